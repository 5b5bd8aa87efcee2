//! `SglangGrpcLoadSource` against a real tonic server on loopback: the
//! checks every gRPC load source passes (`load_transport::test_support`),
//! and what SGLang's own proto and conversion decide.

// Helpers outside #[test] functions may unwrap too: a panic is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::net::SocketAddr;

use backends_sglang::proto::sglang_scheduler_server::{SglangScheduler, SglangSchedulerServer};
use backends_sglang::proto::{GetLoadsResponse, SchedulerLoad};
use backends_sglang::{SglangGetLoads, SglangHttpLoadSource};
use load_protocols::LoadValidationError;
use load_transport::test_support::{self, Script, build, fetch_ranks, options};
use policy_core::{BackendError, BackendRegistry, BackendSpec, LoadError, SourceOptions};
use prost::Message;
use tonic::Status;

load_transport::scripted_backend!(
    Sglang,
    SglangGetLoads,
    SglangScheduler,
    SglangSchedulerServer,
    backends_sglang::proto
);

#[tokio::test]
async fn what_every_grpc_source_does() {
    // DEADLINE_EXCEEDED from the server is a timed-out poll here.
    test_support::check_source::<Sglang>().await;
}

#[test]
fn the_http_backend_beside_it_refuses_a_bad_key_too() {
    let mut registry = BackendRegistry::new();
    backends_sglang::register(&mut registry);
    let http = BackendSpec {
        options: SourceOptions {
            api_key: Some("bad\nkey".into()),
            ..SourceOptions::default()
        },
        ..BackendSpec::new(test_support::WORKER_URL)
    };
    assert!(matches!(
        registry.build("sglang", &http).err().unwrap(),
        BackendError::Client { .. }
    ));
}

#[test]
fn the_api_key_stays_out_of_the_http_source_s_debug_output() {
    let options = SourceOptions {
        api_key: Some("sk-secret".into()),
        ..SourceOptions::default()
    };
    let http = SglangHttpLoadSource::new("http://127.0.0.1:30000", &options).unwrap();
    let debug = format!("{http:?}");
    assert!(!debug.contains("sk-secret"), "{debug}");
}

#[tokio::test]
async fn a_dp2_report() {
    let fixture =
        GetLoadsResponse::decode(include_bytes!("fixtures/grpc_dp2.binpb").as_slice()).unwrap();
    let load = test_support::fetch::<Sglang>(Script::Reply(fixture))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(load.queued_tokens(), Some(5120));
    assert_eq!(load.running_requests(), 21);
    assert_eq!(load.throughput_tps(), Some(3542.75));
}

#[tokio::test]
async fn proto3_presence_over_the_wire() {
    let load = fetch_ranks::<Sglang>(vec![SchedulerLoad {
        num_waiting_reqs: 2,
        token_usage: 0.5,
        ..Default::default()
    }])
    .await
    .unwrap()
    .unwrap();
    assert_eq!(load.queued_tokens(), None, "0 next to waiting requests");
    assert_eq!(load.throughput_tps(), None, "0.0 is not reported");
}

#[tokio::test]
async fn bad_values_are_rejected_or_clamped() {
    for usage in [f64::NAN, f64::INFINITY] {
        let err = fetch_ranks::<Sglang>(vec![SchedulerLoad {
            token_usage: usage,
            ..Default::default()
        }])
        .await
        .unwrap_err();
        assert!(
            matches!(
                err,
                LoadError::Invalid {
                    source: LoadValidationError::NonFinite {
                        field: "token_usage",
                        ..
                    },
                    ..
                }
            ),
            "{err:?}"
        );
    }
    let err = fetch_ranks::<Sglang>(vec![SchedulerLoad {
        dp_rank: 1,
        num_running_reqs: -1,
        ..Default::default()
    }])
    .await
    .unwrap_err();
    assert!(
        matches!(
            err,
            LoadError::Invalid {
                source: LoadValidationError::NegativeCount {
                    dp_rank: 1,
                    field: "num_running_reqs",
                    value: -1
                },
                ..
            }
        ),
        "{err:?}"
    );
    let err = fetch_ranks::<Sglang>(vec![SchedulerLoad {
        num_waiting_uncached_tokens: -5,
        ..Default::default()
    }])
    .await
    .unwrap_err();
    assert!(matches!(err, LoadError::Invalid { .. }), "{err:?}");

    let load = fetch_ranks::<Sglang>(vec![SchedulerLoad {
        token_usage: 1.5,
        gen_throughput: f64::INFINITY,
        ..Default::default()
    }])
    .await
    .unwrap()
    .unwrap();
    assert_eq!(load.kv_usage_ratio(), 1.0);
    assert_eq!(load.throughput_tps(), None);
}

/// An HTTP server (HTTP/1 and h2c) on the gRPC port, answering `status` with
/// a JSON body to every path.
async fn serve_not_grpc(status: u16) -> SocketAddr {
    let router = axum::Router::new().fallback(move || async move {
        (
            axum::http::StatusCode::from_u16(status).unwrap(),
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            "{}",
        )
    });
    common::serve_http(router).await
}

#[tokio::test]
async fn a_server_that_is_not_grpc_gives_typed_errors() {
    // 200 with a JSON content type: not a gRPC reply.
    let err = build::<Sglang>(serve_not_grpc(200).await, options())
        .fetch()
        .await
        .unwrap_err();
    let LoadError::Grpc { source, .. } = &err else {
        panic!("expected a gRPC error, got {err:?}");
    };
    assert!(source.downcast_ref::<Status>().is_some());
    let err = build::<Sglang>(serve_not_grpc(404).await, options())
        .fetch()
        .await
        .unwrap_err();
    assert!(matches!(err, LoadError::Grpc { .. }), "{err:?}");
}
