#!/usr/bin/env bash
# Fast swap against the driver path on one GPU: a PyTorch program (caching
# allocator, a CUDA graph) and a CuPy one, each under `gpusnap run --light`
# with and without --fast-swap, suspended and resumed through gpusnap twice;
# the program's checksum of all its memory (and the graph's output) before
# and after each round; NVML's view of the process after the suspend. Also
# PyTorch with expandable_segments (VMM-mapped memory) through the driver
# path alone. Prints a markdown table; logs go to $OUT (or /tmp).
# CASES selects (default: all but the pinning variants): torch-fast,
# torch-fast-keep (pinned copies kept between rounds), torch-fast-alloc
# (pinned with cuMemHostAlloc), cupy-fast, torch-driver, cupy-driver,
# torch-vmm-driver, jax-fast, jax-driver (XLA's allocator, CUPY_GB); park
# (`gpusnap park`: memory out, the context kept, no driver lock; then
# `resume`; PARK_ROUNDS rounds, 3): torch-park, torch-park-keep (pinned
# copies kept), torch-park-keep-16 and torch-park-keep-55 (16 and 55 GB),
# torch-park-vmm (expandable_segments, CUPY_GB).
#
#   bench/gpu/fastswap.sh [GB] [CUPY_GB]      (GB default 26)
#
# Needs .dev/gpusnap and .dev/libgpusnap_preload.so (a release build).
set -uo pipefail
GB=${1:-26}
CUPY_GB=${2:-8}
OUT=${OUT:-/tmp/fastswap-out}
mkdir -p "$OUT"
G=$PWD/.dev/gpusnap
export GPUSNAP_PRELOAD=$PWD/.dev/libgpusnap_preload.so
export GPUSNAP_STATE_DIR=/tmp/fastswap-state
export GPUSNAP_FAST_SWAP_VERIFY=${VERIFY:-0}
mkdir -p "$GPUSNAP_STATE_DIR"
W=/tmp/fastswap-work
rm -rf "$W"; mkdir -p "$W"
ROWS=$OUT/rows.md
: > "$ROWS"
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/log.txt" >&2; }

used_mib() { timeout 30 nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null | awk -F', ' -v p="$1" '$1==p {print $2}'; }
# shellcheck source=tests/gpu/fastswap-lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/../../tests/gpu/fastswap-lib.sh"

# case NAME MODE(fast|driver) PROG GB [ENV...]
run_case() {
    local name=$1 mode=$2 prog=$3 gb=$4; shift 4
    local st=$W/$name.status flag=() verb=suspend rounds=2
    [ "$mode" = fast ] && flag=(--fast-swap)
    # park: the library moves the memory out, the context stays (no driver
    # lock); three rounds, so that the first (pinning) and the later ones show.
    [ "$mode" = park ] && flag=(--fast-swap) verb=park rounds=${PARK_ROUNDS:-3}
    log "case $name: $mode $prog $gb GB"
    env "$@" setsid "$G" run --light "${flag[@]}" -- python3 "$prog" "$gb" "$st" \
        > "$OUT/$name.out" 2> "$OUT/$name.err" < /dev/null &
    local runner=$!
    if ! wait_file "$st" 300; then
        log "$name: the program did not start"; tail -5 "$OUT/$name.err" >&2
        echo "| $name | $mode | $gb | did not start | | | | | |" >> "$ROWS"
        return
    fi
    local pid d0
    read -r _ pid d0 < "$st"
    local before; before=$(used_mib "$pid")
    log "$name: pid $pid, $before MiB on the GPU, checksum $d0"
    timeout 60 "$G" --json ps > "$OUT/$name.ps-before.json" 2>&1
    for round in $(seq "$rounds"); do
        local t0 t1 t2 after d1 ok
        t0=$(date +%s.%N)
        GPUSNAP_LOG=info timeout 120 "$G" --json "$verb" "$pid" > "$OUT/$name.suspend$round.json" 2> "$OUT/$name.suspend$round.err"
        t1=$(date +%s.%N)
        after=$(used_mib "$pid"); after=${after:-0}
        timeout 60 "$G" --json ps > "$OUT/$name.ps-suspended$round.json" 2>&1
        GPUSNAP_LOG=info timeout 120 "$G" --json resume "$pid" > "$OUT/$name.resume$round.json" 2> "$OUT/$name.resume$round.err"
        t2=$(date +%s.%N)
        d1=$(digest "$st")
        ok=no; [ "$d1" = "$d0" ] && ok=yes
        local s r
        s=$(python3 -c "print('%.2f' % ($t1 - $t0))"); r=$(python3 -c "print('%.2f' % ($t2 - $t1))")
        log "$name round $round: suspend $s s (GPU after: $after MiB), resume $r s, data identical: $ok"
        echo "| $name | $mode | $gb | $before | $round | $s | $after | $r | $ok |" >> "$ROWS"
    done
    "$G" history "$pid" > "$OUT/$name.journal.txt" 2>&1 || true
    timeout 120 "$G" stop "$pid" > "$OUT/$name.stop.txt" 2>&1
    for _ in $(seq 120); do kill -0 "$runner" 2>/dev/null || break; sleep 0.5; done
}

log "GPU: $(nvidia-smi -L 2>&1 | head -1); driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)"
cd "$(dirname "$0")/../.." || exit 1
CASES=${CASES:-torch-fast cupy-fast torch-driver cupy-driver torch-vmm-driver}
for c in $CASES; do
    case $c in
        torch-fast) run_case torch-fast fast tests/gpu/fastswap_torch.py "$GB" ;;
        torch-fast-keep) run_case torch-fast-keep fast tests/gpu/fastswap_torch.py "$GB" GPUSNAP_FAST_SWAP_KEEP=1 ;;
        torch-fast-alloc) run_case torch-fast-alloc fast tests/gpu/fastswap_torch.py "$GB" GPUSNAP_FAST_SWAP_PIN=alloc ;;
        torch-driver) run_case torch-driver driver tests/gpu/fastswap_torch.py "$GB" ;;
        torch-park) run_case torch-park park tests/gpu/fastswap_torch.py "$GB" ;;
        torch-park-keep) run_case torch-park-keep park tests/gpu/fastswap_torch.py "$GB" GPUSNAP_FAST_SWAP_KEEP=1 ;;
        torch-park-keep-16) run_case torch-park-keep-16 park tests/gpu/fastswap_torch.py 16 GPUSNAP_FAST_SWAP_KEEP=1 ;;
        torch-park-keep-55) run_case torch-park-keep-55 park tests/gpu/fastswap_torch.py 55 GPUSNAP_FAST_SWAP_KEEP=1 ;;
        torch-park-vmm) run_case torch-park-vmm park tests/gpu/fastswap_torch.py "$CUPY_GB" \
            PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True GPUSNAP_FAST_SWAP_KEEP=1 ;;
        cupy-fast) run_case cupy-fast fast tests/gpu/fastswap_cupy.py "$CUPY_GB" ;;
        jax-fast) run_case jax-fast fast tests/gpu/fastswap_jax.py "$CUPY_GB" ;;
        jax-driver) run_case jax-driver driver tests/gpu/fastswap_jax.py "$CUPY_GB" ;;
        cupy-driver) run_case cupy-driver driver tests/gpu/fastswap_cupy.py "$CUPY_GB" ;;
        torch-vmm-driver) run_case torch-vmm-driver driver tests/gpu/fastswap_torch.py "$CUPY_GB" \
            PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True ;;
    esac
done

echo "| program | path | GB asked | MiB on GPU | round | suspend (park) s | MiB on GPU after | resume s | data identical |"
echo "|---|---|---|---|---|---|---|---|---|"
cat "$ROWS"
