//! For gRPC backends' tests (feature `test-support`, a dev-dependency): a
//! scripted `GetLoads` server on loopback, and the checks every
//! [`GrpcLoadSource`] passes whatever its proto. A backend's test names its
//! generated server once ([`scripted_backend!`](crate::scripted_backend),
//! a [`ScriptedBackend`]) and runs [`check_source`]; only what its own proto
//! and conversion decide stays in its tests.

// Test support: a failed check panics, as a failed assertion does.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::error::Error as _;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use load_protocols::WorkerLoad;
use parking_lot::Mutex;
use policy_core::{
    BackendError, BackendRegistry, BackendSpec, LoadError, LoadSource, SourceOptions,
};
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};
use tonic::service::Routes;
use tonic::transport::server::TcpIncoming;
use tonic::{Code, Request, Response, Status};

use crate::grpc::{GetLoads, GrpcLoadSource};

/// The worker URL of the specs the checks build.
pub const WORKER_URL: &str = "http://127.0.0.1:8000";

/// What a scripted server answers `GetLoads` with.
#[derive(Debug, Clone)]
pub enum Script<T> {
    Reply(T),
    /// A status with this code and the message `scripted failure`.
    Fail(Code),
    /// No answer, ever.
    Hang,
}

/// What a scripted server saw of one call.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SeenCall {
    pub authorization: Option<String>,
    pub grpc_timeout: Option<String>,
    /// The request's `include` sections.
    pub include: Vec<String>,
}

/// The state of a scripted `GetLoads`: what it answers, and what it saw.
/// A backend's test server forwards its `get_loads` to [`answer`](Self::answer).
#[derive(Debug)]
pub struct ScriptedLoads<T> {
    script: Mutex<Script<T>>,
    seen: Mutex<Vec<SeenCall>>,
}

impl<T: Clone> ScriptedLoads<T> {
    pub fn new(script: Script<T>) -> ScriptedLoads<T> {
        ScriptedLoads {
            script: Mutex::new(script),
            seen: Mutex::new(Vec::new()),
        }
    }

    /// Every call so far, oldest first.
    pub fn seen(&self) -> Vec<SeenCall> {
        self.seen.lock().clone()
    }

    /// Records `request` (`include` reads its sections) and answers as
    /// scripted.
    pub async fn answer<M>(
        &self,
        request: Request<M>,
        include: impl FnOnce(M) -> Vec<String>,
    ) -> Result<Response<T>, Status> {
        let header = |name: &str| {
            request
                .metadata()
                .get(name)
                .and_then(|value| value.to_str().ok())
                .map(str::to_owned)
        };
        let authorization = header("authorization");
        let grpc_timeout = header("grpc-timeout");
        self.seen.lock().push(SeenCall {
            authorization,
            grpc_timeout,
            include: include(request.into_inner()),
        });
        let script = self.script.lock().clone();
        match script {
            Script::Reply(reply) => Ok(Response::new(reply)),
            Script::Fail(code) => Err(Status::new(code, "scripted failure")),
            Script::Hang => std::future::pending().await,
        }
    }
}

/// A gRPC backend under test: its `GetLoads`, its generated server, and a
/// reply of given ranks.
pub trait ScriptedBackend: 'static {
    type Loads: GetLoads<Reply: Clone + Sync>;
    /// One rank of a reply (the proto's `SchedulerLoad`).
    type Rank: Clone + Default;

    /// The generated server, its `get_loads` answered by `loads`.
    fn routes(loads: Arc<ScriptedLoads<<Self::Loads as GetLoads>::Reply>>) -> Routes;

    /// A reply of `ranks`, with the rank count set.
    fn reply(ranks: Vec<Self::Rank>) -> <Self::Loads as GetLoads>::Reply;
}

/// Defines `$backend`, a [`ScriptedBackend`] for the `GetLoads` type
/// `$loads`, served by the generated `$server` (the server trait
/// `$service`) answered by a [`ScriptedLoads`]. The messages are those of
/// the proto module `$proto`, shaped like SGLang's scheduler:
/// `GetLoadsRequest` with `include`, `GetLoadsResponse` of `loads`
/// (`SchedulerLoad`) and `dp_rank_count`, and `HealthCheckRequest` /
/// `HealthCheckResponse` with `healthy` and `message`.
///
/// ```text
/// use backends_sglang::SglangGetLoads;
/// use backends_sglang::proto::sglang_scheduler_server::{SglangScheduler, SglangSchedulerServer};
///
/// load_transport::scripted_backend!(
///     Sglang, SglangGetLoads, SglangScheduler, SglangSchedulerServer, backends_sglang::proto
/// );
/// ```
#[macro_export]
macro_rules! scripted_backend {
    ($backend:ident, $loads:ty, $service:ident, $server:ident, $($proto:ident)::+ $(,)?) => {
        struct $backend;

        const _: () = {
            use ::std::sync::Arc;
            use $crate::test_support::{ScriptedBackend, ScriptedLoads};
            use $($proto)::+::{
                GetLoadsRequest, GetLoadsResponse, HealthCheckRequest, HealthCheckResponse,
                SchedulerLoad,
            };

            struct Scripted(Arc<ScriptedLoads<GetLoadsResponse>>);

            #[::tonic::async_trait]
            impl $service for Scripted {
                async fn get_loads(
                    &self,
                    request: ::tonic::Request<GetLoadsRequest>,
                ) -> ::std::result::Result<::tonic::Response<GetLoadsResponse>, ::tonic::Status>
                {
                    self.0.answer(request, |message| message.include).await
                }

                async fn health_check(
                    &self,
                    _request: ::tonic::Request<HealthCheckRequest>,
                ) -> ::std::result::Result<::tonic::Response<HealthCheckResponse>, ::tonic::Status>
                {
                    Ok(::tonic::Response::new(HealthCheckResponse {
                        healthy: true,
                        message: String::new(),
                    }))
                }
            }

            impl ScriptedBackend for $backend {
                type Loads = $loads;
                type Rank = SchedulerLoad;

                fn routes(loads: Arc<ScriptedLoads<GetLoadsResponse>>) -> ::tonic::service::Routes {
                    ::tonic::service::Routes::new($server::new(Scripted(loads)))
                }

                fn reply(ranks: Vec<SchedulerLoad>) -> GetLoadsResponse {
                    GetLoadsResponse {
                        dp_rank_count: i32::try_from(ranks.len()).unwrap_or(i32::MAX),
                        loads: ranks,
                        ..Default::default()
                    }
                }
            }
        };
    };
}

type Reply<B> = <<B as ScriptedBackend>::Loads as GetLoads>::Reply;

/// Serves `routes` on 127.0.0.1:0 for as long as the test's runtime lives.
pub async fn serve_grpc(routes: Routes) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_routes(routes)
            .serve_with_incoming(TcpIncoming::from(listener)),
    );
    addr
}

/// `B`'s server on loopback, answering as `script` says.
pub async fn serve<B: ScriptedBackend>(
    script: Script<Reply<B>>,
) -> (SocketAddr, Arc<ScriptedLoads<Reply<B>>>) {
    let loads = Arc::new(ScriptedLoads::new(script));
    (serve_grpc(B::routes(loads.clone())).await, loads)
}

/// A registry with `B`'s gRPC backend only.
pub fn registry<B: ScriptedBackend>() -> BackendRegistry {
    let mut registry = BackendRegistry::new();
    GrpcLoadSource::<B::Loads>::register(&mut registry);
    registry
}

/// `B`'s source for the server at `addr`, built by name as the router
/// builds it.
pub fn build<B: ScriptedBackend>(addr: SocketAddr, options: SourceOptions) -> Arc<dyn LoadSource> {
    let spec = BackendSpec {
        options,
        ..BackendSpec::new(WORKER_URL).with_load_url(format!("grpc://{addr}"))
    };
    registry::<B>().build(B::Loads::KIND, &spec).unwrap()
}

/// One fetch from a fresh server answering as `script` says.
pub async fn fetch<B: ScriptedBackend>(
    script: Script<Reply<B>>,
) -> Result<Option<WorkerLoad>, LoadError> {
    let (addr, _) = serve::<B>(script).await;
    build::<B>(addr, options()).fetch().await
}

/// One fetch from a fresh server that replies `ranks`.
pub async fn fetch_ranks<B: ScriptedBackend>(
    ranks: Vec<B::Rank>,
) -> Result<Option<WorkerLoad>, LoadError> {
    fetch::<B>(Script::Reply(B::reply(ranks))).await
}

/// Options for tests that expect an answer: a deadline generous enough for a
/// loaded CI machine.
pub fn options() -> SourceOptions {
    SourceOptions {
        deadline: Duration::from_secs(10),
        ..SourceOptions::default()
    }
}

/// Options for tests that expect the deadline to pass: a short one, so that
/// they end quickly.
pub fn short_deadline() -> SourceOptions {
    SourceOptions {
        deadline: Duration::from_millis(200),
        ..SourceOptions::default()
    }
}

/// A TCP server on 127.0.0.1:0 that hands every connection to `handle`,
/// for as long as the test's runtime lives.
pub async fn serve_tcp<F, Fut>(handle: F) -> SocketAddr
where
    F: Fn(TcpStream) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(handle(stream));
        }
    });
    addr
}

/// A server that accepts connections, reads what is sent, and never answers.
pub async fn serve_silent() -> SocketAddr {
    serve_tcp(|mut stream| async move {
        let mut buffer = [0_u8; 4096];
        while let Ok(n) = stream.read(&mut buffer).await {
            if n == 0 {
                break;
            }
        }
    })
    .await
}

/// An address nothing listens on.
pub async fn refused_addr() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    addr
}

/// Every outcome [`GrpcLoadSource`] decides rather than the backend's
/// conversion: an empty reply is no report; `UNIMPLEMENTED` is unsupported;
/// a server's `UNAVAILABLE` or `INTERNAL` is a gRPC error with its status;
/// a server-sent `DEADLINE_EXCEEDED` is no report or a timeout as the
/// backend reads it; a server without the service is unsupported; a hung
/// server, and a TCP server that never speaks HTTP/2, are timeouts; a refused connection is a connect error; a reply
/// over the body cap is refused.
pub async fn check_outcomes<B: ScriptedBackend>() {
    let load = fetch::<B>(Script::Reply(B::reply(Vec::new()))).await;
    assert!(matches!(load, Ok(None)), "an empty reply: {load:?}");

    let err = fetch::<B>(Script::Fail(Code::Unimplemented))
        .await
        .unwrap_err();
    assert!(
        matches!(err, LoadError::Unsupported { what, .. } if what == B::Loads::WHAT),
        "{err:?}"
    );

    for code in [Code::Unavailable, Code::Internal] {
        let err = fetch::<B>(Script::Fail(code)).await.unwrap_err();
        let LoadError::Grpc { source, .. } = &err else {
            panic!("{code:?}: expected a gRPC error, got {err:?}");
        };
        let status = source.downcast_ref::<Status>().unwrap();
        assert_eq!(
            (status.code(), status.message()),
            (code, "scripted failure")
        );
    }

    let exceeded = fetch::<B>(Script::Fail(Code::DeadlineExceeded)).await;
    if B::Loads::DEADLINE_EXCEEDED_IS_NO_REPORT {
        assert!(matches!(exceeded, Ok(None)), "{exceeded:?}");
    } else {
        assert!(
            matches!(exceeded, Err(LoadError::Timeout { .. })),
            "{exceeded:?}"
        );
    }

    // A gRPC server without the backend's service answers UNIMPLEMENTED.
    let err = build::<B>(serve_grpc(Routes::default()).await, options())
        .fetch()
        .await
        .unwrap_err();
    assert!(matches!(err, LoadError::Unsupported { .. }), "{err:?}");

    let (addr, loads) = serve::<B>(Script::Hang).await;
    let err = build::<B>(addr, short_deadline())
        .fetch()
        .await
        .unwrap_err();
    assert!(
        matches!(&err, LoadError::Timeout { url, deadline }
            if *url == format!("grpc://{addr}") && *deadline == short_deadline().deadline),
        "{err:?}"
    );
    assert_eq!(loads.seen().len(), 1, "the call reached the server");
    let err = build::<B>(serve_silent().await, short_deadline())
        .fetch()
        .await
        .unwrap_err();
    assert!(matches!(err, LoadError::Timeout { .. }), "{err:?}");

    let err = build::<B>(refused_addr().await, options())
        .fetch()
        .await
        .unwrap_err();
    let LoadError::Connect { source, .. } = &err else {
        panic!("expected a connect error, got {err:?}");
    };
    assert_eq!(
        source.downcast_ref::<Status>().map(Status::code),
        Some(Code::Unavailable)
    );
    assert!(err.source().is_some());

    // 64 empty ranks take 128 bytes.
    let (addr, _) = serve::<B>(Script::Reply(B::reply(vec![B::Rank::default(); 64]))).await;
    let capped = SourceOptions {
        body_limit_bytes: 100,
        ..options()
    };
    let err = build::<B>(addr, capped).fetch().await.unwrap_err();
    assert!(
        matches!(err, LoadError::BodyTooLarge { limit_bytes, .. } if limit_bytes == 100),
        "{err:?}"
    );
}

/// [`check_factory`] (on a thread outside any runtime), [`check_outcomes`]
/// and [`check_request`]: everything a `B` source does that is not its
/// conversion.
pub async fn check_source<B: ScriptedBackend>() {
    std::thread::spawn(check_factory::<B>).join().unwrap();
    check_outcomes::<B>().await;
    check_request::<B>().await;
}

/// What each poll sends: `include = ["core"]`, the key as
/// `authorization: Bearer …`, the deadline as `grpc-timeout` where the
/// backend sends it; and one channel serves every poll.
pub async fn check_request<B: ScriptedBackend>() {
    let (addr, loads) = serve::<B>(Script::Reply(B::reply(Vec::new()))).await;
    let options = SourceOptions {
        api_key: Some("sk-grpc".into()),
        ..options()
    };
    let source = build::<B>(addr, options);
    assert_eq!(source.kind(), B::Loads::KIND);
    assert_eq!(source.load_url(), format!("grpc://{addr}"));
    for _ in 0..2 {
        source.fetch().await.unwrap();
    }
    let seen = loads.seen();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[0].authorization.as_deref(), Some("Bearer sk-grpc"));
    assert_eq!(seen[0].include, ["core"]);
    assert_eq!(seen[0].grpc_timeout.is_some(), B::Loads::SENDS_DEADLINE);
}

/// The factory, run outside any runtime (the channel is only made on the
/// first poll): the load address is required and must be
/// `grpc://host:port`, an API key that cannot be metadata is a client
/// error, and the key stays out of the source's Debug output.
pub fn check_factory<B: ScriptedBackend>() {
    let registry = registry::<B>();
    let kind = B::Loads::KIND;
    let missing = registry.build(kind, &BackendSpec::new(WORKER_URL)).err();
    assert!(
        matches!(&missing, Some(BackendError::MissingLoadUrl { backend }) if backend == kind),
        "{missing:?}"
    );
    for bad in [
        "http://127.0.0.1:19000",
        "grpc://127.0.0.1",
        "127.0.0.1:19000",
        "grpc://h:1/x",
    ] {
        let spec = BackendSpec::new(WORKER_URL).with_load_url(bad);
        let err = registry.build(kind, &spec).err();
        assert!(
            matches!(err, Some(BackendError::InvalidAddress { .. })),
            "{bad}: {err:?}"
        );
    }
    let spec = BackendSpec::new(WORKER_URL).with_load_url("grpc://127.0.0.1:19000");
    assert!(registry.build(kind, &spec).is_ok());
    let with_key = |key: &str| BackendSpec {
        options: SourceOptions {
            api_key: Some(key.into()),
            ..SourceOptions::default()
        },
        ..spec.clone()
    };
    let err = registry.build(kind, &with_key("bad\nkey")).err();
    assert!(matches!(err, Some(BackendError::Client { .. })), "{err:?}");
    let source = GrpcLoadSource::<B::Loads>::from_spec(&with_key("sk-secret")).unwrap();
    let debug = format!("{source:?}");
    assert!(!debug.contains("sk-secret"), "{debug}");
}
