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
use bytes::{Bytes, BytesMut};
use http_body::{Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use load_transport::http::{CappedBodyError, read_capped};
use policy_core::{DispatchGuard, RequestInfo, WorkerId, error_chain, tokio_now};

use crate::app::{App, SilentStream};
use crate::client_body::read_body;
use crate::coalesce::Coalesce;
use crate::estimate::{max_output_tokens, request_info};
use crate::outlier::Failure;
use crate::sse::{self, FirstDataEvent};
use crate::upstream::{UpstreamBody, control_get};
use crate::workers::Worker;

/// An OpenAI-shaped error response: `{"error": {"message", "type"}}`.
pub fn error_response(status: StatusCode, kind: &str, message: impl Into<String>) -> Response {
    let body = serde_json::json!({"error": {"message": message.into(), "type": kind}});
    (status, axum::Json(body)).into_response()
}

/// An error the router answers for a worker (a gateway error): no
/// `Retry-After`, which only the router's own lack of capacity carries.
fn gateway_error(status: StatusCode, kind: &str, message: impl Into<String>) -> Response {
    error_response(status, kind, message)
}

/// The router itself has no capacity for the request: 503 with `Retry-After`.
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
    let deadline = tokio::time::Instant::now() + app.config.server.request_deadline();
    let (parts, body) = request.into_parts();
    let server = &app.config.server;
    let body = match read_body(body, server.body_limit_bytes, server.client_body_timeout()).await {
        Ok(body) => body,
        Err(error) => {
            tracing::debug!(%error, "request body not read");
            return error.into_response();
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
    let head_timeout = app
        .config
        .server
        .head_timeout(info.streaming, max_output_tokens(&parsed));
    let headers = forwardable(&parts.headers);
    let request = ClientRequest {
        parts,
        headers,
        body,
        info,
        received_at,
        deadline,
        head_timeout,
    };
    forward(app, &request).await
}

/// A client's request, read and parsed, as every attempt sends it.
struct ClientRequest {
    parts: http::request::Parts,
    headers: HeaderMap,
    body: Bytes,
    info: RequestInfo,
    received_at: Instant,
    /// `server.request_deadline_ms` after it arrived.
    deadline: tokio::time::Instant,
    /// How long one attempt may wait for the response head.
    head_timeout: std::time::Duration,
}

/// How one attempt on one worker ended.
enum Attempt {
    /// The client's answer: the worker's response, or a final error.
    Done(Response),
    /// Nothing reached the client and no generation can have started, so
    /// another worker may take the request. `answer` is the worker's own
    /// (a 503 or 429), passed through if no other worker takes it.
    Retry {
        answer: Option<Response>,
        reason: String,
    },
}

async fn forward(app: Arc<App>, request: &ClientRequest) -> Response {
    let mut tried: Vec<WorkerId> = Vec::new();
    let mut last_answer: Option<Response> = None;
    let mut last_reason = String::new();
    for attempt in 0..=app.config.server.max_retries {
        let snapshot = app.topology.snapshot();
        let untried: Vec<WorkerId>;
        let candidates: &[WorkerId] = if tried.is_empty() {
            snapshot.candidates()
        } else {
            untried = snapshot
                .candidates()
                .iter()
                .copied()
                .filter(|id| !tried.contains(id))
                .collect();
            &untried
        };
        if candidates.is_empty() {
            break;
        }
        let policy = snapshot.policy.clone();
        let Some(dispatch) = policy.select(candidates, &request.info, tokio_now()) else {
            app.metrics.rejected.inc();
            return unavailable("every worker is at capacity (policy cap); retry shortly");
        };
        let guard = DispatchGuard::new(policy, dispatch);
        app.sync_signal.dispatched(dispatch.worker);
        let Some(worker) = snapshot.worker(dispatch.worker).cloned() else {
            tried.push(dispatch.worker);
            continue;
        };
        worker.metrics.selections.inc();
        worker.metrics.dispatched_tokens.inc_by(dispatch.tokens);
        app.metrics.selected_score.observe(dispatch.score);
        if attempt > 0 {
            app.metrics.retries.inc();
        }
        let Some(upstream) = upstream_request(&worker, request) else {
            // Config validation rejects such URLs; a worker added some other
            // way is skipped rather than trusted.
            tracing::warn!(worker = %worker.url, "worker URL does not parse; skipping it");
            tried.push(worker.id);
            continue;
        };
        if tokio::time::Instant::now() >= request.deadline {
            break;
        }
        let tracker = RequestTracker::new(guard, worker.clone(), request.received_at);
        match attempt_on(&app, tracker, upstream, request).await {
            Attempt::Done(response) => return response,
            Attempt::Retry { answer, reason } => {
                tracing::debug!(worker = %worker.url, %reason, "attempt failed before any generation; trying another worker");
                if answer.is_some() {
                    last_answer = answer;
                }
                last_reason = reason;
                tried.push(worker.id);
            }
        }
    }
    if tokio::time::Instant::now() >= request.deadline {
        return gateway_error(
            StatusCode::GATEWAY_TIMEOUT,
            "timeout",
            format!(
                "no worker answered within the request deadline (server.request_deadline_ms = {})",
                app.config.server.request_deadline_ms
            ),
        );
    }
    if let Some(answer) = last_answer {
        return answer;
    }
    app.metrics.rejected.inc();
    if tried.is_empty() {
        return unavailable("no worker is in rotation");
    }
    gateway_error(StatusCode::BAD_GATEWAY, "upstream_error", last_reason)
}

/// Sends the request to the tracker's worker and waits for its first byte:
/// the response head, and for a stream its first `data:` event.
async fn attempt_on(
    app: &Arc<App>,
    mut tracker: RequestTracker,
    upstream: http::Request<UpstreamBody>,
    request: &ClientRequest,
) -> Attempt {
    let worker = tracker.worker.clone();
    let server = &app.config.server;
    let streaming = request.info.streaming;
    let first_byte_by = tokio::time::Instant::now()
        .checked_add(request.head_timeout)
        .map_or(request.deadline, |by| by.min(request.deadline));
    let response =
        match tokio::time::timeout_at(first_byte_by, app.upstream.request(upstream)).await {
            Ok(Ok(response)) => response,
            Ok(Err(error)) => {
                // The connection failed, or closed before any answer: the
                // engine is not generating this request.
                worker.metrics.request_status(&app.metrics, "error");
                app.request_failed(&worker, Failure::Connect);
                return Attempt::Retry {
                    answer: None,
                    reason: format!(
                        "worker {} could not be reached: {}",
                        worker.url,
                        error_chain(&error)
                    ),
                };
            }
            Err(_elapsed) => {
                worker.metrics.request_status(&app.metrics, "timeout");
                app.request_failed(&worker, Failure::FirstByteTimeout);
                let reason = format!(
                    "worker {} sent no response head within {} ms (server.first_byte_timeout_ms)",
                    worker.url, server.first_byte_timeout_ms
                );
                // A streaming engine sends its head when it admits a request, so
                // a stream without one was never admitted. A non-streaming
                // answer's head comes with the answer: that engine may still be
                // generating, and running it again would do the work twice.
                if streaming {
                    return Attempt::Retry {
                        answer: None,
                        reason,
                    };
                }
                return Attempt::Done(gateway_error(
                    StatusCode::GATEWAY_TIMEOUT,
                    "timeout",
                    format!("{reason}; not retried, since the worker may still be generating it"),
                ));
            }
        };
    let status = response.status();
    worker
        .metrics
        .time_to_first_byte
        .observe(request.received_at.elapsed().as_secs_f64());
    worker.metrics.request_status(&app.metrics, status.as_str());
    if status.is_client_error() || status.is_server_error() {
        if status.is_server_error() {
            app.request_failed(&worker, Failure::ServerError(status.as_u16()));
        }
        let answer = worker_error(response, first_byte_by).await;
        // Only an engine that refused the work (overloaded, rate-limited)
        // is known not to have started it.
        if status == StatusCode::SERVICE_UNAVAILABLE || status == StatusCode::TOO_MANY_REQUESTS {
            return Attempt::Retry {
                answer: Some(answer),
                reason: format!("worker {} answered {status}", worker.url),
            };
        }
        return Attempt::Done(answer);
    }
    let (mut parts, inner) = response.into_parts();
    parts.headers = forwardable(&parts.headers);
    if !streaming {
        // A non-streaming response's head is its first token.
        tracker.first_token();
        return Attempt::Done(whole_answer(app, tracker, parts, inner, request).await);
    }
    let mut inner = Coalesce::new(inner);
    let mut first_event = FirstDataEvent::default();
    let held = match tokio::time::timeout_at(
        first_byte_by,
        until_first_event(&mut inner, &mut first_event),
    )
    .await
    {
        Ok(Ok(prefix)) => prefix,
        Ok(Err(error)) => {
            worker
                .metrics
                .request_status(&app.metrics, Failure::Cut.label());
            app.request_failed(&worker, Failure::Cut);
            return Attempt::Done(gateway_error(
                StatusCode::BAD_GATEWAY,
                "upstream_error",
                format!(
                    "worker {} broke off its stream before the first event: {}",
                    worker.url,
                    error_chain(&error)
                ),
            ));
        }
        Err(_elapsed) => {
            worker.metrics.request_status(&app.metrics, "timeout");
            app.request_failed(&worker, Failure::FirstByteTimeout);
            return Attempt::Done(gateway_error(
                StatusCode::GATEWAY_TIMEOUT,
                "timeout",
                format!(
                    "worker {} admitted the stream but sent no event within {} ms \
                         (server.first_byte_timeout_ms); not retried, since it may be generating",
                    worker.url, server.first_byte_timeout_ms
                ),
            ));
        }
    };
    if first_event.found() {
        tracker.first_token();
    }
    let idle_timeout = server.stream_idle_timeout();
    // Past the idle deadline the stream ends anyway, so no hold-back then.
    let silent_after = app
        .config
        .outlier_detection
        .silent_stream()
        .filter(|silent_after| *silent_after < idle_timeout);
    let now = tokio::time::Instant::now();
    let body = TrackedBody {
        inner,
        held,
        tracker: Some(tracker),
        first_event,
        app: app.clone(),
        idle_timeout,
        silent_after,
        last_frame_at: now,
        silent: None,
        idle: Box::pin(tokio::time::sleep_until(
            now + silent_after.unwrap_or(idle_timeout),
        )),
        deadline: Box::pin(tokio::time::sleep_until(request.deadline)),
        ended: false,
    };
    Attempt::Done(Response::from_parts(parts, Body::new(body)))
}

/// Most bytes of a non-streaming answer the router holds to pass on whole.
const WHOLE_ANSWER_LIMIT_BYTES: usize = 64 * 1024 * 1024;

/// A non-streaming answer, read whole before its head goes to the client:
/// one JSON document, so an engine that breaks off mid-way becomes a clear
/// 502 instead of a cut the client cannot tell from a short answer.
async fn whole_answer(
    app: &Arc<App>,
    tracker: RequestTracker,
    parts: http::response::Parts,
    inner: Incoming,
    request: &ClientRequest,
) -> Response {
    let worker = tracker.worker.clone();
    let server = &app.config.server;
    let read_by =
        (tokio::time::Instant::now() + server.stream_idle_timeout()).min(request.deadline);
    let failure = match tokio::time::timeout_at(
        read_by,
        read_capped(inner, WHOLE_ANSWER_LIMIT_BYTES),
    )
    .await
    {
        Ok(Ok(answer)) => {
            app.request_succeeded(&worker);
            return Response::from_parts(parts, Body::from(answer));
        }
        Ok(Err(CappedBodyError::TooLarge { limit_bytes })) => {
            // Not the worker's fault; the router's own limit.
            return gateway_error(
                StatusCode::BAD_GATEWAY,
                "upstream_error",
                format!("the worker's answer exceeds {limit_bytes} bytes"),
            );
        }
        Ok(Err(CappedBodyError::Broken(error))) => (
            Failure::Cut,
            StatusCode::BAD_GATEWAY,
            format!(
                "worker {} broke off its answer: {}",
                worker.url,
                error_chain(&error)
            ),
        ),
        Err(_elapsed) => (
            Failure::Stalled,
            StatusCode::GATEWAY_TIMEOUT,
            format!(
                "worker {} sent its head but not the rest of its answer within {} ms \
                 (server.stream_idle_timeout_ms)",
                worker.url, server.stream_idle_timeout_ms
            ),
        ),
    };
    let (failure, status, message) = failure;
    worker.metrics.request_status(&app.metrics, failure.label());
    app.request_failed(&worker, failure);
    gateway_error(status, "upstream_error", message)
}

/// Reads a stream until its first `data:` field has arrived (or it ended);
/// returns what was read, to be sent first.
async fn until_first_event(
    inner: &mut Coalesce<Incoming>,
    first_event: &mut FirstDataEvent,
) -> Result<Option<Bytes>, hyper::Error> {
    let mut read = BytesMut::new();
    while let Some(frame) = inner.frame().await {
        if let Ok(data) = frame?.into_data() {
            read.extend_from_slice(&data);
            if first_event.feed(&data) {
                break;
            }
        }
    }
    Ok((!read.is_empty()).then(|| read.freeze()))
}

/// Most bytes of a worker's error answer the router reads to pass it on.
const ERROR_BODY_LIMIT_BYTES: usize = 1024 * 1024;

/// A worker's 4xx or 5xx, passed through with its status and body; a body
/// that is not JSON is wrapped in an OpenAI-shaped error.
async fn worker_error(
    response: http::Response<Incoming>,
    read_by: tokio::time::Instant,
) -> Response {
    let (parts, body) = response.into_parts();
    let status = parts.status;
    let read = tokio::time::timeout_at(read_by, read_capped(body, ERROR_BODY_LIMIT_BYTES)).await;
    let text = match read {
        Ok(Ok(bytes)) if serde_json::from_slice::<serde_json::Value>(&bytes).is_ok() => {
            let mut headers = forwardable(&parts.headers);
            headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            let mut response = Response::new(Body::from(bytes));
            *response.status_mut() = status;
            *response.headers_mut() = headers;
            return response;
        }
        Ok(Ok(bytes)) => String::from_utf8_lossy(&bytes).trim().to_owned(),
        Ok(Err(_)) => "(its body broke off or was too large)".to_owned(),
        Err(_elapsed) => "(its body did not arrive in time)".to_owned(),
    };
    const SHOWN_CHARS: usize = 1000;
    let shown: String = text.chars().take(SHOWN_CHARS).collect();
    let mut response = gateway_error(
        status,
        "upstream_error",
        format!("the worker answered {status}: {shown}"),
    );
    for (name, value) in forwardable(&parts.headers) {
        if let Some(name) = name
            && name != header::CONTENT_TYPE
        {
            response.headers_mut().append(name, value);
        }
    }
    response
}

/// The client's request, addressed to `worker`, with the worker's key.
/// `None` if the worker's URL does not make a URI.
fn upstream_request(
    worker: &Worker,
    request: &ClientRequest,
) -> Option<http::Request<UpstreamBody>> {
    let parts = &request.parts;
    let uri = worker.uri_for(parts.uri.path(), parts.uri.query())?;
    let mut upstream = http::Request::new(UpstreamBody::new(request.body.clone()));
    *upstream.method_mut() = parts.method.clone();
    *upstream.uri_mut() = uri;
    *upstream.headers_mut() = request.headers.clone();
    if let Some(authorization) = &worker.authorization {
        upstream
            .headers_mut()
            .insert(header::AUTHORIZATION, authorization.clone());
    }
    Some(upstream)
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

/// A worker's stream, passed through as it arrives (joined into fewer
/// frames by [`Coalesce`]), under the stream idle deadline and the request
/// deadline. A stream that breaks off or stalls ends with an SSE error
/// event, never a silent cut. Dropping it (the stream ended, or the client
/// went away) releases the dispatch.
struct TrackedBody {
    inner: Coalesce<Incoming>,
    /// Read before the head was sent (up to the first event); goes first.
    held: Option<Bytes>,
    tracker: Option<RequestTracker>,
    first_event: FirstDataEvent,
    app: Arc<App>,
    idle_timeout: std::time::Duration,
    /// `outlier_detection.silent_stream_ms`, when shorter than the idle
    /// deadline.
    silent_after: Option<std::time::Duration>,
    last_frame_at: tokio::time::Instant,
    /// Held while the stream is silent: its worker gets no new requests.
    silent: Option<SilentStream>,
    /// Fires at `silent_after` past the last frame (the stream goes
    /// silent), then at `idle_timeout` (it has stalled).
    idle: Pin<Box<tokio::time::Sleep>>,
    deadline: Pin<Box<tokio::time::Sleep>>,
    /// The router ended the body (an error event went out).
    ended: bool,
}

impl TrackedBody {
    /// A whole response: the worker's run of failures is over, and the
    /// dispatch is released now, not when the client's connection lets go
    /// of this body.
    fn succeeded(&mut self) {
        if let Some(tracker) = self.tracker.take() {
            self.app.request_succeeded(&tracker.worker);
        }
    }

    /// Ends the stream early with an SSE error event and a clean end.
    /// `failure` is the worker's.
    fn end_early(
        &mut self,
        failure: Option<Failure>,
        kind: &str,
        message: String,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        if let Some(tracker) = self.tracker.take() {
            if let Some(failure) = failure {
                tracker
                    .worker
                    .metrics
                    .request_status(&self.app.metrics, failure.label());
                self.app.request_failed(&tracker.worker, failure);
            }
            tracing::debug!(worker = %tracker.worker.url, %message, "response ended early");
        }
        self.silent = None;
        self.ended = true;
        Poll::Ready(Some(Ok(Frame::data(sse::error_event(kind, &message)))))
    }

    /// The stream has sent nothing for `silent_after`: holds its worker
    /// back and re-arms the timer for the idle deadline. False when it was
    /// already held back (or hold-back is off): the stream has stalled.
    fn went_silent(&mut self) -> bool {
        let (Some(_), None, Some(tracker)) = (self.silent_after, &self.silent, &self.tracker)
        else {
            return false;
        };
        self.silent = Some(SilentStream::new(&self.app, &tracker.worker));
        let stalled_at = self.last_frame_at + self.idle_timeout;
        self.idle.as_mut().reset(stalled_at);
        true
    }

    fn pass(&mut self, frame: Frame<Bytes>) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        let now = tokio::time::Instant::now();
        self.last_frame_at = now;
        self.silent = None;
        let next_check = now + self.silent_after.unwrap_or(self.idle_timeout);
        self.idle.as_mut().reset(next_check);
        if let Some(data) = frame.data_ref()
            && !self.first_event.found()
            && self.first_event.feed(data)
            && let Some(tracker) = self.tracker.as_mut()
        {
            tracker.first_token();
        }
        Poll::Ready(Some(Ok(frame)))
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
        if this.ended {
            return Poll::Ready(None);
        }
        if let Some(held) = this.held.take() {
            if this.inner.is_end_stream() {
                this.succeeded();
            }
            return this.pass(Frame::data(held));
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if this.inner.is_end_stream() {
                    this.succeeded();
                }
                this.pass(frame)
            }
            Poll::Ready(Some(Err(error))) => this.end_early(
                Some(Failure::Cut),
                "upstream_error",
                format!("the worker's response broke off: {}", error_chain(&error)),
            ),
            Poll::Ready(None) => {
                this.succeeded();
                Poll::Ready(None)
            }
            Poll::Pending => {
                if this.deadline.as_mut().poll(cx).is_ready() {
                    let limit_ms = this.app.config.server.request_deadline_ms;
                    return this.end_early(
                        None,
                        "timeout",
                        format!("the request ran past its deadline (server.request_deadline_ms = {limit_ms})"),
                    );
                }
                if this.idle.as_mut().poll(cx).is_ready() {
                    // Silent, not yet stalled: wait on, with the worker held
                    // back (polled again so the re-armed timer wakes us).
                    if this.went_silent() && this.idle.as_mut().poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                    let idle_ms = this.app.config.server.stream_idle_timeout_ms;
                    return this.end_early(
                        Some(Failure::Stalled),
                        "timeout",
                        format!("the worker sent nothing for {idle_ms} ms (server.stream_idle_timeout_ms)"),
                    );
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended || (self.held.is_none() && self.inner.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        if self.held.is_some() {
            return SizeHint::default();
        }
        self.inner.size_hint()
    }
}

/// `GET /v1/models`: the union of every healthy worker's models.
pub async fn models(State(app): State<Arc<App>>) -> Response {
    // Asked of every worker at once, each under the health-check timeout, so
    // one hung worker costs that timeout, not the sum.
    let timeout = std::time::Duration::from_millis(app.config.health.timeout_ms);
    let workers: Vec<Arc<Worker>> = app
        .workers()
        .into_iter()
        .filter(|worker| worker.in_rotation())
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
}
