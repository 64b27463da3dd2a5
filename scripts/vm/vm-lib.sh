# shellcheck shell=bash
# What the qemu VM runners share: scripts/vm/rxe-vm.sh (one VM) and scripts/vm/cluster-vm.sh (two VMs,
# "hosts", joined by network links). Sourced after `set -Eeuo pipefail` and `prog=NAME` (the
# prefix of every message); it defines, and runs nothing but the ERR trap:
#
#   die/note/vm_usage      messages, exit codes ERR_TIMEOUT (124) and ERR_RUNNER (125)
#   vm_args                --help, the argument count, the stage directory
#   vm_prepare_host        root or sudo, host packages, tools, the kernel (kver, vmlinuz, ...)
#   vm_rootfs              the cached rootfs (built once; sets rootdir, root_mib)
#   vm_check_room          disk space for a run, guest memory for the rootfs and the stage
#   vm_stage_begin/_pack   the per-run initramfs: rootfs + /init + /opt/work + /.vm/*
#   vm_qemu_args           the qemu flags every VM gets (sets the array vm_qemu)
#   vm_on_exit             the EXIT trap, and INT/TERM turned into exits
#   vm_exit_code, vm_setup_failed, vm_show_console   reading a VM's marks and console
#
# The guest (see vm_init below): PID 1 mounts, finds the output port, runs `/.vm/setup HOST`
# (the runner's: devices, then its ready mark), sources /.vm/env and runs /.vm/cmdHOST under
# bash in /opt/work; HOST is the `vm.host=` of the kernel command line, empty for a single VM.
# Channels: ttyS0 the kernel console (console.log), virtio port "out" the command's output
# (output.log; ttyS1 as a fallback), ttyS2 the marks (status.log): `booted`, `output DEV`,
# the setup's ready mark, `exit=N` or `setup-failed` followed by the setup's log.
#
# Rootfs settings, shared by both runners (one cached rootfs serves both):
#   RXE_VM_CACHE    cache directory (default $HOME/.cache/nccl-net-erdma/rxe-vm)
#   RXE_VM_MIRROR   Debian mirror for debootstrap (default: the host's apt source)
#   RXE_VM_SUITE    Debian suite of the rootfs (default: the host's, else bookworm)

: "${prog:?set prog before sourcing vm-lib.sh}"
# shellcheck disable=SC2034 # used by the runners
ERR_TIMEOUT=124
ERR_RUNNER=125
# Nothing fails silently: an unexpected failure names its line and command.
# shellcheck disable=SC2154 # rc is assigned in the trap itself
trap 'rc=$?; echo "$prog: error: line $LINENO: \`$BASH_COMMAND\` failed (exit $rc)" >&2; exit "$ERR_RUNNER"' ERR

die() {
  echo "$prog: error: $*" >&2
  exit "$ERR_RUNNER"
}
note() { echo "$prog: $*" >&2; }

# The calling script's header comment (line 2 up to `set -`).
vm_usage() {
  sed -n '2,/^set -/{/^set -/d;s/^# \{0,1\}//;p}' "$0" || true # a reader that stops early (head) is fine
}

# vm_args N WHAT ARGS...: --help/-h prints the header and exits; else exactly N arguments (WHAT
# names them), the first an existing stage directory. Sets stage (its real path).
vm_args() {
  local n=$1 what=$2
  shift 2
  if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    vm_usage
    exit 0
  fi
  [[ $# -eq $n ]] || {
    vm_usage >&2
    die "expected $n arguments ($what), got $#"
  }
  [[ -d $1 ]] || die "stage directory '$1' does not exist"
  stage=$(realpath "$1")
}

cache=${RXE_VM_CACHE:-$HOME/.cache/nccl-net-erdma/rxe-vm}

free_mib() { df -Pm "$1" | awk 'NR==2 {print $4}'; }

# ------------------------------------------------------------------------------------------
# The host: privileges (debootstrap and reading the rootfs need root; sudo -n when not root),
# packages (installed when missing, apt-get update only then), tools, and the kernel: the one
# linux-image-amd64 currently points at (not whatever else is installed).

vm_prepare_host() {
  if [[ $(id -u) -eq 0 ]]; then
    as_root() { "$@"; }
    need_root() { :; }
  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    as_root() { sudo -n "$@"; }
    need_root() { :; }
  else
    as_root() { return 1; }
    need_root() { die "$1 needs root or password-less sudo; run this once as root (later runs with the cache in place need neither)"; }
  fi

  local host_pkgs=(qemu-system-x86 debootstrap linux-image-amd64 cpio kmod coreutils util-linux)
  local missing=() p t aptlog
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

  kpkg=$(dpkg-query -W -f='${Depends}' linux-image-amd64 | grep -oE 'linux-image-[^ ,]+' | head -1) ||
    die "cannot tell which kernel linux-image-amd64 depends on"
  kver=${kpkg#linux-image-}
  kpkg_version=$(dpkg-query -W -f='${Version}' "$kpkg" 2>/dev/null) || die "$kpkg is not installed"
  vmlinuz=/boot/vmlinuz-$kver
  moddir=/lib/modules/$kver
  [[ -e $vmlinuz ]] || die "kernel $vmlinuz missing (is $kpkg installed properly?)"
  [[ -d $moddir ]] || die "kernel modules $moddir missing (is $kpkg installed properly?)"
}

# ------------------------------------------------------------------------------------------
# The rootfs recipe. Everything that goes into the cached rootfs is named here and hashed into
# the cache key, so a change to any of it (packages, kernel, modules) rebuilds it. PID 1 is not
# part of it: each run brings its own /init (below), so the runners can change without a rebuild.

# binutils: the conformance suite checks the .so's NEEDED entries and exports with readelf/nm.
# iproute2 brings ip, ss, tc and rdma.
guest_pkgs=(rdma-core ibverbs-providers ibverbs-utils perftest libibverbs1 librdmacm1 iproute2 kmod procps
  binutils)
# Modules, resolved with their dependencies from the host's module tree: rxe (rdma_rxe,
# ib_uverbs, rdma_ucm) plus the crc32 crypto that rdma_rxe asks for at runtime (without it
# `rdma link add` fails, ENOENT); dummy (rxe-vm's netdev); virtio_pci/virtio_console carry the
# command's output (~100x faster than a serial port); virtio_net (cluster-vm's NICs) and
# sch_netem (fault injection with tc).
guest_mods=(rdma_rxe ib_uverbs rdma_ucm dummy crypto-crc32 virtio_pci virtio_console virtio_net sch_netem)

# PID 1 in the VM, written into each run's initramfs (see the header for what it does).
read -r -d '' vm_init <<'INIT' || true
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
host=
for a in $(cat /proc/cmdline); do
  case $a in vm.host=*) host=${a#vm.host=} ;; esac
done
ulimit -l unlimited
sh -e /.vm/setup "$host" >/tmp/vm-setup.log 2>&1 || {
  mark "setup-failed"
  cat /tmp/vm-setup.log >/dev/ttyS2
  finish 1
}
. /.vm/env
cd /opt/work
bash "/.vm/cmd$host" </dev/null >"$out" 2>&1
rc=$?
mark "exit=$rc $(cut -d' ' -f1 /proc/uptime)"
finish "$rc"
INIT

layout=5 # bump when the build steps below change in a way the hash would not see

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
    tree=$1 kver=$2; shift 2
    rm -rf "$tree/var/cache/apt/"* "$tree/var/lib/apt/lists/"* "$tree/usr/share/doc" \
      "$tree/usr/share/man" "$tree/usr/share/info" "$tree/usr/share/locale" "$tree/debootstrap"
    for m in "$@"; do mkdir -p "$tree${m%/*}"; cp "$m" "$tree$m"; done
    for f in modules.order modules.builtin modules.builtin.modinfo; do
      cp "/lib/modules/$kver/$f" "$tree/lib/modules/$kver/"
    done
    depmod -b "$tree" "$kver"
    printf "127.0.0.1 localhost\n198.18.0.1 rxe-vm\n" >"$tree/etc/hosts"
    echo rxe-vm >"$tree/etc/hostname"
    mkdir -p "$tree/opt/work"
  ' sh "$tree" "$kver" "${mods[@]}" || die "preparing the rootfs failed"
  # The archive is written by this user; reading the tree needs root.
  (cd "$tree" && as_root find . -xdev -print0 | as_root cpio --null -o -H newc -R 0:0 --quiet) \
    >"$build/rootfs.cpio" || die "packing the rootfs into cpio failed"
  cp "$vmlinuz" "$build/vmlinuz" 2>/dev/null || as_root cat "$vmlinuz" >"$build/vmlinuz"
  as_root rm -rf "$tree"
  printf 'suite=%s\nmirror=%s\nkernel=%s %s\npackages=%s\nmodules=%s\nbuilt=%s\n' "$suite" "$mirror" \
    "$kpkg" "$kpkg_version" "${guest_pkgs[*]}" "${guest_mods[*]}" "$(date -u +%FT%TZ)" >"$build/manifest"
  chmod 755 "$build"
  mv "$build" "$rootdir"
  note "rootfs ready in $((SECONDS - t0)) s ($(du -sm "$rootdir/rootfs.cpio" | cut -f1) MiB)"
}

# Sets rootdir (the cached rootfs.cpio and vmlinuz) and root_mib, building it when missing.
vm_rootfs() {
  suite=${RXE_VM_SUITE:-$(sed -n 's/^VERSION_CODENAME=//p' /etc/os-release 2>/dev/null || true)}
  suite=${suite:-bookworm}
  key=$(printf '%s\n' "layout=$layout" "suite=$suite" "kernel=$kpkg=$kpkg_version" \
    "pkgs=${guest_pkgs[*]}" "mods=${guest_mods[*]}" | sha256sum | cut -c1-16)
  rootdir=$cache/$key # exists only when complete: it is renamed into place as the last step
  mkdir -p "$cache"
  exec 9>"$cache/.lock"
  if [[ ! -d $rootdir ]]; then
    flock 9 # one builder at a time; whoever waited finds it built
    if [[ ! -d $rootdir ]]; then
      # Leftovers of interrupted builds are never reused, nor are rootfs of other recipes that
      # nothing has used for a day (a checkout of another version may still be using one).
      local old
      for old in "$cache"/.build.* "$cache"/*/; do
        [[ -e $old ]] || continue
        old=${old%/}
        [[ $old == "$rootdir" ]] && continue
        [[ ${old##*/} == .build.* || -n $(find "$old" -maxdepth 0 -mmin +1440) ]] || continue
        rm -rf "$old" 2>/dev/null || as_root rm -rf "$old" || die "cannot remove the stale $old"
      done
      build_rootfs
    fi
  fi
  exec 9>&- # a running VM holds no lock: the cached files are only read
  touch "$rootdir" 2>/dev/null || true # when it was last used
  root_mib=$(du -sm "$rootdir/rootfs.cpio" | cut -f1)
}

# ------------------------------------------------------------------------------------------
# One run.

# vm_check_room RUNS_DIR STAGE MEM_MIB MEM_VAR: room on disk for the run's initramfs, and guest
# memory for the rootfs and the stage (MEM_VAR names the setting in the message). Sets stage_mib.
vm_check_room() {
  local runs=$1 stage=$2 mem=$3 var=$4 need_mib
  stage_mib=$(du -sm "$stage" | cut -f1)
  need_mib=$((root_mib + 2 * stage_mib + 16))
  [[ $(free_mib "$runs") -ge $need_mib ]] ||
    die "need $need_mib MiB free in $runs for this run, have $(free_mib "$runs") MiB"
  [[ $mem -ge $((root_mib + stage_mib + 512)) ]] ||
    die "$var=$mem MiB is too small for a $root_mib MiB rootfs plus a $stage_mib MiB stage (need >= $((root_mib + stage_mib + 512)))"
}

# vm_stage_begin RUN STAGE: starts the run's initramfs tree in RUN/stage with /init and a copy
# of STAGE at /opt/work; the caller adds /.vm/setup, /.vm/env and /.vm/cmd*, then vm_stage_pack.
vm_stage_begin() {
  mkdir -p "$1/stage/opt" "$1/stage/.vm"
  cp -a "$2" "$1/stage/opt/work"
  printf '%s\n' "$vm_init" >"$1/stage/init"
  chmod 755 "$1/stage/init"
}

# vm_stage_pack RUN: RUN/initrd.cpio = the cached rootfs followed by the run's tree.
vm_stage_pack() {
  (cd "$1/stage" && find . -print0 | cpio --null -o -H newc -R 0:0 --quiet) >"$1/stage.cpio"
  cat "$rootdir/rootfs.cpio" "$1/stage.cpio" >"$1/initrd.cpio"
  rm -rf "$1/stage" "$1/stage.cpio"
}

# vm_qemu_args INITRD LOGDIR [KERNEL ARGS...]: sets vm_qemu, the flags every VM gets: TCG,
# no defaults, no display, kernel + initramfs, the three channels as files in LOGDIR
# (console.log, output.log, status.log). The caller adds -m, -smp and the network.
vm_qemu_args() {
  local initrd=$1 dir=$2
  shift 2
  : >"$dir/console.log"
  : >"$dir/output.log"
  : >"$dir/status.log"
  # shellcheck disable=SC2034,SC2054 # used by the runners; the commas are qemu's
  vm_qemu=(-nodefaults -no-user-config -accel tcg,thread=multi -cpu max
    -display none -monitor none -no-reboot
    -kernel "$rootdir/vmlinuz" -initrd "$initrd"
    -append "console=ttyS0 quiet panic=-1 rdinit=/init clocksource=tsc tsc=reliable${*:+ $*}"
    -serial "file:$dir/console.log" -serial "file:$dir/output.log" -serial "file:$dir/status.log"
    -device virtio-serial-pci -chardev "file,id=out,path=$dir/output.log,append=on"
    -device virtserialport,chardev=out,name=out)
}

# vm_on_exit FUNCTION: FUNCTION runs when the script ends, also on INT (130) and TERM (143).
vm_on_exit() {
  # shellcheck disable=SC2064 # the name is meant to be expanded now
  trap "$1" EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
}

# vm_exit_code LOGDIR: the command's exit code from the marks, or nothing.
vm_exit_code() {
  sed -n 's/^exit=\([0-9]\{1,3\}\)\( .*\)\{0,1\}$/\1/p' "$1/status.log" | tail -1
}

# vm_setup_failed LOGDIR: shows the failed setup's log (indented, on stderr) and prints its
# last line (the reason); fails when the setup did not fail.
vm_setup_failed() {
  grep -q '^setup-failed' "$1/status.log" || return 1
  sed -n '/^setup-failed/,$p' "$1/status.log" | sed 's/^/  | /' >&2
  sed -n '/^setup-failed/,$p' "$1/status.log" | tail -n 1
}

# vm_show_console LOGDIR ELAPSED WHAT: WHAT's progress marks and the end of its console.
vm_show_console() {
  note "$3 progress: $(cut -d' ' -f1 "$1/status.log" | tr '\n' ' ')($2 s)"
  if [[ -s $1/console.log ]]; then
    note "last lines of the $3 console ($1/console.log):"
    tail -n 25 "$1/console.log" | sed 's/^/  | /' >&2
  fi
}
