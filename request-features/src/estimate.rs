//! What the router reads from a request body before choosing a worker: the
//! model, the streaming flag, the prompt's size in tokens and its prefix
//! block hashes (`prefix_hash`).
//!
//! [`read_request`] is what the proxy runs on every request: it walks the
//! body once without building it (no map, no string copies but the
//! model's). The model, the streaming flag and the output limits are read
//! as it passes them; the chat's `messages` are hashed and counted as it
//! passes them (`ChatSeed`); the prompt fields are
//! captured as raw JSON slices, and a token id list among them is read
//! once more, for its hash and count together. The body is checked as
//! UTF-8 once, up front.
//! [`request_info`] and [`max_output_tokens`] read the same facts from a
//! parsed [`Value`]; the tests hold the two to the same answers.

use std::fmt;
use std::sync::Arc;

use policy_core::{PrefixBlocks, RequestInfo, TokenCount};
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::Value;
use serde_json::value::RawValue;

use crate::prefix_hash::{
    self, ChatSeed, MessageText, PrefixHashing, RawPrompt, ReadChat, Unhashed, json_str_chars,
    scan_uint_list, skip_whitespace,
};

/// What [`read_request`] found.
#[derive(Debug, Clone, PartialEq)]
pub struct ReadRequest {
    pub info: RequestInfo,
    /// As [`max_output_tokens`].
    pub max_output_tokens: Option<u64>,
    /// Why `info.prefix` is empty; `None` when the prefix was hashed.
    pub prefix_unhashed: Option<Unhashed>,
    /// As [`stream_usage`].
    pub stream_usage: StreamUsage,
    /// The body's `priority` (vLLM's: lower is served first), when it is
    /// an integer.
    pub priority: Option<i64>,
}

/// Whether the client asked for OpenAI's closing usage chunk on a stream
/// (`stream_options.include_usage`), which carries the engine's
/// `prompt_tokens_details.cached_tokens`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamUsage {
    /// `stream_options.include_usage` is `true`.
    Asked,
    /// The body has no `stream_options` field: the router may ask for the
    /// chunk itself, as long as it keeps it from the client.
    Unset,
    /// `stream_options` is there without `include_usage: true`: the
    /// client's choice, left as it is.
    Declined,
}

/// Why a body could not be read.
#[derive(Debug, thiserror::Error)]
pub enum RequestBodyError {
    #[error("request body must be a JSON object")]
    NotAnObject,
    #[error("request body is not valid JSON: {0}")]
    Invalid(#[source] serde_json::Error),
    /// JSON is UTF-8 (RFC 8259 §8.1); a body that is not is refused whole,
    /// even where the bytes lie in a field the router does not read.
    #[error("request body is not UTF-8: {0}")]
    NotUtf8(#[source] std::str::Utf8Error),
}

/// The top-level fields the router reads: first the scalars, read where
/// they lie ([`Scalar`]), then those kept as raw JSON, among them
/// `messages`, read where it lies too ([`ChatSeed`]).
const TOP_FIELDS: [&str; TOP_FIELD_COUNT] = [
    "model",
    "stream",
    "max_completion_tokens",
    "max_tokens",
    "priority",
    "input_ids",
    "prompt",
    "text",
    "messages",
    "sampling_params",
    "stream_options",
];
const TOP_FIELD_COUNT: usize = 11;
/// How many of [`TOP_FIELDS`] are scalars.
const SCALAR_COUNT: usize = 5;
/// `messages`' place in [`TOP_FIELDS`].
const MESSAGES: usize = 8;

/// Reads the routing facts from a raw OpenAI or SGLang-native body, as
/// [`request_info`] and [`max_output_tokens`] read them from a parsed one.
/// `hashing.chars_per_token` also turns text into the token estimate.
pub fn read_request(body: &[u8], hashing: &PrefixHashing) -> Result<ReadRequest, RequestBodyError> {
    let chars_per_token = hashing.chars_per_token;
    // Checked once here, so no string the walk meets is checked again.
    let body = std::str::from_utf8(body).map_err(RequestBodyError::NotUtf8)?;
    let mut de = serde_json::Deserializer::from_str(body);
    // Only an object is asked for, so any other value is a type error.
    let top = match de.deserialize_map(TopFields { hashing }) {
        Ok(top) => top,
        Err(error) if error.classify() == serde_json::error::Category::Data => {
            return Err(RequestBodyError::NotAnObject);
        }
        Err(error) => return Err(RequestBodyError::Invalid(error)),
    };
    de.end().map_err(RequestBodyError::Invalid)?;
    let [model, stream, max_completion, max_tokens, priority] = top.scalars;
    let [input_ids, prompt, text, _, sampling, stream_options] = top.raw;
    let model = match model {
        Some(Scalar::Str(model)) => Some(model),
        _ => None,
    };
    let streaming = matches!(stream, Some(Scalar::Bool(true)));
    let raw_prompt = RawPrompt {
        input_ids,
        prompt,
        text,
    };
    // The chat was hashed and counted in the walk: its messages are read once.
    let message_text = top.messages.as_ref().map(ReadChat::text);
    let hashed = prefix_hash::hash_raw_counting(raw_prompt, top.messages, hashing);
    // A list of ids the hash read whole is not read again for its count.
    let tokens = match hashed.ids_counted {
        Some(ids) => TokenCount::Exact(ids),
        None => raw_token_count(raw_prompt, message_text, chars_per_token),
    };
    let (prefix, prefix_unhashed) = split_hashed(hashed.blocks);
    let max_output_tokens = match (max_completion, max_tokens) {
        (Some(limit), _) | (None, Some(limit)) => match limit {
            Scalar::Uint(limit) => Some(limit),
            _ => None,
        },
        (None, None) => sampling.and_then(|raw| {
            let [max_new] = fields_of(raw, &["max_new_tokens"])?;
            serde_json::from_str::<u64>(max_new?.get()).ok()
        }),
    };
    let stream_usage = match stream_options {
        None => StreamUsage::Unset,
        Some(options) => match fields_of(options, &["include_usage"]) {
            Some([Some(include)]) if include.get() == "true" => StreamUsage::Asked,
            _ => StreamUsage::Declined,
        },
    };
    let priority = match priority {
        Some(Scalar::Uint(value)) => i64::try_from(value).ok(),
        Some(Scalar::Int(value)) => Some(value),
        _ => None,
    };
    Ok(ReadRequest {
        info: RequestInfo {
            tokens,
            streaming,
            model,
            prefix,
        },
        max_output_tokens,
        prefix_unhashed,
        stream_usage,
        priority,
    })
}

/// The blocks, or the empty (unknown) set and why.
fn split_hashed(hashed: Result<PrefixBlocks, Unhashed>) -> (PrefixBlocks, Option<Unhashed>) {
    match hashed {
        Ok(blocks) => (blocks, None),
        Err(reason) => (PrefixBlocks::default(), Some(reason)),
    }
}

/// As [`token_count`], on the raw prompt fields and the text of the
/// messages, if any.
fn raw_token_count(
    prompt: RawPrompt<'_>,
    message_text: Option<MessageText>,
    chars_per_token: f64,
) -> TokenCount {
    for ids in [prompt.input_ids, prompt.prompt] {
        if let Some(count) = ids.and_then(raw_token_ids) {
            return TokenCount::Exact(count);
        }
    }
    let MessageText {
        mut chars,
        any: mut any_text,
    } = message_text.unwrap_or_default();
    for value in [prompt.prompt, prompt.text] {
        any_text |= raw_add_text(value, &mut chars);
    }
    if !any_text {
        return TokenCount::Unknown;
    }
    TokenCount::Estimated((chars as f64 / chars_per_token).ceil() as u64)
}

/// As [`token_ids`], on a raw value: scanned by hand, since the body was
/// validated when it was read and a list of ids is most of such a body.
fn raw_token_ids(raw: &RawValue) -> Option<u64> {
    let bytes = raw.get().as_bytes();
    if bytes.first() != Some(&b'[') {
        return None;
    }
    let first = skip_whitespace(bytes, 1);
    match bytes.get(first)? {
        b']' => None,
        // A batch: every item a list of ids.
        b'[' => {
            let (mut ids, mut at) = (0u64, first);
            loop {
                let (count, next) = raw_id_list(bytes, at)?;
                ids += count;
                at = skip_whitespace(bytes, next);
                match bytes.get(at)? {
                    b',' => at = skip_whitespace(bytes, at + 1),
                    _ => return Some(ids),
                }
            }
        }
        _ => raw_id_list(bytes, 0).map(|(count, _)| count),
    }
}

/// The ids in the list that opens at `bytes[at]` and the index after it,
/// `None` unless it is a list of integers from 0 to `u64::MAX` (what
/// `Value::is_u64` accepts: digits only, as JSON writes them).
fn raw_id_list(bytes: &[u8], at: usize) -> Option<(u64, usize)> {
    scan_uint_list(bytes, at, u64::MAX, |_| true)
}

/// As [`add_text`], on a raw value.
fn raw_add_text(value: Option<&RawValue>, chars: &mut usize) -> bool {
    let Some(raw) = value else {
        return false;
    };
    let text = raw.get();
    if text.starts_with('"') {
        return json_str_chars(text).is_some_and(|count| {
            *chars += count;
            true
        });
    }
    if !text.starts_with('[') {
        return false;
    }
    let mut found = false;
    let _ = for_each_item(raw, |item| {
        let text = if item.get().starts_with('"') {
            Some(item)
        } else {
            fields_of(item, &["text"]).and_then(|[text]| text)
        };
        if let Some(count) = text.and_then(|text| json_str_chars(text.get())) {
            *chars += count;
            found = true;
        }
    });
    found
}

/// The named fields of a raw JSON object (the last of a repeated name
/// wins, as in a parsed [`Value`]); `None` if it is not an object.
pub(crate) fn fields_of<'a, const N: usize>(
    raw: &'a RawValue,
    names: &'static [&'static str; N],
) -> Option<[Option<&'a RawValue>; N]> {
    if !raw.get().starts_with('{') {
        return None;
    }
    let mut de = serde_json::Deserializer::from_str(raw.get());
    ObjectFields { names }.deserialize(&mut de).ok().flatten()
}

/// Where an object's key stands in `names`, compared where it lies: a key
/// read as `String` (or `Cow<str>`, which serde always builds owned) cost
/// an allocation for every key of every request.
struct KeyIndex<'n> {
    names: &'n [&'static str],
}

impl<'de> DeserializeSeed<'de> for KeyIndex<'_> {
    type Value = Option<usize>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeyIndex<'_> {
    type Value = Option<usize>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object key")
    }

    /// serde_json passes a key without escapes as it lies in the body, and
    /// one with escapes decoded into its scratch buffer: no allocation
    /// either way.
    fn visit_str<E>(self, key: &str) -> Result<Self::Value, E> {
        Ok(self.names.iter().position(|name| *name == key))
    }
}

/// A top-level scalar the router reads, read where it lies (a raw value
/// read again would walk it twice, with a second deserializer): what
/// `Value::as_str`, `as_bool` and `as_u64` would find, or `Other`.
#[derive(Debug)]
enum Scalar {
    /// A string, built once into the `Arc<str>` the model is kept as, from
    /// the text where it lies or from serde_json's decoding of its escapes.
    Str(Arc<str>),
    Bool(bool),
    /// An integer from 0 to `u64::MAX`.
    Uint(u64),
    /// A negative integer.
    Int(i64),
    /// Any other value (negative, fractional, null, a list or an object).
    Other,
}

struct ScalarSeed;

impl<'de> DeserializeSeed<'de> for ScalarSeed {
    type Value = Scalar;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Scalar, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ScalarSeed {
    type Value = Scalar;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_str<E>(self, text: &str) -> Result<Scalar, E> {
        Ok(Scalar::Str(Arc::from(text)))
    }

    fn visit_bool<E>(self, value: bool) -> Result<Scalar, E> {
        Ok(Scalar::Bool(value))
    }

    fn visit_u64<E>(self, value: u64) -> Result<Scalar, E> {
        Ok(Scalar::Uint(value))
    }

    fn visit_i64<E>(self, value: i64) -> Result<Scalar, E> {
        Ok(u64::try_from(value).map_or(Scalar::Int(value), Scalar::Uint))
    }

    fn visit_f64<E>(self, _: f64) -> Result<Scalar, E> {
        Ok(Scalar::Other)
    }

    fn visit_unit<E>(self) -> Result<Scalar, E> {
        Ok(Scalar::Other)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Scalar, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Scalar::Other)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Scalar, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Scalar::Other)
    }
}

/// Calls `each` with every item of a raw JSON array.
fn for_each_item<'a>(
    raw: &'a RawValue,
    mut each: impl FnMut(&'a RawValue),
) -> Result<(), serde_json::Error> {
    for_each_item_while(raw, |item| {
        each(item);
        true
    })
}

/// Calls `each` with the items of a raw JSON array until it returns false;
/// the rest of the array is not read (and the result is then an error).
pub(crate) fn for_each_item_while<'a>(
    raw: &'a RawValue,
    each: impl FnMut(&'a RawValue) -> bool,
) -> Result<(), serde_json::Error> {
    let mut de = serde_json::Deserializer::from_str(raw.get());
    (Items { each }).deserialize(&mut de)
}

/// The raw values of an object's named fields, the others skipped without
/// being built; `None` for a value that is not an object.
pub(crate) struct ObjectFields<const N: usize> {
    pub(crate) names: &'static [&'static str; N],
}

impl<'de, const N: usize> DeserializeSeed<'de> for ObjectFields<N> {
    type Value = Option<[Option<&'de RawValue>; N]>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de, const N: usize> Visitor<'de> for ObjectFields<N> {
    type Value = Option<[Option<&'de RawValue>; N]>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut found = [None; N];
        let names = self.names;
        while let Some(named) = map.next_key_seed(KeyIndex { names })? {
            match named {
                Some(index) => found[index] = Some(map.next_value::<&'de RawValue>()?),
                None => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(Some(found))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(None)
    }

    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
}

/// The top-level fields of a body: the scalars of [`TOP_FIELDS`] read
/// where they lie, the raw values of the rest but `messages`, which is
/// read where it lies too, and any other field skipped without being built.
struct TopFields<'h> {
    hashing: &'h PrefixHashing,
}

/// What [`TopFields`] read.
struct Top<'de> {
    /// The first [`SCALAR_COUNT`] of [`TOP_FIELDS`], in their order.
    scalars: [Option<Scalar>; SCALAR_COUNT],
    /// The rest, by place in [`TOP_FIELDS`] less [`SCALAR_COUNT`];
    /// `messages`' place stays empty.
    raw: [Option<&'de RawValue>; TOP_FIELD_COUNT - SCALAR_COUNT],
    messages: Option<ReadChat>,
}

impl<'de> Visitor<'de> for TopFields<'_> {
    type Value = Top<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut top = Top {
            scalars: [const { None }; SCALAR_COUNT],
            raw: [None; TOP_FIELD_COUNT - SCALAR_COUNT],
            messages: None,
        };
        let names = &TOP_FIELDS;
        while let Some(named) = map.next_key_seed(KeyIndex { names })? {
            match named {
                // The last of a repeated name wins, as in a parsed `Value`.
                Some(MESSAGES) => {
                    top.messages = map.next_value_seed(ChatSeed {
                        hashing: self.hashing,
                    })?;
                }
                Some(index) if index < SCALAR_COUNT => {
                    top.scalars[index] = Some(map.next_value_seed(ScalarSeed)?);
                }
                Some(index) => {
                    top.raw[index - SCALAR_COUNT] = Some(map.next_value::<&'de RawValue>()?);
                }
                None => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(top)
    }
}

/// Calls `each` with the raw value of every item of an array, until it
/// returns false.
struct Items<F> {
    each: F,
}

impl<'de, F: FnMut(&'de RawValue) -> bool> DeserializeSeed<'de> for Items<F> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_seq(self)
    }
}

impl<'de, F: FnMut(&'de RawValue) -> bool> Visitor<'de> for Items<F> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON array")
    }

    fn visit_seq<A: SeqAccess<'de>>(mut self, mut seq: A) -> Result<(), A::Error> {
        while let Some(item) = seq.next_element::<&'de RawValue>()? {
            if !(self.each)(item) {
                break;
            }
        }
        Ok(())
    }
}

/// Reads the routing facts from a parsed OpenAI or SGLang-native body.
///
/// Token ids (`prompt` as integers, `input_ids`) are counted exactly; text
/// (`messages[].content`, `prompt`, `text`) is estimated as characters divided
/// by `chars_per_token`, rounded up; a body with neither is `Unknown`. The
/// prefix is hashed as the crate docs describe.
pub fn request_info(body: &Value, hashing: &PrefixHashing) -> RequestInfo {
    let chars_per_token = hashing.chars_per_token;
    let model = body
        .get("model")
        .and_then(Value::as_str)
        .map(Arc::<str>::from);
    let streaming = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    RequestInfo {
        tokens: token_count(body, chars_per_token),
        streaming,
        model,
        prefix: split_hashed(prefix_hash::hash_value(body, hashing)).0,
    }
}

fn token_count(body: &Value, chars_per_token: f64) -> TokenCount {
    for ids_key in ["input_ids", "prompt"] {
        if let Some(ids) = token_ids(body.get(ids_key)) {
            return TokenCount::Exact(ids);
        }
    }
    let mut chars = 0usize;
    let mut any_text = false;
    if let Some(messages) = body.get("messages").and_then(Value::as_array) {
        for message in messages {
            any_text |= add_text(message.get("content"), &mut chars);
        }
    }
    for key in ["prompt", "text"] {
        any_text |= add_text(body.get(key), &mut chars);
    }
    if !any_text {
        return TokenCount::Unknown;
    }
    TokenCount::Estimated((chars as f64 / chars_per_token).ceil() as u64)
}

/// The most output tokens the request allows: OpenAI's `max_tokens` or
/// `max_completion_tokens`, or SGLang's `sampling_params.max_new_tokens`.
/// `None` when the body names no limit (or a nonsensical one).
pub fn max_output_tokens(body: &Value) -> Option<u64> {
    body.get("max_completion_tokens")
        .or_else(|| body.get("max_tokens"))
        .or_else(|| body.get("sampling_params")?.get("max_new_tokens"))
        .and_then(Value::as_u64)
}

/// Whether `body` asks for a stream's closing usage chunk.
pub fn stream_usage(body: &Value) -> StreamUsage {
    match body.get("stream_options") {
        None => StreamUsage::Unset,
        Some(options) if options.get("include_usage") == Some(&Value::Bool(true)) => {
            StreamUsage::Asked
        }
        Some(_) => StreamUsage::Declined,
    }
}

/// The body's `priority` (vLLM's convention: lower first), when it is an
/// integer.
pub fn priority(body: &Value) -> Option<i64> {
    body.get("priority")?.as_i64()
}

/// A list of integers (or a batch of such lists) counts tokens exactly.
fn token_ids(value: Option<&Value>) -> Option<u64> {
    let items = value?.as_array()?;
    if items.is_empty() {
        return None;
    }
    if items.iter().all(Value::is_u64) {
        return Some(items.len() as u64);
    }
    items
        .iter()
        .map(|item| {
            let inner = item.as_array()?;
            inner
                .iter()
                .all(Value::is_u64)
                .then_some(inner.len() as u64)
        })
        .sum()
}

/// Adds the characters of a string, a list of strings, or OpenAI content parts
/// (`[{"type": "text", "text": "…"}]`); returns whether any text was found.
fn add_text(value: Option<&Value>, chars: &mut usize) -> bool {
    match value {
        Some(Value::String(text)) => {
            *chars += text.chars().count();
            true
        }
        Some(Value::Array(items)) => {
            let mut found = false;
            for item in items {
                let text = item
                    .as_str()
                    .or_else(|| item.get("text").and_then(Value::as_str));
                if let Some(text) = text {
                    *chars += text.chars().count();
                    found = true;
                }
            }
            found
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The router's default hashing (64-token blocks, up to 32 768
    /// tokens) with this characters-per-token ratio.
    fn cpt(chars_per_token: f64) -> PrefixHashing {
        PrefixHashing {
            chars_per_token,
            ..DEFAULT
        }
    }

    const DEFAULT: PrefixHashing = PrefixHashing {
        block_tokens: 64,
        max_tokens: 32_768,
        chars_per_token: 4.0,
    };

    #[test]
    fn chat_messages_are_estimated_from_their_text() {
        let body = json!({"model": "m", "stream": true, "messages": [
            {"role": "system", "content": "abcd"},
            {"role": "user", "content": [{"type": "text", "text": "abcdefgh"}, {"type": "image_url"}]}
        ]});
        let info = request_info(&body, &cpt(4.0));
        // 4 + 8 = 12 characters / 4 = 3 tokens.
        assert_eq!(info.tokens, TokenCount::Estimated(3));
        assert!(info.streaming);
        assert_eq!(info.model.as_deref(), Some("m"));
    }

    #[test]
    fn the_output_limit_is_read_from_either_api() {
        assert_eq!(max_output_tokens(&json!({"max_tokens": 64})), Some(64));
        assert_eq!(
            max_output_tokens(&json!({"max_completion_tokens": 32, "max_tokens": 64})),
            Some(32)
        );
        assert_eq!(
            max_output_tokens(&json!({"sampling_params": {"max_new_tokens": 16}})),
            Some(16)
        );
        assert_eq!(max_output_tokens(&json!({"max_tokens": -1})), None);
        assert_eq!(max_output_tokens(&json!({"max_tokens": "lots"})), None);
        assert_eq!(max_output_tokens(&json!({})), None);
    }

    #[test]
    fn model_stream_and_limits_are_read_as_the_parsed_reader_reads_them() {
        let bodies = [
            r#"{"model": "m", "stream": true, "max_tokens": 64}"#,
            r#"{"model": "caf\u00e9\n", "stream": false, "max_completion_tokens": 0}"#,
            r#"{"model": 5, "stream": "true", "max_tokens": "64"}"#,
            r#"{"model": null, "stream": 1, "max_tokens": null}"#,
            r#"{"model": ["m"], "stream": [true], "max_tokens": [64]}"#,
            r#"{"model": {"name": "m"}, "stream": {}, "max_tokens": {"n": 1}}"#,
            r#"{"max_tokens": -1}"#,
            r#"{"max_tokens": -0}"#,
            r#"{"max_tokens": 64.0}"#,
            r#"{"max_tokens": 1e2}"#,
            r#"{"max_tokens": 18446744073709551615}"#,
            r#"{"max_tokens": 18446744073709551616}"#,
            r#"{"max_completion_tokens": null, "max_tokens": 64}"#,
            r#"{"max_completion_tokens": "x", "max_tokens": 64}"#,
            r#"{"max_tokens": 64, "max_completion_tokens": 32}"#,
            r#"{"sampling_params": {"max_new_tokens": 16}}"#,
            r#"{"max_tokens": 8, "sampling_params": {"max_new_tokens": 16}}"#,
            // The last of a repeated name wins, as in a parsed body.
            r#"{"model": "a", "model": "b", "stream": true, "stream": false}"#,
            r#"{"max_tokens": 1, "max_tokens": "x"}"#,
            r#"{"stream": false, "stream": true, "max_tokens": "x", "max_tokens": 2}"#,
            r#"{"stream": true, "stream_options": {"include_usage": true}}"#,
            r#"{"stream": true, "stream_options": {"include_usage": false}}"#,
            r#"{"stream": true, "stream_options": {"include_usage": "true"}}"#,
            r#"{"stream": true, "stream_options": {"include_usage": true, "include_usage": 1}}"#,
            r#"{"stream": true, "stream_options": {}}"#,
            r#"{"stream": true, "stream_options": null}"#,
            r#"{"stream": true, "stream_options": [true]}"#,
            r#"{"stream_options": {"continuous_usage_stats": true, "include_usage": true}}"#,
            r#"{"priority": 3}"#,
            r#"{"priority": -2}"#,
            r#"{"priority": "high", "priority": 1}"#,
            r#"{"priority": 1.5}"#,
            r#"{"priority": 9223372036854775808}"#,
            r#"{"priority": null}"#,
        ];
        for raw in bodies {
            let parsed: Value = serde_json::from_str(raw).unwrap();
            let read = read_request(raw.as_bytes(), &cpt(4.0)).unwrap();
            let expected = request_info(&parsed, &cpt(4.0));
            assert_eq!(read.info.model, expected.model, "{raw}");
            assert_eq!(read.info.streaming, expected.streaming, "{raw}");
            assert_eq!(read.max_output_tokens, max_output_tokens(&parsed), "{raw}");
            assert_eq!(read.stream_usage, stream_usage(&parsed), "{raw}");
            assert_eq!(read.priority, priority(&parsed), "{raw}");
        }
        let read = |raw: &str| read_request(raw.as_bytes(), &cpt(4.0)).unwrap();
        assert_eq!(read(bodies[28]).priority, Some(3));
        assert_eq!(read(bodies[29]).priority, Some(-2));
        assert_eq!(read(bodies[30]).priority, Some(1));
        for not_an_integer in &bodies[31..=33] {
            assert_eq!(read(not_an_integer).priority, None);
        }
        assert_eq!(read(bodies[0]).stream_usage, StreamUsage::Unset);
        assert_eq!(read(bodies[20]).stream_usage, StreamUsage::Asked);
        for declined in &bodies[21..=26] {
            assert_eq!(read(declined).stream_usage, StreamUsage::Declined);
        }
        assert_eq!(read(bodies[27]).stream_usage, StreamUsage::Asked);
        assert_eq!(read(bodies[1]).info.model.as_deref(), Some("caf\u{e9}\n"));
        assert_eq!(read(bodies[10]).max_output_tokens, Some(u64::MAX));
        assert_eq!(read(bodies[17]).info.model.as_deref(), Some("b"));
        assert!(read(bodies[19]).info.streaming);
        assert_eq!(read(bodies[19]).max_output_tokens, Some(2));
    }

    #[test]
    fn estimates_round_up_and_use_the_configured_ratio() {
        let body = json!({"prompt": "abcde"});
        assert_eq!(
            request_info(&body, &cpt(4.0)).tokens,
            TokenCount::Estimated(2)
        );
        assert_eq!(
            request_info(&body, &cpt(2.5)).tokens,
            TokenCount::Estimated(2)
        );
        assert_eq!(
            request_info(&body, &cpt(1.0)).tokens,
            TokenCount::Estimated(5)
        );
    }

    #[test]
    fn token_ids_are_exact() {
        assert_eq!(
            request_info(&json!({"prompt": [1, 2, 3]}), &cpt(4.0)).tokens,
            TokenCount::Exact(3)
        );
        assert_eq!(
            request_info(&json!({"input_ids": [[1, 2], [3, 4, 5]]}), &cpt(4.0)).tokens,
            TokenCount::Exact(5)
        );
        assert_eq!(
            request_info(&json!({"text": "abcdefgh"}), &cpt(4.0)).tokens,
            TokenCount::Estimated(2)
        );
    }

    /// The raw reader agrees with the parsed one on every body here.
    #[test]
    fn the_raw_reader_reads_what_the_parsed_one_does() {
        let bodies = [
            json!({"model": "m", "stream": true, "messages": [
                {"role": "system", "content": "abcd"},
                {"role": "user", "content": [{"type": "text", "text": "abcdefgh"}, {"type": "image_url"}, "xyz"]}
            ], "max_tokens": 64}),
            json!({"model": 7, "stream": "yes", "prompt": "héllo\n\"quoted\"", "max_completion_tokens": 32, "max_tokens": 64}),
            json!({"prompt": [1, 2, 3], "text": "ignored when ids count"}),
            json!({"input_ids": [[1, 2], [3, 4, 5]], "sampling_params": {"max_new_tokens": 16}}),
            json!({"input_ids": [[1, 2], 3], "prompt": ["ab", "cd"]}),
            json!({"input_ids": [], "prompt": [], "text": ["abc", 1]}),
            json!({"messages": [{"content": null}, {"content": 5}, "x", {"content": [{"text": 1}]}]}),
            json!({"max_completion_tokens": "lots", "max_tokens": 64}),
            json!({"max_tokens": -1, "sampling_params": {"max_new_tokens": 16}}),
            json!({"sampling_params": {"max_new_tokens": 1.5}}),
            json!({"stream": false, "model": "a\u{e9}b"}),
            json!({}),
        ];
        // Long enough to hash (64-token blocks of 256 bytes by default).
        let long = "A long system prompt, \"quoted\", caf\u{e9}\n".repeat(40);
        let ids: Vec<u64> = (0..300).collect();
        let hashed_bodies = [
            json!({"messages": [
                {"role": "system", "content": long},
                {"role": "user", "content": [{"type": "text", "text": long}, {"type": "image_url"}, "xyz"]}
            ]}),
            json!({"prompt": long, "text": "ignored"}),
            json!({"text": [long, "second of a batch"]}),
            json!({"input_ids": ids}),
            json!({"prompt": [ids, [1, 2]], "messages": [{"role": "user", "content": long}]}),
            json!({"messages": null, "prompt": long}),
            json!({"prompt": long, "messages": null}),
        ];
        let unhashed_bodies = [
            json!({"input_ids": [1, -2, 3], "prompt": long}),
            json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
            json!({"messages": "not a list", "prompt": long}),
            json!({"messages": {"role": "user", "content": long}}),
        ];
        let mut hashed = 0;
        for body in bodies
            .into_iter()
            .chain(hashed_bodies)
            .chain(unhashed_bodies)
        {
            let raw = serde_json::to_vec(&body).unwrap();
            let read = read_request(&raw, &cpt(4.0)).unwrap();
            assert_eq!(read.info, request_info(&body, &cpt(4.0)), "{body}");
            assert_eq!(read.max_output_tokens, max_output_tokens(&body), "{body}");
            assert_eq!(
                read.info.prefix.is_empty(),
                read.prefix_unhashed.is_some(),
                "{body}"
            );
            hashed += usize::from(!read.info.prefix.is_empty());
        }
        assert_eq!(hashed, 7, "exactly the long prompts are hashed");
        // The same body hashed with hashing off: unknown, and why.
        let off = PrefixHashing {
            max_tokens: 0,
            ..DEFAULT
        };
        let raw = serde_json::to_vec(&json!({"prompt": long})).unwrap();
        let read = read_request(&raw, &off).unwrap();
        assert!(read.info.prefix.is_empty());
        assert_eq!(read.prefix_unhashed, Some(Unhashed::Disabled));
        // A repeated name: the last one counts, as in a parsed Value.
        let repeated = br#"{"stream": false, "stream": true, "model": "a", "model": "b"}"#;
        let read = read_request(repeated, &cpt(4.0)).unwrap();
        assert!(read.info.streaming);
        assert_eq!(read.info.model.as_deref(), Some("b"));
    }

    /// Keys and the model written with escapes, as a client's JSON encoder
    /// may write them, are read as decoded, as the parsed reader reads them.
    #[test]
    fn escaped_keys_and_model_are_read_as_decoded() {
        let raws = [
            r#"{"mod\u0065l": "caf\u00e9 \"x\"", "str\u0065am": true, "max_tok\u0065ns": 9}"#,
            r#"{"messages": [{"r\u006fle": "user", "cont\u0065nt": "abcdefgh"}], "\u006dodel": "m"}"#,
            r#"{"model": "a\\b", "modeL": "wrong case", "prompt": "abcd"}"#,
            r#"{"model": ["not", "a", "string"], "prompt": "abcd"}"#,
        ];
        for raw in raws {
            let parsed: Value = serde_json::from_str(raw).unwrap();
            let read = read_request(raw.as_bytes(), &cpt(4.0)).unwrap();
            assert_eq!(read.info, request_info(&parsed, &cpt(4.0)), "{raw}");
            assert_eq!(read.max_output_tokens, max_output_tokens(&parsed), "{raw}");
        }
        let read = |raw: &str| read_request(raw.as_bytes(), &cpt(4.0)).unwrap();
        let first = read(raws[0]);
        assert_eq!(first.info.model.as_deref(), Some("caf\u{e9} \"x\""));
        assert!(first.info.streaming);
        assert_eq!(first.max_output_tokens, Some(9));
        assert_eq!(read(raws[1]).info.tokens, TokenCount::Estimated(2));
        assert_eq!(read(raws[2]).info.model.as_deref(), Some("a\\b"));
        assert_eq!(read(raws[3]).info.model, None);
    }

    /// Token id lists as clients write them, spaces and all: the raw
    /// scanner counts what the parsed reader does.
    #[test]
    fn raw_token_ids_are_counted_as_the_parsed_reader_counts_them() {
        let bodies = [
            r#"{"input_ids": [ 1 , 2,3 ]}"#,
            "{\"input_ids\": [\n  1,\n  2\r\n ]}",
            r#"{"input_ids": [[ 1, 2 ] , [3], [ ]]}"#,
            r#"{"input_ids": [[], []], "prompt": "text"}"#,
            r#"{"input_ids": [ ], "prompt": [ 7 ]}"#,
            r#"{"input_ids": [18446744073709551615, 0]}"#,
            r#"{"input_ids": [18446744073709551616], "text": "abcd"}"#,
            r#"{"input_ids": [1, -2], "text": "abcd"}"#,
            r#"{"input_ids": [-0], "text": "abcd"}"#,
            r#"{"input_ids": [1.5, 2], "text": "abcd"}"#,
            r#"{"input_ids": [1e3], "text": "abcd"}"#,
            r#"{"input_ids": [1, [2]], "text": "abcd"}"#,
            r#"{"input_ids": [[1], 2], "text": "abcd"}"#,
            r#"{"input_ids": [[1, "a"]], "text": "abcd"}"#,
            r#"{"input_ids": ["1"], "text": "abcd"}"#,
            r#"{"input_ids": {"a": 1}, "prompt": [[4, 5], [6]]}"#,
            r#"{"input_ids": null, "prompt": [ [ 4 ,5 ] ]}"#,
        ];
        for raw in bodies {
            let parsed: Value = serde_json::from_str(raw).unwrap();
            let read = read_request(raw.as_bytes(), &cpt(4.0)).unwrap();
            assert_eq!(
                read.info.tokens,
                request_info(&parsed, &cpt(4.0)).tokens,
                "{raw}"
            );
        }
        let count = |raw: &str| read_request(raw.as_bytes(), &cpt(4.0)).unwrap().info.tokens;
        assert_eq!(count(bodies[0]), TokenCount::Exact(3));
        assert_eq!(count(bodies[2]), TokenCount::Exact(3));
        assert_eq!(count(bodies[6]), TokenCount::Estimated(1));
    }

    #[test]
    fn id_counts_do_not_stop_where_the_hash_stops() {
        // Two 4-token blocks at most: the hash reads 8 ids, the estimate
        // counts them all.
        let bounded = PrefixHashing {
            block_tokens: 4,
            max_tokens: 8,
            ..DEFAULT
        };
        for raw in [
            r#"{"input_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]}"#,
            r#"{"input_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 4294967296]}"#,
            r#"{"input_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, -10], "text": "abcd"}"#,
            r#"{"prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]}"#,
            r#"{"input_ids": [[1, 2, 3, 4, 5, 6, 7, 8, 9], [10]]}"#,
            r#"{"input_ids": [1, 2, 3, 4294967296], "prompt": [5]}"#,
        ] {
            let parsed: Value = serde_json::from_str(raw).unwrap();
            let read = read_request(raw.as_bytes(), &bounded).unwrap();
            let expected = request_info(&parsed, &bounded);
            assert_eq!(read.info.tokens, expected.tokens, "{raw}");
            assert_eq!(read.info.prefix, expected.prefix, "{raw}");
        }
        let count = |raw: &str| read_request(raw.as_bytes(), &bounded).unwrap().info.tokens;
        assert_eq!(
            count(r#"{"input_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]}"#),
            TokenCount::Exact(11)
        );
    }

    #[test]
    fn bodies_that_are_not_objects_or_not_json_are_refused() {
        for body in [&b"[1, 2]"[..], b"\"text\"", b"7", b"null"] {
            assert!(
                matches!(
                    read_request(body, &cpt(4.0)),
                    Err(RequestBodyError::NotAnObject)
                ),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        for body in [&b"{"[..], b"{\"a\": }", b"{} x", b"", b"{\"a\": [1,}"] {
            assert!(
                matches!(
                    read_request(body, &cpt(4.0)),
                    Err(RequestBodyError::Invalid(_))
                ),
                "{}",
                String::from_utf8_lossy(body)
            );
        } // Bytes that are not UTF-8, in a field read or in one passed over.
        for body in [
            &b"{\"model\": \"m\xff\"}"[..],
            b"{\"user\": \"\xc3\", \"prompt\": \"hi\"}",
            b"\xfe{}",
        ] {
            let error = read_request(body, &cpt(4.0)).unwrap_err();
            assert!(
                matches!(error, RequestBodyError::NotUtf8(_)),
                "{}",
                String::from_utf8_lossy(body)
            );
            assert!(error.to_string().starts_with("request body is not UTF-8"));
        }
    }

    #[test]
    fn no_text_is_unknown() {
        for body in [
            json!({}),
            json!({"messages": []}),
            json!({"prompt": 7}),
            json!({"prompt": []}),
        ] {
            assert_eq!(
                request_info(&body, &cpt(4.0)).tokens,
                TokenCount::Unknown,
                "{body}"
            );
        }
        assert!(!request_info(&json!({"stream": "yes"}), &cpt(4.0)).streaming);
    }
}
