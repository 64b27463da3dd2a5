#!/usr/bin/env bash
# The two-host cluster tier (called by scripts/test.sh after the Soft-RoCE tier): the
# plugin between two Soft-RoCE VMs joined by real (virtual) links, two rails each, with
# faults injected on the RDMA path while the bootstrap link stays up.
#
#   scripts/cluster-tier.sh [CASE ...]
#
# On the host: builds the release .so, the info command and the cluster test executable
# (tests/cluster), and stages them. scripts/cluster-vm.sh boots the two hosts; on each, every
# case of tests/cluster runs in its own process (`cluster --exact CASE`), both hosts in step
# over a control connection; host 2 injects the faults on itself. Each case prints one
# `cluster: RESULT case=... host=N ...` line per host (what the plugin did, time to
# completion or error, bytes verified) and one `cluster-tier: PASS|FAIL case (seconds)` line.
# The last case powers host 2 off (a host vanishing). The exit code is non-zero if a case
# failed on either host, or the pair did not boot.
#
# Without arguments every case runs, in the order of tests/cluster; CASE names pick some.
# Environment: CLUSTER_TIER_CASE_TIMEOUT (seconds per case and host, 300), and
# scripts/cluster-vm.sh's CLUSTER_VM_* settings (CLUSTER_VM_TIMEOUT: the whole run).
set -Eeuo pipefail
trap 'echo "cluster-tier: error: line $LINENO: \`$BASH_COMMAND\` failed (exit $?)" >&2; exit 1' ERR

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
# shellcheck source=scripts/common.sh
source scripts/common.sh
help_from_header "${1:-}"

step_prefix cluster-tier
tier_start=$(now)
work=$(mktemp -d "${TMPDIR:-/tmp}/cluster-tier.XXXXXX")
stage=$work/stage
# shellcheck disable=SC2317 # called by the EXIT trap
cleanup() { rm -rf "$work"; }
trap cleanup EXIT

echo "== cluster-tier: build (release)"
t=$(now)
build_release >"$work/build.log" 2>&1 || {
  tail -n 30 "$work/build.log"
  result FAIL build "$t" "cargo build --release failed"
  exit 1
}
json=$work/test.json
cargo test --release -p nccl-net-erdma --test cluster --no-run \
  --message-format=json-render-diagnostics >"$json" 2>"$work/test-build.log" || {
  tail -n 30 "$work/test-build.log"
  result FAIL build "$t" "cargo test --no-run --test cluster failed"
  exit 1
}
exe=$(grep -F '"reason":"compiler-artifact"' "$json" | grep -F '"kind":["test"]' |
  sed -n 's/.*"executable":"\([^"]*cluster-[^"]*\)".*/\1/p' | tail -1)
[[ -n $exe && -x $exe ]] || {
  result FAIL build "$t" "no cluster test executable"
  exit 1
}
result PASS build "$t"

rel=$(release_dir)
mkdir -p "$stage"
cp "$rel/libnccl_net_erdma.so" "$stage/libnccl-net-erdma.so"
cp "$rel/nccl-net-erdma-info" "$exe" "$stage/"
exe_name=$(basename "$exe")

# The cases, in the order the test file declares them (the vanishing host goes last).
if [[ $# -gt 0 ]]; then
  cases=("$@")
else
  mapfile -t cases < <("$exe" --list --ignored 2>/dev/null | sed -n 's/: test$//p')
fi
[[ ${#cases[@]} -gt 0 ]] || {
  echo "cluster-tier: error: no cases found in $exe_name" >&2
  exit 1
}
case_timeout=${CLUSTER_TIER_CASE_TIMEOUT:-300}

# What each host runs: every case in order, one process each, with a result line per case.
cat >"$stage/run-cases.sh" <<INNER
# shellcheck shell=bash
export NCCL_ERDMA_PLUGIN_LIB=/opt/work/libnccl-net-erdma.so
export NCCL_ERDMA_INFO_BIN=/opt/work/nccl-net-erdma-info
export NCCL_ERDMA_TRANSPORT=verbs RUST_BACKTRACE=1
failed=0
# Every case starts from a clean host: links up at MTU 1500, no qdisc, rxe ports ACTIVE (a
# failed case may have left a fault behind).
reset() {
  for n in mgmt raila railb; do ip link set "\$n" mtu 1500 up; tc qdisc del dev "\$n" root 2>/dev/null; done
  for i in \$(seq 100); do
    grep -q ACTIVE /sys/class/infiniband/rxe0/ports/1/state && grep -q ACTIVE /sys/class/infiniband/rxe1/ports/1/state && return 0
    sleep 0.1
  done
  echo "cluster-tier: rxe ports not ACTIVE after the reset"
}
for c in ${cases[*]}; do
  reset
  t0=\$(date +%s.%N)
  if timeout -k 5 $case_timeout ./$exe_name --exact "\$c" --ignored --nocapture --test-threads=1 \
      >"/tmp/\$c.log" 2>&1; then
    status=PASS
  else
    status=FAIL
    failed=\$((failed + 1))
  fi
  grep -oE 'cluster: RESULT.*' "/tmp/\$c.log" || true
  if [[ \$status == FAIL ]]; then
    tail -n 40 "/tmp/\$c.log"
  fi
  echo "cluster-tier: \$status \$c (\$(awk -v a="\$t0" -v b="\$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s)"
done
exit \$failed
INNER

echo "== cluster-tier: two hosts (scripts/cluster-vm.sh), ${#cases[@]} cases"
t=$(now)
rc=0
bash scripts/cluster-vm.sh "$stage" 'bash run-cases.sh' 'bash run-cases.sh' | tee "$work/run.log" || rc=$?
passes=$(grep -cE '^\[h1\] cluster-tier: PASS' "$work/run.log" || true)
fails=$(grep -cE '^\[h[12]\] cluster-tier: FAIL' "$work/run.log" || true)
if [[ $rc -eq 0 && $fails -eq 0 ]]; then
  result PASS "cases" "$t" "$passes of ${#cases[@]} passed on both hosts"
else
  result FAIL "cases" "$t" "$fails failed (cluster-vm exit $rc)"
fi
echo "cluster-tier: $passed passed, $failed failed in $(since "$tier_start") s"
[[ $failed -eq 0 ]]
