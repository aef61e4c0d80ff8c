#!/usr/bin/env bash
# How soon a request to a suspended model server starts its resume, without
# a proxy (wake_on = "socket": the agent sees the connection on the server's
# own port through sock_diag) and through the proxy (wake_on = "proxy"),
# against the fakes (no GPU). One agent, two fake servers (`fake-workload
# --http`), one of each kind. Each run suspends a service through the API,
# then a client connects and sends a GET; the time is from just before the
# client's connect() to the agent's "resume started" (its wall-clock time in
# the agent's log), and the whole request's time to its answer is printed
# beside it. Prints a markdown table of p50 and p99 per mode.
#
#   bench/cpu/sockwake.sh
#   RUNS=200 PROFILE=release bench/cpu/sockwake.sh
#
# Environment:
#   GPUSNAP   the agent to measure (default target/$PROFILE/gpusnap, built
#             first unless SKIP_BUILD=1)
#   PROFILE   debug (default) or release, for the build and the fakes
#   RUNS      wakes per mode (50), the modes taking turns
#   POLL      the socket watch's interval while suspended (socket_poll, 1ms)
# Times are of this machine (a loaded 2-core VM adds its scheduling): compare
# the rows of one run. Target: the socket watch starts the resume within
# 5 ms (p50) of the connect().
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=bench/cpu/lib.sh
. bench/cpu/lib.sh
record_self sockwake "$@"

RUNS=${RUNS:-50}
POLL=${POLL:-1ms}
agent_bench_setup sockwake

python3 - "$work" "$RUNS" "$GPUSNAP" "$PROFILE" "$POLL" <<'PY'
import json, os, re, socket, sys, time

sys.path.insert(0, "bench/cpu")
from bench_agent import free_port, recv_all, start_fake_agent, stop_agent

work, runs, binary, profile, poll = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
fw = os.path.join(work, "lib", "fake-workload")

sport, listen, backend = free_port(), free_port(), free_port()
agent, sock, state = start_fake_agent(
    work, binary,
    f'\n[[service]]\nname = "socket"\nwake_on = "socket"\nbackend = "127.0.0.1:{sport}"\n'
    f'command = ["{fw}", "--mib", "64", "--http", "{sport}"]\nsuspend_after = "never"\n'
    f'socket_poll = "{poll}"\n'
    f'\n[[service]]\nname = "proxy"\nlisten = "127.0.0.1:{listen}"\nbackend = "127.0.0.1:{backend}"\n'
    f'command = ["{fw}", "--mib", "64", "--gpu", "0", "--http", "{backend}"]\nsuspend_after = "never"\n')
logpath = os.path.join(work, "agent.log")


def api(method, path):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(120)
    s.connect(sock)
    s.sendall(f"{method} {path} HTTP/1.1\r\nHost: a\r\nConnection: close\r\nContent-Length: 0\r\n\r\n".encode())
    data = recv_all(s)
    s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def state_of(name):
    try:
        code, body = api("GET", f"/v1/services/{name}")
    except OSError:  # the agent is not up yet
        return None
    if code != 200:
        return None
    return json.loads(body)["state"]


def wait_state(name, want, limit=120):
    end = time.time() + limit
    while state_of(name) != want:
        if time.time() > end or agent.poll() is not None:
            raise SystemExit(f"{name} never {want} (see {logpath})")
        time.sleep(0.02)


START = re.compile(r'resume started.*service="?(\w+)"?.*at_unix_us=(\d+)')


def starts(name):
    out = []
    with open(logpath, errors="replace") as f:
        for line in f:
            m = START.search(re.sub(r"\x1b\[[0-9;]*m", "", line))
            if m and m.group(1) == name:
                out.append(int(m.group(2)))
    return out


def one(name, port):
    suspend(name)
    # Let the watch settle on its fast interval before the client comes.
    time.sleep(0.05)
    before = len(starts(name))
    t0 = time.time()
    c = socket.create_connection(("127.0.0.1", port), timeout=120)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    c.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    data = recv_all(c)
    total = time.time() - t0
    c.close()
    if not data.startswith(b"HTTP/1.1 200"):
        raise SystemExit(f"bad answer from {name}: {data[:120]!r}")
    end = time.time() + 30
    while len(starts(name)) <= before:
        if time.time() > end:
            raise SystemExit(f"no 'resume started' for {name} in {logpath}")
        time.sleep(0.01)
    return starts(name)[before] / 1e6 - t0, total


def suspend(name):
    """Suspended through the API (again, if a late connection resumed it)."""
    for _ in range(20):
        code, body = api("POST", f"/v1/services/{name}/suspend")
        if code == 409:  # a request still in flight: it ends
            time.sleep(0.05)
            continue
        if code != 200:
            raise SystemExit(f"suspend {name}: {code} {body[:200]!r}")
        end = time.time() + 10
        while time.time() < end:
            st = state_of(name)
            if st == "suspended":
                return
            if st == "running":
                break
            time.sleep(0.01)
    view = api("GET", f"/v1/services/{name}")[1][:400]
    raise SystemExit(f"{name} never stayed suspended: {view!r} (see {logpath})")


def cpu_s(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cpu(name, secs=2.0):
    """The agent's CPU (share of one core) while `name` sits suspended."""
    suspend(name)
    c0, t0 = cpu_s(agent.pid), time.time()
    time.sleep(secs)
    return (cpu_s(agent.pid) - c0) / (time.time() - t0)


def pct(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, int(len(v) * p))]


try:
    for name in ("socket", "proxy"):
        wait_state(name, "running")
    for port in (sport, backend, listen):
        end = time.time() + 120
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.time() > end:
                    raise SystemExit(f"port {port} never answered (see {logpath})")
                time.sleep(0.1)
    suspend("proxy")
    cpu = idle_cpu("socket")
    res = {"socket": [], "proxy": []}
    for i in range(runs):
        order = [("socket", sport), ("proxy", listen)]
        if i % 2:
            order.reverse()
        for name, port in order:
            res[name].append(one(name, port))
finally:
    stop_agent(agent, state)

print(f"Socket wake: {runs} wakes per mode of a suspended fake server (64 MiB), one client, {profile} build, "
      f"{os.cpu_count()} CPUs, socket_poll {poll}; target: connect() to resume start p50 <= 5 ms "
      f"(wake_on = \"socket\").\n")
print(f"The agent's CPU while the socket-woken service sits suspended (a look every {poll}): "
      f"{cpu * 100:.1f} % of one core.\n")
print("| mode | connect -> resume start p50 ms | p99 ms | connect -> answer p50 ms | p99 ms |")
print("|---|---:|---:|---:|---:|")
for name, label in (("socket", 'wake_on = "socket" (no proxy)'), ("proxy", 'wake_on = "proxy"')):
    starts_ = [s for s, _ in res[name]]
    totals = [t for _, t in res[name]]
    print(f"| {label} | {pct(starts_, .5) * 1e3:.2f} | {pct(starts_, .99) * 1e3:.2f} | "
          f"{pct(totals, .5) * 1e3:.2f} | {pct(totals, .99) * 1e3:.2f} |")
PY
