//! How the page server fills memory, set by the caller or from the
//! environment (docs/design/wake.md).

use crate::pacer::PaceConfig;
use crate::sys::PAGE;
use crate::PagesError;
use serde::Serialize;
use std::path::PathBuf;
use std::time::Duration;

/// How the server fills memory. Every field can be set from the
/// environment ([`Options::from_env`], docs/design/wake.md), so that a GPU run
/// can compare settings without a rebuild.
#[derive(Debug, Clone, Serialize)]
pub struct Options {
    /// Threads filling memory in the background.
    pub threads: usize,
    /// Bytes one background fill takes at once (its share of the address
    /// range: the next fill starts past it).
    pub batch: u64,
    /// Bytes a fill reads, copies and then wakes at a time. A fault in a
    /// piece in flight waits for the WAKE of its chunk, not for the whole
    /// batch: a whole-batch WAKE (4 MiB read and copied first) made the
    /// driver, which reads right behind the fill, wait for pages already
    /// read.
    pub wake_chunk: u64,
    /// Bytes a fault brings in (from the faulting page on, or down to it
    /// when the process reads downwards).
    pub fault_batch: u64,
    /// How far past the last fault (in the direction the faults go) the
    /// background fill goes on: 0 = just past it.
    pub ahead: u64,
    /// Nice value of the background fill threads (0: as gpusnap), so that
    /// the restored processes (the driver's restore runs in their threads)
    /// get the cores first; the threads that answer faults keep gpusnap's.
    pub nice: i32,
    /// The background fill threads run as SCHED_IDLE (then `nice` does not
    /// apply): any other thread that wakes takes their core at once (see
    /// [`crate::prio`]). Off by default: no gain measured, and a fault on a
    /// piece such a thread has in flight waits for it, which on a busy
    /// host may be long.
    pub idle: bool,
    /// What the background fill should have in place before the driver's
    /// restore starts (applied by the caller: [`Server::wait_ahead`]).
    pub head_start: HeadStart,
    /// The background fill starts at the first run of contiguous lazy
    /// memory at least this large (0: at the lowest address, the default),
    /// and comes back for the rest after the top. A CUDA process's
    /// checkpointed device memory is such a run, and what the driver's
    /// restore reads; the low addresses hold the interpreter's heap and
    /// small mappings. Measured on the H200 (20.5 GB): the first GB went in
    /// at ~2.4 GB/s, the rest at ~11 (bench/results/023); starting at the large run
    /// did not make the driver's restore faster (bench/results/024-025).
    pub big_first: u64,
    /// Bytes per second the background fill keeps to once the head start is
    /// in (0: as fast as it goes, the default): a fill just ahead of the
    /// driver's restore instead of one that takes the host's cores and
    /// memory bandwidth while the driver reads (the warm wake).
    /// Faults are never held back.
    pub rate: u64,
    /// Pace the background fill to the reader while the caller's driver
    /// restores run ([`Server::pace_reader`], [`crate::pacer`]); `rate`,
    /// when set, takes precedence.
    pub pace: bool,
    /// The pace's settings.
    pub pace_cfg: PaceConfig,
    /// Fail on purpose once this many bytes are served (tests of a page
    /// server that dies mid-wake).
    #[serde(skip)]
    pub fail_after: Option<u64>,
    /// Sleep this long before each chunk a thread reads (tests: a kill of
    /// the wake lands in the middle of the fill).
    #[serde(skip)]
    pub slow: Option<Duration>,
    /// Take every REMOVE as one that met a copy in flight (tests of the
    /// wake that fails safely on that race).
    #[serde(skip)]
    pub remove_raced: bool,
    /// The first background fill to have this many bytes served behind it
    /// gives its pieces back as a fill does when the layout changes under
    /// it (`UFFDIO_COPY`'s EAGAIN or ENOENT), once (tests: a fault that
    /// waited for that fill is woken to fault again).
    #[serde(skip)]
    pub give_back_at: Option<u64>,
    /// The background fill follows a fault (goes on from it, in its
    /// direction) only when it falls in a run of contiguous memory to fill
    /// of at least this many bytes (0, the default: every fault). A CUDA driver's restore
    /// touches small mappings here and there (its bookkeeping) before and
    /// while it streams the checkpointed device memory, one large run, in
    /// address order: following those faults took every fill thread away
    /// from the stream's front for 0.2 s, through hundreds of small
    /// mappings, and the driver then caught up with the front (H200, bench/results/052
    /// traces). A fault elsewhere is served by its own batch. Not a gain
    /// measured yet (bench/results/053), so off.
    pub follow_min: u64,
    /// Write a trace of the wake to this file when the server ends: each
    /// fault (time, address, how it was answered), each fill (start and end
    /// time, range) and the pieces each process had to fill, as JSON (for
    /// finding the order in which a driver's restore reads its memory;
    /// `bench/gpu/pages-trace.py` sums it up). Diagnostics: off by default.
    pub trace: Option<PathBuf>,
}

/// Bytes the page server fills before the driver's restore is started.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum HeadStart {
    Bytes(u64),
    /// A share (0-1) of what there is to serve.
    Fraction(f64),
}

impl HeadStart {
    pub fn bytes_of(&self, total: u64) -> u64 {
        match *self {
            HeadStart::Bytes(b) => b.min(total),
            HeadStart::Fraction(f) => ((total as f64) * f.clamp(0.0, 1.0)) as u64,
        }
    }
}

impl Default for Options {
    fn default() -> Self {
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(4);
        // Measured on the H200 host (16 cores, 26.4 GB lazy wake, bench/results/010 of
        // docs/gpu-e2e.md): 16 fill threads at normal priority slowed the
        // driver's restore, which runs on the same cores, to 6.72 s; 8 at
        // nice 10 filled faster (6.3 GB/s against 5.6) and the driver took
        // 5.42 s. So half the cores, below the driver's priority. Batch
        // size 256 KiB-16 MiB made no difference.
        Self {
            threads: (cores / 2).clamp(2, 8),
            batch: 4 << 20,
            wake_chunk: 1 << 20,
            fault_batch: 256 << 10,
            ahead: 0,
            nice: 10,
            // Off: on the H200 (bench/results/030, 20.5 GB, four samples each,
            // alternating) SCHED_IDLE fill and verify threads woke in
            // 4.38-5.71 s (median 4.53), nice 10 in 4.13-5.61 s (4.67): no
            // difference, and a SCHED_IDLE fill gets no core on a busy host.
            idle: false,
            // Measured on the H200 (20.5 GB, bench/results/023):
            // the driver's restore started right after CRIU's caught up
            // with the fill (driver 5.25 s against 3.29 alone); 512 MiB
            // first: 3.80 s, after a 0.21 s head start.
            head_start: HeadStart::Bytes(512 << 20),
            // Off: on the H200 (bench/results/024-025) starting at the large run did not
            // make the driver's restore faster (its slowdown inside a wake
            // came with almost no fault waiting; the hosts varied more than
            // the setting); kept as a setting to measure.
            big_first: 0,
            rate: 0,
            pace: false,
            pace_cfg: PaceConfig::default(),
            fail_after: None,
            remove_raced: false,
            give_back_at: None,
            trace: None,
            // Off: on the H200 (bench/results/053, ~26 GB, one host) the wakes with
            // 64 MiB took 6.85-7.13 s against 5.39 s following every fault;
            // the fill's front was no further ahead when the driver met it
            // (its fills slow down ~10x for ~0.5 s as the driver's restore
            // starts, whatever the fill follows). Kept as a setting.
            follow_min: 0,
            slow: None,
        }
    }
}

/// The environment variables of [`Options::from_env`].
pub const ENV_THREADS: &str = "GPUSNAP_PAGES_THREADS";
pub const ENV_BATCH: &str = "GPUSNAP_PAGES_BATCH";
pub const ENV_WAKE_CHUNK: &str = "GPUSNAP_PAGES_WAKE_CHUNK";
pub const ENV_FAULT_BATCH: &str = "GPUSNAP_PAGES_FAULT_BATCH";
pub const ENV_AHEAD: &str = "GPUSNAP_PAGES_AHEAD";
pub const ENV_NICE: &str = "GPUSNAP_PAGES_NICE";
pub const ENV_HEAD_START: &str = "GPUSNAP_PAGES_HEAD_START";
pub const ENV_BIG_FIRST: &str = "GPUSNAP_PAGES_BIG_FIRST";
pub const ENV_RATE: &str = "GPUSNAP_PAGES_RATE";
pub const ENV_IDLE: &str = "GPUSNAP_PAGES_IDLE";
pub const ENV_TRACE: &str = "GPUSNAP_PAGES_TRACE";
pub const ENV_FOLLOW_MIN: &str = "GPUSNAP_PAGES_FOLLOW_MIN";
pub const ENV_PACE: &str = "GPUSNAP_PAGES_PACE";
pub const ENV_PACE_START: &str = "GPUSNAP_PAGES_PACE_START";
pub const ENV_PACE_MIN: &str = "GPUSNAP_PAGES_PACE_MIN";
pub const ENV_PACE_LEAD: &str = "GPUSNAP_PAGES_PACE_LEAD";

/// A yes/no setting: `1`/`0` (also `yes`/`no`, `on`/`off`, `true`/`false`).
pub fn parse_flag(v: &str) -> Option<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "yes" | "on" | "true" => Some(true),
        "0" | "no" | "off" | "false" => Some(false),
        _ => None,
    }
}

/// The yes/no setting `name` set to `value` ([`parse_flag`]); unset, or
/// set to something else (said in a warning), `default`.
pub fn flag_setting(name: &str, value: Option<String>, default: bool) -> bool {
    let Some(v) = value else { return default };
    parse_flag(&v).unwrap_or_else(|| {
        tracing::warn!("{name}={v}: not 1 or 0; ignored");
        default
    })
}

/// A size: bytes, or with a K, M or G suffix (binary).
fn parse_size(v: &str) -> Option<u64> {
    let v = v.trim();
    let (num, mult) = match v.chars().last()?.to_ascii_uppercase() {
        'K' => (&v[..v.len() - 1], 1u64 << 10),
        'M' => (&v[..v.len() - 1], 1 << 20),
        'G' => (&v[..v.len() - 1], 1 << 30),
        _ => (v, 1),
    };
    num.trim().parse::<u64>().ok()?.checked_mul(mult)
}

impl Options {
    /// Whether the fill is paced to the reader: asked for, and no fixed
    /// [`Options::rate`] (which takes precedence).
    pub fn paced(&self) -> bool {
        self.pace && self.rate == 0
    }

    /// The defaults, with every `GPUSNAP_PAGES_*` variable that is set
    /// applied; a value that is not one is an error naming it.
    pub fn from_env() -> Result<Self, PagesError> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// As [`Options::from_env`], reading variables through `get`.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self, PagesError> {
        let mut o = Self::default();
        let bad = |name: &str, value: &str, why: &str| PagesError::Setting {
            name: name.to_string(),
            value: value.to_string(),
            why: why.to_string(),
        };
        let size = |name: &str, min: u64| -> Result<Option<u64>, PagesError> {
            let Some(v) = get(name) else { return Ok(None) };
            match parse_size(&v) {
                // Whole pages: UFFDIO_COPY moves pages.
                Some(n) if n >= min => Ok(Some(n.div_ceil(PAGE) * PAGE)),
                Some(_) => Err(bad(name, &v, &format!("at least {min} bytes"))),
                None => Err(bad(name, &v, "not a size (bytes, or with K, M or G)")),
            }
        };
        if let Some(v) = get(ENV_THREADS) {
            o.threads = match v.trim().parse::<usize>() {
                Ok(n) if (1..=256).contains(&n) => n,
                _ => return Err(bad(ENV_THREADS, &v, "a count of threads, 1 to 256")),
            };
        }
        if let Some(n) = size(ENV_BATCH, PAGE)? {
            o.batch = n;
        }
        if let Some(n) = size(ENV_WAKE_CHUNK, PAGE)? {
            o.wake_chunk = n;
        }
        if let Some(n) = size(ENV_FAULT_BATCH, PAGE)? {
            o.fault_batch = n;
        }
        if let Some(n) = size(ENV_AHEAD, 0)? {
            o.ahead = n;
        }
        if let Some(n) = size(ENV_BIG_FIRST, 0)? {
            o.big_first = n;
        }
        if let Some(n) = size(ENV_RATE, 0)? {
            o.rate = n;
        }
        if let Some(n) = size(ENV_FOLLOW_MIN, 0)? {
            o.follow_min = n;
        }
        if let Some(v) = get(ENV_PACE) {
            o.pace = parse_flag(&v).ok_or_else(|| bad(ENV_PACE, &v, "1 or 0"))?;
        }
        // Rates in bytes per second, with K, M or G (binary): 1 GiB/s at least.
        if let Some(n) = size(ENV_PACE_START, 1 << 30)? {
            o.pace_cfg.start = n;
        }
        if let Some(n) = size(ENV_PACE_MIN, 1 << 30)? {
            o.pace_cfg.min = n;
        }
        if let Some(n) = size(ENV_PACE_LEAD, 1 << 20)? {
            o.pace_cfg.lead = n;
        }
        if let Some(v) = get(ENV_NICE) {
            o.nice = match v.trim().parse::<i32>() {
                Ok(n) if (0..=19).contains(&n) => n,
                _ => return Err(bad(ENV_NICE, &v, "a nice value, 0 to 19")),
            };
        }
        if let Some(v) = get(ENV_TRACE) {
            let path = PathBuf::from(v.trim());
            if !path.is_absolute() {
                return Err(bad(ENV_TRACE, &v, "an absolute path"));
            }
            o.trace = Some(path);
        }
        if let Some(v) = get(ENV_IDLE) {
            o.idle = parse_flag(&v).ok_or_else(|| bad(ENV_IDLE, &v, "1 or 0"))?;
        }
        if let Some(v) = get(ENV_HEAD_START) {
            let t = v.trim();
            let frac = if let Some(p) = t.strip_suffix('%') {
                p.trim().parse::<f64>().ok().map(|x| x / 100.0)
            } else if t.contains('.') {
                t.parse::<f64>().ok()
            } else {
                None
            };
            o.head_start = match frac {
                Some(f) if (0.0..=1.0).contains(&f) => HeadStart::Fraction(f),
                Some(_) => return Err(bad(ENV_HEAD_START, &v, "a share from 0 to 1 (or 0% to 100%)")),
                None => match parse_size(t) {
                    Some(b) => HeadStart::Bytes(b),
                    None => {
                        return Err(bad(
                            ENV_HEAD_START,
                            &v,
                            "bytes (with K, M or G), a share such as 0.25, or a percentage",
                        ))
                    }
                },
            };
        }
        Ok(o)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn settings_from_the_environment() {
        let vars = |kv: &'static [(&'static str, &'static str)]| {
            move |k: &str| kv.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
        };
        let d = Options::default();
        let o = Options::from_vars(vars(&[])).unwrap();
        assert_eq!((o.threads, o.batch, o.fault_batch, o.ahead), (d.threads, 4 << 20, 256 << 10, 0));
        assert_eq!((o.head_start, o.big_first), (HeadStart::Bytes(512 << 20), 0));
        let o = Options::from_vars(vars(&[(ENV_BIG_FIRST, "0"), (ENV_HEAD_START, "0")])).unwrap();
        assert_eq!((o.head_start, o.big_first), (HeadStart::Bytes(0), 0));
        let o = Options::from_vars(vars(&[
            (ENV_THREADS, "8"),
            (ENV_BATCH, "16M"),
            (ENV_WAKE_CHUNK, "256k"),
            (ENV_FAULT_BATCH, "1M"),
            (ENV_AHEAD, "64M"),
            (ENV_NICE, "10"),
            (ENV_HEAD_START, "25%"),
        ]))
        .unwrap();
        assert_eq!((o.threads, o.batch, o.wake_chunk, o.fault_batch), (8, 16 << 20, 256 << 10, 1 << 20));
        assert_eq!((o.ahead, o.nice, o.head_start), (64 << 20, 10, HeadStart::Fraction(0.25)));
        assert_eq!(HeadStart::Fraction(0.25).bytes_of(1000), 250);
        assert_eq!(HeadStart::Bytes(5000).bytes_of(1000), 1000);
        let o = Options::from_vars(vars(&[(ENV_HEAD_START, "0.5"), (ENV_BATCH, "5000")])).unwrap();
        assert_eq!((o.head_start, o.batch), (HeadStart::Fraction(0.5), 8192));
        let o = Options::from_vars(vars(&[(ENV_HEAD_START, "2G")])).unwrap();
        assert_eq!(o.head_start, HeadStart::Bytes(2 << 30));
        assert_eq!(o.rate, 0);
        let o = Options::from_vars(vars(&[(ENV_RATE, "6G")])).unwrap();
        assert_eq!(o.rate, 6 << 30);
        assert!(!o.idle);
        let o = Options::from_vars(vars(&[(ENV_IDLE, "yes")])).unwrap();
        assert!(o.idle);
        assert_eq!(o.trace, None);
        let o = Options::from_vars(vars(&[(ENV_TRACE, "/tmp/t.json")])).unwrap();
        assert_eq!(o.trace.as_deref(), Some(Path::new("/tmp/t.json")));
        assert_eq!(Options::default().follow_min, 0);
        assert_eq!(Options::from_vars(vars(&[(ENV_FOLLOW_MIN, "64M")])).unwrap().follow_min, 64 << 20);
        assert!(!Options::default().pace);
        let o = Options::from_vars(vars(&[
            (ENV_PACE, "1"),
            (ENV_PACE_START, "8G"),
            (ENV_PACE_MIN, "3G"),
            (ENV_PACE_LEAD, "64M"),
        ]))
        .unwrap();
        assert!(o.pace);
        assert_eq!(o.pace_cfg, PaceConfig { start: 8 << 30, min: 3 << 30, lead: 64 << 20, quiet_ms: 100 });
        for bad in [
            (ENV_PACE, "sometimes"),
            (ENV_PACE_START, "100M"),
            (ENV_PACE_MIN, "fast"),
            (ENV_PACE_LEAD, "4K"),
            (ENV_FOLLOW_MIN, "big"),
            (ENV_TRACE, "t.json"),
            (ENV_THREADS, "0"),
            (ENV_THREADS, "many"),
            (ENV_BATCH, "12"),
            (ENV_BATCH, "4X"),
            (ENV_NICE, "-5"),
            (ENV_HEAD_START, "150%"),
            (ENV_HEAD_START, "1.5"),
            (ENV_RATE, "fast"),
            (ENV_IDLE, "maybe"),
        ] {
            let e = Options::from_vars(move |k| (k == bad.0).then(|| bad.1.to_string())).unwrap_err();
            assert!(e.to_string().starts_with(&format!("{}={}: ", bad.0, bad.1)), "{e}");
        }
    }
}
