//! The `vllm` and `vllm-grpc` factories, and a polled source driving a policy.

// Helpers outside `#[test]` fns panic too: in a test, a panic is a failed assertion.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::http::{StatusCode, header};
use axum::routing::get;
use backends_vllm::register;
use load_protocols::SchedulerLoadSnapshot;
use load_protocols::WorkerLoad;
use mockall::Sequence;
use policy_core::{
    BackendError, BackendRegistry, BackendSpec, LoadError, MockLoadSource, MockPolicy, PollMark,
    PollOutcome, SourceOptions, WorkerId, poll_worker,
};
use tokio::net::TcpListener;

fn registry() -> BackendRegistry {
    let mut registry = BackendRegistry::new();
    register(&mut registry);
    registry
}

#[test]
fn both_backends_are_registered() {
    assert_eq!(registry().names(), ["vllm", "vllm-grpc"]);
}

#[test]
fn factories_build_without_a_runtime() {
    // The router may build sources before its runtime polls them.
    let spec = BackendSpec::new("http://127.0.0.1:8000").with_load_url("grpc://127.0.0.1:50051");
    let grpc = registry().build("vllm-grpc", &spec).unwrap();
    assert_eq!(grpc.kind(), "vllm-grpc");
    assert_eq!(grpc.load_url(), "grpc://127.0.0.1:50051");
    let http = registry()
        .build("vllm", &BackendSpec::new("http://127.0.0.1:8000/"))
        .unwrap();
    assert_eq!(http.kind(), "vllm");
    assert_eq!(http.load_url(), "http://127.0.0.1:8000/metrics");
}

#[test]
fn vllm_grpc_needs_a_grpc_load_url() {
    let err = registry()
        .build("vllm-grpc", &BackendSpec::new("http://127.0.0.1:8000"))
        .err()
        .unwrap();
    assert!(
        matches!(&err, BackendError::MissingLoadUrl { backend } if backend == "vllm-grpc"),
        "{err:?}"
    );
    for (load_url, reason) in [
        ("http://127.0.0.1:50051", "expected grpc://host:port"),
        ("grpc://127.0.0.1", "missing port"),
        ("grpc://:50051", "missing host"),
        ("grpc://h:99999", "invalid port"),
    ] {
        let spec = BackendSpec::new("http://127.0.0.1:8000").with_load_url(load_url);
        match registry().build("vllm-grpc", &spec).err().unwrap() {
            BackendError::InvalidAddress { url, reason: why } => {
                assert_eq!((url.as_str(), why), (load_url, reason));
            }
            other => panic!("{load_url}: {other:?}"),
        }
    }
}

#[test]
fn vllm_needs_an_http_url() {
    for (worker_url, load_url) in [
        ("ftp://127.0.0.1:8000", None),
        ("not a url", None),
        ("http://127.0.0.1:8000", Some("grpc://127.0.0.1:50051")),
    ] {
        let mut spec = BackendSpec::new(worker_url);
        spec.load_url = load_url.map(str::to_owned);
        let err = registry().build("vllm", &spec).err().unwrap();
        assert!(
            matches!(err, BackendError::InvalidAddress { .. }),
            "{worker_url} {load_url:?}: {err:?}"
        );
    }
}

#[test]
fn an_api_key_that_cannot_be_a_header_is_a_client_error() {
    for backend in ["vllm", "vllm-grpc"] {
        let spec = BackendSpec {
            options: SourceOptions {
                api_key: Some("line\nbreak".into()),
                ..SourceOptions::default()
            },
            ..BackendSpec::new("http://127.0.0.1:8000").with_load_url(if backend == "vllm" {
                "http://127.0.0.1:8000"
            } else {
                "grpc://127.0.0.1:50051"
            })
        };
        let err = registry().build(backend, &spec).err().unwrap();
        assert!(
            matches!(err, BackendError::Client { .. }),
            "{backend}: {err:?}"
        );
    }
}

async fn serve_once_then_fail() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let router = Router::new().route(
        "/metrics",
        get(move || {
            let call = calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async move {
                if call == 0 {
                    (
                        StatusCode::OK,
                        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
                        "vllm:num_requests_running{engine=\"0\"} 2\n\
                         vllm:num_requests_waiting{engine=\"0\"} 5\n\
                         vllm:kv_cache_usage_perc{engine=\"0\"} 0.5\n",
                    )
                } else {
                    (
                        StatusCode::INTERNAL_SERVER_ERROR,
                        [(header::CONTENT_TYPE, "text/plain")],
                        "engine dead",
                    )
                }
            }
        }),
    );
    tokio::spawn(async move { axum::serve(listener, router).await });
    addr
}

fn mark(worker: WorkerId, now: Instant) -> PollMark {
    PollMark::nothing_pending(worker, now)
}

#[tokio::test]
async fn a_polled_vllm_source_reports_then_fails_into_the_policy() {
    let addr = serve_once_then_fail().await;
    let source = registry()
        .build("vllm", &BackendSpec::new(format!("http://{addr}")))
        .unwrap();
    let worker = WorkerId::new(0, 0);
    let mut policy = MockPolicy::new();
    let mut order = Sequence::new();
    policy
        .expect_poll_started()
        .times(1)
        .in_sequence(&mut order)
        .returning(mark);
    policy
        .expect_poll_completed()
        .withf(|_, load, _| {
            load.is_some_and(|load| {
                load.waiting_requests() == 5
                    && load.queued_tokens().is_none()
                    && load.observed().is_some()
            })
        })
        .times(1)
        .in_sequence(&mut order)
        .return_const(());
    policy
        .expect_poll_started()
        .times(1)
        .in_sequence(&mut order)
        .returning(mark);
    policy
        .expect_poll_failed()
        .times(1)
        .in_sequence(&mut order)
        .return_const(());

    let clock: policy_core::Clock = Instant::now;
    let deadline = Duration::from_secs(2);
    let first = poll_worker(&policy, source.as_ref(), worker, deadline, clock).await;
    assert!(matches!(first, PollOutcome::Report(_)), "{first:?}");
    let second = poll_worker(&policy, source.as_ref(), worker, deadline, clock).await;
    assert!(
        matches!(
            second,
            PollOutcome::Failed(LoadError::HttpStatus { status: 500, .. })
        ),
        "{second:?}"
    );
}

#[tokio::test]
async fn a_scripted_failing_source_shows_each_error_reaching_the_poller() {
    // The typed errors the vLLM sources produce, as a scripted source would
    // hand them to the load monitor.
    let mut source = MockLoadSource::new();
    let mut order = Sequence::new();
    source
        .expect_fetch()
        .times(1)
        .in_sequence(&mut order)
        .returning(|| {
            Err(LoadError::Unsupported {
                url: "grpc://127.0.0.1:1".into(),
                what: "vllm.grpc.engine.VllmEngine/GetLoads",
            })
        });
    source
        .expect_fetch()
        .times(1)
        .in_sequence(&mut order)
        .returning(|| Ok(None));
    source
        .expect_fetch()
        .times(1)
        .in_sequence(&mut order)
        .returning(|| {
            WorkerLoad::from_ranks(vec![SchedulerLoadSnapshot {
                num_waiting_reqs: 1,
                ..SchedulerLoadSnapshot::default()
            }])
            .map(Some)
            .map_err(|source| LoadError::Invalid {
                url: "grpc://127.0.0.1:1".into(),
                source,
            })
        });
    source
        .expect_load_url()
        .return_const("grpc://127.0.0.1:1".to_owned());

    let worker = WorkerId::new(1, 0);
    let mut policy = MockPolicy::new();
    policy.expect_poll_started().times(3).returning(mark);
    policy.expect_poll_failed().times(1).return_const(());
    policy
        .expect_poll_completed()
        .withf(|_, load, _| load.is_none())
        .times(1)
        .return_const(());
    policy
        .expect_poll_completed()
        .withf(|_, load, _| load.is_some())
        .times(1)
        .return_const(());
    let clock: policy_core::Clock = Instant::now;
    let deadline = Duration::from_millis(500);
    let outcomes = [
        poll_worker(&policy, &source, worker, deadline, clock).await,
        poll_worker(&policy, &source, worker, deadline, clock).await,
        poll_worker(&policy, &source, worker, deadline, clock).await,
    ];
    assert!(matches!(
        outcomes[0],
        PollOutcome::Failed(LoadError::Unsupported { .. })
    ));
    assert!(matches!(outcomes[1], PollOutcome::NoReport));
    assert!(matches!(outcomes[2], PollOutcome::Report(_)));
}
