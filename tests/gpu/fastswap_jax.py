"""A JAX program for the fast-swap benchmark (see fastswap_torch.py): XLA's
own allocator holds GB in arrays of 256 MiB, and a jitted function runs on
them between checks.

    python3 tests/gpu/fastswap_jax.py GB STATUS

XLA's preallocation of most of the GPU is off (as a server sharing a GPU
would run it): its allocator grows as the arrays are made.
"""
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from fastswap_status import digest_of, serve  # noqa: E402

gb, status = float(sys.argv[1]), sys.argv[2]
n = (256 << 20) // 4
arrays = []
left = int(gb * (1 << 30))
key = jax.random.PRNGKey(7)
while left > 0:
    key, sub = jax.random.split(key)
    m = min(n * 4, left) // 4
    arrays.append(jax.random.randint(sub, (m,), 0, 1 << 30, dtype=jnp.int32))
    left -= m * 4


@jax.jit
def total(a):
    return jnp.sum(a.astype(jnp.int64) if jax.config.jax_enable_x64 else (a % 1024).astype(jnp.int32))


def digest():
    parts = [int(total(a)) for a in arrays]
    return digest_of(parts)


# Between checks the main thread reads a result back (a blocking
# device-to-host read, as `int(array)` does), the call JAX was found inside
# when the driver locked it.
serve(status, digest, lambda: int(total(arrays[0])))
