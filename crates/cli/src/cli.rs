//! The command line's definitions (clap): every command, argument and flag
//! with its help. Parsing only; what a command does lives in `cmd`.

use clap::{Parser, Subcommand};
use gpusnap_agent::control::Action;
use gpusnap_guard::OnFault;
use std::ffi::OsString;
use std::path::PathBuf;

/// What the exit code of a command says (also in --help and gpusnap(1)).
const EXIT_STATUS: &str = "\
Exit status:
  0  done
  1  failed (no driver, CRIU failed, stop refused, an I/O error, ...)
  2  bad input, nothing done: no such process, a thread id, a stopped process,
     a reused pid, a process without CUDA, a bad image name, bad arguments
  3  not enough free GPU memory: the resume or wake was refused, nothing changed
  4  a driver call failed; the process was put back as it was
  5  the process cannot be restored in place (see `gpusnap recover`)
  6  a remote could not be reached or refused access
  8, 9, 10  `gpusnap probe`: the server is dead, does not listen, is stuck
`gpusnap run` exits as the program did.";

#[derive(Parser)]
#[command(
    name = "gpusnap",
    version,
    about = "Take live CUDA processes off the GPU and bring them back, safely",
    after_long_help = EXIT_STATUS
)]
pub struct Cli {
    /// Machine-readable output: one JSON object on stdout, no progress.
    #[arg(long, global = true)]
    pub json: bool,
    /// Where gpusnap keeps its journal, ledger and images.
    #[arg(long, global = true, env = "GPUSNAP_STATE_DIR", default_value = "/var/lib/gpusnap")]
    pub state_dir: PathBuf,
    /// More logging on stderr (-v: info, -vv: debug, every driver call).
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,
    /// The CRIU binary (default: `criu` on PATH); CRIU >= 4.0 is required, 4.2 on kernels >= 6.16.
    #[arg(long, global = true, env = "GPUSNAP_CRIU")]
    pub criu: Option<PathBuf>,
    /// Also trust images signed by KEY (64 hex digits, or a file holding
    /// them: `gpusnap images key` on the host that took them prints its
    /// key); KEY=PATTERN[,PATTERN...] trusts it only for the image names
    /// the patterns match (`*`, `?`, `[...]`). Images signed by this host's
    /// own key are always trusted; `recover` trusts only those.
    #[arg(long, global = true, value_name = "KEY")]
    pub trust: Vec<String>,
    #[command(subcommand)]
    pub cmd: Cmd,
}

#[derive(Subcommand)]
pub enum Cmd {
    /// Every CUDA process this host can see, with its checkpoint state and
    /// the container it runs in.
    Ps {
        /// Only the CUDA processes of this running container (name or id).
        #[arg(long, value_name = "NAME|ID")]
        container: Option<String>,
    },
    /// The checkpoint state of processes: running, parked, locked,
    /// checkpointed or failed, and whether one is stuck.
    ///
    /// One line per process. With --json, a single pid named alone gives its
    /// object ({"pid": ..., "state": ...}); several pids or a group give
    /// {"processes": [...]}, the same shape as `gpusnap ps`. A group's
    /// stopped members are listed as "stopped" (the driver is not asked).
    State {
        #[command(flatten)]
        select: Select,
    },
    /// Take processes' GPU state to host RAM (lock + checkpoint), freeing their GPU memory.
    Suspend {
        #[command(flatten)]
        select: Select,
        /// How long to wait for queued GPU work to drain before giving up (ms, 0 = forever).
        #[arg(long, value_name = "MS", default_value_t = 30_000)]
        lock_timeout: u32,
        /// Switch transparent huge pages to `always` for the checkpoint and
        /// back after it (host-wide while it runs; checkpoint about 1.5-2x
        /// faster, measured; see docs/design/wake.md).
        #[arg(long)]
        thp: bool,
    },
    /// Move a fast-swap program's memory to pinned host memory and keep its
    /// CUDA context on the GPU (no lock, no checkpoint); `resume` brings
    /// the memory back.
    ///
    /// Only programs started with `gpusnap run --light --fast-swap` (and
    /// the agent's servers) can be parked; any other process is refused
    /// (exit 11): `suspend` takes it off the GPU. What the library does
    /// not serve (the context, modules, graphs, managed memory) stays on
    /// the GPU: `ps` shows it as the residual. `suspend` of a parked
    /// process finishes the suspend without moving the memory again.
    Park {
        #[command(flatten)]
        select: Select,
    },
    /// Bring suspended or parked processes back onto the GPU, only when the memory is there.
    Resume {
        #[command(flatten)]
        select: Select,
        /// Wait up to SECS for enough free GPU memory instead of refusing at once.
        #[arg(long, value_name = "SECS", default_value_t = 0)]
        wait: u64,
        /// Free memory to require on each GPU beyond the process's footprint (MiB).
        #[arg(long, value_name = "MIB", default_value_t = 256)]
        margin: u64,
        /// Footprint to assume for a process suspended outside gpusnap (MiB).
        #[arg(long, value_name = "MIB")]
        footprint: Option<u64>,
        /// Restore onto other GPUs of the same model: OLD=NEW,... (indices or
        /// UUIDs); GPUs not named are completed into a permutation.
        #[arg(long, value_name = "MAP", value_parser = parse_map)]
        device_map: Option<DeviceMap>,
        /// Take an image of the (suspended) process first, so that a restore
        /// raced by a tenant outside gpusnap can be recovered from it.
        #[arg(long)]
        snapshot_first: bool,
    },
    /// Suspend a process tree's CUDA state, dump the tree with CRIU into an image, and end it.
    ///
    /// A PID is the root of a tree (its children go with it). A group
    /// (several pids, --tree, --cgroup, --all) is hibernated as the trees
    /// that hold it, one image each (NAME-ROOT), all or nothing: no tree is
    /// ended until every image is written.
    Hibernate {
        #[command(flatten)]
        select: Select,
        /// Image name (default COMM-PID-MILLIS), under STATE_DIR/images.
        #[arg(long)]
        image: Option<String>,
        /// Keep the tree running (as it was) after the image is written.
        #[arg(long)]
        leave_running: bool,
        /// End the tree without waiting for the image to reach the disk
        /// (faster; a host crash right after could lose both).
        #[arg(long)]
        no_sync: bool,
        /// How long to wait for queued GPU work to drain before giving up (ms, 0 = forever).
        #[arg(long, value_name = "MS", default_value_t = 30_000)]
        lock_timeout: u32,
        /// Switch transparent huge pages to `always` for the checkpoint and
        /// back after it (host-wide while it runs; checkpoint about 1.5-2x
        /// faster, measured; see docs/design/wake.md).
        #[arg(long)]
        thp: bool,
        /// Raise fs.pipe-max-size to 64 MiB for the dump and back after it,
        /// where gpusnap lacks CAP_SYS_RESOURCE (host-wide while it runs: any
        /// process may then make pipes that large; CRIU's pages move through
        /// larger pipes, see docs/design/chunk-store.md). Also GPUSNAP_DUMP_BIG_PIPES=1.
        #[arg(long)]
        big_pipes: bool,
        /// Also build the image's map file (as `gpusnap images map`): a warm
        /// wake then maps its CUDA processes' host copies from the page cache
        /// instead of filling them (disk and page cache the size of those
        /// host copies; see docs/design/wake.md, "The mapped wake").
        #[arg(long)]
        map: bool,
    },
    /// Keep an image of a process tree and leave it as it is (= hibernate --leave-running).
    Snapshot {
        #[command(flatten)]
        select: Select,
        /// Image name (default COMM-PID-MILLIS), under STATE_DIR/images.
        #[arg(long)]
        image: Option<String>,
        /// How long to wait for queued GPU work to drain before giving up (ms, 0 = forever).
        #[arg(long, value_name = "MS", default_value_t = 30_000)]
        lock_timeout: u32,
        /// As hibernate's --big-pipes.
        #[arg(long)]
        big_pipes: bool,
    },
    /// Restore a process tree from an image and put its CUDA processes back on the GPU.
    ///
    /// Several images (the trees of a hibernated group) are woken all or
    /// nothing: all verified and admitted together before any is restored.
    Wake {
        /// Image names under STATE_DIR/images, or paths to image directories.
        #[arg(required = true, num_args = 1..)]
        images: Vec<String>,
        /// Wait up to SECS for GPU memory and for the image's pids to come free.
        #[arg(long, value_name = "SECS", default_value_t = 0)]
        wait: u64,
        /// Free memory to require on each GPU beyond the processes' footprints (MiB).
        #[arg(long, value_name = "MIB", default_value_t = 256)]
        margin: u64,
        /// Do not attach the guard to the woken processes.
        #[arg(long)]
        no_guard: bool,
        /// Restore onto other GPUs of the same model: OLD=NEW,... (this host's
        /// indices, or UUIDs; the image's GPUs by UUID).
        #[arg(long, value_name = "MAP", value_parser = parse_map)]
        device_map: Option<DeviceMap>,
        /// Restore every page before the tree runs (CRIU alone), not lazily
        /// through gpusnap's page server while the tree already runs.
        #[arg(long)]
        eager: bool,
    },
    /// Bring back a process stuck after a failed restore from its newest image.
    Recover {
        /// The stuck process (its image is the newest taken of it on this host).
        pid: i32,
        /// Roll a process that is not stuck back to its image anyway.
        #[arg(long)]
        force: bool,
        /// Wait up to SECS for GPU memory and for the image's pids to come free.
        #[arg(long, value_name = "SECS", default_value_t = 0)]
        wait: u64,
        /// Free memory to require on each GPU beyond the processes' footprints (MiB).
        #[arg(long, value_name = "MIB", default_value_t = 256)]
        margin: u64,
        /// Restore every page before the tree runs (CRIU alone), not lazily.
        #[arg(long)]
        eager: bool,
    },
    /// List, verify or remove images.
    Images {
        #[command(subcommand)]
        cmd: Option<ImagesCmd>,
    },
    /// Safe teardown: suspend, check the GPU memory is released, then SIGTERM/SIGKILL.
    Stop {
        #[command(flatten)]
        select: Select,
        /// Seconds between SIGTERM and SIGKILL.
        #[arg(long, value_name = "SECS", default_value_t = 10)]
        grace: u64,
        /// Kill even when the CUDA state cannot be suspended first (risky on some hosts).
        #[arg(long)]
        force: bool,
        /// How long to wait for queued GPU work to drain before giving up (ms, 0 = forever).
        #[arg(long, value_name = "MS", default_value_t = 30_000)]
        lock_timeout: u32,
    },
    /// Run a program under the guard: a dying CUDA process is suspended before it dies.
    ///
    /// Fatal signals (SIGSEGV, SIGABRT, an unhandled SIGTERM, ...) and exits
    /// (exit(), _exit() from any thread) of the program and of every child it
    /// starts are caught; the death then proceeds with its own signal or exit
    /// code, and `run` exits as the program did. SIGKILL (and the kernel's
    /// OOM killer) cannot be caught.
    Run {
        /// A name for the journal.
        #[arg(long)]
        name: Option<String>,
        /// How long the guard's suspend of a dying process waits for queued
        /// GPU work to drain (ms, 0 = forever).
        #[arg(long, value_name = "MS", default_value_t = 10_000)]
        lock_timeout: u32,
        /// Do not leave a keeper that re-attaches a new guard if this one dies.
        #[arg(long)]
        no_keeper: bool,
        /// Watch the program's memory cgroup and suspend its CUDA processes
        /// while host memory can still take their device memory, so that
        /// the kernel's OOM killer (SIGKILL, uncatchable) finds them suspended.
        #[arg(long)]
        oom_watch: bool,
        /// No tracing: load libgpusnap_preload.so into the program, which asks
        /// the guard to suspend a dying process from inside it. Signals and
        /// forks then cost nothing extra; raw `exit_group` calls (Go, static
        /// binaries) and children that drop LD_PRELOAD are not caught
        /// (docs/design/safety.md).
        #[arg(long)]
        light: bool,
        /// The preload library for --light (default: next to gpusnap, or
        /// GPUSNAP_PRELOAD).
        #[arg(long, value_name = "PATH", requires = "light")]
        preload: Option<std::path::PathBuf>,
        /// Run the program as this user (a name or a uid; --light only): the
        /// guard stays with gpusnap, the program gets the user's uid, its
        /// primary group unless --group says otherwise, and no
        /// supplementary groups.
        #[arg(long, value_name = "USER", requires = "light")]
        user: Option<String>,
        /// Run the program with this group (a name or a gid; --light only).
        #[arg(long, value_name = "GROUP", requires = "light")]
        group: Option<String>,
        /// What the guard does with a dying process whose CUDA context
        /// faulted (it cannot be suspended): `exit` lets it die (its context
        /// torn down), `hold` keeps it from dying until `gpusnap stop
        /// --force` or a reboot (docs/design/safety.md). Either way `run`
        /// then exits 7.
        #[arg(long, value_enum, value_name = "POLICY", default_value = "exit")]
        on_fault: OnFault,
        /// With --light: serve the program's device allocations from the
        /// driver's virtual memory API, so that a suspend moves them to
        /// pinned host memory at the link's speed and the driver checkpoints
        /// only the rest (docs/design/fast-swap.md).
        #[arg(long, requires = "light")]
        fast_swap: bool,
        /// With --fast-swap: keep the pinned host copies after each resume.
        /// Host memory as large as the moved device memory stays taken
        /// while the program runs; in return every suspend after the first
        /// copies at the link's speed without pinning memory anew.
        #[arg(long, requires = "fast_swap")]
        keep_pinned: bool,
        /// The program and its arguments, after `--`.
        #[arg(required = true, last = true, value_name = "PROGRAM")]
        cmd: Vec<OsString>,
    },
    /// Attach the guard to running processes (and their children).
    ///
    /// Fatal signals are caught. Exits are caught only for processes started
    /// by `gpusnap run` (they carry its exit filter, also after hibernate and
    /// wake): a filter cannot be added to a running process from outside.
    Guard {
        /// The processes to guard (their children too).
        pids: Vec<i32>,
        /// How long the guard's suspend of a dying process waits for queued
        /// GPU work to drain (ms, 0 = forever).
        #[arg(long, value_name = "MS", default_value_t = 10_000)]
        lock_timeout: u32,
        /// Take over from a guard that died (used by its keeper).
        #[arg(long, value_name = "GUARD_PID")]
        takeover: Option<i32>,
        /// What the guard does with a dying process whose CUDA context
        /// faulted: `exit` lets it die, `hold` keeps it from dying until
        /// `gpusnap stop --force` (see `run --on-fault`).
        #[arg(long, value_enum, value_name = "POLICY", default_value = "exit")]
        on_fault: OnFault,
        /// Detach from the terminal and run in the background.
        #[arg(long)]
        daemon: bool,
    },
    /// NVIDIA's cuda-checkpoint command line, with gpusnap's safety (also
    /// reached through a link named cuda-checkpoint).
    #[command(disable_help_flag = true)]
    CudaCheckpoint {
        /// cuda-checkpoint's own arguments (`gpusnap cuda-checkpoint --help` lists them).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, num_args = 0..)]
        args: Vec<OsString>,
    },
    /// The journal of one pid: every driver call gpusnap made on it.
    History {
        /// The process id (also of a process that has ended).
        pid: i32,
    },
    /// The node agent: a proxy per model server that suspends it when idle
    /// and brings it back on the next request (docs/design/agent.md).
    Agent {
        /// The agent's configuration (docs/design/agent.md).
        #[arg(long, value_name = "FILE", default_value = "/etc/gpusnap/agent.toml")]
        config: PathBuf,
        #[command(subcommand)]
        cmd: Option<AgentCmd>,
    },
    /// Whether a server can answer, for a Kubernetes exec probe: exit 0 for
    /// a running or suspended (wakeable) one listening on --port, without
    /// waking it.
    ///
    /// Not ready, each with its exit code and a one-line reason: 8 dead, 9
    /// nothing listens on the port (in the process's network namespace),
    /// 10 stuck (a process of its tree stopped, or frozen in its cgroup as
    /// the agent or the driver sees it), 5 cannot be restored in
    /// place (a failed restore). Bad input (a thread id, a process tree
    /// without CUDA, a pid reused by another program) is 2. Whether it is
    /// suspended or cannot be restored comes from the agent on --socket
    /// (which reads --pid in the probe's own pid namespace, as a container
    /// sees it), else from the driver and the state directory when the
    /// probe runs in the host's pid namespace; with neither, a server that
    /// lives and listens is ready, "alive". With --json, one object:
    /// {"ready", "state", "pid", "port", "source", "reason", "exit_code"}.
    Probe {
        /// The server's process (its tree is judged).
        #[arg(long, value_name = "PID", required_unless_present = "container", conflicts_with = "container")]
        pid: Option<i32>,
        /// A running container, by name or id, resolved through its runtime.
        #[arg(long, value_name = "NAME|ID")]
        container: Option<String>,
        /// The TCP port the server listens on.
        #[arg(long, value_name = "N")]
        port: u16,
        /// The agent's probe socket (asked, read only, whether the server
        /// is suspended). Where it is not, the endpoint the agent places in
        /// a served pod's network namespace (`@gpusnap-probe`); no answer
        /// from either, the probe judges without the agent.
        #[arg(long, env = "GPUSNAP_PROBE_SOCKET", default_value = "/run/gpusnap/probe/probe.sock")]
        socket: PathBuf,
    },
    /// The agent's services and their states.
    ///
    /// The agent is found at --socket (or GPUSNAP_AGENT_SOCKET), else at the
    /// `[agent] socket` of --config, else of /etc/gpusnap/agent.toml when it
    /// exists, else at /run/gpusnap/admin/agent.sock.
    Services {
        #[command(flatten)]
        agent: AgentAt,
    },
    /// Ask the agent to act on one service.
    ///
    /// The agent is found as `gpusnap services` finds it.
    Service {
        /// The service, as named in the agent's configuration.
        name: String,
        /// What to do with it.
        #[arg(value_enum)]
        action: Action,
        #[command(flatten)]
        agent: AgentAt,
    },
    /// A service's server output (`STATE_DIR/agent/NAME.log`, the rotated
    /// file's end first).
    ///
    /// Read from --state-dir where this user may read it, else through the
    /// agent's API (found as `gpusnap services` finds it), which root and
    /// the members of the agent's `[agent] group` may use.
    Logs {
        /// The service, as named in the agent's configuration.
        name: String,
        /// Keep printing what it writes, until interrupted.
        #[arg(short, long)]
        follow: bool,
        /// How many of the last lines to print first.
        #[arg(short = 'n', long, value_name = "N", default_value_t = 100)]
        lines: usize,
        #[command(flatten)]
        agent: AgentAt,
    },
    /// Check this host (and a process) for what checkpointing needs, and explain what is missing.
    Doctor {
        /// A process to check as well.
        pid: Option<i32>,
    },
    /// The manual: gpusnap(1) on stdout, or a page per command in a directory.
    Man {
        /// Write DIR/gpusnap.1 and a page for every command
        /// (gpusnap-suspend.1, gpusnap-images-push.1, ...) instead.
        #[arg(long, value_name = "DIR")]
        dir: Option<PathBuf>,
        /// The command line reference in Markdown (docs/reference/cli.md).
        #[arg(long, hide = true, conflicts_with = "dir")]
        markdown: bool,
    },
    /// A completion script for SHELL on stdout.
    ///
    /// bash: `gpusnap completions bash > /usr/share/bash-completion/completions/gpusnap`;
    /// zsh: `gpusnap completions zsh > /usr/share/zsh/vendor-completions/_gpusnap`;
    /// fish: `gpusnap completions fish > /usr/share/fish/vendor_completions.d/gpusnap.fish`.
    Completions {
        /// The shell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

/// What `gpusnap agent` does besides running the agent.
#[derive(Subcommand)]
pub enum AgentCmd {
    /// Make the running agent read its config file again (as `systemctl
    /// reload gpusnap-agent` does): new services start, changed ones are
    /// restarted once idle, removed ones are left running unless
    /// --stop-removed. A config that does not parse is refused (exit 2), the
    /// one in use kept. The agent is found as `gpusnap services` finds it.
    Reload {
        /// Stop the services the file no longer names (suspended first, as
        /// `gpusnap stop` does) instead of leaving them running, unmanaged.
        #[arg(long)]
        stop_removed: bool,
        #[command(flatten)]
        agent: AgentAt,
    },
}

/// Where `gpusnap services` and `gpusnap service` find the agent.
#[derive(clap::Args, Debug)]
pub struct AgentAt {
    /// The agent's admin socket.
    #[arg(long, env = "GPUSNAP_AGENT_SOCKET", conflicts_with = "config")]
    pub socket: Option<PathBuf>,
    /// The agent's configuration: the socket its `[agent] socket` names.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
}

/// Which processes a command acts on: pids, or a group.
#[derive(clap::Args, Debug)]
#[group(required = true, multiple = true)]
pub struct Select {
    /// Process ids.
    pub pids: Vec<i32>,
    /// Every CUDA process in the tree rooted at PID.
    #[arg(long, value_name = "PID")]
    pub tree: Option<i32>,
    /// Every CUDA process in a cgroup (a container or pod): a path under
    /// /sys/fs/cgroup, or absolute.
    #[arg(long, value_name = "PATH")]
    pub cgroup: Option<PathBuf>,
    /// Every CUDA process in a running container, by name, id or unique id
    /// prefix, resolved through its runtime's state (podman; containerd's
    /// tasks, NAMESPACE/ID too; CRI-O; a docker container is refused: name
    /// its cgroup with --cgroup).
    #[arg(long, value_name = "NAME|ID")]
    pub container: Option<String>,
    /// The --container, once resolved.
    #[arg(skip)]
    pub resolved: std::sync::OnceLock<gpusnap_core::container::Resolved>,
    /// Every CUDA process this host can see.
    #[arg(long)]
    pub all: bool,
}

#[derive(Subcommand)]
pub enum ImagesCmd {
    /// Every image (the default).
    List,
    /// Check an image's signature, manifest and every file's checksum.
    Verify {
        /// An image: a name in the store, or the path of an image directory.
        image: String,
    },
    /// Remove an image (a name in the store, or the path of an image directory).
    Rm {
        /// An image: a name in the store, or the path of an image directory.
        image: String,
        /// Remove it even if a service of the agent wakes from it (the
        /// service then falls back to its remote, or a cold start).
        #[arg(long)]
        force: bool,
    },
    /// Build an image's map file: its CUDA processes' large memory regions
    /// (the driver's host copy) laid out so that a warm wake maps them from
    /// the page cache instead of copying them in (docs/design/wake.md, "The mapped
    /// wake"). Costs disk and page cache the size of those regions.
    Map {
        /// An image in the store.
        image: String,
    },
    /// Copy an image directory (from another host, say) into the store, verified.
    Import {
        /// The image directory to copy.
        path: String,
    },
    /// Finish or undo hibernates a killed gpusnap left, remove its temporary
    /// images, and remove the chunks of STATE_DIR/store no image refers to.
    Gc,
    /// Send an image to a remote: s3://BUCKET/PREFIX (AWS_ACCESS_KEY_ID,
    /// AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ENDPOINT_URL, AWS_ALLOW_HTTP) or
    /// file:///DIR. Only the chunks the remote lacks are sent; then the
    /// manifest, then this host's signed index of the remote naming it.
    Push {
        /// An image in the store.
        image: String,
        /// The remote: s3://BUCKET/PREFIX or file:///DIR.
        url: String,
        /// How long this host's signed index of the remote vouches for its
        /// pushes (days): pulls refuse this host's pushes there once it has
        /// expired, until it pushes there again.
        #[arg(long, value_name = "DAYS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3650))]
        index_ttl: u64,
    },
    /// Fetch URL/NAME into the store (signed by a trusted key, every chunk checked).
    Pull {
        /// The remote and the image's name there: URL/NAME.
        url: String,
        /// The name it gets here (default: its name on the remote).
        #[arg(long = "as", value_name = "NAME")]
        as_name: Option<String>,
        /// Take a push older than the latest of that name the remote's
        /// signed index names, or than the newest this host has pushed or
        /// pulled from that remote, or an older signed index (refused
        /// otherwise, as a rollback).
        #[arg(long)]
        allow_rollback: bool,
    },
    /// This host's public key: what other hosts pass to --trust to wake its images.
    Key,
}

/// A `--device-map` value: OLD=NEW pairs.
#[derive(Debug, Clone)]
pub struct DeviceMap(pub Vec<(String, String)>);

fn parse_map(s: &str) -> Result<DeviceMap, String> {
    gpusnap_core::remap::parse(s).map(DeviceMap)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_definitions_hold_together() {
        Cli::command().debug_assert();
    }
}
