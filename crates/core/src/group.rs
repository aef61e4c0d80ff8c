//! Groups: several processes (a server and its engine cores, one process per
//! GPU) suspended, resumed or stopped together, in parallel, all or nothing.
//!
//! The driver's calls on different processes are independent, so a group
//! takes about as long as its slowest member. If one member fails, the
//! members already done are returned to their prior state and the error
//! names the member and why.

use crate::engine::{
    Engine, ParkReport, Prep, ResumeOptions, ResumeReport, StopOptions, StopReport, SuspendReport,
};
use crate::error::Error;
use crate::progress::Progress;
use gpusnap_cuda::CheckpointApi;
use gpusnap_gpu::GpuInventory;
use std::collections::BTreeMap;
use std::time::Duration;

/// An error a group's member can end with: the lifecycle's own, or that
/// of a crate above that runs groups on the same engine.
pub trait GroupError: From<Error> + std::fmt::Display {
    /// `e`, as the error of member `pid` of a group.
    fn member(pid: i32, e: Self) -> Self;
}

impl GroupError for Error {
    fn member(pid: i32, e: Self) -> Self {
        Error::Member { pid, source: Box::new(e) }
    }
}

/// Makes one progress display per member.
pub type ProgressFactory<'a> = &'a (dyn Fn() -> Box<dyn Progress> + Sync);

impl<A: CheckpointApi, G: GpuInventory> Engine<A, G> {
    /// Suspends every CUDA process of a tree, in parallel (a group: all or
    /// none); returns the ones this call suspended.
    pub fn suspend_all(&mut self, pids: &[i32], lock_timeout_ms: u32) -> Result<Vec<i32>, Error> {
        if pids.is_empty() {
            return Ok(Vec::new());
        }
        // Each member's checkpoint shows beside the others'.
        let proto = self.progress().sibling();
        let reports =
            self.suspend_group(pids, lock_timeout_ms, &|| proto.sibling()).map_err(|e| match e {
                Error::Member { .. } => e,
                other => Error::Member { pid: pids[0], source: Box::new(other) },
            })?;
        Ok(reports.iter().filter(|r| !r.already).map(|r| r.pid).collect())
    }

    /// Puts processes this operation suspended back on the GPU. Their memory
    /// was freed moments ago; admission still guards the race.
    pub fn resume_after_failure(&mut self, pids: &[i32]) -> Option<Error> {
        let opts = ResumeOptions { wait: Duration::from_secs(30), ..Default::default() };
        let mut first = None;
        for &pid in pids.iter().rev() {
            if let Err(e) = self.resume(pid, &opts) {
                tracing::error!(pid, "could not resume: {e}");
                first.get_or_insert(Error::Member { pid, source: Box::new(e) });
            }
        }
        first
    }

    /// Runs `f` for every item on its own engine (thread), in parallel.
    pub fn in_parallel<I: Send, T: Send, E: GroupError + Send>(
        &self,
        items: Vec<(i32, I)>,
        progress: ProgressFactory<'_>,
        f: impl Fn(&mut Self, I) -> Result<T, E> + Sync,
    ) -> Vec<(i32, Result<T, E>)> {
        let f = &f;
        std::thread::scope(|s| {
            let handles: Vec<_> = items
                .into_iter()
                .map(|(pid, item)| {
                    let fork = self.fork(progress());
                    (pid, s.spawn(move || fork.map_err(E::from).and_then(|mut e| f(&mut e, item))))
                })
                .collect();
            handles
                .into_iter()
                .map(|(pid, h)| {
                    let r = h.join().unwrap_or_else(|_| {
                        Err(E::from(Error::Proc {
                            pid,
                            reason: "the worker thread for this process panicked".into(),
                        }))
                    });
                    (pid, r)
                })
                .collect()
        })
    }

    /// The first failure, as the group's error, after `undo` put back what
    /// the others did.
    pub fn fail_group<T, E: GroupError>(
        results: Vec<(i32, Result<T, E>)>,
        undo: impl FnOnce(Vec<(i32, T)>),
    ) -> Result<Vec<T>, E> {
        let mut done = Vec::new();
        let mut failed = None;
        for (pid, r) in results {
            match r {
                Ok(t) => done.push((pid, t)),
                Err(e) if failed.is_none() => failed = Some(E::member(pid, e)),
                Err(e) => tracing::error!(pid, "also failed: {e}"),
            }
        }
        match failed {
            None => Ok(done.into_iter().map(|(_, t)| t).collect()),
            Some(e) => {
                undo(done);
                Err(e)
            }
        }
    }

    pub fn suspend_group(
        &mut self,
        pids: &[i32],
        lock_timeout_ms: u32,
        progress: ProgressFactory<'_>,
    ) -> Result<Vec<SuspendReport>, Error> {
        self.suspend_group_with(pids, lock_timeout_ms, true, progress)
    }

    /// [`Self::suspend_group`]; `offload` false before the group is ended
    /// (see [`Engine::suspend_to_end`]).
    fn suspend_group_with(
        &mut self,
        pids: &[i32],
        lock_timeout_ms: u32,
        offload: bool,
        progress: ProgressFactory<'_>,
    ) -> Result<Vec<SuspendReport>, Error> {
        let one = |e: &mut Self, pid| {
            if offload {
                e.suspend(pid, lock_timeout_ms)
            } else {
                e.suspend_to_end(pid, lock_timeout_ms)
            }
        };
        if pids.len() == 1 {
            return one(self, pids[0]).map(|r| vec![r]);
        }
        let results = self.in_parallel(pids.iter().map(|&p| (p, p)).collect(), progress, one);
        Self::fail_group(results, |done| {
            let undo: Vec<(i32, i32)> =
                done.iter().filter(|(_, r)| !r.already).map(|(p, _)| (*p, *p)).collect();
            let opts = ResumeOptions { wait: Duration::from_secs(30), ..Default::default() };
            for (pid, r) in self.in_parallel(undo, progress, |e, pid| e.resume(pid, &opts)) {
                if let Err(e) = r {
                    tracing::error!(pid, "could not resume after the group failed: {e}");
                }
            }
        })
    }

    /// Parks several processes (a tree, a cgroup), in parallel, all or
    /// none: a member that cannot be parked has the others unparked.
    pub fn park_group(
        &mut self,
        pids: &[i32],
        progress: ProgressFactory<'_>,
    ) -> Result<Vec<ParkReport>, Error> {
        if pids.len() == 1 {
            return self.park(pids[0]).map(|r| vec![r]);
        }
        let results =
            self.in_parallel(pids.iter().map(|&p| (p, p)).collect(), progress, |e, pid| e.park(pid));
        Self::fail_group(results, |done| {
            let undo: Vec<(i32, i32)> =
                done.iter().filter(|(_, r)| !r.already).map(|(p, _)| (*p, *p)).collect();
            let opts = ResumeOptions { wait: Duration::from_secs(30), ..Default::default() };
            for (pid, r) in self.in_parallel(undo, progress, |e, pid| e.resume(pid, &opts)) {
                if let Err(e) = r {
                    tracing::error!(pid, "could not unpark after the group failed: {e}");
                }
            }
        })
    }

    pub fn resume_group(
        &mut self,
        pids: &[i32],
        opts: &ResumeOptions,
        progress: ProgressFactory<'_>,
    ) -> Result<Vec<ResumeReport>, Error> {
        if pids.len() == 1 {
            return self.resume(pids[0], opts).map(|r| vec![r]);
        }
        // Everything that can refuse without touching the driver, first.
        let mut done = Vec::new();
        let mut go = Vec::new();
        for &pid in pids {
            match self.prepare_resume(pid, opts).map_err(|e| Error::Member { pid, source: Box::new(e) })? {
                Prep::Done(r) => done.push(r),
                Prep::Go(p) => go.push(p),
            }
        }
        if go.is_empty() {
            return Ok(done);
        }
        // Admission counts the whole group at once.
        let mut need: BTreeMap<String, u64> = BTreeMap::new();
        for p in &go {
            for (u, b) in &p.need {
                *need.entry(u.clone()).or_insert(0) += b;
            }
        }
        let first = go[0].t.clone();
        let (reservation, waited_ms) =
            self.admit_waiting(first.pid, Some(&first), &need, opts.margin_bytes, opts.wait)?;
        let items: Vec<(i32, _)> = go.into_iter().map(|p| (p.t.pid, p)).collect();
        let results = self.in_parallel(items, progress, |e, p| e.finish_resume(p, waited_ms));
        self.store_mut().release(&reservation)?;
        let mut out = Self::fail_group(results, |resumed| {
            let redo: Vec<(i32, i32)> = resumed.iter().map(|(p, _)| (*p, *p)).collect();
            for (pid, r) in self.in_parallel(redo, progress, |e, pid| e.suspend(pid, 30_000)) {
                if let Err(e) = r {
                    tracing::error!(pid, "could not suspend again after the group failed: {e}");
                }
            }
        })?;
        done.append(&mut out);
        Ok(done)
    }

    /// Suspends every running member first (all or none, unless forced),
    /// then ends them all.
    pub fn stop_group(
        &mut self,
        pids: &[i32],
        opts: &StopOptions,
        progress: ProgressFactory<'_>,
    ) -> Result<Vec<StopReport>, Error> {
        if pids.len() == 1 {
            return self.stop(pids[0], opts).map(|r| vec![r]);
        }
        let started = std::time::Instant::now();
        if !opts.force {
            let cuda: Vec<i32> = pids
                .iter()
                .copied()
                .filter(|&p| {
                    crate::target::resolve_callable(p).is_ok_and(|t| {
                        matches!(
                            self.driver_state(&t),
                            Ok(gpusnap_cuda::ProcessState::Running | gpusnap_cuda::ProcessState::Locked)
                        )
                    })
                })
                .collect();
            if !cuda.is_empty() {
                self.suspend_group_with(&cuda, opts.lock_timeout_ms, false, progress).map_err(
                    |e| match e {
                        Error::Member { pid, source } => Error::StopRefused {
                            pid,
                            reason: format!("suspend failed ({source}); no member of the group was stopped"),
                        },
                        other => other,
                    },
                )?;
            }
        }
        let results =
            self.in_parallel(pids.iter().map(|&p| (p, p)).collect(), progress, |e, pid| e.stop(pid, opts));
        // Nothing to put back: the others are ended either way.
        let mut done = Self::fail_group(results, |_| {})?;
        // Each member's time is the group's: its suspend came first.
        let total_ms = started.elapsed().as_millis() as u64;
        for r in &mut done {
            r.total_ms = total_ms;
        }
        Ok(done)
    }
}
