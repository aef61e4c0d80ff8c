#!/usr/bin/env bash
# GPU check of the keeper of a lazy wake (docs/design/wake.md, Safety): a PyTorch
# worker is hibernated, then woken lazily with the page server slowed, and
# `gpusnap wake` is killed with SIGKILL in the middle of the fill (the
# driver's restore waiting on pages). The keeper must fill every page; the
# worker, once gpusnap brings it back (state, then resume when it is not
# running), must compute on intact data (ok=1, iteration advancing).
#
# Run from the repository root, on a machine with a GPU and CRIU, as root:
#   OUT=/some/dir tests/gpu/keeper-e2e.sh
# Environment:
#   GPUSNAP           the binary (default ./target/release/gpusnap)
#   KEEPER_GIB        worker size (default 2: about 6.6 GB of device memory)
#   KEEPER_SLOW_US    sleep before each 1 MiB the wake's page server reads
#                     (default 3000, with 2 fill threads: ~10 s of fill for
#                     6.6 GB; not passed on to the keeper, which runs at full speed)
#   KEEPER_KILL_S     seconds after the keeper appears before the kill (default 3)
#   KEEPER_BUDGET_S   soft budget (default 240); a watchdog ends the run 60 s after
# Writes $OUT/keeper-e2e.md (the table, also printed) and $OUT/keeper-e2e.log.
# Exit 0 when every check passed.

NAME=keeper-e2e # read by lib.sh
# shellcheck source=tests/gpu/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

KEEPER_GIB=${KEEPER_GIB:-2}
KEEPER_SLOW_US=${KEEPER_SLOW_US:-3000}
KEEPER_KILL_S=${KEEPER_KILL_S:-3}
KEEPER_BUDGET_S=${KEEPER_BUDGET_S:-240}
ROWS=$WORK/rows.tsv
: >"$ROWS"
NPASS=0 NFAIL=0 NSKIP=0 NINFO=0
FINISHED=0

# keeper_pids: running keepers of this run (their command line names a work
# dir under this run's state dir).
keeper_pids() {
    local p
    for p in $(pgrep -f -- "__pages-keeper $STATE_DIR" 2>/dev/null); do
        case $(pstate "$p") in Z | X | "") ;; *) echo "$p" ;; esac
    done
}

# shellcheck disable=SC2317 # runs from the EXIT trap
write_table() {
    local md=$OUT/keeper-e2e.md
    {
        echo "# gpusnap: the keeper of a lazy wake, gpusnap killed mid-wake"
        echo
        echo "- date: $HDR_DATE"
        echo "- host: $HDR_HOST (kernel $HDR_KERNEL); GPU: $HDR_GPU, driver $HDR_DRIVER"
        echo "- gpusnap: $HDR_VERSION ($GPUSNAP)"
        echo "- worker $KEEPER_GIB GiB; wake slowed by GPUSNAP_PAGES_SLOW_US=$KEEPER_SLOW_US, 2 fill threads; killed ${KEEPER_KILL_S} s after its keeper appeared"
        echo "- result: $NPASS passed, $NFAIL failed, $NSKIP skipped, $NINFO info; wall ${SECONDS} s"
        echo
        rows_md "#" check expected got result figure
    } >"$md"
    cat "$md"
}

# shellcheck disable=SC2317 # the EXIT trap
on_exit() {
    local rc=$?
    trap - ERR
    rows_end "$rc"
    write_table
    rows_exit
}

main() {
    local pid i0 wake t0 k got v st log
    start_worker kw "$KEEPER_GIB"
    pid=$LAST_PID
    if ! wait_ready kw "$pid" 240; then
        row k0 "worker starts" "ready, checksum ok" "not ready" FAIL
        return 0
    fi
    read_status "$WORK/kw.status"
    i0=$ST_ITER
    gs 300 hibernate "$pid" --image keeper-k
    v=FAIL; [ "$GS_RC" = 0 ] && v=PASS
    row k1 "hibernate the $KEEPER_GIB GiB worker (pid $pid)" "exit 0" "exit $GS_RC${GS_MSG:+: $GS_MSG}" "$v" "${GS_S} s"
    [ "$GS_RC" = 0 ] || return 0
    reap "$pid"
    wait_gone "$pid" 15 || true
    wait_pid_free "$pid" 10 || true

    # The wake, slowed, in the background; killed mid-fill.
    mark_restored "$pid"
    t0=$(now)
    GPUSNAP_PAGES_SLOW_US=$KEEPER_SLOW_US GPUSNAP_PAGES_THREADS=2 \
        "$GPUSNAP" --json --state-dir "$STATE_DIR" wake keeper-k --wait 30 --no-guard \
        </dev/null >"$WORK/wake.out" 2>"$WORK/wake.err" &
    wake=$!
    log "wake: pid $wake"
    k=""
    for _ in $(seq 1 600); do
        k=$(keeper_pids | head -n 1)
        [ -n "$k" ] && break
        alive "$wake" || break
        sleep 0.1
    done
    sleep "$KEEPER_KILL_S"
    if [ -z "$k" ] || ! alive "$wake"; then
        wait "$wake" 2>/dev/null
        row k2 "gpusnap wake killed mid-fill" "the wake still runs, its keeper too" \
            "keeper ${k:-never seen}; wake ended first: $(tail -n 2 "$WORK/wake.err" | tr '\n' ' ')" SKIP \
            "raise KEEPER_SLOW_US"
        return 0
    fi
    kill -KILL "$wake"
    wait "$wake" 2>/dev/null
    row k2 "gpusnap wake (pid $wake) killed with SIGKILL mid-fill" "keeper running" \
        "killed after $(fsub "$t0" "$(now)") s; keeper pid $k" PASS
    log_file "wake stderr" "$WORK/wake.err"

    got="still running after 300 s"
    for _ in $(seq 1 3000); do
        if ! keeper_pids | grep -qx "$k"; then got="exited"; break; fi
        sleep 0.1
    done
    log=$(cat "$STATE_DIR"/logs/*/keeper.log 2>/dev/null)
    log "keeper logs: $(printf '%s' "$log" | tr '\n' '|')"
    v=FAIL
    if [ "$got" = exited ] && printf '%s' "$log" | grep -q 'every page in place'; then v=PASS; fi
    row k3 "the keeper fills what is missing and exits" "exited, 'every page in place'" \
        "$got; $(printf '%s' "$log" | grep -o 'every page in place: [0-9]* bytes[^;]*' | head -n 1)" "$v" \
        "$(fsub "$t0" "$(now)") s from the wake's start"

    gs 30 state "$pid"
    st=$(jget "$GS_OUT" 'd["state"]')
    row k4 "gpusnap state $pid after the keeper" "(information: the driver's restore was interrupted)" \
        "exit $GS_RC, state ${st:-?}${GS_MSG:+; $GS_MSG}" INFO
    if alive "$pid" && [ "$st" != running ]; then
        gs 120 resume "$pid"
        row k5 "gpusnap resume $pid" "(information)" "exit $GS_RC${GS_MSG:+: $GS_MSG}" INFO "${GS_S} s"
    fi
    if ! alive "$pid"; then
        got="no process $pid"
    elif wait_iter_gt kw "${i0:-0}" 60; then
        got="iteration $i0 -> $ST_ITER, ok=$ST_OK"
    else
        got="no progress in 60 s (iteration ${ST_ITER:-?}, ok=${ST_OK:-?})"
    fi
    v=FAIL; [[ ${ST_ITER:-0} -gt ${i0:-0} && $ST_OK == 1 ]] && v=PASS
    row k6 "the worker computes on intact data" "iteration advances from $i0, ok=1" "$got" "$v"
    return 0
}

install_traps
start_watchdog $((KEEPER_BUDGET_S + 60))
log "gpusnap keeper e2e: budget ${KEEPER_BUDGET_S}s"
collect_header
main
FINISHED=1
exit 0 # on_exit writes the table and sets the exit status
