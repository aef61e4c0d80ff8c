//! What can go wrong talking to the runtime, by call.

use std::path::Path;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum CriError {
    /// The socket is not there or nobody answers on it.
    #[error("{socket}: {call}: cannot reach the runtime: {reason}")]
    Unreachable { call: &'static str, socket: String, reason: String },
    #[error("{call}: no answer within {after:?}")]
    Timeout { call: &'static str, after: Duration },
    /// The object named is gone (a pod or container removed meanwhile).
    #[error("{call}: not found: {message}")]
    NotFound { call: &'static str, message: String },
    /// The runtime answered with an error.
    #[error("{call}: {code}: {message}")]
    Call { call: &'static str, code: String, message: String },
    #[error("{call}: {what}")]
    Malformed { call: &'static str, what: String },
}

impl CriError {
    pub(crate) fn from_status(call: &'static str, socket: &Path, s: tonic::Status) -> Self {
        use tonic::Code;
        match s.code() {
            Code::NotFound => CriError::NotFound { call, message: s.message().to_string() },
            Code::Unavailable => CriError::Unreachable {
                call,
                socket: socket.display().to_string(),
                reason: s.message().to_string(),
            },
            Code::DeadlineExceeded => {
                CriError::Call { call, code: "deadline exceeded".into(), message: s.message().to_string() }
            }
            c => CriError::Call {
                call,
                code: format!("{c:?}").to_lowercase(),
                message: s.message().to_string(),
            },
        }
    }

    /// The object asked about does not exist (any more).
    pub fn is_not_found(&self) -> bool {
        matches!(self, CriError::NotFound { .. })
    }
}
