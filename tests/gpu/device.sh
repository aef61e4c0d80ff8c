#!/usr/bin/env bash
# The one entry point on the GPU machine: installs CRIU from the repository's
# .dev/criu, prints the GPU and driver, then runs the given stages in order
# within one wall-clock budget and leaves a handful of files in $OUT.
#
# Run from the repository root, as root:
#   OUT=/some/dir tests/gpu/device.sh [STAGE...]     (default: e2e)
# Stages:
#   e2e     tests/gpu/e2e.sh (the driver and CRIU sections; ~6 min alone)
#   bench   bench/gpu/suspend-resume.sh $BENCH_SIZES (suspend/resume against the driver)
#   hbench  bench/gpu/hibernate.sh $HBENCH_SIZES (hibernate/wake against driver + CRIU;
#           HB_MODES, HB_DRIVER, HB_COLD, HB_MATRIX, HB_DISK, WORKER_FILL pass through)
#   multi   tests/gpu/multi-e2e.sh (two GPUs: remap, a group across GPUs, one
#           process on two GPUs, NCCL; ~3-4 min; needs a machine with 2 GPUs)
#   guard   tests/gpu/guard-e2e.sh traced, then with --light, then
#           bench/gpu/guard.sh (both modes); ~4 min; needs
#           libgpusnap_preload.so next to $GPUSNAP
#   keeper  tests/gpu/keeper-e2e.sh (a lazy wake whose gpusnap is killed with
#           SIGKILL mid-fill: its keeper fills every page, the worker's data
#           intact; ~2 min; KEEPER_GIB, KEEPER_SLOW_US, KEEPER_KILL_S pass through)
#   rescue  tests/gpu/rescue-e2e.sh (a streaming lazy wake whose page server
#           fails while the driver's restore runs, injected and by a bad
#           chunk, for a PyTorch and a CuPy worker: the wake fails, nothing
#           is left on the GPU, the image wakes intact next; ~2 min;
#           RESCUE_* pass through; DEVICE_BUDGET_S=200 alone)
#   contend bench/gpu/contend.sh (the driver's restore alone beside
#           memory loads of another process, pinned or not, the worker's
#           threads and CPUs during it, then lazy wakes on the same host;
#           ~5-6 min at CONTEND_GIB=23; CONTEND_* pass through)
#   container tests/gpu/container-e2e.sh (CRIU's CUDA plugin with gpusnap as
#           its cuda-checkpoint: a CuPy worker dumped and restored bare and in
#           its own mount and pid namespaces, then a restore that does not
#           fit beside a filler; then tests/gpu/podman-e2e.sh: podman
#           from .dev/debs, checkpoint/restore of a CuPy container; ~4 min;
#           CONT_*, PODMAN_* pass through)
#   runc    tests/gpu/runc-e2e.sh (a CuPy container run by runc from .dev/runc,
#           no image: runc checkpoint with CRIU's CUDA plugin and gpusnap as
#           its cuda-checkpoint, runc restore under another id, then a
#           restore that does not fit beside a filler; ~2 min), after
#           container-e2e.sh's bare mode alone (CONT_MODES=bare, RUNC_BARE=0
#           leaves it out), whose criu dump / restore seconds the runc
#           figures are set against; RUNC_*, CONT_GIB, CONT_WORKER pass through
#   timing  bench/gpu/init-timing.sh (cuInit and nvmlInit bare, alone and on
#           two threads, and the wall of gpusnap ps / doctor / state / a plain
#           wake, 3 samples each; < 20 s; REPS passes through)
#   fault   tests/gpu/fault-e2e.sh (a guarded PyTorch and CuPy worker whose
#           context faults by an illegal-address kernel, under both guards,
#           restored and not, with --on-fault exit and hold; ~2-3 min;
#           FAULT_* pass through; libgpusnap_preload.so next to $GPUSNAP)
#   agent   bench/gpu/agent.sh (the node agent: two ~75 GB model servers
#           swapped on one GPU, answers checked, ttfb, proxy p50; ~6-8 min;
#           AGENT_MODES=hooks: only the swaps with the sleep hooks, ~5 min;
#           libgpusnap_preload.so next to $GPUSNAP; 128 GiB host RAM)
# Environment:
#   OUT              results (default: a new /tmp/gpusnap-device.* directory)
#   DEVICE_BUDGET_S  the whole call's wall-clock budget (default 570); each
#                    stage gets a share of what is left, by weight (e2e 540,
#                    bench 240, hbench 300, multi 300), and runs with its own
#                    soft budget (E2E_BUDGET_S, BENCH_BUDGET_S, HBENCH_BUDGET_S,
#                    MULTI_BUDGET_S) that much below its share that its
#                    watchdog and cleanup still fit
#   BENCH_SIZES      GiB for bench (default "12"); HBENCH_SIZES for hbench (default "12")
#   GPUSNAP          the binary (default ./target/release/gpusnap; there is no
#                    cargo on the GPU machine: carry a build)
#   CRIU_SRC         the relocatable CRIU to install (default .dev/criu), into
#                    /opt/gpusnap/criu (its bin/criu has absolute paths there)
#   BENCH_COMMIT     the commit the binary was built from, for the results'
#                    headers (the copy on the GPU machine may have no .git)
# Anything else (E2E_SECTIONS, REPS, ...) passes through to the stages.
# Files in $OUT (those of the stages run): device.log (this script's log,
# then the logs of bench, hbench, multi, guard, keeper and rescue), gpu-e2e.md,
# e2e.log, bench.md, bench-hibernate.md, multi-e2e.md, guard-e2e.md,
# guard-e2e-light.md, guard-bench.md, agent-bench.md, keeper-e2e.md, rescue-e2e.md, container-e2e.md,
# runc-e2e.md, runc-bare.md, init-timing.md, results.json (host, CRIU, every stage's
# exit status and time, and the JSON of each stage), and bench/results/ with
# one numbered, dated file per stage run (bench/results/README.md): copy
# those into the repository's bench/results. Exit 0 when every stage ran and
# exited 0.

set -u
export LC_ALL=C TZ=UTC PYTHONUNBUFFERED=1

T0=$SECONDS
DEVICE_BUDGET_S=${DEVICE_BUDGET_S:-570}
if [ -z "${OUT:-}" ]; then OUT=$(mktemp -d /tmp/gpusnap-device.XXXXXX); fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SCR=$(mktemp -d /tmp/gpusnap-device.XXXXXX)
DLOG=$OUT/device.log
: >"$DLOG"
STAGES_TSV=$SCR/stages.tsv # name rc wall_s share_s budget_s note
: >"$STAGES_TSV"
CRIU_PREFIX=/opt/gpusnap/criu
CRIU_SRC=${CRIU_SRC:-.dev/criu}
export GPUSNAP=${GPUSNAP:-./target/release/gpusnap}
FINAL_MARGIN=15 # seconds kept free at the end of the call

say() {
    local line
    printf -v line '%(%Y-%m-%dT%H:%M:%S)TZ +%03ds %s' -1 "$((SECONDS - T0))" "$*"
    printf '%s\n' "$line" >>"$DLOG"
    printf '%s\n' "$line"
}

usage() {
    echo "usage: OUT=DIR tests/gpu/device.sh [e2e|bench|hbench|multi|guard|fault|agent|keeper|rescue|contend|container|runc|timing]..." >&2
    exit 2
}

STAGES=("$@")
[ ${#STAGES[@]} -gt 0 ] || STAGES=(e2e)
for s in "${STAGES[@]}"; do
    case $s in e2e | bench | hbench | multi | guard | fault | agent | keeper | rescue | contend | container | runc | timing) ;; *) usage ;; esac
done
if [ ! -f tests/gpu/e2e.sh ]; then
    echo "run tests/gpu/device.sh from the repository root" >&2
    exit 2
fi

# ---------------------------------------------------------------- CRIU

# A copy that lost its symbolic links (the loader link, the sonames) gets them
# back: every versioned library libX.so.N.M gets its libX.so.N.
criu_repair_links() {
    local root=$CRIU_PREFIX/root lib f base so ver
    lib=$root/usr/lib/x86_64-linux-gnu
    [ -d "$lib" ] || return 0
    if [ ! -e "$root/usr/lib64/ld-linux-x86-64.so.2" ] && [ -e "$lib/ld-linux-x86-64.so.2" ]; then
        mkdir -p "$root/usr/lib64"
        ln -sfn ../lib/x86_64-linux-gnu/ld-linux-x86-64.so.2 "$root/usr/lib64/ld-linux-x86-64.so.2"
        say "criu: restored the link usr/lib64/ld-linux-x86-64.so.2"
    fi
    for f in "$lib"/lib*.so.*.*; do
        [ -f "$f" ] || continue
        base=${f##*/}
        ver=${base#*.so.}
        so=${base%%.so.*}.so.${ver%%.*}
        if [ ! -e "$lib/$so" ]; then
            ln -s "$base" "$lib/$so"
            say "criu: restored the link $so -> $base"
        fi
    done
}

CRIU_VERSION="" CRIU_CHECK="" CRIU_CHECK_RC="" CRIU_INSTALL=""
install_criu() {
    local out
    if [ -x "$CRIU_PREFIX/bin/criu" ]; then
        CRIU_INSTALL="already in $CRIU_PREFIX"
    elif [ -d "$CRIU_SRC" ]; then
        mkdir -p "${CRIU_PREFIX%/*}"
        if cp -a "$CRIU_SRC" "$CRIU_PREFIX"; then
            CRIU_INSTALL="copied $CRIU_SRC to $CRIU_PREFIX ($(du -sh "$CRIU_PREFIX" | cut -f1))"
        else
            CRIU_INSTALL="cp -a $CRIU_SRC $CRIU_PREFIX failed"
        fi
    else
        CRIU_INSTALL="no $CRIU_SRC to install from (carry it)"
    fi
    say "criu: $CRIU_INSTALL"
    export PATH=$CRIU_PREFIX/bin:$PATH
    out=$(timeout 30 criu --version 2>&1)
    if ! printf '%s' "$out" | grep -q '^Version:'; then
        say "criu --version failed: $(printf '%s' "$out" | tr '\n' '|' | cut -c1-300); repairing links"
        criu_repair_links
        out=$(timeout 30 criu --version 2>&1)
    fi
    CRIU_VERSION=$(printf '%s\n' "$out" | sed -n 's/^Version: *//p' | head -n 1)
    say "criu: $(command -v criu || echo 'not on PATH'); criu --version: $(printf '%s' "$out" | tr '\n' ' ' | cut -c1-200)"
    out=$(timeout 60 criu check 2>&1)
    CRIU_CHECK_RC=$?
    CRIU_CHECK=$(printf '%s\n' "$out" | grep -v '^[[:space:]]*$' | tail -n 1 | cut -c1-300)
    say "criu check: exit $CRIU_CHECK_RC: $(printf '%s' "$out" | tr '\n' '|' | cut -c1-600)"
    if [ -d /usr/lib/criu ]; then
        say "WARNING: /usr/lib/criu exists (criu loads plugins from there, a CUDA plugin would interfere): $(find /usr/lib/criu -mindepth 1 -maxdepth 1 -printf '%f ')"
    fi
    say "iptables: $(command -v iptables || echo none); nft: $(command -v nft || echo none) (only an established TCP connection needs them)"
}

# ---------------------------------------------------------------- host

HOST_GPUS="" HOST_DRIVER="" HOST_GPUSNAP=""
host_info() {
    HOST_GPUS=$(timeout 30 nvidia-smi -L 2>&1 | tr '\n' ';')
    HOST_DRIVER=$(timeout 30 nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>&1 | head -n 1)
    say "nvidia-smi -L: $HOST_GPUS"
    say "driver: $HOST_DRIVER; kernel $(uname -r); $(awk '/^MemTotal:/ { printf "host memory %.0f GiB", $2 / 1048576 }' /proc/meminfo)"
    say "dump tmpfs (GPUSNAP_DUMP_TMPFS_DIR, default /dev/shm): $(df -h --output=fstype,size,avail "${GPUSNAP_DUMP_TMPFS_DIR:-/dev/shm}" 2>&1 | tail -n 1)"
    say "compute apps now: $(timeout 30 nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2>&1 | tr '\n' ';')"
    say "disk: $(df -P -h /tmp | awk 'NR == 2 { print $1 " " $2 " size, " $4 " free on /tmp" }')"
    say "THP: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null)"
    say "pipes: fs.pipe-max-size $(cat /proc/sys/fs/pipe-max-size 2>/dev/null); CapEff $(awk '/^CapEff/ {print $2}' /proc/self/status) (CAP_SYS_RESOURCE is bit 24)"
    HOST_GPUSNAP=$(timeout 30 "$GPUSNAP" --version 2>&1 | head -n 1)
    say "gpusnap $GPUSNAP: $HOST_GPUSNAP; commands: $(timeout 30 "$GPUSNAP" --help 2>/dev/null | awk '/^Commands:/ { f = 1; next } /^$/ { f = 0 } f { printf "%s ", $1 }')"
}

# ---------------------------------------------------------------- stages

# weight STAGE: the wall it wants; shares of the time left go by these.
weight() {
    case $1 in e2e) echo 540 ;; bench) echo 240 ;; hbench | multi | guard) echo 300 ;; fault) echo 240 ;; agent) echo 480 ;; keeper) echo 200 ;; rescue) echo 180 ;; contend) echo 360 ;; container) echo 240 ;; runc) echo 300 ;; timing) echo 40 ;; esac
}
# slack STAGE: its watchdog fires this long after its soft budget, and its
# cleanup runs after that.
slack() {
    case $1 in e2e | multi) echo 90 ;; rescue | container | runc) echo 45 ;; contend) echo 60 ;; timing) echo 10 ;; *) echo 75 ;; esac
}
# floor STAGE: below this soft budget the stage cannot do anything useful.
floor_s() {
    case $1 in e2e | multi | guard) echo 150 ;; bench | fault) echo 100 ;; hbench | keeper) echo 120 ;; rescue) echo 90 ;; contend) echo 100 ;; container) echo 90 ;; runc) echo 120 ;; agent) echo 240 ;; timing) echo 15 ;; esac
}

stage_row() { printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >>"$STAGES_TSV"; }

# results_json: everything in one file (rewritten after every stage).
results_json() {
    H_GPUS=$HOST_GPUS H_DRIVER=$HOST_DRIVER H_GPUSNAP=$HOST_GPUSNAP H_KERNEL=$(uname -r) \
        C_INSTALL=$CRIU_INSTALL C_VERSION=$CRIU_VERSION C_CHECK=$CRIU_CHECK C_CHECK_RC=$CRIU_CHECK_RC \
        D_BUDGET=$DEVICE_BUDGET_S D_WALL=$((SECONDS - T0)) \
        python3 - "$STAGES_TSV" "$SCR" "$OUT/results.json" <<'PY' || say "results.json not written"
import json, os, sys
tsv, scr, out = sys.argv[1:4]
E = os.environ
stages = []
for line in open(tsv):
    f = line.rstrip("\n").split("\t")
    if len(f) < 6:
        continue
    st = {"stage": f[0], "rc": int(f[1]) if f[1].lstrip("-").isdigit() else None, "wall_s": int(f[2] or 0),
          "share_s": int(f[3] or 0), "budget_s": int(f[4] or 0), "note": f[5]}
    src = {"e2e": "e2e/gpu-e2e.json", "bench": "bench/bench.json", "hbench": "hbench/bench-hibernate.json",
           "multi": "multi/multi-e2e.json", "timing": "timing/init-timing.json"}.get(f[0])
    try:
        st["result"] = json.load(open(os.path.join(scr, src))) if src else None
    except (OSError, ValueError):
        st["result"] = None
    stages.append(st)
json.dump({"host": {"gpus": E.get("H_GPUS"), "driver": E.get("H_DRIVER"), "kernel": E.get("H_KERNEL"),
                    "gpusnap": E.get("H_GPUSNAP")},
           "criu": {"install": E.get("C_INSTALL"), "version": E.get("C_VERSION"), "check": E.get("C_CHECK"),
                    "check_rc": E.get("C_CHECK_RC")},
           "budget_s": int(E.get("D_BUDGET", 0)), "wall_s": int(E.get("D_WALL", 0)), "stages": stages},
          open(out, "w"), indent=1)
PY
}

# append_log TITLE FILE: a stage's log into device.log.
append_log() {
    [ -s "$2" ] || return 0
    printf '\n==================== %s (%s)\n' "$1" "$2" >>"$DLOG"
    cat "$2" >>"$DLOG"
}

RC_ALL=0
run_stage() {
    local name=$1 i=$2 left sumw=0 s share soft rc t0 dir note="" cmd=() sz=()
    for s in "${STAGES[@]:i}"; do sumw=$((sumw + $(weight "$s"))); done
    left=$((DEVICE_BUDGET_S - (SECONDS - T0) - FINAL_MARGIN))
    share=$((left * $(weight "$name") / sumw))
    soft=$((share - $(slack "$name")))
    if [ "$soft" -lt "$(floor_s "$name")" ]; then
        note="skipped: ${left}s left, its share ${share}s gives a budget of ${soft}s < $(floor_s "$name")s"
        say "stage $name $note"
        stage_row "$name" -1 0 "$share" "$soft" "$note"
        RC_ALL=1
        return 0
    fi
    dir=$SCR/$name
    mkdir -p "$dir"
    case $name in
        e2e) cmd=(env OUT="$dir" E2E_BUDGET_S="$soft" tests/gpu/e2e.sh) ;;
        bench)
            read -r -a sz <<<"${BENCH_SIZES:-12}"
            cmd=(env OUT="$dir" BENCH_BUDGET_S="$soft" bench/gpu/suspend-resume.sh "${sz[@]}")
            ;;
        hbench)
            read -r -a sz <<<"${HBENCH_SIZES:-12}"
            cmd=(env OUT="$dir" HBENCH_BUDGET_S="$soft" bench/gpu/hibernate.sh "${sz[@]}")
            ;;
        multi) cmd=(env OUT="$dir" MULTI_BUDGET_S="$soft" tests/gpu/multi-e2e.sh) ;;
        agent) cmd=(env OUT="$dir" AGENT_BENCH_BUDGET_S="$soft" bench/gpu/agent.sh) ;;
        keeper) cmd=(env OUT="$dir" KEEPER_BUDGET_S="$soft" tests/gpu/keeper-e2e.sh) ;;
        rescue) cmd=(env OUT="$dir" RESCUE_BUDGET_S="$soft" tests/gpu/rescue-e2e.sh) ;;
        contend) cmd=(env OUT="$dir" CONTEND_BUDGET_S="$soft" bench/gpu/contend.sh) ;;
        container)
            # The CRIU-plugin flow first (two thirds), then podman where it is
            # installed or carried as .debs (PODMAN=0 leaves it out).
            cmd=(bash -c 'rc=0
                env OUT="$1" CONT_BUDGET_S="$2" tests/gpu/container-e2e.sh || rc=1
                if [ "${PODMAN:-1}" = 1 ]; then env OUT="$1" PODMAN_BUDGET_S="$3" tests/gpu/podman-e2e.sh || rc=1; fi
                exit $rc' _ "$dir" "$((soft * 2 / 3))" "$((soft / 3))")
            ;;
        runc)
            # The same worker bare through CRIU first (its figures are the
            # ones runc's are set against), then the container through runc
            # with what is left.
            cmd=(bash -c 'rc=0 t=$SECONDS
                if [ "${RUNC_BARE:-1}" = 1 ]; then
                    env OUT="$1/bare" CONT_MODES=bare CONT_FILL=0 CONT_BUDGET_S=120 tests/gpu/container-e2e.sh || rc=1
                fi
                env OUT="$1" RUNC_BUDGET_S=$(($2 - (SECONDS - t))) RUNC_BARE_MD="$1/bare/container-e2e.md" tests/gpu/runc-e2e.sh || rc=1
                exit $rc' _ "$dir" "$soft")
            ;;
        timing) cmd=(env OUT="$dir" bench/gpu/init-timing.sh) ;;
        fault) cmd=(env OUT="$dir" FAULT_BUDGET_S="$soft" tests/gpu/fault-e2e.sh) ;;
        guard)
            # Three runs in one stage, a third of the budget each.
            local third=$((soft / 3))
            cmd=(bash -c 'rc=0
                env OUT="$1/traced" GUARD_BUDGET_S="$2" tests/gpu/guard-e2e.sh || rc=1
                env OUT="$1/light" GUARD_BUDGET_S="$2" GUARD_RUN_ARGS=--light GUARD_KEEPER=0 tests/gpu/guard-e2e.sh || rc=1
                env OUT="$1/bench" GUARD_BENCH_BUDGET_S="$2" bench/gpu/guard.sh || rc=1
                exit $rc' _ "$dir" "$((third - 45))")
            ;;
    esac
    say "stage $name: share ${share}s of ${left}s left, soft budget ${soft}s: ${cmd[*]}"
    t0=$SECONDS
    rc=0
    # The stage's own watchdog ends it through its cleanup; this is the last resort.
    timeout -s TERM -k 30 $((share + 10)) "${cmd[@]}" >"$dir/stdout.txt" 2>"$dir/stderr.txt" || rc=$?
    say "stage $name: exit $rc after $((SECONDS - t0))s"
    [ "$rc" = 0 ] || RC_ALL=1
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then note="ended by the device.sh timeout"; fi
    stage_row "$name" "$rc" "$((SECONDS - t0))" "$share" "$soft" "$note"
    case $name in
        e2e)
            cp -f "$dir/gpu-e2e.md" "$OUT/" 2>/dev/null || say "e2e wrote no gpu-e2e.md"
            if [ -s "$dir/e2e.log" ]; then cp -f "$dir/e2e.log" "$OUT/"; else cp -f "$dir/stderr.txt" "$OUT/e2e.log"; fi
            ;;
        bench)
            cp -f "$dir/bench.md" "$OUT/" 2>/dev/null || say "bench wrote no bench.md"
            if [ -s "$dir/bench.log" ]; then append_log bench.log "$dir/bench.log"; else append_log "bench stderr" "$dir/stderr.txt"; fi
            ;;
        hbench)
            cp -f "$dir/bench-hibernate.md" "$OUT/" 2>/dev/null || say "hbench wrote no bench-hibernate.md"
            if [ -s "$dir/bench-hibernate.log" ]; then
                append_log bench-hibernate.log "$dir/bench-hibernate.log"
            else
                append_log "hbench stderr" "$dir/stderr.txt"
            fi
            ;;
        guard)
            cp -f "$dir/traced/guard-e2e.md" "$OUT/guard-e2e.md" 2>/dev/null || say "guard wrote no guard-e2e.md"
            cp -f "$dir/light/guard-e2e.md" "$OUT/guard-e2e-light.md" 2>/dev/null || say "guard (light) wrote no guard-e2e.md"
            cp -f "$dir/bench/guard-bench.md" "$OUT/" 2>/dev/null || say "guard wrote no guard-bench.md"
            for f in traced/guard-e2e.log light/guard-e2e.log bench/guard-bench.log; do
                if [ -s "$dir/$f" ]; then append_log "$f" "$dir/$f"; fi
            done
            append_log "guard stderr" "$dir/stderr.txt"
            ;;
        agent)
            cp -f "$dir/agent-bench.md" "$OUT/" 2>/dev/null || say "agent wrote no agent-bench.md"
            if [ -s "$dir/agent-bench.log" ]; then append_log agent-bench.log "$dir/agent-bench.log"; else append_log "agent stderr" "$dir/stderr.txt"; fi
            ;;
        timing)
            cp -f "$dir/init-timing.md" "$OUT/" 2>/dev/null || say "timing wrote no init-timing.md"
            append_log "timing stderr" "$dir/stderr.txt"
            ;;
        container)
            cp -f "$dir/container-e2e.md" "$OUT/" 2>/dev/null || say "container wrote no container-e2e.md"
            cp -f "$dir/podman-e2e.md" "$OUT/" 2>/dev/null || say "container wrote no podman-e2e.md"
            for f in container-e2e.log podman-e2e.log; do
                if [ -s "$dir/$f" ]; then append_log "$f" "$dir/$f"; fi
            done
            append_log "container stderr" "$dir/stderr.txt"
            ;;
        runc)
            cp -f "$dir/runc-e2e.md" "$OUT/" 2>/dev/null || say "runc wrote no runc-e2e.md"
            cp -f "$dir/bare/container-e2e.md" "$OUT/runc-bare.md" 2>/dev/null || say "runc's bare run wrote no container-e2e.md"
            for f in bare/container-e2e.log runc-e2e.log; do
                if [ -s "$dir/$f" ]; then append_log "$f" "$dir/$f"; fi
            done
            append_log "runc stderr" "$dir/stderr.txt"
            ;;
        keeper | rescue | fault)
            cp -f "$dir/$name-e2e.md" "$OUT/" 2>/dev/null || say "$name wrote no $name-e2e.md"
            if [ -s "$dir/$name-e2e.log" ]; then append_log "$name-e2e.log" "$dir/$name-e2e.log"; else append_log "$name stderr" "$dir/stderr.txt"; fi
            ;;
        contend)
            cp -f "$dir/contend.md" "$OUT/" 2>/dev/null || say "contend wrote no contend.md"
            # The traces in one file: the call brings back only so many.
            (cd "$dir" && tar czf "$OUT/contend-traces.tar.gz" pcie-*.tsv threads-*.tsv wake*.gz 2>/dev/null) || true
            if [ -s "$dir/contend.log" ]; then append_log contend.log "$dir/contend.log"; else append_log "contend stderr" "$dir/stderr.txt"; fi
            ;;
        multi)
            cp -f "$dir/multi-e2e.md" "$OUT/" 2>/dev/null || say "multi wrote no multi-e2e.md"
            if [ -s "$dir/multi-e2e.log" ]; then append_log multi-e2e.log "$dir/multi-e2e.log"; else append_log "multi stderr" "$dir/stderr.txt"; fi
            ;;
    esac
    record_stage "$name" "$rc" "${cmd[*]}"
    results_json
}

# record_stage STAGE RC CMD: the stage's tables as the next numbered, dated
# file of $OUT/bench/results (bench/record.sh; copy them into the
# repository's bench/results), headed by the host and the stage's exit.
record_stage() {
    local name=$1 rc=$2 cmd=$3 tmp f md=() got
    case $name in
        e2e) md=(gpu-e2e.md) ;;
        bench) md=(bench.md) ;;
        hbench) md=(bench-hibernate.md) ;;
        guard) md=(guard-e2e.md guard-e2e-light.md guard-bench.md) ;;
        keeper | rescue | multi | fault) md=("$name-e2e.md") ;;
        agent) md=(agent-bench.md) ;;
        contend) md=(contend.md) ;;
        container) md=(container-e2e.md podman-e2e.md) ;;
        runc) md=(runc-e2e.md runc-bare.md) ;;
        timing) md=(init-timing.md) ;;
    esac
    tmp=$SCR/$name.result.md
    {
        echo "- host: $HOST_GPUS driver $HOST_DRIVER; kernel $(uname -r); gpusnap: $HOST_GPUSNAP; CRIU ${CRIU_VERSION:-none}"
        echo "- stage: \`$name\`, exit $rc; settings: $(env | grep -E '^(WORKER_[A-Z_]+|HB_[A-Z_]+|[A-Z]+_(SIZES|GIB|MODES|WAKES|LOADS|WAKE_ENV|PROBE|MAP|SECTIONS)|REPS|DEVICE_BUDGET_S)=' | sort | tr '\n' ' ')"
        for f in "${md[@]}"; do
            if [ -s "$OUT/$f" ]; then
                echo
                cat "$OUT/$f"
            fi
        done
    } >"$tmp"
    if got=$(RESULTS_DIR=$OUT/bench/results BENCH_TITLE="GPU stage $name" BENCH_CMD="$cmd" bench/record.sh "$name" "$tmp" 2>&1); then
        say "stage $name: results in ${got#"$OUT"/}"
    else
        say "stage $name: results not recorded: $got"
    fi
}

# summary: what matters, last on stdout (the caller sees the tail).
summary() {
    local name rc wall share soft note
    echo
    echo "==================== device.sh summary (wall $((SECONDS - T0)) s of $DEVICE_BUDGET_S s)"
    echo "gpus: $HOST_GPUS driver $HOST_DRIVER; gpusnap: $HOST_GPUSNAP; criu: ${CRIU_VERSION:-none} (check exit $CRIU_CHECK_RC: $CRIU_CHECK)"
    while IFS=$'\t' read -r name rc wall share soft note; do
        echo "stage $name: exit $rc, ${wall}s (share ${share}s, soft budget ${soft}s)${note:+; $note}"
    done <"$STAGES_TSV"
    if [ -s "$SCR/e2e/gpu-e2e.md" ]; then
        echo
        grep -E '^- (result|criu|sections):' "$SCR/e2e/gpu-e2e.md"
        echo "e2e rows not PASS, and the CRIU sections' rows:"
        grep -E '^\| ' "$SCR/e2e/gpu-e2e.md" | grep -E '\| (FAIL|SKIP|INFO) \||^\| [hrx][0-9]* \|' | cut -c1-400
    fi
    if [ -s "$SCR/bench/bench.md" ]; then
        echo
        echo "bench:"
        sed -n '/^| size GiB | footprint/,/^$/p' "$SCR/bench/bench.md"
        sed -n '/^## Notes/,$p' "$SCR/bench/bench.md" | head -n 12
    fi
    if [ -s "$SCR/hbench/bench-hibernate.md" ]; then
        echo
        echo "hbench:"
        sed -n '/^| size GiB | footprint/,/^$/p' "$SCR/hbench/bench-hibernate.md"
        grep -E '^gpusnap cycle|^Images:' "$SCR/hbench/bench-hibernate.md"
        # The targets, where the dump goes, the page server per lazy wake.
        sed -n '/^## Targets/,/^## Every sample/p' "$SCR/hbench/bench-hibernate.md" | grep -v '^## Every sample' | cut -c1-400
        sed -n '/^## Notes/,$p' "$SCR/hbench/bench-hibernate.md" | head -n 12
    fi
    if [ -s "$SCR/multi/multi-e2e.md" ]; then
        echo
        grep -E '^- (GPUs|result|m2 parallel)' "$SCR/multi/multi-e2e.md"
        echo "multi rows not PASS, and the m2 ratios:"
        grep -E '^\| ' "$SCR/multi/multi-e2e.md" | grep -E '\| (FAIL|SKIP|INFO) \||^\| m2\.r[0-9] \|' | cut -c1-400
    fi
    if [ -s "$SCR/keeper/keeper-e2e.md" ]; then
        echo
        grep -E '^- result' "$SCR/keeper/keeper-e2e.md"
        grep -E '^\| [kz][0-9]* \|' "$SCR/keeper/keeper-e2e.md" | cut -c1-400
    fi
    if [ -s "$SCR/rescue/rescue-e2e.md" ]; then
        echo
        grep -E '^- (result|workloads)' "$SCR/rescue/rescue-e2e.md"
        echo "rescue rows not PASS, and each wake's:"
        grep -E '^\| ' "$SCR/rescue/rescue-e2e.md" | grep -E '\| (FAIL|SKIP|INFO) \||^\| [a-z]+\.[a-d]\.1 \|' | cut -c1-300
    fi
    if [ -s "$SCR/container/container-e2e.md" ]; then
        echo
        grep -E '^(- |\| )' "$SCR/container/container-e2e.md" | cut -c1-400
    fi
    if [ -s "$SCR/container/podman-e2e.md" ]; then
        echo
        grep -E '^(- |\| )' "$SCR/container/podman-e2e.md" | cut -c1-400
    fi
    if [ -s "$SCR/runc/runc-e2e.md" ]; then
        echo
        grep -E '^(- |\| )' "$SCR/runc/runc-e2e.md" | cut -c1-400
    fi
    if [ -s "$SCR/timing/init-timing.md" ]; then
        echo
        grep -E '^(- |\| )' "$SCR/timing/init-timing.md"
    fi
    echo "files in $OUT: $(find "$OUT" -mindepth 1 -maxdepth 1 -printf '%f (%s bytes) ')"
}

say "gpusnap device run: stages ${STAGES[*]}, budget ${DEVICE_BUDGET_S}s; results in $OUT, scratch in $SCR"
want=0
for s in "${STAGES[@]}"; do want=$((want + $(weight "$s"))); done
if [ "$want" -gt "$DEVICE_BUDGET_S" ]; then
    say "NOTE: these stages want about ${want}s, the budget is ${DEVICE_BUDGET_S}s: each gets less and skips what does not fit; run e2e alone and 'bench hbench' in another call"
fi
install_criu
host_info
if ! timeout 30 "$GPUSNAP" --version >/dev/null 2>&1; then
    say "ERROR: $GPUSNAP does not run (carry a release build; no cargo here): $(ls -la "$GPUSNAP" 2>&1)"
    RC_ALL=1
else
    for i in "${!STAGES[@]}"; do
        run_stage "${STAGES[$i]}" "$i"
    done
fi
results_json
summary
exit "$RC_ALL"
