//! `images ...`: the image store (list, verify, remove, map, import, gc)
//! and its remotes (push, pull), and this host's signing key.

use crate::cli::{Cli, ImagesCmd};
use crate::output::{self, Out};
use crate::setup::{engine_with, images, own_images, Load};
use gpusnap_hibernate::{Error, Hibernate};
use gpusnap_images::image::ImageStore;

pub fn run(cli: &Cli, out: &Out, cmd: Option<&ImagesCmd>) -> anyhow::Result<()> {
    let store = images(cli)?;
    match cmd.unwrap_or(&ImagesCmd::List) {
        ImagesCmd::List => {
            let list = store.list();
            let maps: Vec<Option<u64>> = list
                .iter()
                .map(|r| {
                    r.as_ref().ok().and_then(|(n, m)| gpusnap_images::mapfile::present(&cli.state_dir, n, m))
                })
                .collect();
            out.images(&list, &maps)
        }
        ImagesCmd::Verify { image } => {
            let (_, m) = store.verify(image, |_| {}).map_err(Error::from)?;
            out.one(
                &m,
                &format!(
                    "{}: ok, {} files, {} bytes, signed by {}",
                    output::printable(image),
                    m.files.len(),
                    m.total_bytes(),
                    m.signer
                ),
            );
        }
        ImagesCmd::Rm { image, force } => {
            // The agent's services that are hibernated to an image wake from it.
            let users = gpusnap_agent::service::load_persisted(&cli.state_dir);
            if let Some((user, _)) = users.iter().find(|(_, p)| p.image.as_deref() == Some(image.as_str())) {
                if !force {
                    let e = gpusnap_images::manifest::ImageError::InUse {
                        name: image.clone(),
                        user: format!("the agent's service {user}"),
                    };
                    return Err(Error::from(gpusnap_images::Error::from(e)).into());
                }
            }
            store.remove(image).map_err(Error::from)?;
            gpusnap_images::mapfile::remove(&cli.state_dir, image);
            out.one(
                &serde_json::json!({ "removed": image }),
                &format!("removed {}", output::printable(image)),
            );
        }
        ImagesCmd::Map { image } => {
            let (dir, m) = store
                .verify_with(image, gpusnap_images::manifest::ChunkCheck::Present, |_| {})
                .map_err(Error::from)?;
            let progress = out.progress();
            match gpusnap_images::mapfile::build(&cli.state_dir, image, &dir, &m, progress.as_ref())
                .map_err(Error::from)?
            {
                Some(b) => out.one(
                    &b,
                    &format!(
                        "{}: map file {} ({} bytes of pages in {} regions, {} ms)",
                        output::printable(image),
                        b.path,
                        b.bytes,
                        b.regions,
                        b.ms
                    ),
                ),
                None => out.one(
                    &serde_json::json!({ "image": image, "regions": 0 }),
                    &format!(
                        "{}: no region to map (no large memory of a CUDA process)",
                        output::printable(image)
                    ),
                ),
            }
        }
        ImagesCmd::Import { path } => {
            let (name, dir, m) = store.import(path, |_| {}).map_err(Error::from)?;
            out.one(
                &serde_json::json!({ "imported": name, "path": dir, "bytes": m.total_bytes() }),
                &format!("imported {name} ({} bytes)", m.total_bytes()),
            );
        }
        ImagesCmd::Gc => {
            let reconciled = match engine_with(cli, out, Load::Lenient) {
                Ok(mut e) => e.reconcile_hibernates(&own_images(cli)?)?,
                Err(err) => return Err(err),
            };
            let mut removed = store.gc();
            removed.extend(gpusnap_images::mapfile::gc(&cli.state_dir, &store.names()));
            let p = out.progress();
            let chunks_gc = {
                let done = std::sync::atomic::AtomicU64::new(0);
                p.begin("gc", 0);
                let r = gpusnap_images::remote::gc(&store, &|n| {
                    p.update(done.fetch_add(n, std::sync::atomic::Ordering::Relaxed) + n)
                });
                p.end();
                r?
            };
            for i in &reconciled {
                out.line(&format!(
                    "interrupted hibernate to {}: {} {:?}",
                    output::printable(&i.image),
                    i.outcome,
                    i.pids
                ));
            }
            for r in &removed {
                out.line(&format!("removed {} ({} bytes)", r.path.display(), r.bytes));
            }
            out.one(
                &serde_json::json!({ "reconciled": reconciled, "removed": removed, "chunks": chunks_gc }),
                &format!(
                    "{} reconciled, {} removed; chunks: {} removed ({} bytes freed), {} kept ({} bytes)",
                    reconciled.len(),
                    removed.len(),
                    chunks_gc.chunks_removed,
                    chunks_gc.bytes_freed,
                    chunks_gc.chunks_kept,
                    chunks_gc.bytes_kept
                ),
            );
        }
        ImagesCmd::Push { image, url, index_ttl } => {
            let p = out.progress();
            let done = std::sync::atomic::AtomicU64::new(0);
            if let Ok((_, m)) = store.manifest(image) {
                p.begin("push", m.total_bytes());
            }
            let ttl = std::time::Duration::from_secs(index_ttl * 24 * 3600);
            let r = gpusnap_images::remote::push_with(&store, image, url, ttl, &|n| {
                p.update(done.fetch_add(n, std::sync::atomic::Ordering::Relaxed) + n)
            });
            p.end();
            let r = r?;
            out.one(
                &r,
                &format!(
                    "pushed {} to {}: {} bytes, {} sent ({} chunks), {} deduplicated, {:.1}s",
                    output::printable(image),
                    r.remote,
                    r.bytes_total,
                    r.bytes_sent,
                    r.chunks_sent,
                    r.bytes_deduplicated,
                    r.seconds
                ),
            );
        }
        ImagesCmd::Pull { url, as_name, allow_rollback } => {
            let (name, r) = pull(out, &store, url, as_name.as_deref(), *allow_rollback)?;
            out.one(
                &serde_json::json!({ "name": name, "result": r }),
                &format!(
                    "pulled {} as {name}: {} bytes, {} received ({} chunks), {} deduplicated, {:.1}s",
                    output::printable(url),
                    r.bytes_total,
                    r.bytes_sent,
                    r.chunks_sent,
                    r.bytes_deduplicated,
                    r.seconds
                ),
            );
        }
        ImagesCmd::Key => {
            let k = gpusnap_images::sign::HostKey::load_or_create(&cli.state_dir)?;
            out.one(&serde_json::json!({ "key": k.public_hex() }), &k.public_hex());
        }
    }
    Ok(())
}

/// Pulls `url` (URL/NAME) into the store, with a progress bar on a terminal.
fn pull(
    out: &Out,
    store: &ImageStore,
    url: &str,
    as_name: Option<&str>,
    allow_rollback: bool,
) -> Result<(String, gpusnap_chunks::TransferReport), Error> {
    let p = out.progress();
    let done = std::sync::atomic::AtomicU64::new(0);
    let r =
        gpusnap_images::remote::pull(store, url, as_name, allow_rollback, &|t| p.begin("pull", t), &|n| {
            p.update(done.fetch_add(n, std::sync::atomic::Ordering::Relaxed) + n)
        });
    p.end();
    Ok(r?)
}
