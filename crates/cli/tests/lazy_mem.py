# A plain process for the lazy-wake tests: four regions of anonymous memory
# with known contents, and, when OUT.go appears (right after a wake), a fork,
# an mremap, a munmap and a madvise(DONTNEED) before it reads its memory.
# OUT.before: what it must read; OUT.after and OUT.child: what it read.
import ctypes, hashlib, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.mremap.restype = ctypes.c_void_p
libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
out, mib = sys.argv[1], int(sys.argv[2])
N = mib << 20
H = N // 2
def region():
    a = libc.mmap(None, N, 3, 0x22, -1, 0)  # PROT_READ|WRITE, MAP_PRIVATE|MAP_ANONYMOUS
    assert a and a != ctypes.c_void_p(-1).value
    return a
def fill(a, seed):
    # A cheap pattern that differs per page and per region.
    blk = hashlib.sha256(seed.encode()).digest() * 128
    for off in range(0, N, 4096):
        ctypes.memmove(a + off, (off // 4096).to_bytes(8, "little") + blk[8:4096], 4096)
def h(a, n):
    return hashlib.sha256(ctypes.string_at(a, n)).hexdigest()
A, B, C, D = region(), region(), region(), region()
for r, s in ((A, "a"), (B, "b"), (C, "c"), (D, "d")):
    fill(r, s)
zeros = hashlib.sha256(bytes(H) + ctypes.string_at(D + H, H)).hexdigest()
with open(out + ".before", "w") as f:
    f.write(f"{h(A, N)} {h(B, N)} {h(C, H)} {zeros}\n")
i = 0
moved = False
while True:
    i += 1
    with open(out + ".tmp", "w") as f:
        f.write(f"{i}\n")
    os.replace(out + ".tmp", out)
    if os.path.exists(out + ".go"):
        os.unlink(out + ".go")
        # Right after a wake: these run while the page server still fills.
        kid = os.fork()
        if kid == 0:
            with open(out + ".child", "w") as f:
                f.write(h(A, N) + "\n")
            os._exit(0)
        if not moved:
            dst = libc.mmap(None, N, 0, 0x22, -1, 0)
            B2 = libc.mremap(B, N, N, 3, dst)  # MREMAP_MAYMOVE|MREMAP_FIXED
            assert B2 == dst, ctypes.get_errno()
            B = B2
            assert libc.munmap(C + H, H) == 0
            assert libc.madvise(D, H, 4) == 0  # MADV_DONTNEED
            moved = True
        os.waitpid(kid, 0)
        with open(out + ".after.tmp", "w") as f:
            f.write(f"{h(A, N)} {h(B, N)} {h(C, H)} {h(D, N)}\n")
        os.replace(out + ".after.tmp", out + ".after")
    time.sleep(0.05)
