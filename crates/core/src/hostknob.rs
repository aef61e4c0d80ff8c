//! Host-wide settings that gpusnap switches for the length of one operation
//! and puts back: transparent huge pages for a checkpoint (`--thp`,
//! [`crate::thp`]) and `fs.pipe-max-size` for a dump (`--big-pipes`,
//! [`BigPipes`]). Each is opt-in: while it is switched, every process of
//! the host sees it.
//!
//! Crash safety: the previous value is journaled in `STATE_DIR/NAME.json`
//! before the switch, with the gpusnaps that want it switched now (several
//! may overlap: the last one out switches back). A gpusnap that dies leaves
//! its pid there; [`reconcile`], run by every gpusnap command, drops dead
//! owners and switches back when none is left.

use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum KnobError {
    #[error("{what}: {path}: {err}")]
    Io { what: &'static str, path: String, err: String },
}

/// One host setting: a file under /sys or /proc, its journal's name, how
/// its value reads, and whether a value already gives what is wanted.
pub struct Knob {
    /// The journal's name (`STATE_DIR/NAME.json`, `NAME.lock`).
    pub name: &'static str,
    /// For messages.
    pub what: &'static str,
    /// The file, and a variable that points it elsewhere (tests).
    path: &'static str,
    path_env: &'static str,
    /// The value in the file's text.
    parse: fn(&str) -> String,
    /// Whether `current` gives `want` already (nothing to switch).
    enough: fn(current: &str, want: &str) -> bool,
}

/// Transparent huge pages: the selected mode (`always [madvise] never` is `madvise`).
pub static THP: Knob = Knob {
    name: "thp",
    what: "transparent huge pages",
    path: "/sys/kernel/mm/transparent_hugepage/enabled",
    path_env: "GPUSNAP_THP_SYSFS",
    parse: |s| {
        let sel = s.split_whitespace().find(|w| w.starts_with('[')).or_else(|| s.split_whitespace().next());
        sel.unwrap_or("").trim_matches(['[', ']']).to_string()
    },
    enough: |current, want| current == want,
};

/// The largest pipe a process without CAP_SYS_RESOURCE may ask for.
pub static PIPE_MAX: Knob = Knob {
    name: "pipe-max-size",
    what: "fs.pipe-max-size",
    path: "/proc/sys/fs/pipe-max-size",
    path_env: "GPUSNAP_PIPE_MAX_SYSCTL",
    parse: |s| s.trim().to_string(),
    enough: |current, want| match (current.parse::<u64>(), want.parse::<u64>()) {
        (Ok(c), Ok(w)) => c >= w,
        _ => false,
    },
};

/// Every knob, for [`reconcile`].
static KNOBS: [&Knob; 2] = [&THP, &PIPE_MAX];

impl Knob {
    fn path(&self) -> PathBuf {
        std::env::var_os(self.path_env).map(PathBuf::from).unwrap_or_else(|| PathBuf::from(self.path))
    }

    fn err(&self, path: &Path, e: impl ToString) -> KnobError {
        KnobError::Io { what: self.what, path: path.display().to_string(), err: e.to_string() }
    }

    /// The value now.
    pub fn get(&self) -> Result<String, KnobError> {
        let p = self.path();
        let s = std::fs::read_to_string(&p).map_err(|e| self.err(&p, e))?;
        Ok((self.parse)(&s))
    }

    fn set(&self, v: &str) -> Result<(), KnobError> {
        let p = self.path();
        let mut f =
            std::fs::OpenOptions::new().write(true).truncate(true).open(&p).map_err(|e| self.err(&p, e))?;
        f.write_all(v.as_bytes()).map_err(|e| self.err(&p, e))?;
        tracing::debug!(value = v, "{} switched", self.what);
        Ok(())
    }

    /// Runs `f` on the record under an exclusive lock of `NAME.lock`; the
    /// record is written back atomically, or removed when `f` leaves it
    /// without owners.
    fn with_record<T>(
        &self,
        state_dir: &Path,
        f: impl FnOnce(&mut Option<Record>) -> Result<T, KnobError>,
    ) -> Result<T, KnobError> {
        use nix::fcntl::{Flock, FlockArg};
        let _ = std::fs::create_dir_all(state_dir);
        let lock_path = state_dir.join(format!("{}.lock", self.name));
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| self.err(&lock_path, e))?;
        let _held = Flock::lock(lock, FlockArg::LockExclusive).map_err(|(_, e)| self.err(&lock_path, e))?;
        let path = self.record_path(state_dir);
        let mut rec: Option<Record> = std::fs::read(&path).ok().and_then(|b| serde_json::from_slice(&b).ok());
        let out = f(&mut rec)?;
        match rec {
            Some(r) if !r.owners.is_empty() => {
                let tmp = state_dir.join(format!("{}.json.tmp", self.name));
                std::fs::write(&tmp, serde_json::to_vec(&r).unwrap_or_default())
                    .map_err(|e| self.err(&tmp, e))?;
                std::fs::rename(&tmp, &path).map_err(|e| self.err(&path, e))?;
            }
            _ => {
                let _ = std::fs::remove_file(&path);
            }
        }
        Ok(out)
    }

    fn record_path(&self, state_dir: &Path) -> PathBuf {
        state_dir.join(format!("{}.json", self.name))
    }

    /// Puts back the value of a switch whose gpusnaps all died; the value
    /// put back, if any.
    pub fn reconcile(&self, state_dir: &Path) -> Result<Option<String>, KnobError> {
        if !self.record_path(state_dir).exists() {
            return Ok(None);
        }
        self.with_record(state_dir, |rec| {
            let Some(r) = rec.as_mut() else { return Ok(None) };
            r.owners.retain(alive);
            if r.owners.is_empty() {
                tracing::warn!(
                    value = r.previous,
                    "a gpusnap that switched {} died: switching it back",
                    self.what
                );
                self.set(&r.previous)?;
                return Ok(Some(r.previous.clone()));
            }
            Ok(None)
        })
    }
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Record {
    /// The value to put back.
    previous: String,
    /// gpusnaps that switched it (pid, start time).
    owners: Vec<(i32, u64)>,
}

fn me() -> (i32, u64) {
    let pid = std::process::id() as i32;
    (pid, crate::target::resolve(pid).map(|t| t.start_time).unwrap_or(0))
}

fn alive(o: &(i32, u64)) -> bool {
    crate::target::resolve(o.0).is_ok_and(|t| t.start_time == o.1)
}

/// Puts back every knob whose switching gpusnaps all died.
pub fn reconcile(state_dir: &Path) -> Vec<KnobError> {
    KNOBS.iter().filter_map(|k| k.reconcile(state_dir).err()).collect()
}

/// A knob at `want` until dropped (then what it was, unless another
/// gpusnap still holds it switched).
pub struct Switched {
    knob: &'static Knob,
    state_dir: PathBuf,
}

impl Switched {
    pub fn on(state_dir: &Path, knob: &'static Knob, want: &str) -> Result<Self, KnobError> {
        knob.reconcile(state_dir)?;
        knob.with_record(state_dir, |rec| {
            match rec {
                Some(r) => r.owners.push(me()),
                None => {
                    let previous = knob.get()?;
                    if (knob.enough)(&previous, want) {
                        // Nothing to switch, nothing to put back.
                        return Ok(());
                    }
                    // Journaled before the switch: a crash right after it
                    // is put right by the next gpusnap.
                    *rec = Some(Record { previous, owners: vec![me()] });
                }
            }
            Ok(())
        })?;
        let me = Self { knob, state_dir: state_dir.to_path_buf() };
        knob.with_record(state_dir, |rec| match rec {
            Some(_) => knob.set(want),
            None => Ok(()),
        })?;
        Ok(me)
    }

    fn off(&self) -> Result<(), KnobError> {
        let mine = me();
        let knob = self.knob;
        knob.with_record(&self.state_dir, |rec| {
            let Some(r) = rec.as_mut() else { return Ok(()) };
            // One entry per switch: a long-lived gpusnap (the agent) may
            // hold several at once, and only its last one switches back.
            if let Some(i) = r.owners.iter().position(|o| *o == mine) {
                r.owners.remove(i);
            }
            r.owners.retain(alive);
            if r.owners.is_empty() {
                knob.set(&r.previous)?;
            }
            Ok(())
        })
    }
}

impl Drop for Switched {
    fn drop(&mut self) {
        if let Err(e) = self.off() {
            tracing::error!(
                "could not switch {} back: {e} (the next gpusnap command tries again)",
                self.knob.what
            );
        }
    }
}

/// The pipe size a FIFO of a dump asks for (the dump's FIFOs, in gpusnap-hibernate), and what
/// `--big-pipes` raises `fs.pipe-max-size` to.
pub const BIG_PIPE: u64 = 64 << 20;

/// Does this process hold CAP_SYS_RESOURCE (pipes above `fs.pipe-max-size`)?
pub fn can_exceed_pipe_max() -> bool {
    const CAP_SYS_RESOURCE: u32 = 24;
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let hex = s.lines().find_map(|l| l.strip_prefix("CapEff:"))?.trim().to_string();
            u64::from_str_radix(&hex, 16).ok()
        })
        .is_some_and(|caps| caps & (1 << CAP_SYS_RESOURCE) != 0)
}

/// `--big-pipes` (or `GPUSNAP_DUMP_BIG_PIPES=1`): `fs.pipe-max-size` at
/// [`BIG_PIPE`] for the length of a dump, so that CRIU's pipes (8 per
/// batch of pages, each up to ~3.2 MiB) and the FIFOs they are spliced
/// into get their size where gpusnap (and so CRIU) lacks CAP_SYS_RESOURCE,
/// as in many containers. There, every pipe is held to the sysctl's 1 MiB
/// by default: CRIU drains and writes its pages in batches of 8 MiB, each
/// waiting for the FIFO's reader to take all but 1 MiB of it. Nothing is
/// switched where gpusnap holds CAP_SYS_RESOURCE (the pipes get their size
/// anyway) or the sysctl is high enough.
pub struct BigPipes(#[allow(dead_code)] Option<Switched>);

/// The variable that asks for [`BigPipes`] without the flag.
pub const BIG_PIPES_ENV: &str = "GPUSNAP_DUMP_BIG_PIPES";

impl BigPipes {
    pub fn on(state_dir: &Path) -> Result<Self, KnobError> {
        if can_exceed_pipe_max() {
            tracing::debug!("CAP_SYS_RESOURCE held: the pipes get their size without --big-pipes");
            return Ok(Self(None));
        }
        Switched::on(state_dir, &PIPE_MAX, &BIG_PIPE.to_string()).map(|s| Self(Some(s)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The only test of this binary that reads the variables.
    #[test]
    fn switches_are_journaled_and_put_back_after_the_last_holder() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        // THP: the agent suspends two services at once, one process, two owners.
        let file = dir.path().join("enabled");
        std::fs::write(&file, "always [madvise] never\n").unwrap();
        std::env::set_var(THP.path_env, &file);
        let a = Switched::on(&state, &THP, "always").unwrap();
        assert_eq!(THP.get().unwrap(), "always");
        let b = Switched::on(&state, &THP, "always").unwrap();
        drop(a);
        assert_eq!(THP.get().unwrap(), "always", "switched back while the second checkpoint runs");
        assert!(state.join("thp.json").exists());
        drop(b);
        assert_eq!(THP.get().unwrap(), "madvise");
        assert!(!state.join("thp.json").exists());

        // fs.pipe-max-size: raised, then put back; a value high enough
        // already is left alone and journals nothing.
        let sysctl = dir.path().join("pipe-max-size");
        std::fs::write(&sysctl, "1048576\n").unwrap();
        std::env::set_var(PIPE_MAX.path_env, &sysctl);
        let s = Switched::on(&state, &PIPE_MAX, &BIG_PIPE.to_string()).unwrap();
        assert_eq!(PIPE_MAX.get().unwrap(), BIG_PIPE.to_string());
        let rec: Record =
            serde_json::from_slice(&std::fs::read(state.join("pipe-max-size.json")).unwrap()).unwrap();
        assert_eq!(rec.previous, "1048576");
        drop(s);
        assert_eq!(PIPE_MAX.get().unwrap(), "1048576");
        std::fs::write(&sysctl, "134217728\n").unwrap();
        let s = Switched::on(&state, &PIPE_MAX, &BIG_PIPE.to_string()).unwrap();
        assert!(!state.join("pipe-max-size.json").exists());
        drop(s);
        assert_eq!(PIPE_MAX.get().unwrap(), "134217728");

        // A switch whose gpusnap died (a pid that is no more) is put back
        // by the next command's reconcile.
        std::fs::write(&sysctl, "67108864\n").unwrap();
        let dead = Record { previous: "1048576".into(), owners: vec![(i32::MAX - 1, 1)] };
        std::fs::write(state.join("pipe-max-size.json"), serde_json::to_vec(&dead).unwrap()).unwrap();
        assert!(reconcile(&state).is_empty());
        assert_eq!(PIPE_MAX.get().unwrap(), "1048576");
        assert!(!state.join("pipe-max-size.json").exists());
    }
}
