//! vLLM's Prometheus `/metrics` over HTTP: the [`LoadSource`] shell around
//! [`VllmMetricsConverter`].

use std::time::{Duration, Instant};

use async_trait::async_trait;
use load_protocols::WorkerLoad;
use load_transport::http::{ReportClient, ReportFormat, ReportUrl, http_base};
use parking_lot::Mutex;
use policy_core::{BackendError, BackendSpec, LoadError, LoadSource};

use crate::{VllmMetricsConverter, VllmMetricsError};

/// The backend name of [`VllmMetricsLoadSource`].
pub const METRICS_KIND: &str = "vllm";

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
/// - a `Content-Type` other than `text/plain` (or OpenMetrics text) →
///   [`LoadError::ContentType`] (a response without one is read);
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
    url: ReportUrl,
    client: ReportClient,
    deadline: Duration,
    converter: Mutex<VllmMetricsConverter>,
}

impl VllmMetricsLoadSource {
    /// Builds the source; `load_url`, when given, replaces the worker URL as
    /// the base that `/metrics` is appended to.
    pub fn new(spec: &BackendSpec) -> Result<VllmMetricsLoadSource, BackendError> {
        let base = http_base(spec.load_url.as_deref().unwrap_or(&spec.worker_url))?;
        let url = ReportUrl::new(
            &base,
            "/metrics",
            ReportFormat::PrometheusText,
            "vllm /metrics",
            &spec.options,
        )?;
        Ok(VllmMetricsLoadSource {
            client: ReportClient::new(url.as_str(), &spec.options)?,
            url,
            deadline: spec.options.deadline,
            converter: Mutex::new(VllmMetricsConverter::new()),
        })
    }

    /// Fetches the whole body as text, within the cap.
    async fn fetch_text(&self) -> Result<String, LoadError> {
        let body = self.client.get(&self.url).await?;
        String::from_utf8(body.into()).map_err(|source| LoadError::Decode {
            url: self.url.as_str().to_owned(),
            source: Box::new(source),
        })
    }
}

#[async_trait]
impl LoadSource for VllmMetricsLoadSource {
    async fn fetch(&self) -> Result<Option<WorkerLoad>, LoadError> {
        let text = tokio::time::timeout(self.deadline, self.fetch_text())
            .await
            .map_err(|_elapsed| LoadError::Timeout {
                url: self.url.as_str().to_owned(),
                deadline: self.deadline,
            })??;
        let observed_at = Instant::now();
        let converted = self.converter.lock().convert_text(&text, observed_at);
        match converted {
            Ok(load) => Ok(Some(load)),
            Err(VllmMetricsError::Invalid(source)) => Err(LoadError::Invalid {
                url: self.url.as_str().to_owned(),
                source,
            }),
            Err(error) => Err(LoadError::Decode {
                url: self.url.as_str().to_owned(),
                source: Box::new(error),
            }),
        }
    }

    fn kind(&self) -> &'static str {
        METRICS_KIND
    }

    fn load_url(&self) -> &str {
        self.url.as_str()
    }
}
