//! Images in the chunk store and on remotes: the seam between image.rs
//! (signed manifests, directory images CRIU reads) and `gpusnap-chunks`.
//!
//! Hibernate keeps writing a directory image (CRIU restores from it, and
//! the page server of lazy wakes reads its pages in place); its manifest
//! carries every file's chunk list, signed. `push` stores the chunks in
//! `STATE/store` and sends the ones the remote lacks; `pull` fetches the
//! ones the store lacks and reassembles the directory image, each chunk
//! checked against its hash and each file against the signed manifest.

use crate::image::{self, ImageError, ImageStore, Manifest};
use gpusnap_chunks::{ChunkError, ChunkRef, GcReport, LocalStore, Remote, RemoteUrl, TransferReport};
use std::collections::HashSet;
use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;

pub use gpusnap_chunks::RemoteUrl as Url;

pub fn local_store(images: &ImageStore) -> Result<LocalStore, ChunkError> {
    LocalStore::open(images.state_dir().join("store"))
}

fn all_chunks(m: &Manifest) -> Vec<ChunkRef> {
    m.files.iter().flat_map(|f| f.chunks.iter().cloned()).collect()
}

/// Every file's chunk list covers exactly its bytes (else the image was
/// taken before chunk lists, or the manifest lies).
fn check_chunk_lists(name: &str, m: &Manifest) -> Result<(), ImageError> {
    for f in &m.files {
        let sum = f.chunks.iter().fold(0u64, |a, c| a.saturating_add(c.size));
        if sum != f.size || f.chunks.iter().any(|c| !gpusnap_chunks::valid_hash(&c.blake3) || c.size == 0) {
            return Err(ImageError::Corrupt {
                name: name.into(),
                why: if f.chunks.is_empty() {
                    format!(
                        "{} has no chunk list (an image taken before chunk lists: take it again to push it)",
                        f.path
                    )
                } else {
                    format!("{}: its chunk list does not cover the file", f.path)
                },
            });
        }
    }
    Ok(())
}

/// Sends the image `name` to `url`: its chunks are stored locally (each
/// checked against the signed chunk list as it is read), the remote's
/// missing ones sent, the manifest last.
pub fn push(
    images: &ImageStore,
    name: &str,
    url: &str,
    on_bytes: &(dyn Fn(u64) + Sync),
) -> Result<TransferReport, crate::Error> {
    let (dir, m) = images.manifest(name)?;
    image::check_contents_pub(name, &dir, &m)?;
    check_chunk_lists(name, &m)?;
    let remote =
        Remote::open_for_push(RemoteUrl::parse(url).map_err(ChunkError::from)?).map_err(ChunkError::from)?;
    let local = local_store(images)?;
    let _lock = local.shared_lock()?;
    for f in &m.files {
        let mut file = image::open_listed(name, &dir, f)?;
        for c in &f.chunks {
            let mut buf = vec![0u8; c.size as usize];
            file.read_exact(&mut buf).map_err(|e| ImageError::Io {
                name: name.into(),
                op: format!("read {}", f.path),
                err: e,
            })?;
            if blake3::hash(&buf).to_hex().as_str() != c.blake3 {
                return Err(ImageError::Corrupt {
                    name: name.into(),
                    why: format!("{} fails its checksum", f.path),
                }
                .into());
            }
            local.put(c, &buf)?;
        }
    }
    let (body, sig) = image::manifest_bytes(name, &dir)?;
    Ok(remote.push(&local, name, &all_chunks(&m), &body, &sig, on_bytes)?)
}

/// Fetches `URL/NAME` into the store as `as_name` (default NAME). The
/// manifest must be signed by a trusted key (this host's, or one named by
/// --trust) before a single chunk is fetched. An image of that name already
/// here with the very same manifest is kept as it is.
pub fn pull(
    images: &ImageStore,
    url_name: &str,
    as_name: Option<&str>,
    on_total: &dyn Fn(u64),
    on_bytes: &(dyn Fn(u64) + Sync),
) -> Result<(String, TransferReport), crate::Error> {
    let (url, rname) = RemoteUrl::parse_image(url_name).map_err(ChunkError::from)?;
    let name = as_name.unwrap_or(&rname).to_string();
    if !image::valid_name(&name) || !image::valid_name(&rname) {
        return Err(ImageError::BadName {
            name,
            why: "names are letters, digits, '-', '_' and '.', not starting with '.'".into(),
        }
        .into());
    }
    let remote = Remote::open(url).map_err(ChunkError::from)?;
    let (body, sig) = remote.get_manifest(&rname).map_err(ChunkError::from)?;
    let m = image::parse_manifest(&rname, &body)?;
    images.check_signature(&rname, &body, &sig, &m)?;
    image::check_paths(&rname, &m)?;
    check_chunk_lists(&rname, &m)?;
    on_total(m.total_bytes());
    if let Ok((dir, _)) = images.manifest(&name) {
        if image::manifest_bytes(&name, &dir).is_ok_and(|(b, _)| b == body) {
            let total = m.total_bytes();
            on_bytes(total);
            return Ok((
                name,
                TransferReport {
                    image: rname,
                    remote: remote.url.base.clone(),
                    bytes_total: total,
                    bytes_deduplicated: total,
                    chunks_total: all_chunks(&m).len() as u64,
                    ..Default::default()
                },
            ));
        }
    }
    let local = local_store(images)?;
    // Held until the image is in place: gc sees its chunks referenced.
    let _lock = local.shared_lock()?;
    let report = remote.fetch(&local, &rname, &all_chunks(&m), on_bytes)?;
    let pending = images.begin(&name)?;
    for f in &m.files {
        let to_path = pending.dir.join(&f.path);
        if let Some(parent) = to_path.parent() {
            image::mkdir_private(parent).map_err(|e| ImageError::Io {
                name: name.clone(),
                op: "create".into(),
                err: e,
            })?;
        }
        let ioe = |e: std::io::Error| ImageError::Io {
            name: name.clone(),
            op: format!("write {}", f.path),
            err: e,
        };
        let mut to = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&to_path)
            .map_err(ioe)?;
        let mut h = blake3::Hasher::new();
        for c in &f.chunks {
            let data = local.get(&c.blake3)?;
            h.update(&data);
            to.write_all(&data).map_err(ioe)?;
        }
        if h.finalize().to_hex().as_str() != f.blake3 {
            return Err(ImageError::Corrupt {
                name: name.clone(),
                why: format!("{} fails its checksum", f.path),
            }
            .into());
        }
        to.sync_data().map_err(ioe)?;
    }
    image::write_private(&pending.dir.join(image::MANIFEST), &body).map_err(|e| ImageError::Io {
        name: name.clone(),
        op: "write manifest".into(),
        err: e,
    })?;
    image::write_private(&pending.dir.join(image::SIG), &sig).map_err(|e| ImageError::Io {
        name: name.clone(),
        op: "write manifest.sig".into(),
        err: e,
    })?;
    pending.install().map_err(|e| ImageError::Io {
        name: name.clone(),
        op: "rename into place".into(),
        err: e,
    })?;
    images.verify(&name, |_| {})?;
    Ok((name, report))
}

/// Removes the chunks no image of this store refers to. Safe against a
/// concurrent push or pull (they hold the store's lock shared from their
/// first chunk to their manifest, gc holds it exclusive); hibernate writes
/// no chunks (its image's chunks enter the store on push).
pub fn gc(images: &ImageStore, on_chunk: &dyn Fn(u64)) -> Result<GcReport, crate::Error> {
    let local = local_store(images)?;
    let _lock = local.exclusive_lock()?;
    let mut referenced = HashSet::new();
    // Every manifest that parses counts, signed or not, ours or not:
    // removing an image is `images rm`'s decision, never gc's.
    for name in images.names() {
        if let Ok(dir) = images.locate(&name) {
            if let Ok((_, m)) = image::read_manifest(&name, &dir) {
                referenced.extend(all_chunks(&m).into_iter().map(|c| c.blake3));
            }
        }
    }
    Ok(local.gc(&referenced, on_chunk))
}
