//! The clients: threads sending requests to the services through the
//! agent, each answer checked. A server answers `ok PID N INTACT NAME`:
//! only the right server knows its name, only a server whose GPU memory
//! came back intact says 1. A refusal (503, or the connection closed
//! unanswered after `wake_timeout`) is allowed; a wrong answer or a
//! request that outlives its bound is a violation.

use rand::{Rng, SeedableRng};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::stats::Stats;

/// The longest a request may take: the services' `wake_timeout` (30 s)
/// and a margin for a loaded machine.
pub const REQUEST_BOUND: Duration = Duration::from_secs(75);

pub enum Answer {
    Right,
    Refused(String),
    Wrong(String),
    Hung,
}

/// One request to `port`, checked against `name`.
pub fn request(port: u16, name: &str) -> Answer {
    let start = Instant::now();
    let mut s = match TcpStream::connect(("127.0.0.1", port)) {
        Ok(s) => s,
        // The agent is down (killed, restarting): nothing listens.
        Err(e) => return Answer::Refused(format!("connect: {e}")),
    };
    let _ = s.set_read_timeout(Some(REQUEST_BOUND));
    if let Err(e) = write!(s, "GET / HTTP/1.1\r\nHost: soak\r\nConnection: close\r\n\r\n") {
        return Answer::Refused(format!("send: {e}"));
    }
    let mut buf = Vec::new();
    let r = s.read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf).into_owned();
    if let Err(e) = r {
        if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)
            || start.elapsed() >= REQUEST_BOUND
        {
            return Answer::Hung;
        }
        if text.is_empty() {
            return Answer::Refused(format!("read: {e}"));
        }
    }
    if text.is_empty() {
        return Answer::Refused("closed unanswered".into());
    }
    let code: u16 = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = text.split_once("\r\n\r\n").map(|x| x.1).unwrap_or("").trim().to_string();
    match code {
        200 => {
            let f: Vec<&str> = body.split_whitespace().collect();
            if f.len() == 5 && f[0] == "ok" && f[3] == "1" && f[4] == name {
                Answer::Right
            } else {
                Answer::Wrong(format!("{name} answered {body:?}"))
            }
        }
        502..=504 => Answer::Refused(format!("{code} {body}")),
        _ => Answer::Wrong(format!("{name}: status {code} {body:?}")),
    }
}

/// One request to `port` (`name`), counted in `stats`; true when answered right.
pub fn ask(stats: &Stats, port: u16, name: &str) -> bool {
    let t = Instant::now();
    let a = request(port, name);
    let waited = t.elapsed().as_secs_f64();
    stats.with(|c| c.requests += 1);
    match a {
        Answer::Right => {
            stats.with(|c| {
                c.answered += 1;
                c.waits.push(waited);
            });
            return true;
        }
        Answer::Refused(why) => {
            stats.with(|c| c.refused += 1);
            if why.starts_with("connect") {
                // The agent is down: do not spin.
                std::thread::sleep(Duration::from_millis(200));
            }
        }
        Answer::Wrong(what) => stats.violation("wrong_answer", what),
        Answer::Hung => {
            stats.violation("request_past_bound", format!("{name}: no answer within {REQUEST_BOUND:?}"))
        }
    }
    false
}

/// Starts `n` client threads until `stop`; each picks services at random
/// (seeded), with pauses so that some go idle and are suspended.
pub fn start(
    n: usize,
    seed: u64,
    services: Vec<(u16, String)>,
    stats: Arc<Stats>,
    stop: Arc<AtomicBool>,
) -> Vec<std::thread::JoinHandle<()>> {
    (0..n)
        .map(|i| {
            let (services, stats, stop) = (services.clone(), Arc::clone(&stats), Arc::clone(&stop));
            std::thread::spawn(move || {
                let mut rng =
                    rand::rngs::StdRng::seed_from_u64(seed.wrapping_mul(1000).wrapping_add(i as u64));
                while !stop.load(Ordering::SeqCst) {
                    // Skewed: the first services are asked most, the last
                    // rarely (they idle out, hibernate, and are woken).
                    let k = rng.gen_range(0..services.len() * 2).min(rng.gen_range(0..services.len()));
                    let (port, name) = &services[k];
                    ask(&stats, *port, name);
                    std::thread::sleep(Duration::from_millis(rng.gen_range(0..400)));
                }
            })
        })
        .collect()
}
