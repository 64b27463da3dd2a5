#!/usr/bin/env bash
# The plugin against perftest on Soft-RoCE: one qemu VM boot (scripts/vm/rxe-vm.sh: rxe0 on a
# dummy netdev, both ends of every connection on it) that measures, interleaved so both see
# the same conditions,
#   - per size: ib_write_bw -d rxe0 -x 1, then nccl-net-bench's bandwidth over the plugin
#     (NCCL_ERDMA_TRANSPORT=verbs NCCL_IB_HCA==rxe0), same payload per measurement;
#   - per size: ib_write_lat -d rxe0 -x 1, then the plugin's latency (and at 8 B ib_send_lat,
#     the floor of a receiver that learns of arrival from a completion);
#   - the plugin's bandwidth at 1 MiB and 4 MiB for NCCL_IB_QPS_PER_CONNECTION=1,2,4,8;
# repeated $PERF_VM_REPS times (medians reported, with their ranges: the VM is emulated and
# its speed follows the host's load). Prints per size perftest GB/s, plugin GB/s and their
# ratio, the latencies and their ratio, the QP table, and checks the targets (>= 1 MiB:
# plugin >= 0.95 x ib_write_bw; 8 B: plugin latency <= 1.25 x ib_write_lat).
#
#   scripts/perf/perf-vm.sh [--lib PATH] [--compare-lib PATH]
#
# --lib PATH measures that NCCL net plugin (any library exporting ncclNetPlugin_v4..v12)
# instead of the built one; --compare-lib PATH measures another one too, right after it at
# every size in the same VM boot, and adds a table of both with the ratio (other / this),
# other.csv and its curve in the plot. Another plugin takes in the VM whatever its own
# settings say (NCCL_IB_HCA==rxe0 and NCCL_SOCKET_IFNAME=lo are set).
#
# Output in $OUT (default target/perf/perf-vm): summary.txt, raw.csv (every measurement),
# perftest.csv and plugin.csv (medians; nccl-net-bench's CSV format), qps.csv, and
# perf-vm.svg (bandwidth and latency against size, plugin and perftest; perf-vm.png too when
# rsvg-convert is installed).
#
# Environment: PERF_VM_SIZES (8,4K,64K,1M,4M), PERF_VM_BYTES (payload per measurement,
# 24M), PERF_VM_REPS (3), PERF_VM_WINDOW (8: the plugin's receives in flight),
# PERF_VM_TX_DEPTH (ib_write_bw -t, default the same as the window: equal work in flight),
# PERF_VM_QPS (1,2,4,8), PERF_VM_QP_SIZES (1M,4M), OUT, and rxe-vm.sh's RXE_VM_*.
set -Eeuo pipefail
trap 'echo "perf-vm: error: line $LINENO: \`$BASH_COMMAND\` failed (exit $?)" >&2; exit 1' ERR

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
# shellcheck source=scripts/common.sh
source scripts/common.sh

help_from_header "$@"
start=$SECONDS
lib_this='' lib_other=''
while (($#)); do
  case $1 in
    --lib | --compare-lib)
      [[ $# -ge 2 && -f $2 ]] || { echo "perf-vm: $1 needs an existing library, not '${2:-}'" >&2; exit 2; }
      if [[ $1 == --lib ]]; then lib_this=$2; else lib_other=$2; fi
      shift 2
      ;;
    *) echo "perf-vm: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

# Sizes in bytes (K/M suffixes allowed), checked here rather than in the VM.
to_bytes() { # LIST -> comma-separated bytes
  local bytes=() list=() s n
  IFS=, read -r -a list <<<"$1"
  for s in "${list[@]}"; do
    case ${s^^} in
      *K) n=$((${s%[kK]} << 10)) ;;
      *M) n=$((${s%[mM]} << 20)) ;;
      *) n=$s ;;
    esac
    [[ $n =~ ^[0-9]+$ && $n -gt 0 ]] || {
      echo "perf-vm: bad size '$s' in '$1'" >&2
      exit 2
    }
    bytes+=("$n")
  done
  (IFS=,; echo "${bytes[*]}")
}
sizes=$(to_bytes "${PERF_VM_SIZES:-8,4K,64K,1M,4M}")
qp_sizes=$(to_bytes "${PERF_VM_QP_SIZES:-1M,4M}")
budget=$(to_bytes "${PERF_VM_BYTES:-24M}")
reps=${PERF_VM_REPS:-3}
window=${PERF_VM_WINDOW:-8}
txdepth=${PERF_VM_TX_DEPTH:-$window}
qps=${PERF_VM_QPS:-1,2,4,8}
for v in "$reps" "$window" "$txdepth"; do
  [[ $v =~ ^[0-9]+$ && $v -gt 0 ]] || {
    echo "perf-vm: PERF_VM_REPS, PERF_VM_WINDOW and PERF_VM_TX_DEPTH must be positive numbers" >&2
    exit 2
  }
done
[[ $qps =~ ^[0-9]+(,[0-9]+)*$ ]] || {
  echo "perf-vm: PERF_VM_QPS must be a list like 1,2,4,8, not '$qps'" >&2
  exit 2
}
out=${OUT:-$root/target/perf/perf-vm}
mkdir -p "$out"
out=$(cd "$out" && pwd)

echo "== perf-vm: build (release)"
ensure_build_deps
build_release
rel=$(cd "$(release_dir)" && pwd)

stage=$(mktemp -d "${TMPDIR:-/tmp}/perf-vm-stage.XXXXXX")
vmlog=$out/vm.log
# shellcheck disable=SC2317 # called by the EXIT trap
cleanup() { rm -rf "$stage"; }
trap cleanup EXIT
cp "$rel/nccl-net-bench" "$stage/"
lib_this=${lib_this:-$rel/libnccl-net-erdma.so}
# Each library in a directory of its own: their names may be the same.
mkdir -p "$stage/lib0" "$stage/lib1"
cp "$lib_this" "$stage/lib0/"
staged_this=./lib0/$(basename "$lib_this") staged_other=''
if [[ -n $lib_other ]]; then
  cp "$lib_other" "$stage/lib1/"
  staged_other=./lib1/$(basename "$lib_other")
fi
cp scripts/perf/perf-vm-inner.sh "$stage/"

# shellcheck disable=SC2016 # $? and $rc are the VM shell's
printf -v inner 'bash perf-vm-inner.sh /tmp/perf %q %q %q %q %q %q %q %q %q; rc=$?
echo "--- perf-vm archive begin"
tar -C /tmp/perf -czf - raw.csv medians.csv perftest.csv plugin.csv other.csv qps.csv summary.txt 2>/dev/null | base64 -w 100
echo "--- perf-vm archive end"
exit $rc' "$reps" "$sizes" "$budget" "$window" "$txdepth" "$qps" "$qp_sizes" "$staged_this" "$staged_other"

echo "== perf-vm: Soft-RoCE VM (scripts/vm/rxe-vm.sh): sizes $sizes, $reps repetitions, ~$((budget >> 20)) MiB per measurement"
vmrc=0
t0=$SECONDS
RXE_VM_TIMEOUT=${RXE_VM_TIMEOUT:-1500} bash scripts/vm/rxe-vm.sh "$stage" "$inner" 2>&1 |
  tee "$vmlog" | sed -u '/^--- perf-vm archive begin/,/^--- perf-vm archive end/d' ||
  vmrc=${PIPESTATUS[0]}
echo "perf-vm: the VM run took $((SECONDS - t0)) s (rxe-vm.sh exit $vmrc)"
if ! grep -q '^--- perf-vm archive end' "$vmlog"; then
  echo "perf-vm: error: the VM run produced no results (log: $vmlog)" >&2
  exit 1
fi
sed -n '/^--- perf-vm archive begin/,/^--- perf-vm archive end/p' "$vmlog" | sed '1d;$d' |
  base64 -d | tar -C "$out" -xzf -

# The picture: the plugin's medians against perftest's, drawn by nccl-net-bench itself.
if [[ -s $out/plugin.csv && -s $out/perftest.csv ]]; then
  others=()
  if [[ -n $lib_other && -s $out/other.csv ]]; then
    others=(--compare "$out/other.csv=$(basename "$lib_other") (window $window)")
  fi
  "$rel/nccl-net-bench" --plot "$out/plugin.csv" --compare "$out/perftest.csv=perftest (ib_write_bw -t $txdepth / ib_write_lat)" \
    "${others[@]}" --label "$(basename "$lib_this"), verbs (window $window)" --svg "$out/perf-vm.svg" --quiet \
    --title "Soft-RoCE rxe0 in a qemu VM: plugin vs perftest (median of $reps)" \
    --note "One VM boot, both tools interleaved per size; ~$((budget >> 20)) MiB per measurement; the plugin keeps $window receives in flight, ib_write_bw -t $txdepth." \
    --note "Bandwidth: plugin = payload / receiver time, perftest = BW average. Latency: plugin = median round trip / 2, perftest = t_typical."
  if command -v rsvg-convert >/dev/null 2>&1; then
    rsvg-convert -o "$out/perf-vm.png" "$out/perf-vm.svg"
  fi
fi
echo "perf-vm: results in $out: $(cd "$out" && find . -maxdepth 1 -type f -printf '%f ' | sort)"
echo "perf-vm: done in $((SECONDS - start)) s"
exit "$vmrc"
