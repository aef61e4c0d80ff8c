//! The test's images, without a registry: a rootfs directory made into a
//! one-layer OCI image archive that `ctr images import` takes.

use sha2::{Digest, Sha256};
use std::path::Path;
use std::process::Command;

fn blob(dir: &Path, bytes: &[u8]) -> (String, usize) {
    let hex = format!("{:x}", Sha256::digest(bytes));
    std::fs::write(dir.join("blobs/sha256").join(&hex), bytes).unwrap();
    (format!("sha256:{hex}"), bytes.len())
}

/// Writes `out` (a tar of an OCI image layout) holding `rootfs` as one
/// layer, named `name` and running `entrypoint` by default.
pub fn oci_archive(rootfs: &Path, name: &str, entrypoint: &[&str], out: &Path) {
    let work = out.with_extension("d");
    std::fs::create_dir_all(work.join("blobs/sha256")).unwrap();
    let layer_tar = out.with_extension("layer.tar");
    let st = Command::new("tar")
        .arg("-C")
        .arg(rootfs)
        .args(["--numeric-owner", "-cf"])
        .arg(&layer_tar)
        .arg(".")
        .status()
        .unwrap();
    assert!(st.success(), "tar of {}", rootfs.display());
    let (layer, layer_size) = blob(&work, &std::fs::read(&layer_tar).unwrap());
    let config = serde_json::json!({
        "architecture": std::env::consts::ARCH.replace("x86_64", "amd64").replace("aarch64", "arm64"),
        "os": "linux",
        "config": { "Entrypoint": entrypoint, "Env": ["PATH=/bin"] },
        "rootfs": { "type": "layers", "diff_ids": [layer] },
    });
    let (config, config_size) = blob(&work, &serde_json::to_vec(&config).unwrap());
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": { "mediaType": "application/vnd.oci.image.config.v1+json", "digest": config, "size": config_size },
        "layers": [{ "mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer, "size": layer_size }],
    });
    let (manifest, manifest_size) = blob(&work, &serde_json::to_vec(&manifest).unwrap());
    let index = serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": manifest,
            "size": manifest_size,
            "annotations": { "io.containerd.image.name": name, "org.opencontainers.image.ref.name": "test" },
        }],
    });
    std::fs::write(work.join("index.json"), serde_json::to_vec(&index).unwrap()).unwrap();
    std::fs::write(work.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
    let st = Command::new("tar").arg("-C").arg(&work).arg("-cf").arg(out).arg(".").status().unwrap();
    assert!(st.success(), "tar of the image layout");
}
