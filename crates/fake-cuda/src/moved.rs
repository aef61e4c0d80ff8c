//! A process that CRIU restored into a new pid namespace (a container
//! runtime's restore). The real driver's state of a process travels inside
//! the process's memory, so the driver knows it under its new host pid. The
//! fake keeps its state by pid in a shared file: a process in a pid
//! namespace of its own holds a mark open from its first context on
//! (`ids/TOKEN` in the fake's directory; CRIU restores the descriptor with
//! the process), and a call naming a pid the fake has no entry for follows
//! that descriptor to the entry of the process that was dumped.

use gpusnap_fake_common::procfs;
use gpusnap_fake_common::state::ProcState;
use gpusnap_fake_common::store::{Store, Txn};
use std::path::Path;

/// Gives the entry of `pid` (a process in a pid namespace of its own) a mark
/// it holds open for the rest of its life.
pub(crate) fn mark(store: &Store, t: &mut Txn, pid: i32) {
    if !procfs::in_child_pid_namespace() {
        return;
    }
    let Some(p) = t.state.procs.get_mut(&pid) else { return };
    if p.token.is_some() {
        return;
    }
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let token = format!("{pid:x}-{:x}-{nanos:x}", p.start_time);
    let dir = store.ids_dir();
    let opened = std::fs::create_dir_all(&dir).and_then(|_| std::fs::File::create(dir.join(&token)));
    match opened {
        Ok(f) => {
            // Held open on purpose until the process ends: it is the mark.
            std::mem::forget(f);
            p.token = Some(token);
        }
        Err(e) => eprintln!("gpusnap-fake-cuda: mark of {pid}: {e}"),
    }
}

/// The mark `pid` holds open, if any.
fn token_of(store: &Store, pid: i32) -> Option<String> {
    let ids = store.ids_dir();
    std::fs::read_dir(format!("{}/{pid}/fd", procfs::root())).ok()?.flatten().find_map(|fd| {
        let target = std::fs::read_link(fd.path()).ok()?;
        let rel = target.strip_prefix(&ids).ok()?;
        (rel.parent() == Some(Path::new(""))).then(|| rel.to_str().map(str::to_owned)).flatten()
    })
}

/// Moves to `pid` the entry of the dumped process whose mark `pid` holds: a
/// checkpointed or locked entry whose own process is gone. Returns whether
/// one moved.
pub(crate) fn follow(store: &Store, t: &mut Txn, pid: i32) -> bool {
    let Some(token) = token_of(store, pid) else { return false };
    let old = t.state.procs.iter().find_map(|(&old, p)| {
        let dumped = matches!(p.state, ProcState::Checkpointed | ProcState::Locked);
        (old != pid
            && dumped
            && p.token.as_deref() == Some(token.as_str())
            && !procfs::is_same_live_process(old, p.start_time))
        .then_some(old)
    });
    let Some(old) = old else { return false };
    let Some(entry) = t.state.procs.remove(&old) else { return false };
    t.state.procs.insert(pid, entry);
    if let Err(e) = store.rename_data(old, pid) {
        eprintln!("gpusnap-fake-cuda: data of {old} to {pid}: {e}");
    }
    let _ = store.journal_note("moved", pid, &old.to_string());
    true
}
