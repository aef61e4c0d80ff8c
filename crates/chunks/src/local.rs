//! The local chunk store, `STATE/store`: chunks staged, named once durable,
//! read back checked, locked against a concurrent gc, and collected.

use crate::codec::{decode, encode, MAX_ENCODED};
use crate::io_err;
use crate::valid_hash;
use crate::{ChunkError, ChunkRef, MAX_CHUNK};
use serde::Serialize;
use std::collections::HashSet;
use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

/// A chunk written under a temporary name, its write-back started, not yet
/// under its own name: [`LocalStore::finish`] makes it durable and names
/// it. A chunk is never under its name before its bytes are on disk (when
/// asked to be durable), or a crash could leave a torn chunk that later
/// images would deduplicate against.
#[derive(Debug)]
pub struct Staged {
    pub(crate) tmp: PathBuf,
    pub(crate) dest: PathBuf,
    /// Its encoded size.
    pub bytes: u64,
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
    pub(crate) root: PathBuf,
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
    /// (bench/cpu/chunks-hibernate.sh, docs/benchmarks.md): an
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

pub(crate) fn rand_u64() -> u64 {
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
