//! A containerd of the test's own: its root, state and sockets under the
//! test's temporary directory (CRI plugin off), an image imported from an
//! archive the test makes of a root file system (no registry; `native`
//! snapshotter), tasks run with `ctr run` in the host's pid namespace as the
//! podman tests run theirs (the fake driver knows a process by its host
//! pid). Every task and the daemon are ended on drop.

use crate::common::*;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

/// The namespace the tests' tasks run in.
pub const NS: &str = "gpusnap-test";
/// The image the tasks run.
pub const IMAGE: &str = "localhost/gpusnap-fake-cuda:test";

pub struct Containerd {
    pub dir: PathBuf,
    _tmp: tempfile::TempDir,
    daemon: Child,
    /// Mounted into the tasks: their status files.
    pub shared: PathBuf,
}

/// Whether containerd, ctr and runc are installed; `false` skips the test,
/// saying why, except in CI (CI=true), which installs them (.ci/run).
pub fn containerd_present() -> bool {
    let ok = |p: &str, a: &str| Command::new(p).arg(a).output().is_ok_and(|o| o.status.success());
    if ok("containerd", "--version") && ok("ctr", "--version") && ok("runc", "--version") {
        return true;
    }
    let why =
        "containerd, ctr and runc are not installed (apt-get install containerd runc; .ci/run installs them)";
    gpusnap_testkit::skip(why);
    false
}

impl Containerd {
    pub fn new(w: &World) -> Option<Containerd> {
        if !containerd_present() {
            return None;
        }
        let tmp = tempfile::Builder::new().prefix("gpusnap-ctrd").tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        let shared = w.tmp.path().join("shared");
        std::fs::create_dir_all(&shared).unwrap();
        let d = dir.display();
        std::fs::write(
            dir.join("config.toml"),
            format!(
                "version = 2\nroot = \"{d}/root\"\nstate = \"{d}/state\"\n\
                 disabled_plugins = [\"io.containerd.grpc.v1.cri\"]\n\
                 [grpc]\n  address = \"{d}/sock\"\n[ttrpc]\n  address = \"{d}/sock.ttrpc\"\n\
                 [debug]\n  address = \"{d}/debug.sock\"\n"
            ),
        )
        .unwrap();
        let log = std::fs::File::create(dir.join("containerd.log")).unwrap();
        let daemon = Command::new("containerd")
            .arg("--config")
            .arg(dir.join("config.toml"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("containerd");
        let c = Containerd { dir, _tmp: tmp, daemon, shared };
        let up = wait_until(Duration::from_secs(60), || c.ctr(&["version"]).status.success());
        assert!(up, "containerd did not start: {}", c.log());
        c.import_image();
        Some(c)
    }

    /// The test image, as a docker-save archive (one uncompressed layer of
    /// the root file system) imported into containerd's `native` snapshotter.
    fn import_image(&self) {
        let img = self.dir.join("image");
        build_rootfs(&self.dir.join("rootfs"), fake_workload_bin().parent().unwrap());
        std::fs::create_dir_all(&img).unwrap();
        let tar = |dir: &std::path::Path, out: &std::path::Path, what: &[&str]| {
            let st = Command::new("tar").arg("-C").arg(dir).arg("-cf").arg(out).args(what).status().unwrap();
            assert!(st.success(), "tar {}", out.display());
        };
        tar(&self.dir.join("rootfs"), &img.join("layer.tar"), &["."]);
        let sum = Command::new("sha256sum").arg(img.join("layer.tar")).output().expect("sha256sum");
        let sum = String::from_utf8_lossy(&sum.stdout).split_whitespace().next().unwrap_or("").to_string();
        assert_eq!(sum.len(), 64, "sha256sum of the layer");
        let config = serde_json::json!({
            "architecture": "amd64", "os": "linux", "config": {},
            "rootfs": { "type": "layers", "diff_ids": [format!("sha256:{sum}")] },
        });
        std::fs::write(img.join("config.json"), config.to_string()).unwrap();
        let manifest =
            serde_json::json!([{ "Config": "config.json", "RepoTags": [IMAGE], "Layers": ["layer.tar"] }]);
        std::fs::write(img.join("manifest.json"), manifest.to_string()).unwrap();
        let archive = self.dir.join("image.tar");
        tar(&img, &archive, &["manifest.json", "config.json", "layer.tar"]);
        self.ok(&["images", "import", "--snapshotter", "native", archive.to_str().unwrap()]);
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("containerd.log")).unwrap_or_default()
    }

    /// The environment gpusnap needs to find this containerd's tasks.
    pub fn env(&self, cmd: &mut Command) {
        cmd.env("GPUSNAP_CONTAINERD_STATE", self.dir.join("state"));
    }

    /// `ctr -n NS ARGS` against this containerd, bounded (two minutes).
    pub fn ctr(&self, args: &[&str]) -> Output {
        let mut cmd = Command::new("ctr");
        cmd.arg("--address").arg(self.dir.join("sock")).args(["-n", NS]).args(args).stdin(Stdio::null());
        bounded(cmd, Duration::from_secs(120))
    }

    pub fn ok(&self, args: &[&str]) -> String {
        let o = self.ctr(args);
        assert!(
            o.status.success(),
            "ctr {args:?}: {}\n{}\n{}",
            o.status,
            String::from_utf8_lossy(&o.stderr),
            self.log()
        );
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    }

    /// Runs task `id`: `cmd` in the test's image, with the fake
    /// world mounted (the build directory read-only) and its environment.
    pub fn run(&self, w: &World, id: &str, cmd: &[&str]) {
        let fake = w.fake_dir().display().to_string();
        let shared = self.shared.display().to_string();
        let target = fake_workload_bin().parent().unwrap().display().to_string();
        let mut args: Vec<String> = vec![
            "run".into(),
            "-d".into(),
            "--with-ns".into(),
            format!("pid:/proc/{}/ns/pid", std::process::id()),
            "--env".into(),
            format!("LD_LIBRARY_PATH={}", fake_libdir().display()),
            "--env".into(),
            format!("GPUSNAP_FAKE_DIR={fake}"),
        ];
        for (p, o) in [(&fake, "rw"), (&shared, "rw"), (&target, "ro")] {
            args.extend(["--mount".into(), format!("type=bind,src={p},dst={p},options=rbind:{o}")]);
        }
        args.extend(["--snapshotter".into(), "native".into(), IMAGE.into(), id.into()]);
        args.extend(cmd.iter().map(|s| s.to_string()));
        self.ok(&args.iter().map(|s| s.as_str()).collect::<Vec<_>>());
    }

    /// Task `id` running a fake CUDA program holding `mib`: its host pid,
    /// once it has done its first intact iteration, and its status file.
    pub fn workload(&self, w: &World, id: &str, mib: u64) -> (i32, PathBuf) {
        let status = self.shared.join(format!("status-{id}"));
        let wl = fake_workload_bin().display().to_string();
        let (m, s) = (mib.to_string(), status.display().to_string());
        self.run(w, id, &[&wl, "--mib", &m, "--status", &s]);
        wait_for(Duration::from_secs(60), || read_status(&status).is_some_and(|s| s.1 >= 1));
        (self.init_pid(id), status)
    }

    /// The host pid of task `id`'s first process, from the shim's state.
    pub fn init_pid(&self, id: &str) -> i32 {
        let p = self.dir.join("state/io.containerd.runtime.v2.task").join(NS).join(id).join("init.pid");
        std::fs::read_to_string(p).unwrap().trim().parse().unwrap()
    }

    /// gpusnap ARGS (JSON output) with this containerd: exit code, stdout,
    /// stderr.
    pub fn gpusnap(&self, w: &World, args: &[&str]) -> (i32, String, String) {
        let mut cmd = w.gpusnap_cmd(&["--json"]);
        self.env(&mut cmd);
        cmd.args(args);
        let o = bounded(cmd, Duration::from_secs(120));
        let text = |b: &[u8]| String::from_utf8_lossy(b).to_string();
        (o.status.code().unwrap_or(-1), text(&o.stdout), text(&o.stderr))
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        let list = self.ctr(&["task", "ls", "-q"]);
        for id in String::from_utf8_lossy(&list.stdout).split_whitespace() {
            let _ = self.ctr(&["task", "kill", "-s", "SIGKILL", id]);
            let _ = self.ctr(&["task", "rm", "-f", id]);
        }
        let list = self.ctr(&["container", "ls", "-q"]);
        for id in String::from_utf8_lossy(&list.stdout).split_whitespace() {
            let _ = self.ctr(&["container", "rm", id]);
        }
        let _ = self.ctr(&["images", "rm", IMAGE]);
        let _ = self.daemon.kill();
        let _ = self.daemon.wait();
    }
}
