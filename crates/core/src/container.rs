//! Containers as targets: which container a process belongs to (from its
//! cgroup path, where most runtimes name the container's id, or from a
//! runtime's task state), and a container's name or id resolved through its
//! runtime's own state to the processes in it. One [`Runtime`] per runtime
//! gpusnap can ask (podman through its command line, containerd and CRI-O
//! through the state they keep under `/run`, no gRPC); a runtime it cannot
//! ask (docker) is still recognised by its cgroups, so that a container of
//! it is refused with a reason rather than not found.

mod containerd;
mod crio;

pub use containerd::Containerd;
pub use crio::Crio;

use crate::error::Error;
use serde::Serialize;
use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The container a process belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ContainerRef {
    /// `podman`, `docker`, `containerd` or `cri-o`: whose cgroup names it.
    pub runtime: &'static str,
    /// The full id (64 hex digits, or the name a containerd task was
    /// given: `ctr run IMAGE ID`).
    pub id: String,
    /// Its name, where the runtime was asked (`ps` asks podman).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// A container a runtime knows, as it reports it.
#[derive(Debug, Clone)]
pub struct Found {
    pub id: String,
    pub name: String,
    /// The runtime's word for its state (`running`, `exited`, `paused`...).
    pub status: String,
    /// Its first process (host pid), 0 when it runs none.
    pub pid: i32,
}

/// A container runtime gpusnap can ask about its containers.
pub trait Runtime {
    /// As [`ContainerRef::runtime`].
    fn name(&self) -> &'static str;
    /// The container named `name_or_id` (a name, a full id or an id
    /// prefix); `Ok(None)` when this runtime has none such or is not
    /// installed.
    fn find(&self, name_or_id: &str) -> Result<Option<Found>, Error>;
    /// The names of its containers, by full id (for `ps`); empty when it
    /// cannot say.
    fn names(&self) -> Vec<(String, String)>;
    /// The processes (host pids) of a running container it found: those
    /// whose cgroups name its id.
    fn members(&self, found: &Found) -> Vec<i32> {
        members(&found.id)
    }
    /// Its running containers and their processes, where its cgroups do not
    /// name them (containerd's `ctr run`): for `ps`.
    fn running(&self) -> Vec<(ContainerRef, Vec<i32>)> {
        Vec::new()
    }
}

/// The runtimes gpusnap asks, in order.
pub fn runtimes() -> Vec<Box<dyn Runtime>> {
    vec![Box::new(Podman), Box::new(Containerd::from_env()), Box::new(Crio::from_env())]
}

/// Picks the one of `ids` that `want` names: the id itself, else the only
/// id it begins; `Ok(None)` when none; an error naming them when several.
fn pick<'a>(runtime: &str, want: &str, ids: &'a [String]) -> Result<Option<&'a String>, Error> {
    let exact: Vec<&String> = ids.iter().filter(|i| *i == want).collect();
    let found: Vec<&String> =
        if exact.is_empty() { ids.iter().filter(|i| i.starts_with(want)).collect() } else { exact };
    match found.as_slice() {
        [] => Ok(None),
        [one] => Ok(Some(one)),
        many => {
            let mut shown: Vec<String> = many.iter().take(4).map(|i| i.chars().take(16).collect()).collect();
            if many.len() > 4 {
                shown.push("...".into());
            }
            Err(Error::Container {
                name: want.into(),
                reason: format!(
                    "ambiguous: it names {} {runtime} containers ({}); give more of the id",
                    many.len(),
                    shown.join(", ")
                ),
            })
        }
    }
}

/// Whether process `pid` runs (exists and is not a zombie).
fn alive(pid: i32) -> bool {
    pid > 0
        && std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| s.rsplit_once(')').and_then(|(_, r)| r.trim_start().chars().next()))
            .is_some_and(|c| c != 'Z' && c != 'X')
}

/// The processes of a container whose first process is `pid` and whose id
/// is `id`: those in that process's cgroup or below it, on every hierarchy
/// where that cgroup names the id (`/NAMESPACE/ID` for `ctr run`,
/// `cri-containerd-ID.scope`); where none does (no cgroup of the
/// container's own: the cgroup would hold other processes), the tree of
/// `pid`.
pub fn cgroup_members(pid: i32, id: &str) -> Vec<i32> {
    let lines = |p: i32| -> Vec<(String, String)> {
        std::fs::read_to_string(format!("/proc/{p}/cgroup"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let mut f = l.splitn(3, ':');
                let (_, ctrl, path) = (f.next()?, f.next()?, f.next()?);
                Some((ctrl.to_string(), path.to_string()))
            })
            .collect()
    };
    // A part that is the id, or holds a long one (`cri-containerd-ID.scope`).
    let names = |part: &str, id: &str| part == id || (id.len() >= 12 && part.contains(id));
    if !alive(pid) {
        return Vec::new();
    }
    let own: Vec<(String, String)> =
        lines(pid).into_iter().filter(|(_, path)| path.split('/').any(|part| names(part, id))).collect();
    if own.is_empty() {
        return crate::tree::process_tree(pid).into_iter().map(|(p, _)| p).collect();
    }
    let under = |path: &str, top: &str| path == top || path.starts_with(&format!("{top}/"));
    all_pids()
        .into_iter()
        .filter(|&p| {
            let theirs = lines(p);
            own.iter().all(|(ctrl, top)| theirs.iter().any(|(c, path)| c == ctrl && under(path, top)))
        })
        .collect()
}

/// podman, through its command line (`podman container inspect`), with the
/// caller's environment (`CONTAINERS_CONF`, `CONTAINERS_STORAGE_CONF`).
pub struct Podman;

/// How long one question to a runtime may take, and how much it may answer.
const ASK_LIMIT: Duration = Duration::from_secs(30);
const ASK_BYTES: u64 = 4 << 20;

impl Runtime for Podman {
    fn name(&self) -> &'static str {
        "podman"
    }

    fn find(&self, name_or_id: &str) -> Result<Option<Found>, Error> {
        let Some((ok, out, err)) = ask("podman", &["container", "inspect", "--format", "json", name_or_id])?
        else {
            return Ok(None);
        };
        if !ok {
            if err.contains("no such") {
                return Ok(None);
            }
            return Err(Error::Container {
                name: name_or_id.into(),
                reason: format!("podman container inspect failed: {}", err.trim()),
            });
        }
        let v: serde_json::Value = serde_json::from_str(&out).map_err(|e| Error::Container {
            name: name_or_id.into(),
            reason: format!("podman container inspect: {e}"),
        })?;
        let Some(c) = v.as_array().and_then(|a| a.first()) else { return Ok(None) };
        let s = |v: &serde_json::Value| v.as_str().unwrap_or("").to_string();
        Ok(Some(Found {
            id: s(&c["Id"]),
            name: s(&c["Name"]),
            status: s(&c["State"]["Status"]),
            pid: c["State"]["Pid"].as_i64().unwrap_or(0) as i32,
        }))
    }

    fn names(&self) -> Vec<(String, String)> {
        let Ok(Some((true, out, _))) =
            ask("podman", &["ps", "--all", "--no-trunc", "--format", "{{.ID}} {{.Names}}"])
        else {
            return Vec::new();
        };
        out.lines()
            .filter_map(|l| l.split_once(' ').map(|(id, n)| (id.to_string(), n.trim().to_string())))
            .collect()
    }
}

/// Runs `prog args`, bounded in time and output: `None` when `prog` is not
/// installed, else (success, stdout, stderr).
fn ask(prog: &str, args: &[&str]) -> Result<Option<(bool, String, String)>, Error> {
    let mut child = match Command::new(prog)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(Error::Container {
                name: args.last().unwrap_or(&"").to_string(),
                reason: format!("{prog}: {e}"),
            })
        }
    };
    let drain = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            if let Some(r) = r {
                let _ = r.take(ASK_BYTES).read_to_string(&mut s);
            }
            s
        })
    };
    let out = drain(child.stdout.take().map(|r| Box::new(r) as Box<dyn Read + Send>));
    let err = drain(child.stderr.take().map(|r| Box::new(r) as Box<dyn Read + Send>));
    let end = Instant::now() + ASK_LIMIT;
    let status = loop {
        if let Ok(Some(st)) = child.try_wait() {
            break st;
        }
        if Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            return Err(Error::Container {
                name: args.last().unwrap_or(&"").to_string(),
                reason: format!("{prog} did not answer within {}s", ASK_LIMIT.as_secs()),
            });
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Ok(Some((status.success(), out.join().unwrap_or_default(), err.join().unwrap_or_default())))
}

/// Where a process lives: its cgroup and its container, recorded when
/// gpusnap suspends it, so that a process CRIU restored outside gpusnap
/// takes the record only from within the same container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// Its cgroup v2 path (the `0::` line of /proc/PID/cgroup), else the
    /// path of the first hierarchy listed.
    pub cgroup: String,
    /// `runtime:id` of its container ([`of_pid`]), None for a process of no
    /// container.
    pub container: Option<String>,
}

/// The placement of process `pid` (None when /proc cannot say).
pub fn placement(pid: i32) -> Option<Placement> {
    placement_of(&std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?)
}

fn placement_of(text: &str) -> Option<Placement> {
    let paths: Vec<(&str, &str)> = text
        .lines()
        .filter_map(|l| {
            let mut f = l.splitn(3, ':');
            Some((f.next()?, f.nth(1)?))
        })
        .collect();
    let cgroup = paths.iter().find(|(h, _)| *h == "0").or(paths.first())?.1.to_string();
    let container = of_cgroup_file(text).map(|c| format!("{}:{}", c.runtime, c.id));
    Some(Placement { cgroup, container })
}

/// The live processes placed as `at` says (the same cgroup and container).
pub fn placement_members(at: &Placement) -> Vec<i32> {
    all_pids().into_iter().filter(|&p| placement(p).as_ref() == Some(at)).collect()
}

/// The container of process `pid`, from the ids its cgroup paths name
/// (`libpod-ID`, `docker-ID.scope`, `/docker/ID`, `cri-containerd-ID.scope`,
/// `crio-ID.scope`); None for a process of no container.
pub fn of_pid(pid: i32) -> Option<ContainerRef> {
    of_cgroup_file(&std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?)
}

fn of_cgroup_file(text: &str) -> Option<ContainerRef> {
    text.lines().filter_map(|l| l.splitn(3, ':').nth(2)).find_map(of_cgroup_path)
}

fn of_cgroup_path(path: &str) -> Option<ContainerRef> {
    let parts: Vec<&str> = path.split('/').collect();
    for (i, part) in parts.iter().enumerate().rev() {
        let part = part.strip_suffix(".scope").unwrap_or(part);
        // conmon, podman's monitor, lives beside the container, not in it.
        if part.starts_with("libpod-conmon-") {
            return None;
        }
        let (runtime, id) = if let Some(id) = part.strip_prefix("libpod-") {
            ("podman", id)
        } else if let Some(id) = part.strip_prefix("docker-") {
            ("docker", id)
        } else if let Some(id) = part.strip_prefix("cri-containerd-") {
            ("containerd", id)
        } else if let Some(id) = part.strip_prefix("crio-") {
            ("cri-o", id)
        } else if i > 0 && parts[i - 1] == "docker" {
            ("docker", part)
        } else {
            continue;
        };
        if id.len() == 64 && id.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Some(ContainerRef { runtime, id: id.to_string(), name: None });
        }
    }
    None
}

/// The cgroup that freezes process `pid` (cgroup v2 `cgroup.freeze`, or
/// v1's freezer), when it is frozen or freezing: a paused container, or a
/// runtime's dump in progress. The driver hangs on a frozen process as on
/// a stopped one.
pub fn frozen(pid: i32) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    for l in text.lines() {
        let mut f = l.splitn(3, ':');
        let (_, ctrl, path) = (f.next()?, f.next()?, f.next()?);
        let rel = path.trim_start_matches('/');
        if ctrl.is_empty() {
            for root in ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"] {
                let p = std::path::Path::new(root).join(rel);
                if std::fs::read_to_string(p.join("cgroup.freeze")).is_ok_and(|s| s.trim() == "1") {
                    return Some(p.display().to_string());
                }
            }
        } else if ctrl.split(',').any(|c| c == "freezer") {
            let p = std::path::Path::new("/sys/fs/cgroup/freezer").join(rel);
            if std::fs::read_to_string(p.join("freezer.state")).is_ok_and(|s| s.trim() != "THAWED") {
                return Some(p.display().to_string());
            }
        }
    }
    None
}

/// Refuses a CRIU dump of process `pid` on its own when it runs in a
/// container with a mount namespace of its own: its mounts are the
/// runtime's (bind mounts from the host) and CRIU fails on them ("doesn't
/// have a proper root mount"); the runtime's checkpoint is the way.
pub fn refuse_lone_dump(pid: i32) -> Result<(), Error> {
    let Some(c) = of_pid(pid) else { return Ok(()) };
    let ns = |p: &str| std::fs::read_link(format!("/proc/{p}/ns/mnt")).ok();
    if ns(&pid.to_string()) == ns("self") {
        return Ok(());
    }
    Err(Error::Container {
        name: c.id.chars().take(12).collect(),
        reason: format!(
            "process {pid} runs in this {} container's mount namespace: CRIU cannot dump it alone (the runtime's mounts); checkpoint the whole container through its runtime ({} container checkpoint, with CRIU's CUDA plugin and gpusnap as cuda-checkpoint)",
            c.runtime, c.runtime
        ),
    })
}

/// A running container resolved: its id and its processes' host pids.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub runtime: &'static str,
    pub id: String,
    pub name: String,
    pub pids: Vec<i32>,
}

/// Resolves `name_or_id` through the runtimes gpusnap can ask. Unknown, a
/// container that does not run, a container of a runtime gpusnap cannot
/// ask: [`Error::Container`] (exit 2) with the reason.
pub fn resolve(name_or_id: &str) -> Result<Resolved, Error> {
    let bad = |reason: String| Error::Container { name: name_or_id.to_string(), reason };
    if name_or_id.is_empty() {
        return Err(bad("an empty name".into()));
    }
    let mut asked = Vec::new();
    for rt in runtimes() {
        asked.push(rt.name());
        let Some(f) = rt.find(name_or_id)? else { continue };
        if f.status == "paused" {
            return Err(bad(format!(
                "the {} container {} is paused: its cgroup is frozen and the driver hangs on frozen processes; unpause it first",
                rt.name(),
                f.name
            )));
        }
        if f.status != "running" || f.pid <= 0 {
            return Err(bad(format!("the {} container {} is {}, not running", rt.name(), f.name, f.status)));
        }
        let pids = rt.members(&f);
        return Ok(Resolved { runtime: rt.name(), id: f.id, name: f.name, pids });
    }
    // A container of another runtime, recognised by its processes' cgroups.
    let want = name_or_id.to_ascii_lowercase();
    if want.len() >= 12 && want.bytes().all(|b| b.is_ascii_hexdigit()) {
        if let Some(c) = all_pids().into_iter().filter_map(of_pid).find(|c| c.id.starts_with(&want)) {
            if !asked.contains(&c.runtime) {
                return Err(bad(format!(
                    "it is a {} container; gpusnap resolves containers of {} only: name its cgroup with --cgroup PATH",
                    c.runtime,
                    asked.join(", ")
                )));
            }
        }
    }
    Err(bad(format!("no such container (asked {})", asked.join(", "))))
}

/// The processes (host pids) whose cgroups name container `id`.
pub fn members(id: &str) -> Vec<i32> {
    all_pids().into_iter().filter(|&p| of_pid(p).is_some_and(|c| c.id == id)).collect()
}

fn all_pids() -> Vec<i32> {
    let mut v: Vec<i32> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    v.sort_unstable();
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "4e1dc2d6fbe29e50eac490ab5eb73f9cd22f5d0f9c33d1c4237cf2d897314223";

    #[test]
    fn names_the_container_of_each_runtime_layout() {
        let f = |p: &str| of_cgroup_path(p).map(|c| (c.runtime, c.id));
        assert_eq!(f(&format!("/libpod_parent/libpod-{ID}")), Some(("podman", ID.into())));
        assert_eq!(f(&format!("/machine.slice/libpod-{ID}.scope/container")), Some(("podman", ID.into())));
        assert_eq!(f(&format!("/system.slice/docker-{ID}.scope")), Some(("docker", ID.into())));
        assert_eq!(f(&format!("/docker/{ID}")), Some(("docker", ID.into())));
        assert_eq!(
            f(&format!("/kubepods.slice/kubepods-pod1.slice/cri-containerd-{ID}.scope")),
            Some(("containerd", ID.into()))
        );
        assert_eq!(f(&format!("/kubepods/crio-{ID}.scope")), Some(("cri-o", ID.into())));
        assert_eq!(f(&format!("/libpod_parent/libpod-conmon-{ID}")), None);
        assert_eq!(f("/user.slice/user-1000.slice/cron.service"), None);
        assert_eq!(f("/libpod_parent/libpod-abc"), None);
        let file = format!("12:memory:/process_api/x\n0::/libpod_parent/libpod-{ID}\n");
        assert_eq!(of_cgroup_file(&file).map(|c| c.runtime), Some("podman"));
    }

    #[test]
    fn a_placement_is_the_v2_cgroup_and_the_container() {
        let id = "a".repeat(64);
        let text = format!("12:pids:/docker/{id}\n0::/system.slice/docker-{id}.scope\n");
        let p = placement_of(&text).unwrap();
        assert_eq!(p.cgroup, format!("/system.slice/docker-{id}.scope"));
        assert_eq!(p.container, Some(format!("docker:{id}")));
        let p = placement_of("4:memory:/user.slice\n").unwrap();
        assert_eq!((p.cgroup.as_str(), p.container), ("/user.slice", None));
    }

    #[test]
    fn a_cgroup_that_does_not_name_the_container_gives_the_tree() {
        // This test's cgroups name no container "gpusnap-none": its tree.
        let me = std::process::id() as i32;
        let mut kid = std::process::Command::new("sleep").arg("600").spawn().unwrap();
        let members = cgroup_members(me, "gpusnap-none");
        let _ = kid.kill();
        let _ = kid.wait();
        assert!(members.contains(&me) && members.contains(&(kid.id() as i32)), "{members:?}");
        assert!(!members.contains(&1), "{members:?}");
        assert!(cgroup_members(i32::MAX, "x").is_empty());
    }
}
