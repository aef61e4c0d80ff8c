//! CRIU's own account of a dump (`stats-dump`, written by every
//! `criu dump` into its images directory): where the dump's time went.
//!
//! Read with prost over CRIU's `stats.proto` (vendored from CRIU 4.2). The
//! file is a service image: IMG_SERVICE_MAGIC, STATS_MAGIC, then one
//! `stats_entry` (criu/stats.c `write_stats`).

use crate::image::{entries_after, pb, IMG_SERVICE_MAGIC};
use crate::PagesError;
use prost::Message;
use serde::Serialize;
use std::path::Path;

const STATS_MAGIC: u32 = 0x5709_3306;

/// The dump's stages, in milliseconds, and its page counts (4 KiB pages).
///
/// CRIU's timers nest (criu/mem.c): `memdump` (per process: the parasite
/// draining the pages into pipes, and the writing) holds `memwrite` (the
/// pipes spliced into `pages-N.img`); both are inside `frozen` (from the
/// freeze until the tree is let go or killed).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct DumpStats {
    pub freezing_ms: u64,
    pub frozen_ms: u64,
    pub memdump_ms: u64,
    pub memwrite_ms: u64,
    /// `memdump` less `memwrite`: the parasite's draining.
    pub drain_ms: u64,
    pub pages_scanned: u64,
    pub pages_written: u64,
    pub pages_lazy: u64,
    pub page_pipes: u64,
    pub page_pipe_bufs: u64,
    pub shpages_written: u64,
}

impl DumpStats {
    /// The rate CRIU wrote pages at while writing, in GB/s.
    pub fn write_gbps(&self) -> f64 {
        rate(self.pages_written, self.memwrite_ms)
    }
    /// The rate of the whole memory dump (draining and writing), in GB/s.
    pub fn memdump_gbps(&self) -> f64 {
        rate(self.pages_written, self.memdump_ms)
    }
}

fn rate(pages: u64, ms: u64) -> f64 {
    if ms == 0 {
        0.0
    } else {
        (pages * crate::sys::PAGE) as f64 / (ms as f64 * 1e6)
    }
}

/// CRIU's statistics of the dump in `images`; `Ok(None)` when CRIU wrote
/// none (an old CRIU, or a dump that failed before the end).
pub fn dump_stats(images: &Path) -> Result<Option<DumpStats>, PagesError> {
    let path = images.join("stats-dump");
    if !path.exists() {
        return Ok(None);
    }
    let bad = |why: String| PagesError::Image { path: path.display().to_string(), why };
    let ents = entries_after(&path, IMG_SERVICE_MAGIC, STATS_MAGIC)?;
    let Some(first) = ents.first() else { return Ok(None) };
    let e = pb::StatsEntry::decode(first.as_slice()).map_err(|e| bad(e.to_string()))?;
    let Some(d) = e.dump else { return Ok(None) };
    let ms = |us: u32| u64::from(us) / 1000;
    Ok(Some(DumpStats {
        freezing_ms: ms(d.freezing_time),
        frozen_ms: ms(d.frozen_time),
        memdump_ms: ms(d.memdump_time),
        memwrite_ms: ms(d.memwrite_time),
        drain_ms: ms(d.memdump_time.saturating_sub(d.memwrite_time)),
        pages_scanned: d.pages_scanned,
        pages_written: d.pages_written,
        pages_lazy: d.pages_lazy,
        page_pipes: d.page_pipes.unwrap_or(0),
        page_pipe_bufs: d.page_pipe_bufs.unwrap_or(0),
        shpages_written: d.shpages_written.unwrap_or(0),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_what_criu_writes() {
        let d = tempfile::tempdir().unwrap();
        let e = pb::StatsEntry {
            dump: Some(pb::DumpStatsEntry {
                freezing_time: 1500,
                frozen_time: 9_000_000,
                memdump_time: 8_000_000,
                memwrite_time: 5_000_000,
                pages_scanned: 1000,
                pages_skipped_parent: 0,
                pages_written: 900,
                irmap_resolve: Some(0),
                pages_lazy: 0,
                page_pipes: Some(1),
                page_pipe_bufs: Some(2),
                shpages_scanned: Some(0),
                shpages_skipped_parent: Some(0),
                shpages_written: Some(3),
            }),
            restore: None,
        };
        let body = e.encode_to_vec();
        let mut f = Vec::new();
        f.extend_from_slice(&IMG_SERVICE_MAGIC.to_ne_bytes());
        f.extend_from_slice(&STATS_MAGIC.to_ne_bytes());
        f.extend_from_slice(&(body.len() as u32).to_ne_bytes());
        f.extend_from_slice(&body);
        std::fs::write(d.path().join("stats-dump"), &f).unwrap();
        let s = dump_stats(d.path()).unwrap().unwrap();
        assert_eq!(
            (s.freezing_ms, s.frozen_ms, s.memdump_ms, s.memwrite_ms, s.drain_ms),
            (1, 9000, 8000, 5000, 3000)
        );
        assert_eq!((s.pages_written, s.shpages_written), (900, 3));
        // No file: no statistics, not an error; a foreign file: an error.
        assert_eq!(dump_stats(&d.path().join("none")).unwrap(), None);
        std::fs::write(d.path().join("stats-dump"), b"garbage!garbage!").unwrap();
        assert!(dump_stats(d.path()).is_err());
    }
}
