//! What the lane's faults need around gpusnap: a real S3 server
//! (moto_server) to stop and start, and a small tmpfs to fill.

use anyhow::{bail, Result};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::host::{free_port, wait_until};

pub struct Moto {
    child: Option<Child>,
    pub port: u16,
}

impl Moto {
    /// Starts moto_server with bucket `soak`; None when it is not installed.
    pub fn start() -> Option<Moto> {
        let found =
            Command::new("moto_server").arg("--help").stdout(Stdio::null()).stderr(Stdio::null()).status();
        if !found.is_ok_and(|s| s.success()) {
            return None;
        }
        let mut m = Moto { child: None, port: free_port() };
        m.restart().ok()?;
        Some(m)
    }

    /// Starts it again on its port (an empty server: moto keeps nothing).
    pub fn restart(&mut self) -> Result<()> {
        self.kill();
        for _ in 0..3 {
            let mut c = Command::new("moto_server")
                .args(["-H", "127.0.0.1", "-p", &self.port.to_string()])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()?;
            let port = self.port;
            let up = wait_until(Duration::from_secs(120), || {
                std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() || !matches!(c.try_wait(), Ok(None))
            });
            if up && matches!(c.try_wait(), Ok(None)) {
                self.child = Some(c);
                return self.bucket();
            }
            let _ = c.kill();
            let _ = c.wait();
            std::thread::sleep(Duration::from_secs(1));
        }
        bail!("moto_server did not start again on port {}", self.port)
    }

    fn bucket(&self) -> Result<()> {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.port))?;
        write!(
            s,
            "PUT /soak HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            self.port
        )?;
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        if !out.starts_with("HTTP/1.1 200") {
            bail!("creating the bucket: {}", out.lines().next().unwrap_or(""));
        }
        Ok(())
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn env(&self) -> Vec<(String, String)> {
        [
            ("AWS_ACCESS_KEY_ID", "testing".to_string()),
            ("AWS_SECRET_ACCESS_KEY", "testing".to_string()),
            ("AWS_REGION", "us-east-1".to_string()),
            ("AWS_ENDPOINT_URL", format!("http://127.0.0.1:{}", self.port)),
            ("AWS_ALLOW_HTTP", "true".to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Mounts a tmpfs of `mib` MiB, mode 0700, on `dir` (root only); false when
/// it could not be.
pub fn mount_tmpfs(dir: &Path, mib: u64) -> bool {
    // SAFETY: geteuid has no arguments and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return false;
    }
    Command::new("mount")
        .args(["-t", "tmpfs", "-o", &format!("size={mib}m,mode=0700"), "soak-state"])
        .arg(dir)
        .status()
        .is_ok_and(|s| s.success())
}

pub fn umount(dir: &Path) {
    for _ in 0..20 {
        if Command::new("umount").arg(dir).status().is_ok_and(|s| s.success()) {
            return;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Fills the filesystem of `dir` with `file` until `leave` bytes are free.
pub fn fill(dir: &Path, file: &Path, leave: u64) {
    let Ok(out) = Command::new("df").args(["-B1", "--output=avail"]).arg(dir).output() else { return };
    let avail: u64 =
        String::from_utf8_lossy(&out.stdout).lines().nth(1).and_then(|l| l.trim().parse().ok()).unwrap_or(0);
    let n = avail.saturating_sub(leave);
    if let Ok(f) = std::fs::File::create(file) {
        // Written, not sparse: a tmpfs counts only pages written.
        use std::io::Write;
        let mut w = std::io::BufWriter::new(f);
        let block = vec![0x17u8; 1 << 20];
        let mut left = n;
        while left > 0 {
            let k = left.min(block.len() as u64) as usize;
            if w.write_all(&block[..k]).is_err() {
                break;
            }
            left -= k as u64;
        }
        let _ = w.flush();
    }
}
