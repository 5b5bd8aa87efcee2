//! The request bodies migration sends: the continuation of a broken
//! stream, and a non-streaming request sent as a stream.
//!
//! Both rewrite the client's body through [`RawObject`]: members they do
//! not change are sent as the client wrote them, in its order.

use bytes::Bytes;
use serde_json::value::RawValue;
use serde_json::{Map, Value, json};

use super::raw::{RawObject, is_null};
use super::{Api, NotResumable, Sent};

/// Completions' `max_tokens` when the client left it out (vLLM's and
/// SGLang's default, as OpenAI's).
const COMPLETIONS_DEFAULT_MAX_TOKENS: u64 = 16;
/// `/generate`'s `sampling_params.max_new_tokens` when left out (SGLang's
/// default).
const GENERATE_DEFAULT_MAX_NEW_TOKENS: u64 = 128;

/// The body of the request that continues `sent` on another worker.
///
/// `original` is the client's JSON body as the router sent it (the first
/// one, also on a second migration: `sent` then covers everything the
/// client got). The continuation streams with the client's own
/// `stream_options` (a usage chunk comes only where the original asked for
/// one, and then counts the whole answer), has the token budget (`max_tokens` /
/// `max_completion_tokens`, `max_new_tokens`) reduced by the tokens sent
/// and the minimum (`min_tokens`, `min_new_tokens`) too, and:
///
/// - chat: `messages` with `{"role": "assistant", "content": <sent text>}`
///   appended, `continue_final_message: true`, `add_generation_prompt:
///   false`; when the client itself continued its final message
///   (`continue_final_message: true`), the sent text is appended to that
///   message's (string) content instead;
/// - completions: `prompt` (one string) with the sent text appended;
/// - `/generate`: `input_ids` with the sent `output_ids` appended, or
///   `text` with the sent text appended.
///
/// With nothing generated sent yet, the prompt is left as it is: the
/// continuation is a retry.
pub(crate) fn continuation(api: Api, original: &[u8], sent: &Sent) -> Result<Bytes, NotResumable> {
    let mut body = RawObject::parse(original).ok_or(NotResumable::BodyNotJson)?;
    if sent.finished {
        return Err(NotResumable::Finished);
    }
    check_faithful(api, &body)?;
    check_unconstrained(api, &body)?;
    if sent.tool_calls_seen {
        return Err(NotResumable::ToolCallsStreamed);
    }
    if sent.reasoning_seen {
        return Err(NotResumable::ReasoningStreamed);
    }
    match api {
        Api::Chat => continue_chat(&mut body, sent)?,
        Api::Completions => continue_completion(&mut body, sent)?,
        Api::Generate => continue_generate(&mut body, sent)?,
    }
    Ok(Bytes::from(body.to_json()))
}

/// The body a non-streaming request is sent upstream with, so that its
/// answer can be assembled ([`super::Assembler`]) and, broken, continued:
/// `stream: true`, and for chat and completions
/// `stream_options.include_usage: true` (the other `stream_options` kept).
/// Refused where the assembled answer would not be the engine's own: several
/// choices or a batch, log probabilities, `echo`.
pub(crate) fn as_stream(api: Api, original: &[u8]) -> Result<Bytes, NotResumable> {
    let mut body = RawObject::parse(original).ok_or(NotResumable::BodyNotJson)?;
    check_faithful(api, &body)?;
    ask_to_stream(api, &mut body)?;
    Ok(Bytes::from(body.to_json()))
}

fn continue_chat(body: &mut RawObject, sent: &Sent) -> Result<(), NotResumable> {
    reduce_limits(
        body,
        &["max_tokens", "max_completion_tokens"],
        None,
        sent.tokens_sent,
    )?;
    reduce_minimum(body, "min_tokens", sent.tokens_sent);
    if !sent.text.is_empty() {
        let mut messages: Vec<Box<RawValue>> =
            body.value("messages").ok_or(NotResumable::PromptNotText)?;
        if body.value::<bool>("continue_final_message") == Some(true) {
            let last = messages.last_mut().ok_or(NotResumable::PromptNotText)?;
            let mut message = RawObject::parse_raw(last).ok_or(NotResumable::PromptNotText)?;
            let mut content: String = message
                .value("content")
                .ok_or(NotResumable::PromptNotText)?;
            content.push_str(&sent.text);
            message
                .set("content", &content)
                .ok_or(NotResumable::PromptNotText)?;
            *last = message.to_raw().ok_or(NotResumable::PromptNotText)?;
        } else {
            if body.value::<bool>("add_generation_prompt") == Some(false) {
                return Err(NotResumable::PromptNotText);
            }
            let message = json!({"role": "assistant", "content": sent.text});
            let message = serde_json::value::to_raw_value(&message)
                .map_err(|_| NotResumable::PromptNotText)?;
            messages.push(message);
            set(body, "continue_final_message", &true)?;
            set(body, "add_generation_prompt", &false)?;
        }
        set(body, "messages", &messages)?;
    }
    set(body, "stream", &true)
}

fn continue_completion(body: &mut RawObject, sent: &Sent) -> Result<(), NotResumable> {
    reduce_limits(
        body,
        &["max_tokens"],
        Some(COMPLETIONS_DEFAULT_MAX_TOKENS),
        sent.tokens_sent,
    )?;
    reduce_minimum(body, "min_tokens", sent.tokens_sent);
    if !sent.text.is_empty() {
        let mut prompt = match body.value::<Value>("prompt") {
            Some(Value::String(prompt)) => prompt,
            Some(Value::Array(prompts)) => match <[Value; 1]>::try_from(prompts) {
                Ok([Value::String(prompt)]) => prompt,
                _ => return Err(NotResumable::PromptNotText),
            },
            _ => return Err(NotResumable::PromptNotText),
        };
        prompt.push_str(&sent.text);
        set(body, "prompt", &prompt)?;
    }
    set(body, "stream", &true)
}

fn continue_generate(body: &mut RawObject, sent: &Sent) -> Result<(), NotResumable> {
    let mut params = sampling_params(body)?.unwrap_or_default();
    reduce_limits(
        &mut params,
        &["max_new_tokens"],
        Some(GENERATE_DEFAULT_MAX_NEW_TOKENS),
        sent.tokens_sent,
    )?;
    reduce_minimum(&mut params, "min_new_tokens", sent.tokens_sent);
    let params = params.to_raw().ok_or(NotResumable::BodyNotJson)?;
    body.set_raw("sampling_params", params);
    if sent.tokens_sent > 0 || !sent.text.is_empty() {
        match (body.get_set("text"), body.get_set("input_ids")) {
            (Some(_), None) => {
                let mut text: String = body.value("text").ok_or(NotResumable::PromptNotText)?;
                text.push_str(&sent.text);
                set(body, "text", &text)?;
            }
            (None, Some(_)) => {
                let mut ids: Vec<u64> =
                    body.value("input_ids").ok_or(NotResumable::PromptNotText)?;
                if sent.output_ids.len() as u64 != sent.tokens_sent {
                    return Err(NotResumable::OutputIdsMissing);
                }
                ids.extend_from_slice(&sent.output_ids);
                set(body, "input_ids", &ids)?;
            }
            _ => return Err(NotResumable::PromptNotText),
        }
    }
    set(body, "stream", &true)
}

/// `stream: true`, and for chat and completions
/// `stream_options.include_usage: true`.
fn ask_to_stream(api: Api, body: &mut RawObject) -> Result<(), NotResumable> {
    set(body, "stream", &true)?;
    if api != Api::Generate {
        let mut options = body
            .value::<Map<String, Value>>("stream_options")
            .unwrap_or_default();
        options.insert("include_usage".to_owned(), Value::Bool(true));
        set(body, "stream_options", &options)?;
    }
    Ok(())
}

fn set<T: serde::Serialize + ?Sized>(
    body: &mut RawObject,
    key: &str,
    value: &T,
) -> Result<(), NotResumable> {
    body.set(key, value).ok_or(NotResumable::BodyNotJson)
}

/// `/generate`'s `sampling_params`: `None` when absent or null.
fn sampling_params(body: &RawObject) -> Result<Option<RawObject>, NotResumable> {
    match body.get_set("sampling_params") {
        None => Ok(None),
        Some(raw) if raw.get().starts_with('[') => Err(NotResumable::SeveralChoices),
        Some(raw) => RawObject::parse_raw(raw)
            .map(Some)
            .ok_or(NotResumable::BodyNotJson),
    }
}

/// Reduces each of `keys` that is set by `spent`; when none of them is
/// present and there is a `default`, sets the first key to `default`
/// reduced. A `null` limit is no limit and stays.
fn reduce_limits(
    object: &mut RawObject,
    keys: &[&str],
    default: Option<u64>,
    spent: u64,
) -> Result<(), NotResumable> {
    let mut present = false;
    for key in keys {
        let Some(raw) = object.get(key) else {
            continue;
        };
        present = true;
        if is_null(raw) {
            continue;
        }
        let limit: u64 =
            serde_json::from_str(raw.get()).map_err(|_| NotResumable::InvalidTokenLimit)?;
        set(object, key, &left(limit, spent)?)?;
    }
    if let (false, Some(default), Some(key)) = (present, default, keys.first()) {
        set(object, key, &left(default, spent)?)?;
    }
    Ok(())
}

fn left(limit: u64, spent: u64) -> Result<u64, NotResumable> {
    match limit.saturating_sub(spent) {
        0 => Err(NotResumable::BudgetSpent),
        left => Ok(left),
    }
}

/// Reduces a minimum number of tokens by `spent` (not below 0); one that
/// is not a number is left for the engine to judge.
fn reduce_minimum(object: &mut RawObject, key: &str, spent: u64) {
    if let Some(minimum) = object.value::<u64>(key) {
        // A u64 always serializes.
        object.set(key, &minimum.saturating_sub(spent));
    }
}

/// Refuses what neither a continuation nor an assembled answer can give
/// faithfully: several answers, log probabilities, echo.
fn check_faithful(api: Api, body: &RawObject) -> Result<(), NotResumable> {
    let several = |object: &RawObject, key: &str| {
        object
            .value::<Value>(key)
            .and_then(|value| value.as_f64())
            .is_some_and(|count| count > 1.0)
    };
    if several(body, "n") || several(body, "best_of") {
        return Err(NotResumable::SeveralChoices);
    }
    let is_true = |key: &str| body.value::<bool>(key) == Some(true);
    match api {
        Api::Chat => {
            if is_true("logprobs") || body.get_set("prompt_logprobs").is_some() {
                return Err(NotResumable::Logprobs);
            }
        }
        Api::Completions => {
            if prompt_count(body.value::<Value>("prompt").as_ref()) > 1 {
                return Err(NotResumable::SeveralChoices);
            }
            let logprobs = body
                .get_set("logprobs")
                .is_some_and(|raw| raw.get() != "false");
            if logprobs || body.get_set("prompt_logprobs").is_some() {
                return Err(NotResumable::Logprobs);
            }
        }
        Api::Generate => {
            let batch_text = body
                .get_set("text")
                .is_some_and(|raw| raw.get().starts_with('['));
            let batch_ids = body
                .value::<Vec<Value>>("input_ids")
                .is_some_and(|ids| ids.iter().any(Value::is_array));
            if batch_text || batch_ids {
                return Err(NotResumable::SeveralChoices);
            }
            if sampling_params(body)?.is_some_and(|params| several(&params, "n")) {
                return Err(NotResumable::SeveralChoices);
            }
            if is_true("return_logprob") {
                return Err(NotResumable::Logprobs);
            }
        }
    }
    if api != Api::Generate && is_true("echo") {
        return Err(NotResumable::Echo);
    }
    Ok(())
}

/// How many prompts a completions `prompt` holds: a string or a list of
/// token ids is one, a list of strings or of id lists one each.
fn prompt_count(prompt: Option<&Value>) -> usize {
    match prompt {
        Some(Value::Array(items)) if items.iter().all(Value::is_number) => 1,
        Some(Value::Array(items)) => items.len(),
        _ => 1,
    }
}

/// Top-level members that constrain generation with a grammar (vLLM's and
/// SGLang's extensions).
const GUIDED: [&str; 9] = [
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "structural_tag",
    "regex",
    "json_schema",
    "ebnf",
];

/// Refuses a generation constrained by a grammar: a continuation would
/// start the grammar over in the middle of the answer.
fn check_unconstrained(api: Api, body: &RawObject) -> Result<(), NotResumable> {
    let guided = GUIDED.iter().any(|key| body.get_set(key).is_some());
    let response_format =
        body.value::<Value>("response_format")
            .is_some_and(|format| match format {
                Value::Null => false,
                Value::Object(format) => format.get("type").and_then(Value::as_str) != Some("text"),
                _ => true,
            });
    let forced_tool = body
        .value::<Value>("tool_choice")
        .is_some_and(|choice| match choice {
            Value::String(choice) => choice == "required",
            Value::Object(_) => true,
            _ => false,
        });
    let sampling = api == Api::Generate
        && sampling_params(body)?.is_some_and(|params| {
            ["regex", "json_schema", "ebnf", "structural_tag"]
                .iter()
                .any(|key| params.get_set(key).is_some())
        });
    if guided || response_format || forced_tool || sampling {
        return Err(NotResumable::GuidedDecoding);
    }
    Ok(())
}
