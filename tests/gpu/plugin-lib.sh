# shellcheck shell=bash
# Helpers shared by tests/gpu/container-e2e.sh and tests/gpu/runc-e2e.sh: a
# CUDA worker checkpointed and restored by CRIU's CUDA plugin with gpusnap as
# its `cuda-checkpoint`. Finding criu and the plugin, the worker's readiness
# and progress, gpusnap's journal and state of a pid, the budget, the steps
# table, and the restore beside a filler once the process is back.
#
# Sourced after lib.sh. The caller sets:
#   STEPS            the steps file (flow, step, seconds, note a line)
#   FLOW_ST          where the status files lie, relative to $WORK ("" or "st/"):
#                    NAME.status and NAME.log
#   FLOW_BUDGET_S    the budget need_s counts against
#   FLOW_PROGRESS_S  how long progress waits for the status line to advance
#   FLOW_WORKER_WHAT the worker in progress's check ("the worker", ...)

# step FLOW STEP SECONDS [NOTE]: a row of the steps table.
step() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$(cell "${4:-}")" >>"$STEPS"; }

# find_plugins: CRIU_BIN (criu on PATH) and PLUGINS (CONT_PLUGINS, else the
# directory of cuda_plugin.so at PREFIX/lib/criu of that criu or of its link's
# target); either empty when not found.
find_plugins() {
    local d
    CRIU_BIN=$(command -v criu 2>/dev/null || true)
    PLUGINS=${CONT_PLUGINS:-}
    if [ -z "$PLUGINS" ] && [ -n "$CRIU_BIN" ]; then
        for d in "$(dirname "$(dirname "$CRIU_BIN")")/lib/criu" "$(dirname "$(dirname "$(readlink -f "$CRIU_BIN")")")/lib/criu"; do
            if [ -f "$d/cuda_plugin.so" ]; then PLUGINS=$d; break; fi
        done
    fi
}

# plugin_lines LOG: what the CUDA plugin said (one line).
plugin_lines() { grep -o 'cuda_plugin: .*' "$1" 2>/dev/null | cut -c1-90 | sort | uniq -c | sort -rn | head -n 4 | tr -s ' ' | tr '\n' ';'; }

# crit_err LOG: CRIU's first error lines (one line).
crit_err() { grep -E 'Error|rror \(' "$1" 2>/dev/null | grep -v RLIMIT_NOFILE | head -n 2 | cut -c1-240 | tr '\n' ' '; }

# ready NAME PID TIMEOUT: like wait_ready, 2 passes with ok=1, but the status
# pid is the one the worker sees (1 in its own pid namespace).
ready() {
    local end=$((SECONDS + $3))
    while [ "$SECONDS" -lt "$end" ]; do
        alive "$2" || { log_file "$1 log" "$WORK/$FLOW_ST$1.log"; return 1; }
        if read_status "$WORK/$FLOW_ST$1.status" && [ "$ST_ITER" -ge 2 ]; then [ "$ST_OK" = 1 ]; return; fi
        sleep 0.5
    done
    log_file "$1 log" "$WORK/$FLOW_ST$1.log"
    return 1
}

# progress ID NAME PID I0 T0: the status line advances past I0 with ok=1
# within FLOW_PROGRESS_S; the seconds since T0 (now) until it did are the
# row's figure.
progress() {
    local id=$1 name=$2 pid=$3 i0=$4 t0=$5 got v=FAIL s=""
    if ! alive "$pid"; then
        got="no process $pid"
    elif wait_iter_gt "$FLOW_ST$name" "$i0" "$FLOW_PROGRESS_S"; then
        s=$(fsub "$t0" "$(now)")
        got="iteration $i0 -> $ST_ITER, ok=$ST_OK"
        [ "$ST_OK" = 1 ] && v=PASS
    else
        got="no progress in $FLOW_PROGRESS_S s (iteration ${ST_ITER:-?}, ok=${ST_OK:-?})"
    fi
    row "$id" "$FLOW_WORKER_WHAT computes again, checksum intact" "iteration > $i0, ok=1" "$got" "$v" "${s:+$s s}"
    [ "$v" = PASS ]
}

# ops PID: the operations of gpusnap's journal for PID ("lock checkpoint ...").
ops() {
    gs 30 history "$1"
    jget "$GS_OUT" '" ".join(e["op"] for e in d["events"])'
}

# gs_state PID: S_STATE, S_FP.
gs_state() {
    gs 30 state "$1"
    S_STATE=$(jget "$GS_OUT" 'd["state"]')
    S_FP=$(jget "$GS_OUT" 'd.get("footprint_bytes")')
}
gs_result() { jget "$GS_OUT" "d[\"results\"][0][\"$1\"]"; }

# need_s SECONDS ID: a SKIP row, and false, when fewer than SECONDS of
# FLOW_BUDGET_S are left.
need_s() {
    if [ "$SECONDS" -ge $((FLOW_BUDGET_S - $1)) ]; then
        row "$2" "$2" "within the budget" "skipped: ${SECONDS}s of ${FLOW_BUDGET_S}s used" SKIP
        return 1
    fi
}

# steps_md FIRST: the steps table in Markdown, FIRST the first column's name.
steps_md() {
    local m s t n
    echo "## Steps (seconds)"
    echo
    echo "| $1 | step | seconds | note |"
    echo "|---|---|---|---|"
    while IFS=$'\t' read -r m s t n; do printf '| %s | %s | %s | %s |\n' "$m" "$s" "$t" "$n"; done <"$STEPS"
}

# fill_start WHAT MIB: a filler leaving a third of MIB (the worker's MiB
# before its checkpoint) free, row f.1; false when it failed.
fill_start() {
    local what=$1 mib=$2 leave
    leave=$(((${mib:-2048}) / 3))
    if ! start_filler "$leave" 120; then
        row f.1 "$what: a filler leaves $leave MiB (the worker held ${mib:-?} MiB)" "ready" "filler failed" FAIL
        return 1
    fi
    row f.1 "$what: a filler leaves $leave MiB (the worker held ${mib:-?} MiB)" "ready" "free $(smi_free_mib) MiB" PASS
}

# fill_refused WHAT WHEN LOG: row f.2, the plugin's restore at WHEN-time size
# refused by gpusnap, as LOG (CRIU's restore log) says.
fill_refused() {
    row f.2 "$1: the plugin's restore at $2-time size" "RESUME_DEVICES failed, gpusnap's refusal in the log" \
        "$(grep -oE 'RESUME_DEVICES[^"]*|not enough GPU memory[^"]{0,80}' "$3" | head -n 2 | tr '\n' ' ' | cut -c1-240)" \
        "$(grep -q 'not enough GPU memory' "$3" && echo PASS || echo FAIL)"
}

# fill_resume WHAT FLOW NAME PID I0: rows f.3-f.7 of a process restored beside
# the filler: checkpointed, resume refused (3) while the filler holds the GPU,
# resumed once it is gone and computing again; then stopped safely.
fill_resume() {
    local what=$1 flow=$2 name=$3 pid=$4 i0=$5 t0 o v
    gs_state "$pid"
    v=FAIL; [[ $S_STATE == checkpointed ]] && v=PASS
    row f.3 "$what: gpusnap state of pid $pid" "checkpointed (recoverable), no GPU memory" \
        "exit $GS_RC, ${S_STATE:-?}, footprint $(gb "$S_FP") GB; nvidia-smi $(smi_pid_mib "$pid") MiB${GS_MSG:+; $GS_MSG}" "$v"
    gs 60 resume "$pid"
    row f.4 "$what: gpusnap resume while the filler holds the GPU" "exit 3 (no room)" "exit $GS_RC${GS_MSG:+; $GS_MSG}" \
        "$([ "$GS_RC" = 3 ] && echo PASS || echo FAIL)"
    kill_fillers
    t0=$(now)
    gs 180 resume "$pid" --wait 60
    row f.5 "$what: gpusnap resume once the filler is gone" "exit 0, running" \
        "exit $GS_RC, $(gs_result state)${GS_MSG:+; $GS_MSG}" "$([ "$GS_RC" = 0 ] && echo PASS || echo FAIL)" "$GS_S s"
    step "$flow" "gpusnap resume after the filler" "$GS_S" "exit $GS_RC"
    progress f.6 "$name" "$pid" "$i0" "$t0" || true
    o=$(ops "$pid")
    row f.7 "$what: gpusnap's journal of pid $pid" "the refused restore and the resume (INFO)" "${o:-none}" INFO
    stop_safely "$pid" "end of fill" || true
}
