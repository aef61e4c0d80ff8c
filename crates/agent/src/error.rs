//! What can stop the agent from starting, with the exit code each gives.

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error("{0}")]
    Setup(String),
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
            AgentError::Core(e) => e.exit_code(),
        }
    }
}
