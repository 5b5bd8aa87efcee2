//! The continuous-batching engine model: one simulated inference engine as a
//! deterministic state machine, and its state as each real engine reports it.
//! No I/O: no sockets, no files, no sleeping, and the model never reads a clock. The mock servers (`mock-engines`)
//! drive it from the wall clock, the fleet simulator (`fleet-sim`) from its
//! event queue.
//!
//! - [`model`]: an [`Engine`] is one simulated replica (`docs/engine-model.md`):
//!   FIFO admission bounded by `max_running` and KV room, chunked prefill
//!   with a shared per-step budget, one decode token per running request,
//!   step time = max(prefill cost, decode cost), KV accounting with
//!   preemption (recompute) of the newest request, and an optional prefix
//!   cache (chained block hashes, LRU past a high watermark). It is a
//!   deterministic state machine advanced by its caller in explicit virtual
//!   time, so the simulator and the mock servers drive the same code.
//! - [`reports`]: the engine's true state as each real engine reports it
//!   (SGLang `/v1/loads` and `/metrics`, vLLM `/metrics`, gRPC fields).
//! - [`mix`] and [`SplitMix64`]: the one seeded generator and mixer behind
//!   every seed and hash of the model and the simulator, re-exported from
//!   `policy_core::splitmix` (the policies' tie-breaking and hash ring use
//!   the same one).
//!
//! ```
//! use engine_model::{Engine, EngineEvent, EngineParams, EngineRequest};
//!
//! let mut engine = Engine::new(EngineParams::default(), 7)?;
//! // Two 2048-token prompts at t = 0: each fills a whole prefill chunk.
//! for id in 0..2 {
//!     engine.submit(EngineRequest {
//!         id,
//!         prompt_tokens: 2048,
//!         output_tokens: 4,
//!         arrival_s: 0.0,
//!         prefix_block_hashes: Vec::new(),
//!     })?;
//! }
//! // The oracle's signal: uncached prefill work queued, in tokens.
//! assert_eq!(engine.queued_prefill_tokens(), 4096);
//!
//! let mut events = Vec::new();
//! while let Some(start_s) = engine.next_step_start_s() {
//!     engine.step(start_s, &mut events); // appends the step's events
//! }
//! let ttfts: Vec<f64> = events
//!     .iter()
//!     .filter_map(|event| match event {
//!         EngineEvent::Finished(record) => Some(record.ttft_s()),
//!         _ => None,
//!     })
//!     .collect();
//! // 2048 / 8000 tokens per second = 0.256 s per chunk: the second request
//! // waits for the first one's prefill.
//! assert!((ttfts[0] - 0.256).abs() < 1e-9);
//! assert!((ttfts[1] - 0.512).abs() < 1e-9);
//! # Ok::<(), engine_model::EngineError>(())
//! ```

mod error;
pub mod model;
mod prefix_cache;
pub mod reports;

pub use error::EngineError;
pub use model::{
    Engine, EngineEvent, EngineParams, EngineRequest, EngineSnapshot, RequestRecord, StepSummary,
    chain_block_hashes,
};
pub use policy_core::splitmix::{SplitMix64, mix};
