//! `SglangHttpLoadSource`: `GET /v1/loads?include=core`, falling back to
//! `/metrics` on servers that lack it.

use std::time::Duration;

use async_trait::async_trait;
use load_protocols::{LoadsResponse, WorkerLoad};
use load_transport::http::{ReportClient, ReportFormat, ReportUrl, http_base};
use parking_lot::Mutex;
use policy_core::{BackendError, LoadError, LoadSource, SourceOptions};

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
/// and `/metrics` Prometheus text (or no content type). An empty `loads` list
/// is `Ok(None)`. The request and its errors are
/// [`ReportClient::get`](load_transport::http::ReportClient::get)'s.
///
/// Proxies from the environment are not used: the router talks to its
/// workers directly.
#[derive(Debug)]
pub struct SglangHttpLoadSource {
    client: ReportClient,
    base_url: String,
    loads_url: ReportUrl,
    metrics_url: ReportUrl,
    deadline: Duration,
    reprobe_every_polls: u32,
    detection: Mutex<Detection>,
}

#[derive(Debug, Clone, Copy)]
struct Detection {
    endpoint: SglangHttpEndpoint,
    polls_since_probe: u32,
}

impl SglangHttpLoadSource {
    /// A source polling `base_url` (`http://host:port` or
    /// `https://host:port`, optionally with a path prefix; a trailing `/` is
    /// ignored). An `https://` worker is polled over TLS, trusting
    /// `options.ca_file` or the system's roots.
    ///
    /// Fails with [`BackendError::InvalidAddress`] for anything but an
    /// `http://` or `https://` URL with a host, and with
    /// [`BackendError::Client`] for an API key that cannot be a header value
    /// or a CA file (or system store) that cannot be loaded.
    pub fn new(
        base_url: &str,
        options: &SourceOptions,
    ) -> Result<SglangHttpLoadSource, BackendError> {
        let base_url = http_base(base_url)?;
        Ok(SglangHttpLoadSource {
            client: ReportClient::new(&base_url, options)?,
            loads_url: ReportUrl::new(
                &base_url,
                "/v1/loads?include=core",
                ReportFormat::Json,
                "/v1/loads",
                options,
            )?,
            metrics_url: ReportUrl::new(
                &base_url,
                "/metrics",
                ReportFormat::PrometheusText,
                "/metrics",
                options,
            )?,
            base_url,
            deadline: options.deadline,
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
        let url = &self.loads_url;
        let body = self.client.get(url).await?;
        let response: LoadsResponse =
            serde_json::from_slice(&body).map_err(|source| LoadError::Decode {
                url: url.as_str().to_owned(),
                source: source.into(),
            })?;
        worker_load_from_loads_json(response).map_err(|source| LoadError::Invalid {
            url: url.as_str().to_owned(),
            source,
        })
    }

    async fn fetch_metrics(&self) -> Result<Option<WorkerLoad>, LoadError> {
        let url = self.metrics_url.as_str();
        let body = self.client.get(&self.metrics_url).await?;
        let text = std::str::from_utf8(&body).map_err(|source| LoadError::Decode {
            url: url.to_owned(),
            source: source.into(),
        })?;
        match worker_load_from_metrics_text(text) {
            Ok(load) => Ok(Some(load)),
            Err(MetricsError::Parse(source)) => Err(LoadError::Decode {
                url: url.to_owned(),
                source: source.into(),
            }),
            Err(MetricsError::NoLoadGauges) => Err(LoadError::Unsupported {
                url: url.to_owned(),
                what: "SGLang load gauges",
            }),
            Err(MetricsError::Invalid(source)) => Err(LoadError::Invalid {
                url: url.to_owned(),
                source,
            }),
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
