//! hibernate, wake and recover: whole process trees to an image and back.
//!
//! The order is chosen so that nothing is lost at any step:
//! 1. every CUDA process of the tree is suspended (all or none);
//! 2. CRIU dumps the tree into a temporary directory and leaves it stopped
//!    (SIGSTOP: it cannot make the image stale, and can still go on);
//! 3. the image is checksummed, its manifest written, and renamed into place;
//! 4. only then is the tree ended (its CUDA state is already off the GPU,
//!    so the kill is safe). With `leave_running` the tree runs on throughout
//!    and its CUDA processes are resumed as they were.
//!
//! A failure at 1-3 resumes what was suspended and removes the partial image.

use crate::criu::Criu;
use crate::dump::{Dump, Dumped};
use crate::ms;
use crate::options::{HibernateOptions, HibernateReport, Stages, WakeOptions, WakeReport};
use crate::reconcile::{reconcile, Interrupted};
use crate::tree::{kill_tree, wait_pid_free};
use crate::unwind::Unwind;
use crate::wake::Wake;
use crate::Error;
use gpusnap_core::engine::Engine;
use gpusnap_core::target::{self, Target};
use gpusnap_core::Error as CoreError;
use gpusnap_cuda::CheckpointApi;
use gpusnap_gpu::GpuInventory;
use gpusnap_images::image::ImageStore;
use gpusnap_images::manifest::ProcDesc;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// An error of one image of a group wake, named by the image (alone, the
/// error itself).
fn member(names: &[String], name: &str, e: Error) -> Error {
    if names.len() <= 1 {
        return e;
    }
    Error::GroupImage { image: name.to_string(), source: Box::new(e) }
}

/// Hibernate, wake and recover, on the lifecycle engine: whole process
/// trees to an image and back.
pub trait Hibernate {
    /// Hibernates the tree rooted at `root` (or, with `leave_running`,
    /// snapshots it): every CUDA process suspended (all or none), the tree
    /// dumped by CRIU, the image checksummed and renamed into place, and only
    /// then the tree ended. A failure at any step puts everything back.
    fn hibernate(
        &mut self,
        criu: &Criu,
        images: &ImageStore,
        root: i32,
        opts: &HibernateOptions,
    ) -> Result<HibernateReport, Error>;

    /// Hibernates several trees (a group: the roots of the processes of a
    /// cgroup, say), one image each (`NAME-ROOT` when a name is given), all
    /// or nothing: every tree is dumped and its image written before any
    /// tree is ended; if one fails, the others are put back as they were
    /// and their images removed.
    fn hibernate_group(
        &mut self,
        criu: &Criu,
        images: &ImageStore,
        roots: &[i32],
        opts: &HibernateOptions,
    ) -> Result<Vec<HibernateReport>, Error>;

    fn wake(
        &mut self,
        criu: &Criu,
        images: &ImageStore,
        name: &str,
        opts: &WakeOptions,
    ) -> Result<WakeReport, Error>;

    /// Wakes several images (the trees of a hibernated group), all or
    /// nothing: every image is verified and checked against this host, and
    /// their processes admitted together, before any is restored; if one
    /// fails, the trees already woken are ended safely (suspended first) and
    /// every image stays as it was, for a retry.
    fn wake_group(
        &mut self,
        criu: &Criu,
        images: &ImageStore,
        names: &[String],
        opts: &WakeOptions,
    ) -> Result<Vec<WakeReport>, Error>;

    /// A process stuck after a failed restore, brought back from its newest
    /// image: the stuck tree is ended (it holds no GPU memory) and woken.
    fn recover(
        &mut self,
        criu: &Criu,
        images: &ImageStore,
        pid: i32,
        opts: &WakeOptions,
    ) -> Result<WakeReport, Error>;

    /// Reconciles hibernates that a gpusnap killed mid-way left open: if
    /// their image was committed (signed and complete), the hibernate is
    /// finished (the tree, stopped by CRIU and off the GPU, is ended);
    /// otherwise the tree is continued and the CUDA processes it suspended
    /// are resumed. Only processes still the ones journaled (pid and start
    /// time) are touched. Temporary images are removed by [`ImageStore::gc`].
    fn reconcile_hibernates(&mut self, images: &ImageStore) -> Result<Vec<Interrupted>, Error>;
}

impl<A: CheckpointApi, G: GpuInventory> Hibernate for Engine<A, G> {
    fn hibernate(
        &mut self,
        criu: &Criu,
        images: &ImageStore,
        root: i32,
        opts: &HibernateOptions,
    ) -> Result<HibernateReport, Error> {
        let d = self.dump_tree(criu, images, root, opts)?;
        let mut r = self.finish_hibernate(d, opts)?;
        if opts.map {
            self.map_after(images, &mut r);
        }
        Ok(r)
    }

    fn hibernate_group(
        &mut self,
        criu: &Criu,
        images: &ImageStore,
        roots: &[i32],
        opts: &HibernateOptions,
    ) -> Result<Vec<HibernateReport>, Error> {
        if roots.len() == 1 {
            return self.hibernate(criu, images, roots[0], opts).map(|r| vec![r]);
        }
        let mut dumped: Vec<Dumped> = Vec::new();
        for &root in roots {
            let o =
                HibernateOptions { name: opts.name.as_ref().map(|n| format!("{n}-{root}")), ..opts.clone() };
            match self.dump_tree(criu, images, root, &o) {
                Ok(d) => dumped.push(d),
                Err(e) => {
                    for d in dumped.into_iter().rev() {
                        self.abandon_hibernate(d, images, opts);
                    }
                    return Err(Error::Member { pid: root, source: Box::new(e) });
                }
            }
        }
        // Every image is safe by now: a failure here is one tree's, with
        // nothing to put back.
        let results: Vec<_> =
            dumped.into_iter().map(|d| (d.report.root_pid, self.finish_hibernate(d, opts))).collect();
        let mut reports = Self::fail_group(results, |_| {})?;
        if opts.map {
            for r in &mut reports {
                self.map_after(images, r);
            }
        }
        Ok(reports)
    }

    fn wake(
        &mut self,
        criu: &Criu,
        images: &ImageStore,
        name: &str,
        opts: &WakeOptions,
    ) -> Result<WakeReport, Error> {
        let names = [name.to_string()];
        let mut r = self.wake_group(criu, images, &names, opts)?;
        Ok(r.remove(0))
    }

    fn wake_group(
        &mut self,
        criu: &Criu,
        images: &ImageStore,
        names: &[String],
        opts: &WakeOptions,
    ) -> Result<Vec<WakeReport>, Error> {
        let mut plans = Vec::new();
        for name in names {
            let plan =
                self.plan_wake(images, name, opts, names.len() > 1).map_err(|e| member(names, name, e))?;
            // An image from another host may come from a newer CRIU, whose
            // image files an older one may misread.
            if crate::criu::newer_version(&plan.m.criu_version, &criu.version) {
                let e = Error::Incompatible {
                    image: plan.m.name.clone(),
                    why: format!(
                        "it was dumped by CRIU {}, this host's CRIU {} is older (install CRIU {} or newer: scripts/install-criu.sh)",
                        plan.m.criu_version, criu.version, plan.m.criu_version
                    ),
                };
                return Err(member(names, name, e));
            }
            plans.push(plan);
        }
        // The images' pids must be free: a dying old process may still hold one.
        let t_wait = Instant::now();
        for plan in &plans {
            for p in &plan.m.processes {
                wait_pid_free(p, opts.wait.max(Duration::from_secs(10)))
                    .map_err(|e| member(names, &plan.name, e))?;
            }
        }
        let mut need: BTreeMap<String, u64> = BTreeMap::new();
        for plan in &plans {
            for fp in &plan.fps {
                for (u, b) in fp {
                    let e = need.entry(u.clone()).or_insert(0u64);
                    *e = e.saturating_add(*b);
                }
            }
        }
        let reservation = if need.is_empty() {
            Vec::new()
        } else {
            // The images' processes do not exist yet: nothing to journal on.
            let left = opts.wait.saturating_sub(t_wait.elapsed());
            let first = plans[0].m.root_pid;
            self.admit_waiting(first, None, &need, opts.margin_bytes, left)?.0
        };
        let waited_ms = ms(t_wait);

        let mut out: Vec<WakeReport> = Vec::new();
        let mut failed = None;
        for plan in &plans {
            let resume: Vec<&ProcDesc> = plan.resume.iter().collect();
            match self.wake_admitted(criu, images.state_dir(), plan, &resume, opts.eager) {
                Ok(w) => out.push(WakeReport {
                    image: plan.name.clone(),
                    root_pid: w.root,
                    processes: plan.m.processes.iter().map(|p| p.pid).collect(),
                    resumed: plan.resume.iter().map(|p| p.pid).collect(),
                    // The verify on the wake's critical path: before the
                    // restore, and the driver's wait for its background part.
                    verify_ms: plan.verify_ms + w.verify.wait_ms,
                    waited_ms,
                    criu_ms: w.criu_ms,
                    restore_ms: w.driver_ms,
                    total_ms: ms(plan.started),
                    lazy: w.lazy,
                    pages_bytes: w.pages_bytes,
                    mapped_bytes: w.mapped.bytes,
                    file_pages_bytes: w.file_pages_bytes,
                    notice: w.notice,
                    stages: Stages {
                        verify: plan.verify_ms,
                        waited: waited_ms,
                        criu: w.criu_ms,
                        head_start: w.head_ms,
                        driver: w.driver_ms,
                        pages: w.pages_ms,
                        verify_background: w.verify.verify_ms,
                        verify_wait: w.verify.wait_ms,
                        check: plan.check_ms,
                        journal: w.journal_ms,
                        driver_start: w.driver_start_ms,
                        finish: w.finish_ms,
                        map_check: w.mapped.check_ms,
                        map_hash: w.mapped.hash_ms,
                    },
                    pages: w.report,
                }),
                Err(e) => {
                    failed = Some(member(names, &plan.name, e));
                    break;
                }
            }
        }
        // Best effort: a reservation of a gpusnap that exits is void anyway,
        // and a store error must not skip the undo below.
        if let Err(e) = self.store_mut().release(&reservation) {
            tracing::warn!("could not release the reservation: {e}");
        }
        if let Some(err) = failed {
            // The images are untouched; the trees woken before are ended so
            // that the whole group can be woken again.
            self.end_woken(out.iter().rev().flat_map(|r| r.processes.iter().rev().copied()));
            return Err(err);
        }
        Ok(out)
    }

    fn recover(
        &mut self,
        criu: &Criu,
        images: &ImageStore,
        pid: i32,
        opts: &WakeOptions,
    ) -> Result<WakeReport, Error> {
        let t = target::resolve(pid)?;
        let stuck = self.store().get(&t)?.is_some_and(|r| r.unrecoverable.is_some());
        if !stuck && !opts.force {
            return Err(CoreError::WrongState {
                pid,
                state:
                    "not stuck (use `gpusnap resume`; `recover --force` rolls it back to its image anyway)"
                        .into(),
                op: "recover",
            }
            .into());
        }
        // Only a signed image of the store, by its directory's name: a
        // manifest's own claims (its name, its processes) count only once
        // its signature says gpusnap wrote it.
        let Some((image, m)) = images.find_for(pid, t.start_time) else {
            return Err(CoreError::Unrecoverable {
                pid,
                reason: "no image of it exists (take one with `gpusnap snapshot` while it is suspended)"
                    .into(),
            }
            .into());
        };
        // Everything of that tree still alive must go, and none of it may hold GPU memory.
        let alive: Vec<Target> = m
            .processes
            .iter()
            .filter_map(|p| target::resolve(p.pid).ok().filter(|t| t.start_time == p.start_time))
            .collect();
        for a in &alive {
            if self.gpus().usage_of(a.pid as u32)?.iter().any(|u| u.bytes.unwrap_or(1) > 0) {
                return Err(CoreError::StopRefused {
                    pid: a.pid,
                    reason: "it still holds GPU memory, so it is not stuck: use `gpusnap resume`".into(),
                }
                .into());
            }
        }
        for a in &alive {
            self.store_mut().note(a, "recover", Some("stopped"), &format!("ended to wake image {image}"))?;
        }
        kill_tree(&alive)?;
        let mut o = opts.clone();
        o.force_resume.push(pid);
        self.wake(criu, images, &image, &o)
    }

    fn reconcile_hibernates(&mut self, images: &ImageStore) -> Result<Vec<Interrupted>, Error> {
        reconcile(self, images)
    }
}
