//! The embedded store: SQLite in the state directory.
//!
//! It holds what the driver does not remember for us: who a suspended process
//! was (pid + start time), how much device memory it needs back (footprint per
//! GPU), the journal of every driver call (written before and after the call,
//! so a crash leaves a `begin` without an end that the next run reconciles),
//! and the admission ledger (reservations of resumes in flight).

use crate::error::Error;
use crate::target::Target;
use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const SCHEMA_VERSION: i32 = 1;

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
        self.footprint.values().sum()
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
        let path = dir.join("gpusnap.db");
        let err = |reason: String| Error::Store { path: path.display().to_string(), reason };
        create_private_dir(dir).map_err(|e| err(format!("cannot create {}: {e}", dir.display())))?;
        let conn = Connection::open(&path).map_err(|e| err(e.to_string()))?;
        conn.busy_timeout(Duration::from_secs(60)).map_err(|e| err(e.to_string()))?;
        // Switching to WAL needs the database to itself and does not wait on
        // the busy handler: two gpusnaps opening a new store together retry.
        let mut tries = 0;
        while let Err(e) = conn.pragma_update(None, "journal_mode", "WAL") {
            tries += 1;
            if tries > 100 {
                return Err(err(e.to_string()));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        conn.pragma_update(None, "synchronous", "NORMAL").map_err(|e| err(e.to_string()))?;
        let version: i32 =
            conn.pragma_query_value(None, "user_version", |r| r.get(0)).map_err(|e| err(e.to_string()))?;
        if version > SCHEMA_VERSION {
            return Err(err(format!(
                "written by a newer gpusnap (schema {version}, this one knows {SCHEMA_VERSION})"
            )));
        }
        conn.execute_batch(SCHEMA).map_err(|e| err(e.to_string()))?;
        conn.pragma_update(None, "user_version", SCHEMA_VERSION).map_err(|e| err(e.to_string()))?;
        let me_pid = std::process::id() as i32;
        let me_start =
            procfs::process::Process::myself().and_then(|p| p.stat()).map(|s| s.starttime).unwrap_or(0);
        Ok(Self { conn, path, me: (me_pid, me_start) })
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

    fn get_by(&self, pid: i32, start: Option<u64>) -> Result<Option<Record>, Error> {
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
        self.conn
            .execute(
                "INSERT INTO events (ts_ms, pid, start_time, op, phase, actor) VALUES (?1, ?2, ?3, ?4, 'begin', ?5)",
                params![now_ms(), t.pid, t.start_time as i64, op, self.me.0],
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
            self.conn
                .execute(
                    "UPDATE processes SET state = ?3, updated_ms = ?4 WHERE pid = ?1 AND start_time = ?2",
                    params![t.pid, t.start_time as i64, s, now_ms()],
                )
                .map_err(|e| self.err(e))?;
        }
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
            self.conn
                .execute(
                    "UPDATE processes SET state = ?3, updated_ms = ?4 WHERE pid = ?1 AND start_time = ?2",
                    params![t.pid, t.start_time as i64, s, now_ms()],
                )
                .map_err(|e| self.err(e))?;
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
                 AND NOT EXISTS (SELECT 1 FROM events e WHERE e.begin_id = b.id)",
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

    /// The journal of `pid`, oldest first.
    pub fn history(&self, pid: i32) -> Result<Vec<Event>, Error> {
        let mut stmt = self
            .conn
            .prepare("SELECT ts_ms, op, phase, state, detail FROM events WHERE pid = ?1 ORDER BY id")
            .map_err(|e| self.err(e))?;
        let rows = stmt
            .query_map(params![pid], |r| {
                Ok(Event {
                    ts_ms: r.get(0)?,
                    op: r.get(1)?,
                    phase: r.get(2)?,
                    state: r.get(3)?,
                    detail: r.get(4)?,
                })
            })
            .map_err(|e| self.err(e))?;
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
                Ok(JournalEntry {
                    id: r.get(0)?,
                    pid: r.get(1)?,
                    event: Event {
                        ts_ms: r.get(2)?,
                        op: r.get(3)?,
                        phase: r.get(4)?,
                        state: r.get(5)?,
                        detail: r.get(6)?,
                    },
                })
            })
            .map_err(|e| self.err(e))?;
        rows.collect::<Result<_, _>>().map_err(|e| self.err(e))
    }

    /// Runs `decide` inside an exclusive (cross-process) transaction with the
    /// bytes that live reservations hold per GPU, and records the
    /// reservations it returns. Two gpusnaps can never both count the same
    /// free memory: the second waits for the first to commit and then sees its
    /// reservation.
    pub fn reserve<T>(
        &mut self,
        pid: i32,
        decide: impl FnOnce(&BTreeMap<String, u64>) -> Result<(Vec<(String, u64)>, T), Error>,
    ) -> Result<(Vec<i64>, T), Error> {
        let path = self.path.display().to_string();
        let serr = |e: rusqlite::Error| Error::Store { path: path.clone(), reason: e.to_string() };
        let me = self.me;
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate).map_err(serr)?;
        // Reservations of gpusnaps that died are void.
        let holders: Vec<(i64, i32, i64)> = {
            let mut stmt =
                tx.prepare("SELECT id, holder_pid, holder_start FROM reservations").map_err(serr)?;
            let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?))).map_err(serr)?;
            rows.collect::<Result<_, _>>().map_err(serr)?
        };
        for (id, hp, hs) in holders {
            let alive = procfs::process::Process::new(hp)
                .and_then(|p| p.stat())
                .is_ok_and(|s| s.starttime as i64 == hs);
            if !alive {
                tx.execute("DELETE FROM reservations WHERE id = ?1", params![id]).map_err(serr)?;
            }
        }
        let mut held: BTreeMap<String, u64> = BTreeMap::new();
        {
            let mut stmt = tx
                .prepare("SELECT gpu_uuid, SUM(bytes) FROM reservations GROUP BY gpu_uuid")
                .map_err(serr)?;
            let rows = stmt
                .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)? as u64)))
                .map_err(serr)?;
            for row in rows {
                let (u, b) = row.map_err(serr)?;
                held.insert(u, b);
            }
        }
        let (want, out) = decide(&held)?;
        let mut ids = Vec::new();
        for (uuid, bytes) in want {
            tx.execute(
                "INSERT INTO reservations (gpu_uuid, bytes, pid, holder_pid, holder_start, created_ms)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                params![uuid, bytes as i64, pid, me.0, me.1 as i64, now_ms()],
            )
            .map_err(serr)?;
            ids.push(tx.last_insert_rowid());
        }
        tx.commit().map_err(serr)?;
        Ok((ids, out))
    }

    pub fn release(&mut self, ids: &[i64]) -> Result<(), Error> {
        for id in ids {
            self.conn
                .execute("DELETE FROM reservations WHERE id = ?1", params![id])
                .map_err(|e| self.err(e))?;
        }
        Ok(())
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

fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    if dir.is_dir() {
        return Ok(());
    }
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)
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
