#!/usr/bin/env bash
# What the idle calls NCCL's proxy makes (a test of a receive not done, an isend whose
# clear-to-send has not come) cost after the connection moved to another NIC, against the
# same calls before the move: instructions counted by callgrind over the fake fabric (unit
# test `idle_calls_before_and_after_a_move`, each batch of 4096 calls in a function of its
# own). The fake's CQ poll is not a real device's, so the figures are not cpu-cost.sh's; what
# this shows is the ratio: a moved connection's idle calls take the same lock-free path.
#
#   scripts/perf/moved-idle-cost.sh
set -Eeuo pipefail
trap 'echo "moved-idle-cost: error: line $LINENO: \`$BASH_COMMAND\` failed (exit $?)" >&2; exit 1' ERR
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
# shellcheck source=scripts/common.sh
source scripts/common.sh
help_from_header "${1:-}"
ensure_build_deps
ensure_packages valgrind
json=$(mktemp)
out=$(mktemp -d)
trap 'rm -rf "$json" "$out"' EXIT
cargo test --release --lib --no-run --message-format=json-render-diagnostics >"$json"
exe=$(grep -F '"reason":"compiler-artifact"' "$json" | grep -F '"test":true' |
  sed -n 's/.*"executable":"\([^"]*nccl_net_erdma-[^"]*\)".*/\1/p' | tail -1)
[[ -x $exe ]] || { echo "moved-idle-cost: no unit test executable" >&2; exit 1; }
batches=(idle_tests_unmoved idle_tests_moved idle_isends_unmoved idle_isends_moved)
toggles=()
for b in "${batches[@]}"; do toggles+=("--toggle-collect=*failover::$b"); done
valgrind --tool=callgrind --callgrind-out-file="$out/cg.out" "${toggles[@]}" \
  "$exe" --exact transport::verbs::tests::failover::idle_calls_before_and_after_a_move \
  --ignored --test-threads=1 >"$out/run.log" 2>&1 || { tail -20 "$out/run.log"; exit 1; }
# Inclusive instructions of each batch function, per call.
declare -A per
for b in "${batches[@]}"; do
  ir=$(callgrind_annotate --inclusive=yes "$out/cg.out" 2>/dev/null |
    awk -v f="failover::$b" '!found && index($0, f) { gsub(",", "", $1); print $1; found = 1 }')
  per[$b]=$(awk -v i="${ir:-0}" 'BEGIN { printf "%.1f", i / 4096 }')
done
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", (a > 0) ? b / a : 0 }'; }
echo "moved-idle-cost: instructions per idle call on the fake fabric (4096 calls each), before and after a move"
printf '  %-40s %9s %9s %6s\n' "call" "unmoved" "moved" "ratio"
printf '  %-40s %9s %9s %6s\n' "test of a receive not done" "${per[idle_tests_unmoved]}" \
  "${per[idle_tests_moved]}" "$(ratio "${per[idle_tests_unmoved]}" "${per[idle_tests_moved]}")"
printf '  %-40s %9s %9s %6s\n' "isend whose clear-to-send has not come" "${per[idle_isends_unmoved]}" \
  "${per[idle_isends_moved]}" "$(ratio "${per[idle_isends_unmoved]}" "${per[idle_isends_moved]}")"
