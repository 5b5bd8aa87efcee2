//! The admission gate through the router's public port: requests wait
//! while every worker is capped, leave in the room's order, and are turned
//! away with 429 and `Retry-After` when the queue is full or their TTFT
//! deadline cannot be met.

// Test helpers outside #[test] functions fail loudly on purpose.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::upstream::Upstream;
use common::{TestRouter, fast_config, metric_sum, start_built, start_router, wait_until, worker};
use load_protocols::WorkerLoad;
use policy_core::{
    Dispatch, ExpectedWait, Policy, PollMark, PrefillSample, RequestInfo, ScoreTable, WorkerId,
    WorkerInfo, WorkerStats,
};
use serde_json::{Value, json};

/// One worker that takes one request at a time (`max_waiting_requests = 1`
/// counts the router's pending request), holding each until released.
async fn capped_router(admission_toml: &str) -> (Upstream, TestRouter) {
    let upstream = Upstream::start().await;
    upstream.switches.hold.store(true, Ordering::SeqCst);
    let router = start_router(fast_config(
        vec![worker("sglang", &upstream.url)],
        &format!(
            "[policy]\nkind = \"least_load\"\n[policy.least_load]\nmax_waiting_requests = 1\n{admission_toml}"
        ),
    ))
    .await;
    wait_until("the worker is healthy", || async {
        router.healthy_count().await == 1
    })
    .await;
    (upstream, router)
}

/// Sends a chat request with `headers` in the background; its status and
/// body when it ends.
fn send(
    router: &TestRouter,
    text: &str,
    body_priority: Option<i64>,
    headers: &[(&'static str, String)],
) -> tokio::task::JoinHandle<(u16, Option<String>, Value)> {
    let mut body = json!({"model": "test-model", "messages": [{"role": "user", "content": text}]});
    if let Some(priority) = body_priority {
        body["priority"] = json!(priority);
    }
    let mut request = router
        .client
        .post(format!("{}/v1/chat/completions", router.base))
        .json(&body);
    for (name, value) in headers {
        request = request.header(*name, value);
    }
    tokio::spawn(async move {
        let response = request.send().await.unwrap();
        let status = response.status().as_u16();
        let retry_after = response
            .headers()
            .get("retry-after")
            .map(|value| value.to_str().unwrap().to_owned());
        let body = response.json().await.unwrap_or(Value::Null);
        (status, retry_after, body)
    })
}

async fn queued(router: &TestRouter) -> u64 {
    router.admission_json().await["queue"]["queued_requests"]
        .as_u64()
        .unwrap()
}

/// Sends the request that takes the only slot (held at the engine), once
/// it is there.
async fn hold_the_slot(
    router: &TestRouter,
    upstream: &Upstream,
) -> tokio::task::JoinHandle<(u16, Option<String>, Value)> {
    let first = send(router, "first", None, &[]);
    wait_until("the first request holds the slot", || async {
        upstream.requests() == 1
    })
    .await;
    first
}

/// Sends a request that waits in the router's queue, once it waits there.
async fn wait_behind(
    router: &TestRouter,
    text: &str,
) -> tokio::task::JoinHandle<(u16, Option<String>, Value)> {
    let before = queued(router).await;
    let waiting = send(router, text, None, &[]);
    wait_until("it waits", || async { queued(router).await == before + 1 }).await;
    waiting
}

/// Lets the held request go, and every later one through unheld. The
/// worker takes one request at a time, so the engine still receives them
/// in the router's order. `notify_one` keeps its permit for a request that
/// has not started waiting yet.
fn release_all(upstream: &Upstream) {
    upstream.switches.hold.store(false, Ordering::SeqCst);
    upstream.switches.release.notify_one();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capped_requests_wait_and_leave_lower_priority_value_first() {
    let (upstream, router) = capped_router("").await;
    let first = hold_the_slot(&router, &upstream).await;
    let batch = send(&router, "batch", Some(5), &[]);
    wait_until("the batch request waits", || async {
        queued(&router).await == 1
    })
    .await;
    // The header outranks the body's priority.
    let urgent = send(
        &router,
        "urgent",
        Some(9),
        &[("x-request-priority", "0".into())],
    );
    wait_until("both wait", || async { queued(&router).await == 2 }).await;
    let view = router.admission_json().await;
    assert_eq!(view["queue"]["order"], "priority");
    assert_eq!(
        view["queue"]["flows"].as_array().unwrap().len(),
        2,
        "{view}"
    );
    assert_eq!(
        metric_sum(&router, "router_admission_queue_depth").await,
        2.0
    );

    release_all(&upstream);
    for task in [first, batch, urgent] {
        assert_eq!(task.await.unwrap().0, 200);
    }
    assert_eq!(upstream.prompts(), ["first", "urgent", "batch"]);
    assert_eq!(queued(&router).await, 0);
    assert_eq!(
        metric_sum(&router, "router_admission_queue_depth").await,
        0.0
    );
    let dispatched = metric_sum(
        &router,
        "router_admission_wait_seconds_count{class=\"0\",outcome=\"dispatched\"}",
    )
    .await;
    assert!(dispatched >= 1.0, "{dispatched}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fair_share_serves_a_light_tenant_ahead_of_a_heavy_one_s_backlog() {
    let (upstream, router) =
        capped_router("[admission]\norder = \"fair_share\"\ntenant_header = \"x-team\"\n").await;
    let first = send(&router, "first", None, &[("x-team", "heavy".into())]);
    wait_until("the first request holds the slot", || async {
        upstream.requests() == 1
    })
    .await;
    let mut tasks = vec![first];
    for index in 0..3 {
        tasks.push(send(
            &router,
            &format!("heavy-{index}"),
            None,
            &[("x-team", "heavy".into())],
        ));
        let expected = index + 1;
        wait_until("the heavy backlog waits", || async {
            queued(&router).await == expected
        })
        .await;
    }
    // A tenant by API key: its requests share as one tenant.
    tasks.push(send(
        &router,
        "light",
        None,
        &[("authorization", "Bearer light-key".into())],
    ));
    wait_until("four wait", || async { queued(&router).await == 4 }).await;
    let tenants: Vec<String> = router.admission_json().await["queue"]["flows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|flow| flow["tenant"].as_str().unwrap().to_owned())
        .collect();
    assert!(tenants.contains(&"heavy".to_owned()), "{tenants:?}");
    assert!(
        tenants
            .iter()
            .any(|t| t.starts_with("key-") && !t.contains("light")),
        "an API key's tenant is a hash of it: {tenants:?}"
    );

    release_all(&upstream);
    for task in tasks {
        assert_eq!(task.await.unwrap().0, 200);
    }
    let order = upstream.prompts();
    let light = order.iter().position(|p| p == "light").unwrap();
    assert!(
        light <= 2,
        "the light tenant waited behind the backlog: {order:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_answers_429_with_retry_after() {
    let (upstream, router) = capped_router("[admission]\nmax_queue_requests = 1\n").await;
    let first = hold_the_slot(&router, &upstream).await;
    let waiting = wait_behind(&router, "waiting").await;

    let (status, retry_after, body) = send(&router, "turned away", None, &[]).await.unwrap();
    assert_eq!(status, 429);
    assert!(retry_after.is_some_and(|s| s.parse::<u64>().unwrap() >= 1));
    assert_eq!(body["error"]["code"], "queue_full", "{body}");
    assert_eq!(
        metric_sum(&router, "router_admission_rejections_total").await,
        1.0
    );

    release_all(&upstream);
    assert_eq!(first.await.unwrap().0, 200);
    assert_eq!(waiting.await.unwrap().0, 200);
    assert_eq!(upstream.prompts(), ["first", "waiting"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_request_whose_deadline_cannot_be_met_is_answered_429() {
    let (upstream, router) = capped_router("").await;
    let first = hold_the_slot(&router, &upstream).await;
    // The worker stays held: the request cannot start before its deadline.
    let (status, retry_after, body) = send(
        &router,
        "hurried",
        None,
        &[("x-ttft-deadline-ms", "300".into())],
    )
    .await
    .unwrap();
    assert_eq!(status, 429, "{body}");
    assert!(retry_after.is_some());
    let code = body["error"]["code"].as_str().unwrap();
    assert!(
        code == "deadline_unmeetable" || code == "deadline_passed",
        "{body}"
    );
    assert_eq!(upstream.requests(), 1, "it never reached the engine");
    assert_eq!(queued(&router).await, 0);

    release_all(&upstream);
    assert_eq!(first.await.unwrap().0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_is_taken_out_of_the_queue_at_once() {
    let (upstream, router) = capped_router("").await;
    let first = hold_the_slot(&router, &upstream).await;
    let gone = send(&router, "gone", None, &[]);
    wait_until("it waits", || async { queued(&router).await == 1 }).await;
    gone.abort();
    wait_until("its wait is over", || async { queued(&router).await == 0 }).await;
    let left = metric_sum(
        &router,
        "router_admission_wait_seconds_count{class=\"0\",outcome=\"left\"}",
    )
    .await;
    assert_eq!(left, 1.0);

    let after = send(&router, "after", None, &[]);
    release_all(&upstream);
    assert_eq!(first.await.unwrap().0, 200);
    assert_eq!(after.await.unwrap().0, 200);
    assert_eq!(
        upstream.prompts(),
        ["first", "after"],
        "the one that left never went"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreadable_admission_headers_are_the_client_s_error() {
    let (upstream, router) = capped_router("").await;
    upstream.switches.hold.store(false, Ordering::SeqCst);
    for (name, value) in [
        ("x-request-priority", "high"),
        ("x-request-priority", "1.5"),
        ("x-ttft-deadline-ms", "0"),
        ("x-ttft-deadline-ms", "-5"),
        ("x-ttft-deadline-ms", "soon"),
    ] {
        let (status, _, body) = send(&router, "bad", None, &[(name, value.into())])
            .await
            .unwrap();
        assert_eq!(status, 400, "{name}: {value}");
        assert!(
            body["error"]["message"].as_str().unwrap().contains(name),
            "{body}"
        );
    }
    assert_eq!(upstream.requests(), 0);
    // A body priority that is not an integer is the engine's to judge.
    let (status, _, _) = send(&router, "fine", None, &[]).await.unwrap();
    assert_eq!(status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admission_section_swaps_live_and_refuses_an_invalid_one() {
    let (upstream, router) = capped_router("").await;
    let first = hold_the_slot(&router, &upstream).await;
    let waiting = wait_behind(&router, "waiting").await;

    let put = |section: Value| {
        router
            .client
            .put(format!("{}/admin/admission", router.base))
            .json(&section)
            .send()
    };
    let swapped = put(json!({"order": "fair_share", "queue_above_wait_s": 0.5}))
        .await
        .unwrap();
    assert_eq!(swapped.status(), 200);
    let view: Value = swapped.json().await.unwrap();
    assert_eq!(view["queue"]["order"], "fair_share");
    assert_eq!(
        view["queue"]["queued_requests"], 1,
        "the waiting request moved over"
    );
    assert_eq!(view["config"]["queue_above_wait_s"], 0.5);

    for invalid in [
        json!({"order": "lifo"}),
        json!({"queue_above_wait_s": -1.0}),
        json!({"max_queue_requests": 0}),
        json!({"classes": [{"name": "a", "priority": 0, "weight": 0.0}]}),
        json!({"tenant_header": "bad header"}),
        json!({"unknown_key": 1}),
    ] {
        let refused = put(invalid.clone()).await.unwrap();
        assert_eq!(refused.status(), 400, "{invalid}");
    }
    assert_eq!(
        router.admission_json().await["queue"]["order"],
        "fair_share"
    );

    release_all(&upstream);
    assert_eq!(first.await.unwrap().0, 200);
    assert_eq!(waiting.await.unwrap().0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_says_what_the_room_would_do_and_changes_nothing() {
    let (upstream, router) = capped_router(
        "[admission]\n[[admission.classes]]\nname = \"chat\"\npriority = 0\nweight = 4\nttft_deadline_ms = 2000\n\
         [[admission.classes]]\nname = \"batch\"\npriority = 9\n",
    )
    .await;
    let explain = |priority: &'static str| {
        router
            .client
            .post(format!("{}/admin/admission/explain", router.base))
            .header("x-request-priority", priority)
            .header("x-tenant-id", "team-a")
            .json(&json!({"messages": [{"role": "user", "content": "hello there"}]}))
            .send()
    };
    let idle: Value = explain("0").await.unwrap().json().await.unwrap();
    assert_eq!(idle["decision"], "dispatch_now", "{idle}");
    assert_eq!(idle["class"], "chat");
    assert_eq!(idle["tenant"], "team-a");
    assert_eq!(idle["ttft_deadline_s"], 2.0);
    assert!(idle["expected_queue_s"].is_number(), "{idle}");

    let first = hold_the_slot(&router, &upstream).await;
    let waiting = wait_behind(&router, "waiting").await;
    let behind: Value = explain("5").await.unwrap().json().await.unwrap();
    assert_eq!(behind["decision"], "queue", "{behind}");
    assert_eq!(behind["class"], "batch");
    assert_eq!(queued(&router).await, 1, "explaining queued nothing");
    let bad = explain("high").await.unwrap();
    assert_eq!(bad.status(), 400);

    release_all(&upstream);
    assert_eq!(first.await.unwrap().0, 200);
    assert_eq!(waiting.await.unwrap().0, 200);
}

#[test]
fn an_invalid_admission_config_is_refused_at_load() {
    for (toml, key) in [
        ("[admission]\norder = \"lifo\"\n", "admission.order"),
        (
            "[admission]\nqueue_above_wait_s = nan\n",
            "admission.queue_above_wait_s",
        ),
        (
            "[admission]\n[[admission.classes]]\nname = \"a\"\npriority = 0\n[[admission.classes]]\nname = \"b\"\npriority = 0\n",
            "admission",
        ),
        (
            "[admission]\ntenant_header = \"\"\n",
            "admission.tenant_header",
        ),
    ] {
        let path = std::env::temp_dir().join(format!(
            "router-admission-{}-{key}.toml",
            std::process::id()
        ));
        std::fs::write(&path, toml).unwrap();
        let loaded = router::RouterBuilder::with_builtins().load_config(router::Layers {
            file: Some(&path),
            ..router::Layers::default()
        });
        let _ = std::fs::remove_file(&path);
        let error = loaded.expect_err(toml).to_string();
        assert!(error.contains(key), "{toml}: {error}");
    }
}

/// The workers a [`Pinned`] policy knows, and the wait the test sets for
/// each (by URL).
#[derive(Default)]
struct Pins {
    long_prompts_to: String,
    workers: Mutex<Vec<(WorkerId, String)>>,
    wait_secs: Mutex<HashMap<String, f64>>,
}

/// A policy that sends long prompts to one worker and short ones to the
/// other (as a prefix held on one worker would), and expects the waits the
/// test sets: a worker the room must wait for, or must route around.
struct Pinned {
    pins: Arc<Pins>,
    seq: AtomicU64,
}

impl Pinned {
    fn pick(&self, candidates: &[WorkerId], request: &RequestInfo) -> Option<WorkerId> {
        let long = request.tokens.or(0) >= 100;
        let workers = self.pins.workers.lock().unwrap();
        workers
            .iter()
            .find(|(id, url)| {
                candidates.contains(id) && (*url == self.pins.long_prompts_to) == long
            })
            .map(|(id, _)| *id)
            .or_else(|| candidates.first().copied())
    }

    fn wait(&self, id: WorkerId) -> ExpectedWait {
        let workers = self.pins.workers.lock().unwrap();
        let url = workers
            .iter()
            .find(|(known, _)| *known == id)
            .map(|(_, url)| url);
        let waits = self.pins.wait_secs.lock().unwrap();
        ExpectedWait {
            queue_secs: url.and_then(|url| waits.get(url)).copied().unwrap_or(0.0),
            prefill_secs: 0.01,
            queue_less_progress_secs: None,
            cached_prefill_secs: 0.0,
        }
    }
}

impl Policy for Pinned {
    fn name(&self) -> &'static str {
        "pinned"
    }
    fn params(&self) -> Value {
        Value::Null
    }
    fn add_worker(&self, id: WorkerId, info: WorkerInfo) {
        self.pins
            .workers
            .lock()
            .unwrap()
            .push((id, info.url.to_string()));
    }
    fn remove_worker(&self, id: WorkerId) {
        self.pins
            .workers
            .lock()
            .unwrap()
            .retain(|(known, _)| *known != id);
    }
    fn select(
        &self,
        candidates: &[WorkerId],
        request: &RequestInfo,
        _: Instant,
    ) -> Option<Dispatch> {
        Some(Dispatch {
            worker: self.pick(candidates, request)?,
            tokens: 0,
            seq: self.seq.fetch_add(1, Ordering::Relaxed),
            score: 0.0,
            cached_tokens: 0,
        })
    }
    fn first_token(&self, _: &Dispatch, _: Instant) -> Option<PrefillSample> {
        None
    }
    fn finish(&self, _: &Dispatch, _: Instant) {}
    fn poll_started(&self, id: WorkerId, now: Instant) -> PollMark {
        PollMark::nothing_pending(id, now)
    }
    fn poll_completed(&self, _: PollMark, _: Option<&WorkerLoad>, _: Instant) {}
    fn poll_failed(&self, _: PollMark, _: Instant) {}
    fn expected_wait(
        &self,
        candidates: &[WorkerId],
        _: &RequestInfo,
        _: Instant,
    ) -> Option<ExpectedWait> {
        candidates
            .iter()
            .map(|id| self.wait(*id))
            .min_by(|a, b| a.queue_secs.total_cmp(&b.queue_secs))
    }
    fn preview(
        &self,
        candidates: &[WorkerId],
        request: &RequestInfo,
        _: Instant,
    ) -> Option<(WorkerId, ExpectedWait)> {
        let id = self.pick(candidates, request)?;
        Some((id, self.wait(id)))
    }
    fn explain(&self, _: &[WorkerId], _: &RequestInfo, _: Instant) -> ScoreTable {
        ScoreTable::new("pinned", String::new(), &[])
    }
    fn worker_stats(&self, _: WorkerId) -> Option<WorkerStats> {
        Some(WorkerStats::default())
    }
}

fn set_wait(pins: &Pins, upstream: &Upstream, secs: f64) {
    pins.wait_secs
        .lock()
        .unwrap()
        .insert(upstream.url.clone(), secs);
}

/// A router over two workers, each 10 s away, whose `pinned` policy sends
/// long prompts to the first (`held`) and short ones to the second.
async fn pinned_router() -> (Upstream, Upstream, Arc<Pins>, TestRouter) {
    let (held, other) = (Upstream::start().await, Upstream::start().await);
    let pins = Arc::new(Pins {
        long_prompts_to: held.url.clone(),
        ..Pins::default()
    });
    set_wait(&pins, &held, 10.0);
    set_wait(&pins, &other, 10.0);
    let mut builder = router::RouterBuilder::with_builtins();
    let shared = pins.clone();
    builder.policies().register("pinned", move |_, _| {
        Ok(Box::new(Pinned {
            pins: shared.clone(),
            seq: AtomicU64::new(0),
        }) as Box<dyn Policy>)
    });
    let router = start_built(
        builder,
        fast_config(
            vec![worker("sglang", &held.url), worker("sglang", &other.url)],
            "[policy]\nkind = \"pinned\"\n",
        ),
    )
    .await;
    wait_until("both workers are healthy", || async {
        router.healthy_count().await == 2
    })
    .await;
    (held, other, pins, router)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waits_for_its_busy_worker_while_the_ones_behind_it_go_to_theirs() {
    let (held, other, pins, router) = pinned_router().await;
    let long = "a conversation whose context is cached on its worker ".repeat(20);

    // Every worker 10 s away: both wait, the long prompt first in the order
    // (one class: neither passes the other).
    let first = send(&router, &long, Some(0), &[]);
    wait_until("it waits", || async { queued(&router).await == 1 }).await;
    let behind = send(&router, "short", Some(0), &[]);
    wait_until("it waits", || async { queued(&router).await == 2 }).await;

    // The short prompt's worker frees up: it goes, the long one waits for
    // its own worker rather than join its queue.
    set_wait(&pins, &other, 0.0);
    let (status, _, body) = behind.await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(other.prompts(), vec!["short".to_owned()]);
    assert_eq!(queued(&router).await, 1);
    assert!(held.prompts().is_empty());

    // A deadline is judged at the worker the policy would choose: 10 s
    // away, a 2 s deadline is refused at once, though another has room.
    let (status, retry_after, body) = send(
        &router,
        &long,
        Some(0),
        &[("x-ttft-deadline-ms", "2000".into())],
    )
    .await
    .unwrap();
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["error"]["code"], "deadline_unmeetable", "{body}");
    assert!(retry_after.is_some());

    // Admitted while its worker was 1 s away, a request with a 3 s
    // deadline waits for it; once waiting there would miss the deadline,
    // it goes to the worker with room, at the last moment that still
    // meets it there (twice the reorder threshold before it).
    set_wait(&pins, &held, 1.0);
    let hurried = send(
        &router,
        &long,
        Some(0),
        &[("x-ttft-deadline-ms", "3000".into())],
    );
    wait_until("it waits", || async { queued(&router).await == 2 }).await;
    set_wait(&pins, &held, 10.0);
    let (status, _, body) = hurried.await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(other.prompts().len(), 2);
    assert!(held.prompts().is_empty());
    assert_eq!(
        queued(&router).await,
        1,
        "the one without a deadline still waits"
    );

    // Its worker has room: it goes there.
    set_wait(&pins, &held, 0.0);
    let (status, _, body) = first.await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(held.prompts(), vec![long]);
}

/// Waits at most 20 s for `request`'s answer, which must be 200; panics
/// with `what` if it does not come.
async fn answered_200(request: tokio::task::JoinHandle<(u16, Option<String>, Value)>, what: &str) {
    let (status, _, body) = tokio::time::timeout(Duration::from_secs(20), request)
        .await
        .expect(what)
        .unwrap();
    assert_eq!(status, 200, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_class_with_none_of_its_own_waiting_passes_another_s_backlog() {
    let (held, _other, pins, router) = pinned_router().await;
    let long = "a conversation whose context is cached on its worker ".repeat(20);

    // Every worker 10 s away: two batch requests wait (their deadline,
    // far off, keeps the room to the reorder threshold, 0.1 s).
    let far_deadline = [("x-ttft-deadline-ms", "60000".to_owned())];
    let batch: Vec<_> = (0..2)
        .map(|_| send(&router, &long, Some(1), &far_deadline))
        .collect();
    wait_until("they wait", || async { queued(&router).await == 2 }).await;

    // An interactive request, the only one of its class: its worker 10 s
    // away, it waits for it like the rest.
    let urgent = send(&router, &long, Some(0), &[]);
    wait_until("it waits", || async { queued(&router).await == 3 }).await;

    // Its worker still busy, but within reach (0.3 s, above the 0.1 s
    // threshold): it goes there at once, while the batch waits for room.
    set_wait(&pins, &held, 0.3);
    answered_200(urgent, "it passes the batch").await;
    assert_eq!(held.prompts().len(), 1);
    assert_eq!(queued(&router).await, 2, "the batch still waits");

    set_wait(&pins, &held, 0.0);
    for request in batch {
        answered_200(request, "released once its worker has room").await;
    }
    assert_eq!(held.prompts().len(), 3);
}
