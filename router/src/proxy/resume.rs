//! Migration: a stream that breaks after its first event is continued on
//! another worker, and a non-streaming request's stream is assembled into
//! its whole answer (`docs/reliability.md`, "Migration").
//!
//! With migration on, a [`TrackedBody`] passes only whole SSE events on
//! and keeps them, so that at a break it knows exactly what the client
//! has: [`Sent`] reads them only then. The continuation is a request of
//! its own through [`forward`] (any worker but the broken ones, no
//! admission wait), whose body the broken stream then reads through a
//! [`Splicer`]. A continuation that breaks continues itself the same way,
//! while the request's `max_migrations` last.

use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use axum::http::{HeaderValue, StatusCode, header};
use bytes::{Bytes, BytesMut};
use memchr::memmem;

use super::{Answer, ClientRequest, ProxyBody, TrackedBody, forward, gateway_error, since};
use crate::metrics::MigrationLabels;
use crate::migration::{Api, Assembler, Sent, Splicer, continuation};
use crate::outlier::Failure;

/// How a worker's answer broke after it began.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Break {
    /// The connection failed or the body's framing broke off.
    Cut,
    /// Nothing for `server.stream_idle_timeout_ms`.
    Stalled,
    /// The engine sent an SSE event with an `error` object.
    ErrorEvent,
    /// The worker's drain grace period ended (`DELETE /admin/workers/{id}?grace_ms=`).
    Drained,
}

impl Break {
    /// The `reason` label of `router_migrations_total`.
    fn label(self) -> &'static str {
        match self {
            Break::Cut => "cut",
            Break::Stalled => "stalled",
            Break::ErrorEvent => "error_event",
            Break::Drained => "drained",
        }
    }

    /// What it counts as against the worker: a drain is no failure.
    pub(super) fn failure(self) -> Option<Failure> {
        match self {
            Break::Cut => Some(Failure::Cut),
            Break::Stalled => Some(Failure::Stalled),
            Break::ErrorEvent => Some(Failure::ServerError(500)),
            Break::Drained => None,
        }
    }
}

/// A stream's record of what it sent, and its continuation once one runs.
pub(super) struct Resume {
    request: Arc<ClientRequest>,
    /// Whole events passed on so far, as they went out.
    sent: Vec<Bytes>,
    /// The start of an event whose end has not arrived.
    partial: BytesMut,
    /// An error event waits behind what went out before it.
    error_pending: bool,
    /// Its worker's drain ended and it could not move: it stays.
    stays_drained: bool,
    state: State,
}

enum State {
    /// The worker's own stream.
    Direct,
    /// Looking for a worker to continue on.
    Resuming(Box<Resuming>),
    /// Another worker's stream, spliced on.
    Continued {
        inner: Box<TrackedBody>,
        splicer: Splicer,
    },
}

struct Resuming {
    why: Break,
    started: tokio::time::Instant,
    sent: Sent,
    api: Api,
    answer: Pin<Box<dyn Future<Output = Answer> + Send>>,
}

/// What a piece of the worker's stream gives the client.
pub(super) enum Whole {
    /// Whole events, to pass on.
    Events(Bytes),
    /// Nothing yet: the piece ends inside an event.
    Nothing,
    /// An error event, after `before` (whole events to pass on first).
    ErrorEvent { before: Option<Bytes> },
}

impl Resume {
    pub(super) fn new(request: Arc<ClientRequest>) -> Resume {
        Resume {
            request,
            sent: Vec::new(),
            partial: BytesMut::new(),
            error_pending: false,
            stays_drained: false,
            state: State::Direct,
        }
    }

    /// Still on the worker's own stream.
    pub(super) fn is_direct(&self) -> bool {
        matches!(self.state, State::Direct)
    }

    /// Holds something the client has not had, or reads from elsewhere.
    pub(super) fn is_holding(&self) -> bool {
        !self.partial.is_empty() || !self.is_direct()
    }

    /// Whether it may still move off a drained worker.
    pub(super) fn may_leave_drained(&self) -> bool {
        !self.stays_drained
    }

    pub(super) fn stay_drained(&mut self) {
        self.stays_drained = true;
    }

    /// Whether an error event is next.
    pub(super) fn take_error_pending(&mut self) -> bool {
        std::mem::take(&mut self.error_pending)
    }

    /// An unfinished event left when the worker's stream ended cleanly.
    pub(super) fn rest(&mut self) -> Option<Bytes> {
        (!self.partial.is_empty()).then(|| self.partial.split().freeze())
    }

    /// The whole events of `piece` (with what was held before it), kept
    /// as sent; an unfinished event's start is held for the next piece.
    pub(super) fn take_whole_events(&mut self, piece: Bytes) -> Whole {
        let data = if self.partial.is_empty() {
            piece
        } else {
            self.partial.extend_from_slice(&piece);
            self.partial.split().freeze()
        };
        let end = last_event_end(&data);
        if end < data.len() {
            self.partial.extend_from_slice(&data[end..]);
        }
        let whole = data.slice(..end);
        if memmem::find(&whole, b"\"error\"").is_some()
            && let Some(at) = error_event_start(&whole)
        {
            if at == 0 {
                return Whole::ErrorEvent { before: None };
            }
            let before = whole.slice(..at);
            self.sent.push(before.clone());
            self.error_pending = true;
            return Whole::ErrorEvent {
                before: Some(before),
            };
        }
        if whole.is_empty() {
            return Whole::Nothing;
        }
        self.sent.push(whole.clone());
        Whole::Events(whole)
    }
}

impl TrackedBody {
    /// Starts continuing the broken stream on another worker; `false` when
    /// it cannot be (migration off or spent, the deadline passed, a request
    /// that cannot be continued faithfully), and then nothing changed.
    pub(super) fn start_continuation(&mut self, why: Break) -> bool {
        let Some(resume) = self.resume.as_mut() else {
            return false;
        };
        let request = resume.request.clone();
        let count = |outcome: &'static str| {
            self.app
                .metrics
                .migrations
                .get_or_create(&MigrationLabels {
                    reason: why.label(),
                    outcome,
                })
                .inc();
        };
        let Some(api) = request.api else {
            return false;
        };
        let now = tokio::time::Instant::now();
        if request.migrations_left == 0 || now >= request.deadline {
            count("refused");
            tracing::debug!(
                reason = why.label(),
                "stream broke with no continuation left (migration.max_migrations or the deadline)"
            );
            return false;
        }
        let sent = Sent::read(api, &resume.sent);
        let body = match continuation(api, &request.body, &sent) {
            Ok(body) => body,
            Err(refusal) => {
                count("refused");
                tracing::debug!(
                    reason = why.label(),
                    refusal = refusal.as_str(),
                    "stream broke and cannot be continued faithfully: {refusal}"
                );
                return false;
            }
        };
        let Some(tracker) = self.tracker.take() else {
            return false;
        };
        let worker = tracker.worker().clone();
        if let Some(failure) = why.failure() {
            worker
                .metrics
                .request_status(&self.app.metrics, failure.label());
            tracker.failed(&self.app, failure);
        }
        drop(tracker);
        tracing::debug!(worker = %worker.url, reason = why.label(), sent_tokens = sent.tokens_sent, "stream broke; continuing it on another worker");
        if let Some(trace) = &request.trace {
            trace.migration(why.label());
        }
        self.silent = None;
        let continued = Arc::new(request.continuation(&self.app, body, worker.id));
        let app = self.app.clone();
        resume.state = State::Resuming(Box::new(Resuming {
            why,
            started: now,
            sent,
            api,
            answer: Box::pin(async move { forward(&app, &continued).await }),
        }));
        true
    }

    /// The stream once it broke: the search for a worker to continue on,
    /// then that worker's events, spliced.
    pub(super) fn poll_continued(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, std::io::Error>>> {
        loop {
            let Some(resume) = self.resume.as_mut() else {
                return Poll::Ready(None);
            };
            match &mut resume.state {
                State::Direct => return Poll::Ready(None),
                State::Resuming(resuming) => {
                    let answer = ready!(resuming.answer.as_mut().poll(cx));
                    let why = resuming.why;
                    let labels = |outcome| MigrationLabels {
                        reason: why.label(),
                        outcome,
                    };
                    let status = answer.status();
                    let (_, body) = answer.into_parts();
                    match body {
                        ProxyBody::Stream(inner) if status == StatusCode::OK => {
                            let splicer = Splicer::new(resuming.api, &resuming.sent);
                            let metrics = &self.app.metrics;
                            metrics.migrations.get_or_create(&labels("resumed")).inc();
                            metrics
                                .migration_resume
                                .observe(since(resuming.started.into_std(), tokio_now_std()));
                            resume.state = State::Continued { inner, splicer };
                        }
                        other => {
                            self.app
                                .metrics
                                .migrations
                                .get_or_create(&labels("failed"))
                                .inc();
                            resume.state = State::Direct;
                            let message = answer_message(status, other);
                            return self.end_early(
                                None,
                                "upstream_error",
                                format!(
                                    "the worker's stream broke ({}) and no other worker continued it: {message}",
                                    why.label()
                                ),
                            );
                        }
                    }
                }
                State::Continued { inner, splicer } => match inner.poll_piece(cx) {
                    Poll::Ready(Some(Ok(bytes))) => {
                        let out = splicer.feed(&bytes);
                        if let Some(error) = splicer.engine_error() {
                            // The continuation gave up (its own error event,
                            // or its engine's): the client's stream ends so.
                            let mut ending = BytesMut::from(&out[..]);
                            ending.extend_from_slice(b"data: ");
                            ending.extend_from_slice(error);
                            ending.extend_from_slice(b"\n\n");
                            self.ended = true;
                            return Poll::Ready(Some(Ok(ending.freeze())));
                        }
                        if !out.is_empty() {
                            return self.pass(out);
                        }
                    }
                    Poll::Ready(Some(Err(error))) => return Poll::Ready(Some(Err(error))),
                    Poll::Ready(None) => {
                        let rest = splicer.finish();
                        if splicer.torn_tail() {
                            tracing::debug!(
                                "the continuing stream ended inside an event; its start was dropped"
                            );
                        }
                        self.ended = true;
                        return Poll::Ready((!rest.is_empty()).then_some(Ok(rest)));
                    }
                    Poll::Pending => return Poll::Pending,
                },
            }
        }
    }
}

fn tokio_now_std() -> std::time::Instant {
    tokio::time::Instant::now().into_std()
}

/// The message of a router answer that is not a stream (its JSON error's
/// `message`), for the error event that ends the client's stream.
fn answer_message(status: StatusCode, body: ProxyBody) -> String {
    if let ProxyBody::Whole(Some(bytes)) = body
        && let Ok(error) = serde_json::from_slice::<serde_json::Value>(&bytes)
        && let Some(message) = error.pointer("/error/message").and_then(|m| m.as_str())
    {
        return message.to_owned();
    }
    format!("answered {status}")
}

/// The non-streaming answer of a request sent upstream as a stream: its
/// events assembled into the JSON the engine would have answered. Any
/// answer but a 200 stream is the client's as it is.
pub(super) async fn assembled(api: Api, answer: Answer) -> Answer {
    if answer.status() != StatusCode::OK {
        return answer;
    }
    let (mut parts, body) = answer.into_parts();
    let ProxyBody::Stream(mut stream) = body else {
        return Answer::from_parts(parts, body);
    };
    let mut assembler = Assembler::new(api);
    while let Some(piece) = poll_fn(|cx| stream.poll_piece(cx)).await {
        match piece {
            Ok(bytes) => assembler.feed(&bytes),
            Err(_) => break,
        }
    }
    // The dispatch ends with the stream, before the answer goes out.
    drop(stream);
    match assembler.finish() {
        Ok(whole) => {
            parts.headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            parts.headers.remove(header::CACHE_CONTROL);
            Answer::from_parts(parts, ProxyBody::whole(whole))
        }
        Err(error) => {
            tracing::debug!(
                error = error.as_str(),
                "a non-streaming answer was not assembled"
            );
            match error.engine_json() {
                // The engine's own error, as it would have answered it.
                Some(engine) => {
                    let mut answer = Answer::new(ProxyBody::whole(engine.clone()));
                    *answer.status_mut() = error.status();
                    answer.headers_mut().insert(
                        header::CONTENT_TYPE,
                        HeaderValue::from_static("application/json"),
                    );
                    answer
                }
                None => gateway_error(
                    error.status(),
                    "upstream_error",
                    format!("the worker's answer did not complete: {error}"),
                ),
            }
        }
    }
}

/// Where the last whole SSE event of `data` ends (0: none does).
fn last_event_end(data: &[u8]) -> usize {
    let lf = memmem::rfind(data, b"\n\n").map_or(0, |at| at + 2);
    let crlf = memmem::rfind(data, b"\r\n\r\n").map_or(0, |at| at + 4);
    lf.max(crlf)
}

/// Where the first event of `events` (whole events) that carries a
/// top-level `error` begins.
fn error_event_start(events: &[u8]) -> Option<usize> {
    let mut start = 0;
    while start < events.len() {
        let rest = &events[start..];
        let end = [
            memmem::find(rest, b"\n\n").map(|at| at + 2),
            memmem::find(rest, b"\r\n\r\n").map(|at| at + 4),
        ]
        .into_iter()
        .flatten()
        .min()
        .unwrap_or(rest.len());
        if crate::migration::is_error_event(&rest[..end]) {
            return Some(start);
        }
        start += end;
    }
    None
}
