"""Helpers of the agent bench scripts (agent-flood.sh, agent-swap.sh,
front-door.sh, sockwake.sh): their Python, run from the repository root, imports
this file as `bench_agent` (bench/cpu/ on sys.path)."""

import json, os, signal, socket, subprocess


def free_port():
    """A loopback port free now."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def recv_all(s):
    """Everything socket `s` receives until its peer closes (bytes)."""
    data = b""
    while True:
        b = s.recv(65536)
        if not b:
            return data
        data += b


def api_raw(sock, path, timeout):
    """GET `path` on the agent's unix socket `sock`: the answer's head and body (bytes)."""
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(timeout)
    s.connect(sock)
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n".encode())
    head, _, body = recv_all(s).partition(b"\r\n\r\n")
    return head, body


def dechunk(body):
    """The data of a chunked body (bytes)."""
    out, rest = b"", body
    while rest:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size.strip() or b"0", 16)
        if n == 0:
            break
        out, rest = out + rest[:n], rest[n + 2:]
    return out


def stop_agent(agent, state):
    """Ends the agent (SIGTERM) and then the servers it last recorded in the
    state directory `state`: they run in sessions of their own and outlive it."""
    agent.send_signal(signal.SIGTERM)
    agent.wait()
    try:
        recs = json.load(open(os.path.join(state, "agent", "services.json")))
    except (OSError, ValueError):
        recs = {}
    for r in recs.values():
        for k in ("runner", "pid"):
            if r.get(k):
                try:
                    os.kill(r[k], signal.SIGKILL)
                except OSError:
                    pass


def start_fake_agent(work, binary, config):
    """Starts `gpusnap agent` (`binary`) against the fakes of lib.sh's
    agent_bench_setup (`work`/lib), a fake GPU of 1000 MiB (`work`/fake) and
    the state directory `work`/state; its configuration `work`/agent.toml is
    `[agent]`, its socket `work`/agent.sock, then `config` (the rest of the
    file); its output goes to `work`/agent.log. Returns (the agent's Popen,
    the socket's path, the state directory)."""
    fake, state = os.path.join(work, "fake"), os.path.join(work, "state")
    os.makedirs(fake)
    os.makedirs(state)
    with open(os.path.join(fake, "config.json"), "w") as f:
        json.dump({"gpus": [{"name": "NVIDIA H200 (fake)", "total_mib": 1000}]}, f)
    sock = os.path.join(work, "agent.sock")
    with open(os.path.join(work, "agent.toml"), "w") as f:
        f.write(f'[agent]\nsocket = "{sock}"\n' + config)
    env = dict(os.environ, LD_LIBRARY_PATH=os.path.join(work, "lib"), GPUSNAP_FAKE_DIR=fake)
    log = open(os.path.join(work, "agent.log"), "w")
    agent = subprocess.Popen([binary, "--state-dir", state, "agent", "--config", os.path.join(work, "agent.toml")],
                             env=env, stdout=log, stderr=subprocess.STDOUT)
    return agent, sock, state
