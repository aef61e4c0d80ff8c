//! gpusnap's content-addressed chunk store.
//!
//! An image's pages files are cut into content-defined chunks, at page ends
//! chosen by the pages' content ([`Cuts`]: a shift in a file, such as one
//! process's private pages before pages both processes share, moves
//! fixed-size boundaries and loses the dedup; see docs/benchmarks.md for
//! the measurement), each named by its blake3
//! hash and stored once, zstd-compressed or raw when zstd does not pay.
//!
//! ```text
//! STATE/store/
//!   lock               flock: shared by push/pull (they add chunks before the
//!                      manifest that refers to them), exclusive by gc
//!   chunks/ab/HASH     one chunk, encoded: b'R' + raw bytes, or b'Z' + zstd frame
//! ```
//! A remote (`s3://BUCKET/PREFIX`, `file:///DIR`) has the same chunks under
//! `PREFIX/chunks/HASH` and each image's signed manifest under
//! `PREFIX/images/NAME/manifest.{sig,json}`, the manifest written last.
//!
//! Every chunk read back (from the local store or a remote) is decoded and
//! its hash checked against its name before it is used.

use serde::{Deserialize, Serialize};
use std::path::Path;

mod remote;
pub use remote::{Remote, RemoteError, RemoteUrl, TransferReport};

/// Chunk sizes: 1 MiB chunks on average keep a 28 GB image at ~28k objects
/// (each a request to an object store) while private state between shared
/// pages costs at most a few MiB of lost dedup.
pub const MIN_CHUNK: u32 = 256 << 10;
pub const AVG_CHUNK: u32 = 1 << 20;
pub const MAX_CHUNK: u32 = 4 << 20;

mod cut;
pub use cut::{Cuts, PAGE};
mod zframe;
pub use zframe::sequences;
mod chunking;
mod codec;
mod local;
pub use chunking::{chunk_reader, chunk_slice, store_segment, store_slice, Stored, SEGMENT};
pub use codec::{
    decode, encode, encode_with, Codec, CODEC_ENV, LZ_BYTES_PER_SEQUENCE, MAX_ENCODED, ZSTD_LEVEL,
};
pub use local::{GcReport, LocalStore, Scratch, Staged, StoreLock};

#[derive(Debug, thiserror::Error)]
pub enum ChunkError {
    #[error("chunk store {path}: {op}: {err}")]
    Io { path: String, op: String, err: std::io::Error },
    #[error("chunk {hash} is corrupt: {why}")]
    Corrupt { hash: String, why: String },
    #[error("chunk {0} is missing from the local store")]
    Missing(String),
    #[error(transparent)]
    Remote(#[from] RemoteError),
}

fn io_err(path: &Path, op: impl Into<String>) -> impl FnOnce(std::io::Error) -> ChunkError {
    let path = path.display().to_string();
    let op = op.into();
    move |err| ChunkError::Io { path, op, err }
}

/// One chunk of a file, in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkRef {
    pub blake3: String,
    pub size: u64,
}

pub fn valid_hash(h: &str) -> bool {
    h.len() == 64 && h.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chunking::chunk_segments;
    use std::collections::HashSet;
    use std::fs;

    /// bf16 values of a normal distribution (sd 0.02), as a model's weights.
    fn weights(n: usize) -> Vec<u8> {
        use rand::{Rng, SeedableRng};
        let mut r = rand::rngs::StdRng::seed_from_u64(7);
        let mut v = Vec::with_capacity(n);
        while v.len() < n {
            // The sum of 12 uniforms less 6: near enough a normal one.
            let z: f32 = (0..12).map(|_| r.gen::<f32>()).sum::<f32>() - 6.0;
            v.extend_from_slice(&(((z * 0.02).to_bits() >> 16) as u16).to_le_bytes());
        }
        v
    }

    #[test]
    fn codecs_keep_what_decodes_fast_and_read_back_alike() {
        let w = weights(1 << 20);
        let zeros = vec![0u8; 1 << 20];
        let mut heap = zeros.clone();
        heap[..4096].copy_from_slice(&w[..4096]);
        // Random int16 widened to int64: 0.34x with lz, but a match every
        // 8 bytes (slow to decode): raw.
        let mut x = 3u64;
        let wide: Vec<u8> = (0..1 << 17)
            .flat_map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((x >> 33) as i16 as i64).to_le_bytes()
            })
            .collect();
        // Weights then zero pages: the slices lz tries first find the zeros.
        let mut half = w.clone();
        half[w.len() / 2..].fill(0);
        for (data, lz, zstd) in [
            (&w, b'R', b'Z'),
            (&zeros, b'Z', b'Z'),
            (&heap, b'Z', b'Z'),
            (&wide, b'R', b'Z'),
            (&half, b'Z', b'Z'),
        ] {
            let hash = blake3::hash(data).to_hex().to_string();
            for (codec, tag) in [(Codec::Lz, lz), (Codec::Zstd, zstd), (Codec::Raw, b'R')] {
                let enc = encode_with(codec, data);
                assert_eq!(enc[0], tag, "{codec:?}");
                assert_eq!(&decode(&hash, &enc).unwrap(), data, "{codec:?}");
            }
        }
        // The weights' entropy-coded frame saves ~20 %: under a quarter,
        // so the default stores them raw; the zeros' frame is tiny either way.
        let z = encode_with(Codec::Zstd, &w).len() as f64 / w.len() as f64;
        assert!(z > 0.7 && z < 0.9, "{z}");
        assert!(encode_with(Codec::Lz, &zeros).len() < 1024);
        assert_eq!(Codec::parse("lz"), Some(Codec::Lz));
        assert_eq!(Codec::parse("zstd"), Some(Codec::Zstd));
        assert_eq!(Codec::parse("raw"), Some(Codec::Raw));
        assert_eq!(Codec::parse("gzip"), None);
    }

    #[test]
    fn chunks_roundtrip_and_damage_is_found() {
        let d = tempfile::tempdir().unwrap();
        let s = LocalStore::open(d.path().join("store")).unwrap();
        // A random head and a zero tail each at least twice the largest
        // chunks (4 MiB): at least one chunk lies wholly in each, whatever
        // the random cut points (with 2 + 1 MiB one chunk could span both).
        let mut data = vec![0u8; 17 << 20];
        use rand::RngCore;
        rand::thread_rng().fill_bytes(&mut data[..8 << 20]);
        let mut got = Vec::new();
        let (size, whole, list) = chunk_reader(&data[..], |c, b| {
            s.put(c, b).unwrap();
            got.extend_from_slice(b);
            Ok(())
        })
        .unwrap();
        assert_eq!(size, data.len() as u64);
        assert_eq!(whole, blake3::hash(&data).to_hex().to_string());
        assert_eq!(got, data);
        let mut back = Vec::new();
        for c in &list {
            back.extend(s.get(&c.blake3).unwrap());
        }
        assert_eq!(back, data);
        // The zero tail compresses; the random head is stored raw.
        let enc: Vec<u8> = list.iter().map(|c| s.get_encoded(&c.blake3).unwrap()[0]).collect();
        assert!(enc.contains(&b'R') && enc.contains(&b'Z'), "{enc:?}");
        // A raw chunk maps (hashed from the mapping when not checked yet);
        // a compressed one does not.
        let (c0, last) = (&list[0], list.last().unwrap());
        let m = s.map_checked_raw(&c0.blake3, c0.size, &mut Scratch::default(), false).unwrap().unwrap();
        assert_eq!(&m[1..], &data[..c0.size as usize]);
        drop(m);
        assert!(s
            .map_checked_raw(&last.blake3, last.size, &mut Scratch::default(), false)
            .unwrap()
            .is_none());
        // A flipped byte is refused.
        let p = s.path_of(&list[0].blake3);
        let mut b = fs::read(&p).unwrap();
        b[10] ^= 1;
        fs::write(&p, b).unwrap();
        assert!(matches!(s.get(&list[0].blake3), Err(ChunkError::Corrupt { .. })));
        assert!(matches!(
            s.map_checked_raw(&c0.blake3, c0.size, &mut Scratch::default(), false),
            Err(ChunkError::Corrupt { .. })
        ));
        // gc keeps what is referenced.
        let keep: HashSet<String> = list[1..].iter().map(|c| c.blake3.clone()).collect();
        let _l = s.exclusive_lock().unwrap();
        let r = s.gc(&keep, |_| {});
        assert_eq!(r.chunks_removed, 1);
        assert!(!s.has(&list[0].blake3) && s.has(&list[1].blake3));
    }

    #[test]
    fn parallel_segments_cover_the_data() {
        use rand::RngCore;
        let mut d = vec![0u8; (24 << 20) + 17];
        rand::thread_rng().fill_bytes(&mut d);
        let list = chunk_segments(&d, 8 << 20, 3, &|_| {});
        assert_eq!(list.iter().map(|c| c.size).sum::<u64>(), d.len() as u64);
        let mut off = 0usize;
        for c in &list {
            assert_eq!(blake3::hash(&d[off..off + c.size as usize]).to_hex().as_str(), c.blake3);
            off += c.size as usize;
        }
    }

    #[test]
    fn shifted_data_dedups() {
        use rand::{RngCore, SeedableRng};
        // Seeded: the bytes lost where chunking resynchronizes after the
        // private prefix vary with the data (up to a maximal chunk or two).
        let mut shared = vec![0u8; 64 << 20];
        rand::rngs::StdRng::seed_from_u64(11).fill_bytes(&mut shared);
        // Pages files shift by whole pages.
        let mut a = vec![1u8; 3 * PAGE];
        a.extend_from_slice(&shared);
        let mut b = vec![7u8; 190 * PAGE];
        b.extend_from_slice(&shared);
        let (_, _, la) = chunk_reader(&a[..], |_, _| Ok(())).unwrap();
        let (_, _, lb) = chunk_reader(&b[..], |_, _| Ok(())).unwrap();
        let sa: HashSet<_> = la.iter().map(|c| &c.blake3).collect();
        let common: u64 = lb.iter().filter(|c| sa.contains(&c.blake3)).map(|c| c.size).sum();
        assert!(common > (56 << 20), "only {common} bytes shared");
    }
}
