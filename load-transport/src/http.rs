//! What every HTTP load source shares, behind the `http` feature: the check
//! of an `http://` or `https://` base address, and one GET of a load report
//! (accept and bearer headers, status, content type, a capped body) with
//! every failure as a [`LoadError`]. The router's control-plane clients
//! ([`pooled_client`], [`pooled_https_client`], [`read_capped`]) are built
//! from the same pieces.
//!
//! A poll runs on the router's own HTTP/1.1 client ([`worker_h1`]): one
//! kept-alive connection per load endpoint, a request head written in one
//! system call and the answer read in the polling task, with no URL parsed,
//! no client built and no connection task woken, so polling a thousand
//! workers every second stays a few percent of one core. An `https://`
//! endpoint is polled over TLS, its certificate verified against the
//! source's CA file ([`SourceOptions::ca_file`]) or, without one, the
//! system's roots: the same trust the router forwards requests with.

use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::header::{ACCEPT, CONTENT_TYPE, InvalidHeaderValue};
use http::{HeaderValue, Method, StatusCode, Uri};
use http_body_util::BodyExt;
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use worker_h1::WorkerTls;

use policy_core::{BackendError, LoadError, SourceOptions};

/// How long an idle poll connection stays open. Longer than any sane poll
/// interval, so a worker polled every few seconds keeps one connection.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// Checks an HTTP base address (`http://host:port[/prefix]` or
/// `https://host:port[/prefix]`) and removes any trailing `/`.
pub fn http_base(raw: &str) -> Result<String, BackendError> {
    let invalid = |reason| BackendError::InvalidAddress {
        url: raw.to_owned(),
        reason,
    };
    let uri: Uri = raw.parse().map_err(|_| invalid("not a valid URL"))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) {
        return Err(invalid("expected an http:// or https:// URL"));
    }
    if uri.host().is_none_or(str::is_empty) {
        return Err(invalid("missing host"));
    }
    if uri.query().is_some() {
        return Err(invalid("expected no query or fragment"));
    }
    Ok(raw.trim_end_matches('/').to_owned())
}

/// `Bearer <api_key>` as an `Authorization` value, marked sensitive so that
/// it stays out of Debug output and logs. Fails for a key with bytes a
/// header cannot hold (a newline, say).
pub fn bearer_header(api_key: &str) -> Result<HeaderValue, InvalidHeaderValue> {
    let mut value = HeaderValue::try_from(format!("Bearer {api_key}"))?;
    value.set_sensitive(true);
    Ok(value)
}

/// The format a load report must come in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReportFormat {
    /// `application/json` (or `application/*+json`); required.
    Json,
    /// Prometheus text (`text/plain`) or OpenMetrics text; a response
    /// without a content type is read as text too.
    PrometheusText,
}

impl ReportFormat {
    fn accept(self) -> HeaderValue {
        HeaderValue::from_static(match self {
            ReportFormat::Json => "application/json",
            ReportFormat::PrometheusText => {
                "text/plain;version=0.0.4;q=1.0,application/openmetrics-text;q=0.5,*/*;q=0.1"
            }
        })
    }

    fn expected(self) -> &'static str {
        match self {
            ReportFormat::Json => "application/json",
            ReportFormat::PrometheusText => "text/plain",
        }
    }

    fn admits(self, content_type: Option<&[u8]>) -> bool {
        let Some(content_type) = content_type else {
            return self == ReportFormat::PrometheusText;
        };
        let essence = String::from_utf8_lossy(content_type)
            .split(';')
            .next()
            .unwrap_or_default()
            .trim()
            .to_ascii_lowercase();
        match self {
            ReportFormat::Json => {
                essence == "application/json"
                    || (essence.starts_with("application/") && essence.ends_with("+json"))
            }
            ReportFormat::PrometheusText => {
                essence == "text/plain" || essence == "application/openmetrics-text"
            }
        }
    }
}

/// One load endpoint: its URL (for errors), split once into the worker's
/// connection pool and the path asked for, and its format.
#[derive(Debug, Clone)]
pub struct ReportUrl {
    url: String,
    /// Kept-alive connections to the endpoint's server (its base address).
    pool: Arc<worker_h1::Pool>,
    path: String,
    query: Option<String>,
    /// The `Accept` header the format asks with.
    headers: worker_h1::HeaderLines,
    format: ReportFormat,
    /// The endpoint's name in [`LoadError::Unsupported`] (`/v1/loads`).
    what: &'static str,
}

impl ReportUrl {
    /// `base` (already checked by [`http_base`]) joined with `path_and_query`.
    /// An `https://` base is reached over TLS, trusting `options.ca_file`
    /// (read now) or, without one, the system's roots; a file or a store
    /// that cannot be loaded is [`BackendError::Client`].
    pub fn new(
        base: &str,
        path_and_query: &str,
        format: ReportFormat,
        what: &'static str,
        options: &SourceOptions,
    ) -> Result<ReportUrl, BackendError> {
        let url = format!("{base}{path_and_query}");
        let invalid = |reason| BackendError::InvalidAddress {
            url: url.clone(),
            reason,
        };
        url.parse::<Uri>().map_err(|_| invalid("not a valid URL"))?;
        let pool = if worker_h1::wants_tls(base) {
            let tls = worker_tls(options).map_err(|source| BackendError::Client {
                url: url.clone(),
                source: source.into(),
            })?;
            worker_h1::Pool::with_tls(base, tls)
        } else {
            worker_h1::Pool::new(base)
        };
        if !pool.is_usable() {
            return Err(invalid("expected http(s)://host[:port][/prefix]"));
        }
        let (path, query) = match path_and_query.split_once('?') {
            Some((path, query)) => (path, Some(query.to_owned())),
            None => (path_and_query, None),
        };
        if !path.starts_with('/') {
            return Err(invalid("the report's path must start with /"));
        }
        let mut headers = worker_h1::HeaderLines::default();
        headers.append(&ACCEPT, &format.accept());
        Ok(ReportUrl {
            url,
            pool: Arc::new(pool),
            path: path.to_owned(),
            query,
            headers,
            format,
            what,
        })
    }

    pub fn as_str(&self) -> &str {
        &self.url
    }
}

/// The trust `options` asks for `https://` workers: the certificates of its
/// CA file, or the system's roots (read once per process).
pub fn worker_tls(options: &SourceOptions) -> Result<WorkerTls, worker_h1::TlsConfigError> {
    match &options.ca_file {
        Some(path) => WorkerTls::from_ca_file(path),
        None => WorkerTls::system_roots(),
    }
}

/// GETs load reports with the source's key and body cap.
///
/// A new connection must be made within the source's deadline; the
/// deadline of a whole poll is the caller's, since one poll may take
/// several requests.
#[derive(Debug, Clone)]
pub struct ReportClient {
    connect_timeout: Duration,
    authorization: Option<HeaderValue>,
    body_limit_bytes: usize,
}

/// A GET's body.
static NO_BODY: Bytes = Bytes::new();

impl ReportClient {
    /// Fails with [`BackendError::Client`] for an API key that cannot be a
    /// header value (`url` names the source in that error).
    pub fn new(url: &str, options: &SourceOptions) -> Result<ReportClient, BackendError> {
        let authorization = options
            .api_key
            .as_deref()
            .map(bearer_header)
            .transpose()
            .map_err(|source| BackendError::Client {
                url: url.to_owned(),
                source: source.into(),
            })?;
        Ok(ReportClient {
            connect_timeout: options.deadline,
            authorization,
            body_limit_bytes: options.body_limit_bytes,
        })
    }

    /// One GET of `report`, its body read into memory. Errors:
    /// - connection refused, unreachable or not made within the source's
    ///   deadline, or a failed TLS handshake (an untrusted certificate) →
    ///   [`LoadError::Connect`];
    /// - HTTP 404, 405 or 501 → [`LoadError::Unsupported`]; any other non-200
    ///   status → [`LoadError::HttpStatus`];
    /// - a content type the format does not admit → [`LoadError::ContentType`];
    /// - a body (announced or read) over the cap → [`LoadError::BodyTooLarge`];
    /// - a connection that fails, a malformed answer or a body cut short →
    ///   [`LoadError::Transport`].
    pub async fn get(&self, report: &ReportUrl) -> Result<Bytes, LoadError> {
        let transport = |source: Box<dyn std::error::Error + Send + Sync>| LoadError::Transport {
            url: report.url.clone(),
            source,
        };
        let request = worker_h1::Outgoing {
            method: &Method::GET,
            path: &report.path,
            query: report.query.as_deref(),
            headers: &report.headers,
            authorization: self.authorization.as_ref(),
            body: &NO_BODY,
        };
        let response = worker_h1::send(&report.pool, &request, self.connect_timeout)
            .await
            .map_err(|error| match error {
                worker_h1::SendError::Connect { .. }
                | worker_h1::SendError::ConnectTimeout { .. }
                | worker_h1::SendError::Handshake { .. } => LoadError::Connect {
                    url: report.url.clone(),
                    source: error.into(),
                },
                other => transport(other.into()),
            })?;
        let status = response.status;
        if matches!(
            status,
            StatusCode::NOT_FOUND | StatusCode::METHOD_NOT_ALLOWED | StatusCode::NOT_IMPLEMENTED
        ) {
            return Err(LoadError::Unsupported {
                url: report.url.clone(),
                what: report.what,
            });
        }
        if status != StatusCode::OK {
            return Err(LoadError::HttpStatus {
                url: report.url.clone(),
                status: status.as_u16(),
            });
        }
        let content_type = response.headers.get(CONTENT_TYPE.as_str());
        if !report.format.admits(content_type) {
            return Err(LoadError::ContentType {
                url: report.url.clone(),
                content_type: content_type
                    .map(|value| String::from_utf8_lossy(value).into_owned())
                    .unwrap_or_default(),
                expected: report.format.expected(),
            });
        }
        read_capped(response.body, self.body_limit_bytes)
            .await
            .map_err(|error| match error {
                CappedBodyError::TooLarge { limit_bytes } => LoadError::BodyTooLarge {
                    url: report.url.clone(),
                    limit_bytes,
                },
                CappedBodyError::Broken(source) => transport(source),
            })
    }
}

/// hyper's pooled client as every HTTP caller here configures it: no Nagle
/// delay (requests and streamed answers are small writes), `connect_timeout`
/// on the TCP connect, idle connections kept 90 s. `http://` only; see
/// [`pooled_https_client`].
pub fn pooled_client<B>(connect_timeout: Duration) -> Client<HttpConnector, B>
where
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
{
    pooled_builder().build(tcp_connector(connect_timeout))
}

/// The client [`pooled_https_client`] builds.
pub type PooledHttpsClient<B> = Client<HttpsConnector<HttpConnector>, B>;

/// [`pooled_client`] for `https://` (and `http://`) URLs: HTTP/1.1 over TLS
/// with `tls`'s trust (hyper-rustls), the TLS handshake after a TCP connect
/// bounded by `connect_timeout`.
pub fn pooled_https_client<B>(connect_timeout: Duration, tls: &WorkerTls) -> PooledHttpsClient<B>
where
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
{
    let mut tcp = tcp_connector(connect_timeout);
    // The TLS connector wraps it, and hands it https:// URLs too.
    tcp.enforce_http(false);
    // hyper-rustls sets the ALPN list itself (none for HTTP/1.1 alone).
    let mut config = (**tls.client_config()).clone();
    config.alpn_protocols.clear();
    let connector = HttpsConnectorBuilder::new()
        .with_tls_config(config)
        .https_or_http()
        .enable_http1()
        .wrap_connector(tcp);
    pooled_builder().build(connector)
}

fn tcp_connector(connect_timeout: Duration) -> HttpConnector {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(connect_timeout));
    connector
}

fn pooled_builder() -> hyper_util::client::legacy::Builder {
    let mut builder = Client::builder(TokioExecutor::new());
    builder
        .pool_idle_timeout(POOL_IDLE_TIMEOUT)
        .pool_timer(TokioTimer::new());
    builder
}

/// Why [`read_capped`] returned no body.
#[derive(Debug, thiserror::Error)]
pub enum CappedBodyError {
    #[error("the body exceeds {limit_bytes} bytes")]
    TooLarge { limit_bytes: usize },
    #[error("the body broke off")]
    Broken(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// A whole response body in memory (hyper's or [`worker_h1`]'s), refused as soon
/// as it (announced or read so far) exceeds `limit_bytes`.
pub async fn read_capped<B>(mut body: B, limit_bytes: usize) -> Result<Bytes, CappedBodyError>
where
    B: hyper::body::Body<Data = Bytes> + Unpin,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let too_large = CappedBodyError::TooLarge { limit_bytes };
    let announced = body.size_hint().exact();
    if announced.is_some_and(|len| usize::try_from(len).map_or(true, |len| len > limit_bytes)) {
        return Err(too_large);
    }
    let capacity = announced
        .and_then(|len| usize::try_from(len).ok())
        .unwrap_or(0);
    let mut collected = BytesMut::with_capacity(capacity);
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|error| CappedBodyError::Broken(error.into()))?;
        if let Ok(chunk) = frame.into_data() {
            if collected.len().saturating_add(chunk.len()) > limit_bytes {
                return Err(too_large);
            }
            collected.extend_from_slice(&chunk);
        }
    }
    Ok(collected.freeze())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_addresses_are_checked() {
        assert_eq!(http_base("http://h:1/").unwrap(), "http://h:1");
        assert_eq!(
            http_base("http://h:1/engine-a/").unwrap(),
            "http://h:1/engine-a"
        );
        assert_eq!(http_base("https://h:8443/").unwrap(), "https://h:8443");
        let base = http_base("http://gw:80/vllm-0/").unwrap();
        let report = ReportUrl::new(
            &base,
            "/metrics",
            ReportFormat::PrometheusText,
            "m",
            &SourceOptions::default(),
        )
        .unwrap();
        assert_eq!(report.as_str(), "http://gw:80/vllm-0/metrics");
        for (raw, reason) in [
            ("h:1", "expected an http:// or https:// URL"),
            ("ftp://h:1", "expected an http:// or https:// URL"),
            ("http://h:1/?x=1", "expected no query or fragment"),
            ("not a url", "not a valid URL"),
        ] {
            match http_base(raw) {
                Err(BackendError::InvalidAddress { reason: got, .. }) => {
                    assert_eq!(got, reason, "{raw}");
                }
                other => panic!("{raw}: {other:?}"),
            }
        }
    }

    #[test]
    fn content_types_are_admitted_by_format() {
        let admits = |format: ReportFormat, value: Option<&'static str>| {
            format.admits(value.map(str::as_bytes))
        };
        assert!(admits(ReportFormat::Json, Some("application/json")));
        assert!(admits(
            ReportFormat::Json,
            Some("Application/JSON; charset=utf-8")
        ));
        assert!(admits(ReportFormat::Json, Some("application/problem+json")));
        assert!(!admits(ReportFormat::Json, Some("text/plain")));
        assert!(!admits(ReportFormat::Json, None), "JSON must say so");
        assert!(admits(
            ReportFormat::PrometheusText,
            Some("text/plain; version=0.0.4")
        ));
        assert!(admits(
            ReportFormat::PrometheusText,
            Some("application/openmetrics-text; version=1.0.0")
        ));
        assert!(admits(ReportFormat::PrometheusText, None));
        assert!(!admits(ReportFormat::PrometheusText, Some("text/html")));
    }

    #[test]
    fn the_api_key_becomes_a_sensitive_bearer_header() {
        let value = bearer_header("sk-1").unwrap();
        assert_eq!(value, "Bearer sk-1");
        assert!(value.is_sensitive());
        assert!(bearer_header("bad\nkey").is_err());
    }

    /// A worker at `/engine-a` on loopback: it answers the requests it
    /// receives, on whichever connection, with `answers` in turn, and sends
    /// each request's head, with the number of the connection it came on,
    /// through the channel.
    async fn scripted_worker(
        answers: Vec<&'static str>,
    ) -> (
        String,
        tokio::sync::mpsc::UnboundedReceiver<(usize, String)>,
    ) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}/engine-a/", listener.local_addr().unwrap());
        let (heads, received) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut answers = answers.into_iter();
            let mut connection = 0;
            while let Ok((mut socket, _)) = listener.accept().await {
                let mut buffer = Vec::new();
                'requests: loop {
                    let end = loop {
                        if let Some(at) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
                            break at + 4;
                        }
                        let mut chunk = [0u8; 1024];
                        match socket.read(&mut chunk).await {
                            Ok(0) | Err(_) => break 'requests,
                            Ok(n) => buffer.extend_from_slice(&chunk[..n]),
                        }
                    };
                    let head: Vec<u8> = buffer.drain(..end).collect();
                    let _ = heads.send((connection, String::from_utf8(head).unwrap()));
                    let Some(answer) = answers.next() else { return };
                    socket.write_all(answer.as_bytes()).await.unwrap();
                    if answers.len() == 0 {
                        // The script is over: closing ends a body cut short.
                        return;
                    }
                }
                connection += 1;
            }
        });
        (http_base(&base).unwrap(), received)
    }

    #[tokio::test]
    async fn polls_reuse_one_connection_and_read_every_framing() {
        let (base, mut heads) = scripted_worker(vec![
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 8\r\n\r\n{\"a\": 1}",
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n4\r\n{\"b\"\r\n4\r\n: 2}\r\n0\r\n\r\n",
            "HTTP/1.1 503 Busy\r\ncontent-length: 0\r\n\r\n",
            "HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: 2\r\n\r\nhi",
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 64\r\n\r\n",
        ])
        .await;
        let options = SourceOptions {
            api_key: Some("sk-1".into()),
            body_limit_bytes: 32,
            ..SourceOptions::default()
        };
        let report = ReportUrl::new(
            &base,
            "/v1/loads?rank=0",
            ReportFormat::Json,
            "/v1/loads",
            &options,
        )
        .unwrap();
        let client = ReportClient::new(&base, &options).unwrap();
        assert_eq!(client.get(&report).await.unwrap(), "{\"a\": 1}");
        let (connection, head) = heads.recv().await.unwrap();
        assert_eq!(connection, 0);
        assert!(
            head.starts_with("GET /engine-a/v1/loads?rank=0 HTTP/1.1\r\n"),
            "{head}"
        );
        let authority = base
            .trim_start_matches("http://")
            .trim_end_matches("/engine-a");
        assert!(head.contains(&format!("host: {authority}\r\n")), "{head}");
        assert!(head.contains("accept: application/json\r\n"), "{head}");
        assert!(head.contains("authorization: Bearer sk-1\r\n"), "{head}");
        // The next poll rides the same connection.
        assert_eq!(client.get(&report).await.unwrap(), "{\"b\": 2}");
        assert_eq!(
            heads.recv().await.map(|(connection, _)| connection),
            Some(0)
        );
        assert!(matches!(
            client.get(&report).await,
            Err(LoadError::HttpStatus { status: 503, .. })
        ));
        assert!(matches!(
            client.get(&report).await,
            Err(LoadError::ContentType { .. })
        ));
        assert!(matches!(
            client.get(&report).await,
            Err(LoadError::BodyTooLarge {
                limit_bytes: 32,
                ..
            })
        ));
        // An error answer's connection is not kept (its body was not read).
        let connections: Vec<usize> = std::iter::from_fn(|| heads.try_recv().ok())
            .map(|(connection, _)| connection)
            .collect();
        assert_eq!(connections, [0, 1, 2]);
    }

    #[tokio::test]
    async fn a_refused_connection_is_a_connect_error_and_a_broken_answer_a_transport_one() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let closed = http_base(&format!("http://{}", listener.local_addr().unwrap())).unwrap();
        drop(listener);
        let report = ReportUrl::new(
            &closed,
            "/metrics",
            ReportFormat::PrometheusText,
            "/metrics",
            &SourceOptions::default(),
        )
        .unwrap();
        let client = ReportClient::new(&closed, &SourceOptions::default()).unwrap();
        assert!(matches!(
            client.get(&report).await,
            Err(LoadError::Connect { .. })
        ));
        let (base, _heads) =
            scripted_worker(vec!["HTTP/1.1 200 OK\r\ncontent-length: 50\r\n\r\ncut"]).await;
        let report = ReportUrl::new(
            &base,
            "/metrics",
            ReportFormat::PrometheusText,
            "/metrics",
            &SourceOptions::default(),
        )
        .unwrap();
        assert!(matches!(
            client.get(&report).await,
            Err(LoadError::Transport { .. })
        ));
    }

    /// A CA made for one test, in a PEM file of its own, and a leaf
    /// certificate it signed for `127.0.0.1`, with its key.
    fn test_ca(
        name: &str,
    ) -> (
        std::path::PathBuf,
        rustls_pki_types::CertificateDer<'static>,
        rustls_pki_types::PrivateKeyDer<'static>,
    ) {
        use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
        let ca_key = KeyPair::generate().unwrap();
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca_pem = ca_params.self_signed(&ca_key).unwrap().pem();
        let issuer = Issuer::new(ca_params, ca_key);
        let leaf_key = KeyPair::generate().unwrap();
        let leaf = CertificateParams::new(vec!["127.0.0.1".to_owned()])
            .unwrap()
            .signed_by(&leaf_key, &issuer)
            .unwrap();
        let path = std::env::temp_dir().join(format!(
            "load-transport-ca-{}-{name}.pem",
            std::process::id()
        ));
        std::fs::write(&path, ca_pem).unwrap();
        let key = rustls_pki_types::PrivateKeyDer::Pkcs8(leaf_key.serialize_der().into());
        (path, leaf.der().clone(), key)
    }

    /// A worker on loopback over TLS with `certificate`: every request on
    /// every connection gets `answer`. Its base URL.
    async fn tls_worker(
        certificate: rustls_pki_types::CertificateDer<'static>,
        key: rustls_pki_types::PrivateKeyDer<'static>,
        answer: &'static str,
    ) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![certificate], key)
        .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("https://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let mut buffer = Vec::new();
                    loop {
                        while !buffer.windows(4).any(|w| w == b"\r\n\r\n") {
                            let mut chunk = [0u8; 1024];
                            match tls.read(&mut chunk).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => buffer.extend_from_slice(&chunk[..n]),
                            }
                        }
                        let end = buffer.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
                        buffer.drain(..end);
                        if tls.write_all(answer.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        base
    }

    #[tokio::test]
    async fn an_https_worker_is_polled_with_the_sources_ca_file() {
        let (ca_file, certificate, key) = test_ca("trusted");
        let base = tls_worker(
            certificate,
            key,
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 8\r\n\r\n{\"a\": 1}",
        )
        .await;
        let base = http_base(&base).unwrap();
        let options = SourceOptions {
            ca_file: Some(ca_file.clone()),
            ..SourceOptions::default()
        };
        let report = ReportUrl::new(
            &base,
            "/v1/loads",
            ReportFormat::Json,
            "/v1/loads",
            &options,
        )
        .unwrap();
        let client = ReportClient::new(&base, &options).unwrap();
        for _ in 0..2 {
            assert_eq!(client.get(&report).await.unwrap(), "{\"a\": 1}");
        }

        // The control plane's client, with the same trust.
        let tls = worker_tls(&options).unwrap();
        let control =
            pooled_https_client::<http_body_util::Empty<Bytes>>(Duration::from_secs(5), &tls);
        let response = control
            .get(format!("{base}/health").parse().unwrap())
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        let body = read_capped(response.into_body(), 1024).await.unwrap();
        assert_eq!(body, "{\"a\": 1}");

        // Another CA's trust: the handshake fails, as a connect failure.
        let (other_ca, _, _) = test_ca("other");
        let untrusting = SourceOptions {
            ca_file: Some(other_ca.clone()),
            ..SourceOptions::default()
        };
        let report = ReportUrl::new(
            &base,
            "/v1/loads",
            ReportFormat::Json,
            "/v1/loads",
            &untrusting,
        )
        .unwrap();
        let error = client.get(&report).await.unwrap_err();
        assert!(matches!(error, LoadError::Connect { .. }), "{error:?}");

        // A CA file that is not there: the source cannot be built.
        let missing = SourceOptions {
            ca_file: Some(ca_file.with_extension("missing")),
            ..SourceOptions::default()
        };
        let error = ReportUrl::new(
            &base,
            "/v1/loads",
            ReportFormat::Json,
            "/v1/loads",
            &missing,
        )
        .unwrap_err();
        assert!(
            matches!(&error, BackendError::Client { url, .. } if url.starts_with("https://")),
            "{error:?}"
        );
        assert!(
            policy_core::error_chain(&error).contains("missing"),
            "{}",
            policy_core::error_chain(&error)
        );
        // A plain base never reads the CA file.
        assert!(
            ReportUrl::new(
                "http://h:1",
                "/metrics",
                ReportFormat::PrometheusText,
                "m",
                &missing
            )
            .is_ok()
        );
        std::fs::remove_file(&ca_file).unwrap();
        std::fs::remove_file(&other_ca).unwrap();
    }

    #[test]
    fn a_report_path_must_be_absolute() {
        assert!(matches!(
            ReportUrl::new(
                "http://h:1",
                "v1/loads",
                ReportFormat::Json,
                "x",
                &SourceOptions::default()
            ),
            Err(BackendError::InvalidAddress { .. })
        ));
    }

    #[test]
    fn a_key_that_cannot_be_a_header_is_a_client_error() {
        let options = SourceOptions {
            api_key: Some("line\nbreak".into()),
            ..SourceOptions::default()
        };
        assert!(matches!(
            ReportClient::new("http://h:1", &options),
            Err(BackendError::Client { .. })
        ));
    }
}
