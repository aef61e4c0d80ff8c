#!/usr/bin/env bash
# A cold wake with and without the read-ahead of the process's own files
# (crates/images/src/workingset.rs), on any machine (no GPU).
#
#   sudo bench/cpu/file-pages.sh        REPS=3 FILE_MIB=1024 sudo bench/cpu/file-pages.sh
#
# A Python process maps a FILE_MIB file read-only and reads every 16th page
# of it in a shuffled order (as a process runs its libraries' code: here and
# there), then holds 256 MiB of memory. It is
# hibernated (--no-sync), the page cache is dropped, and it is woken lazily,
# told to read its file and its memory once more as soon as it runs. "ready"
# is the time from the start of the wake until it has. The default (no
# read-ahead) and GPUSNAP_FILE_PAGES=1 (read-ahead) alternate (ABBA). Needs root
# and CRIU >= 4 (scripts/install-criu.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=bench/cpu/lib.sh
. bench/cpu/lib.sh
record_self file-pages-cpu "$@"
if [[ -x /opt/gpusnap/criu/bin/criu ]]; then PATH=/opt/gpusnap/criu/bin:$PATH; fi

REPS=${REPS:-3}
FILE_MIB=${FILE_MIB:-1024}
bench_setup fpbench
head -c "$((FILE_MIB << 20))" /dev/urandom >"$work/lib.bin"

cat >"$work/hold.py" <<'PY'
import mmap, os, sys, time
work = sys.argv[1]
f = open(work + "/lib.bin", "rb")
lib = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
# Every 16th page, in a shuffled order: the way a process runs its
# libraries' code (here and there), not one sequential read.
import random
order = list(range(0, len(lib), 16 * 4096))
random.Random(7).shuffle(order)
def read_lib():
    return sum(lib[i] for i in order)
s = read_lib()
mem = bytearray(256 << 20)
for i in range(0, len(mem), 4096):
    mem[i] = 1
open(work + "/ready", "w").write("ready\n")
while True:
    if os.path.exists(work + "/go"):
        os.unlink(work + "/go")
        assert read_lib() == s and mem.count(1) == len(mem) // 4096
        with open(work + "/done.tmp", "w") as o:
            o.write(f"{time.time():.6f}\n")
        os.replace(work + "/done.tmp", work + "/done")
    time.sleep(0.01)
PY


one() {
    local way=$1 rep=$2 t0 t1 done_at
    rm -f "$work/ready" "$work/done" "$work/go"
    setsid python3 "$work/hold.py" "$work" </dev/null >/dev/null 2>&1 &
    holder=$!
    disown "$holder"
    while [ ! -s "$work/ready" ]; do sleep 0.1; done
    "$gs" --json hibernate "$holder" --image "b-$way-$rep" --no-sync >/dev/null
    gone "$holder"
    sync
    echo 3 >/proc/sys/vm/drop_caches
    touch "$work/go"
    t0=$(now)
    if [ "$way" = on ]; then
        GPUSNAP_FILE_PAGES=1 "$gs" --json wake "b-$way-$rep" --no-guard >"$work/wake.json"
    else
        "$gs" --json wake "b-$way-$rep" --no-guard >"$work/wake.json"
    fi
    t1=$(now)
    while [ ! -s "$work/done" ]; do sleep 0.005; done
    done_at=$(cat "$work/done")
    python3 - "$work/wake.json" "$way" "$(secs "$t0" "$t1")" "$(secs "$t0" "$done_at")" >>"$tsv" <<'PY'
import json, sys
v = json.load(open(sys.argv[1]))
print("\t".join([sys.argv[2], sys.argv[3], sys.argv[4], str(v.get("file_pages_bytes", 0))]))
PY
    end_holder
    "$gs" --json images rm "b-$way-$rep" >/dev/null
}

abba off on

python3 - "$tsv" "$FILE_MIB" "$REPS" <<'PY'
import statistics, sys
rows = [l.split("\t") for l in open(sys.argv[1]).read().splitlines()]
med = lambda way, i: statistics.median(float(r[i]) for r in rows if r[0] == way)
print(f"cold lazy wake of a process that maps a {sys.argv[2]} MiB file and reads every 16th page of it, shuffled, {sys.argv[3]} runs each way (ABBA), medians")
print()
print("| files read ahead | wake returned s | process read its file and memory s | bytes asked to be read ahead |")
print("|---|---|---|---|")
for way, name in (("off", "no (the default)"), ("on", "yes (GPUSNAP_FILE_PAGES=1)")):
    print(f"| {name} | {med(way, 1):.3f} | {med(way, 2):.3f} | {med(way, 3):.0f} |")
print()
print("runs (way, wake s, ready s):", "; ".join(f"{r[0]} {float(r[1]):.2f} {float(r[2]):.2f}" for r in rows))
PY
