#!/usr/bin/env bash
# The check of a map file on this machine: blake3 of every 1 MiB block of a
# file in the page cache, on THREADS threads through a mapping of it, as a
# wake checks its map file (crates/images/examples/bench_mapcheck.rs); the
# mincore, the hash and the unmap timed apart.
#
#   bench/cpu/mapcheck.sh [GIB [THREADS]]    (a file of GIB GiB under $TMPDIR)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=bench/cpu/lib.sh
. bench/cpu/lib.sh
record_self mapcheck-cpu "$@"
cargo build --release -q -p gpusnap-images --example bench_mapcheck
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $(date -u '+%Y-%m-%d %H:%M UTC'), load $(cut -d' ' -f1-3 /proc/loadavg)"
target/release/examples/bench_mapcheck "$@"
