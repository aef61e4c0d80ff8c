//! The file systems of the containers tests run: a root built from the
//! host's own files (no registry), and the mounts a runtime leaves behind.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A container's root file system at `root`: the dynamic loader and
/// libraries the fake workload and gpusnap need (from the build directory
/// `target`), busybox where the host has a static one.
pub fn build_rootfs(root: &Path, target: &Path) -> bool {
    for d in ["proc", "sys", "dev", "tmp", "etc", "bin"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    std::fs::write(root.join("etc/passwd"), "root:x:0:0:root:/:/bin/sh\n").unwrap();
    let mut libs: Vec<PathBuf> = Vec::new();
    for b in [target.join("fake-workload"), PathBuf::from(env!("CARGO_BIN_EXE_gpusnap"))] {
        let o = Command::new("ldd").arg(&b).output().expect("ldd");
        for l in String::from_utf8_lossy(&o.stdout).lines() {
            let p = l.split("=>").last().unwrap_or("").split_whitespace().next().unwrap_or("");
            if p.starts_with('/') && !libs.iter().any(|x| x == Path::new(p)) {
                libs.push(PathBuf::from(p));
            }
        }
    }
    for l in &libs {
        let dst = root.join(l.strip_prefix("/").unwrap());
        std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
        std::fs::copy(l, &dst).unwrap();
    }
    for bb in ["/bin/busybox", "/usr/bin/busybox"] {
        if Path::new(bb).is_file() {
            std::fs::copy(bb, root.join("bin/busybox")).unwrap();
            for a in ["sh", "sleep", "cat", "kill", "ps"] {
                std::os::unix::fs::symlink("busybox", root.join("bin").join(a)).unwrap();
            }
            return true;
        }
    }
    false
}

/// Detaches every mount under `dir` (what a runtime left mounted there, such
/// as a container's /dev/shm), deepest first, so that `dir` can be removed.
pub fn unmount_under(dir: &Path) {
    let dir = dir.display().to_string();
    let mut mounts: Vec<String> = std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().nth(4).map(str::to_string))
        .filter(|m| m.starts_with(&dir))
        .collect();
    mounts.sort_by_key(|m| std::cmp::Reverse(m.len()));
    for m in mounts {
        let c = std::ffi::CString::new(m).unwrap();
        // SAFETY: a NUL-terminated path; umount2 reads it and nothing else.
        unsafe {
            libc::umount2(c.as_ptr(), libc::MNT_DETACH);
        }
    }
}
