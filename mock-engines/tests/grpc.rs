//! The mock servers' gRPC side through real tonic clients: `GetLoads` and
//! `HealthCheck` in each flavour's package and numbering, and the load faults.

// Test helpers (not only #[test] fns) may unwrap: a panic is a failed assertion.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use backends_sglang::proto::sglang_scheduler_client::SglangSchedulerClient;
use backends_tokenspeed::proto::token_speed_scheduler_client::TokenSpeedSchedulerClient;
use backends_vllm::proto::vllm_engine_client::VllmEngineClient;
use mock_engines::{FaultMode, Flavour, SimEngineConfig, SimFleet};
use serde_json::json;

mod common;

use common::{DEADLINE, poll_until};

/// Starts one engine at real time (scale 1) and keeps it busy with four
/// prompts of 10 000 tokens (1.25 s of prefill each), so that queued work is
/// visible for seconds.
async fn busy_engine(flavour: Flavour) -> (SimFleet, String, Vec<tokio::task::JoinHandle<()>>) {
    let fleet = mock_engines::start(vec![SimEngineConfig::new(flavour)])
        .await
        .unwrap();
    let http = fleet.engines()[0].http_url();
    let grpc = fleet.engines()[0].grpc_http_url().unwrap();
    let client = reqwest::Client::new();
    let prompt = "x".repeat(40_000);
    let mut requests = Vec::new();
    for _ in 0..4 {
        let request = client
            .post(format!("{http}/v1/completions"))
            .json(&json!({"prompt": prompt, "max_tokens": 2}))
            .send();
        requests.push(tokio::spawn(async move {
            let _ = request.await;
        }));
    }
    (fleet, grpc, requests)
}

async fn finish(fleet: SimFleet, requests: Vec<tokio::task::JoinHandle<()>>) {
    fleet.shutdown().await;
    for request in requests {
        let _ = request.await;
    }
}

#[tokio::test]
async fn sglang_get_loads_reports_queued_tokens_and_throughput() {
    let (fleet, grpc, requests) = busy_engine(Flavour::Sglang).await;
    let mut client = SglangSchedulerClient::connect(grpc).await.unwrap();
    let health = client
        .health_check(backends_sglang::proto::HealthCheckRequest {})
        .await
        .unwrap();
    assert!(health.get_ref().healthy);
    let response = poll_until(
        || {
            let mut client = client.clone();
            async move {
                client
                    .get_loads(backends_sglang::proto::GetLoadsRequest::default())
                    .await
                    .unwrap()
                    .into_inner()
            }
        },
        |response| {
            let load = &response.loads[0];
            load.num_waiting_uncached_tokens > 20_000 && load.num_waiting_reqs >= 1
        },
    )
    .await;
    let load = &response.loads[0];
    assert_eq!(response.dp_rank_count, 1);
    assert_eq!(load.max_total_num_tokens, 524_288);
    assert_eq!(load.max_running_requests, 256);
    assert!(load.num_used_tokens > 0);
    assert!(load.token_usage > 0.0);
    assert!(response.aggregate.is_some());
    // Another DP rank than ours: no loads.
    let other = client
        .get_loads(backends_sglang::proto::GetLoadsRequest {
            dp_rank: Some(3),
            include: Vec::new(),
        })
        .await
        .unwrap();
    assert!(other.get_ref().loads.is_empty());
    finish(fleet, requests).await;
}

#[tokio::test]
async fn vllm_get_loads_fills_only_what_vllm_fills() {
    let (fleet, grpc, requests) = busy_engine(Flavour::Vllm).await;
    let mut client = VllmEngineClient::connect(grpc).await.unwrap();
    assert!(
        client
            .health_check(backends_vllm::proto::HealthCheckRequest {})
            .await
            .unwrap()
            .get_ref()
            .healthy
    );
    let response = poll_until(
        || {
            let mut client = client.clone();
            async move {
                client
                    .get_loads(backends_vllm::proto::GetLoadsRequest::default())
                    .await
                    .unwrap()
                    .into_inner()
            }
        },
        |response| {
            response.loads[0].num_waiting_reqs >= 1 && response.loads[0].num_running_reqs >= 1
        },
    )
    .await;
    let load = &response.loads[0];
    assert_eq!(
        load.num_total_reqs,
        load.num_running_reqs + load.num_waiting_reqs
    );
    assert!(load.token_usage > 0.0);
    assert_eq!(load.gen_throughput, 0.0);
    assert_eq!(load.max_total_num_tokens, 0);
    assert_eq!(load.num_used_tokens, 0);
    finish(fleet, requests).await;
}

#[tokio::test]
async fn tokenspeed_get_loads_has_no_queued_tokens_or_throughput() {
    let (fleet, grpc, requests) = busy_engine(Flavour::Tokenspeed).await;
    let mut client = TokenSpeedSchedulerClient::connect(grpc).await.unwrap();
    assert!(
        client
            .health_check(backends_tokenspeed::proto::HealthCheckRequest {})
            .await
            .unwrap()
            .get_ref()
            .healthy
    );
    let response = poll_until(
        || {
            let mut client = client.clone();
            async move {
                client
                    .get_loads(backends_tokenspeed::proto::GetLoadsRequest::default())
                    .await
                    .unwrap()
                    .into_inner()
            }
        },
        |response| response.loads[0].num_waiting_reqs >= 1,
    )
    .await;
    let load = &response.loads[0];
    assert_eq!(load.num_waiting_uncached_tokens, 0);
    assert_eq!(load.gen_throughput, 0.0);
    assert_eq!(load.max_total_num_tokens, 524_288);
    assert_eq!(load.max_running_requests, 256);
    assert!(load.num_used_tokens > 0);
    assert!(load.token_usage > 0.0);
    finish(fleet, requests).await;
}

#[tokio::test]
async fn grpc_load_faults_behave_as_named() {
    let fleet = mock_engines::start(vec![SimEngineConfig {
        slow_loads_delay: Duration::from_secs(3600),
        ..SimEngineConfig::new(Flavour::Sglang)
    }])
    .await
    .unwrap();
    let grpc = fleet.engines()[0].grpc_http_url().unwrap();
    let mut client = SglangSchedulerClient::connect(grpc.clone()).await.unwrap();
    let request = || backends_sglang::proto::GetLoadsRequest::default();

    fleet.set_fault(0, FaultMode::Loads500);
    let status = client.get_loads(request()).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Internal);

    fleet.set_fault(0, FaultMode::SlowLoads);
    let mut slow = tonic::Request::new(request());
    slow.set_timeout(Duration::from_millis(200));
    let status = client.get_loads(slow).await.unwrap_err();
    assert!(
        matches!(
            status.code(),
            tonic::Code::DeadlineExceeded | tonic::Code::Cancelled
        ),
        "{status:?}"
    );

    fleet.set_fault(0, FaultMode::NanLoads);
    let load = client
        .get_loads(request())
        .await
        .unwrap()
        .into_inner()
        .loads[0];
    assert!(load.token_usage.is_nan());

    fleet.set_fault(0, FaultMode::MalformedLoads);
    let load = client
        .get_loads(request())
        .await
        .unwrap()
        .into_inner()
        .loads[0];
    assert!(load.num_running_reqs < 0);

    fleet.set_fault(0, FaultMode::RefuseConnections);
    let status = client.get_loads(request()).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unavailable);
    let status = client
        .health_check(backends_sglang::proto::HealthCheckRequest {})
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unavailable);
    // A new connection is dropped.
    let fresh = async {
        let mut fresh = SglangSchedulerClient::connect(grpc.clone()).await?;
        fresh
            .get_loads(request())
            .await
            .map_err(|status| Box::new(status) as Box<dyn std::error::Error>)
    };
    assert!(fresh.await.is_err());

    fleet.set_fault(0, FaultMode::None);
    let load = client
        .get_loads(request())
        .await
        .unwrap()
        .into_inner()
        .loads[0];
    assert_eq!(load.num_running_reqs, 0);
    assert_eq!(load.token_usage, 0.0);
    tokio::time::timeout(DEADLINE, fleet.shutdown())
        .await
        .unwrap();
}
