//! A dump's keeper (`gpusnap __dump-keeper`): a process that holds every
//! FIFO of a dump open for reading from before CRIU starts, so that a
//! gpusnap that dies mid-dump never leaves CRIU blocked (see
//! [`crate::fifo`]).

use std::fs;
use std::os::fd::AsFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// The argument that runs a dump's keeper (hidden; started by hibernate).
pub const KEEPER_ARG: &str = "__dump-keeper";

/// A dump's keeper, as its hibernate holds it.
pub(crate) struct Keeper {
    pub(crate) child: std::process::Child,
    pub(crate) stdin: Option<std::process::ChildStdin>,
}

impl Keeper {
    /// Starts `PROGRAM __dump-keeper CRIU_DIR COUNT` and waits until it has
    /// every FIFO open.
    pub(crate) fn start(criu_dir: &Path, count: usize, log: &Path) -> std::io::Result<Self> {
        use std::io::BufRead;
        use std::process::{Command, Stdio};
        let exe = crate::lazy::keeper_exe().ok_or_else(|| std::io::Error::other("no keeper program"))?;
        let log = fs::OpenOptions::new().create(true).append(true).open(log)?;
        let mut child = Command::new(exe)
            .arg(KEEPER_ARG)
            .arg(criu_dir)
            .arg(count.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()?;
        let stdin = child.stdin.take();
        let mut me = Self { child, stdin };
        let mut line = String::new();
        let ready =
            me.child.stdout.take().map(|o| std::io::BufReader::new(o).read_line(&mut line)).transpose()?;
        if ready.is_none() || line.trim() != "ready" {
            me.done();
            return Err(std::io::Error::other(format!("the keeper did not start ({:?})", line.trim())));
        }
        Ok(me)
    }

    /// The dump is over (finished or failed): the keeper exits at once.
    pub(crate) fn done(&mut self) {
        use std::io::Write;
        if let Some(mut s) = self.stdin.take() {
            let _ = s.write_all(b"done\n");
        }
        let _ = self.child.wait();
    }
}

/// The keeper (`gpusnap __dump-keeper CRIU_DIR COUNT`, its stdin a pipe
/// from the hibernate): opens `CRIU_DIR/pages-1.img` .. `pages-COUNT.img`
/// for reading, says "ready", and waits. "done" from the hibernate: exits.
/// The end of its stdin without it: the hibernate died; reads and drops
/// everything CRIU writes into them until no CRIU has CRIU_DIR on its
/// command line, removes them and exits. Returns the exit status.
pub fn keeper_main(args: &[std::ffi::OsString]) -> i32 {
    use std::io::{BufRead, Read, Write};
    let pid = std::process::id();
    let say = |line: &str| eprintln!("{} gpusnap dump keeper[{pid}]: {line}", crate::lazy::now_secs());
    let (Some(dir), Some(count), 2) =
        (args.first(), args.get(1).and_then(|c| c.to_str()?.parse::<usize>().ok()), args.len())
    else {
        say("usage: __dump-keeper CRIU_DIR COUNT (started by hibernate)");
        return 2;
    };
    let dir = PathBuf::from(dir);
    // The OOM killer that took the hibernate must not take its keeper.
    let _ = fs::write("/proc/self/oom_score_adj", "-1000");
    let mut fifos: Vec<(PathBuf, fs::File)> = Vec::new();
    for i in 1..=count {
        let p = dir.join(format!("pages-{i}.img"));
        let f = fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&p);
        if let Ok(f) = f {
            if f.metadata().is_ok_and(|m| m.file_type().is_fifo()) {
                fifos.push((p, f));
            }
        }
    }
    let mut out = std::io::stdout();
    if writeln!(out, "ready").and_then(|_| out.flush()).is_err() {
        return 1;
    }
    let mut line = String::new();
    let stdin = std::io::stdin();
    let mut lock = stdin.lock();
    loop {
        line.clear();
        match lock.read_line(&mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) if line.trim() == "done" => return 0,
            Ok(_) => {}
        }
    }
    say(&format!(
        "the hibernate died during its dump: reading what CRIU sends into {} FIFOs in {} until CRIU is gone",
        fifos.len(),
        dir.display()
    ));
    let mut buf = vec![0u8; 1 << 20];
    let mut dropped = 0u64;
    let mut gone_checks = 0;
    while gone_checks < 3 {
        use nix::poll::{PollFd, PollFlags, PollTimeout};
        let mut ended = Vec::new();
        {
            let mut fds: Vec<PollFd> =
                fifos.iter().map(|(_, f)| PollFd::new(f.as_fd(), PollFlags::POLLIN)).collect();
            let _ = nix::poll::poll(&mut fds, PollTimeout::from(200u16));
            for (i, fd) in fds.iter().enumerate() {
                if fd.revents().is_some_and(|r| !r.is_empty()) {
                    ended.push(i);
                }
            }
        }
        let mut closed = Vec::new();
        for i in ended {
            loop {
                match (&fifos[i].1).read(&mut buf) {
                    Ok(0) => {
                        // A writer came and went: CRIU is done with this one
                        // (each pages file is opened once).
                        closed.push(i);
                        break;
                    }
                    Ok(n) => dropped += n as u64,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
        }
        for i in closed.into_iter().rev() {
            let (p, _) = fifos.remove(i);
            let _ = fs::remove_file(p);
        }
        if criu_on(&dir) {
            gone_checks = 0;
        } else {
            gone_checks += 1;
        }
    }
    for (p, _) in fifos {
        let _ = fs::remove_file(p);
    }
    say(&format!("CRIU is gone; {dropped} bytes of pages dropped, the FIFOs removed"));
    0
}

/// Does a process have `dir` on its command line (a CRIU dumping into it)?
pub(crate) fn criu_on(dir: &Path) -> bool {
    let want = dir.as_os_str().as_encoded_bytes();
    let me = std::process::id().to_string();
    let Ok(rd) = fs::read_dir("/proc") else { return true };
    rd.flatten().any(|e| {
        let name = e.file_name();
        let n = name.to_string_lossy();
        if !n.bytes().all(|b| b.is_ascii_digit()) || n == me {
            return false;
        }
        fs::read(e.path().join("cmdline")).is_ok_and(|c| c.split(|b| *b == 0).any(|a| a == want))
    })
}
