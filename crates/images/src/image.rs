//! Images: a directory per hibernated process tree.
//!
//! ```text
//! NAME/
//!   manifest.json   magic, format, who/where/when, driver and GPUs, processes
//!                   with their footprints, CRIU version, the signer's key,
//!                   size and blake3 of every file
//!   manifest.sig    ed25519 signature of manifest.json by the signer ([`crate::sign`])
//!   criu/           CRIU's image files and dump.log, every one listed
//! ```
//! An image is written under a temporary name and renamed when complete, and
//! is readable only by its owner (0700/0600): it is the memory of a process,
//! secrets included.
//!
//! An image is untrusted input (it may come from another host, and CRIU runs
//! it as root): it may hold nothing but those regular files (no links, no
//! hard links, no FIFOs or devices, nothing unlisted), every read is bounded
//! and made only after the file's type is checked on the open descriptor,
//! and it is verified in full before anything is restored. CRIU reads only
//! images inside the store (root-owned, 0700, refused when others can write
//! it: nobody else can change a file between its verification and CRIU's
//! read); an image given by path is copied into the store, verified as it is
//! copied. See docs/images.md.

use gpusnap_files::{create_private, mkdir_private, open_regular, read_bounded, write_private};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

pub const MAGIC: &str = "gpusnap-image";
/// 2: signed (`manifest.sig`, `signer`); 1 was checksummed only.
pub const FORMAT: u32 = 2;
/// A manifest larger than this is not ours (Firecracker-style bound on reads).
const MAX_MANIFEST: u64 = 16 << 20;
pub(crate) const MAX_SIG: u64 = 4096;
pub(crate) const MANIFEST: &str = "manifest.json";
pub(crate) const SIG: &str = "manifest.sig";

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("no image {0}")]
    Missing(String),
    #[error("image {name} is not a gpusnap image: {why}")]
    Foreign { name: String, why: String },
    #[error("image {name} has format {found}; this gpusnap reads format {FORMAT}: upgrade gpusnap")]
    Newer { name: String, found: u32 },
    #[error("image {name} is corrupt: {why}")]
    Corrupt { name: String, why: String },
    #[error("image {0} already exists (remove it with `gpusnap images rm`, or choose another --image)")]
    Exists(String),
    #[error("image {name} cannot be trusted: {why}")]
    Untrusted { name: String, why: String },
    #[error("{name:?} is not an image name or path: {why}")]
    BadName { name: String, why: String },
    #[error("image {name}: {op}: {err}")]
    Io { name: String, op: String, err: std::io::Error },
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GpuDesc {
    pub uuid: String,
    pub name: String,
    pub total_bytes: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProcDesc {
    pub pid: i32,
    pub ppid: i32,
    pub start_time: u64,
    pub comm: String,
    /// It held CUDA state when dumped (so it is checkpointed in the image).
    pub cuda: bool,
    /// Its CUDA state was running before hibernate (wake resumes it).
    pub was_running: bool,
    /// Device memory per GPU UUID.
    pub footprint: BTreeMap<String, u64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FileDesc {
    pub path: String,
    pub size: u64,
    pub blake3: String,
    /// The file's content-defined chunks, in order (signed with the rest of
    /// the manifest: what `images push` sends and `pull` reassembles). Empty
    /// for an empty file and in images taken before chunk lists.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub chunks: Vec<gpusnap_chunks::ChunkRef>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Manifest {
    pub magic: String,
    pub format: u32,
    pub gpusnap_version: String,
    pub name: String,
    pub host: String,
    pub created_ms: i64,
    pub driver_api: Option<i32>,
    pub driver_version: Option<String>,
    pub gpus: Vec<GpuDesc>,
    /// Every GPU the image's CUDA processes could see (a restore onto other
    /// GPUs must map them all).
    #[serde(default)]
    pub visible_gpus: Vec<GpuDesc>,
    pub root_pid: i32,
    pub processes: Vec<ProcDesc>,
    pub criu_version: String,
    /// The public key (hex) of the host that wrote and signed it.
    #[serde(default)]
    pub signer: String,
    pub files: Vec<FileDesc>,
    /// The pages of its own files (libraries, ...) the tree had in memory,
    /// read ahead by a wake (see `crate::workingset`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub file_pages: Vec<crate::workingset::FilePages>,
}

/// Files kept as chunks in `STATE/store`, not in the image directory: the
/// pages files (a process's memory, nearly all of an image's bytes, and
/// what replicas share). CRIU's other files are small and stay files.
pub fn chunked_name(path: &str) -> bool {
    Path::new(path)
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with("pages-") && n.ends_with(".img"))
}

impl FileDesc {
    /// Is this file held by the store in the image at `dir` (a pages file
    /// with a chunk list and no file of its own there)? A pages file still
    /// in the directory (an image from before, not yet imported) is read
    /// and verified whole, as it always was.
    pub fn in_store(&self, dir: &Path) -> bool {
        chunked_name(&self.path)
            && !self.chunks.is_empty()
            && fs::symlink_metadata(dir.join(&self.path))
                .is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound)
    }

    /// The chunk list covers exactly the file's bytes.
    pub fn check_chunk_list(&self, name: &str) -> Result<(), ImageError> {
        let sum = self.chunks.iter().fold(0u64, |a, c| a.saturating_add(c.size));
        if sum != self.size
            || self.chunks.iter().any(|c| {
                !gpusnap_chunks::valid_hash(&c.blake3)
                    || c.size == 0
                    || c.size > gpusnap_chunks::MAX_CHUNK as u64
            })
        {
            return Err(ImageError::Corrupt {
                name: name.into(),
                why: format!("{}: its chunk list does not cover the file", self.path),
            });
        }
        Ok(())
    }
}

/// How much of a store-held file [`ImageStore::verify_with`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkCheck {
    /// Every chunk read, decoded and checked against its hash.
    Full,
    /// Every chunk present in the local store (a wake: each chunk is
    /// checked as it is read).
    Present,
    /// The chunk lists only (a wake streaming from a remote).
    Listed,
}

impl Manifest {
    pub fn footprint_by_gpu(&self) -> BTreeMap<String, u64> {
        let mut out = BTreeMap::new();
        for p in &self.processes {
            for (u, b) in &p.footprint {
                let e = out.entry(u.clone()).or_insert(0u64);
                *e = e.saturating_add(*b);
            }
        }
        out
    }

    // Saturating: the numbers come from an untrusted manifest.
    pub fn footprint_total(&self) -> u64 {
        self.footprint_by_gpu().values().fold(0u64, |a, b| a.saturating_add(*b))
    }

    pub fn total_bytes(&self) -> u64 {
        self.files.iter().fold(0u64, |a, f| a.saturating_add(f.size))
    }
}

/// One pages file as a follower saw it while CRIU wrote it: its size,
/// checksum and chunks, stored (staged) in the store.
#[derive(Debug)]
pub struct FollowedFile {
    pub size: u64,
    pub blake3: String,
    pub stored: gpusnap_chunks::Stored,
}

/// The pages files chunked before the commit (by their path under the
/// image directory, e.g. `criu/pages-1.img`): what [`PendingImage::commit_followed`]
/// takes instead of chunking them again.
#[derive(Default)]
pub struct Prechunked {
    pub files: BTreeMap<String, FollowedFile>,
    /// The store's shared lock, held from the first chunk staged until the
    /// manifest that refers to them is in place (`images gc` waits).
    pub lock: Option<gpusnap_chunks::StoreLock>,
    /// The pages files are outside the image directory (a tmpfs dump
    /// directory) and are not copied into it: the commit takes them from
    /// there alone.
    pub elsewhere: bool,
}

pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && !name.starts_with('.')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

pub(crate) fn io(name: &str, op: impl Into<String>) -> impl FnOnce(std::io::Error) -> ImageError + '_ {
    let op = op.into();
    move |err| ImageError::Io { name: name.to_string(), op, err }
}

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
fn hash_and_chunk(
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
fn store_file(
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
fn hash_open(f: fs::File, mut on_bytes: impl FnMut(u64)) -> std::io::Result<(u64, String)> {
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

/// Every regular file under `dir`, as paths relative to `base`.
fn files_under(base: &Path, dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for e in fs::read_dir(dir)? {
        let e = e?;
        let ft = e.file_type()?;
        if ft.is_dir() {
            files_under(base, &e.path(), out)?;
        } else if ft.is_file() {
            out.push(e.path().strip_prefix(base).unwrap_or(&e.path()).to_path_buf());
        }
    }
    Ok(())
}

/// An image being written: a temporary directory that becomes the image only
/// when [`PendingImage::commit`] renames it. Dropped uncommitted, it is removed.
pub struct PendingImage {
    pub name: String,
    pub dir: PathBuf,
    final_dir: PathBuf,
    state_dir: PathBuf,
    committed: bool,
}

impl PendingImage {
    pub fn criu_dir(&self) -> PathBuf {
        self.dir.join("criu")
    }

    /// Checksums every file, writes the manifest and renames the directory
    /// into place. Returns the final manifest.
    /// With `durable`, the image's pages are on disk before this returns.
    pub fn commit(
        self,
        m: Manifest,
        durable: bool,
        on_bytes: impl FnMut(u64),
    ) -> Result<Manifest, ImageError> {
        self.commit_followed(m, durable, None, on_bytes)
    }

    /// [`Self::commit`], taking the pages files a follower (gpusnap-hibernate's)
    /// chunked while CRIU wrote them (checked to be the files as they are
    /// now: same size); the others are chunked here.
    pub fn commit_followed(
        mut self,
        mut m: Manifest,
        durable: bool,
        followed: Option<Prechunked>,
        mut on_bytes: impl FnMut(u64),
    ) -> Result<Manifest, ImageError> {
        let name = self.name.clone();
        let (mut followed, _follow_lock, elsewhere) = match followed {
            Some(f) => (f.files, f.lock, f.elsewhere),
            None => (BTreeMap::new(), None, false),
        };
        // The flush to disk runs while the files are hashed (one is disk
        // bound, the other CPU bound); both end before the rename.
        let dir = self.dir.clone();
        // The pages files become chunks and are removed: never flushed.
        let flush =
            std::thread::spawn(move || if durable { sync_tree_but(&dir, chunked_name) } else { Ok(()) });
        let mut rel = Vec::new();
        files_under(&self.dir, &self.dir.join("criu"), &mut rel).map_err(io(&name, "list files"))?;
        rel.sort();
        m.files.clear();
        let chunk_err = |e: gpusnap_chunks::ChunkError| ImageError::Io {
            name: name.clone(),
            op: "store chunks".into(),
            err: std::io::Error::other(e.to_string()),
        };
        let store = gpusnap_chunks::LocalStore::open(self.state_dir.join("store")).map_err(chunk_err)?;
        // Held until the manifest that refers to the new chunks is in
        // place: `images gc` (exclusive) never removes them in between.
        let _lock = store.shared_lock().map_err(chunk_err)?;
        // Whatever fails below, no staged chunk stays behind (the
        // follower's included).
        let mut guard = StagedGuard { store: &store, staged: Vec::new() };
        for f in followed.values_mut() {
            guard.staged.append(&mut f.stored.staged);
        }
        let staged = &mut guard.staged;
        let mut to_remove = Vec::new();
        for r in rel {
            let p = self.dir.join(&r);
            let rs = r.to_string_lossy().into_owned();
            fs::set_permissions(&p, fs::Permissions::from_mode(0o600)).map_err(io(&name, "chmod"))?;
            let now = fs::symlink_metadata(&p).map(|md| md.len());
            let stored = if let Some(f) = followed.remove(&rs) {
                if now.as_ref().ok() != Some(&f.size) {
                    store.abandon(std::mem::take(staged));
                    return Err(ImageError::Io {
                        name: name.clone(),
                        op: format!("store {}", r.display()),
                        err: std::io::Error::other(format!(
                            "it changed after it was chunked ({} bytes then, {:?} now)",
                            f.size, now
                        )),
                    });
                }
                on_bytes(f.size);
                (f.size, f.blake3, f.stored)
            } else if chunked_name(&rs) {
                store_file(&p, &store, durable, &mut on_bytes).map_err(|e| {
                    store.abandon(std::mem::take(staged));
                    io(&name, format!("store {}", r.display()))(e)
                })?
            } else {
                let (size, hash, chunks) =
                    hash_and_chunk(&p, &mut on_bytes).map_err(io(&name, format!("hash {}", r.display())))?;
                (size, hash, gpusnap_chunks::Stored { chunks, staged: Vec::new() })
            };
            let (size, hash, st) = stored;
            if chunked_name(&rs) && !st.chunks.is_empty() {
                to_remove.push(p);
            }
            staged.extend(st.staged);
            m.files.push(FileDesc { path: rs, size, blake3: hash, chunks: st.chunks });
        }
        if elsewhere {
            // Followed on a tmpfs and never copied here (gpusnap_hibernate::dumpdir):
            // the manifest lists them in the order of the files here.
            for (rs, f) in std::mem::take(&mut followed) {
                on_bytes(f.size);
                staged.extend(f.stored.staged);
                m.files.push(FileDesc { path: rs, size: f.size, blake3: f.blake3, chunks: f.stored.chunks });
            }
            m.files.sort_by(|a, b| Path::new(&a.path).cmp(Path::new(&b.path)));
        }
        if let Some(rs) = followed.keys().next() {
            // A pages file followed and then gone: not CRIU's doing.
            store.abandon(std::mem::take(staged));
            return Err(ImageError::Io {
                name: name.clone(),
                op: format!("store {rs}"),
                err: std::io::Error::other("it was chunked, then removed"),
            });
        }
        // The pages files CRIU wrote go before the chunks are flushed: a
        // syncfs with them still there would write the memory to the disk
        // twice (their dirty pages, then the chunks). Nothing depends on
        // them any more: this image is not committed yet, its process is
        // still alive (stopped) until the commit returns, and a commit that
        // fails removes the whole pending image and lets the process run on.
        for p in &to_remove {
            fs::remove_file(p).map_err(|e| {
                store.abandon(std::mem::take(staged));
                io(&name, "remove a stored pages file")(e)
            })?;
        }
        // The chunks under their names (on disk first when durable): the
        // image is whole once its manifest is renamed into place.
        store.finish(std::mem::take(staged), durable).map_err(chunk_err)?;
        let key = crate::sign::HostKey::load_or_create(&self.state_dir).map_err(|e| ImageError::Io {
            name: name.clone(),
            op: "sign".into(),
            err: std::io::Error::other(e.to_string()),
        })?;
        m.signer = key.public_hex();
        let body = serde_json::to_vec_pretty(&m).map_err(|e| ImageError::Io {
            name: name.clone(),
            op: "encode manifest".into(),
            err: std::io::Error::other(e),
        })?;
        write_private(&self.dir.join(MANIFEST), &body).map_err(io(&name, "write manifest"))?;
        let sig = serde_json::to_vec_pretty(&key.sign(&body)).map_err(|e| ImageError::Io {
            name: name.clone(),
            op: "encode signature".into(),
            err: std::io::Error::other(e),
        })?;
        write_private(&self.dir.join(SIG), &sig).map_err(io(&name, "write manifest.sig"))?;
        // The image's pages reach the disk before it counts as written (and
        // before hibernate ends the process it holds); the manifest is
        // fsynced as it is written.
        flush
            .join()
            .map_err(|_| ImageError::Io {
                name: name.clone(),
                op: "sync".into(),
                err: std::io::Error::other("flush thread panicked"),
            })?
            .map_err(io(&name, "sync"))?;
        sync_dir(&self.dir).map_err(io(&name, "sync"))?;
        if fs::symlink_metadata(&self.final_dir).is_ok() {
            return Err(ImageError::Exists(name));
        }
        fs::rename(&self.dir, &self.final_dir).map_err(io(&name, "rename into place"))?;
        if let Some(parent) = self.final_dir.parent() {
            sync_dir(parent).map_err(io(&name, "sync"))?;
        }
        self.committed = true;
        Ok(m)
    }
}

/// Staged chunks abandoned when dropped (a commit that fails part-way).
struct StagedGuard<'a> {
    store: &'a gpusnap_chunks::LocalStore,
    staged: Vec<gpusnap_chunks::Staged>,
}

impl Drop for StagedGuard<'_> {
    fn drop(&mut self) {
        self.store.abandon(std::mem::take(&mut self.staged));
    }
}

impl PendingImage {
    /// Renames a complete directory into place (no manifest written here).
    pub(crate) fn install(mut self) -> std::io::Result<()> {
        sync_dir(&self.dir)?;
        if fs::symlink_metadata(&self.final_dir).is_ok() {
            return Err(std::io::Error::from(std::io::ErrorKind::AlreadyExists));
        }
        fs::rename(&self.dir, &self.final_dir)?;
        if let Some(parent) = self.final_dir.parent() {
            sync_dir(parent)?;
        }
        self.committed = true;
        Ok(())
    }
}

impl Drop for PendingImage {
    fn drop(&mut self) {
        if !self.committed {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

/// Queues the dirty pages of every file under `dir` for write-back and
/// returns at once (sync_file_range WRITE: no waiting). Called while CRIU
/// is still writing, so that the disk works alongside it and little is left
/// for [`sync_tree`] at the end. Only the image's own files: unlike a
/// syncfs, another program's dirty data on the same filesystem never makes
/// a hibernate wait.
pub fn start_writeback(dir: &Path) {
    use std::os::fd::AsRawFd;
    let mut rel = Vec::new();
    if files_under(dir, dir, &mut rel).is_err() {
        return;
    }
    // Pages files become chunks: writing them back would put the memory
    // on the disk twice (the file, then its chunks).
    for r in rel.into_iter().filter(|r| !chunked_name(&r.to_string_lossy())) {
        if let Ok(f) = fs::File::open(dir.join(r)) {
            // SAFETY: a valid fd; offset 0 and length 0 mean the whole file.
            unsafe { libc::sync_file_range(f.as_raw_fd(), 0, 0, libc::SYNC_FILE_RANGE_WRITE) };
        }
    }
}

/// Puts every file under `dir`, and the directories themselves, on disk
/// (fdatasync each: one page file holds nearly all of an image's bytes).
pub fn sync_tree(dir: &Path) -> std::io::Result<()> {
    sync_tree_but(dir, |_| false)
}

/// [`sync_tree`], leaving out the files `skip` names (by their path).
fn sync_tree_but(dir: &Path, skip: fn(&str) -> bool) -> std::io::Result<()> {
    let mut rel = Vec::new();
    files_under(dir, dir, &mut rel)?;
    for r in rel.iter().filter(|r| !skip(&r.to_string_lossy())) {
        fs::File::open(dir.join(r))?.sync_data()?;
    }
    let mut dirs: Vec<PathBuf> = rel.iter().filter_map(|r| r.parent().map(|p| dir.join(p))).collect();
    dirs.sort();
    dirs.dedup();
    for d in dirs {
        sync_dir(&d)?;
    }
    sync_dir(dir)
}

fn sync_dir(p: &Path) -> std::io::Result<()> {
    fs::File::open(p)?.sync_all()
}

/// Where images live: `<state dir>/images`, trusting the signatures of
/// [`crate::sign::Trust`].
#[derive(Debug, Clone)]
pub struct ImageStore {
    pub root: PathBuf,
    trust: crate::sign::Trust,
}

/// An image's name: the directory's own, never one its manifest claims.
pub type Named = (String, Manifest);

/// A temporary directory of the store left by a gpusnap that is gone
/// (killed mid-hibernate or mid-removal).
#[derive(Debug, Clone, Serialize)]
pub struct Stale {
    pub path: PathBuf,
    pub bytes: u64,
}

impl ImageStore {
    pub fn new(root: PathBuf, trust: crate::sign::Trust) -> Self {
        Self { root, trust }
    }

    /// The state directory the store lives in (`STATE/images`).
    pub fn state_dir(&self) -> &Path {
        self.root.parent().unwrap_or(&self.root)
    }

    /// `name` is an image of this store, or (with a `/`) a path to an
    /// image directory; anything else is refused.
    pub fn locate(&self, name: &str) -> Result<PathBuf, ImageError> {
        if valid_name(name) {
            return Ok(self.root.join(name));
        }
        if name.contains('/') && !name.trim_matches('/').is_empty() {
            return Ok(PathBuf::from(name));
        }
        Err(ImageError::BadName {
            name: name.chars().take(200).collect(),
            why: "names are letters, digits, '-', '_' and '.', not starting with '.' (or give a path to an image directory)".into(),
        })
    }

    /// Is `dir` this store's own directory for an image (not a path elsewhere)?
    fn in_store(&self, dir: &Path) -> bool {
        if dir.parent() == Some(self.root.as_path()) {
            return true;
        }
        // The same directory by another spelling (a linked state dir, `//`).
        let parent = dir.parent().and_then(|p| fs::canonicalize(p).ok());
        parent.is_some() && parent == fs::canonicalize(&self.root).ok()
    }

    /// Starts a new image `name` (which must not exist yet).
    pub fn begin(&self, name: &str) -> Result<PendingImage, ImageError> {
        if !valid_name(name) {
            return Err(ImageError::Foreign {
                name: name.into(),
                why: "names are letters, digits, '-', '_' and '.', not starting with '.'".into(),
            });
        }
        mkdir_private(&self.root).map_err(io(name, "create the image directory"))?;
        // Every hibernate clears what killed ones left behind.
        self.gc();
        let final_dir = self.root.join(name);
        if fs::symlink_metadata(&final_dir).is_ok() {
            return Err(ImageError::Exists(name.into()));
        }
        let dir = self.root.join(format!(".{name}.tmp-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        mkdir_private(&dir).map_err(io(name, "create"))?;
        mkdir_private(&dir.join("criu")).map_err(io(name, "create"))?;
        Ok(PendingImage {
            name: name.into(),
            dir,
            final_dir,
            state_dir: self.state_dir().to_path_buf(),
            committed: false,
        })
    }

    /// The directory of an image, which must be a real directory (not a link).
    fn image_dir(&self, name: &str) -> Result<PathBuf, ImageError> {
        let dir = self.locate(name)?;
        match fs::symlink_metadata(&dir) {
            Err(_) => Err(ImageError::Missing(name.into())),
            Ok(m) if m.file_type().is_symlink() => Err(ImageError::Foreign {
                name: name.into(),
                why: "it is a symbolic link, not an image directory".into(),
            }),
            Ok(m) if !m.is_dir() => {
                Err(ImageError::Foreign { name: name.into(), why: "not a directory".into() })
            }
            Ok(_) => Ok(dir),
        }
    }

    /// Reads the manifest and its signature (bounded reads, regular files
    /// only) and checks them: magic, format, signed by a trusted key.
    pub fn manifest(&self, name: &str) -> Result<(PathBuf, Manifest), ImageError> {
        let dir = self.image_dir(name)?;
        let (body, m) = read_manifest(name, &dir)?;
        let corrupt = |why: String| ImageError::Corrupt { name: name.into(), why };
        let sig = match open_regular(&dir.join(SIG), MAX_SIG) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(ImageError::Untrusted {
                    name: name.into(),
                    why: "it is not signed (no manifest.sig; images of gpusnap before format 2 must be taken again)".into(),
                })
            }
            Err(e) => return Err(corrupt(format!("manifest.sig: {e}"))),
            Ok(f) => read_bounded(f, MAX_SIG).map_err(|e| corrupt(format!("manifest.sig: {e}")))?,
        };
        self.check_signature(name, &body, &sig, &m)?;
        check_paths(name, &m)?;
        Ok((dir, m))
    }

    /// `sig` is a signature of `body` by a trusted key, and the manifest
    /// names that key as its signer.
    pub(crate) fn check_signature(
        &self,
        name: &str,
        body: &[u8],
        sig: &[u8],
        m: &Manifest,
    ) -> Result<(), ImageError> {
        let corrupt = |why: String| ImageError::Corrupt { name: name.into(), why };
        let env: crate::sign::Envelope =
            serde_json::from_slice(sig).map_err(|e| corrupt(format!("manifest.sig: {e}")))?;
        let key = self
            .trust
            .check(body, &env)
            .map_err(|e| ImageError::Untrusted { name: name.into(), why: e.to_string() })?;
        if !m.signer.eq_ignore_ascii_case(&key) {
            return Err(ImageError::Untrusted {
                name: name.into(),
                why: "its manifest names another signer than the one who signed it".into(),
            });
        }
        Ok(())
    }

    /// Checks the whole image: the manifest (signed), then that the
    /// directory holds exactly the listed files, each a regular file of its
    /// size and checksum.
    /// A pages file held by the store counts as its chunks: with
    /// [`ImageStore::verify`], every one is read and checked.
    pub fn verify(&self, name: &str, on_bytes: impl FnMut(u64)) -> Result<(PathBuf, Manifest), ImageError> {
        self.verify_with(name, ChunkCheck::Full, on_bytes)
    }

    /// [`ImageStore::verify`], reading the store's chunks as `check` says
    /// (the small files are always checked whole).
    pub fn verify_with(
        &self,
        name: &str,
        check: ChunkCheck,
        mut on_bytes: impl FnMut(u64),
    ) -> Result<(PathBuf, Manifest), ImageError> {
        let (dir, m) = self.manifest(name)?;
        check_contents(name, &dir, &m)?;
        for f in &m.files {
            if f.in_store(&dir) {
                f.check_chunk_list(name)?;
                self.check_chunks(name, f, check, &mut on_bytes)?;
                continue;
            }
            let file = open_listed(name, &dir, f)?;
            let (_, h) = hash_open(file, &mut on_bytes).map_err(io(name, format!("read {}", f.path)))?;
            if h != f.blake3 {
                return Err(ImageError::Corrupt {
                    name: name.into(),
                    why: format!("{} fails its checksum", f.path),
                });
            }
        }
        Ok((dir, m))
    }

    /// The chunks of a store-held file, checked as `check` says (on every
    /// core for [`ChunkCheck::Full`]).
    fn check_chunks(
        &self,
        name: &str,
        f: &FileDesc,
        check: ChunkCheck,
        on_bytes: &mut dyn FnMut(u64),
    ) -> Result<(), ImageError> {
        let chunk_err = |e: gpusnap_chunks::ChunkError| match e {
            gpusnap_chunks::ChunkError::Corrupt { hash, why } => ImageError::Corrupt {
                name: name.into(),
                why: format!("{}: chunk {hash} fails its checksum ({why})", f.path),
            },
            gpusnap_chunks::ChunkError::Missing(hash) => ImageError::Corrupt {
                name: name.into(),
                why: format!("{}: chunk {hash} is missing from the store (pull the image again)", f.path),
            },
            e => ImageError::Io {
                name: name.into(),
                op: "read chunks".into(),
                err: std::io::Error::other(e.to_string()),
            },
        };
        let store = crate::remote::local_store(self).map_err(chunk_err)?;
        match check {
            ChunkCheck::Listed => Ok(()),
            ChunkCheck::Present => {
                // A stat per chunk: thousands for a 20 GB image, on the
                // wake's critical path, so on several threads.
                let per = f.chunks.len().div_ceil(8).max(512);
                let missing = std::thread::scope(|s| {
                    let parts: Vec<_> = f
                        .chunks
                        .chunks(per)
                        .map(|part| {
                            s.spawn(|| part.iter().find(|c| !store.has(&c.blake3)).map(|c| c.blake3.clone()))
                        })
                        .collect();
                    parts
                        .into_iter()
                        .find_map(|h| h.join().unwrap_or_else(|_| Some("(a check thread panicked)".into())))
                });
                if let Some(hash) = missing {
                    return Err(chunk_err(gpusnap_chunks::ChunkError::Missing(hash)));
                }
                on_bytes(f.size);
                Ok(())
            }
            ChunkCheck::Full => {
                let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(4).clamp(1, 16);
                let r = store.verify_chunks(&f.chunks, threads);
                on_bytes(f.size);
                r.map_err(chunk_err)
            }
        }
    }

    /// An image ready for CRIU: verified, and inside the store. An image
    /// given by path is first copied into the store (as its directory's
    /// name), verified as it is copied, so that CRIU reads only bytes that
    /// were checked and that nobody else can change.
    /// The last field: every chunk of the image's store-held files was read
    /// and checked in full here (`check` was [`ChunkCheck::Full`] and the
    /// image was in the store already; an imported image's chunks may be
    /// ones the store had).
    pub fn verified_in_store(
        &self,
        name: &str,
        check: ChunkCheck,
        on_bytes: impl FnMut(u64),
    ) -> Result<(String, PathBuf, Manifest, bool), ImageError> {
        let dir = self.locate(name)?;
        if self.in_store(&dir) {
            let (dir, m) = self.verify_with(name, check, on_bytes)?;
            return Ok((name.to_string(), dir, m, check == ChunkCheck::Full));
        }
        let (name, dir, m) = self.import(name, on_bytes)?;
        Ok((name, dir, m, false))
    }

    /// Copies the image at `path` into the store under its directory's name
    /// (its pages files as chunks); an image of the store whose pages files
    /// are still files (taken before images were chunks) is migrated in place.
    pub fn import(
        &self,
        path: &str,
        mut on_bytes: impl FnMut(u64),
    ) -> Result<(String, PathBuf, Manifest), ImageError> {
        let (src, m) = self.manifest(path)?;
        check_contents(path, &src, &m)?;
        let chunk_err = |e: gpusnap_chunks::ChunkError| ImageError::Io {
            name: path.into(),
            op: "store chunks".into(),
            err: std::io::Error::other(e.to_string()),
        };
        let store = crate::remote::local_store(self).map_err(chunk_err)?;
        let _lock = store.shared_lock().map_err(chunk_err)?;
        if self.in_store(&src) {
            // Each pages file: its chunks stored (checked against the signed
            // list, durable), then the file removed; a crash in between
            // leaves the file, which is still the image.
            for f in
                m.files.iter().filter(|f| chunked_name(&f.path) && !f.chunks.is_empty() && !f.in_store(&src))
            {
                f.check_chunk_list(path)?;
                let file = open_listed(path, &src, f)?;
                put_chunks_of(path, file, f, &store, &mut on_bytes)?;
                fs::remove_file(src.join(&f.path)).map_err(io(path, format!("remove {}", f.path)))?;
            }
            sync_dir(&src.join("criu")).map_err(io(path, "sync"))?;
            let (dir, m) = self.verify(path, |_| {})?;
            return Ok((path.to_string(), dir, m));
        }
        let base = src
            .file_name()
            .and_then(|n| n.to_str())
            .filter(|n| valid_name(n))
            .ok_or_else(|| ImageError::BadName {
                name: path.into(),
                why: "its directory's name is not a valid image name".into(),
            })?
            .to_string();
        let pending = self.begin(&base)?;
        for f in &m.files {
            if f.in_store(&src) {
                // Chunks already (of this host's store, or none at all: the
                // check below finds them missing).
                f.check_chunk_list(path)?;
                continue;
            }
            if chunked_name(&f.path) && !f.chunks.is_empty() {
                f.check_chunk_list(path)?;
                put_chunks_of(path, open_listed(path, &src, f)?, f, &store, &mut on_bytes)?;
                continue;
            }
            let mut from = open_listed(path, &src, f)?;
            let to_path = pending.dir.join(&f.path);
            if let Some(parent) = to_path.parent() {
                mkdir_private(parent).map_err(io(path, "create"))?;
            }
            let mut to = create_private(&to_path).map_err(io(path, format!("copy {}", f.path)))?;
            // Hashed as copied: what is checked is what lands in the store.
            let mut h = blake3::Hasher::new();
            let mut buf = vec![0u8; 1 << 20];
            let mut n = 0u64;
            loop {
                let k = from.read(&mut buf).map_err(io(path, format!("read {}", f.path)))?;
                if k == 0 {
                    break;
                }
                n += k as u64;
                if n > f.size {
                    break;
                }
                h.update(&buf[..k]);
                to.write_all(&buf[..k]).map_err(io(path, format!("copy {}", f.path)))?;
                on_bytes(k as u64);
            }
            if n != f.size || h.finalize().to_hex().as_str() != f.blake3 {
                return Err(ImageError::Corrupt {
                    name: path.into(),
                    why: format!("{} fails its checksum", f.path),
                });
            }
            to.sync_data().map_err(io(path, "sync"))?;
        }
        // The manifest and its signature as they were: the signature covers
        // those exact bytes.
        let (body, _) = read_manifest(path, &src)?;
        let sig = open_regular(&src.join(SIG), MAX_SIG)
            .and_then(|f| read_bounded(f, MAX_SIG))
            .map_err(io(path, "read manifest.sig"))?;
        write_private(&pending.dir.join(MANIFEST), &body).map_err(io(path, "write manifest"))?;
        write_private(&pending.dir.join(SIG), &sig).map_err(io(path, "write manifest.sig"))?;
        let final_dir = pending.final_dir.clone();
        pending.install().map_err(io(path, "rename into place"))?;
        // Read back as the store's own image (signature and all).
        let (dir, m) = self.verify(&base, |_| {})?;
        debug_assert_eq!(dir, final_dir);
        Ok((base, dir, m))
    }

    /// Every image here by its directory's name; one that does not read is
    /// an error of its own and never hides the others.
    pub fn list(&self) -> Vec<Result<Named, (String, ImageError)>> {
        self.names()
            .into_iter()
            .map(|n| match self.manifest(&n) {
                Ok((_, m)) => Ok((n, m)),
                Err(e) => Err((n, e)),
            })
            .collect()
    }

    /// The names of the store's directories (temporary ones left out).
    pub fn names(&self) -> Vec<String> {
        let Ok(rd) = fs::read_dir(&self.root) else {
            return Vec::new();
        };
        let mut names: Vec<String> = rd
            .filter_map(|e| e.ok())
            .filter_map(|e| e.file_name().to_str().map(str::to_string))
            .filter(|n| !n.starts_with('.'))
            .collect();
        names.sort();
        names
    }

    /// Removes an image: a name of this store, or a path to a directory
    /// holding a gpusnap manifest; nothing else. Renamed aside first, so a
    /// crash mid-removal never leaves a half image under its name.
    pub fn remove(&self, name: &str) -> Result<(), ImageError> {
        let dir = self.image_dir(name)?;
        if !self.in_store(&dir) {
            // A path: only a directory that holds a gpusnap manifest (a
            // signature is not asked: a foreign image may be removed).
            read_manifest(name, &dir)?;
        }
        let base = dir.file_name().and_then(|n| n.to_str()).unwrap_or("image").replace('/', "_");
        let aside = dir.with_file_name(format!(".{base}.rm-{}", std::process::id()));
        fs::rename(&dir, &aside).map_err(io(name, "rename aside"))?;
        if self.in_store(&dir) {
            crate::remote::clear_origin(self.state_dir(), name);
        }
        // remove_dir_all does not follow links inside.
        fs::remove_dir_all(&aside).map_err(io(name, "remove"))
    }

    /// The newest signed image of this store that holds the process `pid`
    /// with `start_time`, by its directory's name.
    pub fn find_for(&self, pid: i32, start_time: u64) -> Option<Named> {
        self.list()
            .into_iter()
            .filter_map(Result::ok)
            .filter(|(_, m)| m.processes.iter().any(|p| p.pid == pid && p.start_time == start_time))
            .max_by_key(|(_, m)| m.created_ms)
    }

    /// Temporary directories (`.NAME.tmp-PID`, `.NAME.rm-PID`) whose
    /// gpusnap is gone.
    pub fn stale(&self) -> Vec<Stale> {
        let Ok(rd) = fs::read_dir(&self.root) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for e in rd.filter_map(|e| e.ok()) {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(owner) = temp_owner(&name) else { continue };
            if gpusnap_alive(owner) {
                continue;
            }
            let path = e.path();
            let mut bytes = 0;
            let mut rel = Vec::new();
            if files_under(&path, &path, &mut rel).is_ok() {
                bytes = rel
                    .iter()
                    .filter_map(|r| fs::symlink_metadata(path.join(r)).ok())
                    .fold(0u64, |a, m| a.saturating_add(m.len()));
            }
            out.push(Stale { path, bytes });
        }
        out.sort_by(|a, b| a.path.cmp(&b.path));
        out
    }

    /// Removes the stale temporary directories; returns what was removed.
    pub fn gc(&self) -> Vec<Stale> {
        let mut out = Vec::new();
        for s in self.stale() {
            match fs::remove_dir_all(&s.path) {
                Ok(()) => out.push(s),
                Err(e) => {
                    tracing::warn!(path = %s.path.display(), "cannot remove a stale temporary image: {e}")
                }
            }
        }
        out
    }
}

/// Stores the chunks of a pages file read from `file`, each checked
/// against the signed chunk list and the whole against the file's checksum
/// (each chunk durable as it is stored).
fn put_chunks_of(
    name: &str,
    mut file: fs::File,
    f: &FileDesc,
    store: &gpusnap_chunks::LocalStore,
    on_bytes: &mut dyn FnMut(u64),
) -> Result<(), ImageError> {
    let mut whole = blake3::Hasher::new();
    let mut buf = Vec::new();
    for c in &f.chunks {
        buf.resize(c.size as usize, 0);
        file.read_exact(&mut buf).map_err(io(name, format!("read {}", f.path)))?;
        whole.update(&buf);
        if blake3::hash(&buf).to_hex().as_str() != c.blake3 {
            return Err(ImageError::Corrupt {
                name: name.into(),
                why: format!("{} fails its checksum", f.path),
            });
        }
        store.put(c, &buf).map_err(|e| ImageError::Io {
            name: name.into(),
            op: "store chunks".into(),
            err: std::io::Error::other(e.to_string()),
        })?;
        on_bytes(c.size);
    }
    if whole.finalize().to_hex().as_str() != f.blake3 {
        return Err(ImageError::Corrupt { name: name.into(), why: format!("{} fails its checksum", f.path) });
    }
    Ok(())
}

/// The pid in a temporary directory's name (`.NAME.tmp-PID`, `.NAME.rm-PID`).
fn temp_owner(name: &str) -> Option<i32> {
    if !name.starts_with('.') {
        return None;
    }
    temp_pid(name)
}

/// The pid in a temporary name (`...tmp-PID`, `...rm-PID`), if it is one.
pub(crate) fn temp_pid(name: &str) -> Option<i32> {
    let (_, pid) = name.rsplit_once(".tmp-").or_else(|| name.rsplit_once(".rm-"))?;
    pid.parse().ok()
}

/// Is `pid` this gpusnap or another running one (its temporaries are in
/// use)?
pub(crate) fn gpusnap_alive(pid: i32) -> bool {
    pid == std::process::id() as i32
        || fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim().starts_with("gpusnap"))
}

/// The manifest's bytes and contents (magic and format checked, not the
/// signature).
pub(crate) fn read_manifest(name: &str, dir: &Path) -> Result<(Vec<u8>, Manifest), ImageError> {
    let corrupt = |why: String| ImageError::Corrupt { name: name.into(), why };
    let f = match open_regular(&dir.join(MANIFEST), MAX_MANIFEST) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(ImageError::Foreign { name: name.into(), why: "no manifest.json".into() })
        }
        Err(e) => return Err(ImageError::Foreign { name: name.into(), why: format!("manifest.json: {e}") }),
    };
    let body = read_bounded(f, MAX_MANIFEST).map_err(|e| corrupt(format!("manifest.json: {e}")))?;
    let m = parse_manifest(name, &body)?;
    Ok((body, m))
}

/// A manifest's contents from its bytes (magic and format checked, not the
/// signature).
pub(crate) fn parse_manifest(name: &str, body: &[u8]) -> Result<Manifest, ImageError> {
    let corrupt = |why: String| ImageError::Corrupt { name: name.into(), why };
    if body.len() as u64 > MAX_MANIFEST {
        return Err(corrupt("manifest.json is too large".into()));
    }
    let v: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| corrupt(format!("manifest.json: {e}")))?;
    if v.get("magic").and_then(|m| m.as_str()) != Some(MAGIC) {
        return Err(ImageError::Foreign { name: name.into(), why: "wrong magic".into() });
    }
    let format = v.get("format").and_then(|f| f.as_u64()).unwrap_or(0);
    if format > FORMAT as u64 {
        return Err(ImageError::Newer { name: name.into(), found: format.min(u32::MAX as u64) as u32 });
    }
    serde_json::from_value(v).map_err(|e| corrupt(format!("manifest.json: {e}")))
}

/// Every listed path is a plain relative path under `criu/`, listed once.
pub(crate) fn check_paths(name: &str, m: &Manifest) -> Result<(), ImageError> {
    let mut seen = std::collections::HashSet::new();
    for f in &m.files {
        let p = Path::new(&f.path);
        let plain = p.components().all(|c| matches!(c, std::path::Component::Normal(_)));
        if !plain || !f.path.starts_with("criu/") || f.path.contains('\0') || !seen.insert(&f.path) {
            return Err(ImageError::Corrupt { name: name.into(), why: format!("bad path {:?}", f.path) });
        }
    }
    Ok(())
}

/// The image directory holds the manifest, its signature and the listed
/// files, nothing else, and every entry is a real directory or a regular
/// file (checked without following anything).
fn check_contents(name: &str, dir: &Path, m: &Manifest) -> Result<(), ImageError> {
    let corrupt = |why: String| ImageError::Corrupt { name: name.into(), why };
    let listed: std::collections::HashSet<&str> = m.files.iter().map(|f| f.path.as_str()).collect();
    let mut dirs: std::collections::HashSet<String> = std::collections::HashSet::new();
    for f in &m.files {
        let mut p = Path::new(&f.path).parent();
        while let Some(d) = p.filter(|d| !d.as_os_str().is_empty()) {
            dirs.insert(d.to_string_lossy().into_owned());
            p = d.parent();
        }
    }
    dirs.insert("criu".into());
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let rd = fs::read_dir(dir.join(&rel)).map_err(io(name, "list"))?;
        for e in rd {
            let e = e.map_err(io(name, "list"))?;
            let r = rel.join(e.file_name());
            let rs = r.to_string_lossy().into_owned();
            let ft = e.file_type().map_err(io(name, "list"))?;
            if rel.as_os_str().is_empty() && (rs == MANIFEST || rs == SIG) {
                continue; // opened with the same checks when read
            }
            if ft.is_dir() && dirs.contains(&rs) {
                stack.push(r);
            } else if ft.is_file() && listed.contains(rs.as_str()) {
                // its type and links are checked again on the descriptor
            } else if ft.is_symlink() {
                return Err(corrupt(format!("{rs} is a symbolic link (an image holds regular files only)")));
            } else if !ft.is_file() && !ft.is_dir() {
                return Err(corrupt(format!(
                    "{rs} is not a regular file (an image holds regular files only)"
                )));
            } else {
                return Err(corrupt(format!("{rs} is not listed in the manifest")));
            }
        }
    }
    Ok(())
}

/// The manifest's and its signature's bytes, as stored (bounded reads).
pub(crate) fn manifest_bytes(name: &str, dir: &Path) -> Result<(Vec<u8>, Vec<u8>), ImageError> {
    let (body, _) = read_manifest(name, dir)?;
    let sig = open_regular(&dir.join(SIG), MAX_SIG)
        .and_then(|f| read_bounded(f, MAX_SIG))
        .map_err(io(name, "read manifest.sig"))?;
    Ok((body, sig))
}

pub(crate) fn check_contents_pub(name: &str, dir: &Path, m: &Manifest) -> Result<(), ImageError> {
    check_contents(name, dir, m)
}

/// Opens a listed file with every check, and checks its size.
pub(crate) fn open_listed(name: &str, dir: &Path, f: &FileDesc) -> Result<fs::File, ImageError> {
    let file = open_regular(&dir.join(&f.path), u64::MAX).map_err(|e| ImageError::Corrupt {
        name: name.into(),
        why: if e.kind() == std::io::ErrorKind::NotFound {
            format!("{} is missing", f.path)
        } else {
            format!("{}: {e}", f.path)
        },
    })?;
    let len = file.metadata().map_err(io(name, format!("stat {}", f.path)))?.len();
    if len != f.size {
        return Err(ImageError::Corrupt {
            name: name.into(),
            why: format!("{} is {} bytes, the manifest says {} (truncated?)", f.path, len, f.size),
        });
    }
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_back_and_sync_of_a_tree() {
        let d = tempfile::tempdir().unwrap();
        fs::create_dir_all(d.path().join("criu/sub")).unwrap();
        fs::write(d.path().join("criu/pages-1.img"), vec![7u8; 1 << 20]).unwrap();
        fs::write(d.path().join("criu/sub/x.img"), b"x").unwrap();
        start_writeback(d.path());
        sync_tree(d.path()).unwrap();
        assert!(sync_tree(&d.path().join("missing")).is_err());
    }

    fn manifest(name: &str) -> Manifest {
        Manifest {
            magic: MAGIC.into(),
            format: FORMAT,
            gpusnap_version: "test".into(),
            name: name.into(),
            host: "h".into(),
            created_ms: 1,
            driver_api: None,
            driver_version: None,
            gpus: vec![],
            visible_gpus: vec![],
            root_pid: 1,
            processes: vec![],
            criu_version: "4.1.1".into(),
            signer: String::new(),
            files: vec![],
            file_pages: vec![],
        }
    }

    fn store_in(state: &Path) -> ImageStore {
        // The host key is made by the first commit; the store trusts it.
        crate::sign::HostKey::load_or_create(state).unwrap();
        ImageStore::new(state.join("images"), crate::sign::Trust::host_only(state).unwrap())
    }

    fn make(store: &ImageStore, name: &str) -> PathBuf {
        let p = store.begin(name).unwrap();
        fs::write(p.criu_dir().join("pages-1.img"), vec![7u8; 100_000]).unwrap();
        fs::write(p.criu_dir().join("core-1.img"), b"core").unwrap();
        p.commit(manifest(name), true, |_| {}).unwrap();
        store.locate(name).unwrap()
    }

    #[test]
    fn written_images_verify_and_are_private() {
        let d = tempfile::tempdir().unwrap();
        let s = store_in(d.path());
        let dir = make(&s, "a");
        let (_, m) = s.verify("a", |_| {}).unwrap();
        assert_eq!(m.files.len(), 2);
        assert_eq!(fs::metadata(&dir).unwrap().permissions().mode() & 0o777, 0o700);
        assert_eq!(fs::metadata(dir.join("criu/core-1.img")).unwrap().permissions().mode() & 0o777, 0o600);
        // The pages file is chunks in the store, private too.
        assert!(!dir.join("criu/pages-1.img").exists());
        let store = gpusnap_chunks::LocalStore::open(d.path().join("store")).unwrap();
        let pages = m.files.iter().find(|f| f.path == "criu/pages-1.img").unwrap();
        assert!(!pages.chunks.is_empty());
        for c in &pages.chunks {
            let p = store.path_of(&c.blake3);
            assert_eq!(fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o600);
        }
        assert!(matches!(s.begin("a"), Err(ImageError::Exists(_))));
        assert_eq!(s.list().len(), 1);
    }

    #[test]
    fn damage_is_found() {
        let d = tempfile::tempdir().unwrap();
        let s = store_in(d.path());
        let dir = make(&s, "t");
        // truncated
        let f = fs::OpenOptions::new().write(true).open(dir.join("criu/core-1.img")).unwrap();
        f.set_len(1).unwrap();
        let e = s.verify("t", |_| {}).unwrap_err();
        assert!(e.to_string().contains("truncated"), "{e}");
        // flipped byte, same size
        let dir = make(&s, "c");
        let mut b = fs::read(dir.join("criu/core-1.img")).unwrap();
        b[2] ^= 1;
        fs::write(dir.join("criu/core-1.img"), b).unwrap();
        assert!(s.verify("c", |_| {}).unwrap_err().to_string().contains("checksum"));
        // a flipped byte in a chunk of the pages file (the store's)
        make(&s, "k");
        let (_, m) = s.manifest("k").unwrap();
        let pages = m.files.iter().find(|f| f.path == "criu/pages-1.img").unwrap();
        let store = gpusnap_chunks::LocalStore::open(d.path().join("store")).unwrap();
        let p = store.path_of(&pages.chunks[0].blake3);
        let good = fs::read(&p).unwrap();
        let mut bad = good.clone();
        let at = bad.len() - 1;
        bad[at] ^= 1;
        fs::write(&p, &bad).unwrap();
        let e = s.verify("k", |_| {}).unwrap_err().to_string();
        assert!(e.contains("chunk") && e.contains("fails its checksum"), "{e}");
        // a missing chunk
        fs::remove_file(&p).unwrap();
        let e = s.verify_with("k", ChunkCheck::Present, |_| {}).unwrap_err().to_string();
        assert!(e.contains("missing from the store"), "{e}");
        fs::write(&p, &good).unwrap();
        // edited manifest
        let dir = make(&s, "m");
        let body = fs::read_to_string(dir.join("manifest.json")).unwrap().replace("\"h\"", "\"x\"");
        fs::write(dir.join("manifest.json"), body).unwrap();
        assert!(matches!(s.manifest("m"), Err(ImageError::Untrusted { .. })));
        // newer format
        let dir = make(&s, "n");
        let body = fs::read_to_string(dir.join("manifest.json"))
            .unwrap()
            .replace(&format!("\"format\": {FORMAT}"), "\"format\": 9");
        fs::write(dir.join("manifest.json"), body).unwrap();
        assert!(matches!(s.manifest("n"), Err(ImageError::Newer { found: 9, .. })));
        // foreign directory, missing image
        fs::create_dir_all(s.root.join("foreign")).unwrap();
        assert!(matches!(s.manifest("foreign"), Err(ImageError::Foreign { .. })));
        assert!(matches!(s.manifest("nope"), Err(ImageError::Missing(_))));
    }

    #[test]
    fn an_uncommitted_image_leaves_nothing() {
        let d = tempfile::tempdir().unwrap();
        let s = store_in(d.path());
        let p = s.begin("x").unwrap();
        fs::write(p.criu_dir().join("pages-1.img"), b"x").unwrap();
        drop(p);
        assert_eq!(fs::read_dir(&s.root).unwrap().count(), 0);
        assert!(s.remove("x").is_err());
        make(&s, "y");
        s.remove("y").unwrap();
        assert_eq!(fs::read_dir(&s.root).unwrap().count(), 0);
    }
}
