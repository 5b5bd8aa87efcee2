//! What the router reads from a request body before choosing a worker: the
//! model, the streaming flag and the prompt's size in tokens.

use std::sync::Arc;

use policy_core::{RequestInfo, TokenCount};
use serde_json::Value;

/// Reads the routing facts from a parsed OpenAI or SGLang-native body.
///
/// Token ids (`prompt` as integers, `input_ids`) are counted exactly; text
/// (`messages[].content`, `prompt`, `text`) is estimated as characters divided
/// by `chars_per_token`, rounded up; a body with neither is `Unknown`.
pub fn request_info(body: &Value, chars_per_token: f64) -> RequestInfo {
    let model = body
        .get("model")
        .and_then(Value::as_str)
        .map(Arc::<str>::from);
    let streaming = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    RequestInfo {
        tokens: token_count(body, chars_per_token),
        streaming,
        model,
        // Prompt block hashes are not computed from HTTP bodies yet: unknown.
        prefix: Default::default(),
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

    #[test]
    fn chat_messages_are_estimated_from_their_text() {
        let body = json!({"model": "m", "stream": true, "messages": [
            {"role": "system", "content": "abcd"},
            {"role": "user", "content": [{"type": "text", "text": "abcdefgh"}, {"type": "image_url"}]}
        ]});
        let info = request_info(&body, 4.0);
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
    fn estimates_round_up_and_use_the_configured_ratio() {
        let body = json!({"prompt": "abcde"});
        assert_eq!(request_info(&body, 4.0).tokens, TokenCount::Estimated(2));
        assert_eq!(request_info(&body, 2.5).tokens, TokenCount::Estimated(2));
        assert_eq!(request_info(&body, 1.0).tokens, TokenCount::Estimated(5));
    }

    #[test]
    fn token_ids_are_exact() {
        assert_eq!(
            request_info(&json!({"prompt": [1, 2, 3]}), 4.0).tokens,
            TokenCount::Exact(3)
        );
        assert_eq!(
            request_info(&json!({"input_ids": [[1, 2], [3, 4, 5]]}), 4.0).tokens,
            TokenCount::Exact(5)
        );
        assert_eq!(
            request_info(&json!({"text": "abcdefgh"}), 4.0).tokens,
            TokenCount::Estimated(2)
        );
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
                request_info(&body, 4.0).tokens,
                TokenCount::Unknown,
                "{body}"
            );
        }
        assert!(!request_info(&json!({"stream": "yes"}), 4.0).streaming);
    }
}
