//! The little of Server-Sent Events the proxy needs: noticing the first
//! `data:` field of a stream, however the bytes are split into frames, and
//! writing an error event a client can read.

use bytes::Bytes;

const DATA_FIELD: &[u8] = b"data:";

/// Finds the first line that starts with `data:` in a stream fed frame by
/// frame. A field split across frames (`da` + `ta:`), even byte by byte, is
/// still found; `data:` inside a line (a comment, a JSON string) is not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FirstDataEvent {
    state: State,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// At a line's start, with this many bytes of `data:` matched.
    LineStart(usize),
    /// Inside a line that is not a data field.
    MidLine,
    Found,
}

impl Default for FirstDataEvent {
    fn default() -> FirstDataEvent {
        FirstDataEvent {
            state: State::LineStart(0),
        }
    }
}

impl FirstDataEvent {
    pub(crate) fn found(&self) -> bool {
        self.state == State::Found
    }

    /// Reads the next bytes of the stream; true once a data field began.
    pub(crate) fn feed(&mut self, chunk: &[u8]) -> bool {
        for &byte in chunk {
            self.state = match self.state {
                State::Found => return true,
                // SSE ends lines with \n, \r or \r\n.
                _ if byte == b'\n' || byte == b'\r' => State::LineStart(0),
                State::LineStart(matched) if byte == DATA_FIELD[matched] => {
                    if matched + 1 == DATA_FIELD.len() {
                        State::Found
                    } else {
                        State::LineStart(matched + 1)
                    }
                }
                State::LineStart(_) | State::MidLine => State::MidLine,
            };
        }
        self.found()
    }
}

/// An SSE event carrying an OpenAI-shaped error, for a stream the router
/// has to end: `data: {"error": {"message", "type"}}`. It starts with a
/// blank line so it is a separate event even after a partial one.
pub(crate) fn error_event(kind: &str, message: &str) -> Bytes {
    let body = serde_json::json!({"error": {"message": message, "type": kind}});
    Bytes::from(format!("\n\ndata: {body}\n\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn found_in(frames: &[&[u8]]) -> bool {
        let mut detector = FirstDataEvent::default();
        frames.iter().any(|frame| detector.feed(frame))
    }

    #[test]
    fn a_data_field_is_found_whole_or_split() {
        assert!(found_in(&[b"data: {\"x\":1}\n\n"]));
        assert!(found_in(&[b": ping\n\ndata: {}\n\n"]));
        assert!(found_in(&[b"da", b"ta: {}\n\n"]));
        assert!(found_in(&[
            b": ping\r\n\r\nd",
            b"a",
            b"t",
            b"a",
            b":",
            b" 1"
        ]));
        assert!(found_in(&[b"event: token\ndata: 1\n\n"]));
    }

    #[test]
    fn other_lines_are_not_data() {
        assert!(!found_in(&[b": keep-alive\n\n"]));
        assert!(!found_in(&[b""]));
        assert!(!found_in(&[b": comment with data: inside\n"]));
        assert!(!found_in(&[b"dat", b"e: x\n"]));
        assert!(!found_in(&[b"event: data:\n"]));
    }

    #[test]
    fn every_split_of_a_stream_finds_the_same_event() {
        let stream = b": ping\n\nevent: x\ndata: {\"choices\":[]}\n\n";
        for split in 0..stream.len() {
            let (head, tail) = stream.split_at(split);
            assert!(found_in(&[head, tail]), "split at {split}");
        }
        let mut detector = FirstDataEvent::default();
        let found_at = stream
            .iter()
            .position(|byte| detector.feed(std::slice::from_ref(byte)));
        assert_eq!(found_at, Some(b": ping\n\nevent: x\ndata".len()));
    }

    #[test]
    fn the_error_event_is_one_parseable_data_line() {
        let event = error_event("upstream_timeout", "no event for 60 s");
        let text = std::str::from_utf8(&event).unwrap();
        let data = text.trim().strip_prefix("data: ").unwrap();
        let parsed: serde_json::Value = serde_json::from_str(data).unwrap();
        assert_eq!(parsed["error"]["type"], "upstream_timeout");
        assert!(text.ends_with("\n\n"));
    }
}
