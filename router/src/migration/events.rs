//! Whole SSE events out of bytes split anywhere, and what one carries.
//!
//! Lines end with `\n` or `\r\n`; an event ends at a blank line, so
//! `\n\n`, `\r\n\r\n` and mixes of the two end one. A lone `\r` is not
//! taken as a line end (no engine sends one). An event's data is the
//! values of its `data:` fields joined by `\n`, as the SSE spec says.

use std::borrow::Cow;

use bytes::{BufMut, Bytes, BytesMut};

use super::raw::RawObject;

/// The most bytes an event may hold before its end. A continuation's
/// `/generate` events carry the whole text so far, so this is generous;
/// past it the stream is not SSE.
pub(super) const MAX_EVENT_BYTES: usize = 16 * 1024 * 1024;

/// Cuts a stream fed in pieces into whole events.
#[derive(Debug, Default)]
pub(super) struct EventReader {
    /// Bytes after the last whole event handed out.
    held: BytesMut,
    /// How much of `held` was searched for the event's end.
    scanned: usize,
    /// Where the line being searched starts in `held`.
    line_start: usize,
}

impl EventReader {
    pub(super) fn push(&mut self, bytes: &[u8]) {
        self.held.extend_from_slice(bytes);
    }

    /// The next whole event, its blank line included.
    pub(super) fn next_event(&mut self) -> Option<Bytes> {
        while let Some(found) = self
            .held
            .get(self.scanned..)
            .and_then(|rest| memchr::memchr(b'\n', rest))
        {
            let newline = self.scanned + found;
            let line = self.held.get(self.line_start..newline).unwrap_or_default();
            let blank = line.is_empty() || line == b"\r";
            self.scanned = newline + 1;
            self.line_start = newline + 1;
            if blank {
                self.scanned = 0;
                self.line_start = 0;
                return Some(self.held.split_to(newline + 1).freeze());
            }
        }
        self.scanned = self.held.len();
        None
    }

    /// How many bytes wait for their event's end.
    pub(super) fn held(&self) -> usize {
        self.held.len()
    }

    /// The bytes after the last whole event (the stream ended there).
    pub(super) fn take_rest(&mut self) -> Bytes {
        self.scanned = 0;
        self.line_start = 0;
        self.held.split().freeze()
    }
}

/// One event's fields.
#[derive(Debug)]
pub(super) struct Event<'a> {
    /// The lines that are not data fields (comments, `event:`, `id:`,
    /// `retry:`), without their line ends.
    pub(super) others: Vec<&'a [u8]>,
    /// The data fields' values joined by `\n`; `None` without any.
    pub(super) data: Option<Cow<'a, [u8]>>,
}

impl<'a> Event<'a> {
    pub(super) fn parse(event: &'a [u8]) -> Event<'a> {
        let mut others = Vec::new();
        let mut data: Option<Cow<'a, [u8]>> = None;
        for line in event.split(|byte| *byte == b'\n') {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            if line.is_empty() {
                continue;
            }
            let (field, value) = match memchr::memchr(b':', line) {
                Some(colon) => {
                    let (field, value) = line.split_at(colon);
                    let value = value.get(1..).unwrap_or_default();
                    (field, value.strip_prefix(b" ").unwrap_or(value))
                }
                None => (line, &b""[..]),
            };
            if field != b"data" {
                others.push(line);
                continue;
            }
            data = Some(match data {
                None => Cow::Borrowed(value),
                Some(joined) => {
                    let mut joined = joined.into_owned();
                    joined.push(b'\n');
                    joined.extend_from_slice(value);
                    Cow::Owned(joined)
                }
            });
        }
        Event { others, data }
    }

    /// What the data is.
    pub(super) fn payload(&self) -> Payload {
        let Some(data) = &self.data else {
            return Payload::NoData;
        };
        if data.trim_ascii() == b"[DONE]" {
            return Payload::Done;
        }
        match RawObject::parse(data) {
            Some(object) if is_error_object(&object) => Payload::Error,
            Some(object) => Payload::Json(object),
            None => Payload::Other,
        }
    }

    /// This event with `json` as its data, its other lines kept (first).
    pub(super) fn write_with_data(&self, json: &[u8], out: &mut BytesMut) {
        for line in &self.others {
            out.put_slice(line);
            out.put_u8(b'\n');
        }
        out.put_slice(b"data: ");
        out.put_slice(json);
        out.put_slice(b"\n\n");
    }
}

/// What an event's data is.
#[derive(Debug)]
pub(super) enum Payload {
    /// No data field: a comment (`: ping`) or other fields only.
    NoData,
    /// `[DONE]`.
    Done,
    /// An engine's error object (see [`is_error_event`]).
    Error,
    /// A JSON object.
    Json(RawObject),
    /// Anything else.
    Other,
}

/// Whether one whole event carries an engine's error mid-stream: its data
/// is a JSON object with a top-level `error` object (or string), as vLLM,
/// SGLang and the router itself send, or older vLLM's `"object": "error"`.
/// The caller treats such an event as a break.
pub(crate) fn is_error_event(event: &[u8]) -> bool {
    matches!(Event::parse(event).payload(), Payload::Error)
}

fn is_error_object(object: &RawObject) -> bool {
    let error_member = object
        .get("error")
        .is_some_and(|raw| raw.get().starts_with(['{', '"']));
    error_member || object.value::<String>("object").as_deref() == Some("error")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(pieces: &[&[u8]]) -> (Vec<Bytes>, Bytes) {
        let mut reader = EventReader::default();
        let mut out = Vec::new();
        for piece in pieces {
            reader.push(piece);
            while let Some(event) = reader.next_event() {
                out.push(event);
            }
        }
        (out, reader.take_rest())
    }

    #[test]
    fn events_end_at_blank_lines_of_either_kind() {
        let stream = b"data: 1\n\ndata: 2\r\n\r\n: ping\n\r\nevent: x\ndata: 3\r\n\ndata: 4";
        let (whole, rest) = events(&[stream]);
        assert_eq!(
            whole,
            vec![
                Bytes::from_static(b"data: 1\n\n"),
                Bytes::from_static(b"data: 2\r\n\r\n"),
                Bytes::from_static(b": ping\n\r\n"),
                Bytes::from_static(b"event: x\ndata: 3\r\n\n"),
            ]
        );
        assert_eq!(rest, Bytes::from_static(b"data: 4"));
        for split in 0..=stream.len() {
            let (head, tail) = stream.split_at(split);
            assert_eq!(events(&[head, tail]), (whole.clone(), rest.clone()));
        }
        let bytes: Vec<&[u8]> = stream.chunks(1).collect();
        assert_eq!(events(&bytes), (whole, rest));
    }

    #[test]
    fn data_fields_are_joined_and_other_lines_kept() {
        let event = Event::parse(b": c\ndata: {\"a\":\r\nid: 7\ndata:1}\ndata\n\n");
        assert_eq!(event.data.as_deref(), Some(&b"{\"a\":\n1}\n"[..]));
        assert_eq!(event.others, vec![&b": c"[..], b"id: 7"]);
        assert!(matches!(event.payload(), Payload::Json(_)));
        assert!(matches!(
            Event::parse(b": ping\n\n").payload(),
            Payload::NoData
        ));
        assert!(matches!(
            Event::parse(b"data: [DONE]\n\n").payload(),
            Payload::Done
        ));
        assert!(matches!(
            Event::parse(b"data: [1]\n\n").payload(),
            Payload::Other
        ));
        assert!(matches!(
            Event::parse(b"data: \xff\n\n").payload(),
            Payload::Other
        ));
    }

    #[test]
    fn engine_errors_are_recognized() {
        assert!(is_error_event(
            b"data: {\"error\": {\"message\": \"boom\", \"type\": \"x\"}}\n\n"
        ));
        assert!(is_error_event(b"data: {\"error\":\"boom\"}\n\n"));
        assert!(is_error_event(
            b"data: {\"object\":\"error\",\"message\":\"m\",\"code\":400}\n\n"
        ));
        assert!(is_error_event(
            &crate::sse::error_event("upstream_error", "cut")[2..]
        ));
        assert!(!is_error_event(
            b"data: {\"error\": null, \"choices\": []}\n\n"
        ));
        assert!(!is_error_event(
            b"data: {\"choices\":[{\"delta\":{\"content\":\"error\"}}]}\n\n"
        ));
        assert!(!is_error_event(b": error\n\n"));
        assert!(!is_error_event(b"data: [DONE]\n\n"));
    }
}
