//! The mock servers through a real HTTP client: generation in every flavour
//! and API, each flavour's load endpoints, canned mode, and every fault mode.
//! Servers bind 127.0.0.1:0; conditions are awaited with deadlines.

// Test helpers (not only #[test] fns) may unwrap: a panic is a failed assertion.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use futures::StreamExt;
use load_protocols::WorkerLoad;
use mock_engines::{FaultMode, Flavour, ServeMode, SimEngineConfig, SimFleet};
use serde_json::{Value, json};

mod common;

use common::{DEADLINE, poll_until};

fn config(flavour: Flavour) -> SimEngineConfig {
    SimEngineConfig {
        time_scale: 200.0,
        ..SimEngineConfig::new(flavour)
    }
}

async fn start_one(config: SimEngineConfig) -> (SimFleet, String) {
    let fleet = mock_engines::start(vec![config]).await.unwrap();
    let url = fleet.engines()[0].http_url();
    (fleet, url)
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(DEADLINE)
        .build()
        .unwrap()
}

/// Reads a whole SSE body into its `data:` payloads.
async fn sse_payloads(response: reqwest::Response) -> Vec<String> {
    assert_eq!(response.status(), 200);
    assert!(
        response.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let mut body = String::new();
    let mut stream = response.bytes_stream();
    while let Some(chunk) = stream.next().await {
        body.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
    }
    assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
    body.split("\n\n")
        .filter(|event| !event.is_empty())
        .map(|event| event.strip_prefix("data: ").unwrap().to_owned())
        .collect()
}

async fn stream_chat(client: &reqwest::Client, url: &str, max_tokens: u32) -> Vec<String> {
    let response = client
        .post(format!("{url}/v1/chat/completions"))
        .json(&json!({
            "model": "sim-model",
            "stream": true,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "hello there, engine"}],
        }))
        .send()
        .await
        .unwrap();
    sse_payloads(response).await
}

#[tokio::test]
async fn every_flavour_streams_a_completion_and_reports_loads() {
    let client = client();
    for flavour in Flavour::ALL {
        let (fleet, url) = start_one(config(flavour)).await;
        assert_eq!(
            client
                .get(format!("{url}/health"))
                .send()
                .await
                .unwrap()
                .status(),
            200
        );
        let models: Value = client
            .get(format!("{url}/v1/models"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(models["data"][0]["id"], "sim-model");

        let payloads = stream_chat(&client, &url, 5).await;
        // Five token chunks, the final chunk, [DONE].
        assert_eq!(payloads.len(), 7, "{payloads:?}");
        let first: Value = serde_json::from_str(&payloads[0]).unwrap();
        assert_eq!(first["object"], "chat.completion.chunk");
        assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
        let last: Value = serde_json::from_str(&payloads[5]).unwrap();
        assert_eq!(last["choices"][0]["finish_reason"], "length");
        assert_eq!(payloads[6], "[DONE]");

        let loads = client.get(format!("{url}/v1/loads")).send().await.unwrap();
        let metrics = client.get(format!("{url}/metrics")).send().await.unwrap();
        match flavour {
            Flavour::Sglang => {
                assert_eq!(loads.headers()["content-type"], "application/json");
                let load: WorkerLoad = loads.json().await.unwrap();
                assert_eq!(load.queued_tokens(), Some(0));
                assert!(load.throughput_tps().is_some());
                assert_eq!(load.ranks()[0].max_total_num_tokens, 524_288);
                let text = metrics.text().await.unwrap();
                assert!(text.contains("sglang:num_running_reqs{"), "{text}");
            }
            Flavour::SglangMetrics => {
                assert_eq!(loads.status(), 404);
                let text = metrics.text().await.unwrap();
                assert!(
                    text.contains("# TYPE sglang:num_queue_reqs gauge"),
                    "{text}"
                );
            }
            Flavour::Vllm => {
                assert_eq!(loads.status(), 404);
                assert!(
                    metrics.headers()["content-type"]
                        .to_str()
                        .unwrap()
                        .starts_with("text/plain")
                );
                let text = metrics.text().await.unwrap();
                // One request of 5 generated tokens; its 5-token prompt.
                assert!(
                    text.contains(
                        "vllm:generation_tokens_total{engine=\"0\",model_name=\"sim-model\"} 5.0"
                    ),
                    "{text}"
                );
                assert!(text.contains(
                    "vllm:prompt_tokens_total{engine=\"0\",model_name=\"sim-model\"} 5.0"
                ));
                assert!(text.contains("vllm:num_requests_running{"));
                assert!(text.contains("vllm:kv_cache_usage_perc{"));
            }
            Flavour::Tokenspeed => {
                assert_eq!(loads.status(), 404);
                // Counters, no load gauges: its load report is gRPC.
                let text = metrics.text().await.unwrap();
                assert!(
                    text.contains("tokenspeed:num_requests_total{model_name=\"sim-model\"} 1.0"),
                    "{text}"
                );
                assert!(!text.contains("num_running_reqs"), "{text}");
                assert!(fleet.engines()[0].grpc_addr.is_some());
            }
        }
        fleet.shutdown().await;
    }
}

#[tokio::test]
async fn every_api_answers_plain_and_streaming() {
    let client = client();
    let (fleet, url) = start_one(config(Flavour::Sglang)).await;
    let cases = [
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
        ),
        (
            "/v1/completions",
            json!({"prompt": "once upon a time", "max_tokens": 4}),
        ),
        (
            "/generate",
            json!({"text": "once upon a time", "sampling_params": {"max_new_tokens": 4}}),
        ),
        (
            "/generate",
            json!({"input_ids": [1, 2, 3, 4, 5, 6, 7, 8], "sampling_params": {"max_new_tokens": 4}}),
        ),
    ];
    for (path, body) in cases {
        let whole: Value = client
            .post(format!("{url}{path}"))
            .json(&body)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        match path {
            "/generate" => {
                assert_eq!(whole["meta_info"]["completion_tokens"], 4, "{whole}");
                assert!(!whole["text"].as_str().unwrap().is_empty());
            }
            _ => {
                assert_eq!(whole["usage"]["completion_tokens"], 4, "{whole}");
                assert_eq!(whole["choices"][0]["finish_reason"], "length");
            }
        }
        if body.get("input_ids").is_some() {
            assert_eq!(whole["meta_info"]["prompt_tokens"], 8);
        }
        let mut streaming = body.clone();
        streaming["stream"] = json!(true);
        let payloads = sse_payloads(
            client
                .post(format!("{url}{path}"))
                .json(&streaming)
                .send()
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(payloads.len(), 6, "{path}: {payloads:?}");
    }
    // Not JSON: 400.
    let bad = client
        .post(format!("{url}/v1/completions"))
        .body("nope")
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    fleet.shutdown().await;
}

#[tokio::test]
async fn loads_report_queued_prefill_work_while_busy() {
    // Real time (scale 1): four prompts of 10 000 tokens (40 000 chars) take
    // 1.25 s of prefill each, so queued tokens are visible for seconds.
    let (fleet, url) = start_one(SimEngineConfig {
        time_scale: 1.0,
        ..SimEngineConfig::new(Flavour::Sglang)
    })
    .await;
    let client = client();
    let prompt = "x".repeat(40_000);
    let mut requests = Vec::new();
    for _ in 0..4 {
        let request = client
            .post(format!("{url}/v1/completions"))
            .json(&json!({"prompt": prompt, "max_tokens": 2}))
            .send();
        requests.push(tokio::spawn(request));
    }
    poll_until(
        || {
            let client = client.clone();
            let url = url.clone();
            async move {
                let load: WorkerLoad = client
                    .get(format!("{url}/v1/loads"))
                    .send()
                    .await
                    .unwrap()
                    .json()
                    .await
                    .unwrap();
                load.queued_tokens().unwrap() > 20_000 && load.waiting_requests() >= 1
            }
        },
        |ready| *ready,
    )
    .await;
    let truth = fleet.snapshot(0).unwrap();
    assert!(truth.queued_prefill_tokens > 0);
    assert!(truth.used_kv_tokens > 0);
    fleet.shutdown().await;
    for request in requests {
        // Stopped mid-flight: the requests end one way or another.
        let _ = request.await;
    }
}

#[tokio::test]
async fn canned_mode_answers_at_once_on_many_ports() {
    let template = SimEngineConfig {
        mode: ServeMode::Canned,
        canned_tokens: 3,
        // Real time: a modelled answer would take a visible while.
        time_scale: 1.0,
        ..SimEngineConfig::new(Flavour::Vllm)
    };
    let fleet = mock_engines::start_many(&template, 3).await.unwrap();
    assert_eq!(fleet.engines().len(), 3);
    let client = client();
    for engine in fleet.engines() {
        let url = engine.http_url();
        let payloads = sse_payloads(
            client
                .post(format!("{url}/v1/completions"))
                .json(&json!({"prompt": "x", "stream": true, "max_tokens": 1000}))
                .send()
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(payloads.len(), 5);
        let whole: Value = client
            .post(format!("{url}/v1/chat/completions"))
            .json(&json!({"messages": [{"role": "user", "content": "x"}]}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(whole["usage"]["completion_tokens"], 3);
    }
    fleet.shutdown().await;
}

async fn set_fault(client: &reqwest::Client, url: &str, mode: &str) {
    let response = client
        .post(format!("{url}/control/fault"))
        .json(&json!({"mode": mode}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["mode"], mode);
}

#[tokio::test]
async fn every_fault_mode_behaves_as_named() {
    let (fleet, url) = start_one(SimEngineConfig {
        slow_loads_delay: Duration::from_secs(3600),
        ..config(Flavour::Sglang)
    })
    .await;
    let (vllm_fleet, vllm_url) = start_one(config(Flavour::Vllm)).await;
    let client = client();
    let quick = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();

    // An unknown mode is refused.
    let bad = client
        .post(format!("{url}/control/fault"))
        .json(&json!({"mode": "explode"}))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);

    // slow-loads: the load endpoints do not answer in time; generation does.
    set_fault(&client, &url, "slow-loads").await;
    let slow = quick.get(format!("{url}/v1/loads")).send().await;
    assert!(slow.unwrap_err().is_timeout());
    assert_eq!(stream_chat(&client, &url, 2).await.len(), 4);

    // malformed-loads: 200 with a body that does not decode.
    set_fault(&client, &url, "malformed-loads").await;
    let response = client.get(format!("{url}/v1/loads")).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let text = response.text().await.unwrap();
    assert!(serde_json::from_str::<Value>(&text).is_err(), "{text}");
    set_fault(&client, &vllm_url, "malformed-loads").await;
    let text = client
        .get(format!("{vllm_url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(text.contains("{engine=\"0\" 3 x"), "{text}");

    // nan-loads: NaN where numbers belong.
    set_fault(&client, &url, "nan-loads").await;
    let text = client
        .get(format!("{url}/v1/loads"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(text.contains("\"token_usage\": NaN"), "{text}");
    set_fault(&client, &vllm_url, "nan-loads").await;
    let text = client
        .get(format!("{vllm_url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        text.contains("vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"sim-model\"} NaN"),
        "{text}"
    );

    // loads-500.
    set_fault(&client, &url, "loads-500").await;
    assert_eq!(
        client
            .get(format!("{url}/v1/loads"))
            .send()
            .await
            .unwrap()
            .status(),
        500
    );
    assert_eq!(
        client
            .get(format!("{url}/metrics"))
            .send()
            .await
            .unwrap()
            .status(),
        500
    );
    set_fault(&client, &vllm_url, "loads-500").await;
    assert_eq!(
        client
            .get(format!("{vllm_url}/metrics"))
            .send()
            .await
            .unwrap()
            .status(),
        500
    );

    // hang-generation: no answer; health and loads still fine.
    set_fault(&client, &url, "hang-generation").await;
    let hung = quick
        .post(format!("{url}/v1/completions"))
        .json(&json!({"prompt": "x", "max_tokens": 1}))
        .send()
        .await;
    assert!(hung.unwrap_err().is_timeout());
    assert_eq!(
        client
            .get(format!("{url}/v1/loads"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );

    // close-mid-stream: the first chunk arrives, then the body breaks off.
    set_fault(&client, &url, "close-mid-stream").await;
    let response = client
        .post(format!("{url}/v1/chat/completions"))
        .json(&json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 50, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut stream = response.bytes_stream();
    let first = stream.next().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: {"));
    let mut broke = false;
    while let Some(chunk) = stream.next().await {
        if chunk.is_err() {
            broke = true;
            break;
        }
    }
    assert!(broke, "the stream ended cleanly");
    let whole = client
        .post(format!("{url}/v1/completions"))
        .json(&json!({"prompt": "x", "max_tokens": 3}))
        .send()
        .await
        .unwrap();
    assert!(whole.bytes().await.is_err());

    // refuse-connections: requests get their connection closed unanswered
    // (fresh client and pooled connections alike); control still works.
    set_fault(&client, &url, "refuse-connections").await;
    let refused = client.get(format!("{url}/health")).send().await;
    assert!(refused.is_err(), "{refused:?}");
    let fresh = reqwest::Client::new()
        .get(format!("{url}/v1/loads"))
        .send()
        .await;
    assert!(fresh.is_err());
    assert_eq!(fleet.fault(0), Some(FaultMode::RefuseConnections));

    // none: everything is back.
    set_fault(&client, &url, "none").await;
    assert_eq!(
        client
            .get(format!("{url}/health"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    let load: WorkerLoad = client
        .get(format!("{url}/v1/loads"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(load.running_requests(), 0);
    assert_eq!(stream_chat(&client, &url, 3).await.len(), 5);

    // The in-process switch and a fault set at start.
    assert!(fleet.set_fault(0, FaultMode::Loads500));
    assert_eq!(
        client
            .get(format!("{url}/v1/loads"))
            .send()
            .await
            .unwrap()
            .status(),
        500
    );
    assert!(!fleet.set_fault(7, FaultMode::None));
    fleet.shutdown().await;
    vllm_fleet.shutdown().await;

    let (fleet, url) = start_one(SimEngineConfig {
        fault: FaultMode::Loads500,
        ..config(Flavour::SglangMetrics)
    })
    .await;
    assert_eq!(
        client
            .get(format!("{url}/metrics"))
            .send()
            .await
            .unwrap()
            .status(),
        500
    );
    fleet.shutdown().await;
}

#[tokio::test]
async fn shutdown_is_clean_even_with_hung_requests() {
    let (fleet, url) = start_one(SimEngineConfig {
        fault: FaultMode::HangGeneration,
        ..config(Flavour::Sglang)
    })
    .await;
    let client = client();
    let hung = tokio::spawn({
        let client = client.clone();
        let url = url.clone();
        async move {
            client
                .post(format!("{url}/v1/completions"))
                .json(&json!({"prompt": "x"}))
                .send()
                .await
        }
    });
    // The request is in (the engine counts nothing: it never reached the model).
    poll_until(
        || {
            let client = client.clone();
            let url = url.clone();
            async move { client.get(format!("{url}/health")).send().await.is_ok() }
        },
        |ready| *ready,
    )
    .await;
    tokio::time::timeout(DEADLINE, fleet.shutdown())
        .await
        .unwrap();
    // The hung request got an answer or a closed connection, not a hang.
    let _ = tokio::time::timeout(DEADLINE, hung).await.unwrap();
    assert!(client.get(format!("{url}/health")).send().await.is_err());
}

#[test]
fn names_parse_both_ways() {
    for flavour in Flavour::ALL {
        assert_eq!(flavour.as_str().parse::<Flavour>().unwrap(), flavour);
    }
    for mode in FaultMode::ALL {
        assert_eq!(mode.as_str().parse::<FaultMode>().unwrap(), mode);
    }
    assert!("sglang-grpc".parse::<Flavour>().is_err());
    assert!("canned".parse::<ServeMode>().is_ok());
    // tokenspeed without a gRPC port, or sglang-metrics with one, is refused.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let mut tokenspeed = SimEngineConfig::new(Flavour::Tokenspeed);
        tokenspeed.grpc_addr = None;
        assert!(mock_engines::start(vec![tokenspeed]).await.is_err());
        let mut metrics = SimEngineConfig::new(Flavour::SglangMetrics);
        metrics.grpc_addr = SimEngineConfig::new(Flavour::Sglang).grpc_addr;
        assert!(mock_engines::start(vec![metrics]).await.is_err());
    });
}
