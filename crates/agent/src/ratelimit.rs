//! Warnings that a flood could repeat thousands of times a minute (a refused
//! connection, a failed accept) are logged at most once per interval per
//! kind, with the count of those left out since the last one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One kind of warning, logged at most once per `every`.
#[derive(Debug)]
pub struct Every {
    every: Duration,
    last: Mutex<Option<Instant>>,
    left_out: AtomicU64,
}

impl Every {
    pub const fn new(every: Duration) -> Self {
        Self { every, last: Mutex::new(None), left_out: AtomicU64::new(0) }
    }

    /// `Some(n)` when this one may be logged (`n` left out since the last
    /// one logged), `None` when it is to be left out.
    pub fn allow(&self) -> Option<u64> {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        if last.is_some_and(|t| now.duration_since(t) < self.every) {
            self.left_out.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        *last = Some(now);
        Some(self.left_out.swap(0, Ordering::Relaxed))
    }
}

/// What to add to a warning about the ones left out before it.
pub fn left_out_note(n: u64) -> String {
    if n == 0 {
        String::new()
    } else {
        format!(" ({n} more like it not logged)")
    }
}

/// `tracing::warn!` at most once per interval of `$every` (an [`Every`]).
#[macro_export]
macro_rules! warn_every {
    ($every:expr, $($field:ident = $value:expr,)* $fmt:literal $(, $arg:expr)* $(,)?) => {
        if let Some(n) = $every.allow() {
            tracing::warn!($($field = $value,)* "{}{}", format!($fmt $(, $arg)*), $crate::ratelimit::left_out_note(n));
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_per_interval_with_the_count_left_out() {
        let e = Every::new(Duration::from_secs(3600));
        assert_eq!(e.allow(), Some(0));
        for _ in 0..1900 {
            assert_eq!(e.allow(), None);
        }
        *e.last.lock().unwrap() = Some(Instant::now() - Duration::from_secs(3601));
        assert_eq!(e.allow(), Some(1900));
        assert_eq!(left_out_note(1900), " (1900 more like it not logged)");
    }
}
