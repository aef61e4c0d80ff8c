//! An image being written: a temporary directory of the store, renamed
//! into place once every file is checksummed (and chunked), the manifest
//! signed and everything flushed.

use crate::hash::{hash_and_chunk, store_file};
use crate::manifest::{chunked_name, io, FileDesc, ImageError, Manifest, Prechunked, MANIFEST, SIG};
use crate::sync::{files_under, sync_dir, sync_tree_but};
use gpusnap_files::write_private;
use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

pub struct PendingImage {
    pub name: String,
    pub dir: PathBuf,
    pub(crate) final_dir: PathBuf,
    pub(crate) state_dir: PathBuf,
    pub(crate) committed: bool,
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
