//! The `engine-sim serve` binary: one JSON line per engine, engines on
//! consecutive ports, a clean stop on SIGTERM.

// Test helpers (not only #[test] fns) may unwrap: a panic is a failed assertion.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(20);

/// A base port with `count` free ports after it (checked by binding them).
fn free_base_port(count: u16) -> u16 {
    for _ in 0..100 {
        let probe = TcpListener::bind("127.0.0.1:0").unwrap();
        let base = probe.local_addr().unwrap().port();
        drop(probe);
        if base > u16::MAX - count {
            continue;
        }
        let all_free = (0..count).all(|i| TcpListener::bind(("127.0.0.1", base + i)).is_ok());
        if all_free {
            return base;
        }
    }
    panic!("no run of free ports found");
}

#[test]
fn serve_prints_one_line_per_engine_and_stops_on_sigterm() {
    let http_base = free_base_port(2);
    let grpc_base = free_base_port(2);
    let mut child = Command::new(env!("CARGO_BIN_EXE_engine-sim"))
        .args([
            "serve",
            "--flavour",
            "vllm",
            "--count",
            "2",
            "--base-port",
            &http_base.to_string(),
            "--grpc-base-port",
            &grpc_base.to_string(),
            "--time-scale",
            "100",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    for index in 0..2u16 {
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        let expected = format!(
            "{{\"index\":{index},\"flavour\":\"vllm\",\"http\":\"http://127.0.0.1:{}\",\"grpc\":\"grpc://127.0.0.1:{}\"}}\n",
            http_base + index,
            grpc_base + index
        );
        assert_eq!(line, expected);
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let text = reqwest::get(format!("http://127.0.0.1:{}/metrics", http_base + 1))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(text.contains("vllm:num_requests_running{"));
    });

    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    // A waiter thread reports the exit; the test waits on it with a deadline.
    let (exited_tx, exited) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = exited_tx.send(child.wait());
    });
    let status = exited
        .recv_timeout(DEADLINE)
        .expect("engine-sim did not stop")
        .unwrap();
    assert!(status.success(), "{status:?}");
}

#[test]
fn tokenspeed_needs_a_grpc_base_port() {
    let output = Command::new(env!("CARGO_BIN_EXE_engine-sim"))
        .args([
            "serve",
            "--flavour",
            "tokenspeed",
            "--count",
            "1",
            "--base-port",
            "1",
        ])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("grpc"), "{stderr}");
}

#[test]
fn serve_takes_the_new_faults_and_the_first_byte_delay() {
    // A 1 ms first-byte delay: answered well inside a client timeout shorter
    // than the 5 s default, so the flag reached the engine.
    let mut child = Command::new(env!("CARGO_BIN_EXE_engine-sim"))
        .args([
            "serve",
            "--flavour",
            "sglang-metrics",
            "--base-port",
            "0",
            "--time-scale",
            "100",
            "--fault",
            "slow-first-byte",
            "--slow-first-byte-ms",
            "1",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    let engine: serde_json::Value = serde_json::from_str(&line).unwrap();
    let url = engine["http"].as_str().unwrap().to_owned();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(4))
            .build()
            .unwrap();
        let answered = client
            .post(format!("{url}/v1/completions"))
            .json(&serde_json::json!({"prompt": "x", "max_tokens": 2}))
            .send()
            .await
            .unwrap();
        assert_eq!(answered.status(), 200);
        assert_eq!(
            client
                .get(format!("{url}/health_generate"))
                .send()
                .await
                .unwrap()
                .status(),
            200
        );
        let switched = client
            .post(format!("{url}/control/fault"))
            .json(&serde_json::json!({"mode": "generation-500"}))
            .send()
            .await
            .unwrap();
        assert_eq!(switched.status(), 200);
        let stats: serde_json::Value = client
            .get(format!("{url}/control/stats"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(
            stats,
            serde_json::json!({
                "generation_requests": 1,
                "health_generate_requests": 1,
                "fault": "generation-500",
            })
        );
    });
    child.kill().unwrap();
    let _ = child.wait();
}

#[test]
fn serve_refuses_an_unknown_fault_and_lists_the_new_ones_in_help() {
    let output = Command::new(env!("CARGO_BIN_EXE_engine-sim"))
        .args(["serve", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&output.stdout);
    for name in [
        "hang-mid-stream",
        "generation-500",
        "slow-first-byte",
        "--slow-first-byte-ms",
    ] {
        assert!(help.contains(name), "{help}");
    }
    let output = Command::new(env!("CARGO_BIN_EXE_engine-sim"))
        .args([
            "serve",
            "--flavour",
            "sglang",
            "--base-port",
            "0",
            "--fault",
            "explode",
        ])
        .output()
        .unwrap();
    assert!(!output.status.success());
}
