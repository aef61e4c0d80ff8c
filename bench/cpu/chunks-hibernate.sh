#!/usr/bin/env bash
# What storing the pages as chunks costs hibernate and wake, on any machine.
#
#   sudo bench/cpu/chunks-hibernate.sh            REPS=3 SIZE_GIB=4 BASE=/path/to/old/gpusnap sudo bench/cpu/chunks-hibernate.sh
#
# A Python process holding SIZE_GIB of incompressible memory (os.urandom: the
# worst case for the store, every chunk new, compressed in vain and written
# raw) is hibernated (default, durable mode) and woken (lazy), REPS times,
# by this tree's release gpusnap and, with BASE, by another gpusnap binary
# (one from before images were chunks). The page cache is dropped before
# each run. Prints a markdown table of medians: hibernate and wake seconds,
# and what the state directory holds after the hibernate. Needs root and
# CRIU >= 4 (scripts/install-criu.sh).
#
# FILL=pattern holds one 1 MiB block of random bytes repeated instead (the
# store's best case: a few distinct chunks, the hibernate's cost the CPU's
# chunking of every byte, as for the GPU runs' repeated pattern).
#
# VARIANTS="punch:GPUSNAP_FOLLOW_PUNCH=1 nofollow:GPUSNAP_FOLLOW=0" adds runs
# of this tree's binary with that environment (label:VAR=VALUE, space separated).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=bench/cpu/lib.sh
. bench/cpu/lib.sh
record_self chunks-hibernate "$@"
if [[ -x /opt/gpusnap/criu/bin/criu ]]; then PATH=/opt/gpusnap/criu/bin:$PATH; fi

REPS=${REPS:-3}
SIZE_GIB=${SIZE_GIB:-4}
BASE=${BASE:-}
VARIANTS=${VARIANTS:-}
FILL=${FILL:-random}
case $FILL in random | pattern) ;; *) echo "FILL must be random or pattern" >&2; exit 2 ;; esac
cargo build --release --quiet -p gpusnap
work=$(mktemp -d /var/tmp/gpusnap-cbench.XXXXXX)
trap 'pkill -9 -f "$work/hold.py" 2>/dev/null || true; rm -rf -- "$work"' EXIT
tsv=$work/runs.tsv
: >"$tsv"

cat >"$work/hold.py" <<'PY'
import os, sys, time
n = int(sys.argv[1]) << 30
buf = bytearray(n)
step = 64 << 20
block = (os.urandom(1 << 20) * 64) if sys.argv[3] == "pattern" else None
for i in range(0, n, step):
    buf[i:i + step] = block if block is not None else os.urandom(step)
open(sys.argv[2], "w").write("ready\n")
while True:
    time.sleep(0.5)
PY


one() {
    local way=$1 bin=$2 rep=$3 envs=${4:-} pid t0 t1 t2 state
    state=$work/state-$way-$rep
    rm -f "$work/ready"
    setsid python3 "$work/hold.py" "$SIZE_GIB" "$work/ready" "$FILL" </dev/null >/dev/null 2>&1 &
    pid=$!
    while [ ! -s "$work/ready" ]; do sleep 0.1; done
    sync
    echo 3 >/proc/sys/vm/drop_caches
    t0=$(now)
    env $envs GPUSNAP_STATE_DIR="$state" "$bin" --json hibernate "$pid" --image b >"$work/h.json"
    t1=$(now)
    gone "$pid"
    local bytes
    bytes=$(du -sb "$state" | cut -f1)
    sync
    echo 3 >/proc/sys/vm/drop_caches
    t2=$(now)
    GPUSNAP_STATE_DIR=$state "$bin" --json wake b --no-guard >/dev/null
    local t3
    t3=$(now)
    kill -9 "$pid" 2>/dev/null || true
    gone "$pid"
    local st
    st=$(python3 -c 'import json,sys; s=json.load(open(sys.argv[1])).get("stages",{}); print(s.get("dump",0), s.get("commit",0), s.get("follow_overlapped_bytes",0), s.get("follow_punched_bytes",0), sep="\t")' "$work/h.json")
    printf '%s\t%s\t%s\t%s\t%s\n' "$way" "$(secs "$t0" "$t1")" "$(secs "$t2" "$t3")" "$bytes" "$st" >>"$tsv"
    rm -rf -- "$state"
}

for rep in $(seq 1 "$REPS"); do
    one chunks "$PWD/target/release/gpusnap" "$rep"
    if [[ -n $BASE ]]; then one base "$BASE" "$rep"; fi
    for v in $VARIANTS; do one "${v%%:*}" "$PWD/target/release/gpusnap" "$rep" "${v#*:}"; done
done

echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $(date -u +%Y-%m-%d), SIZE_GIB=$SIZE_GIB REPS=$REPS FILL=$FILL"
python3 - "$tsv" <<'PY'
import statistics, sys
rows = [l.split("\t") for l in open(sys.argv[1]).read().splitlines()]
print("| gpusnap | hibernate s | dump s | commit s | chunked during the dump GB | punched GB | wake (lazy) s | state dir GB |")
print("|---|---|---|---|---|---|---|---|")
ways = list(dict.fromkeys(["base", "chunks"] + [x[0] for x in rows]))
for way in ways:
    r = [x for x in rows if x[0] == way]
    if not r:
        continue
    med = lambda i: statistics.median(float(x[i]) for x in r)
    print(f"| {way} | {med(1):.3f} | {med(4) / 1e3:.3f} | {med(5) / 1e3:.3f} | {med(6) / 1e9:.2f} | {med(7) / 1e9:.2f} "
          f"| {med(2):.3f} | {med(3) / 1e9:.2f} |")
print()
print("every run:", "; ".join(f"{x[0]} {x[1]} {x[2]}" for x in rows))
PY
