#!/usr/bin/env bash
# GPU end-to-end checks of the guard (`gpusnap run`, docs/design/safety.md) against
# the real driver, on one GPU.
#
# Run from the repository root, on a machine with a GPU, as root:
#   OUT=/some/dir tests/gpu/guard-e2e.sh
# Environment:
#   GPUSNAP            the binary (default ./target/release/gpusnap)
#   OUT                results directory (default: a new /tmp/gpusnap-out.* dir)
#   GUARD_BUDGET_S     soft budget in seconds (default 200): a section that
#                      would not fit is skipped (and counts as a failure); a
#                      watchdog ends the run, through the cleanup, 40 s after it
#   GUARD_GIB          GiB each worker holds (default 2)
#   GUARD_MODES        death modes (default "segv abort os_exit:5 sys_exit:6";
#                      see tests/gpu/dying_worker.py for the syntax)
#   GUARD_SIGTERM      1 (default): also the "sigterm" mode: SIGTERM (as from
#                      Kubernetes) to a worker whose main thread is busy in
#                      CUDA calls (--interval 0); never restored; 0: not
#   GUARD_RUNTERM      1 (default): also the "runterm" mode: a restored worker
#                      is sent SIGTERM through its `gpusnap run` (the pid a
#                      kubelet or `docker stop` signals), not directly; 0: not
#   GUARD_LIGHT_PY     1 (default; light mode only): a Python program that
#                      uses subprocess (vfork), a broken pipe, and torch ops
#                      whose CUDA libraries load lazily (linalg: cusolver,
#                      matmul: cublasLt, conv: cuDNN), then exits (sys.exit)
#   GUARD_KEEPER       1 (default): the keeper row (kill -9 of the guard); 0: not
#   GUARD_RESTORE      1 (default): each death-mode worker is suspended and
#                      resumed first (a restored process, the case the guard
#                      exists for); 0: it dies never restored (a cautious
#                      first run)
#   GUARD_WORKER_ARGS  extra arguments for dying_worker.py (a dry run against
#                      gpusnap's fake driver uses "--backend driver")
#   GUARD_RUN_ARGS     extra arguments for `gpusnap run`: "--light" checks the
#                      light mode (the preload library next to $GPUSNAP; no
#                      keeper there, so set GUARD_KEEPER=0)
# Writes $OUT/guard-e2e.md (the table, also printed on stdout) and
# $OUT/guard-e2e.log (timestamped log, gpusnap outputs, worker logs).
# Exit 0 when every check passed, 1 when one failed or was skipped.
#
# For each death mode a worker runs under `gpusnap run` (guard + exit filter
# + keeper), is made a restored process (gpusnap suspend, then resume) and is
# then told to die (STATUS.die). The guard must suspend it (lock + checkpoint,
# journalled) before the death proceeds, and `run` must exit as the program
# did. The "sigterm" mode sends SIGTERM to a worker that is busy in CUDA
# calls: the guard then holds a thread stopped wherever the signal found it,
# possibly inside the driver, while it calls lock and checkpoint. That worker
# is never restored, so a guard that fails there kills nothing dangerous.
# The keeper row kills the `run` guard with SIGKILL: the worker runs on,
# the keeper re-attaches a new guard, and an exit is still caught. That worker
# is never restored: if the takeover failed, its exit_group would fail
# (ENOSYS, the filter with no tracer), glibc's _exit would fall back to the
# exit of the calling thread only, and the worker would live on headless (it
# is not told to die when no new tracer shows up; the cleanup stops it).
# Every worker still alive at the end is ended through `gpusnap stop`, which
# suspends it before the kill (under the guard the SIGTERM then finds it
# already suspended); see lib.sh stop_safely for the fallback. Guards are
# only ended once every worker is gone: a guard is what keeps a worker that
# could not be stopped safe.

NAME=guard-e2e # read by lib.sh
# shellcheck source=tests/gpu/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

GUARD_BUDGET_S=${GUARD_BUDGET_S:-200}
GIB=${GUARD_GIB:-2}
GUARD_MODES=${GUARD_MODES:-segv abort os_exit:5 sys_exit:6}
GUARD_SIGTERM=${GUARD_SIGTERM:-1}
GUARD_KEEPER=${GUARD_KEEPER:-1}
GUARD_RUNTERM=${GUARD_RUNTERM:-1}
GUARD_LIGHT_PY=${GUARD_LIGHT_PY:-1}
GUARD_RESTORE=${GUARD_RESTORE:-1}
read -r -a WARGS <<<"${GUARD_WORKER_ARGS:-}"
read -r -a RARGS <<<"${GUARD_RUN_ARGS:-}"
THREADS=2
START_TIMEOUT_S=150   # torch import + CUDA init of all workers, started together
EXIT_TIMEOUT_S=60     # STATUS.die -> `gpusnap run` has exited

ROWS=$WORK/rows.tsv
: >"$ROWS"
NPASS=0 NFAIL=0 NSKIP=0 NINFO=0
FINISHED=0
RUNS=()               # `gpusnap run` pids (children of this shell)
declare -A RUNP=()    # key -> pid of its `gpusnap run`
declare -A WPID=()    # key -> pid of its worker (the guarded CUDA process)
declare -A WMODE=()   # key -> death mode
KEYS=()               # in start order
READY_FAILED=""       # keys whose worker did not get ready

# ---------------------------------------------------------------- table

# cell and row (the results table) are in lib.sh.

# need SECONDS ID CHECK: true if that much of the soft budget is left;
# otherwise records a SKIP row.
need() { budget_need "$GUARD_BUDGET_S" "$@"; }

# shellcheck disable=SC2317 # runs from the EXIT trap
write_table() {
    local md=$OUT/guard-e2e.md id c e g r f torch
    torch=$(torch_seen)
    {
        echo "# gpusnap guard: GPU end-to-end"
        echo
        echo "- date: $HDR_DATE"
        echo "- host: $HDR_HOST (kernel $HDR_KERNEL, host memory $HDR_HOSTMEM)"
        echo "- GPU: $HDR_GPU, $HDR_GPU_MEM; driver $HDR_DRIVER"
        echo "- gpusnap: $HDR_VERSION ($GPUSNAP); \`gpusnap run${GUARD_RUN_ARGS:+ $GUARD_RUN_ARGS}\`"
        echo "- torch: ${torch:-?}${GUARD_WORKER_ARGS:+; worker args: $GUARD_WORKER_ARGS}"
        echo "- workers: $GIB GiB each, $THREADS extra threads; modes: $GUARD_MODES$([ "$GUARD_SIGTERM" = 1 ] && echo " sigterm (busy, never restored)"); restored before the death: $([ "$GUARD_RESTORE" = 1 ] && echo yes || echo no); keeper row: $([ "$GUARD_KEEPER" = 1 ] && echo yes || echo no)"
        echo "- death-to-suspended: from writing STATUS.die to the guard's checkpoint ok event (the worker polls the file every 5 ms)"
        echo "- result: $NPASS passed, $NFAIL failed, $NSKIP skipped, $NINFO info; wall ${SECONDS} s (budget $GUARD_BUDGET_S s)"
        echo
        rows_md "#" check expected got result figure
    } >"$md"
    cat "$md"
}

# ---------------------------------------------------------------- cleanup

# guard_cleanup: like lib.sh cleanup_all, but the guards (and their keepers)
# are left alone while a worker could not be stopped safely: ending a guard
# would leave that worker without one.
# shellcheck disable=SC2317 # runs from the EXIT trap
guard_cleanup() {
    local p
    [ "$CLEANED" = 1 ] && return 0
    CLEANED=1
    trap 'log "signal ignored: cleanup is running"' INT TERM HUP
    : >"$WORK/.done"
    log "cleanup"
    for p in ${HELPERS[@]+"${HELPERS[@]}"}; do
        if alive "$p"; then kill -KILL "$p" 2>/dev/null; fi
    done
    for p in ${WORKERS[@]+"${WORKERS[@]}"}; do
        stop_safely "$p" cleanup || true
    done
    # A `run` ends with its program.
    for p in ${RUNS[@]+"${RUNS[@]}"}; do
        wait_gone "$p" 15 || log "gpusnap run $p still alive 15 s after its worker"
    done
    if [ -n "$LEFT_ALIVE" ]; then
        log "LEFT ALIVE (could not be stopped safely):$LEFT_ALIVE; their guards are left running: $(run_helpers)"
    else
        end_run_helpers
    fi
    return 0
}

# shellcheck disable=SC2317 # the EXIT trap
on_exit() {
    local rc=$? p m
    trap - ERR
    row_interrupted "$rc"
    guard_cleanup
    row_all_gone ${WORKERS[@]+"${WORKERS[@]}"} ${HELPERS[@]+"${HELPERS[@]}"}
    m=""
    for p in ${WORKERS[@]+"${WORKERS[@]}"}; do
        if [ -n "$(smi_pid_mib "$p")" ]; then m="$m $p"; fi
    done
    row z2 "nvidia-smi lists no process of this run" "none" "${m:-none}; apps now: $(smi_apps)" \
        "$([ -z "$m" ] && echo PASS || echo FAIL)"
    write_table
    for p in "$WORK"/*.log; do log_file "$(basename "$p")" "$p"; done
    log "scratch kept in $WORK"
    if [ "$NFAIL" -gt 0 ] || [ "$NSKIP" -gt 0 ]; then exit 1; fi
    exit 0
}

# ---------------------------------------------------------------- helpers

now_ms() { calc %.0f 't * 1000' t="$(now)"; }

# key_of MODE: a file-name-safe key ("os_exit:5" -> "os_exit_5").
key_of() { printf '%s' "${1//[^A-Za-z0-9_]/_}"; }

# natural_status MODE: what bash reports for the program dying that way.
natural_status() {
    local m=${1%%@*}
    case $m in
        segv) echo 139 ;;
        abort) echo 134 ;;
        sigterm | runterm) echo 143 ;;
        os_exit:* | sys_exit:*) echo "${m#*:}" ;;
        *) echo "?" ;;
    esac
}

# why_of MODE: the guard's word for that death ("signal SIGSEGV", "exit_group").
why_of() {
    case ${1%%@*} in
        segv) echo "signal SIGSEGV" ;;
        abort) echo "signal SIGABRT" ;;
        sigterm | runterm) echo "signal SIGTERM" ;;
        *) echo "exit_group" ;;
    esac
}

# tracer_of PID: TracerPid from /proc/PID/status (no fork: polled fast).
tracer_of() {
    local k v
    while read -r k v; do
        if [ "$k" = TracerPid: ]; then
            printf '%s\n' "$v"
            return 0
        fi
    done <"/proc/$1/status" 2>/dev/null
    return 1
}

# children_of PID: pids whose parent is PID (no fork per process: read builtin).
children_of() {
    local d s f
    for d in /proc/[0-9]*; do
        s=""
        { read -r s <"$d/stat"; } 2>/dev/null || continue
        s=${s##*) }
        read -r -a f <<<"$s"
        [ "${f[1]:-}" = "$1" ] && printf '%s\n' "${d#/proc/}"
    done
    return 0
}

# start_guarded KEY NAME [WORKER ARGS...]: `gpusnap run --name NAME --
# dying_worker.py` in the background (with the keeper); sets RUNP[KEY], and
# WPID[KEY] as soon as the worker is found (it goes to WORKERS for the cleanup).
start_guarded() {
    local key=$1 name=$2 st=$WORK/$1.status
    shift 2
    rm -f "$st" "$st".*
    # No core files: an aborted or segfaulting 2 GiB worker would write one.
    (
        ulimit -c 0
        NO_COLOR=1 exec "$GPUSNAP" -v --json --state-dir "$STATE_DIR" run --name "$name" ${RARGS[@]+"${RARGS[@]}"} -- \
            python3 "$GPU_DIR/dying_worker.py" "$GIB" "$st" --threads "$THREADS" ${WARGS[@]+"${WARGS[@]}"} "$@"
    ) </dev/null >"$WORK/$key.log" 2>&1 &
    RUNP[$key]=$!
    RUNS+=("$!")
    sleep 0.3
    WPID[$key]=""
    KEYS+=("$key")
    log "guarded worker $key: gpusnap run pid ${RUNP[$key]}, $GIB GiB, name $name"
}

# find_worker KEY: the worker pid (the child of its `gpusnap run` that runs
# dying_worker.py: not the keeper's short-lived first fork), once.
find_worker() {
    local key=$1 c="" k
    [ -n "${WPID[$key]}" ] && return 0
    for k in $(children_of "${RUNP[$key]}"); do
        case $(tr '\0' ' ' <"/proc/$k/cmdline" 2>/dev/null) in *dying_worker.py*) c=$k; break ;; esac
    done
    [ -n "$c" ] || return 1
    WPID[$key]=$c
    WORKERS+=("$c")
    log "worker $key: pid $c (child of gpusnap run ${RUNP[$key]})"
}

# wait_guarded_ready KEY DEADLINE_SECONDS: until 2 passes with ok=1.
wait_guarded_ready() {
    local key=$1 end=$2 st=$WORK/$1.status
    while [ "$SECONDS" -lt "$end" ]; do
        find_worker "$key" || true
        if ! alive "${RUNP[$key]}"; then
            log "gpusnap run of $key (pid ${RUNP[$key]}) ended while starting"
            return 1
        fi
        if read_status "$st" && [ "$ST_ITER" -ge 2 ]; then
            find_worker "$key" || true
            if [ "$ST_PID" != "${WPID[$key]}" ]; then
                log "WARNING: worker $key writes pid $ST_PID; the child of gpusnap run is ${WPID[$key]:-?}"
                if [ -z "${WPID[$key]}" ]; then WPID[$key]=$ST_PID; WORKERS+=("$ST_PID"); fi
            fi
            log "worker $key ready: $(cat "$st")"
            [ "$ST_OK" = 1 ] && return 0
            log "worker $key reports a bad checksum"
            return 1
        fi
        sleep 0.5
    done
    log "worker $key not ready after $START_TIMEOUT_S s"
    return 1
}

# deathwatch PID FILE TIMEOUT_S: a helper that writes to FILE the unix time
# (s) at which PID is gone (pidfd: the exit itself, not a poll), or "timeout".
# Waits until the helper watches.
DW_PY=$WORK/deathwatch.py
cat >"$DW_PY" <<'PY'
import os, select, sys, time
pid, out, limit = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
try:
    fd = os.pidfd_open(pid)
except (AttributeError, OSError):
    fd = None
open(out + ".ready", "w").close()
t = None
if fd is not None:
    p = select.poll()
    p.register(fd, select.POLLIN)
    if p.poll(limit * 1000):
        t = time.time()
else:
    end = time.time() + limit
    while time.time() < end:
        try:
            s = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            s = "gone"
        if s in ("Z", "X", "gone"):
            t = time.time()
            break
        time.sleep(0.002)
with open(out, "w") as f:
    f.write("timeout\n" if t is None else f"{t:.6f} {'pidfd' if fd is not None else 'poll'}\n")
PY

deathwatch() {
    local end=$((SECONDS + 10))
    rm -f "$2" "$2.ready"
    python3 "$DW_PY" "$1" "$2" "$3" </dev/null >>"$WORK/deathwatch.log" 2>&1 &
    HELPERS+=("$!")
    while [ ! -e "$2.ready" ] && [ "$SECONDS" -lt "$end" ]; do sleep 0.05; done
    [ -e "$2.ready" ]
}

# die_now KEY MODE: writes STATUS.die atomically (mode sigterm: SIGTERM to
# the worker instead); sets T_DIE_MS.
die_now() {
    local st=$WORK/$1.status
    if [ "$2" = sigterm ]; then
        T_DIE_MS=$(now_ms)
        kill -TERM "${WPID[$1]}"
        return 0
    fi
    # runterm: to the `gpusnap run` pid, which forwards it to the program.
    if [ "$2" = runterm ]; then
        T_DIE_MS=$(now_ms)
        kill -TERM "${RUNP[$1]}"
        return 0
    fi
    printf '%s\n' "$2" >"$st.die.tmp"
    T_DIE_MS=$(now_ms)
    mv -f "$st.die.tmp" "$st.die"
}

# wait_run KEY TIMEOUT_S: until its `gpusnap run` has exited; sets RUN_RC
# (its exit status, "timeout" if it did not end) and RUN_S.
wait_run() {
    local p=${RUNP[$1]} t0=$SECONDS
    RUN_RC=timeout
    if wait_gone "$p" "$2"; then
        RUN_RC=0
        wait "$p" 2>/dev/null || RUN_RC=$?
    fi
    RUN_S=$((SECONDS - t0))
}

# history_facts PID DIE_MS DEATH_S WHY: reads `gpusnap --json history PID`
# and sets H_* from the guard's events after its last "dying:" note.
history_facts() {
    local k v
    gs 30 history "$1"
    H_DYING="" H_LOCK="" H_CK="" H_CK_MS="" H_NOTE="" H_NOTE_MS="" H_DYING_MS="" H_GUARDS="" H_ALL=""
    while IFS='=' read -r k v; do
        case $k in
            dying) H_DYING=$v ;;
            dying_ms) H_DYING_MS=$v ;;
            lock) H_LOCK=$v ;;
            ck) H_CK=$v ;;
            ck_ms) H_CK_MS=$v ;;
            note) H_NOTE=$v ;;
            note_ms) H_NOTE_MS=$v ;;
            guards) H_GUARDS=$v ;;
            all) H_ALL=$v ;;
        esac
    done < <(python3 - "$GS_OUT" <<'PY' 2>>"$LOG"
import json, sys
try:
    ev = json.load(open(sys.argv[1]))["events"]
except Exception as e:
    print(f"all=unreadable history: {e}")
    sys.exit(0)
def short(e):
    s = f"{e['op']} {e['phase']}"
    if e.get("state"):
        s += f" {e['state']}"
    if e.get("detail"):
        s += f" ({e['detail'][:90]})"
    return s
print("all=" + "; ".join(short(e) for e in ev[-12:]).replace("\n", " "))
print("guards=" + ",".join(e["detail"].split()[-1] for e in ev
                           if e["op"] == "guard" and (e.get("detail") or "").startswith("guarded by gpusnap ")))
di = max((i for i, e in enumerate(ev) if e["op"] == "guard" and (e.get("detail") or "").startswith("dying: ")),
         default=None)
if di is None:
    sys.exit(0)
print(f"dying={ev[di]['detail'][len('dying: '):]}")
print(f"dying_ms={ev[di]['ts_ms']}")
after = ev[di + 1:]
lock = [e for e in after if e["op"] == "lock" and e["phase"] != "begin"]
print("lock=" + (lock[0]["phase"] + (f" ({lock[0]['detail']})" if lock[0].get("detail") else "") if lock else "none"))
ck = [e for e in after if e["op"] == "checkpoint" and e["phase"] != "begin"]
if ck:
    print("ck=" + ck[0]["phase"] + (f" ({ck[0]['detail']})" if ck[0].get("detail") else ""))
    print(f"ck_ms={ck[0]['ts_ms']}")
else:
    print("ck=none")
note = [e for e in after if e["op"] == "guard" and "before death" in (e.get("detail") or "")]
if note:
    print("note=" + note[0]["detail"].replace("\n", " "))
    print(f"note_ms={note[0]['ts_ms']}")
PY
)
}

# guard_says KEY PID: the guard's own log lines about PID's death (run -v).
guard_says() {
    grep -h "guard pid=$2 " "$WORK/$1.log" 2>/dev/null | sed 's/^.*guard pid=/pid=/' | tail -n 3 | cut -c1-300 | tr '\n' ' '
}

# ---------------------------------------------------------------- sections

preflight() {
    local h ps
    if [ "$HDR_VERSION_RC" = 0 ]; then
        row p1 "gpusnap --version" "exit 0" "$HDR_VERSION" PASS
    else
        row p1 "gpusnap --version" "exit 0" "exit $HDR_VERSION_RC: $HDR_VERSION" FAIL
        return 1
    fi
    h=$(timeout 30 "$GPUSNAP" run --help 2>&1 </dev/null | head -n 1 | cut -c1-120)
    if [ -n "$h" ] && timeout 30 "$GPUSNAP" run --help >/dev/null 2>&1 </dev/null; then
        row p2 "gpusnap run exists" "run --help: exit 0" "$h" PASS
    else
        row p2 "gpusnap run exists" "run --help: exit 0" "${h:-no output}" FAIL
        return 1
    fi
    ps=$(cat /proc/sys/kernel/yama/ptrace_scope 2>/dev/null || echo "no yama")
    row p3 "GPU idle; ptrace allowed; core dumps" "(information)" \
        "compute apps: $(smi_apps); free $(smi_free_mib) MiB; yama ptrace_scope: $ps; uid $(id -u); core_pattern '$(cat /proc/sys/kernel/core_pattern 2>/dev/null)' (workers run with ulimit -c 0)" INFO
    return 0
}

start_all() {
    local mode key t0=$SECONDS end got="" n=0 ok=0
    # The state store exists before the guards open it together (one of
    # several `gpusnap run` started at once on a fresh state dir was seen to
    # fail with "database is locked"), and the starts are staggered.
    gs 30 history 1
    for mode in $GUARD_MODES; do
        key=$(key_of "$mode")
        WMODE[$key]=$mode
        start_guarded "$key" "g-$key"
    done
    if [ "$GUARD_SIGTERM" = 1 ]; then
        WMODE[sigterm]=sigterm
        start_guarded sigterm g-sigterm --interval 0
    fi
    if [ "$GUARD_RUNTERM" = 1 ]; then
        WMODE[runterm]=runterm
        start_guarded runterm g-runterm
    fi
    if [ "$GUARD_KEEPER" = 1 ]; then
        start_guarded keeper g-keeper
        WMODE[keeper]=os_exit:7
    fi
    end=$((SECONDS + START_TIMEOUT_S))
    for key in "${KEYS[@]}"; do
        n=$((n + 1))
        if wait_guarded_ready "$key" "$end"; then
            ok=$((ok + 1))
            got="$got, $key pid ${WPID[$key]} ($(smi_pid_mib "${WPID[$key]}") MiB)"
        else
            got="$got, $key FAILED"
            log_file "$key log" "$WORK/$key.log"
            WPID[$key]=${WPID[$key]:-}
            READY_FAILED="$READY_FAILED $key"
        fi
    done
    row w1 "guarded workers start under gpusnap run ($n)" "all ready, checksum ok" "$ok ready${got}" \
        "$([ "$ok" = "$n" ] && echo PASS || echo FAIL)" "$((SECONDS - t0)) s"
}

is_ready() { case " $READY_FAILED " in *" $1 "*) return 1 ;; esac; [ -n "${WPID[$1]:-}" ]; }

# section_mode KEY: restore the worker, make it die, check what the guard did.
section_mode() {
    local key=$1 mode=${WMODE[$1]} pid=${WPID[$1]:-} run=${RUNP[$1]} st=$WORK/$1.status
    local s1 s2 r1 r2 i0 got v smi0 want tracer why death death_s death_ms gone smi fig d2s lc ok2 mib
    if ! is_ready "$key"; then
        row "$key" "death by $mode" "worker ready" "worker did not start" SKIP
        return 0
    fi
    # sigterm: a guard stuck behind the stopped thread gives up after its
    # get-state deadline (30 s), then the death proceeds.
    need "$([ "$mode" = sigterm ] && echo 75 || echo 45)" "$key" "death by $mode" || return 0
    want=$(natural_status "$mode") why=$(why_of "$mode")

    # 1. a restored process, still guarded, data intact
    if [ "$mode" = sigterm ]; then
        read_status "$st"
        i0=${ST_ITER:-0}
        sleep 1
        read_status "$st"
        row "$key.1" "[$mode] busy worker, never restored" "(information)" \
            "$((ST_ITER - i0)) passes in 1 s, ok=${ST_OK:-?}; SIGTERM comes while its main thread is in a CUDA call" INFO
    elif [ "$GUARD_RESTORE" != 1 ]; then
        row "$key.1" "[$mode] suspend + resume under the guard" "(GUARD_RESTORE=0)" "not done: the worker dies never restored" INFO
    else
        gs 120 suspend "$pid"
        s1=$(jget "$GS_OUT" 'd["results"][0]["state"]') r1=$GS_RC
        mark_restored "$pid"
        gs 120 resume "$pid"
        s2=$(jget "$GS_OUT" 'd["results"][0]["state"]') r2=$GS_RC
        read_status "$st"
        i0=${ST_ITER:-0}
        if wait_iter_gt "$key" $((i0 + 2)) 20; then got="iteration $i0 -> $ST_ITER, ok=$ST_OK"; else got="no progress in 20 s (iteration ${ST_ITER:-?}, ok=${ST_OK:-?})"; fi
        v=FAIL
        [[ $r1 == 0 && $s1 == checkpointed && $r2 == 0 && $s2 == running && $ST_ITER -gt $((i0 + 2)) && $ST_OK == 1 ]] && v=PASS
        row "$key.1" "[$mode] suspend + resume under the guard (pid $pid is now a restored process)" \
            "suspend exit 0 checkpointed; resume exit 0 running; work goes on, ok=1" \
            "suspend exit $r1 ${s1:-?}; resume exit $r2 ${s2:-?}; $got" "$v"
    fi

    # Without its guard the death would kill a live (restored) process:
    # traced by its `run`, or (light mode) carrying the preload library
    # with its `run` alive to answer on the socket.
    if [[ " ${RARGS[*]-} " == *" --light "* ]]; then
        if ! alive "$run" || ! grep -q 'libgpusnap_preload' "/proc/$pid/maps" 2>/dev/null; then
            row "$key.2" "[$mode] the death" "worker carries libgpusnap_preload.so and its gpusnap run ($run) lives" \
                "run alive: $(alive "$run" && echo yes || echo no); preload mapped: $(grep -qs libgpusnap_preload "/proc/$pid/maps" && echo yes || echo no): not told to die; the cleanup stops it" FAIL
            return 0
        fi
    else
        tracer=$(tracer_of "$pid")
        if [ "$tracer" != "$run" ]; then
            row "$key.2" "[$mode] the death" "worker traced by its gpusnap run ($run)" \
                "tracer ${tracer:-none} ($(pstate "$pid" || echo gone)): not told to die; the cleanup stops it" FAIL
            return 0
        fi
    fi

    # 2. the death
    smi0=$(smi_pid_mib "$pid")
    deathwatch "$pid" "$WORK/$key.death" $((EXIT_TIMEOUT_S + 5)) || log "deathwatch for $pid did not start"
    log "[$key] nvidia-smi before the death: ${smi0:-not listed} MiB; death: $mode"
    die_now "$key" "$mode"
    wait_run "$key" "$EXIT_TIMEOUT_S"
    v=FAIL; [[ $RUN_RC == "$want" ]] && v=PASS
    row "$key.2" "[$mode] gpusnap run exits as the program did" "exit $want within ${EXIT_TIMEOUT_S} s" \
        "exit $RUN_RC after ~${RUN_S} s" "$v"

    # 3. gone, and off the GPU
    if wait_gone "$pid" 10; then gone=gone; else gone="still alive ($(pstate "$pid"))"; fi
    if wait_smi_unlisted "$pid" 10; then smi="not listed"; else smi="listed with $(smi_pid_mib "$pid") MiB"; fi
    v=FAIL; [[ $gone == gone && $smi == "not listed" ]] && v=PASS
    row "$key.3" "[$mode] the worker is gone and off the GPU" "pid gone; nvidia-smi does not list it" \
        "pid $pid $gone; nvidia-smi: $smi" "$v"

    # 4. the journal: suspended before the death
    death=$(cat "$WORK/$key.death" 2>/dev/null)
    death_s=${death%% *}
    death_ms=""
    [[ $death_s =~ ^[0-9.]+$ ]] && death_ms=$(calc %.0f 's * 1000' s="$death_s")
    history_facts "$pid"
    d2s="" lc=""
    [ -n "$H_CK_MS" ] && d2s=$((H_CK_MS - T_DIE_MS))
    [ -n "$H_CK_MS" ] && [ -n "$H_DYING_MS" ] && lc=$((H_CK_MS - H_DYING_MS))
    ok2=no
    if [ -n "$H_NOTE_MS" ] && [ -n "$death_ms" ] && [ "$H_NOTE_MS" -le "$death_ms" ] && [ "$H_NOTE_MS" -ge "$T_DIE_MS" ]; then ok2=yes; fi
    v=FAIL
    # A signal from another process reads "signal SIGTERM from pid N".
    [[ $H_DYING == "$why"* && $H_LOCK == ok && $H_CK == ok && $H_NOTE == *"before death ($why"* && $ok2 == yes ]] && v=PASS
    got="dying: ${H_DYING:-none}; lock ${H_LOCK:-?}; checkpoint ${H_CK:-?}; note '${H_NOTE:-none}'"
    if [ -n "$H_NOTE_MS" ] && [ -n "$death_ms" ]; then
        got="$got at $(calc %+.0f 'n - d' n="$H_NOTE_MS" d="$death_ms") ms vs the death"
    fi
    got="$got (death seen: ${death:-no})"
    if [ "$v" = FAIL ]; then
        # A failed suspension is only in the guard's log, not in the journal.
        got="$got; last events: $H_ALL; guard log: $(guard_says "$key" "$pid")"
    fi
    fig="death-to-suspended ${d2s:-?} ms ($(case $mode in sigterm) echo SIGTERM ;; runterm) echo "SIGTERM to gpusnap run" ;; *) echo STATUS.die ;; esac) -> checkpoint ok); lock+checkpoint ${lc:-?} ms"
    if [ -n "$death_ms" ] && [ -n "$H_CK_MS" ]; then fig="$fig; died $((death_ms - H_CK_MS)) ms after it"; fi
    if [ -s "$st.dying" ]; then fig="$fig; worker acted $(awk -v d="$T_DIE_MS" '{ printf "%.0f", $4 * 1000 - d }' "$st.dying") ms after STATUS.die"; fi
    row "$key.4" "[$mode] history: suspended before the death" \
        "'dying: $why', then lock ok, checkpoint ok, note '... before death ($why)' timed before the death" \
        "$got" "$v" "$fig"

    # 5. the guard's own NVML check
    mib=$(printf '%s' "$H_NOTE" | sed -n 's/^suspended \([0-9]*\) MiB.*/\1/p')
    v=FAIL
    if [[ -n $H_NOTE && $H_NOTE != *"NVML still shows memory"* && -n $mib && $mib -gt 0 ]] &&
        close_mib "$mib" "${smi0:-0}"; then v=PASS; fi
    row "$key.5" "[$mode] the guard saw the memory released (NVML)" \
        "note without 'NVML still shows memory'; suspended MiB = nvidia-smi before the death (5%)" \
        "suspended ${mib:-?} MiB, nvidia-smi ${smi0:-not listed} MiB before; note '${H_NOTE:-none}'" "$v"
    return 0
}

# close_mib A B: within 5% (at least 256 MiB) of each other.
close_mib() {
    awk -v a="$1" -v b="$2" 'BEGIN { d = a - b; if (d < 0) d = -d; lim = b * 0.05; if (lim < 256) lim = 256; exit !(d <= lim) }'
}

# keeper_helpers: gpusnap processes of the keeper row still alive, "pid cmdline;"
# (the takeover guards and their keepers carry --takeover; the first keeper,
# a fork of that `gpusnap run`, carries its name g-keeper).
keeper_helpers() {
    local p c out=""
    for p in $(run_helpers | tr ';' ' '); do
        c=$(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null) || continue
        case $c in *--takeover* | *g-keeper*) out="$out$p ${c:0:100};" ;; esac
    done
    printf '%s' "$out"
}

# section_keeper: kill -9 the `run` guard; the keeper re-attaches a new guard.
section_keeper() {
    local key=keeper pid=${WPID[keeper]:-} run=${RUNP[keeper]:-} st=$WORK/keeper.status
    local t0 tracer="" ms="" i0 got v end rc h0 h1 news smi d2s
    [ "$GUARD_KEEPER" = 1 ] || return 0
    if ! is_ready keeper; then row k "keeper takeover" "worker ready" "worker did not start" SKIP; return 0; fi
    need 40 k "keeper takeover" || return 0
    h0=$(tracer_of "$pid")
    read_status "$st"
    i0=${ST_ITER:-0}
    log "[keeper] worker $pid traced by $h0; SIGKILL to gpusnap run $run"
    t0=$(now)
    kill -KILL "$run"
    end=$((SECONDS + 10))
    while [ "$SECONDS" -lt "$end" ]; do
        tracer=$(tracer_of "$pid") || break
        if [ -n "$tracer" ] && [ "$tracer" != 0 ] && [ "$tracer" != "$run" ]; then
            ms=$(calc %.0f '(b - a) * 1000' a="$t0" b="$(now)")
            break
        fi
        tracer=""
        sleep 0.01
    done
    wait_run keeper 10
    h1=$(tr '\0' ' ' <"/proc/${tracer:-0}/cmdline" 2>/dev/null | cut -c1-160)
    v=FAIL; [[ $RUN_RC == 137 && -n $tracer ]] && v=PASS
    row k.1 "kill -9 of the gpusnap run guard ($run); the keeper re-attaches" \
        "run exit 137; a new tracer of pid $pid within 10 s" \
        "run exit $RUN_RC; tracer before $h0, after ${tracer:-none} (${h1:-?})" "$v" "re-attached ${ms:-?} ms after the SIGKILL"

    if wait_iter_gt keeper $((i0 + 2)) 10; then got="iteration $i0 -> $ST_ITER, ok=$ST_OK"; else got="no progress in 10 s (iteration ${ST_ITER:-?}, ok=${ST_OK:-?})"; fi
    v=FAIL; alive "$pid" && [[ $ST_ITER -gt $((i0 + 2)) && $ST_OK == 1 ]] && v=PASS
    row k.2 "the worker runs on without its first guard" "alive, iteration advances, ok=1" "$got" "$v"
    if [ -z "$tracer" ] || [ "$(tracer_of "$pid")" != "$tracer" ]; then
        row k.3 "os_exit:7 under the new guard" "a new guard traces the worker" \
            "tracer now $(tracer_of "$pid" || echo none): not told to die; the cleanup stops it" FAIL
        return 0
    fi

    smi=$(smi_pid_mib "$pid")
    deathwatch "$pid" "$WORK/keeper.death" 65 || log "deathwatch for $pid did not start"
    die_now keeper os_exit:7
    t0=$SECONDS
    if wait_gone "$pid" 60; then got="gone after ~$((SECONDS - t0)) s"; rc=ok; else got="still alive after 60 s ($(pstate "$pid"))"; rc=""; fi
    if [ -n "$rc" ] && wait_smi_unlisted "$pid" 10; then got="$got; nvidia-smi: not listed"; else got="$got; nvidia-smi: $(smi_pid_mib "$pid") MiB"; fi
    v=FAIL; [[ $got == "gone after"*"not listed" ]] && v=PASS
    row k.3 "os_exit:7 under the new guard" "pid gone within 60 s, off the GPU" "$got" "$v"

    history_facts "$pid"
    news=${H_GUARDS##*,}
    d2s=""
    [ -n "$H_CK_MS" ] && d2s=$((H_CK_MS - T_DIE_MS))
    v=FAIL
    [[ -n $news && $news != "$run" && $H_DYING == exit_group && $H_LOCK == ok && $H_CK == ok && $H_NOTE == *"before death (exit_group)"* ]] && v=PASS
    got="guards $H_GUARDS; dying: ${H_DYING:-none}; lock ${H_LOCK:-?}; checkpoint ${H_CK:-?}; note '${H_NOTE:-none}'"
    if [ "$v" = FAIL ]; then got="$got; last events: $H_ALL; guard log: $(guard_says keeper "$pid")"; fi
    row k.4 "history: the new guard suspended it before the exit" \
        "'guarded by gpusnap <new guard>' ($run was the first), 'dying: exit_group', lock ok, checkpoint ok, '... before death (exit_group)'" \
        "$got" "$v" "death-to-suspended ${d2s:-?} ms; nvidia-smi ${smi:-?} MiB before"

    # The new guard ends with its last tracee; its keeper then finds nothing to do.
    end=$((SECONDS + 10))
    while [ -n "$(keeper_helpers)" ] && [ "$SECONDS" -lt "$end" ]; do sleep 0.5; done
    got=$(keeper_helpers)
    v=FAIL; [ -z "$got" ] && v=PASS
    row k.5 "no guard or keeper of this run left" "none within 10 s" "${got:-none}" "$v"
    return 0
}

# ---------------------------------------------------------------- light: python

# A Python program under `run --light`: subprocess.run (CPython forks it with
# vfork and resets SIGPIPE in the child), a broken pipe (must stay a
# BrokenPipeError: SIGPIPE ignored), CUDA libraries loaded lazily by torch
# (cusolver, cublasLt, cuDNN, dlopened from torch's own libraries, whose
# RUNPATH must keep working), work after all that, then sys.exit(5).
LP_PY=$WORK/light_program.py
cat >"$LP_PY" <<'PY'
import os, subprocess, sys, time
status, backend = sys.argv[1], sys.argv[2]
def lazy_libs():
    names = ("libcusolver", "libcublasLt", "libcudnn")
    found = set()
    for line in open("/proc/self/maps"):
        base = os.path.basename(line.split()[-1]) if "/" in line else ""
        for n in names:
            if base.startswith(n):
                found.add(base.split(".so")[0])
    return ",".join(sorted(found)) or "none"
before = lazy_libs()
if backend == "torch":
    import torch
    x = torch.randn(1024, 1024, device="cuda")
    def work():
        a = x @ x.T + 1024 * torch.eye(1024, device="cuda")   # cublas(Lt)
        inv = torch.linalg.inv(a)                              # cusolver
        conv = torch.nn.functional.conv2d(torch.randn(4, 3, 64, 64, device="cuda"),
                                          torch.randn(8, 3, 3, 3, device="cuda"))  # cuDNN
        torch.cuda.synchronize()
        return float((a @ inv).diagonal().mean()) , float(conv.abs().sum())
    ok1 = abs(work()[0] - 1.0) < 1e-2
else:
    import ctypes
    cu = ctypes.CDLL("libcuda.so.1")
    d, ctx, p = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
    assert cu.cuInit(0) == 0 and cu.cuDeviceGet(ctypes.byref(d), 0) == 0
    assert cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, d) == 0
    assert cu.cuMemAlloc_v2(ctypes.byref(p), 512 << 20) == 0
    buf = ctypes.create_string_buffer(b"x" * 4096, 4096)
    def work():
        return cu.cuMemcpyHtoD_v2(p, buf, 4096) == 0 and cu.cuMemcpyDtoH_v2(buf, p, 4096) == 0
    ok1 = work()
r = subprocess.run(["sh", "-c", "echo sub-ok"], capture_output=True, text=True)
rd, wr = os.pipe()
os.close(rd)
try:
    os.write(wr, b"x")
    pipe = "no-error"
except BrokenPipeError:
    pipe = "BrokenPipeError"
ok2 = bool(work()) if backend != "torch" else abs(work()[0] - 1.0) < 1e-2
line = f"{os.getpid()} {r.stdout.strip() or 'sub-failed'} {pipe} ops={'ok' if ok1 and ok2 else 'bad'} libs={before}->{lazy_libs()}\n"
with open(status + ".tmp", "w") as f:
    f.write(line)
os.replace(status + ".tmp", status)
while not os.path.exists(status + ".die"):
    time.sleep(0.05)
work()
sys.exit(5)
PY

section_light_python() {
    local st=$WORK/lp.status backend=torch pid="" sub="" pipe="" ops="" libs="" t0 v smi0
    [[ " ${RARGS[*]-} " == *" --light "* ]] || return 0
    [ "$GUARD_LIGHT_PY" = 1 ] || return 0
    need 60 lp "[light] python: subprocess + lazily loaded CUDA libraries" || return 0
    [[ " ${WARGS[*]-} " == *" driver "* ]] && backend=driver
    rm -f "$st" "$st".*
    (
        ulimit -c 0
        NO_COLOR=1 exec "$GPUSNAP" -v --json --state-dir "$STATE_DIR" run --name g-lp ${RARGS[@]+"${RARGS[@]}"} -- \
            python3 "$LP_PY" "$st" "$backend"
    ) </dev/null >"$WORK/lp.log" 2>&1 &
    RUNP[lp]=$!
    RUNS+=("$!")
    t0=$SECONDS
    while [ ! -s "$st" ] && [ $((SECONDS - t0)) -lt 150 ] && alive "${RUNP[lp]}"; do sleep 0.5; done
    if [ ! -s "$st" ]; then
        row lp.1 "[light] python: subprocess.run, a broken pipe, lazily loaded CUDA libraries ($backend)" \
            "it reports" "no report within 150 s (run alive: $(alive "${RUNP[lp]}" && echo yes || echo no))" FAIL
        log_file "lp log" "$WORK/lp.log"
        return 0
    fi
    read -r pid sub pipe ops libs <"$st"
    WORKERS+=("$pid")
    v=FAIL
    [[ $sub == sub-ok && $pipe == BrokenPipeError && $ops == ops=ok ]] && v=PASS
    row lp.1 "[light] python: subprocess.run, a broken pipe, lazily loaded CUDA libraries ($backend)" \
        "sub-ok; BrokenPipeError (SIGPIPE still ignored after the vfork child); CUDA ops ok before and after" \
        "$sub; $pipe; $ops; $libs (mapped: before torch -> after)" "$v"
    smi0=$(smi_pid_mib "$pid")
    deathwatch "$pid" "$WORK/lp.death" 65 || log "deathwatch for $pid did not start"
    T_DIE_MS=$(now_ms)
    : >"$st.die"
    wait_run lp 60
    v=FAIL
    [[ $RUN_RC == 5 ]] && v=PASS
    row lp.2 "[light] it works on, then sys.exit(5)" "gpusnap run exit 5 within 60 s" "exit $RUN_RC after ~${RUN_S} s" "$v"
    history_facts "$pid"
    v=FAIL
    [[ $H_DYING == "exit_group via exit" && $H_LOCK == ok && $H_CK == ok && $H_NOTE == *"before death (exit_group via exit)"* ]] && v=PASS
    row lp.3 "[light] history: suspended before its exit (after torch's own exit handlers)" \
        "'dying: exit_group via exit', lock ok, checkpoint ok, note '... before death (exit_group via exit)'" \
        "dying: ${H_DYING:-none}; lock ${H_LOCK:-?}; checkpoint ${H_CK:-?}; note '${H_NOTE:-none}'$([ "$v" = FAIL ] && echo "; last events: $H_ALL")" \
        "$v" "nvidia-smi ${smi0:-not listed} MiB before"
    return 0
}

# ---------------------------------------------------------------- main

install_traps
start_watchdog $((GUARD_BUDGET_S + 40))
log "gpusnap guard GPU e2e: budget ${GUARD_BUDGET_S}s"
collect_header
if preflight; then
    start_all
    for mode in $GUARD_MODES; do
        section_mode "$(key_of "$mode")"
    done
    if [ "$GUARD_SIGTERM" = 1 ]; then section_mode sigterm; fi
    if [ "$GUARD_RUNTERM" = 1 ]; then section_mode runterm; fi
    section_keeper
    section_light_python
fi
FINISHED=1
