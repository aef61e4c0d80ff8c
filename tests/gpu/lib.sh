# shellcheck shell=bash
# Helpers shared by the GPU checks (tests/gpu/*-e2e.sh) and benchmarks (bench/gpu): logging, timing,
# gpusnap and raw driver calls, workers and fillers, and the cleanup that
# never kills a live restored CUDA process without suspending it first.
#
# The caller sets NAME (stem of the log file in $OUT) and sources this file
# from the repository root. Environment read here:
#   GPUSNAP  the binary (default ./target/release/gpusnap)
#   OUT      directory for the results (default: a new temp directory)

set -u
export LC_ALL=C TZ=UTC PYTHONUNBUFFERED=1

GPU_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
GPUSNAP=${GPUSNAP:-./target/release/gpusnap}
case $GPUSNAP in
    /*) ;;
    */*) GPUSNAP=$PWD/$GPUSNAP ;;
    *) GPUSNAP=$(command -v "$GPUSNAP" || printf '%s' "$PWD/$GPUSNAP") ;;
esac
if [ -z "${OUT:-}" ]; then
    OUT=$(mktemp -d /tmp/gpusnap-out.XXXXXX)
fi
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/gpusnap-gpu.XXXXXX)
STATE_DIR=$WORK/state
mkdir -p "$STATE_DIR"
LOG=$OUT/${NAME:?set NAME before sourcing lib.sh}.log
: >"$LOG"

WORKERS=()       # CUDA workers started by this run (stopped through gpusnap)
FILLERS=()       # fillers: never checkpointed, plain SIGKILL is safe
HELPERS=()       # non-CUDA helpers (sleep): plain SIGKILL
RESTORED=" "     # pids that saw a restore attempt (gpusnap or raw)
LEFT_ALIVE=""    # pids cleanup could not end safely
CLEANED=0
WATCHDOG_PID=""
# Filled by collect_header; set here so a report written early never trips set -u.
HDR_DATE="?" HDR_HOST="?" HDR_KERNEL="?" HDR_GPU="?" HDR_DRIVER="?" HDR_GPU_MEM="?"
HDR_VERSION="?" HDR_VERSION_RC="?" HDR_THP="?" HDR_THP_DEFRAG="?" HDR_HOSTMEM="?"

# ---------------------------------------------------------------- logging

log() {
    local line
    printf -v line '%(%Y-%m-%dT%H:%M:%S)TZ +%03ds %s' -1 "$SECONDS" "$*"
    printf '%s\n' "$line" >>"$LOG"
    printf '%s\n' "$line" >&2
}

# log_file TITLE FILE: copy a file into the log only (not to stderr).
log_file() {
    [ -s "$2" ] || return 0
    printf '    ---- %s (%s)\n' "$1" "$2" >>"$LOG"
    sed 's/^/    | /' "$2" >>"$LOG"
}

# ---------------------------------------------------------------- numbers

now() {
    if [ -n "${EPOCHREALTIME:-}" ]; then printf '%s\n' "$EPOCHREALTIME"; else date +%s.%N; fi
}

# calc FORMAT EXPR [var=value]...: awk arithmetic; empty values count as 0.
calc() {
    local f=$1 e=$2 kv
    shift 2
    local args=()
    for kv in "$@"; do args+=(-v "$kv"); done
    awk "${args[@]}" "BEGIN { printf \"$f\", $e }"
}

fsub() { calc %.3f 'b - a' a="$1" b="$2"; }          # seconds between two now()s
gb() { if [ -n "${1:-}" ]; then calc %.2f 'b / 1e9' b="$1"; else printf '?'; fi; }
mib_gb() { if [ -n "${1:-}" ]; then calc %.2f 'm * 1048576 / 1e9' m="$1"; else printf '?'; fi; }
# gbps BYTES SECONDS
gbps() { if [ -n "${1:-}" ] && [ -n "${2:-}" ]; then calc %.2f '(s > 0) ? b / 1e9 / s : 0' b="$1" s="$2"; else printf '?'; fi; }
# fle A B: A <= B (floats)
fle() { [ "$(calc %d '(a <= b) ? 1 : 0' a="$1" b="$2")" = 1 ]; }

# jget FILE EXPR: evaluate a Python expression on the JSON object d in FILE.
# Prints the value (true/false for booleans), or nothing if anything fails.
jget() {
    python3 - "$1" "$2" <<'PY' 2>/dev/null || true
import json, sys
try:
    with open(sys.argv[1]) as f:
        d = json.load(f)
    v = eval(sys.argv[2], {"d": d})
except Exception:
    sys.exit(0)
if isinstance(v, (bool, list, dict)) or v is None:
    print(json.dumps(v))
else:
    print(v)
PY
}

# ---------------------------------------------------------------- processes

# pstate PID: one-letter state from /proc/PID/stat; fails if there is no such pid.
pstate() {
    local s
    s=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    s=${s##*) }
    printf '%s\n' "${s%% *}"
}

alive() {
    local s
    s=$(pstate "$1") || return 1
    [ -n "$s" ] && [ "$s" != Z ] && [ "$s" != X ]
}

# wait_gone PID TIMEOUT_S
wait_gone() {
    local end=$((SECONDS + $2))
    while alive "$1"; do
        [ "$SECONDS" -lt "$end" ] || return 1
        sleep 0.2
    done
    return 0
}

# wait_pstate PID LETTERS TIMEOUT_S: wait until the state is one of LETTERS.
wait_pstate() {
    local end=$((SECONDS + $3)) s
    while [ "$SECONDS" -lt "$end" ]; do
        s=$(pstate "$1") || return 1
        case $2 in *"$s"*) return 0 ;; esac
        sleep 0.1
    done
    return 1
}

vmrss_mib() {
    awk '/^VmRSS:/ { printf "%d", $2 / 1024 }' "/proc/$1/status" 2>/dev/null || true
}

mem_avail_mib() {
    awk '/^MemAvailable:/ { printf "%d", $2 / 1024 }' /proc/meminfo
}

# ---------------------------------------------------------------- nvidia-smi

# smi_pid_mib PID: MiB nvidia-smi lists for that pid, nothing if not listed.
smi_pid_mib() {
    timeout 30 nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null |
        awk -F', *' -v p="$1" '$1 == p { s += $2; f = 1 } END { if (f) printf "%d", s }'
}

smi_apps() {
    timeout 30 nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null |
        tr '\n' ';' || true
}

smi_free_mib() {
    timeout 30 nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits -i 0 2>/dev/null | head -n 1 | tr -d ' '
}

smi_used_mib() {
    timeout 30 nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 2>/dev/null | head -n 1 | tr -d ' '
}

# wait_smi_used_le MIB TIMEOUT_S: until nvidia-smi reports at most MIB used
# (SMI_USED: the last reading).
wait_smi_used_le() {
    local end=$((SECONDS + $2))
    while :; do
        SMI_USED=$(smi_used_mib)
        if [ -n "$SMI_USED" ] && [ "$SMI_USED" -le "$1" ] 2>/dev/null; then return 0; fi
        [ "$SECONDS" -lt "$end" ] || return 1
        sleep 0.5
    done
}

# wait_smi_free MIB TIMEOUT_S: until nvidia-smi reports at least MIB free.
wait_smi_free() {
    local end=$((SECONDS + $2)) f
    while [ "$SECONDS" -lt "$end" ]; do
        f=$(smi_free_mib)
        if [ -n "$f" ] && [ "$f" -ge "$1" ] 2>/dev/null; then return 0; fi
        sleep 0.5
    done
    return 1
}

# wait_smi_unlisted PID TIMEOUT_S: until nvidia-smi lists no memory for PID.
wait_smi_unlisted() {
    local end=$((SECONDS + $2)) m
    while :; do
        m=$(smi_pid_mib "$1")
        if [ -z "$m" ] || [ "$m" = 0 ]; then return 0; fi
        [ "$SECONDS" -lt "$end" ] || return 1
        sleep 0.5
    done
}

collect_header() {
    local smi
    HDR_DATE=$(date -u '+%Y-%m-%d %H:%M:%S UTC')
    HDR_HOST=$(hostname 2>/dev/null || cat /proc/sys/kernel/hostname)
    HDR_KERNEL=$(uname -r)
    smi=$(timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -n 1)
    HDR_GPU=$(printf '%s' "$smi" | cut -d, -f1 | sed 's/^ *//')
    HDR_DRIVER=$(printf '%s' "$smi" | cut -d, -f2 | tr -d ' ')
    HDR_GPU_MEM=$(printf '%s' "$smi" | cut -d, -f3 | sed 's/^ *//')
    HDR_VERSION=$(timeout 30 "$GPUSNAP" --version 2>&1)
    HDR_VERSION_RC=$?
    HDR_VERSION=${HDR_VERSION%%$'\n'*}
    HDR_THP=$(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null || echo unknown)
    HDR_THP_DEFRAG=$(cat /sys/kernel/mm/transparent_hugepage/defrag 2>/dev/null || echo unknown)
    HDR_HOSTMEM=$(awk '/^MemTotal:/ { printf "%.0f GiB", $2 / 1048576 }' /proc/meminfo)
    # The CPU: hosts of one kind differ, and the page server shares it with
    # the driver's restore (bench/results/029, 030); threads per
    # core say whether a fill thread can share a core with the driver's.
    HDR_HOSTMEM="$HDR_HOSTMEM; $(nproc) CPUs: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $(lscpu 2>/dev/null | awk -F: '/^NUMA node\(s\)/ { gsub(/ /, "", $2); print $2 " NUMA node(s)" }'), $(lscpu 2>/dev/null | awk -F: '/^Thread\(s\) per core/ { gsub(/ /, "", $2); print $2 " thread(s) per core" }')"
    log "date $HDR_DATE host $HDR_HOST kernel $HDR_KERNEL"
    log "gpu '$HDR_GPU' driver '$HDR_DRIVER' memory '$HDR_GPU_MEM'; host memory $HDR_HOSTMEM"
    log "gpusnap $GPUSNAP: '$HDR_VERSION' (exit $HDR_VERSION_RC)"
    log "THP enabled: $HDR_THP; defrag: $HDR_THP_DEFRAG"
    log "compute apps before start: $(smi_apps)"
    log "results in $OUT, scratch in $WORK"
}

# ---------------------------------------------------------------- gpusnap

GS_N=0
# gs TIMEOUT_S ARGS...: one gpusnap call with --json and this run's state dir.
# Sets GS_RC (exit status; 124/137 = our timeout), GS_S (wall seconds),
# GS_OUT/GS_ERR (files with stdout/stderr), GS_MSG (last stderr line).
gs() {
    local to=$1 t0 t1
    shift
    GS_N=$((GS_N + 1))
    GS_OUT=$WORK/gs.$GS_N.out
    GS_ERR=$WORK/gs.$GS_N.err
    log "gpusnap $* (timeout ${to}s)"
    t0=$(now)
    GS_RC=0
    timeout -k 10 "$to" "$GPUSNAP" --json --state-dir "$STATE_DIR" "$@" \
        </dev/null >"$GS_OUT" 2>"$GS_ERR" || GS_RC=$?
    t1=$(now)
    GS_S=$(fsub "$t0" "$t1")
    # The error line is "gpusnap: ..." (a "  hint:" line may follow).
    # shellcheck disable=SC2034 # read by the callers
    # Warnings said before acting ("gpusnap: warning: ...") are not the error.
    GS_MSG=$(grep '^gpusnap: ' "$GS_ERR" | grep -v '^gpusnap: warning: ' | head -n 1 | cut -c1-300)
    if [ -z "$GS_MSG" ]; then GS_MSG=$(grep -v '^[[:space:]]*$' "$GS_ERR" | tail -n 1 | cut -c1-300); fi
    log "  -> exit $GS_RC in ${GS_S}s; stdout: $(head -c 1500 "$GS_OUT" | tr '\n' ' ')"
    if [ -s "$GS_ERR" ]; then
        log "  stderr: $(tail -n 5 "$GS_ERR" | cut -c1-400 | tr '\n' '|')"
    fi
    return 0
}

RAW_N=0
# raw TIMEOUT_S ARGS...: tests/gpu/cuckpt.py ARGS, the bare driver calls.
# Sets RAW_RC, RAW_S (wall seconds of the whole python process), RAW_OUT (JSON).
raw() {
    local to=$1 t0 t1
    shift
    RAW_N=$((RAW_N + 1))
    RAW_OUT=$WORK/raw.$RAW_N.out
    local err=$WORK/raw.$RAW_N.err
    log "cuckpt.py $* (timeout ${to}s)"
    t0=$(now)
    RAW_RC=0
    timeout -k 5 "$((to + 10))" python3 "$GPU_DIR/cuckpt.py" --deadline "$to" "$@" \
        </dev/null >"$RAW_OUT" 2>"$err" || RAW_RC=$?
    t1=$(now)
    RAW_S=$(fsub "$t0" "$t1")
    log "  -> exit $RAW_RC in ${RAW_S}s: $(tr '\n' '|' <"$err" | cut -c1-600)"
    log "  json: $(head -c 1500 "$RAW_OUT")"
    return 0
}

# raw_rcs: the rc of every call in RAW_OUT, space separated ("2 0" ...).
raw_rcs() { jget "$RAW_OUT" '" ".join(str(c["rc"]) for c in d["calls"])'; }

# ---------------------------------------------------------------- workers

# read_status FILE: sets ST_PID ST_ITER ST_OK ST_TS; fails if unreadable.
read_status() {
    ST_PID="" ST_ITER="" ST_OK="" ST_TS=""
    [ -r "$1" ] || return 1
    read -r ST_PID ST_ITER ST_OK ST_TS _ <"$1" 2>/dev/null || true
    [ -n "$ST_TS" ] && [ "$ST_ITER" -ge 0 ] 2>/dev/null
}

# start_worker NAME GIB [worker.py options]: sets LAST_PID; status in $WORK/NAME.status.
# WORKER_SCRIPT (default worker.py) picks another workload of the same
# command line and status line (worker_cupy.py: the memory held by CuPy).
start_worker() {
    local name=$1 gib=$2
    shift 2
    rm -f "$WORK/$name.status" "$WORK/$name.status.exit"
    # The log is opened for appending: CRIU refuses to restore a file opened
    # for writing without O_APPEND whose size changed after the dump ("has
    # bad size"), so a line the worker writes after a snapshot would make
    # the snapshot unrestorable.
    : >"$WORK/$name.log"
    python3 "$GPU_DIR/${WORKER_SCRIPT:-worker.py}" "$gib" "$WORK/$name.status" "$@" \
        </dev/null >>"$WORK/$name.log" 2>&1 &
    LAST_PID=$!
    WORKERS+=("$LAST_PID")
    log "worker $name: pid $LAST_PID, $gib GiB $* (${WORKER_SCRIPT:-worker.py})"
}

# wait_ready NAME PID TIMEOUT_S: until the worker did 2 passes with ok=1.
wait_ready() {
    local name=$1 pid=$2 end=$((SECONDS + $3)) st=$WORK/$1.status
    while [ "$SECONDS" -lt "$end" ]; do
        if ! alive "$pid"; then
            log "worker $name (pid $pid) died while starting"
            log_file "$name log" "$WORK/$name.log"
            return 1
        fi
        if read_status "$st" && [ "$ST_ITER" -ge 2 ]; then
            if [ "$ST_PID" != "$pid" ]; then
                log "WARNING: worker $name writes pid $ST_PID, shell started $pid"
            fi
            log "worker $name ready: $(cat "$st")"
            [ "$ST_OK" = 1 ] && return 0
            log "worker $name reports a bad checksum"
            return 1
        fi
        sleep 0.5
    done
    log "worker $name (pid $pid) not ready after $3 s"
    log_file "$name log" "$WORK/$name.log"
    return 1
}

# wait_iter_gt NAME N TIMEOUT_S: until the worker's iteration exceeds N (sets ST_*).
wait_iter_gt() {
    local end=$((SECONDS + $3))
    while :; do
        if read_status "$WORK/$1.status" && [ "$ST_ITER" -gt "$2" ]; then return 0; fi
        [ "$SECONDS" -lt "$end" ] || return 1
        sleep 0.2
    done
}

# start_filler LEAVE_MIB TIMEOUT_S: sets FILLER_PID, FILL_BEFORE/FILL_AFTER/FILL_HELD (MiB).
start_filler() {
    local ready=$WORK/filler.$RANDOM.ready end=$((SECONDS + $2))
    FILL_BEFORE="" FILL_AFTER="" FILL_HELD=""
    rm -f "$ready"
    python3 "$GPU_DIR/filler.py" "$1" "$ready" --max-s 600 \
        </dev/null >>"$WORK/filler.log" 2>&1 &
    FILLER_PID=$!
    FILLERS+=("$FILLER_PID")
    log "filler: pid $FILLER_PID, leave $1 MiB"
    while [ "$SECONDS" -lt "$end" ]; do
        if [ -s "$ready" ]; then
            read -r _ FILL_BEFORE FILL_AFTER FILL_HELD <"$ready" || true
            log "filler ready: free $FILL_BEFORE -> $FILL_AFTER MiB, holds $FILL_HELD MiB; nvidia-smi free $(smi_free_mib) MiB"
            return 0
        fi
        if ! alive "$FILLER_PID"; then
            log "filler died"
            log_file "filler log" "$WORK/filler.log"
            return 1
        fi
        sleep 0.5
    done
    log "filler not ready after $2 s"
    return 1
}

# kill_fillers: fillers were never checkpointed; SIGKILL is safe.
kill_fillers() {
    local p
    for p in ${FILLERS[@]+"${FILLERS[@]}"}; do
        if alive "$p"; then
            log "killing filler $p"
            kill -KILL "$p" 2>/dev/null
            wait_gone "$p" 30 || log "filler $p still there after 30 s"
        fi
    done
    return 0
}

mark_restored() {
    case $RESTORED in *" $1 "*) ;; *) RESTORED="$RESTORED$1 " ;; esac
}

was_restored() {
    case $RESTORED in *" $1 "*) return 0 ;; esac
    return 1
}

# stop_safely PID [WHY]: end a CUDA worker without ever killing it live after a
# restore: `gpusnap stop` first (without --force: --force kills even when the
# suspend failed); if the pid survives, a raw lock + checkpoint, and SIGKILL
# only if the process is then checkpointed (holds no GPU memory), is not a
# CUDA process, or was never restored. Otherwise it is left alive, reported.
stop_safely() {
    local pid=$1 why=${2:-cleanup} st rc0
    alive "$pid" || return 0
    log "stopping pid $pid safely ($why)"
    case $(pstate "$pid") in
        T | t)
            log "pid $pid is stopped; SIGCONT first (the driver hangs on stopped processes)"
            kill -CONT "$pid" 2>/dev/null
            sleep 1
            ;;
    esac
    gs 240 stop "$pid"
    # A successful stop returns once the pid is gone; after a failed one, a
    # short look is enough before the fallback.
    if wait_gone "$pid" "$([ "$GS_RC" = 0 ] && echo 60 || echo 2)"; then
        log "pid $pid gone (gpusnap stop exit $GS_RC)"
        return 0
    fi
    log "gpusnap stop left pid $pid alive (exit $GS_RC); raw lock + checkpoint"
    raw 180 --keep-going --timeout-ms 30000 "$pid" state lock checkpoint state
    st=$(jget "$RAW_OUT" 'd["final_state"]')
    rc0=$(jget "$RAW_OUT" 'd["calls"][0]["rc"]')
    if [ "$st" = checkpointed ] || [ "$rc0" = 3 ] || ! was_restored "$pid"; then
        log "pid $pid: driver state '$st' (first rc '$rc0'), restored before: $(was_restored "$pid" && echo yes || echo no); SIGKILL"
        kill -KILL "$pid" 2>/dev/null
        if wait_gone "$pid" 60; then return 0; fi
        log "pid $pid survived SIGKILL for 60 s"
    else
        log "NOT KILLING pid $pid: it was restored and could not be suspended (state '$st')"
    fi
    LEFT_ALIVE="$LEFT_ALIVE $pid"
    return 1
}

# ---------------------------------------------------------------- CRIU and images

# criu_probe: finds CRIU as gpusnap will (GPUSNAP_CRIU, else criu on PATH) and
# runs `criu --version` and `criu check`. Sets CRIU_BIN, CRIU_VERSION,
# CRIU_CHECK (its last line), CRIU_CHECK_RC, CRIU_OK (1 when gpusnap can use
# it: found, version >= 4.0, check passed) and CRIU_WHY (why not).
criu_probe() {
    local out maj
    CRIU_BIN=${GPUSNAP_CRIU:-$(command -v criu 2>/dev/null || true)}
    CRIU_VERSION="" CRIU_CHECK="" CRIU_CHECK_RC="" CRIU_OK=0 CRIU_WHY=""
    if [ -z "$CRIU_BIN" ] || [ ! -x "$CRIU_BIN" ]; then
        if [ -n "${GPUSNAP_CRIU:-}" ]; then
            CRIU_WHY="GPUSNAP_CRIU=$GPUSNAP_CRIU is not an executable"
        else
            CRIU_WHY="no criu on PATH (tests/gpu/device.sh installs one from .dev/criu)"
        fi
        log "criu: $CRIU_WHY"
        return 1
    fi
    out=$(timeout 30 "$CRIU_BIN" --version 2>&1)
    CRIU_VERSION=$(printf '%s\n' "$out" | sed -n 's/^Version: *//p' | head -n 1)
    out=$(timeout 60 "$CRIU_BIN" check 2>&1)
    CRIU_CHECK_RC=$?
    CRIU_CHECK=$(printf '%s\n' "$out" | grep -v '^[[:space:]]*$' | tail -n 1 | cut -c1-200)
    log "criu $CRIU_BIN: version '${CRIU_VERSION:-?}'; criu check: exit $CRIU_CHECK_RC, '$CRIU_CHECK'"
    maj=${CRIU_VERSION%%.*}
    if [ -z "$CRIU_VERSION" ]; then
        CRIU_WHY="$CRIU_BIN printed no version"
    elif ! [ "$maj" -ge 4 ] 2>/dev/null; then
        CRIU_WHY="criu $CRIU_VERSION is older than 4.0"
    elif [ "$CRIU_CHECK_RC" != 0 ]; then
        CRIU_WHY="criu check failed (exit $CRIU_CHECK_RC): $CRIU_CHECK"
    else
        # shellcheck disable=SC2034 # read by the callers
        CRIU_OK=1
        return 0
    fi
    log "criu unusable: $CRIU_WHY"
    return 1
}

# disk_free_bytes DIR: bytes available to root-less writers on DIR's filesystem.
disk_free_bytes() {
    df -P -B1 "$1" 2>/dev/null | awk 'NR == 2 { print $4 }'
}

# du_bytes PATH: apparent size of a file tree in bytes (0 if absent).
du_bytes() {
    local b
    b=$(du -sb "$1" 2>/dev/null | cut -f1)
    printf '%s\n' "${b:-0}"
}

# reap PID: a worker this shell started is its child; once it is killed (by
# CRIU, or by gpusnap hibernate), collect it so its pid is free for a
# restore. bash normally reaps on SIGCHLD by itself; this makes sure. Only
# a zombie is waited for (wait on a live child would block).
reap() {
    if [ "$(pstate "$1" 2>/dev/null)" = Z ]; then
        wait "$1" 2>/dev/null || true
    fi
    return 0
}

# wait_pid_free PID TIMEOUT_S: until no process (not even a zombie) has PID.
wait_pid_free() {
    local end=$((SECONDS + $2))
    while [ -e "/proc/$1" ]; do
        reap "$1"
        [ -e "/proc/$1" ] || break
        [ "$SECONDS" -lt "$end" ] || return 1
        sleep 0.05
    done
    return 0
}

# image_logs IMAGE: the tails of the image's CRIU logs (its dump.log and the
# newest restore.log) into the log. A failed hibernate leaves no image; its
# dump.log is kept in STATE_DIR/logs/MILLIS-dump-IMAGE/, and every wake's
# restore log in STATE_DIR/logs/MILLIS-restore-IMAGE/ (the error names it).
image_logs() {
    local dir=$STATE_DIR/images/$1 f newest="" dump=""
    # MILLIS-...: the last in glob order is the newest.
    for f in "$STATE_DIR"/logs/*-restore-"$1"/restore.log; do [ -s "$f" ] && newest=$f; done
    for f in "$STATE_DIR"/logs/*-dump-"$1"/dump.log "$dir/criu/dump.log"; do [ -s "$f" ] && dump=$f; done
    for f in ${dump:+"$dump"} ${newest:+"$newest"}; do
        [ -s "$f" ] || continue
        printf '    ---- last 30 lines of %s\n' "$f" >>"$LOG"
        tail -n 30 "$f" | cut -c1-300 | sed 's/^/    | /' >>"$LOG"
    done
    return 0
}

# images_clear: removes every image of this run's state dir (they hold the
# memory of the processes: GBs each), through gpusnap, then whatever is left
# (temporary directories of an interrupted hibernate) directly.
images_clear() {
    local dir=$STATE_DIR/images n
    [ -d "$dir" ] || return 0
    for n in "$dir"/*; do
        [ -d "$n" ] || continue
        timeout 120 "$GPUSNAP" --state-dir "$STATE_DIR" images rm "${n##*/}" </dev/null >/dev/null 2>&1 ||
            log "gpusnap images rm ${n##*/} failed"
    done
    rm -rf "${dir:?}"/* "${dir:?}"/.[!.]* 2>/dev/null
    log "images removed; $(disk_free_bytes "$WORK") bytes free on $WORK"
}

# run_helpers: gpusnap processes of this run still alive (guards and their
# keepers that `gpusnap wake` starts carry --state-dir $STATE_DIR): "pid comm;...".
run_helpers() {
    local d pid cmd out=""
    for d in /proc/[0-9]*; do
        pid=${d#/proc/}
        [ "$pid" = "$$" ] && continue
        cmd=$(tr '\0' ' ' <"$d/cmdline" 2>/dev/null) || continue
        case $cmd in
            *"$STATE_DIR"*) case $cmd in *gpusnap*) out="$out$pid;" ;; esac ;;
        esac
    done
    printf '%s' "$out"
}

# end_run_helpers: after every worker is gone, guards should have ended on
# their own; any left (they hold no GPU memory) get SIGTERM, then SIGKILL.
end_run_helpers() {
    local h p end
    h=$(run_helpers)
    [ -n "$h" ] || return 0
    end=$((SECONDS + 5))
    while [ -n "$h" ] && [ "$SECONDS" -lt "$end" ]; do
        sleep 0.5
        h=$(run_helpers)
    done
    [ -n "$h" ] || return 0
    log "gpusnap helpers of this run still alive after the workers: $h"
    for p in ${h//;/ }; do
        log "  $p: $(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | cut -c1-200)"
        kill -TERM "$p" 2>/dev/null
    done
    sleep 2
    for p in ${h//;/ }; do
        if alive "$p"; then kill -KILL "$p" 2>/dev/null; fi
    done
    return 0
}

# cleanup_all: idempotent; fillers and helpers first, then every worker.
cleanup_all() {
    local p
    [ "$CLEANED" = 1 ] && return 0
    CLEANED=1
    # A handler, not '' (ignored): ignored signals would be inherited by the
    # gpusnap and python processes cleanup starts.
    trap 'log "signal ignored: cleanup is running"' INT TERM HUP
    : >"$WORK/.done"
    log "cleanup"
    kill_fillers
    for p in ${HELPERS[@]+"${HELPERS[@]}"}; do
        if alive "$p"; then kill -KILL "$p" 2>/dev/null; fi
    done
    for p in ${WORKERS[@]+"${WORKERS[@]}"}; do
        stop_safely "$p" cleanup || true
    done
    if [ -n "$LEFT_ALIVE" ]; then
        log "LEFT ALIVE (could not be stopped safely):$LEFT_ALIVE"
    fi
    end_run_helpers
    images_clear
    return 0
}

# start_watchdog SECONDS: SIGTERM to this script after that long; the trap
# then cleans up. It polls instead of sleeping long, so no orphan keeps the
# script's output open, and ends once cleanup starts.
start_watchdog() {
    local me=$$ done=$WORK/.done limit=$1 end
    (
        end=$(($(date +%s) + limit))
        while [ "$(date +%s)" -lt "$end" ]; do
            [ -e "$done" ] && exit 0
            sleep 1
        done
        [ -e "$done" ] || kill -TERM "$me"
    ) </dev/null >/dev/null 2>&1 &
    WATCHDOG_PID=$!
    log "watchdog (pid $WATCHDOG_PID): SIGTERM to $me after ${limit}s"
}

on_signal() {
    log "caught SIG$1; cleaning up"
    exit 130
}

# install_traps: the caller defines on_exit (cleanup_all, then its report).
# shellcheck disable=SC2317 # the handlers run from traps
install_traps() {
    trap 'on_signal INT' INT
    trap 'on_signal TERM' TERM
    trap 'on_signal HUP' HUP
    trap 'log "(a command failed at line $LINENO: exit $?)"' ERR
    trap on_exit EXIT
}

# ---------------------------------------------------------------- benches
# bench/gpu/suspend-resume.sh and hibernate.sh: each keeps NOTES (the report's notes) and
# ERRORS (what went wrong), and measures one worker per size.

# note TEXT: a line for the report's notes (and the log).
note() {
    printf '%s\n' "$*" >>"$NOTES"
    log "NOTE: $*"
}

# note_interrupted RC: from a bench's EXIT trap (RC: its exit status): a note
# and an error when it did not get to FINISHED=1.
note_interrupted() {
    if [ "$FINISHED" != 1 ]; then
        note "run interrupted (exit $1) at +${SECONDS}s"
        ERRORS=$((ERRORS + 1))
    fi
}

# note_left_alive: after the cleanup, a note and an error for what it could
# not stop safely.
note_left_alive() {
    if [ -n "$LEFT_ALIVE" ]; then
        note "cleanup could not stop safely:$LEFT_ALIVE"
        ERRORS=$((ERRORS + 1))
    fi
}

# size_fits GIB GBE LEFT NEED: whether a size of GIB GiB (~GBE GB on the GPU)
# fits NEED seconds in the LEFT left of the budget and its suspended copy in
# host memory; otherwise a note and an error.
size_fits() {
    if [ "$3" -lt "$4" ]; then
        note "size $1 GiB skipped: ${3}s of budget left, one rep needs ~${4}s with start and stop"
        ERRORS=$((ERRORS + 1))
        return 1
    fi
    if [ "$(mem_avail_mib)" -lt "$(calc %d 'g * 1024 * 1.1 + 4096' g="$2")" ]; then
        note "size $1 GiB skipped: host MemAvailable $(mem_avail_mib) MiB cannot hold its suspended copy"
        ERRORS=$((ERRORS + 1))
        return 1
    fi
}

# size_worker NAME GIB: starts the size's worker (LAST_PID) and waits until it
# is ready; otherwise a note, an error, and the worker stopped safely.
size_worker() {
    start_worker "$1" "$2"
    if ! wait_ready "$1" "$LAST_PID" 300; then
        note "size $2 GiB: the worker did not start"
        ERRORS=$((ERRORS + 1))
        stop_safely "$LAST_PID" "bench start failed" || true
        return 1
    fi
}

# size_stop GIB PID: ends the size's worker with `gpusnap stop`, noted (and
# stopped safely when that left it alive).
size_stop() {
    local sus rel
    gs 300 stop "$2"
    sus=$(jget "$GS_OUT" 'd["results"][0]["suspended"]')
    rel=$(jget "$GS_OUT" 'd["results"][0]["released_before_kill"]')
    if wait_gone "$2" "$([ "$GS_RC" = 0 ] && echo 60 || echo 2)"; then
        note "size $1 GiB: gpusnap stop exit $GS_RC in ${GS_S} s (suspended $sus, released_before_kill $rel)"
        if [ "$GS_RC" != 0 ]; then ERRORS=$((ERRORS + 1)); fi
    else
        note "size $1 GiB: gpusnap stop exit $GS_RC left pid $2 alive; stopping it safely"
        ERRORS=$((ERRORS + 1))
        stop_safely "$2" "bench stop failed" || true
    fi
}

# A dry run against the fakes (docs/design/fakes.md) replaces the PyTorch workers,
# the filler and nvidia-smi here; see the end of tests/gpu/README.md.
if [ -n "${GPU_TEST_HOOK:-}" ]; then
    # shellcheck disable=SC1090
    . "$GPU_TEST_HOOK"
fi

# ---------------------------------------------------------------- results table
# Each script keeps NPASS NFAIL NSKIP NINFO and appends rows to $ROWS.

# cell TEXT: one table cell (no tabs, newlines or bars; empty is "-").
cell() {
    local s=${1:--}
    s=${s//$'\t'/ }
    s=${s//$'\n'/ }
    s=${s//|/\\|}
    printf '%s' "${s:--}"
}

# row ID CHECK EXPECTED GOT RESULT [FIGURE]; RESULT is PASS, FAIL, SKIP or INFO.
row() {
    case $5 in
        PASS) NPASS=$((NPASS + 1)) ;;
        FAIL) NFAIL=$((NFAIL + 1)) ;;
        SKIP) NSKIP=$((NSKIP + 1)) ;;
        *) NINFO=$((NINFO + 1)) ;;
    esac
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$(cell "$1")" "$(cell "$2")" "$(cell "$3")" \
        "$(cell "$4")" "$(cell "$5")" "$(cell "${6:-}")" >>"$ROWS"
    log "ROW $1 [$5] $2 | expected: $3 | got: $4 | ${6:-}"
}

# budget_need BUDGET SECONDS ID CHECK: true if SECONDS of the soft budget
# BUDGET (seconds from the script's start) are left; otherwise records a
# SKIP row for ID.
budget_need() {
    local left=$(($1 - SECONDS))
    if [ "$left" -ge "$2" ]; then return 0; fi
    row "$3" "$4" "runs" "skipped: ${left}s of budget left, needs $2s" SKIP
    return 1
}

# torch_seen: the torch version the first worker log of this run names (torch=...).
torch_seen() {
    grep -ho 'torch=[^ ]*' "$WORK"/*.log 2>/dev/null | head -n 1 | cut -d= -f2
}

# rows_md HEADER...: the rows as a markdown table under those six headers.
rows_md() {
    local id c e g r f
    printf '| %s ' "$@"
    echo '|'
    printf '|---%.0s' "$@"
    echo '|'
    while IFS=$'\t' read -r id c e g r f; do
        printf '| %s | %s | %s | %s | %s | %s |\n' "$id" "$c" "$e" "$g" "$r" "$f"
    done <"$ROWS"
}

# row_interrupted RC: from an e2e script's EXIT trap (RC: its exit status): a
# FAIL row z0 when it did not get to FINISHED=1.
row_interrupted() {
    if [ "$FINISHED" != 1 ]; then
        row z0 "run completes" "all sections ran" "interrupted (exit $1) at +${SECONDS}s" FAIL
    fi
}

# row_all_gone PID...: after the cleanup, row z1: every process of the run
# (PID...) gone and none left alive by the cleanup (LEFT_ALIVE).
row_all_gone() {
    local p gone=yes
    for p in "$@"; do
        if alive "$p"; then gone="no: $p alive"; fi
    done
    row z1 "cleanup: every process of this run ended safely" "all gone" "$gone${LEFT_ALIVE:+; not stopped:$LEFT_ALIVE}" \
        "$([ "$gone" = yes ] && [ -z "$LEFT_ALIVE" ] && echo PASS || echo FAIL)"
}

# rows_end RC: from a script's EXIT trap (RC: its exit status): a FAIL row if
# the script did not get to FINISHED=1, then the cleanup and its row.
rows_end() {
    if [ "${FINISHED:-0}" != 1 ]; then
        row z0 "run completes" "all steps ran" "interrupted (exit $1) at +${SECONDS}s" FAIL
    fi
    cleanup_all
    row z1 "cleanup: every worker ended safely" "none left" "${LEFT_ALIVE:-none left}" \
        "$([ -z "$LEFT_ALIVE" ] && echo PASS || echo FAIL)"
}

# rows_exit: exit 0 when no row failed or was skipped, else 1.
rows_exit() {
    [ "$NFAIL" = 0 ] && [ "$NSKIP" = 0 ] && exit 0
    exit 1
}
