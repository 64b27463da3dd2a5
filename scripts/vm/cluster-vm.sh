#!/usr/bin/env bash
# Two simulated hosts, each a throw-away qemu VM with two Soft-RoCE rails, joined by network
# links that never leave this machine; runs one command on each.
#
#   scripts/vm/cluster-vm.sh STAGE_DIR 'command on host 1' 'command on host 2'
#   scripts/vm/cluster-vm.sh --selftest
#
# Each host (N = 1 or 2) has three virtio NICs, found by MAC (52:54:00:00:0N:0K, K = 0, 1, 2) and
# renamed (there is no udev; the kernel names them ethK):
#   mgmt   198.18.0.N/24   the bootstrap / out-of-band link (NCCL_SOCKET_IFNAME=mgmt)
#   raila  198.18.1.N/24   with Soft-RoCE rxe0 (GID index 1 = ::ffff:198.18.1.N)
#   railb  198.18.2.N/24   with Soft-RoCE rxe1 (GID index 1 = ::ffff:198.18.2.N)
# Both rxe ports are ACTIVE, and both hosts are up, before either command starts. STAGE_DIR is
# copied to /opt/work on both hosts, the commands' working directory. Each command runs under
# bash as root with `ulimit -l unlimited`, `lo` up, sch_netem loaded and this environment:
#   CLUSTER_HOST_ID      1 or 2
#   CLUSTER_PEER_MGMT    the other host's mgmt address (198.18.0.P); also CLUSTER_PEER_RAILA
#                        and CLUSTER_PEER_RAILB (198.18.1.P, 198.18.2.P)
#   NCCL_SOCKET_IFNAME   mgmt
# Faults a command can inject on its own host: `tc qdisc add dev raila root netem loss 1%`
# (delay, reorder, corrupt: any netem), `ip link set raila down` (rxe0's port goes DOWN; up
# again, ACTIVE), and `cluster-vanish`: the host vanishes at once, as if it lost power (no FIN,
# no RST: sysrq o). A host that vanished counts as success ("vanished (as asked)"); the other
# keeps running.
#
# Output: both commands' output (stdout and stderr, not the kernels' consoles) is streamed here
# as it comes, each line prefixed `[h1] ` or `[h2] `; the run directory (named at the start)
# keeps h1/ and h2/ with output.log, console.log and status.log. The last line is
#   cluster-vm: host 1 exit=X, host 2 exit=Y (T s)
# and the exit code is 0 iff both commands exited 0 (or vanished as asked), else the first
# failing command's exit code (host 1's if both failed). When one command fails, the other
# host is stopped CLUSTER_VM_GRACE seconds later if it has not ended by then. This script's own
# failures are a `cluster-vm: error: ...` line (naming the host, and the device when a NIC or
# rxe port did not come up) and exit code 124 (the time limit) or 125 (anything else: missing
# tool, a VM did not boot or died, ...); a VM that dies stops the other at once.
#
# --selftest: boots the pair with an empty stage and checks, one PASS/FAIL line each: the
# environment on both hosts; ib_write_bw (64 KiB messages, host 2 -> host 1) on rxe0 and on
# rxe1; the same on rxe0 with `netem loss 5%` on host 2's raila; `ip link set railb down` on
# host 2 (rxe1's port DOWN) and up again (ACTIVE, ib_write_bw works); last, host 2 vanishes
# while host 1 holds a TCP connection to it, which must see neither FIN nor RST. Ends with
# `cluster-vm: selftest: PASS` (exit 0) or `FAIL` (exit non-zero).
#
# How (see /work/shared/softroce/README.md for the facts this relies on):
# - The VMs are rxe-vm.sh's (scripts/vm/vm-lib.sh: the same cached rootfs as an initramfs, PID 1,
#   channels and qemu flags): Debian's stock kernel under TCG, -smp 1 each (2 host cores), with
#   the whole run's initramfs built once and booted by both. Two VMs because rxe on kernel 6.1
#   works in the initial network namespace only, and two rxe devices in one namespace do not
#   talk: this is the only way to get RoCE between two kernels here.
# - Links: qemu `socket` netdevs, TCP on 127.0.0.1 only: host 1's qemu listens on three free
#   ports (retried when taken), host 2's connects. TCP gives backpressure, so the links lose
#   nothing by themselves; the only loss is what a command asks netem for. When a host vanishes,
#   its peer's qemu drops what it sends there: the peer's link stays up, nothing answers.
# - Each VM has a fourth channel, a virtio port `ctl` (a fifo here): a host marks `up` when its
#   NICs and rxe ports are, then waits there for this script's `go`, sent once both are up.
# - Measured on the 2-core build machine (load ~1): both hosts up 12-14 s after start (the
#   initramfs ~141 MiB, built once per run); a trivial run ~14 s in all, --selftest ~43 s.
#   ib_write_bw 64 KiB host 2 -> host 1: 15-18 MB/s on rxe0 and on rxe1 (each VM one emulated
#   CPU); with netem loss 5% on the sender's rail 0.35-0.4 MB/s (it completes: RC retransmits,
#   and rxe's go-back-N sends ~6.6 packets per packet delivered); rxe1's port DOWN within 0.05 s
#   of `ip link set railb down`, ACTIVE as fast after `up`, and carries traffic again. Numbers
#   under TCG are emulated and fall when other builds share the cores: compare only ratios
#   from the same run.
#
# Environment:
#   CLUSTER_VM_TIMEOUT       seconds the whole run may take, from the first VM's start, boot
#                            included (default 600; the rootfs build, once, is not counted)
#   CLUSTER_VM_BOOT_TIMEOUT  seconds until both hosts must be up (default 240)
#   CLUSTER_VM_GRACE         seconds the other host may go on after a command failed (default 30)
#   CLUSTER_VM_MEM           guest memory per VM in MiB (default 1536; the rootfs, ~135 MiB, and
#                            the stage live in it)
#   RXE_VM_CACHE, RXE_VM_MIRROR, RXE_VM_SUITE   the rootfs, shared with scripts/vm/rxe-vm.sh
set -Eeuo pipefail

prog=cluster-vm
# shellcheck source=scripts/vm/vm-lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/vm-lib.sh"

# ------------------------------------------------------------------------------------------
# The self-test's two commands (bash, in the guests). Data is small: a few MiB per check.

read -r -d '' selftest_common <<'EOS' || true
h=$CLUSTER_HOST_ID p=$((3 - CLUSTER_HOST_ID)) fails=0
pass() { echo "selftest: PASS $*"; }
fail() { echo "selftest: FAIL $*"; fails=$((fails + 1)); }
port_state() { local s; { read -r _ s <"/sys/class/infiniband/$1/ports/1/state"; } 2>/dev/null && echo "$s" || echo none; }
secs_since() { local us=$((${EPOCHREALTIME/./} - ${1/./})); printf '%d.%02d\n' $((us / 1000000)) $((us / 10000 % 100)); }
got="$CLUSTER_PEER_MGMT $NCCL_SOCKET_IFNAME $PWD $(ulimit -l) $(id -u)"
want="198.18.0.$p mgmt /opt/work unlimited 0"
if [[ $got == "$want" ]]; then pass "host $h: environment (peer, NCCL_SOCKET_IFNAME, cwd, ulimit -l, uid: $want)"
else fail "host $h: environment: got '$got', want '$want'"; fi
bad=
for k in 0 1 2; do
  nic=$(case $k in 0) echo mgmt ;; 1) echo raila ;; 2) echo railb ;; esac)
  ip -4 -o addr show dev "$nic" 2>/dev/null | grep -q "inet 198.18.$k.$h/24 " || bad+=" $nic:no-198.18.$k.$h"
done
for r in rxe0:raila rxe1:railb; do
  [[ $(port_state "${r%:*}") == ACTIVE ]] || bad+=" ${r%:*}:$(port_state "${r%:*}")"
  rdma link show "${r%:*}/1" 2>/dev/null | grep -q "netdev ${r#*:}" || bad+=" ${r%:*}:not-on-${r#*:}"
done
grep -q '^sch_netem ' /proc/modules || bad+=" sch_netem:not-loaded"
if [[ -z $bad ]]; then pass "host $h: mgmt/raila/railb 198.18.{0,1,2}.$h, rxe0 on raila and rxe1 on railb ACTIVE, sch_netem"
else fail "host $h: devices:$bad"; fi
EOS

read -r -d '' selftest_h1 <<'EOS' || true
# Host 1: the ib_write_bw servers, one per check of host 2's (each its own port), then the
# vanish check.
srv() { timeout 240 ib_write_bw -d "$2" -x 1 -s 65536 -n "$3" -p "$1" >"/tmp/srv-$1.log" 2>&1; }
srv 18515 rxe0 100 & s1=$!
srv 18516 rxe1 100 & s2=$!
srv 18517 rxe0 40 & s3=$!
srv 18518 rxe1 100 & s4=$!
for s in "$s1 18515 rxe0" "$s2 18516 rxe1" "$s3 18517 rxe0-loss" "$s4 18518 rxe1-after-up"; do
  read -r pid port what <<<"$s"
  if wait "$pid"; then pass "host 1: ib_write_bw server $what (port $port) done"
  else fail "host 1: ib_write_bw server $what (port $port): $(tail -n 2 "/tmp/srv-$port.log" | tr '\n' ' ')"; fi
done
# Host 2 ends by vanishing while this host holds a TCP connection to it (a listening
# ib_write_bw there, which sends nothing before the client does): no FIN, no RST may come,
# and afterwards host 2 answers nothing.
connected=0
for ((i = 0; i < 120; i++)); do
  if exec 3<>/dev/tcp/198.18.0.2/18600; then connected=1; break; fi 2>/dev/null
  sleep 0.5
done
if ((connected)); then
  t=$EPOCHREALTIME
  rc=0
  read -r -t 8 -u 3 _ || rc=$?
  quiet=$(secs_since "$t")
  if ((rc > 128)); then
    err=$(timeout 3 bash -c 'exec 4<>/dev/tcp/198.18.0.2/18600' 2>&1) && rc=0 || rc=$?
    if ((rc == 0)); then fail "host 2 still accepts connections after it should have vanished"
    elif [[ $err == *refused* ]]; then fail "host 2 answered with a RST after it should have vanished"
    else pass "host 2 vanished: an open connection saw no FIN/RST in $quiet s, a new one gets no answer"; fi
  else
    fail "the connection to host 2 ended or got data (read exit $rc: FIN or RST?)"
  fi
else
  fail "host 1 could not connect to host 2 (port 18600) for the vanish check"
fi
exit $((fails > 0))
EOS

read -r -d '' selftest_h2 <<'EOS' || true
# Host 2: the clients and the faults.
bw() { # NAME PORT DEV ITERS: retried only while host 1's server is not listening yet
  local name=$1 port=$2 dev=$3 n=$4 t=$EPOCHREALTIME i rc mbs
  for ((i = 0; i < 60; i++)); do
    rc=0
    timeout 180 ib_write_bw -d "$dev" -x 1 -s 65536 -n "$n" -p "$port" 198.18.0.1 >/tmp/bw.log 2>&1 || rc=$?
    grep -q "Couldn't connect" /tmp/bw.log || break
    sleep 1
  done
  mbs=$(awk '$1 == 65536 && NF >= 4 {print $4}' /tmp/bw.log)
  if ((rc == 0)) && [[ -n $mbs ]]; then pass "$name: $mbs MB/s average ($((n * 64)) KiB, $(secs_since "$t") s)"
  else fail "$name: ib_write_bw exit $rc: $(tail -n 3 /tmp/bw.log | tr '\n' ' ')"; fi
}
wait_state() { # DEV STATE TENTHS: the port reaches STATE within TENTHS/10 s
  local i
  for ((i = 0; i < $3; i++)); do
    [[ $(port_state "$1") == "$2" ]] && return 0
    sleep 0.1
  done
  return 1
}
bw "ib_write_bw rxe0 (raila) 64 KiB x100 host 2 -> host 1" 18515 rxe0 100
bw "ib_write_bw rxe1 (railb) 64 KiB x100 host 2 -> host 1" 18516 rxe1 100
if tc qdisc add dev raila root netem loss 5%; then
  bw "ib_write_bw rxe0 with netem loss 5% on host 2's raila, 64 KiB x40" 18517 rxe0 40
  echo "selftest: netem on raila: $(tc -s qdisc show dev raila | grep -o '[0-9]* pkt (dropped [0-9]*' | head -1 | tr -d '(')"
  tc qdisc del dev raila root || fail "tc qdisc del dev raila root"
else
  fail "tc qdisc add dev raila root netem loss 5%"
fi
t=$EPOCHREALTIME
ip link set railb down
if wait_state rxe1 DOWN 100; then pass "rxe1 port DOWN $(secs_since "$t") s after ip link set railb down"
else fail "rxe1 port still $(port_state rxe1) 10 s after ip link set railb down"; fi
t=$EPOCHREALTIME
ip link set railb up
if wait_state rxe1 ACTIVE 100; then pass "rxe1 port ACTIVE $(secs_since "$t") s after ip link set railb up"
else fail "rxe1 port still $(port_state rxe1) 10 s after ip link set railb up"; fi
bw "ib_write_bw rxe1 after railb down and up, 64 KiB x100" 18518 rxe1 100
if ((fails == 0)); then
  timeout 120 ib_write_bw -d rxe0 -x 1 -p 18600 >/dev/null 2>&1 &
  for ((i = 0; i < 600; i++)); do
    if ss -Htn state established '( sport = :18600 )' | grep -q .; then
      echo "selftest: host 2 vanishes now (cluster-vanish), host 1 connected"
      cluster-vanish
    fi
    sleep 0.1
  done
  fail "host 1 did not connect to port 18600 within 60 s for the vanish check"
fi
exit 1
EOS

# ------------------------------------------------------------------------------------------
# Arguments and settings.

selftest=0
if [[ ${1:-} == --selftest ]]; then
  [[ $# -eq 1 ]] || die "--selftest takes no arguments"
  selftest=1
  stage=
  cmd1="$selftest_common"$'\n'"$selftest_h1"
  cmd2="$selftest_common"$'\n'"$selftest_h2"
else
  vm_args 3 "STAGE_DIR 'command on host 1' 'command on host 2'" "$@"
  cmd1=$2
  cmd2=$3
fi

timeout_s=${CLUSTER_VM_TIMEOUT:-600}
boot_s=${CLUSTER_VM_BOOT_TIMEOUT:-240}
grace_s=${CLUSTER_VM_GRACE:-30}
mem=${CLUSTER_VM_MEM:-1536}
positive() { [[ $2 =~ ^[0-9]+$ && $2 -gt 0 ]] || die "$1 must be a positive number, not '$2'"; }
positive CLUSTER_VM_TIMEOUT "$timeout_s"
positive CLUSTER_VM_BOOT_TIMEOUT "$boot_s"
positive CLUSTER_VM_GRACE "$grace_s"
positive CLUSTER_VM_MEM "$mem"

vm_prepare_host
vm_rootfs

# ------------------------------------------------------------------------------------------
# The run directory: the shared initramfs (removed at the end) and each host's logs (kept).

runs=${TMPDIR:-/tmp}
run=$(mktemp -d "$runs/cluster-vm.XXXXXX")
[[ -n $stage ]] || stage=$(mkdir -p "$run/empty" && echo "$run/empty")
vm_check_room "$runs" "$stage" "$mem" CLUSTER_VM_MEM
mkdir -p "$run/h1" "$run/h2"

declare -a qpid=() spid=() state=() result=() why=() stop_at=() kill_at=() up_at=()
state=([1]=new [2]=new)
err=
errcode=0
t0=$SECONDS

# shellcheck disable=SC2317 # called by the EXIT trap
cleanup() {
  local rc=$? h
  trap - ERR
  for h in 1 2; do
    if [[ ${state[h]} == run || ${state[h]} == stop ]]; then kill "${qpid[h]}" 2>/dev/null || true; fi
  done
  for h in 1 2; do
    if [[ ${state[h]} == run || ${state[h]} == stop ]]; then wait "${qpid[h]}" 2>/dev/null || true; fi
    if [[ -n ${spid[h]:-} ]]; then kill "${spid[h]}" 2>/dev/null || true; fi
  done
  rm -rf "$run/stage" "$run/stage.cpio" "$run/initrd.cpio" "$run/empty"
  exit "$rc"
}
vm_on_exit cleanup

# ------------------------------------------------------------------------------------------
# The initramfs both hosts boot: rootfs, PID 1, the stage, the setup, both commands, and
# cluster-vanish. The host id comes from the kernel command line (vm.host=N).

vm_stage_begin "$run" "$stage"
{
  echo "go_wait=$((timeout_s + 60))"
  cat <<'SETUP'
# The setup (sh -e, before the command): NICs found by MAC and renamed, addresses, rxe0 and
# rxe1, their ports ACTIVE, the `up` mark; then wait for the runner's `go` on the port "ctl".
h=$1
fail() {
  echo "$*"
  exit 1
}
now() { cut -d. -f1 /proc/uptime; } # waits are bounded in seconds, not in tries (forks are slow)
echo "host$h" >/proc/sys/kernel/hostname
printf '127.0.0.1 localhost\n198.18.0.1 host1\n198.18.0.2 host2\n' >/etc/hosts
ip link set lo up
for m in virtio_net sch_netem rdma_rxe ib_uverbs; do
  modprobe "$m" || fail "modprobe $m failed"
done
# MAC 52:54:00:00:0H:0K: K = 0 mgmt, 1 raila, 2 railb; the address is 198.18.K.H/24.
for k in 0 1 2; do
  case $k in 0) name=mgmt ;; 1) name=raila ;; 2) name=railb ;; esac
  mac=52:54:00:00:0$h:0$k
  dev=
  end=$(($(now) + 10))
  while [ -z "$dev" ]; do
    for p in /sys/class/net/*; do
      if [ "$(cat "$p/address" 2>/dev/null)" = "$mac" ]; then dev=${p##*/}; fi
    done
    if [ -z "$dev" ]; then
      [ "$(now)" -lt $end ] || fail "NIC $name (MAC $mac) did not appear within 10 s (NICs: $(ls /sys/class/net | tr '\n' ' '))"
      sleep 0.1
    fi
  done
  if [ "$dev" != "$name" ]; then
    ip link set "$dev" name "$name" || fail "NIC $name: renaming $dev (MAC $mac) failed"
  fi
  ip addr add "198.18.$k.$h/24" dev "$name" || fail "NIC $name: adding 198.18.$k.$h/24 failed"
  ip link set "$name" up || fail "NIC $name: ip link set up failed"
done
rdma link add rxe0 type rxe netdev raila || fail "rxe0: rdma link add rxe0 type rxe netdev raila failed"
rdma link add rxe1 type rxe netdev railb || fail "rxe1: rdma link add rxe1 type rxe netdev railb failed"
for r in rxe0:raila rxe1:railb; do
  end=$(($(now) + 20))
  until grep -q ACTIVE "/sys/class/infiniband/${r%:*}/ports/1/state" 2>/dev/null; do
    [ "$(now)" -lt $end ] || fail "${r%:*}: port (on ${r#*:}) not ACTIVE within 20 s (state: $(cat "/sys/class/infiniband/${r%:*}/ports/1/state" 2>/dev/null || echo none); $(ip -br link show dev "${r#*:}" 2>&1))"
    sleep 0.1
  done
done
echo "up $(cut -d' ' -f1 /proc/uptime)" >/dev/ttyS2
ctl=
for p in /sys/class/virtio-ports/*; do
  if [ "$(cat "$p/name" 2>/dev/null)" = ctl ]; then ctl=/dev/${p##*/}; fi
done
[ -n "$ctl" ] || fail "ctl: the runner's control port (virtio port ctl) is missing"
go=$(timeout "$go_wait" head -n 1 "$ctl") || true
[ "$go" = go ] || fail "ctl: no go from the runner within $go_wait s"
SETUP
} >"$run/stage/.vm/setup"
cat >"$run/stage/.vm/env" <<'ENV'
peer=$((3 - host))
export CLUSTER_HOST_ID=$host NCCL_SOCKET_IFNAME=mgmt CLUSTER_PEER_MGMT=198.18.0.$peer \
  CLUSTER_PEER_RAILA=198.18.1.$peer CLUSTER_PEER_RAILB=198.18.2.$peer
unset peer
ENV
printf '%s\n' "$cmd1" >"$run/stage/.vm/cmd1"
printf '%s\n' "$cmd2" >"$run/stage/.vm/cmd2"
mkdir -p "$run/stage/usr/local/bin"
cat >"$run/stage/usr/local/bin/cluster-vanish" <<'VANISH'
#!/bin/sh
# This host vanishes at once, as if it lost power: no FIN, no RST, no process ends. The mark
# tells scripts/vm/cluster-vm.sh that it was asked for (it counts as success).
echo "vanished $(cut -d' ' -f1 /proc/uptime)" >/dev/ttyS2
stty -F /dev/ttyS2 raw -echo 2>/dev/null # waits until the mark is out
echo o >/proc/sysrq-trigger
sleep 60
echo "cluster-vanish: the VM did not power off" >&2
exit 1
VANISH
chmod 755 "$run/stage/usr/local/bin" "$run/stage/usr/local/bin/cluster-vanish"
vm_stage_pack "$run"

# ------------------------------------------------------------------------------------------
# Start: host 1's qemu listens on three ports of 127.0.0.1, host 2's connects.

port_hex() { printf '%04X' "$1"; }
port_used() { grep -q "^ *[0-9]*: [0-9A-F]*:$(port_hex "$1") " /proc/net/tcp /proc/net/tcp6 2>/dev/null; }
listening() { awk -v a="0100007F:$(port_hex "$1")" '$2 == a && $4 == "0A" {f = 1} END {exit !f}' /proc/net/tcp; }

start_vm() { # HOST listen|connect BASE_PORT
  local h=$1 d=$run/h$1 k nets=()
  for k in 0 1 2; do
    nets+=(-netdev "socket,id=n$k,$2=127.0.0.1:$(($3 + k))"
      -device "virtio-net-pci,netdev=n$k,mac=52:54:00:00:0$h:0$k,romfile=")
  done
  rm -f "$d/ctl.in" "$d/ctl.out"
  mkfifo "$d/ctl.in" "$d/ctl.out"
  vm_qemu_args "$run/initrd.cpio" "$d" "vm.host=$h"
  # qemu's own limit is a backstop: the loop below stops the VMs in time.
  timeout -k 10 $((timeout_s + 30)) qemu-system-x86_64 "${vm_qemu[@]}" -m "$mem" -smp 1 "${nets[@]}" \
    -chardev "pipe,id=ctl,path=$d/ctl" -device virtserialport,chardev=ctl,name=ctl \
    </dev/null >"$d/qemu.log" 2>&1 &
  qpid[h]=$!
  state[h]=run
  (
    trap - ERR
    tail -n +1 -f --pid="${qpid[h]}" "$d/output.log" | sed -u "s/^/[h$h] /"
  ) &
  spid[h]=$!
}

note "run directory $run (h1/, h2/: output.log, console.log, status.log)"
for attempt in 1 2 3 4 5; do
  for ((i = 0; i < 200; i++)); do # three free ports in a row (a busy machine uses thousands)
    base=$((20000 + RANDOM % 40000))
    port_used "$base" || port_used $((base + 1)) || port_used $((base + 2)) || break
  done
  start_vm 1 listen "$base"
  ok=0
  for ((i = 0; i < 100; i++)); do # 20 s
    if listening "$base" && listening $((base + 1)) && listening $((base + 2)); then
      ok=1
      break
    fi
    kill -0 "${qpid[1]}" 2>/dev/null || break
    sleep 0.2
  done
  ((ok)) && break
  kill "${qpid[1]}" 2>/dev/null || true
  wait "${qpid[1]}" 2>/dev/null || true
  state[1]=new
  wait "${spid[1]}" 2>/dev/null || true
  spid[1]=
  if ! grep -qi 'in use' "$run/h1/qemu.log"; then
    sed 's/^/  qemu: /' "$run/h1/qemu.log" >&2
    die "host 1: qemu did not start listening on 127.0.0.1:$base-$((base + 2)) (log: $run/h1/qemu.log)"
  fi
done
[[ ${state[1]} == run ]] || die "host 1: qemu could not listen on 127.0.0.1 (ports taken) in $attempt tries"
start_vm 2 connect "$base"

# ------------------------------------------------------------------------------------------
# Watch both until both have ended; every wait is bounded.

other() { echo $((3 - $1)); }
marked() { grep -q "^$2\\b" "$run/h$1/status.log" 2>/dev/null; }
where() { # HOST: how far it got
  if marked "$1" up; then echo "running the command"
  elif marked "$1" booted; then echo "after boot, before its NICs and rxe ports were up"
  else echo "before it booted"; fi
}
stop_vm() { # HOST WHY
  kill -TERM "${qpid[$1]}" 2>/dev/null || true
  state[$1]=stop
  why[$1]=$2
  kill_at[$1]=$((SECONDS + 15))
}
fail_run() { # CODE MESSAGE WHY: the first failure is the one reported; running hosts are stopped
  local h
  if [[ -z $err ]]; then
    err=$2
    errcode=$1
  fi
  for h in 1 2; do
    if [[ ${state[h]} == run ]]; then stop_vm "$h" "$3"; fi
  done
}
reap() { # HOST: its qemu has exited
  local h=$1 o qrc=0 code d=$run/h$1 was=${state[$1]} elapsed reason
  o=$(other "$h")
  wait "${qpid[h]}" || qrc=$?
  state[h]=ended
  elapsed=$((SECONDS - t0))
  code=$(vm_exit_code "$d")
  if [[ -n $code ]]; then
    result[h]=$code
    if [[ $code != 0 && ${state[o]} == run && -z ${stop_at[o]:-} ]]; then
      stop_at[o]=$((SECONDS + grace_s))
      why[o]="$grace_s s after host $h's command failed"
    fi
  elif marked "$h" vanished; then
    result[h]="vanished (as asked)"
  elif [[ $was == stop ]]; then
    result[h]="stopped (${why[h]})"
  elif reason=$(vm_setup_failed "$d"); then
    result[h]="none (setup failed)"
    fail_run "$ERR_RUNNER" "host $h: setup failed: $reason" "host $h's setup failed"
  else
    result[h]="none (the VM ended)"
    [[ -s $d/qemu.log ]] && sed 's/^/  qemu: /' "$d/qemu.log" >&2
    vm_show_console "$d" "$elapsed" "host $h"
    if [[ $qrc -eq 124 || $qrc -eq 137 ]]; then
      fail_run "$ERR_TIMEOUT" "host $h: qemu's own time limit hit ($(where "$h"))" "time limit"
    elif ! marked "$h" booted; then
      fail_run "$ERR_RUNNER" "host $h: the VM did not boot (qemu exit code $qrc after $elapsed s; console log: $d/console.log)" \
        "host $h did not boot"
    else
      fail_run "$ERR_RUNNER" "host $h: the VM stopped after $elapsed s $(where "$h") without reporting the command's exit code (crash? out of memory? CLUSTER_VM_MEM=$mem; console log: $d/console.log)" \
        "host $h died"
    fi
  fi
}
send_go() { # HOST: the fifo is open for reading in qemu; O_RDWR never blocks
  local fd
  exec {fd}<>"$run/h$1/ctl.in"
  echo go >&"$fd"
  exec {fd}>&-
}

go_sent=0
while [[ ${state[1]} != ended || ${state[2]} != ended ]]; do
  for h in 1 2; do
    if [[ ${state[h]} != ended ]] && ! kill -0 "${qpid[h]}" 2>/dev/null; then reap "$h"; fi
  done
  now=$SECONDS
  for h in 1 2; do
    if [[ -z ${up_at[h]:-} ]] && marked "$h" up; then up_at[h]=$((now - t0)); fi
  done
  if ((!go_sent)) && [[ -n ${up_at[1]:-} && -n ${up_at[2]:-} && ${state[1]} == run && ${state[2]} == run ]]; then
    send_go 1
    send_go 2
    go_sent=1
    note "both hosts up after $((now - t0)) s (host 1 ${up_at[1]} s, host 2 ${up_at[2]} s); running the commands"
  fi
  if ((!go_sent)) && [[ -z $err ]] && ((now - t0 >= boot_s)); then
    for h in 1 2; do
      if [[ -z ${up_at[h]:-} && ${state[h]} == run ]]; then
        vm_show_console "$run/h$h" "$((now - t0))" "host $h"
        fail_run "$ERR_RUNNER" "host $h: not up after $boot_s s ($(where "$h"); CLUSTER_VM_BOOT_TIMEOUT)" \
          "host $h was not up in time"
      fi
    done
  fi
  if [[ -z $err ]] && ((now - t0 >= timeout_s)); then
    fail_run "$ERR_TIMEOUT" "timed out after $timeout_s s (host 1: ${result[1]:-$(where 1)}; host 2: ${result[2]:-$(where 2)}; CLUSTER_VM_TIMEOUT)" \
      "time limit"
  fi
  for h in 1 2; do
    if [[ ${state[h]} == run && -n ${stop_at[h]:-} ]] && ((now >= stop_at[h])); then
      stop_vm "$h" "${why[h]}"
    fi
    if [[ ${state[h]} == stop ]] && ((now >= kill_at[h])); then
      pkill -KILL -P "${qpid[h]}" 2>/dev/null || true
      kill -KILL "${qpid[h]}" 2>/dev/null || true
      kill_at[h]=$((now + 5))
    fi
  done
  sleep 0.5
done
elapsed=$((SECONDS - t0))

# The output streams end within a second or two of their VM (tail --pid); bounded anyway.
for h in 1 2; do
  for ((i = 0; i < 50; i++)); do
    kill -0 "${spid[h]}" 2>/dev/null || break
    sleep 0.1
  done
  kill "${spid[h]}" 2>/dev/null || true
  wait "${spid[h]}" 2>/dev/null || true
  spid[h]=
  # a last line without its newline must not run into what follows
  if [[ -s $run/h$h/output.log && $(tail -c 1 "$run/h$h/output.log" | od -An -c | tr -d ' ') != '\n' ]]; then echo; fi
done

rc=0
if [[ -n $err ]]; then
  echo "$prog: error: $err" >&2
  rc=$errcode
else
  for h in 1 2; do
    case ${result[h]} in
      0 | "vanished (as asked)") ;;
      [0-9]*) ((rc)) || rc=${result[h]} ;;
      *) ((rc)) || rc=1 ;;
    esac
  done
fi
if ((selftest)); then
  if [[ -z $err && ${result[1]} == 0 && ${result[2]} == "vanished (as asked)" ]]; then
    echo "$prog: selftest: PASS"
  else
    echo "$prog: selftest: FAIL (host 1 must exit 0 and host 2 vanish; see the FAIL lines above)"
    ((rc)) || rc=1
  fi
fi
echo "$prog: host 1 exit=${result[1]}, host 2 exit=${result[2]} ($elapsed s)"
exit "$rc"
