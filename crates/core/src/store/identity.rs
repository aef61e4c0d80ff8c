//! Who a recorded process was (its executable, command line, time namespace
//! and the pid it has inside a pid namespace of its own), so that gpusnap
//! knows it again after CRIU restored it outside gpusnap: under the same pid
//! with a new start time (`criu restore`), or under a new host pid with the
//! same pid inside (a container runtime restoring into a new pid namespace).

use super::{now_ms, row_to_record, Record, Store};
use crate::container::Placement;
use crate::error::Error;
use crate::target::{Fingerprint, Target};
use rusqlite::{params, OptionalExtension, Transaction};

/// Records what `t` runs (`id`, read while `t` is alive) and its pid inside
/// its pid namespace when it has one of its own.
pub(super) fn insert(tx: &Transaction<'_>, t: &Target, id: &Fingerprint) -> rusqlite::Result<()> {
    tx.execute(
        "INSERT OR REPLACE INTO identities (pid, start_time, exe, cmdline, timens)
         VALUES (?1, ?2, ?3, ?4, ?5)",
        params![t.pid, t.start_time as i64, id.exe, id.cmdline, id.timens],
    )?;
    match crate::target::ns_pid(t.pid) {
        Some(inner) => tx.execute(
            "INSERT OR REPLACE INTO ns_pids (pid, start_time, ns_pid) VALUES (?1, ?2, ?3)",
            params![t.pid, t.start_time as i64, inner],
        )?,
        None => tx.execute(
            "DELETE FROM ns_pids WHERE pid = ?1 AND start_time = ?2",
            params![t.pid, t.start_time as i64],
        )?,
    };
    match crate::container::placement(t.pid) {
        Some(p) => tx.execute(
            "INSERT OR REPLACE INTO placements (pid, start_time, cgroup, container) VALUES (?1, ?2, ?3, ?4)",
            params![t.pid, t.start_time as i64, p.cgroup, p.container],
        )?,
        None => tx.execute(
            "DELETE FROM placements WHERE pid = ?1 AND start_time = ?2",
            params![t.pid, t.start_time as i64],
        )?,
    };
    Ok(())
}

/// Whether an error says the store predates a table (an older store opened
/// read-only, not migrated).
fn no_such_table(e: &rusqlite::Error) -> bool {
    matches!(e, rusqlite::Error::SqliteFailure(_, Some(m)) if m.contains("no such table"))
}

impl Store {
    /// What `pid` at `start` ran, when it was recorded.
    pub fn identity(&self, pid: i32, start: u64) -> Result<Option<Fingerprint>, Error> {
        self.conn
            .query_row(
                "SELECT exe, cmdline, timens FROM identities WHERE pid = ?1 AND start_time = ?2",
                params![pid, start as i64],
                |r| Ok(Fingerprint { exe: r.get(0)?, cmdline: r.get(1)?, timens: r.get(2)? }),
            )
            .optional()
            .or_else(|e| if no_such_table(&e) { Ok(None) } else { Err(e) })
            .map_err(|e| self.err(e))
    }

    /// The cgroup and container `pid` at `start` lived in, when recorded.
    pub fn placement(&self, pid: i32, start: u64) -> Result<Option<Placement>, Error> {
        self.conn
            .query_row(
                "SELECT cgroup, container FROM placements WHERE pid = ?1 AND start_time = ?2",
                params![pid, start as i64],
                |r| Ok(Placement { cgroup: r.get(0)?, container: r.get(1)? }),
            )
            .optional()
            .or_else(|e| if no_such_table(&e) { Ok(None) } else { Err(e) })
            .map_err(|e| self.err(e))
    }

    /// The records, locked or checkpointed, of processes that had the pid
    /// `inner` inside a pid namespace of their own: the candidates for a
    /// process CRIU restored into a new pid namespace. Newest first.
    pub fn checkpointed_with_ns_pid(&self, inner: i32) -> Result<Vec<Record>, Error> {
        let rows = (|| {
            let mut stmt = self.conn.prepare(
                "SELECT p.pid, p.start_time, p.comm, p.state, p.unrecoverable, p.updated_ms
                 FROM processes p JOIN ns_pids n ON n.pid = p.pid AND n.start_time = p.start_time
                 WHERE n.ns_pid = ?1 AND p.state IN ('checkpointed', 'locked')
                 ORDER BY p.updated_ms DESC",
            )?;
            let rows = stmt.query_map(params![inner], row_to_record)?.collect::<Result<Vec<_>, _>>();
            rows
        })();
        let rows = match rows {
            Err(e) if no_such_table(&e) => Vec::new(),
            other => other.map_err(|e| self.err(e))?,
        };
        rows.into_iter()
            .map(|mut r| {
                r.footprint = self.footprint(r.pid, r.start_time)?;
                Ok(r)
            })
            .collect()
    }

    /// Moves the record of `old` (its state, footprint and identity) to `t`,
    /// the same process brought back by CRIU (under the same pid with a new
    /// start time, or under a new pid in a new pid namespace), and journals
    /// the move, all in one transaction. The journal of the old process stays
    /// where it is (`history` shows both). A stuck mark is not carried over:
    /// the restored process's state is the image's, taken before whatever
    /// stranded the old one, and the driver judges it anew.
    pub fn adopt(&mut self, old: &Record, t: &Target, detail: &str) -> Result<(), Error> {
        let identity = crate::target::fingerprint(t.pid);
        let me = self.me.0;
        let tx = self
            .conn
            .transaction()
            .map_err(|e| Error::Store { path: self.path.display().to_string(), reason: e.to_string() })?;
        let res = (|| {
            let (from_pid, from, pid, to) = (old.pid, old.start_time as i64, t.pid, t.start_time as i64);
            tx.execute(
                "UPDATE processes SET pid = ?3, start_time = ?4, comm = ?5, unrecoverable = NULL, updated_ms = ?6
                 WHERE pid = ?1 AND start_time = ?2",
                params![from_pid, from, pid, to, t.comm, now_ms()],
            )?;
            tx.execute(
                "UPDATE footprints SET pid = ?3, start_time = ?4 WHERE pid = ?1 AND start_time = ?2",
                params![from_pid, from, pid, to],
            )?;
            tx.execute("DELETE FROM identities WHERE pid = ?1 AND start_time = ?2", params![from_pid, from])?;
            tx.execute("DELETE FROM ns_pids WHERE pid = ?1 AND start_time = ?2", params![from_pid, from])?;
            tx.execute("DELETE FROM placements WHERE pid = ?1 AND start_time = ?2", params![from_pid, from])?;
            insert(&tx, t, &identity)?;
            tx.execute(
                "INSERT INTO events (ts_ms, pid, start_time, op, phase, state, detail, actor)
                 VALUES (?1, ?2, ?3, 'adopt', 'note', ?4, ?5, ?6)",
                params![now_ms(), pid, to, old.state, detail, me],
            )?;
            tx.commit()
        })();
        res.map_err(|e| self.err(e))
    }
}
