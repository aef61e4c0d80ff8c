#!/usr/bin/env bash
# CRIU's dump of a process's memory into a pages file on a tmpfs against
# into a FIFO that a reader drains 4 MiB at a time (as hibernate's receiver
# takes the pages as they come, chunking them, without CRIU writing them
# into a file first), on any machine (no GPU). CRIU alone, not gpusnap: is
# the FIFO faster for CRIU's single thread? (In the hibernate of large
# images CRIU writes 2.2-2.5 GB/s into a tmpfs file on the H200's host.)
#
#   sudo bench/cpu/dump-fifo.sh        REPS=3 SIZE_GIB=4 sudo bench/cpu/dump-fifo.sh
#
# A Python process holding SIZE_GIB of random bytes is dumped by `criu dump`
# into /dev/shm; its pages-1.img is a file, or a FIFO read by a Python
# reader into one reused buffer. The two alternate (ABBA). Needs root and
# CRIU >= 4 (scripts/install-criu.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=bench/cpu/lib.sh
. bench/cpu/lib.sh
record_self dump-fifo-cpu "$@"
if [[ -x /opt/gpusnap/criu/bin/criu ]]; then PATH=/opt/gpusnap/criu/bin:$PATH; fi

REPS=${REPS:-3}
SIZE_GIB=${SIZE_GIB:-4}
work=$(mktemp -d /var/tmp/gpusnap-fifobench.XXXXXX)
dir=/dev/shm/gpusnap-fifobench.$$
holder=
cleanup() {
    if [ -n "$holder" ]; then kill -9 "$holder" 2>/dev/null || true; fi
    rm -rf -- "$work" "$dir"
}
trap cleanup EXIT
tsv=$work/runs.tsv
: >"$tsv"

cat >"$work/hold.py" <<'PY'
import os, sys, time
b = bytearray(int(sys.argv[1]) << 30)
step = 64 << 20
for i in range(0, len(b), step):
    b[i:i + step] = os.urandom(min(step, len(b) - i))
open(sys.argv[2] + "/ready", "w").write("ready\n")
time.sleep(100000)
PY
cat >"$work/drain.py" <<'PY'
import sys
f = open(sys.argv[1], "rb", buffering=0)
buf = memoryview(bytearray(4 << 20))
n = 0
while True:
    k = f.readinto(buf)
    if not k:
        break
    n += k
open(sys.argv[2], "w").write(f"{n}\n")
PY

one() {
    local way=$1 t0 t1 reader='' bytes
    rm -rf "$dir" "$work/ready" "$work/count"
    mkdir -p "$dir"
    setsid python3 "$work/hold.py" "$SIZE_GIB" "$work" </dev/null >/dev/null 2>&1 &
    holder=$!
    disown "$holder"
    while [ ! -s "$work/ready" ]; do sleep 0.1; done
    if [ "$way" = fifo ]; then
        mkfifo "$dir/pages-1.img"
        python3 "$work/drain.py" "$dir/pages-1.img" "$work/count" &
        reader=$!
    fi
    t0=$EPOCHREALTIME
    criu dump -t "$holder" -D "$dir" --shell-job -o dump.log >/dev/null 2>&1
    t1=$EPOCHREALTIME
    if [ -n "$reader" ]; then wait "$reader"; bytes=$(cat "$work/count"); else bytes=$(stat -c %s "$dir/pages-1.img"); fi
    while [ -e "/proc/$holder" ]; do sleep 0.05; done
    holder=
    python3 -c "import sys; print(sys.argv[1], f'{float(sys.argv[3]) - float(sys.argv[2]):.3f}', sys.argv[4], sep='\t')" \
        "$way" "$t0" "$t1" "$bytes" >>"$tsv"
}

abba file fifo

python3 - "$tsv" "$SIZE_GIB" "$REPS" <<'PY'
import statistics, sys
rows = [l.split("\t") for l in open(sys.argv[1]).read().splitlines()]
print(f"criu dump of a process holding {sys.argv[2]} GiB of random bytes into /dev/shm, {sys.argv[3]} runs each way (ABBA), medians")
print()
print("| pages-1.img | criu dump s | GB | GB/s |")
print("|---|---|---|---|")
for way, name in (("file", "a file"), ("fifo", "a FIFO, drained by a reader")):
    s = statistics.median(float(r[1]) for r in rows if r[0] == way)
    b = statistics.median(int(r[2]) for r in rows if r[0] == way)
    print(f"| {name} | {s:.3f} | {b / 1e9:.2f} | {b / 1e9 / s:.2f} |")
print()
print("runs (way, s):", "; ".join(f"{r[0]} {float(r[1]):.2f}" for r in rows))
PY
