//! The `gpusnap` command line: parses arguments, calls the library, prints.

mod agent;
mod compat;
mod doctor;
mod guarded;
mod output;

use clap::{Parser, Subcommand};
use gpusnap_core::engine::{ResumeOptions, StopOptions};
use gpusnap_core::Error as CoreError;
use gpusnap_hibernate::criu::Criu;
use gpusnap_hibernate::{HibernateOptions, WakeOptions};
use gpusnap_images::image::ImageStore;

use gpusnap_core::{Engine, Store};
use gpusnap_cuda::{Absent, CheckpointApi, CudaDriver, Deadline, Timeouts};
use gpusnap_gpu::{GpuInventory, NoGpus, NvmlInventory};
use gpusnap_hibernate::{Error, Hibernate};
use output::Out;
use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "gpusnap",
    version,
    about = "Take live CUDA processes off the GPU and bring them back, safely"
)]
struct Cli {
    /// Machine-readable output: one JSON object on stdout, no progress.
    #[arg(long, global = true)]
    json: bool,
    /// Where gpusnap keeps its journal, ledger and images.
    #[arg(long, global = true, env = "GPUSNAP_STATE_DIR", default_value = "/var/lib/gpusnap")]
    state_dir: PathBuf,
    /// More logging on stderr (-v: info, -vv: debug, every driver call).
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    /// The CRIU binary (default: `criu` on PATH); CRIU >= 4.0 is required, 4.2 on kernels >= 6.16.
    #[arg(long, global = true, env = "GPUSNAP_CRIU")]
    criu: Option<PathBuf>,
    /// Also trust images signed by KEY (64 hex digits, or a file holding
    /// them: `gpusnap images key` on the host that took them prints its
    /// key). Images signed by this host's own key are always trusted;
    /// `recover` trusts only those.
    #[arg(long, global = true, value_name = "KEY")]
    trust: Vec<String>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Every CUDA process this host can see, with its checkpoint state.
    Ps,
    /// The checkpoint state of one process.
    State { pid: i32 },
    /// Take processes' GPU state to host RAM (lock + checkpoint), freeing their GPU memory.
    Suspend {
        #[command(flatten)]
        select: Select,
        /// How long to wait for queued GPU work to drain before giving up (ms, 0 = forever).
        #[arg(long, default_value_t = 30_000)]
        lock_timeout: u32,
        /// Switch transparent huge pages to `always` for the checkpoint and
        /// back after it (host-wide while it runs; checkpoint about 1.5-2x
        /// faster, measured; see docs/pages.md).
        #[arg(long)]
        thp: bool,
    },
    /// Bring suspended processes back onto the GPU, only when the memory is there.
    Resume {
        #[command(flatten)]
        select: Select,
        /// Wait up to SECS for enough free GPU memory instead of refusing at once.
        #[arg(long, value_name = "SECS", default_value_t = 0)]
        wait: u64,
        /// Free memory to require on each GPU beyond the process's footprint (MiB).
        #[arg(long, value_name = "MIB", default_value_t = 256)]
        margin: u64,
        /// Footprint to assume for a process suspended outside gpusnap (MiB).
        #[arg(long, value_name = "MIB")]
        footprint: Option<u64>,
        /// Restore onto other GPUs of the same model: OLD=NEW,... (indices or
        /// UUIDs); GPUs not named are completed into a permutation.
        #[arg(long, value_name = "MAP", value_parser = parse_map)]
        device_map: Option<DeviceMap>,
        /// Take an image of the (suspended) process first, so that a restore
        /// raced by a tenant outside gpusnap can be recovered from it.
        #[arg(long)]
        snapshot_first: bool,
    },
    /// Suspend a process tree's CUDA state, dump the tree with CRIU into an image, and end it.
    ///
    /// A PID is the root of a tree (its children go with it). A group
    /// (several pids, --tree, --cgroup, --all) is hibernated as the trees
    /// that hold it, one image each (NAME-ROOT), all or nothing: no tree is
    /// ended until every image is written.
    Hibernate {
        #[command(flatten)]
        select: Select,
        /// Image name (default COMM-PID-MILLIS), under STATE_DIR/images.
        #[arg(long)]
        image: Option<String>,
        /// Keep the tree running (as it was) after the image is written.
        #[arg(long)]
        leave_running: bool,
        /// End the tree without waiting for the image to reach the disk
        /// (faster; a host crash right after could lose both).
        #[arg(long)]
        no_sync: bool,
        #[arg(long, default_value_t = 30_000)]
        lock_timeout: u32,
        /// Switch transparent huge pages to `always` for the checkpoint and
        /// back after it (host-wide while it runs; checkpoint about 1.5-2x
        /// faster, measured; see docs/pages.md).
        #[arg(long)]
        thp: bool,
        /// Raise fs.pipe-max-size to 64 MiB for the dump and back after it,
        /// where gpusnap lacks CAP_SYS_RESOURCE (host-wide while it runs: any
        /// process may then make pipes that large; CRIU's pages move through
        /// larger pipes, see docs/images.md). Also GPUSNAP_DUMP_BIG_PIPES=1.
        #[arg(long)]
        big_pipes: bool,
        /// Also build the image's map file (as `gpusnap images map`): a warm
        /// wake then maps its CUDA processes' host copies from the page cache
        /// instead of filling them (disk and page cache the size of those
        /// host copies; see docs/pages.md, "The mapped wake").
        #[arg(long)]
        map: bool,
    },
    /// Keep an image of a process tree and leave it as it is (= hibernate --leave-running).
    Snapshot {
        #[command(flatten)]
        select: Select,
        #[arg(long)]
        image: Option<String>,
        #[arg(long, default_value_t = 30_000)]
        lock_timeout: u32,
        /// As hibernate's --big-pipes.
        #[arg(long)]
        big_pipes: bool,
    },
    /// Restore a process tree from an image and put its CUDA processes back on the GPU.
    ///
    /// Several images (the trees of a hibernated group) are woken all or
    /// nothing: all verified and admitted together before any is restored.
    Wake {
        /// Image names under STATE_DIR/images, or paths to image directories.
        #[arg(required = true, num_args = 1..)]
        images: Vec<String>,
        /// Wait up to SECS for GPU memory and for the image's pids to come free.
        #[arg(long, value_name = "SECS", default_value_t = 0)]
        wait: u64,
        #[arg(long, value_name = "MIB", default_value_t = 256)]
        margin: u64,
        /// Do not attach the guard to the woken processes.
        #[arg(long)]
        no_guard: bool,
        /// Restore onto other GPUs of the same model: OLD=NEW,... (this host's
        /// indices, or UUIDs; the image's GPUs by UUID).
        #[arg(long, value_name = "MAP", value_parser = parse_map)]
        device_map: Option<DeviceMap>,
        /// Restore every page before the tree runs (CRIU alone), not lazily
        /// through gpusnap's page server while the tree already runs.
        #[arg(long)]
        eager: bool,
    },
    /// Bring back a process stuck after a failed restore from its newest image.
    Recover {
        pid: i32,
        /// Roll a process that is not stuck back to its image anyway.
        #[arg(long)]
        force: bool,
        #[arg(long, value_name = "SECS", default_value_t = 0)]
        wait: u64,
        #[arg(long, value_name = "MIB", default_value_t = 256)]
        margin: u64,
        /// Restore every page before the tree runs (CRIU alone), not lazily.
        #[arg(long)]
        eager: bool,
    },
    /// List, verify or remove images.
    Images {
        #[command(subcommand)]
        cmd: Option<ImagesCmd>,
    },
    /// Safe teardown: suspend, check the GPU memory is released, then SIGTERM/SIGKILL.
    Stop {
        #[command(flatten)]
        select: Select,
        /// Seconds between SIGTERM and SIGKILL.
        #[arg(long, value_name = "SECS", default_value_t = 10)]
        grace: u64,
        /// Kill even when the CUDA state cannot be suspended first (risky on some hosts).
        #[arg(long)]
        force: bool,
        #[arg(long, default_value_t = 30_000)]
        lock_timeout: u32,
    },
    /// Run a program under the guard: a dying CUDA process is suspended before it dies.
    ///
    /// Fatal signals (SIGSEGV, SIGABRT, an unhandled SIGTERM, ...) and exits
    /// (exit(), _exit() from any thread) of the program and of every child it
    /// starts are caught; the death then proceeds with its own signal or exit
    /// code, and `run` exits as the program did. SIGKILL (and the kernel's
    /// OOM killer) cannot be caught.
    Run {
        /// A name for the journal.
        #[arg(long)]
        name: Option<String>,
        #[arg(long, default_value_t = 10_000)]
        lock_timeout: u32,
        /// Do not leave a keeper that re-attaches a new guard if this one dies.
        #[arg(long)]
        no_keeper: bool,
        /// Watch the program's memory cgroup and suspend its CUDA processes
        /// while host memory can still take their device memory, so that
        /// the kernel's OOM killer (SIGKILL, uncatchable) finds them suspended.
        #[arg(long)]
        oom_watch: bool,
        /// No tracing: load libgpusnap_preload.so into the program, which asks
        /// the guard to suspend a dying process from inside it. Signals and
        /// forks then cost nothing extra; raw `exit_group` calls (Go, static
        /// binaries) and children that drop LD_PRELOAD are not caught
        /// (docs/guard.md).
        #[arg(long)]
        light: bool,
        /// The preload library for --light (default: next to gpusnap, or
        /// GPUSNAP_PRELOAD).
        #[arg(long, value_name = "PATH", requires = "light")]
        preload: Option<std::path::PathBuf>,
        #[arg(required = true, last = true)]
        cmd: Vec<OsString>,
    },
    /// Attach the guard to running processes (and their children).
    ///
    /// Fatal signals are caught. Exits are caught only for processes started
    /// by `gpusnap run` (they carry its exit filter, also after hibernate and
    /// wake): a filter cannot be added to a running process from outside.
    Guard {
        pids: Vec<i32>,
        #[arg(long, default_value_t = 10_000)]
        lock_timeout: u32,
        /// Take over from a guard that died (used by its keeper).
        #[arg(long, value_name = "GUARD_PID")]
        takeover: Option<i32>,
        /// Detach from the terminal and run in the background.
        #[arg(long)]
        daemon: bool,
    },
    /// NVIDIA's cuda-checkpoint command line, with gpusnap's safety (also
    /// reached through a link named cuda-checkpoint).
    #[command(disable_help_flag = true)]
    CudaCheckpoint {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, num_args = 0..)]
        args: Vec<OsString>,
    },
    /// The journal of one pid: every driver call gpusnap made on it.
    History { pid: i32 },
    /// The node agent: a proxy per model server that suspends it when idle
    /// and brings it back on the next request (docs/agent.md).
    Agent {
        #[arg(long, value_name = "FILE", default_value = "/etc/gpusnap/agent.toml")]
        config: PathBuf,
    },
    /// The agent's services and their states.
    Services {
        #[arg(long, env = "GPUSNAP_AGENT_SOCKET", default_value = "/run/gpusnap/agent.sock")]
        socket: PathBuf,
    },
    /// Ask the agent to act on one service.
    Service {
        name: String,
        #[arg(value_enum)]
        action: agent::Action,
        #[arg(long, env = "GPUSNAP_AGENT_SOCKET", default_value = "/run/gpusnap/agent.sock")]
        socket: PathBuf,
    },
    /// Check this host (and a process) for what checkpointing needs, and explain what is missing.
    Doctor {
        /// A process to check as well.
        pid: Option<i32>,
    },
}

/// Which processes a command acts on: pids, or a group.
#[derive(clap::Args, Debug)]
#[group(required = true, multiple = true)]
struct Select {
    /// Process ids.
    pids: Vec<i32>,
    /// Every CUDA process in the tree rooted at PID.
    #[arg(long, value_name = "PID")]
    tree: Option<i32>,
    /// Every CUDA process in a cgroup (a container or pod): a path under
    /// /sys/fs/cgroup, or absolute.
    #[arg(long, value_name = "PATH")]
    cgroup: Option<PathBuf>,
    /// Every CUDA process this host can see.
    #[arg(long)]
    all: bool,
}

#[derive(Subcommand)]
enum ImagesCmd {
    /// Every image (the default).
    List,
    /// Check an image's signature, manifest and every file's checksum.
    Verify { image: String },
    /// Remove an image (a name in the store, or the path of an image directory).
    Rm { image: String },
    /// Build an image's map file: its CUDA processes' large memory regions
    /// (the driver's host copy) laid out so that a warm wake maps them from
    /// the page cache instead of copying them in (docs/pages.md, "The mapped
    /// wake"). Costs disk and page cache the size of those regions.
    Map { image: String },
    /// Copy an image directory (from another host, say) into the store, verified.
    Import { path: String },
    /// Finish or undo hibernates a killed gpusnap left, remove its temporary
    /// images, and remove the chunks of STATE_DIR/store no image refers to.
    Gc,
    /// Send an image to a remote: s3://BUCKET/PREFIX (AWS_ACCESS_KEY_ID,
    /// AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ENDPOINT_URL, AWS_ALLOW_HTTP) or
    /// file:///DIR. Only the chunks the remote lacks are sent; the manifest last.
    Push { image: String, url: String },
    /// Fetch URL/NAME into the store (signed by a trusted key, every chunk checked).
    Pull {
        url: String,
        /// The name it gets here (default: its name on the remote).
        #[arg(long = "as", value_name = "NAME")]
        as_name: Option<String>,
    },
    /// This host's public key: what other hosts pass to --trust to wake its images.
    Key,
}

fn main() -> ExitCode {
    // The page server reads a wake's pages a chunk (1-4 MiB) at a time on
    // several threads; with glibc's defaults each such buffer is a fresh
    // mmap (or trimmed back after use), so every page of it faults in
    // again: keep buffers under 64 MiB on the heap and freed memory up to
    // 512 MiB there for the next one. The environment's MALLOC_* tunables
    // still win (glibc reads them before main).
    if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_none()
        && std::env::var_os("MALLOC_TRIM_THRESHOLD_").is_none()
    {
        // SAFETY: mallopt only changes the allocator's thresholds; called
        // first thing in main, before any other thread exists.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 64 << 20);
            libc::mallopt(libc::M_TRIM_THRESHOLD, 512 << 20);
        }
    }
    // Called as cuda-checkpoint (a link): NVIDIA's command line.
    let argv: Vec<OsString> = std::env::args_os().collect();
    if argv.first().and_then(|a| std::path::Path::new(a).file_name()).is_some_and(|n| n == "cuda-checkpoint")
    {
        init_logging(0);
        return ExitCode::from(compat::main(&argv[1..]) as u8);
    }
    // The keeper of a lazy wake (hidden: started by the wake itself).
    if argv.get(1).is_some_and(|a| a == gpusnap_hibernate::lazy::KEEPER_ARG) {
        return ExitCode::from(gpusnap_hibernate::lazy::keeper_main(&argv[2..]) as u8);
    }
    // The keeper of a dump through FIFOs (hidden: started by hibernate).
    if argv.get(1).is_some_and(|a| a == gpusnap_hibernate::dumpkeeper::KEEPER_ARG) {
        return ExitCode::from(gpusnap_hibernate::dumpkeeper::keeper_main(&argv[2..]) as u8);
    }
    if let Ok(exe) = std::env::current_exe() {
        gpusnap_hibernate::lazy::set_keeper_exe(exe);
    }
    let cli = Cli::parse();
    init_logging(cli.verbose);
    let out = Out::new(cli.json);
    match run(&cli, &out) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let code = match typed(e) {
                Ok(err) => {
                    let err = &err;
                    out.error(err.kind(), &err.to_string(), err.hint(), err.exit_code());
                    if let Some(pid) = failed_driver_pid(err) {
                        for f in process_findings(pid).into_iter().filter(|f| {
                            matches!(f.severity, doctor::Severity::Warn | doctor::Severity::Error)
                        }) {
                            eprintln!("  likely cause ({}): {}", f.check, f.message);
                        }
                    }
                    err.exit_code()
                }
                Err(e) => {
                    let code = agent::exit_code(&e).unwrap_or(1);
                    out.error("failed", &format!("{e:#}"), None, code);
                    code
                }
            };
            ExitCode::from(code as u8)
        }
    }
}

fn init_logging(verbose: u8) {
    let level = match verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("GPUSNAP_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_target(false).init();
}

type DynEngine = Engine<Box<dyn CheckpointApi>, Box<dyn GpuInventory>>;

/// An engine on the real driver and NVML; without them only `lenient`
/// commands go on, treating every process as one without CUDA (and refusing
/// those that map libcuda).
/// How the driver and NVML are loaded for one command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Load {
    /// A host without them is an error.
    Strict,
    /// A host without them (no library, or a driver that cannot start)
    /// handles only processes without CUDA.
    Lenient,
    /// As `Lenient`, but the driver's start-up (`cuInit`) is left running in
    /// the background when both libraries load: a wake's first driver call
    /// comes after the image check, admission and CRIU's restore, and it
    /// checks the start-up there (`Engine::driver_ready`).
    Background,
}

type DriverAndGpus = (Box<dyn CheckpointApi>, Box<dyn GpuInventory>);

/// The driver and NVML. `cuInit` runs on the driver's thread while NVML
/// initialises here (on an H200 the two cost a wake ~0.27 s before its own
/// clock started: docs/benchmarks.md P7); only `Background` does not wait
/// for it.
fn driver_and_gpus(mode: Load) -> Result<DriverAndGpus, Error> {
    let lenient = mode != Load::Strict;
    let absent = |e: gpusnap_cuda::DriverError| -> Result<Box<dyn CheckpointApi>, Error> {
        if lenient {
            tracing::info!("no CUDA driver ({e}); only processes without CUDA can be handled");
            Ok(Box::new(Absent { why: e.to_string() }))
        } else {
            Err(CoreError::Driverless(e).into())
        }
    };
    let driver = CudaDriver::load();
    let nvml = NvmlInventory::load();
    let api: Box<dyn CheckpointApi> = match driver {
        // Without NVML the start-up decides between an error and a host
        // without GPUs, so it is waited for.
        Ok(d) if mode == Load::Background && nvml.is_ok() => Box::new(d),
        Ok(d) => match d.ready() {
            Ok(()) => Box::new(d),
            Err(e) => absent(e)?,
        },
        Err(e) => absent(e)?,
    };
    let gpus: Box<dyn GpuInventory> = match nvml {
        Ok(n) => Box::new(n),
        Err(_) if lenient && api.api_version() == 0 => Box::new(NoGpus),
        Err(e) => return Err(CoreError::Gpu(e).into()),
    };
    Ok((api, gpus))
}

fn engine_with(cli: &Cli, out: &Out, load: Load) -> anyhow::Result<DynEngine> {
    let store = Store::open(&cli.state_dir)?;
    let (api, gpus) = driver_and_gpus(load)?;
    Ok(Engine::new(Deadline::new(api, Timeouts::default()), gpus, store).with_progress(out.progress()))
}

fn engine(cli: &Cli, out: &Out) -> anyhow::Result<DynEngine> {
    engine_with(cli, out, Load::Strict)
}

/// A quiet engine on the real driver for the state directory `dir`.
pub(crate) fn engine_at(dir: &std::path::Path) -> anyhow::Result<DynEngine> {
    let store = Store::open(dir)?;
    let (api, gpus) = driver_and_gpus(Load::Strict)?;
    Ok(Engine::new(Deadline::new(api, Timeouts::default()), gpus, store))
}

/// The image store, trusting this host's key and those of `--trust`.
fn images(cli: &Cli) -> Result<ImageStore, Error> {
    gpusnap_core::store::check_state_dir(&cli.state_dir)?;
    let trust = gpusnap_images::sign::Trust::new(&cli.state_dir, &cli.trust)?;
    Ok(ImageStore::new(cli.state_dir.join("images"), trust))
}

/// The image store trusting only this host's key: `recover` (and resume's
/// automatic recovery) act on the manifest's processes.
fn own_images(cli: &Cli) -> Result<ImageStore, Error> {
    gpusnap_core::store::check_state_dir(&cli.state_dir)?;
    let trust = gpusnap_images::sign::Trust::host_only(&cli.state_dir)?;
    Ok(ImageStore::new(cli.state_dir.join("images"), trust))
}

/// The next run after a gpusnap killed mid-hibernate finishes or undoes
/// what it left (a tree stopped by CRIU, CUDA processes suspended).
fn reconcile(cli: &Cli, e: &mut DynEngine) {
    let done = own_images(cli).and_then(|store| e.reconcile_hibernates(&store));
    match done {
        Ok(list) => {
            for i in list {
                eprintln!(
                    "gpusnap: reconciled a hibernate to image {} interrupted by a gpusnap that died: {} {:?}",
                    i.image, i.outcome, i.pids
                );
            }
        }
        Err(err) => tracing::warn!("could not reconcile interrupted hibernates: {err}"),
    }
}

/// MiB to bytes, saturating: a huge value is refused by admission, never
/// wrapped into a small one.
fn mib(v: u64) -> u64 {
    v.saturating_mul(1 << 20)
}

fn criu(cli: &Cli) -> Result<Criu, Error> {
    Ok(Criu::find(cli.criu.as_deref())?)
}

/// Runs `f` on each pid in order, stopping at the first failure; the
/// results so far are printed either way.
fn each<T: serde::Serialize>(
    out: &Out,
    pids: &[i32],
    mut f: impl FnMut(i32) -> Result<T, Error>,
    human: impl Fn(&T) -> String,
) -> anyhow::Result<()> {
    let mut done = Vec::new();
    for &pid in pids {
        match f(pid) {
            Ok(r) => {
                out.line(&human(&r));
                done.push(r);
            }
            Err(e) => {
                out.results(&done);
                return Err(e.into());
            }
        }
    }
    out.results(&done);
    Ok(())
}

fn run(cli: &Cli, out: &Out) -> anyhow::Result<()> {
    // A `--thp` or `--big-pipes` switch whose gpusnap died is put back by the next one.
    for e in gpusnap_core::hostknob::reconcile(&cli.state_dir) {
        tracing::warn!("{e}");
    }
    match &cli.cmd {
        Cmd::CudaCheckpoint { args } => std::process::exit(compat::main(args)),
        Cmd::Doctor { pid } => {
            let mut findings = doctor::host(&cli.state_dir);
            findings.push(doctor::criu(cli.criu.as_deref()));
            findings.push(doctor::lazy_wake());
            findings.push(doctor::ptrace());
            if let Some(pid) = pid {
                findings.extend(process_findings(*pid));
            }
            out.doctor(&findings);
            Ok(())
        }
        Cmd::Ps => {
            let mut e = engine(cli, out)?;
            let rows = e.ps()?;
            out.ps(&rows);
            Ok(())
        }
        Cmd::State { pid } => {
            gpusnap_core::target::resolve_callable(*pid)?;
            let mut e = engine(cli, out)?;
            let r = e.state(*pid)?;
            out.state(&r);
            Ok(())
        }
        Cmd::Agent { config } => agent::run_agent(cli, config),
        Cmd::Services { socket } => agent::services(out, socket),
        Cmd::Service { name, action, socket } => agent::service(out, socket, name, *action),
        Cmd::History { pid } => {
            let store = Store::open_read_only(&cli.state_dir)?;
            let h = store.history(*pid)?;
            out.history(*pid, &h);
            Ok(())
        }
        Cmd::Suspend { select, lock_timeout, thp } => {
            select.validate(Check::Callable)?;
            let mut e = engine(cli, out)?;
            reconcile(cli, &mut e);
            let pids = &select.resolve(&mut e)?;
            // Said before anything is done: what is known about suspending a
            // rank of a multi-process NCCL job.
            for &pid in pids {
                if let Some(note) = doctor::nccl_job_note(pid, pids) {
                    eprintln!("gpusnap: warning: {note}");
                }
            }
            let _thp = thp.then(|| gpusnap_core::thp::Always::on(&cli.state_dir)).transpose()?;
            let r = e.suspend_group(pids, *lock_timeout, &|| out.progress())?;
            out.all(&r, output::suspended);
            Ok(())
        }
        Cmd::Resume { select, wait, margin, footprint, snapshot_first, device_map } => {
            select.validate(Check::Callable)?;
            let mut e = engine(cli, out)?;
            reconcile(cli, &mut e);
            let pids = &select.resolve(&mut e)?;
            let opts = ResumeOptions {
                margin_bytes: mib(*margin),
                wait: Duration::from_secs(*wait),
                footprint_bytes: footprint.map(mib),
                device_map: device_map.clone().map(|m| m.0).unwrap_or_default(),
            };
            let store = own_images(cli)?;
            if pids.len() > 1 && !snapshot_first {
                // A group: admission for all of it, restores in parallel.
                let r = e.resume_group(pids, &opts, &|| out.progress())?;
                out.all(&r, output::resumed);
                return Ok(());
            }
            let criu = if *snapshot_first { Some(criu(cli)?) } else { None };
            each(
                out,
                pids,
                |pid| {
                    if let Some(c) = &criu {
                        snapshot_if_suspended(&mut e, c, &store, pid)?;
                    }
                    match e.resume(pid, &opts) {
                        // Stuck, but an image of it exists: wake it from that.
                        Err(CoreError::Unrecoverable { reason, .. }) if has_image(&store, pid) => {
                            tracing::warn!(pid, "{reason}; recovering from its image");
                            let c = match &criu {
                                Some(c) => c.clone(),
                                None => Criu::find(cli.criu.as_deref())?,
                            };
                            let w = WakeOptions {
                                wait: opts.wait,
                                margin_bytes: opts.margin_bytes,
                                force_resume: vec![],
                                device_map: opts.device_map.clone(),
                                force: false,
                                eager: false,
                            };
                            e.recover(&c, &store, pid, &w).map(|w| output::recovered_as_resume(pid, &w))
                        }
                        other => other.map_err(Error::from),
                    }
                },
                output::resumed,
            )
        }
        Cmd::Hibernate { select, image, leave_running, lock_timeout, no_sync, thp, big_pipes, map } => {
            let _thp = thp.then(|| gpusnap_core::thp::Always::on(&cli.state_dir)).transpose()?;
            let opts = HibernateOptions {
                name: image.clone(),
                leave_running: *leave_running,
                lock_timeout_ms: *lock_timeout,
                durable: !no_sync,
                big_pipes: *big_pipes,
                map: *map,
            };
            hibernate(cli, out, select, &opts)
        }
        Cmd::Snapshot { select, image, lock_timeout, big_pipes } => {
            let opts = HibernateOptions {
                name: image.clone(),
                leave_running: true,
                lock_timeout_ms: *lock_timeout,
                durable: true,
                big_pipes: *big_pipes,
                map: false,
            };
            hibernate(cli, out, select, &opts)
        }
        Cmd::Wake { images: names, wait, margin, no_guard, device_map, eager } => {
            let c = criu(cli)?;
            let store = images(cli)?;
            // A remote image (URL/NAME) is put in place with its small files;
            // its pages stream from the remote as the wake reads them.
            let mut local_names = Vec::with_capacity(names.len());
            for n in names {
                if gpusnap_images::remote::Url::is_remote(n) {
                    let p = out.progress();
                    let done = std::sync::atomic::AtomicU64::new(0);
                    let r = gpusnap_images::remote::pull_for_wake(&store, n, &|t| p.begin("pull", t), &|k| {
                        p.update(done.fetch_add(k, std::sync::atomic::Ordering::Relaxed) + k)
                    });
                    p.end();
                    local_names.push(r?.0);
                } else {
                    local_names.push(n.clone());
                }
            }
            let names = &local_names;
            let mut e = engine_with(cli, out, Load::Background)?;
            reconcile(cli, &mut e);
            let opts = WakeOptions {
                wait: Duration::from_secs(*wait),
                margin_bytes: mib(*margin),
                force_resume: vec![],
                device_map: device_map.clone().map(|m| m.0).unwrap_or_default(),
                force: false,
                eager: *eager,
            };
            let r = e.wake_group(&c, &store, names, &opts)?;
            if !no_guard {
                let pids: Vec<i32> = r.iter().flat_map(|w| w.processes.iter().copied()).collect();
                if let Err(e) = start_guard(&cli.state_dir, &pids) {
                    tracing::warn!("woken, but the guard could not attach: {e}");
                }
            }
            if let [one] = r.as_slice() {
                out.one(one, &output::woken(one));
            } else {
                out.all(&r, output::woken);
            }
            Ok(())
        }
        Cmd::Run { light: true, name, lock_timeout, preload, oom_watch, cmd, .. } => {
            guarded::run_light(cli, name.clone(), *lock_timeout, preload.as_deref(), *oom_watch, cmd)
        }
        Cmd::Run { name, lock_timeout, no_keeper, oom_watch, cmd, .. } => {
            guarded::run(cli, name.clone(), *lock_timeout, !no_keeper, *oom_watch, cmd)
        }
        Cmd::Guard { pids, lock_timeout, takeover, daemon } => {
            guarded::guard(cli, pids, *lock_timeout, *takeover, *daemon)
        }
        Cmd::Recover { pid, wait, margin, force, eager } => {
            gpusnap_core::target::resolve(*pid)?;
            let c = criu(cli)?;
            let store = own_images(cli)?;
            let mut e = engine(cli, out)?;
            reconcile(cli, &mut e);
            let opts = WakeOptions {
                wait: Duration::from_secs(*wait),
                margin_bytes: mib(*margin),
                force_resume: vec![],
                device_map: vec![],
                force: *force,
                eager: *eager,
            };
            let r = e.recover(&c, &store, *pid, &opts)?;
            out.one(&r, &output::woken(&r));
            Ok(())
        }
        Cmd::Images { cmd } => {
            let store = images(cli)?;
            match cmd.as_ref().unwrap_or(&ImagesCmd::List) {
                ImagesCmd::List => {
                    let list = store.list();
                    let maps: Vec<Option<u64>> = list
                        .iter()
                        .map(|r| {
                            r.as_ref()
                                .ok()
                                .and_then(|(n, m)| gpusnap_images::mapfile::present(&cli.state_dir, n, m))
                        })
                        .collect();
                    out.images(&list, &maps)
                }
                ImagesCmd::Verify { image } => {
                    let (_, m) = store.verify(image, |_| {}).map_err(Error::from)?;
                    out.one(
                        &m,
                        &format!(
                            "{}: ok, {} files, {} bytes, signed by {}",
                            output::printable(image),
                            m.files.len(),
                            m.total_bytes(),
                            m.signer
                        ),
                    );
                }
                ImagesCmd::Rm { image } => {
                    store.remove(image).map_err(Error::from)?;
                    gpusnap_images::mapfile::remove(&cli.state_dir, image);
                    out.one(
                        &serde_json::json!({ "removed": image }),
                        &format!("removed {}", output::printable(image)),
                    );
                }
                ImagesCmd::Map { image } => {
                    let (dir, m) = store
                        .verify_with(image, gpusnap_images::manifest::ChunkCheck::Present, |_| {})
                        .map_err(Error::from)?;
                    let progress = out.progress();
                    match gpusnap_images::mapfile::build(&cli.state_dir, image, &dir, &m, progress.as_ref())
                        .map_err(Error::from)?
                    {
                        Some(b) => out.one(
                            &b,
                            &format!(
                                "{}: map file {} ({} bytes of pages in {} regions, {} ms)",
                                output::printable(image),
                                b.path,
                                b.bytes,
                                b.regions,
                                b.ms
                            ),
                        ),
                        None => out.one(
                            &serde_json::json!({ "image": image, "regions": 0 }),
                            &format!(
                                "{}: no region to map (no large memory of a CUDA process)",
                                output::printable(image)
                            ),
                        ),
                    }
                }
                ImagesCmd::Import { path } => {
                    let (name, dir, m) = store.import(path, |_| {}).map_err(Error::from)?;
                    out.one(
                        &serde_json::json!({ "imported": name, "path": dir, "bytes": m.total_bytes() }),
                        &format!("imported {name} ({} bytes)", m.total_bytes()),
                    );
                }
                ImagesCmd::Gc => {
                    let reconciled = match engine_with(cli, out, Load::Lenient) {
                        Ok(mut e) => e.reconcile_hibernates(&own_images(cli)?)?,
                        Err(err) => return Err(err),
                    };
                    let mut removed = store.gc();
                    removed.extend(gpusnap_images::mapfile::gc(&cli.state_dir, &store.names()));
                    let p = out.progress();
                    let chunks_gc = {
                        let done = std::sync::atomic::AtomicU64::new(0);
                        p.begin("gc", 0);
                        let r = gpusnap_images::remote::gc(&store, &|n| {
                            p.update(done.fetch_add(n, std::sync::atomic::Ordering::Relaxed) + n)
                        });
                        p.end();
                        r?
                    };
                    for i in &reconciled {
                        out.line(&format!(
                            "interrupted hibernate to {}: {} {:?}",
                            output::printable(&i.image),
                            i.outcome,
                            i.pids
                        ));
                    }
                    for r in &removed {
                        out.line(&format!("removed {} ({} bytes)", r.path.display(), r.bytes));
                    }
                    out.one(
                        &serde_json::json!({ "reconciled": reconciled, "removed": removed, "chunks": chunks_gc }),
                        &format!(
                            "{} reconciled, {} removed; chunks: {} removed ({} bytes freed), {} kept ({} bytes)",
                            reconciled.len(),
                            removed.len(),
                            chunks_gc.chunks_removed,
                            chunks_gc.bytes_freed,
                            chunks_gc.chunks_kept,
                            chunks_gc.bytes_kept
                        ),
                    );
                }
                ImagesCmd::Push { image, url } => {
                    let p = out.progress();
                    let done = std::sync::atomic::AtomicU64::new(0);
                    if let Ok((_, m)) = store.manifest(image) {
                        p.begin("push", m.total_bytes());
                    }
                    let r = gpusnap_images::remote::push(&store, image, url, &|n| {
                        p.update(done.fetch_add(n, std::sync::atomic::Ordering::Relaxed) + n)
                    });
                    p.end();
                    let r = r?;
                    out.one(
                        &r,
                        &format!(
                            "pushed {} to {}: {} bytes, {} sent ({} chunks), {} deduplicated, {:.1}s",
                            output::printable(image),
                            r.remote,
                            r.bytes_total,
                            r.bytes_sent,
                            r.chunks_sent,
                            r.bytes_deduplicated,
                            r.seconds
                        ),
                    );
                }
                ImagesCmd::Pull { url, as_name } => {
                    let (name, r) = pull(out, &store, url, as_name.as_deref())?;
                    out.one(
                        &serde_json::json!({ "name": name, "result": r }),
                        &format!(
                            "pulled {} as {name}: {} bytes, {} received ({} chunks), {} deduplicated, {:.1}s",
                            output::printable(url),
                            r.bytes_total,
                            r.bytes_sent,
                            r.chunks_sent,
                            r.bytes_deduplicated,
                            r.seconds
                        ),
                    );
                }
                ImagesCmd::Key => {
                    let k = gpusnap_images::sign::HostKey::load_or_create(&cli.state_dir)?;
                    out.one(&serde_json::json!({ "key": k.public_hex() }), &k.public_hex());
                }
            }
            Ok(())
        }
        Cmd::Stop { select, grace, force, lock_timeout } => {
            // A stopped process is stop's to refuse (or --force), not bad input.
            select.validate(Check::Exists)?;
            let mut e = engine_with(cli, out, Load::Lenient)?;
            reconcile(cli, &mut e);
            let pids = &select.resolve(&mut e)?;
            let opts = StopOptions {
                grace: Duration::from_secs(*grace),
                force: *force,
                lock_timeout_ms: *lock_timeout,
            };
            let r = e.stop_group(pids, &opts, &|| out.progress())?;
            out.all(&r, output::stopped);
            Ok(())
        }
    }
}

/// How much [`Select::validate`] asks of a pid named.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Check {
    /// A process gpusnap may act on (not a thread, a zombie, another user's).
    Exists,
    /// ... and not stopped: the driver would hang on it.
    Callable,
}

impl Select {
    /// The targets named, checked before the driver (or CRIU) is loaded, so
    /// that bad input gets the same error (exit 2) on a host without the
    /// driver as with one, and nothing is done when one of them is wrong:
    /// each pid named, the --tree root, the --cgroup.
    fn validate(&self, check: Check) -> Result<(), Error> {
        let several = self.pids.len() > 1 || self.tree.is_some() || self.cgroup.is_some() || self.all;
        for &pid in &self.pids {
            let r = match check {
                Check::Exists => gpusnap_core::target::resolve(pid),
                Check::Callable => gpusnap_core::target::resolve_callable(pid),
            };
            // A group names the member, as the group's own errors do.
            r.map_err(
                |e| if several { Error::Member { pid, source: Box::new(e.into()) } } else { e.into() },
            )?;
        }
        if let Some(root) = self.tree {
            gpusnap_core::target::resolve(root)?;
        }
        if let Some(cg) = &self.cgroup {
            gpusnap_core::target::cgroup_processes(cg)?;
        }
        Ok(())
    }

    /// The roots of the trees a hibernate of this selection dumps: each pid
    /// named, the --tree root, the processes of a --cgroup, the CUDA
    /// processes (--all), less any that lies inside another's tree.
    fn roots(&self, e: &mut DynEngine) -> anyhow::Result<Vec<i32>> {
        let mut want: Vec<i32> = self.pids.clone();
        want.extend(self.tree);
        if let Some(cg) = &self.cgroup {
            want.extend(gpusnap_core::target::cgroup_processes(cg)?);
        }
        if self.all {
            want.extend(e.ps()?.into_iter().filter(|r| r.state != "stopped").map(|r| r.pid));
        }
        let mut roots = gpusnap_core::tree::roots_of(&want);
        // A group's member may end between the listing and now (a short-lived
        // process of a container); a pid named on the command line may not.
        roots.retain(|p| {
            self.pids.contains(p)
                || !matches!(
                    gpusnap_core::target::resolve(*p),
                    Err(CoreError::NoProcess { .. } | CoreError::Zombie { .. })
                )
        });
        Ok(roots)
    }

    /// The pids named, plus the CUDA processes of the groups named, in order
    /// and without repeats. A group that turns out empty is not an error.
    fn resolve(&self, e: &mut DynEngine) -> anyhow::Result<Vec<i32>> {
        let mut out: Vec<i32> = Vec::new();
        let mut push = |p: i32| {
            if !out.contains(&p) {
                out.push(p);
            }
        };
        self.pids.iter().copied().for_each(&mut push);
        if self.all || self.tree.is_some() || self.cgroup.is_some() {
            let cuda: Vec<i32> =
                e.ps()?.into_iter().filter(|r| r.state != "stopped").map(|r| r.pid).collect();
            if self.all {
                cuda.iter().copied().for_each(&mut push);
            }
            if let Some(root) = self.tree {
                gpusnap_core::target::resolve(root)?;
                let tree: Vec<i32> =
                    gpusnap_core::tree::process_tree(root).into_iter().map(|(p, _)| p).collect();
                cuda.iter().copied().filter(|p| tree.contains(p)).for_each(&mut push);
            }
            if let Some(cg) = &self.cgroup {
                let members = gpusnap_core::target::cgroup_processes(cg)?;
                cuda.iter().copied().filter(|p| members.contains(p)).for_each(&mut push);
            }
        }
        Ok(out)
    }
}

/// Hibernate (or snapshot) with the guard out of CRIU's way: CRIU must be
/// the only tracer while it dumps. The guard is re-attached where the tree
/// stays alive.
fn hibernate(cli: &Cli, out: &Out, select: &Select, opts: &HibernateOptions) -> anyhow::Result<()> {
    select.validate(Check::Callable)?;
    let c = criu(cli)?;
    let store = images(cli)?;
    let mut e = engine_with(cli, out, Load::Lenient)?;
    reconcile(cli, &mut e);
    let roots = select.roots(&mut e)?;
    if roots.is_empty() {
        // As for the other commands, a group that turns out empty is no error.
        eprintln!("gpusnap: no process in that group: nothing to hibernate");
        out.all::<gpusnap_hibernate::HibernateReport>(&[], output::hibernated);
        return Ok(());
    }
    let mut tree: Vec<i32> = Vec::new();
    for &root in &roots {
        gpusnap_core::target::resolve_callable(root)?;
        tree.extend(gpusnap_core::tree::process_tree(root).into_iter().map(|(p, _)| p));
    }
    let detached = gpusnap_guard::detach_for(&cli.state_dir, &tree)?;
    let res = e.hibernate_group(&c, &store, &roots, opts);
    respawn_guard(&cli.state_dir, &detached);
    let r = res?;
    if let [one] = r.as_slice() {
        out.one(one, &output::hibernated(one));
    } else {
        out.all(&r, output::hibernated);
    }
    Ok(())
}

/// Pulls `url` (URL/NAME) into the store, with a progress bar on a terminal.
fn pull(
    out: &Out,
    store: &ImageStore,
    url: &str,
    as_name: Option<&str>,
) -> Result<(String, gpusnap_chunks::TransferReport), Error> {
    let p = out.progress();
    let done = std::sync::atomic::AtomicU64::new(0);
    let r = gpusnap_images::remote::pull(store, url, as_name, &|t| p.begin("pull", t), &|n| {
        p.update(done.fetch_add(n, std::sync::atomic::Ordering::Relaxed) + n)
    });
    p.end();
    Ok(r?)
}

/// The state directory an image store lives in (`STATE/images`).
fn store_dir(store: &ImageStore) -> &std::path::Path {
    store.root.parent().unwrap_or(&store.root)
}

/// Re-attaches a guard to the detached processes that are still alive.
fn respawn_guard(state_dir: &std::path::Path, detached: &[i32]) {
    let alive: Vec<i32> =
        detached.iter().copied().filter(|p| gpusnap_core::target::resolve(*p).is_ok()).collect();
    if let Err(e) = start_guard(state_dir, &alive) {
        tracing::error!("could not re-attach the guard to {alive:?}: {e}");
    }
}

/// Starts `gpusnap guard --daemon PIDS` in the background.
fn start_guard(state_dir: &std::path::Path, pids: &[i32]) -> Result<(), Error> {
    if pids.is_empty() {
        return Ok(());
    }
    let exe = std::env::current_exe().map_err(|e| CoreError::Proc { pid: 0, reason: e.to_string() })?;
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("--state-dir").arg(state_dir).args(["guard", "--daemon"]);
    cmd.args(pids.iter().map(|p| p.to_string()));
    let st = cmd
        .stdin(std::process::Stdio::null())
        .status()
        .map_err(|e| CoreError::Proc { pid: 0, reason: format!("cannot start the guard: {e}") })?;
    if !st.success() {
        return Err(CoreError::Proc { pid: pids[0], reason: "the guard could not attach".into() }.into());
    }
    Ok(())
}

fn has_image(store: &ImageStore, pid: i32) -> bool {
    gpusnap_core::target::resolve(pid).is_ok_and(|t| store.find_for(pid, t.start_time).is_some())
}

/// `resume --snapshot-first`: an image of the process while it is suspended
/// (and so holds no GPU memory), kept until the next snapshot replaces it.
fn snapshot_if_suspended(e: &mut DynEngine, criu: &Criu, store: &ImageStore, pid: i32) -> Result<(), Error> {
    let st = e.state(pid)?;
    if st.state != "checkpointed" {
        return Ok(());
    }
    // A new name each time; older snapshots of this process go only once
    // the new one is written.
    let prefix = format!("resume-{pid}-{}-", st.start_time);
    let name = format!("{prefix}{}", gpusnap_core::store::now_ms());
    let older: Vec<String> = store
        .list()
        .into_iter()
        .filter_map(Result::ok)
        .map(|(n, _)| n)
        .filter(|n| n.starts_with(&prefix))
        .collect();
    let opts = HibernateOptions {
        name: Some(name),
        leave_running: true,
        lock_timeout_ms: 30_000,
        durable: true,
        big_pipes: false,
        map: false,
    };
    let tree: Vec<i32> = gpusnap_core::tree::process_tree(pid).into_iter().map(|(p, _)| p).collect();
    let detached = gpusnap_guard::detach_for(store_dir(store), &tree)?;
    let res = e.hibernate(criu, store, pid, &opts);
    respawn_guard(store_dir(store), &detached);
    res?;
    for n in older {
        let _ = store.remove(&n);
    }
    Ok(())
}

/// A `--device-map` value: OLD=NEW pairs.
#[derive(Debug, Clone)]
struct DeviceMap(Vec<(String, String)>);

fn parse_map(s: &str) -> Result<DeviceMap, String> {
    gpusnap_core::remap::parse(s).map(DeviceMap)
}

/// Doctor's checks of one process, with the driver's state where it answers.
fn process_findings(pid: i32) -> Vec<doctor::Finding> {
    let host_gpus = NvmlInventory::load().ok().and_then(|n| n.gpus().ok()).map(|g| g.len()).unwrap_or(0);
    let mut f = doctor::process(pid, host_gpus);
    // Waited for at load: the 5 s limit below is for the call, not the start-up.
    if let (Ok(t), Ok(d)) = (gpusnap_core::target::resolve_callable(pid), CudaDriver::load_ready()) {
        let api = Deadline::new(d, Timeouts { quick: Duration::from_secs(5), ..Timeouts::default() });
        let (severity, message) = match api.get_state(t.pid) {
            Ok(s) => (doctor::Severity::Ok, format!("the driver reports it {s}")),
            Err(e) => (doctor::Severity::Warn, format!("the driver answers: {e}")),
        };
        f.push(doctor::Finding { check: "driver-state", severity, message, fix: None });
    }
    f
}

/// The process a driver error is about, for doctor's explanation.
fn failed_driver_pid(e: &Error) -> Option<i32> {
    fn core(e: &CoreError) -> Option<i32> {
        match e {
            CoreError::Driver { pid, .. } => Some(*pid),
            CoreError::Member { source, .. } => core(source),
            _ => None,
        }
    }
    match e {
        Error::Member { source, .. } => failed_driver_pid(source),
        _ => e.core().and_then(core),
    }
}

/// The error as gpusnap's own, of whichever layer it came from.
fn typed(e: anyhow::Error) -> Result<Error, anyhow::Error> {
    let e = match e.downcast::<Error>() {
        Ok(e) => return Ok(e),
        Err(e) => e,
    };
    let e = match e.downcast::<CoreError>() {
        Ok(e) => return Ok(e.into()),
        Err(e) => e,
    };
    e.downcast::<gpusnap_images::Error>().map(Error::from)
}
