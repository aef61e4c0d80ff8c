#!/usr/bin/env bash
# GPU end-to-end checks of gpusnap against the real driver, on one GPU.
#
# Run from the repository root, on a machine with a GPU, as root:
#   OUT=/some/dir tests/gpu/e2e.sh
# Environment:
#   GPUSNAP       the binary (default ./target/release/gpusnap)
#   OUT           results directory (default: a new /tmp/gpusnap-out.* dir)
#   E2E_BUDGET_S  soft budget in seconds (default 480): a section that would
#                 not fit is skipped (and counts as a failure); a watchdog
#                 ends the run, through the cleanup, 60 s after it
#   BIG_GIB STUCK_GIB SMALL_GIB  driver-section worker sizes (default 8, 2, 1)
#   HIB_GIB REC_GIB              CRIU-section worker sizes (default 4, 2)
#   EXT_GIB       (k) worker size (default 2)
#   E2E_SECTIONS  the sections to run (default "a b c d e h r x"; k is not in
#                 the default list: E2E_SECTIONS=k runs it alone)
#   E2E_CRIU      auto (default): run the CRIU sections h r x k when
#                 selected; without a usable CRIU each is a SKIP row.
#                 no: leave them out (one INFO row says so)
#   E2E_WAKE_ARGS extra arguments for `gpusnap wake` in (h) (e.g. --no-guard)
#   GPUSNAP_CRIU  the CRIU binary (default: criu on PATH), as for gpusnap
# Writes $OUT/gpu-e2e.md (the table, also printed on stdout),
# $OUT/gpu-e2e.json (the rows and the CRIU sections' figures) and $OUT/e2e.log
# (timestamped log, gpusnap outputs, worker logs).
# Exit 0 when every check passed, 1 when one failed or was skipped.
#
# Driver-section workers: big (suspend/resume, admission, stop), stuck (driven by raw
# driver calls into the stranded state), thr (fresh, with extra threads:
# bad input). CRIU-section workers: hib (hibernate into an image, wake), rec (suspended,
# snapshotted, driven into the stuck state, recovered from the snapshot by
# `gpusnap resume`), ext (k: suspended by gpusnap, then dumped and restored
# by plain criu outside gpusnap, as a container runtime would, and resumed
# by `gpusnap resume` with no flags). Images live in this run's state dir and are removed at
# the end. Every restored worker is ended through `gpusnap stop`, which
# suspends it before the kill; see lib.sh stop_safely for the fallback.

NAME=e2e # read by lib.sh
# shellcheck source=tests/gpu/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

E2E_BUDGET_S=${E2E_BUDGET_S:-480}
BIG_GIB=${BIG_GIB:-8}
STUCK_GIB=${STUCK_GIB:-2}
SMALL_GIB=${SMALL_GIB:-1}
HIB_GIB=${HIB_GIB:-4}
REC_GIB=${REC_GIB:-2}
EXT_GIB=${EXT_GIB:-2}
E2E_SECTIONS=${E2E_SECTIONS:-a b c d e h r x}
E2E_CRIU=${E2E_CRIU:-auto}
E2E_WAKE_ARGS=${E2E_WAKE_ARGS:-}
FILL_LEAVE_ADMISSION=1024   # MiB the filler leaves in (b)
FILL_LEAVE_STUCK=256        # MiB the filler leaves in (c), as in reports/000

ROWS=$WORK/rows.tsv
FIGS=$WORK/figures.tsv      # key, value: the CRIU sections' figures for gpu-e2e.json
: >"$ROWS"
: >"$FIGS"
NPASS=0 NFAIL=0 NSKIP=0 NINFO=0
FINISHED=0
WB="" WS="" WT=""           # pids of the big, stuck and thread workers
WB_OK=0 WS_OK=0 WT_OK=0
WH="" WR=""                 # pids of the hibernate and recovery workers (CRIU sections)
WH_OK=0 WR_OK=0
WK="" WK_OK=0               # pid of the worker CRIU restores outside gpusnap (k)
CRIU_ON=0                   # 1: the CRIU sections run (CRIU usable)
CRIU_BIN="" CRIU_VERSION="" CRIU_CHECK="" CRIU_CHECK_RC="" CRIU_WHY=""

# ---------------------------------------------------------------- table

# cell and row (the results table) are in lib.sh.

# fig KEY VALUE: a figure for gpu-e2e.json.
fig() { printf '%s\t%s\n' "$1" "${2:-}" >>"$FIGS"; }

# selected SECTION: whether E2E_SECTIONS names it.
selected() {
    case " $E2E_SECTIONS " in *" $1 "*) return 0 ;; esac
    return 1
}

# need SECONDS ID SECTION: true if that much of the soft budget is left;
# otherwise records a SKIP row for the section.
need() { budget_need "$E2E_BUDGET_S" "$@"; }

# shellcheck disable=SC2317 # runs from the EXIT trap
write_table() {
    local md=$OUT/gpu-e2e.md id c e g r f torch
    torch=$(torch_seen)
    {
        echo "# gpusnap GPU end-to-end"
        echo
        echo "- date: $HDR_DATE"
        echo "- host: $HDR_HOST (kernel $HDR_KERNEL, host memory $HDR_HOSTMEM)"
        echo "- GPU: $HDR_GPU, $HDR_GPU_MEM; driver $HDR_DRIVER"
        echo "- gpusnap: $HDR_VERSION ($GPUSNAP)"
        echo "- torch: $torch"
        echo "- THP enabled: $HDR_THP"
        echo "- criu: ${CRIU_BIN:-none} ${CRIU_VERSION:+version $CRIU_VERSION}; criu check: ${CRIU_CHECK:-not run}${CRIU_CHECK_RC:+ (exit $CRIU_CHECK_RC)}"
        echo "- sections: $E2E_SECTIONS (CRIU sections: $([ "$CRIU_ON" = 1 ] && echo run || echo "not run${CRIU_WHY:+: $CRIU_WHY}"))"
        echo "- workers: big $BIG_GIB GiB, stuck $STUCK_GIB GiB, thr $SMALL_GIB GiB (+2 threads); hib $HIB_GIB GiB, rec $REC_GIB GiB"
        echo "- result: $NPASS passed, $NFAIL failed, $NSKIP skipped, $NINFO info; wall ${SECONDS} s (budget $E2E_BUDGET_S s)"
        echo
        rows_md "#" check expected got result figure
    } >"$md"
    cat "$md"
    HDR_DATE=$HDR_DATE HDR_HOST=$HDR_HOST HDR_KERNEL=$HDR_KERNEL HDR_GPU=$HDR_GPU HDR_GPU_MEM=$HDR_GPU_MEM \
        HDR_DRIVER=$HDR_DRIVER HDR_VERSION=$HDR_VERSION HDR_THP=$HDR_THP HDR_HOSTMEM=$HDR_HOSTMEM \
        E_TORCH=$torch E_CRIU=$CRIU_BIN E_CRIU_VERSION=$CRIU_VERSION E_CRIU_CHECK=$CRIU_CHECK \
        E_CRIU_CHECK_RC=$CRIU_CHECK_RC E_SECTIONS=$E2E_SECTIONS E_CRIU_ON=$CRIU_ON E_WALL=$SECONDS \
        E_BUDGET=$E2E_BUDGET_S E_COUNTS="$NPASS $NFAIL $NSKIP $NINFO" \
        python3 - "$ROWS" "$FIGS" "$OUT/gpu-e2e.json" <<'PY' || log "gpu-e2e.json not written"
import json, os, sys
rows_f, figs_f, out_f = sys.argv[1:4]
E = os.environ
rows = []
for line in open(rows_f):
    f = line.rstrip("\n").split("\t")
    if len(f) >= 6:
        rows.append(dict(zip(("id", "check", "expected", "got", "result", "figure"), f[:6])))
figs = {}
for line in open(figs_f):
    k, _, v = line.rstrip("\n").partition("\t")
    if v == "":
        figs[k] = None
        continue
    try:
        v = int(v)
    except ValueError:
        try:
            v = float(v)
        except ValueError:
            pass
    figs[k] = v
n = E.get("E_COUNTS", "0 0 0 0").split()
out = {"header": {k: E.get(k) for k in ("HDR_DATE", "HDR_HOST", "HDR_KERNEL", "HDR_GPU", "HDR_GPU_MEM",
                                        "HDR_DRIVER", "HDR_VERSION", "HDR_THP", "HDR_HOSTMEM")},
       "torch": E.get("E_TORCH"), "criu": {"bin": E.get("E_CRIU"), "version": E.get("E_CRIU_VERSION"),
                                            "check": E.get("E_CRIU_CHECK"), "check_rc": E.get("E_CRIU_CHECK_RC")},
       "sections": E.get("E_SECTIONS"), "criu_run": E.get("E_CRIU_ON") == "1",
       "wall_s": int(E.get("E_WALL", "0")), "budget_s": int(E.get("E_BUDGET", "0")),
       "passed": int(n[0]), "failed": int(n[1]), "skipped": int(n[2]), "info": int(n[3]),
       "rows": rows, "figures": figs}
json.dump(out, open(out_f, "w"), indent=1)
PY
}

# shellcheck disable=SC2317 # the EXIT trap
on_exit() {
    local rc=$? p m
    trap - ERR
    row_interrupted "$rc"
    cleanup_all
    row_all_gone ${WORKERS[@]+"${WORKERS[@]}"} ${FILLERS[@]+"${FILLERS[@]}"} ${HELPERS[@]+"${HELPERS[@]}"}
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

# p2_preflight: whether the CRIU sections run; records CRIU's version and check.
p2_preflight() {
    local sec want=""
    for sec in h r x k; do selected "$sec" && want="$want $sec"; done
    [ -n "$want" ] || return 0
    if [ "$E2E_CRIU" = no ]; then
        CRIU_WHY="E2E_CRIU=no"
        row p3 "CRIU sections (${want# })" "(information)" "not run: E2E_CRIU=no" INFO
        return 0
    fi
    if criu_probe; then
        CRIU_ON=1
        row p3 "criu usable (CRIU sections ${want# })" "found, version >= 4, criu check passes" \
            "$CRIU_BIN: version $CRIU_VERSION; criu check exit $CRIU_CHECK_RC: $CRIU_CHECK" PASS
    else
        row p3 "criu usable (CRIU sections ${want# })" "found, version >= 4, criu check passes" \
            "${CRIU_WHY}" INFO
    fi
    fig criu.version "$CRIU_VERSION"
    fig criu.check "$CRIU_CHECK_RC: $CRIU_CHECK"
    return 0
}

# p2_can ID SECTION: true if this CRIU section is selected and CRIU is usable;
# otherwise records why it is not run (SKIP when CRIU is missing).
p2_can() {
    selected "$1" || return 1
    [ "$E2E_CRIU" = no ] && return 1
    if [ "$CRIU_ON" != 1 ]; then
        row "$1" "$2" "criu usable" "skipped: ${CRIU_WHY:-criu unusable}" SKIP
        return 1
    fi
    return 0
}

start_workers() {
    local t0=$SECONDS got="" p1=0 p2=0 s
    for s in a b c d e; do selected "$s" && p1=1; done
    if [ "$CRIU_ON" = 1 ] && { selected h || selected r || selected x || selected k; }; then p2=1; fi
    # All start at once (torch's import and the allocation overlap); the CRIU
    # sections' workers simply run on through the driver sections.
    if [ "$p1" = 1 ]; then
        start_worker big "$BIG_GIB"
        WB=$LAST_PID
        start_worker stuck "$STUCK_GIB"
        WS=$LAST_PID
        start_worker thr "$SMALL_GIB" --threads 2
        WT=$LAST_PID
    fi
    if [ "$p2" = 1 ]; then
        if selected h; then start_worker hib "$HIB_GIB"; WH=$LAST_PID; fi
        if selected r || selected x; then start_worker rec "$REC_GIB"; WR=$LAST_PID; fi
        if selected k; then start_worker ext "$EXT_GIB"; WK=$LAST_PID; fi
    fi
    if [ "$p1" = 1 ]; then
        if wait_ready big "$WB" 240; then WB_OK=1; fi
        if wait_ready stuck "$WS" 60; then WS_OK=1; fi
        if wait_ready thr "$WT" 60; then WT_OK=1; fi
        got="big $([ $WB_OK = 1 ] && echo ok || echo failed), stuck $([ $WS_OK = 1 ] && echo ok || echo failed), thr $([ $WT_OK = 1 ] && echo ok || echo failed); nvidia-smi MiB: big $(smi_pid_mib "$WB"), stuck $(smi_pid_mib "$WS"), thr $(smi_pid_mib "$WT")"
        row w1 "workers start (pids $WB $WS $WT)" "all ready, checksum ok" "$got" \
            "$([ $WB_OK$WS_OK$WT_OK = 111 ] && echo PASS || echo FAIL)" "$((SECONDS - t0)) s"
    fi
    if [ "$p2" = 1 ]; then
        got="" s=PASS
        if [ -n "$WH" ]; then
            if wait_ready hib "$WH" 120; then WH_OK=1; got="hib ok"; else got="hib failed"; s=FAIL; fi
            got="$got ($(smi_pid_mib "$WH") MiB)"
        fi
        if [ -n "$WR" ]; then
            if wait_ready rec "$WR" 60; then WR_OK=1; got="$got, rec ok"; else got="$got, rec failed"; s=FAIL; fi
            got="$got ($(smi_pid_mib "$WR") MiB)"
        fi
        if [ -n "$WK" ]; then
            if wait_ready ext "$WK" 120; then WK_OK=1; got="$got, ext ok"; else got="$got, ext failed"; s=FAIL; fi
            got="$got ($(smi_pid_mib "$WK") MiB)"
        fi
        row w2 "CRIU workers start (pids ${WH:--} ${WR:--} ${WK:--})" "all ready, checksum ok" "${got#, }" "$s" "$((SECONDS - t0)) s"
    fi
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

# ---------------------------------------------------------------- CRIU

# gs_image_bytes NAME: the bytes `gpusnap images` lists for an image (runs gs).
gs_image_bytes() {
    gs 30 images
    jget "$GS_OUT" "next((i.get('bytes') for i in d['images'] if i.get('name') == '$1'), '')"
}

# disk_ok ID SECTION BYTES: true if the state dir's disk has 1.3 x BYTES
# free; otherwise a SKIP row.
disk_ok() {
    local free
    free=$(disk_free_bytes "$STATE_DIR")
    if fle "$(calc %.0f 'e * 1.3' e="$3")" "${free:-0}"; then return 0; fi
    row "$1" "$2" "free disk >= 1.3 x the image" \
        "$(gb "$free") GB free on $STATE_DIR; the image needs about $(gb "$3") GB" SKIP
    return 1
}

# stop_row ID NAME PID: `gpusnap stop` of a (restored) worker, as a row.
stop_row() {
    local got v
    alive "$3" || return 0
    gs 180 stop "$3"
    got="exit $GS_RC, suspended $(gs_result suspended), released_before_kill $(gs_result released_before_kill)"
    if wait_gone "$3" "$([ "$GS_RC" = 0 ] && echo 20 || echo 2)"; then got="$got, gone"; else got="$got, still alive"; fi
    v=FAIL; [[ $GS_RC == 0 && $got == *"suspended true, released_before_kill true, gone" ]] && v=PASS
    row "$1" "stop the $2 worker (pid $3)" "exit 0, suspended, released, pid gone" "$got${GS_MSG:+; $GS_MSG}" "$v" "${GS_S} s"
}

# (h) hibernate a PyTorch worker into an image (it leaves the GPU and the
# process table), then wake it: same pid, data intact, back on the GPU.
section_h() {
    local pid=$WH smi0 smi rss i0 got v img ib du cu tot sus dmp wr wroot wres vt wt ct rt ppid
    p2_can h "hibernate/wake" || return 0
    if [ "$WH_OK" != 1 ]; then row h "hibernate/wake" "hib worker" "hib worker did not start" SKIP; return 0; fi
    need 100 h "hibernate/wake" || return 0
    smi0=$(smi_pid_mib "$pid")
    rss=$(vmrss_mib "$pid")
    # The image is the process's host memory, which after the suspend holds
    # its device memory too.
    disk_ok h "hibernate/wake" "$(calc %.0f '(a + b) * 1048576' a="${smi0:-0}" b="${rss:-0}")" || return 0
    sleep 0.5
    read_status "$WORK/hib.status"
    i0=$ST_ITER

    gs 240 hibernate "$pid" --image e2e-h
    img=$(jget "$GS_OUT" 'd["image"]') ib=$(jget "$GS_OUT" 'd["image_bytes"]')
    cu=$(jget "$GS_OUT" "$pid in d['cuda']")
    tot=$(jget "$GS_OUT" 'd["total_ms"]') sus=$(jget "$GS_OUT" 'd["suspend_ms"]')
    dmp=$(jget "$GS_OUT" 'd["dump_ms"]') wr=$(jget "$GS_OUT" 'd["write_ms"]')
    fig h.device_mib "$smi0"
    fig h.rss_mib_before "$rss"
    fig h.hibernate_exit "$GS_RC"
    fig h.hibernate_wall_s "$GS_S"
    fig h.hibernate_total_ms "$tot"
    fig h.hibernate_suspend_ms "$sus"
    fig h.hibernate_dump_ms "$dmp"
    fig h.hibernate_write_ms "$wr"
    fig h.image_bytes "$ib"
    v=FAIL; [[ $GS_RC == 0 && $img == e2e-h && $cu == true ]] && v=PASS
    row h1 "hibernate the $HIB_GIB GiB worker (pid $pid, nvidia-smi $smi0 MiB)" "exit 0, image e2e-h, the pid among its CUDA processes" \
        "exit $GS_RC, image ${img:-?}, cuda: $(jget "$GS_OUT" 'd["cuda"]')${GS_MSG:+; $GS_MSG}" "$v" \
        "image $(gb "$ib") GB; ${GS_S} s wall; total $tot ms (suspend $sus, dump $dmp, write $wr)"
    if [ "$GS_RC" != 0 ]; then
        # A failed hibernate puts the tree back as it was (cleanup stops it).
        gs_state "$pid"
        log "after the failed hibernate: pid $pid alive $(alive "$pid" && echo yes || echo no), state ${S_STATE:-?}"
        return 0
    fi

    # The worker is this shell's child: collect it so that its pid comes free.
    reap "$pid"
    if wait_gone "$pid" 15; then got="gone"; else got="still there (state $(pstate "$pid"))"; fi
    wait_pid_free "$pid" 10 || got="$got, pid still held (state $(pstate "$pid"))"
    if wait_smi_unlisted "$pid" 5; then got="$got; nvidia-smi: not listed"; else got="$got; nvidia-smi: $(smi_pid_mib "$pid") MiB"; fi
    v=FAIL; [[ $got == "gone; nvidia-smi: not listed" ]] && v=PASS
    row h2 "after hibernate" "pid gone, nvidia-smi lists nothing for it" "$got; free $(smi_free_mib) MiB" "$v"

    v=$(gs_image_bytes e2e-h)
    du=$(du_bytes "$STATE_DIR/images/e2e-h")
    fig h.image_du_bytes "$du"
    got="exit $GS_RC, listed with ${v:-no} bytes; du -sb $du"
    # The checkpointed device memory is in the process's host memory, so in the image.
    cu=FAIL
    if [[ $GS_RC == 0 && -n $v && $v == "$ib" ]] && fle "$(calc %.0f 'm * 1048576 * 0.9' m="${smi0:-0}")" "$v"; then cu=PASS; fi
    row h3 "gpusnap images" "lists e2e-h, bytes = hibernate's, >= 90% of the device memory" "$got" "$cu" \
        "$(gb "$v") GB (device $(mib_gb "$smi0") GB, host RSS before $(mib_gb "$rss") GB)"

    gs 300 images verify e2e-h
    v=FAIL; [[ $GS_RC == 0 ]] && v=PASS
    fig h.verify_wall_s "$GS_S"
    row h4 "gpusnap images verify e2e-h" "exit 0" "exit $GS_RC${GS_MSG:+: $GS_MSG}" "$v" \
        "${GS_S} s = $(gbps "$ib" "$GS_S") GB/s"

    mark_restored "$pid"
    # shellcheck disable=SC2086 # E2E_WAKE_ARGS is a list of words
    gs 300 wake e2e-h --wait 30 $E2E_WAKE_ARGS
    wroot=$(jget "$GS_OUT" 'd["root_pid"]') wres=$(jget "$GS_OUT" "$pid in d['resumed']")
    tot=$(jget "$GS_OUT" 'd["total_ms"]') vt=$(jget "$GS_OUT" 'd["verify_ms"]') wt=$(jget "$GS_OUT" 'd["waited_ms"]')
    ct=$(jget "$GS_OUT" 'd["criu_ms"]') rt=$(jget "$GS_OUT" 'd["restore_ms"]')
    fig h.wake_exit "$GS_RC"
    fig h.wake_wall_s "$GS_S"
    fig h.wake_total_ms "$tot"
    fig h.wake_verify_ms "$vt"
    fig h.wake_waited_ms "$wt"
    fig h.wake_criu_ms "$ct"
    fig h.wake_restore_ms "$rt"
    v=FAIL; [[ $GS_RC == 0 && $wroot == "$pid" && $wres == true ]] && v=PASS
    row h5 "gpusnap wake e2e-h --wait 30${E2E_WAKE_ARGS:+ $E2E_WAKE_ARGS}" "exit 0, root pid $pid, resumed onto the GPU" \
        "exit $GS_RC, root pid ${wroot:-?}, resumed: $(jget "$GS_OUT" 'd["resumed"]')${GS_MSG:+; $GS_MSG}" "$v" \
        "${GS_S} s wall; total $tot ms (verify $vt, waited $wt, criu $ct, restore $rt)"
    if [ "$GS_RC" != 0 ]; then image_logs e2e-h; fi

    v=FAIL
    if alive "$pid"; then
        ppid=$(awk '{ print $4 }' "/proc/$pid/stat" 2>/dev/null)
        gs_state "$pid"
        smi=$(smi_pid_mib "$pid")
        got="alive (parent ${ppid:-?}, state $(pstate "$pid")), gpusnap state ${S_STATE:-?}, nvidia-smi ${smi:-not listed} MiB"
        if [[ $S_STATE == running && -n $smi ]] && close_to "$(calc %.0f 'm * 1048576' m="$smi")" "${smi0:-0}"; then v=PASS; fi
    else
        got="no process $pid"
    fi
    row h6 "the woken worker" "same pid alive, running, nvidia-smi lists about $smi0 MiB again" "$got" "$v"

    if ! alive "$pid"; then got="no process $pid"; elif wait_iter_gt hib "${i0:-0}" 30; then got="iteration $i0 -> $ST_ITER, ok=$ST_OK, status pid $ST_PID"; else got="no progress in 30 s (iteration ${ST_ITER:-?}, ok=${ST_OK:-?})"; fi
    v=FAIL; [[ $ST_ITER -gt ${i0:-0} && $ST_OK == 1 && $ST_PID == "$pid" ]] && v=PASS
    row h7 "work continues, data intact" "iteration advances from $i0, ok=1, same pid" "$got" "$v"

    got=$(run_helpers)
    row h8 "gpusnap processes left running by wake (its guard)" "(information)" "${got:-none}" INFO

    stop_row h9 woken "$pid"
    return 0
}

# (r) recovery from the real stuck state: a suspended worker is snapshotted,
# the raw driver strands it (restore -> 2 without memory, then 304), and
# `gpusnap resume` brings it back from the snapshot.
section_r() {
    local pid=$WR smi0 rss i_s st rcs got v ib lr rf tot rt wt ppid smi dmp wr t
    p2_can r "recovery from the stuck state" || return 0
    if [ "$WR_OK" != 1 ]; then row r "recovery from the stuck state" "rec worker" "rec worker did not start" SKIP; return 0; fi
    need 140 r "recovery from the stuck state" || return 0
    smi0=$(smi_pid_mib "$pid")
    rss=$(vmrss_mib "$pid")
    disk_ok r "recovery from the stuck state" "$(calc %.0f '(a + b) * 1048576' a="${smi0:-0}" b="${rss:-0}")" || return 0

    gs 120 suspend "$pid"
    st=$(gs_result state)
    v=FAIL; [[ $GS_RC == 0 && $st == checkpointed ]] && v=PASS
    row r1 "suspend the $REC_GIB GiB worker (pid $pid, nvidia-smi $smi0 MiB)" "exit 0, checkpointed" "exit $GS_RC, ${st:-?}${GS_MSG:+; $GS_MSG}" "$v" "${GS_S} s"
    [ "$st" = checkpointed ] || return 0
    sleep 1
    read_status "$WORK/rec.status"
    i_s=$ST_ITER

    gs 240 snapshot "$pid" --image e2e-snap
    ib=$(jget "$GS_OUT" 'd["image_bytes"]') lr=$(jget "$GS_OUT" 'd["left_running"]')
    tot=$(jget "$GS_OUT" 'd["total_ms"]') dmp=$(jget "$GS_OUT" 'd["dump_ms"]') wr=$(jget "$GS_OUT" 'd["write_ms"]')
    fig r.snapshot_exit "$GS_RC"
    fig r.snapshot_wall_s "$GS_S"
    fig r.snapshot_total_ms "$tot"
    fig r.snapshot_dump_ms "$dmp"
    fig r.snapshot_write_ms "$wr"
    fig r.image_bytes "$ib"
    got="exit $GS_RC, left_running ${lr:-?}${GS_MSG:+; $GS_MSG}"
    t=$GS_S
    gs_state "$pid"
    got="$got; pid $(alive "$pid" && echo alive || echo gone), state ${S_STATE:-?}"
    v=FAIL; [[ $got == "exit 0, left_running true; pid alive, state checkpointed" ]] && v=PASS
    row r2 "gpusnap snapshot of the suspended worker" "exit 0, image e2e-snap, the process stays, suspended" "$got" "$v" \
        "image $(gb "$ib") GB; $t s wall; total $tot ms (dump $dmp, write $wr)"
    # Without an image the rest would only strand the worker for good.
    [ "$v" = PASS ] || return 0

    if ! start_filler "$FILL_LEAVE_STUCK" 120; then
        row r3 "filler leaves $FILL_LEAVE_STUCK MiB" "ready" "filler failed" FAIL
        kill_fillers
        return 0
    fi
    mark_restored "$pid"
    raw 120 --keep-going "$pid" restore state
    rcs=$(raw_rcs) st=$(jget "$RAW_OUT" 'd["final_state"]')
    v=FAIL; [[ ${rcs%% *} == 2 && $st == checkpointed ]] && v=PASS
    row r3 "raw restore with $FILL_LEAVE_STUCK MiB free" "restore 2 (out of memory), get-state: checkpointed" \
        "$rcs, ${st:-?}; free $(smi_free_mib) MiB" "$v"
    kill_fillers
    wait_smi_free $((${smi0:-2048} + 1024)) 60 || log "memory did not come back within 60 s"
    raw 120 --keep-going "$pid" restore state
    rcs=$(raw_rcs) st=$(jget "$RAW_OUT" 'd["final_state"]')
    v=FAIL; [[ $rcs == "304 0" && $st == checkpointed ]] && v=PASS
    row r4 "raw restore again with memory free" "restore 304, get-state: checkpointed (stuck)" \
        "$rcs, ${st:-?}; free $(smi_free_mib) MiB" "$v"

    gs 180 resume --wait 30 "$pid"
    rf=$(gs_result recovered_from) st=$(gs_result state)
    tot=$(gs_result total_ms) rt=$(gs_result restore_ms) wt=$(gs_result waited_ms)
    fig r.resume_exit "$GS_RC"
    fig r.resume_wall_s "$GS_S"
    fig r.resume_total_ms "$tot"
    fig r.resume_restore_ms "$rt"
    fig r.resume_waited_ms "$wt"
    v=FAIL; [[ $GS_RC == 0 && $rf == e2e-snap && $st == running ]] && v=PASS
    row r5 "gpusnap resume --wait 30 of the stuck worker" "exit 0, recovered_from e2e-snap, running" \
        "exit $GS_RC, recovered_from ${rf:-none}, ${st:-?}${GS_MSG:+; $GS_MSG}" "$v" \
        "${GS_S} s wall; total $tot ms (restore $rt, waited $wt)"
    if [ "$GS_RC" != 0 ]; then image_logs e2e-snap; fi
    reap "$pid"

    v=FAIL
    if alive "$pid"; then
        ppid=$(awk '{ print $4 }' "/proc/$pid/stat" 2>/dev/null)
        gs_state "$pid"
        smi=$(smi_pid_mib "$pid")
        got="alive (parent ${ppid:-?}), gpusnap state ${S_STATE:-?}, unrecoverable ${S_UNREC:-?}, nvidia-smi ${smi:-not listed} MiB"
        if [[ $S_STATE == running && $S_UNREC == false && -n $smi ]] && close_to "$(calc %.0f 'm * 1048576' m="$smi")" "${smi0:-0}"; then v=PASS; fi
    else
        got="no process $pid"
    fi
    row r6 "the recovered worker" "same pid alive, running, recoverable, on the GPU again" "$got" "$v"

    if ! alive "$pid"; then got="no process $pid"; elif wait_iter_gt rec "${i_s:-0}" 30; then got="iteration $i_s -> $ST_ITER, ok=$ST_OK, status pid $ST_PID"; else got="no progress in 30 s (iteration ${ST_ITER:-?}, ok=${ST_OK:-?})"; fi
    v=FAIL; [[ $ST_ITER -gt ${i_s:-0} && $ST_OK == 1 && $ST_PID == "$pid" ]] && v=PASS
    row r7 "work continues from the snapshot, data intact" "iteration advances from $i_s, ok=1" "$got" "$v"

    got=$(timeout 30 "$GPUSNAP" recover --help 2>&1 </dev/null)
    v=$?
    got=$(printf '%s\n' "$got" | head -n 1 | cut -c1-160)
    row r8 "gpusnap recover exists" "recover --help: exit 0" "exit $v: $got" "$([ "$v" = 0 ] && echo PASS || echo FAIL)"
    return 0
}

# (x) bad input for the image commands.
section_x() {
    local src="" n dead got v f off
    p2_can x "bad input (images)" || return 0
    need 45 x "bad input (images)" || return 0

    gs 30 wake nope
    v=FAIL; [[ $GS_RC == 2 ]] && v=PASS
    row x1 "wake an image that does not exist" "exit 2" "exit $GS_RC: ${GS_MSG:-no message}" "$v"

    for n in e2e-snap e2e-h; do
        if [ -f "$STATE_DIR/images/$n/manifest.json" ]; then src=$n; break; fi
    done
    if [ -z "$src" ]; then
        row x2 "wake a corrupted image" "exit 2, checksum" "no image to copy (h and r left none)" SKIP
    elif disk_ok x2 "wake a corrupted image" "$(du_bytes "$STATE_DIR/images/$src")"; then
        rm -rf "$STATE_DIR/images/e2e-corrupt"
        cp -a "$STATE_DIR/images/$src" "$STATE_DIR/images/e2e-corrupt"
        # One byte flipped in the middle of the largest stored chunk of the
        # image's pages (the pages live in the chunk store, STATE/store/chunks,
        # shared with the image copied): same size, so only the chunk's
        # checksum can tell. Flipped back right after the wake.
        f="" off=""
        read -r f off < <(python3 - "$STATE_DIR" e2e-corrupt <<'PY'
import json, os, sys
state, name = sys.argv[1], sys.argv[2]
m = json.load(open(os.path.join(state, "images", name, "manifest.json")))
refs = [c for f in m["files"] for c in f.get("chunks", [])]
if refs:
    c = max(refs, key=lambda c: c["size"])
    p = os.path.join(state, "store", "chunks", c["blake3"][:2], c["blake3"])
    off = os.path.getsize(p) // 2
    with open(p, "r+b") as fh:
        fh.seek(off)
        b = fh.read(1)
        fh.seek(off)
        fh.write(bytes([b[0] ^ 0xFF]))
    print(p, off)
PY
) || true
        log "corrupted copy of $src: byte $off of chunk ${f:-none} flipped"
        # The check alone (the wake's own check streams beside the restore,
        # and the image's pid may still be held by the worker woken from it).
        gs 120 images verify e2e-corrupt
        vrc=$GS_RC vmsg=${GS_MSG:-no message} vbad=0
        grep -qiE 'checksum|corrupt' "$GS_ERR" && vbad=1
        gs 120 wake e2e-corrupt
        if [ -n "$off" ]; then
            python3 - "$f" "$off" <<'PY' || log "could not flip the chunk byte back"
import sys
p, off = sys.argv[1], int(sys.argv[2])
with open(p, "r+b") as fh:
    fh.seek(off)
    b = fh.read(1)
    fh.seek(off)
    fh.write(bytes([b[0] ^ 0xFF]))
PY
        fi
        got="verify: exit $vrc: $vmsg; wake: exit $GS_RC: ${GS_MSG:-no message}"
        v=FAIL; [[ $vrc == 2 && $vbad == 1 && -n $off && $GS_RC != 0 ]] && v=PASS
        if [ "$GS_RC" = 0 ]; then
            # Woken despite the damage: a restored process to end safely.
            n=$(jget "$GS_OUT" 'd["root_pid"]')
            if [ -n "$n" ]; then WORKERS+=("$n"); mark_restored "$n"; got="$got; pid $n restored"; fi
        fi
        row x2 "wake a corrupted copy of $src (byte $off of chunk ${f##*/} flipped)" "verify exit 2 naming the checksum; wake refused, nothing restored" "$got" "$v" "${GS_S} s"
        gs 60 images rm e2e-corrupt
    fi

    dead=999999
    while [ -e "/proc/$dead" ]; do dead=$((dead + 1)); done
    gs 30 hibernate "$dead"
    v=FAIL; [[ $GS_RC == 2 ]] && v=PASS
    row x3 "hibernate a pid that does not exist ($dead)" "exit 2" "exit $GS_RC: ${GS_MSG:-no message}" "$v"
    section_x_untrusted "$src"
    return 0
}

# Images as untrusted input and CRIU's first error.
# x5: an edited manifest (its signature no longer matches); x6: a `logs`
# link out of the image (wake wrote restore.log through it); x7: a dump
# with CRIU's plugin directory missing names CRIU's first error (not the
# detach error that follows it) and a log that still exists in STATE/logs.
section_x_untrusted() {
    local src=$1 d out got v pid wrap log
    if [ -n "$src" ] && disk_ok x5 "wake an edited image" "$(du_bytes "$STATE_DIR/images/$src")"; then
        d=$STATE_DIR/images/e2e-edited
        rm -rf "$d"
        cp -a "$STATE_DIR/images/$src" "$d"
        python3 - "$d/manifest.json" <<'PY'
import json, sys
p = sys.argv[1]
m = json.load(open(p))
m["files"] = []
json.dump(m, open(p, "w"), indent=2)
PY
        gs 120 wake e2e-edited
        got="exit $GS_RC: ${GS_MSG:-no message}"
        v=FAIL; [[ $GS_RC == 2 ]] && grep -qi signature "$GS_ERR" && v=PASS
        if [ "$GS_RC" = 0 ]; then
            pid=$(jget "$GS_OUT" 'd["root_pid"]')
            if [ -n "$pid" ]; then WORKERS+=("$pid"); mark_restored "$pid"; got="$got; pid $pid restored"; fi
        fi
        row x5 "wake a copy of $src with an edited manifest (files: [])" "exit 2, 'signature', nothing restored" "$got" "$v" "${GS_S} s"
        gs 60 images rm e2e-edited

        d=$STATE_DIR/images/e2e-linked
        out=$WORK/x6-outside
        rm -rf "$d" "$out"
        mkdir -p "$out"
        chmod 0755 "$out"
        cp -a "$STATE_DIR/images/$src" "$d"
        ln -s "$out" "$d/logs"
        gs 120 wake e2e-linked
        got="exit $GS_RC: ${GS_MSG:-no message}; $(find "$out" -mindepth 1 | wc -l) files in the link's target, mode $(stat -c %a "$out")"
        v=FAIL
        if [[ $GS_RC == 2 ]] && grep -qi 'symbolic link' "$GS_ERR" && [ -z "$(ls -A "$out")" ] && [ "$(stat -c %a "$out")" = 755 ]; then v=PASS; fi
        if [ "$GS_RC" = 0 ]; then
            pid=$(jget "$GS_OUT" 'd["root_pid"]')
            if [ -n "$pid" ]; then WORKERS+=("$pid"); mark_restored "$pid"; got="$got; pid $pid restored"; fi
        fi
        row x6 "wake a copy of $src with a 'logs' link out of it" "exit 2, 'symbolic link', nothing written or chmodded outside" "$got" "$v" "${GS_S} s"
        rm -f "$d/logs"
        gs 60 images rm e2e-linked
    else
        row x5 "wake an edited image" "exit 2, signature" "no image to copy" SKIP
    fi

    # A criu whose plugin directory does not exist: CRIU's first error is
    # "Unable to open directory", its last "Unable to detach".
    wrap=$WORK/criu-no-plugins
    cat >"$wrap" <<EOF_WRAP
#!/bin/sh
case "\$1" in
dump|restore) op=\$1; shift; exec "$CRIU_BIN" "\$op" -L "$WORK/no-such-plugin-dir" "\$@" ;;
*) exec "$CRIU_BIN" "\$@" ;;
esac
EOF_WRAP
    chmod 0755 "$wrap"
    setsid sleep 600 </dev/null >/dev/null 2>&1 &
    pid=$!
    gs 120 --criu "$wrap" hibernate "$pid" --image e2e-noplugins
    log=$(sed -n 's/.*(log: \([^)]*\)).*/\1/p' "$GS_ERR" | head -n 1)
    got="exit $GS_RC: ${GS_MSG:-no message}; log ${log:-not named}$([ -n "$log" ] && [ -s "$log" ] && echo ' exists')"
    v=FAIL
    if [[ $GS_RC == 1 ]] && grep -q 'Unable to open directory' "$GS_ERR" && [[ $log == "$STATE_DIR"/logs/* ]] && [ -s "$log" ] && alive "$pid"; then v=PASS; fi
    row x7 "hibernate with CRIU's plugin directory missing" "exit 1, CRIU's first error (Unable to open directory), the log in STATE/logs exists, the process runs on" "$got" "$v" "${GS_S} s"
    kill "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
    return 0
}

# start_time PID: field 22 of /proc/PID/stat.
start_time() { sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | awk '{ print $20 }'; }

# plain_criu ID CHECK LOG ARGS...: criu ARGS (as gpusnap would run it, less
# --shell-job: the worker is a session leader), as a row; sets CR_RC.
plain_criu() {
    local id=$1 what=$2 log=$3 t0 t1 s err
    shift 3
    t0=$(now)
    CR_RC=0
    timeout -k 10 300 "$CRIU_BIN" "$@" -v4 --log-file "$log" --file-locks --ext-unix-sk --tcp-established \
        </dev/null >>"$WORK/criu-k.out" 2>&1 || CR_RC=$?
    t1=$(now)
    s=$(fsub "$t0" "$t1")
    # The rlimit line is in every log of an unprivileged-ish root (docs/design/driver.md): not a cause.
    err=""
    if [ "$CR_RC" != 0 ]; then err=$(grep 'Error' "$log" 2>/dev/null | grep -v RLIMIT_NOFILE | head -n 1 | cut -c1-200); fi
    row "$id" "$what" "exit 0" "exit $CR_RC${err:+; first Error line: $err}" "$([ "$CR_RC" = 0 ] && echo PASS || echo FAIL)" "$s s"
    if [ "$CR_RC" != 0 ] && [ -s "$log" ]; then log_file "criu log (last lines)" <(tail -n 30 "$log"); fi
}

# (k) a worker suspended by gpusnap, then dumped and restored by plain criu
# (outside gpusnap, as container runtimes do): same pid, new start time.
# gpusnap must recognise it (state, its recorded footprint) and `resume`
# with no flags must bring it back with its data.
section_k() {
    local pid=$WK fp st0 st1 got v i0 img=$WORK/k-image
    p2_can k "criu outside gpusnap" || return 0
    if [ "$WK_OK" != 1 ]; then row k "criu outside gpusnap" "ext worker" "ext worker did not start" SKIP; return 0; fi
    need 90 k "criu outside gpusnap" || return 0
    gs 120 suspend "$pid"
    fp=$(gs_result footprint_bytes)
    v=FAIL; [[ $GS_RC == 0 && $(gs_result state) == checkpointed ]] && v=PASS
    row k1 "gpusnap suspend of the $EXT_GIB GiB worker (pid $pid)" "exit 0, checkpointed" \
        "exit $GS_RC, $(gs_result state), footprint $(gb "$fp") GB${GS_MSG:+; $GS_MSG}" "$v" "${GS_S} s"
    [ "$v" = PASS ] || return 0
    sleep 0.5
    read_status "$WORK/ext.status"
    i0=$ST_ITER
    st0=$(start_time "$pid")
    rm -rf "$img" && mkdir -p "$img"
    mark_restored "$pid"
    plain_criu k2 "plain criu dump --tree $pid (criu ends the worker)" "$img/dump.log" \
        dump --tree "$pid" --images-dir "$img"
    reap "$pid"
    [ "$CR_RC" = 0 ] || return 0
    wait_pid_free "$pid" 60 || log "pid $pid still held after the dump"
    plain_criu k3 "plain criu restore --restore-detached" "$img/restore.log" \
        restore --restore-detached --images-dir "$img"
    [ "$CR_RC" = 0 ] || return 0
    st1=$(start_time "$pid")
    gs_state "$pid"
    v=FAIL; [[ $GS_RC == 0 && $S_STATE == checkpointed && $S_FP == "$fp" && -n $st1 && $st1 != "$st0" ]] && v=PASS
    row k4 "gpusnap state of the restored worker" "exit 0, checkpointed, footprint as recorded at suspend, new start time" \
        "exit $GS_RC, ${S_STATE:-?}, footprint $(gb "$S_FP") GB (recorded $(gb "$fp") GB), start time $st0 -> ${st1:-gone}${GS_MSG:+; $GS_MSG}" "$v"

    gs 180 resume "$pid"
    v=FAIL; [[ $GS_RC == 0 && $(gs_result state) == running ]] && v=PASS
    row k5 "gpusnap resume PID (no flags)" "exit 0, running (admitted with the recorded footprint)" \
        "exit $GS_RC, $(gs_result state), footprint $(gb "$(gs_result footprint_bytes)") GB${GS_MSG:+; $GS_MSG}" "$v" "${GS_S} s"
    if ! alive "$pid"; then got="no process $pid"; elif wait_iter_gt ext "${i0:-0}" 30; then got="iteration $i0 -> $ST_ITER, ok=$ST_OK, status pid $ST_PID"; else got="no progress in 30 s (iteration ${ST_ITER:-?}, ok=${ST_OK:-?})"; fi
    v=FAIL; [[ $ST_ITER -gt ${i0:-0} && $ST_OK == 1 && $ST_PID == "$pid" ]] && v=PASS
    row k6 "work continues, data intact" "iteration advances from $i0, ok=1, same pid" "$got" "$v"
    gs 30 history "$pid"
    got=$(jget "$GS_OUT" 'next((e["detail"] for e in d["events"] if e["op"] == "adopt"), "")' 2>/dev/null)
    row k7 "gpusnap history PID" "an adopt entry (the record moved to the new start time)" "${got:-none}" "$([ -n "$got" ] && echo PASS || echo FAIL)"
    stop_row k8 "criu-restored" "$pid"
    rm -rf "$img"
    return 0
}

# p2_end: the recovered worker is stopped through gpusnap; the images go.
p2_end() {
    local n=0 d b
    [ "$CRIU_ON" = 1 ] || return 0
    if [ -n "$WR" ]; then stop_row r9 recovered "$WR"; fi
    for d in "$STATE_DIR"/images/*/; do [ -d "$d" ] && n=$((n + 1)); done
    [ "$n" -gt 0 ] || return 0
    b=$(du_bytes "$STATE_DIR/images")
    images_clear
    d=$(find "$STATE_DIR/images" -mindepth 1 -maxdepth 1 2>/dev/null | wc -l)
    row x4 "remove the images" "none left" "$n removed ($(gb "$b") GB); $d entries left" "$([ "$d" = 0 ] && echo PASS || echo FAIL)"
}

# ---------------------------------------------------------------- main

install_traps
start_watchdog $((E2E_BUDGET_S + 60))
log "gpusnap GPU e2e: budget ${E2E_BUDGET_S}s"
collect_header
if preflight; then
    p2_preflight
    start_workers
    if selected a; then section_a; fi
    if selected b; then section_b; fi
    kill_fillers
    if selected c; then section_c; fi
    kill_fillers
    if selected d; then section_d; fi
    if selected e; then section_e; fi
    section_h
    section_r
    kill_fillers
    section_x
    section_k
    p2_end
fi
FINISHED=1
exit 0   # on_exit writes the table and sets the exit status
