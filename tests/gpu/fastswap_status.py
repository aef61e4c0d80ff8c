"""The status protocol of the fast-swap benchmark's programs
(fastswap_torch.py, fastswap_cupy.py, fastswap_jax.py): STATUS holds
"ready PID DIGEST" once the program's memory is made; each time STATUS.check
appears it is removed and STATUS.result gets the digest of that moment.
"""
import os
import time


def digest_of(parts):
    """A short hex digest of a sequence of integers (sums of the arrays)."""
    return "%x" % (hash(tuple(parts)) & ((1 << 64) - 1))


def put(path, text):
    """Writes PATH whole: a reader sees the old text or the new, never part."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.rename(path + ".tmp", path)


def serve(status, digest, tick):
    """Writes the ready line, then forever answers checks and runs TICK (a
    little GPU work) between them."""
    put(status, "ready %d %s\n" % (os.getpid(), digest()))
    while True:
        if os.path.exists(status + ".check"):
            os.unlink(status + ".check")
            put(status + ".result", digest() + "\n")
        tick()
        time.sleep(0.02)
