//! The program's own use of the VMM API (PyTorch's expandable segments,
//! vLLM's sleep-mode allocator, SGLang's memory saver): `cuMemCreate`,
//! `cuMemMap`, `cuMemSetAccess`, `cuMemUnmap`, `cuMemRelease` are wrapped
//! so that the library knows every physical allocation the program made
//! and where it is mapped, with which access. An offload copies out what a
//! handle holds (through a mapping that covers it), unmaps it everywhere
//! and releases it; a restore creates new physical memory with the same
//! properties and maps it at the same addresses with the same access. The
//! reservations are the program's and stay.
//!
//! The program holds handles across that, but the driver's handle of the
//! new memory differs: the program is given handles of the library's own
//! (`VIRTUAL` and up), which every wrapper translates to the driver's
//! current one. A handle exported to another process, or never mapped whole
//! at offset 0, stays with the driver (named in the status line).

use super::driver as cu;
use super::{gate, table};
use std::collections::BTreeMap;
use std::ffi::{c_int, c_void};
use std::sync::atomic::Ordering;
use std::sync::{Mutex, MutexGuard};

/// The first handle value handed to the program: far from any the driver
/// hands out in practice, so that a stray driver handle is never taken for
/// one of these.
const VIRTUAL: u64 = 0x6773_0000_0000_0001;

/// One physical allocation the program made.
#[derive(Debug, Clone)]
pub struct Handle {
    /// The driver's handle now; 0 while its memory is away.
    pub real: u64,
    pub size: u64,
    /// The `CUmemAllocationProp` it was made with (32 bytes).
    prop: [u8; 32],
    pub device: i32,
    /// The program released it while mapped: freed at its last unmap.
    released: bool,
    /// Exported to a shareable handle: another process may hold it.
    exported: bool,
    /// `cuMemRetainAllocationHandle` references not yet released.
    retained: u32,
    /// Pinned host copy, chunk by chunk, while away (and kept copies).
    pub host: Vec<usize>,
    pub sum: Vec<[u8; 32]>,
}

/// One mapping of (part of) a handle.
#[derive(Debug, Clone)]
struct Mapping {
    size: u64,
    offset: u64,
    /// The program's (virtual) handle.
    handle: u64,
    /// The access descriptors set on it (12 bytes each, `CUmemAccessDesc`).
    access: Vec<[u8; 12]>,
    /// The context current when it was mapped.
    ctx: usize,
}

#[derive(Default)]
struct Vmm {
    handles: BTreeMap<u64, Handle>,
    maps: BTreeMap<u64, Mapping>,
    next: u64,
}

static VMM: Mutex<Option<Vmm>> = Mutex::new(None);

fn vmm() -> MutexGuard<'static, Option<Vmm>> {
    VMM.lock().unwrap_or_else(|e| e.into_inner())
}

fn with<T>(f: impl FnOnce(&mut Vmm) -> T) -> T {
    let mut g = vmm();
    f(g.get_or_insert_with(|| Vmm { next: VIRTUAL, ..Vmm::default() }))
}

fn serving() -> bool {
    table::SERVING.load(Ordering::Relaxed)
}

/// The driver's handle for the program's `h` (itself when it is not one of
/// ours: made before the library served, or the driver's own).
fn real_of(h: u64) -> u64 {
    with(|v| v.handles.get(&h).map_or(h, |x| x.real))
}

/// Why a handle stays with the driver, if it does.
fn why_kept(v: &Vmm, h: u64, x: &Handle) -> Option<&'static str> {
    if x.exported {
        return Some("VMM memory exported to another process (cuMemExportToShareableHandle)");
    }
    let whole = v.maps.values().any(|m| m.handle == h && m.offset == 0 && m.size == x.size);
    if !whole {
        return Some("VMM memory not mapped whole (cuMemMap)");
    }
    None
}

/// The copy address of a movable handle: a mapping that covers it whole.
fn whole_at(v: &Vmm, h: u64, size: u64) -> Option<u64> {
    v.maps.iter().find(|(_, m)| m.handle == h && m.offset == 0 && m.size == size).map(|(va, _)| *va)
}

/// The program's handles an offload moves now, as table entries at the
/// address they are copied from (`program` names the handle).
pub fn units(away: bool) -> Vec<(u64, table::Entry)> {
    with(|v| {
        let mut out = Vec::new();
        for (&h, x) in &v.handles {
            if (x.real == 0) != away || why_kept(v, h, x).is_some() {
                continue;
            }
            let Some(va) = whole_at(v, h, x.size) else { continue };
            let ctx = v.maps.get(&va).map_or(0, |m| m.ctx);
            out.push((
                va,
                table::Entry {
                    bytes: x.size,
                    size: x.size,
                    device: x.device,
                    ctx,
                    handle: x.real,
                    host: x.host.clone(),
                    sum: x.sum.clone(),
                    program: h,
                },
            ));
        }
        out
    })
}

/// What the program's own VMM memory is: (movable count, movable bytes,
/// kept (bytes, why) each).
pub fn summary() -> (usize, u64, Vec<(u64, &'static str)>) {
    with(|v| {
        let (mut n, mut bytes, mut kept) = (0, 0, Vec::new());
        for (&h, x) in &v.handles {
            match why_kept(v, h, x) {
                Some(why) => kept.push((x.size, why)),
                None => {
                    n += 1;
                    bytes += x.size;
                }
            }
        }
        (n, bytes, kept)
    })
}

/// Unmaps every mapping of the program's handle `h` and releases its
/// memory (the reservations stay): the first failure's code.
pub fn give_back(h: u64) -> c_int {
    let (real, released, maps) = with(|v| {
        let maps: Vec<(u64, u64)> =
            v.maps.iter().filter(|(_, m)| m.handle == h).map(|(va, m)| (*va, m.size)).collect();
        let x = v.handles.get(&h);
        (x.map_or(0, |x| x.real), x.is_some_and(|x| x.released), maps)
    });
    let mut rc = cu::SUCCESS;
    for (va, size) in maps {
        // SAFETY: a mapping the program made and the library tracks.
        let r = unsafe { cu::unmap(va, size as usize) };
        if rc == cu::SUCCESS {
            rc = r;
        }
    }
    if real != 0 && !released {
        // SAFETY: the driver's handle of it; its mappings are gone.
        let r = unsafe { cu::release(real) };
        if rc == cu::SUCCESS {
            rc = r;
        }
    }
    rc
}

/// New physical memory for the program's handle `h`, with its properties,
/// mapped at each of its addresses with the access it had: the driver's
/// handle, or its answer (nothing left taken).
pub fn take_back(h: u64) -> Result<u64, c_int> {
    let Some((x, maps)) = with(|v| {
        let x = v.handles.get(&h)?.clone();
        let maps: Vec<(u64, Mapping)> =
            v.maps.iter().filter(|(_, m)| m.handle == h).map(|(va, m)| (*va, m.clone())).collect();
        Some((x, maps))
    }) else {
        return Err(cu::NOT_SUPPORTED);
    };
    // SAFETY: the 32 bytes the program passed as a CUmemAllocationProp.
    let prop: cu::AllocationProp = unsafe { std::ptr::read_unaligned(x.prop.as_ptr().cast()) };
    let mut real = 0u64;
    // SAFETY: out-pointer to a local; the program's own properties.
    let rc = unsafe { cu::create(&mut real, x.size as usize, &prop, 0) };
    if rc != cu::SUCCESS {
        return Err(rc);
    }
    let mut done: Vec<(u64, u64)> = Vec::new();
    let undo = |done: &[(u64, u64)], rc: c_int| {
        for &(va, size) in done {
            // SAFETY: a mapping made just above.
            unsafe { cu::unmap(va, size as usize) };
        }
        // SAFETY: the handle made just above.
        unsafe { cu::release(real) };
        Err(rc)
    };
    for (va, m) in &maps {
        // SAFETY: the program's reservation, where this handle was mapped.
        let rc = unsafe { cu::map(*va, m.size as usize, m.offset as usize, real, 0) };
        if rc != cu::SUCCESS {
            return undo(&done, rc);
        }
        done.push((*va, m.size));
        for d in &m.access {
            // SAFETY: the 12 bytes the program passed as a CUmemAccessDesc.
            let desc: cu::AccessDesc = unsafe { std::ptr::read_unaligned(d.as_ptr().cast()) };
            // SAFETY: the range just mapped; one descriptor.
            let rc = unsafe { cu::set_access(*va, m.size as usize, &desc, 1) };
            if rc != cu::SUCCESS {
                return undo(&done, rc);
            }
        }
    }
    if x.released {
        // The program released it while mapped: freed at its last unmap.
        // SAFETY: the handle made above, mapped.
        unsafe { cu::release(real) };
    }
    Ok(real)
}

/// Records where the program's handle `h` is now: `real` (0: away; None:
/// unchanged), and its host copies.
pub fn set(h: u64, real: Option<u64>, host: Option<Vec<usize>>, sum: Option<Vec<[u8; 32]>>) {
    with(|v| {
        if let Some(x) = v.handles.get_mut(&h) {
            if let Some(real) = real {
                x.real = real;
            }
            if let Some(host) = host {
                x.host = host;
            }
            if let Some(sum) = sum {
                x.sum = sum;
            }
        }
    })
}

/// Stores a chunk pinned ahead of time as chunk `k` (of `n`) of the
/// program's handle `h`; false when it has one, or is gone or away.
pub fn set_chunk(h: u64, k: usize, n: usize, p: usize) -> bool {
    with(|v| match v.handles.get_mut(&h) {
        Some(x) if x.real != 0 && x.host.get(k).copied().unwrap_or(0) == 0 => {
            x.host.resize(n.max(x.host.len()), 0);
            x.host[k] = p;
            true
        }
        _ => false,
    })
}

/// `cuMemCreate`: the driver's memory, under a handle of the library's.
///
/// # Safety
/// The driver's contract.
pub unsafe extern "C" fn mem_create(
    handle: *mut u64,
    size: usize,
    prop: *const cu::AllocationProp,
    flags: u64,
) -> c_int {
    if !serving() || handle.is_null() || prop.is_null() {
        // SAFETY: the caller's arguments, passed on.
        return unsafe { cu::create(handle, size, prop, flags) };
    }
    gate::enter();
    let mut real = 0u64;
    // SAFETY: the caller's arguments, with our out-pointer.
    let rc = unsafe { cu::create(&mut real, size, prop, flags) };
    if rc == cu::SUCCESS {
        super::prepin::changed();
        let mut raw = [0u8; 32];
        // SAFETY: `prop` is a readable CUmemAllocationProp (the contract).
        unsafe { std::ptr::copy_nonoverlapping(prop.cast::<u8>(), raw.as_mut_ptr(), 32) };
        // SAFETY: as above.
        let device = unsafe { (*prop).location.id };
        let h = with(|v| {
            let h = v.next;
            v.next += 1;
            let x = Handle {
                real,
                size: size as u64,
                prop: raw,
                device,
                released: false,
                exported: false,
                retained: 0,
                host: Vec::new(),
                sum: Vec::new(),
            };
            v.handles.insert(h, x);
            h
        });
        // SAFETY: checked non-NULL; the caller's contract.
        unsafe { handle.write_unaligned(h) };
    }
    gate::leave();
    rc
}

/// `cuMemRelease`: freed now, or at its last unmap.
pub extern "C" fn mem_release(h: u64) -> c_int {
    gate::enter();
    super::prepin::changed();
    let (real, drop_copies) = with(|v| {
        let mapped = v.maps.values().any(|m| m.handle == h);
        let Some(x) = v.handles.get_mut(&h) else { return (Some(h), None) };
        if x.retained > 0 {
            x.retained -= 1;
            return (None, None);
        }
        if x.released {
            return (None, None);
        }
        let real = x.real;
        if mapped {
            x.released = true;
            return (Some(real), None);
        }
        let x = v.handles.remove(&h);
        (Some(real), x.map(|x| (x.host, x.size)))
    });
    let rc = match real {
        // SAFETY: the driver's handle (or the program's own, not ours).
        Some(r) => unsafe { cu::release(r) },
        None => cu::SUCCESS,
    };
    if let Some((host, size)) = drop_copies {
        super::hostmem::unpin_all(&host, size);
    }
    gate::leave();
    rc
}

/// `cuMemMap`.
pub extern "C" fn mem_map(va: u64, size: usize, offset: usize, h: u64, flags: u64) -> c_int {
    gate::enter();
    // SAFETY: the caller's arguments, the handle translated.
    let rc = unsafe { cu::map(va, size, offset, real_of(h), flags) };
    if rc == cu::SUCCESS && serving() {
        let mut ctx = 0usize;
        // SAFETY: out-pointer to a local.
        unsafe { cu::ctx_get_current(&mut ctx) };
        with(|v| {
            if v.handles.contains_key(&h) {
                let m =
                    Mapping { size: size as u64, offset: offset as u64, handle: h, access: Vec::new(), ctx };
                v.maps.insert(va, m);
            }
        });
    }
    gate::leave();
    rc
}

/// `cuMemUnmap`: the mappings inside the range go; a handle the program
/// released goes with its last mapping.
pub extern "C" fn mem_unmap(va: u64, size: usize) -> c_int {
    gate::enter();
    // SAFETY: the caller's arguments.
    let rc = unsafe { cu::unmap(va, size) };
    if rc == cu::SUCCESS {
        let gone = with(|v| {
            let inside: Vec<u64> = v.maps.range(va..va + size as u64).map(|(a, _)| *a).collect();
            let mut gone = Vec::new();
            for a in inside {
                let Some(m) = v.maps.remove(&a) else { continue };
                let last = !v.maps.values().any(|o| o.handle == m.handle);
                if last && v.handles.get(&m.handle).is_some_and(|x| x.released) {
                    gone.extend(v.handles.remove(&m.handle));
                }
            }
            gone
        });
        for x in gone {
            super::hostmem::unpin_all(&x.host, x.size);
        }
    }
    gate::leave();
    rc
}

/// `cuMemSetAccess`: the descriptors are kept for the mappings in range.
///
/// # Safety
/// `desc` points to `count` descriptors (the driver's contract).
pub unsafe extern "C" fn mem_set_access(
    va: u64,
    size: usize,
    desc: *const cu::AccessDesc,
    count: usize,
) -> c_int {
    gate::enter();
    // SAFETY: the caller's arguments.
    let rc = unsafe { cu::set_access(va, size, desc, count) };
    if rc == cu::SUCCESS && !desc.is_null() && serving() {
        let mut raw = Vec::with_capacity(count);
        for i in 0..count {
            let mut d = [0u8; 12];
            // SAFETY: descriptor i of the `count` the caller passed.
            unsafe { std::ptr::copy_nonoverlapping(desc.add(i).cast::<u8>(), d.as_mut_ptr(), 12) };
            raw.push(d);
        }
        with(|v| {
            for (_, m) in v.maps.range_mut(va..va + size as u64) {
                m.access = raw.clone();
            }
        });
    }
    gate::leave();
    rc
}

/// `cuMemExportToShareableHandle`: another process may map it from now
/// on, so it stays with the driver.
///
/// # Safety
/// The driver's contract.
pub unsafe extern "C" fn mem_export(out: *mut c_void, h: u64, kind: c_int, flags: u64) -> c_int {
    // SAFETY: the caller's arguments, the handle translated.
    let rc = unsafe { cu::export(out, real_of(h), kind, flags) };
    if rc == cu::SUCCESS {
        with(|v| v.handles.get_mut(&h).map(|x| x.exported = true));
    }
    rc
}

/// `cuMemGetAllocationPropertiesFromHandle`.
///
/// # Safety
/// The driver's contract.
pub unsafe extern "C" fn mem_props(prop: *mut cu::AllocationProp, h: u64) -> c_int {
    // SAFETY: the caller's arguments, the handle translated.
    unsafe { cu::props_of(prop, real_of(h)) }
}

/// `cuMemRetainAllocationHandle`: the program's handle of the memory
/// mapped at `va` (one more reference, released by `cuMemRelease`).
///
/// # Safety
/// The driver's contract.
pub unsafe extern "C" fn mem_retain(out: *mut u64, va: *mut c_void) -> c_int {
    if out.is_null() {
        // SAFETY: the caller's arguments.
        return unsafe { cu::retain(out, va) };
    }
    let ours = with(|v| {
        let (&a, m) = v.maps.range(..=(va as u64)).next_back()?;
        if (va as u64) >= a + m.size {
            return None;
        }
        let h = m.handle;
        v.handles.get_mut(&h)?.retained += 1;
        Some(h)
    });
    match ours {
        Some(h) => {
            // SAFETY: checked non-NULL; the caller's contract.
            unsafe { out.write_unaligned(h) };
            cu::SUCCESS
        }
        // SAFETY: the caller's arguments.
        None => unsafe { cu::retain(out, va) },
    }
}
