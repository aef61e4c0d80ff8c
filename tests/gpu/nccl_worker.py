#!/usr/bin/env python3
"""PyTorch worker with an NCCL communicator, for tests/gpu/multi-e2e.sh (m4).

One process, world size 1: init_process_group("nccl", rank=0, world_size=1)
on 127.0.0.1 and a free port (MASTER_PORT if set, else one the kernel picks),
one all_reduce on cuda:DEVICE (which creates the NCCL communicator), then it
keeps checking a GIB GiB tensor as worker.py does, writing to STATUS:
    <pid> <iteration> <1 if the checksum is intact else 0> <unix time>
Every all_reduce (the first one, then one each time STATUS.again appears; the
file is removed first) writes, atomically, to STATUS.allreduce:
    <count> <1 if the result is right else 0> <ms> <note>
An all_reduce that raises writes ok 0 and the error; the worker goes on.

Usage: nccl_worker.py GIB STATUS [--device N] [--interval S] [--no-setsid]
Exits with 3 when STATUS.exit exists. A CUDA error in the checksum loop does
not end the process: it writes ok=0 and idles (a restored process must be
suspended before it dies). PyTorch's NCCL watchdog may not end the process
either: its heartbeat monitor and async error handling are turned off here
(a suspended process makes no progress, which they would take for a hang),
and the collective timeout is an hour.
"""
import argparse
import datetime
import os
import socket
import sys
import time


bytecode = sys.dont_write_bytecode
sys.dont_write_bytecode = True  # no __pycache__ in the checkout
from worker import idle, write_status  # noqa: E402 (worker.py's helpers, from this directory)
sys.dont_write_bytecode = bytecode


def free_port():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def nccl_maps():
    """The libnccl files this process maps (what gpusnap doctor looks for)."""
    try:
        with open("/proc/self/maps") as f:
            return sorted({ln.split()[-1] for ln in f if "libnccl" in ln})
    except OSError:
        return []


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("gib", type=float)
    ap.add_argument("status")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--interval", type=float, default=0.2)
    ap.add_argument("--no-setsid", action="store_true")
    a = ap.parse_args()
    if not a.no_setsid:
        try:
            os.setsid()
        except OSError:
            pass
    pid = os.getpid()
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_NCCL_ENABLE_MONITORING", "0"),
                 ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0"), ("NCCL_ASYNC_ERROR_HANDLING", "0"),
                 ("TORCH_NCCL_DUMP_ON_TIMEOUT", "0"), ("MASTER_ADDR", "127.0.0.1"),
                 ("NCCL_SOCKET_IFNAME", "lo")):  # one process: its bootstrap stays on loopback
        os.environ.setdefault(k, v)
    if not os.environ.get("MASTER_PORT"):
        os.environ["MASTER_PORT"] = str(free_port())
    import torch
    import torch.distributed as dist

    dev = torch.device("cuda", a.device)
    torch.cuda.set_device(dev)
    n = int(a.gib * (1 << 30) // 4)
    x = torch.arange(n, device=dev, dtype=torch.float32).remainder_(1000.0)
    expect = x.sum(dtype=torch.float64).item()

    dist.init_process_group("nccl", rank=0, world_size=1, timeout=datetime.timedelta(hours=1))
    ar_path = a.status + ".allreduce"
    count = 0

    def all_reduce():
        nonlocal count
        count += 1
        m = 1 << 20
        t0 = time.perf_counter()
        try:
            t = torch.full((m,), float(count), device=dev, dtype=torch.float32)
            dist.all_reduce(t)
            torch.cuda.synchronize(dev)
            got = t.sum(dtype=torch.float64).item()
            ok = int(got == float(count) * m)  # world size 1: the sum is the tensor itself
            note = "ok" if ok else f"sum={got!r}"
        except Exception as e:  # noqa: BLE001 - record it, keep the process alive
            ok, note = 0, f"error:{type(e).__name__}:{str(e)[:200]}".replace("\n", " ").replace(" ", "_")
        ms = (time.perf_counter() - t0) * 1e3
        write_status(ar_path, f"{count} {ok} {ms:.1f} {note}\n")
        print(f"nccl_worker all_reduce {count}: ok={ok} {ms:.1f} ms {note}", flush=True)

    all_reduce()
    try:
        nccl_v = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001 - only for the log
        nccl_v = "?"
    print(f"nccl_worker pid={pid} torch={torch.__version__} nccl={nccl_v} device=cuda:{a.device} "
          f"gpu={torch.cuda.get_device_name(a.device)} port={os.environ['MASTER_PORT']} "
          f"tensor={n * 4} bytes expect={expect:.0f} maps={nccl_maps()}", flush=True)

    i = 0
    again = a.status + ".again"
    while True:
        try:
            s = x.sum(dtype=torch.float64).item()
            ok = int(s == expect)
            if not ok:
                print(f"nccl_worker checksum mismatch at {i + 1}: {s!r} != {expect!r}", flush=True)
        except Exception as e:  # noqa: BLE001 - keep the process alive, see the docstring
            print(f"nccl_worker CUDA error at iteration {i + 1}: {e!r}; idling", flush=True)
            write_status(a.status, f"{pid} {i} 0 {time.time():.3f}\n")
            idle()
        i += 1
        write_status(a.status, f"{pid} {i} {ok} {time.time():.3f}\n")
        if os.path.exists(again):
            os.remove(again)
            all_reduce()
        if os.path.exists(a.status + ".exit"):
            print("nccl_worker exit requested", flush=True)
            sys.stdout.flush()
            os._exit(3)
        time.sleep(a.interval)


if __name__ == "__main__":
    main()
