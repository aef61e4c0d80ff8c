#!/usr/bin/env bash
# Builds the fake driver, the fake NVML and fake-workload, and links them
# into DIR under the real library names, so that LD_LIBRARY_PATH=DIR makes
# any program (gpusnap included) use them. See docs/design/fakes.md.
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

(cd "$root" && "$cargo" build --quiet "${profile_flag[@]}" \
    -p gpusnap-fake-cuda -p gpusnap-fake-nvml -p gpusnap-fake-workload)

target=${CARGO_TARGET_DIR:-$root/target}
case "$target" in /*) ;; *) target=$root/$target ;; esac
out=$target/$profile

mkdir -p "$dir"
ln -sfn "$out/libgpusnap_fake_cuda.so" "$dir/libcuda.so.1"
ln -sfn "$out/libgpusnap_fake_nvml.so" "$dir/libnvidia-ml.so.1"
# nvml-wrapper's Nvml::init() asks for the unversioned name.
ln -sfn "$out/libgpusnap_fake_nvml.so" "$dir/libnvidia-ml.so"
ln -sfn "$out/fake-workload" "$dir/fake-workload"
