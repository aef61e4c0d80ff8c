//! The fast-swap control protocol, one line each way (each at most 4 KiB):
//!
//! - gpusnap asks `status`, `offload` or `restore`;
//! - the library answers `ok STATUS` to a status, `ok bytes=N ms=N
//!   PHASE_ms=N... STATUS` to a finished offload or restore, or
//!   `error KIND: DETAIL`; while an offload or restore runs it says
//!   `progress ms=N` every second.
//!
//! `STATUS` is `key=value` words; keys a reader does not know are skipped
//! (a process restored with an older or newer library still answers).

use crate::{number, ParseError};
use std::fmt::{self, Write as _};

/// What gpusnap asks the library.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request {
    Status,
    Offload,
    Restore,
}

impl Request {
    pub const fn word(self) -> &'static str {
        match self {
            Request::Status => "status",
            Request::Offload => "offload",
            Request::Restore => "restore",
        }
    }

    /// The request line, newline included.
    pub fn encode(self) -> String {
        format!("{}\n", self.word())
    }

    /// A request line (surrounding blanks ignored).
    pub fn parse(line: &str) -> Result<Self, ParseError> {
        match line.trim() {
            "status" => Ok(Request::Status),
            "offload" => Ok(Request::Offload),
            "restore" => Ok(Request::Restore),
            other => Err(ParseError::new("fast swap request", format!("unknown request {other:?}"))),
        }
    }
}

impl fmt::Display for Request {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.word())
    }
}

/// Where the served memory is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Phase {
    #[default]
    Resident,
    Offloading,
    Offloaded,
    Restoring,
}

impl Phase {
    pub const fn word(self) -> &'static str {
        match self {
            Phase::Resident => "resident",
            Phase::Offloading => "offloading",
            Phase::Offloaded => "offloaded",
            Phase::Restoring => "restoring",
        }
    }

    fn parse(v: &str) -> Result<Self, ParseError> {
        match v {
            "resident" => Ok(Phase::Resident),
            "offloading" => Ok(Phase::Offloading),
            "offloaded" => Ok(Phase::Offloaded),
            "restoring" => Ok(Phase::Restoring),
            _ => Err(ParseError::new("fast swap status", format!("unknown phase {v:?}"))),
        }
    }
}

/// What the library holds: its status words.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Status {
    pub phase: Phase,
    /// The quiescence gate is closed (no launch goes through).
    pub gate_closed: bool,
    /// Threads inside a gated driver call now.
    pub inside: u64,
    /// Allocations the library serves (moved by a fast swap), in all.
    pub movable: u64,
    pub movable_bytes: u64,
    /// Of those, the program's own VMM allocations.
    pub vmm: u64,
    pub vmm_bytes: u64,
    /// Allocations left with the driver, and why (each reason without `,`).
    pub kept: u64,
    pub kept_bytes: u64,
    pub kept_why: Vec<String>,
    /// Driver calls that went past the gate ungated.
    pub ungated: u64,
    /// How host memory is pinned (`register`, `alloc`).
    pub pin: String,
    /// Pinned copies are kept after a restore.
    pub keep: bool,
    /// `cuIpcGetMemHandle` calls refused on served memory.
    pub ipc_refused: u64,
    /// Pinned host bytes held now, and the budget for them (`None`: none).
    pub pinned_bytes: u64,
    pub pin_budget: Option<u64>,
}

impl fmt::Display for Status {
    /// The status words, as the library writes them.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let why = if self.kept_why.is_empty() {
            "-".to_string()
        } else {
            self.kept_why.join(",").replace(' ', "_")
        };
        let budget = self.pin_budget.map_or_else(|| "-".to_string(), |b| b.to_string());
        write!(
            f,
            "phase={} gate={} inside={} movable={} movable_bytes={} vmm={} vmm_bytes={} kept={} kept_bytes={} \
             kept_why={why} ungated={} pin={} keep={} ipc_refused={} pinned_bytes={} pin_budget={budget}",
            self.phase.word(),
            if self.gate_closed { "closed" } else { "open" },
            self.inside,
            self.movable,
            self.movable_bytes,
            self.vmm,
            self.vmm_bytes,
            self.kept,
            self.kept_bytes,
            self.ungated,
            if self.pin.is_empty() { "-" } else { &self.pin },
            u8::from(self.keep),
            self.ipc_refused,
            self.pinned_bytes,
        )
    }
}

impl Status {
    /// Status words (`key=value`); a phase must be among them, unknown keys
    /// are skipped.
    pub fn parse_words(words: &[&str]) -> Result<Self, ParseError> {
        const W: &str = "fast swap status";
        let mut s = Status::default();
        let mut phase = None;
        for w in words {
            let Some((k, v)) = w.split_once('=') else {
                return Err(ParseError::new(W, format!("{w:?} is no key=value")));
            };
            let n = || number::<u64>(W, k, v);
            match k {
                "phase" => phase = Some(Phase::parse(v)?),
                "gate" => s.gate_closed = v == "closed",
                "inside" => s.inside = n()?,
                "movable" => s.movable = n()?,
                "movable_bytes" => s.movable_bytes = n()?,
                "vmm" => s.vmm = n()?,
                "vmm_bytes" => s.vmm_bytes = n()?,
                "kept" => s.kept = n()?,
                "kept_bytes" => s.kept_bytes = n()?,
                "kept_why" if v != "-" => s.kept_why = v.split(',').map(|x| x.replace('_', " ")).collect(),
                "ungated" => s.ungated = n()?,
                "pin" if v != "-" => s.pin = v.to_string(),
                "keep" => s.keep = v == "1",
                "ipc_refused" => s.ipc_refused = n()?,
                "pinned_bytes" => s.pinned_bytes = n()?,
                "pin_budget" => s.pin_budget = if v == "-" { None } else { Some(n()?) },
                _ => {}
            }
        }
        s.phase = phase.ok_or_else(|| ParseError::new(W, "no phase"))?;
        Ok(s)
    }
}

/// A finished offload or restore.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Done {
    /// Bytes moved and the library's own milliseconds.
    pub bytes: u64,
    pub ms: u64,
    /// Its phases, each a name (`copy`, `release`, `map`) and milliseconds.
    pub phases: Vec<(String, u64)>,
    /// Its status after.
    pub status: Status,
}

/// One line from the library.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// An offload or restore is still at work (`ms` so far).
    Progress { ms: u64 },
    /// The answer to a status.
    Status(Status),
    /// An offload or restore is done.
    Done(Done),
    /// Refused or failed: a word (`no-memory`, `busy`, `driver`, `denied`,
    /// `unknown`, ...) and the detail; nothing was given back or taken.
    Failed { kind: String, detail: String },
}

impl Reply {
    /// The line, newline included.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        let _ = match self {
            Reply::Progress { ms } => write!(out, "progress ms={ms}"),
            Reply::Status(s) => write!(out, "ok {s}"),
            Reply::Done(d) => {
                let _ = write!(out, "ok bytes={} ms={}", d.bytes, d.ms);
                for (name, ms) in &d.phases {
                    let _ = write!(out, " {name}_ms={ms}");
                }
                write!(out, " {}", d.status)
            }
            Reply::Failed { kind, detail } => write!(out, "error {kind}: {detail}"),
        };
        out.push('\n');
        out
    }

    /// A line from the library (the newline may be there or not).
    pub fn parse(line: &str) -> Result<Self, ParseError> {
        const W: &str = "fast swap answer";
        let w: Vec<&str> = line.split_whitespace().collect();
        match w.first().copied() {
            Some("progress") => {
                let ms = w[1..].iter().find_map(|x| x.strip_prefix("ms=")).unwrap_or("0");
                Ok(Reply::Progress { ms: number(W, "ms", ms)? })
            }
            Some("ok") if w[1..].iter().any(|x| x.starts_with("bytes=")) => {
                let (mut bytes, mut ms, mut phases, mut rest) = (0, 0, Vec::new(), Vec::new());
                for x in &w[1..] {
                    match x.split_once('=') {
                        Some(("bytes", v)) => bytes = number(W, "bytes", v)?,
                        Some(("ms", v)) => ms = number(W, "ms", v)?,
                        Some((k, v)) if k.ends_with("_ms") => {
                            phases.push((k.trim_end_matches("_ms").to_string(), number(W, k, v)?))
                        }
                        _ => rest.push(*x),
                    }
                }
                Ok(Reply::Done(Done { bytes, ms, phases, status: Status::parse_words(&rest)? }))
            }
            Some("ok") => Ok(Reply::Status(Status::parse_words(&w[1..])?)),
            Some("error") => {
                let kind = w.get(1).map(|k| k.trim_end_matches(':')).filter(|k| !k.is_empty());
                let kind = kind.ok_or_else(|| ParseError::new(W, "an error without a kind"))?;
                Ok(Reply::Failed { kind: kind.to_string(), detail: w.get(2..).unwrap_or_default().join(" ") })
            }
            _ => Err(ParseError::new(W, format!("{:?}", line.trim_end()))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status() -> Status {
        Status {
            phase: Phase::Offloaded,
            gate_closed: true,
            inside: 0,
            movable: 3,
            movable_bytes: 100,
            vmm: 1,
            vmm_bytes: 40,
            kept: 1,
            kept_bytes: 7,
            kept_why: vec!["managed (cuMemAllocManaged)".into(), "too small".into()],
            ungated: 2,
            pin: "register".into(),
            keep: true,
            ipc_refused: 1,
            pinned_bytes: 100,
            pin_budget: Some(1 << 30),
        }
    }

    #[test]
    fn requests_round_trip() {
        for r in [Request::Status, Request::Offload, Request::Restore] {
            assert_eq!(Request::parse(&r.encode()), Ok(r));
        }
        for bad in ["", "stat", "offload now", "OFFLOAD"] {
            assert!(Request::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn replies_round_trip() {
        let bare = Status { pin_budget: None, kept_why: Vec::new(), ..Status::default() };
        for r in [
            Reply::Progress { ms: 1500 },
            Reply::Status(status()),
            Reply::Status(bare.clone()),
            Reply::Done(Done {
                bytes: 42,
                ms: 9,
                phases: vec![("map".into(), 3), ("copy".into(), 5)],
                status: status(),
            }),
            Reply::Done(Done { bytes: 0, ms: 0, phases: Vec::new(), status: bare }),
            Reply::Failed { kind: "no-memory".into(), detail: "mapping 8 bytes".into() },
            Reply::Failed { kind: "busy".into(), detail: String::new() },
        ] {
            let line = r.encode();
            assert!(line.ends_with('\n') && !line[..line.len() - 1].contains('\n'), "{line}");
            assert_eq!(Reply::parse(&line), Ok(r), "{line}");
        }
    }

    #[test]
    fn unknown_status_keys_are_skipped() {
        let Reply::Status(s) = Reply::parse("ok phase=restoring later=7 movable=2").unwrap() else {
            panic!()
        };
        assert_eq!((s.phase, s.movable), (Phase::Restoring, 2));
    }

    #[test]
    fn malformed_replies_are_refused() {
        for bad in [
            "",
            "maybe",
            "ok",
            "ok movable=3",
            "ok phase=sideways",
            "ok phase=resident movable=many",
            "ok phase=resident loose",
            "ok bytes=x ms=1 phase=resident",
            "ok bytes=1 ms=1 copy_ms=? phase=resident",
            "progress ms=soon",
            "error",
            "error :",
        ] {
            assert!(Reply::parse(bad).is_err(), "{bad}");
        }
    }
}
