//! The fake driver's behaviour in safe Rust; `lib.rs` only turns C arguments
//! into these calls and results back into C.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::thread::sleep;
use std::time::{Duration, Instant};

use gpusnap_fake_common::codes::*;
use gpusnap_fake_common::state::{GpuPair, HostCopy, LockWait, Proc};
use gpusnap_fake_common::{copy_time, hostcopy, now_ms, procfs, Store, Txn, MIB};

/// `cuInit` ran in this process. Like the real driver, nothing but version
/// and error-name queries works before it.
static INITIALIZED: AtomicBool = AtomicBool::new(false);
/// The device of this process's context (-1: none): the fake keeps one
/// current context per process, not per thread.
static CURRENT_DEVICE: AtomicI32 = AtomicI32::new(-1);

/// How often a blocked call looks again.
const POLL: Duration = Duration::from_millis(10);

/// The fake failed itself (a bad state file, a full disk): say why on stderr,
/// since a `CUresult` cannot, and answer `CUDA_ERROR_UNKNOWN`.
pub(crate) fn io_fail(e: io::Error) -> CuResult {
    eprintln!("gpusnap-fake-cuda: {e}");
    CUDA_ERROR_UNKNOWN
}

fn transact<T>(store: &Store, f: impl FnOnce(&mut Txn) -> Result<T, CuResult>) -> Result<T, CuResult> {
    store.transact(f).map_err(io_fail)?
}

pub fn init(flags: u32) -> Result<(), CuResult> {
    if flags != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let config = Store::from_env().load_config().map_err(io_fail)?;
    sleep(Duration::from_millis(config.init_ms));
    if config.init_rc != 0 {
        return Err(config.init_rc);
    }
    if config.gpus.is_empty() {
        return Err(CUDA_ERROR_NO_DEVICE);
    }
    INITIALIZED.store(true, Ordering::SeqCst);
    Ok(())
}

pub fn driver_version() -> Result<i32, CuResult> {
    Ok(Store::from_env().load_config().map_err(io_fail)?.driver_version)
}

// ---------------------------------------------------------------------------
// The checkpoint API.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    Lock,
    Checkpoint,
    Restore,
    Unlock,
    GetState,
    GetRestoreTid,
}

impl Call {
    /// The name in the journal and in `inject` entries.
    fn name(self) -> &'static str {
        match self {
            Call::Lock => "lock",
            Call::Checkpoint => "checkpoint",
            Call::Restore => "restore",
            Call::Unlock => "unlock",
            Call::GetState => "get_state",
            Call::GetRestoreTid => "get_restore_tid",
        }
    }

    /// The calls that hang on a stopped process on the real driver.
    fn hangs_on_stopped(self) -> bool {
        matches!(self, Call::Lock | Call::GetState)
    }
}

/// Runs one checkpoint-API call on `pid` and journals its answer.
///
/// `args` are the call's C arguments, already checked by the FFI layer;
/// `body` gets the store, the process (thread ids resolved to it) and the
/// arguments, and runs with the call serialised against others on the same
/// process.
pub fn checkpoint_call<A, T>(
    call: Call,
    pid: i32,
    args: Result<A, CuResult>,
    body: impl FnOnce(&Store, i32, A) -> Result<T, CuResult>,
) -> Result<T, CuResult> {
    let store = Store::from_env();
    let result = run_checkpoint_call(&store, call, pid, args, body);
    let rc = result.as_ref().err().copied().unwrap_or(CUDA_SUCCESS);
    if let Err(e) = store.journal(call.name(), pid, rc) {
        eprintln!("gpusnap-fake-cuda: journal: {e}");
    }
    result
}

fn run_checkpoint_call<A, T>(
    store: &Store,
    call: Call,
    pid: i32,
    args: Result<A, CuResult>,
    body: impl FnOnce(&Store, i32, A) -> Result<T, CuResult>,
) -> Result<T, CuResult> {
    if !INITIALIZED.load(Ordering::SeqCst) {
        return Err(CUDA_ERROR_NOT_INITIALIZED);
    }
    let args = args?;
    if let Some(inj) = transact(store, |t| Ok(t.take_injection(call.name(), pid)))? {
        if inj.hang {
            // A hung driver call never comes back; the caller must give up on
            // it, as gpusnap does with its own deadlines.
            loop {
                sleep(Duration::from_secs(3600));
            }
        }
        if inj.rc != CUDA_SUCCESS {
            return Err(inj.rc);
        }
    }

    let process = procfs::tgid(pid).ok_or(CUDA_ERROR_OPERATING_SYSTEM)?;
    let stat = procfs::stat(process).ok_or(CUDA_ERROR_OPERATING_SYSTEM)?;
    if stat.is_dead() {
        return Err(CUDA_ERROR_NOT_INITIALIZED);
    }
    if call.hangs_on_stopped() {
        // Ignores any lock timeout, as the real driver does.
        while procfs::stat(process).is_some_and(|s| s.is_stopped()) {
            sleep(POLL);
        }
    }
    let _serialised = store.lock_target(process).map_err(io_fail)?;
    finish_orphaned_restore(store, process)?;
    body(store, process, args)
}

/// A restore under way whose caller died (calls on a process are
/// serialised: holding the process's lock, one still under way has lost its
/// caller) goes on in the process, whose restore thread does the copy (as
/// on the real driver; assumed, not measured): this call waits for the copy
/// to end and then finds the process restored (LOCKED).
fn finish_orphaned_restore(store: &Store, pid: i32) -> Result<(), CuResult> {
    loop {
        let left = transact(store, |t| {
            let Some(p) = t.state.procs.get_mut(&pid) else { return Ok(0) };
            if p.restoring_until_ms.is_none() {
                return Ok(0);
            }
            let left = p.finish_orphaned_restore(now_ms());
            if left == 0 && p.state == gpusnap_fake_common::state::ProcState::Locked {
                store.move_data(pid, false).map_err(io_fail)?;
            }
            Ok(left)
        })?;
        if left == 0 {
            return Ok(());
        }
        sleep(Duration::from_millis(left).min(POLL * 10));
    }
}

/// Runs `f` on the entry of `pid` under the directory lock; a process that has
/// vanished meanwhile answers 304 and one that never made a context 3.
fn on_process<T>(
    store: &Store,
    pid: i32,
    f: impl FnOnce(&mut Txn) -> Result<T, CuResult>,
) -> Result<T, CuResult> {
    transact(store, |t| {
        let stat = procfs::stat(pid).ok_or(CUDA_ERROR_OPERATING_SYSTEM)?;
        if stat.is_dead() {
            return Err(CUDA_ERROR_NOT_INITIALIZED);
        }
        if !t.state.procs.contains_key(&pid) {
            crate::moved::follow(store, t, pid);
        }
        let p = t.state.procs.get_mut(&pid).ok_or(CUDA_ERROR_NOT_INITIALIZED)?;
        // The start times differ only for a checkpointed entry, the one kind
        // that outlives its process (see `collect_garbage`): a CRIU-restored
        // process took over the pid, and from now on the entry is its own.
        if p.start_time != stat.start_time {
            // Its memory (and so its driver state) is from the image, taken
            // before anything that happened to the old process: a restore
            // that stranded the old one does not strand this one.
            p.poisoned = false;
            p.restoring_until_ms = None;
            p.start_time = stat.start_time;
        }
        f(t)
    })
}

pub(crate) fn entry(t: &mut Txn, pid: i32) -> Result<&mut Proc, CuResult> {
    t.state.procs.get_mut(&pid).ok_or(CUDA_ERROR_NOT_INITIALIZED)
}

pub fn lock(store: &Store, pid: i32, timeout_ms: u32) -> Result<(), CuResult> {
    let (wait, inside) = on_process(store, pid, |t| {
        let p = entry(t, pid)?;
        Ok((p.begin_lock(now_ms(), timeout_ms)?, p.inside))
    })?;
    if inside > 0 {
        // A thread of the process was inside a driver call when the lock
        // came: what the real driver's checkpoint was seen to crash a
        // program for once restored. Tests look for this note.
        if let Err(e) = store.journal_note("lock_inside", pid, &inside.to_string()) {
            eprintln!("gpusnap-fake-cuda: journal: {e}");
        }
    }
    match wait {
        LockWait::TimesOut(ms) => {
            sleep(Duration::from_millis(ms));
            Err(CUDA_ERROR_NOT_READY)
        }
        LockWait::Drains(ms) => {
            sleep(Duration::from_millis(ms));
            on_process(store, pid, |t| entry(t, pid)?.finish_lock())
        }
    }
}

pub fn checkpoint(store: &Store, pid: i32) -> Result<(), CuResult> {
    let (bytes, gbps, host) = on_process(store, pid, |t| {
        let ctx = t.config.context_mib * MIB;
        let gbps = t.config.checkpoint_gbps;
        let p = entry(t, pid)?;
        Ok((p.begin_checkpoint(ctx)?, gbps, p.host_copy))
    })?;
    let started = Instant::now();
    if let Some(hc) = host {
        // The copy to host memory inside the process. A process gone
        // meanwhile answers 304 below.
        if let Err(e) = hostcopy::write(pid, hc) {
            eprintln!("gpusnap-fake-cuda: host copy of {pid}: {e}");
        }
    }
    sleep(copy_time(bytes, gbps).saturating_sub(started.elapsed()));
    on_process(store, pid, |t| {
        let p = entry(t, pid)?;
        p.finish_checkpoint()?;
        p.released_ms = now_ms();
        store.move_data(pid, true).map_err(io_fail)
    })
}

pub fn restore(store: &Store, pid: i32, pairs: Option<Vec<GpuPair>>) -> Result<(), CuResult> {
    let (bytes, gbps, host, tid) = on_process(store, pid, |t| {
        let bytes = t.state.begin_restore(&t.config, pid, pairs.as_deref())?;
        let gbps = t.config.restore_gbps;
        let p = entry(t, pid)?;
        p.restoring_until_ms = Some(now_ms() + copy_time(bytes, gbps).as_millis() as u64);
        Ok((bytes, gbps, p.host_copy, p.restore_tid))
    })?;
    let started = Instant::now();
    if let Some(hc) = host {
        // The copy back from host memory: blocks on pages a lazy wake has not
        // filled yet. The real driver cannot tell zero pages from data, so
        // whatever it read, the restore goes on; the journal says what it was.
        // The copy is the restore thread's work inside the process: it does
        // not go on while that thread is stopped (assumed, not measured).
        let verdict = hostcopy::read(pid, hc, || wait_while_stopped(pid, tid));
        if let Err(e) = store.journal_note("restore_data", pid, &verdict.to_string()) {
            eprintln!("gpusnap-fake-cuda: journal: {e}");
        }
    }
    sleep(copy_time(bytes, gbps).saturating_sub(started.elapsed()));
    on_process(store, pid, |t| {
        entry(t, pid)?.finish_restore()?;
        store.move_data(pid, false).map_err(io_fail)
    })
}

/// Waits while the restore thread `tid` of `pid` is stopped (by a signal or
/// a tracer); no wait when there is none or it is gone.
fn wait_while_stopped(pid: i32, tid: Option<i32>) {
    let Some(tid) = tid else { return };
    while procfs::tgid(tid) == Some(pid) && procfs::stat(tid).is_some_and(|s| matches!(s.state, 'T' | 't')) {
        sleep(POLL);
    }
}

pub fn unlock(store: &Store, pid: i32) -> Result<(), CuResult> {
    on_process(store, pid, |t| entry(t, pid)?.unlock())
}

pub fn get_state(store: &Store, pid: i32) -> Result<i32, CuResult> {
    on_process(store, pid, |t| Ok(entry(t, pid)?.reported_state() as i32))
}

/// The registered restore thread while it is a thread of `pid`, else `pid`.
pub fn get_restore_tid(store: &Store, pid: i32) -> Result<i32, CuResult> {
    on_process(store, pid, |t| {
        let tid = entry(t, pid)?.restore_tid;
        Ok(tid.filter(|&tid| procfs::tgid(tid) == Some(pid)).unwrap_or(pid))
    })
}

// ---------------------------------------------------------------------------
// The workload API: what `fake-workload` calls on itself.

/// Runs `f` for the calling process once it may do CUDA work: every call
/// blocks while the process is locked, checkpointed or poisoned, as a real
/// locked process's calls do. `f` runs under the same directory lock as that
/// check, so a checkpoint cannot move the data under a copy.
///
/// `new_context` is the caller's start time when it creates a context: an
/// entry from another start time is an earlier process's with the same pid
/// (kept because it was checkpointed), whose resume it must not wait for.
/// So is any entry of another start time when the caller lives in the
/// initial time namespace: it is a fresh program that got the pid, not the
/// process CRIU restored (which lives in a time namespace of its own, where
/// /proc shows its start time shifted), and the real driver does not hold a
/// fresh process's calls for a dead one's state.
pub(crate) fn as_workload<T>(
    new_context: Option<u64>,
    f: impl FnOnce(&Store, &mut Txn, i32) -> Result<T, CuResult>,
) -> Result<T, CuResult> {
    if !INITIALIZED.load(Ordering::SeqCst) {
        return Err(CUDA_ERROR_NOT_INITIALIZED);
    }
    let store = Store::from_env();
    let mut f = Some(f);
    loop {
        // Who the caller is, asked again on every try: a call blocked by a
        // checkpoint goes on in the process CRIU restored, which may have
        // another host pid (a new pid namespace) and a time namespace of its
        // own.
        let me = procfs::self_pid();
        let fresh_start =
            procfs::in_initial_time_namespace().then(|| procfs::stat(me).map(|s| s.start_time)).flatten();
        let stale_for_me = |p: &gpusnap_fake_common::state::Proc| {
            new_context.is_some_and(|start| p.start_time != start)
                || fresh_start.is_some_and(|start| p.start_time != start)
        };
        let blocked_in = |state: &gpusnap_fake_common::state::State| {
            state.procs.get(&me).is_some_and(|p| !p.accepts_work() && !stale_for_me(p))
        };
        // Looked at without the lock first: a blocked process (locked,
        // checkpointed) polls, and CRIU may freeze it mid-poll; frozen while
        // holding the lock it would stall everyone else.
        if store.peek_state().is_ok_and(|st| blocked_in(&st)) {
            sleep(POLL);
            continue;
        }
        let done = store
            .transact(|t| {
                if !t.state.procs.contains_key(&me) {
                    crate::moved::follow(&store, t, me);
                }
                let blocked = t.state.procs.get(&me).is_some_and(|p| !p.accepts_work() && !stale_for_me(p));
                if blocked {
                    return None;
                }
                // A faulted context fails every call at once (sticky).
                if let Some(rc) = t.state.procs.get(&me).filter(|p| !stale_for_me(p)).and_then(|p| p.faulted)
                {
                    return Some(Err(rc));
                }
                f.take().map(|f| f(&store, t, me))
            })
            .map_err(io_fail)?;
        if let Some(result) = done {
            return result;
        }
        sleep(POLL);
    }
}

pub(crate) fn current_device() -> Result<u32, CuResult> {
    u32::try_from(CURRENT_DEVICE.load(Ordering::SeqCst)).map_err(|_| CUDA_ERROR_INVALID_CONTEXT)
}

pub fn device_count() -> Result<i32, CuResult> {
    as_workload(None, |_, t, _| Ok(t.config.gpus.len() as i32))
}

pub fn device_get(ordinal: i32) -> Result<i32, CuResult> {
    as_workload(None, |_, t, _| {
        if ordinal < 0 || ordinal as usize >= t.config.gpus.len() {
            return Err(CUDA_ERROR_INVALID_DEVICE);
        }
        Ok(ordinal)
    })
}

pub fn ctx_create(device: i32) -> Result<(), CuResult> {
    let gpu = u32::try_from(device).map_err(|_| CUDA_ERROR_INVALID_DEVICE)?;
    let start = procfs::stat(procfs::self_pid()).map_or(0, |s| s.start_time);
    as_workload(Some(start), |store, t, me| {
        if t.state.create_context(&t.config, me, start, gpu)? {
            store.remove_data(me);
        }
        crate::moved::mark(store, t, me);
        Ok(())
    })?;
    CURRENT_DEVICE.store(device, Ordering::SeqCst);
    Ok(())
}

pub fn mem_alloc(bytes: u64) -> Result<u64, CuResult> {
    let gpu = current_device()?;
    as_workload(None, |_, t, me| t.state.alloc(&t.config, me, gpu, bytes))
}

pub fn mem_free(ptr: u64) -> Result<(), CuResult> {
    current_device()?;
    as_workload(None, |store, t, me| {
        t.state.free(me, ptr)?;
        store.drop_data(me, ptr).map_err(io_fail)
    })
}

pub fn memcpy_htod(dst: u64, bytes: &[u8]) -> Result<(), CuResult> {
    current_device()?;
    let (wait, me) = as_workload(None, |store, t, me| {
        let (base, offset) = entry(t, me)?.locate(dst, bytes.len() as u64)?;
        store.write_data(me, base, offset, bytes).map_err(io_fail)?;
        let wait = copy_time(bytes.len() as u64, t.config.copy_gbps);
        enter_wait(t, me, wait)?;
        Ok((wait, me))
    })?;
    wait_inside(me, wait);
    Ok(())
}

pub fn memcpy_dtoh(src: u64, len: usize) -> Result<Vec<u8>, CuResult> {
    current_device()?;
    let (data, wait, me) = as_workload(None, |store, t, me| {
        let (base, offset) = entry(t, me)?.locate(src, len as u64)?;
        let data = store.read_data(me, base, offset, len).map_err(io_fail)?;
        let wait = copy_time(len as u64, t.config.copy_gbps);
        enter_wait(t, me, wait)?;
        Ok((data, wait, me))
    })?;
    wait_inside(me, wait);
    Ok(data)
}

/// Waits for the process's queued work. Copies do not: only this call (and
/// `cuStreamSynchronize`) and a lock wait for queued work.
pub fn ctx_synchronize() -> Result<(), CuResult> {
    current_device()?;
    let (wait, me) = as_workload(None, |_, t, me| {
        let busy = Duration::from_millis(entry(t, me)?.busy_until_ms.saturating_sub(now_ms()));
        let wait = busy.max(CALL_TIME);
        enter_wait(t, me, wait)?;
        Ok((wait, me))
    })?;
    wait_inside(me, wait);
    Ok(())
}

/// How long a synchronize or a query stays inside the driver at least (a
/// real one takes microseconds; a thread polling in a loop is inside the
/// driver most of the time either way).
const CALL_TIME: Duration = Duration::from_millis(1);

/// `cuStreamQuery`: `CUDA_ERROR_NOT_READY` while queued work runs.
pub fn stream_query() -> Result<(), CuResult> {
    current_device()?;
    let (ready, me) = as_workload(None, |_, t, me| {
        let ready = entry(t, me)?.busy_until_ms <= now_ms();
        enter_wait(t, me, CALL_TIME)?;
        Ok((ready, me))
    })?;
    wait_inside(me, CALL_TIME);
    if ready {
        Ok(())
    } else {
        Err(CUDA_ERROR_NOT_READY)
    }
}

/// Counts the calling thread as inside the driver when its call has to
/// wait after this transaction.
fn enter_wait(t: &mut Txn, me: i32, wait: Duration) -> Result<(), CuResult> {
    if !wait.is_zero() {
        entry(t, me)?.inside += 1;
    }
    Ok(())
}

/// The wait of a call counted by `enter_wait`; the thread leaves the
/// driver after it (without waiting for the process to be running: the
/// thread is on its way out).
fn wait_inside(me: i32, wait: Duration) {
    if wait.is_zero() {
        return;
    }
    sleep(wait);
    let store = Store::from_env();
    let _ = transact(&store, |t| {
        if let Some(p) = t.state.procs.get_mut(&me) {
            p.inside = p.inside.saturating_sub(1);
        }
        Ok(())
    });
}

/// `fakeRegisterHostCopy`: the calling process keeps its host copy in
/// `[addr, addr + len)` (page-aligned, anonymous, its own): from now on its
/// checkpoints write there and its restores read from there.
pub fn register_host_copy(addr: u64, len: u64) -> Result<(), CuResult> {
    let page = hostcopy::PAGE as u64;
    if addr == 0 || len == 0 || !addr.is_multiple_of(page) || !len.is_multiple_of(page) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    as_workload(None, |_, t, me| {
        entry(t, me)?.host_copy = Some(HostCopy { addr, len });
        Ok(())
    })
}

/// `fakeRegisterRestoreThread`: the calling thread is the one
/// `cuCheckpointProcessGetRestoreThreadId` names for its process.
pub fn register_restore_thread() -> Result<(), CuResult> {
    let tid = procfs::self_tid();
    as_workload(None, |_, t, me| {
        entry(t, me)?.restore_tid = Some(tid);
        Ok(())
    })
}

/// `fakeFault`: the calling process's context takes the sticky error `rc`
/// (0: `CUDA_ERROR_ILLEGAL_ADDRESS`), as a kernel that wrote through a bad
/// pointer leaves it. Answers `rc`, as the synchronising call after such a
/// kernel does.
pub fn fault(rc: CuResult) -> Result<(), CuResult> {
    let rc = if rc == 0 { CUDA_ERROR_ILLEGAL_ADDRESS } else { rc };
    current_device()?;
    as_workload(None, |_, t, me| {
        entry(t, me)?.faulted = Some(rc);
        Ok(())
    })?;
    Err(rc)
}

pub fn enqueue_work(ms: u32) -> Result<(), CuResult> {
    current_device()?;
    as_workload(None, |_, t, me| {
        entry(t, me)?.enqueue_work(now_ms(), ms);
        Ok(())
    })
}

/// `cuCtxSetCurrent`: the context token of `device` (one context per
/// process and device); the process must have made it.
pub fn set_current(device: i32) -> Result<(), CuResult> {
    let gpu = u32::try_from(device).map_err(|_| CUDA_ERROR_INVALID_CONTEXT)?;
    as_workload(None, |_, t, me| {
        if entry(t, me)?.contexts.contains(&gpu) {
            Ok(())
        } else {
            Err(CUDA_ERROR_INVALID_CONTEXT)
        }
    })?;
    CURRENT_DEVICE.store(device, Ordering::SeqCst);
    Ok(())
}

/// The current device, -1 for none.
pub fn current_raw() -> i32 {
    CURRENT_DEVICE.load(Ordering::SeqCst)
}
