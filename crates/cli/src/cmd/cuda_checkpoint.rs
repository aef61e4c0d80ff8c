//! `cuda-checkpoint`: NVIDIA's command line, answered by gpusnap.
//!
//! Reached as `gpusnap cuda-checkpoint ARGS` or through a link named
//! `cuda-checkpoint`, so that CRIU's CUDA plugin and gVisor's
//! `--cuda-checkpoint-path` use gpusnap unchanged. The output formats are the
//! ones those callers parse: `--get-state` prints the state word and a
//! newline, `--get-restore-tid` the thread id and a newline, actions print
//! nothing on success; failures print one line on stderr and exit 1.

use gpusnap_core::compat::Action;
use gpusnap_core::Error as CoreError;
use gpusnap_cuda::ProcessState;
use std::ffi::OsString;
use std::path::PathBuf;

pub const HELP: &str = "\
CUDA checkpoint and restore utility (gpusnap compatible implementation).
Toggles the state of CUDA within a process between suspended and running.

Usage: cuda-checkpoint [OPTION]...

    --toggle --pid <value>
        Toggle the checkpoint state of the process: a running process is
        locked and checkpointed, a checkpointed one restored and unlocked.

    --get-state --pid <value>
        Print the CUDA state of the process: running, locked, checkpointed or
        failed.

    --get-restore-tid --pid <value>
        Print the thread id of the CUDA restore thread of the process.

    --action <value> --pid <value> [--timeout <value>] [--device-map <value>]
        Run one step: lock, checkpoint, restore or unlock.

    --timeout <value>
        Lock timeout in milliseconds (0: wait for queued work to finish).

    --device-map <value>
        Restore onto other GPUs: comma-separated old=new pairs of GPU UUIDs
        (or indices). Pairs not given are completed.

    --help, -h
        Show this help.

gpusnap adds admission control to restore, refuses thread ids other than
the restore thread, and never hangs on a stopped process.
";

#[derive(Debug, Default, PartialEq, Eq)]
struct Args {
    toggle: bool,
    get_state: bool,
    get_restore_tid: bool,
    action: Option<String>,
    pid: Option<i32>,
    timeout: Option<u32>,
    device_map: Option<String>,
    help: bool,
}

fn parse(args: &[OsString]) -> Result<Args, String> {
    let mut a = Args::default();
    let mut it = args.iter().map(|s| s.to_string_lossy().into_owned()).peekable();
    while let Some(arg) = it.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (arg.clone(), None),
        };
        let mut value = |name: &str| -> Result<String, String> {
            inline.clone().or_else(|| it.next()).ok_or_else(|| format!("{name} needs a value"))
        };
        match flag.as_str() {
            "--toggle" => a.toggle = true,
            "--get-state" => a.get_state = true,
            "--get-restore-tid" => a.get_restore_tid = true,
            "--help" | "-h" => a.help = true,
            "--action" => a.action = Some(value("--action")?),
            "--pid" | "-p" => {
                let v = value("--pid")?;
                a.pid = Some(v.parse().map_err(|_| format!("invalid pid: {v}"))?);
            }
            "--timeout" => {
                let v = value("--timeout")?;
                a.timeout = Some(v.parse().map_err(|_| format!("invalid timeout: {v}"))?);
            }
            "--device-map" => a.device_map = Some(value("--device-map")?),
            other => return Err(format!("unrecognized option: {other}")),
        }
    }
    Ok(a)
}

/// Runs the compatible command line; returns the exit code.
pub fn main(args: &[OsString]) -> i32 {
    let a = match parse(args) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            eprint!("{HELP}");
            return 1;
        }
    };
    if a.help || (!a.toggle && !a.get_state && !a.get_restore_tid && a.action.is_none()) {
        print!("{HELP}");
        return if a.help { 0 } else { 1 };
    }
    let Some(pid) = a.pid else {
        eprintln!("--pid is required");
        return 1;
    };
    match run(&a, pid) {
        Ok(out) => {
            if let Some(line) = out {
                println!("{line}");
            }
            0
        }
        Err(e) => {
            eprintln!("Error: pid {pid}: {e}");
            1
        }
    }
}

fn state_dir() -> PathBuf {
    std::env::var_os("GPUSNAP_STATE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/lib/gpusnap"))
}

fn run(a: &Args, pid: i32) -> anyhow::Result<Option<String>> {
    let mut e = crate::setup::engine_at(&state_dir())?;
    if a.get_state {
        let st = e.compat_state(pid)?;
        return Ok(Some(st.to_string()));
    }
    if a.get_restore_tid {
        return Ok(Some(e.compat_restore_tid(pid)?.to_string()));
    }
    let margin = 256 << 20;
    let device_map = match &a.device_map {
        Some(m) => gpusnap_core::remap::parse(m).map_err(CoreError::BadMap)?,
        None => Vec::new(),
    };
    if a.toggle {
        let steps: &[Action] = match e.compat_state(pid)? {
            ProcessState::Running => {
                &[Action::Lock { timeout_ms: a.timeout.unwrap_or(0) }, Action::Checkpoint]
            }
            ProcessState::Checkpointed => {
                &[Action::Restore { device_map: device_map.clone() }, Action::Unlock]
            }
            ProcessState::Locked => &[Action::Unlock],
            other => anyhow::bail!("cannot toggle a process in state {other}"),
        };
        for s in steps {
            e.compat_action(pid, s, margin)?;
        }
        return Ok(None);
    }
    let action = match a.action.as_deref() {
        Some("lock") => Action::Lock { timeout_ms: a.timeout.unwrap_or(0) },
        Some("checkpoint") => Action::Checkpoint,
        Some("restore") => Action::Restore { device_map },
        Some("unlock") => Action::Unlock,
        Some(other) => anyhow::bail!("unknown action {other} (lock, checkpoint, restore or unlock)"),
        None => anyhow::bail!("nothing to do"),
    };
    e.compat_action(pid, &action, margin)?;
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(v: &[&str]) -> Result<Args, String> {
        parse(&v.iter().map(OsString::from).collect::<Vec<_>>())
    }

    #[test]
    fn parses_what_criu_and_gvisor_send() {
        let a = p(&["--action", "lock", "--pid", "42", "--timeout", "5000"]).unwrap();
        assert_eq!((a.action.as_deref(), a.pid, a.timeout), (Some("lock"), Some(42), Some(5000)));
        assert!(p(&["--get-restore-tid", "--pid", "7"]).unwrap().get_restore_tid);
        assert!(p(&["--toggle", "--pid=7"]).unwrap().toggle);
        assert!(p(&["-h"]).unwrap().help);
        assert!(p(&["--pid", "x"]).is_err());
        assert!(p(&["--bogus"]).is_err());
    }

    #[test]
    fn help_names_every_flag_the_callers_probe_for() {
        for f in
            ["--action", "--get-state", "--get-restore-tid", "--toggle", "--pid", "--timeout", "--device-map"]
        {
            assert!(HELP.contains(f), "{f}");
        }
    }
}
