#!/usr/bin/env bash
# The node agent on a GPU: two model servers that do not fit one
# GPU together, behind `gpusnap agent`, asked in turn; the swap against a
# cold start that loads its weights from disk, as real servers do.
#
# Run from the repository root, as root:
#   OUT=/some/dir bench/gpu/agent.sh
# (w) weights: model_server.py --save-weights writes each model's seeded
#     random weights as safetensors shards, one directory per model
#     (untimed; reused when already there).
# (a) cold starts of m1 (from spawning the server to the first byte of the
#     answer to its first request, what a user waits for): weights read from
#     disk with the page cache warm, then after `echo 3 > drop_caches` (a
#     fresh node scaling from zero), then (last, if the budget allows) with
#     random weights initialised on the GPU (the number of earlier runs,
#     labelled as such). A cold-start server was never restored: it is ended
#     with SIGTERM (the safety rule is about restored processes).
# (b) the agent with services m1 and m2 (each declares gpu_memory, so the
#     second start evicts the first), `thp = false`; alternating requests:
#     every answer must be the process's own reference, and each one swaps
#     the servers (suspend the other, resume this one). Then the agent is
#     restarted (SIGTERM; it adopts both services as they are) with
#     `thp = true`, and the same swaps again.
# (c) the table: ttfb to the running model; ttfb of a swap (thp off, on);
#     suspend(other) and resume(this) from the agent's metrics; swap -
#     (suspend + resume); the cold starts; each target met or not met; the
#     agent's trace of the swaps (gpusnap_agent_swap_phase_seconds): where
#     the time goes, phase by phase (c6), what the agent itself adds (c7),
#     the first answer after a resume against a running one's (c8), and
#     what each swap had to do (c9).
#     Mode hooks (AGENT_MODES): the services have the hooks of a cooperating
#     server (before_suspend = POST /sleep: model_server.py frees its KV
#     cache; after_resume = POST /wake_up: it allocates it again), thp =
#     true: a swap moves the weights only. Rows c2-c9.hooks, with c3/c4
#     counting hook_suspend + suspend + resume + hook_resume, and c5.hooks
#     against the cold starts (target: <= 0.5x).
#     Mode fast (AGENT_MODES, first if given): the servers run under fast
#     swap (the agent's default) with their pinned copies kept (`keep_pinned
#     = true`), thp = true, no hooks: their library moves the device
#     memory at the link's speed. Rows c2-c9.fast, c5.fast against the cold
#     starts (target: <= 0.5x). Without it the services say `fast_swap =
#     false` (the driver path).
# (d) the proxy's cost: p50 of /health to the running service through the
#     agent against straight to the server (target: <= 1 ms added).
# Environment:
#   GPUSNAP            the binary (default ./target/release/gpusnap; its
#                      libgpusnap_preload.so must lie next to it)
#   OUT                results directory (default: a new /tmp/gpusnap-out.* dir)
#   AGENT_WEIGHTS_GB   weights per server (16) and AGENT_KV_GB its KV cache
#                      (59): 75 GB each, two do not fit one H200 (143 GB).
#                      A swap holds both in host RAM for a moment: with less
#                      than 2 x size + 24 GB available the KV cache shrinks,
#                      and a filler (filler.py) keeps room for one server only
#   AGENT_WEIGHTS_DIR  where the weights go (default $WORK/weights, removed
#                      at the end unless AGENT_KEEP_WEIGHTS=1); 2 x weights of disk
#   AGENT_BACKEND      auto (transformers if importable, else plain PyTorch),
#                      transformers or torch
#   AGENT_MODES        the swap modes, in order (default "off on hooks"): off
#                      (thp = false), on (thp = true), hooks (thp = true and
#                      the sleep/wake_up hooks); the agent is restarted between
#                      modes and adopts both services. AGENT_MODES=hooks (the
#                      quick run, ~5 min): weights, the two cold starts, the
#                      hooks swaps and the proxy only (no random-init cold start)
#   AGENT_SWAPS        alternating requests per mode (2); AGENT_TOKENS new
#                      tokens per answer (16); PROXY_N requests for (d) (200)
#   AGENT_BENCH_BUDGET_S  soft budget (420 s); a watchdog ends the run 60 s after
#   AGENT_SERVER=fake  a dry run without a GPU: fake-workload --http against
#                      the fake driver (FAKE_WORKLOAD, the fakes on
#                      LD_LIBRARY_PATH, GPUSNAP_FAKE_DIR; see docs/design/fakes.md);
#                      its "weights" are files the server reads before it
#                      starts, and THP is a file (GPUSNAP_THP_SYSFS)
# Writes $OUT/agent-bench.md (also printed) and $OUT/agent-bench.log.
# Exit 0 when every check passed (the speed targets are reported, met or
# not met, not enforced), 1 otherwise.

NAME=agent-bench # read by lib.sh
# shellcheck source=tests/gpu/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/../../tests/gpu/lib.sh"

WEIGHTS_GB=${AGENT_WEIGHTS_GB:-16}
KV_GB=${AGENT_KV_GB:-59}
BACKEND=${AGENT_BACKEND:-auto}
SWAPS=${AGENT_SWAPS:-2}
TOKENS=${AGENT_TOKENS:-16}
WEIGHTS_DIR=${AGENT_WEIGHTS_DIR:-$WORK/weights}
PROXY_N=${PROXY_N:-200}
BUDGET=${AGENT_BENCH_BUDGET_S:-420}
SERVER=${AGENT_SERVER:-torch}
MODES=${AGENT_MODES:-off on hooks}
read -r -a MODE_LIST <<<"$MODES"
for m in "${MODE_LIST[@]}"; do
    case $m in off | on | hooks | fast) ;; *) echo "agent-bench: AGENT_MODES: unknown mode $m (off, on, hooks, fast)" >&2 && exit 2 ;; esac
done
# fast: the servers run with fast swap (the agent's default for a server it
# starts) and keep_pinned from their start, so that mode comes first (the
# agent adopts them as they are in later modes). Without it they run with
# fast_swap = false: the driver path.
FAST_KEYS='fast_swap = false'
if [[ " $MODES " == *" fast "* ]]; then
    [ "${MODE_LIST[0]}" = fast ] || { echo "agent-bench: AGENT_MODES: fast must come first" >&2 && exit 2; }
    FAST_KEYS='keep_pinned = true'
fi
[ "${#MODE_LIST[@]}" -gt 0 ] || { echo "agent-bench: AGENT_MODES is empty" >&2 && exit 2; }
PROMPT="the quick brown fox jumps over the lazy dog"
QPROMPT=${PROMPT// /+}
ROWS=$WORK/rows.tsv
: >"$ROWS"
NPASS=0 NFAIL=0 NSKIP=0 NINFO=0
AGENT_PID=""
SOCK=$WORK/agent.sock
REPORT=$OUT/agent-bench.md

# Ports: the services listen on 127.0.0.1:LP*, their servers on BP*.
LP1=18411 LP2=18412 BP1=18421 BP2=18422 BP0=18420

# ttfb URL -> "SECONDS_TO_FIRST_BYTE TOTAL_SECONDS" on the first line, then the body.
fetch() {
    local out=$WORK/body.$$ t
    t=$(curl -sS -m 600 -o "$out" -w '%{time_starttransfer} %{time_total} %{http_code}' "$1" 2>>"$LOG") || t="0 0 000"
    printf '%s\n' "$t"
    cat "$out" 2>/dev/null
    rm -f "$out"
}

api() { "$GPUSNAP" --json services --socket "$SOCK" 2>>"$LOG"; }

svc_field() { # NAME FIELD
    api | python3 -c 'import json,sys
for s in json.load(sys.stdin):
    if s["name"] == sys.argv[1]:
        print(s.get(sys.argv[2]) if s.get(sys.argv[2]) is not None else "")' "$1" "$2" 2>/dev/null
}

metric_sum() { # KIND -> "SUM COUNT" of the transition histogram
    curl -s --unix-socket "$SOCK" http://agent/metrics 2>/dev/null | awk -v k="kind=\"$1\"" '
        index($0, "gpusnap_agent_transition_duration_seconds_sum{") == 1 && index($0, k) { s = $2 }
        index($0, "gpusnap_agent_transition_duration_seconds_count{") == 1 && index($0, k) { c = $2 }
        END { printf "%s %s\n", (s == "" ? 0 : s), (c == "" ? 0 : c) }'
}

# phase_sums -> "PHASE SUM COUNT" per line: the agent's trace of the wakes
# requests caused (gpusnap_agent_swap_phase_seconds), plus "total SUM COUNT"
# (gpusnap_agent_swap_seconds) and "event:NAME N 0" (swap_events_total).
phase_sums() {
    curl -s --unix-socket "$SOCK" http://agent/metrics 2>/dev/null | awk '
        function lab(l, k,   i, r) { i = index(l, k "=\""); if (!i) return ""; r = substr(l, i + length(k) + 2); return substr(r, 1, index(r, "\"") - 1) }
        index($0, "gpusnap_agent_swap_phase_seconds_sum{") == 1 { s[lab($0, "phase")] += $2 }
        index($0, "gpusnap_agent_swap_phase_seconds_count{") == 1 { c[lab($0, "phase")] += $2 }
        index($0, "gpusnap_agent_swap_seconds_sum{") == 1 { s["total"] += $2 }
        index($0, "gpusnap_agent_swap_seconds_count{") == 1 { c["total"] += $2 }
        index($0, "gpusnap_agent_swap_events_total{") == 1 { s["event:" lab($0, "event")] += $2; c["event:" lab($0, "event")] += 0 }
        END { for (k in s) print k, s[k], c[k] + 0 }'
}

# breakdown BEFORE AFTER -> the mean per traced swap of each phase between two
# phase_sums outputs, in the agent's order, as "phase ms, ..." on line 1;
# "SWAPS TOTAL_S SUSPEND_S RESUME_S RELEASE_S FIRST_BYTE_S HOOKS_S" on line 2;
# the counts per swap on line 3.
breakdown() {
    python3 - "$1" "$2" <<'PY'
import sys
def load(p):
    d = {}
    for l in open(p):
        f = l.split()
        if len(f) == 3:
            d[f[0]] = (float(f[1]), float(f[2]))
    return d
a, b = load(sys.argv[1]), load(sys.argv[2])
delta = lambda k, i: b.get(k, (0, 0))[i] - a.get(k, (0, 0))[i]
n = delta("total", 1)
order = ["decide", "admission", "pick", "evict_prep", "hook_suspend", "suspend", "release_wait", "memory_wait",
         "resume_prep", "wake", "resume", "hook_resume", "ready", "connect", "first_byte"]
if n <= 0:
    print("no traced swap"); print("0 0 0 0 0 0 0"); print("-"); sys.exit()
mean = lambda k: delta(k, 0) / n
print(", ".join(f"{k} {mean(k) * 1e3:.1f} ms" for k in order if delta(k, 1) > 0))
print(f"{n:.0f} {mean('total'):.4f} {mean('suspend'):.4f} {mean('resume') + mean('wake'):.4f} {mean('release_wait'):.4f} {mean('first_byte'):.4f} {mean('hook_suspend') + mean('hook_resume'):.4f}")
ev = sorted(k for k in b if k.startswith("event:"))
print(", ".join(f"{k[6:]} {delta(k, 0) / n:.1f}" for k in ev) or "-")
PY
}

median() { sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) print "?"; else if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

# shellcheck disable=SC2317 # runs from the EXIT trap
on_exit() {
    local rc=$?
    if [ -n "$AGENT_PID" ] && alive "$AGENT_PID"; then
        log "stopping the agent ($AGENT_PID); its services are stopped through gpusnap stop"
        kill -TERM "$AGENT_PID" 2>/dev/null
        wait "$AGENT_PID" 2>/dev/null
    fi
    cleanup_all
    [ "${AGENT_KEEP_WEIGHTS:-0}" = 1 ] || [ -n "${AGENT_WEIGHTS_DIR:-}" ] || rm -rf "$WEIGHTS_DIR"
    report
    [ "$NFAIL" = 0 ] && [ "$rc" = 0 ] && exit 0
    exit 1
}

# shellcheck disable=SC2317 # called from on_exit
report() {
    {
        echo "# agent benchmark"
        echo
        echo "$(date -u +%FT%TZ) $(hostname), $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
        echo "servers: $SERVER ($BACKEND), ${WEIGHTS_GB} GB weights (safetensors on disk) + ${KV_GB} GB KV cache each; $SWAPS alternating requests per mode ($MODES), $TOKENS tokens each; host THP: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null)"
        echo
        echo "| id | check | expected | got | result | figure |"
        echo "|---|---|---|---|---|---|"
        while IFS=$'\t' read -r a b c d e f; do
            echo "| $a | $b | $c | $d | $e | $f |"
        done <"$ROWS"
        echo
        echo "pass $NPASS, fail $NFAIL, skip $NSKIP, info $NINFO"
    } >"$REPORT"
    cat "$REPORT"
}

server_cmd() { # PORT SEED -> a TOML array (the server loads DIR/mSEED)
    local port=$1 seed=$2
    if [ "$SERVER" = fake ]; then
        # shellcheck disable=SC2016 # $0 and $@ are the inner shell's
        printf '["sh", "-c", "cat %s/m%s/* >/dev/null && exec \\"$0\\" \\"$@\\"", "%s", "--mib", "%s", "--kv-mib", "%s", "--http", "%s"]' \
            "$WEIGHTS_DIR" "$seed" "${FAKE_WORKLOAD:?set FAKE_WORKLOAD for AGENT_SERVER=fake}" "$(fake_mib w)" "$(fake_mib k)" "$port"
    else
        printf '["python3", "%s/model_server.py", "--port", "%s", "--seed", "%s", "--weights-gb", "%s", "--kv-gb", "%s", "--backend", "%s", "--ref-n", "%s", "--weights", "%s/m%s"]' \
            "$GPU_DIR" "$port" "$seed" "$WEIGHTS_GB" "$KV_GB" "$BACKEND" "$TOKENS" "$WEIGHTS_DIR" "$seed"
    fi
}

# fake_mib [w|k]: the fake server's size (weights, KV cache, or both) in MiB.
fake_mib() {
    case ${1:-} in
        w) calc %d 'w * 1e9 / 1048576' w="$WEIGHTS_GB" ;;
        k) calc %d 'k * 1e9 / 1048576' k="$KV_GB" ;;
        *) calc %d '(w + k) * 1e9 / 1048576' w="$WEIGHTS_GB" k="$KV_GB" ;;
    esac
}

# cold_cmd KIND: the command line of a cold-start server of m1 on BP0 (no
# reference answer: its port opens as soon as it has loaded).
cold_cmd() {
    if [ "$SERVER" = fake ]; then
        case $1 in
            random) printf '%s\n' "$FAKE_WORKLOAD" --mib "$(fake_mib)" --http "$BP0" ;;
            *) printf '%s\n' sh -c "cat $WEIGHTS_DIR/m1/* >/dev/null && exec \"\$0\" \"\$@\"" "$FAKE_WORKLOAD" --mib "$(fake_mib)" --http "$BP0" ;;
        esac
    else
        printf '%s\n' python3 "$GPU_DIR/model_server.py" --port "$BP0" --seed 1 --weights-gb "$WEIGHTS_GB" \
            --kv-gb "$KV_GB" --backend "$BACKEND" --ref-n 0
        [ "$1" = random ] || printf '%s\n' --weights "$WEIGHTS_DIR/m1"
    fi
}

# cold_start KIND: spawns the server and times, from just before the spawn,
# the first byte of the answer to its first request. Sets COLD_S and
# COLD_PID (left running; end it with end_fresh).
cold_start() {
    local kind=$1 out cmd=()
    mapfile -t cmd < <(cold_cmd "$kind")
    out=$(python3 - "$BP0" "$QPROMPT" "$TOKENS" "$WORK/cold-$kind.log" "${cmd[@]}" 2>>"$LOG" <<'PY'
import socket, subprocess, sys, time
port, qp, n, logf = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
t0 = time.perf_counter()
p = subprocess.Popen(sys.argv[5:], stdout=open(logf, "w"), stderr=subprocess.STDOUT,
                     stdin=subprocess.DEVNULL, start_new_session=True)
while True:
    if p.poll() is not None:
        print(f"0 {p.pid} exited")
        sys.exit(0)
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=1)
        break
    except OSError:
        if time.perf_counter() - t0 > 300:
            print(f"0 {p.pid} timeout")
            sys.exit(0)
        time.sleep(0.01)
s.settimeout(300)
s.sendall(f"GET /generate?prompt={qp}&n={n} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
first = s.recv(1)
ttfb = time.perf_counter() - t0
print(f"{ttfb:.3f} {p.pid} {'ok' if first else 'closed'}")
PY
)
    COLD_S=${out%% *}
    COLD_PID=$(awk '{ print $2 }' <<<"$out")
    [ -n "$COLD_PID" ] && WORKERS+=("$COLD_PID")
    log "cold start ($kind): $out; $(grep -m1 '^ready' "$WORK/cold-$kind.log" 2>/dev/null)"
    [ "$(awk '{ print $3 }' <<<"$out")" = ok ]
}

# end_fresh PID: a server that was never suspended nor restored ends with
# SIGTERM (no checkpoint of 55 GB first: the safety rule is about restored
# processes); anything else through stop_safely.
end_fresh() {
    local pid=$1
    [ -n "$pid" ] && alive "$pid" || return 0
    if was_restored "$pid"; then
        stop_safely "$pid" cold
        return
    fi
    kill -TERM "$pid" 2>/dev/null
    wait_gone "$pid" 60 || stop_safely "$pid" cold
}

# drop_caches: the page cache emptied, as on a fresh node.
drop_caches() { sync && echo 3 2>/dev/null >/proc/sys/vm/drop_caches; }

budget_left() { [ "$SECONDS" -lt "$BUDGET" ]; }

install_traps
start_watchdog $((BUDGET + 60))

# A swap holds both servers in host RAM for a moment (the other one is
# suspended before this one is resumed): two 75 GB servers need ~170 GB of
# it. With less, the servers are made smaller (KV cache first) and a filler
# takes GPU memory so that still only one fits: the kernel's OOM killer must
# never meet a suspended CUDA process.
FILL_LEAVE_MIB=""
if [ "$SERVER" != fake ]; then
    avail_gb=$(calc %.1f 'm * 1048576 / 1e9' m="$(mem_avail_mib)")
    size_gb=$(calc %.1f 'w + k' w="$WEIGHTS_GB" k="$KV_GB")
    if ! fle "$(calc %.1f '2 * s + 24' s="$size_gb")" "$avail_gb"; then
        KV_GB=$(calc %.1f '((a - 24) / 2 - w > 4) ? (a - 24) / 2 - w : 4' a="$avail_gb" w="$WEIGHTS_GB")
        row s1 "server size for this host's RAM" "2 x size + 24 GB <= available" \
            "${avail_gb} GB available: KV cache ${AGENT_KV_GB:-59} -> ${KV_GB} GB" INFO
    fi
    size_gb=$(calc %.1f 'w + k' w="$WEIGHTS_GB" k="$KV_GB")
    gpu_free_gb=$(calc %.1f 'm * 1048576 / 1e9' m="$(smi_free_mib)")
    if fle "$(calc %.1f '2 * s + 4' s="$size_gb")" "$gpu_free_gb"; then
        # Room for both: leave 1.5 servers' worth free, so that one fits.
        FILL_LEAVE_MIB=$(calc %d 's * 1.5 * 1e9 / 1048576' s="$size_gb")
    fi
fi
log "agent-bench: GPUSNAP=$GPUSNAP OUT=$OUT server=$SERVER weights=${WEIGHTS_GB}GB in $WEIGHTS_DIR kv=${KV_GB}GB filler leaves ${FILL_LEAVE_MIB:-no filler} MiB"

# ---------------------------------------------------------------- (w) weights
t0=$(now)
pids=()
for seed in 1 2; do
    d=$WEIGHTS_DIR/m$seed
    if [ -s "$d/complete" ]; then
        log "weights of m$seed already in $d: $(cat "$d/complete")"
        continue
    fi
    rm -rf "$d"
    mkdir -p "$d"
    if [ "$SERVER" = fake ]; then
        (dd if=/dev/urandom of="$d/model-00000.safetensors" bs=1M count=64 conv=fsync status=none &&
            echo "fake $WEIGHTS_GB $seed $((64 << 20))" >"$d/complete") &
    else
        python3 "$GPU_DIR/model_server.py" --save-weights "$d" --seed "$seed" --weights-gb "$WEIGHTS_GB" \
            --backend "$BACKEND" >"$WORK/save-m$seed.log" 2>&1 &
    fi
    pids+=($!)
done
for p in ${pids[@]+"${pids[@]}"}; do wait "$p"; done
if [ -s "$WEIGHTS_DIR/m1/complete" ] && [ -s "$WEIGHTS_DIR/m2/complete" ]; then
    wbytes=$(du -sb "$WEIGHTS_DIR/m1" | awk '{ print $1 }')
    row w1 "weights on disk (safetensors, one directory per model; untimed)" "written" \
        "2 x $(gb "$wbytes") GB in $(fsub "$t0" "$(now)") s" INFO
else
    for f in "$WORK"/save-m*.log; do log_file "$f" "$f"; done
    row w1 "weights on disk" "written" "failed" FAIL
    exit 1
fi

# ---------------------------------------------------------------- (a) cold starts
COLD_WARM="" COLD_COLD=""
if cold_start warm; then
    COLD_WARM=$COLD_S
    row a1 "cold start of m1, weights from disk, page cache warm (spawn -> first byte)" "answers" "${COLD_S}s" PASS "${COLD_S}s"
else
    log_file "cold start output" "$WORK/cold-warm.log"
    row a1 "cold start of m1, page cache warm" "answers within 300 s" "no answer" FAIL
fi
end_fresh "$COLD_PID"
if ! drop_caches; then
    row a2 "cold start of m1, page cache dropped" "echo 3 > /proc/sys/vm/drop_caches" "not writable here" SKIP
elif cold_start cold; then
    COLD_COLD=$COLD_S
    row a2 "cold start of m1, weights from disk after drop_caches (a fresh node)" "answers" "${COLD_S}s" PASS "${COLD_S}s"
else
    log_file "cold start output" "$WORK/cold-cold.log"
    row a2 "cold start of m1, page cache dropped" "answers within 300 s" "no answer" FAIL
fi
end_fresh "$COLD_PID"

# ---------------------------------------------------------------- (b) the agent
if [ -n "$FILL_LEAVE_MIB" ]; then
    if start_filler "$FILL_LEAVE_MIB" 120; then
        row s2 "filler: only one server fits the GPU" "free ~1.5 servers" "holds ${FILL_HELD:-?} MiB, leaves ${FILL_AFTER:-?} MiB" INFO
    else
        row s2 "filler: only one server fits the GPU" "ready" "failed" FAIL
        exit 1
    fi
fi
gb_need=$(calc %d '(w + k) * 1e9' w="$WEIGHTS_GB" k="$KV_GB")
# A dry run's THP is a file: the agent's switches are seen, the host's not touched.
if [ "$SERVER" = fake ]; then
    export GPUSNAP_THP_SYSFS=$WORK/thp-enabled
    echo "always [madvise] never" >"$GPUSNAP_THP_SYSFS"
fi
THP_FILE=${GPUSNAP_THP_SYSFS:-/sys/kernel/mm/transparent_hugepage/enabled}
# thp_mode: the selected mode ("always [madvise] never" -> madvise).
thp_mode() {
    awk '{ for (i = 1; i <= NF; i++) if ($i ~ /^\[/) { gsub(/[][]/, "", $i); print $i; exit } print $1; exit }' "$THP_FILE" 2>/dev/null
}
THP_BEFORE=$(thp_mode)

# agent_up MODE: (re)starts the agent for a swap mode (off: thp = false;
# on: thp = true; hooks: thp = true and the services' sleep hooks); it
# adopts what runs.
agent_up() {
    local thp=true hooks=""
    [ "$1" = off ] && thp=false
    if [ "$1" = hooks ]; then
        hooks='hooks.before_suspend = { method = "POST", path = "/sleep?level=1", timeout = "60s" }
hooks.after_resume = { method = "POST", path = "/wake_up", timeout = "120s" }'
    fi
    cat >"$WORK/agent.toml" <<EOF
[agent]
socket = "$SOCK"
thp = $thp

[[service]]
name = "m1"
listen = "127.0.0.1:$LP1"
backend = "127.0.0.1:$BP1"
command = $(server_cmd "$BP1" 1)
suspend_after = "1h"
wake_timeout = "300s"
gpu_memory = $gb_need
$hooks
$FAST_KEYS

[[service]]
name = "m2"
listen = "127.0.0.1:$LP2"
backend = "127.0.0.1:$BP2"
command = $(server_cmd "$BP2" 2)
suspend_after = "1h"
wake_timeout = "300s"
gpu_memory = $gb_need
$hooks
$FAST_KEYS
EOF
    log_file "agent.toml" "$WORK/agent.toml"
    "$GPUSNAP" --state-dir "$STATE_DIR" -v agent --config "$WORK/agent.toml" >>"$WORK/agent.log" 2>&1 &
    AGENT_PID=$!
}

agent_down() {
    kill -TERM "$AGENT_PID" 2>/dev/null
    wait "$AGENT_PID" 2>/dev/null
    AGENT_PID=""
}

# settled: one service running, the other suspended (sets s1 s2).
settled() {
    s1=$(svc_field m1 state) s2=$(svc_field m2 state)
    { [ "$s1" = suspended ] && [ "$s2" = running ]; } || { [ "$s1" = running ] && [ "$s2" = suspended ]; }
}

agent_up "${MODE_LIST[0]}"
end=$((SECONDS + 600))
up=0
while [ "$SECONDS" -lt "$end" ] && alive "$AGENT_PID"; do
    if settled; then
        up=1
        break
    fi
    sleep 0.5
done
for n in m1 m2; do
    p=$(svc_field "$n" pid)
    [ -n "$p" ] && WORKERS+=("$p")
done
if [ "$up" = 1 ]; then
    row b1 "both services started from their weights (the second evicted the first)" "one running, one suspended" "m1 $s1, m2 $s2" PASS
else
    log_file "agent log" "$WORK/agent.log"
    row b1 "both services started (the second evicted the first)" "one running, one suspended" "m1 ${s1:-?}, m2 ${s2:-?}" FAIL
    exit 1
fi

# References: each process's own answer from before any suspension
# (model_server.py computes it at start-up, /reference serves it without
# the GPU); the fake has none: then its first answer.
running=$([ "$s1" = running ] && echo m1 || echo m2)
# shellcheck disable=SC2034 # read through ${!ref}
REF_m1="" REF_m2=""
if [ "$SERVER" != fake ]; then
    # shellcheck disable=SC2034 # read through ${!ref}
    REF_m1=$(fetch "http://127.0.0.1:$LP1/reference" | tail -n +2)
    # shellcheck disable=SC2034
    REF_m2=$(fetch "http://127.0.0.1:$LP2/reference" | tail -n +2)
fi

# (c-a) the running model.
rport=$([ "$running" = m1 ] && echo "$LP1" || echo "$LP2")
: >"$WORK/run.ttfb"
for _ in 1 2 3 4 5; do
    fetch "http://127.0.0.1:$rport/generate?prompt=$QPROMPT&n=$TOKENS" | head -1 | awk '{ print $1 }' >>"$WORK/run.ttfb"
done
run_ttfb=$(median <"$WORK/run.ttfb")

# swaps MODE: SWAPS alternating requests, each to the suspended model.
# Sets SWAP_TTFB SUS_AVG RES_AVG NSWAPS.
swaps() {
    local mode=$1 i n port ref res t body ttfb sus0 susn0 res0 resn0 sus1 susn1 res1 resn1 hs0 hsn0 hr0 hrn0 hs1 hsn1 hr1 hrn1
    read -r sus0 susn0 <<<"$(metric_sum suspend)"
    read -r res0 resn0 <<<"$(metric_sum resume)"
    read -r hs0 hsn0 <<<"$(metric_sum hook_suspend)"
    read -r hr0 hrn0 <<<"$(metric_sum hook_resume)"
    phase_sums >"$WORK/phases-$mode.0"
    : >"$WORK/swap-$mode.ttfb"
    for i in $(seq 1 "$SWAPS"); do
        if [ "$(svc_field m1 state)" = running ]; then n=m2 port=$LP2; else n=m1 port=$LP1; fi
        if ! budget_left; then
            row "b2.$mode.$i" "request $i to $n (thp $mode)" "answered" "budget spent" SKIP
            continue
        fi
        res=$(fetch "http://127.0.0.1:$port/generate?prompt=$QPROMPT&n=$TOKENS")
        t=$(head -1 <<<"$res")
        body=$(tail -n +2 <<<"$res")
        ttfb=${t%% *}
        echo "$ttfb" >>"$WORK/swap-$mode.ttfb"
        ref=REF_$n
        ref=${!ref}
        if [ -z "$ref" ] && [ "$SERVER" = fake ]; then
            # The fake's answer is a checksum of its device memory: its
            # first one is the reference of the later ones.
            printf -v "REF_$n" '%s' "$body"
            ref=$body
        fi
        if [ -n "$body" ] && [ "$body" = "$ref" ]; then
            row "b2.$mode.$i" "request $i to $n (swap, $(mlabel "$mode"))" "the reference answer" "same ($(wc -w <<<"$body") tokens)" PASS "ttfb ${ttfb}s"
        else
            row "b2.$mode.$i" "request $i to $n (swap, $(mlabel "$mode"))" "the reference answer" "$(head -c 60 <<<"$body") (http ${t##* })" FAIL "ttfb ${ttfb}s"
        fi
    done
    read -r sus1 susn1 <<<"$(metric_sum suspend)"
    read -r res1 resn1 <<<"$(metric_sum resume)"
    read -r hs1 hsn1 <<<"$(metric_sum hook_suspend)"
    read -r hr1 hrn1 <<<"$(metric_sum hook_resume)"
    HS_AVG=$(calc %.3f '(m > 0) ? (b - a) / m : 0' a="$hs0" b="$hs1" m="$(calc %d 'b - a' a="$hsn0" b="$hsn1")")
    HR_AVG=$(calc %.3f '(m > 0) ? (b - a) / m : 0' a="$hr0" b="$hr1" m="$(calc %d 'b - a' a="$hrn0" b="$hrn1")")
    # The last swap's trace is observed just after its first byte.
    sleep 0.5
    phase_sums >"$WORK/phases-$mode.1"
    mapfile -t BREAKDOWN < <(breakdown "$WORK/phases-$mode.0" "$WORK/phases-$mode.1")
    NSWAPS=$(calc %d 'b - a' a="$resn0" b="$resn1")
    SWAP_TTFB=$(median <"$WORK/swap-$mode.ttfb")
    if [ "$NSWAPS" -gt 0 ] && [ "$(calc %d 'b - a' a="$susn0" b="$susn1")" -gt 0 ]; then
        SUS_AVG=$(calc %.3f '(b - a) / n' a="$sus0" b="$sus1" n="$(calc %d 'b - a' a="$susn0" b="$susn1")")
        RES_AVG=$(calc %.3f '(b - a) / n' a="$res0" b="$res1" n="$NSWAPS")
    else
        SUS_AVG="?" RES_AVG="?"
    fi
}

# mlabel MODE: how a row names the mode.
mlabel() { case $1 in hooks) echo "sleep hooks, thp on" ;; fast) echo "fast swap, pinned copies kept" ;; *) echo "thp $1" ;; esac; }

# met CMD...: MET or NOT MET (a speed target is reported, not enforced).
met() { if "$@"; then echo MET; else echo "NOT MET"; fi; }

swap_rows() { # MODE
    local mode=$1 over k c
    row "c2.$mode" "ttfb, request to the suspended model (a swap), $(mlabel "$mode"), median" "-" "${SWAP_TTFB}s over $NSWAPS swaps" INFO "${SWAP_TTFB}s"
    if [ "$SUS_AVG" != "?" ] && [ "$mode" = hooks ]; then
        row "c3.$mode" "hook_suspend(other) + suspend(other) + resume(this) + hook_resume(this), agent metrics" "-" \
            "hook_suspend ${HS_AVG}s + suspend ${SUS_AVG}s + resume ${RES_AVG}s + hook_resume ${HR_AVG}s" INFO \
            "$(calc %.3f 'h + a + b + k' h="$HS_AVG" a="$SUS_AVG" b="$RES_AVG" k="$HR_AVG")s"
        over=$(calc %.3f 's - h - a - b - k - r' s="$SWAP_TTFB" h="$HS_AVG" a="$SUS_AVG" b="$RES_AVG" k="$HR_AVG" r="$run_ttfb")
        row "c4.$mode" "swap ttfb - (hook_suspend + suspend + resume + hook_resume) - ttfb of the running model" "<= 0.100 s" "${over}s" \
            "$(met fle "$over" 0.1)" "${over}s"
    elif [ "$SUS_AVG" != "?" ]; then
        row "c3.$mode" "suspend(other) + resume(this), agent metrics, thp $mode" "-" "suspend ${SUS_AVG}s + resume ${RES_AVG}s" INFO \
            "$(calc %.3f 'a + b' a="$SUS_AVG" b="$RES_AVG")s"
        over=$(calc %.3f 's - a - b - r' s="$SWAP_TTFB" a="$SUS_AVG" b="$RES_AVG" r="$run_ttfb")
        row "c4.$mode" "swap ttfb - (suspend + resume) - ttfb of the running model, thp $mode" "<= 0.100 s" "${over}s" \
            "$(met fle "$over" 0.1)" "${over}s"
    else
        row "c3.$mode" "suspend(other) + resume(this), agent metrics, thp $mode" "-" "no swap measured" FAIL
    fi
    # The agent's trace of the same swaps: accept -> first byte, in phases.
    local tn tt ts tr trel tfb thk
    read -r tn tt ts tr trel tfb thk <<<"${BREAKDOWN[1]:-0 0 0 0 0 0 0}"
    thk=${thk:-0}
    if [ "${tn:-0}" != 0 ]; then
        row "c6.$mode" "where a swap's time goes (agent trace, mean of $tn; docs/design/agent.md)" "-" "${BREAKDOWN[0]}" INFO \
            "${tt}s accept->first byte"
        local added
        added=$(calc %.3f 't - s - r - f - h' t="$tt" s="$ts" r="$tr" f="$tfb" h="$thk")
        row "c7.$mode" "what the agent adds: trace total - suspend - resume - first_byte$([ "$mode" = hooks ] && echo " - hooks") (release_wait included), $mode" \
            "<= 0.100 s" "${added}s (release_wait ${trel}s$([ "$mode" = hooks ] && echo ", hooks ${thk}s"))" \
            "$(met fle "$added" 0.1)" "${added}s"
        row "c8.$mode" "first byte after the resume (first_byte phase) against the running model's ttfb (c1), $(mlabel "$mode")" "-" \
            "${tfb}s vs ${run_ttfb}s: $(calc %+.3f 'f - r' f="$tfb" r="$run_ttfb")s" INFO
        row "c9.$mode" "what each swap did (per swap: admissions, refusals, evictions, NVML reads, connect retries)" "-" \
            "${BREAKDOWN[2]}" INFO
    else
        row "c6.$mode" "where a swap's time goes (agent trace)" "traced swaps" "none (an agent without the trace?)" INFO
    fi
    for k in warm cold; do
        c=$([ "$k" = warm ] && echo "$COLD_WARM" || echo "$COLD_COLD")
        [ -n "$c" ] || continue
        if [ "$mode" = hooks ] || [ "$mode" = fast ]; then
            # Well under: at most half the cold start.
            row "c5.$mode.$k" "swap ($(mlabel "$mode")) against the cold start, page cache $k" "swap <= 0.5 x cold start" \
                "${SWAP_TTFB}s vs ${c}s: $(calc %.2f '(c > 0) ? s / c : 0' s="$SWAP_TTFB" c="$c")x" \
                "$(met fle "$SWAP_TTFB" "$(calc %.3f 'c / 2' c="$c")")"
        else
            row "c5.$mode.$k" "swap (thp $mode) against the cold start, page cache $k" "swap < cold start" \
                "${SWAP_TTFB}s vs ${c}s: $(calc %.2f '(c > 0) ? s / c : 0' s="$SWAP_TTFB" c="$c")x" "$(met fle "$SWAP_TTFB" "$c")"
        fi
    done
}

# Does the driver release a process's device memory while its checkpoint
# copies, or only at the end? (Whether a resume could start before the
# eviction returns.) NVML sampled through the thp-off swaps.
smi_start() {
    SMI_SAMPLER=""
    if command -v nvidia-smi >/dev/null 2>&1; then
        # (Made before the sampler starts: it stops when the file is gone.)
        touch "$WORK/.smi-watch"
        (while [ -e "$WORK/.smi-watch" ]; do
            t=$(now)
            timeout 5 nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null |
                awk -v t="$t" -F', *' '{ print t, $1, $2 }'
            sleep 0.1
        done >"$WORK/smi-samples") &
        SMI_SAMPLER=$!
    fi
}

smi_rows() {
if [ -n "$SMI_SAMPLER" ]; then
    rm -f "$WORK/.smi-watch"
    wait "$SMI_SAMPLER" 2>/dev/null
    partial=$(python3 - "$WORK/smi-samples" "$(svc_field m1 pid)" "$(svc_field m2 pid)" 2>>"$LOG" <<'PY'
import sys
path, pids = sys.argv[1], [p for p in sys.argv[2:] if p]
rows = [l.split() for l in open(path) if len(l.split()) == 3]
out = []
for pid in pids:
    mib = [float(r[2]) for r in rows if r[1] == pid]
    if not mib:
        continue
    full = max(mib)
    mid = [m for m in mib if 0.05 * full < m < 0.95 * full]
    out.append(f"{pid}: full {full:.0f} MiB, {len(mib)} samples, {len(mid)} in between")
print("; ".join(out) or "no samples")
PY
)
    cp -f "$WORK/smi-samples" "$OUT/agent-smi-samples.txt" 2>/dev/null
    row e1 "device memory of each server through the swaps (NVML every ~0.2 s; agent-smi-samples.txt)" \
        "samples between full and 0: memory released (checkpoint) or taken (restore) gradually" "$partial" INFO
    # When NVML showed an evicted server's memory free, against its
    # checkpoint's return (the journal's checkpoint end): the samples bound
    # the lag (last sample still holding, first free); the agent's trace
    # measures it at 5 ms (release_wait in c6).
    curl -s --unix-socket "$SOCK" "http://agent/v1/events?after=0&follow=false" >"$WORK/events.jsonl" 2>>"$LOG"
    lag=$(python3 - "$WORK/smi-samples" "$WORK/events.jsonl" "$(svc_field m1 pid)" "$(svc_field m2 pid)" 2>>"$LOG" <<'PY'
import json, sys
samples, evf, pids = sys.argv[1], sys.argv[2], {int(p) for p in sys.argv[3:] if p}
by_t = {}
for l in open(samples):
    f = l.split()
    if len(f) == 3:
        try:
            by_t.setdefault(float(f[0]), {})[int(f[1])] = float(f[2])
        except ValueError:
            pass
times = sorted(by_t)
out = []
for l in open(evf):
    try:
        e = json.loads(l)
    except ValueError:
        continue
    if e.get("op") != "checkpoint" or e.get("phase") != "ok" or e.get("pid") not in pids:
        continue
    te, pid = e["ts_ms"] / 1000, e["pid"]
    after = [t for t in times if te <= t <= te + 30]
    if not after:
        continue
    # Up to the first sample that shows it free (a later resume takes the
    # memory again).
    free = [t - te for t in after if by_t[t].get(pid, 0) == 0]
    first_free = min(free) if free else 30
    held = [t - te for t in after if t - te < first_free and by_t[t].get(pid, 0) > 0]
    out.append(f"{pid}: held in NVML until +{max(held):.2f} s" if held else f"{pid}: no sample held it after the return")
    out[-1] += f", free from +{first_free:.2f} s" if free else ", never free within 30 s"
print("; ".join(out) or "no checkpoint with samples after it")
PY
)
    row e2 "NVML after each eviction's checkpoint returned (journal's checkpoint end against the samples)" \
        "free at the first sample: nothing to wait for" "${lag:-not measured}" INFO
fi
}

thp_watch_start() {
    # Sampled while the swaps run: the switch is seen, and put back after.
    touch "$WORK/.thp-watch"
    (while [ -e "$WORK/.thp-watch" ]; do thp_mode; sleep 0.05; done | sort | uniq -c >"$WORK/thp-seen") &
    watcher=$!
}

thp_watch_rows() {
    rm -f "$WORK/.thp-watch"
    wait "$watcher" 2>/dev/null
    seen=$(awk '{ printf "%s%s x%s", (NR > 1 ? ", " : ""), $2, $1 }' "$WORK/thp-seen" 2>/dev/null)
    if [ "$THP_BEFORE" = always ]; then
        row b4 "THP with thp = true" "switched to always during suspends" "the host's mode is always already: nothing to switch" INFO
    else
        row b4 "THP with thp = true: always during the swaps' suspends, then $THP_BEFORE again" "always seen; $THP_BEFORE after" \
            "samples: $seen; after: $(thp_mode)" \
            "$(grep -qw always "$WORK/thp-seen" 2>/dev/null && [ "$(thp_mode)" = "$THP_BEFORE" ] && echo PASS || echo FAIL)"
    fi
}

# Each mode in turn: the agent restarted for it (it adopts both services as
# they are), then SWAPS alternating requests. Results per mode in SW and BD*.
declare -A SW=() BD0=() BD1=() BD2=()
first=1
for mode in "${MODE_LIST[@]}"; do
    if [ "$first" = 1 ]; then
        first=0
    else
        if ! budget_left; then
            row "b3.$mode" "swaps, mode $mode" "run" "budget spent" SKIP
            continue
        fi
        agent_down
        agent_up "$mode"
        end=$((SECONDS + 60))
        while [ "$SECONDS" -lt "$end" ] && ! settled; do sleep 0.2; done
        if settled; then
            row "b3.$mode" "agent restarted for mode $mode: both services adopted as they were" "one running, one suspended" "m1 $s1, m2 $s2" PASS
        else
            row "b3.$mode" "agent restarted for mode $mode: both services adopted as they were" "one running, one suspended" "m1 ${s1:-?}, m2 ${s2:-?}" FAIL
        fi
        if [ "$mode" = hooks ]; then
            # The suspended server was suspended whole (no hook then): one
            # swap, checked but not timed, so that each has slept once.
            if [ "$(svc_field m1 state)" = running ]; then n=m2 port=$LP2; else n=m1 port=$LP1; fi
            res=$(fetch "http://127.0.0.1:$port/generate?prompt=$QPROMPT&n=$TOKENS")
            body=$(tail -n +2 <<<"$res")
            ref=REF_$n
            ref=${!ref}
            [ -z "$ref" ] && [ "$SERVER" = fake ] && printf -v "REF_$n" '%s' "$body" && ref=$body
            if [ -n "$body" ] && [ "$body" = "$ref" ]; then
                row "b5.hooks" "warm-up swap to $n (it was suspended without its hook; not timed)" "the reference answer" "same" PASS "ttfb $(head -1 <<<"$res" | awk '{ print $1 }')s"
            else
                row "b5.hooks" "warm-up swap to $n (it was suspended without its hook; not timed)" "the reference answer" "$(head -c 60 <<<"$body")" FAIL
            fi
        fi
    fi
    case $mode in
        off) smi_start ;;
        on) thp_watch_start ;;
    esac
    swaps "$mode"
    SW[$mode]="$SWAP_TTFB $SUS_AVG $RES_AVG $NSWAPS $HS_AVG $HR_AVG"
    BD0[$mode]=${BREAKDOWN[0]:-} BD1[$mode]=${BREAKDOWN[1]:-} BD2[$mode]=${BREAKDOWN[2]:-}
    case $mode in
        off) smi_rows ;;
        on) thp_watch_rows ;;
    esac
    if [ "$mode" = hooks ]; then
        curl -s --unix-socket "$SOCK" "http://agent/v1/events?after=0&follow=false" >"$WORK/events-hooks.jsonl" 2>>"$LOG"
        hooks_seen=$(python3 - "$WORK/events-hooks.jsonl" 2>>"$LOG" <<'PY'
import json, sys
keys = ["before_suspend hook: ", "after_resume hook: ", "hook failed"]
n = dict.fromkeys(keys, 0)
for l in open(sys.argv[1]):
    try:
        d = json.loads(l).get("detail") or ""
    except ValueError:
        continue
    for k in keys:
        n[k] += k in d
print(f"journal: before_suspend ok {n[keys[0]]}, after_resume ok {n[keys[1]]}, failed {n[keys[2]]}")
PY
)
        row "b6.hooks" "the sleep hooks ran around the swaps (the agent's journal, all of this agent's run)" "none failed" \
            "${hooks_seen:-not read}" "$(grep -q 'failed 0$' <<<"${hooks_seen:-x}" && echo PASS || echo FAIL)"
    fi
done

# ---------------------------------------------------------------- (c) the table
row c1 "ttfb, request to the running model (median of 5)" "-" "${run_ttfb}s" INFO "${run_ttfb}s"
for mode in "${MODE_LIST[@]}"; do
    [ -n "${SW[$mode]:-}" ] || continue
    read -r SWAP_TTFB SUS_AVG RES_AVG NSWAPS HS_AVG HR_AVG <<<"${SW[$mode]}"
    BREAKDOWN=("${BD0[$mode]}" "${BD1[$mode]}" "${BD2[$mode]}")
    swap_rows "$mode"
done

# ---------------------------------------------------------------- (d) proxy overhead
cur=$(svc_field m1 state)
if [ "$cur" = running ]; then lp=$LP1 bp=$BP1; else lp=$LP2 bp=$BP2; fi
python3 - "$lp" "$bp" "$PROXY_N" >"$WORK/proxy.txt" 2>>"$LOG" <<'EOF'
import http.client, statistics, sys, time
lp, bp, n = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
def p50(port):
    ts = []
    for i in range(n):
        t = time.perf_counter()
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        c.request("GET", "/health", headers={"Connection": "close"})
        c.getresponse().read()
        c.close()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)
p50(bp); p50(lp)  # warm up
direct, proxied = p50(bp), p50(lp)
print(f"{direct * 1000:.3f} {proxied * 1000:.3f} {(proxied - direct) * 1000:.3f}")
EOF
read -r d_ms p_ms add_ms <"$WORK/proxy.txt" || true
if [ -n "${add_ms:-}" ]; then
    row d1 "proxy overhead p50 (/health, new connection each)" "<= 1 ms added" "direct ${d_ms} ms, proxied ${p_ms} ms" \
        "$(met fle "$add_ms" 1)" "+${add_ms} ms"
else
    row d1 "proxy overhead p50" "<= 1 ms added" "not measured" FAIL
fi

# ---------------------------------------------------------------- (a) the old cold start, last
# Random weights initialised on the GPU, nothing read from disk: the number
# earlier runs reported, kept for comparison. The running service is
# suspended first (a filler, if any, leaves room for one server only).
RANDOM_COLD=${AGENT_RANDOM_COLD:-$([ "$MODES" = hooks ] && echo 0 || echo 1)}
if [ "$RANDOM_COLD" != 1 ]; then
    row a3 "cold start of m1, random init on the GPU" "answers" "not run (AGENT_MODES=hooks, the quick run)" SKIP
elif budget_left; then
    if [ "$(svc_field m1 state)" = running ]; then n=m1; else n=m2; fi
    "$GPUSNAP" service "$n" suspend --socket "$SOCK" >>"$LOG" 2>&1 || log "could not suspend $n for the random-init cold start"
    if cold_start random; then
        row a3 "cold start of m1, random init on the GPU (no disk; as in earlier runs)" "answers" "${COLD_S}s" PASS "${COLD_S}s"
    else
        log_file "cold start output" "$WORK/cold-random.log"
        row a3 "cold start of m1, random init" "answers within 300 s" "no answer" FAIL
    fi
    end_fresh "$COLD_PID"
else
    row a3 "cold start of m1, random init on the GPU" "answers" "budget spent" SKIP
fi
log_file "agent log" "$WORK/agent.log"
exit 0
