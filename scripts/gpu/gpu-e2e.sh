#!/usr/bin/env bash
# End-to-end test of the nccl-net-erdma plugin under PyTorch, on one Linux machine with an NVIDIA
# GPU. Two ranks share the GPU; each gets its own NCCL_HOSTID, so NCCL takes them for two hosts
# and every byte crosses the network plugin (over loopback: NCCL_SOCKET_IFNAME=lo).
#
#   1. plugin run  (NCCL_NET_PLUGIN=<the .so>, NCCL_ERDMA_TRANSPORT=tcp without an RDMA device,
#      verbs with one): collectives from 4 B to 256 MiB checked exactly, a few DDP training
#      steps, all_reduce bus bandwidth at 1, 16 and 256 MiB. NCCL's log must show the plugin
#      loaded (with its ABI version), initialized and used, and no fallback.
#   2. baseline run (NCCL_NET_PLUGIN=none NCCL_NET=Socket): the same DDP steps and bandwidth
#      through NCCL's own Socket transport.
#   3. DDP losses must match the baseline; the bandwidth ratio plugin/Socket is printed per size
#      against a target of >= 1.0 (a miss is reported, not a failure).
#
# The machine needs python3 with torch (CUDA build); no Rust toolchain and no network: the .so
# is built elsewhere and passed in (or carried along in target/release/ of a copy of the repo).
#
# Usage: scripts/gpu/gpu-e2e.sh [--so PATH] [--dry-run] [--out DIR] [--transport tcp|verbs|auto]
#                           [--expect-abi N]
#   --so PATH        the plugin; default target/release/libnccl-net-erdma.so, else
#                    target/release/libnccl_net_erdma.so (relative to the repository root)
#   --dry-run        run everything that needs no GPU: argument and environment checks, the
#                    .so's exports, the log checks against canned logs, the report logic
#                    against canned results, python syntax; then list what was skipped
#   --out DIR        keep logs and outputs there (default: a new /tmp/gpu-e2e.XXXXXX)
#   --transport T    NCCL_ERDMA_TRANSPORT for the plugin run (default: verbs when
#                    /sys/class/infiniband has a device, else tcp)
#   --expect-abi N   fail unless NCCL loads ncclNetPlugin_vN (default: v11 under NCCL 2.28,
#                    the newest exported under later NCCL, not checked under older NCCL)
# Environment: PYTHON (interpreter with torch), GPU_E2E_PLUGIN_TIMEOUT (s, default 150),
#   GPU_E2E_BASELINE_TIMEOUT (s, default 90), GPU_E2E_BUDGET (s for the whole script, default
#   285), GPU_E2E_DDP_STEPS (default 8), GPU_E2E_TARGET (default 1.0), GPU_E2E_LOSS_ATOL
#   (default 1e-6), GPU_E2E_TRANSPORT, GPU_E2E_EXPECT_ABI.
# Exit status: 0 when every check passed, 1 when any failed, 2 on a usage error.

set -uo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "$SCRIPT_DIR/../.." && pwd)
PYPROG=$SCRIPT_DIR/gpu_e2e.py
PLUGIN_NAME=erdma

SO=""
DRY_RUN=0
OUT_DIR=""
TRANSPORT=${GPU_E2E_TRANSPORT:-}
EXPECT_ABI=${GPU_E2E_EXPECT_ABI:-}
PLUGIN_TIMEOUT=${GPU_E2E_PLUGIN_TIMEOUT:-150}
BASELINE_TIMEOUT=${GPU_E2E_BASELINE_TIMEOUT:-90}
BUDGET=${GPU_E2E_BUDGET:-285}
DDP_STEPS=${GPU_E2E_DDP_STEPS:-8}
TARGET=${GPU_E2E_TARGET:-1.0}
LOSS_ATOL=${GPU_E2E_LOSS_ATOL:-1e-6}
PY=""
HIGHEST_EXPORTED=""
NCCL_VERSION_HINT=""

usage() { sed -n '/^# Usage:/,/^# Exit status/p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

while (($#)); do
    case $1 in
        --so) [[ $# -ge 2 ]] || { echo "gpu-e2e: --so needs a path" >&2; exit 2; }
              SO=$2; shift 2 ;;
        --so=*) SO=${1#--so=}; shift ;;
        --dry-run) DRY_RUN=1; shift ;;
        --out) [[ $# -ge 2 ]] || { echo "gpu-e2e: --out needs a directory" >&2; exit 2; }
               OUT_DIR=$2; shift 2 ;;
        --out=*) OUT_DIR=${1#--out=}; shift ;;
        --transport) [[ $# -ge 2 ]] || { echo "gpu-e2e: --transport needs a value" >&2; exit 2; }
                     TRANSPORT=$2; shift 2 ;;
        --transport=*) TRANSPORT=${1#--transport=}; shift ;;
        --expect-abi) [[ $# -ge 2 ]] || { echo "gpu-e2e: --expect-abi needs a number" >&2; exit 2; }
                      EXPECT_ABI=$2; shift 2 ;;
        --expect-abi=*) EXPECT_ABI=${1#--expect-abi=}; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu-e2e: unknown argument: $1" >&2; usage >&2; exit 2 ;;
    esac
done

# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------

PASSED=0
FAILED=0
FAILURES=()
SKIPPED=()
pass() { PASSED=$((PASSED + 1)); printf '  PASS  %s\n' "$*"; }
fail() { FAILED=$((FAILED + 1)); FAILURES+=("$*"); printf '  FAIL  %s\n' "$*"; }
note() { printf '        %s\n' "$*"; }
indent() { sed 's/^/          /'; }
skip() { SKIPPED+=("$*"); printf '  SKIP  (needs a GPU) %s\n' "$*"; }
section() { printf '\n== %s\n' "$*"; }

# Counts "PASS msg" / "FAIL msg" lines from stdin; shows "INFO msg" and anything else as notes.
tally() {
    local line
    while IFS= read -r line; do
        [[ -n $line ]] || continue
        case $line in
            "PASS "*) pass "${line#PASS }" ;;
            "FAIL "*) fail "${line#FAIL }" ;;
            "INFO "*) note "${line#INFO }" ;;
            *) note "$line" ;;
        esac
    done
}

# Counts the FAIL lines of a checker's output (for the self-tests of the checkers).
count_fails() { grep -c '^FAIL ' <<<"$1" || true; }

# ---------------------------------------------------------------------------------------------
# NCCL log checks. Each prints PASS/FAIL/INFO lines for `tally`. NCCL writes one file per rank
# (NCCL_DEBUG_FILE); lines look like "host:pid:tid [dev] NCCL INFO <message>".
# ---------------------------------------------------------------------------------------------

# The ABI version NCCL should pick from our exports, given the NCCL version seen in its log;
# empty when it cannot be told (NCCL older than 2.28: not checked).
expected_abi() {
    local nccl=$1 major minor
    [[ -n $EXPECT_ABI ]] && { echo "${EXPECT_ABI#v}"; return; }
    [[ $nccl =~ ^([0-9]+)\.([0-9]+) ]] || return 0
    major=${BASH_REMATCH[1]} minor=${BASH_REMATCH[2]}
    if ((major == 2 && minor == 28)); then
        echo 11  # NCCL 2.28 looks for ncclNetPlugin_v11 first.
    elif ((major > 2 || (major == 2 && minor > 28))) && [[ -n $HIGHEST_EXPORTED ]]; then
        echo "$HIGHEST_EXPORTED"
    fi
}

# check_plugin_logs FILE...: the NCCL logs of the plugin run, one per rank.
check_plugin_logs() {
    local files=("$@") f name n_use n_via missing_load=() missing_use=() missing_via=()
    local missing_own=() versions nccl want fallback warns
    if ((${#files[@]} == 0)); then
        echo "FAIL NCCL log: no log file was written (NCCL_DEBUG_FILE)"
        return
    fi
    for f in "${files[@]}"; do
        name=$(basename "$f")
        grep -qE "NET/Plugin: Loaded net plugin $PLUGIN_NAME \(v[0-9]+\)" "$f" ||
            missing_load+=("$name")
        grep -qE "NCCL INFO Using network $PLUGIN_NAME([[:space:]]|$)" "$f" || missing_use+=("$name")
        grep -qE "via NET/$PLUGIN_NAME/[0-9]+" "$f" || missing_via+=("$name")
        grep -qE "NCCL (INFO|WARN) NET/$PLUGIN_NAME " "$f" || missing_own+=("$name")
    done
    versions=$(grep -hoE "NET/Plugin: Loaded net plugin $PLUGIN_NAME \(v[0-9]+\)" "${files[@]}" |
        grep -oE '[0-9]+\)$' | tr -d ')' | sort -un | tr '\n' ' ')
    versions=${versions% }
    nccl=$(grep -hoE 'NCCL version [0-9]+\.[0-9]+\.[0-9]+[^ ]*' "${files[@]}" | head -n 1 |
        awk '{print $3}')
    nccl=${nccl:-$NCCL_VERSION_HINT}  # torch's NCCL, when the log does not say

    # 1. Loaded, and which ABI.
    if ((${#missing_load[@]})); then
        echo "FAIL plugin loaded: no 'Loaded net plugin $PLUGIN_NAME' in ${missing_load[*]}"
    elif [[ $versions == *" "* ]]; then
        echo "FAIL plugin loaded: ranks loaded different ABI versions (v${versions// /, v})"
    else
        want=$(expected_abi "$nccl")
        if [[ -z $want ]]; then
            echo "PASS plugin loaded by NCCL ${nccl:-?} as ncclNetPlugin_v$versions on every rank" \
                "(ABI not checked for this NCCL)"
        elif [[ $versions == "$want" ]]; then
            echo "PASS plugin loaded by NCCL ${nccl:-?} as ncclNetPlugin_v$versions on every rank"
        else
            echo "FAIL plugin loaded by NCCL ${nccl:-?} as ncclNetPlugin_v$versions, expected v$want"
        fi
    fi
    # 2. Used: every communicator of every rank on our network, channels through it.
    n_use=$(cat "${files[@]}" | grep -cE "NCCL INFO Using network $PLUGIN_NAME([[:space:]]|$)")
    n_via=$(cat "${files[@]}" | grep -cE "via NET/$PLUGIN_NAME/[0-9]+")
    if ((${#missing_use[@]})); then
        echo "FAIL plugin used: no 'Using network $PLUGIN_NAME' in ${missing_use[*]}"
    elif ((${#missing_via[@]})); then
        echo "FAIL plugin used: no channel 'via NET/$PLUGIN_NAME/' in ${missing_via[*]}"
    else
        echo "PASS plugin used: 'Using network $PLUGIN_NAME' x$n_use (communicators)," \
            "channels via NET/$PLUGIN_NAME x$n_via"
    fi
    if ((${#missing_own[@]})); then
        echo "FAIL plugin's own log lines (NET/$PLUGIN_NAME ...) missing in ${missing_own[*]}"
    else
        echo "PASS plugin's own log lines present ($(cat "${files[@]}" |
            grep -cE "NCCL (INFO|WARN) NET/$PLUGIN_NAME ") lines)"
    fi
    # 3. No fallback to another network, no failed init or load.
    fallback=$(grep -hE "Failed to initialize NET plugin $PLUGIN_NAME|Failed to initialize any NET plugin|External network plugin .* is unsupported|NET/Plugin: Could not find|NCCL INFO Using network |Assigned NET plugin " \
        "${files[@]}" | grep -vE "Using network $PLUGIN_NAME([[:space:]]|$)|Assigned NET plugin $PLUGIN_NAME " |
        sed 's/^[^ ]* \[[0-9]*\] NCCL [A-Z]* //' | sort | uniq -c | sed 's/^ *//' | head -n 5)
    if [[ -n $fallback ]]; then
        echo "FAIL no fallback: NCCL logged:"
        while IFS= read -r f; do echo "INFO   $f"; done <<<"$fallback"
    else
        echo "PASS no fallback to NCCL's own IB or Socket transport"
    fi
    warns=$(cat "${files[@]}" | grep -cE "NCCL WARN NET/$PLUGIN_NAME ")
    if ((warns)); then
        echo "INFO plugin WARN lines: $warns, first:"
        grep -hE "NCCL WARN NET/$PLUGIN_NAME " "${files[@]}" | head -n 3 |
            sed 's/^[^ ]* \[[0-9]*\] NCCL WARN /INFO   /'
    fi
}

# check_socket_logs FILE...: the NCCL logs of the baseline run must show NCCL's own Socket
# transport and no external plugin.
check_socket_logs() {
    local files=("$@") f missing=() other
    if ((${#files[@]} == 0)); then
        echo "FAIL baseline NCCL log: no log file was written"
        return
    fi
    for f in "${files[@]}"; do
        grep -qE 'NCCL INFO Using network Socket([[:space:]]|$)' "$f" || missing+=("$(basename "$f")")
    done
    other=$(grep -hE 'NET/Plugin: Loaded net plugin|NCCL INFO Using network ' "${files[@]}" |
        grep -vE 'Using network Socket([[:space:]]|$)' | head -n 1)
    if ((${#missing[@]})); then
        echo "FAIL baseline on NCCL's Socket transport: no 'Using network Socket' in ${missing[*]}"
    elif [[ -n $other ]]; then
        echo "FAIL baseline on NCCL's Socket transport only: ${other#* NCCL INFO }"
    else
        echo "PASS baseline on NCCL's own Socket transport (no external plugin)"
    fi
}

# ---------------------------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------------------------

resolve_so() {
    local c
    if [[ -z $SO ]]; then
        for c in "$REPO_ROOT/target/release/libnccl-net-erdma.so" \
                 "$REPO_ROOT/target/release/libnccl_net_erdma.so"; do
            if [[ -f $c ]]; then SO=$c; break; fi
        done
        if [[ -z $SO ]]; then
            fail "plugin .so: none at target/release/libnccl-net-erdma.so or" \
                "target/release/libnccl_net_erdma.so (build with cargo build --release, or pass --so)"
            return 1
        fi
    fi
    if [[ ! -f $SO || ! -r $SO ]]; then
        fail "plugin .so: $SO is not a readable file"
        SO=""
        return 1
    fi
    SO=$(cd "$(dirname "$SO")" && pwd)/$(basename "$SO")  # NCCL_NET_PLUGIN wants a full path
    if [[ $(head -c 4 "$SO" | od -An -tx1 | tr -d ' \n') != 7f454c46 ]]; then
        fail "plugin .so: $SO is not an ELF file"
        return 1
    fi
    pass "plugin .so: $SO ($(du -k "$SO" | cut -f1) KiB)"
}

check_exports() {
    local syms how
    if command -v nm >/dev/null 2>&1; then
        how="nm -D --defined-only"
        syms=$(nm -D --defined-only "$SO" 2>/dev/null | awk '{print $NF}' |
            grep -E '^ncclNetPlugin_v[0-9]+$' | sort -V | tr '\n' ' ')
    else
        how="strings in the file (nm not installed)"
        syms=$(grep -aoE 'ncclNetPlugin_v[0-9]+' "$SO" | sort -Vu | tr '\n' ' ')
    fi
    syms=${syms% }
    HIGHEST_EXPORTED=$(tr ' ' '\n' <<<"$syms" | sed -n 's/^ncclNetPlugin_v//p' | sort -n | tail -n 1)
    if [[ " $syms " == *" ncclNetPlugin_v11 "* ]]; then
        pass "exports ($how): ${syms:-none}"
    else
        fail "exports ($how): ncclNetPlugin_v11 missing; found: ${syms:-none}"
    fi
}

rdma_devices() {
    local dir=/sys/class/infiniband
    [[ -d $dir ]] && find "$dir" -mindepth 1 -maxdepth 1 -printf '%f ' 2>/dev/null
}

choose_transport() {
    local devs why
    devs=$(rdma_devices)
    devs=${devs% }
    if [[ -n $TRANSPORT ]]; then
        why="as asked"
    elif [[ -n $devs ]]; then
        TRANSPORT=verbs why="RDMA devices: $devs"
    else
        TRANSPORT=tcp why="no RDMA device in /sys/class/infiniband"
    fi
    case $TRANSPORT in
        tcp|verbs|auto) pass "transport for the plugin run: NCCL_ERDMA_TRANSPORT=$TRANSPORT ($why)" ;;
        *) fail "transport: '$TRANSPORT' is not tcp, verbs or auto"; return 1 ;;
    esac
}

check_settings() {
    local v bad=0
    for v in PLUGIN_TIMEOUT BASELINE_TIMEOUT BUDGET DDP_STEPS; do
        if ! [[ ${!v} =~ ^[0-9]+$ ]] || ((${!v} < 1)); then
            fail "setting GPU_E2E_$v=${!v}: not a positive integer"
            bad=1
        fi
    done
    [[ $TARGET =~ ^[0-9]+(\.[0-9]+)?$ ]] || { fail "setting GPU_E2E_TARGET=$TARGET: not a number"; bad=1; }
    [[ $LOSS_ATOL =~ ^[0-9.]+([eE][-+]?[0-9]+)?$ ]] ||
        { fail "setting GPU_E2E_LOSS_ATOL=$LOSS_ATOL: not a number"; bad=1; }
    [[ -z $EXPECT_ABI || ${EXPECT_ABI#v} =~ ^[0-9]+$ ]] ||
        { fail "--expect-abi $EXPECT_ABI: not a number"; bad=1; }
    ((bad)) || pass "settings: timeouts ${PLUGIN_TIMEOUT}s + ${BASELINE_TIMEOUT}s within" \
        "${BUDGET}s, $DDP_STEPS DDP steps, target ratio >= $TARGET, loss tolerance $LOSS_ATOL"
}

check_tools() {
    local t missing=()
    for t in timeout grep awk sed sort od head tail du; do
        command -v "$t" >/dev/null 2>&1 || missing+=("$t")
    done
    if ((${#missing[@]})); then
        fail "tools missing: ${missing[*]}"
    else
        pass "tools: bash $BASH_VERSION, coreutils timeout, grep, awk, sed$(command -v nm >/dev/null 2>&1 &&
            echo ', nm' || echo ' (no nm: exports read from strings)')"
    fi
}

# Picks the interpreter: $PYTHON, else the first of python3, python that imports torch (any
# python3 in a dry run). Sets PY; TORCH_OK=1 when torch imports.
TORCH_OK=0
find_python() {
    local c cands=()
    if [[ -n ${PYTHON:-} ]]; then cands=("$PYTHON"); else cands=(python3 python); fi
    for c in "${cands[@]}"; do
        command -v "$c" >/dev/null 2>&1 || continue
        [[ -z $PY ]] && PY=$(command -v "$c")
        if "$c" -c 'import torch' >/dev/null 2>&1; then
            PY=$(command -v "$c")
            TORCH_OK=1
            return 0
        fi
    done
    [[ -n $PY ]]
}

check_python_files() {
    local cache err
    cache=$(mktemp -d /tmp/gpu-e2e-pycache.XXXXXX)  # keeps __pycache__ out of the checkout
    if err=$(PYTHONPYCACHEPREFIX=$cache "$PY" -m py_compile "$PYPROG" 2>&1); then
        pass "python3 -m py_compile scripts/gpu/gpu_e2e.py"
    else
        fail "python3 -m py_compile scripts/gpu/gpu_e2e.py: $(tail -n 3 <<<"$err")"
    fi
    rm -rf "$cache"
}

free_port() {
    "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Settings shared by both runs. Everything else NCCL-related that the caller exported stays, and
# is shown; these are cleared first so that they cannot skew either run.
CLEARED_VARS=(NCCL_NET NCCL_NET_PLUGIN NCCL_NET_PLUGIN_REF_COUNT NCCL_HOSTID NCCL_DEBUG_FILE
    NCCL_IB_DISABLE NCCL_ERDMA_TRANSPORT NCCL_ALGO NCCL_PROTO NCCL_COLLNET_ENABLE)
UNSET_ARGS=()
for _v in "${CLEARED_VARS[@]}"; do UNSET_ARGS+=(-u "$_v"); done
unset _v
COMMON_ENV=(
    NCCL_DEBUG=INFO
    NCCL_DEBUG_SUBSYS="INIT,NET,ENV"
    NCCL_SOCKET_IFNAME=lo
    NCCL_P2P_DISABLE=1
    NCCL_SHM_DISABLE=1
    NCCL_NVLS_ENABLE=0
    NCCL_MNNVL_ENABLE=0
    CUBLAS_WORKSPACE_CONFIG=:4096:8
    PYTHONUNBUFFERED=1
)
plugin_env() {
    PLUGIN_ENV=(NCCL_NET_PLUGIN="$SO" NCCL_NET_PLUGIN_REF_COUNT=1 NCCL_ERDMA_TRANSPORT="$TRANSPORT")
}
BASELINE_ENV=(NCCL_NET_PLUGIN=none NCCL_NET=Socket NCCL_IB_DISABLE=1)

# launch LABEL LIMIT PHASES ENV...: runs the two ranks on GPU 0 with ENV, each under `timeout`,
# output in $OUT_DIR/LABEL. When one rank fails, the other gets 20 s and is then stopped.
# Sets LAUNCH_RCS ("rc0 rc1") and LAUNCH_SECONDS; returns 0 when both ranks exited 0.
launch() {
    local label=$1 limit=$2 phases=$3 dir port r i left failed_at=0 start=$SECONDS
    shift 3
    dir=$OUT_DIR/$label
    mkdir -p "$dir"
    port=$(free_port) || { LAUNCH_RCS="no-port"; return 1; }
    local pids=() rcs=()
    for r in 0 1; do
        env "${UNSET_ARGS[@]}" "${COMMON_ENV[@]}" "$@" \
            RANK=$r LOCAL_RANK=$r WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 \
            MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" \
            NCCL_HOSTID="gpu-e2e-$label-host$r" \
            NCCL_DEBUG_FILE="$dir/nccl.rank$r.%h.%p.log" \
            timeout -k 10 "$limit" "$PY" "$PYPROG" run --phases "$phases" \
            --ddp-steps "$DDP_STEPS" --timeout $((limit > 40 ? limit - 10 : 30)) \
            >"$dir/rank$r.out" 2>"$dir/rank$r.err" &
        pids+=($!)
    done
    left=2
    while ((left > 0)); do
        for i in 0 1; do
            [[ -n ${rcs[i]:-} ]] && continue
            if ! kill -0 "${pids[i]}" 2>/dev/null; then
                wait "${pids[i]}"
                rcs[i]=$?
                left=$((left - 1))
                if ((rcs[i] != 0 && failed_at == 0)); then failed_at=$SECONDS; fi
            fi
        done
        if ((left > 0 && failed_at > 0 && SECONDS - failed_at > 20)); then
            for i in 0 1; do
                [[ -n ${rcs[i]:-} ]] || kill -TERM "${pids[i]}" 2>/dev/null
            done
        fi
        ((left > 0)) && sleep 0.5
    done
    LAUNCH_RCS="${rcs[0]} ${rcs[1]}"
    LAUNCH_SECONDS=$((SECONDS - start))
    [[ ${rcs[0]} == 0 && ${rcs[1]} == 0 ]]
}

# What went wrong in a launch: exit codes, the end of each rank's stderr, NCCL's warnings.
show_launch_failure() {
    local label=$1 dir=$OUT_DIR/$1 r rc rcs
    read -r -a rcs <<<"$LAUNCH_RCS"
    for r in 0 1; do
        rc=${rcs[r]:-?}
        case $rc in
            124|137) note "rank $r: timed out" ;;
            143) note "rank $r: stopped 20 s after the other rank failed" ;;
            0) note "rank $r: exit 0" ;;
            *) note "rank $r: exit $rc" ;;
        esac
        if [[ -s $dir/rank$r.err ]]; then
            note "rank $r stderr (last lines):"
            tail -n 12 "$dir/rank$r.err" | sed 's/^/          /'
        fi
    done
    if compgen -G "$dir/nccl.rank*.log" >/dev/null; then
        grep -h 'NCCL WARN' "$dir"/nccl.rank*.log | head -n 8 | sed 's/^/          /'
    fi
    note "full logs: $dir"
}

# Seconds a launch may take: its own limit, cut to what is left of the budget.
limit_for() {
    local want=$1 left=$((BUDGET - SECONDS - 15))
    ((left < want)) && want=$left
    echo "$want"
}

# ---------------------------------------------------------------------------------------------
# Dry-run self-tests of the checkers against canned logs
# ---------------------------------------------------------------------------------------------

write_sample_logs() {
    local d=$1 h="gpu1:4242:4242 [0] NCCL INFO" h1="gpu1:4343:4343 [0] NCCL INFO"
    cat >"$d/good.rank0.log" <<EOF
$h NCCL_NET_PLUGIN set by environment to /opt/erdma/libnccl_net_erdma.so
$h NET/Plugin: Loaded net plugin erdma (v11)
$h Successfully loaded external network plugin /opt/erdma/libnccl_net_erdma.so
$h NET/erdma bootstrap interface lo address 127.0.0.1
$h NET/erdma device 0: erdma-tcp-lo transport tcp speed 10000 Mbps pci None
$h Initialized NET plugin erdma
$h Assigned NET plugin erdma to comm
$h Using network erdma
$h NCCL version 2.28.9+cuda12.9
gpu1:4242:4301 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/erdma/0
gpu1:4242:4301 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/erdma/0
$h Using network erdma
EOF
    sed 's/4242/4343/g; s/0\[0\] -> 1\[0\] \[send\]/1[0] -> 0[0] [send]/' \
        "$d/good.rank0.log" | grep -v 'NCCL version' >"$d/good.rank1.log"
    # Init failed: NCCL fell back to IB, found none, and took its Socket transport.
    cat >"$d/fallback.rank1.log" <<EOF
$h1 NET/Plugin: Loaded net plugin erdma (v11)
gpu1:4343:4343 [0] NCCL WARN NET/erdma verbs transport unavailable: no RDMA device. NCCL falls back to its own transports
$h1 Failed to initialize NET plugin erdma
$h1 NET/IB : No device found.
$h1 Initialized NET plugin Socket
$h1 Assigned NET plugin Socket to comm
$h1 Using network Socket
gpu1:4343:4380 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [send] via NET/Socket/0
EOF
    # Not loaded at all.
    cat >"$d/notloaded.rank0.log" <<EOF
$h NET/Plugin: Could not find: /opt/erdma/libnccl_net_erdma.so
$h NET/IB : No device found.
$h Using network Socket
$h NCCL version 2.28.9+cuda12.9
EOF
    # Loaded through an older table than NCCL 2.28 should pick.
    sed 's/(v11)/(v10)/' "$d/good.rank0.log" >"$d/oldabi.rank0.log"
    sed 's/(v11)/(v10)/' "$d/good.rank1.log" >"$d/oldabi.rank1.log"
    # The Socket baseline.
    cat >"$d/socket.rank0.log" <<EOF
$h NCCL_NET_PLUGIN set by environment to none
$h NET/IB : Disabled (NCCL_IB_DISABLE set)
$h Initialized NET plugin Socket
$h Assigned NET plugin Socket to comm
$h Using network Socket
EOF
    sed 's/4242/4343/g' "$d/socket.rank0.log" >"$d/socket.rank1.log"
}

dry_run_log_checks() {
    local d out n
    d=$(mktemp -d /tmp/gpu-e2e-samples.XXXXXX)
    write_sample_logs "$d"
    # case: name, checker, expectation (pass|fail), files
    run_sample() {
        local name=$1 checker=$2 expect=$3
        shift 3
        out=$("$checker" "$@")
        n=$(count_fails "$out")
        if [[ $expect == pass && $n == 0 ]] || [[ $expect == fail && $n -gt 0 ]]; then
            pass "log checker on canned '$name' logs: $([[ $expect == pass ]] && echo accepted ||
                echo "rejected ($n FAIL: $(grep '^FAIL ' <<<"$out" | head -n 1 | cut -c6-90)...)")"
        else
            fail "log checker on canned '$name' logs: expected $expect, got $n FAIL line(s)"
            indent <<<"$out"
        fi
    }
    run_sample "plugin loaded and used" check_plugin_logs pass "$d/good.rank0.log" "$d/good.rank1.log"
    run_sample "one rank fell back to Socket" check_plugin_logs fail "$d/good.rank0.log" "$d/fallback.rank1.log"
    run_sample "plugin not found" check_plugin_logs fail "$d/notloaded.rank0.log"
    run_sample "v10 under NCCL 2.28" check_plugin_logs fail "$d/oldabi.rank0.log" "$d/oldabi.rank1.log"
    run_sample "no log files" check_plugin_logs fail
    run_sample "Socket baseline" check_socket_logs pass "$d/socket.rank0.log" "$d/socket.rank1.log"
    run_sample "plugin logs as baseline" check_socket_logs fail "$d/good.rank0.log" "$d/good.rank1.log"
    rm -rf "$d"
}

# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------

summary() {
    local s
    section "Summary"
    if ((${#SKIPPED[@]})); then
        echo "  skipped (need a GPU):"
        for s in "${SKIPPED[@]}"; do echo "    - $s"; done
    fi
    if ((${#FAILURES[@]})); then
        echo "  failed:"
        for s in "${FAILURES[@]}"; do echo "    - $s"; done
    fi
    [[ -n $OUT_DIR && $DRY_RUN == 0 ]] && echo "  logs and outputs: $OUT_DIR"
    echo "gpu-e2e: $PASSED passed, $FAILED failed"
    ((FAILED == 0))
}

main() {
    local so_ok=1 gpu_info lim v out
    echo "gpu-e2e: $([[ $DRY_RUN == 1 ]] && echo 'dry run' || echo 'GPU run') from $REPO_ROOT"

    section "Environment"
    check_tools
    check_settings
    resolve_so || so_ok=0
    ((so_ok)) && check_exports
    choose_transport
    if find_python; then
        pass "python: $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))," \
            "torch $([[ $TORCH_OK == 1 ]] && "$PY" -c 'import torch; print(torch.__version__)' ||
                echo 'not importable')"
    else
        fail "python: no python3 found (set PYTHON)"
    fi
    for v in $(compgen -e | grep -E '^(NCCL|TORCH_NCCL)_' | sort); do
        [[ " ${CLEARED_VARS[*]} " == *" $v "* ]] && continue
        note "inherited from the environment: $v=${!v}"
    done

    if [[ -n $PY ]]; then
        section "Python program"
        check_python_files
        if out=$("$PY" "$PYPROG" selftest 2>&1); then
            pass "gpu_e2e.py report logic on canned results ($(grep -c '^selftest ok' <<<"$out") cases)"
        else
            fail "gpu_e2e.py selftest"
            indent <<<"$out"
        fi
    fi

    if ((DRY_RUN)); then
        section "Log checks on canned NCCL logs"
        dry_run_log_checks
        section "Plan (not run)"
        plugin_env
        note "rank r of 2, both on cuda:0, $PY $PYPROG run --phases check,ddp,bw:"
        note "  ${COMMON_ENV[*]} ${PLUGIN_ENV[*]} NCCL_HOSTID=gpu-e2e-plugin-host<r>"
        note "baseline, --phases ddp,bw:"
        note "  ${COMMON_ENV[*]} ${BASELINE_ENV[*]} NCCL_HOSTID=gpu-e2e-socket-host<r>"
        if ((TORCH_OK)); then
            note "torch is importable here; a dry run goes no further"
        fi
        skip "GPU check (torch.cuda, device 0)"
        skip "plugin run: collectives 4 B..256 MiB, $DDP_STEPS DDP steps, all_reduce bandwidth"
        skip "NCCL log assertions on the plugin run's logs (checked above on canned logs)"
        skip "Socket baseline run: DDP steps, all_reduce bandwidth"
        skip "DDP loss comparison and bandwidth ratio table (checked above on canned results)"
        summary
        return
    fi

    # ---- GPU run ----
    if ((!so_ok)) || [[ -z $PY ]]; then
        fail "cannot run on the GPU without the .so and python"
        summary
        return
    fi
    if ((!TORCH_OK)); then
        fail "torch: not importable by $PY (set PYTHON to an interpreter with a CUDA torch)"
        summary
        return
    fi
    section "GPU"
    if gpu_info=$("$PY" - 2>&1 <<'EOF'
import sys
import torch
import torch.distributed as dist
if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
    print("no CUDA device visible to torch"); sys.exit(1)
if not dist.is_nccl_available():
    print("this torch has no NCCL backend"); sys.exit(1)
p = torch.cuda.get_device_properties(0)
print(f"{p.name}, {p.total_memory / 2**30:.0f} GiB; torch {torch.__version__}, CUDA "
      f"{torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}; "
      f"{torch.cuda.device_count()} device(s), using cuda:0 for both ranks")
EOF
    ); then
        pass "GPU: $gpu_info"
        [[ $gpu_info =~ NCCL\ ([0-9]+\.[0-9]+\.[0-9]+) ]] && NCCL_VERSION_HINT=${BASH_REMATCH[1]}
    else
        fail "GPU: $(tail -n 1 <<<"$gpu_info")"
        summary
        return
    fi
    if [[ -z $OUT_DIR ]]; then
        OUT_DIR=$(mktemp -d /tmp/gpu-e2e.XXXXXX)
    else
        mkdir -p "$OUT_DIR" && OUT_DIR=$(cd "$OUT_DIR" && pwd)
    fi
    note "logs and outputs: $OUT_DIR"

    section "Plugin run (NCCL_NET_PLUGIN=$SO, NCCL_ERDMA_TRANSPORT=$TRANSPORT)"
    plugin_env
    lim=$(limit_for "$PLUGIN_TIMEOUT")
    if ((lim < 30)); then
        fail "plugin run: only ${lim}s left of the ${BUDGET}s budget"
    elif launch plugin "$lim" check,ddp,bw "${PLUGIN_ENV[@]}"; then
        pass "plugin run: both ranks exited 0 in ${LAUNCH_SECONDS}s (limit ${lim}s)"
    else
        fail "plugin run: rank exit codes $LAUNCH_RCS after ${LAUNCH_SECONDS}s (limit ${lim}s)"
        show_launch_failure plugin
    fi
    if [[ -d $OUT_DIR/plugin ]]; then
        shopt -s nullglob
        local logs=("$OUT_DIR"/plugin/nccl.rank*.log)
        shopt -u nullglob
        tally < <(check_plugin_logs "${logs[@]}")
    fi

    section "Baseline run (NCCL_NET_PLUGIN=none NCCL_NET=Socket)"
    lim=$(limit_for "$BASELINE_TIMEOUT")
    if ((lim < 30)); then
        fail "baseline run: only ${lim}s left of the ${BUDGET}s budget"
    elif launch socket "$lim" ddp,bw "${BASELINE_ENV[@]}"; then
        pass "baseline run: both ranks exited 0 in ${LAUNCH_SECONDS}s (limit ${lim}s)"
    else
        fail "baseline run: rank exit codes $LAUNCH_RCS after ${LAUNCH_SECONDS}s (limit ${lim}s)"
        show_launch_failure socket
    fi
    if [[ -d $OUT_DIR/socket ]]; then
        shopt -s nullglob
        local slogs=("$OUT_DIR"/socket/nccl.rank*.log)
        shopt -u nullglob
        tally < <(check_socket_logs "${slogs[@]}")
    fi

    section "Results"
    tally < <("$PY" "$PYPROG" report --plugin "$OUT_DIR/plugin/rank0.out" \
        --baseline "$OUT_DIR/socket/rank0.out" --target "$TARGET" --loss-atol "$LOSS_ATOL" 2>&1)
    note "wall time: ${SECONDS}s"
    summary
}

main
