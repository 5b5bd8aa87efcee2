//! What every HTTP load source shares, behind the `http` feature: the check
//! of an `http://` base address, and one GET of a load report (accept and
//! bearer headers, status, content type, a capped body) with every failure
//! as a [`LoadError`]. The router's own HTTP client ([`pooled_client`],
//! [`read_capped`]) is built from the same pieces.
//!
//! It runs on hyper's pooled client directly: a poll parses no URL and
//! builds no client, so polling a thousand workers every second stays a few
//! percent of one core.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE, InvalidHeaderValue};
use http::{HeaderValue, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use policy_core::{BackendError, LoadError, SourceOptions};

/// How long an idle poll connection stays open. Longer than any sane poll
/// interval, so a worker polled every few seconds keeps one connection.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// Checks an HTTP base address (`http://host:port[/prefix]`) and removes any
/// trailing `/`.
pub fn http_base(raw: &str) -> Result<String, BackendError> {
    let invalid = |reason| BackendError::InvalidAddress {
        url: raw.to_owned(),
        reason,
    };
    let uri: Uri = raw.parse().map_err(|_| invalid("not a valid URL"))?;
    if uri.scheme_str() != Some("http") {
        return Err(invalid("expected an http:// URL (this build has no TLS)"));
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

    fn admits(self, content_type: Option<&HeaderValue>) -> bool {
        let Some(content_type) = content_type else {
            return self == ReportFormat::PrometheusText;
        };
        let essence = String::from_utf8_lossy(content_type.as_bytes())
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

/// One load endpoint: its URL (for errors), parsed once, and its format.
#[derive(Debug, Clone)]
pub struct ReportUrl {
    url: String,
    uri: Uri,
    format: ReportFormat,
    /// The endpoint's name in [`LoadError::Unsupported`] (`/v1/loads`).
    what: &'static str,
}

impl ReportUrl {
    /// `base` (already checked by [`http_base`]) joined with `path_and_query`.
    pub fn new(
        base: &str,
        path_and_query: &str,
        format: ReportFormat,
        what: &'static str,
    ) -> Result<ReportUrl, BackendError> {
        let url = format!("{base}{path_and_query}");
        let uri = url.parse().map_err(|_| BackendError::InvalidAddress {
            url: url.clone(),
            reason: "not a valid URL",
        })?;
        Ok(ReportUrl {
            url,
            uri,
            format,
            what,
        })
    }

    pub fn as_str(&self) -> &str {
        &self.url
    }
}

/// GETs load reports: one pooled client with the source's key and body cap.
///
/// The connection timeout is the source's deadline; the deadline of a whole
/// poll is the caller's, since one poll may take several requests.
#[derive(Debug, Clone)]
pub struct ReportClient {
    client: Client<HttpConnector, Empty<Bytes>>,
    authorization: Option<HeaderValue>,
    body_limit_bytes: usize,
}

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
            client: pooled_client(options.deadline),
            authorization,
            body_limit_bytes: options.body_limit_bytes,
        })
    }

    /// One GET of `report`, its body read into memory. Errors:
    /// - connection refused or unreachable → [`LoadError::Connect`];
    /// - HTTP 404, 405 or 501 → [`LoadError::Unsupported`]; any other non-200
    ///   status → [`LoadError::HttpStatus`];
    /// - a content type the format does not admit → [`LoadError::ContentType`];
    /// - a body (announced or read) over the cap → [`LoadError::BodyTooLarge`];
    /// - a connection that fails or a body cut short → [`LoadError::Transport`].
    pub async fn get(&self, report: &ReportUrl) -> Result<Bytes, LoadError> {
        let transport = |source: Box<dyn std::error::Error + Send + Sync>| LoadError::Transport {
            url: report.url.clone(),
            source,
        };
        let mut request = Request::new(Empty::new());
        *request.uri_mut() = report.uri.clone();
        request.headers_mut().insert(ACCEPT, report.format.accept());
        if let Some(authorization) = &self.authorization {
            request
                .headers_mut()
                .insert(AUTHORIZATION, authorization.clone());
        }
        let response = self.client.request(request).await.map_err(|error| {
            if error.is_connect() {
                LoadError::Connect {
                    url: report.url.clone(),
                    source: error.into(),
                }
            } else {
                transport(error.into())
            }
        })?;
        let status = response.status();
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
        let content_type = response.headers().get(CONTENT_TYPE);
        if !report.format.admits(content_type) {
            return Err(LoadError::ContentType {
                url: report.url.clone(),
                content_type: content_type
                    .map(|value| String::from_utf8_lossy(value.as_bytes()).into_owned())
                    .unwrap_or_default(),
                expected: report.format.expected(),
            });
        }
        read_capped(response.into_body(), self.body_limit_bytes)
            .await
            .map_err(|error| match error {
                CappedBodyError::TooLarge { limit_bytes } => LoadError::BodyTooLarge {
                    url: report.url.clone(),
                    limit_bytes,
                },
                CappedBodyError::Broken(source) => transport(source.into()),
            })
    }
}

/// hyper's pooled client as every HTTP caller here configures it: no Nagle
/// delay (requests and streamed answers are small writes), `connect_timeout`
/// on the TCP connect, idle connections kept 90 s.
pub fn pooled_client<B>(connect_timeout: Duration) -> Client<HttpConnector, B>
where
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
{
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(connect_timeout));
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(POOL_IDLE_TIMEOUT)
        .pool_timer(TokioTimer::new())
        .build(connector)
}

/// Why [`read_capped`] returned no body.
#[derive(Debug, thiserror::Error)]
pub enum CappedBodyError {
    #[error("the body exceeds {limit_bytes} bytes")]
    TooLarge { limit_bytes: usize },
    #[error("the body broke off")]
    Broken(#[source] hyper::Error),
}

/// A whole response body in memory, refused as soon as it (announced or
/// read so far) exceeds `limit_bytes`.
pub async fn read_capped(
    mut incoming: hyper::body::Incoming,
    limit_bytes: usize,
) -> Result<Bytes, CappedBodyError> {
    let too_large = CappedBodyError::TooLarge { limit_bytes };
    let announced = hyper::body::Body::size_hint(&incoming).exact();
    if announced.is_some_and(|len| usize::try_from(len).map_or(true, |len| len > limit_bytes)) {
        return Err(too_large);
    }
    let capacity = announced
        .and_then(|len| usize::try_from(len).ok())
        .unwrap_or(0);
    let mut body = BytesMut::with_capacity(capacity);
    while let Some(frame) = incoming.frame().await {
        let frame = frame.map_err(CappedBodyError::Broken)?;
        if let Ok(chunk) = frame.into_data() {
            if body.len().saturating_add(chunk.len()) > limit_bytes {
                return Err(too_large);
            }
            body.extend_from_slice(&chunk);
        }
    }
    Ok(body.freeze())
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
        let base = http_base("http://gw:80/vllm-0/").unwrap();
        let report = ReportUrl::new(&base, "/metrics", ReportFormat::PrometheusText, "m").unwrap();
        assert_eq!(report.as_str(), "http://gw:80/vllm-0/metrics");
        for (raw, reason) in [
            ("h:1", "expected an http:// URL (this build has no TLS)"),
            (
                "https://h:1",
                "expected an http:// URL (this build has no TLS)",
            ),
            (
                "ftp://h:1",
                "expected an http:// URL (this build has no TLS)",
            ),
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
            format.admits(value.map(HeaderValue::from_static).as_ref())
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
