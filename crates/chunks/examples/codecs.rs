//! The chunk codecs against the memory a wake fills, one core: for each
//! kind of data, what each codec stores (x of raw), how fast `hibernate`
//! encodes it, and how fast a wake reads it back checked (decode + blake3,
//! what the page server's fill and the verify do for every chunk they have
//! not checked yet). `bench/cpu/codec.sh` runs it.
//!
//! Usage: codecs [MIB]   (default 256 MiB of each kind; REPS=3 runs each,
//! the median printed)

use gpusnap_chunks::{decode, encode_with, Codec, Cuts};
use std::time::Instant;

struct Xorshift(u64);

impl Xorshift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// The kinds of memory a CUDA process's image holds.
fn kind(name: &str, n: usize) -> Vec<u8> {
    let mut r = Xorshift(0x9e37_79b9_7f4a_7c15);
    let mut v = Vec::with_capacity(n + 8);
    match name {
        // Incompressible (tests/gpu/worker.py --fill random).
        "random" => {
            while v.len() < n {
                v.extend_from_slice(&r.next().to_le_bytes());
            }
        }
        // A model's weights: bf16 from a normal distribution (sd 0.02),
        // Box-Muller over the generator.
        "weights" => {
            while v.len() < n {
                let u1 = ((r.next() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
                let u2 = (r.next() >> 11) as f64 / (1u64 << 53) as f64;
                let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
                let bits = ((z * 0.02) as f32).to_bits();
                v.extend_from_slice(&((bits >> 16) as u16).to_le_bytes());
            }
        }
        // Random int32 widened to int64 (worker.py's checksum buffer).
        "widened" => {
            while v.len() < n {
                v.extend_from_slice(&(r.next() as i32 as i64).to_le_bytes());
            }
        }
        // Random int16 widened to int64 (worker.py's checksum buffer of
        // --fill weights: the bits of bf16 values summed as int64).
        "widened16" => {
            while v.len() < n {
                v.extend_from_slice(&(r.next() as i16 as i64).to_le_bytes());
            }
        }
        // float32 arange % 1000 (worker.py --fill pattern).
        "pattern" => {
            let mut i = 0u64;
            while v.len() < n {
                v.extend_from_slice(&((i % 1000) as f32).to_le_bytes());
                i += 1;
            }
        }
        // worker.py's float32 arange % 1000 as PyTorch makes it past 2^24
        // elements, where float32 rounds the index: each value repeated
        // 2^k times (here from element 2^27: 16 times, 64-byte runs).
        "arange" => {
            let mut i = 1u64 << 27;
            while v.len() < n {
                v.extend_from_slice(&((i as f32) % 1000.0).to_le_bytes());
                i += 1;
            }
        }
        // float64 arange % 1000 (the float64 sum's copy in worker.py).
        "pattern64" => {
            let mut i = 0u64;
            while v.len() < n {
                v.extend_from_slice(&((i % 1000) as f64).to_le_bytes());
                i += 1;
            }
        }
        // A heap: mostly zero pages, some random ones, some small integers.
        "heap" => {
            while v.len() < n {
                let page = match r.next() % 8 {
                    0..=4 => vec![0u8; 4096],
                    5 => (0..512).flat_map(|_| r.next().to_le_bytes()).collect(),
                    _ => (0..1024).flat_map(|_| ((r.next() % 4096) as u32).to_le_bytes()).collect(),
                };
                v.extend_from_slice(&page);
            }
        }
        other => panic!("no data kind {other}"),
    }
    v.truncate(n);
    v
}

fn median(reps: usize, mut f: impl FnMut() -> f64) -> f64 {
    let mut v: Vec<f64> = (0..reps.max(1)).map(|_| f()).collect();
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let reps: usize = std::env::var("REPS").ok().and_then(|r| r.parse().ok()).unwrap_or(3);
    let mib: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(256);
    let n = mib << 20;
    println!(
        "| data | codec | stored (x of raw) | chunks stored zstd | encode GB/s | read back checked GB/s |"
    );
    println!("|---|---|---|---|---|---|");
    for name in ["random", "weights", "widened", "widened16", "pattern", "arange", "pattern64", "heap"] {
        let data = kind(name, n);
        let chunks: Vec<&[u8]> = Cuts::new(&data).map(|(o, l)| &data[o..o + l]).collect();
        let hashes: Vec<String> = chunks.iter().map(|c| blake3::hash(c).to_hex().to_string()).collect();
        if std::env::var_os("SEQS").is_some() {
            // Every chunk's lz frame, kept or not: its bytes per sequence
            // and its decode + blake3 pace (calibrates LZ_BYTES_PER_SEQUENCE).
            let mut z = zstd::bulk::Compressor::new(1).unwrap();
            z.set_parameter(zstd::zstd_safe::CParameter::LiteralCompressionMode(
                zstd::zstd_safe::ParamSwitch::Disable,
            ))
            .unwrap();
            let frames: Vec<Vec<u8>> = chunks.iter().map(|c| z.compress(c).unwrap()).collect();
            let t = Instant::now();
            for (f, c) in frames.iter().zip(&chunks) {
                blake3::hash(&zstd::bulk::decompress(f, c.len()).unwrap());
            }
            let pace = n as f64 / t.elapsed().as_secs_f64() / 1e9;
            let mut per: Vec<f64> = chunks
                .iter()
                .zip(&frames)
                .map(|(c, f)| c.len() as f64 / gpusnap_chunks::sequences(f).expect("parse").max(1) as f64)
                .collect();
            per.sort_by(|a, b| a.total_cmp(b));
            let size = frames.iter().map(|f| f.len()).sum::<usize>() as f64 / n as f64;
            eprintln!(
                "{name}: lz frames {size:.3} of raw, decoded + hashed {pace:.2} GB/s; bytes per sequence: min {:.0} median {:.0} max {:.0}",
                per[0],
                per[per.len() / 2],
                per[per.len() - 1]
            );
        }
        for (label, codec) in [("lz (default)", Codec::Lz), ("zstd (before)", Codec::Zstd)] {
            let mut enc = Vec::new();
            let e = median(reps, || {
                let t = Instant::now();
                enc = chunks.iter().map(|c| encode_with(codec, c)).collect();
                n as f64 / t.elapsed().as_secs_f64() / 1e9
            });
            let stored: usize = enc.iter().map(|e| e.len() - 1).sum();
            let zs = enc.iter().filter(|e| e[0] == b'Z').count();
            let d = median(reps, || {
                let t = Instant::now();
                for (h, e) in hashes.iter().zip(&enc) {
                    decode(h, e).expect("decode");
                }
                n as f64 / t.elapsed().as_secs_f64() / 1e9
            });
            println!(
                "| {name} | {label} | {:.3} | {zs} of {} | {e:.2} | {d:.2} |",
                stored as f64 / n as f64,
                enc.len()
            );
        }
    }
}
