//! The router: a load-aware router for LLM inference fleets, as a library.
//!
//! It holds no policy math. It reads layered config ([`config`]), keeps the
//! worker set with health checks, outlier ejection and probes, polls every
//! worker's load through the backends' `LoadSource`s, proxies OpenAI and
//! SGLang-native requests with unbuffered SSE streaming, and serves an
//! admin API, `/metrics`, `/health` and `/readiness`. With `[sync]` on,
//! replicas share their pending work and prefix placements through NATS.
//!
//! The public API is small: a [`RouterBuilder`] holds the policies and
//! backends ([`PolicyRegistry`], [`BackendRegistry`]; register your own),
//! loads and validates a [`RouterConfig`] from its [`Layers`], and starts
//! an [`App`], an opaque handle that [`serve`] serves until a shutdown
//! future ([`termination`]: SIGTERM or SIGINT) resolves.
//! [`RouterBuilder::run`] does all of it from a config, as the `router`
//! binary does (and, with `server.metrics_port` set, [`serve_metrics`] on
//! a second listener); the binary's command line is the `router-bin` crate.
//!
//! ```no_run
//! use router::RouterBuilder;
//! use router::config::{Layers, parse_worker_flag};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let builder = RouterBuilder::with_builtins();
//! let config = builder.load_config(Layers {
//!     workers: vec![parse_worker_flag("sglang=http://127.0.0.1:30000")?],
//!     ..Layers::default()
//! })?;
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! let app = builder.start(config, None).await?;
//! router::serve(app, listener, router::termination()).await?;
//! # Ok(())
//! # }
//! ```

mod admin;
mod admission;
mod app;
mod builder;
mod cached_tokens;
mod client_body;
pub mod config;
mod error;
mod metric_shards;
mod metrics;
mod migration;
mod monitor;
mod outlier;
mod probe;
mod proxy;
mod replica_sync;
mod server;
mod sse;
mod stream_usage;
mod telemetry;
mod topology;
mod upstream;
mod workers;

pub use app::App;
pub use builder::RouterBuilder;
pub use config::{Layers, RouterConfig, WorkerConfig, parse_worker_flag};
pub use error::{ConfigError, RouterError};
pub use policy_core::{AdmissionRegistry, BackendRegistry, PolicyRegistry};
pub use server::{serve, serve_metrics, termination};

/// A few internals, for this crate's benchmarks (`benches/`) only, behind
/// the `bench-internals` feature. Not an API: anything here may change or
/// go in any release.
#[cfg(feature = "bench-internals")]
#[doc(hidden)]
pub mod bench_internals {
    pub use crate::metrics::{Metrics, WorkerMetrics};
    pub use crate::replica_sync::prefix::{PrefixCounters, coalesce, receive_prefix};
    pub use crate::stream_usage::UsageChunkFilter;

    /// Replica sync's wire format: what the benchmarks encode.
    pub mod wire {
        pub use crate::replica_sync::wire::{MAX_MESSAGE_BYTES, Placement, encode_prefix};
    }
}
