//! Chaos on loopback: the `router` binary as a process in front of mock
//! engine servers (`mock-engines`) that misbehave in every way an LLM engine
//! does (hang before or during a stream, fail generation while `/health`
//! passes, cut streams, answer late, refuse connections), or die and come
//! back.

// Test helpers outside #[test] functions fail loudly on purpose.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::wait_until;
use futures::StreamExt;
use mock_engines::{FaultMode, Flavour, SimEngineConfig, SimFleet};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Exp};

/// The heavy tests below each load both cores; run one at a time.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The router binary, killed when dropped.
struct RouterProcess {
    child: Child,
    base: String,
    client: reqwest::Client,
    /// The router's config file, removed with the process.
    config: std::path::PathBuf,
}

impl Drop for RouterProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.config);
    }
}

impl RouterProcess {
    async fn start(workers: &[String], extra_toml: &str) -> RouterProcess {
        let port = {
            let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            probe.local_addr().unwrap().port()
        };
        let mut text = format!(
            "[server]\nport = {port}\n{extra_toml}\n\
             [load_monitor]\ninterval_ms = 200\ntimeout_ms = 500\nstale_after_ms = 1000\n\
             [health]\ninterval_ms = 200\ntimeout_ms = 500\nfailure_threshold = 2\nsuccess_threshold = 1\n"
        );
        for url in workers {
            text.push_str(&format!(
                "[[workers]]\nurl = \"{url}\"\nbackend = \"sglang\"\n"
            ));
        }
        let path =
            std::env::temp_dir().join(format!("router-chaos-{}-{port}.toml", std::process::id()));
        std::fs::write(&path, text).unwrap();
        let mut command = Command::new(env!("CARGO_BIN_EXE_router"));
        command
            .arg("--config")
            .arg(&path)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        for (name, _) in std::env::vars() {
            if name.starts_with("ROUTER__") {
                command.env_remove(name);
            }
        }
        let child = command.spawn().unwrap();
        let router = RouterProcess {
            child,
            config: path,
            base: format!("http://127.0.0.1:{port}"),
            client: reqwest::Client::builder()
                .pool_max_idle_per_host(1024)
                .build()
                .unwrap(),
        };
        wait_until("the router answers /health", || async {
            router
                .client
                .get(format!("{}/health", router.base))
                .send()
                .await
                .is_ok()
        })
        .await;
        router
    }

    /// Hedges that sent a request to a second worker (`won` + `lost`).
    async fn hedges_sent(&self) -> usize {
        let text = self
            .client
            .get(format!("{}/metrics", self.base))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        text.lines()
            .filter(|line| {
                line.starts_with("router_hedges_total{outcome=\"won\"}")
                    || line.starts_with("router_hedges_total{outcome=\"lost\"}")
            })
            .filter_map(|line| line.rsplit_once(' ')?.1.parse::<f64>().ok())
            .sum::<f64>() as usize
    }

    async fn workers(&self) -> Vec<serde_json::Value> {
        let listing: serde_json::Value = self
            .client
            .get(format!("{}/admin/workers", self.base))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        listing["workers"].as_array().unwrap().clone()
    }

    /// `/admin/workers` by worker URL.
    async fn workers_by_url(&self) -> HashMap<String, serde_json::Value> {
        self.workers()
            .await
            .into_iter()
            .map(|worker| (worker["url"].as_str().unwrap().to_owned(), worker))
            .collect()
    }

    /// The router's resident memory, from /proc.
    fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        status
            .lines()
            .find_map(|line| line.strip_prefix("VmRSS:"))
            .and_then(|value| value.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap()
    }
}

fn engine(seed: u64) -> SimEngineConfig {
    let mut config = SimEngineConfig::new(Flavour::Sglang);
    config.seed = seed;
    config.params.prefix_cache = false;
    config.params.max_running = 1024;
    config
}

/// How one request ended, from the client's side.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Outcome {
    /// 200, and a stream that reached `[DONE]`.
    Completed,
    /// A clear error: an HTTP error status with an OpenAI-shaped body, or an
    /// SSE error event that ended the stream.
    ClearError(String),
    /// Anything else: a connection reset, a stream that stopped without
    /// `[DONE]` or an error event, a client timeout. Never acceptable.
    Unclear(String),
}

async fn send(
    client: &reqwest::Client,
    base: &str,
    id: u64,
    stream: bool,
    prompt_tokens: usize,
    max_tokens: u32,
    client_timeout: Duration,
) -> Outcome {
    let mut prompt = format!("request {id:08} ");
    while prompt.len() < prompt_tokens * 4 {
        prompt.push_str("lorem ipsum dolor sit amet ");
    }
    let body = serde_json::json!({
        "model": "sim", "stream": stream, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": prompt}],
    });
    let exchange = async {
        let response = client
            .post(format!("{base}/v1/chat/completions"))
            .header("x-request-id", id.to_string())
            .json(&body)
            .send()
            .await
            .map_err(|error| Outcome::Unclear(format!("send: {error}")))?;
        let status = response.status();
        if !status.is_success() {
            let error: serde_json::Value = response
                .json()
                .await
                .map_err(|error| Outcome::Unclear(format!("{status} without JSON: {error}")))?;
            return match error["error"]["message"].as_str() {
                Some(message) => Err(Outcome::ClearError(format!("{status}: {message}"))),
                None => Err(Outcome::Unclear(format!("{status}: {error}"))),
            };
        }
        let mut body = response.bytes_stream();
        let mut text = Vec::new();
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|error| Outcome::Unclear(format!("cut: {error}")))?;
            text.extend_from_slice(&chunk);
        }
        let text = String::from_utf8_lossy(&text);
        if !stream {
            return Ok(());
        }
        if text.contains("data: [DONE]") {
            Ok(())
        } else if let Some(event) = text
            .lines()
            .rev()
            .find_map(|line| line.strip_prefix("data: "))
            .filter(|data| data.contains("\"error\""))
        {
            Err(Outcome::ClearError(format!("SSE error event: {event}")))
        } else {
            Err(Outcome::Unclear(format!(
                "stream ended without [DONE] or an error event: {text}"
            )))
        }
    };
    match tokio::time::timeout(client_timeout, exchange).await {
        Ok(Ok(())) => Outcome::Completed,
        Ok(Err(outcome)) => outcome,
        Err(_) => Outcome::Unclear("no end within the client timeout".into()),
    }
}

/// Every request id admitted into an engine's model more than once,
/// across the fleet: a generation run twice.
fn duplicate_generations(engines: &SimFleet, among: std::ops::Range<usize>) -> Vec<String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    for index in among {
        for id in engines.admitted_request_ids(index).unwrap().ids {
            *seen.entry(id).or_default() += 1;
        }
    }
    seen.into_iter()
        .filter(|(_, count)| *count > 1)
        .map(|(id, _)| id)
        .collect()
}

/// Three good engines and one of each generation fault, under open-loop
/// load: at least 99 % of requests succeed, every request ends by the
/// deadline with an answer or a clear error, every bad engine leaves
/// rotation, and no generation runs on two good engines except by a hedge
/// (a request a bad engine broke is retried or continued on a good one:
/// that is migration).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_with_every_fault_serves_99_percent_and_ejects_the_bad_engines() {
    let _one_at_a_time = ONE_AT_A_TIME.lock().await;
    let faults = [
        FaultMode::HangGeneration,
        FaultMode::HangMidStream,
        FaultMode::Generation500,
        FaultMode::CloseMidStream,
        FaultMode::SlowFirstByte,
        FaultMode::RefuseConnections,
    ];
    let mut configs: Vec<SimEngineConfig> = (0..3).map(engine).collect();
    for (index, _) in faults.iter().enumerate() {
        let mut bad = engine(10 + index as u64);
        bad.slow_first_byte_delay = Duration::from_secs(30);
        configs.push(bad);
    }
    let engines = mock_engines::start(configs).await.unwrap();
    let urls: Vec<String> = engines
        .engines()
        .iter()
        .map(|engine| engine.http_url())
        .collect();
    let deadline = Duration::from_secs(10);
    let router = RouterProcess::start(
        &urls,
        &format!(
            "first_byte_timeout_ms = 2000\nstream_idle_timeout_ms = 1500\n\
             request_deadline_ms = {}\n\
             [outlier_detection]\nbase_ejection_ms = 60000\nmax_ejection_ms = 60000\n\
             max_ejected_percent = 75\nsilent_stream_ms = 300\n",
            deadline.as_millis()
        ),
    )
    .await;
    wait_until("every worker is in rotation", || async {
        router
            .workers()
            .await
            .iter()
            .all(|worker| worker["in_rotation"] == true)
    })
    .await;
    for (offset, fault) in faults.iter().enumerate() {
        assert!(engines.set_fault(3 + offset, *fault));
    }

    // Open loop: Poisson arrivals at 40/s for 60 s, about a third of the
    // good engines' prefill capacity; one in five is not streamed; one in
    // ten prompts is long.
    let arrivals_per_s = 40.0;
    // Each bad engine costs a few failed requests before it is ejected (a
    // stream that hangs midway is only known after the idle deadline), so
    // the run is long enough for that cost to be a small share.
    let load_for = Duration::from_secs(60);
    let mut rng = SmallRng::seed_from_u64(12);
    let gaps = Exp::new(arrivals_per_s).unwrap();
    let started = tokio::time::Instant::now();
    let mut next = started;
    let mut requests = tokio::task::JoinSet::new();
    let mut id = 0u64;
    while next < started + load_for {
        tokio::time::sleep_until(next).await;
        id += 1;
        let stream = rng.random_bool(0.8);
        let prompt_tokens = if rng.random_bool(0.1) { 1000 } else { 200 };
        let client = router.client.clone();
        let base = router.base.clone();
        requests.spawn(async move {
            (
                stream,
                send(
                    &client,
                    &base,
                    id,
                    stream,
                    prompt_tokens,
                    8,
                    deadline + Duration::from_secs(5),
                )
                .await,
            )
        });
        next += Duration::from_secs_f64(gaps.sample(&mut rng));
    }
    let mut completed = 0usize;
    let mut clear = Vec::new();
    let mut unclear = Vec::new();
    while let Some(joined) = requests.join_next().await {
        match joined.unwrap() {
            (_, Outcome::Completed) => completed += 1,
            (stream, Outcome::ClearError(error)) => clear.push((stream, error)),
            (stream, Outcome::Unclear(error)) => unclear.push((stream, error)),
        }
    }
    let sent = completed + clear.len() + unclear.len();
    eprintln!("{completed} of {sent} completed; errors: {clear:?}");
    assert!(
        unclear.is_empty(),
        "every request ends with an answer or a clear error by the deadline: {:?}",
        &unclear[..unclear.len().min(5)]
    );
    assert!(
        completed * 100 >= sent * 99,
        "{completed} of {sent} completed; errors: {:?}",
        &clear
    );

    let workers = router.workers_by_url().await;
    for (offset, fault) in faults.iter().enumerate() {
        let worker = &workers[&urls[3 + offset]];
        assert_eq!(
            worker["in_rotation"], false,
            "{fault} is out of rotation: {worker}"
        );
        // A worker that refuses connections also fails its health checks,
        // which may take it out before any request reaches it; every
        // other fault passes /health and is caught by ejection.
        if *fault != FaultMode::RefuseConnections {
            assert_eq!(worker["ejected"], true, "{fault} is ejected: {worker}");
        }
    }
    for url in &urls[..3] {
        assert_eq!(workers[url]["in_rotation"], true, "good worker {url}");
    }
    // Only a hedge sends a request to two engines before either has
    // answered; anything more would be a generation run twice by mistake.
    let duplicates = duplicate_generations(&engines, 0..3);
    let hedges = router.hedges_sent().await;
    assert!(
        duplicates.len() <= hedges,
        "generations run on two good engines: {duplicates:?}, hedges: {hedges}"
    );
    drop(router);
    engines.shutdown().await;
}

/// 500 streams at a time for 30 s while one good engine is killed and later
/// restarted: every request completes or ends with a clear error, none is
/// cut silently, and the router's memory stays bounded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_hundred_streams_ride_out_an_engine_killed_and_restarted() {
    let _one_at_a_time = ONE_AT_A_TIME.lock().await;
    let mut configs: Vec<SimEngineConfig> = (0..3).map(engine).collect();
    for config in &mut configs {
        // Slow enough that streams last seconds and overlap the kill.
        config.time_scale = 0.5;
    }
    let engines = Arc::new(mock_engines::start(configs).await.unwrap());
    let urls: Vec<String> = engines
        .engines()
        .iter()
        .map(|engine| engine.http_url())
        .collect();
    let router = RouterProcess::start(
        &urls,
        "first_byte_timeout_ms = 5000\nstream_idle_timeout_ms = 5000\nrequest_deadline_ms = 30000\n\
         [outlier_detection]\nbase_ejection_ms = 1000\n",
    )
    .await;
    wait_until("every worker is in rotation", || async {
        router
            .workers()
            .await
            .iter()
            .all(|worker| worker["in_rotation"] == true)
    })
    .await;
    let rss_before_kib = router.rss_kib();

    let run_for = Duration::from_secs(30);
    let started = tokio::time::Instant::now();
    let mut streams = tokio::task::JoinSet::new();
    for stream in 0..500u64 {
        let client = router.client.clone();
        let base = router.base.clone();
        streams.spawn(async move {
            let mut outcomes = Vec::new();
            let mut round = 0u64;
            while started.elapsed() < run_for {
                let id = stream * 1_000_000 + round;
                round += 1;
                outcomes
                    .push(send(&client, &base, id, true, 100, 12, Duration::from_secs(35)).await);
            }
            outcomes
        });
    }
    // Kill one engine a third of the way in, with streams open on it, and
    // bring it back a third later.
    tokio::time::sleep_until(started + run_for / 3).await;
    assert!(engines.kill(1).await);
    tokio::time::sleep_until(started + run_for * 2 / 3).await;
    engines.restart(1).await.unwrap();

    let mut completed = 0usize;
    let mut clear = 0usize;
    let mut unclear = Vec::new();
    while let Some(joined) = streams.join_next().await {
        for outcome in joined.unwrap() {
            match outcome {
                Outcome::Completed => completed += 1,
                Outcome::ClearError(_) => clear += 1,
                Outcome::Unclear(error) => unclear.push(error),
            }
        }
    }
    assert!(
        unclear.is_empty(),
        "{} of {} requests ended unclearly, e.g. {:?}",
        unclear.len(),
        completed + clear + unclear.len(),
        &unclear[..unclear.len().min(5)]
    );
    assert!(completed > 0, "streams completed");
    wait_until("the restarted engine is back in rotation", || async {
        router.workers_by_url().await[&urls[1]]["in_rotation"] == true
    })
    .await;
    let rss_after_kib = router.rss_kib();
    // Bounded: well under what 500 streams' buffers could leak to over
    // thousands of requests.
    assert!(
        rss_after_kib < rss_before_kib + 256 * 1024,
        "router RSS grew from {rss_before_kib} KiB to {rss_after_kib} KiB"
    );
    println!(
        "500 streams, engine killed and restarted: {completed} completed, {clear} clear errors, \
         RSS {rss_before_kib} -> {rss_after_kib} KiB"
    );
    drop(router);
}

/// With migration off, a non-streaming request whose first attempt times
/// out is not run again on another worker: the hung engine may still be
/// generating it. (With migration on it goes upstream as a stream, and a
/// hung engine is known by its missing first event: router/tests/migration.rs.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_migration_off_a_timed_out_non_streaming_request_is_not_run_again() {
    let _one_at_a_time = ONE_AT_A_TIME.lock().await;
    let engines = mock_engines::start(vec![engine(1), engine(2)])
        .await
        .unwrap();
    let urls: Vec<String> = engines
        .engines()
        .iter()
        .map(|engine| engine.http_url())
        .collect();
    let router = RouterProcess::start(
        &urls,
        "first_byte_timeout_ms = 500\nmax_retries = 2\n[policy]\nkind = \"round_robin\"\n\
         [migration]\nmax_migrations = 0\nnon_streaming_as_stream = false\n",
    )
    .await;
    wait_until("both workers are in rotation", || async {
        router
            .workers()
            .await
            .iter()
            .all(|worker| worker["in_rotation"] == true)
    })
    .await;
    assert!(engines.set_fault(0, FaultMode::HangGeneration));
    let mut timed_out = 0u64;
    for id in 0..6u64 {
        match send(
            &router.client,
            &router.base,
            id,
            false,
            50,
            4,
            Duration::from_secs(10),
        )
        .await
        {
            Outcome::Completed => {}
            Outcome::ClearError(error) => {
                assert!(error.starts_with("504"), "{error}");
                timed_out += 1;
            }
            Outcome::Unclear(error) => panic!("request {id}: {error}"),
        }
    }
    assert!(timed_out > 0, "some requests met the hung engine");
    let hung = engines.generation_requests(0).unwrap();
    let good = engines.generation_requests(1).unwrap();
    assert_eq!(hung, timed_out, "every timeout was the hung engine's");
    assert_eq!(
        hung + good,
        6,
        "each request reached exactly one engine (hung {hung}, good {good})"
    );
    drop(router);
    engines.shutdown().await;
}
