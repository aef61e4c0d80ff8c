//! The light guard's protocol, on the guard's unix socket:
//!
//! - a dying process (its preload library) sends `dying WHY start=T` and
//!   waits, or `dying-async signal N start=T` and runs on until the guard
//!   sends the signal again; `WHY` is `signal N`, `exit` or `_exit`, and
//!   `T` the process's start time (field 22 of /proc/PID/stat);
//! - `hibernate` sends `detach PID...`;
//! - the guard sends a heartbeat byte (`.`) every second while it works,
//!   then one line: `ok`, `hold` (the process must wait in its exit path
//!   for good) or `error: WHY`.
//!
//! The library's side ([`encode_dying`], [`scan_answer`]) runs in signal
//! handlers: it writes into the caller's buffer and allocates nothing.

use crate::{number, ParseError};

/// Why a process is dying.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// A fatal signal left at its default action.
    Signal(i32),
    /// `exit()` or a return from `main`.
    Exit,
    /// `_exit()` or `_Exit()`.
    UnderscoreExit,
}

/// A request to the guard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// This process is dying (`asynchronous`: of a signal from elsewhere;
    /// it runs on until the guard sends the signal again). `start` is its
    /// start time as it reads it.
    Dying { asynchronous: bool, why: Why, start: Option<u64> },
    /// Let these processes go.
    Detach { pids: Vec<i32> },
}

/// The guard's answer line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    Ok,
    /// Keep the process in its exit path for good.
    Hold,
    Error(String),
}

/// The heartbeat byte the guard sends every second while it works.
pub const HEARTBEAT: u8 = b'.';

/// Writes `bytes` at `*n` in `buf`, as much as fits before its last byte.
fn put(buf: &mut [u8], n: &mut usize, bytes: &[u8]) {
    for b in bytes {
        if *n + 1 < buf.len() {
            buf[*n] = *b;
            *n += 1;
        }
    }
}

/// Writes `v` in decimal at `*n` in `buf` (as [`put`]).
fn put_number(buf: &mut [u8], n: &mut usize, v: u64) {
    let mut digits = [0u8; 20];
    let (mut v, mut k) = (v, digits.len());
    loop {
        k -= 1;
        digits[k] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    put(buf, n, &digits[k..]);
}

/// Writes the `dying` request line (newline included) into `buf`; returns
/// its length. A line longer than `buf` is cut, its newline kept; an empty
/// `buf` gets nothing. Allocates nothing, calls nothing: safe in a signal
/// handler.
pub fn encode_dying(buf: &mut [u8], asynchronous: bool, why: Why, start: Option<u64>) -> usize {
    if buf.is_empty() {
        return 0;
    }
    let mut n = 0;
    put(buf, &mut n, if asynchronous { b"dying-async " } else { b"dying " });
    match why {
        Why::Signal(sig) => {
            put(buf, &mut n, b"signal ");
            if sig < 0 {
                put(buf, &mut n, b"-");
            }
            put_number(buf, &mut n, u64::from(sig.unsigned_abs()));
        }
        Why::Exit => put(buf, &mut n, b"exit"),
        Why::UnderscoreExit => put(buf, &mut n, b"_exit"),
    }
    if let Some(t) = start {
        put(buf, &mut n, b" start=");
        put_number(buf, &mut n, t);
    }
    buf[n] = b'\n';
    n + 1
}

impl Request {
    /// The request line, newline included.
    pub fn encode(&self) -> String {
        match self {
            Request::Dying { asynchronous, why, start } => {
                let mut buf = [0u8; 96];
                let n = encode_dying(&mut buf, *asynchronous, *why, *start);
                String::from_utf8_lossy(&buf[..n]).into_owned()
            }
            Request::Detach { pids } => {
                let mut s = String::from("detach");
                for p in pids {
                    s.push(' ');
                    s.push_str(&p.to_string());
                }
                s.push('\n');
                s
            }
        }
    }

    /// A request line. `start=T` may stand anywhere in a `dying` line.
    pub fn parse(line: &str) -> Result<Self, ParseError> {
        const W: &str = "guard request";
        let mut words: Vec<&str> = line.split_whitespace().collect();
        let mut start = None;
        if let Some(i) = words.iter().position(|w| w.starts_with("start=")) {
            start = Some(number(W, "start", &words.remove(i)["start=".len()..])?);
        }
        match words.as_slice() {
            [kind @ ("dying" | "dying-async"), rest @ ..] => {
                let why = match rest {
                    ["signal", n] => Why::Signal(number(W, "signal", n)?),
                    ["exit"] => Why::Exit,
                    ["_exit"] => Why::UnderscoreExit,
                    _ => {
                        return Err(ParseError::new(W, format!("no reason to die in {:?}", line.trim_end())))
                    }
                };
                Ok(Request::Dying { asynchronous: *kind == "dying-async", why, start })
            }
            ["detach", pids @ ..] if start.is_none() => {
                let pids = pids.iter().map(|p| number(W, "pid", p)).collect::<Result<_, _>>()?;
                Ok(Request::Detach { pids })
            }
            _ => Err(ParseError::new(W, format!("unknown request {:?}", line.trim_end()))),
        }
    }
}

impl Answer {
    /// The answer line, newline included.
    pub fn encode(&self) -> String {
        match self {
            Answer::Ok => "ok\n".to_string(),
            Answer::Hold => "hold\n".to_string(),
            Answer::Error(why) => format!("error: {why}\n"),
        }
    }

    /// An answer line (heartbeat bytes before it are skipped).
    pub fn parse(line: &str) -> Result<Self, ParseError> {
        match line.trim_start_matches(HEARTBEAT as char).trim() {
            "ok" => Ok(Answer::Ok),
            "hold" => Ok(Answer::Hold),
            l => match l.strip_prefix("error:") {
                Some(why) => Ok(Answer::Error(why.trim().to_string())),
                None => Err(ParseError::new("guard answer", format!("{l:?}"))),
            },
        }
    }
}

/// What a chunk read from the guard says, for a process waiting on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scan {
    /// Heartbeats only: the guard is at work.
    Heartbeats,
    /// The answer's line ended here; `hold` if it was `hold`.
    Answer { hold: bool },
}

/// Reads a chunk of what the guard sent (heartbeats, then the answer's
/// line, which comes in one write). Allocates nothing: safe in a signal
/// handler.
pub fn scan_answer(chunk: &[u8]) -> Scan {
    let Some(end) = chunk.iter().position(|b| *b == b'\n') else { return Scan::Heartbeats };
    let mut line = &chunk[..end];
    while let [HEARTBEAT, rest @ ..] = line {
        line = rest;
    }
    Scan::Answer { hold: line == b"hold" }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip() {
        for r in [
            Request::Dying { asynchronous: false, why: Why::Signal(11), start: Some(123_456) },
            Request::Dying { asynchronous: true, why: Why::Signal(64), start: Some(u64::MAX) },
            Request::Dying { asynchronous: false, why: Why::Exit, start: None },
            Request::Dying { asynchronous: false, why: Why::UnderscoreExit, start: Some(0) },
            Request::Detach { pids: vec![1, 4242] },
            Request::Detach { pids: Vec::new() },
        ] {
            let line = r.encode();
            assert!(line.ends_with('\n'), "{line}");
            assert_eq!(Request::parse(&line), Ok(r), "{line}");
        }
    }

    #[test]
    fn the_dying_line_fits_the_buffer_it_is_given() {
        let mut buf = [0u8; 96];
        let n = encode_dying(&mut buf, true, Why::Signal(9), Some(77));
        assert_eq!(&buf[..n], b"dying-async signal 9 start=77\n");
        let mut small = [0u8; 8];
        let n = encode_dying(&mut small, false, Why::Exit, None);
        assert_eq!(&small[..n], b"dying e\n");
        assert_eq!(encode_dying(&mut [], false, Why::Exit, None), 0);
    }

    #[test]
    fn malformed_requests_are_refused() {
        for bad in [
            "",
            "dying",
            "dying signal",
            "dying signal x",
            "dying sideways",
            "dying exit now",
            "dying exit start=soon",
            "detach 1 two",
            "detach 1 start=3",
            "wake 1",
        ] {
            assert!(Request::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn answers_round_trip() {
        for a in [Answer::Ok, Answer::Hold, Answer::Error("not allowed".into())] {
            assert_eq!(Answer::parse(&a.encode()), Ok(a.clone()));
            let mut beats = b"...".to_vec();
            beats.extend(a.encode().as_bytes());
            assert_eq!(Answer::parse(std::str::from_utf8(&beats).unwrap()), Ok(a.clone()));
            assert_eq!(scan_answer(&beats), Scan::Answer { hold: a == Answer::Hold });
        }
        for bad in ["", "fine", "holdon", "err: x"] {
            assert!(Answer::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(scan_answer(b".."), Scan::Heartbeats);
        assert_eq!(scan_answer(b""), Scan::Heartbeats);
    }
}
