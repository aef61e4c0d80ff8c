#!/usr/bin/env bash
# The chunk codecs on this machine (one core): for each kind of memory a
# wake fills (random, a model's bf16 weights, integers widened to int64, a
# repeated pattern, a heap), what `lz` (the default) and `zstd` (before)
# store, how fast they encode, and how fast a wake reads the chunks back
# checked (decode + blake3).
#
#   bench/cpu/codec.sh [MIB]    (default 256 MiB of each kind; REPS=3)
#
# SEQS=1 also prints, per kind, every chunk's lz frame (kept or not): its
# size, its decode + blake3 pace and its bytes per sequence (what
# LZ_BYTES_PER_SEQUENCE in crates/chunks/src/lib.rs is calibrated on).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=bench/cpu/lib.sh
. bench/cpu/lib.sh
record_self codec-cpu "$@"
cargo build --release -q -p gpusnap-chunks --example codecs
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $(date -u '+%Y-%m-%d %H:%M UTC'), load $(cut -d' ' -f1-3 /proc/loadavg)"
taskset -c 0 target/release/examples/codecs "$@"
