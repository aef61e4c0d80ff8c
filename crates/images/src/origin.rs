//! Which remote an image pulled for a streamed wake still streams from:
//! a file beside the store per image, forgotten once the image is whole here.

use crate::manifest::valid_name;
use gpusnap_chunks::RemoteUrl;
use std::fs;
use std::path::{Path, PathBuf};

fn origin_path(state_dir: &Path, name: &str) -> PathBuf {
    state_dir.join("store").join("origins").join(name)
}

/// The remote an image streamed from (its chunks not all here yet).
pub fn origin(state_dir: &Path, name: &str) -> Option<String> {
    if !valid_name(name) {
        return None;
    }
    let f = gpusnap_files::open_regular(&origin_path(state_dir, name), 4096).ok()?;
    let s = String::from_utf8(gpusnap_files::read_bounded(f, 4096).ok()?).ok()?;
    Some(s.trim().to_string()).filter(|s| RemoteUrl::is_remote(s))
}

pub(crate) fn set_origin(state_dir: &Path, name: &str, url: &str) -> std::io::Result<()> {
    let p = origin_path(state_dir, name);
    if let Some(d) = p.parent() {
        gpusnap_files::mkdir_private(d)?;
    }
    gpusnap_files::write_private(&p, url.as_bytes())
}

/// The image is whole here (or gone): its origin is forgotten.
pub fn clear_origin(state_dir: &Path, name: &str) {
    if valid_name(name) {
        let _ = fs::remove_file(origin_path(state_dir, name));
    }
}
