//! An image's files hashed, and chunked into the store, on every core:
//! checksumming an image of tens of GB must not take longer than writing it.

use gpusnap_files::{open_regular, read_bounded};
use std::fs;
use std::path::Path;

/// Hashes a file, reporting bytes as it goes. Large files are mapped and
/// hashed on every core (BLAKE3's tree hashing): checksumming an image of
/// tens of GB must not take longer than writing it.
pub fn hash_file(p: &Path, on_bytes: impl FnMut(u64)) -> std::io::Result<(u64, String)> {
    hash_open(open_regular(p, u64::MAX)?, on_bytes)
}

/// A file's size, blake3 and chunk list (the chunks of a file kept as a
/// file: a small CRIU file). Large files are mapped: the checksum
/// runs on every core (BLAKE3's tree hashing), and so does the chunking
/// (by segments), over one read of the pages.
pub(crate) fn hash_and_chunk(
    p: &Path,
    on_bytes: &mut dyn FnMut(u64),
) -> std::io::Result<(u64, String, Vec<gpusnap_chunks::ChunkRef>)> {
    let f = open_regular(p, u64::MAX)?;
    let len = f.metadata()?.len();
    if len < (16 << 20) {
        let buf = read_bounded(f, len)?;
        on_bytes(buf.len() as u64);
        let chunks = gpusnap_chunks::chunk_slice(&buf, 1, &|_| {});
        return Ok((buf.len() as u64, blake3::hash(&buf).to_hex().to_string(), chunks));
    }
    // SAFETY: a regular file (checked on the descriptor) in the 0700 store,
    // written by this hibernate's CRIU which has exited; a concurrent
    // truncation could fault, which is the risk memmap2 documents for
    // every mapping.
    let map = unsafe { memmap2::Mmap::map(&f)? };
    let _ = map.advise(memmap2::Advice::Sequential);
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let done = std::sync::atomic::AtomicU64::new(0);
    let (hash, chunks) = std::thread::scope(|s| {
        let chunker = s.spawn(|| {
            gpusnap_chunks::chunk_slice(&map, threads, &|n| {
                done.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
            })
        });
        let mut h = blake3::Hasher::new();
        h.update_rayon(&map);
        (h.finalize().to_hex().to_string(), chunker.join())
    });
    let chunks = chunks.map_err(|_| std::io::Error::other("chunking thread panicked"))?;
    on_bytes(done.load(std::sync::atomic::Ordering::Relaxed));
    Ok((map.len() as u64, hash, chunks))
}

/// A pages file's size and blake3, its chunks stored (staged) in `store`:
/// the file is mapped and chunked, hashed and compressed on every core,
/// while its whole checksum runs beside (BLAKE3's tree hashing), over one
/// read of the pages.
pub(crate) fn store_file(
    p: &Path,
    store: &gpusnap_chunks::LocalStore,
    durable: bool,
    on_bytes: &mut dyn FnMut(u64),
) -> std::io::Result<(u64, String, gpusnap_chunks::Stored)> {
    let f = open_regular(p, u64::MAX)?;
    let len = f.metadata()?.len();
    if len == 0 {
        return Ok((0, blake3::hash(&[]).to_hex().to_string(), gpusnap_chunks::Stored::default()));
    }
    // SAFETY: as in hash_and_chunk: a regular file of this hibernate's
    // image, written by its CRIU which has exited.
    let map = unsafe { memmap2::Mmap::map(&f)? };
    let _ = map.advise(memmap2::Advice::Sequential);
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let done = std::sync::atomic::AtomicU64::new(0);
    let (hash, stored) = std::thread::scope(|s| {
        let chunker = s.spawn(|| {
            gpusnap_chunks::store_slice(&map, threads, store, durable, &|n| {
                done.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
            })
        });
        let mut h = blake3::Hasher::new();
        h.update_rayon(&map);
        (h.finalize().to_hex().to_string(), chunker.join())
    });
    let stored = stored
        .map_err(|_| std::io::Error::other("chunking thread panicked"))?
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    on_bytes(done.load(std::sync::atomic::Ordering::Relaxed));
    Ok((map.len() as u64, hash, stored))
}

/// Hashes a file opened by [`open_regular`].
pub(crate) fn hash_open(f: fs::File, mut on_bytes: impl FnMut(u64)) -> std::io::Result<(u64, String)> {
    const CHUNK: usize = 256 << 20;
    let len = f.metadata()?.len();
    let mut h = blake3::Hasher::new();
    if len < (16 << 20) {
        let buf = read_bounded(f, len)?;
        h.update(&buf);
        on_bytes(buf.len() as u64);
        return Ok((buf.len() as u64, h.finalize().to_hex().to_string()));
    }
    // SAFETY: a regular file (checked on the descriptor) in the 0700 store
    // or being copied into it; a concurrent truncation could fault, which
    // is the risk memmap2 documents for every mapping.
    let map = unsafe { memmap2::Mmap::map(&f)? };
    let _ = map.advise(memmap2::Advice::Sequential);
    for chunk in map.chunks(CHUNK) {
        h.update_rayon(chunk);
        on_bytes(chunk.len() as u64);
    }
    Ok((map.len() as u64, h.finalize().to_hex().to_string()))
}
