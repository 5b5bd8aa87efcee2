//! Project tasks, run as `cargo xtask <task>`.
//!
//! A thin runner: it invokes cargo and the project's binaries as processes and
//! depends on no workspace crate, so `ci` can format-check and lint even when
//! the code does not compile.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

mod bench;
mod chaos;
mod demo;
mod python;
// The workspace's one SplitMix64, compiled here from its source: xtask
// depends on no workspace crate (see Cargo.toml). xtask uses the generator,
// not every function of the module.
#[allow(dead_code)]
#[path = "../../policy-core/src/splitmix.rs"]
mod splitmix;

const USAGE: &str = "usage: cargo xtask <task> [options]

tasks:
  bench [--only PART]...  selection cost, proxy overhead, polling, router replicas:
                          target/bench/report.md
  chaos [--rate R] [--duration-s S]  a fleet with one engine per fault mode vs good
                          engines only: target/chaos/report.md
  ci                      format check, unused dependencies, clippy and rustdoc
                          (warnings are errors), every test, then `python`
  demo [--replicas N] [--multi-turn]
                          start a mixed engine-sim fleet and the router (N replicas
                          sharing pending work through nats-server, installed
                          from Debian when missing), drive 20 s of size-skewed
                          streaming traffic spread over them (or, --multi-turn,
                          30 s of multi-turn chat sessions, ending with each
                          engine's prefix-cache hit rate), print per-worker
                          results and a live score table
  python                  build the Python wheel (maturin), install it into a fresh
                          venv, run its unit tests and drive the OpenAI client
                          through `python -m llm_router.launch_router` over
                          engine-sim engines (part of ci)
  sim [--scenario PATH]   run the fleet simulator (the standard set, or one
                          scenario file); reports under target/sim/";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("ci") => ci(),
        Some("bench") => bench::run(&args[1..]),
        Some("chaos") => chaos::run(&args[1..]),
        Some("demo") => demo::run(&args[1..]),
        Some("python") => python::run(&args[1..]),
        Some("sim") => sim(&args[1..]),
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

    // A declared dependency no code uses fails CI. cargo-machete is the one
    // tool CI needs beyond the toolchain: installed from crates.io on first
    // use, so a fresh machine needs nothing but this repository. It knows it
    // runs as `cargo machete` only when CARGO_PKG_NAME is unset (`cargo
    // xtask` sets it; then machete reads its own name as a path to check).
    let machete = || {
        let mut command = cargo();
        command.arg("machete").env_remove("CARGO_PKG_NAME");
        command
    };
    let machete_installed = machete()
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success());
    if !machete_installed {
        let mut install = cargo();
        install.args(["install", "cargo-machete", "--locked"]);
        run("cargo install cargo-machete --locked", install)?;
    }
    run("cargo machete", machete())?;

    // The router's benchmarks build only with its `bench-internals`
    // feature; linted with everything else.
    let mut clippy = cargo();
    clippy.args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--features",
        "router/bench-internals",
        "--",
        "-D",
        "warnings",
    ]);
    run(
        "cargo clippy --workspace --all-targets --features router/bench-internals -- -D warnings",
        clippy,
    )?;

    // The API docs are part of the framework: a broken intra-doc link or a
    // link to a private item fails CI like a warning does.
    let mut doc = cargo();
    doc.args(["doc", "--workspace", "--no-deps"])
        .env("RUSTDOCFLAGS", "-D warnings");
    run(
        "RUSTDOCFLAGS='-D warnings' cargo doc --workspace --no-deps",
        doc,
    )?;

    let mut test = cargo();
    test.args(["test", "--workspace"]).env("INSTA_UPDATE", "no");
    run("cargo test --workspace", test)?;

    // The Python package: its wheel, its unit tests, and the OpenAI client
    // through the sglang-router-compatible launcher.
    python::run(&[])?;

    eprintln!("xtask: ci passed");
    Ok(())
}

/// `target` under the workspace, or `CARGO_TARGET_DIR` when set (where
/// cargo builds).
fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|dir| {
            if dir.is_absolute() {
                dir
            } else {
                workspace_root().join(dir)
            }
        })
        .unwrap_or_else(|| workspace_root().join("target"))
}

/// A release binary where `build_release` puts it.
fn release_binary(name: &str) -> PathBuf {
    target_dir().join("release").join(name)
}

fn build_release(packages: &[&str]) -> Result<(), String> {
    let mut build = cargo();
    build.args(["build", "--release"]);
    for package in packages {
        build.args(["-p", package]);
    }
    run(
        &format!("cargo build --release -p {}", packages.join(" -p ")),
        build,
    )
}

fn sim(args: &[String]) -> Result<(), String> {
    build_release(&["engine-sim"])?;
    let mut simulate = Command::new(release_binary("engine-sim"));
    simulate
        .current_dir(workspace_root())
        .arg("sim")
        .args(["--out-dir", "target/sim"])
        .args(args);
    run("engine-sim sim", simulate)
}

/// A child process that is stopped (SIGTERM, then SIGKILL) when dropped, so
/// the demo leaves nothing running whichever way it ends.
struct Process {
    name: String,
    child: Child,
}

impl Process {
    fn spawn(name: &str, command: &mut Command) -> Result<Process, String> {
        let child = command
            .spawn()
            .map_err(|error| format!("could not start {name}: {error}"))?;
        Ok(Process {
            name: name.to_owned(),
            child,
        })
    }

    /// Reads `lines` lines of the child's stdout (engine-sim prints one JSON
    /// line per engine once it listens).
    fn read_lines(&mut self, lines: usize) -> Result<Vec<String>, String> {
        let stdout = self
            .child
            .stdout
            .take()
            .ok_or_else(|| format!("{}: no stdout", self.name))?;
        let mut reader = BufReader::new(stdout);
        let mut out = Vec::new();
        while out.len() < lines {
            let mut line = String::new();
            let read = reader
                .read_line(&mut line)
                .map_err(|error| format!("{}: {error}", self.name))?;
            if read == 0 {
                return Err(format!("{} exited before it was ready", self.name));
            }
            out.push(line.trim().to_owned());
        }
        Ok(out)
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A block of `count` consecutive free loopback ports.
fn free_ports(count: u16) -> Result<u16, String> {
    let seed = std::process::id() as u16;
    for attempt in 0..200u16 {
        let base = 20_000 + (seed.wrapping_mul(31).wrapping_add(attempt.wrapping_mul(97))) % 40_000;
        let all_free =
            (0..count).all(|offset| TcpListener::bind(("127.0.0.1", base + offset)).is_ok());
        if all_free {
            return Ok(base);
        }
    }
    Err(format!("no block of {count} free ports found"))
}

/// One engine's HTTP URL and, for flavours that serve one, its gRPC URL.
type EngineUrls = (String, Option<String>);

/// One engine-sim process; returns it with its engines' URLs. Port 0 lets
/// each engine bind a free port, so parallel runs never collide.
fn start_engines(flavour: &str, extra: &[&str]) -> Result<(Process, Vec<EngineUrls>), String> {
    start_engines_of(&release_binary("engine-sim"), flavour, extra)
}

/// [`start_engines`] with the engine-sim binary at `binary`.
fn start_engines_of(
    binary: &std::path::Path,
    flavour: &str,
    extra: &[&str],
) -> Result<(Process, Vec<EngineUrls>), String> {
    let mut command = Command::new(binary);
    command
        .args(["serve", "--flavour", flavour, "--count", "1"])
        .args(["--base-port", "0", "--grpc-base-port", "0"])
        .args(extra)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut process = Process::spawn(&format!("engine-sim ({flavour})"), &mut command)?;
    let lines = process.read_lines(1)?;
    let engines = lines
        .iter()
        .map(|line| {
            let field = |name: &str| {
                line.split(&format!("\"{name}\":"))
                    .nth(1)
                    .and_then(|rest| rest.trim_start().strip_prefix('"'))
                    .and_then(|rest| rest.split('"').next())
                    .map(str::to_owned)
            };
            (field("http").unwrap_or_default(), field("grpc"))
        })
        .collect();
    Ok((process, engines))
}
