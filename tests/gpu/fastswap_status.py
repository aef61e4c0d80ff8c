"""The status protocol of the fast-swap benchmark's programs
(fastswap_torch.py, fastswap_cupy.py, fastswap_jax.py): STATUS holds
"ready PID DIGEST" once the program's memory is made; each time STATUS.check
appears it is removed and STATUS.result gets the digest of that moment; once
STATUS.exit appears the program ends with status 0.
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
    """Writes the ready line, then answers checks and runs TICK (a little
    GPU work) between them until asked to end."""
    put(status, "ready %d %s\n" % (os.getpid(), digest()))
    while not os.path.exists(status + ".exit"):
        if os.path.exists(status + ".check"):
            os.unlink(status + ".check")
            put(status + ".result", digest() + "\n")
        tick()
        time.sleep(0.02)
