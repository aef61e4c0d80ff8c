#!/usr/bin/env python3
"""worker.py on a chosen GPU, for the two-GPU checks (tests/gpu/multi-e2e.sh).

Usage: worker_dev.py GIB STATUS [--device N] [worker.py options]
  --device N  the CUDA device the tensor lives on (default 0), chosen with
              torch.cuda.set_device, so every GPU stays visible to the process
              (CUDA_VISIBLE_DEVICES is left as it is). With
              CUDA_DEVICE_ORDER=PCI_BUS_ID, N is nvidia-smi's index.
Everything else (status line, checksum, --threads, --interval, --no-setsid,
STATUS.exit, idling after a CUDA error) is worker.py's: this only selects the
device, then runs worker.main().
"""
import os
import sys


def split_device(argv):
    """(device, the other arguments) from argv: --device N or --device=N."""
    dev, rest, i = 0, [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--device" and i + 1 < len(argv):
            dev = int(argv[i + 1])
            i += 2
            continue
        if a.startswith("--device="):
            dev = int(a.split("=", 1)[1])
        else:
            rest.append(a)
        i += 1
    return dev, rest


def main():
    dev, rest = split_device(sys.argv[1:])
    # Own session before CUDA is touched (worker.main's setsid then fails
    # harmlessly: it is already a session leader), as worker.py does.
    if "--no-setsid" not in rest:
        try:
            os.setsid()
        except OSError:
            pass
    sys.dont_write_bytecode = True  # no __pycache__ in the checkout
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch
    import worker

    torch.cuda.set_device(dev)
    print(f"worker_dev pid={os.getpid()} device={dev} name={torch.cuda.get_device_name(dev)} "
          f"visible={os.environ.get('CUDA_VISIBLE_DEVICES', 'all')} count={torch.cuda.device_count()}",
          flush=True)
    sys.argv = [worker.__file__] + rest
    worker.main()


if __name__ == "__main__":
    main()
