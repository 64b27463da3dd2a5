#!/usr/bin/env bash
# Builds the install packages into target/dist/ (for CI and releases):
#
#   scripts/package/package.sh [--wheel-only | --deb-only]
#
#   target/dist/nccl_net_erdma-VERSION-py3-none-manylinux_2_17_x86_64.manylinux2014_x86_64.whl
#       the Python wheel (tools/python, hatchling + its build hook): lib/libnccl-net-erdma.so,
#       lib/libnccl-net.so (a copy: the one name NCCL 2.9 and 2.10 open; a wheel holds no
#       links) and bin/nccl-net-erdma-info inside the package; `python -m nccl_net_erdma
#       [--env [--nccl VERSION]]`, the `nccl-net-erdma-info` command,
#       nccl_net_erdma.library_path() / library_dir() / configure_env().
#   target/dist/nccl-net-erdma_VERSION_amd64.deb
#       the Debian package (cargo-deb, [package.metadata.deb] in tools/Cargo.toml):
#       /usr/lib/x86_64-linux-gnu/libnccl-net-erdma.so (found by name: NCCL_NET_PLUGIN=erdma),
#       /usr/lib/x86_64-linux-gnu/nccl-net-erdma/libnccl-net.so (a link to it, for NCCL 2.9
#       and 2.10, outside the loader's search: a job opts in with LD_LIBRARY_PATH; installed
#       in the default path, that name would make every NCCL on the host that runs without
#       NCCL_NET_PLUGIN load the plugin) and /usr/bin/nccl-net-erdma-info.
#
# VERSION is the root package's version in Cargo.toml. The packaged library, info command and
# benchmark are built for glibc 2.17 (manylinux2014: CentOS 7, Ubuntu 18.04, Debian 10 and
# later) with cargo-zigbuild (`--target x86_64-unknown-linux-gnu.2.17`: zig links against
# glibc 2.17's symbol versions, and no libgcc_s) into target/x86_64-unknown-linux-gnu/release/;
# the development build (target/release) keeps the host toolchain. The newest GLIBC_2.* symbol
# version the packaged files require (objdump -p) is the oldest glibc they run on: the wheel's
# manylinux tag and the .deb's `libc6 (>=)` both say it, and this script fails if they disagree
# with it or it is newer than 2.17. Installs what it needs: the build dependencies, dpkg-dev and
# python3-venv with apt-get (as root, or with sudo), cargo-deb with `cargo install --locked`
# (CARGO_DEB_VERSION, 3.8.0), and from PyPI cargo-zigbuild and ziglang (CARGO_ZIGBUILD_VERSION
# 0.24.1, ZIGLANG_VERSION 0.17.1) into a virtual environment under ~/.cache/nccl-net-erdma/;
# pip (target/package/venv) builds the wheel with hatchling.
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=scripts/common.sh
source scripts/common.sh
help_from_header "$@"

wheel=1 deb=1
case ${1:-} in
  "") ;;
  --wheel-only) deb=0 ;;
  --deb-only) wheel=0 ;;
  *)
    echo "package.sh: unknown argument '$1' (see --help)" >&2
    exit 2
    ;;
esac

ensure_build_deps
if [[ $deb == 1 ]]; then ensure_packages dpkg-dev; fi # dpkg-architecture and friends, for cargo-deb

# The root package's version, as cargo reads it (pkgid ends in `#VERSION` or `#name@VERSION`).
version=$(cargo pkgid --quiet -p nccl-net-erdma)
version=${version##*[#@]}
[[ $version =~ ^[0-9]+\.[0-9]+\.[0-9]+ ]] || {
  echo "package.sh: cannot read the version from Cargo.toml (got '$version')" >&2
  exit 1
}

# The build virtual environment (pip, which builds the wheel), and zig with cargo-zigbuild in
# one of their own outside the source tree: zig names its library directory relative to the
# working directory when it lies below it, and build scripts, which run elsewhere, would not
# find its C headers.
ensure_packages python3 python3-venv
venv=target/package/venv
if [[ ! -x $venv/bin/pip ]]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
fi
zigbuild_version=${CARGO_ZIGBUILD_VERSION:-0.24.1} zig_version=${ZIGLANG_VERSION:-0.17.1}
zig_venv=${XDG_CACHE_HOME:-$HOME/.cache}/nccl-net-erdma/zig-$zig_version-cargo-zigbuild-$zigbuild_version
if ! "$zig_venv/bin/cargo-zigbuild" --version 2>/dev/null | grep -qxF "cargo-zigbuild $zigbuild_version" ||
  [[ $("$zig_venv/bin/python" -m ziglang version 2>/dev/null) != "$zig_version" ]]; then
  echo "installing cargo-zigbuild $zigbuild_version and ziglang $zig_version into $zig_venv (PyPI)" >&2
  rm -rf "$zig_venv"
  python3 -m venv "$zig_venv"
  "$zig_venv/bin/pip" install --quiet --disable-pip-version-check \
    "cargo-zigbuild==$zigbuild_version" "ziglang==$zig_version"
fi

# glibc 2.17: the oldest the wheel and the .deb promise.
floor=2.17
triple=x86_64-unknown-linux-gnu
echo "== package: build (release, glibc $floor: cargo zigbuild --target $triple.$floor)"
PATH=$zig_venv/bin:$PATH cargo zigbuild --release --target "$triple.$floor" --workspace --lib --bins
rel=$(cd "${CARGO_TARGET_DIR:-target}/$triple/release" && pwd)
cp -f "$rel/libnccl_net_erdma.so" "$rel/libnccl-net-erdma.so"
so=$rel/libnccl_net_erdma.so
info=$rel/nccl-net-erdma-info
glibc=$(objdump -p "$so" "$info" | grep -oE '\bGLIBC_2\.[0-9]+\b' | sort -uV | tail -1)
glibc=${glibc#GLIBC_}
[[ -n $glibc ]] || {
  echo "package.sh: no GLIBC_2.* version references in $so and $info" >&2
  exit 1
}
[[ $(printf '%s\n' "$glibc" "$floor" | sort -V | tail -1) == "$floor" ]] || {
  echo "package.sh: $so and $info need glibc $glibc, newer than the $floor the packages promise" >&2
  exit 1
}
echo "package: version $version; requires glibc >= $glibc (newest GLIBC_ symbol version used); built in $rel"
dist=target/dist
mkdir -p "$dist"

if [[ $wheel == 1 ]]; then
  echo "== package: wheel (tools/python, hatchling)"
  rm -f "$dist"/nccl_net_erdma-*.whl
  # pip builds in an isolated environment with the backend pyproject.toml asks for (hatchling).
  NCCL_ERDMA_RELEASE_DIR=$rel PIP_DISABLE_PIP_VERSION_CHECK=1 \
    "$venv/bin/pip" wheel --quiet --no-deps --wheel-dir "$dist" tools/python
  # manylinux_2_17 is also manylinux2014, the name older pips know (pip < 20.3).
  tag=manylinux_${glibc/./_}_x86_64
  [[ $glibc != 2.17 ]] || tag+=.manylinux2014_x86_64
  whl=$dist/nccl_net_erdma-$version-py3-none-$tag.whl
  [[ -f $whl ]] || {
    echo "package.sh: expected $whl, got: $(ls "$dist")" >&2
    exit 1
  }
  # The library under both names: its own, and libnccl-net.so (NCCL 2.9 and 2.10 open only that).
  listing=$(python3 -m zipfile -l "$whl")
  for f in libnccl-net-erdma.so libnccl-net.so; do
    grep -qE "^nccl_net_erdma/lib/${f//./\\.} " <<<"$listing" || {
      echo "package.sh: $whl has no nccl_net_erdma/lib/$f" >&2
      exit 1
    }
  done
  echo "package: $whl ($(du -h "$whl" | cut -f1))"
fi

if [[ $deb == 1 ]]; then
  echo "== package: Debian package (cargo-deb)"
  cargo_deb_version=${CARGO_DEB_VERSION:-3.8.0}
  if ! cargo deb --version >/dev/null 2>&1; then
    echo "installing cargo-deb $cargo_deb_version (cargo install --locked)" >&2
    cargo install --quiet --locked cargo-deb --version "$cargo_deb_version"
  fi
  rm -f "$dist"/nccl-net-erdma_*.deb
  # --no-build: package what cargo zigbuild built (cargo-deb would build only the tools crate);
  # --target: the assets' target/release/ paths are read from target/$triple/release/.
  cargo deb --quiet -p nccl-net-erdma-tools --no-build --target "$triple" --deb-version "$version" --output "$dist/"
  debfile=$dist/nccl-net-erdma_${version}_amd64.deb
  [[ -f $debfile ]] || {
    echo "package.sh: expected $debfile, got: $(ls "$dist")" >&2
    exit 1
  }
  depends=$(dpkg-deb --field "$debfile" Depends)
  [[ $depends == *"libc6 (>= $glibc)"* ]] || {
    echo "package.sh: $debfile: Depends '$depends' does not say libc6 (>= $glibc)" >&2
    exit 1
  }
  echo "package: $debfile ($(du -h "$debfile" | cut -f1)); Depends: $depends"
fi
