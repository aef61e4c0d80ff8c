//! The page server's read throughput, the way its fill threads read (each
//! thread takes the next 4 MiB batch in address order and reads it 1 MiB at
//! a time): a pages file of an image directory (`DirSource`) against the
//! same bytes as chunks in the store (`chunksrc`, every chunk checked),
//! for a repeated pattern like tests/gpu/worker.py's memory and for random
//! (incompressible) bytes, page cache warm; and the up-front verify of the
//! chunks (`LocalStore::verify_chunks`, on every core) that a wake of CUDA
//! processes runs first. `bench/cpu/pagesrc.sh` runs it.
//!
//! Usage: bench_pagesrc [SIZE_MIB] [THREADS...]   (defaults: 2048, 1 and
//! the number of cores); BENCH_KINDS="pattern random" (the default; also
//! "widened": random int32 widened to int64, compressed chunks with
//! GPUSNAP_CHUNK_CODEC=zstd) picks
//! the data, REPS=3 the runs of each (the median is printed).

use gpusnap_chunks::LocalStore;
use gpusnap_pages::{DirSource, PageSource, PagesFile};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

const BATCH: u64 = 4 << 20;
const READ: u64 = 1 << 20;

/// tests/gpu/worker.py's tensor: float32 `arange(n) % 1000`.
fn pattern(n: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(n);
    let mut i = 0u64;
    while v.len() < n {
        v.extend_from_slice(&((i % 1000) as f32).to_le_bytes());
        i += 1;
    }
    v.truncate(n);
    v
}

/// `n` bytes of xorshift words from `seed`, each turned into bytes by `f`.
fn xorshift(n: usize, seed: u64, f: impl Fn(u64) -> [u8; 8]) -> Vec<u8> {
    let mut x = seed;
    let mut v = Vec::with_capacity(n + 8);
    while v.len() < n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&f(x));
    }
    v.truncate(n);
    v
}

/// tests/gpu/worker.py's checksum buffer: random int32 widened to int64
/// (each high half all zeros or all ones): every chunk distinct, ~1.5x
/// smaller with zstd's entropy coding.
fn widened(n: usize) -> Vec<u8> {
    xorshift(n, 0x2545_f491_4f6c_dd1d, |x| (x as i32 as i64).to_le_bytes())
}

/// Incompressible bytes.
fn random(n: usize) -> Vec<u8> {
    xorshift(n, 0x9e37_79b9_7f4a_7c15, u64::to_le_bytes)
}

/// GB/s of `threads` threads reading all of `f` (`size` bytes) as the
/// fill does; checks every byte against `want` when given (the timed runs
/// do not: the comparison would cost as much as a fast read).
fn fill_read(f: &Arc<dyn PagesFile>, size: u64, threads: usize, want: Option<&[u8]>) -> f64 {
    let next = AtomicU64::new(0);
    let t = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                let mut buf = vec![0u8; READ as usize];
                loop {
                    let b = next.fetch_add(BATCH, Ordering::Relaxed);
                    if b >= size {
                        break;
                    }
                    let end = (b + BATCH).min(size);
                    let mut at = b;
                    while at < end {
                        let n = (end - at).min(READ) as usize;
                        f.read_at(at, &mut buf[..n]).expect("read");
                        if let Some(w) = want {
                            assert!(buf[..n] == w[at as usize..at as usize + n], "bytes at {at:#x} differ");
                        }
                        at += n as u64;
                    }
                }
            });
        }
    });
    size as f64 / t.elapsed().as_secs_f64() / 1e9
}

/// The median of `reps` runs of `f` (other builds share this machine's
/// cores: a single run is noise).
fn median(reps: usize, mut f: impl FnMut() -> f64) -> f64 {
    let mut v: Vec<f64> = (0..reps.max(1)).map(|_| f()).collect();
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let reps: usize = std::env::var("REPS").ok().and_then(|r| r.parse().ok()).unwrap_or(3);
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mib: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(2048);
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2);
    let mut threads: Vec<usize> = args.iter().skip(1).filter_map(|a| a.parse().ok()).collect();
    if threads.is_empty() {
        threads = vec![1, cores];
        threads.dedup();
    }
    let size = mib << 20;
    let tmp = std::env::var_os("BENCH_DIR").map(std::path::PathBuf::from).unwrap_or_else(std::env::temp_dir);
    let work = tempfile::tempdir_in(tmp).expect("temp dir");
    println!("| data | source | threads | GB/s | per thread GB/s | vs directory |");
    println!("|---|---|---|---|---|---|");
    let mut notes = Vec::new();
    let kinds = std::env::var("BENCH_KINDS").unwrap_or_else(|_| "pattern random".into());
    for kind in kinds.split_whitespace() {
        let data = match kind {
            "pattern" => pattern(size),
            "random" => random(size),
            "widened" => widened(size),
            other => panic!("BENCH_KINDS: {other}: not pattern, random or widened"),
        };
        let dir = work.path().join(kind);
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(dir.join("pages-1.img"), &data).expect("write pages");
        let store = LocalStore::open(dir.join("store")).expect("store");
        let st = gpusnap_chunks::store_slice(&data, cores, &store, false, &|_| {}).expect("chunk");
        store.finish(st.staged, false).expect("finish");
        let chunks = st.chunks;
        let distinct: std::collections::HashSet<_> = chunks.iter().map(|c| &c.blake3).collect();
        let stored = store.stored_bytes();
        notes.push(format!(
            "{kind}: {} MiB, {} chunks ({} distinct, mean {:.2} MiB), {:.1} MiB stored",
            mib,
            chunks.len(),
            distinct.len(),
            size as f64 / chunks.len() as f64 / (1 << 20) as f64,
            stored as f64 / (1 << 20) as f64
        ));
        let dir_file = DirSource::new(&dir).open("pages-1.img").expect("open");
        // Warm the page cache (both copies), and check what each reads.
        fill_read(&dir_file, size as u64, cores, Some(&data));
        let reopen = |verified: bool| {
            gpusnap_images::chunkfile::bench_file(
                "bench",
                "criu/pages-1.img",
                &chunks,
                LocalStore::open(dir.join("store")).expect("store"),
                verified,
            )
        };
        fill_read(&reopen(false), size as u64, cores, Some(&data));
        fill_read(&reopen(true), size as u64, cores, Some(&data));
        // The up-front verify, every core.
        let v = median(reps, || {
            let t = Instant::now();
            store.verify_chunks(&chunks, cores).expect("verify");
            size as f64 / t.elapsed().as_secs_f64() / 1e9
        });
        notes.push(format!("{kind}: up-front verify of the chunks on {cores} cores: {v:.2} GB/s"));
        for &n in &threads {
            let d = median(reps, || fill_read(&dir_file, size as u64, n, None));
            println!("| {kind} | directory | {n} | {d:.2} | {:.2} | 1.00 |", d / n as f64);
            if std::env::var_os("BENCH_KEPT").is_some() {
                let f = reopen(true);
                fill_read(&f, size as u64, n, None);
                let c = median(reps, || fill_read(&f, size as u64, n, None));
                println!(
                    "| {kind} | chunks, second pass of one source | {n} | {c:.2} | {:.2} | {:.2} |",
                    c / n as f64,
                    c / d
                );
            }
            for verified in [false, true] {
                let c = median(reps, || fill_read(&reopen(verified), size as u64, n, None));
                let what = if verified { "chunks, verified up front" } else { "chunks, checked as read" };
                println!("| {kind} | {what} | {n} | {c:.2} | {:.2} | {:.2} |", c / n as f64, c / d);
            }
            // A CUDA wake before and after: the verify on every core, then
            // the fill; or the verify in the background of the fill, both
            // to their end (the driver's restore starts then). GB/s of the
            // whole, until both are done.
            let seq = median(reps, || {
                let t = Instant::now();
                store.verify_chunks(&chunks, cores).expect("verify");
                fill_read(&reopen(true), size as u64, n, None);
                size as f64 / t.elapsed().as_secs_f64() / 1e9
            });
            println!(
                "| {kind} | chunks, verify then fill (until both end) | {n} | {seq:.2} | {:.2} | {:.2} |",
                seq / n as f64,
                seq / d
            );
            let bg = median(reps, || {
                let t = Instant::now();
                let (f, v) = gpusnap_images::verify::bench_file_verifying(
                    "bench",
                    "criu/pages-1.img",
                    &chunks,
                    LocalStore::open(dir.join("store")).expect("store"),
                );
                fill_read(&f, size as u64, n, None);
                v.wait().expect("verify");
                size as f64 / t.elapsed().as_secs_f64() / 1e9
            });
            println!(
                "| {kind} | chunks, verify in the background of the fill (until both end) | {n} | {bg:.2} | {:.2} | {:.2} |",
                bg / n as f64,
                bg / d
            );
        }
    }
    println!();
    for n in notes {
        println!("- {n}");
    }
}
