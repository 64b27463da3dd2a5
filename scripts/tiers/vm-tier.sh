#!/usr/bin/env bash
# The Soft-RoCE VM test tier (called by scripts/test.sh): real verbs on an rxe device.
#
#   scripts/tiers/vm-tier.sh
#
# On the host: builds the release .so, binaries and integration-test executables, and stages
# them (laid out like target/release, so the tests find the .so next to themselves) with an
# inner script. In a qemu VM with rxe0 (scripts/vm/rxe-vm.sh), the inner script:
#   a. ibv_devinfo -d rxe0 must show PORT_ACTIVE;
#   b. every integration-test executable, one at a time, with NCCL_ERDMA_TEST_DEVICE=rxe0
#      (the suite then runs over verbs on rxe0, see tests/common), NCCL_SOCKET_IFNAME=lo,
#      NCCL_ERDMA_TRANSPORT=$VM_TIER_TRANSPORT (default verbs), --test-threads=1
#      --include-ignored (the verbs-only tests are #[ignore]d on hosts without a device);
#   c. perftest's ib_write_bw and ib_write_lat on rxe0 (server and client in the VM);
#   d. nccl-net-bench --sizes 8,4K,64K,1M --iters 50 over each of $VM_TIER_BENCH_TRANSPORTS
#      (default "verbs tcp"), next to c's numbers;
#   e. the Debian package (target/dist/, built by scripts/package/package.sh --deb-only unless one newer
#      than the build is there): dpkg -i, then nccl-net-erdma-info from /usr/bin must say the
#      plugin can run on rxe0, then over verbs on rxe0 `nccl-net-bench --lib libnccl-net-erdma.so
#      --sizes 8,64K,1M --iters 20` (a bare name: dlopen finds the installed library in the
#      default path, as NCCL_NET_PLUGIN=erdma does; LD_DEBUG shows which file it loaded),
#      then dpkg -r.
# Each step ends with a line `vm-tier: PASS|FAIL|SKIP <step> (<seconds> s)`, the tier with
# `vm-tier: N passed, M failed, K skipped in T s`; the exit code is non-zero if any step failed.
#
# Environment: VM_TIER_TRANSPORT (verbs), VM_TIER_TEST_TIMEOUT (seconds per test executable,
# 300), VM_TIER_BENCH_ARGS (--sizes 8,4K,64K,1M --iters 50), VM_TIER_BENCH_TRANSPORTS
# (verbs tcp), and rxe-vm.sh's RXE_VM_* settings (RXE_VM_TIMEOUT: the whole VM run, 600 s).
set -Eeuo pipefail
trap 'echo "vm-tier: error: line $LINENO: \`$BASH_COMMAND\` failed (exit $?)" >&2; exit 1' ERR

root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
# shellcheck source=scripts/common.sh
source scripts/common.sh

# Run alone on a fresh machine, it installs what the build needs (as scripts/test.sh does).
ensure_build_deps
step_prefix vm-tier
tier_start=$(now)

work=$(mktemp -d "${TMPDIR:-/tmp}/vm-tier.XXXXXX")
stage=$work/stage
vmlog=$work/vm.log
# shellcheck disable=SC2317 # called by the EXIT trap
cleanup() { rm -rf "$work"; }
trap cleanup EXIT

# ------------------------------------------------------------------------------------------
# Host: build, find the executables, stage.

echo "== vm-tier: build (release)"
t=$(now)
build_json=$work/build.json
if cargo build --release --workspace --lib --bins --message-format=json-render-diagnostics >"$build_json"; then
  result PASS "build" "$t"
else
  result FAIL "build" "$t" "cargo build --release failed"
  echo "vm-tier: 0 passed, $failed failed, 0 skipped in $(since "$tier_start") s"
  exit 1
fi

echo "== vm-tier: integration-test executables"
t=$(now)
test_json=$work/test.json
# Cargo prints one JSON object per line; an integration test is a compiler-artifact whose target
# kind is ["test"] and which has an executable.
json_executables() { # FILE KIND (none found is not an error)
  { grep -F '"reason":"compiler-artifact"' "$1" | grep -F "\"kind\":[\"$2\"]" |
    sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | sort -u; } || true
}
tests=()
if cargo test --release --workspace --no-run --message-format=json-render-diagnostics >"$test_json"; then
  mapfile -t tests < <(json_executables "$test_json" test)
  if [[ ${#tests[@]} -eq 0 ]]; then
    result SKIP "test-build" "$t" "no integration tests (tests/*.rs) yet: nothing to run in the VM"
  else
    result PASS "test-build" "$t" "${#tests[@]} executable(s): $(for x in "${tests[@]}"; do basename "$x"; done | tr '\n' ' ')"
  fi
else
  result FAIL "test-build" "$t" "cargo test --release --no-run failed"
fi

target_dir=$(sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p' < <(cargo metadata --format-version 1 --no-deps) | head -1)
target_dir=${target_dir:-$root/target}
rel=$target_dir/release
so=$rel/libnccl_net_erdma.so
[[ -f $so ]] || {
  echo "vm-tier: error: $so was not built" >&2
  exit 1
}
mkdir -p "$stage/deps"
# The tools' tests drive a toy plugin in C, which they compile where there is a compiler; the
# VM has none, so it comes built (NCCL_NET_TOY_PLUGIN).
build_toy_plugin "$stage/libtoy.so"
cp "$so" "$stage/libnccl_net_erdma.so"
ln "$stage/libnccl_net_erdma.so" "$stage/libnccl-net-erdma.so"
while read -r bin; do
  [[ -n $bin ]] && cp "$bin" "$stage/"
done < <(json_executables "$build_json" bin)
for x in "${tests[@]}"; do
  # The cluster suite needs two hosts: scripts/tiers/cluster-tier.sh runs it.
  [[ $(basename "$x") == cluster-* ]] && continue
  cp "$x" "$stage/deps/"
done

# The Debian package for step e: the one in target/dist/ when it is newer than this build (as
# scripts/test.sh's packaging step leaves it), else built now.
echo "== vm-tier: Debian package (scripts/package/package.sh --deb-only)"
t=$(now)
version=$(cargo pkgid --quiet -p nccl-net-erdma)
version=${version##*[#@]}
deb=$root/target/dist/nccl-net-erdma_${version}_amd64.deb
if [[ -f $deb && $deb -nt $so && $deb -nt $rel/nccl-net-erdma-info ]]; then
  cp "$deb" "$stage/"
  result PASS "deb-build" "$t" "${deb#"$root"/} is newer than the build: staged as is"
elif bash scripts/package/package.sh --deb-only >"$work/package.log" 2>&1 && [[ -f $deb ]]; then
  cp "$deb" "$stage/"
  result PASS "deb-build" "$t" "built and staged ${deb#"$root"/}"
else
  tail -n 20 "$work/package.log"
  result FAIL "deb-build" "$t" "scripts/package/package.sh --deb-only failed (see above)"
fi

# The inner script. Runs in the VM from /opt/work with bash; its settings come as arguments.
cat >"$stage/vm-inner.sh" <<'INNER'
# shellcheck shell=bash
set -uo pipefail
transport=$1 test_timeout=$2 host_release=$3 bench_args=$4 bench_transports=$5
passed=0 failed=0 skipped=0
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
result() {
  case $1 in PASS) passed=$((passed + 1)) ;; FAIL) failed=$((failed + 1)) ;; SKIP) skipped=$((skipped + 1)) ;; esac
  echo "vm-tier: $1 $2 ($(since "$3") s)${4:+ -- $4}"
}
export NCCL_ERDMA_TEST_DEVICE=rxe0 NCCL_SOCKET_IFNAME=lo RUST_BACKTRACE=1
export NCCL_ERDMA_PLUGIN_LIB=/opt/work/libnccl-net-erdma.so
# Paths compiled into the tests (CARGO_BIN_EXE_*, target/release) resolve to the stage.
if [[ -n $host_release && ! -e $host_release ]]; then
  mkdir -p "${host_release%/*}" && ln -s /opt/work "$host_release"
fi

echo "== vm: ibv_devinfo -d rxe0"
t=$(now)
if ibv_devinfo -d rxe0 >devinfo.txt 2>&1 && grep -q PORT_ACTIVE devinfo.txt; then
  grep -E 'hca_id|state|active_mtu|link_layer' devinfo.txt
  result PASS "ibv_devinfo" "$t" "rxe0 PORT_ACTIVE"
else
  cat devinfo.txt
  result FAIL "ibv_devinfo" "$t" "rxe0 missing or its port not PORT_ACTIVE"
fi

echo "== vm: nccl-net-erdma-info (what the plugin sees on rxe0)"
t=$(now)
if [[ -x ./nccl-net-erdma-info ]]; then
  if NCCL_IB_HCA="=rxe0" ./nccl-net-erdma-info; then
    result PASS "nccl-net-erdma-info" "$t" "the plugin can run on rxe0"
  else
    result FAIL "nccl-net-erdma-info" "$t" "says the plugin cannot run on rxe0"
  fi
else
  result SKIP "nccl-net-erdma-info" "$t" "not built"
fi

shopt -s nullglob
tests=(deps/*)
if [[ ${#tests[@]} -eq 0 ]]; then
  result SKIP "tests" "$(now)" "no test executables staged"
fi
for x in "${tests[@]}"; do
  name=${x#deps/}
  echo "== vm: $name (NCCL_ERDMA_TEST_DEVICE=rxe0 NCCL_ERDMA_TRANSPORT=$transport --test-threads=1 --include-ignored)"
  t=$(now)
  NCCL_ERDMA_TRANSPORT=$transport NCCL_NET_TOY_PLUGIN=/opt/work/libtoy.so \
    timeout -k 5 "$test_timeout" "./$x" --test-threads=1 --include-ignored
  rc=$?
  if [[ $rc -eq 0 ]]; then
    result PASS "test:$name" "$t"
  elif [[ $rc -eq 124 || $rc -eq 137 ]]; then
    result FAIL "test:$name" "$t" "timed out after $test_timeout s"
  else
    result FAIL "test:$name" "$t" "exit code $rc"
  fi
done

# perftest: a server in the background, then a client, on rxe0 with GID index 1; a fresh port
# and a retry when the pair fails (port taken, startup race), each side under a timeout.
perftest_pair() { # NAME HOST ARGS...
  local name=$1 host=$2 attempt port srv i ok
  shift 2
  for attempt in 1 2 3; do
    port=$((18600 + 10 * attempt + RANDOM % 10))
    timeout -k 5 60 "$@" -p "$port" >"$name.srv" 2>&1 &
    srv=$!
    for ((i = 0; i < 100; i++)); do
      ss -Hltn "sport = :$port" 2>/dev/null | grep -q . && break
      kill -0 "$srv" 2>/dev/null || break
      sleep 0.1
    done
    ok=0
    if timeout -k 5 60 "$@" -p "$port" "$host" >"$name.cli" 2>&1; then ok=1; fi
    if [[ $ok -eq 1 ]] && wait "$srv"; then
      sed -n '/#bytes/,$p' "$name.cli"
      return 0
    fi
    kill "$srv" 2>/dev/null; wait "$srv" 2>/dev/null
    echo "-- $name attempt $attempt (port $port) failed; client:"; tail -n 5 "$name.cli"
    echo "-- server:"; tail -n 5 "$name.srv"
    sleep 1
  done
  return 1
}
echo "== vm: ib_write_bw -d rxe0 -x 1 -s 65536 -n 200 (198.18.0.1)"
t=$(now)
if perftest_pair ib_write_bw 198.18.0.1 ib_write_bw -d rxe0 -x 1 -s 65536 -n 200; then
  bw=$(awk '/#bytes/ {getline; print $4; exit}' ib_write_bw.cli)
  result PASS "ib_write_bw" "$t" "65536 B: ${bw} MB/s average"
else
  result FAIL "ib_write_bw" "$t" "3 attempts failed"
fi
echo "== vm: ib_write_lat -d rxe0 -x 1 -s 8 -n 200 (127.0.0.1)"
t=$(now)
if perftest_pair ib_write_lat 127.0.0.1 ib_write_lat -d rxe0 -x 1 -s 8 -n 200; then
  lat=$(awk '/#bytes/ {getline; print $5; exit}' ib_write_lat.cli)
  result PASS "ib_write_lat" "$t" "8 B: ${lat} us typical"
else
  result FAIL "ib_write_lat" "$t" "3 attempts failed"
fi

# shellcheck disable=SC2206 # bench_args is a word list
bench=(./nccl-net-bench $bench_args)
for bt in $bench_transports; do
  echo "== vm: ${bench[*]} (NCCL_ERDMA_TRANSPORT=$bt)"
  t=$(now)
  if [[ ! -x ./nccl-net-bench ]]; then
    result SKIP "nccl-net-bench:$bt" "$t" "not built"
    continue
  elif ! ./nccl-net-bench --help 2>&1 | grep -q -- '--sizes'; then
    result SKIP "nccl-net-bench:$bt" "$t" "its --help lists no --sizes yet: not run"
    continue
  fi
  csv=()
  if ./nccl-net-bench --help 2>&1 | grep -q -- '--csv'; then csv=(--csv "bench-$bt.csv"); fi
  rm -f "bench-$bt.csv"
  NCCL_ERDMA_TRANSPORT=$bt timeout -k 5 180 "${bench[@]}" "${csv[@]}" >bench.out 2>&1
  rc=$?
  cat bench.out
  if [[ $rc -eq 0 ]]; then
    # Ratios against perftest in this same VM run (absolute numbers under TCG mean little).
    ratio=$(awk -F, -v bw="${bw:-}" -v lat="${lat:-}" '
      $1 == 65536 && bw > 0 { r = r sprintf("64 KiB: %.1f MB/s = %.2fx ib_write_bw", $2 * 1000, $2 * 1000 / bw) }
      $1 == 8 && lat > 0 { l = sprintf("8 B: %.1f us = %.2fx ib_write_lat", $3, $3 / lat) }
      END { if (r != "" || l != "") print r (r != "" && l != "" ? "; " : "") l }' "bench-$bt.csv" 2>/dev/null)
    result PASS "nccl-net-bench:$bt" "$t" "${ratio:-compare with ib_write_bw ${bw:-?} MB/s (64 KiB), ib_write_lat ${lat:-?} us (8 B)}"
  elif grep -qiE 'unknown (argument|option|flag)|unrecognized|unexpected argument' bench.out; then
    result SKIP "nccl-net-bench:$bt" "$t" "it does not take '$bench_args' yet (see above)"
  elif [[ $rc -eq 124 || $rc -eq 137 ]]; then
    result FAIL "nccl-net-bench:$bt" "$t" "timed out after 180 s"
  else
    result FAIL "nccl-net-bench:$bt" "$t" "exit code $rc"
  fi
done
# The Debian package as a user installs it; the library is then found by name (no path, no
# LD_LIBRARY_PATH): dlopen searches the loader cache and the default directories, never the
# working directory, so the staged copy here cannot stand in for it.
deb_install() { # sets `why` when it fails
  local debfile=$1 rc lib=/usr/lib/x86_64-linux-gnu/libnccl-net-erdma.so
  why=
  echo "\$ dpkg -i $debfile"
  dpkg -i "$debfile" || { why="dpkg -i failed"; return 1; }
  ldconfig -p | grep -F libnccl-net-erdma.so || { why="$lib is not in the loader cache (ldconfig -p)"; return 1; }
  echo "\$ NCCL_IB_HCA==rxe0 nccl-net-erdma-info   # $(command -v nccl-net-erdma-info)"
  [[ $(command -v nccl-net-erdma-info) == /usr/bin/nccl-net-erdma-info ]] || { why="nccl-net-erdma-info is not /usr/bin's"; return 1; }
  (cd / && NCCL_IB_HCA="=rxe0" nccl-net-erdma-info) >deb-info.txt 2>&1
  rc=$?
  grep -E '^== |rxe0|WARNING' deb-info.txt
  if [[ $rc -ne 0 ]] || ! grep -q '^== result: the plugin can run here' deb-info.txt; then
    why="the installed nccl-net-erdma-info says the plugin cannot run on rxe0 (exit $rc)"
    return 1
  fi
  echo "\$ NCCL_IB_HCA==rxe0 ./nccl-net-bench --lib libnccl-net-erdma.so --sizes 8,64K,1M --iters 20"
  rm -f ld-debug.*
  env -u LD_LIBRARY_PATH -u NCCL_ERDMA_PLUGIN_LIB NCCL_IB_HCA="=rxe0" NCCL_ERDMA_TRANSPORT=verbs \
    LD_DEBUG=libs LD_DEBUG_OUTPUT="$PWD/ld-debug" timeout -k 5 180 \
    ./nccl-net-bench --lib libnccl-net-erdma.so --sizes 8,64K,1M --iters 20 >deb-bench.txt 2>&1
  rc=$?
  cat deb-bench.txt
  [[ $rc -eq 0 ]] || { why="nccl-net-bench --lib libnccl-net-erdma.so: exit $rc"; return 1; }
  grep -qE '^transport: +verbs' deb-bench.txt || { why="the benchmark did not run over verbs"; return 1; }
  # Both processes (side A and its child, side B) must have loaded the installed file (with a
  # merged /usr the loader cache names it /lib/x86_64-linux-gnu/...).
  loaded=$(grep -oh "calling init: .*libnccl-net-erdma.so\$" ld-debug.* | sed 's/^calling init: //' |
    xargs -r readlink -f | sort | uniq -c)
  echo "loaded (LD_DEBUG=libs): $loaded"
  if ! [[ $loaded =~ ^\ *2\ $lib$ ]]; then
    why="the benchmark's two processes did not both load $lib (LD_DEBUG=libs: $loaded)"
    return 1
  fi
  echo "\$ dpkg -r nccl-net-erdma"
  if ! dpkg -r nccl-net-erdma || [[ -e $lib || -e /usr/bin/nccl-net-erdma-info ]]; then
    why="dpkg -r failed or left files"
    return 1
  fi
}
echo "== vm: the Debian package: dpkg -i, nccl-net-erdma-info, nccl-net-bench --lib libnccl-net-erdma.so on rxe0"
t=$(now)
debs=(nccl-net-erdma_*.deb)
if [[ ${#debs[@]} -eq 0 ]]; then
  result SKIP "deb" "$t" "no .deb staged"
elif deb_install "${debs[0]}"; then
  result PASS "deb" "$t" "installed ${debs[0]}; info: can run on rxe0; 8 B, 64 KiB, 1 MiB over verbs through /usr/lib/x86_64-linux-gnu/libnccl-net-erdma.so found by name"
else
  result FAIL "deb" "$t" "$why"
fi
echo "vm-inner: $passed passed, $failed failed, $skipped skipped"
[[ $failed -eq 0 ]]
INNER

echo "== vm-tier: staged $(du -sh "$stage" | cut -f1) in $stage: $(cd "$stage" && find . -type f | sort | tr '\n' ' ')"

# ------------------------------------------------------------------------------------------
# The VM.

echo "== vm-tier: Soft-RoCE VM (scripts/vm/rxe-vm.sh)"
t=$(now)
transport=${VM_TIER_TRANSPORT:-verbs}
bench_args=${VM_TIER_BENCH_ARGS:---sizes 8,4K,64K,1M --iters 50}
bench_transports=${VM_TIER_BENCH_TRANSPORTS:-verbs tcp}
printf -v inner 'bash vm-inner.sh %q %q %q %q %q' "$transport" "${VM_TIER_TEST_TIMEOUT:-300}" "$rel" \
  "$bench_args" "$bench_transports"
vmrc=0
bash "$root/scripts/vm/rxe-vm.sh" "$stage" "$inner" 2>&1 | tee "$vmlog" || vmrc=$?
# Count the VM's steps from its result lines; then judge the VM run itself.
while read -r _ status _; do
  case $status in
    PASS) passed=$((passed + 1)) ;;
    FAIL) failed=$((failed + 1)) ;;
    SKIP) skipped=$((skipped + 1)) ;;
  esac
done < <(grep -E '^vm-tier: (PASS|FAIL|SKIP) ' "$vmlog" || true)
if [[ $vmrc -ne 0 ]] && ! grep -q '^vm-inner: ' "$vmlog"; then
  result FAIL "vm" "$t" "the VM run did not complete (rxe-vm.sh exit $vmrc; see its error above)"
elif [[ $vmrc -ne 0 ]] && ! grep -qE '^vm-tier: FAIL ' "$vmlog"; then
  result FAIL "vm" "$t" "the inner script failed (exit $vmrc) without a failed step"
else
  echo "vm-tier: VM run took $(since "$t") s"
fi

echo "vm-tier: $passed passed, $failed failed, $skipped skipped in $(since "$tier_start") s"
if [[ $failed -ne 0 ]]; then
  exit 1
fi
