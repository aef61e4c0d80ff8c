use crate::manifest::ImageError;
use crate::sign::SignError;
use gpusnap_chunks::{ChunkError, RemoteError};

/// An image operation that ended badly: the image itself, its signature, or
/// the chunks under it (local store or remote). Exit codes as the README's
/// table: 1 failed, 2 bad input, 6 a remote unreachable or refusing.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Image(#[from] ImageError),
    #[error(transparent)]
    Sign(#[from] SignError),
    #[error(transparent)]
    Chunks(#[from] ChunkError),
}

impl Error {
    /// What to do about it, where there is something to say beyond the message.
    pub fn hint(&self) -> Option<&'static str> {
        None
    }

    pub fn exit_code(&self) -> i32 {
        match self {
            Self::Image(ImageError::Io { .. }) => 1,
            Self::Image(_) => 2,
            Self::Sign(SignError::BadKey(_) | SignError::BadScope(_)) => 2,
            Self::Sign(_) => 1,
            Self::Chunks(ChunkError::Remote(
                RemoteError::Unreachable { .. } | RemoteError::Denied { .. } | RemoteError::NoBucket { .. },
            )) => 6,
            Self::Chunks(ChunkError::Remote(_) | ChunkError::Corrupt { .. }) => 2,
            Self::Chunks(ChunkError::Io { .. } | ChunkError::Missing(_)) => 1,
        }
    }

    /// A short machine-readable kind for `--json` output.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Chunks(ChunkError::Remote(RemoteError::Denied { .. })) => "remote_denied",
            Self::Chunks(ChunkError::Remote(RemoteError::Unreachable { .. })) => "remote_unreachable",
            Self::Chunks(ChunkError::Remote(RemoteError::NoBucket { .. })) => "remote_no_bucket",
            Self::Chunks(ChunkError::Corrupt { .. }) => "corrupt_chunk",
            Self::Chunks(_) => "chunks",
            Self::Image(ImageError::Missing(_)) => "image_missing",
            Self::Image(ImageError::Exists(_)) => "image_exists",
            Self::Image(ImageError::InUse { .. }) => "image_in_use",
            Self::Image(ImageError::Io { .. }) => "image_io",
            Self::Image(ImageError::Untrusted { .. }) => "image_untrusted",
            Self::Image(ImageError::BadName { .. }) => "bad_image_name",
            Self::Image(_) => "image_invalid",
            Self::Sign(_) => "key",
        }
    }
}
