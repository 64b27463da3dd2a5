#!/usr/bin/env bash
# CPU cost of the plugin per message, as instructions counted by callgrind (deterministic: the
# same code path executes the same instructions, whatever the machine's load).
#
#   scripts/cpu-cost.sh [tcp] [verbs]       (default: both)
#
# What runs: nccl-net-bench with 8-byte messages, window $CPU_COST_WINDOW (8), bandwidth phase
# only, both sides on one host, each process under `valgrind --tool=callgrind`, collecting
# only inside the bench's send loop (side A: isend + test) and receive loop (side B: irecv +
# test), twice: with N1 and N2 messages ($CPU_COST_MSGS, 2000,4000). Every figure is
# (count at N2 - count at N1) / (N2 - N1), so setup and one-off costs cancel. A third run,
# the idle probe, makes $CPU_COST_PROBE (4000) isend calls that must return NULL and as many
# test calls of a receive not yet sent to: the cost of one idle call, used to split the
# measured cost into idle polling and work.
#   tcp    on this host (loopback);
#   verbs  inside the Soft-RoCE VM (scripts/rxe-vm.sh: rxe0, both sides in the VM), with
#          this host's valgrind staged into it (the VM's rootfs has none and no network).
# "The plugin's own code" is every instruction whose code lies in libnccl_net_erdma.so (our
# Rust, with the std code compiled into it); libc (syscall wrappers, memcpy), libibverbs and
# its provider are reported separately, and the kernel is not counted at all (callgrind sees
# user space only). Also reported: allocations (calls of malloc & co.) and lock slow paths
# (parking_lot *_slow, futex) per message, the plugin's entry points with their calls per
# message, and the hottest functions and source lines.
#
# Output: the report on stdout and, in $OUT (default target/perf/cpu-cost), cpu-cost.txt,
# cpu-cost.csv and the raw callgrind profiles (callgrind_annotate can read them).
# Environment: CPU_COST_MSGS, CPU_COST_PROBE, CPU_COST_WINDOW, OUT, CPU_COST_REPORT_ONLY=1
# (no runs: report again from the profiles already in $OUT), and rxe-vm.sh's RXE_VM_*.
set -Eeuo pipefail
trap 'echo "cpu-cost: error: line $LINENO: \`$BASH_COMMAND\` failed (exit $?)" >&2; exit 1' ERR

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
# shellcheck source=scripts/common.sh
source scripts/common.sh

help_from_header "$@"
transports=("$@")
[[ ${#transports[@]} -gt 0 ]] || transports=(tcp verbs)
for t in "${transports[@]}"; do
  [[ $t == tcp || $t == verbs ]] || {
    echo "cpu-cost: unknown transport '$t' (tcp, verbs)" >&2
    exit 2
  }
done
IFS=, read -r n1 n2 <<<"${CPU_COST_MSGS:-2000,4000}"
probe=${CPU_COST_PROBE:-4000}
window=${CPU_COST_WINDOW:-8}
[[ $n1 =~ ^[0-9]+$ && $n2 =~ ^[0-9]+$ && $n2 -gt $n1 && $n1 -gt 0 ]] || {
  echo "cpu-cost: CPU_COST_MSGS must be N1,N2 with 0 < N1 < N2, not '${CPU_COST_MSGS:-}'" >&2
  exit 2
}
out=${OUT:-$root/target/perf/cpu-cost}
mkdir -p "$out"
out=$(cd "$out" && pwd)
start=$SECONDS

if [[ ${CPU_COST_REPORT_ONLY:-0} != 1 ]]; then
  ensure_build_deps
  ensure_packages valgrind
  echo "== cpu-cost: valgrind $(valgrind --version 2>/dev/null || echo '?'); perf stat -e instructions on this host:" \
    "$( (perf stat -x, -e instructions true 2>&1 >/dev/null || true) | awk -F, '/instructions/ {print ($1 ~ /not supported|not counted/ ? "not supported (no PMU in this VM)" : "available"); f=1} END {if (!f) print "perf not installed"}')"
  echo "== cpu-cost: build (release)"
  build_release
fi
rel=$(cd "$(release_dir)" && pwd)
bench=$rel/nccl-net-bench
lib=$rel/libnccl-net-erdma.so

report=$out/cpu-cost.txt
csv=$out/cpu-cost.csv
: >"$report"
echo "transport,side,plugin_ir_per_msg,plugin_work_ir_per_msg,libc_ir_per_msg,verbs_ir_per_msg,posts_per_msg,null_posts_per_msg,tests_per_msg,idle_tests_per_msg,plugin_allocs_per_msg" >"$csv"

# Sums the profiles of DIR/{n1,n2,probe} and prints the report for NAME.
analyze() { # NAME DIR
  local name=$1 dir=$2 r f side
  for r in n1 n2 probe; do
    for f in "$dir/$r"/callgrind.*.out; do
      [[ -e $f ]] || {
        echo "cpu-cost: no callgrind profiles in $dir/$r" >&2
        return 1
      }
      side=A
      grep -q '^cmd:.* --connect ' "$f" && side=B
      awk -v plugin='libnccl[-_]net[-_]erdma' -f scripts/perf/callgrind-sum.awk "$f" >"$dir/$r/$side.tsv"
    done
    # The bench's `stats` lines: the calls each side made.
    awk '/^stats / {
      side = ""
      for (i = 2; i <= NF; i++) {
        if ($i == "per_message:") break
        split($i, kv, "=")
        if (kv[1] == "side") { side = kv[2]; continue }
        k = kv[1]; sub(/^(isend|irecv)/, "post", k)
        if (side != "" && k ~ /^(post|post_null|test|test_idle)$/) printf "%s:%s\t%s\n", side, k, kv[2]
      }
    }' "$dir/$r/bench.log" >"$dir/$r/stats.tsv"
    [[ -s $dir/$r/stats.tsv || $r == probe ]] || {
      echo "cpu-cost: no stats lines in $dir/$r/bench.log" >&2
      return 1
    }
  done
  for f in n1/A n1/B n2/A n2/B probe/A probe/B; do
    [[ -s $dir/$f.tsv ]] || {
      echo "cpu-cost: missing profile $dir/$f (both sides must run under callgrind)" >&2
      return 1
    }
  done
  awk -v n1="$n1" -v n2="$n2" -v probe="$probe" -v name="$name" -v root="$root" -v csv="$csv" \
    -f scripts/perf/cost-report.awk \
    tag=A1 "$dir/n1/A.tsv" tag=A2 "$dir/n2/A.tsv" tag=B1 "$dir/n1/B.tsv" tag=B2 "$dir/n2/B.tsv" \
    tag=PA "$dir/probe/A.tsv" tag=PB "$dir/probe/B.tsv" \
    tag=S1 "$dir/n1/stats.tsv" tag=S2 "$dir/n2/stats.tsv" | tee -a "$report"
}

status=0
for t in "${transports[@]}"; do
  dir=$out/$t
  if [[ ${CPU_COST_REPORT_ONLY:-0} == 1 ]]; then
    case $t in
      tcp) analyze "tcp (host, loopback)" "$dir" || status=1 ;;
      verbs) analyze "verbs (rxe0 in the Soft-RoCE VM)" "$dir" || status=1 ;;
    esac
    continue
  fi
  rm -rf "$dir"
  mkdir -p "$dir"
  t0=$SECONDS
  case $t in
    tcp)
      echo "== cpu-cost: tcp on this host (loopback), $n1 and $n2 messages + idle probe under callgrind"
      if ! NCCL_ERDMA_TRANSPORT=tcp NCCL_SOCKET_IFNAME=lo \
        bash scripts/perf/cost-runs.sh "$bench" "$lib" "$dir" "$n1" "$n2" "$probe" "$window"; then
        status=1
        continue
      fi
      analyze "tcp (host, loopback)" "$dir" || status=1
      ;;
    verbs)
      echo "== cpu-cost: verbs on rxe0 in the Soft-RoCE VM, with this host's valgrind staged in"
      stage=$(mktemp -d "${TMPDIR:-/tmp}/cpu-cost-stage.XXXXXX")
      vmlog=$dir/vm.log
      mkdir -p "$stage/vg/lib"
      cp "$bench" "$stage/nccl-net-bench"
      cp "$lib" "$stage/libnccl-net-erdma.so"
      cp scripts/perf/cost-runs.sh "$stage/"
      vgbin=$(command -v valgrind.bin || true)
      vglib=/usr/libexec/valgrind
      if [[ -z $vgbin || ! -e $vglib/callgrind-amd64-linux ]]; then
        echo "cpu-cost: cannot find valgrind.bin and $vglib/callgrind-amd64-linux to stage; skipping verbs" >&2
        rm -rf "$stage"
        status=1
        continue
      fi
      cp "$vgbin" "$stage/vg/valgrind"
      cp "$vglib/callgrind-amd64-linux" "$vglib/vgpreload_core-amd64-linux.so" "$vglib/default.supp" "$stage/vg/lib/"
      # The inner command: the same runs as on the host, then the profiles back as base64.
      inner="export VALGRIND_LIB=/opt/work/vg/lib VALGRIND=/opt/work/vg/valgrind NCCL_ERDMA_TRANSPORT=verbs NCCL_IB_HCA==rxe0 COST_RUN_TIMEOUT=${COST_RUN_TIMEOUT:-900}
bash cost-runs.sh ./nccl-net-bench ./libnccl-net-erdma.so /tmp/cost $n1 $n2 $probe $window || exit 1
echo '--- cost-runs archive begin'
tar -C /tmp/cost -czf - . | base64 -w 100
echo '--- cost-runs archive end'"
      # Streamed as it runs, without the archive.
      vmrc=0
      RXE_VM_TIMEOUT=${RXE_VM_TIMEOUT:-1500} bash scripts/rxe-vm.sh "$stage" "$inner" 2>&1 |
        tee "$vmlog" | sed -u '/^--- cost-runs archive begin/,/^--- cost-runs archive end/d; s/^/  vm| /' ||
        vmrc=${PIPESTATUS[0]}
      rm -rf "$stage"
      if [[ $vmrc -ne 0 ]] || ! grep -q '^--- cost-runs archive end' "$vmlog"; then
        echo "cpu-cost: the VM run failed (rxe-vm.sh exit $vmrc; log $vmlog)" >&2
        status=1
        continue
      fi
      sed -n '/^--- cost-runs archive begin/,/^--- cost-runs archive end/p' "$vmlog" | sed '1d;$d' |
        base64 -d | tar -C "$dir" -xzf -
      analyze "verbs (rxe0 in the Soft-RoCE VM)" "$dir" || status=1
      ;;
  esac
  echo "cpu-cost: $t took $((SECONDS - t0)) s"
done

{
  echo
  echo "== notes"
  echo "  Ir = instructions executed in user space (callgrind); the kernel (syscalls, rxe's soft"
  echo "  RoCE in the VM) is not counted. 'work only' subtracts the measured idle calls (NULL"
  echo "  isends, not-done tests) at the idle-probe cost per call; 'as measured' depends on how"
  echo "  often a side polled while waiting for the other, which varies from run to run."
  echo "  Target: verbs <= 1,500 Ir of the plugin's own code per message (isend + irecv + test,"
  echo "  both sides): compare the 'both' column."
} | tee -a "$report"
echo "cpu-cost: report $report, csv $csv, profiles under $out/<transport>/{n1,n2,probe} ($((SECONDS - start)) s in all)"
exit "$status"
