//! Images: a directory per hibernated process tree.
//!
//! ```text
//! NAME/
//!   manifest.json   magic, format, who/where/when, driver and GPUs, processes
//!                   with their footprints, CRIU version, blake3 of every file
//!   manifest.b3     blake3 of manifest.json
//!   criu/           CRIU's image files and dump.log
//!   logs/           restore logs (not part of the checksummed image)
//! ```
//! An image is written under a temporary name and renamed when complete, and
//! is readable only by its owner (0700/0600): it is the memory of a process,
//! secrets included. It is verified in full before anything is restored.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

pub const MAGIC: &str = "gpusnap-image";
pub const FORMAT: u32 = 1;
/// A manifest larger than this is not ours (Firecracker-style bound on reads).
const MAX_MANIFEST: u64 = 16 << 20;

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
    pub files: Vec<FileDesc>,
}

impl Manifest {
    pub fn footprint_by_gpu(&self) -> BTreeMap<String, u64> {
        let mut out = BTreeMap::new();
        for p in &self.processes {
            for (u, b) in &p.footprint {
                *out.entry(u.clone()).or_insert(0) += b;
            }
        }
        out
    }

    pub fn total_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }
}

/// Where images live: `<state dir>/images`, or a path given directly.
#[derive(Debug, Clone)]
pub struct ImageStore {
    pub root: PathBuf,
}

pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && !name.starts_with('.')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

fn io(name: &str, op: impl Into<String>) -> impl FnOnce(std::io::Error) -> ImageError + '_ {
    let op = op.into();
    move |err| ImageError::Io { name: name.to_string(), op, err }
}

pub fn mkdir_private(p: &Path) -> std::io::Result<()> {
    fs::DirBuilder::new().recursive(true).mode(0o700).create(p)?;
    fs::set_permissions(p, fs::Permissions::from_mode(0o700))
}

/// Hashes a file, reporting bytes as it goes. Large files are mapped and
/// hashed on every core (BLAKE3's tree hashing): checksumming an image of
/// tens of GB must not take longer than writing it.
pub fn hash_file(p: &Path, mut on_bytes: impl FnMut(u64)) -> std::io::Result<(u64, String)> {
    const CHUNK: usize = 256 << 20;
    let f = fs::File::open(p)?;
    let len = f.metadata()?.len();
    let mut h = blake3::Hasher::new();
    if len < (16 << 20) {
        let mut f = f;
        let mut buf = Vec::with_capacity(len as usize);
        f.read_to_end(&mut buf)?;
        h.update(&buf);
        on_bytes(buf.len() as u64);
        return Ok((buf.len() as u64, h.finalize().to_hex().to_string()));
    }
    // SAFETY: the image files are ours (0600, in a 0700 directory) and no
    // one writes them while they are hashed; a concurrent truncation could
    // fault, which is the risk memmap2 documents for every mapping.
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
        mut self,
        mut m: Manifest,
        durable: bool,
        mut on_bytes: impl FnMut(u64),
    ) -> Result<Manifest, ImageError> {
        let name = self.name.clone();
        // The flush to disk runs while the files are hashed (one is disk
        // bound, the other CPU bound); both end before the rename.
        let dir = self.dir.clone();
        let flush = std::thread::spawn(move || if durable { sync_tree(&dir) } else { Ok(()) });
        let mut rel = Vec::new();
        files_under(&self.dir, &self.dir.join("criu"), &mut rel).map_err(io(&name, "list files"))?;
        rel.sort();
        m.files.clear();
        for r in rel {
            let p = self.dir.join(&r);
            fs::set_permissions(&p, fs::Permissions::from_mode(0o600)).map_err(io(&name, "chmod"))?;
            let (size, hash) =
                hash_file(&p, &mut on_bytes).map_err(io(&name, format!("hash {}", r.display())))?;
            m.files.push(FileDesc { path: r.to_string_lossy().into_owned(), size, blake3: hash });
        }
        let body = serde_json::to_vec_pretty(&m).map_err(|e| ImageError::Io {
            name: name.clone(),
            op: "encode manifest".into(),
            err: std::io::Error::other(e),
        })?;
        write_private(&self.dir.join("manifest.json"), &body).map_err(io(&name, "write manifest"))?;
        let sum = blake3::hash(&body).to_hex().to_string();
        write_private(&self.dir.join("manifest.b3"), sum.as_bytes())
            .map_err(io(&name, "write manifest.b3"))?;
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
        if self.final_dir.exists() {
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

impl Drop for PendingImage {
    fn drop(&mut self) {
        if !self.committed {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

fn write_private(p: &Path, data: &[u8]) -> std::io::Result<()> {
    let mut f = fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(p)?;
    f.write_all(data)?;
    f.sync_all()
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
    for r in rel {
        if let Ok(f) = fs::File::open(dir.join(r)) {
            // SAFETY: a valid fd; offset 0 and length 0 mean the whole file.
            unsafe { libc::sync_file_range(f.as_raw_fd(), 0, 0, libc::SYNC_FILE_RANGE_WRITE) };
        }
    }
}

/// Puts every file under `dir`, and the directories themselves, on disk
/// (fdatasync each: one page file holds nearly all of an image's bytes).
pub fn sync_tree(dir: &Path) -> std::io::Result<()> {
    let mut rel = Vec::new();
    files_under(dir, dir, &mut rel)?;
    for r in &rel {
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

impl ImageStore {
    pub fn new(root: PathBuf) -> Self {
        Self { root }
    }

    /// `name` is an image in this store, or a path to an image directory.
    pub fn locate(&self, name: &str) -> PathBuf {
        if name.contains('/') {
            PathBuf::from(name)
        } else {
            self.root.join(name)
        }
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
        let final_dir = self.root.join(name);
        if final_dir.exists() {
            return Err(ImageError::Exists(name.into()));
        }
        let dir = self.root.join(format!(".{name}.tmp-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        mkdir_private(&dir.join("criu")).map_err(io(name, "create"))?;
        Ok(PendingImage { name: name.into(), dir, final_dir, committed: false })
    }

    /// Reads and checks the manifest only (fast).
    pub fn manifest(&self, name: &str) -> Result<(PathBuf, Manifest), ImageError> {
        let dir = self.locate(name);
        if !dir.join("manifest.json").is_file() {
            if dir.is_dir() {
                return Err(ImageError::Foreign { name: name.into(), why: "no manifest.json".into() });
            }
            return Err(ImageError::Missing(name.into()));
        }
        let meta = fs::metadata(dir.join("manifest.json")).map_err(io(name, "stat manifest"))?;
        if meta.len() > MAX_MANIFEST {
            return Err(ImageError::Foreign { name: name.into(), why: "manifest.json is too large".into() });
        }
        let body = fs::read(dir.join("manifest.json")).map_err(io(name, "read manifest"))?;
        let v: serde_json::Value = serde_json::from_slice(&body)
            .map_err(|e| ImageError::Corrupt { name: name.into(), why: format!("manifest.json: {e}") })?;
        if v.get("magic").and_then(|m| m.as_str()) != Some(MAGIC) {
            return Err(ImageError::Foreign { name: name.into(), why: "wrong magic".into() });
        }
        let format = v.get("format").and_then(|f| f.as_u64()).unwrap_or(0) as u32;
        if format > FORMAT {
            return Err(ImageError::Newer { name: name.into(), found: format });
        }
        let want = fs::read_to_string(dir.join("manifest.b3"))
            .map_err(|_| ImageError::Corrupt { name: name.into(), why: "manifest.b3 is missing".into() })?;
        if blake3::hash(&body).to_hex().as_str() != want.trim() {
            return Err(ImageError::Corrupt {
                name: name.into(),
                why: "manifest.json does not match manifest.b3".into(),
            });
        }
        let m: Manifest = serde_json::from_value(v)
            .map_err(|e| ImageError::Corrupt { name: name.into(), why: format!("manifest.json: {e}") })?;
        Ok((dir, m))
    }

    /// Reads the manifest and checks every file's size and checksum.
    pub fn verify(
        &self,
        name: &str,
        mut on_bytes: impl FnMut(u64),
    ) -> Result<(PathBuf, Manifest), ImageError> {
        let (dir, m) = self.manifest(name)?;
        for f in &m.files {
            let p = dir.join(&f.path);
            if f.path.contains("..") || f.path.starts_with('/') {
                return Err(ImageError::Corrupt { name: name.into(), why: format!("bad path {}", f.path) });
            }
            let meta = fs::metadata(&p).map_err(|_| ImageError::Corrupt {
                name: name.into(),
                why: format!("{} is missing", f.path),
            })?;
            if meta.len() != f.size {
                return Err(ImageError::Corrupt {
                    name: name.into(),
                    why: format!(
                        "{} is {} bytes, the manifest says {} (truncated?)",
                        f.path,
                        meta.len(),
                        f.size
                    ),
                });
            }
            let (_, h) = hash_file(&p, &mut on_bytes).map_err(io(name, format!("read {}", f.path)))?;
            if h != f.blake3 {
                return Err(ImageError::Corrupt {
                    name: name.into(),
                    why: format!("{} fails its checksum", f.path),
                });
            }
        }
        Ok((dir, m))
    }

    /// Every image here (manifests that read; others are reported as errors).
    pub fn list(&self) -> Vec<Result<Manifest, (String, ImageError)>> {
        let Ok(rd) = fs::read_dir(&self.root) else {
            return Vec::new();
        };
        let mut names: Vec<String> = rd
            .filter_map(|e| e.ok())
            .filter(|e| e.path().is_dir())
            .filter_map(|e| e.file_name().to_str().map(str::to_string))
            .filter(|n| !n.starts_with('.'))
            .collect();
        names.sort();
        names.into_iter().map(|n| self.manifest(&n).map(|(_, m)| m).map_err(|e| (n, e))).collect()
    }

    /// Removes an image: renamed aside first, so a crash mid-removal never
    /// leaves a half image under its name.
    pub fn remove(&self, name: &str) -> Result<(), ImageError> {
        let dir = self.locate(name);
        if !dir.is_dir() {
            return Err(ImageError::Missing(name.into()));
        }
        let aside = dir.with_file_name(format!(".{}.rm-{}", name.replace('/', "_"), std::process::id()));
        fs::rename(&dir, &aside).map_err(io(name, "rename aside"))?;
        fs::remove_dir_all(&aside).map_err(io(name, "remove"))
    }

    /// The newest image that holds the process `pid` with `start_time`.
    pub fn find_for(&self, pid: i32, start_time: u64) -> Option<Manifest> {
        self.list()
            .into_iter()
            .filter_map(Result::ok)
            .filter(|m| m.processes.iter().any(|p| p.pid == pid && p.start_time == start_time))
            .max_by_key(|m| m.created_ms)
    }
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
            files: vec![],
        }
    }

    fn make(store: &ImageStore, name: &str) -> PathBuf {
        let p = store.begin(name).unwrap();
        fs::write(p.criu_dir().join("pages-1.img"), vec![7u8; 100_000]).unwrap();
        fs::write(p.criu_dir().join("core-1.img"), b"core").unwrap();
        p.commit(manifest(name), true, |_| {}).unwrap();
        store.locate(name)
    }

    #[test]
    fn written_images_verify_and_are_private() {
        let d = tempfile::tempdir().unwrap();
        let s = ImageStore::new(d.path().join("images"));
        let dir = make(&s, "a");
        let (_, m) = s.verify("a", |_| {}).unwrap();
        assert_eq!(m.files.len(), 2);
        assert_eq!(fs::metadata(&dir).unwrap().permissions().mode() & 0o777, 0o700);
        assert_eq!(fs::metadata(dir.join("criu/pages-1.img")).unwrap().permissions().mode() & 0o777, 0o600);
        assert!(matches!(s.begin("a"), Err(ImageError::Exists(_))));
        assert_eq!(s.list().len(), 1);
    }

    #[test]
    fn damage_is_found() {
        let d = tempfile::tempdir().unwrap();
        let s = ImageStore::new(d.path().join("images"));
        let dir = make(&s, "t");
        // truncated
        let f = fs::OpenOptions::new().write(true).open(dir.join("criu/pages-1.img")).unwrap();
        f.set_len(10).unwrap();
        let e = s.verify("t", |_| {}).unwrap_err();
        assert!(e.to_string().contains("truncated"), "{e}");
        // flipped byte, same size
        let dir = make(&s, "c");
        let mut b = fs::read(dir.join("criu/pages-1.img")).unwrap();
        b[5] ^= 1;
        fs::write(dir.join("criu/pages-1.img"), b).unwrap();
        assert!(s.verify("c", |_| {}).unwrap_err().to_string().contains("checksum"));
        // edited manifest
        let dir = make(&s, "m");
        let body = fs::read_to_string(dir.join("manifest.json")).unwrap().replace("\"h\"", "\"x\"");
        fs::write(dir.join("manifest.json"), body).unwrap();
        assert!(matches!(s.manifest("m"), Err(ImageError::Corrupt { .. })));
        // newer format
        let dir = make(&s, "n");
        let body =
            fs::read_to_string(dir.join("manifest.json")).unwrap().replace("\"format\": 1", "\"format\": 9");
        fs::write(dir.join("manifest.b3"), blake3::hash(body.as_bytes()).to_hex().as_bytes()).unwrap();
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
        let s = ImageStore::new(d.path().join("images"));
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
