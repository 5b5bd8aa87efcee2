//! The chaos faults through real clients on loopback: hang-mid-stream,
//! generation-500, slow-first-byte, SGLang's `/health_generate` under every
//! generation fault, the request counters, and a hard kill and restart of
//! one engine. Waits are bounded by deadlines; nothing asserts a duration.

// Test helpers (not only #[test] fns) may unwrap: a panic is a failed assertion.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use backends_sglang::proto::HealthCheckRequest;
use backends_sglang::proto::sglang_scheduler_client::SglangSchedulerClient;
use bytes::Bytes;
use futures::StreamExt;
use futures::stream::BoxStream;
use mock_engines::{FaultMode, Flavour, SimEngineConfig, SimEngineStats, SimFleet};
use serde_json::{Value, json};

mod common;

use common::DEADLINE;

/// How long a client waits before calling a silent server silent. Only an
/// upper bound on waiting: a hung server never answers at all.
const SILENCE: Duration = Duration::from_millis(300);

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

/// A client that gives up after [`SILENCE`].
fn quick() -> reqwest::Client {
    reqwest::Client::builder().timeout(SILENCE).build().unwrap()
}

fn chat(max_tokens: u32, stream: bool) -> Value {
    json!({
        "model": "sim-model",
        "stream": stream,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "hello there, engine"}],
    })
}

async fn status(request: reqwest::RequestBuilder) -> u16 {
    request.send().await.unwrap().status().as_u16()
}

/// A body stream with its first SSE event read off.
struct OpenStream {
    first_event: String,
    rest: BoxStream<'static, reqwest::Result<Bytes>>,
    buffered: String,
}

/// Starts a streaming chat and reads until its first whole event.
async fn open_stream(client: &reqwest::Client, url: &str, max_tokens: u32) -> OpenStream {
    let response = client
        .post(format!("{url}/v1/chat/completions"))
        .json(&chat(max_tokens, true))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert!(
        response.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let mut rest = response.bytes_stream().boxed();
    let mut buffered = String::new();
    while !buffered.contains("\n\n") {
        let chunk = rest.next().await.unwrap().unwrap();
        buffered.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    let (first, after) = buffered.split_once("\n\n").unwrap();
    OpenStream {
        first_event: first.to_owned(),
        buffered: after.to_owned(),
        rest,
    }
}

/// How a stream ended.
#[derive(Debug, PartialEq)]
enum End {
    /// Cleanly, after `data: [DONE]`.
    Done,
    /// With a body error (the connection broke off).
    Cut,
    /// Cleanly but without `[DONE]`.
    Truncated,
}

/// Reads a stream to its end, under the deadline.
async fn read_to_end(mut stream: OpenStream) -> End {
    tokio::time::timeout(DEADLINE, async {
        while let Some(chunk) = stream.rest.next().await {
            match chunk {
                Ok(bytes) => stream
                    .buffered
                    .push_str(std::str::from_utf8(&bytes).unwrap()),
                Err(_) => return End::Cut,
            }
        }
        if stream.buffered.ends_with("data: [DONE]\n\n") {
            End::Done
        } else {
            End::Truncated
        }
    })
    .await
    .expect("the stream neither ended nor broke before the deadline")
}

async fn stats_over_http(client: &reqwest::Client, url: &str) -> Value {
    let response = client
        .get(format!("{url}/control/stats"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    response.json().await.unwrap()
}

#[tokio::test]
async fn hang_mid_stream_sends_the_head_and_first_event_then_goes_silent() {
    let (fleet, url) = start_one(SimEngineConfig {
        fault: FaultMode::HangMidStream,
        ..config(Flavour::Sglang)
    })
    .await;
    let client = client();

    let mut stream = open_stream(&client, &url, 50).await;
    let first: Value =
        serde_json::from_str(stream.first_event.strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    // Nothing more within the client's patience, and the connection is
    // neither closed (None) nor broken (Err): the read simply times out.
    let next = tokio::time::timeout(SILENCE, stream.rest.next()).await;
    assert!(next.is_err(), "the stream moved on: {next:?}");
    // Switching the fault off does not revive a stream that went silent.
    assert!(fleet.set_fault(0, FaultMode::None));
    let next = tokio::time::timeout(SILENCE, stream.rest.next()).await;
    assert!(next.is_err(), "the stream moved on: {next:?}");

    // A non-streaming request hangs before its head, like hang-generation;
    // health and loads stay fine.
    assert!(fleet.set_fault(0, FaultMode::HangMidStream));
    let hung = quick()
        .post(format!("{url}/v1/completions"))
        .json(&json!({"prompt": "x", "max_tokens": 3}))
        .send()
        .await;
    assert!(hung.unwrap_err().is_timeout());
    assert_eq!(status(client.get(format!("{url}/health"))).await, 200);
    assert_eq!(status(client.get(format!("{url}/v1/loads"))).await, 200);
    assert_eq!(fleet.generation_requests(0), Some(2));

    // Stopping the engine ends the silent stream.
    tokio::time::timeout(DEADLINE, fleet.shutdown())
        .await
        .unwrap();
    assert_ne!(read_to_end(stream).await, End::Done);
}

#[tokio::test]
async fn generation_500_fails_every_generation_while_health_says_ok() {
    let (fleet, url) = start_one(config(Flavour::Sglang)).await;
    let client = client();
    assert!(fleet.set_fault(0, FaultMode::Generation500));
    let cases = [
        ("/v1/chat/completions", chat(4, false)),
        ("/v1/chat/completions", chat(4, true)),
        ("/v1/completions", json!({"prompt": "x", "max_tokens": 4})),
        (
            "/generate",
            json!({"text": "x", "sampling_params": {"max_new_tokens": 4}}),
        ),
    ];
    for (path, body) in &cases {
        let response = client
            .post(format!("{url}{path}"))
            .json(body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 500, "{path}");
        assert!(
            response.headers()["content-type"]
                .to_str()
                .unwrap()
                .starts_with("application/json")
        );
        let error: Value = response.json().await.unwrap();
        assert!(
            error["error"]["message"]
                .as_str()
                .unwrap()
                .contains("generation-500"),
            "{error}"
        );
    }
    // The lying health endpoint, and the honest deep one.
    assert_eq!(status(client.get(format!("{url}/health"))).await, 200);
    assert_eq!(status(client.get(format!("{url}/v1/models"))).await, 200);
    assert_eq!(
        status(client.get(format!("{url}/health_generate"))).await,
        500
    );
    let stats = stats_over_http(&client, &url).await;
    assert_eq!(
        stats,
        json!({"generation_requests": 4, "health_generate_requests": 1, "fault": "generation-500"})
    );
    // Nothing reached the model.
    assert_eq!(fleet.snapshot(0).unwrap().running_requests, 0);
    fleet.shutdown().await;
}

#[tokio::test]
async fn slow_first_byte_answers_normally_after_its_delay() {
    // Engine 0 waits an hour before its head, engine 1 a moment.
    let fleet = mock_engines::start(vec![
        SimEngineConfig {
            fault: FaultMode::SlowFirstByte,
            slow_first_byte_delay: Duration::from_secs(3600),
            ..config(Flavour::Vllm)
        },
        SimEngineConfig {
            fault: FaultMode::SlowFirstByte,
            slow_first_byte_delay: Duration::from_millis(50),
            ..config(Flavour::Vllm)
        },
    ])
    .await
    .unwrap();
    let slow = fleet.engines()[0].http_url();
    let quicker = fleet.engines()[1].http_url();
    let client = client();

    // No head within the client's patience, streaming or not; the rest of
    // the engine answers at once.
    let streaming = quick()
        .post(format!("{slow}/v1/chat/completions"))
        .json(&chat(3, true))
        .send()
        .await;
    assert!(streaming.unwrap_err().is_timeout());
    let whole = quick()
        .post(format!("{slow}/v1/completions"))
        .json(&json!({"prompt": "x", "max_tokens": 3}))
        .send()
        .await;
    assert!(whole.unwrap_err().is_timeout());
    assert_eq!(status(quick().get(format!("{slow}/health"))).await, 200);
    assert_eq!(status(quick().get(format!("{slow}/metrics"))).await, 200);
    assert_eq!(fleet.generation_requests(0), Some(2));

    // Once the delay is over the answer is a normal one.
    let stream = open_stream(&client, &quicker, 5).await;
    assert!(stream.first_event.starts_with("data: {"));
    assert_eq!(read_to_end(stream).await, End::Done);
    let whole: Value = client
        .post(format!("{quicker}/v1/completions"))
        .json(&json!({"prompt": "x", "max_tokens": 3}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(whole["usage"]["completion_tokens"], 3, "{whole}");
    let stats = stats_over_http(&client, &quicker).await;
    assert_eq!(stats["generation_requests"], 2);
    assert_eq!(stats["fault"], "slow-first-byte");
    fleet.shutdown().await;
}

#[tokio::test]
async fn health_generate_runs_a_real_generation_and_obeys_its_faults() {
    let (fleet, url) = start_one(SimEngineConfig {
        slow_first_byte_delay: Duration::from_secs(3600),
        ..config(Flavour::Sglang)
    })
    .await;
    let client = client();
    let probe = |client: &reqwest::Client| client.get(format!("{url}/health_generate")).send();

    let healthy = probe(&client).await.unwrap();
    assert_eq!(healthy.status(), 200);
    assert!(healthy.bytes().await.unwrap().is_empty());
    // It went through the model: one prompt token, one output token.
    let generated = fleet.snapshot(0).unwrap();
    assert_eq!(generated.finished_requests_total, 1);
    assert_eq!(generated.generation_tokens_total, 1);

    for hanging in [
        FaultMode::HangGeneration,
        FaultMode::HangMidStream,
        FaultMode::SlowFirstByte,
    ] {
        assert!(fleet.set_fault(0, hanging));
        let hung = probe(&quick()).await;
        assert!(hung.unwrap_err().is_timeout(), "{hanging}");
    }
    for failing in [FaultMode::Generation500, FaultMode::CloseMidStream] {
        assert!(fleet.set_fault(0, failing));
        assert_eq!(probe(&client).await.unwrap().status(), 500, "{failing}");
    }
    // Load faults leave generation alone.
    for load_fault in [FaultMode::Loads500, FaultMode::SlowLoads] {
        assert!(fleet.set_fault(0, load_fault));
        assert_eq!(probe(&client).await.unwrap().status(), 200, "{load_fault}");
    }
    assert!(fleet.set_fault(0, FaultMode::RefuseConnections));
    assert!(probe(&reqwest::Client::new()).await.is_err());
    // Probes count as probes, never as generation requests; the refused
    // one never reached the engine.
    assert_eq!(
        fleet.stats(0),
        Some(SimEngineStats {
            generation_requests: 0,
            health_generate_requests: 8,
        })
    );
    fleet.shutdown().await;

    // SGLang without /v1/loads serves it too; vLLM and TokenSpeed do not.
    for (flavour, expected) in [
        (Flavour::SglangMetrics, 200),
        (Flavour::Vllm, 404),
        (Flavour::Tokenspeed, 404),
    ] {
        let (fleet, url) = start_one(config(flavour)).await;
        assert_eq!(
            status(client.get(format!("{url}/health_generate"))).await,
            expected,
            "{flavour}"
        );
        fleet.shutdown().await;
    }
}

#[tokio::test]
async fn counters_count_each_generation_on_arrival() {
    let (fleet, url) = start_one(config(Flavour::Sglang)).await;
    let client = client();
    assert_eq!(
        stats_over_http(&client, &url).await,
        json!({"generation_requests": 0, "health_generate_requests": 0, "fault": "none"})
    );
    assert_eq!(
        status(
            client
                .post(format!("{url}/v1/chat/completions"))
                .json(&chat(2, false))
        )
        .await,
        200
    );
    let stream = open_stream(&client, &url, 2).await;
    assert_eq!(read_to_end(stream).await, End::Done);
    assert_eq!(
        status(
            client
                .post(format!("{url}/generate"))
                .json(&json!({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}))
        )
        .await,
        200
    );
    // A request the engine cannot parse still arrived.
    assert_eq!(
        status(client.post(format!("{url}/v1/completions")).body("nope")).await,
        400
    );
    assert_eq!(
        status(client.get(format!("{url}/health_generate"))).await,
        200
    );
    // Counted before the fault: a hung request is in.
    assert!(fleet.set_fault(0, FaultMode::HangGeneration));
    let hung = quick()
        .post(format!("{url}/v1/completions"))
        .json(&json!({"prompt": "x"}))
        .send()
        .await;
    assert!(hung.unwrap_err().is_timeout());
    // Refused connections never reach the engine; /control/* still answers.
    assert!(fleet.set_fault(0, FaultMode::RefuseConnections));
    let refused = reqwest::Client::new()
        .post(format!("{url}/v1/completions"))
        .json(&json!({"prompt": "x"}))
        .send()
        .await;
    assert!(refused.is_err());
    assert_eq!(
        stats_over_http(&client, &url).await,
        json!({"generation_requests": 5, "health_generate_requests": 1, "fault": "refuse-connections"})
    );
    assert_eq!(fleet.generation_requests(0), Some(5));
    assert_eq!(fleet.health_generate_requests(0), Some(1));
    assert_eq!(fleet.generation_requests(1), None);
    assert_eq!(fleet.stats(1), None);

    // Every new mode switches over HTTP; a bad one lists them.
    for mode in ["hang-mid-stream", "generation-500", "slow-first-byte"] {
        let switched: Value = client
            .post(format!("{url}/control/fault"))
            .json(&json!({"mode": mode}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(switched["mode"], mode);
        assert_eq!(fleet.fault(0), Some(mode.parse().unwrap()));
    }
    let bad = client
        .post(format!("{url}/control/fault"))
        .json(&json!({"mode": "explode"}))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    let text = bad.text().await.unwrap();
    for mode in FaultMode::ALL {
        assert!(text.contains(mode.as_str()), "{text}");
    }
    fleet.shutdown().await;
}

#[tokio::test]
async fn kill_cuts_open_streams_and_refuses_and_restart_serves_on_the_same_ports() {
    // Real time: a 50 000-token answer streams for minutes, so every stream
    // is still open when the engine dies.
    let fleet = mock_engines::start(vec![
        SimEngineConfig::new(Flavour::Sglang),
        SimEngineConfig::new(Flavour::Sglang),
    ])
    .await
    .unwrap();
    let victim = fleet.engines()[0];
    let url = victim.http_url();
    let grpc = victim.grpc_http_url().unwrap();
    let bystander = fleet.engines()[1].http_url();
    let client = client();

    let streams =
        futures::future::join_all((0..32).map(|_| open_stream(&client, &url, 50_000))).await;
    let mut bystander_stream = open_stream(&client, &bystander, 50_000).await;
    let mut grpc_client = SglangSchedulerClient::connect(grpc.clone()).await.unwrap();
    assert!(
        grpc_client
            .health_check(HealthCheckRequest {})
            .await
            .unwrap()
            .get_ref()
            .healthy
    );

    assert!(fleet.kill(0).await);
    assert_eq!(fleet.is_running(0).await, Some(false));
    // Every open stream breaks off (no [DONE]).
    let ends = futures::future::join_all(streams.into_iter().map(read_to_end)).await;
    assert!(ends.iter().all(|end| *end != End::Done), "{ends:?}");
    // Nothing listens: new connections are refused, HTTP and gRPC alike.
    let refused = reqwest::Client::new()
        .get(format!("{url}/health"))
        .send()
        .await
        .unwrap_err();
    assert!(refused.is_connect(), "{refused:?}");
    assert!(
        grpc_client
            .health_check(HealthCheckRequest {})
            .await
            .is_err()
    );
    assert!(SglangSchedulerClient::connect(grpc.clone()).await.is_err());
    // The other engine carries on, its stream included.
    assert_eq!(status(client.get(format!("{bystander}/health"))).await, 200);
    let more = tokio::time::timeout(DEADLINE, bystander_stream.rest.next()).await;
    assert!(matches!(more, Ok(Some(Ok(_)))), "{more:?}");
    assert!(fleet.is_running(1).await.unwrap());
    // The counters outlive the engine; killing twice is harmless.
    assert_eq!(fleet.generation_requests(0), Some(32));
    assert!(fleet.kill(0).await);
    assert!(!fleet.kill(9).await);

    fleet.restart(0).await.unwrap();
    assert_eq!(fleet.is_running(0).await, Some(true));
    let fresh = self::client();
    assert_eq!(status(fresh.get(format!("{url}/health"))).await, 200);
    // A fresh engine: nothing of the killed streams is left in it.
    let truth = fleet.snapshot(0).unwrap();
    assert_eq!(truth.running_requests, 0);
    assert_eq!(truth.finished_requests_total, 0);
    let stream = open_stream(&fresh, &url, 3).await;
    assert_eq!(read_to_end(stream).await, End::Done);
    let mut grpc_client = SglangSchedulerClient::connect(grpc.clone()).await.unwrap();
    assert!(
        grpc_client
            .health_check(HealthCheckRequest {})
            .await
            .unwrap()
            .get_ref()
            .healthy
    );
    assert_eq!(fleet.generation_requests(0), Some(33));

    // Restarting a running engine kills it first; it comes back again.
    let stream = open_stream(&fresh, &url, 50_000).await;
    fleet.restart(0).await.unwrap();
    assert_ne!(read_to_end(stream).await, End::Done);
    assert_eq!(
        status(self::client().get(format!("{url}/health"))).await,
        200
    );
    assert!(fleet.restart(9).await.is_err());

    tokio::time::timeout(DEADLINE, fleet.shutdown())
        .await
        .unwrap();
    // The bystander's stream ended with the fleet, not with the kill.
    assert_ne!(read_to_end(bystander_stream).await, End::Done);
}
