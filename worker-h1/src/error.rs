//! Why a request failed: before its response head ([`SendError`]), or
//! while its body was read ([`BodyError`]).

use std::time::Duration;

/// Why a request got no response head.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    #[error("cannot connect to {address}")]
    Connect {
        address: String,
        #[source]
        source: std::io::Error,
    },
    #[error("connecting to {address} took longer than {timeout:?}")]
    ConnectTimeout { address: String, timeout: Duration },
    /// The TLS handshake with an `https://` worker failed: its certificate
    /// is not trusted or does not name it, or the connection broke. The
    /// rustls error, when there is one, is the source's inner error.
    #[error("the TLS handshake with {address} failed")]
    Handshake {
        address: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the worker's URL cannot be used: {reason}")]
    UnusableUrl { reason: &'static str },
    #[error("the request could not be written")]
    Write(#[source] std::io::Error),
    #[error("the connection closed before any answer")]
    ClosedBeforeAnswer,
    #[error("the connection broke before the response head ended")]
    Read(#[source] std::io::Error),
    #[error("the response head is malformed: {0}")]
    BadHead(String),
}

/// Why a response body ended early.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("the connection broke")]
    Io(#[from] std::io::Error),
    #[error("the connection closed before the body ended")]
    Closed,
    #[error("the chunked body is malformed: {0}")]
    BadChunk(&'static str),
}
