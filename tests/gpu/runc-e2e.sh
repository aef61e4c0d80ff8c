#!/usr/bin/env bash
# A CUDA container through an OCI runtime: runc (carried: .dev/runc/runc, with
# its libseccomp.so.2 beside it) runs a CuPy worker in a container made here,
# with no image, checkpoints it with CRIU's CUDA plugin calling gpusnap as
# `cuda-checkpoint`, and restores it under another id.
#
# The bundle: `rootfs/` an empty directory; `config.json` from `runc spec`,
# edited: the host's /usr /lib /lib64 /bin /sbin /etc /opt bound read-only
# (each mount below them bound on its own, so that runc names every one to
# CRIU as external), the Python the worker runs where it lives elsewhere,
# tests/gpu and a status directory read-write, /proc, a tmpfs /dev with the
# host's /dev/nvidia* nodes as devices (the device cgroup allows all), the
# namespaces of RUNC_NAMESPACES (pid mount ipc uts: the host's network), no
# terminal; the worker's stdio opened inside the container. CRIU's options
# (the plugin directory, file-locks) come from a configuration file the
# bundle's `org.criu.config` annotation names: the host's
# /etc/criu/runc.conf is neither read nor written.
#
# Steps (rows):
#   r0      runc --version starts (it runs with LD_LIBRARY_PATH of its
#           directory when libseccomp.so.2 is there)
#   c.*     runc run -d; the status line advances with ok=1; runc checkpoint
#           (exit 0, the process gone, the plugin's lines, gpusnap's journal
#           holds lock and checkpoint); runc restore -d under another id
#           (exit 0, gpusnap state running, the status advances with ok=1,
#           nvidia-smi lists the pid again)
#   c.a     gpusnap knew the restored process (its record and footprint
#           moved to it: under the same pid, or in a pid namespace of the
#           container's own under another host pid, the same pid inside)
#   f.*     (RUNC_FILL=1) the same container checkpointed, a filler holding
#           the GPU, runc restore: the container is back with its CUDA state
#           checkpointed (gpusnap refused the plugin's restore), resume
#           refused (3) until the filler is gone, then resumed and computing;
#           in the host's pid namespace unless c.a passed (a restore that
#           does not fit, without admission, would leave the process stuck)
#   fig.*   checkpoint and restore seconds against the bare `criu dump` /
#           `criu restore -d` of container-e2e.sh (RUNC_BARE_MD, the
#           Steps table of its container-e2e.md; device.sh's runc stage runs
#           it with CONT_MODES=bare first)
# Every exit cleans up: each CUDA process through `gpusnap stop` (never a
# kill of a live restored process), then `runc delete -f` of each container
# whose processes are gone.
#
# Run as root from the repository root on the GPU machine (tests/gpu/device.sh
# runc). Environment: GPUSNAP, OUT, RUNC (default .dev/runc/runc, else runc
# on PATH), RUNC_GIB (CONT_GIB, 2), RUNC_WORKER (CONT_WORKER, worker_cupy.py), RUNC_BUDGET_S (240),
# RUNC_FILL (1), RUNC_NAMESPACES, RUNC_BARE_MD, CONT_PLUGINS (CRIU's plugin
# directory; default PREFIX/lib/criu of the criu on PATH). For a dry run
# against the fakes (tests/gpu/README.md): RUNC_MOUNTS_RO / RUNC_MOUNTS_RW
# (more host directories, bound at the same paths), RUNC_ENV (more
# VAR=VALUE for the worker), RUNC_CC_ENV (more VAR=VALUE for gpusnap as
# cuda-checkpoint), RUNC_CRIU_ENV (VAR=VALUE for criu, e.g. CRIU_FAULT=138),
# and a GPU_TEST_HOOK replacing worker_cmd, start_filler, kill_fillers.
# Files: $OUT/runc-e2e.md (check table, then steps with seconds),
# $OUT/runc-e2e.log. Exit 1 if a check failed.

NAME=runc-e2e
# shellcheck source=tests/gpu/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
# shellcheck source=tests/gpu/plugin-lib.sh
. "$GPU_DIR/plugin-lib.sh"

RUNC_GIB=${RUNC_GIB:-${CONT_GIB:-2}}
RUNC_WORKER=${RUNC_WORKER:-${CONT_WORKER:-worker_cupy.py}}
RUNC_BUDGET_S=${RUNC_BUDGET_S:-240}
RUNC_FILL=${RUNC_FILL:-1}
RUNC_NAMESPACES=${RUNC_NAMESPACES:-pid mount ipc uts}
RUNC_BARE_MD=${RUNC_BARE_MD:-}
ROWS=$WORK/rows.tsv
STEPS=$WORK/steps.tsv # flow step seconds note
: >"$ROWS"
: >"$STEPS"
NPASS=0 NFAIL=0 NSKIP=0 NINFO=0
FINISHED=0
R=$WORK/runc            # the runtime's state (--root), bundle, images
ST=$WORK/st             # status files and logs, bound read-write into the containers
mkdir -p "$R/state" "$R/bin" "$R/bundle/rootfs" "$ST/tmp" "$ST/home"
CONTAINERS=()           # every id run or restored: `runc delete -f` at the end
CKPT_S="" RESTORE_S=""  # the figures of the first cycle
KNOWN=0                 # gpusnap found the record of the cycle's restored process
FLOW_ST=st/ FLOW_BUDGET_S=$RUNC_BUDGET_S FLOW_PROGRESS_S=90 FLOW_WORKER_WHAT="the worker in the container"

# worker_cmd STATUS: the worker's command line (a dry run's hook replaces it).
if ! declare -F worker_cmd >/dev/null; then
    worker_cmd() { printf '%s\n' "$PY" "$GPU_DIR/$RUNC_WORKER" "$RUNC_GIB" "$1"; }
fi
PY=$(command -v python3 || echo python3)
WLABEL=$(worker_cmd STATUS | head -n 3 | tr '\n' ' ' | sed 's|[^ ]*/||g')

# ---------------------------------------------------------------- runc

if [ -z "${RUNC:-}" ]; then
    RUNC=.dev/runc/runc
    [ -x "$RUNC" ] || RUNC=$(command -v runc 2>/dev/null || printf '%s' "$RUNC")
fi
case $RUNC in /*) ;; *) RUNC=$PWD/$RUNC ;; esac
RUNC_LD=""
if [ -f "$(dirname "$RUNC")/libseccomp.so.2" ]; then RUNC_LD=$(dirname "$RUNC"); fi

# runc_call ARGS...: this run's runc (its own --root), bounded, with criu and
# cuda-checkpoint first on PATH; sets RC_RC, RC_S, RC_OUT (one line).
runc_call() {
    local t0 o=$R/runc.out
    log "runc $*"
    t0=$(now)
    RC_RC=0
    timeout -k 10 240 env PATH="$R/bin:$PATH" LD_LIBRARY_PATH="${RUNC_LD}${RUNC_LD:+${LD_LIBRARY_PATH:+:}}${LD_LIBRARY_PATH:-}" \
        "$RUNC" --root "$R/state" --log "$R/runc.log" "$@" </dev/null >"$o" 2>&1 || RC_RC=$?
    RC_S=$(fsub "$t0" "$(now)")
    RC_OUT=$(tr '\n' ' ' <"$o" | cut -c1-400)
    log "  -> exit $RC_RC in ${RC_S}s: $RC_OUT"
}

# rc_err: runc's own last error line (its --log), for a row.
rc_err() { grep -o 'msg="[^"]*"' "$R/runc.log" 2>/dev/null | tail -n 1 | cut -c1-240; }

# ---------------------------------------------------------------- setup

setup() {
    local out
    out=$(LD_LIBRARY_PATH="${RUNC_LD}${RUNC_LD:+${LD_LIBRARY_PATH:+:}}${LD_LIBRARY_PATH:-}" timeout 30 "$RUNC" --version 2>&1)
    local v=$? missing
    # What keeps a carried runc from starting, named.
    missing=$(LD_LIBRARY_PATH="${RUNC_LD}${RUNC_LD:+${LD_LIBRARY_PATH:+:}}${LD_LIBRARY_PATH:-}" ldd "$RUNC" 2>/dev/null | awk '/not found/ { print $1 }' | tr '\n' ' ')
    row r0 "runc $RUNC starts${RUNC_LD:+ (LD_LIBRARY_PATH=$RUNC_LD)}" "runc --version exit 0" \
        "exit $v: $(printf '%s' "$out" | tr '\n' ' ' | cut -c1-200)${missing:+; libraries not found: $missing}" "$([ "$v" = 0 ] && echo PASS || echo FAIL)"
    [ "$v" = 0 ] || return 1
    find_plugins
    if [ -z "$CRIU_BIN" ] || [ -z "$PLUGINS" ]; then
        row pre "criu and CRIU's cuda_plugin.so" "found" "criu '${CRIU_BIN:-none}', plugins '${PLUGINS:-none}'" FAIL
        return 1
    fi
    # gpusnap as the plugin's cuda-checkpoint, with this run's state dir.
    printf '#!/bin/sh\nGPUSNAP_STATE_DIR=%s %s exec %s cuda-checkpoint "$@"\n' "$STATE_DIR" "${RUNC_CC_ENV:-}" "$GPUSNAP" >"$R/bin/cuda-checkpoint"
    if [ -n "${RUNC_CRIU_ENV:-}" ]; then
        printf '#!/bin/sh\n%s exec %s "$@"\n' "$RUNC_CRIU_ENV" "$CRIU_BIN" >"$R/bin/criu"
    fi
    chmod +x "$R/bin"/*
    printf 'libdir %s\nfile-locks\n' "$PLUGINS" >"$R/criu.conf"
    row pre "criu and CRIU's cuda_plugin.so" "found" "criu $CRIU_BIN, plugins $PLUGINS; cuda-checkpoint -> $GPUSNAP${RUNC_CRIU_ENV:+; criu with $RUNC_CRIU_ENV}" PASS
    bundle
}

# python_dirs: where the worker's Python lives (interpreter, prefixes,
# sys.path, CuPy), one real path a line.
python_dirs() {
    timeout 60 "$PY" - <<'PY' 2>/dev/null || true
import os, site, sys
ps = [sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable))]
ps += [p for p in sys.path if p]
try:
    ps += site.getsitepackages() + [site.getusersitepackages()]
except Exception:
    pass
try:
    import cupy
    ps.append(os.path.dirname(os.path.dirname(cupy.__file__)))
except Exception:
    pass
for p in ps:
    if os.path.isdir(p):
        print(os.path.realpath(p))
PY
}

# bundle: $R/bundle/config.json (see the header); sets BUNDLE_NOTE.
bundle() {
    local d top=() ro=() rw=() p k covered
    for d in /usr /lib /lib64 /bin /sbin /etc /opt; do
        if [ -L "$d" ]; then
            ln -sfn "$(readlink "$d")" "$R/bundle/rootfs${d}"
        elif [ -d "$d" ]; then
            top+=("$d")
        fi
    done
    # The worker's Python and anything asked for, where the host's
    # directories above do not hold it already.
    ro=("${top[@]}")
    for p in $(python_dirs) ${RUNC_MOUNTS_RO:-}; do
        covered=0
        for k in "${ro[@]}"; do case $p/ in "$k"/*) covered=1 ;; esac; done
        [ "$covered" = 1 ] || ro+=("$p")
    done
    rw=("$GPU_DIR" "$ST" ${RUNC_MOUNTS_RW:-})
    mapfile -t ENV_LINES < <(env | grep -E '^(PATH|LD_LIBRARY_PATH|PYTHONPATH|PYTHONUNBUFFERED|LC_ALL|TZ|WORKER_FILL|(CUDA|NVIDIA|NCCL|TORCH|NVSHMEM|CUPY)_[A-Z0-9_]*)=' | sort)
    rm -f "$R/bundle/config.json"
    runc_call spec --bundle "$R/bundle"
    if [ "$RC_RC" != 0 ]; then
        row b0 "runc spec" "exit 0" "exit $RC_RC: $RC_OUT" FAIL
        return 1
    fi
    BUNDLE_NOTE=$(B_RO="${ro[*]}" B_RW="${rw[*]}" B_NS="$RUNC_NAMESPACES" B_CONF="$R/criu.conf" B_HOME="$ST/home" \
        B_TMP="$ST/tmp" B_CWD="$GPU_DIR" B_ENV="$(printf '%s\n' "${ENV_LINES[@]}" ${RUNC_ENV:-})" \
        python3 - "$R/bundle/config.json" <<'PY'
import glob, json, os, stat, sys

path = sys.argv[1]
E = os.environ
c = json.load(open(path))
mounts = [m for m in c["mounts"] if m["destination"] not in ("/dev/shm",)]
mounts.append({"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
               "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=1g"]})
# /tmp first: the status directory and a dry run's fake state live below it.
mounts.append({"destination": "/tmp", "type": "bind", "source": E["B_TMP"], "options": ["bind", "rw"]})


def unescape(s):
    return s.encode().decode("unicode_escape")


points = []
for line in open("/proc/self/mountinfo"):
    mp = unescape(line.split()[4])
    if mp not in points:
        points.append(mp)


def bind(src, ro):
    opts = ["bind", "nosuid"] + (["ro"] if ro else ["rw"])
    mounts.append({"destination": src, "type": "bind", "source": src, "options": opts})


n_sub = 0
for ro, dirs in ((True, E["B_RO"].split()), (False, E["B_RW"].split())):
    for d in dirs:
        bind(d, ro)
        # Each mount below it on its own (runc gives CRIU each bind mount as
        # external; a submount carried by a recursive bind it would not).
        for mp in sorted((p for p in points if p.startswith(d.rstrip("/") + "/")), key=lambda p: p.count("/")):
            if os.path.exists(mp):
                bind(mp, ro)
                n_sub += 1
c["mounts"] = mounts

devices = []
for p in sorted(glob.glob("/dev/nvidia*") + glob.glob("/dev/nvidia-caps/*")):
    try:
        st = os.stat(p)
    except OSError:
        continue
    if stat.S_ISCHR(st.st_mode):
        devices.append({"path": p, "type": "c", "major": os.major(st.st_rdev), "minor": os.minor(st.st_rdev),
                        "fileMode": 0o666, "uid": 0, "gid": 0})
lx = c["linux"]
lx["devices"] = devices
lx["resources"] = {"devices": [{"allow": True, "access": "rwm"}]}
lx["namespaces"] = [{"type": t} for t in E["B_NS"].split()]

pr = c["process"]
pr["terminal"] = False
pr.pop("rlimits", None)
pr["cwd"] = E["B_CWD"]
env = {"HOME": E["B_HOME"], "PYTHONUNBUFFERED": "1", "TMPDIR": "/tmp"}
for kv in E["B_ENV"].splitlines():
    if "=" in kv:
        k, v = kv.split("=", 1)
        env[k] = v
pr["env"] = [f"{k}={v}" for k, v in env.items()]
c["annotations"] = {"org.criu.config": E["B_CONF"]}
json.dump(c, open(path, "w"), indent=1)
print(f"{len(mounts)} mounts ({n_sub} submounts bound on their own), {len(devices)} GPU device nodes, "
      f"namespaces {E['B_NS']}; read-only {E['B_RO']}")
PY
    )
    local v=$?
    row b0 "the bundle: runc spec, edited (no image)" "config.json written" "${BUNDLE_NOTE:-python3 failed (exit $v)}" \
        "$([ "$v" = 0 ] && echo PASS || echo FAIL)"
    [ "$v" = 0 ]
}

# set_args ID STATUS: the container's process: the worker, its stdio opened
# inside the container (a file of the host outside it would be a file CRIU
# cannot place).
set_args() {
    local args=()
    mapfile -t args < <(worker_cmd "$2")
    python3 - "$R/bundle/config.json" "$2" "${args[@]}" <<'PY'
import json, sys
path, status, args = sys.argv[1], sys.argv[2], sys.argv[3:]
c = json.load(open(path))
log = status[: -len(".status")] + ".log" if status.endswith(".status") else status + ".log"
c["process"]["args"] = ["/bin/sh", "-c", 'exec "$@" </dev/null >>"$0" 2>&1', log] + args
json.dump(c, open(path, "w"), indent=1)
PY
}

# ---------------------------------------------------------------- flows

# start ID NAME: runc run -d; sets CPID (the container's first process here).
start() {
    local id=$1 name=$2 t0
    rm -f "$ST/$name.status" "$ST/$name.status.exit" "$R/$id.pid"
    : >"$ST/$name.log"
    set_args "$id" "$ST/$name.status" || return 1
    CONTAINERS+=("$id")
    t0=$(now)
    runc_call run -d --bundle "$R/bundle" --pid-file "$R/$id.pid" "$id"
    CPID=$(cat "$R/$id.pid" 2>/dev/null)
    [ -n "$CPID" ] && WORKERS+=("$CPID")
    log "container $id: exit $RC_RC, pid ${CPID:-none}"
    [ "$RC_RC" = 0 ] && [ -n "$CPID" ] && ready "$name" "$CPID" 180 && START_S=$(fsub "$t0" "$(now)")
}

log_tail() { tail -n "${2:-30}" "$1" >"$WORK/tail.txt" 2>/dev/null && log_file "$1 (last lines)" "$WORK/tail.txt"; }

# checkpoint P ID PID IMG WORKDIR: runc checkpoint and its rows (P: row prefix).
checkpoint() {
    local p=$1 id=$2 pid=$3 img=$4 wd=$5 o v
    rm -rf "$img" "$wd" && mkdir -p "$img" "$wd"
    runc_call checkpoint --image-path "$img" --work-path "$wd" --file-locks "$id"
    CK_RC=$RC_RC CK_S=$RC_S
    row "$p.d" "runc checkpoint $id (CRIU, the plugin: lock + checkpoint through gpusnap)" "exit 0" \
        "exit $RC_RC${RC_OUT:+: $RC_OUT}$( [ "$RC_RC" = 0 ] || echo "; $(crit_err "$wd/dump.log")")" \
        "$([ "$RC_RC" = 0 ] && echo PASS || echo FAIL)" "$RC_S s"
    step "$p" "runc checkpoint" "$RC_S" "exit $RC_RC"
    if [ "$RC_RC" != 0 ]; then
        log_tail "$wd/dump.log" 40
        return 1
    fi
    mark_restored "$pid"
    reap "$pid"
    v=FAIL
    wait_pid_free "$pid" 60 && v=PASS
    row "$p.g" "the container's process is gone after the checkpoint" "pid $pid gone" \
        "$([ "$v" = PASS ] && echo gone || echo "still there ($(pstate "$pid"))")" "$v"
    row "$p.p" "the plugin ran at checkpoint" "cuda_plugin: pausing devices, Checkpointing CUDA devices" "$(plugin_lines "$wd/dump.log")" \
        "$(grep -q 'cuda_plugin: Checkpointing CUDA devices' "$wd/dump.log" && echo PASS || echo FAIL)"
    o=$(ops "$pid")
    row "$p.j" "gpusnap's journal of pid $pid after the checkpoint" "lock and checkpoint" "${o:-none}" \
        "$([[ " $o " == *" lock "* && " $o " == *" checkpoint "* ]] && echo PASS || echo FAIL)"
}

# restore P ID IMG WORKDIR: runc restore -d; sets RPID.
restore() {
    local p=$1 id=$2 img=$3 wd=$4
    rm -rf "$wd" && mkdir -p "$wd"
    rm -f "$R/$id.pid"
    CONTAINERS+=("$id")
    runc_call restore -d --image-path "$img" --work-path "$wd" --file-locks --bundle "$R/bundle" --pid-file "$R/$id.pid" "$id"
    RS_RC=$RC_RC RS_S=$RC_S
    RPID=$(cat "$R/$id.pid" 2>/dev/null)
    if [ -n "$RPID" ]; then
        WORKERS+=("$RPID")
        mark_restored "$RPID"
    fi
    row "$p.r" "runc restore -d as $id (the plugin: restore + unlock, admitted by gpusnap)" "exit 0, a pid" \
        "exit $RC_RC, pid ${RPID:-none}${RC_OUT:+: $RC_OUT}$( [ "$RC_RC" = 0 ] || echo "; $(crit_err "$wd/restore.log")")" \
        "$([ "$RC_RC" = 0 ] && [ -n "$RPID" ] && echo PASS || echo FAIL)" "$RC_S s"
    step "$p" "runc restore -d" "$RC_S" "exit $RC_RC, pid ${RPID:-none}"
    [ "$RC_RC" = 0 ] || log_tail "$wd/restore.log" 40
    [ "$RC_RC" = 0 ] && [ -n "$RPID" ]
}

# cycle: run, checkpoint, restore, check, stop.
cycle() {
    local name=w id=gpusnap-runc-w i0 t0 mib o
    need_s 100 c || return 0
    if ! start "$id" "$name"; then
        row c.0 "runc run -d: ${WLABEL:-the worker} in a container" "ready, ok=1" \
            "exit $RC_RC, pid ${CPID:-none}; $(rc_err); log: $(tail -n 2 "$ST/$name.log" | tr '\n' ' ' | cut -c1-200)" FAIL
        return 0
    fi
    mib=$(smi_pid_mib "$CPID")
    row c.0 "runc run -d: ${WLABEL:-the worker} in a container" "ready, ok=1" \
        "pid $CPID (its own: $ST_PID), nvidia-smi ${mib:-not listed} MiB" PASS "$START_S s"
    checkpoint c "$id" "$CPID" "$R/img-c" "$R/work-c" || return 0
    CKPT_S=$CK_S
    read_status "$ST/$name.status"
    i0=$ST_ITER
    restore c "$id-r" "$R/img-c" "$R/work-c-r" || return 0
    RESTORE_S=$RS_S
    t0=$(now)
    gs_state "$RPID"
    row c.s "gpusnap state of the restored pid $RPID" "running" "exit $GS_RC, ${S_STATE:-?}${GS_MSG:+; $GS_MSG}" \
        "$([ "$S_STATE" = running ] && echo PASS || echo FAIL)"
    progress c.c "$name" "$RPID" "$i0" "$t0" && step c "first status line after the restore" "$(fsub "$t0" "$(now)")" "iteration $ST_ITER"
    mib=$(smi_pid_mib "$RPID")
    row c.n "nvidia-smi lists the restored pid $RPID" "listed with its memory" "${mib:-not listed}${mib:+ MiB}" \
        "$([ -n "$mib" ] && [ "$mib" != 0 ] && echo PASS || echo FAIL)"
    o=$(ops "$RPID")
    row c.k "gpusnap's journal of the restored pid $RPID" "the plugin's restore (INFO)" "${o:-none}" INFO
    # Admission needs the footprint recorded at the checkpoint: in a pid
    # namespace of the container's own the restored process has another host
    # pid, and gpusnap moves the record to it (adopt).
    if [[ " $o " == *" lock "* || " $o " == *" adopt "* ]]; then KNOWN=1; fi
    row c.a "gpusnap knew the restored process (the checkpoint's record and footprint: admission)" \
        "the journal of pid $RPID holds the checkpoint's lock, or the record's move to it (adopt)" \
        "host pid $CPID -> $RPID$([ "$CPID" != "$RPID" ] && echo " (a pid namespace of its own)"); journal: ${o:-none}" \
        "$([ "$KNOWN" = 1 ] && echo PASS || echo FAIL)"
    row c.q "the plugin ran at restore" "cuda_plugin: resuming devices" "$(plugin_lines "$R/work-c-r/restore.log")" \
        "$(grep -q 'cuda_plugin: resuming devices' "$R/work-c-r/restore.log" && echo PASS || echo FAIL)"
    t0=$(now)
    stop_safely "$RPID" "end of the cycle" && step c "gpusnap stop" "$(fsub "$t0" "$(now)")"
    rm -rf "$R/img-c"
}

# fill_cycle: the restore meets a filler; the container must come back with
# its CUDA state checkpointed, and resume once the filler is gone.
fill_cycle() {
    local name=f id=gpusnap-runc-f i0 mib
    need_s 120 f || return 0
    # A restore without admission that does not fit would leave the process
    # stuck: where gpusnap did not know the restored pid, the container
    # shares the host's pids (the restore keeps them) for this flow.
    if [ "$KNOWN" != 1 ] && [[ " $RUNC_NAMESPACES " == *" pid "* ]]; then
        python3 - "$R/bundle/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["linux"]["namespaces"] = [n for n in c["linux"]["namespaces"] if n["type"] != "pid"]
json.dump(c, open(sys.argv[1], "w"), indent=1)
PY
        row f.ns "fill: the container's namespaces" "as the cycle's (INFO)" \
            "the host's pid namespace: gpusnap did not know the cycle's restored pid (c.a), a restore that does not fit would go without admission" INFO
    fi
    if ! start "$id" "$name"; then
        row f.0 "fill: runc run -d" "ready, ok=1" "exit $RC_RC, pid ${CPID:-none}; $(rc_err)" FAIL
        return 0
    fi
    mib=$(smi_pid_mib "$CPID")
    checkpoint f "$id" "$CPID" "$R/img-f" "$R/work-f" || return 0
    read_status "$ST/$name.status"
    i0=$ST_ITER
    fill_start fill "$mib" || return 0
    restore f "$id-r" "$R/img-f" "$R/work-f-r"
    if [ -z "$RPID" ] || ! alive "$RPID"; then
        row f.2 "fill: the container is back" "alive" "no process (runc exit $RS_RC)" FAIL
        kill_fillers
        return 0
    fi
    fill_refused fill checkpoint "$R/work-f-r/restore.log"
    fill_resume fill f "$name" "$RPID" "$i0"
    rm -rf "$R/img-f"
}

# bare_s STEP: that step's seconds in container-e2e's bare mode (RUNC_BARE_MD).
bare_s() {
    [ -n "$RUNC_BARE_MD" ] && [ -s "$RUNC_BARE_MD" ] || return 0
    awk -F'|' -v s="$1" '{ gsub(/^ +| +$/, "", $2); gsub(/^ +| +$/, "", $3); gsub(/ /, "", $4) } $2 == "bare" && $3 == s && $5 ~ /^ *exit 0/ { print $4; exit }' "$RUNC_BARE_MD"
}

figures() {
    local bd br
    bd=$(bare_s "criu dump")
    br=$(bare_s "criu restore -d")
    row fig.d "checkpoint: runc checkpoint against the same worker's bare criu dump" "figures (INFO)" \
        "runc ${CKPT_S:-?} s; bare ${bd:-not measured}${bd:+ s}$([ -n "$bd" ] && [ -n "$CKPT_S" ] && calc ' (x%.2f)' 'a / b' a="$CKPT_S" b="$bd")" INFO
    row fig.r "restore: runc restore -d against the same worker's bare criu restore -d" "figures (INFO)" \
        "runc ${RESTORE_S:-?} s; bare ${br:-not measured}${br:+ s}$([ -n "$br" ] && [ -n "$RESTORE_S" ] && calc ' (x%.2f)' 'a / b' a="$RESTORE_S" b="$br")" INFO
}

# ---------------------------------------------------------------- report

write_table() {
    {
        echo "# A CUDA container through runc, CRIU's CUDA plugin and gpusnap"
        echo
        echo "- date: $HDR_DATE; host: $HDR_HOST; kernel $HDR_KERNEL"
        echo "- gpu: $HDR_GPU, driver $HDR_DRIVER, $HDR_GPU_MEM; gpusnap: $HDR_VERSION"
        echo "- runc: $RUNC ($(LD_LIBRARY_PATH=${RUNC_LD:-} timeout 10 "$RUNC" --version 2>/dev/null | head -n 1)); criu: ${CRIU_BIN:-none}, plugins: ${PLUGINS:-none}"
        echo "- worker: $(worker_cmd STATUS | tr '\n' ' ' | sed "s|$GPU_DIR/||"); namespaces: $RUNC_NAMESPACES; fill: $RUNC_FILL; bare figures: ${RUNC_BARE_MD:-none}"
        echo "- bundle: ${BUNDLE_NOTE:-none}"
        echo "- result: $NPASS passed, $NFAIL failed, $NSKIP skipped, $NINFO info"
        echo
        rows_md id check expected got result figure
        echo
        steps_md flow
    } >"$OUT/$NAME.md"
}

# delete_containers: `runc delete -f` of each container whose first process
# is gone or was never restored live (after cleanup_all's gpusnap stops).
delete_containers() {
    local id pid
    for id in ${CONTAINERS[@]+"${CONTAINERS[@]}"}; do
        pid=$(cat "$R/$id.pid" 2>/dev/null)
        case " $LEFT_ALIVE " in
            *" $pid "*) log "NOT deleting container $id: its pid $pid could not be stopped safely"; continue ;;
        esac
        [ -e "$R/state/$id" ] || continue
        runc_call delete -f "$id"
    done
}

on_exit() {
    local rc=$?
    trap - ERR
    rows_end "$rc"
    delete_containers
    write_table
    rows_exit
}

# ---------------------------------------------------------------- main

install_traps
start_watchdog $((RUNC_BUDGET_S + 60))
collect_header
if setup; then
    cycle
    if [ "$RUNC_FILL" = 1 ]; then fill_cycle; fi
    figures
fi
FINISHED=1
