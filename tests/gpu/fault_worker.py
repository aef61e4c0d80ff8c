#!/usr/bin/env python3
"""GPU worker for tests/gpu/fault-e2e.sh: holds memory through PyTorch or
CuPy, and on request runs a kernel that writes through a null pointer.

Usage: fault_worker.py GIB STATUS --backend torch|cupy
Holds GIB GiB in one array of the framework and sums it over and over.
After every pass it writes, atomically, to STATUS:
    <pid> <iteration> 1 <unix time>
When STATUS.fault appears it loads a tiny PTX kernel through the driver API
(ctypes; the driver compiles PTX itself, no NVRTC or compiler needed) into
the framework's own context (the device's primary context), launches it
once (one thread storing to address 0), synchronises (which answers
CUDA_ERROR_ILLEGAL_ADDRESS, 700: the context is now faulted for good), writes
STATUS.faulted with what the synchronise said, then makes one more call of
the framework, which raises; the exception is not caught, so Python exits
(status 1) as a serving program whose CUDA context faulted does.
STATUS.exit makes it exit 3.
"""
import ctypes
import os
import sys
import time

PTX = rb"""
.version 7.0
.target sm_70
.address_size 64
.visible .entry gpusnap_fault()
{
    .reg .b64 %rd<2>;
    .reg .b32 %r<2>;
    mov.u64 %rd1, 0;
    mov.u32 %r1, 1;
    st.global.u32 [%rd1], %r1;
    ret;
}
"""


def write(path, line):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(line)
    os.replace(tmp, path)


def fault(status):
    """The illegal-address kernel, in the device's primary context."""
    cu = ctypes.CDLL("libcuda.so.1")
    ctx, mod, fn = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    steps = [
        ("cuDevicePrimaryCtxRetain", lambda: cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0)),
        ("cuCtxSetCurrent", lambda: cu.cuCtxSetCurrent(ctx)),
        ("cuModuleLoadData", lambda: cu.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(PTX))),
        ("cuModuleGetFunction", lambda: cu.cuModuleGetFunction(ctypes.byref(fn), mod, b"gpusnap_fault")),
        ("cuLaunchKernel", lambda: cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, None, None, None)),
        ("cuCtxSynchronize", lambda: cu.cuCtxSynchronize()),
    ]
    said = []
    for name, call in steps:
        rc = call()
        said.append(f"{name}={rc}")
        if rc != 0 and name != "cuCtxSynchronize":
            break
    write(status + ".faulted", f"{os.getpid()} {' '.join(said)} {time.time():.3f}\n")
    print("fault:", " ".join(said), flush=True)


def main():
    gib, status = float(sys.argv[1]), sys.argv[2]
    backend = sys.argv[sys.argv.index("--backend") + 1] if "--backend" in sys.argv else "torch"
    n = int(gib * (1 << 30)) // 4
    if backend == "torch":
        import torch

        x = torch.ones(n, dtype=torch.float32, device="cuda")

        def step():
            return float(x.sum().item())

        def after():
            torch.cuda.synchronize()
            return float(x.sum().item())
    else:
        import cupy as cp

        x = cp.ones(n, dtype=cp.float32)

        def step():
            return float(x.sum())

        def after():
            cp.cuda.Device().synchronize()
            return float(x.sum())

    it = 0
    while True:
        it += 1
        step()
        write(status, f"{os.getpid()} {it} 1 {time.time():.3f}\n")
        if os.path.exists(status + ".exit"):
            sys.exit(3)
        if os.path.exists(status + ".fault"):
            fault(status)
            after()  # raises: the context faulted
            print("fault: the framework's call after the fault did not raise", flush=True)
            sys.exit(4)
        time.sleep(0.05)


if __name__ == "__main__":
    main()
