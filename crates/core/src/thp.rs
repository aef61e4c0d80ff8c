//! `--thp`: transparent huge pages `always` for the length of a checkpoint.
//!
//! The driver's checkpoint copies device memory into anonymous host memory
//! that it does not allocate through libc (an LD_PRELOAD madvise hook and
//! glibc's hugetlb tunable did not help, measured), so only the host-wide
//! setting makes it huge-page backed: with `always` checkpoint ran 3.1-3.5
//! GB/s against 1.6-2.4 GB/s with `madvise` on an H200 (gpu-facts.md). The
//! price: for as long as it is on, every process of the host gets huge pages
//! where it did not ask for them (more memory per sparse mapping, khugepaged
//! work), which is why it is opt-in and switched back at once. The switch
//! and its journal (`STATE_DIR/thp.json`) are [`crate::hostknob`]'s.

use crate::hostknob::{KnobError, Switched, THP};
use std::path::Path;

/// The sysfs file; tests point it elsewhere.
pub const SYSFS_ENV: &str = "GPUSNAP_THP_SYSFS";

pub type ThpError = KnobError;

/// The selected mode: `always [madvise] never` gives `madvise`.
pub fn mode() -> Result<String, ThpError> {
    THP.get()
}

/// THP `always` until dropped (then what it was, unless another gpusnap
/// still wants `always`).
pub struct Always(#[allow(dead_code)] Switched);

impl Always {
    pub fn on(state_dir: &Path) -> Result<Self, ThpError> {
        Switched::on(state_dir, &THP, "always").map(Self)
    }
}
