//! `SglangHttpLoadSource`: `GET /v1/loads?include=core`, falling back to
//! `/metrics` on servers that lack it.

use std::time::Duration;

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use load_protocols::{LoadsResponse, WorkerLoad};
use parking_lot::Mutex;
use policy_core::{BackendError, LoadError, LoadSource, SourceOptions};
use reqwest::StatusCode;
use reqwest::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE, HeaderValue};

use crate::{MetricsError, worker_load_from_loads_json, worker_load_from_metrics_text};

/// While a server is read through `/metrics`, every this many polls
/// `/v1/loads` is tried again first (a server upgraded in place gains it).
pub const DEFAULT_REPROBE_EVERY_POLLS: u32 = 30;

/// Which SGLang endpoint a [`SglangHttpLoadSource`] currently reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SglangHttpEndpoint {
    /// `GET /v1/loads?include=core` (JSON).
    Loads,
    /// `GET /metrics` (Prometheus text), for servers without `/v1/loads`.
    Metrics,
}

/// SGLang's load over HTTP.
///
/// Polls `GET {base}/v1/loads?include=core`. A server that answers 404, 405 or
/// 501 there lacks the endpoint: the source switches to `GET {base}/metrics`
/// in the same poll, remembers it, and tries `/v1/loads` again every
/// [`reprobe_every_polls`](SglangHttpLoadSource::reprobe_every_polls) polls.
/// A re-probe that fails in any other way also falls back to `/metrics`.
///
/// Each poll (both requests, if it falls back) runs under the deadline of
/// [`SourceOptions`]; the body is read in chunks and abandoned past the body
/// cap; the API key goes out as a bearer token; `/v1/loads` must answer JSON
/// and `/metrics` text. An empty `loads` list is `Ok(None)`.
///
/// Proxies from the environment are not used: the router talks to its
/// workers directly.
#[derive(Debug)]
pub struct SglangHttpLoadSource {
    client: reqwest::Client,
    base_url: String,
    loads_url: String,
    metrics_url: String,
    deadline: Duration,
    body_limit_bytes: usize,
    authorization: Option<HeaderValue>,
    reprobe_every_polls: u32,
    detection: Mutex<Detection>,
}

#[derive(Debug, Clone, Copy)]
struct Detection {
    endpoint: SglangHttpEndpoint,
    polls_since_probe: u32,
}

enum Format {
    Json,
    Text,
}

impl SglangHttpLoadSource {
    /// A source polling `base_url` (`http://host:port`, optionally with a
    /// path prefix; a trailing `/` is ignored).
    ///
    /// Fails with [`BackendError::InvalidAddress`] for anything but an
    /// `http://` URL with a host (this build has no TLS), and with
    /// [`BackendError::Client`] for an API key that cannot be a header value.
    pub fn new(
        base_url: &str,
        options: &SourceOptions,
    ) -> Result<SglangHttpLoadSource, BackendError> {
        let base_url = crate::address::http_base(base_url)?;
        let client_error =
            |source: Box<dyn std::error::Error + Send + Sync>| BackendError::Client {
                url: base_url.clone(),
                source,
            };
        let authorization = options
            .api_key
            .as_ref()
            .map(|key| {
                HeaderValue::from_str(&format!("Bearer {key}")).map(|mut value| {
                    value.set_sensitive(true);
                    value
                })
            })
            .transpose()
            .map_err(|source| client_error(source.into()))?;
        let client = reqwest::Client::builder()
            .connect_timeout(options.deadline)
            .no_proxy()
            .build()
            .map_err(|source| client_error(source.into()))?;
        Ok(SglangHttpLoadSource {
            client,
            loads_url: format!("{base_url}/v1/loads?include=core"),
            metrics_url: format!("{base_url}/metrics"),
            base_url,
            deadline: options.deadline,
            body_limit_bytes: options.body_limit_bytes,
            authorization,
            reprobe_every_polls: DEFAULT_REPROBE_EVERY_POLLS,
            detection: Mutex::new(Detection {
                endpoint: SglangHttpEndpoint::Loads,
                polls_since_probe: 0,
            }),
        })
    }

    /// Sets how often (in polls) `/v1/loads` is re-probed while on `/metrics`;
    /// 0 and 1 both mean every poll.
    #[must_use]
    pub fn reprobe_every_polls(mut self, polls: u32) -> SglangHttpLoadSource {
        self.reprobe_every_polls = polls.max(1);
        self
    }

    /// The endpoint the next poll starts from (before any re-probe).
    pub fn endpoint(&self) -> SglangHttpEndpoint {
        self.detection.lock().endpoint
    }

    async fn poll(&self) -> Result<Option<WorkerLoad>, LoadError> {
        // (try /v1/loads first, the source is currently on /v1/loads)
        let (probe_loads, on_loads) = {
            let mut detection = self.detection.lock();
            match detection.endpoint {
                SglangHttpEndpoint::Loads => (true, true),
                SglangHttpEndpoint::Metrics => {
                    detection.polls_since_probe += 1;
                    let due = detection.polls_since_probe >= self.reprobe_every_polls;
                    if due {
                        detection.polls_since_probe = 0;
                    }
                    (due, false)
                }
            }
        };
        if probe_loads {
            match self.fetch_loads().await {
                Ok(load) => {
                    self.switch_to(SglangHttpEndpoint::Loads);
                    return Ok(load);
                }
                Err(LoadError::Unsupported { .. }) => {
                    if on_loads {
                        tracing::info!(
                            url = %self.base_url,
                            "no /v1/loads on this SGLang server; reading /metrics"
                        );
                    }
                    self.switch_to(SglangHttpEndpoint::Metrics);
                }
                Err(error) if on_loads => return Err(error),
                Err(error) => {
                    tracing::debug!(url = %self.base_url, %error, "/v1/loads re-probe failed");
                }
            }
        }
        self.fetch_metrics().await
    }

    fn switch_to(&self, endpoint: SglangHttpEndpoint) {
        let mut detection = self.detection.lock();
        if detection.endpoint != endpoint {
            *detection = Detection {
                endpoint,
                polls_since_probe: 0,
            };
        }
    }

    async fn fetch_loads(&self) -> Result<Option<WorkerLoad>, LoadError> {
        let body = self.get(&self.loads_url, Format::Json).await?;
        let response: LoadsResponse =
            serde_json::from_slice(&body).map_err(|source| LoadError::Decode {
                url: self.loads_url.clone(),
                source: source.into(),
            })?;
        worker_load_from_loads_json(response).map_err(|source| LoadError::Invalid {
            url: self.loads_url.clone(),
            source,
        })
    }

    async fn fetch_metrics(&self) -> Result<Option<WorkerLoad>, LoadError> {
        let body = self.get(&self.metrics_url, Format::Text).await?;
        let text = std::str::from_utf8(&body).map_err(|source| LoadError::Decode {
            url: self.metrics_url.clone(),
            source: source.into(),
        })?;
        match worker_load_from_metrics_text(text) {
            Ok(load) => Ok(Some(load)),
            Err(MetricsError::Parse(source)) => Err(LoadError::Decode {
                url: self.metrics_url.clone(),
                source: source.into(),
            }),
            Err(MetricsError::NoLoadGauges) => Err(LoadError::Unsupported {
                url: self.metrics_url.clone(),
                what: "SGLang load gauges",
            }),
            Err(MetricsError::Invalid(source)) => Err(LoadError::Invalid {
                url: self.metrics_url.clone(),
                source,
            }),
        }
    }

    /// One GET: status, content type and a capped, streamed body.
    async fn get(&self, url: &str, format: Format) -> Result<Bytes, LoadError> {
        let accept = match format {
            Format::Json => "application/json",
            Format::Text => "text/plain",
        };
        let mut request = self.client.get(url).header(ACCEPT, accept);
        if let Some(authorization) = &self.authorization {
            request = request.header(AUTHORIZATION, authorization.clone());
        }
        let mut response = request
            .send()
            .await
            .map_err(|error| self.error(url, error))?;
        let status = response.status();
        if matches!(
            status,
            StatusCode::NOT_FOUND | StatusCode::METHOD_NOT_ALLOWED | StatusCode::NOT_IMPLEMENTED
        ) {
            return Err(LoadError::Unsupported {
                url: url.to_owned(),
                what: match format {
                    Format::Json => "/v1/loads",
                    Format::Text => "/metrics",
                },
            });
        }
        if status != StatusCode::OK {
            return Err(LoadError::HttpStatus {
                url: url.to_owned(),
                status: status.as_u16(),
            });
        }
        check_content_type(url, &response, format)?;
        let too_large = || LoadError::BodyTooLarge {
            url: url.to_owned(),
            limit_bytes: self.body_limit_bytes,
        };
        let declared = response.content_length().unwrap_or(0);
        if usize::try_from(declared).map_or(true, |declared| declared > self.body_limit_bytes) {
            return Err(too_large());
        }
        let mut body = BytesMut::new();
        while let Some(chunk) = response
            .chunk()
            .await
            .map_err(|error| self.error(url, error))?
        {
            if body.len().saturating_add(chunk.len()) > self.body_limit_bytes {
                return Err(too_large());
            }
            body.extend_from_slice(&chunk);
        }
        Ok(body.freeze())
    }

    fn error(&self, url: &str, error: reqwest::Error) -> LoadError {
        let url = url.to_owned();
        if error.is_timeout() {
            LoadError::Timeout {
                url,
                deadline: self.deadline,
            }
        } else if error.is_connect() {
            LoadError::Connect {
                url,
                source: error.into(),
            }
        } else if error.is_body() || error.is_decode() {
            // The body ended early or broke off: a truncated report.
            LoadError::Decode {
                url,
                source: error.into(),
            }
        } else {
            LoadError::Transport {
                url,
                source: error.into(),
            }
        }
    }
}

#[async_trait]
impl LoadSource for SglangHttpLoadSource {
    async fn fetch(&self) -> Result<Option<WorkerLoad>, LoadError> {
        tokio::time::timeout(self.deadline, self.poll())
            .await
            .unwrap_or_else(|_elapsed| {
                Err(LoadError::Timeout {
                    url: self.base_url.clone(),
                    deadline: self.deadline,
                })
            })
    }

    fn kind(&self) -> &'static str {
        "sglang"
    }

    fn load_url(&self) -> &str {
        &self.base_url
    }
}

fn check_content_type(
    url: &str,
    response: &reqwest::Response,
    format: Format,
) -> Result<(), LoadError> {
    let raw = response
        .headers()
        .get(CONTENT_TYPE)
        .map(|value| String::from_utf8_lossy(value.as_bytes()).into_owned())
        .unwrap_or_default();
    let essence = raw
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    let (ok, expected) = match format {
        Format::Json => (
            essence == "application/json"
                || (essence.starts_with("application/") && essence.ends_with("+json")),
            "application/json",
        ),
        Format::Text => (
            essence == "text/plain" || essence == "application/openmetrics-text",
            "text/plain",
        ),
    };
    if ok {
        Ok(())
    } else {
        Err(LoadError::ContentType {
            url: url.to_owned(),
            content_type: raw,
            expected,
        })
    }
}
