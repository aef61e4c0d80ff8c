//! docs/getting-started.md's step 4 (the agent, its front door and the
//! official OpenAI client), run as written: its shell blocks in one bash,
//! in the environment step 1 sets up (the fakes linked by
//! `scripts/fakes.sh`, `T`, `LD_LIBRARY_PATH`, `GPUSNAP_FAKE_DIR`,
//! `GPUSNAP_STATE_DIR`), each block's output compared with the text block
//! that follows it on the page, numbers (pids, times) aside.

mod common;

use common::*;
use std::path::Path;
use std::process::{Command, Stdio};

/// The `sh` blocks of the section that starts with `heading`, each with the
/// `text` block that follows it (if one does).
fn blocks(page: &str, heading: &str) -> Vec<(String, Option<String>)> {
    let start = page.find(heading).unwrap_or_else(|| panic!("no {heading:?} in the page"));
    let rest = &page[start + heading.len()..];
    let section = &rest[..rest.find("\n## ").unwrap_or(rest.len())];
    let mut out: Vec<(String, Option<String>)> = Vec::new();
    let mut lines = section.lines();
    while let Some(l) = lines.next() {
        let kind = match l.trim_end() {
            "```sh" => "sh",
            "```text" => "text",
            _ => continue,
        };
        let body: Vec<&str> = lines.by_ref().take_while(|l| l.trim_end() != "```").collect();
        let body = body.join("\n");
        match kind {
            "sh" => out.push((body, None)),
            _ => out.last_mut().expect("a text block after a sh block").1 = Some(body),
        }
    }
    out
}

/// A block's output as compared: numbers as `N`, runs of blanks as one.
fn shape(text: &str) -> Vec<String> {
    text.lines()
        .map(|l| {
            let mut s = String::new();
            let mut prev = ' ';
            for c in l.trim().chars() {
                let c = if c.is_ascii_digit() { 'N' } else { c };
                if (c == 'N' && prev == 'N') || (c.is_whitespace() && prev.is_whitespace()) {
                    continue;
                }
                s.push(if c.is_whitespace() { ' ' } else { c });
                prev = c;
            }
            // `N.N` and `N` are one number.
            s.replace("N.N", "N")
        })
        .filter(|l| !l.is_empty())
        .collect()
}

fn have(tool: &str, args: &[&str]) -> bool {
    Command::new(tool)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

#[test]
fn step_4_the_front_door_with_the_official_client_runs_as_written() {
    for (tool, args) in
        [("jq", &["--version"][..]), ("curl", &["--version"][..]), ("python3", &["-m", "venv", "--help"][..])]
    {
        if !have(tool, args) {
            gpusnap_testkit::skip(format!(
                "{tool} does not run here (the page needs it; .ci/run installs it)"
            ));
            return;
        }
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let page = std::fs::read_to_string(root.join("docs/getting-started.md")).unwrap();
    let steps = blocks(&page, "## 4. The agent: one endpoint, two models, one GPU");
    assert!(steps.len() >= 4, "{steps:?}");
    let mut w = World::new(&[16384]);
    let t = w.tmp.path().to_path_buf();
    // Step 1, for a debug build: the fakes linked under the real names.
    let fakes = Command::new(root.join("scripts/fakes.sh"))
        .arg(t.join("lib"))
        .env("GPUSNAP_TEST_PREBUILT", "1")
        .output()
        .unwrap();
    assert!(fakes.status.success(), "{}", String::from_utf8_lossy(&fakes.stderr));
    const MARK: &str = "@@ end of block @@";
    let mut script = String::from("set -e\n");
    for (sh, _) in &steps {
        script += &format!("{sh}\necho '{MARK}'\n");
    }
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_gpusnap")).parent().unwrap().to_path_buf();
    let path = format!("{}:{}", bin_dir.display(), std::env::var("PATH").unwrap_or_default());
    let mut cmd = Command::new("timeout");
    w.env(&mut cmd);
    cmd.args(["600", "bash", "-c", &script])
        .current_dir(&root)
        .env("T", &t)
        .env("PATH", path)
        .env("LD_LIBRARY_PATH", t.join("lib"))
        .env_remove("GPUSNAP_AGENT_SOCKET")
        .stdin(Stdio::null());
    let out = cmd.output().unwrap();
    // Whatever happened, the agent's servers end with the test.
    adopt_recorded_services(&mut w);
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    let agent_log = std::fs::read_to_string(t.join("agent.log")).unwrap_or_default();
    assert!(
        out.status.success(),
        "the page's step 4 failed: {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}\nagent log:\n{agent_log}",
        out.status
    );
    let outputs: Vec<&str> = stdout.split(&format!("{MARK}\n")).collect();
    let mut wrong = Vec::new();
    for (i, (sh, want)) in steps.iter().enumerate() {
        let Some(want) = want else { continue };
        // The page's `T`.
        let got = outputs
            .get(i)
            .copied()
            .unwrap_or_default()
            .replace(&t.display().to_string(), "/tmp/gpusnap-tutorial");
        let got = got.as_str();
        if shape(got) != shape(want) {
            wrong.push(format!("block {i}:\n{sh}\n--- printed:\n{got}\n--- the page:\n{want}\n"));
        }
    }
    assert!(wrong.is_empty(), "printed what the page does not say:\n{}\nstderr:\n{stderr}", wrong.join("\n"));
}
