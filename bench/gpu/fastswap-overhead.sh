#!/usr/bin/env bash
# What fast swap costs a program while it runs: bench/gpu/fastswap_overhead.py
# (an allocation-heavy training step, with and without PyTorch's caching
# allocator, and a launch-bound inference loop) run bare, under
# `gpusnap run --light` and under `gpusnap run --light --fast-swap`,
# interleaved, REPS times each; prints a markdown table of the median it/s
# and fast swap's cost against the light guard alone (target <= 2 %).
#
#   bench/gpu/fastswap-overhead.sh [SECONDS] [REPS]     (defaults 8, 3)
#
# OVERHEAD_CASES selects (default "train nocache infer").
# Needs .dev/gpusnap and .dev/libgpusnap_preload.so (a release build).
set -uo pipefail
SECS=${1:-8}
REPS=${2:-3}
G=$PWD/.dev/gpusnap
export GPUSNAP_PRELOAD=$PWD/.dev/libgpusnap_preload.so
export GPUSNAP_STATE_DIR=${GPUSNAP_STATE_DIR:-/tmp/fastswap-overhead-state}
mkdir -p "$GPUSNAP_STATE_DIR"
PY=$(dirname "$0")/fastswap_overhead.py
R=$(mktemp)
one() { # KIND HOW [ENV...]
    local kind=$1 how=$2; shift 2
    local out
    case $how in
        bare) out=$(env "$@" python3 "$PY" "$kind" "$SECS" 2>/dev/null) ;;
        light) out=$(env "$@" timeout 300 "$G" run --light -- python3 "$PY" "$kind" "$SECS" 2>/dev/null) ;;
        fast) out=$(env "$@" timeout 300 "$G" run --light --fast-swap -- python3 "$PY" "$kind" "$SECS" 2>/dev/null) ;;
    esac
    # Each sample on stderr as it comes, so a run cut short still says something.
    echo "$kind${*:+ $*} $how $(awk '{print $4}' <<<"$out")" | tee -a "$R" >&2
}
for ((r = 0; r < REPS; r++)); do
    for how in bare light fast; do
        case " ${OVERHEAD_CASES:-train nocache infer} " in *" train "*) one train "$how" ;; esac
        case " ${OVERHEAD_CASES:-train nocache infer} " in *" nocache "*) one train "$how" PYTORCH_NO_CUDA_MEMORY_CACHING=1 ;; esac
        case " ${OVERHEAD_CASES:-train nocache infer} " in *" infer "*) one infer "$how" ;; esac
    done
done
python3 - "$R" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    *case, how, v = line.split()
    try:
        rows.setdefault(" ".join(case), {}).setdefault(how, []).append(float(v))
    except ValueError:
        rows.setdefault(" ".join(case), {}).setdefault(how, [])
print("| program | bare it/s | run --light it/s | run --light --fast-swap it/s | fast swap's cost vs --light | vs bare |")
print("|---|---|---|---|---|---|")
for case, d in rows.items():
    m = {h: (statistics.median(d[h]) if d.get(h) else None) for h in ("bare", "light", "fast")}
    f = lambda x: "-" if x is None else f"{x:.1f}"
    cost = lambda a, b: "-" if not a or not b else f"{(1 - b / a) * 100:+.1f} %"
    print(f"| {case} | {f(m['bare'])} | {f(m['light'])} | {f(m['fast'])} | {cost(m['light'], m['fast'])} | {cost(m['bare'], m['fast'])} |")
PY
rm -f "$R"
