//! `VllmGrpcLoadSource` against real loopback tonic servers built from the
//! generated server trait (the same one the engine simulator serves): the
//! checks every gRPC load source passes (`load_transport::test_support`),
//! and what vLLM's own proto and conversion decide.

// Helpers outside `#[test]` fns panic too: in a test, a panic is a failed assertion.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use backends_vllm::VllmGetLoads;
use backends_vllm::proto::SchedulerLoad;
use backends_vllm::proto::vllm_engine_server::{VllmEngine, VllmEngineServer};
use load_protocols::LoadValidationError;
use load_transport::test_support::{self, fetch_ranks};
use policy_core::LoadError;

load_transport::scripted_backend!(
    Vllm,
    VllmGetLoads,
    VllmEngine,
    VllmEngineServer,
    backends_vllm::proto
);

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

#[tokio::test]
async fn what_every_grpc_source_does() {
    // Unsupported names the full RPC; DEADLINE_EXCEEDED from the server is a
    // timed-out poll.
    test_support::check_source::<Vllm>().await;
}

#[tokio::test]
async fn a_two_rank_report() {
    let load = fetch_ranks::<Vllm>(vec![rank(0, 12, 3, 0.35), rank(1, 9, 1, 0.25)])
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
    assert!(matches!(
        invalid(
            fetch_ranks::<Vllm>(vec![rank(0, 1, 1, f64::NAN)])
                .await
                .unwrap_err()
        ),
        LoadValidationError::NonFinite {
            field: "token_usage",
            ..
        }
    ));
    assert!(matches!(
        invalid(
            fetch_ranks::<Vllm>(vec![rank(0, 1, 1, f64::INFINITY)])
                .await
                .unwrap_err()
        ),
        LoadValidationError::NonFinite {
            field: "token_usage",
            ..
        }
    ));
    assert_eq!(
        invalid(
            fetch_ranks::<Vllm>(vec![rank(3, -1, 1, 0.5)])
                .await
                .unwrap_err()
        ),
        LoadValidationError::NegativeCount {
            dp_rank: 3,
            field: "num_running_reqs",
            value: -1
        }
    );
    let load = fetch_ranks::<Vllm>(vec![rank(0, 1, 1, 2.0)])
        .await
        .unwrap()
        .unwrap();
    assert_eq!(load.kv_usage_ratio(), 1.0);
}

#[tokio::test]
async fn the_default_cap_takes_64_ranks() {
    // The default cap (1 MiB) takes 64 full ranks.
    let ranks = (0..64).map(|dp| rank(dp, 1, 1, 0.5)).collect();
    let load = fetch_ranks::<Vllm>(ranks).await.unwrap().unwrap();
    assert_eq!(load.ranks().len(), 64);
}
