//! What the client has been sent of a stream.

use bytes::Bytes;
use serde_json::{Map, Value};

use super::Api;
use super::events::{Event, EventReader, Payload};

/// What the client has been sent of a stream, read from the whole events
/// forwarded so far. Engine error events, comments and anything that is
/// not a JSON object are not counted.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Sent {
    /// The stream's `id` (chat, completions) or `meta_info.id`
    /// (`/generate`), as the first event that had one.
    pub(crate) id: Option<Value>,
    /// `created` (chat, completions).
    pub(crate) created: Option<Value>,
    /// `model` (chat, completions).
    pub(crate) model: Option<Value>,
    /// `system_fingerprint`, when the stream carried a non-null one.
    pub(crate) system_fingerprint: Option<Value>,
    /// The generated text sent: the deltas' `content` / `text`
    /// concatenated, or `/generate`'s last cumulative `text`.
    pub(crate) text: String,
    /// The tokens sent: the reported `usage.completion_tokens` (or
    /// `meta_info.completion_tokens`) when the stream reports it, else
    /// chat and completions chunks with non-empty content (one token each)
    /// and `/generate`'s `output_ids` (or its events whose text grew).
    pub(crate) tokens_sent: u64,
    /// `/generate`'s last cumulative `output_ids`; empty when it did not
    /// report them (or reported something else than token ids).
    pub(crate) output_ids: Vec<u64>,
    /// A chat delta carried the `role`.
    pub(crate) role_sent: bool,
    /// A `finish_reason` or `[DONE]` was sent.
    pub(crate) finished: bool,
    /// A chat delta carried tool calls.
    pub(crate) tool_calls_seen: bool,
    /// A chat delta carried reasoning (`reasoning_content`, `reasoning`).
    pub(crate) reasoning_seen: bool,
    /// A `usage` object was sent.
    pub(crate) usage_seen: bool,
    /// The prompt's tokens, as the stream reported them (`usage`, or
    /// `/generate`'s `meta_info`).
    pub(crate) prompt_tokens: Option<u64>,
    /// Bytes that do not make a whole event followed the last one: the
    /// client got part of an event, which nothing spliced after it can
    /// mend (its SSE parser would join the part to the next event). The
    /// caller should forward whole events only while it may migrate.
    pub(crate) torn_tail: bool,
}

impl Sent {
    /// Reads `events`, the bytes forwarded to the client, in order (split
    /// anywhere across the slices). Only whole events count.
    pub(crate) fn read(api: Api, events: &[Bytes]) -> Sent {
        let mut reader = EventReader::default();
        let mut sent = Sent::default();
        let mut counter = Counter::default();
        for piece in events {
            reader.push(piece);
            while let Some(event) = reader.next_event() {
                sent.note(api, &event, &mut counter);
            }
        }
        sent.torn_tail = !reader.take_rest().trim_ascii().is_empty();
        sent.tokens_sent = counter.tokens(&sent);
        sent
    }

    fn note(&mut self, api: Api, event: &[u8], counter: &mut Counter) {
        let event = Event::parse(event);
        match event.payload() {
            Payload::Done => {
                self.finished = true;
                return;
            }
            Payload::Json(_) => {}
            Payload::NoData | Payload::Error | Payload::Other => return,
        }
        let Some(Ok(Value::Object(chunk))) = event.data.as_deref().map(serde_json::from_slice)
        else {
            return;
        };
        match api {
            Api::Chat | Api::Completions => self.note_openai(api, &chunk, counter),
            Api::Generate => self.note_generate(&chunk, counter),
        }
    }

    fn note_openai(&mut self, api: Api, chunk: &Map<String, Value>, counter: &mut Counter) {
        first(&mut self.id, chunk.get("id"));
        first(&mut self.created, chunk.get("created"));
        first(&mut self.model, chunk.get("model"));
        first(
            &mut self.system_fingerprint,
            chunk.get("system_fingerprint"),
        );
        let mut content = false;
        let choices = chunk.get("choices").and_then(Value::as_array);
        for choice in choices.into_iter().flatten().filter_map(Value::as_object) {
            let text = match api {
                Api::Chat => {
                    let delta = choice.get("delta").and_then(Value::as_object);
                    if let Some(delta) = delta {
                        self.role_sent |= delta.get("role").is_some_and(|role| !role.is_null());
                        self.tool_calls_seen |= ["tool_calls", "function_call"]
                            .iter()
                            .any(|key| delta.get(*key).is_some_and(is_filled));
                        self.reasoning_seen |= ["reasoning_content", "reasoning"]
                            .iter()
                            .any(|key| delta.get(*key).is_some_and(is_filled));
                    }
                    delta.and_then(|delta| delta.get("content"))
                }
                Api::Completions | Api::Generate => choice.get("text"),
            };
            if let Some(Value::String(text)) = text
                && !text.is_empty()
            {
                self.text.push_str(text);
                content = true;
            }
            self.finished |= choice.get("finish_reason").is_some_and(|f| !f.is_null());
        }
        counter.content_events += u64::from(content);
        if let Some(Value::Object(usage)) = chunk.get("usage") {
            self.usage_seen = true;
            self.note_counts(usage, counter);
        }
    }

    fn note_generate(&mut self, chunk: &Map<String, Value>, counter: &mut Counter) {
        if let Some(Value::Object(meta)) = chunk.get("meta_info") {
            first(&mut self.id, meta.get("id"));
            self.note_counts(meta, counter);
            self.finished |= meta.get("finish_reason").is_some_and(|f| !f.is_null());
        }
        if let Some(Value::String(text)) = chunk.get("text") {
            if *text != self.text {
                counter.content_events += 1;
            }
            self.text.clone_from(text);
        }
        if let Some(Value::Array(ids)) = chunk.get("output_ids") {
            self.output_ids = ids
                .iter()
                .map(Value::as_u64)
                .collect::<Option<Vec<u64>>>()
                .unwrap_or_default();
        }
    }

    /// `prompt_tokens` and `completion_tokens` of a `usage` or `meta_info`.
    fn note_counts(&mut self, counts: &Map<String, Value>, counter: &mut Counter) {
        if let Some(prompt) = counts.get("prompt_tokens").and_then(Value::as_u64) {
            self.prompt_tokens = Some(prompt);
        }
        if let Some(completion) = counts.get("completion_tokens").and_then(Value::as_u64) {
            counter.reported = Some(counter.reported.unwrap_or(0).max(completion));
        }
    }
}

/// What the token count is read from.
#[derive(Debug, Default)]
struct Counter {
    /// Events that carried generated text.
    content_events: u64,
    /// The largest `completion_tokens` reported.
    reported: Option<u64>,
}

impl Counter {
    fn tokens(&self, sent: &Sent) -> u64 {
        match self.reported {
            Some(reported) => reported.max(self.content_events),
            None if !sent.output_ids.is_empty() => sent.output_ids.len() as u64,
            None => self.content_events,
        }
    }
}

/// Sets `slot` to `value` unless it is set or `value` is absent or null.
fn first(slot: &mut Option<Value>, value: Option<&Value>) {
    if slot.is_none()
        && let Some(value) = value.filter(|value| !value.is_null())
    {
        *slot = Some(value.clone());
    }
}

/// Whether a delta member carries something: not null, not empty.
pub(super) fn is_filled(value: &Value) -> bool {
    match value {
        Value::Null => false,
        Value::String(text) => !text.is_empty(),
        Value::Array(items) => !items.is_empty(),
        Value::Object(members) => !members.is_empty(),
        Value::Bool(_) | Value::Number(_) => true,
    }
}
