//! A dying process whose CUDA context faulted, and what the guard does then.
//!
//! A context that took a sticky error (an illegal address, an ECC error, a
//! launch that failed: `gpusnap_cuda::ffi::STICKY_ERRORS`) answers that error
//! to every call, the checkpoint API's lock included: it cannot be suspended,
//! and its process tears it down as it dies. On some drivers that teardown
//! hangs the host (docs/design/safety.md, "A faulted context"). The guard
//! tells such a death apart by the lock's (or the checkpoint's) answer, adds
//! the kernel log's Xid lines for the process where it can read them, and
//! then follows the policy ([`OnFault`]): let the death go on, or hold the
//! process where it stands for the operator.

use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;

/// What the guard does with a dying process whose CUDA context faulted:
/// `run --on-fault` and `guard --on-fault` (with the `clap` feature) and the
/// agent's `on_fault` key spell it alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum OnFault {
    /// The death goes on: the process tears its context down.
    #[default]
    Exit,
    /// The process is kept from dying (traced: its threads stay stopped;
    /// light: the library blocks in its exit path) until the operator ends
    /// it (`gpusnap stop --force`) or reboots.
    Hold,
}

impl OnFault {
    pub fn as_str(self) -> &'static str {
        match self {
            OnFault::Exit => "exit",
            OnFault::Hold => "hold",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "exit" => Some(OnFault::Exit),
            "hold" => Some(OnFault::Hold),
            _ => None,
        }
    }
}

pub use gpusnap_core::store::FAULTED;

/// A faulted context as the guard saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    /// The sticky error the driver answered.
    pub code: i32,
    /// The call that answered it and the driver's text.
    pub detail: String,
    /// The kernel log's Xid lines for this process (best effort: empty where
    /// the log cannot be read).
    pub xids: Vec<String>,
}

impl Fault {
    /// One line for the journal.
    pub fn describe(&self) -> String {
        let mut s = format!("CUDA context faulted: {}", self.detail);
        if !self.xids.is_empty() {
            s.push_str("; kernel log: ");
            s.push_str(&self.xids.join(" | "));
        }
        s
    }
}

/// The most of the kernel log read, and the most Xid lines kept.
const KMSG_MAX_BYTES: usize = 4 << 20;
const XID_MAX: usize = 8;

/// The NVIDIA driver's Xid lines in the kernel log that name `pid`
/// (`NVRM: Xid (PCI:0000:3b:00): 31, pid=4242, name=python, ...`), from
/// `/dev/kmsg` (read without waiting, bounded). Empty where it cannot be
/// read (no `CAP_SYSLOG` with `dmesg_restrict`, a container).
pub fn xid_lines(pid: i32) -> Vec<String> {
    let Ok(mut f) = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open("/dev/kmsg")
    else {
        return Vec::new();
    };
    let mut lines = Vec::new();
    let mut total = 0usize;
    let mut buf = vec![0u8; 8192];
    // One record per read; EAGAIN at the end of the buffer, EPIPE when a
    // record was overwritten while reading (skip it and go on).
    while total < KMSG_MAX_BYTES {
        match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                total += n;
                let rec = String::from_utf8_lossy(&buf[..n]);
                let text = rec.split_once(';').map_or(&*rec, |(_, t)| t).trim_end();
                if let Some(line) = xid_for(text, pid) {
                    if lines.len() == XID_MAX {
                        lines.remove(0);
                    }
                    lines.push(line);
                }
            }
            Err(e) if e.raw_os_error() == Some(libc::EPIPE) => continue,
            Err(_) => break,
        }
    }
    lines
}

/// `text` when it is an Xid line about `pid`.
fn xid_for(text: &str, pid: i32) -> Option<String> {
    let at = text.find("NVRM: Xid")?;
    let line = &text[at..];
    let want = format!("pid={pid},");
    let names_it = line.contains(&want) || line.ends_with(&format!("pid={pid}"));
    names_it.then(|| line.chars().take(300).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xid_lines_are_told_by_pid() {
        let l =
            "NVRM: Xid (PCI:0000:3b:00): 31, pid=4242, name=python3, Ch 00000008, intr 10000000. MMU Fault";
        assert_eq!(xid_for(l, 4242).as_deref(), Some(l));
        assert_eq!(xid_for(l, 424), None);
        assert_eq!(
            xid_for("NVRM: Xid (PCI:0000:3b:00): 13, pid=7", 7).as_deref(),
            Some("NVRM: Xid (PCI:0000:3b:00): 13, pid=7")
        );
        assert_eq!(xid_for("usb 1-1: new device, pid=4242,", 4242), None);
    }

    #[test]
    fn policies_by_name() {
        assert_eq!(OnFault::parse("hold"), Some(OnFault::Hold));
        assert_eq!(OnFault::parse("exit"), Some(OnFault::Exit));
        assert_eq!(OnFault::parse("keep"), None);
        assert_eq!(OnFault::default().as_str(), "exit");
    }
}
