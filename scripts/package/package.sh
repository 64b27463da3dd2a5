#!/usr/bin/env bash
# Builds the install packages into target/dist/ (for CI and releases):
#
#   scripts/package/package.sh [--wheel-only | --deb-only]
#
#   target/dist/nccl_net_erdma-VERSION-py3-none-manylinux_2_NN_x86_64.whl
#       the Python wheel (tools/python, hatchling + its build hook): libnccl-net-erdma.so and
#       nccl-net-erdma-info inside the package; `python -m nccl_net_erdma [--env]`, the
#       `nccl-net-erdma-info` command, nccl_net_erdma.library_path() / configure_env().
#   target/dist/nccl-net-erdma_VERSION_amd64.deb
#       the Debian package (cargo-deb, [package.metadata.deb] in tools/Cargo.toml):
#       /usr/lib/x86_64-linux-gnu/libnccl-net-erdma.so and /usr/bin/nccl-net-erdma-info.
#
# VERSION is the root package's version in Cargo.toml. 2.NN is the newest GLIBC_2.* symbol
# version the library and the info command require (objdump -p): the oldest glibc they run on;
# the wheel's manylinux tag and the .deb's `libc6 (>=)` both say it, and this script fails if
# they disagree with it. Builds the release library and binaries first (cargo build --release).
# Installs what it needs: the build dependencies, dpkg-dev and python3-venv with apt-get (as
# root, or with sudo), cargo-deb with `cargo install --locked` (CARGO_DEB_VERSION, 3.8.0),
# and hatchling from PyPI into a build virtual environment (target/package/venv).
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
if [[ $deb == 1 ]]; then ensure_packages dpkg-dev; fi # dpkg-shlibdeps: the .deb's Depends
if [[ $wheel == 1 ]]; then ensure_packages python3 python3-venv; fi

# The root package's version, as cargo reads it (pkgid ends in `#VERSION` or `#name@VERSION`).
version=$(cargo pkgid --quiet -p nccl-net-erdma)
version=${version##*[#@]}
[[ $version =~ ^[0-9]+\.[0-9]+\.[0-9]+ ]] || {
  echo "package.sh: cannot read the version from Cargo.toml (got '$version')" >&2
  exit 1
}

echo "== package: build (release)"
build_release
rel=$(cd "$(release_dir)" && pwd)
so=$rel/libnccl_net_erdma.so
info=$rel/nccl-net-erdma-info
glibc=$(objdump -p "$so" "$info" | grep -oE '\bGLIBC_2\.[0-9]+\b' | sort -uV | tail -1)
glibc=${glibc#GLIBC_}
[[ -n $glibc ]] || {
  echo "package.sh: no GLIBC_2.* version references in $so and $info" >&2
  exit 1
}
echo "package: version $version; requires glibc >= $glibc (newest GLIBC_ symbol version used)"
dist=target/dist
mkdir -p "$dist"

if [[ $wheel == 1 ]]; then
  echo "== package: wheel (tools/python, hatchling)"
  venv=target/package/venv
  if [[ ! -x $venv/bin/pip ]]; then
    rm -rf "$venv"
    python3 -m venv "$venv"
  fi
  rm -f "$dist"/nccl_net_erdma-*.whl
  # pip builds in an isolated environment with the backend pyproject.toml asks for (hatchling).
  NCCL_ERDMA_RELEASE_DIR=$rel PIP_DISABLE_PIP_VERSION_CHECK=1 \
    "$venv/bin/pip" wheel --quiet --no-deps --wheel-dir "$dist" tools/python
  whl=$dist/nccl_net_erdma-$version-py3-none-manylinux_${glibc/./_}_x86_64.whl
  [[ -f $whl ]] || {
    echo "package.sh: expected $whl, got: $(ls "$dist")" >&2
    exit 1
  }
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
  # --no-build: package what build_release built (cargo-deb would build only the tools crate).
  cargo deb --quiet -p nccl-net-erdma-tools --no-build --deb-version "$version" --output "$dist/"
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
