//! Load reports built from an engine's true state, in the shape each real
//! engine reports it (`docs/engine-model.md`, "What the engine knows about
//! itself"; `docs/wire-formats.md`). Each flavour carries only the signals its real engine
//! reports.

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use load_protocols::{AggregateMetrics, LoadsResponse, SchedulerLoadSnapshot};

use crate::model::EngineSnapshot;

/// The version string the mock servers report.
pub const SIM_VERSION: &str = "engine-sim-0.1.0";

/// SGLang's `SchedulerLoad` for one rank: every field, including the queued
/// uncached tokens (with the chunked-prefill remainder) and the smoothed
/// generation throughput.
pub fn sglang_rank(snapshot: &EngineSnapshot) -> SchedulerLoadSnapshot {
    SchedulerLoadSnapshot {
        dp_rank: 0,
        num_running_reqs: i64::from(snapshot.running_requests),
        num_waiting_reqs: i64::from(snapshot.waiting_requests),
        num_waiting_uncached_tokens: Some(clamp_i64(snapshot.queued_prefill_tokens)),
        num_total_reqs: i64::from(snapshot.running_requests) + i64::from(snapshot.waiting_requests),
        num_used_tokens: clamp_i64(snapshot.used_kv_tokens),
        max_total_num_tokens: clamp_i64(snapshot.kv_capacity_tokens),
        token_usage: snapshot.kv_usage_ratio(),
        gen_throughput: Some(snapshot.decode_tps),
        cache_hit_rate: snapshot.cache_hit_rate,
        utilization: utilization(snapshot),
        max_running_requests: i64::from(snapshot.max_running),
    }
}

/// SGLang's `GET /v1/loads` body (one DP rank).
pub fn sglang_loads(snapshot: &EngineSnapshot, timestamp: String) -> LoadsResponse {
    let rank = sglang_rank(snapshot);
    let aggregate = AggregateMetrics {
        total_running_reqs: rank.num_running_reqs,
        total_waiting_reqs: rank.num_waiting_reqs,
        total_reqs: rank.num_total_reqs,
        avg_token_usage: rank.token_usage,
        avg_throughput: snapshot.decode_tps,
        avg_utilization: rank.utilization,
    };
    LoadsResponse {
        timestamp,
        version: SIM_VERSION.to_owned(),
        dp_rank_count: 1,
        loads: vec![rank],
        aggregate: Some(aggregate),
    }
}

/// SGLang's Prometheus `/metrics` text (`sglang:` prefix, ≤ 0.5.3): running,
/// queued requests, token usage, throughput, cache hit rate, utilization. No
/// queued-token gauge exists.
pub fn sglang_metrics_text(snapshot: &EngineSnapshot, model_name: &str) -> String {
    let labels = format!("model_name=\"{}\"", escape_label(model_name));
    let mut out = String::with_capacity(1024);
    let gauges: [(&str, &str, f64); 6] = [
        (
            "num_running_reqs",
            "The number of running requests.",
            f64::from(snapshot.running_requests),
        ),
        (
            "num_queue_reqs",
            "The number of requests in the waiting queue.",
            f64::from(snapshot.waiting_requests),
        ),
        ("token_usage", "The token usage.", snapshot.kv_usage_ratio()),
        (
            "gen_throughput",
            "The generation throughput (token/s).",
            snapshot.decode_tps,
        ),
        (
            "cache_hit_rate",
            "The prefix cache hit rate.",
            snapshot.cache_hit_rate,
        ),
        ("utilization", "The utilization.", utilization(snapshot)),
    ];
    for (name, help, value) in gauges {
        let _ = writeln!(out, "# HELP sglang:{name} {help}");
        let _ = writeln!(out, "# TYPE sglang:{name} gauge");
        let _ = writeln!(out, "sglang:{name}{{{labels}}} {}", prom_value(value));
    }
    out
}

/// vLLM V1's Prometheus `/metrics` text: the running/waiting gauges, KV usage,
/// and the token counters (no throughput gauge, no queued tokens), labelled
/// with `model_name` and `engine`. `# TYPE` lines of counters omit `_total`,
/// as `prometheus_client` writes them.
pub fn vllm_metrics_text(snapshot: &EngineSnapshot, model_name: &str, engine: u32) -> String {
    let labels = format!(
        "engine=\"{engine}\",model_name=\"{}\"",
        escape_label(model_name)
    );
    let mut out = String::with_capacity(2048);
    let gauges: [(&str, &str, f64); 3] = [
        (
            "num_requests_running",
            "Number of requests in model execution batches.",
            f64::from(snapshot.running_requests),
        ),
        (
            "num_requests_waiting",
            "Number of requests waiting to be processed.",
            f64::from(snapshot.waiting_requests),
        ),
        (
            "kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            snapshot.kv_usage_ratio(),
        ),
    ];
    for (name, help, value) in gauges {
        let _ = writeln!(out, "# HELP vllm:{name} {help}");
        let _ = writeln!(out, "# TYPE vllm:{name} gauge");
        let _ = writeln!(out, "vllm:{name}{{{labels}}} {}", prom_value(value));
    }
    let counters: [(&str, &str, u64); 4] = [
        (
            "prompt_tokens",
            "Number of prefill tokens processed.",
            snapshot.prompt_tokens_total,
        ),
        (
            "generation_tokens",
            "Number of generation tokens processed.",
            snapshot.generation_tokens_total,
        ),
        (
            "prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            snapshot.prefix_cache_queries_tokens_total,
        ),
        (
            "prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            snapshot.prefix_cache_hits_tokens_total,
        ),
    ];
    for (name, help, value) in counters {
        let _ = writeln!(out, "# HELP vllm:{name}_total {help}");
        let _ = writeln!(out, "# TYPE vllm:{name} counter");
        let _ = writeln!(
            out,
            "vllm:{name}_total{{{labels}}} {}",
            prom_value(value as f64)
        );
    }
    out
}

/// The fields a released TokenSpeed server fills: running, waiting, total,
/// used tokens, max tokens, token usage (no queued tokens, no throughput).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenSpeedLoad {
    pub num_running_reqs: i32,
    pub num_waiting_reqs: i32,
    pub num_total_reqs: i32,
    pub num_used_tokens: i32,
    pub max_total_num_tokens: i32,
    pub max_running_requests: i32,
    pub token_usage: f64,
}

/// TokenSpeed's load fields.
pub fn tokenspeed_load(snapshot: &EngineSnapshot) -> TokenSpeedLoad {
    TokenSpeedLoad {
        num_running_reqs: clamp_i32(u64::from(snapshot.running_requests)),
        num_waiting_reqs: clamp_i32(u64::from(snapshot.waiting_requests)),
        num_total_reqs: clamp_i32(
            u64::from(snapshot.running_requests) + u64::from(snapshot.waiting_requests),
        ),
        num_used_tokens: clamp_i32(snapshot.used_kv_tokens),
        max_total_num_tokens: clamp_i32(snapshot.kv_capacity_tokens),
        max_running_requests: clamp_i32(u64::from(snapshot.max_running)),
        token_usage: snapshot.kv_usage_ratio(),
    }
}

/// The fields a vLLM gRPC server fills: running, waiting, total, token usage;
/// throughput and capacity stay 0, queued tokens do not exist.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VllmLoad {
    pub num_running_reqs: i32,
    pub num_waiting_reqs: i32,
    pub num_total_reqs: i32,
    pub token_usage: f64,
}

/// vLLM's gRPC load fields.
pub fn vllm_load(snapshot: &EngineSnapshot) -> VllmLoad {
    VllmLoad {
        num_running_reqs: clamp_i32(u64::from(snapshot.running_requests)),
        num_waiting_reqs: clamp_i32(u64::from(snapshot.waiting_requests)),
        num_total_reqs: clamp_i32(
            u64::from(snapshot.running_requests) + u64::from(snapshot.waiting_requests),
        ),
        token_usage: snapshot.kv_usage_ratio(),
    }
}

/// The current wall-clock time as RFC 3339 (`2026-06-10T12:00:00.123Z`).
pub fn rfc3339_now() -> String {
    let since_epoch = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    rfc3339(since_epoch.as_secs(), since_epoch.subsec_millis())
}

/// Formats seconds since the Unix epoch (UTC) as RFC 3339 with milliseconds.
pub fn rfc3339(unix_s: u64, millis: u32) -> String {
    let days = (unix_s / 86_400) as i64;
    let seconds_of_day = unix_s % 86_400;
    // Howard Hinnant's civil-from-days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{millis:03}Z",
        seconds_of_day / 3600,
        seconds_of_day / 60 % 60,
        seconds_of_day % 60
    )
}

/// SGLang's utilization: the share of the running-request limit in use.
fn utilization(snapshot: &EngineSnapshot) -> f64 {
    if snapshot.max_running == 0 {
        0.0
    } else {
        f64::from(snapshot.running_requests) / f64::from(snapshot.max_running)
    }
}

/// A Prometheus sample value: `1.0`, `0.25`, `NaN`, `+Inf`.
fn prom_value(value: f64) -> String {
    if value.is_nan() {
        "NaN".to_owned()
    } else if value.is_infinite() {
        if value > 0.0 { "+Inf" } else { "-Inf" }.to_owned()
    } else if value.fract() == 0.0 && value.abs() < 1e15 {
        format!("{value:.1}")
    } else {
        format!("{value}")
    }
}

fn escape_label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn clamp_i64(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// Saturates a count into the `int32` fields of the gRPC load reports.
pub fn clamp_i32(value: u64) -> i32 {
    i32::try_from(value).unwrap_or(i32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn busy() -> EngineSnapshot {
        EngineSnapshot {
            running_requests: 12,
            waiting_requests: 3,
            queued_prefill_tokens: 5120,
            used_kv_tokens: 131_072,
            kv_capacity_tokens: 524_288,
            max_running: 256,
            decode_tps: 1840.5,
            cache_hit_rate: 0.25,
            prompt_tokens_total: 9000,
            generation_tokens_total: 700,
            ..EngineSnapshot::default()
        }
    }

    #[test]
    fn sglang_loads_round_trip_through_worker_load() {
        let body = serde_json::to_string(&sglang_loads(&busy(), rfc3339(0, 0))).unwrap();
        let load: load_protocols::WorkerLoad = serde_json::from_str(&body).unwrap();
        assert_eq!(load.queued_tokens(), Some(5120));
        assert_eq!(load.waiting_requests(), 3);
        assert_eq!(load.running_requests(), 12);
        assert_eq!(load.throughput_tps(), Some(1840.5));
        assert_eq!(load.kv_usage_ratio(), 0.25);
        assert!(body.contains("\"timestamp\":\"1970-01-01T00:00:00.000Z\""));
    }

    #[test]
    fn vllm_metrics_use_the_real_names_and_labels() {
        let text = vllm_metrics_text(&busy(), "m", 0);
        for line in [
            "# TYPE vllm:num_requests_running gauge",
            "vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 12.0",
            "vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 3.0",
            "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25",
            "# TYPE vllm:generation_tokens counter",
            "vllm:generation_tokens_total{engine=\"0\",model_name=\"m\"} 700.0",
            "vllm:prompt_tokens_total{engine=\"0\",model_name=\"m\"} 9000.0",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        assert!(!text.contains("uncached"));
        assert!(!text.contains("throughput"));
    }

    #[test]
    fn sglang_metrics_have_no_queued_tokens() {
        let text = sglang_metrics_text(&busy(), "m");
        assert!(text.contains("sglang:num_queue_reqs{model_name=\"m\"} 3.0"));
        assert!(text.contains("sglang:gen_throughput{model_name=\"m\"} 1840.5"));
        assert!(!text.contains("uncached"));
    }

    #[test]
    fn rfc3339_formats_known_dates() {
        assert_eq!(rfc3339(1_781_092_800, 5), "2026-06-10T12:00:00.005Z");
        assert_eq!(rfc3339(951_782_400, 0), "2000-02-29T00:00:00.000Z");
    }

    #[test]
    fn prometheus_values() {
        assert_eq!(prom_value(f64::NAN), "NaN");
        assert_eq!(prom_value(f64::INFINITY), "+Inf");
        assert_eq!(prom_value(3.0), "3.0");
        assert_eq!(prom_value(0.5), "0.5");
    }
}
