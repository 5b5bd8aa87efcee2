//! `VllmMetricsLoadSource` against real loopback HTTP servers.

// Helpers outside `#[test]` fns panic too: in a test, a panic is a failed assertion.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::error::Error as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use backends_vllm::{VllmMetricsError, register};
use load_protocols::{LoadValidationError, PrometheusParseReason};
use policy_core::{BackendRegistry, BackendSpec, LoadError, LoadSource, SourceOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

const V1_T0: &str = include_str!("fixtures/v1_two_engines_t0.txt");
const V1_T1: &str = include_str!("fixtures/v1_two_engines_t1.txt");
const OLDER: &str = include_str!("fixtures/older_server.txt");
const QUIRKS: &str = include_str!("fixtures/v1_quirks.txt");
const TEXT_FORMAT: &str = "text/plain; version=0.0.4; charset=utf-8";

async fn serve(router: Router) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await });
    addr
}

/// A server answering `/metrics` with a fixed status, content type and body.
async fn serve_metrics(
    status: StatusCode,
    content_type: &'static str,
    body: Vec<u8>,
) -> SocketAddr {
    let router = Router::new().route(
        "/metrics",
        get(move || {
            let body = body.clone();
            async move { (status, [(header::CONTENT_TYPE, content_type)], body) }
        }),
    );
    serve(router).await
}

async fn serve_text(body: &str) -> SocketAddr {
    serve_metrics(StatusCode::OK, TEXT_FORMAT, body.as_bytes().to_vec()).await
}

fn options(deadline_ms: u64) -> SourceOptions {
    SourceOptions {
        deadline: Duration::from_millis(deadline_ms),
        ..SourceOptions::default()
    }
}

fn source_with(addr: SocketAddr, options: SourceOptions) -> Arc<dyn LoadSource> {
    let mut registry = BackendRegistry::new();
    register(&mut registry);
    let spec = BackendSpec {
        options,
        ..BackendSpec::new(format!("http://{addr}"))
    };
    registry.build("vllm", &spec).unwrap()
}

fn source(addr: SocketAddr) -> Arc<dyn LoadSource> {
    source_with(addr, options(2_000))
}

/// The `VllmMetricsError` inside a `LoadError::Decode`.
fn decode_cause(err: &LoadError) -> &VllmMetricsError {
    match err {
        LoadError::Decode { source, .. } => source
            .downcast_ref::<VllmMetricsError>()
            .unwrap_or_else(|| panic!("unexpected decode cause {source:?}")),
        other => panic!("expected Decode, got {other:?}"),
    }
}

fn validation(err: LoadError) -> LoadValidationError {
    match err {
        LoadError::Invalid { source, .. } => source,
        other => panic!("expected Invalid, got {other:?}"),
    }
}

#[tokio::test]
async fn v1_server_is_polled_and_rated() {
    let polls = Arc::new(AtomicUsize::new(0));
    let seen = polls.clone();
    let router = Router::new().route(
        "/metrics",
        get(move || {
            let poll = seen.fetch_add(1, Ordering::SeqCst);
            let body = if poll == 0 { V1_T0 } else { V1_T1 };
            async move { ([(header::CONTENT_TYPE, TEXT_FORMAT)], body) }
        }),
    );
    let addr = serve(router).await;
    let source = source(addr);
    assert_eq!(source.kind(), "vllm");
    assert_eq!(source.load_url(), format!("http://{addr}/metrics"));

    let first = source.fetch().await.unwrap().unwrap();
    assert_eq!(first.running_requests(), 43);
    assert_eq!(first.waiting_requests(), 9);
    assert_eq!(first.throughput_tps(), None);
    assert_eq!(first.queued_tokens(), None);

    let second = source.fetch().await.unwrap().unwrap();
    assert_eq!(second.waiting_requests(), 8);
    // 7000 tokens over the (real) time between the two polls.
    let rate = second.throughput_tps().unwrap();
    assert!(rate.is_finite() && rate > 0.0, "{rate}");
    assert_eq!(polls.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn older_server_and_quirky_text_are_read() {
    let older = source(serve_text(OLDER).await)
        .fetch()
        .await
        .unwrap()
        .unwrap();
    assert_eq!(older.waiting_requests(), 4);
    assert!((older.kv_usage_ratio() - 0.8734).abs() < 1e-12);

    let quirks = source(serve_text(QUIRKS).await)
        .fetch()
        .await
        .unwrap()
        .unwrap();
    assert_eq!(quirks.running_requests(), 4);
    assert_eq!(quirks.waiting_requests(), 6);
}

#[tokio::test]
async fn a_missing_content_type_is_read_as_text() {
    let addr = serve(Router::new().route(
        "/metrics",
        get(|| async {
            let mut response = Response::new(Body::from(OLDER));
            response.headers_mut().remove(header::CONTENT_TYPE);
            response
        }),
    ))
    .await;
    assert!(source(addr).fetch().await.unwrap().is_some());
}

#[tokio::test]
async fn the_api_key_is_sent_as_a_bearer_token() {
    let router = Router::new().route(
        "/metrics",
        get(|headers: HeaderMap| async move {
            let authorized = headers
                .get(header::AUTHORIZATION)
                .is_some_and(|value| value == "Bearer s3cret");
            if authorized {
                ([(header::CONTENT_TYPE, TEXT_FORMAT)], OLDER).into_response()
            } else {
                StatusCode::UNAUTHORIZED.into_response()
            }
        }),
    );
    let addr = serve(router).await;
    let keyed = source_with(
        addr,
        SourceOptions {
            api_key: Some("s3cret".into()),
            ..options(2_000)
        },
    );
    assert!(keyed.fetch().await.unwrap().is_some());
    let err = source(addr).fetch().await.unwrap_err();
    assert!(
        matches!(err, LoadError::HttpStatus { status: 401, .. }),
        "{err:?}"
    );
}

#[tokio::test]
async fn a_separate_load_url_is_polled() {
    let addr = serve_text(OLDER).await;
    let mut registry = BackendRegistry::new();
    register(&mut registry);
    let spec = BackendSpec::new("http://127.0.0.1:9").with_load_url(format!("http://{addr}/"));
    let source = registry.build("vllm", &spec).unwrap();
    assert_eq!(source.load_url(), format!("http://{addr}/metrics"));
    assert!(source.fetch().await.unwrap().is_some());
}

#[tokio::test]
async fn malformed_text_is_a_decode_error_naming_the_line() {
    let addr = serve_text(
        "vllm:num_requests_running{engine=\"0\"} 1\nvllm:num_requests_waiting{engine=0} 2\n",
    )
    .await;
    let err = source(addr).fetch().await.unwrap_err();
    let VllmMetricsError::Parse(parse) = decode_cause(&err) else {
        panic!("{err:?}");
    };
    assert_eq!(parse.line, 2);
    assert_eq!(
        parse.reason,
        PrometheusParseReason::Expected {
            expected: '"',
            found: "'0'".into()
        }
    );
    assert!(err.source().is_some());
}

#[tokio::test]
async fn text_that_is_not_utf8_is_a_decode_error() {
    let addr = serve_metrics(
        StatusCode::OK,
        TEXT_FORMAT,
        vec![b'm', b' ', 0xff, 0xfe, b'\n'],
    )
    .await;
    let err = source(addr).fetch().await.unwrap_err();
    match err {
        LoadError::Decode { source, .. } => {
            assert!(
                source
                    .downcast_ref::<std::string::FromUtf8Error>()
                    .is_some()
            );
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn an_engine_missing_a_gauge_is_a_decode_error() {
    let addr = serve_text(
        "vllm:num_requests_running{engine=\"0\"} 1\nvllm:kv_cache_usage_perc{engine=\"0\"} 0.5\n",
    )
    .await;
    let err = source(addr).fetch().await.unwrap_err();
    assert_eq!(
        decode_cause(&err),
        &VllmMetricsError::MissingSeries {
            family: "vllm:num_requests_waiting",
            engine: "0".into()
        }
    );
}

#[tokio::test]
async fn nan_infinite_and_negative_values_are_invalid() {
    let scrape = |running: &str, waiting: &str, usage: &str| {
        format!(
            "vllm:num_requests_running{{engine=\"0\"}} {running}\n\
             vllm:num_requests_waiting{{engine=\"0\"}} {waiting}\n\
             vllm:kv_cache_usage_perc{{engine=\"0\"}} {usage}\n"
        )
    };
    let err = source(serve_text(&scrape("1", "1", "NaN")).await)
        .fetch()
        .await
        .unwrap_err();
    assert!(matches!(
        validation(err),
        LoadValidationError::NonFinite { field: "token_usage", value, .. } if value.is_nan()
    ));
    let err = source(serve_text(&scrape("+Inf", "1", "0.5")).await)
        .fetch()
        .await
        .unwrap_err();
    assert_eq!(
        validation(err),
        LoadValidationError::NonFinite {
            dp_rank: 0,
            field: "num_running_reqs",
            value: f64::INFINITY
        }
    );
    let err = source(serve_text(&scrape("1", "-1", "0.5")).await)
        .fetch()
        .await
        .unwrap_err();
    assert_eq!(
        validation(err),
        LoadValidationError::NegativeCount {
            dp_rank: 0,
            field: "num_waiting_reqs",
            value: -1
        }
    );
    let err = source(serve_text(&scrape("1", "1", "-0.5")).await)
        .fetch()
        .await
        .unwrap_err();
    assert_eq!(
        validation(err),
        LoadValidationError::NegativeRatio {
            dp_rank: 0,
            field: "token_usage",
            value: -0.5
        }
    );
}

#[tokio::test]
async fn kv_usage_above_one_is_clamped() {
    let text = "vllm:num_requests_running{engine=\"0\"} 1\n\
                vllm:num_requests_waiting{engine=\"0\"} 1\n\
                vllm:kv_cache_usage_perc{engine=\"0\"} 1.25\n";
    let load = source(serve_text(text).await)
        .fetch()
        .await
        .unwrap()
        .unwrap();
    assert_eq!(load.kv_usage_ratio(), 1.0);
}

#[tokio::test]
async fn zero_vllm_series_is_no_ranks() {
    for body in [
        "",
        "# HELP process_open_fds x\n# TYPE process_open_fds gauge\nprocess_open_fds 97\n",
    ] {
        let err = source(serve_text(body).await).fetch().await.unwrap_err();
        assert_eq!(validation(err), LoadValidationError::NoRanks, "{body:?}");
    }
}

#[tokio::test]
async fn http_errors_are_typed() {
    let addr = serve_metrics(
        StatusCode::INTERNAL_SERVER_ERROR,
        TEXT_FORMAT,
        b"boom".to_vec(),
    )
    .await;
    let err = source(addr).fetch().await.unwrap_err();
    assert!(
        matches!(err, LoadError::HttpStatus { status: 500, .. }),
        "{err:?}"
    );

    for status in [
        StatusCode::NOT_FOUND,
        StatusCode::METHOD_NOT_ALLOWED,
        StatusCode::NOT_IMPLEMENTED,
    ] {
        let addr = serve_metrics(status, TEXT_FORMAT, Vec::new()).await;
        let err = source(addr).fetch().await.unwrap_err();
        assert!(
            matches!(
                err,
                LoadError::Unsupported {
                    what: "vllm /metrics",
                    ..
                }
            ),
            "{status}: {err:?}"
        );
    }
    // A server with no /metrics route at all.
    let addr = serve(Router::new()).await;
    let err = source(addr).fetch().await.unwrap_err();
    assert!(matches!(err, LoadError::Unsupported { .. }), "{err:?}");
}

#[tokio::test]
async fn a_wrong_content_type_is_rejected() {
    let addr = serve_metrics(
        StatusCode::OK,
        "application/json",
        b"{\"loads\": []}".to_vec(),
    )
    .await;
    let err = source(addr).fetch().await.unwrap_err();
    match err {
        LoadError::ContentType {
            content_type,
            expected,
            ..
        } => {
            assert_eq!(content_type, "application/json");
            assert_eq!(expected, "text/plain");
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_body_over_the_cap_is_cut_off() {
    let limited = |addr| {
        source_with(
            addr,
            SourceOptions {
                body_limit_bytes: 4 * 1024,
                ..options(2_000)
            },
        )
    };
    // Announced by Content-Length: refused before reading.
    let addr = serve_text(V1_T0).await;
    let err = limited(addr).fetch().await.unwrap_err();
    assert!(
        matches!(
            err,
            LoadError::BodyTooLarge {
                limit_bytes: 4096,
                ..
            }
        ),
        "{err:?}"
    );
    // Streamed without a length, and endless: reading stops at the cap.
    let router = Router::new().route(
        "/metrics",
        get(|| async {
            let line = Bytes::from_static(b"vllm:num_requests_running{engine=\"0\"} 1\n");
            let endless = tokio_stream::iter(std::iter::repeat_with(move || {
                Ok::<_, std::io::Error>(line.clone())
            }));
            (
                [(header::CONTENT_TYPE, TEXT_FORMAT)],
                Body::from_stream(endless),
            )
        }),
    );
    let addr = serve(router).await;
    let err = limited(addr).fetch().await.unwrap_err();
    assert!(
        matches!(
            err,
            LoadError::BodyTooLarge {
                limit_bytes: 4096,
                ..
            }
        ),
        "{err:?}"
    );
    // Exactly at the cap is fine.
    let small =
        "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0.5\n";
    let exact = format!("{small}#{}\n", " ".repeat(4096 - small.len() - 2));
    assert_eq!(exact.len(), 4096);
    let addr = serve_text(&exact).await;
    assert!(limited(addr).fetch().await.unwrap().is_some());
}

/// A raw server that answers every connection with `response`, then closes.
async fn serve_raw(response: Vec<u8>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let response = response.clone();
            tokio::spawn(async move {
                let mut request = [0_u8; 4096];
                let _ = socket.read(&mut request).await;
                let _ = socket.write_all(&response).await;
                let _ = socket.shutdown().await;
            });
        }
    });
    addr
}

#[tokio::test]
async fn a_truncated_body_is_a_transport_error() {
    let partial = &OLDER[..OLDER.len() / 2];
    let response = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n{partial}",
        OLDER.len()
    );
    let addr = serve_raw(response.into_bytes()).await;
    let err = source(addr).fetch().await.unwrap_err();
    assert!(matches!(err, LoadError::Transport { .. }), "{err:?}");
}

#[tokio::test]
async fn a_body_truncated_mid_line_is_a_decode_error() {
    // The server itself cut the text (a correct length for a cut body).
    let prefix = "vllm:num_requests_waiting{model_name=\"mistral";
    let cut = &OLDER[..OLDER.find(prefix).unwrap() + prefix.len()];
    let addr = serve_text(cut).await;
    let err = source(addr).fetch().await.unwrap_err();
    assert!(
        matches!(
            decode_cause(&err),
            VllmMetricsError::Parse(parse)
                if parse.reason == PrometheusParseReason::UnterminatedLabelValue
        ),
        "{err:?}"
    );
}

#[tokio::test]
async fn a_server_that_never_answers_times_out() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket); // accepted, never answered
        }
    });
    let err = source_with(addr, options(200)).fetch().await.unwrap_err();
    match err {
        LoadError::Timeout { url, deadline } => {
            assert_eq!(url, format!("http://{addr}/metrics"));
            assert_eq!(deadline, Duration::from_millis(200));
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn connection_refused_is_a_connect_error() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let err = source(addr).fetch().await.unwrap_err();
    assert!(matches!(err, LoadError::Connect { .. }), "{err:?}");
}
