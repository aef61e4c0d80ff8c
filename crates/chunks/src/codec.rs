//! How a chunk is encoded for storage (zstd, or raw when zstd does not pay)
//! and decoded and checked when it is read back.

use crate::{ChunkError, MAX_CHUNK};

/// zstd level 1: measured (bench/cpu/chunks.sh) within a few percent
/// of level 3's ratio on CRIU pages at about twice the speed.
pub const ZSTD_LEVEL: i32 = 1;

/// How chunks are encoded for storage (`GPUSNAP_CHUNK_CODEC`, read once per
/// process; a chunk stored either way is read back the same: a `Z` chunk
/// is a zstd frame whatever its settings).
///
/// The default, [`Codec::Lz`], keeps what a wake can decode fast: zstd's
/// matches (zero pages, repeated pages, runs) with its literals left as
/// they are, and a chunk stored raw unless that saves a quarter of it.
/// zstd's entropy coding of literals is what makes a chunk of a model's
/// weights (bf16) 1.28x smaller, and it decodes at ~1.2 GB/s a core (a raw
/// chunk is a copy at 5-15 GB/s): a wake's fill threads and verify decode
/// every such chunk while the driver's restore waits on them. Measured on
/// the H200 (docs/benchmarks.md, "What slowed the fill at the driver's
/// front"): the 470 MiB of a worker's int64 buffer, stored at 1.5x, filled
/// at ~1.2 GB/s where raw chunks filled at 11-14 GB/s, and the driver's
/// restore waited on it. [`Codec::Zstd`] is the encoding before (smaller
/// images, for stores that move between hosts over slow links).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    /// zstd level 1 without entropy-coded literals; raw below 1.33x or
    /// with more than one sequence per [`LZ_BYTES_PER_SEQUENCE`] bytes.
    Lz,
    /// zstd level 1; raw below 1.05x (the encoding before `Lz` became the default).
    Zstd,
    /// Every chunk raw.
    Raw,
}

/// An `lz` frame is kept only if it has at most one sequence (a match and
/// the literals before it) per this many bytes of the chunk: its decoding
/// costs about a sequence's work each. `SEQS=1 bench/cpu/codec.sh`
/// (CPU machine, one core, decode + blake3 of every lz frame): random
/// int16 widened to int64, a match every 8 bytes, 0.58 GB/s; int32 widened,
/// every 16, 0.94; PyTorch's float32 `arange % 1000` past 2^24 elements
/// (each value repeated), every 32-64, 2.3 (0.019x of raw); a heap, every
/// ~128, 2.6; raw chunks 2.4-4 (a copy and the hash).
pub const LZ_BYTES_PER_SEQUENCE: u64 = 32;

/// The lz encoder first tries this many slices of a chunk, spread over it,
/// of [`SLICE`] bytes each: the whole is compressed only if one of them
/// would be kept. A chunk none of whose slices shrinks is stored raw at
/// once (`bench/cpu/codec.sh`, encode GB/s).
const SLICES: usize = 4;
const SLICE: usize = 16 << 10;

/// The variable that picks the [`Codec`]: `lz` (default), `zstd`, `raw`.
pub const CODEC_ENV: &str = "GPUSNAP_CHUNK_CODEC";

impl Codec {
    /// `lz`, `zstd` or `raw`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "lz" => Some(Self::Lz),
            "zstd" => Some(Self::Zstd),
            "raw" => Some(Self::Raw),
            _ => None,
        }
    }

    /// The process's codec: `GPUSNAP_CHUNK_CODEC`, read once (an unknown
    /// value is ignored with a warning, as every `GPUSNAP_*` setting).
    pub fn configured() -> Self {
        static CODEC: std::sync::OnceLock<Codec> = std::sync::OnceLock::new();
        *CODEC.get_or_init(|| match std::env::var(CODEC_ENV) {
            Err(_) => Self::Lz,
            Ok(v) => Self::parse(&v).unwrap_or_else(|| {
                eprintln!("gpusnap: warning: {CODEC_ENV}={v}: not lz, zstd or raw; lz used");
                Self::Lz
            }),
        })
    }

    /// Whether frame `z` of `len` bytes is stored rather than the bytes:
    /// small enough and, for lz, fast enough to decode.
    fn keeps(self, z: &[u8], len: usize) -> bool {
        self.small(z, len) && self.decodes_fast(z, len)
    }

    /// Whether frame `z` of `len` bytes is under [`Codec::keep_below`] of them.
    fn small(self, z: &[u8], len: usize) -> bool {
        (z.len() as f64) < len as f64 * self.keep_below()
    }

    /// Whether the frame `f` of a [`SLICE`] of a chunk says the whole may
    /// be kept: it saves what the codec asks. (Not its sequences: a slice
    /// holds the start of a pattern that the rest of a chunk only repeats,
    /// float64 `arange % 1000` one sequence per 16 bytes in a slice and per
    /// ~300 in its chunk.)
    fn slice_promising(self, f: &[u8]) -> bool {
        self.small(f, SLICE)
    }

    /// Whether frame `z` of a chunk of `len` bytes decodes fast enough to
    /// be kept ([`Codec::Lz`]: at least [`LZ_BYTES_PER_SEQUENCE`] bytes of
    /// the chunk per sequence; any frame for the others).
    fn decodes_fast(self, z: &[u8], len: usize) -> bool {
        self != Self::Lz
            || crate::zframe::sequences(z).is_some_and(|n| n * LZ_BYTES_PER_SEQUENCE <= len as u64)
    }

    /// A zstd frame no larger than this share of the chunk is kept;
    /// larger, the chunk is stored raw.
    fn keep_below(self) -> f64 {
        match self {
            Self::Lz => 0.75,
            Self::Zstd => 0.95,
            Self::Raw => 0.0,
        }
    }
}
/// An encoded chunk is never larger than this (a bound on reads of untrusted
/// remote objects).
pub const MAX_ENCODED: u64 = MAX_CHUNK as u64 + 4096 + (MAX_CHUNK as u64 / 64);

/// Encodes a chunk for storage with the process's codec
/// ([`Codec::configured`]).
pub fn encode(data: &[u8]) -> Vec<u8> {
    encode_with(Codec::configured(), data)
}

/// Encodes a chunk for storage: a zstd frame, or raw when zstd does not pay
/// enough for `codec`.
pub fn encode_with(codec: Codec, data: &[u8]) -> Vec<u8> {
    thread_local! {
        // A context per thread and codec, set up once: the chunkers call
        // this for every chunk.
        static CTX: std::cell::RefCell<Option<(Codec, zstd::bulk::Compressor<'static>)>> =
            const { std::cell::RefCell::new(None) };
    }
    let frame = (codec != Codec::Raw)
        .then(|| {
            CTX.with(|c| {
                let mut c = c.borrow_mut();
                if c.as_ref().is_none_or(|(k, _)| *k != codec) {
                    let mut z = zstd::bulk::Compressor::new(ZSTD_LEVEL).ok()?;
                    if codec == Codec::Lz {
                        z.set_parameter(zstd::zstd_safe::CParameter::LiteralCompressionMode(
                            zstd::zstd_safe::ParamSwitch::Disable,
                        ))
                        .ok()?;
                    }
                    *c = Some((codec, z));
                }
                let (_, z) = c.as_mut()?;
                // lz: a few slices first; when none of them shrinks enough,
                // neither does the whole (a model's weights, random bytes:
                // a 1 MiB chunk of them took ~1 ms of zstd for nothing, the
                // slices ~1/16 of that).
                if codec == Codec::Lz && data.len() >= SLICES * SLICE * 2 {
                    let step = data.len() / SLICES;
                    let any = (0..SLICES).any(|k| {
                        let s = &data[k * step..k * step + SLICE];
                        z.compress(s).is_ok_and(|f| codec.slice_promising(&f))
                    });
                    if !any {
                        return None;
                    }
                }
                z.compress(data).ok()
            })
        })
        .flatten();
    if let Some(z) = frame {
        if codec.keeps(&z, data.len()) {
            let mut out = Vec::with_capacity(z.len() + 1);
            out.push(b'Z');
            out.extend_from_slice(&z);
            return out;
        }
    }
    let mut out = Vec::with_capacity(data.len() + 1);
    out.push(b'R');
    out.extend_from_slice(data);
    out
}

/// Decodes a stored chunk and checks it is the chunk `hash` names.
pub fn decode(hash: &str, enc: &[u8]) -> Result<Vec<u8>, ChunkError> {
    let corrupt = |why: String| ChunkError::Corrupt { hash: hash.into(), why };
    let data = match enc.split_first() {
        Some((b'R', rest)) => rest.to_vec(),
        Some((b'Z', rest)) => {
            zstd::bulk::decompress(rest, MAX_CHUNK as usize).map_err(|e| corrupt(format!("zstd: {e}")))?
        }
        _ => return Err(corrupt("unknown encoding".into())),
    };
    if blake3::hash(&data).to_hex().as_str() != hash {
        return Err(corrupt("its content does not match its hash".into()));
    }
    Ok(data)
}
