//! The driver's virtual memory management API as the fake models it
//! (`cuMemAddressReserve`, `cuMemCreate`, `cuMemMap`, ...), measured on an
//! H200 with driver 580.159 (`docs/design/driver.md`): a reservation holds
//! no memory and survives a checkpoint and restore; physical memory counts
//! from `cuMemCreate` until it is released and unmapped, mapped or not; the
//! driver's checkpoint copies mapped memory like any other. The fake maps
//! whole physical allocations only (offset 0, their full size), which is
//! all gpusnap's preload library does.

use serde::{Deserialize, Serialize};

use crate::codes::*;
use crate::config::Config;
use crate::state::{Alloc, Proc, State, PTR_ALIGN};

/// The allocation granularity (`cuMemGetAllocationGranularity`): 2 MiB, as
/// on the H200.
pub const GRANULARITY: u64 = PTR_ALIGN;

/// One physical allocation (`cuMemCreate`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Phys {
    pub gpu: u32,
    pub bytes: u64,
    /// Where it is mapped, if anywhere.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mapped_at: Option<u64>,
    /// Released while mapped: freed at its unmap, as the driver does.
    #[serde(default)]
    pub released: bool,
}

impl Proc {
    /// Device memory bytes (on `gpu`, or all): `cuMemAlloc`'s allocations
    /// and physical allocations, mapped or not.
    pub fn memory_bytes(&self, gpu: Option<u32>) -> u64 {
        let on = |g: u32| gpu.is_none_or(|want| want == g);
        let plain: u64 =
            self.allocs.values().filter(|a| a.handle.is_none() && on(a.gpu)).map(|a| a.bytes).sum();
        let phys: u64 = self.handles.values().filter(|h| on(h.gpu)).map(|h| h.bytes).sum();
        plain + phys
    }

    /// Whether it holds device memory on `gpu`.
    pub fn holds_on(&self, gpu: u32) -> bool {
        self.allocs.values().any(|a| a.gpu == gpu) || self.handles.values().any(|h| h.gpu == gpu)
    }

    fn overlaps(&self, addr: u64, size: u64) -> bool {
        let end = addr + size;
        let reserved = self.reservations.range(..end).next_back().is_some_and(|(&a, &s)| a + s > addr);
        let plain = self
            .allocs
            .range(..end)
            .next_back()
            .is_some_and(|(&a, al)| al.handle.is_none() && a + al.bytes > addr);
        reserved || plain
    }

    /// `cuMemAddressReserve`: `size` bytes at `hint` when that range is free,
    /// else at a fresh address.
    pub fn reserve(&mut self, size: u64, hint: u64) -> Result<u64, CuResult> {
        if size == 0 || !size.is_multiple_of(GRANULARITY) || !hint.is_multiple_of(GRANULARITY) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let addr = if hint != 0 && !self.overlaps(hint, size) {
            hint
        } else {
            let a = self.next_ptr.div_ceil(GRANULARITY) * GRANULARITY;
            self.next_ptr = a + size;
            a
        };
        self.reservations.insert(addr, size);
        Ok(addr)
    }

    /// `cuMemAddressFree`: a whole reservation with nothing mapped in it.
    pub fn address_free(&mut self, addr: u64, size: u64) -> Result<(), CuResult> {
        if self.reservations.get(&addr) != Some(&size) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if self.allocs.range(addr..addr + size).any(|(_, a)| a.handle.is_some()) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        self.reservations.remove(&addr);
        Ok(())
    }

    /// `cuMemMap` of the whole of `handle` at `addr`, inside a reservation.
    pub fn map(&mut self, addr: u64, size: u64, offset: u64, handle: u64) -> Result<(), CuResult> {
        let h = self.handles.get(&handle).copied().ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if offset != 0 || size != h.bytes || h.mapped_at.is_some() || h.released {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let inside =
            self.reservations.range(..=addr).next_back().is_some_and(|(&a, &s)| addr + size <= a + s);
        let taken = self.allocs.range(..addr + size).next_back().is_some_and(|(&a, al)| a + al.bytes > addr);
        if !inside || taken {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        self.allocs.insert(addr, Alloc { gpu: h.gpu, bytes: size, handle: Some(handle) });
        if let Some(h) = self.handles.get_mut(&handle) {
            h.mapped_at = Some(addr);
        }
        Ok(())
    }

    /// `cuMemUnmap` of a whole mapping; a released handle is freed with it.
    pub fn unmap(&mut self, addr: u64, size: u64) -> Result<(), CuResult> {
        let a = self.allocs.get(&addr).copied().ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let handle = a.handle.ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if a.bytes != size {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        self.allocs.remove(&addr);
        let released = self.handles.get(&handle).is_some_and(|h| h.released);
        if released {
            self.handles.remove(&handle);
        } else if let Some(h) = self.handles.get_mut(&handle) {
            h.mapped_at = None;
        }
        Ok(())
    }

    /// `cuMemRelease`: freed now, or at its unmap when it is mapped.
    pub fn release(&mut self, handle: u64) -> Result<(), CuResult> {
        let h = self.handles.get_mut(&handle).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if h.released {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if h.mapped_at.is_some() {
            h.released = true;
        } else {
            self.handles.remove(&handle);
        }
        Ok(())
    }

    /// Whether `[addr, addr + size)` is mapped memory (for `cuMemSetAccess`).
    pub fn is_mapped(&self, addr: u64, size: u64) -> bool {
        self.allocs
            .range(..=addr)
            .next_back()
            .is_some_and(|(&a, al)| al.handle.is_some() && addr + size <= a + al.bytes)
    }
}

impl State {
    /// `cuMemCreate` of `bytes` on `gpu` by `pid`: the handle.
    pub fn create(&mut self, cfg: &Config, pid: i32, gpu: u32, bytes: u64) -> Result<u64, CuResult> {
        if bytes == 0 || !bytes.is_multiple_of(GRANULARITY) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if gpu as usize >= cfg.gpus.len() {
            return Err(CUDA_ERROR_INVALID_DEVICE);
        }
        if self.free_bytes(cfg, gpu) < bytes {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        let p = self.procs.get_mut(&pid).ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        let handle = p.handles.keys().next_back().map_or(1, |h| h + 1);
        p.handles.insert(handle, Phys { gpu, bytes, mapped_at: None, released: false });
        Ok(handle)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::GpuConfig;
    use crate::MIB;

    fn setup(total_mib: u64) -> (Config, State) {
        let mut cfg = Config {
            gpus: vec![GpuConfig { total_mib, ..GpuConfig::default() }],
            context_mib: 10,
            ..Config::default()
        };
        cfg.normalize();
        let mut st = State::default();
        st.create_context(&cfg, 7, 1, 0).unwrap();
        (cfg, st)
    }

    #[test]
    fn unmapped_and_released_memory_leaves_the_footprint_and_the_reservation_stays() {
        let (cfg, mut st) = setup(1000);
        let size = 64 * MIB;
        let va = st.procs.get_mut(&7).unwrap().reserve(size, 0).unwrap();
        let h = st.create(&cfg, 7, 0, size).unwrap();
        let p = st.procs.get_mut(&7).unwrap();
        p.map(va, size, 0, h).unwrap();
        assert!(p.is_mapped(va, size));
        assert_eq!(p.footprint(10 * MIB), 74 * MIB);
        p.unmap(va, size).unwrap();
        assert_eq!(p.footprint(10 * MIB), 74 * MIB, "an unmapped handle still holds memory");
        p.release(h).unwrap();
        assert_eq!(p.footprint(10 * MIB), 10 * MIB);
        assert_eq!(p.reservations.get(&va), Some(&size));
        // The same address again, with new memory.
        let h2 = st.create(&cfg, 7, 0, size).unwrap();
        st.procs.get_mut(&7).unwrap().map(va, size, 0, h2).unwrap();
        assert_eq!(st.used_bytes(&cfg, 0), 74 * MIB);
    }

    #[test]
    fn create_beyond_the_gpu_is_out_of_memory_and_bad_sizes_are_refused() {
        let (cfg, mut st) = setup(100);
        assert_eq!(st.create(&cfg, 7, 0, 128 * MIB), Err(CUDA_ERROR_OUT_OF_MEMORY));
        assert_eq!(st.create(&cfg, 7, 0, MIB), Err(CUDA_ERROR_INVALID_VALUE));
        let p = st.procs.get_mut(&7).unwrap();
        assert_eq!(p.reserve(3 * MIB, 0), Err(CUDA_ERROR_INVALID_VALUE));
        let va = p.reserve(4 * MIB, 0).unwrap();
        assert_eq!(p.map(va, 4 * MIB, 0, 99), Err(CUDA_ERROR_INVALID_VALUE));
        assert_eq!(p.address_free(va, 2 * MIB), Err(CUDA_ERROR_INVALID_VALUE));
        p.address_free(va, 4 * MIB).unwrap();
    }

    #[test]
    fn a_handle_released_while_mapped_is_freed_at_its_unmap() {
        let (cfg, mut st) = setup(1000);
        let va = st.procs.get_mut(&7).unwrap().reserve(2 * MIB, 0).unwrap();
        let h = st.create(&cfg, 7, 0, 2 * MIB).unwrap();
        let p = st.procs.get_mut(&7).unwrap();
        p.map(va, 2 * MIB, 0, h).unwrap();
        p.release(h).unwrap();
        assert_eq!(p.memory_bytes(None), 2 * MIB);
        assert_eq!(p.address_free(va, 2 * MIB), Err(CUDA_ERROR_INVALID_VALUE));
        p.unmap(va, 2 * MIB).unwrap();
        assert_eq!(p.memory_bytes(None), 0);
        assert!(p.handles.is_empty());
    }
}
