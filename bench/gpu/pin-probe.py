"""Where the time of pinning new host memory goes on this host: the kernel's
population of an anonymous mapping (huge pages asked for) and the driver's
cuMemHostRegister of it, separately, on 1..16 threads and two chunk sizes;
then cuMemHostAlloc on the same threads. Prints a markdown table (GB/s).

    python3 bench/gpu/pin-probe.py [GIB]        (default 8)
"""
import ctypes
import sys
import threading
import time

GIB = float(sys.argv[1]) if len(sys.argv) > 1 else 8.0
HUGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23
PROT_RW = 0x3
MAP_PRIVATE_ANON_NORESERVE = 0x02 | 0x20 | 0x4000

libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
cu = ctypes.CDLL("libcuda.so.1")
cu.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
cu.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
cu.cuMemHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
cu.cuMemFreeHost.argtypes = [ctypes.c_void_p]


def check(rc, what):
    if rc != 0:
        raise SystemExit("%s: %d" % (what, rc))


check(cu.cuInit(0), "cuInit")
dev = ctypes.c_int()
check(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
ctx = ctypes.c_void_p()
check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")


def current():
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def run(threads, n, work):
    """work(i) for i in 0..n on THREADS threads; the wall time."""
    nxt = [0]
    lock = threading.Lock()

    def loop():
        current()
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= n:
                return
            work(i)

    t0 = time.perf_counter()
    ts = [threading.Thread(target=loop) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def thp():
    out = []
    for f in ("enabled", "defrag"):
        try:
            out.append(f + "=" + open("/sys/kernel/mm/transparent_hugepage/" + f).read().strip())
        except OSError:
            out.append(f + "=?")
    return " ".join(out)


total = int(GIB * (1 << 30))
print("host: %s; THP %s; %.0f GiB per case" % (open("/proc/cpuinfo").read().count("processor\t"), thp(), GIB))
print()
print("| how | chunk MiB | threads | populate GB/s | register GB/s | both GB/s | unregister+unmap s |")
print("|---|---|---|---|---|---|---|")
for chunk in (256 << 20, 1 << 30):
    n = total // chunk
    for threads in (1, 4, 8, 16):
        ptrs = [0] * n

        def populate(i):
            raw = libc.mmap(None, chunk + HUGE, PROT_RW, MAP_PRIVATE_ANON_NORESERVE, -1, 0)
            p = (raw + HUGE - 1) // HUGE * HUGE
            libc.madvise(p, chunk, MADV_HUGEPAGE)
            if libc.madvise(p, chunk, MADV_POPULATE_WRITE) != 0:
                raise SystemExit("MADV_POPULATE_WRITE: errno %d" % ctypes.get_errno())
            ptrs[i] = p

        def register(i):
            check(cu.cuMemHostRegister_v2(ptrs[i], chunk, 1), "cuMemHostRegister")

        def free(i):
            cu.cuMemHostUnregister(ptrs[i])
            libc.munmap(ptrs[i], chunk)

        a = run(threads, n, populate)
        b = run(threads, n, register)
        c = run(threads, n, free)
        gb = n * chunk / 1e9
        print("| populate+register | %d | %d | %.1f | %.1f | %.1f | %.2f |"
              % (chunk >> 20, threads, gb / a, gb / b, gb / (a + b), c))
        sys.stdout.flush()
    for threads in (1, 8, 16):
        ptrs = [ctypes.c_void_p() for _ in range(n)]

        def alloc(i):
            check(cu.cuMemHostAlloc(ctypes.byref(ptrs[i]), chunk, 1), "cuMemHostAlloc")

        def free(i):
            cu.cuMemFreeHost(ptrs[i])

        a = run(threads, n, alloc)
        c = run(threads, n, free)
        print("| cuMemHostAlloc | %d | %d | | | %.1f | %.2f |" % (chunk >> 20, threads, n * chunk / 1e9 / a, c))
        sys.stdout.flush()
