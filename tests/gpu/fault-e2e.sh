#!/usr/bin/env bash
# GPU end-to-end checks of a guarded process whose CUDA context faults
# (docs/design/safety.md, "A faulted context"), on one GPU.
#
# Run from the repository root, on a machine with a GPU, as root:
#   OUT=/some/dir tests/gpu/fault-e2e.sh
# Environment:
#   GPUSNAP          the binary (default ./target/release/gpusnap), with
#                    libgpusnap_preload.so next to it (the light guard)
#   OUT              results directory (default: a new /tmp/gpusnap-fault.* dir)
#   FAULT_BUDGET_S   soft budget in seconds (default 240): cases that would
#                    not fit are skipped (and count as failures)
#   FAULT_GIB        GiB each worker holds (default 1)
#   FAULT_BACKENDS   default "torch cupy" (tests/gpu/fault_worker.py)
#   FAULT_GUARDS     default "traced light" (`gpusnap run` and `run --light`)
#   FAULT_RESTORED   default "0 1": 1 suspends and resumes the worker first
#   FAULT_POLICIES   default "exit hold" (`run --on-fault`)
# Writes $OUT/fault-e2e.md (the table, also on stdout) and $OUT/fault-e2e.log.
# Exit 0 when every case passed.
#
# Every worker starts at once under its own `gpusnap run`, each holding
# FAULT_GIB GiB through PyTorch or CuPy; those marked restored are suspended
# and resumed. Then, one case at a time, the worker runs a kernel that
# writes through a null pointer (CUDA_ERROR_ILLEGAL_ADDRESS), and its next
# framework call raises, so it exits. Checked per case: the guard's lock
# answered 700 and the journal says the context faulted (with the kernel
# log's Xid lines where the guard could read them); with `exit` the death
# goes on and `run` exits 7; with `hold` the process stays alive, `ps` says
# `faulted`, a plain `stop` is refused, `stop --force` ends it (SIGKILL)
# and `run` exits 7. The times from the fault to the end (exit) and from
# the SIGKILL to the process gone (hold) are the teardown of a faulted
# context on this driver. Afterwards NVML must list none of the workers.

set -u
export LC_ALL=C TZ=UTC PYTHONUNBUFFERED=1
T0=$SECONDS
GPUSNAP=${GPUSNAP:-./target/release/gpusnap}
GPUSNAP=$(cd "$(dirname "$GPUSNAP")" && pwd)/$(basename "$GPUSNAP")
if [ -z "${OUT:-}" ]; then OUT=$(mktemp -d /tmp/gpusnap-fault.XXXXXX); fi
mkdir -p "$OUT"
BUDGET=${FAULT_BUDGET_S:-240}
GIB=${FAULT_GIB:-1}
read -r -a BACKENDS <<<"${FAULT_BACKENDS:-torch cupy}"
read -r -a GUARDS <<<"${FAULT_GUARDS:-traced light}"
read -r -a RESTORED <<<"${FAULT_RESTORED:-0 1}"
read -r -a POLICIES <<<"${FAULT_POLICIES:-exit hold}"
STATE=$(mktemp -d /tmp/gpusnap-fault-state.XXXXXX)
WORK=$(mktemp -d /tmp/gpusnap-fault-work.XXXXXX)
LOG=$OUT/fault-e2e.log
MD=$OUT/fault-e2e.md
: >"$LOG"
WORKER=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/fault_worker.py

log() { printf '%s +%ss %s\n' "$(date +%H:%M:%S)" "$((SECONDS - T0))" "$*" >>"$LOG"; }
G() { timeout 90 "$GPUSNAP" --state-dir "$STATE" "$@"; }
alive() { [ -r "/proc/$1/stat" ] && ! awk '{ sub(/.*\) /, ""); exit ($1 == "Z" ? 0 : 1) }' "/proc/$1/stat"; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }'; }

CASES=()
for b in "${BACKENDS[@]}"; do for g in "${GUARDS[@]}"; do for r in "${RESTORED[@]}"; do for p in "${POLICIES[@]}"; do
    CASES+=("$b-$g-r$r-$p")
done; done; done; done

cleanup() {
    local c pid
    for c in "${CASES[@]}"; do
        pid=$(cut -d' ' -f1 "$WORK/$c.st" 2>/dev/null) || continue
        alive "$pid" || continue
        if G history "$pid" 2>/dev/null | grep -q "CUDA context faulted"; then
            log "cleanup: $c ($pid) faulted: stop --force"
            G stop --force "$pid" >>"$LOG" 2>&1
        else
            log "cleanup: $c ($pid): stop (suspended first)"
            G stop --grace 5 "$pid" >>"$LOG" 2>&1 || G stop --force "$pid" >>"$LOG" 2>&1
        fi
    done
}
trap cleanup EXIT

log "gpusnap: $("$GPUSNAP" --version 2>&1 | head -n 1); driver: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -n 1)"
log "kernel log readable: $(dd if=/dev/kmsg bs=8192 count=1 iflag=nonblock status=none >/dev/null 2>&1 && echo yes || echo no)"

# Every worker at once (imports and CUDA start-up overlap).
for c in "${CASES[@]}"; do
    IFS=- read -r b g r p <<<"$c"
    light=()
    [ "$g" = light ] && light=(--light)
    (
        "$GPUSNAP" --state-dir "$STATE" run "${light[@]}" --on-fault "$p" --name "$c" -- \
            python3 "$WORKER" "$GIB" "$WORK/$c.st" --backend "$b" >"$WORK/$c.out" 2>&1
        echo $? >"$WORK/$c.rc"
    ) &
done
deadline=$((SECONDS + 180))
for c in "${CASES[@]}"; do
    while [ ! -s "$WORK/$c.st" ] && [ ! -e "$WORK/$c.rc" ] && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
done
log "workers started after $((SECONDS - T0)) s"

ROWS=()
NFAIL=0
row() { ROWS+=("| $* |"); }

for c in "${CASES[@]}"; do
    IFS=- read -r b g r p <<<"$c"
    if [ $((SECONDS - T0)) -gt "$BUDGET" ]; then
        row "$b | $g | ${r#r} | $p | skipped: over budget | | | | | FAIL"
        NFAIL=$((NFAIL + 1))
        continue
    fi
    pid=$(cut -d' ' -f1 "$WORK/$c.st" 2>/dev/null)
    if [ -z "$pid" ]; then
        row "$b | $g | ${r#r} | $p | did not start ($(tail -n 1 "$WORK/$c.out" 2>/dev/null)) | | | | | FAIL"
        NFAIL=$((NFAIL + 1))
        continue
    fi
    note=""
    ok=1
    if [ "$r" = r1 ]; then
        G suspend "$pid" >>"$LOG" 2>&1 || { ok=0; note="suspend failed; "; }
        G resume "$pid" >>"$LOG" 2>&1 || { ok=0; note="${note}resume failed; "; }
    fi
    it=$(cut -d' ' -f2 "$WORK/$c.st")
    t=$(now)
    : >"$WORK/$c.st.fault"
    log "$c: fault in $pid (iteration $it)"
    end_s="" gone_s="" stop_rc="" ps_state=""
    if [ "$p" = exit ]; then
        d=$((SECONDS + 60))
        while [ ! -e "$WORK/$c.rc" ] && [ $SECONDS -lt $d ]; do sleep 0.05; done
        end_s=$(since "$t")
        [ -e "$WORK/$c.rc" ] || { ok=0; note="${note}run did not end in 60 s; "; }
    else
        d=$((SECONDS + 60))
        until G history "$pid" 2>/dev/null | grep -q "held (on-fault hold)"; do
            [ $SECONDS -lt $d ] && [ ! -e "$WORK/$c.rc" ] || break
            sleep 0.2
        done
        end_s="held $(since "$t")"
        alive "$pid" || { ok=0; note="${note}not held: gone; "; }
        sleep 2
        alive "$pid" || { ok=0; note="${note}died while held; "; }
        ps_state=$(G --json ps 2>/dev/null | python3 -c "
import json, sys
rows = [r for r in json.load(sys.stdin).get('processes', []) if r.get('pid') == $pid]
print(rows[0]['state'] if rows else 'absent')" 2>/dev/null)
        [ "$ps_state" = faulted ] || { ok=0; note="${note}ps says $ps_state; "; }
        G stop "$pid" >>"$LOG" 2>&1
        stop_rc=$?
        [ "$stop_rc" = 1 ] || { ok=0; note="${note}plain stop exit $stop_rc; "; }
        k=$(now)
        G stop --force "$pid" >>"$LOG" 2>&1 || { ok=0; note="${note}stop --force failed; "; }
        d=$((SECONDS + 60))
        while alive "$pid" && [ $SECONDS -lt $d ]; do sleep 0.05; done
        gone_s=$(since "$k")
        d=$((SECONDS + 30))
        while [ ! -e "$WORK/$c.rc" ] && [ $SECONDS -lt $d ]; do sleep 0.05; done
    fi
    rc=$(cat "$WORK/$c.rc" 2>/dev/null || echo "?")
    [ "$rc" = 7 ] || { ok=0; note="${note}run exit $rc; "; }
    hist=$(G history "$pid" 2>/dev/null)
    echo "== $c ($pid)" >>"$LOG"
    echo "$hist" >>"$LOG"
    cat "$WORK/$c.out" >>"$LOG" 2>/dev/null
    lock=$(echo "$hist" | grep -o "cuCheckpointProcess[A-Za-z]* failed: [A-Z_]* ([0-9]*)" | head -n 1 | sed 's/cuCheckpointProcess//')
    [ -n "$lock" ] || { ok=0; note="${note}no failed lock journaled; "; }
    echo "$hist" | grep -q "CUDA context faulted" || { ok=0; note="${note}no fault journaled; "; }
    xid=$(echo "$hist" | grep -o "NVRM: Xid ([^)]*): [0-9]*" | head -n 1 | awk '{ print "Xid " $NF }')
    sync=$(grep -o "cuCtxSynchronize=[0-9]*" "$WORK/$c.st.faulted" 2>/dev/null)
    [ "$ok" = 1 ] && res=PASS || { res=FAIL; NFAIL=$((NFAIL + 1)); }
    row "$b | $g | ${r#r} | $p | ${sync:-?}; ${lock:-no lock} | $end_s | ${gone_s:-} | ${ps_state:-} ${stop_rc:+stop $stop_rc} | run $rc; ${xid:-no Xid} | $res ${note:+($note)}"
    log "$c: $res $note"
done

sleep 2
left=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2>&1)
still=""
for c in "${CASES[@]}"; do
    pid=$(cut -d' ' -f1 "$WORK/$c.st" 2>/dev/null) || continue
    echo "$left" | grep -q "^$pid," && still="$still $pid"
done

{
    echo "# fault-e2e: a guarded process whose CUDA context faults"
    echo
    echo "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -n 1); $("$GPUSNAP" --version 2>&1 | head -n 1); ${GIB} GiB per worker; kernel log readable by the guard: $(dd if=/dev/kmsg bs=8192 count=1 iflag=nonblock status=none >/dev/null 2>&1 && echo yes || echo no)"
    echo
    echo "| backend | guard | restored | on-fault | the fault (worker; guard's lock) | fault -> run ended / held (s) | SIGKILL -> gone (s) | ps, plain stop | run exit; kernel log | result |"
    echo "|---|---|---|---|---|---|---|---|---|---|"
    printf '%s\n' "${ROWS[@]}"
    echo
    echo "NVML after the last case: ${still:+still listed:}${still:-no worker listed} ($(echo "$left" | tr '\n' ';'))"
    echo
    echo "$(( ${#CASES[@]} - NFAIL )) of ${#CASES[@]} cases passed; wall $((SECONDS - T0)) s"
} | tee "$MD"
[ -z "$still" ] || NFAIL=$((NFAIL + 1))
[ "$NFAIL" = 0 ]
