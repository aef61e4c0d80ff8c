#!/usr/bin/env bash
# The node agent on a GPU (issue 9): two model servers that do not fit one
# GPU together, behind `gpusnap agent`, asked in turn.
#
# Run from the repository root, as root:
#   OUT=/some/dir tests/gpu/agent-bench.sh
# (a) cold start: tests/gpu/model_server.py started directly (process start +
#     model load + KV cache, until it answers); its answer to the prompt is
#     the reference for service m1 (same seed, same random weights).
# (b) the agent with services m1 and m2 (each declares gpu_memory, so the
#     second start evicts the first); alternating requests: every answer
#     must be the reference (greedy: same prompt, same tokens), and each one
#     swaps the servers (suspend the other, resume this one).
# (c) time to first byte: a request to the suspended model against one to
#     the running model and against the cold start; the swap against
#     suspend(other) + resume(this) from the agent's metrics (target: within
#     100 ms of their sum).
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
#   AGENT_BACKEND      auto (transformers if importable, else plain PyTorch),
#                      transformers or torch
#   AGENT_SWAPS        alternating requests (4); AGENT_TOKENS new tokens per
#                      answer (16); PROXY_N requests for (d) (200)
#   AGENT_BENCH_BUDGET_S  soft budget (420 s); a watchdog ends the run 60 s after
#   AGENT_SERVER=fake  a dry run without a GPU: fake-workload --http against
#                      the fake driver (FAKE_WORKLOAD, the fakes on
#                      LD_LIBRARY_PATH, GPUSNAP_FAKE_DIR; see docs/fakes.md)
# Writes $OUT/agent-bench.md (also printed) and $OUT/agent-bench.log.
# Exit 0 when every check passed (the speed targets are reported, not
# enforced), 1 otherwise.

NAME=agent-bench # read by lib.sh
# shellcheck source=tests/gpu/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

WEIGHTS_GB=${AGENT_WEIGHTS_GB:-16}
KV_GB=${AGENT_KV_GB:-59}
BACKEND=${AGENT_BACKEND:-auto}
SWAPS=${AGENT_SWAPS:-4}
TOKENS=${AGENT_TOKENS:-16}
XPROC=""
PROXY_N=${PROXY_N:-200}
BUDGET=${AGENT_BENCH_BUDGET_S:-420}
SERVER=${AGENT_SERVER:-torch}
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

server_cmd() { # PORT SEED -> a TOML array
    local port=$1 seed=$2
    if [ "$SERVER" = fake ]; then
        local mib
        mib=$(calc %d '(w + k) * 1e9 / 1048576' w="$WEIGHTS_GB" k="$KV_GB")
        printf '["%s", "--mib", "%s", "--http", "%s"]' "${FAKE_WORKLOAD:?set FAKE_WORKLOAD for AGENT_SERVER=fake}" "$mib" "$port"
    else
        printf '["python3", "%s/model_server.py", "--port", "%s", "--seed", "%s", "--weights-gb", "%s", "--kv-gb", "%s", "--backend", "%s", "--ref-n", "%s"]' \
            "$GPU_DIR" "$port" "$seed" "$WEIGHTS_GB" "$KV_GB" "$BACKEND" "$TOKENS"
    fi
}

# ttfb URL -> "SECONDS_TO_FIRST_BYTE TOTAL_SECONDS" on the first line, then the body.
fetch() {
    local out=$WORK/body.$$ t
    t=$(curl -sS -m 600 -o "$out" -w '%{time_starttransfer} %{time_total} %{http_code}' "$1" 2>>"$LOG") || t="0 0 000"
    printf '%s\n' "$t"
    cat "$out" 2>/dev/null
    rm -f "$out"
}

wait_health() { # PORT LIMIT_S: 0 once it answers
    local end=$((SECONDS + $2))
    while [ "$SECONDS" -lt "$end" ]; do
        if curl -s -m 5 -o /dev/null "http://127.0.0.1:$1/health" 2>/dev/null ||
            curl -s -m 5 -o /dev/null "http://127.0.0.1:$1/" 2>/dev/null; then
            return 0
        fi
        sleep 0.2
    done
    return 1
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
        echo "servers: $SERVER ($BACKEND), ${WEIGHTS_GB} GB weights + ${KV_GB} GB KV cache each; $SWAPS alternating requests, $TOKENS tokens each"
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
log "agent-bench: GPUSNAP=$GPUSNAP OUT=$OUT server=$SERVER weights=${WEIGHTS_GB}GB kv=${KV_GB}GB filler leaves ${FILL_LEAVE_MIB:-no filler} MiB"

# ---------------------------------------------------------------- (a) cold start
t0=$(now)
if [ "$SERVER" = fake ]; then
    cmd=("$FAKE_WORKLOAD" --mib "$(calc %d '(w + k) * 1e9 / 1048576' w="$WEIGHTS_GB" k="$KV_GB")" --http "$BP0")
else
    cmd=(python3 "$GPU_DIR/model_server.py" --port "$BP0" --seed 1 --weights-gb "$WEIGHTS_GB" --kv-gb "$KV_GB" --backend "$BACKEND" --ref-n "$TOKENS")
fi
setsid "${cmd[@]}" >"$WORK/cold.log" 2>&1 &
COLD_PID=$!
WORKERS+=("$COLD_PID")
if wait_health "$BP0" 300; then
    cold_s=$(fsub "$t0" "$(now)")
    log "cold start: ${cold_s}s ($(head -1 "$WORK/cold.log" 2>/dev/null))"
    REF1=$(fetch "http://127.0.0.1:$BP0/generate?prompt=$QPROMPT&n=$TOKENS" | tail -n +2)
    row a1 "cold start of m1 (process start + load)" "answers" "${cold_s}s" PASS "${cold_s}s"
else
    cold_s=""
    REF1=""
    log_file "cold start output" "$WORK/cold.log"
    row a1 "cold start of m1 (process start + load)" "answers within 300 s" "no answer" FAIL
fi
stop_safely "$COLD_PID" cold >>"$LOG" 2>&1 || log "cold server: stop failed"

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
cat >"$WORK/agent.toml" <<EOF
[agent]
socket = "$SOCK"

[[service]]
name = "m1"
listen = "127.0.0.1:$LP1"
backend = "127.0.0.1:$BP1"
command = $(server_cmd "$BP1" 1)
suspend_after = "1h"
wake_timeout = "300s"
gpu_memory = $gb_need

[[service]]
name = "m2"
listen = "127.0.0.1:$LP2"
backend = "127.0.0.1:$BP2"
command = $(server_cmd "$BP2" 2)
suspend_after = "1h"
wake_timeout = "300s"
gpu_memory = $gb_need
EOF
log_file "agent.toml" "$WORK/agent.toml"
"$GPUSNAP" --state-dir "$STATE_DIR" -v agent --config "$WORK/agent.toml" >"$WORK/agent.log" 2>&1 &
AGENT_PID=$!
end=$((SECONDS + 600))
up=0
while [ "$SECONDS" -lt "$end" ] && alive "$AGENT_PID"; do
    s1=$(svc_field m1 state) s2=$(svc_field m2 state)
    if { [ "$s1" = suspended ] && [ "$s2" = running ]; } || { [ "$s1" = running ] && [ "$s2" = suspended ]; }; then
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
    row b1 "both services started (the second evicted the first)" "one running, one suspended" "m1 $s1, m2 $s2" PASS
else
    log_file "agent log" "$WORK/agent.log"
    row b1 "both services started (the second evicted the first)" "one running, one suspended" "m1 ${s1:-?}, m2 ${s2:-?}" FAIL
    exit 1
fi

# The first answer of m2 is its reference (nothing of m2 ran before).
REF2=$(fetch "http://127.0.0.1:$LP2/generate?prompt=$QPROMPT&n=$TOKENS" | tail -n +2)
[ -n "$REF1" ] || REF1=$(fetch "http://127.0.0.1:$LP1/generate?prompt=$QPROMPT&n=$TOKENS" | tail -n +2)

# (c-a) a running model: m2 is resident now.
: >"$WORK/run.ttfb"
for _ in 1 2 3 4 5; do
    fetch "http://127.0.0.1:$LP2/generate?prompt=$QPROMPT&n=$TOKENS" | head -1 | awk '{ print $1 }' >>"$WORK/run.ttfb"
done
run_ttfb=$(median <"$WORK/run.ttfb")

read -r sus0 susn0 <<<"$(metric_sum suspend)"
read -r res0 resn0 <<<"$(metric_sum resume)"
: >"$WORK/swap.ttfb"
bad=0
for i in $(seq 1 "$SWAPS"); do
    if [ $((i % 2)) = 1 ]; then n=m1 port=$LP1 ref=$REF1; else n=m2 port=$LP2 ref=$REF2; fi
    if [ $((SECONDS)) -gt "$BUDGET" ]; then
        row "b2.$i" "request $i to $n" "answered" "budget spent" SKIP
        continue
    fi
    res=$(fetch "http://127.0.0.1:$port/generate?prompt=$QPROMPT&n=$TOKENS")
    t=$(head -1 <<<"$res")
    body=$(tail -n +2 <<<"$res")
    ttfb=${t%% *}
    echo "$ttfb" >>"$WORK/swap.ttfb"
    # The process's own answer from before any suspension (model_server.py
    # computes it at start-up); the fake has none: then the first answer.
    own=$(fetch "http://127.0.0.1:$port/reference" | tail -n +2)
    if [ -n "$own" ]; then
        [ "$n" = m1 ] && [ -n "$REF1" ] && [ "$own" != "$REF1" ] && XPROC="m1's reference differs from the cold-start process's (same seed)"
        ref=$own
    fi
    if [ -n "$ref" ] && [ "$body" = "$ref" ]; then
        row "b2.$i" "request $i to $n (swap)" "the reference answer" "same ($(wc -w <<<"$body") tokens)" PASS "ttfb ${ttfb}s"
    else
        bad=1
        row "b2.$i" "request $i to $n (swap)" "the reference answer" "$(head -c 60 <<<"$body") (http ${t##* })" FAIL "ttfb ${ttfb}s"
    fi
done
read -r sus1 susn1 <<<"$(metric_sum suspend)"
read -r res1 resn1 <<<"$(metric_sum resume)"
swaps=$(calc %d 'b - a' a="$resn0" b="$resn1")
swap_ttfb=$(median <"$WORK/swap.ttfb")
if [ "$swaps" -gt 0 ]; then
    sus_avg=$(calc %.3f '(b - a) / n' a="$sus0" b="$sus1" n="$(calc %d 'b - a' a="$susn0" b="$susn1")")
    res_avg=$(calc %.3f '(b - a) / n' a="$res0" b="$res1" n="$swaps")
else
    sus_avg="?" res_avg="?"
fi
[ "$bad" = 0 ] && log "every answer was the reference"

# ---------------------------------------------------------------- (c) the table
row c1 "ttfb, request to the running model" "-" "${run_ttfb}s" INFO "${run_ttfb}s"
row c2 "ttfb, request to the suspended model (swap)" "< cold start" "${swap_ttfb}s (cold ${cold_s:-?}s)" \
    "$( [ -n "$cold_s" ] && fle "$swap_ttfb" "$cold_s" && echo PASS || echo FAIL)" "${swap_ttfb}s"
row c3 "suspend(other) + resume(this), agent metrics" "-" "suspend ${sus_avg}s + resume ${res_avg}s over $swaps swaps" INFO
if [ "$sus_avg" != "?" ]; then
    over=$(calc %.3f 's - a - b' s="$swap_ttfb" a="$sus_avg" b="$res_avg")
    row c4 "swap ttfb - (suspend + resume)" "<= 0.100 s (+ one run of the request)" "${over}s" INFO "${over}s"
fi
row c5 "cold start of the same server" "-" "${cold_s:-?}s" INFO "${cold_s:-?}s"
row c6 "answers of m1 against the cold-start process (same seed)" "(information: greedy decoding over random weights need not repeat across processes)" "${XPROC:-same}" INFO

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
        "$(fle "$add_ms" 1 && echo PASS || echo FAIL)" "+${add_ms} ms"
else
    row d1 "proxy overhead p50" "<= 1 ms added" "not measured" FAIL
fi
log_file "agent log" "$WORK/agent.log"
exit 0
