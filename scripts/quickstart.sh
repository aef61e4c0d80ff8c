#!/usr/bin/env bash
# Build gpusnap, check this host, and take a CUDA program through
# suspend -> resume -> stop. On a host with a GPU and PyTorch the program is a
# real PyTorch worker; otherwise it is the fake CUDA workload of this
# workspace, run against the fake driver and NVML (docs/design/fakes.md), and the
# script says so.
#
#   scripts/quickstart.sh            GPUSNAP_STATE_DIR=DIR scripts/quickstart.sh
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

say() { printf '\n== %s\n' "$*"; }

# What the build needs, checked before minutes are spent building: each
# missing tool is named in one line with how to get it.
missing=0
need() {
    command -v "$1" >/dev/null 2>&1 && return 0
    echo "quickstart: $1 is missing: $2" >&2
    missing=1
}
if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
    PATH=$HOME/.cargo/bin:$PATH
fi
need cargo "install Rust 1.80 or newer (https://rustup.rs), then open a new shell"
need cc "install a C compiler (Debian/Ubuntu: apt-get install build-essential; Fedora: dnf install gcc)"
if command -v rustc >/dev/null 2>&1; then
    v=$(rustc --version | awk '{print $2}')
    if [ "$(printf '%s\n1.80.0\n' "$v" | sort -V | head -n1)" != 1.80.0 ]; then
        echo "quickstart: rustc $v is older than 1.80: rustup update" >&2
        missing=1
    fi
fi
[ "$missing" = 0 ] || exit 2

say "building gpusnap (release)"
cargo build --release --quiet -p gpusnap -p gpusnap-preload
bin=$root/target/release/gpusnap
"$bin" --version

work=$(mktemp -d /tmp/gpusnap-quickstart.XXXXXX)
export GPUSNAP_STATE_DIR=${GPUSNAP_STATE_DIR:-$work/state}
pid=
cleanup() {
    # Never kill a live CUDA process: gpusnap stop suspends it first.
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
        "$bin" stop --grace 5 --force "$pid" >/dev/null 2>&1 || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT

if nvidia-smi -L >/dev/null 2>&1 && python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    mode=gpu
else
    mode=fake
fi

say "gpusnap doctor (this host, as it is)"
"$bin" doctor || true

status=$work/status
if [ "$mode" = gpu ]; then
    say "GPU found: starting a PyTorch worker holding 2 GiB"
    python3 tests/gpu/worker.py 2 "$status" >"$work/worker.log" 2>&1 &
else
    say "no usable GPU here: using the fake driver and NVML from this workspace"
    PROFILE=release scripts/fakes.sh "$work/lib" >/dev/null
    export LD_LIBRARY_PATH=$work/lib GPUSNAP_FAKE_DIR=$work/fake
    mkdir -p "$GPUSNAP_FAKE_DIR"
    # One fake H200; copies at 4 GB/s so the progress is visible.
    cat >"$GPUSNAP_FAKE_DIR/config.json" <<'JSON'
{ "gpus": [ { "uuid": "GPU-00000000-0000-0000-0000-000000000000", "name": "NVIDIA H200 (fake)", "total_mib": 143771 } ],
  "checkpoint_gbps": 4.0, "restore_gbps": 8.0 }
JSON
    "$work/lib/fake-workload" --mib 8192 --status "$status" &
fi
pid=$!
for _ in $(seq 1 600); do
    [ -s "$status" ] && break
    sleep 0.1
done
[ -s "$status" ] || { echo "the workload did not start" >&2; exit 1; }
echo "workload pid $pid: $(cat "$status")"

say "gpusnap ps"
"$bin" ps
say "gpusnap suspend $pid"
"$bin" suspend "$pid"
"$bin" state "$pid"
say "gpusnap resume $pid"
"$bin" resume "$pid"
sleep 1
echo "workload status (pid iteration intact time): $(cat "$status")"
say "gpusnap stop $pid"
"$bin" stop --grace 5 "$pid"
pid=
say "the journal of that process"
"$bin" history "$(cut -d' ' -f1 "$status")" | tail -n 12

# Hibernate and wake a plain process tree with CRIU: real on any Linux host.
if ! command -v criu >/dev/null 2>&1 && [ -x /opt/gpusnap/criu/bin/criu ]; then
    PATH=/opt/gpusnap/criu/bin:$PATH
fi
criu_failed=
if ! command -v criu >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    say "installing CRIU (scripts/install-criu.sh)"
    scripts/install-criu.sh || criu_failed=1
    PATH=/opt/gpusnap/criu/bin:$PATH
fi
if command -v criu >/dev/null 2>&1; then
    say "hibernate and wake a plain process with CRIU"
    count=$work/count
    setsid bash -c 'i=0; while :; do i=$((i+1)); echo $i >"$1"; sleep 0.2; done' _ "$count" </dev/null >/dev/null 2>&1 &
    pid=$!
    sleep 1
    echo "counter pid $pid at $(cat "$count")"
    "$bin" hibernate "$pid" --image quickstart
    "$bin" images
    at=$(cat "$count")
    sleep 1
    echo "while hibernated the counter stays at $(cat "$count") (was $at)"
    wait "$pid" 2>/dev/null || true
    "$bin" wake quickstart --wait 10
    sleep 1
    echo "after wake it goes on from where it was: $(cat "$count")"
    "$bin" stop --grace 2 "$pid"
    pid=
    "$bin" images rm quickstart
else
    if [ -n "$criu_failed" ]; then
        say "CRIU could not be installed (scripts/install-criu.sh said why above): skipping hibernate/wake"
    else
        say "CRIU not available (run as root to install it): skipping hibernate/wake"
    fi
fi
say "done ($mode mode); see README.md for the commands"
