# A tenant's pod on a node shared by tenants, for crates/cli/tests/tenants.rs:
# run by `unshare --pid --net --mount --uts --fork` as root (a pod without a
# user namespace), it sees the node as a pod does (its own pid and network
# namespaces, its own /proc, the agent's admin directory not mounted, the
# probe directory mounted read-only), starts its own CUDA server (the fake
# workload) and tries what a hostile tenant would. It prints one JSON object.
import json
import os
import socket
import subprocess
import sys
import time

probe_dir, admin_dir, hostproc, workload, gpusnap, other_pid = sys.argv[1:7]
probe_sock = os.path.join(probe_dir, "probe.sock")
admin_sock = os.path.join(admin_dir, "agent.sock")


def sh(*args):
    subprocess.run(args, check=True)


# The fake driver knows processes by their host pids, as the kernel's does:
# it reads the host's /proc (GPUSNAP_FAKE_PROC); everything else the pod's own.
os.makedirs(hostproc, exist_ok=True)
sh("mount", "--make-rprivate", "/")
sh("mount", "--bind", "/proc", hostproc)
sh("mount", "-t", "proc", "proc", "/proc")
sh("mount", "-t", "tmpfs", "tmpfs", admin_dir)
sh("mount", "--bind", probe_dir, probe_dir)
sh("mount", "-o", "remount,bind,ro", probe_dir)
sh("ip", "link", "set", "lo", "up")
env = dict(os.environ, GPUSNAP_FAKE_PROC=hostproc)
server = subprocess.Popen([workload, "--mib", "64", "--gpu", "0", "--http", "8000"], env=env)


def listening():
    try:
        socket.create_connection(("127.0.0.1", 8000), timeout=1).close()
        return True
    except OSError:
        return False


end = time.monotonic() + 60
while not listening() and time.monotonic() < end:
    time.sleep(0.05)


def request(path_to, method, path):
    try:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(60)
        s.connect(path_to)
    except OSError as e:
        return {"status": 0, "error": e.strerror}
    s.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 0\r\n\r\n".encode())
    data = b""
    while True:
        b = s.recv(65536)
        if not b:
            break
        data += b
    head, _, body = data.partition(b"\r\n\r\n")
    return {"status": int(head.split()[1]), "body": body.decode(errors="replace")}


def attempt(f):
    try:
        f()
        return "done"
    except OSError as e:
        return e.strerror


r = {"server": server.pid}
r["suspend_other"] = request(probe_sock, "POST", "/v1/services/a/suspend")
r["restart_other"] = request(probe_sock, "POST", "/v1/services/b/restart")
r["services"] = request(probe_sock, "GET", "/v1/services")
r["events"] = request(probe_sock, "GET", "/v1/events?follow=false")
r["every_process"] = request(probe_sock, "GET", "/v1/processes")
r["own_tree"] = request(probe_sock, "GET", "/v1/processes?tree=1")
r["other_tree"] = request(probe_sock, "GET", f"/v1/processes?tree={other_pid}")
r["admin"] = request(admin_sock, "POST", "/v1/services/b/restart")
r["unlink"] = attempt(lambda: os.unlink(probe_sock))
r["rename"] = attempt(lambda: os.rename(probe_sock, probe_sock + ".old"))


def bind_own():
    s = socket.socket(socket.AF_UNIX)
    s.bind(os.path.join(probe_dir, "impostor.sock"))


r["bind"] = attempt(bind_own)
p = subprocess.run(
    [gpusnap, "--json", "probe", "--pid", str(server.pid), "--port", "8000", "--socket", probe_sock],
    env=env, capture_output=True, text=True,
)
r["probe"] = {"code": p.returncode, "stdout": p.stdout, "stderr": p.stderr}
server.kill()
server.wait()
print(json.dumps(r))
