//! The load report every backend is adapted into.
//!
//! A [`SchedulerLoadSnapshot`] is one DP rank's scheduler load, shaped like
//! SGLang's `GET /v1/loads` (other engines' reports are converted into it). A
//! [`WorkerLoad`] holds every rank of one worker after validation, with the
//! aggregates a routing policy needs. The two signals that not every engine
//! reports, queued uncached tokens and generation throughput, are `Option`s, so
//! "reported 0" and "not reported" stay apart.
//!
//! ```
//! use load_protocols::WorkerLoad;
//!
//! let body = r#"{"timestamp": "", "dp_rank_count": 2, "loads": [
//!     {"dp_rank": 0, "num_waiting_reqs": 3, "num_waiting_uncached_tokens": 5120,
//!      "token_usage": 0.3, "gen_throughput": 1800.0},
//!     {"dp_rank": 1, "num_waiting_reqs": 1, "num_waiting_uncached_tokens": 0,
//!      "token_usage": 0.5, "gen_throughput": 1700.0}]}"#;
//! let load: WorkerLoad = serde_json::from_str(body)?;
//! assert_eq!(load.queued_tokens(), Some(5120));
//! assert_eq!(load.waiting_requests(), 4);
//! assert_eq!(load.throughput_tps(), Some(3500.0));
//! assert!((load.kv_usage_ratio() - 0.4).abs() < 1e-12);
//! # Ok::<(), serde_json::Error>(())
//! ```
//!
//! [`parse_prometheus_text`] reads the Prometheus text exposition format, for
//! engines whose load is only published on `/metrics`.
//!
//! This crate does no I/O.

mod error;
mod prometheus;
mod snapshot;
mod worker_load;

pub use error::{LoadValidationError, PrometheusParseError, PrometheusParseReason};
pub use prometheus::{Sample, parse_prometheus_text};
pub use snapshot::{
    AggregateMetrics, LoadsResponse, SchedulerLoadSnapshot, proto3_count,
    queued_tokens_from_proto3, throughput_from_proto3,
};
pub use worker_load::WorkerLoad;
