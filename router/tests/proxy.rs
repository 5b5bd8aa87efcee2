//! The proxy end to end: a real router and scriptable upstreams on loopback.

// Test helpers outside #[test] functions fail loudly on purpose.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::atomic::Ordering;

use common::upstream::Upstream;
use common::{fast_config, metric, start_router, wait_until, worker};
use futures::StreamExt;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_is_not_buffered() {
    let upstream = Upstream::start().await;
    upstream
        .switches
        .gate_after_first_chunk
        .store(true, Ordering::SeqCst);
    let router = start_router(fast_config(vec![worker("sglang", &upstream.url)], "")).await;

    let response = router.chat("hello there", true).await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let mut body = response.bytes_stream();
    // The upstream holds every later chunk until we have seen the first one,
    // so this only completes if the router forwarded it unbuffered.
    let first = body.next().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: "), "{first:?}");
    upstream.switches.continue_stream.notify_one();
    let mut rest = Vec::new();
    while let Some(chunk) = body.next().await {
        rest.extend_from_slice(&chunk.unwrap());
    }
    let rest = String::from_utf8(rest).unwrap();
    assert!(rest.ends_with("data: [DONE]\n\n"), "{rest}");
    assert_eq!(rest.matches("data: ").count(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_shaped_errors() {
    let upstream = Upstream::start().await;
    let mut config = fast_config(vec![worker("sglang", &upstream.url)], "");
    config.server.body_limit_bytes = 1024;
    let router = start_router(config).await;

    let malformed = router
        .client
        .post(format!("{}/v1/completions", router.base))
        .header("content-type", "application/json")
        .body("{\"prompt\": ")
        .send()
        .await
        .unwrap();
    assert_eq!(malformed.status(), 400);
    let error: serde_json::Value = malformed.json().await.unwrap();
    assert_eq!(error["error"]["type"], "invalid_request_error");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("request body is not valid JSON"),
        "{error}"
    );

    let too_big = router
        .client
        .post(format!("{}/v1/completions", router.base))
        .body(format!("{{\"prompt\": \"{}\"}}", "x".repeat(4096)))
        .send()
        .await
        .unwrap();
    assert_eq!(too_big.status(), 413);
    let error: serde_json::Value = too_big.json().await.unwrap();
    assert_eq!(
        error["error"]["message"],
        "request body exceeds 1024 bytes (server.body_limit_bytes)"
    );
    assert_eq!(upstream.requests(), 0, "nothing bad reached the worker");

    let ok = router.chat("fine", false).await;
    assert_eq!(ok.status(), 200);
    let body: serde_json::Value = ok.json().await.unwrap();
    assert_eq!(body["choices"][0]["message"]["content"], "t0t1t2t3");
}

/// `POST` to a generation path skips axum's route table; any other method
/// or path still gets axum's answers, as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_posts_to_the_generation_paths_skip_the_route_table() {
    let upstream = Upstream::start().await;
    let router = start_router(fast_config(vec![worker("sglang", &upstream.url)], "")).await;
    wait_until("the worker is in rotation", || async {
        router.in_rotation_count().await == 1
    })
    .await;
    let paths = ["/v1/chat/completions", "/v1/completions", "/generate"];
    for path in paths {
        let get = router
            .client
            .get(format!("{}{path}", router.base))
            .send()
            .await
            .unwrap();
        assert_eq!(get.status(), 405, "GET {path}");
        let allow = get.headers()["allow"].to_str().unwrap().to_owned();
        assert!(allow.contains("POST"), "GET {path}: allow {allow}");
        let slash = router
            .client
            .post(format!("{}{path}/", router.base))
            .body("{}")
            .send()
            .await
            .unwrap();
        assert_eq!(slash.status(), 404, "POST {path}/");
    }
    assert_eq!(upstream.requests(), 0, "nothing reached the worker");
    for path in paths {
        let answer = router
            .client
            .post(format!("{}{path}?trace=1", router.base))
            .json(&serde_json::json!({
                "model": "test-model",
                "messages": [{"role": "user", "content": "hi"}],
            }))
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), 200, "POST {path}?trace=1");
    }
    assert_eq!(upstream.requests(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_disconnect_releases_pending_and_in_flight_work() {
    let upstream = Upstream::start().await;
    upstream
        .switches
        .gate_after_first_chunk
        .store(true, Ordering::SeqCst);
    upstream.switches.hold.store(true, Ordering::SeqCst);
    let router = start_router(fast_config(vec![worker("sglang", &upstream.url)], "")).await;

    // 400 characters at 4 per token: 100 pending tokens while the upstream holds.
    let client = router.client.clone();
    let url = format!("{}/v1/chat/completions", router.base);
    let request = tokio::spawn(async move {
        client
            .post(url)
            .json(&serde_json::json!({"stream": true, "messages": [{"role": "user", "content": "x".repeat(400)}]}))
            .send()
            .await
    });
    wait_until("the request is pending at the worker", || async {
        let workers = router.workers_json().await;
        workers["workers"][0]["pending_tokens"] == 100 && workers["workers"][0]["in_flight"] == 1
    })
    .await;
    // The client goes away before any token.
    request.abort();
    let _ = request.await;
    upstream.switches.release.notify_waiters();
    wait_until("pending work and in-flight are released", || async {
        let workers = router.workers_json().await;
        workers["workers"][0]["pending_tokens"] == 0 && workers["workers"][0]["in_flight"] == 0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_admission_off_the_cap_answers_503_with_retry_after() {
    let upstream = Upstream::start().await;
    upstream.switches.hold.store(true, Ordering::SeqCst);
    let router = start_router(fast_config(
        vec![worker("sglang", &upstream.url)],
        "[policy]\nkind = \"least_load\"\n[policy.least_load]\nmax_waiting_requests = 1\n\
         [admission]\nenabled = false\n",
    ))
    .await;
    wait_until("the worker is healthy", || async {
        router.healthy_count().await == 1
    })
    .await;

    let client = router.client.clone();
    let url = format!("{}/v1/chat/completions", router.base);
    let held = tokio::spawn(async move {
        client
            .post(url)
            .json(&serde_json::json!({"messages": [{"role": "user", "content": "first"}]}))
            .send()
            .await
            .unwrap()
            .status()
    });
    wait_until("the first request holds the only slot", || async {
        upstream.requests() == 1
    })
    .await;

    let rejected = router.chat("second", false).await;
    assert_eq!(rejected.status(), 503);
    assert_eq!(rejected.headers()["retry-after"], "1");
    let error: serde_json::Value = rejected.json().await.unwrap();
    assert_eq!(error["error"]["type"], "unavailable");
    assert_eq!(
        upstream.requests(),
        1,
        "the capped request never reached the worker"
    );

    upstream.switches.release.notify_waiters();
    assert_eq!(held.await.unwrap(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_worker_is_retried_around_taken_out_and_comes_back() {
    let alive = Upstream::start().await;
    let doomed = Upstream::start().await;
    let doomed_address = doomed.address;
    let mut config = fast_config(
        vec![worker("sglang", &alive.url), worker("sglang", &doomed.url)],
        "[policy]\nkind = \"round_robin\"\n",
    );
    config.outlier_detection.base_ejection_ms = 200;
    let router = start_router(config).await;
    wait_until("both workers are healthy", || async {
        router.healthy_count().await == 2
    })
    .await;

    // Kill one worker mid-run: every request still succeeds (retried around it).
    drop(doomed);
    for index in 0..20 {
        let response = router.chat(&format!("request {index}"), false).await;
        assert_eq!(response.status(), 200, "request {index}");
    }
    wait_until("the dead worker is out of rotation", || async {
        router.in_rotation_count().await == 1
    })
    .await;

    // It recovers on the same address; health checks and a passing
    // generation probe bring it back.
    let revived = Upstream::start_on(&doomed_address.to_string()).await;
    wait_until("the revived worker is back in rotation", || async {
        router.in_rotation_count().await == 2
    })
    .await;
    for index in 0..10 {
        assert_eq!(
            router.chat(&format!("again {index}"), false).await.status(),
            200
        );
    }
    assert!(
        revived.requests() > 0,
        "round robin sends to the revived worker"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_answering_503_is_retried_on_another() {
    let refusing = Upstream::start().await;
    refusing.switches.fail_status.store(503, Ordering::SeqCst);
    let healthy = Upstream::start().await;
    let router = start_router(fast_config(
        vec![
            worker("sglang", &refusing.url),
            worker("sglang", &healthy.url),
        ],
        "[policy]\nkind = \"round_robin\"\n",
    ))
    .await;
    wait_until("both workers are healthy", || async {
        router.healthy_count().await == 2
    })
    .await;
    for index in 0..6 {
        let response = router.chat(&format!("r{index}"), false).await;
        assert_eq!(response.status(), 200, "request {index} was retried");
    }
    assert_eq!(healthy.requests(), 6);
    let metrics = router
        .client
        .get(format!("{}/metrics", router.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(metrics.contains("router_retries_total"), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_retry_left_the_workers_own_answer_reaches_the_client() {
    let refusing = Upstream::start().await;
    refusing.switches.fail_status.store(503, Ordering::SeqCst);
    let mut config = fast_config(vec![worker("sglang", &refusing.url)], "");
    config.server.max_retries = 0;
    let router = start_router(config).await;
    wait_until("the worker is healthy", || async {
        router.healthy_count().await == 1
    })
    .await;
    let response = router.chat("hello", false).await;
    assert_eq!(
        response.status(),
        503,
        "the worker's status, not the router's"
    );
    assert!(
        response.headers().get("retry-after").is_none(),
        "Retry-After is only for the router's own lack of capacity"
    );
    let error: serde_json::Value = response.json().await.unwrap();
    assert_eq!(error["error"]["type"], "upstream_error");
    let message = error["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("upstream failure"),
        "the worker's plain-text body is carried in an OpenAI-shaped error: {message}"
    );
    assert_eq!(refusing.requests(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_migration_off_a_worker_answering_500_is_passed_through_and_ejected_not_retried() {
    let failing = Upstream::start().await;
    failing.switches.fail_status.store(500, Ordering::SeqCst);
    let healthy = Upstream::start().await;
    let mut config = fast_config(
        vec![
            worker("sglang", &failing.url),
            worker("sglang", &healthy.url),
        ],
        "[policy]\nkind = \"round_robin\"\n",
    );
    config.outlier_detection.base_ejection_ms = 200;
    migration_off(&mut config);
    let router = start_router(config).await;
    wait_until("both workers are healthy", || async {
        router.healthy_count().await == 2
    })
    .await;
    let mut failed = 0;
    for index in 0..12 {
        let response = router.chat(&format!("r{index}"), false).await;
        match response.status().as_u16() {
            200 => {}
            500 => failed += 1,
            other => panic!("request {index}: {other}"),
        }
    }
    let threshold = router.config.outlier_detection.consecutive_failures;
    assert_eq!(
        failed, threshold,
        "the 500s pass through until the worker is ejected"
    );
    assert_eq!(
        failing.requests(),
        u64::from(threshold),
        "a 500 is never re-run on another worker"
    );
    assert_eq!(healthy.requests(), 12 - u64::from(threshold));
    // /health keeps passing, but the generation probe fails: it stays out.
    wait_until("the failing worker was probed", || async {
        failing.switches.probes.load(Ordering::SeqCst) >= 2
    })
    .await;
    assert_eq!(router.in_rotation_count().await, 1);
    // Fixed: the next probe passes and it takes traffic again.
    failing.switches.fail_status.store(0, Ordering::SeqCst);
    wait_until("the fixed worker is back in rotation", || async {
        router.in_rotation_count().await == 2
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_hundred_concurrent_streams_finish_with_none_lost() {
    let upstreams = [Upstream::start().await, Upstream::start().await];
    let router = start_router(fast_config(
        upstreams
            .iter()
            .map(|upstream| worker("sglang", &upstream.url))
            .collect(),
        "",
    ))
    .await;
    wait_until("both workers are healthy", || async {
        router.healthy_count().await == 2
    })
    .await;

    let url = format!("{}/v1/chat/completions", router.base);
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(512)
        .build()
        .unwrap();
    let tasks: Vec<_> = (0..500)
        .map(|index| {
            let client = client.clone();
            let url = url.clone();
            tokio::spawn(async move {
                let response = client
                    .post(url)
                    .json(&serde_json::json!({"stream": true, "messages": [{"role": "user", "content": format!("n{index}")}]}))
                    .send()
                    .await?;
                let status = response.status();
                let text = response.text().await?;
                Ok::<_, reqwest::Error>((status, text))
            })
        })
        .collect();
    let mut completed = 0;
    for task in tasks {
        let (status, text) = task.await.unwrap().unwrap();
        assert_eq!(status, 200);
        assert!(text.ends_with("data: [DONE]\n\n"));
        completed += 1;
    }
    assert_eq!(completed, 500);
    // One upstream request each, and one more for each stream the router
    // hedged (a response head over a second late on a loaded machine):
    // nothing else was sent twice.
    wait_until(
        "every upstream request is a stream or a counted hedge",
        || async {
            let mut hedged = 0.0;
            for outcome in ["won", "lost", "failed"] {
                hedged += metric(
                    &router,
                    &format!("router_hedges_total{{outcome=\"{outcome}\"}}"),
                )
                .await;
            }
            (upstreams[0].requests() + upstreams[1].requests()) as f64 == 500.0 + hedged
        },
    )
    .await;
    wait_until("nothing is left in flight", || async {
        let workers = router.workers_json().await;
        workers["workers"]
            .as_array()
            .unwrap()
            .iter()
            .all(|worker| worker["in_flight"] == 0 && worker["pending_tokens"] == 0)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_never_lists_its_models_does_not_hold_up_the_others() {
    let answering = Upstream::start().await;
    let hanging = Upstream::start().await;
    hanging.switches.hang_models.store(true, Ordering::SeqCst);
    let router = start_router(fast_config(
        vec![
            worker("sglang", &hanging.url),
            worker("sglang", &answering.url),
        ],
        "",
    ))
    .await;
    wait_until("both workers are healthy", || async {
        router.healthy_count().await == 2
    })
    .await;

    // The hung worker costs the health-check timeout (500 ms here); the
    // deadline only stops the test from hanging if it costs forever.
    let listing = tokio::time::timeout(
        std::time::Duration::from_secs(30),
        router
            .client
            .get(format!("{}/v1/models", router.base))
            .send(),
    )
    .await
    .expect("/v1/models answered before the deadline")
    .unwrap();
    assert_eq!(listing.status(), 200);
    let models: serde_json::Value = listing.json().await.unwrap();
    assert_eq!(
        models["data"],
        serde_json::json!([{"id": "test-model", "object": "model"}]),
        "the answering worker's models, once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_field_split_byte_by_byte_is_still_the_first_token() {
    let upstream = Upstream::start().await;
    upstream
        .switches
        .first_chunk_bytewise
        .store(true, Ordering::SeqCst);
    upstream
        .switches
        .gate_after_first_chunk
        .store(true, Ordering::SeqCst);
    let router = start_router(fast_config(vec![worker("sglang", &upstream.url)], "")).await;
    wait_until("the worker is healthy", || async {
        router.healthy_count().await == 1
    })
    .await;
    let response = router.chat("a prompt of a few tokens", true).await;
    assert_eq!(response.status(), 200);
    let mut body = response.bytes_stream();
    let mut first = Vec::new();
    while !first.ends_with(b"\n\n") {
        first.extend_from_slice(&body.next().await.unwrap().unwrap());
    }
    assert!(first.starts_with(b"data: "), "{first:?}");
    // The stream is held open after its first event: its prompt is no
    // longer pending work on the worker.
    wait_until("the first token released the pending work", || async {
        router.workers_json().await["workers"][0]["pending_tokens"] == 0
    })
    .await;
    upstream.switches.continue_stream.notify_one();
    while let Some(chunk) = body.next().await {
        chunk.unwrap();
    }
}

/// One upstream that holds every stream after its first event, and a
/// healthy router in front of it with `tweak` applied to its config.
/// Migration off: a broken stream ends with an error event, a non-streaming
/// request goes upstream as it came.
fn migration_off(config: &mut router::config::RouterConfig) {
    config.migration.max_migrations = 0;
    config.migration.non_streaming_as_stream = false;
}

async fn held_stream_router(
    tweak: impl FnOnce(&mut router::config::RouterConfig),
) -> (Upstream, common::TestRouter) {
    let upstream = Upstream::start().await;
    upstream
        .switches
        .gate_after_first_chunk
        .store(true, Ordering::SeqCst);
    let mut config = fast_config(vec![worker("sglang", &upstream.url)], "");
    tweak(&mut config);
    let router = start_router(config).await;
    wait_until("the worker is healthy", || async {
        router.healthy_count().await == 1
    })
    .await;
    (upstream, router)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_past_its_deadline_ends_with_an_error_event() {
    let (_upstream, router) = held_stream_router(|config| {
        config.server.first_byte_timeout_ms = 300;
        config.server.request_deadline_ms = 600;
    })
    .await;
    let response = router.chat("hello", true).await;
    assert_eq!(response.status(), 200);
    // The upstream never continues: the router ends the stream itself.
    let text = String::from_utf8(response.bytes().await.unwrap().to_vec()).unwrap();
    let last = text
        .lines()
        .rev()
        .find_map(|line| line.strip_prefix("data: "))
        .unwrap();
    let event: serde_json::Value = serde_json::from_str(last).unwrap();
    assert_eq!(event["error"]["type"], "timeout");
    assert!(
        event["error"]["message"]
            .as_str()
            .unwrap()
            .contains("request_deadline_ms"),
        "{event}"
    );
    assert!(!text.contains("[DONE]"));
    // Running past the client's own deadline is not the worker's failure.
    assert_eq!(
        router.workers_json().await["workers"][0]["consecutive_failures"],
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_migration_off_a_stalled_stream_ends_with_an_error_event_and_counts_against_the_worker()
 {
    let (_upstream, router) = held_stream_router(|config| {
        migration_off(config);
        config.server.stream_idle_timeout_ms = 300;
    })
    .await;
    let response = router.chat("hello", true).await;
    let text = String::from_utf8(response.bytes().await.unwrap().to_vec()).unwrap();
    assert!(text.starts_with("data: "), "the first event passed: {text}");
    assert!(
        text.contains("stream_idle_timeout_ms"),
        "then an error event: {text}"
    );
    assert_eq!(
        router.workers_json().await["workers"][0]["consecutive_failures"],
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_stream_holds_its_worker_back_until_it_sends_again() {
    let (upstream, router) = held_stream_router(|config| {
        // The second request is non-streaming and must not be held back
        // by the upstream's gate, which holds every stream.
        config.migration.non_streaming_as_stream = false;
        config.server.stream_idle_timeout_ms = 60_000;
        config.outlier_detection.silent_stream_ms = 200;
    })
    .await;
    let response = router.chat("hello", true).await;
    assert_eq!(response.status(), 200);
    let mut body = response.bytes_stream();
    let first = body.next().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: "), "the first event passed");
    let worker = || async { router.workers_json().await["workers"][0].clone() };
    wait_until("the silent stream holds its worker back", || async {
        worker().await["held_back"] == true
    })
    .await;
    assert_eq!(worker().await["silent_streams"], 1);
    assert_eq!(
        worker().await["consecutive_failures"],
        0,
        "silence is not yet a failure"
    );
    // The only worker still serves: held back is a preference.
    let answer = router.chat("again", false).await;
    assert_eq!(answer.status(), 200);
    upstream.switches.continue_stream.notify_one();
    let mut rest = Vec::new();
    while let Some(chunk) = body.next().await {
        rest.extend_from_slice(&chunk.unwrap());
    }
    assert!(
        String::from_utf8_lossy(&rest).contains("[DONE]"),
        "the stream finished"
    );
    wait_until("the worker is back in selection", || async {
        worker().await["held_back"] == false
    })
    .await;
    assert_eq!(worker().await["silent_streams"], 0);
}

/// A streamed chat whose prompt is long enough to be hashed, with
/// `stream_options` as the client sets it (`None`: not at all).
fn hashed_stream_body(stream_options: Option<serde_json::Value>) -> serde_json::Value {
    let mut body = serde_json::json!({
        "model": "test-model",
        "stream": true,
        "messages": [{"role": "user", "content": "a prompt long enough to hash. ".repeat(40)}],
    });
    if let Some(options) = stream_options {
        body["stream_options"] = options;
    }
    body
}

/// What the client read, and the body the upstream got.
async fn stream_through(
    router: &common::TestRouter,
    upstream: &Upstream,
    body: &serde_json::Value,
) -> (String, serde_json::Value) {
    let response = router
        .client
        .post(format!("{}/v1/chat/completions", router.base))
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let read = response.text().await.unwrap();
    let sent = upstream
        .switches
        .bodies
        .lock()
        .unwrap()
        .last()
        .cloned()
        .unwrap();
    (read, serde_json::from_slice(&sent).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_reports_cached_tokens_whether_or_not_its_client_asked_for_usage() {
    let upstream = Upstream::start().await;
    upstream
        .switches
        .report_cached
        .store(true, Ordering::SeqCst);
    upstream.switches.cached_tokens.store(64, Ordering::SeqCst);
    let router = start_router(fast_config(vec![worker("sglang", &upstream.url)], "")).await;
    let reports = || async {
        let mut total = 0.0;
        for outcome in ["as_predicted", "fewer", "more"] {
            let series = format!(
                "router_prefix_cache_reports_total{{worker=\"{}\",outcome=\"{outcome}\"}}",
                upstream.url
            );
            total += common::metric(&router, &series).await;
        }
        total
    };

    // Not asked: the router asks the engine, reads the report and keeps
    // the usage chunk (empty `choices`) from the client.
    let (read, sent) = stream_through(&router, &upstream, &hashed_stream_body(None)).await;
    assert_eq!(
        sent["stream_options"],
        serde_json::json!({"include_usage": true})
    );
    assert!(!read.contains("usage"), "{read}");
    assert_eq!(
        read.matches("data: ").count(),
        5,
        "4 tokens and [DONE]: {read}"
    );
    assert!(read.ends_with("data: [DONE]\n\n"), "{read}");
    assert_eq!(reports().await, 1.0);

    // Asked: the body goes as it came, and the client gets its chunk.
    let asked = hashed_stream_body(Some(serde_json::json!({"include_usage": true})));
    let (read, sent) = stream_through(&router, &upstream, &asked).await;
    assert_eq!(sent, asked);
    assert!(read.contains("\"choices\":[]"), "{read}");
    assert!(read.contains("\"cached_tokens\":64"), "{read}");
    assert_eq!(reports().await, 2.0);

    // Declined: the client's choice stands; there is no report to read.
    let declined = hashed_stream_body(Some(serde_json::json!({"include_usage": false})));
    let (read, sent) = stream_through(&router, &upstream, &declined).await;
    assert_eq!(sent, declined);
    assert!(!read.contains("usage"), "{read}");
    assert_eq!(reports().await, 2.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_ask_stream_usage_off_the_router_leaves_the_body_alone() {
    let upstream = Upstream::start().await;
    let mut config = fast_config(vec![worker("sglang", &upstream.url)], "");
    config.request.ask_stream_usage = false;
    let router = start_router(config).await;
    let body = hashed_stream_body(None);
    let (read, sent) = stream_through(&router, &upstream, &body).await;
    assert_eq!(sent, body);
    assert!(read.ends_with("data: [DONE]\n\n"), "{read}");
}
