//! The `gpusnap` command line: parses arguments, calls the library, prints.

mod cli;
mod cmd;
mod finding;
mod output;
mod reference;
mod report;
mod select;
mod setup;

use clap::Parser;
use cli::Cli;
use output::Out;
use std::ffi::OsString;
use std::process::ExitCode;

fn main() -> ExitCode {
    // The page server reads a wake's pages a chunk (1-4 MiB) at a time on
    // several threads; with glibc's defaults each such buffer is a fresh
    // mmap (or trimmed back after use), so every page of it faults in
    // again: keep buffers under 64 MiB on the heap and freed memory up to
    // 512 MiB there for the next one. The environment's MALLOC_* tunables
    // still win (glibc reads them before main).
    if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_none()
        && std::env::var_os("MALLOC_TRIM_THRESHOLD_").is_none()
    {
        // SAFETY: mallopt only changes the allocator's thresholds; called
        // first thing in main, before any other thread exists.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 64 << 20);
            libc::mallopt(libc::M_TRIM_THRESHOLD, 512 << 20);
        }
    }
    // Called as cuda-checkpoint (a link): NVIDIA's command line.
    let argv: Vec<OsString> = std::env::args_os().collect();
    if argv.first().and_then(|a| std::path::Path::new(a).file_name()).is_some_and(|n| n == "cuda-checkpoint")
    {
        init_logging(0);
        return ExitCode::from(cmd::cuda_checkpoint::main(&argv[1..]) as u8);
    }
    // The keeper of a lazy wake (hidden: started by the wake itself).
    if argv.get(1).is_some_and(|a| a == gpusnap_hibernate::lazy::KEEPER_ARG) {
        return ExitCode::from(gpusnap_hibernate::lazy::keeper_main(&argv[2..]) as u8);
    }
    // The keeper of a dump through FIFOs (hidden: started by hibernate).
    if argv.get(1).is_some_and(|a| a == gpusnap_hibernate::dumpkeeper::KEEPER_ARG) {
        return ExitCode::from(gpusnap_hibernate::dumpkeeper::keeper_main(&argv[2..]) as u8);
    }
    if let Ok(exe) = std::env::current_exe() {
        gpusnap_hibernate::lazy::set_keeper_exe(exe);
    }
    let cli = Cli::parse();
    // The agent is a daemon: its transitions are its log, at info by default.
    let daemon = matches!(cli.cmd, cli::Cmd::Agent { cmd: None, .. });
    init_logging(cli.verbose + u8::from(daemon));
    let out = Out::new(cli.json);
    match cmd::run(&cli, &out) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => ExitCode::from(report::failure(&out, e) as u8),
    }
}

fn init_logging(verbose: u8) {
    let level = match verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("GPUSNAP_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    // Colour only for a person at a terminal: a journal or a file gets
    // plain text (NO_COLOR is honoured too).
    use std::io::IsTerminal;
    let ansi = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(ansi)
        .init();
}
