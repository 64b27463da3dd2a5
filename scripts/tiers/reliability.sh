#!/usr/bin/env bash
# Reliability tier (called by scripts/test.sh): fuzzing and memcheck on the host, over tcp.
#
#   scripts/tiers/reliability.sh
#
# 1. Fuzzing (cargo-fuzz, libFuzzer, nightly toolchain): one target per decoder of bytes a
#    peer sends (fuzz/fuzz_targets/): handle_decode (oob::Handle::decode + stage_id),
#    handshake (message headers + Hello), conn_info, move_message, answer, probe_qps, bye and
#    tcp_frames (each through its check in src/protocol.rs: decodes as the plugin does, and
#    what decodes re-encodes alike). All at once, each for $RELIABILITY_FUZZ_SECONDS (60)
#    over its committed seed corpus fuzz/corpus/<target>/ (captured-*: real messages from a
#    run, see src/protocol.rs). New inputs go to a scratch directory, so the committed corpus
#    is not modified; a crash leaves its input in fuzz/artifacts/<target>/.
# 2. valgrind memcheck over the host test binaries (tests/conformance.rs and
#    tests/reliability.rs, release build, tcp transport), following the child processes the
#    tests start (--trace-children=yes; only system tools the tests run are skipped). Every
#    process writes its own log; any error in any log fails the step, not only the exit code
#    (the tests' child processes report their result on stdout, not through valgrind).
#    Leaks count only when definite. No suppression file is needed today; if one becomes
#    necessary, put it at scripts/valgrind.supp with a comment justifying each entry and it
#    is used.
#
# Each step ends with `reliability: PASS|FAIL <step> (<seconds> s)`, the whole with
# `reliability: N passed, M failed`; the exit code is non-zero if a step failed.
#
# Installs what it needs: valgrind, util-linux, iproute2 (apt-get), the nightly toolchain
# (rustup, if missing) and cargo-fuzz $CARGO_FUZZ_VERSION (cargo install, if missing).
# Environment: RELIABILITY_FUZZ_SECONDS (60), RELIABILITY_FUZZ_TARGET_DIR (where the
# sanitizer build is kept between runs; default $HOME/.cache/nccl-net-erdma/fuzz-target),
# RELIABILITY_SKIP_FUZZ=1 / RELIABILITY_SKIP_VALGRIND=1 (local loops only).
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root" || exit 1
# shellcheck source=scripts/common.sh
source scripts/common.sh

CARGO_FUZZ_VERSION=0.13.2
fuzz_seconds=${RELIABILITY_FUZZ_SECONDS:-60}
fuzz_target_dir=${RELIABILITY_FUZZ_TARGET_DIR:-$HOME/.cache/nccl-net-erdma/fuzz-target}
targets=(handle_decode handshake conn_info move_message answer probe_qps bye tcp_frames)

step_prefix reliability
start=$(now)
finish() {
  echo "reliability: total $(since "$start") s"
  echo "reliability: $passed passed, $failed failed"
  [[ $failed -eq 0 ]]
  exit
}

work=$(mktemp -d "${TMPDIR:-/tmp}/reliability.XXXXXX")
trap 'rm -rf "$work"' EXIT

echo "== reliability: dependencies"
t=$(now)
if ! ensure_build_deps || ! ensure_packages valgrind util-linux iproute2; then
  result FAIL "dependencies" "$t" "apt-get install failed"
  finish
fi

# ------------------------------------------------------------------------------------------
# 1. Fuzzing

fuzz_ready=1
if [[ ${RELIABILITY_SKIP_FUZZ:-0} == 1 ]]; then
  echo "== reliability: fuzzing SKIPPED (RELIABILITY_SKIP_FUZZ=1)"
  fuzz_ready=0
else
  echo "== reliability: fuzz build (cargo-fuzz $CARGO_FUZZ_VERSION, nightly)"
  t=$(now)
  if ! rustup toolchain list | grep -q '^nightly'; then
    rustup toolchain install nightly --profile minimal >"$work/rustup.log" 2>&1 || {
      tail -n 5 "$work/rustup.log"
      result FAIL "fuzz-build" "$t" "no nightly toolchain and rustup could not install one"
      fuzz_ready=0
    }
  fi
  if [[ $fuzz_ready == 1 ]] && ! cargo fuzz --version 2>/dev/null | grep -qF "$CARGO_FUZZ_VERSION"; then
    cargo install cargo-fuzz --version "$CARGO_FUZZ_VERSION" --locked >"$work/install.log" 2>&1 || {
      tail -n 5 "$work/install.log"
      result FAIL "fuzz-build" "$t" "cargo install cargo-fuzz $CARGO_FUZZ_VERSION failed"
      fuzz_ready=0
    }
  fi
  if [[ $fuzz_ready == 1 ]]; then
    if cargo +nightly fuzz build --target-dir "$fuzz_target_dir" >"$work/fuzz-build.log" 2>&1; then
      result PASS "fuzz-build" "$t"
    else
      tail -n 20 "$work/fuzz-build.log"
      result FAIL "fuzz-build" "$t" "cargo +nightly fuzz build failed"
      fuzz_ready=0
    fi
  fi
fi

if [[ $fuzz_ready == 1 ]]; then
  echo "== reliability: fuzz ${targets[*]} for $fuzz_seconds s each (all at once)"
  t=$(now)
  pids=()
  for target in "${targets[@]}"; do
    mkdir -p "$work/corpus-$target"
    # The scratch corpus first: libFuzzer writes what it finds to the first directory.
    cargo +nightly fuzz run --target-dir "$fuzz_target_dir" "$target" \
      "$work/corpus-$target" "fuzz/corpus/$target" -- \
      -max_total_time="$fuzz_seconds" -timeout=10 -print_final_stats=1 \
      >"$work/fuzz-$target.log" 2>&1 &
    pids+=($!)
  done
  for i in "${!targets[@]}"; do
    target=${targets[$i]}
    rc=0
    wait "${pids[$i]}" || rc=$?
    log=$work/fuzz-$target.log
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
    cov=$(grep -oE 'cov: [0-9]+ ft: [0-9]+' "$log" | tail -1)
    if [[ $rc -eq 0 && -n $runs ]]; then
      result PASS "fuzz:$target" "$t" "${runs} executions, ${rate} exec/s, ${cov}"
    else
      grep -E 'panicked|ERROR|SUMMARY|artifact|Test unit written' "$log" | head -n 20
      tail -n 5 "$log"
      result FAIL "fuzz:$target" "$t" "exit code $rc; crashing inputs are in fuzz/artifacts/$target/"
    fi
  done
fi

# ------------------------------------------------------------------------------------------
# 2. valgrind memcheck over the host suites

if [[ ${RELIABILITY_SKIP_VALGRIND:-0} == 1 ]]; then
  echo "== reliability: valgrind SKIPPED (RELIABILITY_SKIP_VALGRIND=1)"
  finish
fi

echo "== reliability: build (release) for valgrind"
t=$(now)
test_json=$work/tests.json
if build_release >"$work/build.log" 2>&1 &&
  cargo test --release --no-run --test conformance --test reliability \
    --message-format=json-render-diagnostics >"$test_json" 2>"$work/test-build.log"; then
  result PASS "build" "$t"
else
  tail -n 20 "$work/build.log" "$work/test-build.log"
  result FAIL "build" "$t" "cargo build / cargo test --no-run failed"
  finish
fi
so=$(release_dir)/libnccl_net_erdma.so
[[ $so == /* ]] || so=$root/$so

supp=()
[[ -f scripts/valgrind.supp ]] && supp=(--suppressions="$root/scripts/valgrind.supp")
for name in conformance reliability; do
  exe=$(grep -F '"reason":"compiler-artifact"' "$test_json" | grep -F '"kind":["test"]' |
    grep -F "\"name\":\"$name\"" | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | head -1)
  t=$(now)
  if [[ -z $exe ]]; then
    result FAIL "valgrind:$name" "$t" "test executable not found"
    continue
  fi
  echo "== reliability: valgrind memcheck $(basename "$exe") (children followed)"
  logs=$work/vg-$name
  mkdir -p "$logs"
  rc=0
  # Skipped children: system tools some tests run (ip in a namespace child, nm/readelf on
  # the .so); unshare and sh are followed, so the test binary they exec is checked too.
  env -u NCCL_ERDMA_TEST_DEVICE NCCL_ERDMA_TRANSPORT=tcp NCCL_ERDMA_PLUGIN_LIB="$so" \
    NCCL_NET_CLIENT_QUIET=1 \
    valgrind --tool=memcheck --error-exitcode=1 --errors-for-leak-kinds=definite \
    --leak-check=full --trace-children=yes \
    --trace-children-skip='*/ip,*/nm,*/readelf,*/objdump,*/taskset' \
    --log-file="$logs/vg.%p.log" "${supp[@]}" \
    "$exe" >"$work/vg-$name.out" 2>&1 || rc=$?
  procs=$(find "$logs" -name 'vg.*.log' | wc -l)
  bad=()
  for f in "$logs"/vg.*.log; do
    if grep -q 'ERROR SUMMARY:' "$f"; then
      grep -q 'ERROR SUMMARY: 0 errors' "$f" || bad+=("$f")
    elif grep -qE '^==[0-9]+== +(at|by) 0x' "$f"; then
      # No summary: a peer the test SIGKILLed, or a process that exec'ed an unfollowed
      # tool. Its log must still hold no error report.
      bad+=("$f")
    fi
  done
  summary=$(grep -E '^test result:' "$work/vg-$name.out" | tail -1)
  if [[ $rc -eq 0 && ${#bad[@]} -eq 0 ]]; then
    result PASS "valgrind:$name" "$t" "0 errors in $procs processes; $summary"
  else
    grep -E '^test .* FAILED|panicked|^failures:' "$work/vg-$name.out" | head -n 20
    for f in "${bad[@]}"; do
      echo "--- $f"
      grep -m1 'Command:' "$f"
      grep -vE '^==[0-9]+== +(by|at) 0x' "$f" | grep -E 'Invalid|uninitialised|lost in|ERROR SUMMARY|Process terminating' | head -n 20
      grep -m1 -A12 -E 'Invalid|uninitialised|definitely lost in' "$f"
    done
    result FAIL "valgrind:$name" "$t" "exit code $rc, ${#bad[@]} of $procs processes with errors; ${summary:-no test result}"
  fi
done

finish
