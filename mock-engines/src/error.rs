use std::net::SocketAddr;

use engine_model::EngineError;
use thiserror::Error;

/// Everything that can go wrong starting and running the mock servers,
/// including an engine refusing its parameters or a request.
#[derive(Debug, Error)]
pub enum EngineSimError {
    /// An engine refused its parameters or a request.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// A flavour name that is not one of `sglang`, `sglang-metrics`, `vllm`, `tokenspeed`.
    #[error("unknown engine flavour {name:?}")]
    UnknownFlavour { name: String },
    /// A fault-mode name that is not one of the documented modes.
    #[error("unknown fault mode {name:?}")]
    UnknownFault { name: String },
    /// A mode name that is not `model` or `canned`.
    #[error("unknown serving mode {name:?}")]
    UnknownMode { name: String },
    /// A flavour that needs a gRPC port was started without one.
    #[error("flavour {flavour} needs a grpc port")]
    MissingGrpcPort { flavour: &'static str },
    /// A flavour that has no gRPC service was given a gRPC port.
    #[error("flavour {flavour} serves no grpc")]
    UnexpectedGrpcPort { flavour: &'static str },
    /// The time-scale factor must be finite and positive.
    #[error("time scale must be finite and positive, got {time_scale}")]
    InvalidTimeScale { time_scale: f64 },
    /// A port computed from a base port and an index does not fit in 16 bits.
    #[error("port {base} + {index} is out of range")]
    PortOutOfRange { base: u16, index: usize },
    /// A fleet has no engine at this index.
    #[error("no engine {index} in the fleet")]
    NoSuchEngine { index: usize },
    /// A listener could not be bound.
    #[error("could not bind {addr}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    /// Other I/O failures (signals, local addresses, stdout).
    #[error("i/o error")]
    Io(#[from] std::io::Error),
    /// A JSON encoding failure.
    #[error("json encoding failed")]
    Json(#[from] serde_json::Error),
}
