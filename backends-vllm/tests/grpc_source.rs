//! `VllmGrpcLoadSource` against real loopback tonic servers built from the
//! generated server trait (the same one the engine simulator serves): the
//! checks every gRPC load source passes (`load_transport::test_support`),
//! and what vLLM's own proto and conversion decide.

// Helpers outside `#[test]` fns panic too: in a test, a panic is a failed assertion.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::sync::Arc;

use backends_vllm::VllmGetLoads;
use backends_vllm::proto::vllm_engine_server::{VllmEngine, VllmEngineServer};
use backends_vllm::proto::{
    GetLoadsRequest, GetLoadsResponse, HealthCheckRequest, HealthCheckResponse, SchedulerLoad,
};
use load_protocols::LoadValidationError;
use load_transport::test_support::{
    self, Script, ScriptedBackend, ScriptedLoads, build, options, serve,
};
use policy_core::LoadError;
use tonic::service::Routes;
use tonic::{Request, Response, Status};

struct Engine(Arc<ScriptedLoads<GetLoadsResponse>>);

#[tonic::async_trait]
impl VllmEngine for Engine {
    async fn get_loads(
        &self,
        request: Request<GetLoadsRequest>,
    ) -> Result<Response<GetLoadsResponse>, Status> {
        self.0.answer(request, |message| message.include).await
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

struct Vllm;

impl ScriptedBackend for Vllm {
    type Loads = VllmGetLoads;

    fn routes(loads: Arc<ScriptedLoads<GetLoadsResponse>>) -> Routes {
        Routes::new(VllmEngineServer::new(Engine(loads)))
    }

    fn oversized() -> GetLoadsResponse {
        respond((0..64).map(|dp| rank(dp, 1, 1, 0.5)).collect())
    }
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

fn respond(loads: Vec<SchedulerLoad>) -> GetLoadsResponse {
    GetLoadsResponse {
        timestamp: "2026-12-01T00:00:00Z".into(),
        version: "0.11.0".into(),
        dp_rank_count: i32::try_from(loads.len()).unwrap(),
        loads,
    }
}

async fn serve_ranks(loads: Vec<SchedulerLoad>) -> SocketAddr {
    serve::<Vllm>(Script::Reply(respond(loads))).await.0
}

#[tokio::test]
async fn every_grpc_source_outcome() {
    // Unsupported names the full RPC; DEADLINE_EXCEEDED from the server is a
    // timed-out poll.
    test_support::check_outcomes::<Vllm>().await;
}

#[tokio::test]
async fn polls_send_core_the_bearer_key_and_the_deadline() {
    test_support::check_request::<Vllm>().await;
}

#[test]
fn factory_needs_a_grpc_load_address() {
    test_support::check_factory::<Vllm>();
}

#[tokio::test]
async fn a_two_rank_report() {
    let addr = serve_ranks(vec![rank(0, 12, 3, 0.35), rank(1, 9, 1, 0.25)]).await;
    let load = build::<Vllm>(addr, options())
        .fetch()
        .await
        .unwrap()
        .unwrap();
    assert_eq!(load.running_requests(), 21);
    assert_eq!(load.waiting_requests(), 4);
    assert!((load.kv_usage_ratio() - 0.3).abs() < 1e-12);
    assert_eq!(load.throughput_tps(), None);
    assert_eq!(load.queued_tokens(), None);
}

#[tokio::test]
async fn hostile_values_are_invalid_or_clamped() {
    let invalid = |err: LoadError| match err {
        LoadError::Invalid { source, .. } => source,
        other => panic!("{other:?}"),
    };
    let addr = serve_ranks(vec![rank(0, 1, 1, f64::NAN)]).await;
    assert!(matches!(
        invalid(build::<Vllm>(addr, options()).fetch().await.unwrap_err()),
        LoadValidationError::NonFinite {
            field: "token_usage",
            ..
        }
    ));
    let addr = serve_ranks(vec![rank(0, 1, 1, f64::INFINITY)]).await;
    assert!(matches!(
        invalid(build::<Vllm>(addr, options()).fetch().await.unwrap_err()),
        LoadValidationError::NonFinite {
            field: "token_usage",
            ..
        }
    ));
    let addr = serve_ranks(vec![rank(3, -1, 1, 0.5)]).await;
    assert_eq!(
        invalid(build::<Vllm>(addr, options()).fetch().await.unwrap_err()),
        LoadValidationError::NegativeCount {
            dp_rank: 3,
            field: "num_running_reqs",
            value: -1
        }
    );
    let addr = serve_ranks(vec![rank(0, 1, 1, 2.0)]).await;
    let load = build::<Vllm>(addr, options())
        .fetch()
        .await
        .unwrap()
        .unwrap();
    assert_eq!(load.kv_usage_ratio(), 1.0);
}

#[tokio::test]
async fn the_default_cap_takes_64_ranks() {
    // Over the 1 KiB cap of the outcome checks; the default cap (1 MiB) takes it.
    let addr = serve::<Vllm>(Script::Reply(Vllm::oversized())).await.0;
    let load = build::<Vllm>(addr, options())
        .fetch()
        .await
        .unwrap()
        .unwrap();
    assert_eq!(load.ranks().len(), 64);
}
