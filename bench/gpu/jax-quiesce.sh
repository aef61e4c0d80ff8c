#!/usr/bin/env bash
# A JAX program (XLA's allocator, no preallocation) that reads a result back
# between checks, suspended and resumed N times under `gpusnap run --light
# --fast-swap`: the library quiesces it (no thread inside the driver) before
# the driver's lock. Counts suspends that worked, refused ones (exit codes),
# crashes (the program gone), and checks its data at the end. Prints a
# markdown table.
#
#   bench/gpu/jax-quiesce.sh [N] [GB]        (N default 50, GB default 4)
#
# Needs .dev/gpusnap and .dev/libgpusnap_preload.so (a release build).
set -uo pipefail
N=${1:-50}
GB=${2:-4}
cd "$(dirname "$0")/../.." || exit 1
G=$PWD/.dev/gpusnap
export GPUSNAP_PRELOAD=$PWD/.dev/libgpusnap_preload.so
export GPUSNAP_STATE_DIR=/tmp/jaxq-state
W=/tmp/jaxq; rm -rf "$W" "$GPUSNAP_STATE_DIR"; mkdir -p "$W" "$GPUSNAP_STATE_DIR"
# shellcheck source=tests/gpu/fastswap-lib.sh
. tests/gpu/fastswap-lib.sh
st=$W/jax.status
setsid "$G" run --light --fast-swap -- python3 tests/gpu/fastswap_jax.py "$GB" "$st" >"$W/out" 2>"$W/err" </dev/null &
if ! wait_file "$st" 300; then
    echo "the JAX program did not start"; tail -5 "$W/err"; exit 1
fi
read -r _ pid d0 <"$st"
ok=0 refused=0 crashed=0 codes=""
t0=$(date +%s.%N)
for i in $(seq "$N"); do
    timeout 120 "$G" --json suspend "$pid" >"$W/s.json" 2>"$W/s.err"; rc=$?
    if [ $rc -ne 0 ]; then refused=$((refused + 1)); codes="$codes s$i:$rc"; fi
    timeout 120 "$G" --json resume "$pid" --wait 30 >"$W/r.json" 2>"$W/r.err"; rr=$?
    [ $rr -ne 0 ] && codes="$codes r$i:$rr"
    if ! kill -0 "$pid" 2>/dev/null; then crashed=$((crashed + 1)); echo "round $i: the program is gone"; tail -3 "$W/err"; break; fi
    [ $rc -eq 0 ] && [ $rr -eq 0 ] && ok=$((ok + 1))
    sleep 0.2
done
t1=$(date +%s.%N)
d1=$(digest "$st")
same=no; [ "$d1" = "$d0" ] && same=yes
dmesg 2>/dev/null | grep -c "python3.*segfault" >"$W/segv" || true
echo "| rounds | suspend+resume ok | refused (exit codes) | crashed | data identical | seconds |"
echo "|---|---|---|---|---|---|"
printf '| %s | %s | %s%s | %s | %s | %.1f |\n' "$N" "$ok" "$refused" "${codes:+ ($codes)}" "$crashed" "$same" "$(python3 -c "print($t1 - $t0)")"
"$G" --json ps 2>/dev/null | head -c 2000; echo
grep -h "inside\|quiesc" "$W"/s.err 2>/dev/null | tail -3
if kill -0 "$pid" 2>/dev/null; then timeout 120 "$G" stop "$pid" >/dev/null 2>&1; fi
