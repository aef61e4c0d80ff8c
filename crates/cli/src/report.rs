//! A failed command's report: one line (and a hint) on stderr, the error as
//! JSON with `--json`, the likely cause of a driver failure, and the exit
//! code that tells the kind of failure apart.

use crate::cmd::doctor::process_findings;
use crate::finding::Severity;
use crate::output::Out;
use gpusnap_core::Error as CoreError;
use gpusnap_hibernate::Error;

/// Reports `e` and returns the exit code it carries.
pub fn failure(out: &Out, e: anyhow::Error) -> i32 {
    match typed(e) {
        Ok(err) => {
            let err = &err;
            out.error(err.kind(), &err.to_string(), err.hint(), err.exit_code());
            if let Some(pid) = failed_driver_pid(err) {
                for f in process_findings(pid)
                    .into_iter()
                    .filter(|f| matches!(f.severity, Severity::Warn | Severity::Error))
                {
                    eprintln!("  likely cause ({}): {}", f.check, f.message);
                }
            }
            err.exit_code()
        }
        Err(e) => {
            let code = crate::cmd::agent::exit_code(&e).unwrap_or(1);
            out.error("failed", &format!("{e:#}"), None, code);
            code
        }
    }
}

/// The process a driver error is about, for doctor's explanation.
fn failed_driver_pid(e: &Error) -> Option<i32> {
    fn core(e: &CoreError) -> Option<i32> {
        match e {
            CoreError::Driver { pid, .. } => Some(*pid),
            CoreError::Member { source, .. } => core(source),
            _ => None,
        }
    }
    match e {
        Error::Member { source, .. } => failed_driver_pid(source),
        _ => e.core().and_then(core),
    }
}

/// The error as gpusnap's own, of whichever layer it came from.
fn typed(e: anyhow::Error) -> Result<Error, anyhow::Error> {
    let e = match e.downcast::<Error>() {
        Ok(e) => return Ok(e),
        Err(e) => e,
    };
    let e = match e.downcast::<CoreError>() {
        Ok(e) => return Ok(e.into()),
        Err(e) => e,
    };
    e.downcast::<gpusnap_images::Error>().map(Error::from)
}
