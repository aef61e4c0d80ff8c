//! OpenAI's API, as the fake model server answers it: a chat completion or
//! a completion whose text is `ok <pid> <request> <intact> [TAG]` (only this
//! process can give it, and only with its device memory intact), streamed
//! as server-sent events when asked; and the model list. What the official
//! clients read is there (`id`, `object`, `model`, `choices`, `usage`);
//! the rest of a real server's fields are not.

use crate::server::Gpu;
use std::io::Write;
use std::net::TcpStream;
use std::time::{SystemTime, UNIX_EPOCH};

/// The OpenAI routes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Route {
    Chat,
    Completion,
    Models,
}

pub fn route(path: &str) -> Option<Route> {
    match path {
        "/v1/chat/completions" => Some(Route::Chat),
        "/v1/completions" => Some(Route::Completion),
        "/v1/models" => Some(Route::Models),
        _ => None,
    }
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn send(out: &mut TcpStream, status: &str, kind: &str, body: &str) -> Result<(), String> {
    let all =
        format!("HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\n\r\n{body}", body.len());
    out.write_all(all.as_bytes()).map_err(|e| e.to_string())
}

/// Answers `route` for a request with `body`, the `n`th this server serves.
pub fn answer(gpu: &Gpu, route: Route, body: &[u8], n: u64, out: &mut TcpStream) -> Result<(), String> {
    if route == Route::Models {
        let list = serde_json::json!({
            "object": "list",
            "data": [{ "id": gpu.model, "object": "model", "created": 0, "owned_by": "fake-workload" }],
        });
        return send(out, "200 OK", "application/json", &list.to_string());
    }
    let req: serde_json::Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => {
            let err = serde_json::json!({ "error": { "message": format!("the body is not JSON: {e}"), "type": "invalid_request_error" } });
            return send(out, "400 Bad Request", "application/json", &err.to_string());
        }
    };
    let model = req["model"].as_str().unwrap_or(&gpu.model).to_string();
    let stream = req["stream"].as_bool().unwrap_or(false);
    let pid = std::process::id();
    let id = format!("{}-fake-{pid}-{n}", if route == Route::Chat { "chatcmpl" } else { "cmpl" });
    let created = now();
    // One word per token, each after a touch of the device memory: a
    // server suspended mid-answer holds the rest as a real one would.
    let tag = gpu.tag.as_deref().map(|t| format!(" {t}")).unwrap_or_default();
    let intact = gpu.touch()?;
    let text = format!("ok {pid} {n} {}{tag}", u8::from(intact));
    let words: Vec<String> =
        text.split(' ').enumerate().map(|(i, w)| if i == 0 { w.into() } else { format!(" {w}") }).collect();
    let usage = serde_json::json!({ "prompt_tokens": 1, "completion_tokens": words.len(), "total_tokens": words.len() + 1 });
    if !stream {
        let choice = match route {
            Route::Chat => {
                serde_json::json!({ "index": 0, "message": { "role": "assistant", "content": text }, "finish_reason": "stop" })
            }
            _ => serde_json::json!({ "index": 0, "text": text, "finish_reason": "stop" }),
        };
        let object = if route == Route::Chat { "chat.completion" } else { "text_completion" };
        let body = serde_json::json!({ "id": id, "object": object, "created": created, "model": model, "choices": [choice], "usage": usage });
        return send(out, "200 OK", "application/json", &body.to_string());
    }
    write!(out, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n")
        .map_err(|e| e.to_string())?;
    let mut event = |v: &str| -> Result<(), String> {
        let piece = format!("data: {v}\n\n");
        write!(out, "{:x}\r\n{piece}\r\n", piece.len()).map_err(|e| e.to_string())?;
        out.flush().map_err(|e| e.to_string())
    };
    let last = words.len().saturating_sub(1);
    for (i, w) in words.iter().enumerate() {
        if i > 0 {
            gpu.touch()?;
        }
        let finish = if i == last { serde_json::json!("stop") } else { serde_json::Value::Null };
        let choice = match route {
            Route::Chat => {
                let delta = if i == 0 {
                    serde_json::json!({ "role": "assistant", "content": w })
                } else {
                    serde_json::json!({ "content": w })
                };
                serde_json::json!({ "index": 0, "delta": delta, "finish_reason": finish })
            }
            _ => serde_json::json!({ "index": 0, "text": w, "finish_reason": finish }),
        };
        let object = if route == Route::Chat { "chat.completion.chunk" } else { "text_completion" };
        event(&serde_json::json!({ "id": id, "object": object, "created": created, "model": model, "choices": [choice] }).to_string())?;
    }
    event("[DONE]")?;
    write!(out, "0\r\n\r\n").map_err(|e| e.to_string())
}
