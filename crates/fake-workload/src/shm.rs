//! `--shm-semaphore`: /dev/shm held as a named POSIX semaphore holds it.

/// See `--shm-semaphore`: a page of /dev/shm, mapped shared for the life of
/// the process, its first name unlinked, its second kept.
pub fn semaphore() -> Result<(), String> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let pid = std::process::id();
    let (tmp, name) = (format!("/dev/shm/sem.tmp{pid}"), format!("/dev/shm/sem.fake-workload-{pid}"));
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| format!("{tmp}: {e}"))?;
    f.set_len(4096).map_err(|e| format!("{tmp}: {e}"))?;
    // SAFETY: a shared mapping of the page just sized, kept (never unmapped)
    // for the life of the process; the descriptor may close after it.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(format!("mmap {tmp}: {}", std::io::Error::last_os_error()));
    }
    std::fs::hard_link(&tmp, &name).map_err(|e| format!("{name}: {e}"))?;
    std::fs::remove_file(&tmp).map_err(|e| format!("{tmp}: {e}"))
}
