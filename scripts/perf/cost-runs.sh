#!/usr/bin/env bash
# The callgrind runs behind scripts/cpu-cost.sh, on this host or inside the Soft-RoCE VM:
#
#   scripts/perf/cost-runs.sh BENCH LIB OUTDIR N1 N2 PROBE WINDOW
#
# Runs BENCH (nccl-net-bench) on LIB with 8-byte messages, the bandwidth phase only, both
# sides on this host (the connecting side is a child process, followed by
# --trace-children), each process under `valgrind --tool=callgrind`:
#   OUTDIR/n1     N1 messages, instructions collected only inside bw_send / bw_recv
#   OUTDIR/n2     N2 messages, likewise (n2 - n1 cancels every per-run cost)
#   OUTDIR/probe  PROBE idle isend calls (side A) and PROBE idle test calls (side B),
#                 collected only inside probe_idle_send / probe_idle_recv
# Each directory gets callgrind.PID.out per process and bench.log (the bench's output,
# with its `stats` lines: the calls each side made). The transport comes from the
# environment (NCCL_ERDMA_TRANSPORT, NCCL_IB_HCA, ...). $VALGRIND overrides the valgrind
# command (a staged copy in the VM); $COST_RUN_TIMEOUT bounds each run (seconds, 900).
set -euo pipefail

if [[ $# -ne 7 ]]; then
  sed -n '2,/^set -/{/^set -/d;s/^# \{0,1\}//;p}' "$0" >&2
  exit 2
fi
bench=$1 lib=$2 out=$3 n1=$4 n2=$5 probe=$6 window=$7
read -r -a vg <<<"${VALGRIND:-valgrind}"
limit=${COST_RUN_TIMEOUT:-900}

run() { # NAME COLLECT1 COLLECT2 BENCH-ARGS...
  local name=$1 c1=$2 c2=$3 dir=$out/$1 t0=$SECONDS rc=0
  shift 3
  rm -rf "$dir"
  mkdir -p "$dir"
  timeout -k 10 "$limit" "${vg[@]}" --tool=callgrind -q --trace-children=yes \
    --callgrind-out-file="$dir/callgrind.%p.out" \
    --toggle-collect="nccl_net_bench::$c1" --toggle-collect="nccl_net_bench::$c2" \
    "$bench" --lib "$lib" --sizes 8 --window "$window" --phases bw --stats "$@" \
    >"$dir/bench.log" 2>&1 || rc=$?
  if [[ $rc -ne 0 ]]; then
    echo "cost-runs: $name failed (exit $rc); its output:" >&2
    tail -n 30 "$dir/bench.log" >&2
    return 1
  fi
  echo "cost-runs: $name done in $((SECONDS - t0)) s ($(find "$dir" -name 'callgrind.*.out' | wc -l) profiles)"
}

run n1 bw_send bw_recv --iters "$n1"
run n2 bw_send bw_recv --iters "$n2"
run probe probe_idle_send probe_idle_recv --iters 1 --idle-probe "$probe"
