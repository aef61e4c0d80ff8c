//! The API and its OpenAPI document agree: the router serves exactly the
//! routes the document describes, and each of them answers on a real
//! agent's socket as the document says (a host without a driver: the agent
//! as it runs where libcuda cannot be loaded).

use gpusnap_agent::api::{self, OPENAPI};
use gpusnap_agent::client::{request, ClientError};
use gpusnap_agent::control::Control;
use gpusnap_agent::{Agent, Config, Setup};
use gpusnap_cuda::{Absent, Deadline, Timeouts};
use gpusnap_gpu::NoGpus;
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const METHODS: [&str; 8] = ["get", "put", "post", "delete", "options", "head", "patch", "trace"];

fn document() -> Value {
    serde_json::from_str(OPENAPI).expect("openapi.json is JSON")
}

/// (METHOD, path) of every operation in the document.
fn documented(doc: &Value) -> BTreeSet<(String, String)> {
    let mut out = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for m in METHODS {
            if item.get(m).is_some() {
                out.insert((m.to_uppercase(), path.clone()));
            }
        }
    }
    out
}

/// Follows a local `$ref` (`#/components/...`).
fn resolve<'a>(doc: &'a Value, v: &'a Value) -> &'a Value {
    match v.get("$ref").and_then(Value::as_str) {
        Some(r) => {
            let target = doc.pointer(r.trim_start_matches('#')).unwrap_or_else(|| panic!("{r} resolves"));
            resolve(doc, target)
        }
        None => v,
    }
}

#[test]
fn the_router_serves_exactly_the_documented_routes() {
    let doc = document();
    assert!(doc["openapi"].as_str().is_some_and(|v| v.starts_with("3.1.")), "{}", doc["openapi"]);
    let served: BTreeSet<(String, String)> =
        api::routes().iter().map(|r| (r.method.to_string(), r.path.to_string())).collect();
    assert_eq!(served, documented(&doc));
}

#[test]
fn every_documented_operation_refuses_strangers_and_resolves_its_refs() {
    let doc = document();
    for (method, path) in documented(&doc) {
        let op = &doc["paths"][&path][method.to_lowercase()];
        let responses = op["responses"].as_object().expect("responses");
        assert!(responses.contains_key("403"), "{method} {path} has no 403");
        for (code, r) in responses {
            let r = resolve(&doc, r);
            assert!(r["description"].is_string(), "{method} {path} {code}");
            for media in r["content"].as_object().into_iter().flat_map(|c| c.values()) {
                resolve(&doc, &media["schema"]);
            }
        }
        for p in op["parameters"].as_array().into_iter().chain(doc["paths"][&path]["parameters"].as_array()) {
            for p in p {
                assert!(resolve(&doc, p)["name"].is_string(), "{method} {path}");
            }
        }
    }
}

/// A real agent with one service (adopted by pid file, not found: it is
/// `dead` and never started), its API served on a socket in `dir`.
fn serve(dir: &Path) -> PathBuf {
    let socket = dir.join("agent.sock");
    let toml = format!(
        r#"
[agent]
socket = "{socket}"
group = "{gid}"

[[service]]
name = "m"
listen = "127.0.0.1:1"
backend = "127.0.0.1:2"
pid_file = "{pid_file}"
"#,
        socket = socket.display(),
        gid = nix::unistd::getgid(),
        pid_file = dir.join("m.pid").display(),
    );
    let state_dir = dir.join("state");
    std::fs::create_dir(&state_dir).unwrap();
    let agent = Agent::new(Setup {
        config: Config::parse(&toml, "test.toml").unwrap(),
        state_dir,
        criu: None,
        api: Deadline::new(Box::new(Absent { why: "no driver on this host".into() }), Timeouts::default()),
        gpus: Box::new(NoGpus),
        exe: PathBuf::from("/bin/false"),
        config_path: None,
    })
    .unwrap();
    let ctl: Arc<dyn Control> = Arc::new(agent);
    // Bound here: the socket is there before the first request.
    let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    listener.set_nonblocking(true).unwrap();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(async move {
            let l = tokio::net::UnixListener::from_std(listener).unwrap();
            let cap = gpusnap_agent::limits::Cap::new(16);
            let bounds = gpusnap_agent::listen::Bounds {
                own: Arc::clone(&cap),
                total: cap,
                header_timeout: std::time::Duration::from_secs(10),
            };
            api::serve(ctl, l, bounds).await;
        });
    });
    socket
}

/// The keys of an object in an answer, and those its schema names.
fn keys(v: &Value) -> BTreeSet<String> {
    v.as_object().expect("an object").keys().cloned().collect()
}

fn properties(doc: &Value, schema: &str) -> BTreeSet<String> {
    keys(&doc["components"]["schemas"][schema]["properties"])
}

/// A service's documented keys, less `pod` (only a pod's service has it).
fn service_properties(doc: &Value) -> BTreeSet<String> {
    let mut p = properties(doc, "Service");
    p.remove("pod");
    p
}

fn api_error(r: Result<String, ClientError>) -> (u16, String, i32) {
    match r {
        Err(ClientError::Api { status, message, exit_code }) => (status, message, exit_code),
        other => panic!("expected an API error, got {other:?}"),
    }
}

#[test]
fn every_documented_route_answers_on_the_socket_as_documented() {
    let dir = tempfile::tempdir().unwrap();
    let socket = serve(dir.path());
    let doc = document();
    for (method, path) in documented(&doc) {
        let uri = match path.as_str() {
            // The stream would follow the journal for ever.
            "/v1/events" => "/v1/events?follow=false".to_string(),
            p => p.replace("{name}", "m").replace("{action}", "suspend"),
        };
        let r = request(&socket, &method, &uri);
        if let Err(ClientError::Api { message, .. }) = &r {
            assert!(!message.starts_with("no route "), "{method} {path} is not served: {message}");
        }
        match path.as_str() {
            "/v1/services" => {
                let v: Value = serde_json::from_str(&r.unwrap()).unwrap();
                assert_eq!(v.as_array().map(Vec::len), Some(1));
                assert_eq!(keys(&v[0]), service_properties(&doc));
            }
            "/v1/services/{name}" => {
                let v: Value = serde_json::from_str(&r.unwrap()).unwrap();
                assert_eq!(keys(&v), service_properties(&doc));
                assert_eq!(v["state"], "dead");
            }
            // Nothing to suspend: the service never ran.
            "/v1/services/{name}/{action}" => {
                let (status, message, code) = api_error(r);
                assert_eq!((status, code), (409, 1), "{message}");
                assert_eq!(message, "m is dead");
            }
            // Without a driver, the list is empty or the error says why.
            "/v1/processes" => match r {
                Ok(body) => assert!(serde_json::from_str::<Value>(&body).unwrap().is_array()),
                Err(e) => assert_eq!(api_error(Err(e)).0, 500),
            },
            "/v1/events" => {
                for line in r.unwrap().lines() {
                    assert_eq!(keys(&serde_json::from_str(line).unwrap()), properties(&doc, "Event"));
                }
            }
            // Its server never ran: no output yet.
            "/v1/services/{name}/logs" => {
                let (status, message, code) = api_error(r);
                assert_eq!((status, code), (404, 2), "{message}");
            }
            // Started without a file to read again.
            "/v1/reload" => {
                let (status, message, code) = api_error(r);
                assert_eq!((status, code), (422, 2), "{message}");
                assert!(message.contains("without a config file"), "{message}");
            }
            "/v1/openapi.json" => assert_eq!(r.unwrap(), OPENAPI),
            "/metrics" => assert!(r.unwrap().contains("# TYPE gpusnap_agent_services gauge")),
            other => panic!("{other}: add what it answers to this test"),
        }
    }
}

#[test]
fn bad_requests_get_the_error_format() {
    let dir = tempfile::tempdir().unwrap();
    let socket = serve(dir.path());
    for (method, uri, status) in [
        ("GET", "/v1/nothing", 404),
        ("DELETE", "/v1/services", 405),
        ("GET", "/v1/services/nope", 404),
        ("POST", "/v1/services/nope/suspend", 404),
        ("POST", "/v1/services/m/fly", 404),
        ("GET", "/v1/events?after=yesterday", 400),
    ] {
        let (got, message, code) = api_error(request(&socket, method, uri));
        assert_eq!((got, code), (status, 2), "{method} {uri}: {message}");
        assert!(!message.is_empty() && !message.contains('\n'), "{method} {uri}: {message:?}");
    }
}
