//! Header lines as they go on to the next hop.

use http::header::HeaderName;
use http::{HeaderMap, HeaderValue};

/// Headers that describe one hop, never forwarded (RFC 9110 §7.6.1).
#[cfg(test)]
const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "proxy-connection",
];

/// Whether a header is forwarded: not hop-by-hop, not named in
/// `Connection` (`listed`), not `Host` or `Content-Length` (the next hop's
/// own). Names compare in any case.
fn is_forwarded(name: &[u8], listed: &[&[u8]]) -> bool {
    !(is_never_forwarded(name)
        || listed
            .iter()
            .any(|listed| listed.eq_ignore_ascii_case(name)))
}

/// Whether `name` is left out whatever `Connection` lists: the hop-by-hop
/// headers of RFC 9110 §7.6.1 (`Connection`, `Keep-Alive`,
/// `Proxy-Authenticate`, `Proxy-Authorization`, `TE`, `Trailer`,
/// `Transfer-Encoding`, `Upgrade`, `Proxy-Connection`), `Host` and
/// `Content-Length`; chosen by length first, since every header of every
/// request and answer is asked.
fn is_never_forwarded(name: &[u8]) -> bool {
    let is = |known: &str| known.as_bytes().eq_ignore_ascii_case(name);
    match name.len() {
        2 => is("te"),
        4 => is("host"),
        7 => is("trailer") || is("upgrade"),
        10 => is("connection") || is("keep-alive"),
        14 => is("content-length"),
        16 => is("proxy-connection"),
        17 => is("transfer-encoding"),
        18 => is("proxy-authenticate"),
        19 => is("proxy-authorization"),
        _ => false,
    }
}

/// Headers as they go on to the next hop: the lines as the last one wrote
/// them (`name: value\r\n`, each name in its case), less the hop-by-hop
/// ones, those `Connection` lists, `Host` and `Content-Length`. An
/// HTTP/1.1 writer copies them as they are, so a proxied head builds no
/// [`HeaderMap`] either way; one is built only when asked for
/// ([`to_header_map`](Self::to_header_map)).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeaderLines {
    /// Each name and value passed httparse's checks (or came from a
    /// [`HeaderMap`]), so each line is one header a map would take too.
    lines: Vec<u8>,
}

/// One line of [`HeaderLines`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct HeaderLine<'a> {
    /// The whole line, CRLF included.
    wire: &'a [u8],
    colon: usize,
}

impl<'a> HeaderLine<'a> {
    pub(crate) fn name(&self) -> &'a [u8] {
        &self.wire[..self.colon]
    }

    pub(crate) fn value(&self) -> &'a [u8] {
        &self.wire[self.colon + 2..self.wire.len() - 2]
    }

    /// The line as written, CRLF included.
    pub(crate) fn as_wire(&self) -> &'a [u8] {
        self.wire
    }
}

impl HeaderLines {
    /// The headers `fields` gives (name, value; it is called twice) that
    /// go on to the next hop: hop-by-hop ones, those `Connection` lists
    /// (wherever it stands), `Host` and `Content-Length` are left out.
    pub(crate) fn forwarded<'f, I>(fields: impl Fn() -> I) -> HeaderLines
    where
        I: Iterator<Item = (&'f str, &'f [u8])>,
    {
        // Borrowed, and only names not left out anyway: the common
        // `Connection: keep-alive` (or `close`) costs no allocation.
        let mut listed: Vec<&[u8]> = Vec::new();
        let mut room = 0;
        for (name, value) in fields() {
            room += name.len() + value.len() + 4;
            if name.eq_ignore_ascii_case("connection") {
                listed.extend(
                    value
                        .split(|byte| *byte == b',')
                        .map(<[u8]>::trim_ascii)
                        .filter(|token| {
                            !token.is_empty()
                                && !token.eq_ignore_ascii_case(b"close")
                                && !is_never_forwarded(token)
                        }),
                );
            }
        }
        let mut lines = HeaderLines {
            lines: Vec::with_capacity(room),
        };
        for (name, value) in fields() {
            if is_forwarded(name.as_bytes(), &listed) {
                lines.push(name, value);
            }
        }
        lines
    }

    /// The headers of `map` that go on to the next hop: hop-by-hop ones,
    /// those `Connection` lists, `Host` and `Content-Length` are left out.
    pub fn forwarded_from_map(map: &HeaderMap) -> HeaderLines {
        HeaderLines::forwarded(|| {
            map.iter()
                .map(|(name, value)| (name.as_str(), value.as_bytes()))
        })
    }

    /// The header lines, each ending in CRLF: ready to write into an
    /// HTTP/1.1 head.
    pub fn as_wire(&self) -> &[u8] {
        &self.lines
    }

    /// Whether there are no headers.
    pub fn is_empty(&self) -> bool {
        self.lines.is_empty()
    }

    /// Each header line, in order.
    pub(crate) fn lines(&self) -> impl Iterator<Item = HeaderLine<'_>> {
        self.lines
            .split_inclusive(|byte| *byte == b'\n')
            .filter_map(|wire| {
                let colon = wire.iter().position(|byte| *byte == b':')?;
                Some(HeaderLine { wire, colon })
            })
    }

    /// The first value of the header `name` (any case).
    pub fn get(&self, name: &str) -> Option<&[u8]> {
        self.lines()
            .find(|line| line.name().eq_ignore_ascii_case(name.as_bytes()))
            .map(|line| line.value())
    }

    /// The headers as a [`HeaderMap`] (names lowercased), for a server
    /// that needs one (hyper's).
    pub fn to_header_map(&self) -> HeaderMap {
        let mut map = HeaderMap::new();
        for line in self.lines() {
            // Both were checked as the head was read, so neither fails.
            if let (Ok(name), Ok(value)) = (
                HeaderName::from_bytes(line.name()),
                HeaderValue::from_bytes(line.value()),
            ) {
                map.append(name, value);
            }
        }
        map
    }

    /// Adds a header line (after those there are).
    pub fn append(&mut self, name: &HeaderName, value: &HeaderValue) {
        self.push(name.as_str(), value.as_bytes());
    }

    fn push(&mut self, name: &str, value: &[u8]) {
        self.lines.extend_from_slice(name.as_bytes());
        self.lines.extend_from_slice(b": ");
        self.lines.extend_from_slice(value);
        self.lines.extend_from_slice(b"\r\n");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::header;

    #[test]
    fn never_forwarded_names_are_the_hop_headers_host_and_content_length() {
        let never: Vec<&str> = HOP_BY_HOP
            .iter()
            .copied()
            .chain(["host", "content-length"])
            .collect();
        for name in &never {
            assert!(is_never_forwarded(name.as_bytes()), "{name}");
            let upper = name.to_ascii_uppercase();
            assert!(is_never_forwarded(upper.as_bytes()), "{upper}");
        }
        // Same lengths as some of them, or a prefix of one: forwarded.
        for name in [
            "tf",
            "hose",
            "trailers",
            "upgrades",
            "connexion",
            "keep-alivf",
            "content-type",
            "content-lengthx",
            "x-request-id",
            "authorization",
            "",
            "t",
        ] {
            assert!(!is_never_forwarded(name.as_bytes()), "{name}");
        }
    }

    #[test]
    fn forwarded_lines_leave_out_what_connection_lists_wherever_it_stands() {
        let mut map = HeaderMap::new();
        map.insert("x-before", HeaderValue::from_static("1"));
        map.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, X-Before, close, host"),
        );
        map.insert(header::HOST, HeaderValue::from_static("router"));
        map.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        let lines = HeaderLines::forwarded_from_map(&map);
        assert_eq!(lines.as_wire(), b"content-type: text/plain\r\n");
        assert_eq!(lines.get("Content-Type"), Some(&b"text/plain"[..]));
        assert_eq!(lines.get("x-before"), None);
        let mut appended = lines.clone();
        appended.append(&header::ACCEPT, &HeaderValue::from_static("*/*"));
        let map = appended.to_header_map();
        assert_eq!(map.len(), 2);
        assert_eq!(map[header::ACCEPT], "*/*");
        assert!(HeaderLines::default().is_empty());
    }
}
