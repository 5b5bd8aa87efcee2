//! SGLang load sources: HTTP `/v1/loads`, gRPC `GetLoads` and the `/metrics`
//! fallback, each turning one worker's scheduler load into a
//! [`WorkerLoad`](load_protocols::WorkerLoad).
//!
//! - [`SglangHttpLoadSource`] (backend `sglang`): `GET /v1/loads?include=core`;
//!   on servers without it (404/405/501) it reads `/metrics` instead,
//!   remembers that, and re-probes `/v1/loads` every few polls.
//! - [`SglangGrpcLoadSource`] (backend `sglang-grpc`): `GetLoads` on
//!   `sglang.grpc.scheduler.SglangScheduler`, with the real
//!   `num_waiting_uncached_tokens` (field 17).
//! - Pure conversions, reused by anything that speaks these formats:
//!   [`worker_load_from_grpc`], [`worker_load_from_loads_json`],
//!   [`worker_load_from_metrics`] / [`worker_load_from_metrics_text`], and
//!   [`grpc_from_snapshot`] for servers.
//! - [`proto`]: the generated messages, client
//!   (`proto::sglang_scheduler_client::SglangSchedulerClient`) and server
//!   (`proto::sglang_scheduler_server::{SglangScheduler, SglangSchedulerServer}`).
//!
//! Register the backends by name and build a source for one worker:
//!
//! ```
//! use policy_core::{BackendRegistry, BackendSpec};
//!
//! let mut registry = BackendRegistry::new();
//! backends_sglang::register(&mut registry);
//! let http = registry.build("sglang", &BackendSpec::new("http://127.0.0.1:30000"))?;
//! assert_eq!(http.load_url(), "http://127.0.0.1:30000");
//! let grpc = registry.build(
//!     "sglang-grpc",
//!     &BackendSpec::new("http://127.0.0.1:30000").with_load_url("grpc://127.0.0.1:30001"),
//! )?;
//! assert_eq!(grpc.kind(), "sglang-grpc");
//! # Ok::<(), policy_core::BackendError>(())
//! ```
//!
//! A gRPC reply converts without any I/O; proto3 presence rules decide what was
//! reported:
//!
//! ```
//! use backends_sglang::{proto, worker_load_from_grpc};
//!
//! let reply = proto::GetLoadsResponse {
//!     loads: vec![proto::SchedulerLoad {
//!         num_waiting_reqs: 3,
//!         num_waiting_uncached_tokens: 5120,
//!         token_usage: 0.35,
//!         gen_throughput: 1840.5,
//!         ..Default::default()
//!     }],
//!     ..Default::default()
//! };
//! let load = worker_load_from_grpc(reply)?.expect("one rank");
//! assert_eq!(load.queued_tokens(), Some(5120));
//! assert_eq!(load.throughput_tps(), Some(1840.5));
//! # Ok::<(), load_protocols::LoadValidationError>(())
//! ```

mod convert;
mod error;
mod grpc;
mod http;
mod metrics;

use std::sync::Arc;

use policy_core::{BackendRegistry, LoadAddress, LoadSource};

pub use convert::{
    grpc_from_snapshot, snapshot_from_grpc, worker_load_from_grpc, worker_load_from_loads_json,
};
pub use error::MetricsError;
pub use grpc::{SglangGetLoads, SglangGrpcLoadSource};
pub use http::{DEFAULT_REPROBE_EVERY_POLLS, SglangHttpEndpoint, SglangHttpLoadSource};
pub use metrics::{METRIC_PREFIXES, worker_load_from_metrics, worker_load_from_metrics_text};

/// Code generated from `proto/sglang_scheduler.proto` (package
/// `sglang.grpc.scheduler`): messages, client and server.
#[allow(
    missing_docs,
    missing_debug_implementations,
    clippy::all,
    clippy::pedantic
)]
pub mod proto {
    tonic::include_proto!("sglang.grpc.scheduler");
}

/// Backend name of [`SglangHttpLoadSource`].
pub const HTTP_BACKEND: &str = "sglang";
/// Backend name of [`SglangGrpcLoadSource`].
pub const GRPC_BACKEND: &str = "sglang-grpc";

/// Registers `sglang` (HTTP with the `/metrics` fallback; the load address is
/// optional and defaults to the worker's URL, `http://` or `https://`) and
/// `sglang-grpc` (the load address is required, `grpc://host:port`).
pub fn register(registry: &mut BackendRegistry) {
    registry.register(HTTP_BACKEND, LoadAddress::Http, |spec| {
        let base = spec.load_url.as_deref().unwrap_or(&spec.worker_url);
        let source = SglangHttpLoadSource::new(base, &spec.options)?;
        Ok(Arc::new(source) as Arc<dyn LoadSource>)
    });
    SglangGrpcLoadSource::register(registry);
}

#[cfg(test)]
mod tests {
    use super::*;
    use policy_core::{BackendError, BackendSpec};

    #[tokio::test]
    async fn the_http_source_polls_the_load_url_when_given() {
        let mut registry = BackendRegistry::new();
        register(&mut registry);
        let build = |spec: BackendSpec| registry.build(HTTP_BACKEND, &spec);
        let source = build(BackendSpec::new("http://127.0.0.1:30000/")).unwrap();
        assert_eq!(source.load_url(), "http://127.0.0.1:30000");
        let source = build(BackendSpec::new("http://w:1").with_load_url("http://m:2")).unwrap();
        assert_eq!(source.load_url(), "http://m:2");
        // An https:// worker is polled over TLS, with the CA file it names.
        let mut tls_spec = BackendSpec::new("https://w:1");
        tls_spec.options.ca_file =
            Some(std::env::temp_dir().join("backends-sglang-no-such-ca.pem"));
        assert!(
            matches!(build(tls_spec), Err(BackendError::Client { .. })),
            "a CA file that cannot be read fails the build"
        );
        for bad in ["127.0.0.1:30000", "ftp://w:1", "http://w:1/?x=1"] {
            assert!(
                matches!(
                    build(BackendSpec::new(bad)),
                    Err(BackendError::InvalidAddress { .. })
                ),
                "{bad}"
            );
        }
    }
}
