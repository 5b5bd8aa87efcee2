//! OpenTelemetry traces of generation requests (`[tracing]`,
//! `docs/observability.md`).
//!
//! Each traced request is one `receive` span (kind server), a child of the
//! client's `traceparent` when it sent one, that ends when the answer's
//! last byte has gone (the `finish`). Under it: `admission` (the wait at
//! the gate, with `queued` and `rejected` events), `selection` (the
//! policy, the chosen worker, its score) and one `dispatch` (kind client)
//! per attempt, whose context is the `traceparent` the engine gets, with a
//! `first_token` event, and `worker_ejected` when its failure ejected the
//! worker. A retry is a second `selection` and `dispatch`, and a `retry`
//! event on `receive`.
//!
//! With tracing off nothing here runs: a request carries no trace, and the
//! client's own `traceparent` goes on to the engine untouched, as every
//! other end-to-end header does.

use std::time::Duration;

use http::{HeaderMap, HeaderName, HeaderValue};
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{
    Span as _, SpanKind, Status, TraceContextExt as _, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracer, SdkTracerProvider,
};
use worker_h1::HeaderLines;

use crate::config::TracingConfig;
use crate::error::RouterError;

/// The W3C trace context headers: replaced on the way to the engine by the
/// dispatch span's own when tracing is on.
const TRACE_HEADERS: [&str; 2] = ["traceparent", "tracestate"];

/// The instrumentation scope's name on every span.
const SCOPE: &str = "llm-router";

/// The router's tracer, or nothing when `[tracing]` is off.
#[derive(Debug, Default)]
pub(crate) struct Telemetry {
    exporting: Option<Exporting>,
}

#[derive(Debug)]
struct Exporting {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
}

impl Telemetry {
    /// Starts the OTLP/gRPC exporter `config` names (it connects lazily, so
    /// a collector that is down costs dropped spans, never a request).
    /// Must run inside the tokio runtime, which carries the exporter's
    /// connection.
    pub(crate) fn new(config: &TracingConfig) -> Result<Telemetry, RouterError> {
        if !config.enabled {
            return Ok(Telemetry::default());
        }
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(config.otlp_endpoint.clone())
            .build()
            .map_err(|source| RouterError::Tracing {
                endpoint: config.otlp_endpoint.clone(),
                source,
            })?;
        let batches = BatchConfigBuilder::default()
            .with_scheduled_delay(Duration::from_millis(config.export_interval_ms))
            .build();
        let processor = BatchSpanProcessor::builder(exporter)
            .with_batch_config(batches)
            .build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                config.sample_ratio,
            ))))
            .with_resource(
                Resource::builder()
                    .with_service_name(config.service_name.clone())
                    .build(),
            )
            .build();
        let tracer = provider.tracer(SCOPE);
        Ok(Telemetry {
            exporting: Some(Exporting { provider, tracer }),
        })
    }

    /// The trace of a request with `headers` to `path`: `None` with tracing
    /// off, or when the sampler leaves it out.
    pub(crate) fn request(&self, headers: &HeaderMap, path: &'static str) -> Option<RequestTrace> {
        let exporting = self.exporting.as_ref()?;
        let parent = TraceContextPropagator::new().extract(&HeaderExtractor(headers));
        let span = exporting
            .tracer
            .span_builder("receive")
            .with_kind(SpanKind::Server)
            .with_attributes([
                KeyValue::new("http.request.method", "POST"),
                KeyValue::new("url.path", path),
            ])
            .start_with_context(&exporting.tracer, &parent);
        if !span.span_context().is_sampled() {
            return None;
        }
        let mut forwarded = headers.clone();
        for name in TRACE_HEADERS {
            forwarded.remove(name);
        }
        Some(RequestTrace {
            receive: parent.with_span(span),
            tracer: exporting.tracer.clone(),
            forwarded: HeaderLines::forwarded_from_map(&forwarded),
        })
    }

    /// Sends the spans still buffered, waiting up to `timeout`; called as
    /// the router stops.
    pub(crate) async fn shutdown(&self, timeout: Duration) {
        let Some(exporting) = self.exporting.as_ref() else {
            return;
        };
        let provider = exporting.provider.clone();
        // The SDK's shutdown blocks its caller until the exporter's thread
        // is done: not on a runtime thread.
        let stopped =
            tokio::task::spawn_blocking(move || provider.shutdown_with_timeout(timeout)).await;
        match stopped {
            Ok(Ok(())) => {}
            Ok(Err(error)) => tracing::warn!(%error, "tracing: spans not all exported at shutdown"),
            Err(error) => tracing::warn!(%error, "tracing: exporter shutdown failed"),
        }
    }
}

/// One traced request: its `receive` span, and the client's headers less
/// the trace context, to which each attempt adds its own. A continuation
/// of its answer ([`crate::migration`]) carries a clone: its attempts are
/// spans of the same request.
#[derive(Debug, Clone)]
pub(crate) struct RequestTrace {
    receive: Context,
    tracer: SdkTracer,
    forwarded: HeaderLines,
}

/// Ends a request's `receive` span when dropped. The client's answer body
/// holds it, so the span ends with the answer's last byte (or the client
/// leaving), even while a hedge's detached attempt still holds the request.
#[derive(Debug)]
pub(crate) struct ReceiveEnd(Context);

impl Drop for ReceiveEnd {
    fn drop(&mut self) {
        self.0.span().end();
    }
}

impl RequestTrace {
    /// Notes facts of the request read from its body.
    pub(crate) fn describe(&self, streaming: bool, prompt_tokens: Option<u64>) {
        let span = self.receive.span();
        span.set_attribute(KeyValue::new("llm_router.streaming", streaming));
        if let Some(tokens) = prompt_tokens {
            span.set_attribute(KeyValue::new(
                "llm_router.prompt_tokens",
                i64::try_from(tokens).unwrap_or(i64::MAX),
            ));
        }
    }

    /// The `admission` span, open until the returned guard drops.
    pub(crate) fn admission(&self, priority: i32, tenant: &str) -> SpanGuard {
        SpanGuard(self.child(
            "admission",
            SpanKind::Internal,
            vec![
                KeyValue::new("llm_router.priority", i64::from(priority)),
                KeyValue::new("llm_router.tenant", tenant.to_owned()),
            ],
        ))
    }

    /// Records the policy's choice as a `selection` span.
    pub(crate) fn selection(&self, choice: &Selection<'_>) {
        let mut attributes = vec![
            KeyValue::new("llm_router.policy", choice.policy.to_owned()),
            KeyValue::new("llm_router.worker.url", choice.worker_url.to_owned()),
            KeyValue::new("llm_router.worker.id", choice.worker_id.to_string()),
            KeyValue::new("llm_router.score", choice.score),
            KeyValue::new(
                "llm_router.cached_tokens",
                i64::try_from(choice.cached_tokens).unwrap_or(i64::MAX),
            ),
            KeyValue::new("llm_router.attempt", i64::from(choice.attempt)),
        ];
        if let Some(sent_tokens) = choice.tokens {
            attributes.push(KeyValue::new(
                "llm_router.dispatched_tokens",
                i64::try_from(sent_tokens).unwrap_or(i64::MAX),
            ));
        }
        let mut span = self.child("selection", SpanKind::Internal, attributes);
        span.end();
    }

    /// A `retry` event on `receive`, before another attempt.
    pub(crate) fn retry(&self, attempt: u32, reason: &str) {
        self.receive.span().add_event(
            "retry",
            vec![
                KeyValue::new("llm_router.attempt", i64::from(attempt)),
                KeyValue::new("llm_router.reason", reason.to_owned()),
            ],
        );
    }

    /// Attempt `attempt` sent no event within `waited`, so the request also
    /// went to another worker.
    pub(crate) fn hedge(&self, attempt: u32, waited: Duration) {
        self.receive.span().add_event(
            "hedge",
            vec![
                KeyValue::new("llm_router.attempt", i64::from(attempt)),
                KeyValue::new(
                    "llm_router.waited_ms",
                    i64::try_from(waited.as_millis()).unwrap_or(i64::MAX),
                ),
            ],
        );
    }

    /// The answer broke (`reason`: `cut`, `stalled`, …) and is continued on
    /// another worker.
    pub(crate) fn migration(&self, reason: &'static str) {
        self.receive.span().add_event(
            "migration",
            vec![KeyValue::new("llm_router.reason", reason)],
        );
    }

    /// What ends the `receive` span when the client's answer is dropped.
    pub(crate) fn end_with_answer(&self) -> ReceiveEnd {
        ReceiveEnd(self.receive.clone())
    }

    /// The status the client got.
    pub(crate) fn answered(&self, status: http::StatusCode) {
        let span = self.receive.span();
        span.set_attribute(KeyValue::new(
            "http.response.status_code",
            i64::from(status.as_u16()),
        ));
        if status.is_server_error() {
            span.set_status(Status::error(status.to_string()));
        }
    }

    /// Opens the `dispatch` span of one attempt on the worker at
    /// `worker_url`: the headers to send (the client's, with this span as
    /// their `traceparent`) and the span, which the attempt's tracker holds
    /// to the answer's end.
    pub(crate) fn dispatch(&self, worker_url: &str, attempt: u32) -> DispatchTrace {
        let span = self.child(
            "dispatch",
            SpanKind::Client,
            vec![
                KeyValue::new("server.address", worker_url.to_owned()),
                KeyValue::new("llm_router.attempt", i64::from(attempt)),
            ],
        );
        let context = self.receive.with_span(span);
        let mut headers = self.forwarded.clone();
        let mut injected = HeaderInjector::default();
        TraceContextPropagator::new().inject_context(&context, &mut injected);
        for (name, value) in injected.0 {
            headers.append(&name, &value);
        }
        DispatchTrace {
            context,
            _receive: self.receive.clone(),
            headers,
        }
    }

    fn child(
        &self,
        name: &'static str,
        kind: SpanKind,
        attributes: Vec<KeyValue>,
    ) -> opentelemetry_sdk::trace::Span {
        self.tracer
            .span_builder(name)
            .with_kind(kind)
            .with_attributes(attributes)
            .start_with_context(&self.tracer, &self.receive)
    }
}

/// What [`RequestTrace::selection`] records.
#[derive(Debug)]
pub(crate) struct Selection<'a> {
    pub(crate) policy: &'a str,
    pub(crate) worker_url: &'a str,
    pub(crate) worker_id: policy_core::WorkerId,
    pub(crate) score: f64,
    pub(crate) cached_tokens: u64,
    pub(crate) tokens: Option<u64>,
    pub(crate) attempt: u32,
}

/// A span that ends when this drops.
#[derive(Debug)]
pub(crate) struct SpanGuard(opentelemetry_sdk::trace::Span);

impl SpanGuard {
    pub(crate) fn event(&mut self, name: &'static str, attributes: Vec<KeyValue>) {
        self.0.add_event(name, attributes);
    }

    pub(crate) fn set(&mut self, attribute: KeyValue) {
        self.0.set_attribute(attribute);
    }
}

/// One attempt's `dispatch` span and the headers that carry it to the
/// engine. It holds the request's `receive` span too, so that a stream's
/// `receive` ends with its last byte, after the handler has returned.
#[derive(Debug)]
pub(crate) struct DispatchTrace {
    // Dropped in this order: the attempt's span ends before the request's.
    context: Context,
    _receive: Context,
    pub(crate) headers: HeaderLines,
}

impl DispatchTrace {
    /// The worker's response head arrived with `status`.
    pub(crate) fn answered(&self, status: http::StatusCode) {
        let span = self.context.span();
        span.set_attribute(KeyValue::new(
            "http.response.status_code",
            i64::from(status.as_u16()),
        ));
        if status.is_server_error() {
            span.set_status(Status::error(status.to_string()));
        }
    }

    /// The first token passed, `ttft_s` after the request arrived.
    pub(crate) fn first_token(&self, ttft_s: f64) {
        self.context.span().add_event(
            "first_token",
            vec![KeyValue::new("llm_router.ttft_s", ttft_s)],
        );
    }

    /// The attempt failed (`reason`), and ejected the worker for
    /// `ejected_for` when that is set.
    pub(crate) fn failed(&self, reason: &'static str, ejected_for: Option<Duration>) {
        let span = self.context.span();
        span.set_status(Status::error(reason));
        if let Some(ejected_for) = ejected_for {
            span.add_event(
                "worker_ejected",
                vec![KeyValue::new(
                    "llm_router.ejected_for_s",
                    ejected_for.as_secs_f64(),
                )],
            );
        }
    }
}

struct HeaderExtractor<'a>(&'a HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|value| value.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(HeaderName::as_str).collect()
    }
}

#[derive(Default)]
struct HeaderInjector(Vec<(HeaderName, HeaderValue)>);

impl Injector for HeaderInjector {
    fn set(&mut self, key: &str, value: String) {
        // The propagator writes only `traceparent` and `tracestate`, with
        // values of its own making: anything else is dropped, not sent.
        if let (Ok(name), Ok(value)) = (
            HeaderName::try_from(key),
            HeaderValue::try_from(value.as_str()),
        ) {
            self.0.push((name, value));
        }
    }
}
