#!/usr/bin/env python3
"""GPU worker for the guard tests: like worker.py, and it dies on request.

Holds GIB GiB on the device with a known checksum and keeps computing on it.
After every pass it writes, atomically, one line to STATUS:
    <pid> <iteration> <1 if the checksum is intact else 0> <unix time>
When the file STATUS.die appears it dies the way the file says:
    segv         a real fault: ctypes.string_at(0) reads address 0 (SIGSEGV)
    abort        os.abort() (SIGABRT)
    os_exit:N    os._exit(N): exit_group(N), no clean-up
    sys_exit:N   sys.exit(N): interpreter finalization and atexit handlers,
                 then exit(N) -> exit_group(N)
A suffix picks the thread that dies: "@main" or "@thread" (the watcher
thread, which is not the main thread). Defaults: os_exit from the watcher
thread, the others from the main thread. sys_exit only works from the main
thread (from another one it ends that thread alone), so "@thread" is refused.
The main thread keeps running CUDA work while the watcher thread dies.
Just before the fatal act it writes STATUS.dying:
    <pid> <mode> <main|thread> <unix time>
STATUS.exit makes it exit with 3, as worker.py.

Every extra thread is a daemon: a non-daemon thread would keep sys.exit from
ending the interpreter (threading joins them first), and then no exit_group
would come at all.

Usage: dying_worker.py GIB STATUS [--threads N] [--interval S] [--no-setsid]
                       [--backend torch|driver]
  --threads N   N extra idle threads (their ids go to STATUS.tids)
  --interval S  pause between passes (default 0.05); 0: busy, the main
                thread is nearly always inside a CUDA call (the status file
                is then written every 50 ms)
  --no-setsid   stay in the caller's session (by default it starts its own,
                so a signal to the test script's process group never reaches
                a live CUDA process)
  --backend     torch (default): a PyTorch tensor of GIB GiB, summed each
                pass. driver: the CUDA driver API through ctypes (cuMemAlloc
                GIB GiB, 1 MiB of it written and read back each pass); needs
                no PyTorch, and runs against gpusnap's fake driver (dry runs).
A CUDA error does not end the process: it writes ok=0 and idles without
touching the GPU again (the test can still suspend it; see worker.py).
"""
import argparse
import ctypes
import os
import sys
import threading
import time

MODES = ("segv", "abort", "os_exit", "sys_exit")


def write_status(path, line):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(line)
    os.replace(tmp, path)


def idle():
    while True:
        time.sleep(1.0)


def parse_mode(text):
    """'os_exit:5@thread' -> ('os_exit', 5, 'thread'); raises ValueError."""
    text = text.strip()
    where = None
    if "@" in text:
        text, where = text.split("@", 1)
        if where not in ("main", "thread"):
            raise ValueError(f"bad thread {where!r}")
    name, _, arg = text.partition(":")
    if name not in MODES:
        raise ValueError(f"bad mode {name!r}")
    code = None
    if name in ("os_exit", "sys_exit"):
        code = int(arg) if arg else 1
    elif arg:
        raise ValueError(f"{name} takes no code")
    if where is None:
        where = "thread" if name == "os_exit" else "main"
    if name == "sys_exit" and where == "thread":
        raise ValueError("sys_exit ends the process only from the main thread")
    return name, code, where


def die(status, mode, code, where):
    write_status(status + ".dying", f"{os.getpid()} {mode}{'' if code is None else ':' + str(code)} "
                                    f"{where} {time.time():.3f}\n")
    print(f"worker dying: {mode} code={code} from the {where} thread", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    if mode == "segv":
        ctypes.string_at(0)
    elif mode == "abort":
        os.abort()
    elif mode == "os_exit":
        os._exit(code)
    elif mode == "sys_exit":
        sys.exit(code)
    # string_at(0) returned: no fault (should not happen); end anyway.
    print("worker: the fault did not happen; os._exit(99)", flush=True)
    os._exit(99)


class Watcher:
    """Polls STATUS.die; dies itself (watcher thread) or hands over to main."""

    def __init__(self, status, poll):
        self.status = status
        self.poll = poll
        self.request = None
        self.wake = threading.Event()

    def run(self):
        path = self.status + ".die"
        while True:
            if os.path.exists(path):
                try:
                    with open(path) as f:
                        text = f.read()
                except OSError:
                    text = ""
                if text.strip():
                    try:
                        mode, code, where = parse_mode(text)
                    except ValueError as e:
                        print(f"worker: ignoring {path}: {e}", flush=True)
                        os.unlink(path)
                        continue
                    if where == "thread":
                        die(self.status, mode, code, where)
                    self.request = (mode, code, where)
                    self.wake.set()
                    return
            time.sleep(self.poll)


class TorchData:
    def __init__(self, gib):
        import torch  # after setsid: importing takes seconds

        self.torch = torch
        n = int(gib * (1 << 30) // 4)
        self.x = torch.arange(n, device="cuda", dtype=torch.float32).remainder_(1000.0)
        # Integers below 1000: the float64 sum is exact and order-independent.
        self.expect = self.x.sum(dtype=torch.float64).item()
        free, total = torch.cuda.mem_get_info()
        self.desc = (f"torch={torch.__version__} gpu={torch.cuda.get_device_name(0)} tensor={n * 4} bytes "
                     f"expect={self.expect:.0f} free={free >> 20}/{total >> 20} MiB")

    def check(self):
        s = self.x.sum(dtype=self.torch.float64).item()
        return s == self.expect, s


class DriverData:
    """The CUDA driver API through ctypes: enough for gpusnap's fake driver too."""

    CHUNK = 1 << 20

    def __init__(self, gib):
        cu = ctypes.CDLL("libcuda.so.1")
        self.cu = cu
        u64 = ctypes.c_uint64

        def ok(rc, what):
            if rc != 0:
                raise RuntimeError(f"{what}: CUDA error {rc}")

        ok(cu.cuInit(0), "cuInit")
        dev = ctypes.c_int(0)
        ok(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
        ctx = ctypes.c_void_p()
        ok(cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev), "cuCtxCreate_v2")
        self.bytes = max(int(gib * (1 << 30)), self.CHUNK)
        self.ptr = u64(0)
        cu.cuMemAlloc_v2.argtypes = [ctypes.POINTER(u64), ctypes.c_size_t]
        cu.cuMemcpyHtoD_v2.argtypes = [u64, ctypes.c_void_p, ctypes.c_size_t]
        cu.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, u64, ctypes.c_size_t]
        ok(cu.cuMemAlloc_v2(ctypes.byref(self.ptr), self.bytes), "cuMemAlloc_v2")
        self.pattern = bytes((i * 7 + 3) & 0xFF for i in range(self.CHUNK))
        ok(cu.cuMemcpyHtoD_v2(self.ptr, self.pattern, self.CHUNK), "cuMemcpyHtoD_v2")
        self.buf = ctypes.create_string_buffer(self.CHUNK)
        self.ok = ok
        self.desc = f"backend=driver bytes={self.bytes} checked={self.CHUNK}"

    def check(self):
        self.ok(self.cu.cuMemcpyDtoH_v2(self.buf, self.ptr, self.CHUNK), "cuMemcpyDtoH_v2")
        self.ok(self.cu.cuCtxSynchronize(), "cuCtxSynchronize")
        same = self.buf.raw == self.pattern
        return same, int(same)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("gib", type=float)
    ap.add_argument("status")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--interval", type=float, default=0.05)
    ap.add_argument("--no-setsid", action="store_true")
    ap.add_argument("--backend", choices=("torch", "driver"), default="torch")
    a = ap.parse_args()
    if not a.no_setsid:
        try:
            os.setsid()
        except OSError:
            pass  # already a session/group leader
    pid = os.getpid()
    data = TorchData(a.gib) if a.backend == "torch" else DriverData(a.gib)
    with open(f"/proc/{pid}/status") as f:
        masks = " ".join(l.strip().replace("\t", "") for l in f if l.startswith(("SigCgt", "SigIgn")))
    print(f"dying_worker pid={pid} {data.desc} {masks}", flush=True)

    tids = []
    for k in range(a.threads):
        t = threading.Thread(target=idle, name=f"extra-{k}", daemon=True)
        t.start()
        tids.append(t.native_id)
    if a.threads:
        write_status(a.status + ".tids", " ".join(map(str, tids)) + "\n")
        print(f"worker extra thread ids: {tids}", flush=True)
    watcher = Watcher(a.status, 0.005)
    wt = threading.Thread(target=watcher.run, name="die-watcher", daemon=True)
    wt.start()
    print(f"worker die-watcher thread id: {wt.native_id}", flush=True)

    i = 0
    last_write = 0.0
    while True:
        try:
            same, s = data.check()
            ok = int(same)
            if not ok:
                print(f"worker checksum mismatch at {i + 1}: {s!r}", flush=True)
        except Exception as e:  # noqa: BLE001 - keep the process alive, see the docstring
            print(f"worker CUDA error at iteration {i + 1}: {e!r}; idling", flush=True)
            write_status(a.status, f"{pid} {i} 0 {time.time():.3f}\n")
            idle()
        i += 1
        now = time.time()
        # Busy mode (--interval 0): the main thread should spend its time in
        # CUDA calls, not in writing the status file.
        if a.interval > 0 or now - last_write >= 0.05 or not ok:
            write_status(a.status, f"{pid} {i} {ok} {now:.3f}\n")
            last_write = now
        if os.path.exists(a.status + ".exit"):
            print("worker exit requested", flush=True)
            sys.stdout.flush()
            os._exit(3)
        if watcher.wake.wait(a.interval) and watcher.request:
            die(a.status, *watcher.request)


if __name__ == "__main__":
    main()
