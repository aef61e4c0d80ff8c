#!/usr/bin/env bash
# GPU check of the streaming lazy wake's rescue (docs/design/wake.md): the driver's
# restore starts right after CRIU's, before the whole image is verified; if
# the page server fails while it runs, gpusnap stops every other thread of
# the woken tree, answers the missing pages with zeros so that the driver's
# restore returns, checkpoints the process again and kills the tree. The
# wake fails, the image is kept, nothing is left on the GPU, and the next
# wake brings the worker back intact.
#
# For each workload (RESCUE_WORKLOADS: torch = tests/gpu/worker.py, cupy =
# tests/gpu/worker_cupy.py, jax = tests/gpu/worker_jax.py, each RESCUE_GIB of
# random memory, checksummed):
#   W.1  hibernate (its pages through FIFOs, the default: stages.dump_dir)
#   W.a  wake with the page server slowed (GPUSNAP_PAGES_SLOW_US, so the fill
#        takes ~RESCUE_FILL_S s, 2 fill threads) and failing on purpose
#        (GPUSNAP_PAGES_FAIL_AFTER = RESCUE_FAIL_AT of the image's pages):
#        non-zero exit; then the checks of a failed wake (below)
#   W.b  wake without either: the worker computes on intact data; stop
#   W.c  one byte flipped in a stored chunk of the largest pages file (the
#        CUDA process's memory) at ~RESCUE_BAD_AT of it, the page cache
#        dropped (the verify reads from the disk: slower than the driver's
#        start); wake: exit 2 naming the chunk; the checks of a failed wake;
#        the byte flipped back; wake: intact; stop
# The checks of a failed wake: the worker's pid gone within RESCUE_GONE_S s,
# nvidia-smi lists no process of it, the GPU's used memory back to its level
# before the wake (+ RESCUE_SLACK_MIB), `gpusnap images` still lists the
# image, and no new Xid in dmesg (INFO when dmesg is not readable). Two INFO
# rows say where a wake failed: whether nvidia-smi listed the worker during
# the wake (the driver's restore had begun), and what the wake's stderr and
# logs say of a rescue.
#
# Run from the repository root, on a machine with a GPU and CRIU, as root:
#   OUT=/some/dir tests/gpu/rescue-e2e.sh        (stage `rescue` of device.sh)
# Environment:
#   GPUSNAP            the binary (default ./target/release/gpusnap)
#   RESCUE_WORKLOADS   default "torch cupy" (jax: also tests/gpu/worker_jax.py)
#   RESCUE_GIB         each worker's memory (default 3; --fill random: ~4.7 GB
#                      of device memory, the image ~5 GB)
#   RESCUE_FILL_S      the slowed fill's length in W.a (default 5)
#   RESCUE_FAIL_AT     where the injected failure lands (default 0.4)
#   RESCUE_BAD_AT      where the bad chunk is (default 0.6)
#   RESCUE_BAD_SLOW_US GPUSNAP_PAGES_SLOW_US for W.c's failing wake (default
#                      none: only the cold page cache slows it)
#   RESCUE_GONE_S      "within a few seconds" (default 10)
#   RESCUE_SLACK_MIB   used memory above the level before (default 256)
#   RESCUE_DUMP_DIR    where W.1's pages must go (default fifo: stages.dump_dir
#                      of `hibernate --json`; tmpfs or disk with GPUSNAP_DUMP_FIFO=0)
#   RESCUE_WAKE_ARGS   extra `wake` arguments (default --no-guard, as keeper-e2e.sh)
#   RESCUE_BUDGET_S    soft budget (default 150): a workload whose next part
#                      would not fit is skipped (SKIP rows); a watchdog ends
#                      the run 30 s after
# Writes $OUT/rescue-e2e.md (the table, also printed) and $OUT/rescue-e2e.log.
# Exit 0 when every check passed (INFO rows do not count).

NAME=rescue-e2e # read by lib.sh
# shellcheck source=tests/gpu/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

RESCUE_WORKLOADS=${RESCUE_WORKLOADS:-torch cupy}
RESCUE_GIB=${RESCUE_GIB:-3}
RESCUE_FILL_S=${RESCUE_FILL_S:-5}
RESCUE_FAIL_AT=${RESCUE_FAIL_AT:-0.4}
RESCUE_BAD_AT=${RESCUE_BAD_AT:-0.6}
RESCUE_BAD_SLOW_US=${RESCUE_BAD_SLOW_US:-}
RESCUE_GONE_S=${RESCUE_GONE_S:-10}
RESCUE_SLACK_MIB=${RESCUE_SLACK_MIB:-256}
RESCUE_WAKE_ARGS=${RESCUE_WAKE_ARGS---no-guard}
RESCUE_BUDGET_S=${RESCUE_BUDGET_S:-150}
read -r -a WAKE_ARGS <<<"$RESCUE_WAKE_ARGS"
read -r -a LOADS <<<"$RESCUE_WORKLOADS"
for w in "${LOADS[@]}"; do
    case $w in torch | cupy | jax) ;; *) echo "RESCUE_WORKLOADS: '$w' is not torch, cupy or jax" >&2; exit 2 ;; esac
done
ROWS=$WORK/rows.tsv
: >"$ROWS"
NPASS=0 NFAIL=0 NSKIP=0 NINFO=0
FINISHED=0
FLIPPED="" # "FILE OFFSET" of a chunk byte flipped and not yet flipped back

# shellcheck disable=SC2317 # runs from the EXIT trap
write_table() {
    local md=$OUT/rescue-e2e.md
    {
        echo "## gpusnap: the rescue of a streaming lazy wake whose page server fails"
        echo
        echo "- date: $HDR_DATE"
        echo "- host: $HDR_HOST (kernel $HDR_KERNEL); GPU: $HDR_GPU, driver $HDR_DRIVER"
        echo "- gpusnap: $HDR_VERSION ($GPUSNAP)"
        echo "- workloads: ${LOADS[*]}, $RESCUE_GIB GiB of random memory each; injected failure at $RESCUE_FAIL_AT of the pages, fill slowed to ~${RESCUE_FILL_S} s (2 fill threads); bad chunk at ~$RESCUE_BAD_AT of the largest pages file, page cache dropped; wake ${RESCUE_WAKE_ARGS:-(no extra arguments)}"
        echo "- result: $NPASS passed, $NFAIL failed, $NSKIP skipped, $NINFO info; wall ${SECONDS} s (budget $RESCUE_BUDGET_S s)"
        echo
        rows_md "#" step expected got result seconds
    } >"$md"
    cat "$md"
}

# flip_byte FILE OFFSET: XOR one byte with 0xff (twice puts it back).
flip_byte() {
    python3 - "$1" "$2" <<'PY'
import os, sys
with open(sys.argv[1], "r+b") as f:
    f.seek(int(sys.argv[2]))
    b = f.read(1)
    f.seek(int(sys.argv[2]))
    f.write(bytes([b[0] ^ 0xFF]))
    f.flush()
    os.fsync(f.fileno())
PY
}

# shellcheck disable=SC2317 # the EXIT trap
on_exit() {
    local rc=$?
    trap - ERR
    if [ -n "$FLIPPED" ]; then
        # shellcheck disable=SC2086 # FILE OFFSET
        flip_byte $FLIPPED && log "chunk byte flipped back: $FLIPPED"
    fi
    rows_end "$rc"
    write_table
    rows_exit
}

# xid_count: NVRM Xid lines in the kernel log; nothing if dmesg is not readable.
xid_count() {
    local k
    k=$(dmesg 2>/dev/null) || return 0
    [ -n "$k" ] || return 0
    printf '%s\n' "$k" | grep -c 'NVRM: Xid' || true
}

# fits ID WHAT SECONDS: whether SECONDS more fit the budget; a SKIP row if not.
fits() {
    local left=$((RESCUE_BUDGET_S - SECONDS))
    [ "$left" -ge "$3" ] && return 0
    row "$1" "$2" "runs" "skipped: ${left}s of the budget left, it needs ~$3 s" SKIP
    return 1
}

# image_facts IMG: from the manifest, sets PAGES_BYTES (every pages file) and
# the chunk of the largest pages file at ~RESCUE_BAD_AT of it that no other
# place of the image holds (a raw one when there is one: a flipped byte then
# fails its blake3 rather than the decoding; a repeated one only when no
# chunk is unique): BAD_HASH, BAD_PATH (in STATE_DIR/store), BAD_FILE,
# BAD_AT (its offset / the file's size), BAD_ENC (R raw, Z zstd), BAD_FLIP
# (the offset of the byte to flip), BAD_TIMES (its places in the image).
image_facts() {
    local out
    PAGES_BYTES="" BAD_HASH="" BAD_PATH="" BAD_FILE="" BAD_AT="" BAD_ENC="" BAD_FLIP="" BAD_TIMES=""
    out=$(python3 - "$STATE_DIR/images/$1/manifest.json" "$STATE_DIR/store" "$RESCUE_BAD_AT" <<'PY' 2>>"$LOG"
import collections, json, os, sys
man, store, at = sys.argv[1], sys.argv[2], float(sys.argv[3])
d = json.load(open(man))
pages = [f for f in d["files"] if os.path.basename(f["path"]).startswith("pages-")]
total = sum(f["size"] for f in pages)
seen = collections.Counter(c["blake3"] for f in d["files"] for c in f.get("chunks", []))
big = max(pages, key=lambda f: f["size"])

def stored(h):
    p = os.path.join(store, "chunks", h[:2], h)
    try:
        with open(p, "rb") as f:
            return p, f.read(1).decode()
    except (OSError, UnicodeDecodeError):
        return p, ""


# The first unique raw chunk from `at` on (up to at + 0.2), else the first
# unique one, else (a repeating memory, as the fake workload's) the first.
picks, off = [], 0
for c in big.get("chunks", []):
    if off >= at * big["size"]:
        p, enc = stored(c["blake3"])
        if enc:
            rank = (seen[c["blake3"]] > 1) * 2 + (enc != "R")
            picks.append((rank, len(picks), c["blake3"], p, off, enc))
            if rank == 0 or off > min(1.0, at + 0.2) * big["size"]:
                break
    off += c["size"]
if not picks:
    print(total)
else:
    _, _, h, p, o, enc = min(picks)
    print(total, h, p, big["path"], "%.3f" % (o / big["size"]), enc, max(1, os.path.getsize(p) // 2), seen[h])
PY
    )
    read -r PAGES_BYTES BAD_HASH BAD_PATH BAD_FILE BAD_AT BAD_ENC BAD_FLIP BAD_TIMES <<<"$out"
    log "image $1: pages ${PAGES_BYTES:-?} bytes; bad chunk ${BAD_HASH:-none} ($BAD_ENC, ${BAD_TIMES:-?}x in the image) in $BAD_FILE at $BAD_AT, flip at $BAD_FLIP of $BAD_PATH"
}

# image_listed IMG: `gpusnap images` lists it.
image_listed() {
    gs 30 images
    [ "$(jget "$GS_OUT" "any(i.get('name') == '$1' for i in d['images'])")" = true ]
}

# failed_wake_checks ID PID IMG MEM0 XID0: after a failed wake, the tree is
# gone, off the GPU, the memory back, the image kept, no new Xid.
failed_wake_checks() {
    local id=$1 pid=$2 img=$3 mem0=$4 xid0=$5 t0 got v x
    t0=$(now)
    v=FAIL got="pid $pid still there after ${RESCUE_GONE_S} s ($(pstate "$pid"))"
    if wait_gone "$pid" "$RESCUE_GONE_S"; then v=PASS got="gone"; fi
    row "$id.2" "the woken worker's pid $pid is gone" "within ${RESCUE_GONE_S} s of the wake's exit" "$got" "$v" "$(fsub "$t0" "$(now)")"
    t0=$(now)
    v=FAIL got="listed: $(smi_apps)"
    if wait_smi_unlisted "$pid" 10; then v=PASS got="not listed (apps: $(smi_apps))"; fi
    row "$id.3" "nvidia-smi --query-compute-apps" "no process $pid" "$got" "$v" "$(fsub "$t0" "$(now)")"
    t0=$(now)
    v=FAIL
    if [ -z "$mem0" ]; then
        v=INFO got="no reading before the wake"
    elif wait_smi_used_le $((mem0 + RESCUE_SLACK_MIB)) 15; then
        v=PASS got="$SMI_USED MiB (before the wake $mem0 MiB)"
    else
        got="${SMI_USED:-?} MiB after 15 s (before the wake $mem0 MiB)"
    fi
    row "$id.4" "GPU memory.used back to its level before the wake" "<= $mem0 + $RESCUE_SLACK_MIB MiB" "$got" "$v" "$(fsub "$t0" "$(now)")"
    t0=$(now)
    v=FAIL got="not listed (exit $GS_RC${GS_MSG:+: $GS_MSG})"
    if image_listed "$img"; then v=PASS got=listed; fi
    row "$id.5" "gpusnap images" "lists $img" "$got" "$v" "$GS_S"
    x=$(xid_count)
    if [ -z "$xid0" ] || [ -z "$x" ]; then
        row "$id.6" "dmesg: new Xid" "none" "dmesg not readable" INFO
    else
        v=PASS got="none ($x in all)"
        if [ "$x" -gt "$xid0" ]; then
            v=FAIL got="$((x - xid0)) new: $(dmesg 2>/dev/null | grep 'NVRM: Xid' | tail -n 2 | cut -c1-200 | tr '\n' ' ')"
        fi
        row "$id.6" "dmesg: new Xid" "none" "$got" "$v"
    fi
}

# gpu_watch PID FILE: in the background (HELPERS; sets WATCH_PID), every
# ~0.25 s a line "SECONDS_SINCE_START MIB" while nvidia-smi lists PID on the
# GPU: whether the driver's restore had begun when a wake failed.
gpu_watch() {
    local pid=$1 f=$2 t0
    : >"$f"
    t0=$(now)
    (
        while [ ! -e "$WORK/.done" ]; do
            m=$(smi_pid_mib "$pid")
            [ -n "$m" ] && printf '%s %s\n' "$(fsub "$t0" "$(now)")" "$m" >>"$f"
            sleep 0.25
        done
    ) </dev/null >/dev/null 2>&1 &
    WATCH_PID=$!
    HELPERS+=("$WATCH_PID")
}

# gpu_watch_end FILE: stops the watch; prints what it saw.
gpu_watch_end() {
    kill "$WATCH_PID" 2>/dev/null
    wait "$WATCH_PID" 2>/dev/null
    if [ -s "$1" ]; then
        awk 'NR == 1 { a = $1 } { b = $1; if ($2 > m) m = $2 } END { printf "listed with up to %d MiB, from +%s s to +%s s of the wake", m, a, b }' "$1"
    else
        printf 'never listed (the failure came before the driver restored its memory, or between two looks)'
    fi
}

# rescue_said IMG: the last lines of the last wake's stderr and of its logs
# (STATE_DIR/logs/MILLIS-restore-IMG/, the newest) that speak of a rescue
# (the images are named rs-W, so that their name and paths never match).
rescue_said() {
    local d newest="" said
    for d in "$STATE_DIR"/logs/*-restore-"$1"; do [ -d "$d" ] && newest=$d; done
    said=$(cat "$GS_ERR" ${newest:+"$newest"/*.log} 2>/dev/null | sed 's/\x1b\[[0-9;]*m//g' |
        grep -i 'rescu' | tail -n 3 | cut -c1-250 | tr '\n' ' ')
    printf '%s\n' "${said:-no mention of a rescue (stderr, ${newest:-no log dir})}"
}

# failing_wake ID WHAT EXPECTED PID IMG RC_OK GREP [VAR=VALUE...]: a wake
# with those variables that must fail: exit RC_OK ("nz": any non-zero), its
# stderr or JSON naming GREP (when not empty); then failed_wake_checks.
failing_wake() {
    local id=$1 what=$2 exp=$3 pid=$4 img=$5 rc_ok=$6 grepfor=$7 mem0 xid0 v kind named="" kv seen
    shift 7
    mem0=$(smi_used_mib)
    xid0=$(xid_count)
    log "before the wake $id: GPU memory.used ${mem0:-?} MiB, Xid lines ${xid0:-unreadable}"
    mark_restored "$pid"
    for kv in "$@"; do export "${kv?}"; done
    gpu_watch "$pid" "$WORK/$id.gpu"
    gs 120 wake "$img" --wait 30 ${WAKE_ARGS[@]+"${WAKE_ARGS[@]}"}
    seen=$(gpu_watch_end "$WORK/$id.gpu")
    for kv in "$@"; do unset "${kv%%=*}"; done
    kind=$(jget "$GS_OUT" 'd["error"]["kind"]')
    v=FAIL
    case $GS_RC in
        0 | 124 | 137) ;;
        *) if [ "$rc_ok" = nz ] || [ "$GS_RC" = "$rc_ok" ]; then v=PASS; fi ;;
    esac
    if [ -n "$grepfor" ]; then
        if grep -q "$grepfor" "$GS_ERR" "$GS_OUT"; then named="; names ${grepfor:0:12}..."; else
            named="; does not name ${grepfor:0:12}..."
            v=FAIL
        fi
    fi
    row "$id.1" "$what" "$exp" "exit $GS_RC (kind ${kind:-?})$named: ${GS_MSG:-no message}" "$v" "$GS_S"
    log_file "wake $id stderr" "$GS_ERR"
    image_logs "$img"
    row "$id.1g" "where it failed: pid $pid on the GPU during the wake (nvidia-smi every ~0.25 s)" \
        "(information: listed, the driver's restore had begun)" "$seen" INFO
    row "$id.1r" "where it failed: what the wake and its logs say of a rescue" \
        "(information: the driver's restore was running, so a rescue)" "$(rescue_said "$img")" INFO
    if [ "$GS_RC" = 0 ]; then
        # It woke after all: the worker runs; the rest of the checks would
        # only fail. Stop it so that the next step starts as planned.
        stop_worker "$id.9" "$pid"
        return 1
    fi
    failed_wake_checks "$id" "$pid" "$img" "$mem0" "$xid0"
}

# intact_wake ID NAME PID IMG: a plain wake; the worker goes on with ok=1.
intact_wake() {
    local id=$1 name=$2 pid=$3 img=$4 i0 v got
    read_status "$WORK/$name.status"
    i0=${ST_ITER:-0}
    mark_restored "$pid"
    gs 120 wake "$img" --wait 30 ${WAKE_ARGS[@]+"${WAKE_ARGS[@]}"}
    v=FAIL; [ "$GS_RC" = 0 ] && v=PASS
    row "$id.1" "wake $img, no injection" "exit 0" "exit $GS_RC${GS_MSG:+: $GS_MSG}; verify_ms $(jget "$GS_OUT" 'd["verify_ms"]'), restore_ms $(jget "$GS_OUT" 'd["restore_ms"]')" "$v" "$GS_S"
    if [ "$GS_RC" != 0 ]; then
        image_logs "$img"
        return 1
    fi
    got="no progress in 30 s (iteration ${ST_ITER:-?}, ok=${ST_OK:-?})"
    if ! alive "$pid"; then
        got="no process $pid"
    elif wait_iter_gt "$name" "$i0" 30; then
        got="pid $ST_PID: iteration $i0 -> $ST_ITER, ok=$ST_OK"
    fi
    v=FAIL; [[ ${ST_ITER:-0} -gt $i0 && $ST_OK == 1 && $ST_PID == "$pid" ]] && v=PASS
    row "$id.2" "the worker computes on intact data" "pid $pid, iteration advances from $i0, checksum ok=1" "$got" "$v"
    [ "$v" = PASS ]
}

# stop_worker ID PID: gpusnap stop; the pid gone and free for the next wake.
stop_worker() {
    local v=FAIL
    gs 120 stop "$2"
    if [ "$GS_RC" = 0 ] && wait_gone "$2" 30; then v=PASS; fi
    row "$1" "gpusnap stop $2" "exit 0, pid gone" "exit $GS_RC${GS_MSG:+: $GS_MSG}$(alive "$2" && echo '; still alive')" "$v" "$GS_S"
    wait_pid_free "$2" 10 || log "pid $2 still held 10 s after the stop"
    [ "$v" = PASS ]
}

# one_workload W NAME PID: steps 1, a, b, c for one ready worker.
one_workload() {
    local w=$1 name=$2 pid=$3 img=rs-$1 slow fail v dropped
    fits "$w.1" "hibernate $w" 25 || return 0
    gs 300 hibernate "$pid" --image "$img"
    v=FAIL; [ "$GS_RC" = 0 ] && [ "$(jget "$GS_OUT" 'd["stages"]["dump_dir"]')" = "${RESCUE_DUMP_DIR:-fifo}" ] && v=PASS
    row "$w.1" "hibernate the $w worker (pid $pid)" "exit 0, pages via ${RESCUE_DUMP_DIR:-fifo}" "exit $GS_RC${GS_MSG:+: $GS_MSG}; pages via $(jget "$GS_OUT" 'd["stages"]["dump_dir"]'), dump_ms $(jget "$GS_OUT" 'd["dump_ms"]')" "$v" "$GS_S"
    [ "$GS_RC" = 0 ] || { image_logs "$img"; return 0; }
    reap "$pid"
    wait_gone "$pid" 15 || true
    wait_pid_free "$pid" 10 || true
    image_facts "$img"
    if ! [ "${PAGES_BYTES:-0}" -gt 0 ] 2>/dev/null; then
        row "$w.0" "the image's pages (manifest)" "> 0 bytes" "${PAGES_BYTES:-unreadable}" FAIL
        return 0
    fi

    # a: the page server fails while the driver's restore runs.
    slow=$(calc %d 's * 1e6 * 2 / (b / 1048576)' s="$RESCUE_FILL_S" b="$PAGES_BYTES")
    [ "$slow" -ge 1 ] || slow=1
    fail=$(calc %d 'f * b' f="$RESCUE_FAIL_AT" b="$PAGES_BYTES")
    if fits "$w.a" "wake with an injected page-server failure" 30; then
        failing_wake "$w.a" "wake, page server failing at $(gb "$fail") of $(gb "$PAGES_BYTES") GB, slowed ${slow} us/MiB" \
            "exit != 0 (pages), worker gone" "$pid" "$img" nz "" \
            GPUSNAP_PAGES_SLOW_US="$slow" GPUSNAP_PAGES_THREADS=2 GPUSNAP_PAGES_FAIL_AFTER="$fail" || true
    else
        return 0
    fi

    # b: the image is whole: the next wake brings the worker back intact.
    fits "$w.b" "wake again, intact" 25 || return 0
    intact_wake "$w.b" "$name" "$pid" "$img" || return 0
    stop_worker "$w.b.3" "$pid" || return 0

    # c: a chunk that fails its check, found while the driver's restore runs.
    fits "$w.c" "a bad chunk" 45 || return 0
    if [ -z "$BAD_HASH" ] || [ ! -f "$BAD_PATH" ]; then
        row "$w.c.0" "a chunk of $img's largest pages file at ~$RESCUE_BAD_AT, in no other place" "found in the store" "none (${BAD_PATH:-no path})" FAIL
        return 0
    fi
    cp -p "$BAD_PATH" "$WORK/chunk.orig"
    flip_byte "$BAD_PATH" "$BAD_FLIP"
    FLIPPED="$BAD_PATH $BAD_FLIP"
    dropped=dropped
    { sync && echo 3 >/proc/sys/vm/drop_caches; } 2>/dev/null || dropped="not dropped (no write to /proc/sys/vm/drop_caches)"
    row "$w.c.0" "one byte flipped in chunk ${BAD_HASH:0:12}... ($BAD_ENC, ${BAD_TIMES}x in the image) of $BAD_FILE at $BAD_AT of it; page cache" \
        "(information)" "byte $BAD_FLIP of $(stat -c %s "$BAD_PATH") flipped; page cache $dropped" INFO
    failing_wake "$w.c" "wake with the bad chunk" "exit 2 naming the chunk, worker gone" "$pid" "$img" 2 "$BAD_HASH" \
        ${RESCUE_BAD_SLOW_US:+GPUSNAP_PAGES_SLOW_US="$RESCUE_BAD_SLOW_US"} || true
    flip_byte "$BAD_PATH" "$BAD_FLIP"
    FLIPPED=""
    v=FAIL; cmp -s "$BAD_PATH" "$WORK/chunk.orig" && v=PASS
    row "$w.c.7" "the chunk's byte flipped back" "the chunk as saved" "$([ $v = PASS ] && echo same || echo differs)" "$v"
    rm -f "$WORK/chunk.orig"
    fits "$w.d" "wake after the repair, intact" 25 || return 0
    intact_wake "$w.d" "$name" "$pid" "$img" || return 0
    stop_worker "$w.d.3" "$pid" || return 0
    gs 60 images rm "$img"
}

main() {
    local w name t0 ready=() pids=() names=() i
    # Both workers start at once (their imports and fills overlap), then
    # each is taken through its steps alone.
    t0=$(now)
    for w in "${LOADS[@]}"; do
        name=${w:0:1}w
        if [ "$w" = cupy ] || [ "$w" = jax ]; then
            WORKER_SCRIPT=worker_$w.py start_worker "$name" "$RESCUE_GIB" --fill random
        else
            start_worker "$name" "$RESCUE_GIB" --fill random
        fi
        pids+=("$LAST_PID") names+=("$name")
    done
    for i in "${!LOADS[@]}"; do
        if wait_ready "${names[$i]}" "${pids[$i]}" 120; then
            ready+=(1)
            row "${LOADS[$i]}.0" "start the ${LOADS[$i]} worker, $RESCUE_GIB GiB random" "ready, checksum ok" \
                "pid ${pids[$i]}: $(cat "$WORK/${names[$i]}.status"); GPU memory.used $(smi_used_mib) MiB" PASS "$(fsub "$t0" "$(now)")"
        else
            ready+=(0)
            row "${LOADS[$i]}.0" "start the ${LOADS[$i]} worker" "ready, checksum ok" \
                "not ready: $(tail -n 2 "$WORK/${names[$i]}.log" | tr '\n' ' ' | cut -c1-300)" FAIL "$(fsub "$t0" "$(now)")"
        fi
    done
    for i in "${!LOADS[@]}"; do
        [ "${ready[$i]}" = 1 ] || continue
        one_workload "${LOADS[$i]}" "${names[$i]}" "${pids[$i]}"
    done
    return 0
}

install_traps
start_watchdog $((RESCUE_BUDGET_S + 30))
log "gpusnap rescue e2e: workloads ${LOADS[*]}, $RESCUE_GIB GiB each, budget ${RESCUE_BUDGET_S}s"
collect_header
main
FINISHED=1
exit 0 # on_exit writes the table and sets the exit status
