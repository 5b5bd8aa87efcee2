//! `TokenspeedGrpcLoadSource` against a real tonic server on loopback: the
//! checks every gRPC load source passes (`load_transport::test_support`),
//! and what TokenSpeed's own proto and conversion decide.

// Helpers outside #[test] functions may unwrap too: a panic is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use backends_tokenspeed::TokenspeedGetLoads;
use backends_tokenspeed::proto::token_speed_scheduler_server::{
    TokenSpeedScheduler, TokenSpeedSchedulerServer,
};
use backends_tokenspeed::proto::{GetLoadsResponse, SchedulerLoad};
use load_protocols::LoadValidationError;
use load_transport::test_support::{self, Script, build, fetch_ranks, options, serve};
use policy_core::LoadError;
use prost::Message;
use tonic::Code;

load_transport::scripted_backend!(
    TokenSpeed,
    TokenspeedGetLoads,
    TokenSpeedScheduler,
    TokenSpeedSchedulerServer,
    backends_tokenspeed::proto
);

#[tokio::test]
async fn what_every_grpc_source_does() {
    // DEADLINE_EXCEEDED from the server is no report here.
    test_support::check_source::<TokenSpeed>().await;
}

#[test]
fn registers_tokenspeed_only() {
    let mut registry = policy_core::BackendRegistry::new();
    backends_tokenspeed::register(&mut registry);
    assert_eq!(registry.names(), ["tokenspeed"]);
}

#[tokio::test]
async fn a_released_server_s_report() {
    let fixture =
        GetLoadsResponse::decode(include_bytes!("fixtures/grpc_released_dp2.binpb").as_slice())
            .unwrap();
    let load = test_support::fetch::<TokenSpeed>(Script::Reply(fixture))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(load.running_requests(), 59);
    assert_eq!(load.waiting_requests(), 4);
    assert_eq!(load.queued_tokens(), None, "a released server reports none");
}

#[tokio::test]
async fn a_positive_field_14_is_used() {
    let load = fetch_ranks::<TokenSpeed>(vec![SchedulerLoad {
        num_waiting_reqs: 2,
        num_waiting_uncached_tokens: 3000,
        gen_throughput: 1500.0,
        ..Default::default()
    }])
    .await
    .unwrap()
    .unwrap();
    assert_eq!(load.queued_tokens(), Some(3000));
    assert_eq!(load.throughput_tps(), Some(1500.0));
}

#[tokio::test]
async fn bad_values_are_rejected_or_clamped() {
    for usage in [f64::NAN, f64::INFINITY, -0.5] {
        let err = fetch_ranks::<TokenSpeed>(vec![SchedulerLoad {
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
    let err = fetch_ranks::<TokenSpeed>(vec![SchedulerLoad {
        num_waiting_reqs: -2,
        ..Default::default()
    }])
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
    let load = fetch_ranks::<TokenSpeed>(vec![SchedulerLoad {
        token_usage: 1.2,
        gen_throughput: f64::NAN,
        ..Default::default()
    }])
    .await
    .unwrap()
    .unwrap();
    assert_eq!(load.kv_usage_ratio(), 1.0);
    assert_eq!(load.throughput_tps(), None);
}

#[tokio::test]
async fn deadline_exceeded_completes_the_poll_without_a_snapshot() {
    use policy_core::{MockPolicy, PollMark, PollOutcome, WorkerId, poll_worker, tokio_now};

    let (addr, _) = serve::<TokenSpeed>(Script::Fail(Code::DeadlineExceeded)).await;
    let source = build::<TokenSpeed>(addr, options());
    let mut policy = MockPolicy::new();
    policy
        .expect_poll_started()
        .times(1)
        .returning(PollMark::nothing_pending);
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
