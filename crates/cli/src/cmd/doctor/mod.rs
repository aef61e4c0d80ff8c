//! `doctor`: what this host (and a process) has and lacks for checkpointing.

mod checks;
mod container;
mod swap;

pub use checks::*;

use crate::cli::Cli;
use crate::output::Out;
use gpusnap_cuda::{CheckpointApi, CudaDriver, Deadline, Timeouts};
use gpusnap_gpu::{GpuInventory, NvmlInventory};
use std::time::Duration;

pub fn run(cli: &Cli, out: &Out, pid: Option<i32>) -> anyhow::Result<()> {
    let mut findings = checks::host(&cli.state_dir);
    findings.push(checks::criu(cli.criu.as_deref()));
    findings.push(checks::lazy_wake());
    findings.push(checks::ptrace());
    findings.extend(container::host());
    if let Some(pid) = pid {
        findings.extend(process_findings(pid));
    }
    out.doctor(&findings);
    Ok(())
}

/// Doctor's checks of one process, with the driver's state where it answers.
pub fn process_findings(pid: i32) -> Vec<Finding> {
    let host_gpus = NvmlInventory::load().ok().and_then(|n| n.gpus().ok()).map(|g| g.len()).unwrap_or(0);
    let mut f = checks::process(pid, host_gpus);
    f.extend(container::findings(std::path::Path::new("/proc"), pid));
    // Waited for at load: the 5 s limit below is for the call, not the start-up.
    if let (Ok(t), Ok(d)) = (gpusnap_core::target::resolve_callable(pid), CudaDriver::load_ready()) {
        let api = Deadline::new(d, Timeouts { quick: Duration::from_secs(5), ..Timeouts::default() });
        let (severity, message) = match api.get_state(t.pid) {
            Ok(s) => (checks::Severity::Ok, format!("the driver reports it {s}")),
            Err(e) => (checks::Severity::Warn, format!("the driver answers: {e}")),
        };
        f.push(Finding { check: "driver-state", severity, message, fix: None });
    }
    f
}
