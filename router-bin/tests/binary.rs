//! The `router` binary as a process: config errors, --print-config, SIGHUP.

// Test helpers outside #[test] functions fail loudly on purpose.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::process::{Command, Stdio};

use common::wait_until;
use mock_engines::{Flavour, SimEngineConfig};

fn router() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_router"));
    command.env_remove("RUST_LOG");
    for (name, _) in std::env::vars() {
        if name.starts_with("ROUTER__") {
            command.env_remove(name);
        }
    }
    command
}

/// A file in the temp directory, removed when dropped.
struct TempFile(std::path::PathBuf);

impl AsRef<std::path::Path> for TempFile {
    fn as_ref(&self) -> &std::path::Path {
        &self.0
    }
}

impl AsRef<std::ffi::OsStr> for TempFile {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.0.as_os_str()
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn temp_file(name: &str, text: &str) -> TempFile {
    let path = std::env::temp_dir().join(format!("router-bin-{}-{name}", std::process::id()));
    std::fs::write(&path, text).unwrap();
    TempFile(path)
}

fn stderr_of(command: &mut Command) -> (i32, String) {
    let output = command.output().unwrap();
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn invalid_config_files_and_flags_give_the_exact_error() {
    let bad_relation = temp_file("relation.toml", "[load_monitor]\ninterval_ms = 4000\n");
    let (code, stderr) = stderr_of(
        router()
            .arg("--config")
            .arg(&bad_relation)
            .arg("--print-config"),
    );
    assert_eq!(code, 2);
    assert_eq!(
        stderr.trim(),
        "router: invalid load_monitor.stale_after_ms = 3000: must be greater than load_monitor.interval_ms (4000)"
    );

    let (code, stderr) =
        stderr_of(router().args(["--worker", "tokenspeed=http://h:8000", "--print-config"]));
    assert_eq!(code, 2);
    assert_eq!(
        stderr.trim(),
        "router: invalid workers[0].load_url = none: must be a grpc://host:port address (required by this backend)"
    );

    let (code, stderr) = stderr_of(router().args(["--policy", "fastest", "--print-config"]));
    assert_eq!(code, 2);
    assert_eq!(
        stderr.trim(),
        "router: invalid policy configuration: unknown policy \"fastest\"; valid policies: cache_aware, consistent_hash, least_load, least_requests, power_of_two, random, round_robin"
    );

    let (code, stderr) =
        stderr_of(router().args(["--least-load-kv-pressure-weight", "-1", "--print-config"]));
    assert_eq!(code, 2);
    assert_eq!(
        stderr.trim(),
        "router: invalid policy configuration: least_load.kv_pressure_weight = -1 is invalid: must be a finite number of seconds >= 0"
    );

    let (code, stderr) = stderr_of(router().args(["--config", "/nonexistent.toml"]));
    assert_eq!(code, 2);
    assert_eq!(
        stderr.trim(),
        "router: config file /nonexistent.toml does not exist"
    );

    let (code, _) = stderr_of(router().args(["--port", "seventy"]));
    assert_eq!(code, 2, "clap rejects a non-number");
}

#[test]
fn print_config_shows_the_effective_config() {
    let output = router()
        .args([
            "--port",
            "9123",
            "--worker",
            "vllm=http://127.0.0.1:8000",
            "--print-config",
        ])
        .env("ROUTER__LOAD_MONITOR__INTERVAL_MS", "250")
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let text = String::from_utf8(output.stdout).unwrap();
    let printed: toml::Value = toml::from_str(&text).unwrap();
    assert_eq!(printed["server"]["port"].as_integer(), Some(9123));
    assert_eq!(
        printed["load_monitor"]["interval_ms"].as_integer(),
        Some(250)
    );
    assert_eq!(printed["workers"][0]["backend"].as_str(), Some("vllm"));
    assert_eq!(
        printed["policy"]["least_load"]["kv_pressure_weight"].as_float(),
        Some(0.15)
    );
}

#[test]
fn the_example_config_is_valid() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/router.example.toml");
    let output = router()
        .args(["--config", path, "--print-config"])
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_rereads_the_policy_section() {
    let engines = mock_engines::start_many(&SimEngineConfig::new(Flavour::Sglang), 1)
        .await
        .unwrap();
    let engine_url = engines.engines()[0].http_url();
    let port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port()
    };
    let file = temp_file(
        "sighup.toml",
        &format!(
            "[server]\nport = {port}\n[policy]\nkind = \"round_robin\"\n[[workers]]\nurl = \"{}\"\nbackend = \"sglang\"\n",
            engine_url
        ),
    );
    let mut child = router()
        .arg("--config")
        .arg(&file)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The router's log lines, as they come.
    let (log_tx, log_rx) = std::sync::mpsc::channel::<String>();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            let _ = log_tx.send(line);
        }
    });
    let client = reqwest::Client::new();
    let policy_url = format!("http://127.0.0.1:{port}/admin/policy");
    let kind = || async {
        match client.get(&policy_url).send().await {
            Ok(response) => response
                .json::<serde_json::Value>()
                .await
                .ok()
                .map(|policy| policy["kind"].clone()),
            Err(_) => None,
        }
    };
    wait_until("the router is up with round_robin", || async {
        kind().await == Some("round_robin".into())
    })
    .await;

    // A broken section is rejected and the old policy kept.
    std::fs::write(
        &file,
        format!("[server]\nport = {port}\n[policy]\nkind = \"nope\"\n"),
    )
    .unwrap();
    let hup = |pid: u32| {
        Command::new("kill")
            .args(["-HUP", &pid.to_string()])
            .status()
            .unwrap()
    };
    assert!(hup(child.id()).success());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let line = log_rx
            .recv_timeout(deadline.saturating_duration_since(std::time::Instant::now()))
            .expect("the router logs the rejected reload");
        if line.contains("policy reload rejected") {
            assert!(line.contains("unknown policy"), "{line}");
            break;
        }
    }
    assert_eq!(
        kind().await,
        Some("round_robin".into()),
        "the old policy is kept"
    );
    // Then a valid one is applied.
    std::fs::write(
        &file,
        format!("[server]\nport = {port}\n[policy]\nkind = \"least_requests\"\n"),
    )
    .unwrap();
    assert!(hup(child.id()).success());
    wait_until("SIGHUP swapped in least_requests", || async {
        kind().await == Some("least_requests".into())
    })
    .await;
    assert_eq!(kind().await, Some("least_requests".into()));

    // SIGTERM: a clean exit.
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}");
    engines.shutdown().await;
}

/// A child process killed when dropped, so a failed assertion leaves no
/// router running.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    probe.local_addr().unwrap().port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_can_have_a_listener_of_their_own() {
    let engines = mock_engines::start_many(&SimEngineConfig::new(Flavour::Sglang), 1)
        .await
        .unwrap();
    let engine_url = engines.engines()[0].http_url();
    let (port, metrics_port) = (free_port(), free_port());
    let mut child = KillOnDrop(
        router()
            .args(["--port", &port.to_string(), "--policy", "round_robin"])
            .args(["--worker", &format!("sglang={engine_url}")])
            .env("ROUTER__SERVER__METRICS_PORT", metrics_port.to_string())
            .env("ROUTER__SERVER__METRICS_HOST", "127.0.0.1")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let client = reqwest::Client::new();
    let main = format!("http://127.0.0.1:{port}");
    let metrics = format!("http://127.0.0.1:{metrics_port}");
    let status = |url: String| {
        let client = client.clone();
        async move {
            match client.get(&url).send().await {
                Ok(response) => Some(response.status().as_u16()),
                Err(_) => None,
            }
        }
    };
    wait_until("both listeners answer", || async {
        status(format!("{main}/health")).await == Some(200)
            && status(format!("{metrics}/metrics")).await == Some(200)
    })
    .await;
    // A request through the main listener shows on the metrics listener.
    let answer = client
        .post(format!("{main}/v1/completions"))
        .json(&serde_json::json!({"model": "m", "prompt": "hello", "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status().as_u16(), 200);
    let text = client
        .get(format!("{metrics}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(text.contains("router_requests_total"), "{text}");
    assert_eq!(
        status(format!("{main}/metrics")).await,
        Some(404),
        "/metrics moved to its own listener"
    );
    assert_eq!(status(format!("{metrics}/health")).await, Some(404));
    let proxied = client
        .post(format!("{metrics}/v1/completions"))
        .json(&serde_json::json!({"model": "m", "prompt": "hello", "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(
        proxied.status().as_u16(),
        404,
        "the metrics listener proxies nothing"
    );

    Command::new("kill")
        .args(["-TERM", &child.0.id().to_string()])
        .status()
        .unwrap();
    let exited = child.0.wait().unwrap();
    assert!(exited.success(), "{exited}");
    engines.shutdown().await;
}

#[test]
fn a_taken_metrics_port_is_an_error_at_start() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let metrics_port = taken.local_addr().unwrap().port();
    let (code, stderr) = stderr_of(
        router()
            .args(["--port", &free_port().to_string()])
            .env("ROUTER__SERVER__METRICS_PORT", metrics_port.to_string()),
    );
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains(&format!("could not bind 127.0.0.1:{metrics_port}")),
        "{stderr}"
    );
}
