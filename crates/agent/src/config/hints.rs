//! What a TOML or serde error of the config file means in the file's own
//! words: a mistyped key with the key it may mean, `[service]` written for
//! `[[service]]`, an address that is not `IP:PORT`.

/// The error message for `message` (toml's), whose span starts at `at` in
/// `text`: said again where a plainer one helps, else as it is.
pub(super) fn explain(text: &str, at: usize, message: &str) -> String {
    if let Some(m) = unknown_key(text, at, message) {
        return m;
    }
    if message.starts_with("invalid type: map, expected a sequence")
        && line_at(text, at).trim() == "[service]"
    {
        return "`[service]` is one table, but services are an array of tables: write `[[service]]` above each \
                service"
            .into();
    }
    if message.contains("invalid socket address syntax") {
        if let Some(m) = bad_address(text, at) {
            return m;
        }
    }
    message.to_string()
}

/// `unknown field `X`, expected one of `a`, `b``: the table, and the key
/// closest to X if one is close, else the keys there are.
fn unknown_key(text: &str, at: usize, message: &str) -> Option<String> {
    let rest = message.strip_prefix("unknown field `")?;
    let (key, rest) = rest.split_once('`')?;
    let known: Vec<&str> = rest.split('`').skip(1).step_by(2).collect();
    let table = table_at(text, at);
    let closest = known
        .iter()
        .map(|k| (strsim::jaro_winkler(key, k), *k))
        .filter(|(score, _)| *score >= 0.8)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, k)| k);
    Some(match closest {
        Some(k) => format!("unknown key `{key}` in {table}: did you mean `{k}`?"),
        None => {
            let list: Vec<String> = known.iter().map(|k| format!("`{k}`")).collect();
            format!("unknown key `{key}` in {table} (its keys: {})", list.join(", "))
        }
    })
}

/// `KEY = "VALUE"` on the line at `at`, where an `IP:PORT` was expected.
fn bad_address(text: &str, at: usize) -> Option<String> {
    let line = line_at(text, at);
    let (key, value) = line.split_once('=')?;
    let (key, value) = (key.trim(), value.trim().trim_matches('"'));
    let bare = value.split_once("://").map_or(value, |(_, b)| b).trim_end_matches('/');
    let port = bare.rsplit_once(':').map_or("PORT", |(_, p)| p);
    let example = format!("\"127.0.0.1:{port}\"");
    let why = if value.contains("://") {
        format!("an address with no scheme, such as {example}")
    } else {
        format!("an IP address and port, such as {example} (a host name is not resolved)")
    };
    Some(format!("{key} = \"{value}\": expected IP:PORT, {why}"))
}

/// The line of `text` that holds offset `at`.
fn line_at(text: &str, at: usize) -> &str {
    let at = at.min(text.len());
    let start = text[..at].rfind('\n').map_or(0, |i| i + 1);
    let end = text[at..].find('\n').map_or(text.len(), |i| at + i);
    &text[start..end]
}

/// The table header in force at `at` (`[[service]]`, `[agent]`), or "the
/// top level" before any.
fn table_at(text: &str, at: usize) -> String {
    let at = at.min(text.len());
    // The key that is unknown may be a table's own name: its parent's.
    let here = line_at(text, at).trim();
    if here.starts_with('[') {
        let name = here.split('#').next().unwrap_or(here).trim().trim_matches(['[', ']']);
        return name.rsplit_once('.').map_or("the top level".into(), |(p, _)| format!("[{p}]"));
    }
    text[..at]
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| l.starts_with('['))
        .map_or("the top level".into(), |l| l.split('#').next().unwrap_or(l).trim().to_string())
}
