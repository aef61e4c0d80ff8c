#!/usr/bin/env bash
# Where a swap's time goes, against the fakes (no GPU): two fake model
# servers (`fake-workload --http`) on a fake GPU that holds one, behind
# `gpusnap agent`; requests alternate, so each one swaps them (suspend the
# other, resume this one). Prints a markdown table: the ttfb of a swap
# against suspend + resume (the agent's transition metrics) and the running
# service's ttfb, and, for an agent that traces its swaps, the mean of each
# phase (gpusnap_agent_swap_phase_seconds, docs/design/agent.md).
#
#   bench/cpu/agent-swap.sh
#   BASE=/tmp/old/gpusnap SWAPS=20 NVML_PROCESS_LAG_MS=30 NVML_MEMORY_LAG_MS=60 bench/cpu/agent-swap.sh
#
# Environment:
#   GPUSNAP      the agent to measure (default target/$PROFILE/gpusnap, built
#                first unless SKIP_BUILD=1); its libgpusnap_preload.so must
#                lie next to it
#   BASE         another gpusnap binary (say, one built before a change): run
#                first, in the same conditions, as the "before" column
#   PROFILE      debug (default) or release, for the build and the fakes
#   SWAPS        alternating requests (10); MIB per server (600, on a fake GPU
#                of 1000 MiB); CKPT_GBPS (2) and RESTORE_GBPS (6): the fake
#                driver's copy speeds, which set suspend and resume times
#   NVML_PROCESS_LAG_MS, NVML_MEMORY_LAG_MS (0): the fake NVML reports a
#                checkpoint's release this late, in its process list and in
#                the GPU's used memory (docs/design/fakes.md), as a real NVML may
# Times are of the whole path on this machine (a debug build on a loaded
# 2-core VM is slow): compare columns of one run, not runs of machines.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=bench/cpu/lib.sh
. bench/cpu/lib.sh
record_self agent-swap "$@"

SWAPS=${SWAPS:-10}
MIB=${MIB:-600}
CKPT_GBPS=${CKPT_GBPS:-2}
RESTORE_GBPS=${RESTORE_GBPS:-6}
PLAG=${NVML_PROCESS_LAG_MS:-0}
MLAG=${NVML_MEMORY_LAG_MS:-0}
BASE=${BASE:-}
agent_bench_setup swapbench

python3 - "$work" "$SWAPS" "$MIB" "$CKPT_GBPS" "$RESTORE_GBPS" "$PLAG" "$MLAG" "$GPUSNAP" "$BASE" <<'PY'
import json, os, socket, statistics, subprocess, sys, time

sys.path.insert(0, "bench/cpu")
from bench_agent import api_raw, dechunk, free_port, stop_agent

work, swaps, mib, cg, rg, plag, mlag, after, base = sys.argv[1:10]
swaps, mib, plag, mlag = int(swaps), int(mib), int(plag), int(mlag)
fw = os.path.join(work, "lib", "fake-workload")
PHASES = ["decide", "admission", "pick", "evict_prep", "suspend", "release_wait", "memory_wait",
          "resume_prep", "wake", "resume", "ready", "connect", "first_byte"]


def api(sock, path):
    head, body = api_raw(sock, path, 30)
    if b"chunked" in head.lower():
        body = dechunk(body)
    return body.decode()


def ttfb(port):
    """Seconds from connect to the answer's first byte; the whole answer."""
    t0 = time.perf_counter()
    s = socket.create_connection(("127.0.0.1", port), timeout=120)
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    first = s.recv(1)
    t = time.perf_counter() - t0
    data = first
    while True:
        b = s.recv(65536)
        if not b:
            break
        data += b
    if not data.startswith(b"HTTP/1.1 200"):
        raise SystemExit(f"bad answer on {port}: {data[:80]!r}")
    return t


def metric(text, prefix):
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith(prefix))


def run(label, binary):
    d = os.path.join(work, label)
    fake, state = os.path.join(d, "fake"), os.path.join(d, "state")
    os.makedirs(fake)
    os.makedirs(state)
    with open(os.path.join(fake, "config.json"), "w") as f:
        json.dump({"gpus": [{"name": "NVIDIA H200 (fake)", "total_mib": 1000}], "checkpoint_gbps": float(cg),
                   "restore_gbps": float(rg), "nvml_process_lag_ms": plag, "nvml_memory_lag_ms": mlag}, f)
    sock = os.path.join(d, "agent.sock")
    ports = [(free_port(), free_port()) for _ in range(2)]
    cfg = f'[agent]\nsocket = "{sock}"\n'
    for i, (lp, bp) in enumerate(ports):
        cfg += (f'\n[[service]]\nname = "m{i + 1}"\nlisten = "127.0.0.1:{lp}"\nbackend = "127.0.0.1:{bp}"\n'
                f'command = ["{fw}", "--mib", "{mib}", "--http", "{bp}"]\nsuspend_after = "1h"\n'
                f'wake_timeout = "120s"\ngpu_memory = "{mib}MiB"\n')
    with open(os.path.join(d, "agent.toml"), "w") as f:
        f.write(cfg)
    env = dict(os.environ, LD_LIBRARY_PATH=os.path.join(work, "lib"), GPUSNAP_FAKE_DIR=fake)
    log = open(os.path.join(d, "agent.log"), "w")
    agent = subprocess.Popen([binary, "--state-dir", state, "agent", "--config", os.path.join(d, "agent.toml")],
                             env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        end = time.time() + 120
        while True:
            try:
                svcs = json.loads(api(sock, "/v1/services"))
                st = {s["name"]: s["state"] for s in svcs}
                if sorted(st.values()) == ["running", "suspended"]:
                    break
            except (OSError, ValueError):
                pass
            if time.time() > end or agent.poll() is not None:
                raise SystemExit(f"{label}: the services never settled (see {d}/agent.log)")
            time.sleep(0.1)
        port = {f"m{i + 1}": lp for i, (lp, _) in enumerate(ports)}
        running = [n for n, s in st.items() if s == "running"][0]
        run_ttfb = statistics.median(ttfb(port[running]) for _ in range(5))
        m0 = api(sock, "/metrics")
        times = []
        for i in range(swaps):
            svcs = {s["name"]: s["state"] for s in json.loads(api(sock, "/v1/services"))}
            target = [n for n, s in svcs.items() if s != "running"][0]
            times.append(ttfb(port[target]))
        time.sleep(0.5)  # the last trace is observed just after its first byte
        m1 = api(sock, "/metrics")
    finally:
        stop_agent(agent, state)

    def delta(prefix):
        return metric(m1, prefix) - metric(m0, prefix)

    def tr(kind):
        n = delta(f'gpusnap_agent_transition_duration_seconds_count{{kind="{kind}"}}')
        return delta(f'gpusnap_agent_transition_duration_seconds_sum{{kind="{kind}"}}') / n if n else float("nan")

    r = {"run": run_ttfb, "swap": statistics.median(times), "t_suspend": tr("suspend"), "t_resume": tr("resume"),
         "n": len(times)}
    traced = delta("gpusnap_agent_swap_seconds_count")
    if traced:
        r["traced"] = traced
        r["total"] = delta("gpusnap_agent_swap_seconds_sum") / traced
        for p in PHASES:
            if delta(f'gpusnap_agent_swap_phase_seconds_count{{phase="{p}"}}'):
                r[p] = delta(f'gpusnap_agent_swap_phase_seconds_sum{{phase="{p}"}}') / traced
        for e in ["admission", "refusal", "eviction", "release_poll", "memory_poll", "connect_retry"]:
            r["ev:" + e] = delta(f'gpusnap_agent_swap_events_total{{event="{e}"}}') / traced
    return r


cols = ([("before", base)] if base else []) + [("after" if base else "agent", after)]
res = [(label, run(label, b)) for label, b in cols]

ms = lambda v: "-" if v is None or v != v else f"{v * 1e3:.1f} ms"
print(f"fake GPU 1000 MiB, two servers of {mib} MiB, checkpoint {cg} GB/s, restore {rg} GB/s, "
      f"NVML release lag {plag} ms (process list) / {mlag} ms (used memory); {swaps} swaps; "
      f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
print()
print("| what | " + " | ".join(l for l, _ in res) + " |")
print("|---|" + "---|" * len(res))
row = lambda name, f: print(f"| {name} | " + " | ".join(f(r) for _, r in res) + " |")
row("ttfb, request to the running service (median of 5)", lambda r: ms(r["run"]))
row("ttfb of a swap (median)", lambda r: ms(r["swap"]))
row("suspend(other) + resume(this), transition metrics (means)",
    lambda r: f'{ms(r["t_suspend"])} + {ms(r["t_resume"])}')
row("**swap - (suspend + resume) - ttfb running** (agent-bench's c4)",
    lambda r: "**" + ms(r["swap"] - r["t_suspend"] - r["t_resume"] - r["run"]) + "**")
row("traced swaps: accept -> first byte (mean)", lambda r: ms(r.get("total")))
for p in PHASES:
    if any(p in r for _, r in res):
        row(f"phase `{p}`", lambda r, p=p: ms(r.get(p)) if "traced" in r else "-")
row("what the agent adds: total - suspend - resume - first_byte",
    lambda r: ms(r["total"] - r.get("suspend", 0) - r.get("resume", 0) - r.get("first_byte", 0))
    if "traced" in r else "-")
row("per swap: admissions / refusals / evictions / NVML reads (release, memory) / connect retries",
    lambda r: " / ".join(f'{r["ev:" + e]:.1f}' for e in
                         ["admission", "refusal", "eviction", "release_poll", "memory_poll", "connect_retry"])
    if "traced" in r else "-")
PY
