//! gpusnap's images: the format (a manifest with magic, version and the
//! checksum of every file), signing and trust, the chunk-backed local store,
//! remotes (S3) and map files for a mapped wake. Built on `gpusnap-chunks`;
//! knows nothing of processes, CRIU or the driver.

pub mod chunkfile;
pub mod chunksrc;
pub mod error;
pub mod hash;
pub mod image;
pub mod index;
pub mod manifest;
pub mod mapfile;
pub mod origin;
pub mod pending;
pub mod pullcheck;
pub mod pushed;
pub mod remote;
pub mod sign;
pub mod sync;
pub mod verify;
pub mod workingset;

pub use error::Error;
