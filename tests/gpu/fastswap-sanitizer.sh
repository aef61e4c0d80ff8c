#!/usr/bin/env bash
# Fast swap under compute-sanitizer: a PyTorch and a CuPy program (the
# fast-swap benchmark's, SAN_GB each) run by `gpusnap run --light
# --fast-swap -- compute-sanitizer --tool TOOL python3 ...`, with the
# library's checksums on (GPUSNAP_FAST_SWAP_VERIFY=1). Two rounds of the
# library's own offload and restore, asked on its control socket (the
# memory leaves, is mapped again at the same addresses and copied back, the
# program's kernels run on it after), then two rounds of `gpusnap suspend`
# and `resume` (the driver's checkpoint of what is left: it refuses a
# process a sanitizer runs, and the suspend then brings the memory back at
# once, which is judged too); the program's own digest compared after each
# round, then asked to end: the sanitizer's ERROR SUMMARY and exit status
# (--error-exitcode 9) are what this judges. Prints a markdown table; logs go
# to $OUT (or /tmp).
#
#   tests/gpu/fastswap-sanitizer.sh [TOOL...]     (default: memcheck)
#
# Needs .dev/gpusnap and .dev/libgpusnap_preload.so (a release build) and
# compute-sanitizer (CUDA toolkit) on PATH or under /usr/local/cuda/bin.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
TOOLS=${*:-memcheck}
GB=${SAN_GB:-1}
OUT=${OUT:-/tmp/fastswap-san}
mkdir -p "$OUT"
G=$PWD/.dev/gpusnap
export GPUSNAP_PRELOAD=$PWD/.dev/libgpusnap_preload.so
export GPUSNAP_STATE_DIR=/tmp/fastswap-san-state
export GPUSNAP_FAST_SWAP_VERIFY=1
mkdir -p "$GPUSNAP_STATE_DIR"
W=/tmp/fastswap-san-work
rm -rf "$W"; mkdir -p "$W"
ROWS=$OUT/san-rows.md
: > "$ROWS"
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/san-log.txt" >&2; }
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -z "$SAN" ]; then
    log "compute-sanitizer: not found"
    echo "| all | - | compute-sanitizer not found | | | |"
    exit 0
fi
log "compute-sanitizer: $SAN ($("$SAN" --version 2>&1 | tail -1))"

# shellcheck source=tests/gpu/fastswap-lib.sh
. tests/gpu/fastswap-lib.sh

# ask PID offload|restore: the library's answer on its socket (its name,
# @gpusnap-swap-PID-RANDOM, read from the socket table), past the
# progress lines it sends while it works.
ask() {
    python3 - "$1" "$2" <<'PY'
import socket, sys
pid = sys.argv[1]
name = next(l.split()[-1] for l in open("/proc/%s/net/unix" % pid)
            if l.split()[-1].startswith("@gpusnap-swap-%s-" % pid))
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(300)
s.connect("\0" + name[1:])
s.sendall((sys.argv[2] + "\n").encode())
f = s.makefile()
line = f.readline()
while line.startswith("progress"):
    line = f.readline()
print(line.strip())
PY
}

# one TOOL NAME PROG
one() {
    local tool=$1 name=$2 prog=$3
    local st=$W/$tool-$name.status tag=$tool-$name
    log "$tag: $prog $GB GB under $tool"
    setsid "$G" run --light --fast-swap -- "$SAN" --tool "$tool" --error-exitcode 9 \
        --print-limit 50 python3 "$prog" "$GB" "$st" > "$OUT/$tag.out" 2> "$OUT/$tag.err" < /dev/null &
    local runner=$!
    if ! wait_file "$st" "${SAN_START_S:-240}"; then
        log "$tag: the program did not start"; tail -5 "$OUT/$tag.err" "$OUT/$tag.out" >&2
        echo "| $name | $tool | did not start | | | |" >> "$ROWS"
        timeout 60 "$G" stop "$runner" > /dev/null 2>&1
        return
    fi
    local pid d0 rounds=""
    read -r _ pid d0 < "$st"
    log "$tag: pid $pid, checksum $d0"
    local lib=""
    for round in 1 2; do
        local o r d1
        o=$(ask "$pid" offload); r=$(ask "$pid" restore)
        d1=$(digest "$st" 180)
        local same=no; [ "$d1" = "$d0" ] && same=yes
        log "$tag library round $round: offload: $o; restore: $r; data identical: $same"
        lib="$lib ${o%% *}/${r%% *}/$same"
    done
    for round in 1 2; do
        local s r d1
        GPUSNAP_LOG=info timeout 300 "$G" --json suspend "$pid" > "$OUT/$tag.suspend$round.json" 2> "$OUT/$tag.suspend$round.err"
        s=$?
        GPUSNAP_LOG=info timeout 300 "$G" --json resume "$pid" > "$OUT/$tag.resume$round.json" 2> "$OUT/$tag.resume$round.err"
        r=$?
        d1=$(digest "$st" 180)
        local same=no; [ "$d1" = "$d0" ] && same=yes
        log "$tag round $round: suspend rc $s ($(tail -c 300 "$OUT/$tag.suspend$round.err" | tr '\n' ' ')), resume rc $r, data identical: $same"
        rounds="$rounds $s/$r/$same"
    done
    "$G" history "$pid" > "$OUT/$tag.journal.txt" 2>&1 || true
    touch "$st.exit"
    local rc=timeout
    for _ in $(seq 240); do
        if ! kill -0 "$runner" 2>/dev/null; then
            wait "$runner"; rc=$?; break
        fi
        sleep 0.5
    done
    [ "$rc" = timeout ] && timeout 120 "$G" stop "$pid" > /dev/null 2>&1
    local summary
    summary=$(grep -ho "ERROR SUMMARY: [0-9]* error[s]*" "$OUT/$tag.out" "$OUT/$tag.err" | tail -1)
    log "$tag: exit $rc, ${summary:-no summary}"
    echo "| $name | $tool |$lib |$rounds | $rc | ${summary:-none} |" >> "$ROWS"
}

for tool in $TOOLS; do
    one "$tool" cupy tests/gpu/fastswap_cupy.py
    one "$tool" torch tests/gpu/fastswap_torch.py
done
echo "| program | tool | library rounds (offload/restore/data identical) | gpusnap rounds (suspend rc/resume rc/data identical) | exit | sanitizer |"
echo "|---|---|---|---|---|---|"
cat "$ROWS"
