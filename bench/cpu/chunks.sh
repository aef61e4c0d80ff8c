#!/usr/bin/env bash
# CPU cost of the chunk store on this machine (one core): the page-end cuts
# (and FastCDC, for comparison),
# blake3, zstd levels, and the dedup of two images sharing SHARED_MIB
# (default 1024) at different offsets, content-defined against fixed chunks.
# Extra arguments: real image files (CRIU pages-*.img) to measure zstd on.
#
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=bench/cpu/lib.sh
. bench/cpu/lib.sh
record_self chunks-cpu "$@"
shared=${SHARED_MIB:-1024}
cargo build --release -q -p gpusnap-chunks --example bench
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $(date -u +%Y-%m-%d)"
taskset -c 0 target/release/examples/bench "$shared" "$@"
