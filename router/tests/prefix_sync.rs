//! Prefix sharing between replicas end to end: real routers in-process on
//! loopback, a real `nats-server` (installed from Debian when missing), and
//! scriptable upstream engines. A placement made on one replica steers the
//! same prompt on another; a starting replica warms from a running one's
//! snapshot; an engine's cached-tokens report is counted against the
//! prediction and a bound it teaches is shared; with the broker away,
//! routing goes on.

// Test helpers outside #[test] functions fail loudly on purpose.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use common::nats::NatsServer;
use common::upstream::Upstream;
use common::{
    TestRouter, explain_column, fast_config, metric, start_router, sync_connected, wait_until,
    worker,
};

fn sync_section(nats_url: &str, replica: &str, share_prefixes: bool) -> String {
    format!(
        "[sync]\nenabled = true\nnats_url = \"{nats_url}\"\nreplica_id = \"{replica}\"\n\
         publish_interval_ms = 20\nentry_ttl_ms = 1000\nshare_prefixes = {share_prefixes}\n"
    )
}

async fn replica_with(
    nats_url: &str,
    id: &str,
    upstreams: &[&Upstream],
    share_prefixes: bool,
    extra: &str,
) -> TestRouter {
    let workers = upstreams
        .iter()
        .map(|upstream| worker("sglang", &upstream.url))
        .collect();
    start_router(fast_config(
        workers,
        &format!("{}{extra}", sync_section(nats_url, id, share_prefixes)),
    ))
    .await
}

async fn replica(nats: &NatsServer, id: &str, upstreams: &[&Upstream]) -> TestRouter {
    replica_with(&nats.url, id, upstreams, true, "").await
}

/// About `tokens` tokens of text (4 characters each) that starts with `tag`.
fn text(tag: &str, tokens: usize) -> String {
    let mut text = format!("{tag}: ");
    while text.len() < tokens * 4 {
        text.push_str("a long system prompt that every turn of the chat repeats. ");
    }
    text.truncate(tokens * 4);
    text
}

/// A chat request whose system prompt is `system`, then `question`.
fn chat_body(system: &str, question: &str, stream: bool) -> serde_json::Value {
    serde_json::json!({
        "model": "test-model",
        "stream": stream,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
    })
}

async fn send(router: &TestRouter, body: &serde_json::Value) -> String {
    let response = router
        .client
        .post(format!("{}/v1/chat/completions", router.base))
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    response.text().await.unwrap()
}

/// Sends `body` through `router` and returns the index of the upstream that
/// served it.
async fn served_by(
    router: &TestRouter,
    upstreams: &[&Upstream],
    body: &serde_json::Value,
) -> usize {
    let before: Vec<u64> = upstreams
        .iter()
        .map(|upstream| upstream.requests())
        .collect();
    send(router, body).await;
    let served: Vec<usize> = (0..upstreams.len())
        .filter(|index| upstreams[*index].requests() > before[*index])
        .collect();
    assert_eq!(served.len(), 1, "one upstream served the request");
    served[0]
}

/// The explain table for the request `body`, as JSON.
async fn explain(router: &TestRouter, body: &serde_json::Value) -> serde_json::Value {
    let response = router
        .client
        .post(format!("{}/admin/policy/explain", router.base))
        .header("accept", "application/json")
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    response.json().await.unwrap()
}

async fn ready(routers: &[&TestRouter], workers: usize) {
    wait_until(
        "every replica is connected and its workers healthy",
        || async {
            for router in routers {
                if !sync_connected(router).await || router.healthy_count().await != workers {
                    return false;
                }
            }
            true
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_placement_on_one_replica_steers_the_same_prompt_on_another() {
    let nats = NatsServer::start();
    let upstreams = [Upstream::start().await, Upstream::start().await];
    let both: Vec<&Upstream> = upstreams.iter().collect();
    let a = replica(&nats, "a", &both).await;
    let b = replica(&nats, "b", &both).await;
    ready(&[&a, &b], 2).await;

    // About 4000 tokens of system prompt: sixteen 256-token index blocks.
    let system = text("fleet X", 4000);
    let first = chat_body(&system, "turn 1: which engine is idle?", false);
    let home = served_by(&a, &both, &first).await;
    let home_url = &upstreams[home].url;
    let other_url = &upstreams[1 - home].url;

    // The next turn, on B: it extends the prompt A placed.
    let next = chat_body(&system, "turn 2: and which is busy?", false);
    wait_until(
        "B expects the prompt on A's worker, and A's request is done",
        || async {
            let table = explain(&b, &next).await;
            explain_column(&table, home_url, "cached_tok") > 0.0
                && explain_column(&table, home_url, "remote_tok") == 0.0
        },
    )
    .await;
    let table = explain(&b, &next).await;
    assert_eq!(explain_column(&table, other_url, "cached_tok"), 0.0);
    // The cached prefix is worth about two seconds of prefill at the
    // default rate, far past the tie tolerance (10 ms): no tie decides it.
    assert!(
        explain_column(&table, home_url, "score_s") + 0.5
            < explain_column(&table, other_url, "score_s"),
        "{table}"
    );
    assert_eq!(
        served_by(&b, &both, &next).await,
        home,
        "B sent the next turn home"
    );
    assert!(metric(&a, "router_sync_placements_sent_total").await >= 1.0);
    assert!(
        metric(
            &b,
            "router_sync_placements_received_total{outcome=\"applied\"}"
        )
        .await
            >= 1.0
    );
    assert!(metric(&a, "router_sync_bytes_sent_total{subject=\"prefix\"}").await > 0.0);
    assert!(metric(&a, "router_sync_bytes_sent_total{subject=\"pending\"}").await > 0.0);

    // Junk on the prefix subject is counted and changes nothing.
    let outsider = async_nats::connect(nats.url.as_str()).await.unwrap();
    for payload in [
        &b"not json"[..],
        br#"{"v":2,"replica":"x","seq":1,"workers":[]}"#,
        br#"{"v":1,"replica":"x","seq":1,"workers":["http://w:1"],"placed":[[0,256,[-1]],[7,256,[1]]]}"#,
    ] {
        outsider
            .publish("llm-router.prefix", payload.to_vec().into())
            .await
            .unwrap();
    }
    outsider.flush().await.unwrap();
    wait_until("the junk is counted", || async {
        metric(
            &b,
            "router_sync_prefix_messages_received_total{outcome=\"malformed\"}",
        )
        .await
            >= 1.0
            && metric(
                &b,
                "router_sync_prefix_messages_received_total{outcome=\"foreign_version\"}",
            )
            .await
                >= 1.0
            && metric(
                &b,
                "router_sync_placements_received_total{outcome=\"invalid\"}",
            )
            .await
                >= 2.0
    })
    .await;
    assert_eq!(served_by(&b, &both, &next).await, home);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_sharing_off_the_other_replica_does_not_know() {
    let nats = NatsServer::start();
    let upstreams = [Upstream::start().await, Upstream::start().await];
    let both: Vec<&Upstream> = upstreams.iter().collect();
    let a = Arc::new(replica_with(&nats.url, "a", &both, false, "").await);
    let b = replica_with(&nats.url, "b", &both, false, "").await;
    ready(&[&a, &b], 2).await;

    let system = text("fleet Y", 4000);
    let first = chat_body(&system, "turn 1", false);
    // A's request is held at the engine: B sees it as A's pending work,
    // which goes out at the same wake as a placement would.
    for upstream in &upstreams {
        upstream.switches.hold.store(true, Ordering::SeqCst);
    }
    let held = {
        let (a, first) = (a.clone(), first.clone());
        tokio::spawn(async move { send(&a, &first).await })
    };
    let next = chat_body(&system, "turn 2", false);
    wait_until("B shows A's pending request", || async {
        let table = explain(&b, &next).await;
        upstreams
            .iter()
            .map(|upstream| explain_column(&table, &upstream.url, "remote_req"))
            .sum::<f64>()
            == 1.0
    })
    .await;
    let table = explain(&b, &next).await;
    for upstream in &upstreams {
        assert_eq!(
            explain_column(&table, &upstream.url, "cached_tok"),
            0.0,
            "{table}"
        );
    }
    assert_eq!(metric(&a, "router_sync_placements_sent_total").await, 0.0);
    assert_eq!(
        metric(
            &b,
            "router_sync_prefix_messages_received_total{outcome=\"applied\"}"
        )
        .await,
        0.0
    );
    for upstream in &upstreams {
        upstream.switches.hold.store(false, Ordering::SeqCst);
    }
    wait_until("the held request completes", || async {
        for upstream in &upstreams {
            upstream.switches.release.notify_waiters();
        }
        held.is_finished()
    })
    .await;
    held.await.unwrap();
    // A still knows its own placement.
    let table = explain(&a, &next).await;
    let cached: f64 = upstreams
        .iter()
        .map(|upstream| explain_column(&table, &upstream.url, "cached_tok"))
        .sum();
    assert!(cached > 0.0, "{table}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_starting_replica_warms_from_a_running_ones_snapshot() {
    let nats = NatsServer::start();
    let upstreams = [Upstream::start().await, Upstream::start().await];
    let both: Vec<&Upstream> = upstreams.iter().collect();
    let a = replica(&nats, "a", &both).await;
    ready(&[&a], 2).await;
    let systems: Vec<String> = (0..4).map(|i| text(&format!("tenant {i}"), 2000)).collect();
    let mut homes = Vec::new();
    for system in &systems {
        homes.push(served_by(&a, &both, &chat_body(system, "hello", false)).await);
    }

    // C starts after those placements were made: only A's snapshot can
    // tell it where they went.
    let c = replica(&nats, "c", &both).await;
    wait_until("C has warmed from A's snapshot", || async {
        metric(&c, "router_sync_warmups_total{outcome=\"complete\"}").await >= 1.0
    })
    .await;
    for (system, home) in systems.iter().zip(&homes) {
        let table = explain(&c, &chat_body(system, "and again", false)).await;
        assert!(
            explain_column(&table, &upstreams[*home].url, "cached_tok") > 0.0,
            "C expects the prompt where A sent it: {table}"
        );
        assert_eq!(
            explain_column(&table, &upstreams[1 - home].url, "cached_tok"),
            0.0,
            "{table}"
        );
    }
    assert!(metric(&c, "router_sync_warmup_blocks_total").await >= 4.0);
    assert!(metric(&c, "router_sync_warmup_bytes_total").await > 0.0);
    assert!(metric(&a, "router_sync_snapshots_served_total").await >= 1.0);
    assert!(metric(&a, "router_sync_bytes_sent_total{subject=\"snapshot\"}").await > 0.0);
    // And it routes by what it loaded.
    for (system, home) in systems.iter().zip(&homes) {
        assert_eq!(
            served_by(&c, &both, &chat_body(system, "third turn", false)).await,
            *home
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_of_fewer_cached_tokens_is_counted_and_its_bound_shared() {
    let nats = NatsServer::start();
    let upstream = Upstream::start().await;
    // A small assumed cache, so a few thousand tokens dispatched since a
    // prefix make its miss evidence of eviction.
    let policy = "[policy.least_load]\nprefix_cache_tokens = 8000\n";
    let a = replica_with(&nats.url, "a", &[&upstream], true, policy).await;
    let b = replica_with(&nats.url, "b", &[&upstream], true, policy).await;
    ready(&[&a, &b], 1).await;
    let url = &upstream.url;
    let series = |name: &str| format!("router_prefix_{name}{{worker=\"{url}\"}}");
    let report = |outcome: &str| {
        format!("router_prefix_cache_reports_total{{worker=\"{url}\",outcome=\"{outcome}\"}}")
    };
    upstream
        .switches
        .report_cached
        .store(true, Ordering::SeqCst);
    upstream.switches.cached_tokens.store(0, Ordering::SeqCst);

    let system = text("fleet Z", 4000);
    // First turn: nothing expected, nothing reported.
    send(&a, &chat_body(&system, "turn 1", false)).await;
    // Another prompt goes there: the worker's cache moves on by 2000 tokens.
    send(&a, &chat_body(&text("other", 2000), "unrelated", false)).await;
    assert_eq!(
        metric(&a, &series("predicted_cached_tokens_total")).await,
        0.0
    );
    assert_eq!(metric(&a, &report("as_predicted")).await, 2.0);

    // Second turn, streamed: the router expects the system prompt cached,
    // the engine says it served none of it, in the closing usage chunk the
    // router asked for and the client did not.
    let table = explain(&a, &chat_body(&system, "turn 2", true)).await;
    let expected = explain_column(&table, url, "cached_tok");
    assert!(expected >= 3000.0, "{table}");
    let streamed = send(&a, &chat_body(&system, "turn 2", true)).await;
    let sent: serde_json::Value =
        serde_json::from_slice(upstream.switches.bodies.lock().unwrap().last().unwrap()).unwrap();
    assert_eq!(sent["stream_options"]["include_usage"], true);
    assert!(!streamed.contains("usage"), "{streamed}");
    assert_eq!(streamed.matches("\"content\":\"t").count(), 4, "{streamed}");
    assert!(streamed.ends_with("data: [DONE]\n\n"), "{streamed}");
    assert_eq!(
        metric(&a, &series("predicted_cached_tokens_total")).await,
        expected
    );
    assert_eq!(
        metric(&a, &series("reported_cached_tokens_total")).await,
        0.0
    );
    assert_eq!(metric(&a, &report("fewer")).await, 1.0);
    let bound = metric(&a, &series("cache_bound_tokens")).await;
    assert!(
        bound > 0.0 && bound < 8000.0,
        "the bound dropped to what the cache kept: {bound}"
    );
    wait_until("A published the bound", || async {
        metric(&a, "router_sync_bounds_sent_total").await == 1.0
    })
    .await;
    wait_until("B applied A's learned bound", || async {
        metric(&b, "router_sync_bounds_received_total{outcome=\"applied\"}").await >= 1.0
    })
    .await;
    assert_eq!(metric(&b, &series("cache_bound_tokens")).await, bound);

    // A report at the prediction counts as such, and the reported tokens
    // add up.
    upstream
        .switches
        .cached_tokens
        .store(1234, Ordering::SeqCst);
    send(&a, &chat_body(&text("new", 1000), "q", false)).await;
    assert_eq!(
        metric(&a, &series("reported_cached_tokens_total")).await,
        1234.0
    );
    assert_eq!(metric(&a, &report("more")).await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_broker_away_prefixed_requests_route_and_placements_are_counted_unsent() {
    // Nothing listens on this port.
    let port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port()
    };
    let upstreams = [Upstream::start().await, Upstream::start().await];
    let both: Vec<&Upstream> = upstreams.iter().collect();
    let a = replica_with(&format!("nats://127.0.0.1:{port}"), "a", &both, true, "").await;
    wait_until("both workers are healthy", || async {
        a.healthy_count().await == 2
    })
    .await;
    let system = text("fleet W", 4000);
    let home = served_by(&a, &both, &chat_body(&system, "turn 1", false)).await;
    for turn in 2..6 {
        let body = chat_body(&system, &format!("turn {turn}"), turn % 2 == 0);
        assert_eq!(
            served_by(&a, &both, &body).await,
            home,
            "its own placements steer it"
        );
    }
    wait_until("the placements are counted as unsent", || async {
        metric(
            &a,
            "router_sync_placements_dropped_total{reason=\"unsent\"}",
        )
        .await
            >= 5.0
    })
    .await;
    assert_eq!(metric(&a, "router_sync_connected").await, 0.0);
    assert_eq!(
        metric(&a, "router_sync_warmups_total{outcome=\"no_answer\"}").await,
        0.0,
        "no warm-up without a broker"
    );
}
