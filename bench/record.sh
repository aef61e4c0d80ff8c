#!/usr/bin/env bash
# Records one measurement as the next numbered, dated file of bench/results:
#
#   bench/record.sh NAME [FILE]      (standard input without FILE)
#
# writes RESULTS_DIR/NNN-YYYY-MM-DD-NAME.md (NNN one more than the highest
# number in bench/results and in RESULTS_DIR) with a header (title, machine,
# date, commit, command) and then the markdown of FILE, and prints its path.
# Environment:
#   RESULTS_DIR   where to write (default: bench/results of this repository;
#                 tests/gpu/device.sh uses $OUT/bench/results)
#   BENCH_TITLE   the title (default: NAME)
#   BENCH_CMD     the command that measured it (default: not recorded)
#   BENCH_COMMIT  the commit, where git cannot tell it (no .git on the GPU
#                 machine's copy)
# Exit 2 on bad input (no NAME, FILE unreadable, empty results).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
name=${1:-}
src=${2:--}
if [ -z "$name" ] || [ $# -gt 2 ]; then
    echo "usage: bench/record.sh NAME [FILE]" >&2
    exit 2
fi
slug=$(printf '%s' "$name" | tr 'A-Z' 'a-z' | tr -c 'a-z0-9\n' '-' | sed 's/--*/-/g; s/^-//; s/-$//')
if [ -z "$slug" ]; then
    echo "record.sh: NAME needs a letter or digit: $name" >&2
    exit 2
fi
if [ "$src" != - ] && [ ! -r "$src" ]; then
    echo "record.sh: cannot read $src" >&2
    exit 2
fi
dir=${RESULTS_DIR:-$repo/bench/results}
mkdir -p "$dir"

body=$(mktemp)
trap 'rm -f "$body"' EXIT
cat -- "$src" >"$body"
if [ ! -s "$body" ]; then
    echo "record.sh: nothing to record for $name (empty input)" >&2
    exit 2
fi

# The next number, over the repository's files and those already in $dir.
last=$(find "$repo/bench/results" "$dir" -maxdepth 1 -name '[0-9][0-9][0-9]-*.md' -printf '%f\n' 2>/dev/null |
    cut -c1-3 | sort -n | tail -n 1)
num=$(printf '%03d' $((10#${last:-0} + 1)))
day=$(date -u +%Y-%m-%d)
out=$dir/$num-$day-$slug.md

commit=${BENCH_COMMIT:-}
if [ -z "$commit" ] && git -C "$repo" rev-parse --git-dir >/dev/null 2>&1; then
    commit=$(git -C "$repo" rev-parse --short HEAD)
    if ! git -C "$repo" diff --quiet HEAD -- 2>/dev/null; then commit="$commit + uncommitted changes"; fi
fi
machine="$(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')), $(awk '/^MemTotal:/ { printf "%.0f GiB", $2 / 1048576 }' /proc/meminfo), kernel $(uname -r)"
gpu=none
if command -v nvidia-smi >/dev/null 2>&1; then
    gpu=$(timeout 30 nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | sort | uniq -c |
        awk '{ n = $1; $1 = ""; sub(/^ /, ""); printf "%s%dx %s (name, driver)", (NR > 1 ? "; " : ""), n, $0 }')
    gpu=${gpu:-none}
fi

{
    echo "# ${BENCH_TITLE:-$name}"
    echo
    echo "- machine: $machine; GPU: $gpu"
    echo "- date: $day $(date -u +%H:%M) UTC"
    echo "- commit: ${commit:-unknown}"
    echo "- command: ${BENCH_CMD:-not recorded}"
    echo
    cat "$body"
} >"$out"
echo "$out"
