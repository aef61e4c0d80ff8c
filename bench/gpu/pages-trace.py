#!/usr/bin/env python3
"""Sums up a lazy wake's page-server trace (GPUSNAP_PAGES_TRACE=FILE, see
docs/design/wake.md): where the faults fell (which piece of the process's memory,
how far into it, whether a fill had it in flight) against where the
background fill was, to find the order in which a driver's restore reads.

Usage: bench/gpu/pages-trace.py TRACE.json [MAX_FAULTS]

Then, per 100 ms, the fill's pace and where its time went (traces that
hold them: read and copy times, the fill threads' time on a
CPU and waiting for one, their context switches): a slow window whose fills
wait for a CPU lost their cores; one whose fills neither ran nor waited slept
in the kernel.
"""
import bisect
import json
import sys


def main():
    t = json.load(open(sys.argv[1]))
    most = int(sys.argv[2]) if len(sys.argv) > 2 else 80
    mib = 1 << 20
    head = t.get("head_done_us", 0)
    print(f"restore done {t['restore_done_us'] / 1e3:.1f} ms, head start done {head / 1e3:.1f} ms; "
          f"{len(t['faults'])} faults, {len(t['fills'])} fills, {t.get('dropped', 0)} dropped")
    for pid, pieces in t["pieces"].items():
        pid = int(pid)
        # Contiguous pieces are one region (CRIU cuts its page map into
        # entries of its own sizes): the analysis is by region.
        runs = []
        for start, length in sorted(pieces):
            if runs and runs[-1][0] + runs[-1][1] == start:
                runs[-1][1] += length
            else:
                runs.append([start, length])
        pieces = runs
        starts = [p[0] for p in pieces]
        big = sorted(range(len(pieces)), key=lambda i: -pieces[i][1])[:12]
        print(f"pid {pid}: {len(pieces)} regions, {sum(p[1] for p in pieces) / 1e9:.2f} GB; largest (index: MiB): "
              + ", ".join(f"{i}: {pieces[i][1] // mib}" for i in sorted(big)))

        def where(addr):
            i = bisect.bisect_right(starts, addr) - 1
            if i < 0 or addr >= pieces[i][0] + pieces[i][1]:
                return None, 0
            return i, addr - pieces[i][0]

        fills = sorted((f for f in t["fills"] if f[2] == pid), key=lambda f: f[0])
        # Per piece: when the fill first and last touched it.
        span = {}
        for f in fills:
            i, _ = where(f[3])
            if i is None:
                continue
            a, b = span.get(i, (f[0], f[1]))
            span[i] = (min(a, f[0]), max(b, f[1]))
        order = sorted(span, key=lambda i: span[i][0])
        print("  fill order of the largest regions (index@start ms-end ms): "
              + ", ".join(f"{i}@{span[i][0] / 1e3:.0f}-{span[i][1] / 1e3:.0f}" for i in order if i in big))
        how = {0: "in flight", 1: "filled", 2: "zero"}
        faults = [f for f in t["faults"] if f[1] == pid]
        print(f"  faults ({len(faults)}): time ms, region, MiB into it / its MiB, how, fill span of that region ms")
        prev = None
        for f in faults[:most]:
            i, off = where(f[2])
            size = pieces[i][1] // mib if i is not None else 0
            s = span.get(i)
            mark = "" if prev is None or i == prev else ("  <- down" if i is not None and prev is not None and i < prev else "  -> up")
            print(f"    {f[0] / 1e3:8.1f}  {i!s:>5}  {off / mib:8.1f} / {size:<6} {how.get(f[3], f[3]):9} "
                  f"{'' if s is None else f'{s[0] / 1e3:.0f}-{s[1] / 1e3:.0f}'}{mark}")
            prev = i
        # Runs of faults in one piece, in time order: the reader's path.
        path = []
        for f in faults:
            i, _ = where(f[2])
            if not path or path[-1][0] != i:
                path.append([i, 0])
            path[-1][1] += 1
        print("  the faults' path through the regions (region x faults): "
              + " ".join(f"{i}x{n}" for i, n in path[:200]))


def timeline(t, step_us=100_000, end_us=3_000_000):
    """Per STEP of the wake: the bytes filled, and per MiB filled the wall
    time of its fills, their read and copy times, and the fill threads' time
    on a CPU and waiting for one (the trace's scheduler columns, when it has
    them), and their context switches."""
    fills = t["fills"]
    if not fills or len(fills[0]) < 12:
        return
    print("  ms     GB/s  per MiB: wall   read   copy    cpu   wait (ms)  switches per fill: vol  invol")
    for b in range(0, end_us, step_us):
        fs = [f for f in fills if b <= f[1] < b + step_us]
        if not fs:
            continue
        mib = sum(f[4] for f in fs) / (1 << 20)
        per = lambda i: sum(f[i] for f in fs) / mib / 1000
        if len(fs[0]) >= 12:
            vol = sum(f[10] for f in fs) / len(fs)
            inv = sum(f[11] for f in fs) / len(fs)
        print(f"  {b // 1000:5d} {sum(f[4] for f in fs) / step_us / 1e3:6.2f}  "
              f"{sum(f[1] - f[0] for f in fs) / mib / 1000:11.2f} {per(6):6.2f} {per(7):6.2f} {per(8):6.2f} {per(9):6.2f}"
              f"  {vol:19.2f} {inv:6.2f}")


if __name__ == "__main__":
    main()
    timeline(json.load(open(sys.argv[1])))
