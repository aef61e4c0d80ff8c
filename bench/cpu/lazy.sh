#!/usr/bin/env bash
# Lazy against eager wake of a plain process, on any machine (no GPU).
#
#   sudo bench/cpu/lazy.sh     REPS=5 SIZE_GIB=4 COLD=1 sudo bench/cpu/lazy.sh
#
# A Python process holding SIZE_GIB of written memory is hibernated once per
# run (--no-sync), then woken with `gpusnap wake --eager` (CRIU restores every
# page before the process runs) or `gpusnap wake` (lazy: gpusnap's page
# server, crates/pages, fills the memory while the process runs). The process
# is told before the wake to read all its memory once as soon as it runs;
# "read all" is the time from the start of the wake until it has. "wake" is
# until `gpusnap wake` returned (lazy: once every page was in place). The
# image is in the page cache (warm) unless COLD=1 drops the caches before
# each wake. The two ways alternate (ABBA). Prints a markdown table of
# medians and every run, with the page server's report (faults, faults that
# waited for a fill in flight, its fill rate). GPUSNAP_PAGES_* settings in the
# environment (docs/reference/environment.md) apply to the lazy wakes. Needs root and
# CRIU >= 4 (scripts/install-criu.sh). FILL=random writes random bytes (raw,
# incompressible chunks) instead of one page repeated (the default, pattern:
# compressed chunks that recur). MAPS_MIB=2 holds the memory in separate
# private mappings of 2 MiB each (thousands of areas, as the driver's host
# buffers of a CUDA process are) instead of one.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=bench/cpu/lib.sh
. bench/cpu/lib.sh
record_self lazy-cpu "$@"
if [[ -x /opt/gpusnap/criu/bin/criu ]]; then PATH=/opt/gpusnap/criu/bin:$PATH; fi

REPS=${REPS:-5}
SIZE_GIB=${SIZE_GIB:-4}
COLD=${COLD:-0}
FILL=${FILL:-pattern}
MAPS_MIB=${MAPS_MIB:-0}
export FILL MAPS_MIB
case $FILL in pattern | random) ;; *) echo "FILL: pattern or random, not '$FILL'" >&2; exit 2 ;; esac
bench_setup lazybench

cat >"$work/hold.py" <<'PY'
import mmap, os, sys, time
n = int(sys.argv[1]) << 30
work = sys.argv[2]
per = int(os.environ.get("MAPS_MIB", "0")) << 20
if per:
    # Neighbouring mappings with different flags stay separate areas.
    bufs = []
    for k in range(0, n, per):
        m = mmap.mmap(-1, min(per, n - k), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.madvise(mmap.MADV_NOHUGEPAGE if len(bufs) % 2 else mmap.MADV_NORMAL)
        bufs.append(m)
else:
    bufs = [bytearray(n)]
page = bytes(range(256)) * 16
for buf in bufs:
    size = len(buf)
    if sys.argv[3] == "random":
        step = 64 << 20
        for i in range(0, size, step):
            buf[i:i + step] = os.urandom(min(step, size - i))
    else:
        for i in range(0, size, 4096):
            buf[i:i + 4096] = page
open(work + "/ready", "w").write("ready\n")
while True:
    if os.path.exists(work + "/go"):
        os.unlink(work + "/go")
        # Reads every byte once (a search for what is not there).
        assert all(buf.find(b"\xff\xfe" * 64) == -1 for buf in bufs)
        with open(work + "/done.tmp", "w") as f:
            f.write(f"{time.time():.6f}\n")
        os.replace(work + "/done.tmp", work + "/done")
    time.sleep(0.01)
PY


one() {
    local way=$1 rep=$2 t0 t1 done_at flag=()
    rm -f "$work/ready" "$work/done" "$work/go"
    setsid python3 "$work/hold.py" "$SIZE_GIB" "$work" "$FILL" </dev/null >/dev/null 2>&1 &
    holder=$!
    disown "$holder"
    while [ ! -s "$work/ready" ]; do sleep 0.1; done
    "$gs" --json hibernate "$holder" --image "b-$way-$rep" --no-sync >/dev/null
    gone "$holder"
    if [ "$COLD" = 1 ]; then
        sync
        echo 3 >/proc/sys/vm/drop_caches
    fi
    touch "$work/go"
    [ "$way" = eager ] && flag=(--eager)
    t0=$(now)
    "$gs" --json wake "b-$way-$rep" --no-guard ${flag[@]+"${flag[@]}"} >"$work/wake.json"
    t1=$(now)
    while [ ! -s "$work/done" ]; do sleep 0.005; done
    done_at=$(cat "$work/done")
    python3 - "$work/wake.json" "$way" "$(secs "$t0" "$t1")" "$(secs "$t0" "$done_at")" >>"$tsv" <<'PY'
import json, sys
v = json.load(open(sys.argv[1]))
s = v["stages"]
assert v["lazy"] == (sys.argv[2] == "lazy"), v
p = v.get("pages") or {}
print("\t".join([sys.argv[2], sys.argv[3], sys.argv[4], str(s["criu"] / 1e3), str(s["pages"] / 1e3), str(v["pages_bytes"]),
                 str(p.get("faults", 0)), str(p.get("faults_in_flight", 0)), str(p.get("fill_gbps", 0))]))
PY
    end_holder
    "$gs" --json images rm "b-$way-$rep" >/dev/null
}

abba eager lazy

python3 - "$tsv" "$SIZE_GIB" "$REPS" "$COLD" <<'PY'
import os, statistics, sys
rows = [l.split("\t") for l in open(sys.argv[1]).read().splitlines()]
size, reps, cold = sys.argv[2], sys.argv[3], sys.argv[4] == "1"
col = lambda way, i: [float(r[i]) for r in rows if r[0] == way]
med = lambda way, i: statistics.median(col(way, i))
maps = int(os.environ.get("MAPS_MIB", "0"))
print(f"plain process of {size} GiB ({os.environ.get('FILL', 'pattern')}{f', in mappings of {maps} MiB' if maps else ''}), {reps} runs each way (ABBA), medians; image {'cold (caches dropped)' if cold else 'in the page cache'}")
print()
print("| wake | wake returned s | process read all its memory s | criu s | pages s | faults | in flight | fill GB/s |")
print("|---|---|---|---|---|---|---|---|")
for way in ("eager", "lazy"):
    print(f"| {way} | {med(way, 1):.3f} | {med(way, 2):.3f} | {med(way, 3):.3f} | {med(way, 4):.3f} "
          f"| {med(way, 6):.0f} | {med(way, 7):.0f} | {med(way, 8):.2f} |")
e, l = med("eager", 2), med("lazy", 2)
print()
print(f"read all: lazy / eager = {l / e:.2f}")
print()
print("runs (way, wake s, read all s):", "; ".join(f"{r[0]} {float(r[1]):.2f} {float(r[2]):.2f}" for r in rows))
PY
