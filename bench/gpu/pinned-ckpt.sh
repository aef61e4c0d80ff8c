#!/usr/bin/env bash
# What the driver's checkpoint and restore cost for page-locked host memory a
# process holds: bench/gpu/pinned_holder.py with 1 GiB on the GPU and GB of
# pinned host memory (none, registered, cuMemHostAlloc), suspended and
# resumed through gpusnap twice; prints the driver's checkpoint_ms and
# restore_ms per case as a markdown table.
#
#   bench/gpu/pinned-ckpt.sh [GB...]      (default: 16 48)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
G=$PWD/.dev/gpusnap
export GPUSNAP_STATE_DIR=/tmp/pinned-ckpt-state
W=/tmp/pinned-ckpt; rm -rf "$W"; mkdir -p "$W" "$GPUSNAP_STATE_DIR"
ms() { python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['results'][0]; print(r.get(sys.argv[2], ''))" "$1" "$2" 2>/dev/null; }
echo "| pinned host memory | GB | round | checkpoint ms | restore ms |"
echo "|---|---|---|---|---|"
for gb in ${*:-16 48}; do
    for mode in none register alloc; do
        [ "$mode" = none ] && [ "$gb" != "${1:-16}" ] && continue
        st=$W/$mode-$gb.status
        setsid python3 bench/gpu/pinned_holder.py "$gb" "$mode" "$st" > "$W/$mode-$gb.log" 2>&1 < /dev/null &
        for _ in $(seq 600); do [ -s "$st" ] && break; sleep 0.2; done
        [ -s "$st" ] || { echo "| $mode | $gb | did not start | | |"; continue; }
        read -r _ pid < "$st"
        for round in 1 2; do
            timeout 300 "$G" --json suspend "$pid" > "$W/s.json" 2> "$W/s.err"
            timeout 300 "$G" --json resume "$pid" > "$W/r.json" 2> "$W/r.err"
            echo "| $mode | $gb | $round | $(ms "$W/s.json" checkpoint_ms) | $(ms "$W/r.json" restore_ms) |"
        done
        timeout 120 "$G" stop "$pid" > /dev/null 2>&1
    done
done
