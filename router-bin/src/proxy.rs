//! The proxy: choose a worker, forward the request, stream the response back
//! unbuffered, and tell the policy when the first token passes.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use policy_core::{DispatchGuard, RequestInfo, WorkerId, tokio_now};

use crate::app::App;
use crate::coalesce::Coalesce;
use crate::estimate::request_info;
use crate::monitor::error_chain;
use crate::upstream::{UpstreamBody, control_get};
use crate::workers::Worker;

/// An OpenAI-shaped error response: `{"error": {"message", "type"}}`.
pub fn error_response(status: StatusCode, kind: &str, message: impl Into<String>) -> Response {
    let body = serde_json::json!({"error": {"message": message.into(), "type": kind}});
    (status, axum::Json(body)).into_response()
}

fn unavailable(message: &str) -> Response {
    let mut response = error_response(StatusCode::SERVICE_UNAVAILABLE, "unavailable", message);
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    response
}

/// Headers that describe one hop, never forwarded (RFC 9110 §7.6.1).
const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "proxy-connection",
];

fn forwardable(headers: &HeaderMap) -> HeaderMap {
    // Names listed in `Connection` are hop-by-hop too.
    let listed: Vec<String> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .map(|name| name.trim().to_ascii_lowercase())
        .collect();
    let mut out = HeaderMap::with_capacity(headers.len());
    for (name, value) in headers {
        let name_text = name.as_str();
        if HOP_BY_HOP.contains(&name_text)
            || listed.iter().any(|listed| listed == name_text)
            || name == header::HOST
            || name == header::CONTENT_LENGTH
        {
            continue;
        }
        out.append(name.clone(), value.clone());
    }
    out
}

/// `POST /v1/chat/completions`, `/v1/completions`, `/generate`.
pub async fn generate(State(app): State<Arc<App>>, request: Request) -> Response {
    let received_at = Instant::now();
    let (parts, body) = request.into_parts();
    let body = match axum::body::to_bytes(body, app.config.server.body_limit_bytes).await {
        Ok(body) => body,
        Err(_) => {
            return error_response(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                format!(
                    "request body exceeds {} bytes (server.body_limit_bytes)",
                    app.config.server.body_limit_bytes
                ),
            );
        }
    };
    let parsed: serde_json::Value = match serde_json::from_slice(&body) {
        Ok(parsed @ serde_json::Value::Object(_)) => parsed,
        Ok(_) => {
            return error_response(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "request body must be a JSON object",
            );
        }
        Err(error) => {
            return error_response(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                format!("request body is not valid JSON: {error}"),
            );
        }
    };
    let info = request_info(&parsed, app.config.request.chars_per_token);
    let headers = forwardable(&parts.headers);
    forward(app, &parts, headers, body, info, received_at).await
}

async fn forward(
    app: Arc<App>,
    parts: &http::request::Parts,
    headers: HeaderMap,
    body: Bytes,
    info: RequestInfo,
    received_at: Instant,
) -> Response {
    let mut tried: Vec<WorkerId> = Vec::new();
    let attempts = app.config.server.max_retries + 1;
    let mut last_failure = "no worker is healthy";
    for attempt in 0..attempts {
        let all = app.workers.candidates();
        let untried: Vec<WorkerId>;
        let candidates: &[WorkerId] = if tried.is_empty() {
            &all
        } else {
            untried = all
                .iter()
                .copied()
                .filter(|id| !tried.contains(id))
                .collect();
            &untried
        };
        if candidates.is_empty() {
            break;
        }
        let policy = app.policy();
        let Some(dispatch) = policy.select(candidates, &info, tokio_now()) else {
            app.metrics.rejected.inc();
            return unavailable("every worker is at capacity (policy cap); retry shortly");
        };
        let guard = DispatchGuard::new(policy.clone(), dispatch);
        let Some(worker) = app.workers.get(dispatch.worker) else {
            tried.push(dispatch.worker);
            continue;
        };
        worker.metrics.selections.inc();
        worker.metrics.dispatched_tokens.inc_by(dispatch.tokens);
        app.metrics.selected_score.observe(dispatch.score);
        if attempt > 0 {
            app.metrics.retries.inc();
        }
        let Some(upstream) = upstream_request(&worker, parts, &headers, &body) else {
            // Config validation rejects such URLs; a worker added some other
            // way is skipped rather than trusted.
            tracing::warn!(worker = %worker.url, "worker URL does not parse; skipping it");
            tried.push(worker.id);
            continue;
        };
        let tracker = RequestTracker::new(guard, worker.clone(), received_at);
        let answer = tokio::time::timeout(
            app.config.server.first_byte_timeout(),
            app.upstream.request(upstream),
        )
        .await;
        match answer {
            Ok(Ok(response)) if !response.status().is_server_error() => {
                return respond(&app, tracker, response, info.streaming);
            }
            Ok(Ok(response)) => {
                worker
                    .metrics
                    .request_status(&app.metrics, response.status().as_str());
                last_failure = "workers answered with server errors";
                tracing::debug!(worker = %worker.url, status = %response.status(), "worker answered 5xx; retrying");
            }
            Ok(Err(error)) => {
                worker.metrics.request_status(&app.metrics, "error");
                last_failure = "workers could not be reached";
                tracing::debug!(worker = %worker.url, error = %error_chain(&error), "worker unreachable; retrying");
            }
            Err(_elapsed) => {
                worker.metrics.request_status(&app.metrics, "timeout");
                last_failure = "workers did not answer in time";
            }
        }
        // Nothing reached the client yet, so another worker may take it.
        passive_failure(&app, &worker);
        tried.push(worker.id);
        drop(tracker);
    }
    app.metrics.rejected.inc();
    unavailable(last_failure)
}

/// The client's request, addressed to `worker`, with the worker's key.
/// `None` if the worker's URL does not make a URI.
fn upstream_request(
    worker: &Worker,
    parts: &http::request::Parts,
    headers: &HeaderMap,
    body: &Bytes,
) -> Option<http::Request<UpstreamBody>> {
    let uri = worker.uri_for(parts.uri.path(), parts.uri.query())?;
    let mut request = http::Request::new(UpstreamBody::new(body.clone()));
    *request.method_mut() = parts.method.clone();
    *request.uri_mut() = uri;
    *request.headers_mut() = headers.clone();
    if let Some(authorization) = &worker.authorization {
        request
            .headers_mut()
            .insert(header::AUTHORIZATION, authorization.clone());
    }
    Some(request)
}

fn passive_failure(app: &App, worker: &Worker) {
    let change = worker.request_failed(app.config.health.failure_threshold);
    app.apply_health_change(worker, change);
}

fn respond(
    app: &Arc<App>,
    mut tracker: RequestTracker,
    response: http::Response<Incoming>,
    streaming: bool,
) -> Response {
    let (mut parts, inner) = response.into_parts();
    tracker
        .worker
        .metrics
        .time_to_first_byte
        .observe(tracker.received_at.elapsed().as_secs_f64());
    tracker
        .worker
        .metrics
        .request_status(&app.metrics, parts.status.as_str());
    if !streaming || !parts.status.is_success() {
        // A non-streaming response's start is its first token.
        tracker.first_token();
    }
    parts.headers = forwardable(&parts.headers);
    let body = TrackedBody {
        inner: Coalesce::new(inner),
        tracker: Some(tracker),
        app: app.clone(),
        streaming,
    };
    Response::from_parts(parts, Body::new(body))
}

/// Holds a request's dispatch and in-flight count until its response ends.
struct RequestTracker {
    guard: DispatchGuard,
    worker: Arc<Worker>,
    received_at: Instant,
}

impl RequestTracker {
    fn new(guard: DispatchGuard, worker: Arc<Worker>, received_at: Instant) -> RequestTracker {
        worker.request_started();
        RequestTracker {
            guard,
            worker,
            received_at,
        }
    }

    fn first_token(&mut self) {
        if !self.guard.first_token_seen() {
            self.guard.first_token();
            self.worker
                .metrics
                .time_to_first_token
                .observe(self.received_at.elapsed().as_secs_f64());
        }
    }
}

impl Drop for RequestTracker {
    fn drop(&mut self) {
        self.worker.request_ended();
        self.worker
            .metrics
            .request_duration
            .observe(self.received_at.elapsed().as_secs_f64());
        // `guard` drops next and finishes the dispatch.
    }
}

/// The worker's body, passed through as it arrives (joined into fewer
/// frames by [`Coalesce`]). Dropping it (the body ended, or the client went
/// away) releases the dispatch.
struct TrackedBody {
    inner: Coalesce<Incoming>,
    tracker: Option<RequestTracker>,
    app: Arc<App>,
    streaming: bool,
}

impl TrackedBody {
    /// A whole response: the worker's run of failures is over, and the
    /// dispatch is released now, not when the client's connection lets go
    /// of this body.
    fn succeeded(&mut self) {
        if let Some(tracker) = self.tracker.take() {
            tracker.worker.request_succeeded();
        }
    }
}

impl http_body::Body for TrackedBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref()
                    && this.streaming
                    && let Some(tracker) = this.tracker.as_mut()
                    && !tracker.guard.first_token_seen()
                    && contains_sse_data(data)
                {
                    tracker.first_token();
                }
                if this.inner.is_end_stream() {
                    this.succeeded();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(error))) => {
                // The stream broke off: count it against the worker.
                if let Some(tracker) = this.tracker.take() {
                    tracker
                        .worker
                        .metrics
                        .request_status(&this.app.metrics, "cut");
                    passive_failure(&this.app, &tracker.worker);
                }
                Poll::Ready(Some(Err(std::io::Error::other(error))))
            }
            Poll::Ready(None) => {
                this.succeeded();
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

fn contains_sse_data(chunk: &[u8]) -> bool {
    chunk.windows(5).any(|window| window == b"data:")
}

/// `GET /v1/models`: the union of every healthy worker's models.
pub async fn models(State(app): State<Arc<App>>) -> Response {
    // Asked of every worker at once, each under the health-check timeout, so
    // one hung worker costs that timeout, not the sum.
    let timeout = std::time::Duration::from_millis(app.config.health.timeout_ms);
    let workers: Vec<Arc<Worker>> = app
        .workers
        .all()
        .into_iter()
        .filter(|worker| worker.is_healthy() && !worker.is_draining())
        .collect();
    let listings = futures::future::join_all(workers.iter().map(|worker| {
        let url = format!("{}/v1/models", worker.url);
        let upstream = &app.upstream;
        async move {
            match control_get(upstream, &url, timeout).await {
                Ok((status, body)) if status.is_success() => {
                    serde_json::from_slice::<serde_json::Value>(&body).ok()
                }
                _ => None,
            }
        }
    }))
    .await;
    // Workers in registration order; the first to list a model describes it.
    let mut seen = std::collections::BTreeMap::new();
    for listing in listings.iter().flatten() {
        for model in listing
            .get("data")
            .and_then(serde_json::Value::as_array)
            .into_iter()
            .flatten()
        {
            if let Some(id) = model.get("id").and_then(serde_json::Value::as_str) {
                seen.entry(id.to_owned()).or_insert_with(|| model.clone());
            }
        }
    }
    let data: Vec<serde_json::Value> = seen.into_values().collect();
    axum::Json(serde_json::json!({"object": "list", "data": data})).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_are_stripped() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-trace"),
        );
        headers.insert("x-trace", HeaderValue::from_static("1"));
        headers.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        headers.insert(header::HOST, HeaderValue::from_static("router"));
        headers.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer k"));
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        let out = forwardable(&headers);
        assert_eq!(out.len(), 2);
        assert!(out.contains_key(header::AUTHORIZATION));
        assert!(out.contains_key(header::CONTENT_TYPE));
    }

    #[test]
    fn sse_data_is_found_in_a_chunk() {
        assert!(contains_sse_data(b"data: {\"x\":1}\n\n"));
        assert!(contains_sse_data(b": ping\n\ndata: {}\n\n"));
        assert!(!contains_sse_data(b": keep-alive\n\n"));
        assert!(!contains_sse_data(b""));
    }
}
