//! The guard files in the state directory: whom each guard guards, for
//! `hibernate` (to ask it to let go) and for its keeper.

use gpusnap_core::error::Error;
use gpusnap_wire::guard::{Answer, Request};
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The guard's record of whom it guards, for `hibernate` (to ask it to let
/// go) and for its keeper (to re-attach a new guard if it dies).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GuardFile {
    pub guard_pid: i32,
    pub name: Option<String>,
    pub leader: i32,
    pub processes: Vec<i32>,
    pub socket: PathBuf,
}

impl GuardFile {
    /// Writes the record at `path` under a temporary name and renames it:
    /// a reader (hibernate, a keeper) never sees half of one.
    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, serde_json::to_vec(self).map_err(std::io::Error::other)?)?;
        std::fs::rename(&tmp, path)
    }
}

/// The guards' directory's name in the state directory.
pub(crate) const GUARDS: &str = "guards";

pub fn guards_dir(state_dir: &Path) -> PathBuf {
    state_dir.join(GUARDS)
}

/// Creates `dir` (the guards' sockets live there) readable by its owner
/// only, and checks an existing one (not a link, this user's; made private
/// on its descriptor): a socket is bound before its mode can be set, so the
/// directory is what keeps other users out.
pub fn private_dir(dir: &Path) -> Result<(), Error> {
    let fail = |why: String| Error::Proc {
        pid: std::process::id() as i32,
        reason: format!("{}: {why}", dir.display()),
    };
    let (Some(parent), Some(name)) = (dir.parent(), dir.file_name().and_then(|n| n.to_str())) else {
        return Err(fail("not a directory's path".into()));
    };
    std::fs::create_dir_all(parent).map_err(|e| fail(e.to_string()))?;
    gpusnap_files::PrivateDir::open(parent, name)
        .map(drop)
        .map_err(|e| Error::Proc { pid: std::process::id() as i32, reason: e.to_string() })
}

/// Every live guard's record.
pub fn live_guards(state_dir: &Path) -> Vec<GuardFile> {
    let Ok(rd) = std::fs::read_dir(guards_dir(state_dir)) else { return Vec::new() };
    rd.filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
        .filter_map(|e| serde_json::from_slice::<GuardFile>(&std::fs::read(e.path()).ok()?).ok())
        .filter(|g| Path::new(&format!("/proc/{}", g.guard_pid)).exists())
        .collect()
}

/// Asks the guards of `pids` to detach from them (before CRIU seizes the
/// tree). Returns the pids that were guarded.
pub fn detach_for(state_dir: &Path, pids: &[i32]) -> Result<Vec<i32>, Error> {
    let mut out = Vec::new();
    for g in live_guards(state_dir) {
        let mine: Vec<i32> = pids.iter().copied().filter(|p| g.processes.contains(p)).collect();
        if mine.is_empty() {
            continue;
        }
        let fail = |why: String| Error::Proc {
            pid: g.guard_pid,
            reason: format!("cannot ask the guard to detach: {why}"),
        };
        let mut s = UnixStream::connect(&g.socket).map_err(|e| fail(e.to_string()))?;
        s.set_read_timeout(Some(Duration::from_secs(30))).ok();
        let line = Request::Detach { pids: mine.clone() }.encode();
        s.write_all(line.as_bytes()).map_err(|e| fail(e.to_string()))?;
        let mut reply = String::new();
        BufReader::new(&s).read_line(&mut reply).map_err(|e| fail(e.to_string()))?;
        if Answer::parse(&reply) != Ok(Answer::Ok) {
            return Err(fail(reply.trim().to_string()));
        }
        out.extend(mine);
    }
    Ok(out)
}
