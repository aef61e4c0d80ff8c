//! `man` and `completions`: the manual pages, the Markdown reference and the
//! shell completions, all generated from the command line's definitions, so
//! that they say what this binary accepts.

use crate::cli::Cli;
use crate::reference;
use anyhow::Context;
use clap::CommandFactory;
use std::io::Write;
use std::path::Path;

pub fn man(dir: Option<&Path>, markdown: bool) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    if markdown {
        stdout.write_all(reference::markdown(Cli::command()).as_bytes())?;
        return Ok(());
    }
    match dir {
        None => clap_mangen::Man::new(Cli::command()).render(&mut stdout)?,
        Some(dir) => {
            std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
            clap_mangen::generate_to(Cli::command(), dir)
                .with_context(|| format!("cannot write the manual pages into {}", dir.display()))?;
        }
    }
    stdout.flush()?;
    Ok(())
}

pub fn completions(shell: clap_complete::Shell) -> anyhow::Result<()> {
    let mut cmd = Cli::command();
    let name = cmd.get_name().to_string();
    let mut stdout = std::io::stdout().lock();
    clap_complete::generate(shell, &mut cmd, name, &mut stdout);
    stdout.flush()?;
    Ok(())
}
