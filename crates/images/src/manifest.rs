//! The image format: the manifest (magic, format, who/where/when, driver
//! and GPUs, processes with their footprints, the checksum and chunk list
//! of every file) and its checks, the errors of an image, and the bounded,
//! checked reads of an image's files (an image is untrusted input, see
//! [`crate::image`]).

use gpusnap_files::{open_regular, read_bounded};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

pub const MAGIC: &str = "gpusnap-image";
/// 2: signed (`manifest.sig`, `signer`); 1 was checksummed only.
pub const FORMAT: u32 = 2;
/// A manifest larger than this is not ours (Firecracker-style bound on reads).
pub(crate) const MAX_MANIFEST: u64 = 16 << 20;
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
    #[error("image {name} is the one {user} wakes from (remove it anyway with --force)")]
    InUse { name: String, user: String },
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
pub(crate) fn check_contents(name: &str, dir: &Path, m: &Manifest) -> Result<(), ImageError> {
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
