"""Holds a CUDA context with 1 GiB of device memory and GB of page-locked
host memory (MODE: register = huge-page anonymous memory populated then
cuMemHostRegister'd, alloc = cuMemHostAlloc, none = nothing pinned), writes
"ready PID" to STATUS, then idles: what the driver's checkpoint and restore
cost for pinned host memory a process holds (bench/gpu/pinned-ckpt.sh).

    python3 bench/gpu/pinned_holder.py GB MODE STATUS
"""
import ctypes
import os
import sys
import time

gb, mode, status = float(sys.argv[1]), sys.argv[2], sys.argv[3]
cu = ctypes.CDLL("libcuda.so.1")
libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
cu.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
cu.cuMemHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]


def check(rc, what):
    if rc != 0:
        raise SystemExit("%s: %d" % (what, rc))


check(cu.cuInit(0), "cuInit")
dev = ctypes.c_int()
check(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
ctx = ctypes.c_void_p()
check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "retain")
check(cu.cuCtxSetCurrent(ctx), "set")
d = ctypes.c_uint64()
check(cu.cuMemAlloc_v2(ctypes.byref(d), 1 << 30), "cuMemAlloc")
chunk = 1 << 30
for _ in range(int(gb)):
    if mode == "register":
        raw = libc.mmap(None, chunk + (2 << 20), 3, 0x22 | 0x4000, -1, 0)
        p = (raw + (2 << 20) - 1) // (2 << 20) * (2 << 20)
        libc.madvise(p, chunk, 14)
        libc.madvise(p, chunk, 23)
        check(cu.cuMemHostRegister_v2(p, chunk, 1), "cuMemHostRegister")
    elif mode == "alloc":
        p = ctypes.c_void_p()
        check(cu.cuMemHostAlloc(ctypes.byref(p), chunk, 1), "cuMemHostAlloc")
with open(status + ".tmp", "w") as f:
    f.write("ready %d\n" % os.getpid())
os.rename(status + ".tmp", status)
while True:
    time.sleep(0.1)
