#!/usr/bin/env bash
# Builds the fake driver, the fake NVML and fake-workload (unless
# GPUSNAP_TEST_PREBUILT is set: already built), and links them into DIR under
# the real library names, so that LD_LIBRARY_PATH=DIR makes any program
# (gpusnap included) use them. See docs/design/fakes.md.
#
#   scripts/fakes.sh DIR        PROFILE=release scripts/fakes.sh DIR
set -euo pipefail

if [ $# -ne 1 ]; then
    echo "usage: $0 DIR" >&2
    exit 2
fi
dir=$1
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
profile=${PROFILE:-debug}
cargo=${CARGO:-cargo}

# Cargo's dev profile builds into target/debug.
case "$profile" in
    debug | dev) profile_flag=() ; profile=debug ;;
    release) profile_flag=(--release) ;;
    *) profile_flag=(--profile "$profile") ;;
esac

# GPUSNAP_TEST_PREBUILT: scripts/test.sh has just built the whole workspace.
if [ -z "${GPUSNAP_TEST_PREBUILT:-}" ]; then
    (cd "$root" && "$cargo" build --quiet "${profile_flag[@]}" \
        -p gpusnap-fake-cuda -p gpusnap-fake-nvml -p gpusnap-fake-workload)
fi

target=${CARGO_TARGET_DIR:-$root/target}
case "$target" in /*) ;; *) target=$root/$target ;; esac
out=$target/$profile

mkdir -p "$dir"
# Tests running side by side link the same names: a link under a name of
# its own, renamed over, never leaves a name missing or fails on another's.
link() {
    ln -sfn "$1" "$2.$$"
    mv -fT "$2.$$" "$2"
}
link "$out/libgpusnap_fake_cuda.so" "$dir/libcuda.so.1"
link "$out/libgpusnap_fake_nvml.so" "$dir/libnvidia-ml.so.1"
# nvml-wrapper's Nvml::init() asks for the unversioned name.
link "$out/libgpusnap_fake_nvml.so" "$dir/libnvidia-ml.so"
link "$out/fake-workload" "$dir/fake-workload"
