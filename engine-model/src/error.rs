use thiserror::Error;

/// What an engine refuses: parameters out of range, or a request it cannot take.
#[derive(Debug, Error)]
pub enum EngineError {
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
}
