//! The generated gRPC types against hand-written golden bytes, and the pure
//! `GetLoads` conversion.

use backends_vllm::proto::{
    GetLoadsRequest, GetLoadsResponse, HealthCheckRequest, HealthCheckResponse, SchedulerLoad,
};
use backends_vllm::worker_load_from_grpc;
use load_protocols::LoadValidationError;
use prost::Message;

#[test]
fn token_usage_is_field_7_golden_bytes() {
    let load = SchedulerLoad {
        token_usage: 0.5,
        ..SchedulerLoad::default()
    };
    assert_eq!(
        load.encode_to_vec(),
        [0x39, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xe0, 0x3f]
    );
}

#[test]
fn every_scheduler_load_field_has_its_number() {
    // Hand-encoded: each field's tag, then its value.
    #[rustfmt::skip]
    let bytes = [
        0x08, 0x01,             // 1 dp_rank = 1
        0x10, 0x02,             // 2 num_running_reqs = 2
        0x18, 0x03,             // 3 num_waiting_reqs = 3
        0x20, 0x04,             // 4 num_total_reqs = 4
        0x28, 0x05,             // 5 num_used_tokens = 5
        0x30, 0x06,             // 6 max_total_num_tokens = 6
        0x39, 0, 0, 0, 0, 0, 0, 0xe0, 0x3f, // 7 token_usage = 0.5
        0x41, 0, 0, 0, 0, 0, 0, 0x59, 0x40, // 8 gen_throughput = 100.0
        0x49, 0, 0, 0, 0, 0, 0, 0xd0, 0x3f, // 9 cache_hit_rate = 0.25
        0x51, 0, 0, 0, 0, 0, 0, 0xe8, 0x3f, // 10 utilization = 0.75
        0x58, 0x0b,             // 11 max_running_requests = 11
    ];
    let load = SchedulerLoad::decode(&bytes[..]).unwrap();
    assert_eq!(
        load,
        SchedulerLoad {
            dp_rank: 1,
            num_running_reqs: 2,
            num_waiting_reqs: 3,
            num_total_reqs: 4,
            num_used_tokens: 5,
            max_total_num_tokens: 6,
            token_usage: 0.5,
            gen_throughput: 100.0,
            cache_hit_rate: 0.25,
            utilization: 0.75,
            max_running_requests: 11,
        }
    );
    assert_eq!(load.encode_to_vec(), bytes);
}

#[test]
fn response_request_and_health_fields_have_their_numbers() {
    let response = GetLoadsResponse {
        timestamp: "t".into(),
        version: "v".into(),
        dp_rank_count: 2,
        loads: vec![SchedulerLoad {
            num_waiting_reqs: 5,
            ..SchedulerLoad::default()
        }],
    };
    assert_eq!(
        response.encode_to_vec(),
        [0x0a, 1, b't', 0x12, 1, b'v', 0x18, 2, 0x22, 2, 0x18, 5]
    );
    let request = GetLoadsRequest {
        dp_rank: Some(0),
        include: vec!["core".into()],
    };
    // `optional` keeps an explicit 0 on the wire.
    assert_eq!(
        request.encode_to_vec(),
        [0x08, 0, 0x12, 4, b'c', b'o', b'r', b'e']
    );
    let health = HealthCheckResponse {
        healthy: true,
        message: "ok".into(),
    };
    assert_eq!(health.encode_to_vec(), [0x08, 1, 0x12, 2, b'o', b'k']);
    assert!(HealthCheckRequest {}.encode_to_vec().is_empty());
}

#[test]
fn unknown_fields_from_newer_servers_are_ignored() {
    // Field 17 (varint 5) is not in our proto: proto3 skips it.
    let bytes = [0x18, 0x03, 0x88, 0x01, 0x05];
    let load = SchedulerLoad::decode(&bytes[..]).unwrap();
    assert_eq!(load.num_waiting_reqs, 3);
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

#[test]
fn two_ranks_as_vllm_fills_them() {
    let response = GetLoadsResponse {
        timestamp: "2026-12-01T00:00:00Z".into(),
        version: "0.11.0".into(),
        dp_rank_count: 2,
        loads: vec![rank(0, 12, 3, 0.35), rank(1, 9, 0, 0.25)],
    };
    let load = worker_load_from_grpc(response).unwrap().unwrap();
    assert_eq!(load.running_requests(), 21);
    assert_eq!(load.waiting_requests(), 3);
    assert!((load.kv_usage_ratio() - 0.3).abs() < 1e-12);
    // Throughput 0 and queued tokens: not reported.
    assert_eq!(load.throughput_tps(), None);
    assert_eq!(load.queued_tokens(), None);
    assert_eq!(load.ranks()[0].num_total_reqs, 15);
    insta::assert_json_snapshot!("grpc_two_ranks", load);
}

#[test]
fn a_positive_throughput_is_reported() {
    let mut with_rate = rank(0, 1, 0, 0.1);
    with_rate.gen_throughput = 950.5;
    let response = GetLoadsResponse {
        loads: vec![with_rate],
        ..GetLoadsResponse::default()
    };
    let load = worker_load_from_grpc(response).unwrap().unwrap();
    assert_eq!(load.throughput_tps(), Some(950.5));
}

#[test]
fn empty_loads_is_no_report() {
    assert_eq!(
        worker_load_from_grpc(GetLoadsResponse::default()).unwrap(),
        None
    );
}

#[test]
fn hostile_values_are_rejected_or_clamped() {
    let one = |load: SchedulerLoad| {
        worker_load_from_grpc(GetLoadsResponse {
            loads: vec![load],
            ..GetLoadsResponse::default()
        })
    };
    assert!(matches!(
        one(rank(2, 1, 1, f64::NAN)),
        Err(LoadValidationError::NonFinite {
            dp_rank: 2,
            field: "token_usage",
            ..
        })
    ));
    assert_eq!(
        one(rank(2, 1, 1, f64::INFINITY)),
        Err(LoadValidationError::NonFinite {
            dp_rank: 2,
            field: "token_usage",
            value: f64::INFINITY
        })
    );
    assert_eq!(
        one(rank(0, 1, -2, 0.5)),
        Err(LoadValidationError::NegativeCount {
            dp_rank: 0,
            field: "num_waiting_reqs",
            value: -2
        })
    );
    assert_eq!(
        one(rank(0, 1, 1, -0.5)),
        Err(LoadValidationError::NegativeRatio {
            dp_rank: 0,
            field: "token_usage",
            value: -0.5
        })
    );
    let clamped = one(rank(0, 1, 1, 1.5)).unwrap().unwrap();
    assert_eq!(clamped.kv_usage_ratio(), 1.0);
    let mut bad_rate = rank(0, 1, 1, 0.5);
    bad_rate.gen_throughput = -10.0;
    assert_eq!(one(bad_rate).unwrap().unwrap().throughput_tps(), None);
}
