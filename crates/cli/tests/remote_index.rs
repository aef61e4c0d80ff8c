//! A remote's signed index: what a pull takes from a remote is the latest
//! push of that name to that remote, by a key allowed to sign that name,
//! on any host, whether or not it pulled from the remote before. Through a
//! real S3-compatible server (moto_server), against what anyone with write
//! access to the bucket can do.

mod common;

use common::*;
use std::process::Command;

/// Runs `script` (python, boto3 client `s3` on moto at `port`) with `args`.
fn s3_py(port: u16, script: &str, args: &[&str]) {
    let head = r#"
import sys, json, boto3
s3 = boto3.client("s3", endpoint_url="http://127.0.0.1:" + sys.argv[1], aws_access_key_id="testing",
                  aws_secret_access_key="testing", region_name="us-east-1")
def split(k):
    return k.split("/", 1)
"#;
    let out = Command::new("python3")
        .args(["-c", &format!("{head}{script}"), &port.to_string()])
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// Copies every object under `from` (`BUCKET/PREFIX`) to `to`, keeping the
/// rest of each key: as anyone with write access to the bucket could.
fn copy_tree(port: u16, from: &str, to: &str) {
    let script = r#"
sb, sp = split(sys.argv[2])
db, dp = split(sys.argv[3])
for page in s3.get_paginator("list_objects_v2").paginate(Bucket=sb, Prefix=sp + "/"):
    for o in page.get("Contents", []):
        rest = o["Key"][len(sp):]
        s3.copy_object(Bucket=db, Key=dp + rest, CopySource={"Bucket": sb, "Key": o["Key"]})
"#;
    s3_py(port, script, &[from, to]);
}

/// Takes an image `name` of a small CPU process in `w`.
fn take(w: &mut World, name: &str) {
    let (pid, _) = w.cpu_tree();
    let r = w.json(&["hibernate", &pid.to_string(), "--image", name]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.reap(pid);
}

fn push(w: &World, name: &str, url: &str) {
    let r = w.json(&["images", "push", name, url]);
    assert_eq!(r.code, 0, "{}", r.stderr);
}

fn world(port: u16) -> World {
    let mut w = World::new(&[8192]);
    w.env_extra.extend(s3_env(port));
    w
}

fn key_of(w: &World) -> String {
    w.json(&["images", "key"]).json()["key"].as_str().unwrap().to_string()
}

/// An older push put back over a newer one is refused by a host that
/// never pulled from the remote (the signed index names the newer
/// manifest), and so is the older manifest stripped of its push record.
#[test]
fn a_new_host_refuses_an_older_push_and_a_manifest_without_its_record() {
    criu_present();
    let Some(m) = moto(&[]) else { return };
    s3_py(m.port, "s3.create_bucket(Bucket='snaps')", &[]);
    let mut w = world(m.port);
    take(&mut w, "prod");
    push(&w, "prod", "s3://snaps/fleet");
    copy_tree(m.port, "snaps/fleet/images/prod", "snaps/kept/prod-1");
    // A newer image of prod.
    assert_eq!(w.json(&["images", "rm", "prod"]).code, 0);
    take(&mut w, "prod");
    push(&w, "prod", "s3://snaps/fleet");
    let key = key_of(&w);

    copy_tree(m.port, "snaps/kept/prod-1", "snaps/fleet/images/prod");
    let fresh = world(m.port);
    let r = fresh.json(&["--trust", &key, "images", "pull", "s3://snaps/fleet/prod"]);
    assert_eq!(r.code, 2, "a new host took the older push: {}", r.stdout);
    assert!(r.stderr.contains("index") && r.stderr.contains("rollback"), "{}", r.stderr);
    assert_eq!(r.json()["error"]["kind"], "image_untrusted");

    // The same older manifest without its push record.
    let strip = r#"
b, k = split(sys.argv[2])
env = json.loads(s3.get_object(Bucket=b, Key=k)["Body"].read())
env.pop("push", None)
s3.put_object(Bucket=b, Key=k, Body=json.dumps(env).encode())
"#;
    s3_py(m.port, strip, &["snaps/fleet/images/prod/manifest.sig"]);
    let r = fresh.json(&["--trust", &key, "images", "pull", "s3://snaps/fleet/prod"]);
    assert_eq!(r.code, 2, "a manifest without its push record was taken: {}", r.stdout);
    assert!(r.stderr.contains("no signed push record") && r.stderr.contains("index"), "{}", r.stderr);

    // The latest push, pushed again, is taken.
    push(&w, "prod", "s3://snaps/fleet");
    let r = fresh.json(&["--trust", &key, "images", "pull", "s3://snaps/fleet/prod"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
}

/// A push to one remote copied to another (chunks and all) is refused
/// there: the push record names the remote it was pushed to.
#[test]
fn a_push_copied_to_another_remote_is_refused() {
    criu_present();
    let Some(m) = moto(&[]) else { return };
    s3_py(m.port, "s3.create_bucket(Bucket='snaps')", &[]);
    let mut w = world(m.port);
    take(&mut w, "prod");
    push(&w, "prod", "s3://snaps/staging");
    let key = key_of(&w);
    copy_tree(m.port, "snaps/staging", "snaps/fleet");
    let fresh = world(m.port);
    let r = fresh.json(&["--trust", &key, "images", "pull", "s3://snaps/fleet/prod"]);
    assert_eq!(r.code, 2, "a push to staging was taken from fleet: {}", r.stdout);
    assert!(r.stderr.contains("s3://snaps/staging"), "{}", r.stderr);
    let r = fresh.json(&["--trust", &key, "images", "pull", "s3://snaps/staging/prod"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
}

/// A key trusted for some names only: its pushes of those names are
/// taken, of any other name refused.
#[test]
fn a_key_trusted_for_some_names_signs_only_those() {
    criu_present();
    let Some(m) = moto(&[]) else { return };
    s3_py(m.port, "s3.create_bucket(Bucket='snaps')", &[]);
    let mut w = world(m.port);
    take(&mut w, "dev-a");
    take(&mut w, "prod");
    push(&w, "dev-a", "s3://snaps/fleet");
    push(&w, "prod", "s3://snaps/fleet");
    let scoped = format!("{}=dev-*", key_of(&w));
    let other = world(m.port);
    let r = other.json(&["--trust", &scoped, "images", "pull", "s3://snaps/fleet/dev-a"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let r = other.json(&["--trust", &scoped, "images", "pull", "s3://snaps/fleet/prod"]);
    assert_eq!(r.code, 2, "a key trusted for dev-* signed prod: {}", r.stdout);
    assert!(r.stderr.contains("dev-*") && r.stderr.contains("prod"), "{}", r.stderr);
    let r = other.json(&["--trust", &scoped, "wake", "s3://snaps/fleet/prod", "--wait", "10"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(!other.state_dir().join("images/prod").exists());
}
