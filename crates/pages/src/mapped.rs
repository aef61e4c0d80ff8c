//! A mapped wake's change to CRIU's images: anonymous VMAs restored as
//! private mappings of a file that holds their pages (docs/design/wake.md,
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

use crate::image::{entries_after, pb, IMG_COMMON_MAGIC, MM_MAGIC, VMA_AREA_REGULAR, VMA_FILE_PRIVATE};
use crate::PagesError;
use prost::Message;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::image::{PAGEMAP_MAGIC, PE_LAZY, PE_PRESENT, VMA_ANON_PRIVATE};
    const MB: u64 = 1 << 20;

    fn vma(start: u64, end: u64) -> pb::VmaEntry {
        pb::VmaEntry {
            start,
            end,
            pgoff: 0,
            shmid: 0,
            prot: 3,
            flags: MAP_PRIVATE | MAP_ANONYMOUS,
            status: VMA_AREA_REGULAR | VMA_ANON_PRIVATE,
            fd: -1,
            madv: Some((1 << 18) | (1 << 10)),
            fdflags: None,
        }
    }

    /// A process 7 with two anonymous VMAs (A: 4 MiB, B: 2 MiB after a
    /// gap), every page lazy; files.img with an entry of another kind
    /// (id 5) and a regular file (id 9).
    fn images() -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        let (a, b) = (0x7000_0000u64, 0x7100_0000u64);
        let mm = pb::MmEntry { vmas: vec![vma(a, a + 4 * MB), vma(b, b + 2 * MB)], ..Default::default() };
        write_image(&d.path().join("mm-7.img"), MM_MAGIC, &[mm.encode_to_vec()]).unwrap();
        let lazy = Some(PE_LAZY | PE_PRESENT);
        let pe = |vaddr: u64, len: u64| pb::PagemapEntry {
            vaddr,
            compat_nr_pages: 0,
            in_parent: None,
            flags: lazy,
            nr_pages: Some(len / 4096),
        };
        let pm = [
            pb::PagemapHead { pages_id: 3 }.encode_to_vec(),
            pe(a, MB).encode_to_vec(),
            pe(a + MB, 3 * MB).encode_to_vec(),
            pe(b, 2 * MB).encode_to_vec(),
        ];
        write_image(&d.path().join("pagemap-7.img"), PAGEMAP_MAGIC, &pm).unwrap();
        let fe = |t: pb::FdTypes, id: u32| pb::FileEntry { r#type: t as i32, id, reg: None }.encode_to_vec();
        write_image(
            &d.path().join("files.img"),
            FILES_MAGIC,
            &[fe(pb::FdTypes::Und, 5), fe(pb::FdTypes::Reg, 9)],
        )
        .unwrap();
        d
    }

    #[test]
    fn a_vma_becomes_a_private_mapping_of_a_new_file_entry() {
        let d = images();
        let id = add_reg_file(d.path(), Path::new("/state/maps/x.map"), 6 * MB).unwrap();
        assert_eq!(id, 10);
        let files = entries_after(&d.path().join("files.img"), IMG_COMMON_MAGIC, FILES_MAGIC).unwrap();
        assert_eq!(files.len(), 3);
        let fe = pb::FileEntry::decode(files[2].as_slice()).unwrap();
        let reg = fe.reg.unwrap();
        assert_eq!((fe.r#type, fe.id, reg.id), (pb::FdTypes::Reg as i32, 10, 10));
        assert_eq!(
            (reg.name.as_str(), reg.size, reg.flags, reg.pos),
            ("/state/maps/x.map", Some(6 * MB), 0, 0)
        );
        // The entries before are kept byte for byte.
        assert_eq!(pb::FileEntry::decode(files[0].as_slice()).unwrap().id, 5);

        let a = 0x7000_0000u64;
        map_vmas(d.path(), 7, &[FileMap { start: a, end: a + 4 * MB, file_off: 2 * MB }], id).unwrap();
        let mm = entries_after(&d.path().join("mm-7.img"), IMG_COMMON_MAGIC, MM_MAGIC).unwrap();
        let mm = pb::MmEntry::decode(mm[0].as_slice()).unwrap();
        let v = &mm.vmas[0];
        assert_eq!(v.status, VMA_AREA_REGULAR | VMA_FILE_PRIVATE);
        assert_eq!(v.flags, MAP_PRIVATE);
        assert_eq!((v.shmid, v.pgoff, v.fd, v.fdflags), (10, 2 * MB, -1, Some(0)));
        // MADV_WIPEONFORK dropped (refused on a file mapping), DONTFORK kept.
        assert_eq!(v.madv, Some(1 << 10));
        // The other VMA as it was.
        assert_eq!(mm.vmas[1], vma(0x7100_0000, 0x7100_0000 + 2 * MB));

        // The page server leaves the mapped VMA's lazy pages out; B's are
        // served as before, from the same offset in the pages file.
        let (_, iovs) = crate::lazy_iovs(d.path(), 7).unwrap();
        assert_eq!(iovs.len(), 1);
        assert_eq!((iovs[0].start, iovs[0].len(), iovs[0].off), (0x7100_0000, 2 * MB, 4 * MB));
        assert_eq!(crate::lazy_bytes(d.path()), 2 * MB);
    }

    #[test]
    fn only_an_anonymous_private_vma_named_exactly_is_mapped() {
        let d = images();
        let a = 0x7000_0000u64;
        let e = map_vmas(d.path(), 7, &[FileMap { start: a, end: a + 2 * MB, file_off: 0 }], 10).unwrap_err();
        assert!(e.to_string().contains("no VMA"), "{e}");
        let e =
            map_vmas(d.path(), 7, &[FileMap { start: a, end: a + 4 * MB, file_off: 100 }], 10).unwrap_err();
        assert!(e.to_string().contains("page-aligned"), "{e}");
        map_vmas(d.path(), 7, &[FileMap { start: a, end: a + 4 * MB, file_off: 0 }], 10).unwrap();
        // Now a file mapping: not again.
        let e = map_vmas(d.path(), 7, &[FileMap { start: a, end: a + 4 * MB, file_off: 0 }], 10).unwrap_err();
        assert!(e.to_string().contains("not anonymous private"), "{e}");
        let e = add_reg_file(d.path(), Path::new("relative.map"), 1).unwrap_err();
        assert!(e.to_string().contains("absolute"), "{e}");
    }
}
