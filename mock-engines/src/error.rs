use std::net::SocketAddr;

use thiserror::Error;

/// Everything that can go wrong in this crate: building an engine, submitting
/// to it, or starting and running the mock servers.
#[derive(Debug, Error)]
pub enum EngineSimError {
    /// An engine parameter is out of its range.
    #[error("invalid engine parameter {name}: {value} ({rule})")]
    InvalidParam {
        name: &'static str,
        value: f64,
        rule: &'static str,
    },
    /// A request that could never fit in the KV cache, even alone.
    #[error("request {id} needs {needed_tokens} kv tokens but the engine holds {capacity_tokens}")]
    RequestTooLarge {
        id: u64,
        needed_tokens: u64,
        capacity_tokens: u64,
    },
    /// A request id that is already queued or running.
    #[error("request {id} is already in the engine")]
    DuplicateRequest { id: u64 },
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
    /// A command-line argument or the target it names is unusable.
    #[error("{name}: {reason}")]
    InvalidArgument { name: &'static str, reason: String },
    /// A JSON encoding failure.
    #[error("json encoding failed")]
    Json(#[from] serde_json::Error),
}
