#!/usr/bin/env bash
# What slows the driver's restore beside gpusnap's page server (the warm
# wake of a model's weights). The driver's restore alone reads ~9-10 GB/s
# from host memory; under a lazy wake 4-7 GB/s while the fill runs. This
# times the bare driver restore (tests/gpu/cuckpt.py) of one worker again and
# again, each time beside another load made by bench/gpu/memload.c in another
# process (memory copies like the fill's, reads like the verify's, paced or
# not, pinned or not; the worker's threads pinned apart or not), and samples
# which of the worker's threads work during the restore and on which CPUs
# (bench/gpu/thread-trace.py) and the GPU's PCIe receive rate
# (bench/gpu/pcie-trace.py). Then, on the same host, CONTEND_WAKES lazy
# `gpusnap wake`s of that worker with the same samplers, so each load can be
# set against the real thing.
#
# Run from the repository root, on a machine with a GPU, as root:
#   OUT=/some/dir bench/gpu/contend.sh
# Environment:
#   GPUSNAP          the binary (default ./target/release/gpusnap)
#   CONTEND_GIB      worker size in GiB (default 23)
#   WORKER_FILL      the worker's memory (default weights)
#   CONTEND_LOADS    the samples, in order, separated by spaces; each
#                    LABEL[=THREADS:MODE:GBPS:LOADCPUS:WORKERCPUS] (none
#                    for no load; MODE copy|fill|read|spin; GBPS 0 unpaced;
#                    LOADCPUS the CPUs memload's threads are pinned to, in
#                    turn; WORKERCPUS the CPUs every thread of the worker is
#                    pinned to for the restore, its mask put back after);
#                    default: see CONTEND_LOADS below
#   CONTEND_WAKES    lazy wakes at the end (default 2; 0: none)
#   CONTEND_WAKE_ENV settings for those wakes, taken in turn, one wake each:
#                    LABEL:VAR=VALUE,...;LABEL2:...  (default: one entry,
#                    "base:", the defaults)
#   CONTEND_PROBE    1 (default): the memload probe first; 0: not
#   CONTEND_MAP      1: build the image's map file after the hibernate
#                    (gpusnap images map; wakes then map the host copy
#                    unless their settings have GPUSNAP_MAP=0); 0 (default)
#   CONTEND_BUDGET_S soft budget (default 360): samples stop when less than
#                    a sample is left; a watchdog ends the run 60 s after it
# Writes $OUT/contend.md (the tables), $OUT/contend.log, and per sample the
# traces $OUT/pcie-*.tsv and $OUT/threads-*.tsv.
# Exit 0 when every sample ran and the worker's checksum held after each.

NAME=contend # read by lib.sh
# shellcheck source=tests/gpu/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/../../tests/gpu/lib.sh"
# This directory: the probes and workloads only the benchmarks use.
BENCH_GPU_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

CONTEND_GIB=${CONTEND_GIB:-23}
export WORKER_FILL=${WORKER_FILL:-weights}
NCPU=$(nproc)
HALF=$((NCPU / 2))
CONTEND_LOADS=${CONTEND_LOADS:-"none copy8=8:copy:0 fill8r13=8:fill:13 read8=8:read:0 none2 fill8r13apart=8:fill:13:$HALF-$((NCPU - 1)):0-$((HALF - 1)) copy4=4:copy:0 fill8r7=8:fill:7 none3"}
CONTEND_WAKES=${CONTEND_WAKES:-2}
CONTEND_WAKE_ENV=${CONTEND_WAKE_ENV:-base:}
CONTEND_BUDGET_S=${CONTEND_BUDGET_S:-360}
CONTEND_PROBE=${CONTEND_PROBE:-1}
CONTEND_MAP=${CONTEND_MAP:-0}
SAMPLES=$WORK/samples.tsv # label load restore_ms driver_ms load_gbps pcie_mid pcie_t10 pcie_t90 threads...
: >"$SAMPLES"
MEMLOAD=""
ERRORS=0
PROBE=""

# shellcheck disable=SC2317 # runs from the EXIT trap
write_report() {
    local md=$OUT/contend.md
    {
        echo "# gpusnap: the driver's restore beside other memory traffic"
        echo
        echo "- date: $HDR_DATE"
        echo "- host: $HDR_HOST (kernel $HDR_KERNEL, host memory $HDR_HOSTMEM)"
        echo "- GPU: $HDR_GPU, $HDR_GPU_MEM; driver $HDR_DRIVER; THP $HDR_THP"
        echo "- gpusnap: $HDR_VERSION ($GPUSNAP)"
        echo "- worker: $CONTEND_GIB GiB of $WORKER_FILL; wall ${SECONDS} s; errors $ERRORS"
        echo "- restore = cuckpt.py restore+unlock of the worker (driver_ms: the two calls); wake = gpusnap --json wake (its restore_ms: the driver's calls under the page server)"
        echo "- load: memload (bench/gpu/memload.c) THREADS MODE at GBPS (0: as fast as it goes), pinned to LOADCPUS; worker pinned to WORKERCPUS for the restore"
        echo
        echo "## memload probe: one thread's copy rate on CPU 0, alone and beside other copying CPUs"
        echo
        echo '```'
        printf '%s\n' "${PROBE:-not run}"
        echo '```'
        echo
        echo "## Samples"
        echo
        echo "| label | load | restore s | driver calls s | load GB/s | PCIe mid GB/s | PCIe t10 / t90 s | worker threads: CPU s (busiest, its share of the span) | busiest threads tid:comm:cpu_s:CPUs |"
        echo "|---|---|---|---|---|---|---|---|---|"
        while IFS=$'\t' read -r label load rs dms lg pm p10 p90 tcpu ttop tshare tlist; do
            echo "| $label | $(cell "$load") | $rs | $dms | $lg | $pm | $p10 / $p90 | $tcpu ($ttop, $tshare) | $(cell "$tlist") |"
        done <"$SAMPLES"
    } >"$md"
    cat "$md"
}

# shellcheck disable=SC2317 # the EXIT trap
on_exit() {
    local rc=$?
    trap - ERR
    cleanup_all
    write_report
    log "exit: rc $rc, errors $ERRORS"
    [ "$ERRORS" = 0 ] && [ "$rc" = 0 ] && [ -z "$LEFT_ALIVE" ] && exit 0
    exit 1
}

# build_memload: compiles bench/gpu/memload.c, or takes .dev/memload.
build_memload() {
    if command -v cc >/dev/null && cc -O2 -pthread -o "$WORK/memload" "$BENCH_GPU_DIR/memload.c" 2>>"$LOG"; then
        MEMLOAD=$WORK/memload
    elif [ -x .dev/memload ]; then
        MEMLOAD=$PWD/.dev/memload
    fi
    log "memload: ${MEMLOAD:-none (no compiler, no .dev/memload)}"
}

# word KEY WORDS: the value of KEY=VALUE among the space-separated WORDS.
word() { printf '%s\n' "$2" | tr ' ' '\n' | sed -n "s/^$1=//p"; }

# traces_start TAG PID / traces_stop: the PCIe and thread samplers around a
# restore; traces_stop sets PCIE_MID, PCIE_T10, PCIE_T90 (pcie-trace.py's
# summary) and THR_CPU, THR_TOP, THR_SHARE, THR_LIST (thread-trace.py's).
traces_start() {
    rm -f "$WORK/tr.stop"
    TR_PCIE=$OUT/pcie-$1.tsv
    TR_THR=$OUT/threads-$1.tsv
    python3 "$BENCH_GPU_DIR/pcie-trace.py" sample "$TR_PCIE" "$WORK/tr.stop" --max 300 2>>"$LOG" &
    TR_P1=$!
    python3 "$BENCH_GPU_DIR/thread-trace.py" sample "$2" "$TR_THR" "$WORK/tr.stop" --max 300 2>>"$LOG" &
    TR_P2=$!
    sleep 0.3
    TR_T0=$(now)
}
traces_stop() {
    local p t
    sleep 0.2
    touch "$WORK/tr.stop"
    wait "$TR_P1" "$TR_P2" 2>/dev/null
    p=$(python3 "$BENCH_GPU_DIR/pcie-trace.py" summary "$TR_PCIE" "$TR_T0" 2>&1 | head -n 1)
    t=$(python3 "$BENCH_GPU_DIR/thread-trace.py" summary "$TR_THR" 2>&1 | head -n 1)
    log "pcie: $p"
    log "threads: $t"
    PCIE_MID=$(word pcie_mid_gbps "$p") PCIE_T10=$(word pcie_t10_s "$p") PCIE_T90=$(word pcie_t90_s "$p")
    THR_CPU=$(word threads_cpu_s "$t") THR_TOP=$(word threads_top_cpu_s "$t")
    THR_SHARE=$(word threads_top_share "$t") THR_LIST=$(word threads_top "$t")
}

# sample_row LABEL LOAD SECONDS DRIVER_SECONDS LOAD_GBPS: a row of the
# samples' table, with the traces' figures traces_stop set.
sample_row() {
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" \
        "${PCIE_MID:-?}" "${PCIE_T10:-?}" "${PCIE_T90:-?}" "${THR_CPU:-?}" "${THR_TOP:-?}" "${THR_SHARE:-?}" "${THR_LIST:-?}" >>"$SAMPLES"
}

# checksum_ok NAME: the worker goes on with ok=1 after a restore.
checksum_ok() {
    local i0
    read_status "$WORK/$1.status" || return 1
    i0=$ST_ITER
    wait_iter_gt "$1" "$i0" 60 || return 1
    [ "$ST_OK" = 1 ]
}

# one_sample NAME PID SPEC
one_sample() {
    local name=$1 pid=$2 spec=$3 label load th mode gbps lcpus wcpus mask="" lpid="" lg="-" dms rs
    label=${spec%%=*}
    load=${spec#*=}
    [ "$load" = "$spec" ] && load=""
    IFS=: read -r th mode gbps lcpus wcpus <<<"$load"
    log "sample $label: load '${load:-none}'"
    raw 120 --timeout-ms 30000 "$pid" suspend
    if [ "$RAW_RC" != 0 ]; then
        log "sample $label: suspend failed"
        ERRORS=$((ERRORS + 1))
        return 1
    fi
    if [ -n "$wcpus" ]; then
        mask=$(taskset -p "$pid" | sed 's/.*: //')
        taskset -a -p -c "$wcpus" "$pid" >/dev/null 2>>"$LOG" || log "taskset of the worker failed"
    fi
    if [ -n "$th" ] && [ -n "$MEMLOAD" ]; then
        "$MEMLOAD" load "$th" "$mode" "${gbps:-0}" ${lcpus:+"$lcpus"} >"$WORK/memload.out" 2>>"$LOG" &
        lpid=$!
        HELPERS+=("$lpid")
        sleep 1.5 # its buffers touched (1 GiB a thread)
    fi
    traces_start "$label" "$pid"
    mark_restored "$pid"
    raw 120 "$pid" resume
    rs=$RAW_S
    traces_stop
    dms=$(jget "$RAW_OUT" 'round(sum(c["ms"] for c in d["calls"] if c["call"] in ("restore", "unlock")) / 1000, 3)')
    if [ -n "$lpid" ]; then
        kill -TERM "$lpid" 2>/dev/null
        wait "$lpid" 2>/dev/null
        lg=$(jget "$WORK/memload.out" 'd["gbps"]')
    fi
    if [ -n "$mask" ]; then
        taskset -a -p "$mask" "$pid" >/dev/null 2>>"$LOG" || log "taskset back to $mask failed"
    fi
    if [ "$RAW_RC" != 0 ]; then
        log "sample $label: resume failed (exit $RAW_RC)"
        ERRORS=$((ERRORS + 1))
        return 1
    fi
    if ! checksum_ok "$name"; then
        log "sample $label: the worker's checksum did not hold after the restore"
        ERRORS=$((ERRORS + 1))
        return 1
    fi
    sample_row "$label" "${load:-none}" "$rs" "$dms" "$lg"
    return 0
}

# wakes NAME PID: hibernate once, then CONTEND_WAKES lazy wakes of that image
# (each after a gpusnap stop of the one before).
wakes() {
    local name=$1 pid=$2 i envs=() variants=() var label rms rlog
    [ "$CONTEND_WAKES" -gt 0 ] || return 0
    if [ $((CONTEND_BUDGET_S - SECONDS)) -lt 90 ]; then
        log "wakes skipped: $((CONTEND_BUDGET_S - SECONDS)) s left"
        return 0
    fi
    IFS=';' read -r -a variants <<<"$CONTEND_WAKE_ENV"
    gs 300 hibernate "$pid" --image contend
    if [ "$GS_RC" != 0 ]; then
        log "hibernate failed: $GS_MSG"
        ERRORS=$((ERRORS + 1))
        return 1
    fi
    # The image's map file (docs/design/wake.md, "The mapped wake"): wakes use it
    # unless their settings say GPUSNAP_MAP=0.
    if [ "$CONTEND_MAP" = 1 ]; then
        gs 300 images map contend
        log "images map: exit $GS_RC; $GS_MSG"
    fi
    for i in $(seq 1 "$CONTEND_WAKES"); do
        reap "$pid"
        wait_pid_free "$pid" 30 || true
        if [ $((CONTEND_BUDGET_S - SECONDS)) -lt 45 ]; then
            log "wake $i skipped: $((CONTEND_BUDGET_S - SECONDS)) s left"
            break
        fi
        var=${variants[$(((i - 1) % ${#variants[@]}))]}
        label=${var%%:*}
        envs=()
        if [ "$var" != "$label" ] && [ -n "${var#*:}" ]; then IFS=, read -r -a envs <<<"${var#*:}"; fi
        log "wake $i: $label (${envs[*]:-defaults})"
        traces_start "wake$i-$label" "$pid"
        mark_restored "$pid"
        env ${envs[@]+"${envs[@]}"} "$GPUSNAP" --json --state-dir "$STATE_DIR" wake contend --wait 30 --no-guard \
            </dev/null >"$WORK/wake.out" 2>"$WORK/wake.err"
        GS_RC=$?
        traces_stop
        log "wake $i: exit $GS_RC; $(head -c 2500 "$WORK/wake.out" | tr '\n' ' ')"
        # What the wake said on stderr (GPUSNAP_LOG=debug in its settings:
        # its timeline) and CRIU's log of its restore, kept for reading.
        if [ -s "$WORK/wake.err" ]; then gzip -c "$WORK/wake.err" >"$OUT/wake$i-$label.err.gz"; fi
        rlog=$(ls -td "$STATE_DIR"/logs/*restore-contend* 2>/dev/null | head -n 1)
        if [ -n "$rlog" ] && [ -f "$rlog/restore.log" ]; then gzip -c "$rlog/restore.log" >"$OUT/wake$i-$label.restore.log.gz"; fi
        if [ "$GS_RC" != 0 ]; then
            log_file "wake stderr" "$WORK/wake.err"
            ERRORS=$((ERRORS + 1))
            return 1
        fi
        rms=$(jget "$WORK/wake.out" 'round(d["restore_ms"] / 1000, 3)')
        sample_row "wake$i-$label" "gpusnap wake ${envs[*]:-(defaults)}; $(jget "$WORK/wake.out" '"mapped %.2f GB, fill %.1f GB/s, faults in flight %s, pace %s" % (d.get("mapped_bytes", 0) / 1e9, d["pages"]["fill_gbps"], d["pages"]["faults_in_flight"], d["pages"].get("pace"))' | tr '|' '/'); stages ms: $(jget "$WORK/wake.out" '" ".join("%s %s" % (k, v) for k, v in d["stages"].items())' | tr '|' '/')" \
            "$(jget "$WORK/wake.out" 'round(d["total_ms"] / 1000, 3)')" "$rms" "-"
        if ! checksum_ok "$name"; then
            log "wake $i: the worker's checksum did not hold"
            ERRORS=$((ERRORS + 1))
            return 1
        fi
        if [ "$i" -lt "$CONTEND_WAKES" ]; then
            stop_safely "$pid" "before the next wake" || return 1
        fi
    done
}

main() {
    local name=cw pid spec per=20
    collect_header
    build_memload
    if [ -n "$MEMLOAD" ] && [ "$CONTEND_PROBE" = 1 ]; then
        PROBE=$(timeout 120 "$MEMLOAD" probe 0 2>&1)
        log "memload probe: $(printf '%s' "$PROBE" | tr '\n' ' ')"
    fi
    start_worker "$name" "$CONTEND_GIB"
    pid=$LAST_PID
    if ! wait_ready "$name" "$pid" 300; then
        ERRORS=$((ERRORS + 1))
        return 1
    fi
    for spec in $CONTEND_LOADS; do
        # ~per seconds a sample at this size: checkpoint ~2.3 GB/s, restore, start-ups.
        per=$(calc %d 'g * 1.074 / 2.2 + g * 1.074 / 6 + 6' g="$CONTEND_GIB")
        # The wakes after the samples: the hibernate, then a wake and a stop each.
        if [ $((CONTEND_BUDGET_S - SECONDS)) -lt $((per + 30 + 40 + 35 * CONTEND_WAKES)) ]; then
            log "sample $spec skipped: $((CONTEND_BUDGET_S - SECONDS)) s left, a sample needs ~$per s and the wakes ~$((40 + 35 * CONTEND_WAKES)) s"
            continue
        fi
        one_sample "$name" "$pid" "$spec" || break
    done
    wakes "$name" "$pid" || true
}

install_traps
start_watchdog $((CONTEND_BUDGET_S + 60))
main
