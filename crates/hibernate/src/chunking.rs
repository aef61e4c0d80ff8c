//! Why chunking a dump's pages files as CRIU writes them (the follower, the
//! FIFO receiver) failed. The first failure is kept and shared among the
//! threads (so the type is `Clone`: I/O errors are held behind an `Arc`);
//! the hibernate reports it as an I/O error of the image.

use std::sync::Arc;

#[derive(Debug, Clone, thiserror::Error)]
pub enum ChunkingError {
    /// An I/O call failed: what was done (`read`, `poll`, `open pages-1.img`,
    /// `list DIR`, ...) and the error.
    #[error("{what}: {source}")]
    Io { what: String, source: Arc<std::io::Error> },
    /// An I/O call on a file failed (the file is named around it).
    #[error("{0}")]
    Os(Arc<std::io::Error>),
    /// The chunk store refused a segment.
    #[error("{0}")]
    Store(String),
    /// A file's own failure, named.
    #[error("{rel}: {source}")]
    File { rel: String, source: Box<ChunkingError> },
    /// A segment of a file never came back from the chunking threads.
    #[error("{0}: a segment was not chunked")]
    NotChunked(String),
    /// Another segment failed first: this one was not tried.
    #[error("an earlier segment failed")]
    EarlierSegment,
    /// A thread of the pipeline stopped or panicked (`the hashing thread
    /// panicked`, `the chunking pool stopped`, `poisoned`, ...).
    #[error("{0}")]
    Thread(&'static str),
    /// The follower was stopped (CRIU failed, or the hibernate did).
    #[error("stopped")]
    Stopped,
    /// The dump ended without the follower's last scan.
    #[error("abandoned")]
    Abandoned,
    /// A failure the tests inject.
    #[error("{0}")]
    Injected(&'static str),
}

impl ChunkingError {
    pub(crate) fn io(what: impl Into<String>, e: std::io::Error) -> Self {
        Self::Io { what: what.into(), source: Arc::new(e) }
    }

    pub(crate) fn of_file(self, rel: &str) -> Self {
        Self::File { rel: rel.to_string(), source: Box::new(self) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_failure_says_what_it_said_before() {
        let io = ChunkingError::io("read", std::io::Error::other("gone"));
        assert_eq!(io.to_string(), "read: gone");
        assert_eq!(io.clone().of_file("criu/pages-1.img").to_string(), "criu/pages-1.img: read: gone");
        assert_eq!(
            ChunkingError::NotChunked("criu/p.img".into()).to_string(),
            "criu/p.img: a segment was not chunked"
        );
        assert_eq!(ChunkingError::EarlierSegment.to_string(), "an earlier segment failed");
        assert_eq!(
            ChunkingError::Thread("the chunking pool stopped").to_string(),
            "the chunking pool stopped"
        );
    }
}
