//! Project tasks, run as `cargo xtask <task>`.
//!
//! A thin runner: it invokes cargo and the project's binaries as processes and
//! depends on no workspace crate, so `ci` can format-check and lint even when
//! the code does not compile.

use std::path::PathBuf;
use std::process::{Command, ExitCode};

const USAGE: &str = "usage: cargo xtask <task>

tasks:
  ci      format check, clippy (warnings are errors), every test";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("ci") => ci(),
        Some("-h" | "--help" | "help") => {
            println!("{USAGE}");
            Ok(())
        }
        Some(other) => Err(format!("unknown task {other:?}\n\n{USAGE}")),
        None => Err(USAGE.to_owned()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("xtask: {message}");
            ExitCode::FAILURE
        }
    }
}

/// The workspace root: xtask's manifest sits one level below it.
fn workspace_root() -> PathBuf {
    let manifest_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest_dir
        .parent()
        .map(PathBuf::from)
        .unwrap_or(manifest_dir)
}

fn cargo() -> Command {
    let mut command = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    command.current_dir(workspace_root());
    command
}

/// Runs one step, echoing it first; a non-zero exit fails the task.
fn run(step: &str, mut command: Command) -> Result<(), String> {
    eprintln!("xtask: == {step}");
    let status = command
        .status()
        .map_err(|error| format!("{step}: could not start: {error}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{step} failed ({status})"))
    }
}

fn ci() -> Result<(), String> {
    let mut fmt = cargo();
    fmt.args(["fmt", "--all", "--check"]);
    run("cargo fmt --all --check", fmt)?;

    let mut clippy = cargo();
    clippy.args(["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"]);
    run("cargo clippy --workspace --all-targets -- -D warnings", clippy)?;

    let mut test = cargo();
    test.args(["test", "--workspace"]).env("INSTA_UPDATE", "no");
    run("cargo test --workspace", test)?;

    eprintln!("xtask: ci passed");
    Ok(())
}
