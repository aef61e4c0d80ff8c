#!/usr/bin/env bash
# Benchmark of gpusnap suspend/resume against the bare driver calls, on one GPU.
#
# Run from the repository root, on a machine with a GPU, as root:
#   OUT=/some/dir bench/gpu/suspend-resume.sh [SIZE_GIB...]      (default: 12 50)
# Environment:
#   GPUSNAP         the binary (default ./target/release/gpusnap)
#   OUT             results directory (default: a new /tmp/gpusnap-out.* dir)
#   REPS            repetitions per size (default 3 below 30 GiB, 2 from 30 GiB)
#   BENCH_BUDGET_S  soft budget in seconds (default 490): a size or a
#                   repetition that would not fit (including the safe stop of
#                   its worker) is skipped; a watchdog ends the run, through
#                   the cleanup, 45 s after it
# For each size one worker holds SIZE GiB; each repetition runs, in
# alternating order, a bare cycle (tests/gpu/cuckpt.py: lock+checkpoint, then
# restore+unlock, each in one python process; timed as driver calls only and
# as the whole process) and a gpusnap cycle (`gpusnap --json suspend PID`,
# then `resume PID`, timed as whole commands). The worker's checksum and
# progress are checked after every cycle; it is stopped with `gpusnap stop`.
# Writes $OUT/bench.md (also on stdout), $OUT/bench.json (every sample) and
# $OUT/bench.log. Exit 0 when every planned repetition ran and passed its
# checks, 1 otherwise; whether the target is met is in the table, not the
# exit status. THP (/sys/kernel/mm/transparent_hugepage) is read, never changed.

NAME=bench # read by lib.sh
# shellcheck source=tests/gpu/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/../../tests/gpu/lib.sh"

BENCH_BUDGET_S=${BENCH_BUDGET_S:-490}
if [ $# -gt 0 ]; then SIZES=("$@"); else SIZES=(12 50); fi
for s in "${SIZES[@]}"; do
    case $s in
        '' | *[!0-9.]* | *.*.* | .*)
            echo "usage: bench/gpu/suspend-resume.sh [SIZE_GIB...]  (bad size '$s')" >&2
            exit 2
            ;;
    esac
done
if [ -n "${REPS:-}" ]; then
    case $REPS in '' | *[!0-9]* | 0) echo "REPS must be a positive integer" >&2; exit 2 ;; esac
fi

SAMPLES=$WORK/samples.tsv   # gib fp_bytes rep mode op wall_s inner_ms rc rss_mib (after the op)
NOTES=$WORK/notes.txt
: >"$SAMPLES"
: >"$NOTES"
ERRORS=0
FINISHED=0

sample() {
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >>"$SAMPLES"
    log "SAMPLE size=$1 GiB rep=$3 $4 $5: wall $6 s, inner $7 ms, rc $8, rss ${9:--} MiB"
}

# cycle GIB PID NAME REP MODE FP_BYTES: one suspend + resume, checked.
cycle() {
    local gib=$1 pid=$2 name=$3 rep=$4 mode=$5 fp=$6
    local fp_mib need avail st rc wall inner i rss free
    fp_mib=$(calc %d 'b / 1048576' b="$fp")
    need=$(calc %d 'm * 1.1 + 4096' m="$fp_mib")
    avail=$(mem_avail_mib)
    if [ "$avail" -lt "$need" ]; then
        note "size $gib GiB rep $rep: host MemAvailable $avail MiB < $need MiB a suspended copy needs; stopping this size"
        return 1
    fi
    sleep 1
    read_status "$WORK/$name.status"
    i=$ST_ITER

    if [ "$mode" = bare ]; then
        # Exactly the two driver calls; CUDA_SUCCESS from both means CHECKPOINTED.
        raw 300 --timeout-ms 30000 "$pid" lock checkpoint
        rc=$RAW_RC wall=$RAW_S st=""
        inner=$(jget "$RAW_OUT" 'd["driver_ms"]')
        if [ "$rc" = 0 ]; then st=checkpointed; fi
    else
        gs 300 suspend "$pid"
        rc=$GS_RC wall=$GS_S
        inner=$(jget "$GS_OUT" 'd["results"][0]["total_ms"]') st=$(jget "$GS_OUT" 'd["results"][0]["state"]')
    fi
    sleep 1
    rss=$(vmrss_mib "$pid")
    sample "$gib" "$fp" "$rep" "$mode" suspend "$wall" "${inner:-}" "$rc" "$rss"
    if [ "$st" != checkpointed ]; then
        note "size $gib GiB rep $rep: $mode suspend gave exit $rc, state '${st:-?}'; stopping this size"
        return 1
    fi
    read_status "$WORK/$name.status"
    if [ -n "$i" ] && [ "${ST_ITER:-0}" -gt $((i + 1)) ]; then
        note "size $gib GiB rep $rep: the worker advanced from $i to $ST_ITER across a $mode suspend"
    fi
    i=$ST_ITER

    free=$(smi_free_mib)
    if [ -z "$free" ] || [ "$free" -lt $((fp_mib + 1024)) ]; then
        # Never restore without room: an out-of-memory restore strands the process.
        note "size $gib GiB rep $rep: only ${free:-?} MiB free on the GPU for a $fp_mib MiB restore; stopping this size"
        return 1
    fi
    mark_restored "$pid"
    if [ "$mode" = bare ]; then
        raw 300 "$pid" restore unlock
        rc=$RAW_RC wall=$RAW_S st=""
        inner=$(jget "$RAW_OUT" 'd["driver_ms"]')
        if [ "$rc" = 0 ]; then st=running; fi
    else
        gs 300 resume "$pid"
        rc=$GS_RC wall=$GS_S
        inner=$(jget "$GS_OUT" 'd["results"][0]["total_ms"]') st=$(jget "$GS_OUT" 'd["results"][0]["state"]')
    fi
    sample "$gib" "$fp" "$rep" "$mode" resume "$wall" "${inner:-}" "$rc" "$(vmrss_mib "$pid")"
    if [ "$st" != running ]; then
        note "size $gib GiB rep $rep: $mode resume gave exit $rc, state '${st:-?}'; stopping this size"
        return 1
    fi
    if ! wait_iter_gt "$name" "${i:-0}" 30 || [ "$ST_OK" != 1 ]; then
        note "size $gib GiB rep $rep: after the $mode cycle the worker did not go on intact (iteration ${ST_ITER:-?}, ok ${ST_OK:-?})"
        return 1
    fi
    return 0
}

# bench_size GIB
bench_size() {
    local gib=$1 name="w$1" reps pid fp smi gbe est_susp est_res est_rep est_stop left rep mode order t_rep failed=0 done_reps=0
    reps=${REPS:-$(calc %d '(g >= 30) ? 2 : 3' g="$gib")}
    gbe=$(calc %.2f 'g * 1.073741824 + 0.6' g="$gib")
    # Model from shared/gpu-facts.md (THP madvise): checkpoint 1.6 GB/s, restore 4 GB/s.
    est_susp=$(calc %d 'g / 1.6 + 3' g="$gbe")
    est_res=$(calc %d 'g / 4 + 3' g="$gbe")
    est_rep=$((2 * (est_susp + est_res) + 8))
    est_stop=$((est_susp + 20))
    left=$((BENCH_BUDGET_S - SECONDS))
    log "size $gib GiB (~$gbe GB on the GPU): $reps reps planned; estimates: rep ${est_rep}s, stop ${est_stop}s; ${left}s left"
    size_fits "$gib" "$gbe" "$left" $((45 + est_rep + est_stop)) || return 0

    size_worker "$name" "$gib" || return 0
    pid=$LAST_PID
    gs 30 state "$pid"
    fp=$(jget "$GS_OUT" 'd["footprint_bytes"]')
    smi=$(smi_pid_mib "$pid")
    log "size $gib GiB: footprint gpusnap ${fp:-?} B, nvidia-smi ${smi:-?} MiB"
    fp=${fp:-$(calc %.0f 'm * 1048576' m="${smi:-0}")}

    for ((rep = 1; rep <= reps; rep++)); do
        left=$((BENCH_BUDGET_S - SECONDS))
        if [ "$left" -lt $((est_rep + est_stop + 10)) ]; then
            note "size $gib GiB: $done_reps of $reps reps (budget: ${left}s left, a rep takes ~${est_rep}s, the stop ~${est_stop}s)"
            ERRORS=$((ERRORS + 1))
            break
        fi
        t_rep=$SECONDS
        if [ $((rep % 2)) = 1 ]; then order="bare gpusnap"; else order="gpusnap bare"; fi
        for mode in $order; do
            if ! cycle "$gib" "$pid" "$name" "$rep" "$mode" "$fp"; then failed=1; break; fi
        done
        if [ "$failed" = 1 ]; then ERRORS=$((ERRORS + 1)); break; fi
        done_reps=$rep
        est_rep=$((SECONDS - t_rep))
        est_stop=$(calc %d 'w + 20' w="$(awk -F'\t' -v g="$gib" '$1 == g && $5 == "suspend" && $6 > m { m = $6 } END { print m + 0 }' "$SAMPLES")")
        log "size $gib GiB: rep $rep took ${est_rep}s"
    done

    size_stop "$gib" "$pid"
    return 0
}

# shellcheck disable=SC2317 # runs from the EXIT trap
write_report() {
    python3 - "$SAMPLES" "$NOTES" "$OUT/bench.md" "$OUT/bench.json" <<'PY'
import json, os, statistics, sys

samples_f, notes_f, md_f, json_f = sys.argv[1:5]
E = os.environ
def num(s):
    try:
        return float(s)
    except ValueError:
        return None

samples = []
for line in open(samples_f):
    f = line.rstrip("\n").split("\t")
    if len(f) < 9:
        continue
    samples.append({"gib": f[0], "footprint_bytes": num(f[1]), "rep": int(f[2]), "mode": f[3],
                    "op": f[4], "wall_s": num(f[5]), "inner_ms": num(f[6]), "rc": int(num(f[7]) or 0),
                    "rss_mib": num(f[8])})
notes = [l.rstrip("\n") for l in open(notes_f) if l.strip()]

def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None

def f2(x, d=2):
    return "?" if x is None else f"{x:.{d}f}"

sizes = []
for s in samples:
    if s["gib"] not in sizes:
        sizes.append(s["gib"])
summary = []
for g in sizes:
    ss = [s for s in samples if s["gib"] == g and s["rc"] == 0]
    fp = med([s["footprint_bytes"] for s in ss])
    for op in ("suspend", "resume", "cycle"):
        def pick(mode, key):
            if op != "cycle":
                return [s[key] for s in ss if s["mode"] == mode and s["op"] == op]
            out = []
            for r in sorted({s["rep"] for s in ss}):
                v = [s[key] for s in ss if s["mode"] == mode and s["rep"] == r]
                if len(v) == 2 and None not in v:
                    out.append(sum(v))
            return out
        bare_drv = pick("bare", "inner_ms")
        bare_wall = pick("bare", "wall_s")
        gs_wall = pick("gpusnap", "wall_s")
        gs_inner = pick("gpusnap", "inner_ms")
        row = {"gib": g, "footprint_gb": fp / 1e9 if fp else None, "op": op,
               "n": min(len(bare_drv), len(gs_wall)),
               "bare_driver_s": med(bare_drv) / 1e3 if med(bare_drv) is not None else None,
               "bare_process_s": med(bare_wall), "gpusnap_wall_s": med(gs_wall),
               "gpusnap_internal_s": med(gs_inner) / 1e3 if med(gs_inner) is not None else None}
        b, p, w = row["bare_driver_s"], row["bare_process_s"], row["gpusnap_wall_s"]
        if b and w:
            row["ratio"] = w / b
            row["overhead_ms"] = (w - b) * 1e3
            row["allowed_ms"] = max(100.0, 0.02 * b * 1e3)
            row["met"] = row["overhead_ms"] <= row["allowed_ms"]
        if p and w:
            row["overhead_vs_process_ms"] = (w - p) * 1e3
            row["allowed_vs_process_ms"] = max(100.0, 0.02 * p * 1e3)
            row["met_vs_process"] = row["overhead_vs_process_ms"] <= row["allowed_vs_process_ms"]
        if fp and b:
            row["bare_gbps"] = fp / 1e9 / b
        if fp and w:
            row["gpusnap_gbps"] = fp / 1e9 / w
        summary.append(row)

yn = lambda v: "?" if v is None else ("yes" if v else "**no**")
L = []
L.append("# gpusnap benchmark: suspend/resume against the bare driver calls")
L.append("")
L.append(f"- date: {E.get('HDR_DATE')}")
L.append(f"- host: {E.get('HDR_HOST')} (kernel {E.get('HDR_KERNEL')}, host memory {E.get('HDR_HOSTMEM')})")
L.append(f"- GPU: {E.get('HDR_GPU')}, {E.get('HDR_GPU_MEM')}; driver {E.get('HDR_DRIVER')}")
L.append(f"- gpusnap: {E.get('HDR_VERSION')} ({E.get('GPUSNAP')})")
L.append(f"- THP: enabled `{E.get('HDR_THP')}`, defrag `{E.get('HDR_THP_DEFRAG')}` (read, not changed)")
L.append(f"- sizes (GiB held by the worker): {E.get('B_SIZES')}; wall {E.get('B_WALL')} s")
L.append("- bare = tests/gpu/cuckpt.py: driver = the lock+checkpoint (restore+unlock) calls timed inside "
         "one python process; process = that whole python process, timed from the shell. "
         "gpusnap = `gpusnap --json suspend|resume PID`, whole command timed from the shell; "
         "internal = its total_ms. Medians over the repetitions; bare and gpusnap alternate.")
L.append("- target: gpusnap adds under 2% or 100 ms, whichever is larger; "
         "judged against the bare driver calls (strict) and against the bare process.")
L.append("")
L.append("| size GiB | footprint GB | op | n | bare driver s | bare process s | gpusnap wall s | gpusnap internal s "
         "| gpusnap / bare driver | overhead vs driver ms | overhead vs bare process ms | allowed ms (driver / process) | target met (driver / process) |")
L.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in summary:
    L.append(f"| {r['gib']} | {f2(r['footprint_gb'])} | {r['op']} | {r['n']} | {f2(r['bare_driver_s'], 3)} "
             f"| {f2(r['bare_process_s'], 3)} | {f2(r['gpusnap_wall_s'], 3)} | {f2(r['gpusnap_internal_s'], 3)} "
             f"| {f2(r.get('ratio'), 3)} | {f2(r.get('overhead_ms'), 0)} | {f2(r.get('overhead_vs_process_ms'), 0)} "
             f"| {f2(r.get('allowed_ms'), 0)} / {f2(r.get('allowed_vs_process_ms'), 0)} "
             f"| {yn(r.get('met'))} / {yn(r.get('met_vs_process'))} |")
L.append("")
L.append("## Every sample")
L.append("")
L.append("| size GiB | rep | mode | op | exit | wall s | driver / internal s | GB/s (wall) | worker host RSS after the op GB |")
L.append("|---|---|---|---|---|---|---|---|---|")
for s in samples:
    gbps = s["footprint_bytes"] / 1e9 / s["wall_s"] if s["footprint_bytes"] and s["wall_s"] else None
    inner = s["inner_ms"] / 1e3 if s["inner_ms"] is not None else None
    rss = f2(s["rss_mib"] * 1048576 / 1e9) if s["rss_mib"] is not None else "-"
    L.append(f"| {s['gib']} | {s['rep']} | {s['mode']} | {s['op']} | {s['rc']} | {f2(s['wall_s'], 3)} "
             f"| {f2(inner, 3)} | {f2(gbps)} | {rss} |")
if notes:
    L.append("")
    L.append("## Notes")
    L.append("")
    L.extend(f"- {n}" for n in notes)
md = "\n".join(L) + "\n"
open(md_f, "w").write(md)
hdr = {k: E.get(k) for k in ("HDR_DATE", "HDR_HOST", "HDR_KERNEL", "HDR_GPU", "HDR_GPU_MEM", "HDR_DRIVER",
                             "HDR_VERSION", "HDR_THP", "HDR_THP_DEFRAG", "HDR_HOSTMEM", "B_SIZES", "B_WALL")}
json.dump({"header": hdr, "summary": summary, "samples": samples, "notes": notes}, open(json_f, "w"), indent=1)
sys.stdout.write(md)
PY
}

# shellcheck disable=SC2317 # the EXIT trap
on_exit() {
    local rc=$?
    trap - ERR
    note_interrupted "$rc"
    cleanup_all
    note_left_alive
    HDR_DATE=$HDR_DATE HDR_HOST=$HDR_HOST HDR_KERNEL=$HDR_KERNEL HDR_GPU=$HDR_GPU HDR_GPU_MEM=$HDR_GPU_MEM \
        HDR_DRIVER=$HDR_DRIVER HDR_VERSION=$HDR_VERSION HDR_THP=$HDR_THP HDR_THP_DEFRAG=$HDR_THP_DEFRAG \
        HDR_HOSTMEM=$HDR_HOSTMEM GPUSNAP=$GPUSNAP B_SIZES="${SIZES[*]}" B_WALL=$SECONDS \
        write_report || log "report generation failed"
    local p
    for p in "$WORK"/*.log; do log_file "$(basename "$p")" "$p"; done
    log "scratch kept in $WORK"
    if [ "$ERRORS" -gt 0 ]; then exit 1; fi
    exit 0
}

install_traps
start_watchdog $((BENCH_BUDGET_S + 45))
log "gpusnap benchmark: sizes ${SIZES[*]} GiB, budget ${BENCH_BUDGET_S}s"
collect_header
if [ "$HDR_VERSION_RC" != 0 ]; then
    note "gpusnap --version failed (exit $HDR_VERSION_RC): $HDR_VERSION"
    ERRORS=$((ERRORS + 1))
else
    for s in "${SIZES[@]}"; do
        bench_size "$s"
    done
fi
FINISHED=1
exit 0   # on_exit writes the report and sets the exit status
