//! vLLM's Prometheus `/metrics` over HTTP: the [`LoadSource`] shell around
//! [`VllmMetricsConverter`].

use std::time::{Duration, Instant};

use async_trait::async_trait;
use load_protocols::WorkerLoad;
use parking_lot::Mutex;
use policy_core::{BackendError, BackendSpec, LoadError, LoadSource};
use reqwest::StatusCode;
use reqwest::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE, HeaderValue};

use crate::{VllmMetricsConverter, VllmMetricsError};

/// The backend name of [`VllmMetricsLoadSource`].
pub const METRICS_KIND: &str = "vllm";

/// The text exposition format, which is what [`parse_prometheus_text`]
/// reads; OpenMetrics is not asked for.
///
/// [`parse_prometheus_text`]: load_protocols::parse_prometheus_text
const ACCEPT_TEXT_FORMAT: &str = "text/plain;version=0.0.4;q=1.0,*/*;q=0.1";

/// Polls `GET {load_url or worker_url}/metrics` of a vLLM server.
///
/// One instance per worker: it keeps the previous generation counters, so
/// throughput is reported from the second successful poll on. Each poll is
/// bounded by the deadline (connection and whole body included) and reads
/// at most `body_limit_bytes`, streaming, so an oversized body is cut off
/// rather than buffered. Errors:
///
/// - no complete answer within the deadline → [`LoadError::Timeout`];
/// - connection refused → [`LoadError::Connect`];
/// - HTTP 404, 405 or 501 → [`LoadError::Unsupported`]; any other non-200
///   status → [`LoadError::HttpStatus`];
/// - a `Content-Type` other than `text/plain` → [`LoadError::ContentType`]
///   (a response without one is read);
/// - a body over the cap → [`LoadError::BodyTooLarge`];
/// - a body cut short by the connection → [`LoadError::Transport`];
/// - text that is not UTF-8 or not Prometheus text, or an engine missing a
///   load gauge → [`LoadError::Decode`] (source: [`VllmMetricsError`] or the
///   UTF-8 error);
/// - impossible values (no vLLM engine, NaN, infinities, negative values) →
///   [`LoadError::Invalid`]. A KV usage above 1 is clamped to 1.
///
/// System proxies are not used: workers are polled directly.
#[derive(Debug)]
pub struct VllmMetricsLoadSource {
    url: String,
    client: reqwest::Client,
    deadline: Duration,
    body_limit_bytes: usize,
    authorization: Option<HeaderValue>,
    converter: Mutex<VllmMetricsConverter>,
}

impl VllmMetricsLoadSource {
    /// Builds the source; `load_url`, when given, replaces the worker URL as
    /// the base that `/metrics` is appended to.
    pub fn new(spec: &BackendSpec) -> Result<VllmMetricsLoadSource, BackendError> {
        let base = spec.load_url.as_deref().unwrap_or(&spec.worker_url);
        let url = metrics_url(base)?;
        let authorization = spec
            .options
            .api_key
            .as_ref()
            .map(|key| {
                HeaderValue::try_from(format!("Bearer {key}"))
                    .map(|mut value| {
                        value.set_sensitive(true);
                        value
                    })
                    .map_err(|source| BackendError::Client {
                        url: url.clone(),
                        source: Box::new(source),
                    })
            })
            .transpose()?;
        let client = reqwest::Client::builder()
            .no_proxy()
            .connect_timeout(spec.options.deadline)
            .build()
            .map_err(|source| BackendError::Client {
                url: url.clone(),
                source: Box::new(source),
            })?;
        Ok(VllmMetricsLoadSource {
            url,
            client,
            deadline: spec.options.deadline,
            body_limit_bytes: spec.options.body_limit_bytes,
            authorization,
            converter: Mutex::new(VllmMetricsConverter::new()),
        })
    }

    /// Fetches the whole body as text, within the cap.
    async fn fetch_text(&self) -> Result<String, LoadError> {
        let mut request = self
            .client
            .get(&self.url)
            .header(ACCEPT, ACCEPT_TEXT_FORMAT);
        if let Some(value) = &self.authorization {
            request = request.header(AUTHORIZATION, value.clone());
        }
        let mut response = request
            .send()
            .await
            .map_err(|source| self.send_error(source))?;
        let status = response.status();
        if matches!(
            status,
            StatusCode::NOT_FOUND | StatusCode::METHOD_NOT_ALLOWED | StatusCode::NOT_IMPLEMENTED
        ) {
            return Err(LoadError::Unsupported {
                url: self.url.clone(),
                what: "vllm /metrics",
            });
        }
        if status != StatusCode::OK {
            return Err(LoadError::HttpStatus {
                url: self.url.clone(),
                status: status.as_u16(),
            });
        }
        if let Some(content_type) = response.headers().get(CONTENT_TYPE) {
            let is_text = content_type
                .to_str()
                .ok()
                .and_then(|value| value.split(';').next())
                .is_some_and(|mime| mime.trim().eq_ignore_ascii_case("text/plain"));
            if !is_text {
                return Err(LoadError::ContentType {
                    url: self.url.clone(),
                    content_type: String::from_utf8_lossy(content_type.as_bytes()).into_owned(),
                    expected: "text/plain",
                });
            }
        }
        let too_large = || LoadError::BodyTooLarge {
            url: self.url.clone(),
            limit_bytes: self.body_limit_bytes,
        };
        let announced = response.content_length().unwrap_or(0);
        if usize::try_from(announced).map_or(true, |len| len > self.body_limit_bytes) {
            return Err(too_large());
        }
        let mut body = Vec::with_capacity(usize::try_from(announced).unwrap_or(0));
        while let Some(chunk) = response
            .chunk()
            .await
            .map_err(|source| LoadError::Transport {
                url: self.url.clone(),
                source: Box::new(source),
            })?
        {
            if body.len().saturating_add(chunk.len()) > self.body_limit_bytes {
                return Err(too_large());
            }
            body.extend_from_slice(&chunk);
        }
        String::from_utf8(body).map_err(|source| LoadError::Decode {
            url: self.url.clone(),
            source: Box::new(source),
        })
    }

    fn send_error(&self, source: reqwest::Error) -> LoadError {
        if source.is_timeout() {
            LoadError::Timeout {
                url: self.url.clone(),
                deadline: self.deadline,
            }
        } else if source.is_connect() {
            LoadError::Connect {
                url: self.url.clone(),
                source: Box::new(source),
            }
        } else {
            LoadError::Transport {
                url: self.url.clone(),
                source: Box::new(source),
            }
        }
    }
}

#[async_trait]
impl LoadSource for VllmMetricsLoadSource {
    async fn fetch(&self) -> Result<Option<WorkerLoad>, LoadError> {
        let text = tokio::time::timeout(self.deadline, self.fetch_text())
            .await
            .map_err(|_elapsed| LoadError::Timeout {
                url: self.url.clone(),
                deadline: self.deadline,
            })??;
        let observed_at = Instant::now();
        let converted = self.converter.lock().convert_text(&text, observed_at);
        match converted {
            Ok(load) => Ok(Some(load)),
            Err(VllmMetricsError::Invalid(source)) => Err(LoadError::Invalid {
                url: self.url.clone(),
                source,
            }),
            Err(error) => Err(LoadError::Decode {
                url: self.url.clone(),
                source: Box::new(error),
            }),
        }
    }

    fn kind(&self) -> &'static str {
        METRICS_KIND
    }

    fn load_url(&self) -> &str {
        &self.url
    }
}

/// `http://host:port[/prefix][/]` → `http://host:port[/prefix]/metrics`.
fn metrics_url(base: &str) -> Result<String, BackendError> {
    let invalid = |reason| BackendError::InvalidAddress {
        url: base.to_owned(),
        reason,
    };
    let parsed = reqwest::Url::parse(base).map_err(|_| invalid("expected an http:// URL"))?;
    if parsed.scheme() != "http" {
        return Err(invalid("expected an http:// URL"));
    }
    if parsed.host_str().is_none_or(str::is_empty) {
        return Err(invalid("missing host"));
    }
    if parsed.query().is_some() || parsed.fragment().is_some() {
        return Err(invalid("expected no query or fragment"));
    }
    Ok(format!("{}/metrics", base.trim_end_matches('/')))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_url_appends_the_path() {
        assert_eq!(
            metrics_url("http://127.0.0.1:8000").unwrap(),
            "http://127.0.0.1:8000/metrics"
        );
        assert_eq!(
            metrics_url("http://engine:8000/").unwrap(),
            "http://engine:8000/metrics"
        );
        assert_eq!(
            metrics_url("http://gw:80/vllm-0").unwrap(),
            "http://gw:80/vllm-0/metrics"
        );
        for (base, reason) in [
            ("grpc://127.0.0.1:50051", "expected an http:// URL"),
            ("https://engine:8000", "expected an http:// URL"),
            ("engine:8000", "expected an http:// URL"),
            ("not a url", "expected an http:// URL"),
            ("http://engine:8000/?x=1", "expected no query or fragment"),
        ] {
            match metrics_url(base) {
                Err(BackendError::InvalidAddress { url, reason: why }) => {
                    assert_eq!((url.as_str(), why), (base, reason));
                }
                other => panic!("{base}: {other:?}"),
            }
        }
    }
}
