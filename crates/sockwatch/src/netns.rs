//! Opening something inside another network namespace: a thread of its own
//! enters the namespace, opens it there and ends. A socket belongs to the
//! namespace it was created in for its whole life, whichever thread uses
//! it later; the caller's threads never change namespace.

use crate::Error;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// Runs `open` on a new thread that has entered the network namespace `ns`;
/// in the caller's own namespace, runs it there without entering anything
/// (entering needs CAP_SYS_ADMIN, which a probe run in a pod's container
/// lacks, and gives nothing).
pub fn inside<T: Send + 'static>(
    ns: &Path,
    open: impl FnOnce() -> Result<T, Error> + Send + 'static,
) -> Result<T, Error> {
    let fail = |source: std::io::Error| Error::Namespace { path: ns.display().to_string(), source };
    let file = std::fs::File::open(ns).map_err(fail)?;
    let id = |m: std::fs::Metadata| (m.dev(), m.ino());
    let own = std::fs::metadata("/proc/thread-self/ns/net").map(id).ok();
    if own.is_some() && file.metadata().map(id).ok() == own {
        return open();
    }
    tracing::debug!(ns = %ns.display(), "entering the network namespace to open a socket");
    let t = std::thread::Builder::new()
        .name("sockwatch-netns".into())
        .spawn(move || {
            nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET)
                .map_err(|e| std::io::Error::from_raw_os_error(e as i32))?;
            Ok::<_, std::io::Error>(open())
        })
        .map_err(fail)?;
    match t.join() {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => Err(fail(e)),
        Err(_) => Err(fail(std::io::Error::other("the thread that entered it panicked"))),
    }
}
