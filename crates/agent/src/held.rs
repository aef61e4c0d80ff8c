//! What one service holds now: device memory on the GPU (NVML's figure for
//! its processes), its device memory kept in host memory (suspended: the
//! driver's copy; parked: the fast-swap library's), and the bytes of its
//! image while hibernated.

use crate::service::{Service, State};
use crate::state::Agent;
use serde::Serialize;

#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq, Eq)]
pub struct Held {
    pub gpu_bytes: u64,
    pub host_bytes: u64,
    pub image_bytes: u64,
}

impl Agent {
    /// What `s` holds now (blocks: asks NVML and reads the store).
    pub fn held_by(&self, s: &Service) -> Held {
        let (state, root, image) = {
            let g = s.lock();
            (g.state, g.process.clone(), g.image.clone())
        };
        let mut h = Held::default();
        if let Some(image) = image.filter(|_| state == State::Hibernated) {
            if let Ok((_, m)) = self.images().manifest(&image) {
                h.image_bytes = m.files.iter().map(|f| f.size).sum();
            }
            return h;
        }
        let Some(root) = root else { return h };
        let Ok(e) = self.engine() else { return h };
        let store = gpusnap_core::Store::open(self.state_dir()).ok();
        for pid in self.cuda_pids(root.pid) {
            let Ok(r) = e.look(pid) else { continue };
            match r.state.as_str() {
                // Its footprint was recorded when it was checkpointed.
                "checkpointed" => {
                    h.host_bytes += store
                        .as_ref()
                        .and_then(|st| st.latest_for_pid(pid).ok().flatten())
                        .map_or(0, |rec| rec.footprint_bytes())
                }
                _ => {
                    h.gpu_bytes += r.footprint_bytes;
                    h.host_bytes += r.parked.map_or(0, |p| p.host_bytes);
                }
            }
        }
        h
    }
}
