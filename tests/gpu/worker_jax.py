#!/usr/bin/env python3
"""worker.py with its memory held by JAX instead of PyTorch (XLA's own
allocator and CUDA runtime use), for the GPU checks that hibernate and wake
are right for more than one framework (tests/gpu/rescue-e2e.sh).

Usage: worker_jax.py GIB STATUS [worker.py options]
Holds GIB GiB on the device in JAX arrays of 256 MiB each (JAX's arrays are
immutable: one array built piece by piece would need twice the memory),
with a known checksum:
  --fill pattern  float32 arange % 1000, summed in float64 (exact)
  --fill random   uint32 of a hash of each index (murmur3's finaliser, as
                  worker_cupy.py; incompressible), summed as uint64 (exact)
XLA's preallocation of most of the GPU is turned off (the workers of a run
share one GPU). The status line, --threads, --interval, --no-setsid,
STATUS.exit and the idling after a CUDA error are worker.py's (worker.serve).
"""
import os
import sys

STEP = 1 << 26  # elements per array: 256 MiB of 4-byte values


def main():
    sys.dont_write_bytecode = True  # no __pycache__ in the checkout
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import worker

    a = worker.parser().parse_args()
    worker.own_session(a)  # before CUDA is touched, as worker.py does
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    pid = os.getpid()
    import jax

    jax.config.update("jax_enable_x64", True)  # the exact uint64 / float64 sums
    import jax.numpy as jnp

    n = int(a.gib * (1 << 30) // 4)
    pieces = []
    if a.fill == "random":
        for i in range(0, n, STEP):
            h = jnp.arange(i, i + min(STEP, n - i), dtype=jnp.uint32)
            h = h ^ (h >> jnp.uint32(16))
            h = h * jnp.uint32(0x85EBCA6B)
            h = h ^ (h >> jnp.uint32(13))
            h = h * jnp.uint32(0xC2B2AE35)
            h = h ^ (h >> jnp.uint32(16))
            pieces.append(h.block_until_ready())

        def checksum():
            return sum(int(p.sum(dtype=jnp.uint64)) for p in pieces)
    else:
        for i in range(0, n, STEP):
            p = jnp.remainder(jnp.arange(i, i + min(STEP, n - i), dtype=jnp.float32), jnp.float32(1000.0))
            pieces.append(p.block_until_ready())

        def checksum():
            return float(sum(float(p.sum(dtype=jnp.float64)) for p in pieces))
    expect = checksum()
    dev = jax.devices()[0]
    print(f"worker_jax pid={pid} jax={jax.__version__} device={dev.device_kind} tensor={n * 4} bytes "
          f"fill={a.fill} expect={expect:.0f}", flush=True)
    worker.serve(a, pid, checksum, expect)


if __name__ == "__main__":
    main()
