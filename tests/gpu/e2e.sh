#!/usr/bin/env bash
# GPU end-to-end checks of gpusnap against the real driver, on one GPU.
#
# Run from the repository root, on a machine with a GPU, as root:
#   OUT=/some/dir tests/gpu/e2e.sh
# Environment:
#   GPUSNAP       the binary (default ./target/release/gpusnap)
#   OUT           results directory (default: a new /tmp/gpusnap-out.* dir)
#   E2E_BUDGET_S  soft budget in seconds (default 420): a section that would
#                 not fit is skipped (and counts as a failure); a watchdog
#                 ends the run, through the cleanup, 60 s after it
#   BIG_GIB STUCK_GIB SMALL_GIB  worker sizes (default 8, 2, 1)
# Writes $OUT/gpu-e2e.md (the table, also printed on stdout) and
# $OUT/e2e.log (timestamped log, gpusnap outputs, worker logs).
# Exit 0 when every check passed, 1 when one failed or was skipped.
#
# Workers: big (suspend/resume, admission, stop), stuck (driven by raw
# driver calls into the stranded state), thr (fresh, with extra threads:
# bad input). Every restored worker is ended through `gpusnap stop`, which
# suspends it before the kill; see lib.sh stop_safely for the fallback.

NAME=e2e # read by lib.sh
# shellcheck source=tests/gpu/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

E2E_BUDGET_S=${E2E_BUDGET_S:-420}
BIG_GIB=${BIG_GIB:-8}
STUCK_GIB=${STUCK_GIB:-2}
SMALL_GIB=${SMALL_GIB:-1}
FILL_LEAVE_ADMISSION=1024   # MiB the filler leaves in (b)
FILL_LEAVE_STUCK=256        # MiB the filler leaves in (c), as in reports/000

ROWS=$WORK/rows.tsv
: >"$ROWS"
NPASS=0 NFAIL=0 NSKIP=0 NINFO=0
FINISHED=0
WB="" WS="" WT=""           # pids of the big, stuck and thread workers
WB_OK=0 WS_OK=0 WT_OK=0

# ---------------------------------------------------------------- table

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

# need SECONDS ID SECTION: true if that much of the soft budget is left;
# otherwise records a SKIP row for the section.
need() {
    local left=$((E2E_BUDGET_S - SECONDS))
    if [ "$left" -ge "$1" ]; then return 0; fi
    row "$2" "$3" "runs" "skipped: ${left}s of budget left, needs $1s" SKIP
    return 1
}

# shellcheck disable=SC2317 # runs from the EXIT trap
write_table() {
    local md=$OUT/gpu-e2e.md id c e g r f
    {
        echo "# gpusnap GPU end-to-end"
        echo
        echo "- date: $HDR_DATE"
        echo "- host: $HDR_HOST (kernel $HDR_KERNEL, host memory $HDR_HOSTMEM)"
        echo "- GPU: $HDR_GPU, $HDR_GPU_MEM; driver $HDR_DRIVER"
        echo "- gpusnap: $HDR_VERSION ($GPUSNAP)"
        echo "- torch: $(grep -ho 'torch=[^ ]*' "$WORK"/*.log 2>/dev/null | head -n 1 | cut -d= -f2)"
        echo "- THP enabled: $HDR_THP"
        echo "- workers: big $BIG_GIB GiB, stuck $STUCK_GIB GiB, thr $SMALL_GIB GiB (+2 threads)"
        echo "- result: $NPASS passed, $NFAIL failed, $NSKIP skipped, $NINFO info; wall ${SECONDS} s"
        echo
        echo "| # | check | expected | got | result | figure |"
        echo "|---|---|---|---|---|---|"
        while IFS=$'\t' read -r id c e g r f; do
            printf '| %s | %s | %s | %s | %s | %s |\n' "$id" "$c" "$e" "$g" "$r" "$f"
        done <"$ROWS"
    } >"$md"
    cat "$md"
}

# shellcheck disable=SC2317 # the EXIT trap
on_exit() {
    local rc=$? p gone m
    trap - ERR
    if [ "$FINISHED" != 1 ]; then
        row z0 "run completes" "all sections ran" "interrupted (exit $rc) at +${SECONDS}s" FAIL
    fi
    cleanup_all
    gone=yes
    for p in ${WORKERS[@]+"${WORKERS[@]}"} ${FILLERS[@]+"${FILLERS[@]}"} ${HELPERS[@]+"${HELPERS[@]}"}; do
        if alive "$p"; then gone="no: $p alive"; fi
    done
    row z1 "cleanup: every process of this run ended safely" "all gone" "$gone${LEFT_ALIVE:+; not stopped:$LEFT_ALIVE}" \
        "$([ "$gone" = yes ] && [ -z "$LEFT_ALIVE" ] && echo PASS || echo FAIL)"
    m=""
    for p in ${WORKERS[@]+"${WORKERS[@]}"} ${FILLERS[@]+"${FILLERS[@]}"}; do
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

# ---------------------------------------------------------------- checks

# gs_state PID: gpusnap state; sets S_STATE S_UNREC S_FP (and GS_*).
gs_state() {
    gs 30 state "$1"
    S_STATE=$(jget "$GS_OUT" 'd["state"]')
    S_UNREC=$(jget "$GS_OUT" 'd["unrecoverable"]')
    S_FP=$(jget "$GS_OUT" 'd["footprint_bytes"]')
}

# gs_result KEY: field of the first entry of "results" in the last gpusnap output.
gs_result() { jget "$GS_OUT" "d[\"results\"][0][\"$1\"]"; }

# close_to BYTES MIB: within 5% (at least 256 MiB) of each other.
close_to() {
    [ -n "$1" ] && [ -n "$2" ] &&
        awk -v b="$1" -v m="$2" 'BEGIN {
            d = b - m * 1048576; if (d < 0) d = -d
            lim = b * 0.05; if (lim < 268435456) lim = 268435456
            exit !(d <= lim) }'
}

preflight() {
    if [ "$HDR_VERSION_RC" = 0 ]; then
        row p1 "gpusnap --version" "exit 0" "$HDR_VERSION" PASS
    else
        row p1 "gpusnap --version" "exit 0" "exit $HDR_VERSION_RC: $HDR_VERSION" FAIL
        return 1
    fi
    local apps
    apps=$(smi_apps)
    row p2 "GPU idle before the run" "no compute apps" "${apps:-none}; free $(smi_free_mib) MiB" INFO
    return 0
}

start_workers() {
    local t0=$SECONDS got=""
    start_worker big "$BIG_GIB"
    WB=$LAST_PID
    start_worker stuck "$STUCK_GIB"
    WS=$LAST_PID
    start_worker thr "$SMALL_GIB" --threads 2
    WT=$LAST_PID
    if wait_ready big "$WB" 240; then WB_OK=1; fi
    if wait_ready stuck "$WS" 60; then WS_OK=1; fi
    if wait_ready thr "$WT" 60; then WT_OK=1; fi
    got="big $([ $WB_OK = 1 ] && echo ok || echo failed), stuck $([ $WS_OK = 1 ] && echo ok || echo failed), thr $([ $WT_OK = 1 ] && echo ok || echo failed); nvidia-smi MiB: big $(smi_pid_mib "$WB"), stuck $(smi_pid_mib "$WS"), thr $(smi_pid_mib "$WT")"
    row w1 "workers start (pids $WB $WS $WT)" "all ready, checksum ok" "$got" \
        "$([ $WB_OK$WS_OK$WT_OK = 111 ] && echo PASS || echo FAIL)" "$((SECONDS - t0)) s"
}

# (a) suspend / resume keeps the data and stops the work while suspended.
section_a() {
    local st fp smi ck lk tot got i1 i2 rss un psst rs ul v
    if [ "$WB_OK" != 1 ]; then row a "suspend/resume" "big worker" "big worker did not start" SKIP; return 0; fi
    need 90 a "suspend/resume" || return 0

    smi=$(smi_pid_mib "$WB")
    gs_state "$WB"
    v=FAIL
    if [[ $GS_RC == 0 && $S_STATE == running && $S_UNREC == false ]] && close_to "$S_FP" "$smi"; then v=PASS; fi
    row a1 "gpusnap state of a running worker" "exit 0, running, footprint = nvidia-smi (5%)" \
        "exit $GS_RC, $S_STATE, unrecoverable $S_UNREC, footprint $(gb "$S_FP") GB, nvidia-smi $(mib_gb "$smi") GB" "$v"
    fp=${S_FP:-$(calc %.0f 'm * 1048576' m="${smi:-0}")}

    gs 180 suspend "$WB"
    st=$(gs_result state) lk=$(gs_result lock_ms) ck=$(gs_result checkpoint_ms) tot=$(gs_result total_ms)
    v=$(gs_result footprint_bytes)
    fp=${v:-$fp}
    v=FAIL; [[ $GS_RC == 0 && $st == checkpointed ]] && v=PASS
    row a2 "suspend" "exit 0, checkpointed" "exit $GS_RC, ${st:-?}" \
        "$v" \
        "$(gb "$fp") GB in ${GS_S} s wall (lock $lk ms, checkpoint $ck ms, total $tot ms) = $(gbps "$fp" "$GS_S") GB/s"

    if wait_smi_unlisted "$WB" 5; then got="not listed"; else got="listed with $(smi_pid_mib "$WB") MiB"; fi
    v=FAIL; [[ $got == "not listed" ]] && v=PASS
    row a3 "nvidia-smi while suspended" "pid holds no GPU memory" "$got; free $(smi_free_mib) MiB" \
        "$v"

    gs_state "$WB"
    st=$S_STATE un=$S_UNREC
    gs 30 ps
    psst=$(jget "$GS_OUT" "[p['state'] for p in d['processes'] if p['pid'] == $WB][0]")
    v=FAIL; [[ $st == checkpointed && $un == false && $psst == checkpointed ]] && v=PASS
    row a4 "gpusnap state / ps while suspended" "checkpointed, recoverable; ps lists it" \
        "state: $st, unrecoverable $un; ps: ${psst:-not listed}" \
        "$v"

    sleep 1
    read_status "$WORK/big.status"
    i1=$ST_ITER
    sleep 3
    read_status "$WORK/big.status"
    i2=$ST_ITER
    rss=$(vmrss_mib "$WB")
    v=FAIL; [[ -n $i1 && $i1 == "$i2" ]] && v=PASS
    row a5 "no progress while suspended" "iteration unchanged over 3 s" "iteration $i1 -> $i2" \
        "$v" "host RSS $(mib_gb "$rss") GB while suspended"

    mark_restored "$WB"
    gs 120 resume "$WB"
    st=$(gs_result state) rs=$(gs_result restore_ms) ul=$(gs_result unlock_ms) tot=$(gs_result total_ms)
    v=FAIL; [[ $GS_RC == 0 && $st == running ]] && v=PASS
    row a6 "resume" "exit 0, running" "exit $GS_RC, ${st:-?}" \
        "$v" \
        "$(gb "$fp") GB in ${GS_S} s wall (restore $rs ms, unlock $ul ms, total $tot ms) = $(gbps "$fp" "$GS_S") GB/s"

    if wait_iter_gt big "${i2:-0}" 20; then got="iteration $i2 -> $ST_ITER, ok=$ST_OK"; else got="no progress in 20 s (iteration ${ST_ITER:-?}, ok=${ST_OK:-?})"; fi
    v=FAIL; [[ $ST_ITER -gt ${i2:-0} && $ST_OK == 1 ]] && v=PASS
    row a7 "work continues, data intact" "iteration advances, ok=1" "$got; nvidia-smi $(smi_pid_mib "$WB") MiB" \
        "$v"
    return 0
}

# (b) admission: a resume that does not fit is refused and changes nothing.
section_b() {
    local st i0 got fp fp_mib free t0 t rc driver_st timely v
    if [ "$WB_OK" != 1 ] || ! alive "$WB"; then row b "admission" "big worker" "big worker not running" SKIP; return 0; fi
    need 120 b "admission" || return 0
    gs_state "$WB"
    if [ "$S_STATE" != running ]; then row b "admission" "big worker running" "state ${S_STATE:-?}" SKIP; return 0; fi

    gs 180 suspend "$WB"
    st=$(gs_result state) fp=$(gs_result footprint_bytes)
    fp=${fp:-$S_FP}
    v=FAIL; [[ $GS_RC == 0 && $st == checkpointed ]] && v=PASS
    row b1 "suspend" "exit 0, checkpointed" "exit $GS_RC, ${st:-?}" \
        "$v" "$(gb "$fp") GB in ${GS_S} s"
    if [ "$st" != checkpointed ]; then return 0; fi
    sleep 1
    read_status "$WORK/big.status"
    i0=$ST_ITER
    fp_mib=$(calc %d 'b / 1048576' b="${fp:-0}")

    if ! start_filler "$FILL_LEAVE_ADMISSION" 120; then
        row b2 "filler leaves ${FILL_LEAVE_ADMISSION} MiB" "ready" "filler failed" FAIL
        kill_fillers
    else
        free=$(smi_free_mib)
        v=FAIL; [[ ${free:-999999} -lt $fp_mib ]] && v=PASS
        row b2 "filler leaves ${FILL_LEAVE_ADMISSION} MiB" "less free than the worker needs" \
            "free $free MiB (nvidia-smi), filler holds $FILL_HELD MiB; worker needs $fp_mib MiB" \
            "$v"

        mark_restored "$WB"
        gs 60 resume "$WB"
        v=FAIL; [[ $GS_RC == 3 ]] && v=PASS
        row b3 "resume without memory" "exit 3 (refused)" "exit $GS_RC: ${GS_MSG:-no message}" \
            "$v" "${GS_S} s"

        gs_state "$WB"
        st=$S_STATE
        raw 60 "$WB" state
        driver_st=$(jget "$RAW_OUT" 'd["final_state"]')
        read_status "$WORK/big.status"
        v=FAIL; [[ $st == checkpointed && $S_UNREC == false && $driver_st == checkpointed && -n $i0 && $ST_ITER == "$i0" ]] && v=PASS
        row b4 "nothing changed after the refusal" "checkpointed, recoverable, no progress" \
            "gpusnap: $st, unrecoverable $S_UNREC; driver: ${driver_st:-?}; iteration $i0 -> $ST_ITER" \
            "$v"

        gs 60 resume --wait 3 "$WB"
        rc=$GS_RC t=$GS_S
        got="exit $GS_RC after ${GS_S} s: ${GS_MSG:-no message}"
        timely=no
        if fle 2.5 "$t" && fle "$t" 15; then timely=yes; fi
        gs_state "$WB"
        v=FAIL; [[ $rc == 3 && $timely == yes && $S_STATE == checkpointed && $S_UNREC == false ]] && v=PASS
        row b5 "resume --wait 3 without memory" "exit 3 after 2.5-15 s, still checkpointed" \
            "$got; state $S_STATE, unrecoverable $S_UNREC" \
            "$v" "$t s"

        t0=$SECONDS
        kill_fillers
        if wait_smi_free $((fp_mib + 1024)) 60; then got="after $((SECONDS - t0)) s"; else got="not within 60 s"; fi
        free=$(smi_free_mib)
        v=FAIL; [[ ${free:-0} -ge $((fp_mib + 1024)) ]] && v=PASS
        row b6 "filler killed" "free memory covers the worker again" "$free MiB free $got" \
            "$v"
    fi

    mark_restored "$WB"
    gs 120 resume "$WB"
    st=$(gs_result state)
    got="exit $GS_RC, ${st:-?} ${GS_MSG:+($GS_MSG)}"
    v=FAIL; [[ $GS_RC == 0 && $st == running ]] && v=PASS
    if [ "$GS_RC" = 3 ]; then
        # Refused again: keep the worker for (d), but the check has failed.
        gs 120 resume --wait 60 "$WB"
        got="$got; then resume --wait 60: exit $GS_RC"
    fi
    row b7 "resume once memory is free" "exit 0, running" "$got" \
        "$v" "restore $(gs_result restore_ms) ms, ${GS_S} s wall"

    if wait_iter_gt big "${i0:-0}" 20; then got="iteration $i0 -> $ST_ITER, ok=$ST_OK"; else got="no progress in 20 s (ok=${ST_OK:-?})"; fi
    v=FAIL; [[ $ST_ITER -gt ${i0:-0} && $ST_OK == 1 ]] && v=PASS
    row b8 "data intact after the refused resumes" "iteration advances, ok=1" "$got" \
        "$v"
    return 0
}

# (c) contrast: the raw driver strands a process after an OOM restore;
# gpusnap must report it unrecoverable and refuse with exit 5.
section_c() {
    local st rcs got smi fp_mib t0 w name pid i v
    if [ "$WS_OK" != 1 ]; then row c "stranded process" "stuck worker" "stuck worker did not start" SKIP; return 0; fi
    need 120 c "stranded process" || return 0

    fp_mib=$(smi_pid_mib "$WS")
    raw 60 --timeout-ms 10000 "$WS" lock checkpoint state
    st=$(jget "$RAW_OUT" 'd["final_state"]')
    v=FAIL; [[ $RAW_RC == 0 && $st == checkpointed ]] && v=PASS
    row c1 "raw lock + checkpoint of the $STUCK_GIB GiB worker" "lock 0, checkpoint 0, get-state 0: checkpointed" "$(raw_rcs), ${st:-?}" \
        "$v" "driver $(jget "$RAW_OUT" 'd["driver_ms"]') ms"
    if [ "$st" != checkpointed ]; then return 0; fi

    if ! start_filler "$FILL_LEAVE_STUCK" 120; then
        row c2 "filler leaves $FILL_LEAVE_STUCK MiB" "ready" "filler failed" FAIL
        kill_fillers
        return 0
    fi
    mark_restored "$WS"
    raw 120 --keep-going "$WS" restore state
    rcs=$(raw_rcs) st=$(jget "$RAW_OUT" 'd["final_state"]')
    v=FAIL; [[ ${rcs%% *} == 2 && $st == checkpointed ]] && v=PASS
    row c2 "raw restore with $FILL_LEAVE_STUCK MiB free" "restore 2 (out of memory), get-state 0: checkpointed" \
        "$rcs, ${st:-?}; free $(smi_free_mib) MiB" "$v"

    kill_fillers
    wait_smi_free $((${fp_mib:-2048} + 1024)) 60 || log "memory did not come back within 60 s"
    raw 120 --keep-going "$WS" restore unlock state
    rcs=$(raw_rcs) st=$(jget "$RAW_OUT" 'd["final_state"]')
    v=FAIL; [[ $rcs == "304 401 0" && $st == checkpointed ]] && v=PASS
    row c3 "raw restore again with memory free" "restore 304, unlock 401, get-state 0: checkpointed (stranded)" \
        "$rcs, ${st:-?}; free $(smi_free_mib) MiB" "$v"

    gs_state "$WS"
    row c4 "gpusnap state before any gpusnap resume" "(information)" \
        "exit $GS_RC, ${S_STATE:-?}, unrecoverable ${S_UNREC:-?}" INFO
    # gpusnap has no footprint on record for a process suspended outside it.
    gs 60 resume --footprint "${fp_mib:-$((STUCK_GIB * 1024 + 1024))}" "$WS"
    v=FAIL; [[ $GS_RC == 5 ]] && v=PASS
    row c5 "gpusnap resume --footprint of the stranded process" "exit 5" "exit $GS_RC: ${GS_MSG:-no message}" \
        "$v" "${GS_S} s"
    gs_state "$WS"
    v=FAIL; [[ $S_STATE == checkpointed && $S_UNREC == true ]] && v=PASS
    row c6 "gpusnap state after that" "checkpointed, unrecoverable true" \
        "exit $GS_RC, ${S_STATE:-?}, unrecoverable ${S_UNREC:-?}" \
        "$v"

    smi=$(smi_pid_mib "$WS")
    raw 30 "$WS" state
    st=$(jget "$RAW_OUT" 'd["final_state"]')
    if [ "$st" = checkpointed ] && [ -z "$smi" ]; then
        # Stranded in CHECKPOINTED: it holds no GPU memory, killing it is safe.
        log "stranded worker $WS holds no GPU memory (driver: $st); SIGKILL"
        t0=$(now)
        kill -KILL "$WS"
        if wait_gone "$WS" 30; then got="gone"; else got="still alive after 30 s"; fi
        v=FAIL; [[ $got == gone ]] && v=PASS
        row c7 "kill the stranded process" "holds no GPU memory; pid gone" \
            "nvidia-smi: not listed, driver: $st; $got" "$v" "$(fsub "$t0" "$(now)") s"
    else
        row c7 "kill the stranded process" "holds no GPU memory; pid gone" \
            "nvidia-smi: ${smi:-not listed} MiB, driver: ${st:-?}; stopping it through gpusnap instead" FAIL
        stop_safely "$WS" "section c" || true
    fi

    got=""
    for w in big:$WB thr:$WT; do
        name=${w%%:*} pid=${w#*:}
        alive "$pid" || continue
        gs_state "$pid"
        if [ "$S_STATE" != running ]; then got="$got $name not running ($S_STATE), not checked;"; continue; fi
        read_status "$WORK/$name.status"
        i=$ST_ITER
        if wait_iter_gt "$name" "${i:-0}" 10 && [ "$ST_OK" = 1 ]; then got="$got $name ok;"; else got="$got $name NOT ok;"; fi
    done
    v=FAIL; [[ $got == *" ok;"* && $got != *NOT* ]] && v=PASS
    row c8 "other workers unaffected" "running ones advance with ok=1" "${got# }" \
        "$v"
    return 0
}

# (d) gpusnap stop of a restored worker suspends it before the kill.
section_d() {
    local sus rel sig got smi t v
    if [ "$WB_OK" != 1 ] || ! alive "$WB"; then row d "stop" "big worker" "big worker not running" SKIP; return 0; fi
    need 60 d "stop" || return 0
    smi=$(smi_pid_mib "$WB")
    gs 180 stop "$WB"
    sus=$(gs_result suspended) rel=$(gs_result released_before_kill) sig=$(gs_result signal) t=$(gs_result total_ms)
    v=FAIL; [[ $GS_RC == 0 && $sus == true && $rel == true ]] && v=PASS
    row d1 "stop a restored worker (held $(mib_gb "$smi") GB)" "exit 0, suspended true, released_before_kill true" \
        "exit $GS_RC, suspended $sus, released_before_kill $rel, signal $sig" \
        "$v" "${GS_S} s wall, total $t ms"
    if alive "$WB"; then
        if wait_gone "$WB" 10; then got="gone within 10 s after gpusnap returned"; else got="still alive 10 s after"; fi
    else
        got="gone when gpusnap returned"
    fi
    v=FAIL; [[ $got == "gone when gpusnap returned" ]] && v=PASS
    row d2 "pid gone" "gone when stop returns" "$got" "$v"
    if wait_smi_unlisted "$WB" 5; then got="not listed"; else got="listed: $(smi_pid_mib "$WB") MiB"; fi
    v=FAIL; [[ $got == "not listed" ]] && v=PASS
    row d3 "nvidia-smi after stop" "no process for the pid" "$got; apps: $(smi_apps)" "$v"
    return 0
}

# (e) bad input: thread id, dead pid, non-CUDA pid, stopped process.
section_e() {
    local tid t dead slp got i msg_ok slp_alive quick v
    if [ "$WT_OK" != 1 ]; then row e "bad input" "thr worker" "thr worker did not start" SKIP; return 0; fi
    need 60 e "bad input" || return 0

    tid=$(cut -d' ' -f1 "$WORK/thr.status.tids" 2>/dev/null)
    if [ -z "$tid" ] || [ "$tid" = "$WT" ]; then
        tid=""
        for t in /proc/"$WT"/task/*; do
            t=${t##*/}
            if [ "$t" != "$WT" ]; then tid=$t; break; fi
        done
    fi
    gs 30 suspend "$tid"
    msg_ok=no
    if grep -q 'is a thread of' "$GS_ERR"; then msg_ok=yes; fi
    v=FAIL; [[ $GS_RC == 2 && $msg_ok == yes ]] && v=PASS
    row e1 "suspend a thread id ($tid of $WT)" "exit 2, 'is a thread of'" "exit $GS_RC: ${GS_MSG:-no message}" \
        "$v"
    read_status "$WORK/thr.status"
    i=$ST_ITER
    gs_state "$WT"
    if [ "$S_STATE" = checkpointed ]; then
        log "the thread id was accepted: worker $WT is checkpointed; resuming it"
        mark_restored "$WT"
        gs 60 resume "$WT"
    fi
    if wait_iter_gt thr "${i:-0}" 10; then got="state $S_STATE, iteration $i -> $ST_ITER ok=$ST_OK"; else got="state $S_STATE, no progress"; fi
    v=FAIL; [[ $S_STATE == running && $ST_ITER -gt ${i:-0} && $ST_OK == 1 ]] && v=PASS
    row e2 "the process behind the thread id is untouched" "running, advancing" "$got" \
        "$v"

    dead=999999
    while [ -e "/proc/$dead" ]; do dead=$((dead + 1)); done
    gs 30 suspend "$dead"
    v=FAIL; [[ $GS_RC == 2 ]] && v=PASS
    row e3 "suspend a pid that does not exist ($dead)" "exit 2" "exit $GS_RC: ${GS_MSG:-no message}" "$v"

    sleep 300 >/dev/null 2>&1 &
    slp=$!
    HELPERS+=("$slp")
    gs 30 suspend "$slp"
    slp_alive=no
    if alive "$slp"; then slp_alive=yes; fi
    v=FAIL; [[ $GS_RC == 2 && $slp_alive == yes ]] && v=PASS
    row e4 "suspend a non-CUDA process (sleep $slp)" "exit 2, process untouched" \
        "exit $GS_RC: ${GS_MSG:-no message}; sleep alive: $slp_alive" "$v"
    kill -KILL "$slp" 2>/dev/null

    read_status "$WORK/thr.status"
    i=$ST_ITER
    kill -STOP "$WT"
    wait_pstate "$WT" Tt 5 || log "worker $WT not in state T after 5 s: $(pstate "$WT")"
    gs 60 suspend "$WT"
    t=$GS_S got="exit $GS_RC after ${GS_S} s: ${GS_MSG:-no message}"
    kill -CONT "$WT"
    wait_pstate "$WT" RSD 5 || log "worker $WT state after SIGCONT: $(pstate "$WT")"
    quick=no
    if fle "$t" 10; then quick=yes; fi
    v=FAIL; [[ $GS_RC == 2 && $quick == yes ]] && v=PASS
    row e5 "suspend a stopped process (SIGSTOP)" "exit 2 within 10 s, no hang" "$got" \
        "$v" "$t s"

    gs_state "$WT"
    if wait_iter_gt thr "${i:-0}" 15; then got="state $S_STATE, iteration $i -> $ST_ITER ok=$ST_OK"; else got="state ${S_STATE:-?}, no progress in 15 s"; fi
    v=FAIL; [[ $S_STATE == running && $ST_ITER -gt ${i:-0} && $ST_OK == 1 ]] && v=PASS
    row e6 "after SIGCONT the worker runs on" "running, advancing, ok=1" "$got" \
        "$v"

    gs 120 stop "$WT"
    if wait_gone "$WT" 10; then got="exit $GS_RC, gone"; else got="exit $GS_RC, still alive"; fi
    v=FAIL; [[ $got == "exit 0, gone" ]] && v=PASS
    row e7 "stop the fresh worker" "exit 0, pid gone" "$got; suspended $(gs_result suspended)" \
        "$v" "${GS_S} s"
    return 0
}

# ---------------------------------------------------------------- main

install_traps
start_watchdog $((E2E_BUDGET_S + 60))
log "gpusnap GPU e2e: budget ${E2E_BUDGET_S}s"
collect_header
if preflight; then
    start_workers
    section_a
    section_b
    kill_fillers
    section_c
    kill_fillers
    section_d
    section_e
fi
FINISHED=1
exit 0   # on_exit writes the table and sets the exit status
