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
use std::collections::HashSet;
use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

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
/// zstd level 1: measured (scripts/bench-chunks-cpu.sh) within a few percent
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
    /// zstd level 1; raw below 1.05x (the encoding before the tenth session).
    Zstd,
    /// Every chunk raw.
    Raw,
}

/// An `lz` frame is kept only if it has at most one sequence (a match and
/// the literals before it) per this many bytes of the chunk: its decoding
/// costs about a sequence's work each. `SEQS=1 scripts/bench-codec-cpu.sh`
/// (CPU machine, one core, decode + blake3 of every lz frame): random
/// int16 widened to int64, a match every 8 bytes, 0.58 GB/s; int32 widened,
/// every 16, 0.94; PyTorch's float32 `arange % 1000` past 2^24 elements
/// (each value repeated), every 32-64, 2.3 (0.019x of raw); a heap, every
/// ~128, 2.6; raw chunks 2.4-4 (a copy and the hash).
pub const LZ_BYTES_PER_SEQUENCE: u64 = 32;

/// The lz encoder first tries this many slices of a chunk, spread over it,
/// of [`SLICE`] bytes each: the whole is compressed only if one of them
/// would be kept. A chunk none of whose slices shrinks is stored raw at
/// once (`scripts/bench-codec-cpu.sh`, encode GB/s).
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
        self != Self::Lz || zframe::sequences(z).is_some_and(|n| n * LZ_BYTES_PER_SEQUENCE <= len as u64)
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

/// The chunks of one segment (or a whole slice), each with its bytes: cut
/// ([`Cuts`]) and hashed. Every chunking of the store goes through here.
fn cut_chunks(seg: &[u8]) -> impl Iterator<Item = (ChunkRef, &[u8])> {
    Cuts::new(seg).map(move |(off, len)| {
        let bytes = &seg[off..off + len];
        (ChunkRef { blake3: blake3::hash(bytes).to_hex().to_string(), size: len as u64 }, bytes)
    })
}

/// Cuts `r` into chunks as [`chunk_slice`] cuts the same bytes: returns its
/// size, its whole blake3 and the chunk list, calling `each` with every
/// chunk's bytes (one read of the data, a [`SEGMENT`] at a time).
pub fn chunk_reader(
    mut r: impl Read,
    mut each: impl FnMut(&ChunkRef, &[u8]) -> std::io::Result<()>,
) -> std::io::Result<(u64, String, Vec<ChunkRef>)> {
    let mut whole = blake3::Hasher::new();
    let mut list = Vec::new();
    let mut size = 0u64;
    let mut seg = Vec::with_capacity(SEGMENT);
    loop {
        seg.clear();
        // A whole segment, or what is left of the data.
        (&mut r).take(SEGMENT as u64).read_to_end(&mut seg)?;
        whole.update(&seg);
        for (cref, bytes) in cut_chunks(&seg) {
            size += cref.size;
            each(&cref, bytes)?;
            list.push(cref);
        }
        if seg.len() < SEGMENT {
            break;
        }
    }
    Ok((size, whole.finalize().to_hex().to_string(), list))
}

/// Segments of a large file are chunked on separate cores: the cuts are
/// sequential, and one core (blake3 of every chunk, 2-3 GB/s) would make
/// hibernate's commit of tens of GB take as long as the dump. A cut at every segment edge
/// costs dedup only there (a chunk or two per 256 MiB).
pub const SEGMENT: usize = 256 << 20;

/// The chunk list of `data`, cut ([`Cuts`]) in [`SEGMENT`]s, each hashed
/// with blake3, on up to `threads` cores. `on_bytes` is called from those
/// threads as segments finish.
pub fn chunk_slice(data: &[u8], threads: usize, on_bytes: &(dyn Fn(u64) + Sync)) -> Vec<ChunkRef> {
    chunk_segments(data, SEGMENT, threads, on_bytes)
}

fn chunk_segments(
    data: &[u8],
    segment: usize,
    threads: usize,
    on_bytes: &(dyn Fn(u64) + Sync),
) -> Vec<ChunkRef> {
    let segs: Vec<&[u8]> = data.chunks(segment).collect();
    let mut out: Vec<Vec<ChunkRef>> = vec![Vec::new(); segs.len()];
    let next = std::sync::atomic::AtomicUsize::new(0);
    let slots: Vec<std::sync::Mutex<&mut Vec<ChunkRef>>> =
        out.iter_mut().map(std::sync::Mutex::new).collect();
    std::thread::scope(|s| {
        for _ in 0..threads.clamp(1, segs.len().max(1)) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(seg) = segs.get(i) else { break };
                let list: Vec<ChunkRef> = cut_chunks(seg).map(|(cref, _)| cref).collect();
                on_bytes(seg.len() as u64);
                if let Ok(mut slot) = slots[i].lock() {
                    **slot = list;
                }
            });
        }
    });
    drop(slots);
    out.into_iter().flatten().collect()
}

/// A chunk written under a temporary name, its write-back started, not yet
/// under its own name: [`LocalStore::finish`] makes it durable and names
/// it. A chunk is never under its name before its bytes are on disk (when
/// asked to be durable), or a crash could leave a torn chunk that later
/// images would deduplicate against.
#[derive(Debug)]
pub struct Staged {
    tmp: PathBuf,
    dest: PathBuf,
    /// Its encoded size.
    pub bytes: u64,
}

/// What [`store_slice`] did: the chunk list of the data, and the chunks it
/// added (staged, see [`LocalStore::finish`]).
#[derive(Debug, Default)]
pub struct Stored {
    pub chunks: Vec<ChunkRef>,
    pub staged: Vec<Staged>,
}

/// Cuts `data` into chunks ([`Cuts`] by [`SEGMENT`]s, as [`chunk_slice`]),
/// hashes, compresses and stages each chunk the store lacks, on up to
/// `threads` cores in one pass over the data. `durable`: each chunk's
/// write-back starts as it is written (sync_file_range), so that the
/// fdatasync of [`LocalStore::finish`] finds little left to do.
pub fn store_slice(
    data: &[u8],
    threads: usize,
    store: &LocalStore,
    durable: bool,
    on_bytes: &(dyn Fn(u64) + Sync),
) -> Result<Stored, ChunkError> {
    let segs: Vec<&[u8]> = data.chunks(SEGMENT).collect();
    type Slot = Result<(Vec<ChunkRef>, Vec<Staged>), ChunkError>;
    let slots: Vec<std::sync::Mutex<Option<Slot>>> =
        segs.iter().map(|_| std::sync::Mutex::new(None)).collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let failed = std::sync::atomic::AtomicBool::new(false);
    // One stage per distinct new chunk, even when it repeats (zero pages).
    let taken: std::sync::Mutex<HashSet<String>> = std::sync::Mutex::new(HashSet::new());
    std::thread::scope(|s| {
        for _ in 0..threads.clamp(1, segs.len().max(1)) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(seg) = segs.get(i) else { break };
                if failed.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                let res = store_segment(seg, store, durable, &taken);
                on_bytes(seg.len() as u64);
                if res.is_err() {
                    failed.store(true, std::sync::atomic::Ordering::Relaxed);
                }
                if let Ok(mut slot) = slots[i].lock() {
                    *slot = Some(res);
                }
            });
        }
    });
    let mut out = Stored::default();
    let mut err = None;
    for slot in slots {
        match slot.into_inner().ok().flatten() {
            Some(Ok((list, staged))) => {
                out.chunks.extend(list);
                out.staged.extend(staged);
            }
            Some(Err(e)) => {
                err.get_or_insert(e);
            }
            None => {
                err.get_or_insert(ChunkError::Io {
                    path: store.root.display().to_string(),
                    op: "chunk".into(),
                    err: std::io::Error::other("a chunking thread stopped"),
                });
            }
        }
    }
    if let Some(e) = err {
        store.abandon(out.staged);
        return Err(e);
    }
    Ok(out)
}

/// One [`SEGMENT`] (or a file's last, shorter one) of [`store_slice`]:
/// cut ([`Cuts`]), each chunk hashed, and each one the store lacks
/// compressed and staged, once per distinct chunk among the callers that
/// share `taken`. The chunks are those [`store_slice`] cuts from the same
/// segment of a file, wherever they come from: a pages file followed while
/// CRIU writes it is cut segment by segment as each one is complete. On an
/// error, what this call staged is abandoned.
pub fn store_segment(
    seg: &[u8],
    store: &LocalStore,
    durable: bool,
    taken: &std::sync::Mutex<HashSet<String>>,
) -> Result<(Vec<ChunkRef>, Vec<Staged>), ChunkError> {
    let mut list = Vec::new();
    let mut staged = Vec::new();
    for (cref, bytes) in cut_chunks(seg) {
        let new = !store.has(&cref.blake3)
            && taken.lock().map(|mut t| t.insert(cref.blake3.clone())).unwrap_or(true);
        if new {
            match store.stage(&cref.blake3, &encode(bytes), durable) {
                Ok(st) => staged.push(st),
                Err(e) => {
                    store.abandon(staged);
                    return Err(e);
                }
            }
        }
        list.push(cref);
    }
    Ok((list, staged))
}

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

/// A thread's reusable buffers for [`LocalStore::read_into`]: the encoded
/// bytes and a zstd context, so that reading chunk after chunk allocates
/// nothing once the buffers have grown to a chunk's size.
#[derive(Default)]
pub struct Scratch {
    enc: Vec<u8>,
    dec: Option<zstd::bulk::Decompressor<'static>>,
    /// The chunk last read by [`LocalStore::read_checked_raw_at`]: its
    /// hash, its file, and its path when it is stored raw.
    open: Option<(String, fs::File, Option<PathBuf>)>,
    /// The chunk last mapped by [`LocalStore::map_checked_raw`].
    mapped: Option<(String, std::sync::Arc<memmap2::Mmap>)>,
}

/// The local store, `STATE/store`.
pub struct LocalStore {
    root: PathBuf,
}

/// A held flock on the store's lock file (released when dropped).
pub struct StoreLock(#[allow(dead_code)] fs::File);

#[derive(Debug, Default, Clone, Serialize)]
pub struct GcReport {
    pub chunks_removed: u64,
    pub bytes_freed: u64,
    pub chunks_kept: u64,
    pub bytes_kept: u64,
}

impl LocalStore {
    pub fn open(root: PathBuf) -> Result<Self, ChunkError> {
        let chunks = root.join("chunks");
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&chunks)
            .map_err(io_err(&chunks, "create"))?;
        Ok(Self { root })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    fn lock(&self, how: libc::c_int) -> Result<StoreLock, ChunkError> {
        let p = self.root.join("lock");
        let f = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&p)
            .map_err(io_err(&p, "open"))?;
        // SAFETY: flock on a descriptor this function owns; no memory is passed.
        let rc = unsafe { libc::flock(f.as_raw_fd(), how) };
        if rc != 0 {
            return Err(io_err(&p, "lock")(std::io::Error::last_os_error()));
        }
        Ok(StoreLock(f))
    }

    /// Held by writers of chunks (push, pull) until the manifest that
    /// refers to their chunks is in place: gc waits for them.
    pub fn shared_lock(&self) -> Result<StoreLock, ChunkError> {
        self.lock(libc::LOCK_SH)
    }

    pub fn exclusive_lock(&self) -> Result<StoreLock, ChunkError> {
        self.lock(libc::LOCK_EX)
    }

    pub fn path_of(&self, hash: &str) -> PathBuf {
        self.root.join("chunks").join(&hash[..2]).join(hash)
    }

    pub fn has(&self, hash: &str) -> bool {
        fs::symlink_metadata(self.path_of(hash)).is_ok_and(|m| m.is_file())
    }

    /// Stores an encoded chunk after checking it (temporary name, then
    /// rename: a chunk under its name is always whole). Returns its stored size.
    pub fn put_encoded(&self, hash: &str, enc: &[u8]) -> Result<u64, ChunkError> {
        if !valid_hash(hash) {
            return Err(ChunkError::Corrupt {
                hash: hash.chars().take(80).collect(),
                why: "not a blake3 name".into(),
            });
        }
        decode(hash, enc)?;
        let (mut f, tmp, p) = self.create_temp(hash)?;
        let done = f.write_all(enc).and_then(|_| f.sync_data()).and_then(|_| fs::rename(&tmp, &p));
        if let Err(e) = done {
            let _ = fs::remove_file(&tmp);
            return Err(io_err(&p, "write")(e));
        }
        Ok(enc.len() as u64)
    }

    /// A new private file under a temporary name beside chunk `hash`'s
    /// place (its directory made if needed), that place, and the file.
    fn create_temp(&self, hash: &str) -> Result<(fs::File, PathBuf, PathBuf), ChunkError> {
        let dest = self.path_of(hash);
        let dir = dest.parent().expect("chunk path has a parent");
        fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).map_err(io_err(dir, "create"))?;
        let tmp = dir.join(format!(".{hash}.tmp-{}-{:x}", std::process::id(), rand_u64()));
        let f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)
            .map_err(io_err(&tmp, "create"))?;
        Ok((f, tmp, dest))
    }

    /// Writes an encoded chunk under a temporary name next to its place
    /// (see [`Staged`]); with `durable`, its write-back starts at once.
    pub fn stage(&self, hash: &str, enc: &[u8], durable: bool) -> Result<Staged, ChunkError> {
        let (mut f, tmp, dest) = self.create_temp(hash)?;
        if let Err(e) = f.write_all(enc) {
            let _ = fs::remove_file(&tmp);
            return Err(io_err(&tmp, "write")(e));
        }
        if durable {
            // SAFETY: a valid descriptor this function owns; offset 0 and
            // length 0 mean the whole file; no memory is passed.
            unsafe { libc::sync_file_range(f.as_raw_fd(), 0, 0, libc::SYNC_FILE_RANGE_WRITE) };
        }
        Ok(Staged { tmp, dest, bytes: enc.len() as u64 })
    }

    /// Puts staged chunks under their names: with `durable`, their bytes
    /// are on disk first, and the names after the renames. Measured
    /// (scripts/bench-chunks-hibernate.sh, docs/benchmarks.md): an
    /// fdatasync per chunk made a 3 GiB hibernate three times slower on
    /// ext4 (a journal commit per chunk), so the store's filesystem is
    /// synced whole (syncfs), once for the data and once for the names;
    /// that also flushes other dirty data of that filesystem.
    pub fn finish(&self, staged: Vec<Staged>, durable: bool) -> Result<(), ChunkError> {
        if durable && !staged.is_empty() {
            self.syncfs()?;
        }
        for st in &staged {
            if let Err(e) = fs::rename(&st.tmp, &st.dest) {
                let err = io_err(&st.dest, "store")(e);
                self.abandon(staged);
                return Err(err);
            }
        }
        if durable && !staged.is_empty() {
            self.syncfs()?;
        }
        Ok(())
    }

    fn syncfs(&self) -> Result<(), ChunkError> {
        let f = fs::File::open(&self.root).map_err(io_err(&self.root, "open"))?;
        // SAFETY: syncfs on a descriptor this function owns; no memory is passed.
        if unsafe { libc::syncfs(f.as_raw_fd()) } != 0 {
            return Err(io_err(&self.root, "sync")(std::io::Error::last_os_error()));
        }
        Ok(())
    }

    /// Removes staged chunks that will not be named (a failed commit).
    pub fn abandon(&self, staged: Vec<Staged>) {
        for st in staged {
            let _ = fs::remove_file(&st.tmp);
        }
    }

    /// Stores a chunk's bytes unless it is there; returns the bytes added.
    pub fn put(&self, c: &ChunkRef, data: &[u8]) -> Result<u64, ChunkError> {
        if self.has(&c.blake3) {
            return Ok(0);
        }
        self.put_encoded(&c.blake3, &encode(data))
    }

    pub fn get_encoded(&self, hash: &str) -> Result<Vec<u8>, ChunkError> {
        if !valid_hash(hash) {
            return Err(ChunkError::Corrupt {
                hash: hash.chars().take(80).collect(),
                why: "not a blake3 name".into(),
            });
        }
        let (mut f, len, p) = self.open_chunk(hash)?;
        let mut out = Vec::with_capacity(len as usize);
        (&mut f).take(MAX_ENCODED + 1).read_to_end(&mut out).map_err(io_err(&p, "read"))?;
        Ok(out)
    }

    /// A chunk file opened for reading (never through a link), its size
    /// (bounded) and path.
    fn open_chunk(&self, hash: &str) -> Result<(fs::File, u64, PathBuf), ChunkError> {
        let p = self.path_of(hash);
        let f = match fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(&p) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(ChunkError::Missing(hash.into()))
            }
            r => r.map_err(io_err(&p, "open"))?,
        };
        let len = f.metadata().map_err(io_err(&p, "stat"))?.len().min(MAX_ENCODED + 1);
        Ok((f, len, p))
    }

    /// A chunk's bytes, checked against its hash. A raw chunk is read
    /// straight into the buffer it is returned in: the page server reads
    /// every page of a wake through here, and each extra copy into fresh
    /// memory cost it more than the read itself (measured on the H200: the
    /// fill ran at 2.2 GB/s from chunks against 5.5-6.3 GB/s from a file).
    pub fn get(&self, hash: &str) -> Result<Vec<u8>, ChunkError> {
        if !valid_hash(hash) {
            return self.get_encoded(hash).and_then(|e| decode(hash, &e));
        }
        let (mut f, len, p) = self.open_chunk(hash)?;
        let mut tag = [0u8; 1];
        if len == 0 || f.read_exact(&mut tag).is_err() || tag[0] != b'R' || len > MAX_CHUNK as u64 + 1 {
            // Compressed (or damaged): the general path.
            return decode(hash, &self.get_encoded(hash)?);
        }
        let mut data = vec![0u8; (len - 1) as usize];
        f.read_exact(&mut data).map_err(io_err(&p, "read"))?;
        let mut extra = [0u8; 1];
        if f.read(&mut extra).map_err(io_err(&p, "read"))? != 0 {
            return Err(ChunkError::Corrupt { hash: hash.into(), why: "it grew while being read".into() });
        }
        if blake3::hash(&data).to_hex().as_str() != hash {
            return Err(ChunkError::Corrupt {
                hash: hash.into(),
                why: "its content does not match its hash".into(),
            });
        }
        Ok(data)
    }

    /// Checks every chunk of `chunks` (read, decoded, hashed, its size
    /// the listed one) on up to `threads` cores; the first failure found.
    pub fn verify_chunks(&self, chunks: &[ChunkRef], threads: usize) -> Result<(), ChunkError> {
        // A chunk that recurs (zero pages, a repeated pattern) is checked once.
        let mut seen = HashSet::new();
        let todo: Vec<(usize, &ChunkRef)> =
            chunks.iter().enumerate().filter(|(_, c)| seen.insert(c.blake3.as_str())).collect();
        let next = std::sync::atomic::AtomicUsize::new(0);
        let first: std::sync::Mutex<Option<(usize, ChunkError)>> = std::sync::Mutex::new(None);
        std::thread::scope(|s| {
            for _ in 0..threads.clamp(1, todo.len().max(1)) {
                s.spawn(|| {
                    let (mut out, mut scratch) = (Vec::new(), Scratch::default());
                    loop {
                        let k = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(&(i, c)) = todo.get(k) else { break };
                        if let Err(e) = self.read_into(&c.blake3, c.size, &mut out, &mut scratch, false) {
                            if let Ok(mut g) = first.lock() {
                                if g.as_ref().is_none_or(|(j, _)| i < *j) {
                                    *g = Some((i, e));
                                }
                            }
                        }
                    }
                });
            }
        });
        match first.into_inner().ok().flatten() {
            Some((_, e)) => Err(e),
            None => Ok(()),
        }
    }

    /// Reads chunk `hash` into `out` (replacing its content), decoded,
    /// without allocating when `out` and `scratch` have room from an
    /// earlier chunk. Its size must be `size`; its blake3 is checked unless
    /// `checked` (the chunk was checked in full earlier in this operation:
    /// the store is root's only, so its bytes are those that were checked,
    /// as an image directory's files are after their verify). Returns
    /// whether it is stored raw.
    pub fn read_into(
        &self,
        hash: &str,
        size: u64,
        out: &mut Vec<u8>,
        scratch: &mut Scratch,
        checked: bool,
    ) -> Result<bool, ChunkError> {
        use std::os::unix::fs::FileExt;
        let corrupt = |why: &str| ChunkError::Corrupt { hash: hash.into(), why: why.into() };
        if !valid_hash(hash) {
            return Err(corrupt("not a blake3 name"));
        }
        if size > MAX_CHUNK as u64 {
            return Err(corrupt("its listed size is larger than a chunk can be"));
        }
        let (f, len, p) = self.open_chunk(hash)?;
        let mut tag = [0u8; 1];
        if len == 0 || f.read_exact_at(&mut tag, 0).is_err() {
            return Err(corrupt("it is empty"));
        }
        let (raw, got) = match tag[0] {
            b'R' => {
                if len != size + 1 {
                    return Err(corrupt("its size is not the listed one"));
                }
                // read_to_end fills spare capacity without zeroing it.
                out.clear();
                out.reserve(size as usize);
                let mut r = std::io::Read::take(&f, size + 1);
                r.read_exact(&mut tag).map_err(io_err(&p, "read"))?;
                r.read_to_end(out).map_err(io_err(&p, "read"))?;
                (true, out.len())
            }
            b'Z' => {
                scratch.enc.clear();
                std::io::Read::take(&f, MAX_ENCODED + 1)
                    .read_to_end(&mut scratch.enc)
                    .map_err(io_err(&p, "read"))?;
                if scratch.dec.is_none() {
                    scratch.dec =
                        Some(zstd::bulk::Decompressor::new().map_err(|e| corrupt(&format!("zstd: {e}")))?);
                }
                let dec = scratch.dec.as_mut().expect("set above");
                // Room for the listed size only: a frame that decodes to
                // more fails here.
                out.clear();
                out.reserve(size as usize);
                let n = dec
                    .decompress_to_buffer(&scratch.enc[1..], out)
                    .map_err(|e| corrupt(&format!("zstd: {e}")))?;
                (false, n)
            }
            _ => return Err(corrupt("unknown encoding")),
        };
        if got as u64 != size {
            return Err(corrupt("its size is not the listed one"));
        }
        if !checked && blake3::hash(out).to_hex().as_str() != hash {
            return Err(corrupt("its content does not match its hash"));
        }
        Ok(raw)
    }

    /// For a chunk checked in full earlier in this operation (see
    /// [`Self::read_into`]) and stored raw: reads `buf.len()` bytes of its
    /// content at `from` straight into `buf`, with no copy and no check.
    /// `Ok(false)`: it is not stored raw (decode it with `read_into`). The
    /// chunk's file stays open in `scratch` for the next read of it (a
    /// chunk's file is never rewritten in place: it is only ever added
    /// whole, under its name, or removed).
    pub fn read_checked_raw_at(
        &self,
        hash: &str,
        size: u64,
        from: u64,
        buf: &mut [u8],
        scratch: &mut Scratch,
    ) -> Result<bool, ChunkError> {
        use std::os::unix::fs::FileExt;
        if from.saturating_add(buf.len() as u64) > size {
            return Err(ChunkError::Corrupt { hash: hash.into(), why: "a read past its end".into() });
        }
        let open = matches!(&scratch.open, Some((h, _, _)) if h == hash);
        if !open {
            scratch.open = None;
            let (f, raw, p) = self.open_raw(hash, size)?;
            scratch.open = Some((hash.to_string(), f, raw.then_some(p)));
        }
        let Some((_, f, Some(p))) = &scratch.open else { return Ok(false) };
        f.read_exact_at(buf, 1 + from).map_err(io_err(p, "read"))?;
        Ok(true)
    }

    /// Opens chunk `hash` of `size` bytes: its file, whether it is stored
    /// raw (a tag byte `R`, then the chunk), and its path.
    fn open_raw(&self, hash: &str, size: u64) -> Result<(fs::File, bool, PathBuf), ChunkError> {
        use std::os::unix::fs::FileExt;
        if !valid_hash(hash) {
            return Err(ChunkError::Corrupt { hash: hash.into(), why: "not a blake3 name".into() });
        }
        let (f, len, p) = self.open_chunk(hash)?;
        let mut tag = [0u8; 1];
        let raw = len == size + 1 && f.read_exact_at(&mut tag, 0).is_ok() && tag[0] == b'R';
        Ok((f, raw, p))
    }

    /// A chunk stored raw mapped from its file (the page cache) rather
    /// than read: the page server copies straight from the mapping into the
    /// woken process, one copy of each byte instead of two (read into a
    /// buffer, then the copy). Not `checked` in full yet: its bytes are
    /// hashed from the mapping first (a bad chunk is `Corrupt`), and then
    /// copied while they are still in the core's caches, instead of a read
    /// into a buffer to hash and copy from. The chunk's bytes are
    /// `map[1..1 + size]`. `None`: the chunk is not stored raw.
    pub fn map_checked_raw(
        &self,
        hash: &str,
        size: u64,
        scratch: &mut Scratch,
        checked: bool,
    ) -> Result<Option<std::sync::Arc<memmap2::Mmap>>, ChunkError> {
        if let Some((h, m)) = &scratch.mapped {
            if h == hash {
                return Ok(Some(m.clone()));
            }
        }
        let (f, raw, p) = self.open_raw(hash, size)?;
        if !raw {
            return Ok(None);
        }
        // SAFETY: the store is root's alone and gpusnap never writes a
        // chunk's file after its rename into place (a chunk is replaced by
        // a new file under the same name, which leaves this mapping on the
        // old one), so the mapped bytes do not change under us; they are
        // only read. The same trust as the checked reads above: root
        // truncating a chunk file in place during a wake would fault here
        // (SIGBUS) where a read would fail.
        let m = unsafe { memmap2::MmapOptions::new().len(size as usize + 1).populate().map(&f) }
            .map_err(io_err(&p, "map"))?;
        if !checked && blake3::hash(&m[1..]).to_hex().as_str() != hash {
            return Err(ChunkError::Corrupt { hash: hash.into(), why: "checksum mismatch".into() });
        }
        // Only checked mappings are kept: a kept one is returned unhashed.
        let m = std::sync::Arc::new(m);
        scratch.mapped = Some((hash.to_string(), m.clone()));
        Ok(Some(m))
    }

    /// Every chunk in the store with its stored size.
    pub fn all(&self) -> Vec<(String, u64)> {
        let mut out = Vec::new();
        let Ok(rd) = fs::read_dir(self.root.join("chunks")) else { return out };
        for d in rd.filter_map(|e| e.ok()) {
            let Ok(inner) = fs::read_dir(d.path()) else { continue };
            for e in inner.filter_map(|e| e.ok()) {
                let name = e.file_name().to_string_lossy().into_owned();
                if valid_hash(&name) {
                    out.push((name, e.metadata().map(|m| m.len()).unwrap_or(0)));
                }
            }
        }
        out
    }

    pub fn stored_bytes(&self) -> u64 {
        self.all().iter().map(|(_, b)| b).sum()
    }

    /// Removes every chunk not in `referenced` (and temporary files of
    /// writers that are gone). The caller holds [`Self::exclusive_lock`],
    /// taken before it read the references, so no push or pull is between
    /// writing a chunk and writing the manifest that refers to it.
    pub fn gc(&self, referenced: &HashSet<String>, mut on_chunk: impl FnMut(u64)) -> GcReport {
        let mut r = GcReport::default();
        for (h, bytes) in self.all() {
            if referenced.contains(&h) {
                r.chunks_kept += 1;
                r.bytes_kept += bytes;
            } else if fs::remove_file(self.path_of(&h)).is_ok() {
                r.chunks_removed += 1;
                r.bytes_freed += bytes;
            }
            on_chunk(1);
        }
        // Temporary files: with the exclusive lock held no writer is active.
        if let Ok(rd) = fs::read_dir(self.root.join("chunks")) {
            for d in rd.filter_map(|e| e.ok()) {
                if let Ok(inner) = fs::read_dir(d.path()) {
                    for e in inner.filter_map(|e| e.ok()) {
                        if e.file_name().to_string_lossy().contains(".tmp-") {
                            let _ = fs::remove_file(e.path());
                        }
                    }
                }
            }
        }
        r
    }
}

fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0),
    );
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

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
