//! The status file the workload writes every iteration.

use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

pub fn unix_time() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// Writes through a temporary file and a rename, so readers never see half.
pub fn write_status(path: &Path, line: &str) -> std::io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    std::fs::write(&tmp, line)?;
    std::fs::rename(&tmp, path)
}
