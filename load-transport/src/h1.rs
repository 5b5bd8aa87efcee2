//! The router's HTTP/1.1 client to the workers: a pool of kept-alive
//! connections per worker, and a response body read straight from the
//! worker's socket by whoever polls it. The router forwards generation
//! requests with it, and every HTTP load source polls with it
//! ([`ReportClient`](crate::http::ReportClient)).
//!
//! hyper's pooled client runs every upstream connection in a task of its
//! own and hands each decoded body chunk to the response body through a
//! channel of one slot: an SSE event costs a task wake each way, and a
//! request a dispatch message, a pool checkout keyed by scheme and
//! authority, and a oneshot back. Here the task that sends the request
//! does it all itself, as nginx's one event loop does: it writes the
//! request head and body with one vectored write, reads and parses the
//! head, and its [`WorkerBody`] reads the socket when it is asked for the
//! next frame. Each read returns every whole chunk that arrived as one
//! piece, so a burst of events costs one read and one write to the client,
//! and an event that arrives alone goes out at once. A writer that frames
//! a chunked HTTP/1.1 answer itself may take the chunks as the worker
//! framed them ([`WorkerBody::poll_piece`] with `relay`), neither copying
//! their data together nor framing them again.
//!
//! The control plane (health checks, probes, `/v1/models`) stays on
//! hyper's client ([`pooled_client`](crate::http::pooled_client)).
//!
//! ```no_run
//! use std::sync::Arc;
//! use std::time::Duration;
//!
//! use bytes::Bytes;
//! use http::Method;
//! use http_body_util::BodyExt;
//! use load_transport::h1::{self, HeaderLines, Outgoing, Pool};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = Arc::new(Pool::new("http://10.0.0.3:8000"));
//! let body = Bytes::new();
//! let request = Outgoing {
//!     method: &Method::GET,
//!     path: "/v1/loads",
//!     query: None,
//!     headers: &HeaderLines::default(),
//!     authorization: None,
//!     body: &body,
//! };
//! let response = h1::send(&pool, &request, Duration::from_secs(1)).await?;
//! assert!(response.status.is_success());
//! // Read to its end, the connection goes back to the pool for the next one.
//! let _report = response.body.collect().await?.to_bytes();
//! # Ok(())
//! # }
//! ```

use std::io::IoSlice;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use http::header::HeaderName;
use http::{HeaderMap, HeaderValue, Method, StatusCode};
use http_body::{Body, Frame, SizeHint};
use parking_lot::Mutex;
use tokio::io::AsyncWrite;
use tokio::net::TcpStream;

/// How long an idle connection stays in the pool: as long as hyper's client
/// kept one.
const IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// Most idle connections a worker keeps.
const MAX_IDLE_PER_WORKER: usize = 1024;
/// Most bytes of a response head.
const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Most headers of a response head.
const MAX_HEADERS: usize = 100;
/// Room made in the read buffer when under half of it is free
/// ([`make_read_room`]).
const READ_RESERVE: usize = 16 * 1024;
/// A connection whose buffer grew past this goes back to the pool with a
/// fresh one.
const MAX_POOLED_BUFFER: usize = 256 * 1024;
/// Most slices handed to one vectored write (the kernel takes up to 1024).
const MAX_WRITE_SLICES: usize = 32;
/// Most bytes of a chunk-size line (with extensions) or a trailer line.
const MAX_LINE_BYTES: usize = 4 * 1024;
/// Most hex digits of a chunk size (60 bits).
const MAX_SIZE_DIGITS: usize = 15;

/// Why a request got no response head.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    #[error("cannot connect to {address}")]
    Connect {
        address: String,
        #[source]
        source: std::io::Error,
    },
    #[error("connecting to {address} took longer than {timeout:?}")]
    ConnectTimeout { address: String, timeout: Duration },
    #[error("the request could not be written")]
    Write(#[source] std::io::Error),
    #[error("the connection closed before any answer")]
    ClosedBeforeAnswer,
    #[error("the connection broke before the response head ended")]
    Read(#[source] std::io::Error),
    #[error("the response head is malformed: {0}")]
    BadHead(String),
}

/// Why a response body ended early.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("the connection broke")]
    Io(#[from] std::io::Error),
    #[error("the connection closed before the body ended")]
    Closed,
    #[error("the chunked body is malformed: {0}")]
    BadChunk(&'static str),
}

/// Where a worker is, split once: what every request to it reuses.
#[derive(Debug)]
pub struct Target {
    /// `host` and `port` to connect to (an IPv6 literal without brackets).
    host: String,
    port: u16,
    /// The `Host` header: the URL's authority.
    host_header: HeaderValue,
    /// A path the worker sits behind (`/engine-a`), without a trailing
    /// slash; usually empty.
    path_prefix: String,
}

impl Target {
    /// `None` unless `url` is `http://host[:port][/prefix]`.
    pub fn parse(url: &str) -> Option<Target> {
        let uri: http::Uri = url.parse().ok()?;
        if uri.scheme() != Some(&http::uri::Scheme::HTTP) {
            return None;
        }
        let authority = uri.authority()?;
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        Some(Target {
            host,
            port: authority.port_u16().unwrap_or(80),
            host_header: HeaderValue::from_str(authority.as_str()).ok()?,
            path_prefix: uri.path().trim_end_matches('/').to_owned(),
        })
    }
}

/// One worker's kept-alive connections, most recently used first out.
#[derive(Debug)]
pub struct Pool {
    target: Option<Target>,
    idle: Mutex<Vec<Idle>>,
}

#[derive(Debug)]
struct Idle {
    connection: Connection,
    /// When its last request was sent: its idle time is counted from
    /// then, which overstates it by that answer's length, so a connection
    /// whose answer outlasted [`IDLE_TIMEOUT`] is closed rather than
    /// reused. That costs a connect after such an answer, and saves a
    /// clock read on every request.
    since: Instant,
}

/// A connection and its read buffer, which may hold the start of what
/// follows (never, between requests, since a pooled connection had read
/// exactly its answers).
#[derive(Debug)]
struct Connection {
    stream: TcpStream,
    buffer: BytesMut,
    /// The request head, built here to reuse its allocation.
    head: Vec<u8>,
    /// When the request it carries was sent ([`Idle::since`]).
    sent_at: Instant,
}

impl Pool {
    /// The pool of the worker at `url`; requests through it fail if the URL
    /// is not `http://host[:port][/prefix]`.
    pub fn new(url: &str) -> Pool {
        Pool {
            target: Target::parse(url),
            idle: Mutex::new(Vec::new()),
        }
    }

    /// Whether requests can be made at all (the URL parsed).
    pub fn is_usable(&self) -> bool {
        self.target.is_some()
    }

    fn checkout(&self, now: Instant) -> Option<Connection> {
        let mut idle = self.idle.lock();
        while let Some(entry) = idle.pop() {
            if now.saturating_duration_since(entry.since) < IDLE_TIMEOUT {
                return Some(entry.connection);
            }
            // The rest are older still.
            idle.clear();
        }
        None
    }

    fn give_back(&self, mut connection: Connection) {
        if connection.buffer.capacity() > MAX_POOLED_BUFFER {
            connection.buffer = BytesMut::new();
        }
        let mut idle = self.idle.lock();
        if idle.len() < MAX_IDLE_PER_WORKER {
            idle.push(Idle {
                since: connection.sent_at,
                connection,
            });
        }
    }

    /// Idle connections now.
    pub fn idle_count(&self) -> usize {
        self.idle.lock().len()
    }

    async fn connect(
        &self,
        target: &Target,
        timeout: Duration,
        now: Instant,
    ) -> Result<Connection, SendError> {
        let address = || format!("{}:{}", target.host, target.port);
        let connect = TcpStream::connect((target.host.as_str(), target.port));
        let stream = match tokio::time::timeout(timeout, connect).await {
            Ok(Ok(stream)) => stream,
            Ok(Err(source)) => {
                return Err(SendError::Connect {
                    address: address(),
                    source,
                });
            }
            Err(_elapsed) => {
                return Err(SendError::ConnectTimeout {
                    address: address(),
                    timeout,
                });
            }
        };
        // Requests and events are small writes: no Nagle delay.
        let _ = stream.set_nodelay(true);
        Ok(Connection {
            stream,
            buffer: BytesMut::new(),
            head: Vec::new(),
            sent_at: now,
        })
    }
}

/// What a request to a worker is: the client's method, path, query,
/// headers (hop-by-hop ones already left out) and whole body.
#[derive(Debug, Clone, Copy)]
pub struct Outgoing<'a> {
    pub method: &'a Method,
    pub path: &'a str,
    pub query: Option<&'a str>,
    pub headers: &'a HeaderLines,
    /// Replaces the client's `Authorization` (the worker's own key).
    pub authorization: Option<&'a HeaderValue>,
    pub body: &'a Bytes,
}

/// Headers that describe one hop, never forwarded (RFC 9110 §7.6.1).
pub const HOP_BY_HOP: [&str; 9] = [
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
pub fn is_forwarded(name: &[u8], listed: &[&[u8]]) -> bool {
    !(is_never_forwarded(name)
        || listed
            .iter()
            .any(|listed| listed.eq_ignore_ascii_case(name)))
}

/// Whether `name` is left out whatever `Connection` lists.
/// ([`HOP_BY_HOP`], `Host` and `Content-Length`: chosen by length first,
/// since every header of every request and answer is asked.)
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

fn write_head(head: &mut Vec<u8>, target: &Target, request: &Outgoing<'_>) {
    head.clear();
    head.extend_from_slice(request.method.as_str().as_bytes());
    head.push(b' ');
    head.extend_from_slice(target.path_prefix.as_bytes());
    head.extend_from_slice(request.path.as_bytes());
    if let Some(query) = request.query {
        head.push(b'?');
        head.extend_from_slice(query.as_bytes());
    }
    head.extend_from_slice(b" HTTP/1.1\r\nhost: ");
    head.extend_from_slice(target.host_header.as_bytes());
    head.extend_from_slice(b"\r\n");
    match request.authorization {
        None => head.extend_from_slice(request.headers.as_wire()),
        Some(authorization) => {
            // The worker's key replaces the client's.
            for line in request.headers.lines() {
                if !line.name().eq_ignore_ascii_case(b"authorization") {
                    head.extend_from_slice(line.as_wire());
                }
            }
            head.extend_from_slice(b"authorization: ");
            head.extend_from_slice(authorization.as_bytes());
            head.extend_from_slice(b"\r\n");
        }
    }
    head.extend_from_slice(b"content-length: ");
    head.extend_from_slice(itoa::Buffer::new().format(request.body.len()).as_bytes());
    head.extend_from_slice(b"\r\n\r\n");
}

/// A worker's response head, and its body to read.
#[derive(Debug)]
pub struct Response {
    pub status: StatusCode,
    /// The worker's headers, hop-by-hop ones and `Content-Length` left out.
    pub headers: HeaderLines,
    pub body: WorkerBody,
}

/// Headers as they go on to the next hop: the lines as the last one wrote
/// them (`name: value\r\n`, each name in its case), less those
/// [`is_forwarded`] leaves out. An HTTP/1.1 writer copies them as they
/// are, so a proxied head builds no [`HeaderMap`] either way; one is built
/// only when asked for ([`to_header_map`](Self::to_header_map)).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeaderLines {
    /// Each name and value passed httparse's checks (or came from a
    /// [`HeaderMap`]), so each line is one header a map would take too.
    lines: Vec<u8>,
}

/// One line of [`HeaderLines`].
#[derive(Debug, Clone, Copy)]
pub struct HeaderLine<'a> {
    /// The whole line, CRLF included.
    wire: &'a [u8],
    colon: usize,
}

impl<'a> HeaderLine<'a> {
    pub fn name(&self) -> &'a [u8] {
        &self.wire[..self.colon]
    }

    pub fn value(&self) -> &'a [u8] {
        &self.wire[self.colon + 2..self.wire.len() - 2]
    }

    /// The line as written, CRLF included.
    pub fn as_wire(&self) -> &'a [u8] {
        self.wire
    }
}

impl HeaderLines {
    /// The headers `fields` gives (name, value; it is called twice) that
    /// go on to the next hop: hop-by-hop ones, those `Connection` lists
    /// (wherever it stands), `Host` and `Content-Length` are left out.
    pub fn forwarded<'f, I>(fields: impl Fn() -> I) -> HeaderLines
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

    /// The headers of `map` that go on to the next hop, as
    /// [`forwarded`](Self::forwarded) chooses them.
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

    pub fn is_empty(&self) -> bool {
        self.lines.is_empty()
    }

    /// Each header line, in order.
    pub fn lines(&self) -> impl Iterator<Item = HeaderLine<'_>> {
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

/// Sends `request` to the pool's worker and reads the response head: on a
/// kept-alive connection if one is idle, else a new one (connected within
/// `connect_timeout`). A kept-alive connection the worker closed meanwhile
/// (it answers nothing at all) is replaced by a new one once, as hyper's
/// client does: nothing reached the worker's application.
pub async fn send(
    pool: &std::sync::Arc<Pool>,
    request: &Outgoing<'_>,
    connect_timeout: Duration,
) -> Result<Response, SendError> {
    send_at(pool, request, connect_timeout, Instant::now()).await
}

/// [`send`] for a caller that has just read the clock: `now` is when the
/// request goes out, which the pool also counts idle time from.
pub async fn send_at(
    pool: &std::sync::Arc<Pool>,
    request: &Outgoing<'_>,
    connect_timeout: Duration,
    now: Instant,
) -> Result<Response, SendError> {
    let Some(target) = pool.target.as_ref() else {
        return Err(SendError::BadHead(
            "the worker's URL is not http://host:port".into(),
        ));
    };
    if let Some(mut connection) = pool.checkout(now) {
        connection.sent_at = now;
        match exchange(connection, target, request).await {
            Err(SendError::ClosedBeforeAnswer | SendError::Write(_)) => {}
            answered => return answered.map(|head| head.into_response(pool)),
        }
    }
    let connection = pool.connect(target, connect_timeout, now).await?;
    exchange(connection, target, request)
        .await
        .map(|head| head.into_response(pool))
}

/// A parsed head and the connection, its buffer past the head.
struct Head {
    status: StatusCode,
    headers: HeaderLines,
    framing: Framing,
    reusable: bool,
    connection: Connection,
}

impl Head {
    fn into_response(self, pool: &std::sync::Arc<Pool>) -> Response {
        Response {
            status: self.status,
            headers: self.headers,
            body: WorkerBody {
                connection: Some(self.connection),
                pool: pool.clone(),
                framing: self.framing,
                reusable: self.reusable,
                ended: false,
            },
        }
    }
}

async fn exchange(
    mut connection: Connection,
    target: &Target,
    request: &Outgoing<'_>,
) -> Result<Head, SendError> {
    let mut head = std::mem::take(&mut connection.head);
    write_head(&mut head, target, request);
    write_all_vectored(&mut connection.stream, &[&head, request.body])
        .await
        .map_err(SendError::Write)?;
    connection.head = head;
    connection.buffer.clear();
    loop {
        if !connection.buffer.is_empty()
            && let Some(head) = parse_head(&mut connection.buffer)?
        {
            let (status, headers, framing, reusable) = head;
            return Ok(Head {
                status,
                headers,
                framing,
                reusable,
                connection,
            });
        }
        if connection.buffer.len() > MAX_HEAD_BYTES {
            return Err(SendError::BadHead(format!(
                "longer than {MAX_HEAD_BYTES} bytes"
            )));
        }
        make_read_room(&mut connection.buffer, READ_RESERVE);
        let read = std::future::poll_fn(|cx| {
            poll_read_buf(&mut connection.stream, &mut connection.buffer, cx)
        })
        .await;
        match read {
            Ok(0) if connection.buffer.is_empty() => return Err(SendError::ClosedBeforeAnswer),
            Err(error)
                if connection.buffer.is_empty()
                    && matches!(
                        error.kind(),
                        std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
                    ) =>
            {
                return Err(SendError::ClosedBeforeAnswer);
            }
            Ok(0) => {
                return Err(SendError::Read(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "the connection closed mid-head",
                )));
            }
            Ok(_) => {}
            Err(error) => return Err(SendError::Read(error)),
        }
    }
}

/// Writes `slices` in order, in as few system calls as the socket allows
/// (one, normally).
async fn write_all_vectored(stream: &mut TcpStream, slices: &[&[u8]]) -> std::io::Result<()> {
    // The slice being written, and how much of it is out.
    let mut index = 0usize;
    let mut offset = 0usize;
    while index < slices.len() {
        if offset == slices[index].len() {
            index += 1;
            offset = 0;
            continue;
        }
        let n = std::future::poll_fn(|cx| {
            let mut vectored = [IoSlice::new(&[]); MAX_WRITE_SLICES];
            let rest = &slices[index..];
            vectored[0] = IoSlice::new(&rest[0][offset..]);
            for (slot, slice) in vectored.iter_mut().zip(rest).skip(1) {
                *slot = IoSlice::new(slice);
            }
            Pin::new(&mut *stream)
                .poll_write_vectored(cx, &vectored[..rest.len().min(MAX_WRITE_SLICES)])
        })
        .await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        // Step past what went out.
        let mut left = n;
        while left > 0 && index < slices.len() {
            let here = slices[index].len() - offset;
            if left < here {
                offset += left;
                left = 0;
            } else {
                left -= here;
                index += 1;
                offset = 0;
            }
        }
    }
    Ok(())
}

/// Makes room in `buffer` for a read of up to `room_bytes`, unless half of
/// that is free already. What was read before it (a request body, a frame
/// still being sent) keeps the buffer's allocation shared, so reserving
/// the whole room whenever a byte of it was used would move the buffer to
/// a new allocation on every request.
fn make_read_room(buffer: &mut BytesMut, room_bytes: usize) {
    if buffer.capacity() - buffer.len() < room_bytes / 2 {
        buffer.reserve(room_bytes);
    }
}

/// Reads what the socket has into the buffer's spare room. tokio marks the
/// socket drained when a read fills less than the room offered, so the
/// next poll waits for readiness without another system call.
fn poll_read_buf(
    stream: &mut TcpStream,
    buffer: &mut BytesMut,
    cx: &mut Context<'_>,
) -> Poll<std::io::Result<usize>> {
    tokio_util::io::poll_read_buf(Pin::new(stream), cx, buffer)
}

type ParsedHead = (StatusCode, HeaderLines, Framing, bool);

/// Parses a whole response head at the start of `buffer` and removes it;
/// `None` while it is incomplete. Informational (1xx) heads are skipped.
fn parse_head(buffer: &mut BytesMut) -> Result<Option<ParsedHead>, SendError> {
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
                return Err(SendError::BadHead("an upgrade was not asked for".into()));
            }
            buffer.advance(head_len);
            continue;
        }
        let http10 = response.version == Some(0);
        // The framing and `Connection` first: the names `Connection` lists
        // are not forwarded, wherever they stand.
        let mut chunked = false;
        let mut length: Option<u64> = None;
        let mut close = http10;
        let mut keep_alive = false;
        for header in response.headers.iter() {
            let (name, value) = (header.name, header.value);
            if name.eq_ignore_ascii_case("transfer-encoding") {
                // Chunked must be the last coding; anything else is read to
                // the close.
                chunked = value
                    .rsplit(|byte| *byte == b',')
                    .next()
                    .is_some_and(|last| last.trim_ascii().eq_ignore_ascii_case(b"chunked"));
                if !chunked {
                    close = true;
                }
            } else if name.eq_ignore_ascii_case("content-length") {
                let parsed = std::str::from_utf8(value)
                    .ok()
                    .and_then(|text| text.trim().parse::<u64>().ok())
                    .ok_or_else(|| SendError::BadHead("content-length".into()))?;
                if length.is_some_and(|earlier| earlier != parsed) {
                    return Err(SendError::BadHead("conflicting content-length".into()));
                }
                length = Some(parsed);
            } else if name.eq_ignore_ascii_case("connection") {
                for token in value.split(|byte| *byte == b',') {
                    let token = token.trim_ascii();
                    if token.eq_ignore_ascii_case(b"close") {
                        close = true;
                    } else if token.eq_ignore_ascii_case(b"keep-alive") {
                        keep_alive = true;
                    }
                }
            }
        }
        if http10 && keep_alive {
            close = false;
        }
        let framing = if status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED {
            Framing::Done
        } else if chunked {
            Framing::Chunked(Chunked::Size)
        } else if close && length.is_none() {
            Framing::UntilClose
        } else {
            match length {
                Some(0) => Framing::Done,
                Some(remaining) => Framing::Length { remaining },
                None => {
                    close = true;
                    Framing::UntilClose
                }
            }
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
        return Ok(Some((status, forwarded, framing, !close)));
    }
}

/// How a response body's end is known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    Length { remaining: u64 },
    Chunked(Chunked),
    UntilClose,
    Done,
}

impl Framing {
    /// What is known of the rest of the body's length.
    fn size_hint(&self) -> SizeHint {
        match self {
            Framing::Length { remaining } => SizeHint::with_exact(*remaining),
            Framing::Done => SizeHint::with_exact(0),
            Framing::Chunked(_) | Framing::UntilClose => SizeHint::default(),
        }
    }
}

/// Where a chunked body's decoder is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunked {
    /// At a chunk-size line.
    Size,
    /// Inside a chunk's data.
    Data { remaining: u64 },
    /// At the CRLF after a chunk's data.
    DataEnd,
    /// After the last chunk: trailer lines up to an empty one.
    Trailers,
}

/// A worker's response body, read from its connection by whoever polls it.
/// Each frame holds every whole piece of data that had arrived, joined.
/// Once the body has been read to its end the connection goes back to the
/// pool; dropped before that (the client went away, a deadline), it is
/// closed, which tells the worker to stop.
#[derive(Debug)]
pub struct WorkerBody {
    connection: Option<Connection>,
    pool: std::sync::Arc<Pool>,
    framing: Framing,
    reusable: bool,
    ended: bool,
}

impl WorkerBody {
    /// The next piece of the body, reading the socket when the buffer holds
    /// none. With `relay`, whole chunks in plain form come as
    /// [`Piece::Chunks`], framing and all, for a chunked HTTP/1.1 answer to
    /// pass on as they came: no copying their data together, no framing it
    /// again. Everything else (and everything without `relay`) comes as
    /// [`Piece::Data`].
    pub fn poll_piece(
        &mut self,
        cx: &mut Context<'_>,
        relay: bool,
    ) -> Poll<Option<Result<Piece, BodyError>>> {
        loop {
            if self.ended {
                return Poll::Ready(None);
            }
            let piece = match self.next_piece(relay) {
                Ok(piece) => piece,
                Err(error) => {
                    self.ended = true;
                    self.connection = None;
                    return Poll::Ready(Some(Err(error)));
                }
            };
            if self.framing == Framing::Done {
                self.finish();
            }
            if let Some(piece) = piece {
                return Poll::Ready(Some(Ok(piece)));
            }
            if self.ended {
                return Poll::Ready(None);
            }
            let Some(connection) = self.connection.as_mut() else {
                return Poll::Ready(None);
            };
            make_read_room(&mut connection.buffer, READ_RESERVE);
            let read = poll_read_buf(&mut connection.stream, &mut connection.buffer, cx);
            match ready!(read) {
                Ok(0) => {
                    self.connection = None;
                    self.ended = true;
                    if self.framing == Framing::UntilClose {
                        return Poll::Ready(None);
                    }
                    return Poll::Ready(Some(Err(BodyError::Closed)));
                }
                Ok(_) => {}
                Err(error) => {
                    self.ended = true;
                    self.connection = None;
                    return Poll::Ready(Some(Err(BodyError::Io(error))));
                }
            }
        }
    }

    /// Takes a piece from what the buffer holds (none when it holds no
    /// data), moving the framing on.
    fn next_piece(&mut self, relay: bool) -> Result<Option<Piece>, BodyError> {
        let Some(connection) = self.connection.as_mut() else {
            return Ok(None);
        };
        take_piece(&mut self.framing, &mut connection.buffer, relay)
    }

    /// The body was read to its end: the connection goes back to the pool
    /// if it can carry another request.
    fn finish(&mut self) {
        self.ended = true;
        if let Some(connection) = self.connection.take()
            && self.reusable
            && connection.buffer.is_empty()
        {
            self.pool.give_back(connection);
        }
    }
}

/// Takes the body data that `buffer` holds, framed as `framing` says,
/// and moves `framing` on (to `Done` at the body's end): the data
/// (possibly none).
fn decode_body(framing: &mut Framing, buffer: &mut BytesMut) -> Result<Option<Bytes>, BodyError> {
    match framing {
        Framing::Done => Ok(None),
        Framing::UntilClose => Ok((!buffer.is_empty()).then(|| buffer.split().freeze())),
        Framing::Length { remaining } => {
            if buffer.is_empty() {
                return Ok(None);
            }
            let take = usize::try_from(*remaining).map_or(buffer.len(), |r| r.min(buffer.len()));
            *remaining -= take as u64;
            let data = buffer.split_to(take).freeze();
            if *remaining == 0 {
                *framing = Framing::Done;
            }
            Ok(Some(data))
        }
        Framing::Chunked(state) => {
            let data = decode_chunked(buffer, state)?;
            if *state == Chunked::Trailers && trailers_end(buffer)? {
                *framing = Framing::Done;
            }
            Ok(data)
        }
    }
}

/// Takes the next piece of a body framed as `framing` from `buffer` (none
/// when it holds no data), moving `framing` on; see
/// [`WorkerBody::poll_piece`] for `relay`.
fn take_piece(
    framing: &mut Framing,
    buffer: &mut BytesMut,
    relay: bool,
) -> Result<Option<Piece>, BodyError> {
    // Relaying starts only at a chunk boundary, where an answer that framed
    // the data before it is at one too.
    if relay
        && *framing == Framing::Chunked(Chunked::Size)
        && let Some(chunks) = whole_chunks(buffer)
    {
        return Ok(Some(Piece::Chunks(chunks)));
    }
    Ok(decode_body(framing, buffer)?.map(Piece::Data))
}

/// A piece of a worker's body on its way to a client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// Body data, for whoever writes it to frame.
    Data(Bytes),
    /// Whole chunks of a chunked body as the worker sent them, framing
    /// included, each a size line of hex digits and CRLF, the data and
    /// CRLF: a chunked HTTP/1.1 answer passes them on as they are.
    Chunks(Bytes),
}

impl Piece {
    /// The body data the piece carries, in order: for chunks, each one's
    /// data.
    pub fn data_parts(&self) -> DataParts<'_> {
        match self {
            Piece::Data(data) => DataParts {
                rest: data,
                framed: false,
            },
            Piece::Chunks(framed) => DataParts {
                rest: framed,
                framed: true,
            },
        }
    }

    /// The body data, joined (for chunks, copied out of their framing).
    pub fn into_data(self) -> Bytes {
        match self {
            Piece::Data(data) => data,
            Piece::Chunks(ref framed) => {
                let mut data = BytesMut::with_capacity(framed.len());
                for part in self.data_parts() {
                    data.extend_from_slice(part);
                }
                data.freeze()
            }
        }
    }

    /// The piece's length on the wire.
    pub fn len(&self) -> usize {
        match self {
            Piece::Data(bytes) | Piece::Chunks(bytes) => bytes.len(),
        }
    }

    /// Whether it carries no bytes at all.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The body data of a [`Piece`], part by part.
#[derive(Debug, Clone)]
pub struct DataParts<'a> {
    rest: &'a [u8],
    framed: bool,
}

impl<'a> Iterator for DataParts<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        if !self.framed {
            return (!self.rest.is_empty()).then(|| std::mem::take(&mut self.rest));
        }
        // A `Chunks` piece holds whole chunks in plain form only.
        let (size, line) = plain_size_line(self.rest)?;
        let data = self.rest.get(line..line + size)?;
        self.rest = self.rest.get(line + size + 2..).unwrap_or_default();
        Some(data)
    }
}

/// Splits off the whole chunks at the buffer's front whose size line is in
/// plain form (see [`plain_size_line`]) and whose data ends in CRLF,
/// framing and all, without copying. It stops at anything else, which
/// [`decode_chunked`] then reads: a chunk not yet whole (its data goes
/// out as it comes), the last chunk, a size line with extensions, a bare
/// LF. Called at a size line.
fn whole_chunks(buffer: &mut BytesMut) -> Option<Bytes> {
    let mut rest: &[u8] = buffer;
    while let Some((size, line)) = plain_size_line(rest)
        && size > 0
        && let Some(chunk_bytes) = line
            .checked_add(size)
            .and_then(|bytes| bytes.checked_add(2))
        && let Some(chunk) = rest.get(..chunk_bytes)
        && chunk.ends_with(b"\r\n")
    {
        rest = &rest[chunk_bytes..];
    }
    let end = buffer.len() - rest.len();
    (end > 0).then(|| buffer.split_to(end).freeze())
}

/// A chunk-size line in plain form at the front of `bytes`: 1 to 15 hex
/// digits and CRLF, no extensions, spaces or bare LF. The size and the
/// line's length; `None` for anything else, or a line not yet whole.
fn plain_size_line(bytes: &[u8]) -> Option<(usize, usize)> {
    let mut size = 0u64;
    let mut digits = 0;
    while digits <= MAX_SIZE_DIGITS
        && let Some(&byte) = bytes.get(digits)
        && let value = HEX_VALUE[usize::from(byte)]
        && value != NOT_HEX
    {
        size = size << 4 | u64::from(value);
        digits += 1;
    }
    if digits == 0 || digits > MAX_SIZE_DIGITS || bytes.get(digits..digits + 2) != Some(b"\r\n") {
        return None;
    }
    Some((usize::try_from(size).ok()?, digits + 2))
}

/// Not a hex digit, in [`HEX_VALUE`].
const NOT_HEX: u8 = 0xff;

/// Each byte's value as a hex digit, or [`NOT_HEX`]: a size line's digits
/// are read with one load each.
const HEX_VALUE: [u8; 256] = {
    let mut table = [NOT_HEX; 256];
    let mut byte = 0;
    while byte < 256 {
        table[byte] = match byte as u8 {
            digit @ b'0'..=b'9' => digit - b'0',
            digit @ b'a'..=b'f' => digit - b'a' + 10,
            digit @ b'A'..=b'F' => digit - b'A' + 10,
            _ => NOT_HEX,
        };
        byte += 1;
    }
    table
};

/// Decodes the whole chunks (and the part of one) that `buffer` holds into
/// one run of data, moved to the buffer's front and split off; what
/// remains is an incomplete size line or nothing. `None` when no data.
fn decode_chunked(buffer: &mut BytesMut, state: &mut Chunked) -> Result<Option<Bytes>, BodyError> {
    // Data is gathered at `written`; `read` walks the framing.
    let mut written = 0usize;
    let mut read = 0usize;
    loop {
        match *state {
            Chunked::Size => {
                let Some(line_end) = find_line(&buffer[read..])? else {
                    break;
                };
                let line = &buffer[read..read + line_end.content];
                let digits = line
                    .split(|byte| *byte == b';')
                    .next()
                    .map(<[u8]>::trim_ascii)
                    .unwrap_or_default();
                if digits.is_empty() || digits.len() > MAX_SIZE_DIGITS {
                    return Err(BodyError::BadChunk("chunk size"));
                }
                let mut size = 0u64;
                for digit in digits {
                    let value = HEX_VALUE[usize::from(*digit)];
                    if value == NOT_HEX {
                        return Err(BodyError::BadChunk("chunk size"));
                    }
                    size = size << 4 | u64::from(value);
                }
                read += line_end.total;
                *state = if size == 0 {
                    Chunked::Trailers
                } else {
                    Chunked::Data { remaining: size }
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
                let Some(line_end) = find_line(&buffer[read..])? else {
                    break;
                };
                if line_end.content != 0 {
                    return Err(BodyError::BadChunk("no line end after chunk data"));
                }
                read += line_end.total;
                *state = Chunked::Size;
            }
            Chunked::Trailers => break,
        }
    }
    let data = (written > 0).then(|| buffer.split_to(written).freeze());
    buffer.advance(read - written);
    Ok(data)
}

/// Consumes trailer lines at the buffer's front; true once the empty line
/// that ends them (and the body) has been read.
fn trailers_end(buffer: &mut BytesMut) -> Result<bool, BodyError> {
    while let Some(line) = find_line(buffer)? {
        buffer.advance(line.total);
        if line.content == 0 {
            return Ok(true);
        }
    }
    Ok(false)
}

struct LineEnd {
    /// Bytes before the line end.
    content: usize,
    /// Bytes including it (`\r\n`, or a bare `\n`).
    total: usize,
}

fn find_line(bytes: &[u8]) -> Result<Option<LineEnd>, BodyError> {
    match bytes.iter().position(|byte| *byte == b'\n') {
        Some(newline) => {
            let content = if newline > 0 && bytes[newline - 1] == b'\r' {
                newline - 1
            } else {
                newline
            };
            Ok(Some(LineEnd {
                content,
                total: newline + 1,
            }))
        }
        None if bytes.len() > MAX_LINE_BYTES => Err(BodyError::BadChunk("line too long")),
        None => Ok(None),
    }
}

impl Body for WorkerBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        self.get_mut()
            .poll_piece(cx, false)
            .map_ok(|piece| Frame::data(piece.into_data()))
    }

    fn is_end_stream(&self) -> bool {
        self.ended
    }

    fn size_hint(&self) -> SizeHint {
        self.framing.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::header;

    #[test]
    fn read_room_stays_in_a_shared_allocation_while_half_of_it_is_free() {
        let mut buffer = BytesMut::with_capacity(1024);
        buffer.extend_from_slice(&[b'x'; 300]);
        // What was read is handed on and still held, as a request body is.
        let held = buffer.split_to(300).freeze();
        let room_at = buffer.spare_capacity_mut().as_ptr();
        make_read_room(&mut buffer, 1024);
        assert_eq!(
            buffer.capacity(),
            1024 - 300,
            "half the room is free: no move"
        );
        assert_eq!(buffer.spare_capacity_mut().as_ptr(), room_at);

        buffer.extend_from_slice(&[b'y'; 400]);
        make_read_room(&mut buffer, 1024);
        assert!(
            buffer.capacity() - buffer.len() >= 1024,
            "under half free: the whole room"
        );
        assert_eq!(&buffer[..], &[b'y'; 400][..], "what was unread is kept");
        assert_eq!(&held[..], &[b'x'; 300][..]);
    }

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
    fn worker_addresses_are_split_once() {
        let plain = Target::parse("http://10.0.0.1:30000").unwrap();
        assert_eq!((plain.host.as_str(), plain.port), ("10.0.0.1", 30000));
        assert_eq!(plain.host_header, "10.0.0.1:30000");
        assert_eq!(plain.path_prefix, "");
        let prefixed = Target::parse("http://h:8000/engine-a/").unwrap();
        assert_eq!(prefixed.path_prefix, "/engine-a");
        let v6 = Target::parse("http://[::1]:9000").unwrap();
        assert_eq!((v6.host.as_str(), v6.port), ("::1", 9000));
        assert_eq!(Target::parse("http://h").unwrap().port, 80);
        assert!(Target::parse("not a url").is_none());
        assert!(Target::parse("/relative").is_none());
        assert!(Target::parse("https://h:1").is_none(), "no TLS");
    }

    fn head_of(request: &Outgoing<'_>, url: &str) -> String {
        let target = Target::parse(url).unwrap();
        let mut head = Vec::new();
        write_head(&mut head, &target, request);
        String::from_utf8(head).unwrap()
    }

    #[test]
    fn the_request_head_drops_hop_by_hop_headers_and_sets_its_own() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-trace"),
        );
        headers.insert("x-trace", HeaderValue::from_static("1"));
        headers.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        headers.insert(header::HOST, HeaderValue::from_static("router"));
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from_static("99"));
        headers.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer k"));
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        let headers = HeaderLines::forwarded_from_map(&headers);
        let body = Bytes::from_static(b"{}");
        let request = Outgoing {
            method: &Method::POST,
            path: "/v1/chat/completions",
            query: Some("x=1"),
            headers: &headers,
            authorization: None,
            body: &body,
        };
        let head = head_of(&request, "http://w:8000/engine-a");
        assert!(
            head.starts_with("POST /engine-a/v1/chat/completions?x=1 HTTP/1.1\r\nhost: w:8000\r\n"),
            "{head}"
        );
        assert!(head.contains("authorization: Bearer k\r\n"), "{head}");
        assert!(
            head.contains("content-type: application/json\r\n"),
            "{head}"
        );
        assert!(head.ends_with("content-length: 2\r\n\r\n"), "{head}");
        for gone in ["x-trace", "transfer-encoding", "connection", "router", "99"] {
            assert!(!head.contains(gone), "{gone} in {head}");
        }
        // The worker's own key replaces the client's.
        let key = HeaderValue::from_static("Bearer worker");
        let keyed = head_of(
            &Outgoing {
                authorization: Some(&key),
                ..request
            },
            "http://w:8000",
        );
        assert_eq!(keyed.matches("authorization").count(), 1, "{keyed}");
        assert!(
            keyed.contains("authorization: Bearer worker\r\n"),
            "{keyed}"
        );
    }

    fn parse(text: &str) -> Option<ParsedHead> {
        let mut buffer = BytesMut::from(text.as_bytes());
        parse_head(&mut buffer).unwrap()
    }

    #[test]
    fn response_heads_give_status_headers_and_framing() {
        let (status, headers, framing, reusable) = parse(
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\nx-a: 1\r\n\r\n",
        )
        .unwrap();
        assert_eq!(status, StatusCode::OK);
        assert_eq!(framing, Framing::Chunked(Chunked::Size));
        assert!(reusable);
        assert_eq!(
            headers.as_wire(),
            b"content-type: text/event-stream\r\nx-a: 1\r\n",
            "the framing left out, the rest as written"
        );
        assert_eq!(headers.get("X-A"), Some(&b"1"[..]));
        assert_eq!(headers.get("transfer-encoding"), None);

        let (_, headers, framing, reusable) = parse(
            "HTTP/1.1 200 OK\r\ncontent-length: 5\r\nconnection: close, x-b\r\nx-b: 2\r\n\r\n",
        )
        .unwrap();
        assert_eq!(framing, Framing::Length { remaining: 5 });
        assert!(!reusable, "connection: close");
        assert!(headers.is_empty(), "{headers:?}");

        // A listed name is dropped even before `Connection` lists it;
        // names keep the worker's case on the wire, and are lowercased in
        // a map.
        let (_, headers, _, _) = parse(
            "HTTP/1.1 200 OK\r\nX-B: 2\r\nConnection: X-B\r\nX-Keep:  3 \r\nContent-Length: 0\r\n\r\n",
        )
        .unwrap();
        assert_eq!(headers.as_wire(), b"X-Keep: 3\r\n");
        let map = headers.to_header_map();
        assert_eq!(map.len(), 1, "{map:?}");
        assert_eq!(map["x-keep"], "3");

        let (_, _, framing, reusable) = parse("HTTP/1.0 200 OK\r\n\r\n").unwrap();
        assert_eq!(framing, Framing::UntilClose);
        assert!(!reusable);
        let (_, _, framing, _) = parse("HTTP/1.1 204 No Content\r\n\r\n").unwrap();
        assert_eq!(framing, Framing::Done);
        let (status, _, _, _) =
            parse("HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 503 Busy\r\ncontent-length: 0\r\n\r\n")
                .unwrap();
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "1xx skipped");
        assert!(parse("HTTP/1.1 200 OK\r\ncontent-le").is_none(), "partial");
        let mut bad = BytesMut::from(&b"HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n"[..]);
        assert!(parse_head(&mut bad).is_err());
    }

    /// Decodes `wire` fed in the given pieces; every data frame, and
    /// whether the end was found.
    fn decode_pieces(pieces: &[&[u8]]) -> Result<(Vec<String>, bool), BodyError> {
        let mut buffer = BytesMut::new();
        let mut state = Chunked::Size;
        let mut frames = Vec::new();
        let mut ended = false;
        for piece in pieces {
            buffer.extend_from_slice(piece);
            if let Some(data) = decode_chunked(&mut buffer, &mut state)? {
                frames.push(String::from_utf8(data.to_vec()).unwrap_or_default());
            }
            if state == Chunked::Trailers && trailers_end(&mut buffer)? {
                ended = true;
                assert!(buffer.is_empty(), "nothing after the end: {buffer:?}");
            }
        }
        Ok((frames, ended))
    }

    #[test]
    fn chunks_that_arrived_together_are_one_frame() {
        let wire = b"5\r\nhello\r\n1;ext=1\r\n \r\n5\r\nworld\r\n0\r\n\r\n";
        let (frames, ended) = decode_pieces(&[wire]).unwrap();
        assert_eq!(frames, ["hello world"]);
        assert!(ended);
    }

    #[test]
    fn every_split_of_a_chunked_body_gives_the_same_bytes() {
        let wire = b"5\r\nhello\r\nA\r\n0123456789\r\n0\r\nx-trailer: 1\r\n\r\n";
        for split in 0..=wire.len() {
            let (head, tail) = wire.split_at(split);
            let (frames, ended) = decode_pieces(&[head, tail]).unwrap();
            assert_eq!(frames.concat(), "hello0123456789", "split at {split}");
            assert!(ended, "split at {split}");
        }
        let bytewise: Vec<&[u8]> = wire.chunks(1).collect();
        let (frames, ended) = decode_pieces(&bytewise).unwrap();
        assert_eq!(frames.concat(), "hello0123456789");
        assert!(ended);
    }

    /// Relays `wire` fed in the given pieces, as the router's HTTP/1.1
    /// server writes it: chunks as they came, data framed as a chunk of its
    /// own, and the last chunk. The client's wire, and whether the end was
    /// found.
    fn relay_pieces(pieces: &[&[u8]]) -> Result<(Vec<u8>, bool), BodyError> {
        let mut buffer = BytesMut::new();
        let mut framing = Framing::Chunked(Chunked::Size);
        let mut client = Vec::new();
        for piece in pieces {
            buffer.extend_from_slice(piece);
            while let Some(piece) = take_piece(&mut framing, &mut buffer, true)? {
                match piece {
                    Piece::Chunks(chunks) => client.extend_from_slice(&chunks),
                    Piece::Data(data) => {
                        client.extend_from_slice(format!("{:x}\r\n", data.len()).as_bytes());
                        client.extend_from_slice(&data);
                        client.extend_from_slice(b"\r\n");
                    }
                }
            }
        }
        let ended = framing == Framing::Done;
        if ended {
            assert!(buffer.is_empty(), "nothing after the end: {buffer:?}");
            client.extend_from_slice(b"0\r\n\r\n");
        }
        Ok((client, ended))
    }

    #[test]
    fn whole_plain_chunks_are_relayed_as_they_came() {
        let chunks = b"5\r\nhello\r\n1\r\n \r\nA\r\n0123456789\r\n";
        let wire = [&chunks[..], b"0\r\nx-trailer: 1\r\n\r\n"].concat();
        let mut buffer = BytesMut::from(&wire[..]);
        let mut framing = Framing::Chunked(Chunked::Size);
        let piece = take_piece(&mut framing, &mut buffer, true).unwrap();
        assert_eq!(piece, Some(Piece::Chunks(Bytes::from_static(chunks))));
        let parts: Vec<&[u8]> = piece.as_ref().unwrap().data_parts().collect();
        assert_eq!(parts, [&b"hello"[..], b" ", b"0123456789"]);
        assert_eq!(piece.unwrap().into_data(), "hello 0123456789");
        // The last chunk and the trailers end the body; they are not relayed.
        assert_eq!(take_piece(&mut framing, &mut buffer, true).unwrap(), None);
        assert_eq!(framing, Framing::Done);
        assert!(buffer.is_empty());
        // Without relay, the same chunks are one run of data.
        let mut buffer = BytesMut::from(&wire[..]);
        let mut framing = Framing::Chunked(Chunked::Size);
        let piece = take_piece(&mut framing, &mut buffer, false).unwrap();
        assert_eq!(
            piece,
            Some(Piece::Data(Bytes::from_static(b"hello 0123456789")))
        );
    }

    #[test]
    fn plain_size_lines_are_hex_digits_and_crlf_only() {
        assert_eq!(plain_size_line(b"1a\r\ndata"), Some((0x1a, 4)));
        assert_eq!(plain_size_line(b"0\r\n"), Some((0, 3)));
        assert_eq!(
            plain_size_line(b"fffffffffffffff\r\n"),
            Some(((1 << 60) - 1, 17))
        );
        for other in [
            &b"1a"[..],
            b"1a\r",
            b"1a\n",
            b"1a \r\n",
            b"1a;x=1\r\n",
            b"\r\n",
            b"0000000000000001\r\n",
            b"g\r\n",
        ] {
            assert_eq!(plain_size_line(other), None, "{other:?}");
        }
    }

    #[test]
    fn every_split_of_a_relayed_body_reaches_the_client_whole() {
        // Plain chunks, then forms that are decoded rather than relayed: an
        // extension, spaces, upper-case hex, a bare LF after the data.
        let wire =
            b"5\r\nhello\r\n3;ext=1\r\nabc\r\nB \r\n0123456789A\r\n2\r\nxy\n1\r\nz\r\n0\r\n\r\n";
        let data = "helloabc0123456789Axyz";
        let client_data = |client: &[u8]| {
            let (frames, ended) = decode_pieces(&[client]).unwrap();
            assert!(ended);
            frames.concat()
        };
        for split in 0..=wire.len() {
            let (head, tail) = wire.split_at(split);
            let (client, ended) = relay_pieces(&[head, tail]).unwrap();
            assert!(ended, "split at {split}");
            assert_eq!(client_data(&client), data, "split at {split}");
        }
        let bytewise: Vec<&[u8]> = wire.chunks(1).collect();
        let (client, ended) = relay_pieces(&bytewise).unwrap();
        assert!(ended);
        assert_eq!(client_data(&client), data);
        // Whole, the first chunk passes as it came.
        let (client, _) = relay_pieces(&[wire]).unwrap();
        assert!(client.starts_with(b"5\r\nhello\r\n"));
    }

    #[test]
    fn malformed_chunks_are_errors_when_relayed_too() {
        assert!(relay_pieces(&[b"zz\r\n"]).is_err());
        assert!(relay_pieces(&[b"2\r\nabX\r\n"]).is_err());
        assert!(relay_pieces(&[b"1\r\na\r\n2\r\nabXY\r\n"]).is_err());
        assert!(relay_pieces(&[b"1234567890abcdef0\r\n"]).is_err());
        assert!(relay_pieces(&[&[b'1'; MAX_LINE_BYTES + 1]]).is_err());
    }

    #[test]
    fn malformed_chunks_are_errors() {
        assert!(decode_pieces(&[b"zz\r\n"]).is_err());
        assert!(decode_pieces(&[b"2\r\nabX\r\n"]).is_err());
        assert!(decode_pieces(&[&[b'1'; MAX_LINE_BYTES + 1]]).is_err());
    }
}
