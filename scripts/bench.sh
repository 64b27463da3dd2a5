#!/usr/bin/env bash
# Builds the plugin and nccl-net-bench (release) and runs the benchmark on the built .so.
# Arguments go to nccl-net-bench (see `scripts/bench.sh --help`); without any, both sides run
# on this host over loopback. Without an RDMA device the plugin runs over tcp.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/common.sh
source scripts/common.sh

ensure_build_deps
build_release
out=$(release_dir)
exec "$out/nccl-net-bench" --lib "$out/libnccl-net-erdma.so" "$@"
