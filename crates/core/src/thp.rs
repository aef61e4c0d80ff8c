//! `--thp`: transparent huge pages `always` for the length of a checkpoint.
//!
//! The driver's checkpoint copies device memory into anonymous host memory
//! that it does not allocate through libc (an LD_PRELOAD madvise hook and
//! glibc's hugetlb tunable did not help, measured), so only the host-wide
//! setting makes it huge-page backed: with `always` checkpoint ran 3.1-3.5
//! GB/s against 1.6-2.4 GB/s with `madvise` on an H200 (gpu-facts.md). The
//! price: for as long as it is on, every process of the host gets huge pages
//! where it did not ask for them (more memory per sparse mapping, khugepaged
//! work), which is why it is opt-in and switched back at once.
//!
//! Crash safety: the previous mode is journaled in `STATE_DIR/thp.json`
//! before the switch, with the pids of the gpusnaps that want `always` now
//! (several may overlap: the last one out switches back). A gpusnap that dies
//! leaves its pid there; [`reconcile`], run by every gpusnap command, drops
//! dead owners and switches back when none is left.

use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The sysfs file; tests point it elsewhere.
pub const SYSFS_ENV: &str = "GPUSNAP_THP_SYSFS";
const SYSFS: &str = "/sys/kernel/mm/transparent_hugepage/enabled";

#[derive(Debug, thiserror::Error)]
pub enum ThpError {
    #[error("transparent huge pages: {path}: {err}")]
    Io { path: String, err: String },
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Record {
    /// The mode to put back.
    previous: String,
    /// gpusnaps that switched it (pid, start time).
    owners: Vec<(i32, u64)>,
}

fn sysfs() -> PathBuf {
    std::env::var_os(SYSFS_ENV).map(PathBuf::from).unwrap_or_else(|| PathBuf::from(SYSFS))
}

fn io(path: &Path, e: impl ToString) -> ThpError {
    ThpError::Io { path: path.display().to_string(), err: e.to_string() }
}

/// The selected mode: `always [madvise] never` gives `madvise`.
pub fn mode() -> Result<String, ThpError> {
    let p = sysfs();
    let s = std::fs::read_to_string(&p).map_err(|e| io(&p, e))?;
    let sel = s.split_whitespace().find(|w| w.starts_with('[')).or_else(|| s.split_whitespace().next());
    Ok(sel.unwrap_or("").trim_matches(['[', ']']).to_string())
}

fn set_mode(m: &str) -> Result<(), ThpError> {
    let p = sysfs();
    let mut f = std::fs::OpenOptions::new().write(true).truncate(true).open(&p).map_err(|e| io(&p, e))?;
    f.write_all(m.as_bytes()).map_err(|e| io(&p, e))?;
    tracing::debug!(mode = m, "transparent huge pages switched");
    Ok(())
}

fn me() -> (i32, u64) {
    let pid = std::process::id() as i32;
    (pid, crate::target::resolve(pid).map(|t| t.start_time).unwrap_or(0))
}

fn alive(o: &(i32, u64)) -> bool {
    crate::target::resolve(o.0).is_ok_and(|t| t.start_time == o.1)
}

/// Runs `f` on the record under an exclusive lock of the state dir's
/// `thp.lock`; the record is written back atomically, or removed when
/// `f` leaves it without owners.
fn with_record<T>(
    state_dir: &Path,
    f: impl FnOnce(&mut Option<Record>) -> Result<T, ThpError>,
) -> Result<T, ThpError> {
    use nix::fcntl::{Flock, FlockArg};
    let _ = std::fs::create_dir_all(state_dir);
    let lock_path = state_dir.join("thp.lock");
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|e| io(&lock_path, e))?;
    let _held = Flock::lock(lock, FlockArg::LockExclusive).map_err(|(_, e)| io(&lock_path, e))?;
    let path = state_dir.join("thp.json");
    let mut rec: Option<Record> = std::fs::read(&path).ok().and_then(|b| serde_json::from_slice(&b).ok());
    let out = f(&mut rec)?;
    match rec {
        Some(r) if !r.owners.is_empty() => {
            let tmp = state_dir.join("thp.json.tmp");
            std::fs::write(&tmp, serde_json::to_vec(&r).unwrap_or_default()).map_err(|e| io(&tmp, e))?;
            std::fs::rename(&tmp, &path).map_err(|e| io(&path, e))?;
        }
        _ => {
            let _ = std::fs::remove_file(&path);
        }
    }
    Ok(out)
}

/// Puts back the mode of a switch whose gpusnaps all died; returns the mode
/// put back, if any.
pub fn reconcile(state_dir: &Path) -> Result<Option<String>, ThpError> {
    if !state_dir.join("thp.json").exists() {
        return Ok(None);
    }
    with_record(state_dir, |rec| {
        let Some(r) = rec.as_mut() else { return Ok(None) };
        r.owners.retain(alive);
        if r.owners.is_empty() {
            tracing::warn!(
                mode = r.previous,
                "a gpusnap that switched transparent huge pages died: switching them back"
            );
            set_mode(&r.previous)?;
            return Ok(Some(r.previous.clone()));
        }
        Ok(None)
    })
}

/// THP `always` until dropped (then what it was, unless another gpusnap
/// still wants `always`).
pub struct Always {
    state_dir: PathBuf,
}

impl Always {
    pub fn on(state_dir: &Path) -> Result<Self, ThpError> {
        reconcile(state_dir)?;
        with_record(state_dir, |rec| {
            match rec {
                Some(r) => r.owners.push(me()),
                None => {
                    let previous = mode()?;
                    if previous == "always" {
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
        if let Err(e) = with_record(state_dir, |rec| match rec {
            Some(_) => set_mode("always"),
            None => Ok(()),
        }) {
            let _ = Self { state_dir: state_dir.to_path_buf() }.off();
            return Err(e);
        }
        Ok(Self { state_dir: state_dir.to_path_buf() })
    }

    fn off(&self) -> Result<(), ThpError> {
        let mine = me();
        with_record(&self.state_dir, |rec| {
            let Some(r) = rec.as_mut() else { return Ok(()) };
            // One entry per switch: a long-lived gpusnap (the agent) may
            // hold several at once, and only its last one switches back.
            if let Some(i) = r.owners.iter().position(|o| *o == mine) {
                r.owners.remove(i);
            }
            r.owners.retain(alive);
            if r.owners.is_empty() {
                set_mode(&r.previous)?;
            }
            Ok(())
        })
    }
}

impl Drop for Always {
    fn drop(&mut self) {
        if let Err(e) = self.off() {
            tracing::error!(
                "could not switch transparent huge pages back: {e} (the next gpusnap command tries again)"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_process_holding_two_switches_puts_the_mode_back_after_the_last() {
        // The agent suspends two services at once: one process, two owners.
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("enabled");
        std::fs::write(&file, "always [madvise] never\n").unwrap();
        // The only test of this binary that reads the variable.
        std::env::set_var(SYSFS_ENV, &file);
        let state = dir.path().join("state");
        let a = Always::on(&state).unwrap();
        assert_eq!(mode().unwrap(), "always");
        let b = Always::on(&state).unwrap();
        drop(a);
        assert_eq!(mode().unwrap(), "always", "switched back while the second checkpoint runs");
        assert!(state.join("thp.json").exists());
        drop(b);
        assert_eq!(mode().unwrap(), "madvise");
        assert!(!state.join("thp.json").exists());
    }
}
