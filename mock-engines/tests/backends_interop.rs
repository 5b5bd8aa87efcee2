//! The mock servers against the router's real load sources (the backends
//! crates, built by name through the `BackendRegistry`): every flavour's
//! report decodes, carries the signals its real engine reports, and every
//! load fault turns into a failed poll.

// Test helpers (not only #[test] fns) may unwrap: a panic is a failed assertion.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::Duration;

use load_protocols::WorkerLoad;
use mock_engines::{FaultMode, Flavour, SimEngineConfig, SimFleet};
use policy_core::{BackendRegistry, BackendSpec, LoadSource};
use serde_json::json;

mod common;

use common::poll_until;

fn registry() -> BackendRegistry {
    let mut registry = BackendRegistry::new();
    backends_sglang::register(&mut registry);
    backends_vllm::register(&mut registry);
    backends_tokenspeed::register(&mut registry);
    registry
}

/// One engine at real time, kept busy by four 10 000-token prompts.
async fn busy(flavour: Flavour) -> (SimFleet, Vec<tokio::task::JoinHandle<()>>) {
    let fleet = mock_engines::start(vec![SimEngineConfig {
        slow_loads_delay: Duration::from_secs(3600),
        ..SimEngineConfig::new(flavour)
    }])
    .await
    .unwrap();
    let http = fleet.engines()[0].http_url();
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
    (fleet, requests)
}

fn source(fleet: &SimFleet, backend: &str) -> Arc<dyn LoadSource> {
    let engine = fleet.engines()[0];
    let mut spec = BackendSpec::new(engine.http_url());
    if let Some(grpc) = engine.grpc_url()
        && (backend.ends_with("grpc") || backend == "tokenspeed")
    {
        spec = spec.with_load_url(grpc);
    }
    registry().build(backend, &spec).unwrap()
}

/// Polls until a report shows waiting requests.
async fn busy_report(source: &Arc<dyn LoadSource>) -> WorkerLoad {
    let busy = |fetched: &Result<Option<WorkerLoad>, _>| matches!(fetched, Ok(Some(load)) if load.waiting_requests() >= 1);
    poll_until(|| source.fetch(), busy).await.unwrap().unwrap()
}

async fn finish(fleet: SimFleet, requests: Vec<tokio::task::JoinHandle<()>>) {
    fleet.shutdown().await;
    for request in requests {
        let _ = request.await;
    }
}

#[tokio::test]
async fn each_flavour_decodes_with_its_real_signals() {
    // (flavour, backend, queued tokens reported?)
    let cases = [
        (Flavour::Sglang, "sglang", true),
        (Flavour::Sglang, "sglang-grpc", true),
        (Flavour::SglangMetrics, "sglang", false),
        (Flavour::Vllm, "vllm", false),
        (Flavour::Vllm, "vllm-grpc", false),
        (Flavour::Tokenspeed, "tokenspeed", false),
    ];
    for (flavour, backend, reports_queued) in cases {
        let (fleet, requests) = busy(flavour).await;
        let source = source(&fleet, backend);
        let load = busy_report(&source).await;
        assert!(
            load.running_requests() >= 1,
            "{flavour}/{backend}: {load:?}"
        );
        assert!(load.kv_usage_ratio() > 0.0, "{flavour}/{backend}: {load:?}");
        if reports_queued {
            assert!(
                load.queued_tokens().is_some_and(|tokens| tokens > 0),
                "{flavour}/{backend}: {load:?}"
            );
        } else {
            assert!(
                load.queued_tokens().is_none_or(|tokens| tokens == 0),
                "{flavour}/{backend}: {load:?}"
            );
        }
        finish(fleet, requests).await;
    }
}

#[tokio::test]
async fn every_load_fault_is_a_failed_poll() {
    for (flavour, backend) in [
        (Flavour::Sglang, "sglang"),
        (Flavour::Sglang, "sglang-grpc"),
        (Flavour::Vllm, "vllm"),
        (Flavour::Tokenspeed, "tokenspeed"),
    ] {
        let (fleet, requests) = busy(flavour).await;
        let source = source(&fleet, backend);
        busy_report(&source).await;
        for fault in [
            FaultMode::SlowLoads,
            FaultMode::MalformedLoads,
            FaultMode::NanLoads,
            FaultMode::Loads500,
            FaultMode::RefuseConnections,
        ] {
            fleet.set_fault(0, fault);
            let result = source.fetch().await;
            assert!(
                !matches!(result, Ok(Some(_))),
                "{flavour}/{backend} under {fault}: {result:?}"
            );
        }
        fleet.set_fault(0, FaultMode::None);
        busy_report(&source).await;
        finish(fleet, requests).await;
    }
}
