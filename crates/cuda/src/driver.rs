use crate::error::{Code, DriverError};
use crate::ffi::{self, CUresult};
use crate::{Call, CheckpointApi, GpuPair, ProcessState};
use libloading::Library;
use std::ffi::CStr;
use std::os::raw::{c_char, c_int};
use std::ptr;
use std::sync::{Mutex, OnceLock, PoisonError};
use std::thread::JoinHandle;
use std::time::Instant;

/// The CUDA driver library, loaded at run time so that gpusnap builds and runs
/// on machines without one (and so that tests can put a fake first on
/// `LD_LIBRARY_PATH`).
///
/// `cuInit(0)` runs on a thread of its own, started by [`CudaDriver::load_from`]:
/// it is the slow part of loading (on an H200 a `gpusnap wake` spent ~0.27 s
/// before its own clock started, mostly the driver's and NVML's start-up,
/// docs/benchmarks.md), and a wake's first checkpoint-API call comes only
/// after the image check, admission and CRIU's restore. Every checkpoint-API
/// call waits for it first ([`CudaDriver::ready`]); a failed `cuInit` is that
/// call's error, the same one a synchronous load returned.
pub struct CudaDriver {
    init: Init,
    // Keeps the function pointers below valid; dropped after `init` is
    // joined (see `Drop`).
    _lib: Library,
    lib_name: String,
    api_version: i32,
    get_error_name: ffi::FnGetErrorName,
    lock: ffi::FnLock,
    checkpoint: ffi::FnCheckpoint,
    restore: ffi::FnRestore,
    unlock: ffi::FnUnlock,
    get_state: ffi::FnGetState,
    get_restore_tid: ffi::FnGetRestoreThreadId,
}

/// The background `cuInit` and, once joined, its outcome.
struct Init {
    thread: Mutex<Option<JoinHandle<Result<(), Code>>>>,
    done: OnceLock<Result<(), Code>>,
}

impl Init {
    /// Starts `cuInit(0)` on a thread. The thread uses only the two function
    /// pointers, which stay valid while the library is loaded: `CudaDriver`
    /// joins it before the library is closed.
    fn start(init: ffi::FnInit, get_error_name: ffi::FnGetErrorName) -> Self {
        let run = move || {
            let t0 = Instant::now();
            // SAFETY: cuInit takes a flags word that must be 0; the driver
            // allows it from any thread, concurrently with other calls.
            let rc = unsafe { init(0) };
            tracing::debug!(rc, ms = t0.elapsed().as_secs_f64() * 1e3, "cuInit");
            if rc == ffi::CUDA_SUCCESS {
                Ok(())
            } else {
                Err(name_of(get_error_name, rc))
            }
        };
        match std::thread::Builder::new().name("cuInit".into()).spawn(run) {
            Ok(h) => Self { thread: Mutex::new(Some(h)), done: OnceLock::new() },
            // No thread to be had: run it here, as before.
            Err(_) => Self { thread: Mutex::new(None), done: OnceLock::from(run()) },
        }
    }

    /// Waits for `cuInit` (the first caller joins the thread; the others
    /// block on the mutex meanwhile, then read the outcome).
    fn wait(&self) -> &Result<(), Code> {
        if let Some(r) = self.done.get() {
            return r;
        }
        let mut thread = self.thread.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(h) = thread.take() {
            // A thread that panicked: no outcome to give.
            let _ = self.done.set(h.join().unwrap_or_else(|_| Err(unknown())));
        }
        drop(thread);
        // Set by whoever took the thread, under the mutex (or at start).
        self.done.get_or_init(|| Err(unknown()))
    }
}

/// The outcome of a `cuInit` that gave none.
fn unknown() -> Code {
    Code { raw: ffi::CUDA_ERROR_UNKNOWN, name: "CUDA_ERROR_UNKNOWN".into() }
}

impl Drop for CudaDriver {
    fn drop(&mut self) {
        // The thread calls into the library: it ends before `_lib` is closed.
        // (A cuInit that never returns hangs here, as it hung a synchronous
        // load before.)
        self.init.wait();
    }
}

impl std::fmt::Debug for CudaDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDriver")
            .field("lib", &self.lib_name)
            .field("api_version", &self.api_version)
            .finish()
    }
}

/// Resolves one symbol and copies the function pointer out.
///
/// # Safety
/// `T` must be the exact C signature of `name` in the CUDA driver.
unsafe fn symbol<T: Copy>(lib: &Library, lib_name: &str, name: &'static str) -> Result<T, DriverError> {
    let mut cname = name.as_bytes().to_vec();
    cname.push(0);
    // SAFETY: the caller guarantees T matches the symbol's C type; the
    // pointer is only used while `lib` (owned by CudaDriver) stays loaded.
    unsafe { lib.get::<T>(&cname) }
        .map(|s| *s)
        .map_err(|_| DriverError::MissingSymbol { lib: lib_name.to_string(), symbol: name })
}

impl CudaDriver {
    /// Loads `libcuda.so.1` the way the dynamic linker finds it.
    pub fn load() -> Result<Self, DriverError> {
        Self::load_from("libcuda.so.1")
    }

    pub fn load_from(lib_name: &str) -> Result<Self, DriverError> {
        tracing::debug!(lib = lib_name, "loading the CUDA driver");
        // SAFETY: loading libcuda runs its initialisers, which have no
        // preconditions on our side.
        let lib = unsafe { Library::new(lib_name) }.map_err(|e| DriverError::Load {
            lib: lib_name.to_string(),
            reason: short_dl_error(&e.to_string()),
        })?;
        // SAFETY: each `symbol` type below is the signature from cuda.h for
        // that name (see ffi.rs).
        let init: ffi::FnInit = unsafe { symbol(&lib, lib_name, "cuInit")? };
        // SAFETY: as above.
        let get_version: ffi::FnDriverGetVersion = unsafe { symbol(&lib, lib_name, "cuDriverGetVersion")? };
        // SAFETY: as above.
        let get_error_name: ffi::FnGetErrorName = unsafe { symbol(&lib, lib_name, "cuGetErrorName")? };

        let mut version: c_int = 0;
        // SAFETY: cuDriverGetVersion writes one int through a valid pointer
        // and may be called before cuInit.
        let rc = unsafe { get_version(&mut version) };
        if rc != ffi::CUDA_SUCCESS {
            return Err(DriverError::Call { call: Call::Init, code: name_of(get_error_name, rc) });
        }
        if version < ffi::CHECKPOINT_MIN_API {
            return Err(DriverError::TooOld { found: version, needed: ffi::CHECKPOINT_MIN_API });
        }
        // SAFETY: as above.
        let lock: ffi::FnLock = unsafe { symbol(&lib, lib_name, "cuCheckpointProcessLock")? };
        // SAFETY: as above.
        let checkpoint: ffi::FnCheckpoint =
            unsafe { symbol(&lib, lib_name, "cuCheckpointProcessCheckpoint")? };
        // SAFETY: as above.
        let restore: ffi::FnRestore = unsafe { symbol(&lib, lib_name, "cuCheckpointProcessRestore")? };
        // SAFETY: as above.
        let unlock: ffi::FnUnlock = unsafe { symbol(&lib, lib_name, "cuCheckpointProcessUnlock")? };
        // SAFETY: as above.
        let get_state: ffi::FnGetState = unsafe { symbol(&lib, lib_name, "cuCheckpointProcessGetState")? };
        // SAFETY: as above.
        let get_restore_tid: ffi::FnGetRestoreThreadId =
            unsafe { symbol(&lib, lib_name, "cuCheckpointProcessGetRestoreThreadId")? };

        tracing::debug!(version, "driver API");
        Ok(Self {
            init: Init::start(init, get_error_name),
            _lib: lib,
            lib_name: lib_name.to_string(),
            api_version: version,
            get_error_name,
            lock,
            checkpoint,
            restore,
            unlock,
            get_state,
            get_restore_tid,
        })
    }

    /// Loads the driver and waits for its `cuInit`: what a caller whose first
    /// driver call comes at once needs (its errors are those of a load).
    pub fn load_ready() -> Result<Self, DriverError> {
        let d = Self::load()?;
        d.ready()?;
        Ok(d)
    }

    /// Waits for the background `cuInit`; its failure, every time it is asked.
    pub fn ready(&self) -> Result<(), DriverError> {
        self.init.wait().clone().map_err(|code| DriverError::Call { call: Call::Init, code })
    }

    fn check(&self, call: Call, pid: i32, rc: CUresult) -> Result<(), DriverError> {
        tracing::debug!(call = call.as_str(), pid, rc, "driver answered");
        if rc == ffi::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(DriverError::Call { call, code: name_of(self.get_error_name, rc) })
        }
    }
}

fn name_of(get_error_name: ffi::FnGetErrorName, rc: CUresult) -> Code {
    let mut s: *const c_char = ptr::null();
    // SAFETY: cuGetErrorName stores a pointer to a static NUL-terminated
    // string (or leaves it NULL for unknown codes).
    let ok = unsafe { get_error_name(rc, &mut s) } == ffi::CUDA_SUCCESS;
    let name = if ok && !s.is_null() {
        // SAFETY: non-NULL and NUL-terminated per the driver's contract; the
        // string is static in the driver library.
        unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
    } else {
        "CUDA_ERROR_UNKNOWN_CODE".to_string()
    };
    Code { raw: rc, name }
}

/// dlopen's messages repeat the library name; keep the useful tail.
fn short_dl_error(msg: &str) -> String {
    msg.rsplit(": ").next().unwrap_or(msg).to_string()
}

impl CheckpointApi for CudaDriver {
    fn api_version(&self) -> i32 {
        self.api_version
    }

    fn ready(&self) -> Result<(), DriverError> {
        CudaDriver::ready(self)
    }

    fn get_state(&self, pid: i32) -> Result<ProcessState, DriverError> {
        self.ready()?;
        let mut state: c_int = -1;
        // SAFETY: writes one int through a valid pointer.
        let rc = unsafe { (self.get_state)(pid, &mut state) };
        self.check(Call::GetState, pid, rc)?;
        Ok(ProcessState::from_raw(state))
    }

    fn lock(&self, pid: i32, timeout_ms: u32) -> Result<(), DriverError> {
        self.ready()?;
        let mut args = ffi::CUcheckpointLockArgs { timeout_ms, ..Default::default() };
        // SAFETY: args is a valid, zero-reserved 64-byte struct that outlives the call.
        let rc = unsafe { (self.lock)(pid, &mut args) };
        self.check(Call::Lock, pid, rc)
    }

    fn checkpoint(&self, pid: i32) -> Result<(), DriverError> {
        self.ready()?;
        // SAFETY: NULL args are documented as "use defaults".
        let rc = unsafe { (self.checkpoint)(pid, ptr::null_mut()) };
        self.check(Call::Checkpoint, pid, rc)
    }

    fn restore(&self, pid: i32, pairs: &[GpuPair]) -> Result<(), DriverError> {
        self.ready()?;
        if pairs.is_empty() {
            // SAFETY: NULL args restore onto the original GPUs.
            let rc = unsafe { (self.restore)(pid, ptr::null_mut()) };
            return self.check(Call::Restore, pid, rc);
        }
        if self.api_version < ffi::GPU_PAIRS_MIN_API {
            return Err(DriverError::NoRemap { found: self.api_version });
        }
        let raw: Vec<ffi::CUcheckpointGpuPair> = pairs
            .iter()
            .map(|p| ffi::CUcheckpointGpuPair {
                old_uuid: ffi::CUuuid { bytes: p.old.0 },
                new_uuid: ffi::CUuuid { bytes: p.new.0 },
            })
            .collect();
        let mut args = ffi::CUcheckpointRestoreArgs {
            gpu_pairs: raw.as_ptr(),
            gpu_pairs_count: raw.len() as u32,
            reserved: [0; 52 - std::mem::size_of::<*const ffi::CUcheckpointGpuPair>()],
            reserved1: 0,
        };
        // SAFETY: args points at `raw`, which lives until after the call; the
        // struct layout is the 13.0 one, used only when the driver is >= 13000.
        let rc = unsafe { (self.restore)(pid, &mut args) };
        self.check(Call::Restore, pid, rc)
    }

    fn unlock(&self, pid: i32) -> Result<(), DriverError> {
        self.ready()?;
        // SAFETY: NULL args are documented as "use defaults".
        let rc = unsafe { (self.unlock)(pid, ptr::null_mut()) };
        self.check(Call::Unlock, pid, rc)
    }

    fn restore_thread_id(&self, pid: i32) -> Result<i32, DriverError> {
        self.ready()?;
        let mut tid: c_int = -1;
        // SAFETY: writes one int through a valid pointer.
        let rc = unsafe { (self.get_restore_tid)(pid, &mut tid) };
        self.check(Call::GetRestoreThreadId, pid, rc)?;
        Ok(tid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_is_an_error_not_a_panic() {
        let err = CudaDriver::load_from("libcuda-does-not-exist.so.1").unwrap_err();
        assert!(matches!(err, DriverError::Load { .. }), "{err}");
        assert!(err.to_string().contains("r570"));
    }
}
