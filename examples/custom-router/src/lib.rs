//! An example of extending the router from a crate of your own: a backend
//! (`jsonstats`, an engine that reports load in a JSON shape of its own), a
//! policy (`least_kv`, with its own `[policy.least_kv]` knobs), and the
//! router binary built with both. Nothing in the router's crates knows them.
//!
//! - [`backend`]: the report type, its conversion into the router's
//!   validated `WorkerLoad`, the `LoadSource` that polls it, and
//!   [`register_backend`].
//! - [`policy`]: [`LeastKvPolicy`], its knobs, and [`register_policy`].
//! - [`engine`]: a stand-in `jsonstats` engine for tests and demos
//!   ([`serve_stats_engine`]).
//! - `src/main.rs`: the router binary with both added, in four lines.
//!
//! Add both to a [`RouterBuilder`] and the router accepts them in config
//! like the built-in ones, with the same validation:
//!
//! ```
//! use router::RouterBuilder;
//! use router::config::{Layers, parse_worker_flag};
//!
//! let mut builder = RouterBuilder::with_builtins();
//! custom_router::register(&mut builder);
//! let config = builder.load_config(Layers {
//!     workers: vec![parse_worker_flag("jsonstats=http://127.0.0.1:31001")?],
//!     overrides: vec![
//!         ("policy.kind".into(), "least_kv".into()),
//!         ("policy.least_kv.max_kv_usage_ratio".into(), 0.8.into()),
//!     ],
//!     ..Layers::default()
//! })?;
//! assert_eq!(config.workers[0].backend.as_deref(), Some("jsonstats"));
//! assert_eq!(config.policy.sections["least_kv"]["max_kv_usage_ratio"], 0.8);
//! assert_eq!(config.policy.sections["least_kv"]["pending_weight"], 1.0);
//! // From here: `builder.start(config, None)` and `router::serve`, or
//! // `router_bin::main(builder)` to run the router's whole command line.
//! # Ok::<(), router::ConfigError>(())
//! ```

pub mod backend;
pub mod engine;
pub mod policy;

pub use backend::{
    BACKEND_NAME, JsonStats, JsonStatsError, JsonStatsLoadSource, KvCacheStats, QueueStats,
    register_backend, worker_load_from_stats, worker_load_from_stats_json,
};
pub use engine::{STATS_ENGINE_MODEL, StatsEngine, serve_stats_engine};
pub use policy::{LeastKvParams, LeastKvPolicy, POLICY_NAME, register_policy};

use router::RouterBuilder;

/// Adds the `jsonstats` backend and the `least_kv` policy to `builder`.
pub fn register(builder: &mut RouterBuilder) {
    register_backend(builder.backends());
    register_policy(builder.policies());
}
