//! A private directory held by its descriptor: opened with O_NOFOLLOW
//! below its parent, checked on the descriptor (a directory, owned by this
//! user, no access for others), and acted in by names relative to it
//! (`*at` calls), so that nobody can swap a link in between the check and
//! the use.

use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::{Mode, SFlag};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// A directory held open: one of this user's ([`PrivateDir::open`]), or
/// any, as named when held ([`PrivateDir::hold`]).
#[derive(Debug)]
pub struct PrivateDir {
    fd: OwnedFd,
    path: PathBuf,
}

fn io(e: nix::Error) -> std::io::Error {
    std::io::Error::from_raw_os_error(e as i32)
}

fn other(p: &Path, why: &str) -> std::io::Error {
    std::io::Error::other(format!("{}: {why}", p.display()))
}

impl PrivateDir {
    /// `parent/name`, created 0700 if missing; refused if it is a link or
    /// not a directory, or belongs to another user; made 0700 if others
    /// may reach it. `parent` itself is opened as named (the state
    /// directory, which its own check covers).
    pub fn open(parent: &Path, name: &str) -> std::io::Result<Self> {
        let path = parent.join(name);
        if name.is_empty() || name.contains('/') || name == "." || name == ".." {
            return Err(other(&path, "not a plain name"));
        }
        let up =
            nix::fcntl::open(parent, OFlag::O_DIRECTORY | OFlag::O_RDONLY | OFlag::O_CLOEXEC, Mode::empty())
                .map_err(io)?;
        // SAFETY: open just returned this descriptor, owned by nobody else.
        let up = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(up) };
        match nix::sys::stat::mkdirat(Some(up.as_raw_fd()), name, Mode::from_bits_truncate(0o700)) {
            Ok(()) | Err(nix::Error::EEXIST) => {}
            Err(e) => return Err(io(e)),
        }
        let flags = OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_RDONLY | OFlag::O_CLOEXEC;
        let raw =
            nix::fcntl::openat(Some(up.as_raw_fd()), name, flags, Mode::empty()).map_err(|e| match e {
                nix::Error::ELOOP | nix::Error::ENOTDIR => other(&path, "not a directory (a link?)"),
                e => io(e),
            })?;
        // SAFETY: openat just returned this descriptor, owned by nobody else.
        let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) };
        let st = nix::sys::stat::fstat(fd.as_raw_fd()).map_err(io)?;
        let me = nix::unistd::geteuid().as_raw();
        if st.st_uid != me {
            return Err(other(&path, &format!("owned by uid {}, not by this user ({me})", st.st_uid)));
        }
        if st.st_mode & 0o077 != 0 {
            nix::sys::stat::fchmod(fd.as_raw_fd(), Mode::from_bits_truncate(0o700)).map_err(io)?;
        }
        Ok(Self { fd, path })
    }

    /// The directory `path` names now (followed), held as it is: not
    /// checked, for acting on its entries by name whatever is renamed or
    /// linked in its place afterwards.
    pub fn hold(path: &Path) -> std::io::Result<Self> {
        let raw =
            nix::fcntl::open(path, OFlag::O_DIRECTORY | OFlag::O_RDONLY | OFlag::O_CLOEXEC, Mode::empty())
                .map_err(io)?;
        // SAFETY: open just returned this descriptor, owned by nobody else.
        let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) };
        Ok(Self { fd, path: path.to_path_buf() })
    }

    /// The directory `name` here (not followed if a link), held.
    pub fn hold_entry(&self, name: &str) -> std::io::Result<Self> {
        let flags = OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_RDONLY | OFlag::O_CLOEXEC;
        let raw =
            nix::fcntl::openat(Some(self.fd.as_raw_fd()), name, flags, Mode::empty()).map_err(
                |e| match e {
                    nix::Error::ELOOP | nix::Error::ENOTDIR => {
                        other(&self.path.join(name), "not a directory (a link?)")
                    }
                    e => io(e),
                },
            )?;
        // SAFETY: openat just returned this descriptor, owned by nobody else.
        let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) };
        Ok(Self { fd, path: self.path.join(name) })
    }

    /// Whether the entry `name` here (not followed) is the directory
    /// `other` holds.
    pub fn entry_is(&self, name: &str, other: &PrivateDir) -> bool {
        let (Ok(a), Ok(b)) = (self.stat(name), nix::sys::stat::fstat(other.fd.as_raw_fd())) else {
            return false;
        };
        a.st_dev == b.st_dev && a.st_ino == b.st_ino
    }

    /// The directory's path as it was opened (for messages).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A path to `name` in this very directory, whatever is renamed or
    /// linked meanwhile: through the descriptor (`/proc/self/fd/N/name`),
    /// for calls that take a path only (bind(2), another program).
    pub fn fd_path(&self, name: &str) -> PathBuf {
        PathBuf::from(format!("/proc/self/fd/{}/{name}", self.fd.as_raw_fd()))
    }

    /// [`Self::fd_path`] as another process reaches it while this one
    /// holds the descriptor (`/proc/PID/fd/N/name`).
    pub fn fd_path_for_others(&self, name: &str) -> PathBuf {
        PathBuf::from(format!("/proc/{}/fd/{}/{name}", std::process::id(), self.fd.as_raw_fd()))
    }

    /// Whether `dir` (a path, followed) is this very directory.
    pub fn is(&self, dir: &Path) -> bool {
        let Ok(st) = nix::sys::stat::fstat(self.fd.as_raw_fd()) else { return false };
        std::fs::metadata(dir).is_ok_and(|m| m.dev() == st.st_dev && m.ino() == st.st_ino)
    }

    /// Removes the entry `name` (never a directory).
    pub fn unlink(&self, name: &str) -> std::io::Result<()> {
        nix::unistd::unlinkat(Some(self.fd.as_raw_fd()), name, nix::unistd::UnlinkatFlags::NoRemoveDir)
            .map_err(io)
    }

    /// The entry `name` itself (not followed): its type, inode and mode.
    pub fn stat(&self, name: &str) -> std::io::Result<nix::sys::stat::FileStat> {
        nix::sys::stat::fstatat(Some(self.fd.as_raw_fd()), name, AtFlags::AT_SYMLINK_NOFOLLOW).map_err(io)
    }

    /// Whether `name` is a socket.
    pub fn is_socket(&self, name: &str) -> bool {
        self.stat(name)
            .is_ok_and(|s| SFlag::from_bits_truncate(s.st_mode & SFlag::S_IFMT.bits()) == SFlag::S_IFSOCK)
    }

    /// Sets the mode of `name`, a socket or file made here (not followed
    /// where it is a link: refused).
    pub fn chmod(&self, name: &str, mode: u32) -> std::io::Result<()> {
        if self.stat(name)?.st_mode & SFlag::S_IFMT.bits() == SFlag::S_IFLNK.bits() {
            return Err(other(&self.path.join(name), "a symbolic link"));
        }
        nix::sys::stat::fchmodat(
            Some(self.fd.as_raw_fd()),
            name,
            Mode::from_bits_truncate(mode),
            nix::sys::stat::FchmodatFlags::FollowSymlink,
        )
        .map_err(io)
    }

    /// Opens `name` here for reading if it is a regular file of this
    /// user's, no link (not followed, not hard-linked elsewhere), writable by
    /// nobody else: the descriptor is what is checked and used.
    pub fn open_file(&self, name: &str) -> std::io::Result<std::fs::File> {
        let flags =
            OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_NOCTTY | OFlag::O_CLOEXEC;
        let raw =
            nix::fcntl::openat(Some(self.fd.as_raw_fd()), name, flags, Mode::empty()).map_err(
                |e| match e {
                    nix::Error::ELOOP => other(&self.path.join(name), "a symbolic link"),
                    e => io(e),
                },
            )?;
        // SAFETY: openat just returned this descriptor, owned by nobody else.
        let f = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(raw) };
        let m = f.metadata()?;
        let bad = |why: &str| Err(other(&self.path.join(name), why));
        if !m.is_file() {
            return bad("not a regular file");
        }
        if m.nlink() > 1 {
            return bad("a hard link to a file elsewhere");
        }
        if m.uid() != nix::unistd::geteuid().as_raw() || m.mode() & 0o022 != 0 {
            return bad("not this user's alone (owner or mode)");
        }
        Ok(f)
    }

    /// Renames `from` to `to`, both in this directory.
    pub fn rename(&self, from: &str, to: &str) -> std::io::Result<()> {
        nix::fcntl::renameat(Some(self.fd.as_raw_fd()), from, Some(self.fd.as_raw_fd()), to).map_err(io)
    }
}

impl AsFd for PrivateDir {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_link_in_place_of_the_directory_is_refused_and_nothing_is_made_through_it() {
        let d = tempfile::tempdir().unwrap();
        let elsewhere = d.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        std::os::unix::fs::symlink(&elsewhere, d.path().join("guards")).unwrap();
        let e = PrivateDir::open(d.path(), "guards").unwrap_err();
        assert!(e.to_string().contains("a link"), "{e}");
        assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0);
    }

    /// `images rm PATH`'s way: the parent and the entry held, renamed by
    /// name in the held parent, and the renamed entry compared with the
    /// held one; an entry swapped for a link or another directory is seen.
    #[test]
    fn a_held_entry_swapped_before_its_rename_is_seen() {
        let d = tempfile::tempdir().unwrap();
        let (img, other_dir) = (d.path().join("img"), d.path().join("other"));
        std::fs::create_dir(&img).unwrap();
        std::fs::create_dir(&other_dir).unwrap();
        let up = PrivateDir::hold(d.path()).unwrap();
        let held = up.hold_entry("img").unwrap();
        up.rename("img", ".img.rm").unwrap();
        assert!(up.entry_is(".img.rm", &held));
        up.rename(".img.rm", "img").unwrap();
        // Swapped: the directory moved away, a link to another in its place.
        std::fs::rename(&img, d.path().join("moved")).unwrap();
        std::os::unix::fs::symlink(&other_dir, &img).unwrap();
        up.rename("img", ".img.rm").unwrap();
        assert!(!up.entry_is(".img.rm", &held));
        assert!(up.hold_entry(".img.rm").is_err(), "a link is not held");
        // The parent itself renamed: still the one held.
        std::fs::rename(d.path(), d.path().with_extension("away")).unwrap();
        assert!(up.stat(".img.rm").is_ok());
        std::fs::rename(d.path().with_extension("away"), d.path()).unwrap();
    }

    #[test]
    fn made_private_and_used_by_descriptor() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("maps");
        std::fs::create_dir(&p).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o777)).unwrap();
        let dir = PrivateDir::open(d.path(), "maps").unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().mode() & 0o777, 0o700);
        assert!(dir.is(&p));
        assert!(!dir.is(d.path()));
        std::fs::write(dir.fd_path("a"), b"x").unwrap();
        dir.rename("a", "b").unwrap();
        dir.chmod("b", 0o600).unwrap();
        assert_eq!(std::fs::metadata(p.join("b")).unwrap().mode() & 0o777, 0o600);
        // Renamed away, the directory is still the one held.
        std::fs::rename(&p, d.path().join("moved")).unwrap();
        std::fs::create_dir(&p).unwrap();
        dir.unlink("b").unwrap();
        assert!(!d.path().join("moved/b").exists());
        assert!(!dir.is(&p));
    }
}
