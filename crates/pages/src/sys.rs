//! userfaultfd, the kernel's side: the structures and ioctls of
//! `<linux/userfaultfd.h>` and nothing else.
//!
//! Hand-written rather than the `userfaultfd` crate: that crate generates its
//! bindings with bindgen at build time (libclang on every build machine, CI
//! included), and its `copy` drops the count of pages copied when a copy
//! stops at a page already present (EEXIST), which is how several threads
//! filling one process meet. Seven ioctls and four structures are less than
//! that dependency.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

pub const PAGE: u64 = 4096;

pub const UFFD_API: u64 = 0xAA;
pub const FEATURE_EVENT_FORK: u64 = 1 << 1;
pub const FEATURE_EVENT_REMAP: u64 = 1 << 2;
pub const FEATURE_EVENT_REMOVE: u64 = 1 << 3;
pub const FEATURE_EVENT_UNMAP: u64 = 1 << 6;
/// What CRIU asks for (`NEED_UFFD_API_FEATURES` in criu/uffd.c): without
/// them a restored process that forks, remaps or unmaps loses pages.
pub const NONCOOP: u64 =
    FEATURE_EVENT_FORK | FEATURE_EVENT_REMAP | FEATURE_EVENT_REMOVE | FEATURE_EVENT_UNMAP;

pub const EVENT_PAGEFAULT: u8 = 0x12;
pub const EVENT_FORK: u8 = 0x13;
pub const EVENT_REMAP: u8 = 0x14;
pub const EVENT_REMOVE: u8 = 0x15;
pub const EVENT_UNMAP: u8 = 0x16;

const COPY_MODE_DONTWAKE: u64 = 1;

#[repr(C)]
#[derive(Default)]
pub struct UffdioApi {
    pub api: u64,
    pub features: u64,
    pub ioctls: u64,
}

#[repr(C)]
#[derive(Default)]
pub struct UffdioRange {
    pub start: u64,
    pub len: u64,
}

#[repr(C)]
#[derive(Default)]
pub struct UffdioCopy {
    pub dst: u64,
    pub src: u64,
    pub len: u64,
    pub mode: u64,
    pub copy: i64,
}

#[repr(C)]
#[derive(Default)]
pub struct UffdioZeropage {
    pub range: UffdioRange,
    pub mode: u64,
    pub zeropage: i64,
}

#[repr(C)]
#[derive(Default)]
pub struct UffdioRegister {
    pub range: UffdioRange,
    pub mode: u64,
    pub ioctls: u64,
}

/// `struct uffd_msg`: the event, then a union of at most three u64.
#[repr(C)]
#[derive(Default, Clone, Copy)]
pub struct UffdMsg {
    pub event: u8,
    pub reserved1: u8,
    pub reserved2: u16,
    pub reserved3: u32,
    pub arg: [u64; 3],
}

nix::ioctl_readwrite!(ioctl_api, UFFD_API, 0x3F, UffdioApi);
nix::ioctl_readwrite!(ioctl_register, UFFD_API, 0x00, UffdioRegister);
nix::ioctl_read!(ioctl_unregister, UFFD_API, 0x01, UffdioRange);
nix::ioctl_read!(ioctl_wake, UFFD_API, 0x02, UffdioRange);
nix::ioctl_readwrite!(ioctl_copy, UFFD_API, 0x03, UffdioCopy);
nix::ioctl_readwrite!(ioctl_zeropage, UFFD_API, 0x04, UffdioZeropage);

/// A new userfaultfd with the API handshake done and `features` asked for;
/// returns the features the kernel granted.
pub fn open(features: u64) -> nix::Result<(OwnedFd, u64)> {
    // SAFETY: the syscall takes flags only and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK) };
    if fd < 0 {
        return Err(nix::errno::Errno::last());
    }
    // SAFETY: fd was just returned by the kernel and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let mut api = UffdioApi { api: UFFD_API, features, ioctls: 0 };
    // SAFETY: api is a valid, initialised uffdio_api for the whole call.
    unsafe { ioctl_api(fd.as_raw_fd(), &mut api) }?;
    Ok((fd, api.features))
}

/// Registers `[start, start+len)` for missing-page faults (tests only: CRIU's
/// restorer registers the lazy areas of a restored process itself).
pub fn register_missing(fd: BorrowedFd<'_>, start: u64, len: u64) -> nix::Result<()> {
    let mut r = UffdioRegister { range: UffdioRange { start, len }, mode: 1, ioctls: 0 };
    // SAFETY: r is a valid uffdio_register for the whole call.
    unsafe { ioctl_register(fd.as_raw_fd(), &mut r) }.map(|_| ())
}

/// Copies `len` bytes from `src` to `dst` of the process behind `fd`, not
/// waking its faulting threads. Returns the bytes copied and the error that
/// stopped the copy, if any (a copy can stop part-way, e.g. at a page
/// that is already there: EEXIST).
pub fn copy(fd: BorrowedFd<'_>, dst: u64, src: &[u8]) -> (u64, Option<nix::errno::Errno>) {
    let mut c = UffdioCopy {
        dst,
        src: src.as_ptr() as u64,
        len: src.len() as u64,
        mode: COPY_MODE_DONTWAKE,
        copy: 0,
    };
    // SAFETY: c is a valid uffdio_copy; src is readable for src.len() bytes
    // during the call (the kernel only reads it); dst is in another process
    // (or a registered range of ours), which the kernel validates.
    match unsafe { ioctl_copy(fd.as_raw_fd(), &mut c) } {
        Ok(_) => (c.copy.max(0) as u64, None),
        Err(e) => (c.copy.max(0) as u64, Some(e)),
    }
}

/// Maps zero pages at `[start, start+len)` and wakes the faulting threads.
pub fn zeropage(fd: BorrowedFd<'_>, start: u64, len: u64) -> nix::Result<()> {
    match zeropage_part(fd, start, len) {
        (_, None) => Ok(()),
        (_, Some(e)) => Err(e),
    }
}

/// Maps zero pages at `[start, start+len)` and wakes the faulting threads
/// there; returns the bytes mapped and the error that stopped it part-way,
/// if any (EEXIST at a page already there, EAGAIN after a partial range).
pub fn zeropage_part(fd: BorrowedFd<'_>, start: u64, len: u64) -> (u64, Option<nix::errno::Errno>) {
    let mut z = UffdioZeropage { range: UffdioRange { start, len }, mode: 0, zeropage: 0 };
    // SAFETY: z is a valid uffdio_zeropage for the whole call.
    match unsafe { ioctl_zeropage(fd.as_raw_fd(), &mut z) } {
        Ok(_) => (z.zeropage.max(0) as u64, None),
        Err(e) => (z.zeropage.max(0) as u64, Some(e)),
    }
}

pub fn wake(fd: BorrowedFd<'_>, start: u64, len: u64) -> nix::Result<()> {
    let mut r = UffdioRange { start, len };
    // SAFETY: r is a valid uffdio_range for the whole call.
    unsafe { ioctl_wake(fd.as_raw_fd(), &mut r) }.map(|_| ())
}

pub fn unregister(fd: BorrowedFd<'_>, start: u64, len: u64) -> nix::Result<()> {
    let mut r = UffdioRange { start, len };
    // SAFETY: r is a valid uffdio_range for the whole call.
    unsafe { ioctl_unregister(fd.as_raw_fd(), &mut r) }.map(|_| ())
}

/// Reads one message; `None` when none is queued (the fd is non-blocking).
pub fn read_msg(fd: BorrowedFd<'_>) -> nix::Result<Option<UffdMsg>> {
    let mut m = UffdMsg::default();
    let n = std::mem::size_of::<UffdMsg>();
    // SAFETY: m is n writable bytes; read writes at most n.
    let r = unsafe { libc::read(fd.as_raw_fd(), &mut m as *mut UffdMsg as *mut libc::c_void, n) };
    if r < 0 {
        let e = nix::errno::Errno::last();
        return if e == nix::errno::Errno::EAGAIN { Ok(None) } else { Err(e) };
    }
    if r as usize != n {
        // EOF: the process behind it is gone.
        return Err(nix::errno::Errno::ESRCH);
    }
    Ok(Some(m))
}
