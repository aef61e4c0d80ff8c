#!/usr/bin/env bash
# Images anywhere on one GPU: two replicas of one model server (the same
# seed: the same weights) hibernated (their pages stored once, as chunks, in
# the local store), pushed to a remote, their local images removed and the
# store emptied, each woken from the remote (its pages streamed); against a
# wake from the local image. Stored bytes, dedup ratio, push and wake times;
# every answer after a wake checked against the replica's answer before.
#
# Run from the repository root, on a machine with a GPU and CRIU >= 4.2, as root:
#   OUT=/some/dir bench/gpu/remote.sh [SIZE_GIB]   (default: $RBENCH_SIZE, else 4)
# Environment:
#   GPUSNAP         the binary (default ./target/release/gpusnap)
#   RBENCH_SERVER   model (default): tests/gpu/model_server.py, RBENCH_WEIGHTS_GB
#                   (default 6) of seeded random weights + RBENCH_KV_GB (default 2)
#                   of KV cache, greedy answers; worker: tests/gpu/worker.py of
#                   SIZE_GIB; fake: a dry run without a GPU, FAKE_WORKLOAD --http
#                   against the fakes (LD_LIBRARY_PATH, GPUSNAP_FAKE_DIR; docs/design/fakes.md)
#   REMOTE_URL      where to push (default file://$WORK/remote; an s3://BUCKET/PREFIX
#                   takes AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION,
#                   AWS_ENDPOINT_URL, AWS_ALLOW_HTTP=true for a local http server)
#   RBENCH_S3=1     push to an S3 server started on this machine (loopback):
#                   moto from RBENCH_WHEELS (a directory of cp312 wheels, extracted
#                   with python's zipfile: no pip, no internet; make it with
#                   `pip download --only-binary=:all: --python-version 3.12
#                   --platform manylinux2014_x86_64 'moto[server]' -d DIR`, the
#                   S3 part: moto boto3 botocore s3transfer jmespath python_dateutil
#                   six urllib3 werkzeug flask flask_cors jinja2 markupsafe
#                   itsdangerous click blinker xmltodict responses requests certifi
#                   idna charset_normalizer cryptography cffi pycparser pyyaml, ~31 MB),
#                   else moto_server on PATH; REMOTE_URL is then s3://gpusnap-bench/replicas
#   RBENCH_BUDGET_S soft budget in seconds (default 480); a watchdog ends the
#                   run, through the cleanup, 45 s after it
# Writes $OUT/bench-remote.md (also on stdout) and $OUT/bench-remote.log.
# Exit 0 when every row passed.

NAME=bench-remote # read by lib.sh
# shellcheck source=tests/gpu/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/../../tests/gpu/lib.sh"

SIZE=${1:-${RBENCH_SIZE:-4}}
case $SIZE in '' | *[!0-9.]* | *.*.* | .*) echo "usage: bench/gpu/remote.sh [SIZE_GIB]" >&2; exit 2 ;; esac
RBENCH_BUDGET_S=${RBENCH_BUDGET_S:-480}
REMOTE=${REMOTE_URL:-file://$WORK/remote}
ROWS=$WORK/rows.tsv
: >"$ROWS"
NPASS=0 NFAIL=0 NSKIP=0 NINFO=0

SERVER=${RBENCH_SERVER:-model}
WEIGHTS_GB=${RBENCH_WEIGHTS_GB:-6}
KV_GB=${RBENCH_KV_GB:-2}
PROMPT="the+quick+brown+fox+jumps+over+the+lazy+dog"
declare -A PORT REF

# jn FILE EXPR: a field of gpusnap's JSON output (python expression over d).
jn() { jget "$1" "$2" 2>/dev/null || printf '?'; }

# worker_on NAME PID: the worker is back, advancing, checksum ok.
worker_on() {
    alive "$2" && wait_iter_gt "$1" "${3:-0}" 60 && [ "$ST_OK" = 1 ] && [ "$ST_PID" = "$2" ]
}

# answer NAME: the replica's answer to the prompt (greedy: the same model
# gives the same tokens).
answer() {
    curl -s -m 300 "http://127.0.0.1:${PORT[$1]}/generate?prompt=$PROMPT&n=16" 2>>"$LOG"
}

# start_replica NAME INDEX: sets LAST_PID once it serves (or its worker is ready).
start_replica() {
    local name=$1 port=$((18530 + $2)) end
    if [ "$SERVER" = worker ]; then
        start_worker "$name" "$SIZE"
        wait_ready "$name" "$LAST_PID" 180
        return
    fi
    PORT[$name]=$port
    : >"$WORK/$name.log"
    if [ "$SERVER" = fake ]; then
        "${FAKE_WORKLOAD:?set FAKE_WORKLOAD for RBENCH_SERVER=fake}" --mib "$(calc %d 's * 1024' s="$SIZE")" --http "$port" \
            </dev/null >>"$WORK/$name.log" 2>&1 &
    else
        python3 "$GPU_DIR/model_server.py" --port "$port" --seed 7 --weights-gb "$WEIGHTS_GB" --kv-gb "$KV_GB" \
            </dev/null >>"$WORK/$name.log" 2>&1 &
    fi
    LAST_PID=$!
    WORKERS+=("$LAST_PID")
    end=$((SECONDS + 300))
    while [ "$SECONDS" -lt "$end" ] && alive "$LAST_PID"; do
        if curl -s -m 5 -o /dev/null "http://127.0.0.1:$port/health" 2>/dev/null; then
            REF[$name]=$(answer "$name")
            log "replica $name: pid $LAST_PID, answer ${REF[$name]}"
            [ -n "${REF[$name]}" ]
            return
        fi
        sleep 0.5
    done
    log_file "$name log" "$WORK/$name.log"
    return 1
}

# replica_on NAME PID: back, and (a server) answering as before the hibernate.
replica_on() {
    if [ "$SERVER" = worker ]; then
        worker_on "$1" "$2" 0
        return
    fi
    local got
    alive "$2" || return 1
    got=$(answer "$1")
    log "replica $1 answers: $got"
    [ -n "$got" ] && [ "$got" = "${REF[$1]}" ]
}

# start_s3: an S3 server on loopback for the remote (see RBENCH_S3).
S3_PID=""
start_s3() {
    local port=18599 end
    if [ -n "${RBENCH_WHEELS:-}" ]; then
        mkdir -p "$WORK/s3lib"
        for w in "$RBENCH_WHEELS"/*.whl; do
            python3 -m zipfile -e "$w" "$WORK/s3lib" >>"$LOG" 2>&1 || return 1
        done
        PYTHONPATH=$WORK/s3lib python3 -m moto.server -H 127.0.0.1 -p "$port" </dev/null >>"$WORK/s3.log" 2>&1 &
    else
        command -v moto_server >/dev/null || return 1
        moto_server -H 127.0.0.1 -p "$port" </dev/null >>"$WORK/s3.log" 2>&1 &
    fi
    S3_PID=$!
    end=$((SECONDS + 60))
    until curl -s -m 2 -o /dev/null "http://127.0.0.1:$port/"; do
        if [ "$SECONDS" -ge "$end" ] || ! alive "$S3_PID"; then
            log_file "s3 log" "$WORK/s3.log"
            return 1
        fi
        sleep 0.3
    done
    curl -s -m 10 -X PUT "http://127.0.0.1:$port/gpusnap-bench" >>"$LOG" 2>&1 || return 1
    export AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing AWS_REGION=us-east-1
    export AWS_ENDPOINT_URL=http://127.0.0.1:$port AWS_ALLOW_HTTP=true
    REMOTE=s3://gpusnap-bench/replicas
    log "S3 server (moto) pid $S3_PID on 127.0.0.1:$port"
}

# image_bytes NAME: the bytes of an image's files (its pages in the store).
image_bytes() { "$GPUSNAP" --json --state-dir "$STATE_DIR" images verify "$1" 2>>"$LOG" | python3 -c 'import json,sys; print(sum(f["size"] for f in json.load(sys.stdin)["files"]))' 2>/dev/null; }

# shellcheck disable=SC2317 # runs from the EXIT trap
report() {
    {
        echo "# gpusnap images anywhere: push, pull, wake from a remote"
        echo
        echo "date $HDR_DATE, host $HDR_HOST, GPU $HDR_GPU, driver $HDR_DRIVER, gpusnap $HDR_VERSION"
        if [ "$SERVER" = model ]; then
            echo "model server ($WEIGHTS_GB GB weights + $KV_GB GB KV cache) x 2 replicas (same seed), remote $REMOTE"
        else
            echo "$SERVER $SIZE GiB x 2 replicas, remote $REMOTE"
        fi
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
    if [ -n "$S3_PID" ]; then kill "$S3_PID" 2>/dev/null || true; fi
    report
    if [ "$NFAIL" -gt 0 ] || [ "$rc" -ne 0 ]; then exit 1; fi
    exit 0
}

install_traps
start_watchdog $((RBENCH_BUDGET_S + 45))
collect_header
if [ "${RBENCH_S3:-0}" = 1 ]; then
    start_s3 || { row R0 "an S3 server starts on loopback" running "not running" FAIL; exit 1; }
fi

# Both replicas hold the same data (the same seed, or worker.py's fill).
pids=()
i=0
for r in a b; do
    start_replica "$r" "$i" || { row R0 "replica $r starts" ready "not ready" FAIL; exit 1; }
    pids+=("$LAST_PID")
    i=$((i + 1))
done

# A local wake of replica a first: the time a remote wake is compared with.
gs 300 hibernate "${pids[0]}" --image local
row R1 "hibernate replica a (local image)" "exit 0" "exit $GS_RC" "$([ "$GS_RC" = 0 ] && echo PASS || echo FAIL)" "${GS_S}s"
wait_pid_free "${pids[0]}" 60 || true
gs 300 wake local --wait 30 --no-guard
LOCAL_WAKE_S=$GS_S
ok=FAIL
if [ "$GS_RC" = 0 ] && replica_on a "${pids[0]}"; then ok=PASS; fi
row R2 "wake from the local image" "exit 0, the same answer" "exit $GS_RC" "$ok" "${GS_S}s"
gs 60 images rm local

for i in 0 1; do
    r=$([ "$i" = 0 ] && echo a || echo b)
    gs 300 hibernate "${pids[$i]}" --image "rep-$r"
    row "R3$r" "hibernate replica $r" "exit 0" "exit $GS_RC" "$([ "$GS_RC" = 0 ] && echo PASS || echo FAIL)" "${GS_S}s"
    wait_pid_free "${pids[$i]}" 60 || true
done
IMG_BYTES=$(image_bytes rep-a)
LOCAL_STORED=$(du_bytes "$STATE_DIR/store/chunks")
ratio=$(calc %.3f 's / i' s="${LOCAL_STORED:-0}" i="${IMG_BYTES:-1}")
row R3s "the local store holds both for less than 1.3 x one image" "< 1.3" "$ratio" \
    "$(fle "$ratio" 1.3 && echo PASS || echo FAIL)" "stored $(gb "$LOCAL_STORED") GB, one image $(gb "$IMG_BYTES") GB, image dirs $(gb "$(du_bytes "$STATE_DIR/images")") GB"
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
row R5s "the local store emptied" "0 B" "$(du_bytes "$STATE_DIR/store/chunks") B" INFO
for i in 0 1; do
    r=$([ "$i" = 0 ] && echo a || echo b)
    before=$(du_bytes "$STATE_DIR/store/chunks")
    gs 480 wake "$REMOTE/rep-$r" --wait 30 --no-guard
    ok=FAIL
    if [ "$GS_RC" = 0 ] && replica_on "$r" "${pids[$i]}"; then ok=PASS; fi
    got=$(($(du_bytes "$STATE_DIR/store/chunks") - before))
    row "R6$r" "wake replica $r from the remote (streamed)" "exit 0, the same answer" "exit $GS_RC" "$ok" \
        "${GS_S}s (local wake ${LOCAL_WAKE_S}s); criu $(jn "$GS_OUT" 'd["stages"]["criu"]') ms, driver $(jn "$GS_OUT" 'd["stages"]["driver"]') ms, pages $(jn "$GS_OUT" 'd["stages"]["pages"]') ms; $(gb "$got") GB fetched"
done
gs 120 images verify rep-b
row R7 "the streamed images are whole here after their wakes" "exit 0" "exit $GS_RC" "$([ "$GS_RC" = 0 ] && echo PASS || echo FAIL)"
exit 0
