//! The pure conversion on real-shaped `GetLoadsResponse` bytes, encoded by
//! protoc from the `.txtpb` files beside them.

// Helpers outside #[test] functions may unwrap too: a panic is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use backends_tokenspeed::proto::GetLoadsResponse;
use backends_tokenspeed::worker_load_from_grpc;
use load_protocols::WorkerLoad;
use prost::Message;

fn convert(bytes: &[u8]) -> Option<WorkerLoad> {
    worker_load_from_grpc(GetLoadsResponse::decode(bytes).unwrap()).unwrap()
}

#[test]
fn released_server_two_ranks() {
    let load = convert(include_bytes!("fixtures/grpc_released_dp2.binpb")).unwrap();
    assert_eq!(load.ranks().len(), 2);
    assert_eq!(load.running_requests(), 59);
    assert_eq!(load.waiting_requests(), 4);
    // Rank 0 has 4 waiting and reports 0 tokens: not reported, so the worker
    // as a whole does not report queued tokens.
    assert_eq!(load.ranks()[0].num_waiting_uncached_tokens, None);
    assert_eq!(load.ranks()[1].num_waiting_uncached_tokens, Some(0));
    assert_eq!(load.queued_tokens(), None);
    assert_eq!(load.throughput_tps(), None);
    assert!((load.kv_usage_ratio() - 0.5).abs() < 1e-12);
    assert_eq!(load.ranks()[0].max_total_num_tokens, 400_000);
    insta::assert_json_snapshot!("released_dp2", load);
}

#[test]
fn newer_server_with_queued_tokens() {
    let load = convert(include_bytes!("fixtures/grpc_with_queued_tokens.binpb")).unwrap();
    assert_eq!(load.queued_tokens(), Some(9000));
    assert_eq!(load.waiting_requests(), 5);
    assert_eq!(load.running_requests(), 64);
    assert_eq!(load.throughput_tps(), Some(2450.5));
    assert_eq!(load.kv_usage_ratio(), 0.75);
    assert_eq!(load.ranks()[0].max_running_requests, 128);
    assert_eq!(load.ranks()[0].cache_hit_rate, 0.33);
    insta::assert_json_snapshot!("with_queued_tokens", load);
}

#[test]
fn encode_only_worker_is_no_report() {
    assert!(convert(include_bytes!("fixtures/grpc_encode_only.binpb")).is_none());
}
