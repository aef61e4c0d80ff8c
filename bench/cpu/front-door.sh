#!/usr/bin/env bash
# What the agent's front door adds to a request's latency, against the fakes
# (no GPU): one fake model server (`fake-workload --http`) behind `gpusnap
# agent`, asked the same POST (a JSON body naming its model) directly, through
# its own port (the TCP proxy) and through the front door (`http_listen`,
# routed by the body's model). One client, keep-alive, one request at a time;
# the service stays running (no wake in the measure). Prints a markdown table
# of p50 and p99 per path and what each adds to the direct one.
#
#   bench/cpu/front-door.sh
#   REQS=5000 PROFILE=release bench/cpu/front-door.sh
#
# Environment:
#   GPUSNAP   the agent to measure (default target/$PROFILE/gpusnap, built
#             first unless SKIP_BUILD=1)
#   PROFILE   debug (default) or release, for the build and the fakes
#   REQS      requests per path (2000), after 200 unmeasured
# Times are of this machine (a debug build on a loaded 2-core VM is slow):
# compare the rows of one run, not runs of machines.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=bench/cpu/lib.sh
. bench/cpu/lib.sh
record_self front-door "$@"

REQS=${REQS:-2000}
agent_bench_setup doorbench

python3 - "$work" "$REQS" "$GPUSNAP" "$PROFILE" <<'PY'
import http.client, json, os, socket, sys, time

sys.path.insert(0, "bench/cpu")
from bench_agent import free_port, start_fake_agent, stop_agent

work, reqs, binary, profile = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
fw = os.path.join(work, "lib", "fake-workload")

door, listen, backend = free_port(), free_port(), free_port()
agent, sock, state = start_fake_agent(
    work, binary,
    f'http_listen = "127.0.0.1:{door}"\n'
    f'\n[[service]]\nname = "m"\nmodels = ["bench-model"]\nlisten = "127.0.0.1:{listen}"\n'
    f'backend = "127.0.0.1:{backend}"\ncommand = ["{fw}", "--mib", "1", "--http", "{backend}"]\n'
    f'suspend_after = "never"\n')
body = json.dumps({"model": "bench-model", "prompt": "hello", "max_tokens": 1})
headers = {"Content-Type": "application/json"}


def measure(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.connect()
    # As HTTP clients do: no request waits on a delayed ACK (Nagle).
    c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    times = []
    for i in range(reqs + 200):
        t0 = time.perf_counter()
        c.request("POST", "/v1/completions", body, headers)
        r = c.getresponse()
        data = r.read()
        t = time.perf_counter() - t0
        if r.status != 200 or not json.loads(data)["choices"][0]["text"].startswith("ok "):
            raise SystemExit(f"bad answer on {port}: {r.status} {data[:80]!r}")
        if i >= 200:
            times.append(t)
    c.close()
    times.sort()
    return times[len(times) // 2], times[min(len(times) - 1, int(len(times) * 0.99))]


try:
    end = time.time() + 120
    while True:
        try:
            socket.create_connection(("127.0.0.1", backend), timeout=1).close()
            socket.create_connection(("127.0.0.1", door), timeout=1).close()
            break
        except OSError:
            if time.time() > end or agent.poll() is not None:
                raise SystemExit(f"the service never came up (see {work}/agent.log)")
            time.sleep(0.1)
    rows = [("direct (the server's port)", measure(backend)), ("the service's own port (TCP proxy)", measure(listen)),
            ("the front door (routed by model)", measure(door))]
finally:
    stop_agent(agent, state)

d50, d99 = rows[0][1]
print(f"Front door latency: {reqs} POSTs per path, one keep-alive client, {profile} build, "
      f"{os.cpu_count()} CPUs; target: the front door adds at most 1 ms.\n")
print("| path | p50 ms | p99 ms | added p50 ms | added p99 ms |")
print("|---|---:|---:|---:|---:|")
for name, (p50, p99) in rows:
    print(f"| {name} | {p50 * 1e3:.3f} | {p99 * 1e3:.3f} | {(p50 - d50) * 1e3:+.3f} | {(p99 - d99) * 1e3:+.3f} |")
PY
