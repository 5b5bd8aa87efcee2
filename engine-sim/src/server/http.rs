//! The HTTP side of a mock engine: health, models, generation (plain and
//! SSE), SGLang's `/health_generate`, the flavour's load endpoints, fault
//! control and request counters.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderValue, Request, Response, StatusCode, header};
use axum::routing::{get, post};
use futures::StreamExt;
use futures::stream::{self, BoxStream};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tower::ServiceExt;

use super::{EngineShared, FaultMode, Flavour, Progress, ServeMode};
use crate::error::EngineSimError;
use crate::model::{EngineRequest, EngineSnapshot};
use crate::reports;

const PROMETHEUS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";
const SSE_CONTENT_TYPE: &str = "text/event-stream";
/// Under `close-mid-stream`, how long the written chunks get to reach the
/// client before the connection is cut.
const CUT_FLUSH_DELAY: Duration = Duration::from_millis(50);
/// `/health_generate` reads its one-token answer whole; far more than enough.
const PROBE_BODY_LIMIT_BYTES: usize = 1 << 20;
const WORDS: [&str; 8] = [
    " the", " engine", " sim", " says", " hello", " to", " every", " router",
];

type Shared = Arc<EngineShared>;

/// Accepts connections until the engine stops, serving each with the router;
/// under [`FaultMode::RefuseConnections`] every request but `/control/*`
/// closes its connection unanswered. A kill drops every open connection at
/// once; a graceful stop lets them finish for a while first.
pub(super) async fn serve(listener: TcpListener, shared: Shared) {
    let router = router(shared.clone());
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let _ = stream.set_nodelay(true);
                let router = router.clone();
                let shared = shared.clone();
                connections.spawn(serve_connection(stream, router, shared));
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            () = shared.stopped() => break,
        }
    }
    drop(listener);
    if shared.killed() {
        // Joining, not just aborting: every socket is closed on return.
        connections.abort_all();
        while connections.join_next().await.is_some() {}
        return;
    }
    let drained = tokio::time::timeout(Duration::from_secs(2), async {
        while connections.join_next().await.is_some() {}
    });
    if drained.await.is_err() {
        connections.abort_all();
    }
}

async fn serve_connection(stream: tokio::net::TcpStream, router: Router, shared: Shared) {
    let service_shared = shared.clone();
    let service = hyper::service::service_fn(move |request: Request<Incoming>| {
        let router = router.clone();
        let refuse = service_shared.fault() == FaultMode::RefuseConnections
            && !request.uri().path().starts_with("/control/");
        async move {
            if refuse {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::ConnectionRefused,
                    "refusing connections (fault mode)",
                ));
            }
            match router.oneshot(request).await {
                Ok(response) => Ok(response),
                Err(never) => match never {},
            }
        }
    });
    let builder = auto::Builder::new(TokioExecutor::new());
    let connection = builder.serve_connection(TokioIo::new(stream), service);
    let mut connection = std::pin::pin!(connection);
    tokio::select! {
        _ = connection.as_mut() => {}
        () = shared.stopped() => {
            // Killed: return, dropping the socket mid-whatever.
            if !shared.killed() {
                connection.as_mut().graceful_shutdown();
                let _ = connection.await;
            }
        }
    }
}

fn router(shared: Shared) -> Router {
    let mut router = Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/generate", post(generate))
        .route("/control/fault", post(set_fault).get(get_fault))
        .route("/control/stats", get(stats))
        .route("/control/admitted", get(admitted));
    match shared.config.flavour {
        Flavour::Sglang => {
            router = router
                .route("/v1/loads", get(sglang_loads))
                .route("/metrics", get(sglang_metrics))
                .route("/health_generate", get(health_generate));
        }
        Flavour::SglangMetrics => {
            router = router
                .route("/metrics", get(sglang_metrics))
                .route("/health_generate", get(health_generate));
        }
        Flavour::Vllm => router = router.route("/metrics", get(vllm_metrics)),
        Flavour::Tokenspeed => {}
    }
    router.with_state(shared)
}

async fn health() -> StatusCode {
    StatusCode::OK
}

async fn models(State(shared): State<Shared>) -> Response<Body> {
    json_response(
        StatusCode::OK,
        &json!({
            "object": "list",
            "data": [{
                "id": shared.config.model_name,
                "object": "model",
                "created": 0,
                "owned_by": "engine-sim",
                "max_model_len": shared.config.params.kv_capacity_tokens,
            }],
        }),
    )
}

#[derive(Debug, Deserialize)]
struct FaultBody {
    mode: String,
}

async fn set_fault(State(shared): State<Shared>, body: Bytes) -> Response<Body> {
    let parsed = serde_json::from_slice::<FaultBody>(&body)
        .ok()
        .and_then(|body| body.mode.parse::<FaultMode>().ok());
    match parsed {
        Some(mode) => {
            let previous = shared.fault();
            shared.set_fault(mode);
            tracing::info!(engine = shared.index, %previous, %mode, "fault mode switched");
            json_response(
                StatusCode::OK,
                &json!({"mode": mode.as_str(), "previous": previous.as_str()}),
            )
        }
        None => {
            let names: Vec<&str> = FaultMode::ALL.iter().map(|mode| mode.as_str()).collect();
            error_response(
                StatusCode::BAD_REQUEST,
                &format!("expected {{\"mode\": one of {}}}", names.join(", ")),
            )
        }
    }
}

async fn get_fault(State(shared): State<Shared>) -> Response<Body> {
    json_response(StatusCode::OK, &json!({"mode": shared.fault().as_str()}))
}

async fn stats(State(shared): State<Shared>) -> Response<Body> {
    let stats = shared.counters.stats();
    json_response(
        StatusCode::OK,
        &json!({
            "generation_requests": stats.generation_requests,
            "health_generate_requests": stats.health_generate_requests,
            "fault": shared.fault().as_str(),
        }),
    )
}

async fn admitted(State(shared): State<Shared>) -> Response<Body> {
    let admitted = shared.counters.admitted();
    json_response(
        StatusCode::OK,
        &json!({
            "admitted_request_ids": admitted.ids,
            "admitted_total": admitted.total,
        }),
    )
}

// ---------------------------------------------------------------- loads

/// Applies the load-endpoint faults; `Err` is the response to send instead.
async fn load_fault(shared: &Shared) -> Result<FaultMode, Response<Body>> {
    let fault = shared.fault();
    match fault {
        FaultMode::SlowLoads => {
            tokio::select! {
                () = tokio::time::sleep(shared.config.slow_loads_delay) => {}
                () = shared.stopped() => {
                    return Err(error_response(StatusCode::SERVICE_UNAVAILABLE, "shutting down"));
                }
            }
            Ok(fault)
        }
        FaultMode::Loads500 => Err(error_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal error (fault mode loads-500)",
        )),
        other => Ok(other),
    }
}

#[derive(Debug, Deserialize, Default)]
#[serde(default)]
struct LoadsQuery {
    format: Option<String>,
    dp_rank: Option<i64>,
}

async fn sglang_loads(State(shared): State<Shared>, query: Query<LoadsQuery>) -> Response<Body> {
    let fault = match load_fault(&shared).await {
        Ok(fault) => fault,
        Err(response) => return response,
    };
    let snapshot = shared.snapshot();
    if query.format.as_deref() == Some("prometheus") {
        return metrics_response(fault, sglang_metrics_body(&shared, &snapshot, fault));
    }
    match fault {
        FaultMode::MalformedLoads => {
            return text_response(
                "application/json",
                "{\"timestamp\": \"\", \"loads\": [{\"dp_rank\": 0, \"num_running_reqs\": \"many\", "
                    .to_owned(),
            );
        }
        FaultMode::NanLoads => {
            return text_response("application/json", nan_loads_body(&snapshot));
        }
        _ => {}
    }
    let mut body = reports::sglang_loads(&snapshot, reports::rfc3339_now());
    if let Some(rank) = query.dp_rank {
        body.loads.retain(|load| load.dp_rank == rank);
    }
    match serde_json::to_string(&body) {
        Ok(text) => text_response("application/json", text),
        Err(_) => error_response(StatusCode::INTERNAL_SERVER_ERROR, "encoding failed"),
    }
}

/// The SGLang body with bare `NaN` literals (what Python's `json` writes).
fn nan_loads_body(snapshot: &EngineSnapshot) -> String {
    let rank = reports::sglang_rank(snapshot);
    format!(
        "{{\"timestamp\": \"{}\", \"version\": \"{}\", \"dp_rank_count\": 1, \"loads\": [{{\
         \"dp_rank\": 0, \"num_running_reqs\": {}, \"num_waiting_reqs\": {}, \
         \"num_waiting_uncached_tokens\": {}, \"num_total_reqs\": {}, \"num_used_tokens\": {}, \
         \"max_total_num_tokens\": {}, \"token_usage\": NaN, \"gen_throughput\": NaN, \
         \"cache_hit_rate\": NaN, \"utilization\": NaN, \"max_running_requests\": {}}}]}}",
        reports::rfc3339_now(),
        reports::SIM_VERSION,
        rank.num_running_reqs,
        rank.num_waiting_reqs,
        rank.num_waiting_uncached_tokens.unwrap_or(0),
        rank.num_total_reqs,
        rank.num_used_tokens,
        rank.max_total_num_tokens,
        rank.max_running_requests,
    )
}

async fn sglang_metrics(State(shared): State<Shared>) -> Response<Body> {
    let fault = match load_fault(&shared).await {
        Ok(fault) => fault,
        Err(response) => return response,
    };
    let snapshot = shared.snapshot();
    metrics_response(fault, sglang_metrics_body(&shared, &snapshot, fault))
}

fn sglang_metrics_body(shared: &Shared, snapshot: &EngineSnapshot, fault: FaultMode) -> String {
    match fault {
        FaultMode::NanLoads => {
            let nan = EngineSnapshot {
                decode_tps: f64::NAN,
                cache_hit_rate: f64::NAN,
                ..*snapshot
            };
            // token_usage is derived; rewrite its sample by hand.
            reports::sglang_metrics_text(&nan, &shared.config.model_name)
                .lines()
                .map(|line| nan_sample(line, "sglang:token_usage{"))
                .collect::<Vec<_>>()
                .join("\n")
                + "\n"
        }
        _ => reports::sglang_metrics_text(snapshot, &shared.config.model_name),
    }
}

async fn vllm_metrics(State(shared): State<Shared>) -> Response<Body> {
    let fault = match load_fault(&shared).await {
        Ok(fault) => fault,
        Err(response) => return response,
    };
    let snapshot = shared.snapshot();
    let text = reports::vllm_metrics_text(&snapshot, &shared.config.model_name, 0);
    let text = match fault {
        FaultMode::NanLoads => {
            text.lines()
                .map(|line| nan_sample(line, "vllm:kv_cache_usage_perc{"))
                .collect::<Vec<_>>()
                .join("\n")
                + "\n"
        }
        _ => text,
    };
    metrics_response(fault, text)
}

/// Replaces the value of the sample line starting with `prefix` by `NaN`.
fn nan_sample(line: &str, prefix: &str) -> String {
    match (line.starts_with(prefix), line.rfind(' ')) {
        (true, Some(space)) => format!("{} NaN", &line[..space]),
        _ => line.to_owned(),
    }
}

fn metrics_response(fault: FaultMode, text: String) -> Response<Body> {
    if fault == FaultMode::MalformedLoads {
        return text_response(
            PROMETHEUS_CONTENT_TYPE,
            "# TYPE broken gauge\nvllm:num_requests_running{engine=\"0\" 3 x\n\
             sglang:num_running_reqs{{{ not a number\n\u{0}\u{1}garbage"
                .to_owned(),
        );
    }
    text_response(PROMETHEUS_CONTENT_TYPE, text)
}

// ---------------------------------------------------------------- generation

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    Chat,
    Completions,
    Generate,
}

async fn chat_completions(
    State(shared): State<Shared>,
    headers: HeaderMap,
    body: Bytes,
) -> Response<Body> {
    generation(shared, Api::Chat, &headers, body).await
}

async fn completions(
    State(shared): State<Shared>,
    headers: HeaderMap,
    body: Bytes,
) -> Response<Body> {
    generation(shared, Api::Completions, &headers, body).await
}

async fn generate(State(shared): State<Shared>, headers: HeaderMap, body: Bytes) -> Response<Body> {
    generation(shared, Api::Generate, &headers, body).await
}

/// The header whose value `/control/admitted` records.
const REQUEST_ID_HEADER: &str = "x-request-id";

/// What a generation request asks for.
#[derive(Debug, Clone, PartialEq)]
struct GenerationRequest {
    stream: bool,
    prompt_tokens: u32,
    output_tokens: u32,
    /// Whether `max_tokens` (or its equivalent) bounded the output.
    bounded: bool,
    /// Content hashes of the prompt's full prefix-cache blocks.
    prefix_block_hashes: Vec<u64>,
}

fn parse_generation(
    api: Api,
    body: &Value,
    block_size_tokens: u32,
    default_output: u32,
) -> GenerationRequest {
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let max_tokens = body
        .get("max_tokens")
        .or_else(|| body.get("max_completion_tokens"))
        .or_else(|| body.pointer("/sampling_params/max_new_tokens"))
        .and_then(Value::as_u64);
    let output_tokens = max_tokens.map_or(default_output, |n| clamp_u32(n.max(1)));
    let block = block_size_tokens.max(1) as usize;
    let input_ids = body.get("input_ids").and_then(Value::as_array).map(|ids| {
        // A batch (array of arrays) counts its first sequence.
        match ids.first().and_then(Value::as_array) {
            Some(first) => first.clone(),
            None => ids.clone(),
        }
    });
    let (prompt_tokens, prefix_block_hashes) = match input_ids {
        Some(ids) => {
            let hashes = ids
                .chunks_exact(block)
                .map(|chunk| {
                    chunk.iter().fold(FNV_OFFSET, |hash, id| {
                        fnv1a(hash, &id.as_u64().unwrap_or(0).to_le_bytes())
                    })
                })
                .collect();
            (clamp_u32(ids.len() as u64).max(1), hashes)
        }
        None => {
            let text = prompt_text(api, body);
            let chars = text.chars().count() as u64;
            // chars / 4 (rounded up); a block of tokens is 4 × block chars.
            let hashes = text
                .as_bytes()
                .chunks_exact(block * 4)
                .map(|chunk| fnv1a(FNV_OFFSET, chunk))
                .collect();
            (clamp_u32(chars.div_ceil(4)).max(1), hashes)
        }
    };
    GenerationRequest {
        stream,
        prompt_tokens,
        output_tokens,
        bounded: max_tokens.is_some(),
        prefix_block_hashes,
    }
}

/// The prompt's text: chat messages' contents, a completion prompt, or
/// SGLang's `text`.
fn prompt_text(api: Api, body: &Value) -> String {
    let mut text = String::new();
    let mut push = |value: &Value| match value {
        Value::String(s) => text.push_str(s),
        Value::Array(parts) => {
            for part in parts {
                match part {
                    Value::String(s) => text.push_str(s),
                    other => {
                        if let Some(s) = other.get("text").and_then(Value::as_str) {
                            text.push_str(s);
                        }
                    }
                }
            }
        }
        _ => {}
    };
    match api {
        Api::Chat => {
            if let Some(messages) = body.get("messages").and_then(Value::as_array) {
                for message in messages {
                    if let Some(content) = message.get("content") {
                        push(content);
                    }
                }
            }
        }
        Api::Completions => {
            if let Some(prompt) = body.get("prompt") {
                push(prompt);
            }
        }
        Api::Generate => {
            if let Some(prompt) = body.get("text") {
                push(prompt);
            }
        }
    }
    text
}

async fn generation(shared: Shared, api: Api, headers: &HeaderMap, body: Bytes) -> Response<Body> {
    // Counted on arrival, before parsing or any fault.
    shared
        .counters
        .generation_requests
        .fetch_add(1, Ordering::Relaxed);
    let body: Value = match serde_json::from_slice(&body) {
        Ok(value) => value,
        Err(_) => return error_response(StatusCode::BAD_REQUEST, "request body is not json"),
    };
    let request = parse_generation(
        api,
        &body,
        shared.config.params.block_size_tokens,
        shared.config.default_output_tokens,
    );
    let request_id = headers
        .get(REQUEST_ID_HEADER)
        .and_then(|value| value.to_str().ok())
        .map(str::to_owned);
    answer(shared, api, request, request_id).await
}

/// SGLang's deep health check: a one-token generation through [`answer`],
/// so every generation fault applies. 200 when it completes, 500 when it
/// fails or its answer breaks off (SGLang's body is empty either way).
async fn health_generate(State(shared): State<Shared>) -> Response<Body> {
    shared
        .counters
        .health_generate_requests
        .fetch_add(1, Ordering::Relaxed);
    let probe = GenerationRequest {
        stream: false,
        prompt_tokens: 1,
        output_tokens: 1,
        bounded: true,
        prefix_block_hashes: Vec::new(),
    };
    let response = answer(shared, Api::Generate, probe, None).await;
    let status = response.status();
    let body = axum::body::to_bytes(response.into_body(), PROBE_BODY_LIMIT_BYTES).await;
    let healthy = status == StatusCode::OK && body.is_ok();
    let mut answer = Response::new(Body::empty());
    if !healthy {
        *answer.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
    }
    answer
}

/// Answers a parsed generation request, applying the generation faults;
/// `request_id` is recorded as admitted once the request gets past them.
async fn answer(
    shared: Shared,
    api: Api,
    request: GenerationRequest,
    request_id: Option<String>,
) -> Response<Body> {
    match shared.fault() {
        FaultMode::HangGeneration => return hang(&shared).await,
        FaultMode::HangMidStream if !request.stream => return hang(&shared).await,
        FaultMode::Generation500 => {
            return error_response(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal error (fault mode generation-500)",
            );
        }
        FaultMode::SlowFirstByte => {
            tokio::select! {
                () = tokio::time::sleep(shared.config.slow_first_byte_delay) => {}
                () = shared.stopped() => {
                    return error_response(StatusCode::SERVICE_UNAVAILABLE, "shutting down");
                }
            }
        }
        _ => {}
    }
    let id = shared.next_request_id.fetch_add(1, Ordering::Relaxed);
    let meta = ResponseMeta {
        id,
        api,
        model: shared.config.model_name.clone(),
        created_s: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        prompt_tokens: request.prompt_tokens,
        finish_reason: if request.bounded { "length" } else { "stop" },
    };
    // Recorded only once generation really starts: a request dropped during
    // a pre-model hang or delay, or refused, was never generated.
    let admit = |shared: &Shared| {
        if let Some(request_id) = &request_id {
            shared.counters.admit(request_id);
        }
    };
    let progress: BoxStream<'static, Progress> = match shared.config.mode {
        ServeMode::Canned => {
            admit(&shared);
            let tokens = shared.config.canned_tokens.max(1);
            stream::iter(
                (1..=tokens)
                    .map(|generated_tokens| Progress::Token { generated_tokens })
                    .chain(std::iter::once(Progress::Finished(canned_record(
                        id, &request, tokens,
                    )))),
            )
            .boxed()
        }
        ServeMode::Model => match submit(&shared, id, &request) {
            Ok(receiver) => {
                admit(&shared);
                progress_stream(
                    receiver,
                    RequestGuard {
                        shared: shared.clone(),
                        id,
                    },
                )
            }
            Err(error) => return error_response(StatusCode::BAD_REQUEST, &error.to_string()),
        },
    };
    if request.stream {
        stream_response(shared, meta, progress)
    } else {
        whole_response(shared, meta, progress).await
    }
}

/// Never answers; the engine stopping ends it.
async fn hang(shared: &Shared) -> Response<Body> {
    shared.stopped().await;
    error_response(StatusCode::SERVICE_UNAVAILABLE, "shutting down")
}

fn canned_record(id: u64, request: &GenerationRequest, tokens: u32) -> crate::model::RequestRecord {
    crate::model::RequestRecord {
        id,
        prompt_tokens: request.prompt_tokens,
        output_tokens: tokens,
        cached_tokens: 0,
        arrival_s: 0.0,
        admitted_s: 0.0,
        first_token_s: 0.0,
        finish_s: 0.0,
        preemptions: 0,
    }
}

/// Queues the request in the model and registers its waiter.
fn submit(
    shared: &Shared,
    id: u64,
    request: &GenerationRequest,
) -> Result<mpsc::UnboundedReceiver<Progress>, EngineSimError> {
    let (sender, receiver) = mpsc::unbounded_channel();
    {
        let now_s = shared.clock.now_s();
        let mut core = shared.core.lock();
        // Catch the model up first, so the request joins at the right step.
        core.advance(now_s);
        let submitted = core.engine.submit(EngineRequest {
            id,
            prompt_tokens: request.prompt_tokens,
            output_tokens: request.output_tokens,
            arrival_s: now_s,
            prefix_block_hashes: request.prefix_block_hashes.clone(),
        });
        submitted?;
        core.waiters.insert(id, sender);
    }
    shared.wake.notify_one();
    Ok(receiver)
}

/// Aborts the request in the model if its response is dropped early.
#[derive(Debug)]
struct RequestGuard {
    shared: Shared,
    id: u64,
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        let mut core = self.shared.core.lock();
        core.waiters.remove(&self.id);
        core.engine.abort(self.id);
    }
}

fn progress_stream(
    receiver: mpsc::UnboundedReceiver<Progress>,
    guard: RequestGuard,
) -> BoxStream<'static, Progress> {
    stream::unfold((receiver, guard), |(mut receiver, guard)| async move {
        let progress = receiver.recv().await?;
        Some((progress, (receiver, guard)))
    })
    .boxed()
}

#[derive(Debug, Clone)]
struct ResponseMeta {
    id: u64,
    api: Api,
    model: String,
    created_s: u64,
    prompt_tokens: u32,
    finish_reason: &'static str,
}

impl ResponseMeta {
    fn response_id(&self) -> String {
        match self.api {
            Api::Chat => format!("chatcmpl-sim-{}", self.id),
            Api::Completions => format!("cmpl-sim-{}", self.id),
            Api::Generate => format!("sim-{}", self.id),
        }
    }

    fn usage(&self, completion_tokens: u32) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": u64::from(self.prompt_tokens) + u64::from(completion_tokens),
        })
    }

    /// One SSE chunk carrying `token` (the `generated_tokens`-th); `finish`
    /// marks the final chunk.
    fn chunk(&self, generated_tokens: u32, text_so_far: &str, finish: bool) -> Value {
        let token = word(generated_tokens);
        let finish_reason = if finish {
            json!(self.finish_reason)
        } else {
            Value::Null
        };
        match self.api {
            Api::Chat => {
                let delta = if finish {
                    json!({})
                } else if generated_tokens == 1 {
                    json!({"role": "assistant", "content": token})
                } else {
                    json!({"content": token})
                };
                json!({
                    "id": self.response_id(), "object": "chat.completion.chunk",
                    "created": self.created_s, "model": self.model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
                })
            }
            Api::Completions => json!({
                "id": self.response_id(), "object": "text_completion",
                "created": self.created_s, "model": self.model,
                "choices": [{"index": 0, "text": if finish { "" } else { token },
                             "logprobs": null, "finish_reason": finish_reason}],
            }),
            Api::Generate => json!({
                "text": text_so_far,
                "meta_info": self.generate_meta(generated_tokens, finish),
            }),
        }
    }

    fn generate_meta(&self, completion_tokens: u32, finish: bool) -> Value {
        json!({
            "id": self.response_id(),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "cached_tokens": 0,
            "finish_reason": if finish {
                json!({"type": self.finish_reason, "length": completion_tokens})
            } else {
                Value::Null
            },
        })
    }

    fn whole(&self, completion_tokens: u32, text: &str) -> Value {
        match self.api {
            Api::Chat => json!({
                "id": self.response_id(), "object": "chat.completion",
                "created": self.created_s, "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": self.finish_reason}],
                "usage": self.usage(completion_tokens),
            }),
            Api::Completions => json!({
                "id": self.response_id(), "object": "text_completion",
                "created": self.created_s, "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": null,
                             "finish_reason": self.finish_reason}],
                "usage": self.usage(completion_tokens),
            }),
            Api::Generate => json!({
                "text": text,
                "meta_info": self.generate_meta(completion_tokens, true),
            }),
        }
    }
}

fn word(generated_tokens: u32) -> &'static str {
    WORDS[generated_tokens as usize % WORDS.len()]
}

/// The connection error that cuts a response under `close-mid-stream`.
fn cut() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::ConnectionReset,
        "closing mid-stream (fault mode)",
    )
}

async fn whole_response(
    shared: Shared,
    meta: ResponseMeta,
    mut progress: BoxStream<'static, Progress>,
) -> Response<Body> {
    let mut text = String::new();
    let mut generated = 0;
    loop {
        let next = tokio::select! {
            next = progress.next() => next,
            () = shared.stopped() => None,
        };
        match next {
            Some(Progress::Token { generated_tokens }) => {
                generated = generated_tokens;
                text.push_str(word(generated_tokens));
            }
            Some(Progress::Finished(record)) => {
                generated = generated.max(record.output_tokens);
                break;
            }
            None => return error_response(StatusCode::SERVICE_UNAVAILABLE, "engine stopped"),
        }
    }
    if shared.fault() == FaultMode::CloseMidStream {
        // Headers, then a body that breaks off.
        let head = stream::iter([Ok::<_, std::io::Error>(Bytes::from_static(b"{\"id\": "))]);
        let tail = stream::once(async move {
            tokio::select! {
                () = tokio::time::sleep(CUT_FLUSH_DELAY) => {}
                () = shared.stopped() => {}
            }
            Err(cut())
        });
        let body = Body::from_stream(head.chain(tail));
        return with_content_type(Response::new(body), "application/json");
    }
    json_response(StatusCode::OK, &meta.whole(generated, &text))
}

fn stream_response(
    shared: Shared,
    meta: ResponseMeta,
    progress: BoxStream<'static, Progress>,
) -> Response<Body> {
    struct State {
        progress: BoxStream<'static, Progress>,
        shared: Shared,
        meta: ResponseMeta,
        text: String,
        sent_chunks: u32,
        done: bool,
    }
    let state = State {
        progress,
        shared,
        meta,
        text: String::new(),
        sent_chunks: 0,
        done: false,
    };
    let body = stream::unfold(state, |mut state| async move {
        if state.done {
            return None;
        }
        if state.sent_chunks >= 1 && state.shared.fault() == FaultMode::HangMidStream {
            // Silent from here on; the written events are flushed because
            // the body is pending.
            state.shared.stopped().await;
            state.done = true;
            return Some((Err(cut()), state));
        }
        if state.sent_chunks >= 1 && state.shared.fault() == FaultMode::CloseMidStream {
            // Let the chunks already written reach the client, then cut.
            tokio::select! {
                () = tokio::time::sleep(CUT_FLUSH_DELAY) => {}
                () = state.shared.stopped() => {}
            }
            state.done = true;
            return Some((Err(cut()), state));
        }
        let next = tokio::select! {
            next = state.progress.next() => next,
            () = state.shared.stopped() => None,
        };
        let bytes = match next {
            Some(Progress::Token { generated_tokens }) => {
                state.text.push_str(word(generated_tokens));
                sse(&state.meta.chunk(generated_tokens, &state.text, false))
            }
            Some(Progress::Finished(record)) => {
                state.done = true;
                let last = state.meta.chunk(record.output_tokens, &state.text, true);
                let mut bytes = sse(&last);
                bytes.extend_from_slice(b"data: [DONE]\n\n");
                bytes
            }
            None => {
                state.done = true;
                return Some((Err(cut()), state));
            }
        };
        state.sent_chunks += 1;
        Some((Ok(Bytes::from(bytes)), state))
    });
    let mut response = Response::new(Body::from_stream(body));
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    with_content_type(response, SSE_CONTENT_TYPE)
}

fn sse(value: &Value) -> Vec<u8> {
    let mut bytes = b"data: ".to_vec();
    // Serializing a Value cannot fail.
    bytes.extend_from_slice(value.to_string().as_bytes());
    bytes.extend_from_slice(b"\n\n");
    bytes
}

// ---------------------------------------------------------------- helpers

fn json_response(status: StatusCode, value: &Value) -> Response<Body> {
    let mut response = Response::new(Body::from(value.to_string()));
    *response.status_mut() = status;
    with_content_type(response, "application/json")
}

fn text_response(content_type: &'static str, text: String) -> Response<Body> {
    with_content_type(Response::new(Body::from(text)), content_type)
}

fn error_response(status: StatusCode, message: &str) -> Response<Body> {
    json_response(
        status,
        &json!({"error": {"message": message, "type": "engine_sim_error", "code": status.as_u16()}}),
    )
}

fn with_content_type(mut response: Response<Body>, content_type: &'static str) -> Response<Body> {
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

fn fnv1a(mut hash: u64, bytes: &[u8]) -> u64 {
    for &byte in bytes {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

fn clamp_u32(value: u64) -> u32 {
    u32::try_from(value).unwrap_or(u32::MAX)
}
