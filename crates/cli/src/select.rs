//! Which processes a command acts on: the pids named and the groups
//! (`--tree`, `--cgroup`, `--container`, `--all`) resolved to processes.

use crate::cli::Select;
use crate::setup::DynEngine;
use gpusnap_core::Error as CoreError;
use gpusnap_hibernate::Error;

/// How much [`Select::validate`] asks of a pid named.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Check {
    /// A process gpusnap may act on (not a thread, a zombie, another user's).
    Exists,
    /// ... and not stopped: the driver would hang on it.
    Callable,
}

impl Select {
    /// The targets named, checked before the driver (or CRIU) is loaded, so
    /// that bad input gets the same error (exit 2) on a host without the
    /// driver as with one, and nothing is done when one of them is wrong:
    /// each pid named, the --tree root, the --cgroup.
    pub fn validate(&self, check: Check) -> Result<(), Error> {
        let several = self.single().is_none();
        for &pid in &self.pids {
            let r = match check {
                Check::Exists => gpusnap_core::target::resolve(pid),
                Check::Callable => gpusnap_core::target::resolve_callable(pid),
            };
            // A group names the member, as the group's own errors do.
            r.map_err(
                |e| if several { Error::Member { pid, source: Box::new(e.into()) } } else { e.into() },
            )?;
        }
        if let Some(root) = self.tree {
            gpusnap_core::target::resolve(root)?;
        }
        if let Some(cg) = &self.cgroup {
            gpusnap_core::target::cgroup_processes(cg)?;
        }
        self.container_pids()?;
        Ok(())
    }

    /// The processes of the --container (empty without one), resolved
    /// through its runtime once per command.
    pub fn container_pids(&self) -> Result<Vec<i32>, CoreError> {
        let Some(name) = &self.container else { return Ok(Vec::new()) };
        if let Some(r) = self.resolved.get() {
            return Ok(r.pids.clone());
        }
        let r = gpusnap_core::container::resolve(name)?;
        tracing::debug!("container {name}: {} {} pids {:?}", r.runtime, r.id, r.pids);
        Ok(self.resolved.get_or_init(|| r).pids.clone())
    }

    /// The roots of the trees a hibernate of this selection dumps: each pid
    /// named, the --tree root, the processes of a --cgroup, the CUDA
    /// processes (--all), less any that lies inside another's tree.
    pub fn roots(&self, e: &mut DynEngine) -> anyhow::Result<Vec<i32>> {
        let mut want: Vec<i32> = self.pids.clone();
        want.extend(self.tree);
        if let Some(cg) = &self.cgroup {
            want.extend(gpusnap_core::target::cgroup_processes(cg)?);
        }
        want.extend(self.container_pids()?);
        if self.all {
            want.extend(e.ps()?.into_iter().filter(|r| r.state != "stopped").map(|r| r.pid));
        }
        let mut roots = gpusnap_core::tree::roots_of(&want);
        // A group's member may end between the listing and now (a short-lived
        // process of a container); a pid named on the command line may not.
        roots.retain(|p| {
            self.pids.contains(p)
                || !matches!(
                    gpusnap_core::target::resolve(*p),
                    Err(CoreError::NoProcess { .. } | CoreError::Zombie { .. })
                )
        });
        Ok(roots)
    }

    /// The pid named, when it is the whole selection (no other pid, no group).
    pub fn single(&self) -> Option<i32> {
        match self.pids.as_slice() {
            [pid] if !self.is_group() => Some(*pid),
            _ => None,
        }
    }

    /// Whether a group (--tree, --cgroup, --container, --all) is named.
    pub fn is_group(&self) -> bool {
        self.all || self.tree.is_some() || self.cgroup.is_some() || self.container.is_some()
    }

    /// The pids named, plus the CUDA processes of the groups named, in order
    /// and without repeats. A group that turns out empty is not an error.
    pub fn resolve(&self, e: &mut DynEngine) -> anyhow::Result<Vec<i32>> {
        let mut out: Vec<i32> = Vec::new();
        let mut push = |p: i32| {
            if !out.contains(&p) {
                out.push(p);
            }
        };
        self.pids.iter().copied().for_each(&mut push);
        if self.is_group() {
            let cuda: Vec<i32> =
                e.ps()?.into_iter().filter(|r| r.state != "stopped").map(|r| r.pid).collect();
            self.members(&cuda)?.into_iter().for_each(&mut push);
        }
        Ok(out)
    }

    /// The groups' members among `cuda` (CUDA processes): those of --all,
    /// of the --tree, of the --cgroup, in that order, perhaps repeated.
    pub fn members(&self, cuda: &[i32]) -> anyhow::Result<Vec<i32>> {
        let mut out: Vec<i32> = Vec::new();
        if self.all {
            out.extend_from_slice(cuda);
        }
        if let Some(root) = self.tree {
            gpusnap_core::target::resolve(root)?;
            let tree: Vec<i32> = gpusnap_core::tree::process_tree(root).into_iter().map(|(p, _)| p).collect();
            out.extend(cuda.iter().copied().filter(|p| tree.contains(p)));
        }
        if let Some(cg) = &self.cgroup {
            let members = gpusnap_core::target::cgroup_processes(cg)?;
            out.extend(cuda.iter().copied().filter(|p| members.contains(p)));
        }
        if self.container.is_some() {
            let members = self.container_pids()?;
            out.extend(cuda.iter().copied().filter(|p| members.contains(p)));
        }
        Ok(out)
    }
}
