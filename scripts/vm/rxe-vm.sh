#!/usr/bin/env bash
# Runs a command against a real Soft-RoCE device (rdma_rxe, `rxe0`) inside a throw-away qemu VM.
#
#   scripts/vm/rxe-vm.sh STAGE_DIR 'command'
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
#   The rootfs build (debootstrap) takes 35-50 s; the cached cpio is ~135 MiB. The rootfs, PID 1
#   and the qemu flags are shared with scripts/vm/cluster-vm.sh (scripts/vm/vm-lib.sh): one cached
#   rootfs serves both, and a rootfs nobody used for a day is dropped when another is built.
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
# shellcheck source=scripts/vm/vm-lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/vm-lib.sh"

vm_args 2 "STAGE_DIR 'command'" "$@"
cmd=$2

timeout_s=${RXE_VM_TIMEOUT:-600}
mem=${RXE_VM_MEM:-3072}
smp=${RXE_VM_SMP:-2}
[[ $timeout_s =~ ^[0-9]+$ && $timeout_s -gt 0 ]] || die "RXE_VM_TIMEOUT must be a positive number of seconds, not '$timeout_s'"
[[ $mem =~ ^[0-9]+$ ]] || die "RXE_VM_MEM must be MiB, not '$mem'"
[[ $smp =~ ^[0-9]+$ ]] || die "RXE_VM_SMP must be a number, not '$smp'"

vm_prepare_host
vm_rootfs

# ------------------------------------------------------------------------------------------
# One run: the run's cpio (PID 1, stage, setup, command) appended to the rootfs cpio, boot,
# stream the output, report.

runs=${TMPDIR:-/tmp}
vm_check_room "$runs" "$stage" "$mem" RXE_VM_MEM

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
vm_on_exit cleanup

vm_stage_begin "$run" "$stage"
# The setup (sh -e, before the command): rxe0 on a dummy netdev, then the ready mark.
cat >"$run/stage/.vm/setup" <<'SETUP'
echo rxe-vm >/proc/sys/kernel/hostname
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
echo "rxe0-up $(cut -d' ' -f1 /proc/uptime)" >/dev/ttyS2
SETUP
echo 'export NCCL_SOCKET_IFNAME=lo' >"$run/stage/.vm/env"
printf '%s\n' "$cmd" >"$run/stage/.vm/cmd"
vm_stage_pack "$run"

vm_qemu_args "$run/initrd.cpio" "$run"
marks=$run/status.log
start=$SECONDS
timeout -k 10 "$timeout_s" qemu-system-x86_64 "${vm_qemu[@]}" -m "$mem" -smp "$smp" -nic none \
  </dev/null >"$run/qemu.log" 2>&1 &
qpid=$!
tail -n +1 -f --pid="$qpid" "$run/output.log" &
tpid=$!
qrc=0
wait "$qpid" || qrc=$?
qpid=
wait "$tpid" 2>/dev/null || true
tpid=
elapsed=$((SECONDS - start))

code=$(vm_exit_code "$run")
if [[ -n $code ]]; then
  exit "$code"
fi
console=$run/console.log
if [[ $qrc -eq 124 || $qrc -eq 137 ]]; then
  where="before it booted"
  grep -q '^booted' "$marks" && where="after boot, before rxe0 was up"
  grep -q '^rxe0-up' "$marks" && where="while running the command"
  vm_show_console "$run" "$elapsed" VM
  echo "$prog: error: timed out after $timeout_s s ($where); console log: $console" >&2
  exit "$ERR_TIMEOUT"
fi
if vm_setup_failed "$run" >/dev/null; then
  die "the VM booted but creating rxe0 failed (see above; console log: $console)"
fi
[[ -s $run/qemu.log ]] && sed 's/^/  qemu: /' "$run/qemu.log" >&2
vm_show_console "$run" "$elapsed" VM
if ! grep -q '^booted' "$marks"; then
  die "the VM did not boot (qemu exit code $qrc after $elapsed s); console log: $console"
fi
die "the VM stopped after $elapsed s without reporting the command's exit code (crash? out of memory? RXE_VM_MEM=$mem); console log: $console"
