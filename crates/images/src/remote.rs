//! Images in the chunk store and on remotes: the seam between image.rs
//! (signed manifests, directory images) and `gpusnap-chunks`.
//!
//! Hibernate stores an image's pages files as chunks in `STATE/store`
//! (the image directory keeps CRIU's small files and the signed manifest
//! with every file's chunk list). `push` sends the store's chunks the
//! remote lacks, the manifest last; `pull` fetches the chunks the store
//! lacks (each checked against its hash), writes the small files, and puts
//! the manifest in place. A wake from a remote installs the image with its
//! small files only and records its origin (`STATE/store/origins/NAME`):
//! its pages' chunks are fetched as the wake reads them (and by a
//! prefetcher, in address order), until the image is whole here.

use crate::image::{local_store, ImageStore};
use crate::index::Index;
use crate::manifest::{self, ImageError, Manifest};
use crate::sign::Envelope;
use gpusnap_chunks::{ChunkError, ChunkRef, GcReport, Remote, RemoteUrl, TransferReport};
use std::collections::HashSet;
use std::io::{Read, Write};

pub use gpusnap_chunks::RemoteUrl as Url;

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
/// missing ones sent, the manifest, then this host's signed index of the
/// remote naming it (valid for [`crate::index::DEFAULT_TTL`]).
pub fn push(
    images: &ImageStore,
    name: &str,
    url: &str,
    on_bytes: &(dyn Fn(u64) + Sync),
) -> Result<TransferReport, crate::Error> {
    push_with(images, name, url, crate::index::DEFAULT_TTL, on_bytes)
}

/// [`push`], the index valid for `index_ttl`.
pub fn push_with(
    images: &ImageStore,
    name: &str,
    url: &str,
    index_ttl: std::time::Duration,
    on_bytes: &(dyn Fn(u64) + Sync),
) -> Result<TransferReport, crate::Error> {
    let (dir, m) = images.manifest(name)?;
    crate::manifest::check_contents(name, &dir, &m)?;
    check_chunk_lists(name, &m)?;
    let remote =
        Remote::open_for_push(RemoteUrl::parse(url).map_err(ChunkError::from)?).map_err(ChunkError::from)?;
    let local = local_store(images)?;
    let _lock = local.shared_lock()?;
    for f in &m.files {
        if f.in_store(&dir) {
            // Already chunks: each is read and checked as it is sent.
            if let Some(c) = f.chunks.iter().find(|c| !local.has(&c.blake3)) {
                return Err(ImageError::Corrupt {
                    name: name.into(),
                    why: format!(
                        "{}: chunk {} is missing from the store (pull the image whole first)",
                        f.path, c.blake3
                    ),
                }
                .into());
            }
            continue;
        }
        let mut file = manifest::open_listed(name, &dir, f)?;
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
    let (body, sig) = manifest::manifest_bytes(name, &dir)?;
    // The push signs the remote, the name it is stored under and its
    // version, one more than the newest push of that name there, in this
    // host's index of it, or seen here.
    let state = images.state_dir();
    let base = remote.url.base.clone();
    let on_remote = match remote.get_manifest(name) {
        Ok((_, sig)) => {
            serde_json::from_slice::<Envelope>(&sig).ok().and_then(|e| e.push).map_or(0, |p| p.version)
        }
        Err(gpusnap_chunks::RemoteError::NoImage { .. }) => 0,
        Err(e) => return Err(ChunkError::from(e).into()),
    };
    let key = crate::sign::HostKey::load_or_create(state).map_err(|e| ImageError::Io {
        name: name.into(),
        op: "sign the push".into(),
        err: std::io::Error::other(e.to_string()),
    })?;
    let me = key.public_hex();
    let mut index = match remote.get_index(&me).map_err(ChunkError::from)? {
        // A new one goes on from the newest of this host's seen here, so
        // that hosts that read an older one of this key do not take it for
        // a rollback.
        None => Index {
            sequence: crate::pushed::seen(state, &base, &crate::pullcheck::index_seen_name(&me)),
            ..Index::new(&base, &me)
        },
        // This host's own: renewed even when it has expired.
        Some(b) => Index::decode(&b, images.trust(), &base, &me, 0).map_err(|why| ImageError::Untrusted {
            name: name.into(),
            why: format!(
                "this host's signed index on {base} does not verify: {why} (remove {base}/index/{me}.json to start a new one)"
            ),
        })?,
    };
    let indexed = index.entries.get(name).map_or(0, |e| e.version);
    let version = on_remote.max(indexed).max(crate::pushed::seen(state, &base, name)) + 1;
    let mut env: Envelope = serde_json::from_slice(&sig)
        .map_err(|e| ImageError::Corrupt { name: name.into(), why: format!("manifest.sig: {e}") })?;
    let rec = key.sign_push(&base, name, version, &body);
    env.push = Some(rec.clone());
    let sig = serde_json::to_vec(&env)
        .map_err(|e| ImageError::Corrupt { name: name.into(), why: e.to_string() })?;
    let report = remote.push(&local, name, &all_chunks(&m), &body, &sig, on_bytes)?;
    // The index last: it names the manifest now there.
    index.entries.insert(name.into(), rec);
    index.sequence += 1;
    index.expires = crate::index::now_unix().saturating_add(index_ttl.as_secs());
    remote.put_index(&me, &index.encode(&key)).map_err(ChunkError::from)?;
    let _ = crate::pushed::note(state, &base, name, version);
    let _ = crate::pushed::note(state, &base, &crate::pullcheck::index_seen_name(&me), index.sequence);
    Ok(report)
}

/// Fetches `URL/NAME` into the store as `as_name` (default NAME). The
/// manifest must be signed by a trusted key (this host's, or one named by
/// --trust) before a single chunk is fetched. Only the chunks the store
/// lacks are fetched (an interrupted pull resumes); the manifest is put in
/// place last. An image of that name already here with the very same
/// manifest is completed (its missing chunks fetched) and kept.
pub fn pull(
    images: &ImageStore,
    url_name: &str,
    as_name: Option<&str>,
    allow_rollback: bool,
    on_total: &dyn Fn(u64),
    on_bytes: &(dyn Fn(u64) + Sync),
) -> Result<(String, TransferReport), crate::Error> {
    pull_with(images, url_name, as_name, false, allow_rollback, on_total, on_bytes)
}

/// For a wake from a remote: the image put in place with its small files
/// only, its origin recorded; the wake fetches its pages' chunks as it
/// reads them (see crate::chunksrc).
pub fn pull_for_wake(
    images: &ImageStore,
    url_name: &str,
    on_total: &dyn Fn(u64),
    on_bytes: &(dyn Fn(u64) + Sync),
) -> Result<(String, TransferReport), crate::Error> {
    pull_with(images, url_name, None, true, false, on_total, on_bytes)
}

fn pull_with(
    images: &ImageStore,
    url_name: &str,
    as_name: Option<&str>,
    stream: bool,
    allow_rollback: bool,
    on_total: &dyn Fn(u64),
    on_bytes: &(dyn Fn(u64) + Sync),
) -> Result<(String, TransferReport), crate::Error> {
    let (url, rname) = RemoteUrl::parse_image(url_name).map_err(ChunkError::from)?;
    let name = as_name.unwrap_or(&rname).to_string();
    if !manifest::valid_name(&name) || !manifest::valid_name(&rname) {
        return Err(ImageError::BadName {
            name,
            why: "names are letters, digits, '-', '_' and '.', not starting with '.'".into(),
        }
        .into());
    }
    let remote = Remote::open(url).map_err(ChunkError::from)?;
    let (body, sig) = remote.get_manifest(&rname).map_err(ChunkError::from)?;
    let m = manifest::parse_manifest(&rname, &body)?;
    images.check_signature(&rname, &body, &sig, &m)?;
    let seen = crate::pullcheck::check(images, &remote, &rname, &body, &sig, &m, allow_rollback)?;
    manifest::check_paths(&rname, &m)?;
    check_chunk_lists(&rname, &m)?;
    let state = images.state_dir().to_path_buf();
    // What is fetched now: everything, or for a streaming wake the chunks
    // of the small files (CRIU reads them whole).
    let wanted: Vec<ChunkRef> = m
        .files
        .iter()
        .filter(|f| !stream || !manifest::chunked_name(&f.path))
        .flat_map(|f| f.chunks.iter().cloned())
        .collect();
    on_total(wanted.iter().map(|c| c.size).sum());
    let local = local_store(images)?;
    // Held until the image is in place: gc sees its chunks referenced.
    let _lock = local.shared_lock()?;
    if let Ok((dir, _)) = images.manifest(&name) {
        if manifest::manifest_bytes(&name, &dir).is_ok_and(|(b, _)| b == body) {
            let report = remote.fetch(&local, &rname, &wanted, on_bytes)?;
            seen.note(images, &remote.url.base, &rname);
            if !stream {
                crate::origin::clear_origin(&state, &name);
            }
            return Ok((name, report));
        }
    }
    let report = remote.fetch(&local, &rname, &wanted, on_bytes)?;
    let pending = images.begin(&name)?;
    for f in &m.files {
        if manifest::chunked_name(&f.path) && !f.chunks.is_empty() {
            continue; // kept as chunks
        }
        let to_path = pending.dir.join(&f.path);
        if let Some(parent) = to_path.parent() {
            gpusnap_files::mkdir_private(parent).map_err(|e| ImageError::Io {
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
        let mut to = gpusnap_files::create_private(&to_path).map_err(ioe)?;
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
    gpusnap_files::write_private(&pending.dir.join(manifest::MANIFEST), &body)
        .map_err(|e| ImageError::Io { name: name.clone(), op: "write manifest".into(), err: e })?;
    gpusnap_files::write_private(&pending.dir.join(manifest::SIG), &sig).map_err(|e| ImageError::Io {
        name: name.clone(),
        op: "write manifest.sig".into(),
        err: e,
    })?;
    // The origin before the image: an image that lacks chunks is never
    // without the remote that has them.
    if stream {
        crate::origin::set_origin(&state, &name, &remote.url.base).map_err(|e| ImageError::Io {
            name: name.clone(),
            op: "record the origin".into(),
            err: e,
        })?;
    } else {
        crate::origin::clear_origin(&state, &name);
    }
    pending.install().map_err(|e| ImageError::Io {
        name: name.clone(),
        op: "rename into place".into(),
        err: e,
    })?;
    let check = if stream { manifest::ChunkCheck::Listed } else { manifest::ChunkCheck::Present };
    images.verify_with(&name, check, |_| {})?;
    seen.note(images, &remote.url.base, &rname);
    Ok((name, report))
}

/// Opens the remote an image streams from.
pub fn open_origin(url: &str) -> Result<Remote, crate::Error> {
    Ok(Remote::open(RemoteUrl::parse(url).map_err(ChunkError::from)?).map_err(ChunkError::from)?)
}

/// Removes the chunks no image of this store refers to. Safe against a
/// concurrent hibernate, import, push or pull (they hold the store's lock
/// shared from their first chunk to their manifest, gc holds it exclusive).
pub fn gc(images: &ImageStore, on_chunk: &dyn Fn(u64)) -> Result<GcReport, crate::Error> {
    let local = local_store(images)?;
    let _lock = local.exclusive_lock()?;
    let mut referenced = HashSet::new();
    // Every manifest that parses counts, signed or not, ours or not:
    // removing an image is `images rm`'s decision, never gc's.
    for name in images.names() {
        if let Ok(dir) = images.locate(&name) {
            if let Ok((_, m)) = manifest::read_manifest(&name, &dir) {
                referenced.extend(all_chunks(&m).into_iter().map(|c| c.blake3));
            }
        }
    }
    Ok(local.gc(&referenced, on_chunk))
}
