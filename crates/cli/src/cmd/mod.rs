//! What each command does, one family of commands per module; this file
//! only dispatches.

pub mod agent;
pub mod cuda_checkpoint;
pub mod doctor;
mod hibernate;
mod images;
mod lifecycle;
mod manual;
mod probe;
mod run;

use crate::cli::{AgentCmd, Cli, Cmd};
use crate::output::Out;

pub fn run(cli: &Cli, out: &Out) -> anyhow::Result<()> {
    // A `--thp` or `--big-pipes` switch whose gpusnap died is put back by
    // the next one; not by the manual, made at package time.
    if !matches!(cli.cmd, Cmd::Man { .. } | Cmd::Completions { .. }) {
        for e in gpusnap_core::hostknob::reconcile(&cli.state_dir) {
            tracing::warn!("{e}");
        }
    }
    match &cli.cmd {
        Cmd::CudaCheckpoint { args } => std::process::exit(cuda_checkpoint::main(args)),
        Cmd::Doctor { pid } => doctor::run(cli, out, *pid),
        Cmd::Ps { container } => lifecycle::ps(cli, out, container.as_deref()),
        Cmd::State { select } => lifecycle::state(cli, out, select),
        Cmd::History { pid } => lifecycle::history(cli, out, *pid),
        Cmd::Probe { pid, container, port, socket } => {
            probe::probe(cli, *pid, container.as_deref(), *port, socket)
        }
        Cmd::Suspend { select, lock_timeout, thp } => {
            lifecycle::suspend(cli, out, select, *lock_timeout, *thp)
        }
        Cmd::Park { select } => lifecycle::park(cli, out, select),
        Cmd::Resume { select, wait, margin, footprint, snapshot_first, device_map } => {
            let a = lifecycle::Resume {
                wait: *wait,
                margin: *margin,
                footprint: *footprint,
                device_map: device_map.as_ref(),
                snapshot_first: *snapshot_first,
            };
            lifecycle::resume(cli, out, select, &a)
        }
        Cmd::Stop { select, grace, force, lock_timeout } => {
            lifecycle::stop(cli, out, select, *grace, *force, *lock_timeout)
        }
        Cmd::Hibernate { select, image, leave_running, lock_timeout, no_sync, thp, big_pipes, map } => {
            let a = hibernate::HibernateArgs {
                image: image.as_deref(),
                leave_running: *leave_running,
                lock_timeout: *lock_timeout,
                no_sync: *no_sync,
                thp: *thp,
                big_pipes: *big_pipes,
                map: *map,
            };
            hibernate::hibernate(cli, out, select, &a)
        }
        Cmd::Snapshot { select, image, lock_timeout, big_pipes } => {
            hibernate::snapshot(cli, out, select, image.as_deref(), *lock_timeout, *big_pipes)
        }
        Cmd::Wake { images: names, wait, margin, no_guard, device_map, eager } => {
            let a = hibernate::WakeArgs {
                wait: *wait,
                margin: *margin,
                no_guard: *no_guard,
                device_map: device_map.as_ref(),
                eager: *eager,
            };
            hibernate::wake(cli, out, names, &a)
        }
        Cmd::Recover { pid, wait, margin, force, eager } => {
            hibernate::recover(cli, out, *pid, *wait, *margin, *force, *eager)
        }
        Cmd::Images { cmd } => images::run(cli, out, cmd.as_ref()),
        Cmd::Run {
            light: true,
            name,
            lock_timeout,
            preload,
            oom_watch,
            on_fault,
            user,
            group,
            fast_swap,
            keep_pinned,
            cmd,
            ..
        } => {
            let who = run::RunAs::resolve(user.as_deref(), group.as_deref())?;
            let o = run::Opts { lock_timeout: *lock_timeout, oom_watch: *oom_watch, on_fault: *on_fault };
            let light = run::LightOptions {
                preload: preload.as_deref(),
                fast_swap: *fast_swap,
                keep_pinned: *keep_pinned,
            };
            run::run_light(cli, name.clone(), &o, &light, who, cmd)
        }
        Cmd::Run { name, lock_timeout, no_keeper, oom_watch, on_fault, cmd, .. } => {
            let o = run::Opts { lock_timeout: *lock_timeout, oom_watch: *oom_watch, on_fault: *on_fault };
            run::run(cli, name.clone(), &o, !no_keeper, cmd)
        }
        Cmd::Guard { pids, lock_timeout, takeover, daemon, on_fault } => {
            run::guard(cli, pids, *lock_timeout, *on_fault, *takeover, *daemon)
        }
        Cmd::Agent { config, cmd: None } => agent::run_agent(cli, config),
        Cmd::Agent { cmd: Some(AgentCmd::Reload { stop_removed, agent: at }), .. } => {
            agent::reload(out, &agent::reload_socket(at)?, *stop_removed)
        }
        Cmd::Logs { name, follow, lines, agent: at } => agent::logs(cli, at, name, *lines, *follow),
        Cmd::Services { agent: at } => agent::services(out, &agent::socket(at)?),
        Cmd::Service { name, action, agent: at } => agent::service(out, &agent::socket(at)?, name, *action),
        Cmd::Man { dir, markdown } => manual::man(dir.as_deref(), *markdown),
        Cmd::Completions { shell } => manual::completions(*shell),
    }
}
