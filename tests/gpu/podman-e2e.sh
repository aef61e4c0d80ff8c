#!/usr/bin/env bash
# podman + runc + CRIU's CUDA plugin with gpusnap as its cuda-checkpoint, on a
# machine without a container runtime or a registry: podman, runc and conmon
# from Debian 12 .debs carried in PODMAN_DEBS (default .dev/debs, unpacked
# with dpkg-deb -x into scratch; a podman on PATH is used as it is), the
# container's root an empty directory with the host's /usr, /etc, /opt,
# /root bound read-only (python, CuPy and the driver's libraries as
# installed; no image), /tmp and the repository read-write, the GPU's
# device nodes passed with --device. A CuPy worker (CONT_GIB GiB) in a container: `podman container
# checkpoint`, `podman container restore`, its status line must advance with
# ok=1, gpusnap's journal must hold the plugin's calls.
#
# Run as root from the repository root (tests/gpu/device.sh container runs it
# after container-e2e.sh when PODMAN=1). Files: $OUT/podman-e2e.md and .log.
# Environment: GPUSNAP, OUT, CONT_GIB (2), PODMAN_DEBS, PODMAN_BUDGET_S (150),
# CONT_PLUGINS (CRIU's plugin directory; default PREFIX/lib/criu of the criu on PATH),
# CONT_WORKER (worker_cupy.py), PM_CC_ENV (more VAR=VALUE for gpusnap as
# cuda-checkpoint: a dry run's fake driver); a dry run's GPU_TEST_HOOK may replace
# pm_worker_cmd and pm_devices.

NAME=podman-e2e
# shellcheck source=tests/gpu/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

CONT_GIB=${CONT_GIB:-2}
CONT_WORKER=${CONT_WORKER:-worker_cupy.py}
PODMAN_DEBS=${PODMAN_DEBS:-.dev/debs}
PODMAN_BUDGET_S=${PODMAN_BUDGET_S:-150}
ROWS=$WORK/rows.tsv
: >"$ROWS"
NPASS=0 NFAIL=0 NSKIP=0 NINFO=0
FINISHED=0
PM=$WORK/pm
mkdir -p "$PM/bin" "$PM/tmp" "$PM/volumes"
CNAME=gpusnap-w

if ! declare -F pm_worker_cmd >/dev/null; then
    pm_worker_cmd() { printf '%s\n' python3 "$GPU_DIR/$CONT_WORKER" "$CONT_GIB" "$1"; }
fi
if ! declare -F pm_devices >/dev/null; then
    pm_devices() {
        local d
        for d in /dev/nvidia[0-9]* /dev/nvidiactl /dev/nvidia-uvm /dev/nvidia-uvm-tools; do
            [ -e "$d" ] && printf -- '--device=%s\n' "$d"
        done
    }
fi

# pm ARGS...: this run's podman, bounded; sets PM_RC, PM_S, PM_OUT (stdout+stderr, one line).
pm() {
    local t0 t1 o=$WORK/pm.out
    log "podman $*"
    t0=$(now)
    PM_RC=0
    timeout -k 10 180 env CONTAINERS_CONF="$PM/containers.conf" CONTAINERS_STORAGE_CONF="$PM/storage.conf" \
        PATH="$PM_PATH" LD_LIBRARY_PATH="${PM_LD:-}" podman "$@" </dev/null >"$o" 2>&1 || PM_RC=$?
    t1=$(now)
    PM_S=$(fsub "$t0" "$t1")
    PM_OUT=$(tr '\n' ' ' <"$o" | cut -c1-400)
    log "  -> exit $PM_RC in ${PM_S}s: $PM_OUT"
}

setup() {
    local d plugins criu
    if ! command -v podman >/dev/null; then
        if ! ls "$PODMAN_DEBS"/*.deb >/dev/null 2>&1; then
            row p0 "podman" "on PATH or carried .debs" "none (no podman, no $PODMAN_DEBS/*.deb)" FAIL
            return 1
        fi
        for d in "$PODMAN_DEBS"/*.deb; do dpkg-deb -x "$d" "$PM/root" || log "dpkg-deb -x $d failed"; done
        # Debian 12 packages put some libraries in /lib (libdevmapper), others in /usr/lib.
        PM_LD=$PM/root/usr/lib/x86_64-linux-gnu:$PM/root/lib/x86_64-linux-gnu
        PATH_EXTRA=$PM/root/usr/bin:$PM/root/usr/sbin:
    fi
    criu=$(command -v criu)
    plugins=${CONT_PLUGINS:-$(dirname "$(dirname "$criu")")/lib/criu}
    # gpusnap as the plugin's cuda-checkpoint, with this run's state dir (runc
    # gives criu only PATH).
    printf '#!/bin/sh\nGPUSNAP_STATE_DIR=%s %s exec %s cuda-checkpoint "$@"\n' "$STATE_DIR" "${PM_CC_ENV:-}" "$GPUSNAP" >"$PM/bin/cuda-checkpoint"
    chmod +x "$PM/bin/cuda-checkpoint"
    PM_PATH=$PM/bin:${PATH_EXTRA:-}$PATH
    printf 'libdir %s\nfile-locks\n' "$plugins" >"$PM/criu.conf"
    printf '[storage]\ndriver = "vfs"\ngraphroot = "%s/root-s"\nrunroot = "%s/runroot"\n' "$PM" "$PM" >"$PM/storage.conf"
    cat >"$PM/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]
netns = "none"
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
tmp_dir = "$PM/tmp"
volume_path = "$PM/volumes"
conmon_env_vars = ["PATH=$PM_PATH"]
conmon_path = ["$(PATH=$PM_PATH command -v conmon)"]
[engine.runtimes]
runc = ["$(PATH=$PM_PATH command -v runc)"]
EOF
    pm --version
    # Libraries of the carried programs the host lacks, named in the row.
    PM_MISSING=$(for b in podman conmon runc; do PATH=$PM_PATH LD_LIBRARY_PATH=${PM_LD:-} ldd "$(PATH=$PM_PATH command -v "$b")" 2>/dev/null; done |
        awk '/not found/ { print $1 }' | sort -u | tr '\n' ' ')
    [ -z "$PM_MISSING" ] || PM_OUT="$PM_OUT; libraries not found: $PM_MISSING"
    row p0 "podman from $([ -n "${PM_LD:-}" ] && echo "the carried .debs ($(du -sh "$PODMAN_DEBS" | cut -f1))" || echo PATH)" "podman --version exit 0" \
        "exit $PM_RC: $PM_OUT; runc $(PATH=$PM_PATH LD_LIBRARY_PATH=${PM_LD:-} runc --version 2>&1 | head -n 1)" "$([ "$PM_RC" = 0 ] && echo PASS || echo FAIL)"
    [ "$PM_RC" = 0 ]
}

flow() {
    local pid rpid i0 o st=$WORK/pm.status t0 devs=() vols=() d
    mapfile -t devs < <(pm_devices)
    rm -f "$st"
    # The host's programs read-only under an empty root; /tmp (status, state
    # dir) and the repository read-write.
    mkdir -p "$PM/rootfs"
    for d in bin sbin lib lib64 lib32 libx32 usr etc opt root; do
        if [ -L "/$d" ]; then
            ln -sfn "$(readlink "/$d")" "$PM/rootfs/$d"
        elif [ -d "/$d" ]; then
            mkdir -p "$PM/rootfs/$d"
            vols+=(-v "/$d:/$d:ro")
        fi
    done
    vols+=(-v /tmp:/tmp -v "$PWD:$PWD")
    # shellcheck disable=SC2046 # the worker's command line
    pm run -d --name "$CNAME" --pid=private --init=false --workdir "$PWD" \
        --annotation "org.criu.config=$PM/criu.conf" ${vols[@]+"${vols[@]}"} ${devs[@]+"${devs[@]}"} \
        --rootfs "$PM/rootfs" $(pm_worker_cmd "$st")
    row p1 "podman run -d, the host's programs bound read-only (${#devs[@]} GPU device nodes)" "exit 0" "exit $PM_RC: $PM_OUT" "$([ "$PM_RC" = 0 ] && echo PASS || echo FAIL)" "$PM_S s"
    [ "$PM_RC" = 0 ] || return 0
    pm inspect --format '{{.State.Pid}}' "$CNAME"
    pid=${PM_OUT%% *}
    [ -n "$pid" ] && [ "$pid" != 0 ] && WORKERS+=("$pid")
    if ! wait_iter_gt pm 1 120; then
        row p2 "the worker in the container is ready" "iteration >= 2, ok=1" "not ready (pid ${pid:-?}; logs: $(pm logs "$CNAME"; echo "$PM_OUT" | cut -c1-200))" FAIL
        return 0
    fi
    row p2 "the worker in the container is ready" "iteration >= 2, ok=1" "pid $pid, $(cat "$st"), nvidia-smi $(smi_pid_mib "$pid") MiB" PASS
    pm container checkpoint "$CNAME"
    row p3 "podman container checkpoint (the plugin through gpusnap)" "exit 0" "exit $PM_RC: $PM_OUT" "$([ "$PM_RC" = 0 ] && echo PASS || echo FAIL)" "$PM_S s"
    if [ "$PM_RC" != 0 ]; then
        for f in "$PM"/root-s/*/*/userdata/dump.log; do [ -s "$f" ] && tail -n 30 "$f" >"$WORK/tail.txt"; log_file "$f" "$WORK/tail.txt"; done
        return 0
    fi
    gs 30 history "$pid"
    o=$(jget "$GS_OUT" '" ".join(e["op"] for e in d["events"])')
    row p4 "gpusnap's journal of pid $pid after the checkpoint" "lock and checkpoint" "${o:-none}" \
        "$([[ " $o " == *" lock "* && " $o " == *" checkpoint "* ]] && echo PASS || echo FAIL)"
    mark_restored "$pid"
    read_status "$st"
    i0=$ST_ITER
    pm container restore "$CNAME"
    row p5 "podman container restore (admitted by gpusnap)" "exit 0" "exit $PM_RC: $PM_OUT" "$([ "$PM_RC" = 0 ] && echo PASS || echo FAIL)" "$PM_S s"
    if [ "$PM_RC" != 0 ]; then
        for f in "$PM"/root-s/*/*/userdata/restore.log; do [ -s "$f" ] && tail -n 30 "$f" >"$WORK/tail.txt"; log_file "$f" "$WORK/tail.txt"; done
        return 0
    fi
    t0=$(now)
    pm inspect --format '{{.State.Pid}}' "$CNAME"
    rpid=${PM_OUT%% *}
    [ -n "$rpid" ] && WORKERS+=("$rpid") && mark_restored "$rpid"
    if wait_iter_gt pm "${i0:-0}" 60 && [ "$ST_OK" = 1 ]; then
        row p6 "the worker computes again, checksum intact" "iteration > $i0, ok=1" "iteration $ST_ITER, ok=$ST_OK, pid $rpid" PASS "$(fsub "$t0" "$(now)") s"
    else
        row p6 "the worker computes again, checksum intact" "iteration > $i0, ok=1" "iteration ${ST_ITER:-?}, ok=${ST_OK:-?}" FAIL
    fi
    stop_safely "$rpid" "end of the podman flow" || true
}

write_table() {
    {
        echo "# podman + runc + CRIU's CUDA plugin through gpusnap"
        echo
        echo "- date: $HDR_DATE; host: $HDR_HOST; gpu: $HDR_GPU, driver $HDR_DRIVER; gpusnap: $HDR_VERSION"
        echo "- result: $NPASS passed, $NFAIL failed, $NSKIP skipped, $NINFO info"
        echo
        rows_md id check expected got result figure
    } >"$OUT/$NAME.md"
}

on_exit() {
    local rc=$?
    trap - ERR
    rows_end "$rc"
    [ -n "${PM_PATH:-}" ] && pm rm --all --force --time 0
    write_table
    rows_exit
}

install_traps
start_watchdog "$PODMAN_BUDGET_S"
collect_header
if setup; then flow; fi
FINISHED=1
