use std::sync::Arc;

/// How many prompt tokens the request being routed carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenCount {
    /// Known exactly (gRPC path, or the caller sent token ids).
    Exact(u64),
    /// Estimated from the prompt text (HTTP path: characters / chars-per-token).
    Estimated(u64),
    /// No text to measure.
    Unknown,
}

impl TokenCount {
    /// The count, or `fallback` (a policy's mean prompt size) when unknown.
    pub fn or(self, fallback: u64) -> u64 {
        match self {
            TokenCount::Exact(tokens) | TokenCount::Estimated(tokens) => tokens,
            TokenCount::Unknown => fallback,
        }
    }
}

/// What a policy knows of the request it routes.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestInfo {
    pub tokens: TokenCount,
    pub streaming: bool,
    pub model: Option<Arc<str>>,
}

impl RequestInfo {
    pub fn new(tokens: TokenCount) -> RequestInfo {
        RequestInfo {
            tokens,
            streaming: false,
            model: None,
        }
    }

    #[must_use]
    pub fn streaming(mut self, streaming: bool) -> RequestInfo {
        self.streaming = streaming;
        self
    }
}
