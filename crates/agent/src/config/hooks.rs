//! `[service.hooks]`: HTTP calls to a server's own backend around its
//! suspends and resumes.

use crate::units::duration;
use serde::Deserialize;
use std::time::Duration;
use toml::Spanned;

/// `[service.hooks]` (in a `[[service]]` array: `hooks.before_suspend = {...}`
/// or a `[service.hooks]` table after the service's keys).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hooks {
    /// Before each suspend (idle, eviction, API): the server gives back what
    /// need not be saved (its KV cache). Failing or late, the suspend goes on.
    pub before_suspend: Option<Spanned<Hook>>,
    /// After each resume or wake, before any request is forwarded: the
    /// server takes it again. Failing or late: the service is suspended
    /// again and its waiting connections get a 503.
    pub after_resume: Option<Spanned<Hook>>,
}

impl Hooks {
    pub fn any(&self) -> bool {
        self.before_suspend.is_some() || self.after_resume.is_some()
    }
}

/// One HTTP request to the service's backend; any 2xx answer is success.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hook {
    #[serde(default = "default_hook_method")]
    pub method: String,
    /// Path and query, e.g. `/sleep?level=1`.
    pub path: String,
    /// Request body (sent as `application/json` when it parses as JSON).
    #[serde(default)]
    pub body: Option<String>,
    #[serde(default = "default_hook_timeout", deserialize_with = "duration")]
    pub timeout: Duration,
}

impl Hook {
    /// `POST /sleep?level=1`, for the journal.
    pub fn describe(&self) -> String {
        format!("{} {}", self.method, self.path)
    }
}

fn default_hook_method() -> String {
    "POST".into()
}
fn default_hook_timeout() -> Duration {
    Duration::from_secs(30)
}
