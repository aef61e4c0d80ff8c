//! The lazy wake: CRIU restores a tree without its anonymous memory and
//! gpusnap's page server (crates/pages) fills it while the tree, and the
//! driver's restore inside it, already run. See docs/pages.md.
//!
//! The one seam with the rest of wake: [`restore`] stands where
//! `Criu::restore` stood and hands back the page server to wait on.

use crate::criu::{Criu, CriuError};
use gpusnap_pages::{HeadStart, Options, PagesError, Server};
use std::path::Path;
use std::time::Instant;

/// Fails the page server on purpose after this many bytes: how the tests
/// prove that a page server dying mid-wake leaves nothing half-done.
pub const FAIL_AFTER_ENV: &str = "GPUSNAP_PAGES_FAIL_AFTER";

/// A tree CRIU restored, and the page server still filling its memory
/// (`None`: restored eagerly, every page already in place).
pub struct Restored {
    pub root: i32,
    pub pages: Option<Server>,
    /// Why a lazy wake fell back to an eager one.
    pub notice: Option<String>,
    /// What the page server fills before the driver's restore starts.
    pub head_start: HeadStart,
}

impl Restored {
    /// Waits for the page server's head start (GPUSNAP_PAGES_HEAD_START;
    /// none by default) before the driver's restore; returns the ms it
    /// took. An error is the page server's failure: the driver must not be
    /// started on memory that will never come.
    pub fn head_start(&self) -> Result<u64, PagesError> {
        let Some(srv) = &self.pages else { return Ok(0) };
        let want = self.head_start.bytes_of(srv.total_bytes());
        if want == 0 {
            return Ok(0);
        }
        let t = Instant::now();
        srv.wait_ahead(want)?;
        Ok(t.elapsed().as_millis() as u64)
    }
}

/// Restores `images` (CRIU's files) lazily where this kernel and CRIU allow
/// it, else eagerly with a notice; `eager` asks for today's path.
pub fn restore(criu: &Criu, images: &Path, work: &Path, eager: bool) -> Result<Restored, CriuError> {
    restore_from(criu, images, work, eager, None, &|| Ok(()))
}

/// [`restore`], the page server reading through `source` (default: the
/// images directory); `before_eager` runs before any eager restore (an
/// image of chunks puts its whole pages files in place for CRIU then).
pub fn restore_from(
    criu: &Criu,
    images: &Path,
    work: &Path,
    eager: bool,
    source: Option<std::sync::Arc<dyn gpusnap_pages::PageSource>>,
    before_eager: &dyn Fn() -> Result<(), CriuError>,
) -> Result<Restored, CriuError> {
    let none = HeadStart::Bytes(0);
    if eager {
        before_eager()?;
        return Ok(Restored {
            root: criu.restore(images, work)?,
            pages: None,
            notice: None,
            head_start: none,
        });
    }
    let fallback = |why: String| -> Result<Restored, CriuError> {
        tracing::warn!("lazy wake not possible ({why}): waking eagerly");
        before_eager()?;
        let root = criu.restore(images, work)?;
        Ok(Restored {
            root,
            pages: None,
            notice: Some(format!("lazy wake not possible ({why}): woken eagerly")),
            head_start: none,
        })
    };
    let support = gpusnap_pages::support();
    if let Some(why) = support.why_not {
        return fallback(why);
    }
    // The page server's settings (GPUSNAP_PAGES_*, docs/pages.md): a bad
    // one is said, and the wake goes on eagerly, as safe as ever.
    let opts = match Options::from_env() {
        Ok(o) => Options { fail_after: std::env::var(FAIL_AFTER_ENV).ok().and_then(|v| v.parse().ok()), ..o },
        Err(e) => return fallback(format!("page server: {e}")),
    };
    let head_start = opts.head_start;
    let started = match source {
        Some(src) => Server::start_with(images, src, work, opts),
        None => Server::start(images, work, opts),
    };
    let server = match started {
        Ok(s) => s,
        Err(e) => return fallback(format!("page server: {e}")),
    };
    match criu.restore_with(images, work, &["--lazy-pages"]) {
        Ok(root) => Ok(Restored { root, pages: Some(server), notice: None, head_start }),
        // A pid still held: the caller waits and tries again, as for an
        // eager restore.
        Err(CriuError::Failed { line, op, log }) if line.contains("File exists") => {
            server.abort();
            Err(CriuError::Failed { op, line, log })
        }
        // CRIU ends what it restored when a restore fails: nothing of the
        // tree is left, so the eager path starts from where it would have.
        Err(CriuError::Failed { line, .. }) => {
            server.abort();
            drop(server);
            fallback(format!("criu restore --lazy-pages: {line}"))
        }
        Err(e) => Err(e),
    }
}
