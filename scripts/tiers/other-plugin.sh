#!/usr/bin/env bash
# The tools against a plugin that is not ours (called by scripts/test.sh after the host
# tier): the toy plugin (tools/tests/toy-plugin/toy_net.c, C, ncclNet_v8 over TCP on
# loopback) side by side with ours, as a user compares the plugin they run today:
#   - scripts/bench.sh --compare-lib: both libraries at each size, the table with ratios, the
#     CSVs and the SVG;
#   - scripts/perf/cpu-cost.sh --compare-lib ... tcp: the scripted cost run of both on this host,
#     each report naming its library and table, and the side-by-side table.
# Each step ends with `other-plugin: PASS|FAIL <step> (<seconds> s)`.
#
#   scripts/tiers/other-plugin.sh
set -Eeuo pipefail
trap 'echo "other-plugin: error: line $LINENO: \`$BASH_COMMAND\` failed (exit $?)" >&2; exit 1' ERR

root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
# shellcheck source=scripts/common.sh
source scripts/common.sh
help_from_header "${1:-}"

step_prefix other-plugin
work=$(mktemp -d "${TMPDIR:-/tmp}/other-plugin.XXXXXX")
# shellcheck disable=SC2317 # called by the EXIT trap
cleanup() { rm -rf "$work"; }
trap cleanup EXIT
toy=$work/libtoy.so
t=$(now)
build_toy_plugin "$toy"
result PASS build-toy "$t"

# Every row has both figures of both libraries and their ratios.
t=$(now)
if NCCL_ERDMA_TRANSPORT=tcp bash scripts/bench.sh --compare-lib "$toy" --sizes 8,64K --iters 10 \
  --csv "$work/cmp.csv" --svg "$work/cmp.svg" >"$work/bench.out" 2>&1 &&
  grep -q '^other: .*libtoy.so (ncclNetPlugin_v8, plugin "toy")$' "$work/bench.out" &&
  [[ $(grep -cE '^ +(8 B|64 KiB)( +[0-9.]+){6}$' "$work/bench.out") == 2 ]] &&
  [[ -s $work/cmp.csv && -s $work/cmp.csv.other.csv ]] && grep -q 'toy (libtoy.so)' "$work/cmp.svg"; then
  result PASS bench-compare "$t" "$(grep -E '^ +64 KiB' "$work/bench.out" | tr -s ' ')"
else
  cat "$work/bench.out"
  result FAIL bench-compare "$t" "no side-by-side table of both libraries"
fi

t=$(now)
if OUT=$work/cost bash scripts/perf/cpu-cost.sh --compare-lib "$toy" tcp >"$work/cost.out" 2>&1 &&
  grep -q '^== tcp (host, loopback), libtoy.so (ncclNetPlugin_v8): instructions per call' "$work/cost.out" &&
  grep -qE '^  tcp +work_per_message +[0-9]+ +[0-9]+ +[0-9.]+ \| +[0-9]+ +[0-9]+ +[0-9.]+$' "$work/cost.out"; then
  result PASS cpu-cost-compare "$t" "$(grep -E '^  tcp +work_per_message' "$work/cost.out" | tr -s ' ')"
else
  cat "$work/cost.out"
  result FAIL cpu-cost-compare "$t" "no side-by-side figures of both libraries"
fi
echo "other-plugin: $passed passed, $failed failed"
[[ $failed -eq 0 ]]
