#!/usr/bin/env bash
# gpusnap's own cost on suspend and resume, apart from the driver's.
#
#   bench/cpu/overhead.sh            REPS=9 SIZES="12 50" GBPS=20 bench/cpu/overhead.sh
#
# Runs on any machine (no GPU): the fake driver and NVML of this workspace
# (docs/design/fakes.md) copy at a fixed GBPS, so the driver's part of every call
# is the same each time and what differs between "bare" and gpusnap is
# gpusnap's own work (process start, /proc, NVML, the SQLite journal and
# ledger). bare = one `fake-workload --driver-call` process per driver call
# (lock + checkpoint, restore + unlock), the way a script drives the raw
# API; gpusnap = `gpusnap --json suspend|resume PID`. The two alternate
# (ABBA) REPS times per size. Prints a markdown table (medians): the
# suspend/resume target is "adds under 2 % or 100 ms, whichever is larger". The GPU
# benchmark with the real driver is bench/gpu/suspend-resume.sh (docs/benchmarks.md).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=bench/cpu/lib.sh
. bench/cpu/lib.sh
record_self overhead "$@"

REPS=${REPS:-9}
SIZES=${SIZES:-12 50}
GBPS=${GBPS:-20}

cargo build --release --quiet -p gpusnap
work=$(mktemp -d /tmp/gpusnap-overhead.XXXXXX)
pids=()
cleanup() {
    local p
    for p in ${pids[@]+"${pids[@]}"}; do kill -9 "$p" 2>/dev/null || true; done
    rm -rf -- "$work"
}
trap cleanup EXIT
PROFILE=release scripts/fakes.sh "$work/lib" >/dev/null
export LD_LIBRARY_PATH=$work/lib GPUSNAP_FAKE_DIR=$work/fake GPUSNAP_STATE_DIR=$work/state
mkdir -p "$GPUSNAP_FAKE_DIR"
printf '{ "gpus": [ { "name": "NVIDIA H200 (fake)", "total_mib": 143771 } ], "checkpoint_gbps": %s, "restore_gbps": %s }\n' \
    "$GBPS" "$GBPS" >"$GPUSNAP_FAKE_DIR/config.json"
gs=target/release/gpusnap
fw=$work/lib/fake-workload
tsv=$work/runs.tsv
: >"$tsv"

elapsed() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.6f}')" "$1" "$2"; }

# bare OP PID: the raw calls, one process each; prints the wall seconds.
bare() {
    local t0 t1 calls
    if [ "$1" = suspend ]; then calls=(lock checkpoint); else calls=(restore unlock); fi
    t0=$(now)
    for c in "${calls[@]}"; do
        "$fw" --driver-call "$c" "$2" | grep -qx 'rc=0' || { echo "bare $c of $2 failed" >&2; exit 1; }
    done
    t1=$(now)
    elapsed "$t0" "$t1"
}

# viagpusnap OP PID: prints "wall internal" seconds.
viagpusnap() {
    local t0 t1 out
    t0=$(now)
    out=$("$gs" --json "$1" "$2")
    t1=$(now)
    printf '%s %s\n' "$(elapsed "$t0" "$t1")" \
        "$(printf '%s' "$out" | python3 -c 'import json,sys; print(json.load(sys.stdin)["results"][0]["total_ms"] / 1000)')"
}

for size in $SIZES; do
    status=$work/status-$size
    "$fw" --mib $((size * 1024)) --status "$status" >/dev/null 2>&1 &
    pid=$!
    pids+=("$pid")
    for _ in $(seq 1 100); do [ -s "$status" ] && break; sleep 0.1; done
    for rep in $(seq 1 "$REPS"); do
        for way in $([ $((rep % 2)) = 1 ] && echo "bare gpusnap" || echo "gpusnap bare"); do
            for op in suspend resume; do
                if [ "$way" = bare ]; then
                    printf '%s\t%s\t%s\t%s\t-\n' "$size" "$op" "$way" "$(bare "$op" "$pid")" >>"$tsv"
                else
                    read -r wall internal < <(viagpusnap "$op" "$pid")
                    printf '%s\t%s\t%s\t%s\t%s\n' "$size" "$op" "$way" "$wall" "$internal" >>"$tsv"
                fi
            done
        done
    done
    "$gs" stop --grace 5 "$pid" >/dev/null
done

python3 - "$tsv" "$GBPS" "$REPS" <<'PY'
import statistics, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
gbps, reps = sys.argv[2], sys.argv[3]
print(f"fake driver at {gbps} GB/s, {reps} repetitions each way (alternating), medians")
print()
print("| size GiB | op | bare s | gpusnap wall s | gpusnap internal s | overhead ms | allowed ms | target met |")
print("|---|---|---|---|---|---|---|---|")
for size in dict.fromkeys(r[0] for r in rows):
    for op in ("suspend", "resume"):
        b = statistics.median(float(r[3]) for r in rows if r[0] == size and r[1] == op and r[2] == "bare")
        g = [r for r in rows if r[0] == size and r[1] == op and r[2] == "gpusnap"]
        gw = statistics.median(float(r[3]) for r in g)
        gi = statistics.median(float(r[4]) for r in g)
        over = (gw - b) * 1000
        allowed = max(0.02 * b * 1000, 100)
        print(f"| {size} | {op} | {b:.3f} | {gw:.3f} | {gi:.3f} | {over:.0f} | {allowed:.0f} | {'yes' if over <= allowed else '**no**'} |")
PY
