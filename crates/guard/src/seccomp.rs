//! The seccomp side of the guard: a filter, installed by `gpusnap run`
//! between fork and exec, that stops every `exit_group` of the guarded
//! program for its tracer (SECCOMP_RET_TRACE). At that stop the exiting
//! process is still whole (its driver threads live), so its CUDA state can be
//! suspended; at PTRACE_EVENT_EXIT it is too late (the driver hangs).
//!
//! Written by hand (a six-instruction BPF program) because seccompiler
//! (Firecracker's) targets whole-policy allow-lists and the libseccomp binding
//! would add a C library to every host.
//!
//! RET_TRACE rather than a user-notification listener: CRIU can dump and
//! restore a RET_TRACE filter (a listener cannot be restored), and any later
//! tracer (a restarted guard, the one `wake` attaches) catches exits again.
//! Its cost: with no tracer attached the kernel fails `exit_group` with
//! ENOSYS. So the guard leaves a standby keeper that re-attaches a new guard
//! the moment the old one dies (see `keeper`).

use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

const BPF_LD_W_ABS: u16 = 0x20; // BPF_LD | BPF_W | BPF_ABS
const BPF_JEQ_K: u16 = 0x15; // BPF_JMP | BPF_JEQ | BPF_K
const BPF_RET_K: u16 = 0x06; // BPF_RET | BPF_K
/// The native ABI (seccomp_data.arch) and its compat ABI (i386 on x86-64,
/// arm on aarch64), with `exit_group`'s number in each. x32 shares the
/// native arch and marks its numbers with bit 30.
#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH_NATIVE: u32 = 0xc000_003e;
#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH_COMPAT: u32 = 0x4000_0003;
#[cfg(target_arch = "x86_64")]
const NR_COMPAT_EXIT_GROUP: u32 = 252;
#[cfg(target_arch = "x86_64")]
const X32_BIT: u32 = 0x4000_0000;
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH_NATIVE: u32 = 0xc000_00b7;
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH_COMPAT: u32 = 0x4000_0028;
#[cfg(target_arch = "aarch64")]
const NR_COMPAT_EXIT_GROUP: u32 = 248;
#[cfg(target_arch = "aarch64")]
const X32_BIT: u32 = 0;
const OFFSET_NR: u32 = 0; // seccomp_data.nr
const OFFSET_ARCH: u32 = 4; // seccomp_data.arch

fn insn(code: u16, jt: u8, jf: u8, k: u32) -> libc::sock_filter {
    libc::sock_filter { code, jt, jf, k }
}

/// `exit_group` -> stop for the tracer, whichever way it is called: the
/// native ABI, x32 (x86-64), or the compat ABI (`int 0x80` on x86-64, a
/// 32-bit arm program on aarch64), each of which would otherwise end the
/// process unsuspended. Everything else -> allow.
fn program() -> [libc::sock_filter; 11] {
    let nr = libc::SYS_exit_group as u32;
    [
        /* 0 */ insn(BPF_LD_W_ABS, 0, 0, OFFSET_ARCH),
        /* 1 */ insn(BPF_JEQ_K, 0, 4, AUDIT_ARCH_NATIVE), // no: 6
        /* 2 */ insn(BPF_LD_W_ABS, 0, 0, OFFSET_NR),
        /* 3 */ insn(BPF_JEQ_K, 5, 0, nr), // yes: 9
        /* 4 */ insn(BPF_JEQ_K, 4, 0, nr | X32_BIT), // yes: 9
        /* 5 */ insn(BPF_RET_K, 0, 0, libc::SECCOMP_RET_ALLOW),
        /* 6 */ insn(BPF_JEQ_K, 0, 3, AUDIT_ARCH_COMPAT), // no: 10
        /* 7 */ insn(BPF_LD_W_ABS, 0, 0, OFFSET_NR),
        /* 8 */ insn(BPF_JEQ_K, 0, 1, NR_COMPAT_EXIT_GROUP), // no: 10
        /* 9 */ insn(BPF_RET_K, 0, 0, libc::SECCOMP_RET_TRACE),
        /* 10 */ insn(BPF_RET_K, 0, 0, libc::SECCOMP_RET_ALLOW),
    ]
}

/// Installs the filter on the calling thread. Meant for the child between
/// fork and exec: it allocates nothing and makes only async-signal-safe
/// system calls.
pub fn install_in_child() -> Result<(), i32> {
    let prog = program();
    let fprog = libc::sock_fprog { len: prog.len() as u16, filter: prog.as_ptr() as *mut libc::sock_filter };
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        set_no_new_privs()?;
    }
    match set_filter(&fprog) {
        // Root without CAP_SYS_ADMIN (a container's root): a filter needs
        // no_new_privs there too.
        Err(libc::EACCES) => {
            set_no_new_privs()?;
            set_filter(&fprog)
        }
        r => r,
    }
}

/// Without CAP_SYS_ADMIN a filter needs no_new_privs.
fn set_no_new_privs() -> Result<(), i32> {
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(errno());
    }
    Ok(())
}

fn set_filter(fprog: &libc::sock_fprog) -> Result<(), i32> {
    // SAFETY: fprog points at a valid program that outlives the call; the
    // kernel copies it.
    let r = unsafe {
        libc::syscall(libc::SYS_seccomp, libc::SECCOMP_SET_MODE_FILTER, 0, fprog as *const libc::sock_fprog)
    };
    if r != 0 {
        return Err(errno());
    }
    Ok(())
}

fn errno() -> i32 {
    io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)
}

pub fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags, returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs the filter on (arch, nr) as the kernel would (the four
    /// instructions it uses).
    fn run(arch: u32, nr: u32) -> u32 {
        let p = program();
        let (mut pc, mut acc) = (0usize, 0u32);
        loop {
            let i = p[pc];
            match i.code {
                BPF_LD_W_ABS => acc = if i.k == OFFSET_ARCH { arch } else { nr },
                BPF_JEQ_K => {
                    pc += usize::from(if acc == i.k { i.jt } else { i.jf });
                }
                BPF_RET_K => return i.k,
                other => panic!("unexpected instruction {other:#x}"),
            }
            pc += 1;
        }
    }

    #[test]
    fn the_program_traps_exit_group_only() {
        let nr = libc::SYS_exit_group as u32;
        assert_eq!(run(AUDIT_ARCH_NATIVE, nr), libc::SECCOMP_RET_TRACE);
        assert_eq!(run(AUDIT_ARCH_NATIVE, libc::SYS_exit as u32), libc::SECCOMP_RET_ALLOW);
        assert_eq!(run(AUDIT_ARCH_NATIVE, libc::SYS_write as u32), libc::SECCOMP_RET_ALLOW);
        assert_eq!(run(AUDIT_ARCH_NATIVE, NR_COMPAT_EXIT_GROUP), libc::SECCOMP_RET_ALLOW);
        assert_eq!(run(0x1234, nr), libc::SECCOMP_RET_ALLOW);
    }

    #[test]
    fn exit_group_through_the_compat_and_x32_abis_is_trapped_too() {
        let nr = libc::SYS_exit_group as u32;
        assert_eq!(run(AUDIT_ARCH_COMPAT, NR_COMPAT_EXIT_GROUP), libc::SECCOMP_RET_TRACE);
        assert_eq!(run(AUDIT_ARCH_COMPAT, 1), libc::SECCOMP_RET_ALLOW);
        assert_eq!(run(AUDIT_ARCH_NATIVE, nr | X32_BIT), libc::SECCOMP_RET_TRACE);
    }
}
