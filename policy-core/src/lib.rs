//! The two traits a load-aware router is built from, and the baseline policies
//! (`round_robin`, `random`, `least_requests`, and the prefix-aware
//! `cache_aware` and `consistent_hash`).
//!
//! - [`LoadSource`]: how one worker's load is fetched (async, I/O at the edge).
//! - [`Policy`]: how a worker is chosen for each request (sync, no I/O, the
//!   caller passes `now`, so the router and the simulator drive the same code).
//!
//! Workers are addressed by a generation-tagged [`WorkerId`]. `select` returns
//! a small [`Dispatch`]; the router wraps it in a [`DispatchGuard`] that
//! finishes it on drop. Policies and backends are built by name from config
//! through a [`PolicyRegistry`] and a [`BackendRegistry`]. Other router
//! replicas' pending work reaches a policy as [`ReplicaPending`] entries,
//! keyed by worker URL ([`Policy::replica_pending`]); where they placed
//! prompt prefixes, what engines reported of their caches and the prefill
//! rates they measured, as [`ReplicaUpdate`]s ([`Policy::replica_update`]).
//! When the fleet is saturated, an [`Admission`] order decides which waiting
//! request goes next (built by name through an [`AdmissionRegistry`]).
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Instant;
//! use policy_core::{
//!     DispatchGuard, Policy, PolicyContext, PolicyRegistry, RequestInfo, TokenCount, WorkerId,
//!     WorkerInfo,
//! };
//!
//! let registry = PolicyRegistry::with_baselines();
//! let policy: Arc<dyn Policy> =
//!     registry.build("round_robin", &serde_json::json!({}), &PolicyContext::default())?.into();
//! let worker = WorkerId::new(0, 0);
//! policy.add_worker(worker, WorkerInfo::new("http://127.0.0.1:30000", "sglang"));
//!
//! let request = RequestInfo::new(TokenCount::Estimated(512)).streaming(true);
//! let dispatch = policy.select(&[worker], &request, Instant::now()).expect("one worker");
//! {
//!     let mut guard = DispatchGuard::new(policy.clone(), dispatch);
//!     assert_eq!(policy.worker_stats(worker).unwrap().pending_tokens, 512);
//!     guard.first_token(); // the first SSE chunk passed through
//!     assert_eq!(policy.worker_stats(worker).unwrap().pending_tokens, 0);
//! } // the response ended: the guard finishes the dispatch
//! assert_eq!(policy.worker_stats(worker).unwrap().in_flight_requests, 0);
//! # Ok::<(), policy_core::PolicyError>(())
//! ```
//!
//! With the `mocks` feature, `MockLoadSource` and `MockPolicy` (mockall) are
//! exported for other crates' tests. The clients load sources fetch with
//! (HTTP, gRPC) are the `load-transport` crate's. [`splitmix`] is the one
//! SplitMix64 generator and mixer of the workspace (tie-breaking, the
//! consistent-hash ring, the engine model and the simulators).

mod admission;
mod baseline;
mod cache_aware;
mod consistent_hash;
mod dispatch;
mod error;
mod load_source;
mod policy;
mod poll;
mod registry;
mod replica;
mod request;
mod rng;
mod score_table;
mod slots;
pub mod splitmix;
#[cfg(test)]
mod test_support;
mod worker;

pub use admission::{Admission, AdmissionFactory, AdmissionRegistry, FlowView, Waiting};
pub use baseline::{BaselineKind, BaselineParams, BaselinePolicy, describe_request};
pub use cache_aware::{CACHE_AWARE, CacheAwareParams, CacheAwarePolicy};
pub use consistent_hash::{
    CONSISTENT_HASH, ConsistentHashParams, ConsistentHashPolicy, MAX_VIRTUAL_NODES,
};
pub use dispatch::{Clock, Dispatch, DispatchGuard, PollMark, tokio_now};
pub use error::{BackendError, BoxError, LoadError, PolicyError, error_chain};
#[cfg(any(test, feature = "mocks"))]
pub use load_source::MockLoadSource;
pub use load_source::{BackendSpec, LoadSource, SourceOptions};
#[cfg(any(test, feature = "mocks"))]
pub use policy::MockPolicy;
pub use policy::{ExpectedWait, Policy, PolicyContext, WorkerStats};
pub use poll::{PollOutcome, poll_worker, prime_worker};
pub use registry::{
    BackendFactory, BackendRegistry, LoadAddress, PolicyFactory, PolicyRegistry, parse_section,
};
pub use replica::{
    PrefillSample, PrefixSnapshot, ReplicaPending, ReplicaPendingOutcome, ReplicaUpdate,
    ReplicaUpdateOutcome, SnapshotBlock, SnapshotWorker, worker_url_key,
};
pub use request::{PrefixBlocks, RequestInfo, TokenCount};
pub use rng::{ArgMin, RankKey, TieBreaker};
pub use score_table::{ScoreRow, ScoreTable, format_value};
pub use slots::{SeqHasher, Slot, SlotsView, WorkerLedger, WorkerSlots};
pub use worker::{ParseWorkerIdError, WorkerId, WorkerIdAllocator, WorkerInfo};
