//! The fake model server (`--http`): HTTP/1.1 by hand (a few fixed routes,
//! no web framework needed), every answer after touching the device
//! memory, so that a suspended server holds its requests as a real one.

use crate::{fault, Cuda};
use std::io::Write;
use std::thread::sleep;
use std::time::Duration;

/// The server's device memory and the pattern it must still hold.
pub(crate) struct Gpu {
    pub(crate) cuda: Cuda,
    pub(crate) ptr: u64,
    pub(crate) data: Vec<u8>,
    pub(crate) served: std::sync::atomic::AtomicU64,
    /// The "KV cache": its size, and its allocation while awake.
    pub(crate) kv_bytes: u64,
    pub(crate) kv: std::sync::Mutex<Option<u64>>,
    /// --tag: appended to the answer of `GET /`.
    pub(crate) tag: Option<String>,
    /// The model it serves for OpenAI's API.
    pub(crate) model: String,
}

impl Gpu {
    fn kv(&self) -> std::sync::MutexGuard<'_, Option<u64>> {
        self.kv.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Awake: the KV cache is allocated (nothing to do without one).
    pub(crate) fn awake(&self) -> bool {
        self.kv_bytes == 0 || self.kv().is_some()
    }

    /// Frees the KV cache (vLLM's sleep level 1 discards it).
    pub(crate) fn sleep(&self) -> Result<(), String> {
        if let Some(p) = self.kv().take() {
            // SAFETY: `p` came from cuMemAlloc_v2 and is freed once (taken).
            self.cuda.check("cuMemFree_v2", unsafe { (self.cuda.mem_free)(p) })?;
        }
        Ok(())
    }

    /// Allocates the KV cache again (a no-op while it is there).
    pub(crate) fn wake_up(&self) -> Result<(), String> {
        let mut kv = self.kv();
        if self.kv_bytes == 0 || kv.is_some() {
            return Ok(());
        }
        let mut p: u64 = 0;
        // SAFETY: `p` is a live local out-pointer.
        self.cuda.check("cuMemAlloc_v2", unsafe { (self.cuda.mem_alloc)(&mut p, self.kv_bytes as usize) })?;
        *kv = Some(p);
        Ok(())
    }

    /// Reads the pattern back from the device: blocks while the process is
    /// suspended, as a real server's next kernel launch would.
    pub(crate) fn touch(&self) -> Result<bool, String> {
        if self.data.is_empty() {
            return Ok(true);
        }
        let mut back = vec![0u8; self.data.len()];
        // SAFETY: `back` is as long as the length passed.
        let rc = unsafe { (self.cuda.memcpy_dtoh)(back.as_mut_ptr().cast(), self.ptr, back.len()) };
        self.cuda.check("cuMemcpyDtoH_v2", rc)?;
        Ok(back == self.data)
    }
}

pub(crate) fn serve_http(
    gpu: std::sync::Arc<Gpu>,
    (host, port): (std::net::IpAddr, u16),
    print_ready: bool,
) -> Result<(), String> {
    let listener =
        std::net::TcpListener::bind((host, port)).map_err(|e| format!("bind {host}:{port}: {e}"))?;
    if print_ready {
        println!("ready {}", std::process::id());
    }
    for conn in listener.incoming() {
        let Ok(conn) = conn else { continue };
        let gpu = std::sync::Arc::clone(&gpu);
        std::thread::spawn(move || {
            if let Err(e) = serve_conn(&gpu, conn) {
                eprintln!("fake-workload: connection: {e}");
            }
        });
    }
    Ok(())
}

/// HTTP/1.1 by hand: the fake needs three fixed routes, not a web framework.
fn serve_conn(gpu: &Gpu, conn: std::net::TcpStream) -> Result<(), String> {
    use std::io::{BufRead, BufReader, Read};
    let mut out = conn.try_clone().map_err(|e| e.to_string())?;
    let mut input = BufReader::new(conn);
    loop {
        let mut line = String::new();
        if input.read_line(&mut line).map_err(|e| e.to_string())? == 0 {
            return Ok(());
        }
        let target = line.split_whitespace().nth(1).unwrap_or("/").to_string();
        let mut close = line.trim_end().ends_with("HTTP/1.0");
        let mut length = 0usize;
        loop {
            let mut h = String::new();
            if input.read_line(&mut h).map_err(|e| e.to_string())? == 0 {
                return Ok(());
            }
            if h.trim().is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                if k.eq_ignore_ascii_case("content-length") {
                    length = v.trim().parse().unwrap_or(0);
                }
                if k.eq_ignore_ascii_case("connection") {
                    close = v.trim().eq_ignore_ascii_case("close");
                }
            }
        }
        let mut body = vec![0u8; length];
        input.read_exact(&mut body).map_err(|e| e.to_string())?;
        let (path, query) = target.split_once('?').unwrap_or((&target, ""));
        let param = |k: &str| {
            query
                .split('&')
                .find_map(|kv| kv.strip_prefix(k).and_then(|v| v.strip_prefix('=')))
                .and_then(|v| v.parse::<u64>().ok())
        };
        let n = gpu.served.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        let pid = std::process::id();
        // One write: an answer in pieces waits on the client's delayed ACK
        // (Nagle), 40 ms that no real server adds.
        let reply = |out: &mut std::net::TcpStream, status: &str, text: &str| {
            let all = format!(
                "HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\r\n{text}",
                text.len()
            );
            out.write_all(all.as_bytes()).map_err(|e| e.to_string())
        };
        if path == "/fault" {
            // An illegal-address kernel mid-request: the program exits 1.
            fault(&gpu.cuda, 0)?;
        }
        if path == "/sleep" || path == "/wake_up" {
            sleep(Duration::from_millis(param("delay_ms").unwrap_or(0)));
            let r = if param("fail") == Some(1) {
                Err("asked to fail".to_string())
            } else if path == "/sleep" {
                gpu.sleep()
            } else {
                gpu.wake_up()
            };
            match r {
                Ok(()) => reply(&mut out, "200 OK", &format!("{} {pid}\n", &path[1..]))?,
                Err(e) => reply(&mut out, "500 Internal Server Error", &format!("{e}\n"))?,
            }
        } else if !gpu.awake() {
            reply(&mut out, "503 Service Unavailable", "asleep: its KV cache is gone\n")?;
        } else if let Some(answer) = crate::openai::route(path) {
            crate::openai::answer(gpu, answer, &body, n, &mut out)?;
        } else if path == "/stream" {
            let chunks = param("chunks").unwrap_or(5);
            let every = param("ms").unwrap_or(100);
            write!(out, "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n")
                .map_err(|e| e.to_string())?;
            for i in 0..chunks {
                let intact = gpu.touch()?;
                let piece = format!("chunk {i} {}\n", u8::from(intact));
                write!(out, "{:x}\r\n{piece}\r\n", piece.len()).map_err(|e| e.to_string())?;
                out.flush().map_err(|e| e.to_string())?;
                sleep(Duration::from_millis(every));
            }
            write!(out, "0\r\n\r\n").map_err(|e| e.to_string())?;
        } else {
            let intact = gpu.touch()?;
            let text = if path == "/generate" {
                // Deterministic "tokens" for the agent benchmark's dry run:
                // the same prompt always gets the same answer.
                let h = query
                    .bytes()
                    .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
                format!("{h:016x} {}\n", u8::from(intact))
            } else {
                match &gpu.tag {
                    Some(tag) => format!("ok {pid} {n} {} {tag}\n", u8::from(intact)),
                    None => format!("ok {pid} {n} {}\n", u8::from(intact)),
                }
            };
            reply(&mut out, "200 OK", &text)?;
        }
        out.flush().map_err(|e| e.to_string())?;
        if close {
            return Ok(());
        }
    }
}
