//! Pacing the background fill to the reader: the fill writes the image into
//! the woken process no faster than the driver's restore reads it.
//!
//! Why (docs/benchmarks.md, "What slows the driver's restore"):
//! the driver's restore of a checkpointed CUDA process is one thread of
//! that process copying its host memory into the GPU's staging buffers at
//! 6-10 GB/s, CPU-bound. Measured on the H200 (`bench/gpu/contend.sh`,
//! another process loading the memory beside a bare driver restore), reads
//! beside it do not slow it (8 threads reading 42 GB/s: none), but writes
//! do: copies at 13 GB/s (what the fill does at full speed) took its restore
//! from ~5.1 to 6.4 s, 31 GB/s to 7.0 s; at 7 GB/s, nothing. Every byte of
//! the image has to be written into the process once during a lazy wake:
//! spread at the reader's own pace those writes cost it least, where the
//! fill at full speed bunches them up at the restore's start.
//!
//! The driver's read rate is not known beforehand (6-10 GB/s by host) and
//! its reads of memory already in place are invisible, so the pace is
//! found the way a congestion window is: the fill is allowed a budget that
//! grows at `rate`; a fault in a large run of memory still to fill (the
//! reader has caught up with the fill's front) raises the rate by a
//! quarter and gives the fill `lead` bytes of room at once; every `quiet`
//! span without such a fault lowers the rate by a tenth, down to `min`.
//! The rate thus saws around the reader's. Faults are never held back, and
//! the pace ends when the caller says the reader is done (or the server
//! stops): what is left then goes in at full speed.
//!
//! Before the reader starts, a paced fill is held: past the head start
//! (what the caller waits for before it starts the driver) and `lead`, it
//! waits for the reader, so that the rest does not go in at full speed in
//! the moments before the driver starts and then bunch up at its start.
//! Whoever waits for every page ([`crate::Server::wait`]) lets it go: no
//! reader runs then.

use serde::Serialize;
use std::sync::atomic::{AtomicU8, Ordering::SeqCst};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

/// The pace's settings (GPUSNAP_PAGES_PACE_*, docs/design/wake.md).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PaceConfig {
    /// Bytes per second the fill starts at.
    pub start: u64,
    /// The slowest the fill goes while paced, bytes per second.
    pub min: u64,
    /// Room the fill gets past what it has served when the reader catches
    /// up, and the most it may bank while it cannot keep its pace.
    pub lead: u64,
    /// A span without a catch-up after which the rate falls by a tenth.
    pub quiet_ms: u64,
}

impl Default for PaceConfig {
    fn default() -> Self {
        PaceConfig { start: 10 << 30, min: 2 << 30, lead: 256 << 20, quiet_ms: 100 }
    }
}

/// What the pace did, for the report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct PaceStats {
    /// Faults that found the reader at the fill's front.
    pub catch_ups: u64,
    /// The rate when the pace ended, and the lowest and highest it took,
    /// in GB/s.
    pub end_gbps: f64,
    pub low_gbps: f64,
    pub high_gbps: f64,
    /// How long the pace lasted.
    pub paced_ms: u64,
}

#[derive(Debug, Default)]
struct State {
    /// Bytes per microsecond.
    rate: f64,
    /// What `served` may reach before a fill waits.
    allowed: f64,
    last_us: u64,
    last_catch_us: u64,
    last_raise_us: u64,
    /// When the pace (last) started; 0: never.
    since_us: u64,
    stats: PaceStats,
}

impl State {
    /// Brings the budget and the rate up to `now`.
    fn advance(&mut self, cfg: &PaceConfig, now: u64, served: u64) {
        let dt = now.saturating_sub(self.last_us);
        if dt == 0 {
            return;
        }
        let quiet = (cfg.quiet_ms * 1000).max(1);
        if now.saturating_sub(self.last_catch_us) > quiet {
            // A tenth per quiet span, continuously.
            let min = bytes_per_us(cfg.min);
            self.rate = (self.rate * 0.9f64.powf(dt as f64 / quiet as f64)).max(min);
            self.note_rate();
        }
        self.allowed += self.rate * dt as f64;
        // A fill that could not keep its pace banks no more than `lead`.
        self.allowed = self.allowed.min((served + cfg.lead) as f64);
        self.last_us = now;
    }
    fn note_rate(&mut self) {
        let g = self.rate / 1e3;
        if self.stats.low_gbps == 0.0 || g < self.stats.low_gbps {
            self.stats.low_gbps = g;
        }
        if g > self.stats.high_gbps {
            self.stats.high_gbps = g;
        }
        self.stats.end_gbps = g;
    }
}

fn bytes_per_us(bytes_per_s: u64) -> f64 {
    bytes_per_s as f64 / 1e6
}

/// The pacer's modes ([`Pacer::mode`]).
const OFF: u8 = 0;
/// Waiting for the reader: the fill goes no further than its hold.
const HELD: u8 = 1;
/// The reader runs: the fill keeps to its pace.
const PACED: u8 = 2;

/// The pace of one page server's background fill (see the module's text).
#[derive(Debug)]
pub(crate) struct Pacer {
    cfg: PaceConfig,
    st: Mutex<State>,
    cv: Condvar,
    /// OFF, HELD or PACED; changed only under `st`'s lock, read without
    /// it, so that an unpaced fill (the default) never takes it.
    mode: AtomicU8,
}

impl Pacer {
    pub(crate) fn new(cfg: PaceConfig) -> Self {
        Pacer { cfg, st: Mutex::new(State::default()), cv: Condvar::new(), mode: AtomicU8::new(OFF) }
    }

    /// The reader is to come: until [`Pacer::start`] (or [`Pacer::stop`])
    /// the fill goes no further than the hold it is given in
    /// [`Pacer::wait`]. Only before the pace ever started.
    pub(crate) fn hold(&self) {
        let st = self.st.lock().unwrap();
        if self.mode.load(SeqCst) == OFF && st.since_us == 0 {
            self.mode.store(HELD, SeqCst);
        }
    }

    /// The reader starts: the fill is paced from now, with `lead` bytes of
    /// room past `served`.
    pub(crate) fn start(&self, now: u64, served: u64) {
        let mut st = self.st.lock().unwrap();
        if self.is_on() {
            return;
        }
        let rate = bytes_per_us(self.cfg.start.max(self.cfg.min));
        *st = State {
            rate,
            allowed: (served + self.cfg.lead) as f64,
            last_us: now,
            last_catch_us: now,
            last_raise_us: 0,
            since_us: now,
            stats: PaceStats { catch_ups: st.stats.catch_ups, ..PaceStats::default() },
        };
        st.note_rate();
        self.mode.store(PACED, SeqCst);
        drop(st);
        // A held fill goes on at the pace.
        self.cv.notify_all();
    }

    /// The reader is done (or the wake ends, or no reader comes): no more
    /// pace or hold; waiting fills go on at once.
    pub(crate) fn stop(&self, now: u64) {
        let mut st = self.st.lock().unwrap();
        if self.is_on() {
            st.stats.paced_ms = now.saturating_sub(st.since_us) / 1000;
        }
        self.mode.store(OFF, SeqCst);
        drop(st);
        self.cv.notify_all();
    }

    /// A fault found the reader at the fill's front: more rate (at most
    /// once per half a quiet span, so that a burst of faults at one front
    /// counts once, and only if the pace held the fill back: a fill that
    /// cannot keep its pace has its whole `lead` banked, and more rate
    /// would not move it), and `lead` bytes of room at once.
    /// The caller asks [`Pacer::is_on`] first (a fault's fast path).
    pub(crate) fn caught_up(&self, now: u64, served: u64) {
        let mut st = self.st.lock().unwrap();
        if !self.is_on() {
            return;
        }
        st.advance(&self.cfg, now, served);
        st.stats.catch_ups += 1;
        st.last_catch_us = now;
        // Without this, a fill slower than the reader (3 threads on the
        // H200, bench/results/072) met it a thousand times and raised the rate a
        // quarter each 50 ms, to 10^7 GB/s: no pace at all once it could.
        let held_back = st.allowed - (served as f64) < (self.cfg.lead / 2) as f64;
        if held_back && now.saturating_sub(st.last_raise_us) >= self.cfg.quiet_ms * 500 {
            st.rate *= 1.25;
            st.last_raise_us = now;
            st.note_rate();
        }
        st.allowed = st.allowed.max((served + self.cfg.lead) as f64);
        drop(st);
        self.cv.notify_all();
    }

    /// Whether the fill is paced now (the reader runs).
    pub(crate) fn is_on(&self) -> bool {
        self.mode.load(SeqCst) == PACED
    }

    /// Whether a fill must ask [`Pacer::wait`]: paced or held.
    pub(crate) fn engaged(&self) -> bool {
        self.mode.load(SeqCst) != OFF
    }

    /// How long a fill that has `served` bytes behind it must wait now
    /// (zero: go on), without waiting; `hold`: how far a held fill goes.
    #[cfg(test)]
    fn due(&self, now: u64, served: u64, hold: u64) -> Duration {
        let mut st = self.st.lock().unwrap();
        self.due_in(&mut st, now, served, hold)
    }

    fn due_in(&self, st: &mut State, now: u64, served: u64, hold: u64) -> Duration {
        match self.mode.load(SeqCst) {
            OFF => return Duration::ZERO,
            // Until the reader starts (a wake of the condition variable).
            HELD if served < hold => return Duration::ZERO,
            HELD => return Duration::MAX,
            _ => {}
        }
        st.advance(&self.cfg, now, served);
        let over = served as f64 - st.allowed;
        if over < 0.0 {
            Duration::ZERO
        } else {
            Duration::from_micros((over / st.rate).ceil() as u64 + 1)
        }
    }

    /// Holds a background fill until the pace allows `served()` bytes
    /// (held: until the reader starts, past `hold()` bytes); returns at
    /// once when unpaced, and rechecks `give_up` every `tick`. The wait is
    /// on the lock's condition variable, so a catch-up, the reader's start
    /// or the end of the pace lets it go at once.
    pub(crate) fn wait(
        &self,
        now: impl Fn() -> u64,
        served: impl Fn() -> u64,
        hold: impl Fn() -> u64,
        give_up: impl Fn() -> bool,
        tick: Duration,
    ) {
        if !self.engaged() {
            return;
        }
        let mut st = self.st.lock().unwrap();
        loop {
            let d = self.due_in(&mut st, now(), served(), hold());
            if d.is_zero() || give_up() {
                return;
            }
            st = self.cv.wait_timeout(st, d.min(tick)).unwrap().0;
        }
    }

    /// What the pace did; None if it never started.
    pub(crate) fn stats(&self, now: u64) -> Option<PaceStats> {
        let st = self.st.lock().unwrap();
        if st.since_us == 0 {
            return None;
        }
        let mut s = st.stats;
        if self.is_on() {
            s.paced_ms = now.saturating_sub(st.since_us) / 1000;
        }
        Some(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1000;
    const GB: u64 = 1_000_000_000;

    fn cfg() -> PaceConfig {
        PaceConfig { start: 10 * GB, min: 2 * GB, lead: 256 << 20, quiet_ms: 100 }
    }

    /// Runs a fill that would go at `fill_gbps` against a reader at
    /// `read_gbps` that starts at the fill's start, for `secs`, in steps of
    /// 1 ms; returns (the fill's bytes, catch-ups, the highest rate in GB/s).
    fn race(fill_gbps: f64, read_gbps: f64, secs: f64) -> (u64, u64, f64) {
        let p = Pacer::new(cfg());
        p.start(1, 0);
        let (mut filled, mut read) = (0u64, 0f64);
        let steps = (secs * 1000.0) as u64;
        for i in 1..=steps {
            let now = 1 + i * MS;
            // The fill moves 1 MiB pieces while the pace allows.
            let mut budget = (fill_gbps * 1e6) as u64; // bytes per ms
            while budget >= 1 << 20 && p.due(now, filled, 0).is_zero() {
                filled += 1 << 20;
                budget -= 1 << 20;
            }
            read += read_gbps * 1e6;
            if read as u64 >= filled {
                // The reader meets unfilled memory: a fault.
                read = filled as f64;
                p.caught_up(now, filled);
            }
        }
        let s = p.stats(1 + steps * MS).unwrap();
        (filled, s.catch_ups, s.high_gbps)
    }

    #[test]
    fn the_fill_settles_near_a_slower_readers_pace() {
        // A reader at 6 GB/s, a fill that could do 13: over 3 s the fill
        // writes about what the reader reads, not 13 GB/s' worth.
        let (filled, catches, _) = race(13.0, 6.0, 3.0);
        let gb = filled as f64 / 1e9;
        assert!(gb < 3.0 * 6.0 * 1.35, "filled {gb} GB");
        assert!(gb > 3.0 * 6.0 * 0.95, "filled {gb} GB: the reader was held back");
        assert!(catches > 0);
    }

    #[test]
    fn a_faster_reader_raises_the_pace() {
        // A reader at 12 GB/s against a fill that starts paced at 10: the
        // catch-ups raise the rate, and the reader is not held to 10.
        let (filled, catches, high) = race(20.0, 12.0, 2.0);
        let gb = filled as f64 / 1e9;
        assert!(catches > 0);
        assert!(high > 12.0, "highest rate {high}");
        assert!(gb > 2.0 * 12.0 * 0.95, "filled {gb} GB: the reader was held back");
    }

    #[test]
    fn a_fill_slower_than_its_reader_does_not_raise_the_pace() {
        // A fill that can do 4 GB/s against a reader at 12: the reader is
        // at the front all the time, but the pace never held the fill
        // back, so the rate stays where it started (10 GB/s).
        let (filled, catches, high) = race(4.0, 12.0, 2.0);
        assert!(catches > 100, "{catches} catch-ups");
        assert!((high - 10.0).abs() < 0.01, "highest rate {high}");
        // At 4 GB/s the race's fill moves three 1 MiB pieces a ms.
        let own = 2000.0 * 3.0 * (1 << 20) as f64;
        assert!(filled as f64 > own * 0.95, "filled {filled} bytes: the fill was held back");
    }

    #[test]
    fn an_idle_reader_brings_the_rate_to_its_floor_and_stop_frees_the_fill() {
        let p = Pacer::new(cfg());
        p.start(1, 0);
        // Two seconds and no fault: the rate is at its floor.
        let d = p.due(1 + 2000 * MS, 64 << 30, 0);
        assert!(!d.is_zero());
        assert!((p.stats(1 + 2000 * MS).unwrap().end_gbps - 2.0).abs() < 0.01);
        // Banked room never exceeds the lead.
        let served = 1 << 30;
        assert!(p.due(1 + 2001 * MS, served, 0).is_zero());
        let after_lead = served + (256 << 20) + (2 << 20);
        assert!(!p.due(1 + 2001 * MS, after_lead, 0).is_zero());
        p.stop(1 + 2002 * MS);
        assert!(p.due(1 + 2003 * MS, u64::MAX / 2, 0).is_zero());
        assert_eq!(p.stats(1 + 2003 * MS).unwrap().paced_ms, 2002);
    }

    #[test]
    fn a_held_fill_goes_to_its_hold_and_waits_for_the_reader_or_the_end() {
        let p = Pacer::new(cfg());
        p.hold();
        assert!(p.engaged() && !p.is_on());
        // Up to the hold it goes; past it, it waits however long it takes.
        assert!(p.due(1, 1 << 20, 2 << 20).is_zero());
        assert_eq!(p.due(1, 2 << 20, 2 << 20), Duration::MAX);
        // A catch-up before the reader is none.
        p.caught_up(2, 2 << 20);
        assert_eq!(p.due(3, 2 << 20, 2 << 20), Duration::MAX);
        // The reader starts: the pace, with the lead past what is served.
        p.start(10, 2 << 20);
        assert!(p.is_on());
        assert!(p.due(11, 2 << 20, 2 << 20).is_zero());
        assert_eq!(p.stats(11).unwrap().catch_ups, 0);
        p.stop(20);
        assert!(!p.engaged());
        // Once paced, never held again.
        p.hold();
        assert!(!p.engaged());
        // And a hold that no reader ends is ended by stop.
        let q = Pacer::new(cfg());
        q.hold();
        q.stop(5);
        assert!(q.due(6, u64::MAX / 2, 0).is_zero());
        assert!(q.stats(6).is_none(), "never paced");
    }

    #[test]
    fn a_waiting_fill_is_let_go_by_a_catch_up_the_reader_s_start_and_the_end_of_the_pace() {
        use std::sync::Arc;
        let cfg = PaceConfig { start: 2 * GB, min: 2 * GB, lead: 1 << 20, quiet_ms: 100 };
        let t0 = std::time::Instant::now();
        let now = move || t0.elapsed().as_micros() as u64 + 1;
        // A fill thread that waits on `p` with `served` behind it (and a
        // hold at 0); then `act` runs; returns how long the fill waited.
        // Unreleased, each wait below would last 4 s or more (8 GiB past
        // its room at 2 GB/s, or a hold); released, a few milliseconds, so
        // the bound of 2 s holds on a busy machine.
        let released = |p: &Arc<Pacer>, served: u64, act: &dyn Fn(&Pacer, u64)| {
            let p2 = p.clone();
            let h = std::thread::spawn(move || {
                let t = std::time::Instant::now();
                p2.wait(now, || served, || 0, || false, Duration::from_millis(50));
                t.elapsed()
            });
            std::thread::sleep(Duration::from_millis(30));
            act(p, served);
            let waited = h.join().unwrap();
            assert!(waited < Duration::from_secs(2), "waited {waited:?}");
        };
        let p = Arc::new(Pacer::new(cfg));
        p.start(now(), 0);
        // The reader at the front: room past what is served, at once.
        released(&p, 8 << 30, &|p, served| p.caught_up(now(), served));
        // The end of the pace.
        released(&p, 16 << 30, &|p, _| p.stop(now()));
        // A held fill, let go by the reader's start.
        let q = Arc::new(Pacer::new(cfg));
        q.hold();
        released(&q, 8 << 30, &|q, served| q.start(now(), served));
    }
}
