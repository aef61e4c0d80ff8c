//! Hibernate and wake: whole process trees to an image and back through
//! CRIU, on top of the lifecycle (`gpusnap-core`), the images
//! (`gpusnap-images`) and the page server (`gpusnap-pages`): the CRIU
//! driver, the dump pipeline (FIFOs, a tmpfs dump directory, the chunk
//! follower), the lazy wake and its rescue, recovery of an interrupted
//! hibernate.

pub mod criu;
pub mod dumpdir;
pub mod error;
pub mod fifo;
pub mod follow;
pub mod hibernate;
pub mod lazy;
pub mod rescue;

pub use error::Error;
pub use hibernate::Hibernate;
