//! A real S3 server for the tests of remotes: moto_server on loopback.

use super::{free_port, wait_for};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A moto S3 server on a free loopback port, ended on drop.
pub struct Moto {
    child: Child,
    pub port: u16,
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts moto_server (with `extra_env`); without it the test is skipped
/// here and fails on CI (.ci/run installs it).
pub fn moto(extra_env: &[(&str, &str)]) -> Option<Moto> {
    let found =
        Command::new("moto_server").arg("--help").stdout(Stdio::null()).stderr(Stdio::null()).status();
    if !found.is_ok_and(|s| s.success()) {
        gpusnap_testkit::skip(
            "moto_server is not installed (pip install 'moto[server]'; .ci/run installs it)",
        );
        return None;
    }
    let port = free_port();
    let mut cmd = Command::new("moto_server");
    cmd.args(["-H", "127.0.0.1", "-p", &port.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    for (k, v) in extra_env {
        cmd.env(k, v);
    }
    let mut m = Moto { child: cmd.spawn().expect("start moto_server"), port };
    // Up when the port answers while this server still runs: one that
    // could not bind it (taken meanwhile) exits, and what answers is not it.
    wait_for(Duration::from_secs(120), || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() || !matches!(m.child.try_wait(), Ok(None))
    });
    if let Ok(Some(st)) = m.child.try_wait() {
        panic!("moto_server on port {port} exited at its start ({st}): was the port taken?");
    }
    Some(m)
}

/// The environment that points gpusnap's S3 client at moto on `port`.
pub fn s3_env(port: u16) -> Vec<(String, String)> {
    [
        ("AWS_ACCESS_KEY_ID", "testing".to_string()),
        ("AWS_SECRET_ACCESS_KEY", "testing".to_string()),
        ("AWS_REGION", "us-east-1".to_string()),
        ("AWS_ENDPOINT_URL", format!("http://127.0.0.1:{port}")),
        ("AWS_ALLOW_HTTP", "true".to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}
