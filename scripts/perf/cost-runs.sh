#!/usr/bin/env bash
# The callgrind run behind scripts/perf/cpu-cost.sh, on this host or inside the Soft-RoCE VM:
#
#   scripts/perf/cost-runs.sh BENCH LIB OUTDIR ROUNDS WINDOW IDLE [WAIT_US] [SIZE]
#
# Runs BENCH (nccl-net-bench) on LIB in its scripted mode (`--script ROUNDS`: one process
# holding both ends of one connection, a fixed sequence of calls whose every outcome is
# known in advance; see tools/src/bin/nccl-net-bench/script.rs) under
# `valgrind --tool=callgrind`, collecting instructions only inside the bench's counting
# functions (nccl_net_bench::script::count_*, one per kind of call) and writing one profile
# per phase (--dump-after=nccl_net_bench::script::phase_end):
#   OUTDIR/callgrind.PID.out.N  profile N: 1 the warm-up (nothing collected), then one per
#                               phase attempt, as the bench's `script-phase n=N` lines say
#   OUTDIR/bench.log            the bench's output (its `script` lines)
# WINDOW messages of SIZE bytes (default 8) per round, IDLE idle isends and idle tests per
# message, WAIT_US the wait for the network outside the plugin (default: the bench's, by
# transport). The transport comes from the environment (NCCL_ERDMA_TRANSPORT, NCCL_IB_HCA,
# ...). $VALGRIND overrides the valgrind command (a staged copy in the VM);
# $COST_RUN_TIMEOUT bounds the run (seconds, 900); $CPU_COST_COMMS idle connection pairs are
# held open beside the measured one (--script-comms; default 0).
set -euo pipefail

if [[ $# -lt 6 || $# -gt 8 ]]; then
  sed -n '2,/^set -/{/^set -/d;s/^# \{0,1\}//;p}' "$0" >&2
  exit 2
fi
bench=$1 lib=$2 out=$3 rounds=$4 window=$5 idle=$6 wait_us=${7:-} size=${8:-8}
read -r -a vg <<<"${VALGRIND:-valgrind}"
limit=${COST_RUN_TIMEOUT:-900}
extra=()
[[ -z $wait_us ]] || extra+=(--script-wait "$wait_us")
[[ -z ${CPU_COST_COMMS:-} ]] || extra+=(--script-comms "$CPU_COST_COMMS")

rm -rf "$out"
mkdir -p "$out"
t0=$SECONDS
rc=0
# Two descriptors per idle pair (the out-of-band sockets).
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
# Uncompressed names and positions: each profile is read on its own. Instruction-level
# positions: the executions of a function's first instruction are its calls while collecting.
timeout -k 10 "$limit" "${vg[@]}" --tool=callgrind -q \
  --compress-strings=no --compress-pos=no --dump-instr=yes \
  --callgrind-out-file="$out/callgrind.%p.out" \
  --toggle-collect='nccl_net_bench::script::count_*' \
  --dump-after='nccl_net_bench::script::phase_end' \
  "$bench" --lib "$lib" --sizes "$size" --window "$window" --script "$rounds" \
  --script-idle "$idle" "${extra[@]}" >"$out/bench.log" 2>&1 || rc=$?
if [[ $rc -ne 0 ]]; then
  echo "cost-runs: the scripted run failed (exit $rc); its output:" >&2
  tail -n 30 "$out/bench.log" >&2
  exit 1
fi
echo "cost-runs: scripted run done in $((SECONDS - t0)) s ($(find "$out" -name 'callgrind.*.out.*' | wc -l) profiles)" \
  "$(awk '/^script-phase/ && / kept=no/ {r++} /^script-phase/ {m += substr($0, index($0, " misses=") + 8) + 0} END {printf "%d phase(s) rerun, %d miss(es)", r, m}' "$out/bench.log")"
