//! Remotes through `object_store`: S3 and S3-compatible servers
//! (`s3://BUCKET/PREFIX`, credentials and endpoint from the standard AWS
//! variables) and local directories (`file:///DIR`, for NFS and tests).

use crate::{decode, ChunkError, ChunkRef, LocalStore};
use futures::stream::{StreamExt, TryStreamExt};
use object_store::{path::Path as OPath, ObjectStore, PutPayload};
use serde::Serialize;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

/// Requests in flight at once (uploads or downloads of chunks).
const PARALLEL: usize = 8;
const MAX_MANIFEST: usize = 16 << 20;
const MAX_SIG: usize = 4096;
/// A signed index of one key's pushes to a remote (a few hundred bytes a
/// name).
const MAX_INDEX: usize = 8 << 20;

#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    #[error("{0:?} is not a remote: give s3://BUCKET/PREFIX or file:///DIR")]
    BadUrl(String),
    #[error("remote {url}: {op}: {why}")]
    Unreachable { url: String, op: String, why: String },
    #[error("remote {url}: {op}: access denied ({why}); check AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_REGION")]
    Denied { url: String, op: String, why: String },
    #[error("remote {url}: no bucket {bucket:?}: create it (aws s3 mb s3://{bucket}) or fix the URL")]
    NoBucket { url: String, bucket: String },
    #[error("remote {url}: no image {name} there")]
    NoImage { url: String, name: String },
    #[error("remote {url}: {what} is larger than a gpusnap object can be")]
    TooLarge { url: String, what: String },
}

/// A parsed remote URL: the store's prefix and, for pull/wake, the image name.
#[derive(Debug, Clone)]
pub struct RemoteUrl {
    /// `s3://BUCKET/PREFIX` or `file:///DIR`, without the image name.
    pub base: String,
    pub scheme: String,
    pub bucket_or_dir: String,
    pub prefix: String,
}

impl RemoteUrl {
    pub fn is_remote(s: &str) -> bool {
        s.starts_with("s3://") || s.starts_with("file://")
    }

    /// `s3://BUCKET[/PREFIX]` or `file:///DIR`.
    pub fn parse(s: &str) -> Result<Self, RemoteError> {
        let bad = || RemoteError::BadUrl(s.chars().take(200).collect());
        let (scheme, rest) = s.split_once("://").ok_or_else(bad)?;
        let rest = rest.trim_end_matches('/');
        match scheme {
            "s3" => {
                let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
                if bucket.is_empty() || prefix.split('/').any(|c| c == ".." || c == ".") {
                    return Err(bad());
                }
                Ok(Self {
                    base: format!("s3://{rest}"),
                    scheme: "s3".into(),
                    bucket_or_dir: bucket.into(),
                    prefix: prefix.trim_matches('/').into(),
                })
            }
            "file" => {
                if !rest.starts_with('/') || rest.split('/').any(|c| c == "..") {
                    return Err(bad());
                }
                Ok(Self {
                    base: format!("file://{rest}"),
                    scheme: "file".into(),
                    bucket_or_dir: rest.into(),
                    prefix: String::new(),
                })
            }
            _ => Err(bad()),
        }
    }

    /// Splits `URL/NAME` into the remote and the image name.
    pub fn parse_image(s: &str) -> Result<(Self, String), RemoteError> {
        let t = s.trim_end_matches('/');
        let (base, name) = t.rsplit_once('/').ok_or_else(|| RemoteError::BadUrl(s.into()))?;
        if name.is_empty() || base.ends_with(':') || base.ends_with(":/") {
            return Err(RemoteError::BadUrl(s.chars().take(200).collect()));
        }
        Ok((Self::parse(base)?, name.to_string()))
    }
}

/// What a push or pull did.
#[derive(Debug, Default, Clone, Serialize)]
pub struct TransferReport {
    pub image: String,
    pub remote: String,
    /// The image's bytes (its files, uncompressed).
    pub bytes_total: u64,
    /// Encoded bytes sent or received.
    pub bytes_sent: u64,
    /// Image bytes not transferred because the other side had their chunk.
    pub bytes_deduplicated: u64,
    pub chunks_total: u64,
    pub chunks_sent: u64,
    pub seconds: f64,
}

impl TransferReport {
    /// Counts `chunks` into the report and returns those to transfer: each
    /// distinct chunk the other side lacks (`have` is false) once; the rest
    /// are counted as deduplicated (and as progress) at once.
    fn pick_missing(
        &mut self,
        chunks: &[ChunkRef],
        have: impl Fn(&str) -> bool,
        on_bytes: &(dyn Fn(u64) + Sync),
    ) -> Vec<ChunkRef> {
        let mut todo = Vec::new();
        let mut seen = HashSet::new();
        for c in chunks {
            self.bytes_total += c.size;
            self.chunks_total += 1;
            if have(&c.blake3) || !seen.insert(c.blake3.clone()) {
                self.bytes_deduplicated += c.size;
                on_bytes(c.size);
            } else {
                todo.push(c.clone());
            }
        }
        todo
    }
}

pub struct Remote {
    pub url: RemoteUrl,
    store: Arc<dyn ObjectStore>,
    rt: tokio::runtime::Runtime,
}

/// A chunk name that is not a blake3 hash (cut short: it came from outside).
/// 64 hex digits: a public key as an object name.
fn is_key_hex(key: &str) -> bool {
    key.len() == 64 && key.bytes().all(|b| b.is_ascii_hexdigit())
}

fn not_a_hash(hash: &str) -> ChunkError {
    ChunkError::Corrupt { hash: hash.chars().take(80).collect(), why: "not a blake3 name".into() }
}

/// Whether an error's text carries an HTTP 401/403 or S3's refusal codes,
/// as whole words: the text also holds the URL, whose chunk names are hex
/// and hold "401" or "403" in about one push in thirty (a connection
/// refused was once called denied that way).
fn says_denied(why: &str) -> bool {
    why.split(|c: char| !c.is_ascii_alphanumeric()).any(|w| {
        ["403", "401", "forbidden", "accessdenied", "invalidaccesskeyid", "signaturedoesnotmatch"]
            .iter()
            .any(|k| w.eq_ignore_ascii_case(k))
    })
}

/// Whether an error's text carries S3's `NoSuchBucket` code.
fn says_no_bucket(why: &str) -> bool {
    why.split(|c: char| !c.is_ascii_alphanumeric()).any(|w| w.eq_ignore_ascii_case("nosuchbucket"))
}

/// The bucket of an `s3://BUCKET/...` URL.
fn bucket_of(url: &str) -> String {
    url.strip_prefix("s3://").and_then(|r| r.split('/').next()).unwrap_or(url).to_string()
}

fn classify(url: &str, op: &str, e: object_store::Error) -> RemoteError {
    let why = e.to_string();
    let denied = matches!(
        e,
        object_store::Error::PermissionDenied { .. } | object_store::Error::Unauthenticated { .. }
    ) || says_denied(&why);
    // The chain of sources holds the cause (connection refused, DNS).
    let mut why = why;
    let mut src: Option<&dyn std::error::Error> = std::error::Error::source(&e);
    while let Some(s) = src {
        let t = s.to_string();
        if !why.contains(&t) {
            why = format!("{why}: {t}");
        }
        src = s.source();
    }
    let why: String = why.chars().take(600).collect();
    // S3's XML says which: its one word is the whole answer.
    if says_no_bucket(&why) {
        return RemoteError::NoBucket { url: url.into(), bucket: bucket_of(url) };
    }
    if denied {
        RemoteError::Denied { url: url.into(), op: op.into(), why }
    } else {
        RemoteError::Unreachable { url: url.into(), op: op.into(), why }
    }
}

impl Remote {
    /// Opens a remote to read from (a missing directory remote is an error).
    pub fn open(url: RemoteUrl) -> Result<Self, RemoteError> {
        Self::open_with(url, false)
    }

    /// Opens a remote to push to (a directory remote is created if missing).
    pub fn open_for_push(url: RemoteUrl) -> Result<Self, RemoteError> {
        Self::open_with(url, true)
    }

    fn open_with(url: RemoteUrl, create: bool) -> Result<Self, RemoteError> {
        let fail = |e: object_store::Error| classify(&url.base, "open", e);
        let store: Arc<dyn ObjectStore> = match url.scheme.as_str() {
            "s3" => {
                // Bounded retries: an unreachable endpoint is said within
                // seconds, not after object_store's default three minutes.
                let retry = object_store::RetryConfig {
                    max_retries: 3,
                    retry_timeout: Duration::from_secs(20),
                    backoff: Default::default(),
                };
                let allow_http =
                    std::env::var("AWS_ALLOW_HTTP").is_ok_and(|v| v.eq_ignore_ascii_case("true"));
                // The whole client configuration: with_client_options
                // replaces what from_env read (AWS_ALLOW_HTTP among it).
                let opts = object_store::ClientOptions::new()
                    .with_allow_http(allow_http)
                    .with_connect_timeout(Duration::from_secs(5))
                    .with_timeout(Duration::from_secs(120));
                let mut b = object_store::aws::AmazonS3Builder::from_env();
                // Named explicitly: from_env does not map these two of the
                // standard variables in every object_store version.
                if let Ok(e) = std::env::var("AWS_ENDPOINT_URL") {
                    b = b.with_endpoint(e);
                }
                let b = b.with_bucket_name(&url.bucket_or_dir).with_retry(retry).with_client_options(opts);
                Arc::new(b.build().map_err(fail)?)
            }
            _ => {
                let made = if create {
                    std::fs::create_dir_all(&url.bucket_or_dir)
                } else {
                    std::fs::metadata(&url.bucket_or_dir).map(|_| ())
                };
                made.map_err(|e| RemoteError::Unreachable {
                    url: url.base.clone(),
                    op: if create { "create" } else { "open" }.into(),
                    why: e.to_string(),
                })?;
                Arc::new(
                    object_store::local::LocalFileSystem::new_with_prefix(&url.bucket_or_dir)
                        .map_err(fail)?,
                )
            }
        };
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().map_err(
            |e| RemoteError::Unreachable { url: url.base.clone(), op: "start".into(), why: e.to_string() },
        )?;
        Ok(Self { url, store, rt })
    }

    fn key(&self, rel: &str) -> OPath {
        if self.url.prefix.is_empty() {
            OPath::from(rel)
        } else {
            OPath::from(format!("{}/{rel}", self.url.prefix))
        }
    }

    fn chunk_key(&self, hash: &str) -> OPath {
        self.key(&format!("chunks/{hash}"))
    }

    /// The chunks the remote has (one listing: resumption skips them).
    pub fn chunks(&self) -> Result<HashSet<String>, RemoteError> {
        let prefix = self.key("chunks");
        let url = self.url.base.clone();
        self.rt.block_on(async {
            let mut out = HashSet::new();
            let mut s = self.store.list(Some(&prefix));
            while let Some(m) = s.next().await {
                let m = m.map_err(|e| classify(&url, "list chunks", e))?;
                if let Some(n) = m.location.filename() {
                    if crate::valid_hash(n) {
                        out.insert(n.to_string());
                    }
                }
            }
            Ok(out)
        })
    }

    async fn get_bounded(&self, key: &OPath, max: usize, what: &str) -> Result<Option<Vec<u8>>, RemoteError> {
        let url = &self.url.base;
        match self.store.get(key).await {
            // A missing bucket is a 404 too, which is not "no such object".
            Err(e @ object_store::Error::NotFound { .. }) => match classify(url, &format!("get {what}"), e) {
                nb @ RemoteError::NoBucket { .. } => Err(nb),
                _ => Ok(None),
            },
            Err(e) => Err(classify(url, &format!("get {what}"), e)),
            Ok(r) => {
                if r.meta.size > max as u64 {
                    return Err(RemoteError::TooLarge { url: url.clone(), what: what.into() });
                }
                let b = r.bytes().await.map_err(|e| classify(url, &format!("get {what}"), e))?;
                if b.len() > max {
                    return Err(RemoteError::TooLarge { url: url.clone(), what: what.into() });
                }
                Ok(Some(b.to_vec()))
            }
        }
    }

    /// The image's signed manifest and its signature, as stored.
    pub fn get_manifest(&self, name: &str) -> Result<(Vec<u8>, Vec<u8>), RemoteError> {
        let no = || RemoteError::NoImage { url: self.url.base.clone(), name: name.into() };
        self.rt.block_on(async {
            let body = self
                .get_bounded(&self.key(&format!("images/{name}/manifest.json")), MAX_MANIFEST, "manifest")
                .await?
                .ok_or_else(no)?;
            let sig = self
                .get_bounded(&self.key(&format!("images/{name}/manifest.sig")), MAX_SIG, "manifest.sig")
                .await?
                .ok_or_else(no)?;
            Ok((body, sig))
        })
    }

    /// The index that key `key` (hex) signed of its pushes here, as stored
    /// (`index/KEY.json`); None when it has none.
    pub fn get_index(&self, key: &str) -> Result<Option<Vec<u8>>, RemoteError> {
        if !is_key_hex(key) {
            return Ok(None);
        }
        self.rt.block_on(self.get_bounded(&self.key(&format!("index/{key}.json")), MAX_INDEX, "index"))
    }

    /// Stores the index of key `key` (hex), in one object.
    pub fn put_index(&self, key: &str, body: &[u8]) -> Result<(), RemoteError> {
        if !is_key_hex(key) || body.len() > MAX_INDEX {
            return Err(RemoteError::TooLarge { url: self.url.base.clone(), what: "index".into() });
        }
        let url = self.url.base.clone();
        self.rt.block_on(async {
            self.store
                .put(&self.key(&format!("index/{key}.json")), PutPayload::from(body.to_vec()))
                .await
                .map(|_| ())
                .map_err(|e| classify(&url, "put index", e))
        })
    }

    /// Sends the chunks of `chunks` the remote lacks (from the local store,
    /// in parallel), then the signature and, last, the manifest: an image is
    /// visible on the remote only once all its chunks are there.
    pub fn push(
        &self,
        local: &LocalStore,
        name: &str,
        chunks: &[ChunkRef],
        manifest: &[u8],
        sig: &[u8],
        on_bytes: &(dyn Fn(u64) + Sync),
    ) -> Result<TransferReport, ChunkError> {
        let t0 = std::time::Instant::now();
        let mut r =
            TransferReport { image: name.into(), remote: self.url.base.clone(), ..Default::default() };
        let there = self.chunks()?;
        let todo = r.pick_missing(chunks, |h| there.contains(h), on_bytes);
        let url = self.url.base.clone();
        self.transfer(&mut r, todo, |c| {
            let url = url.clone();
            async move {
                let enc = local.get_encoded(&c.blake3)?;
                // What leaves is what the store checked it to be.
                decode(&c.blake3, &enc)?;
                let n = enc.len() as u64;
                self.store
                    .put(&self.chunk_key(&c.blake3), PutPayload::from(enc))
                    .await
                    .map_err(|e| ChunkError::Remote(classify(&url, "put chunk", e)))?;
                on_bytes(c.size);
                Ok(n)
            }
        })?;
        self.rt.block_on(async {
            self.store
                .put(&self.key(&format!("images/{name}/manifest.sig")), PutPayload::from(sig.to_vec()))
                .await
                .map_err(|e| classify(&url, "put manifest.sig", e))?;
            self.store
                .put(&self.key(&format!("images/{name}/manifest.json")), PutPayload::from(manifest.to_vec()))
                .await
                .map_err(|e| classify(&url, "put manifest", e))
        })?;
        r.bytes_sent += (manifest.len() + sig.len()) as u64;
        r.seconds = t0.elapsed().as_secs_f64();
        Ok(r)
    }

    /// Fetches one chunk into `local`, checked against its hash before it
    /// is stored (a wake streaming from the remote asks for the chunk a
    /// page lies in). Returns the encoded bytes received.
    pub fn fetch_one(&self, local: &LocalStore, hash: &str) -> Result<u64, ChunkError> {
        if !crate::valid_hash(hash) {
            return Err(not_a_hash(hash));
        }
        let enc = self.rt.block_on(self.get_chunk(hash))?;
        local.put_encoded(hash, &enc)
    }

    /// Chunk `hash`, encoded, from the remote (bounded); a missing one is
    /// an error.
    async fn get_chunk(&self, hash: &str) -> Result<Vec<u8>, RemoteError> {
        self.get_bounded(&self.chunk_key(hash), crate::MAX_ENCODED as usize, &format!("chunk {hash}"))
            .await?
            .ok_or_else(|| RemoteError::Unreachable {
                url: self.url.base.clone(),
                op: format!("get chunk {hash}"),
                why: "missing on the remote".into(),
            })
    }

    /// Moves each chunk of `todo` with `one` (which gives the encoded bytes
    /// it moved), [`PARALLEL`] at a time, and counts them into `r`.
    fn transfer<F, Fut>(&self, r: &mut TransferReport, todo: Vec<ChunkRef>, one: F) -> Result<(), ChunkError>
    where
        F: Fn(ChunkRef) -> Fut,
        Fut: std::future::Future<Output = Result<u64, ChunkError>>,
    {
        let moved: Vec<u64> = self.rt.block_on(
            futures::stream::iter(todo.into_iter().map(one)).buffer_unordered(PARALLEL).try_collect(),
        )?;
        r.chunks_sent = moved.len() as u64;
        r.bytes_sent = moved.iter().sum();
        Ok(())
    }

    /// Fetches into `local` the chunks of `chunks` it lacks, in parallel,
    /// each checked against its hash before it is stored (a chunk already
    /// fetched by an interrupted pull is not fetched again).
    pub fn fetch(
        &self,
        local: &LocalStore,
        name: &str,
        chunks: &[ChunkRef],
        on_bytes: &(dyn Fn(u64) + Sync),
    ) -> Result<TransferReport, ChunkError> {
        let t0 = std::time::Instant::now();
        let mut r =
            TransferReport { image: name.into(), remote: self.url.base.clone(), ..Default::default() };
        if let Some(c) = chunks.iter().find(|c| !crate::valid_hash(&c.blake3)) {
            return Err(not_a_hash(&c.blake3));
        }
        let todo = r.pick_missing(chunks, |h| local.has(h), on_bytes);
        self.transfer(&mut r, todo, |c| async move {
            let enc = self.get_chunk(&c.blake3).await?;
            let n = enc.len() as u64;
            local.put_encoded(&c.blake3, &enc)?;
            on_bytes(c.size);
            Ok(n)
        })?;
        r.seconds = t0.elapsed().as_secs_f64();
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::{bucket_of, says_denied, says_no_bucket};

    #[test]
    fn a_missing_bucket_is_named() {
        let why = "Generic S3 error: Client error with status 404 Not Found: <?xml version=\"1.0\"?>\
                   <Error><Code>NoSuchBucket</Code><Message>The specified bucket does not exist</Message></Error>";
        assert!(says_no_bucket(why));
        assert!(!says_no_bucket("<Code>NoSuchKey</Code>"));
        assert_eq!(bucket_of("s3://snaps/agent"), "snaps");
    }

    #[test]
    fn refusals_are_whole_words_not_digits_of_a_chunk_name() {
        let refused = "Generic S3 error: Error after 3 retries in 1.2s, max_retries:10, \
            retry_timeout:180s, source:error sending request for url \
            (http://127.0.0.1:1/snaps/x/chunks/9f4033a1b401e2): connection refused";
        assert!(!says_denied(refused));
        assert!(says_denied("Client error with status 403 Forbidden: <Code>AccessDenied</Code>"));
        assert!(says_denied("<Code>InvalidAccessKeyId</Code>"));
        assert!(says_denied("status: 401"));
    }
}
