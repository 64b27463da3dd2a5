#!/usr/bin/env bash
# Runs every test: lint (rustfmt, clippy, shellcheck), the host tier (unit tests and the
# conformance suite over tcp), the tools against another plugin (scripts/tiers/other-plugin.sh),
# the packaging tests (scripts/package/package-test.sh: the wheel and .deb built and
# installed), the Soft-RoCE VM tier (real verbs on an rxe device in a qemu VM), the CPU budget
# (scripts/perf/cpu-cost.sh --check) and the two-host cluster tier (two VMs, two rails each,
# faults on the RDMA path). Installs the Debian packages it needs.
# NCCL_ERDMA_SKIP_VM=1 skips the VM tier, NCCL_ERDMA_SKIP_CLUSTER=1 the cluster tier and
# NCCL_ERDMA_SKIP_RELIABILITY=1 the fuzzing and valgrind runs, for quick local loops; CI never
# sets them.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/common.sh
source scripts/common.sh

start=$(date +%s)
ensure_build_deps
# The conformance suite uses unshare/ip for its network-namespace tests; shellcheck lints the
# scripts.
ensure_packages util-linux iproute2 shellcheck
rustup component add rustfmt clippy >/dev/null 2>&1 || true

echo "== lint"
cargo fmt --check
cargo clippy --workspace --all-targets -- -D warnings
shellcheck -x scripts/*.sh scripts/*/*.sh .ci/run

echo "== build"
build_release

echo "== host tier"
cargo test --release --workspace

# The benchmark and the CPU yardstick side by side with a plugin that is not ours (a toy in C).
echo "== tools against another plugin"
bash scripts/tiers/other-plugin.sh

# The wheel and the .deb (scripts/package/package.sh into target/dist/), installed as a user would: the
# wheel into a fresh venv, then its commands, its Python API and the benchmark through it. The
# .deb is installed in the Soft-RoCE VM tier.
echo "== packaging"
bash scripts/package/package-test.sh

# Fuzzing of the handle and handshake decoders, and the host suite under valgrind memcheck.
if [[ "${NCCL_ERDMA_SKIP_RELIABILITY:-0}" == 1 ]]; then
  echo "== reliability (fuzz, valgrind): SKIPPED (NCCL_ERDMA_SKIP_RELIABILITY=1)"
else
  echo "== reliability (fuzz, valgrind)"
  bash scripts/tiers/reliability.sh
fi

if [[ "${NCCL_ERDMA_SKIP_VM:-0}" == 1 ]]; then
  echo "== Soft-RoCE VM tier: SKIPPED (NCCL_ERDMA_SKIP_VM=1)"
  echo "== CPU budget: SKIPPED (NCCL_ERDMA_SKIP_VM=1)"
else
  echo "== Soft-RoCE VM tier"
  bash scripts/tiers/vm-tier.sh
  # Instructions per call on rxe0, deterministic (callgrind): fails over the budget.
  echo "== CPU budget (verbs, NCCL_ERDMA_CTS_BATCH=1)"
  NCCL_ERDMA_CTS_BATCH=1 bash scripts/perf/cpu-cost.sh --check verbs
fi
if [[ "${NCCL_ERDMA_SKIP_CLUSTER:-0}" == 1 ]]; then
  echo "== cluster tier: SKIPPED (NCCL_ERDMA_SKIP_CLUSTER=1)"
else
  echo "== cluster tier (two hosts)"
  bash scripts/tiers/cluster-tier.sh
fi
echo "test.sh: all tiers passed in $(( $(date +%s) - start )) s"
