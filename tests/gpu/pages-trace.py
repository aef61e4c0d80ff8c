#!/usr/bin/env python3
"""Sums up a lazy wake's page-server trace (GPUSNAP_PAGES_TRACE=FILE, see
docs/pages.md): where the faults fell (which piece of the process's memory,
how far into it, whether a fill had it in flight) against where the
background fill was, to find the order in which a driver's restore reads.

Usage: tests/gpu/pages-trace.py TRACE.json [MAX_FAULTS]
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


if __name__ == "__main__":
    main()
