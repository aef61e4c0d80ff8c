#!/usr/bin/env bash
# The page server's source read throughput on this machine: the pages of an
# image read the way the fill threads read them (next 4 MiB batch in address
# order, 1 MiB at a time) from a directory image against the same bytes as
# chunks in the store, for a repeated pattern (tests/gpu/worker.py's memory)
# and random bytes, page cache warm; plus the up-front verify of the chunks.
#
#   bench/cpu/pagesrc.sh [SIZE_MIB [THREADS...]]    (default 2048 MiB, 1 and all cores)
#
# BENCH_DIR: where the data goes (default: $TMPDIR or /tmp; needs 2 x
# SIZE_MIB x 2 of space).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=bench/cpu/lib.sh
. bench/cpu/lib.sh
record_self pagesrc-cpu "$@"
cargo build --release -q -p gpusnap-images --example bench_pagesrc
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $(date -u '+%Y-%m-%d %H:%M UTC'), load $(cut -d' ' -f1-3 /proc/loadavg)"
target/release/examples/bench_pagesrc "$@"
