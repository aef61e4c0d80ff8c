//! Where the bytes of an image's `pages-N.img` files come from.
//!
//! The page server reads pages through this seam, not from a `File`, so
//! that the bytes can come from a plain image directory (verified whole
//! before the wake, [`DirSource`]), or chunk by chunk from a verifying
//! source (each chunk's blake3 checked before any byte of it reaches a
//! process), from the local chunk store or a remote.

use crate::PagesError;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// One `pages-N.img`, opened for reading.
pub trait PagesFile: Send + Sync {
    /// Fills `buf` with the file's bytes at `offset`. A verifying source
    /// returns only bytes it has checked (an error otherwise), so a page
    /// that fails its check never reaches a process.
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()>;

    /// The file's checked bytes from `offset` in place, `len` of them or
    /// fewer (at least one: a source in pieces, such as chunks, gives them
    /// up to the end of the piece), if the source can give them without a
    /// copy (a mapping of the page cache, bytes it keeps): the page server
    /// then copies them straight into the process. `None`: read them with
    /// [`PagesFile::read_at`].
    fn map_at(&self, _offset: u64, _len: usize) -> Option<Mapped> {
        None
    }
}

/// Bytes of a [`PagesFile`] in place, held while they are used.
pub struct Mapped {
    /// What keeps the bytes mapped.
    pub hold: Arc<dyn AsRef<[u8]> + Send + Sync>,
    /// Where they are in it.
    pub start: usize,
    pub len: usize,
}

impl Mapped {
    pub fn bytes(&self) -> &[u8] {
        let all: &[u8] = (*self.hold).as_ref();
        &all[self.start..self.start + self.len]
    }
}

/// Opens the pages files of one image.
pub trait PageSource: Send + Sync {
    /// Opens `name` (e.g. `pages-3.img`).
    fn open(&self, name: &str) -> Result<Arc<dyn PagesFile>, PagesError>;
}

/// The pages files of an image directory, read as they are (the image was
/// verified whole before the wake began).
#[derive(Debug, Clone)]
pub struct DirSource {
    dir: PathBuf,
}

impl DirSource {
    pub fn new(dir: &Path) -> Self {
        Self { dir: dir.to_path_buf() }
    }
}

struct PlainFile(File);

impl PagesFile for PlainFile {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.0.read_exact_at(buf, offset)
    }
}

impl PageSource for DirSource {
    fn open(&self, name: &str) -> Result<Arc<dyn PagesFile>, PagesError> {
        let p = self.dir.join(name);
        let f = File::open(&p)
            .map_err(|e| PagesError::Image { path: p.display().to_string(), why: e.to_string() })?;
        Ok(Arc::new(PlainFile(f)))
    }
}
