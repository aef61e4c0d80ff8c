//! Park: a fast-swap program's library moves the allocations it serves to
//! pinned host memory and closes its gate, and the driver is not asked to
//! lock or checkpoint anything: the context, modules and graphs stay on the
//! GPU (the residual). A resume of a parked process is admitted for the
//! moved bytes and has the library copy them back; a suspend of one locks
//! and checkpoints what is left without moving memory again (see
//! docs/design/fast-swap.md).

use super::{ms, Engine, MIB};
use crate::error::Error;
use crate::reports::{GpuBytes, ParkReport, ParkedBytes, ResumeOptions};
use crate::store::PARKED;
use crate::swap::{self, SwapStatus};
use crate::target;
use gpusnap_cuda::{CheckpointApi, ProcessState};
use gpusnap_gpu::GpuInventory;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// How long NVML may take to show the memory the library gave back.
const RESIDUAL_WAIT: Duration = Duration::from_secs(2);

/// The state `ps` and `state` show for a process the driver reports `st`:
/// `parked` while its library holds its memory in host memory, `parking`
/// and `unparking` while the library moves it (it finishes on its own), and
/// what it parked (the residual from NVML, `live` bytes now).
pub(super) fn parked_state(
    st: &ProcessState,
    fast_swap: Option<&SwapStatus>,
    live: u64,
) -> (String, Option<ParkedBytes>) {
    let Some(fs) = fast_swap.filter(|s| s.away()) else { return (st.to_string(), None) };
    let bytes = ParkedBytes { residual_bytes: live, host_bytes: fs.movable_bytes };
    match st {
        ProcessState::Running => {
            let state = match fs.phase.as_str() {
                "offloading" => "parking",
                "restoring" => "unparking",
                _ => PARKED,
            };
            (state.to_string(), Some(bytes))
        }
        ProcessState::Locked => (st.to_string(), Some(bytes)),
        _ => (st.to_string(), None),
    }
}

impl<A: CheckpointApi, G: GpuInventory> Engine<A, G> {
    /// Parks `pid`: only for a program run with fast swap (others:
    /// [`Error::NoFastSwap`]); never locks or checkpoints.
    pub fn park(&mut self, pid: i32) -> Result<ParkReport, Error> {
        let started = Instant::now();
        let t = target::resolve_callable(pid)?;
        let _serial = self.store.lock_target(pid)?;
        self.record_now(&t)?;
        self.reconcile(&t)?;
        let st = self.driver_state(&t)?;
        if st != ProcessState::Running {
            return Err(Error::WrongState { pid, state: st.to_string(), op: "park" });
        }
        let Some(status) = swap::status(pid) else {
            return Err(Error::NoFastSwap { pid, comm: t.comm.clone() });
        };
        if status.offloaded() {
            let fp = self.store.get(&t)?.map(|r| r.footprint).unwrap_or_default();
            let residual = self.live_usage(pid)?;
            return Ok(parked(pid, true, &fp, &residual, status.movable_bytes, 0, started));
        }
        // The footprint before anything moves: the unpark's admission asks
        // for it less what stays on the GPU. A park a gpusnap began and did
        // not finish (the library still offloading) keeps the one it
        // recorded.
        let fp = self.with_offloaded(&t, self.live_usage(pid)?)?;
        self.store.record(&t, st.as_str(), Some(&fp))?;
        let t_offload = Instant::now();
        if let Err(why) = self.offload_or_why(&t)? {
            self.store.note(&t, "park", None, &format!("not parked: {why}"))?;
            return Err(Error::ParkFailed { pid, reason: why });
        }
        let offload_ms = ms(t_offload);
        let host = swap::status(pid).map(|s| s.movable_bytes).unwrap_or(0);
        let residual = self.residual(pid, fp.values().sum(), host)?;
        self.store.record(&t, PARKED, None)?;
        let left: u64 = residual.values().sum();
        self.store.note(
            &t,
            "park",
            Some(PARKED),
            &format!(
                "{} MiB in pinned host memory; {} MiB stay on the GPU (the context, modules, graphs and what the library does not serve)",
                host / MIB,
                left / MIB
            ),
        )?;
        Ok(parked(pid, false, &fp, &residual, host, offload_ms, started))
    }

    /// What `pid` holds on its GPUs once NVML shows the library's memory
    /// given back (NVML may show a release a little late).
    fn residual(&self, pid: i32, before: u64, moved: u64) -> Result<BTreeMap<String, u64>, Error> {
        let end = Instant::now() + RESIDUAL_WAIT;
        loop {
            let live = self.live_usage(pid)?;
            let now: u64 = live.values().sum();
            if now.saturating_add(moved) <= before || moved == 0 || Instant::now() >= end {
                return Ok(live);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Per GPU, the bytes an unpark needs: the footprint recorded before the
    /// park less what it still holds there (its residual, counted by NVML
    /// as taken already). Nothing recorded: the library's bytes, on the GPU
    /// that holds its residual.
    pub(super) fn needed_to_unpark(
        &self,
        t: &target::Target,
        recorded: &BTreeMap<String, u64>,
        opts: &ResumeOptions,
    ) -> Result<BTreeMap<String, u64>, Error> {
        if opts.footprint_bytes.is_some() {
            return self.needed(t, recorded, opts);
        }
        let live = self.live_usage(t.pid)?;
        if recorded.is_empty() {
            let host = swap::status(t.pid).map(|s| s.movable_bytes).unwrap_or(0);
            let Some(uuid) = live.iter().find(|(_, b)| **b > 0).map(|(u, _)| u.clone()) else {
                return Err(Error::NoFootprint { pid: t.pid });
            };
            return Ok(BTreeMap::from([(uuid, host)]));
        }
        Ok(recorded
            .iter()
            .map(|(u, b)| (u.clone(), b.saturating_sub(live.get(u).copied().unwrap_or(0))))
            .collect())
    }
}

fn parked(
    pid: i32,
    already: bool,
    fp: &BTreeMap<String, u64>,
    residual: &BTreeMap<String, u64>,
    host: u64,
    offload_ms: u64,
    started: Instant,
) -> ParkReport {
    ParkReport {
        pid,
        state: PARKED.into(),
        already,
        footprint_bytes: fp.values().sum(),
        residual_bytes: residual.values().sum(),
        host_bytes: host,
        gpus: residual.iter().map(|(u, b)| GpuBytes { uuid: u.clone(), bytes: *b }).collect(),
        offload_ms,
        total_ms: ms(started),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(phase: &str) -> SwapStatus {
        SwapStatus { phase: phase.into(), movable_bytes: 7, ..Default::default() }
    }

    #[test]
    fn the_library_says_whether_a_running_process_is_parked() {
        let run = ProcessState::Running;
        assert_eq!(parked_state(&run, None, 5), ("running".into(), None));
        assert_eq!(parked_state(&run, Some(&status("resident")), 5), ("running".into(), None));
        let bytes = Some(ParkedBytes { residual_bytes: 5, host_bytes: 7 });
        assert_eq!(parked_state(&run, Some(&status("offloaded")), 5), ("parked".into(), bytes));
        assert_eq!(parked_state(&run, Some(&status("offloading")), 5).0, "parking");
        assert_eq!(parked_state(&run, Some(&status("restoring")), 5).0, "unparking");
        assert_eq!(
            parked_state(&ProcessState::Locked, Some(&status("offloaded")), 5),
            ("locked".into(), bytes)
        );
        let ckpt = ProcessState::Checkpointed;
        assert_eq!(parked_state(&ckpt, Some(&status("offloaded")), 0), ("checkpointed".into(), None));
    }
}
