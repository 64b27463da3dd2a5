#!/usr/bin/env bash
# Runs a command against a real Soft-RoCE device (rdma_rxe, `rxe0`) inside a throw-away qemu VM.
#
#   scripts/rxe-vm.sh STAGE_DIR 'command'
#
# STAGE_DIR is copied to /opt/work in the VM, which is also the command's working directory.
# The command runs under bash as root, with `ulimit -l unlimited`, `lo` up, NCCL_SOCKET_IFNAME=lo
# and rxe0 on a dummy netdev (198.18.0.1/24; GID index 1 = ::ffff:198.18.0.1). Its output
# (stdout and stderr, not the kernel's console) is streamed here, and this script exits with
# the command's exit code. Its own failures are an `rxe-vm: error:` line and exit code 124
# (the VM ran past its time limit) or 125 (anything else: missing tool, VM did not boot, ...).
#
# How (see /work/shared/softroce/README.md for the facts this relies on):
# - Debian's stock kernel (linux-image-amd64 on the host) under qemu TCG (-accel tcg; KVM cannot
#   boot a stock kernel on the build machines), -smp 2, no network link at all (-nic none).
# - Clock source TSC (clocksource=tsc tsc=reliable): left alone, the guest kernel picks hpet,
#   whose every read is an emulated device access (~1.1 us measured), so each clock_gettime
#   costs 50x what it costs on real hardware; under TCG the guest TSC is the host's invariant
#   TSC, which perftest reads directly anyway. Benchmarks then time the plugin, not the clock.
# - No disk and no initrd of Debian's: the whole root file system is an initramfs. A minbase
#   Debian rootfs with the RDMA packages and just the kernel modules rxe needs is built once with
#   debootstrap and cached as an uncompressed cpio archive; each run appends a small cpio of the
#   stage and boots straight into /init (our PID 1). Measured on 2 busy cores: rxe0 up ~7 s
#   after start, ~13 s per trivial run in all, vs ~30 s for an ext4 disk image rebuilt per run
#   plus Debian's initrd (the reference recipe): no image to write, no udev, no ext4 module.
#   The rootfs build (debootstrap) takes 35-50 s; the cached cpio is ~135 MiB.
# - Separate channels: ttyS0 the kernel console (console.log, shown only on failure); a
#   virtio-serial port the command's output (output.log, streamed here; ttyS1 as a fallback,
#   whose ~200 KB/s would make a verbose log slow); ttyS2 this script's markers (booted, rxe0
#   up, exit code), so neither kernel noise nor the command's output can fake or hide them.
#
# Environment:
#   RXE_VM_CACHE    cache directory (default $HOME/.cache/nccl-net-erdma/rxe-vm)
#   RXE_VM_TIMEOUT  seconds the VM may run, boot included (default 600)
#   RXE_VM_MEM      guest memory in MiB (default 3072; the rootfs and the stage live in it)
#   RXE_VM_SMP      guest CPUs (default 2)
#   RXE_VM_MIRROR   Debian mirror for debootstrap (default: the host's apt source)
#   RXE_VM_SUITE    Debian suite of the rootfs (default: the host's, else bookworm)
#   RXE_VM_KEEP=1   keep the run directory (logs, initramfs) even on success
set -Eeuo pipefail

prog=rxe-vm
ERR_TIMEOUT=124
ERR_RUNNER=125
# Nothing fails silently: an unexpected failure names its line and command.
trap 'rc=$?; echo "$prog: error: line $LINENO: \`$BASH_COMMAND\` failed (exit $rc)" >&2; exit "$ERR_RUNNER"' ERR

die() {
  echo "$prog: error: $*" >&2
  exit "$ERR_RUNNER"
}
note() { echo "$prog: $*" >&2; }

usage() {
  sed -n '2,/^set -/{/^set -/d;s/^# \{0,1\}//;p}' "$0"
}

if [[ ${1:-} == -h || ${1:-} == --help ]]; then
  usage
  exit 0
fi
[[ $# -eq 2 ]] || {
  usage >&2
  die "expected 2 arguments (STAGE_DIR 'command'), got $#"
}
[[ -d $1 ]] || die "stage directory '$1' does not exist"
stage=$(realpath "$1")
cmd=$2

timeout_s=${RXE_VM_TIMEOUT:-600}
mem=${RXE_VM_MEM:-3072}
smp=${RXE_VM_SMP:-2}
cache=${RXE_VM_CACHE:-$HOME/.cache/nccl-net-erdma/rxe-vm}
[[ $timeout_s =~ ^[0-9]+$ && $timeout_s -gt 0 ]] || die "RXE_VM_TIMEOUT must be a positive number of seconds, not '$timeout_s'"
[[ $mem =~ ^[0-9]+$ ]] || die "RXE_VM_MEM must be MiB, not '$mem'"
[[ $smp =~ ^[0-9]+$ ]] || die "RXE_VM_SMP must be a number, not '$smp'"

# ------------------------------------------------------------------------------------------
# Privileges: debootstrap and reading the rootfs need root. Use sudo -n when not root.

if [[ $(id -u) -eq 0 ]]; then
  as_root() { "$@"; }
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  as_root() { sudo -n "$@"; }
else
  as_root() { return 1; }
  need_root() { die "$1 needs root or password-less sudo; run this once as root (later runs with the cache in place need neither)"; }
fi
command -v need_root >/dev/null || need_root() { :; }

# ------------------------------------------------------------------------------------------
# Host packages: install what is missing (apt-get update only then).

host_pkgs=(qemu-system-x86 debootstrap linux-image-amd64 cpio kmod coreutils util-linux)
missing=()
for p in "${host_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [[ ${#missing[@]} -gt 0 ]]; then
  command -v apt-get >/dev/null || die "missing host packages ${missing[*]} and no apt-get to install them (this needs Debian)"
  need_root "installing ${missing[*]}"
  note "installing host packages: ${missing[*]}"
  aptlog=$(mktemp)
  if ! { as_root apt-get update -qq && as_root env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq --no-install-recommends "${missing[@]}"; } >"$aptlog" 2>&1; then
    tail -n 20 "$aptlog" >&2
    die "apt-get install ${missing[*]} failed (log: $aptlog)"
  fi
  rm -f "$aptlog"
fi
for t in qemu-system-x86_64 debootstrap cpio depmod modprobe flock timeout sha256sum; do
  command -v "$t" >/dev/null 2>&1 || PATH=$PATH:/usr/sbin:/sbin
  command -v "$t" >/dev/null 2>&1 || die "'$t' not found even after installing ${host_pkgs[*]}"
done

# The kernel: the one linux-image-amd64 currently points at (not whatever else is installed).
kpkg=$(dpkg-query -W -f='${Depends}' linux-image-amd64 | grep -oE 'linux-image-[^ ,]+' | head -1) ||
  die "cannot tell which kernel linux-image-amd64 depends on"
kver=${kpkg#linux-image-}
kpkg_version=$(dpkg-query -W -f='${Version}' "$kpkg" 2>/dev/null) || die "$kpkg is not installed"
vmlinuz=/boot/vmlinuz-$kver
moddir=/lib/modules/$kver
[[ -e $vmlinuz ]] || die "kernel $vmlinuz missing (is $kpkg installed properly?)"
[[ -d $moddir ]] || die "kernel modules $moddir missing (is $kpkg installed properly?)"

# ------------------------------------------------------------------------------------------
# The rootfs recipe. Everything that goes into the cached rootfs is named here and hashed into
# the cache key, so a change to any of it (packages, kernel, modules, init) rebuilds it.

suite=${RXE_VM_SUITE:-$(sed -n 's/^VERSION_CODENAME=//p' /etc/os-release 2>/dev/null || true)}
suite=${suite:-bookworm}
# binutils: the conformance suite checks the .so's NEEDED entries and exports with readelf/nm.
guest_pkgs=(rdma-core ibverbs-providers ibverbs-utils perftest libibverbs1 librdmacm1 iproute2 kmod procps
  binutils)
# Modules rxe0 needs, resolved with their dependencies from the host's module tree, plus the
# crc32 crypto that rdma_rxe asks for at runtime (without it `rdma link add` fails, ENOENT).
# virtio_pci/virtio_console carry the command's output (~100x faster than a serial port).
guest_mods=(rdma_rxe ib_uverbs rdma_ucm dummy crypto-crc32 virtio_pci virtio_console)

# PID 1 in the VM. Writes its progress to ttyS2, runs /.rxe-vm/cmd with output to ttyS1.
read -r -d '' init_script <<'INIT' || true
#!/bin/sh
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 TERM=dumb
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /run
stty -F /dev/ttyS1 raw -echo
stty -F /dev/ttyS2 raw -echo
mark() { echo "$*" >/dev/ttyS2; }
finish() {
  # Drain the serial ports (stty waits for pending output), then power off (qemu exits).
  # A virtio port needs no drain: under TCG qemu writes out each buffer as it is queued.
  stty -F /dev/ttyS1 raw -echo; stty -F /dev/ttyS2 raw -echo
  echo o >/proc/sysrq-trigger
  sleep 30
  exit "$1" # not reached; if it were, PID 1 exiting panics and panic=-1 -no-reboot ends qemu
}
mark "booted $(cut -d' ' -f1 /proc/uptime)"
# The command's output: the virtio port named "out" if it shows up, else ttyS1 (slow but sure).
out=/dev/ttyS1
modprobe virtio_pci 2>/dev/null && modprobe virtio_console 2>/dev/null
for i in 1 2 3 4 5 6 7 8 9 10; do
  for p in /sys/class/virtio-ports/*; do
    [ "$(cat "$p/name" 2>/dev/null)" = out ] && [ -c "/dev/${p##*/}" ] && out=/dev/${p##*/}
  done
  [ "$out" != /dev/ttyS1 ] && break
  sleep 0.1
done
mark "output $out"
echo rxe-vm >/proc/sys/kernel/hostname
ulimit -l unlimited
sh -e >/tmp/rxe-setup.log 2>&1 <<'SETUP' || {
  ip link set lo up
  modprobe dummy
  ip link show dummy0 >/dev/null 2>&1 || ip link add dummy0 type dummy
  ip addr add 198.18.0.1/24 dev dummy0
  ip link set dummy0 up
  modprobe rdma_rxe
  modprobe ib_uverbs
  rdma link add rxe0 type rxe netdev dummy0
  n=0
  until [ -e /sys/class/infiniband/rxe0/ports/1/state ] && grep -q ACTIVE /sys/class/infiniband/rxe0/ports/1/state; do
    n=$((n + 1)); [ $n -le 50 ] || { echo "rxe0 port never became ACTIVE"; exit 1; }
    sleep 0.1
  done
SETUP
  mark "setup-failed"
  cat /tmp/rxe-setup.log >/dev/ttyS2
  finish 1
}
mark "rxe0-up $(cut -d' ' -f1 /proc/uptime)"
export NCCL_SOCKET_IFNAME=lo
cd /opt/work
bash /.rxe-vm/cmd </dev/null >"$out" 2>&1
rc=$?
mark "exit=$rc $(cut -d' ' -f1 /proc/uptime)"
finish "$rc"
INIT

layout=4 # bump when the build steps below change in a way the hash would not see
key=$(printf '%s\n' "layout=$layout" "suite=$suite" "kernel=$kpkg=$kpkg_version" \
  "pkgs=${guest_pkgs[*]}" "mods=${guest_mods[*]}" "$init_script" | sha256sum | cut -c1-16)
rootdir=$cache/$key # exists only when complete: it is renamed into place as the last step

free_mib() { df -Pm "$1" | awk 'NR==2 {print $4}'; }

build_rootfs() {
  local mirror build tree log
  mirror=${RXE_VM_MIRROR:-$({
    grep -hE '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}'
    grep -hoE '^deb +(\[[^]]*\] +)?https?://[^ ]+' /etc/apt/sources.list 2>/dev/null | awk '{print $NF}'
  } | grep -v -e security -e '^$' | head -1 || true)}
  mirror=${mirror:-http://deb.debian.org/debian}
  need_root "building the VM rootfs (debootstrap)"
  [[ $(free_mib "$cache") -ge 800 ]] ||
    die "need 800 MiB free in $cache to build the rootfs, have $(free_mib "$cache") MiB"
  build=$(mktemp -d "$cache/.build.$key.XXXXXX")
  tree=$build/tree
  log=$build/debootstrap.log
  note "building the VM rootfs ($suite from $mirror, kernel $kver) in $cache; log: $log"
  local t0=$SECONDS
  local inc
  inc=$(IFS=,; echo "${guest_pkgs[*]}")
  as_root timeout 900 debootstrap --variant=minbase --include="$inc" "$suite" "$tree" "$mirror" \
    >"$log" 2>&1 || {
    tail -n 20 "$log" >&2
    die "debootstrap of the VM rootfs failed (full log: $log)"
  }
  # Modules: each one's dependency closure, copied at its own path, then depmod.
  local mods
  mapfile -t mods < <(for m in "${guest_mods[@]}"; do modprobe -S "$kver" -d / --show-depends "$m"; done |
    awk '$1 == "insmod" {print $2}' | sort -u)
  [[ ${#mods[@]} -gt 0 ]] || die "no modules found for ${guest_mods[*]} in $moddir"
  # shellcheck disable=SC2016 # expanded by the inner shell, from its arguments
  as_root sh -ec '
    tree=$1 kver=$2 init=$3; shift 3
    rm -rf "$tree/var/cache/apt/"* "$tree/var/lib/apt/lists/"* "$tree/usr/share/doc" \
      "$tree/usr/share/man" "$tree/usr/share/info" "$tree/usr/share/locale" "$tree/debootstrap"
    for m in "$@"; do mkdir -p "$tree${m%/*}"; cp "$m" "$tree$m"; done
    for f in modules.order modules.builtin modules.builtin.modinfo; do
      cp "/lib/modules/$kver/$f" "$tree/lib/modules/$kver/"
    done
    depmod -b "$tree" "$kver"
    printf "127.0.0.1 localhost\n198.18.0.1 rxe-vm\n" >"$tree/etc/hosts"
    echo rxe-vm >"$tree/etc/hostname"
    printf "%s\n" "$init" >"$tree/init"
    chmod 755 "$tree/init"
    mkdir -p "$tree/opt/work"
  ' sh "$tree" "$kver" "$init_script" "${mods[@]}" || die "preparing the rootfs failed"
  # The archive is written by this user; reading the tree needs root.
  (cd "$tree" && as_root find . -xdev -print0 | as_root cpio --null -o -H newc -R 0:0 --quiet) \
    >"$build/rootfs.cpio" || die "packing the rootfs into cpio failed"
  cp "$vmlinuz" "$build/vmlinuz" 2>/dev/null || as_root cat "$vmlinuz" >"$build/vmlinuz"
  as_root rm -rf "$tree"
  printf 'suite=%s\nmirror=%s\nkernel=%s %s\npackages=%s\nbuilt=%s\n' "$suite" "$mirror" \
    "$kpkg" "$kpkg_version" "${guest_pkgs[*]}" "$(date -u +%FT%TZ)" >"$build/manifest"
  chmod 755 "$build"
  mv "$build" "$rootdir"
  note "rootfs ready in $((SECONDS - t0)) s ($(du -sm "$rootdir/rootfs.cpio" | cut -f1) MiB)"
}

mkdir -p "$cache"
exec 9>"$cache/.lock"
if [[ ! -d $rootdir ]]; then
  flock 9 # one builder at a time; whoever waited finds it built
  if [[ ! -d $rootdir ]]; then
    # Leftovers of interrupted builds and rootfs of other recipes are never reused: drop them.
    for old in "$cache"/.build.* "$cache"/*/; do
      [[ -e $old ]] || continue
      old=${old%/}
      [[ $old == "$rootdir" ]] || rm -rf "$old" 2>/dev/null || as_root rm -rf "$old" ||
        die "cannot remove the stale $old"
    done
    build_rootfs
  fi
fi
exec 9>&-   # a running VM holds no lock: the cached files are only read

# ------------------------------------------------------------------------------------------
# One run: stage cpio appended to the rootfs cpio, boot, stream the output, report.

runs=${TMPDIR:-/tmp}
stage_mib=$(du -sm "$stage" | cut -f1)
root_mib=$(du -sm "$rootdir/rootfs.cpio" | cut -f1)
need_mib=$((root_mib + 2 * stage_mib + 16))
[[ $(free_mib "$runs") -ge $need_mib ]] ||
  die "need $need_mib MiB free in $runs for this run, have $(free_mib "$runs") MiB"
[[ $mem -ge $((root_mib + stage_mib + 512)) ]] ||
  die "RXE_VM_MEM=$mem MiB is too small for a $root_mib MiB rootfs plus a $stage_mib MiB stage (need >= $((root_mib + stage_mib + 512)))"

run=$(mktemp -d "$runs/rxe-vm.XXXXXX")
qpid=
tpid=
# shellcheck disable=SC2317 # called by the EXIT trap
cleanup() {
  local rc=$?
  trap - ERR
  if [[ -n $tpid ]]; then kill "$tpid" 2>/dev/null || true; fi
  if [[ -n $qpid ]]; then
    kill "$qpid" 2>/dev/null || true
    wait "$qpid" 2>/dev/null || true
  fi
  rm -rf "$run/stage" "$run/initrd.cpio"
  if [[ $rc -eq 0 && ${RXE_VM_KEEP:-0} != 1 ]] || [[ $rc -ne 0 && $rc -ne $ERR_TIMEOUT && $rc -ne $ERR_RUNNER ]]; then
    rm -rf "$run" # the command's own exit code: its output was shown, nothing to keep
  fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

mkdir -p "$run/stage/opt" "$run/stage/.rxe-vm"
cp -a "$stage" "$run/stage/opt/work"
printf '%s\n' "$cmd" >"$run/stage/.rxe-vm/cmd"
(cd "$run/stage" && find . -print0 | cpio --null -o -H newc -R 0:0 --quiet) >"$run/stage.cpio"
cat "$rootdir/rootfs.cpio" "$run/stage.cpio" >"$run/initrd.cpio"
rm -rf "$run/stage" "$run/stage.cpio"

console=$run/console.log
out=$run/output.log
marks=$run/status.log
: >"$console"
: >"$out"
: >"$marks"

start=$SECONDS
timeout -k 10 "$timeout_s" qemu-system-x86_64 \
  -nodefaults -no-user-config -accel tcg,thread=multi -cpu max -m "$mem" -smp "$smp" \
  -display none -monitor none -no-reboot -nic none \
  -kernel "$rootdir/vmlinuz" -initrd "$run/initrd.cpio" \
  -append "console=ttyS0 quiet panic=-1 rdinit=/init clocksource=tsc tsc=reliable" \
  -serial "file:$console" -serial "file:$out" -serial "file:$marks" \
  -device virtio-serial-pci -chardev "file,id=out,path=$out,append=on" \
  -device virtserialport,chardev=out,name=out \
  </dev/null >"$run/qemu.log" 2>&1 &
qpid=$!
tail -n +1 -f --pid="$qpid" "$out" &
tpid=$!
qrc=0
wait "$qpid" || qrc=$?
qpid=
wait "$tpid" 2>/dev/null || true
tpid=
elapsed=$((SECONDS - start))

show_console() {
  note "VM progress: $(cut -d' ' -f1 "$marks" | tr '\n' ' ')(${elapsed} s)"
  if [[ -s $console ]]; then
    note "last lines of the VM console ($console):"
    tail -n 25 "$console" | sed 's/^/  | /' >&2
  fi
}

code=$(sed -n 's/^exit=\([0-9]\{1,3\}\)\( .*\)\{0,1\}$/\1/p' "$marks" | tail -1)
if [[ -n $code ]]; then
  exit "$code"
fi
if [[ $qrc -eq 124 || $qrc -eq 137 ]]; then
  where="before it booted"
  grep -q '^booted' "$marks" && where="after boot, before rxe0 was up"
  grep -q '^rxe0-up' "$marks" && where="while running the command"
  show_console
  echo "$prog: error: timed out after $timeout_s s ($where); console log: $console" >&2
  exit "$ERR_TIMEOUT"
fi
if grep -q '^setup-failed' "$marks"; then
  sed -n '/^setup-failed/,$p' "$marks" | sed 's/^/  | /' >&2
  die "the VM booted but creating rxe0 failed (see above; console log: $console)"
fi
[[ -s $run/qemu.log ]] && sed 's/^/  qemu: /' "$run/qemu.log" >&2
show_console
if ! grep -q '^booted' "$marks"; then
  die "the VM did not boot (qemu exit code $qrc after $elapsed s); console log: $console"
fi
die "the VM stopped after $elapsed s without reporting the command's exit code (crash? out of memory? RXE_VM_MEM=$mem); console log: $console"
