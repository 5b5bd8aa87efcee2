//! The pure conversions on real-shaped captures of each SGLang flavour:
//! `/v1/loads` JSON, gRPC `GetLoadsResponse` bytes (encoded by protoc), and
//! `/metrics` text of both prefix generations.

// Helpers outside #[test] functions may unwrap too: a panic is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use backends_sglang::proto::GetLoadsResponse;
use backends_sglang::{
    worker_load_from_grpc, worker_load_from_loads_json, worker_load_from_metrics_text,
};
use load_protocols::{LoadsResponse, WorkerLoad};
use prost::Message;

fn json(body: &str) -> WorkerLoad {
    let response: LoadsResponse = serde_json::from_str(body).unwrap();
    worker_load_from_loads_json(response).unwrap().unwrap()
}

fn grpc(bytes: &[u8]) -> WorkerLoad {
    worker_load_from_grpc(GetLoadsResponse::decode(bytes).unwrap())
        .unwrap()
        .unwrap()
}

#[test]
fn json_single_rank() {
    let load = json(include_str!("fixtures/loads_single_rank.json"));
    assert_eq!(load.ranks().len(), 1);
    assert_eq!(load.queued_tokens(), Some(5120));
    assert_eq!(load.waiting_requests(), 3);
    assert_eq!(load.running_requests(), 12);
    assert_eq!(load.throughput_tps(), Some(1840.5));
    assert_eq!(load.kv_usage_ratio(), 0.349);
    insta::assert_json_snapshot!("json_single_rank", load);
}

#[test]
fn json_dp4_with_every_section() {
    let load = json(include_str!("fixtures/loads_dp4_all_sections.json"));
    assert_eq!(load.ranks().len(), 4);
    assert_eq!(load.queued_tokens(), Some(14336 + 61440));
    assert_eq!(load.waiting_requests(), 23);
    assert_eq!(load.running_requests(), 227);
    // Rank 3 is idle and reports 0.0: over JSON that is a report.
    assert_eq!(load.ranks()[3].gen_throughput, Some(0.0));
    let throughput = load.throughput_tps().unwrap();
    assert!((throughput - (2210.7 + 2301.2 + 1604.0)).abs() < 1e-9);
    assert!((load.kv_usage_ratio() - (0.6136 + 0.5920 + 0.9918) / 4.0).abs() < 1e-12);
    insta::assert_json_snapshot!("json_dp4_all_sections", load);
}

#[test]
fn json_older_server() {
    let load = json(include_str!("fixtures/loads_older_server.json"));
    assert_eq!(load.ranks().len(), 2);
    assert_eq!(load.queued_tokens(), None, "missing key: not reported");
    assert_eq!(load.throughput_tps(), None, "missing key: not reported");
    assert_eq!(load.waiting_requests(), 2);
    assert_eq!(load.running_requests(), 10);
    assert!((load.kv_usage_ratio() - 0.3).abs() < 1e-12);
    insta::assert_json_snapshot!("json_older_server", load);
}

#[test]
fn grpc_dp2() {
    let load = grpc(include_bytes!("fixtures/grpc_dp2.binpb"));
    assert_eq!(load.ranks().len(), 2);
    // Rank 1 has nothing waiting, so its 0 is a report.
    assert_eq!(load.ranks()[1].num_waiting_uncached_tokens, Some(0));
    assert_eq!(load.queued_tokens(), Some(5120));
    assert_eq!(load.waiting_requests(), 3);
    assert_eq!(load.running_requests(), 21);
    assert_eq!(load.throughput_tps(), Some(1840.5 + 1702.25));
    assert!((load.kv_usage_ratio() - (0.349 + 0.2289) / 2.0).abs() < 1e-12);
    insta::assert_json_snapshot!("grpc_dp2", load);
}

#[test]
fn grpc_older_server() {
    let load = grpc(include_bytes!("fixtures/grpc_older_server.binpb"));
    // 0 queued tokens next to 4 waiting requests: not reported.
    assert_eq!(load.queued_tokens(), None);
    assert_eq!(load.throughput_tps(), None, "0.0 over gRPC: not reported");
    assert_eq!(load.waiting_requests(), 4);
    assert_eq!(load.running_requests(), 7);
    assert_eq!(load.kv_usage_ratio(), 0.61);
    insta::assert_json_snapshot!("grpc_older_server", load);
}

#[test]
fn metrics_colon_prefix_single_series() {
    let load =
        worker_load_from_metrics_text(include_str!("fixtures/metrics_v0_5_3_single.txt")).unwrap();
    assert_eq!(load.ranks().len(), 1);
    assert_eq!(load.running_requests(), 17);
    assert_eq!(load.waiting_requests(), 5);
    assert_eq!(load.queued_tokens(), None, "no waiting-token gauge exists");
    assert_eq!(load.throughput_tps(), Some(1288.6));
    assert_eq!(load.kv_usage_ratio(), 0.42);
    assert_eq!(load.ranks()[0].cache_hit_rate, 0.37);
    insta::assert_json_snapshot!("metrics_v0_5_3_single", load);
}

#[test]
fn metrics_underscore_prefix_two_dp_ranks() {
    // Escaped label values, timestamps, `_created` series, histograms and
    // other families in the text.
    let load =
        worker_load_from_metrics_text(include_str!("fixtures/metrics_v0_5_4_dp2.txt")).unwrap();
    assert_eq!(load.ranks().len(), 2);
    assert_eq!(load.ranks()[1].dp_rank, 1);
    assert_eq!(load.running_requests(), 76);
    assert_eq!(load.waiting_requests(), 11);
    assert_eq!(load.ranks()[0].num_waiting_reqs, 9);
    assert_eq!(load.queued_tokens(), None);
    assert_eq!(load.throughput_tps(), Some(2000.0));
    assert!((load.kv_usage_ratio() - 0.7).abs() < 1e-12);
    // A NaN informational gauge degrades to 0.
    assert_eq!(load.ranks()[1].utilization, 0.0);
    insta::assert_json_snapshot!("metrics_v0_5_4_dp2", load);
}

#[test]
fn metrics_series_without_dp_label_are_summed_and_averaged() {
    let load =
        worker_load_from_metrics_text(include_str!("fixtures/metrics_tp_series_no_dp_label.txt"))
            .unwrap();
    assert_eq!(load.ranks().len(), 1);
    assert_eq!(load.running_requests(), 7);
    assert_eq!(load.waiting_requests(), 3);
    assert!((load.kv_usage_ratio() - 0.3).abs() < 1e-12);
    assert_eq!(load.throughput_tps(), None, "no throughput gauge");
    insta::assert_json_snapshot!("metrics_no_dp_label", load);
}
