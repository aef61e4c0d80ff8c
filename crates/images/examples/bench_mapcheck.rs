//! The check of a map file (gpusnap_images::mapfile): blake3 of every 1 MiB block of
//! a file in the page cache on THREADS threads through a mapping of it, its
//! map and unmap included, as a wake checks its map file; each phase timed
//! apart (a full mincore of the mapping, the hash, the unmap). Usage:
//! bench_mapcheck [GIB] [THREADS] (a file of GIB GiB written in 32 MiB
//! pieces under $TMPDIR first). On the H200 (bench/results/081), 8 GiB on 16 threads:
//! 59.8 GB/s (62.6 through a mapping placed at a 2 MiB boundary by hand,
//! within the noise: the kernel aligns such a mapping itself).
use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

fn hash_all(b: &[u8], threads: usize) -> usize {
    let next = AtomicUsize::new(0);
    let n = b.len().div_ceil(1 << 20);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    break;
                }
                let e = ((i + 1) << 20).min(b.len());
                std::hint::black_box(blake3::hash(&b[i << 20..e]));
            });
        }
    });
    n
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let gib: u64 = a.get(1).and_then(|v| v.parse().ok()).unwrap_or(4);
    let threads: usize = a.get(2).and_then(|v| v.parse().ok()).unwrap_or(2);
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("map");
    let mut f = std::fs::File::create(&path).expect("create");
    let piece: Vec<u8> = (0..32u64 << 20).map(|i| ((i * 2654435761) >> 13) as u8).collect();
    for _ in 0..gib * 32 {
        f.write_all(&piece).expect("write");
    }
    f.sync_data().expect("sync");
    let f = std::fs::File::open(&path).expect("open");
    let len = f.metadata().expect("stat").len();
    println!("| round | GiB | threads | mincore s | hash s (GB/s) | unmap s | all s (GB/s) |");
    println!("|---|---|---|---|---|---|---|");
    for round in 0..2 {
        let t = Instant::now();
        // SAFETY: a read-only mapping of our own temporary file.
        let m = unsafe { memmap2::Mmap::map(&f) }.expect("mmap");
        let page = 4096usize;
        let mut vec = vec![0u8; m.len().div_ceil(page)];
        // SAFETY: `m` is a page-aligned mapping of m.len() bytes; `vec` has a byte per page.
        let r = unsafe { libc::mincore(m.as_ptr() as *mut libc::c_void, m.len(), vec.as_mut_ptr()) };
        assert_eq!(r, 0, "mincore");
        let t_mincore = t.elapsed().as_secs_f64();
        let t1 = Instant::now();
        hash_all(&m, threads);
        let t_hash = t1.elapsed().as_secs_f64();
        let t2 = Instant::now();
        drop(m);
        let t_unmap = t2.elapsed().as_secs_f64();
        let s = t.elapsed().as_secs_f64();
        println!(
            "| {round} | {gib} | {threads} | {t_mincore:.3} | {t_hash:.3} ({:.1}) | {t_unmap:.3} | {s:.3} ({:.1}) |",
            len as f64 / t_hash / 1e9,
            len as f64 / s / 1e9
        );
    }
}
