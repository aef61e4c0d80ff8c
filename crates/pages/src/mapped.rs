//! A mapped wake's change to CRIU's images: anonymous VMAs restored as
//! private mappings of a file that holds their pages (docs/pages.md,
//! "The mapped wake").
//!
//! What CRIU 4.2 does with such a VMA (criu/proc_parse.c, files-reg.c,
//! mem.c, pie/restorer.c): its `status` is `VMA_AREA_REGULAR |
//! VMA_FILE_PRIVATE` (0x41), its `flags` MAP_PRIVATE without
//! MAP_ANONYMOUS, `shmid` the id of a regular file's entry in `files.img`
//! (`file_entry { type REG, id, reg { id, name "/abs/path", ... } }`, the
//! two ids equal), `pgoff` in bytes. CRIU opens the file itself and maps it
//! at `pgoff`; it registers no userfaultfd there (only anonymous private
//! VMAs can be lazy), and it skips the VMA's lazy pagemap entries, which
//! are therefore left as they are: every later entry keeps its offset in
//! the pages file, and the page server leaves them out
//! ([`crate::lazy_iovs`]).

use crate::image::{entries_after, pb, VMA_AREA_REGULAR, VMA_FILE_PRIVATE};
use crate::PagesError;
use prost::Message;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

const IMG_COMMON_MAGIC: u32 = 0x5456_4319;
const MM_MAGIC: u32 = 0x5749_2820;
const FILES_MAGIC: u32 = 0x5630_3138;
const MAP_PRIVATE: u32 = 0x02;
const MAP_ANONYMOUS: u32 = 0x20;
/// madvise advice kept on a VMA that becomes a file mapping: MADV_DONTFORK
/// and MADV_DONTDUMP. Others are dropped: the kernel refuses some of them
/// on a file mapping (MADV_WIPEONFORK), and CRIU's restore fails on any
/// advice refused.
const MADV_KEPT: u64 = (1 << 10) | (1 << 16);

/// One VMA to map from the file: `[start, end)` of the process, from
/// `file_off` in the file (congruent to `start` modulo 2 MiB, so that the
/// page cache's large folios can be mapped whole).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileMap {
    pub start: u64,
    pub end: u64,
    pub file_off: u64,
}

fn bad(path: &Path, why: impl ToString) -> PagesError {
    PagesError::Image { path: path.display().to_string(), why: why.to_string() }
}

/// Writes a CRIU image file: the two magics, then each entry (a u32 length
/// and its bytes), to a temporary name renamed over `path`.
fn write_image(path: &Path, magic: u32, entries: &[Vec<u8>]) -> Result<(), PagesError> {
    let mut out = Vec::with_capacity(8 + entries.iter().map(|e| e.len() + 4).sum::<usize>());
    out.extend_from_slice(&IMG_COMMON_MAGIC.to_ne_bytes());
    out.extend_from_slice(&magic.to_ne_bytes());
    for e in entries {
        let n = u32::try_from(e.len()).map_err(|_| bad(path, "entry too large"))?;
        out.extend_from_slice(&n.to_ne_bytes());
        out.extend_from_slice(e);
    }
    let tmp = path.with_extension("img.tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| bad(&tmp, e))?;
    f.write_all(&out).map_err(|e| bad(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| bad(path, e))
}

/// Adds a regular file's entry to `images/files.img` (opened read-only,
/// `size` checked by CRIU when it opens it) and returns its id, one above
/// every id there. `file` must be an absolute path.
pub fn add_reg_file(images: &Path, file: &Path, size: u64) -> Result<u32, PagesError> {
    let path = images.join("files.img");
    let name =
        file.to_str().filter(|n| n.starts_with('/')).ok_or_else(|| bad(file, "not an absolute path"))?;
    let mut raw = entries_after(&path, IMG_COMMON_MAGIC, FILES_MAGIC)?;
    let mut top = 0u32;
    for e in &raw {
        let fe = pb::FileEntry::decode(e.as_slice()).map_err(|e| bad(&path, e))?;
        top = top.max(fe.id);
    }
    let id = top.checked_add(1).ok_or_else(|| bad(&path, "no free file id"))?;
    let reg = pb::RegFileEntry {
        id,
        flags: 0, // O_RDONLY: a private mapping writes nothing back
        pos: 0,
        fown: pb::FownEntry { uid: 0, euid: 0, signum: 0, pid_type: 0, pid: 0 },
        name: name.to_string(),
        size: Some(size),
        ..Default::default()
    };
    let fe = pb::FileEntry { r#type: pb::FdTypes::Reg as i32, id, reg: Some(reg) };
    raw.push(fe.encode_to_vec());
    write_image(&path, FILES_MAGIC, &raw)?;
    Ok(id)
}

/// Turns process `pid`'s VMAs named in `maps` (each exactly one anonymous
/// private VMA of `images/mm-PID.img`) into private mappings of file
/// `file_id` (see [`add_reg_file`]).
pub fn map_vmas(images: &Path, pid: i32, maps: &[FileMap], file_id: u32) -> Result<(), PagesError> {
    let path = images.join(format!("mm-{pid}.img"));
    let raw = entries_after(&path, IMG_COMMON_MAGIC, MM_MAGIC)?;
    let (first, rest) = raw.split_first().ok_or_else(|| bad(&path, "no mm entry"))?;
    let mut mm = pb::MmEntry::decode(first.as_slice()).map_err(|e| bad(&path, e))?;
    for m in maps {
        if m.file_off % crate::sys::PAGE != 0 {
            return Err(bad(&path, format!("file offset {:#x} is not page-aligned", m.file_off)));
        }
        let v = mm
            .vmas
            .iter_mut()
            .find(|v| v.start == m.start && v.end == m.end)
            .ok_or_else(|| bad(&path, format!("no VMA {:#x}-{:#x}", m.start, m.end)))?;
        if v.flags & (MAP_ANONYMOUS | MAP_PRIVATE) != MAP_ANONYMOUS | MAP_PRIVATE {
            return Err(bad(&path, format!("VMA {:#x}-{:#x} is not anonymous private", m.start, m.end)));
        }
        v.status = VMA_AREA_REGULAR | VMA_FILE_PRIVATE;
        v.flags &= !MAP_ANONYMOUS;
        v.shmid = u64::from(file_id);
        v.pgoff = m.file_off;
        v.fd = -1;
        v.fdflags = Some(0);
        v.madv = v.madv.map(|a| a & MADV_KEPT);
    }
    let mut out = vec![mm.encode_to_vec()];
    out.extend(rest.iter().cloned());
    write_image(&path, MM_MAGIC, &out)
}
