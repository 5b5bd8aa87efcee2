//! The gRPC side of a mock engine: `GetLoads` and `HealthCheck` in the
//! flavour's own package and field numbering (the backends crates own the
//! `.proto` files; this module implements their generated server traits).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use backends_sglang::proto as sglang;
use backends_tokenspeed::proto as tokenspeed;
use backends_vllm::proto as vllm;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::transport::server::{Connected, TcpConnectInfo};
use tonic::{Request, Response, Status};

use super::{EngineShared, FaultMode, Flavour, Stop};
use engine_model::EngineSnapshot;
use engine_model::reports::{self, clamp_i32};

/// Serves the flavour's gRPC service until the engine stops. Under
/// [`FaultMode::RefuseConnections`] new connections are dropped at once and
/// calls on open ones fail with `UNAVAILABLE`. A kill breaks every open
/// connection (see [`KillableIo`]).
pub(super) async fn serve(listener: TcpListener, shared: Arc<EngineShared>) {
    let refuse_shared = shared.clone();
    let stop = shared.stop.clone();
    let incoming = TcpListenerStream::new(listener)
        .filter(move |connection| {
            let refusing = refuse_shared.fault() == FaultMode::RefuseConnections;
            // Dropping the accepted stream closes it.
            !(refusing && connection.is_ok())
        })
        .map(move |connection| connection.map(|stream| KillableIo::new(stream, stop.clone())));
    let service = GrpcEngine {
        shared: shared.clone(),
    };
    let mut builder = tonic::transport::Server::builder();
    let router = match shared.config.flavour {
        Flavour::Sglang => builder.add_service(
            sglang::sglang_scheduler_server::SglangSchedulerServer::new(service),
        ),
        Flavour::Vllm => {
            builder.add_service(vllm::vllm_engine_server::VllmEngineServer::new(service))
        }
        Flavour::Tokenspeed => builder.add_service(
            tokenspeed::token_speed_scheduler_server::TokenSpeedSchedulerServer::new(service),
        ),
        // Validation keeps gRPC away from this flavour; serve nothing.
        Flavour::SglangMetrics => return,
    };
    let stop = shared.clone();
    let served = router
        .serve_with_incoming_shutdown(incoming, async move { stop.stopped().await })
        .await;
    if let Err(error) = served {
        tracing::warn!(engine = shared.index, %error, "grpc server stopped with an error");
    }
}

#[derive(Debug, Clone)]
struct GrpcEngine {
    shared: Arc<EngineShared>,
}

impl GrpcEngine {
    /// Applies the load faults, then reads the true state.
    async fn loads(&self) -> Result<(FaultMode, EngineSnapshot), Status> {
        let fault = self.shared.fault();
        match fault {
            FaultMode::RefuseConnections => {
                return Err(Status::unavailable("refusing connections (fault mode)"));
            }
            FaultMode::Loads500 => {
                return Err(Status::internal("internal error (fault mode loads-500)"));
            }
            FaultMode::SlowLoads => {
                tokio::select! {
                    () = tokio::time::sleep(self.shared.config.slow_loads_delay) => {}
                    () = self.shared.stopped() => {
                        return Err(Status::unavailable("shutting down"));
                    }
                }
            }
            _ => {}
        }
        Ok((fault, self.shared.snapshot()))
    }

    fn health(&self) -> Result<(bool, String), Status> {
        if self.shared.fault() == FaultMode::RefuseConnections {
            return Err(Status::unavailable("refusing connections (fault mode)"));
        }
        Ok((true, "ok".to_owned()))
    }
}

/// The ranks a request for `dp_rank` gets: our single rank 0, or none.
fn requested_ranks<T>(dp_rank: Option<i32>, load: T) -> Vec<T> {
    if dp_rank.is_none_or(|rank| rank == 0) {
        vec![load]
    } else {
        Vec::new()
    }
}

/// Malformed loads over gRPC: the bytes decode, the values are impossible.
const MALFORMED_COUNT: i32 = -7;

#[tonic::async_trait]
impl sglang::sglang_scheduler_server::SglangScheduler for GrpcEngine {
    async fn get_loads(
        &self,
        request: Request<sglang::GetLoadsRequest>,
    ) -> Result<Response<sglang::GetLoadsResponse>, Status> {
        let (fault, snapshot) = self.loads().await?;
        let rank = reports::sglang_rank(&snapshot);
        let clamp = |value: i64| clamp_i32(u64::try_from(value).unwrap_or(0));
        let mut load = sglang::SchedulerLoad {
            dp_rank: 0,
            num_running_reqs: clamp(rank.num_running_reqs),
            num_waiting_reqs: clamp(rank.num_waiting_reqs),
            num_total_reqs: clamp(rank.num_total_reqs),
            num_used_tokens: clamp(rank.num_used_tokens),
            max_total_num_tokens: clamp(rank.max_total_num_tokens),
            token_usage: rank.token_usage,
            gen_throughput: rank.gen_throughput.unwrap_or(0.0),
            cache_hit_rate: rank.cache_hit_rate,
            utilization: rank.utilization,
            max_running_requests: clamp(rank.max_running_requests),
            num_waiting_uncached_tokens: clamp(rank.num_waiting_uncached_tokens.unwrap_or(0)),
        };
        match fault {
            FaultMode::MalformedLoads => {
                load.num_running_reqs = MALFORMED_COUNT;
                load.num_waiting_uncached_tokens = MALFORMED_COUNT;
            }
            FaultMode::NanLoads => {
                load.token_usage = f64::NAN;
                load.gen_throughput = f64::NAN;
            }
            _ => {}
        }
        let aggregate = sglang::AggregateMetrics {
            total_running_reqs: load.num_running_reqs,
            total_waiting_reqs: load.num_waiting_reqs,
            total_reqs: load.num_total_reqs,
            avg_token_usage: load.token_usage,
            avg_throughput: load.gen_throughput,
            avg_utilization: load.utilization,
        };
        let loads = requested_ranks(request.get_ref().dp_rank, load);
        Ok(Response::new(sglang::GetLoadsResponse {
            timestamp: reports::rfc3339_now(),
            version: reports::SIM_VERSION.to_owned(),
            dp_rank_count: 1,
            loads,
            aggregate: Some(aggregate),
        }))
    }

    async fn health_check(
        &self,
        _request: Request<sglang::HealthCheckRequest>,
    ) -> Result<Response<sglang::HealthCheckResponse>, Status> {
        let (healthy, message) = self.health()?;
        Ok(Response::new(sglang::HealthCheckResponse {
            healthy,
            message,
        }))
    }
}

#[tonic::async_trait]
impl vllm::vllm_engine_server::VllmEngine for GrpcEngine {
    async fn get_loads(
        &self,
        request: Request<vllm::GetLoadsRequest>,
    ) -> Result<Response<vllm::GetLoadsResponse>, Status> {
        let (fault, snapshot) = self.loads().await?;
        let fields = reports::vllm_load(&snapshot);
        // vLLM fills running, waiting, total and token usage; throughput
        // and capacity stay 0.
        let mut load = vllm::SchedulerLoad {
            dp_rank: 0,
            num_running_reqs: fields.num_running_reqs,
            num_waiting_reqs: fields.num_waiting_reqs,
            num_total_reqs: fields.num_total_reqs,
            token_usage: fields.token_usage,
            ..vllm::SchedulerLoad::default()
        };
        match fault {
            FaultMode::MalformedLoads => load.num_waiting_reqs = MALFORMED_COUNT,
            FaultMode::NanLoads => load.token_usage = f64::NAN,
            _ => {}
        }
        let loads = requested_ranks(request.get_ref().dp_rank, load);
        Ok(Response::new(vllm::GetLoadsResponse {
            timestamp: reports::rfc3339_now(),
            version: reports::SIM_VERSION.to_owned(),
            dp_rank_count: 1,
            loads,
        }))
    }

    async fn health_check(
        &self,
        _request: Request<vllm::HealthCheckRequest>,
    ) -> Result<Response<vllm::HealthCheckResponse>, Status> {
        let (healthy, message) = self.health()?;
        Ok(Response::new(vllm::HealthCheckResponse {
            healthy,
            message,
        }))
    }
}

#[tonic::async_trait]
impl tokenspeed::token_speed_scheduler_server::TokenSpeedScheduler for GrpcEngine {
    async fn get_loads(
        &self,
        request: Request<tokenspeed::GetLoadsRequest>,
    ) -> Result<Response<tokenspeed::GetLoadsResponse>, Status> {
        let (fault, snapshot) = self.loads().await?;
        let fields = reports::tokenspeed_load(&snapshot);
        // Released TokenSpeed servers send no queued tokens and no throughput.
        let mut load = tokenspeed::SchedulerLoad {
            dp_rank: 0,
            num_running_reqs: fields.num_running_reqs,
            num_waiting_reqs: fields.num_waiting_reqs,
            num_total_reqs: fields.num_total_reqs,
            num_used_tokens: fields.num_used_tokens,
            max_total_num_tokens: fields.max_total_num_tokens,
            max_running_requests: fields.max_running_requests,
            token_usage: fields.token_usage,
            ..tokenspeed::SchedulerLoad::default()
        };
        match fault {
            FaultMode::MalformedLoads => load.num_used_tokens = MALFORMED_COUNT,
            FaultMode::NanLoads => load.token_usage = f64::NAN,
            _ => {}
        }
        let loads = requested_ranks(request.get_ref().dp_rank, load);
        Ok(Response::new(tokenspeed::GetLoadsResponse {
            timestamp: reports::rfc3339_now(),
            version: reports::SIM_VERSION.to_owned(),
            dp_rank_count: 1,
            loads,
            aggregate: Some(tokenspeed::AggregateMetrics {}),
        }))
    }

    async fn health_check(
        &self,
        _request: Request<tokenspeed::HealthCheckRequest>,
    ) -> Result<Response<tokenspeed::HealthCheckResponse>, Status> {
        let (healthy, message) = self.health()?;
        Ok(Response::new(tokenspeed::HealthCheckResponse {
            healthy,
            message,
        }))
    }
}

/// A gRPC connection that fails every read and write once its engine is
/// killed. tonic runs connections in tasks of its own that a kill cannot
/// reach, and its shutdown is graceful; failing the I/O ends them at once
/// (hyper then drops the socket).
struct KillableIo {
    stream: TcpStream,
    kill: Pin<Box<dyn Future<Output = ()> + Send>>,
    killed: bool,
}

impl KillableIo {
    fn new(stream: TcpStream, mut stop: watch::Receiver<Stop>) -> KillableIo {
        let kill = Box::pin(async move {
            // A dropped sender (the fleet is gone) kills too.
            let _ = stop.wait_for(|stop| *stop == Stop::Kill).await;
        });
        KillableIo {
            stream,
            kill,
            killed: false,
        }
    }

    /// Whether the engine is killed; otherwise registers the task to be woken
    /// when it is.
    fn poll_killed(&mut self, cx: &mut Context<'_>) -> bool {
        if !self.killed && self.kill.as_mut().poll(cx).is_ready() {
            self.killed = true;
        }
        self.killed
    }
}

fn killed_error() -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionAborted, "engine killed")
}

impl AsyncRead for KillableIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.poll_killed(cx) {
            return Poll::Ready(Err(killed_error()));
        }
        Pin::new(&mut this.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for KillableIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.poll_killed(cx) {
            return Poll::Ready(Err(killed_error()));
        }
        Pin::new(&mut this.stream).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.poll_killed(cx) {
            return Poll::Ready(Err(killed_error()));
        }
        Pin::new(&mut this.stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.poll_killed(cx) {
            return Poll::Ready(Err(killed_error()));
        }
        Pin::new(&mut this.stream).poll_shutdown(cx)
    }
}

impl Connected for KillableIo {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.stream.connect_info()
    }
}
