#!/usr/bin/env bash
# The agent under floods, against the fakes (no GPU): three fake model
# servers behind `gpusnap agent`, run under a low open-file limit (prlimit),
# and three floods on loopback, each bounded in count and time: silent
# connections on one service's port, half-sent requests on the metrics
# port, and concurrent requests on a port. During each flood the script
# asks every service and the API once a second; it prints a markdown table:
# per flood, the answers (200), refusals (503 or closed) and failures of
# the flooded service, the others and the API, the agent's descriptors at
# their most, the warnings it logged, and whether anything was restarted.
#
#   bench/cpu/agent-flood.sh
#   NOFILE=64 SILENT=700 HALF=1100 CONCURRENT=80 SECONDS_EACH=10 bench/cpu/agent-flood.sh
#
# Environment:
#   GPUSNAP      the agent (default target/$PROFILE/gpusnap, built first
#                unless SKIP_BUILD=1); libgpusnap_preload.so next to it
#   PROFILE      debug (default) or release
#   NOFILE       the agent's open-file limit, soft and hard (1024)
#   SILENT, HALF, CONCURRENT   the floods' sizes (700, 1100, 80)
#   SECONDS_EACH how long each flood is held (10)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=bench/cpu/lib.sh
. bench/cpu/lib.sh
record_self agent-flood "$@"

agent_bench_setup floodbench

python3 - "$work" "$GPUSNAP" "${NOFILE:-1024}" "${SILENT:-700}" "${HALF:-1100}" "${CONCURRENT:-80}" \
    "${SECONDS_EACH:-10}" <<'PY'
import json, os, resource, socket, subprocess, sys, threading, time

sys.path.insert(0, "bench/cpu")
from bench_agent import api_raw, free_port, stop_agent

work, binary, nofile, silent, half, concurrent, each = sys.argv[1:8]
nofile, silent, half, concurrent, each = int(nofile), int(silent), int(half), int(concurrent), float(each)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
fw = os.path.join(work, "lib", "fake-workload")


def api(sock, path):
    head, body = api_raw(sock, path, 10)
    return int(head.split()[1]), body


def ask(port):
    """'ok' (200), 'refused' (503, or closed unanswered) or 'failed' (no answer in 10 s)."""
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = s.recv(64)
        s.close()
    except socket.timeout:
        return "failed"
    except OSError:
        return "refused"
    if data.startswith(b"HTTP/1.1 200"):
        return "ok"
    return "refused"


def ask_api(sock):
    try:
        return "ok" if api(sock, "/v1/services")[0] == 200 else "refused"
    except socket.timeout:
        return "failed"
    except (OSError, ValueError, IndexError):
        return "refused"


d = os.path.join(work, "run")
fake, state = os.path.join(d, "fake"), os.path.join(d, "state")
os.makedirs(fake)
os.makedirs(state)
with open(os.path.join(fake, "config.json"), "w") as f:
    json.dump({"gpus": [{"name": "NVIDIA H200 (fake)", "total_mib": 4000}]}, f)
sock = os.path.join(d, "agent.sock")
metrics_port = free_port()
ports = [(free_port(), free_port()) for _ in range(3)]
cfg = f'[agent]\nsocket = "{sock}"\nmetrics_listen = "127.0.0.1:{metrics_port}"\nheader_timeout = "2s"\n'
for i, (lp, bp) in enumerate(ports):
    cfg += (f'\n[[service]]\nname = "m{i + 1}"\nlisten = "127.0.0.1:{lp}"\nbackend = "127.0.0.1:{bp}"\n'
            f'command = ["{fw}", "--mib", "100", "--http", "{bp}"]\nsuspend_after = "never"\n'
            f'max_connections = 64\n')
with open(os.path.join(d, "agent.toml"), "w") as f:
    f.write(cfg)
env = dict(os.environ, LD_LIBRARY_PATH=os.path.join(work, "lib"), GPUSNAP_FAKE_DIR=fake)
logpath = os.path.join(d, "agent.log")
log = open(logpath, "w")
agent = subprocess.Popen(["prlimit", f"--nofile={nofile}:{nofile}", "--", binary, "--state-dir", state, "agent",
                          "--config", os.path.join(d, "agent.toml")], env=env, stdout=log, stderr=subprocess.STDOUT)


def services():
    return {s["name"]: s for s in json.loads(api(sock, "/v1/services")[1])}


def fds():
    try:
        return len(os.listdir(f"/proc/{agent.pid}/fd"))
    except OSError:
        return -1


rows = []
try:
    end = time.time() + 120
    while True:
        try:
            if all(s["state"] == "running" for s in services().values()):
                break
        except (OSError, ValueError, KeyError):
            pass
        if time.time() > end or agent.poll() is not None:
            raise SystemExit(f"the services never ran (see {logpath})")
        time.sleep(0.1)
    before = {n: (s["pid"], s["restarts"]) for n, s in services().items()}
    flooded = ports[0][0]

    def silent_flood(stop):
        held = []
        for _ in range(silent):
            try:
                held.append(socket.create_connection(("127.0.0.1", flooded), timeout=5))
            except OSError:
                pass
        stop.wait()
        for s in held:
            s.close()

    def half_flood(stop):
        held = []
        for _ in range(half):
            try:
                s = socket.create_connection(("127.0.0.1", metrics_port), timeout=5)
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
                held.append(s)
            except OSError:
                pass
        stop.wait()
        for s in held:
            s.close()

    def concurrent_flood(stop):
        def one():
            while not stop.is_set():
                ask(flooded)
        ts = [threading.Thread(target=one) for _ in range(concurrent)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    for name, flood, size in [("silent connections", silent_flood, silent),
                              ("half-sent requests (metrics)", half_flood, half),
                              ("concurrent requests", concurrent_flood, concurrent)]:
        stop = threading.Event()
        warned0 = sum(1 for l in open(logpath, errors="replace") if "WARN" in l)
        t = threading.Thread(target=flood, args=(stop,))
        t.start()
        tally = {"flooded": {}, "others": {}, "api": {}}
        peak = 0
        t_end = time.time() + each
        while time.time() < t_end:
            for who, port in [("flooded", flooded), ("others", ports[1][0]), ("others", ports[2][0])]:
                r = ask(port)
                tally[who][r] = tally[who].get(r, 0) + 1
            r = ask_api(sock)
            tally["api"][r] = tally["api"].get(r, 0) + 1
            peak = max(peak, fds())
            time.sleep(1)
        stop.set()
        t.join()
        warned = sum(1 for l in open(logpath, errors="replace") if "WARN" in l) - warned0
        now = {n: (s["pid"], s["restarts"]) for n, s in services().items()}
        rows.append((name, size, tally, peak, warned, now == before, agent.poll() is None))
finally:
    stop_agent(agent, state)


def cell(t):
    return f'{t.get("ok", 0)} / {t.get("refused", 0)} / {t.get("failed", 0)}'


print(f"Agent open-file limit {nofile}; 3 services (max_connections = 64), header_timeout 2 s; each flood held "
      f"{each:.0f} s while every service and the API were asked once a second. Cells: answered (200) / refused "
      f"(503 or closed at once) / no answer within 10 s.\n")
print("| flood | size | flooded service | other services | API | agent fds at most | warnings logged | "
      "restarts or new pids | agent alive |")
print("|---|---|---|---|---|---|---|---|---|")
for name, size, tally, peak, warned, same, alive in rows:
    print(f"| {name} | {size} | {cell(tally['flooded'])} | {cell(tally['others'])} | {cell(tally['api'])} | "
          f"{peak} | {warned} | {'none' if same else 'YES'} | {'yes' if alive else 'NO'} |")
PY
