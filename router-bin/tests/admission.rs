//! The order of service at saturation, through the `router` binary as a
//! process in front of a simulated engine (`mock-engines`, what
//! `engine-sim serve` runs): two tenants and two priorities wait in the
//! router's admission queue and reach the engine in the room's order.

// Test helpers outside #[test] functions fail loudly on purpose.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::wait_until;
use futures::StreamExt;
use mock_engines::{Flavour, SimEngineConfig};

struct RouterProcess {
    child: Child,
    base: String,
    config: std::path::PathBuf,
}

impl Drop for RouterProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.config);
    }
}

/// How one request went: who sent it, and when its first token came.
#[derive(Debug)]
struct Served {
    label: String,
    first_token_after: Duration,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_tenants_and_two_priorities_are_served_in_the_room_s_order() {
    // 2000 prompt tokens a second: the blocker's prefill takes about 4 s,
    // each queued request's about 0.2 s.
    let mut engine = SimEngineConfig::new(Flavour::Sglang);
    engine.params.prefill_tps = 2000.0;
    engine.params.prefix_cache = false;
    let fleet = mock_engines::start(vec![engine]).await.unwrap();
    let engine_url = format!("http://{}", fleet.engines()[0].http_addr);

    let port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port()
    };
    // One request at a time may wait for its first token at the worker
    // (the cap); the rest wait in the router, in fair-share order.
    let text = format!(
        "[server]\nport = {port}\n\
         [policy]\nkind = \"least_load\"\n[policy.least_load]\nmax_waiting_requests = 1\n\
         [admission]\norder = \"fair_share\"\ntenant_header = \"x-tenant\"\n\
         [load_monitor]\ninterval_ms = 200\ntimeout_ms = 500\nstale_after_ms = 1000\n\
         [health]\ninterval_ms = 200\ntimeout_ms = 500\n\
         [[workers]]\nurl = \"{engine_url}\"\nbackend = \"sglang\"\n"
    );
    let config = std::env::temp_dir().join(format!(
        "router-admission-{}-{port}.toml",
        std::process::id()
    ));
    std::fs::write(&config, text).unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_router"));
    command
        .arg("--config")
        .arg(&config)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    for (name, _) in std::env::vars() {
        if name.starts_with("ROUTER__") {
            command.env_remove(name);
        }
    }
    let router = RouterProcess {
        child: command.spawn().unwrap(),
        base: format!("http://127.0.0.1:{port}"),
        config,
    };
    let client = reqwest::Client::new();
    wait_until("the router has its worker in rotation", || async {
        let Ok(response) = client
            .get(format!("{}/admin/workers", router.base))
            .send()
            .await
        else {
            return false;
        };
        let listing: serde_json::Value = response.json().await.unwrap_or_default();
        listing["workers"][0]["in_rotation"] == true
    })
    .await;
    let queued = || async {
        let view: serde_json::Value = client
            .get(format!("{}/admin/admission", router.base))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        view["queue"]["queued_requests"].as_u64().unwrap()
    };

    let start = tokio::time::Instant::now();
    let send = |label: String, tenant: &str, priority: i64, prompt_tokens: usize| {
        let request = client
            .post(format!("{}/v1/chat/completions", router.base))
            .header("x-tenant", tenant)
            .header("x-request-priority", priority.to_string())
            .json(&serde_json::json!({
                "model": "sim-model",
                "stream": true,
                "max_tokens": 2,
                // 4 characters a token, as the router and the engine count.
                "messages": [{"role": "user", "content": "word".repeat(prompt_tokens)}],
            }));
        tokio::spawn(async move {
            let response = request.send().await.unwrap();
            assert_eq!(response.status(), 200, "{label}");
            let mut body = response.bytes_stream();
            let mut first_token_after = None;
            while let Some(piece) = body.next().await {
                let piece = piece.unwrap();
                if first_token_after.is_none() && piece.windows(5).any(|w| w == b"data:") {
                    first_token_after = Some(start.elapsed());
                }
            }
            Served {
                label,
                first_token_after: first_token_after.unwrap(),
            }
        })
    };

    let blocker = send("blocker".into(), "a", 1, 8000);
    wait_until("the blocker is at the engine", || async {
        let listing: serde_json::Value = client
            .get(format!("{}/admin/workers", router.base))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        listing["workers"][0]["in_flight"] == 1
    })
    .await;
    // Tenant a's batch backlog first, then tenant b's batch, then a's
    // urgent requests: each waits behind what came before it in time.
    let mut tasks = Vec::new();
    for (label, tenant, priority, count) in [
        ("a-batch", "a", 1, 6),
        ("b-batch", "b", 1, 2),
        ("a-urgent", "a", 0, 2),
    ] {
        for index in 0..count {
            tasks.push(send(format!("{label}-{index}"), tenant, priority, 400));
            let expected = tasks.len() as u64;
            wait_until("the request waits", || async { queued().await == expected }).await;
        }
    }
    let mut served = vec![blocker.await.unwrap()];
    for task in tasks {
        served.push(task.await.unwrap());
    }
    served.sort_by_key(|served| served.first_token_after);
    let order: Vec<&str> = served.iter().map(|s| s.label.as_str()).collect();
    assert_eq!(order[0], "blocker", "{order:?}");
    // The urgent class goes first, though it came last.
    assert!(
        order[1].starts_with("a-urgent") && order[2].starts_with("a-urgent"),
        "{order:?}"
    );
    // Within the batch class the tenants alternate: b waits behind at most
    // one of a's requests, not behind a's whole backlog.
    let b_places: Vec<usize> = order
        .iter()
        .enumerate()
        .filter(|(_, label)| label.starts_with("b-batch"))
        .map(|(place, _)| place)
        .collect();
    // (b may even go first: a's blocker's generated tokens count to a.)
    assert!(
        b_places.len() == 2 && b_places[0] <= 4 && b_places[1] <= 6,
        "{order:?}"
    );
    drop(fleet);
}
