//! The lazy wake: CRIU restores a tree without its anonymous memory and
//! gpusnap's page server (crates/pages) fills it while the tree, and the
//! driver's restore inside it, already run. See docs/design/wake.md.
//!
//! The one seam with the rest of wake: [`restore`] stands where
//! `Criu::restore` stood and hands back the page server to wait on.

use crate::criu::{Criu, CriuError};
use gpusnap_pages::keeper::Keeper;
use gpusnap_pages::{HeadStart, Options, PagesError, Server};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Fails the page server on purpose after this many bytes: how the tests
/// prove that a page server dying mid-wake leaves nothing half-done.
pub const FAIL_AFTER_ENV: &str = "GPUSNAP_PAGES_FAIL_AFTER";

/// Sleeps this many microseconds before each chunk the page server reads:
/// how the tests make a kill of the wake land in the middle of the fill.
pub const SLOW_ENV: &str = "GPUSNAP_PAGES_SLOW_US";
/// Test hook: "1" takes every REMOVE as one that met a copy in flight.
pub const REMOVE_RACED_ENV: &str = "GPUSNAP_TEST_PAGES_REMOVE_RACED";

/// The hidden subcommand that runs the keeper (docs/design/wake.md, "Safety").
pub const KEEPER_ARG: &str = "__pages-keeper";

static KEEPER_EXE: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

/// The program that runs the keeper (`PROGRAM __pages-keeper ...`): set by
/// gpusnap's binary at its start. Without it (a library caller) a lazy
/// wake has no keeper and is not safe against the death of its process.
pub fn set_keeper_exe(p: PathBuf) {
    let _ = KEEPER_EXE.set(p);
}

/// The program that runs gpusnap's keepers, if set ([`set_keeper_exe`]).
pub fn keeper_exe() -> Option<&'static PathBuf> {
    KEEPER_EXE.get()
}

/// Where the keeper reads pages from, if gpusnap dies mid-wake, for an
/// image whose pages are chunks: the wake's manifest is written to the work
/// dir (`keeper-manifest.json`) and the keeper reads the chunks from the
/// store (or the image's remote), each checked as the wake checks it.
pub struct KeeperChunks<'a> {
    pub state_dir: &'a Path,
    pub name: &'a str,
    pub dir: &'a Path,
}

const KEEPER_MANIFEST: &str = "keeper-manifest.json";

/// Starts the keeper of a lazy wake; `None` without a keeper program.
fn start_keeper(
    images: &Path,
    work: &Path,
    chunks: Option<&KeeperChunks<'_>>,
    m: Option<&gpusnap_images::manifest::Manifest>,
) -> std::io::Result<Option<Keeper>> {
    let Some(exe) = KEEPER_EXE.get() else { return Ok(None) };
    let mut cmd = std::process::Command::new(exe);
    cmd.arg(KEEPER_ARG).arg(work).arg(images);
    if let (Some(c), Some(m)) = (chunks, m) {
        let body = serde_json::to_vec(m).map_err(std::io::Error::other)?;
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        // In the wake's private work dir, readable by root alone.
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(work.join(KEEPER_MANIFEST))?
            .write_all(&body)?;
        cmd.arg(c.state_dir).arg(c.name).arg(c.dir);
    }
    let log = std::fs::OpenOptions::new().create(true).append(true).open(work.join("keeper.log"))?;
    // The keeper's own page server writes no trace over the wake's.
    cmd.stderr(log)
        .env_remove(SLOW_ENV)
        .env_remove(FAIL_AFTER_ENV)
        .env_remove(REMOVE_RACED_ENV)
        .env_remove(gpusnap_pages::ENV_TRACE);
    Keeper::spawn(cmd).map(Some)
}

/// The keeper (`gpusnap __pages-keeper WORK IMAGES [STATE_DIR NAME DIR]`,
/// its stdin the socket from the wake): holds the wake's userfaultfds until
/// the wake says "done"; if the wake dies first, serves every page still
/// missing, then exits. Returns the exit status.
pub fn keeper_main(args: &[std::ffi::OsString]) -> i32 {
    use std::os::fd::FromRawFd;
    let say = |line: &str| eprintln!("{} gpusnap keeper[{}]: {line}", now_secs(), std::process::id());
    if args.len() != 2 && args.len() != 5 {
        say("usage: __pages-keeper WORK IMAGES [STATE_DIR NAME DIR] (started by a lazy wake)");
        return 2;
    }
    let is_socket = nix::sys::stat::fstat(0).is_ok_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFSOCK);
    if !is_socket {
        say("stdin is not the socket of a lazy wake (the keeper is started by the wake itself)");
        return 2;
    }
    // The OOM killer that took the wake must not take its keeper next (it
    // holds little memory): as root, never.
    let _ = std::fs::write("/proc/self/oom_score_adj", "-1000");
    // SAFETY: fd 0 is the socket the wake made for us (Keeper::spawn,
    // checked above); nothing else in this process uses stdin.
    let sock = unsafe { std::os::fd::OwnedFd::from_raw_fd(0) };
    let (work, images) = (Path::new(&args[0]), Path::new(&args[1]));
    let log = match gpusnap_pages::keeper::keep(&sock) {
        gpusnap_pages::keeper::Kept::Released => {
            let _ = std::fs::remove_file(work.join(KEEPER_MANIFEST));
            return 0;
        }
        gpusnap_pages::keeper::Kept::Orphaned(log) => log,
    };
    let pids: Vec<i32> = log.iter().filter(|(m, f)| f.is_some() && m.pid > 0).map(|(m, _)| m.pid).collect();
    say(&format!(
        "the wake died before every page was in place: serving {} userfaultfds (processes {pids:?}, {} events replayed) from {}",
        log.iter().filter(|(_, f)| f.is_some()).count(),
        log.iter().filter(|(m, _)| m.pid == 0).count(),
        images.display()
    ));
    // The chunked image's copies (its Workdir) live until serving ends.
    let mut held = None;
    let source: Result<std::sync::Arc<dyn gpusnap_pages::PageSource>, KeeperError> = if args.len() == 5 {
        keeper_chunks(work, Path::new(&args[2]), &args[3].to_string_lossy(), Path::new(&args[4])).map(|wd| {
            let src = wd.source.clone() as std::sync::Arc<dyn gpusnap_pages::PageSource>;
            held = Some(wd);
            src
        })
    } else {
        Ok(std::sync::Arc::new(gpusnap_pages::DirSource::new(images)))
    };
    let opts = Options::from_env().unwrap_or_default();
    let served =
        source.and_then(|src| Ok(Server::adopt(images, src, opts, log)?)).and_then(|srv| Ok(srv.wait()?));
    // The copies hold a process's memory: they go, as the wake's would
    // have (its own copy of a chunked image's files too).
    drop(held);
    if args.len() == 5 && images.starts_with(work) {
        let _ = std::fs::remove_dir_all(images);
        let _ = std::fs::remove_file(work.join(KEEPER_MANIFEST));
        let _ = std::fs::remove_dir_all(work.join("keeper"));
    }
    match served {
        Ok(r) => {
            say(&format!(
                "every page in place: {} bytes ({} by faults, {} by the fill, {} pages already there) in {} ms; \
                 the next gpusnap command reconciles the wake",
                r.bytes,
                r.fault_bytes,
                r.fill_bytes,
                r.eexist_pages,
                r.ms
            ));
            0
        }
        Err(e) => {
            // The pages cannot come: a process must not run on zeros where
            // its memory is missing. The image is kept for a retry.
            say(&format!("cannot serve the missing pages ({e}): killing {pids:?}"));
            for p in &pids {
                let _ =
                    nix::sys::signal::kill(nix::unistd::Pid::from_raw(*p), nix::sys::signal::Signal::SIGKILL);
            }
            1
        }
    }
}

pub(crate) fn now_secs() -> String {
    let d = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    format!("{}.{:03}", d.as_secs(), d.subsec_millis())
}

/// Why the page keeper cannot serve the missing pages of a wake that died.
#[derive(Debug, thiserror::Error)]
enum KeeperError {
    /// The manifest the wake wrote could not be read.
    #[error("{KEEPER_MANIFEST}: {0}")]
    ManifestRead(std::io::Error),
    #[error("{KEEPER_MANIFEST}: {0}")]
    ManifestParse(serde_json::Error),
    /// The chunk store could not be opened.
    #[error(transparent)]
    Store(#[from] gpusnap_chunks::ChunkError),
    /// The image's remote, or its chunks, could not be reached or prepared.
    #[error(transparent)]
    Image(#[from] gpusnap_images::Error),
    /// The keeper's own directory could not be made.
    #[error("{0}")]
    Workdir(std::io::Error),
    /// None of the image's pages files is in the store.
    #[error("no pages file of the image is in the store")]
    NoPagesFile,
    /// The page server failed.
    #[error(transparent)]
    Pages(#[from] PagesError),
}

/// The page source of a chunked image for the keeper, from the manifest the
/// wake wrote (the one it verified) and the chunk store.
fn keeper_chunks(
    work: &Path,
    state_dir: &Path,
    name: &str,
    dir: &Path,
) -> Result<gpusnap_images::chunksrc::Workdir, KeeperError> {
    let body = std::fs::read(work.join(KEEPER_MANIFEST)).map_err(KeeperError::ManifestRead)?;
    let m: gpusnap_images::manifest::Manifest =
        serde_json::from_slice(&body).map_err(KeeperError::ManifestParse)?;
    let store = gpusnap_chunks::LocalStore::open(state_dir.join("store"))?;
    let remote = match gpusnap_images::origin::origin(state_dir, name) {
        Some(url) => Some(gpusnap_images::remote::open_origin(&url)?),
        None => None,
    };
    let kw = work.join("keeper");
    gpusnap_files::mkdir_private(&kw).map_err(KeeperError::Workdir)?;
    gpusnap_images::chunksrc::Workdir::prepare(name, dir, &m, store, remote, &kw, false)
        .map_err(gpusnap_images::Error::from)?
        .ok_or(KeeperError::NoPagesFile)
}

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
/// it, else eagerly with a notice; `eager` asks for the eager path.
pub fn restore(criu: &Criu, images: &Path, work: &Path, eager: bool) -> Result<Restored, CriuError> {
    restore_from(criu, images, work, eager, None, &|| Ok(()), None)
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
    chunks: Option<(&KeeperChunks<'_>, &gpusnap_images::manifest::Manifest)>,
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
    // The page server's settings (GPUSNAP_PAGES_*, docs/design/wake.md): a bad
    // one is said, and the wake goes on eagerly, as safe as ever.
    let opts = match Options::from_env() {
        Ok(o) => Options {
            fail_after: std::env::var(FAIL_AFTER_ENV).ok().and_then(|v| v.parse().ok()),
            slow: std::env::var(SLOW_ENV)
                .ok()
                .and_then(|v| v.parse().ok())
                .map(std::time::Duration::from_micros),
            remove_raced: std::env::var(REMOVE_RACED_ENV).is_ok_and(|v| v == "1"),
            ..o
        },
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
    // The keeper holds a copy of every userfaultfd, so that the death of
    // this process never lets the tree read zeros (docs/design/wake.md, "Safety").
    match start_keeper(images, work, chunks.map(|c| c.0), chunks.map(|c| c.1)) {
        Ok(Some(k)) => server.keep_with(k),
        Ok(None) => tracing::debug!("lazy wake without a keeper (no keeper program)"),
        Err(e) => {
            server.abort();
            drop(server);
            return fallback(format!("the page server's keeper: {e}"));
        }
    }
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
