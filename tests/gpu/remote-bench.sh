#!/usr/bin/env bash
# Images anywhere (P8) on one GPU: two replicas of one worker (the same
# device data, as two servers of one model) hibernated, pushed to a remote,
# their local images removed, each woken from the remote; against a wake from
# the local image. Stored bytes, dedup ratio, push and wake times.
#
# Run from the repository root, on a machine with a GPU and CRIU >= 4.2, as root:
#   OUT=/some/dir tests/gpu/remote-bench.sh [SIZE_GIB]   (default: $RBENCH_SIZE, else 4)
# Environment:
#   GPUSNAP         the binary (default ./target/release/gpusnap)
#   REMOTE_URL      where to push (default file://$WORK/remote; an s3://BUCKET/PREFIX
#                   takes AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION,
#                   AWS_ENDPOINT_URL, AWS_ALLOW_HTTP=true for a local http server)
#   RBENCH_BUDGET_S soft budget in seconds (default 480); a watchdog ends the
#                   run, through the cleanup, 45 s after it
# Writes $OUT/bench-remote.md (also on stdout) and $OUT/bench-remote.log.
# Exit 0 when every row passed.

NAME=bench-remote # read by lib.sh
# shellcheck source=tests/gpu/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

SIZE=${1:-${RBENCH_SIZE:-4}}
case $SIZE in '' | *[!0-9.]* | *.*.* | .*) echo "usage: tests/gpu/remote-bench.sh [SIZE_GIB]" >&2; exit 2 ;; esac
RBENCH_BUDGET_S=${RBENCH_BUDGET_S:-480}
REMOTE=${REMOTE_URL:-file://$WORK/remote}
ROWS=$WORK/rows.tsv
: >"$ROWS"
NPASS=0 NFAIL=0 NSKIP=0 NINFO=0

# jn FILE EXPR: a field of gpusnap's JSON output (python expression over d).
jn() { jget "$1" "$2" 2>/dev/null || printf '?'; }

# worker_on NAME PID: the worker is back, advancing, checksum ok.
worker_on() {
    alive "$2" && wait_iter_gt "$1" "${3:-0}" 60 && [ "$ST_OK" = 1 ] && [ "$ST_PID" = "$2" ]
}

# shellcheck disable=SC2317 # runs from the EXIT trap
report() {
    {
        echo "# gpusnap images anywhere: push, pull, wake from a remote"
        echo
        echo "date $HDR_DATE, host $HDR_HOST, GPU $HDR_GPU, driver $HDR_DRIVER, gpusnap $HDR_VERSION"
        echo "worker $SIZE GiB x 2 replicas, remote $REMOTE"
        echo
        echo "| id | check | expected | got | result | figure |"
        echo "|---|---|---|---|---|---|"
        while IFS=$'\t' read -r a b c d e f; do
            echo "| $a | $b | $c | $d | $e | $f |"
        done <"$ROWS"
        echo
        echo "$NPASS passed, $NFAIL failed, $NSKIP skipped, $NINFO info"
    } | tee "$OUT/bench-remote.md"
}

# shellcheck disable=SC2317 # runs from the EXIT trap
on_exit() {
    local rc=$?
    cleanup_all
    report
    if [ "$NFAIL" -gt 0 ] || [ "$rc" -ne 0 ]; then exit 1; fi
    exit 0
}

install_traps
start_watchdog $((RBENCH_BUDGET_S + 45))
collect_header

# Both replicas hold the same data (worker.py fills it deterministically).
pids=()
for r in a b; do
    start_worker "$r" "$SIZE"
    wait_ready "$r" "$LAST_PID" 180 || { row R0 "replica $r starts" ready "not ready" FAIL; exit 1; }
    pids+=("$LAST_PID")
done

# A local wake of replica a first: the time a remote wake is compared with.
gs 300 hibernate "${pids[0]}" --image local
row R1 "hibernate replica a (local image)" "exit 0" "exit $GS_RC" "$([ "$GS_RC" = 0 ] && echo PASS || echo FAIL)" "${GS_S}s"
wait_pid_free "${pids[0]}" 60 || true
gs 300 wake local --wait 30 --no-guard
LOCAL_WAKE_S=$GS_S
ok=FAIL
if [ "$GS_RC" = 0 ] && worker_on a "${pids[0]}" 0; then ok=PASS; fi
row R2 "wake from the local image" "exit 0, worker on" "exit $GS_RC" "$ok" "${GS_S}s"
gs 60 images rm local

for i in 0 1; do
    r=$([ "$i" = 0 ] && echo a || echo b)
    gs 300 hibernate "${pids[$i]}" --image "rep-$r"
    row "R3$r" "hibernate replica $r" "exit 0" "exit $GS_RC" "$([ "$GS_RC" = 0 ] && echo PASS || echo FAIL)" "${GS_S}s"
    wait_pid_free "${pids[$i]}" 60 || true
done
IMG_BYTES=$(du_bytes "$STATE_DIR/images/rep-a")
for r in a b; do
    gs 480 images push "rep-$r" "$REMOTE"
    sent=$(jn "$GS_OUT" 'd["bytes_sent"]')
    dedup=$(jn "$GS_OUT" 'd["bytes_deduplicated"]')
    row "R4$r" "push replica $r" "exit 0" "exit $GS_RC; sent $(gb "$sent") GB, deduplicated $(gb "$dedup") GB" \
        "$([ "$GS_RC" = 0 ] && echo PASS || echo FAIL)" "${GS_S}s, $(gbps "$sent" "$GS_S") GB/s sent"
done
if [ "${REMOTE#file://}" != "$REMOTE" ]; then
    STORED=$(du_bytes "${REMOTE#file://}/chunks")
    ratio=$(calc %.3f 's / i' s="${STORED:-0}" i="${IMG_BYTES:-1}")
    row R5 "remote holds both for less than 1.3 x one image" "< 1.3" "$ratio" \
        "$(fle "$ratio" 1.3 && echo PASS || echo FAIL)" "stored $(gb "$STORED") GB, one image $(gb "$IMG_BYTES") GB"
else
    row R5 "remote stored bytes" "-" "not measured on s3 (list the bucket)" INFO
fi
gs 60 images rm rep-a
gs 60 images rm rep-b
gs 120 images gc
for i in 0 1; do
    r=$([ "$i" = 0 ] && echo a || echo b)
    gs 480 wake "$REMOTE/rep-$r" --wait 30 --no-guard
    ok=FAIL
    if [ "$GS_RC" = 0 ] && worker_on "$r" "${pids[$i]}" 0; then ok=PASS; fi
    row "R6$r" "wake replica $r from the remote" "exit 0, worker on, checksum ok" "exit $GS_RC" "$ok" \
        "${GS_S}s (local wake ${LOCAL_WAKE_S}s)"
done
exit 0
