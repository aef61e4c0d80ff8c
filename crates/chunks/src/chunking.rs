//! Cutting data into chunks ([`Cuts`]) by segments on every core, hashed,
//! and (for [`store_slice`]) compressed and staged in the local store.

use crate::codec::encode;
use crate::local::{LocalStore, Staged};
use crate::{ChunkError, ChunkRef, Cuts};
use std::collections::HashSet;

use std::io::Read;
/// The chunks of one segment (or a whole slice), each with its bytes: cut
/// ([`Cuts`]) and hashed. Every chunking of the store goes through here.
pub(crate) fn cut_chunks(seg: &[u8]) -> impl Iterator<Item = (ChunkRef, &[u8])> {
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

pub(crate) fn chunk_segments(
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
