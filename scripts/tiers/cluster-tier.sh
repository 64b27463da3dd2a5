#!/usr/bin/env bash
# The two-host cluster tier (called by scripts/test.sh after the Soft-RoCE tier): the
# plugin between two Soft-RoCE VMs joined by real (virtual) links, two rails each, with
# faults injected on the RDMA path while the bootstrap link stays up.
#
#   scripts/tiers/cluster-tier.sh [CASE ...]
#
# On the host: builds the release .so, the info command and the cluster test executable
# (tests/cluster), and stages them. scripts/vm/cluster-vm.sh boots the two hosts; on each, every
# case of tests/cluster runs in its own process (`cluster --exact CASE`), both hosts in step
# over a control connection; host 2 injects the faults on itself. Each case prints one
# `cluster: RESULT case=... host=N ...` line per host (what the plugin did, time to
# completion or error, bytes verified) and one `cluster-tier: PASS|FAIL case (seconds)` line.
# The last case powers host 2 off (a host vanishing). The exit code is non-zero if a case
# failed on either host, or the pair did not boot. Before each case, and after a case
# that failed, both hosts check that their three links still reach the peer (ARP); when one
# has died (`cluster-tier: LOST`, with the links' counters) the cases not yet run go again on
# a freshly booted pair, three rounds at most: a case the links died before is run again,
# one that failed before they were found dead counts as failed (a rerun never turns a
# failure into a pass). The tier says how many cases it reran, and why.
#
# Without arguments every case runs, in the order of tests/cluster; CASE names pick some.
# Environment: CLUSTER_TIER_CASE_TIMEOUT (seconds per case and host, 300), SOAK_ROUNDS (the
# soak case's rounds, 6; its time limit grows with them),
# CLUSTER_TIER_LOSE_LINKS_AFTER=CASE (tests the rerun: in round 1, host 2's raila drops
# everything after CASE), and scripts/vm/cluster-vm.sh's CLUSTER_VM_* settings
# (CLUSTER_VM_TIMEOUT: each round; by default enough for the cases and the soak's rounds).
set -Eeuo pipefail
trap 'echo "cluster-tier: error: line $LINENO: \`$BASH_COMMAND\` failed (exit $?)" >&2; exit 1' ERR

root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
# shellcheck source=scripts/common.sh
source scripts/common.sh
help_from_header "${1:-}"

# Run alone on a fresh machine, it installs what the build needs (as scripts/test.sh does).
ensure_build_deps
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

# The cases, in the order the test file declares them (the vanishing host goes last); a
# CASE named on the command line is its full name or the name of its function, and one that
# names no case is an error (it would pass without running).
mapfile -t all < <("$exe" --list --ignored 2>/dev/null | sed -n 's/: test$//p')
if [[ $# -gt 0 ]]; then
  cases=()
  for want in "$@"; do
    found=
    for c in "${all[@]}"; do
      [[ $c == "$want" || $c == *"::$want" ]] && found=$c
    done
    [[ -n $found ]] || {
      echo "cluster-tier: error: no case $want in $exe_name (--list shows them)" >&2
      exit 1
    }
    cases+=("$found")
  done
else
  cases=("${all[@]}")
fi
[[ ${#cases[@]} -gt 0 ]] || {
  echo "cluster-tier: error: no cases found in $exe_name" >&2
  exit 1
}
case_timeout=${CLUSTER_TIER_CASE_TIMEOUT:-300}
soak_rounds=${SOAK_ROUNDS:-6}
soak_timeout=$((60 + 30 * soak_rounds))
((soak_timeout > case_timeout)) || soak_timeout=$case_timeout
# A round of the pair: about 20 s a case (the links checked before each) and the soak's.
export CLUSTER_VM_TIMEOUT=${CLUSTER_VM_TIMEOUT:-$((300 + 20 * ${#cases[@]} + 30 * soak_rounds))}

# What each host runs: the cases it is given, in order, one process each, with a result line
# per case. Before the first case, and after each that fails (but the one that powers host 2
# off), the host checks that all three links still reach the peer: a link that died under the
# emulation (it has happened in CI: a qemu socket link that stopped carrying frames mid-run,
# so every later case failed) is reported as `LOST case` with the links' counters, and the
# host stops (exit 99) so that the tier reruns the case and the rest on a freshly booted pair.
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
# Each link answers a fresh ARP exchange with the peer (both directions) within 30 s: the
# peer may still be finishing the case, with its faults in place, for a while. Forks are
# slow in the VM (~70 ms), so one 'ip neigh' a round.
links_ok() {
  local left="mgmt:\$CLUSTER_PEER_MGMT raila:\$CLUSTER_PEER_RAILA railb:\$CLUSTER_PEER_RAILB" n i up still
  for n in \$left; do ip neigh flush to "\${n#*:}" dev "\${n%%:*}" 2>/dev/null; done
  for i in \$(seq 150); do
    # A link that answered once is done: its entry may go stale again before the others answer.
    up=\$(ip neigh show nud reachable)
    still=
    for n in \$left; do
      [[ \$'\n'\$up == *\$'\n'"\${n#*:} dev \${n%%:*} "* ]] && continue
      still+=" \$n"
      { echo probe >"/dev/udp/\${n#*:}/9"; } 2>/dev/null # the discard port: only the ARP matters
    done
    left=\$still
    [[ -z \$left ]] && return 0
    sleep 0.2
  done
  for n in \$left; do echo -n " \${n%%:*}"; done
  return 1
}
lost() { # CASE WHY: the links died before CASE ran (it runs again), or "after CASE" (failed)
  echo "cluster-tier: LOST \$1 (\$2)"
  for n in mgmt raila railb; do
    ip -s link show dev "\$n"
    ip neigh show dev "\$n"
  done | sed 's/^/  /'
  cat /sys/class/infiniband/rxe*/ports/1/hw_counters/{rcvd_pkts,sent_pkts,retry_exceeded_err} 2>/dev/null |
    paste -sd' ' | sed 's/^/  rxe0, rxe1 received, sent, retries exceeded: /'
  exit 99
}
reset
for c in "\$@"; do
  # Links that died after the last case (a qemu link that stops carrying frames) are found
  # before this one runs: it runs again on a fresh pair, and its result is not lost to them.
  dead=\$(links_ok) || lost "\$c" "before it: no ARP answer from the peer on\$dead within 30 s"
  t0=\$(date +%s.%N)
  limit=$case_timeout
  [[ \$c == soak* ]] && limit=$soak_timeout
  if timeout -k 5 \$limit ./$exe_name --exact "\$c" --ignored --nocapture --test-threads=1 \\
      >"/tmp/\$c.log" 2>&1; then
    status=PASS
  else
    status=FAIL
    failed=\$((failed + 1))
  fi
  t1=\$(date +%s.%N)
  grep -oE '(cluster: RESULT|soak: (round|log)).*' "/tmp/\$c.log" || true
  if [[ \$status == FAIL ]]; then
    tail -n 40 "/tmp/\$c.log"
  fi
  reset # the next case starts from a clean host
  # Test hook of this script's rerun: the links "die" after this case in the first round.
  if [[ \$c == "\${CLUSTER_TIER_LOSE_LINKS_AFTER:-}" && \$CLUSTER_TIER_ROUND == 1 && \$CLUSTER_HOST_ID == 2 ]]; then
    tc qdisc add dev raila root netem loss 100%
  fi
  echo "cluster-tier: \$status \$c (\$(awk -v a="\$t0" -v b="\$t1" 'BEGIN { printf "%.1f", b - a }') s)"
  # A case that passed has shown the links work (if they die at its end, the next case fails
  # and finds out); after one that failed, the links are checked so that the cases after it
  # run on a pair whose links work. The failure stands either way.
  if [[ \$status == FAIL && \$c != *vanish* ]]; then
    dead=\$(links_ok) || lost "after \$c" "it failed, then no ARP answer came from the peer on\$dead within 30 s"
  fi
done
exit \$failed
INNER

# Rounds: each boots a fresh pair and runs the cases left. A case LOST on either host (the
# earliest in the list, if both lost one) and every case after it go to the next round; what
# came before it counts. Three rounds at most: a case that loses the links every time fails.
todo=("${cases[@]}")
rounds=3
passes=0
fails=0
reruns=()
t=$(now)
for ((round = 1; ; round++)); do
  echo "== cluster-tier: two hosts (scripts/vm/cluster-vm.sh), ${#todo[@]} cases (round $round)"
  log=$work/run-$round.log
  rc=0
  cmd="CLUSTER_TIER_ROUND=$round CLUSTER_TIER_LOSE_LINKS_AFTER=${CLUSTER_TIER_LOSE_LINKS_AFTER:-} SOAK_ROUNDS=$soak_rounds bash run-cases.sh ${todo[*]}"
  bash scripts/vm/cluster-vm.sh "$stage" "$cmd" "$cmd" | tee "$log" || rc=$?
  # The position in todo of the first case not run on working links: the one the links died
  # before, or the one after a case that failed and left them dead.
  cut=${#todo[@]}
  why=
  while read -r when c; do
    for i in "${!todo[@]}"; do
      [[ ${todo[i]} == "$c" ]] || continue
      next=$i
      [[ $when == after ]] && next=$((i + 1))
      if ((next < cut)); then
        cut=$next
        why="links dead $when $c"
      fi
    done
  done < <(sed -n -e 's/^\[h[12]\] cluster-tier: LOST after \([^ ]*\) .*/after \1/p' \
    -e 's/^\[h[12]\] cluster-tier: LOST \([^ ]*\) .*/before \1/p' "$log")
  round_fails=0
  for ((i = 0; i < cut; i++)); do
    c=${todo[i]}
    # A pass on host 1 and no failure on host 2 (the vanishing host prints nothing).
    if grep -qF "[h1] cluster-tier: PASS $c (" "$log" && ! grep -qF "[h2] cluster-tier: FAIL $c (" "$log"; then
      passes=$((passes + 1))
    else
      round_fails=$((round_fails + 1))
    fi
  done
  fails=$((fails + round_fails))
  if ((cut == ${#todo[@]})); then
    if ((rc != 0 && round_fails == 0)); then fails=$((fails + 1)); fi # the pair failed (boot, time limit)
    break
  fi
  reruns+=("${todo[cut]} ($why)")
  if ((round == rounds)); then
    echo "cluster-tier: the links died in $rounds rounds; ${#todo[@]} - $cut cases left unrun count as failed"
    fails=$((fails + ${#todo[@]} - cut))
    break
  fi
  echo "cluster-tier: the links to the peer died at ${todo[cut]} (LOST lines above); rerunning it and the $((${#todo[@]} - cut - 1)) after it on a fresh pair"
  todo=("${todo[@]:cut}")
done
how=
if ((${#reruns[@]} > 0)); then
  how="; reran on a fresh pair from: $(printf '%s; ' "${reruns[@]}")"
  echo "cluster-tier: ${#reruns[@]} rerun(s) on a freshly booted pair: ${reruns[*]}"
fi
if ((fails == 0)); then
  result PASS "cases" "$t" "$passes of ${#cases[@]} passed on both hosts$how"
else
  result FAIL "cases" "$t" "$fails failed, $passes passed$how"
fi
echo "cluster-tier: $passed passed, $failed failed in $(since "$tier_start") s"
[[ $failed -eq 0 ]]
