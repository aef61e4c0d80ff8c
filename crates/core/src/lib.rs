//! gpusnap's lifecycle of a CUDA process, written against the driver and
//! NVML traits: a target's identity (pid and start time), the journal and
//! the admission ledger, suspend, resume and stop, groups, device remapping.
//!
//! Images, CRIU and the guard live in the crates above this one
//! (`gpusnap-images`, `gpusnap-hibernate`, `gpusnap-guard`); this crate
//! never imports them.

pub mod compat;
pub mod container;
pub mod engine;
pub mod error;
pub mod group;
pub mod hostknob;
pub mod pidns;
pub mod remap;
pub mod reports;
pub mod statedir;
pub mod store;
pub mod swap;
pub mod target;
pub mod thp;
pub mod tree;

pub use engine::{Engine, ResumeOptions, StopOptions};
pub use error::Error;
pub use gpusnap_progress as progress;
pub use gpusnap_progress::{Progress, Quiet};
pub use store::Store;
