#!/usr/bin/env python3
"""A syscall- and signal-heavy CPU program, to price the guard's tracing.

Under `gpusnap run` every signal delivery becomes a ptrace stop the guard
must answer, every system call passes the seccomp exit filter, and every
fork adds a traced child whose exit is a seccomp stop. This program does
each of those many times and times them apart:
    syscalls  N x (os.getppid() + os.stat("/"))
    signals   N x a self-sent SIGUSR1, caught by a Python handler
    forks     F x fork + waitpid of a child that _exit(0)s at once
One JSON object goes to stdout:
    {"pid", "n", "forks", "syscalls_s", "signals_s", "forks_s", "total_s",
     "handled", "ok"}
ok is false if a signal was lost or a child did not exit with 0.

Usage: sigheavy.py [--n N] [--signals S] [--forks F]
  --n N        syscall iterations (default 200000)
  --signals S  signal iterations (default: N / 10)
  --forks F    forks (default 20)
"""
import argparse
import json
import os
import signal
import sys
import time

HANDLED = 0


def on_usr1(_sig, _frame):
    global HANDLED
    HANDLED += 1


def main(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200000)
    ap.add_argument("--signals", type=int, default=None)
    ap.add_argument("--forks", type=int, default=20)
    a = ap.parse_args(argv)
    nsig = a.signals if a.signals is not None else max(1, a.n // 10)
    signal.signal(signal.SIGUSR1, on_usr1)
    pid = os.getpid()
    out = {"pid": pid, "n": a.n, "signals": nsig, "forks": a.forks}

    t0 = time.perf_counter()
    getppid, stat = os.getppid, os.stat
    for _ in range(a.n):
        getppid()
        stat("/")
    t1 = time.perf_counter()
    kill, usr1 = os.kill, signal.SIGUSR1
    for _ in range(nsig):
        kill(pid, usr1)
    t2 = time.perf_counter()
    bad = 0
    for _ in range(a.forks):
        child = os.fork()
        if child == 0:
            os._exit(0)
        _, status = os.waitpid(child, 0)
        if not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
            bad += 1
    t3 = time.perf_counter()

    out.update(syscalls_s=round(t1 - t0, 6), signals_s=round(t2 - t1, 6), forks_s=round(t3 - t2, 6),
               total_s=round(t3 - t0, 6), handled=HANDLED, bad_children=bad,
               ok=HANDLED == nsig and bad == 0)
    print(json.dumps(out), flush=True)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
