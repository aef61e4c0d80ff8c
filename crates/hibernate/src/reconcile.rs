//! Hibernates a gpusnap killed mid-way left open, as its journal says:
//! listed (for `doctor`) and reconciled.

use crate::tree::{continue_tree, kill_tree};
use crate::Error;
use gpusnap_core::engine::{Engine, ResumeOptions};
use gpusnap_core::target::{self, Target};
use gpusnap_core::tree::process_tree;
use gpusnap_core::Error as CoreError;
use gpusnap_cuda::{CheckpointApi, ProcessState};
use gpusnap_gpu::GpuInventory;
use gpusnap_images::image::ImageStore;
use serde::Serialize;
use std::time::{Duration, Instant};

/// A hibernate that a gpusnap killed mid-way left behind, as its journal
/// says (for `doctor`, and what [`Engine::reconcile_hibernates`] did).
#[derive(Debug, Clone, Serialize)]
pub struct Interrupted {
    pub image: String,
    pub pids: Vec<i32>,
    /// finished (the image was complete: the stopped tree was ended),
    /// resumed (the tree was continued and its CUDA processes resumed), or
    /// pending (not reconciled yet).
    pub outcome: String,
}

/// The fields of a hibernate journal entry's detail.
fn detail_field<'a>(detail: &'a str, key: &str) -> Option<&'a str> {
    detail.split(' ').find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
}

/// Hibernates begun by a gpusnap that is gone and never finished, by image.
pub fn interrupted_hibernates(store: &gpusnap_core::Store) -> Result<Vec<Interrupted>, Error> {
    let mut out: Vec<Interrupted> = Vec::new();
    for (_, t, detail) in store.open_entries("hibernate")? {
        let image = detail_field(&detail, "image").unwrap_or("?").to_string();
        match out.iter_mut().find(|i| i.image == image) {
            Some(i) => i.pids.push(t.pid),
            None => out.push(Interrupted { image, pids: vec![t.pid], outcome: "pending".into() }),
        }
    }
    Ok(out)
}

/// What [`crate::Hibernate::reconcile_hibernates`] does.
pub(crate) fn reconcile<A: CheckpointApi, G: GpuInventory>(
    engine: &mut Engine<A, G>,
    images: &ImageStore,
) -> Result<Vec<Interrupted>, Error> {
    let open = engine.store().open_entries("hibernate")?;
    type Entries = Vec<(i64, Target, String)>;
    let mut by_image: Vec<(String, Entries)> = Vec::new();
    for e in open {
        let image = detail_field(&e.2, "image").unwrap_or("?").to_string();
        match by_image.iter_mut().find(|(i, _)| *i == image) {
            Some((_, v)) => v.push(e),
            None => by_image.push((image, vec![e])),
        }
    }
    let mut out = Vec::new();
    for (image, entries) in by_image {
        let alive: Entries = entries
            .iter()
            .filter(|(_, t, _)| target::resolve(t.pid).is_ok_and(|now| now.start_time == t.start_time))
            .cloned()
            .collect();
        let stopping = entries.iter().any(|(_, _, d)| detail_field(d, "stop") == Some("1"));
        // Complete: committed, signed, and holding these very processes
        // (an image of the same name taken since is not this one).
        let complete = if gpusnap_images::manifest::valid_name(&image) {
            images.manifest(&image).ok().map(|(_, m)| m).filter(|m| {
                entries.iter().all(|(_, t, _)| {
                    m.processes.iter().any(|p| p.pid == t.pid && p.start_time == t.start_time)
                })
            })
        } else {
            None
        };
        let finish = stopping && complete.is_some();
        tracing::warn!(image, finish, "reconciling a hibernate interrupted by a gpusnap that died");
        if let (true, Some(m)) = (finish, &complete) {
            // Every process of the tree (children born during the dump
            // too) is in the image, which is safe: end those still the
            // ones it holds.
            let ts: Vec<Target> = m
                .processes
                .iter()
                .filter_map(|p| target::resolve(p.pid).ok().filter(|t| t.start_time == p.start_time))
                .collect();
            kill_tree(&ts)?;
        } else {
            // CRIU stopped the whole tree, children born during the dump
            // (not journaled) included.
            let mut ts: Vec<Target> = Vec::new();
            for (_, t, _) in &alive {
                for (p, _) in process_tree(t.pid) {
                    if let Ok(k) = target::resolve(p) {
                        if !ts.iter().any(|x| x.pid == k.pid) {
                            ts.push(k);
                        }
                    }
                }
            }
            continue_tree(&ts);
            for (_, t, d) in &alive {
                if detail_field(d, "resume") != Some("1") {
                    continue;
                }
                // SIGCONT is seen at once by the kernel, but wait for it:
                // the driver hangs on a stopped process.
                let end = Instant::now() + Duration::from_secs(10);
                while target::resolve_callable(t.pid).is_err_and(|e| matches!(e, CoreError::Stopped { .. }))
                    && Instant::now() < end
                {
                    std::thread::sleep(Duration::from_millis(20));
                }
                let state = target::resolve_callable(t.pid).and_then(|t| engine.driver_state(&t));
                if matches!(state, Ok(ProcessState::Checkpointed | ProcessState::Locked)) {
                    let opts = ResumeOptions { wait: Duration::from_secs(30), ..Default::default() };
                    if let Err(e) = engine.resume(t.pid, &opts) {
                        tracing::error!(pid = t.pid, "could not resume after an interrupted hibernate: {e}");
                    }
                }
            }
        }
        let outcome = if finish { "finished" } else { "resumed" };
        for (id, t, _) in &entries {
            engine.store_mut().close(*id, t, "hibernate", finish, &format!("reconciled: {outcome}"))?;
        }
        out.push(Interrupted {
            image,
            pids: entries.iter().map(|(_, t, _)| t.pid).collect(),
            outcome: outcome.into(),
        });
    }
    Ok(out)
}
