//! `hibernate`, `snapshot`, `wake`, `recover`: whole process trees dumped
//! into images by CRIU and restored from them, with the guard kept out of
//! CRIU's way.

use crate::cli::{Cli, DeviceMap, Select};
use crate::output::{self, Out};
use crate::select::Check;
use crate::setup::{criu, engine, engine_with, images, mib, own_images, reconcile, DynEngine, Load};
use gpusnap_core::Error as CoreError;
use gpusnap_hibernate::criu::Criu;
use gpusnap_hibernate::{Error, Hibernate};
use gpusnap_hibernate::{HibernateOptions, WakeOptions};
use gpusnap_images::image::ImageStore;
use std::path::Path;
use std::time::Duration;

/// `hibernate`'s flags.
pub struct HibernateArgs<'a> {
    pub image: Option<&'a str>,
    pub leave_running: bool,
    pub lock_timeout: u32,
    pub no_sync: bool,
    pub thp: bool,
    pub big_pipes: bool,
    pub map: bool,
}

pub fn hibernate(cli: &Cli, out: &Out, select: &Select, a: &HibernateArgs) -> anyhow::Result<()> {
    let _thp = a.thp.then(|| gpusnap_core::thp::Always::on(&cli.state_dir)).transpose()?;
    let opts = HibernateOptions {
        name: a.image.map(str::to_string),
        leave_running: a.leave_running,
        lock_timeout_ms: a.lock_timeout,
        durable: !a.no_sync,
        big_pipes: a.big_pipes,
        map: a.map,
    };
    hibernate_roots(cli, out, select, &opts)
}

pub fn snapshot(
    cli: &Cli,
    out: &Out,
    select: &Select,
    image: Option<&str>,
    lock_timeout: u32,
    big_pipes: bool,
) -> anyhow::Result<()> {
    let opts = HibernateOptions {
        name: image.map(str::to_string),
        leave_running: true,
        lock_timeout_ms: lock_timeout,
        durable: true,
        big_pipes,
        map: false,
    };
    hibernate_roots(cli, out, select, &opts)
}

/// `wake`'s flags.
pub struct WakeArgs<'a> {
    pub wait: u64,
    pub margin: u64,
    pub no_guard: bool,
    pub device_map: Option<&'a DeviceMap>,
    pub eager: bool,
}

pub fn wake(cli: &Cli, out: &Out, names: &[String], a: &WakeArgs) -> anyhow::Result<()> {
    let c = criu(cli)?;
    let store = images(cli)?;
    // A remote image (URL/NAME) is put in place with its small files;
    // its pages stream from the remote as the wake reads them.
    let mut local_names = Vec::with_capacity(names.len());
    for n in names {
        if gpusnap_images::remote::Url::is_remote(n) {
            let p = out.progress();
            let done = std::sync::atomic::AtomicU64::new(0);
            let r = gpusnap_images::remote::pull_for_wake(&store, n, &|t| p.begin("pull", t), &|k| {
                p.update(done.fetch_add(k, std::sync::atomic::Ordering::Relaxed) + k)
            });
            p.end();
            local_names.push(r?.0);
        } else {
            local_names.push(n.clone());
        }
    }
    let names = &local_names;
    let mut e = engine_with(cli, out, Load::Background)?;
    reconcile(cli, &mut e);
    let opts = WakeOptions {
        wait: Duration::from_secs(a.wait),
        margin_bytes: mib(a.margin),
        force_resume: vec![],
        device_map: a.device_map.map(|m| m.0.clone()).unwrap_or_default(),
        force: false,
        eager: a.eager,
    };
    let r = e.wake_group(&c, &store, names, &opts)?;
    if !a.no_guard {
        let pids: Vec<i32> = r.iter().flat_map(|w| w.processes.iter().copied()).collect();
        if let Err(e) = start_guard(&cli.state_dir, &pids) {
            tracing::warn!("woken, but the guard could not attach: {e}");
        }
    }
    if let [one] = r.as_slice() {
        out.one(one, &output::woken(one));
    } else {
        out.all(&r, output::woken);
    }
    Ok(())
}

pub fn recover(
    cli: &Cli,
    out: &Out,
    pid: i32,
    wait: u64,
    margin: u64,
    force: bool,
    eager: bool,
) -> anyhow::Result<()> {
    gpusnap_core::target::resolve(pid)?;
    let c = criu(cli)?;
    let store = own_images(cli)?;
    let mut e = engine(cli, out)?;
    reconcile(cli, &mut e);
    let opts = WakeOptions {
        wait: Duration::from_secs(wait),
        margin_bytes: mib(margin),
        force_resume: vec![],
        device_map: vec![],
        force,
        eager,
    };
    let r = e.recover(&c, &store, pid, &opts)?;
    out.one(&r, &output::woken(&r));
    Ok(())
}

/// Hibernate (or snapshot) with the guard out of CRIU's way: CRIU must be
/// the only tracer while it dumps. The guard is re-attached where the tree
/// stays alive.
fn hibernate_roots(cli: &Cli, out: &Out, select: &Select, opts: &HibernateOptions) -> anyhow::Result<()> {
    select.validate(Check::Callable)?;
    let c = criu(cli)?;
    let store = images(cli)?;
    let mut e = engine_with(cli, out, Load::Lenient)?;
    reconcile(cli, &mut e);
    let roots = select.roots(&mut e)?;
    if roots.is_empty() {
        // As for the other commands, a group that turns out empty is no error.
        eprintln!("gpusnap: no process in that group: nothing to hibernate");
        out.all::<gpusnap_hibernate::HibernateReport>(&[], output::hibernated);
        return Ok(());
    }
    let mut tree: Vec<i32> = Vec::new();
    for &root in &roots {
        gpusnap_core::target::resolve_callable(root)?;
        gpusnap_core::container::refuse_lone_dump(root)?;
        tree.extend(gpusnap_core::tree::process_tree(root).into_iter().map(|(p, _)| p));
    }
    let detached = gpusnap_guard::detach_for(&cli.state_dir, &tree)?;
    let res = e.hibernate_group(&c, &store, &roots, opts);
    respawn_guard(&cli.state_dir, &detached);
    let r = res?;
    if let [one] = r.as_slice() {
        out.one(one, &output::hibernated(one));
    } else {
        out.all(&r, output::hibernated);
    }
    Ok(())
}

/// The state directory an image store lives in (`STATE/images`).
fn store_dir(store: &ImageStore) -> &Path {
    store.root.parent().unwrap_or(&store.root)
}

/// Re-attaches a guard to the detached processes that are still alive.
fn respawn_guard(state_dir: &Path, detached: &[i32]) {
    let alive: Vec<i32> =
        detached.iter().copied().filter(|p| gpusnap_core::target::resolve(*p).is_ok()).collect();
    if let Err(e) = start_guard(state_dir, &alive) {
        tracing::error!("could not re-attach the guard to {alive:?}: {e}");
    }
}

/// Starts `gpusnap guard --daemon PIDS` in the background.
pub fn start_guard(state_dir: &Path, pids: &[i32]) -> Result<(), Error> {
    if pids.is_empty() {
        return Ok(());
    }
    let exe = std::env::current_exe().map_err(|e| CoreError::Proc { pid: 0, reason: e.to_string() })?;
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("--state-dir").arg(state_dir).args(["guard", "--daemon"]);
    cmd.args(pids.iter().map(|p| p.to_string()));
    let st = cmd
        .stdin(std::process::Stdio::null())
        .status()
        .map_err(|e| CoreError::Proc { pid: 0, reason: format!("cannot start the guard: {e}") })?;
    if !st.success() {
        return Err(CoreError::Proc { pid: pids[0], reason: "the guard could not attach".into() }.into());
    }
    Ok(())
}

pub fn has_image(store: &ImageStore, pid: i32) -> bool {
    gpusnap_core::target::resolve(pid).is_ok_and(|t| store.find_for(pid, t.start_time).is_some())
}

/// For a process CRIU restored from an image by a wake that ended (killed)
/// before it recorded the process: the footprint the newest image holding
/// a CUDA process of this pid and name recorded for it, and that image's
/// name. (CRIU restores a process with its pid, under a new start time.)
pub fn footprint_from_image(
    store: &ImageStore,
    pid: i32,
) -> Option<(String, std::collections::BTreeMap<String, u64>)> {
    let t = gpusnap_core::target::resolve(pid).ok()?;
    store
        .list()
        .into_iter()
        .filter_map(Result::ok)
        .filter_map(|(name, m)| {
            let p = m.processes.iter().find(|p| p.pid == pid && p.cuda && p.comm == t.comm)?;
            (!p.footprint.is_empty()).then(|| (m.created_ms, name, p.footprint.clone()))
        })
        .max_by_key(|(created, _, _)| *created)
        .map(|(_, name, fp)| (name, fp))
}

/// `resume --snapshot-first`: an image of the process while it is suspended
/// (and so holds no GPU memory), kept until the next snapshot replaces it.
pub fn snapshot_if_suspended(
    e: &mut DynEngine,
    criu: &Criu,
    store: &ImageStore,
    pid: i32,
) -> Result<(), Error> {
    let st = e.state(pid)?;
    if st.state != "checkpointed" {
        return Ok(());
    }
    // A new name each time; older snapshots of this process go only once
    // the new one is written.
    let prefix = format!("resume-{pid}-{}-", st.start_time);
    let name = format!("{prefix}{}", gpusnap_core::store::now_ms());
    let older: Vec<String> = store
        .list()
        .into_iter()
        .filter_map(Result::ok)
        .map(|(n, _)| n)
        .filter(|n| n.starts_with(&prefix))
        .collect();
    let opts = HibernateOptions {
        name: Some(name),
        leave_running: true,
        lock_timeout_ms: 30_000,
        durable: true,
        big_pipes: false,
        map: false,
    };
    let tree: Vec<i32> = gpusnap_core::tree::process_tree(pid).into_iter().map(|(p, _)| p).collect();
    let detached = gpusnap_guard::detach_for(store_dir(store), &tree)?;
    let res = e.hibernate(criu, store, pid, &opts);
    respawn_guard(store_dir(store), &detached);
    res?;
    for n in older {
        let _ = store.remove(&n);
    }
    Ok(())
}
