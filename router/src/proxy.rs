//! The proxy: choose a worker, forward the request, stream the response back
//! unbuffered, and tell the policy when the first token passes.
//!
//! Per request the path takes one lock-free topology load, calls the
//! policy on the snapshot's own candidate slice, and from then on holds
//! only the chosen worker's [`Route`]; the request goes out on that
//! worker's kept-alive connections ([`worker_h1`]), read and written by
//! this task alone.
//!
//! [`handle`] is the one way in: the server ([`crate::server`]) passes it
//! every request addressed to one of [`GENERATE_PATHS`], with hyper's own
//! head and body.

use std::collections::VecDeque;
use std::future::poll_fn;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::{Bytes, BytesMut};
use http_body::{Body as _, Frame, SizeHint};
use http_body_util::BodyExt;
use policy_core::{Dispatch, RequestInfo, TokenCount, WorkerId, error_chain, tokio_now};
use request_features::{StreamUsage, Unhashed, read_request};

mod hedge;
mod resume;

pub(crate) use hedge::HedgeBudget;

use crate::admission::{Admission, Admitted, admit};
use crate::app::{App, SilentStream};
use crate::cached_tokens::{CachedTokensScanner, CompletionTokensScanner};
use crate::client_body::read_client_body;
use crate::migration::{Api, as_stream};
use crate::outlier::Failure;
use crate::sse::{self, FirstDataEvent};
use crate::stream_usage::{UsageChunkFilter, with_usage_asked};
use crate::telemetry::{DispatchTrace, ReceiveEnd, RequestTrace, Selection};
use crate::topology::Route;
use crate::upstream::control_get;
use crate::workers::Worker;
use worker_h1::{self as h1, WorkerBody};

use resume::{Break, Resume, Whole, assembled};

/// An OpenAI-shaped error response: `{"error": {"message", "type"}}`.
pub(crate) fn error_response(
    status: StatusCode,
    kind: &str,
    message: impl Into<String>,
) -> Response {
    let body = serde_json::json!({"error": {"message": message.into(), "type": kind}});
    (status, axum::Json(body)).into_response()
}

/// An error the router answers for a worker (a gateway error): no
/// `Retry-After`, which only the router's own lack of capacity carries.
fn gateway_error(status: StatusCode, kind: &str, message: impl Into<String>) -> Answer {
    own(error_response(status, kind, message))
}

/// The router itself has no capacity for the request: 503 with `Retry-After`.
fn unavailable(message: &str) -> Answer {
    let mut response = error_response(StatusCode::SERVICE_UNAVAILABLE, "unavailable", message);
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    own(response)
}

/// What the proxy answers a client with.
pub(crate) type Answer = http::Response<ProxyBody>;

/// One of the router's own responses (an error, or a page of its own) as
/// an [`Answer`].
pub(crate) fn own(response: Response) -> Answer {
    response.map(ProxyBody::Boxed)
}

/// A worker's answer, with its headers (less the hop-by-hop ones).
fn worker_answer(status: StatusCode, headers: &h1::HeaderLines, body: ProxyBody) -> Answer {
    let mut answer = http::Response::new(body);
    *answer.status_mut() = status;
    *answer.headers_mut() = headers.to_header_map();
    answer
}

/// The paths [`handle`] serves (all `POST`).
pub(crate) const GENERATE_PATHS: [&str; 3] =
    ["/v1/chat/completions", "/v1/completions", "/generate"];

/// `path` as one of [`GENERATE_PATHS`], if it is one.
pub(crate) fn generate_path(path: &str) -> Option<&'static str> {
    GENERATE_PATHS.into_iter().find(|known| *known == path)
}

/// A generation request's head as it goes on to a worker (always a
/// `POST`).
#[derive(Debug, Clone)]
pub(crate) struct ClientHead {
    /// One of [`GENERATE_PATHS`].
    pub(crate) path: &'static str,
    pub(crate) query: Option<String>,
    /// The client's headers that go on: hop-by-hop ones, `Host` and
    /// `Content-Length` left out.
    pub(crate) headers: h1::HeaderLines,
}

impl ClientHead {
    /// The head of a request hyper read: `None` unless its path is one of
    /// [`GENERATE_PATHS`].
    pub(crate) fn from_parts(parts: &http::request::Parts) -> Option<ClientHead> {
        Some(ClientHead {
            path: generate_path(parts.uri.path())?,
            query: parts.uri.query().map(str::to_owned),
            headers: h1::HeaderLines::forwarded_from_map(&parts.headers),
        })
    }
}

/// `POST /v1/chat/completions`, `/v1/completions`, `/generate`: one
/// generation request, whatever its body type (the server passes hyper's
/// own). Another method on those paths is answered 405.
pub(crate) async fn handle<B>(app: Arc<App>, parts: http::request::Parts, body: B) -> Answer
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: Into<axum::BoxError>,
{
    let arrived = tokio::time::Instant::now();
    let Some(head) = ClientHead::from_parts(&parts) else {
        return own(error_response(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("no generation endpoint at {}", parts.uri.path()),
        ));
    };
    if parts.method != Method::POST {
        let mut response = error_response(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            format!("{} takes POST, not {}", head.path, parts.method),
        );
        response
            .headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("POST"));
        return own(response);
    }
    let server = &app.config.server;
    let body = match read_client_body(body, server, arrived).await {
        Ok(body) => body,
        Err(error) => {
            tracing::debug!(%error, "request body not read");
            return own(error.response());
        }
    };
    let received_at = arrived.into_std();
    let deadline = arrived + server.request_deadline();
    let read = match read_request(&body, &app.config.request.prefix_hashing()) {
        Ok(read) => read,
        Err(error) => {
            return gateway_error(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                error.to_string(),
            );
        }
    };
    if let Some(reason) = read.prefix_unhashed.filter(|r| *r != Unhashed::Disabled) {
        // The policy scores the request without prefix affinity.
        tracing::debug!(reason = reason.as_str(), "prompt prefix not hashed");
    }
    let admission = match Admission::read(
        &parts.headers,
        read.priority,
        &app.admission.tenant_header(),
    ) {
        Ok(admission) => admission,
        Err(message) => {
            return gateway_error(StatusCode::BAD_REQUEST, "invalid_request_error", message);
        }
    };
    let info = read.info;
    let trace = app.telemetry.request(&parts.headers, head.path);
    if let Some(trace) = &trace {
        let prompt_tokens = match info.tokens {
            TokenCount::Exact(tokens) | TokenCount::Estimated(tokens) => Some(tokens),
            TokenCount::Unknown => None,
        };
        trace.describe(info.streaming, prompt_tokens);
    }
    // Only a prompt with hashed blocks has a prediction to check.
    let ask_usage = app.config.request.ask_stream_usage
        && info.streaming
        && read.stream_usage == StreamUsage::Unset
        && head.path != "/generate"
        && !info.prefix.is_empty();
    let (body, hide_usage_chunk) = match ask_usage.then(|| with_usage_asked(&body)).flatten() {
        Some(asked) => (asked, true),
        None => (body, false),
    };
    let api = Api::from_path(head.path);
    let migration = &app.config.migration;
    // A non-streaming request goes upstream as a stream where its answer
    // can be assembled faithfully, so it is retried and continued as one.
    let (body, assemble) = match api {
        Some(api) if !info.streaming && migration.non_streaming_as_stream => {
            match as_stream(api, &body) {
                Ok(streamed) => (streamed, Some(api)),
                Err(reason) => {
                    tracing::debug!(%reason, "non-streaming request passed through whole");
                    (body, None)
                }
            }
        }
        _ => (body, None),
    };
    let upstream_streaming = info.streaming || assemble.is_some();
    let head_timeout = server.head_timeout(upstream_streaming, read.max_output_tokens);
    let request = Arc::new(ClientRequest {
        head,
        body,
        hide_usage_chunk,
        info,
        received_at,
        deadline,
        head_timeout,
        admission,
        trace,
        api,
        upstream_streaming,
        migrations_left: migration.max_migrations,
        exclude: Vec::new(),
        continued: false,
    });
    let mut answer = forward(&app, &request).await;
    if let Some(api) = assemble {
        answer = assembled(api, answer).await;
    }
    if let Some(trace) = &request.trace {
        trace.answered(answer.status());
        let end = trace.end_with_answer();
        answer = answer.map(|body| ProxyBody::Traced(Box::new((body, end))));
    }
    answer
}

/// A client's request, read and parsed, as every attempt sends it.
struct ClientRequest {
    head: ClientHead,
    body: Bytes,
    /// The router asked for the stream's usage chunk; the client did not.
    hide_usage_chunk: bool,
    info: RequestInfo,
    received_at: Instant,
    /// `server.request_deadline_ms` after it arrived.
    deadline: tokio::time::Instant,
    /// How long one attempt may wait for the response head.
    head_timeout: std::time::Duration,
    /// Its priority, tenant and TTFT deadline, for the admission gate.
    admission: Admission,
    /// Its spans, when `[tracing]` is on and the request is sampled.
    trace: Option<RequestTrace>,
    /// Which generation API it is on (`None`: not one the router can
    /// continue).
    api: Option<Api>,
    /// Whether the worker is asked for a stream: the client's own, or one
    /// the router assembles into a whole answer.
    upstream_streaming: bool,
    /// Continuations on another worker it may still have.
    migrations_left: u32,
    /// Workers not to try: those its earlier parts broke on.
    exclude: Vec<WorkerId>,
    /// A continuation of a broken answer: already admitted.
    continued: bool,
}

impl ClientRequest {
    /// The request that continues this one's broken answer with `body`,
    /// anywhere but on `broken`.
    fn continuation(&self, app: &App, body: Bytes, broken: WorkerId) -> ClientRequest {
        let mut exclude = self.exclude.clone();
        exclude.push(broken);
        ClientRequest {
            head: self.head.clone(),
            body,
            hide_usage_chunk: false,
            info: RequestInfo {
                streaming: true,
                ..self.info.clone()
            },
            // Its own clock: the metrics of the attempt time the resume.
            received_at: tokio_now(),
            deadline: self.deadline,
            head_timeout: app.config.server.first_byte_timeout(),
            admission: self.admission.clone(),
            trace: self.trace.clone(),
            api: self.api,
            upstream_streaming: true,
            migrations_left: self.migrations_left.saturating_sub(1),
            exclude,
            continued: true,
        }
    }

    /// The request as `worker` gets it, with the worker's key, and the
    /// attempt's trace context when it is traced.
    fn outgoing<'a>(
        &'a self,
        worker: &'a Worker,
        trace: Option<&'a DispatchTrace>,
    ) -> h1::Outgoing<'a> {
        h1::Outgoing {
            method: &Method::POST,
            path: self.head.path,
            query: self.head.query.as_deref(),
            headers: trace.map_or(&self.head.headers, |trace| &trace.headers),
            authorization: worker.authorization.as_ref(),
            body: &self.body,
        }
    }
}

/// How one attempt on one worker ended.
enum Attempt {
    /// The client's answer: the worker's response, or a final error.
    Done(Answer),
    /// Nothing reached the client and no generation can have started, so
    /// another worker may take the request. `answer` is the worker's own
    /// (a 503 or 429), passed through if no other worker takes it.
    Retry {
        answer: Option<Answer>,
        reason: String,
    },
}

/// What one selection gave: the worker to try, or why none.
pub(crate) enum Chosen {
    Worker(RequestTracker),
    /// The policy chose a worker the snapshot does not list (it was just
    /// forgotten): try another.
    Gone(WorkerId),
    /// Every candidate is capped.
    Capped,
    NoCandidate,
}

/// Chooses a worker among the current candidates not yet `tried`, with one
/// lock-free snapshot load, and credits it. The candidate slice is the
/// snapshot's own; only a retry (some worker already tried) filters a copy.
pub(crate) fn choose(
    app: &Arc<App>,
    info: &RequestInfo,
    received_at: Instant,
    tried: &[WorkerId],
    now: tokio::time::Instant,
) -> Chosen {
    let snapshot = app.topology.load();
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
        return Chosen::NoCandidate;
    }
    let now = now.into_std();
    let Some(dispatch) = snapshot.policy.select(candidates, info, now) else {
        return Chosen::Capped;
    };
    app.sync_signal
        .dispatched(dispatch.worker, snapshot.policy.as_ref(), info);
    match snapshot.route(dispatch.worker) {
        Some(route) => Chosen::Worker(RequestTracker::new(
            app,
            route.clone(),
            dispatch,
            received_at,
            // A non-streamed answer's first byte comes after its last token.
            (info.streaming && snapshot.policy.score_is_wait_secs()).then_some(now),
            // Only a prompt with hashed blocks can have been predicted a
            // hit, or be placed; for others the engine's report is not read.
            !info.prefix.is_empty(),
        )),
        None => {
            snapshot.policy.finish(&dispatch, now);
            Chosen::Gone(dispatch.worker)
        }
    }
}

async fn forward(app: &Arc<App>, request: &Arc<ClientRequest>) -> Answer {
    let mut tried: Vec<WorkerId> = request.exclude.clone();
    let mut last_answer: Option<Answer> = None;
    let mut last_reason = String::new();
    let mut hedged = false;
    for attempt in 0..=app.config.server.max_retries {
        // One clock read per attempt: the selection's time, the deadline
        // check and the attempt's first-byte deadline.
        let now = tokio::time::Instant::now();
        if now >= request.deadline {
            break;
        }
        // The first attempt passes the admission gate; a retry goes
        // straight to another worker, its wait already served.
        let chosen = if attempt == 0 && !request.continued {
            let mut admission_span = request.trace.as_ref().map(|trace| {
                let admission = &request.admission;
                trace.admission(admission.priority.unwrap_or(0), &admission.tenant)
            });
            match admit(
                app,
                &request.info,
                request.received_at,
                &request.admission,
                request.deadline,
                admission_span.as_mut(),
            )
            .await
            {
                Admitted::Chosen(chosen) => chosen,
                Admitted::Answer(answer) => return answer,
            }
        } else {
            choose(app, &request.info, request.received_at, &tried, now)
        };
        // The wait may have been long: the attempt's clock starts now.
        let now = tokio::time::Instant::now();
        let mut tracker = match chosen {
            Chosen::Worker(tracker) => tracker,
            Chosen::Gone(id) => {
                tried.push(id);
                continue;
            }
            Chosen::Capped => {
                app.metrics.rejected.inc();
                return unavailable("every worker is at capacity (policy cap); retry shortly");
            }
            Chosen::NoCandidate => break,
        };
        if attempt > 0 {
            app.metrics.retries.inc();
            if let Some(trace) = &request.trace {
                trace.retry(attempt, &last_reason);
            }
        }
        selected(request, &mut tracker, attempt);
        let worker = tracker.worker();
        if !worker.pool.is_usable() {
            // Config validation rejects such URLs; a worker added some other
            // way is skipped rather than trusted.
            tracing::warn!(worker = %worker.url, "worker URL is not http(s)://host:port; skipping it");
            tried.push(worker.id);
            continue;
        }
        let worker_id = worker.id;
        // One hedge per request: a retry after a hedge is not hedged.
        let hedge_at = if hedged {
            None
        } else {
            hedge::hedge_at(app, request, &tracker, now)
        };
        let outcome = match hedge_at {
            Some(hedge_at) => {
                let hedge = hedge::Hedge {
                    at: hedge_at,
                    attempt,
                    sent: &mut hedged,
                };
                hedge::hedged_attempt(app, tracker, request, now, hedge, &mut tried).await
            }
            None => attempt_on(app, tracker, request, now, None).await,
        };
        match outcome {
            Attempt::Done(response) => return response,
            Attempt::Retry { answer, reason } => {
                tracing::debug!(worker = %worker_id, %reason, "attempt failed before any generation; trying another worker");
                if answer.is_some() {
                    last_answer = answer;
                }
                last_reason = reason;
                tried.push(worker_id);
            }
        }
    }
    if tokio::time::Instant::now() >= request.deadline {
        return deadline_passed(app);
    }
    if let Some(answer) = last_answer {
        return answer;
    }
    app.metrics.rejected.inc();
    if tried.len() == request.exclude.len() {
        return unavailable("no worker is in rotation");
    }
    gateway_error(StatusCode::BAD_GATEWAY, "upstream_error", last_reason)
}

/// Counts the tracker's selection in its worker's metrics and, when the
/// request is traced, records it and opens the attempt's `dispatch` span.
fn selected(request: &ClientRequest, tracker: &mut RequestTracker, attempt: u32) {
    let worker = tracker.worker();
    let dispatch = tracker.dispatch;
    worker.metrics.selections.inc();
    worker.metrics.dispatched_tokens.inc_by(dispatch.tokens);
    if dispatch.cached_tokens > 0 {
        worker
            .metrics
            .predicted_cached_tokens
            .inc_by(dispatch.cached_tokens);
    }
    worker.metrics.selected_score.observe(dispatch.score);
    if let Some(trace) = &request.trace {
        trace.selection(&Selection {
            policy: tracker.route.policy.name(),
            worker_url: &worker.url,
            worker_id: worker.id,
            score: dispatch.score,
            cached_tokens: dispatch.cached_tokens,
            tokens: Some(dispatch.tokens),
            attempt,
        });
        let dispatch_trace = trace.dispatch(&worker.url, attempt);
        tracker.trace = Some(Box::new(dispatch_trace));
    }
}

/// The answer to a request whose deadline passed before any worker answered.
pub(crate) fn deadline_passed(app: &App) -> Answer {
    gateway_error(
        StatusCode::GATEWAY_TIMEOUT,
        "timeout",
        format!(
            "no worker answered within the request deadline (server.request_deadline_ms = {})",
            app.config.server.request_deadline_ms
        ),
    )
}

/// Sends the request to the tracker's worker and waits for its first byte:
/// the response head, and for a stream its first `data:` event.
/// `head_seen`, when given, is set as the response head arrives.
async fn attempt_on(
    app: &Arc<App>,
    mut tracker: RequestTracker,
    request: &Arc<ClientRequest>,
    now: tokio::time::Instant,
    head_seen: Option<Arc<AtomicBool>>,
) -> Attempt {
    let worker = tracker.worker();
    let server = &app.config.server;
    let streaming = request.upstream_streaming;
    // With migration on, a stream that failed before its first event goes
    // to another worker whatever the failure: the engine may have begun
    // the work, and continuing it elsewhere is what migration accepts.
    let resumable = streaming && request.api.is_some() && app.config.migration.enabled();
    let first_byte_by = now
        .checked_add(request.head_timeout)
        .map_or(request.deadline, |by| by.min(request.deadline));
    // A request still waiting for its first event after
    // `silent_stream_ms` holds its worker back, as a silent stream does:
    // a hung engine then takes no more requests while its first failure
    // is still coming.
    let overdue_at = app
        .config
        .outlier_detection
        .silent_stream()
        .and_then(|after| now.checked_add(after))
        .filter(|at| *at < first_byte_by);
    let mut held_back: Option<SilentStream> = None;
    let outgoing = request.outgoing(worker, tracker.trace.as_deref());
    let sent = h1::send_at(
        &worker.pool,
        &outgoing,
        server.connect_timeout(),
        now.into_std(),
    );
    let hold_back = |held_back: &mut Option<SilentStream>| {
        *held_back = Some(SilentStream::new(app, worker));
    };
    let head = first_byte_within(sent, first_byte_by, overdue_at, || {
        hold_back(&mut held_back)
    });
    let response = match head.await {
        Ok(Ok(response)) => response,
        Ok(Err(error)) => {
            // The connection failed, or closed before any answer: the
            // engine is not generating this request.
            worker.metrics.request_status(&app.metrics, "error");
            tracker.failed(app, Failure::Connect);
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
            tracker.failed(app, Failure::FirstByteTimeout);
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
    if let Some(head_seen) = head_seen {
        head_seen.store(true, Ordering::Relaxed);
    }
    let h1::Response {
        status,
        headers,
        body: mut inner,
    } = response;
    // One clock read for what the head's arrival marks.
    let head_at = tokio_now();
    worker
        .metrics
        .time_to_first_byte
        .observe(since(request.received_at, head_at));
    worker.metrics.request_status(&app.metrics, status.as_str());
    if let Some(trace) = &tracker.trace {
        trace.answered(status);
    }
    if status.is_client_error() || status.is_server_error() {
        if status.is_server_error() {
            tracker.failed(app, Failure::ServerError(status.as_u16()));
        }
        let answer = worker_error(status, &headers, inner, first_byte_by).await;
        // Only an engine that refused the work (overloaded, rate-limited)
        // is known not to have started it.
        let refused =
            status == StatusCode::SERVICE_UNAVAILABLE || status == StatusCode::TOO_MANY_REQUESTS;
        if refused || (resumable && status.is_server_error()) {
            return Attempt::Retry {
                answer: Some(answer),
                reason: format!("worker {} answered {status}", worker.url),
            };
        }
        return Attempt::Done(answer);
    }
    if !streaming {
        // A non-streaming response's head is its first token.
        tracker.first_token_at(app, head_at);
        let answer = whole_answer(app, tracker, status, headers, inner, request, head_at);
        return Attempt::Done(answer.await);
    }
    let mut first_event = FirstDataEvent::default();
    let overdue_at = overdue_at.filter(|_| held_back.is_none());
    let first = first_byte_within(
        until_first_event(&mut inner, &mut first_event),
        first_byte_by,
        overdue_at,
        || hold_back(&mut held_back),
    );
    let held = match first.await {
        Ok(Ok(prefix)) => prefix,
        Ok(Err(error)) => {
            worker
                .metrics
                .request_status(&app.metrics, Failure::Cut.label());
            tracker.failed(app, Failure::Cut);
            let reason = format!(
                "worker {} broke off its stream before the first event: {}",
                worker.url,
                error_chain(&error)
            );
            if resumable {
                return Attempt::Retry {
                    answer: None,
                    reason,
                };
            }
            return Attempt::Done(gateway_error(
                StatusCode::BAD_GATEWAY,
                "upstream_error",
                reason,
            ));
        }
        Err(_elapsed) => {
            worker.metrics.request_status(&app.metrics, "timeout");
            tracker.failed(app, Failure::FirstByteTimeout);
            if resumable {
                return Attempt::Retry {
                    answer: None,
                    reason: format!(
                        "worker {} admitted the stream but sent no event within {} ms \
                         (server.first_byte_timeout_ms)",
                        worker.url, server.first_byte_timeout_ms
                    ),
                };
            }
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
    // One clock read for the first event's arrival and the stream's timers.
    let now = tokio::time::Instant::now();
    if first_event.found() {
        tracker.first_token_at(app, now.into_std());
    }
    let idle_timeout = server.stream_idle_timeout();
    // Past the idle deadline the stream ends anyway, so no hold-back then.
    let silent_after = app
        .config
        .outlier_detection
        .silent_stream()
        .filter(|silent_after| *silent_after < idle_timeout);
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
        timer: Box::pin(tokio::time::sleep_until(
            (now + silent_after.unwrap_or(idle_timeout)).min(request.deadline),
        )),
        deadline: request.deadline,
        ended: false,
        usage_filter: request.hide_usage_chunk.then(UsageChunkFilter::default),
        resume: resumable.then(|| Box::new(Resume::new(request.clone()))),
    };
    Attempt::Done(worker_answer(
        status,
        &headers,
        ProxyBody::Stream(Box::new(body)),
    ))
}

/// `work` until `by`; `on_overdue` runs if it is still pending at
/// `overdue_at` (before `by`), and it goes on waiting.
async fn first_byte_within<F: Future>(
    work: F,
    by: tokio::time::Instant,
    overdue_at: Option<tokio::time::Instant>,
    on_overdue: impl FnOnce(),
) -> Result<F::Output, tokio::time::error::Elapsed> {
    let mut work = std::pin::pin!(work);
    if let Some(at) = overdue_at {
        match tokio::time::timeout_at(at, work.as_mut()).await {
            Ok(output) => return Ok(output),
            Err(_) => on_overdue(),
        }
    }
    tokio::time::timeout_at(by, work).await
}

/// Most bytes of a non-streaming answer the router holds to pass on whole.
const WHOLE_ANSWER_LIMIT_BYTES: usize = 64 * 1024 * 1024;

/// Why a body was not read whole.
enum ReadWholeError {
    TooLarge { limit_bytes: usize },
    Broken(h1::BodyError),
}

/// A worker's whole body, refused as soon as it (announced or read so far)
/// exceeds `limit_bytes`. A body that came in one piece is not copied.
async fn read_whole(mut body: WorkerBody, limit_bytes: usize) -> Result<Bytes, ReadWholeError> {
    let too_large = ReadWholeError::TooLarge { limit_bytes };
    let announced = http_body::Body::size_hint(&body).exact();
    if announced.is_some_and(|len| usize::try_from(len).map_or(true, |len| len > limit_bytes)) {
        return Err(too_large);
    }
    let mut first: Option<Bytes> = None;
    let mut joined: Option<BytesMut> = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(ReadWholeError::Broken)?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let so_far = joined
            .as_ref()
            .map_or_else(|| first.as_ref().map_or(0, Bytes::len), BytesMut::len);
        if so_far.saturating_add(data.len()) > limit_bytes {
            return Err(too_large);
        }
        match (&mut joined, first.take()) {
            (Some(joined), _) => joined.extend_from_slice(&data),
            (None, None) => first = Some(data),
            (None, Some(earlier)) => {
                let mut both = BytesMut::with_capacity(earlier.len() + data.len());
                both.extend_from_slice(&earlier);
                both.extend_from_slice(&data);
                joined = Some(both);
            }
        }
    }
    Ok(match joined {
        Some(joined) => joined.freeze(),
        None => first.unwrap_or_default(),
    })
}

/// A non-streaming answer, read whole before its head goes to the client:
/// an engine that breaks off mid-way becomes a clear
/// 502 instead of a cut the client cannot tell from a short answer.
async fn whole_answer(
    app: &Arc<App>,
    mut tracker: RequestTracker,
    status: StatusCode,
    headers: h1::HeaderLines,
    inner: WorkerBody,
    request: &ClientRequest,
    head_at: Instant,
) -> Answer {
    let worker = tracker.worker();
    let server = &app.config.server;
    let read_by = (tokio::time::Instant::from_std(head_at) + server.stream_idle_timeout())
        .min(request.deadline);
    let failure =
        match tokio::time::timeout_at(read_by, read_whole(inner, WHOLE_ANSWER_LIMIT_BYTES)).await {
            Ok(Ok(answer)) => {
                app.request_succeeded(worker);
                tracker.scan(&answer);
                tracker.report_cache(app);
                return worker_answer(status, &headers, ProxyBody::whole(answer));
            }
            Ok(Err(ReadWholeError::TooLarge { limit_bytes })) => {
                // Not the worker's fault; the router's own limit.
                return gateway_error(
                    StatusCode::BAD_GATEWAY,
                    "upstream_error",
                    format!("the worker's answer exceeds {limit_bytes} bytes"),
                );
            }
            Ok(Err(ReadWholeError::Broken(error))) => (
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
    tracker.failed(app, failure);
    gateway_error(status, "upstream_error", message)
}

/// Reads `inner` up to its first SSE `data:` field (or its end), feeding
/// `first_event`: the pieces read, in order.
async fn until_first_event(
    inner: &mut WorkerBody,
    first_event: &mut FirstDataEvent,
) -> Result<VecDeque<Bytes>, h1::BodyError> {
    let mut pieces = VecDeque::new();
    while let Some(piece) = poll_fn(|cx| inner.poll_data(cx)).await {
        let piece = piece?;
        let found = first_event.feed(&piece);
        pieces.push_back(piece);
        if found {
            break;
        }
    }
    Ok(pieces)
}

/// Most bytes of a worker's error answer the router reads to pass it on.
const ERROR_BODY_LIMIT_BYTES: usize = 1024 * 1024;

/// A worker's 4xx or 5xx, passed through with its status and body; a body
/// that is not JSON is wrapped in an OpenAI-shaped error.
async fn worker_error(
    status: StatusCode,
    headers: &h1::HeaderLines,
    body: WorkerBody,
    read_by: tokio::time::Instant,
) -> Answer {
    let read = tokio::time::timeout_at(read_by, read_whole(body, ERROR_BODY_LIMIT_BYTES)).await;
    let text = match read {
        Ok(Ok(bytes)) if serde_json::from_slice::<serde_json::Value>(&bytes).is_ok() => {
            let mut answer = worker_answer(status, headers, ProxyBody::whole(bytes));
            answer.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            return answer;
        }
        Ok(Ok(bytes)) => String::from_utf8_lossy(&bytes).trim().to_owned(),
        Ok(Err(_)) => "(its body broke off or was too large)".to_owned(),
        Err(_elapsed) => "(its body did not arrive in time)".to_owned(),
    };
    const SHOWN_CHARS: usize = 1000;
    let shown: String = text.chars().take(SHOWN_CHARS).collect();
    let mut response = error_response(
        status,
        "upstream_error",
        format!("the worker answered {status}: {shown}"),
    );
    for (name, value) in &headers.to_header_map() {
        if name != header::CONTENT_TYPE {
            response.headers_mut().append(name, value.clone());
        }
    }
    own(response)
}

/// Holds a request's dispatch and in-flight count until its response ends,
/// then finishes the dispatch against the policy that credited it. Its
/// first token and its end let waiting requests through the admission gate.
pub(crate) struct RequestTracker {
    app: Arc<App>,
    route: Arc<Route>,
    dispatch: Dispatch,
    first_token_seen: bool,
    received_at: Instant,
    /// When the policy chose the worker, if its score is the predicted
    /// wait for a streamed request's first token: the first token is then
    /// counted against that prediction.
    predicted_wait_from: Option<Instant>,
    /// Reads the engine's `cached_tokens` report from the response, when
    /// the prompt had hashed blocks.
    cache_scan: Option<CachedTokensScanner>,
    /// The class and tenant the admission room charges the answer's
    /// generated tokens to, and the scanner that reads their count (boxed:
    /// a router with admission off carries only the pointer).
    output_charge: Option<Box<OutputCharge>>,
    /// The attempt's `dispatch` span, when the request is traced; it ends
    /// with the tracker.
    trace: Option<Box<DispatchTrace>>,
}

struct OutputCharge {
    class: Arc<str>,
    tenant: Arc<str>,
    scan: CompletionTokensScanner,
}

impl RequestTracker {
    /// What the policy decided for the request.
    pub(crate) fn dispatch(&self) -> &Dispatch {
        &self.dispatch
    }

    fn new(
        app: &Arc<App>,
        route: Arc<Route>,
        dispatch: Dispatch,
        received_at: Instant,
        predicted_wait_from: Option<Instant>,
        read_cache_report: bool,
    ) -> RequestTracker {
        route.worker.request_started();
        RequestTracker {
            app: app.clone(),
            route,
            dispatch,
            first_token_seen: false,
            received_at,
            predicted_wait_from,
            cache_scan: read_cache_report.then(CachedTokensScanner::default),
            output_charge: None,
            trace: None,
        }
    }

    /// The attempt failed: counts it against the worker (which may eject
    /// it), and marks the attempt's span.
    fn failed(&self, app: &App, failure: Failure) {
        let ejected_for = app.request_failed(self.worker(), failure);
        if let Some(trace) = &self.trace {
            trace.failed(failure.label(), ejected_for);
        }
    }

    /// Charges the answer's generated tokens (as the engine reports them)
    /// to this class and tenant when it ends.
    pub(crate) fn charge_output_to(&mut self, class: Arc<str>, tenant: Arc<str>) {
        self.output_charge = Some(Box::new(OutputCharge {
            class,
            tenant,
            scan: CompletionTokensScanner::default(),
        }));
    }

    fn worker(&self) -> &Arc<Worker> {
        &self.route.worker
    }

    /// Reads response bytes for the engine's cache report.
    #[inline]
    fn scan(&mut self, bytes: &[u8]) {
        if let Some(scan) = self.cache_scan.as_mut() {
            scan.feed(bytes);
        }
        if let Some(charge) = self.output_charge.as_mut() {
            charge.scan.feed(bytes);
        }
    }

    /// The response completed: hands the engine's report of its prefix
    /// cache (if it made one) to the policy that predicted it, counts it,
    /// and queues a bound the report changed for the other replicas.
    fn report_cache(&mut self, app: &App) {
        let Some(reported) = self.cache_scan.take().and_then(|scan| scan.value()) else {
            return;
        };
        let worker = &self.route.worker;
        worker
            .metrics
            .cache_reported(self.dispatch.cached_tokens, reported);
        if let Some(bound) = self
            .route
            .policy
            .cache_report(&self.dispatch, reported, tokio_now())
        {
            worker
                .metrics
                .cache_bound_tokens
                .set(i64::try_from(bound).unwrap_or(i64::MAX));
            app.sync_signal.bound_learned(worker.id, bound);
        }
    }

    /// Tells the policy the first token passed; later calls do nothing.
    fn first_token(&mut self, app: &App) {
        if !self.first_token_seen {
            self.first_token_at(app, tokio_now());
        }
    }

    /// [`first_token`](Self::first_token), with the time it passed.
    /// What the policy learns from it goes to the other replicas too.
    fn first_token_at(&mut self, app: &App, now: Instant) {
        if !self.first_token_seen {
            self.first_token_seen = true;
            if let Some(sample) = self.route.policy.first_token(&self.dispatch, now) {
                app.sync_signal
                    .first_token_had(self.dispatch.worker, sample, now);
            }
            let ttft_s = since(self.received_at, now);
            let metrics = &self.route.worker.metrics;
            metrics.time_to_first_token.observe(ttft_s);
            if let Some(dispatched_at) = self.predicted_wait_from {
                metrics.first_token_wait(self.dispatch.score, since(dispatched_at, now));
            }
            if let Some(trace) = &self.trace {
                trace.first_token(ttft_s);
            }
            self.app.admission.release(&self.app);
        }
    }
}

impl Drop for RequestTracker {
    fn drop(&mut self) {
        let now = tokio_now();
        let worker = &self.route.worker;
        worker.request_ended();
        worker
            .metrics
            .request_duration
            .observe(since(self.received_at, now));
        self.route.policy.finish(&self.dispatch, now);
        if let Some(charge) = self.output_charge.take()
            && let Some(tokens) = charge.scan.value()
        {
            self.app
                .admission
                .finished(&charge.class, &charge.tenant, tokens);
        }
        self.app.admission.release(&self.app);
    }
}

/// Seconds from `start` to `now`, both on tokio's clock (the policy's, and
/// paused in tests).
fn since(start: Instant, now: Instant) -> f64 {
    now.saturating_duration_since(start).as_secs_f64()
}

/// A worker's stream, passed through as it arrives (each frame all that
/// had arrived, see [`WorkerBody`]), under the stream idle deadline and the
/// request deadline. A stream that breaks off or stalls ends with an SSE
/// error event, never a silent cut. Dropping it (the stream ended, or the
/// client went away) releases the dispatch.
///
/// The idle timer is not moved for every frame: a frame only notes its
/// time, and when the timer fires it is pushed to that time plus the
/// threshold if the stream has sent since. One timer serves both deadlines:
/// it is never set past the request's.
pub(crate) struct TrackedBody {
    inner: WorkerBody,
    /// Read before the head was sent (up to the first event); goes first.
    held: VecDeque<Bytes>,
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
    /// Fires no earlier than `silent_after` past the last frame (the stream
    /// went silent), then `idle_timeout` past it (it has stalled), or at
    /// `deadline`, whichever is sooner.
    timer: Pin<Box<tokio::time::Sleep>>,
    /// The request's deadline.
    deadline: tokio::time::Instant,
    /// The router ended the body (an error event went out).
    ended: bool,
    /// Keeps from the client the usage chunk the router asked for.
    usage_filter: Option<UsageChunkFilter>,
    /// With migration on: what was sent, to continue it on another worker
    /// when the stream breaks, and the continuation once it runs.
    resume: Option<Box<Resume>>,
}

impl std::fmt::Debug for TrackedBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrackedBody")
            .field(
                "held_bytes",
                &self.held.iter().map(Bytes::len).sum::<usize>(),
            )
            .field("first_event", &self.first_event.found())
            .field("ended", &self.ended)
            .finish_non_exhaustive()
    }
}

/// What the idle timer found when it fired.
enum IdleCheck {
    /// The stream sent since; the timer is re-armed.
    Rearmed,
    /// Silent for `silent_after`: the worker is held back now.
    WentSilent,
    /// Nothing for `idle_timeout`.
    Stalled,
}

impl TrackedBody {
    /// A whole response: the worker's run of failures is over, the
    /// engine's cache report is read, and the dispatch is released now, not
    /// when the client's connection lets go of this body.
    fn succeeded(&mut self) {
        if let Some(mut tracker) = self.tracker.take() {
            self.app.request_succeeded(tracker.worker());
            tracker.report_cache(&self.app);
        }
    }

    /// Reads a piece for the engine's cache report, before it may end the
    /// stream.
    #[inline]
    fn scan(&mut self, piece: &[u8]) {
        if let Some(tracker) = self.tracker.as_mut()
            && tracker.cache_scan.is_some()
        {
            tracker.scan(piece);
        }
    }

    /// Ends the stream early with an SSE error event and a clean end.
    /// `failure` is the worker's.
    fn end_early(
        &mut self,
        failure: Option<Failure>,
        kind: &str,
        message: String,
    ) -> Poll<Option<Result<Bytes, std::io::Error>>> {
        if let Some(tracker) = self.tracker.take() {
            let worker = tracker.worker();
            if let Some(failure) = failure {
                worker
                    .metrics
                    .request_status(&self.app.metrics, failure.label());
                tracker.failed(&self.app, failure);
            }
            tracing::debug!(worker = %worker.url, %message, "response ended early");
        }
        self.silent = None;
        self.ended = true;
        Poll::Ready(Some(Ok(sse::error_event(kind, &message))))
    }

    /// The idle timer fired: re-arms it past the last frame if the stream
    /// sent since, holds the worker back if the stream has been silent for
    /// `silent_after`, or finds it stalled.
    fn idle_fired(&mut self, now: tokio::time::Instant) -> IdleCheck {
        let silent_for = now.saturating_duration_since(self.last_frame_at);
        let holding_back = self.silent_after.is_some() && self.tracker.is_some();
        if holding_back
            && self.silent.is_none()
            && let Some(silent_after) = self.silent_after
        {
            if silent_for < silent_after {
                self.arm(self.last_frame_at + silent_after);
                return IdleCheck::Rearmed;
            }
            if let Some(tracker) = &self.tracker {
                self.silent = Some(SilentStream::new(&self.app, tracker.worker()));
            }
            if silent_for < self.idle_timeout {
                self.arm(self.last_frame_at + self.idle_timeout);
                return IdleCheck::WentSilent;
            }
            return IdleCheck::Stalled;
        }
        if silent_for < self.idle_timeout {
            self.arm(self.last_frame_at + self.idle_timeout);
            return IdleCheck::Rearmed;
        }
        IdleCheck::Stalled
    }

    /// Sets the timer for the idle check due at `idle_due`, or for the
    /// request's deadline if that comes first.
    fn arm(&mut self, idle_due: tokio::time::Instant) {
        self.timer.as_mut().reset(idle_due.min(self.deadline));
    }

    fn pass(&mut self, piece: Bytes) -> Poll<Option<Result<Bytes, std::io::Error>>> {
        self.last_frame_at = tokio::time::Instant::now();
        if self.silent.take().is_some() {
            // The timer was set for the stall; the next silence is sooner.
            let next_check = self.last_frame_at + self.silent_after.unwrap_or(self.idle_timeout);
            self.arm(next_check);
        }
        if !self.first_event.found()
            && self.first_event.feed(&piece)
            && let Some(tracker) = self.tracker.as_mut()
        {
            tracker.first_token(&self.app);
        }
        Poll::Ready(Some(Ok(piece)))
    }

    /// The next piece of the stream, as data, less a usage chunk the
    /// client did not ask for.
    fn poll_piece(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, std::io::Error>>> {
        if self.usage_filter.is_none() {
            return self.poll_worker_piece(cx);
        }
        loop {
            let polled = self.poll_worker_piece(cx);
            let Some(filter) = self.usage_filter.as_mut() else {
                return polled;
            };
            match polled {
                Poll::Ready(Some(Ok(piece))) => {
                    if let Some(data) = filter.feed(piece) {
                        return Poll::Ready(Some(Ok(data)));
                    }
                }
                Poll::Ready(None) => {
                    let rest = filter.finish();
                    self.usage_filter = None;
                    return Poll::Ready(rest.map(Ok));
                }
                other => return other,
            }
        }
    }

    /// The next piece of the worker's stream, as data.
    fn poll_worker_piece(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, std::io::Error>>> {
        loop {
            if self.ended {
                return Poll::Ready(None);
            }
            if let Some(resume) = self.resume.as_mut() {
                if !resume.is_direct() {
                    return self.poll_continued(cx);
                }
                if resume.take_error_pending() {
                    return self.broke(
                        cx,
                        Break::ErrorEvent,
                        "the worker sent an error event mid-stream".to_owned(),
                    );
                }
                if resume.may_leave_drained()
                    && self
                        .tracker
                        .as_ref()
                        .is_some_and(|tracker| tracker.worker().is_drained())
                {
                    if self.start_continuation(Break::Drained) {
                        return self.poll_continued(cx);
                    }
                    // It runs on where it is, as without a grace period.
                    if let Some(resume) = self.resume.as_mut() {
                        resume.stay_drained();
                    }
                }
            }
            let piece = if let Some(held) = self.held.pop_front() {
                self.scan(&held);
                if self.held.is_empty() && self.inner.is_end_stream() {
                    self.succeeded();
                }
                held
            } else {
                match self.inner.poll_data(cx) {
                    Poll::Ready(Some(Ok(piece))) => {
                        self.scan(&piece);
                        if self.inner.is_end_stream() {
                            self.succeeded();
                        }
                        piece
                    }
                    Poll::Ready(Some(Err(error))) => {
                        return self.broke(
                            cx,
                            Break::Cut,
                            format!("the worker's response broke off: {}", error_chain(&error)),
                        );
                    }
                    Poll::Ready(None) => {
                        self.succeeded();
                        // An event the worker left unfinished goes out as it is.
                        let rest = self.resume.as_mut().and_then(|resume| resume.rest());
                        self.ended = true;
                        return match rest {
                            Some(rest) => self.pass(rest),
                            None => Poll::Ready(None),
                        };
                    }
                    Poll::Pending => return self.poll_timer(cx),
                }
            };
            let Some(resume) = self.resume.as_mut() else {
                return self.pass(piece);
            };
            match resume.take_whole_events(piece) {
                Whole::Events(events) => return self.pass(events),
                Whole::Nothing => {}
                Whole::ErrorEvent { before } => {
                    if let Some(before) = before {
                        // The next poll finds the error event again.
                        return self.pass(before);
                    }
                    return self.broke(
                        cx,
                        Break::ErrorEvent,
                        "the worker sent an error event mid-stream".to_owned(),
                    );
                }
            }
        }
    }

    /// Nothing from the worker now: the idle and deadline checks.
    fn poll_timer(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, std::io::Error>>> {
        // A fired timer is re-armed (or the stream has stalled, or reached
        // its deadline); the re-armed one is polled so that it wakes us.
        while self.timer.as_mut().poll(cx).is_ready() {
            let now = tokio::time::Instant::now();
            if now >= self.deadline {
                let limit_ms = self.app.config.server.request_deadline_ms;
                return self.end_early(
                    None,
                    "timeout",
                    format!(
                        "the request ran past its deadline (server.request_deadline_ms = {limit_ms})"
                    ),
                );
            }
            match self.idle_fired(now) {
                IdleCheck::Rearmed | IdleCheck::WentSilent => {}
                IdleCheck::Stalled => {
                    let idle_ms = self.app.config.server.stream_idle_timeout_ms;
                    return self.broke(
                        cx,
                        Break::Stalled,
                        format!(
                            "the worker sent nothing for {idle_ms} ms (server.stream_idle_timeout_ms)"
                        ),
                    );
                }
            }
        }
        Poll::Pending
    }

    /// The worker's answer broke after it began: continued on another
    /// worker when it can be, or ended with an SSE error event.
    fn broke(
        &mut self,
        cx: &mut Context<'_>,
        why: Break,
        message: String,
    ) -> Poll<Option<Result<Bytes, std::io::Error>>> {
        if self.start_continuation(why) {
            return self.poll_continued(cx);
        }
        let kind = match why {
            Break::Stalled => "timeout",
            Break::Cut | Break::ErrorEvent | Break::Drained => "upstream_error",
        };
        self.end_early(why.failure(), kind, message)
    }
}

impl http_body::Body for TrackedBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        self.get_mut().poll_piece(cx).map_ok(Frame::data)
    }

    fn is_end_stream(&self) -> bool {
        let filter_holding = self
            .usage_filter
            .as_ref()
            .is_some_and(UsageChunkFilter::is_holding);
        let resume_holding = self
            .resume
            .as_ref()
            .is_some_and(|resume| resume.is_holding());
        self.ended
            || (self.held.is_empty()
                && !filter_holding
                && !resume_holding
                && self.inner.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        // A filtered or continued stream's length is not the worker's.
        if !self.held.is_empty() || self.usage_filter.is_some() || self.resume.is_some() {
            return SizeHint::default();
        }
        self.inner.size_hint()
    }
}

/// The body of an [`Answer`]: a whole answer, a worker's stream, or one the
/// router built (an error). Whole answers and streams are not boxed.
#[derive(Debug)]
pub(crate) enum ProxyBody {
    /// A whole answer; `None` once taken (or empty).
    Whole(Option<Bytes>),
    /// A worker's stream, passed through as it arrives.
    Stream(Box<TrackedBody>),
    /// Anything else (the router's own error answers).
    Boxed(Body),
    /// A traced request's answer, which ends its `receive` span when
    /// dropped.
    Traced(Box<(ProxyBody, ReceiveEnd)>),
}

impl ProxyBody {
    /// A whole answer of `bytes`.
    pub(crate) fn whole(bytes: Bytes) -> ProxyBody {
        ProxyBody::Whole((!bytes.is_empty()).then_some(bytes))
    }
}

impl http_body::Body for ProxyBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        match self.get_mut() {
            ProxyBody::Whole(bytes) => {
                Poll::Ready(bytes.take().map(|bytes| Ok(Frame::data(bytes))))
            }
            ProxyBody::Stream(stream) => Pin::new(stream.as_mut())
                .poll_frame(cx)
                .map_err(axum::Error::new),
            ProxyBody::Boxed(body) => Pin::new(body).poll_frame(cx),
            ProxyBody::Traced(traced) => Pin::new(&mut traced.0).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ProxyBody::Whole(bytes) => bytes.is_none(),
            ProxyBody::Stream(stream) => stream.is_end_stream(),
            ProxyBody::Boxed(body) => body.is_end_stream(),
            ProxyBody::Traced(traced) => traced.0.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ProxyBody::Whole(bytes) => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |bytes| bytes.len() as u64))
            }
            ProxyBody::Stream(stream) => stream.size_hint(),
            ProxyBody::Boxed(body) => body.size_hint(),
            ProxyBody::Traced(traced) => traced.0.size_hint(),
        }
    }
}

/// `GET /v1/models`: the union of every healthy worker's models.
pub(crate) async fn models(State(app): State<Arc<App>>) -> Response {
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
