//! The mapped wake (docs/design/wake.md, "The mapped wake"): the large anonymous
//! regions of an image's CUDA processes (the driver's host copy, nearly all
//! of a model server's image) restored as private mappings of a file that
//! holds their pages, instead of being copied in by the page server.
//!
//! Why: the driver's restore is one CPU-bound thread reading the host copy;
//! a lazy wake copies every byte of it into the process beside that thread,
//! and the copy's CPU time and memory traffic slow it by 20-30 % on some
//! hosts (docs/benchmarks.md, "What slows the driver's restore"). A private
//! mapping of a file in the page cache copies nothing: the driver reads the
//! page cache's own pages, mapped whole as 2 MiB pages where the file's
//! large folios sit at offsets congruent to their addresses. Measured on the
//! H200 (bench/results/078): the driver's restore of 14 GB from such a
//! mapping took 0.81x its time from its own anonymous memory (its release of
//! the host copy is nearly free), 6975 faults (one per 2 MiB); unaligned,
//! 214755 faults (one per 64 KiB) and 1.0x.
//!
//! The map file of an image is built on demand (`gpusnap images map NAME`)
//! from the image's chunks, every chunk checked as it is read, into
//! `STATE/maps/NAME.map` (each region at an offset congruent to its address
//! modulo 2 MiB, written in large pieces so that the page cache holds large
//! folios), with its index `STATE/maps/NAME.json`. A wake uses it when it
//! is there, belongs to this very image (name, creation time, the regions
//! the image's layout gives), and is in the page cache; before CRIU maps
//! it, every byte of it is checked against the image's chunks (hashed where
//! it lies), so that no byte reaches a process unverified. Otherwise, or if
//! any check fails, the wake fills memory as before (a notice says why).
//!
//! Only VMAs that CRIU could restore lazily and whose every page is in the
//! image qualify, of at least [`MIN_REGION`] bytes, in CUDA processes. The
//! driver releases its host copy at the end of its restore, and replaces
//! the mapping with fresh anonymous memory at its next checkpoint (bench/results/079),
//! so the next image of the process refers to no map file.

use crate::chunksrc::Workdir;
use crate::manifest::{io, ImageError, Manifest};
use gpusnap_pages::mapped::FileMap;
use gpusnap_pages::{PageSource, Vma, PE_LAZY, PE_PRESENT, VMA_ANON_PRIVATE};
use serde::{Deserialize, Serialize};
use std::fs;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// The smallest region mapped from the file (`GPUSNAP_MAP_MIN_MIB`).
pub const MIN_REGION: u64 = 64 << 20;
pub const MIN_ENV: &str = "GPUSNAP_MAP_MIN_MIB";
/// `GPUSNAP_MAP=0`: wakes never use a map file.
pub const ENABLE_ENV: &str = "GPUSNAP_MAP";
/// A map file is used only this much of it in the page cache (a cold one
/// would be read by the driver's own faults, one thread; the page server
/// reads a cold image on many).
const RESIDENT_MIN: f64 = 0.9;
const HUGE: u64 = 2 << 20;
const PIECE: u64 = 32 << 20;
const FORMAT: u32 = 1;
const PROT_RW: u32 = 0x3;

thread_local! {
    /// A building thread's piece, reused (not zeroed again for every piece).
    static PIECE_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// One region of a process kept in the map file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Region {
    pub pid: i32,
    /// `pages-N.img`, the process's pages file.
    pub pages: String,
    pub start: u64,
    pub end: u64,
    /// Where `start` is in the map file.
    pub file_off: u64,
    /// The image's pages in the region: (address, length, offset in the
    /// pages file).
    pub runs: Vec<(u64, u64, u64)>,
}

/// `STATE/maps/NAME.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Index {
    pub format: u32,
    pub image: String,
    pub created_ms: i64,
    pub root_pid: i32,
    pub size: u64,
    pub regions: Vec<Region>,
}

/// `STATE/maps/NAME.map` and `STATE/maps/NAME.json`.
pub fn paths(state_dir: &Path, name: &str) -> (PathBuf, PathBuf) {
    let d = state_dir.join("maps");
    (d.join(format!("{name}.map")), d.join(format!("{name}.json")))
}

fn min_region() -> u64 {
    std::env::var(MIN_ENV).ok().and_then(|v| v.parse::<u64>().ok()).map(|m| m << 20).unwrap_or(MIN_REGION)
}

/// The regions of image `m` (at `dir`) that a map file holds: in each CUDA
/// process, every anonymous private read-write VMA of [`MIN_REGION`] bytes
/// or more whose pages are all in the image and lazy (CRIU leaves them to
/// the page server), laid out one after the other, each at an offset
/// congruent to its address modulo 2 MiB.
pub fn plan(dir: &Path, m: &Manifest) -> Result<Vec<Region>, ImageError> {
    let images = dir.join("criu");
    let min = min_region();
    let mut out = Vec::new();
    let mut off = 0u64;
    for p in m.processes.iter().filter(|p| p.cuda) {
        let (pages_id, vmas, runs) = gpusnap_pages::layout(&images, p.pid)
            .map_err(|e| ImageError::Corrupt { name: m.name.clone(), why: e.to_string() })?;
        for v in vmas.iter().filter(|v| v.end - v.start >= min) {
            if !candidate(v) {
                tracing::debug!(
                    pid = p.pid,
                    start = v.start,
                    end = v.end,
                    status = v.status,
                    prot = v.prot,
                    "map: not an anonymous private read-write VMA"
                );
                continue;
            }
            // The image's pages in the VMA (a pagemap entry may run on
            // from the VMA before, or into the next: its part in this one).
            let inside: Vec<_> =
                runs.iter().filter(|r| r.vaddr < v.end && r.vaddr + r.len > v.start).collect();
            let lazy = |r: &&&gpusnap_pages::Run| r.flags & (PE_LAZY | PE_PRESENT) == PE_LAZY | PE_PRESENT;
            if inside.is_empty() || !inside.iter().all(|r| lazy(&r)) {
                let odd: Vec<_> =
                    inside.iter().filter(|r| !lazy(r)).map(|r| (r.vaddr, r.len, r.flags)).collect();
                tracing::debug!(
                    pid = p.pid,
                    start = v.start,
                    end = v.end,
                    ?odd,
                    "map: not every page of the VMA is in the image, lazy"
                );
                continue;
            }
            // Clipped to the VMA, and merged where they follow each other
            // both in memory and in the pages file (CRIU writes entries of
            // at most ~1 MiB: a check by chunk across entries' edges would
            // read each chunk from the store instead of hashing it in place;
            // bench/results/081: 3.0 s for 26.6 GB).
            let mut clipped: Vec<(u64, u64, u64)> = Vec::new();
            for r in &inside {
                let (s, e) = (r.vaddr.max(v.start), (r.vaddr + r.len).min(v.end));
                let at = r.off + (s - r.vaddr);
                match clipped.last_mut() {
                    Some(l) if l.0 + l.1 == s && l.2 + l.1 == at => l.1 += e - s,
                    _ => clipped.push((s, e - s, at)),
                }
            }
            off = off.div_ceil(HUGE) * HUGE + v.start % HUGE;
            out.push(Region {
                pid: p.pid,
                pages: format!("pages-{pages_id}.img"),
                start: v.start,
                end: v.end,
                file_off: off,
                runs: clipped,
            });
            off += v.end - v.start;
        }
    }
    Ok(out)
}

fn candidate(v: &Vma) -> bool {
    v.status & VMA_ANON_PRIVATE != 0 && v.prot & PROT_RW == PROT_RW
}

/// The map file's size: the end of its last region.
fn size_of(regions: &[Region]) -> u64 {
    regions.iter().map(|r| r.file_off + (r.end - r.start)).max().unwrap_or(0)
}

/// What [`build`] made.
#[derive(Debug, Clone, Serialize)]
pub struct Built {
    pub path: String,
    /// Bytes of pages written (the rest of the file is holes).
    pub bytes: u64,
    pub size: u64,
    pub regions: usize,
    pub ms: u64,
}

/// Builds image `name`'s map file from its chunks (each checked as it is
/// read), written under a temporary name and renamed, the index last.
/// `None`: the image has no region to map.
pub fn build(
    state_dir: &Path,
    name: &str,
    dir: &Path,
    m: &Manifest,
    progress: &dyn gpusnap_progress::Progress,
) -> Result<Option<Built>, ImageError> {
    let started = Instant::now();
    if !crate::manifest::valid_name(name) {
        return Err(ImageError::Foreign {
            name: name.into(),
            why: "map files are kept for images of the store (import it first)".into(),
        });
    }
    let regions = plan(dir, m)?;
    if regions.is_empty() {
        return Ok(None);
    }
    let size = size_of(&regions);
    let (map, index) = paths(state_dir, name);
    gpusnap_files::mkdir_private(&state_dir.join("maps")).map_err(io(name, "create STATE/maps"))?;
    let store = gpusnap_chunks::LocalStore::open(state_dir.join("store")).map_err(|e| ImageError::Io {
        name: name.into(),
        op: "open the chunk store".into(),
        err: std::io::Error::other(e.to_string()),
    })?;
    // The pages are read through a wake's work copy (chunksrc), which keeps
    // no log: a temporary directory (0700) beside the logs, removed when the
    // build ends (dropped after `wd`); one a killed build left is pruned
    // with the oldest logs (its name starts with the time, as theirs do).
    let logs = state_dir.join("logs");
    gpusnap_files::mkdir_private(&logs).map_err(io(name, "create a work dir"))?;
    let work = tempfile::Builder::new()
        .prefix(&format!(
            "{:013}-map-{name}-",
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis())
        ))
        .tempdir_in(&logs)
        .map_err(io(name, "create a work dir"))?;
    let wd = Workdir::prepare(name, dir, m, store, None, work.path(), false)?.ok_or_else(|| {
        ImageError::Corrupt { name: name.into(), why: "its pages are not in the store".into() }
    })?;
    let tmp = map.with_extension(format!("map.tmp-{}", std::process::id()));
    // One of a killed gpusnap that had this pid, if any (gc removes them too).
    let _ = fs::remove_file(&tmp);
    let f = gpusnap_files::create_private(&tmp).map_err(io(name, "create the map file"))?;
    f.set_len(size).map_err(io(name, "size the map file"))?;
    // Pieces of at most PIECE bytes, cut at PIECE boundaries of the map
    // file (large, aligned writes: the page cache keeps large folios).
    let mut pieces: Vec<(String, u64, u64, u64)> = Vec::new(); // (pages, off, len, map_off)
    for r in &regions {
        for &(vaddr, len, off) in &r.runs {
            let mut done = 0;
            while done < len {
                let at = r.file_off + (vaddr - r.start) + done;
                let n = (len - done).min(PIECE - at % PIECE);
                pieces.push((r.pages.clone(), off + done, n, at));
                done += n;
            }
        }
    }
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(4).min(8);
    let written = AtomicU64::new(0);
    progress.begin(&format!("map {name}"), pieces.iter().map(|p| p.2).sum());
    let wrote = crate::chunksrc::for_each_on(&pieces, threads, |(pages, off, len, at)| {
        let pf = wd
            .source
            .open(pages)
            .map_err(|e| ImageError::Corrupt { name: name.into(), why: e.to_string() })?;
        PIECE_BUF.with_borrow_mut(|buf| {
            buf.resize(*len as usize, 0);
            pf.read_at(*off, buf).map_err(|e| ImageError::Corrupt {
                name: name.into(),
                why: format!("{pages} at {off:#x}: {e}"),
            })?;
            f.write_all_at(buf, *at).map_err(io(name, "write the map file"))
        })?;
        progress.update(written.fetch_add(*len, Ordering::Relaxed) + len);
        Ok(())
    });
    progress.end();
    let done = wrote.and_then(|()| f.sync_data().map_err(io(name, "write the map file")));
    if let Err(e) = done {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    fs::rename(&tmp, &map).map_err(io(name, "rename the map file"))?;
    let idx = Index {
        format: FORMAT,
        image: name.into(),
        created_ms: m.created_ms,
        root_pid: m.root_pid,
        size,
        regions: regions.clone(),
    };
    let body = serde_json::to_vec_pretty(&idx)
        .map_err(|e| io(name, "write the map index")(std::io::Error::other(e)))?;
    let itmp = index.with_extension(format!("json.tmp-{}", std::process::id()));
    gpusnap_files::write_private(&itmp, &body).map_err(io(name, "write the map index"))?;
    fs::rename(&itmp, &index).map_err(io(name, "write the map index"))?;
    Ok(Some(Built {
        path: map.display().to_string(),
        bytes: regions.iter().flat_map(|r| r.runs.iter().map(|x| x.1)).sum(),
        size,
        regions: regions.len(),
        ms: started.elapsed().as_millis() as u64,
    }))
}

/// The size of image `name`'s map file when it has one whose index names
/// this image (`m`: the same creation time and root pid), else None. Its
/// layout, bytes and page-cache share are a wake's to check.
pub fn present(state_dir: &Path, name: &str, m: &Manifest) -> Option<u64> {
    if !crate::manifest::valid_name(name) {
        return None;
    }
    let (map, index) = paths(state_dir, name);
    let idx: Index = serde_json::from_slice(&fs::read(index).ok()?).ok()?;
    let len = fs::metadata(map).ok()?.len();
    (idx.names(name, m) && idx.size == len).then_some(len)
}

impl Index {
    /// The index names image `name` as `m` describes it (not another image
    /// hibernated under that name since).
    fn names(&self, name: &str, m: &Manifest) -> bool {
        self.format == FORMAT
            && self.image == name
            && self.created_ms == m.created_ms
            && self.root_pid == m.root_pid
    }
}

/// Removes image `name`'s map file and index, if there are (nothing for a
/// name that is a path: such an image has no map file).
pub fn remove(state_dir: &Path, name: &str) {
    if !crate::manifest::valid_name(name) {
        return;
    }
    let (map, index) = paths(state_dir, name);
    // The index first: a map file without one is never used.
    let _ = fs::remove_file(index);
    let _ = fs::remove_file(map);
}

/// Removes what `STATE/maps` holds for no image of the store (`names`): the
/// map files and indexes of images removed otherwise than by `images rm`,
/// and the temporary files of a build that was killed (a running build's
/// are left, as the image store's are).
pub fn gc(state_dir: &Path, names: &[String]) -> Vec<crate::image::Stale> {
    let mut out = Vec::new();
    let Ok(rd) = fs::read_dir(state_dir.join("maps")) else { return out };
    for e in rd.filter_map(|e| e.ok()) {
        let Some(f) = e.file_name().to_str().map(str::to_string) else { continue };
        let owner = f.strip_suffix(".map").or_else(|| f.strip_suffix(".json"));
        if owner.is_some_and(|n| names.iter().any(|x| x == n))
            || crate::image::temp_pid(&f).is_some_and(crate::image::gpusnap_alive)
        {
            continue;
        }
        let Ok(md) = e.metadata() else { continue };
        if !md.is_file() {
            continue;
        }
        if fs::remove_file(e.path()).is_ok() {
            out.push(crate::image::Stale { path: e.path(), bytes: md.len() });
        }
    }
    out
}

/// The share of the mapped file in the page cache, nothing faulted in.
///
/// cachestat(2) (Linux 6.5) counts it in one call, a large folio at a time.
/// Where the kernel lacks it, mincore(2) of one page in every 2 MiB: a full
/// mincore looks every 4 KiB page up in the page cache on one thread, ~0.5 s
/// for 26 GB (73-95 ms for 4 GiB on the CPU machine, `bench_mapcheck`),
/// as long as the check of its bytes on every core; and the share is only
/// the choice between a warm map and a cold one.
fn resident(f: &fs::File, m: &memmap2::Mmap) -> std::io::Result<f64> {
    if m.is_empty() {
        return Ok(1.0);
    }
    match cachestat(f, m.len() as u64) {
        Ok(cached) => return Ok(cached as f64 / (m.len() as u64).div_ceil(gpusnap_pages::sys::PAGE) as f64),
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOSYS | libc::EPERM | libc::EOPNOTSUPP)) => {}
        Err(e) => return Err(e),
    }
    resident_sampled(m)
}

/// Pages of `f`'s first `len` bytes in the page cache (cachestat(2)).
fn cachestat(f: &fs::File, len: u64) -> std::io::Result<u64> {
    // Written by hand: neither libc (its x86_64 glibc module lacks
    // SYS_cachestat) nor nix wraps it; the number is 451 on every
    // architecture (the unified syscall table since Linux 5.1).
    const SYS_CACHESTAT: libc::c_long = 451;
    #[repr(C)]
    struct Range {
        off: u64,
        len: u64,
    }
    #[repr(C)]
    #[derive(Default)]
    struct Stat {
        nr_cache: u64,
        nr_dirty: u64,
        nr_writeback: u64,
        nr_evicted: u64,
        nr_recently_evicted: u64,
    }
    let range = Range { off: 0, len };
    let mut st = Stat::default();
    // SAFETY: cachestat(fd, range, out, flags) reads `range` and writes one
    // `struct cachestat` to `st`; both are live, #[repr(C)] copies of the
    // kernel's structs (include/uapi/linux/mman.h), and the fd is open.
    let r = unsafe {
        libc::syscall(SYS_CACHESTAT, f.as_raw_fd(), &range as *const Range, &mut st as *mut Stat, 0u32)
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st.nr_cache)
}

/// The share of one page in every 2 MiB of `m` found in the page cache.
fn resident_sampled(m: &memmap2::Mmap) -> std::io::Result<f64> {
    let (mut seen, mut warm) = (0u64, 0u64);
    let mut v = [0u8; 1];
    for at in (0..m.len()).step_by(HUGE as usize) {
        // SAFETY: `m` is a live, page-aligned mapping of `m.len()` bytes and
        // `at` a multiple of 2 MiB inside it, so one page from there is in
        // it; `v` has the one byte mincore writes for it.
        let r = unsafe { libc::mincore(m.as_ptr().add(at) as *mut libc::c_void, 1, v.as_mut_ptr()) };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        seen += 1;
        warm += u64::from(v[0] & 1);
    }
    Ok(warm as f64 / seen as f64)
}

/// What a mapped wake mapped.
#[derive(Debug, Clone, Default)]
pub struct Mapped {
    pub bytes: u64,
    /// The check of the map file against the image's chunks: its page
    /// cache share, the hash of its bytes, its mapping made and removed.
    pub check_ms: u64,
    /// The hash of its bytes alone.
    pub hash_ms: u64,
    /// The map file as checked: CRIU opens it through this descriptor
    /// (`/proc/PID/fd/N`), which must stay open until its restore is done.
    pub file: Option<std::sync::Arc<fs::File>>,
}

/// Prepares a lazy wake of image `name` from chunks (`wd`) to map its
/// regions from its map file: the index read and matched to the image, the
/// file found in the page cache, every byte of it checked against the
/// chunks, then CRIU's images in the work dir changed to map it. `Ok(None)`
/// when there is no usable map file (the wake fills memory as before);
/// `Err`: why a map file that is there could not be used (said as a notice,
/// and the wake fills memory as before).
pub fn for_wake(
    state_dir: &Path,
    name: &str,
    dir: &Path,
    m: &Manifest,
    wd: &Workdir,
) -> Result<Option<Mapped>, String> {
    if !crate::manifest::valid_name(name) || std::env::var(ENABLE_ENV).is_ok_and(|v| v == "0") {
        return Ok(None);
    }
    let (map, index) = paths(state_dir, name);
    if !index.exists() {
        return Ok(None);
    }
    // Read by name in STATE/maps held by descriptor (neither followed if a
    // link, nor taken if another user could write it).
    let maps =
        gpusnap_files::PrivateDir::open(state_dir, "maps").map_err(|e| format!("its map file: {e}"))?;
    let name_of = |p: &Path| p.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_string();
    let body = maps
        .open_file(&name_of(&index))
        .and_then(|f| gpusnap_files::read_bounded(f, 64 << 20))
        .map_err(|e| format!("its map index: {e}"))?;
    let idx: Index =
        serde_json::from_slice(&body).map_err(|e| format!("its map index is not readable: {e}"))?;
    if !idx.names(name, m) {
        return Err(
            "its map file belongs to another image of that name (rebuild it: gpusnap images map)".into()
        );
    }
    let regions = plan(dir, m).map_err(|e| e.to_string())?;
    if regions != idx.regions || idx.size != size_of(&regions) {
        return Err("its map file does not match the image's layout (rebuild it: gpusnap images map)".into());
    }
    let started = Instant::now();
    // What is checked is what CRIU maps: it is given this very
    // descriptor's path, not the file's name a user could swap.
    let f = maps.open_file(&name_of(&map)).map_err(|e| format!("its map file: {e}"))?;
    let len = f.metadata().map_err(|e| format!("its map file: {e}"))?.len();
    if len != idx.size {
        return Err(format!("its map file is {len} bytes, not {}", idx.size));
    }
    // SAFETY: a read-only mapping of a root-only file that no one writes
    // while the wake runs; its bytes are hashed and compared only, never
    // handed on. (The kernel places a file mapping this large at a 2 MiB
    // boundary, so the page cache's large folios are mapped whole: on the
    // H200 a 2 MiB-aligned mapping of our own hashed 62.6 GB/s against
    // 59.8 through this one, `bench_mapcheck`, bench/results/081.)
    let mm = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| format!("its map file: {e}"))?;
    let warm = resident(&f, &mm).map_err(|e| format!("its map file: {e}"))?;
    if warm < RESIDENT_MIN {
        return Err(format!(
            "its map file is {:.0} % in the page cache (a cold one is read faster by the page server)",
            warm * 100.0
        ));
    }
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(4);
    let mut by_pages: std::collections::BTreeMap<&str, Vec<(u64, u64, u64)>> = Default::default();
    for r in &regions {
        for &(vaddr, len, off) in &r.runs {
            by_pages.entry(r.pages.as_str()).or_default().push((off, len, r.file_off + (vaddr - r.start)));
        }
    }
    let mut bytes = 0;
    let hashed = Instant::now();
    for (pages, runs) in &by_pages {
        bytes += wd.check_mapped(pages, runs, &mm, threads).map_err(|e| e.to_string())?;
    }
    let hash_ms = hashed.elapsed().as_millis() as u64;
    drop(mm);
    let check_ms = started.elapsed().as_millis() as u64;
    let checked = PathBuf::from(format!("/proc/{}/fd/{}", std::process::id(), f.as_raw_fd()));
    let id = gpusnap_pages::mapped::add_reg_file(&wd.images, &checked, len).map_err(|e| e.to_string())?;
    let mut by_pid: std::collections::BTreeMap<i32, Vec<FileMap>> = Default::default();
    for r in &regions {
        by_pid.entry(r.pid).or_default().push(FileMap { start: r.start, end: r.end, file_off: r.file_off });
    }
    for (pid, maps) in &by_pid {
        gpusnap_pages::mapped::map_vmas(&wd.images, *pid, maps, id).map_err(|e| e.to_string())?;
    }
    Ok(Some(Mapped { bytes, check_ms, hash_ms, file: Some(std::sync::Arc::new(f)) }))
}

/// The first of `pids` that maps a map file of `state_dir` (a path under
/// `STATE/maps/`), and that file. The driver's checkpoint replaces the host
/// copy it restored from one with fresh anonymous memory (bench/results/078); a
/// mapping that outlives it is the process's own memory, and an image of it
/// would need the file.
pub fn still_mapped(state_dir: &Path, pids: &[i32]) -> Option<(i32, String)> {
    let dir = fs::canonicalize(state_dir.join("maps")).ok()?;
    let prefix = format!("{}/", dir.display());
    for &pid in pids {
        let Ok(maps) = fs::read_to_string(format!("/proc/{pid}/maps")) else { continue };
        for line in maps.lines() {
            // Address, perms, offset, dev, inode, then the path.
            if let Some(path) = line.split_whitespace().nth(5) {
                if path.starts_with(&prefix) && path.ends_with(".map") {
                    return Some((pid, path.to_string()));
                }
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// gc leaves a running build's temporary files (this process's here)
    /// and removes a dead one's and a map no image owns.
    #[test]
    fn gc_spares_a_running_builds_temporaries() {
        let dir = tempfile::tempdir().unwrap();
        let maps = dir.path().join("maps");
        fs::create_dir(&maps).unwrap();
        let me = std::process::id();
        for f in [format!("a.map.tmp-{me}"), format!("a.json.tmp-{me}"), "b.map.tmp-1".into(), "c.map".into()]
        {
            fs::write(maps.join(f), b"x").unwrap();
        }
        let gone: Vec<_> = gc(dir.path(), &[]).into_iter().map(|s| s.path).collect();
        let mut left: Vec<String> =
            fs::read_dir(&maps).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        left.sort();
        assert_eq!(left, [format!("a.json.tmp-{me}"), format!("a.map.tmp-{me}")], "{gone:?}");
    }

    /// cachestat and the sampled mincore agree: a file just written and
    /// flushed is in the page cache, and out of it once dropped.
    #[test]
    fn resident_share_of_warm_and_dropped_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.map");
        let mut f = fs::File::create(&path).unwrap();
        let piece: Vec<u8> = (0..PIECE).map(|i| (i * 31 % 251) as u8).collect();
        for _ in 0..4 {
            f.write_all(&piece).unwrap();
        }
        f.sync_all().unwrap();
        let f = fs::File::open(&path).unwrap();
        // SAFETY: a read-only mapping of the test's own file.
        let m = unsafe { memmap2::Mmap::map(&f) }.unwrap();
        let all = resident(&f, &m).unwrap();
        let sampled = resident_sampled(&m).unwrap();
        assert!(all > 0.99 && sampled > 0.99, "warm: {all} {sampled}");
        if let Ok(n) = cachestat(&f, m.len() as u64) {
            assert_eq!(n, m.len() as u64 / gpusnap_pages::sys::PAGE);
        }
        // SAFETY: fadvise on the test's open, flushed file.
        let r = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        assert_eq!(r, 0);
        let all = resident(&f, &m).unwrap();
        let sampled = resident_sampled(&m).unwrap();
        assert!(all < RESIDENT_MIN && sampled < RESIDENT_MIN, "dropped: {all} {sampled}");
    }
}
