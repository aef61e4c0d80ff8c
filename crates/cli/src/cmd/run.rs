//! `gpusnap run` and `gpusnap guard`: the guard's front end.

use crate::cli::Cli;
use gpusnap_core::Error as CoreError;
use gpusnap_core::Store;
use gpusnap_cuda::{Absent, CheckpointApi, CudaDriver, Deadline, OrAbsent, Timeouts};
use gpusnap_gpu::{Deferred, GpuInventory, NoGpus, NvmlInventory};
use gpusnap_guard::light::{self, LightGuard};
use gpusnap_guard::{self as guard, Ending, Guard, OnFault};
use std::ffi::OsString;
use std::path::Path;

type DynGuard = Guard<Box<dyn CheckpointApi>, Box<dyn GpuInventory>>;

/// What `run` asks of its guard.
pub struct Opts {
    pub lock_timeout: u32,
    pub oom_watch: bool,
    pub on_fault: OnFault,
}

/// `run`'s exit code when a guarded process's CUDA context faulted
/// (docs/reference/exit-codes.md).
const FAULTED_EXIT: i32 = 7;

/// The driver and NVML. A host without a driver still runs programs under
/// the guard (nothing to suspend, but exits and signals pass through).
fn driver_and_gpus() -> (Deadline<Box<dyn CheckpointApi>>, Box<dyn GpuInventory>) {
    // The driver's start-up runs in the background (see OrAbsent).
    let api: Box<dyn CheckpointApi> = match CudaDriver::load() {
        Ok(d) => Box::new(OrAbsent::new(d)),
        Err(e) => Box::new(Absent { why: e.to_string() }),
    };
    // NVML too: the guard's attach, which `gpusnap wake` waits for, needs
    // neither (docs/benchmarks.md, "what the wake waits for").
    let gpus: Box<dyn GpuInventory> = Box::new(Deferred::start(|| match NvmlInventory::load() {
        Ok(n) => Box::new(n),
        Err(_) => Box::new(NoGpus),
    }));
    (Deadline::new(api, Timeouts::default()), gpus)
}

fn new_guard(cli: &Cli, lock_timeout: u32, name: Option<String>) -> anyhow::Result<DynGuard> {
    let store = Store::open(&cli.state_dir)?;
    let (api, gpus) = driver_and_gpus();
    Ok(Guard::new(api, gpus, store, &cli.state_dir, lock_timeout, name))
}

fn new_light_guard(
    cli: &Cli,
    lock_timeout: u32,
    on_fault: OnFault,
) -> LightGuard<Box<dyn CheckpointApi>, Box<dyn GpuInventory>> {
    let (api, gpus) = driver_and_gpus();
    LightGuard::new(api, gpus, &cli.state_dir, lock_timeout).with_on_fault(on_fault)
}

/// The user and group `run --light --user/--group` gives the program.
#[derive(Debug, Default, Clone, Copy)]
pub struct RunAs {
    pub uid: Option<u32>,
    pub gid: Option<u32>,
}

impl RunAs {
    /// Names or numbers; a user's primary group when no group is given.
    pub fn resolve(user: Option<&str>, group: Option<&str>) -> anyhow::Result<Self> {
        use nix::unistd::{Group, User};
        let bad = |what: &str, n: &str| {
            gpusnap_agent::AgentError::Config(gpusnap_agent::config::ConfigError::Read {
                path: format!("--{what}"),
                reason: format!("no {what} {n:?} on this host"),
            })
        };
        let (uid, primary) = match user {
            None => (None, None),
            Some(u) => match u.parse::<u32>() {
                Ok(n) => (Some(n), User::from_uid(n.into()).ok().flatten().map(|u| u.gid.as_raw())),
                Err(_) => {
                    let pw = User::from_name(u).ok().flatten().ok_or_else(|| bad("user", u))?;
                    (Some(pw.uid.as_raw()), Some(pw.gid.as_raw()))
                }
            },
        };
        let gid = match group {
            None => primary,
            Some(g) => Some(match g.parse::<u32>() {
                Ok(n) => n,
                Err(_) => Group::from_name(g).ok().flatten().ok_or_else(|| bad("group", g))?.gid.as_raw(),
            }),
        };
        Ok(Self { uid, gid })
    }
}

/// What `run --light` was asked for besides the program.
pub struct LightOptions<'a> {
    pub preload: Option<&'a Path>,
    /// `--fast-swap`: the library serves allocations from the VMM API.
    pub fast_swap: bool,
    /// `--keep-pinned`: the pinned copies stay after each resume.
    pub keep_pinned: bool,
}

/// `gpusnap run --light`: the program carries the preload library and asks
/// this process, over a unix socket, to suspend it before it dies.
pub fn run_light(
    cli: &Cli,
    name: Option<String>,
    opts: &Opts,
    light_opts: &LightOptions<'_>,
    who: RunAs,
    cmd: &[OsString],
) -> anyhow::Result<()> {
    let (lock_timeout, oom_watch) = (opts.lock_timeout, opts.oom_watch);
    let mut store = Store::open(&cli.state_dir)?;
    let lib = light::find_library(light_opts.preload)?;
    let me = std::process::id();
    let socket = light::socket_for(&cli.state_dir, me);
    let lg = new_light_guard(cli, lock_timeout, opts.on_fault);
    let ino = lg.serve(&socket)?;
    let mut preload_env = lib.into_os_string();
    if let Some(more) = std::env::var_os("LD_PRELOAD").filter(|p| !p.is_empty()) {
        preload_env.push(":");
        preload_env.push(more);
    }
    // The program's orphans (a child that outlives the leader) become ours,
    // so `run` sees them end and serves the socket until the last of them
    // has, as the traced guard does with every process it traces.
    // SAFETY: prctl with integer arguments only.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    let mut command = std::process::Command::new(&cmd[0]);
    command.args(&cmd[1..]).env("LD_PRELOAD", preload_env).env(light::SOCKET_ENV, &socket);
    // Group first, then user (std sets them so, and drops the supplementary
    // groups when it changes the user).
    use std::os::unix::process::CommandExt;
    if let Some(g) = who.gid {
        command.gid(g);
    }
    if let Some(u) = who.uid {
        command.uid(u);
    }
    if light_opts.fast_swap {
        command.env(gpusnap_core::swap::FAST_SWAP_ENV, "1");
        if light_opts.keep_pinned {
            command.env(gpusnap_core::swap::KEEP_PINNED_ENV, "1");
        }
    }
    // The same session rule as the traced `run` (see guard::launch).
    gpusnap_core::target::own_session_where_needed(&mut command);
    let mut child = match command.spawn() {
        Ok(c) => c,
        Err(e) => {
            let _ = std::fs::remove_file(&socket);
            eprintln!("gpusnap run: {}: {e}", cmd[0].to_string_lossy());
            std::process::exit(if e.kind() == std::io::ErrorKind::NotFound { 127 } else { 126 });
        }
    };
    let leader = child.id() as i32;
    if oom_watch {
        lg.watch_memory(leader)?;
    }
    // LD_PRELOAD does not reach a statically linked or setuid program, nor
    // one a wrapper started with a clean environment: say so, once it has
    // had time to start, rather than guard nothing in silence.
    std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_secs(2));
        let maps = std::fs::read_to_string(format!("/proc/{leader}/maps"));
        if let Ok(maps) = maps {
            if !maps.contains(light::LIBRARY) {
                tracing::warn!(
                    pid = leader,
                    "{} is not loaded in the program (statically linked? setuid? started with a clean \
                     environment?): its deaths are not guarded; run it without --light",
                    light::LIBRARY
                );
            }
        }
    });
    if let Ok(t) = gpusnap_core::target::resolve(leader) {
        store.note(&t, "guard", None, &format!("guarded by gpusnap {me} (light)"))?;
    }
    let record = guard::guards_dir(&cli.state_dir).join(format!("{me}.json"));
    let file = guard::GuardFile {
        guard_pid: me as i32,
        name,
        leader,
        processes: vec![leader],
        socket: socket.clone(),
    };
    file.save(&record)?;
    forward_signals(leader, &cli.state_dir, lock_timeout);
    // Every child is reaped as it ends, not only the program: as a
    // container's PID 1 (or a subreaper) `run` is handed the program's
    // orphans, which would otherwise stay zombies while the program runs.
    let status = loop {
        let mut st = 0;
        // SAFETY: waitpid writes one int.
        let r = unsafe { libc::waitpid(-1, &mut st, 0) };
        if r == leader {
            use std::os::unix::process::ExitStatusExt;
            break std::process::ExitStatus::from_raw(st);
        }
        if r < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            break child.wait()?;
        }
    };
    // The rest of the tree: children still running, and orphans handed to
    // us as they are orphaned.
    loop {
        let mut st = 0;
        // SAFETY: waitpid writes one int.
        let r = unsafe { libc::waitpid(-1, &mut st, 0) };
        if r < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            break;
        }
    }
    // A request accepted or waiting (an answer that came late, to a
    // process that is gone) is journaled before `run` ends.
    lg.quiesce(std::time::Duration::from_secs(30));
    let _ = std::fs::remove_file(&record);
    light::unbind(&cli.state_dir, &socket, ino);
    use std::os::unix::process::ExitStatusExt;
    // Hibernate asked to let go and then ended the tree (SIGKILL, by CRIU):
    // that is no death of the program's. A tree left running (snapshot)
    // stays guarded here, and its real ending is reported.
    let ending =
        if lg.detached.load(std::sync::atomic::Ordering::SeqCst) && status.signal() == Some(libc::SIGKILL) {
            Ending::Detached
        } else if let Some(sig) = status.signal() {
            Ending::Signaled(sig)
        } else {
            Ending::Exited(status.code().unwrap_or(1))
        };
    finish(ending, lg.faulted.load(std::sync::atomic::Ordering::SeqCst))
}

fn keeper_argv(cli: &Cli, lock_timeout: u32, on_fault: OnFault) -> Vec<OsString> {
    vec![
        "gpusnap-keeper".into(),
        "--state-dir".into(),
        cli.state_dir.clone().into_os_string(),
        "guard".into(),
        "--lock-timeout".into(),
        lock_timeout.to_string().into(),
        "--on-fault".into(),
        on_fault.as_str().into(),
        "--takeover".into(),
        std::process::id().to_string().into(),
    ]
}

pub fn run(
    cli: &Cli,
    name: Option<String>,
    opts: &Opts,
    keeper: bool,
    cmd: &[OsString],
) -> anyhow::Result<()> {
    // The store first (a failure leaves nothing behind), then the forks,
    // while this process has a single thread, then the driver.
    drop(Store::open(&cli.state_dir)?);
    let launched = guard::launch(cmd)?;
    if keeper {
        guard::start_keeper(&keeper_argv(cli, opts.lock_timeout, opts.on_fault))?;
    }
    let mut g =
        new_guard(cli, opts.lock_timeout, name)?.with_oom_watch(opts.oom_watch).with_on_fault(opts.on_fault);
    g.attach(launched.pid)?;
    let leader = launched.pid;
    launched.release();
    forward_signals(leader, &cli.state_dir, opts.lock_timeout);
    let ending = g.run_loop()?;
    finish(ending, g.faulted())
}

/// Signals sent to `gpusnap run` by other processes go on to the program, as
/// from an init such as tini. Signals from the terminal (Ctrl-C) already
/// reach the program directly: its process group is the same.
///
/// As a container's PID 1, a SIGTERM (the runtime's stop) to a program that
/// ignores it ends only with the runtime's SIGKILL once its stop timeout
/// has passed, which nothing can intercept: the program is suspended at
/// once, while it still can be.
fn forward_signals(leader: i32, state_dir: &Path, lock_timeout: u32) {
    use signal_hook::consts::*;
    use signal_hook::iterator::exfiltrator::WithOrigin;
    use signal_hook::iterator::SignalsInfo;
    let Ok(mut signals) =
        SignalsInfo::<WithOrigin>::new([SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2])
    else {
        tracing::warn!("cannot forward signals to the program");
        return;
    };
    let state_dir = state_dir.to_path_buf();
    std::thread::spawn(move || {
        for info in signals.forever() {
            if info.process.is_some_and(|p| p.pid != leader) {
                // SAFETY: kill with a valid signal number.
                unsafe { libc::kill(leader, info.signal) };
                if info.signal == SIGTERM && std::process::id() == 1 && ignores(leader, SIGTERM) {
                    suspend_before_kill(leader, &state_dir, lock_timeout);
                }
            }
        }
    });
}

/// Whether process `pid` ignores signal `sig` (`SigIgn` in its status).
fn ignores(pid: i32, sig: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("SigIgn:").map(|m| m.trim().to_string())))
        .and_then(|m| u64::from_str_radix(&m, 16).ok())
        .is_some_and(|mask| mask & (1 << (sig - 1)) != 0)
}

/// Suspends the program a SIGKILL will end (see [`forward_signals`]).
fn suspend_before_kill(pid: i32, state_dir: &Path, lock_timeout: u32) {
    let done = crate::setup::engine_at(state_dir).and_then(|mut e| Ok(e.suspend(pid, lock_timeout)?));
    match done {
        Ok(_) => {
            if let (Ok(mut store), Ok(t)) = (Store::open(state_dir), gpusnap_core::target::resolve(pid)) {
                let _ = store.note(
                    &t,
                    "guard",
                    None,
                    "suspended: it ignores the SIGTERM of the container's stop, whose SIGKILL follows",
                );
            }
        }
        Err(e) => eprintln!("gpusnap run: could not suspend {pid} before the container's SIGKILL: {e:#}"),
    }
}

/// Ends `gpusnap run` the way the program ended; 7 when a guarded
/// process's CUDA context faulted (its own ending is in the journal).
fn finish(ending: Ending, faulted: bool) -> anyhow::Result<()> {
    if faulted {
        let how = match ending {
            Ending::Exited(code) => format!("exit code {code}"),
            Ending::Signaled(sig) => guard::signal_name(sig),
            Ending::Detached => "a detach".into(),
        };
        eprintln!(
            "gpusnap run: a guarded process's CUDA context faulted, so it could not be suspended \
             (gpusnap history PID has the details); the program ended with {how}"
        );
        std::process::exit(FAULTED_EXIT)
    }
    match ending {
        Ending::Exited(code) => std::process::exit(code),
        Ending::Signaled(sig) => {
            // No core file of gpusnap's own for the program's SIGSEGV.
            let _ = nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_CORE, 0, 0);
            // A container's PID 1 cannot die of a signal it sends itself
            // (the kernel drops it); it exits 128 + the signal, as runtimes
            // report a signal death.
            if std::process::id() != 1 {
                let _ = signal_hook::low_level::emulate_default_handler(sig);
            }
            std::process::exit(128 + sig)
        }
        Ending::Detached => {
            eprintln!("gpusnap run: the program was detached from the guard (hibernated)");
            std::process::exit(0)
        }
    }
}

pub fn guard(
    cli: &Cli,
    pids: &[i32],
    lock_timeout: u32,
    on_fault: OnFault,
    takeover: Option<i32>,
    daemon: bool,
) -> anyhow::Result<()> {
    let mut pids = pids.to_vec();
    if let Some(old) = takeover {
        let file = guard::guards_dir(&cli.state_dir).join(format!("{old}.json"));
        // The old guard finished cleanly: nothing to take over.
        let Ok(body) = std::fs::read(&file) else { return Ok(()) };
        let _ = std::fs::remove_file(&file);
        let g: guard::GuardFile = serde_json::from_slice(&body)?;
        pids.extend(g.processes.iter().filter(|p| gpusnap_core::target::resolve(**p).is_ok()));
        if pids.is_empty() {
            return Ok(());
        }
    }
    if pids.is_empty() {
        return Err(CoreError::BadPid { pid: 0 }.into());
    }
    // The state directory, created and checked, holds the guards' sockets.
    drop(Store::open(&cli.state_dir)?);
    // Check every pid before detaching from the terminal, so bad input is
    // reported to the caller; and the socket a light program names, its to
    // set: only a light guard's socket of this state directory is served.
    for &p in &pids {
        gpusnap_core::target::resolve(p)?;
        if let Some(s) = light::socket_of(p) {
            light::check_socket(&cli.state_dir, &s).map_err(|e| match e {
                CoreError::Proc { reason, .. } => anyhow::anyhow!("process {p}: {reason}"),
                e => e.into(),
            })?;
        }
    }
    if daemon {
        daemonize(cli)?;
    }
    // Processes started by `run --light` carry the preload library: their
    // guard serves the socket they were started with, and traces nothing.
    let mut traced = Vec::new();
    let mut sockets = std::collections::BTreeSet::new();
    let mut light_targets: Vec<gpusnap_core::target::Target> = Vec::new();
    for &p in &pids {
        match light::socket_of(p) {
            Some(s) => {
                sockets.insert(s);
                light_targets.extend(gpusnap_core::target::resolve(p).ok());
            }
            None => traced.push(p),
        }
    }
    if !sockets.is_empty() {
        let lg = new_light_guard(cli, lock_timeout, on_fault);
        for s in &sockets {
            lg.serve(s)?;
        }
        let mut store = Store::open(&cli.state_dir)?;
        for t in &light_targets {
            store.note(t, "guard", None, &format!("guarded by gpusnap {} (light)", std::process::id()))?;
        }
        // The sockets stay served by threads of this process.
    }
    if traced.is_empty() {
        if daemon {
            report_ready(true);
        }
    } else {
        trace(cli, lock_timeout, on_fault, &traced, daemon)?;
    }
    // No tracee left to wait for: watch the light processes themselves.
    while light_targets.iter().any(gpusnap_core::target::is_alive) {
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    Ok(())
}

/// The traced guard of `traced` and their children, until none is left.
fn trace(
    cli: &Cli,
    lock_timeout: u32,
    on_fault: OnFault,
    traced: &[i32],
    daemon: bool,
) -> anyhow::Result<()> {
    guard::start_keeper(&keeper_argv(cli, lock_timeout, on_fault))?;
    let mut g = new_guard(cli, lock_timeout, None)?.with_on_fault(on_fault);
    for &p in traced {
        g.attach(p)?;
        // Children may come and go while they are attached: one that is gone
        // by then needs no guard. Children of a light program are light.
        for (q, _) in gpusnap_core::tree::process_tree(p).into_iter().skip(1) {
            if light::socket_of(q).is_some() {
                continue;
            }
            match g.attach(q) {
                Ok(()) | Err(CoreError::NoProcess { .. } | CoreError::Zombie { .. }) => {}
                Err(CoreError::Proc { .. }) if gpusnap_core::target::resolve(q).is_err() => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
    if daemon {
        report_ready(true);
    }
    g.run_loop()?;
    Ok(())
}

static READY_FD: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);

/// Forks into the background; the foreground process waits until the
/// background one says it has attached, and exits 0 (or 1 if it failed).
fn daemonize(cli: &Cli) -> anyhow::Result<()> {
    let mut fds = [0; 2];
    // SAFETY: pipe fills two fds.
    if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
        anyhow::bail!("pipe: {}", std::io::Error::last_os_error());
    }
    // SAFETY: fork while single-threaded (nothing has started threads yet).
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        anyhow::bail!("fork: {}", std::io::Error::last_os_error());
    }
    if pid > 0 {
        let mut b = [0u8; 1];
        // SAFETY: closing our copy of the write end; reading one byte.
        let n = unsafe {
            libc::close(fds[1]);
            libc::read(fds[0], b.as_mut_ptr().cast(), 1)
        };
        std::process::exit(if n == 1 && b[0] == b'y' { 0 } else { 1 });
    }
    // SAFETY: the child: new session, stdio to a log file.
    unsafe {
        libc::close(fds[0]);
        libc::setsid();
    }
    READY_FD.store(fds[1], std::sync::atomic::Ordering::SeqCst);
    let dir = guard::guards_dir(&cli.state_dir);
    std::fs::create_dir_all(&dir)?;
    let log = std::fs::OpenOptions::new().create(true).append(true).open(dir.join("guard.log"))?;
    use std::os::fd::AsRawFd;
    // SAFETY: dup2 onto stdio of fds we own.
    unsafe {
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY);
        libc::dup2(null, 0);
        libc::dup2(log.as_raw_fd(), 1);
        libc::dup2(log.as_raw_fd(), 2);
    }
    Ok(())
}

fn report_ready(ok: bool) {
    let fd = READY_FD.swap(-1, std::sync::atomic::Ordering::SeqCst);
    if fd >= 0 {
        let b = if ok { b"y" } else { b"n" };
        // SAFETY: writing one byte to our pipe, then closing it.
        unsafe {
            libc::write(fd, b.as_ptr().cast(), 1);
            libc::close(fd);
        }
    }
}
