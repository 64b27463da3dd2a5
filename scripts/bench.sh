#!/usr/bin/env bash
# Builds the plugin and nccl-net-bench (release) and runs the benchmark on the built .so.
# Arguments go to nccl-net-bench (see `scripts/bench.sh --help`); without any, both sides run
# on this host over loopback. Without an RDMA device the plugin runs over tcp.
#
#   scripts/bench.sh [--compare-lib OTHER.so] [nccl-net-bench options]
#
# --compare-lib OTHER.so: side by side with another NCCL net plugin (any library exporting
# ncclNetPlugin_v4..v12, e.g. the one a job runs today) in one run: per size, this plugin (or
# --lib) and then the other, interleaved so both see the same conditions, each in its own
# processes with the same options. Prints per size each one's bandwidth and latency and their
# ratios (other / this), writes --csv FILE (this one's rows) and FILE.other.csv (the other's),
# and with --svg FILE draws both curves. Only local runs (no --listen/--connect).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/common.sh
source scripts/common.sh

other=
args=()
while (($#)); do
  case $1 in
    --compare-lib)
      [[ $# -ge 2 ]] || { echo "bench: --compare-lib needs a library path" >&2; exit 2; }
      other=$2
      shift 2
      ;;
    --compare-lib=*) other=${1#*=}; shift ;;
    --lib=* | --sizes=* | --csv=* | --svg=*) args+=("${1%%=*}" "${1#*=}"); shift ;;
    *) args+=("$1"); shift ;;
  esac
done

ensure_build_deps
build_release
out=$(release_dir)
bench=$out/nccl-net-bench
if [[ -z $other ]]; then
  exec "$bench" --lib "$out/libnccl-net-erdma.so" "${args[@]}"
fi
[[ -f $other ]] || { echo "bench: --compare-lib $other: no such file" >&2; exit 2; }

# The options each run gets, and the ones this script handles itself.
ours=$out/libnccl-net-erdma.so
sizes=8,32,128,512,2K,8K,32K,128K,512K,2M,8M,32M,64M # nccl-net-bench's default
csv='' svg='' rest=()
for ((i = 0; i < ${#args[@]}; i++)); do
  a=${args[i]}
  case $a in
    --lib | --sizes | --csv | --svg)
      ((i + 1 < ${#args[@]})) || { echo "bench: $a needs a value" >&2; exit 2; }
      v=${args[i + 1]}
      i=$((i + 1))
      ;;&
    --lib) ours=$v ;;
    --sizes) sizes=$v ;;
    --csv) csv=$v ;;
    --svg) svg=$v ;;
    --listen | --connect | --script | --plot | --listen=* | --connect=* | --script=* | --plot=*)
      echo "bench: --compare-lib runs both sides here: not with $a" >&2
      exit 2
      ;;
    *) rest+=("$a") ;;
  esac
done

work=$(mktemp -d "${TMPDIR:-/tmp}/bench-compare.XXXXXX")
trap 'rm -rf "$work"' EXIT
run() { # WHICH LIB SIZE: one size of one library; its CSV row appended to WHICH.csv
  local which=$1 lib=$2 size=$3
  if ! "$bench" --lib "$lib" --sizes "$size" --csv "$work/one.csv" "${rest[@]}" >"$work/$which.log" 2>&1; then
    echo "bench: $lib at $size failed:" >&2
    tail -n 5 "$work/$which.log" >&2
    exit 1
  fi
  [[ -s $work/$which.csv ]] || head -n 1 "$work/one.csv" >"$work/$which.csv"
  tail -n +2 "$work/one.csv" >>"$work/$which.csv"
  # The library line names the plugin and the table it uses.
  [[ -s $work/$which.name ]] || sed -n 's/^library: *//p' "$work/$which.log" | head -n 1 >"$work/$which.name"
}
IFS=, read -r -a size_list <<<"$sizes"
for s in "${size_list[@]}"; do
  run this "$ours" "$s"
  run other "$other" "$s"
done

echo "this:  $(cat "$work/this.name")"
echo "other: $(cat "$work/other.name")"
echo "options: ${rest[*]:-(defaults)}; per size this one, then the other, each in its own processes"
paste -d, "$work/this.csv" "$work/other.csv" | awk -F, '
  function human(s) {
    if (s >= 1048576 && s % 1048576 == 0) return (s / 1048576) " MiB"
    if (s >= 1024 && s % 1024 == 0) return (s / 1024) " KiB"
    return s " B"
  }
  function ratio(a, b) { return (a != "" && b != "" && a > 0) ? sprintf("%.2f", b / a) : "-" }
  NR == 1 {
    printf "%10s %12s %12s %7s %12s %12s %7s\n", "size", "this GB/s", "other GB/s", "o/t", "this lat us", "other lat us", "o/t"
    next
  }
  { printf "%10s %12s %12s %7s %12s %12s %7s\n", human($1), $2, $5, ratio($2, $5), $3, $6, ratio($3, $6) }'
if [[ -n $csv ]]; then
  cp "$work/this.csv" "$csv"
  cp "$work/other.csv" "$csv.other.csv"
  echo "csv: $csv, $csv.other.csv"
fi
if [[ -n $svg ]]; then
  label() { sed 's/.*plugin "\([^"]*\)").*/\1/' "$work/$1.name"; }
  "$bench" --plot "$work/this.csv" --label "$(label this) ($(basename "$ours"))" \
    --compare "$work/other.csv=$(label other) ($(basename "$other"))" --svg "$svg" --quiet \
    --title "$(label this) vs $(label other), interleaved per size" \
    --note "Each size: $(basename "$ours"), then $(basename "$other"); options: ${rest[*]:-(defaults)}."
  echo "svg: $svg"
fi
