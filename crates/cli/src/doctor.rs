//! `gpusnap doctor`: why a host or a process can or cannot be checkpointed.

use gpusnap_cuda::{CheckpointApi, CudaDriver};
use gpusnap_gpu::{GpuInventory, NvmlInventory};
use serde::Serialize;
use std::path::Path;

#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Ok,
    Info,
    Warn,
    Error,
}

#[derive(Debug, Clone, Serialize)]
pub struct Finding {
    pub check: &'static str,
    pub severity: Severity,
    pub message: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

fn f(check: &'static str, severity: Severity, message: impl Into<String>, fix: Option<&str>) -> Finding {
    Finding { check, severity, message: message.into(), fix: fix.map(str::to_string) }
}

/// What killed gpusnaps left behind: hibernates never finished (a tree
/// left stopped, CUDA processes left suspended) and temporary images.
fn leftovers(state_dir: &Path, store: &gpusnap_core::store::Store) -> Vec<Finding> {
    let mut out = Vec::new();
    match gpusnap_hibernate::interrupted_hibernates(store) {
        Ok(list) => {
            for i in list {
                out.push(Finding {
                    check: "interrupted-hibernate",
                    severity: Severity::Warn,
                    message: format!(
                        "a hibernate to image {} was interrupted (gpusnap died); processes {:?} may be stopped or suspended",
                        i.image, i.pids
                    ),
                    fix: Some("run `gpusnap images gc` (or any hibernate, wake, suspend, resume or stop): it finishes the hibernate if its image is complete, else continues and resumes the tree".into()),
                });
            }
        }
        Err(e) => out.push(f("interrupted-hibernate", Severity::Warn, e.to_string(), None)),
    }
    let images = gpusnap_images::image::ImageStore::new(
        state_dir.join("images"),
        gpusnap_images::sign::Trust::default(),
    );
    for s in images.stale() {
        out.push(Finding {
            check: "stale-image",
            severity: Severity::Warn,
            message: format!(
                "{} is a temporary image left by a gpusnap that died ({} bytes)",
                s.path.display(),
                s.bytes
            ),
            fix: Some("`gpusnap images gc` removes it (so does the next hibernate)".into()),
        });
    }
    out
}

/// Host checks: driver and its checkpoint API, NVML and GPUs, huge pages,
/// privileges, the state directory.
pub fn host(state_dir: &Path) -> Vec<Finding> {
    let mut out = Vec::new();
    match CudaDriver::load_ready() {
        Ok(d) => out.push(f(
            "driver",
            Severity::Ok,
            format!("libcuda.so.1 loaded, driver API {}, checkpoint API present", d.api_version()),
            None,
        )),
        Err(e) => out.push(f(
            "driver",
            Severity::Error,
            e.to_string(),
            Some("install the NVIDIA driver r570 or newer (r580 for GPU remapping); without it gpusnap can only hibernate processes that use no GPU"),
        )),
    }
    match NvmlInventory::load() {
        Ok(n) => {
            let ver = n.driver_version().unwrap_or_else(|e| format!("unknown ({e})"));
            match n.gpus() {
                Ok(gpus) => {
                    out.push(f("nvml", Severity::Ok, format!("driver {ver}, {} GPU(s)", gpus.len()), None));
                    if let Ok(off) = n.persistence_off() {
                        if off > 0 {
                            out.push(f(
                                "persistence",
                                Severity::Info,
                                format!("persistence mode is off on {off} GPU(s): the first CUDA call after idle pays the driver's start-up"),
                                Some("nvidia-smi -pm 1 (or nvidia-persistenced)"),
                            ));
                        }
                    }
                    for g in gpus {
                        out.push(f(
                            "gpu",
                            Severity::Info,
                            format!(
                                "GPU {} {} {}: {} MiB free of {} MiB",
                                g.index,
                                g.name,
                                g.uuid,
                                g.free_bytes >> 20,
                                g.total_bytes >> 20
                            ),
                            None,
                        ));
                    }
                }
                Err(e) => out.push(f("nvml", Severity::Error, e.to_string(), None)),
            }
        }
        Err(e) => out.push(f(
            "nvml",
            Severity::Error,
            e.to_string(),
            Some("NVML ships with the driver; gpusnap needs it for footprints and admission control"),
        )),
    }
    match gpusnap_core::hostknob::THP.get() {
        Ok(sel) => {
            if sel == "always" {
                out.push(f("thp", Severity::Ok, "transparent huge pages: always", None));
            } else {
                out.push(f(
                    "thp",
                    Severity::Warn,
                    format!("transparent huge pages: {sel}; checkpoint runs about 2x slower than with `always` (measured on an H200: 1.6-2.0 GB/s vs 3.1 GB/s)"),
                    Some("echo always > /sys/kernel/mm/transparent_hugepage/enabled (host-wide; weigh it against your other workloads)"),
                ));
            }
        }
        Err(_) => out.push(f("thp", Severity::Info, "transparent huge pages: not available", None)),
    }
    out.push(pipes());
    if nix::unistd::geteuid().is_root() {
        out.push(f("privileges", Severity::Ok, "running as root", None));
    } else {
        out.push(f(
            "privileges",
            Severity::Warn,
            "not root: gpusnap can only act on processes of its own user",
            Some("run as root, or grant CAP_SYS_PTRACE"),
        ));
    }
    match gpusnap_core::store::Store::open(state_dir) {
        Ok(store) => {
            out.push(f(
                "state",
                Severity::Ok,
                format!("state store {} is writable", state_dir.display()),
                None,
            ));
            out.extend(leftovers(state_dir, &store));
        }
        Err(e) => {
            out.push(f("state", Severity::Error, e.to_string(), Some("use --state-dir or GPUSNAP_STATE_DIR")))
        }
    }
    if let Some(s) = sandbox() {
        out.push(s);
    }
    out.push(f(
        "sigkill",
        Severity::Info,
        "SIGKILL and the kernel's OOM killer cannot be intercepted: stop restored CUDA processes with `gpusnap stop`, never with kill -9",
        None,
    ));
    out
}

/// Checks of one process: what can keep the driver from checkpointing it.
/// /proc reading (it works where the driver does not, and never hangs),
/// and a fast-swap program's own account of its memory (bounded in time).
pub fn process(pid: i32, host_gpus: usize) -> Vec<Finding> {
    match gpusnap_core::target::resolve(pid) {
        Ok(_) => {
            let mut out = process_at(Path::new("/proc"), pid, host_gpus);
            out.extend(crate::doctor_fastswap::finding(pid));
            out
        }
        Err(e) => vec![f("process", Severity::Error, e.to_string(), None)],
    }
}

/// [`process`] on a /proc tree at `root` (tests give it crafted ones).
/// A rank of a multi-process job, as launchers (torchrun, vLLM, Ray,
/// mpirun through torch.distributed) describe it in the environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NcclJob {
    pub world_size: u32,
    pub rank: Option<u32>,
    /// MASTER_ADDR:MASTER_PORT: the job's rendezvous, shared by its ranks.
    pub rendezvous: Option<String>,
}

impl NcclJob {
    pub fn from_environ(env: &[u8]) -> Option<Self> {
        let var = |k: &str| {
            env.split(|b| *b == 0).find_map(|kv| {
                let kv = std::str::from_utf8(kv).ok()?;
                kv.strip_prefix(k)?.strip_prefix('=').map(str::to_string)
            })
        };
        let world_size = var("WORLD_SIZE")?.trim().parse().ok()?;
        let rank = var("RANK").and_then(|r| r.trim().parse().ok());
        let rendezvous = match (var("MASTER_ADDR"), var("MASTER_PORT")) {
            (Some(a), Some(p)) => Some(format!("{a}:{p}")),
            _ => None,
        };
        Some(Self { world_size, rank, rendezvous })
    }

    pub fn describe(&self) -> String {
        format!(
            "{} of a {}-rank job (WORLD_SIZE={}{})",
            self.rank.map_or("a rank".to_string(), |r| format!("rank {r}")),
            self.world_size,
            self.world_size,
            self.rendezvous.as_deref().map(|r| format!(", rendezvous {r}")).unwrap_or_default()
        )
    }

    /// The other processes under `root` (/proc) of the same job: the same
    /// world size and rendezvous, and libcuda mapped (a launcher carries the
    /// same environment but holds no CUDA state).
    pub fn peers(&self, root: &Path, pid: i32) -> Vec<i32> {
        let Some(rv) = &self.rendezvous else { return Vec::new() };
        let Ok(rd) = std::fs::read_dir(root) else { return Vec::new() };
        let mut out: Vec<i32> = rd
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
            .filter(|p| *p != pid)
            .filter(|p| {
                let dir = root.join(p.to_string());
                std::fs::read(dir.join("environ"))
                    .ok()
                    .and_then(|e| NcclJob::from_environ(&e))
                    .is_some_and(|j| j.world_size == self.world_size && j.rendezvous.as_ref() == Some(rv))
                    && std::fs::read_to_string(dir.join("maps")).is_ok_and(|m| m.contains("libcuda.so"))
            })
            .collect();
        out.sort_unstable();
        out
    }
}

/// What is known about suspending `pid` when it is a rank of a
/// multi-process NCCL job, said before a suspend; `None` for anything else.
/// `group` is what the suspend covers: ranks of the job left out are named.
pub fn nccl_job_note(pid: i32, group: &[i32]) -> Option<String> {
    let dir = Path::new("/proc").join(pid.to_string());
    let maps = std::fs::read_to_string(dir.join("maps")).ok()?;
    if !maps.contains("libnccl") {
        return None;
    }
    let job = NcclJob::from_environ(&std::fs::read(dir.join("environ")).ok()?)?;
    if job.world_size < 2 {
        return None;
    }
    let left_out: Vec<String> = job
        .peers(Path::new("/proc"), pid)
        .into_iter()
        .filter(|p| !group.contains(p))
        .map(|p| p.to_string())
        .collect();
    Some(format!(
        "process {pid} is {}: NVIDIA does not support checkpointing NCCL communicators across processes (see `gpusnap doctor {pid}`){}",
        job.describe(),
        if left_out.is_empty() {
            String::new()
        } else {
            format!(
                "; ranks of the same job not in this suspend: {} (they stall at their next collective until it is resumed)",
                left_out.join(" ")
            )
        }
    ))
}

pub fn process_at(root: &Path, pid: i32, host_gpus: usize) -> Vec<Finding> {
    let mut out = Vec::new();
    let dir = root.join(pid.to_string());
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap_or_default();
    let status = read("status");
    let field = |k: &str| status.lines().find_map(|l| l.strip_prefix(k)).map(|v| v.trim().to_string());
    let stat = read("stat");
    let comm =
        stat.find('(').zip(stat.rfind(')')).map(|(a, b)| stat[a + 1..b].to_string()).unwrap_or_default();
    let state =
        stat.rfind(')').and_then(|b| stat[b + 1..].split_whitespace().next()).unwrap_or("?").to_string();
    out.push(f("process", Severity::Info, format!("{pid} ({comm}), state {state}"), None));
    if state == "T" {
        out.push(f(
            "stopped",
            Severity::Error,
            "the process is stopped by a signal: the driver's lock and get-state hang on it (measured on r580)",
            Some("send it SIGCONT (or thaw its cgroup) first"),
        ));
    }
    if let Some(tp) = field("TracerPid:").and_then(|v| v.parse::<i32>().ok()).filter(|p| *p != 0) {
        let comm = std::fs::read_to_string(root.join(tp.to_string()).join("comm")).unwrap_or_default();
        let sev = if comm.trim() == "gpusnap" { Severity::Info } else { Severity::Warn };
        out.push(f(
            "traced",
            sev,
            format!("traced by {tp} ({}): a debugger holding it stopped makes the driver wait", comm.trim()),
            (sev == Severity::Warn).then_some("detach the debugger, or let gpusnap's guard be the tracer"),
        ));
    }
    if gpusnap_core::target::session_visible_in(&status) == Some(false) {
        out.push(f(
            "session",
            Severity::Warn,
            "its session leader is outside its pid namespace: CRIU cannot dump it, so hibernate and snapshot refuse it (suspend and resume still work)",
            Some("start it in a session of its own: setsid, or `gpusnap run`"),
        ));
    }
    let maps = read("maps");
    let mapped = |needle: &str| maps.lines().any(|l| l.contains(needle));
    let env = std::fs::read(dir.join("environ")).unwrap_or_default();
    if mapped("libgpusnap_preload") {
        match gpusnap_guard::light::socket_in_environ(&env) {
            Some(s) if gpusnap_guard::light::is_served(&s) => out.push(f(
                "guard",
                Severity::Ok,
                format!("guarded by `gpusnap run --light` (socket {})", s.display()),
                None,
            )),
            other => out.push(f(
                "guard",
                Severity::Warn,
                format!(
                    "carries gpusnap's preload library, but no guard answers on {}: a death now would not be suspended",
                    other.map_or("its socket (none in its environment)".into(), |s| s.display().to_string())
                ),
                Some("`gpusnap guard PID` serves its socket again"),
            )),
        }
    }
    if !mapped("libcuda.so") {
        out.push(f(
            "cuda",
            Severity::Info,
            "libcuda is not loaded: no CUDA state to checkpoint (plain CRIU is enough)",
            None,
        ));
        return out;
    }
    out.push(f("cuda", Severity::Ok, "libcuda is loaded", None));
    if mapped("libnccl") {
        // PyTorch loads libnccl into every CUDA process; what the driver
        // cannot checkpoint is a live communicator: NCCL's (and PyTorch's
        // NCCL) threads, or its shared-memory segments, show one.
        let threads: Vec<String> = std::fs::read_dir(dir.join("task"))
            .map(|rd| {
                rd.filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("comm")).ok())
                    .map(|c| c.trim().to_string())
                    .collect()
            })
            .unwrap_or_default();
        let live = threads.iter().any(|c| c.to_ascii_lowercase().contains("nccl")) || mapped("/dev/shm/nccl");
        let job = NcclJob::from_environ(&env).filter(|j| j.world_size > 1);
        if let Some(j) = job {
            let peers = j.peers(root, pid);
            out.push(f(
                "nccl",
                Severity::Warn,
                format!(
                    "{}{}: the communicator spans processes. NVIDIA does not support checkpointing NCCL communicators (NVIDIA/cuda-checkpoint#5); a one-rank communicator survived suspend and resume on an H200 with r580, ranks across processes are untested on this driver (tests/gpu/multi-e2e.sh, section m5, checks them on two GPUs). A rank suspended alone stalls the others at their next collective",
                    j.describe(),
                    if peers.is_empty() {
                        String::new()
                    } else {
                        format!(
                            "; the other ranks on this host: {}",
                            peers.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(" ")
                        )
                    }
                ),
                Some("suspend every rank of the job in one call (all the pids, `--tree LAUNCHER` or `--cgroup`), so that all or none are suspended; or destroy the communicators first (torch.distributed.destroy_process_group; vLLM: sleep mode)"),
            ));
        } else if live {
            out.push(f(
                "nccl",
                Severity::Warn,
                "NCCL communicators are live (NCCL threads or shared memory): NVIDIA does not support checkpointing them (NVIDIA/cuda-checkpoint#5); a one-rank communicator survived suspend and resume on an H200 with r580 (measured), communicators across processes or GPUs are not expected to",
                Some("destroy the communicators before suspending (torch.distributed.destroy_process_group; vLLM: sleep mode), or run one GPU per process without NCCL"),
            ));
        } else {
            out.push(f(
                "nccl",
                Severity::Info,
                "libnccl is loaded but no communicator is live (PyTorch loads it into every CUDA process)",
                None,
            ));
        }
    }
    if mapped("/dev/nvidia-uvm") {
        out.push(f(
            "uvm",
            Severity::Warn,
            "unified memory (nvidia-uvm) is mapped: managed allocations make checkpoints larger and slower; over-subscribed managed memory can fail",
            None,
        ));
    }
    if mapped("libnvidia-ml.so") {
        out.push(f(
            "nvml",
            Severity::Warn,
            "the process has NVML loaded: NVML handles left open can keep /dev/nvidia* files busy",
            Some("call nvmlShutdown in the program when it is done with NVML"),
        ));
    }
    let var = |k: &str| {
        env.split(|b| *b == 0)
            .filter_map(|kv| std::str::from_utf8(kv).ok())
            .find_map(|kv| kv.strip_prefix(k).and_then(|v| v.strip_prefix('=')))
            .map(str::to_string)
    };
    if var("CUDA_MPS_PIPE_DIRECTORY").is_some()
        || mapped("nvidia-mps")
        || std::path::Path::new("/tmp/nvidia-mps").exists()
    {
        out.push(f(
            "mps",
            Severity::Error,
            "an MPS server is in use: MPS clients cannot be checkpointed",
            Some("run the process without MPS"),
        ));
    }
    if let Some(cvd) = var("CUDA_VISIBLE_DEVICES") {
        if cvd.contains("MIG-") {
            out.push(f(
                "mig",
                Severity::Warn,
                "the process uses a MIG instance: check the driver's MIG support for checkpoint",
                None,
            ));
        }
        let n = cvd.split(',').filter(|s| !s.trim().is_empty()).count();
        if host_gpus > 0 && n < host_gpus {
            out.push(f(
                "visible",
                Severity::Warn,
                format!("only {n} of {host_gpus} GPUs are visible to it (CUDA_VISIBLE_DEVICES={cvd}): it can only be restored onto GPUs it can see, and some containers break checkpoint this way (NVIDIA/cuda-checkpoint#27)"),
                Some("expose all GPUs to the container, or restore without a device map"),
            ));
        }
    }
    let devs = std::fs::read_dir(dir.join("fd"))
        .map(|rd| {
            rd.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                .filter(|p| p.to_string_lossy().starts_with("/dev/nvidia"))
                .count()
        })
        .unwrap_or(0);
    out.push(f(
        "devices",
        Severity::Info,
        if devs == 0 {
            "no /dev/nvidia* files open (suspended, or not using the GPU yet)".to_string()
        } else {
            format!("{devs} /dev/nvidia* files open")
        },
        None,
    ));
    out
}

/// Is this a gVisor sandbox, and what does its nvproxy need?
pub fn sandbox() -> Option<Finding> {
    let version = std::fs::read_to_string("/proc/version").unwrap_or_default();
    let gvisor = version.contains("gVisor")
        || std::path::Path::new("/proc/gvisor").exists()
        || std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default().contains("runsc");
    gvisor.then(|| {
        f(
            "sandbox",
            Severity::Warn,
            "running inside gVisor: checkpoint goes through nvproxy",
            Some("use a driver nvproxy supports (runsc nvproxy list-supported-drivers), put a cuda-checkpoint (gpusnap) inside the sandbox, and expose all GPUs to it; a checkpoint that did not run leaves nvproxy memory that runsc cannot save (report 002)"),
        )
    })
}

/// Whether `wake` can restore lazily here (userfaultfd with fork, remap and
/// unmap events: docs/design/wake.md), and `vm.unprivileged_userfaultfd`.
pub fn lazy_wake() -> Finding {
    let s = gpusnap_pages::support();
    let unpriv = match s.unprivileged {
        Some(true) => "vm.unprivileged_userfaultfd=1",
        Some(false) => "vm.unprivileged_userfaultfd=0 (root or CAP_SYS_PTRACE needed)",
        None => "vm.unprivileged_userfaultfd not readable",
    };
    match s.why_not {
        None => f(
            "lazy-wake",
            Severity::Ok,
            format!("userfaultfd with non-cooperative events (fork, remap, remove, unmap): wake fills memory lazily; {unpriv}"),
            None,
        ),
        Some(why) => f(
            "lazy-wake",
            Severity::Warn,
            format!("wake cannot restore lazily ({why}; {unpriv}): it falls back to CRIU's eager restore, slower for large processes"),
            Some("a kernel with CONFIG_USERFAULTFD (4.14+ for the events), run as root or set vm.unprivileged_userfaultfd=1, and no seccomp filter on userfaultfd(2)"),
        ),
    }
}

/// Whether gpusnap may ptrace other processes here: the guard (a dying
/// restored process suspended first) and the rescue of a lazy wake whose
/// page server fails under a driver restore (its other threads stopped)
/// need it. Yama's `kernel.yama.ptrace_scope` 3 forbids it to everyone.
pub fn ptrace() -> Finding {
    let scope = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
        .ok()
        .and_then(|v| v.trim().parse::<u8>().ok());
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    ptrace_finding(scope, root)
}

fn ptrace_finding(scope: Option<u8>, root: bool) -> Finding {
    let why = "the guard and the rescue of a failed lazy wake stop threads with ptrace";
    match (scope, root) {
        (Some(3), _) => f(
            "ptrace",
            Severity::Warn,
            format!("kernel.yama.ptrace_scope=3: no process may ptrace another ({why}): the guard cannot attach, and a lazy CUDA wake whose page server fails during the driver's restore waits for the restore's deadline"),
            Some("set kernel.yama.ptrace_scope to 1 or 2 (3 lasts until reboot)"),
        ),
        (Some(s), false) if s >= 1 => f(
            "ptrace",
            Severity::Warn,
            format!("kernel.yama.ptrace_scope={s} and not root: gpusnap can ptrace only its own children ({why})"),
            Some("run gpusnap as root (or with CAP_SYS_PTRACE)"),
        ),
        (s, _) => f(
            "ptrace",
            Severity::Ok,
            format!(
                "ptrace of other processes allowed ({}; {why})",
                s.map(|s| format!("kernel.yama.ptrace_scope={s}")).unwrap_or_else(|| "no Yama".into())
            ),
            None,
        ),
    }
}

/// CRIU's version, and whether it is new enough for this kernel.
pub fn criu(explicit: Option<&Path>) -> Finding {
    match gpusnap_hibernate::criu::Criu::find(explicit) {
        Ok(c) => {
            let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
            let k: Vec<u32> = kernel
                .trim()
                .split(|c: char| !c.is_ascii_digit())
                .filter_map(|x| x.parse().ok())
                .take(2)
                .collect();
            let new_kernel = k.len() == 2 && (k[0], k[1]) >= (6, 16);
            let old_criu =
                c.version.split('.').take(2).map(|x| x.parse::<u32>().unwrap_or(0)).collect::<Vec<_>>()
                    < vec![4, 2];
            if new_kernel && old_criu {
                f(
                    "criu",
                    Severity::Warn,
                    format!("criu {} on kernel {}: it cannot dump processes with inet sockets (fixed in CRIU 4.2)", c.version, kernel.trim()),
                    Some("scripts/install-criu.sh installs 4.2"),
                )
            } else {
                f("criu", Severity::Ok, format!("criu {} ({})", c.version, c.bin.display()), None)
            }
        }
        Err(e) => f(
            "criu",
            Severity::Warn,
            e.to_string(),
            Some("hibernate and wake need CRIU >= 4.0: scripts/install-criu.sh"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A crafted /proc/4242 with the given maps, environment and state.
    fn fixture(maps: &str, environ: &str, state: &str, tracer: i32) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("4242");
        std::fs::create_dir_all(p.join("fd")).unwrap();
        std::fs::write(
            p.join("stat"),
            format!("4242 (python3) {state} 1 4242 4242 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 12345"),
        )
        .unwrap();
        std::fs::write(p.join("status"), format!("Name:\tpython3\nTgid:\t4242\nTracerPid:\t{tracer}\n"))
            .unwrap();
        std::fs::write(p.join("maps"), maps).unwrap();
        std::fs::write(p.join("environ"), environ.replace(' ', "\0")).unwrap();
        std::fs::create_dir_all(d.path().join("77")).unwrap();
        std::fs::write(d.path().join("77/comm"), "gdb\n").unwrap();
        d
    }

    fn checks(v: &[Finding]) -> Vec<(&'static str, Severity)> {
        v.iter().map(|f| (f.check, f.severity)).filter(|(_, s)| *s >= Severity::Warn).collect()
    }

    const CUDA: &str = "7f00-7f01 r-xp 0 00:00 1 /usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04\n";

    #[test]
    fn ptrace_scope_three_or_an_unprivileged_caller_is_a_warning() {
        let sev = |scope, root| ptrace_finding(scope, root).severity;
        assert_eq!(sev(Some(3), true), Severity::Warn);
        assert_eq!(sev(Some(1), false), Severity::Warn);
        assert_eq!(sev(Some(2), true), Severity::Ok);
        assert_eq!(sev(Some(0), false), Severity::Ok);
        assert_eq!(sev(None, true), Severity::Ok);
    }

    #[test]
    fn a_clean_cuda_process_has_no_warnings() {
        let d = fixture(CUDA, "PATH=/bin", "S", 0);
        assert!(checks(&process_at(d.path(), 4242, 2)).is_empty());
    }

    #[test]
    fn nccl_uvm_nvml_mps_and_partial_visibility_are_named() {
        let maps = format!(
            "{CUDA}7f02-7f03 r-xp 0 00:00 2 /opt/lib/libnccl.so.2\n7f04-7f05 rw-s 0 00:05 3 /dev/nvidia-uvm\n7f06-7f07 r-xp 0 00:00 4 /usr/lib/libnvidia-ml.so.1\n"
        );
        let d = fixture(&maps, "CUDA_VISIBLE_DEVICES=1 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps", "S", 0);
        std::fs::create_dir_all(d.path().join("4242/task/4250")).unwrap();
        std::fs::write(d.path().join("4242/task/4250/comm"), "pt_nccl_watchdg\n").unwrap();
        let got = checks(&process_at(d.path(), 4242, 2));
        for want in ["nccl", "uvm", "nvml", "mps", "visible"] {
            assert!(got.iter().any(|(c, _)| *c == want), "{want} missing from {got:?}");
        }
        assert!(got.contains(&("nccl", Severity::Warn)));
    }

    #[test]
    fn a_light_program_without_its_guard_is_named() {
        let maps = format!("{CUDA}7f02-7f03 r-xp 0 00:00 2 /usr/lib/gpusnap/libgpusnap_preload.so\n");
        let d = fixture(&maps, "GPUSNAP_GUARD_SOCKET=/nonexistent/light-1.sock", "S", 0);
        let got = checks(&process_at(d.path(), 4242, 1));
        assert!(got.contains(&("guard", Severity::Warn)), "{got:?}");
    }

    #[test]
    fn a_session_outside_the_namespace_is_named() {
        let d = fixture(CUDA, "", "S", 0);
        let status = d.path().join("4242/status");
        let mut s = std::fs::read_to_string(&status).unwrap();
        s.push_str("NSsid:\t6774\t0\n");
        std::fs::write(&status, s).unwrap();
        let got = checks(&process_at(d.path(), 4242, 1));
        assert!(got.contains(&("session", Severity::Warn)), "{got:?}");
    }

    #[test]
    fn stopped_and_traced_processes_are_named() {
        let d = fixture(CUDA, "", "T", 77);
        let got = checks(&process_at(d.path(), 4242, 1));
        assert!(got.contains(&("stopped", Severity::Error)), "{got:?}");
        assert!(got.contains(&("traced", Severity::Warn)), "{got:?}");
    }

    #[test]
    fn no_libcuda_means_nothing_to_checkpoint() {
        let d = fixture("", "", "S", 0);
        let v = process_at(d.path(), 4242, 1);
        assert!(v.iter().any(|f| f.check == "cuda" && f.message.contains("not loaded")));
    }
}

#[cfg(test)]
mod nccl_tests {
    #[test]
    fn a_rank_of_a_multi_process_job_is_named_with_its_peers() {
        use super::*;
        let d = tempfile::tempdir().unwrap();
        for (pid, rank, cuda) in [(4242, 0, true), (4243, 1, true), (4244, 1, false), (4245, 0, true)] {
            let p = d.path().join(pid.to_string());
            std::fs::create_dir_all(p.join("task")).unwrap();
            let maps = if cuda {
                "1-2 r-xp 0 0:0 1 /usr/lib/libcuda.so.1\n3-4 r-xp 0 0:0 2 /x/libnccl.so.2\n"
            } else {
                "3-4 r-xp 0 0:0 2 /usr/bin/python3\n"
            };
            std::fs::write(p.join("maps"), maps).unwrap();
            let port = if pid == 4245 { 29501 } else { 29500 };
            std::fs::write(
                p.join("environ"),
                format!("A=1\0WORLD_SIZE=2\0RANK={rank}\0MASTER_ADDR=127.0.0.1\0MASTER_PORT={port}\0"),
            )
            .unwrap();
            std::fs::write(p.join("stat"), format!("{pid} (python3) S 1 1 1 0 -1 0")).unwrap();
            std::fs::write(p.join("status"), "Name:\tpython3\n").unwrap();
        }
        let v = process_at(d.path(), 4242, 2);
        let n = v.iter().find(|f| f.check == "nccl").expect("an nccl finding");
        assert_eq!(n.severity, Severity::Warn);
        assert!(n.message.contains("rank 0 of a 2-rank job"), "{}", n.message);
        // Same rendezvous and CUDA: 4243; the launcher (no libcuda) and another job are not.
        assert!(n.message.contains("the other ranks on this host: 4243"), "{}", n.message);
        assert!(n.fix.as_deref().unwrap().contains("in one call"));
    }

    use super::*;

    #[test]
    fn libnccl_alone_is_no_error() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("7");
        std::fs::create_dir_all(p.join("task/7")).unwrap();
        std::fs::write(p.join("task/7/comm"), "python3\n").unwrap();
        std::fs::write(p.join("stat"), "7 (python3) S 1").unwrap();
        std::fs::write(
            p.join("maps"),
            "1-2 r-xp 0 0:0 1 /usr/lib/libcuda.so.1\n3-4 r-xp 0 0:0 2 /x/libnccl.so.2\n",
        )
        .unwrap();
        let v = process_at(d.path(), 7, 1);
        assert!(v.iter().any(|f| f.check == "nccl" && f.severity == Severity::Info), "{v:?}");
    }
}

/// How large the pipes of a hibernate's dump can be (CRIU's, and the FIFOs
/// it writes its pages into): `fs.pipe-max-size` (1 MiB by default) bounds
/// them unless gpusnap holds CAP_SYS_RESOURCE.
fn pipes() -> Finding {
    use gpusnap_core::hostknob::{can_exceed_pipe_max, BIG_PIPE, PIPE_MAX};
    if can_exceed_pipe_max() {
        return f("pipes", Severity::Ok, "pipes: CAP_SYS_RESOURCE held, a dump's pipes get 64 MiB", None);
    }
    match PIPE_MAX.get().map(|v| v.parse::<u64>()) {
        Ok(Ok(n)) if n >= BIG_PIPE => {
            f("pipes", Severity::Ok, format!("pipes: fs.pipe-max-size {} MiB", n >> 20), None)
        }
        Ok(Ok(n)) => f(
            "pipes",
            Severity::Info,
            format!(
                "pipes: at most {} KiB each (fs.pipe-max-size, no CAP_SYS_RESOURCE): a hibernate's dump moves CRIU's pages through pipes that small",
                n >> 10
            ),
            Some("hibernate --big-pipes (raised for the dump only), or sysctl -w fs.pipe-max-size=67108864"),
        ),
        _ => f("pipes", Severity::Info, "pipes: fs.pipe-max-size unreadable", None),
    }
}
