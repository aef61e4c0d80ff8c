//! What a lazy wake's page server reports.

use crate::options::Options;
use crate::pacer::PaceStats;
use serde::Serialize;

/// What a lazy wake's page server did: the figures that tell where the
/// driver's restore waited (docs/design/wake.md, "Reading the report").
#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    /// Processes whose memory was served (forks during the wake included).
    pub processes: usize,
    pub forks: usize,
    /// Bytes in place (copied, or already there).
    pub bytes: u64,
    pub zero_pages: u64,
    /// From the server's start (just before CRIU's restore) until every
    /// page was in place and seen so by the waiter.
    pub ms: u64,
    /// Page faults read from the userfaultfds.
    pub faults: u64,
    /// Of those, faults on a piece a fill had in flight: the faulting thread
    /// waited for that fill's WAKE.
    pub faults_in_flight: u64,
    /// Of those, faults below the same process's previous fault (memory not
    /// read in address order).
    pub faults_backward: u64,
    /// Bytes brought in by faults, and by the background fill.
    pub fault_bytes: u64,
    pub fill_bytes: u64,
    /// Pages a fill found already there (EEXIST: another thread, a fault
    /// or a fork's copy was first).
    pub eexist_pages: u64,
    /// From the server's start until CRIU said the restore was done (the
    /// background fill starts then).
    pub restore_done_ms: Option<u64>,
    pub first_fault_ms: Option<u64>,
    pub last_fault_ms: Option<u64>,
    /// From the server's start until the last page went in.
    pub last_page_ms: u64,
    /// Bytes per second from the restore's end to the last page, in GB/s.
    pub fill_gbps: f64,
    /// Time the fault threads spent answering faults (read, copy, wake),
    /// summed over processes.
    pub fault_busy_ms: u64,
    /// Time all threads spent reading the image, and copying into
    /// processes, summed over threads.
    pub read_ms: u64,
    pub copy_ms: u64,
    /// Bytes the fill copied straight from where the source holds them
    /// ([`crate::PagesFile::map_at`]), not read into its buffer first.
    pub in_place_bytes: u64,
    /// Pieces of memory to fill when the processes were handed over (a
    /// lazy area each, or part of one), summed over processes.
    pub pieces: u64,
    /// Time the fill threads spent taking their next batch and giving it
    /// back done (the processes' piece lists, under their locks), and
    /// waiting with nothing to take, summed over threads.
    pub book_ms: u64,
    pub nap_ms: u64,
    /// Time the fill threads were held back by the pace to the reader,
    /// summed over threads.
    pub pace_wait_ms: u64,
    /// What the pace to the reader did (None: the fill was not paced).
    pub pace: Option<PaceStats>,
    /// The settings this wake ran with.
    pub options: Option<Options>,
}
