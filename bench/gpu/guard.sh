#!/usr/bin/env bash
# What the guard costs a program running under it, in both of its modes:
# "guarded" = `gpusnap run --no-keeper` (ptrace + seccomp exit filter),
# "light" = `gpusnap run --light` (the preload library, no tracing).
#
# Run from the repository root, as root:
#   OUT=/some/dir bench/gpu/guard.sh
# (on a machine without a GPU, GPU_R=0 runs (a) only)
# (a) bench/gpu/sigheavy.py, a CPU program heavy in system calls (seccomp
#     filter on each when traced), self-sent signals (a ptrace stop the
#     guard answers for each) and forks (a traced child each): SIG_R runs
#     each way, interleaved (the order rotates); medians and slowdown per
#     phase.
# (b) a PyTorch training loop (an MLP, fixed steps, torch.cuda.synchronize
#     each step, steps/s timed inside the program): GPU_R runs each way,
#     interleaved; slowdown of the median (target: below 1%).
# The programs time themselves, so the guard's start (driver load, journal)
# and its suspend at the program's exit are not in the medians; the wall
# time of the whole command, which has them, is reported beside.
# Environment:
#   GPUSNAP          the binary (default ./target/release/gpusnap)
#   OUT              results directory (default: a new /tmp/gpusnap-out.* dir)
#   GUARD_BENCH_BUDGET_S  soft budget (default 200 s); a watchdog ends the run,
#                    through the cleanup, 40 s after it
#   SIG_R SIG_N SIG_SIGNALS SIG_FORKS  (a): runs each way (5), syscall
#                    iterations (200000), signals (20000), forks (20)
#   GPU_R TRAIN_STEPS TRAIN_WARMUP TRAIN_WIDTH TRAIN_BATCH TRAIN_LAYERS
#                    (b): runs each way (3), timed steps (300), untimed
#                    warm-up steps (30), MLP width (4096), batch (1024),
#                    layers (4)
#   TRAIN_ARGS       extra arguments for the training program (a dry run
#                    against gpusnap's fake driver uses "--backend driver")
# Writes $OUT/guard-bench.md (also printed on stdout) and $OUT/guard-bench.log.
# Exit 0 when every planned run ran and checked out, 1 otherwise (whether the
# slowdown target is met is in the table).

NAME=guard-bench # read by lib.sh
# shellcheck source=tests/gpu/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/../../tests/gpu/lib.sh"
# This directory: the probes and workloads only the benchmarks use.
BENCH_GPU_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

BUDGET_S=${GUARD_BENCH_BUDGET_S:-200}
SIG_R=${SIG_R:-5}
SIG_N=${SIG_N:-200000}
SIG_SIGNALS=${SIG_SIGNALS:-20000}
SIG_FORKS=${SIG_FORKS:-20}
GPU_R=${GPU_R:-3}
TRAIN_STEPS=${TRAIN_STEPS:-300}
TRAIN_WARMUP=${TRAIN_WARMUP:-30}
TRAIN_WIDTH=${TRAIN_WIDTH:-4096}
TRAIN_BATCH=${TRAIN_BATCH:-1024}
TRAIN_LAYERS=${TRAIN_LAYERS:-4}
read -r -a TARGS <<<"${TRAIN_ARGS:-}"
RUN_TIMEOUT_S=90

RUNS_TSV=$WORK/runs.tsv     # bench, variant, rep, rc, wall_s, json
: >"$RUNS_TSV"
PLANNED=0 BAD=0 FINISHED=0
NOTES=()                    # lines for the report

# ---------------------------------------------------------------- the training program

TRAIN_PY=$WORK/train_mlp.py
cat >"$TRAIN_PY" <<'PY'
"""A small MLP trained for a fixed number of steps; prints one JSON line."""
import argparse, json, os, sys, time
ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=300)
ap.add_argument("--warmup", type=int, default=30)
ap.add_argument("--width", type=int, default=4096)
ap.add_argument("--batch", type=int, default=1024)
ap.add_argument("--layers", type=int, default=4)
ap.add_argument("--backend", choices=("torch", "driver"), default="torch")
ap.add_argument("--gpu-dir", default=os.path.dirname(os.path.abspath(__file__)))
a = ap.parse_args()
out = {"pid": os.getpid(), "backend": a.backend, "steps": a.steps}
if a.backend == "torch":
    import torch
    torch.manual_seed(0)
    dev = "cuda"
    layers = []
    for _ in range(a.layers - 1):
        layers += [torch.nn.Linear(a.width, a.width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(a.width, a.width))
    model = torch.nn.Sequential(*layers).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(a.batch, a.width, device=dev)
    y = torch.randn(a.batch, a.width, device=dev)
    lossf = torch.nn.MSELoss()

    def step():
        opt.zero_grad(set_to_none=True)
        loss = lossf(model(x), y)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        return loss
    out["torch"] = torch.__version__
else:
    # gpusnap's fake driver (dry runs): a copy in and out and a sync per step.
    sys.path.insert(0, a.gpu_dir)
    sys.dont_write_bytecode = True  # no __pycache__ in the checkout
    from dying_worker import DriverData
    d = DriverData(1 / 1024)

    def step():
        d.check()
        return None
for _ in range(a.warmup):
    step()
t0 = time.perf_counter()
for _ in range(a.steps):
    loss = step()
secs = time.perf_counter() - t0
out.update(secs=round(secs, 6), steps_per_s=round(a.steps / secs, 3),
           loss=None if loss is None else float(loss.item()))
print(json.dumps(out), flush=True)
PY

# ---------------------------------------------------------------- runs

# one BENCH VARIANT REP CMD...: runs CMD (under the guard when VARIANT is
# guarded), appends a row to RUNS_TSV. The program's JSON is its last stdout line.
one() {
    local bench=$1 variant=$2 rep=$3 t0 t1 rc=0 json wall o e
    shift 3
    o=$WORK/$bench.$variant.$rep.out
    e=$WORK/$bench.$variant.$rep.err
    t0=$(now)
    if [ "$variant" = guarded ]; then
        log "$bench $variant #$rep: gpusnap run --no-keeper -- $*"
        timeout -k 10 "$RUN_TIMEOUT_S" "$GPUSNAP" --state-dir "$STATE_DIR" run --no-keeper --name "bench-$bench-$rep" -- "$@" \
            </dev/null >"$o" 2>"$e" || rc=$?
    elif [ "$variant" = light ]; then
        log "$bench $variant #$rep: gpusnap run --light -- $*"
        timeout -k 10 "$RUN_TIMEOUT_S" "$GPUSNAP" --state-dir "$STATE_DIR" run --light --name "bench-$bench-$rep" -- "$@" \
            </dev/null >"$o" 2>"$e" || rc=$?
    else
        log "$bench $variant #$rep: $*"
        timeout -k 10 "$RUN_TIMEOUT_S" "$@" </dev/null >"$o" 2>"$e" || rc=$?
    fi
    t1=$(now)
    wall=$(fsub "$t0" "$t1")
    json=$(grep '^{' "$o" | tail -n 1)
    log "  -> exit $rc in ${wall}s: ${json:-no JSON}"
    if [ "$rc" != 0 ] || [ -z "$json" ]; then
        log "  stderr: $(tail -n 5 "$e" | cut -c1-300 | tr '\n' '|')"
    fi
    if [ "$rep" != warm ]; then
        PLANNED=$((PLANNED + 1))
        if [ "$rc" != 0 ] || [ -z "$json" ] || [[ $json == *'"ok": false'* ]]; then BAD=$((BAD + 1)); fi
        printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$bench" "$variant" "$rep" "$rc" "$wall" "${json:-none}" >>"$RUNS_TSV"
    fi
}

# trio BENCH REP CMD...: one run each way; the order rotates with REP.
trio() {
    local bench=$1 rep=$2 v
    shift 2
    local order=(unguarded guarded light)
    case $((rep % 3)) in
    2) order=(guarded light unguarded) ;;
    0) order=(light unguarded guarded) ;;
    esac
    for v in "${order[@]}"; do one "$bench" "$v" "$rep" "$@"; done
}

# left: seconds of the soft budget left.
left() { echo $((BUDGET_S - SECONDS)); }

bench_sig() {
    local r cmd=(python3 "$BENCH_GPU_DIR/sigheavy.py" --n "$SIG_N" --signals "$SIG_SIGNALS" --forks "$SIG_FORKS")
    log "(a) sigheavy: $SIG_R runs each way"
    one sig unguarded warm "${cmd[@]}"
    one sig guarded warm "${cmd[@]}"
    one sig light warm "${cmd[@]}"
    for r in $(seq 1 "$SIG_R"); do
        if [ "$(left)" -lt 20 ]; then
            NOTES+=("(a) stopped after $((r - 1)) of $SIG_R pairs: budget")
            BAD=$((BAD + 1))
            break
        fi
        trio sig "$r" "${cmd[@]}"
    done
}

bench_gpu() {
    local r pid cmd=(python3 "$TRAIN_PY" --steps "$TRAIN_STEPS" --warmup "$TRAIN_WARMUP" --width "$TRAIN_WIDTH"
        --batch "$TRAIN_BATCH" --layers "$TRAIN_LAYERS" --gpu-dir "$GPU_DIR" ${TARGS[@]+"${TARGS[@]}"})
    log "(b) training loop: $GPU_R runs each way"
    # Warm-up (CUDA init, kernel selection, caches), not counted.
    one gpu unguarded warm "${cmd[@]}"
    for r in $(seq 1 "$GPU_R"); do
        if [ "$(left)" -lt 40 ]; then
            NOTES+=("(b) stopped after $((r - 1)) of $GPU_R pairs: budget")
            BAD=$((BAD + 1))
            break
        fi
        trio gpu "$r" "${cmd[@]}"
        # What the guard did at the guarded program's own (normal) exit.
        pid=$(grep -h '^{' "$WORK/gpu.guarded.$r.out" 2>/dev/null | tail -n 1 |
            python3 -c 'import json,sys; print(json.load(sys.stdin)["pid"])' 2>/dev/null)
        if [ -n "$pid" ]; then
            gs 30 history "$pid"
            EXIT_NOTE=$(jget "$GS_OUT" '"; ".join(e["detail"] for e in d["events"] if e["op"] == "guard" and e["phase"] == "note" and not e["detail"].startswith("guarded by"))')
            log "guard at the exit of training pid $pid: ${EXIT_NOTE:-nothing journalled}"
        fi
    done
}

# ---------------------------------------------------------------- report

# shellcheck disable=SC2317 # runs from the EXIT trap
write_report() {
    local md=$OUT/guard-bench.md n
    {
        echo "# gpusnap guard: overhead"
        echo
        echo "- date: $HDR_DATE"
        echo "- host: $HDR_HOST (kernel $HDR_KERNEL, host memory $HDR_HOSTMEM, $(nproc) CPUs)"
        if command -v nvidia-smi >/dev/null; then
            echo "- GPU: $HDR_GPU, $HDR_GPU_MEM; driver $HDR_DRIVER"
        else
            echo "- GPU: none (no nvidia-smi)"
        fi
        echo "- gpusnap: $HDR_VERSION ($GPUSNAP); guarded = \`gpusnap run --no-keeper -- CMD\`; light = \`gpusnap run --light -- CMD\`"
        echo "- (a) sigheavy.py: $SIG_N x (getppid + stat), $SIG_SIGNALS self-sent SIGUSR1 (handled), $SIG_FORKS fork + wait; $SIG_R runs each way after one warm-up each, interleaved (the order rotates)"
        [ "$GPU_R" -gt 0 ] || echo "- (b) not run (GPU_R=0)"
        [ "$GPU_R" -gt 0 ] && echo "- (b) MLP $TRAIN_LAYERS x $TRAIN_WIDTH, batch $TRAIN_BATCH, SGD, $TRAIN_STEPS timed steps after $TRAIN_WARMUP warm-up steps, torch.cuda.synchronize each step${TRAIN_ARGS:+ ($TRAIN_ARGS)}; $GPU_R runs each way after one unguarded warm-up run, interleaved (the order rotates)"
        echo "- figures: medians; the programs time their own work (no guard start, no exit suspend); wall = the whole command"
        echo "- runs: $PLANNED planned ran, $BAD failed or missing; wall ${SECONDS} s (budget $BUDGET_S s)"
        for n in ${NOTES[@]+"${NOTES[@]}"}; do echo "- $n"; done
        echo
        python3 - "$RUNS_TSV" <<'PY' || echo "(no table: $?)"
import json, statistics, sys
runs = {}
for line in open(sys.argv[1]):
    f = line.rstrip("\n").split("\t")
    if len(f) < 6:
        continue
    bench, variant, rep, rc, wall = f[:5]
    try:
        j = json.loads(f[5])
    except ValueError:
        j = {}
    if rc != "0" or not j or j.get("ok") is False:
        continue
    j["wall_s"] = float(wall)
    runs.setdefault((bench, variant), []).append(j)

def med(bench, variant, key):
    v = [r[key] for r in runs.get((bench, variant), []) if r.get(key) is not None]
    return (statistics.median(v), len(v)) if v else (None, 0)

def fmt(x, unit, scale=1.0, digits=3):
    return "-" if x is None else f"{x * scale:.{digits}f} {unit}".strip()

print("| bench | figure | unguarded | guarded (ptrace) | slowdown | light | slowdown | runs (u/g/l) |")
print("|---|---|---|---|---|---|---|---|")
TITLE = {"sig": "(a) sigheavy", "gpu": "(b) training"}
def line(bench, label, key, unit, scale=1.0, digits=3, per=None, higher_better=False):
    u, nu = med(bench, "unguarded", key)
    cells, slows, ns = [], [], [str(nu)]
    for variant in ("guarded", "light"):
        g, ng = med(bench, variant, key)
        if per and u is not None and g is not None:
            g = g / per
        uu = u / per if per and u is not None else u
        if uu and g is not None:
            slow = (uu / g - 1) * 100 if higher_better else (g / uu - 1) * 100
            sl = f"{slow:+.2f} %"
        else:
            sl = "-"
        cells.append(fmt(g, unit, scale, digits))
        slows.append(sl)
        ns.append(str(ng))
    uu = u / per if per and u is not None else u
    print(f"| {TITLE[bench]} | {label} | {fmt(uu, unit, scale, digits)} | {cells[0]} | {slows[0]} | {cells[1]} | {slows[1]} | {'/'.join(ns)} |")
    return slows

sig = runs.get(("sig", "unguarded"), []) + runs.get(("sig", "guarded"), [])
if sig:
    n, ns, nf = sig[0]["n"], sig[0]["signals"], sig[0]["forks"]
    line("sig", "total (in program)", "total_s", "s")
    line("sig", f"getppid + stat, per iteration ({n})", "syscalls_s", "us", 1e6, 3, per=n)
    line("sig", f"SIGUSR1 to self, per signal ({ns})", "signals_s", "us", 1e6, 2, per=ns)
    line("sig", f"fork + wait, per fork ({nf})", "forks_s", "ms", 1e3, 3, per=nf)
    line("sig", "wall (whole command)", "wall_s", "s")
gpu = runs.get(("gpu", "unguarded"), []) + runs.get(("gpu", "guarded"), [])
if gpu:
    s = line("gpu", "steps/s (in program)", "steps_per_s", "", 1.0, 2, higher_better=True)
    best = {v: max((r["steps_per_s"] for r in runs.get(("gpu", v), [])), default=None) for v in ("unguarded", "guarded", "light")}
    ub = best["unguarded"]
    bs = [f"{(ub / best[v] - 1) * 100:+.2f} %" if ub and best[v] else "-" for v in ("guarded", "light")]
    print(f"| (b) training | best steps/s | {fmt(ub, '', 1, 2)} | {fmt(best['guarded'], '', 1, 2)} | {bs[0]} | {fmt(best['light'], '', 1, 2)} | {bs[1]} | - |")
    line("gpu", "wall (whole command, incl. the exit suspend when guarded)", "wall_s", "s")
    print()
    for name, sl in zip(("guarded (ptrace)", "light"), s):
        try:
            met = "met" if float(sl.split()[0]) < 1.0 else "NOT met"
        except ValueError:
            met = "unknown (no runs)"
        print(f"Target for (b), {name}: slowdown of the median steps/s below 1 %: **{met}** ({sl}).")
if sig:
    print()
    u, _ = med("sig", "unguarded", "total_s")
    for name, v in (("guarded (ptrace)", "guarded"), ("light", "light")):
        g, _ = med("sig", v, "total_s")
        if u and g:
            sl = (g / u - 1) * 100
            print(f"Target for (a), {name}: total slowdown below 1 %: **{'met' if sl < 1.0 else 'NOT met'}** ({sl:+.2f} %).")
print()
print("Slowdown: guarded / unguarded - 1 for times, unguarded / guarded - 1 for rates; positive = the guard costs.")
print()
print("| bench | variant | rep | exit | wall s | program output |")
print("|---|---|---|---|---|---|")
for line_ in open(sys.argv[1]):
    f = line_.rstrip("\n").split("\t")
    if len(f) >= 6:
        print(f"| {f[0]} | {f[1]} | {f[2]} | {f[3]} | {f[4]} | `{f[5][:220]}` |")
PY
        if [ -n "${EXIT_NOTE:-}" ]; then
            echo
            echo "Guard at the guarded training program's own exit (history of its last run): $EXIT_NOTE"
        fi
    } >"$md"
    cat "$md"
}

# shellcheck disable=SC2317 # the EXIT trap
on_exit() {
    local rc=$? p
    trap - ERR
    if [ "$FINISHED" != 1 ]; then
        NOTES+=("interrupted (exit $rc) at +${SECONDS}s")
        BAD=$((BAD + 1))
    fi
    cleanup_all
    write_report
    for p in "$WORK"/*.err; do log_file "$(basename "$p")" "$p"; done
    log "scratch kept in $WORK"
    if [ "$BAD" -gt 0 ]; then exit 1; fi
    exit 0
}

# ---------------------------------------------------------------- main

install_traps
start_watchdog $((BUDGET_S + 40))
log "gpusnap guard bench: budget ${BUDGET_S}s"
collect_header
bench_sig
if [ "$GPU_R" -gt 0 ]; then bench_gpu; fi
FINISHED=1
