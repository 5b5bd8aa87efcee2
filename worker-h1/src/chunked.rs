//! The chunked transfer coding (RFC 9112 §7.1), decoded strictly:
//!
//! ```text
//! chunked-body   = *chunk last-chunk trailer-section CRLF
//! chunk          = chunk-size [ chunk-ext ] CRLF chunk-data CRLF
//! chunk-size     = 1*HEXDIG
//! last-chunk     = 1*("0") [ chunk-ext ] CRLF
//! chunk-ext      = *( BWS ";" BWS chunk-ext-name [ BWS "=" BWS chunk-ext-val ] )
//! chunk-ext-name = token
//! chunk-ext-val  = token / quoted-string
//! trailer-section = *( field-line CRLF )
//! ```
//!
//! Every line ends in CRLF: a bare LF is refused, in a size line, after a
//! chunk's data and in the trailers, as is anything before a size's first
//! digit. Whitespace is allowed where the grammar has BWS (before a `;`,
//! around an `=`) and, as one leniency that hyper's client, nginx and Go
//! share, at the end of a size line (`5 \r\n`): it leaves the size as
//! plain. A size is any number of hex digits whose value fits 64 bits.
//! Extensions are checked and ignored. A size line (with its
//! extensions) may be [`MAX_LINE_BYTES`] long, the trailer section
//! [`MAX_TRAILER_BYTES`] with at most [`MAX_TRAILERS`] fields, each a field
//! line as httparse reads one in a head; trailers are read and dropped.

use bytes::{Buf, Bytes, BytesMut};

use crate::BodyError;

/// Most bytes of a chunk-size line, extensions included, without its CRLF.
pub(crate) const MAX_LINE_BYTES: usize = 4 * 1024;
/// Most bytes of a trailer section, its final CRLF included.
pub(crate) const MAX_TRAILER_BYTES: usize = 16 * 1024;
/// Most fields of a trailer section.
pub(crate) const MAX_TRAILERS: usize = 100;

/// Where a chunked body's decoder is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Chunked {
    /// At a chunk-size line.
    Size,
    /// Inside a chunk's data.
    Data { remaining: u64 },
    /// At the CRLF after a chunk's data.
    DataEnd,
    /// After the last chunk: the trailer section and the final CRLF.
    Trailers,
    /// The body has ended.
    Done,
}

/// Decodes what `buffer` holds from `state` on: the data of the whole
/// chunks, and of the part of one, joined into one run, moved to the
/// buffer's front and split off (`None` when there was none). Framing read
/// is removed from the buffer; what stays is an incomplete line, or what
/// follows the body once `state` is [`Chunked::Done`].
pub(crate) fn decode_chunked(
    buffer: &mut BytesMut,
    state: &mut Chunked,
) -> Result<Option<Bytes>, BodyError> {
    // Data is gathered at `written`; `read` walks the framing.
    let mut written = 0usize;
    let mut read = 0usize;
    loop {
        match *state {
            Chunked::Size => {
                let Some(size) = size_line(&buffer[read..])? else {
                    break;
                };
                read += size.line_bytes;
                *state = if size.size == 0 {
                    Chunked::Trailers
                } else {
                    Chunked::Data {
                        remaining: size.size,
                    }
                };
            }
            Chunked::Data { remaining } => {
                let available = buffer.len() - read;
                if available == 0 {
                    break;
                }
                let take = usize::try_from(remaining).map_or(available, |r| r.min(available));
                if written == 0 && read > 0 {
                    // Nothing gathered yet: drop the framing in front
                    // instead of moving the data.
                    buffer.advance(read);
                    read = 0;
                } else if written != read {
                    buffer.copy_within(read..read + take, written);
                }
                written += take;
                read += take;
                let left = remaining - take as u64;
                *state = if left == 0 {
                    Chunked::DataEnd
                } else {
                    Chunked::Data { remaining: left }
                };
            }
            Chunked::DataEnd => {
                let rest = &buffer[read..];
                if rest.len() < 2 {
                    if rest.first().is_some_and(|byte| *byte != b'\r') {
                        return Err(BodyError::BadChunk("no CRLF after chunk data"));
                    }
                    break;
                }
                if &rest[..2] != b"\r\n" {
                    return Err(BodyError::BadChunk("no CRLF after chunk data"));
                }
                read += 2;
                *state = Chunked::Size;
            }
            Chunked::Trailers => {
                let Some(trailer_bytes) = trailer_section(&buffer[read..])? else {
                    break;
                };
                read += trailer_bytes;
                *state = Chunked::Done;
            }
            Chunked::Done => break,
        }
    }
    let data = (written > 0).then(|| buffer.split_to(written).freeze());
    buffer.advance(read - written);
    Ok(data)
}

/// A chunk-size line, read.
#[derive(Debug, PartialEq, Eq)]
struct SizeLine {
    size: u64,
    /// The line's bytes, CRLF included.
    line_bytes: usize,
}

/// The chunk-size line at the front of `bytes`; `None` while it is not
/// whole.
fn size_line(bytes: &[u8]) -> Result<Option<SizeLine>, BodyError> {
    let bad = |what| Err(BodyError::BadChunk(what));
    let Some(newline) = bytes
        .iter()
        .take(MAX_LINE_BYTES + 2)
        .position(|byte| *byte == b'\n')
    else {
        // Whatever is there must be able to start a size line.
        if bytes.first().is_some_and(|byte| hex_value(*byte).is_none()) {
            return bad("chunk size");
        }
        if bytes.len() > MAX_LINE_BYTES + 1 {
            return bad("chunk-size line too long");
        }
        return Ok(None);
    };
    if newline == 0 || bytes[newline - 1] != b'\r' {
        return bad("chunk-size line without CRLF");
    }
    // Whitespace at the line's end is let pass, as hyper's client, nginx
    // and Go's do: the size is just as plain with it.
    let line = trim_end_ows(&bytes[..newline - 1]);
    let digits = line
        .iter()
        .position(|byte| hex_value(*byte).is_none())
        .unwrap_or(line.len());
    if digits == 0 {
        return bad("chunk size");
    }
    let size = line[..digits].iter().try_fold(0u64, |size, digit| {
        size.checked_mul(16)?
            .checked_add(u64::from(hex_value(*digit)?))
    });
    let Some(size) = size else {
        return bad("chunk size over 64 bits");
    };
    if !extensions_valid(&line[digits..]) {
        return bad("chunk extension");
    }
    Ok(Some(SizeLine {
        size,
        line_bytes: newline + 1,
    }))
}

/// `bytes` without the spaces and tabs at its end.
fn trim_end_ows(bytes: &[u8]) -> &[u8] {
    let end = bytes
        .iter()
        .rposition(|byte| *byte != b' ' && *byte != b'\t')
        .map_or(0, |last| last + 1);
    &bytes[..end]
}

fn hex_value(byte: u8) -> Option<u8> {
    match byte {
        b'0'..=b'9' => Some(byte - b'0'),
        b'a'..=b'f' => Some(byte - b'a' + 10),
        b'A'..=b'F' => Some(byte - b'A' + 10),
        _ => None,
    }
}

/// Whether `bytes` is a `chunk-ext` (possibly empty).
fn extensions_valid(mut bytes: &[u8]) -> bool {
    while !bytes.is_empty() {
        let Some(rest) = skip_bws(bytes).strip_prefix(b";") else {
            return false;
        };
        let rest = skip_bws(rest);
        let name = token_len(rest);
        if name == 0 {
            return false;
        }
        bytes = &rest[name..];
        if let Some(value) = skip_bws(bytes).strip_prefix(b"=") {
            let value = skip_bws(value);
            let value_len = if value.first() == Some(&b'"') {
                quoted_string_len(value)
            } else {
                token_len(value)
            };
            if value_len == 0 {
                return false;
            }
            bytes = &value[value_len..];
        }
    }
    true
}

/// `bytes` past its leading spaces and tabs.
fn skip_bws(bytes: &[u8]) -> &[u8] {
    let start = bytes
        .iter()
        .position(|byte| *byte != b' ' && *byte != b'\t')
        .unwrap_or(bytes.len());
    &bytes[start..]
}

/// How many bytes at the front of `bytes` are `tchar`s (RFC 9110 §5.6.2).
fn token_len(bytes: &[u8]) -> usize {
    bytes
        .iter()
        .position(|byte| !is_tchar(*byte))
        .unwrap_or(bytes.len())
}

fn is_tchar(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&byte)
}

/// The length of the quoted-string (RFC 9110 §5.6.4) at the front of
/// `bytes`, quotes included; 0 if there is none.
fn quoted_string_len(bytes: &[u8]) -> usize {
    let mut at = 1;
    while let Some(&byte) = bytes.get(at) {
        match byte {
            b'"' => return at + 1,
            b'\\' => match bytes.get(at + 1) {
                Some(&escaped) if escaped == b'\t' || (escaped >= b' ' && escaped != 0x7f) => {
                    at += 2;
                }
                _ => return 0,
            },
            b'\t' | b' ' | 0x21 | 0x23..=0x5b | 0x5d..=0x7e | 0x80..=0xff => at += 1,
            _ => return 0,
        }
    }
    0
}

/// The trailer section and final CRLF at the front of `bytes`: their
/// length once whole, `None` before.
fn trailer_section(bytes: &[u8]) -> Result<Option<usize>, BodyError> {
    let bad = |what| Err(BodyError::BadChunk(what));
    if bytes.starts_with(b"\r\n") {
        return Ok(Some(2));
    }
    let window = &bytes[..bytes.len().min(MAX_TRAILER_BYTES)];
    let Some(end) = window
        .windows(4)
        .position(|four| four == b"\r\n\r\n")
        .map(|at| at + 4)
    else {
        if bytes.len() >= MAX_TRAILER_BYTES {
            return bad("trailers too long");
        }
        if bare_lf(bytes) {
            return bad("trailer line without CRLF");
        }
        return Ok(None);
    };
    let section = &bytes[..end];
    if bare_lf(section) {
        return bad("trailer line without CRLF");
    }
    let mut fields = [httparse::EMPTY_HEADER; MAX_TRAILERS];
    match httparse::parse_headers(section, &mut fields) {
        Ok(httparse::Status::Complete((parsed, _))) if parsed == end => Ok(Some(end)),
        _ => bad("trailer field"),
    }
}

/// Whether a LF in `bytes` has no CR before it.
fn bare_lf(bytes: &[u8]) -> bool {
    bytes
        .iter()
        .enumerate()
        .any(|(at, byte)| *byte == b'\n' && (at == 0 || bytes[at - 1] != b'\r'))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Decodes `pieces` fed one after another: every run of data, and
    /// whether the end was found.
    fn decode_pieces(pieces: &[&[u8]]) -> Result<(Vec<Vec<u8>>, bool), BodyError> {
        let mut buffer = BytesMut::new();
        let mut state = Chunked::Size;
        let mut runs = Vec::new();
        for piece in pieces {
            buffer.extend_from_slice(piece);
            if let Some(data) = decode_chunked(&mut buffer, &mut state)? {
                runs.push(data.to_vec());
            }
        }
        let ended = state == Chunked::Done;
        if ended {
            assert!(buffer.is_empty(), "nothing after the end: {buffer:?}");
        }
        Ok((runs, ended))
    }

    fn decode(wire: &[u8]) -> Result<(Vec<u8>, bool), BodyError> {
        decode_pieces(&[wire]).map(|(runs, ended)| (runs.concat(), ended))
    }

    fn refused(wire: &[u8]) -> &'static str {
        match decode(wire) {
            Err(BodyError::BadChunk(what)) => what,
            other => panic!(
                "{:?} was not refused: {other:?}",
                String::from_utf8_lossy(wire)
            ),
        }
    }

    #[test]
    fn chunks_that_arrived_together_are_one_run() {
        let wire = b"5\r\nhello\r\n1;ext=1\r\n \r\n5\r\nworld\r\n0\r\n\r\n";
        let (runs, ended) = decode_pieces(&[wire]).unwrap();
        assert_eq!(runs, [b"hello world".to_vec()]);
        assert!(ended);
    }

    #[test]
    fn every_split_of_a_chunked_body_gives_the_same_bytes() {
        let wire =
            b"5\r\nhello\r\nA ; a=\"q \\\" s\"\r\n0123456789\r\n000;last\r\nx-trailer: 1\r\n\r\n";
        for split in 0..=wire.len() {
            let (head, tail) = wire.split_at(split);
            let (runs, ended) = decode_pieces(&[head, tail]).unwrap();
            assert_eq!(runs.concat(), b"hello0123456789", "split at {split}");
            assert!(ended, "split at {split}");
        }
        let bytewise: Vec<&[u8]> = wire.chunks(1).collect();
        let (runs, ended) = decode_pieces(&bytewise).unwrap();
        assert_eq!(runs.concat(), b"hello0123456789");
        assert!(ended);
    }

    #[test]
    fn what_follows_the_body_stays_in_the_buffer() {
        let mut buffer = BytesMut::from(&b"1\r\na\r\n0\r\n\r\nHTTP/1.1"[..]);
        let mut state = Chunked::Size;
        let data = decode_chunked(&mut buffer, &mut state).unwrap();
        assert_eq!(data.as_deref(), Some(&b"a"[..]));
        assert_eq!(state, Chunked::Done);
        assert_eq!(&buffer[..], b"HTTP/1.1");
    }

    #[test]
    fn size_lines_are_hex_digits_extensions_and_crlf() {
        assert_eq!(
            size_line(b"1a\r\ndata").unwrap(),
            Some(SizeLine {
                size: 0x1a,
                line_bytes: 4
            })
        );
        assert_eq!(
            size_line(b"00000000000000000001\r\n")
                .unwrap()
                .map(|s| s.size),
            Some(1),
            "leading zeros count for nothing"
        );
        assert_eq!(
            size_line(b"ffffffffffffffff\r\n").unwrap().map(|s| s.size),
            Some(u64::MAX)
        );
        for good in [
            &b"1;a\r\n"[..],
            b"1 ;a\r\n",
            b"1\t; a = b\r\n",
            b"1;a=b;c;d=\"x y\"\r\n",
            b"1;a=\"\"\r\n",
            b"1;a=\"\\\"\"\r\n",
            b"1;!#$%&'*+-.^_`|~=~\r\n",
            b"1 \r\n",
            b"1\t \r\n",
            b"1;a=b \r\n",
            b"1;a=\"x \" \r\n",
        ] {
            assert!(
                size_line(good).unwrap().is_some(),
                "{:?}",
                String::from_utf8_lossy(good)
            );
        }
        for partial in [&b""[..], b"1", b"1a;x=", b"1\r"] {
            assert_eq!(size_line(partial).unwrap(), None, "{partial:?}");
        }
        for bad in [
            &b"1a\n"[..],
            b"\r\n",
            b" 1\r\n",
            b"\t1\r\n",
            b"1;\r\n",
            b"1 ;\r\n",
            b"1 2\r\n",
            b"1;a=\r\n",
            b"1;a b\r\n",
            b"1;a=\"x \r\n",
            b"1;a=\"x\r\n",
            b"1;a=\"\x01\"\r\n",
            b"1;a\x00\r\n",
            b"1;a\n",
            b"g\r\n",
            b"-1\r\n",
            b"+1\r\n",
            b"0x1\r\n",
            b"1\r\r\n",
            b"10000000000000000\r\n",
            b"z",
            b" ",
        ] {
            assert!(
                size_line(bad).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn lines_are_bounded() {
        let long_extension = format!("1;a={}\r\n", "b".repeat(MAX_LINE_BYTES));
        assert!(size_line(long_extension.as_bytes()).is_err());
        let at_limit = format!("1;a={}\r\n", "b".repeat(MAX_LINE_BYTES - 4));
        assert!(size_line(at_limit.as_bytes()).unwrap().is_some());
        let unfinished = format!("1;a={}", "b".repeat(MAX_LINE_BYTES));
        assert!(
            size_line(unfinished.as_bytes()).is_err(),
            "refused before its end"
        );
        let trailers = format!("x: {}\r\n", "y".repeat(MAX_TRAILER_BYTES));
        assert!(trailer_section(trailers.as_bytes()).is_err());
        let many: String = (0..=MAX_TRAILERS)
            .map(|i| format!("x-{i}: 1\r\n"))
            .collect();
        assert!(trailer_section(format!("{many}\r\n").as_bytes()).is_err());
    }

    #[test]
    fn chunk_data_ends_in_crlf() {
        for bad in [
            &b"2\r\nabX\r\n"[..],
            b"2\r\nab\n0\r\n\r\n",
            b"2\r\nab\r0\r\n\r\n",
            b"2\r\nab0\r\n\r\n",
            b"1\r\na\r\n2\r\nabXY\r\n",
        ] {
            assert_eq!(refused(bad), "no CRLF after chunk data", "{bad:?}");
        }
        // A CR alone may be the start of the CRLF still to come.
        let (data, ended) = decode(b"2\r\nab\r").unwrap();
        assert_eq!((data, ended), (b"ab".to_vec(), false));
    }

    #[test]
    fn trailers_are_field_lines_ending_in_crlf() {
        let (data, ended) = decode(b"1\r\na\r\n0\r\nx-a: 1\r\nX-B:2\r\n\r\n").unwrap();
        assert_eq!((data, ended), (b"a".to_vec(), true));
        for bad in [
            &b"0\r\nx-a: 1\n\r\n"[..],
            b"0\r\n\n",
            b"0\r\nx-a: 1\r\n\n",
            b"0\r\nx-a : 1\r\n\r\n",
            b"0\r\nx-a: 1\r\n folded\r\n\r\n",
            b"0\r\nno colon\r\n\r\n",
            b"0\r\nx-a: 1\n",
        ] {
            assert!(decode(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
        // Not yet whole.
        assert_eq!(decode(b"0\r\nx-a: 1\r\n").unwrap(), (Vec::new(), false));
        assert_eq!(decode(b"0\r\n\r").unwrap(), (Vec::new(), false));
    }

    #[test]
    fn malformed_sizes_are_errors_as_soon_as_seen() {
        assert_eq!(refused(b"zz"), "chunk size");
        assert_eq!(refused(b"zz\r\n"), "chunk size");
        assert_eq!(refused(b"1\r\na\r\n z"), "chunk size");
        assert_eq!(refused(b"1\r\na\r\n1a\n"), "chunk-size line without CRLF");
        assert_eq!(
            refused(&[b'1'; MAX_LINE_BYTES + 2]),
            "chunk-size line too long"
        );
    }

    #[test]
    fn quoted_strings_end_at_their_closing_quote() {
        assert_eq!(quoted_string_len(b"\"\""), 2);
        assert_eq!(quoted_string_len(b"\"a b\"rest"), 5);
        assert_eq!(quoted_string_len(b"\"a\\\"b\""), 6);
        assert_eq!(quoted_string_len(b"\"\xff\""), 3, "obs-text");
        for bad in [
            &b"\""[..],
            b"\"abc",
            b"\"a\\",
            b"\"\r\"",
            b"\"\x7f\"",
            b"\"a\\\x01\"",
        ] {
            assert_eq!(quoted_string_len(bad), 0, "{bad:?}");
        }
    }
}
