//! CRIU's image files, read with prost over CRIU's own schemas.
//!
//! Framing (criu/image.c, criu/protobuf.c, criu/include/magic.h): a file
//! starts with IMG_COMMON_MAGIC and the file's own magic (two u32, native
//! endian); then entries, each a u32 length and that many bytes of protobuf.
//! `pages-N.img` is raw: no header, the pages back to back.

use crate::PagesError;
use prost::Message;
use std::path::Path;

#[allow(clippy::all, dead_code, non_camel_case_types)]
pub mod pb {
    include!(concat!(env!("OUT_DIR"), "/_.rs"));
}

pub(crate) const IMG_COMMON_MAGIC: u32 = 0x5456_4319;
/// Service files (stats, irmap-cache) start with this instead.
pub(crate) const IMG_SERVICE_MAGIC: u32 = 0x5510_5940;
pub(crate) const PAGEMAP_MAGIC: u32 = 0x5608_4025;
pub(crate) const MM_MAGIC: u32 = 0x5749_2820;

/// criu/include/pagemap.h
pub const PE_PARENT: u32 = 1 << 0;
pub const PE_LAZY: u32 = 1 << 1;
pub const PE_PRESENT: u32 = 1 << 2;

/// criu/include/image.h: a VMA's `status` bits.
pub const VMA_AREA_REGULAR: u32 = 1 << 0;
pub const VMA_FILE_PRIVATE: u32 = 1 << 6;
pub const VMA_ANON_PRIVATE: u32 = 1 << 9;

/// A run of pages a process gets from the page server: `[start, end)` of
/// its address space, read from `off` in its pages file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Iov {
    pub start: u64,
    pub end: u64,
    pub off: u64,
}

impl Iov {
    pub fn len(&self) -> u64 {
        self.end - self.start
    }
    pub fn is_empty(&self) -> bool {
        self.end <= self.start
    }
}

fn entries(path: &Path, magic: u32) -> Result<Vec<Vec<u8>>, PagesError> {
    entries_after(path, IMG_COMMON_MAGIC, magic)
}

/// The entries of a CRIU image file whose head is `head` then `magic`.
pub(crate) fn entries_after(path: &Path, head: u32, magic: u32) -> Result<Vec<Vec<u8>>, PagesError> {
    let bad = |why: &str| PagesError::Image { path: path.display().to_string(), why: why.to_string() };
    let data = std::fs::read(path).map_err(|e| bad(&e.to_string()))?;
    let u32_at = |i: usize| data.get(i..i + 4).map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
    if u32_at(0) != Some(head) || u32_at(4) != Some(magic) {
        return Err(bad("not the CRIU image it should be (magic)"));
    }
    let mut out = Vec::new();
    let mut i = 8;
    while i < data.len() {
        let n = u32_at(i).ok_or_else(|| bad("truncated entry length"))? as usize;
        let body = data.get(i + 4..i + 4 + n).ok_or_else(|| bad("truncated entry"))?;
        out.push(body.to_vec());
        i += 4 + n;
    }
    Ok(out)
}

/// The id of process `pid`'s pages file and its pagemap entries, each with
/// its offset in that file (the running sum of the present entries before
/// it), as both the page server and the sparse pages files of a wake from
/// chunks read them.
fn pagemap(images: &Path, pid: i32) -> Result<(u32, Vec<Run>), PagesError> {
    let pm_path = images.join(format!("pagemap-{pid}.img"));
    let bad = |why: String| PagesError::Image { path: pm_path.display().to_string(), why };
    let ents = entries(&pm_path, PAGEMAP_MAGIC)?;
    let (head, rest) = ents.split_first().ok_or_else(|| bad("no pagemap head".into()))?;
    let head = pb::PagemapHead::decode(head.as_slice()).map_err(|e| bad(e.to_string()))?;
    let mut out = Vec::with_capacity(rest.len());
    let mut off = 0u64;
    for raw in rest {
        let pe = pb::PagemapEntry::decode(raw.as_slice()).map_err(|e| bad(e.to_string()))?;
        // As CRIU's init_compat_pagemap_entry: old images carry in_parent or
        // no flags at all.
        let flags = match pe.flags {
            _ if pe.in_parent == Some(true) => PE_PARENT,
            Some(f) => f,
            None => PE_PRESENT,
        };
        let nr = pe.nr_pages.unwrap_or(pe.compat_nr_pages as u64);
        let len = nr.checked_mul(crate::sys::PAGE).ok_or_else(|| bad("page count overflows".into()))?;
        pe.vaddr.checked_add(len).ok_or_else(|| bad("address overflows".into()))?;
        out.push(Run { vaddr: pe.vaddr, len, off, flags });
        if flags & PE_PRESENT != 0 {
            off = off.checked_add(len).ok_or_else(|| bad("offset overflows".into()))?;
        }
    }
    Ok((head.pages_id, out))
}

/// The pages of process `pid` that CRIU leaves to the page server, split at
/// VMA boundaries (one UFFDIO_COPY cannot cross a VMA), in address order;
/// and the id of its pages file.
pub fn lazy_iovs(images: &Path, pid: i32) -> Result<(u32, Vec<Iov>), PagesError> {
    let (pages_id, vmas, runs) = layout(images, pid)?;
    let pm_path = images.join(format!("pagemap-{pid}.img"));
    // Lazy pages in a VMA that is a private file mapping are not served: a
    // mapped wake (gpusnap-core's mapfile) turned it into a private mapping
    // of a file that holds them, and CRIU registers no userfaultfd there.
    let mapped =
        |at: u64| vmas.iter().any(|v| at >= v.start && at < v.end && v.status & VMA_FILE_PRIVATE != 0);

    let mut out = Vec::new();
    for r in runs.iter().filter(|r| r.flags & PE_LAZY != 0) {
        if r.flags & PE_PRESENT == 0 {
            // In a parent image or on a remote page server: not ours to serve.
            return Err(PagesError::Image {
                path: pm_path.display().to_string(),
                why: format!("lazy pages at {:#x} are not in this image (flags {:#x})", r.vaddr, r.flags),
            });
        }
        // Split at VMA ends, as criu/uffd.c collect_iovs does.
        let (mut s, e) = (r.vaddr, r.vaddr + r.len);
        while s < e {
            let vma_end = vmas.iter().find(|v| s >= v.start && s < v.end).map(|v| v.end).unwrap_or(e);
            let end = e.min(vma_end);
            if !mapped(s) {
                out.push(Iov { start: s, end, off: r.off + (s - r.vaddr) });
            }
            s = end;
        }
    }
    Ok((pages_id, out))
}

/// Bytes of every process of an image that the page server would serve.
pub fn lazy_bytes(images: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(images) else { return 0 };
    rd.filter_map(|e| e.ok())
        .filter_map(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            n.strip_prefix("pagemap-")?.strip_suffix(".img")?.parse::<i32>().ok()
        })
        .filter_map(|pid| lazy_iovs(images, pid).ok())
        .map(|(_, iovs)| iovs.iter().map(Iov::len).sum::<u64>())
        .sum()
}

/// The byte ranges `(offset, length)` of process `pid`'s pages file that
/// CRIU itself reads during a lazy restore (present and not lazy), and the
/// id of that pages file: what a wake from chunks must put in place before
/// `criu restore --lazy-pages`; the rest is the page server's.
pub fn eager_ranges(images: &Path, pid: i32) -> Result<(u32, Vec<(u64, u64)>), PagesError> {
    let (pages_id, runs) = pagemap(images, pid)?;
    let mut out: Vec<(u64, u64)> = Vec::new();
    for r in runs.iter().filter(|r| r.flags & PE_PRESENT != 0 && r.flags & PE_LAZY == 0) {
        match out.last_mut() {
            Some(last) if last.0 + last.1 == r.off => last.1 += r.len,
            _ => out.push((r.off, r.len)),
        }
    }
    Ok((pages_id, out))
}

/// One VMA of a process as its image records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Vma {
    pub start: u64,
    pub end: u64,
    pub status: u32,
    pub flags: u32,
    pub prot: u32,
    pub madv: u64,
}

/// One entry of a process's pagemap: `len` bytes at `vaddr`, and where they
/// start in its pages file (`off`, meaningful when `PE_PRESENT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    pub vaddr: u64,
    pub len: u64,
    pub off: u64,
    pub flags: u32,
}

/// Process `pid`'s VMAs (in address order), its pagemap entries and the id
/// of its pages file, as its image (`mm-PID.img`, `pagemap-PID.img`) has
/// them.
pub fn layout(images: &Path, pid: i32) -> Result<(u32, Vec<Vma>, Vec<Run>), PagesError> {
    let (pages_id, runs) = pagemap(images, pid)?;
    let mm_path = images.join(format!("mm-{pid}.img"));
    let bad = |why: String| PagesError::Image { path: mm_path.display().to_string(), why };
    let mm = entries(&mm_path, MM_MAGIC)?;
    let mm = pb::MmEntry::decode(mm.first().ok_or_else(|| bad("no mm entry".into()))?.as_slice())
        .map_err(|e| bad(e.to_string()))?;
    let mut vmas: Vec<Vma> = mm
        .vmas
        .iter()
        .map(|v| Vma {
            start: v.start,
            end: v.end,
            status: v.status,
            flags: v.flags,
            prot: v.prot,
            madv: v.madv.unwrap_or(0),
        })
        .collect();
    vmas.sort_by_key(|v| v.start);
    Ok((pages_id, vmas, runs))
}
