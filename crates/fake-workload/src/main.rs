//! `fake-workload`: a "CUDA program" for the fake driver, the stand-in for
//! `tests/gpu/worker.py` (a PyTorch worker). It holds device memory, writes a known pattern
//! into it, and keeps reading it back and checking it, so that a test can see
//! whether a suspend/resume kept its data and whether it ran meanwhile.
//!
//! It dlopens `libcuda.so.1` like any CUDA program, so `LD_LIBRARY_PATH`
//! decides which driver it gets, and uses only the fake's workload API.

mod loops;
mod openai;
mod server;
mod shm;
mod status;
mod vmm;

use status::{unix_time, write_status};

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::thread::sleep;
use std::time::Duration;

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
    /// from a second thread), `_exit:N`, `segv`, `abort`, or `fault[:RC]`
    /// (its context takes sticky error RC, default 700, and the program
    /// exits 1 reporting it, as a program after an illegal-address kernel).
    /// The same fault happens when `--status FILE`'s `FILE.fault` appears.
    #[arg(long)]
    die: Option<String>,
    #[arg(long, default_value_t = 500)]
    after_ms: u64,
    /// Die by SIGSEGV as soon as CRIU has restored the process (its start
    /// time changes), before any driver restore: as a CUDA thread that runs
    /// on memory the real driver maps back only in its restore.
    #[arg(long)]
    segv_after_restore: bool,
    /// Handle SIGTERM: exit(N) from the main loop when it arrives.
    #[arg(long)]
    sigterm_exit: Option<i32>,
    /// Start a child process (the same program, status FILE.child) that holds
    /// CUDA state of its own.
    #[arg(long)]
    child: bool,
    /// Be a fake model server: answer HTTP/1.1 on 127.0.0.1:PORT (keep-alive)
    /// after touching the device memory, so that a suspended server holds
    /// its requests as a real one does. `GET /` answers
    /// `ok <pid> <request> <1 if intact else 0>`; `GET /stream?chunks=N&ms=M`
    /// streams N chunked lines, one every M ms, each after a touch;
    /// `GET /generate?...` answers a hash of its query (the same every time).
    #[arg(long, value_name = "PORT")]
    http: Option<u16>,
    /// With --http: the address it listens on (a server in a network
    /// namespace of its own listens on its interface's address).
    #[arg(long, default_value = "127.0.0.1")]
    http_host: std::net::IpAddr,
    /// With --http: also hold a "KV cache" of N MiB, which `POST /sleep`
    /// frees and `POST /wake_up` allocates again (vLLM's sleep level 1,
    /// weights kept); asleep, `/` and `/generate` answer 503. Both take
    /// `fail=1` (answer 500, do nothing) and `delay_ms=N` (answer late).
    #[arg(long, default_value_t = 0)]
    kv_mib: u64,
    /// Start a thread every N µs that ends at once (0: none): threads come
    /// and go while a tracer attaches.
    #[arg(long, default_value_t = 0)]
    churn_us: u64,
    /// Keep a host copy of N MiB (anonymous memory, registered with the fake
    /// driver: its checkpoints write a known pattern there and its restores
    /// read it back, as the real driver's do) and an idle thread named
    /// `cuda-restore`, registered as the driver's restore thread.
    #[arg(long, default_value_t = 0)]
    host_copy_mib: u64,
    /// Hold a /dev/shm file mapped shared under a name since removed while
    /// another name still links it, as glibc's `sem_open` leaves a named
    /// POSIX semaphore (created as `sem.XXXXXX`, linked to `sem.NAME`, the
    /// first name unlinked; vLLM's and SGLang's Python hold such): what
    /// CRIU can dump only with `link-remap`, as a `link_remap.N` link in
    /// that /dev/shm.
    #[arg(long)]
    shm_semaphore: bool,
    /// Also hold N MiB of managed memory (`cuMemAllocManaged`), which
    /// gpusnap's fast swap leaves with the driver.
    #[arg(long, default_value_t = 0)]
    managed_mib: u64,
    /// Ask for a CUDA IPC handle of the first allocation
    /// (`cuIpcGetMemHandle`, as a server sharing memory with another
    /// process does) and print `ipc rc=N` on stderr; it runs on either way.
    #[arg(long)]
    ipc: bool,
    /// Make N more allocations of --mib each, written and checked like the
    /// first.
    #[arg(long, default_value_t = 0)]
    extra_allocs: u32,
    /// Reach the allocation and copy calls through `cuGetProcAddress_v2`
    /// (itself asked of `cuGetProcAddress`), as the CUDA runtime does.
    #[arg(long)]
    proc_address: bool,
    /// With --http: `GET /` answers `ok <pid> <request> <intact> <TAG>`, so
    /// that a client can tell which server answered (the soak's check).
    #[arg(long)]
    tag: Option<String>,
    /// With --http: the model it serves for OpenAI's API (default: --tag,
    /// else `fake-model`). `POST /v1/chat/completions` and
    /// `/v1/completions` answer as an OpenAI-compatible server does, their
    /// text `ok <pid> <request> <intact> [TAG]` (streamed with
    /// `"stream": true`, one server-sent event per word, each after a
    /// touch); `GET /v1/models` lists the model.
    #[arg(long)]
    model: Option<String>,
    /// Keep threads inside the driver: kernels of MS ms, synchronizes and
    /// checked blocking reads in loops (see loops.rs).
    #[arg(long, value_name = "MS")]
    sync_loop: Option<u32>,
    /// Also map two allocations of N MiB through the VMM API itself,
    /// written and checked like the first (see vmm.rs).
    #[arg(long, default_value_t = 0)]
    vmm_mib: u64,
    /// Also hold N MiB from the driver's stream-ordered pool (`cuMemAllocAsync`).
    #[arg(long, default_value_t = 0)]
    async_mib: u64,
}

static SIGTERMED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn on_sigterm(_: c_int) {
    SIGTERMED.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// This process's start time (field 22 of /proc/self/stat): a process
/// CRIU restored has a new one.
fn own_start_time() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let after = &stat[stat.rfind(')')? + 2..];
    after.split_whitespace().nth(19)?.parse().ok()
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
pub(crate) struct Cuda {
    init: unsafe extern "C" fn(c_uint) -> CUresult,
    device_get: unsafe extern "C" fn(*mut c_int, c_int) -> CUresult,
    ctx_create: unsafe extern "C" fn(*mut *mut c_void, c_uint, c_int) -> CUresult,
    mem_alloc: unsafe extern "C" fn(*mut u64, usize) -> CUresult,
    mem_free: unsafe extern "C" fn(u64) -> CUresult,
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
            mem_free: sym!("cuMemFree_v2"),
            memcpy_htod: sym!("cuMemcpyHtoD_v2"),
            memcpy_dtoh: sym!("cuMemcpyDtoH_v2"),
            enqueue_work: sym!("fakeEnqueueWork"),
            error_name: sym!("cuGetErrorName"),
            _lib: lib,
        })
    }

    /// Replaces the allocation and copy calls with what the driver's
    /// `cuGetProcAddress_v2` hands out for them (CUDA 12.0's names).
    fn through_proc_address(&mut self) -> Result<(), String> {
        type V1 = unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64) -> CUresult;
        type V2 = unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> CUresult;
        // SAFETY: the symbol has this C signature in cuda.h.
        let v1: V1 = *unsafe { self._lib.get(b"cuGetProcAddress\0") }.map_err(|e| e.to_string())?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: a NUL-terminated name and an out-pointer to a local.
        self.check("cuGetProcAddress", unsafe { v1(c"cuGetProcAddress".as_ptr(), &mut p, 12000, 0) })?;
        // SAFETY: what the driver handed out for version 12000 is cuGetProcAddress_v2.
        let v2: V2 = unsafe { std::mem::transmute::<*mut c_void, V2>(p) };
        let get = |name: &CStr| -> Result<*mut c_void, String> {
            let mut f: *mut c_void = std::ptr::null_mut();
            let mut status: c_int = 0;
            // SAFETY: a NUL-terminated name and out-pointers to locals.
            let rc = unsafe { v2(name.as_ptr(), &mut f, 12000, 0, &mut status) };
            self.check("cuGetProcAddress_v2", rc).map(|()| f)
        };
        let (alloc, free, htod, dtoh) =
            (get(c"cuMemAlloc")?, get(c"cuMemFree")?, get(c"cuMemcpyHtoD")?, get(c"cuMemcpyDtoH")?);
        // SAFETY: the driver's functions for those names, with cuda.h's
        // signatures of their _v2 forms (version 12000).
        unsafe {
            self.mem_alloc =
                std::mem::transmute::<*mut c_void, unsafe extern "C" fn(*mut u64, usize) -> CUresult>(alloc);
            self.mem_free = std::mem::transmute::<*mut c_void, unsafe extern "C" fn(u64) -> CUresult>(free);
            self.memcpy_htod = std::mem::transmute::<
                *mut c_void,
                unsafe extern "C" fn(u64, *const c_void, usize) -> CUresult,
            >(htod);
            self.memcpy_dtoh = std::mem::transmute::<
                *mut c_void,
                unsafe extern "C" fn(*mut c_void, u64, usize) -> CUresult,
            >(dtoh);
        }
        Ok(())
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

fn run(args: &Args) -> Result<(), String> {
    let data_len = usize::try_from(args.data_kib * 1024).map_err(|e| e.to_string())?;
    let bytes = args.mib * 1024 * 1024;
    if data_len as u64 > bytes {
        return Err(format!("--data-kib {} does not fit in --mib {}", args.data_kib, args.mib));
    }
    let mut cuda = Cuda::load()?;
    if args.proc_address {
        cuda.through_proc_address()?;
    }
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
    let mut extra = Vec::new();
    for _ in 0..args.extra_allocs {
        let mut p: u64 = 0;
        // SAFETY: as above.
        unsafe {
            cuda.check("cuMemAlloc_v2", (cuda.mem_alloc)(&mut p, bytes as usize))?;
            cuda.check("cuMemcpyHtoD_v2", (cuda.memcpy_htod)(p, data.as_ptr().cast(), data_len))?;
        }
        extra.push(p);
    }
    if args.vmm_mib > 0 {
        extra.extend(vmm::alloc(&cuda, args.vmm_mib, device, &data)?);
    }
    if args.async_mib > 0 {
        vmm::alloc_async(&cuda, args.async_mib)?;
    }
    if args.managed_mib > 0 {
        type Managed = unsafe extern "C" fn(*mut u64, usize, c_uint) -> CUresult;
        // SAFETY: the symbol has this C signature in cuda.h.
        let managed: Managed =
            *unsafe { cuda._lib.get(b"cuMemAllocManaged\0") }.map_err(|e| e.to_string())?;
        let mut p: u64 = 0;
        // SAFETY: an out-pointer to a local; 1 = CU_MEM_ATTACH_GLOBAL.
        cuda.check("cuMemAllocManaged", unsafe { managed(&mut p, (args.managed_mib << 20) as usize, 1) })?;
    }
    if args.ipc && ptr != 0 {
        type Ipc = unsafe extern "C" fn(*mut [u8; 64], u64) -> CUresult;
        // SAFETY: the symbol has this C signature in cuda.h.
        let ipc: Ipc = *unsafe { cuda._lib.get(b"cuIpcGetMemHandle\0") }.map_err(|e| e.to_string())?;
        let mut h = [0u8; 64];
        // SAFETY: an out-pointer to 64 bytes of a local.
        let rc = unsafe { ipc(&mut h, ptr) };
        eprintln!("ipc rc={rc}");
    }

    if args.host_copy_mib > 0 {
        host_copy(&cuda, args.host_copy_mib)?;
    }
    if let Some(ms) = args.sync_loop.filter(|_| ptr != 0 && !data.is_empty()) {
        loops::start(&cuda, ms, ptr, data.clone())?;
    }
    if args.shm_semaphore {
        shm::semaphore()?;
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
    if let Some(port) = args.http {
        let gpu = server::Gpu {
            cuda,
            ptr,
            data,
            served: std::sync::atomic::AtomicU64::new(0),
            kv_bytes: args.kv_mib * 1024 * 1024,
            kv: std::sync::Mutex::new(None),
            tag: args.tag.clone(),
            model: args.model.clone().or_else(|| args.tag.clone()).unwrap_or_else(|| "fake-model".into()),
        };
        gpu.wake_up()?;
        return server::serve_http(std::sync::Arc::new(gpu), (args.http_host, port), args.print_ready);
    }
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
    if args.segv_after_restore {
        // No core to write: the death is at once.
        let _ = nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_CORE, 0, 0);
        let start = own_start_time();
        std::thread::spawn(move || loop {
            sleep(Duration::from_millis(1));
            if own_start_time().is_some_and(|now| Some(now) != start) {
                die("segv");
            }
        });
    }
    let started = std::time::Instant::now();
    let exit_file = args.status.as_ref().map(|s| {
        let mut p = s.as_os_str().to_owned();
        p.push(".exit");
        PathBuf::from(p)
    });
    let fault_file = args.status.as_ref().map(|s| {
        let mut p = s.as_os_str().to_owned();
        p.push(".fault");
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
        let mut intact = back == data && !loops::BAD.load(std::sync::atomic::Ordering::SeqCst);
        for p in &extra {
            // SAFETY: `back` is `data_len` long.
            let rc = unsafe { (cuda.memcpy_dtoh)(back.as_mut_ptr().cast(), *p, data_len) };
            cuda.check("cuMemcpyDtoH_v2", rc)?;
            intact &= back == data;
        }
        if let Some(status) = &args.status {
            let line = format!("{pid} {iteration} {} {:.3}\n", u8::from(intact), unix_time());
            write_status(status, &line).map_err(|e| format!("{}: {e}", status.display()))?;
        }
        if exit_file.as_ref().is_some_and(|f| f.exists()) {
            std::process::exit(3);
        }
        if fault_file.as_ref().is_some_and(|f| f.exists()) {
            fault(&cuda, 0)?;
        }
        if let (Some(code), true) = (args.sigterm_exit, SIGTERMED.load(std::sync::atomic::Ordering::SeqCst)) {
            std::process::exit(code);
        }
        if let Some(how) = &args.die {
            if started.elapsed() >= Duration::from_millis(args.after_ms) {
                if let Some(k) = kid.as_mut() {
                    let _ = k.wait();
                }
                if let Some(rc) = how.strip_prefix("fault") {
                    let rc =
                        rc.strip_prefix(':').map_or(Ok(0), str::parse).map_err(|_| format!("--die {how}"))?;
                    fault(&cuda, rc)?;
                }
                die(how);
            }
        }
        sleep(Duration::from_millis(100));
    }
    Ok(())
}

/// An illegal-address kernel: the context takes sticky error `rc` (0: 700)
/// through the fake's `fakeFault`, and the call that reports it fails the
/// program (exit 1, as an uncaught CUDA error in Python does).
pub(crate) fn fault(cuda: &Cuda, rc: c_int) -> Result<(), String> {
    type Fault = unsafe extern "C" fn(c_int) -> CUresult;
    // SAFETY: the fake driver's extra export, with this C signature.
    let f: Fault = *unsafe { cuda._lib.get(b"fakeFault\0") }.map_err(|e| e.to_string())?;
    // SAFETY: no pointers.
    if let Err(e) = cuda.check("cuCtxSynchronize", unsafe { f(rc) }) {
        // Exits here, with libcuda still loaded, as a program whose CUDA
        // error ends it does (returning would unload it first).
        eprintln!("fake-workload: {e}");
        std::process::exit(1);
    }
    Ok(())
}

/// Maps `mib` MiB of anonymous memory (left untouched: the fake's checkpoint
/// writes it) and registers it as the host copy, then starts the
/// `cuda-restore` thread and waits until it is registered.
fn host_copy(cuda: &Cuda, mib: u64) -> Result<(), String> {
    type Register = unsafe extern "C" fn(u64, u64) -> CUresult;
    type RegisterThread = unsafe extern "C" fn() -> CUresult;
    // SAFETY: the fake driver's extra exports, with these C signatures.
    let register: Register =
        *unsafe { cuda._lib.get(b"fakeRegisterHostCopy\0") }.map_err(|e| e.to_string())?;
    // SAFETY: as above.
    let register_thread: RegisterThread =
        *unsafe { cuda._lib.get(b"fakeRegisterRestoreThread\0") }.map_err(|e| e.to_string())?;
    let len = usize::try_from(mib * 1024 * 1024).map_err(|e| e.to_string())?;
    // A page of PROT_NONE on either side keeps the host copy a mapping of
    // its own: the kernel would otherwise merge it with a neighbour of the
    // same protection (the stack of the thread started below lands right
    // under it), and CRIU dumps the pages at a thread's stack pointer
    // eagerly, so the merged VMA would not be all lazy (a map file would
    // then leave it out: crates/images/src/mapfile.rs).
    let page = 4096;
    // SAFETY: a fresh private anonymous reservation; nothing in this
    // program reads or writes it (its middle is the driver's), and it is
    // never unmapped.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len + 2 * page,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return Err(format!("mmap of the host copy: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: the middle of our own reservation, page-aligned.
    let addr = unsafe { base.cast::<u8>().add(page).cast::<libc::c_void>() };
    // SAFETY: `addr..addr + len` lies inside the reservation above.
    if unsafe { libc::mprotect(addr, len, libc::PROT_READ | libc::PROT_WRITE) } != 0 {
        return Err(format!("mprotect of the host copy: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: no pointers are dereferenced; the fake records the range.
    cuda.check("fakeRegisterHostCopy", unsafe { register(addr as u64, len as u64) })?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("cuda-restore".into())
        .spawn(move || {
            // SAFETY: no arguments.
            let _ = tx.send(unsafe { register_thread() });
            loop {
                sleep(Duration::from_millis(100));
            }
        })
        .map_err(|e| e.to_string())?;
    let rc = rx.recv().map_err(|e| e.to_string())?;
    cuda.check("fakeRegisterRestoreThread", rc)
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
    let d = match CudaDriver::load_ready() {
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
