//! The `gpusnap` command line: parses arguments, calls the library, prints.

mod output;

use clap::{Parser, Subcommand};
use gpusnap_core::engine::{ResumeOptions, StopOptions};
use gpusnap_core::{doctor, Engine, Error, Store};
use gpusnap_cuda::{CudaDriver, Deadline, Timeouts};
use gpusnap_gpu::NvmlInventory;
use output::Out;
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
    #[arg(
        long,
        global = true,
        env = "GPUSNAP_STATE_DIR",
        default_value = "/var/lib/gpusnap"
    )]
    state_dir: PathBuf,
    /// More logging on stderr (-v: info, -vv: debug, every driver call).
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
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
        #[arg(required = true)]
        pids: Vec<i32>,
        /// How long to wait for queued GPU work to drain before giving up (ms, 0 = forever).
        #[arg(long, default_value_t = 30_000)]
        lock_timeout: u32,
    },
    /// Bring suspended processes back onto the GPU, only when the memory is there.
    Resume {
        #[arg(required = true)]
        pids: Vec<i32>,
        /// Wait up to SECS for enough free GPU memory instead of refusing at once.
        #[arg(long, value_name = "SECS", default_value_t = 0)]
        wait: u64,
        /// Free memory to require on each GPU beyond the process's footprint (MiB).
        #[arg(long, value_name = "MIB", default_value_t = 256)]
        margin: u64,
        /// Footprint to assume for a process suspended outside gpusnap (MiB).
        #[arg(long, value_name = "MIB")]
        footprint: Option<u64>,
    },
    /// Safe teardown: suspend, check the GPU memory is released, then SIGTERM/SIGKILL.
    Stop {
        #[arg(required = true)]
        pids: Vec<i32>,
        /// Seconds between SIGTERM and SIGKILL.
        #[arg(long, value_name = "SECS", default_value_t = 10)]
        grace: u64,
        /// Kill even when the CUDA state cannot be suspended first (risky on some hosts).
        #[arg(long)]
        force: bool,
        #[arg(long, default_value_t = 30_000)]
        lock_timeout: u32,
    },
    /// The journal of one pid: every driver call gpusnap made on it.
    History { pid: i32 },
    /// Check this host for what checkpointing needs, and explain what is missing.
    Doctor,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.verbose);
    let out = Out::new(cli.json);
    match run(&cli, &out) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let code = match e.downcast_ref::<Error>() {
                Some(err) => {
                    out.error(err.kind(), &format!("{e:#}"), err.hint(), err.exit_code());
                    err.exit_code()
                }
                None => {
                    out.error("failed", &format!("{e:#}"), None, 1);
                    1
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
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();
}

type RealEngine = Engine<CudaDriver, NvmlInventory>;

fn engine(cli: &Cli, out: &Out) -> anyhow::Result<RealEngine> {
    let store = Store::open(&cli.state_dir)?;
    let driver = CudaDriver::load().map_err(Error::Driverless)?;
    let nvml = NvmlInventory::load().map_err(Error::Gpu)?;
    Ok(
        Engine::new(Deadline::new(driver, Timeouts::default()), nvml, store)
            .with_progress(out.progress()),
    )
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
    match &cli.cmd {
        Cmd::Doctor => {
            let findings = doctor::host(&cli.state_dir);
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
            let mut e = engine(cli, out)?;
            let r = e.state(*pid)?;
            out.state(&r);
            Ok(())
        }
        Cmd::History { pid } => {
            let store = Store::open(&cli.state_dir)?;
            let h = store.history(*pid)?;
            out.history(*pid, &h);
            Ok(())
        }
        Cmd::Suspend { pids, lock_timeout } => {
            let mut e = engine(cli, out)?;
            each(
                out,
                pids,
                |pid| e.suspend(pid, *lock_timeout),
                output::suspended,
            )
        }
        Cmd::Resume {
            pids,
            wait,
            margin,
            footprint,
        } => {
            let mut e = engine(cli, out)?;
            let opts = ResumeOptions {
                margin_bytes: margin << 20,
                wait: Duration::from_secs(*wait),
                footprint_bytes: footprint.map(|m| m << 20),
            };
            each(out, pids, |pid| e.resume(pid, &opts), output::resumed)
        }
        Cmd::Stop {
            pids,
            grace,
            force,
            lock_timeout,
        } => {
            let mut e = engine(cli, out)?;
            let opts = StopOptions {
                grace: Duration::from_secs(*grace),
                force: *force,
                lock_timeout_ms: *lock_timeout,
            };
            each(out, pids, |pid| e.stop(pid, &opts), output::stopped)
        }
    }
}
