#!/usr/bin/env bash
# The soak on a GPU: `gpusnap agent` with 3-4 real PyTorch model servers
# (model_server.py) whose sum exceeds the free GPU memory, clients whose
# every answer is checked against the server's own reference, and a seeded
# fault injector drawing from the faults that are safe on a real GPU. The
# same invariants and the same table as `gpusnap-soak`
# (docs/design/reliability.md), for the real driver.
#
# Run from the repository root, as root:
#   OUT=/some/dir tests/gpu/soak.sh MINUTES
# MINUTES (default 10): no fault cycle starts after that; the clients stop,
# the table is written, and every server is ended through `gpusnap stop`
# (never a restored CUDA process killed without being suspended first).
#
# The faults (SOAK_FAULTS, space-separated, default all of these):
#   agent-kill-swap   a request to a suspended service, then kill -9 of the
#                     agent 0-1.5 s later; restarted 0-0.5 s after
#   agent-kill-wake   a request to the hibernated service, kill -9 of the
#                     agent 0-2.5 s later; restarted
#   kill-suspend, kill-resume
#                     the lane's `gpusnap suspend`/`resume` (a worker.py
#                     outside the agent) killed with kill -9 0-1.2 s in; the
#                     next `gpusnap resume` must bring it back, progressing
#   tenant            a request to a suspended service, then a filler
#                     (filler.py) takes half the free memory for 5-20 s
#   criu-dump-fail    CRIU fails its dump (at once, or after a complete dump)
#                     during POST /v1/services/s0/hibernate: the answer must
#                     not be 200, and the server must run on (no thread
#                     stopped) and answer right
# After every fault: within 300 s every service is running, suspended or
# hibernated, and each answers right (4 tries); the agent lives.
#
# Environment:
#   GPUSNAP          the binary (default ./target/release/gpusnap)
#   OUT              results directory (default: a new /tmp/gpusnap-out.* dir)
#   SOAK_SEED        the seed of every choice (default 1); the run prints it
#   SOAK_SERVICES    servers behind the agent, 3-4 (default 3)
#   SOAK_SERVER_GB   the most one server holds (default 12): sized down to
#                    the free memory / 2.8 and to what host RAM allows; a
#                    filler then leaves 2.8 servers' worth free: two fit
#                    (with the lane), three never do
#   SOAK_CLIENTS     client threads (default 2); SOAK_TOKENS tokens per answer (8)
#   SOAK_SERVER=fake a dry run without a GPU: fake-workload --http servers
#                    against the fake driver (FAKE_WORKLOAD, the fakes on
#                    LD_LIBRARY_PATH, GPUSNAP_FAKE_DIR, an nvidia-smi on PATH
#                    that answers memory.free; see tests/gpu/README.md)
# Writes $OUT/soak.md (also printed) and $OUT/soak.log. Exit 0 with no
# violation, 1 otherwise.

NAME=soak # read by lib.sh
# shellcheck source=tests/gpu/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

MINUTES=${1:-10}
SEED=${SOAK_SEED:-1}
N=${SOAK_SERVICES:-3}
SERVER=${SOAK_SERVER:-torch}
CLIENTS=${SOAK_CLIENTS:-2}
TOKENS=${SOAK_TOKENS:-8}
FAULTS=${SOAK_FAULTS:-agent-kill-swap agent-kill-wake kill-suspend kill-resume tenant criu-dump-fail}
read -r -a FAULT_LIST <<<"$FAULTS"
case $N in 3 | 4) ;; *) echo "soak: SOAK_SERVICES must be 3 or 4" >&2 && exit 2 ;; esac
for f in "${FAULT_LIST[@]}"; do
    case $f in agent-kill-swap | agent-kill-wake | kill-suspend | kill-resume | tenant | criu-dump-fail) ;;
        *) echo "soak: SOAK_FAULTS: unknown fault $f" >&2 && exit 2 ;;
    esac
done
RANDOM=$SEED
SOCK=$WORK/agent.sock
REPORT=$OUT/soak.md
FAULTDIR=$WORK/faults
REQS=$WORK/requests.tsv
VIOL=$WORK/violations.tsv
FAULTS_DONE=$WORK/faults.tsv
mkdir -p "$FAULTDIR"
: >"$REQS"
: >"$VIOL"
: >"$FAULTS_DONE"
AGENT_PID="" LANE_PID="" CYCLES=0 SWAPS_BEFORE=0 COMMANDS=0 START=$SECONDS
PROMPT="the+quick+brown+fox+jumps+over+the+lazy+dog" # model_server.py's --ref-prompt: /reference answers it

violation() { # KIND DETAIL
    printf '%s\t%s\n' "$1" "$2" >>"$VIOL"
    log "VIOLATION $1: $2"
}

api() { # METHOD PATH [MAX_S] -> body; API_CODE
    API_CODE=$(curl -s -m "${3:-60}" -o "$WORK/api.out" -w '%{http_code}' -X "$1" --unix-socket "$SOCK" "http://agent$2" 2>>"$LOG") || API_CODE=000
    cat "$WORK/api.out" 2>/dev/null
}

svc_field() { # NAME FIELD
    api GET /v1/services 30 | python3 -c 'import json,sys
for s in json.load(sys.stdin):
    if s["name"] == sys.argv[1]:
        v = s.get(sys.argv[2]); print("" if v is None else v)' "$1" "$2" 2>/dev/null
}

# pick STATE...: a service in one of the states (seeded), else s0.
pick() {
    local list
    list=$(api GET /v1/services 30 | python3 -c 'import json,sys
want = sys.argv[1:]
print(" ".join(s["name"] for s in json.load(sys.stdin) if s["state"] in want))' "$@" 2>/dev/null)
    read -r -a a <<<"$list"
    if [ "${#a[@]}" = 0 ]; then echo s0; else echo "${a[RANDOM % ${#a[@]}]}"; fi
}

port_of() { echo $((18511 + ${1#s})); }

swaps_now() {
    curl -s -m 30 --unix-socket "$SOCK" http://agent/metrics 2>/dev/null |
        awk 'index($0, "gpusnap_agent_swap_seconds_count") == 1 { s += $NF } END { printf "%d\n", s }'
}

rand_ms() { echo $((RANDOM % $1)); } # 0..N-1 ms
sleep_ms() { sleep "$(calc %.3f 'm / 1000' m="$1")"; }

# ---------------------------------------------------------------- sizing

FREE_MIB=$(smi_free_mib)
[ -n "$FREE_MIB" ] || { echo "soak: nvidia-smi gave no free memory" >&2 && exit 2; }
# worker.py of 1 GiB holds about 3.2 GB of device memory.
LANE_MIB=$([ "$SERVER" = fake ] && echo 64 || echo 3400)
CAP_MIB=$(calc %d 'g * 1e9 / 1048576' g="${SOAK_SERVER_GB:-12}")
# Two servers, their margins, the lane and its resume's margin (256 MiB)
# fit in 2.8 servers; a third server never does.
S_MIB=$(calc %d '(c < (f - l) / 2.8) ? c : (f - l) / 2.8' c="$CAP_MIB" f="$FREE_MIB" l="$LANE_MIB")
if [ "$SERVER" != fake ]; then
    # A swap holds two servers in host memory for a moment, and one or two
    # more stay suspended: (N - 1) servers + 24 GB of host RAM.
    RAM_MIB=$(calc %d '(a - 24 * 1024) / (n - 1)' a="$(mem_avail_mib)" n="$N")
    [ "$RAM_MIB" -lt "$S_MIB" ] && S_MIB=$RAM_MIB
fi
# A filler leaves that much free.
LEAVE_MIB=$(calc %d 's * 2.8 + l' s="$S_MIB" l="$LANE_MIB")
log "soak: seed $SEED, $N servers of $S_MIB MiB ($SERVER), free $FREE_MIB MiB, leave $LEAVE_MIB MiB; faults: $FAULTS; $MINUTES min"

server_cmd() { # INDEX -> a TOML array
    local i=$1 port=$((18531 + $1))
    if [ "$SERVER" = fake ]; then
        printf '["%s", "--mib", "%s", "--http", "%s", "--tag", "s%s"]' "${FAKE_WORKLOAD:?set FAKE_WORKLOAD for SOAK_SERVER=fake}" "$S_MIB" "$port" "$i"
    else
        local w kv
        w=$(calc %.2f '(s * 1048576 / 1e9) / 3' s="$S_MIB")
        kv=$(calc %.2f '(s * 1048576 / 1e9) - w' s="$S_MIB" w="$w")
        printf '["python3", "%s/model_server.py", "--port", "%s", "--seed", "%s", "--weights-gb", "%s", "--kv-gb", "%s", "--ref-n", "%s"]' \
            "$GPU_DIR" "$port" "$((i + 1))" "$w" "$kv" "$TOKENS"
    fi
}

# A CRIU that fails on request: fail-ACTION fails before anything,
# fail-after-ACTION runs it and then reports a failure anyway.
REAL_CRIU=${GPUSNAP_CRIU:-$(command -v criu)}
cat >"$WORK/criu" <<EOF
#!/bin/sh
d=$FAULTDIR
if [ -e "\$d/fail-\$1" ]; then echo "Error (soak): injected failure of criu \$1" >&2; exit 1; fi
if [ -e "\$d/fail-after-\$1" ]; then "$REAL_CRIU" "\$@"; echo "Error (soak): injected failure after criu \$1" >&2; exit 1; fi
exec "$REAL_CRIU" "\$@"
EOF
chmod +x "$WORK/criu"
export GPUSNAP_CRIU=$WORK/criu

{
    printf '[agent]\nsocket = "%s"\ntick = "200ms"\n' "$SOCK"
    for i in $(seq 0 $((N - 1))); do
        printf '\n[[service]]\nname = "s%s"\nlisten = "127.0.0.1:%s"\nbackend = "127.0.0.1:%s"\n' "$i" "$(port_of "s$i")" "$((18531 + i))"
        printf 'command = %s\nsuspend_after = "%ss"\nwake_timeout = "300s"\ngpu_memory = "%sMiB"\nmargin = "%sMiB"\n' \
            "$(server_cmd "$i")" "$((15 + 10 * i))" "$S_MIB" "$((S_MIB / 25))"
        [ "$i" = 0 ] && printf 'hibernate_after = "30s"\n'
    done
} >"$WORK/agent.toml"
log_file "agent.toml" "$WORK/agent.toml"

agent_up() {
    rm -f "$SOCK"
    "$GPUSNAP" --state-dir "$STATE_DIR" agent --config "$WORK/agent.toml" </dev/null >>"$WORK/agent.log" 2>&1 &
    AGENT_PID=$!
    local end=$((SECONDS + 120))
    while [ ! -S "$SOCK" ] && [ "$SECONDS" -lt "$end" ] && alive "$AGENT_PID"; do sleep 0.2; done
    [ -S "$SOCK" ] || violation agent_start "the agent's API did not come up (pid $AGENT_PID)"
}

agent_kill9() {
    SWAPS_BEFORE=$((SWAPS_BEFORE + $(swaps_now)))
    kill -KILL "$AGENT_PID" 2>/dev/null
    wait "$AGENT_PID" 2>/dev/null
    AGENT_PID=""
}

# Every pid a service ran as, for the cleanup (through gpusnap stop).
note_service_pids() {
    local p
    for p in $(api GET /v1/services 30 | python3 -c 'import json,sys
print(" ".join(str(s["pid"]) for s in json.load(sys.stdin) if s.get("pid")))' 2>/dev/null); do
        case " ${WORKERS[*]-} " in *" $p "*) ;; *) WORKERS+=("$p") ;; esac
        mark_restored "$p" # a service may have been woken or resumed: always suspended first
    done
}

# shellcheck disable=SC2317 # runs from the EXIT trap
on_exit() {
    local rc=$?
    : >"$WORK/.stop"
    [ -n "${CLIENT_PID:-}" ] && wait "$CLIENT_PID" 2>/dev/null
    if [ -n "$AGENT_PID" ] && alive "$AGENT_PID"; then
        note_service_pids
        SWAPS_BEFORE=$((SWAPS_BEFORE + $(swaps_now)))
        log "stopping the agent ($AGENT_PID); its servers are stopped through gpusnap stop"
        kill -TERM "$AGENT_PID" 2>/dev/null
        wait "$AGENT_PID" 2>/dev/null
    fi
    cleanup_all
    report
    [ -z "$LEFT_ALIVE" ] || violation left_alive "$LEFT_ALIVE"
    [ "$rc" = 0 ] && [ ! -s "$VIOL" ] && exit 0
    exit 1
}

# shellcheck disable=SC2317 # called from on_exit
report() {
    python3 - "$REQS" "$VIOL" "$FAULTS_DONE" "$SEED" "$FAULTS" "$((SECONDS - START))" "$CYCLES" "$SWAPS_BEFORE" "$COMMANDS" "$SERVER" "$N" "$S_MIB" >"$REPORT" <<'PY'
import collections, sys
reqs, viol, faults, seed, kinds, secs, cycles, swaps, commands, server, n, mib = sys.argv[1:]
rows = [l.rstrip("\n").split("\t") for l in open(reqs) if l.strip()]
v = [l.rstrip("\n").split("\t", 1) for l in open(viol) if l.strip()]
f = [l.strip() for l in open(faults) if l.strip()]
waits = sorted(float(r[2]) for r in rows if r[3] == "right")
q = lambda p: waits[min(len(waits) - 1, round((len(waits) - 1) * p))] if waits else 0.0
right = sum(r[3] == "right" for r in rows)
refused = sum(r[3] == "refused" for r in rows)
vk = collections.Counter(k for k, _ in v)
for r in rows:
    if r[3] in ("wrong", "past_bound"):
        vk["wrong_answer" if r[3] == "wrong" else "request_past_bound"] += 1
print(f"Seed {seed}, faults `{kinds}`, {secs} s; {n} {server} servers of {mib} MiB.\n")
print("| measure | value |\n|---|---|")
print(f"| cycles | {cycles} |")
print(f"| requests | {len(rows)} ({right} answered right, {refused} refused clearly) |")
print(f"| swaps (agent, traced) | {swaps} |")
print(f"| gpusnap commands run | {commands} |")
print(f"| faults injected | {len(f)} |")
print(f"| violations | {sum(vk.values())} |")
print(f"| request wait p50 | {q(0.5):.3f} s |")
print(f"| request wait p99 | {q(0.99):.3f} s |")
print(f"| request wait max | {waits[-1] if waits else 0.0:.3f} s |")
print("\n| fault kind | injected |\n|---|---|")
for k, n in sorted(collections.Counter(f).items()):
    print(f"| {k} | {n} |")
print("\n| violation kind | count |\n|---|---|")
if not vk:
    print("| (none) | 0 |")
for k, n in sorted(vk.items()):
    print(f"| {k} | {n} |")
details = [f"{k}: {d}" for k, d in v] + [f"{r[3]}: {r[0]} {r[4] if len(r) > 4 else ''}" for r in rows if r[3] in ("wrong", "past_bound")]
if details:
    print("\nViolations:\n")
    for d in details[:50]:
        print(f"- {d}")
PY
    cat "$REPORT"
}

install_traps
start_watchdog $((MINUTES * 60 + 1200))

if [ "$SERVER" != fake ] && [ "$(calc %d 'f > l' f="$FREE_MIB" l="$LEAVE_MIB")" = 1 ]; then
    start_filler "$LEAVE_MIB" 300 || { violation setup "the filler did not start" && exit 1; }
fi
agent_up
# Every server started (one after another: a later one evicts an earlier).
end=$((SECONDS + 1200))
while [ "$SECONDS" -lt "$end" ]; do
    states=$(api GET /v1/services 30 | python3 -c 'import json,sys; print(" ".join(s["state"] for s in json.load(sys.stdin)))' 2>/dev/null)
    log "services: $states"
    ok=1
    for s in $states; do case $s in running | suspended) ;; *) ok=0 ;; esac; done
    [ "$ok" = 1 ] && [ -n "$states" ] && break
    sleep 5
done
note_service_pids
# The lane: a worker outside the agent, driven by gpusnap commands.
if [ "$SERVER" = fake ]; then
    : >"$WORK/lane.log"
    "$FAKE_WORKLOAD" --mib "$LANE_MIB" --status "$WORK/lane.status" </dev/null >>"$WORK/lane.log" 2>&1 &
    LANE_PID=$!
    WORKERS+=("$LANE_PID")
else
    start_worker lane 1
    LANE_PID=$LAST_PID
fi
wait_ready lane "$LANE_PID" 300 || violation setup "the lane's worker did not start"

# The clients: requests to the services at random (skewed, seeded), each
# answer checked against the service's reference (model_server.py's own
# /reference; the fake's first answer, which must say its memory is intact).
python3 - "$WORK" "$SEED" "$N" "$CLIENTS" "$PROMPT" "$TOKENS" "$SERVER" >>"$LOG" 2>&1 <<'PY' &
import os, random, sys, threading, time, http.client
work, seed, n, clients, prompt, tokens, server = sys.argv[1:]
n, clients = int(n), int(clients)
refs, lock = {}, threading.Lock()
out = open(os.path.join(work, "requests.tsv"), "a", buffering=1)

def get(svc, path, limit=360):
    c = http.client.HTTPConnection("127.0.0.1", 18511 + svc, timeout=limit)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read().decode(errors="replace")
    finally:
        c.close()

def ref(svc):
    with lock:
        if svc in refs:
            return refs[svc]
    if server != "fake":
        code, body = get(svc, "/reference")
        if code != 200:
            return None
        with lock:
            refs[svc] = body
        return body
    return None

def one(rng):
    svc = min(int(rng.expovariate(1.0 / max(1, n / 2))), n - 1)
    t = time.time()
    try:
        r = ref(svc)
        code, body = get(svc, f"/generate?prompt={prompt}&n={tokens}")
    except (ConnectionRefusedError, ConnectionResetError, http.client.RemoteDisconnected) as e:
        return svc, t, "refused", repr(e)
    except OSError as e:  # the read deadline: past wake_timeout + 60 s
        return svc, t, "past_bound", repr(e)
    if code in (502, 503, 504):
        return svc, t, "refused", str(code)
    if code != 200:
        return svc, t, "wrong", f"{code} {body.strip()[:80]}"
    if server == "fake":
        if not body.strip().endswith(" 1"):
            return svc, t, "wrong", f"memory not intact: {body.strip()}"
        with lock:
            r = refs.setdefault(svc, body)
    return svc, t, ("right" if body == r else "wrong"), body.strip()[:80]

def client(i):
    rng = random.Random(int(seed) * 1000 + i)
    while not os.path.exists(os.path.join(work, ".stop")):
        svc, t, verdict, detail = one(rng)
        out.write(f"s{svc}\t{t:.3f}\t{time.time() - t:.3f}\t{verdict}\t{detail}\n")
        time.sleep(rng.uniform(0.05, 1.0))

ts = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
for t in ts: t.start()
for t in ts: t.join()
PY
CLIENT_PID=$!

# ask NAME: one request in the background (checked by the same rules).
ask_bg() {
    curl -s -m 360 -o /dev/null "http://127.0.0.1:$(port_of "$1")/generate?prompt=$PROMPT&n=$TOKENS" 2>/dev/null &
    ASK_PID=$!
}

lane_cmd() { # ARGS...: a lane gpusnap command, counted
    COMMANDS=$((COMMANDS + 1))
    gs 300 "$@"
}

lane_killed() { # DELAY_MS ARGS...: the command killed -9 DELAY_MS in
    local d=$1
    shift
    COMMANDS=$((COMMANDS + 1))
    "$GPUSNAP" --json --state-dir "$STATE_DIR" "$@" </dev/null >>"$WORK/lane-killed.log" 2>&1 &
    local p=$!
    sleep_ms "$d"
    kill -KILL "$p" 2>/dev/null
    wait "$p" 2>/dev/null
    mark_restored "$LANE_PID"
}

# The lane is brought back and must make progress with its memory intact.
lane_back() {
    local st
    [ "$(pstate "$LANE_PID")" = T ] && kill -CONT "$LANE_PID"
    "$GPUSNAP" --json --state-dir "$STATE_DIR" state "$LANE_PID" >"$WORK/lane.state" 2>>"$LOG"
    st=$(jget "$WORK/lane.state" 'd["state"]')
    # The agent's swaps share the GPU: admission waits (bounded) for room.
    [ "$st" = running ] || lane_cmd resume --wait 120 "$LANE_PID"
    read_status "$WORK/lane.status"
    local before=$ST_ITER
    if ! wait_iter_gt lane "${before:-0}" 120; then
        violation stranded "the lane's program did not progress after the fault (state: $st)"
    elif ! read_status "$WORK/lane.status" || [ "$ST_OK" != 1 ]; then
        violation corrupt_memory "the lane's program reports its memory damaged"
    fi
}

threads_stopped() { # PID -> how many threads are stopped (T/t)
    local n=0 t s
    for t in /proc/"$1"/task/*; do
        s=$(awk '{ print $3 }' "$t/stat" 2>/dev/null)
        case $s in T | t) n=$((n + 1)) ;; esac
    done
    echo "$n"
}

settle_and_check() { # KIND
    local end=$((SECONDS + 300)) states ok name try body
    while :; do
        states=$(api GET /v1/services 30 | python3 -c 'import json,sys; print(" ".join(s["name"] + "=" + s["state"] for s in json.load(sys.stdin)))' 2>/dev/null)
        ok=1
        for s in $states; do case ${s#*=} in running | suspended | hibernated) ;; *) ok=0 ;; esac; done
        [ "$ok" = 1 ] && [ -n "$states" ] && break
        if [ "$SECONDS" -ge "$end" ]; then
            violation not_settled "after $1: $states"
            break
        fi
        sleep 1
    done
    for i in $(seq 0 $((N - 1))); do
        name=s$i
        for try in 1 2 3 4; do
            body=$(curl -s -m 360 "http://127.0.0.1:$(port_of "$name")/generate?prompt=$PROMPT&n=$TOKENS" 2>/dev/null) && [ -n "$body" ] && break
        done
        [ -n "$body" ] || violation service_lost "$name answers nothing after $1"
    done
    note_service_pids
}

# ---------------------------------------------------------------- the faults

end=$((SECONDS + MINUTES * 60))
while [ "$SECONDS" -lt "$end" ]; do
    kind=${FAULT_LIST[RANDOM % ${#FAULT_LIST[@]}]}
    injected=1
    log "cycle $CYCLES: $kind (replay: SOAK_SEED=$SEED SOAK_FAULTS=\"$FAULTS\")"
    case $kind in
        agent-kill-swap)
            name=$(pick suspended hibernated)
            ask_bg "$name"
            sleep_ms "$(rand_ms 1500)"
            agent_kill9
            sleep_ms "$(rand_ms 500)"
            agent_up
            wait "$ASK_PID" 2>/dev/null || true
            ;;
        agent-kill-wake)
            if [ "$(svc_field s0 state)" != hibernated ]; then
                [ "$(svc_field s0 state)" = running ] && api POST /v1/services/s0/suspend 300 >/dev/null
                api POST /v1/services/s0/hibernate 600 >/dev/null
            fi
            if [ "$(svc_field s0 state)" = hibernated ]; then
                ask_bg s0
                sleep_ms "$(rand_ms 2500)"
                agent_kill9
                sleep_ms "$(rand_ms 500)"
                agent_up
                wait "$ASK_PID" 2>/dev/null || true
            else
                log "s0 could not be hibernated this cycle"
                injected=0
            fi
            ;;
        kill-suspend)
            lane_killed "$(rand_ms 1200)" suspend "$LANE_PID"
            lane_back
            ;;
        kill-resume)
            lane_cmd suspend "$LANE_PID"
            lane_killed "$(rand_ms 1200)" resume "$LANE_PID"
            lane_back
            ;;
        tenant)
            name=$(pick suspended)
            ask_bg "$name"
            sleep_ms "$(rand_ms 300)"
            half=$(calc %d 'f / 2' f="$(smi_free_mib)")
            if [ "$SERVER" = fake ]; then
                "$FAKE_WORKLOAD" --mib "$half" </dev/null >>"$WORK/filler.log" 2>&1 &
                FILLERS+=("$!")
            else
                start_filler "$half" 120 || log "tenant: the filler did not start"
            fi
            sleep $((5 + RANDOM % 16))
            kill_fillers
            FILLERS=()
            [ "$SERVER" != fake ] && [ -n "$LEAVE_MIB" ] && [ "$(calc %d 'f > l' f="$(smi_free_mib)" l="$LEAVE_MIB")" = 1 ] &&
                start_filler "$LEAVE_MIB" 300
            wait "$ASK_PID" 2>/dev/null || true
            ;;
        criu-dump-fail)
            flag=$([ $((RANDOM % 2)) = 0 ] && echo fail-dump || echo fail-after-dump)
            st=$(svc_field s0 state)
            if [ "$st" = running ] || [ "$st" = suspended ]; then
                : >"$FAULTDIR/$flag"
                api POST /v1/services/s0/hibernate 600 >/dev/null
                rm -f "$FAULTDIR/$flag"
                [ "$API_CODE" = 200 ] && violation criu_failure_ignored "s0 hibernated although CRIU's dump failed ($flag)"
                pid=$(svc_field s0 pid)
                if [ -n "$pid" ] && [ "$(threads_stopped "$pid")" != 0 ]; then
                    violation stopped_after_dump "s0 (pid $pid): $(threads_stopped "$pid") threads stopped after a failed dump ($flag)"
                fi
            else
                log "criu-dump-fail: s0 is $st; not injected this cycle"
                injected=0
            fi
            ;;
    esac
    [ "$injected" = 1 ] && printf '%s\n' "$kind" >>"$FAULTS_DONE"
    CYCLES=$((CYCLES + 1))
    alive "$AGENT_PID" || { violation agent_died "after $kind" && agent_up; }
    settle_and_check "$kind"
done
FINISHED=1
log "soak: $CYCLES cycles; stopping"
exit 0
