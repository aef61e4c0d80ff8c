#!/usr/bin/env python3
"""Bare ctypes binding of the CUDA driver's six checkpoint calls.

The GPU scripts use it for three things gpusnap must not be trusted with:
  * the baseline gpusnap is benchmarked against (driver calls, nothing else);
  * driving a process into states gpusnap refuses to create (the restore that
    fails for lack of memory and strands the process, reports/000);
  * the last-resort suspend in the scripts' cleanup, when `gpusnap stop` failed.

Usage:
  cuckpt.py [--timeout-ms MS] [--keep-going] [--deadline S] PID ACTION...
  ACTION: state | lock | checkpoint | restore | unlock | tid
          suspend (= lock checkpoint) | resume (= restore unlock)

The calls run in order in this one process, after one cuInit(0). One JSON
object goes to stdout:
  {"pid", "driver_version", "init_rc", "init_ms", "calls": [{"call", "rc",
   "err", "ms", ["state" | "tid"]}], "driver_ms", "final_state", "ok",
   "error", "py_ms"}
driver_ms is the sum of the lock/checkpoint/restore/unlock calls only; py_ms
is the time from this module's start to the end (no interpreter start-up).
A line per call also goes to stderr.

Exit: 0 every call returned CUDA_SUCCESS; 1 one did not (the rest were skipped
unless --keep-going); 2 bad usage; 6 the target is stopped (SIGSTOP or
ptrace stop), where the driver would hang, so nothing was called.
A deadline (--deadline, default 600 s) ends this process by SIGALRM if a
driver call hangs anyway.
"""
import argparse
import ctypes
import json
import signal
import sys
import time

T_START = time.perf_counter()

STATES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}
ERRORS = {
    0: "CUDA_SUCCESS",
    1: "CUDA_ERROR_INVALID_VALUE",
    2: "CUDA_ERROR_OUT_OF_MEMORY",
    3: "CUDA_ERROR_NOT_INITIALIZED",
    304: "CUDA_ERROR_OPERATING_SYSTEM",
    401: "CUDA_ERROR_ILLEGAL_STATE",
    600: "CUDA_ERROR_NOT_READY",
}
DRIVER_CALLS = ("lock", "checkpoint", "restore", "unlock")
MACROS = {"suspend": ["lock", "checkpoint"], "resume": ["restore", "unlock"]}
ACTIONS = ("state", "lock", "checkpoint", "restore", "unlock", "tid")


class LockArgs(ctypes.Structure):
    """CUcheckpointLockArgs: 64 bytes; timeoutMs 0 means no timeout."""
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint),
                ("reserved1", ctypes.c_uint64 * 7)]


assert ctypes.sizeof(LockArgs) == 64


class Driver:
    """The six cuCheckpointProcess* calls of libcuda.so.1, plus what they need."""

    def __init__(self, lib="libcuda.so.1"):
        cu = ctypes.CDLL(lib)
        i, p = ctypes.c_int, ctypes.c_void_p
        self._sig(cu.cuInit, [ctypes.c_uint])
        self._sig(cu.cuDriverGetVersion, [ctypes.POINTER(i)])
        self._sig(cu.cuGetErrorName, [i, ctypes.POINTER(ctypes.c_char_p)])
        self._sig(cu.cuCheckpointProcessLock, [i, ctypes.POINTER(LockArgs)])
        self._sig(cu.cuCheckpointProcessCheckpoint, [i, p])
        self._sig(cu.cuCheckpointProcessRestore, [i, p])
        self._sig(cu.cuCheckpointProcessUnlock, [i, p])
        self._sig(cu.cuCheckpointProcessGetState, [i, ctypes.POINTER(i)])
        self._sig(cu.cuCheckpointProcessGetRestoreThreadId, [i, ctypes.POINTER(i)])
        self.cu = cu

    @staticmethod
    def _sig(fn, argtypes):
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int

    def init(self):
        return self.cu.cuInit(0)

    def driver_version(self):
        v = ctypes.c_int(0)
        rc = self.cu.cuDriverGetVersion(ctypes.byref(v))
        return v.value if rc == 0 else None

    def err_name(self, rc):
        s = ctypes.c_char_p()
        if self.cu.cuGetErrorName(rc, ctypes.byref(s)) == 0 and s.value:
            return s.value.decode()
        return ERRORS.get(rc, f"CUDA_ERROR_{rc}")

    def get_state(self, pid):
        st = ctypes.c_int(-1)
        rc = self.cu.cuCheckpointProcessGetState(pid, ctypes.byref(st))
        return rc, STATES.get(st.value, str(st.value))

    def lock(self, pid, timeout_ms):
        args = LockArgs(timeout_ms, 0)
        return self.cu.cuCheckpointProcessLock(pid, ctypes.byref(args))

    def checkpoint(self, pid):
        return self.cu.cuCheckpointProcessCheckpoint(pid, None)

    def restore(self, pid):
        return self.cu.cuCheckpointProcessRestore(pid, None)

    def unlock(self, pid):
        return self.cu.cuCheckpointProcessUnlock(pid, None)

    def restore_tid(self, pid):
        tid = ctypes.c_int(-1)
        rc = self.cu.cuCheckpointProcessGetRestoreThreadId(pid, ctypes.byref(tid))
        return rc, tid.value


def proc_state(pid):
    """The one-letter state of /proc/PID/stat, or None if there is no such pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--timeout-ms", type=int, default=10000,
                    help="lock timeout in ms (0 = none; default 10000)")
    ap.add_argument("--keep-going", action="store_true",
                    help="run the remaining calls after one fails")
    ap.add_argument("--deadline", type=int, default=600,
                    help="end this process (SIGALRM) after S seconds (default 600)")
    ap.add_argument("pid", type=int)
    ap.add_argument("actions", nargs="+", choices=ACTIONS + tuple(MACROS))
    a = ap.parse_args(argv)
    # Default SIGALRM action ends the process even inside a hung driver call.
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(max(1, a.deadline))

    actions = [x for act in a.actions for x in MACROS.get(act, [act])]
    out = {"pid": a.pid, "actions": actions, "calls": [], "ok": False,
           "final_state": None, "error": None}
    t0 = time.perf_counter()
    try:
        drv = Driver()
    except (OSError, AttributeError) as e:  # no libcuda.so.1, or one without the API
        out["error"] = f"cannot load the driver: {e}"
        out["py_ms"] = round((time.perf_counter() - T_START) * 1e3, 3)
        print(json.dumps(out), flush=True)
        return 1
    out["init_rc"] = drv.init()
    out["init_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
    out["driver_version"] = drv.driver_version()
    code = 0
    if out["init_rc"] != 0:
        out["error"] = f"cuInit failed: {drv.err_name(out['init_rc'])}"
        code = 1
    else:
        for act in actions:
            if proc_state(a.pid) in ("T", "t"):
                out["error"] = f"pid {a.pid} is stopped; the driver would hang on it"
                code = 6
                break
            rec = {"call": act}
            t = time.perf_counter()
            if act == "state":
                rc, st = drv.get_state(a.pid)
                rec["state"] = st if rc == 0 else None
            elif act == "lock":
                rc = drv.lock(a.pid, a.timeout_ms)
            elif act == "tid":
                rc, rec["tid"] = drv.restore_tid(a.pid)
            else:
                rc = getattr(drv, act)(a.pid)
            rec["ms"] = round((time.perf_counter() - t) * 1e3, 3)
            rec["rc"] = rc
            rec["err"] = drv.err_name(rc)
            out["calls"].append(rec)
            if act == "state":
                out["final_state"] = rec["state"]
            print(f"cuckpt: {act} pid={a.pid} -> {rc} {rec['err']}"
                  + (f" state={rec['state']}" if act == "state" else "")
                  + f" {rec['ms']:.1f} ms", file=sys.stderr, flush=True)
            if rc != 0:
                code = 1
                if not a.keep_going:
                    break
    out["driver_ms"] = round(sum(c["ms"] for c in out["calls"] if c["call"] in DRIVER_CALLS), 3)
    out["ok"] = code == 0
    out["py_ms"] = round((time.perf_counter() - T_START) * 1e3, 3)
    print(json.dumps(out), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
