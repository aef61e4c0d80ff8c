//! `ps`, `state`, `suspend`, `resume`, `stop`, `history`: a CUDA process's
//! GPU state taken off the GPU and brought back, in place.

use super::doctor;
use super::hibernate::{footprint_from_image, has_image, snapshot_if_suspended};
use crate::cli::{Cli, DeviceMap, Select};
use crate::output::{self, Out};
use crate::select::Check;
use crate::setup::{criu, engine, engine_with, mib, own_images, reconcile, Load};
use gpusnap_core::engine::{ResumeOptions, StateReport, StopOptions};
use gpusnap_core::{Error as CoreError, Store};
use gpusnap_hibernate::criu::Criu;
use gpusnap_hibernate::WakeOptions;
use gpusnap_hibernate::{Error, Hibernate};
use std::time::Duration;

/// `ps`: every CUDA process, or those of one container; each row names its
/// container, by name where its runtime can be asked.
pub fn ps(cli: &Cli, out: &Out, container: Option<&str>) -> anyhow::Result<()> {
    let only = container.map(gpusnap_core::container::resolve).transpose()?;
    let mut e = engine(cli, out)?;
    let mut rows = e.ps()?;
    if let Some(c) = &only {
        rows.retain(|r| c.pids.contains(&r.pid));
    }
    for rt in gpusnap_core::container::runtimes() {
        // A runtime whose cgroups do not name its containers: from its state.
        if rows.iter().any(|r| r.container.is_none()) {
            for (c, pids) in rt.running() {
                for r in rows.iter_mut().filter(|r| r.container.is_none() && pids.contains(&r.pid)) {
                    r.container = Some(c.clone());
                }
            }
        }
        if rows
            .iter()
            .any(|r| r.container.as_ref().is_some_and(|c| c.runtime == rt.name() && c.name.is_none()))
        {
            let names = rt.names();
            for c in rows.iter_mut().filter_map(|r| r.container.as_mut()).filter(|c| c.runtime == rt.name()) {
                if c.name.is_none() {
                    c.name = names.iter().find(|(id, _)| *id == c.id).map(|(_, n)| n.clone());
                }
            }
        }
    }
    out.ps(&rows);
    Ok(())
}

/// `state`: a pid named alone gives its report as it always did; several
/// pids or a group give a list, in the order named, each process once. A
/// group's member that is stopped is listed as such, as `ps` lists it.
pub fn state(cli: &Cli, out: &Out, select: &Select) -> anyhow::Result<()> {
    select.validate(Check::Callable)?;
    let mut e = engine(cli, out)?;
    if let Some(pid) = select.single() {
        let r = e.state(pid)?;
        out.state(&r);
        return Ok(());
    }
    let mut rows: Vec<StateReport> = Vec::new();
    for &pid in &select.pids {
        if rows.iter().any(|r| r.pid == pid) {
            continue;
        }
        let r = e.state(pid).map_err(|err| Error::Member { pid, source: Box::new(err.into()) })?;
        rows.push(r);
    }
    if select.is_group() {
        let listed = e.ps()?;
        let cuda: Vec<i32> = listed.iter().map(|r| r.pid).collect();
        for pid in select.members(&cuda)? {
            if rows.iter().any(|r| r.pid == pid) {
                continue;
            }
            if let Some(r) = listed.iter().find(|r| r.pid == pid) {
                rows.push(r.clone());
            }
        }
        if rows.is_empty() {
            eprintln!("gpusnap: no CUDA process in that group");
        }
    }
    out.states(&rows);
    Ok(())
}

pub fn history(cli: &Cli, out: &Out, pid: i32) -> anyhow::Result<()> {
    let store = Store::open_read_only(&cli.state_dir)?;
    let h = store.history(pid)?;
    out.history(pid, &h);
    Ok(())
}

pub fn suspend(cli: &Cli, out: &Out, select: &Select, lock_timeout: u32, thp: bool) -> anyhow::Result<()> {
    select.validate(Check::Callable)?;
    let mut e = engine(cli, out)?;
    reconcile(cli, &mut e);
    let pids = &select.resolve(&mut e)?;
    // Said before anything is done: what is known about suspending a
    // rank of a multi-process NCCL job.
    for &pid in pids {
        if let Some(note) = doctor::nccl_job_note(pid, pids) {
            eprintln!("gpusnap: warning: {note}");
        }
    }
    let _thp = thp.then(|| gpusnap_core::thp::Always::on(&cli.state_dir)).transpose()?;
    let r = e.suspend_group(pids, lock_timeout, &|| out.progress())?;
    out.all(&r, output::suspended);
    Ok(())
}

/// `park`: the library of each fast-swap program moves its memory to host
/// memory; the driver keeps the contexts.
pub fn park(cli: &Cli, out: &Out, select: &Select) -> anyhow::Result<()> {
    select.validate(Check::Callable)?;
    let mut e = engine(cli, out)?;
    reconcile(cli, &mut e);
    let pids = &select.resolve(&mut e)?;
    let r = e.park_group(pids, &|| out.progress())?;
    out.all(&r, output::parked);
    Ok(())
}

/// `resume`'s flags.
pub struct Resume<'a> {
    pub wait: u64,
    pub margin: u64,
    pub footprint: Option<u64>,
    pub device_map: Option<&'a DeviceMap>,
    pub snapshot_first: bool,
}

pub fn resume(cli: &Cli, out: &Out, select: &Select, a: &Resume) -> anyhow::Result<()> {
    select.validate(Check::Callable)?;
    let mut e = engine(cli, out)?;
    reconcile(cli, &mut e);
    let pids = &select.resolve(&mut e)?;
    let opts = ResumeOptions {
        margin_bytes: mib(a.margin),
        wait: Duration::from_secs(a.wait),
        footprint_bytes: a.footprint.map(mib),
        device_map: a.device_map.map(|m| m.0.clone()).unwrap_or_default(),
    };
    let store = own_images(cli)?;
    if pids.len() > 1 && !a.snapshot_first {
        // A group: admission for all of it, restores in parallel.
        let r = e.resume_group(pids, &opts, &|| out.progress())?;
        out.all(&r, output::resumed);
        return Ok(());
    }
    let criu = if a.snapshot_first { Some(criu(cli)?) } else { None };
    each(
        out,
        pids,
        |pid| {
            if let Some(c) = &criu {
                snapshot_if_suspended(&mut e, c, &store, pid)?;
            }
            let resumed = match e.resume(pid, &opts) {
                // Woken by a wake that ended before it recorded the process:
                // its footprint is the image's.
                Err(CoreError::NoFootprint { .. }) if opts.footprint_bytes.is_none() => {
                    match footprint_from_image(&store, pid) {
                        Some((image, fp)) => {
                            tracing::warn!(pid, image, "no footprint recorded: the one its image recorded");
                            let t = gpusnap_core::target::resolve(pid)?;
                            e.store_mut().record(&t, "checkpointed", Some(&fp))?;
                            e.store_mut().note(
                                &t,
                                "resume",
                                None,
                                &format!("footprint from image {image} (a wake ended before it recorded it)"),
                            )?;
                            e.resume(pid, &opts)
                        }
                        None => Err(CoreError::NoFootprint { pid }),
                    }
                }
                other => other,
            };
            match resumed {
                // Stuck, but an image of it exists: wake it from that.
                Err(CoreError::Unrecoverable { reason, .. }) if has_image(&store, pid) => {
                    tracing::warn!(pid, "{reason}; recovering from its image");
                    let c = match &criu {
                        Some(c) => c.clone(),
                        None => Criu::find(cli.criu.as_deref())?,
                    };
                    let w = WakeOptions {
                        wait: opts.wait,
                        margin_bytes: opts.margin_bytes,
                        force_resume: vec![],
                        device_map: opts.device_map.clone(),
                        force: false,
                        eager: false,
                    };
                    e.recover(&c, &store, pid, &w).map(|w| {
                        // Its footprint as the image recorded it: what came back.
                        let fp = store.manifest(&w.image).ok().and_then(|(_, m)| {
                            m.processes.iter().find(|p| p.pid == pid).map(|p| p.footprint.values().sum())
                        });
                        output::recovered_as_resume(pid, &w, fp.unwrap_or(0))
                    })
                }
                other => other.map_err(Error::from),
            }
        },
        output::resumed,
    )
}

pub fn stop(
    cli: &Cli,
    out: &Out,
    select: &Select,
    grace: u64,
    force: bool,
    lock_timeout: u32,
) -> anyhow::Result<()> {
    let began = std::time::Instant::now();
    // A stopped process is stop's to refuse (or --force), not bad input.
    select.validate(Check::Exists)?;
    let mut e = engine_with(cli, out, Load::Lenient)?;
    reconcile(cli, &mut e);
    let pids = &select.resolve(&mut e)?;
    let opts = StopOptions { grace: Duration::from_secs(grace), force, lock_timeout_ms: lock_timeout };
    let mut r = e.stop_group(pids, &opts, &|| out.progress())?;
    // The time said is the command's: its suspends and waits included.
    let total_ms = began.elapsed().as_millis() as u64;
    r.iter_mut().for_each(|r| r.total_ms = r.total_ms.max(total_ms));
    out.all(&r, output::stopped);
    Ok(())
}

/// Runs `f` on each pid in order, stopping at the first failure; the
/// results so far are printed either way (with `--json`, in the error's
/// object when it failed: one object on stdout).
fn each<T: serde::Serialize>(
    out: &Out,
    pids: &[i32],
    mut f: impl FnMut(i32) -> Result<T, Error>,
    human: impl Fn(&T) -> String,
) -> anyhow::Result<()> {
    let mut done = Vec::new();
    for &pid in pids {
        match f(pid) {
            Ok(r) => {
                out.line(&human(&r));
                done.push(r);
            }
            Err(e) => {
                out.partial_results(&done);
                return Err(e.into());
            }
        }
    }
    out.results(&done);
    Ok(())
}
