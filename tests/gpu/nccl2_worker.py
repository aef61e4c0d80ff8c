#!/usr/bin/env python3
"""One rank of a two-process NCCL job, for tests/gpu/multi-e2e.sh (m5).

Two processes, one per GPU, one communicator:
init_process_group("nccl", rank=RANK, world_size=2) on 127.0.0.1:MASTER_PORT
(both ranks get the same port from the caller), cuda:DEVICE (default: the
rank). Each iteration: the checksum of a GIB GiB tensor (as worker.py), then
an all_reduce of a 1 Mi-element tensor filled with (rank + 1) * count, whose
sum must be 3 * count * 2^20 on both ranks (the ranks go in lockstep: an
all_reduce waits for the other). STATUS gets
    <pid> <iteration> <1 if the checksum and the last all_reduce are right else 0> <unix time>
and STATUS.allreduce
    <count> <1 if the sum is right else 0> <ms> <note>
An all_reduce that raises (or a CUDA error) writes ok 0 and the error, and the
worker idles (a restored process must be suspended before it dies).

PyTorch's NCCL watchdog: the heartbeat monitor is off (a suspended process
makes no progress, which it would take for a hang); a collective that has
not finished after NCCL2_TIMEOUT_S (default 120) seconds aborts the
communicator without ending the process (TORCH_NCCL_ASYNC_ERROR_HANDLING=2),
so a collective whose peer never comes back cannot hold the GPU forever.

Usage: nccl2_worker.py GIB STATUS --rank R [--device N] [--interval S]
Exits with 3 when STATUS.exit exists.
"""
import argparse
import datetime
import os
import sys
import time


bytecode = sys.dont_write_bytecode
sys.dont_write_bytecode = True  # no __pycache__ in the checkout
from worker import idle, write_status  # noqa: E402 (worker.py's helpers, from this directory)
from nccl_worker import nccl_maps  # noqa: E402
sys.dont_write_bytecode = bytecode


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("gib", type=float)
    ap.add_argument("status")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--device", type=int, default=None)
    ap.add_argument("--interval", type=float, default=0.2)
    a = ap.parse_args()
    try:
        os.setsid()  # a session of its own: CRIU dumps each rank as a tree
    except OSError:
        pass
    pid = os.getpid()
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_NCCL_ENABLE_MONITORING", "0"),
                 ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2"), ("TORCH_NCCL_DUMP_ON_TIMEOUT", "0"),
                 ("MASTER_ADDR", "127.0.0.1"), ("NCCL_SOCKET_IFNAME", "lo")):
        os.environ.setdefault(k, v)
    if not os.environ.get("MASTER_PORT"):
        sys.exit("nccl2_worker: MASTER_PORT must be set (the same for both ranks)")
    import torch
    import torch.distributed as dist

    dev_idx = a.rank if a.device is None else a.device
    dev = torch.device("cuda", dev_idx)
    torch.cuda.set_device(dev)
    n = int(a.gib * (1 << 30) // 4)
    x = torch.arange(n, device=dev, dtype=torch.float32).remainder_(1000.0)
    expect = x.sum(dtype=torch.float64).item()

    timeout = datetime.timedelta(seconds=float(os.environ.get("NCCL2_TIMEOUT_S", "120")))
    try:  # device_id (torch >= 2.3) binds the rank to its GPU up front
        dist.init_process_group("nccl", rank=a.rank, world_size=2, timeout=timeout, device_id=dev)
    except TypeError:
        dist.init_process_group("nccl", rank=a.rank, world_size=2, timeout=timeout)
    ar_path = a.status + ".allreduce"
    m = 1 << 20
    count = 0

    def all_reduce():
        nonlocal count
        count += 1
        t0 = time.perf_counter()
        try:
            t = torch.full((m,), float((a.rank + 1) * count), device=dev, dtype=torch.float32)
            dist.all_reduce(t)
            torch.cuda.synchronize(dev)
            got = t.sum(dtype=torch.float64).item()
            ok = int(got == 3.0 * count * m)
            note = "ok" if ok else f"sum={got!r}"
        except Exception as e:  # noqa: BLE001 - record it
            ok, note = 0, f"error:{type(e).__name__}:{str(e)[:200]}".replace("\n", " ").replace(" ", "_")
        ms = (time.perf_counter() - t0) * 1e3
        write_status(ar_path, f"{count} {ok} {ms:.1f} {note}\n")
        if not ok or count == 1:
            print(f"nccl2_worker rank {a.rank} all_reduce {count}: ok={ok} {ms:.1f} ms {note}", flush=True)
        return ok

    first = all_reduce()
    try:
        nccl_v = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001 - only for the log
        nccl_v = "?"
    print(f"nccl2_worker pid={pid} rank={a.rank} torch={torch.__version__} nccl={nccl_v} device=cuda:{dev_idx} "
          f"gpu={torch.cuda.get_device_name(dev_idx)} port={os.environ['MASTER_PORT']} "
          f"tensor={n * 4} bytes expect={expect:.0f} first_all_reduce={first} maps={nccl_maps()}", flush=True)

    i = 0
    while True:
        try:
            s = x.sum(dtype=torch.float64).item()
            ok = int(s == expect)
            if not ok:
                print(f"nccl2_worker checksum mismatch at {i + 1}: {s!r} != {expect!r}", flush=True)
        except Exception as e:  # noqa: BLE001 - keep the process alive
            print(f"nccl2_worker CUDA error at iteration {i + 1}: {e!r}; idling", flush=True)
            write_status(a.status, f"{pid} {i} 0 {time.time():.3f}\n")
            idle()
        ar_ok = all_reduce()
        i += 1
        write_status(a.status, f"{pid} {i} {int(ok and ar_ok)} {time.time():.3f}\n")
        if not ar_ok:
            print(f"nccl2_worker rank {a.rank}: all_reduce failed at iteration {i}; idling", flush=True)
            idle()
        if os.path.exists(a.status + ".exit"):
            print("nccl2_worker exit requested", flush=True)
            sys.stdout.flush()
            os._exit(3)
        time.sleep(a.interval)


if __name__ == "__main__":
    main()
