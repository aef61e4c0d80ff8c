//! A containerd of the test's own, driven as a kubelet drives it: its root,
//! state, socket, configuration and CNI network under the test's temporary
//! directory (nothing of the machine's containers or images seen or
//! touched), the CRI plugin with the `native` snapshotter, a bridge network
//! of its own from Debian's CNI plugins, a pause image and a workload image
//! made from a rootfs and imported (no registry); everything removed on drop.

use crate::common::*;
use crate::image::oci_archive;
use gpusnap_cri::api;
use gpusnap_cri::Cri;
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

pub const PAUSE: &str = "localhost/gpusnap-pause:test";
pub const WORKLOAD: &str = "localhost/gpusnap-workload:test";
const CNI_BIN: &str = "/usr/lib/cni";
const LONG: Duration = Duration::from_secs(120);

pub struct Containerd {
    pub dir: PathBuf,
    _tmp: tempfile::TempDir,
    child: Option<Child>,
    pub socket: PathBuf,
    pub rt: tokio::runtime::Runtime,
    pub cri: Cri,
    /// Mounted into the pods: the workloads' status files.
    pub shared: PathBuf,
    bridge: String,
    /// Its network's index (the claim file's).
    net: u32,
}

/// A pod the test runs: its sandbox, its one container and that
/// container's host pid, the status file its workload writes (a fake
/// server writes none) and the container's log.
pub struct TestPod {
    pub id: String,
    pub pid: i32,
    container_id: String,
    sandbox: api::PodSandboxConfig,
    container: api::ContainerConfig,
    pub status: PathBuf,
    pub log: PathBuf,
}

/// How a test pod's container sees the node.
pub enum Sight {
    /// The node's pid namespace, and the node's state directory mounted
    /// read-only (`GPUSNAP_STATE_DIR`).
    Node,
    /// A pid namespace of its own, as a pod's container has by default: its
    /// server is pid 1 there. `state_dir`: the node's state directory
    /// mounted read-only too; `run_dir`: its `probe/` (the agent's probe
    /// socket) mounted read-only at `/run/gpusnap/probe`.
    OwnPids { state_dir: bool, run_dir: Option<PathBuf> },
}

/// Whether this test can run a containerd: root, containerd, ctr, runc and
/// the CNI plugins. `false` skips the test, saying why, except in CI
/// (CI=true), which installs them and must run it.
pub fn containerd_present() -> bool {
    let why = if !nix::unistd::geteuid().is_root() {
        "not root (containerd and its CRI plugin need root)"
    } else if !["containerd", "ctr", "runc"].iter().all(|p| which(p)) {
        "containerd, ctr or runc is not installed (apt-get install containerd runc)"
    } else if !Path::new(CNI_BIN).join("bridge").is_file() {
        "the CNI plugins are not in /usr/lib/cni (apt-get install containernetworking-plugins)"
    } else {
        return true;
    };
    gpusnap_testkit::skip(why);
    false
}

fn which(p: &str) -> bool {
    std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()).any(|d| d.join(p).is_file())
}

/// A network of its own for each containerd (tests run side by side, in
/// processes of their own): the first index 1..=250 whose claim file this
/// test creates, or takes over from a test process that is gone.
fn net_index() -> u32 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let start = std::process::id().wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed));
    for i in 0..250 {
        let n = (start + i) % 250 + 1;
        let claim = net_claim(n);
        let me = std::process::id().to_string();
        if std::fs::OpenOptions::new().write(true).create_new(true).open(&claim).is_ok() {
            std::fs::write(&claim, &me).unwrap();
            return n;
        }
        let owner = std::fs::read_to_string(&claim).ok().and_then(|s| s.trim().parse::<i32>().ok());
        if owner.is_some_and(|p| p > 0 && !Path::new(&format!("/proc/{p}")).exists()) {
            std::fs::write(&claim, &me).unwrap();
            return n;
        }
    }
    panic!("no free test network: 250 claims in /tmp/gsnap-ctd-net.*");
}

fn net_claim(n: u32) -> PathBuf {
    PathBuf::from(format!("/tmp/gsnap-ctd-net.{n}"))
}

impl Containerd {
    /// A running containerd with both images imported; None when this
    /// machine cannot run one (outside CI).
    pub fn new() -> Option<Containerd> {
        if !containerd_present() {
            return None;
        }
        // Short: the socket's path must fit a sockaddr_un.
        let tmp = tempfile::Builder::new().prefix("gsnap-ctd").tempdir_in("/tmp").unwrap();
        let dir = tmp.path().to_path_buf();
        let shared = dir.join("shared");
        for d in ["root", "state", "net.d", "ipam", "logs"] {
            std::fs::create_dir_all(dir.join(d)).unwrap();
        }
        std::fs::create_dir_all(&shared).unwrap();
        let n = net_index();
        let bridge = format!("gsnap{n}");
        let net = n;
        std::fs::write(
            dir.join("net.d/10-gpusnap-test.conflist"),
            serde_json::to_vec_pretty(&serde_json::json!({
                "cniVersion": "1.0.0",
                "name": format!("gpusnap-test-{n}"),
                "plugins": [
                    {
                        "type": "bridge", "bridge": bridge, "isGateway": true, "ipMasq": false,
                        "ipam": {
                            "type": "host-local",
                            "dataDir": dir.join("ipam"),
                            // Up to .200: the addresses above are the node's
                            // (`client_address`).
                            "ranges": [[{
                                "subnet": format!("10.89.{n}.0/24"),
                                "rangeEnd": format!("10.89.{n}.200"),
                            }]],
                            "routes": [{ "dst": "0.0.0.0/0" }],
                        },
                    },
                    { "type": "loopback" },
                ],
            }))
            .unwrap(),
        )
        .unwrap();
        let socket = dir.join("containerd.sock");
        let d = dir.display();
        std::fs::write(
            dir.join("config.toml"),
            format!(
                r#"version = 2
root = "{d}/root"
state = "{d}/state"
[grpc]
  address = "{d}/containerd.sock"
[ttrpc]
  address = "{d}/containerd.sock.ttrpc"
[debug]
  address = "{d}/debug.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE}"
  disable_apparmor = true
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "native"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "{d}/net.d"
"#
            ),
        )
        .unwrap();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        // The client's connection lives on the runtime it was made in.
        let cri = {
            let _in = rt.enter();
            Cri::new(&socket, Duration::from_secs(60)).unwrap()
        };
        let log = std::fs::File::create(dir.join("containerd.log")).unwrap();
        // Owned by the value at once: a failure from here on still ends it.
        let child = Command::new("containerd")
            .arg("--config")
            .arg(dir.join("config.toml"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start containerd");
        let c = Containerd { dir, _tmp: tmp, child: Some(child), socket, rt, cri, shared, bridge, net };
        wait_for(LONG, || c.rt.block_on(c.cri.version()).is_ok());
        c.import_images();
        Some(c)
    }

    /// The test's images: the dynamic loader and the libraries the fake
    /// workload and gpusnap need, busybox, and `/pause` (the sandbox's
    /// process: sleeps until stopped). The binaries and the fake driver
    /// come in by read-only bind mounts of the build directory.
    fn import_images(&self) {
        let root = self.dir.join("rootfs");
        std::fs::create_dir_all(root.join("run")).unwrap();
        let target = fake_workload_bin().parent().unwrap().to_path_buf();
        let busybox = build_rootfs(&root, &target);
        assert!(busybox, "busybox-static (apt-get install busybox-static)");
        let pause = root.join("pause");
        std::fs::write(&pause, "#!/bin/sh\ntrap 'exit 0' TERM INT\nwhile :; do sleep 3600 & wait $!; done\n")
            .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&pause, std::fs::Permissions::from_mode(0o755)).unwrap();
        for (name, entry, file) in [(PAUSE, "/pause", "pause.tar"), (WORKLOAD, "/bin/sh", "workload.tar")] {
            let out = self.dir.join(file);
            oci_archive(&root, name, &[entry], &out);
            let mut cmd = Command::new("ctr");
            cmd.arg("--address").arg(&self.socket).args([
                "-n",
                "k8s.io",
                "images",
                "import",
                "--snapshotter",
                "native",
            ]);
            cmd.arg(&out);
            let o = bounded(cmd, LONG);
            assert!(o.status.success(), "ctr import {name}: {}", String::from_utf8_lossy(&o.stderr));
        }
    }

    fn sandbox_config(&self, ns: &str, name: &str, annotations: &[(&str, &str)]) -> api::PodSandboxConfig {
        let logs = self.dir.join("logs").join(format!("{ns}_{name}"));
        std::fs::create_dir_all(&logs).unwrap();
        api::PodSandboxConfig {
            metadata: Some(api::PodSandboxMetadata {
                name: name.into(),
                namespace: ns.into(),
                uid: format!("uid-{ns}-{name}-{}", std::process::id()),
                attempt: 0,
            }),
            hostname: name.into(),
            log_directory: logs.display().to_string(),
            annotations: annotations.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            linux: Some(api::LinuxPodSandboxConfig {
                security_context: Some(api::LinuxSandboxSecurityContext {
                    // The fake driver, as the real one, knows a process by
                    // its host pid: the pods share the node's pid namespace.
                    namespace_options: Some(api::NamespaceOption {
                        pid: api::NamespaceMode::Node as i32,
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// Runs pod `ns/name` with one container that sleeps (no CUDA): a pod
    /// for the runtime to list. Returns the sandbox's id.
    pub fn run_sleeper(&self, ns: &str, name: &str) -> String {
        let config = self.sandbox_config(ns, name, &[]);
        let mut c = self.cri.runtime();
        let req = api::RunPodSandboxRequest { config: Some(config.clone()), runtime_handler: String::new() };
        let id = self.call("RunPodSandbox", c.run_pod_sandbox(req)).pod_sandbox_id;
        let container = api::ContainerConfig {
            metadata: Some(api::ContainerMetadata { name: "sleeper".into(), attempt: 0 }),
            image: Some(api::ImageSpec { image: WORKLOAD.into(), ..Default::default() }),
            command: vec!["/bin/sleep".into(), "1000000".into()],
            log_path: "sleeper.log".into(),
            ..Default::default()
        };
        let req = api::CreateContainerRequest {
            pod_sandbox_id: id.clone(),
            config: Some(container),
            sandbox_config: Some(config),
        };
        let cid = self.call("CreateContainer", c.create_container(req)).container_id;
        self.call("StartContainer", c.start_container(api::StartContainerRequest { container_id: cid }));
        id
    }

    /// Runs pod `ns/name` with `annotations` and one container `server`: a
    /// fake CUDA program holding `mib` of world `w`'s fake GPU; returns once
    /// it has done its first intact iteration.
    pub fn run_pod(
        &self,
        w: &World,
        ns: &str,
        name: &str,
        annotations: &[(&str, &str)],
        mib: u64,
    ) -> TestPod {
        self.run_pod_with(w, ns, name, annotations, mib, &[])
    }

    /// `run_pod`, the workload given `extra` arguments too.
    pub fn run_pod_with(
        &self,
        w: &World,
        ns: &str,
        name: &str,
        annotations: &[(&str, &str)],
        mib: u64,
        extra: &[&str],
    ) -> TestPod {
        self.run_pod_seeing(w, ns, name, annotations, mib, extra, &Sight::Node)
    }

    /// `run_pod_with`, the pod seeing the node as `sight` says.
    #[allow(clippy::too_many_arguments)]
    pub fn run_pod_seeing(
        &self,
        w: &World,
        ns: &str,
        name: &str,
        annotations: &[(&str, &str)],
        mib: u64,
        extra: &[&str],
        sight: &Sight,
    ) -> TestPod {
        let mut config = self.sandbox_config(ns, name, annotations);
        let own = matches!(sight, Sight::OwnPids { .. });
        if own {
            // The kubelet's default: the sandbox and each container a pid
            // namespace of its own.
            config.linux = None;
        }
        let mut c = self.cri.runtime();
        let req = api::RunPodSandboxRequest { config: Some(config.clone()), runtime_handler: String::new() };
        let id = self.call("RunPodSandbox", c.run_pod_sandbox(req)).pod_sandbox_id;
        let status = self.shared.join(format!("status-{ns}-{name}"));
        let target = fake_workload_bin().parent().unwrap().display().to_string();
        let mount = |p: &str, ro: bool| api::Mount {
            container_path: p.into(),
            host_path: p.into(),
            readonly: ro,
            ..Default::default()
        };
        let fake = w.fake_dir().display().to_string();
        let state = w.state_dir().display().to_string();
        std::fs::create_dir_all(&state).unwrap();
        let shared = self.shared.display().to_string();
        let env = |k: &str, v: String| api::KeyValue { key: k.into(), value: v };
        let container = api::ContainerConfig {
            metadata: Some(api::ContainerMetadata { name: "server".into(), attempt: 0 }),
            image: Some(api::ImageSpec { image: WORKLOAD.into(), ..Default::default() }),
            command: vec![fake_workload_bin().display().to_string()],
            args: ["--mib".to_string(), mib.to_string(), "--status".into(), status.display().to_string()]
                .into_iter()
                .chain(extra.iter().map(|a| a.to_string()))
                .collect(),
            envs: vec![
                env("LD_LIBRARY_PATH", fake_libdir().display().to_string()),
                env("GPUSNAP_FAKE_DIR", fake.clone()),
            ],
            mounts: vec![mount(&fake, false), mount(&shared, false), mount(&target, true)],
            log_path: "server.log".into(),
            linux: Some(api::LinuxContainerConfig {
                security_context: Some(api::LinuxContainerSecurityContext {
                    namespace_options: Some(api::NamespaceOption {
                        pid: if own { api::NamespaceMode::Container } else { api::NamespaceMode::Node }
                            as i32,
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let mut container = container;
        let state_dir = match sight {
            Sight::Node => true,
            Sight::OwnPids { state_dir, .. } => *state_dir,
        };
        if state_dir {
            // For `gpusnap probe` run in the container: the node's state.
            container.envs.push(env("GPUSNAP_STATE_DIR", state.clone()));
            container.mounts.push(mount(&state, true));
        }
        if let Sight::OwnPids { run_dir, .. } = sight {
            // The fake driver, as the real one in the kernel, knows the
            // server by its host pid: it reads the host's /proc, mounted
            // beside the container's own.
            container.mounts.push(api::Mount {
                container_path: "/host/proc".into(),
                host_path: "/proc".into(),
                readonly: true,
                ..Default::default()
            });
            container.envs.push(env("GPUSNAP_FAKE_PROC", "/host/proc".into()));
            if let Some(run) = run_dir {
                // The agent's probe directory, read-only, as the manifests
                // mount it; the admin socket beside it stays on the node.
                let probe = run.join("probe");
                std::fs::create_dir_all(&probe).unwrap();
                container.mounts.push(api::Mount {
                    container_path: "/run/gpusnap/probe".into(),
                    host_path: probe.display().to_string(),
                    readonly: true,
                    ..Default::default()
                });
            }
        }
        let log = PathBuf::from(&config.log_directory).join(&container.log_path);
        let mut pod =
            TestPod { id, pid: 0, status, log, container_id: String::new(), sandbox: config, container };
        self.start_container(&mut pod);
        pod
    }

    /// Runs pod `ns/name` as [`Self::run_pod`], its container a fake model
    /// server (`fake-workload --http`) on `port` of every address of the
    /// pod; returns once it listens.
    pub fn run_server_pod(
        &self,
        w: &World,
        ns: &str,
        name: &str,
        annotations: &[(&str, &str)],
        mib: u64,
        port: u16,
    ) -> TestPod {
        let port = port.to_string();
        let args = ["--http", &port, "--http-host", "0.0.0.0", "--print-ready"];
        self.run_pod_with(w, ns, name, annotations, mib, &args)
    }

    /// [`Self::run_server_pod`] in a pid namespace of its own, as `sight`.
    #[allow(clippy::too_many_arguments)]
    pub fn run_server_pod_seeing(
        &self,
        w: &World,
        ns: &str,
        name: &str,
        annotations: &[(&str, &str)],
        mib: u64,
        port: u16,
        sight: &Sight,
    ) -> TestPod {
        let port = port.to_string();
        let args = ["--http", &port, "--http-host", "0.0.0.0", "--print-ready"];
        self.run_pod_seeing(w, ns, name, annotations, mib, &args, sight)
    }

    /// The pod's IP on the test's network, as the runtime reports it.
    pub fn pod_ip(&self, pod: &TestPod) -> IpAddr {
        let st = self.rt.block_on(self.cri.pod_status(&pod.id)).unwrap();
        st.ip.parse().unwrap_or_else(|_| panic!("pod {}: no IP ({:?})", pod.id, st.ip))
    }

    /// The node's address on the pod network (its bridge's, the gateway):
    /// where the kubelet's probes of a pod come from.
    pub fn gateway(&self) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(10, 89, self.net as u8, 1))
    }

    /// Another address of the node on the pod network (outside the pods'
    /// range), added to the bridge: a client that is not the kubelet. The
    /// bridge exists once a pod has run.
    pub fn client_address(&self) -> IpAddr {
        let ip = Ipv4Addr::new(10, 89, self.net as u8, 254);
        let mut cmd = Command::new("ip");
        cmd.args(["addr", "replace", &format!("{ip}/32"), "dev", &self.bridge]);
        let o = bounded(cmd, LONG);
        assert!(o.status.success(), "ip addr replace {ip}: {}", String::from_utf8_lossy(&o.stderr));
        IpAddr::V4(ip)
    }

    /// Creates and starts the pod's container; returns once its workload
    /// has done its first intact iteration (a fake server: once it listens).
    fn start_container(&self, pod: &mut TestPod) {
        let mut c = self.cri.runtime();
        let req = api::CreateContainerRequest {
            pod_sandbox_id: pod.id.clone(),
            config: Some(pod.container.clone()),
            sandbox_config: Some(pod.sandbox.clone()),
        };
        let cid = self.call("CreateContainer", c.create_container(req)).container_id;
        self.call(
            "StartContainer",
            c.start_container(api::StartContainerRequest { container_id: cid.clone() }),
        );
        let pid =
            self.rt.block_on(self.cri.container_status(&cid)).unwrap().pid.expect("the container's pid");
        if pod.container.args.iter().any(|a| a == "--http") {
            // A fake server writes no status file: it says `ready PID` on
            // its stdout, which the runtime writes to the container's log.
            // In a pid namespace of its own it says its pid there (1).
            let ready = format!(" ready {pid}");
            let own = pod
                .container
                .linux
                .as_ref()
                .and_then(|l| l.security_context.as_ref())
                .and_then(|c| c.namespace_options.as_ref())
                .is_some_and(|n| n.pid == api::NamespaceMode::Container as i32);
            let said = |l: &str| l.ends_with(&ready) || (own && l.ends_with(" ready 1"));
            let listens = || std::fs::read_to_string(&pod.log).is_ok_and(|l| l.lines().any(said));
            if !wait_until(LONG, listens) {
                let st = self.rt.block_on(self.cri.container_status(&cid));
                let log = std::fs::read_to_string(&pod.log).unwrap_or_default();
                panic!("the server of pod {} does not listen: {st:?}\nits log:\n{log}", pod.id);
            }
        } else {
            wait_for(LONG, || read_status(&pod.status).is_some_and(|s| s.0 == pid && s.1 >= 1));
        }
        pod.container_id = cid;
        pod.pid = pid;
    }

    /// [`Self::exec`], or the runtime's refusal (a container whose process
    /// is gone cannot exec).
    pub fn exec_status(&self, pod: &TestPod, cmd: &[&str]) -> Result<(i32, String), String> {
        let mut c = self.cri.runtime();
        let req = api::ExecSyncRequest {
            container_id: pod.container_id.clone(),
            cmd: cmd.iter().map(|a| a.to_string()).collect(),
            timeout: 60,
        };
        let r =
            self.rt.block_on(self.cri.bounded("ExecSync", c.exec_sync(req))).map_err(|e| e.to_string())?;
        let text = String::from_utf8_lossy(&r.stdout).to_string() + &String::from_utf8_lossy(&r.stderr);
        Ok((r.exit_code, text))
    }

    /// `cmd` run in the pod's container as the kubelet runs an exec probe
    /// (ExecSync, the container's environment): its exit code and output.
    pub fn exec(&self, pod: &TestPod, cmd: &[&str]) -> (i32, String) {
        let mut c = self.cri.runtime();
        let req = api::ExecSyncRequest {
            container_id: pod.container_id.clone(),
            cmd: cmd.iter().map(|a| a.to_string()).collect(),
            timeout: 60,
        };
        let r = self.call("ExecSync", c.exec_sync(req));
        let text = String::from_utf8_lossy(&r.stdout).to_string() + &String::from_utf8_lossy(&r.stderr);
        (r.exit_code, text)
    }

    /// The pod's container ended and started anew, as the kubelet restarts
    /// a container that died: a new process in the same pod.
    pub fn restart_container(&self, pod: &mut TestPod) {
        let mut c = self.cri.runtime();
        let id = pod.container_id.clone();
        self.call(
            "StopContainer",
            c.stop_container(api::StopContainerRequest { container_id: id.clone(), timeout: 0 }),
        );
        self.call("RemoveContainer", c.remove_container(api::RemoveContainerRequest { container_id: id }));
        if let Some(m) = pod.container.metadata.as_mut() {
            m.attempt += 1;
        }
        self.start_container(pod);
    }

    /// Stops and removes a pod, as the kubelet does once it is deleted.
    pub fn remove_pod(&self, id: &str) {
        let mut c = self.cri.runtime();
        self.call(
            "StopPodSandbox",
            c.stop_pod_sandbox(api::StopPodSandboxRequest { pod_sandbox_id: id.into() }),
        );
        self.call(
            "RemovePodSandbox",
            c.remove_pod_sandbox(api::RemovePodSandboxRequest { pod_sandbox_id: id.into() }),
        );
    }

    fn call<T>(
        &self,
        what: &'static str,
        f: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> T {
        self.rt.block_on(self.cri.bounded(what, f)).unwrap_or_else(|e| {
            let log = std::fs::read_to_string(self.dir.join("containerd.log")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(30).collect();
            panic!("{e}\ncontainerd's log, last lines first:\n{}", tail.join("\n"))
        })
    }

    /// The `[kubernetes]` table of an agent following this containerd.
    pub fn agent_config(&self) -> String {
        format!(
            "[kubernetes]\ncri_socket = {:?}\npoll_interval = \"200ms\"\n",
            self.socket.display().to_string()
        )
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        // Every pod stopped and removed: their shims end, their network goes.
        if let Ok(pods) = self.rt.block_on(self.cri.pods()) {
            let mut c = self.cri.runtime();
            for p in pods {
                let id = p.id.clone();
                let _ = self.rt.block_on(self.cri.bounded(
                    "StopPodSandbox",
                    c.stop_pod_sandbox(api::StopPodSandboxRequest { pod_sandbox_id: id.clone() }),
                ));
                let _ = self.rt.block_on(self.cri.bounded(
                    "RemovePodSandbox",
                    c.remove_pod_sandbox(api::RemovePodSandboxRequest { pod_sandbox_id: id }),
                ));
            }
        }
        if let Some(mut child) = self.child.take() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            let end = std::time::Instant::now() + Duration::from_secs(30);
            while child.try_wait().ok().flatten().is_none() && std::time::Instant::now() < end {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        // A shim the removal missed (a failed test): it names our socket.
        let sock = self.socket.display().to_string();
        if let Ok(rd) = std::fs::read_dir("/proc") {
            for e in rd.flatten() {
                let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else { continue };
                let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
                if String::from_utf8_lossy(&cmd).contains(&sock) {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(pid),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                }
            }
        }
        // What containerd left mounted under its directory.
        unmount_under(&self.dir);
        let _ = Command::new("ip").args(["link", "del", &self.bridge]).stderr(Stdio::null()).status();
        let _ = std::fs::remove_file(net_claim(self.net));
    }
}
