//! The response head: the status line and header fields (httparse), and
//! how the body that follows is framed (RFC 9112 §6.3).
//!
//! httparse's default configuration is the strict one: the version is
//! `HTTP/1.0` or `HTTP/1.1`, the status three digits, a field name a token
//! followed by the colon with no whitespace before it, a field value
//! visible characters, spaces and tabs (and obs-text), and a line that
//! starts with whitespace (obs-fold) is refused. Lines end in CRLF or, as
//! RFC 9112 §2.2 lets a recipient accept, a bare LF (hyper's client takes
//! the same heads: it parses with the same configuration).
//!
//! The framing fields are held to their grammar, and a head whose framing
//! could be read two ways is refused rather than guessed at:
//!
//! - `Transfer-Encoding` must list exactly one coding, `chunked` (empty
//!   list elements are ignored, RFC 9110 §5.6.1): any other coding, or
//!   `chunked` twice, is refused, since this client decodes no other (RFC
//!   9112 §6.3 would read such a response to the connection's close).
//!   In an HTTP/1.0 response it is refused (§6.1).
//! - `Content-Length` is `1*DIGIT`: no sign, no whitespace inside, no
//!   overflow. Several fields, or a comma-separated list, must all agree
//!   (RFC 9110 §8.6); otherwise the head is refused.
//! - Both present: refused. RFC 9112 §6.3 lets `Transfer-Encoding` win,
//!   and says such a message "ought to be handled as an error": it is how
//!   responses are split and requests smuggled, and no engine sends one.
//! - Neither: the body runs to the connection's close, which is then not
//!   reused.
//! - A `204` or `304` answer, or the answer to a `HEAD`, has no body
//!   whatever its fields say, and those fields are not read (§6.3, rule 1).
//! - Informational (1xx) heads are skipped; `101 Switching Protocols` is
//!   refused, since no upgrade is ever asked for.

use bytes::{Buf, BytesMut};
use http::StatusCode;

use crate::body::Framing;
use crate::chunked::Chunked;
use crate::{HeaderLines, SendError};

/// Most bytes of a response head.
pub(crate) const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Most header fields of a response head.
const MAX_HEADERS: usize = 100;

/// A response head, parsed.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct ParsedHead {
    pub(crate) status: StatusCode,
    /// The fields that go on to the next hop.
    pub(crate) headers: HeaderLines,
    pub(crate) framing: Framing,
    /// Whether the connection may carry another request once the body has
    /// been read.
    pub(crate) reusable: bool,
}

fn bad(reason: &str) -> SendError {
    SendError::BadHead(reason.to_owned())
}

/// What the framing fields of a head say, read as they come.
#[derive(Debug, Default)]
struct FramingFields {
    /// A `Transfer-Encoding` field was there.
    transfer_encoding: bool,
    /// The non-empty codings listed, and whether each was `chunked`.
    codings: usize,
    chunked_codings: usize,
    /// A `Content-Length` field was there.
    content_length: bool,
    /// The length every `Content-Length` value agreed on; `None` once one
    /// was malformed or disagreed.
    length: Option<u64>,
    length_bad: bool,
    /// `Connection` lists `close`, or `keep-alive`.
    close: bool,
    keep_alive: bool,
}

impl FramingFields {
    fn read(&mut self, name: &str, value: &[u8]) {
        if name.eq_ignore_ascii_case("transfer-encoding") {
            self.transfer_encoding = true;
            for coding in list_elements(value) {
                self.codings += 1;
                if coding.eq_ignore_ascii_case(b"chunked") {
                    self.chunked_codings += 1;
                }
            }
        } else if name.eq_ignore_ascii_case("content-length") {
            // Empty elements are not skipped here: `1*DIGIT` each.
            for element in value.split(|byte| *byte == b',') {
                match (decimal(trim_ows(element)), self.content_length) {
                    (Some(parsed), false) => self.length = Some(parsed),
                    (Some(parsed), true) if self.length == Some(parsed) => {}
                    _ => self.length_bad = true,
                }
                self.content_length = true;
            }
        } else if name.eq_ignore_ascii_case("connection") {
            for token in list_elements(value) {
                if token.eq_ignore_ascii_case(b"close") {
                    self.close = true;
                } else if token.eq_ignore_ascii_case(b"keep-alive") {
                    self.keep_alive = true;
                }
            }
        }
    }
}

/// The non-empty elements of a comma-separated field value, without the
/// whitespace around them.
fn list_elements(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    value
        .split(|byte| *byte == b',')
        .map(trim_ows)
        .filter(|element| !element.is_empty())
}

/// `bytes` without the spaces and tabs (OWS) around it.
fn trim_ows(bytes: &[u8]) -> &[u8] {
    let is_ows = |byte: &u8| *byte == b' ' || *byte == b'\t';
    let start = bytes.iter().position(|b| !is_ows(b)).unwrap_or(bytes.len());
    let end = bytes
        .iter()
        .rposition(|b| !is_ows(b))
        .map_or(start, |end| end + 1);
    &bytes[start..end]
}

/// `1*DIGIT` as a number: `None` for anything else (a sign, a space, no
/// digit) or one that overflows.
fn decimal(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() {
        return None;
    }
    digits.iter().try_fold(0u64, |value, digit| {
        if !digit.is_ascii_digit() {
            return None;
        }
        value.checked_mul(10)?.checked_add(u64::from(digit - b'0'))
    })
}

/// Parses a whole response head at the start of `buffer` and removes it;
/// `None` while it is incomplete. Informational (1xx) heads are skipped.
/// `head_request`: the request was a `HEAD`, so no body follows.
pub(crate) fn parse_head(
    buffer: &mut BytesMut,
    head_request: bool,
) -> Result<Option<ParsedHead>, SendError> {
    loop {
        // Left uninitialized: httparse writes only the headers it finds.
        let mut headers =
            [const { std::mem::MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
        let mut response = httparse::Response::new(&mut []);
        let head_len = match httparse::ParserConfig::default().parse_response_with_uninit_headers(
            &mut response,
            buffer,
            &mut headers,
        ) {
            Ok(httparse::Status::Complete(len)) => len,
            Ok(httparse::Status::Partial) => return Ok(None),
            Err(error) => return Err(SendError::BadHead(error.to_string())),
        };
        let code = response.code.unwrap_or(0);
        let status =
            StatusCode::from_u16(code).map_err(|_| SendError::BadHead(format!("status {code}")))?;
        if status.is_informational() {
            if status == StatusCode::SWITCHING_PROTOCOLS {
                return Err(bad("an upgrade was not asked for"));
            }
            buffer.advance(head_len);
            continue;
        }
        let http10 = response.version == Some(0);
        // The framing and `Connection` first: the names `Connection` lists
        // are not forwarded, wherever they stand.
        let mut fields = FramingFields::default();
        for header in response.headers.iter() {
            fields.read(header.name, header.value);
        }
        let mut close = fields.close || (http10 && !fields.keep_alive);
        let framing = if head_request
            || status == StatusCode::NO_CONTENT
            || status == StatusCode::NOT_MODIFIED
        {
            Framing::Done
        } else if fields.transfer_encoding {
            if http10 {
                return Err(bad("transfer-encoding in an HTTP/1.0 response"));
            }
            if fields.content_length {
                return Err(bad("both transfer-encoding and content-length"));
            }
            if fields.codings != 1 || fields.chunked_codings != 1 {
                return Err(bad("a transfer coding other than chunked alone"));
            }
            Framing::Chunked(Chunked::Size)
        } else if fields.content_length {
            match fields.length {
                _ if fields.length_bad => return Err(bad("content-length")),
                Some(0) | None => Framing::Done,
                Some(remaining) => Framing::Length { remaining },
            }
        } else {
            close = true;
            Framing::UntilClose
        };
        // The lines passed on are copied out, so the read buffer stays the
        // connection's own for the body.
        let forwarded = HeaderLines::forwarded(|| {
            response
                .headers
                .iter()
                .map(|header| (header.name, header.value))
        });
        buffer.advance(head_len);
        return Ok(Some(ParsedHead {
            status,
            headers: forwarded,
            framing,
            reusable: !close,
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Option<ParsedHead> {
        let mut buffer = BytesMut::from(text.as_bytes());
        parse_head(&mut buffer, false).unwrap()
    }

    fn refused(text: &str) -> String {
        let mut buffer = BytesMut::from(text.as_bytes());
        match parse_head(&mut buffer, false) {
            Err(SendError::BadHead(reason)) => reason,
            other => panic!("{text:?} was not refused: {other:?}"),
        }
    }

    fn framing(text: &str) -> Framing {
        parse(text).unwrap().framing
    }

    #[test]
    fn response_heads_give_status_headers_and_framing() {
        let head = parse(
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\nx-a: 1\r\n\r\n",
        )
        .unwrap();
        assert_eq!(head.status, StatusCode::OK);
        assert_eq!(head.framing, Framing::Chunked(Chunked::Size));
        assert!(head.reusable);
        assert_eq!(
            head.headers.as_wire(),
            b"content-type: text/event-stream\r\nx-a: 1\r\n",
            "the framing left out, the rest as written"
        );
        assert_eq!(head.headers.get("X-A"), Some(&b"1"[..]));
        assert_eq!(head.headers.get("transfer-encoding"), None);

        let head = parse(
            "HTTP/1.1 200 OK\r\ncontent-length: 5\r\nconnection: close, x-b\r\nx-b: 2\r\n\r\n",
        )
        .unwrap();
        assert_eq!(head.framing, Framing::Length { remaining: 5 });
        assert!(!head.reusable, "connection: close");
        assert!(head.headers.is_empty(), "{:?}", head.headers);

        // A listed name is dropped even before `Connection` lists it;
        // names keep the worker's case on the wire, and are lowercased in
        // a map.
        let head = parse(
            "HTTP/1.1 200 OK\r\nX-B: 2\r\nConnection: X-B\r\nX-Keep:  3 \r\nContent-Length: 0\r\n\r\n",
        )
        .unwrap();
        assert_eq!(head.headers.as_wire(), b"X-Keep: 3\r\n");
        let map = head.headers.to_header_map();
        assert_eq!(map.len(), 1, "{map:?}");
        assert_eq!(map["x-keep"], "3");
        assert_eq!(head.framing, Framing::Done);
        assert!(head.reusable);

        assert!(parse("HTTP/1.1 200 OK\r\ncontent-le").is_none(), "partial");
        assert!(parse("HTTP/1.1 200 OK\r\n").is_none(), "partial");
    }

    #[test]
    fn informational_heads_are_skipped_and_an_upgrade_refused() {
        let head =
            parse("HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 503 Busy\r\ncontent-length: 0\r\n\r\n")
                .unwrap();
        assert_eq!(head.status, StatusCode::SERVICE_UNAVAILABLE, "1xx skipped");
        assert!(parse("HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n").is_none());
        refused("HTTP/1.1 101 Switching Protocols\r\nupgrade: x\r\n\r\n");
    }

    #[test]
    fn the_status_line_is_http_1_x_and_three_digits() {
        for line in [
            "HTTP/1.2 200 OK",
            "HTTP/2 200 OK",
            "HTTP/1.1 20 OK",
            "HTTP/1.1 2000 OK",
            "HTTP/1.1 -20 OK",
            "HTTP/1.1  200 OK",
            "http/1.1 200 OK",
            "HTTP/1.1 099 Low",
        ] {
            refused(&format!("{line}\r\ncontent-length: 0\r\n\r\n"));
        }
        let head = parse("HTTP/1.0 599 Whatever it says\r\ncontent-length: 0\r\n\r\n").unwrap();
        assert_eq!(head.status.as_u16(), 599);
    }

    #[test]
    fn field_lines_are_tokens_a_colon_and_a_value() {
        // Whitespace before the colon (RFC 9112 §5.1), obs-fold (§5.2), a
        // name that is not a token, a control character in a value.
        for fields in [
            "content-length : 0\r\n",
            "x-a: 1\r\n folded\r\ncontent-length: 0\r\n",
            "x-a: 1\r\n\tfolded\r\ncontent-length: 0\r\n",
            " x-a: 1\r\ncontent-length: 0\r\n",
            "x(a): 1\r\ncontent-length: 0\r\n",
            "x-a: 1\x01\r\ncontent-length: 0\r\n",
            ": 1\r\ncontent-length: 0\r\n",
        ] {
            refused(&format!("HTTP/1.1 200 OK\r\n{fields}\r\n"));
        }
        let too_many: String = (0..=MAX_HEADERS).map(|i| format!("x-{i}: 1\r\n")).collect();
        refused(&format!("HTTP/1.1 200 OK\r\n{too_many}\r\n"));
    }

    #[test]
    fn content_length_is_digits_only_and_agrees_with_itself() {
        for value in [
            "+5",
            "-5",
            "5 5",
            "0x5",
            "",
            "5;",
            "five",
            "18446744073709551616",
        ] {
            refused(&format!(
                "HTTP/1.1 200 OK\r\ncontent-length: {value}\r\n\r\n"
            ));
        }
        refused("HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\n");
        refused("HTTP/1.1 200 OK\r\ncontent-length: 5, 6\r\n\r\n");
        refused("HTTP/1.1 200 OK\r\ncontent-length: 5,\r\n\r\n");
        let five = Framing::Length { remaining: 5 };
        assert_eq!(
            framing("HTTP/1.1 200 OK\r\ncontent-length: 005\r\n\r\n"),
            five
        );
        assert_eq!(
            framing("HTTP/1.1 200 OK\r\ncontent-length: 5, 5\r\n\r\n"),
            five
        );
        assert_eq!(
            framing("HTTP/1.1 200 OK\r\ncontent-length: 5\r\nContent-Length: 5\r\n\r\n"),
            five
        );
        assert_eq!(
            framing("HTTP/1.1 200 OK\r\ncontent-length: 18446744073709551615\r\n\r\n"),
            Framing::Length {
                remaining: u64::MAX
            }
        );
    }

    #[test]
    fn transfer_encoding_is_chunked_alone_and_never_beside_a_length() {
        let chunked = Framing::Chunked(Chunked::Size);
        for value in ["chunked", "Chunked", " chunked ", "chunked,", ", chunked"] {
            let head = format!("HTTP/1.1 200 OK\r\ntransfer-encoding: {value}\r\n\r\n");
            assert_eq!(framing(&head), chunked, "{value:?}");
        }
        for value in [
            "gzip, chunked",
            "chunked, gzip",
            "gzip",
            "chunked, chunked",
            "identity",
            "",
        ] {
            refused(&format!(
                "HTTP/1.1 200 OK\r\ntransfer-encoding: {value}\r\n\r\n"
            ));
        }
        refused("HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\ntransfer-encoding: chunked\r\n\r\n");
        let both =
            refused("HTTP/1.1 200 OK\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n");
        assert!(both.contains("both"), "{both}");
        refused("HTTP/1.0 200 OK\r\ntransfer-encoding: chunked\r\n\r\n");
    }

    #[test]
    fn without_a_length_the_body_runs_to_the_close() {
        let head = parse("HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\n").unwrap();
        assert_eq!(head.framing, Framing::UntilClose);
        assert!(!head.reusable);
        let head = parse("HTTP/1.0 200 OK\r\n\r\n").unwrap();
        assert_eq!(head.framing, Framing::UntilClose);
        assert!(!head.reusable);
        // HTTP/1.0 keeps the connection only when asked, and `close` wins.
        let head = parse("HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ncontent-length: 1\r\n\r\n");
        assert!(head.unwrap().reusable);
        let head =
            parse("HTTP/1.0 200 OK\r\nconnection: close, keep-alive\r\ncontent-length: 1\r\n\r\n");
        assert!(!head.unwrap().reusable);
        let head = parse("HTTP/1.0 200 OK\r\ncontent-length: 1\r\n\r\n");
        assert!(!head.unwrap().reusable);
    }

    #[test]
    fn no_content_not_modified_and_head_answers_have_no_body_whatever_they_say() {
        for status in ["204 No Content", "304 Not Modified"] {
            for fields in [
                "",
                "content-length: 5\r\n",
                "content-length: +5\r\n",
                "transfer-encoding: chunked\r\ncontent-length: 5\r\n",
                "transfer-encoding: gzip\r\n",
            ] {
                let text = format!("HTTP/1.1 {status}\r\n{fields}\r\n");
                let head = parse(&text).unwrap();
                assert_eq!(head.framing, Framing::Done, "{text:?}");
                assert!(head.reusable, "{text:?}");
            }
        }
        let mut buffer = BytesMut::from(&b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n"[..]);
        let head = parse_head(&mut buffer, true).unwrap().unwrap();
        assert_eq!(head.framing, Framing::Done);
        assert!(buffer.is_empty());
    }

    #[test]
    fn decimals_are_digits_only() {
        assert_eq!(decimal(b"0"), Some(0));
        assert_eq!(decimal(b"0042"), Some(42));
        assert_eq!(decimal(b"18446744073709551615"), Some(u64::MAX));
        for bad in [
            &b""[..],
            b"+1",
            b"-1",
            b" 1",
            b"1 ",
            b"1_0",
            b"18446744073709551616",
        ] {
            assert_eq!(decimal(bad), None, "{bad:?}");
        }
        assert_eq!(trim_ows(b" \t 5 \t"), b"5");
        assert_eq!(trim_ows(b"  "), b"");
    }
}
