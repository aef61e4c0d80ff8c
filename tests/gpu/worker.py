#!/usr/bin/env python3
"""PyTorch GPU worker for the gpusnap GPU tests.

Holds GIB GiB on the device in one tensor with a known checksum and keeps
computing on it. After every pass it writes, atomically, one line to STATUS:
    <pid> <iteration> <1 if the checksum is intact else 0> <unix time>
While the process is suspended its CUDA calls block, so the iteration stops;
after a resume it goes on, and ok stays 1 only if the data came back intact.

Usage: worker.py GIB STATUS [--threads N] [--interval S] [--no-setsid] [--fill F]
  --threads N   start N extra idle threads (their ids go to STATUS.tids), so
                the tests have thread ids that are not the process id
  --fill F      pattern (default, or $WORKER_FILL): float32 arange % 1000,
                one short pattern repeated (compresses and deduplicates to
                almost nothing; the float64 sum leaves a copy twice the
                tensor's size in PyTorch's cache: GIB 8 holds ~26.4 GB);
                random: random int32, incompressible (a fair test of writing
                and reading an image), checked by their exact integer sum,
                taken 256 MiB at a time (GIB 8 holds ~9.5 GB: ask ~23 for
                25 GB, ~46 for 50 GB);
                weights: bf16 from a normal distribution (sd 0.02), a model's
                weights (zstd with entropy coding stores them at ~1.28x),
                checked by the exact integer sum of their bits, taken 256 MiB
                at a time (sized as random)
  --no-setsid   stay in the caller's session (by default the worker starts
                its own, so a signal to the test script's process group, such
                as Ctrl-C or a wall-clock kill, never reaches a live CUDA
                process; the script suspends it first)
Exits with 3 when STATUS.exit exists. A CUDA error does not end the process:
it writes ok=0 and idles without touching the GPU again, so the test can
still suspend it before it is killed (a restored process must not die live).
"""
import argparse
import os
import sys
import threading
import time


def write_status(path, line):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(line)
    os.replace(tmp, path)


def idle():
    while True:
        time.sleep(1.0)


def parser():
    """The command line of worker.py (worker_cupy.py takes the same)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("gib", type=float)
    ap.add_argument("status")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--interval", type=float, default=0.2)
    ap.add_argument("--no-setsid", action="store_true")
    ap.add_argument("--fill", choices=("pattern", "random", "weights"),
                    default=os.environ.get("WORKER_FILL") or "pattern")
    return ap


def own_session(a):
    if not a.no_setsid:
        try:
            os.setsid()
        except OSError:
            pass  # already a session/group leader


def main():
    a = parser().parse_args()
    own_session(a)
    pid = os.getpid()
    import torch  # after setsid: importing takes seconds

    n = int(a.gib * (1 << 30) // 4)
    if a.fill == "random":
        x = torch.empty(n, device="cuda", dtype=torch.int32).random_(-(1 << 31), (1 << 31) - 1)
        step = 1 << 26

        def checksum():
            # Integer sums are exact, so independent of the reduction's
            # order; summed a piece at a time, so that the int64 copy the
            # sum makes is 512 MiB, not twice the tensor (a large copy stays
            # in PyTorch's cache and in the image, and would be half zeros).
            return sum(x[i:i + step].sum(dtype=torch.int64).item() for i in range(0, n, step))
    elif a.fill == "weights":
        n = int(a.gib * (1 << 30) // 2)
        x = torch.empty(n, device="cuda", dtype=torch.bfloat16).normal_(0.0, 0.02)
        bits = x.view(torch.int16)
        step = 1 << 27

        def checksum():
            # The integer sum of the bf16 values' bits: exact, order-free,
            # 256 MiB of them at a time (an int64 copy of 1 GiB at most).
            return sum(bits[i:i + step].sum(dtype=torch.int64).item() for i in range(0, n, step))
    else:
        x = torch.arange(n, device="cuda", dtype=torch.float32).remainder_(1000.0)

        def checksum():
            # Every element is an integer below 1000, so the float64 sum is
            # exact and does not depend on the order of the reduction.
            return x.sum(dtype=torch.float64).item()
    expect = checksum()
    free, total = torch.cuda.mem_get_info()
    print(f"worker pid={pid} torch={torch.__version__} gpu={torch.cuda.get_device_name(0)} "
          f"tensor={x.numel() * x.element_size()} bytes fill={a.fill} expect={expect:.0f} free={free >> 20}/{total >> 20} MiB",
          flush=True)

    serve(a, pid, checksum, expect)


def serve(a, pid, checksum, expect):
    """The worker's life after its memory is in place, whatever holds it
    (PyTorch here, CuPy in worker_cupy.py): the extra threads, then a
    checksum pass and a status line every --interval until STATUS.exit."""
    tids = []
    for k in range(a.threads):
        t = threading.Thread(target=idle, name=f"extra-{k}", daemon=True)
        t.start()
        tids.append(t.native_id)
    if a.threads:
        write_status(a.status + ".tids", " ".join(map(str, tids)) + "\n")
        print(f"worker extra thread ids: {tids}", flush=True)

    i = 0
    while True:
        try:
            s = checksum()
            ok = int(s == expect)
            if not ok:
                print(f"worker checksum mismatch at {i + 1}: {s!r} != {expect!r}", flush=True)
        except Exception as e:  # noqa: BLE001 - keep the process alive, see the docstring
            print(f"worker CUDA error at iteration {i + 1}: {e!r}; idling", flush=True)
            write_status(a.status, f"{pid} {i} 0 {time.time():.3f}\n")
            idle()
        i += 1
        write_status(a.status, f"{pid} {i} {ok} {time.time():.3f}\n")
        if os.path.exists(a.status + ".exit"):
            print("worker exit requested", flush=True)
            sys.stdout.flush()
            os._exit(3)
        time.sleep(a.interval)


if __name__ == "__main__":
    main()
