use crate::{Call, CheckpointApi, DriverError, GpuPair, ProcessState};
use std::sync::{mpsc, Arc};
use std::time::Duration;

/// How long gpusnap lets each driver call run before it gives up on it.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// get-state, unlock, restore-thread-id: about 1 ms when healthy.
    pub quick: Duration,
    /// Added to the lock's own timeout.
    pub lock_slack: Duration,
    /// checkpoint and restore: scaled by the footprint by the caller.
    pub copy: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            quick: Duration::from_secs(30),
            lock_slack: Duration::from_secs(30),
            copy: Duration::from_secs(600),
        }
    }
}

/// Runs every call of an inner [`CheckpointApi`] on a worker thread and
/// waits for it no longer than a deadline.
///
/// The driver ignores its own lock timeout on a stopped process and can hang
/// for good on a wedged one. A hung call cannot be cancelled, so on timeout
/// the worker thread is abandoned (it dies with the process) and the caller
/// gets [`DriverError::Timeout`]: gpusnap itself never hangs.
pub struct Deadline<A: CheckpointApi> {
    inner: Arc<A>,
    pub timeouts: Timeouts,
}

impl<A: CheckpointApi> Clone for Deadline<A> {
    fn clone(&self) -> Self {
        Self { inner: Arc::clone(&self.inner), timeouts: self.timeouts }
    }
}

impl<A: CheckpointApi> Deadline<A> {
    pub fn new(inner: A, timeouts: Timeouts) -> Self {
        Self { inner: Arc::new(inner), timeouts }
    }

    pub fn inner(&self) -> &A {
        &self.inner
    }

    fn run<T: Send + 'static>(
        &self,
        call: Call,
        after: Duration,
        f: impl FnOnce(&A) -> Result<T, DriverError> + Send + 'static,
    ) -> Result<T, DriverError> {
        let inner = Arc::clone(&self.inner);
        let (tx, rx) = mpsc::sync_channel(1);
        std::thread::Builder::new()
            .name(format!("driver-{}", call.as_str()))
            .spawn(move || {
                let _ = tx.send(f(&inner));
            })
            .map_err(|_| DriverError::Timeout { call, after: Duration::ZERO })?;
        rx.recv_timeout(after).unwrap_or(Err(DriverError::Timeout { call, after }))
    }

    /// A checkpoint or restore of `bytes`: the fixed budget plus 1 s per
    /// 200 MB (ten times slower than the slowest rate measured).
    pub fn copy_budget(&self, bytes: u64) -> Duration {
        self.timeouts.copy + Duration::from_secs(bytes / 200_000_000)
    }

    pub fn checkpoint_within(&self, pid: i32, bytes: u64) -> Result<(), DriverError> {
        self.run(Call::Checkpoint, self.copy_budget(bytes), move |a| a.checkpoint(pid))
    }

    pub fn restore_within(&self, pid: i32, pairs: &[GpuPair], bytes: u64) -> Result<(), DriverError> {
        let pairs = pairs.to_vec();
        self.run(Call::Restore, self.copy_budget(bytes), move |a| a.restore(pid, &pairs))
    }
}

impl<A: CheckpointApi> CheckpointApi for Deadline<A> {
    fn api_version(&self) -> i32 {
        self.inner.api_version()
    }

    fn ready(&self) -> Result<(), DriverError> {
        // A driver's start-up can take seconds on a host without
        // persistence mode; the limit is only against a wedged one.
        self.run(Call::Init, self.timeouts.copy, move |a| a.ready())
    }

    fn get_state(&self, pid: i32) -> Result<ProcessState, DriverError> {
        self.run(Call::GetState, self.timeouts.quick, move |a| a.get_state(pid))
    }

    fn lock(&self, pid: i32, timeout_ms: u32) -> Result<(), DriverError> {
        let after = Duration::from_millis(timeout_ms.into()) + self.timeouts.lock_slack;
        let after = if timeout_ms == 0 { self.timeouts.copy } else { after };
        self.run(Call::Lock, after, move |a| a.lock(pid, timeout_ms))
    }

    fn checkpoint(&self, pid: i32) -> Result<(), DriverError> {
        self.checkpoint_within(pid, 0)
    }

    fn restore(&self, pid: i32, pairs: &[GpuPair]) -> Result<(), DriverError> {
        self.restore_within(pid, pairs, 0)
    }

    fn unlock(&self, pid: i32) -> Result<(), DriverError> {
        self.run(Call::Unlock, self.timeouts.quick, move |a| a.unlock(pid))
    }

    fn restore_thread_id(&self, pid: i32) -> Result<i32, DriverError> {
        self.run(Call::GetRestoreThreadId, self.timeouts.quick, move |a| a.restore_thread_id(pid))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Hangs;
    impl CheckpointApi for Hangs {
        fn api_version(&self) -> i32 {
            13000
        }
        fn get_state(&self, _: i32) -> Result<ProcessState, DriverError> {
            std::thread::sleep(Duration::from_secs(3600));
            Ok(ProcessState::Running)
        }
        fn lock(&self, _: i32, _: u32) -> Result<(), DriverError> {
            Ok(())
        }
        fn checkpoint(&self, _: i32) -> Result<(), DriverError> {
            Ok(())
        }
        fn restore(&self, _: i32, _: &[GpuPair]) -> Result<(), DriverError> {
            Ok(())
        }
        fn unlock(&self, _: i32) -> Result<(), DriverError> {
            Ok(())
        }
        fn restore_thread_id(&self, pid: i32) -> Result<i32, DriverError> {
            Ok(pid)
        }
    }

    #[test]
    fn a_hung_call_times_out() {
        let d = Deadline::new(Hangs, Timeouts { quick: Duration::from_millis(50), ..Default::default() });
        let err = d.get_state(1).unwrap_err();
        assert!(matches!(err, DriverError::Timeout { call: Call::GetState, .. }), "{err}");
        assert_eq!(d.restore_thread_id(7).unwrap(), 7);
    }
}
