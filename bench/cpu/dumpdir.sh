#!/usr/bin/env bash
# hibernate with CRIU's images on the disk vs on a tmpfs (crates/hibernate/src/dumpdir.rs),
# on any machine (no GPU).
#
#   sudo bench/cpu/dumpdir.sh        REPS=3 SIZE_GIB=4 sudo bench/cpu/dumpdir.sh
#
# A Python process holding SIZE_GIB of random bytes (incompressible, no
# dedup: every byte reaches the disk as a chunk) is hibernated (durable)
# with GPUSNAP_DUMP_TMPFS=0 (disk) and =1 (tmpfs), REPS times each, the
# order alternating, from a clean page cache. Prints a markdown table of
# medians: hibernate s, gpusnap's stages, and the bytes written to the
# state directory's block device meanwhile (/sys/block/DEV/stat; other
# writers on the machine count too). Needs root and CRIU >= 4.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=bench/cpu/lib.sh
. bench/cpu/lib.sh
record_self dumpdir-cpu "$@"
if [[ -x /opt/gpusnap/criu/bin/criu ]]; then PATH=/opt/gpusnap/criu/bin:$PATH; fi

REPS=${REPS:-3}
SIZE_GIB=${SIZE_GIB:-4}
if [[ -z ${GS:-} ]]; then
    cargo build --release --quiet -p gpusnap
    GS=$PWD/target/release/gpusnap
fi
work=$(mktemp -d /var/tmp/gpusnap-dbench.XXXXXX)
export GPUSNAP_STATE_DIR=$work/state
trap 'pkill -9 -f "$work/hold.py" 2>/dev/null || true; rm -rf -- "$work"' EXIT
tsv=$work/runs.tsv
: >"$tsv"
# The block device under the state directory (a partition's parent disk).
dev=$(basename "$(df --output=source "$work" | tail -1)")
while [[ ! -e /sys/block/$dev/stat && -n $dev ]]; do dev=${dev%?}; done
written() { echo $(($(awk '{print $7}' "/sys/block/$dev/stat") * 512)); }

cat >"$work/hold.py" <<'PY'
import os, sys, time
buf = bytearray(os.urandom(int(sys.argv[1]) << 30))
open(sys.argv[2], "w").write("ready\n")
while True:
    time.sleep(0.5)
PY

one() {
    local way=$1 rep=$2 pid w0 w1 flag
    rm -f "$work/ready"
    setsid python3 "$work/hold.py" "$SIZE_GIB" "$work/ready" </dev/null >/dev/null 2>&1 &
    pid=$!
    while [ ! -s "$work/ready" ]; do sleep 0.1; done
    sync
    echo 3 >/proc/sys/vm/drop_caches
    [ "$way" = tmpfs ] && flag=1 || flag=0
    w0=$(written)
    GPUSNAP_DUMP_TMPFS=$flag "$GS" --json hibernate "$pid" --image "$way-$rep" >"$work/out.json"
    sync
    w1=$(written)
    python3 - "$work/out.json" "$way" "$((w1 - w0))" >>"$tsv" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); s = d["stages"]
print("\t".join(map(str, [sys.argv[2], d["total_ms"] / 1e3, s["dump"] / 1e3, s["commit"] / 1e3,
                          int(sys.argv[3]), s["follow_punched_bytes"], s["dump_dir"]])))
PY
    while [ -e "/proc/$pid" ]; do sleep 0.05; done
    rm -rf "$GPUSNAP_STATE_DIR/images/$way-$rep"
    "$GS" images gc >/dev/null 2>&1 || true
}

abba disk tmpfs

python3 - "$tsv" "$SIZE_GIB" "$REPS" "$dev" <<'PY'
import statistics, sys
rows = [l.split("\t") for l in open(sys.argv[1]).read().splitlines()]
print(f"random memory of {sys.argv[2]} GiB, hibernate (durable), {sys.argv[3]} runs each way, medians; writes to /dev/{sys.argv[4]}")
print()
print("| CRIU writes to | dump_dir | hibernate s | dump s | commit s | GB written to disk | GB punched |")
print("|---|---|---|---|---|---|---|")
for way in ("disk", "tmpfs"):
    r = [x for x in rows if x[0] == way]
    m = lambda i: statistics.median(float(x[i]) for x in r)
    print(f"| {way} | {r[0][6]} | {m(1):.2f} | {m(2):.2f} | {m(3):.2f} | {m(4) / 1e9:.2f} | {m(5) / 1e9:.2f} |")
PY
