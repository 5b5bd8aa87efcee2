//! The router in front of mock engine servers (`mock-engines`) speaking every
//! flavour's wire format, on loopback.

// Test helpers outside #[test] functions fail loudly on purpose.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::{fast_config, metric_sum, router_over, start_router, wait_until, worker};
use futures::StreamExt;
use mock_engines::{FaultMode, Flavour, ServeMode, SimEngineConfig, SimFleet};
use router::config::WorkerConfig;

fn engine(flavour: Flavour, seed: u64) -> SimEngineConfig {
    let mut config = SimEngineConfig::new(flavour);
    config.seed = seed;
    config.time_scale = 20.0;
    // Distinct prompts would miss the cache anyway; turning it off keeps the
    // prefill work exactly what the test sends.
    config.params.prefix_cache = false;
    config
}

async fn fleet(configs: Vec<SimEngineConfig>) -> SimFleet {
    mock_engines::start(configs).await.unwrap()
}

/// A chat body whose prompt is about `tokens` tokens at 4 characters each,
/// starting with a unique tag so no two prompts share a prefix.
fn prompt(tag: usize, tokens: usize) -> String {
    let mut text = format!("request {tag:06} ");
    while text.len() < tokens * 4 {
        text.push_str("lorem ipsum dolor sit amet ");
    }
    text.truncate(tokens * 4);
    text
}

async fn stream_to_done(
    client: &reqwest::Client,
    url: &str,
    body: serde_json::Value,
) -> Result<String, String> {
    let response = client
        .post(url)
        .json(&body)
        .send()
        .await
        .map_err(|error| error.to_string())?;
    if !response.status().is_success() {
        return Err(format!("status {}", response.status()));
    }
    let mut stream = response.bytes_stream();
    let mut text = Vec::new();
    while let Some(chunk) = stream.next().await {
        text.extend_from_slice(&chunk.map_err(|error| error.to_string())?);
    }
    let text = String::from_utf8_lossy(&text).into_owned();
    if text.ends_with("data: [DONE]\n\n") {
        Ok(text)
    } else {
        Err(format!("stream cut short: {text:?}"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_backend_flavour_end_to_end() {
    let engines = fleet(vec![
        engine(Flavour::Sglang, 1),
        engine(Flavour::Sglang, 2),
        engine(Flavour::SglangMetrics, 3),
        engine(Flavour::Vllm, 4),
        engine(Flavour::Vllm, 5),
        engine(Flavour::Tokenspeed, 6),
    ])
    .await;
    let addr = engines.engines();
    let with_loads = |backend: &str, index: usize| WorkerConfig {
        load_url: addr[index].grpc_url(),
        ..worker(backend, &addr[index].http_url())
    };
    let workers = vec![
        worker("sglang", &addr[0].http_url()),
        with_loads("sglang-grpc", 1),
        worker("sglang", &addr[2].http_url()),
        worker("vllm", &addr[3].http_url()),
        with_loads("vllm-grpc", 4),
        with_loads("tokenspeed", 5),
    ];
    let router = start_router(fast_config(workers, "")).await;
    wait_until("every worker is healthy and reports its load", || async {
        let listed = router.workers_json().await;
        listed["workers"].as_array().unwrap().iter().all(|worker| {
            worker["healthy"] == true && !worker["load"].is_null() && worker["poll_failures"] == 0
        })
    })
    .await;
    let listed = router.workers_json().await;
    let backends: Vec<&str> = listed["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|worker| worker["backend"].as_str().unwrap())
        .collect();
    assert_eq!(
        backends,
        [
            "sglang",
            "sglang-grpc",
            "sglang",
            "vllm",
            "vllm-grpc",
            "tokenspeed"
        ]
    );

    let url = format!("{}/v1/chat/completions", router.base);
    let requests = (0..24).map(|index| {
        let client = router.client.clone();
        let url = url.clone();
        async move {
            let body = serde_json::json!({"stream": true, "max_tokens": 8,
                "messages": [{"role": "user", "content": prompt(index, 100)}]});
            stream_to_done(&client, &url, body).await
        }
    });
    for result in futures::future::join_all(requests).await {
        result.unwrap();
    }
    // Non-streaming and the SGLang-native endpoint go through too.
    let plain = router
        .client
        .post(format!("{}/generate", router.base))
        .json(
            &serde_json::json!({"text": prompt(99, 50), "sampling_params": {"max_new_tokens": 4}}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(plain.status(), 200);
    let models: serde_json::Value = router
        .client
        .get(format!("{}/v1/models", router.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        models["data"][0]["id"], "sim-model",
        "aggregated once across six workers"
    );
    assert_eq!(models["data"].as_array().unwrap().len(), 1);
    engines.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bare_workers_are_detected() {
    let engines = fleet(vec![engine(Flavour::Sglang, 1), engine(Flavour::Vllm, 2)]).await;
    let router = start_router(fast_config(Vec::new(), "")).await;
    for (index, expected) in [(0, "sglang"), (1, "vllm")] {
        let added: serde_json::Value = router
            .client
            .post(format!("{}/admin/workers", router.base))
            .json(&serde_json::json!({"url": engines.engines()[index].http_url()}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(added["backend"], expected, "{added}");
    }
    engines.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn size_skewed_traffic_spreads_by_work() {
    // Long and short prompts alternate. Round robin lands every long prompt
    // on the same worker; least_load sees that worker's pending work and
    // sends the next long prompt elsewhere.
    let mut long_tokens_on_busiest = Vec::new();
    for policy in ["round_robin", "least_load"] {
        let mut configs = vec![engine(Flavour::Sglang, 1), engine(Flavour::Sglang, 2)];
        for config in &mut configs {
            config.time_scale = 4.0;
        }
        let engines = fleet(configs).await;
        let router = router_over(&engines, &format!("[policy]\nkind = \"{policy}\"\n")).await;
        let url = format!("{}/v1/chat/completions", router.base);
        let mut requests = Vec::new();
        for index in 0..16 {
            let tokens = if index % 2 == 0 { 6000 } else { 200 };
            let body = serde_json::json!({"stream": true, "max_tokens": 4,
                "messages": [{"role": "user", "content": prompt(index, tokens)}]});
            let client = router.client.clone();
            let url = url.clone();
            requests.push(tokio::spawn(async move {
                stream_to_done(&client, &url, body).await
            }));
            // One after another: the next is sent once this one is dispatched,
            // while the earlier ones are still pending.
            let dispatched = index as u64 + 1;
            wait_until("the request is dispatched", || async {
                let selections = metric_sum(&router, "router_selections_total").await;
                selections >= dispatched as f64
            })
            .await;
        }
        for request in requests {
            request.await.unwrap().unwrap();
        }
        let prompt_tokens: Vec<u64> = (0..2)
            .map(|index| engines.snapshot(index).unwrap().prompt_tokens_total)
            .collect();
        long_tokens_on_busiest.push(*prompt_tokens.iter().max().unwrap());
        engines.shutdown().await;
    }
    let (round_robin, least_load) = (long_tokens_on_busiest[0], long_tokens_on_busiest[1]);
    // Round robin: all eight 6000-token prompts on one worker.
    assert!(
        round_robin >= 8 * 6000,
        "round_robin busiest worker got {round_robin} prompt tokens"
    );
    // least_load spreads them: the busiest worker holds at most six of eight.
    assert!(
        least_load <= 6 * 6000 + 8 * 200,
        "least_load busiest worker got {least_load} prompt tokens"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_fault_mode_leaves_the_router_serving_the_others() {
    for fault in FaultMode::ALL
        .into_iter()
        .filter(|fault| *fault != FaultMode::None)
    {
        let mut faulty = engine(Flavour::Sglang, 1);
        faulty.slow_loads_delay = Duration::from_secs(5);
        let engines = fleet(vec![faulty, engine(Flavour::Sglang, 2)]).await;
        let workers = engines
            .engines()
            .iter()
            .map(|engine| worker("sglang", &engine.http_url()))
            .collect();
        let mut config = fast_config(workers, "[policy]\nkind = \"round_robin\"\n");
        config.server.first_byte_timeout_ms = 1500;
        config.server.stream_idle_timeout_ms = 1500;
        // Ejected workers stay out while this runs: its probes come later.
        config.outlier_detection.base_ejection_ms = 60_000;
        let router = start_router(config).await;
        wait_until("both workers are healthy", || async {
            router.healthy_count().await == 2
        })
        .await;
        engines.set_fault(0, fault);

        let url = format!("{}/v1/chat/completions", router.base);
        let mut completed = 0;
        let mut cut = 0;
        for index in 0..12 {
            let body = serde_json::json!({"stream": true, "max_tokens": 4,
                "messages": [{"role": "user", "content": prompt(index, 50)}]});
            match stream_to_done(&router.client, &url, body).await {
                Ok(_) => completed += 1,
                Err(_) => cut += 1,
            }
        }
        let failures_to_eject = router.config.outlier_detection.consecutive_failures;
        match fault {
            // The worker answered (a 500) or bytes already reached the
            // client (a cut or stalled stream): not retried, so these fail
            // until the worker is ejected, and no more after.
            FaultMode::CloseMidStream | FaultMode::HangMidStream | FaultMode::Generation500 => {
                assert_eq!(completed + cut, 12);
                assert!(
                    cut <= failures_to_eject as usize,
                    "{fault}: {cut} failed, {completed} completed"
                );
            }
            // No generation can have started (no head on a stream, a
            // refused connection): retried on the good worker.
            _ => assert_eq!(completed, 12, "{fault}: {cut} requests failed"),
        }
        let generation_fault = matches!(
            fault,
            FaultMode::HangGeneration
                | FaultMode::HangMidStream
                | FaultMode::CloseMidStream
                | FaultMode::Generation500
                | FaultMode::SlowFirstByte
                | FaultMode::RefuseConnections
        );
        let ejected = router.workers_json().await["workers"][0]["ejected"]
            .as_bool()
            .unwrap_or(false);
        assert_eq!(
            ejected, generation_fault,
            "{fault}: a worker is ejected exactly when its generation fails"
        );
        // The router itself stays healthy and the good worker keeps serving.
        let health = router
            .client
            .get(format!("{}/health", router.base))
            .send()
            .await
            .unwrap();
        assert_eq!(health.status(), 200, "{fault}");
        if matches!(
            fault,
            FaultMode::MalformedLoads
                | FaultMode::NanLoads
                | FaultMode::Loads500
                | FaultMode::SlowLoads
        ) {
            wait_until(
                "the bad load reports are counted as poll failures",
                || async {
                    router.workers_json().await["workers"][0]["poll_failures"]
                        .as_u64()
                        .unwrap_or(0)
                        > 0
                },
            )
            .await;
        }
        engines.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn canned_engines_serve_through_the_router() {
    let mut config = engine(Flavour::Sglang, 1);
    config.mode = ServeMode::Canned;
    let engines = fleet(vec![config]).await;
    let router = start_router(fast_config(
        vec![worker("sglang", &engines.engines()[0].http_url())],
        "",
    ))
    .await;
    wait_until("the worker is healthy", || async {
        router.healthy_count().await == 1
    })
    .await;
    let body = serde_json::json!({"stream": true, "messages": [{"role": "user", "content": "hi"}]});
    let text = stream_to_done(
        &router.client,
        &format!("{}/v1/chat/completions", router.base),
        body,
    )
    .await
    .unwrap();
    assert!(text.matches("data: ").count() >= 2, "{text}");
    engines.shutdown().await;
}

/// The `delta.content` of every SSE event, in order, and the event count.
fn sse_contents(text: &str) -> (Vec<String>, usize) {
    let events: Vec<&str> = text
        .split("\n\n")
        .filter_map(|event| event.strip_prefix("data: "))
        .collect();
    let contents = events
        .iter()
        .filter_map(|data| serde_json::from_str::<serde_json::Value>(data).ok())
        .filter_map(|event| {
            event["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    (contents, events.len())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_events_passes_whole_and_in_order() {
    // A canned engine writes every event at once: the router joins what
    // arrives together, and must neither drop, reorder nor split an event.
    let mut config = engine(Flavour::Sglang, 1);
    config.mode = ServeMode::Canned;
    config.canned_tokens = 500;
    let engines = fleet(vec![config]).await;
    let engine_url = engines.engines()[0].http_url();
    let router = start_router(fast_config(vec![worker("sglang", &engine_url)], "")).await;
    wait_until("the worker is healthy", || async {
        router.healthy_count().await == 1
    })
    .await;
    let body = serde_json::json!({"stream": true, "max_tokens": 500,
        "messages": [{"role": "user", "content": "burst"}]});
    let direct = stream_to_done(
        &router.client,
        &format!("{engine_url}/v1/chat/completions"),
        body.clone(),
    )
    .await
    .unwrap();
    let routed = stream_to_done(
        &router.client,
        &format!("{}/v1/chat/completions", router.base),
        body,
    )
    .await
    .unwrap();
    let (direct_contents, direct_events) = sse_contents(&direct);
    let (routed_contents, routed_events) = sse_contents(&routed);
    assert_eq!(direct_events, 502, "500 tokens, the final event, [DONE]");
    assert_eq!(routed_events, direct_events);
    assert_eq!(routed_contents, direct_contents);

    // A whole answer keeps its length: the client sees Content-Length, not
    // a chunked body.
    let plain = router
        .client
        .post(format!("{}/v1/chat/completions", router.base))
        .json(&serde_json::json!({"max_tokens": 4,
            "messages": [{"role": "user", "content": "plain"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(plain.status(), 200);
    let announced = plain.content_length().expect("a Content-Length header");
    assert_eq!(announced, plain.bytes().await.unwrap().len() as u64);
    engines.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_streaming_answer_cut_short_is_a_clear_502() {
    let engines = fleet(vec![engine(Flavour::Sglang, 1)]).await;
    let router = start_router(fast_config(
        vec![worker("sglang", &engines.engines()[0].http_url())],
        "",
    ))
    .await;
    wait_until("the worker is healthy", || async {
        router.healthy_count().await == 1
    })
    .await;
    engines.set_fault(0, FaultMode::CloseMidStream);
    let response = router
        .client
        .post(format!("{}/v1/chat/completions", router.base))
        .json(&serde_json::json!({"max_tokens": 8,
            "messages": [{"role": "user", "content": prompt(1, 50)}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 502);
    let error: serde_json::Value = response.json().await.unwrap();
    assert_eq!(error["error"]["type"], "upstream_error");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("broke off its answer"),
        "{error}"
    );
    engines.shutdown().await;
}

/// The burst of issue "least_load v2": three workers served traffic and went
/// quiet (their reported decode rate decays towards 0), a fourth joined
/// fresh; then hundreds of streams arrive at once. With the reported rate
/// nearly every request went to the fresh worker (one pending request on a
/// near-zero rate scores hundreds of seconds); with the learned rate no
/// worker gets more than twice its fair share.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_after_a_quiet_spell_is_spread_over_the_fleet() {
    let configs = (0..4)
        .map(|index| {
            let mut config = engine(Flavour::Sglang, 40 + index);
            // Real time, so a burst's prefill queues up as it would on a GPU;
            // the reported decode rate forgets within a second of quiet.
            config.time_scale = 1.0;
            config.params.throughput_window_s = 0.05;
            config
        })
        .collect();
    let engines = fleet(configs).await;
    let urls: Vec<String> = engines
        .engines()
        .iter()
        .map(|engine| engine.http_url())
        .collect();
    let router = start_router(fast_config(
        urls[..3].iter().map(|url| worker("sglang", url)).collect(),
        "",
    ))
    .await;
    wait_until("three workers are healthy", || async {
        router.healthy_count().await == 3
    })
    .await;
    let url = format!("{}/v1/chat/completions", router.base);
    let send_all = |count: usize, offset: usize| {
        let requests: Vec<_> = (0..count)
            .map(|index| {
                let client = router.client.clone();
                let url = url.clone();
                let body = serde_json::json!({"stream": true, "max_tokens": 4,
                    "messages": [{"role": "user", "content": prompt(offset + index, 300)}]});
                tokio::spawn(async move { stream_to_done(&client, &url, body).await })
            })
            .collect();
        async move {
            for request in requests {
                request.await.unwrap().unwrap();
            }
        }
    };
    // Earlier traffic on the three.
    send_all(60, 0).await;
    // A fresh fourth worker joins; the three go quiet until their reported
    // rate has decayed to almost nothing.
    router.add_worker(&worker("sglang", &urls[3])).await;
    wait_until("four workers are healthy", || async {
        router.healthy_count().await == 4
    })
    .await;
    wait_until("the quiet workers report a decayed rate", || async {
        let workers = router.workers_json().await;
        workers["workers"].as_array().unwrap().iter().all(|worker| {
            worker["load"]["loads"][0]["gen_throughput"]
                .as_f64()
                .is_none_or(|tps| tps < 0.5)
        })
    })
    .await;
    let before: Vec<u64> = (0..4)
        .map(|index| engines.stats(index).unwrap().generation_requests)
        .collect();
    let burst = 400;
    send_all(burst, 1000).await;
    let received: Vec<u64> = (0..4)
        .map(|index| engines.stats(index).unwrap().generation_requests - before[index])
        .collect();
    assert_eq!(received.iter().sum::<u64>(), burst as u64, "{received:?}");
    eprintln!("burst received per worker: {received:?}");
    let fair_share = burst as u64 / 4;
    assert!(
        received.iter().all(|count| *count <= 2 * fair_share),
        "no worker gets more than twice its fair share of {fair_share}: {received:?}"
    );
    engines.shutdown().await;
}

/// The sums of the policy's predicted and the measured waits for first
/// tokens, over every worker.
async fn first_token_waits(router: &common::TestRouter) -> (f64, f64) {
    (
        metric_sum(router, "router_first_token_wait_predicted_seconds_total").await,
        metric_sum(router, "router_first_token_wait_measured_seconds_total").await,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_first_tokens_are_counted_against_the_predicted_wait() {
    let engines = fleet(vec![engine(Flavour::Sglang, 1), engine(Flavour::Sglang, 2)]).await;
    let router = router_over(&engines, "[policy]\nkind = \"least_load\"\n").await;
    let url = format!("{}/v1/chat/completions", router.base);
    for tag in 0..6 {
        let body = serde_json::json!({"stream": true, "max_tokens": 4,
            "messages": [{"role": "user", "content": prompt(tag, 400)}]});
        stream_to_done(&router.client, &url, body).await.unwrap();
    }
    let (predicted, measured) = first_token_waits(&router).await;
    assert!(predicted > 0.0, "predicted {predicted}");
    assert!(measured > 0.0, "measured {measured}");

    // A non-streamed answer's first byte is its last: not a first token
    // to judge a prediction by.
    let response = router
        .client
        .post(&url)
        .json(&serde_json::json!({"max_tokens": 4,
            "messages": [{"role": "user", "content": prompt(99, 400)}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    response.bytes().await.unwrap();
    assert_eq!(first_token_waits(&router).await, (predicted, measured));
    engines.shutdown().await;

    // A policy with no model of wait predicts none.
    let engines = fleet(vec![engine(Flavour::Sglang, 3), engine(Flavour::Sglang, 4)]).await;
    let router = common::round_robin_over(&engines, "").await;
    let body = serde_json::json!({"stream": true, "max_tokens": 4,
        "messages": [{"role": "user", "content": prompt(100, 400)}]});
    let url = format!("{}/v1/chat/completions", router.base);
    stream_to_done(&router.client, &url, body).await.unwrap();
    assert_eq!(first_token_waits(&router).await, (0.0, 0.0));
    engines.shutdown().await;
}
