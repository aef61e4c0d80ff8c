//! What can stop the agent from starting (or a command of its CLI), with
//! the exit code each gives.

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error("{0}")]
    Setup(String),
    /// A command's argument that cannot be (a service name that names no
    /// file): exit 2, nothing done.
    #[error("{0}")]
    BadInput(String),
    #[error(transparent)]
    Core(#[from] gpusnap_hibernate::Error),
}

impl From<gpusnap_core::Error> for AgentError {
    fn from(e: gpusnap_core::Error) -> Self {
        Self::Core(e.into())
    }
}

impl AgentError {
    pub fn exit_code(&self) -> i32 {
        match self {
            AgentError::Config(_) => 2,
            AgentError::Setup(_) => 1,
            AgentError::BadInput(_) => 2,
            AgentError::Core(e) => e.exit_code(),
        }
    }
}
