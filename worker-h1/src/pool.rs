//! A worker's address, and its pool of kept-alive connections.

use std::time::{Duration, Instant};

use bytes::BytesMut;
use http::HeaderValue;
use parking_lot::Mutex;
use rustls_pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

use crate::io::WorkerStream;
use crate::{SendError, WorkerTls};

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
    /// For an `https://` worker: the handshake's trust and server name.
    tls: Option<TlsTarget>,
}

/// What a TLS handshake with an `https://` worker needs.
struct TlsTarget {
    connector: TlsConnector,
    /// The URL's host (an IP literal is checked against the certificate's
    /// IP addresses).
    server_name: ServerName<'static>,
}

impl std::fmt::Debug for TlsTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsTarget")
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

/// Why a [`Pool`] cannot make requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unusable {
    /// Not `http://` or `https://` with a host.
    NotAWorkerUrl,
    /// `https://`, and no trust for it: [`Pool::new`] found no system roots.
    NoTrust,
    /// `https://` with a host that cannot be a TLS server name.
    BadServerName,
}

impl Unusable {
    pub(crate) fn reason(self) -> &'static str {
        match self {
            Unusable::NotAWorkerUrl => "it is not http(s)://host[:port][/prefix]",
            Unusable::NoTrust => {
                "it is https:// and the system's root certificates could not be loaded"
            }
            Unusable::BadServerName => "its host cannot be a TLS server name",
        }
    }
}

impl Target {
    /// `url` split, if it is `http://host[:port][/prefix]`, or
    /// `https://host[:port][/prefix]` with `tls` to trust the worker by.
    pub(crate) fn parse(url: &str, tls: Option<&WorkerTls>) -> Result<Target, Unusable> {
        let uri: http::Uri = url.parse().map_err(|_| Unusable::NotAWorkerUrl)?;
        let https = match uri.scheme_str() {
            Some("http") => false,
            Some("https") => true,
            _ => return Err(Unusable::NotAWorkerUrl),
        };
        let authority = uri.authority().ok_or(Unusable::NotAWorkerUrl)?;
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let tls = if https {
            let tls = tls.ok_or(Unusable::NoTrust)?;
            let server_name =
                ServerName::try_from(host.clone()).map_err(|_| Unusable::BadServerName)?;
            Some(TlsTarget {
                connector: TlsConnector::from(tls.client_config().clone()),
                server_name,
            })
        } else {
            None
        };
        Ok(Target {
            port: authority.port_u16().unwrap_or(if https { 443 } else { 80 }),
            host,
            host_header: HeaderValue::from_str(authority.as_str())
                .map_err(|_| Unusable::NotAWorkerUrl)?,
            path_prefix: uri.path().trim_end_matches('/').to_owned(),
            tls,
        })
    }
}

/// Whether `url` is an `https://` URL (the scheme in any case): a worker
/// reached over TLS, which needs a [`WorkerTls`].
pub fn wants_tls(url: &str) -> bool {
    url.parse::<http::Uri>()
        .is_ok_and(|uri| uri.scheme_str() == Some("https"))
}

/// One worker's kept-alive connections, most recently used first out.
#[derive(Debug)]
pub struct Pool {
    pub(crate) target: Result<Target, Unusable>,
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
    pub(crate) stream: WorkerStream,
    pub(crate) buffer: BytesMut,
    /// The request head, built here to reuse its allocation.
    pub(crate) head: Vec<u8>,
    /// When the request it carries was sent ([`Idle::since`]).
    pub(crate) sent_at: Instant,
}

impl Pool {
    /// The pool of the worker at `url`: `http://host[:port][/prefix]`, or
    /// `https://host[:port][/prefix]` verified against the system's root
    /// certificates ([`WorkerTls::system_roots`], read once per process,
    /// and only for an `https://` URL). Requests through it fail if the URL
    /// is neither, or if the system's roots could not be loaded.
    pub fn new(url: &str) -> Pool {
        let system_roots = if wants_tls(url) {
            WorkerTls::system_roots().ok()
        } else {
            None
        };
        Pool::from_target(Target::parse(url, system_roots.as_ref()))
    }

    /// The pool of the worker at `url`, an `https://` one verified against
    /// `tls`; an `http://` URL is plain HTTP, `tls` unused.
    pub fn with_tls(url: &str, tls: WorkerTls) -> Pool {
        Pool::from_target(Target::parse(url, Some(&tls)))
    }

    fn from_target(target: Result<Target, Unusable>) -> Pool {
        Pool {
            target,
            idle: Mutex::new(Vec::new()),
        }
    }

    /// Whether requests can be made at all (the URL parsed, and an
    /// `https://` one has its trust).
    pub fn is_usable(&self) -> bool {
        self.target.is_ok()
    }

    /// Whether connections are made with TLS (an `https://` worker).
    pub fn is_tls(&self) -> bool {
        self.target
            .as_ref()
            .is_ok_and(|target| target.tls.is_some())
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

    /// A new connection to `target`: the TCP connect and, for an
    /// `https://` worker, the TLS handshake, both within `timeout`.
    pub(crate) async fn connect(
        &self,
        target: &Target,
        timeout: Duration,
        now: Instant,
    ) -> Result<Connection, SendError> {
        let address = || format!("{}:{}", target.host, target.port);
        let connect = async {
            let tcp = TcpStream::connect((target.host.as_str(), target.port))
                .await
                .map_err(|source| SendError::Connect {
                    address: address(),
                    source,
                })?;
            // Requests and events are small writes: no Nagle delay.
            let _ = tcp.set_nodelay(true);
            let Some(tls) = &target.tls else {
                return Ok(WorkerStream::Plain(tcp));
            };
            match tls.connector.connect(tls.server_name.clone(), tcp).await {
                Ok(stream) => Ok(WorkerStream::Tls(Box::new(stream))),
                Err(source) => Err(SendError::Handshake {
                    address: address(),
                    source,
                }),
            }
        };
        let stream = match tokio::time::timeout(timeout, connect).await {
            Ok(connected) => connected?,
            Err(_elapsed) => {
                return Err(SendError::ConnectTimeout {
                    address: address(),
                    timeout,
                });
            }
        };
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
        let plain = Target::parse("http://10.0.0.1:30000", None).unwrap();
        assert_eq!((plain.host.as_str(), plain.port), ("10.0.0.1", 30000));
        assert_eq!(plain.host_header, "10.0.0.1:30000");
        assert_eq!(plain.path_prefix, "");
        assert!(plain.tls.is_none());
        let prefixed = Target::parse("http://h:8000/engine-a/", None).unwrap();
        assert_eq!(prefixed.path_prefix, "/engine-a");
        let v6 = Target::parse("http://[::1]:9000", None).unwrap();
        assert_eq!((v6.host.as_str(), v6.port), ("::1", 9000));
        assert_eq!(Target::parse("http://h", None).unwrap().port, 80);
        assert_eq!(
            Target::parse("not a url", None).unwrap_err(),
            Unusable::NotAWorkerUrl
        );
        assert!(Target::parse("/relative", None).is_err());
        assert!(Target::parse("ftp://h:1", None).is_err());
        assert_eq!(
            Target::parse("https://h:1", None).unwrap_err(),
            Unusable::NoTrust,
            "https needs a trust"
        );
        assert!(Pool::new("http://h:1").is_usable());
        assert!(!Pool::new("http://h:1").is_tls());
        assert!(wants_tls("https://h:1") && wants_tls("HTTPS://h:1/x"));
        assert!(!wants_tls("http://h:1") && !wants_tls("not a url"));
    }

    #[test]
    fn an_https_address_names_its_server_by_host_or_ip() {
        let tls = WorkerTls::from_roots(rustls::RootCertStore::empty()).unwrap();
        let named = Target::parse("https://engine-a.internal/v1-base/", Some(&tls)).unwrap();
        assert_eq!(named.port, 443, "https's default port");
        assert_eq!(named.path_prefix, "/v1-base");
        let name = &named.tls.as_ref().unwrap().server_name;
        assert!(matches!(name, ServerName::DnsName(dns) if dns.as_ref() == "engine-a.internal"));
        let ip = Target::parse("https://127.0.0.1:8443", Some(&tls)).unwrap();
        assert!(matches!(
            ip.tls.as_ref().unwrap().server_name,
            ServerName::IpAddress(_)
        ));
        let v6 = Target::parse("https://[::1]:8443", Some(&tls)).unwrap();
        assert!(matches!(
            v6.tls.as_ref().unwrap().server_name,
            ServerName::IpAddress(_)
        ));
        assert_eq!(v6.host_header, "[::1]:8443");
        // An http:// URL stays plain whatever trust is given.
        assert!(!Pool::with_tls("http://h:1", tls.clone()).is_tls());
        assert!(Pool::with_tls("https://h:1", tls).is_tls());
        // Pool::new trusts the system's roots, if there are any.
        assert_eq!(
            Pool::new("https://h:1").is_usable(),
            WorkerTls::system_roots().is_ok()
        );
    }
}
