//! `SglangHttpLoadSource` against real loopback servers: good reports, every
//! bad input, and the `/metrics` auto-detection.

// Helpers outside #[test] functions may unwrap too: a panic is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::convert::Infallible;
use std::error::Error as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, StatusCode, Uri, header::CONTENT_TYPE};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use backends_sglang::{SglangHttpEndpoint, SglangHttpLoadSource};
use bytes::Bytes;
use load_protocols::{LoadValidationError, WorkerLoad};
use policy_core::{BackendRegistry, BackendSpec, LoadError, LoadSource, SourceOptions};

use common::{options, refused_addr, serve_http, serve_raw, serve_silent, short_deadline};

const SINGLE: &str = include_str!("fixtures/loads_single_rank.json");
const DP4: &str = include_str!("fixtures/loads_dp4_all_sections.json");
const METRICS_OLD: &str = include_str!("fixtures/metrics_v0_5_3_single.txt");
const METRICS_NEW: &str = include_str!("fixtures/metrics_v0_5_4_dp2.txt");
const PROMETHEUS: &str = "text/plain; version=0.0.4; charset=utf-8";

fn json(body: &'static str) -> Response {
    ([(CONTENT_TYPE, "application/json")], body).into_response()
}

fn text(body: &'static str) -> Response {
    ([(CONTENT_TYPE, PROMETHEUS)], body).into_response()
}

/// A server whose `/v1/loads` answers `body` as JSON.
async fn loads_server(body: &'static str) -> String {
    let addr =
        serve_http(Router::new().route("/v1/loads", get(move || async move { json(body) }))).await;
    format!("http://{addr}")
}

fn source(base: &str) -> SglangHttpLoadSource {
    SglangHttpLoadSource::new(base, &options()).unwrap()
}

async fn fetch(base: &str) -> Result<Option<WorkerLoad>, LoadError> {
    source(base).fetch().await
}

#[tokio::test]
async fn reads_v1_loads_with_include_core_and_bearer_key() {
    let router = Router::new().route(
        "/v1/loads",
        get(|uri: Uri, headers: HeaderMap| async move {
            let authorized = headers.get("authorization").and_then(|v| v.to_str().ok())
                == Some("Bearer sk-test");
            if uri.query() != Some("include=core") || !authorized {
                return (StatusCode::BAD_REQUEST, "bad request").into_response();
            }
            json(DP4)
        }),
    );
    let base = format!("http://{}", serve_http(router).await);
    let options = SourceOptions {
        api_key: Some("sk-test".into()),
        ..options()
    };
    let source = SglangHttpLoadSource::new(&base, &options).unwrap();
    let load = source.fetch().await.unwrap().unwrap();
    assert_eq!(load.ranks().len(), 4);
    assert_eq!(load.queued_tokens(), Some(75776));
    assert_eq!(load.waiting_requests(), 23);
    assert_eq!(source.endpoint(), SglangHttpEndpoint::Loads);
    assert_eq!(source.kind(), "sglang");
    assert_eq!(source.load_url(), base);

    // Without the key the server refuses: a typed status error.
    let err = fetch(&base).await.unwrap_err();
    assert!(
        matches!(err, LoadError::HttpStatus { status: 400, .. }),
        "{err:?}"
    );
}

#[tokio::test]
async fn built_by_name_from_the_registry() {
    let base = loads_server(SINGLE).await;
    let mut registry = BackendRegistry::new();
    backends_sglang::register(&mut registry);
    // No load address: the worker's URL is polled.
    let source = registry
        .build("sglang", &BackendSpec::new(format!("{base}/")))
        .unwrap();
    let load = source.fetch().await.unwrap().unwrap();
    assert_eq!(load.queued_tokens(), Some(5120));
    // A separate load address wins over the worker's URL.
    let spec = BackendSpec::new("http://127.0.0.1:9").with_load_url(base.clone());
    let load = registry
        .build("sglang", &spec)
        .unwrap()
        .fetch()
        .await
        .unwrap()
        .unwrap();
    assert_eq!(load.running_requests(), 12);
}

#[tokio::test]
async fn zero_ranks_is_no_report() {
    let base = loads_server(r#"{"timestamp": "", "dp_rank_count": 0, "loads": []}"#).await;
    assert!(fetch(&base).await.unwrap().is_none());
}

#[tokio::test]
async fn malformed_json_is_a_decode_error() {
    for body in [
        r#"{"loads": [{"dp_rank": 0,}]}"#,
        "not json",
        r#"{"loads": {"dp_rank": 0}}"#,
    ] {
        let base = loads_server(body).await;
        let err = fetch(&base).await.unwrap_err();
        assert!(matches!(err, LoadError::Decode { .. }), "{body}: {err:?}");
        assert!(
            err.source().is_some(),
            "the serde error is kept as the source"
        );
    }
}

#[tokio::test]
async fn truncated_json_is_a_decode_error() {
    // A complete HTTP response whose JSON stops mid-way.
    let cut = &SINGLE[..SINGLE.len() / 2];
    let base = loads_server(Box::leak(cut.to_owned().into_boxed_str())).await;
    let err = fetch(&base).await.unwrap_err();
    assert!(matches!(err, LoadError::Decode { .. }), "{err:?}");
}

#[tokio::test]
async fn body_shorter_than_its_content_length_is_a_transport_error() {
    // The connection ended the report early (not the report's own bytes).
    let addr = serve_raw(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 500\r\n\r\n{\"loads\": [{\"dp_rank\": 0, ",
    )
    .await;
    let err = fetch(&format!("http://{addr}")).await.unwrap_err();
    assert!(matches!(err, LoadError::Transport { .. }), "{err:?}");
}

#[tokio::test]
async fn wrong_content_type_is_rejected() {
    let router = Router::new().route(
        "/v1/loads",
        get(|| async { ([(CONTENT_TYPE, "text/html; charset=utf-8")], SINGLE) }),
    );
    let base = format!("http://{}", serve_http(router).await);
    match fetch(&base).await.unwrap_err() {
        LoadError::ContentType {
            content_type,
            expected,
            ..
        } => {
            assert_eq!(content_type, "text/html; charset=utf-8");
            assert_eq!(expected, "application/json");
        }
        other => panic!("expected a content-type error, got {other:?}"),
    }
    // No content type at all is rejected the same way.
    let base = format!(
        "http://{}",
        serve_raw("HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}",).await
    );
    assert!(matches!(
        fetch(&base).await.unwrap_err(),
        LoadError::ContentType { content_type, .. } if content_type.is_empty()
    ));
    // `application/json; charset=utf-8` is JSON.
    let router = Router::new().route(
        "/v1/loads",
        get(|| async { ([(CONTENT_TYPE, "application/json; charset=utf-8")], SINGLE) }),
    );
    let base = format!("http://{}", serve_http(router).await);
    assert!(fetch(&base).await.unwrap().is_some());
}

#[tokio::test]
async fn body_over_the_cap_is_refused() {
    let big: &'static str = Box::leak(
        format!(r#"{{"version": "{}", "loads": []}}"#, "x".repeat(4096)).into_boxed_str(),
    );
    let base = loads_server(big).await;
    let options = SourceOptions {
        body_limit_bytes: 1024,
        ..options()
    };
    let source = SglangHttpLoadSource::new(&base, &options).unwrap();
    let err = source.fetch().await.unwrap_err();
    assert!(
        matches!(
            err,
            LoadError::BodyTooLarge {
                limit_bytes: 1024,
                ..
            }
        ),
        "{err:?}"
    );
}

#[tokio::test]
async fn endless_chunked_body_is_cut_at_the_cap() {
    // No content length and a body that never ends: the source must stop
    // reading at the cap, well before the deadline.
    let router = Router::new().route(
        "/v1/loads",
        get(|| async {
            let chunk = Bytes::from(vec![b' '; 16 * 1024]);
            let stream = futures::stream::repeat_with(move || Ok::<_, Infallible>(chunk.clone()));
            (
                [(CONTENT_TYPE, "application/json")],
                Body::from_stream(stream),
            )
        }),
    );
    let base = format!("http://{}", serve_http(router).await);
    let options = SourceOptions {
        body_limit_bytes: 64 * 1024,
        deadline: std::time::Duration::from_secs(30),
        ..SourceOptions::default()
    };
    let source = SglangHttpLoadSource::new(&base, &options).unwrap();
    let err = source.fetch().await.unwrap_err();
    assert!(matches!(err, LoadError::BodyTooLarge { .. }), "{err:?}");
}

#[tokio::test]
async fn non_finite_values_are_decode_errors() {
    // Python's json module writes NaN and Infinity, which are not JSON.
    for body in [
        r#"{"loads": [{"dp_rank": 0, "token_usage": NaN}]}"#,
        r#"{"loads": [{"dp_rank": 0, "gen_throughput": Infinity}]}"#,
        r#"{"loads": [{"dp_rank": 0, "token_usage": 1e999}]}"#,
    ] {
        let base = loads_server(body).await;
        let err = fetch(&base).await.unwrap_err();
        assert!(matches!(err, LoadError::Decode { .. }), "{body}: {err:?}");
    }
}

#[tokio::test]
async fn negative_values_are_invalid() {
    let base = loads_server(r#"{"loads": [{"dp_rank": 1, "num_waiting_reqs": -3}]}"#).await;
    match fetch(&base).await.unwrap_err() {
        LoadError::Invalid { source, .. } => assert_eq!(
            source,
            LoadValidationError::NegativeCount {
                dp_rank: 1,
                field: "num_waiting_reqs",
                value: -3
            }
        ),
        other => panic!("expected an invalid report, got {other:?}"),
    }
    let base = loads_server(r#"{"loads": [{"dp_rank": 0, "token_usage": -0.5}]}"#).await;
    assert!(matches!(
        fetch(&base).await.unwrap_err(),
        LoadError::Invalid {
            source: LoadValidationError::NegativeRatio { .. },
            ..
        }
    ));
    // A negative rate is dropped to "not reported", not rejected.
    let base = loads_server(r#"{"loads": [{"dp_rank": 0, "gen_throughput": -1.0}]}"#).await;
    let load = fetch(&base).await.unwrap().unwrap();
    assert_eq!(load.throughput_tps(), None);
}

#[tokio::test]
async fn token_usage_above_one_is_clamped() {
    let base = loads_server(r#"{"loads": [{"dp_rank": 0, "token_usage": 1.25}]}"#).await;
    let load = fetch(&base).await.unwrap().unwrap();
    assert_eq!(load.kv_usage_ratio(), 1.0);
}

#[tokio::test]
async fn http_500_is_a_status_error() {
    let router = Router::new().route(
        "/v1/loads",
        get(|| async { (StatusCode::INTERNAL_SERVER_ERROR, "scheduler crashed") }),
    );
    let base = format!("http://{}", serve_http(router).await);
    let source = source(&base);
    let err = source.fetch().await.unwrap_err();
    assert!(
        matches!(err, LoadError::HttpStatus { status: 500, .. }),
        "{err:?}"
    );
    // A 500 is not "endpoint missing": the source stays on /v1/loads.
    assert_eq!(source.endpoint(), SglangHttpEndpoint::Loads);
}

#[tokio::test]
async fn a_server_that_never_answers_hits_the_deadline() {
    let base = format!("http://{}", serve_silent().await);
    let source = SglangHttpLoadSource::new(&base, &short_deadline()).unwrap();
    let err = source.fetch().await.unwrap_err();
    assert!(matches!(err, LoadError::Timeout { .. }), "{err:?}");
}

#[tokio::test]
async fn connection_refused_is_a_connect_error() {
    let base = format!("http://{}", refused_addr().await);
    let err = fetch(&base).await.unwrap_err();
    assert!(matches!(err, LoadError::Connect { .. }), "{err:?}");
}

/// A server without `/v1/loads` (answering `missing` there) that serves
/// `metrics` on `/metrics`.
async fn metrics_server(missing: StatusCode, metrics: &'static str) -> String {
    let router = Router::new()
        .route(
            "/v1/loads",
            get(move || async move { (missing, "missing") }),
        )
        .route("/metrics", get(move || async move { text(metrics) }));
    format!("http://{}", serve_http(router).await)
}

#[tokio::test]
async fn falls_back_to_metrics_on_404_405_and_501() {
    for status in [
        StatusCode::NOT_FOUND,
        StatusCode::METHOD_NOT_ALLOWED,
        StatusCode::NOT_IMPLEMENTED,
    ] {
        let base = metrics_server(status, METRICS_NEW).await;
        let source = source(&base);
        let load = source.fetch().await.unwrap().unwrap();
        assert_eq!(load.ranks().len(), 2, "{status}");
        assert_eq!(load.waiting_requests(), 11);
        assert_eq!(load.queued_tokens(), None, "no queued tokens on /metrics");
        assert_eq!(source.endpoint(), SglangHttpEndpoint::Metrics);
    }
    let base = metrics_server(StatusCode::NOT_FOUND, METRICS_OLD).await;
    let load = fetch(&base).await.unwrap().unwrap();
    assert_eq!(load.running_requests(), 17);
    assert_eq!(load.throughput_tps(), Some(1288.6));
}

#[tokio::test]
async fn bad_metrics_text_is_typed() {
    type Check = fn(&LoadError) -> bool;
    let cases: [(&'static str, Check); 4] = [
        // Label escaping gone wrong: a parse error.
        ("sglang_num_queue_reqs{model=\"a\\q\"} 1\n", |e| {
            matches!(e, LoadError::Decode { .. })
        }),
        ("sglang_num_queue_reqs NaN\n", |e| {
            matches!(
                e,
                LoadError::Invalid {
                    source: LoadValidationError::NonFinite { .. },
                    ..
                }
            )
        }),
        ("sglang_num_running_reqs -4\n", |e| {
            matches!(
                e,
                LoadError::Invalid {
                    source: LoadValidationError::NegativeCount { .. },
                    ..
                }
            )
        }),
        // Metrics without any SGLang load gauge (metrics disabled, another app).
        ("# HELP up Up.\n# TYPE up gauge\nup 1\n", |e| {
            matches!(e, LoadError::Unsupported { .. })
        }),
    ];
    for (body, expected) in cases {
        let base = metrics_server(StatusCode::NOT_FOUND, body).await;
        let err = fetch(&base).await.unwrap_err();
        assert!(expected(&err), "{body}: {err:?}");
    }
    // +Inf throughput degrades to "not reported"; usage above 1 is clamped.
    let base = metrics_server(
        StatusCode::NOT_FOUND,
        "sglang:gen_throughput +Inf\nsglang:token_usage 2.5 1765152000000\n",
    )
    .await;
    let load = fetch(&base).await.unwrap().unwrap();
    assert_eq!(load.throughput_tps(), None);
    assert_eq!(load.kv_usage_ratio(), 1.0);
}

#[tokio::test]
async fn metrics_status_and_content_type_are_checked() {
    let router = Router::new()
        .route("/v1/loads", get(|| async { StatusCode::NOT_FOUND }))
        .route("/metrics", get(|| async { json("{}") }));
    let base = format!("http://{}", serve_http(router).await);
    assert!(matches!(
        fetch(&base).await.unwrap_err(),
        LoadError::ContentType {
            expected: "text/plain",
            ..
        }
    ));

    let router = Router::new()
        .route("/v1/loads", get(|| async { StatusCode::NOT_FOUND }))
        .route(
            "/metrics",
            get(|| async { StatusCode::SERVICE_UNAVAILABLE }),
        );
    let base = format!("http://{}", serve_http(router).await);
    assert!(matches!(
        fetch(&base).await.unwrap_err(),
        LoadError::HttpStatus { status: 503, .. }
    ));

    // Neither endpoint exists.
    let base = format!("http://{}", serve_http(Router::new()).await);
    assert!(matches!(
        fetch(&base).await.unwrap_err(),
        LoadError::Unsupported {
            what: "/metrics",
            ..
        }
    ));
}

#[derive(Default)]
struct Hits {
    loads_enabled: AtomicBool,
    loads_fail: AtomicBool,
    loads: AtomicUsize,
    metrics: AtomicUsize,
}

impl Hits {
    fn counts(&self) -> (usize, usize) {
        (
            self.loads.load(Ordering::SeqCst),
            self.metrics.load(Ordering::SeqCst),
        )
    }
}

#[tokio::test]
async fn remembers_a_server_without_v1_loads_and_reprobes_every_n_polls() {
    let hits = Arc::new(Hits::default());
    let loads_hits = hits.clone();
    let metrics_hits = hits.clone();
    let router = Router::new()
        .route(
            "/v1/loads",
            get(move || {
                let hits = loads_hits.clone();
                async move {
                    hits.loads.fetch_add(1, Ordering::SeqCst);
                    if hits.loads_fail.load(Ordering::SeqCst) {
                        (StatusCode::INTERNAL_SERVER_ERROR, "down").into_response()
                    } else if hits.loads_enabled.load(Ordering::SeqCst) {
                        json(SINGLE)
                    } else {
                        StatusCode::NOT_FOUND.into_response()
                    }
                }
            }),
        )
        .route(
            "/metrics",
            get(move || {
                let hits = metrics_hits.clone();
                async move {
                    hits.metrics.fetch_add(1, Ordering::SeqCst);
                    text(METRICS_OLD)
                }
            }),
        );
    let base = format!("http://{}", serve_http(router).await);
    let source = source(&base).reprobe_every_polls(3);

    // Poll 1 probes /v1/loads, finds nothing, and reads /metrics.
    source.fetch().await.unwrap().unwrap();
    assert_eq!(hits.counts(), (1, 1));
    assert_eq!(source.endpoint(), SglangHttpEndpoint::Metrics);
    // Polls 2 and 3 go straight to /metrics.
    source.fetch().await.unwrap().unwrap();
    source.fetch().await.unwrap().unwrap();
    assert_eq!(hits.counts(), (1, 3));
    // Poll 4 is the third since the switch: re-probe, still missing.
    source.fetch().await.unwrap().unwrap();
    assert_eq!(hits.counts(), (2, 4));
    // A re-probe that fails another way still falls back to /metrics.
    hits.loads_fail.store(true, Ordering::SeqCst);
    for _ in 0..3 {
        source.fetch().await.unwrap().unwrap();
    }
    assert_eq!(hits.counts(), (3, 7));
    assert_eq!(source.endpoint(), SglangHttpEndpoint::Metrics);
    // The server gains /v1/loads: the next re-probe switches back for good.
    hits.loads_fail.store(false, Ordering::SeqCst);
    hits.loads_enabled.store(true, Ordering::SeqCst);
    source.fetch().await.unwrap().unwrap();
    source.fetch().await.unwrap().unwrap();
    assert_eq!(hits.counts(), (3, 9));
    let load = source.fetch().await.unwrap().unwrap();
    assert_eq!(load.queued_tokens(), Some(5120), "read from /v1/loads");
    assert_eq!(hits.counts(), (4, 9));
    assert_eq!(source.endpoint(), SglangHttpEndpoint::Loads);
    source.fetch().await.unwrap().unwrap();
    assert_eq!(hits.counts(), (5, 9));
}
