//! What a command runs on, built from the command line's settings: the
//! engine (driver, NVML, journal), the image stores, CRIU.

use crate::cli::Cli;
use crate::output::Out;
use gpusnap_core::Error as CoreError;
use gpusnap_core::{Engine, Store};
use gpusnap_cuda::{Absent, CheckpointApi, CudaDriver, Deadline, Timeouts};
use gpusnap_gpu::{GpuInventory, NoGpus, NvmlInventory};
use gpusnap_hibernate::criu::Criu;
use gpusnap_hibernate::{Error, Hibernate};
use gpusnap_images::image::ImageStore;
use std::path::Path;

pub type DynEngine = Engine<Box<dyn CheckpointApi>, Box<dyn GpuInventory>>;

/// How the driver and NVML are loaded for one command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Load {
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
/// clock started: docs/benchmarks.md); only `Background` does not wait
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

/// An engine on the real driver and NVML; without them only a lenient
/// `load` goes on, treating every process as one without CUDA (and refusing
/// those that map libcuda).
pub fn engine_with(cli: &Cli, out: &Out, load: Load) -> anyhow::Result<DynEngine> {
    let store = Store::open(&cli.state_dir)?;
    let (api, gpus) = driver_and_gpus(load)?;
    Ok(Engine::new(Deadline::new(api, Timeouts::default()), gpus, store).with_progress(out.progress()))
}

pub fn engine(cli: &Cli, out: &Out) -> anyhow::Result<DynEngine> {
    engine_with(cli, out, Load::Strict)
}

/// A quiet engine on the real driver for the state directory `dir`.
pub fn engine_at(dir: &Path) -> anyhow::Result<DynEngine> {
    let store = Store::open(dir)?;
    let (api, gpus) = driver_and_gpus(Load::Strict)?;
    Ok(Engine::new(Deadline::new(api, Timeouts::default()), gpus, store))
}

/// An engine that only reads, for a probe: the state directory opened
/// read-only (none there reads as empty), nothing written to it.
pub fn engine_read_only(dir: &Path) -> anyhow::Result<DynEngine> {
    let store = Store::open_read_only(dir)?;
    let (api, gpus) = driver_and_gpus(Load::Strict)?;
    Ok(Engine::new(Deadline::new(api, Timeouts::default()), gpus, store))
}

/// The image store, trusting this host's key and those of `--trust`.
pub fn images(cli: &Cli) -> Result<ImageStore, Error> {
    gpusnap_core::store::check_state_dir(&cli.state_dir)?;
    let trust = gpusnap_images::sign::Trust::new(&cli.state_dir, &cli.trust)?;
    Ok(ImageStore::new(cli.state_dir.join("images"), trust))
}

/// The image store trusting only this host's key: `recover` (and resume's
/// automatic recovery) act on the manifest's processes.
pub fn own_images(cli: &Cli) -> Result<ImageStore, Error> {
    gpusnap_core::store::check_state_dir(&cli.state_dir)?;
    let trust = gpusnap_images::sign::Trust::host_only(&cli.state_dir)?;
    Ok(ImageStore::new(cli.state_dir.join("images"), trust))
}

/// The next run after a gpusnap killed mid-hibernate finishes or undoes
/// what it left (a tree stopped by CRIU, CUDA processes suspended).
pub fn reconcile(cli: &Cli, e: &mut DynEngine) {
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
pub fn mib(v: u64) -> u64 {
    v.saturating_mul(1 << 20)
}

pub fn criu(cli: &Cli) -> Result<Criu, Error> {
    Ok(Criu::find(cli.criu.as_deref())?)
}
