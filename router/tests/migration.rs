//! Migration through the router's public port, in front of mock engines
//! that generate deterministically: an answer whose engine breaks (a cut,
//! a stall, a hung engine, a drain's end) is continued on another engine,
//! and the client reads the answer an unbroken engine would have given.

// Test helpers outside #[test] functions fail loudly on purpose.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{
    TestRouter, fast_config, metric, metric_sum, round_robin_over, start_router, wait_until, worker,
};
use futures::StreamExt;
use mock_engines::{FaultMode, Flavour, SimEngineConfig, SimFleet};
use serde_json::{Value, json};

fn engine(time_scale: f64) -> SimEngineConfig {
    let mut config = SimEngineConfig::new(Flavour::Sglang);
    config.time_scale = time_scale;
    config.params.prefix_cache = false;
    config
}

async fn fleet(count: usize, time_scale: f64) -> SimFleet {
    mock_engines::start((0..count).map(|_| engine(time_scale)).collect())
        .await
        .unwrap()
}

/// `router_migrations_total` for one reason and outcome.
async fn migrations(router: &TestRouter, reason: &str, outcome: &str) -> f64 {
    metric(
        router,
        &format!("router_migrations_total{{reason=\"{reason}\",outcome=\"{outcome}\"}}"),
    )
    .await
}

/// What a client read of a stream: the events' JSON, and whether it ended
/// with `[DONE]`.
struct Read {
    events: Vec<Value>,
    done: bool,
}

impl Read {
    fn ids(&self) -> Vec<&str> {
        self.events
            .iter()
            .filter_map(|event| event["id"].as_str())
            .collect()
    }

    /// The chat deltas' or completions' text, in order.
    fn text(&self) -> String {
        self.events
            .iter()
            .filter_map(|event| {
                let choice = &event["choices"][0];
                choice["delta"]["content"]
                    .as_str()
                    .or_else(|| choice["text"].as_str())
            })
            .collect()
    }

    fn errors(&self) -> Vec<&Value> {
        self.events
            .iter()
            .filter(|event| event.get("error").is_some())
            .collect()
    }

    fn usage(&self) -> Option<&Value> {
        self.events
            .iter()
            .rev()
            .find_map(|event| event.get("usage").filter(|usage| !usage.is_null()))
    }

    fn finish_reason(&self) -> Option<&str> {
        self.events
            .iter()
            .find_map(|event| event["choices"][0]["finish_reason"].as_str())
    }
}

async fn stream(client: &reqwest::Client, url: &str, body: &Value) -> Read {
    let response = client.post(url).json(body).send().await.unwrap();
    let status = response.status();
    if status != 200 {
        let text = response.text().await.unwrap();
        panic!("{url}: {status} {text}");
    }
    let mut bytes = Vec::new();
    let mut chunks = response.bytes_stream();
    while let Some(chunk) = chunks.next().await {
        bytes.extend_from_slice(&chunk.unwrap());
    }
    let text = String::from_utf8(bytes).unwrap();
    let mut read = Read {
        events: Vec::new(),
        done: false,
    };
    for event in text.split("\n\n").filter(|event| !event.is_empty()) {
        let data = event
            .strip_prefix("data: ")
            .unwrap_or_else(|| panic!("an SSE data event: {event:?} in {text:?}"));
        if data == "[DONE]" {
            read.done = true;
        } else {
            read.events.push(serde_json::from_str(data).unwrap());
        }
    }
    read
}

fn chat_body(index: usize, max_tokens: u64) -> Value {
    json!({
        "model": "sim-model",
        "stream": true,
        "stream_options": {"include_usage": true},
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": format!("question {index}: tell me about routers")}],
    })
}

/// The client's stream equals the unbroken engine's: the same text, one
/// id throughout, the same finish and completion count, no error event.
fn assert_unbroken(read: &Read, reference: &Read, what: &str) {
    assert!(read.errors().is_empty(), "{what}: {:?}", read.errors());
    assert!(read.done, "{what}: ends with [DONE]");
    assert_eq!(read.text(), reference.text(), "{what}: the same text");
    let ids = read.ids();
    assert!(
        ids.windows(2).all(|pair| pair[0] == pair[1]),
        "{what}: one id throughout: {ids:?}"
    );
    assert_eq!(read.finish_reason(), reference.finish_reason(), "{what}");
    assert_eq!(
        read.usage().map(|usage| &usage["completion_tokens"]),
        reference.usage().map(|usage| &usage["completion_tokens"]),
        "{what}: the usage counts the whole answer"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_cut_mid_way_reads_as_the_unbroken_answer() {
    let engines = fleet(3, 50.0).await;
    let router = round_robin_over(&engines, "").await;
    engines.set_fault(0, FaultMode::CloseMidStream);
    let reference_url = format!("{}/v1/chat/completions", engines.engines()[1].http_url());
    let url = format!("{}/v1/chat/completions", router.base);
    for index in 0..6 {
        let body = chat_body(index, 24);
        let reference = stream(&router.client, &reference_url, &body).await;
        assert_eq!(reference.text().split(' ').count(), 25, "24 words");
        let read = stream(&router.client, &url, &body).await;
        assert_unbroken(&read, &reference, &format!("request {index}"));
    }
    let resumed = migrations(&router, "cut", "resumed").await;
    assert!(resumed >= 1.0, "some requests met the cutting engine");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_stream_continues_on_another_engine() {
    let engines = fleet(2, 50.0).await;
    let router = round_robin_over(&engines, "[server]\nstream_idle_timeout_ms = 400\n").await;
    engines.set_fault(0, FaultMode::HangMidStream);
    let reference_url = format!("{}/v1/chat/completions", engines.engines()[1].http_url());
    let url = format!("{}/v1/chat/completions", router.base);
    for index in 0..4 {
        let body = chat_body(100 + index, 16);
        let reference = stream(&router.client, &reference_url, &body).await;
        let read = stream(&router.client, &url, &body).await;
        assert_unbroken(&read, &reference, &format!("request {index}"));
    }
    assert!(migrations(&router, "stalled", "resumed").await >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_and_generate_ids_continue_exactly() {
    let engines = fleet(2, 50.0).await;
    let router = round_robin_over(&engines, "").await;
    engines.set_fault(0, FaultMode::CloseMidStream);
    let good = engines.engines()[1].http_url();
    for index in 0..4 {
        let body = json!({
            "model": "sim-model", "stream": true, "max_tokens": 20,
            "prompt": format!("complete this {index}:"),
        });
        let reference = stream(&router.client, &format!("{good}/v1/completions"), &body).await;
        let read = stream(
            &router.client,
            &format!("{}/v1/completions", router.base),
            &body,
        )
        .await;
        assert_unbroken(&read, &reference, &format!("completion {index}"));
    }
    for index in 0..4u64 {
        let body = json!({
            "input_ids": [11, 12, 13, 14 + index, 15, 16, 17, 18],
            "sampling_params": {"max_new_tokens": 20},
            "stream": true,
        });
        let reference = stream(&router.client, &format!("{good}/generate"), &body).await;
        let read = stream(&router.client, &format!("{}/generate", router.base), &body).await;
        assert!(read.errors().is_empty(), "{:?}", read.errors());
        let last = |read: &Read| read.events.last().cloned().unwrap();
        assert_eq!(last(&read)["output_ids"], last(&reference)["output_ids"]);
        assert_eq!(last(&read)["text"], last(&reference)["text"]);
        assert_eq!(
            last(&read)["meta_info"]["completion_tokens"],
            last(&reference)["meta_info"]["completion_tokens"]
        );
        // Every event's cumulative ids are a prefix of the whole answer's.
        let whole = last(&reference)["output_ids"].as_array().unwrap().clone();
        for event in &read.events {
            let ids = event["output_ids"].as_array().unwrap();
            assert_eq!(ids[..], whole[..ids.len()], "generate {index}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_streaming_requests_survive_a_hung_engine_and_match_its_own_answer() {
    let engines = fleet(2, 50.0).await;
    let router = round_robin_over(
        &engines,
        "[server]\nfirst_byte_timeout_ms = 1000\nmax_retries = 1\n\
         [outlier_detection]\nconsecutive_failures = 100\n\
         [migration]\nnon_streaming_as_stream = true\n",
    )
    .await;
    engines.set_fault(0, FaultMode::HangGeneration);
    let good = engines.engines()[1].http_url();
    let requests = (0..20).map(|index| {
        let client = router.client.clone();
        let url = format!("{}/v1/chat/completions", router.base);
        let reference_url = format!("{good}/v1/chat/completions");
        async move {
            let body = json!({
                "model": "sim-model", "max_tokens": 12,
                "messages": [{"role": "user", "content": format!("whole answer {index}")}],
            });
            let answer = client.post(&url).json(&body).send().await.unwrap();
            let status = answer.status();
            let answer: Value = answer.json().await.unwrap();
            let reference: Value = client
                .post(&reference_url)
                .json(&body)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            (status, answer, reference)
        }
    });
    for (status, answer, reference) in futures::future::join_all(requests).await {
        assert_eq!(status, 200, "{answer}");
        assert_eq!(answer["object"], "chat.completion");
        assert_eq!(
            answer["choices"][0]["message"],
            reference["choices"][0]["message"]
        );
        assert_eq!(
            answer["choices"][0]["finish_reason"],
            reference["choices"][0]["finish_reason"]
        );
        assert_eq!(answer["usage"], reference["usage"]);
    }
    assert!(
        metric(&router, "router_retries_total").await >= 1.0,
        "the hung engine's share went to the other"
    );
}

/// Streams `body` through a router (with `extra` config) over two engines
/// that both cut every stream after its first event.
async fn over_two_cutting_engines(extra: &str, body: &Value) -> (SimFleet, TestRouter, Read) {
    let engines = fleet(2, 50.0).await;
    let router = round_robin_over(&engines, extra).await;
    engines.set_fault(0, FaultMode::CloseMidStream);
    engines.set_fault(1, FaultMode::CloseMidStream);
    let url = format!("{}/v1/chat/completions", router.base);
    let read = stream(&router.client, &url, body).await;
    (engines, router, read)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_every_engine_breaks_the_stream_ends_with_an_error_event() {
    let (_engines, _router, read) = over_two_cutting_engines("", &chat_body(7, 24)).await;
    assert!(!read.done);
    let errors = read.errors();
    assert_eq!(errors.len(), 1, "{:?}", read.events);
    assert!(
        errors[0]["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no other worker continued it"),
        "{}",
        errors[0]
    );
    assert!(!read.text().is_empty(), "the first events went through");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_cannot_be_continued_faithfully_ends_as_before() {
    let mut body = chat_body(8, 24);
    body["logprobs"] = json!(true);
    let (_engines, router, read) = over_two_cutting_engines("", &body).await;
    assert_eq!(read.errors().len(), 1);
    assert!(migrations(&router, "cut", "refused").await >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_migration_off_a_cut_stream_ends_with_an_error_event() {
    let (_engines, router, read) =
        over_two_cutting_engines("[migration]\nmax_migrations = 0\n", &chat_body(9, 24)).await;
    assert_eq!(read.errors().len(), 1);
    assert!(!read.done);
    assert_eq!(metric_sum(&router, "router_migrations_total").await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_past_its_grace_moves_the_stream_to_another_engine() {
    // Slow engines: the stream is still running when the grace ends.
    let engines = fleet(2, 1.0).await;
    let first = engines.engines()[0].http_url();
    let router = start_router(fast_config(vec![worker("sglang", &first)], "")).await;
    wait_until("the first engine is healthy", || async {
        router.healthy_count().await == 1
    })
    .await;
    let body = chat_body(10, 120);
    let url = format!("{}/v1/chat/completions", router.base);
    let client = router.client.clone();
    let running = tokio::spawn(async move { stream(&client, &url, &body).await });
    wait_until("the stream runs on the first engine", || async {
        engines.snapshot(0).unwrap().running_requests == 1
    })
    .await;
    router
        .add_worker(&worker("sglang", &engines.engines()[1].http_url()))
        .await;
    wait_until("both engines are healthy", || async {
        router.healthy_count().await == 2
    })
    .await;
    let listed = router.workers_json().await;
    let first_id = listed["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|listed| listed["url"] == first.as_str())
        .unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let drained = router
        .client
        .delete(format!(
            "{}/admin/workers/{first_id}?grace_ms=50",
            router.base
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(drained.status(), 202);
    let read = running.await.unwrap();
    let reference = stream(
        &router.client,
        &format!("{}/v1/chat/completions", engines.engines()[1].http_url()),
        &chat_body(10, 120),
    )
    .await;
    assert_unbroken(&read, &reference, "the drained stream");
    assert_eq!(migrations(&router, "drained", "resumed").await, 1.0);
    let bad = router
        .client
        .delete(format!("{}/admin/workers/{first_id}?grace=5", router.base))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400, "an unknown parameter is refused");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_hundred_streams_survive_an_engine_killed_mid_run() {
    // Slow enough that the engine to be killed is still streaming when a
    // loaded machine's wait below first looks.
    let engines = fleet(4, 10.0).await;
    let router = round_robin_over(&engines, "[server]\nmax_retries = 3\n").await;
    let url = format!("{}/v1/chat/completions", router.base);
    let streams: Vec<_> = (0..500)
        .map(|index| {
            let client = router.client.clone();
            let url = url.clone();
            tokio::spawn(async move { stream(&client, &url, &chat_body(1000 + index, 48)).await })
        })
        .collect();
    let first_tokens = format!(
        "router_time_to_first_token_seconds_count{{worker=\"{}\"}}",
        engines.engines()[2].http_url()
    );
    wait_until("the engine to be killed is streaming", || async {
        metric(&router, &first_tokens).await >= 10.0
            && engines
                .snapshot(2)
                .is_some_and(|state| state.running_requests > 0)
    })
    .await;
    assert!(engines.kill(2).await);
    let mut reads = Vec::new();
    for stream in streams {
        reads.push(stream.await.unwrap());
    }
    // Every answer against the same request's on a healthy engine.
    let reference_url = format!("{}/v1/chat/completions", engines.engines()[0].http_url());
    let mut whole = 0;
    for (index, read) in reads.iter().enumerate() {
        let reference = stream(&router.client, &reference_url, &chat_body(1000 + index, 48)).await;
        if read.errors().is_empty() && read.done {
            assert_eq!(read.text(), reference.text(), "stream {index}");
            whole += 1;
        }
    }
    assert!(whole * 100 >= 99 * reads.len(), "{whole} of 500 whole");
    assert!(
        metric_sum(&router, "router_migrations_total").await >= 1.0,
        "the killed engine's streams moved"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_streaming_answer_cut_mid_way_is_continued_and_assembled() {
    let engines = fleet(2, 50.0).await;
    let router = round_robin_over(&engines, "[migration]\nnon_streaming_as_stream = true\n").await;
    engines.set_fault(0, FaultMode::CloseMidStream);
    let good = engines.engines()[1].http_url();
    for index in 0..4 {
        let body = json!({
            "model": "sim-model", "max_tokens": 16,
            "messages": [{"role": "user", "content": format!("cut whole answer {index}")}],
        });
        let answer: Value = router
            .client
            .post(format!("{}/v1/chat/completions", router.base))
            .json(&body)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let reference: Value = router
            .client
            .post(format!("{good}/v1/chat/completions"))
            .json(&body)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(
            answer["choices"][0]["message"]["content"],
            reference["choices"][0]["message"]["content"],
            "request {index}: {answer}"
        );
        assert_eq!(
            answer["usage"]["completion_tokens"],
            reference["usage"]["completion_tokens"]
        );
    }
    assert!(migrations(&router, "cut", "resumed").await >= 1.0);
}
