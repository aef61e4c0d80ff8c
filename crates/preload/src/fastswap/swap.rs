//! Offload and restore: the served allocations' contents go to pinned host
//! memory and their physical memory back to the driver (the reservations
//! stay, so every pointer the program holds stays valid), and later come
//! back at the same addresses. The gate is closed from the start of an
//! offload to the end of the restore: no kernel runs meanwhile.

use super::driver as cu;
use super::{gate, hostmem, program, table};
use std::ffi::c_void;
use std::sync::atomic::{AtomicI32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Where the memory is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    Resident = 0,
    Offloading = 1,
    Offloaded = 2,
    Restoring = 3,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Resident => "resident",
            Phase::Offloading => "offloading",
            Phase::Offloaded => "offloaded",
            Phase::Restoring => "restoring",
        }
    }
}

static PHASE: AtomicU8 = AtomicU8::new(0);
/// One offload or restore at a time.
static BUSY: Mutex<()> = Mutex::new(());

/// The offload-or-restore lock, if free now (the pre-pinning thread steps
/// aside for either).
pub fn try_busy() -> Option<std::sync::MutexGuard<'static, ()>> {
    match BUSY.try_lock() {
        Ok(g) => Some(g),
        Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

/// When each allocation last went out (the library's ms clock), by served
/// address or program handle: the budget gives back the least recent first.
static USED: Mutex<std::collections::BTreeMap<(bool, u64), u64>> =
    Mutex::new(std::collections::BTreeMap::new());

fn used(key: u64, program: bool) -> u64 {
    USED.lock().map(|u| u.get(&(program, key)).copied().unwrap_or(0)).unwrap_or(0)
}

pub fn phase() -> Phase {
    match PHASE.load(Ordering::SeqCst) {
        1 => Phase::Offloading,
        2 => Phase::Offloaded,
        3 => Phase::Restoring,
        _ => Phase::Resident,
    }
}

fn set(p: Phase) {
    PHASE.store(p as u8, Ordering::SeqCst);
}

/// How long an offload waits for the gate to drain with no call leaving
/// before it gives up (`GPUSNAP_FAST_SWAP_DRAIN_S`, default 30).
static DRAIN_S: AtomicU64 = AtomicU64::new(30);

/// Sets the drain limit from the environment (at load).
pub fn set_drain_from_env() {
    if let Some(s) = std::env::var("GPUSNAP_FAST_SWAP_DRAIN_S").ok().and_then(|v| v.parse::<u64>().ok()) {
        DRAIN_S.store(s.clamp(1, 3600), Ordering::Relaxed);
    }
}
/// Copy threads at most: each pins its own chunks (the kernel's zeroing
/// and pinning of pages, not the link, bounds an offload), so as many as
/// the host has cores, up to this.
const THREADS: usize = 16;

fn threads() -> usize {
    std::thread::available_parallelism().map_or(4, |n| n.get()).clamp(2, THREADS)
}

/// Whether contents are checksummed on the way out and checked on the way
/// back (`GPUSNAP_FAST_SWAP_VERIFY=1`).
pub static VERIFY: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// A failed offload or restore: a word for gpusnap, and the detail.
#[derive(Debug)]
pub struct Failure {
    pub kind: &'static str,
    pub detail: String,
}

fn fail(kind: &'static str, detail: String) -> Failure {
    Failure { kind, detail }
}

/// Runs `work(i)` for `i` in `0..n` on up to THREADS threads, each with
/// `ctx_of(i)` made current first; the first failure, if any.
fn parallel(
    n: usize,
    ctx_of: &(dyn Fn(usize) -> usize + Sync),
    work: &(dyn Fn(usize) -> Result<(), String> + Sync),
) -> Result<(), String> {
    let next = AtomicUsize::new(0);
    let first: Mutex<Option<String>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..threads().min(n) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= n || first.lock().map(|f| f.is_some()).unwrap_or(true) {
                    return;
                }
                // SAFETY: a context the program made and still holds.
                let rc = unsafe { cu::ctx_set_current(ctx_of(i)) };
                let r = if rc == cu::SUCCESS { work(i) } else { Err(format!("cuCtxSetCurrent: {rc}")) };
                if let Err(e) = r {
                    if let Ok(mut f) = first.lock() {
                        f.get_or_insert(e);
                    }
                    return;
                }
            });
        }
    });
    match first.into_inner() {
        Ok(Some(e)) => Err(e),
        _ => Ok(()),
    }
}

fn checksum(p: usize, len: u64) -> [u8; 32] {
    // SAFETY: `len` bytes of host memory this library holds.
    let bytes = unsafe { std::slice::from_raw_parts(p as *const u8, len as usize) };
    *blake3::hash(bytes).as_bytes()
}

/// Whether the pinned copies stay after a restore, for the next offload
/// (`GPUSNAP_FAST_SWAP_KEEP=1`): the host memory stays taken while the
/// program runs, and an offload copies at once, without pinning anew.
pub static KEEP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// One chunk of one allocation: (entry index, offset, length).
type Item = (usize, u64, u64);

fn items(entries: &[(u64, table::Entry)]) -> Vec<Item> {
    let mut out = Vec::new();
    for (i, (_, e)) in entries.iter().enumerate() {
        out.extend(hostmem::chunks(e.bytes).map(|(off, len)| (i, off, len)));
    }
    // The largest chunks first, so that the threads finish together.
    out.sort_by_key(|it| std::cmp::Reverse(it.2));
    out
}

/// The indexes of `entries`, largest allocation first.
fn largest_first(entries: &[(u64, table::Entry)]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..entries.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(entries[i].1.size));
    order
}

/// The last offload's and restore's phases in milliseconds: offload's
/// pinning and copying, offload's release of the device memory, restore's
/// mapping, restore's copying back.
static LAST_MS: [AtomicU64; 4] = [const { AtomicU64::new(0) }; 4];

/// The phases of the last offload (`offload`) or restore: name and
/// milliseconds each, for the control socket's answer.
pub fn phases(offload: bool) -> Vec<(String, u64)> {
    let v = |name: &str, k: usize| (name.to_string(), LAST_MS[k].load(Ordering::Relaxed));
    if offload {
        vec![v("copy", 0), v("release", 1)]
    } else {
        vec![v("map", 2), v("copy", 3)]
    }
}

/// The chunk index of an item.
fn chunk_index(off: u64) -> usize {
    (off / hostmem::CHUNK) as usize
}

/// Moves every served allocation to pinned host memory and gives its
/// physical memory back. Returns the bytes moved. On failure nothing has
/// been given back and the gate is open again.
pub fn offload() -> Result<u64, Failure> {
    let _one = BUSY.lock().unwrap_or_else(|e| e.into_inner());
    match phase() {
        Phase::Offloaded => return Ok(0),
        Phase::Resident => {}
        other => return Err(fail("busy", format!("memory is {}", other.name()))),
    }
    set(Phase::Offloading);
    let undo = |f: Failure| {
        gate::open();
        set(Phase::Resident);
        f
    };
    // Quiescence: once the gate has drained no thread is inside a gated
    // driver call (a launch, a copy, a synchronize or a query), and none
    // enters one until the restore: the driver's lock that follows cannot
    // catch a thread inside the driver.
    if let Err(e) = gate::close(Duration::from_secs(DRAIN_S.load(Ordering::Relaxed))) {
        set(Phase::Resident);
        return Err(fail("inside", e));
    }
    let mut entries: Vec<(u64, table::Entry)> = {
        let g = table::table();
        g.as_ref().map(|t| t.served.iter().map(|(a, e)| (*a, e.clone())).collect()).unwrap_or_default()
    };
    // The program's own VMM memory moves the same way.
    entries.extend(program::units(false));
    let mut ctxs: Vec<usize> = entries.iter().map(|(_, e)| e.ctx).collect();
    ctxs.sort_unstable();
    ctxs.dedup();
    for &c in &ctxs {
        // SAFETY: contexts the program made; synchronising only waits.
        let rc = unsafe {
            let rc = cu::ctx_set_current(c);
            if rc == cu::SUCCESS {
                cu::ctx_synchronize()
            } else {
                rc
            }
        };
        if rc != cu::SUCCESS {
            return Err(undo(fail("driver", format!("cuCtxSynchronize: {rc}"))));
        }
    }
    let how = hostmem::how();
    // Each allocation's chunks: pinned copies kept from an earlier swap,
    // or filled in by the copy threads.
    let hosts: Vec<Vec<AtomicUsize>> = entries
        .iter()
        .map(|(_, e)| {
            let n = hostmem::chunks(e.bytes).count();
            (0..n).map(|k| AtomicUsize::new(e.host.get(k).copied().unwrap_or(0))).collect()
        })
        .collect();
    let sums: Vec<Vec<Mutex<[u8; 32]>>> =
        hosts.iter().map(|h| h.iter().map(|_| Mutex::new([0; 32])).collect()).collect();
    let verify = VERIFY.load(Ordering::Relaxed);
    let work = items(&entries);
    let t_copy = Instant::now();
    let copied = parallel(work.len(), &|n| entries[work[n].0].1.ctx, &|n| {
        let (i, off, len) = work[n];
        let (va, _) = &entries[i];
        let slot = &hosts[i][chunk_index(off)];
        let mut host = slot.load(Ordering::SeqCst);
        if host == 0 {
            host = hostmem::pin(how, len)?;
            slot.store(host, Ordering::SeqCst);
        }
        // SAFETY: `len` bytes of pinned host memory and of the served range.
        let rc = unsafe { cu::copy_dtoh(host as *mut c_void, va + off, len as usize) };
        if rc != cu::SUCCESS {
            return Err(format!("cuMemcpyDtoH of {:#x}: {rc}", va + off));
        }
        if verify {
            if let Ok(mut s) = sums[i][chunk_index(off)].lock() {
                *s = checksum(host, len);
            }
        }
        Ok(())
    });
    let host_of = |i: usize| -> Vec<usize> { hosts[i].iter().map(|h| h.load(Ordering::SeqCst)).collect() };
    if let Err(e) = copied {
        // Copies kept from an earlier swap stay; those pinned now go.
        for (i, (_, en)) in entries.iter().enumerate() {
            let fresh: Vec<usize> = host_of(i)
                .into_iter()
                .enumerate()
                .map(|(k, p)| if en.host.get(k).copied() == Some(p) { 0 } else { p })
                .collect();
            hostmem::unpin_all(&fresh, en.bytes);
        }
        return Err(undo(fail("driver", e)));
    }
    LAST_MS[0].store(ms(t_copy), Ordering::Relaxed);
    if let Ok(mut u) = USED.lock() {
        let now = super::prepin::now_ms();
        for (va, e) in &entries {
            u.insert((e.program != 0, if e.program != 0 { e.program } else { *va }), now);
        }
    }
    // Every copy is safe on the host: now the device memory goes back, on
    // the copy threads too (unmapping and releasing tens of GB takes time).
    let t_release = Instant::now();
    let rcs: Vec<AtomicI32> = entries.iter().map(|_| AtomicI32::new(cu::SUCCESS)).collect();
    let order = largest_first(&entries);
    let _ = parallel(order.len(), &|n| entries[order[n]].1.ctx, &|n| {
        let (va, e) = &entries[order[n]];
        let rc =
            if e.program != 0 { program::give_back(e.program) } else { table::unback(*va, e.size, e.handle) };
        rcs[order[n]].store(rc, Ordering::SeqCst);
        Ok(())
    });
    let mut moved = 0;
    let mut g = table::table();
    let t = g.get_or_insert_with(table::Table::default);
    for (i, (va, e)) in entries.iter().enumerate() {
        let sum = || -> Vec<[u8; 32]> {
            if verify {
                sums[i].iter().map(|s| s.lock().map(|s| *s).unwrap_or([0; 32])).collect()
            } else {
                Vec::new()
            }
        };
        if e.program != 0 {
            let ok = rcs[i].load(Ordering::SeqCst) == cu::SUCCESS;
            program::set(e.program, Some(if ok { 0 } else { e.handle }), Some(host_of(i)), Some(sum()));
            moved += e.bytes;
            continue;
        }
        if let Some(entry) = t.served.get_mut(va) {
            entry.host = host_of(i);
            entry.sum = if verify {
                sums[i].iter().map(|s| s.lock().map(|s| *s).unwrap_or([0; 32])).collect()
            } else {
                Vec::new()
            };
            if rcs[i].load(Ordering::SeqCst) == cu::SUCCESS {
                entry.handle = 0;
            }
        }
        moved += e.bytes;
    }
    LAST_MS[1].store(ms(t_release), Ordering::Relaxed);
    set(Phase::Offloaded);
    Ok(moved)
}

/// Maps memory for every offloaded allocation first (all or nothing), then
/// copies the contents back and opens the gate. On failure whatever was
/// taken is given back, and the memory stays offloaded.
pub fn restore() -> Result<u64, Failure> {
    let _one = BUSY.lock().unwrap_or_else(|e| e.into_inner());
    match phase() {
        Phase::Resident => return Ok(0),
        Phase::Offloaded => {}
        other => return Err(fail("busy", format!("memory is {}", other.name()))),
    }
    set(Phase::Restoring);
    let mut away: Vec<(u64, table::Entry)> = {
        let g = table::table();
        g.as_ref()
            .map(|t| t.served.iter().filter(|(_, e)| e.handle == 0).map(|(a, e)| (*a, e.clone())).collect())
            .unwrap_or_default()
    };
    away.extend(program::units(true));
    // Gives back what `back` took for entry `i` (handle `h`).
    let unback = |i: usize, h: u64| {
        let (va, e) = &away[i];
        if e.program != 0 {
            program::give_back(e.program);
            program::set(e.program, Some(0), None, None);
        } else {
            table::unback(*va, e.size, h);
        }
    };
    // Physical memory for every allocation first, on the copy threads (the
    // driver's creation and mapping of tens of GB is not free); all or
    // nothing: on the first refusal whatever was mapped goes back.
    let t_map = Instant::now();
    let handles: Vec<AtomicU64> = away.iter().map(|_| AtomicU64::new(0)).collect();
    let refused = AtomicI32::new(cu::SUCCESS);
    let order = largest_first(&away);
    let mapped = parallel(order.len(), &|n| away[order[n]].1.ctx, &|n| {
        let i = order[n];
        let (va, e) = &away[i];
        let backed = if e.program != 0 {
            let r = program::take_back(e.program);
            if let Ok(h) = r {
                program::set(e.program, Some(h), None, None);
            }
            r
        } else {
            table::back(*va, e.size, e.device)
        };
        match backed {
            Ok(h) => {
                handles[i].store(h, Ordering::SeqCst);
                Ok(())
            }
            Err(rc) => {
                let _ = refused.compare_exchange(cu::SUCCESS, rc, Ordering::SeqCst, Ordering::SeqCst);
                Err(format!("mapping {} bytes at {va:#x}: {rc}", e.size))
            }
        }
    });
    let taken: Vec<(usize, u64)> =
        handles.iter().enumerate().map(|(i, h)| (i, h.load(Ordering::SeqCst))).filter(|t| t.1 != 0).collect();
    if let Err(detail) = mapped {
        for &(i, h) in &taken {
            unback(i, h);
        }
        set(Phase::Offloaded);
        let rc = refused.load(Ordering::SeqCst);
        let kind = if rc == cu::OUT_OF_MEMORY { "no-memory" } else { "driver" };
        return Err(fail(kind, detail));
    }
    LAST_MS[2].store(ms(t_map), Ordering::Relaxed);
    let t_copy = Instant::now();
    {
        let mut g = table::table();
        let t = g.get_or_insert_with(table::Table::default);
        for &(i, h) in &taken {
            if let Some(e) = t.served.get_mut(&away[i].0).filter(|e| e.program == 0) {
                e.handle = h;
            }
        }
    }
    let verify = VERIFY.load(Ordering::Relaxed);
    let work = items(&away);
    let copied = parallel(work.len(), &|n| away[work[n].0].1.ctx, &|n| {
        let (i, off, len) = work[n];
        let (va, e) = &away[i];
        let k = chunk_index(off);
        let Some(&host) = e.host.get(k) else {
            return Err(format!("no host copy of {:#x}", va + off));
        };
        // SAFETY: the pinned chunk and the range just mapped, `len` each.
        let rc = unsafe { cu::copy_htod(va + off, host as *const c_void, len as usize) };
        if rc != cu::SUCCESS {
            return Err(format!("cuMemcpyHtoD of {:#x}: {rc}", va + off));
        }
        if let (true, Some(want)) = (verify, e.sum.get(k)) {
            let mut back = vec![0u8; len as usize];
            // SAFETY: a buffer of `len` bytes.
            let rc = unsafe { cu::copy_dtoh(back.as_mut_ptr().cast(), va + off, len as usize) };
            if rc != cu::SUCCESS || blake3::hash(&back).as_bytes() != want {
                return Err(format!("contents of {:#x} differ after the copy back", va + off));
            }
        }
        Ok(())
    });
    if let Err(e) = copied {
        // The memory is mapped but its contents are not whole: keep the
        // pinned copies and the gate closed; a restore again copies anew.
        for &(i, h) in &taken {
            unback(i, h);
        }
        let mut g = table::table();
        if let Some(t) = g.as_mut() {
            for (va, _) in &away {
                if let Some(e) = t.served.get_mut(va) {
                    e.handle = 0;
                }
            }
        }
        set(Phase::Offloaded);
        return Err(fail("driver", e));
    }
    let keep = KEEP.load(Ordering::Relaxed);
    let mut moved = 0;
    let mut copies: Vec<table::Entry> = Vec::new();
    {
        let mut g = table::table();
        if let Some(t) = g.as_mut() {
            for (va, a) in &away {
                if a.program != 0 {
                    if !keep && !a.host.is_empty() {
                        copies.push(a.clone());
                        program::set(a.program, None, Some(Vec::new()), Some(Vec::new()));
                    } else {
                        program::set(a.program, None, None, Some(Vec::new()));
                    }
                    moved += a.bytes;
                    continue;
                }
                if let Some(e) = t.served.get_mut(va) {
                    if !keep && !e.host.is_empty() {
                        copies.push(e.clone());
                        e.host = Vec::new();
                    }
                    e.sum = Vec::new();
                    moved += e.bytes;
                }
            }
        }
    }
    LAST_MS[3].store(ms(t_copy), Ordering::Relaxed);
    if keep {
        // Kept copies past the pinned budget go back, least recent first.
        copies.extend(super::prepin::over_budget(&used));
    }
    set(Phase::Resident);
    gate::open();
    // The pinned copies are no longer needed; giving them back (unpinning
    // every page) takes seconds for tens of GB, so it happens after the
    // program runs again, off its path.
    release_copies(copies);
    Ok(moved)
}

/// Unpins the copies of `entries` on a thread of its own (inline if no
/// thread can be had).
fn release_copies(entries: Vec<table::Entry>) {
    if entries.is_empty() {
        return;
    }
    let free = move || {
        for e in entries {
            // SAFETY: a context the program holds (cuMemFreeHost wants one).
            unsafe { cu::ctx_set_current(e.ctx) };
            hostmem::unpin_all(&e.host, e.bytes);
        }
    };
    let spare = std::sync::Arc::new(Mutex::new(Some(free)));
    let other = std::sync::Arc::clone(&spare);
    let spawned = std::thread::Builder::new().name("gpusnap-swap-free".into()).spawn(move || {
        if let Some(f) = other.lock().ok().and_then(|mut f| f.take()) {
            f();
        }
    });
    if spawned.is_err() {
        if let Some(f) = spare.lock().ok().and_then(|mut f| f.take()) {
            f();
        }
    }
}

/// Milliseconds since `t`.
pub fn ms(t: Instant) -> u64 {
    t.elapsed().as_millis() as u64
}
