//! Why a transition the policy tried (suspend, park, hibernate, start,
//! stop, restart, or an action asked through the API) did not happen. The
//! text of each is what the journal, the service's `last_error` and the
//! API's answer say.

use std::net::SocketAddr;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// The service is not in a state the transition starts from.
    #[error("{service} is {state}")]
    NotInState { service: String, state: &'static str },
    /// A request is in flight: the service is not idle.
    #[error("{service} has a request in flight")]
    HasTraffic { service: String },
    /// An adopted server is never hibernated (CRIU would make it the
    /// agent's child).
    #[error("{service} was adopted (pid_file/cgroup), not started by the agent: it is never hibernated")]
    AdoptedNotHibernated { service: String },
    /// An adopted server has no command to start it again with.
    #[error("{service} was adopted, not started by the agent: it cannot be restarted")]
    AdoptedNotRestarted { service: String },
    /// The service has no process (not started, or gone).
    #[error("no process")]
    NoProcess,
    /// A hibernated service has no image to wake.
    #[error("no image to wake")]
    NoImage,
    /// A suspended service's tree shows no CUDA process now (the driver
    /// cannot be asked about a stopped process): nothing is resumed.
    #[error("no CUDA process in the tree of {0} (stopped?): it stays suspended")]
    StaysSuspended(i32),
    /// The service's tree holds no CUDA process.
    #[error("no CUDA process in the tree of {0}")]
    NoCudaProcess(i32),
    /// Its backend's connections did not close in time for CRIU.
    #[error("{0} connections to its backend stayed open")]
    ConnectionsOpen(usize),
    /// Its image is kept until the process woken from it runs.
    #[error("{0} is kept until the process it was woken into runs")]
    ImageKept(String),
    /// An older image of the same name could not be removed.
    #[error("{name}: an older image is in the way: {source}")]
    ImageInTheWay { name: String, source: gpusnap_images::Error },
    /// The service has no command to start.
    #[error("no command to start")]
    NoCommand,
    /// Another program answers on the service's backend port.
    #[error(
        "backend {0} is already in use by another program: stop it or give the service another backend port"
    )]
    BackendInUse(SocketAddr),
    /// The server's log could not be opened.
    #[error("{0}")]
    Log(std::io::Error),
    /// `gpusnap run` could not be started.
    #[error("{exe}: {source}")]
    Spawn { exe: PathBuf, source: std::io::Error },
    /// The program did not appear under `gpusnap run` in time.
    #[error("the program did not start (see {})", log.display())]
    NotStarted { log: PathBuf },
    /// The program ended before it listened on its backend.
    #[error("the program ended before it listened on {backend} (see {})", log.display())]
    EndedBeforeListening { backend: SocketAddr, log: PathBuf },
    /// The service cannot come back now (its last start failed and the
    /// next is not due, or the wake timed out).
    #[error("{0}")]
    Unavailable(String),
    /// The engine could not be opened (its journal, the driver).
    #[error(transparent)]
    NoEngine(gpusnap_hibernate::Error),
    /// The engine (journal, admission, locks, driver, CRIU) refused or failed.
    #[error(transparent)]
    Engine(#[from] gpusnap_hibernate::Error),
    #[error(transparent)]
    Core(#[from] gpusnap_core::Error),
    /// THP `always` could not be set for the checkpoint.
    #[error(transparent)]
    Thp(#[from] gpusnap_core::thp::ThpError),
    /// The blocking task that carried the transition out panicked or was
    /// cancelled.
    #[error(transparent)]
    Task(#[from] tokio::task::JoinError),
}

impl PolicyError {
    /// The exit code gpusnap's own command would give for it: the engine's
    /// (3: no room on the GPU), 1 for everything else.
    pub fn exit_code(&self) -> i32 {
        match self {
            Self::Engine(e) => e.exit_code(),
            Self::Core(e) => e.exit_code(),
            _ => 1,
        }
    }

    /// The engine refused for want of room on the GPU (admission).
    pub fn no_room(&self) -> bool {
        self.exit_code() == 3
    }

    pub(super) fn not_in_state(svc: &crate::service::Service, state: crate::service::State) -> Self {
        Self::NotInState { service: svc.name.clone(), state: state.as_str() }
    }

    pub(super) fn has_traffic(svc: &crate::service::Service) -> Self {
        Self::HasTraffic { service: svc.name.clone() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_error_says_what_the_journal_and_the_api_said() {
        let s = || "llm".to_string();
        for (e, text) in [
            (PolicyError::NotInState { service: s(), state: "starting" }, "llm is starting"),
            (PolicyError::HasTraffic { service: s() }, "llm has a request in flight"),
            (
                PolicyError::AdoptedNotHibernated { service: s() },
                "llm was adopted (pid_file/cgroup), not started by the agent: it is never hibernated",
            ),
            (
                PolicyError::AdoptedNotRestarted { service: s() },
                "llm was adopted, not started by the agent: it cannot be restarted",
            ),
            (PolicyError::NoProcess, "no process"),
            (PolicyError::NoCudaProcess(7), "no CUDA process in the tree of 7"),
            (PolicyError::ConnectionsOpen(2), "2 connections to its backend stayed open"),
            (PolicyError::ImageKept("agent-llm".into()), "agent-llm is kept until the process it was woken into runs"),
            (
                PolicyError::BackendInUse("127.0.0.1:9000".parse().unwrap()),
                "backend 127.0.0.1:9000 is already in use by another program: stop it or give the service another backend port",
            ),
            (PolicyError::NotStarted { log: "/l".into() }, "the program did not start (see /l)"),
            (PolicyError::Unavailable("its last start failed".into()), "its last start failed"),
        ] {
            assert_eq!(e.to_string(), text);
        }
    }
}
