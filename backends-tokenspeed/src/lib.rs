//! TokenSpeed load source over gRPC `GetLoads`, turning one worker's scheduler
//! load into a [`WorkerLoad`](load_protocols::WorkerLoad).
//!
//! - [`TokenspeedGrpcLoadSource`] (backend `tokenspeed`): `GetLoads` on
//!   `tokenspeed.grpc.scheduler.TokenSpeedScheduler`, with TokenSpeed's own
//!   field numbering (`token_usage` is 8, `num_waiting_uncached_tokens` 14).
//!   An empty `loads` list or `DEADLINE_EXCEEDED` is `Ok(None)`, "no report
//!   this time".
//! - Pure conversions: [`worker_load_from_grpc`], [`snapshot_from_grpc`], and
//!   [`grpc_from_snapshot`] for servers.
//! - [`proto`]: the generated messages, client
//!   (`proto::token_speed_scheduler_client::TokenSpeedSchedulerClient`) and
//!   server (`proto::token_speed_scheduler_server::{TokenSpeedScheduler,
//!   TokenSpeedSchedulerServer}`).
//!
//! Released TokenSpeed servers report neither queued tokens nor throughput:
//! by the proto3 presence rules both come out "not reported", and the policy
//! estimates the queue from waiting requests.
//!
//! ```
//! use backends_tokenspeed::{proto, worker_load_from_grpc};
//! use policy_core::{BackendRegistry, BackendSpec};
//!
//! let mut registry = BackendRegistry::new();
//! backends_tokenspeed::register(&mut registry);
//! let spec = BackendSpec::new("http://10.0.0.2:8000").with_load_url("grpc://10.0.0.2:19000");
//! let source = registry.build("tokenspeed", &spec)?;
//! assert_eq!(source.load_url(), "grpc://10.0.0.2:19000");
//!
//! // What a released server sends: no queued tokens, no throughput.
//! let reply = proto::GetLoadsResponse {
//!     loads: vec![proto::SchedulerLoad {
//!         num_running_reqs: 8,
//!         num_waiting_reqs: 2,
//!         token_usage: 0.4,
//!         ..Default::default()
//!     }],
//!     ..Default::default()
//! };
//! let load = worker_load_from_grpc(reply).unwrap().expect("one rank");
//! assert_eq!(load.waiting_requests(), 2);
//! assert_eq!(load.queued_tokens(), None);
//! assert_eq!(load.throughput_tps(), None);
//! # Ok::<(), policy_core::BackendError>(())
//! ```

mod convert;
mod grpc;

use policy_core::BackendRegistry;

pub use convert::{grpc_from_snapshot, snapshot_from_grpc, worker_load_from_grpc};
pub use grpc::{TokenspeedGetLoads, TokenspeedGrpcLoadSource};

/// Code generated from `proto/tokenspeed_scheduler.proto` (package
/// `tokenspeed.grpc.scheduler`): messages, client and server.
#[allow(
    missing_docs,
    missing_debug_implementations,
    clippy::all,
    clippy::pedantic
)]
pub mod proto {
    tonic::include_proto!("tokenspeed.grpc.scheduler");
}

/// Backend name of [`TokenspeedGrpcLoadSource`].
pub const BACKEND: &str = "tokenspeed";

/// Registers `tokenspeed`: the load address is required, `grpc://host:port`.
pub fn register(registry: &mut BackendRegistry) {
    TokenspeedGrpcLoadSource::register(registry);
}
