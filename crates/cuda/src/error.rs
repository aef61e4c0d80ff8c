use crate::Call;
use std::fmt;
use std::time::Duration;

/// A `CUresult` with its name as the driver spells it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Code {
    pub raw: i32,
    pub name: String,
}

impl Code {
    pub fn is(&self, raw: i32) -> bool {
        self.raw == raw
    }
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name, self.raw)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    #[error("cannot load {lib}: {reason} (gpusnap needs the NVIDIA driver, r570 or newer)")]
    Load { lib: String, reason: String },
    #[error("{lib} does not export {symbol}: the checkpoint API needs NVIDIA driver r570 or newer")]
    MissingSymbol { lib: String, symbol: &'static str },
    #[error("the driver's API version {found} is older than {needed}, the first with the checkpoint API (driver r570)")]
    TooOld { found: i32, needed: i32 },
    #[error("GPU remapping needs driver API 13000 (r580) or newer, this driver has {found}")]
    NoRemap { found: i32 },
    #[error("{call} failed: {code}")]
    Call { call: Call, code: Code },
    #[error("{call} did not return within {}s (the driver may be stuck on this process)", .after.as_secs())]
    Timeout { call: Call, after: Duration },
}

impl DriverError {
    /// The driver's code, when the error came from a call that returned.
    pub fn code(&self) -> Option<i32> {
        match self {
            Self::Call { code, .. } => Some(code.raw),
            _ => None,
        }
    }

    /// The call found the process's CUDA context faulted: it answered one
    /// of the sticky errors ([`crate::ffi::STICKY_ERRORS`]).
    pub fn is_sticky(&self) -> bool {
        self.code().is_some_and(crate::ffi::is_sticky)
    }
}
