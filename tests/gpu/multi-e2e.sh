#!/usr/bin/env bash
# GPU end-to-end checks of gpusnap on a machine with two GPUs of one model
# (written for 2 x H200, driver 580): remapping onto the other GPU, groups
# in parallel across GPUs, one process on two GPUs, and an NCCL process.
#
# Run from the repository root, as root:
#   OUT=/some/dir tests/gpu/multi-e2e.sh
# Environment:
#   GPUSNAP          the binary (default ./target/release/gpusnap)
#   OUT              results directory (default: a new /tmp/gpusnap-out.* dir)
#   MULTI_BUDGET_S   soft budget in seconds (default 240): a section that would
#                    not fit is skipped (and counts as a failure); a watchdog
#                    ends the run, through the cleanup, 60 s after it
#   MULTI_SECTIONS   the sections to run (default "m1 m2 m3 m4")
#   REMAP_GIB CVD_GIB  m1 workers (default 4, 2)
#   PAR_GIB          m2: GiB of each of the two workers (default 8)
#   PAR_REPS         m2: repetitions of parallel and sequential (default 2)
#   MULTI_RATIO_MAX  m2: the parallel/sequential ratio that passes (default 0.7;
#                    the claim is about 0.5: N processes on N GPUs take the
#                    time of one)
#   TWO_GIB          m3: GiB on each GPU (default 4)
#   NCCL_GIB         m4: GiB of the NCCL worker's checked tensor (default 1)
#   NCCL2_GIB        m5: GiB of each rank's checked tensor (default 2)
#   NCCL2_ENV        m5: extra VAR=VALUE words for both ranks (e.g.
#                    "NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1" to see whether
#                    the transport between the ranks is what breaks)
# Writes $OUT/multi-e2e.md (the table, also printed on stdout),
# $OUT/multi-e2e.json (rows, figures, the m2 timings) and $OUT/multi-e2e.log.
# Exit 0 when every check passed, 1 when one failed or was skipped.
#
# Sections:
#   m1  remap: a 4 GiB worker.py (both GPUs visible, cuda:0) is suspended and
#       resumed with --device-map 0=1: it must run on GPU 1 with its data.
#       Then a bad map (0=7) on the suspended worker: exit 2, and a plain
#       resume still works. A worker started with CUDA_VISIBLE_DEVICES=0
#       cannot be mapped onto GPU 1 (the target GPU must be visible to the
#       process): exit 2 or 4 is recorded, then a plain resume works.
#   m2  a group across GPUs: two 8 GiB workers (worker_dev.py, cuda:0 and
#       cuda:1, both GPUs visible), `suspend PID0 PID1` + `resume PID0 PID1` (one
#       gpusnap call each: in parallel) against one at a time; PAR_REPS
#       repetitions, alternating which goes first; the ratio of the means.
#   m3  one process with 4 GiB on each GPU (worker2gpu.py): suspended it
#       holds nothing on either GPU, `state` records the footprint per GPU,
#       resumed both tensors are intact.
#   m4  an NCCL process (nccl_worker.py: init_process_group nccl, world size
#       1, an all_reduce on cuda:0): doctor must report check "nccl" with
#       severity "error"; what suspend does is recorded, and after a resume
#       whether another all_reduce works.
#   m5  (not in the default list: MULTI_SECTIONS=m5, MULTI_BUDGET_S=480) two
#       processes, one per GPU, one NCCL communicator (nccl2_worker.py:
#       init_process_group nccl, world size 2, an all_reduce every iteration
#       whose sum both ranks check): doctor and suspend say what is known
#       about multi-rank NCCL; `suspend R0 R1` (one group, all or nothing),
#       nothing on either GPU while suspended, `resume R0 R1`, then the
#       all_reduces go on with the right sum. If that held: `hibernate R0 R1`
#       (two trees, two images) and `wake` of both images, and the
#       all_reduces go on again. What breaks is recorded, every wait has a
#       deadline, and both ranks are ended through `gpusnap stop`.
# Every restored worker is ended through `gpusnap stop`, which suspends it
# before the kill; see lib.sh stop_safely for the fallback. CUDA indices are
# nvidia-smi's (CUDA_DEVICE_ORDER=PCI_BUS_ID), as for gpusnap's --device-map.

NAME=multi-e2e # read by lib.sh
# shellcheck source=tests/gpu/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# NVLink SHARP / multicast must stay off on these machines for anything that
# spans GPUs; both GPUs stay visible unless a worker says otherwise.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUDA_DEVICE_ORDER=PCI_BUS_ID
CVD_BEFORE=${CUDA_VISIBLE_DEVICES-unset}
unset CUDA_VISIBLE_DEVICES

MULTI_BUDGET_S=${MULTI_BUDGET_S:-240}
MULTI_SECTIONS=${MULTI_SECTIONS:-m1 m2 m3 m4}
REMAP_GIB=${REMAP_GIB:-4}
CVD_GIB=${CVD_GIB:-2}
PAR_GIB=${PAR_GIB:-8}
PAR_REPS=${PAR_REPS:-2}
RATIO_MAX=${MULTI_RATIO_MAX:-0.7}
TWO_GIB=${TWO_GIB:-4}
NCCL_GIB=${NCCL_GIB:-1}
NCCL2_GIB=${NCCL2_GIB:-2}
NCCL2_ENV=${NCCL2_ENV:-}
START_TIMEOUT_S=240 # torch import + CUDA (and NCCL) init of all workers, started together

ROWS=$WORK/rows.tsv
FIGS=$WORK/figures.tsv  # key, value
BENCH=$WORK/bench.tsv   # rep, mode, suspend s, resume s, member ms
: >"$ROWS"
: >"$FIGS"
: >"$BENCH"
NPASS=0 NFAIL=0 NSKIP=0 NINFO=0
FINISHED=0
WR="" WC="" WP0="" WP1="" W2="" WN="" WA="" WB=""  # remap, cvd, par0, par1, two, nccl, nccl2 ranks 0 and 1
WR_OK=0 WC_OK=0 WP0_OK=0 WP1_OK=0 W2_OK=0 WN_OK=0 WA_OK=0 WB_OK=0
PAR_SUS="" PAR_RES="" SEQ_SUS="" SEQ_RES=""  # m2 wall seconds, one per repetition
GPU_UUID=() GPU_NAME=()
NGPU=0
ADV="" AR=""

# ---------------------------------------------------------------- table

# cell and row (the results table) are in lib.sh.

# fig KEY VALUE: a figure for multi-e2e.json (an empty value is null).
fig() {
    local v=${2:-}
    v=${v//$'\t'/ }
    printf '%s\t%s\n' "$1" "${v//$'\n'/ }" >>"$FIGS"
}

selected() {
    case " $MULTI_SECTIONS " in *" $1 "*) return 0 ;; esac
    return 1
}

# need SECONDS ID CHECK: true if that much of the soft budget is left;
# otherwise records a SKIP row.
need() { budget_need "$MULTI_BUDGET_S" "$@"; }

# mean "X Y ...": their mean (%.3f), nothing for an empty list.
mean() {
    awk -v l="$1" 'BEGIN { n = split(l, a, " "); for (i = 1; i <= n; i++) s += a[i]; if (n) printf "%.3f", s / n }'
}

# shellcheck disable=SC2317 # runs from the EXIT trap
write_table() {
    local md=$OUT/multi-e2e.md id c e g r f torch nccl gpus="" i rep mode s rs ms
    torch=$(torch_seen)
    nccl=$(grep -ho 'nccl=[^ ]*' "$WORK"/nccl.log 2>/dev/null | head -n 1 | cut -d= -f2)
    for i in "${!GPU_UUID[@]}"; do gpus="$gpus${gpus:+; }GPU$i ${GPU_NAME[i]} ${GPU_UUID[i]}"; done
    {
        echo "# gpusnap on two GPUs: end-to-end"
        echo
        echo "- date: $HDR_DATE"
        echo "- host: $HDR_HOST (kernel $HDR_KERNEL, host memory $HDR_HOSTMEM)"
        echo "- GPUs: ${gpus:-none found}; driver $HDR_DRIVER"
        echo "- gpusnap: $HDR_VERSION ($GPUSNAP)"
        echo "- torch: ${torch:-?}; NCCL: ${nccl:-?}"
        echo "- THP enabled: $HDR_THP"
        echo "- environment: NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_ORDER=PCI_BUS_ID; CUDA_VISIBLE_DEVICES unset (was: $CVD_BEFORE)"
        echo "- sections: $MULTI_SECTIONS"
        echo "- workers: remap $REMAP_GIB GiB, cvd $CVD_GIB GiB (CUDA_VISIBLE_DEVICES=0), par 2 x $PAR_GIB GiB (cuda:0, cuda:1), two $TWO_GIB GiB on each GPU, nccl $NCCL_GIB GiB"
        echo "- m2 parallel / sequential (planned repetitions of each: $PAR_REPS; runs timed: $(grep -c . "$BENCH")): $(grep -h '^m2\.ratio' "$FIGS" | tr '\t' '=' | tr '\n' ' ')"
        echo "- result: $NPASS passed, $NFAIL failed, $NSKIP skipped, $NINFO info; wall ${SECONDS} s (budget $MULTI_BUDGET_S s)"
        echo
        rows_md "#" check expected got result figure
        if [ -s "$BENCH" ]; then
            echo
            echo "## m2: two ${PAR_GIB} GiB workers, one per GPU"
            echo
            echo "Wall seconds of the gpusnap calls: parallel is one call for both pids,"
            echo "sequential the sum of one call per pid. Members: each process's total_ms."
            echo
            echo "| rep | mode | suspend s | resume s | suspend + resume s | members ms (suspend; resume) |"
            echo "|---|---|---|---|---|---|"
            while IFS=$'\t' read -r rep mode s rs ms; do
                printf '| %s | %s | %s | %s | %s | %s |\n' "$rep" "$mode" "$s" "$rs" "$(calc %.3f 'a + b' a="$s" b="$rs")" "$ms"
            done <"$BENCH"
        fi
    } >"$md"
    cat "$md"
    HDR_DATE=$HDR_DATE HDR_HOST=$HDR_HOST HDR_KERNEL=$HDR_KERNEL HDR_DRIVER=$HDR_DRIVER \
        HDR_VERSION=$HDR_VERSION HDR_THP=$HDR_THP HDR_HOSTMEM=$HDR_HOSTMEM E_GPUS=$gpus \
        E_TORCH=$torch E_NCCL=$nccl E_SECTIONS=$MULTI_SECTIONS E_WALL=$SECONDS \
        E_BUDGET=$MULTI_BUDGET_S E_COUNTS="$NPASS $NFAIL $NSKIP $NINFO" \
        python3 - "$ROWS" "$FIGS" "$BENCH" "$OUT/multi-e2e.json" <<'PY' || log "multi-e2e.json not written"
import json, os, sys
rows_f, figs_f, bench_f, out_f = sys.argv[1:5]
E = os.environ


def num(v):
    for t in (int, float):
        try:
            return t(v)
        except ValueError:
            pass
    return v if v != "" else None


rows = []
for line in open(rows_f):
    f = line.rstrip("\n").split("\t")
    if len(f) >= 6:
        rows.append(dict(zip(("id", "check", "expected", "got", "result", "figure"), f[:6])))
figs = {}
for line in open(figs_f):
    k, _, v = line.rstrip("\n").partition("\t")
    figs[k] = num(v) if v != "" else None
bench = []
for line in open(bench_f):
    f = line.rstrip("\n").split("\t")
    if len(f) >= 5:
        bench.append({"rep": num(f[0]), "mode": f[1], "suspend_s": num(f[2]), "resume_s": num(f[3]),
                      "members_ms": f[4]})
n = E.get("E_COUNTS", "0 0 0 0").split()
out = {"header": {k: E.get(k) for k in ("HDR_DATE", "HDR_HOST", "HDR_KERNEL", "HDR_DRIVER",
                                        "HDR_VERSION", "HDR_THP", "HDR_HOSTMEM")},
       "gpus": E.get("E_GPUS"), "torch": E.get("E_TORCH"), "nccl": E.get("E_NCCL"),
       "sections": E.get("E_SECTIONS"), "wall_s": int(E.get("E_WALL", "0")),
       "budget_s": int(E.get("E_BUDGET", "0")),
       "passed": int(n[0]), "failed": int(n[1]), "skipped": int(n[2]), "info": int(n[3]),
       "rows": rows, "figures": figs, "m2": bench}
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
    for p in ${WORKERS[@]+"${WORKERS[@]}"}; do
        if [ -n "$(smi_pid_mib "$p")" ]; then m="$m $p"; fi
    done
    p=$(smi_apps_gpu | tr '\n' ';')
    row z2 "nvidia-smi lists no process of this run (any GPU)" "none" "${m:-none}; apps now: ${p:-none}" \
        "$([ -z "$m" ] && echo PASS || echo FAIL)"
    write_table
    for p in "$WORK"/*.log; do log_file "$(basename "$p")" "$p"; done
    log "scratch kept in $WORK"
    if [ "$NFAIL" -gt 0 ] || [ "$NSKIP" -gt 0 ]; then exit 1; fi
    exit 0
}

# ---------------------------------------------------------------- GPUs

# read_gpus: GPU_UUID and GPU_NAME by nvidia-smi index; NGPU.
read_gpus() {
    local idx uuid name
    GPU_UUID=() GPU_NAME=()
    while IFS=, read -r idx uuid name; do
        idx=${idx// /} uuid=${uuid// /} name=${name# }
        if [ -z "$uuid" ] || ! [ "$idx" -ge 0 ] 2>/dev/null; then continue; fi
        GPU_UUID[idx]=$uuid
        GPU_NAME[idx]=$name
    done < <(timeout 30 nvidia-smi --query-gpu=index,uuid,name --format=csv,noheader 2>/dev/null)
    NGPU=${#GPU_UUID[@]}
}

# gpu_label UUID: GPUn for a GPU of this host, else the UUID's start.
gpu_label() {
    local i
    for i in "${!GPU_UUID[@]}"; do
        if [ "${GPU_UUID[i]}" = "$1" ]; then
            printf 'GPU%s' "$i"
            return 0
        fi
    done
    printf '%s' "${1:0:16}"
}

# smi_apps_gpu: "pid, gpu_uuid, MiB" lines of nvidia-smi's compute apps.
smi_apps_gpu() {
    timeout 30 nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader,nounits 2>/dev/null || true
}

# pid_on PID IDX: MiB nvidia-smi lists for PID on GPU IDX; nothing if not listed.
pid_on() {
    smi_apps_gpu | awk -F', *' -v p="$1" -v u="${GPU_UUID[$2]:-none}" \
        '$1 == p && $2 == u { s += $3; f = 1 } END { if (f) printf "%d", s }'
}

# pid_where PID: "GPU0 4610 MiB, GPU1 520 MiB", or "not listed".
pid_where() {
    local apps i m out=""
    apps=$(smi_apps_gpu)
    for i in "${!GPU_UUID[@]}"; do
        m=$(printf '%s\n' "$apps" | awk -F', *' -v p="$1" -v u="${GPU_UUID[i]}" \
            '$1 == p && $2 == u { s += $3; f = 1 } END { if (f) printf "%d", s }')
        if [ -n "$m" ]; then out="$out${out:+, }GPU$i $m MiB"; fi
    done
    printf '%s' "${out:-not listed}"
}

# wait_on PID IDX MIN_MIB TIMEOUT_S: until nvidia-smi lists at least MIN_MIB for PID on GPU IDX.
wait_on() {
    local end=$((SECONDS + $4)) m
    while :; do
        m=$(pid_on "$1" "$2")
        if [ -n "$m" ] && [ "$m" -ge "$3" ]; then return 0; fi
        [ "$SECONDS" -lt "$end" ] || return 1
        sleep 0.5
    done
}

gpu_free() {
    timeout 30 nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits -i "$1" 2>/dev/null | head -n 1 | tr -d ' '
}

# maps_nccl PID: "yes (paths)" when the process maps libnccl, else "no".
maps_nccl() {
    local l
    l=$(awk '/libnccl/ { print $NF }' "/proc/$1/maps" 2>/dev/null | sort -u | tr '\n' ' ')
    if [ -n "$l" ]; then printf 'yes (%s)' "${l% }"; else printf 'no'; fi
}

# ---------------------------------------------------------------- gpusnap

# gs_state PID: gpusnap state; sets S_STATE S_UNREC S_FP S_GPUS (and GS_*).
gs_state() {
    gs 30 state "$1"
    S_STATE=$(jget "$GS_OUT" 'd["state"]')
    S_UNREC=$(jget "$GS_OUT" 'd["unrecoverable"]')
    S_FP=$(jget "$GS_OUT" 'd["footprint_bytes"]')
    S_GPUS=$(gpus_of "$GS_OUT" 'd["gpus"]')
}

# gs_result KEY: field of the first entry of "results" in the last gpusnap output.
gs_result() { jget "$GS_OUT" "d[\"results\"][0][\"$1\"]"; }

# gs_err_kind: the error kind of the last gpusnap output, if it failed.
gs_err_kind() { jget "$GS_OUT" 'd["error"]["kind"]'; }

# all_state N STATE: "true" when the last output has N results, all in STATE.
all_state() { jget "$GS_OUT" "len(d['results']) == $1 and all(r['state'] == '$2' for r in d['results'])"; }

# members KEY: KEY of every result of the last output, "/" separated.
members() {
    jget "$GS_OUT" "'/'.join(str(r['$1']).lower() if isinstance(r['$1'], bool) else str(r['$1']) for r in d['results'])"
}

# gpus_of FILE EXPR: "UUID:BYTES ..." of a list of {uuid, bytes} in a gpusnap output.
gpus_of() { jget "$1" "' '.join(g['uuid'] + ':' + str(g['bytes']) for g in $2)"; }

# fmt_gpus "UUID:BYTES ...": "GPU0 4.61 GB, GPU1 4.61 GB".
fmt_gpus() {
    local x out=""
    for x in $1; do out="$out${out:+, }$(gpu_label "${x%%:*}") $(gb "${x##*:}") GB"; done
    printf '%s' "${out:-none}"
}

# has_gpu "UUID:BYTES ..." IDX MIN_MIB: GPU IDX is listed with at least MIN_MIB.
has_gpu() {
    local x
    for x in $1; do
        if [ "${x%%:*}" = "${GPU_UUID[$2]:-none}" ] && [ "${x##*:}" -ge $(($3 * 1048576)) ] 2>/dev/null; then
            return 0
        fi
    done
    return 1
}

# ---------------------------------------------------------------- workers

# start_py NAME [VAR=VALUE...] -- SCRIPT ARG...: a worker (python3 SCRIPT ARG...)
# with those variables added to its environment; its status goes to
# $WORK/NAME.status (the line of worker.py), its output to $WORK/NAME.log.
# Sets LAST_PID.
start_py() {
    local name=$1 envs=()
    shift
    while [ $# -gt 0 ] && [ "$1" != -- ]; do
        envs+=("$1")
        shift
    done
    [ $# -gt 0 ] && shift
    rm -f "$WORK/$name.status" "$WORK/$name.status.exit" "$WORK/$name.status.again" "$WORK/$name.status.allreduce"
    : >"$WORK/$name.log"
    env ${envs[@]+"${envs[@]}"} python3 "$@" </dev/null >>"$WORK/$name.log" 2>&1 &
    LAST_PID=$!
    WORKERS+=("$LAST_PID")
    log "worker $name: pid $LAST_PID: ${envs[*]:-} python3 $*"
}

# advanced NAME ITER TIMEOUT_S: true when the worker's iteration passes ITER
# with ok=1; ADV says what was seen.
advanced() {
    if wait_iter_gt "$1" "${2:-0}" "$3"; then
        ADV="iteration ${2:-?} -> $ST_ITER, ok=$ST_OK"
        [ "$ST_OK" = 1 ]
        return
    fi
    ADV="no progress in $3 s (iteration ${ST_ITER:-?}, ok=${ST_OK:-?})"
    return 1
}

# iter NAME: the worker's iteration now (after a moment for a write in flight).
iter() {
    read_status "$WORK/$1.status"
    printf '%s' "${ST_ITER:-0}"
}

# stop_row ID WHAT PID...: one `gpusnap stop` of those pids (a group when
# several), as a row: each suspended and released before the kill, all gone.
stop_row() {
    local id=$1 what=$2 p pids=() left="" ok v
    shift 2
    for p in "$@"; do alive "$p" && pids+=("$p"); done
    [ ${#pids[@]} -gt 0 ] || return 0
    gs 240 stop "${pids[@]}"
    ok=$(jget "$GS_OUT" "len(d['results']) == ${#pids[@]} and all(r['suspended'] and r['released_before_kill'] for r in d['results'])")
    for p in "${pids[@]}"; do
        wait_gone "$p" "$([ "$GS_RC" = 0 ] && echo 20 || echo 2)" || left="$left $p"
    done
    v=FAIL; [[ $GS_RC == 0 && $ok == true && -z $left ]] && v=PASS
    row "$id" "stop $what (pid ${pids[*]})" "exit 0, each suspended and released before the kill, gone" \
        "exit $GS_RC, suspended $(members suspended), released_before_kill $(members released_before_kill), signal $(members signal); ${left:+still alive:$left}${left:-all gone}${GS_MSG:+; $GS_MSG}" \
        "$v" "${GS_S} s"
}

start_workers() {
    local t0=$SECONDS end=$((SECONDS + START_TIMEOUT_S)) w name var pid got="" s=PASS
    if selected m1; then
        start_py remap -- "$GPU_DIR/worker.py" "$REMAP_GIB" "$WORK/remap.status"
        WR=$LAST_PID
        start_py cvd CUDA_VISIBLE_DEVICES=0 -- "$GPU_DIR/worker.py" "$CVD_GIB" "$WORK/cvd.status"
        WC=$LAST_PID
    fi
    if selected m2; then
        start_py par0 -- "$GPU_DIR/worker_dev.py" "$PAR_GIB" "$WORK/par0.status" --device 0
        WP0=$LAST_PID
        start_py par1 -- "$GPU_DIR/worker_dev.py" "$PAR_GIB" "$WORK/par1.status" --device 1
        WP1=$LAST_PID
    fi
    if selected m3; then
        start_py two -- "$GPU_DIR/worker2gpu.py" "$TWO_GIB" "$WORK/two.status" --devices 0,1
        W2=$LAST_PID
    fi
    if selected m4; then
        start_py nccl -- "$GPU_DIR/nccl_worker.py" "$NCCL_GIB" "$WORK/nccl.status" --device 0
        WN=$LAST_PID
    fi
    if selected m5; then
        local port envs
        port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
        read -r -a envs <<<"$NCCL2_ENV"
        # As torchrun sets them: doctor reads WORLD_SIZE and RANK from the environment.
        start_py nccl2a MASTER_PORT="$port" WORLD_SIZE=2 RANK=0 ${envs[@]+"${envs[@]}"} -- \
            "$GPU_DIR/nccl2_worker.py" "$NCCL2_GIB" "$WORK/nccl2a.status" --rank 0
        WA=$LAST_PID
        start_py nccl2b MASTER_PORT="$port" WORLD_SIZE=2 RANK=1 ${envs[@]+"${envs[@]}"} -- \
            "$GPU_DIR/nccl2_worker.py" "$NCCL2_GIB" "$WORK/nccl2b.status" --rank 1
        WB=$LAST_PID
    fi
    for w in remap:WR cvd:WC par0:WP0 par1:WP1 two:W2 nccl:WN nccl2a:WA nccl2b:WB; do
        name=${w%%:*} var=${w#*:}
        pid=${!var}
        [ -n "$pid" ] || continue
        if wait_ready "$name" "$pid" "$((end - SECONDS > 5 ? end - SECONDS : 5))"; then
            printf -v "${var}_OK" 1
            got="$got${got:+; }$name $pid ok ($(pid_where "$pid"))"
        else
            got="$got${got:+; }$name $pid FAILED"
            s=FAIL
        fi
    done
    [ -n "$got" ] || return 0
    row w1 "workers start" "all ready, checksum ok" "$got" "$s" "$((SECONDS - t0)) s"
    log "compute apps: $(smi_apps_gpu | tr '\n' ';')"
}

# ---------------------------------------------------------------- preflight

preflight() {
    local i got="" same=yes topo apps
    if [ "$HDR_VERSION_RC" = 0 ]; then
        row p1 "gpusnap --version" "exit 0" "$HDR_VERSION" PASS
    else
        row p1 "gpusnap --version" "exit 0" "exit $HDR_VERSION_RC: $HDR_VERSION" FAIL
        return 1
    fi
    read_gpus
    for i in "${!GPU_UUID[@]}"; do
        got="$got${got:+; }GPU$i ${GPU_NAME[i]} ${GPU_UUID[i]} ($(gpu_free "$i") MiB free)"
        [ "${GPU_NAME[i]}" = "${GPU_NAME[0]:-}" ] || same=no
    done
    if [ "$NGPU" -ge 2 ] && [ "$same" = yes ]; then
        row p2 "two GPUs of one model" "at least 2, same name" "$NGPU: $got" PASS
    else
        row p2 "two GPUs of one model" "at least 2, same name" "$NGPU: ${got:-none}; same model: $same" FAIL
        return 1
    fi
    # The row of GPU0 ("GPU0  X  NV18 ..."), not the header (which starts with GPU0 too).
    topo=$(timeout 30 nvidia-smi topo -m 2>/dev/null | sed 's/\x1b\[[0-9;]*m//g' | awk '$1 == "GPU0" && $2 == "X" { print $3; exit }')
    apps=$(smi_apps_gpu | tr '\n' ';')
    row p3 "GPUs idle before the run" "(information)" "compute apps: ${apps:-none}; GPU0-GPU1 link: ${topo:-?}" INFO
    return 0
}

# ---------------------------------------------------------------- m1: remap

m1_remap() {
    local pid=$WR i0 v got st on0 on1 rc msg kind
    on0=$(pid_on "$pid" 0) on1=$(pid_on "$pid" 1)
    v=FAIL; [[ -n $on0 && -z $on1 ]] && v=PASS
    row m1.1 "remap worker (pid $pid, $REMAP_GIB GiB, both GPUs visible, cuda:0)" "on GPU0 only" "$(pid_where "$pid")" "$v"

    gs 120 suspend "$pid"
    st=$(gs_result state)
    if wait_smi_unlisted "$pid" 5; then got="not listed"; else got="still listed: $(pid_where "$pid")"; fi
    v=FAIL; [[ $GS_RC == 0 && $st == checkpointed && $got == "not listed" ]] && v=PASS
    row m1.2 "suspend" "exit 0, checkpointed, nvidia-smi lists nothing" "exit $GS_RC, ${st:-?}; nvidia-smi: $got${GS_MSG:+; $GS_MSG}" \
        "$v" "$(gb "$(gs_result footprint_bytes)") GB in ${GS_S} s"
    [ "$st" = checkpointed ] || return 0
    sleep 0.5
    i0=$(iter remap)

    mark_restored "$pid"
    gs 120 resume "$pid" --device-map 0=1
    st=$(gs_result state)
    fig m1.remap_exit "$GS_RC"
    fig m1.remap_wall_s "$GS_S"
    fig m1.remap_restore_ms "$(gs_result restore_ms)"
    v=FAIL; [[ $GS_RC == 0 && $st == running ]] && v=PASS
    row m1.3 "resume --device-map 0=1" "exit 0, running" "exit $GS_RC, ${st:-?}${GS_MSG:+; $GS_MSG}" "$v" \
        "restore $(gs_result restore_ms) ms, ${GS_S} s wall"
    if [ "$GS_RC" != 0 ]; then
        # Back where it was, so that the rest can go on.
        gs 120 resume "$pid"
        log "plain resume after the failed remap: exit $GS_RC"
        return 0
    fi

    wait_on "$pid" 1 $((REMAP_GIB * 1024 * 9 / 10)) 10 || log "pid $pid not on GPU1 within 10 s"
    on0=$(pid_on "$pid" 0) on1=$(pid_on "$pid" 1)
    v=FAIL; [[ -n $on1 && -z $on0 ]] && v=PASS
    row m1.4 "nvidia-smi after the remap" "the pid on GPU1 (${GPU_UUID[1]}) only" \
        "GPU0 ${on0:-not listed}, GPU1 ${on1:-not listed} MiB; apps: $(smi_apps_gpu | tr '\n' ';')" "$v"

    v=FAIL; advanced remap "$i0" 20 && v=PASS
    row m1.5 "work continues on GPU1, data intact" "iteration advances, ok=1" "$ADV" "$v"

    gs_state "$pid"
    v=FAIL; [[ $S_STATE == running && $S_GPUS == "${GPU_UUID[1]}:"* && $S_GPUS != *" "* ]] && v=PASS
    row m1.6 "gpusnap state after the remap" "running, gpus: GPU1 only" "exit $GS_RC, ${S_STATE:-?}; gpus: $(fmt_gpus "$S_GPUS")" "$v"

    # A bad map on a suspended worker: refused, and nothing lost.
    gs 120 suspend "$pid"
    st=$(gs_result state)
    v=FAIL; [[ $GS_RC == 0 && $st == checkpointed ]] && v=PASS
    row m1.7 "suspend again (now on GPU1)" "exit 0, checkpointed" "exit $GS_RC, ${st:-?}; footprint $(fmt_gpus "$(gpus_of "$GS_OUT" 'd["results"][0]["gpus"]')")${GS_MSG:+; $GS_MSG}" \
        "$v" "${GS_S} s"
    [ "$st" = checkpointed ] || return 0
    sleep 0.5
    i0=$(iter remap)
    mark_restored "$pid"
    gs 60 resume "$pid" --device-map 0=7
    rc=$GS_RC msg=$GS_MSG kind=$(gs_err_kind)
    gs_state "$pid"
    v=FAIL; [[ $rc == 2 && $S_STATE == checkpointed && $S_UNREC == false ]] && v=PASS
    row m1.8 "resume --device-map 0=7 (no GPU 7)" "exit 2 (bad device map); still checkpointed, recoverable" \
        "exit $rc${kind:+ ($kind)}: ${msg:-no message}; then ${S_STATE:-?}, unrecoverable ${S_UNREC:-?}" "$v"
    fig m1.badmap_exit "$rc"
    fig m1.badmap_message "$msg"

    gs 120 resume "$pid"
    st=$(gs_result state)
    wait_on "$pid" 1 1 5 || wait_on "$pid" 0 1 5 || true
    v=FAIL; [[ $GS_RC == 0 && $st == running ]] && v=PASS
    row m1.9 "plain resume after the bad map" "exit 0, running" \
        "exit $GS_RC, ${st:-?}${GS_MSG:+; $GS_MSG}; nvidia-smi: $(pid_where "$pid")" "$v" "${GS_S} s"
    v=FAIL; advanced remap "$i0" 20 && v=PASS
    row m1.10 "work continues, data intact" "iteration advances, ok=1" "$ADV" "$v"
    return 0
}

m1_cvd() {
    local pid=$WC i0 v st on0 on1 rc msg kind vis nccl
    gs 30 doctor "$pid"
    vis=$(jget "$GS_OUT" '",".join(f["severity"] for f in d["findings"] if f["check"] == "visible")')
    nccl=$(jget "$GS_OUT" '",".join(f["severity"] for f in d["findings"] if f["check"] == "nccl")')
    row m1.11 "doctor of a plain PyTorch worker (pid $pid, CUDA_VISIBLE_DEVICES=0; control for m4)" \
        "(information): 'visible' warns; 'nccl' only where libnccl is mapped" \
        "exit $GS_RC; visible: ${vis:-none}; nccl: ${nccl:-none}; libnccl mapped: $(maps_nccl "$pid")" INFO

    on0=$(pid_on "$pid" 0) on1=$(pid_on "$pid" 1)
    v=FAIL; [[ -n $on0 && -z $on1 ]] && v=PASS
    row m1.12 "CUDA_VISIBLE_DEVICES=0 worker (pid $pid, $CVD_GIB GiB)" "on GPU0 only" "$(pid_where "$pid")" "$v"

    gs 120 suspend "$pid"
    st=$(gs_result state)
    v=FAIL; [[ $GS_RC == 0 && $st == checkpointed ]] && v=PASS
    row m1.13 "suspend" "exit 0, checkpointed" "exit $GS_RC, ${st:-?}${GS_MSG:+; $GS_MSG}" "$v" "${GS_S} s"
    [ "$st" = checkpointed ] || return 0
    sleep 0.5
    i0=$(iter cvd)
    mark_restored "$pid"
    gs 60 resume "$pid" --device-map 0=1
    rc=$GS_RC msg=$GS_MSG kind=$(gs_err_kind)
    gs_state "$pid"
    fig m1.cvd_map_exit "$rc"
    fig m1.cvd_map_kind "$kind"
    fig m1.cvd_map_message "$msg"
    v=FAIL; [[ ($rc == 2 || $rc == 4) && $S_STATE == checkpointed && $S_UNREC == false ]] && v=PASS
    row m1.14 "resume --device-map 0=1 of the CUDA_VISIBLE_DEVICES=0 worker" \
        "refused: exit 2 (gpusnap) or 4 (driver); still checkpointed, recoverable" \
        "exit $rc${kind:+ ($kind)}: ${msg:-no message}; then ${S_STATE:-?}, unrecoverable ${S_UNREC:-?}; nvidia-smi: $(pid_where "$pid")" "$v"

    gs 120 resume "$pid"
    st=$(gs_result state)
    wait_on "$pid" 0 1 5 || true
    on0=$(pid_on "$pid" 0) on1=$(pid_on "$pid" 1)
    v=FAIL; [[ $GS_RC == 0 && $st == running && -n $on0 && -z $on1 ]] && v=PASS
    row m1.15 "plain resume after the refused map" "exit 0, running, on GPU0" \
        "exit $GS_RC, ${st:-?}${GS_MSG:+; $GS_MSG}; nvidia-smi: $(pid_where "$pid")" "$v" "${GS_S} s"
    v=FAIL; advanced cvd "$i0" 20 && v=PASS
    row m1.16 "work continues, data intact" "iteration advances, ok=1" "$ADV" "$v"
    return 0
}

section_m1() {
    selected m1 || return 0
    if [ "$WR_OK" != 1 ]; then
        row m1 "remap onto GPU1" "remap worker" "remap worker did not start" SKIP
    elif need 50 m1 "remap onto GPU1"; then
        m1_remap
    fi
    if [ "$WC_OK" != 1 ]; then
        row m1.c "remap of a CUDA_VISIBLE_DEVICES=0 worker" "cvd worker" "cvd worker did not start" SKIP
    elif need 30 m1.c "remap of a CUDA_VISIBLE_DEVICES=0 worker"; then
        m1_cvd
    fi
    [ -n "$WR" ] && stop_row m1.17 "the remapped worker" "$WR"
    [ -n "$WC" ] && stop_row m1.18 "the CUDA_VISIBLE_DEVICES=0 worker" "$WC"
    return 0
}

# ---------------------------------------------------------------- m2: a group across GPUs

# m2_rescue: after a failed step, whatever is suspended goes back (a resume
# of a running process does nothing). True when both run again.
m2_rescue() {
    mark_restored "$WP0"
    mark_restored "$WP1"
    gs 120 resume "$WP0" "$WP1"
    [ "$(all_state 2 running)" = true ]
}

# m2_par REP: one gpusnap call suspends both, one resumes both.
m2_par() {
    local r=$1 ts tr ok mss msr i0 i1 d0=no d1=no a0 a1 got v
    gs 180 suspend "$WP0" "$WP1"
    ts=$GS_S ok=$(all_state 2 checkpointed) mss=$(members total_ms)
    got="suspend exit $GS_RC, both checkpointed: ${ok:-no}${GS_MSG:+ ($GS_MSG)}"
    if [ "$ok" != true ]; then
        row "m2.$r.par" "rep $r parallel: suspend PID0 PID1, resume PID0 PID1" "exit 0, checkpointed, running, data intact on both" "$got" FAIL "suspend ${ts} s"
        m2_rescue || log "m2: the par workers are not both running after the rescue"
        return 1
    fi
    sleep 0.3
    i0=$(iter par0) i1=$(iter par1)
    mark_restored "$WP0"
    mark_restored "$WP1"
    gs 120 resume "$WP0" "$WP1"
    tr=$GS_S ok=$(all_state 2 running) msr=$(members total_ms)
    got="$got; resume exit $GS_RC, both running: ${ok:-no}${GS_MSG:+ ($GS_MSG)}"
    advanced par0 "$i0" 20 && d0=yes
    a0=$ADV
    advanced par1 "$i1" 20 && d1=yes
    a1=$ADV
    v=FAIL; [[ $ok == true && $d0 == yes && $d1 == yes ]] && v=PASS
    row "m2.$r.par" "rep $r parallel: suspend PID0 PID1, resume PID0 PID1" "exit 0, checkpointed, running, data intact on both" \
        "$got; par0 $a0; par1 $a1" "$v" "suspend $ts s (members $mss ms), resume $tr s (members $msr ms)"
    if [ "$v" != PASS ]; then
        m2_rescue || log "m2: the par workers are not both running after the rescue"
        return 1
    fi
    printf '%s\t%s\t%s\t%s\t%s\n' "$r" parallel "$ts" "$tr" "$mss; $msr" >>"$BENCH"
    PAR_SUS="$PAR_SUS $ts" PAR_RES="$PAR_RES $tr"
    return 0
}

# m2_seq REP: one gpusnap call per pid, one after the other.
m2_seq() {
    local r=$1 s0 s1 r0 r1 st0 st1 ts tr m0 m1 n0 n1 i0 i1 d0=no d1=no a0 a1 got v
    gs 180 suspend "$WP0"
    s0=$GS_S st0=$(gs_result state) m0=$(gs_result total_ms)
    gs 180 suspend "$WP1"
    s1=$GS_S st1=$(gs_result state) m1=$(gs_result total_ms)
    ts=$(calc %.3f 'a + b' a="$s0" b="$s1")
    got="suspend PID0 ${st0:-failed}, PID1 ${st1:-failed}"
    if [ "$st0" != checkpointed ] || [ "$st1" != checkpointed ]; then
        row "m2.$r.seq" "rep $r sequential: suspend PID0; suspend PID1; resume PID0; resume PID1" "each exit 0, data intact on both" "$got" FAIL "suspend ${ts} s"
        m2_rescue || log "m2: the par workers are not both running after the rescue"
        return 1
    fi
    sleep 0.3
    i0=$(iter par0) i1=$(iter par1)
    mark_restored "$WP0"
    mark_restored "$WP1"
    gs 120 resume "$WP0"
    r0=$GS_S st0=$(gs_result state) n0=$(gs_result total_ms)
    gs 120 resume "$WP1"
    r1=$GS_S st1=$(gs_result state) n1=$(gs_result total_ms)
    tr=$(calc %.3f 'a + b' a="$r0" b="$r1")
    got="$got; resume PID0 ${st0:-failed}, PID1 ${st1:-failed}"
    advanced par0 "$i0" 20 && d0=yes
    a0=$ADV
    advanced par1 "$i1" 20 && d1=yes
    a1=$ADV
    v=FAIL; [[ $st0 == running && $st1 == running && $d0 == yes && $d1 == yes ]] && v=PASS
    row "m2.$r.seq" "rep $r sequential: suspend PID0; suspend PID1; resume PID0; resume PID1" "each exit 0, data intact on both" \
        "$got; par0 $a0; par1 $a1" "$v" "suspend $s0 + $s1 = $ts s, resume $r0 + $r1 = $tr s"
    if [ "$v" != PASS ]; then
        m2_rescue || log "m2: the par workers are not both running after the rescue"
        return 1
    fi
    printf '%s\t%s\t%s\t%s\t%s\n' "$r" sequential "$ts" "$tr" "$m0/$m1; $n0/$n1" >>"$BENCH"
    SEQ_SUS="$SEQ_SUS $ts" SEQ_RES="$SEQ_RES $tr"
    return 0
}

# ratio_row ID WHAT PAR_LIST SEQ_LIST KEY
ratio_row() {
    local p s q v
    p=$(mean "$3") s=$(mean "$4")
    if [ -z "$p" ] || [ -z "$s" ]; then
        row "$1" "$2: parallel / sequential" "<= $RATIO_MAX (about 0.5)" "no complete run of both modes" FAIL
        return 0
    fi
    q=$(calc %.2f '(b > 0) ? a / b : 0' a="$p" b="$s")
    fig "m2.ratio_$5" "$q"
    fig "m2.parallel_${5}_s" "$p"
    fig "m2.sequential_${5}_s" "$s"
    v=FAIL; fle "$q" "$RATIO_MAX" && v=PASS
    row "$1" "$2: parallel / sequential" "<= $RATIO_MAX (about 0.5)" "$p s / $s s = $q" "$v" \
        "means of $(wc -w <<<"$3") parallel and $(wc -w <<<"$4") sequential runs"
}

section_m2() {
    local r mode g0 g1 min v
    selected m2 || return 0
    if [ "$WP0_OK$WP1_OK" != 11 ]; then
        row m2 "group across GPUs" "par workers" "par workers did not start" SKIP
        [ -n "$WP0$WP1" ] && stop_row m2.9 "the par workers" "$WP0" "$WP1"
        return 0
    fi
    min=$((PAR_GIB * 1024 * 95 / 100))
    g0=$(pid_on "$WP0" 0) g1=$(pid_on "$WP1" 1)
    v=FAIL; [[ ${g0:-0} -ge $min && ${g1:-0} -ge $min ]] && v=PASS
    row m2.0 "one $PAR_GIB GiB worker per GPU (both GPUs visible)" "par0 on GPU0, par1 on GPU1, >= $min MiB each" \
        "par0 $WP0: $(pid_where "$WP0"); par1 $WP1: $(pid_where "$WP1")" "$v"
    for ((r = 1; r <= PAR_REPS; r++)); do
        need 35 "m2.$r" "repetition $r of parallel and sequential" || break
        # Alternate which mode goes first, so neither always finds warm caches.
        for mode in $( ((r % 2)) && echo par seq || echo seq par); do
            case $mode in
                par) m2_par "$r" || break 2 ;;
                seq) m2_seq "$r" || break 2 ;;
            esac
        done
    done
    ratio_row m2.r1 "suspend of 2 x $PAR_GIB GiB on 2 GPUs" "$PAR_SUS" "$SEQ_SUS" suspend
    ratio_row m2.r2 "resume of 2 x $PAR_GIB GiB on 2 GPUs" "$PAR_RES" "$SEQ_RES" resume
    local pc="" sc="" x i a b
    read -r -a a <<<"$PAR_SUS"
    read -r -a b <<<"$PAR_RES"
    for i in "${!a[@]}"; do pc="$pc $(calc %.3f 'x + y' x="${a[i]}" y="${b[i]:-0}")"; done
    read -r -a a <<<"$SEQ_SUS"
    read -r -a b <<<"$SEQ_RES"
    for i in "${!a[@]}"; do sc="$sc $(calc %.3f 'x + y' x="${a[i]}" y="${b[i]:-0}")"; done
    x="suspend + resume of N processes on N GPUs (N = 2) takes about the time of one"
    ratio_row m2.r3 "$x" "$pc" "$sc" cycle
    stop_row m2.9 "both par workers (one group)" "$WP0" "$WP1"
    return 0
}

# ---------------------------------------------------------------- m3: one process, two GPUs

section_m3() {
    local pid=$W2 min g0 g1 st fp v got i0 oks lk ck
    selected m3 || return 0
    if [ "$W2_OK" != 1 ]; then
        row m3 "one process on two GPUs" "two worker" "two worker did not start" SKIP
        [ -n "$W2" ] && stop_row m3.8 "the two-GPU worker" "$W2"
        return 0
    fi
    need 40 m3 "one process on two GPUs" || return 0
    min=$((TWO_GIB * 1024 * 95 / 100))
    g0=$(pid_on "$pid" 0) g1=$(pid_on "$pid" 1)
    v=FAIL; [[ ${g0:-0} -ge $min && ${g1:-0} -ge $min ]] && v=PASS
    row m3.1 "two-GPU worker (pid $pid, $TWO_GIB GiB on each)" "on GPU0 and GPU1, >= $min MiB each" "$(pid_where "$pid")" "$v"

    gs_state "$pid"
    v=FAIL; [[ $GS_RC == 0 && $S_STATE == running ]] && has_gpu "$S_GPUS" 0 "$min" && has_gpu "$S_GPUS" 1 "$min" && v=PASS
    row m3.2 "gpusnap state while running" "running; gpus: GPU0 and GPU1, >= $min MiB each" \
        "exit $GS_RC, ${S_STATE:-?}; gpus: $(fmt_gpus "$S_GPUS")" "$v"
    fig m3.running_gpus "$S_GPUS"

    gs 180 suspend "$pid"
    st=$(gs_result state) fp=$(gpus_of "$GS_OUT" 'd["results"][0]["gpus"]')
    lk=$(gs_result lock_ms) ck=$(gs_result checkpoint_ms)
    fig m3.suspend_gpus "$fp"
    fig m3.suspend_wall_s "$GS_S"
    v=FAIL; [[ $GS_RC == 0 && $st == checkpointed ]] && has_gpu "$fp" 0 "$min" && has_gpu "$fp" 1 "$min" && v=PASS
    row m3.3 "suspend" "exit 0, checkpointed; footprint on GPU0 and GPU1" \
        "exit $GS_RC, ${st:-?}; footprint: $(fmt_gpus "$fp")${GS_MSG:+; $GS_MSG}" "$v" \
        "$(gb "$(gs_result footprint_bytes)") GB in ${GS_S} s (lock $lk ms, checkpoint $ck ms)"
    [ "$st" = checkpointed ] || {
        stop_row m3.8 "the two-GPU worker" "$pid"
        return 0
    }
    if wait_smi_unlisted "$pid" 10; then got="not listed on any GPU"; else got="still listed: $(pid_where "$pid")"; fi
    v=FAIL; [[ $got == "not listed on any GPU" ]] && v=PASS
    row m3.4 "nvidia-smi while suspended" "no memory on either GPU for the pid" \
        "$got; free GPU0 $(gpu_free 0) MiB, GPU1 $(gpu_free 1) MiB" "$v"

    gs_state "$pid"
    fig m3.footprint_gpus "$S_GPUS"
    v=FAIL; [[ $S_STATE == checkpointed && $S_UNREC == false ]] && has_gpu "$S_GPUS" 0 "$min" && has_gpu "$S_GPUS" 1 "$min" && v=PASS
    row m3.5 "gpusnap state while suspended: footprint per GPU" "checkpointed; gpus: GPU0 and GPU1 with their bytes" \
        "${S_STATE:-?}, unrecoverable ${S_UNREC:-?}; gpus: $(fmt_gpus "$S_GPUS")" "$v" "footprint $(gb "$S_FP") GB"

    i0=$(iter two)
    mark_restored "$pid"
    gs 120 resume "$pid"
    st=$(gs_result state)
    v=FAIL; [[ $GS_RC == 0 && $st == running ]] && v=PASS
    row m3.6 "resume" "exit 0, running" "exit $GS_RC, ${st:-?}${GS_MSG:+; $GS_MSG}" "$v" \
        "restore $(gs_result restore_ms) ms, ${GS_S} s wall"

    wait_on "$pid" 0 "$min" 10 || true
    wait_on "$pid" 1 "$min" 10 || true
    g0=$(pid_on "$pid" 0) g1=$(pid_on "$pid" 1)
    v=FAIL
    if advanced two "$i0" 20; then
        oks=$(cut -d' ' -f5 "$WORK/two.status" 2>/dev/null)
        [[ $oks == 1,1 && ${g0:-0} -ge $min && ${g1:-0} -ge $min ]] && v=PASS
    else
        oks=$(cut -d' ' -f5 "$WORK/two.status" 2>/dev/null)
    fi
    row m3.7 "after resume: both GPUs, both tensors" "on GPU0 and GPU1 again; iteration advances, checksum ok on each GPU" \
        "nvidia-smi: $(pid_where "$pid"); $ADV; ok per GPU: ${oks:-?}" "$v"
    stop_row m3.8 "the two-GPU worker" "$pid"
    return 0
}

# ---------------------------------------------------------------- m4: NCCL

# wait_allreduce N TIMEOUT_S: until the NCCL worker's all_reduce count passes N; sets AR.
wait_allreduce() {
    local end=$((SECONDS + $2)) c
    while :; do
        AR=$(cat "$WORK/nccl.status.allreduce" 2>/dev/null)
        c=${AR%% *}
        if [ -n "$c" ] && [ "$c" -gt "$1" ] 2>/dev/null; then return 0; fi
        [ "$SECONDS" -lt "$end" ] || return 1
        sleep 0.2
    done
}

section_m4() {
    local pid=$WN v got st rc msg kind f n0 i0 maps
    selected m4 || return 0
    if [ "$WN_OK" != 1 ]; then
        row m4 "NCCL process" "nccl worker" "nccl worker did not start" SKIP
        [ -n "$WN" ] && stop_row m4.7 "the NCCL worker" "$WN"
        return 0
    fi
    need 40 m4 "NCCL process" || return 0
    AR=$(cat "$WORK/nccl.status.allreduce" 2>/dev/null)
    maps=$(maps_nccl "$pid")
    v=FAIL; [[ $AR == "1 1 "* && $maps == yes* ]] && v=PASS
    row m4.1 "NCCL worker (pid $pid): init_process_group nccl, world size 1, all_reduce on cuda:0" \
        "first all_reduce right; libnccl mapped" "all_reduce: ${AR:-none}; libnccl: $maps; nvidia-smi: $(pid_where "$pid")" "$v"

    gs 30 doctor "$pid"
    f=$(jget "$GS_OUT" 'next((x["severity"] + ": " + x["message"] + " (fix: " + str(x.get("fix")) + ")" for x in d["findings"] if x["check"] == "nccl"), "")')
    v=FAIL; [[ $GS_RC == 0 && ( $f == error:* || $f == warn:* ) ]] && v=PASS
    row m4.2 "gpusnap doctor PID" "a finding with check nccl, severity warn or error" \
        "exit $GS_RC; ${f:-no nccl finding}; all: $(jget "$GS_OUT" '" ".join(x["check"] + "=" + x["severity"] for x in d["findings"])')" "$v"

    i0=$(iter nccl)
    gs 120 suspend "$pid"
    rc=$GS_RC st=$(gs_result state) msg=$GS_MSG kind=$(gs_err_kind)
    got="exit $rc${kind:+ ($kind)}, ${st:-no result}${msg:+: $msg}"
    gs_state "$pid"
    got="$got; then gpusnap state ${S_STATE:-?}; nvidia-smi: $(pid_where "$pid")"
    fig m4.suspend_exit "$rc"
    fig m4.suspend_message "$msg"
    fig m4.suspend_state "$S_STATE"
    row m4.3 "gpusnap suspend of the NCCL process" "(information: what the driver does with an NCCL communicator)" "$got" INFO "${GS_S} s"

    if [ "$S_STATE" = checkpointed ] || [ "$S_STATE" = locked ]; then
        sleep 0.3
        i0=$(iter nccl)
        mark_restored "$pid"
        gs 120 resume "$pid"
        st=$(gs_result state)
        fig m4.resume_exit "$GS_RC"
        v=FAIL; [[ $GS_RC == 0 && $st == running ]] && v=PASS
        row m4.4 "resume the NCCL process" "exit 0, running" "exit $GS_RC, ${st:-?}${GS_MSG:+; $GS_MSG}" "$v" "${GS_S} s"
        v=FAIL; advanced nccl "$i0" 20 && v=PASS
        row m4.5 "data intact after the resume" "iteration advances, ok=1" "$ADV" "$v"
        if [ "$GS_RC" = 0 ]; then
            n0=$(cut -d' ' -f1 "$WORK/nccl.status.allreduce" 2>/dev/null)
            : >"$WORK/nccl.status.again"
            if wait_allreduce "${n0:-1}" 30; then
                case $AR in
                    *" 1 "*) got="works: $AR" ;;
                    *) got="FAILS: $AR" ;;
                esac
            else
                got="no answer in 30 s (last: ${AR:-none}); the worker's status: $(cat "$WORK/nccl.status" 2>/dev/null)"
            fi
            fig m4.allreduce_after_resume "$got"
            row m4.6 "another all_reduce after the resume" "(information: does NCCL still work after a checkpoint)" "$got" INFO
        fi
    else
        v=FAIL; advanced nccl "$i0" 10 && v=PASS
        row m4.5 "the NCCL process after the suspend attempt" "(not suspended) iteration advances, ok=1" "$ADV" "$v"
    fi
    stop_row m4.7 "the NCCL worker" "$pid"
    return 0
}

# ---------------------------------------------------------------- m5: two NCCL ranks

# ranks_advance I0 I1 TIMEOUT_S: both ranks pass their iterations I0 and I1
# with ok=1 (checksum and all_reduce sum right); ADV says what was seen.
ranks_advance() {
    local r0=1 r1=1 A_ADV
    if advanced nccl2a "$1" "$3"; then r0=0; fi
    A_ADV=$ADV
    if advanced nccl2b "$2" "$3"; then r1=0; fi
    ADV="rank 0: $A_ADV, last all_reduce $(tr -d '\n' <"$WORK/nccl2a.status.allreduce" 2>/dev/null); rank 1: $ADV, last all_reduce $(tr -d '\n' <"$WORK/nccl2b.status.allreduce" 2>/dev/null)"
    [ "$r0" = 0 ] && [ "$r1" = 0 ]
}

# nccl_finding: the doctor finding "nccl" of the last gpusnap output.
nccl_finding() {
    jget "$GS_OUT" 'next((x["severity"] + ": " + x["message"] for x in d["findings"] if x["check"] == "nccl"), "")'
}

m5_hibernate() {
    local p0=$WA p1=$WB v st imgs n i0 i1
    need 150 m5.7 "hibernate and wake the two ranks" || return 0
    i0=$(iter nccl2a) i1=$(iter nccl2b)
    gs 400 hibernate "$p0" "$p1" --image nccl2
    imgs=$(jget "$GS_OUT" "' '.join(r['image'] for r in d['results'])")
    n=$(jget "$GS_OUT" "len(d['results'])")
    fig m5.hibernate_exit "$GS_RC"
    fig m5.hibernate_message "$GS_MSG"
    wait_pid_free "$p0" 60 || true
    wait_pid_free "$p1" 60 || true
    v=FAIL; [[ $GS_RC == 0 && $n == 2 ]] && ! alive "$p0" && ! alive "$p1" && v=PASS
    row m5.7 "hibernate R0 R1 (two trees, two images)" "exit 0, 2 images, both ranks ended" \
        "exit $GS_RC, images: ${imgs:-none}; rank 0 $(alive "$p0" && echo alive || echo gone), rank 1 $(alive "$p1" && echo alive || echo gone)${GS_MSG:+; $GS_MSG}" \
        "$v" "${GS_S} s"
    if [ "$v" != PASS ]; then
        for n in $imgs; do image_logs "$n"; done
        return 0
    fi
    mark_restored "$p0"
    mark_restored "$p1"
    # shellcheck disable=SC2086 # the image names are words
    gs 400 wake $imgs --wait 60
    st=$(jget "$GS_OUT" "' '.join(str(p) for r in d['results'] for p in r['resumed'])")
    fig m5.wake_exit "$GS_RC"
    fig m5.wake_message "$GS_MSG"
    v=FAIL; [[ $GS_RC == 0 ]] && alive "$p0" && alive "$p1" && v=PASS
    row m5.8 "wake both images (one group)" "exit 0, both ranks back and resumed" \
        "exit $GS_RC, resumed: ${st:-none}; rank 0 $(alive "$p0" && echo alive || echo gone), rank 1 $(alive "$p1" && echo alive || echo gone)${GS_MSG:+; $GS_MSG}" \
        "$v" "${GS_S} s"
    [ "$v" = PASS ] || { for n in $imgs; do image_logs "$n"; done; return 0; }
    v=FAIL; ranks_advance "$i0" "$i1" 60 && v=PASS
    fig m5.allreduce_after_wake "$ADV"
    row m5.9 "all_reduce after the wake" "both ranks advance, sums right" "$ADV" "$v"
    return 0
}

section_m5() {
    local p0=$WA p1=$WB v got st f i0 i1 rc msg kind states
    selected m5 || return 0
    if [ "$WA_OK" != 1 ] || [ "$WB_OK" != 1 ]; then
        row m5 "two NCCL ranks" "both ranks start" "rank 0 ready: $WA_OK, rank 1 ready: $WB_OK (see nccl2a.log, nccl2b.log)" FAIL
        stop_row m5.10 "the NCCL ranks" ${WA:+"$WA"} ${WB:+"$WB"}
        return 0
    fi
    if ! need 120 m5 "two NCCL ranks"; then
        stop_row m5.10 "the NCCL ranks" "$p0" "$p1"
        return 0
    fi
    i0=$(iter nccl2a) i1=$(iter nccl2b)
    v=FAIL; ranks_advance "$i0" "$i1" 30 && [[ -n $(pid_on "$p0" 0) && -n $(pid_on "$p1" 1) ]] && v=PASS
    row m5.1 "two ranks (pids $p0 $p1), one per GPU, world size 2, all_reduce every iteration" \
        "both advance, sums right; rank 0 on GPU0, rank 1 on GPU1" \
        "$ADV; nvidia-smi: $p0 $(pid_where "$p0"), $p1 $(pid_where "$p1"); libnccl: $(maps_nccl "$p0" | cut -c1-80)" "$v"

    gs 30 doctor "$p0"
    f=$(nccl_finding)
    fig m5.doctor "$f"
    v=FAIL; [[ $GS_RC == 0 && ( $f == error:* || $f == warn:* ) && $f == *rank* ]] && v=PASS
    row m5.2 "gpusnap doctor R0" "finding nccl (warn or error) naming the ranks" "exit $GS_RC; ${f:-no nccl finding}" "$v"

    i0=$(iter nccl2a) i1=$(iter nccl2b)
    gs 240 suspend "$p0" "$p1"
    rc=$GS_RC msg=$GS_MSG kind=$(gs_err_kind)
    states=$(jget "$GS_OUT" "'/'.join(r['state'] for r in d['results'])")
    f=$(grep -i 'nccl' "$GS_ERR" | head -n 1 | cut -c1-300)
    fig m5.suspend_exit "$rc"
    fig m5.suspend_message "$msg"
    fig m5.suspend_warning "$f"
    v=FAIL; [[ $rc == 0 && $states == checkpointed/checkpointed ]] && v=PASS
    row m5.3 "suspend R0 R1 (one group)" "exit 0, both checkpointed; a warning about NCCL first" \
        "exit $rc${kind:+ ($kind)}, ${states:-no result}${msg:+: $msg}; warning: ${f:-none}" "$v" "${GS_S} s"
    if [ "$v" != PASS ]; then
        # All or nothing: a failed group leaves both running.
        gs_state "$p0"
        got="rank 0 ${S_STATE:-?}"
        gs_state "$p1"
        got="$got, rank 1 ${S_STATE:-?}"
        v=FAIL; ranks_advance "$(iter nccl2a)" "$(iter nccl2b)" 60 && v=PASS
        row m5.4 "after the failed group suspend" "both running, all_reduces go on" "$got; $ADV" "$v"
        stop_row m5.10 "the NCCL ranks" "$p0" "$p1"
        return 0
    fi
    got=""
    wait_smi_unlisted "$p0" 10 || got="$got rank 0 listed: $(pid_where "$p0");"
    wait_smi_unlisted "$p1" 10 || got="$got rank 1 listed: $(pid_where "$p1");"
    sleep 2
    i0=$(iter nccl2a) i1=$(iter nccl2b)
    sleep 2
    [ "$(iter nccl2a)" = "$i0" ] && [ "$(iter nccl2b)" = "$i1" ] || got="$got iterations moved while suspended;"
    v=FAIL; [ -z "$got" ] && v=PASS
    row m5.4 "while suspended" "nvidia-smi lists neither rank; neither iterates" "${got:-as expected}" "$v"

    mark_restored "$p0"
    mark_restored "$p1"
    gs 240 resume "$p0" "$p1"
    states=$(jget "$GS_OUT" "'/'.join(r['state'] for r in d['results'])")
    fig m5.resume_exit "$GS_RC"
    fig m5.resume_message "$GS_MSG"
    v=FAIL; [[ $GS_RC == 0 && $states == running/running ]] && v=PASS
    row m5.5 "resume R0 R1 (one group)" "exit 0, both running" "exit $GS_RC, ${states:-no result}${GS_MSG:+; $GS_MSG}" "$v" "${GS_S} s"
    if [ "$v" = PASS ]; then
        v=FAIL; ranks_advance "$i0" "$i1" 60 && v=PASS
        fig m5.allreduce_after_resume "$ADV"
        row m5.6 "all_reduce after the resume" "both ranks advance, sums right" "$ADV" "$v"
        if [ "$v" = PASS ]; then
            if criu_probe; then
                m5_hibernate
            else
                row m5.7 "hibernate and wake the two ranks" "criu usable" "$CRIU_WHY" SKIP
            fi
        fi
    fi
    stop_row m5.10 "the NCCL ranks" "$p0" "$p1"
    images_clear
    return 0
}

# ---------------------------------------------------------------- main

install_traps
start_watchdog $((MULTI_BUDGET_S + 60))
log "gpusnap two-GPU e2e: budget ${MULTI_BUDGET_S}s, sections $MULTI_SECTIONS"
collect_header
if preflight; then
    log "nvidia-smi topo -m: $(timeout 30 nvidia-smi topo -m 2>&1 | head -n 4 | tr '\n' '|')"
    start_workers
    section_m1
    section_m2
    section_m3
    section_m4
    section_m5
fi
FINISHED=1
exit 0 # on_exit writes the table and sets the exit status
