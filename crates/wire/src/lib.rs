//! The wire between gpusnap and the library it loads into programs
//! (`libgpusnap_preload.so`, crates/preload): one definition of each side
//! of the two conversations they hold, so that the speaker and the listener
//! cannot drift apart.
//!
//! - [`names`]: the environment variables and socket names both sides agree
//!   on (`@gpusnap-swap-PID-RANDOM`, `light-PID.sock`);
//! - [`swap`]: the fast-swap control protocol (`status`, `offload`,
//!   `restore`; `ok ...`, `error KIND: DETAIL`, `progress ms=N`);
//! - [`guard`]: the light guard's protocol (`dying WHY start=T`,
//!   `detach PIDS`; `ok`, `hold`, `error: WHY`, heartbeat bytes);
//! - [`sock`]: unix socket addresses (abstract names and paths), connect,
//!   bind and listen on abstract names, and the peer's credentials and
//!   pidfd.
//!
//! The library speaks part of this from signal handlers: everything it
//! calls there ([`guard::encode_dying`], [`guard::scan_answer`],
//! [`sock::Addr`]) writes into the caller's buffers, allocates nothing and
//! makes no system call. The rest allocates freely.
//!
//! Only libc below it: the preload library links it into every program it
//! is loaded into.

pub mod guard;
pub mod names;
pub mod sock;
pub mod swap;

/// A line that is not what the protocol says: what was wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError {
    /// The protocol's name for the line (`fast swap answer`, `guard request`, ...).
    pub what: &'static str,
    /// What was wrong.
    pub why: String,
}

impl ParseError {
    pub(crate) fn new(what: &'static str, why: impl Into<String>) -> Self {
        Self { what, why: why.into() }
    }
}

impl std::fmt::Display for ParseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "malformed {}: {}", self.what, self.why)
    }
}

impl std::error::Error for ParseError {}

/// A decimal number, or an error naming the key it was for.
pub(crate) fn number<T: std::str::FromStr>(what: &'static str, key: &str, v: &str) -> Result<T, ParseError> {
    v.parse().map_err(|_| ParseError::new(what, format!("{key}={v} is not a number")))
}
