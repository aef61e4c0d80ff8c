//! Hibernate and wake: whole process trees to an image and back through
//! CRIU, on top of the lifecycle (`gpusnap-core`), the images
//! (`gpusnap-images`) and the page server (`gpusnap-pages`): the CRIU
//! driver, the dump pipeline (FIFOs, a tmpfs dump directory, the chunk
//! follower), the lazy wake and its rescue, recovery of an interrupted
//! hibernate.

use std::time::Instant;

pub mod chunking;
pub mod criu;
pub mod drain;
pub mod dump;
pub mod dumpdir;
pub mod dumpkeeper;
pub mod error;
pub mod fifo;
pub mod follow;
pub mod hibernate;
pub mod lazy;
pub mod options;
pub mod reconcile;
pub mod rescue;
pub mod tree;
mod unwind;
pub mod wake;

pub use error::Error;
pub use hibernate::Hibernate;
pub use options::{HibernateOptions, HibernateReport, HibernateStages, Stages, WakeOptions, WakeReport};
pub use reconcile::{interrupted_hibernates, Interrupted};

/// Milliseconds since `since`, as the reports count them.
pub(crate) fn ms(since: Instant) -> u64 {
    since.elapsed().as_millis() as u64
}
