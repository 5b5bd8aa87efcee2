//! `TokenspeedGrpcLoadSource` against a real tonic server on loopback: good
//! reports and every bad input that applies to gRPC.

// Helpers outside #[test] functions may unwrap too: a panic is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::error::Error as _;
use std::net::SocketAddr;
use std::sync::Arc;

use backends_tokenspeed::proto::token_speed_scheduler_server::{
    TokenSpeedScheduler, TokenSpeedSchedulerServer,
};
use backends_tokenspeed::proto::{
    GetLoadsRequest, GetLoadsResponse, HealthCheckRequest, HealthCheckResponse, SchedulerLoad,
};
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
impl TokenSpeedScheduler for Scheduler {
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
    let service = TokenSpeedSchedulerServer::new(scheduler.clone());
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
    backends_tokenspeed::register(&mut registry);
    registry
}

fn build(addr: SocketAddr, options: SourceOptions) -> Arc<dyn LoadSource> {
    let spec = BackendSpec {
        options,
        ..BackendSpec::new("http://127.0.0.1:8000").with_load_url(format!("grpc://{addr}"))
    };
    registry().build("tokenspeed", &spec).unwrap()
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
        GetLoadsResponse::decode(include_bytes!("fixtures/grpc_released_dp2.binpb").as_slice())
            .unwrap();
    let (addr, scheduler) = serve(Reply::Loads(fixture)).await;
    let source = build(
        addr,
        SourceOptions {
            api_key: Some("sk-ts".into()),
            ..options()
        },
    );
    assert_eq!(source.kind(), "tokenspeed");
    assert_eq!(source.load_url(), format!("grpc://{addr}"));
    let load = source.fetch().await.unwrap().unwrap();
    assert_eq!(load.running_requests(), 59);
    assert_eq!(load.waiting_requests(), 4);
    assert_eq!(load.queued_tokens(), None, "a released server reports none");
    source.fetch().await.unwrap().unwrap();
    let seen = scheduler.seen.lock().clone();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[0].0.as_deref(), Some("Bearer sk-ts"));
    assert_eq!(seen[0].1, ["core"]);
}

#[tokio::test]
async fn a_positive_field_14_is_used() {
    let load = fetch(loads(vec![SchedulerLoad {
        num_waiting_reqs: 2,
        num_waiting_uncached_tokens: 3000,
        gen_throughput: 1500.0,
        ..Default::default()
    }]))
    .await
    .unwrap()
    .unwrap();
    assert_eq!(load.queued_tokens(), Some(3000));
    assert_eq!(load.throughput_tps(), Some(1500.0));
}

#[tokio::test]
async fn empty_loads_is_no_report() {
    assert!(fetch(loads(vec![])).await.unwrap().is_none());
}

#[tokio::test]
async fn deadline_exceeded_is_no_report() {
    assert!(
        fetch(Reply::Fail(Code::DeadlineExceeded))
            .await
            .unwrap()
            .is_none()
    );
}

#[tokio::test]
async fn a_hung_server_is_a_timeout() {
    let (addr, _) = serve(Reply::Hang).await;
    let err = build(addr, short_deadline()).fetch().await.unwrap_err();
    assert!(matches!(err, LoadError::Timeout { .. }), "{err:?}");
    let addr = serve_silent().await;
    let err = build(addr, short_deadline()).fetch().await.unwrap_err();
    assert!(matches!(err, LoadError::Timeout { .. }), "{err:?}");
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
    assert_eq!(
        source.downcast_ref::<Status>().unwrap().code(),
        Code::Unavailable
    );
    let err = fetch(Reply::Fail(Code::Internal)).await.unwrap_err();
    assert!(matches!(err, LoadError::Grpc { .. }), "{err:?}");
}

#[tokio::test]
async fn connection_refused_is_a_connect_error() {
    let err = build(refused_addr().await, options())
        .fetch()
        .await
        .unwrap_err();
    assert!(matches!(err, LoadError::Connect { .. }), "{err:?}");
    assert!(err.source().is_some());
}

#[tokio::test]
async fn bad_values_are_rejected_or_clamped() {
    for usage in [f64::NAN, f64::INFINITY, -0.5] {
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
                    } | LoadValidationError::NegativeRatio {
                        field: "token_usage",
                        ..
                    },
                    ..
                }
            ),
            "{usage}: {err:?}"
        );
    }
    let err = fetch(loads(vec![SchedulerLoad {
        num_waiting_reqs: -2,
        ..Default::default()
    }]))
    .await
    .unwrap_err();
    assert!(
        matches!(
            err,
            LoadError::Invalid {
                source: LoadValidationError::NegativeCount {
                    field: "num_waiting_reqs",
                    ..
                },
                ..
            }
        ),
        "{err:?}"
    );
    let load = fetch(loads(vec![SchedulerLoad {
        token_usage: 1.2,
        gen_throughput: f64::NAN,
        ..Default::default()
    }]))
    .await
    .unwrap()
    .unwrap();
    assert_eq!(load.kv_usage_ratio(), 1.0);
    assert_eq!(load.throughput_tps(), None);
}

#[tokio::test]
async fn reply_over_the_cap_is_refused() {
    let (addr, _) = serve(Reply::Loads(GetLoadsResponse {
        version: "x".repeat(4096),
        loads: vec![SchedulerLoad::default()],
        ..Default::default()
    }))
    .await;
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
    let registry = registry();
    assert_eq!(registry.names(), ["tokenspeed"]);
    let spec = BackendSpec::new("http://127.0.0.1:8000");
    assert!(matches!(
        registry.build("tokenspeed", &spec).err().unwrap(),
        BackendError::MissingLoadUrl { backend } if backend == "tokenspeed"
    ));
    for bad in ["http://127.0.0.1:19000", "grpc://127.0.0.1", "grpc://h:1/x"] {
        let spec = BackendSpec::new("http://127.0.0.1:8000").with_load_url(bad);
        assert!(
            matches!(
                registry.build("tokenspeed", &spec).err().unwrap(),
                BackendError::InvalidAddress { .. }
            ),
            "{bad}"
        );
    }
    let spec = BackendSpec {
        options: SourceOptions {
            api_key: Some("bad\nkey".into()),
            ..SourceOptions::default()
        },
        ..BackendSpec::new("http://127.0.0.1:8000").with_load_url("grpc://127.0.0.1:19000")
    };
    assert!(matches!(
        registry.build("tokenspeed", &spec).err().unwrap(),
        BackendError::Client { .. }
    ));
}

#[tokio::test]
async fn deadline_exceeded_completes_the_poll_without_a_snapshot() {
    use policy_core::{MockPolicy, PollMark, PollOutcome, WorkerId, poll_worker, tokio_now};

    let (addr, _) = serve(Reply::Fail(Code::DeadlineExceeded)).await;
    let source = build(addr, options());
    let mut policy = MockPolicy::new();
    policy
        .expect_poll_started()
        .times(1)
        .returning(|worker, sent_at| PollMark {
            worker,
            seq: 0,
            sent_at,
            pending_tokens: 0,
            pending_requests: 0,
            remote_pending_tokens: 0,
            remote_pending_requests: 0,
        });
    // "No report this time": the poll completes, with no load, and never fails.
    policy
        .expect_poll_completed()
        .withf(|_, load, _| load.is_none())
        .times(1)
        .return_const(());
    policy.expect_poll_failed().never();
    let outcome = poll_worker(
        &policy,
        source.as_ref(),
        WorkerId::new(0, 0),
        options().deadline,
        tokio_now,
    )
    .await;
    assert!(matches!(outcome, PollOutcome::NoReport), "{outcome:?}");
}

#[test]
fn the_api_key_stays_out_of_debug_output() {
    let options = SourceOptions {
        api_key: Some("sk-secret".into()),
        ..SourceOptions::default()
    };
    let source =
        backends_tokenspeed::TokenspeedGrpcLoadSource::new("grpc://127.0.0.1:19000", &options)
            .unwrap();
    let debug = format!("{source:?}");
    assert!(!debug.contains("sk-secret"), "{debug}");
}
