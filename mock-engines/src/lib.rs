//! Mock inference engines behind real sockets: each one runs an
//! [`engine_model::Engine`] in wall time and speaks one real engine's wire
//! format (SGLang, SGLang without `/v1/loads`, vLLM, TokenSpeed: load
//! endpoints over HTTP and gRPC, OpenAI and SGLang generation, SSE), with
//! fault modes switchable at run time, and a hard kill and restart. The
//! router's tests and `engine-sim serve` run them (`docs/engine-model.md`,
//! "The mock engine servers").
//!
//! ```
//! use mock_engines::{EngineSimError, FaultMode, Flavour, SimEngineConfig};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let runtime = tokio::runtime::Runtime::new()?;
//! runtime.block_on(async {
//!     // Two SGLang engines on free loopback ports, 100× faster than real time.
//!     let template = SimEngineConfig {
//!         time_scale: 100.0,
//!         ..SimEngineConfig::new(Flavour::Sglang)
//!     };
//!     let fleet = mock_engines::start_many(&template, 2).await?;
//!     for engine in fleet.engines() {
//!         // What a router is pointed at: http://127.0.0.1:PORT, grpc://127.0.0.1:PORT.
//!         assert!(engine.http_url().starts_with("http://127.0.0.1:"));
//!         assert!(engine.grpc_url().is_some());
//!     }
//!     // As `POST /control/fault {"mode": "hang-generation"}` would.
//!     fleet.set_fault(1, FaultMode::HangGeneration);
//!     assert_eq!(fleet.fault(1), Some(FaultMode::HangGeneration));
//!     // The engine's true state, which no load report shows whole.
//!     assert_eq!(fleet.snapshot(0).map(|state| state.running_requests), Some(0));
//!     fleet.shutdown().await;
//!     Ok::<(), EngineSimError>(())
//! })?;
//! # Ok(())
//! # }
//! ```

mod error;
mod server;

pub use error::EngineSimError;
pub use server::{
    ADMITTED_ID_MAX_BYTES, AdmittedRequestIds, FaultMode, Flavour, ServeMode, SimEngineAddr,
    SimEngineConfig, SimEngineStats, SimFleet, start, start_many,
};
