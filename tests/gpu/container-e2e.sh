#!/usr/bin/env bash
# CRIU's CUDA plugin with gpusnap as its `cuda-checkpoint`, for a CUDA worker
# in its own mount and pid namespaces (what a container runtime gives its
# process, without the runtime), against the same worker outside namespaces.
#
# For each mode of CONT_MODES (default "bare ns pidns"):
#   bare   the worker started plainly (its own session)
#   ns     `unshare --mount --pid --fork --mount-proc` (the worker is pid 1 of
#          its pid namespace; CRIU dumps and restores both namespaces)
#   pidns  `unshare --pid --fork` (the pid namespace only)
# a CuPy worker (tests/gpu/worker_cupy.py, CONT_GIB GiB) is dumped with
# `criu dump` (the plugin locks and checkpoints it through gpusnap) and
# restored with `criu restore -d` (the plugin restores and unlocks it through
# gpusnap); its status line must advance with ok=1 and gpusnap's journal
# must hold the plugin's calls. Then (CONT_FILL, default 1), in the first
# namespace mode that went through, the same with a filler taking the GPU
# while it is restored: the restore must still succeed with the process back
# and its CUDA state checkpointed (gpusnap refuses the restore that would not
# fit), and `gpusnap resume` must run it once the filler is gone.
#
# Run as root from the repository root on the GPU machine (tests/gpu/device.sh
# container), with CRIU's plugin directory next to the criu on PATH
# (PREFIX/bin/criu, PREFIX/lib/criu/cuda_plugin.so) or CONT_PLUGINS=DIR.
# Environment: GPUSNAP, OUT, CONT_GIB (2), CONT_MODES, CONT_FILL (1),
# CONT_BUDGET_S (300), CONT_DUMP_ARGS (extra `criu dump` flags of the ns modes,
# tried after the plain dump failed: default the automatic external mounts),
# CONT_WORKER (worker_cupy.py; worker.py for PyTorch).
# Files: $OUT/container-e2e.md (check table, then steps with seconds),
# $OUT/container-e2e.log. Exit 1 if a check failed.

NAME=container-e2e
# shellcheck source=tests/gpu/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
# shellcheck source=tests/gpu/plugin-lib.sh
. "$GPU_DIR/plugin-lib.sh"

CONT_GIB=${CONT_GIB:-2}
CONT_MODES=${CONT_MODES:-bare ns pidns}
CONT_FILL=${CONT_FILL:-1}
CONT_BUDGET_S=${CONT_BUDGET_S:-300}
CONT_WORKER=${CONT_WORKER:-worker_cupy.py}
read -r -a EXT_DUMP <<<"${CONT_DUMP_ARGS:---ext-mount-map auto --enable-external-sharing --enable-external-masters}"
ROWS=$WORK/rows.tsv
STEPS=$WORK/steps.tsv # mode step seconds note
: >"$ROWS"
: >"$STEPS"
NPASS=0 NFAIL=0 NSKIP=0 NINFO=0
FINISHED=0
NS_OK="" # first namespace mode whose cycle went through
FLOW_ST="" FLOW_BUDGET_S=$CONT_BUDGET_S FLOW_PROGRESS_S=60 FLOW_WORKER_WHAT="the worker"

# ---------------------------------------------------------------- setup

BIN=$WORK/bin
mkdir -p "$BIN"
ln -sfn "$GPUSNAP" "$BIN/cuda-checkpoint"
find_plugins

# ccriu ID WHAT LOG ARGS...: criu with the CUDA plugin and gpusnap as its
# cuda-checkpoint, in a session of its own; sets CR_RC, CR_S, CR_ERR.
ccriu() {
    local id=$1 what=$2 lg=$3 t0 t1
    shift 3
    log "criu $* (plugins $PLUGINS)"
    t0=$(now)
    CR_RC=0
    timeout -k 10 240 env PATH="$BIN:$PATH" GPUSNAP_STATE_DIR="$STATE_DIR" \
        setsid -w "$CRIU_BIN" "$@" -L "$PLUGINS" -v4 --log-file "$lg" --file-locks \
        </dev/null >>"$WORK/criu.out" 2>&1 || CR_RC=$?
    t1=$(now)
    CR_S=$(fsub "$t0" "$t1")
    CR_ERR=""
    if [ "$CR_RC" != 0 ]; then
        CR_ERR=$(crit_err "$lg")
        tail -n 40 "$lg" >"$WORK/tail.txt" 2>/dev/null; log_file "criu log (last lines)" "$WORK/tail.txt"
    fi
    log "  -> exit $CR_RC in ${CR_S}s ${CR_ERR:+($CR_ERR)}"
    row "$id" "$what" "exit 0" "exit $CR_RC${CR_ERR:+; $CR_ERR}" "$([ "$CR_RC" = 0 ] && echo PASS || echo FAIL)" "$CR_S s"
}

# start_mode MODE NAME: the worker in MODE; sets WPID (the worker's pid as
# seen here) and UPID (unshare's, or empty).
start_mode() {
    local mode=$1 name=$2 pre=() end
    case $mode in
        ns) pre=(unshare --mount --pid --fork --mount-proc) ;;
        pidns) pre=(unshare --pid --fork) ;;
    esac
    rm -f "$WORK/$name.status" "$WORK/$name.status.exit"
    : >"$WORK/$name.log"
    ${pre[@]+"${pre[@]}"} $(worker_cmd "$WORK/$name.status") </dev/null >>"$WORK/$name.log" 2>&1 &
    WPID=$! UPID=""
    if [ ${#pre[@]} -gt 0 ]; then
        UPID=$WPID WPID=""
        end=$((SECONDS + 20))
        while [ -z "$WPID" ] && [ "$SECONDS" -lt "$end" ]; do
            WPID=$(cat "/proc/$UPID/task/$UPID/children" 2>/dev/null | awk '{ print $1 }')
            [ -n "$WPID" ] || sleep 0.1
        done
        HELPERS+=("$UPID")
    fi
    [ -n "$WPID" ] && WORKERS+=("$WPID")
    log "worker $name ($mode): pid ${WPID:-?}${UPID:+, unshare $UPID}"
    [ -n "$WPID" ]
}

# worker_cmd STATUS: the worker's command line (a dry run's hook replaces it).
if ! declare -F worker_cmd >/dev/null; then
    worker_cmd() { printf '%s\n' python3 "$GPU_DIR/$CONT_WORKER" "$CONT_GIB" "$1"; }
fi

# dump_mode MODE NAME PID DIR: criu dump, for the ns modes retried with
# CONT_DUMP_ARGS after a failure (a failed dump leaves the worker running).
DUMP_EXTRA=()
dump_mode() {
    local mode=$1 name=$2 pid=$3 dir=$4
    DUMP_EXTRA=()
    ccriu "$mode.d" "$mode: criu dump --tree $pid (the plugin: lock + checkpoint through gpusnap)" "$dir/dump.log" \
        dump --tree "$pid" --images-dir "$dir"
    if [ "$CR_RC" != 0 ] && [ "${mode%bare}" = "$mode" ] && alive "$pid" && [ ${#EXT_DUMP[@]} -gt 0 ]; then
        DUMP_EXTRA=("${EXT_DUMP[@]}")
        rm -rf "$dir" && mkdir -p "$dir"
        ccriu "$mode.d2" "$mode: criu dump again with ${DUMP_EXTRA[*]}" "$dir/dump.log" \
            dump --tree "$pid" --images-dir "$dir" "${DUMP_EXTRA[@]}"
    fi
    step "$mode" "criu dump" "$CR_S" "exit $CR_RC${DUMP_EXTRA[*]:+ (${DUMP_EXTRA[*]})}"
}

# restore_mode MODE DIR: criu restore -d (--root / for a mount namespace);
# sets RPID (the restored worker's pid here).
restore_mode() {
    local mode=$1 dir=$2 extra=()
    [ "${mode#fill-}" = ns ] && extra=(--root /)
    [ ${#DUMP_EXTRA[@]} -gt 0 ] && extra+=(--ext-mount-map auto --enable-external-sharing --enable-external-masters)
    rm -f "$dir/restored.pid"
    ccriu "$mode.r" "$mode: criu restore -d (the plugin: restore + unlock through gpusnap)" "$dir/restore.log" \
        restore --restore-detached --images-dir "$dir" --pidfile "$dir/restored.pid" ${extra[@]+"${extra[@]}"}
    RPID=$(cat "$dir/restored.pid" 2>/dev/null)
    if [ -n "$RPID" ]; then
        WORKERS+=("$RPID")
        mark_restored "$RPID"
    fi
    step "$mode" "criu restore -d" "$CR_S" "exit $CR_RC, pid ${RPID:-none}"
}

# cycle MODE: start, dump, restore, check, stop.
cycle() {
    local mode=$1 name=w-$1 dir=$WORK/img-$1 i0 t0 mib o st
    need_s 90 "$mode" || return 0
    rm -rf "$dir" && mkdir -p "$dir"
    t0=$(now)
    if ! start_mode "$mode" "$name" || ! ready "$name" "$WPID" 120; then
        row "$mode.0" "$mode: $CONT_WORKER $CONT_GIB GiB starts" "ready, ok=1" "not ready (log: $(tail -n 2 "$WORK/$name.log" | tr '\n' ' ' | cut -c1-200))" FAIL
        return 0
    fi
    mib=$(smi_pid_mib "$WPID")
    row "$mode.0" "$mode: $CONT_WORKER $CONT_GIB GiB starts" "ready, ok=1" "pid $WPID (its own: $ST_PID), nvidia-smi ${mib:-not listed} MiB" PASS "$(fsub "$t0" "$(now)") s"
    dump_mode "$mode" "$name" "$WPID" "$dir"
    if [ "$CR_RC" != 0 ]; then return 0; fi
    row "$mode.p" "$mode: the plugin ran at dump" "cuda_plugin lines" "$(plugin_lines "$dir/dump.log")" \
        "$(grep -q 'cuda_plugin' "$dir/dump.log" && echo PASS || echo FAIL)"
    o=$(ops "$WPID")
    row "$mode.j" "$mode: gpusnap's journal of pid $WPID after the dump" "lock and checkpoint" "${o:-none}" \
        "$([[ " $o " == *" lock "* && " $o " == *" checkpoint "* ]] && echo PASS || echo FAIL)"
    mark_restored "$WPID"
    reap "$WPID"
    wait_pid_free "$WPID" 60 || log "pid $WPID still there after the dump"
    [ -n "$UPID" ] && { wait_gone "$UPID" 30 || true; reap "$UPID"; }
    read_status "$WORK/$name.status"
    i0=$ST_ITER
    restore_mode "$mode" "$dir"
    if [ "$CR_RC" != 0 ] || [ -z "$RPID" ]; then return 0; fi
    t0=$(now)
    gs_state "$RPID"
    st=$S_STATE
    row "$mode.s" "$mode: gpusnap state of the restored pid $RPID" "running" "exit $GS_RC, ${st:-?}${GS_MSG:+; $GS_MSG}" \
        "$([ "$st" = running ] && echo PASS || echo FAIL)"
    if progress "$mode.c" "$name" "$RPID" "$i0" "$t0"; then
        step "$mode" "first status line after the restore" "$(fsub "$t0" "$(now)")" "iteration $ST_ITER"
        case $mode in bare) ;; *) [ -n "$NS_OK" ] || NS_OK=$mode ;; esac
    fi
    o=$(ops "$RPID")
    row "$mode.k" "$mode: gpusnap's journal of the restored pid $RPID" "the plugin's restore (INFO)" "${o:-none}" INFO
    row "$mode.q" "$mode: the plugin ran at restore" "cuda_plugin lines" "$(plugin_lines "$dir/restore.log")" \
        "$(grep -q 'cuda_plugin' "$dir/restore.log" && echo PASS || echo FAIL)"
    t0=$(now)
    stop_safely "$RPID" "end of $mode" && step "$mode" "gpusnap stop" "$(fsub "$t0" "$(now)")"
    rm -rf "$dir"
}

# fill_cycle MODE: the restore meets a filler; the process must come back
# checkpointed, and resume once the filler is gone.
fill_cycle() {
    local mode=$1 name=f-$1 dir=$WORK/img-f-$1 i0 mib
    need_s 120 "fill" || return 0
    rm -rf "$dir" && mkdir -p "$dir"
    if ! start_mode "$mode" "$name" || ! ready "$name" "$WPID" 120; then
        row f.0 "fill ($mode): worker starts" "ready" "not ready" FAIL
        return 0
    fi
    mib=$(smi_pid_mib "$WPID")
    dump_mode "fill-$mode" "$name" "$WPID" "$dir"
    [ "$CR_RC" = 0 ] || return 0
    mark_restored "$WPID"
    reap "$WPID"
    wait_pid_free "$WPID" 60 || true
    [ -n "$UPID" ] && { wait_gone "$UPID" 30 || true; reap "$UPID"; }
    read_status "$WORK/$name.status"
    i0=$ST_ITER
    fill_start "fill ($mode)" "$mib" || return 0
    restore_mode "fill-$mode" "$dir"
    if [ -z "$RPID" ] || ! alive "$RPID"; then
        row f.2 "fill ($mode): the process is back" "alive" "no process (criu exit $CR_RC)" FAIL
        kill_fillers
        return 0
    fi
    fill_refused "fill ($mode)" dump "$dir/restore.log"
    fill_resume "fill ($mode)" "fill-$mode" "$name" "$RPID" "$i0"
    rm -rf "$dir"
}

# ---------------------------------------------------------------- report

write_table() {
    {
        echo "# CRIU's CUDA plugin through gpusnap, in namespaces and outside"
        echo
        echo "- date: $HDR_DATE; host: $HDR_HOST; kernel $HDR_KERNEL"
        echo "- gpu: $HDR_GPU, driver $HDR_DRIVER, $HDR_GPU_MEM; gpusnap: $HDR_VERSION"
        echo "- criu: ${CRIU_BIN:-none} ($(timeout 10 "${CRIU_BIN:-false}" --version 2>/dev/null | sed -n 's/^Version: *//p')), plugins: ${PLUGINS:-none}"
        echo "- worker: $CONT_WORKER $CONT_GIB GiB; modes: $CONT_MODES; fill: $CONT_FILL ($([ -n "$NS_OK" ] && echo "in $NS_OK" || echo bare))"
        echo "- result: $NPASS passed, $NFAIL failed, $NSKIP skipped, $NINFO info"
        echo
        rows_md id check expected got result figure
        echo
        steps_md mode
    } >"$OUT/$NAME.md"
}

on_exit() {
    local rc=$?
    trap - ERR
    rows_end "$rc"
    write_table
    rows_exit
}

# ---------------------------------------------------------------- main

install_traps
start_watchdog $((CONT_BUDGET_S + 60))
collect_header
if [ -z "$CRIU_BIN" ] || [ -z "$PLUGINS" ]; then
    row pre "criu and CRIU's cuda_plugin.so" "found" "criu '${CRIU_BIN:-none}', plugins '${PLUGINS:-none}'" FAIL
else
    row pre "criu and CRIU's cuda_plugin.so" "found" "criu $CRIU_BIN, plugins $PLUGINS; cuda-checkpoint -> $GPUSNAP" PASS
    for m in $CONT_MODES; do cycle "$m"; done
    if [ "$CONT_FILL" = 1 ]; then fill_cycle "${NS_OK:-bare}"; fi
fi
FINISHED=1
