//! vLLM load sources: Prometheus `/metrics` and gRPC `GetLoads`.
//!
//! Two [`LoadSource`]s report a vLLM server's
//! scheduler load as a [`WorkerLoad`](load_protocols::WorkerLoad):
//!
//! - [`VllmMetricsLoadSource`] (backend `vllm`) reads stock vLLM's
//!   `GET /metrics`: running and waiting requests summed over the `engine`
//!   series, KV usage from `vllm:kv_cache_usage_perc` (or the older
//!   `vllm:gpu_cache_usage_perc`) averaged, and throughput as the rate of
//!   `vllm:generation_tokens_total` between two polls.
//! - [`VllmGrpcLoadSource`] (backend `vllm-grpc`) calls
//!   `vllm.grpc.engine.VllmEngine/GetLoads` at a `grpc://host:port` address.
//!
//! vLLM reports no queued-token count, so both leave it "not reported" and
//! the policy estimates the queue from waiting requests. The conversions are
//! pure and public ([`VllmMetricsConverter`], [`GenerationRate`],
//! [`worker_load_from_grpc`]); [`proto`] holds the generated client and
//! server, which the engine simulator serves.
//!
//! ```
//! use std::time::Instant;
//! use backends_vllm::VllmMetricsConverter;
//! use policy_core::{BackendRegistry, BackendSpec};
//!
//! // Build sources by name, as the router does from its config.
//! let mut registry = BackendRegistry::new();
//! backends_vllm::register(&mut registry);
//! let source = registry.build("vllm", &BackendSpec::new("http://127.0.0.1:8000"))?;
//! assert_eq!(source.load_url(), "http://127.0.0.1:8000/metrics");
//! assert!(registry.build("vllm-grpc", &BackendSpec::new("http://127.0.0.1:8000")).is_err());
//!
//! // The conversion on its own: two engines (DP ranks) of one server.
//! let text = "\
//! ## TYPE vllm:num_requests_waiting gauge
//! vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 3.0
//! vllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 1.0
//! vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 8.0
//! vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 6.0
//! vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.5
//! vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.3
//! ";
//! let load = VllmMetricsConverter::new().convert_text(text, Instant::now())?;
//! assert_eq!(load.waiting_requests(), 4);
//! assert_eq!(load.running_requests(), 14);
//! assert!((load.kv_usage_ratio() - 0.4).abs() < 1e-12);
//! assert_eq!(load.queued_tokens(), None);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod error;
mod grpc;
mod http;
mod metrics;

/// Code generated from `proto/vllm_engine.proto` (package
/// `vllm.grpc.engine`): the messages, the client
/// (`vllm_engine_client::VllmEngineClient`) and the server
/// (`vllm_engine_server::{VllmEngine, VllmEngineServer}`).
#[allow(missing_debug_implementations, clippy::all, clippy::pedantic)]
pub mod proto {
    tonic::include_proto!("vllm.grpc.engine");
}

use std::sync::Arc;

use policy_core::{BackendRegistry, LoadAddress, LoadSource};

pub use error::VllmMetricsError;
pub use grpc::{
    GRPC_KIND, VllmGetLoads, VllmGrpcLoadSource, snapshot_from_grpc, worker_load_from_grpc,
};
pub use http::{METRICS_KIND, VllmMetricsLoadSource};
pub use metrics::{
    ENGINE_LABEL, GENERATION_TOKENS, GENERATION_TOKENS_TOTAL, GPU_CACHE_USAGE_PERC,
    GPU_PREFIX_CACHE_HIT_RATE, GenerationRate, KV_CACHE_USAGE_PERC, NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING, PREFIX_CACHE_HITS_TOTAL, PREFIX_CACHE_QUERIES_TOTAL, VllmEngineSeries,
    VllmMetricsConverter, engine_series, snapshot_from_engine,
};

/// Registers `vllm` (Prometheus `/metrics` over HTTP, at the load URL or
/// else the worker URL) and `vllm-grpc` (`GetLoads` at the load URL, which
/// must be `grpc://host:port`).
pub fn register(registry: &mut BackendRegistry) {
    registry.register(METRICS_KIND, LoadAddress::Http, |spec| {
        VllmMetricsLoadSource::new(spec).map(|source| Arc::new(source) as Arc<dyn LoadSource>)
    });
    VllmGrpcLoadSource::register(registry);
}
