//! Pinned copies made ahead of time, with kept copies
//! (`GPUSNAP_FAST_SWAP_KEEP=1`): once the program's allocations have
//! settled (no allocation served or freed for `GPUSNAP_FAST_SWAP_SETTLE_MS`,
//! default 2000), a thread of the library's own pins the host copy of every
//! movable allocation chunk by chunk, so that the first offload copies at
//! once, as every later one does. It never holds a lock the program's calls
//! take for longer than a table update, and steps aside for an offload or
//! restore (one chunk at most).
//!
//! A budget for pinned host memory (`GPUSNAP_FAST_SWAP_PIN_BUDGET`, bytes;
//! none when unset) bounds it: no copy is pinned ahead of time past it, and
//! after a restore the copies over it are given back, the allocations
//! swapped least recently first (the next offload pins them anew).

use super::{hostmem, program, swap, table};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The budget in bytes (`u64::MAX`: none).
pub static BUDGET: AtomicU64 = AtomicU64::new(u64::MAX);
/// When the program's allocations last changed (ms since the library
/// loaded).
static CHANGED_MS: AtomicU64 = AtomicU64::new(0);
static SETTLE_MS: AtomicU64 = AtomicU64::new(2000);
/// A clock for stamps: ms since the library loaded.
static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();

pub fn now_ms() -> u64 {
    START.get_or_init(Instant::now).elapsed().as_millis() as u64
}

/// An allocation was served or freed: the allocations have not settled.
pub fn changed() {
    CHANGED_MS.store(now_ms(), Ordering::SeqCst);
}

/// Reads the budget and the settle time, and starts the thread when
/// copies are kept (at load).
pub fn start() {
    now_ms();
    if let Some(b) = std::env::var("GPUSNAP_FAST_SWAP_PIN_BUDGET").ok().and_then(|v| v.parse::<u64>().ok()) {
        BUDGET.store(b, Ordering::SeqCst);
    }
    if let Some(s) = std::env::var("GPUSNAP_FAST_SWAP_SETTLE_MS").ok().and_then(|v| v.parse::<u64>().ok()) {
        SETTLE_MS.store(s, Ordering::SeqCst);
    }
    if !swap::KEEP.load(Ordering::Relaxed) {
        return;
    }
    let _ = std::thread::Builder::new().name("gpusnap-swap-pin".into()).spawn(|| loop {
        std::thread::sleep(Duration::from_millis(200));
        let settled =
            now_ms().saturating_sub(CHANGED_MS.load(Ordering::SeqCst)) >= SETTLE_MS.load(Ordering::SeqCst);
        if settled {
            while pin_one() {}
        }
    });
}

/// A chunk still without a pinned copy: (served address or program handle,
/// whether it is the program's, chunk index, its length, chunks in all).
fn missing() -> Option<(u64, bool, usize, u64, usize)> {
    let mut all: Vec<(u64, table::Entry)> = {
        let g = table::table();
        g.as_ref().map(|t| t.served.iter().map(|(a, e)| (*a, e.clone())).collect()).unwrap_or_default()
    };
    all.extend(program::units(false));
    for (va, e) in all {
        let n = hostmem::chunks(e.bytes).count();
        for (k, (_, len)) in hostmem::chunks(e.bytes).enumerate() {
            if e.host.get(k).copied().unwrap_or(0) == 0 {
                let key = if e.program != 0 { e.program } else { va };
                return Some((key, e.program != 0, k, len, n));
            }
        }
    }
    None
}

/// Pins one missing chunk, within the budget; whether it did.
fn pin_one() -> bool {
    // An offload or restore under way goes first; one that starts now
    // waits for this chunk only.
    let Some(_busy) = swap::try_busy() else { return false };
    if swap::phase() != swap::Phase::Resident {
        return false;
    }
    let Some((key, prog, k, len, n)) = missing() else { return false };
    if hostmem::PINNED.load(Ordering::SeqCst).saturating_add(len) > BUDGET.load(Ordering::SeqCst) {
        return false;
    }
    let how = hostmem::how();
    let Ok(p) = hostmem::pin(how, len) else { return false };
    let stored = if prog {
        program::set_chunk(key, k, n, p)
    } else {
        let mut g = table::table();
        match g.as_mut().and_then(|t| t.served.get_mut(&key)) {
            Some(e) if hostmem::chunks(e.bytes).count() == n && e.host.get(k).copied().unwrap_or(0) == 0 => {
                e.host.resize(n, 0);
                e.host[k] = p;
                true
            }
            _ => false,
        }
    };
    if !stored {
        // SAFETY: just pinned, never handed out.
        unsafe { hostmem::unpin(how, p, len) };
    }
    stored
}

/// After a restore that kept its copies: the copies over the budget go
/// back, the allocations swapped least recently first (ties: the smaller
/// address first). Returns the copies to give back (off the program's path).
pub fn over_budget(used: &dyn Fn(u64, bool) -> u64) -> Vec<table::Entry> {
    let budget = BUDGET.load(Ordering::SeqCst);
    let mut pinned = hostmem::PINNED.load(Ordering::SeqCst);
    if pinned <= budget {
        return Vec::new();
    }
    let mut all: Vec<(u64, u64, table::Entry)> = {
        let g = table::table();
        g.as_ref()
            .map(|t| t.served.iter().map(|(a, e)| (used(*a, false), *a, e.clone())).collect())
            .unwrap_or_default()
    };
    all.extend(program::units(false).into_iter().map(|(a, e)| (used(e.program, true), a, e)));
    all.sort_by_key(|(u, a, _)| (*u, *a));
    let mut out = Vec::new();
    for (_, va, e) in all {
        if pinned <= budget {
            break;
        }
        let held: u64 =
            e.host.iter().zip(hostmem::chunks(e.bytes)).filter(|(p, _)| **p != 0).map(|(_, (_, l))| l).sum();
        if held == 0 {
            continue;
        }
        if e.program != 0 {
            program::set(e.program, None, Some(Vec::new()), None);
        } else if let Some(x) = table::table().as_mut().and_then(|t| t.served.get_mut(&va)) {
            x.host = Vec::new();
        }
        pinned = pinned.saturating_sub(held);
        out.push(e);
    }
    out
}
