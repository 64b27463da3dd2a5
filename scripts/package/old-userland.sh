#!/usr/bin/env bash
# The packages in an older userland (called by scripts/package/package-test.sh): a Debian 11
# (bullseye: glibc 2.31, as Ubuntu 20.04, the base of Horovod's py3.8 images) root file system
# made with debootstrap and cached, entered with chroot in its own mount and network
# namespaces (`unshare -m -n`: only its own loopback, so no traffic leaves it), in which
#   1. the wheel installs with pip into a venv (--no-index: it needs no other package);
#   2. `python -m nccl_net_erdma` names the installed library, and the console command
#      `nccl-net-erdma-info` runs (exit 0 over tcp);
#   3. the installed library carries messages over tcp on loopback through nccl-net-bench, by
#      its path, and as libnccl-net.so found by name (as NCCL 2.9 opens it) with the line
#      `python -m nccl_net_erdma --env --nccl 2.9.9` prints;
#   4. the .deb installs with dpkg -i, and its library, found by name, does the same; and its
#      libnccl-net.so with LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu/nccl-net-erdma.
#
#   scripts/package/old-userland.sh WHEEL DEB BENCH
#
# BENCH: a nccl-net-bench built for glibc 2.17 (scripts/package/package.sh's). Each step ends
# with `old-userland: PASS|FAIL <step> (<s> s)`; the exit status is non-zero if one failed.
# Environment: OLD_USERLAND_SUITE (bullseye), OLD_USERLAND_MIRROR (the host's apt source, else
# deb.debian.org), OLD_USERLAND_CACHE ($HOME/.cache/nccl-net-erdma/userland). Needs root (or
# sudo -n) for debootstrap, the namespaces and chroot.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
# shellcheck source=scripts/common.sh
source scripts/common.sh
help_from_header "$@"
[[ $# -eq 3 ]] || {
  echo "old-userland: usage: $0 WHEEL DEB BENCH" >&2
  exit 2
}
whl=$1 deb=$2 bench=$3
step_prefix old-userland
start=$(now)
sudo=()
[[ $(id -u) == 0 ]] || sudo=(sudo -n)

suite=${OLD_USERLAND_SUITE:-bullseye}
cache=${OLD_USERLAND_CACHE:-$HOME/.cache/nccl-net-erdma/userland}
layout=1 # bump when the packages or steps of the root file system change
rootfs=$cache/$suite-$layout.tar
mkdir -p "$cache"
t=$(now)
if [[ ! -s $rootfs ]]; then
  ensure_packages debootstrap
  mirror=${OLD_USERLAND_MIRROR:-$({
    grep -hE '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}'
    grep -hoE '^deb +(\[[^]]*\] +)?https?://[^ ]+' /etc/apt/sources.list 2>/dev/null | awk '{print $NF}'
  } | grep -v -e security -e '^$' | head -1 || true)}
  mirror=${mirror:-http://deb.debian.org/debian}
  build=$(mktemp -d "$cache/.build.XXXXXX")
  echo "old-userland: debootstrap $suite from $mirror (cached afterwards in $rootfs)"
  if "${sudo[@]}" timeout 900 debootstrap --variant=minbase --include=python3,python3-venv,iproute2 \
    "$suite" "$build/tree" "$mirror" >"$build/debootstrap.log" 2>&1 &&
    "${sudo[@]}" tar -C "$build/tree" -cf "$build/rootfs.tar" . &&
    mv "$build/rootfs.tar" "$rootfs"; then
    result PASS rootfs "$t" "$suite built with debootstrap"
  else
    tail -n 20 "$build/debootstrap.log"
    result FAIL rootfs "$t" "debootstrap of $suite from $mirror failed"
  fi
  "${sudo[@]}" rm -rf "$build"
else
  result PASS rootfs "$t" "$suite from the cache ($rootfs)"
fi
[[ -s $rootfs ]] || exit 1

work=$(mktemp -d "${TMPDIR:-/tmp}/old-userland.XXXXXX")
# shellcheck disable=SC2317 # called by the EXIT trap
cleanup() { "${sudo[@]}" rm -rf "$work"; }
trap cleanup EXIT
root=$work/root
mkdir -p "$root"
"${sudo[@]}" tar -C "$root" -xf "$rootfs"
"${sudo[@]}" mkdir -p "$root/opt/pkg"
"${sudo[@]}" cp "$whl" "$deb" "$bench" "$root/opt/pkg/"

# Inside: every step prints its own result line; the bench's sizes are checked by the bench.
cat >"$work/inner.sh" <<INNER
ip link set lo up
export NCCL_ERDMA_TRANSPORT=tcp NCCL_SOCKET_IFNAME=lo
cd /opt/pkg
# bench LIB [ABI]: 8 B and 64 KiB through LIB (its table ABI: v4 as NCCL 2.9 loads it, or the
# highest), the table named in the report.
bench() {
  ./$(basename "$bench") --lib "\$1" \${2:+--abi \$2} --sizes 8,64K --iters 20 >bench.txt 2>&1 &&
    grep -qF "library:   \$1 (ncclNetPlugin_v\${2:-12}," bench.txt && grep -qE '^ +64 KiB ' bench.txt
}
echo "userland: \$(. /etc/os-release; echo "\$PRETTY_NAME"), \$(ldd --version | head -n 1), \$(python3 --version)"
if python3 -m venv /opt/venv && /opt/venv/bin/pip install --quiet --no-index --disable-pip-version-check ./$(basename "$whl"); then
  echo "RESULT PASS pip-install"
else
  echo "RESULT FAIL pip-install"
fi
lib=\$(/opt/venv/bin/python -m nccl_net_erdma)
if [[ -f \$lib ]] && /opt/venv/bin/nccl-net-erdma-info >info.txt 2>&1; then
  echo "RESULT PASS python-and-info \$lib"
else
  echo "RESULT FAIL python-and-info '\$lib'"; tail -n 5 info.txt
fi
if bench "\$lib" && (eval "\$(/opt/venv/bin/python -m nccl_net_erdma --env --nccl 2.9.9)" && bench libnccl-net.so 4); then
  echo "RESULT PASS bench-wheel 8 B and 64 KiB checked through \$lib, and through libnccl-net.so found by name and its v4 table (NCCL 2.9)"
else
  echo "RESULT FAIL bench-wheel"; tail -n 5 bench.txt
fi
if dpkg -i ./$(basename "$deb") >dpkg.txt 2>&1 && /usr/bin/nccl-net-erdma-info >info.txt 2>&1 && bench libnccl-net-erdma.so &&
  LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu/nccl-net-erdma bench libnccl-net.so 4; then
  echo "RESULT PASS deb \$(dpkg-query -W -f='\${Package} \${Version}' nccl-net-erdma), found by name (and its libnccl-net.so with LD_LIBRARY_PATH)"
else
  echo "RESULT FAIL deb"; tail -n 5 dpkg.txt info.txt bench.txt 2>/dev/null
fi
INNER
"${sudo[@]}" cp "$work/inner.sh" "$root/opt/pkg/inner.sh"
t=$(now)
# shellcheck disable=SC2016 # expanded by the inner shell
"${sudo[@]}" unshare -m -n -- sh -c '
  mount -t proc proc "$1/proc" && mount --bind /dev "$1/dev" &&
    exec chroot "$1" /bin/bash /opt/pkg/inner.sh' sh "$root" >"$work/out.txt" 2>&1
sed -n 's/^userland: /old-userland: /p' "$work/out.txt"
grep -v -e '^RESULT ' -e '^userland: ' "$work/out.txt" | sed 's/^/  /'
while read -r _ verdict name note; do
  result "$verdict" "$name" "$t" "$note"
done < <(grep '^RESULT ' "$work/out.txt")
[[ $(grep -c '^RESULT ' "$work/out.txt") == 4 ]] || result FAIL steps "$t" "the chroot ran $(grep -c '^RESULT ' "$work/out.txt") of 4 steps"
echo "old-userland: $passed passed, $failed failed in $(since "$start") s"
[[ $failed -eq 0 ]]
