//! The flavour's load endpoints over HTTP (SGLang `/v1/loads` and
//! `/metrics`, vLLM `/metrics`), TokenSpeed's `/metrics` (counters only, no
//! load gauges), and the load faults they answer with.
//!
//! Every `/metrics` also carries the engine's cumulative request, prompt-token
//! and prefix-cache counters under the real engine's names, so a client can
//! read each engine's cache hit rate: SGLang's `prompt_tokens_total`,
//! `cached_tokens_total` and `num_requests_total` (next to its
//! `cache_hit_rate` gauge), vLLM's `prefix_cache_queries_total`,
//! `prefix_cache_hits_total` and `request_success_total`, TokenSpeed's
//! `prompt_tokens_total` and `num_requests_total` (and a
//! `cached_tokens_total` of the mock's own, named as SGLang's).

use std::fmt::Write as _;

use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::{Response, StatusCode};
use engine_model::{EngineSnapshot, reports};
use serde::Deserialize;

use super::FaultMode;
use super::http::{Shared, error_response, text_response};

const PROMETHEUS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Applies the load-endpoint faults; `Err` is the response to send instead.
async fn load_fault(shared: &Shared) -> Result<FaultMode, Response<Body>> {
    let fault = shared.fault();
    match fault {
        FaultMode::SlowLoads => {
            tokio::select! {
                () = tokio::time::sleep(shared.config.slow_loads_delay) => {}
                () = shared.stopped() => {
                    return Err(error_response(StatusCode::SERVICE_UNAVAILABLE, "shutting down"));
                }
            }
            Ok(fault)
        }
        FaultMode::Loads500 => Err(error_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal error (fault mode loads-500)",
        )),
        other => Ok(other),
    }
}

#[derive(Debug, Deserialize, Default)]
#[serde(default)]
pub(super) struct LoadsQuery {
    format: Option<String>,
    dp_rank: Option<i64>,
}

pub(super) async fn sglang_loads(
    State(shared): State<Shared>,
    query: Query<LoadsQuery>,
) -> Response<Body> {
    let fault = match load_fault(&shared).await {
        Ok(fault) => fault,
        Err(response) => return response,
    };
    let snapshot = shared.snapshot();
    if query.format.as_deref() == Some("prometheus") {
        return metrics_response(fault, sglang_metrics_body(&shared, &snapshot, fault));
    }
    match fault {
        FaultMode::MalformedLoads => {
            return text_response(
                "application/json",
                "{\"timestamp\": \"\", \"loads\": [{\"dp_rank\": 0, \"num_running_reqs\": \"many\", "
                    .to_owned(),
            );
        }
        FaultMode::NanLoads => {
            return text_response("application/json", nan_loads_body(&snapshot));
        }
        _ => {}
    }
    let mut body = reports::sglang_loads(&snapshot, reports::rfc3339_now());
    if let Some(rank) = query.dp_rank {
        body.loads.retain(|load| load.dp_rank == rank);
    }
    match serde_json::to_string(&body) {
        Ok(text) => text_response("application/json", text),
        Err(_) => error_response(StatusCode::INTERNAL_SERVER_ERROR, "encoding failed"),
    }
}

/// The SGLang body with bare `NaN` literals (what Python's `json` writes).
fn nan_loads_body(snapshot: &EngineSnapshot) -> String {
    let rank = reports::sglang_rank(snapshot);
    format!(
        "{{\"timestamp\": \"{}\", \"version\": \"{}\", \"dp_rank_count\": 1, \"loads\": [{{\
         \"dp_rank\": 0, \"num_running_reqs\": {}, \"num_waiting_reqs\": {}, \
         \"num_waiting_uncached_tokens\": {}, \"num_total_reqs\": {}, \"num_used_tokens\": {}, \
         \"max_total_num_tokens\": {}, \"token_usage\": NaN, \"gen_throughput\": NaN, \
         \"cache_hit_rate\": NaN, \"utilization\": NaN, \"max_running_requests\": {}}}]}}",
        reports::rfc3339_now(),
        reports::SIM_VERSION,
        rank.num_running_reqs,
        rank.num_waiting_reqs,
        rank.num_waiting_uncached_tokens.unwrap_or(0),
        rank.num_total_reqs,
        rank.num_used_tokens,
        rank.max_total_num_tokens,
        rank.max_running_requests,
    )
}

pub(super) async fn sglang_metrics(State(shared): State<Shared>) -> Response<Body> {
    let fault = match load_fault(&shared).await {
        Ok(fault) => fault,
        Err(response) => return response,
    };
    let snapshot = shared.snapshot();
    let mut text = sglang_metrics_body(&shared, &snapshot, fault);
    sglang_counters(&mut text, "sglang", &shared, &snapshot);
    metrics_response(fault, text)
}

/// TokenSpeed's `/metrics`: its tokenizer counters (`tokenspeed:` prefix, as
/// SGLang's), no load gauges (its load report is gRPC). Real TokenSpeed has
/// no cached-token counter; this one adds `tokenspeed:cached_tokens_total`,
/// named as SGLang's, so every flavour shows its cache hits.
pub(super) async fn tokenspeed_metrics(State(shared): State<Shared>) -> Response<Body> {
    let fault = match load_fault(&shared).await {
        Ok(fault) => fault,
        Err(response) => return response,
    };
    let snapshot = shared.snapshot();
    let mut text = String::with_capacity(1024);
    sglang_counters(&mut text, "tokenspeed", &shared, &snapshot);
    metrics_response(fault, text)
}

/// The request and token counters SGLang's tokenizer manager exports (and
/// TokenSpeed's, under its own prefix), labelled `model_name`. `# TYPE`
/// lines omit `_total`, as Python's `prometheus_client` writes them.
fn sglang_counters(out: &mut String, prefix: &str, shared: &Shared, snapshot: &EngineSnapshot) {
    let labels = format!("model_name=\"{}\"", escape_label(&shared.config.model_name));
    let (length, stop) = shared.finished.get();
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
            "cached_tokens",
            "Number of cached prompt tokens.",
            snapshot.prefix_cache_hits_tokens_total,
        ),
        (
            "num_requests",
            "Number of requests processed.",
            length + stop,
        ),
    ];
    for (name, help, value) in counters {
        let _ = writeln!(out, "# HELP {prefix}:{name}_total {help}");
        let _ = writeln!(out, "# TYPE {prefix}:{name} counter");
        let _ = writeln!(out, "{prefix}:{name}_total{{{labels}}} {value}.0");
    }
}

/// vLLM V1's finished-request counter, one series per finish reason (its
/// prefix-cache query and hit counters come with the engine model's text).
fn vllm_request_success(out: &mut String, shared: &Shared) {
    let model = escape_label(&shared.config.model_name);
    let (length, stop) = shared.finished.get();
    let _ = writeln!(
        out,
        "# HELP vllm:request_success_total Count of successfully processed requests."
    );
    let _ = writeln!(out, "# TYPE vllm:request_success counter");
    for (reason, value) in [("length", length), ("stop", stop)] {
        let _ = writeln!(
            out,
            "vllm:request_success_total{{engine=\"0\",finished_reason=\"{reason}\",model_name=\"{model}\"}} {value}.0"
        );
    }
}

/// A Prometheus label value with `\\`, `"` and newlines escaped.
fn escape_label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn sglang_metrics_body(shared: &Shared, snapshot: &EngineSnapshot, fault: FaultMode) -> String {
    match fault {
        FaultMode::NanLoads => {
            let nan = EngineSnapshot {
                decode_tps: f64::NAN,
                cache_hit_rate: f64::NAN,
                ..*snapshot
            };
            // token_usage is derived; rewrite its sample by hand.
            reports::sglang_metrics_text(&nan, &shared.config.model_name)
                .lines()
                .map(|line| nan_sample(line, "sglang:token_usage{"))
                .collect::<Vec<_>>()
                .join("\n")
                + "\n"
        }
        _ => reports::sglang_metrics_text(snapshot, &shared.config.model_name),
    }
}

pub(super) async fn vllm_metrics(State(shared): State<Shared>) -> Response<Body> {
    let fault = match load_fault(&shared).await {
        Ok(fault) => fault,
        Err(response) => return response,
    };
    let snapshot = shared.snapshot();
    let mut text = reports::vllm_metrics_text(&snapshot, &shared.config.model_name, 0);
    vllm_request_success(&mut text, &shared);
    let text = match fault {
        FaultMode::NanLoads => {
            text.lines()
                .map(|line| nan_sample(line, "vllm:kv_cache_usage_perc{"))
                .collect::<Vec<_>>()
                .join("\n")
                + "\n"
        }
        _ => text,
    };
    metrics_response(fault, text)
}

/// Replaces the value of the sample line starting with `prefix` by `NaN`.
fn nan_sample(line: &str, prefix: &str) -> String {
    match (line.starts_with(prefix), line.rfind(' ')) {
        (true, Some(space)) => format!("{} NaN", &line[..space]),
        _ => line.to_owned(),
    }
}

fn metrics_response(fault: FaultMode, text: String) -> Response<Body> {
    if fault == FaultMode::MalformedLoads {
        return text_response(
            PROMETHEUS_CONTENT_TYPE,
            "# TYPE broken gauge\nvllm:num_requests_running{engine=\"0\" 3 x\n\
             sglang:num_running_reqs{{{ not a number\n\u{0}\u{1}garbage"
                .to_owned(),
        );
    }
    text_response(PROMETHEUS_CONTENT_TYPE, text)
}
