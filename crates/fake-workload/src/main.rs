//! `fake-workload`: a "CUDA program" for the fake driver, the stand-in for
//! `../shared/probe/worker.py`. It holds device memory, writes a known pattern
//! into it, and keeps reading it back and checking it, so that a test can see
//! whether a suspend/resume kept its data and whether it ran meanwhile.
//!
//! It dlopens `libcuda.so.1` like any CUDA program, so `LD_LIBRARY_PATH`
//! decides which driver it gets, and uses only the fake's workload API.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::thread::sleep;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::Parser;
use libloading::Library;

/// Holds N MiB on a (fake) GPU and checks K KiB of it every 100 ms.
#[derive(Parser, Debug)]
#[command(name = "fake-workload")]
struct Args {
    /// Device memory to allocate, in MiB.
    #[arg(long, default_value_t = 64)]
    mib: u64,
    /// Device ordinal to create the context on.
    #[arg(long, default_value_t = 0)]
    gpu: i32,
    /// How much of the allocation to fill with the pattern and check, in KiB.
    #[arg(long, default_value_t = 64)]
    data_kib: u64,
    /// Where to write `<pid> <iteration> <1 if intact else 0> <unix time>`;
    /// the program exits with 3 once `FILE.exit` exists.
    #[arg(long)]
    status: Option<PathBuf>,
    /// Queue this much GPU work (ms) every iteration, so that a lock has to
    /// wait for it.
    #[arg(long, default_value_t = 0)]
    busy_ms: u32,
    /// Start this many extra idle threads (their ids are thread ids of a
    /// CUDA process).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Print `ready <pid>` once the memory is allocated and written.
    #[arg(long)]
    print_ready: bool,
    /// Instead of running a workload, make one raw checkpoint-API call the
    /// way another tool would (lock, checkpoint, restore, unlock, state) on
    /// PID and print `rc=N`.
    #[arg(long, num_args = 2, value_names = ["ACTION", "PID"])]
    driver_call: Option<Vec<String>>,
    /// Die after --after-ms: `exit:N` (main thread), `exit-thread:N` (exit()
    /// from a second thread), `_exit:N`, `segv`, `abort`.
    #[arg(long)]
    die: Option<String>,
    #[arg(long, default_value_t = 500)]
    after_ms: u64,
    /// Handle SIGTERM: exit(N) from the main loop when it arrives.
    #[arg(long)]
    sigterm_exit: Option<i32>,
    /// Start a child process (the same program, status FILE.child) that holds
    /// CUDA state of its own.
    #[arg(long)]
    child: bool,
    /// Start a thread every N µs that ends at once (0: none): threads come
    /// and go while a tracer attaches.
    #[arg(long, default_value_t = 0)]
    churn_us: u64,
}

static SIGTERMED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn on_sigterm(_: c_int) {
    SIGTERMED.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// Dies the way `how` says (see --die).
fn die(how: &str) -> ! {
    let (mode, code) = how.split_once(':').map_or((how, 0), |(m, c)| (m, c.parse().unwrap_or(1)));
    match mode {
        "exit" => std::process::exit(code),
        "exit-thread" => {
            let h = std::thread::spawn(move || std::process::exit(code));
            let _ = h.join();
            loop {
                sleep(Duration::from_secs(1));
            }
        }
        // SAFETY: _exit has no preconditions.
        "_exit" => unsafe { libc::_exit(code) },
        "segv" => {
            // A real fault, as a crash would be: Rust's own SIGSEGV handler
            // sees it is no stack overflow, restores the default action and
            // returns, and the write faults again, fatally.
            // SAFETY: deliberately invalid; the process dies of it.
            unsafe { std::ptr::null_mut::<u8>().write_volatile(1) };
            std::process::exit(99)
        }
        "abort" => std::process::abort(),
        other => {
            eprintln!("fake-workload: unknown --die {other}");
            std::process::exit(2)
        }
    }
}

type CUresult = c_int;

/// The driver calls the workload makes, resolved once.
struct Cuda {
    init: unsafe extern "C" fn(c_uint) -> CUresult,
    device_get: unsafe extern "C" fn(*mut c_int, c_int) -> CUresult,
    ctx_create: unsafe extern "C" fn(*mut *mut c_void, c_uint, c_int) -> CUresult,
    mem_alloc: unsafe extern "C" fn(*mut u64, usize) -> CUresult,
    memcpy_htod: unsafe extern "C" fn(u64, *const c_void, usize) -> CUresult,
    memcpy_dtoh: unsafe extern "C" fn(*mut c_void, u64, usize) -> CUresult,
    enqueue_work: unsafe extern "C" fn(c_uint) -> CUresult,
    error_name: unsafe extern "C" fn(CUresult, *mut *const c_char) -> CUresult,
    /// Keeps the pointers above valid.
    _lib: Library,
}

impl Cuda {
    fn load() -> Result<Self, String> {
        // SAFETY: loading runs the library's initialisers; libcuda.so.1 is a
        // driver library meant to be loaded into any program.
        let lib = unsafe { Library::new("libcuda.so.1") }.map_err(|e| e.to_string())?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol is declared with the C signature the
                // driver (and the fake) give it in cuda.h.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }.map_err(|e| e.to_string())?
            };
        }
        Ok(Self {
            init: sym!("cuInit"),
            device_get: sym!("cuDeviceGet"),
            ctx_create: sym!("cuCtxCreate_v2"),
            mem_alloc: sym!("cuMemAlloc_v2"),
            memcpy_htod: sym!("cuMemcpyHtoD_v2"),
            memcpy_dtoh: sym!("cuMemcpyDtoH_v2"),
            enqueue_work: sym!("fakeEnqueueWork"),
            error_name: sym!("cuGetErrorName"),
            _lib: lib,
        })
    }

    /// `Ok` for `CUDA_SUCCESS`, else a message naming the call and the code.
    fn check(&self, call: &str, rc: CUresult) -> Result<(), String> {
        if rc == 0 {
            return Ok(());
        }
        let mut name: *const c_char = std::ptr::null();
        // SAFETY: `name` is a valid out-pointer for the call.
        let known = unsafe { (self.error_name)(rc, &mut name) } == 0 && !name.is_null();
        let name = if known {
            // SAFETY: the driver returned a static NUL-terminated string.
            unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned()
        } else {
            "unknown error".into()
        };
        Err(format!("{call}: {rc} {name}"))
    }
}

/// The known pattern: not constant and not a plain ramp, so a misplaced or
/// partial copy shows.
fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| ((i * 31 + 7) % 251) as u8).collect()
}

fn unix_time() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// Writes through a temporary file and a rename, so readers never see half.
fn write_status(path: &Path, line: &str) -> std::io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    std::fs::write(&tmp, line)?;
    std::fs::rename(&tmp, path)
}

fn run(args: &Args) -> Result<(), String> {
    let data_len = usize::try_from(args.data_kib * 1024).map_err(|e| e.to_string())?;
    let bytes = args.mib * 1024 * 1024;
    if data_len as u64 > bytes {
        return Err(format!("--data-kib {} does not fit in --mib {}", args.data_kib, args.mib));
    }
    let cuda = Cuda::load()?;
    let mut device: c_int = 0;
    let mut ctx: *mut c_void = std::ptr::null_mut();
    let mut ptr: u64 = 0;
    let data = pattern(data_len);
    // SAFETY: every out-pointer below points at a live local, and `data` is
    // `data_len` long as passed.
    unsafe {
        cuda.check("cuInit", (cuda.init)(0))?;
        cuda.check("cuDeviceGet", (cuda.device_get)(&mut device, args.gpu))?;
        cuda.check("cuCtxCreate_v2", (cuda.ctx_create)(&mut ctx, 0, device))?;
        if bytes > 0 {
            cuda.check("cuMemAlloc_v2", (cuda.mem_alloc)(&mut ptr, bytes as usize))?;
            cuda.check("cuMemcpyHtoD_v2", (cuda.memcpy_htod)(ptr, data.as_ptr().cast(), data_len))?;
        }
    }

    if args.churn_us > 0 {
        let every = Duration::from_micros(args.churn_us);
        std::thread::spawn(move || loop {
            let _ = std::thread::spawn(|| ());
            sleep(every);
        });
    }
    for _ in 0..args.threads {
        std::thread::spawn(|| loop {
            sleep(Duration::from_secs(3600));
        });
    }
    let pid = std::process::id();
    if args.print_ready {
        let mut out = std::io::stdout().lock();
        writeln!(out, "ready {pid}").and_then(|()| out.flush()).map_err(|e| e.to_string())?;
    }

    if let Some(code) = args.sigterm_exit {
        // SAFETY: installing a handler that only stores to an atomic.
        unsafe { libc::signal(libc::SIGTERM, on_sigterm as extern "C" fn(c_int) as libc::sighandler_t) };
        let _ = code;
    }
    let mut kid = None;
    if args.child {
        let mut a: Vec<String> = std::env::args().skip(1).filter(|x| x != "--child").collect();
        if let Some(i) = a.iter().position(|x| x == "--status") {
            a[i + 1] = format!("{}.child", a[i + 1]);
        }
        kid = Some(
            std::process::Command::new(std::env::current_exe().map_err(|e| e.to_string())?)
                .args(a)
                .spawn()
                .map_err(|e| e.to_string())?,
        );
    }
    let started = std::time::Instant::now();
    let exit_file = args.status.as_ref().map(|s| {
        let mut p = s.as_os_str().to_owned();
        p.push(".exit");
        PathBuf::from(p)
    });
    let mut back = vec![0u8; data_len];
    for iteration in 1u64.. {
        if args.busy_ms > 0 {
            // SAFETY: no pointers.
            cuda.check("fakeEnqueueWork", unsafe { (cuda.enqueue_work)(args.busy_ms) })?;
        }
        if data_len > 0 {
            // SAFETY: `back` is `data_len` long.
            let rc = unsafe { (cuda.memcpy_dtoh)(back.as_mut_ptr().cast(), ptr, data_len) };
            cuda.check("cuMemcpyDtoH_v2", rc)?;
        }
        let intact = back == data;
        if let Some(status) = &args.status {
            let line = format!("{pid} {iteration} {} {:.3}\n", u8::from(intact), unix_time());
            write_status(status, &line).map_err(|e| format!("{}: {e}", status.display()))?;
        }
        if exit_file.as_ref().is_some_and(|f| f.exists()) {
            std::process::exit(3);
        }
        if let (Some(code), true) = (args.sigterm_exit, SIGTERMED.load(std::sync::atomic::Ordering::SeqCst)) {
            std::process::exit(code);
        }
        if let Some(how) = &args.die {
            if started.elapsed() >= Duration::from_millis(args.after_ms) {
                if let Some(k) = kid.as_mut() {
                    let _ = k.wait();
                }
                die(how);
            }
        }
        sleep(Duration::from_millis(100));
    }
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(call) = &args.driver_call {
        return raw_call(&call[0], &call[1]);
    }
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fake-workload: {e}");
            ExitCode::FAILURE
        }
    }
}

/// One raw driver call through gpusnap's own binding, bypassing gpusnap's checks.
fn raw_call(action: &str, pid: &str) -> ExitCode {
    use gpusnap_cuda::{CheckpointApi, CudaDriver};
    let Ok(pid) = pid.parse::<i32>() else {
        eprintln!("fake-workload: bad pid {pid}");
        return ExitCode::from(2);
    };
    let d = match CudaDriver::load() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("fake-workload: {e}");
            return ExitCode::FAILURE;
        }
    };
    let r = match action {
        "lock" => d.lock(pid, 0).map(|_| String::new()),
        "checkpoint" => d.checkpoint(pid).map(|_| String::new()),
        "restore" => d.restore(pid, &[]).map(|_| String::new()),
        "unlock" => d.unlock(pid).map(|_| String::new()),
        "state" => d.get_state(pid).map(|s| format!(" state={s}")),
        other => {
            eprintln!("fake-workload: unknown action {other}");
            return ExitCode::from(2);
        }
    };
    match r {
        Ok(extra) => println!("rc=0{extra}"),
        Err(e) => println!("rc={} {e}", e.code().unwrap_or(-1)),
    }
    ExitCode::SUCCESS
}
