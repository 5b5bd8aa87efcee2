//! The router built from outside its crates, end to end: stand-in
//! `jsonstats` engines on loopback, the router built by `RouterBuilder` with
//! this crate's backend and policy, real HTTP requests through it.
//!
//! - the engines' made-up JSON reaches `/admin/workers` converted;
//! - chat requests, streaming and not, are answered through the router;
//! - `least_kv`'s `max_kv_usage_ratio` decides where held requests go,
//!   counted at the engines, before and after a policy swap;
//! - `/admin/policy` shows `least_kv` with its knobs;
//! - a bad backend name or knob is a config error naming the valid ones; a
//!   hostile `/stats` body is a poll failure, and the router keeps routing;
//! - the `custom-router` binary is the router's command line with both.
//!
//! Every wait has a deadline; no duration is asserted.

// Helpers outside #[test] functions may unwrap too: a panic is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use custom_router::{JsonStats, KvCacheStats, QueueStats, StatsEngine, serve_stats_engine};
use policy_core::error_chain;
use router::config::Layers;
use router::{ConfigError, RouterBuilder};
use serde_json::{Value, json};
use tokio::sync::oneshot;

/// Polls, health checks and staleness fast enough for a test.
const FAST: &str = "[load_monitor]\ninterval_ms = 50\ntimeout_ms = 500\nstale_after_ms = 2000\n\
    [health]\ninterval_ms = 100\ntimeout_ms = 500\nfailure_threshold = 3\nsuccess_threshold = 1\n";

/// 400 tokens at the default 4 characters per token.
const PROMPT_CHARS_400_TOKENS: usize = 1600;

fn stats(kv_used_blocks: i64) -> JsonStats {
    JsonStats {
        queue: QueueStats {
            requests: 0,
            prompt_tokens: Some(0),
        },
        running: 0,
        kv_cache: KvCacheStats {
            used_blocks: kv_used_blocks,
            total_blocks: 1000,
        },
        decode_tps: Some(1000.0),
    }
}

async fn engine(stats: JsonStats) -> StatsEngine {
    serve_stats_engine("127.0.0.1:0", stats).await.unwrap()
}

/// A TOML file in the temp dir, removed on drop.
struct TempToml(PathBuf);

impl TempToml {
    fn new(text: &str) -> TempToml {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let path = std::env::temp_dir().join(format!(
            "custom-router-{}-{}.toml",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&path, text).unwrap();
        TempToml(path)
    }
}

impl Drop for TempToml {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// `[[workers]]` entries of backend `jsonstats`, one per engine.
fn workers_toml(engines: &[&StatsEngine]) -> String {
    engines
        .iter()
        .map(|engine| {
            format!(
                "[[workers]]\nurl = \"{}\"\nbackend = \"jsonstats\"\n",
                engine.url()
            )
        })
        .collect()
}

/// What the `custom-router` binary builds: the built-ins plus this crate's.
fn builder() -> RouterBuilder {
    let mut builder = RouterBuilder::with_builtins();
    custom_router::register(&mut builder);
    builder
}

fn load_config(text: &str) -> Result<router::RouterConfig, ConfigError> {
    let file = TempToml::new(text);
    builder().load_config(Layers {
        file: Some(&file.0),
        ..Layers::default()
    })
}

/// A router serving on `127.0.0.1:<ephemeral>`, stopped on drop.
struct TestRouter {
    /// The workers in its config.
    workers: usize,
    base: String,
    client: reqwest::Client,
    stop: Option<oneshot::Sender<()>>,
}

impl Drop for TestRouter {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Loads `config_text` through the builder's config layers, starts the
/// router and serves it, as `router_bin::main` does.
async fn start_router(config_text: &str) -> TestRouter {
    let builder = builder();
    let config = {
        let file = TempToml::new(config_text);
        builder
            .load_config(Layers {
                file: Some(&file.0),
                ..Layers::default()
            })
            .unwrap()
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let workers = config.workers.len();
    let app = builder.start(config, None).await.unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(router::serve(app, listener, async {
        let _ = stopped.await;
    }));
    TestRouter {
        workers,
        base,
        client: reqwest::Client::new(),
        stop: Some(stop),
    }
}

/// Waits until `condition` holds, checking every 20 ms, for at most 20 s
/// (generous: a loaded 2-core machine). Panics with `what` on timeout.
async fn wait_until<F, Fut>(what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        if condition().await {
            return;
        }
        if tokio::time::Instant::now() > deadline {
            panic!("timed out waiting until {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

impl TestRouter {
    async fn get_json(&self, path: &str) -> Value {
        let response = self
            .client
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "GET {path}");
        response.json().await.unwrap()
    }

    /// `/admin/workers`'s entry for the worker at `url`.
    async fn worker(&self, url: &str) -> Value {
        self.get_json("/admin/workers").await["workers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|worker| worker["url"] == url)
            .cloned()
            .unwrap_or_else(|| panic!("no worker {url}"))
    }

    /// Until every worker is in rotation with a load report.
    async fn until_all_reported(&self) {
        wait_until("every worker is in rotation with a load report", || async {
            let workers = self.get_json("/admin/workers").await;
            let workers = workers["workers"].as_array().unwrap().clone();
            workers.len() == self.workers
                && workers
                    .iter()
                    .all(|worker| worker["in_rotation"] == true && !worker["load"].is_null())
        })
        .await;
    }

    /// One chat request of `prompt_chars` characters; the answer's text.
    async fn chat(&self, prompt_chars: usize, stream: bool) -> String {
        let response = self
            .client
            .post(format!("{}/v1/chat/completions", self.base))
            .json(&json!({
                "model": custom_router::STATS_ENGINE_MODEL,
                "stream": stream,
                "messages": [{"role": "user", "content": "x".repeat(prompt_chars)}],
            }))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let content_type = response.headers()[reqwest::header::CONTENT_TYPE].clone();
        let body = response.text().await.unwrap();
        if stream {
            assert_eq!(content_type, "text/event-stream");
            assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
            body.lines()
                .filter_map(|line| line.strip_prefix("data: "))
                .filter(|data| *data != "[DONE]")
                .map(|data| {
                    let chunk: Value = serde_json::from_str(data).unwrap();
                    chunk["choices"][0]["delta"]["content"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned()
                })
                .collect()
        } else {
            let answer: Value = serde_json::from_str(&body).unwrap();
            assert_eq!(answer["object"], "chat.completion");
            answer["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_owned()
        }
    }

    /// Sends `count` 400-token requests (streaming and not, alternately) at
    /// once while every engine holds them, waits until the engines have
    /// them all, and returns how many each engine got; then lets them be
    /// answered and checks every answer.
    async fn held_burst(&self, engines: &[&StatsEngine], count: u64) -> Vec<u64> {
        let before: Vec<u64> = engines.iter().map(|e| e.generations_received()).collect();
        for engine in engines {
            engine.hold();
        }
        let all = futures::future::join_all(
            (0..count).map(|index| self.chat(PROMPT_CHARS_400_TOKENS, index % 2 == 0)),
        );
        let counted = async {
            wait_until("every held request reached an engine", || async {
                let received: u64 = engines.iter().map(|e| e.generations_received()).sum();
                received - before.iter().sum::<u64>() == count
            })
            .await;
            let got: Vec<u64> = engines
                .iter()
                .zip(&before)
                .map(|(engine, before)| engine.generations_received() - before)
                .collect();
            // While held, the router counts their prompts as pending.
            let pending: u64 = self.get_json("/admin/workers").await["workers"]
                .as_array()
                .unwrap()
                .iter()
                .map(|worker| worker["pending_tokens"].as_u64().unwrap())
                .sum();
            assert_eq!(pending, 400 * count);
            for engine in engines {
                engine.release();
            }
            got
        };
        let (answers, got) = tokio::join!(all, counted);
        for answer in answers {
            assert!(answer.starts_with("served by 127.0.0.1:"), "{answer}");
        }
        got
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_kv_routes_jsonstats_engines_end_to_end() {
    // `a` reports the brief's example; `c`'s cache is over the limit.
    let a = engine(JsonStats {
        queue: QueueStats {
            requests: 3,
            prompt_tokens: Some(1200),
        },
        running: 5,
        kv_cache: KvCacheStats {
            used_blocks: 100,
            total_blocks: 1000,
        },
        decode_tps: Some(850.0),
    })
    .await;
    let b = engine(stats(200)).await;
    let c = engine(stats(700)).await;
    let engines = [&a, &b, &c];
    let router = start_router(&format!(
        "{FAST}[policy]\nkind = \"least_kv\"\n\
         [policy.least_kv]\nmax_kv_usage_ratio = 0.6\npending_weight = 1.0\nkv_capacity_tokens = 1000\n\
         {}",
        workers_toml(&engines)
    ))
    .await;
    router.until_all_reported().await;

    // The made-up JSON, converted: one rank in the router's own shape.
    let worker = router.worker(&a.url()).await;
    assert_eq!(worker["backend"], "jsonstats");
    assert_eq!(worker["poll_failures"], 0);
    let rank = &worker["load"]["loads"][0];
    assert_eq!(worker["load"]["loads"].as_array().unwrap().len(), 1);
    assert_eq!(rank["num_waiting_reqs"], 3);
    assert_eq!(rank["num_waiting_uncached_tokens"], 1200);
    assert_eq!(rank["num_running_reqs"], 5);
    assert_eq!(rank["num_total_reqs"], 8);
    assert_eq!(rank["token_usage"], 0.1);
    assert_eq!(rank["gen_throughput"], 850.0);
    assert_eq!(
        router.worker(&c.url()).await["load"]["loads"][0]["token_usage"],
        0.7
    );
    assert!(a.stats_requests() > 0, "the router polled GET /stats");

    // The policy and its knobs.
    assert_eq!(
        router.get_json("/admin/policy").await,
        json!({"kind": "least_kv", "params": {
            "max_kv_usage_ratio": 0.6, "pending_weight": 1.0, "kv_capacity_tokens": 1000}})
    );
    let explain = router
        .client
        .get(format!("{}/admin/policy/explain?tokens=400", router.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(explain.starts_with("policy: least_kv"), "{explain}");
    assert!(
        explain.contains("over max_kv_usage_ratio: skipped"),
        "{explain}"
    );

    // Requests, streaming and not, answered through the router; none at `c`.
    for index in 0..6 {
        let answer = router.chat(100, index % 2 == 1).await;
        assert!(answer.starts_with("served by 127.0.0.1:"), "{answer}");
    }
    assert_eq!(c.generations_received(), 0);
    assert_eq!(a.generations_answered() + b.generations_answered(), 6);

    // Eight 400-token requests held at once: each adds 0.4 of a 1000-token
    // cache to its worker's score, so `a` and `b` pass `c`'s 0.7 after two
    // each; `c` is over max_kv_usage_ratio = 0.6 and still gets none.
    let got = router.held_burst(&engines, 8).await;
    assert_eq!(got[2], 0, "over the limit, skipped: {got:?}");
    assert_eq!(got[0] + got[1], 8);

    // The knob is what kept `c` out: with skipping off, `c` takes its share.
    let swapped = router
        .client
        .put(format!("{}/admin/policy", router.base))
        .json(&json!({"kind": "least_kv", "least_kv": {
            "max_kv_usage_ratio": 1.0, "pending_weight": 1.0, "kv_capacity_tokens": 1000}}))
        .send()
        .await
        .unwrap();
    assert_eq!(swapped.status(), 200);
    assert_eq!(
        swapped.json::<Value>().await.unwrap()["params"]["max_kv_usage_ratio"],
        1.0
    );
    let got = router.held_burst(&engines, 8).await;
    assert!(got[2] >= 1, "no longer skipped: {got:?}");
    assert_eq!(got.iter().sum::<u64>(), 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_reports_are_poll_failures_and_routing_goes_on() {
    let good = engine(stats(100)).await;
    let bad = engine(stats(100)).await;
    let router = start_router(&format!(
        "{FAST}[policy]\nkind = \"least_kv\"\n{}",
        workers_toml(&[&good, &bad])
    ))
    .await;
    router.until_all_reported().await;
    let bad_url = bad.url();

    for (what, body) in [
        ("malformed JSON", r#"{"queue": {"requests": 1"#.to_owned()),
        (
            "a negative count",
            r#"{"queue": {"requests": -4}, "running": 0, "kv_cache": {"used_blocks": 0, "total_blocks": 10}}"#
                .to_owned(),
        ),
        (
            "NaN as Python writes it",
            r#"{"queue": {"requests": 0}, "running": 0, "kv_cache": {"used_blocks": 0, "total_blocks": 10}, "decode_tps": NaN}"#
                .to_owned(),
        ),
        (
            "blocks in use out of none",
            r#"{"queue": {"requests": 0}, "running": 0, "kv_cache": {"used_blocks": 5, "total_blocks": 0}}"#
                .to_owned(),
        ),
        ("the wrong shape", "[1, 2, 3]".to_owned()),
    ] {
        bad.set_raw_stats(body);
        wait_until(&format!("{what} shows as poll failures"), || async {
            router.worker(&bad_url).await["poll_failures"]
                .as_u64()
                .unwrap()
                >= 2
        })
        .await;
        // The worker keeps serving; the router keeps routing.
        let worker = router.worker(&bad_url).await;
        assert_eq!(worker["in_rotation"], true, "{what}: {worker}");
        for stream in [false, true] {
            let answer = router.chat(100, stream).await;
            assert!(answer.starts_with("served by"), "{what}: {answer}");
        }
        // A good report again clears the failures.
        bad.set_stats(&stats(100));
        wait_until(&format!("polls recover after {what}"), || async {
            router.worker(&bad_url).await["poll_failures"] == 0
        })
        .await;
    }
    assert_eq!(
        router.worker(&good.url()).await["poll_failures"],
        0,
        "the good engine was never affected"
    );
}

#[test]
fn config_errors_name_the_valid_choices() {
    let worker = "[[workers]]\nurl = \"http://127.0.0.1:31001\"\n";
    let with_policy = |policy: &str| format!("{policy}{worker}backend = \"jsonstats\"\n");

    // A backend name that is not registered lists the registered ones, ours
    // among the built-ins.
    let error = load_config(&format!("{worker}backend = \"jsonstat\"\n")).unwrap_err();
    assert_eq!(
        error.to_string(),
        "invalid workers[0].backend = \"jsonstat\": must be one of jsonstats, sglang, \
         sglang-grpc, tokenspeed, vllm, vllm-grpc"
    );

    // Knobs out of range, unknown knobs, unknown policies.
    for (section, expected) in [
        (
            "[policy]\nkind = \"least_kv\"\n[policy.least_kv]\nmax_kv_usage_ratio = 1.5\n",
            "invalid policy configuration: least_kv.max_kv_usage_ratio = 1.5 is invalid: \
             must be a ratio in (0, 1]",
        ),
        (
            "[policy]\nkind = \"least_kv\"\n[policy.least_kv]\npending_weight = -2.0\n",
            "invalid policy configuration: least_kv.pending_weight = -2 is invalid: \
             must be a finite number >= 0",
        ),
        (
            // Checked even while another policy is active.
            "[policy]\nkind = \"round_robin\"\n[policy.least_kv]\nkv_capacity_tokens = -1\n",
            "invalid policy configuration: least_kv.kv_capacity_tokens = -1 is invalid: \
             must be an integer number of tokens >= 1",
        ),
        (
            "[policy]\nkind = \"least_kv\"\n[policy.least_kv]\nmax_kv = 0.9\n",
            "invalid policy configuration: invalid [least_kv] section: unknown field `max_kv`, \
             expected one of `max_kv_usage_ratio`, `pending_weight`, `kv_capacity_tokens`",
        ),
        (
            "[policy]\nkind = \"least_kvv\"\n",
            "invalid policy configuration: unknown policy \"least_kvv\"; valid policies: \
             cache_aware, consistent_hash, least_kv, least_load, least_requests, power_of_two, \
             random, round_robin",
        ),
    ] {
        let error = load_config(&with_policy(section)).unwrap_err();
        assert_eq!(error_chain(&error), expected, "{section}");
    }

    // The demo config in this crate's README loads, every knob filled in.
    let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("router.toml");
    let config = builder()
        .load_config(Layers {
            file: Some(&demo),
            ..Layers::default()
        })
        .unwrap();
    assert_eq!(config.policy.kind, "least_kv");
    assert_eq!(
        config.policy.sections["least_kv"],
        json!({"max_kv_usage_ratio": 0.9, "pending_weight": 1.0, "kv_capacity_tokens": 65536})
    );
    assert!(
        config
            .workers
            .iter()
            .all(|worker| worker.backend.as_deref() == Some("jsonstats"))
    );
}

#[test]
fn the_binary_is_the_router_with_both_added() {
    let binary = env!("CARGO_BIN_EXE_custom-router");
    let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("router.toml");
    let printed = Command::new(binary)
        .arg("--config")
        .arg(&demo)
        .arg("--print-config")
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    assert!(printed.status.success(), "{printed:?}");
    let text = String::from_utf8(printed.stdout).unwrap();
    for expected in [
        "kind = \"least_kv\"",
        "[policy.least_kv]",
        "max_kv_usage_ratio = 0.9",
        "backend = \"jsonstats\"",
        // The built-in policies' knobs are there too: same router.
        "[policy.least_load]",
    ] {
        assert!(text.contains(expected), "{expected} missing from:\n{text}");
    }

    // A flag naming an unknown backend: the router's exit code for a bad
    // config, and the registered names, ours included.
    let refused = Command::new(binary)
        .args([
            "--worker",
            "jsonstatz=http://127.0.0.1:31001",
            "--print-config",
        ])
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(2), "{refused:?}");
    let stderr = String::from_utf8(refused.stderr).unwrap();
    assert!(
        stderr.contains("must be one of jsonstats, sglang"),
        "{stderr}"
    );
}
