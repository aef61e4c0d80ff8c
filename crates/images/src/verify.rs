//! The whole-image verify of a lazy CUDA wake: every chunk checked in the
//! background while CRIU restores the tree and the page server fills its
//! memory, paced beside the driver's restores.

use crate::chunkfile::{map_raw_from_env, ChunkedFile, Shared};
use crate::manifest::ImageError;
use gpusnap_chunks::{ChunkRef, LocalStore};
use gpusnap_pages::PagesFile;
use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// One distinct chunk for the background verify: its file and index, and
/// every (file, canonical index) it marks checked.
pub(crate) type ToCheck = (usize, usize, Vec<(usize, usize)>);

/// The threads of [`Workdir::start_verify`].
/// How the background verify runs: beside the driver's restores it takes
/// half the cores below their priority (the page server's fill checks any
/// chunk it reaches first, so the verify only has to end before the
/// unlocks); before them, every core.
#[derive(Clone, Copy, Debug)]
pub struct VerifyPace {
    pub threads: usize,
    pub nice: i32,
    /// SCHED_IDLE (then `nice` does not apply; `gpusnap_pages::prio`).
    pub idle: bool,
    /// From the top address down, meeting the page server's fill (which
    /// goes up and checks a chunk it reaches first itself) in the middle:
    /// each chunk read for its check once, by one of them, instead of the
    /// verify reading all of them beside the fill. No gain on the H200
    /// (bench/results/035).
    pub downwards: bool,
}

impl VerifyPace {
    pub fn all_cores() -> Self {
        Self { threads: cores().clamp(1, 16), nice: 0, idle: false, downwards: false }
    }
    pub fn beside_the_driver() -> Self {
        Self { threads: (cores() / 2).clamp(2, 8), nice: 10, idle: false, downwards: false }
    }

    /// [`VerifyPace::beside_the_driver`] with `GPUSNAP_VERIFY_THREADS`
    /// (0: no verify beside the driver; what the page server has not
    /// checked by the unlocks is checked then, on every core) and
    /// `GPUSNAP_VERIFY_NICE` applied, so that a GPU run can compare them
    /// (docs/reference/environment.md); a value that is not one is said and left.
    pub fn beside_the_driver_from_env() -> Self {
        Self::beside_the_driver_from(|k| std::env::var(k).ok())
    }

    /// As [`VerifyPace::beside_the_driver_from_env`], reading variables through `get`.
    pub(crate) fn beside_the_driver_from(get: impl Fn(&str) -> Option<String>) -> Self {
        let mut p = Self::beside_the_driver();
        let num = |name: &str, max: i64| -> Option<i64> {
            let v = get(name)?;
            match v.trim().parse::<i64>() {
                Ok(n) if (0..=max).contains(&n) => Some(n),
                _ => {
                    tracing::warn!("{name}={v}: not a number from 0 to {max}; ignored");
                    None
                }
            }
        };
        if let Some(n) = num(VERIFY_THREADS_ENV, 64) {
            p.threads = n as usize;
        }
        if let Some(n) = num(VERIFY_NICE_ENV, 19) {
            p.nice = n as i32;
        }
        for (name, field) in [(VERIFY_IDLE_ENV, &mut p.idle), (VERIFY_DOWN_ENV, &mut p.downwards)] {
            *field = gpusnap_pages::flag_setting(name, get(name), *field);
        }
        p
    }
}

/// Threads of the verify beside a wake's driver restores (see
/// [`VerifyPace::beside_the_driver_from_env`]).
pub const VERIFY_THREADS_ENV: &str = "GPUSNAP_VERIFY_THREADS";
/// Their nice value.
pub const VERIFY_NICE_ENV: &str = "GPUSNAP_VERIFY_NICE";
/// Whether they run as SCHED_IDLE (1) or at their nice value (0, the default).
pub const VERIFY_IDLE_ENV: &str = "GPUSNAP_VERIFY_IDLE";
/// Whether they go from the top address down (1) or up (0, the default).
pub const VERIFY_DOWN_ENV: &str = "GPUSNAP_VERIFY_DOWN";

/// Starts a verify of an image's chunks later, from another thread (the
/// unlocks' gate of a wake whose verify did not run beside the driver):
/// chunks checked meanwhile are skipped.
pub struct VerifyStarter {
    pub(crate) files: Vec<Arc<ChunkedFile>>,
    pub(crate) stop: Arc<AtomicBool>,
}

impl VerifyStarter {
    pub fn start(&self, pace: VerifyPace) -> PendingVerify {
        PendingVerify(spawn_verify(&self.files, self.stop.clone(), pace))
    }
}

pub(crate) fn cores() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(4)
}

pub(crate) fn spawn_verify(files: &[Arc<ChunkedFile>], stop: Arc<AtomicBool>, pace: VerifyPace) -> Verify {
    // Each distinct chunk once, at its first place in address order,
    // with every (file, canonical index) it marks.
    let mut todo: Vec<ToCheck> = Vec::new();
    let mut at: HashMap<&str, usize> = HashMap::new();
    for (fi, f) in files.iter().enumerate() {
        for (i, c) in f.chunks.iter().enumerate() {
            let k = f.canon[i] as usize;
            if k != i {
                continue;
            }
            match at.get(c.blake3.as_str()) {
                Some(&t) => todo[t].2.push((fi, k)),
                None => {
                    at.insert(c.blake3.as_str(), todo.len());
                    todo.push((fi, i, vec![(fi, k)]));
                }
            }
        }
    }
    if pace.downwards {
        todo.reverse();
    }
    let todo = Arc::new(todo);
    let files = Arc::new(files.to_vec());
    let next = Arc::new(AtomicUsize::new(0));
    let failed: Arc<Mutex<Option<(usize, ImageError)>>> = Arc::new(Mutex::new(None));
    let took_ms = Arc::new(AtomicU64::new(0));
    let started = std::time::Instant::now();
    let mut threads = Vec::new();
    for _ in 0..pace.threads.min(todo.len()).max(1) {
        let (todo, files, next, failed, took, stop) =
            (todo.clone(), files.clone(), next.clone(), failed.clone(), took_ms.clone(), stop.clone());
        threads.push(std::thread::spawn(move || {
            if let Err(e) = gpusnap_pages::prio::lower_this_thread(pace.nice, pace.idle) {
                tracing::warn!("verify: cannot lower the threads' priority: {e}");
            }
            let Some(first) = files.first() else { return };
            let shared = first.shared.clone();
            let mut buf = shared.buffer();
            // Chunks a fill thread was loading when this thread came to
            // them: it checks them itself; any it has not by the end are
            // checked then.
            let mut later = Vec::new();
            let check = |j: usize, wait: bool, buf: &mut Vec<u8>| -> bool {
                let (fi, i, marks) = &todo[j];
                let f = &files[*fi];
                let done = || marks.iter().all(|&(g, k)| files[g].checked[k].load(Ordering::Relaxed));
                if done() {
                    return true;
                }
                let Some(_one) = f.load_lock(*i, || wait) else { return false };
                if done() {
                    return true;
                }
                match shared.load(&f.path, &f.chunks[*i], buf, false) {
                    Ok(raw) => {
                        for &(g, k) in marks {
                            files[g].checked[k].store(true, Ordering::Relaxed);
                        }
                        // A fill thread waits for this chunk: what it needs
                        // is decoded already.
                        if !raw && f.wanted[*i].load(Ordering::Relaxed) {
                            f.keep_decoded(*i, std::mem::replace(buf, shared.buffer()));
                        }
                    }
                    Err(e) => {
                        shared.note(&e);
                        if let Ok(mut g) = failed.lock() {
                            if g.as_ref().is_none_or(|(at, _)| j < *at) {
                                *g = Some((j, e));
                            }
                        }
                    }
                }
                true
            };
            let stopped =
                || stop.load(Ordering::Relaxed) || failed.lock().map(|g| g.is_some()).unwrap_or(true);
            loop {
                if stopped() {
                    break;
                }
                let j = next.fetch_add(1, Ordering::Relaxed);
                if j >= todo.len() {
                    break;
                }
                if !check(j, false, &mut buf) {
                    later.push(j);
                }
            }
            for j in later {
                if stopped() {
                    break;
                }
                check(j, true, &mut buf);
            }
            shared.give_back(buf);
            took.fetch_max(started.elapsed().as_millis() as u64, Ordering::Relaxed);
        }));
    }
    let image = files.first().map(|f| f.shared.image.clone()).unwrap_or_default();
    Verify { image, threads, failed, took_ms }
}

/// Waits for the threads of [`spawn_verify`]; the first bad chunk is the error.
pub(crate) fn join_verify(v: Verify) -> Result<VerifyTimes, ImageError> {
    let t = std::time::Instant::now();
    // A thread that panicked left chunks unchecked: never a pass.
    let mut whole = true;
    for h in v.threads {
        whole &= h.join().is_ok();
    }
    let wait_ms = t.elapsed().as_millis() as u64;
    match v.failed.lock().ok().and_then(|mut g| g.take()) {
        Some((_, e)) => Err(e),
        None if !whole => Err(ImageError::Io {
            name: v.image,
            op: "verify chunks".into(),
            err: io::Error::other("a verify thread failed"),
        }),
        None => Ok(VerifyTimes { verify_ms: v.took_ms.load(Ordering::Relaxed), wait_ms }),
    }
}

/// One store-held pages file as the page server reads it while the
/// background verify of a CUDA wake runs over it, for benchmarks: wait on
/// the second (the verify's end) once the reads are done.
#[doc(hidden)]
pub fn bench_file_verifying(
    image: &str,
    path: &str,
    chunks: &[ChunkRef],
    store: LocalStore,
) -> (Arc<dyn PagesFile>, PendingVerify) {
    bench_file_verifying_at(image, path, chunks, store, VerifyPace::all_cores())
}

/// [`bench_file_verifying`] with the verify at `pace`.
#[doc(hidden)]
pub fn bench_file_verifying_at(
    image: &str,
    path: &str,
    chunks: &[ChunkRef],
    store: LocalStore,
    pace: VerifyPace,
) -> (Arc<dyn PagesFile>, PendingVerify) {
    let shared = Shared::new(image, store, None, Arc::new(Mutex::new(None)), map_raw_from_env());
    let f = Arc::new(ChunkedFile::new(path, chunks, shared, false));
    let v = spawn_verify(std::slice::from_ref(&f), Arc::new(AtomicBool::new(false)), pace);
    (f, PendingVerify(v))
}

/// A background verify still running ([`Workdir::take_verify`],
/// [`bench_file_verifying`]).
pub struct PendingVerify(pub(crate) Verify);

impl PendingVerify {
    /// Waits until every chunk was checked; the first bad one is the error.
    pub fn wait(self) -> Result<VerifyTimes, ImageError> {
        join_verify(self.0)
    }
}

/// The whole-image verify of a lazy CUDA wake, run in the background while
/// CRIU restores the tree and the page server fills its memory (see
/// [`Workdir::start_verify`]).
pub(crate) struct Verify {
    pub(crate) image: String,
    pub(crate) threads: Vec<std::thread::JoinHandle<()>>,
    /// The first chunk that failed, by its position in address order.
    pub(crate) failed: Arc<Mutex<Option<(usize, ImageError)>>>,
    /// Ms from the start until the last thread ended.
    pub(crate) took_ms: Arc<AtomicU64>,
}

/// What the background verify took ([`Workdir::wait_verify`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct VerifyTimes {
    /// From its start until every chunk was checked.
    pub verify_ms: u64,
    /// How long the caller waited for it (the rest overlapped the restore).
    pub wait_ms: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chunkfile::*;
    use rand::RngCore;
    use std::fs;
    use std::path::Path;

    /// 8 MiB of random bytes (raw chunks), then 24 MiB of a pattern whose
    /// period divides the largest chunk (compressed chunks that recur),
    /// stored as chunks.
    pub(crate) fn stored(dir: &Path) -> (Vec<u8>, Vec<ChunkRef>) {
        let mut data = vec![0u8; 8 << 20];
        rand::thread_rng().fill_bytes(&mut data);
        data.extend((0..24u32 << 20).map(|i| (i % 256) as u8));
        let store = LocalStore::open(dir.join("store")).unwrap();
        let st = gpusnap_chunks::store_slice(&data, 2, &store, false, &|_| {}).unwrap();
        store.finish(st.staged, false).unwrap();
        (data, st.chunks)
    }

    pub(crate) fn read_all(f: &Arc<dyn PagesFile>, len: usize) -> io::Result<Vec<u8>> {
        let mut out = vec![0u8; len];
        // Odd pieces, so that reads start and end inside chunks.
        for (k, piece) in out.chunks_mut(700_001).enumerate() {
            f.read_at(k as u64 * 700_001, piece)?;
        }
        Ok(out)
    }

    #[test]
    pub(crate) fn chunks_are_given_in_place_only_once_checked() {
        let d = tempfile::tempdir().unwrap();
        let (data, chunks) = stored(d.path());
        let store = || LocalStore::open(d.path().join("store")).unwrap();
        let file = |checked: bool| {
            let shared = Shared::new("img", store(), None, Arc::new(Mutex::new(None)), true);
            ChunkedFile::new("pages-1.img", &chunks, shared, checked)
        };
        let f = file(false);
        let (mut at, mut mapped, mut later) = (0u64, 0, 0);
        for (i, c) in chunks.iter().enumerate() {
            let want = &data[at as usize..(at + c.size) as usize];
            match f.map_at(at, c.size as usize) {
                // A raw chunk, hashed from its mapping: checked from now on.
                Some(m) => {
                    assert_eq!(m.bytes(), want);
                    assert!(f.checked[f.canon[i] as usize].load(Ordering::Relaxed));
                    mapped += 1;
                }
                // A compressed one: read (decoded, checked, kept when it
                // recurs), then in place if it was kept.
                None => {
                    let mut b = vec![0u8; c.size as usize];
                    f.read_at(at, &mut b).unwrap();
                    assert_eq!(b, want);
                    if let Some(m) = f.map_at(at, c.size as usize) {
                        assert_eq!(m.bytes(), want);
                        later += 1;
                    }
                }
            }
            // A piece across two chunks is given up to the first one's end.
            if i + 1 < chunks.len() {
                if let Some(m) = f.map_at(at + c.size - 4096, 8192) {
                    assert_eq!(m.bytes(), &want[want.len() - 4096..]);
                }
            }
            at += c.size;
        }
        assert!(mapped > 0 && later > 0, "raw {mapped}, kept {later}");
        // A raw chunk with a flipped byte is not given in place, and its
        // read fails, unless it was checked before (then it is trusted, as
        // an image directory's pages file is after its verify).
        let c0 = &chunks[0];
        let p = store().path_of(&c0.blake3);
        let mut b = std::fs::read(&p).unwrap();
        b[100] ^= 1;
        std::fs::write(&p, b).unwrap();
        let f = file(false);
        assert!(f.map_at(0, 4096).is_none());
        assert!(f.read_at(0, &mut [0u8; 4096]).is_err());
        assert!(file(true).map_at(0, 4096).is_some());
    }

    #[test]
    pub(crate) fn raw_chunks_are_read_not_mapped_unless_asked() {
        let d = tempfile::tempdir().unwrap();
        let (data, chunks) = stored(d.path());
        let shared = Shared::new(
            "img",
            LocalStore::open(d.path().join("store")).unwrap(),
            None,
            Arc::default(),
            false,
        );
        let f = ChunkedFile::new("pages-1.img", &chunks, shared, false);
        let (mut at, mut raw, mut kept) = (0u64, 0, 0);
        for c in &chunks {
            let want = &data[at as usize..(at + c.size) as usize];
            let mut b = vec![0u8; c.size as usize];
            f.read_at(at, &mut b).unwrap();
            assert_eq!(b, want);
            // Read once: a recurring compressed chunk is kept and given in
            // place from then on; a raw one never is.
            match f.map_at(at, c.size as usize) {
                Some(m) => {
                    assert_eq!(m.bytes(), want);
                    kept += 1;
                }
                None => raw += 1,
            }
            at += c.size;
        }
        assert!(raw > 0 && kept > 0, "raw {raw}, kept {kept}");
        assert_eq!(read_all(&(Arc::new(f) as Arc<dyn PagesFile>), data.len()).unwrap(), data);
        // The setting: 1 or 0, anything else ignored (off).
        assert!(map_raw_from(Some("1".into())));
        assert!(!map_raw_from(Some("0".into())));
        assert!(!map_raw_from(Some("yes please".into())));
        assert!(!map_raw_from(None));
    }

    #[test]
    pub(crate) fn the_recurring_chunks_budget_follows_the_memory_available() {
        const G: u64 = 1 << 30;
        assert_eq!(recurring_budget(70 * G), 70 * G / 8);
        assert_eq!(recurring_budget(500 * G), RECURRING_MAX);
        assert_eq!(recurring_budget(12 * G), RECURRING_MIN);
        assert_eq!(recurring_budget(4 * G), G);
        assert_eq!(recurring_budget(0), 0);
    }

    #[test]
    pub(crate) fn the_verify_pace_takes_its_settings_and_ignores_nonsense() {
        let d = VerifyPace::beside_the_driver();
        let with = |kv: &[(&str, &str)]| {
            VerifyPace::beside_the_driver_from(|k| {
                kv.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
            })
        };
        let p = with(&[
            (VERIFY_THREADS_ENV, "0"),
            (VERIFY_NICE_ENV, "5"),
            (VERIFY_IDLE_ENV, "1"),
            (VERIFY_DOWN_ENV, "1"),
        ]);
        assert_eq!((p.threads, p.nice, p.idle, p.downwards), (0, 5, true, true));
        assert!(!d.idle && !d.downwards);
        for bad in ["-1", "65", "lots", ""] {
            let p = with(&[
                (VERIFY_THREADS_ENV, bad),
                (VERIFY_NICE_ENV, bad),
                (VERIFY_IDLE_ENV, bad),
                (VERIFY_DOWN_ENV, bad),
            ]);
            assert_eq!(
                (p.threads, p.nice, p.idle, p.downwards),
                (d.threads, d.nice, d.idle, d.downwards),
                "{bad:?}"
            );
        }
        assert_eq!(with(&[(VERIFY_NICE_ENV, "20")]).nice, d.nice);
    }

    #[test]
    pub(crate) fn chunked_reads_give_the_bytes_checked_or_not_and_twice() {
        let d = tempfile::tempdir().unwrap();
        let (data, chunks) = stored(d.path());
        let distinct: std::collections::HashSet<_> = chunks.iter().map(|c| &c.blake3).collect();
        assert!(distinct.len() < chunks.len(), "the pattern's chunks recur");
        for checked in [false, true] {
            let store = LocalStore::open(d.path().join("store")).unwrap();
            let f = bench_file("t", "criu/pages-1.img", &chunks, store, checked);
            // Twice: the second pass reads checked raw chunks straight from
            // their files and the recurring ones from memory.
            assert!(read_all(&f, data.len()).unwrap() == data);
            assert!(read_all(&f, data.len()).unwrap() == data);
        }
    }

    #[test]
    pub(crate) fn a_damaged_chunk_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let (data, chunks) = stored(d.path());
        let store = LocalStore::open(d.path().join("store")).unwrap();
        let p = store.path_of(&chunks[0].blake3);
        let mut b = fs::read(&p).unwrap();
        assert_eq!(b[0], b'R');
        b[100] ^= 1;
        fs::write(&p, &b).unwrap();
        let f = bench_file("t", "criu/pages-1.img", &chunks, store, false);
        let mut buf = vec![0u8; 4096];
        let e = f.read_at(0, &mut buf).unwrap_err();
        assert!(e.to_string().contains("fails its checksum"), "{e}");
        // The wake's verify refuses it too (before any process exists).
        let store = LocalStore::open(d.path().join("store")).unwrap();
        assert!(store.verify_chunks(&chunks, 2).is_err());
        // A chunk that was not damaged still reads.
        let at = chunks[0].size;
        f.read_at(at, &mut buf).unwrap();
        assert!(buf[..] == data[at as usize..at as usize + 4096]);
        // The background verify of a CUDA wake finds it, and the reads
        // beside it still refuse it.
        let store = LocalStore::open(d.path().join("store")).unwrap();
        let (f, v) = bench_file_verifying("t", "criu/pages-1.img", &chunks, store);
        let e = v.wait().unwrap_err();
        assert!(e.to_string().contains("fails its checksum"), "{e}");
        assert!(f.read_at(0, &mut buf).is_err());
    }

    #[test]
    pub(crate) fn threads_that_meet_on_a_compressed_chunk_decode_it_once() {
        let d = tempfile::tempdir().unwrap();
        // 8 MiB of compressed chunks that do not recur: random 64-byte
        // runs between zeros.
        let mut data = vec![0u8; 8 << 20];
        for run in data.chunks_mut(1024) {
            rand::thread_rng().fill_bytes(&mut run[..64]);
        }
        let store = LocalStore::open(d.path().join("store")).unwrap();
        let st = gpusnap_chunks::store_slice(&data, 2, &store, false, &|_| {}).unwrap();
        store.finish(st.staged, false).unwrap();
        let chunks = st.chunks;
        assert!(chunks.iter().all(|c| store.get_encoded(&c.blake3).unwrap()[0] == b'Z'));
        let open = |pace: Option<VerifyPace>| {
            let store = LocalStore::open(d.path().join("store")).unwrap();
            let shared = Shared::new("t", store, None, Arc::new(Mutex::new(None)), false);
            let f = Arc::new(ChunkedFile::new("criu/pages-1.img", &chunks, shared, false));
            let v = pace.map(|p| spawn_verify(std::slice::from_ref(&f), Arc::new(AtomicBool::new(false)), p));
            (f, v)
        };
        // Eight threads reading the same pieces at the same time (each
        // 256 KiB, so that four of them fall in each chunk), then the same
        // with the verify beside them: each chunk is loaded once (a few
        // more if the cache dropped one before the last thread came).
        for pace in [None, Some(VerifyPace { threads: 2, ..VerifyPace::all_cores() })] {
            let (f, v) = open(pace);
            let start = std::sync::Barrier::new(8);
            std::thread::scope(|s| {
                for _ in 0..8 {
                    s.spawn(|| {
                        start.wait();
                        let mut got = vec![0u8; data.len()];
                        for (k, piece) in got.chunks_mut(256 << 10).enumerate() {
                            f.read_at(k as u64 * (256 << 10), piece).unwrap();
                        }
                        assert!(got == data);
                    });
                }
            });
            if let Some(v) = v {
                join_verify(v).unwrap();
            }
            assert!(f.checked.iter().all(|c| c.load(Ordering::Relaxed)));
            // Eight threads decoding on their own would load each chunk
            // eight times; sharing, once, plus what a lagging thread finds
            // dropped from the cache (two chunks in one shard): on CI's two
            // busy cores 15 loads of 7 chunks were seen, so at most half
            // of the threads' count.
            let loads = f.shared.loads.load(Ordering::Relaxed);
            assert!(
                loads >= chunks.len() as u64 && loads <= 4 * chunks.len() as u64,
                "{loads} loads of {} chunks",
                chunks.len()
            );
        }
    }

    #[test]
    pub(crate) fn the_background_verify_checks_every_chunk_while_reads_go_on() {
        let d = tempfile::tempdir().unwrap();
        let (data, chunks) = stored(d.path());
        let store = LocalStore::open(d.path().join("store")).unwrap();
        let (f, v) = bench_file_verifying("t", "criu/pages-1.img", &chunks, store);
        assert!(read_all(&f, data.len()).unwrap() == data);
        v.wait().unwrap();
        // Every chunk marked checked: read again without hashing.
        assert!(read_all(&f, data.len()).unwrap() == data);
        // Downwards, with a bad chunk at the bottom: found, named.
        let store = LocalStore::open(d.path().join("store")).unwrap();
        let p = store.path_of(&chunks[0].blake3);
        let mut b = std::fs::read(&p).unwrap();
        b[100] ^= 1;
        std::fs::write(&p, b).unwrap();
        let pace = VerifyPace { downwards: true, threads: 1, ..VerifyPace::all_cores() };
        let (_f, v) = bench_file_verifying_at("t", "criu/pages-1.img", &chunks, store, pace);
        let e = v.wait().unwrap_err().to_string();
        assert!(e.contains(&chunks[0].blake3), "{e}");
    }
}
