//! gpusnap's lifecycle logic, written against the driver and NVML traits.

pub mod chunksrc;
pub mod compat;
pub mod criu;
pub mod doctor;
pub mod dumpdir;
pub mod engine;
pub mod error;
pub mod fifo;
pub mod follow;
pub mod group;
pub mod guard;
pub mod hibernate;
pub mod hostknob;
pub mod image;
pub mod lazy;
pub mod mapfile;
pub mod progress;
pub mod remap;
pub mod remote;
pub mod rescue;
pub mod sign;
pub mod store;
pub mod target;
pub mod thp;
pub mod workingset;

pub use engine::{Engine, ResumeOptions, StopOptions};
pub use error::Error;
pub use progress::{Progress, Quiet};
pub use store::Store;
