//! Lazy wakes: CRIU restores the tree with --lazy-pages and gpusnap's page
//! server fills its memory (crates/pages), with the real CRIU.

mod common;

use common::*;
use std::path::Path;
use std::time::Duration;

/// Asks the woken process to fork, remap, unmap and remove, then checks
/// that it read every byte as it was.
fn check_memory(out: &Path) {
    let _ = std::fs::remove_file(out.with_extension("after"));
    std::fs::write(out.with_extension("go"), "").unwrap();
    check_read(out);
}

/// Waits for the process's report (asked for with its `go` file) and
/// checks that it read every byte as it was.
fn check_read(out: &Path) {
    wait_for(Duration::from_secs(60), || out.with_extension("after").exists());
    let before = read_ext(out, "before");
    assert_eq!(read_ext(out, "after"), before, "memory after the wake (A, moved B, C, D half removed)");
    assert_eq!(read_ext(out, "child"), before.split(' ').next().unwrap(), "a child forked during the wake");
}

/// Hibernates `pid` to `image`; its JSON report.
fn hibernate(w: &World, pid: i32, image: &str) -> serde_json::Value {
    let r = w.json(&["hibernate", &pid.to_string(), "--image", image]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    wait_for(Duration::from_secs(10), || !pid_exists(pid));
    r.json()
}

/// Runs a wake (`args`: the whole command line), which must succeed, and
/// registers `pid`, woken, for cleanup.
fn wake(w: &mut World, pid: i32, args: &[&str]) -> Run {
    let r = w.json(args);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.adopt(pid);
    r
}

/// A wake of `pid`, which acts on its memory (its `go` file is made) while
/// the page server fills it: a wake that failed because the process removed
/// pages while a copy into them was in flight (the one race the page server
/// cannot undo, docs/design/wake.md) ended the tree and kept the image, and is
/// tried again, a few times at most.
fn wake_acting(w: &mut World, pid: i32, out: &Path, args: &[&str]) -> Run {
    for _ in 0..8 {
        // What a failed try's process wrote is not this wake's, and the
        // process it woke may have taken its `go` already.
        let _ = std::fs::remove_file(out.with_extension("after"));
        let _ = std::fs::remove_file(out.with_extension("child"));
        std::fs::write(out.with_extension("go"), "").unwrap();
        let r = w.json(args);
        if r.code == 0 {
            w.adopt(pid);
            return r;
        }
        assert!(r.stderr.contains("while a copy into it was in flight"), "{}", r.stderr);
        eprintln!("the wake raced a removal and failed safely; again");
        wait_for(Duration::from_secs(10), || !pid_exists(pid));
    }
    panic!("eight wakes in a row raced a removal");
}

#[test]
fn a_lazy_wake_serves_every_page_through_fork_remap_unmap_and_remove() {
    criu_present();
    let mut w = World::new(&[8192]);
    let (pid, out) = mem_proc(&mut w, "lazy", 32);
    hibernate(&w, pid, "mem");
    w.env_extra.push(("GPUSNAP_FILE_PAGES".into(), "1".into()));
    // The process acts on its memory as soon as it runs again, while the
    // page server is still filling it.
    std::fs::write(out.with_extension("go"), "").unwrap();
    let v = wake_acting(&mut w, pid, &out, &["wake", "mem", "--no-guard"]).json();
    assert_eq!(v["lazy"], true, "{v}");
    assert!(v["pages_bytes"].as_u64().unwrap() >= 4 * (32 << 20) / 2, "{v}");
    for stage in ["verify", "waited", "criu", "driver", "pages"] {
        assert!(v["stages"][stage].is_u64(), "{stage} in {v}");
    }
    // The pages of its own files (Python and its libraries) it had in
    // memory were recorded by the hibernate and read ahead by the wake
    // (asked for above; off by default).
    assert!(v["file_pages_bytes"].as_u64().unwrap() > 0, "{v}");
    check_read(&out);
    // And once more, now that every page is in place.
    check_memory(&out);
    w.kill(pid);
}

#[test]
fn the_page_server_is_tunable_from_the_environment_and_reports_what_it_did() {
    criu_present();
    let mut w = World::new(&[8192]);
    let (pid, out) = mem_proc(&mut w, "tuned", 16);
    // CRIU's own account of the dump, beside gpusnap's stages.
    let h = hibernate(&w, pid, "mem");
    assert!(h["criu_stats"]["pages_written"].as_u64().unwrap() >= 4 * (16 << 20) / 4096, "{h}");
    for stage in ["suspend", "dump", "commit", "criu_frozen", "criu_drain", "criu_memwrite"] {
        assert!(h["stages"][stage].is_u64(), "{stage} in {h}");
    }
    assert!(h["stages"]["criu_frozen"].as_u64() <= h["stages"]["dump"].as_u64(), "{h}");

    // Every knob away from its default, and a head start of half the
    // memory before the (here: no) driver restore.
    for (k, v) in [
        ("GPUSNAP_PAGES_THREADS", "3"),
        ("GPUSNAP_PAGES_BATCH", "1M"),
        ("GPUSNAP_PAGES_WAKE_CHUNK", "64K"),
        ("GPUSNAP_PAGES_FAULT_BATCH", "64K"),
        ("GPUSNAP_PAGES_AHEAD", "1M"),
        ("GPUSNAP_PAGES_NICE", "5"),
        ("GPUSNAP_PAGES_HEAD_START", "50%"),
        ("GPUSNAP_PAGES_FOLLOW_MIN", "1M"),
    ] {
        w.env_extra.push((k.into(), v.into()));
    }
    let trace = w.tmp.path().join("trace.json");
    w.env_extra.push(("GPUSNAP_PAGES_TRACE".into(), trace.display().to_string()));
    std::fs::write(out.with_extension("go"), "").unwrap();
    let v = wake_acting(&mut w, pid, &out, &["wake", "mem", "--no-guard"]).json();
    assert_eq!(v["lazy"], true, "{v}");
    assert!(v["stages"]["head_start"].is_u64(), "{v}");
    let p = &v["pages"];
    assert_eq!(p["options"]["threads"], 3, "{v}");
    assert_eq!(p["options"]["wake_chunk"], 64 << 10, "{v}");
    assert_eq!(p["options"]["head_start"]["fraction"], 0.5, "{v}");
    let (fault, fill, eexist) = (
        p["fault_bytes"].as_u64().unwrap(),
        p["fill_bytes"].as_u64().unwrap(),
        p["eexist_pages"].as_u64().unwrap(),
    );
    assert_eq!(fault + fill + eexist * 4096, v["pages_bytes"].as_u64().unwrap(), "{v}");
    assert!(p["faults"].as_u64().unwrap() >= p["faults_in_flight"].as_u64().unwrap(), "{v}");
    assert!(p["restore_done_ms"].is_u64() && p["last_page_ms"].is_u64() && p["fill_gbps"].is_f64(), "{v}");
    assert!(p["in_place_bytes"].as_u64().unwrap() <= fill + fault, "{v}");
    assert!(p["book_ms"].is_u64() && p["nap_ms"].is_u64() && p["pieces"].as_u64().unwrap() > 0, "{v}");
    assert_eq!(p["options"]["follow_min"], 1 << 20, "{v}");
    // The trace: the process's pieces, every fault, fills covering every
    // page copied.
    let t: serde_json::Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    assert!(!t["pieces"][pid.to_string()].as_array().unwrap().is_empty(), "{t}");
    let fills = t["fills"].as_array().unwrap();
    assert!(fills.iter().all(|f| f.as_array().unwrap().len() == 12), "{t}");
    let claimed: u64 = fills.iter().map(|f| f[4].as_u64().unwrap()).sum();
    assert!(claimed >= fault + fill, "{claimed} < {fault} + {fill}");
    // The report is taken once every page is in place; faults the kernel
    // had queued before that are still read (and traced) until the server
    // ends: only those up to the report's last fault are in its count.
    let last_us = p["last_fault_ms"].as_u64().unwrap_or(0) * 1000;
    let traced = t["faults"].as_array().unwrap().iter().filter(|f| f[0].as_u64().unwrap() < last_us).count();
    assert!(traced as u64 <= p["faults"].as_u64().unwrap(), "{t}");
    assert!(t["head_done_us"].is_u64() && t["restore_done_us"].as_u64().unwrap() > 0, "{t}");
    check_read(&out);
    check_memory(&out);
    w.kill(pid);

    // A setting that is not one: said, and the wake is eager (safe as ever).
    let (pid, out) = mem_proc(&mut w, "badknob", 4);
    hibernate(&w, pid, "mem2");
    w.env_extra.push(("GPUSNAP_PAGES_BATCH".into(), "lots".into()));
    let v = wake(&mut w, pid, &["wake", "mem2", "--no-guard"]).json();
    assert_eq!(v["lazy"], false, "{v}");
    assert!(v["notice"].as_str().unwrap().contains("GPUSNAP_PAGES_BATCH=lots: not a size"), "{v}");
    check_memory(&out);
    w.kill(pid);
}

#[test]
fn a_removal_that_meets_a_copy_in_flight_fails_the_wake_safely_and_keeps_the_image() {
    criu_present();
    let mut w = World::new(&[8192]);
    let (pid, out) = mem_proc(&mut w, "raced", 16);
    hibernate(&w, pid, "mem");
    // The process removes half of D (madvise DONTNEED) as soon as it runs;
    // the hook takes that removal as one a copy met (a real one: a copy
    // that landed after the kernel zapped the range).
    std::fs::write(out.with_extension("go"), "").unwrap();
    w.env_extra.push(("GPUSNAP_TEST_PAGES_REMOVE_RACED".into(), "1".into()));
    // The fill slowed (one thread, 20 ms a chunk: seconds for this memory),
    // so that the removal meets it however late a loaded machine runs the
    // process; a fill done first would leave nothing to race.
    w.env_extra.push(("GPUSNAP_PAGES_SLOW_US".into(), "20000".into()));
    w.env_extra.push(("GPUSNAP_PAGES_THREADS".into(), "1".into()));
    let r = w.json(&["wake", "mem", "--no-guard"]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert_eq!(r.json()["error"]["kind"], "pages", "{}", r.stderr);
    assert!(r.stderr.contains("(MADV_DONTNEED) while a copy into it was in flight"), "{}", r.stderr);
    // The woken tree is ended, the image kept; the next wake is whole.
    wait_for(Duration::from_secs(10), || !pid_exists(pid));
    assert_eq!(w.json(&["images", "verify", "mem"]).code, 0);
    w.env_extra.clear();
    // Woken whole, then acting: what the failed try's process left (its
    // `go` untaken, its results) is not this wake's. Acting only once
    // every page is in place keeps this wake out of the real race, which
    // a busy machine met six times in a row (the other tests act during
    // the fill).
    for ext in ["go", "after", "child"] {
        let _ = std::fs::remove_file(out.with_extension(ext));
    }
    wake(&mut w, pid, &["wake", "mem", "--no-guard"]);
    std::fs::write(out.with_extension("go"), "").unwrap();
    check_read(&out);
    w.kill(pid);
}

#[test]
fn eager_keeps_criu_restoring_every_page() {
    criu_present();
    let mut w = World::new(&[8192]);
    let (pid, out) = mem_proc(&mut w, "eager", 8);
    hibernate(&w, pid, "mem");
    let v = wake(&mut w, pid, &["wake", "mem", "--eager", "--no-guard"]).json();
    assert_eq!(v["lazy"], false, "{v}");
    assert_eq!(v["pages_bytes"], 0, "{v}");
    assert!(v.get("notice").is_none(), "{v}");
    check_memory(&out);
    w.kill(pid);
}

#[test]
fn a_criu_that_cannot_restore_lazily_falls_back_to_eager_with_a_notice() {
    criu_present();
    let mut w = World::new(&[8192]);
    let (pid, out) = mem_proc(&mut w, "fallback", 8);
    hibernate(&w, pid, "mem");
    // A CRIU (or kernel) without lazy restores: the lazy restore fails.
    let wrapper = criu_without_lazy(&w);
    let r = wake(&mut w, pid, &["--criu", wrapper.to_str().unwrap(), "wake", "mem", "--no-guard"]);
    let v = r.json();
    assert_eq!(v["lazy"], false, "{v}");
    assert!(v["notice"].as_str().unwrap().contains("woken eagerly"), "{v}");
    assert!(r.stderr.contains("notice: lazy wake not possible"), "{}", r.stderr);
    check_memory(&out);
    w.kill(pid);
}

#[test]
fn a_corrupted_page_is_refused_before_any_process_runs_on_it() {
    criu_present();
    let mut w = World::new(&[8192]);
    let (pid, out) = mem_proc(&mut w, "corrupt", 8);
    hibernate(&w, pid, "mem");
    // A chunk in the middle of its memory damaged in the store: the wake
    // refuses it when the chunk is read (before CRIU for the pages CRIU
    // restores, in the page server for the lazy ones).
    let (pages, good) = corrupt_pages_chunk(&w.state_dir(), "mem", &[]);
    let r = w.json(&["wake", "mem", "--no-guard"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("fails its checksum"), "{}", r.stderr);
    wait_for(Duration::from_secs(30), || !pid_exists(pid));
    assert!(!pid_exists(pid), "nothing was left running");
    // The chunk put back, the same image wakes.
    std::fs::write(&pages, &good).unwrap();
    assert_eq!(wake(&mut w, pid, &["wake", "mem", "--no-guard"]).json()["lazy"], true);
    check_memory(&out);
    w.kill(pid);
}

#[test]
fn fake_cuda_workloads_wake_lazily_as_a_group() {
    criu_present();
    let mut w = World::new(&[16_384]);
    let a = w.workload(1024, 0, &[]);
    let b = w.workload(2048, 0, &[]);
    let (m, out) = mem_proc(&mut w, "group", 8);
    let r = w.json(&["hibernate", &a.to_string(), &b.to_string(), &m.to_string(), "--image", "g"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    for p in [a, b, m] {
        w.reap(p);
        wait_for(Duration::from_secs(10), || !pid_exists(p));
    }
    let names = [format!("g-{a}"), format!("g-{b}"), format!("g-{m}")];
    let mut args = vec!["wake", "--no-guard", "--wait", "10"];
    args.extend(names.iter().map(String::as_str));
    let r = w.json(&args);
    assert_eq!(r.code, 0, "{}", r.stderr);
    for p in [a, b, m] {
        w.adopt(p);
    }
    let v = r.json();
    let results = v["results"].as_array().unwrap();
    assert_eq!(results.len(), 3, "{v}");
    assert!(results.iter().all(|x| x["lazy"] == true), "{v}");
    // The CUDA data came back intact and the programs go on.
    for p in [a, b] {
        w.assert_progressing(p);
        assert_eq!(w.json(&["state", &p.to_string()]).json()["state"], "running");
    }
    check_memory(&out);
    for p in [a, b] {
        assert_eq!(w.json(&["stop", &p.to_string(), "--grace", "2"]).code, 0);
    }
    w.kill(m);
}
