#!/usr/bin/env bash
# Probe: where a woken JAX worker (tests/gpu/worker_jax.py,
# XLA_PYTHON_CLIENT_PREALLOCATE=false, 3 GiB random) faults. Saves its maps before
# each hibernate and prints the mapping that held each new segfault address;
# runs suspend + resume alone, a hibernate + wake --eager, and a hibernate + lazy
# wake with XLA preallocation on. Not a pass/fail check: its output is read.
# Run from the repository root on the GPU machine, as root, with .dev/gpusnap:
#   bash bench/gpu/jax-probe.sh > out.txt 2>&1
set -u
G=$PWD/.dev/gpusnap
mkdir -p /opt/gpusnap && [ -x /opt/gpusnap/criu/bin/criu ] || cp -a .dev/criu /opt/gpusnap/criu
export PATH=/opt/gpusnap/criu/bin:$PATH
D=/tmp/jd2; rm -rf $D; mkdir -p $D
S=$D/state
start() { # name [env...]
  local st=$D/$1.status; shift
  env "$@" python3 tests/gpu/worker_jax.py 3 $st --fill random >"$D/$(basename "$st" .status).wlog" 2>&1 &
  W=$!
  for _ in $(seq 120); do [ -s "$st" ] && break; sleep 0.5; done
  echo "start: $(cat $st)"
}
segv_maps() { # maps-file: the mapping that held each new segfault address
  dmesg 2>/dev/null | grep segfault | tail -n 2 | while read -r l; do
    a=$(echo "$l" | sed -n 's/.*segfault at \([0-9a-f]*\).*/\1/p')
    echo "$l" | cut -c1-160
    [ -n "$a" ] && python3 - "$1" "$a" <<'PY'
import sys
a = int(sys.argv[2], 16)
for line in open(sys.argv[1]):
    lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
    if lo - (1 << 21) <= a < hi + (1 << 21):
        print("   near/in:", line.rstrip(), "<- HERE" if lo <= a < hi else "")
PY
  done
}
echo "===== a: suspend + resume (no CRIU)"
start a
$G --state-dir $S --json suspend $W >$D/o 2>&1; echo "suspend rc=$?"
$G --state-dir $S --json resume $W --wait 30 >$D/o 2>&1; echo "resume rc=$? $(tail -c 300 $D/o)"
sleep 3; echo "after: $(cat $D/a.status) (alive: $(ps -o stat= -p $W))"
$G --state-dir $S stop $W >/dev/null 2>&1; echo "stop rc=$?"; wait $W 2>/dev/null
for mode in eager prealloc; do
  echo "===== $mode"
  if [ $mode = prealloc ]; then start $mode XLA_PYTHON_CLIENT_PREALLOCATE=true XLA_PYTHON_CLIENT_MEM_FRACTION=.06; else start $mode; fi
  cp /proc/$W/maps $D/$mode.maps
  grep -c . $D/$mode.maps; grep -v " 00:00 0 " $D/$mode.maps | grep -v "\.so\|python\|/usr/" | cut -c1-150 | head -20
  $G --state-dir $S --json hibernate $W --image j-$mode >$D/h.out 2>$D/h.err; echo "hibernate rc=$?"
  wait $W 2>/dev/null
  wa=(); [ $mode = eager ] && wa=(--eager)
  $G --state-dir $S --json wake j-$mode --wait 30 --no-guard "${wa[@]}" >$D/w.out 2>$D/w.err; echo "wake ${wa[*]} rc=$?"
  head -c 300 $D/w.out; echo
  sleep 4
  echo "status after: $(cat $D/$mode.status); alive: $(ps -o stat= -p $W)"
  segv_maps $D/$mode.maps
  $G --state-dir $S stop $W >/dev/null 2>&1; echo "stop rc=$?"
  sleep 1
done
