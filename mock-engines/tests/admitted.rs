//! `GET /control/admitted` over loopback: an `x-request-id` is recorded only
//! once its request gets past every pre-model fault into the engine, so a
//! retry of a request that a hung engine never started is not a duplicate,
//! and a real duplicate generation shows as an id admitted twice.

// Test helpers (not only #[test] fns) may unwrap: a panic is a failed assertion.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use futures::StreamExt;
use mock_engines::{
    self as server, ADMITTED_ID_MAX_BYTES, AdmittedRequestIds, FaultMode, Flavour, ServeMode,
    SimEngineConfig, SimFleet,
};
use serde_json::{Value, json};

mod common;

use common::{DEADLINE, poll_until};

/// How long a client waits before giving up on a silent engine.
const SILENCE: Duration = Duration::from_millis(300);

fn config(flavour: Flavour) -> SimEngineConfig {
    SimEngineConfig {
        time_scale: 200.0,
        ..SimEngineConfig::new(flavour)
    }
}

async fn start_one(config: SimEngineConfig) -> (SimFleet, String) {
    let fleet = server::start(vec![config]).await.unwrap();
    let url = fleet.engines()[0].http_url();
    (fleet, url)
}

fn client(timeout: Duration) -> reqwest::Client {
    reqwest::Client::builder().timeout(timeout).build().unwrap()
}

fn chat(stream: bool) -> Value {
    json!({
        "model": "sim-model",
        "stream": stream,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hello there, engine"}],
    })
}

/// Sends a chat request with `id` and reads the whole answer; the status, or
/// None when the request failed or timed out.
async fn send(client: &reqwest::Client, url: &str, id: Option<&str>, stream: bool) -> Option<u16> {
    let mut request = client
        .post(format!("{url}/v1/chat/completions"))
        .json(&chat(stream));
    if let Some(id) = id {
        request = request.header("x-request-id", id);
    }
    let response = request.send().await.ok()?;
    let status = response.status().as_u16();
    let mut body = response.bytes_stream();
    while let Some(chunk) = body.next().await {
        chunk.ok()?;
    }
    Some(status)
}

async fn admitted_over_http(url: &str) -> Value {
    let response = client(DEADLINE)
        .get(format!("{url}/control/admitted"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    response.json().await.unwrap()
}

fn ids(fleet: &SimFleet) -> Vec<String> {
    fleet.admitted_request_ids(0).unwrap().ids
}

#[tokio::test]
async fn only_requests_that_enter_the_model_are_admitted() {
    let (fleet, url) = start_one(SimEngineConfig {
        slow_first_byte_delay: Duration::from_millis(200),
        ..config(Flavour::Sglang)
    })
    .await;
    let patient = client(DEADLINE);
    let quick = client(SILENCE);
    assert_eq!(
        admitted_over_http(&url).await,
        json!({"admitted_request_ids": [], "admitted_total": 0})
    );

    // Healthy: whole and streamed answers are admitted; no id, no record.
    assert_eq!(
        send(&patient, &url, Some("whole-1"), false).await,
        Some(200)
    );
    assert_eq!(
        send(&patient, &url, Some("stream-1"), true).await,
        Some(200)
    );
    assert_eq!(send(&patient, &url, None, true).await, Some(200));
    // Probes carry no id and are not generation requests.
    let probe = patient
        .get(format!("{url}/health_generate"))
        .send()
        .await
        .unwrap();
    assert_eq!(probe.status(), 200);
    assert_eq!(ids(&fleet), ["whole-1", "stream-1"]);

    // Faults before the model: nothing is admitted.
    assert!(fleet.set_fault(0, FaultMode::HangGeneration));
    assert_eq!(send(&quick, &url, Some("hung-1"), true).await, None);
    assert_eq!(send(&quick, &url, Some("hung-2"), false).await, None);
    assert!(fleet.set_fault(0, FaultMode::HangMidStream));
    assert_eq!(send(&quick, &url, Some("hung-whole"), false).await, None);
    assert!(fleet.set_fault(0, FaultMode::Generation500));
    assert_eq!(send(&patient, &url, Some("failed"), true).await, Some(500));
    assert!(fleet.set_fault(0, FaultMode::RefuseConnections));
    assert_eq!(send(&patient, &url, Some("refused"), true).await, None);
    assert_eq!(ids(&fleet), ["whole-1", "stream-1"]);

    // Faults after the model took the request: admitted, however it ended.
    assert!(fleet.set_fault(0, FaultMode::CloseMidStream));
    assert_eq!(send(&patient, &url, Some("cut"), true).await, None);
    assert!(fleet.set_fault(0, FaultMode::HangMidStream));
    assert_eq!(send(&quick, &url, Some("stalled"), true).await, None);
    // Slow first byte: admitted once the delay is over.
    assert!(fleet.set_fault(0, FaultMode::SlowFirstByte));
    assert_eq!(send(&patient, &url, Some("slow"), true).await, Some(200));

    // The same id twice is recorded twice: that is what a duplicate looks like.
    assert!(fleet.set_fault(0, FaultMode::None));
    assert_eq!(send(&patient, &url, Some("twice"), false).await, Some(200));
    assert_eq!(send(&patient, &url, Some("twice"), true).await, Some(200));
    let expected = [
        "whole-1", "stream-1", "cut", "stalled", "slow", "twice", "twice",
    ];
    assert_eq!(ids(&fleet), expected);
    assert_eq!(
        admitted_over_http(&url).await,
        json!({"admitted_request_ids": expected, "admitted_total": 7})
    );
    // Engines that do not exist have no record.
    assert_eq!(fleet.admitted_request_ids(1), None);
    fleet.shutdown().await;
}

#[tokio::test]
async fn a_request_dropped_during_slow_first_byte_is_never_admitted() {
    // The client gives up long before the delay ends; the delay then ends
    // with nobody waiting, and the engine must not start the generation.
    let (fleet, url) = start_one(SimEngineConfig {
        fault: FaultMode::SlowFirstByte,
        slow_first_byte_delay: Duration::from_millis(1000),
        ..config(Flavour::Sglang)
    })
    .await;
    assert_eq!(send(&client(SILENCE), &url, Some("gone"), true).await, None);
    assert_eq!(
        send(&client(SILENCE), &url, Some("gone-whole"), false).await,
        None
    );
    // One that waits is admitted after the delay: once it is in, any
    // abandoned one would have been too.
    assert_eq!(
        send(&client(DEADLINE), &url, Some("waited"), true).await,
        Some(200)
    );
    assert_eq!(ids(&fleet), ["waited"]);
    fleet.shutdown().await;
}

#[tokio::test]
async fn canned_answers_are_admitted_and_the_log_works_through_every_api() {
    let (fleet, url) = start_one(SimEngineConfig {
        mode: ServeMode::Canned,
        ..config(Flavour::Sglang)
    })
    .await;
    let patient = client(DEADLINE);
    let cases = [
        ("/v1/chat/completions", chat(true)),
        ("/v1/completions", json!({"prompt": "x", "max_tokens": 2})),
        (
            "/generate",
            json!({"text": "x", "sampling_params": {"max_new_tokens": 2}}),
        ),
    ];
    for (index, (path, body)) in cases.iter().enumerate() {
        let response = patient
            .post(format!("{url}{path}"))
            .header("x-request-id", format!("canned-{index}"))
            .json(body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "{path}");
        response.bytes().await.unwrap();
    }
    // An id too long to keep is not recorded (the log's memory is bounded).
    let long = "x".repeat(ADMITTED_ID_MAX_BYTES + 1);
    assert_eq!(send(&patient, &url, Some(&long), false).await, Some(200));
    let admitted = poll_until(
        || async { fleet.admitted_request_ids(0).unwrap() },
        |admitted: &AdmittedRequestIds| admitted.total >= 3,
    )
    .await;
    assert_eq!(
        admitted,
        AdmittedRequestIds {
            ids: vec!["canned-0".into(), "canned-1".into(), "canned-2".into()],
            total: 3,
        }
    );
    fleet.shutdown().await;
}
