//! Whether a pull takes the manifest a remote holds under a name (its
//! signature already checked): signed by a key trusted for that name, pushed
//! as that name to that remote, the one the newest entry of the name in the
//! signed indexes of the keys trusted for it names (crate::index), and no
//! older than what this host saw there.

use crate::image::ImageStore;
use crate::index::{now_unix, Index};
use crate::manifest::{ImageError, Manifest};
use crate::sign::{Envelope, PushRecord};
use gpusnap_chunks::{ChunkError, Remote};

/// What a pull that takes the manifest records as seen: the push's
/// version, and the sequence of each index it read.
pub struct Seen {
    pub version: u64,
    indexes: Sequences,
}

/// The name under which this host keeps the newest sequence it saw of key
/// `key`'s index of a remote (crate::pushed).
pub fn index_seen_name(key: &str) -> String {
    format!("index/{key}")
}

impl Seen {
    /// Records what the pull took as seen here.
    pub fn note(&self, images: &ImageStore, remote: &str, name: &str) {
        let state = images.state_dir();
        let _ = crate::pushed::note(state, remote, name, self.version);
        for (k, seq) in &self.indexes {
            let _ = crate::pushed::note(state, remote, &index_seen_name(k), *seq);
        }
    }
}

fn same_remote(a: &str, b: &str) -> bool {
    a.trim_end_matches('/') == b.trim_end_matches('/')
}

/// The sequence of each index read, by its key.
type Sequences = Vec<(String, u64)>;

/// The newest entry of `rname` in the indexes on `remote` of the keys
/// trusted for it, and the sequence of each index read.
fn newest_entry(
    images: &ImageStore,
    remote: &Remote,
    rname: &str,
    allow_rollback: bool,
) -> Result<(Option<PushRecord>, Sequences), crate::Error> {
    let base = &remote.url.base;
    let refuse = |why: String| ImageError::Untrusted { name: rname.into(), why };
    let (trust, now) = (images.trust(), now_unix());
    let mut newest: Option<PushRecord> = None;
    let mut seqs = Vec::new();
    for k in trust.keys_for(rname) {
        let Some(bytes) = remote.get_index(&k).map_err(ChunkError::from)? else { continue };
        // An index that expired vouches for nothing: refused where it names
        // the name, passed over where it does not.
        let idx = Index::decode(&bytes, trust, base, &k, 0)
            .map_err(|why| refuse(format!("the signed index of key {k} on {base}: {why}")))?;
        match idx.expired(now) {
            Some(why) if idx.entries.contains_key(rname) => {
                return Err(refuse(format!("the signed index of key {k} on {base}: {why}")).into())
            }
            Some(_) => continue,
            None => {}
        }
        let seen = crate::pushed::seen(images.state_dir(), base, &index_seen_name(&k));
        if idx.sequence < seen && !allow_rollback {
            return Err(refuse(format!(
                "the signed index of key {k} on {base} is number {} and number {seen} was already seen here (an older index put back: a rollback; pass --allow-rollback to take it)",
                idx.sequence
            ))
            .into());
        }
        if let Some(e) = idx.entries.get(rname) {
            trust
                .check_push(e, None)
                .map_err(|e| refuse(format!("its entry in the index of key {k}: {e}")))?;
            if e.name != rname || !e.remote.as_deref().is_some_and(|r| same_remote(r, base)) {
                return Err(refuse(format!(
                    "its entry in the index of key {k} is of another name or remote"
                ))
                .into());
            }
            if newest.as_ref().is_none_or(|n| e.version > n.version) {
                newest = Some(e.clone());
            }
        }
        seqs.push((k, idx.sequence));
    }
    Ok((newest, seqs))
}

/// Checks the manifest `body` (`m`, signed with `sig`) fetched from
/// `remote` as `rname`. A manifest whose record predates indexes (an older
/// gpusnap's push) is taken as before only while no index names the name;
/// one without a record only if it names itself `rname` and no index names
/// it either. `allow_rollback` takes an older push or index the operator
/// asked for.
pub fn check(
    images: &ImageStore,
    remote: &Remote,
    rname: &str,
    body: &[u8],
    sig: &[u8],
    m: &Manifest,
    allow_rollback: bool,
) -> Result<Seen, crate::Error> {
    let base = &remote.url.base;
    let refuse = |why: String| ImageError::Untrusted { name: rname.into(), why };
    let env: Envelope = serde_json::from_slice(sig)
        .map_err(|e| ImageError::Corrupt { name: rname.into(), why: format!("manifest.sig: {e}") })?;
    images.trust().check_scope(&env.key, rname).map_err(|e| refuse(e.to_string()))?;
    let (newest, indexes) = newest_entry(images, remote, rname, allow_rollback)?;
    let version = match env.push {
        Some(rec) => {
            images
                .trust()
                .check_push(&rec, Some(body))
                .map_err(|e| refuse(format!("its push record: {e}")))?;
            if rec.name != rname {
                return Err(refuse(format!(
                    "it was pushed as {:?}, not as {rname:?} (a manifest copied over another image's)",
                    rec.name
                ))
                .into());
            }
            match &rec.remote {
                Some(r) if !same_remote(r, base) => {
                    return Err(refuse(format!(
                        "it was pushed to {r}, not to {base} (a push copied from another remote)"
                    ))
                    .into())
                }
                Some(_) if newest.is_none() => {
                    return Err(refuse(format!(
                        "it was pushed with a signed index, and no index on {base} of a key trusted here for {rname:?} names it (the index removed, or its key not trusted here)"
                    ))
                    .into())
                }
                _ => {}
            }
            rec.version
        }
        None => {
            if let Some(n) = &newest {
                return Err(refuse(format!(
                    "it carries no signed push record, and the signed index on {base} names push version {} of it (a manifest put back without its record)",
                    n.version
                ))
                .into());
            }
            if m.name != rname {
                return Err(refuse(format!(
                    "its manifest names image {:?} and carries no signed push record (a manifest copied over another image's, or pushed under another name by an older gpusnap: push it again)",
                    m.name
                ))
                .into());
            }
            0
        }
    };
    if let Some(n) = &newest {
        let same =
            n.manifest.eq_ignore_ascii_case(blake3::hash(body).to_hex().as_str()) && n.version == version;
        if !same && !allow_rollback {
            return Err(refuse(format!(
                "the signed index on {base} names push version {} of it, not this push version {version} (an older push put back: a rollback, pass --allow-rollback to take it; or a push in progress: pull again)",
                n.version
            ))
            .into());
        }
    }
    let seen = crate::pushed::seen(images.state_dir(), base, rname);
    if version < seen && !allow_rollback {
        return Err(refuse(format!(
            "it is push version {version} and version {seen} of it was already seen here (a rollback: pass --allow-rollback to take the older one)"
        ))
        .into());
    }
    Ok(Seen { version, indexes })
}
