"""A CuPy program for the fast-swap benchmark (see fastswap_torch.py).

    python3 tests/gpu/fastswap_cupy.py GB STATUS
"""
import sys

import cupy as cp
from fastswap_status import digest_of, serve

gb, status = float(sys.argv[1]), sys.argv[2]
chunk = 256 << 20
arrays = []
left = int(gb * (1 << 30))
rng = cp.random.default_rng(7)
while left > 0:
    n = min(chunk, left) // 4
    arrays.append(rng.integers(0, 1 << 30, size=n, dtype=cp.int32))
    left -= n * 4


def digest():
    cp.cuda.Device().synchronize()
    parts = [int(a.sum(dtype=cp.int64)) for a in arrays]
    return digest_of(parts)


serve(status, digest, lambda: arrays[0][:1024].sum())
