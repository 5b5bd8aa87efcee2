//! `SglangGrpcLoadSource` against a real tonic server on loopback.

// Helpers outside #[test] functions may unwrap too: a panic is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::error::Error as _;
use std::net::SocketAddr;
use std::sync::Arc;

use backends_sglang::proto::sglang_scheduler_server::{SglangScheduler, SglangSchedulerServer};
use backends_sglang::proto::{
    GetLoadsRequest, GetLoadsResponse, HealthCheckRequest, HealthCheckResponse, SchedulerLoad,
};
use backends_sglang::{SglangGrpcLoadSource, SglangHttpLoadSource};
use load_protocols::{LoadValidationError, WorkerLoad};
use parking_lot::Mutex;
use policy_core::{
    BackendError, BackendRegistry, BackendSpec, LoadError, LoadSource, SourceOptions,
};
use prost::Message;
use tonic::transport::server::TcpIncoming;
use tonic::{Code, Request, Response, Status};

use common::{options, refused_addr, serve_silent, short_deadline};

#[derive(Clone)]
enum Reply {
    Loads(GetLoadsResponse),
    Fail(Code),
    Hang,
}

/// What the server saw of each call: the authorization header and `include`.
type Seen = Arc<Mutex<Vec<(Option<String>, Vec<String>)>>>;

#[derive(Clone)]
struct Scheduler {
    reply: Arc<Mutex<Reply>>,
    seen: Seen,
}

#[tonic::async_trait]
impl SglangScheduler for Scheduler {
    async fn get_loads(
        &self,
        request: Request<GetLoadsRequest>,
    ) -> Result<Response<GetLoadsResponse>, Status> {
        let authorization = request
            .metadata()
            .get("authorization")
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned);
        self.seen
            .lock()
            .push((authorization, request.into_inner().include));
        let reply = self.reply.lock().clone();
        match reply {
            Reply::Loads(response) => Ok(Response::new(response)),
            Reply::Fail(code) => Err(Status::new(code, "scripted failure")),
            Reply::Hang => std::future::pending().await,
        }
    }

    async fn health_check(
        &self,
        _request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        Ok(Response::new(HealthCheckResponse {
            healthy: true,
            message: String::new(),
        }))
    }
}

async fn serve(reply: Reply) -> (SocketAddr, Scheduler) {
    let scheduler = Scheduler {
        reply: Arc::new(Mutex::new(reply)),
        seen: Arc::default(),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let service = SglangSchedulerServer::new(scheduler.clone());
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(TcpIncoming::from(listener))
            .await
    });
    (addr, scheduler)
}

fn registry() -> BackendRegistry {
    let mut registry = BackendRegistry::new();
    backends_sglang::register(&mut registry);
    registry
}

fn build(addr: SocketAddr, options: SourceOptions) -> Arc<dyn LoadSource> {
    let spec = BackendSpec {
        options,
        ..BackendSpec::new("http://127.0.0.1:30000").with_load_url(format!("grpc://{addr}"))
    };
    registry().build("sglang-grpc", &spec).unwrap()
}

async fn fetch(reply: Reply) -> Result<Option<WorkerLoad>, LoadError> {
    let (addr, _) = serve(reply).await;
    build(addr, options()).fetch().await
}

fn loads(ranks: Vec<SchedulerLoad>) -> Reply {
    Reply::Loads(GetLoadsResponse {
        dp_rank_count: ranks.len() as i32,
        loads: ranks,
        ..Default::default()
    })
}

#[tokio::test]
async fn fetches_get_loads_with_core_and_bearer_key() {
    let fixture =
        GetLoadsResponse::decode(include_bytes!("fixtures/grpc_dp2.binpb").as_slice()).unwrap();
    let (addr, scheduler) = serve(Reply::Loads(fixture)).await;
    let source = build(
        addr,
        SourceOptions {
            api_key: Some("sk-grpc".into()),
            ..options()
        },
    );
    assert_eq!(source.kind(), "sglang-grpc");
    assert_eq!(source.load_url(), format!("grpc://{addr}"));
    let load = source.fetch().await.unwrap().unwrap();
    assert_eq!(load.queued_tokens(), Some(5120));
    assert_eq!(load.running_requests(), 21);
    assert_eq!(load.throughput_tps(), Some(3542.75));
    // The channel is reused across polls.
    source.fetch().await.unwrap().unwrap();
    let seen = scheduler.seen.lock().clone();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[0].0.as_deref(), Some("Bearer sk-grpc"));
    assert_eq!(seen[0].1, ["core"]);
}

#[tokio::test]
async fn proto3_presence_over_the_wire() {
    let load = fetch(loads(vec![SchedulerLoad {
        num_waiting_reqs: 2,
        token_usage: 0.5,
        ..Default::default()
    }]))
    .await
    .unwrap()
    .unwrap();
    assert_eq!(load.queued_tokens(), None, "0 next to waiting requests");
    assert_eq!(load.throughput_tps(), None, "0.0 is not reported");
}

#[tokio::test]
async fn empty_loads_is_no_report() {
    assert!(fetch(loads(vec![])).await.unwrap().is_none());
}

#[tokio::test]
async fn bad_values_are_rejected_or_clamped() {
    for usage in [f64::NAN, f64::INFINITY] {
        let err = fetch(loads(vec![SchedulerLoad {
            token_usage: usage,
            ..Default::default()
        }]))
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
    let err = fetch(loads(vec![SchedulerLoad {
        dp_rank: 1,
        num_running_reqs: -1,
        ..Default::default()
    }]))
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
    let err = fetch(loads(vec![SchedulerLoad {
        num_waiting_uncached_tokens: -5,
        ..Default::default()
    }]))
    .await
    .unwrap_err();
    assert!(matches!(err, LoadError::Invalid { .. }), "{err:?}");

    let load = fetch(loads(vec![SchedulerLoad {
        token_usage: 1.5,
        gen_throughput: f64::INFINITY,
        ..Default::default()
    }]))
    .await
    .unwrap()
    .unwrap();
    assert_eq!(load.kv_usage_ratio(), 1.0);
    assert_eq!(load.throughput_tps(), None);
}

#[tokio::test]
async fn unimplemented_is_unsupported() {
    let err = fetch(Reply::Fail(Code::Unimplemented)).await.unwrap_err();
    assert!(
        matches!(
            err,
            LoadError::Unsupported {
                what: "GetLoads",
                ..
            }
        ),
        "{err:?}"
    );
}

#[tokio::test]
async fn unavailable_from_the_server_is_a_grpc_error() {
    let err = fetch(Reply::Fail(Code::Unavailable)).await.unwrap_err();
    let LoadError::Grpc { source, .. } = &err else {
        panic!("expected a gRPC error, got {err:?}");
    };
    let status = source.downcast_ref::<Status>().unwrap();
    assert_eq!(status.code(), Code::Unavailable);
    assert_eq!(status.message(), "scripted failure");
}

#[tokio::test]
async fn deadline_exceeded_and_a_hung_server_are_timeouts() {
    let err = fetch(Reply::Fail(Code::DeadlineExceeded))
        .await
        .unwrap_err();
    assert!(matches!(err, LoadError::Timeout { .. }), "{err:?}");
    let (addr, _) = serve(Reply::Hang).await;
    let err = build(addr, short_deadline()).fetch().await.unwrap_err();
    assert!(matches!(err, LoadError::Timeout { .. }), "{err:?}");
    // A TCP server that never speaks HTTP/2 at all.
    let addr = serve_silent().await;
    let err = build(addr, short_deadline()).fetch().await.unwrap_err();
    assert!(matches!(err, LoadError::Timeout { .. }), "{err:?}");
}

#[tokio::test]
async fn connection_refused_is_a_connect_error() {
    let addr = refused_addr().await;
    let err = build(addr, options()).fetch().await.unwrap_err();
    assert!(matches!(err, LoadError::Connect { .. }), "{err:?}");
    assert!(err.source().is_some());
}

#[tokio::test]
async fn reply_over_the_cap_is_refused() {
    let big = Reply::Loads(GetLoadsResponse {
        version: "x".repeat(4096),
        loads: vec![SchedulerLoad::default()],
        ..Default::default()
    });
    let (addr, _) = serve(big).await;
    let source = build(
        addr,
        SourceOptions {
            body_limit_bytes: 1024,
            ..options()
        },
    );
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

#[test]
fn factory_needs_a_grpc_load_address() {
    // Built outside any runtime: the channel is only made on the first poll.
    let registry = registry();
    let spec = BackendSpec::new("http://127.0.0.1:30000");
    assert!(matches!(
        registry.build("sglang-grpc", &spec).err().unwrap(),
        BackendError::MissingLoadUrl { backend } if backend == "sglang-grpc"
    ));
    for bad in [
        "http://127.0.0.1:30001",
        "grpc://127.0.0.1",
        "127.0.0.1:30001",
    ] {
        let spec = BackendSpec::new("http://127.0.0.1:30000").with_load_url(bad);
        assert!(
            matches!(
                registry.build("sglang-grpc", &spec).err().unwrap(),
                BackendError::InvalidAddress { .. }
            ),
            "{bad}"
        );
    }
    let spec = BackendSpec::new("http://127.0.0.1:30000").with_load_url("grpc://127.0.0.1:30001");
    assert!(registry.build("sglang-grpc", &spec).is_ok());
    let spec = BackendSpec {
        options: SourceOptions {
            api_key: Some("bad\nkey".into()),
            ..SourceOptions::default()
        },
        ..spec
    };
    assert!(matches!(
        registry.build("sglang-grpc", &spec).err().unwrap(),
        BackendError::Client { .. }
    ));
    let http = BackendSpec {
        load_url: None,
        ..spec
    };
    assert!(matches!(
        registry.build("sglang", &http).err().unwrap(),
        BackendError::Client { .. }
    ));
}

#[test]
fn the_api_key_stays_out_of_debug_output() {
    let options = SourceOptions {
        api_key: Some("sk-secret".into()),
        ..SourceOptions::default()
    };
    let grpc = SglangGrpcLoadSource::new("grpc://127.0.0.1:30001", &options).unwrap();
    let http = SglangHttpLoadSource::new("http://127.0.0.1:30000", &options).unwrap();
    for debug in [format!("{grpc:?}"), format!("{http:?}")] {
        assert!(!debug.contains("sk-secret"), "{debug}");
    }
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
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await });
    addr
}

#[tokio::test]
async fn a_server_that_is_not_grpc_gives_typed_errors() {
    // 200 with a JSON content type: not a gRPC reply.
    let err = build(serve_not_grpc(200).await, options())
        .fetch()
        .await
        .unwrap_err();
    let LoadError::Grpc { source, .. } = &err else {
        panic!("expected a gRPC error, got {err:?}");
    };
    assert!(source.downcast_ref::<Status>().is_some());
    let err = build(serve_not_grpc(404).await, options())
        .fetch()
        .await
        .unwrap_err();
    assert!(matches!(err, LoadError::Grpc { .. }), "{err:?}");
}
