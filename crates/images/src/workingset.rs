//! The pages of its own files a tree had in memory when it was dumped, and
//! reading them back ahead of a wake.
//!
//! A cold wake (page cache dropped, a host rebooted, an image pulled onto
//! another host) reads the restored processes' own files back from the disk
//! page by page, as CRIU, the driver's restore and the process touch them:
//! Python, PyTorch's and CUDA's libraries. On the H200 a cold wake of ~49 GB
//! (an image of 0.23 GB) took 1.25 s longer than a warm one (bench/results/040), CRIU
//! 0.4 s and the driver's restore 0.4 s of it, more than the image's own
//! reads explain. So `hibernate` records, per file, the pages its processes
//! had mapped (present in their page tables, `/proc/PID/pagemap`), and a
//! wake asks the kernel to read those back (`POSIX_FADV_WILLNEED`: the reads
//! are queued at once, no thread waits for them) before CRIU starts, as REAP
//! (ASPLOS 2021) prefetches a function's working set (`GPUSNAP_FILE_PAGES=1`,
//! off until measured on the GPU). A hint only: a file gone, replaced
//! (another size, something other than a regular file) or unreadable is
//! skipped, and a warm page cache makes it nearly free.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

/// At most this much of the files is recorded (and so read ahead): the
/// libraries of a PyTorch process hold a few hundred MB of it.
const MAX_BYTES: u64 = 4 << 30;
/// Pages of file mappings looked at, at most (their pagemap entries: 8
/// bytes each, read a window at a time): 64 GiB of mappings, ~0.1 s. A
/// tree mapping more (a model's weights left mapped) has the rest left out.
const MAX_SCAN_PAGES: usize = 16 << 20;
const WINDOW: usize = 1 << 16;
/// Ranges closer than this are recorded as one (a read of the gap costs
/// less than another seek, and the manifest stays small).
const GAP: u64 = 128 << 10;

/// One file's pages that were in memory: byte ranges `[start, end)`,
/// sorted, not touching one another.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FilePages {
    pub path: String,
    /// Its size when recorded: another size at the wake means another file.
    pub size: u64,
    pub ranges: Vec<(u64, u64)>,
}

impl FilePages {
    pub fn bytes(&self) -> u64 {
        self.ranges.iter().map(|(a, b)| b - a).sum()
    }
}

/// The pages of regular files mapped by `pids` and present in their page
/// tables, by file. Best effort: a process or a mapping that cannot be
/// read is left out.
pub fn capture(pids: &[i32]) -> Vec<FilePages> {
    let page = procfs::page_size();
    let mut by_file: BTreeMap<String, (u64, Vec<(u64, u64)>)> = BTreeMap::new();
    let mut scan = MAX_SCAN_PAGES;
    for &pid in pids {
        let Ok(p) = procfs::process::Process::new(pid) else { continue };
        let (Ok(maps), Ok(mut pagemap)) = (p.maps(), p.pagemap()) else { continue };
        for m in maps {
            let procfs::process::MMapPath::Path(path) = &m.pathname else { continue };
            let Some(name) = path.to_str() else { continue };
            if m.inode == 0 || name.ends_with(" (deleted)") || !regular(path) {
                continue;
            }
            let Some(size) = std::fs::metadata(path).ok().map(|md| md.len()) else { continue };
            let (lo, hi) = ((m.address.0 / page) as usize, (m.address.1 / page) as usize);
            let hi = hi.min(lo + scan);
            scan -= hi - lo;
            let entry = by_file.entry(name.to_string()).or_insert((size, Vec::new()));
            for w in (lo..hi).step_by(WINDOW) {
                let Ok(info) = pagemap.get_range_info(w..(w + WINDOW).min(hi)) else { break };
                for (i, pi) in info.iter().enumerate() {
                    let procfs::process::PageInfo::MemoryPage(f) = pi else { continue };
                    if !f.contains(procfs::process::MemoryPageFlags::PRESENT) {
                        continue;
                    }
                    let at = m.offset + (w - lo + i) as u64 * page;
                    if at < size {
                        entry.1.push((at, (at + page).min(size)));
                    }
                }
            }
        }
    }
    let mut out = Vec::new();
    let mut total = 0u64;
    for (path, (size, ranges)) in by_file {
        let mut ranges = merge(ranges, GAP);
        // Keep within the budget: the first files (by path) in full.
        let mut kept = Vec::new();
        for (a, b) in ranges.drain(..) {
            if total >= MAX_BYTES {
                break;
            }
            let b = b.min(a + (MAX_BYTES - total));
            total += b - a;
            kept.push((a, b));
        }
        if !kept.is_empty() {
            out.push(FilePages { path, size, ranges: kept });
        }
    }
    out
}

fn regular(p: &Path) -> bool {
    !(p.starts_with("/dev") || p.starts_with("/proc") || p.starts_with("/sys"))
        && std::fs::metadata(p).is_ok_and(|m| m.is_file())
}

/// Sorted ranges, those overlapping or less than `gap` apart joined.
fn merge(mut r: Vec<(u64, u64)>, gap: u64) -> Vec<(u64, u64)> {
    r.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(r.len());
    for (a, b) in r {
        match out.last_mut() {
            Some(last) if a <= last.1 + gap => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

/// `GPUSNAP_FILE_PAGES=1`: a wake reads the files ahead. Off by default
/// until measured on the GPU (on the CPU machine: within its noise,
/// docs/benchmarks.md); hibernate records the pages either way. A value
/// other than 1 or 0 is said and left.
pub const ENV: &str = "GPUSNAP_FILE_PAGES";

pub fn enabled() -> bool {
    enabled_from(std::env::var(ENV).ok())
}

fn enabled_from(v: Option<String>) -> bool {
    gpusnap_pages::flag_setting(ENV, v, false)
}

/// What a wake asked to be read ahead.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct Prefetched {
    pub files: u64,
    pub bytes: u64,
    /// Files skipped: gone, another size now, or not readable.
    pub skipped: u64,
}

/// Asks the kernel to read `sets` into the page cache; returns once the
/// reads are queued (the kernel reads on while the wake goes on).
pub fn prefetch(sets: &[FilePages]) -> Prefetched {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let mut done = Prefetched::default();
    for s in sets {
        // A hint from the image: only a regular file is opened, never
        // through a link, and never blocking (a FIFO put in its place), so
        // a path that became something else costs nothing.
        let regular = std::fs::symlink_metadata(&s.path).is_ok_and(|m| m.is_file());
        let opened = regular.then(|| {
            std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
                .open(&s.path)
        });
        let Some(Ok(f)) = opened else {
            done.skipped += 1;
            continue;
        };
        if !f.metadata().is_ok_and(|m| m.is_file() && m.len() == s.size) {
            done.skipped += 1;
            continue;
        }
        for &(a, b) in &s.ranges {
            if b <= a || b > s.size {
                continue;
            }
            let advice = nix::fcntl::PosixFadviseAdvice::POSIX_FADV_WILLNEED;
            if nix::fcntl::posix_fadvise(f.as_raw_fd(), a as i64, (b - a) as i64, advice).is_ok() {
                done.bytes += b - a;
            }
        }
        done.files += 1;
    }
    done
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn ranges_join_and_the_setting_takes_1_or_0() {
        assert_eq!(
            merge(vec![(8, 12), (0, 4), (4, 6), (10, 20), (30, 31)], 0),
            vec![(0, 6), (8, 20), (30, 31)]
        );
        assert_eq!(merge(vec![(8, 12), (0, 4), (4, 6), (10, 20), (30, 31)], 2), vec![(0, 20), (30, 31)]);
        assert!(merge(Vec::new(), GAP).is_empty());
        assert!(enabled_from(Some("1".into())));
        assert!(
            !enabled_from(None) && !enabled_from(Some("0".into())) && !enabled_from(Some("maybe".into()))
        );
    }

    #[test]
    fn the_pages_a_process_touched_of_a_mapped_file_are_recorded() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("data.bin");
        let page = procfs::page_size() as usize;
        // Past the first window of pagemap entries read at once (sparse).
        let pages = WINDOW + 64;
        let mut f = std::fs::File::create(&path).unwrap();
        f.write_all(&vec![7u8; 64 * page]).unwrap();
        f.set_len((pages * page) as u64).unwrap();
        drop(f);
        let f = std::fs::File::open(&path).unwrap();
        // SAFETY: a private read-only mapping of a file this test created
        // and no one writes while it is mapped.
        let m = unsafe { memmap2::Mmap::map(&f) }.unwrap();
        // Touch pages 3, 40 and one in the second window (the kernel may
        // map a few neighbours too).
        let far = WINDOW + 5;
        let touched = [m[3 * page], m[40 * page], m[far * page]];
        assert_eq!(touched, [7, 7, 0]);
        let all = capture(&[std::process::id() as i32]);
        let mine = all.iter().find(|s| Path::new(&s.path) == path).expect("the mapped file is recorded");
        assert_eq!(mine.size, (pages * page) as u64);
        let has = |off: usize| mine.ranges.iter().any(|&(a, b)| a <= off as u64 && (off as u64) < b);
        assert!(has(3 * page) && has(40 * page) && has(far * page), "{:?}", mine.ranges);
        assert!(!has(1000 * page), "untouched pages are not recorded: {:?}", mine.ranges);
        assert!(mine.ranges.windows(2).all(|w| w[0].1 < w[1].0));
        drop(m);
        // Read ahead: a file another size now, and one gone, are skipped.
        let other = FilePages { path: path.display().to_string(), size: 1, ranges: vec![(0, 1)] };
        let gone = FilePages { path: "/nonexistent/gpusnap".into(), size: 1, ranges: vec![(0, 1)] };
        let fifo = d.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let fifo = FilePages { path: fifo.display().to_string(), size: 0, ranges: vec![(0, 1)] };
        let link = d.path().join("link");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        let link = FilePages { path: link.display().to_string(), ..mine.clone() };
        let p = prefetch(&[mine.clone(), other, gone, fifo, link]);
        assert_eq!(p, Prefetched { files: 1, bytes: mine.bytes(), skipped: 4 });
        // A device or a kernel file is never recorded.
        assert!(all.iter().all(|s| !s.path.starts_with("/dev") && !s.path.starts_with("/proc")));
    }
}
