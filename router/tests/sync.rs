//! Replica sync end to end: real routers in-process on loopback, a real
//! `nats-server` (installed from Debian when missing), and scriptable
//! upstream engines.

// Test helpers outside #[test] functions fail loudly on purpose.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use common::nats::NatsServer;
use common::upstream::Upstream;
use common::{
    TestRouter, explain_column, fast_config, metric, start_router, sync_connected, wait_until,
    worker,
};

fn sync_section(nats: &NatsServer, replica: &str) -> String {
    format!(
        "[sync]\nenabled = true\nnats_url = \"{}\"\nreplica_id = \"{replica}\"\n\
         publish_interval_ms = 20\nentry_ttl_ms = 1000\n",
        nats.url
    )
}

async fn replica(nats: &NatsServer, id: &str, upstreams: &[&Upstream]) -> TestRouter {
    let workers = upstreams
        .iter()
        .map(|upstream| worker("sglang", &upstream.url))
        .collect();
    start_router(fast_config(workers, &sync_section(nats, id))).await
}

/// Replicas "a" and "b" over `upstream`, once both are connected to the
/// broker and see the worker healthy.
async fn connected_pair(nats: &NatsServer, upstream: &Upstream) -> (TestRouter, TestRouter) {
    let a = replica(nats, "a", &[upstream]).await;
    let b = replica(nats, "b", &[upstream]).await;
    wait_until(
        "both replicas are connected and the worker healthy",
        || async {
            sync_connected(&a).await && sync_connected(&b).await && b.healthy_count().await == 1
        },
    )
    .await;
    (a, b)
}

async fn explain(router: &TestRouter) -> serde_json::Value {
    router
        .client
        .get(format!("{}/admin/policy/explain?tokens=100", router.base))
        .header("accept", "application/json")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// One column of the worker at `url` in the explain table.
async fn explained(router: &TestRouter, url: &str, column: &str) -> f64 {
    explain_column(&explain(router).await, url, column)
}

/// A streaming request through `router`, to its end; true when it completed.
async fn stream_chat(router: &TestRouter, text: &str) -> bool {
    let response = router.chat(text, true).await;
    response.status() == 200 && response.text().await.unwrap().contains("[DONE]")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dispatch_on_one_replica_appears_in_the_others_explain_table() {
    let nats = NatsServer::start();
    let upstream = Upstream::start().await;
    let (a, b) = connected_pair(&nats, &upstream).await;
    let a = Arc::new(a);
    assert_eq!(explained(&b, &upstream.url, "remote_tok").await, 0.0);

    // A's request is held before its first token: pending work on A.
    upstream.switches.hold.store(true, Ordering::SeqCst);
    let held = {
        let a = a.clone();
        tokio::spawn(async move { stream_chat(&a, &"x".repeat(4000)).await })
    };
    wait_until("B shows A's pending request", || async {
        explained(&b, &upstream.url, "remote_req").await == 1.0
    })
    .await;
    // 4000 characters at 4 per token.
    assert_eq!(explained(&b, &upstream.url, "remote_tok").await, 1000.0);
    assert_eq!(explained(&b, &upstream.url, "inflight_tok").await, 1000.0);
    assert!(explained(&b, &upstream.url, "remote_age_s").await < 1.0);
    let text = b
        .client
        .get(format!("{}/admin/policy/explain", b.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        text.contains("remote_tok") && text.contains("remote: 1 replicas"),
        "{text}"
    );
    // A itself counts its own request once, not as remote work.
    assert_eq!(explained(&a, &upstream.url, "remote_tok").await, 0.0);

    upstream.switches.hold.store(false, Ordering::SeqCst);
    wait_until("the held request completes", || async {
        upstream.switches.release.notify_waiters();
        held.is_finished()
    })
    .await;
    assert!(held.await.unwrap(), "the held request completed");
    wait_until("B sees A's pending work gone", || async {
        explained(&b, &upstream.url, "remote_tok").await == 0.0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_tokens_on_one_replica_teach_the_other_the_worker_s_rate() {
    let nats = NatsServer::start();
    let upstream = Upstream::start().await;
    let (a, b) = connected_pair(&nats, &upstream).await;
    assert_eq!(explained(&b, &upstream.url, "rate_samples").await, 0.0);
    // Streams through A, one after another. B dispatches nothing: it learns
    // the worker's rate from A's first tokens, each closing the one
    // before, once held as long as A's messages take to arrive.
    let turns = AtomicUsize::new(0);
    wait_until(
        "B learned the worker's rate from A's first tokens",
        || async {
            let turn = turns.fetch_add(1, Ordering::SeqCst);
            assert!(stream_chat(&a, &format!("turn {turn} {}", "x".repeat(2000))).await);
            explained(&b, &upstream.url, "rate_samples").await >= 1.0
        },
    )
    .await;
    // Every stream has ended: every first token A had reaches B.
    let streamed = turns.load(Ordering::SeqCst) as f64;
    wait_until("B heard every one of A's first tokens", || async {
        metric(&a, "router_sync_prefill_samples_sent_total").await == streamed
            && metric(
                &b,
                "router_sync_prefill_samples_received_total{outcome=\"applied\"}",
            )
            .await
                == streamed
    })
    .await;
    assert_eq!(
        metric(&a, "router_sync_prefill_samples_dropped_total").await,
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_broker_loses_no_request_and_sharing_resumes() {
    let mut nats = NatsServer::start();
    let upstreams = [Upstream::start().await, Upstream::start().await];
    let both: Vec<&Upstream> = upstreams.iter().collect();
    let a = Arc::new(replica(&nats, "a", &both).await);
    let b = Arc::new(replica(&nats, "b", &both).await);
    wait_until(
        "both replicas are connected and their workers healthy",
        || async {
            sync_connected(&a).await
                && sync_connected(&b).await
                && a.healthy_count().await == 2
                && b.healthy_count().await == 2
        },
    )
    .await;

    // Steady load through both replicas, four requests at a time.
    let sent = |phase: &'static str, count: usize| {
        let routers = [a.clone(), b.clone()];
        async move {
            let mut tasks = tokio::task::JoinSet::new();
            for index in 0..count {
                let router = routers[index % 2].clone();
                tasks.spawn(async move { stream_chat(&router, &format!("{phase} {index}")).await });
                if tasks.len() >= 4 {
                    assert!(
                        tasks.join_next().await.unwrap().unwrap(),
                        "{phase}: a request failed"
                    );
                }
            }
            while let Some(done) = tasks.join_next().await {
                assert!(done.unwrap(), "{phase}: a request failed");
            }
        }
    };
    sent("before", 40).await;
    let during = tokio::spawn(sent("while the broker dies", 60));
    nats.stop();
    wait_until("both replicas notice the broker is gone", || async {
        !sync_connected(&a).await && !sync_connected(&b).await
    })
    .await;
    during.await.unwrap();
    sent("without a broker", 40).await;
    assert!(metric(&a, "router_sync_disconnects_total").await >= 1.0);
    let served: u64 = upstreams.iter().map(Upstream::requests).sum();
    assert_eq!(served, 140, "every request reached a worker exactly once");

    nats.restart();
    wait_until("both replicas reconnect", || async {
        sync_connected(&a).await && sync_connected(&b).await
    })
    .await;
    for upstream in &upstreams {
        upstream.switches.hold.store(true, Ordering::SeqCst);
    }
    let held = {
        let a = a.clone();
        tokio::spawn(async move { stream_chat(&a, "after the broker came back").await })
    };
    wait_until("B shows A's pending request again", || async {
        let mut pending = 0.0;
        for upstream in &upstreams {
            pending += explained(&b, &upstream.url, "remote_req").await;
        }
        pending == 1.0
    })
    .await;
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
    assert!(held.await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_foreign_messages_are_ignored_and_counted() {
    let nats = NatsServer::start();
    let upstream = Upstream::start().await;
    let a = replica(&nats, "a", &[&upstream]).await;
    let outsider = async_nats::connect(nats.url.as_str()).await.unwrap();
    wait_until(
        "the replica is connected and the worker healthy",
        || async { sync_connected(&a).await && a.healthy_count().await == 1 },
    )
    .await;
    // A well-formed message from another replica is counted: the
    // subscription works, so what follows is ignored on its merits.
    let valid = format!(
        r#"{{"v":1,"replica":"other","seq":1,"full":true,"pending":[["{}",700,2]]}}"#,
        upstream.url
    );
    wait_until("the other replica's work shows", || async {
        outsider
            .publish("llm-router.pending", valid.clone().into())
            .await
            .unwrap();
        outsider.flush().await.unwrap();
        explained(&a, &upstream.url, "remote_tok").await == 700.0
    })
    .await;

    let junk: [&[u8]; 5] = [
        b"not json at all",
        br#"{"event":"deploy","service":"web"}"#,
        br#"{"v":2,"replica":"other","seq":2,"full":true,"pending":[]}"#,
        br#"{"v":1,"replica":"has spaces","seq":2,"full":true,"pending":[]}"#,
        b"\xff\xfe\x00",
    ];
    for payload in junk {
        outsider
            .publish("llm-router.pending", payload.to_vec().into())
            .await
            .unwrap();
    }
    let hostile = format!(
        r#"{{"v":1,"replica":"other","seq":3,"full":false,"pending":[["{url}",-5,1],["{url}",1.5,1],["{url}",1099511627777,1]]}}"#,
        url = upstream.url
    );
    outsider
        .publish("llm-router.pending", hostile.into())
        .await
        .unwrap();
    outsider.flush().await.unwrap();
    wait_until("the junk is counted", || async {
        metric(
            &a,
            "router_sync_messages_received_total{outcome=\"malformed\"}",
        )
        .await
            >= 3.0
            && metric(
                &a,
                "router_sync_messages_received_total{outcome=\"foreign_version\"}",
            )
            .await
                >= 1.0
            && metric(
                &a,
                "router_sync_messages_received_total{outcome=\"invalid_replica\"}",
            )
            .await
                >= 1.0
            && metric(&a, "router_sync_entries_total{outcome=\"invalid\"}").await >= 3.0
    })
    .await;
    assert_eq!(
        explained(&a, &upstream.url, "remote_tok").await,
        700.0,
        "nothing the junk said changed the replica's view"
    );
    assert_eq!(a.chat("still routing", false).await.status(), 200);

    // The other replica stops publishing: its work is dropped after the TTL.
    wait_until("the silent replica's entry expires", || async {
        explained(&a, &upstream.url, "remote_tok").await == 0.0
    })
    .await;
    assert!(metric(&a, "router_sync_entries_expired_total").await >= 1.0);
}

/// Replicas "a" and "b" over one worker that takes one request at a time
/// (the cap counts the other replica's pending request too), publishing
/// every `publish_interval_ms`, with `extra` config; once both are
/// connected and see the worker healthy.
async fn one_slot_pair(
    nats: &NatsServer,
    upstream: &Upstream,
    publish_interval_ms: u64,
    extra: &str,
) -> (Arc<TestRouter>, Arc<TestRouter>) {
    let replica = |id: &str| {
        let config = format!(
            "[sync]\nenabled = true\nnats_url = \"{}\"\nreplica_id = \"{id}\"\n\
             publish_interval_ms = {publish_interval_ms}\nentry_ttl_ms = 5000\n{extra}\
             [policy]\nkind = \"least_load\"\n[policy.least_load]\nmax_waiting_requests = 1\n",
            nats.url
        );
        start_router(fast_config(vec![worker("sglang", &upstream.url)], &config))
    };
    let a = Arc::new(replica("a").await);
    let b = Arc::new(replica("b").await);
    wait_until("both replicas are connected and see the worker", || async {
        sync_connected(&a).await
            && sync_connected(&b).await
            && a.healthy_count().await == 1
            && b.healthy_count().await == 1
    })
    .await;
    (a, b)
}

/// A chat request through `router` in the background; its status.
fn send_chat(router: &Arc<TestRouter>, text: &'static str) -> tokio::task::JoinHandle<u16> {
    let router = router.clone();
    tokio::spawn(async move { router.chat(text, false).await.status().as_u16() })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_replica_whose_request_waited_longest_takes_the_freed_worker() {
    let nats = NatsServer::start();
    let upstream = Upstream::start().await;
    upstream.switches.hold.store(true, Ordering::SeqCst);
    // Admission on by default. Publishing every 500 ms, a replica leaves
    // the room to the other for up to 1 s (twice the interval): the other
    // hears within one interval that the worker is free.
    let (a, b) = one_slot_pair(&nats, &upstream, 500, "").await;

    // A's request holds the worker; B hears of it.
    let first = send_chat(&a, "first");
    wait_until("the first request holds the worker", || async {
        upstream.requests() == 1 && explained(&b, &upstream.url, "remote_tok").await > 0.0
    })
    .await;
    // B's request waits in B's room, and A hears of it.
    let from_b = send_chat(&b, "from-b");
    wait_until("A hears that B's request has waited over 1.1 s", || async {
        a.admission_json().await["queue"]["peers_oldest_wait_s"]
            .as_f64()
            .is_some_and(|waited| waited > 1.1)
    })
    .await;
    // A's request arrives later; A's own request frees the worker.
    let from_a = send_chat(&a, "from-a");
    wait_until("A's request waits in A's room", || async {
        a.admission_json().await["queue"]["queued_requests"].as_u64() == Some(1)
    })
    .await;
    upstream.switches.hold.store(false, Ordering::SeqCst);
    upstream.switches.release.notify_one();
    for handle in [first, from_b, from_a] {
        assert_eq!(handle.await.unwrap(), 200);
    }
    // A heard first that the worker was free, but B's request had waited
    // longer: B took it.
    assert_eq!(upstream.prompts(), ["first", "from-b", "from-a"]);
    wait_until("both rooms are empty and say so", || async {
        a.admission_json().await["queue"]["peers_oldest_wait_s"].is_null()
            && b.admission_json().await["queue"]["peers_oldest_wait_s"].is_null()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queue_bound_counts_every_replica_s_queue() {
    let nats = NatsServer::start();
    let upstream = Upstream::start().await;
    upstream.switches.hold.store(true, Ordering::SeqCst);
    // The fleet's queue holds one.
    let (a, b) = one_slot_pair(
        &nats,
        &upstream,
        50,
        "[admission]\nmax_queue_requests = 1\n",
    )
    .await;

    let first = send_chat(&a, "first");
    wait_until("the first request holds the worker", || async {
        upstream.requests() == 1
    })
    .await;
    let queued = send_chat(&a, "queued-at-a");
    wait_until("B hears that A's queue holds one", || async {
        b.admission_json().await["queue"]["peers_queued_requests"].as_u64() == Some(1)
    })
    .await;
    // B's own queue is empty, but the fleet's is full.
    let turned_away = b.chat("turned-away-at-b", false).await;
    assert_eq!(turned_away.status(), 429);
    assert!(turned_away.headers().contains_key("retry-after"));
    let body: serde_json::Value = turned_away.json().await.unwrap();
    assert_eq!(body["error"]["code"], "queue_full", "{body}");

    upstream.switches.hold.store(false, Ordering::SeqCst);
    upstream.switches.release.notify_one();
    for handle in [first, queued] {
        assert_eq!(handle.await.unwrap(), 200);
    }
    assert_eq!(upstream.prompts(), ["first", "queued-at-a"]);
    // A's queue emptied and B heard so: B queues again.
    wait_until("B hears that A's queue is empty", || async {
        b.admission_json().await["queue"]["peers_queued_requests"].as_u64() == Some(0)
    })
    .await;
    assert_eq!(b.chat("after", false).await.status(), 200);
}
