//! The router's HTTP/1.1 client to its workers: a pool of kept-alive
//! connections per worker, each request written with one vectored write,
//! and the response body read straight from the worker's socket by
//! whoever polls it. The router forwards generation requests with it, and
//! its HTTP load sources poll with it.
//!
//! ```no_run
//! use std::sync::Arc;
//! use std::time::Duration;
//!
//! use bytes::Bytes;
//! use http::{HeaderValue, Method, header};
//! use http_body_util::BodyExt;
//! use worker_h1::{HeaderLines, Outgoing, Pool};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! // One pool per worker, made once.
//! let pool = Arc::new(Pool::new("http://10.0.0.3:8000"));
//! let mut headers = HeaderLines::default();
//! headers.append(&header::CONTENT_TYPE, &HeaderValue::from_static("application/json"));
//! let body = Bytes::from_static(br#"{"model":"m","prompt":"hi","stream":true}"#);
//! let request = Outgoing {
//!     method: &Method::POST,
//!     path: "/v1/completions",
//!     query: None,
//!     headers: &headers,
//!     authorization: None,
//!     body: &body,
//! };
//! let mut response = worker_h1::send(&pool, &request, Duration::from_secs(1)).await?;
//! assert!(response.status.is_success());
//! // Each poll gives every byte of data that has arrived: here, the
//! // stream's events as they come.
//! while let Some(data) = std::future::poll_fn(|cx| response.body.poll_data(cx)).await {
//!     print!("{}", String::from_utf8_lossy(&data?));
//! }
//! // Read to its end, the connection went back to the pool for the next
//! // request; the body is an `http_body::Body` too.
//! let again = worker_h1::send(&pool, &request, Duration::from_secs(1)).await?;
//! let _whole = again.body.collect().await?.to_bytes();
//! # Ok(())
//! # }
//! ```
//!
//! hyper's pooled client runs every upstream connection in a task of its
//! own and hands each decoded body chunk to the response body through a
//! channel of one slot: an SSE event costs a task wake each way, and a
//! request a dispatch message, a pool checkout keyed by scheme and
//! authority, and a oneshot back. Here the task that sends the request
//! does it all itself, as nginx's one event loop does: it writes the
//! request head and body with one vectored write, reads and parses the
//! head, and its [`WorkerBody`] reads the socket when it is asked for the
//! next frame. Each read returns the data of every whole chunk that
//! arrived as one piece, so a burst of events costs one read and one write
//! to the client, and an event that arrives alone goes out at once.
//! `benches/client.rs` measures it against hyper's client
//! (`docs/performance.md`).
//!
//! Responses are read strictly (RFC 9112): the head as `head.rs` describes
//! (one unambiguous framing, or the head is refused), a chunked body as
//! `chunked.rs` does (CRLF line ends only, checked sizes, extensions and
//! trailers, bounded lines). `tests/differential.rs` holds both to hyper's
//! client over generated and broken responses.
//!
//! The pool keeps up to 1024 idle connections per worker, most recently
//! used first out, for 90 s from their last request.
//!
//! A worker's URL is `http://host[:port][/prefix]` or
//! `https://host[:port][/prefix]`. An `https://` worker is reached over TLS
//! 1.2 or 1.3 (rustls on ring), its certificate verified against a
//! [`WorkerTls`]: the system's roots ([`Pool::new`]) or a CA file's
//! certificates ([`Pool::with_tls`], [`WorkerTls::from_ca_file`]). The
//! server name is the URL's host (an IP literal is matched against the
//! certificate's IP addresses) and ALPN offers `http/1.1`. The handshake
//! happens within the connect timeout, and its failure is
//! [`SendError::Handshake`]. Over TLS the request is still handed over in
//! one vectored write and the body is read by whoever polls it; a plain
//! connection pays one branch per read and write for the choice.

mod body;
mod chunked;
mod error;
mod head;
mod headers;
mod io;
mod pool;
mod request;
mod tls;

pub use body::WorkerBody;
pub use error::{BodyError, SendError};
pub use headers::HeaderLines;
pub use pool::{Pool, wants_tls};
pub use request::{Outgoing, Response, send, send_at};
pub use tls::{SystemRootsError, TlsConfigError, WorkerTls};
