#!/usr/bin/env python3
"""PyTorch worker holding GIB GiB on each of several GPUs, in one process.

For tests/gpu/multi-e2e.sh (m3): one process with device memory on two GPUs
is suspended (nothing left on either GPU) and resumed (both tensors intact).
Like worker.py, each GPU's tensor has a known checksum and after every pass
one line goes, atomically, to STATUS:
    <pid> <iteration> <ok> <unix time> <ok per device, comma separated>
ok is 1 only when every device's checksum is intact, so the first four
fields read as worker.py's.

Usage: worker2gpu.py GIB STATUS [--devices 0,1] [--interval S] [--no-setsid]
Exits with 3 when STATUS.exit exists. A CUDA error does not end the process:
it writes ok=0 and idles without touching the GPU again (a restored process
must be suspended before it dies).
"""
import argparse
import os
import sys
import time


bytecode = sys.dont_write_bytecode
sys.dont_write_bytecode = True  # no __pycache__ in the checkout
from worker import idle, write_status  # noqa: E402 (worker.py's helpers, from this directory)
sys.dont_write_bytecode = bytecode


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("gib", type=float, help="GiB per device")
    ap.add_argument("status")
    ap.add_argument("--devices", default="0,1")
    ap.add_argument("--interval", type=float, default=0.2)
    ap.add_argument("--no-setsid", action="store_true")
    a = ap.parse_args()
    if not a.no_setsid:
        try:
            os.setsid()
        except OSError:
            pass
    pid = os.getpid()
    import torch

    devs = [int(d) for d in a.devices.split(",") if d.strip()]
    n = int(a.gib * (1 << 30) // 4)
    xs, expect = [], []
    for k, d in enumerate(devs):
        # A different pattern per device: a swap of the two GPUs' memory
        # would show as a checksum mismatch.
        x = torch.arange(n, device=f"cuda:{d}", dtype=torch.float32).add_(k * 7).remainder_(1000.0)
        xs.append(x)
        expect.append(x.sum(dtype=torch.float64).item())
    names = [torch.cuda.get_device_name(d) for d in devs]
    print(f"worker2gpu pid={pid} torch={torch.__version__} devices={devs} gpus={names} "
          f"tensor={n * 4} bytes each expect={[round(e) for e in expect]} "
          f"visible={os.environ.get('CUDA_VISIBLE_DEVICES', 'all')}", flush=True)

    i = 0
    while True:
        oks = []
        try:
            for d, x, e in zip(devs, xs, expect):
                s = x.sum(dtype=torch.float64).item()
                oks.append(int(s == e))
                if s != e:
                    print(f"worker2gpu checksum mismatch on cuda:{d} at {i + 1}: {s!r} != {e!r}", flush=True)
        except Exception as ex:  # noqa: BLE001 - keep the process alive, see the docstring
            print(f"worker2gpu CUDA error at iteration {i + 1}: {ex!r}; idling", flush=True)
            write_status(a.status, f"{pid} {i} 0 {time.time():.3f} -\n")
            idle()
        i += 1
        ok = int(all(oks))
        write_status(a.status, f"{pid} {i} {ok} {time.time():.3f} {','.join(map(str, oks))}\n")
        if os.path.exists(a.status + ".exit"):
            print("worker2gpu exit requested", flush=True)
            sys.stdout.flush()
            os._exit(3)
        time.sleep(a.interval)


if __name__ == "__main__":
    main()
