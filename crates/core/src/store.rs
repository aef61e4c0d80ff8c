//! The embedded store: SQLite in the state directory.
//!
//! It holds what the driver does not remember for us: who a suspended process
//! was (pid + start time), how much device memory it needs back (footprint per
//! GPU), the journal of every driver call (written before and after the call,
//! so a crash leaves a `begin` without an end that the next run reconciles),
//! and the admission ledger (reservations of resumes in flight).

use crate::error::Error;
pub use crate::statedir::check_state_dir;
use crate::statedir::check_state_dir_only;
use crate::target::Target;
use rusqlite::{params, Connection, OpenFlags, OptionalExtension};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

mod identity;
mod ledger;

// 2: the identities table (what a recorded process ran, to know it again
// after a CRIU restore outside gpusnap). 3: ns_pids (its pid inside a pid
// namespace of its own, to know it again under a new host pid). 4:
// placements (its cgroup and container, so that only a process of the same
// container takes its record).
const SCHEMA_VERSION: i32 = 4;

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS processes (
    pid INTEGER NOT NULL,
    start_time INTEGER NOT NULL,
    comm TEXT NOT NULL,
    state TEXT NOT NULL,
    unrecoverable TEXT,
    updated_ms INTEGER NOT NULL,
    PRIMARY KEY (pid, start_time)
);
CREATE TABLE IF NOT EXISTS footprints (
    pid INTEGER NOT NULL,
    start_time INTEGER NOT NULL,
    gpu_uuid TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    PRIMARY KEY (pid, start_time, gpu_uuid)
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY,
    ts_ms INTEGER NOT NULL,
    pid INTEGER NOT NULL,
    start_time INTEGER NOT NULL,
    op TEXT NOT NULL,
    phase TEXT NOT NULL,
    begin_id INTEGER,
    state TEXT,
    detail TEXT,
    actor INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS events_target ON events (pid, start_time);
-- What a recorded process runs, to recognise it after a CRIU restore outside
-- gpusnap (same pid, new start time). A table of its own rather than new
-- columns, so that stores of older gpusnaps open unchanged.
CREATE TABLE IF NOT EXISTS identities (
    pid INTEGER NOT NULL,
    start_time INTEGER NOT NULL,
    exe TEXT,
    cmdline BLOB,
    timens TEXT,
    PRIMARY KEY (pid, start_time)
);
-- The pid a recorded process has inside a pid namespace of its own (a
-- container's): CRIU restores such a tree under new host pids, the same
-- pids inside.
CREATE TABLE IF NOT EXISTS ns_pids (
    pid INTEGER NOT NULL,
    start_time INTEGER NOT NULL,
    ns_pid INTEGER NOT NULL,
    PRIMARY KEY (pid, start_time)
);
CREATE INDEX IF NOT EXISTS ns_pids_inner ON ns_pids (ns_pid);
-- The cgroup and container (runtime:id) a recorded process lived in: a
-- process restored outside gpusnap takes the record only from within them.
CREATE TABLE IF NOT EXISTS placements (
    pid INTEGER NOT NULL,
    start_time INTEGER NOT NULL,
    cgroup TEXT NOT NULL,
    container TEXT,
    PRIMARY KEY (pid, start_time)
);
CREATE TABLE IF NOT EXISTS reservations (
    id INTEGER PRIMARY KEY,
    gpu_uuid TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    pid INTEGER NOT NULL,
    holder_pid INTEGER NOT NULL,
    holder_start INTEGER NOT NULL,
    created_ms INTEGER NOT NULL
);
";

pub fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

/// The record state of a process whose CUDA context faulted (its guard
/// found its lock answering a sticky error): it cannot be suspended.
pub const FAULTED: &str = "faulted";

/// The record state of a parked process: its fast-swap library holds its
/// memory in host memory; the driver runs it, its context on the GPU.
pub const PARKED: &str = "parked";

/// What gpusnap knows of one process.
#[derive(Debug, Clone, Serialize)]
pub struct Record {
    pub pid: i32,
    pub start_time: u64,
    pub comm: String,
    pub state: String,
    /// Why the process can no longer be restored in place, when it cannot.
    pub unrecoverable: Option<String>,
    pub updated_ms: i64,
    /// Device memory per GPU UUID when it was suspended.
    pub footprint: BTreeMap<String, u64>,
}

impl Record {
    pub fn footprint_bytes(&self) -> u64 {
        self.footprint.values().fold(0u64, |a, b| a.saturating_add(*b))
    }
}

/// One journal entry.
#[derive(Debug, Clone, Serialize)]
pub struct Event {
    pub ts_ms: i64,
    pub op: String,
    /// begin, ok, failed, or note.
    pub phase: String,
    pub state: Option<String>,
    pub detail: Option<String>,
}

/// A journal entry with its place in the journal and its process, for those
/// who follow the journal as it grows (the agent's `GET /v1/events`).
#[derive(Debug, Clone, Serialize)]
pub struct JournalEntry {
    pub id: i64,
    pub pid: i32,
    #[serde(flatten)]
    pub event: Event,
}

/// A journal entry left open by a gpusnap that died mid-call.
#[derive(Debug, Clone)]
pub struct Pending {
    pub id: i64,
    pub op: String,
}

pub struct Store {
    conn: Connection,
    path: PathBuf,
    /// This gpusnap process, to tell its reservations from dead ones'.
    me: (i32, u64),
}

impl Store {
    /// Opens (creating it with mode 0700) the state directory's database.
    pub fn open(dir: &Path) -> Result<Self, Error> {
        check_state_dir(dir)?;
        match Self::open_writable(dir) {
            // A state directory on a read-only filesystem (a snapshot, a
            // read-only mount into a container): what only reads still
            // works; a write says why it cannot.
            Err(e) if read_only_fs(dir) && dir.join("gpusnap.db").exists() => {
                tracing::info!("state store is read-only ({e}); opening it for reading");
                Self::open_read_only(dir)
            }
            other => other,
        }
    }

    fn open_writable(dir: &Path) -> Result<Self, Error> {
        let path = dir.join("gpusnap.db");
        let err = |reason: String| Error::Store { path: path.display().to_string(), reason };
        // Created 0600 before SQLite sees it (SQLite would use the umask;
        // its -wal and -shm files copy the database's mode).
        match gpusnap_files::create_private(&path) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(err(format!("cannot create: {e}"))),
        }
        let conn = Connection::open_with_flags(
            &path,
            OpenFlags::SQLITE_OPEN_READ_WRITE
                | OpenFlags::SQLITE_OPEN_NO_MUTEX
                | OpenFlags::SQLITE_OPEN_NOFOLLOW,
        )
        .map_err(|e| err(e.to_string()))?;
        conn.busy_timeout(busy_timeout()).map_err(|e| err(e.to_string()))?;
        // Switching to WAL needs the database to itself and does not wait on
        // the busy handler: two gpusnaps opening a new store together retry.
        // Asked only when not yet WAL: an open that writes nothing never
        // waits behind a writer.
        let mode: String =
            conn.pragma_query_value(None, "journal_mode", |r| r.get(0)).map_err(|e| err(e.to_string()))?;
        if !mode.eq_ignore_ascii_case("wal") {
            let mut tries = 0;
            while let Err(e) = conn.pragma_update(None, "journal_mode", "WAL") {
                tries += 1;
                if tries > 100 {
                    return Err(err(e.to_string()));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        conn.pragma_update(None, "synchronous", "NORMAL").map_err(|e| err(e.to_string()))?;
        let version: i32 =
            conn.pragma_query_value(None, "user_version", |r| r.get(0)).map_err(|e| err(e.to_string()))?;
        if version > SCHEMA_VERSION {
            return Err(err(format!(
                "written by a newer gpusnap (schema {version}, this one knows {SCHEMA_VERSION})"
            )));
        }
        // Migrated only when needed: every open writing the schema made
        // read-only commands wait behind any writer.
        if version < SCHEMA_VERSION {
            conn.execute_batch(SCHEMA).map_err(|e| err(e.to_string()))?;
            conn.pragma_update(None, "user_version", SCHEMA_VERSION).map_err(|e| err(e.to_string()))?;
        }
        Ok(Self { conn, path, me: me() })
    }

    /// Opens the database for reading only (history, listings): never
    /// writes, never waits behind a writer, and works on a read-only state
    /// directory. A state directory with no database yet reads as empty.
    pub fn open_read_only(dir: &Path) -> Result<Self, Error> {
        let path = dir.join("gpusnap.db");
        let err = |reason: String| Error::Store { path: path.display().to_string(), reason };
        if std::fs::symlink_metadata(dir).is_err() {
            let conn = Connection::open_in_memory().map_err(|e| err(e.to_string()))?;
            conn.execute_batch(SCHEMA).map_err(|e| err(e.to_string()))?;
            return Ok(Self { conn, path, me: me() });
        }
        check_state_dir_only(dir)?;
        if std::fs::symlink_metadata(&path).is_err() {
            let conn = Connection::open_in_memory().map_err(|e| err(e.to_string()))?;
            conn.execute_batch(SCHEMA).map_err(|e| err(e.to_string()))?;
            return Ok(Self { conn, path, me: me() });
        }
        let flags = OpenFlags::SQLITE_OPEN_READ_ONLY
            | OpenFlags::SQLITE_OPEN_NO_MUTEX
            | OpenFlags::SQLITE_OPEN_NOFOLLOW;
        let try_open = |conn: Connection| -> rusqlite::Result<Connection> {
            conn.busy_timeout(busy_timeout())?;
            let _: i32 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
            Ok(conn)
        };
        let conn = match Connection::open_with_flags(&path, flags).and_then(try_open) {
            Ok(c) => c,
            // A WAL database in a directory this process cannot write (no
            // -shm to share): read it as it is on disk.
            Err(_) => {
                let uri = format!("file:{}?immutable=1", path.display());
                Connection::open_with_flags(&uri, flags | OpenFlags::SQLITE_OPEN_URI)
                    .and_then(try_open)
                    .map_err(|e| err(e.to_string()))?
            }
        };
        let version: i32 =
            conn.pragma_query_value(None, "user_version", |r| r.get(0)).map_err(|e| err(e.to_string()))?;
        if version > SCHEMA_VERSION {
            return Err(err(format!(
                "written by a newer gpusnap (schema {version}, this one knows {SCHEMA_VERSION})"
            )));
        }
        if version == 0 {
            // Never written yet: as empty.
            let conn = Connection::open_in_memory().map_err(|e| err(e.to_string()))?;
            conn.execute_batch(SCHEMA).map_err(|e| err(e.to_string()))?;
            return Ok(Self { conn, path, me: me() });
        }
        Ok(Self { conn, path, me: me() })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The state directory.
    pub fn dir(&self) -> &Path {
        self.path.parent().unwrap_or(Path::new("."))
    }

    /// An exclusive, cross-process lock on driver calls for `pid`, so that
    /// two gpusnaps (a `stop` and a guard, say) never drive one process at
    /// the same time. Held until the returned file is dropped.
    pub fn lock_target(&self, pid: i32) -> Result<nix::fcntl::Flock<std::fs::File>, Error> {
        let dir = self.dir().join("locks");
        let err = |e: std::io::Error| Error::Store { path: dir.display().to_string(), reason: e.to_string() };
        std::fs::create_dir_all(&dir).map_err(err)?;
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join(pid.to_string()))
            .map_err(err)?;
        nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusive).map_err(|(_, e)| err(e.into()))
    }

    fn err(&self, e: rusqlite::Error) -> Error {
        Error::Store { path: self.path.display().to_string(), reason: e.to_string() }
    }

    /// Creates or updates the record of `t`, replacing its footprint when one is given.
    pub fn record(
        &mut self,
        t: &Target,
        state: &str,
        footprint: Option<&BTreeMap<String, u64>>,
    ) -> Result<(), Error> {
        // Read while the process is certainly the one `t` names (it is being
        // acted on); a process that is gone keeps what was recorded before.
        let identity =
            Some(crate::target::fingerprint(t.pid)).filter(|f| f.exe.is_some() && crate::target::is_alive(t));
        let tx = self
            .conn
            .transaction()
            .map_err(|e| Error::Store { path: self.path.display().to_string(), reason: e.to_string() })?;
        let res = (|| {
            tx.execute(
                "INSERT INTO processes (pid, start_time, comm, state, updated_ms) VALUES (?1, ?2, ?3, ?4, ?5)
                 ON CONFLICT (pid, start_time) DO UPDATE SET state = ?4, updated_ms = ?5",
                params![t.pid, t.start_time as i64, t.comm, state, now_ms()],
            )?;
            if let Some(id) = &identity {
                identity::insert(&tx, t, id)?;
            }
            if let Some(fp) = footprint {
                tx.execute(
                    "DELETE FROM footprints WHERE pid = ?1 AND start_time = ?2",
                    params![t.pid, t.start_time as i64],
                )?;
                for (uuid, bytes) in fp {
                    tx.execute(
                        "INSERT INTO footprints (pid, start_time, gpu_uuid, bytes) VALUES (?1, ?2, ?3, ?4)",
                        params![t.pid, t.start_time as i64, uuid, *bytes as i64],
                    )?;
                }
            }
            tx.commit()
        })();
        res.map_err(|e| self.err(e))
    }

    pub fn set_unrecoverable(&mut self, t: &Target, reason: &str) -> Result<(), Error> {
        self.conn
            .execute(
                "UPDATE processes SET unrecoverable = ?3, updated_ms = ?4 WHERE pid = ?1 AND start_time = ?2",
                params![t.pid, t.start_time as i64, reason, now_ms()],
            )
            .map(|_| ())
            .map_err(|e| self.err(e))
    }

    /// The record of exactly this process (pid and start time).
    pub fn get(&self, t: &Target) -> Result<Option<Record>, Error> {
        self.get_by(t.pid, Some(t.start_time))
    }

    /// The newest record under `pid`, whichever process it was.
    pub fn latest_for_pid(&self, pid: i32) -> Result<Option<Record>, Error> {
        self.get_by(pid, None)
    }

    pub(crate) fn get_by(&self, pid: i32, start: Option<u64>) -> Result<Option<Record>, Error> {
        let row = self
            .conn
            .query_row(
                "SELECT pid, start_time, comm, state, unrecoverable, updated_ms FROM processes
                 WHERE pid = ?1 AND (?2 IS NULL OR start_time = ?2) ORDER BY updated_ms DESC LIMIT 1",
                params![pid, start.map(|s| s as i64)],
                row_to_record,
            )
            .optional()
            .map_err(|e| self.err(e))?;
        match row {
            Some(mut r) => {
                r.footprint = self.footprint(r.pid, r.start_time)?;
                Ok(Some(r))
            }
            None => Ok(None),
        }
    }

    fn footprint(&self, pid: i32, start: u64) -> Result<BTreeMap<String, u64>, Error> {
        let mut stmt = self
            .conn
            .prepare_cached("SELECT gpu_uuid, bytes FROM footprints WHERE pid = ?1 AND start_time = ?2")
            .map_err(|e| self.err(e))?;
        let rows = stmt
            .query_map(params![pid, start as i64], |r| {
                Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)? as u64))
            })
            .map_err(|e| self.err(e))?;
        rows.collect::<Result<_, _>>().map_err(|e| self.err(e))
    }

    /// Every record, newest first.
    pub fn all(&self) -> Result<Vec<Record>, Error> {
        let mut stmt = self
            .conn
            .prepare(
                "SELECT pid, start_time, comm, state, unrecoverable, updated_ms FROM processes ORDER BY updated_ms DESC",
            )
            .map_err(|e| self.err(e))?;
        let rows: Vec<Record> = stmt
            .query_map([], row_to_record)
            .map_err(|e| self.err(e))?
            .collect::<Result<_, _>>()
            .map_err(|e| self.err(e))?;
        drop(stmt);
        rows.into_iter()
            .map(|mut r| {
                r.footprint = self.footprint(r.pid, r.start_time)?;
                Ok(r)
            })
            .collect()
    }

    /// Journals the start of `op` on `t`; returns the entry to close.
    pub fn begin(&mut self, t: &Target, op: &str) -> Result<i64, Error> {
        self.begin_entry(t, op, None)
    }

    /// The `begin` entry of `op` on `t`, with `detail` (NULL if none).
    fn begin_entry(&mut self, t: &Target, op: &str, detail: Option<&str>) -> Result<i64, Error> {
        self.conn
            .execute(
                "INSERT INTO events (ts_ms, pid, start_time, op, phase, detail, actor) VALUES (?1, ?2, ?3, ?4, 'begin', ?5, ?6)",
                params![now_ms(), t.pid, t.start_time as i64, op, detail, self.me.0],
            )
            .map_err(|e| self.err(e))?;
        Ok(self.conn.last_insert_rowid())
    }

    /// Closes a journal entry: `Ok(state)` after success, `Err(detail)` after failure.
    pub fn end(
        &mut self,
        begin_id: i64,
        t: &Target,
        op: &str,
        outcome: Result<&str, &str>,
    ) -> Result<(), Error> {
        let (phase, state, detail) = match outcome {
            Ok(s) => ("ok", Some(s), None),
            Err(d) => ("failed", None, Some(d)),
        };
        self.conn
            .execute(
                "INSERT INTO events (ts_ms, pid, start_time, op, phase, begin_id, state, detail, actor)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
                params![now_ms(), t.pid, t.start_time as i64, op, phase, begin_id, state, detail, self.me.0],
            )
            .map_err(|e| self.err(e))?;
        if let Some(s) = state {
            self.set_state(t, s)?;
        }
        Ok(())
    }

    /// The state a journal entry leaves `t` in.
    fn set_state(&mut self, t: &Target, state: &str) -> Result<(), Error> {
        self.conn
            .execute(
                "UPDATE processes SET state = ?3, updated_ms = ?4 WHERE pid = ?1 AND start_time = ?2",
                params![t.pid, t.start_time as i64, state, now_ms()],
            )
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    /// Journals a note that is not a driver call (reconciliation, verification, signals).
    pub fn note(&mut self, t: &Target, op: &str, state: Option<&str>, detail: &str) -> Result<(), Error> {
        self.conn
            .execute(
                "INSERT INTO events (ts_ms, pid, start_time, op, phase, state, detail, actor)
                 VALUES (?1, ?2, ?3, ?4, 'note', ?5, ?6, ?7)",
                params![now_ms(), t.pid, t.start_time as i64, op, state, detail, self.me.0],
            )
            .map_err(|e| self.err(e))?;
        if let Some(s) = state {
            self.set_state(t, s)?;
        }
        Ok(())
    }

    /// Journal entries on `t` that were begun by a gpusnap no longer running
    /// and never closed.
    pub fn pending(&self, t: &Target) -> Result<Vec<Pending>, Error> {
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT b.id, b.op, b.actor FROM events b WHERE b.pid = ?1 AND b.start_time = ?2 AND b.phase = 'begin'
                 AND b.op != 'hibernate' AND NOT EXISTS (SELECT 1 FROM events e WHERE e.begin_id = b.id)",
            )
            .map_err(|e| self.err(e))?;
        let rows: Vec<(i64, String, i32)> = stmt
            .query_map(params![t.pid, t.start_time as i64], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .map_err(|e| self.err(e))?
            .collect::<Result<_, _>>()
            .map_err(|e| self.err(e))?;
        let me = self.me.0;
        Ok(rows
            .into_iter()
            .filter(|(_, _, actor)| *actor != me && !pid_alive(*actor))
            .map(|(id, op, _)| Pending { id, op })
            .collect())
    }

    /// Journals the start of an operation that is not a driver call, with
    /// what its reconciliation needs to know; returns the entry to close.
    pub fn begin_with(&mut self, t: &Target, op: &str, detail: &str) -> Result<i64, Error> {
        self.begin_entry(t, op, Some(detail))
    }

    /// Closes an entry of [`Self::begin_with`], changing no recorded state.
    pub fn close(
        &mut self,
        begin_id: i64,
        t: &Target,
        op: &str,
        ok: bool,
        detail: &str,
    ) -> Result<(), Error> {
        self.conn
            .execute(
                "INSERT INTO events (ts_ms, pid, start_time, op, phase, begin_id, detail, actor)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
                params![
                    now_ms(),
                    t.pid,
                    t.start_time as i64,
                    op,
                    if ok { "ok" } else { "failed" },
                    begin_id,
                    detail,
                    self.me.0
                ],
            )
            .map(|_| ())
            .map_err(|e| self.err(e))
    }

    /// Entries of `op` begun by a gpusnap no longer running and never
    /// closed, on any process: (entry, process, detail).
    pub fn open_entries(&self, op: &str) -> Result<Vec<(i64, Target, String)>, Error> {
        let mut stmt = self
            .conn
            .prepare(
                "SELECT b.id, b.pid, b.start_time, COALESCE(p.comm, ''), COALESCE(b.detail, ''), b.actor FROM events b
                 LEFT JOIN processes p ON p.pid = b.pid AND p.start_time = b.start_time
                 WHERE b.op = ?1 AND b.phase = 'begin'
                 AND NOT EXISTS (SELECT 1 FROM events e WHERE e.begin_id = b.id) ORDER BY b.id",
            )
            .map_err(|e| self.err(e))?;
        let rows: Vec<(i64, i32, i64, String, String, i32)> = stmt
            .query_map(params![op], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?))
            })
            .map_err(|e| self.err(e))?
            .collect::<Result<_, _>>()
            .map_err(|e| self.err(e))?;
        let me = self.me.0;
        Ok(rows
            .into_iter()
            .filter(|r| r.5 != me && !pid_alive(r.5))
            .map(|(id, pid, st, comm, detail, _)| {
                (id, Target { pid, start_time: st as u64, comm, uid: 0 }, detail)
            })
            .collect())
    }

    /// The journal of `pid`, oldest first.
    pub fn history(&self, pid: i32) -> Result<Vec<Event>, Error> {
        let mut stmt = self
            .conn
            .prepare("SELECT ts_ms, op, phase, state, detail FROM events WHERE pid = ?1 ORDER BY id")
            .map_err(|e| self.err(e))?;
        let rows = stmt.query_map(params![pid], |r| event_at(r, 0)).map_err(|e| self.err(e))?;
        rows.collect::<Result<_, _>>().map_err(|e| self.err(e))
    }

    /// The newest journal entry's id (0 for an empty journal).
    pub fn last_event_id(&self) -> Result<i64, Error> {
        self.conn
            .query_row("SELECT COALESCE(MAX(id), 0) FROM events", [], |r| r.get(0))
            .map_err(|e| self.err(e))
    }

    /// Journal entries of every process after entry `after`, oldest first.
    pub fn events_after(&self, after: i64, limit: usize) -> Result<Vec<JournalEntry>, Error> {
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT id, pid, ts_ms, op, phase, state, detail FROM events WHERE id > ?1 ORDER BY id LIMIT ?2",
            )
            .map_err(|e| self.err(e))?;
        let rows = stmt
            .query_map(params![after, limit as i64], |r| {
                Ok(JournalEntry { id: r.get(0)?, pid: r.get(1)?, event: event_at(r, 2)? })
            })
            .map_err(|e| self.err(e))?;
        rows.collect::<Result<_, _>>().map_err(|e| self.err(e))
    }
}

fn row_to_record(r: &rusqlite::Row<'_>) -> rusqlite::Result<Record> {
    Ok(Record {
        pid: r.get(0)?,
        start_time: r.get::<_, i64>(1)? as u64,
        comm: r.get(2)?,
        state: r.get(3)?,
        unrecoverable: r.get(4)?,
        updated_ms: r.get(5)?,
        footprint: BTreeMap::new(),
    })
}

fn pid_alive(pid: i32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Is `dir` on a filesystem mounted read-only?
fn read_only_fs(dir: &Path) -> bool {
    nix::sys::statvfs::statvfs(dir).is_ok_and(|v| v.flags().contains(nix::sys::statvfs::FsFlags::ST_RDONLY))
}

fn me() -> (i32, u64) {
    let me_pid = std::process::id() as i32;
    let me_start =
        procfs::process::Process::myself().and_then(|p| p.stat()).map(|s| s.starttime).unwrap_or(0);
    (me_pid, me_start)
}

/// How long a writer waits for another (`GPUSNAP_DB_WAIT`, seconds;
/// default 60).
fn busy_timeout() -> Duration {
    let secs = std::env::var("GPUSNAP_DB_WAIT").ok().and_then(|s| s.parse::<u64>().ok()).unwrap_or(60);
    Duration::from_secs(secs)
}

/// The journal event in the columns `ts_ms, op, phase, state, detail` of
/// `r`, starting at column `first` (one reading for history and the stream).
fn event_at(r: &rusqlite::Row<'_>, first: usize) -> rusqlite::Result<Event> {
    Ok(Event {
        ts_ms: r.get(first)?,
        op: r.get(first + 1)?,
        phase: r.get(first + 2)?,
        state: r.get(first + 3)?,
        detail: r.get(first + 4)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(pid: i32, start: u64) -> Target {
        Target { pid, start_time: start, comm: "w".into(), uid: 0 }
    }

    #[test]
    fn records_and_footprints_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = Store::open(dir.path()).unwrap();
        let t = target(42, 100);
        let fp: BTreeMap<_, _> = [("GPU-a".to_string(), 5u64 << 30)].into();
        s.record(&t, "running", Some(&fp)).unwrap();
        let id = s.begin(&t, "lock").unwrap();
        s.end(id, &t, "lock", Ok("locked")).unwrap();
        let r = s.get(&t).unwrap().unwrap();
        assert_eq!(r.state, "locked");
        assert_eq!(r.footprint_bytes(), 5 << 30);
        assert!(s.get(&target(42, 101)).unwrap().is_none());
        assert_eq!(s.latest_for_pid(42).unwrap().unwrap().start_time, 100);
        assert!(s.pending(&t).unwrap().is_empty());
    }

    #[test]
    fn reservations_are_counted_and_released() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = Store::open(dir.path()).unwrap();
        let (ids, ()) = s
            .reserve(1, |held| {
                assert!(held.is_empty());
                Ok((vec![("GPU-a".into(), 10)], ()))
            })
            .unwrap();
        // A second store (another gpusnap process in real life) sees it.
        let mut s2 = Store::open(dir.path()).unwrap();
        s2.reserve(2, |held| {
            assert_eq!(held.get("GPU-a"), Some(&10));
            Ok((vec![], ()))
        })
        .unwrap();
        s.release(&ids).unwrap();
        s2.reserve(2, |held| {
            assert!(held.is_empty());
            Ok((vec![], ()))
        })
        .unwrap();
    }

    #[test]
    fn a_newer_schema_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        drop(Store::open(dir.path()).unwrap());
        let c = Connection::open(dir.path().join("gpusnap.db")).unwrap();
        c.pragma_update(None, "user_version", 99).unwrap();
        drop(c);
        let err = Store::open(dir.path()).err().unwrap();
        assert!(err.to_string().contains("newer gpusnap"), "{err}");
    }
}
