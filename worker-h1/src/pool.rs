//! A worker's address, and its pool of kept-alive connections.

use std::time::{Duration, Instant};

use bytes::BytesMut;
use http::HeaderValue;
use parking_lot::Mutex;
use tokio::net::TcpStream;

use crate::SendError;

/// How long an idle connection stays in the pool: as long as hyper's client
/// keeps one.
const IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// Most idle connections a worker keeps.
const MAX_IDLE_PER_WORKER: usize = 1024;
/// A connection whose buffer grew past this goes back to the pool with a
/// fresh one.
const MAX_POOLED_BUFFER: usize = 256 * 1024;

/// Where a worker is, split once: what every request to it reuses.
#[derive(Debug)]
pub(crate) struct Target {
    /// `host` and `port` to connect to (an IPv6 literal without brackets).
    host: String,
    port: u16,
    /// The `Host` header: the URL's authority.
    pub(crate) host_header: HeaderValue,
    /// A path the worker sits behind (`/engine-a`), without a trailing
    /// slash; usually empty.
    pub(crate) path_prefix: String,
}

impl Target {
    /// `None` unless `url` is `http://host[:port][/prefix]`.
    pub(crate) fn parse(url: &str) -> Option<Target> {
        let uri: http::Uri = url.parse().ok()?;
        if uri.scheme() != Some(&http::uri::Scheme::HTTP) {
            return None;
        }
        let authority = uri.authority()?;
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        Some(Target {
            host,
            port: authority.port_u16().unwrap_or(80),
            host_header: HeaderValue::from_str(authority.as_str()).ok()?,
            path_prefix: uri.path().trim_end_matches('/').to_owned(),
        })
    }
}

/// One worker's kept-alive connections, most recently used first out.
#[derive(Debug)]
pub struct Pool {
    pub(crate) target: Option<Target>,
    idle: Mutex<Vec<Idle>>,
}

#[derive(Debug)]
struct Idle {
    connection: Connection,
    /// When its last request was sent: its idle time is counted from
    /// then, which overstates it by that answer's length, so a connection
    /// whose answer outlasted [`IDLE_TIMEOUT`] is closed rather than
    /// reused. That costs a connect after such an answer, and saves a
    /// clock read on every request.
    since: Instant,
}

/// A connection and its read buffer, which may hold the start of what
/// follows (never, between requests, since a pooled connection had read
/// exactly its answers).
#[derive(Debug)]
pub(crate) struct Connection {
    pub(crate) stream: TcpStream,
    pub(crate) buffer: BytesMut,
    /// The request head, built here to reuse its allocation.
    pub(crate) head: Vec<u8>,
    /// When the request it carries was sent ([`Idle::since`]).
    pub(crate) sent_at: Instant,
}

impl Pool {
    /// The pool of the worker at `url`; requests through it fail if the URL
    /// is not `http://host[:port][/prefix]`.
    pub fn new(url: &str) -> Pool {
        Pool {
            target: Target::parse(url),
            idle: Mutex::new(Vec::new()),
        }
    }

    /// Whether requests can be made at all (the URL parsed).
    pub fn is_usable(&self) -> bool {
        self.target.is_some()
    }

    pub(crate) fn checkout(&self, now: Instant) -> Option<Connection> {
        let mut idle = self.idle.lock();
        while let Some(entry) = idle.pop() {
            if now.saturating_duration_since(entry.since) < IDLE_TIMEOUT {
                return Some(entry.connection);
            }
            // The rest are older still.
            idle.clear();
        }
        None
    }

    pub(crate) fn give_back(&self, mut connection: Connection) {
        if connection.buffer.capacity() > MAX_POOLED_BUFFER {
            connection.buffer = BytesMut::new();
        }
        let mut idle = self.idle.lock();
        if idle.len() < MAX_IDLE_PER_WORKER {
            idle.push(Idle {
                since: connection.sent_at,
                connection,
            });
        }
    }

    /// Idle connections now.
    #[cfg(test)]
    pub(crate) fn idle_count(&self) -> usize {
        self.idle.lock().len()
    }

    pub(crate) async fn connect(
        &self,
        target: &Target,
        timeout: Duration,
        now: Instant,
    ) -> Result<Connection, SendError> {
        let address = || format!("{}:{}", target.host, target.port);
        let connect = TcpStream::connect((target.host.as_str(), target.port));
        let stream = match tokio::time::timeout(timeout, connect).await {
            Ok(Ok(stream)) => stream,
            Ok(Err(source)) => {
                return Err(SendError::Connect {
                    address: address(),
                    source,
                });
            }
            Err(_elapsed) => {
                return Err(SendError::ConnectTimeout {
                    address: address(),
                    timeout,
                });
            }
        };
        // Requests and events are small writes: no Nagle delay.
        let _ = stream.set_nodelay(true);
        Ok(Connection {
            stream,
            buffer: BytesMut::new(),
            head: Vec::new(),
            sent_at: now,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_addresses_are_split_once() {
        let plain = Target::parse("http://10.0.0.1:30000").unwrap();
        assert_eq!((plain.host.as_str(), plain.port), ("10.0.0.1", 30000));
        assert_eq!(plain.host_header, "10.0.0.1:30000");
        assert_eq!(plain.path_prefix, "");
        let prefixed = Target::parse("http://h:8000/engine-a/").unwrap();
        assert_eq!(prefixed.path_prefix, "/engine-a");
        let v6 = Target::parse("http://[::1]:9000").unwrap();
        assert_eq!((v6.host.as_str(), v6.port), ("::1", 9000));
        assert_eq!(Target::parse("http://h").unwrap().port, 80);
        assert!(Target::parse("not a url").is_none());
        assert!(Target::parse("/relative").is_none());
        assert!(Target::parse("https://h:1").is_none(), "no TLS");
        assert!(!Pool::new("https://h:1").is_usable());
        assert!(Pool::new("http://h:1").is_usable());
    }
}
