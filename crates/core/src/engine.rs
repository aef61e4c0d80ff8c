//! The lifecycle: suspend, resume (with admission), stop, state and ps.
//!
//! Every driver call is journaled before and after (see [`Store`]), preceded
//! by a fresh check of the target's identity and run state, and runs under a
//! deadline. Each operation either completes or returns the process to the
//! state it found it in; the one exception the driver forces on us (a restore
//! that ran out of memory strands the process) is recorded as unrecoverable.

use crate::error::Error;
use crate::progress::{observe, Progress, Quiet};
use crate::store::{Record, Store};
use crate::target::{self, Target};
use gpusnap_cuda::ffi::{CUDA_ERROR_NOT_INITIALIZED, CUDA_ERROR_OPERATING_SYSTEM, CUDA_ERROR_OUT_OF_MEMORY};
use gpusnap_cuda::{CheckpointApi, Deadline, DriverError, GpuPair, ProcessState};
use gpusnap_gpu::GpuInventory;
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

mod fastswap;
mod park;
mod records;
mod stop;

const MIB: u64 = 1 << 20;

/// How long NVML may take to show a checkpointed process's memory as freed.
const RELEASE_WAIT: Duration = Duration::from_secs(10);
/// NVML reads while waiting for a release: every RELEASE_FAST_TICK for
/// RELEASE_FAST_FOR, then every RELEASE_SLOW_TICK.
const RELEASE_FAST_TICK: Duration = Duration::from_millis(5);
const RELEASE_FAST_FOR: Duration = Duration::from_secs(1);
const RELEASE_SLOW_TICK: Duration = Duration::from_millis(100);
pub use crate::reports::{
    GpuBytes, ParkReport, ParkedBytes, ResumeOptions, ResumeReport, StateReport, StopOptions, StopReport,
    SuspendReport,
};

pub struct Engine<A: CheckpointApi, G: GpuInventory> {
    api: Deadline<A>,
    gpus: std::sync::Arc<G>,
    store: Store,
    progress: Box<dyn Progress>,
}

fn ms(since: Instant) -> u64 {
    since.elapsed().as_millis() as u64
}

impl<A: CheckpointApi, G: GpuInventory> Engine<A, G> {
    pub fn new(api: Deadline<A>, gpus: G, store: Store) -> Self {
        Self { api, gpus: std::sync::Arc::new(gpus), store, progress: Box::new(Quiet) }
    }

    /// Another engine on the same driver, NVML and state directory (its own
    /// database connection), for work on several processes at once.
    pub fn fork(&self, progress: Box<dyn Progress>) -> Result<Self, Error> {
        Ok(Self {
            api: self.api.clone(),
            gpus: std::sync::Arc::clone(&self.gpus),
            store: Store::open(self.store.dir())?,
            progress,
        })
    }

    pub fn with_progress(mut self, p: Box<dyn Progress>) -> Self {
        self.progress = p;
        self
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    pub fn gpus(&self) -> &G {
        &self.gpus
    }

    pub fn api_ref(&self) -> &Deadline<A> {
        &self.api
    }

    pub fn store_mut(&mut self) -> &mut Store {
        &mut self.store
    }

    pub fn progress(&self) -> &dyn Progress {
        &*self.progress
    }

    /// The driver's API version; 0 on a host without a driver.
    pub fn api_version(&self) -> i32 {
        self.api.api_version()
    }

    /// Waits for the driver's start-up (`cuInit` runs in the background of
    /// the first steps of a wake) and says whether it could.
    pub fn driver_ready(&self) -> Result<(), gpusnap_cuda::DriverError> {
        self.api.ready()
    }

    /// The driver's state of a process that [`target::resolve_callable`] passed.
    pub fn driver_state(&self, t: &Target) -> Result<ProcessState, Error> {
        match self.api.get_state(t.pid) {
            Ok(s) => Ok(s),
            Err(e) if e.code() == Some(CUDA_ERROR_NOT_INITIALIZED) => {
                Err(Error::NotCuda { pid: t.pid, comm: t.comm.clone() })
            }
            Err(e) => Err(Error::Driver { pid: t.pid, source: e }),
        }
    }

    /// Closes journal entries that a gpusnap which died mid-call left open,
    /// recording what the driver says now.
    fn reconcile(&mut self, t: &Target) -> Result<(), Error> {
        let pending = self.store.pending(t)?;
        if pending.is_empty() {
            return Ok(());
        }
        let now = self.driver_state(t).map(|s| s.to_string()).unwrap_or_else(|e| format!("unknown ({e})"));
        for p in pending {
            tracing::warn!(pid = t.pid, op = %p.op, state = %now, "reconciling an interrupted operation");
            self.store.end(p.id, t, &p.op, Err("interrupted: gpusnap exited during the call"))?;
        }
        let state = ProcessState::parse(&now).map(|s| s.as_str());
        self.store.note(t, "reconcile", state, &format!("driver says {now}"))
    }

    /// One journaled driver call: begin, call, end.
    pub fn journaled<T>(
        &mut self,
        t: &Target,
        op: &str,
        after: &str,
        call: impl FnOnce(&Deadline<A>) -> Result<T, DriverError>,
    ) -> Result<T, Error> {
        let id = self.store.begin(t, op)?;
        let res = call(&self.api);
        let outcome = match &res {
            Ok(_) => Ok(after),
            Err(e) => Err(e.to_string()),
        };
        let outcome_ref = outcome.as_ref().map(|s| *s).map_err(|s| s.as_str());
        if let Err(e) = self.store.end(id, t, op, outcome_ref) {
            tracing::error!("cannot journal the end of {op} on {}: {e}", t.pid);
        }
        res.map_err(|source| Error::Driver { pid: t.pid, source })
    }

    /// Device memory `pid` holds now, per GPU, from NVML.
    fn live_usage(&self, pid: i32) -> Result<BTreeMap<String, u64>, Error> {
        let mut out = BTreeMap::new();
        for u in self.gpus.usage_of(pid as u32)? {
            *out.entry(u.uuid).or_insert(0) += u.bytes.unwrap_or(0);
        }
        Ok(out)
    }

    /// Polls NVML until `pid` holds no device memory: `(released, reads)`.
    /// Fast at first (a swap waits on this, and NVML may report the memory
    /// freed a little after the checkpoint returns: a fixed 100 ms tick cost
    /// up to 100 ms for a lag of 1), slower after RELEASE_FAST_FOR.
    fn wait_released(&self, pid: i32) -> Result<(bool, u32), Error> {
        let t0 = Instant::now();
        let deadline = t0 + RELEASE_WAIT;
        let mut reads = 0u32;
        loop {
            reads += 1;
            if self.live_usage(pid)?.values().all(|b| *b == 0) {
                return Ok((true, reads));
            }
            if Instant::now() >= deadline {
                return Ok((false, reads));
            }
            let tick = if t0.elapsed() < RELEASE_FAST_FOR { RELEASE_FAST_TICK } else { RELEASE_SLOW_TICK };
            std::thread::sleep(tick);
        }
    }

    pub fn state(&mut self, pid: i32) -> Result<StateReport, Error> {
        let t = target::resolve_callable(pid)?;
        self.reconcile(&t)?;
        let st = self.driver_state(&t)?;
        // Read, never moved: a record of a process CRIU restored shows here
        // and moves when a command acts on it.
        let rec = self.record_seen(&t)?;
        self.report(&t, st, rec.as_ref())
    }

    /// [`Self::state`] read only, for a probe: nothing is recorded,
    /// reconciled or adopted, so that it works on a read-only state
    /// directory and changes nothing. A pid whose record says suspended but
    /// belongs to an earlier program, while the driver does not hold this
    /// one suspended (a fresh program, not a restored one), is refused.
    /// A stopped process, or one in a frozen cgroup, is not asked (the
    /// driver would hang): its state is `stopped` or `frozen`.
    pub fn look(&self, pid: i32) -> Result<StateReport, Error> {
        let t = match target::resolve_callable(pid) {
            Ok(t) => t,
            Err(e @ (Error::Stopped { .. } | Error::Frozen { .. })) => {
                let t = target::resolve(pid)?;
                let rec = self.store.get(&t)?;
                let mut r = self.report(&t, ProcessState::Unknown(-1), rec.as_ref())?;
                r.state = if matches!(e, Error::Stopped { .. }) { "stopped" } else { "frozen" }.into();
                return Ok(r);
            }
            Err(e) => return Err(e),
        };
        let st = self.driver_state(&t)?;
        let rec = self.store.get(&t)?;
        if rec.is_none() && !matches!(st, ProcessState::Checkpointed | ProcessState::Locked) {
            let old = self.store.latest_for_pid(t.pid)?;
            if old.is_some_and(|o| {
                o.start_time != t.start_time && matches!(o.state.as_str(), "checkpointed" | "locked")
            }) {
                return Err(Error::Reused { pid, comm: t.comm.clone() });
            }
        }
        self.report(&t, st, rec.as_ref())
    }

    fn report(&self, t: &Target, st: ProcessState, rec: Option<&Record>) -> Result<StateReport, Error> {
        let live = self.live_usage(t.pid)?;
        let fast_swap = crate::swap::status(t.pid);
        let (state, parked) = park::parked_state(&st, fast_swap.as_ref(), live.values().sum());
        let fp = if live.values().any(|b| *b > 0) {
            live
        } else {
            rec.map(|r| r.footprint.clone()).unwrap_or_default()
        };
        Ok(StateReport {
            pid: t.pid,
            start_time: t.start_time,
            comm: t.comm.clone(),
            state,
            unrecoverable: rec.is_some_and(|r| r.unrecoverable.is_some()),
            reason: rec.and_then(|r| r.unrecoverable.clone()),
            footprint_bytes: fp.values().sum(),
            gpus: fp.into_iter().map(|(uuid, bytes)| GpuBytes { uuid, bytes }).collect(),
            ns_pid: target::ns_pid(t.pid).filter(|p| *p != t.pid),
            container: crate::container::of_pid(t.pid),
            fast_swap,
            parked,
        })
    }

    /// Every CUDA process this host can see: those NVML lists, those gpusnap
    /// recorded, and those mapping libcuda (suspended ones hold no GPU memory,
    /// so NVML no longer lists them).
    pub fn ps(&mut self) -> Result<Vec<StateReport>, Error> {
        let mut out = Vec::new();
        for pid in self.cuda_pids()? {
            let Ok(t) = target::resolve(pid) else {
                continue;
            };
            // A faulted context is not asked anything more (its guard may
            // hold it stopped, or in its exit path).
            if let Some(rec) = self.store.get(&t)?.filter(|r| r.state == crate::store::FAULTED) {
                let mut r = self.report(&t, ProcessState::Unknown(-1), Some(&rec))?;
                r.state = crate::store::FAULTED.into();
                out.push(r);
                continue;
            }
            if target::run_state(pid).is_ok_and(|s| s.is_stopped()) {
                let rec = self.store.get(&t)?;
                let mut r = self.report(&t, ProcessState::Unknown(-1), rec.as_ref())?;
                r.state = "stopped".into();
                out.push(r);
                continue;
            }
            match self.driver_state(&t) {
                Ok(st) => {
                    self.reconcile(&t)?;
                    let rec = self.record_seen(&t)?;
                    out.push(self.report(&t, st, rec.as_ref())?);
                }
                Err(Error::NotCuda { .. }) => continue,
                Err(e) => tracing::warn!(pid, "skipping: {e}"),
            }
        }
        Ok(out)
    }

    /// The pids [`Self::ps`] looks at: those NVML lists, those recorded,
    /// those mapping libcuda, this process aside.
    fn cuda_pids(&self) -> Result<BTreeSet<i32>, Error> {
        let mut pids: BTreeSet<i32> = self.gpus.processes()?.iter().map(|p| p.pid as i32).collect();
        pids.extend(self.store.all()?.iter().map(|r| r.pid));
        pids.extend(target::processes_mapping_libcuda());
        pids.remove(&(std::process::id() as i32));
        Ok(pids)
    }

    /// [`Self::ps`] read only, each process as [`Self::look`] reports it:
    /// nothing is recorded, reconciled or adopted (the agent's
    /// `GET /v1/processes`). A faulted context is not asked (its record
    /// says `faulted`); a pid that is gone, reused or not a CUDA process is
    /// left out.
    pub fn look_all(&self) -> Result<Vec<StateReport>, Error> {
        let mut out = Vec::new();
        for pid in self.cuda_pids()? {
            let Ok(t) = target::resolve(pid) else { continue };
            if let Some(rec) = self.store.get(&t)?.filter(|r| r.state == crate::store::FAULTED) {
                let mut r = self.report(&t, ProcessState::Unknown(-1), Some(&rec))?;
                r.state = crate::store::FAULTED.into();
                out.push(r);
                continue;
            }
            match self.look(pid) {
                Ok(r) => out.push(r),
                Err(
                    Error::NotCuda { .. }
                    | Error::NoProcess { .. }
                    | Error::Zombie { .. }
                    | Error::Reused { .. },
                ) => {}
                Err(e) => tracing::warn!(pid, "skipping: {e}"),
            }
        }
        Ok(out)
    }

    pub fn suspend(&mut self, pid: i32, lock_timeout_ms: u32) -> Result<SuspendReport, Error> {
        self.suspend_with(pid, lock_timeout_ms, true)
    }

    /// A suspend before the process is ended (`stop`): the driver locks and
    /// checkpoints it as any suspend, but a fast-swap library is not asked
    /// to copy its memory to host memory first (nothing will be brought
    /// back; a parked process's offloaded copies stay as they are).
    pub fn suspend_to_end(&mut self, pid: i32, lock_timeout_ms: u32) -> Result<SuspendReport, Error> {
        self.suspend_with(pid, lock_timeout_ms, false)
    }

    fn suspend_with(
        &mut self,
        pid: i32,
        lock_timeout_ms: u32,
        offload: bool,
    ) -> Result<SuspendReport, Error> {
        let started = Instant::now();
        let t = target::resolve_callable(pid)?;
        // One gpusnap at a time drives a process (a guard may be suspending it).
        let _serial = self.store.lock_target(pid)?;
        self.record_now(&t)?;
        self.reconcile(&t)?;
        let st = self.driver_state(&t)?;
        match st {
            ProcessState::Checkpointed => {
                let rec = self.store.get(&t)?;
                let fp = rec.as_ref().map(|r| r.footprint.clone()).unwrap_or_default();
                if rec.is_none() {
                    self.store.record(&t, "checkpointed", None)?;
                }
                return Ok(SuspendReport {
                    pid,
                    state: st.to_string(),
                    already: true,
                    footprint_bytes: fp.values().sum(),
                    gpus: to_list(&fp),
                    offload_ms: 0,
                    lock_ms: 0,
                    checkpoint_ms: 0,
                    release_ms: 0,
                    release_polls: 0,
                    total_ms: ms(started),
                });
            }
            ProcessState::Running | ProcessState::Locked => {}
            other => {
                return Err(Error::WrongState { pid, state: other.to_string(), op: "suspend" });
            }
        }
        // The footprint is what resume's admission will ask for: record it
        // before anything changes.
        let fp = self.with_offloaded(&t, self.live_usage(pid)?)?;
        self.store.record(&t, st.as_str(), Some(&fp))?;
        let total: u64 = fp.values().sum();

        // Fast swap: the library moves what it serves first; the driver
        // then checkpoints what is left.
        let t_offload = Instant::now();
        let offloaded = offload && st == ProcessState::Running && self.offload(&t)?;
        let offload_ms = ms(t_offload);
        let t_lock = Instant::now();
        if st == ProcessState::Running {
            let locked = target::resolve_callable(pid)
                .and_then(|_| self.journaled(&t, "lock", "locked", |api| api.lock(pid, lock_timeout_ms)));
            if let Err(e) = locked {
                self.undo_offload(&t, offloaded);
                return Err(e);
            }
        }
        let lock_ms = ms(t_lock);

        let t_ckpt = Instant::now();
        let rss0 = target::rss_bytes(pid).unwrap_or(0);
        let label = format!("suspend {pid}");
        let progress: &dyn Progress = &*self.progress;
        let api = &self.api;
        let id = self.store.begin(&t, "checkpoint")?;
        let res = observe(
            progress,
            &label,
            total,
            || target::rss_bytes(pid).map(|r| r.saturating_sub(rss0)),
            || api.checkpoint_within(pid, total),
        );
        match &res {
            Ok(()) => self.store.end(id, &t, "checkpoint", Ok("checkpointed"))?,
            Err(e) => self.store.end(id, &t, "checkpoint", Err(&e.to_string()))?,
        }
        if let Err(source) = res {
            // Leave it as we found it: running, if we were the ones who locked it.
            if st == ProcessState::Running && !matches!(source, DriverError::Timeout { .. }) {
                if let Err(e) = self.journaled(&t, "unlock", "running", |api| api.unlock(pid)) {
                    tracing::error!(pid, "could not unlock after a failed checkpoint: {e}");
                }
                self.undo_offload(&t, offloaded);
            }
            return Err(Error::Driver { pid, source });
        }
        let checkpoint_ms = ms(t_ckpt);

        let t_release = Instant::now();
        let (released, release_polls) = self.wait_released(pid)?;
        let release_ms = ms(t_release);
        if !released {
            let left: u64 = self.live_usage(pid)?.values().sum();
            self.store.note(&t, "verify", None, &format!("NVML still shows {} MiB", left / MIB))?;
            return Err(Error::NotReleased { pid, mib: left / MIB, secs: RELEASE_WAIT.as_secs() });
        }
        self.store.note(&t, "verify", Some("checkpointed"), "NVML shows no device memory")?;
        Ok(SuspendReport {
            pid,
            state: "checkpointed".into(),
            already: false,
            footprint_bytes: total,
            gpus: to_list(&fp),
            offload_ms,
            lock_ms,
            checkpoint_ms,
            release_ms,
            release_polls,
            total_ms: ms(started),
        })
    }

    pub fn resume(&mut self, pid: i32, opts: &ResumeOptions) -> Result<ResumeReport, Error> {
        let p = match self.prepare_resume(pid, opts)? {
            Prep::Done(r) => return Ok(r),
            Prep::Go(p) => p,
        };
        let (reservation, waited_ms) =
            self.admit_waiting(p.t.pid, Some(&p.t), &p.need, opts.margin_bytes, opts.wait)?;
        let result = self.finish_resume(p, waited_ms);
        self.store.release(&reservation)?;
        result
    }

    /// Everything a resume does before admission: identity, state, footprint,
    /// device map. A process that needs no restore is finished here.
    pub fn prepare_resume(&mut self, pid: i32, opts: &ResumeOptions) -> Result<Prep, Error> {
        let started = Instant::now();
        let t = target::resolve_callable(pid)?;
        let rec = self.record_of(&t)?;
        self.reconcile(&t)?;
        if let Some(reason) = rec.as_ref().and_then(|r| r.unrecoverable.clone()) {
            return Err(Error::Unrecoverable { pid, reason });
        }
        let st = self.driver_state(&t)?;
        let footprint = rec.as_ref().map(|r| r.footprint.clone()).unwrap_or_default();
        let fp_total: u64 = footprint.values().sum();
        let mut driver = true;
        match st {
            ProcessState::Running if self.is_offloaded(&t) => driver = false,
            ProcessState::Running => return Ok(Prep::Done(resumed(pid, fp_total, true, started, 0, 0, 0))),
            ProcessState::Locked => {
                // Restored but never unlocked (an interrupted resume): finish it.
                let t0 = Instant::now();
                self.journaled(&t, "unlock", "running", |api| api.unlock(pid))?;
                if !self.is_offloaded(&t) {
                    return Ok(Prep::Done(resumed(pid, fp_total, false, started, 0, 0, ms(t0))));
                }
                driver = false;
            }
            ProcessState::Checkpointed => {}
            other => return Err(Error::WrongState { pid, state: other.to_string(), op: "resume" }),
        }
        if rec.is_none() {
            self.store.record(&t, "checkpointed", None)?;
        }
        let need = if driver {
            self.needed(&t, &footprint, opts)?
        } else {
            self.needed_to_unpark(&t, &footprint, opts)?
        };
        let (pairs, need) = if opts.device_map.is_empty() {
            (Vec::new(), need)
        } else if opts.device_map.iter().any(|(a, b)| a != b) && self.is_offloaded(&t) {
            // The library maps its allocations back on the GPU it took them
            // from; the driver would put the context elsewhere.
            return Err(Error::BadMap(format!(
                "pid {pid} runs with fast swap and its memory waits in host memory for its own GPU: it resumes there, not on another"
            )));
        } else {
            let host = self.host_gpus()?;
            let visible = crate::remap::visible_to(pid, &host);
            self.plan_remap(&opts.device_map, &visible, &visible, &need)?
        };
        Ok(Prep::Go(Prepared { t, need, pairs, started, fp_total, driver }))
    }

    /// Admission: reserve `need`, waiting up to `wait` for it, or refuse
    /// without touching the driver (journaled on `t` when given). Returns the
    /// reservation and the wait.
    pub fn admit_waiting(
        &mut self,
        pid: i32,
        t: Option<&Target>,
        need: &BTreeMap<String, u64>,
        margin: u64,
        wait: Duration,
    ) -> Result<(Vec<i64>, u64), Error> {
        let t_wait = Instant::now();
        loop {
            match self.admit(pid, need, margin) {
                Ok(ids) => return Ok((ids, ms(t_wait))),
                Err(Error::NoMemory { .. }) if t_wait.elapsed() < wait => {
                    std::thread::sleep(Duration::from_millis(250));
                }
                Err(e) => {
                    if let (Error::NoMemory { detail, .. }, Some(t)) = (&e, t) {
                        self.store.note(t, "admission", None, &format!("refused: {detail}"))?;
                    }
                    return Err(e);
                }
            }
        }
    }

    /// The restore and unlock of an admitted resume.
    pub fn finish_resume(&mut self, p: Prepared, waited_ms: u64) -> Result<ResumeReport, Error> {
        let (restore_ms, unlock_ms) = if p.driver {
            self.restore_and_unlock(&p.t, &p.need, &p.pairs)?
        } else {
            // The driver's part is done; only the library's memory is away.
            let _serial = self.store.lock_target(p.t.pid)?;
            let t0 = Instant::now();
            self.restore_offloaded(&p.t)?;
            self.store.record(&p.t, "running", None)?;
            (ms(t0), 0)
        };
        if !p.pairs.is_empty() {
            // It lives on other GPUs now: that is where its next resume goes.
            self.store.record(&p.t, "running", Some(&p.need))?;
        }
        Ok(resumed(p.t.pid, p.fp_total, false, p.started, waited_ms, restore_ms, unlock_ms))
    }

    /// Per GPU, the bytes a restore of `t` needs.
    fn needed(
        &self,
        t: &Target,
        recorded: &BTreeMap<String, u64>,
        opts: &ResumeOptions,
    ) -> Result<BTreeMap<String, u64>, Error> {
        if let Some(b) = opts.footprint_bytes {
            // Without a record we do not know which GPU: require it on all.
            let gpus = self.gpus.gpus()?;
            return Ok(if recorded.is_empty() {
                gpus.into_iter().map(|g| (g.uuid, b)).collect()
            } else {
                let n = recorded.len() as u64;
                recorded.keys().map(|u| (u.clone(), b / n)).collect()
            });
        }
        if recorded.is_empty() {
            return Err(Error::NoFootprint { pid: t.pid });
        }
        Ok(recorded.clone())
    }

    pub fn admit(&mut self, pid: i32, need: &BTreeMap<String, u64>, margin: u64) -> Result<Vec<i64>, Error> {
        let gpus = &self.gpus;
        let (ids, ()) = self.store.reserve(pid, |held| {
            let now = gpus.gpus()?;
            let mut short = Vec::new();
            for (uuid, bytes) in need {
                let Some(g) = now.iter().find(|g| &g.uuid == uuid) else {
                    short.push(format!("GPU {uuid} is not on this host"));
                    continue;
                };
                let reserved = held.get(uuid).copied().unwrap_or(0);
                let free = g.free_bytes.saturating_sub(reserved);
                // Saturating: a footprint or margin from a manifest or the
                // command line must be refused, never wrap into a small one.
                if free < bytes.saturating_add(margin) {
                    short.push(format!(
                        "GPU {} needs {} MiB (footprint {} MiB + margin {} MiB), {} MiB free{}",
                        g.index,
                        bytes.saturating_add(margin) / MIB,
                        bytes / MIB,
                        margin / MIB,
                        free / MIB,
                        if reserved > 0 {
                            format!(" after {} MiB reserved by resumes in flight", reserved / MIB)
                        } else {
                            String::new()
                        }
                    ));
                }
            }
            if short.is_empty() {
                Ok((need.iter().map(|(u, b)| (u.clone(), *b)).collect(), ()))
            } else {
                Err(Error::NoMemory { pid, detail: short.join("; ") })
            }
        })?;
        Ok(ids)
    }

    /// This host's GPUs, for remapping.
    pub fn host_gpus(&self) -> Result<Vec<crate::remap::Gpu>, Error> {
        Ok(self
            .gpus
            .gpus()?
            .into_iter()
            .map(|g| crate::remap::Gpu { index: Some(g.index), uuid: g.uuid, name: g.name })
            .collect())
    }

    /// The driver's pairs and the bytes per new GPU for a user's device map.
    pub fn plan_remap(
        &self,
        map: &[(String, String)],
        olds: &[crate::remap::Gpu],
        news: &[crate::remap::Gpu],
        footprint: &BTreeMap<String, u64>,
    ) -> Result<(Vec<GpuPair>, BTreeMap<String, u64>), Error> {
        let (pairs, need) = crate::remap::plan(map, olds, news, footprint).map_err(Error::BadMap)?;
        let pairs = pairs
            .into_iter()
            .map(|(o, n)| {
                Ok(GpuPair { old: o.parse().map_err(Error::BadMap)?, new: n.parse().map_err(Error::BadMap)? })
            })
            .collect::<Result<Vec<_>, Error>>()?;
        Ok((pairs, need))
    }

    pub fn restore_and_unlock(
        &mut self,
        t: &Target,
        need: &BTreeMap<String, u64>,
        pairs: &[GpuPair],
    ) -> Result<(u64, u64), Error> {
        self.restore_gated(t, need, pairs, &|_| Ok(()))
    }

    /// Restore, then `gate` (told whether the restore succeeded; it may
    /// wait, and its error keeps the process locked), then unlock, under
    /// the target's lock. `gate` is called exactly once, whatever fails.
    pub fn restore_gated<E: From<Error>>(
        &mut self,
        t: &Target,
        need: &BTreeMap<String, u64>,
        pairs: &[GpuPair],
        gate: &dyn Fn(bool) -> Result<(), E>,
    ) -> Result<(u64, u64), E> {
        let pid = t.pid;
        let serial = target::resolve_callable(pid).and_then(|_| self.store.lock_target(pid));
        let _serial = match serial {
            Ok(s) => s,
            Err(e) => {
                let _ = gate(false);
                return Err(e.into());
            }
        };
        let t_restore = Instant::now();
        let restored = self.restore_only(t, need, pairs);
        let restore_ms = ms(t_restore);
        let pass = gate(restored.is_ok());
        restored?;
        pass?;
        let t_unlock = Instant::now();
        self.journaled(t, "unlock", "running", |api| api.unlock(pid))?;
        self.restore_offloaded(t)?;
        Ok((restore_ms, ms(t_unlock)))
    }

    /// The journaled restore (to LOCKED), with progress; an out-of-memory
    /// answer marks the process as stuck. The caller holds the target lock.
    pub fn restore_only(
        &mut self,
        t: &Target,
        need: &BTreeMap<String, u64>,
        pairs: &[GpuPair],
    ) -> Result<(), Error> {
        let pid = t.pid;
        let total: u64 = need.values().sum();
        let used0 = self.used_on(need);
        let id = self.store.begin(t, "restore")?;
        let progress: &dyn Progress = &*self.progress;
        let (api, gpus) = (&self.api, &*self.gpus);
        let label = format!("resume {pid}");
        let res = observe(
            progress,
            &label,
            total,
            || {
                let now = used_on(gpus, need)?;
                Some(now.saturating_sub(used0?))
            },
            || api.restore_within(pid, pairs, total),
        );
        match &res {
            Ok(()) => self.store.end(id, t, "restore", Ok("locked"))?,
            Err(e) => self.store.end(id, t, "restore", Err(&e.to_string()))?,
        }
        if let Err(source) = res {
            return Err(match source.code() {
                Some(CUDA_ERROR_OUT_OF_MEMORY) | Some(CUDA_ERROR_OPERATING_SYSTEM) => {
                    let reason = format!(
                        "{source} while restoring: GPU memory was taken outside gpusnap's admission; \
                         on this driver a failed restore leaves the process stuck for good. Kill it \
                         (it holds no GPU memory) and restart it, or wake it from an image"
                    );
                    self.store.set_unrecoverable(t, &reason)?;
                    Error::Unrecoverable { pid, reason }
                }
                _ => Error::Driver { pid, source },
            });
        }
        Ok(())
    }

    fn used_on(&self, need: &BTreeMap<String, u64>) -> Option<u64> {
        used_on(&*self.gpus, need)
    }
}

fn used_on<G: GpuInventory>(gpus: &G, need: &BTreeMap<String, u64>) -> Option<u64> {
    let all = gpus.gpus().ok()?;
    Some(all.iter().filter(|g| need.contains_key(&g.uuid)).map(|g| g.used_bytes).sum())
}

/// A resume that is ready for admission.
pub struct Prepared {
    pub t: Target,
    pub need: BTreeMap<String, u64>,
    pairs: Vec<GpuPair>,
    started: Instant,
    fp_total: u64,
    /// The driver has the process checkpointed (false: only the fast-swap
    /// library's memory is away).
    driver: bool,
}

pub enum Prep {
    Done(ResumeReport),
    Go(Prepared),
}

fn resumed(
    pid: i32,
    footprint_bytes: u64,
    already: bool,
    started: Instant,
    waited_ms: u64,
    restore_ms: u64,
    unlock_ms: u64,
) -> ResumeReport {
    ResumeReport {
        pid,
        state: "running".into(),
        already,
        footprint_bytes,
        waited_ms,
        restore_ms,
        unlock_ms,
        total_ms: ms(started),
        recovered_from: None,
    }
}

fn to_list(fp: &BTreeMap<String, u64>) -> Vec<GpuBytes> {
    fp.iter().map(|(u, b)| GpuBytes { uuid: u.clone(), bytes: *b }).collect()
}
