//! How the background threads (the page server's fill, the whole image's
//! verify) give way to the woken processes, whose threads run the driver's
//! restore.
//!
//! Measured on the H200 (20.5 GB, one host, bench/results/029): the
//! driver's restore took 3.70 s on memory already in place and 3.92-4.87 s
//! while 16 background threads at nice 10 filled and verified beside it,
//! with almost no fault to wait for: every core was busy, so each time a
//! driver thread woke it had to take a core from one of them. A thread of
//! SCHED_IDLE class is preempted at once by any other thread that wakes,
//! and the scheduler counts a core running only such threads as idle when
//! it places a waking thread (kernel/sched/fair.c, `sched_idle_cpu`).
//! nix wraps neither `sched_setscheduler` nor `setpriority` for a thread.

use nix::errno::Errno;

/// Lowers the calling thread: SCHED_IDLE with `idle`, else nice `nice`
/// (0: left as it is).
pub fn lower_this_thread(nice: i32, idle: bool) -> Result<(), Errno> {
    if idle {
        let p = libc::sched_param { sched_priority: 0 };
        // SAFETY: pid 0 is the calling thread (on Linux the scheduling
        // policy is per thread); `p` is a valid sched_param that outlives
        // the call, which only reads it.
        let r = unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &p) };
        return if r == 0 { Ok(()) } else { Err(Errno::last()) };
    }
    if nice == 0 {
        return Ok(());
    }
    // SAFETY: gettid takes no arguments; setpriority on our own thread id
    // (Linux: per thread) changes only this thread's nice value.
    let r = unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, nice) };
    if r == 0 {
        Ok(())
    } else {
        Err(Errno::last())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_lowers_itself_only() {
        let policy = || {
            // SAFETY: pid 0 is the calling thread; no memory is passed.
            unsafe { libc::sched_getscheduler(0) }
        };
        let before = policy();
        std::thread::spawn(move || {
            lower_this_thread(0, true).unwrap();
            assert_eq!(policy(), libc::SCHED_IDLE);
        })
        .join()
        .unwrap();
        assert_eq!(policy(), before);
        std::thread::spawn(move || {
            lower_this_thread(7, false).unwrap();
            // SAFETY: getpriority reads our own thread's nice value.
            let n = unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t) };
            assert_eq!(n, 7);
            assert_ne!(policy(), libc::SCHED_IDLE);
        })
        .join()
        .unwrap();
    }
}
