#!/usr/bin/env python3
"""Probe: does the driver's restore read its host copy as fast from the page
cache (a private file mapping) as from anonymous memory?

A filled warm wake copies every byte of the image into the woken process
(UFFDIO_COPY) while the driver's restore reads it; the copy slows the
driver's one CPU-bound thread (bench/results/126, "What slows the driver's
restore in a warm wake"). A wake could instead map the image's pages from
the page cache (MAP_PRIVATE of a page-aligned raw file: no copy at all,
copy-on-write only where written). This probe measures that before anything
is built: a PyTorch worker holds GIB GiB of random int32 on the GPU; the
parent suspends it with the bare driver calls (cuckpt.py), the worker then
replaces each new anonymous mapping the checkpoint left (the driver's host
copy) by a private mapping of a file holding the same bytes, and the parent
times the driver's restore and unlock. Modes, per cycle:
  none      the host copy as the driver left it (the baseline)
  file      a file on DIR's filesystem, written and fdatasync'd (clean page
            cache, as a warm image on disk)
  shm       a file in /dev/shm (tmpfs)
  and options joined by `+` (see `swap`): al, huge, pop
After each restore the worker checks its data (exact int64 sum) and lists
which of the file mappings are still there (whether the driver freed them).
At the end the worker is suspended (lock + checkpoint) before it is killed.

Usage: filemap-probe.py GIB DIR MODE...   (one JSON line per cycle on stdout)
"""
import ctypes
import json
import os
import subprocess
import sys
import time

MAP_PRIVATE, MAP_FIXED = 0x02, 0x10
MADV_HUGEPAGE, MADV_POPULATE_READ = 14, 22
PROT = {"r": 1, "w": 2, "x": 4}
BIG = 64 << 20


def maps(pid="self"):
    out = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            p = line.split()
            a, b = (int(x, 16) for x in p[0].split("-"))
            out.append((a, b, p[1], p[5] if len(p) > 5 else ""))
    return out


def swap(mode, snap, d, libc, files):
    """Replaces each new big anonymous mapping by a private mapping of a
    file holding its bytes, or only lists them (mode none). MODE is `file`
    (on DIR) or `shm` (/dev/shm), with options joined by `+`: `al` puts the
    bytes at the file offset congruent to the address modulo 2 MiB (so the
    page cache's large folios can be mapped whole), `huge` MADV_HUGEPAGE,
    `pop` MADV_POPULATE_READ (page tables filled, read-only, before the
    restore: what another thread could do beside the driver)."""
    rep = {}
    new = [m for m in maps() if m not in snap and not m[3] and m[1] - m[0] >= BIG]
    rep["new"] = [[hex(a), b - a, perm] for a, b, perm, _ in new]
    rep["write_s"] = rep["map_s"] = 0.0
    kind, *opts = mode.split("+")
    if kind != "none":
        where = "/dev/shm" if kind == "shm" else d
        for i, (a, b, perm, _) in enumerate(new):
            if "r" not in perm:
                rep.setdefault("skipped", []).append(hex(a))
                continue
            path = os.path.join(where, f"gpusnap-filemap-{os.getpid()}-{i}")
            pad = a % (2 << 20) if "al" in opts else 0
            t = time.perf_counter()
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            mv = memoryview((ctypes.c_char * (b - a)).from_address(a)).cast("B")
            off = 0
            while off < b - a:
                off += os.pwrite(fd, mv[off:off + (256 << 20)], pad + off)
            if kind != "shm":
                os.fdatasync(fd)
            rep["write_s"] += time.perf_counter() - t
            prot = sum(PROT[c] for c in perm[:3] if c in PROT)
            t = time.perf_counter()
            r = libc.mmap(a, b - a, prot, MAP_PRIVATE | MAP_FIXED, fd, pad)
            os.close(fd)
            files.append(path)
            if r != a:
                rep["error"] = f"mmap {hex(a)}: errno {ctypes.get_errno()}"
                break
            for opt, adv in (("huge", MADV_HUGEPAGE), ("pop", MADV_POPULATE_READ)):
                if opt in opts and libc.madvise(a, b - a, adv) != 0:
                    rep.setdefault("madvise_errno", []).append([opt, ctypes.get_errno()])
            rep["map_s"] += time.perf_counter() - t
        rep["rollup"] = rollup()
    rep["write_s"] = round(rep["write_s"], 3)
    rep["map_s"] = round(rep["map_s"], 3)
    return rep


def smaps_big():
    """Every mapping of 64 MiB or more: address, size, perms, path, Rss (kB)
    and VmFlags (which madvise flags the driver's host copy carries)."""
    out, cur = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            p = line.split()
            if "-" in p[0] and ":" not in p[0]:
                a, b = (int(x, 16) for x in p[0].split("-"))
                cur = {"at": hex(a), "size": b - a, "perm": p[1], "path": p[5] if len(p) > 5 else ""}
                if b - a >= BIG:
                    out.append(cur)
            elif p[0] == "Rss:":
                cur["rss_kb"] = int(p[1])
            elif p[0] == "VmFlags:":
                cur["flags"] = " ".join(p[1:])
    return out


def rollup():
    keep = ("Rss", "Anonymous", "AnonHugePages", "FilePmdMapped", "ShmemPmdMapped")
    with open("/proc/self/smaps_rollup") as f:
        return {k: v for k, v in (line.split()[:2] for line in f if ":" in line) if k[:-1] in keep}


def libc_mmap():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def worker(gib, d):
    import torch
    libc = libc_mmap()
    n = int(gib * (1 << 30)) // 4
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device="cuda", generator=g)

    def checksum():
        s = 0
        step = 1 << 26
        for i in range(0, n, step):
            s += int(x[i:i + step].to(torch.int64).sum().item())
        return s

    want = checksum()
    pinned = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)  # noqa: F841 (its VmFlags)
    torch.cuda.synchronize()
    print(json.dumps({"ready": os.getpid(), "sum": want}), flush=True)
    snap = set()
    files = []
    for line in sys.stdin:
        cmd = line.split()
        rep = {"cmd": cmd[0]}
        if cmd[0] == "snap":
            snap = set(maps())
        elif cmd[0] == "swap":
            rep.update(swap(cmd[1], snap, d, libc, files))
        elif cmd[0] == "smaps":
            rep["big"] = smaps_big()
        elif cmd[0] == "check":
            got = checksum()
            rep["ok"] = got == want
            names = {os.path.basename(p) for p in files}
            still = [m for m in maps() if os.path.basename(m[3]) in names]
            rep["still_mapped"] = len(still)
            rep["still"] = [[hex(a), b - a, perm] for a, b, perm, _ in still]
            for p in files:
                os.unlink(p)
            files.clear()
        print(json.dumps(rep), flush=True)


def parent(gib, d, modes):
    # cuckpt.py, the bare driver calls, lives with the GPU checks.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "..", "tests", "gpu"))
    import cuckpt
    drv = cuckpt.Driver()
    assert drv.init() == 0
    w = subprocess.Popen([sys.executable, __file__, "--worker", str(gib), d],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    first = json.loads(w.stdout.readline())
    pid = first["ready"]

    def ask(s):
        w.stdin.write(s + "\n")
        w.stdin.flush()
        return json.loads(w.stdout.readline())

    def minflt():
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])

    def timed(f):
        t = time.perf_counter()
        rc = f(pid)
        return rc, round(time.perf_counter() - t, 3)

    try:
        for mode in modes:
            ask("snap")
            lk, lk_s = timed(lambda p: drv.lock(p, 10000))
            ck, ck_s = timed(drv.checkpoint)
            sm = ask("smaps") if os.environ.get("PROBE_SMAPS") else None
            sw = ask(f"swap {mode}")
            if "error" in sw:
                print(json.dumps({"mode": mode, "swap": sw}), flush=True)
                break
            f0 = minflt()
            rs, rs_s = timed(drv.restore)
            faults = minflt() - f0
            un, un_s = timed(drv.unlock)
            ch = ask("check")
            if sm:
                print(json.dumps({"mode": mode, "after_checkpoint": sm["big"],
                                  "after_restore": ask("smaps")["big"]}), flush=True)
            print(json.dumps({"mode": mode, "gib": gib, "checkpoint_s": ck_s, "restore_s": rs_s,
                              "unlock_s": un_s, "restore_minflt": faults, "rcs": [lk, ck, rs, un], "swap": sw,
                              "check": ch}), flush=True)
            if [lk, ck, rs, un] != [0, 0, 0, 0] or not ch.get("ok"):
                break
    finally:
        # Never end a live CUDA process: suspend it first.
        drv.lock(pid, 10000)
        drv.checkpoint(pid)
        w.kill()
        w.wait()


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        worker(float(sys.argv[2]), sys.argv[3])
    else:
        parent(float(sys.argv[1]), sys.argv[2], sys.argv[3:])
