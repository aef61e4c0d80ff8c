//! What the soak's tests share.

use std::path::PathBuf;
use std::process::Command;

/// Builds what the soak runs: gpusnap, the fakes and the guard's preload
/// (next to gpusnap, where `run --light` finds it); gpusnap's path.
pub fn build() -> PathBuf {
    let gpusnap = PathBuf::from(env!("CARGO_BIN_EXE_gpusnap-soak")).with_file_name("gpusnap");
    // scripts/test.sh has just built the whole workspace.
    if std::env::var_os("GPUSNAP_TEST_PREBUILT").is_some() {
        return gpusnap;
    }
    let st = Command::new(env!("CARGO"))
        .args(["build", "-q", "-p", "gpusnap", "-p", "gpusnap-fake-cuda", "-p", "gpusnap-fake-nvml"])
        .args(["-p", "gpusnap-fake-workload", "-p", "gpusnap-preload"])
        .status()
        .expect("cargo build");
    assert!(st.success(), "building gpusnap and the fakes failed");
    gpusnap
}
