//! The shared directory: `config.json`, `state.json`, `journal.log`, the
//! bytes programs wrote to device memory (`mem/<pid>/<ptr>`, `host/<pid>/`
//! while checkpointed) and the locks that keep concurrent processes from
//! losing each other's updates.

use std::fs::{self, File, OpenOptions};
use std::io::{self, ErrorKind, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};

use crate::codes::CuResult;
use crate::config::{Config, Injection};
use crate::state::State;
use crate::{now_ms, procfs};

/// Where the fakes keep their state unless `GPUSNAP_FAKE_DIR` says otherwise.
pub const DEFAULT_DIR: &str = "/tmp/gpusnap-fake";

/// A handle on the shared directory. Cheap: it holds only the path, and reads
/// the environment when made, so make one per call.
#[derive(Debug, Clone)]
pub struct Store {
    dir: PathBuf,
}

/// A read-modify-write of the config and state under the directory's lock.
pub struct Txn {
    pub config: Config,
    pub state: State,
    config_dirty: bool,
}

impl Txn {
    /// Takes one firing of the injection for `call` on `pid`, if any; a count
    /// going down is written back to `config.json`.
    pub fn take_injection(&mut self, call: &str, pid: i32) -> Option<Injection> {
        let fired = self.config.take_injection(call, pid);
        self.config_dirty |= fired.as_ref().is_some_and(|f| f.count.is_some());
        fired
    }
}

impl Store {
    pub fn from_env() -> Self {
        let dir = std::env::var_os("GPUSNAP_FAKE_DIR")
            .filter(|d| !d.is_empty())
            .map_or_else(|| PathBuf::from(DEFAULT_DIR), PathBuf::from);
        Self::at(dir)
    }

    pub fn at(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    /// Runs `f` on the config and state while holding the exclusive lock, after
    /// dropping the entries of processes that are gone; writes back what
    /// changed.
    pub fn transact<T>(&self, f: impl FnOnce(&mut Txn) -> T) -> io::Result<T> {
        let _lock = self.lock_file(&self.dir.join("lock"))?;
        let config = self.load_config()?;
        let state_path = self.dir.join("state.json");
        let old_text = match fs::read_to_string(&state_path) {
            Ok(text) => text,
            Err(e) if e.kind() == ErrorKind::NotFound => String::new(),
            Err(e) => return Err(e),
        };
        let state = if old_text.is_empty() {
            State::default()
        } else {
            serde_json::from_str(&old_text).map_err(|e| bad_file(&state_path, e))?
        };
        let mut txn = Txn { config, state, config_dirty: false };
        // The caller is alive by definition. It must not judge itself by its
        // start time: a CRIU-restored process lives in its own time namespace,
        // where /proc shows it a different start time than everyone else sees.
        let me = procfs::self_pid();
        // From inside another time namespace (a CRIU-restored process) every
        // start time in /proc is shifted: judge liveness by existence only.
        let own_clock = procfs::in_initial_time_namespace();
        let alive = |pid: i32, start: u64| {
            pid == me
                || if own_clock {
                    procfs::is_same_live_process(pid, start)
                } else {
                    procfs::stat(pid).is_some_and(|s| !s.is_dead())
                }
        };
        for pid in txn.state.collect_garbage(alive) {
            self.remove_data(pid);
        }

        let out = f(&mut txn);

        // Only write what changed: most transactions are the polls of blocked
        // CUDA calls and of NVML, which change nothing.
        let new_text = serde_json::to_string_pretty(&txn.state).map_err(io::Error::other)?;
        if new_text != old_text {
            write_atomically(&state_path, new_text.as_bytes())?;
        }
        if txn.config_dirty {
            let text = serde_json::to_string_pretty(&txn.config).map_err(io::Error::other)?;
            write_atomically(&self.dir.join("config.json"), text.as_bytes())?;
        }
        Ok(out)
    }

    /// The state as last written, read without the lock (every write is an
    /// atomic rename, so a read sees one whole version). For polls that only
    /// look: a process stopped (by CRIU, a debugger) while holding the lock
    /// would stall every other caller, and a CUDA process that is waiting to
    /// be resumed polls all the time.
    pub fn peek_state(&self) -> io::Result<State> {
        let path = self.dir.join("state.json");
        match fs::read_to_string(&path) {
            Ok(text) if !text.is_empty() => serde_json::from_str(&text).map_err(|e| bad_file(&path, e)),
            Ok(_) => Ok(State::default()),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(State::default()),
            Err(e) => Err(e),
        }
    }

    /// The config alone. Callers that also need the state use [`transact`],
    /// which reads it under the lock.
    ///
    /// [`transact`]: Store::transact
    pub fn load_config(&self) -> io::Result<Config> {
        let path = self.dir.join("config.json");
        let mut config: Config = match fs::read_to_string(&path) {
            Ok(text) => serde_json::from_str(&text).map_err(|e| bad_file(&path, e))?,
            Err(e) if e.kind() == ErrorKind::NotFound => Config::default(),
            Err(e) => return Err(e),
        };
        config.normalize();
        Ok(config)
    }

    /// Serialises the checkpoint-API calls on one process, as the driver does,
    /// without holding the directory lock through their sleeps (which would
    /// stall NVML and every other process meanwhile).
    pub fn lock_target(&self, pid: i32) -> io::Result<Flock<File>> {
        let dir = self.dir.join("locks");
        fs::create_dir_all(&dir)?;
        self.lock_file(&dir.join(pid.to_string()))
    }

    /// Appends `<unix_ms> <caller_pid> <call> <target_pid> <rc>` to the
    /// journal. One `write` on an `O_APPEND` file, so lines from concurrent
    /// processes do not interleave.
    pub fn journal(&self, call: &str, target: i32, rc: CuResult) -> io::Result<()> {
        self.journal_line(call, target, &rc.to_string())
    }

    /// Appends a note in the journal's shape, `<unix_ms> <caller_pid> <what>
    /// <target_pid> <word>`, with a word where a call has its rc: what a
    /// restore read in the host copy (`restore_data ... ok`, see
    /// `hostcopy::Verdict`). Readers that parse the last field as a number
    /// skip it.
    pub fn journal_note(&self, what: &str, target: i32, word: &str) -> io::Result<()> {
        self.journal_line(what, target, word)
    }

    fn journal_line(&self, call: &str, target: i32, last: &str) -> io::Result<()> {
        fs::create_dir_all(&self.dir)?;
        let line = format!("{} {} {call} {target} {last}\n", now_ms(), std::process::id());
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("journal.log"))?
            .write_all(line.as_bytes())
    }

    /// Where the data of `pid` lives: device memory (`mem/`) or, once
    /// checkpointed, host memory (`host/`).
    pub fn data_dir(&self, pid: i32, on_host: bool) -> PathBuf {
        self.dir.join(if on_host { "host" } else { "mem" }).join(pid.to_string())
    }

    fn data_file(&self, pid: i32, base: u64) -> PathBuf {
        self.data_dir(pid, false).join(format!("{base:x}"))
    }

    /// Stores bytes a program wrote at `offset` into its allocation `base`.
    /// Files are sparse: only what was written takes space.
    pub fn write_data(&self, pid: i32, base: u64, offset: u64, bytes: &[u8]) -> io::Result<()> {
        fs::create_dir_all(self.data_dir(pid, false))?;
        let file =
            OpenOptions::new().create(true).write(true).truncate(false).open(self.data_file(pid, base))?;
        file.write_all_at(bytes, offset)
    }

    /// Reads `len` bytes at `offset` of allocation `base`; never-written bytes
    /// read as zero.
    pub fn read_data(&self, pid: i32, base: u64, offset: u64, len: usize) -> io::Result<Vec<u8>> {
        let mut out = vec![0u8; len];
        let file = match File::open(self.data_file(pid, base)) {
            Ok(f) => f,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(out),
            Err(e) => return Err(e),
        };
        let mut done = 0;
        while done < len {
            match file.read_at(&mut out[done..], offset + done as u64) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

    /// Forgets the bytes of a freed allocation.
    pub fn drop_data(&self, pid: i32, base: u64) -> io::Result<()> {
        match fs::remove_file(self.data_file(pid, base)) {
            Err(e) if e.kind() != ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    /// Moves a process's data between device and host memory (checkpoint and
    /// restore).
    pub fn move_data(&self, pid: i32, to_host: bool) -> io::Result<()> {
        let from = self.data_dir(pid, !to_host);
        let to = self.data_dir(pid, to_host);
        if !from.exists() {
            return Ok(());
        }
        if to.exists() {
            fs::remove_dir_all(&to)?;
        }
        fs::create_dir_all(to.parent().expect("data dirs have a parent"))?;
        fs::rename(from, to)
    }

    /// Deletes everything stored for `pid` (its process is gone).
    /// Where processes in a pid namespace of their own keep their marks.
    pub fn ids_dir(&self) -> PathBuf {
        self.dir.join("ids")
    }

    /// Gives the data of `from` (on the device and on the host) to `to`.
    pub fn rename_data(&self, from: i32, to: i32) -> io::Result<()> {
        for on_host in [false, true] {
            let a = self.data_dir(from, on_host);
            if a.exists() {
                let b = self.data_dir(to, on_host);
                let _ = fs::remove_dir_all(&b);
                fs::rename(&a, &b)?;
            }
        }
        Ok(())
    }

    pub fn remove_data(&self, pid: i32) {
        for on_host in [false, true] {
            let _ = fs::remove_dir_all(self.data_dir(pid, on_host));
        }
    }

    fn lock_file(&self, path: &Path) -> io::Result<Flock<File>> {
        fs::create_dir_all(&self.dir)?;
        let mut file = OpenOptions::new().create(true).truncate(false).write(true).open(path)?;
        loop {
            match Flock::lock(file, FlockArg::LockExclusive) {
                Ok(lock) => return Ok(lock),
                Err((f, Errno::EINTR)) => file = f,
                Err((_, e)) => return Err(e.into()),
            }
        }
    }
}

fn bad_file(path: &Path, e: serde_json::Error) -> io::Error {
    io::Error::new(ErrorKind::InvalidData, format!("{}: {e}", path.display()))
}

/// Writes through a temporary file and a rename, so that a process killed
/// mid-write leaves the old file, not half a new one.
fn write_atomically(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let tmp = path.with_extension("json.tmp");
    fs::write(&tmp, bytes)?;
    fs::rename(tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::Proc;

    #[test]
    fn transactions_persist_and_collect_dead_processes() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::at(dir.path());
        let me = std::process::id() as i32;
        let start = procfs::stat(me).unwrap().start_time;

        store
            .transact(|t| {
                assert_eq!(t.config.gpus.len(), 1);
                t.state.procs.insert(me, Proc::new(start));
                // Pid 0 never names a process: this entry is gone next time.
                t.state.procs.insert(0, Proc::new(1));
            })
            .unwrap();
        store.write_data(0, 16, 0, b"x").unwrap();
        assert!(store.data_dir(0, false).exists());

        let pids = store.transact(|t| t.state.procs.keys().copied().collect::<Vec<_>>()).unwrap();
        assert_eq!(pids, vec![me]);
        assert!(!store.data_dir(0, false).exists());
        // Nothing injected, so the config file was never written.
        assert!(!dir.path().join("config.json").exists());
    }

    #[test]
    fn injections_are_written_back() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("config.json"), r#"{"inject":[{"call":"lock","rc":2,"count":1}]}"#)
            .unwrap();
        let store = Store::at(dir.path());
        let fired = store.transact(|t| t.take_injection("lock", 5)).unwrap();
        assert_eq!(fired.unwrap().rc, 2);
        assert!(store.load_config().unwrap().inject.is_empty());
    }

    #[test]
    fn corrupt_files_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("state.json"), "{not json").unwrap();
        let err = Store::at(dir.path()).transact(|_| ()).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidData);
    }

    #[test]
    fn data_is_sparse_and_moves_between_device_and_host() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::at(dir.path());
        store.write_data(7, 0x100, 4, b"abcd").unwrap();
        assert_eq!(store.read_data(7, 0x100, 2, 8).unwrap(), b"\0\0abcd\0\0");
        assert_eq!(store.read_data(7, 0x200, 0, 2).unwrap(), b"\0\0");

        store.move_data(7, true).unwrap();
        assert!(store.data_dir(7, true).join("100").exists());
        assert_eq!(store.read_data(7, 0x100, 4, 4).unwrap(), b"\0\0\0\0");
        store.move_data(7, false).unwrap();
        assert_eq!(store.read_data(7, 0x100, 4, 4).unwrap(), b"abcd");

        store.drop_data(7, 0x100).unwrap();
        store.drop_data(7, 0x100).unwrap();
        assert_eq!(store.read_data(7, 0x100, 4, 4).unwrap(), b"\0\0\0\0");
    }

    #[test]
    fn journal_lines_have_five_fields() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::at(dir.path().join("new"));
        store.journal("lock", 42, 0).unwrap();
        store.journal("unlock", 42, 401).unwrap();
        store.journal_note("restore_data", 42, "zeros:3").unwrap();
        let text = fs::read_to_string(dir.path().join("new/journal.log")).unwrap();
        let lines: Vec<Vec<&str>> = text.lines().map(|l| l.split(' ').collect()).collect();
        assert_eq!(lines.len(), 3);
        assert_eq!(lines[1][1..], [std::process::id().to_string().as_str(), "unlock", "42", "401"]);
        assert_eq!(lines[2][2..], ["restore_data", "42", "zeros:3"]);
    }
}
