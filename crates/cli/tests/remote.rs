//! The chunk store and remotes: push, pull and wake through a real
//! S3-compatible server (moto_server, a separate process on loopback) and a
//! local directory remote, with the real CRIU and the fakes.

mod common;

use common::*;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// One plain HTTP request to moto (its S3 API takes unsigned requests unless
/// auth is turned on); returns the status line.
fn http(port: u16, method: &str, path: &str) -> String {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(s, "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n").unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out.lines().next().unwrap_or("").to_string()
}

/// Points gpusnap in `w` at moto on `port`.
fn s3_world(w: &mut World, port: u16) {
    w.env_extra.extend(s3_env(port));
}

/// A python process holding `shared_mib` of bytes that are the same in every
/// process started with the same seed (and incompressible), plus 8 MiB of
/// its own; it counts in FILE so that a woken one can be seen running.
fn memory_holder(w: &mut World, shared_mib: u64, seed: &str) -> (i32, PathBuf) {
    let out = w.tmp.path().join(format!("holder-{}", w.children.len()));
    let script = r#"
import hashlib, os, sys, time
out, mib, seed = sys.argv[1], int(sys.argv[2]), sys.argv[3].encode()
shared = bytearray()
for i in range(mib // 16):
    shared += hashlib.shake_128(seed + b"%d" % i).digest(16 << 20)
private = bytearray(os.urandom(8 << 20))
i = 0
while True:
    i += 1
    if os.path.exists(out + ".go"):
        os.remove(out + ".go")
        h = hashlib.sha256(shared); h.update(private)
        with open(out + ".sum.tmp", "w") as f: f.write(h.hexdigest())
        os.replace(out + ".sum.tmp", out + ".sum")
    tmp = out + ".tmp"
    with open(tmp, "w") as f: f.write(f"{i} {len(shared) + len(private)}\n")
    os.replace(tmp, out)
    time.sleep(0.05)
"#;
    let idx = w.spawn_env("python3", &["-c", script, out.to_str().unwrap(), &shared_mib.to_string(), seed]);
    let pid = w.child_pid(idx);
    wait_for(Duration::from_secs(600), || std::fs::read_to_string(&out).is_ok_and(|s| !s.is_empty()));
    (pid, out)
}

/// The checksum of a memory holder's memory, as it computes it now.
fn memory_sum(out: &Path) -> String {
    let sum = out.with_extension("sum");
    let _ = std::fs::remove_file(&sum);
    std::fs::write(out.with_extension("go"), "").unwrap();
    wait_for(Duration::from_secs(300), || sum.exists());
    std::fs::read_to_string(&sum).unwrap()
}

fn dir_bytes(p: &Path) -> u64 {
    let mut n = 0;
    // Entries may go while they are listed (a push renames its temporary
    // files): those are not counted.
    for e in std::fs::read_dir(p).into_iter().flatten().flatten() {
        let Ok(m) = e.metadata() else { continue };
        n += if m.is_dir() { dir_bytes(&e.path()) } else { m.len() };
    }
    n
}

fn files_in(p: &Path) -> Vec<PathBuf> {
    let mut v = Vec::new();
    for e in std::fs::read_dir(p).into_iter().flatten().flatten() {
        // Gone while listed (a temporary file renamed): not listed.
        let Ok(m) = e.metadata() else { continue };
        if m.is_dir() {
            v.extend(files_in(&e.path()));
        } else {
            v.push(e.path());
        }
    }
    v
}

fn url_of(p: &Path) -> String {
    format!("file://{}", p.display())
}

#[test]
fn a_plain_process_is_pushed_pulled_and_woken_through_s3() {
    criu_present();
    let Some(m) = moto(&[]) else { return };
    assert!(http(m.port, "PUT", "/snaps").contains("200"), "bucket created");
    let mut w = World::new(&[8192]);
    s3_world(&mut w, m.port);
    let (pid, out) = w.cpu_tree();
    let p = pid.to_string();
    let r = w.json(&["hibernate", &p, "--image", "cpu"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.reap(pid);
    wait_for(Duration::from_secs(10), || !pid_exists(pid));
    let at = count(&out);

    let r = w.json(&["images", "push", "cpu", "s3://snaps/fleet"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let v = r.json();
    let total = v["bytes_total"].as_u64().unwrap();
    assert!(total > 0 && v["bytes_sent"].as_u64().unwrap() > 0 && v["seconds"].is_number(), "{v}");
    // Again: every chunk is there already; only the manifest goes.
    let v = w.json(&["images", "push", "cpu", "s3://snaps/fleet"]).json();
    assert_eq!(v["chunks_sent"], 0, "{v}");
    assert_eq!(v["bytes_deduplicated"].as_u64().unwrap(), total, "{v}");

    // Another host (its own key) refuses the image until told to trust it.
    let mut other = World::new(&[8192]);
    s3_world(&mut other, m.port);
    let r = other.json(&["images", "pull", "s3://snaps/fleet/cpu"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("--trust"), "{}", r.stderr);
    assert!(other.json(&["images"]).json()["images"].as_array().unwrap().is_empty());
    let key = w.json(&["images", "key"]).json()["key"].as_str().unwrap().to_string();
    let r = other.json(&["--trust", &key, "images", "pull", "s3://snaps/fleet/cpu", "--as", "theirs"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.json()["result"]["bytes_total"].as_u64().unwrap(), total);
    assert_eq!(other.json(&["--trust", &key, "images", "verify", "theirs"]).code, 0);

    // Here: the local image goes (and its chunks, the store is empty), and
    // wake brings it back from the remote, its pages streamed.
    assert_eq!(w.json(&["images", "rm", "cpu"]).code, 0);
    assert_eq!(w.json(&["images", "gc"]).code, 0);
    assert_eq!(dir_bytes(&w.state_dir().join("store/chunks")), 0, "an empty store");
    let r = w.json(&["wake", "s3://snaps/fleet/cpu", "--wait", "10"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.adopt(pid);
    assert_eq!(r.json()["root_pid"], pid);
    wait_for(Duration::from_secs(20), || count(&out) > at + 5);
    // Every chunk came with the wake: the image is whole here now.
    let r = w.json(&["images", "verify", "cpu"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    // A name that is not on the remote: a clear error.
    let r = w.json(&["images", "pull", "s3://snaps/fleet/nope"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("no image nope"), "{}", r.stderr);
}

#[test]
fn a_cuda_process_is_woken_from_s3() {
    criu_present();
    let Some(m) = moto(&[]) else { return };
    assert!(http(m.port, "PUT", "/gpu").contains("200"));
    let mut w = World::new(&[16_384]);
    s3_world(&mut w, m.port);
    let pid = w.workload(2048, 0, &[]);
    let p = pid.to_string();
    let r = w.json(&["hibernate", &p, "--image", "gpu"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.reap(pid);
    let r = w.json(&["images", "push", "gpu", "s3://gpu"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(w.json(&["images", "rm", "gpu"]).code, 0);
    assert_eq!(w.json(&["images", "gc"]).code, 0);
    let r = w.json(&["wake", "s3://gpu/gpu", "--wait", "10"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.adopt(pid);
    assert_eq!(r.json()["resumed"][0], pid);
    w.assert_progressing(pid);
    let r = w.json(&["stop", &p, "--grace", "2"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
}

#[test]
fn replicas_share_chunks_an_interrupted_push_resumes_gc_keeps_the_other_and_damage_is_refused() {
    criu_present();
    let mut w = World::new(&[8192]);
    w.run_limit = Duration::from_secs(600);
    let (a, _) = memory_holder(&mut w, 1024, "weights");
    let (b, _) = memory_holder(&mut w, 1024, "weights");
    for (pid, name) in [(a, "a"), (b, "b")] {
        let r = w.json(&["hibernate", &pid.to_string(), "--image", name, "--no-sync"]);
        assert_eq!(r.code, 0, "{}", r.stderr);
        w.reap(pid);
    }
    let one = w.json(&["images", "verify", "a"]).json();
    let image_bytes: u64 = one["files"].as_array().unwrap().iter().map(|f| f["size"].as_u64().unwrap()).sum();
    assert!(image_bytes > 1 << 30, "{image_bytes}");

    // A push killed mid-way leaves no image on the remote; the next one
    // sends only what is missing.
    let remote = w.tmp.path().join("remote");
    let url = url_of(&remote);
    let push = w.spawn_gpusnap(&["--json", "images", "push", "a", &url]);
    let chunks_dir = remote.join("chunks");
    wait_for(Duration::from_secs(600), || files_in(&chunks_dir).len() >= 3);
    let _ = Command::new("kill").args(["-9", &w.child_pid(push).to_string()]).status();
    w.wait_child(push);
    let manifest = remote.join("images/a/manifest.json");
    assert!(!manifest.exists(), "a half-pushed image is never visible");
    let r = w.json(&["images", "push", "a", &url]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let v = r.json();
    assert!(v["bytes_deduplicated"].as_u64().unwrap() > 0, "resumed: {v}");
    assert!(manifest.exists());
    let r = w.json(&["images", "push", "b", &url]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let v = r.json();
    // All of the 1 GiB of weights but the chunks across their two ends and
    // across the 256 MiB segment edges, which fall elsewhere in the two
    // files (about a chunk each, ~1 MiB on average, 4 MiB at most).
    assert!(v["bytes_deduplicated"].as_u64().unwrap() > (1 << 30) - (16 << 20), "b shares a's weights: {v}");

    // Two images cost less than 1.3x one, remote and local.
    let remote_bytes = dir_bytes(&chunks_dir);
    let local_bytes = dir_bytes(&w.state_dir().join("store/chunks"));
    assert!(
        (remote_bytes as f64) < 1.3 * image_bytes as f64,
        "remote {remote_bytes} vs one image {image_bytes}"
    );
    assert!(
        (local_bytes as f64) < 1.3 * image_bytes as f64,
        "store {local_bytes} vs one image {image_bytes}"
    );

    // gc after rm: b stays whole (every chunk of it), a's own chunks go.
    assert_eq!(w.json(&["images", "rm", "a"]).code, 0);
    let r = w.json(&["images", "gc"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.json()["chunks"]["chunks_removed"].as_u64().unwrap() > 0, "{}", r.stdout);
    let vb = w.json(&["images", "verify", "b"]).json();
    for f in vb["files"].as_array().unwrap() {
        for c in f["chunks"].as_array().into_iter().flatten() {
            let h = c["blake3"].as_str().unwrap();
            assert!(w.state_dir().join("store/chunks").join(&h[..2]).join(h).exists(), "chunk {h} of b kept");
        }
    }
    // Pushing b again to a fresh remote needs only what the store kept.
    let r = w.json(&["images", "push", "b", &url_of(&w.tmp.path().join("remote2"))]);
    assert_eq!(r.code, 0, "{}", r.stderr);

    // A pull killed with -9 mid-way: nothing installed, nothing of the
    // other host's own lost; pulled again, it resumes and the image is whole.
    let key = w.json(&["images", "key"]).json()["key"].as_str().unwrap().to_string();
    let mut other = World::new(&[8192]);
    other.run_limit = Duration::from_secs(600);
    let (mine, _) = other.cpu_tree();
    let r = other.json(&["hibernate", &mine.to_string(), "--image", "mine"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    other.reap(mine);
    let their_chunks = other.state_dir().join("store/chunks");
    let had = files_in(&their_chunks).len();
    let pull = other.spawn_gpusnap(&["--json", "--trust", &key, "images", "pull", &format!("{url}/b")]);
    wait_for(Duration::from_secs(600), || files_in(&their_chunks).len() >= had + 3);
    let _ = Command::new("kill").args(["-9", &other.child_pid(pull).to_string()]).status();
    other.wait_child(pull);
    let names: Vec<String> = other.json(&["images"]).json()["images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(names, vec!["mine".to_string()], "no half-pulled image");
    assert_eq!(other.json(&["images", "verify", "mine"]).code, 0, "nothing local lost");
    let r = other.json(&["--trust", &key, "images", "pull", &format!("{url}/b")]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let v = r.json();
    assert!(v["result"]["bytes_deduplicated"].as_u64().unwrap() > 0, "resumed: {v}");
    assert_eq!(other.json(&["--trust", &key, "images", "verify", "b"]).code, 0, "whole");
    assert_eq!(other.json(&["images", "verify", "mine"]).code, 0);
    assert_eq!(other.json(&["images", "rm", "b"]).code, 0);
    assert_eq!(other.json(&["images", "gc"]).code, 0);

    // A damaged chunk on the remote is refused by a host pulling it, and
    // nothing is installed there.
    // The largest chunk of b that this host does not hold itself: one its
    // own image `mine` shares with b (the same bytes, cut the same way) is
    // never fetched, so damage to it could not be seen here.
    // Nor one of a's alone: the remote holds both images' chunks.
    let local: std::collections::HashSet<String> = files_in(&their_chunks)
        .iter()
        .filter_map(|p| p.file_name().and_then(|n| n.to_str()).map(String::from))
        .collect();
    let b_manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(remote.join("images/b/manifest.json")).unwrap()).unwrap();
    let of_b: std::collections::HashSet<String> = b_manifest["files"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|f| f["chunks"].as_array().cloned().unwrap_or_default())
        .filter_map(|c| c["blake3"].as_str().map(String::from))
        .collect();
    let victim = files_in(&chunks_dir)
        .into_iter()
        .filter(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| of_b.contains(n) && !local.contains(n))
        })
        .max_by_key(|p| std::fs::metadata(p).unwrap().len())
        .expect("b has chunks this host lacks");
    let mut bytes = std::fs::read(&victim).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x55;
    std::fs::write(&victim, bytes).unwrap();
    let r = other.json(&["--trust", &key, "images", "pull", &format!("{url}/b")]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("corrupt"), "{}", r.stderr);
    let names: Vec<String> = other.json(&["images"]).json()["images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(names, vec!["mine".to_string()], "nothing installed");
    // A wake streaming from it refuses the chunk too (its bytes never reach
    // the process), and leaves nothing running.
    let r = other.json(&["--trust", &key, "wake", &format!("{url}/b"), "--wait", "10", "--no-guard"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("fails its checksum"), "{}", r.stderr);
    wait_for(Duration::from_secs(30), || !pid_exists(b));
}

#[test]
fn replicas_cost_one_image_in_the_local_store_and_wake_from_it_whole() {
    criu_present();
    let mut w = World::new(&[8192]);
    w.run_limit = Duration::from_secs(600);
    let (a, out_a) = memory_holder(&mut w, 1024, "weights");
    let (b, out_b) = memory_holder(&mut w, 1024, "weights");
    let sums = [memory_sum(&out_a), memory_sum(&out_b)];
    // Durable (the default): every chunk on disk before the manifest.
    for (pid, name) in [(a, "a"), (b, "b")] {
        let r = w.json(&["hibernate", &pid.to_string(), "--image", name]);
        assert_eq!(r.code, 0, "{}", r.stderr);
        w.reap(pid);
        wait_for(Duration::from_secs(30), || !pid_exists(pid));
    }
    let one = w.json(&["images", "verify", "a"]).json();
    let image_bytes: u64 = one["files"].as_array().unwrap().iter().map(|f| f["size"].as_u64().unwrap()).sum();
    assert!(image_bytes > 1 << 30, "{image_bytes}");
    // No push: the store alone holds the pages, once.
    let store = dir_bytes(&w.state_dir().join("store/chunks"));
    assert!((store as f64) < 1.3 * image_bytes as f64, "store {store} vs one image {image_bytes}");
    for n in ["a", "b"] {
        let dir = w.state_dir().join("images").join(n);
        assert!(dir_bytes(&dir) < 64 << 20, "image {n} keeps only small files: {}", dir_bytes(&dir));
        assert!(!files_in(&dir).iter().any(|p| p.to_string_lossy().contains("/pages-")));
    }
    // Each wakes from the chunks (lazily, then eagerly) with its memory whole.
    let r = w.json(&["wake", "a", "--wait", "10", "--no-guard"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.adopt(a);
    let r = w.json(&["wake", "b", "--wait", "10", "--no-guard", "--eager"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.adopt(b);
    assert_eq!(memory_sum(&out_a), sums[0]);
    assert_eq!(memory_sum(&out_b), sums[1]);
    // The copies CRIU read are gone from its work directory.
    let logs = w.state_dir().join("logs");
    assert!(
        !files_in(&logs).iter().any(|p| p.to_string_lossy().contains("/pages-")),
        "{:?}",
        files_in(&logs)
    );
    w.kill(a);
    w.kill(b);
}

#[test]
fn an_unreachable_endpoint_and_wrong_credentials_are_clear_errors_and_nothing_is_lost() {
    criu_present();
    let mut w = World::new(&[8192]);
    let (pid, _) = w.cpu_tree();
    let r = w.json(&["hibernate", &pid.to_string(), "--image", "cpu"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.reap(pid);
    // Nothing listens on port 1 (tcpmux), and no S3 server of the tests
    // beside this one takes it. (The error's text holds the chunks' hex
    // names: "403" in one of them once made a refused connection "denied";
    // refusals are now matched as whole words.)
    s3_world(&mut w, 1);
    let r = w.json(&["images", "push", "cpu", "s3://snaps/x"]);
    assert_eq!(r.code, 6, "{}", r.stderr);
    assert!(r.stderr.contains("remote s3://snaps/x"), "{}", r.stderr);
    assert_eq!(r.json()["error"]["kind"], "remote_unreachable");
    let r = w.json(&["wake", "s3://snaps/x/cpu"]);
    assert_eq!(r.code, 6, "{}", r.stderr);
    assert_eq!(w.json(&["images", "verify", "cpu"]).code, 0, "the local image is intact");
    let r = w.json(&["images", "push", "cpu", "ftp://x"]);
    assert_eq!(r.code, 2, "{}", r.stderr);

    // moto with IAM auth on: the keys it issued work, others are refused.
    let Some(m) = moto(&[("INITIAL_NO_AUTH_ACTION_COUNT", "0")]) else { return };
    w.env_extra.clear();
    s3_world(&mut w, m.port);
    let r = w.json(&["images", "push", "cpu", "s3://snaps/x"]);
    assert_eq!(r.code, 6, "{}", r.stderr);
    assert!(r.stderr.contains("access denied"), "{}", r.stderr);
    assert_eq!(r.json()["error"]["kind"], "remote_denied");
    assert_eq!(w.json(&["images", "verify", "cpu"]).code, 0, "the local image is intact");
}

/// Copies object `from` over `to` (`BUCKET/KEY`) on moto (S3 CopyObject,
/// signed by boto3, moto's own client library), as anyone with write
/// access to the bucket could.
fn copy_object(port: u16, from: &str, to: &str) {
    let script = r#"
import sys, boto3
port, src, dst = sys.argv[1], sys.argv[2], sys.argv[3]
s3 = boto3.client("s3", endpoint_url="http://127.0.0.1:" + port, aws_access_key_id="testing",
                  aws_secret_access_key="testing", region_name="us-east-1")
sb, sk = src.split("/", 1)
db, dk = dst.split("/", 1)
s3.copy_object(Bucket=db, Key=dk, CopySource={"Bucket": sb, "Key": sk})
"#;
    let out = Command::new("python3").args(["-c", script, &port.to_string(), from, to]).output().unwrap();
    assert!(out.status.success(), "copy {from} -> {to}: {}", String::from_utf8_lossy(&out.stderr));
}

fn copy_manifest(port: u16, from: &str, to: &str) {
    for f in ["manifest.sig", "manifest.json"] {
        copy_object(port, &format!("{from}/{f}"), &format!("{to}/{f}"));
    }
}

/// A pull (and a wake from the remote) refuses another image's signed
/// manifest copied over an image's, and an older push of the same image
/// put back over a newer one (unless told to take it): each push signs
/// the name it is stored under and a version one above the last.
#[test]
fn a_manifest_copied_over_another_or_rolled_back_is_refused() {
    criu_present();
    let Some(m) = moto(&[]) else { return };
    assert!(http(m.port, "PUT", "/snaps").contains("200"), "bucket created");
    let mut w = World::new(&[8192]);
    s3_world(&mut w, m.port);
    for name in ["prod", "dev"] {
        let (pid, _) = w.cpu_tree();
        let r = w.json(&["hibernate", &pid.to_string(), "--image", name]);
        assert_eq!(r.code, 0, "{}", r.stderr);
        w.reap(pid);
        let r = w.json(&["images", "push", name, "s3://snaps/fleet"]);
        assert_eq!(r.code, 0, "{}", r.stderr);
    }
    let (prod, dev, old) = ("snaps/fleet/images/prod", "snaps/fleet/images/dev", "snaps/kept/prod-1");
    copy_manifest(m.port, prod, old);
    // Pushed again: version 2.
    assert_eq!(w.json(&["images", "push", "prod", "s3://snaps/fleet"]).code, 0);

    let key = w.json(&["images", "key"]).json()["key"].as_str().unwrap().to_string();
    let mut other = World::new(&[8192]);
    s3_world(&mut other, m.port);
    let pull = |o: &World, extra: &[&str]| {
        let mut args = vec!["--trust", &key, "images", "pull", "s3://snaps/fleet/prod"];
        args.extend_from_slice(extra);
        o.json(&args)
    };
    let r = pull(&other, &[]);
    assert_eq!(r.code, 0, "{}", r.stderr);

    // Version 1 put back: a rollback, refused; taken when asked.
    copy_manifest(m.port, old, prod);
    let r = pull(&other, &[]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("rollback") && r.stderr.contains("--allow-rollback"), "{}", r.stderr);
    let r = other.json(&["--trust", &key, "wake", "s3://snaps/fleet/prod", "--wait", "10"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("rollback"), "{}", r.stderr);
    let r = pull(&other, &["--allow-rollback"]);
    assert_eq!(r.code, 0, "{}", r.stderr);

    // dev's manifest, signed by the same trusted key, copied over prod's:
    // refused here and on a host that saw no version of it.
    copy_manifest(m.port, dev, prod);
    let mut fresh = World::new(&[8192]);
    s3_world(&mut fresh, m.port);
    for o in [&other, &fresh] {
        let r = pull(o, &["--as", "copied"]);
        assert_eq!(r.code, 2, "{}", r.stderr);
        assert!(r.stderr.contains("pushed as \"dev\""), "{}", r.stderr);
        let r = o.json(&["--trust", &key, "wake", "s3://snaps/fleet/prod", "--wait", "10"]);
        assert_eq!(r.code, 2, "{}", r.stderr);
        assert!(!o.state_dir().join("images/copied").exists());
    }
    // What was pulled as prod before is still prod's.
    let body = std::fs::read_to_string(other.state_dir().join("images/prod/manifest.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["name"], "prod");
}

#[test]
fn a_missing_bucket_says_so_with_the_fix_in_one_line() {
    let Some(m) = moto(&[]) else { return };
    let mut w = World::new(&[1000]);
    s3_world(&mut w, m.port);
    let r = w.json(&["images", "pull", "s3://nobucket/fleet/cpu"]);
    assert_eq!(r.code, 6, "{}", r.stderr);
    let line = r.stderr.trim();
    assert!(
        line.contains("no bucket \"nobucket\": create it (aws s3 mb s3://nobucket)") && !line.contains('\n'),
        "{line}"
    );
    assert!(!line.contains("<Error>"), "{line}");
    assert_eq!(r.json()["error"]["kind"], "remote_no_bucket");
}
