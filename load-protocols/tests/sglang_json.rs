//! SGLang `/v1/loads` bodies, real-shaped, through serde and validation.

use load_protocols::{
    LoadValidationError, LoadsResponse, WorkerLoad, queued_tokens_from_proto3,
    throughput_from_proto3,
};

const SINGLE: &str = include_str!("fixtures/single_rank.json");
const MULTI: &str = include_str!("fixtures/multi_rank.json");
const OLDER: &str = include_str!("fixtures/older_server.json");

#[test]
fn single_rank_report() {
    let load: WorkerLoad = serde_json::from_str(SINGLE).unwrap();
    assert_eq!(load.ranks().len(), 1);
    assert_eq!(load.queued_tokens(), Some(5120));
    assert_eq!(load.waiting_requests(), 3);
    assert_eq!(load.running_requests(), 12);
    assert_eq!(load.throughput_tps(), Some(1840.5));
    assert_eq!(load.kv_usage_ratio(), 0.349);
}

#[test]
fn multi_rank_report_aggregates() {
    let load: WorkerLoad = serde_json::from_str(MULTI).unwrap();
    assert_eq!(load.ranks().len(), 2);
    // 5120 + 0: rank 1 reported zero, which is a report.
    assert_eq!(load.queued_tokens(), Some(5120));
    assert_eq!(load.waiting_requests(), 5);
    assert_eq!(load.throughput_tps(), Some(3600.0));
    assert!((load.kv_usage_ratio() - 0.33).abs() < 1e-12);
    insta::assert_json_snapshot!("multi_rank_worker_load", load);
}

#[test]
fn older_server_without_optional_signals() {
    let load: WorkerLoad = serde_json::from_str(OLDER).unwrap();
    assert_eq!(load.queued_tokens(), None, "missing key means not reported");
    assert_eq!(load.throughput_tps(), None);
    assert_eq!(load.waiting_requests(), 2);
    assert_eq!(
        load.ranks()[0].max_total_num_tokens,
        0,
        "missing field takes its default"
    );
    assert_eq!(load.kv_usage_ratio(), 0.25);
}

#[test]
fn empty_timestamp_is_accepted() {
    let response: LoadsResponse = serde_json::from_str(OLDER).unwrap();
    assert_eq!(response.timestamp, "");
    assert!(WorkerLoad::try_from(response).is_ok());
}

#[test]
fn loads_response_round_trips() {
    for body in [SINGLE, MULTI, OLDER] {
        let parsed: LoadsResponse = serde_json::from_str(body).unwrap();
        let text = serde_json::to_string(&parsed).unwrap();
        let again: LoadsResponse = serde_json::from_str(&text).unwrap();
        assert_eq!(parsed, again);
    }
    // A missing optional key stays missing after a round trip.
    let parsed: LoadsResponse = serde_json::from_str(OLDER).unwrap();
    let text = serde_json::to_string(&parsed).unwrap();
    assert!(!text.contains("num_waiting_uncached_tokens"));
    assert!(!text.contains("gen_throughput"));
}

#[test]
fn worker_load_round_trips_under_loads_key() {
    let load: WorkerLoad = serde_json::from_str(MULTI).unwrap();
    let value = serde_json::to_value(&load).unwrap();
    assert_eq!(value["loads"][0]["num_waiting_uncached_tokens"], 5120);
    let again: WorkerLoad = serde_json::from_value(value).unwrap();
    assert_eq!(load, again);
}

#[test]
fn malformed_json_is_an_error() {
    for body in [
        "",
        "{",
        "not json",
        r#"{"loads": [{"dp_rank": 0, "num_waiting_reqs": "three"}]}"#,
        r#"{"loads": {"dp_rank": 0}}"#,
        r#"{"loads": [{"token_usage": NaN}]}"#,
    ] {
        assert!(
            serde_json::from_str::<LoadsResponse>(body).is_err(),
            "{body:?} must not parse"
        );
    }
}

#[test]
fn hostile_values_are_rejected_with_the_exact_error() {
    let negative = r#"{"loads": [{"dp_rank": 1, "num_running_reqs": -2}]}"#;
    let response: LoadsResponse = serde_json::from_str(negative).unwrap();
    assert_eq!(
        WorkerLoad::try_from(response),
        Err(LoadValidationError::NegativeCount {
            dp_rank: 1,
            field: "num_running_reqs",
            value: -2
        })
    );
    // Deserializing straight into WorkerLoad runs the same checks.
    let err = serde_json::from_str::<WorkerLoad>(negative).unwrap_err();
    assert!(
        err.to_string()
            .contains("num_running_reqs is negative (-2)"),
        "{err}"
    );

    let empty = r#"{"timestamp": "", "loads": []}"#;
    let err = serde_json::from_str::<WorkerLoad>(empty).unwrap_err();
    assert!(err.to_string().contains("no dp ranks"), "{err}");

    let over = r#"{"loads": [{"token_usage": 1.5, "gen_throughput": -3.0}]}"#;
    let load: WorkerLoad = serde_json::from_str(over).unwrap();
    assert_eq!(load.kv_usage_ratio(), 1.0, "usage above 1 is clamped");
    assert_eq!(load.throughput_tps(), None, "negative rate is not a report");
}

#[test]
fn grpc_presence_rule() {
    assert_eq!(queued_tokens_from_proto3(5, 3), Some(5));
    assert_eq!(
        queued_tokens_from_proto3(0, 0),
        Some(0),
        "nothing waiting: 0 is a report"
    );
    assert_eq!(
        queued_tokens_from_proto3(0, 3),
        None,
        "0 next to waiting requests: not reported"
    );
    assert_eq!(
        queued_tokens_from_proto3(-1, 0),
        Some(-1),
        "kept so validation rejects it"
    );
    assert_eq!(throughput_from_proto3(0.0), None);
    assert_eq!(throughput_from_proto3(1800.0), Some(1800.0));
}
