//! `gpusnap-soak`: the chaos soak. The real `gpusnap agent` with several
//! fake model servers on a fake GPU smaller than their sum, clients whose
//! every answer is checked, and a seeded, printed, replayable fault
//! injector; invariants checked after every fault and at the end. Loopback
//! only, bounded in cycles and in time. See docs/design/reliability.md.

mod agent;
mod agent_faults;
mod check;
mod clients;
mod freezer;
mod host;
mod infra;
mod lone;
mod parked;
mod settle;
mod stats;
mod supervise;

use anyhow::{Context, Result};
use clap::Parser;
use rand::{Rng, SeedableRng};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Every fault kind, in the order they are listed.
pub const KINDS: &[&str] = &[
    "agent-kill-swap",
    "agent-kill-hibernate",
    "agent-kill-wake",
    "agent-kill-park",
    "agent-kill-unpark",
    "tenant",
    "nvml-late",
    "crash-guarded",
    "crash-unguarded",
    "criu-dump-fail",
    "criu-restore-fail",
    "sigstop",
    "freeze",
    "kill-suspend",
    "kill-resume",
    "kill-hibernate",
    "kill-wake",
    "kill-park",
    "kill-unpark",
    "kill-push",
    "kill-pull",
    "pages-fail",
    "s3-stop-push",
    "s3-stop-pull",
    "corrupt-chunk",
    "full-fs",
];

#[derive(Parser, Debug)]
#[command(name = "gpusnap-soak", about = "The chaos soak of gpusnap against the fake driver")]
struct Args {
    /// The seed of every random choice: the same seed replays the same faults in the same order.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Fault cycles to run at most.
    #[arg(long, default_value_t = 20)]
    cycles: u64,
    /// Start at this cycle, with the fault the whole run would draw there
    /// (the cycles before it are drawn and not run): a quick replay of a
    /// long run's later cycles.
    #[arg(long, default_value_t = 0)]
    from_cycle: u64,
    /// Stop starting cycles after this many seconds.
    #[arg(long, default_value_t = 600)]
    max_secs: u64,
    /// Fault kinds to inject, comma-separated, or `all`.
    #[arg(long, default_value = "all")]
    faults: String,
    /// Services behind the agent (4-8).
    #[arg(long, default_value_t = 6)]
    services: usize,
    /// The agent's services never park (each is suspended when evicted or
    /// idle); by default two in three park first.
    #[arg(long)]
    no_park: bool,
    /// Client threads.
    #[arg(long, default_value_t = 3)]
    clients: usize,
    /// The fake GPU's memory (MiB): less than the services' sum.
    #[arg(long, default_value_t = 480)]
    gpu_mib: u64,
    /// The gpusnap binary (default: GPUSNAP_BIN, else next to this program).
    #[arg(long, env = "GPUSNAP_BIN")]
    gpusnap: Option<PathBuf>,
    /// Also write the table here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Keep the scratch directory (logs, state) for a look after the run.
    #[arg(long)]
    keep: bool,
    /// End the whole run, whatever it is doing, after this many seconds
    /// (default: `--max-secs` plus 600, room for the last cycle and the
    /// final checks); everything it started is ended with it.
    #[arg(long)]
    hard_secs: Option<u64>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let Some(root) = std::env::var_os(supervise::ROOT_ENV) else {
        // The supervisor: runs the soak in a worker and ends whatever it
        // left, on every way the worker ends.
        let hard =
            std::time::Duration::from_secs(args.hard_secs.unwrap_or(args.max_secs.saturating_add(600)));
        return match supervise::supervise(hard, args.keep) {
            Ok(code) => ExitCode::from(code),
            Err(e) => {
                eprintln!("gpusnap-soak: {e:#}");
                ExitCode::from(2)
            }
        };
    };
    match run(&args, PathBuf::from(root)) {
        Ok(0) => ExitCode::SUCCESS,
        Ok(_) => ExitCode::from(1),
        Err(e) => {
            eprintln!("gpusnap-soak: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn run(args: &Args, root: PathBuf) -> Result<u64> {
    let kinds: Vec<&str> = if args.faults == "all" {
        KINDS.to_vec()
    } else {
        let list: Vec<&str> = args.faults.split(',').map(str::trim).filter(|k| !k.is_empty()).collect();
        for k in &list {
            if !KINDS.contains(k) {
                anyhow::bail!("unknown fault kind {k:?}; the kinds: {}", KINDS.join(","));
            }
        }
        list
    };
    if kinds.is_empty() {
        anyhow::bail!("--faults names no kind");
    }
    let bin = match &args.gpusnap {
        Some(b) => b.clone(),
        None => std::env::current_exe()?.with_file_name("gpusnap"),
    };
    let start = Instant::now();
    let host = host::Host::new(root, bin, args.gpu_mib, Duration::from_secs(150))?;
    eprintln!(
        "gpusnap-soak: seed {} faults {} cycles {} max {} s",
        args.seed,
        kinds.join(","),
        args.cycles,
        args.max_secs,
    );
    let stats = Arc::new(stats::Stats::default());
    let agent = agent::Agent::configure(&host, args.services.clamp(2, 8), 2, !args.no_park)?;
    agent.start(&host)?;
    let services: Vec<(u16, String)> = agent.services.iter().map(|s| (s.listen, s.name.clone())).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let clients = clients::start(args.clients, args.seed, services, Arc::clone(&stats), Arc::clone(&stop));
    let moto = infra::Moto::start();
    let mut lone = lone::Lone::new(&host, Arc::clone(&stats), moto).context("the command lane")?;
    let mut parked = parked::Parked::new(&host, Arc::clone(&stats)).context("the park lane")?;
    let mut lane =
        agent_faults::Lane { host: &host, agent: &agent, stats: Arc::clone(&stats), swaps_before: 0 };

    let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed);
    // The kinds of the cycles skipped, drawn as the whole run draws them.
    for _ in 0..args.from_cycle {
        rng.gen_range(0..kinds.len());
    }
    let mut result = Ok(());
    for cycle in args.from_cycle..args.from_cycle.saturating_add(args.cycles) {
        if start.elapsed() >= Duration::from_secs(args.max_secs) {
            break;
        }
        let kind = kinds[rng.gen_range(0..kinds.len())];
        // A generator per cycle, from the seed and the cycle: a cycle's
        // choices do not depend on how the ones before it went.
        let mut crng = rand::rngs::StdRng::seed_from_u64(args.seed.wrapping_mul(7919).wrapping_add(cycle));
        eprintln!(
            "gpusnap-soak: cycle {cycle}: {kind} (replay: --seed {} --faults {} --from-cycle {cycle})",
            args.seed, args.faults
        );
        let r = (|| -> Result<()> {
            if !lane.inject(kind, &mut crng)?
                && !lone.inject(kind, &mut crng)?
                && !parked.inject(kind, &mut crng)?
            {
                anyhow::bail!("no lane injects {kind}");
            }
            Ok(())
        })();
        if let Err(e) = r {
            result = Err(e.context(format!("cycle {cycle} ({kind})")));
            break;
        }
        stats.fault(kind);
        stats.with(|c| c.cycles += 1);
        if !alive_agent(&agent) {
            stats.violation("agent_died", format!("after {kind}"));
            let _ = agent.start(&host);
        }
        let context = format!("cycle {cycle} ({kind})");
        check::services(&host, &agent, &stats, &context);
        check::answers(&agent, &stats, &context);
    }

    stop.store(true, Ordering::SeqCst);
    for c in clients {
        let _ = c.join();
    }
    check::services(&host, &agent, &stats, "the end");
    let swaps = lane.swaps_before + agent.swaps();
    agent.kill9();
    let mut leftover = agent.recorded_pids();
    leftover.push(lone.pid);
    leftover.push(parked.pid);
    lone.finish();
    parked.finish();
    check::at_rest(&host, &stats, &agent.state);
    check::at_rest(&host, &stats, &lone.state);
    check::at_rest(&host, &stats, &parked.state);
    host.end_all(&leftover);
    let m = check::mounts_under(&host.root);
    if !m.is_empty() {
        stats.violation("mount_left", format!("{m:?}"));
    }
    let table = stats.with(|c| stats::table(c, swaps, args.seed, &args.faults, start.elapsed()));
    println!("{table}");
    if let Some(out) = &args.out {
        std::fs::write(out, &table)?;
    }
    result?;
    Ok(stats.violations())
}

fn alive_agent(agent: &agent::Agent) -> bool {
    host::alive(agent.pid())
}
