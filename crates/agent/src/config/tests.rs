//! The configuration's parsing and checks.
use super::*;

#[test]
fn durations_and_sizes() {
    assert_eq!(parse_duration("300").unwrap(), Duration::from_secs(300));
    assert_eq!(parse_duration("5m").unwrap(), Duration::from_secs(300));
    assert_eq!(parse_duration("2h").unwrap(), Duration::from_secs(7200));
    assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
    assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
    assert!(parse_duration("5x").is_err());
    assert_eq!(parse_size("16GiB").unwrap(), 16 << 30);
    assert_eq!(parse_size("1024").unwrap(), 1024);
    assert!(parse_size("3 apples").is_err());
}

const GOOD: &str = r#"
[agent]
socket = "/tmp/a.sock"
min_host_available = "16GiB"

[[service]]
name = "a"
listen = "127.0.0.1:8000"
backend = "127.0.0.1:18000"
command = ["serve"]
suspend_after = "5m"
hibernate_after = "never"
wake_timeout = "120s"
priority = 10
"#;

#[test]
fn good_config() {
    let c = Config::parse(GOOD, "x.toml").unwrap();
    assert_eq!(c.agent.min_host_available, Some(16 << 30));
    let s = &c.service[0];
    assert_eq!(s.suspend_after, Some(Duration::from_secs(300)));
    assert_eq!(s.hibernate_after, None);
    assert!(s.restart);
}

fn err(text: &str) -> String {
    Config::parse(text, "x.toml").unwrap_err().to_string()
}

#[test]
fn hooks() {
    let text = format!(
        "{GOOD}hooks.before_suspend = {{ method = \"POST\", path = \"/sleep?level=1\", timeout = \"30s\" }}\n\
         hooks.after_resume = {{ path = \"/wake_up\", timeout = \"60s\" }}\n"
    );
    let c = Config::parse(&text, "x.toml").unwrap();
    let h = &c.service[0].hooks;
    let b = h.before_suspend.as_ref().unwrap().get_ref();
    assert_eq!(
        (b.method.as_str(), b.path.as_str(), b.timeout),
        ("POST", "/sleep?level=1", Duration::from_secs(30))
    );
    let a = h.after_resume.as_ref().unwrap().get_ref();
    assert_eq!((a.method.as_str(), a.timeout), ("POST", Duration::from_secs(60)));
    // The table form, as SGLang's operators would write it.
    let text = format!(
        "{GOOD}\n[service.hooks]\nbefore_suspend = {{ path = \"/release_memory_occupation\", body = \"{{}}\" }}\n"
    );
    let c = Config::parse(&text, "x.toml").unwrap();
    assert_eq!(c.service[0].hooks.before_suspend.as_ref().unwrap().get_ref().body.as_deref(), Some("{}"));
    assert!(c.service[0].hooks.after_resume.is_none());
    for (bad, what) in [
        ("hooks.before_suspend = { method = \"FETCH\", path = \"/sleep\" }", "method \"FETCH\""),
        ("hooks.before_suspend = { path = \"sleep\" }", "must start with '/'"),
        ("hooks.after_resume = { path = \"/wake up\" }", "must start with '/'"),
        ("hooks.after_resume = { path = \"/w\", timeout = \"0s\" }", "timeout must be above 0"),
        ("hooks.after_resume = { path = \"/w\", retries = 3 }", "unknown key `retries`"),
        ("hooks.after_suspend = { path = \"/w\" }", "unknown key `after_suspend`"),
        ("hooks.after_resume = { timeout = \"1s\" }", "missing field `path`"),
    ] {
        let e = err(&format!("{GOOD}{bad}\n"));
        assert!(e.starts_with("x.toml:15:") && e.contains(what), "{bad}: {e}");
    }
}

#[test]
fn errors_name_the_line() {
    let e = err(&GOOD.replace("priority = 10", "priority = 10\nfoo = 1"));
    assert!(e.starts_with("x.toml:15:") && e.contains("foo"), "{e}");
    let dup = format!("{GOOD}\n[[service]]\nname = \"a\"\nlisten = \"127.0.0.1:8001\"\nbackend = \"127.0.0.1:18001\"\ncommand = [\"s\"]\n");
    let e = err(&dup);
    assert!(e.starts_with("x.toml:17:") && e.contains("duplicate service name"), "{e}");
    let port =
        dup.replace("name = \"a\"\nlisten = \"127.0.0.1:8001\"", "name = \"b\"\nlisten = \"127.0.0.1:8000\"");
    let e = err(&port);
    assert!(e.starts_with("x.toml:18:") && e.contains("port 8000"), "{e}");
    let shared = format!("{GOOD}\n[[service]]\nname = \"b\"\nlisten = \"127.0.0.1:8001\"\nbackend = \"127.0.0.1:18000\"\ncommand = [\"s\"]\n");
    let e = err(&shared);
    assert!(e.starts_with("x.toml:17:") && e.contains("backend 127.0.0.1:18000 is already \"a\"'s"), "{e}");
    let e = err(&GOOD.replace("command = [\"serve\"]\n", ""));
    assert!(e.starts_with("x.toml:7:") && e.contains("exactly one of command"), "{e}");
    let e = err(&GOOD.replace("\"5m\"", "\"5 parsecs\""));
    assert!(e.starts_with("x.toml:11:") && e.contains("bad duration"), "{e}");
}

#[test]
fn front_door_keys() {
    let text = GOOD
        .replace("min_host_available = \"16GiB\"\n", "min_host_available = \"16GiB\"\nhttp_listen = \"127.0.0.1:8080\"\n\n[agent.http]\nmax_body = \"1MiB\"\n")
        + "models = [\"m-7b\", \"m\"]\nstart = \"on-demand\"\nfail_fast = true\nremote = \"s3://b/p\"\n";
    let c = Config::parse(&text, "x.toml").unwrap();
    assert_eq!(c.agent.http_listen, Some("127.0.0.1:8080".parse().unwrap()));
    assert_eq!(c.agent.http.max_body, 1 << 20);
    assert_eq!(c.agent.http.max_connections, 1024);
    let s = &c.service[0];
    assert_eq!(s.models.iter().map(|m| m.get_ref().as_str()).collect::<Vec<_>>(), ["m-7b", "m"]);
    assert_eq!((s.start, s.fail_fast), (Start::OnDemand, true));
    assert_eq!(Config::parse(GOOD, "x.toml").unwrap().service[0].start, Start::Boot);
    let two = format!(
        "{text}\n[[service]]\nname = \"b\"\nlisten = \"127.0.0.1:8001\"\nbackend = \"127.0.0.1:18001\"\ncommand = [\"s\"]\nmodels = [\"m\"]\n"
    );
    let e = err(&two);
    assert!(e.contains("model \"m\" is served by \"a\" already"), "{e}");
    for (bad, what) in [
        ("start = \"later\"", "unknown variant"),
        ("remote = \"ftp://x\"", "remote \"ftp://x\""),
        ("models = [\"\"]", "empty"),
    ] {
        let e = err(&format!("{GOOD}{bad}\n"));
        assert!(e.starts_with("x.toml:15:") && e.contains(what), "{bad}: {e}");
    }
    let e = err(&text.replace("max_body = \"1MiB\"", "max_body = 0"));
    assert!(e.starts_with("x.toml:7:") && e.contains("max_body"), "{e}");
    let e = err(&text.replace("max_body = \"1MiB\"", "max_header = 100"));
    assert!(e.contains("max_header"), "{e}");
    let e = err(&text.replace("127.0.0.1:8080", "127.0.0.1:8000"));
    assert!(e.contains("the http_listen port"), "{e}");
}

const BASE: &str =
    "[agent]\nsocket = \"/tmp/a.sock\"\n\n[[service]]\nname = \"a\"\nlisten = \"127.0.0.1:8000\"\n\
                    backend = \"127.0.0.1:18000\"\ncommand = [\"serve\"]\n";

#[test]
fn out_of_range_numbers_name_their_key_and_line() {
    let e = err(&BASE.replace("[agent]\n", "[agent]\ntick = 0\n"));
    assert!(e.starts_with("x.toml:2:") && e.contains("tick = 0ns"), "{e}");
    for (line, what) in [
        ("max_waiting = 0", "max_waiting = 0"),
        ("wake_timeout = 9223372036854775807", "wake_timeout"),
        ("max_connections = 0", "max_connections = 0"),
        ("request_timeout = \"10ms\"", "request_timeout"),
        ("hibernate_after = \"1000d\"", "hibernate_after"),
        ("priority = 9223372036854775807", "priority"),
        ("gpu_memory = 0", "gpu_memory"),
    ] {
        let e = err(&format!("{BASE}{line}\n"));
        assert!(e.starts_with("x.toml:9:") && e.contains(what) && e.contains("service \"a\""), "{line}: {e}");
    }
    // The key of the second service, not the first's.
    let two = format!(
        "{BASE}max_waiting = 5\n\n[[service]]\nname = \"b\"\nlisten = \"127.0.0.1:8001\"\n\
         backend = \"127.0.0.1:18001\"\ncommand = [\"s\"]\nmax_waiting = 0\n"
    );
    let e = err(&two);
    assert!(e.starts_with("x.toml:16:") && e.contains("service \"b\""), "{e}");
    assert!(Config::parse(&format!("{BASE}max_waiting = 1\nrequest_timeout = \"never\"\n"), "x").is_ok());
}

#[test]
fn fast_swap_keys() {
    let c = Config::parse(&format!("{GOOD}fast_swap = true\nkeep_pinned = true\n"), "x.toml").unwrap();
    assert!(c.service[0].fast_swap_on() && c.service[0].keep_pinned_on());
    // On by default for a server the agent starts; off when the file says so.
    let c = Config::parse(GOOD, "x.toml").unwrap();
    assert!(c.service[0].fast_swap_on() && !c.service[0].keep_pinned_on());
    let c = Config::parse(&format!("{GOOD}keep_pinned = true\n"), "x.toml").unwrap();
    assert!(c.service[0].keep_pinned_on());
    let c = Config::parse(&format!("{GOOD}fast_swap = false\n"), "x.toml").unwrap();
    assert!(!c.service[0].fast_swap_on());
    let e = err(&format!("{GOOD}fast_swap = false\nkeep_pinned = true\n"));
    assert!(e.contains("keep_pinned needs fast swap"), "{e}");
    let adopted = GOOD.replace("command = [\"serve\"]", "pid_file = \"/run/x.pid\"");
    let e = err(&format!("{adopted}fast_swap = true\n"));
    assert!(e.contains("fast_swap is for a server the agent starts"), "{e}");
    let c = Config::parse(&adopted, "x.toml").unwrap();
    assert!(!c.service[0].fast_swap_on());
}

#[test]
fn wake_on_socket_has_no_listen_and_may_share_a_port_across_namespaces() {
    let text = r#"
[[service]]
name = "a"
wake_on = "socket"
backend = "10.0.0.2:8000"
netns = "/run/netns/a"
ignore_peers = ["10.0.0.1", "fd00::/8"]
pid_file = "/run/a.pid"

[[service]]
name = "b"
wake_on = "socket"
backend = "10.0.0.2:8000"
netns = "/run/netns/b"
pid_file = "/run/b.pid"
"#;
    let c = Config::parse(text, "x.toml").unwrap();
    let a = &c.service[0];
    assert_eq!(a.wake_on, WakeOn::Socket);
    assert_eq!(a.client_addr(), "10.0.0.2:8000".parse().unwrap());
    assert_eq!(a.ignore_peers().unwrap().len(), 2);
    assert_eq!(a.socket_poll, Duration::from_millis(1));
    assert_eq!(c.service[1].ignore_peers(), None);
    assert_eq!(Config::parse(GOOD, "x.toml").unwrap().service[0].wake_on, WakeOn::Proxy);
}

#[test]
fn wake_on_keys_are_checked() {
    let socket =
        "[[service]]\nname = \"a\"\nwake_on = \"socket\"\nbackend = \"127.0.0.1:8000\"\ncommand = [\"s\"]\n";
    assert!(
        err(&format!("{socket}listen = \"127.0.0.1:9000\"\n")).contains("listen is for wake_on = \"proxy\"")
    );
    assert!(err(&format!("{socket}ignore_peers = [\"node\"]\n"))
        .contains("ignore_peers: \"node\" is not an address"));
    assert!(err(&format!("{socket}socket_poll = \"0ms\"\n")).contains("socket_poll"));
    assert!(err(&format!("{socket}start = \"on-demand\"\n"))
        .contains("start = \"on-demand\" needs wake_on = \"proxy\""));
    assert!(err(&format!("{socket}fail_fast = true\n")).contains("fail_fast needs wake_on = \"proxy\""));
    let proxy = "[[service]]\nname = \"a\"\nbackend = \"127.0.0.1:8000\"\ncommand = [\"s\"]\n";
    assert!(err(proxy).contains("listen is missing"));
    assert!(err(&format!("{proxy}listen = \"127.0.0.1:9000\"\nnetns = \"/run/netns/x\"\n"))
        .contains("netns is for wake_on = \"socket\""));
    assert!(
        err(&proxy.replace("backend", "wake_on = \"pigeon\"\nbackend")).contains("unknown variant `pigeon`")
    );
}

#[test]
fn the_pinned_budget_is_a_size_of_the_agent() {
    assert_eq!(Config::parse(GOOD, "x.toml").unwrap().agent.pinned_budget, None);
    let text = GOOD.replace("min_host_available = \"16GiB\"\n", "pinned_budget = \"64GiB\"\n");
    assert_eq!(Config::parse(&text, "x.toml").unwrap().agent.pinned_budget, Some(64 << 30));
    let e = err(&GOOD.replace("min_host_available = \"16GiB\"\n", "pinned_budget = \"lots\"\n"));
    assert!(e.contains("pinned_budget") || e.contains("lots"), "{e}");
}

#[test]
fn a_mistyped_key_is_named_with_the_key_it_may_mean() {
    for (from, to, table, meant) in [
        ("suspend_after", "suspend_aftr", "[[service]]", "suspend_after"),
        ("min_host_available", "min_host_avail", "[agent]", "min_host_available"),
        ("agent", "agnet", "the top level", "agent"),
    ] {
        let e = err(&GOOD.replacen(from, to, 1));
        assert!(e.contains(&format!("unknown key `{to}` in {table}: did you mean `{meant}`?")), "{e}");
        assert!(!e.contains("expected one of"), "{e}");
    }
    // Nothing close: the keys it may be.
    let e = err(&format!("{GOOD}zzzzzz = 1\n"));
    assert!(e.contains("unknown key `zzzzzz` in [[service]]") && e.contains("`suspend_after`"), "{e}");
}

#[test]
fn a_service_table_written_once_says_to_write_an_array_of_tables() {
    let e = err(&GOOD.replace("[[service]]", "[service]"));
    assert!(e.starts_with("x.toml:6: "), "{e}");
    assert!(e.contains("write `[[service]]`"), "{e}");
}

#[test]
fn an_address_that_is_not_ip_and_port_names_the_key_and_the_form() {
    let e = err(&GOOD.replace("\"127.0.0.1:18000\"", "\"localhost:18000\""));
    assert!(e.starts_with("x.toml:9: backend = \"localhost:18000\""), "{e}");
    assert!(e.contains("IP:PORT") && e.contains("\"127.0.0.1:18000\""), "{e}");
    let e = err(&GOOD.replace("\"127.0.0.1:18000\"", "\"http://127.0.0.1:18000\""));
    assert!(e.contains("no scheme") && e.contains("\"127.0.0.1:18000\""), "{e}");
    let e = err(&GOOD.replace("\"127.0.0.1:8000\"", "\"8000\""));
    assert!(e.starts_with("x.toml:8: listen = \"8000\""), "{e}");
}

#[test]
fn a_file_being_edited_still_names_its_socket() {
    let s = crate::config::socket_in("[agent]\nsocket = \"/run/x.sock\"\n[[service]]\nlisten = 12\n");
    assert_eq!(s, Some(std::path::PathBuf::from("/run/x.sock")));
    let default = crate::config::AgentConfig::default().socket;
    assert_eq!(crate::config::socket_in("[[service]]\nname = \"a\"\n"), Some(default));
    assert_eq!(crate::config::socket_in("[agent\n"), None);
}
