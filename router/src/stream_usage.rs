//! Asks engines for an OpenAI stream's closing usage chunk, and keeps it
//! from a client that did not ask for it.
//!
//! The router asks engines for the chunk (`stream_options.include_usage`)
//! on streams whose client did not set `stream_options`, because only that
//! chunk carries `usage.prompt_tokens_details.cached_tokens`, the engine's
//! word on the prefix-cache hit the router predicted. The client did not
//! ask for it, and a chunk with an empty `choices` list breaks clients that
//! read `choices[0]`, so [`UsageChunkFilter`] drops it on the way out.
//!
//! The filter passes the stream on event by event (an event ends at a
//! blank line). The bytes of an event that has not ended yet are held
//! until it does: a client acts on an event only at its blank line, so this
//! delays nothing it could use. A piece that ends on an event's end and
//! holds no usage object passes on as it is, without a copy. Held bytes
//! that grow past [`MAX_HELD_BYTES`] with no event end (a stream that is
//! not SSE) pass on as they are, and the filter stands aside.

use bytes::{Bytes, BytesMut};
use memchr::memmem;

/// The member [`with_usage_asked`] adds.
const ASK_FOR_USAGE: &[u8] = br#""stream_options":{"include_usage":true}"#;

/// `body`, a JSON object without `stream_options`, with
/// `"stream_options":{"include_usage":true}` as its first member; `None`
/// when it is not an object.
pub(crate) fn with_usage_asked(body: &[u8]) -> Option<Bytes> {
    let open = body.iter().position(|byte| !byte.is_ascii_whitespace())?;
    let members = body[open..].strip_prefix(b"{")?;
    let empty = members.trim_ascii_start().starts_with(b"}");
    let mut asked = BytesMut::with_capacity(body.len() + ASK_FOR_USAGE.len() + 1);
    asked.extend_from_slice(b"{");
    asked.extend_from_slice(ASK_FOR_USAGE);
    if !empty {
        asked.extend_from_slice(b",");
    }
    asked.extend_from_slice(members);
    Some(asked.freeze())
}

/// Most bytes held waiting for an event's end before the filter gives up.
const MAX_HELD_BYTES: usize = 256 * 1024;

/// See the module docs.
#[derive(Debug, Default)]
pub struct UsageChunkFilter {
    /// The start of an event whose end has not come yet.
    held: BytesMut,
    /// The stream turned out not to be SSE: everything passes.
    standing_aside: bool,
}

impl UsageChunkFilter {
    /// The next bytes of the stream in; what may go to the client now out
    /// (`None`: nothing yet).
    pub fn feed(&mut self, piece: Bytes) -> Option<Bytes> {
        if self.standing_aside {
            return non_empty(piece);
        }
        if self.held.is_empty() {
            // The common case: whole events, no usage object among them.
            match last_event_end(&piece) {
                Some(end) if end == piece.len() && !has_usage_object(&piece) => {
                    return Some(piece);
                }
                None if piece.len() <= MAX_HELD_BYTES => {
                    self.held.extend_from_slice(&piece);
                    return None;
                }
                _ => {}
            }
        }
        self.held.extend_from_slice(&piece);
        let Some(end) = last_event_end(&self.held) else {
            if self.held.len() > MAX_HELD_BYTES {
                self.standing_aside = true;
                return non_empty(self.held.split().freeze());
            }
            return None;
        };
        let events = self.held.split_to(end).freeze();
        Self::without_usage_chunks(events)
    }

    /// The stream ended: what was held (an event without its blank line),
    /// unless it is a usage chunk.
    pub fn finish(&mut self) -> Option<Bytes> {
        let rest = self.held.split().freeze();
        if self.standing_aside {
            return non_empty(rest);
        }
        if is_usage_chunk(&rest) {
            return None;
        }
        non_empty(rest)
    }

    /// Whether bytes wait for their event's end (or the stream's).
    pub(crate) fn is_holding(&self) -> bool {
        !self.held.is_empty()
    }

    /// `events` (whole events) less their usage chunks; not copied when
    /// there is none.
    fn without_usage_chunks(events: Bytes) -> Option<Bytes> {
        if !has_usage_object(&events) {
            return non_empty(events);
        }
        let mut kept = BytesMut::with_capacity(events.len());
        let mut rest = events;
        while !rest.is_empty() {
            let end = first_event_end(&rest).unwrap_or(rest.len());
            let event = rest.split_to(end);
            if !is_usage_chunk(&event) {
                kept.extend_from_slice(&event);
            }
        }
        non_empty(kept.freeze())
    }
}

fn non_empty(bytes: Bytes) -> Option<Bytes> {
    (!bytes.is_empty()).then_some(bytes)
}

/// The index just past the first blank line (`\n\n` or `\n\r\n`) of
/// `bytes`.
fn first_event_end(bytes: &[u8]) -> Option<usize> {
    let mut from = 0;
    while let Some(at) = memchr::memchr(b'\n', &bytes[from..]) {
        let line_end = from + at + 1;
        match bytes.get(line_end..) {
            Some([b'\n', ..]) => return Some(line_end + 1),
            Some([b'\r', b'\n', ..]) => return Some(line_end + 2),
            _ => from = line_end,
        }
    }
    None
}

/// The index just past the last blank line of `bytes`.
fn last_event_end(bytes: &[u8]) -> Option<usize> {
    let mut at = bytes.len();
    while let Some(newline) = memchr::memrchr(b'\n', &bytes[..at]) {
        let before = &bytes[..newline];
        if before.ends_with(b"\n") || before.ends_with(b"\n\r") {
            return Some(newline + 1);
        }
        at = newline;
    }
    None
}

/// Whether `bytes` may hold a `"usage"` key with an object value: the
/// cheap test every passing event gets.
fn has_usage_object(bytes: &[u8]) -> bool {
    let mut rest = bytes;
    while let Some(at) = memmem::find(rest, b"\"usage\"") {
        let after = &rest[at + b"\"usage\"".len()..];
        let value = after.trim_ascii_start();
        if let Some(value) = value.strip_prefix(b":")
            && value.trim_ascii_start().starts_with(b"{")
        {
            return true;
        }
        rest = after;
    }
    false
}

/// Whether one whole event is the closing usage chunk: its data is a JSON
/// object whose `choices` is an empty list and whose `usage` is an object.
fn is_usage_chunk(event: &[u8]) -> bool {
    if !has_usage_object(event) {
        return false;
    }
    let Ok(chunk) = serde_json::from_slice::<serde_json::Value>(&event_data(event)) else {
        return false;
    };
    chunk
        .get("choices")
        .and_then(serde_json::Value::as_array)
        .is_some_and(Vec::is_empty)
        && chunk.get("usage").is_some_and(serde_json::Value::is_object)
}

/// An event's data: the values of its `data:` lines, joined by `\n`.
fn event_data(event: &[u8]) -> Vec<u8> {
    let mut data = Vec::new();
    for line in event.split(|byte| *byte == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if let Some(value) = line.strip_prefix(b"data:") {
            if !data.is_empty() {
                data.push(b'\n');
            }
            data.extend_from_slice(value.strip_prefix(b" ").unwrap_or(value));
        }
    }
    data
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONTENT: &str =
        "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n";
    const USAGE: &str = "data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":900,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":768}}}\n\n";
    const DONE: &str = "data: [DONE]\n\n";

    /// Feeds `stream` cut at `cuts` and returns what came out.
    fn filtered(stream: &[u8], cuts: &[usize]) -> Vec<u8> {
        let mut filter = UsageChunkFilter::default();
        let mut out = Vec::new();
        let mut from = 0;
        for &cut in cuts.iter().chain([stream.len()].iter()) {
            if let Some(bytes) = filter.feed(Bytes::copy_from_slice(&stream[from..cut])) {
                out.extend_from_slice(&bytes);
            }
            from = cut;
        }
        if let Some(bytes) = filter.finish() {
            out.extend_from_slice(&bytes);
        }
        out
    }

    #[test]
    fn usage_is_asked_for_as_the_first_member() {
        let hashing = request_features::PrefixHashing {
            block_tokens: 4,
            max_tokens: 1024,
            chars_per_token: 4.0,
        };
        for body in [
            r#"{"model":"m","stream":true,"messages":[]}"#,
            " \n{ \"stream\": true }",
            "{}",
            "{ }",
        ] {
            let asked = with_usage_asked(body.as_bytes()).unwrap();
            let mut expected: serde_json::Value = serde_json::from_str(body).unwrap();
            expected["stream_options"] = serde_json::json!({"include_usage": true});
            let parsed: serde_json::Value = serde_json::from_slice(&asked).unwrap();
            assert_eq!(parsed, expected, "{body}");
            let read = request_features::read_request(&asked, &hashing).unwrap();
            assert_eq!(read.stream_usage, request_features::StreamUsage::Asked);
        }
        assert_eq!(with_usage_asked(b"[1]"), None);
        assert_eq!(with_usage_asked(b"  "), None);
    }

    #[test]
    fn the_usage_chunk_is_dropped_wherever_the_stream_is_cut() {
        let stream = format!("{CONTENT}{CONTENT}{USAGE}{DONE}");
        let expected = format!("{CONTENT}{CONTENT}{DONE}");
        for cut in 0..=stream.len() {
            assert_eq!(
                filtered(stream.as_bytes(), &[cut]),
                expected.clone().into_bytes(),
                "cut at {cut}"
            );
        }
        let every_byte: Vec<usize> = (1..stream.len()).collect();
        assert_eq!(
            filtered(stream.as_bytes(), &every_byte),
            expected.into_bytes()
        );
    }

    #[test]
    fn a_stream_without_a_usage_chunk_passes_unchanged() {
        let stream = format!("{CONTENT}: a comment\n\n{CONTENT}{DONE}");
        for cut in 0..=stream.len() {
            assert_eq!(
                filtered(stream.as_bytes(), &[cut]),
                stream.clone().into_bytes()
            );
        }
    }

    #[test]
    fn whole_events_pass_without_a_copy() {
        let mut filter = UsageChunkFilter::default();
        let piece = Bytes::from(format!("{CONTENT}{CONTENT}"));
        let out = filter.feed(piece.clone());
        assert_eq!(
            out.as_ref().map(|bytes| bytes.as_ptr()),
            Some(piece.as_ptr())
        );
    }

    #[test]
    fn only_a_chunk_with_empty_choices_and_a_usage_object_is_dropped() {
        let kept = [
            // Usage on a chunk that carries a token (continuous usage stats).
            "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}],\"usage\":{\"prompt_tokens\":1}}\n\n",
            "data: {\"choices\":[],\"usage\":null}\n\n",
            "data: {\"choices\":[]}\n\n",
            // The words in a string.
            "data: {\"choices\":[{\"delta\":{\"content\":\"\\\"usage\\\": {\"}}]}\n\n",
            "data: not json \"usage\": {\n\n",
            "event: usage\n\n",
        ];
        for event in kept {
            assert_eq!(filtered(event.as_bytes(), &[]), event.as_bytes(), "{event}");
        }
        let dropped = [
            USAGE,
            "data:{\"choices\" : [ ],\"usage\" : {}}\r\n\r\n",
            "data: {\"choices\":[],\ndata: \"usage\":{\"prompt_tokens\":1}}\n\n",
        ];
        for event in dropped {
            assert!(filtered(event.as_bytes(), &[]).is_empty(), "{event}");
        }
    }

    #[test]
    fn a_usage_chunk_without_its_blank_line_at_the_end_is_dropped() {
        let stream = format!("{CONTENT}{}", USAGE.trim_end());
        assert_eq!(filtered(stream.as_bytes(), &[10]), CONTENT.as_bytes());
    }

    #[test]
    fn a_stream_that_is_not_sse_passes_once_past_the_limit() {
        let stream = vec![b'x'; MAX_HELD_BYTES + 10];
        assert_eq!(
            filtered(&stream, &[100, MAX_HELD_BYTES, MAX_HELD_BYTES + 5]),
            stream
        );
    }
}
