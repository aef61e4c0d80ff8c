//! A client of the node's container runtime through the Kubernetes CRI v1
//! API (containerd, CRI-O) over its unix socket: what the kubelet sees of
//! pods and containers, read the way the kubelet reads it.
//!
//! One job: talk CRI. Every call is bounded by the client's timeout; every
//! failure is a [`CriError`] naming the call. The read calls return the
//! plain types of [`types`]; [`Cri::runtime`] hands out the generated
//! client for the calls a kubelet makes (run, create, start, stop, remove),
//! which the tests use to drive a runtime.

mod error;
pub mod types;

pub use error::CriError;
pub use types::{Container, ContainerStatus, Pod, PodStatus, Version};

/// The CRI v1 messages and the runtime service's client, generated from
/// `proto/api.proto` by the build script.
#[allow(clippy::all, missing_docs)]
pub mod api {
    tonic::include_proto!("runtime.v1");
}

use api::runtime_service_client::RuntimeServiceClient;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tonic::transport::{Channel, Endpoint, Uri};

/// A connection to one runtime's CRI socket.
#[derive(Clone)]
pub struct Cri {
    client: RuntimeServiceClient<Channel>,
    socket: PathBuf,
    timeout: Duration,
}

impl Cri {
    /// Connects to the runtime at `socket`; each later call gives up after
    /// `timeout`. The connection is made lazily: a runtime that is down
    /// fails the first call, not this. Called within a tokio runtime, on
    /// which the connection lives.
    pub fn new(socket: &Path, timeout: Duration) -> Result<Self, CriError> {
        let path = socket.to_path_buf();
        // The URI is a placeholder: the connector dials the socket.
        let endpoint = Endpoint::from_static("http://cri.invalid").connect_timeout(timeout).timeout(timeout);
        let channel = endpoint.connect_with_connector_lazy(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                let s = tokio::net::UnixStream::connect(&path).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(s))
            }
        }));
        Ok(Self { client: RuntimeServiceClient::new(channel), socket: socket.to_path_buf(), timeout })
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The generated client, for the calls that change the runtime's state
    /// (a kubelet's: RunPodSandbox, CreateContainer, StartContainer...).
    /// Callers bound them with [`Cri::bounded`].
    pub fn runtime(&self) -> RuntimeServiceClient<Channel> {
        self.client.clone()
    }

    /// Runs one call of the generated client within the client's timeout.
    pub async fn bounded<T, F>(&self, call: &'static str, f: F) -> Result<T, CriError>
    where
        F: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        tracing::debug!(call, socket = %self.socket.display(), "cri");
        match tokio::time::timeout(self.timeout, f).await {
            Err(_) => Err(CriError::Timeout { call, after: self.timeout }),
            Ok(Err(status)) => Err(CriError::from_status(call, &self.socket, status)),
            Ok(Ok(r)) => Ok(r.into_inner()),
        }
    }

    /// The runtime's name and versions (`Version`).
    pub async fn version(&self) -> Result<Version, CriError> {
        let mut c = self.runtime();
        let r = self.bounded("Version", c.version(api::VersionRequest { version: "v1".into() })).await?;
        Ok(Version {
            runtime_name: r.runtime_name,
            runtime_version: r.runtime_version,
            runtime_api_version: r.runtime_api_version,
        })
    }

    /// Every pod sandbox the runtime knows, ready or not (`ListPodSandbox`).
    pub async fn pods(&self) -> Result<Vec<Pod>, CriError> {
        let mut c = self.runtime();
        let r = self
            .bounded("ListPodSandbox", c.list_pod_sandbox(api::ListPodSandboxRequest { filter: None }))
            .await?;
        Ok(r.items.into_iter().map(Pod::from).collect())
    }

    /// One sandbox's state, IP and, from the verbose info, the pid of its
    /// sandbox process (whose network namespace is the pod's).
    pub async fn pod_status(&self, pod_id: &str) -> Result<PodStatus, CriError> {
        let mut c = self.runtime();
        let req = api::PodSandboxStatusRequest { pod_sandbox_id: pod_id.into(), verbose: true };
        let r = self.bounded("PodSandboxStatus", c.pod_sandbox_status(req)).await?;
        let status = r
            .status
            .ok_or_else(|| CriError::Malformed { call: "PodSandboxStatus", what: "no status".into() })?;
        Ok(PodStatus::new(status, &r.info))
    }

    /// The containers of one pod (all pods: None), running or not (`ListContainers`).
    pub async fn containers(&self, pod_id: Option<&str>) -> Result<Vec<Container>, CriError> {
        let mut c = self.runtime();
        let filter =
            pod_id.map(|id| api::ContainerFilter { pod_sandbox_id: id.into(), ..Default::default() });
        let r =
            self.bounded("ListContainers", c.list_containers(api::ListContainersRequest { filter })).await?;
        Ok(r.containers.into_iter().map(Container::from).collect())
    }

    /// One container's state and, from the verbose info (containerd's and
    /// CRI-O's `info` key), the host pid of its first process.
    pub async fn container_status(&self, container_id: &str) -> Result<ContainerStatus, CriError> {
        let mut c = self.runtime();
        let req = api::ContainerStatusRequest { container_id: container_id.into(), verbose: true };
        let r = self.bounded("ContainerStatus", c.container_status(req)).await?;
        let status = r
            .status
            .ok_or_else(|| CriError::Malformed { call: "ContainerStatus", what: "no status".into() })?;
        Ok(ContainerStatus::new(status, &r.info))
    }
}
