#!/usr/bin/env python3
"""The GPU's PCIe receive rate over time: how fast a driver restore copies.

A restore's host-to-device copy is the data the GPU receives over PCIe, so
its rate over time is the driver's progress, which the page server's own
trace (GPUSNAP_PAGES_TRACE) cannot see once its fill is ahead of the
driver (no faults). Used by hibernate.sh (HB_PCIE=1) around the
driver's restore alone and around each wake, to tell whether the restore
runs slower only while the fill runs beside it, or all along.

Usage:
  pcie-trace.py sample FILE STOPFILE [--gpu N] [--max S]
      samples NVML's PCIe RX throughput (nvmlDeviceGetPcieThroughput, KB/s
      over its own 20 ms window) and the device memory in use, until
      STOPFILE exists or S seconds (default 300) have passed; one line per
      sample to FILE: unix time, RX KB/s, memory used MiB. NVML through
      ctypes: no Python package needed. A GPU or driver without the counter
      writes '# unsupported: ...' and exits 0.
  pcie-trace.py summary FILE T0 [--bin S]
      from FILE, relative to unix time T0 (the command's start): the bytes
      received, when 10/50/90/99 % of them had arrived, the peak and the
      mean rate between 10 and 90 %, and the rate per bin of S seconds
      (default 0.5), as key=value words on one line then the bins on a
      second line ('bins=...').
"""
import ctypes
import os
import sys
import time


def sample(path, stop, gpu, max_s):
    with open(path, "w") as out:
        try:
            nvml = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError as e:
            out.write(f"# unsupported: {e}\n")
            return 0
        if nvml.nvmlInit_v2() != 0:
            out.write("# unsupported: nvmlInit_v2 failed\n")
            return 0
        dev = ctypes.c_void_p()
        if nvml.nvmlDeviceGetHandleByIndex_v2(gpu, ctypes.byref(dev)) != 0:
            out.write(f"# unsupported: no GPU {gpu}\n")
            return 0

        class Memory(ctypes.Structure):
            _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong),
                        ("used", ctypes.c_ulonglong)]

        mem = Memory()
        kbps = ctypes.c_uint()
        try:
            rx = nvml.nvmlDeviceGetPcieThroughput
        except AttributeError as e:
            out.write(f"# unsupported: {e}\n")
            return 0
        out.write("# unix_s rx_kbps used_mib\n")
        start = time.monotonic()
        while not os.path.exists(stop) and time.monotonic() - start < max_s:
            t0 = time.time()
            rc = rx(dev, 1, ctypes.byref(kbps))  # NVML_PCIE_UTIL_RX_BYTES
            t1 = time.time()
            if rc != 0:
                out.write(f"# unsupported: nvmlDeviceGetPcieThroughput returned {rc}\n")
                return 0
            used = -1
            if nvml.nvmlDeviceGetMemoryInfo(dev, ctypes.byref(mem)) == 0:
                used = mem.used >> 20
            # The counter covers the call's own ~20 ms: stamp its middle.
            out.write(f"{(t0 + t1) / 2:.4f} {kbps.value} {used}\n")
            if t1 - t0 < 0.005:
                time.sleep(0.02)  # a counter that answers at once: pace it
        out.flush()
    return 0


def summary(path, t0, bin_s):
    rows = []
    with open(path) as f:
        for line in f:
            if line.startswith("#"):
                if "unsupported" in line:
                    print("pcie=unsupported")
                    print("bins=")
                    return 0
                continue
            p = line.split()
            if len(p) >= 2:
                rows.append((float(p[0]) - t0, int(p[1]) * 1000.0))
    if len(rows) < 2:
        print("pcie_samples=%d" % len(rows))
        print("bins=")
        return 0
    # Bytes received: each sample's rate over the time to the next one.
    cum, total, peak = [], 0.0, 0.0
    for (t, r), (t2, _) in zip(rows, rows[1:]):
        total += r * (t2 - t)
        cum.append((t2, total))
        peak = max(peak, r)
    words = {"pcie_samples": len(rows), "pcie_gb": round(total / 1e9, 3),
             "pcie_peak_gbps": round(peak / 1e9, 2)}
    at = {}
    for q in (10, 50, 90, 99):
        at[q] = next((t for t, c in cum if c >= total * q / 100), None)
        if at[q] is not None:
            words[f"pcie_t{q}_s"] = round(at[q], 3)
    if at.get(10) is not None and at.get(90) is not None and at[90] > at[10]:
        words["pcie_mid_gbps"] = round(total * 0.8 / (at[90] - at[10]) / 1e9, 2)
    print(" ".join(f"{k}={v}" for k, v in words.items()))
    bins = {}
    for (t, r), (t2, _) in zip(rows, rows[1:]):
        if t >= 0:
            bins.setdefault(int(t // bin_s), []).append((r, t2 - t))
    last = max(bins) if bins else -1
    series = []
    for b in range(last + 1):
        got = bins.get(b, [])
        span = sum(d for _, d in got)
        series.append("%.1f" % (sum(r * d for r, d in got) / span / 1e9 if span else 0.0))
    print(f"bins={bin_s}s:" + ",".join(series))
    return 0


def main(argv):
    if len(argv) >= 3 and argv[0] == "sample":
        gpu, max_s = 0, 300.0
        rest = argv[3:]
        while rest:
            if rest[0] == "--gpu" and len(rest) > 1:
                gpu = int(rest[1])
            elif rest[0] == "--max" and len(rest) > 1:
                max_s = float(rest[1])
            else:
                break
            rest = rest[2:]
        return sample(argv[1], argv[2], gpu, max_s)
    if len(argv) >= 3 and argv[0] == "summary":
        bin_s = float(argv[4]) if len(argv) >= 5 and argv[3] == "--bin" else 0.5
        return summary(argv[1], float(argv[2]), bin_s)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
