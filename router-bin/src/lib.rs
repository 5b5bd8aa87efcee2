//! The `router` binary's library: everything it composes, so tests can run a
//! real router in-process.
//!
//! It holds no policy math. It reads layered config ([`config`]), keeps the
//! worker registry with health checks ([`workers`], [`monitor`]), polls every
//! worker's load through the backends' `LoadSource`s, proxies OpenAI and
//! SGLang-native requests with unbuffered SSE streaming ([`proxy`]), and serves
//! an admin API, `/metrics`, `/health` and `/readiness` ([`server`]). With
//! `[sync]` on, replicas share their pending work through NATS
//! ([`replica_sync`]).
//!
//! The [`RouterBuilder`] is the router as a library: register policies and
//! backends of your own, then run exactly what the `router` binary runs.
//!
//! ```no_run
//! use router_bin::RouterBuilder;
//! use router_bin::config::{Layers, parse_worker_flag};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let builder = RouterBuilder::with_builtins();
//! let config = builder.load_config(Layers {
//!     workers: vec![parse_worker_flag("sglang=http://127.0.0.1:30000")?],
//!     ..Layers::default()
//! })?;
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! let app = builder.start(config, None).await?;
//! router_bin::server::serve(app, listener, router_bin::server::termination()).await?;
//! # Ok(())
//! # }
//! ```

pub mod admin;
pub mod app;
pub mod builder;
pub mod cached_tokens;
pub mod cli;
pub mod client_body;
pub mod config;
pub mod error;
pub mod metric_shards;
pub mod metrics;
pub mod monitor;
pub mod outlier;
pub mod probe;
pub mod proxy;
pub mod replica_sync;
pub mod server;
pub mod sse;
pub mod topology;
pub mod upstream;
pub mod workers;

pub use app::App;
pub use builder::RouterBuilder;
pub use config::RouterConfig;
pub use error::{ConfigError, RouterError};
