//! Room on the GPU: which idle service to evict for another, what a resume
//! needs free, waiting for memory when nothing can be evicted, and what a
//! service with hooks takes once its after_resume hook has run.

use crate::service::{Service, State};
use crate::state::{cuda_pids_in, Agent, DynEngine};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Waiting for GPU memory with nothing to evict: NVML is read this often,
/// and admission asked again after at most MEMORY_WAIT_MAX.
const MEMORY_POLL: Duration = Duration::from_millis(5);
const MEMORY_WAIT_MAX: Duration = Duration::from_millis(200);

/// An eviction candidate: (tier, priority, last used), what it holds on the
/// GPU (bytes, as NVML says), the service.
type Candidate = ((u8, i64, i64), u64, Arc<Service>);

impl Agent {
    /// Suspends idle services (as a resume would) until `need` bytes are
    /// free on the GPU with the most free memory, or wake_timeout passes.
    pub(super) async fn make_room(
        self: &Arc<Self>,
        svc: &Arc<Service>,
        need: u64,
    ) -> tokio::sync::MutexGuard<'_, ()> {
        let gpu = self.gpu_lock().await;
        let deadline = Instant::now() + svc.cfg.wake_timeout;
        loop {
            let a = Arc::clone(self);
            let free = tokio::task::spawn_blocking(move || {
                a.engine()
                    .ok()
                    .and_then(|e| e.gpus().gpus().ok())
                    .map(|g| g.iter().map(|g| g.free_bytes).max().unwrap_or(0))
            })
            .await
            .ok()
            .flatten()
            .unwrap_or(u64::MAX);
            if free >= need.saturating_add(svc.cfg.margin) || Instant::now() >= deadline {
                return gpu;
            }
            match self.pick_victim(svc, Some(need.saturating_add(svc.cfg.margin).saturating_sub(free))) {
                Some(v) => {
                    let reason = format!(
                        "evicted to make room for {} to start ({} MiB free, {} MiB needed)",
                        svc.name,
                        free >> 20,
                        need >> 20
                    );
                    if self.evict(&v, &reason).await.is_err() {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
                None => {
                    self.wait_for_memory(None, deadline).await;
                }
            }
        }
    }

    /// After admission refused and nothing can be evicted: returns as soon
    /// as NVML shows what the resume of `svc` needs free on each of its GPUs
    /// (its recorded footprint and margin; without one, `svc` None or not
    /// known: as soon as free memory grows on some GPU), or after
    /// MEMORY_WAIT_MAX, or at `deadline`. The caller then asks admission
    /// again, which decides: this only chooses when to ask. NVML is read
    /// every MEMORY_POLL (a checkpoint's release it reports late, a process
    /// that ended); it used to be a fixed 200 ms sleep. Returns the reads.
    pub(super) async fn wait_for_memory(
        self: &Arc<Self>,
        svc: Option<&Arc<Service>>,
        deadline: Instant,
    ) -> u32 {
        let until = (Instant::now() + MEMORY_WAIT_MAX).min(deadline);
        let (a, s) = (Arc::clone(self), svc.cloned());
        tokio::task::spawn_blocking(move || {
            let need = s.map(|s| a.resume_need(&s)).unwrap_or_default();
            let Ok(e) = a.engine() else {
                std::thread::sleep(until.saturating_duration_since(Instant::now()));
                return 0;
            };
            let read = || -> Option<std::collections::BTreeMap<String, u64>> {
                e.gpus().gpus().ok().map(|g| g.into_iter().map(|g| (g.uuid, g.free_bytes)).collect())
            };
            let first = read();
            let mut reads = 1;
            loop {
                let left = until.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return reads;
                }
                std::thread::sleep(MEMORY_POLL.min(left));
                reads += 1;
                let Some(now) = read() else { continue };
                let enough = if need.is_empty() {
                    first.as_ref().is_some_and(|f| now.iter().any(|(u, b)| f.get(u).is_some_and(|g| b > g)))
                } else {
                    need.iter().all(|(u, b)| now.get(u).is_some_and(|f| f >= b))
                };
                if enough {
                    return reads;
                }
            }
        })
        .await
        .unwrap_or(0)
    }

    /// Per GPU, what admission asks for a resume of `svc`: the footprint
    /// recorded for its CUDA processes plus its margin (empty if unknown).
    fn resume_need(&self, svc: &Service) -> std::collections::BTreeMap<String, u64> {
        let mut need = std::collections::BTreeMap::new();
        let Some(root) = svc.lock().process.as_ref().map(|t| t.pid) else { return need };
        let mut e = self.engine().ok();
        let pids = cuda_pids_in(e.as_mut(), root);
        let Some(e) = e else { return need };
        for pid in pids {
            if let Ok(Some(r)) = e.store().latest_for_pid(pid) {
                for (u, b) in r.footprint {
                    *need.entry(u).or_insert(0u64) += b;
                }
            }
        }
        let extra = Self::full_size(svc).map(|full| full.saturating_sub(need.values().sum()));
        for b in need.values_mut() {
            *b = b.saturating_add(svc.cfg.margin).saturating_add(extra.unwrap_or(0));
        }
        need
    }

    /// The service to evict for `for_svc`: an idle running one first
    /// (parked, or suspended if it does not park), never one with traffic
    /// in flight nor one back on the GPU for less than its `min_resident`;
    /// only when none is left, a parked one (suspended in full: its
    /// residual is the room needed). Lowest priority, then least recently
    /// used. `short`: the bytes still missing, when known (a cold start):
    /// among the cheapest (same tier and priority), one that frees that
    /// much alone, else the one that frees the most, so that no more
    /// services are evicted than the room needs. One engine and one NVML
    /// process list for all the candidates (a swap waits on this).
    pub(super) fn pick_victim(&self, for_svc: &Service, short: Option<u64>) -> Option<Arc<Service>> {
        let mut e = self.engine().ok();
        // Only services on the GPUs the resume needs (its footprint's);
        // unknown (a cold start): any.
        let needed = self.footprint_gpus(&mut e, for_svc);
        let mut nvml: Option<Vec<gpusnap_gpu::ProcessUsage>> = None;
        let mut all: Vec<Candidate> = Vec::new();
        for s in self.services().iter() {
            if s.name == for_svc.name {
                continue;
            }
            let (key, root) = {
                let g = s.lock();
                let tier = match g.state {
                    State::Running if g.since.elapsed() >= s.min_resident() => 0,
                    State::Parked => 1,
                    _ => continue,
                };
                if Service::has_traffic(&g) {
                    continue;
                }
                ((tier, s.cfg.priority, g.last_used_ms), g.process.as_ref().map(|t| t.pid))
            };
            // Sizes matter only with `short`; else only the best key does.
            if short.is_none() && all.first().is_some_and(|(k, _, _)| key >= *k) {
                continue;
            }
            // A parked one is worth suspending only for what it still holds.
            let parked = key.0 == 1;
            let mut held = 0;
            if let (true, Some(root)) = (parked || !needed.is_empty() || short.is_some(), root) {
                let procs = nvml.get_or_insert_with(|| {
                    e.as_ref().and_then(|e| e.gpus().processes().ok()).unwrap_or_default()
                });
                let pids = cuda_pids_in(e.as_mut(), root);
                let mine: Vec<&gpusnap_gpu::ProcessUsage> =
                    procs.iter().filter(|p| pids.contains(&(p.pid as i32))).collect();
                let on: std::collections::BTreeSet<String> =
                    mine.iter().filter(|p| p.bytes.is_none_or(|b| b > 0)).map(|p| p.uuid.clone()).collect();
                if parked && on.is_empty() {
                    continue;
                }
                if !needed.is_empty() && !on.is_empty() && on.is_disjoint(&needed) {
                    continue;
                }
                held = mine.iter().filter_map(|p| p.bytes).sum();
            }
            if short.is_none() {
                all.clear();
            }
            all.push((key, held, Arc::clone(s)));
        }
        let cheapest = all.iter().map(|(k, _, _)| (k.0, k.1)).min()?;
        let class = all.into_iter().filter(|(k, _, _)| (k.0, k.1) == cheapest);
        let pick = match short {
            None => class.min_by_key(|(k, _, _)| *k),
            Some(short) => {
                let (enough, not): (Vec<_>, Vec<_>) = class.partition(|(_, held, _)| *held >= short);
                if enough.is_empty() {
                    not.into_iter().max_by_key(|(k, held, _)| (*held, std::cmp::Reverse(k.2)))
                } else {
                    enough.into_iter().min_by_key(|(k, _, _)| k.2)
                }
            }
        };
        pick.map(|(_, _, s)| s)
    }

    /// The GPUs a suspended service's recorded footprint is on.
    fn footprint_gpus(&self, e: &mut Option<DynEngine>, svc: &Service) -> std::collections::BTreeSet<String> {
        let Some(root) = svc.lock().process.as_ref().map(|t| t.pid) else { return Default::default() };
        let pids = cuda_pids_in(e.as_mut(), root);
        let Some(e) = e.as_ref() else { return Default::default() };
        pids.into_iter()
            .filter_map(|p| e.store().latest_for_pid(p).ok().flatten())
            .flat_map(|r| r.footprint.into_keys())
            .collect()
    }

    /// The size of a service with hooks once its after_resume hook has run:
    /// what it held before its last before_suspend hook (NVML), or its
    /// declared `gpu_memory` if larger (or if NVML could not tell).
    fn full_size(svc: &Service) -> Option<u64> {
        if !svc.cfg.hooks.any() {
            return None;
        }
        let seen = svc.lock().full_footprint;
        match (seen, svc.cfg.gpu_memory) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        }
    }

    /// What the service will take after its after_resume hook beyond what
    /// its suspend recorded (the before_suspend hook gave it back): admission
    /// asks for it on top of the margin.
    pub(super) fn growth(&self, svc: &Service, e: &mut DynEngine, pids: &[i32]) -> u64 {
        let Some(full) = Self::full_size(svc) else { return 0 };
        let recorded: u64 = pids
            .iter()
            .filter_map(|p| e.store().latest_for_pid(*p).ok().flatten())
            .map(|r| r.footprint.values().sum::<u64>())
            .sum();
        full.saturating_sub(recorded)
    }
}
