//! Builds a non-streaming answer from a stream's events.

use bytes::Bytes;
use http::StatusCode;
use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value, json};

use super::Api;
use super::events::{Event, EventReader, MAX_EVENT_BYTES, Payload};

/// Why a stream gave no answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum AssembleError {
    /// The engine sent an error event mid-stream; its JSON (the event's
    /// data: `{"error": {...}}` or older vLLM's `{"object": "error", ...}`),
    /// for the caller to answer with.
    #[error("the engine sent an error mid-stream")]
    Engine(Bytes),
    /// The stream ended before its answer finished (no `finish_reason`),
    /// or an event grew past [`MAX_EVENT_BYTES`].
    #[error("the stream ended before the answer finished")]
    Incomplete,
}

impl AssembleError {
    /// A snake_case label for metrics.
    pub(crate) fn as_str(&self) -> &'static str {
        match self {
            AssembleError::Engine(_) => "engine_error",
            AssembleError::Incomplete => "incomplete",
        }
    }

    /// The status to answer the client with: the engine's own for its
    /// error when the error says one (`error.code`, or older vLLM's
    /// top-level `code`, a 4xx or 5xx), else `502`.
    pub(crate) fn status(&self) -> StatusCode {
        let AssembleError::Engine(error) = self else {
            return StatusCode::BAD_GATEWAY;
        };
        let Ok(error) = serde_json::from_slice::<Value>(error) else {
            return StatusCode::BAD_GATEWAY;
        };
        ["/error/code", "/code"]
            .iter()
            .find_map(|pointer| error.pointer(pointer).and_then(Value::as_u64))
            .and_then(|code| u16::try_from(code).ok())
            .and_then(|code| StatusCode::from_u16(code).ok())
            .filter(|status| status.is_client_error() || status.is_server_error())
            .unwrap_or(StatusCode::BAD_GATEWAY)
    }

    /// The engine's error JSON, for an engine error.
    pub(crate) fn engine_json(&self) -> Option<&Bytes> {
        match self {
            AssembleError::Engine(error) => Some(error),
            AssembleError::Incomplete => None,
        }
    }
}

/// Builds the answer a non-streaming request would have had from the
/// events of the same request streamed ([`super::as_stream`]):
///
/// - chat: `{"id", "object": "chat.completion", "created", "model",
///   ["system_fingerprint"], "choices": [{"index": 0, "message": {"role":
///   "assistant", "content", ["tool_calls"], ["reasoning_content"],
///   ["reasoning"]}, "logprobs": null, "finish_reason", ["stop_reason"],
///   ["matched_stop"]}], "usage"}`: `content` is the deltas' content
///   concatenated (`null` when empty and there are tool calls); tool calls
///   are gathered by their `index`, their `arguments` concatenated;
/// - completions: `{"id", "object": "text_completion", "created", "model",
///   ["system_fingerprint"], "choices": [{"index": 0, "text", "logprobs":
///   null, "finish_reason", ["stop_reason"], ["matched_stop"]}], "usage"}`;
/// - `/generate`: the last event's JSON as it is (its text and ids are
///   cumulative).
///
/// `usage` is the last one the stream sent, left out if it sent none.
#[derive(Debug)]
pub(crate) struct Assembler {
    api: Api,
    reader: EventReader,
    id: Option<Value>,
    created: Option<Value>,
    model: Option<Value>,
    system_fingerprint: Option<Value>,
    text: String,
    reasoning_content: Option<String>,
    reasoning: Option<String>,
    tool_calls: Vec<ToolCall>,
    finish_reason: Option<Value>,
    /// `stop_reason` (vLLM) and `matched_stop` (SGLang) of the finishing
    /// choice.
    stop: Map<String, Value>,
    usage: Option<Value>,
    /// `/generate`'s last event's data.
    last: Option<Bytes>,
    engine_error: Option<Bytes>,
    overflowed: bool,
}

/// What the assembler reads of a chat or completions chunk; the rest is
/// skipped. A field of another type than these fails the chunk, which is
/// then left out, as a chunk that is not JSON is.
#[derive(Deserialize)]
struct ChunkView<'a> {
    #[serde(borrow)]
    id: Option<&'a RawValue>,
    #[serde(borrow)]
    created: Option<&'a RawValue>,
    #[serde(borrow)]
    model: Option<&'a RawValue>,
    #[serde(borrow)]
    system_fingerprint: Option<&'a RawValue>,
    #[serde(borrow)]
    usage: Option<&'a RawValue>,
    #[serde(borrow)]
    choices: Option<Vec<ChoiceView<'a>>>,
}

#[derive(Deserialize)]
struct ChoiceView<'a> {
    #[serde(borrow)]
    delta: Option<DeltaView<'a>>,
    #[serde(borrow)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow)]
    finish_reason: Option<&'a RawValue>,
    // Kept even when null, as the engine sent them.
    #[serde(borrow, default, deserialize_with = "present")]
    stop_reason: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "present")]
    matched_stop: Option<&'a RawValue>,
}

/// A field that is there, `null` included (serde reads a `null` as an
/// absent `Option`).
fn present<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<&'de RawValue>, D::Error> {
    <&RawValue>::deserialize(deserializer).map(Some)
}

#[derive(Deserialize)]
struct DeltaView<'a> {
    #[serde(borrow)]
    content: Option<Cow<'a, str>>,
    #[serde(borrow)]
    reasoning_content: Option<Cow<'a, str>>,
    #[serde(borrow)]
    reasoning: Option<Cow<'a, str>>,
    #[serde(borrow)]
    tool_calls: Option<&'a RawValue>,
}

/// What the assembler reads of a `/generate` chunk.
#[derive(Deserialize)]
struct GenerateView<'a> {
    #[serde(borrow)]
    meta_info: Option<MetaView<'a>>,
}

#[derive(Deserialize)]
struct MetaView<'a> {
    #[serde(borrow)]
    finish_reason: Option<&'a RawValue>,
}

fn is_null(raw: &RawValue) -> bool {
    raw.get().trim() == "null"
}

/// A raw value as an owned one; `None` for `null` (or what does not parse).
fn owned(raw: &RawValue) -> Option<Value> {
    match serde_json::from_str(raw.get()) {
        Ok(Value::Null) | Err(_) => None,
        Ok(value) => Some(value),
    }
}

/// One tool call gathered from deltas.
#[derive(Debug)]
struct ToolCall {
    index: u64,
    id: Option<Value>,
    kind: Option<Value>,
    name: String,
    arguments: String,
}

impl Assembler {
    pub(crate) fn new(api: Api) -> Assembler {
        Assembler {
            api,
            reader: EventReader::default(),
            id: None,
            created: None,
            model: None,
            system_fingerprint: None,
            text: String::new(),
            reasoning_content: None,
            reasoning: None,
            tool_calls: Vec::new(),
            finish_reason: None,
            stop: Map::new(),
            usage: None,
            last: None,
            engine_error: None,
            overflowed: false,
        }
    }

    /// Takes the stream's bytes as they arrive (split anywhere).
    pub(crate) fn feed(&mut self, bytes: &[u8]) {
        if self.engine_error.is_some() || self.overflowed {
            return;
        }
        self.reader.push(bytes);
        while let Some(event) = self.reader.next_event() {
            self.note(&event);
            if self.engine_error.is_some() {
                return;
            }
        }
        if self.reader.held() > MAX_EVENT_BYTES {
            self.overflowed = true;
        }
    }

    /// The whole answer as the engine would have sent it without streaming
    /// (see the type's docs). A last event without its blank line counts
    /// when its data is whole.
    pub(crate) fn finish(mut self) -> Result<Bytes, AssembleError> {
        if !self.overflowed && self.engine_error.is_none() {
            let mut rest = self.reader.take_rest().to_vec();
            rest.extend_from_slice(b"\n\n");
            self.note(&rest);
        }
        if let Some(error) = self.engine_error.take() {
            return Err(AssembleError::Engine(error));
        }
        if self.overflowed {
            return Err(AssembleError::Incomplete);
        }
        match self.api {
            Api::Generate => self.last.ok_or(AssembleError::Incomplete),
            Api::Chat | Api::Completions => {
                let finish_reason = self.finish_reason.take().ok_or(AssembleError::Incomplete)?;
                Ok(Bytes::from(self.openai_answer(finish_reason).to_string()))
            }
        }
    }

    fn note(&mut self, event: &[u8]) {
        let event = Event::parse(event);
        match event.payload() {
            Payload::Error => {
                let data = event.data.as_deref().unwrap_or_default();
                self.engine_error = Some(Bytes::copy_from_slice(data));
                return;
            }
            Payload::Json(_) => {}
            Payload::NoData | Payload::Done | Payload::Other => return,
        }
        let Some(data) = event.data.as_deref() else {
            return;
        };
        match self.api {
            Api::Generate => {
                let Ok(chunk) = serde_json::from_slice::<GenerateView<'_>>(data) else {
                    return;
                };
                let finished = chunk
                    .meta_info
                    .and_then(|meta| meta.finish_reason)
                    .is_some_and(|finish| !is_null(finish));
                // An answer that never finished is no answer.
                if finished {
                    self.last = Some(Bytes::copy_from_slice(data));
                }
            }
            Api::Chat | Api::Completions => {
                if let Ok(chunk) = serde_json::from_slice::<ChunkView<'_>>(data) {
                    self.note_openai(chunk);
                }
            }
        }
    }

    /// One chunk, read through borrowed views: most chunks carry a few
    /// characters of content, and reading them into `Value` trees would
    /// cost an allocation per field.
    fn note_openai(&mut self, chunk: ChunkView<'_>) {
        for (slot, raw) in [
            (&mut self.id, chunk.id),
            (&mut self.created, chunk.created),
            (&mut self.model, chunk.model),
            (&mut self.system_fingerprint, chunk.system_fingerprint),
        ] {
            if slot.is_none() {
                *slot = raw.and_then(owned);
            }
        }
        if let Some(usage) = chunk.usage.and_then(owned).filter(Value::is_object) {
            self.usage = Some(usage);
        }
        for choice in chunk.choices.into_iter().flatten() {
            match self.api {
                Api::Chat => {
                    if let Some(delta) = choice.delta {
                        self.note_delta(delta);
                    }
                }
                Api::Completions | Api::Generate => {
                    if let Some(text) = choice.text {
                        self.text.push_str(&text);
                    }
                }
            }
            if let Some(finish) = choice.finish_reason.and_then(owned) {
                self.finish_reason = Some(finish);
                for (key, raw) in [
                    ("stop_reason", choice.stop_reason),
                    ("matched_stop", choice.matched_stop),
                ] {
                    if let Some(raw) = raw
                        && let Ok(value) = serde_json::from_str(raw.get())
                    {
                        self.stop.insert(key.to_owned(), value);
                    }
                }
            }
        }
    }

    fn note_delta(&mut self, delta: DeltaView<'_>) {
        if let Some(content) = delta.content {
            self.text.push_str(&content);
        }
        for (slot, text) in [
            (&mut self.reasoning_content, delta.reasoning_content),
            (&mut self.reasoning, delta.reasoning),
        ] {
            if let Some(text) = text {
                slot.get_or_insert_with(String::new).push_str(&text);
            }
        }
        let Some(calls) = delta.tool_calls.and_then(owned) else {
            return;
        };
        let calls = calls.as_array();
        for (position, call) in calls.into_iter().flatten().enumerate() {
            let Some(call) = call.as_object() else {
                continue;
            };
            let index = call
                .get("index")
                .and_then(Value::as_u64)
                .unwrap_or(position as u64);
            let at = match self.tool_calls.iter().position(|call| call.index == index) {
                Some(at) => at,
                None => {
                    self.tool_calls.push(ToolCall {
                        index,
                        id: None,
                        kind: None,
                        name: String::new(),
                        arguments: String::new(),
                    });
                    self.tool_calls.len() - 1
                }
            };
            let Some(gathered) = self.tool_calls.get_mut(at) else {
                continue;
            };
            for (slot, key) in [(&mut gathered.id, "id"), (&mut gathered.kind, "type")] {
                if slot.is_none()
                    && let Some(value) = call.get(key).filter(|value| !value.is_null())
                {
                    *slot = Some(value.clone());
                }
            }
            let function = call.get("function").and_then(Value::as_object);
            if let Some(function) = function {
                if let Some(Value::String(name)) = function.get("name")
                    && gathered.name.is_empty()
                {
                    gathered.name.clone_from(name);
                }
                if let Some(Value::String(arguments)) = function.get("arguments") {
                    gathered.arguments.push_str(arguments);
                }
            }
        }
    }

    fn openai_answer(mut self, finish_reason: Value) -> Value {
        let mut choice = Map::new();
        choice.insert("index".to_owned(), 0.into());
        match self.api {
            Api::Chat => {
                self.tool_calls.sort_by_key(|call| call.index);
                let content = if self.text.is_empty() && !self.tool_calls.is_empty() {
                    Value::Null
                } else {
                    Value::String(self.text)
                };
                let mut message = Map::new();
                message.insert("role".to_owned(), "assistant".into());
                message.insert("content".to_owned(), content);
                if !self.tool_calls.is_empty() {
                    let calls = self.tool_calls.into_iter().map(|call| {
                        json!({
                            "id": call.id.unwrap_or(Value::Null),
                            "type": call.kind.unwrap_or_else(|| "function".into()),
                            "function": {"name": call.name, "arguments": call.arguments},
                        })
                    });
                    message.insert("tool_calls".to_owned(), calls.collect());
                }
                for (key, text) in [
                    ("reasoning_content", self.reasoning_content),
                    ("reasoning", self.reasoning),
                ] {
                    if let Some(text) = text {
                        message.insert(key.to_owned(), text.into());
                    }
                }
                choice.insert("message".to_owned(), message.into());
            }
            Api::Completions | Api::Generate => {
                choice.insert("text".to_owned(), self.text.into());
            }
        }
        choice.insert("logprobs".to_owned(), Value::Null);
        choice.insert("finish_reason".to_owned(), finish_reason);
        choice.extend(self.stop);
        let object = match self.api {
            Api::Chat => "chat.completion",
            Api::Completions | Api::Generate => "text_completion",
        };
        let mut answer = Map::new();
        if let Some(id) = self.id {
            answer.insert("id".to_owned(), id);
        }
        answer.insert("object".to_owned(), object.into());
        for (key, value) in [
            ("created", self.created),
            ("model", self.model),
            ("system_fingerprint", self.system_fingerprint),
        ] {
            if let Some(value) = value {
                answer.insert(key.to_owned(), value);
            }
        }
        answer.insert("choices".to_owned(), vec![Value::Object(choice)].into());
        if let Some(usage) = self.usage {
            answer.insert("usage".to_owned(), usage);
        }
        Value::Object(answer)
    }
}
