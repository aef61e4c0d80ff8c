//! A podman of the test's own: its storage (`--root`, `--runroot` through
//! `CONTAINERS_STORAGE_CONF`) and configuration (`CONTAINERS_CONF`) under the
//! test's temporary directory, so that nothing of the machine's own
//! containers or images is seen or touched; an image built from a rootfs
//! tarball the test makes (no registry); everything removed on drop.
//!
//! The configuration is the one docs/guides/containers.md gives: runc, or the
//! crun `scripts/install-criu.sh --crun` installs (Debian's crun 1.8.1 cannot
//! checkpoint), default ulimits that an unprivileged-ish root (no
//! CAP_SYS_RESOURCE) may set, no network, and a PATH for conmon that holds
//! the `cuda-checkpoint` CRIU's plugin runs.

use crate::common::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

pub const IMAGE: &str = "localhost/gpusnap-fake-cuda:test";

pub struct Podman {
    /// Everything of this podman: storage, configuration, the bin directory;
    /// apart from the world's directory, which containers mount.
    pub dir: PathBuf,
    _tmp: tempfile::TempDir,
    /// Mounted into the containers (with the fake driver's directory): the
    /// workloads' status files.
    pub shared: PathBuf,
    /// CRIU's configuration for runc and crun (`--annotation org.criu.config=...`).
    pub criu_conf: PathBuf,
    path: String,
    /// crun on a host of hybrid cgroups whose v2 hierarchy holds a
    /// controller: every podman runs in a mount namespace of its own where
    /// that hierarchy shows none (crun refuses such a host otherwise).
    hide_v2_controllers: bool,
}

/// The OCI runtime podman runs the containers with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Oci {
    Runc,
    Crun,
}

/// The hybrid hierarchy's v2 half, where crun looks for controllers.
const UNIFIED_CONTROLLERS: &str = "/sys/fs/cgroup/unified/cgroup.controllers";

/// A crun that can checkpoint (`crun --version` says +CRIU):
/// GPUSNAP_TEST_CRUN, the one `scripts/install-criu.sh --crun` installs, or
/// crun on PATH; None skips the test, saying why, except in CI.
pub fn crun_with_criu() -> Option<PathBuf> {
    let mut candidates: Vec<PathBuf> =
        std::env::var_os("GPUSNAP_TEST_CRUN").map(PathBuf::from).into_iter().collect();
    candidates.push(PathBuf::from("/opt/gpusnap/criu/bin/crun"));
    candidates
        .extend(std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()).map(|d| d.join("crun")));
    let found = candidates.into_iter().find(|c| {
        Command::new(c)
            .arg("--version")
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("+CRIU"))
    });
    if found.is_none() {
        let why = "no crun with CRIU support (scripts/install-criu.sh --crun, or GPUSNAP_TEST_CRUN=PATH)";
        gpusnap_testkit::skip(why);
    }
    found
}

/// Whether podman and runc are installed; `false` skips the test, saying
/// why, except in CI (CI=true), which installs them and must run it.
pub fn podman_present() -> bool {
    let ok = |p: &str| Command::new(p).arg("--version").output().is_ok_and(|o| o.status.success());
    if ok("podman") && ok("runc") {
        return true;
    }
    let why = "podman and runc are not installed (apt-get install podman runc; .ci/run installs them)";
    gpusnap_testkit::skip(why);
    false
}

/// The directory of CRIU's CUDA plugin for the criu on PATH
/// (GPUSNAP_TEST_CRIU_PLUGINS, else PREFIX/lib/criu next to PREFIX/bin/criu,
/// see criu_outside.rs), or None: the test is skipped, except in CI.
pub fn cuda_plugin_dir() -> Option<PathBuf> {
    if let Some(d) = plugin_dir_found() {
        return Some(d);
    }
    let why = "CRIU's cuda_plugin.so is not installed next to the criu on PATH \
               (scripts/install-criu.sh --cuda-plugin, or GPUSNAP_TEST_CRIU_PLUGINS=DIR)";
    gpusnap_testkit::skip(why);
    None
}

fn plugin_dir_found() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("GPUSNAP_TEST_CRIU_PLUGINS").map(PathBuf::from) {
        return Some(d).filter(|d| d.join("cuda_plugin.so").is_file());
    }
    let criu = std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|d| d.join("criu"))
        .find(|p| p.is_file())?;
    [Some(criu.clone()), std::fs::canonicalize(&criu).ok()]
        .into_iter()
        .flatten()
        .filter_map(|c| Some(c.parent()?.parent()?.join("lib/criu")))
        .find(|d| d.join("cuda_plugin.so").is_file())
}

fn write_exec(path: &Path, text: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

impl Podman {
    /// A podman for world `w`, with the test image imported; None when
    /// podman is not installed (outside CI).
    pub fn new(w: &World) -> Option<Podman> {
        Self::with(w, Oci::Runc)
    }

    /// A podman running its containers with `oci`.
    pub fn with(w: &World, oci: Oci) -> Option<Podman> {
        if !podman_present() {
            return None;
        }
        let runtime = match oci {
            Oci::Runc => "runtime = \"runc\"".to_string(),
            Oci::Crun => {
                let crun = crun_with_criu()?;
                format!("runtime = \"crun\"\n[engine.runtimes]\ncrun = [\"{}\"]", crun.display())
            }
        };
        let hide_v2_controllers = oci == Oci::Crun
            && std::fs::read_to_string(UNIFIED_CONTROLLERS).is_ok_and(|c| !c.trim().is_empty());
        let tmp = tempfile::Builder::new().prefix("gpusnap-podman").tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        let shared = w.tmp.path().join("shared");
        std::fs::create_dir_all(&shared).unwrap();
        let bin = dir.join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        let target = fake_workload_bin().parent().unwrap().to_path_buf();
        // gpusnap as NVIDIA's command, with the fake world's environment
        // (the plugin runs it with criu's, which runc gives only PATH).
        write_exec(
            &bin.join("cuda-checkpoint"),
            &format!(
                "#!/bin/sh\nGPUSNAP_FAKE_DIR='{}' GPUSNAP_STATE_DIR='{}' LD_LIBRARY_PATH='{}' exec '{}' cuda-checkpoint \"$@\"\n",
                w.fake_dir().display(),
                w.state_dir().display(),
                fake_libdir().display(),
                env!("CARGO_BIN_EXE_gpusnap"),
            ),
        );
        // The criu on PATH, with its CUDA plugin on without a GPU.
        let criu = std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
            .map(|d| d.join("criu"))
            .find(|p| p.is_file());
        if let Some(criu) = criu {
            write_exec(
                &bin.join("criu"),
                &format!("#!/bin/sh\nCRIU_FAULT=138 exec '{}' \"$@\"\n", criu.display()),
            );
        }
        let criu_conf = dir.join("criu.conf");
        // file-locks: gpusnap's state store, held by a guard in the container.
        let libdir = plugin_dir_found().map(|d| format!("libdir {}\n", d.display())).unwrap_or_default();
        std::fs::write(&criu_conf, format!("{libdir}file-locks\n")).unwrap();

        let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
        std::fs::write(
            dir.join("storage.conf"),
            format!(
                "[storage]\ndriver = \"vfs\"\ngraphroot = \"{0}/root\"\nrunroot = \"{0}/runroot\"\n",
                dir.display()
            ),
        )
        .unwrap();
        std::fs::write(
            dir.join("containers.conf"),
            format!(
                r#"[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]
netns = "none"
[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
tmp_dir = "{dir}/tmp"
volume_path = "{dir}/volumes"
conmon_env_vars = ["PATH={path}"]
{runtime}
"#,
                dir = dir.display(),
            ),
        )
        .unwrap();
        std::fs::write(dir.join("no-controllers"), "").unwrap();
        let p = Podman { dir, _tmp: tmp, shared, criu_conf, path, hide_v2_controllers };
        p.build_image(&target);
        Some(p)
    }

    /// The environment podman (and gpusnap, which asks podman) runs with.
    pub fn env(&self, cmd: &mut Command) {
        cmd.env("CONTAINERS_CONF", self.dir.join("containers.conf"))
            .env("CONTAINERS_STORAGE_CONF", self.dir.join("storage.conf"))
            .env("PATH", &self.path);
    }

    /// `podman ARGS`, bounded (two minutes), its output.
    pub fn podman(&self, args: &[&str]) -> Output {
        let mut cmd = if self.hide_v2_controllers {
            let mut c = Command::new("unshare");
            c.args(["--mount", "--propagation", "private", "sh", "-c"]).arg(format!(
                "mount --bind '{}' {UNIFIED_CONTROLLERS} && exec podman \"$@\"",
                self.dir.join("no-controllers").display()
            ));
            c.arg("podman");
            c
        } else {
            Command::new("podman")
        };
        self.env(&mut cmd);
        cmd.args(args).stdin(Stdio::null());
        bounded(cmd, Duration::from_secs(120))
    }

    /// `podman ARGS`, which must succeed; its stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let o = self.podman(args);
        assert!(o.status.success(), "podman {args:?}: {}\n{}", o.status, String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    }

    /// The image: the dynamic loader and libraries the fake workload and
    /// gpusnap need, busybox where the host has a static one; the binaries
    /// and the fake driver come in by a read-only bind mount of the build
    /// directory, as the NVIDIA container toolkit mounts the driver's.
    fn build_image(&self, target: &Path) {
        let root = self.dir.join("rootfs");
        build_rootfs(&root, target);
        let tar = self.dir.join("rootfs.tar");
        let st = Command::new("tar").arg("-C").arg(&root).arg("-cf").arg(&tar).arg(".").status().unwrap();
        assert!(st.success(), "tar of the rootfs");
        self.ok(&["import", tar.to_str().unwrap(), IMAGE]);
    }

    /// The flags that give a container the fake world: the fake driver's
    /// directory and the shared one (status files) read-write, the build directory
    /// read-only at the same paths, the fake driver's environment, CRIU's
    /// configuration, and the host's pid namespace: the fake driver, like
    /// the real one, knows a process by its host pid, which a process in a
    /// pid namespace of its own cannot learn.
    pub fn world_flags(&self, w: &World) -> Vec<String> {
        let mut f = vec!["--pid=host".to_string()];
        f.extend(self.mounts(w));
        f
    }

    /// [`Podman::world_flags`] less the host's pid namespace: a container
    /// of its own pids, where every CUDA call is made inside it (the fake
    /// driver then knows its processes by their pids in the container).
    pub fn mounts(&self, w: &World) -> Vec<String> {
        let fake = w.fake_dir().display().to_string();
        let shared = self.shared.display().to_string();
        let target = fake_workload_bin().parent().unwrap().display().to_string();
        vec![
            "-v".into(),
            format!("{fake}:{fake}"),
            "-v".into(),
            format!("{shared}:{shared}"),
            "-v".into(),
            format!("{target}:{target}:ro"),
            "-e".into(),
            format!("LD_LIBRARY_PATH={}", fake_libdir().display()),
            "-e".into(),
            format!("GPUSNAP_FAKE_DIR={}", w.fake_dir().display()),
            "--annotation".into(),
            format!("org.criu.config={}", self.criu_conf.display()),
        ]
    }

    /// Starts container `name` running a fake CUDA program that holds `mib`;
    /// returns its host pid once it has done its first intact iteration,
    /// and the status file it writes.
    pub fn workload(&self, w: &World, name: &str, mib: u64) -> (i32, PathBuf) {
        let status = self.shared.join(format!("status-{name}"));
        let mut args: Vec<String> = vec!["run".into(), "-d".into(), "--name".into(), name.into()];
        args.extend(self.world_flags(w));
        args.extend([
            IMAGE.into(),
            fake_workload_bin().display().to_string(),
            "--mib".into(),
            mib.to_string(),
            "--status".into(),
            status.display().to_string(),
        ]);
        let a: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
        self.ok(&a);
        wait_for(Duration::from_secs(60), || read_status(&status).is_some_and(|s| s.1 >= 1));
        (self.pid(name), status)
    }

    /// The host pid of the container's first process.
    pub fn pid(&self, name: &str) -> i32 {
        self.ok(&["inspect", "--format", "{{.State.Pid}}", name]).parse().unwrap()
    }

    pub fn status(&self, name: &str) -> String {
        self.ok(&["inspect", "--format", "{{.State.Status}}", name])
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        let _ = self.podman(&["rm", "--all", "--force", "--time", "0"]);
        let _ = self.podman(&["rmi", "--all", "--force"]);
        // Whatever podman left mounted under its directory.
        unmount_under(&self.dir);
    }
}
