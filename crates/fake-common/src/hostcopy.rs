//! The host copy: what the real driver's checkpoint leaves in the process.
//!
//! `cuCheckpointProcessCheckpoint` copies a process's device memory into
//! anonymous memory of that process, and `cuCheckpointProcessRestore` copies
//! it back from there. In a lazy wake that memory arrives through
//! userfaultfd while the restore runs, so the restore blocks on pages not
//! yet in place. The fake models it for a process that registered a range
//! of its own memory (`fakeRegisterHostCopy`): its checkpoint writes a known
//! pattern there, its restore reads the range back and says what it found.
//!
//! Both go through `process_vm_writev`/`process_vm_readv` from the process
//! that called the driver (gpusnap): a read of a page still missing in a
//! userfaultfd-registered range waits until the page server fills it, as
//! the driver's copy does. (Measured on Linux 6.18: `process_vm_readv`
//! waits for the page; a read of `/proc/PID/mem` fails with EIO instead, so
//! it is not used.)

use std::fmt;
use std::io;

use crate::state::HostCopy;

/// The pattern is made per page, so that a page in the wrong place shows.
pub const PAGE: usize = 4096;

/// How much one read or write moves: the driver's copy also goes in pieces.
const PIECE: usize = 1 << 20;

/// What a restore read in the host copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Every page as the checkpoint wrote it.
    Ok,
    /// This many pages were all zeros (and no page was otherwise wrong):
    /// missing pages answered with zero pages.
    Zeros(u64),
    /// This many pages held something else, neither zeros nor the pattern.
    Bad(u64),
    /// The read stopped after this many bytes (the process went away, or the
    /// range is not mapped).
    Short(u64),
}

impl fmt::Display for Verdict {
    /// One word, for the journal: `ok`, `zeros:N`, `bad:N`, `short:BYTES`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Verdict::Ok => f.write_str("ok"),
            Verdict::Zeros(n) => write!(f, "zeros:{n}"),
            Verdict::Bad(n) => write!(f, "bad:{n}"),
            Verdict::Short(n) => write!(f, "short:{n}"),
        }
    }
}

/// Fills `buf` with the pattern of the bytes at `offset` of a host copy
/// (`offset` and `buf.len()` multiples of [`PAGE`]). Page `i` starts with
/// `i + 1` (8 bytes, little endian); every other byte is non-zero.
pub fn pattern(offset: u64, buf: &mut [u8]) {
    for (n, page) in buf.chunks_mut(PAGE).enumerate() {
        let index = offset / PAGE as u64 + n as u64;
        for (j, b) in page.iter_mut().enumerate() {
            *b = 1 + ((j as u64 * 31 + index * 7) % 251) as u8;
        }
        let head = (index + 1).to_le_bytes();
        let k = head.len().min(page.len());
        page[..k].copy_from_slice(&head[..k]);
    }
}

/// Counts the pages of `buf` (at `offset`) that are all zeros and those
/// that are otherwise not the pattern.
pub fn check(offset: u64, buf: &[u8]) -> (u64, u64) {
    let mut want = vec![0u8; buf.len()];
    pattern(offset, &mut want);
    let (mut zeros, mut bad) = (0, 0);
    for (got, want) in buf.chunks(PAGE).zip(want.chunks(PAGE)) {
        if got == want {
            continue;
        }
        if got.iter().all(|&b| b == 0) {
            zeros += 1;
        } else {
            bad += 1;
        }
    }
    (zeros, bad)
}

/// Writes the pattern over the host copy of `pid`, a piece at a time (the
/// checkpoint's copy to the host).
pub fn write(pid: i32, hc: HostCopy) -> io::Result<()> {
    let mut buf = vec![0u8; PIECE];
    let mut at = 0u64;
    while at < hc.len {
        let len = (hc.len - at).min(PIECE as u64) as usize;
        let piece = &mut buf[..len];
        pattern(at, piece);
        let mut done = 0;
        while done < len {
            done += transfer(pid, hc.addr + at + done as u64, &mut piece[done..], true)?;
        }
        at += len as u64;
    }
    Ok(())
}

/// Reads the host copy of `pid` back a piece at a time (the restore's copy
/// to the device) and says what it held. `before_piece` runs before each
/// piece (the driver waits there while its restore thread cannot run).
pub fn read(pid: i32, hc: HostCopy, mut before_piece: impl FnMut()) -> Verdict {
    let mut buf = vec![0u8; PIECE];
    let (mut zeros, mut bad) = (0, 0);
    let mut at = 0u64;
    while at < hc.len {
        before_piece();
        let len = (hc.len - at).min(PIECE as u64) as usize;
        let piece = &mut buf[..len];
        let mut done = 0;
        while done < len {
            match transfer(pid, hc.addr + at + done as u64, &mut piece[done..], false) {
                Ok(n) => done += n,
                Err(_) => return Verdict::Short(at + done as u64),
            }
        }
        let (z, b) = check(at, piece);
        zeros += z;
        bad += b;
        at += len as u64;
    }
    if bad > 0 {
        Verdict::Bad(bad)
    } else if zeros > 0 {
        Verdict::Zeros(zeros)
    } else {
        Verdict::Ok
    }
}

/// One `process_vm_writev` (`to_remote`) or `process_vm_readv` between
/// `local` and `remote` in `pid`; returns the bytes moved (never 0: a
/// transfer that moves nothing is an error).
fn transfer(pid: i32, remote: u64, local: &mut [u8], to_remote: bool) -> io::Result<usize> {
    // Hand-written over libc rather than nix's `uio` feature: two calls,
    // and turning that feature on would rebuild nix for the whole workspace.
    let liov = libc::iovec { iov_base: local.as_mut_ptr().cast(), iov_len: local.len() };
    let riov = libc::iovec { iov_base: remote as *mut libc::c_void, iov_len: local.len() };
    let n = if to_remote {
        // SAFETY: `liov` describes `local`, which lives through the call;
        // the remote address is only interpreted by the kernel in `pid`'s
        // address space, which it checks.
        unsafe { libc::process_vm_writev(pid, &liov, 1, &riov, 1, 0) }
    } else {
        // SAFETY: as above; the kernel writes at most `local.len()` bytes
        // into `local`, which we borrow mutably.
        unsafe { libc::process_vm_readv(pid, &liov, 1, &riov, 1, 0) }
    };
    match n {
        n if n > 0 => Ok(n as usize),
        0 => Err(io::Error::new(io::ErrorKind::UnexpectedEof, "no bytes moved")),
        _ => Err(io::Error::last_os_error()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pattern_tells_pages_apart_and_zeros_from_garbage() {
        let mut a = vec![0u8; 3 * PAGE];
        pattern(8 * PAGE as u64, &mut a);
        assert!(a.chunks(PAGE).all(|p| p.iter().any(|&b| b != 0)));
        assert_ne!(a[..PAGE], a[PAGE..2 * PAGE]);
        assert_eq!(check(8 * PAGE as u64, &a), (0, 0));
        // The same bytes a page further on are wrong everywhere.
        assert_eq!(check(9 * PAGE as u64, &a), (0, 3));
        a[PAGE..2 * PAGE].fill(0);
        a[2 * PAGE + 100] ^= 1;
        assert_eq!(check(8 * PAGE as u64, &a), (1, 1));
    }

    #[test]
    fn writes_and_reads_another_process() {
        // A child that holds an untouched anonymous range and waits.
        let len = 3 * PIECE as u64 + 2 * PAGE as u64;
        // SAFETY: a fresh private anonymous mapping, not aliased.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(addr, libc::MAP_FAILED);
        let hc = HostCopy { addr: addr as u64, len };
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id() as i32;
        // The child has no such range: nothing is read.
        assert!(matches!(read(pid, hc, || ()), Verdict::Short(_)));
        child.kill().unwrap();
        child.wait().unwrap();

        // This process itself: untouched memory reads as zeros, written as
        // the pattern it reads right, and a damaged page is found.
        let me = std::process::id() as i32;
        let mut pieces = 0;
        assert_eq!(read(me, hc, || pieces += 1), Verdict::Zeros(len / PAGE as u64));
        assert_eq!(pieces, 4);
        write(me, hc).unwrap();
        assert_eq!(read(me, hc, || ()), Verdict::Ok);
        // SAFETY: inside the mapping made above.
        unsafe { *(addr as *mut u8).add(PIECE + 5) ^= 0xff };
        assert_eq!(read(me, hc, || ()), Verdict::Bad(1));
        // SAFETY: the mapping made above, no longer used.
        unsafe { libc::munmap(addr, len as usize) };
        assert_eq!(read(me, hc, || ()), Verdict::Short(0));
    }
}
