use serde::{Deserialize, Serialize};

/// One DP rank's scheduler load, field for field as SGLang's `/v1/loads`
/// reports it (`docs/wire-formats.md`).
///
/// Counts are `i64` so that every wire format converts into this type without
/// loss; [`WorkerLoad::from_ranks`](crate::WorkerLoad::from_ranks) rejects the
/// negative ones. The two optional signals are `Option`s: `None` means the
/// backend did not report the signal, which is not the same as reporting 0.
/// Missing JSON keys take their defaults and unknown keys are ignored, so older
/// and newer servers both parse.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct SchedulerLoadSnapshot {
    pub dp_rank: i64,
    pub num_running_reqs: i64,
    pub num_waiting_reqs: i64,
    /// Token-work waiting in the queue that the prefix cache will not serve.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_waiting_uncached_tokens: Option<i64>,
    pub num_total_reqs: i64,
    pub num_used_tokens: i64,
    pub max_total_num_tokens: i64,
    /// KV-cache usage ratio in `[0, 1]`.
    pub token_usage: f64,
    /// Live generation rate of this rank, tokens per second.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gen_throughput: Option<f64>,
    pub cache_hit_rate: f64,
    pub utilization: f64,
    pub max_running_requests: i64,
}

/// SGLang's fleet-level summary, carried for round-tripping; the router
/// aggregates from the ranks itself.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct AggregateMetrics {
    pub total_running_reqs: i64,
    pub total_waiting_reqs: i64,
    pub total_reqs: i64,
    pub avg_token_usage: f64,
    pub avg_throughput: f64,
    pub avg_utilization: f64,
}

/// The whole body of SGLang's `GET /v1/loads` (and the shape of every gRPC
/// `GetLoadsResponse`).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct LoadsResponse {
    /// RFC 3339 time of the report; some servers send an empty string.
    pub timestamp: String,
    pub version: String,
    pub dp_rank_count: i64,
    pub loads: Vec<SchedulerLoadSnapshot>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub aggregate: Option<AggregateMetrics>,
}

/// The gRPC presence rule for `num_waiting_uncached_tokens`.
///
/// proto3 gives an `int32` no presence, so 0 is ambiguous. An engine that
/// reports the signal counts at least one uncached token per waiting request
/// (the last prompt token is always computed), so a positive value, or 0 with
/// nothing waiting, is a report; 0 next to waiting requests is not.
pub fn queued_tokens_from_proto3(
    num_waiting_uncached_tokens: i64,
    num_waiting_reqs: i64,
) -> Option<i64> {
    if num_waiting_uncached_tokens > 0
        || (num_waiting_uncached_tokens == 0 && num_waiting_reqs == 0)
    {
        Some(num_waiting_uncached_tokens)
    } else if num_waiting_uncached_tokens < 0 {
        // Keep a negative value so that validation rejects it by name.
        Some(num_waiting_uncached_tokens)
    } else {
        None
    }
}

/// The throughput presence rule for proto3 doubles: engines that do not
/// measure it leave it 0, which means "not reported", never "stalled".
pub fn throughput_from_proto3(gen_throughput: f64) -> Option<f64> {
    (gen_throughput != 0.0).then_some(gen_throughput)
}

/// A count as a proto3 `int32`, for servers that send the gRPC reports:
/// counts beyond `i32` saturate.
///
/// ```
/// use load_protocols::proto3_count;
///
/// assert_eq!(proto3_count(7), 7);
/// assert_eq!(proto3_count(i64::MAX), i32::MAX);
/// assert_eq!(proto3_count(i64::MIN), i32::MIN);
/// ```
pub fn proto3_count(value: i64) -> i32 {
    i32::try_from(value).unwrap_or(if value < 0 { i32::MIN } else { i32::MAX })
}
