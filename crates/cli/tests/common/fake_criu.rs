//! Stand-ins for criu that fail on purpose, for the tests of what a failed
//! dump or restore leaves behind.

use std::path::Path;

/// Writes an executable criu stand-in at `path`: it answers `--version` as
/// 4.2.1 (new enough), and otherwise sets `$d` to the directory that follows
/// `dir_flag` (`--images-dir`, `--work-dir`) and runs `body` (sh).
pub fn fake_criu(path: &Path, dir_flag: &str, body: &str) {
    std::fs::write(
        path,
        format!(
            "#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'Version: 4.2.1'; exit 0; fi\n\
             for a; do case $prev in {dir_flag}) d=$a;; esac; prev=$a; done\n{body}"
        ),
    )
    .unwrap();
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
}
