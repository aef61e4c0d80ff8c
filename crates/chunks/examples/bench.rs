//! CPU cost of the chunk store, one core: chunking (page-end cuts, the
//! store's; FastCDC, for comparison), hashing
//! (blake3), zstd at several levels, and the dedup of two images that share
//! most of their bytes at different offsets (fixed-size chunks against
//! content-defined). `bench/cpu/chunks.sh` runs it.
//!
//! Usage: bench [SHARED_MIB] [FILE...]  (FILEs: real image files, such as
//! CRIU's pages-*.img, measured for zstd's ratio as well).

use std::collections::HashSet;
use std::time::Instant;

fn gbps(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

/// Deterministic incompressible bytes (xorshift), with a run of
/// compressible pages every 16 MiB as a process's heap has.
fn data(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut v = Vec::with_capacity(n);
    while v.len() < n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(n);
    for blk in v.chunks_mut(16 << 20) {
        let k = blk.len().min(1 << 20);
        for (i, b) in blk[..k].iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
    }
    v
}

fn fixed(d: &[u8], size: usize) -> Vec<(blake3::Hash, usize)> {
    d.chunks(size).map(|c| (blake3::hash(c), c.len())).collect()
}

fn cdc(d: &[u8]) -> Vec<(blake3::Hash, usize)> {
    fastcdc::v2020::FastCDC::new(
        d,
        gpusnap_chunks::MIN_CHUNK,
        gpusnap_chunks::AVG_CHUNK,
        gpusnap_chunks::MAX_CHUNK,
    )
    .map(|c| (blake3::hash(&d[c.offset..c.offset + c.length]), c.length))
    .collect()
}

fn pagecut(d: &[u8]) -> Vec<(blake3::Hash, usize)> {
    gpusnap_chunks::Cuts::new(d).map(|(o, n)| (blake3::hash(&d[o..o + n]), n)).collect()
}

fn stored(a: &[(blake3::Hash, usize)], b: &[(blake3::Hash, usize)]) -> usize {
    let mut seen = HashSet::new();
    a.iter().chain(b).filter(|(h, _)| seen.insert(*h)).map(|(_, n)| n).sum()
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let shared_mib: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(1024);
    let shared = data(shared_mib << 20, 7);
    // Two images: different private state in front (so the shared bytes
    // sit at different offsets, as in two CRIU pages files), same weights.
    let mut a = data(37 << 20, 1);
    a.extend_from_slice(&shared);
    let mut b = data(5 << 20 | 12288, 2);
    b.extend_from_slice(&shared);
    drop(shared);
    println!("data: two images of {} and {} MiB sharing {shared_mib} MiB", a.len() >> 20, b.len() >> 20);

    let t = Instant::now();
    let n = fastcdc::v2020::FastCDC::new(
        &a,
        gpusnap_chunks::MIN_CHUNK,
        gpusnap_chunks::AVG_CHUNK,
        gpusnap_chunks::MAX_CHUNK,
    )
    .count();
    println!(
        "fastcdc chunking:   {:.2} GB/s per core ({n} chunks)",
        gbps(a.len(), t.elapsed().as_secs_f64())
    );
    let t = Instant::now();
    let n = gpusnap_chunks::Cuts::new(&a).count();
    println!(
        "page-end cuts:      {:.2} GB/s per core ({n} chunks)",
        gbps(a.len(), t.elapsed().as_secs_f64())
    );
    let t = Instant::now();
    let h = blake3::hash(&a);
    println!(
        "blake3 hashing:     {:.2} GB/s per core ({})",
        gbps(a.len(), t.elapsed().as_secs_f64()),
        &h.to_hex()[..8]
    );
    let t = Instant::now();
    let ca = cdc(&a);
    println!("fastcdc + hash:     {:.2} GB/s per core", gbps(a.len(), t.elapsed().as_secs_f64()));
    let t = Instant::now();
    let pa = pagecut(&a);
    println!("page cuts + hash:   {:.2} GB/s per core", gbps(a.len(), t.elapsed().as_secs_f64()));

    let sample = &a[..a.len().min(256 << 20)];
    for level in [1, 3, 9] {
        let t = Instant::now();
        let mut out = 0usize;
        let mut raw = 0usize;
        for c in sample.chunks(1 << 20) {
            let z = zstd::bulk::compress(c, level).unwrap();
            if (z.len() as f64) < c.len() as f64 * 0.95 {
                out += z.len();
            } else {
                out += c.len();
                raw += 1;
            }
        }
        println!(
            "zstd -{level}:            {:.2} GB/s per core, stored {:.3} of the bytes ({raw} of {} chunks raw)",
            gbps(sample.len(), t.elapsed().as_secs_f64()),
            out as f64 / sample.len() as f64,
            sample.len() >> 20
        );
    }
    let cb = cdc(&b);
    let pb = pagecut(&b);
    let one = a.len();
    let s_cdc = stored(&ca, &cb);
    let s_page = stored(&pa, &pb);
    let s_fixed = stored(&fixed(&a, 1 << 20), &fixed(&b, 1 << 20));
    let s_fixed4k = stored(&fixed(&a, 4096), &fixed(&b, 4096));
    println!("dedup, two images stored as a multiple of one:");
    println!(
        "  content-defined at page ends (chosen): {:.3} ({} + {} chunks)",
        s_page as f64 / one as f64,
        pa.len(),
        pb.len()
    );
    println!("  content-defined (FastCDC 256K/1M/4M): {:.3}", s_cdc as f64 / one as f64);
    println!("  fixed 1 MiB:                          {:.3}", s_fixed as f64 / one as f64);
    println!(
        "  fixed 4 KiB (page-aligned):           {:.3} ({} chunks per image)",
        s_fixed4k as f64 / one as f64,
        one / 4096
    );

    for f in &args[1.min(args.len())..] {
        let Ok(d) = std::fs::read(f) else {
            eprintln!("cannot read {f}");
            continue;
        };
        for level in [1, 3] {
            let t = Instant::now();
            let mut out = 0usize;
            let _ = pagecut(&d);
            for c in d.chunks(1 << 20) {
                let z = zstd::bulk::compress(c, level).unwrap();
                out += z.len().min(c.len());
            }
            println!(
                "{f}: zstd -{level} {:.2} GB/s, stored {:.3}",
                gbps(d.len(), t.elapsed().as_secs_f64()),
                out as f64 / d.len().max(1) as f64
            );
        }
    }
}
