//! CRI-O's containers, without its gRPC: a running container's processes
//! are named by their cgroups (`crio-ID.scope`); one that has exited is
//! named by the file conmon writes in CRI-O's exits directory
//! (`STATE/exits/ID`).

use super::{all_pids, frozen, of_pid, pick, Found, Runtime};
use crate::error::Error;
use std::path::PathBuf;

/// CRI-O's state directory: `GPUSNAP_CRIO_STATE`, else `/run/crio`.
pub struct Crio {
    state: PathBuf,
}

impl Crio {
    pub fn from_env() -> Self {
        let state = std::env::var_os("GPUSNAP_CRIO_STATE")
            .filter(|s| !s.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/run/crio"));
        Crio { state }
    }

    /// The running containers' ids with their processes.
    fn live(&self) -> Vec<(String, Vec<i32>)> {
        let mut out: Vec<(String, Vec<i32>)> = Vec::new();
        for pid in all_pids() {
            let Some(c) = of_pid(pid).filter(|c| c.runtime == "cri-o") else { continue };
            match out.iter_mut().find(|(id, _)| *id == c.id) {
                Some((_, pids)) => pids.push(pid),
                None => out.push((c.id, vec![pid])),
            }
        }
        out
    }

    fn exited(&self) -> Vec<String> {
        std::fs::read_dir(self.state.join("exits"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str().map(str::to_string))
            .filter(|n| n.len() == 64 && n.bytes().all(|b| b.is_ascii_hexdigit()))
            .collect()
    }
}

impl Runtime for Crio {
    fn name(&self) -> &'static str {
        "cri-o"
    }

    fn find(&self, name_or_id: &str) -> Result<Option<Found>, Error> {
        let running = self.live();
        let mut ids: Vec<String> = running.iter().map(|(id, _)| id.clone()).collect();
        ids.extend(self.exited().into_iter().filter(|id| !running.iter().any(|(r, _)| r == id)));
        let Some(id) = pick("cri-o", &name_or_id.to_ascii_lowercase(), &ids)? else { return Ok(None) };
        let short: String = id.chars().take(12).collect();
        Ok(Some(match running.iter().find(|(r, _)| r == id) {
            Some((_, pids)) => {
                let pid = pids.iter().copied().min().unwrap_or(0);
                let status = if frozen(pid).is_some() { "paused" } else { "running" };
                Found { id: id.clone(), name: short, status: status.into(), pid }
            }
            None => Found { id: id.clone(), name: short, status: "exited".into(), pid: 0 },
        }))
    }

    fn names(&self) -> Vec<(String, String)> {
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exited_container_is_found_by_its_exit_file() {
        let tmp = tempfile::tempdir().unwrap();
        let id = "9f".repeat(32);
        std::fs::create_dir_all(tmp.path().join("exits")).unwrap();
        std::fs::write(tmp.path().join("exits").join(&id), "137").unwrap();
        let c = Crio { state: tmp.path().to_path_buf() };
        let f = c.find("9f9f9f9f9f9f").unwrap().unwrap();
        assert_eq!((f.id.as_str(), f.status.as_str(), f.pid), (id.as_str(), "exited", 0));
        assert!(c.find("abcdef").unwrap().is_none());
    }
}
