//! The admission ledger: reservations of resumes in flight, per GPU. Kept
//! apart from the records and the journal because it is the one part of the
//! store that must be cross-process exclusive: the decision and its
//! reservation are taken in one immediate transaction.

use super::{now_ms, Store};
use crate::error::Error;
use rusqlite::{params, TransactionBehavior};
use std::collections::BTreeMap;

impl Store {
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
