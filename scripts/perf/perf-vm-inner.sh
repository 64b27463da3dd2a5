#!/usr/bin/env bash
# The part of scripts/perf/perf-vm.sh that runs inside the Soft-RoCE VM (from the stage directory,
# next to nccl-net-bench and libnccl-net-erdma.so):
#
#   bash perf-vm-inner.sh OUTDIR REPS SIZES BYTES WINDOW TXDEPTH QPS QPSIZES LIB [OTHER]
#
# For each of REPS repetitions and each size of SIZES (bytes, comma-separated), one after the
# other so both see the same conditions: ib_write_bw, then the plugin's bandwidth; then per
# size ib_write_lat, then the plugin's latency (at 8 B also ib_send_lat). Then, per
# repetition, the plugin's bandwidth at QPSIZES for each NCCL_IB_QPS_PER_CONNECTION in QPS.
# Each measurement moves about BYTES payload bytes (at least 16 messages); the plugin keeps
# WINDOW receives in flight and perftest TXDEPTH writes. Writes OUTDIR/raw.csv (every
# measurement), perftest.csv and plugin.csv (medians, in nccl-net-bench's CSV format),
# qps.csv and summary.txt, and prints the tables. LIB is the plugin measured; OTHER, where
# given, another plugin measured right after it at every size (other.csv, its own table).
set -uo pipefail

[[ $# -eq 9 || $# -eq 10 ]] || {
  sed -n '2,/^set -/{/^set -/d;s/^# \{0,1\}//;p}' "$0" >&2
  exit 2
}
out=$1 reps=$2 sizes=$3 budget=$4 window=$5 txdepth=$6 qps_list=$7 qp_sizes=$8 lib=$9 other=${10:-}
mkdir -p "$out"
raw=$out/raw.csv
echo "tool,metric,size_bytes,qps,rep,value" >"$raw"
export NCCL_ERDMA_TRANSPORT=verbs NCCL_IB_HCA='=rxe0' NCCL_SOCKET_IFNAME=lo
# Each library's name and table, as the bench states them.
named() { ./nccl-net-bench --lib "$1" --sizes 8 --iters 1 --phases lat 2>/dev/null | sed -n 's/^library: *//p'; }
lib_name=$(named "$lib")
other_name=
[[ -z $other ]] || other_name=$(named "$other")
IFS=, read -r -a size_list <<<"$sizes"
IFS=, read -r -a qp_list <<<"$qps_list"
failures=0

bw_iters() { # SIZE: BYTES worth of messages, at least 16, at most 20000
  local n=$((budget / ($1 > 0 ? $1 : 1)))
  ((n < 16)) && n=16
  ((n > 20000)) && n=20000
  echo "$n"
}
lat_iters() { # SIZE: BYTES in all (both directions), 5..2000 round trips
  local n=$((budget / 2 / ($1 > 0 ? $1 : 1)))
  ((n < 5)) && n=5
  ((n > 2000)) && n=2000
  echo "$n"
}
record() { echo "$1,$2,$3,$4,$5,$6" >>"$raw"; }

# perftest: the server in the background, then the client; a fresh port and another try when
# the pair fails (port taken, startup race), each side under a timeout. Prints the client's
# result line (the one after the "#bytes" header).
port=18600
perftest_pair() { # NAME HOST ARGS...
  local name=$1 host=$2 attempt srv i line
  shift 2
  for attempt in 1 2 3; do
    port=$((port + 1))
    timeout -k 5 120 "$@" -p "$port" >"$out/$name.srv" 2>&1 &
    srv=$!
    for ((i = 0; i < 100; i++)); do
      ss -Hltn "sport = :$port" 2>/dev/null | grep -q . && break
      kill -0 "$srv" 2>/dev/null || break
      sleep 0.05
    done
    if timeout -k 5 120 "$@" -p "$port" "$host" >"$out/$name.cli" 2>&1 && wait "$srv"; then
      line=$(awk '/#bytes/ { getline; print; exit }' "$out/$name.cli")
      if [[ -n $line ]]; then
        echo "$line"
        return 0
      fi
    fi
    kill "$srv" 2>/dev/null
    wait "$srv" 2>/dev/null
    echo "perf-vm: $name attempt $attempt (port $port) failed: $(tail -n 2 "$out/$name.cli" | tr '\n' ' ')" >&2
    sleep 1
  done
  return 1
}

# A plugin (LIB), one size, one phase; prints GB/s or us.
plugin_run() { # LIB PHASE SIZE ITERS [ENV...]
  local which=$1 phase=$2 size=$3 iters=$4 col rc=0
  shift 4
  rm -f "$out/bench.csv"
  env "$@" timeout -k 5 300 ./nccl-net-bench --lib "$which" --quiet --sizes "$size" --iters "$iters" --window "$window" \
    --phases "$phase" --csv "$out/bench.csv" >"$out/bench.log" 2>&1 || rc=$?
  if [[ $rc -ne 0 ]]; then
    echo "perf-vm: nccl-net-bench ($which, $phase, $size B, $*) failed (exit $rc): $(tail -n 3 "$out/bench.log" | tr '\n' ' ')" >&2
    return 1
  fi
  col=2
  [[ $phase == lat ]] && col=3
  awk -F, -v c="$col" 'NR == 2 { print $c }' "$out/bench.csv"
}

# Measures and records one figure of a plugin (TOOL: plugin or other), or counts a failure.
measure() { # TOOL LIB PHASE SIZE ITERS QPS REP [ENV...]
  local tool=$1 which=$2 phase=$3 size=$4 iters=$5 qps=$6 rep=$7 v
  shift 7
  if v=$(plugin_run "$which" "$phase" "$size" "$iters" "$@"); then
    record "$tool" "$phase" "$size" "$qps" "$rep" "$v"
  else
    failures=$((failures + 1))
  fi
}

t_start=$(date +%s)
for ((rep = 1; rep <= reps; rep++)); do
  echo "perf-vm: repetition $rep of $reps ($(($(date +%s) - t_start)) s)"
  for size in "${size_list[@]}"; do
    n=$(bw_iters "$size")
    if line=$(perftest_pair ib_write_bw 198.18.0.1 ib_write_bw -d rxe0 -x 1 -s "$size" -n "$n" -t "$txdepth"); then
      # BW average is MiB/s.
      record perftest bw "$size" default "$rep" "$(awk '{ printf "%.6f", $4 * 1048576 / 1e9 }' <<<"$line")"
    else
      failures=$((failures + 1))
    fi
    measure plugin "$lib" bw "$size" "$n" default "$rep"
    [[ -z $other ]] || measure other "$other" bw "$size" "$n" default "$rep"
  done
  for size in "${size_list[@]}"; do
    n=$(lat_iters "$size")
    if line=$(perftest_pair ib_write_lat 127.0.0.1 ib_write_lat -d rxe0 -x 1 -s "$size" -n "$n"); then
      record perftest lat "$size" default "$rep" "$(awk '{ print $5 }' <<<"$line")" # t_typical
    else
      failures=$((failures + 1))
    fi
    measure plugin "$lib" lat "$size" "$n" default "$rep"
    [[ -z $other ]] || measure other "$other" lat "$size" "$n" default "$rep"
    # The floor of a receiver that learns of arrival from a completion queue entry (as
    # NCCL's IB transport and this plugin do), where ib_write_lat polls memory instead.
    if ((size == 8)); then
      if line=$(perftest_pair ib_send_lat 127.0.0.1 ib_send_lat -d rxe0 -x 1 -s "$size" -n "$n"); then
        record perftest_send lat "$size" default "$rep" "$(awk '{ print $5 }' <<<"$line")"
      else
        failures=$((failures + 1))
      fi
    fi
  done
  for q in "${qp_list[@]}"; do
    for size in ${qp_sizes//,/ }; do
      measure plugin "$lib" bw "$size" "$(bw_iters "$size")" "$q" "$rep" NCCL_IB_QPS_PER_CONNECTION="$q"
    done
  done
done
echo "perf-vm: measurements done in $(($(date +%s) - t_start)) s, $failures failed"

# Medians (and ranges) per tool, metric, size and QP count.
awk -F, 'NR > 1 { k = $1 "," $2 "," $3 "," $4; n[k]++; v[k, n[k]] = $6 + 0 }
  END {
    for (k in n) {
      m = n[k]
      for (i = 2; i <= m; i++) for (j = i; j > 1 && v[k, j] < v[k, j - 1]; j--) {
        t = v[k, j]; v[k, j] = v[k, j - 1]; v[k, j - 1] = t
      }
      med = (m % 2) ? v[k, (m + 1) / 2] : (v[k, m / 2] + v[k, m / 2 + 1]) / 2
      printf "%s,%.6f,%.6f,%.6f,%d\n", k, med, v[k, 1], v[k, m], m
    }
  }' "$raw" | sort -t, -k1,1 -k2,2 -k4,4n -k3,3n >"$out/medians.csv"

med() { # TOOL METRIC SIZE QPS -> median or empty
  awk -F, -v k="$1,$2,$3,$4" '$1 "," $2 "," $3 "," $4 == k { print $5; exit }' "$out/medians.csv"
}
range() { # TOOL METRIC SIZE QPS -> "min..max"
  awk -F, -v k="$1,$2,$3,$4" '$1 "," $2 "," $3 "," $4 == k { printf "%s..%s", $6 + 0, $7 + 0; exit }' "$out/medians.csv"
}
best() { # TOOL METRIC SIZE QPS -> the best value (bandwidth: max, latency: min)
  awk -F, -v k="$1,$2,$3,$4" -v m="$2" '$1 "," $2 "," $3 "," $4 == k { print (m == "lat" ? $6 : $7); exit }' "$out/medians.csv"
}
num() { awk -v v="$1" 'BEGIN { if (v == "") print "-"; else if (v >= 100) printf "%.1f", v; else if (v >= 1) printf "%.2f", v; else printf "%.6f", v }'; }
human() {
  local s=$1
  if ((s >= 1048576 && s % 1048576 == 0)); then echo "$((s / 1048576)) MiB"
  elif ((s >= 1024 && s % 1024 == 0)); then echo "$((s / 1024)) KiB"
  else echo "$s B"; fi
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a != "" && b != "" && b > 0) printf "%.2f", a / b; else printf "-" }'; }

tools=(perftest plugin)
[[ -z $other ]] || tools+=(other)
for tool in "${tools[@]}"; do
  echo "size_bytes,bandwidth_gbps,latency_us" >"$out/$tool.csv"
  for size in "${size_list[@]}"; do
    echo "$size,$(med "$tool" bw "$size" default),$(med "$tool" lat "$size" default)" >>"$out/$tool.csv"
  done
done

{
  echo
  echo "== Soft-RoCE (rxe0, qemu TCG): plugin (verbs) vs perftest, same VM run, $reps repetitions"
  echo "   plugin: $lib_name"
  echo "   (the plugin keeps $window receives in flight, ib_write_bw -t $txdepth writes; ~$((budget >> 20)) MiB per measurement;"
  echo "    median of the repetitions, and the best one: bandwidth max, latency min)"
  printf "%8s %12s %12s %6s | %12s %12s %6s | %s\n" size "perftest" "plugin" ratio "best perftest" "best plugin" ratio "target: >= 1 MiB, ratio >= 0.95"
  printf "%8s %12s %12s %6s | %12s %12s %6s |\n" "" "GB/s" "GB/s" "" "GB/s" "GB/s" ""
  for size in "${size_list[@]}"; do
    p=$(med perftest bw "$size" default)
    q=$(med plugin bw "$size" default)
    bp=$(best perftest bw "$size" default)
    bq=$(best plugin bw "$size" default)
    r=$(ratio "$q" "$p")
    rb=$(ratio "$bq" "$bp")
    verdict=-
    if ((size >= 1048576)) && [[ $r != - ]]; then
      verdict=$(awk -v r="$r" -v b="$rb" 'BEGIN { printf "%s (best: %s)", (r >= 0.95 ? "met" : "MISSED"), (b >= 0.95 ? "met" : "missed") }')
    fi
    printf "%8s %12s %12s %6s | %12s %12s %6s | %s\n" "$(human "$size")" "$(num "$p")" "$(num "$q")" "$r" \
      "$(num "$bp")" "$(num "$bq")" "$rb" "$verdict"
  done
  echo
  printf "%8s %12s %12s %6s | %12s %12s %6s | %s\n" size "perftest" "plugin" ratio "best perftest" "best plugin" ratio "target: 8 B, ratio <= 1.25"
  printf "%8s %12s %12s %6s | %12s %12s %6s |\n" "" "us" "us" "" "us" "us" ""
  for size in "${size_list[@]}"; do
    p=$(med perftest lat "$size" default)
    q=$(med plugin lat "$size" default)
    bp=$(best perftest lat "$size" default)
    bq=$(best plugin lat "$size" default)
    r=$(ratio "$q" "$p")
    rb=$(ratio "$bq" "$bp")
    verdict=-
    if ((size == 8)) && [[ $r != - ]]; then
      verdict=$(awk -v r="$r" -v b="$rb" 'BEGIN { printf "%s (best: %s)", (r <= 1.25 ? "met" : "MISSED"), (b <= 1.25 ? "met" : "missed") }')
    fi
    printf "%8s %12s %12s %6s | %12s %12s %6s | %s\n" "$(human "$size")" "$(num "$p")" "$(num "$q")" "$r" \
      "$(num "$bp")" "$(num "$bq")" "$rb" "$verdict"
  done
  echo "   (latency: ib_write_lat t_typical, one way; plugin: median round trip / 2)"
  p=$(med perftest_send lat 8 default)
  q=$(med plugin lat 8 default)
  if [[ -n $p ]]; then
    echo "   8 B against ib_send_lat (send/receive, completions on both sides: the floor of a"
    echo "   receiver that learns of arrival from a completion queue, as NCCL's IB transport's does):"
    echo "   $(num "$p") us [$(range perftest_send lat 8 default)], plugin/ib_send_lat $(ratio "$q" "$p")"
  fi
  echo
  echo "== plugin bandwidth (GB/s) vs NCCL_IB_QPS_PER_CONNECTION (window $window; median of $reps [min..max])"
  printf "%10s" "QPs/conn"
  for size in ${qp_sizes//,/ }; do printf " %28s" "$(human "$size")"; done
  echo
  echo "qps,size_bytes,bandwidth_gbps_median,min,max" >"$out/qps.csv"
  for q in "${qp_list[@]}"; do
    printf "%10s" "$q"
    for size in ${qp_sizes//,/ }; do
      v=$(med plugin bw "$size" "$q")
      printf " %28s" "$(num "$v") [$(range plugin bw "$size" "$q")]"
      echo "$q,$size,$v,$(range plugin bw "$size" "$q" | sed 's/\.\./,/')" >>"$out/qps.csv"
    done
    echo
  done
  printf "%10s" "perftest"
  for size in ${qp_sizes//,/ }; do
    v=$(med perftest bw "$size" default)
    printf " %28s" "$(num "$v") [$(range perftest bw "$size" default)]"
  done
  echo "   (ib_write_bw, 1 QP, -t $txdepth, same run)"
  if [[ -n $other ]]; then
    echo
    echo "== the other plugin, measured right after this one at every size (median of $reps)"
    echo "   this:  $lib_name"
    echo "   other: $other_name"
    printf "%8s %12s %12s %6s | %12s %12s %6s\n" size "this" "other" "o/t" "this" "other" "o/t"
    printf "%8s %12s %12s %6s | %12s %12s %6s\n" "" "GB/s" "GB/s" "" "lat us" "lat us" ""
    for size in "${size_list[@]}"; do
      p=$(med plugin bw "$size" default)
      q=$(med other bw "$size" default)
      lp=$(med plugin lat "$size" default)
      lq=$(med other lat "$size" default)
      printf "%8s %12s %12s %6s | %12s %12s %6s\n" "$(human "$size")" "$(num "$p")" "$(num "$q")" "$(ratio "$q" "$p")" \
        "$(num "$lp")" "$(num "$lq")" "$(ratio "$lq" "$lp")"
    done
  fi
  echo "perf-vm: $failures measurement(s) failed"
} | tee "$out/summary.txt"
[[ $failures -eq 0 ]]
