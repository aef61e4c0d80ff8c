#!/usr/bin/env bash
# What a gpusnap command pays before its own work (bench/results/104,
# "What the wake waits for outside total_ms"): the driver's and NVML's start-up, measured bare
# (python ctypes, a fresh process each time, as each gpusnap is one), alone
# and side by side on two threads (as gpusnap now loads them), then the wall
# time of a few cheap gpusnap commands. 3 samples each; < 20 s.
#
# Run from the repository root:  OUT=DIR bench/gpu/init-timing.sh
# (or as the `timing` stage of tests/gpu/device.sh).
# Environment: GPUSNAP (default ./target/release/gpusnap), OUT (default a new
# temp directory), REPS (default 3).
# Files in $OUT: init-timing.md (the tables), init-timing.json (every sample).
# Rows:
#   bare cuInit / nvmlInit: dlopen, cuDriverGetVersion, cuInit(0) in ms;
#       dlopen, nvmlInit_v2, nvmlDeviceGetCount_v2 in ms;
#   both on two threads: the wall of the two start-ups together (what
#       gpusnap's load costs when it waits for cuInit: max, not sum);
#   gpusnap ps / doctor --json / state <a plain pid> (exit 2: no CUDA
#       context; its driver call waits for cuInit): wall ms of the command;
#   wake (plain tree): wall ms of `gpusnap --json wake` of a one-process
#       image, its total_ms, and the difference (process start, load, exit;
#       only where CRIU is on PATH).
# Exit 0 when every sample ran; 1 otherwise (the tables say which failed).

set -u
export LC_ALL=C TZ=UTC PYTHONUNBUFFERED=1
T0=$SECONDS
GPUSNAP=${GPUSNAP:-./target/release/gpusnap}
case $GPUSNAP in /*) ;; */*) GPUSNAP=$PWD/$GPUSNAP ;; *) GPUSNAP=$(command -v "$GPUSNAP" || echo "$PWD/$GPUSNAP") ;; esac
if [ -z "${OUT:-}" ]; then OUT=$(mktemp -d /tmp/gpusnap-timing.XXXXXX); fi
mkdir -p "$OUT"
REPS=${REPS:-3}
WORK=$(mktemp -d /tmp/gpusnap-timing.XXXXXX)
export GPUSNAP_STATE_DIR=$WORK/state
SAMPLES=$WORK/samples.jsonl
: >"$SAMPLES"
RC=0
KIDS=()
# shellcheck disable=SC2329 # run by the EXIT trap
cleanup() {
    local p
    for p in "${KIDS[@]}"; do kill -9 "$p" 2>/dev/null; done
    rm -rf "$WORK"
}
trap cleanup EXIT

# One fresh python per sample: bare start-up costs, "cuda", "nvml" or "both".
probe() {
    timeout 60 python3 - "$1" <<'PY'
import ctypes, json, sys, threading, time

def ms(t):
    return round((time.perf_counter() - t) * 1e3, 2)

def cuda(out):
    t = time.perf_counter()
    lib = ctypes.CDLL("libcuda.so.1")
    out["cu_dlopen_ms"] = ms(t)
    t = time.perf_counter()
    v = ctypes.c_int(0)
    lib.cuDriverGetVersion(ctypes.byref(v))
    out["cu_version_ms"], out["driver_api"] = ms(t), v.value
    t = time.perf_counter()
    out["cuinit_rc"] = lib.cuInit(0)
    out["cuinit_ms"] = ms(t)

def nvml(out):
    t = time.perf_counter()
    lib = ctypes.CDLL("libnvidia-ml.so.1")
    out["nvml_dlopen_ms"] = ms(t)
    t = time.perf_counter()
    out["nvmlinit_rc"] = lib.nvmlInit_v2()
    out["nvmlinit_ms"] = ms(t)
    t = time.perf_counter()
    n = ctypes.c_uint(0)
    lib.nvmlDeviceGetCount_v2(ctypes.byref(n))
    out["nvml_count_ms"], out["gpus"] = ms(t), n.value
    lib.nvmlShutdown()

mode, out = sys.argv[1], {"kind": "bare", "mode": sys.argv[1]}
t = time.perf_counter()
try:
    if mode == "cuda":
        cuda(out)
    elif mode == "nvml":
        nvml(out)
    else:
        # ctypes releases the GIL during a foreign call: the two start-ups
        # overlap as they do on gpusnap's two threads.
        th = threading.Thread(target=cuda, args=(out,))
        th.start()
        nvml(out)
        th.join()
    out["wall_ms"] = ms(t)
except OSError as e:
    out["error"] = str(e)
print(json.dumps(out))
PY
}

# wall ms of one gpusnap command; appends a sample.
timed() {
    local label=$1 t0 t1 rc
    shift
    t0=$(date +%s%N)
    timeout 60 "$GPUSNAP" "$@" >"$WORK/cmd.out" 2>"$WORK/cmd.err"
    rc=$?
    t1=$(date +%s%N)
    printf '{"kind": "cmd", "cmd": "%s", "rc": %d, "wall_ms": %s}\n' "$label" "$rc" \
        "$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", (b - a) / 1e6 }')" >>"$SAMPLES"
    return "$rc"
}

for _ in $(seq "$REPS"); do
    for m in cuda nvml both; do
        if ! probe "$m" >>"$SAMPLES"; then RC=1; fi
    done
done
sleep 300 &
PLAIN=$!
disown
KIDS+=("$PLAIN")
for _ in $(seq "$REPS"); do
    timed "ps" ps || RC=1
    timed "doctor --json" --json doctor || true # exit 1 on any error finding; the wall is what counts
    timed "state <plain pid>" state "$PLAIN"
    [ $? = 2 ] || RC=1
done

# A plain one-process image, woken REPS times (CRIU needed).
WAKES=0
if command -v criu >/dev/null 2>&1 && [ $((SECONDS - T0)) -lt 10 ]; then
    for i in $(seq "$REPS"); do
        pid=$(python3 -c 'import subprocess; print(subprocess.Popen(["sleep", "300"], start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)')
        KIDS+=("$pid")
        if ! timeout 30 "$GPUSNAP" --json hibernate "$pid" --image "t$i" >"$WORK/h.out" 2>"$WORK/h.err"; then
            echo "hibernate failed: $(tail -n 2 "$WORK/h.err")" >&2
            RC=1
            continue
        fi
        t0=$(date +%s%N)
        timeout 30 "$GPUSNAP" --json wake "t$i" >"$WORK/w.out" 2>"$WORK/w.err"
        rc=$?
        t1=$(date +%s%N)
        total=$(python3 -c 'import json, sys; print(json.loads(open(sys.argv[1]).read().splitlines()[-1])["total_ms"])' "$WORK/w.out" 2>/dev/null || echo null)
        printf '{"kind": "wake", "rc": %d, "wall_ms": %s, "total_ms": %s}\n' "$rc" \
            "$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", (b - a) / 1e6 }')" "$total" >>"$SAMPLES"
        [ "$rc" = 0 ] || { echo "wake failed: $(tail -n 2 "$WORK/w.err")" >&2; RC=1; }
        kill -9 "$pid" 2>/dev/null
        "$GPUSNAP" images rm "t$i" >/dev/null 2>&1
        WAKES=$((WAKES + 1))
    done
fi

PERSIST=$(timeout 10 nvidia-smi --query-gpu=persistence_mode --format=csv,noheader 2>/dev/null | tr '\n' ' ')
python3 - "$SAMPLES" "$OUT" "$PERSIST" "$($GPUSNAP --version 2>&1 | head -n 1)" <<'PY' || RC=1
import json, sys, statistics as st, time, socket
samples_path, out, persist, version = sys.argv[1:5]
S = [json.loads(l) for l in open(samples_path) if l.strip()]
def fmt(xs):
    xs = [x for x in xs if isinstance(x, (int, float))]
    if not xs:
        return "-"
    return f"{st.median(xs):.1f} ({' / '.join(f'{x:.1f}' for x in xs)})"
L = [f"# init timing ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {socket.gethostname()})", "",
     f"- gpusnap: {version}; persistence mode: {persist.strip() or '?'}",
     "- median (samples), ms; each bare sample is a fresh python process", "",
     "| what | ms |", "|---|---|"]
bare = lambda m: [s for s in S if s["kind"] == "bare" and s["mode"] == m]
c, n, b = bare("cuda"), bare("nvml"), bare("both")
L.append(f"| dlopen libcuda.so.1 | {fmt([s.get('cu_dlopen_ms') for s in c])} |")
L.append(f"| cuDriverGetVersion | {fmt([s.get('cu_version_ms') for s in c])} |")
L.append(f"| cuInit(0) (rc {sorted({s.get('cuinit_rc') for s in c}, key=str)}) | {fmt([s.get('cuinit_ms') for s in c])} |")
L.append(f"| dlopen libnvidia-ml.so.1 | {fmt([s.get('nvml_dlopen_ms') for s in n])} |")
L.append(f"| nvmlInit_v2 (rc {sorted({s.get('nvmlinit_rc') for s in n}, key=str)}) | {fmt([s.get('nvmlinit_ms') for s in n])} |")
L.append(f"| nvmlDeviceGetCount_v2 | {fmt([s.get('nvml_count_ms') for s in n])} |")
L.append(f"| cuda alone, whole | {fmt([s.get('wall_ms') for s in c])} |")
L.append(f"| nvml alone, whole | {fmt([s.get('wall_ms') for s in n])} |")
L.append(f"| both on two threads, whole | {fmt([s.get('wall_ms') for s in b])} |")
L.append(f"| cuInit / nvmlInit when side by side | {fmt([s.get('cuinit_ms') for s in b])} / {fmt([s.get('nvmlinit_ms') for s in b])} |")
for cmd in dict.fromkeys(s["cmd"] for s in S if s["kind"] == "cmd"):
    xs = [s for s in S if s["kind"] == "cmd" and s["cmd"] == cmd]
    L.append(f"| gpusnap {cmd} (exit {sorted({s['rc'] for s in xs})}) | {fmt([s['wall_ms'] for s in xs])} |")
w = [s for s in S if s["kind"] == "wake"]
if w:
    L.append(f"| gpusnap wake, plain tree: wall (exit {sorted({s['rc'] for s in w})}) | {fmt([s['wall_ms'] for s in w])} |")
    L.append(f"| ... its total_ms | {fmt([s['total_ms'] for s in w])} |")
    L.append(f"| ... outside total_ms | {fmt([s['wall_ms'] - s['total_ms'] for s in w if isinstance(s['total_ms'], (int, float))])} |")
else:
    L.append("| gpusnap wake, plain tree | not run (no criu on PATH, or no time) |")
errs = [s["error"] for s in S if "error" in s]
if errs:
    L += ["", "errors: " + "; ".join(sorted(set(errs)))]
text = "\n".join(L) + "\n"
open(f"{out}/init-timing.md", "w").write(text)
json.dump(S, open(f"{out}/init-timing.json", "w"), indent=1)
print(text)
PY
echo "init-timing: $((SECONDS - T0)) s, exit $RC; files in $OUT" >&2
exit "$RC"
