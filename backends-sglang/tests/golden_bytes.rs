//! The generated messages encode with SGLang's field numbers. The expected
//! bytes are written by hand from the field numbers (`docs/wire-formats.md`),
//! so a wrong number fails here
//! (round-tripping through the same generated type would prove nothing).

// Helpers outside #[test] functions may unwrap too: a panic is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use backends_sglang::proto::{
    AggregateMetrics, GetLoadsRequest, GetLoadsResponse, HealthCheckResponse, SchedulerLoad,
};
use prost::Message;

#[test]
fn queued_tokens_is_field_17() {
    let load = SchedulerLoad {
        num_waiting_uncached_tokens: 5,
        ..Default::default()
    };
    assert_eq!(load.encode_to_vec(), [0x88, 0x01, 0x05]);
}

#[test]
fn token_usage_is_field_7_double() {
    let load = SchedulerLoad {
        token_usage: 0.5,
        ..Default::default()
    };
    assert_eq!(
        load.encode_to_vec(),
        [0x39, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xe0, 0x3f]
    );
}

#[test]
fn every_scheduler_load_field_has_its_number() {
    // (message, expected bytes): tag = field << 3 | wire type.
    let cases: [(SchedulerLoad, &[u8]); 11] = [
        (
            SchedulerLoad {
                dp_rank: 1,
                ..Default::default()
            },
            &[0x08, 0x01],
        ),
        (
            SchedulerLoad {
                num_running_reqs: 1,
                ..Default::default()
            },
            &[0x10, 0x01],
        ),
        (
            SchedulerLoad {
                num_waiting_reqs: 1,
                ..Default::default()
            },
            &[0x18, 0x01],
        ),
        (
            SchedulerLoad {
                num_total_reqs: 1,
                ..Default::default()
            },
            &[0x20, 0x01],
        ),
        (
            SchedulerLoad {
                num_used_tokens: 1,
                ..Default::default()
            },
            &[0x28, 0x01],
        ),
        (
            SchedulerLoad {
                max_total_num_tokens: 1,
                ..Default::default()
            },
            &[0x30, 0x01],
        ),
        (
            SchedulerLoad {
                gen_throughput: 0.5,
                ..Default::default()
            },
            &[0x41, 0, 0, 0, 0, 0, 0, 0xe0, 0x3f],
        ),
        (
            SchedulerLoad {
                cache_hit_rate: 0.5,
                ..Default::default()
            },
            &[0x49, 0, 0, 0, 0, 0, 0, 0xe0, 0x3f],
        ),
        (
            SchedulerLoad {
                utilization: 0.5,
                ..Default::default()
            },
            &[0x51, 0, 0, 0, 0, 0, 0, 0xe0, 0x3f],
        ),
        (
            SchedulerLoad {
                max_running_requests: 1,
                ..Default::default()
            },
            &[0x58, 0x01],
        ),
        (
            SchedulerLoad {
                num_waiting_uncached_tokens: 300,
                ..Default::default()
            },
            &[0x88, 0x01, 0xac, 0x02],
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
        aggregate: Some(AggregateMetrics {
            total_waiting_reqs: 3,
            ..Default::default()
        }),
    };
    assert_eq!(
        response.encode_to_vec(),
        [
            0x0a, 0x01, b't', // timestamp = 1
            0x12, 0x01, b'v', // version = 2
            0x18, 0x02, // dp_rank_count = 3
            0x22, 0x02, 0x08, 0x01, // loads = 4 { dp_rank = 1 }
            0x2a, 0x02, 0x10, 0x03, // aggregate = 5 { total_waiting_reqs = 2 }
        ]
    );
    let aggregate = AggregateMetrics {
        total_running_reqs: 1,
        total_reqs: 1,
        avg_token_usage: 0.5,
        avg_throughput: 0.5,
        avg_utilization: 0.5,
        ..Default::default()
    };
    let mut expected = vec![0x08, 0x01, 0x18, 0x01];
    for tag in [0x21, 0x29, 0x31] {
        expected.extend([tag, 0, 0, 0, 0, 0, 0, 0xe0, 0x3f]);
    }
    assert_eq!(aggregate.encode_to_vec(), expected);

    // `optional` gives dp_rank presence: an explicit 0 is sent.
    let request = GetLoadsRequest {
        dp_rank: Some(0),
        include: vec!["core".into()],
    };
    assert_eq!(
        request.encode_to_vec(),
        [0x08, 0x00, 0x12, 0x04, b'c', b'o', b'r', b'e']
    );
    assert!(
        GetLoadsRequest {
            dp_rank: None,
            include: vec![]
        }
        .encode_to_vec()
        .is_empty()
    );

    let health = HealthCheckResponse {
        healthy: true,
        message: "ok".into(),
    };
    assert_eq!(health.encode_to_vec(), [0x08, 0x01, 0x12, 0x02, b'o', b'k']);
}

#[test]
fn fields_we_leave_out_are_skipped() {
    // dp_rank = 1, then the sub-messages 12 (memory) and 16 (queues) a full
    // server sends, then field 17 = 5.
    let bytes = [
        0x08, 0x01, // dp_rank
        0x62, 0x02, 0x08, 0x07, // 12: { 1: 7 }
        0x82, 0x01, 0x02, 0x08, 0x02, // 16: { 1: 2 }
        0x88, 0x01, 0x05, // 17
    ];
    let load = SchedulerLoad::decode(bytes.as_slice()).unwrap();
    assert_eq!(load.dp_rank, 1);
    assert_eq!(load.num_waiting_uncached_tokens, 5);
}
