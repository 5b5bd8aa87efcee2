//! `VllmGrpcLoadSource` against real loopback tonic servers built from the
//! generated server trait (the same one the engine simulator serves).

// Helpers outside `#[test]` fns panic too: in a test, a panic is a failed assertion.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use backends_vllm::proto::vllm_engine_server::{VllmEngine, VllmEngineServer};
use backends_vllm::proto::{
    GetLoadsRequest, GetLoadsResponse, HealthCheckRequest, HealthCheckResponse, SchedulerLoad,
};
use backends_vllm::register;
use load_protocols::LoadValidationError;
use parking_lot::Mutex;
use policy_core::{BackendRegistry, BackendSpec, LoadError, LoadSource, SourceOptions};
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::{Code, Request, Response, Status};

#[derive(Debug, Clone)]
enum Behavior {
    Respond(GetLoadsResponse),
    Fail(Code),
    Hang,
}

#[derive(Debug, Clone, Default)]
struct Seen {
    authorization: Option<String>,
    grpc_timeout: Option<String>,
    include: Vec<String>,
}

#[derive(Debug)]
struct Engine {
    behavior: Behavior,
    seen: Arc<Mutex<Vec<Seen>>>,
}

#[tonic::async_trait]
impl VllmEngine for Engine {
    async fn get_loads(
        &self,
        request: Request<GetLoadsRequest>,
    ) -> Result<Response<GetLoadsResponse>, Status> {
        let header = |name: &str| {
            request
                .metadata()
                .get(name)
                .and_then(|value| value.to_str().ok())
                .map(str::to_owned)
        };
        self.seen.lock().push(Seen {
            authorization: header("authorization"),
            grpc_timeout: header("grpc-timeout"),
            include: request.get_ref().include.clone(),
        });
        match &self.behavior {
            Behavior::Respond(response) => Ok(Response::new(response.clone())),
            Behavior::Fail(code) => Err(Status::new(*code, "scripted failure")),
            Behavior::Hang => std::future::pending().await,
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

async fn serve(behavior: Behavior) -> (SocketAddr, Arc<Mutex<Vec<Seen>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let engine = Engine {
        behavior,
        seen: seen.clone(),
    };
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(VllmEngineServer::new(engine))
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    (addr, seen)
}

fn source_with(addr: SocketAddr, options: SourceOptions) -> Arc<dyn LoadSource> {
    let mut registry = BackendRegistry::new();
    register(&mut registry);
    let spec = BackendSpec {
        options,
        ..BackendSpec::new("http://127.0.0.1:8000").with_load_url(format!("grpc://{addr}"))
    };
    registry.build("vllm-grpc", &spec).unwrap()
}

fn source(addr: SocketAddr) -> Arc<dyn LoadSource> {
    source_with(
        addr,
        SourceOptions {
            deadline: Duration::from_secs(2),
            ..SourceOptions::default()
        },
    )
}

fn rank(dp_rank: i32, running: i32, waiting: i32, usage: f64) -> SchedulerLoad {
    SchedulerLoad {
        dp_rank,
        num_running_reqs: running,
        num_waiting_reqs: waiting,
        num_total_reqs: running + waiting,
        token_usage: usage,
        ..SchedulerLoad::default()
    }
}

fn respond(loads: Vec<SchedulerLoad>) -> Behavior {
    Behavior::Respond(GetLoadsResponse {
        timestamp: "2026-12-01T00:00:00Z".into(),
        version: "0.11.0".into(),
        dp_rank_count: i32::try_from(loads.len()).unwrap(),
        loads,
    })
}

fn status_of(err: &LoadError) -> Code {
    match err {
        LoadError::Grpc { source, .. } | LoadError::Connect { source, .. } => {
            source.downcast_ref::<Status>().unwrap().code()
        }
        other => panic!("no status in {other:?}"),
    }
}

#[tokio::test]
async fn get_loads_is_polled_with_deadline_and_api_key() {
    let (addr, seen) = serve(respond(vec![rank(0, 12, 3, 0.35), rank(1, 9, 1, 0.25)])).await;
    let source = source_with(
        addr,
        SourceOptions {
            deadline: Duration::from_secs(2),
            api_key: Some("s3cret".into()),
            ..SourceOptions::default()
        },
    );
    assert_eq!(source.kind(), "vllm-grpc");
    assert_eq!(source.load_url(), format!("grpc://{addr}"));
    let load = source.fetch().await.unwrap().unwrap();
    assert_eq!(load.running_requests(), 21);
    assert_eq!(load.waiting_requests(), 4);
    assert!((load.kv_usage_ratio() - 0.3).abs() < 1e-12);
    assert_eq!(load.throughput_tps(), None);
    assert_eq!(load.queued_tokens(), None);
    // A second poll reuses the channel.
    assert!(source.fetch().await.unwrap().is_some());

    let seen = seen.lock().clone();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[0].authorization.as_deref(), Some("Bearer s3cret"));
    assert!(seen[0].grpc_timeout.is_some());
    assert_eq!(seen[0].include, ["core"]);
}

#[tokio::test]
async fn empty_loads_is_no_report() {
    let (addr, _) = serve(respond(Vec::new())).await;
    assert!(source(addr).fetch().await.unwrap().is_none());
}

#[tokio::test]
async fn hostile_values_are_invalid_or_clamped() {
    let invalid = |err: LoadError| match err {
        LoadError::Invalid { source, .. } => source,
        other => panic!("{other:?}"),
    };
    let (addr, _) = serve(respond(vec![rank(0, 1, 1, f64::NAN)])).await;
    assert!(matches!(
        invalid(source(addr).fetch().await.unwrap_err()),
        LoadValidationError::NonFinite {
            field: "token_usage",
            ..
        }
    ));
    let (addr, _) = serve(respond(vec![rank(0, 1, 1, f64::INFINITY)])).await;
    assert!(matches!(
        invalid(source(addr).fetch().await.unwrap_err()),
        LoadValidationError::NonFinite {
            field: "token_usage",
            ..
        }
    ));
    let (addr, _) = serve(respond(vec![rank(3, -1, 1, 0.5)])).await;
    assert_eq!(
        invalid(source(addr).fetch().await.unwrap_err()),
        LoadValidationError::NegativeCount {
            dp_rank: 3,
            field: "num_running_reqs",
            value: -1
        }
    );
    let (addr, _) = serve(respond(vec![rank(0, 1, 1, 2.0)])).await;
    let load = source(addr).fetch().await.unwrap().unwrap();
    assert_eq!(load.kv_usage_ratio(), 1.0);
}

#[tokio::test]
async fn unimplemented_is_unsupported() {
    let (addr, _) = serve(Behavior::Fail(Code::Unimplemented)).await;
    let err = source(addr).fetch().await.unwrap_err();
    assert!(
        matches!(
            err,
            LoadError::Unsupported {
                what: "vllm.grpc.engine.VllmEngine/GetLoads",
                ..
            }
        ),
        "{err:?}"
    );
}

#[tokio::test]
async fn a_server_without_the_service_is_unsupported() {
    // A gRPC server that serves only the health service of another package.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_routes(tonic::service::Routes::default())
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    let err = source(addr).fetch().await.unwrap_err();
    assert!(matches!(err, LoadError::Unsupported { .. }), "{err:?}");
}

#[tokio::test]
async fn server_sent_unavailable_is_a_grpc_error_with_its_status() {
    let (addr, _) = serve(Behavior::Fail(Code::Unavailable)).await;
    let err = source(addr).fetch().await.unwrap_err();
    assert!(matches!(err, LoadError::Grpc { .. }), "{err:?}");
    assert_eq!(status_of(&err), Code::Unavailable);
}

#[tokio::test]
async fn other_statuses_are_grpc_errors() {
    let (addr, _) = serve(Behavior::Fail(Code::Internal)).await;
    let err = source(addr).fetch().await.unwrap_err();
    assert_eq!(status_of(&err), Code::Internal);
}

#[tokio::test]
async fn deadline_exceeded_is_a_timeout() {
    let (addr, _) = serve(Behavior::Fail(Code::DeadlineExceeded)).await;
    let err = source(addr).fetch().await.unwrap_err();
    assert!(
        matches!(err, LoadError::Timeout { deadline, .. } if deadline == Duration::from_secs(2)),
        "{err:?}"
    );
}

#[tokio::test]
async fn a_server_that_never_answers_times_out() {
    let (addr, seen) = serve(Behavior::Hang).await;
    let err = source_with(
        addr,
        SourceOptions {
            deadline: Duration::from_millis(200),
            ..SourceOptions::default()
        },
    )
    .fetch()
    .await
    .unwrap_err();
    match err {
        LoadError::Timeout { url, deadline } => {
            assert_eq!(url, format!("grpc://{addr}"));
            assert_eq!(deadline, Duration::from_millis(200));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(seen.lock().len(), 1);
}

#[tokio::test]
async fn a_socket_that_accepts_and_never_speaks_times_out() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    let err = source_with(
        addr,
        SourceOptions {
            deadline: Duration::from_millis(200),
            ..SourceOptions::default()
        },
    )
    .fetch()
    .await
    .unwrap_err();
    assert!(matches!(err, LoadError::Timeout { .. }), "{err:?}");
}

#[tokio::test]
async fn connection_refused_is_a_connect_error() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let err = source(addr).fetch().await.unwrap_err();
    assert!(matches!(err, LoadError::Connect { .. }), "{err:?}");
    assert_eq!(status_of(&err), Code::Unavailable);
}

#[tokio::test]
async fn a_response_over_the_cap_is_too_large() {
    let ranks = (0..64).map(|dp| rank(dp, 1, 1, 0.5)).collect();
    let (addr, _) = serve(respond(ranks)).await;
    let err = source_with(
        addr,
        SourceOptions {
            deadline: Duration::from_secs(2),
            body_limit_bytes: 256,
            ..SourceOptions::default()
        },
    )
    .fetch()
    .await
    .unwrap_err();
    assert!(
        matches!(
            err,
            LoadError::BodyTooLarge {
                limit_bytes: 256,
                ..
            }
        ),
        "{err:?}"
    );
    // The default cap (1 MiB) takes it.
    let load = source(addr).fetch().await.unwrap().unwrap();
    assert_eq!(load.ranks().len(), 64);
}
