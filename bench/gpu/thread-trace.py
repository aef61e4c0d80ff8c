#!/usr/bin/env python3
"""Which threads of a process work during a driver restore, and on which CPUs.

The driver's restore copies a checkpointed process's host memory back to the
GPU from inside that process. Whether that copy is one thread's CPU work (a
memcpy into pinned staging buffers, slowed by whatever else loads the memory
or shares its core) or the GPU's DMA (no CPU) decides what gpusnap's page
server may run beside it. bench/gpu/contend.sh samples the process's threads
around each restore.

Usage:
  thread-trace.py sample PID FILE STOPFILE [--every S] [--max S]
      every S seconds (default 0.02) until STOPFILE exists or --max seconds
      (default 120): for each thread of PID (waiting for the pid to appear,
      as after a CRIU restore), one line "unix_s tid cpu ticks comm" (ticks
      = utime + stime in clock ticks, cpu = the CPU it last ran on).
  thread-trace.py summary FILE [--top N]
      one line of key=value words: the span, the CPU seconds of the whole
      process, of the busiest thread and its share of the span, then the
      top N threads (default 5) as tid:comm:cpu_s:CPUs-it-ran-on.
"""
import argparse
import os
import sys
import time


def ticks_per_s():
    try:
        return os.sysconf("SC_CLK_TCK")
    except (ValueError, OSError):
        return 100


def read_tasks(pid):
    out = []
    base = f"/proc/{pid}/task"
    try:
        tids = os.listdir(base)
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"{base}/{tid}/stat") as f:
                s = f.read()
        except OSError:
            continue
        # comm may hold spaces and parentheses: split after the last ')'.
        lp, rp = s.find("("), s.rfind(")")
        comm = s[lp + 1:rp].replace(" ", "_") or "?"
        rest = s[rp + 2:].split()
        # rest[0] is field 3 (state); utime is field 14, stime 15, processor 39.
        try:
            ticks = int(rest[11]) + int(rest[12])
            cpu = int(rest[36])
        except (IndexError, ValueError):
            continue
        out.append((tid, cpu, ticks, comm))
    return out


def sample(pid, path, stop, every, max_s):
    start = time.monotonic()
    with open(path, "w") as out:
        out.write("# unix_s tid cpu ticks comm\n")
        while not os.path.exists(stop) and time.monotonic() - start < max_s:
            now = time.time()
            for tid, cpu, ticks, comm in read_tasks(pid):
                out.write(f"{now:.3f} {tid} {cpu} {ticks} {comm}\n")
            time.sleep(every)
    return 0


def summary(path, top):
    hz = ticks_per_s()
    first, last, cpus, comms = {}, {}, {}, {}
    t0 = t1 = None
    with open(path) as f:
        for line in f:
            if line.startswith("#"):
                continue
            p = line.split()
            if len(p) < 5:
                continue
            t, tid, cpu, ticks, comm = float(p[0]), p[1], int(p[2]), int(p[3]), p[4]
            t0 = t if t0 is None else t0
            t1 = t
            if tid not in first:
                first[tid] = ticks
            elif ticks > last.get(tid, first[tid]):
                cpus.setdefault(tid, set()).add(cpu)
            last[tid] = ticks
            comms[tid] = comm
    if t0 is None:
        print("threads=none")
        return 0
    used = {tid: (last[tid] - first[tid]) / hz for tid in first}
    span = max(t1 - t0, 1e-3)
    order = sorted(used, key=lambda k: -used[k])
    words = [f"threads_span_s={span:.3f}", f"threads_n={len(used)}",
             f"threads_cpu_s={sum(used.values()):.2f}"]
    if order:
        words.append(f"threads_top_cpu_s={used[order[0]]:.2f}")
        words.append(f"threads_top_share={used[order[0]] / span:.2f}")
    tops = []
    for tid in order[:top]:
        seen = ",".join(str(c) for c in sorted(cpus.get(tid, ())))
        tops.append(f"{tid}:{comms[tid]}:{used[tid]:.2f}:{seen or '-'}")
    words.append("threads_top=" + ";".join(tops))
    print(" ".join(words))
    return 0


def main(argv):
    ap = argparse.ArgumentParser(description="threads of a process during a driver restore")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("sample")
    sp.add_argument("pid")
    sp.add_argument("file")
    sp.add_argument("stopfile")
    sp.add_argument("--every", type=float, default=0.02)
    sp.add_argument("--max", type=float, default=120.0)
    su = sub.add_parser("summary")
    su.add_argument("file")
    su.add_argument("--top", type=int, default=5)
    a = ap.parse_args(argv[1:])
    if a.cmd == "sample":
        return sample(a.pid, a.file, a.stopfile, a.every, a.max)
    return summary(a.file, a.top)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
