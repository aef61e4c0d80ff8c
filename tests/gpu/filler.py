#!/usr/bin/env python3
"""Takes all free device memory but LEAVE MiB, writes READY, then sleeps.

Usage: filler.py LEAVE_MIB READY [--max-s S]
READY gets one line: `ready <free MiB before> <free MiB after> <MiB held>`.
The filler is never checkpointed, so killing it is always safe; it also ends
by itself after --max-s seconds (default 900) in case nobody does.
"""
import argparse
import os
import time

MIB = 1 << 20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("leave_mib", type=int)
    ap.add_argument("ready")
    ap.add_argument("--max-s", type=float, default=900.0)
    a = ap.parse_args()
    t0 = time.monotonic()
    import torch

    free, total = torch.cuda.mem_get_info()  # creates the context first
    take = max(0, free - a.leave_mib * MIB)
    chunk = 8 << 30
    blocks, held = [], 0
    while take >= 2 * MIB:
        b = min(take, chunk)
        try:
            blocks.append(torch.empty(b, dtype=torch.uint8, device="cuda"))
            take -= b
            held += b
        except RuntimeError:  # torch.OutOfMemoryError is a RuntimeError
            if chunk <= 64 * MIB:
                break
            chunk //= 2
    after, _ = torch.cuda.mem_get_info()
    line = f"ready {free // MIB} {after // MIB} {held // MIB}\n"
    print(f"filler pid={os.getpid()} total={total // MIB} MiB: {line.strip()} "
          f"({time.monotonic() - t0:.1f} s)", flush=True)
    tmp = a.ready + ".tmp"
    with open(tmp, "w") as f:
        f.write(line)
    os.replace(tmp, a.ready)
    while time.monotonic() - t0 < a.max_s:
        time.sleep(1.0)
    print("filler: --max-s reached, exiting", flush=True)


if __name__ == "__main__":
    main()
