#!/usr/bin/env bash
# Benchmark of gpusnap hibernate/wake against the bare calls they are made
# of (driver checkpoint + CRIU dump; CRIU restore + driver restore), on one GPU.
#
# Run from the repository root, on a machine with a GPU and CRIU >= 4.2, as root:
#   OUT=/some/dir bench/gpu/hibernate.sh [SIZE_GIB...]   (default: $HBENCH_SIZES, else 12)
# Environment:
#   GPUSNAP          the binary (default ./target/release/gpusnap)
#   OUT              results directory (default: a new /tmp/gpusnap-out.* dir)
#   GPUSNAP_CRIU     the CRIU binary (default: criu on PATH), for both modes
#   REPS             repetitions of each mode per size (default 2)
#   HBENCH_BUDGET_S  soft budget in seconds (default: BENCH_BUDGET_S, else
#                    490): a size or a repetition that would not fit
#                    (including the safe stop of its worker) is skipped; a
#                    watchdog ends the run, through the cleanup, 45 s after it
#   HB_CRIU_ARGS     flags of the bare `criu dump` and `criu restore` (default
#                    --shell-job; gpusnap passes --shell-job --file-locks
#                    --ext-unix-sk --tcp-established, with -v4 logs)
#   HB_WAKE_ARGS     arguments for `gpusnap wake` (default: --no-guard when
#                    this gpusnap has it: a guard attached to the worker would
#                    make the next bare `criu dump` fail, CRIU must be its
#                    only tracer, and the bare cycle has no guard either)
#   HB_MODES         the cycles of each repetition, in turn (default "bare
#                    gpusnap"): bare, gpusnap (lazy wake, the default),
#                    eager (wake --eager), thp (hibernate --thp, lazy wake)
#   HB_DRIVER        1 (default): once per size, before the repetitions, the
#                    bare driver alone: lock+checkpoint, then restore+unlock
#                    in the same process (no CRIU): "driver restore alone"
#   HB_DRIVER_WOKEN  1: the same once more after the repetitions, on the
#                    worker as the last wake left it (a process restored
#                    once: does the driver restore it slower?), its sample
#                    `driver_woken` (not used as the targets' reference)
#   HB_COLD          1: `sync; echo 3 > /proc/sys/vm/drop_caches` before every
#                    wake (bare and gpusnap; the image is read from the disk);
#                    0 (default): warm page cache. Run a cold call apart.
#   HB_MATRIX        wake settings to compare, after the repetitions,
#                    on ONE image woken once per entry (the worker is stopped
#                    through gpusnap between wakes): "NAME:VAR=VAL,VAR=VAL;..."
#                    with any GPUSNAP_* variables (GPUSNAP_[A-Z0-9_]+, e.g.
#                    the page server's GPUSNAP_PAGES_*, docs/reference/environment.md, or
#                    GPUSNAP_VERIFY_FIRST=1, the driver waiting for the
#                    whole verify: "first:GPUSNAP_VERIFY_FIRST=1;stream:"),
#                    set for that wake alone (a value the caller had is
#                    put back after it); an entry whose NAME starts with
#                    "cold" drops the page cache before its wake (a warm
#                    call's cold wake: "cold:"); "preset" = batch4m (one WAKE
#                    per 4 MiB batch), default, t8n10 (8 fill threads at nice 10),
#                    head100 (the whole fill before the driver starts);
#                    empty (default): none
#   HB_REP_ENV       GPUSNAP_* settings for the gpusnap cycles (hibernate
#                    and wake) of given repetitions, "REP:VAR=VAL,...;...":
#                    REPS=2 HB_REP_ENV='2:GPUSNAP_DUMP_FIFO_COPIERS=8'
#                    compares a hibernate setting on one host (the sample
#                    says "settings"; the medians mix the reps, the
#                    samples' table does not); empty (default): none
#   HB_ROOM          free disk a dump needs, as a multiple of the expected
#                    image (default 1.3; 1.1 lets a ~49 GB image (15 GiB) fit
#                    the 64 GiB disk)
#   WORKER_FILL      the worker's memory (tests/gpu/worker.py --fill):
#                    pattern (default: one short pattern repeated, which
#                    the chunk store compresses and deduplicates to almost
#                    nothing: SIZE 8 holds ~26.4 GB), random
#                    (incompressible, the fair test of a cold wake and of
#                    writing the image: SIZE 23 holds ~25 GB, 46 ~50 GB) or
#                    weights (bf16 as a model's weights, sized as random;
#                    GPUSNAP_CHUNK_CODEC=zstd stores them at ~1.28x)
#   HB_PCIE          1: the GPU's PCIe receive rate sampled through NVML
#                    (bench/gpu/pcie-trace.py) around the driver's restore
#                    alone and around every wake: when 10/50/90/99 % of the
#                    bytes the restore sent to the GPU had arrived, the
#                    mean rate between 10 and 90 %, and the rate per 0.5 s
#                    (in the samples as pcie_*, the series in the log and
#                    in OUT/pcie-*.tsv); 0 (default): not sampled
#   HB_DISK          1 (default): the scratch disk's write speed (dd of
#                    HB_DD_GIB GiB, default 8, conv=fdatasync) and cold read
#                    speed, once per run, for the hibernate and cold targets
# For each size one worker holds SIZE GiB; each repetition runs, in
# alternating order:
#   bare:    tests/gpu/cuckpt.py lock+checkpoint; `criu dump -t PID -D DIR
#            --shell-job` (CRIU kills the tree after the dump); wait until the
#            pid is gone; `criu restore -D DIR -d --shell-job`; cuckpt.py
#            restore+unlock
# Both modes wait, untimed, until the old pid is free before the wake (the
# killed worker's parent must reap it first: init, after a restore).
#   gpusnap: `gpusnap --json hibernate PID --image b`; `gpusnap --json wake b
#            --wait 30` (timed as whole commands, with their own breakdown)
#   driver:  (HB_DRIVER) cuckpt.py lock+checkpoint, then restore+unlock
#   eager, thp: as gpusnap, with `wake --eager`, `hibernate --thp`
#   matrix:  (HB_MATRIX) one `gpusnap hibernate`, then per entry `wake` with
#            its GPUSNAP_* settings and `gpusnap stop` before the next
# The worker's checksum and progress are checked after every wake; each image
# is removed right after use (gpusnap's: `images rm`, then `images gc` to
# drop its chunks from STATE/store, so that the next hibernate writes every
# chunk again and the disk holds one image at a time), and a dump is skipped
# (with a note) when the disk has less than HB_ROOM x the expected image
# free. A gpusnap image's size ("image_bytes") is what its hibernate wrote:
# the image directory (manifest, CRIU's small files) plus the growth of
# STATE/store across the hibernate (its chunks, as stored: compressed or
# raw; the store is empty before, see above); "manifest_bytes" is the
# logical size (every byte of the pages files). The worker is ended with
# `gpusnap stop`.
# Writes $OUT/bench-hibernate.md (also on stdout), $OUT/bench-hibernate.json
# (every sample) and $OUT/bench-hibernate.log. Exit 0 when every planned
# repetition ran and passed its checks, 1 otherwise; whether the targets
# (gpusnap <= 1.05 x bare; wake <= 1.3 x the driver's restore alone,
# cold wake <= 1.2 x max(disk read of the image, driver restore), hibernate
# <= 1.2 x (suspend + image at the disk's write speed)) are met is in the
# tables, not the exit status.
# Dry run without a GPU: tests/gpu/README.md ("Dry runs against the fakes").

NAME=bench-hibernate # read by lib.sh
# shellcheck source=tests/gpu/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/../../tests/gpu/lib.sh"
# This directory: the probes and workloads only the benchmarks use.
BENCH_GPU_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

HBENCH_BUDGET_S=${HBENCH_BUDGET_S:-${BENCH_BUDGET_S:-490}}
if [ $# -gt 0 ]; then
    SIZES=("$@")
else
    read -r -a SIZES <<<"${HBENCH_SIZES:-12}"
fi
for s in "${SIZES[@]}"; do
    case $s in
        '' | *[!0-9.]* | *.*.* | .*)
            echo "usage: bench/gpu/hibernate.sh [SIZE_GIB...]  (bad size '$s')" >&2
            exit 2
            ;;
    esac
done
REPS=${REPS:-2}
case $REPS in '' | *[!0-9]* | 0) echo "REPS must be a positive integer" >&2; exit 2 ;; esac
read -r -a MODES <<<"${HB_MODES:-bare gpusnap}"
for m in "${MODES[@]}"; do
    case $m in bare | gpusnap | eager | thp) ;; *) echo "HB_MODES: unknown mode '$m' (bare gpusnap eager thp)" >&2; exit 2 ;; esac
done
HB_DRIVER=${HB_DRIVER:-1}
HB_DRIVER_WOKEN=${HB_DRIVER_WOKEN:-0}
HB_COLD=${HB_COLD:-0}
HB_PCIE=${HB_PCIE:-0}
HB_DISK=${HB_DISK:-1}
HB_DD_GIB=${HB_DD_GIB:-8}
case $HB_DD_GIB in '' | *[!0-9]* | 0) echo "HB_DD_GIB must be a positive integer" >&2; exit 2 ;; esac
HB_MATRIX=${HB_MATRIX:-}
if [ "$HB_MATRIX" = preset ]; then
    # batch4m: the fill's WAKE once per 4 MiB batch (not per wake chunk);
    # default: this build's defaults; t8n10: fewer fill threads, below the
    # driver's priority (is the driver short of CPU?); head100: the whole
    # fill before the driver starts (the fill's rate alone, and the driver
    # on memory already in place).
    HB_MATRIX="batch4m:GPUSNAP_PAGES_WAKE_CHUNK=4M;default:;t8n10:GPUSNAP_PAGES_THREADS=8,GPUSNAP_PAGES_NICE=10;head100:GPUSNAP_PAGES_HEAD_START=100%"
fi
# check_knobs VAR ENTRY KVS: each of the comma-separated KVS (of ENTRY, an
# entry of the setting VAR) is GPUSNAP_[A-Z0-9_]+=VALUE, else exit 2.
check_knobs() {
    local kvs kv
    IFS=',' read -r -a kvs <<<"$3"
    for kv in ${kvs[@]+"${kvs[@]}"}; do
        if ! [[ $kv =~ ^GPUSNAP_[A-Z0-9_]+=.+$ ]]; then
            echo "$1: '$kv' in '$2' is not GPUSNAP_[A-Z0-9_]+=VALUE" >&2
            exit 2
        fi
    done
}
MATRIX=()
if [ -n "$HB_MATRIX" ]; then
    IFS=';' read -r -a MATRIX <<<"$HB_MATRIX"
    for v in "${MATRIX[@]}"; do
        case ${v%%:*} in '' | *[!A-Za-z0-9_.-]*) echo "HB_MATRIX: bad entry name in '$v' (NAME:VAR=VAL,...)" >&2; exit 2 ;; esac
        if [ "$v" != "${v%%:*}" ] && [ -n "${v#*:}" ]; then
            check_knobs HB_MATRIX "$v" "${v#*:}"
        fi
    done
fi
# HB_REP_ENV: REP_ENV[rep]="VAR=VAL,..."
declare -A REP_ENV=()
if [ -n "${HB_REP_ENV:-}" ]; then
    IFS=';' read -r -a _reps <<<"$HB_REP_ENV"
    for v in "${_reps[@]}"; do
        r=${v%%:*}
        case $r in '' | *[!0-9]*) echo "HB_REP_ENV: '$v' is not REP:VAR=VAL,..." >&2; exit 2 ;; esac
        # A repetition with no settings ("2") is refused as one bad setting.
        if [ "$v" = "$r" ]; then check_knobs HB_REP_ENV "$v" "$v"; fi
        check_knobs HB_REP_ENV "$v" "${v#*:}"
        REP_ENV[$r]=${v#*:}
    done
fi
DISK_W_GBPS="" DISK_R_GBPS=""

SAMPLES=$WORK/samples.jsonl # one JSON object per cycle
NOTES=$WORK/notes.txt
: >"$SAMPLES"
: >"$NOTES"
ERRORS=0
FINISHED=0
WAKE_ARGS=()
read -r -a CRIU_ARGS <<<"${HB_CRIU_ARGS:---shell-job}"
CRIU_BIN="" CRIU_VERSION="" CRIU_CHECK="" CRIU_CHECK_RC="" CRIU_WHY=""

# jv VALUE: a JSON number, or null when empty / not a number.
jv() {
    case ${1:-} in
        '' | *[!0-9.eE+-]* | . | *.*.*) printf 'null' ;;
        *) printf '%s' "$1" ;;
    esac
}

# sample KEY=VALUE...: one JSON line; string values are given as KEY=s:VALUE.
sample() {
    local kv k v out="{"
    for kv in "$@"; do
        k=${kv%%=*} v=${kv#*=}
        case $v in
            s:*) v=${v#s:}; v=${v//\\/\\\\}; v=${v//\"/\\\"}; out="$out\"$k\": \"$v\", " ;;
            *) out="$out\"$k\": $(jv "$v"), " ;;
        esac
    done
    printf '%s}\n' "${out%, }" >>"$SAMPLES"
    log "SAMPLE $*"
}

# disk_room GIB REP MODE BYTES: HB_ROOM x BYTES free on the scratch disk, or a note.
# A gpusnap hibernate of incompressible memory (WORKER_FILL=random) needs
# twice its image: CRIU's pages file and its chunks coexist until the commit
# removes the file (a pattern's chunks take almost nothing).
disk_room() {
    local free
    free=$(disk_free_bytes "$WORK")
    if fle "$(calc %.0f 'b * r' b="$4" r="${HB_ROOM:-1.3}")" "${free:-0}"; then return 0; fi
    note "size $1 GiB rep $2: $3 skipped: $(gb "$free") GB free on $WORK, the image needs about $(gb "$4") GB (x${HB_ROOM:-1.3})"
    return 1
}

# random_room BYTES: the disk an image of BYTES of random memory takes while
# it is made: its chunks, plus CRIU's pages file when the pages do not go
# through FIFOs (GPUSNAP_DUMP_FIFO=0: the file, then the chunks made from
# it); with the FIFOs (the default) only the chunks.
random_room() {
    if [ "${WORKER_FILL:-pattern}" != pattern ] && [ "${GPUSNAP_DUMP_FIFO:-1}" = 0 ]; then
        echo $(($1 * 2))
    else
        echo "$1"
    fi
}

# gpu_room MIB: enough free GPU memory for a restore of MIB (never restore
# without room: an out-of-memory restore strands the process).
gpu_room() {
    local free
    free=$(smi_free_mib)
    [ -n "$free" ] && [ "$free" -ge $(($1 + 1024)) ]
}

# worker_on NAME PID I: the worker is back, advancing past I with ok=1.
worker_on() {
    alive "$2" && wait_iter_gt "$1" "${3:-0}" 30 && [ "$ST_OK" = 1 ] && [ "$ST_PID" = "$2" ]
}

# log_tail FILE: its last 40 lines into the log.
log_tail() {
    [ -s "$1" ] || return 0
    printf '    ---- last 40 lines of %s\n' "$1" >>"$LOG"
    tail -n 40 "$1" | cut -c1-300 | sed 's/^/    | /' >>"$LOG"
}

# criu_err DIR LOG: the last telling error line of a CRIU log.
criu_err() {
    grep -E 'Error \(|Error:' "$1/$2" 2>/dev/null | grep -v RLIMIT_NOFILE | tail -n 1 | cut -c1-300
}

# cold_cache: with HB_COLD=1, the page cache dropped (the next wake reads
# the image from the disk); fails (with a note) when it cannot be.
cold_cache() {
    [ "$HB_COLD" = 1 ] || [ "${1:-}" = force ] || return 0
    sync
    if ! echo 3 >/proc/sys/vm/drop_caches 2>/dev/null; then
        note "cannot drop the page cache (root needed): HB_COLD=1 runs are warm"
        HB_COLD=0
    fi
    return 0
}

# knobs_set "VAR=VAL,VAR=VAL": exported for the next gpusnap call; knobs_clear
# undoes it: a variable the caller had set (GPUSNAP_CRIU, say) gets its value
# back, any other is unset.
KNOBS=()
KNOBS_SAVED=() # "VAR=VALUE" of those set before, "VAR" of those unset
knobs_set() {
    local kv k
    KNOBS=() KNOBS_SAVED=()
    [ -n "$1" ] || return 0
    IFS=',' read -r -a KNOBS <<<"$1"
    for kv in "${KNOBS[@]}"; do
        k=${kv%%=*}
        if [ -n "${!k+x}" ]; then KNOBS_SAVED+=("$k=${!k}"); else KNOBS_SAVED+=("$k"); fi
        export "${kv?}"
    done
}
knobs_clear() {
    local kv i
    # Backwards, so that a variable named twice ends with its first saved value.
    for ((i = ${#KNOBS_SAVED[@]} - 1; i >= 0; i--)); do
        kv=${KNOBS_SAVED[$i]}
        if [ "$kv" = "${kv%%=*}" ]; then unset "$kv"; else export "${kv?}"; fi
    done
    KNOBS=() KNOBS_SAVED=()
}

# hib_extra FILE / wake_extra FILE: KEY=VALUE words for `sample` from a
# hibernate's / wake's --json (CRIU's dump statistics; the page server's report).
hib_extra() {
    python3 - "$1" <<'PY' 2>/dev/null || true
import json, sys
d = json.load(open(sys.argv[1]))
c, st = d.get("criu_stats") or {}, d.get("stages") or {}
v = {"commit_ms": st.get("commit"), "criu_freezing_ms": c.get("freezing_ms"), "criu_frozen_ms": c.get("frozen_ms"),
     "criu_memdump_ms": c.get("memdump_ms"), "criu_drain_ms": c.get("drain_ms"), "criu_memwrite_ms": c.get("memwrite_ms"),
     "criu_pages_written": c.get("pages_written"), "criu_pages_scanned": c.get("pages_scanned"),
     "follow_overlapped_bytes": st.get("follow_overlapped_bytes"), "follow_after_bytes": st.get("follow_after_bytes"),
     "follow_finish_ms": st.get("follow_finish"), "follow_punched_bytes": st.get("follow_punched_bytes"),
     "dump_tmpfs": {"tmpfs": 1, "disk": 0}.get(st.get("dump_dir"))}
# Where the FIFO receiver's threads spent the dump (stages.fifo).
for k, x in (st.get("fifo") or {}).items():
    v["fifo_" + k] = x
print(" ".join(f"{k}={x}" for k, x in v.items() if isinstance(x, (int, float)) and not isinstance(x, bool)))
PY
}
wake_extra() {
    python3 - "$1" <<'PY' 2>/dev/null || true
import json, sys
d = json.load(open(sys.argv[1]))
p, st = d.get("pages") or {}, d.get("stages") or {}
v = {"head_start_ms": st.get("head_start"), "lazy": 1 if d.get("lazy") else 0}
for k in ("faults", "faults_in_flight", "faults_backward", "fault_bytes", "fill_bytes", "eexist_pages",
          "restore_done_ms", "first_fault_ms", "last_fault_ms", "last_page_ms", "fill_gbps", "fault_busy_ms",
          "read_ms", "copy_ms", "in_place_bytes", "book_ms", "nap_ms", "pieces", "pace_wait_ms"):
    v["p_" + k] = p.get(k)
# The pace to the reader (GPUSNAP_PAGES_PACE), when it ran.
for k, x in (p.get("pace") or {}).items():
    v["pace_" + k] = x
o = p.get("options") or {}
for k in ("threads", "batch", "wake_chunk", "fault_batch", "ahead", "nice"):
    v["o_" + k] = o.get(k)
print(" ".join(f"{k}={x}" for k, x in v.items() if isinstance(x, (int, float)) and not isinstance(x, bool)))
PY
}

# pcie_start LABEL / pcie_stop: with HB_PCIE=1, the GPU's PCIe receive
# rate sampled (bench/gpu/pcie-trace.py) from just before the command timed
# next until pcie_stop, which sets PCIE_WORDS (KEY=VALUE words for `sample`)
# and logs the rate per 0.5 s.
PCIE_PID="" PCIE_T0="" PCIE_FILE="" PCIE_N=0
PCIE_WORDS=()
pcie_start() {
    PCIE_WORDS=()
    [ "$HB_PCIE" = 1 ] || return 0
    PCIE_N=$((PCIE_N + 1))
    PCIE_FILE=$OUT/pcie-$PCIE_N-$1.tsv
    rm -f "$WORK/pcie.stop"
    python3 "$BENCH_GPU_DIR/pcie-trace.py" sample "$PCIE_FILE" "$WORK/pcie.stop" --max 600 2>>"$LOG" &
    PCIE_PID=$!
    sleep 0.3 # its NVML start, before the command's
    PCIE_T0=$(now)
}
pcie_stop() {
    local out
    [ -n "$PCIE_PID" ] || return 0
    sleep 0.2
    touch "$WORK/pcie.stop"
    wait "$PCIE_PID" 2>/dev/null
    PCIE_PID=""
    out=$(python3 "$BENCH_GPU_DIR/pcie-trace.py" summary "$PCIE_FILE" "$PCIE_T0" 2>&1)
    log "pcie ${PCIE_FILE##*/}: $(printf '%s' "$out" | tr '\n' ' ' | cut -c1-1200)"
    read -r -a PCIE_WORDS <<<"$(printf '%s\n' "$out" | head -n 1 | grep '^pcie_' || true)"
}

# disk_speed: the scratch disk's write speed (dd HB_DD_GIB GiB, fdatasync)
# and cold read speed, once; sets DISK_W_GBPS, DISK_R_GBPS.
disk_speed() {
    local f=$WORK/dd.bin bytes t0 w_s r_s="" free
    bytes=$((HB_DD_GIB * 1073741824))
    free=$(disk_free_bytes "$WORK")
    if ! fle "$(calc %.0f 'b * 1.2' b="$bytes")" "${free:-0}"; then
        note "disk speed not measured: $(gb "$free") GB free on $WORK, dd needs $(gb "$bytes") GB"
        return 0
    fi
    log "dd: $HB_DD_GIB GiB to $f (conv=fdatasync)"
    t0=$(now)
    if ! dd if=/dev/zero of="$f" bs=16M count=$((HB_DD_GIB * 64)) conv=fdatasync status=none 2>>"$LOG"; then
        note "dd write failed"
        rm -f "$f"
        return 0
    fi
    w_s=$(fsub "$t0" "$(now)")
    sync
    if echo 3 >/proc/sys/vm/drop_caches 2>/dev/null; then
        t0=$(now)
        dd if="$f" of=/dev/null bs=16M status=none 2>>"$LOG" && r_s=$(fsub "$t0" "$(now)")
    else
        note "disk read speed not measured: cannot drop the page cache"
    fi
    rm -f "$f"
    DISK_W_GBPS=$(gbps "$bytes" "$w_s")
    [ -n "$r_s" ] && DISK_R_GBPS=$(gbps "$bytes" "$r_s")
    log "disk: write ${DISK_W_GBPS} GB/s (${w_s}s), read ${DISK_R_GBPS:-?} GB/s (${r_s:-?}s) for $(gb "$bytes") GB"
    sample gib=0 rep=0 mode=s:disk dd_bytes="$bytes" write_s="$w_s" read_s="$r_s" \
        write_gbps="$DISK_W_GBPS" read_gbps="$DISK_R_GBPS"
}

# driver_cycle GIB PID NAME FP [MODE]: the bare driver alone: lock+checkpoint,
# then restore+unlock in the same process (the memory never leaves it); its
# sample's mode MODE (default driver).
driver_cycle() {
    local gib=$1 pid=$2 name=$3 fp=$4 mode=${5:-driver} fp_mib i c_wall c_drv
    fp_mib=$(calc %d 'b / 1048576' b="$fp")
    sleep 1
    read_status "$WORK/$name.status"
    i=$ST_ITER
    raw 300 --timeout-ms 30000 "$pid" lock checkpoint
    c_wall=$RAW_S c_drv=$(jget "$RAW_OUT" 'd["driver_ms"]')
    if [ "$RAW_RC" != 0 ]; then
        note "size $gib GiB: driver alone: lock+checkpoint failed ($(raw_rcs))"
        if [ "$(jget "$RAW_OUT" 'd["calls"][0]["rc"]')" = 0 ]; then raw 60 "$pid" unlock; fi
        return 1
    fi
    if ! gpu_room "$fp_mib"; then
        note "size $gib GiB: driver alone: only $(smi_free_mib) MiB free for a $fp_mib MiB restore"
        return 1
    fi
    mark_restored "$pid"
    pcie_start "$mode-$gib"
    raw 300 "$pid" restore unlock
    pcie_stop
    if [ "$RAW_RC" != 0 ]; then
        note "size $gib GiB: driver alone: restore+unlock failed ($(raw_rcs))"
        return 1
    fi
    sample gib="$gib" rep=0 mode=s:"$mode" footprint_bytes="$fp" ckpt_wall_s="$c_wall" ckpt_driver_ms="$c_drv" \
        restore_wall_s="$RAW_S" restore_driver_ms="$(jget "$RAW_OUT" 'd["driver_ms"]')" ${PCIE_WORDS[@]+"${PCIE_WORDS[@]}"}
    if ! worker_on "$name" "$pid" "$i"; then
        note "size $gib GiB: after the driver alone the worker did not go on intact (iteration ${ST_ITER:-?}, ok ${ST_OK:-?})"
        return 1
    fi
    return 0
}

# bare_cycle GIB PID NAME REP FP: driver checkpoint, criu dump, wait, criu restore, driver restore.
bare_cycle() {
    local gib=$1 pid=$2 name=$3 rep=$4 fp=$5 dir=$WORK/bare-img fp_mib rss est i t0
    local c_rc c_wall c_drv d_rc d_s g_s img pf_s r_rc r_s u_rc u_wall u_drv
    fp_mib=$(calc %d 'b / 1048576' b="$fp")
    rss=$(vmrss_mib "$pid")
    est=$(calc %.0f 'f + r * 1048576' f="$fp" r="${rss:-0}")
    disk_room "$gib" "$rep" bare "$est" || return 2
    sleep 1
    read_status "$WORK/$name.status"
    i=$ST_ITER

    raw 300 --timeout-ms 30000 "$pid" lock checkpoint
    c_rc=$RAW_RC c_wall=$RAW_S c_drv=$(jget "$RAW_OUT" 'd["driver_ms"]')
    if [ "$c_rc" != 0 ]; then
        note "size $gib GiB rep $rep: bare lock+checkpoint failed ($(raw_rcs)); stopping this size"
        if [ "$(jget "$RAW_OUT" 'd["calls"][0]["rc"]')" = 0 ]; then raw 60 "$pid" unlock; fi
        return 1
    fi
    rm -rf "$dir"
    mkdir -p "$dir"
    log "criu dump -t $pid -D $dir ${CRIU_ARGS[*]}"
    t0=$(now)
    d_rc=0
    timeout -k 10 600 "$CRIU_BIN" dump -t "$pid" -D "$dir" "${CRIU_ARGS[@]}" -o dump.log \
        </dev/null >"$WORK/criu.out" 2>&1 || d_rc=$?
    d_s=$(fsub "$t0" "$(now)")
    log "  -> exit $d_rc in ${d_s}s $(tr '\n' '|' <"$WORK/criu.out" | cut -c1-300)"
    if [ "$d_rc" != 0 ]; then
        note "size $gib GiB rep $rep: criu dump failed (exit $d_rc): $(criu_err "$dir" dump.log); stopping this size"
        log_tail "$dir/dump.log"
        # CRIU leaves the tree running after a failed dump: put it back on the GPU.
        if alive "$pid" && gpu_room "$fp_mib"; then
            mark_restored "$pid"
            raw 300 "$pid" restore unlock
        fi
        rm -rf "$dir"
        return 1
    fi
    t0=$(now)
    reap "$pid"
    wait_gone "$pid" 60 || log "pid $pid still alive 60 s after the dump"
    g_s=$(fsub "$t0" "$(now)")
    img=$(du_bytes "$dir")
    # Wake: the pid must be free (not even a zombie), then CRIU, then the driver.
    t0=$(now)
    wait_pid_free "$pid" 30 || log "pid $pid still held 30 s after the dump"
    pf_s=$(fsub "$t0" "$(now)")
    mark_restored "$pid"
    cold_cache
    log "criu restore -D $dir -d ${CRIU_ARGS[*]}"
    t0=$(now)
    r_rc=0
    timeout -k 10 600 "$CRIU_BIN" restore -D "$dir" -d "${CRIU_ARGS[@]}" -o restore.log \
        </dev/null >"$WORK/criu.out" 2>&1 || r_rc=$?
    r_s=$(fsub "$t0" "$(now)")
    log "  -> exit $r_rc in ${r_s}s $(tr '\n' '|' <"$WORK/criu.out" | cut -c1-300)"
    if [ "$r_rc" != 0 ] || ! alive "$pid"; then
        note "size $gib GiB rep $rep: criu restore failed (exit $r_rc, pid $pid $(alive "$pid" && echo alive || echo gone)): $(criu_err "$dir" restore.log); the worker is lost"
        log_tail "$dir/restore.log"
        rm -rf "$dir"
        return 1
    fi
    if ! gpu_room "$fp_mib"; then
        note "size $gib GiB rep $rep: only $(smi_free_mib) MiB free on the GPU for a $fp_mib MiB restore; stopping this size"
        rm -rf "$dir"
        return 1
    fi
    raw 300 "$pid" restore unlock
    u_rc=$RAW_RC u_wall=$RAW_S u_drv=$(jget "$RAW_OUT" 'd["driver_ms"]')
    rm -rf "$dir"
    if [ "$u_rc" != 0 ]; then
        note "size $gib GiB rep $rep: bare restore+unlock after the CRIU restore failed ($(raw_rcs)); stopping this size"
        return 1
    fi
    sample gib="$gib" rep="$rep" mode=s:bare cold="$HB_COLD" footprint_bytes="$fp" rss_mib_before="$rss" image_bytes="$img" \
        ckpt_wall_s="$c_wall" ckpt_driver_ms="$c_drv" dump_s="$d_s" gone_s="$g_s" \
        hibernate_s="$(calc %.3f 'a + b + c' a="$c_wall" b="$d_s" c="$g_s")" \
        hibernate_driver_s="$(calc %.3f 'a / 1000 + b + c' a="$c_drv" b="$d_s" c="$g_s")" \
        pidfree_s="$pf_s" criu_restore_s="$r_s" restore_wall_s="$u_wall" restore_driver_ms="$u_drv" \
        wake_s="$(calc %.3f 'b + c' b="$r_s" c="$u_wall")" \
        wake_driver_s="$(calc %.3f 'b + c / 1000' b="$r_s" c="$u_drv")"
    if ! worker_on "$name" "$pid" "$i"; then
        note "size $gib GiB rep $rep: after the bare cycle the worker did not go on intact (alive $(alive "$pid" && echo yes || echo no), iteration ${ST_ITER:-?}, ok ${ST_OK:-?}, status pid ${ST_PID:-?})"
        return 1
    fi
    return 0
}

# drop_image NAME: removes a gpusnap image and the chunks no image refers
# to any more (the next hibernate writes all of its chunks again).
drop_image() {
    gs 120 images rm "$1"
    gs 300 images gc
}

# gpusnap_cycle GIB PID NAME REP FP [MODE]: gpusnap hibernate, then wake;
# MODE gpusnap (lazy, default), eager (wake --eager), thp (hibernate --thp).
gpusnap_cycle() {
    local gib=$1 pid=$2 name=$3 rep=$4 fp=$5 mode=${6:-gpusnap} rss est i h_rc h_wall img du
    local h_tot h_sus h_dmp h_wr w_rc w_wall w_tot w_ver w_wait w_criu w_res t0 pf_s w_pages st0 st_new
    local hflags=() wflags=() hx=() wx=()
    [ "$mode" = thp ] && hflags=(--thp)
    [ "$mode" = eager ] && wflags=(--eager)
    rss=$(vmrss_mib "$pid")
    est=$(calc %.0f 'f + r * 1048576' f="$fp" r="${rss:-0}")
    est=$(random_room "$est")
    disk_room "$gib" "$rep" gpusnap "$est" || return 2
    sleep 1
    read_status "$WORK/$name.status"
    i=$ST_ITER

    st0=$(du_bytes "$STATE_DIR/store")
    # shellcheck disable=SC2086 # HBENCH_HIBERNATE_ARGS is a list of flags
    gs 600 hibernate "$pid" --image b ${HBENCH_HIBERNATE_ARGS:-} ${hflags[@]+"${hflags[@]}"}
    h_rc=$GS_RC h_wall=$GS_S
    read -r -a hx <<<"$(hib_extra "$GS_OUT")"
    h_tot=$(jget "$GS_OUT" 'd["total_ms"]') h_sus=$(jget "$GS_OUT" 'd["suspend_ms"]')
    h_dmp=$(jget "$GS_OUT" 'd["dump_ms"]') h_wr=$(jget "$GS_OUT" 'd["write_ms"]')
    img=$(jget "$GS_OUT" 'd["image_bytes"]')
    if [ "$h_rc" != 0 ]; then
        note "size $gib GiB rep $rep: gpusnap hibernate ($mode) failed (exit $h_rc): $GS_MSG; stopping this size"
        return 1
    fi
    # What the hibernate wrote: the image directory and its new chunks.
    st_new=$(calc %.0f 'a - b' a="$(du_bytes "$STATE_DIR/store")" b="$st0")
    du=$(calc %.0f 'a + b' a="$(du_bytes "$STATE_DIR/images/b")" b="$st_new")
    # As in the bare cycle, the wait until the killed worker's pid is free
    # (its parent reaps it: this shell the first time, init after a restore,
    # which can take a second or two) is kept out of the wake's time.
    t0=$(now)
    reap "$pid"
    wait_pid_free "$pid" 30 || log "pid $pid still held 30 s after the hibernate"
    pf_s=$(fsub "$t0" "$(now)")
    mark_restored "$pid"
    cold_cache
    pcie_start "$mode-$gib-$rep"
    gs 600 wake b --wait 30 ${WAKE_ARGS[@]+"${WAKE_ARGS[@]}"} ${wflags[@]+"${wflags[@]}"}
    w_rc=$GS_RC w_wall=$GS_S
    pcie_stop
    read -r -a wx <<<"$(wake_extra "$GS_OUT")"
    w_tot=$(jget "$GS_OUT" 'd["total_ms"]') w_ver=$(jget "$GS_OUT" 'd["verify_ms"]')
    w_wait=$(jget "$GS_OUT" 'd["waited_ms"]') w_criu=$(jget "$GS_OUT" 'd["criu_ms"]')
    w_res=$(jget "$GS_OUT" 'd["restore_ms"]')
    # A lazy wake (the default since the page server): until every page is in.
    w_pages=$(jget "$GS_OUT" 'd.get("stages", {}).get("pages", 0)')
    # A CUDA image's chunks checked in the background of the restore, and
    # what the driver's restore waited for that (inside verify_ms).
    w_vbg=$(jget "$GS_OUT" 'd.get("stages", {}).get("verify_background", 0)')
    w_vwait=$(jget "$GS_OUT" 'd.get("stages", {}).get("verify_wait", 0)')
    if [ "$w_rc" != 0 ]; then
        note "size $gib GiB rep $rep: gpusnap wake ($mode) failed (exit $w_rc): $GS_MSG; stopping this size"
        image_logs b
        drop_image b
        return 1
    fi
    drop_image b
    sample gib="$gib" rep="$rep" mode="s:$mode" settings="s:${REP_ENV[$rep]:--}" cold="$HB_COLD" footprint_bytes="$fp" rss_mib_before="$rss" \
        image_bytes="$du" manifest_bytes="$img" store_new_bytes="$st_new" fill="${WORKER_FILL:-pattern}" \
        hibernate_s="$h_wall" hibernate_total_ms="$h_tot" suspend_ms="$h_sus" dump_ms="$h_dmp" write_ms="$h_wr" \
        pidfree_s="$pf_s" wake_s="$w_wall" wake_total_ms="$w_tot" verify_ms="$w_ver" waited_ms="$w_wait" criu_ms="$w_criu" \
        restore_ms="$w_res" pages_ms="$w_pages" verify_bg_ms="$w_vbg" verify_wait_ms="$w_vwait" ${hx[@]+"${hx[@]}"} ${wx[@]+"${wx[@]}"} \
        ${PCIE_WORDS[@]+"${PCIE_WORDS[@]}"}
    if ! worker_on "$name" "$pid" "$i"; then
        note "size $gib GiB rep $rep: after the gpusnap cycle ($mode) the worker did not go on intact (alive $(alive "$pid" && echo yes || echo no), iteration ${ST_ITER:-?}, ok ${ST_OK:-?}, status pid ${ST_PID:-?})"
        return 1
    fi
    return 0
}

# matrix_cycle GIB PID NAME FP EST_WAKE EST_STOP: one hibernate, then a wake
# per HB_MATRIX entry with its settings, the worker stopped between wakes.
matrix_cycle() {
    local gib=$1 pid=$2 name=$3 fp=$4 est_w=$5 est_s=$6 rss est i k v vname kvs wx=() n=${#MATRIX[@]} left cold
    rss=$(vmrss_mib "$pid")
    est=$(calc %.0f 'f + r * 1048576' f="$fp" r="${rss:-0}")
    est=$(random_room "$est")
    disk_room "$gib" m matrix "$est" || return 2
    gs 600 hibernate "$pid" --image m
    if [ "$GS_RC" != 0 ]; then
        note "size $gib GiB: matrix: gpusnap hibernate failed (exit $GS_RC): $GS_MSG"
        return 1
    fi
    reap "$pid"
    wait_pid_free "$pid" 30 || log "pid $pid still held 30 s after the hibernate"
    for ((k = 0; k < n; k++)); do
        v=${MATRIX[$k]}
        vname=${v%%:*} kvs=""
        [ "$v" != "$vname" ] && kvs=${v#*:}
        left=$((HBENCH_BUDGET_S - SECONDS))
        if [ "$left" -lt $((est_w + est_s + 20)) ]; then
            note "size $gib GiB: matrix: $k of $n entries (budget: ${left}s left; a wake ~${est_w}s, the stop ~${est_s}s)"
            ERRORS=$((ERRORS + 1))
            # The worker is gone (hibernated or stopped): wake it once more,
            # with the defaults, so that the size ends as it began.
            vname=restore kvs=""
            k=$n
        fi
        read_status "$WORK/$name.status"
        i=$ST_ITER
        cold=$HB_COLD
        case $vname in
            cold*) cold_cache force; [ "$(id -u)" = 0 ] && cold=1 ;;
            *) cold_cache ;;
        esac
        mark_restored "$pid"
        knobs_set "$kvs"
        pcie_start "matrix-$vname-$gib"
        gs 600 wake m --wait 30 ${WAKE_ARGS[@]+"${WAKE_ARGS[@]}"}
        pcie_stop
        knobs_clear
        if [ "$GS_RC" != 0 ]; then
            note "size $gib GiB: matrix $vname ($kvs): gpusnap wake failed (exit $GS_RC): $GS_MSG"
            image_logs m
            drop_image m
            return 1
        fi
        read -r -a wx <<<"$(wake_extra "$GS_OUT")"
        [ "$vname" = restore ] || sample gib="$gib" rep=0 mode=s:matrix variant="s:$vname" settings="s:${kvs:--}" \
            cold="$cold" footprint_bytes="$fp" wake_s="$GS_S" wake_total_ms="$(jget "$GS_OUT" 'd["total_ms"]')" \
            verify_ms="$(jget "$GS_OUT" 'd["verify_ms"]')" criu_ms="$(jget "$GS_OUT" 'd["criu_ms"]')" \
            restore_ms="$(jget "$GS_OUT" 'd["restore_ms"]')" pages_ms="$(jget "$GS_OUT" 'd["stages"]["pages"]')" \
            ${wx[@]+"${wx[@]}"} ${PCIE_WORDS[@]+"${PCIE_WORDS[@]}"}
        if ! worker_on "$name" "$pid" "$i"; then
            note "size $gib GiB: matrix $vname: the worker did not go on intact (iteration ${ST_ITER:-?}, ok ${ST_OK:-?})"
            drop_image m
            return 1
        fi
        if [ $((k + 1)) -lt "$n" ]; then
            gs 300 stop "$pid"
            if ! wait_gone "$pid" 60; then
                note "size $gib GiB: matrix: gpusnap stop (exit $GS_RC) left pid $pid alive"
                drop_image m
                return 1
            fi
            wait_pid_free "$pid" 30 || log "pid $pid still held 30 s after the stop"
        fi
    done
    drop_image m
    return 0
}

# bench_size GIB
bench_size() {
    local gib=$1 name="h$1" pid fp smi gbe est_rep est_stop est_drv est_mw left rep mode order t_rep failed=0 done_reps=0 rc
    local k
    # The worker's footprint (worker.py --fill): a pattern's float64 sum
    # leaves a copy twice the tensor in PyTorch's cache (8 GiB: 26.4 GB).
    if [ "${WORKER_FILL:-pattern}" != pattern ]; then
        gbe=$(calc %.2f 'g * 1.073741824 + 1.5' g="$gib")
    else
        gbe=$(calc %.2f 'g * 3.221225472 + 0.6' g="$gib")
    fi
    # Model (shared/gpu-facts.md, THP madvise): checkpoint 1.6 GB/s, CRIU dump
    # 1.5 GB/s, checksum 1.5 GB/s, CRIU restore 3 GB/s, driver restore 4 GB/s;
    # cold: the image read at 1.6 GB/s.
    est_rep=$(calc %d 'n * (g * (1 / 1.6 + 1 / 1.5 + 1 / 3 + 1 / 4) + g / 1.5 + 10 + c * g / 1.6)' \
        g="$gbe" n="${#MODES[@]}" c="$HB_COLD")
    est_stop=$(calc %d 'g / 1.6 + 20' g="$gbe")
    est_drv=$(calc %d 'g / 1.6 + g / 4 + 15' g="$gbe")
    est_mw=$(calc %d 'g / 4 + 10 + c * g / 1.6' g="$gbe" c="$HB_COLD")
    left=$((HBENCH_BUDGET_S - SECONDS))
    log "size $gib GiB (~$gbe GB image): $REPS reps of ${MODES[*]} planned; estimates: rep ${est_rep}s, stop ${est_stop}s, driver alone ${est_drv}s, matrix wake ${est_mw}s; ${left}s left"
    size_fits "$gib" "$gbe" "$left" $((45 + est_rep + est_stop)) || return 0

    size_worker "$name" "$gib" || return 0
    pid=$LAST_PID
    gs 30 state "$pid"
    fp=$(jget "$GS_OUT" 'd["footprint_bytes"]')
    smi=$(smi_pid_mib "$pid")
    log "size $gib GiB: footprint gpusnap ${fp:-?} B, nvidia-smi ${smi:-?} MiB, host RSS $(vmrss_mib "$pid") MiB"
    fp=${fp:-$(calc %.0f 'm * 1048576' m="${smi:-0}")}

    if [ "$HB_DRIVER" = 1 ]; then
        if [ $((HBENCH_BUDGET_S - SECONDS)) -ge $((est_drv + est_rep + est_stop + 10)) ]; then
            driver_cycle "$gib" "$pid" "$name" "$fp" || ERRORS=$((ERRORS + 1))
        else
            note "size $gib GiB: driver alone skipped (budget)"
        fi
    fi
    for ((rep = 1; rep <= REPS; rep++)); do
        left=$((HBENCH_BUDGET_S - SECONDS))
        if [ "$left" -lt $((est_rep + est_stop + 10)) ]; then
            note "size $gib GiB: $done_reps of $REPS reps (budget: ${left}s left, a rep takes ~${est_rep}s, the stop ~${est_stop}s)"
            ERRORS=$((ERRORS + 1))
            break
        fi
        t_rep=$SECONDS
        # The modes alternate: as given in odd reps, reversed in even ones.
        order=""
        for ((k = 0; k < ${#MODES[@]}; k++)); do
            if [ $((rep % 2)) = 1 ]; then order="$order ${MODES[$k]}"; else order="${MODES[$k]} $order"; fi
        done
        for mode in $order; do
            rc=0
            if [ "$mode" = bare ]; then
                bare_cycle "$gib" "$pid" "$name" "$rep" "$fp" || rc=$?
            else
                knobs_set "${REP_ENV[$rep]:-}"
                gpusnap_cycle "$gib" "$pid" "$name" "$rep" "$fp" "$mode" || rc=$?
                knobs_clear
            fi
            if [ "$rc" != 0 ]; then failed=1; break; fi
        done
        if [ "$failed" = 1 ]; then ERRORS=$((ERRORS + 1)); break; fi
        done_reps=$rep
        est_rep=$((SECONDS - t_rep))
        log "size $gib GiB: rep $rep took ${est_rep}s"
    done

    if [ "$HB_DRIVER_WOKEN" = 1 ] && [ "$failed" = 0 ] && alive "$pid"; then
        if [ $((HBENCH_BUDGET_S - SECONDS)) -ge $((est_drv + est_stop + 10)) ]; then
            driver_cycle "$gib" "$pid" "$name" "$fp" driver_woken || ERRORS=$((ERRORS + 1))
        else
            note "size $gib GiB: driver alone on the woken worker skipped (budget)"
        fi
    fi

    if [ "${#MATRIX[@]}" -gt 0 ] && [ "$failed" = 0 ] && alive "$pid"; then
        left=$((HBENCH_BUDGET_S - SECONDS))
        if [ "$left" -lt $((est_rep / ${#MODES[@]} + est_mw + est_stop + 10)) ]; then
            note "size $gib GiB: matrix skipped (budget: ${left}s left)"
            ERRORS=$((ERRORS + 1))
        elif ! matrix_cycle "$gib" "$pid" "$name" "$fp" "$est_mw" "$est_stop"; then
            ERRORS=$((ERRORS + 1))
        fi
    fi
    if ! alive "$pid"; then
        note "size $gib GiB: the worker (pid $pid) is gone"
        return 0
    fi
    size_stop "$gib" "$pid"
    return 0
}

# shellcheck disable=SC2317 # runs from the EXIT trap
write_report() {
    python3 - "$SAMPLES" "$NOTES" "$OUT/bench-hibernate.md" "$OUT/bench-hibernate.json" <<'PY'
import json, os, statistics, sys

samples_f, notes_f, md_f, json_f = sys.argv[1:5]
E = os.environ
samples = [json.loads(l) for l in open(samples_f) if l.strip()]
notes = [l.rstrip("\n") for l in open(notes_f) if l.strip()]
TARGET = 1.05


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def f(x, d=2):
    return "?" if x is None else f"{x:.{d}f}"


def ms(x):
    return None if x is None else x / 1e3


def div(a, b):
    return a / b if a is not None and b else None


sizes = []
for s in samples:
    if s["mode"] != "disk" and s["gib"] not in sizes:
        sizes.append(s["gib"])
summary, breakdown = [], []
for g in sizes:
    B = [s for s in samples if s["gib"] == g and s["mode"] == "bare"]
    G = [s for s in samples if s["gib"] == g and s["mode"] == "gpusnap"]
    m = lambda rows, k: med([r.get(k) for r in rows])
    mm = lambda rows, k: ms(m(rows, k))
    fp = med([s.get("footprint_bytes") for s in B + G])
    for op in ("hibernate", "wake"):
        bare_s, bare_drv = m(B, f"{op}_s"), m(B, f"{op}_driver_s")
        gs_wall, gs_int = m(G, f"{op}_s"), mm(G, f"{op}_total_ms")
        r = {"gib": g, "footprint_gb": fp / 1e9 if fp else None, "op": op, "n_bare": len(B), "n_gpusnap": len(G),
             "bare_s": bare_s, "bare_driver_s": bare_drv, "gpusnap_wall_s": gs_wall, "gpusnap_internal_s": gs_int,
             "ratio": div(gs_wall, bare_s), "ratio_internal": div(gs_int, bare_s),
             "ratio_vs_driver": div(gs_wall, bare_drv)}
        r["met"] = None if r["ratio"] is None else r["ratio"] <= TARGET
        summary.append(r)
    # Where the time goes: medians of each stage.
    hw, ww = m(G, "hibernate_s"), m(G, "wake_s")
    hs, hd, hwr, ht = mm(G, "suspend_ms"), mm(G, "dump_ms"), mm(G, "write_ms"), mm(G, "hibernate_total_ms")
    wv, wwt, wc, wr, wt = mm(G, "verify_ms"), mm(G, "waited_ms"), mm(G, "criu_ms"), mm(G, "restore_ms"), mm(G, "wake_total_ms")
    rest = lambda tot, *xs: None if tot is None or None in xs else tot - sum(xs)
    breakdown.append({"gib": g, "rows": [
        ("hibernate", "driver: lock + checkpoint", mm(B, "ckpt_driver_ms"), hs,
         "bare: the two driver calls; gpusnap: its suspend (also records the footprint, checks NVML)"),
        ("hibernate", "checkpoint process (python + cuInit)", m(B, "ckpt_wall_s"), None, "bare only: cuckpt.py as a whole"),
        ("hibernate", "CRIU dump", m(B, "dump_s"), hd, "gpusnap: -v4 log, --leave-stopped"),
        ("hibernate", "of it: CRIU's drain / its write", None, None,
         "gpusnap: %s / %s s (CRIU's statistics)" % (f(mm(G, "criu_drain_ms")), f(mm(G, "criu_memwrite_ms")))),
        ("hibernate", "of the write: the FIFOs' readers waited for CRIU / a copier / a buffer / the checksum", None, None,
         "gpusnap: %s / %s / %s / %s s of %s s read (stages.fifo)" % tuple(
             f(mm(G, "fifo_" + k)) for k in ("wait_criu_ms", "wait_room_ms", "wait_buffer_ms", "wait_hash_ms", "read_ms"))),
        ("hibernate", "of the write: copiers copying / chunkers at work (summed over threads)", None, None,
         "gpusnap: %s s on %s copiers / %s s on %s chunkers" % (
             f(mm(G, "fifo_copy_ms")), f(m(G, "fifo_copiers"), 0), f(mm(G, "fifo_chunk_ms")), f(m(G, "fifo_chunkers"), 0))),
        ("hibernate", "until the tree is gone", m(B, "gone_s"), None, "gpusnap: inside 'other'"),
        ("hibernate", "checksum + manifest + rename (disk)", None, hwr, "gpusnap only"),
        ("hibernate", "other (inside gpusnap)", None, rest(ht, hs, hd, hwr), "tree walk, store, kill, wait"),
        ("hibernate", "process start etc. (outside total_ms)", None, rest(hw, ht), "gpusnap wall - total_ms"),
        ("hibernate", "TOTAL (wall)", m(B, "hibernate_s"), hw, ""),
        ("wake", "(before) until the pid is free", m(B, "pidfree_s"), m(G, "pidfree_s"),
         "its parent reaps the killed worker; outside both totals"),
        ("wake", "pid check + admission", None, wwt, "gpusnap: waited_ms"),
        ("wake", "verify: checksum of the image (disk)", None, wv,
         "gpusnap only: before CRIU + the driver's wait for the background verify (next rows)"),
        ("wake", "verify in the background (CUDA image)", None, mm(G, "verify_bg_ms"),
         "from before CRIU's restore to its end; overlaps CRIU and the page server"),
        ("wake", "of which the driver waited for", None, mm(G, "verify_wait_ms"), "inside verify above"),
        ("wake", "CRIU restore", m(B, "criu_restore_s"), wc, ""),
        ("wake", "driver: restore + unlock", mm(B, "restore_driver_ms"), wr, "bare: the two driver calls"),
        ("wake", "page server: CRIU's return until every page is in", None, mm(G, "pages_ms"),
         "lazy wake only (0 with --eager in HB_WAKE_ARGS); overlaps the driver's restore"),
        ("wake", "restore process (python + cuInit)", m(B, "restore_wall_s"), None, "bare only: cuckpt.py as a whole"),
        ("wake", "other (inside gpusnap)", None, rest(wt, wv, wwt, wc, wr), "lazy: includes the wait for the last pages after the driver"),
        ("wake", "process start etc. (outside total_ms)", None, rest(ww, wt), "gpusnap wall - total_ms"),
        ("wake", "TOTAL (wall)", m(B, "wake_s"), ww, ""),
    ], "images": {"bare_du_bytes": m(B, "image_bytes"), "gpusnap_du_bytes": m(G, "image_bytes"),
                  "gpusnap_manifest_bytes": m(G, "manifest_bytes"),
                  "rss_mib_before": med([s.get("rss_mib_before") for s in B + G])},
        "split": {"driver_s": None if None in (hs, wr) else hs + wr,
                  "criu_s": None if None in (hd, wc) else hd + wc,
                  "disk_checksum_s": None if None in (hwr, wv) else hwr + wv,
                  "cycle_wall_s": None if None in (hw, ww) else hw + ww}})

# The targets against the driver alone and the disk, and the page server.
disk = next((s for s in samples if s["mode"] == "disk"), {})
dw, dr = disk.get("write_gbps"), disk.get("read_gbps")
cold_run = E.get("B_COLD") == "1"
targets, dumps, pagers = [], [], []
for g in sizes:
    at = lambda mode: [s for s in samples if s["gib"] == g and s["mode"] == mode]
    m = lambda rows, k: med([r.get(k) for r in rows])
    D, B = at("driver"), at("bare")
    drv = ms(m(D, "restore_driver_ms"))
    drv_src = "driver alone"
    if drv is None:
        drv, drv_src = ms(m(B, "restore_driver_ms")), "bare (after CRIU's restore)"
    sus_alone = ms(m(D, "ckpt_driver_ms"))
    for mode, label in (("gpusnap", "lazy (default)"), ("eager", "--eager"), ("thp", "--thp (lazy)")):
        R = at(mode)
        if not R:
            continue
        img = m(R, "image_bytes")
        wake, hib, sus = m(R, "wake_s"), m(R, "hibernate_s"), ms(m(R, "suspend_ms"))
        if cold_run:
            rd = None if img is None or not dr else img / 1e9 / dr
            lim = None if drv is None else max(drv, rd or 0)
            targets.append((g, f"wake {label}, cold", wake, lim, 1.2,
                            f"max(image {f(rd)} s at {f(dr)} GB/s read, driver restore {f(drv)} s ({drv_src}))"))
        else:
            targets.append((g, f"wake {label}, warm", wake, drv, 1.3, f"driver restore {f(drv)} s ({drv_src})"))
        wr = None if img is None or not dw else img / 1e9 / dw
        lim = None if None in (sus, wr) else sus + wr
        targets.append((g, f"hibernate {label}", hib, lim, 1.2,
                        f"suspend {f(sus)} s + image {f((img or 0) / 1e9)} GB at {f(dw)} GB/s write = {f(wr)} s"))
        cw = m(R, "criu_memwrite_ms")
        pw = m(R, "criu_pages_written")
        dumps.append((g, label, sus, sus_alone, ms(m(R, "dump_ms")), ms(m(R, "criu_frozen_ms")), ms(m(R, "criu_drain_ms")),
                      ms(cw), None if not cw or pw is None else pw * 4096 / 1e9 / (cw / 1e3), ms(m(R, "commit_ms")),
                      (img or 0) / 1e9, wr, hib,
                      None if m(R, "follow_overlapped_bytes") is None else m(R, "follow_overlapped_bytes") / 1e9,
                      ms(m(R, "follow_finish_ms"))))
    for s in samples:
        if s["gib"] != g or not s.get("lazy"):
            continue
        name = s["mode"] if s["mode"] != "matrix" else f"matrix {s.get('variant')}"
        pagers.append((g, name, s.get("settings") or "-", s.get("cold"), s.get("wake_s"), ms(s.get("restore_ms")),
                       ms(s.get("head_start_ms")), ms(s.get("pages_ms")), s.get("p_faults"), s.get("p_faults_in_flight"),
                       s.get("p_faults_backward"), (s.get("p_fault_bytes") or 0) / 1e9, (s.get("p_fill_bytes") or 0) / 1e9,
                       s.get("p_eexist_pages"), s.get("p_fill_gbps"),
                       None if s.get("p_last_page_ms") is None or s.get("p_restore_done_ms") is None
                       else (s["p_last_page_ms"] - s["p_restore_done_ms"]) / 1e3,
                       s.get("o_threads"), s.get("o_wake_chunk"), drv))

L = ["# gpusnap benchmark: hibernate/wake against the bare driver + CRIU calls", ""]
L.append(f"- date: {E.get('HDR_DATE')}")
L.append(f"- host: {E.get('HDR_HOST')} (kernel {E.get('HDR_KERNEL')}, host memory {E.get('HDR_HOSTMEM')})")
L.append(f"- GPU: {E.get('HDR_GPU')}, {E.get('HDR_GPU_MEM')}; driver {E.get('HDR_DRIVER')}")
L.append(f"- gpusnap: {E.get('HDR_VERSION')} ({E.get('GPUSNAP')}); wake args: `{E.get('B_WAKE_ARGS') or '-'}`")
L.append(f"- criu: {E.get('B_CRIU')} version {E.get('B_CRIU_VERSION')}; criu check: {E.get('B_CRIU_CHECK')}; "
         f"bare flags `{E.get('B_CRIU_ARGS')}` (gpusnap: --shell-job --file-locks --ext-unix-sk --tcp-established, -v4)")
L.append(f"- THP: enabled `{E.get('HDR_THP')}`, defrag `{E.get('HDR_THP_DEFRAG')}` (read, not changed); "
         f"images on {E.get('B_DISK')}")
L.append(f"- sizes (GiB held by the worker): {E.get('B_SIZES')}; {E.get('B_REPS')} reps of {E.get('B_MODES')}; wall {E.get('B_WALL')} s; "
         f"page cache {'dropped before every wake (cold)' if cold_run else 'warm'}; wake-settings matrix `{E.get('B_MATRIX') or '-'}`")
L.append("- bare hibernate = cuckpt.py lock+checkpoint (whole python process) + `criu dump -t PID -D DIR` "
         "+ until the pid is gone; bare wake = `criu restore -D DIR -d` + "
         "cuckpt.py restore+unlock. Both modes wait until the old pid is free before the wake (not counted). gpusnap = `gpusnap --json hibernate PID --image b` / `wake b --wait 30`, "
         "whole commands timed from the shell; internal = their total_ms. Medians; the modes alternate.")
L.append(f"- target: gpusnap wall <= {TARGET} x bare (whole processes on both sides); "
         "'vs driver' counts the bare driver calls without their python process.")
L.append("")
L.append("| size GiB | footprint GB | op | n (bare / gpusnap) | bare s | bare (driver calls only) s | gpusnap wall s "
         "| gpusnap internal s | gpusnap / bare | gpusnap / bare (driver only) | target met |")
L.append("|---|---|---|---|---|---|---|---|---|---|---|")
yn = lambda v: "?" if v is None else ("yes" if v else "**no**")
for r in summary:
    L.append(f"| {r['gib']} | {f(r['footprint_gb'])} | {r['op']} | {r['n_bare']} / {r['n_gpusnap']} | {f(r['bare_s'], 3)} "
             f"| {f(r['bare_driver_s'], 3)} | {f(r['gpusnap_wall_s'], 3)} | {f(r['gpusnap_internal_s'], 3)} "
             f"| {f(r['ratio'], 3)} | {f(r['ratio_vs_driver'], 3)} | {yn(r['met'])} |")
for b in breakdown:
    L += ["", f"## Where the time goes: {b['gib']} GiB (medians, s)", "",
          "| op | stage | bare | gpusnap | note |", "|---|---|---|---|---|"]
    for op, stage, x, y, n in b["rows"]:
        L.append(f"| {op} | {stage} | {f(x, 3) if x is not None else '-'} | {f(y, 3) if y is not None else '-'} | {n} |")
    im, sp = b["images"], b["split"]
    L.append("")
    gb = lambda x: "?" if x is None else f"{x / 1e9:.2f}"
    L.append(f"Images: bare {gb(im['bare_du_bytes'])} GB (du -sb), gpusnap {gb(im['gpusnap_du_bytes'])} GB "
             f"written (du -sb of the image directory + the growth of STATE/store: its chunks as stored; "
             f"logical, the manifest's: {gb(im['gpusnap_manifest_bytes'])} GB); worker memory {E.get('B_FILL', 'pattern')}; "
             f"worker host RSS before "
             f"{f((im['rss_mib_before'] or 0) * 1048576 / 1e9)} GB.")
    c = sp["cycle_wall_s"]
    if c:
        pc = lambda x: "?" if x is None else f"{x:.2f} s ({100 * x / c:.0f}%)"
        L.append(f"gpusnap cycle (hibernate + wake) {c:.2f} s: driver {pc(sp['driver_s'])}, CRIU {pc(sp['criu_s'])}, "
                 f"disk/checksum {pc(sp['disk_checksum_s'])}, rest "
                 f"{pc(None if None in sp.values() else c - sp['driver_s'] - sp['criu_s'] - sp['disk_checksum_s'])}.")
if targets:
    L += ["", f"## Targets{' - cold: page cache dropped before every wake' if cold_run else ' - warm page cache'}", "",
          f"Disk (scratch, dd {E.get('B_DD_GIB')} GiB): write {f(dw)} GB/s (conv=fdatasync), cold read {f(dr)} GB/s.", "",
          "| size GiB | what | gpusnap s | limit s | ratio | target | met | limit from |", "|---|---|---|---|---|---|---|---|"]
    for g, what, x, lim, tgt, why in targets:
        r = div(x, lim)
        L.append(f"| {g} | {what} | {f(x, 3)} | {f(lim, 3)} | {f(r, 3)} | <= {tgt} | {yn(None if r is None else r <= tgt)} | {why} |")
if dumps:
    L += ["", "## Where the dump goes (CRIU's stats-dump; medians, s)", "",
          "| size GiB | mode | suspend | driver checkpoint alone | CRIU dump | CRIU frozen | drain (parasite) | memwrite | CRIU write GB/s | commit (checksum, chunks, flush) | image GB | image at disk write speed | hibernate | chunked during the dump GB | chunking after the dump s |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for d in dumps:
        L.append("| " + " | ".join([str(d[0]), d[1]] + [f(x, 3) for x in d[2:8]] + [f(d[8]), f(d[9], 3), f(d[10]), f(d[11], 3), f(d[12], 3), f(d[13]), f(d[14], 3)]) + " |")
if pagers:
    L += ["", "## The page server in each lazy wake", "",
          "driver = the CUDA restores (the driver's restore alone: the last column); pages = CRIU's return until the "
          "last page; fill = the restore's end until the last page; faults in flight waited for a fill's WAKE.", "",
          "| size GiB | wake | settings | cold | wake s | driver s | head start s | pages s | faults | in flight | backward "
          "| fault GB | fill GB | EEXIST pages | fill GB/s | fill s | threads | wake chunk | driver alone s |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in pagers:
        L.append("| " + " | ".join([str(p[0]), p[1], p[2], str(p[3]), f(p[4], 3), f(p[5], 3), f(p[6], 3), f(p[7], 3),
                                    str(p[8]), str(p[9]), str(p[10]), f(p[11]), f(p[12]), str(p[13]), f(p[14]), f(p[15], 3),
                                    str(p[16]), str(p[17]), f(p[18], 3)]) + " |")
L += ["", "## Every sample", "",
      "| size GiB | rep | mode | hibernate s | wake s | image GB | detail |", "|---|---|---|---|---|---|---|"]
skip = {"gib", "rep", "mode", "hibernate_s", "wake_s", "image_bytes"}
for s in samples:
    det = ", ".join(f"{k} {v}" for k, v in s.items() if k not in skip and v is not None)
    L.append(f"| {s['gib']} | {s['rep']} | {s['mode']} | {f(s.get('hibernate_s'), 3)} | {f(s.get('wake_s'), 3)} "
             f"| {f((s.get('image_bytes') or 0) / 1e9)} | {det} |")
if notes:
    L += ["", "## Notes", ""] + [f"- {n}" for n in notes]
md = "\n".join(L) + "\n"
open(md_f, "w").write(md)
hdr = {k: E.get(k) for k in ("HDR_DATE", "HDR_HOST", "HDR_KERNEL", "HDR_GPU", "HDR_GPU_MEM", "HDR_DRIVER",
                             "HDR_VERSION", "HDR_THP", "HDR_THP_DEFRAG", "HDR_HOSTMEM", "B_SIZES", "B_REPS", "B_WALL",
                             "B_CRIU", "B_CRIU_VERSION", "B_CRIU_CHECK", "B_CRIU_ARGS", "B_WAKE_ARGS", "B_DISK",
                             "B_COLD", "B_DD_GIB", "B_MODES", "B_MATRIX")}
json.dump({"header": hdr, "target": TARGET, "summary": summary,
           "p7": {"disk": disk, "targets": [dict(zip(("gib", "what", "gpusnap_s", "limit_s", "target", "limit_from"),
                                                     (t[0], t[1], t[2], t[3], t[4], t[5]))) for t in targets]},
           "breakdown": [{"gib": b["gib"], "stages": [dict(zip(("op", "stage", "bare_s", "gpusnap_s", "note"), r))
                                                      for r in b["rows"]], "images": b["images"], "split": b["split"]}
                         for b in breakdown],
           "samples": samples, "notes": notes}, open(json_f, "w"), indent=1)
sys.stdout.write(md)
PY
}

# shellcheck disable=SC2317 # the EXIT trap
on_exit() {
    local rc=$?
    trap - ERR
    note_interrupted "$rc"
    cleanup_all
    rm -rf "$WORK/bare-img"
    note_left_alive
    HDR_DATE=$HDR_DATE HDR_HOST=$HDR_HOST HDR_KERNEL=$HDR_KERNEL HDR_GPU=$HDR_GPU HDR_GPU_MEM=$HDR_GPU_MEM \
        HDR_DRIVER=$HDR_DRIVER HDR_VERSION=$HDR_VERSION HDR_THP=$HDR_THP HDR_THP_DEFRAG=$HDR_THP_DEFRAG \
        HDR_HOSTMEM=$HDR_HOSTMEM GPUSNAP=$GPUSNAP B_SIZES="${SIZES[*]}" B_REPS=$REPS B_WALL=$SECONDS \
        B_CRIU=$CRIU_BIN B_CRIU_VERSION=$CRIU_VERSION B_CRIU_CHECK="exit $CRIU_CHECK_RC: $CRIU_CHECK" \
        B_CRIU_ARGS="${CRIU_ARGS[*]}" B_WAKE_ARGS="${WAKE_ARGS[*]}" B_COLD=$HB_COLD B_DD_GIB=$HB_DD_GIB \
        B_MODES="${MODES[*]}" B_MATRIX="${HB_MATRIX:-}" B_FILL="${WORKER_FILL:-pattern}" B_DISK="$(df -P -h "$WORK" 2>/dev/null | awk 'NR == 2 { print $1 " (" $2 ", " $4 " free at the end)" }')" \
        write_report || log "report generation failed"
    local p
    for p in "$WORK"/*.log; do log_file "$(basename "$p")" "$p"; done
    log "scratch kept in $WORK"
    if [ "$ERRORS" -gt 0 ]; then exit 1; fi
    exit 0
}

install_traps
start_watchdog $((HBENCH_BUDGET_S + 45))
log "gpusnap hibernate benchmark: sizes ${SIZES[*]} GiB (worker memory ${WORKER_FILL:-pattern}), $REPS reps of ${MODES[*]}, driver alone $HB_DRIVER (on the woken worker $HB_DRIVER_WOKEN), cold $HB_COLD, matrix '${HB_MATRIX:-}', per-rep settings '${HB_REP_ENV:-}', disk $HB_DISK, budget ${HBENCH_BUDGET_S}s"
collect_header
log "disk: $(df -P -h "$WORK" | tail -n 1)"
if [ -n "${HB_WAKE_ARGS+x}" ]; then
    read -r -a WAKE_ARGS <<<"$HB_WAKE_ARGS"
elif timeout 30 "$GPUSNAP" wake --help 2>/dev/null | grep -q -- '--no-guard'; then
    WAKE_ARGS=(--no-guard)
fi
if [ "$HDR_VERSION_RC" != 0 ]; then
    note "gpusnap --version failed (exit $HDR_VERSION_RC): $HDR_VERSION"
    ERRORS=$((ERRORS + 1))
elif ! criu_probe; then
    note "no usable CRIU: $CRIU_WHY"
    ERRORS=$((ERRORS + 1))
else
    if [ "$HB_DISK" = 1 ]; then disk_speed; fi
    for s in "${SIZES[@]}"; do
        bench_size "$s"
    done
fi
FINISHED=1
exit 0   # on_exit writes the report and sets the exit status
