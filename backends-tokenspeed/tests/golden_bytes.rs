//! The generated messages encode with TokenSpeed's own field numbers, which
//! differ from SGLang's. The expected bytes are written by hand from the spec.

// Helpers outside #[test] functions may unwrap too: a panic is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use backends_tokenspeed::proto::{
    GetLoadsRequest, GetLoadsResponse, HealthCheckResponse, SchedulerLoad,
};
use prost::Message;

#[test]
fn queued_tokens_is_field_14() {
    let load = SchedulerLoad {
        num_waiting_uncached_tokens: 5,
        ..Default::default()
    };
    assert_eq!(load.encode_to_vec(), [0x70, 0x05]);
}

#[test]
fn token_usage_is_field_8_double() {
    let load = SchedulerLoad {
        token_usage: 0.5,
        ..Default::default()
    };
    assert_eq!(
        load.encode_to_vec(),
        [0x41, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xe0, 0x3f]
    );
}

#[test]
fn every_scheduler_load_field_has_its_number() {
    const HALF: [u8; 8] = [0, 0, 0, 0, 0, 0, 0xe0, 0x3f];
    let double = |tag: u8| {
        let mut bytes = vec![tag];
        bytes.extend(HALF);
        bytes
    };
    let cases: Vec<(SchedulerLoad, Vec<u8>)> = vec![
        (
            SchedulerLoad {
                dp_rank: 1,
                ..Default::default()
            },
            vec![0x08, 0x01],
        ),
        (
            SchedulerLoad {
                num_running_reqs: 1,
                ..Default::default()
            },
            vec![0x10, 0x01],
        ),
        (
            SchedulerLoad {
                num_waiting_reqs: 1,
                ..Default::default()
            },
            vec![0x18, 0x01],
        ),
        (
            SchedulerLoad {
                num_total_reqs: 1,
                ..Default::default()
            },
            vec![0x20, 0x01],
        ),
        (
            SchedulerLoad {
                num_used_tokens: 1,
                ..Default::default()
            },
            vec![0x28, 0x01],
        ),
        (
            SchedulerLoad {
                max_total_num_tokens: 1,
                ..Default::default()
            },
            vec![0x30, 0x01],
        ),
        // 7 is max_running_requests here (11 in SGLang's numbering).
        (
            SchedulerLoad {
                max_running_requests: 1,
                ..Default::default()
            },
            vec![0x38, 0x01],
        ),
        (
            SchedulerLoad {
                gen_throughput: 0.5,
                ..Default::default()
            },
            double(0x49),
        ),
        (
            SchedulerLoad {
                cache_hit_rate: 0.5,
                ..Default::default()
            },
            double(0x51),
        ),
        (
            SchedulerLoad {
                utilization: 0.5,
                ..Default::default()
            },
            double(0x59),
        ),
        (
            SchedulerLoad {
                num_waiting_uncached_tokens: 300,
                ..Default::default()
            },
            vec![0x70, 0xac, 0x02],
        ),
    ];
    for (message, expected) in cases {
        assert_eq!(message.encode_to_vec(), expected, "{message:?}");
    }
}

#[test]
fn response_request_and_health_numbers() {
    let response = GetLoadsResponse {
        timestamp: "t".into(),
        version: "v".into(),
        dp_rank_count: 2,
        loads: vec![SchedulerLoad {
            dp_rank: 1,
            ..Default::default()
        }],
        aggregate: Some(Default::default()),
    };
    assert_eq!(
        response.encode_to_vec(),
        [
            0x0a, 0x01, b't', // timestamp = 1
            0x12, 0x01, b'v', // version = 2
            0x18, 0x02, // dp_rank_count = 3
            0x22, 0x02, 0x08, 0x01, // loads = 4 { dp_rank = 1 }
            0x2a, 0x00, // aggregate = 5 {}
        ]
    );
    let request = GetLoadsRequest {
        dp_rank: Some(0),
        include: vec!["core".into()],
    };
    assert_eq!(
        request.encode_to_vec(),
        [0x08, 0x00, 0x12, 0x04, b'c', b'o', b'r', b'e']
    );
    let health = HealthCheckResponse {
        healthy: true,
        message: "ok".into(),
    };
    assert_eq!(health.encode_to_vec(), [0x08, 0x01, 0x12, 0x02, b'o', b'k']);
}

#[test]
fn sglang_numbering_does_not_leak_in() {
    // SGLang's field 17 (queued tokens there) is unknown here and skipped;
    // its aggregate fields inside field 5 are skipped too.
    let bytes = [
        0x22, 0x05, 0x18, 0x02, 0x88, 0x01, 0x05, // loads { waiting = 2, 17: 5 }
        0x2a, 0x02, 0x10, 0x03, // aggregate { 2: 3 }
    ];
    let response = GetLoadsResponse::decode(bytes.as_slice()).unwrap();
    assert_eq!(response.loads[0].num_waiting_reqs, 2);
    assert_eq!(response.loads[0].num_waiting_uncached_tokens, 0);
}
