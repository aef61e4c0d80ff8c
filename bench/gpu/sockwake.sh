#!/usr/bin/env bash
# Wake on request without a proxy, on a GPU: a transformers model server in
# a network namespace of its own (`ip netns`, a veth pair: the node is
# 10.232.0.1, the namespace 10.232.0.2), as a pod is. Two services of one
# agent, each such a server: `sock` with wake_on = "socket" (clients connect
# to the server's own port; the agent watches it through sock_diag in the
# namespace) and `prox` with wake_on = "proxy" (clients connect to the
# agent's proxy on the node, which connects to the server). For each: the
# TTFB of a request to the running server, then RUNS times: suspend it
# (API), then the TTFB of a request to the suspended server, and the time
# from the client's connect() to the agent's "resume started" (its log).
#
# Run from the repository root, as root:
#   OUT=/some/dir bench/gpu/sockwake.sh
# Environment:
#   GPUSNAP        the binary (default ./target/release/gpusnap)
#   OUT            results directory (default: a new /tmp/gpusnap-out.* dir)
#   SW_WEIGHTS_GB  weights per server (2) and SW_KV_GB its KV cache (2)
#   SW_RUNS        suspended requests per mode (3); SW_TOKENS new tokens (8)
#   SW_BACKEND     model_server.py's backend (auto: transformers if importable)
#   SW_SERVER=fake a dry run without a GPU: fake-workload --http against the
#                  fake driver (FAKE_WORKLOAD, the fakes on LD_LIBRARY_PATH,
#                  GPUSNAP_FAKE_DIR; see docs/design/fakes.md)
# Writes $OUT/sockwake-bench.md (also printed) and $OUT/sockwake-bench.log.
# Exit 0 when every check passed (the speed target is reported, met or not
# met, not enforced), 1 otherwise.

NAME=sockwake-bench # read by lib.sh
# shellcheck source=tests/gpu/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/../../tests/gpu/lib.sh"

WEIGHTS_GB=${SW_WEIGHTS_GB:-2}
KV_GB=${SW_KV_GB:-2}
RUNS=${SW_RUNS:-3}
TOKENS=${SW_TOKENS:-8}
BACKEND=${SW_BACKEND:-auto}
SERVER=${SW_SERVER:-torch}
NS=gsw-bench-$$
HOST_IF=gswb$$
NODE=10.232.0.1
POD=10.232.0.2
SOCK=$WORK/agent.sock
REPORT=$OUT/sockwake-bench.md
ROWS=$WORK/rows.tsv
: >"$ROWS"
NPASS=0 NFAIL=0 NSKIP=0 NINFO=0
AGENT_PID=""
SP=18001 # the socket-woken server's port (in the namespace)
BP=18002 # the proxied server's port (in the namespace)
LP=18003 # the proxy's port (on the node)

api() { # METHOD PATH
    curl -s --max-time 300 --unix-socket "$SOCK" -X "$1" "http://agent$2"
}

svc_state() {
    api GET "/v1/services/$1" | python3 -c 'import json,sys; print(json.load(sys.stdin)["state"])' 2>/dev/null
}

wait_state() { # NAME STATE TIMEOUT_S
    local end=$((SECONDS + $3))
    while [ "$(svc_state "$1")" != "$2" ]; do
        [ "$SECONDS" -lt "$end" ] || return 1
        sleep 0.1
    done
}

# suspend NAME: suspended through the API, asked again while the agent
# refuses (409: the last request's answer not seen yet) or a late
# connection resumed it; bounded (300 s).
suspend() {
    local end=$((SECONDS + 300))
    while [ "$SECONDS" -lt "$end" ]; do
        api POST "/v1/services/$1/suspend" >/dev/null
        wait_state "$1" suspended 5 && return 0
    done
    return 1
}

server_cmd() { # PORT SEED -> a TOML array, run inside the namespace
    if [ "$SERVER" = fake ]; then
        printf '["ip", "netns", "exec", "%s", "%s", "--mib", "256", "--http", "%s", "--http-host", "%s"]' \
            "$NS" "${FAKE_WORKLOAD:?set FAKE_WORKLOAD for SW_SERVER=fake}" "$1" "$POD"
    else
        printf '["ip", "netns", "exec", "%s", "python3", "%s/model_server.py", "--host", "%s", "--port", "%s", "--seed", "%s", "--weights-gb", "%s", "--kv-gb", "%s", "--backend", "%s", "--ref-n", "%s"]' \
            "$NS" "$GPU_DIR" "$POD" "$1" "$2" "$WEIGHTS_GB" "$KV_GB" "$BACKEND" "$TOKENS"
    fi
}

path_q() { # the request each TTFB is of
    if [ "$SERVER" = fake ]; then echo "/"; else echo "/generate?prompt=hello&n=$TOKENS"; fi
}

# ttfb HOST PORT: "CONNECT_UNIX_US TTFB_S HTTP_CODE" of one request.
ttfb() {
    python3 - "$1" "$2" "$(path_q)" <<'PY'
import socket, sys, time
host, port, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
t0 = time.time()
c = socket.create_connection((host, port), timeout=600)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
c.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
first = c.recv(1)
t1 = time.time()
rest = first
while True:
    b = c.recv(65536)
    if not b:
        break
    rest += b
code = rest.split(b" ")[1].decode() if rest.startswith(b"HTTP/") else "000"
print(int(t0 * 1e6), f"{t1 - t0:.4f}", code)
PY
}

# resume_start NAME N: the agent's N-th (1-based) "resume started" of NAME, unix µs.
resume_start() {
    sed 's/\x1b\[[0-9;]*m//g' "$WORK/agent.log" | grep 'resume started' | grep -E "service=\"?$1\"? " |
        sed -n "$2p" | sed -E 's/.*at_unix_us=([0-9]+).*/\1/'
}

resume_count() {
    sed 's/\x1b\[[0-9;]*m//g' "$WORK/agent.log" | grep 'resume started' | grep -cE "service=\"?$1\"? " || true
}

# shellcheck disable=SC2317 # runs from the EXIT trap
on_exit() {
    local rc=$?
    if [ -n "$AGENT_PID" ] && alive "$AGENT_PID"; then
        kill -TERM "$AGENT_PID" 2>/dev/null
        wait "$AGENT_PID" 2>/dev/null
    fi
    cleanup_all
    ip link del "$HOST_IF" 2>/dev/null
    ip netns del "$NS" 2>/dev/null
    {
        echo "# no-proxy wake benchmark"
        echo
        echo "$(date -u +%FT%TZ) $(hostname), $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
        echo "servers: $SERVER ($BACKEND), ${WEIGHTS_GB} GB weights + ${KV_GB} GB KV cache each, in network namespace $NS ($POD); $RUNS suspended requests per mode, $TOKENS tokens"
        echo
        rows_md id check expected got result figure
        echo
        echo "pass $NPASS, fail $NFAIL, skip $NSKIP, info $NINFO"
    } >"$REPORT"
    cat "$REPORT"
    [ "$NFAIL" = 0 ] && [ "$rc" = 0 ] && exit 0
    exit 1
}
install_traps
start_watchdog 900

ip netns add "$NS" &&
    ip link add "$HOST_IF" type veth peer name eth0 netns "$NS" &&
    ip addr add "$NODE/24" dev "$HOST_IF" && ip link set "$HOST_IF" up &&
    ip -n "$NS" addr add "$POD/24" dev eth0 && ip -n "$NS" link set eth0 up && ip -n "$NS" link set lo up
if [ $? != 0 ]; then
    row n0 "a network namespace with a veth pair" "made" "ip netns failed (root and iproute2?)" FAIL
    exit 1
fi
row n0 "a network namespace with a veth pair" "made" "$NS: $POD, node $NODE" PASS

cat >"$WORK/agent.toml" <<TOML
[agent]
socket = "$SOCK"

[[service]]
name = "sock"
wake_on = "socket"
backend = "$POD:$SP"
# The client of this bench is on the node: nothing is ignored.
ignore_peers = []
command = $(server_cmd "$SP" 1)
suspend_after = "never"
wake_timeout = "300s"

[[service]]
name = "prox"
listen = "$NODE:$LP"
backend = "$POD:$BP"
command = $(server_cmd "$BP" 2)
suspend_after = "never"
wake_timeout = "300s"
TOML
log_file "agent.toml" "$WORK/agent.toml"
"$GPUSNAP" --state-dir "$STATE_DIR" agent --config "$WORK/agent.toml" >>"$WORK/agent.log" 2>&1 &
AGENT_PID=$!

for s in sock prox; do
    if ! wait_state "$s" running 600; then
        log_file "agent.log" "$WORK/agent.log"
        row "a0.$s" "service $s starts in the namespace" "running" "$(svc_state "$s")" FAIL
        exit 1
    fi
    p=$(api GET "/v1/services/$s" | python3 -c 'import json,sys; print(json.load(sys.stdin)["pid"] or "")')
    [ -n "$p" ] && WORKERS+=("$p")
done
row a0 "both servers start in the namespace" "running" "sock, prox" PASS

for mode in sock prox; do
    if [ "$mode" = sock ]; then host=$POD port=$SP; else host=$NODE port=$LP; fi
    read -r _ t code <<<"$(ttfb "$host" "$port")"
    row "b1.$mode" "ttfb to the running server ($mode)" "200" "$code" "$([ "$code" = 200 ] && echo PASS || echo FAIL)" "${t}s"
    starts=() ttfbs=()
    for i in $(seq 1 "$RUNS"); do
        if ! suspend "$mode"; then
            row "b2.$mode.$i" "suspend $mode" "suspended" "$(svc_state "$mode")" FAIL
            continue
        fi
        sleep 0.2
        n=$(($(resume_count "$mode") + 1))
        read -r t0 t code <<<"$(ttfb "$host" "$port")"
        st=$(resume_start "$mode" "$n")
        d=$([ -n "$st" ] && calc %.4f '(s - c) / 1e6' s="$st" c="$t0" || echo "?")
        row "b2.$mode.$i" "request $i to the suspended server ($mode)" "200" "$code" \
            "$([ "$code" = 200 ] && echo PASS || echo FAIL)" "ttfb ${t}s, connect -> resume start ${d}s"
        starts+=("$d") ttfbs+=("$t")
    done
    med_s=$(printf '%s\n' "${starts[@]}" | grep -v '?' | sort -g | awk '{v[NR]=$1} END {print (NR ? v[int((NR+1)/2)] : "?")}')
    med_t=$(printf '%s\n' "${ttfbs[@]}" | sort -g | awk '{v[NR]=$1} END {print (NR ? v[int((NR+1)/2)] : "?")}')
    if [ "$mode" = sock ]; then
        met="not met"
        [ "$med_s" != "?" ] && fle "$med_s" 0.005 && met=met
        row "c1.$mode" "connect -> resume start, median (wake_on = socket)" "<= 0.005 s" "${med_s}s: $met" INFO "${med_s}s"
    else
        row "c1.$mode" "connect -> resume start, median (wake_on = proxy)" "-" "${med_s}s" INFO "${med_s}s"
    fi
    row "c2.$mode" "ttfb of a request to the suspended server, median ($mode)" "-" "${med_t}s" INFO "${med_t}s"
done
log_file "agent.log" "$WORK/agent.log"
FINISHED=1
