//! `cargo xtask python`: the Python package (`python/`) end to end.
//!
//! 1. maturin, installed from PyPI into `target/python/tools` on first use
//!    (as `ci` installs cargo-machete), builds the wheel: the release
//!    `router` binary and the `llm_router` package.
//! 2. The wheel and the OpenAI client go into a fresh virtual environment
//!    (`target/python/venv`), and the package's unit tests run there with
//!    its Python (`python -m unittest`): the flag mapping, the launcher's
//!    exec, and the `Router` API against the installed binary.
//! 3. Two engine-sim SGLang engines start; `python -m
//!    llm_router.launch_router` starts the router over them with
//!    sglang-router's flags, on a PATH without a Rust toolchain, and the
//!    process must have become the wheel's binary (not `target/`'s); the
//!    OpenAI Python client then sends chat, streamed chat, completions and
//!    models requests through it (`python/tests/openai_e2e.py`), and through
//!    a second router the `Router` API starts.
//!
//! Every process it starts is stopped whichever way it ends.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::bench::{http_status, router_workers, wait_for};
use crate::{Process, free_ports, start_engines_of, target_dir, workspace_root};

const PYTHON_USAGE: &str = "usage: cargo xtask python

Builds the llm-router wheel with maturin (installed into target/python/tools on
first use), installs it and the OpenAI client into a fresh virtual environment,
runs the package's unit tests, and drives the OpenAI client through a router
started by `python -m llm_router.launch_router` over two engine-sim engines.";

/// The maturin that builds the wheel, pinned so a CI run is repeatable.
const MATURIN: &str = "maturin==1.16.0";
/// The OpenAI client the end-to-end check drives.
const OPENAI: &str = "openai>=1.40,<3";

/// How long one Python step may run before it is stopped and fails.
const STEP_LIMIT: Duration = Duration::from_secs(600);

/// `cargo xtask python`.
pub(crate) fn run(args: &[String]) -> Result<(), String> {
    if let Some(arg) = args.first() {
        return match arg.as_str() {
            "-h" | "--help" => Err(PYTHON_USAGE.to_owned()),
            other => Err(format!("unknown option {other:?}\n\n{PYTHON_USAGE}")),
        };
    }
    let started = Instant::now();
    let mut times: Vec<(&str, Duration)> = Vec::new();
    let mut timed = |name, step: Instant| times.push((name, step.elapsed()));
    let dir = target_dir().join("python");
    let python = host_python()?;

    let step = Instant::now();
    let maturin = ensure_maturin(&dir, &python)?;
    let wheel = build_wheel(&dir, &maturin)?;
    timed("wheel", step);

    let step = Instant::now();
    let venv = fresh_venv(&dir, &python, &wheel)?;
    let binary = check_installed_binary(&venv)?;
    timed("venv", step);

    let step = Instant::now();
    let mut unit = venv_python(&venv)?;
    unit.args(["-m", "unittest", "discover", "-v"])
        .arg("-s")
        .arg(tests_dir())
        .arg("-t")
        .arg(tests_dir());
    run_limited("python -m unittest (the venv's Python)", unit)?;
    timed("unit tests", step);

    // The engines are engine-sim in the test profile: `ci` has just built
    // most of it for `cargo test`, where a release build would add a
    // whole-program-optimized link of its own for a few requests.
    let step = Instant::now();
    let mut engine_sim = crate::cargo();
    engine_sim.args(["build", "--profile", "test", "-p", "engine-sim"]);
    crate::run("cargo build --profile test -p engine-sim", engine_sim)?;
    timed("engine-sim", step);

    let step = Instant::now();
    end_to_end(&venv, &binary)?;
    timed("end to end", step);

    let detail: Vec<String> = times
        .iter()
        .map(|(name, took)| format!("{name} {:.0} s", took.as_secs_f64()))
        .collect();
    eprintln!(
        "xtask: python passed in {:.0} s ({})",
        started.elapsed().as_secs_f64(),
        detail.join(", ")
    );
    Ok(())
}

fn tests_dir() -> PathBuf {
    workspace_root().join("python").join("tests")
}

fn bin(venv: &Path, name: &str) -> PathBuf {
    venv.join("bin").join(name)
}

/// The machine's `python3`, at least 3.11 (the unit tests read TOML with
/// `tomllib`).
fn host_python() -> Result<PathBuf, String> {
    let python = PathBuf::from("python3");
    let output = Command::new(&python)
        .args([
            "-c",
            "import sys; print('%d.%d' % sys.version_info[:2]); sys.exit(sys.version_info < (3, 11))",
        ])
        .output()
        .map_err(|error| format!("python3 is needed to build and test the Python package: {error}"))?;
    if !output.status.success() {
        return Err(format!(
            "python3 is {}; the Python package's checks need 3.11 or later",
            String::from_utf8_lossy(&output.stdout).trim()
        ));
    }
    Ok(python)
}

/// A virtual environment's Python, in the environment every Python step
/// runs in: no Rust toolchain on PATH, no override of the router binary,
/// no router settings inherited from this shell.
fn venv_python(venv: &Path) -> Result<Command, String> {
    let mut command = Command::new(bin(venv, "python"));
    command
        .current_dir(venv)
        .env("PATH", path_without_rust(&venv.join("bin"))?)
        // No __pycache__ left in python/ (the tests run from there).
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env_remove("LLM_ROUTER_BINARY")
        .env_remove("RUST_LOG")
        .env_remove("CARGO")
        .env_remove("RUSTC")
        .env_remove("CARGO_TARGET_DIR");
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("ROUTER__") {
            command.env_remove(name);
        }
    }
    Ok(command)
}

/// `first`, then this PATH's directories that hold no cargo, rustc or rustup.
fn path_without_rust(first: &Path) -> Result<OsString, String> {
    let current = std::env::var_os("PATH").unwrap_or_default();
    let kept = std::env::split_paths(&current).filter(|dir| {
        !["cargo", "rustc", "rustup"]
            .iter()
            .any(|tool| dir.join(tool).exists())
    });
    std::env::join_paths(std::iter::once(first.to_path_buf()).chain(kept))
        .map_err(|error| format!("cannot build a PATH: {error}"))
}

/// maturin in `target/python/tools`, installed from PyPI when missing or
/// not the pinned version.
fn ensure_maturin(dir: &Path, python: &Path) -> Result<PathBuf, String> {
    let tools = dir.join("tools");
    let maturin = bin(&tools, "maturin");
    let wanted = MATURIN.trim_start_matches("maturin==");
    let installed = Command::new(&maturin)
        .arg("--version")
        .output()
        .is_ok_and(|output| {
            output.status.success() && String::from_utf8_lossy(&output.stdout).contains(wanted)
        });
    if !installed {
        remove_dir(&tools)?;
        let mut venv = Command::new(python);
        venv.arg("-m").arg("venv").arg(&tools);
        crate::run("python3 -m venv target/python/tools", venv)?;
        let mut install = Command::new(bin(&tools, "python"));
        install.args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            MATURIN,
        ]);
        crate::run(
            &format!("pip install {MATURIN} (target/python/tools)"),
            install,
        )?;
    }
    Ok(maturin)
}

/// `maturin build --release` in `python/`; the wheel it wrote.
fn build_wheel(dir: &Path, maturin: &Path) -> Result<PathBuf, String> {
    let out = dir.join("wheels");
    remove_dir(&out)?;
    let mut build = Command::new(maturin);
    build
        .current_dir(workspace_root().join("python"))
        .args(["build", "--release", "--out"])
        .arg(&out)
        .env("CARGO_TARGET_DIR", target_dir());
    crate::run("maturin build --release (python/pyproject.toml)", build)?;
    let wheels: Vec<PathBuf> = std::fs::read_dir(&out)
        .map_err(|error| format!("{}: {error}", out.display()))?
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "whl"))
        .collect();
    match wheels.as_slice() {
        [wheel] => Ok(wheel.clone()),
        other => Err(format!(
            "expected one wheel in {}, found {}",
            out.display(),
            other.len()
        )),
    }
}

/// A new virtual environment with the wheel and the OpenAI client.
fn fresh_venv(dir: &Path, python: &Path, wheel: &Path) -> Result<PathBuf, String> {
    let venv = dir.join("venv");
    remove_dir(&venv)?;
    let mut create = Command::new(python);
    create.arg("-m").arg("venv").arg(&venv);
    crate::run("python3 -m venv target/python/venv (fresh)", create)?;
    let mut install = venv_python(&venv)?;
    install
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
        ])
        .arg(wheel)
        .arg(OPENAI);
    let name = wheel
        .file_name()
        .map_or_else(String::new, |name| name.to_string_lossy().into_owned());
    crate::run(&format!("pip install {name} '{OPENAI}'"), install)?;
    Ok(venv)
}

/// The router binary the installed package runs: the wheel's, in the venv,
/// not a build under `target/`.
fn check_installed_binary(venv: &Path) -> Result<PathBuf, String> {
    let mut ask = venv_python(venv)?;
    ask.args(["-c", "import llm_router; print(llm_router.binary_path())"]);
    let output = ask
        .output()
        .map_err(|error| format!("could not ask the venv's Python: {error}"))?;
    if !output.status.success() {
        return Err(format!(
            "llm_router.binary_path() failed: {}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    let found = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
    let expected = canonical(&bin(venv, "router"))?;
    if canonical(&found)? != expected {
        return Err(format!(
            "llm_router runs {}, not the wheel's binary {}",
            found.display(),
            expected.display()
        ));
    }
    eprintln!(
        "xtask: == the package runs the wheel's binary {}",
        expected.display()
    );
    Ok(expected)
}

fn canonical(path: &Path) -> Result<PathBuf, String> {
    path.canonicalize()
        .map_err(|error| format!("{}: {error}", path.display()))
}

fn remove_dir(dir: &Path) -> Result<(), String> {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(error) => Err(format!("cannot remove {}: {error}", dir.display())),
    }
}

/// A process in a process group of its own, and whatever it starts (the
/// `Router` API's routers): the whole group is stopped (SIGTERM, then
/// SIGKILL) when this is dropped, however the step ended.
struct Group(std::process::Child);

impl Group {
    fn spawn(step: &str, command: &mut Command) -> Result<Group, String> {
        use std::os::unix::process::CommandExt;
        command
            .process_group(0)
            .spawn()
            .map(Group)
            .map_err(|error| format!("could not start {step}: {error}"))
    }

    fn signal_group(&self, signal: &str) {
        let _ = Command::new("kill")
            .args([signal, "--", &format!("-{}", self.0.id())])
            .stderr(Stdio::null())
            .status();
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        self.signal_group("-TERM");
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.signal_group("-KILL");
        let _ = self.0.wait();
    }
}

/// Runs one step in a process group of its own, stopping it (and failing)
/// if it takes over [`STEP_LIMIT`].
fn run_limited(step: &str, mut command: Command) -> Result<(), String> {
    eprintln!("xtask: == {step}");
    let mut process = Group::spawn(step, &mut command)?;
    let deadline = Instant::now() + STEP_LIMIT;
    loop {
        match process.0.try_wait() {
            Ok(Some(status)) if status.success() => return Ok(()),
            Ok(Some(status)) => return Err(format!("{step} failed ({status})")),
            Ok(None) if Instant::now() > deadline => {
                return Err(format!(
                    "{step} did not finish within {} s; stopped",
                    STEP_LIMIT.as_secs()
                ));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(100)),
            Err(error) => return Err(format!("{step}: {error}")),
        }
    }
}

/// The launcher over two engine-sim engines, and the OpenAI client through it.
fn end_to_end(venv: &Path, binary: &Path) -> Result<(), String> {
    // The test profile builds into target/debug.
    let engine_sim = target_dir().join("debug").join("engine-sim");
    let (engines_a, a) = start_engines_of(&engine_sim, "sglang", &["--seed", "1"])?;
    let (engines_b, b) = start_engines_of(&engine_sim, "sglang", &["--seed", "2"])?;
    let _engines = [engines_a, engines_b];
    let workers: Vec<String> = a.iter().chain(&b).map(|(http, _)| http.clone()).collect();

    let port = free_ports(2)?;
    let metrics_port = port + 1;
    let mut launch = venv_python(venv)?;
    launch
        .args(["-m", "llm_router.launch_router", "--worker-urls"])
        .args(&workers)
        .args(["--policy", "cache_aware", "--host", "127.0.0.1"])
        .args(["--port", &port.to_string()])
        .args(["--prometheus-port", &metrics_port.to_string()])
        .args([
            "--request-timeout-secs",
            "120",
            "--max-payload-size",
            "67108864",
        ])
        .args([
            "--health-check-interval-secs",
            "1",
            "--api-key",
            "sk-xtask-e2e",
        ])
        .args(["--log-level", "warning"])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    eprintln!(
        "xtask: == python -m llm_router.launch_router --worker-urls {} --policy cache_aware --port {port} --prometheus-port {metrics_port} ... (PATH without cargo)",
        workers.join(" ")
    );
    let mut router = Process::spawn("llm_router.launch_router", &mut launch)?;
    wait_for(
        "the launched router and its workers",
        Duration::from_secs(60),
        || {
            if let Ok(Some(status)) = router.child.try_wait() {
                return Err(format!("the launched router exited early ({status})"));
            }
            if http_status(port, "/health") != Some(200) {
                return Ok(false);
            }
            let in_rotation = router_workers(port)?
                .unwrap_or_default()
                .iter()
                .filter(|worker| {
                    worker
                        .get("in_rotation")
                        .and_then(serde_json::Value::as_bool)
                        == Some(true)
                })
                .count();
            Ok(in_rotation == workers.len())
        },
    )?;
    // The launcher exec'd: its process is now the wheel's binary.
    let pid = router.child.id();
    let running = std::fs::read_link(format!("/proc/{pid}/exe"))
        .map_err(|error| format!("/proc/{pid}/exe: {error}"))?;
    if canonical(&running)? != binary {
        return Err(format!(
            "the launched process runs {}, not the wheel's binary {}",
            running.display(),
            binary.display()
        ));
    }
    if ["release", "debug"]
        .iter()
        .any(|profile| running.starts_with(target_dir().join(profile)))
    {
        return Err(format!(
            "the launched router is a cargo build: {}",
            running.display()
        ));
    }
    eprintln!(
        "xtask: == process {pid} is the wheel's router ({})",
        running.display()
    );

    let mut client = venv_python(venv)?;
    client
        .arg(tests_dir().join("openai_e2e.py"))
        .args(["--router", &format!("http://127.0.0.1:{port}")])
        .args([
            "--metrics",
            &format!("http://127.0.0.1:{metrics_port}/metrics"),
        ])
        .arg("--workers")
        .args(&workers);
    run_limited(
        "openai_e2e.py: the OpenAI client through the router",
        client,
    )?;
    drop(router);
    Ok(())
}
