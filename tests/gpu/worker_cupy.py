#!/usr/bin/env python3
"""worker.py with its memory held by CuPy instead of PyTorch, for the GPU
checks that a wake is right for more than one CUDA runtime user
(tests/gpu/rescue-e2e.sh).

Usage: worker_cupy.py GIB STATUS [worker.py options]
Holds GIB GiB on the device in one CuPy array with a known checksum:
  --fill pattern  float32 arange % 1000, summed in float64 (exact: integers
                  below 1000)
  --fill random   uint32 of a hash of each index (incompressible, no
                  repeated chunk; made 256 MiB at a time with CuPy's own
                  operations, no kernel of ours), summed as uint64 256 MiB
                  at a time (exact)
The status line, --threads, --interval, --no-setsid, STATUS.exit and the
idling after a CUDA error are worker.py's (worker.serve).
"""
import os
import sys

STEP = 1 << 26  # elements per piece: 256 MiB of 4-byte values


def fill_random(cp, x):
    """x[k] = a 32-bit hash of k (murmur3's finaliser), a piece at a time."""
    n = x.size
    for i in range(0, n, STEP):
        m = min(STEP, n - i)
        h = cp.arange(i, i + m, dtype=cp.uint32)
        h ^= h >> cp.uint32(16)
        h *= cp.uint32(0x85EBCA6B)
        h ^= h >> cp.uint32(13)
        h *= cp.uint32(0xC2B2AE35)
        h ^= h >> cp.uint32(16)
        x[i:i + m] = h
        del h


def main():
    sys.dont_write_bytecode = True  # no __pycache__ in the checkout
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import worker

    a = worker.parser().parse_args()
    worker.own_session(a)  # before CUDA is touched, as worker.py does
    pid = os.getpid()
    import cupy as cp

    n = int(a.gib * (1 << 30) // 4)
    if a.fill == "random":
        x = cp.empty(n, dtype=cp.uint32)
        fill_random(cp, x)

        def checksum():
            return sum(int(x[i:i + STEP].sum(dtype=cp.uint64)) for i in range(0, n, STEP))
    else:
        x = cp.arange(n, dtype=cp.float32)
        cp.remainder(x, cp.float32(1000.0), out=x)

        def checksum():
            return float(x.sum(dtype=cp.float64))
    expect = checksum()
    free, total = cp.cuda.runtime.memGetInfo()
    print(f"worker_cupy pid={pid} cupy={cp.__version__} tensor={n * 4} bytes fill={a.fill} "
          f"expect={expect:.0f} free={free >> 20}/{total >> 20} MiB", flush=True)
    worker.serve(a, pid, checksum, expect)


if __name__ == "__main__":
    main()
