//! Progress of long driver calls, reported to whatever the front end shows.

use std::time::Duration;

/// Receives progress of one long operation at a time.
pub trait Progress: Send + Sync {
    fn begin(&self, label: &str, total_bytes: u64);
    fn update(&self, done_bytes: u64);
    fn end(&self);
    /// Whether anything is shown: when not, nothing is sampled either.
    fn enabled(&self) -> bool {
        true
    }
    /// Another display of the same kind, shown beside this one: for the
    /// members of a group that work at the same time.
    fn sibling(&self) -> Box<dyn Progress> {
        Box::new(Quiet)
    }
}

/// Shows nothing (`--json`, pipes, tests).
pub struct Quiet;

impl Progress for Quiet {
    fn begin(&self, _: &str, _: u64) {}
    fn update(&self, _: u64) {}
    fn end(&self) {}
    fn enabled(&self) -> bool {
        false
    }
}

/// Runs `work` while a side thread samples `probe` every 100 ms and reports
/// what it returns. The driver's calls are opaque, so progress is observed
/// from outside: the target's resident memory grows by what checkpoint has
/// copied, and the GPU's used memory by what restore has put back.
pub fn observe<T>(
    progress: &dyn Progress,
    label: &str,
    total: u64,
    probe: impl Fn() -> Option<u64> + Send,
    work: impl FnOnce() -> T,
) -> T {
    if !progress.enabled() {
        return work();
    }
    progress.begin(label, total);
    // The sampler sleeps on a channel: dropping the sender when the work
    // ends wakes it at once, so observing adds no latency to the work.
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let out = std::thread::scope(|s| {
        s.spawn(move || loop {
            if let Some(done) = probe() {
                progress.update(done.min(total));
            }
            if done_rx.recv_timeout(Duration::from_millis(100))
                != Err(std::sync::mpsc::RecvTimeoutError::Timeout)
            {
                break;
            }
        });
        let out = work();
        drop(done_tx);
        out
    });
    progress.end();
    out
}
