#!/usr/bin/env bash
# hibernate and wake of a plain process against bare CRIU, on any machine.
#
#   sudo bench/cpu/hibernate.sh        REPS=3 SIZE_GIB=4 sudo bench/cpu/hibernate.sh
#
# A Python process holding SIZE_GIB of written memory (no GPU: this prices
# what gpusnap adds around CRIU: its checks, the checksums, the manifest,
# and, in the default durable mode, waiting until the image is on disk).
# bare = `criu dump --leave-stopped` + kill (hibernate), `criu restore -d`
# (wake), with gpusnap's flags; gpusnap = `gpusnap --json hibernate` in its
# default (durable) mode and with --no-sync, and `gpusnap --json wake`.
# Each way REPS times, the order rotating. Prints a markdown table of
# medians. Needs root and CRIU >= 4 (scripts/install-criu.sh). The GPU
# version is bench/gpu/hibernate.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=bench/cpu/lib.sh
. bench/cpu/lib.sh
record_self hibernate-cpu "$@"
if [[ -x /opt/gpusnap/criu/bin/criu ]]; then PATH=/opt/gpusnap/criu/bin:$PATH; fi

REPS=${REPS:-3}
SIZE_GIB=${SIZE_GIB:-4}
cargo build --release --quiet -p gpusnap
gs=$PWD/target/release/gpusnap
work=$(mktemp -d /var/tmp/gpusnap-hbench.XXXXXX)
export GPUSNAP_STATE_DIR=$work/state
trap 'pkill -9 -f "$work/hold.py" 2>/dev/null || true; rm -rf -- "$work"' EXIT
tsv=$work/runs.tsv
: >"$tsv"

cat >"$work/hold.py" <<'PY'
import os, sys, time
n = int(sys.argv[1]) << 30
buf = bytearray(n)
page = bytes(range(256)) * 16
for i in range(0, n, 4096):
    buf[i:i + 4096] = page
open(sys.argv[2], "w").write("ready\n")
while True:
    time.sleep(0.5)
PY


# start: a new holder; prints its pid once its memory is written.
start() {
    rm -f "$work/ready"
    setsid python3 "$work/hold.py" "$SIZE_GIB" "$work/ready" </dev/null >/dev/null 2>&1 &
    local pid=$!
    while [ ! -s "$work/ready" ]; do sleep 0.1; done
    echo "$pid"
}
flags=(--shell-job --file-locks --ext-unix-sk --tcp-established)

one() {
    local way=$1 rep=$2 pid t0 t1 img
    pid=$(start)
    # Every run starts from a clean page cache: no write-back of an earlier
    # image competes with this one.
    sync
    echo 3 >/proc/sys/vm/drop_caches
    img=$work/img-$way-$rep
    t0=$(now)
    case $way in
    bare)
        mkdir -p "$img"
        criu dump -t "$pid" -D "$img" "${flags[@]}" --leave-stopped -o dump.log
        kill -9 "$pid"
        ;;
    durable) "$gs" --json hibernate "$pid" --image "$way-$rep" >/dev/null ;;
    nosync) "$gs" --json hibernate "$pid" --image "$way-$rep" --no-sync >/dev/null ;;
    esac
    t1=$(now)
    printf '%s\thibernate\t%s\n' "$way" "$(secs "$t0" "$t1")" >>"$tsv"
    gone "$pid"
    sync
    echo 3 >/proc/sys/vm/drop_caches
    t0=$(now)
    case $way in
    bare) criu restore -D "$img" "${flags[@]}" -d -o restore.log ;;
    *) "$gs" --json wake "$way-$rep" --no-guard >/dev/null ;;
    esac
    t1=$(now)
    printf '%s\twake\t%s\n' "$way" "$(secs "$t0" "$t1")" >>"$tsv"
    kill -9 "$pid"
    gone "$pid"
    [ "$way" = bare ] && du -sb "$img" | cut -f1 >"$work/size-bare" || true
    [ "$way" = durable ] && du -sb "$GPUSNAP_STATE_DIR/images/$way-$rep" | cut -f1 >"$work/size-gpusnap" || true
    rm -rf "$img" "$GPUSNAP_STATE_DIR/images/$way-$rep"
}

for rep in $(seq 1 "$REPS"); do
    case $((rep % 3)) in
    1) order="bare durable nosync" ;;
    2) order="durable nosync bare" ;;
    0) order="nosync bare durable" ;;
    esac
    for way in $order; do one "$way" "$rep"; done
done

python3 - "$tsv" "$SIZE_GIB" "$REPS" "$(cat "$work/size-bare")" "$(cat "$work/size-gpusnap")" <<'PY'
import statistics, sys
rows = [l.split("\t") for l in open(sys.argv[1]).read().splitlines()]
size, reps, sb, sg = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
med = lambda way, op: statistics.median(float(r[2]) for r in rows if r[0] == way and r[1] == op)
print(f"plain process of {size} GiB, {reps} runs each way (order rotating), medians; image {sg / 1e9:.2f} GB (bare CRIU {sb / 1e9:.2f} GB)")
print()
print("| op | bare CRIU s | gpusnap (durable) s | ratio | gpusnap --no-sync s | ratio |")
print("|---|---|---|---|---|---|")
for op in ("hibernate", "wake"):
    b, d, n = med("bare", op), med("durable", op), med("nosync", op)
    print(f"| {op} | {b:.3f} | {d:.3f} | {d / b:.3f} | {n:.3f} | {n / b:.3f} |")
PY
