use std::time::Duration;

use load_protocols::LoadValidationError;
use thiserror::Error;

/// A boxed error kept as a source, so that no error is stringified to be stored.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why one load poll failed. The worker stays in rotation; the policy is told
/// through `poll_failed` and scores it without a fresh snapshot.
#[derive(Debug, Error)]
pub enum LoadError {
    /// The connection could not be made (refused, reset, DNS).
    #[error("could not connect to {url}")]
    Connect {
        url: String,
        #[source]
        source: BoxError,
    },
    /// No complete answer within the deadline.
    #[error("no load report from {url} within {deadline:?}")]
    Timeout { url: String, deadline: Duration },
    /// An HTTP status other than 200.
    #[error("{url} answered HTTP {status}")]
    HttpStatus { url: String, status: u16 },
    /// The server does not offer this kind of load report (HTTP 404/405/501,
    /// gRPC `UNIMPLEMENTED`).
    #[error("{url} does not serve {what}")]
    Unsupported { url: String, what: &'static str },
    /// The body was larger than the configured cap.
    #[error("load report from {url} exceeds {limit_bytes} bytes")]
    BodyTooLarge { url: String, limit_bytes: usize },
    /// The body's content type was not the one the format needs.
    #[error("{url} sent content type {content_type:?}, expected {expected}")]
    ContentType {
        url: String,
        content_type: String,
        expected: &'static str,
    },
    /// The body could not be decoded (malformed or truncated JSON, bad text).
    #[error("could not decode the load report from {url}")]
    Decode {
        url: String,
        #[source]
        source: BoxError,
    },
    /// The report decoded but held impossible values.
    #[error("invalid load report from {url}")]
    Invalid {
        url: String,
        #[source]
        source: LoadValidationError,
    },
    /// A gRPC call failed with a status other than the ones above.
    #[error("gRPC load call to {url} failed")]
    Grpc {
        url: String,
        #[source]
        source: BoxError,
    },
    /// Any other transport failure.
    #[error("transport error talking to {url}")]
    Transport {
        url: String,
        #[source]
        source: BoxError,
    },
}

/// Why a policy could not be built from its config section.
#[derive(Debug, Error)]
pub enum PolicyError {
    #[error("unknown policy {name:?}; valid policies: {valid}")]
    UnknownPolicy { name: String, valid: String },
    #[error("unknown admission order {name:?}; valid orders: {valid}")]
    UnknownAdmission { name: String, valid: String },
    #[error("invalid [{policy}] section")]
    InvalidSection {
        policy: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("{policy}.{key} = {value} is invalid: must be {allowed}")]
    InvalidParameter {
        policy: String,
        key: &'static str,
        value: String,
        allowed: &'static str,
    },
}

/// Why a backend's load source could not be built.
#[derive(Debug, Error)]
pub enum BackendError {
    #[error("unknown backend {name:?}; valid backends: {valid}")]
    UnknownBackend { name: String, valid: String },
    #[error("invalid address {url:?}: {reason}")]
    InvalidAddress { url: String, reason: &'static str },
    #[error("backend {backend} needs a separate load address (loads=grpc://host:port)")]
    MissingLoadUrl { backend: String },
    #[error("could not build the client for {url}")]
    Client {
        url: String,
        #[source]
        source: BoxError,
    },
}

/// An error and its sources, joined, for one log line: `could not connect
/// to http://h:1: Connection refused`. The error types here keep their
/// causes as sources rather than in their messages, so a log line that
/// printed only the top would lose them.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chain_joins_every_source() {
        let refused = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let error = LoadError::Connect {
            url: "http://h:1".into(),
            source: refused.into(),
        };
        assert_eq!(
            error_chain(&error),
            "could not connect to http://h:1: refused"
        );
    }
}
