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
//! copied. See docs/design/chunk-store.md.
use crate::hash::hash_open;
use crate::manifest::{
    check_contents, check_paths, chunked_name, io, open_listed, read_manifest, valid_name, ChunkCheck,
    FileDesc, ImageError, Manifest, MANIFEST, MAX_SIG, SIG,
};
use crate::pending::PendingImage;
use crate::sync::{files_under, sync_dir};
use gpusnap_files::{create_private, mkdir_private, open_regular, read_bounded, write_private};
use serde::Serialize;
use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

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

    /// The keys this store trusts.
    pub fn trust(&self) -> &crate::sign::Trust {
        &self.trust
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
        let store = local_store(self).map_err(chunk_err)?;
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
        let store = local_store(self).map_err(chunk_err)?;
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
        let in_store = self.in_store(&dir);
        // Its parent and the image held by descriptor: what is checked is
        // what is renamed aside and removed, whatever a user owning a
        // parent directory renames or links meanwhile.
        let foreign = |why: &str| ImageError::Foreign { name: name.into(), why: why.into() };
        let (Some(parent), Some(base)) = (dir.parent(), dir.file_name().and_then(|n| n.to_str())) else {
            return Err(foreign("not an image directory's path"));
        };
        let parent = if parent.as_os_str().is_empty() { Path::new(".") } else { parent };
        let up = gpusnap_files::PrivateDir::hold(parent).map_err(io(name, "open its directory"))?;
        let image = up.hold_entry(base).map_err(io(name, "open"))?;
        if !in_store {
            // A path: only a directory that holds a gpusnap manifest (a
            // signature is not asked: a foreign image may be removed).
            read_manifest(name, &image.fd_path(""))?;
        }
        let aside = format!(".{base}.rm-{}", std::process::id());
        up.rename(base, &aside).map_err(io(name, "rename aside"))?;
        if !up.entry_is(&aside, &image) {
            // Swapped between the check and the rename: put back, refused.
            let _ = up.rename(&aside, base);
            return Err(foreign("it was replaced while being removed; nothing removed"));
        }
        if in_store {
            crate::origin::clear_origin(self.state_dir(), name);
        }
        // remove_dir_all does not follow links inside; it starts from the
        // held parent.
        fs::remove_dir_all(up.fd_path(&aside)).map_err(io(name, "remove"))
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

/// The chunk store beside the image store (`STATE/store`).
pub fn local_store(images: &ImageStore) -> Result<gpusnap_chunks::LocalStore, gpusnap_chunks::ChunkError> {
    gpusnap_chunks::LocalStore::open(images.state_dir().join("store"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::{FORMAT, MAGIC};
    use std::os::unix::fs::PermissionsExt;

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
