//! Hedging through the router's public port: a stream whose worker sends no
//! event in time also goes to another worker, the first to answer serves
//! the client, and the worker that lost is still charged its failure.

// Test helpers outside #[test] functions fail loudly on purpose.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::{TestRouter, metric, metric_sum, round_robin_over, router_over, wait_until};
use mock_engines::{FaultMode, Flavour, SimEngineConfig, SimFleet};
use serde_json::{Value, json};

fn engine(slow_first_byte: Duration) -> SimEngineConfig {
    let mut config = SimEngineConfig::new(Flavour::Sglang);
    config.time_scale = 50.0;
    config.params.prefix_cache = false;
    config.slow_first_byte_delay = slow_first_byte;
    config
}

/// Two engines, the first hung (it takes requests and never answers), and
/// a round-robin router over them with `extra` config.
async fn hung_and_good(extra: &str) -> (SimFleet, TestRouter) {
    let engines = mock_engines::start(vec![engine(Duration::ZERO), engine(Duration::ZERO)])
        .await
        .unwrap();
    let router = round_robin_over(&engines, extra).await;
    engines.set_fault(0, FaultMode::HangGeneration);
    (engines, router)
}

fn chat_body(index: usize) -> Value {
    json!({
        "model": "sim-model",
        "stream": true,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": format!("hedged question {index}")}],
    })
}

/// The stream's text, or why it did not end whole with `[DONE]`.
async fn streamed_text(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
) -> Result<String, String> {
    let response = client
        .post(url)
        .json(body)
        .send()
        .await
        .map_err(|error| error.to_string())?;
    let status = response.status();
    let text = response.text().await.map_err(|error| error.to_string())?;
    if status != 200 {
        return Err(format!("{status}: {text}"));
    }
    let mut content = String::new();
    let mut done = false;
    for event in text.split("\n\n").filter(|event| !event.is_empty()) {
        let data = event
            .strip_prefix("data: ")
            .ok_or(format!("not SSE: {event:?}"))?;
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let event: Value = serde_json::from_str(data).map_err(|error| error.to_string())?;
        if event.get("error").is_some() {
            return Err(format!("error event: {event}"));
        }
        content.push_str(
            event["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap_or(""),
        );
    }
    if !done {
        return Err(format!("no [DONE]: {text:?}"));
    }
    Ok(content)
}

async fn hedges(router: &TestRouter, outcome: &str) -> f64 {
    metric(
        router,
        &format!("router_hedges_total{{outcome=\"{outcome}\"}}"),
    )
    .await
}

/// A client that gives up well before the router's first-byte deadline in
/// these tests, so a request that was not hedged fails instead of waiting.
fn impatient_client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_on_a_hung_engine_are_answered_by_the_hedge() {
    // Without a hedge, a request on the hung engine would wait a minute
    // for its first byte, and then fail: no retries.
    let (engines, router) = hung_and_good(
        "[server]\nfirst_byte_timeout_ms = 60000\nrequest_deadline_ms = 120000\nmax_retries = 0\n\
         [hedging]\nafter_ms = 100\n",
    )
    .await;
    let good = engines.engines()[1].http_url();
    let client = impatient_client();
    let requests = (0..8).map(|index| {
        let client = client.clone();
        let url = format!("{}/v1/chat/completions", router.base);
        let reference_url = format!("{good}/v1/chat/completions");
        async move {
            let body = chat_body(index);
            let answer = streamed_text(&client, &url, &body).await;
            let reference = streamed_text(&client, &reference_url, &body).await;
            (index, answer, reference)
        }
    });
    for (index, answer, reference) in futures::future::join_all(requests).await {
        let reference = reference.unwrap();
        assert!(!reference.is_empty());
        assert_eq!(answer, Ok(reference), "request {index}");
    }
    assert!(
        hedges(&router, "won").await >= 1.0,
        "the hung engine's share was hedged"
    );
    assert_eq!(
        hedges(&router, "lost").await,
        0.0,
        "the hung engine never answered"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_that_lost_the_race_is_charged_and_ejected() {
    let (engines, router) = hung_and_good(
        "[server]\nfirst_byte_timeout_ms = 800\nmax_retries = 0\n\
         [outlier_detection]\nconsecutive_failures = 2\nbase_ejection_ms = 60000\n\
         [hedging]\nafter_ms = 100\n",
    )
    .await;
    let url = format!("{}/v1/chat/completions", router.base);
    let client = impatient_client();
    let mut index = 0;
    // Each hedged request is answered by the good engine; the hung one's
    // attempts run on, detached, to their first-byte deadline and count.
    wait_until("the hung engine is ejected", || {
        index += 1;
        let (client, url, router) = (&client, &url, &router);
        async move {
            let answer = streamed_text(client, url, &chat_body(index)).await;
            assert!(answer.is_ok(), "request {index}: {answer:?}");
            router.workers_json().await["workers"][0]["ejected"]
                .as_bool()
                .unwrap_or(false)
        }
    })
    .await;
    assert!(hedges(&router, "won").await >= 2.0);
    let timeouts = metric(
        &router,
        &format!(
            "router_requests_total{{worker=\"{}\",status=\"timeout\"}}",
            engines.engines()[0].http_url()
        ),
    )
    .await;
    assert!(
        timeouts >= 2.0,
        "the lost attempts timed out on record: {timeouts}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_worker_to_send_an_event_answers_either_way() {
    // Engine 0 sends its first byte after 400 ms, engine 1 after 3 s: a
    // request hedged at 100 ms is answered by engine 0 whichever it
    // started on.
    let engines = mock_engines::start(vec![
        engine(Duration::from_millis(400)),
        engine(Duration::from_secs(3)),
    ])
    .await
    .unwrap();
    let router = round_robin_over(
        &engines,
        "[server]\nfirst_byte_timeout_ms = 20000\nmax_retries = 0\n[hedging]\nafter_ms = 100\n",
    )
    .await;
    engines.set_fault(0, FaultMode::SlowFirstByte);
    engines.set_fault(1, FaultMode::SlowFirstByte);
    let url = format!("{}/v1/chat/completions", router.base);
    let client = impatient_client();
    // Two at once: round robin starts one on each engine.
    let (body_0, body_1) = (chat_body(0), chat_body(1));
    let (first, second) = tokio::join!(
        streamed_text(&client, &url, &body_0),
        streamed_text(&client, &url, &body_1),
    );
    assert!(first.is_ok(), "{first:?}");
    assert!(second.is_ok(), "{second:?}");
    assert!(
        hedges(&router, "won").await >= 1.0,
        "started on the slower engine"
    );
    assert!(
        hedges(&router, "lost").await >= 1.0,
        "started on the faster engine"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_budget_a_hung_engine_costs_its_first_byte_deadline() {
    let (_engines, router) = hung_and_good(
        "[server]\nfirst_byte_timeout_ms = 400\nmax_retries = 1\n\
         [outlier_detection]\nconsecutive_failures = 100\n\
         [hedging]\nafter_ms = 50\nmax_percent = 0.0\n",
    )
    .await;
    let url = format!("{}/v1/chat/completions", router.base);
    let client = impatient_client();
    for index in 0..4 {
        let answer = streamed_text(&client, &url, &chat_body(index)).await;
        assert!(answer.is_ok(), "retried after the deadline: {answer:?}");
    }
    assert!(hedges(&router, "skipped").await >= 1.0);
    assert_eq!(hedges(&router, "won").await, 0.0);
    assert!(metric(&router, "router_retries_total").await >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_prefill_with_its_head_sent_is_not_hedged_before_its_predicted_wait() {
    // Slow engines: a long prompt's first event comes well after the
    // 50 ms hedge delay, but its head comes at once, and least_load
    // predicts the prefill's wait.
    let slow = || {
        let mut config = engine(Duration::ZERO);
        config.time_scale = 0.25;
        config
    };
    let engines = mock_engines::start(vec![slow(), slow()]).await.unwrap();
    let router = router_over(
        &engines,
        "[policy]\nkind = \"least_load\"\n\
         [server]\nfirst_byte_timeout_ms = 60000\n[hedging]\nafter_ms = 50\n",
    )
    .await;
    let url = format!("{}/v1/chat/completions", router.base);
    let client = impatient_client();
    for index in 0..2 {
        let body = json!({
            "model": "sim-model", "stream": true, "max_tokens": 4,
            "messages": [{"role": "user", "content": format!("{index} {}", "long context ".repeat(1500))}],
        });
        let answer = streamed_text(&client, &url, &body).await;
        assert!(answer.is_ok(), "{answer:?}");
    }
    let ttft_sum = metric_sum(&router, "router_time_to_first_token_seconds_sum").await;
    for outcome in ["won", "lost", "skipped"] {
        assert_eq!(
            hedges(&router, outcome).await,
            0.0,
            "{outcome}, TTFT sum {ttft_sum}"
        );
    }
}
