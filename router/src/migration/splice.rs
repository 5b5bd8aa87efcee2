//! Rewrites a continuing worker's stream into the rest of the client's.

use bytes::{Bytes, BytesMut};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use super::events::{Event, EventReader, MAX_EVENT_BYTES, Payload};
use super::raw::RawObject;
use super::sent::is_filled;
use super::{Api, Sent};

/// Rewrites the continuing worker's SSE stream so it reads as the rest of
/// the client's:
///
/// - chat and completions: every chunk's `id`, `created` and `model` (and
///   `system_fingerprint`, when the original stream had one) become the
///   original stream's; chat drops `role` from deltas once the client has
///   it, and a chunk that dropping it leaves empty; a `usage` object counts
///   the whole answer: `completion_tokens` plus the tokens sent,
///   `prompt_tokens` as the original stream reported it, else less the
///   tokens sent (which the continuation's prompt holds), `total_tokens`
///   their sum; `prompt_tokens_details` is kept as it is;
/// - `/generate`: `text` and `output_ids` get the sent ones in front,
///   `meta_info.id` is the original's, `completion_tokens` and
///   `finish_reason.length` count the tokens sent too, `prompt_tokens` as
///   for usage.
///
/// Events that are not JSON objects (comments, `[DONE]`, other data) pass
/// through untouched. Rewritten events are written `data: <json>\n\n`
/// (their other lines, if any, first). An engine's error event is not
/// passed on: the splicer keeps it ([`Splicer::engine_error`]) and ignores
/// the rest of the stream, for the caller to treat as a break. Bytes past
/// [`MAX_EVENT_BYTES`] without an event's end are not SSE: they, and all
/// that follows, pass through as they are.
#[derive(Debug)]
pub(crate) struct Splicer {
    api: Api,
    reader: EventReader,
    /// What the original stream sent (boxed: a splicer is moved around
    /// with the client's stream, this is read only when rewriting).
    original: Box<Original>,
    /// The client has the chat role.
    role_sent: bool,
    engine_error: Option<Bytes>,
    torn_tail: bool,
    standing_aside: bool,
}

/// What the rewriting takes from the original stream.
#[derive(Debug)]
struct Original {
    id: Option<Box<RawValue>>,
    created: Option<Box<RawValue>>,
    model: Option<Box<RawValue>>,
    system_fingerprint: Option<Box<RawValue>>,
    tokens_sent: u64,
    prompt_tokens: Option<u64>,
    /// `/generate`'s sent text and ids.
    text: String,
    output_ids: Vec<u64>,
}

impl Splicer {
    pub(crate) fn new(api: Api, sent: &Sent) -> Splicer {
        let raw = |value: &Option<Value>| {
            value
                .as_ref()
                .and_then(|value| serde_json::value::to_raw_value(value).ok())
        };
        Splicer {
            api,
            reader: EventReader::default(),
            original: Box::new(Original {
                id: raw(&sent.id),
                created: raw(&sent.created),
                model: raw(&sent.model),
                system_fingerprint: raw(&sent.system_fingerprint),
                tokens_sent: sent.tokens_sent,
                prompt_tokens: sent.prompt_tokens,
                text: sent.text.clone(),
                output_ids: sent.output_ids.clone(),
            }),
            role_sent: sent.role_sent,
            engine_error: None,
            torn_tail: false,
            standing_aside: false,
        }
    }

    /// Takes the continuing stream's bytes as they arrive (split anywhere)
    /// and returns the rewritten whole events ready for the client
    /// (possibly none).
    pub(crate) fn feed(&mut self, bytes: &[u8]) -> Bytes {
        if self.engine_error.is_some() {
            return Bytes::new();
        }
        if self.standing_aside {
            return Bytes::copy_from_slice(bytes);
        }
        self.reader.push(bytes);
        let mut out = BytesMut::new();
        while let Some(event) = self.reader.next_event() {
            if !self.splice(&event, &mut out) {
                return out.freeze();
            }
        }
        if self.reader.held() > MAX_EVENT_BYTES {
            self.standing_aside = true;
            out.extend_from_slice(&self.reader.take_rest());
        }
        out.freeze()
    }

    /// The end of the continuing stream: a last event without its blank
    /// line is passed on (ended properly) when its data is whole (JSON or
    /// `[DONE]`), as clients' SSE readers take it at the end of a stream;
    /// anything else left is dropped and reported ([`Splicer::torn_tail`]).
    pub(crate) fn finish(&mut self) -> Bytes {
        let rest = self.reader.take_rest();
        if self.engine_error.is_some() || rest.trim_ascii().is_empty() {
            return Bytes::new();
        }
        if self.standing_aside {
            return rest;
        }
        let whole = matches!(
            Event::parse(&rest).payload(),
            Payload::Json(_) | Payload::Done | Payload::Error
        );
        if !whole {
            self.torn_tail = true;
            return Bytes::new();
        }
        let mut event = rest.to_vec();
        event.extend_from_slice(b"\n\n");
        let mut out = BytesMut::new();
        self.splice(&event, &mut out);
        out.freeze()
    }

    /// The engine's error event's data, if the continuing stream sent one.
    pub(crate) fn engine_error(&self) -> Option<&Bytes> {
        self.engine_error.as_ref()
    }

    /// Whether the continuing stream ended in the middle of an event
    /// (dropped by [`Splicer::finish`]).
    pub(crate) fn torn_tail(&self) -> bool {
        self.torn_tail
    }

    /// Rewrites one whole event into `out`; false at an engine error.
    fn splice(&mut self, event: &[u8], out: &mut BytesMut) -> bool {
        let parsed = Event::parse(event);
        let object = match parsed.payload() {
            Payload::Json(object) => object,
            Payload::Error => {
                let data = parsed.data.as_deref().unwrap_or_default();
                self.engine_error = Some(Bytes::copy_from_slice(data));
                return false;
            }
            Payload::NoData | Payload::Done | Payload::Other => {
                out.extend_from_slice(event);
                return true;
            }
        };
        let rewritten = match self.api {
            Api::Chat | Api::Completions => self.rewrite_openai(object),
            Api::Generate => self.rewrite_generate(object),
        };
        match rewritten {
            Rewrite::Json(json) => parsed.write_with_data(json.as_bytes(), out),
            Rewrite::Drop => {}
            Rewrite::Unchanged => out.extend_from_slice(event),
        }
        true
    }

    fn rewrite_openai(&mut self, mut chunk: RawObject) -> Rewrite {
        for (key, value) in [
            ("id", &self.original.id),
            ("created", &self.original.created),
            ("model", &self.original.model),
            ("system_fingerprint", &self.original.system_fingerprint),
        ] {
            if let Some(value) = value {
                chunk.set_raw(key, value.clone());
            }
        }
        let mut has_usage = false;
        if let Some(mut usage) = chunk.value::<Map<String, Value>>("usage") {
            has_usage = true;
            self.fix_counts(&mut usage);
            if chunk.set("usage", &usage).is_none() {
                return Rewrite::Unchanged;
            }
        }
        if self.api == Api::Chat
            && let Some(mut choices) = chunk.value::<Vec<Value>>("choices")
        {
            let mut role_dropped = false;
            for delta in choices
                .iter_mut()
                .filter_map(|choice| choice.get_mut("delta"))
                .filter_map(Value::as_object_mut)
            {
                if delta.get("role").is_none_or(Value::is_null) {
                    continue;
                }
                if self.role_sent {
                    delta.remove("role");
                    role_dropped = true;
                } else {
                    self.role_sent = true;
                }
            }
            if role_dropped {
                if !has_usage && !choices.is_empty() && choices.iter().all(is_empty_choice) {
                    return Rewrite::Drop;
                }
                if chunk.set("choices", &choices).is_none() {
                    return Rewrite::Unchanged;
                }
            }
        }
        Rewrite::Json(chunk.to_json())
    }

    fn rewrite_generate(&mut self, mut chunk: RawObject) -> Rewrite {
        if let Some(text) = chunk.value::<String>("text") {
            let whole = format!("{}{text}", self.original.text);
            if chunk.set("text", &whole).is_none() {
                return Rewrite::Unchanged;
            }
        }
        if let Some(ids) = chunk.value::<Vec<u64>>("output_ids") {
            let mut whole = self.original.output_ids.clone();
            whole.extend(ids);
            if chunk.set("output_ids", &whole).is_none() {
                return Rewrite::Unchanged;
            }
        }
        if let Some(mut meta) = chunk.value::<Map<String, Value>>("meta_info") {
            if let Some(id) = &self.original.id
                && let Ok(id) = serde_json::from_str(id.get())
            {
                meta.insert("id".to_owned(), id);
            }
            self.fix_counts(&mut meta);
            if let Some(Value::Object(finish)) = meta.get_mut("finish_reason")
                && let Some(length) = finish.get("length").and_then(Value::as_u64)
            {
                finish.insert(
                    "length".to_owned(),
                    length.saturating_add(self.original.tokens_sent).into(),
                );
            }
            if chunk.set("meta_info", &meta).is_none() {
                return Rewrite::Unchanged;
            }
        }
        Rewrite::Json(chunk.to_json())
    }

    /// `prompt_tokens`, `completion_tokens` and `total_tokens` of a `usage`
    /// or `meta_info`, counting the whole answer (see the type's docs).
    fn fix_counts(&self, counts: &mut Map<String, Value>) {
        let reported = |key: &str| counts.get(key).and_then(Value::as_u64);
        let prompt = match (self.original.prompt_tokens, reported("prompt_tokens")) {
            (_, None) => None,
            (Some(original), Some(_)) => Some(original),
            (None, Some(continued)) => Some(continued.saturating_sub(self.original.tokens_sent)),
        };
        let completion = reported("completion_tokens")
            .map(|continued| continued.saturating_add(self.original.tokens_sent));
        if let Some(prompt) = prompt {
            counts.insert("prompt_tokens".to_owned(), prompt.into());
        }
        if let Some(completion) = completion {
            counts.insert("completion_tokens".to_owned(), completion.into());
        }
        if let (Some(prompt), Some(completion), true) =
            (prompt, completion, counts.contains_key("total_tokens"))
        {
            counts.insert(
                "total_tokens".to_owned(),
                prompt.saturating_add(completion).into(),
            );
        }
    }
}

/// What becomes of one event.
enum Rewrite {
    Json(String),
    Drop,
    /// It could not be rewritten: passed on as it came.
    Unchanged,
}

/// Whether a chat choice carries nothing: its `delta` members and its other
/// members (but `index`) are all null or empty.
fn is_empty_choice(choice: &Value) -> bool {
    let Some(choice) = choice.as_object() else {
        return false;
    };
    choice.iter().all(|(key, value)| match key.as_str() {
        "index" => true,
        "delta" => value
            .as_object()
            .is_some_and(|delta| !delta.values().any(is_filled)),
        _ => !is_filled(value),
    })
}
