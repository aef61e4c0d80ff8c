//! Signatures: who wrote a manifest, and whether this host trusts them.
//!
//! An image is treated like a download (it may come from another host or an
//! object store, and gpusnap runs it as root): its manifest is signed with
//! ed25519 by the host key of the gpusnap that wrote it, and everything else
//! in the image is bound to the manifest by its blake3 checksums. The API is
//! over bytes, not over a manifest type, so that any signed document (a
//! manifest listing chunks, an index of a remote store) can use it.
//!
//! The host key is a 32-byte ed25519 seed in `STATE_DIR/host.key` (hex,
//! 0600, created on first need); its public half is printed by
//! `gpusnap images key` and is what another host passes to `--trust`.

use ed25519_dalek::{Signature, Signer as _, SigningKey, VerifyingKey};
use serde::{Deserialize, Serialize};
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

pub const ALGORITHM: &str = "ed25519";
const KEY_FILE: &str = "host.key";

#[derive(Debug, thiserror::Error)]
pub enum SignError {
    #[error("host key {path}: {reason}")]
    HostKey { path: String, reason: String },
    #[error("not a public key: {0} (give 64 hex digits, or a file holding them: `gpusnap images key` prints this host's)")]
    BadKey(String),
    #[error("not a name pattern: {0} (give KEY=PATTERN[,PATTERN...], e.g. KEY=dev-*)")]
    BadScope(String),
}

/// A signature of some bytes, stored beside them (`manifest.sig`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Envelope {
    pub algorithm: String,
    /// The signer's public key, hex.
    pub key: String,
    /// The signature, hex.
    pub signature: String,
    /// On a remote: what the push that put it there signed (absent in
    /// images pushed before pushes were signed, and in local images).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub push: Option<PushRecord>,
}

/// What a push binds to a manifest, signed by the pushing host: the remote
/// and the name the image is stored under there and the push's version
/// (one more than the last push of that name), so that a pull refuses a
/// manifest copied over another name's or from another remote, and an
/// older push put back. The same record is the push's entry in the
/// pusher's signed index of the remote (crate::index).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct PushRecord {
    /// The remote pushed to (its URL without the image name). Absent in
    /// records of older gpusnaps, which named no remote and kept no index.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote: Option<String>,
    pub name: String,
    pub version: u64,
    /// The blake3 of the manifest's bytes, hex.
    pub manifest: String,
    /// The pushing host's public key, hex.
    pub key: String,
    /// Its signature of the three above, hex.
    pub signature: String,
}

impl PushRecord {
    fn signed_bytes(&self) -> Vec<u8> {
        let (name, version, manifest) = (&self.name, self.version, &self.manifest);
        match &self.remote {
            Some(remote) => {
                format!(
                    "gpusnap-push-2\nremote {remote}\nname {name}\nversion {version}\nmanifest {manifest}\n"
                )
            }
            None => format!("gpusnap-push\nname {name}\nversion {version}\nmanifest {manifest}\n"),
        }
        .into_bytes()
    }
}

/// This host's signing key.
pub struct HostKey {
    key: SigningKey,
}

impl HostKey {
    /// The key of the state directory `dir`, created on first need. The
    /// directory itself is checked by [`gpusnap_core::store::check_state_dir`].
    pub fn load_or_create(dir: &Path) -> Result<Self, SignError> {
        if let Some(k) = Self::load(dir)? {
            return Ok(k);
        }
        let path = dir.join(KEY_FILE);
        let err = |reason: String| SignError::HostKey { path: path.display().to_string(), reason };
        let key = SigningKey::generate(&mut rand::rngs::OsRng);
        // Written under a temporary name and linked into place: a reader
        // never sees half a key, and of two gpusnaps creating one at once
        // the first wins and the other uses it.
        let tmp = dir.join(format!(".{KEY_FILE}.tmp-{}", std::process::id()));
        let _ = std::fs::remove_file(&tmp);
        let mut f = gpusnap_files::create_private(&tmp).map_err(|e| err(format!("cannot create: {e}")))?;
        f.write_all(hex::encode(key.to_bytes()).as_bytes())
            .and_then(|()| f.sync_all())
            .map_err(|e| err(format!("cannot write: {e}")))?;
        let linked = std::fs::hard_link(&tmp, &path);
        let _ = std::fs::remove_file(&tmp);
        match linked {
            Ok(()) => Ok(Self { key }),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                Self::load(dir)?.ok_or_else(|| err("vanished while created".into()))
            }
            Err(e) => Err(err(format!("cannot create: {e}"))),
        }
    }

    /// The key of `dir`, if one was made.
    pub fn load(dir: &Path) -> Result<Option<Self>, SignError> {
        let path = dir.join(KEY_FILE);
        let err = |reason: String| SignError::HostKey { path: path.display().to_string(), reason };
        let f = match std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(&path)
        {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(err(format!("cannot open (a link?): {e}"))),
        };
        let meta = f.metadata().map_err(|e| err(e.to_string()))?;
        use std::os::unix::fs::MetadataExt;
        if !meta.is_file() || meta.mode() & 0o077 != 0 || meta.uid() != nix::unistd::geteuid().as_raw() {
            return Err(err(format!(
                "must be a regular file owned by this user, mode 0600 (it is {:o}): remove it and a new one is made",
                meta.mode() & 0o7777
            )));
        }
        let mut text = String::new();
        f.take(256).read_to_string(&mut text).map_err(|e| err(e.to_string()))?;
        let bytes: [u8; 32] = hex::decode(text.trim())
            .ok()
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| err("not 64 hex digits".into()))?;
        Ok(Some(Self { key: SigningKey::from_bytes(&bytes) }))
    }

    pub fn public_hex(&self) -> String {
        hex::encode(self.key.verifying_key().to_bytes())
    }

    pub fn sign(&self, body: &[u8]) -> Envelope {
        Envelope {
            algorithm: ALGORITHM.into(),
            key: self.public_hex(),
            signature: hex::encode(self.key.sign(body).to_bytes()),
            push: None,
        }
    }

    /// Signs the push of the manifest `body` to `remote` as `name`,
    /// version `version`.
    pub fn sign_push(&self, remote: &str, name: &str, version: u64, body: &[u8]) -> PushRecord {
        let mut rec = PushRecord {
            remote: Some(remote.into()),
            name: name.into(),
            version,
            manifest: blake3::hash(body).to_hex().to_string(),
            key: self.public_hex(),
            signature: String::new(),
        };
        rec.signature = self.sign(&rec.signed_bytes()).signature;
        rec
    }
}

/// The keys whose signatures are accepted: this host's, and those named
/// with `--trust` (each for every name, or for the names its patterns
/// match: `KEY=PATTERN[,PATTERN...]`).
#[derive(Debug, Clone, Default)]
pub struct Trust {
    keys: Vec<VerifyingKey>,
    /// The names a key of `keys` may sign, by its hex; a key absent here
    /// signs any name.
    scopes: std::collections::HashMap<String, Scope>,
    /// The state directory whose host key is trusted; read again when a
    /// check needs it and it was not there yet (a hibernate in this same
    /// run may have just made it).
    host: Option<PathBuf>,
    /// This host's key as read when the trust was made.
    host_key: Option<VerifyingKey>,
}

/// Why a signature is not accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Untrusted {
    Malformed(String),
    /// Signed by a key that is not trusted here (its hex).
    Foreign(String),
    BadSignature,
    /// This host's key could not be read to compare (why): not the
    /// image's fault, and not a verdict on its signer.
    HostKey(String),
    /// Signed by a key trusted only for other names: (key, its patterns,
    /// the name).
    OutOfScope(String, String, String),
}

/// The image names a trusted key may sign: shell-style patterns (`*`, `?`,
/// `[...]`), any of which may match.
#[derive(Debug, Clone)]
pub struct Scope {
    patterns: String,
    set: globset::GlobSet,
}

impl Scope {
    /// `dev-*,team-a-*`: comma-separated patterns.
    pub fn parse(text: &str) -> Result<Self, SignError> {
        let mut b = globset::GlobSetBuilder::new();
        let mut n = 0;
        for p in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let g = globset::GlobBuilder::new(p)
                .literal_separator(true)
                .build()
                .map_err(|e| SignError::BadScope(format!("{p}: {e}")))?;
            b.add(g);
            n += 1;
        }
        if n == 0 {
            return Err(SignError::BadScope(format!("{text:?} names no pattern")));
        }
        let set = b.build().map_err(|e| SignError::BadScope(e.to_string()))?;
        Ok(Self { patterns: text.trim().to_string(), set })
    }

    pub fn allows(&self, name: &str) -> bool {
        self.set.is_match(name)
    }
}

impl std::fmt::Display for Untrusted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Malformed(why) => write!(f, "its signature is malformed ({why})"),
            Self::Foreign(k) => write!(
                f,
                "it is signed by key {k}, which is not this host's (if you trust it, pass --trust {k})"
            ),
            Self::BadSignature => write!(f, "its signature does not match (tampered with)"),
            Self::HostKey(why) => {
                write!(f, "this host's key could not be read to check its signature ({why})")
            }
            Self::OutOfScope(k, patterns, name) => write!(
                f,
                "it is signed by key {k}, which is trusted only for names matching {patterns}, not {name:?}"
            ),
        }
    }
}

pub fn parse_public(text: &str) -> Result<VerifyingKey, SignError> {
    let bytes: [u8; 32] = hex::decode(text.trim())
        .ok()
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| SignError::BadKey(text.chars().take(80).collect()))?;
    VerifyingKey::from_bytes(&bytes).map_err(|_| SignError::BadKey(text.chars().take(80).collect()))
}

impl Trust {
    /// This host's key (if one was made) and each of `extra`: 64 hex digits,
    /// or the path of a file holding them.
    pub fn new(state_dir: &Path, extra: &[String]) -> Result<Self, SignError> {
        let mut keys = Vec::new();
        // A key that is there must be sound (mode, owner): said now, and
        // kept, so that a check needs no file (an agent short of
        // descriptors must not take its own image for a stranger's).
        let host_key = HostKey::load(state_dir)?.map(|k| k.key.verifying_key());
        let mut scopes = std::collections::HashMap::new();
        for e in extra {
            // KEY=PATTERNS: the key for those names only.
            let (e, scope) = match e.rsplit_once('=') {
                Some((k, patterns)) => (k.to_string(), Some(Scope::parse(patterns)?)),
                None => (e.clone(), None),
            };
            let e = &e;
            let text = if hex::decode(e.trim()).is_ok_and(|b| b.len() == 32) {
                e.clone()
            } else {
                let p = PathBuf::from(e);
                let f = std::fs::File::open(&p).map_err(|err| SignError::BadKey(format!("{e}: {err}")))?;
                let mut s = String::new();
                f.take(4096)
                    .read_to_string(&mut s)
                    .map_err(|err| SignError::BadKey(format!("{e}: {err}")))?;
                s
            };
            let key = parse_public(&text)?;
            let hex = hex::encode(key.to_bytes());
            match scope {
                // Named twice, once for every name: every name.
                _ if keys.contains(&key) && !scopes.contains_key(&hex) => {}
                Some(sc) => {
                    let merged = match scopes.remove(&hex) {
                        Some(Scope { patterns, .. }) => Scope::parse(&format!("{patterns},{}", sc.patterns))?,
                        None => sc,
                    };
                    scopes.insert(hex, merged);
                }
                None => {
                    scopes.remove(&hex);
                }
            }
            if !keys.contains(&key) {
                keys.push(key);
            }
        }
        Ok(Self { keys, scopes, host: Some(state_dir.to_path_buf()), host_key })
    }

    /// Only this host's key.
    pub fn host_only(state_dir: &Path) -> Result<Self, SignError> {
        Self::new(state_dir, &[])
    }

    /// Checks `env` over `body`; returns the signer's key (hex).
    pub fn check(&self, body: &[u8], env: &Envelope) -> Result<String, Untrusted> {
        if env.algorithm != ALGORITHM {
            return Err(Untrusted::Malformed(format!("algorithm {:?}", env.algorithm)));
        }
        let key = parse_public(&env.key).map_err(|_| Untrusted::Malformed("key".into()))?;
        if !self.keys.contains(&key) && self.host_key != Some(key) {
            // Made since this trust was? Read it again; a failure to read
            // is said as such, never as a foreign signer.
            let now = match (self.host_key, self.host.as_deref()) {
                (None, Some(dir)) => HostKey::load(dir).map_err(|e| Untrusted::HostKey(e.to_string()))?,
                _ => None,
            };
            if now.map(|k| k.key.verifying_key()) != Some(key) {
                return Err(Untrusted::Foreign(hex::encode(key.to_bytes())));
            }
        }
        let sig: [u8; 64] = hex::decode(&env.signature)
            .ok()
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| Untrusted::Malformed("signature".into()))?;
        key.verify_strict(body, &Signature::from_bytes(&sig)).map_err(|_| Untrusted::BadSignature)?;
        Ok(env.key.to_ascii_lowercase())
    }

    /// Whether the trusted key `key` (hex) may sign the image name `name`:
    /// this host's key and keys trusted without patterns sign any name.
    pub fn check_scope(&self, key: &str, name: &str) -> Result<(), Untrusted> {
        match self.scopes.get(&key.to_ascii_lowercase()) {
            Some(sc) if !sc.allows(name) => {
                Err(Untrusted::OutOfScope(key.to_ascii_lowercase(), sc.patterns.clone(), name.into()))
            }
            _ => Ok(()),
        }
    }

    /// The trusted keys (hex) that may sign `name`: this host's (when it
    /// has one) and those of `--trust` whose patterns match it.
    pub fn keys_for(&self, name: &str) -> Vec<String> {
        let host = self.host_key.or_else(|| {
            let dir = self.host.as_deref()?;
            HostKey::load(dir).ok().flatten().map(|k| k.key.verifying_key())
        });
        let mut out: Vec<String> = host.iter().map(|k| hex::encode(k.to_bytes())).collect();
        for k in &self.keys {
            let h = hex::encode(k.to_bytes());
            if !out.contains(&h) && self.check_scope(&h, name).is_ok() {
                out.push(h);
            }
        }
        out
    }

    /// Checks a push record: signed by a trusted key allowed to sign its
    /// name, of the manifest `body` (None: of whatever manifest it names).
    /// Its remote, name and version are the caller's to judge.
    pub fn check_push(&self, rec: &PushRecord, body: Option<&[u8]>) -> Result<String, Untrusted> {
        if body.is_some_and(|b| !rec.manifest.eq_ignore_ascii_case(blake3::hash(b).to_hex().as_str())) {
            return Err(Untrusted::BadSignature);
        }
        let env = Envelope {
            algorithm: ALGORITHM.into(),
            key: rec.key.clone(),
            signature: rec.signature.clone(),
            push: None,
        };
        let key = self.check(&rec.signed_bytes(), &env)?;
        self.check_scope(&key, &rec.name)?;
        Ok(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_are_checked_against_trusted_keys() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        let ka = HostKey::load_or_create(a.path()).unwrap();
        assert_eq!(HostKey::load_or_create(a.path()).unwrap().public_hex(), ka.public_hex(), "kept");
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(a.path().join(KEY_FILE)).unwrap().permissions().mode() & 0o777, 0o600);
        let kb = HostKey::load_or_create(b.path()).unwrap();
        let env = ka.sign(b"body");
        let here = Trust::host_only(a.path()).unwrap();
        assert_eq!(here.check(b"body", &env).unwrap(), ka.public_hex());
        assert_eq!(here.check(b"bodY", &env), Err(Untrusted::BadSignature));
        let there = Trust::host_only(b.path()).unwrap();
        assert!(matches!(there.check(b"body", &env), Err(Untrusted::Foreign(_))));
        let told = Trust::new(b.path(), &[ka.public_hex()]).unwrap();
        assert!(told.check(b"body", &env).is_ok());
        // A file holding the key works as well as its text.
        std::fs::write(b.path().join("a.pub"), ka.public_hex() + "\n").unwrap();
        let file = b.path().join("a.pub").display().to_string();
        assert!(Trust::new(b.path(), &[file]).unwrap().check(b"body", &env).is_ok());
        assert!(Trust::new(b.path(), &["zz".into()]).is_err());
        // Signed by B but claiming A's key: refused.
        let forged = Envelope { key: ka.public_hex(), ..kb.sign(b"body") };
        assert_eq!(here.check(b"body", &forged), Err(Untrusted::BadSignature));
        // Trusted from before the host key existed: it counts once made.
        let c = tempfile::tempdir().unwrap();
        let early = Trust::host_only(c.path()).unwrap();
        let kc = HostKey::load_or_create(c.path()).unwrap();
        assert!(early.check(b"x", &kc.sign(b"x")).is_ok());
        assert!(matches!(Trust::default().check(b"x", &kc.sign(b"x")), Err(Untrusted::Foreign(_))));
        // Once read, this host's key is checked without its file: a file
        // that cannot be opened later (no descriptor left) changes nothing.
        let here = Trust::host_only(a.path()).unwrap();
        std::fs::rename(a.path().join(KEY_FILE), a.path().join("moved")).unwrap();
        assert_eq!(here.check(b"body", &env).unwrap(), ka.public_hex());
        // A key made after the trust that cannot be read is said as such.
        let d = tempfile::tempdir().unwrap();
        let early = Trust::host_only(d.path()).unwrap();
        std::fs::write(d.path().join(KEY_FILE), "not a key").unwrap();
        std::fs::set_permissions(d.path().join(KEY_FILE), std::fs::Permissions::from_mode(0o600)).unwrap();
        let r = early.check(b"body", &env);
        assert!(matches!(&r, Err(Untrusted::HostKey(_))), "{r:?}");
        assert!(r.unwrap_err().to_string().contains("could not be read"));
    }

    #[test]
    fn push_records_bind_name_version_and_manifest() {
        let a = tempfile::tempdir().unwrap();
        let ka = HostKey::load_or_create(a.path()).unwrap();
        let here = Trust::host_only(a.path()).unwrap();
        let rec = ka.sign_push("s3://b/fleet", "llama-prod", 7, b"manifest");
        let m = Some(&b"manifest"[..]);
        assert_eq!(here.check_push(&rec, m).unwrap(), ka.public_hex());
        assert_eq!(here.check_push(&rec, Some(b"other manifest")), Err(Untrusted::BadSignature));
        for forged in [
            PushRecord { name: "llama-dev".into(), ..rec.clone() },
            PushRecord { version: 8, ..rec.clone() },
            PushRecord { remote: Some("s3://b/other".into()), ..rec.clone() },
            PushRecord { remote: None, ..rec.clone() },
        ] {
            assert_eq!(here.check_push(&forged, m), Err(Untrusted::BadSignature));
        }
        let b = tempfile::tempdir().unwrap();
        let there = Trust::host_only(b.path()).unwrap();
        assert!(matches!(there.check_push(&rec, m), Err(Untrusted::Foreign(_))));
        // Trusted for other names only.
        let scoped = Trust::new(b.path(), &[format!("{}=dev-*,test-?", ka.public_hex())]).unwrap();
        let r = scoped.check_push(&rec, m);
        assert!(
            matches!(&r, Err(Untrusted::OutOfScope(_, p, n)) if p == "dev-*,test-?" && n == "llama-prod"),
            "{r:?}"
        );
        let dev = ka.sign_push("s3://b/fleet", "dev-a", 1, b"manifest");
        assert!(scoped.check_push(&dev, m).is_ok());
        assert!(scoped.check_scope(&ka.public_hex(), "test-1").is_ok());
        assert!(scoped.check_scope(&ka.public_hex(), "test-12").is_err());
        assert_eq!(scoped.keys_for("prod"), Vec::<String>::new());
        assert_eq!(scoped.keys_for("dev-b"), vec![ka.public_hex()]);
        // Named once for every name as well: every name.
        let both = Trust::new(b.path(), &[format!("{}=dev-*", ka.public_hex()), ka.public_hex()]).unwrap();
        assert!(both.check_push(&rec, m).is_ok());
        assert!(Trust::new(b.path(), &[format!("{}=", ka.public_hex())]).is_err());
        // Kept in the envelope, which older readers parse without it.
        let env = Envelope { push: Some(rec.clone()), ..ka.sign(b"manifest") };
        let text = serde_json::to_vec(&env).unwrap();
        let back: Envelope = serde_json::from_slice(&text).unwrap();
        assert_eq!(back.push, Some(rec));
        let plain: Envelope = serde_json::from_slice(&serde_json::to_vec(&ka.sign(b"m")).unwrap()).unwrap();
        assert_eq!(plain.push, None);
    }
}
