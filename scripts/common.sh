# shellcheck shell=bash
# Shared by the scripts in this directory: build dependencies and the build itself.

# rdma-sys/bindgen need libclang <= 15; Debian 12's default is 14. Pin it so a newer libclang
# installed next to it is never picked up.
if [[ -z "${LIBCLANG_PATH:-}" && -d /usr/lib/llvm-14/lib ]]; then
  export LIBCLANG_PATH=/usr/lib/llvm-14/lib
fi

# `--help`/`-h`: prints the calling script's header comment (line 2 up to `set -`) and exits.
help_from_header() {
  if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    sed -n '2,/^set -/{/^set -/d;s/^# \{0,1\}//;p}' "$0"
    exit 0
  fi
}

# Where cargo leaves release artifacts.
release_dir() {
  echo "${CARGO_TARGET_DIR:-target}/release"
}

# Installs Debian packages that are missing (apt-get update only when something is).
ensure_packages() {
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  [[ ${#missing[@]} -eq 0 ]] && return 0
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "not a Debian system: install ${missing[*]} yourself" >&2
    return 1
  fi
  local sudo=()
  [[ $(id -u) -eq 0 ]] || sudo=(sudo)
  echo "installing: ${missing[*]}" >&2
  "${sudo[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
}

ensure_build_deps() {
  # gcc: the linker, and the tools' C logger (tools/csrc).
  ensure_packages libclang-dev libibverbs-dev librdmacm-dev pkg-config binutils gcc
  if [[ -z "${LIBCLANG_PATH:-}" && -d /usr/lib/llvm-14/lib ]]; then
    export LIBCLANG_PATH=/usr/lib/llvm-14/lib
  fi
}

# Builds the release library and binaries; leaves the library also under the name NCCL
# looks for (libnccl-net-<NCCL_NET_PLUGIN>.so).
build_release() {
  cargo build --release --workspace --lib --bins
  local out
  out=$(release_dir)
  cp -f "$out/libnccl_net_erdma.so" "$out/libnccl-net-erdma.so"
}

# The toy plugin (tools/tests/toy-plugin/toy_net.c: ncclNet_v8 over TCP on loopback, printf
# logging), built into FILE: a plugin that is not ours, for the tools' side-by-side modes.
build_toy_plugin() { # FILE
  "${CC:-cc}" -shared -fPIC -O2 -Wall -Wextra -Werror -Iinclude tools/tests/toy-plugin/toy_net.c -o "$1"
}

# Step bookkeeping for the tier scripts: `step_prefix NAME`, then `result PASS|FAIL|SKIP STEP
# START [NOTE]` after each step (START from `now`); the counts are in passed/failed/skipped.
passed=0
failed=0
skipped=0
step_name=steps
step_prefix() {
  step_name=$1
}
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
result() {
  case $1 in
    PASS) passed=$((passed + 1)) ;;
    FAIL) failed=$((failed + 1)) ;;
    SKIP) skipped=$((skipped + 1)) ;;
  esac
  echo "$step_name: $1 $2 ($(since "$3") s)${4:+ -- $4}"
}
