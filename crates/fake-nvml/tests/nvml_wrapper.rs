//! The fake NVML through `nvml-wrapper`, the way gpusnap uses it: every call
//! gpusnap makes must resolve and answer from the shared fake state.

use std::path::{Path, PathBuf};
use std::process::Command;

use gpusnap_fake_common::state::Proc;
use gpusnap_fake_common::{procfs, Alloc, ProcState, Store, MIB};
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;

/// Builds the fakes with `scripts/fakes.sh` (cargo does not build a cdylib
/// for its package's integration tests) for this test binary's profile, and
/// returns the library under its real name.
fn fake_nvml() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    // target/<profile>/deps/<this test>
    let out = exe.parent().unwrap().parent().unwrap();
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fakes");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/fakes.sh");
    let status = Command::new("bash")
        .arg(&script)
        .arg(&dir)
        .env("CARGO", env!("CARGO"))
        .env("CARGO_TARGET_DIR", out.parent().unwrap())
        .env("PROFILE", out.file_name().unwrap())
        .status()
        .unwrap();
    assert!(status.success(), "{} failed", script.display());
    dir.join("libnvidia-ml.so.1")
}

#[test]
fn nvml_wrapper_sees_the_fake_gpus() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        r#"{"driver_string":"580.1.2","driver_version":12080,"context_mib":10,
            "gpus":[{"total_mib":1024},{"name":"second","total_mib":2048}]}"#,
    )
    .unwrap();
    // The only test in this binary: nothing else reads the environment.
    std::env::set_var("GPUSNAP_FAKE_DIR", dir.path());

    // This process holds 100 MiB and a context on GPU 0; a checkpointed
    // process (a `sleep`) holds nothing and is not listed.
    let me = std::process::id() as i32;
    let mut sleeper = Command::new("sleep").arg("30").spawn().unwrap();
    let other = sleeper.id() as i32;
    let store = Store::at(dir.path());
    store
        .transact(|t| {
            let mut mine = Proc::new(procfs::stat(me).unwrap().start_time);
            mine.contexts.insert(0);
            mine.allocs.insert(0x1000, Alloc { gpu: 0, bytes: 100 * MIB, handle: None });
            t.state.procs.insert(me, mine);
            let mut parked = Proc::new(procfs::stat(other).unwrap().start_time);
            parked.contexts.insert(0);
            parked.allocs.insert(0x1000, Alloc { gpu: 0, bytes: 500 * MIB, handle: None });
            parked.state = ProcState::Checkpointed;
            parked.resident = false;
            t.state.procs.insert(other, parked);
        })
        .unwrap();

    let lib = fake_nvml();
    let nvml = Nvml::builder().lib_path(lib.as_os_str()).init().unwrap();
    assert_eq!(nvml.sys_driver_version().unwrap(), "580.1.2");
    assert_eq!(nvml.sys_cuda_driver_version().unwrap(), 12080);
    assert_eq!(nvml.device_count().unwrap(), 2);

    let gpu0 = nvml.device_by_index(0).unwrap();
    assert_eq!(gpu0.uuid().unwrap(), "GPU-00000000-0000-0000-0000-000000000000");
    assert_eq!(gpu0.name().unwrap(), "NVIDIA H200 (fake)");
    assert_eq!(gpu0.index().unwrap(), 0);
    assert!(gpu0.is_in_persistent_mode().unwrap());
    let mem = gpu0.memory_info().unwrap();
    assert_eq!((mem.total, mem.used, mem.free, mem.reserved), (1024 * MIB, 110 * MIB, 914 * MIB, 0));
    let procs = gpu0.running_compute_processes().unwrap();
    assert_eq!(procs.len(), 1);
    assert_eq!(procs[0].pid, me as u32);
    assert_eq!(procs[0].used_gpu_memory, UsedGpuMemory::Used(110 * MIB));
    assert_eq!(procs[0].gpu_instance_id, None);
    assert_eq!(gpu0.running_compute_processes_count().unwrap(), 1);

    let gpu1 = nvml.device_by_uuid("GPU-00000001-0000-0000-0000-000000000000").unwrap();
    assert_eq!(gpu1.index().unwrap(), 1);
    assert_eq!(gpu1.name().unwrap(), "second");
    assert!(gpu1.running_compute_processes().unwrap().is_empty());
    assert_eq!(gpu1.memory_info().unwrap().free, 2048 * MIB);

    assert!(matches!(nvml.device_by_uuid("GPU-nope"), Err(NvmlError::NotFound)));
    assert!(matches!(nvml.device_by_index(2), Err(NvmlError::InvalidArg)));

    // Once the sleeper is gone its checkpointed entry stays (its data is host
    // memory) but still counts for nothing.
    sleeper.kill().unwrap();
    sleeper.wait().unwrap();
    assert_eq!(gpu0.memory_info().unwrap().used, 110 * MIB);
    nvml.shutdown().unwrap();
}
