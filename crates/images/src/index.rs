//! A key's signed index of its pushes to one remote
//! (`REMOTE/index/KEY.json`): for each name it pushed there, the push
//! record of its latest push (the manifest's blake3, the version), and,
//! for the whole index, the remote it is of, a sequence number and an
//! expiry. A pull takes a manifest only when the newest entry of that name
//! among the indexes of the keys it trusts for the name names that very
//! manifest: an older push put back is refused on any host, not only on
//! one that saw the newer, until the index it was pushed with expires.
//! One object, so that a reader never sees an index without its signature.

use crate::sign::{Envelope, HostKey, PushRecord, Trust};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How long an index vouches for its entries when the push does not say.
pub const DEFAULT_TTL: Duration = Duration::from_secs(30 * 24 * 3600);

/// What a key signs of its pushes to a remote.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Index {
    /// The remote (its URL without an image name).
    pub remote: String,
    /// The signing key, hex.
    pub key: String,
    /// One more at every push by this key to this remote.
    pub sequence: u64,
    /// Unix seconds after which the index vouches for nothing.
    pub expires: u64,
    /// The latest push of each name, as its record.
    pub entries: BTreeMap<String, PushRecord>,
}

/// The stored object: the index's exact bytes and their signature.
#[derive(Serialize, Deserialize)]
struct Stored {
    signed: String,
    signature: Envelope,
}

pub fn now_unix() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

impl Index {
    pub fn new(remote: &str, key: &str) -> Self {
        Self { remote: remote.into(), key: key.into(), sequence: 0, expires: 0, entries: BTreeMap::new() }
    }

    /// The stored bytes, signed by `key`.
    pub fn encode(&self, key: &HostKey) -> Vec<u8> {
        let signed = serde_json::to_string(self).unwrap_or_default();
        let signature = key.sign(signed.as_bytes());
        serde_json::to_vec(&Stored { signed, signature }).unwrap_or_default()
    }

    /// Why the index vouches for nothing at `now` (it has expired), if so.
    pub fn expired(&self, now: u64) -> Option<String> {
        (self.expires <= now).then(|| {
            format!(
                "it expired {}s ago (a push to the remote by that key signs a fresh one)",
                now - self.expires
            )
        })
    }

    /// The index in `bytes`, stored as key `key` (hex)'s index of `remote`:
    /// signed by that key (trusted here), of that remote, not expired at
    /// `now` (0: expired or not). Why not, otherwise.
    pub fn decode(bytes: &[u8], trust: &Trust, remote: &str, key: &str, now: u64) -> Result<Self, String> {
        let stored: Stored = serde_json::from_slice(bytes).map_err(|e| format!("it is malformed ({e})"))?;
        if !stored.signature.key.eq_ignore_ascii_case(key) {
            return Err(format!("it is signed by key {}, not by {key}", stored.signature.key));
        }
        trust.check(stored.signed.as_bytes(), &stored.signature).map_err(|e| e.to_string())?;
        let idx: Index =
            serde_json::from_str(&stored.signed).map_err(|e| format!("it is malformed ({e})"))?;
        if !idx.key.eq_ignore_ascii_case(key) {
            return Err(format!("it names key {}, not {key}", idx.key));
        }
        if idx.remote.trim_end_matches('/') != remote.trim_end_matches('/') {
            return Err(format!("it was signed for the remote {}, not {remote}", idx.remote));
        }
        match idx.expired(now) {
            Some(why) if now > 0 => Err(why),
            _ => Ok(idx),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_index_is_of_one_key_one_remote_and_expires() {
        let d = tempfile::tempdir().unwrap();
        let k = HostKey::load_or_create(d.path()).unwrap();
        let trust = Trust::host_only(d.path()).unwrap();
        let key = k.public_hex();
        let mut idx = Index::new("s3://b/fleet", &key);
        idx.expires = 1000;
        idx.entries.insert("a".into(), k.sign_push("s3://b/fleet", "a", 1, b"m"));
        let bytes = idx.encode(&k);
        assert_eq!(Index::decode(&bytes, &trust, "s3://b/fleet/", &key, 999).unwrap(), idx);
        let r = Index::decode(&bytes, &trust, "s3://b/fleet", &key, 1000);
        assert!(r.unwrap_err().contains("expired"));
        let r = Index::decode(&bytes, &trust, "s3://b/other", &key, 1);
        assert!(r.unwrap_err().contains("s3://b/fleet"));
        let r = Index::decode(&bytes, &trust, "s3://b/fleet", &"0".repeat(64), 1);
        assert!(r.unwrap_err().contains("signed by key"));
        // Changed after it was signed: refused.
        let text = String::from_utf8(bytes).unwrap().replace("\\\"sequence\\\":0", "\\\"sequence\\\":9");
        let r = Index::decode(text.as_bytes(), &trust, "s3://b/fleet", &key, 1);
        assert!(r.unwrap_err().contains("does not match"));
        let other = tempfile::tempdir().unwrap();
        let r =
            Index::decode(&idx.encode(&k), &Trust::host_only(other.path()).unwrap(), "s3://b/fleet", &key, 1);
        assert!(r.unwrap_err().contains("not this host's"));
    }
}
