#!/usr/bin/env bash
# Checkpoint and restore of a fake CUDA program in a podman container
# against the same program outside one, both through CRIU and its CUDA
# plugin with gpusnap as the plugin's cuda-checkpoint.
#
#   sudo bench/cpu/container.sh        REPS=5 MIB=1024 PROFILE=debug sudo bench/cpu/container.sh
#
# container = `podman container checkpoint` / `podman container restore`
# (runc calling CRIU, and crun where a crun with CRIU support is found:
# $CRUN, else /opt/gpusnap/criu/bin/crun from scripts/install-criu.sh --crun; the runtime's own work: its state, the container's
# rootfs changes and /dev/shm, conmon); process = `criu dump --tree` /
# `criu restore -d` of the same program started bare. The fake driver
# (docs/design/fakes.md) copies at 100 GB/s, so what differs is what the
# container stack adds. Each way REPS times, alternating; prints a markdown
# table of medians. Needs root, podman and runc, CRIU with its CUDA plugin
# (scripts/install-criu.sh --cuda-plugin); uses a podman storage of its own.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=bench/cpu/lib.sh
. bench/cpu/lib.sh
record_self container-cpu "$@"
if [[ -x /opt/gpusnap/criu/bin/criu ]]; then PATH=/opt/gpusnap/criu/bin:$PATH; fi

REPS=${REPS:-5}
MIB=${MIB:-1024}
PROFILE=${PROFILE:-release}
plugins=$(dirname "$(command -v criu)")/../lib/criu
[[ -f $plugins/cuda_plugin.so ]] || {
	echo "no cuda_plugin.so next to criu (scripts/install-criu.sh --cuda-plugin)" >&2
	exit 2
}
command -v podman >/dev/null && command -v runc >/dev/null || {
	echo "podman and runc are needed (apt-get install podman runc)" >&2
	exit 2
}
CRUN=${CRUN:-/opt/gpusnap/criu/bin/crun}
if ! "$CRUN" --version 2>/dev/null | grep -q '+CRIU'; then
	echo "no crun with CRIU support at $CRUN: measuring runc only" >&2
	CRUN=
fi
# crun refuses hybrid cgroups whose v2 half holds a controller: podman
# runs it in a mount namespace of its own where that list is empty
# (docs/guides/containers.md, "crun and hybrid cgroups").
unified=/sys/fs/cgroup/unified/cgroup.controllers
hide=0
if [[ -n $(cat "$unified" 2>/dev/null) ]]; then hide=1; fi
flag=()
[[ $PROFILE == release ]] && flag=(--release)
cargo build "${flag[@]}" --quiet -p gpusnap -p gpusnap-fake-cuda -p gpusnap-fake-nvml -p gpusnap-fake-workload
target=$PWD/target/$PROFILE
work=$(mktemp -d /var/tmp/gpusnap-cbench.XXXXXX)
mkdir -p "$work"/{fake,fakelib,bin,shared,rootfs/{proc,sys,dev,tmp,etc}}
: >"$work/no-controllers"
ln -s "$target/libgpusnap_fake_cuda.so" "$work/fakelib/libcuda.so.1"
ln -s "$target/libgpusnap_fake_nvml.so" "$work/fakelib/libnvidia-ml.so.1"
export GPUSNAP_FAKE_DIR=$work/fake GPUSNAP_STATE_DIR=$work/state
cat >"$work/fake/config.json" <<JSON
{"gpus": [{"uuid": "GPU-00000000-0000-0000-0000-000000000000", "total_mib": 143771}],
 "checkpoint_gbps": 100.0, "restore_gbps": 100.0, "inject": []}
JSON
cat >"$work/bin/cuda-checkpoint" <<SH
#!/bin/sh
GPUSNAP_FAKE_DIR=$work/fake GPUSNAP_STATE_DIR=$work/state LD_LIBRARY_PATH=$work/fakelib exec $target/gpusnap cuda-checkpoint "\$@"
SH
cat >"$work/bin/criu" <<SH
#!/bin/sh
CRIU_FAULT=138 exec $(command -v criu) "\$@"
SH
chmod +x "$work/bin/"*
printf 'libdir %s\nfile-locks\n' "$(cd "$plugins" && pwd)" >"$work/criu.conf"
cat >"$work/storage.conf" <<TOML
[storage]
driver = "vfs"
graphroot = "$work/root"
runroot = "$work/runroot"
TOML
cat >"$work/containers.conf" <<TOML
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]
netns = "none"
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
tmp_dir = "$work/tmp"
conmon_env_vars = ["PATH=$work/bin:$PATH"]
TOML
export PATH=$work/bin:$PATH CONTAINERS_CONF=$work/containers.conf CONTAINERS_STORAGE_CONF=$work/storage.conf
cleanup() {
	podman rm --all --force --time 0 >/dev/null 2>&1 || true
	podman rmi --all --force >/dev/null 2>&1 || true
	if [[ -n ${bare:-} ]]; then kill -9 "$bare" 2>/dev/null || true; fi
	grep -o " $work[^ ]*" /proc/self/mountinfo | sort -r | xargs -r -n1 umount -l 2>/dev/null || true
	rm -rf -- "$work"
}
trap cleanup EXIT

# The image: the loader and libraries the binaries need; the build
# directory comes in by a read-only bind mount.
for lib in $(ldd "$target/fake-workload" "$target/gpusnap" | grep -v ":$" | grep -o '/[^ ]*' | sort -u); do
	mkdir -p "$work/rootfs$(dirname "$lib")"
	cp "$lib" "$work/rootfs$lib"
done
tar -C "$work/rootfs" -cf "$work/rootfs.tar" .
podman import "$work/rootfs.tar" localhost/gpusnap-bench:latest >/dev/null

status=$work/shared/status
# ready: waits (a minute at most) for the program's first iteration.
ready() {
	local n=0
	while ! [[ -s $status ]] || [[ $(cut -d' ' -f2 "$status") -lt 1 ]]; do
		((++n < 1200)) || { echo "the fake CUDA program did not start" >&2; exit 1; }
		sleep 0.05
	done
}
tsv=$work/runs.tsv
: >"$tsv"

# pod RUNTIME ARGS: podman with runc or crun.
pod() {
	local rt=$1
	shift
	if [[ $rt == runc ]]; then
		podman "$@"
	elif ((hide)); then
		unshare --mount --propagation private sh -c 'mount --bind "$0" "$1" && shift && exec podman "$@"' \
			"$work/no-controllers" "$unified" --runtime "$CRUN" "$@"
	else
		podman --runtime "$CRUN" "$@"
	fi
}

container() {
	local rep=$1 rt=$2 t0 t1 t2
	rm -f "$status"
	pod "$rt" run -d --name "c$rep" --pid=host --annotation "org.criu.config=$work/criu.conf" \
		-v "$work/fake:$work/fake" -v "$work/shared:$work/shared" -v "$target:$target:ro" -v "$work/fakelib:$work/fakelib:ro" \
		-e "LD_LIBRARY_PATH=$work/fakelib" -e "GPUSNAP_FAKE_DIR=$work/fake" \
		localhost/gpusnap-bench:latest "$target/fake-workload" --mib "$MIB" --status "$status" >/dev/null
	ready
	t0=$(now)
	pod "$rt" container checkpoint "c$rep" >/dev/null
	t1=$(now)
	pod "$rt" container restore "c$rep" >/dev/null
	t2=$(now)
	printf 'container-%s\t%s\t%s\n' "$rt" "$(secs "$t0" "$t1")" "$(secs "$t1" "$t2")" >>"$tsv"
	pod "$rt" rm --force --time 0 "c$rep" >/dev/null
}

process() {
	local rep=$1 t0 t1 t2 img=$work/img$1
	rm -f "$status"
	mkdir -p "$img"
	LD_LIBRARY_PATH=$work/fakelib setsid "$target/fake-workload" --mib "$MIB" --status "$status" \
		</dev/null >/dev/null 2>"$work/workload.log" &
	bare=$!
	disown "$bare"
	ready
	t0=$(now)
	criu dump --tree "$bare" --images-dir "$img" --file-locks --libdir "$plugins" --log-file "$img/dump.log"
	gone "$bare"
	t1=$(now)
	setsid criu restore --restore-detached --images-dir "$img" --file-locks --libdir "$plugins" \
		--log-file "$img/restore.log" </dev/null
	t2=$(now)
	printf 'process\t%s\t%s\n' "$(secs "$t0" "$t1")" "$(secs "$t1" "$t2")" >>"$tsv"
	kill -9 "$bare" 2>/dev/null || true
	gone "$bare"
	bare=
	rm -rf -- "$img"
}

for rep in $(seq 1 "$REPS"); do
	if ((rep % 2)); then container "$rep" runc; process "$rep"; else process "$rep"; container "$rep" runc; fi
	if [[ -n $CRUN ]]; then container "$rep" crun; fi
done

printf '%s MiB of fake GPU memory, %s runs each way (medians, seconds); CRIU %s, %s, %s\n\n' \
	"$MIB" "$REPS" "$(criu --version | head -1 | awk '{print $2}')" "$(podman --version)" "$(runc --version | head -1)${CRUN:+, $("$CRUN" --version | head -1)}"
python3 - "$tsv" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    way, c, r = line.split()
    rows.setdefault(way, []).append((float(c), float(r)))
print("| way | checkpoint | restore |")
print("|---|---|---|")
for way in ("process", "container-runc", "container-crun"):
    v = rows.get(way, [])
    if v:
        print(f"| {way} | {statistics.median(x[0] for x in v):.3f} | {statistics.median(x[1] for x in v):.3f} |")
PY
