//! Generation: OpenAI chat and completions and SGLang's `/generate`, plain
//! or SSE, paced by the engine model or canned, with the generation faults;
//! and SGLang's `/health_generate`, a one-token generation.
//!
//! The generated tokens are a deterministic function of the context (the
//! prompt's text or ids, then every token generated so far), so a request
//! that continues a partial answer (a chat's final assistant message with
//! `continue_final_message`, a longer completion prompt, longer `input_ids`)
//! generates exactly the rest of the unbroken answer.

use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, Response, StatusCode, header};
use engine_model::EngineRequest;
use futures::StreamExt;
use futures::stream::{self, BoxStream};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::http::{Shared, error_response, json_response, with_content_type};
use super::{FaultMode, Progress, ServeMode};
use crate::error::EngineSimError;

const SSE_CONTENT_TYPE: &str = "text/event-stream";
/// Under `close-mid-stream`, how long the written chunks get to reach the
/// client before the connection is cut.
const CUT_FLUSH_DELAY: Duration = Duration::from_millis(50);
/// `/health_generate` reads its one-token answer whole; far more than enough.
const PROBE_BODY_LIMIT_BYTES: usize = 1 << 20;
/// The vocabulary's words, one per token. Each starts with a space and has
/// none inside, so a generated text splits back into the same tokens.
const WORDS: [&str; 32] = [
    " the", " engine", " sim", " says", " hello", " to", " every", " router", " token", " stream",
    " model", " cache", " prefix", " queue", " batch", " worker", " load", " fleet", " request",
    " answer", " fast", " steady", " warm", " cold", " byte", " word", " again", " and", " then",
    " now", " here", " there",
];
/// Generated token ids are `FIRST_GENERATED_ID ..
/// FIRST_GENERATED_ID + GENERATED_ID_COUNT`.
const FIRST_GENERATED_ID: u32 = 1000;
const GENERATED_ID_COUNT: u64 = 50_000;
/// Hashed between a chat's earlier messages and the answer, standing for
/// the chat template's assistant header: a continued final assistant
/// message sits after it, and a new turn after a final assistant message
/// starts from a different context than continuing that message would.
const ASSISTANT_TURN_START: &str = "\n<|assistant|>\n";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    Chat,
    Completions,
    Generate,
}

pub(super) async fn chat_completions(
    State(shared): State<Shared>,
    headers: HeaderMap,
    body: Bytes,
) -> Response<Body> {
    generation(shared, Api::Chat, &headers, body).await
}

pub(super) async fn completions(
    State(shared): State<Shared>,
    headers: HeaderMap,
    body: Bytes,
) -> Response<Body> {
    generation(shared, Api::Completions, &headers, body).await
}

pub(super) async fn generate(
    State(shared): State<Shared>,
    headers: HeaderMap,
    body: Bytes,
) -> Response<Body> {
    generation(shared, Api::Generate, &headers, body).await
}

/// The header whose value `/control/admitted` records.
const REQUEST_ID_HEADER: &str = "x-request-id";

/// What a generation request asks for.
#[derive(Debug, Clone, PartialEq)]
struct GenerationRequest {
    stream: bool,
    /// `stream_options.include_usage`: a streamed answer ends with a usage
    /// chunk, as the OpenAI API does.
    include_usage: bool,
    prompt_tokens: u32,
    output_tokens: u32,
    /// Whether `max_tokens` (or its equivalent) bounded the output.
    bounded: bool,
    /// Content hashes of the prompt's full prefix-cache blocks.
    prefix_block_hashes: Vec<u64>,
    /// Generates the answer's tokens from the request's context.
    generator: TokenGenerator,
}

/// Parses a generation request; `Err` carries a 400's message.
fn parse_generation(
    api: Api,
    body: &Value,
    block_size_tokens: u32,
    default_output: u32,
) -> Result<GenerationRequest, String> {
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let include_usage = body
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        .unwrap_or(false);
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
    let (prompt_tokens, prefix_block_hashes) = match &input_ids {
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
    let generator = match &input_ids {
        Some(ids) => TokenGenerator::over_ids(ids.iter().map(|id| id.as_u64().unwrap_or(0))),
        None if api == Api::Chat => TokenGenerator::over_text(&chat_context_text(body)?),
        None => TokenGenerator::over_text(&prompt_text(api, body)),
    };
    Ok(GenerationRequest {
        stream,
        include_usage,
        prompt_tokens,
        output_tokens,
        bounded: max_tokens.is_some(),
        prefix_block_hashes,
        generator,
    })
}

/// The text a chat's answer is generated from: the contents of the messages
/// before the answer, the assistant turn's start, and, when the request
/// continues its final assistant message (`continue_final_message`), that
/// message's content. `Err` when the continuation is asked for as vLLM
/// refuses it.
fn chat_context_text(body: &Value) -> Result<String, String> {
    let messages: &[Value] = body
        .get("messages")
        .and_then(Value::as_array)
        .map_or(&[], Vec::as_slice);
    let continue_final_message = body
        .get("continue_final_message")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    // vLLM's default, which continuing the final message must turn off.
    let add_generation_prompt = body
        .get("add_generation_prompt")
        .and_then(Value::as_bool)
        .unwrap_or(true);
    let (earlier_messages, continued_message) = if continue_final_message {
        if add_generation_prompt {
            return Err(
                "continue_final_message and add_generation_prompt cannot both be true \
                        (add_generation_prompt defaults to true: send it as false)"
                    .to_owned(),
            );
        }
        match messages.split_last() {
            Some((last, earlier))
                if last.get("role").and_then(Value::as_str) == Some("assistant") =>
            {
                (earlier, Some(last))
            }
            _ => {
                return Err(
                    "continue_final_message needs the last message to be an assistant message"
                        .to_owned(),
                );
            }
        }
    } else {
        (messages, None)
    };
    let mut text = String::new();
    for message in earlier_messages {
        if let Some(content) = message.get("content") {
            push_content(&mut text, content);
        }
    }
    text.push_str(ASSISTANT_TURN_START);
    if let Some(content) = continued_message.and_then(|message| message.get("content")) {
        push_content(&mut text, content);
    }
    Ok(text)
}

/// The prompt's text: chat messages' contents, a completion prompt, or
/// SGLang's `text`.
fn prompt_text(api: Api, body: &Value) -> String {
    let mut text = String::new();
    match api {
        Api::Chat => {
            if let Some(messages) = body.get("messages").and_then(Value::as_array) {
                for message in messages {
                    if let Some(content) = message.get("content") {
                        push_content(&mut text, content);
                    }
                }
            }
        }
        Api::Completions => {
            if let Some(prompt) = body.get("prompt") {
                push_content(&mut text, prompt);
            }
        }
        Api::Generate => {
            if let Some(prompt) = body.get("text") {
                push_content(&mut text, prompt);
            }
        }
    }
    text
}

/// Appends a content value's text: a string, or the strings and `text`
/// fields of an array of parts.
fn push_content(text: &mut String, content: &Value) {
    match content {
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
    }
}

/// How generated tokens extend the context they are hashed with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ContextForm {
    /// A text prompt: each token folds in as its word's bytes, so a prompt
    /// with the first words appended hashes as the unbroken run did.
    Text,
    /// `input_ids`: each token folds in as its id, as the prompt's ids did.
    TokenIds,
}

/// Generates tokens deterministically from the context: each token's id is
/// picked by an FNV-1a hash of the whole context so far, which the token
/// then extends (O(1) per token), and its text is a word picked by the id.
/// Keeps the tokens generated so far.
#[derive(Debug, Clone, PartialEq)]
struct TokenGenerator {
    form: ContextForm,
    context_hash: u64,
    /// The generated text so far (`text` of SGLang's `/generate`).
    text: String,
    /// The generated ids so far (`output_ids` of SGLang's `/generate`).
    output_ids: Vec<u32>,
}

impl TokenGenerator {
    fn over_text(prompt: &str) -> TokenGenerator {
        TokenGenerator {
            form: ContextForm::Text,
            context_hash: fnv1a(FNV_OFFSET, prompt.as_bytes()),
            text: String::new(),
            output_ids: Vec::new(),
        }
    }

    fn over_ids(input_ids: impl Iterator<Item = u64>) -> TokenGenerator {
        TokenGenerator {
            form: ContextForm::TokenIds,
            context_hash: input_ids.fold(FNV_OFFSET, |hash, id| fnv1a(hash, &id.to_le_bytes())),
            text: String::new(),
            output_ids: Vec::new(),
        }
    }

    fn generated_tokens(&self) -> u32 {
        clamp_u32(self.output_ids.len() as u64)
    }

    /// Generates tokens until `generated_tokens` exist; returns where the
    /// new tokens' text starts in `text` (for [`TokenGenerator::text_from`]).
    fn advance_to(&mut self, generated_tokens: u32) -> usize {
        let new_text_start = self.text.len();
        while self.generated_tokens() < generated_tokens {
            self.generate_one();
        }
        new_text_start
    }

    fn text_from(&self, byte_offset: usize) -> &str {
        self.text.get(byte_offset..).unwrap_or_default()
    }

    fn generate_one(&mut self) {
        // Below 51 000: the remainder fits u32.
        let id = FIRST_GENERATED_ID + (mix(self.context_hash) % GENERATED_ID_COUNT) as u32;
        let word = WORDS[id as usize % WORDS.len()];
        self.context_hash = match self.form {
            ContextForm::Text => fnv1a(self.context_hash, word.as_bytes()),
            ContextForm::TokenIds => fnv1a(self.context_hash, &u64::from(id).to_le_bytes()),
        };
        self.text.push_str(word);
        self.output_ids.push(id);
    }
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
    let request = match parse_generation(
        api,
        &body,
        shared.config.params.block_size_tokens,
        shared.config.default_output_tokens,
    ) {
        Ok(request) => request,
        Err(message) => return error_response(StatusCode::BAD_REQUEST, &message),
    };
    let request_id = headers
        .get(REQUEST_ID_HEADER)
        .and_then(|value| value.to_str().ok())
        .map(str::to_owned);
    answer(shared, api, request, request_id).await
}

/// SGLang's deep health check: a one-token generation through [`answer`],
/// so every generation fault applies. 200 when it completes, 500 when it
/// fails or its answer breaks off (SGLang's body is empty either way).
pub(super) async fn health_generate(State(shared): State<Shared>) -> Response<Body> {
    shared
        .counters
        .health_generate_requests
        .fetch_add(1, Ordering::Relaxed);
    let probe = GenerationRequest {
        stream: false,
        include_usage: false,
        prompt_tokens: 1,
        output_tokens: 1,
        bounded: true,
        prefix_block_hashes: Vec::new(),
        generator: TokenGenerator::over_text(""),
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
        include_usage: request.include_usage,
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
                let counted = shared.clone();
                let bounded = request.bounded;
                progress_stream(
                    receiver,
                    RequestGuard {
                        shared: shared.clone(),
                        id,
                    },
                )
                .inspect(move |progress| {
                    if matches!(progress, Progress::Finished(_)) {
                        counted.finished.count(bounded);
                    }
                })
                .boxed()
            }
            Err(error) => return error_response(StatusCode::BAD_REQUEST, &error.to_string()),
        },
    };
    if request.stream {
        stream_response(shared, meta, progress, request.generator)
    } else {
        whole_response(shared, meta, progress, request.generator).await
    }
}

/// Never answers; the engine stopping ends it.
async fn hang(shared: &Shared) -> Response<Body> {
    shared.stopped().await;
    error_response(StatusCode::SERVICE_UNAVAILABLE, "shutting down")
}

fn canned_record(id: u64, request: &GenerationRequest, tokens: u32) -> engine_model::RequestRecord {
    engine_model::RequestRecord {
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
    include_usage: bool,
}

impl ResponseMeta {
    fn response_id(&self) -> String {
        match self.api {
            Api::Chat => format!("chatcmpl-sim-{}", self.id),
            Api::Completions => format!("cmpl-sim-{}", self.id),
            Api::Generate => format!("sim-{}", self.id),
        }
    }

    /// OpenAI's usage object, with the prefix-cache hits as SGLang (and vLLM
    /// with `--enable-prompt-tokens-details`) report them.
    fn usage(&self, completion_tokens: u32, cached_tokens: u32) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": u64::from(self.prompt_tokens) + u64::from(completion_tokens),
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        })
    }

    /// The chunk that ends a stream asked for usage: no choices, only usage;
    /// `None` for `/generate`, whose chunks carry `meta_info` instead.
    fn usage_chunk(&self, completion_tokens: u32, cached_tokens: u32) -> Option<Value> {
        let object = match self.api {
            Api::Chat => "chat.completion.chunk",
            Api::Completions => "text_completion",
            Api::Generate => return None,
        };
        Some(json!({
            "id": self.response_id(), "object": object,
            "created": self.created_s, "model": self.model,
            "choices": [],
            "usage": self.usage(completion_tokens, cached_tokens),
        }))
    }

    /// One SSE chunk carrying `new_text`, the text of the tokens that took
    /// the answer to `generated_tokens` (`/generate` carries the whole
    /// `output` so far instead); `finish` marks the final chunk.
    /// `cached_tokens` goes into `/generate`'s `meta_info`.
    fn chunk(
        &self,
        generated_tokens: u32,
        new_text: &str,
        output: &TokenGenerator,
        finish: bool,
        cached_tokens: u32,
    ) -> Value {
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
                    json!({"role": "assistant", "content": new_text})
                } else {
                    json!({"content": new_text})
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
                "choices": [{"index": 0, "text": if finish { "" } else { new_text },
                             "logprobs": null, "finish_reason": finish_reason}],
            }),
            Api::Generate => json!({
                "text": output.text,
                "output_ids": output.output_ids,
                "meta_info": self.generate_meta(generated_tokens, finish, cached_tokens),
            }),
        }
    }

    fn generate_meta(&self, completion_tokens: u32, finish: bool, cached_tokens: u32) -> Value {
        json!({
            "id": self.response_id(),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "cached_tokens": cached_tokens,
            "finish_reason": if finish {
                json!({"type": self.finish_reason, "length": completion_tokens})
            } else {
                Value::Null
            },
        })
    }

    fn whole(&self, completion_tokens: u32, output: &TokenGenerator, cached_tokens: u32) -> Value {
        let text = &output.text;
        match self.api {
            Api::Chat => json!({
                "id": self.response_id(), "object": "chat.completion",
                "created": self.created_s, "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": self.finish_reason}],
                "usage": self.usage(completion_tokens, cached_tokens),
            }),
            Api::Completions => json!({
                "id": self.response_id(), "object": "text_completion",
                "created": self.created_s, "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": null,
                             "finish_reason": self.finish_reason}],
                "usage": self.usage(completion_tokens, cached_tokens),
            }),
            Api::Generate => json!({
                "text": text,
                "output_ids": output.output_ids,
                "meta_info": self.generate_meta(completion_tokens, true, cached_tokens),
            }),
        }
    }
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
    mut output: TokenGenerator,
) -> Response<Body> {
    let mut generated = 0;
    let cached_tokens;
    loop {
        let next = tokio::select! {
            next = progress.next() => next,
            () = shared.stopped() => None,
        };
        match next {
            Some(Progress::Token { generated_tokens }) => {
                generated = generated_tokens;
                output.advance_to(generated_tokens);
            }
            Some(Progress::Finished(record)) => {
                generated = generated.max(record.output_tokens);
                cached_tokens = record.cached_tokens;
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
    json_response(
        StatusCode::OK,
        &meta.whole(generated, &output, cached_tokens),
    )
}

fn stream_response(
    shared: Shared,
    meta: ResponseMeta,
    progress: BoxStream<'static, Progress>,
    output: TokenGenerator,
) -> Response<Body> {
    struct State {
        progress: BoxStream<'static, Progress>,
        shared: Shared,
        meta: ResponseMeta,
        output: TokenGenerator,
        sent_chunks: u32,
        done: bool,
    }
    let state = State {
        progress,
        shared,
        meta,
        output,
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
                let new_text_start = state.output.advance_to(generated_tokens);
                let new_text = state.output.text_from(new_text_start);
                // The model reports the prefix-cache hits only in the
                // finished record, so the chunks before it carry 0.
                sse(&state
                    .meta
                    .chunk(generated_tokens, new_text, &state.output, false, 0))
            }
            Some(Progress::Finished(record)) => {
                state.done = true;
                let last = state.meta.chunk(
                    record.output_tokens,
                    "",
                    &state.output,
                    true,
                    record.cached_tokens,
                );
                let mut bytes = sse(&last);
                if state.meta.include_usage
                    && let Some(usage) = state
                        .meta
                        .usage_chunk(record.output_tokens, record.cached_tokens)
                {
                    bytes.extend_from_slice(&sse(&usage));
                }
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

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

fn fnv1a(mut hash: u64, bytes: &[u8]) -> u64 {
    for &byte in bytes {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

/// MurmurHash3's 64-bit finalizer. FNV-1a's low bits depend only on the
/// inputs' low bits; this spreads every bit before a remainder is taken.
fn mix(mut hash: u64) -> u64 {
    hash ^= hash >> 33;
    hash = hash.wrapping_mul(0xff51_afd7_ed55_8ccd);
    hash ^= hash >> 33;
    hash = hash.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    hash ^= hash >> 33;
    hash
}

fn clamp_u32(value: u64) -> u32 {
    u32::try_from(value).unwrap_or(u32::MAX)
}
