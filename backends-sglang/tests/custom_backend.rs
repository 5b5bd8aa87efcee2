//! "Add a new backend by implementing a trait", end to end: a tiny custom
//! `LoadSource`, registered by name in a `BackendRegistry` next to SGLang's,
//! built per worker, polled with `poll_worker` into the `least_load` policy,
//! whose choice follows the reported load. Then a mockall source fails in a
//! scripted way and the policy routes around what it can and cannot see.

// Helpers outside #[test] functions may unwrap too: a panic is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use load_protocols::{SchedulerLoadSnapshot, WorkerLoad};
use parking_lot::Mutex;
use policy_core::{
    BackendError, BackendRegistry, BackendSpec, LoadAddress, LoadError, LoadSource, MockLoadSource,
    Policy, PolicyContext, PolicyRegistry, PollOutcome, RequestInfo, TokenCount, WorkerId,
    WorkerInfo, poll_worker, tokio_now,
};

/// Step 1: a backend is a type implementing `LoadSource`. This one reads a
/// queue length (in tokens) from a shared gauge instead of a network.
struct GaugeSource {
    url: String,
    queued_tokens: Arc<AtomicI64>,
}

#[async_trait]
impl LoadSource for GaugeSource {
    async fn fetch(&self) -> Result<Option<WorkerLoad>, LoadError> {
        let queued = self.queued_tokens.load(Ordering::SeqCst);
        let rank = SchedulerLoadSnapshot {
            num_waiting_reqs: i64::from(queued > 0),
            num_waiting_uncached_tokens: Some(queued),
            gen_throughput: Some(2000.0),
            ..SchedulerLoadSnapshot::default()
        };
        // `from_ranks` validates: a negative gauge would be a typed error.
        WorkerLoad::from_ranks(vec![rank])
            .map(Some)
            .map_err(|source| LoadError::Invalid {
                url: self.url.clone(),
                source,
            })
    }

    fn kind(&self) -> &'static str {
        "gauge"
    }

    fn load_url(&self) -> &str {
        &self.url
    }
}

/// Step 2: register a factory under a name, next to the built-in backends.
fn backends(gauges: BTreeMap<String, Arc<AtomicI64>>) -> BackendRegistry {
    let mut registry = BackendRegistry::new();
    backends_sglang::register(&mut registry);
    registry.register("gauge", LoadAddress::Http, move |spec: &BackendSpec| {
        let queued_tokens =
            gauges
                .get(&spec.worker_url)
                .cloned()
                .ok_or_else(|| BackendError::InvalidAddress {
                    url: spec.worker_url.clone(),
                    reason: "no gauge for this worker",
                })?;
        Ok(Arc::new(GaugeSource {
            url: spec.worker_url.clone(),
            queued_tokens,
        }) as Arc<dyn LoadSource>)
    });
    registry
}

fn least_load() -> Arc<dyn Policy> {
    let mut policies = PolicyRegistry::with_baselines();
    policy_least_load::register(&mut policies);
    policies
        .build(
            "least_load",
            &serde_json::Value::Null,
            &PolicyContext::default(),
        )
        .unwrap()
        .into()
}

const DEADLINE: Duration = Duration::from_millis(500);

/// Routes one 100-token request, releases it at once, and returns the choice.
fn route(policy: &dyn Policy, candidates: &[WorkerId]) -> WorkerId {
    let request = RequestInfo::new(TokenCount::Exact(100));
    let dispatch = policy.select(candidates, &request, tokio_now()).unwrap();
    policy.finish(&dispatch, tokio_now());
    dispatch.worker
}

#[tokio::test(start_paused = true)]
async fn a_custom_backend_steers_least_load() {
    let (url_a, url_b) = ("http://10.0.0.1:8000", "http://10.0.0.2:8000");
    let (gauge_a, gauge_b) = (Arc::new(AtomicI64::new(6000)), Arc::new(AtomicI64::new(0)));
    let registry = backends(BTreeMap::from([
        (url_a.to_owned(), gauge_a.clone()),
        (url_b.to_owned(), gauge_b.clone()),
    ]));
    assert_eq!(registry.names(), ["gauge", "sglang", "sglang-grpc"]);

    // Step 3: the router builds one source per worker by name.
    let source_a = registry.build("gauge", &BackendSpec::new(url_a)).unwrap();
    let source_b = registry.build("gauge", &BackendSpec::new(url_b)).unwrap();
    assert_eq!(source_a.kind(), "gauge");

    let policy = least_load();
    let (a, b) = (WorkerId::new(0, 0), WorkerId::new(1, 0));
    policy.add_worker(a, WorkerInfo::new(url_a, "gauge"));
    policy.add_worker(b, WorkerInfo::new(url_b, "gauge"));

    // Step 4: the load monitor polls each source into the policy.
    let poll = |id, source: Arc<dyn LoadSource>| {
        let policy = policy.clone();
        async move { poll_worker(policy.as_ref(), source.as_ref(), id, DEADLINE, tokio_now).await }
    };
    assert!(matches!(
        poll(a, source_a.clone()).await,
        PollOutcome::Report(_)
    ));
    assert!(matches!(
        poll(b, source_b.clone()).await,
        PollOutcome::Report(_)
    ));
    // a has 3 s of queued work, b none.
    assert_eq!(route(policy.as_ref(), &[a, b]), b);

    // The load moves; after the next polls, so does the choice.
    gauge_a.store(0, Ordering::SeqCst);
    gauge_b.store(8000, Ordering::SeqCst);
    tokio::time::advance(Duration::from_secs(1)).await;
    poll(a, source_a).await;
    poll(b, source_b).await;
    assert_eq!(route(policy.as_ref(), &[a, b]), a);

    // A bad gauge is a typed error, and an unknown worker a factory error.
    gauge_a.store(-1, Ordering::SeqCst);
    let source = registry.build("gauge", &BackendSpec::new(url_a)).unwrap();
    assert!(matches!(
        source.fetch().await,
        Err(LoadError::Invalid { .. })
    ));
    assert!(matches!(
        registry.build("gauge", &BackendSpec::new("http://10.0.0.9:8000")),
        Err(BackendError::InvalidAddress { .. })
    ));
}

fn waiting(tokens: i64) -> WorkerLoad {
    WorkerLoad::from_ranks(vec![SchedulerLoadSnapshot {
        num_waiting_reqs: 1,
        num_waiting_uncached_tokens: Some(tokens),
        gen_throughput: Some(2000.0),
        ..SchedulerLoadSnapshot::default()
    }])
    .unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_scripted_failing_source_through_the_registry() {
    // Worker a's source fails twice (refused, then HTTP 500), then reports
    // a long queue; worker b always reports a medium one.
    let mut flaky = MockLoadSource::new();
    let mut script = mockall::Sequence::new();
    flaky
        .expect_fetch()
        .times(1)
        .in_sequence(&mut script)
        .returning(|| {
            Err(LoadError::Connect {
                url: "http://10.0.0.1:8000".into(),
                source: "connection refused".into(),
            })
        });
    flaky
        .expect_fetch()
        .times(1)
        .in_sequence(&mut script)
        .returning(|| {
            Err(LoadError::HttpStatus {
                url: "http://10.0.0.1:8000".into(),
                status: 500,
            })
        });
    flaky
        .expect_fetch()
        .times(1)
        .in_sequence(&mut script)
        .returning(|| Ok(Some(waiting(20_000))));
    flaky
        .expect_load_url()
        .return_const("http://10.0.0.1:8000".to_owned());
    flaky.expect_kind().return_const("flaky");
    let mut steady = MockLoadSource::new();
    steady.expect_fetch().returning(|| Ok(Some(waiting(4000))));
    steady
        .expect_load_url()
        .return_const("http://10.0.0.2:8000".to_owned());
    steady.expect_kind().return_const("steady");

    let mocks = Mutex::new(BTreeMap::from([
        (
            "http://10.0.0.1:8000".to_owned(),
            Arc::new(flaky) as Arc<dyn LoadSource>,
        ),
        (
            "http://10.0.0.2:8000".to_owned(),
            Arc::new(steady) as Arc<dyn LoadSource>,
        ),
    ]));
    let mut registry = BackendRegistry::new();
    registry.register("scripted", LoadAddress::Http, move |spec: &BackendSpec| {
        mocks
            .lock()
            .remove(&spec.worker_url)
            .ok_or_else(|| BackendError::MissingLoadUrl {
                backend: "scripted".into(),
            })
    });
    let source_a = registry
        .build("scripted", &BackendSpec::new("http://10.0.0.1:8000"))
        .unwrap();
    let source_b = registry
        .build("scripted", &BackendSpec::new("http://10.0.0.2:8000"))
        .unwrap();

    let policy = least_load();
    let (a, b) = (WorkerId::new(0, 0), WorkerId::new(1, 0));
    policy.add_worker(a, WorkerInfo::new("http://10.0.0.1:8000", "scripted"));
    policy.add_worker(b, WorkerInfo::new("http://10.0.0.2:8000", "scripted"));

    let outcome = poll_worker(policy.as_ref(), source_b.as_ref(), b, DEADLINE, tokio_now).await;
    assert!(matches!(outcome, PollOutcome::Report(_)));
    for expected_status in [None, Some(500)] {
        let outcome = poll_worker(policy.as_ref(), source_a.as_ref(), a, DEADLINE, tokio_now).await;
        match (outcome, expected_status) {
            (PollOutcome::Failed(LoadError::Connect { .. }), None) => {}
            (PollOutcome::Failed(LoadError::HttpStatus { status, .. }), Some(expected)) => {
                assert_eq!(status, expected);
            }
            (other, _) => panic!("unexpected outcome {other:?}"),
        }
        // Without a fresh report, a's queue is unknown and counts as 0, so it
        // beats b's 2 s of reported work.
        assert_eq!(route(policy.as_ref(), &[a, b]), a);
    }
    // a recovers and reports 10 s of work: b wins.
    let outcome = poll_worker(policy.as_ref(), source_a.as_ref(), a, DEADLINE, tokio_now).await;
    assert!(matches!(outcome, PollOutcome::Report(load) if load.queued_tokens() == Some(20_000)));
    assert_eq!(route(policy.as_ref(), &[a, b]), b);
}
