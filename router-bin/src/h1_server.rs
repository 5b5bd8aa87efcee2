//! The router's HTTP/1.1 server for the generation routes: the client side
//! of the proxy, as [`load_transport::h1`] is its worker side.
//!
//! hyper's server runs every request through a generic dispatcher: a
//! service future, a response body polled frame by frame behind a trait
//! object of state machines, a flush per frame. Here the connection's own
//! task does what nginx's event loop does: it reads a head, reads the body
//! (under [`crate::client_body`]'s bounds), asks the proxy for the answer,
//! and writes it straight to the socket: a whole answer and its head in one
//! vectored write, a stream in one write per burst of frames (every frame
//! that is ready when the socket is written). While the answer is awaited
//! or streamed the socket is watched: a client that closes its connection
//! drops its request, which closes the worker's connection and stops the
//! generation.
//!
//! Headers pass through as lines ([`h1::HeaderLines`]): the client's go to
//! the worker, and the worker's to the client, as they were written, less
//! the hop-by-hop ones. No `HeaderMap`, `Uri` or request `Parts` is built
//! for a proxied request; hyper's path builds its map from the lines.
//!
//! Only `POST` to one of [`proxy::GENERATE_PATHS`] is served here. A
//! connection whose next request is anything else (`/health`, `/metrics`,
//! the admin API), or that opens with HTTP/2's preface (h2c with prior
//! knowledge), is handed to hyper with the bytes read so far
//! ([`Handoff`]), and stays there.
//!
//! Deadlines: a request head must arrive within `client_header_timeout_ms`
//! of the accept (the first) or of its first byte (later ones); a kept-alive
//! connection with nothing in flight is closed after `keepalive_timeout_ms`.
//! One timer per connection covers both: it is re-armed only when it fires
//! early, so a request costs no timer work.

use std::future::poll_fn;
use std::io;
use std::mem::MaybeUninit;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use http::header;
use http::{HeaderMap, StatusCode};
use http_body::{Body, Frame, SizeHint};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::{Instant, Sleep};

use crate::app::App;
use crate::client_body::{self, read_client_body};
use crate::proxy::{self, Answer, AnswerHeaders};
use load_transport::h1::{self, BodyError, Chunked, Framing, Piece};

/// Most bytes of a request head (nginx's default is 1 KB, growing to four
/// 8 KB buffers; hyper's about 400 KB).
const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Most headers of a request head (hyper's default).
const MAX_HEADERS: usize = 100;
/// Room made in the read buffer when under half of it is free
/// ([`h1::make_read_room`]).
const READ_RESERVE: usize = 8 * 1024;
/// Most bytes of what follows a request (a pipelined one) read while it is
/// served; past this the socket is no longer watched until the answer ends.
const MAX_READ_AHEAD_BYTES: usize = 64 * 1024;
/// Stream frames up to this size are copied into the write buffer beside
/// their chunk framing; larger ones go out as slices of their own.
const COPY_LIMIT_BYTES: usize = 1024;
/// HTTP/2's connection preface: a client with prior knowledge opens with it.
const HTTP2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const CONTINUE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

/// The connection-level deadlines.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Deadlines {
    pub header: std::time::Duration,
    pub keepalive: std::time::Duration,
}

impl Deadlines {
    /// When a connection's one timer looks next, from `now`: at `due` (the
    /// deadline, if any), but no later than the shorter of the two timeouts
    /// from now. Nothing re-arms the timer between its firings, and any
    /// deadline that begins meanwhile (a request ends, a new head's first
    /// byte arrives) lies at least that far past its start, so the timer
    /// fires in time for it and is then re-armed to it exactly.
    pub fn next_check(&self, due: Option<Instant>, now: Instant) -> Instant {
        let bound = now + self.header.min(self.keepalive);
        due.map_or(bound, |due| due.max(now).min(bound))
    }
}

/// A connection that goes on under hyper: its socket, and what was read
/// from it and not yet served (the start of the next request).
#[derive(Debug)]
pub(crate) struct Handoff {
    pub read: Bytes,
    pub stream: TcpStream,
}

/// How [`serve`] ended.
#[derive(Debug)]
pub(crate) enum Served {
    /// The connection is closed (or is to be, once dropped).
    Closed,
    /// Its next request is not one served here.
    Handoff(Handoff),
}

/// A client connection: the socket, what was read from it, and what is
/// being written to it.
struct ClientConnection {
    stream: TcpStream,
    buffer: BytesMut,
    writer: Writer,
}

/// Serves the generation requests of one connection, accepted at
/// `accepted`, until it closes, misses a deadline, the server stops
/// (`stopping` turns true) with it idle, or its next request is for hyper.
pub(crate) async fn serve(
    app: &Arc<App>,
    stream: TcpStream,
    deadlines: Deadlines,
    stopping: &watch::Receiver<bool>,
) -> Served {
    let mut stop_receiver = stopping.clone();
    let mut stop_wait = StopWait {
        wait: pin!(async move {
            let _ = stop_receiver.wait_for(|stopping| *stopping).await;
        }),
        done: false,
    };
    let mut connection = ClientConnection {
        stream,
        buffer: BytesMut::with_capacity(READ_RESERVE),
        writer: Writer::default(),
    };
    let accepted = Instant::now();
    let mut waiting = HeadWait {
        since: accepted,
        first: true,
        started: None,
    };
    let mut timer = pin!(tokio::time::sleep_until(
        waiting.next_check(deadlines, accepted)
    ));
    loop {
        let head = match next_head(
            &mut connection,
            &mut waiting,
            deadlines,
            &mut timer,
            stopping,
            &mut stop_wait,
        )
        .await
        {
            NextHead::Request(head) => head,
            NextHead::Close => return Served::Closed,
            NextHead::Handoff => {
                return Served::Handoff(Handoff {
                    read: connection.buffer.freeze(),
                    stream: connection.stream,
                });
            }
            NextHead::Malformed(status, message) => {
                let answer = Answer::own(proxy::error_response(
                    status,
                    "invalid_request_error",
                    message,
                ));
                if write_answer(&mut connection, answer, false).await == Written::Close {
                    linger(&mut connection).await;
                }
                return Served::Closed;
            }
        };
        let keep_alive = serve_request(app, &mut connection, head, waiting.started, stopping).await;
        if !keep_alive || is_stopping(stopping) {
            return Served::Closed;
        }
        waiting = HeadWait {
            since: Instant::now(),
            first: false,
            started: None,
        };
    }
}

/// Waiting for a request head, for its deadline.
#[derive(Debug, Clone, Copy)]
struct HeadWait {
    /// The accept, or the end of the last response.
    since: Instant,
    /// No request was served yet.
    first: bool,
    /// When the first byte of a later head arrived (bytes read during the
    /// last request do not count: the keep-alive deadline covers them).
    started: Option<Instant>,
}

impl HeadWait {
    /// When the timer looks next ([`Deadlines::next_check`]).
    fn next_check(&self, deadlines: Deadlines, now: Instant) -> Instant {
        deadlines.next_check(Some(self.deadline(deadlines)), now)
    }

    fn deadline(&self, deadlines: Deadlines) -> Instant {
        match self.started {
            Some(started) => started + deadlines.header,
            None if self.first => self.since + deadlines.header,
            None => self.since + deadlines.keepalive,
        }
    }
}

/// What came of waiting for a head.
// Returned once per request and taken apart at once; boxing the head would
// cost the allocation this server exists to save.
#[allow(clippy::large_enum_variant)]
enum NextHead {
    Request(RequestHead),
    Close,
    Handoff,
    Malformed(StatusCode, String),
}

/// Reads until a whole head is buffered (or the connection is done).
async fn next_head(
    connection: &mut ClientConnection,
    waiting: &mut HeadWait,
    deadlines: Deadlines,
    timer: &mut Pin<&mut Sleep>,
    stopping: &watch::Receiver<bool>,
    stop_wait: &mut StopWait<'_, impl Future<Output = ()>>,
) -> NextHead {
    loop {
        if connection.buffer.is_empty() {
            // Nothing to parse.
        } else if waiting.first && preface_pending(&connection.buffer) {
            if connection.buffer.len() >= HTTP2_PREFACE.len() {
                return NextHead::Handoff;
            }
        } else {
            match parse_head(&mut connection.buffer) {
                Ok(Parsed::Request(head)) => return NextHead::Request(head),
                Ok(Parsed::NotHere) => return NextHead::Handoff,
                Ok(Parsed::Partial) => {}
                Err((status, message)) => return NextHead::Malformed(status, message),
            }
        }
        if (stop_wait.done || is_stopping(stopping)) && connection.buffer.is_empty() {
            return NextHead::Close;
        }
        let was_empty = connection.buffer.is_empty();
        h1::make_read_room(&mut connection.buffer, READ_RESERVE);
        tokio::select! {
            biased;
            read = poll_fn(|cx| h1::poll_read_buf(&mut connection.stream, &mut connection.buffer, cx)) => match read {
                Ok(0) | Err(_) => return NextHead::Close,
                Ok(_) => {
                    if was_empty && !waiting.first && waiting.started.is_none() {
                        let now = Instant::now();
                        waiting.started = Some(now);
                        let due = waiting.deadline(deadlines);
                        if timer.deadline() > due {
                            timer.as_mut().reset(due);
                        }
                    }
                }
            },
            () = timer.as_mut() => {
                let now = Instant::now();
                if now >= waiting.deadline(deadlines) {
                    tracing::debug!("closing a client connection: request head late or idle past keepalive_timeout_ms");
                    return NextHead::Close;
                }
                timer.as_mut().reset(waiting.next_check(deadlines, now));
            }
            () = stop_wait.wait.as_mut(), if !stop_wait.done => stop_wait.done = true,
        }
    }
}

/// Whether the server is stopping, or is gone without a word: one atomic
/// load while nothing was sent, where reading the value takes the channel's
/// lock, which every connection shares and every request would touch. A
/// connection never marks a value seen on this receiver (its wait for the
/// stop runs on a clone), so a stop once sent stays visible here.
fn is_stopping(stopping: &watch::Receiver<bool>) -> bool {
    match stopping.has_changed() {
        Ok(false) => false,
        Ok(true) => *stopping.borrow(),
        Err(_closed) => true,
    }
}

/// An idle connection's wait for the server's stop. It is made once per
/// connection, so its place in the channel's list of waiters is taken once,
/// not taken and given up around every request.
struct StopWait<'a, F> {
    wait: Pin<&'a mut F>,
    /// The wait has ended (the stop came, or the server is gone): it is
    /// not polled again.
    done: bool,
}

/// Whether `buffer` is, so far, HTTP/2's preface.
fn preface_pending(buffer: &[u8]) -> bool {
    !buffer.is_empty()
        && HTTP2_PREFACE.starts_with(&buffer[..buffer.len().min(HTTP2_PREFACE.len())])
}

/// A generation request's head, parsed.
#[derive(Debug)]
struct RequestHead {
    client: proxy::ClientHead,
    framing: Framing,
    keep_alive: bool,
    expects_continue: bool,
}

// As `NextHead`.
#[allow(clippy::large_enum_variant)]
enum Parsed {
    Request(RequestHead),
    /// A whole head, of a request not served here; left in the buffer.
    NotHere,
    Partial,
}

type Malformed = (StatusCode, String);

fn malformed(message: impl Into<String>) -> Malformed {
    (StatusCode::BAD_REQUEST, message.into())
}

/// Parses the head at the buffer's front. A generation request's head is
/// taken out of the buffer; any other is left for hyper.
fn parse_head(buffer: &mut BytesMut) -> Result<Parsed, Malformed> {
    // Left uninitialized: httparse writes only the headers it finds.
    let mut headers = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut request = httparse::Request::new(&mut []);
    let head_len = match request.parse_with_uninit_headers(buffer, &mut headers) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) if buffer.len() > MAX_HEAD_BYTES => {
            return Err((
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                format!("the request head exceeds {MAX_HEAD_BYTES} bytes"),
            ));
        }
        Ok(httparse::Status::Partial) => return Ok(Parsed::Partial),
        Err(httparse::Error::TooManyHeaders) => {
            return Err((
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                format!("the request has more than {MAX_HEADERS} headers"),
            ));
        }
        Err(error) => return Err(malformed(format!("malformed request head: {error}"))),
    };
    let (Some(method), Some(target), Some(minor)) = (request.method, request.path, request.version)
    else {
        return Err(malformed("malformed request line"));
    };
    let (path, query) = match target.split_once('?') {
        Some((path, query)) => (path, Some(query)),
        None => (target, None),
    };
    // HTTP/1.0 clients (no chunked answers, keep-alive by request) are
    // rare enough to leave to hyper.
    let path = match proxy::generate_path(path) {
        Some(path) if method == "POST" && minor == 1 => path,
        _ => return Ok(Parsed::NotHere),
    };
    let mut length: Option<u64> = None;
    let mut chunked = false;
    let mut close = false;
    let mut expects_continue = false;
    // httparse checked every name and value; a header is matched by its
    // name in any case.
    for field in request.headers.iter() {
        let (name, value) = (field.name, field.value);
        if name.eq_ignore_ascii_case("content-length") {
            for item in value.split(|byte| *byte == b',') {
                let parsed = std::str::from_utf8(item)
                    .ok()
                    .and_then(|text| text.trim().parse::<u64>().ok())
                    .ok_or_else(|| malformed("invalid content-length"))?;
                if length.is_some_and(|earlier| earlier != parsed) {
                    return Err(malformed("conflicting content-length values"));
                }
                length = Some(parsed);
            }
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            // A request's body length is only known when chunked is the
            // last coding (RFC 9112 §6.3).
            let last = value
                .rsplit(|byte| *byte == b',')
                .next()
                .unwrap_or_default();
            if !last.trim_ascii().eq_ignore_ascii_case(b"chunked") {
                return Err((
                    StatusCode::NOT_IMPLEMENTED,
                    "transfer-encoding other than chunked".to_owned(),
                ));
            }
            chunked = true;
        } else if name.eq_ignore_ascii_case("connection") {
            for token in value.split(|byte| *byte == b',') {
                let token = token.trim_ascii();
                close |= token.eq_ignore_ascii_case(b"close");
            }
        } else if name.eq_ignore_ascii_case("expect") {
            expects_continue = value.trim_ascii().eq_ignore_ascii_case(b"100-continue");
        }
    }
    if chunked && length.is_some() {
        // Both framings at once is how requests are smuggled past proxies.
        return Err(malformed(
            "a request may not carry both transfer-encoding and content-length",
        ));
    }
    // What goes on is copied out, so the read buffer stays the
    // connection's own for the body and the next request.
    let client = proxy::ClientHead {
        path,
        query: query.map(str::to_owned),
        headers: h1::HeaderLines::forwarded(|| {
            request
                .headers
                .iter()
                .map(|field| (field.name, field.value))
        }),
    };
    buffer.advance(head_len);
    let framing = if chunked {
        Framing::Chunked(Chunked::Size)
    } else {
        match length {
            None | Some(0) => Framing::Done,
            Some(remaining) => Framing::Length { remaining },
        }
    };
    Ok(Parsed::Request(RequestHead {
        client,
        framing,
        keep_alive: !close,
        expects_continue,
    }))
}

/// Serves one request whose head was read, and whose first byte arrived at
/// `head_started` if that was noted (a later request on the connection);
/// true if the connection can carry another.
async fn serve_request(
    app: &Arc<App>,
    connection: &mut ClientConnection,
    head: RequestHead,
    head_started: Option<Instant>,
    stopping: &watch::Receiver<bool>,
) -> bool {
    // The clock was read when the head began to arrive; only a first
    // request (or a pipelined one) reads it here.
    let arrived = head_started.unwrap_or_else(Instant::now);
    let server = &app.config.server;
    let RequestHead {
        client,
        framing,
        keep_alive,
        expects_continue,
    } = head;
    if expects_continue && framing != Framing::Done && connection.buffer.is_empty() {
        // The client waits for this before it sends the body.
        if h1::write_all_vectored(&mut connection.stream, &[CONTINUE])
            .await
            .is_err()
        {
            return false;
        }
    }
    let body = ClientBody {
        connection: &mut *connection,
        framing,
    };
    let body = match read_client_body(body, server, arrived).await {
        Ok(body) => body,
        Err(error) => {
            tracing::debug!(%error, "request body not read");
            // Whatever is left of the body is not worth reading.
            let answer = Answer::own(error.response());
            if write_answer(connection, answer, false).await == Written::Close {
                linger(connection).await;
            }
            return false;
        }
    };
    // Pinned here, where it is built: a future passed by value would be
    // copied (kilobytes) into `until_answered`'s state and again into its pin.
    let answer = pin!(proxy::handle_read(app, client, body, arrived, true));
    let Some(answer) = until_answered(connection, answer).await else {
        return false;
    };
    let keep_alive = keep_alive && !is_stopping(stopping);
    write_answer(connection, answer, keep_alive).await == Written::Open
}

/// Awaits `answer` while watching the socket: `None` if the client closed
/// its connection first (the answer, and so its request, is dropped).
async fn until_answered(
    connection: &mut ClientConnection,
    mut answer: Pin<&mut impl Future<Output = Answer>>,
) -> Option<Answer> {
    loop {
        tokio::select! {
            biased;
            answer = answer.as_mut() => return Some(answer),
            open = watch_for_close(&mut connection.stream, &mut connection.buffer), if connection.buffer.len() < MAX_READ_AHEAD_BYTES => {
                if !open {
                    tracing::debug!("the client closed its connection before its answer");
                    return None;
                }
            }
        }
    }
}

/// Waits for the socket to have something: false if the client closed it
/// (or it broke), true if bytes arrived (kept for the next request).
async fn watch_for_close(stream: &mut TcpStream, buffer: &mut BytesMut) -> bool {
    h1::make_read_room(buffer, READ_RESERVE);
    match poll_fn(|cx| h1::poll_read_buf(stream, buffer, cx)).await {
        Ok(0) | Err(_) => false,
        Ok(_) => true,
    }
}

/// Closes after an error answer as nginx's lingering close does: the write
/// side first, then what the client still sends is read and dropped, within
/// [`client_body`]'s discard bounds. Closing with unread bytes would reset
/// the connection, and a reset can destroy the answer before the client
/// reads it.
async fn linger(connection: &mut ClientConnection) {
    let _ = tokio::io::AsyncWriteExt::shutdown(&mut connection.stream).await;
    let drain = async {
        let mut discarded = 0u64;
        while discarded <= client_body::DISCARD_LIMIT_BYTES {
            connection.buffer.clear();
            h1::make_read_room(&mut connection.buffer, READ_RESERVE);
            match poll_fn(|cx| {
                h1::poll_read_buf(&mut connection.stream, &mut connection.buffer, cx)
            })
            .await
            {
                Ok(0) | Err(_) => return,
                Ok(read) => discarded += read as u64,
            }
        }
    };
    let _ = tokio::time::timeout(client_body::DISCARD_TIME, drain).await;
}

/// A request body read from the client's connection.
struct ClientBody<'a> {
    connection: &'a mut ClientConnection,
    framing: Framing,
}

impl Body for ClientBody<'_> {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = &mut *self;
        loop {
            if this.framing == Framing::Done {
                return Poll::Ready(None);
            }
            let connection = &mut *this.connection;
            if let Some(data) = h1::decode_body(&mut this.framing, &mut connection.buffer)? {
                return Poll::Ready(Some(Ok(Frame::data(data))));
            }
            if this.framing == Framing::Done {
                return Poll::Ready(None);
            }
            h1::make_read_room(&mut connection.buffer, READ_RESERVE);
            match std::task::ready!(h1::poll_read_buf(
                &mut connection.stream,
                &mut connection.buffer,
                cx
            )) {
                Ok(0) => return Poll::Ready(Some(Err(BodyError::Closed))),
                Ok(_) => {}
                Err(error) => return Poll::Ready(Some(Err(BodyError::Io(error)))),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.framing == Framing::Done
    }

    fn size_hint(&self) -> SizeHint {
        self.framing.size_hint()
    }
}

/// How an answer's body is framed on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Out {
    /// No body (1xx, 204, 304).
    None,
    Length(u64),
    Chunked,
}

/// How writing an answer ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Written {
    /// Whole, and the connection can carry another request.
    Open,
    /// Whole, and the connection is to close.
    Close,
    /// Not whole: the socket failed, the client left, or the body broke.
    Failed,
}

/// Writes `answer` (head and body) to the client, keeping the connection
/// open after it if `keep_alive`. The body goes out as it comes; the socket
/// is watched meanwhile, and a client that closes drops the body.
async fn write_answer(
    connection: &mut ClientConnection,
    answer: Answer,
    keep_alive: bool,
) -> Written {
    let whole = if keep_alive {
        Written::Open
    } else {
        Written::Close
    };
    let Answer {
        status,
        headers,
        mut body,
    } = answer;
    // An answer of the router's own that says close (a body it did not
    // read) closes.
    let keep_alive = keep_alive && !matches!(&headers, AnswerHeaders::Own(own) if says_close(own));
    let out = if status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        Out::None
    } else {
        match body.size_hint().exact() {
            Some(length) => Out::Length(length),
            None => Out::Chunked,
        }
    };
    let writer = &mut connection.writer;
    write_head(&mut writer.bytes, status, &headers, out, keep_alive);
    if out == Out::None {
        return match writer.flush(&mut connection.stream).await {
            Ok(()) => whole,
            Err(_) => Written::Failed,
        };
    }
    let mut sent: u64 = 0;
    // A chunked answer passes a worker's chunks on as they came.
    let relay = out == Out::Chunked;
    // A piece taken while waiting, to go out first.
    let mut carried: Option<Option<Result<Piece, axum::Error>>> = None;
    loop {
        // Every piece that is ready now goes into one write.
        let ended = loop {
            let polled = match carried.take() {
                Some(piece) => Poll::Ready(piece),
                None => poll_fn(|cx| Poll::Ready(body.poll_piece(cx, relay))).await,
            };
            match polled {
                Poll::Ready(Some(Ok(piece))) => {
                    // Only a chunked answer asks for chunks; any other
                    // gets data, whose length `sent` counts.
                    let piece = match piece {
                        Piece::Chunks(_) if !relay => Piece::Data(piece.into_data()),
                        piece => piece,
                    };
                    sent += piece.len() as u64;
                    writer.piece(piece, out);
                }
                Poll::Ready(Some(Err(error))) => {
                    // What was sent stands; the connection closes without
                    // the body's end, so the client can tell it broke.
                    tracing::debug!(%error, "an answer's body broke off");
                    let _ = writer.flush(&mut connection.stream).await;
                    return Written::Failed;
                }
                Poll::Ready(None) => break true,
                Poll::Pending => break false,
            }
        };
        if ended {
            if let Out::Length(length) = out
                && sent != length
            {
                tracing::debug!(length, sent, "an answer's body did not match its length");
                let _ = writer.flush(&mut connection.stream).await;
                return Written::Failed;
            }
            if out == Out::Chunked {
                writer.bytes.extend_from_slice(b"0\r\n\r\n");
            }
            return match writer.flush(&mut connection.stream).await {
                Ok(()) => whole,
                Err(_) => Written::Failed,
            };
        }
        if writer.flush(&mut connection.stream).await.is_err() {
            return Written::Failed;
        }
        // Nothing ready: wait for the next frame, or for the client to go.
        loop {
            tokio::select! {
                biased;
                piece = poll_fn(|cx| body.poll_piece(cx, relay)) => {
                    carried = Some(piece);
                    break;
                }
                open = watch_for_close(&mut connection.stream, &mut connection.buffer), if connection.buffer.len() < MAX_READ_AHEAD_BYTES => {
                    if !open {
                        tracing::debug!("the client closed its connection during its answer");
                        return Written::Failed;
                    }
                }
            }
        }
    }
}

/// Whether `headers` carry `Connection: close`.
fn says_close(headers: &HeaderMap) -> bool {
    headers.get_all(header::CONNECTION).iter().any(|value| {
        value
            .as_bytes()
            .split(|byte| *byte == b',')
            .any(|token| token.trim_ascii().eq_ignore_ascii_case(b"close"))
    })
}

/// Writes the status line and headers: the answer's own, less those that
/// describe a hop (the framing and `Connection` are this connection's).
fn write_head(
    buffer: &mut Vec<u8>,
    status: StatusCode,
    headers: &AnswerHeaders,
    out: Out,
    keep_alive: bool,
) {
    buffer.extend_from_slice(b"HTTP/1.1 ");
    buffer.extend_from_slice(status.as_str().as_bytes());
    buffer.extend_from_slice(b" ");
    buffer.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
    buffer.extend_from_slice(b"\r\n");
    let dated = match headers {
        // A worker's lines hold no hop-by-hop headers and no framing: they
        // were left out as its head was read.
        AnswerHeaders::Worker(lines) => {
            buffer.extend_from_slice(lines.as_wire());
            lines.get("date").is_some()
        }
        AnswerHeaders::Own(headers) => {
            let mut dated = false;
            for (name, value) in headers {
                // The framing and `Connection` are this connection's own.
                if name == header::CONTENT_LENGTH
                    || name == header::TRANSFER_ENCODING
                    || name == header::CONNECTION
                {
                    continue;
                }
                dated |= name == header::DATE;
                buffer.extend_from_slice(name.as_str().as_bytes());
                buffer.extend_from_slice(b": ");
                buffer.extend_from_slice(value.as_bytes());
                buffer.extend_from_slice(b"\r\n");
            }
            dated
        }
    };
    match out {
        Out::None => {}
        Out::Length(length) => {
            buffer.extend_from_slice(b"content-length: ");
            buffer.extend_from_slice(itoa::Buffer::new().format(length).as_bytes());
            buffer.extend_from_slice(b"\r\n");
        }
        Out::Chunked => buffer.extend_from_slice(b"transfer-encoding: chunked\r\n"),
    }
    if !dated {
        buffer.extend_from_slice(b"date: ");
        http_date(buffer);
        buffer.extend_from_slice(b"\r\n");
    }
    if !keep_alive {
        buffer.extend_from_slice(b"connection: close\r\n");
    }
    buffer.extend_from_slice(b"\r\n");
}

/// The bytes of an answer on their way: the head, the chunk framing and
/// small frames (copied) in `bytes`; larger frames as they came, each with
/// how much of `bytes` goes before it. Kept by the connection, so that its
/// room is reused from answer to answer.
#[derive(Debug, Default)]
struct Writer {
    bytes: Vec<u8>,
    frames: Vec<(usize, Bytes)>,
}

impl Writer {
    /// Adds a piece of the body, framed as `out` says (chunks come
    /// framed: they are asked for only when `out` is chunked).
    fn piece(&mut self, piece: Piece, out: Out) {
        match piece {
            Piece::Chunks(chunks) => self.append(chunks),
            Piece::Data(data) if data.is_empty() => {}
            Piece::Data(data) if out == Out::Chunked => {
                write_hex(&mut self.bytes, data.len());
                self.bytes.extend_from_slice(b"\r\n");
                self.append(data);
                self.bytes.extend_from_slice(b"\r\n");
            }
            Piece::Data(data) => self.append(data),
        }
    }

    /// Adds `bytes` as they are: copied if small, else a slice of their
    /// own.
    fn append(&mut self, bytes: Bytes) {
        if bytes.len() <= COPY_LIMIT_BYTES {
            self.bytes.extend_from_slice(&bytes);
        } else {
            self.frames.push((self.bytes.len(), bytes));
        }
    }

    /// Writes everything gathered, in one system call when the socket
    /// takes it all.
    async fn flush(&mut self, stream: &mut TcpStream) -> io::Result<()> {
        let written = if self.frames.is_empty() {
            h1::write_all_vectored(stream, &[&self.bytes]).await
        } else {
            let mut slices: Vec<&[u8]> = Vec::with_capacity(2 * self.frames.len() + 1);
            let mut start = 0;
            for (end, frame) in &self.frames {
                slices.push(&self.bytes[start..*end]);
                slices.push(frame);
                start = *end;
            }
            slices.push(&self.bytes[start..]);
            h1::write_all_vectored(stream, &slices).await
        };
        self.frames.clear();
        self.bytes.clear();
        written
    }
}

/// Appends `value` in hexadecimal (a chunk's size line).
fn write_hex(buffer: &mut Vec<u8>, value: usize) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut digits = [0u8; 2 * size_of::<usize>()];
    let mut start = digits.len();
    let mut rest = value;
    loop {
        start -= 1;
        digits[start] = DIGITS[rest & 0xf];
        rest >>= 4;
        if rest == 0 {
            break;
        }
    }
    buffer.extend_from_slice(&digits[start..]);
}

/// Appends the current time as an HTTP date (`Tue, 01 Dec 2026 12:00:00
/// GMT`), formatted once a second per thread.
fn http_date(buffer: &mut Vec<u8>) {
    thread_local! {
        static CACHED: std::cell::RefCell<(u64, String)> = const { std::cell::RefCell::new((0, String::new())) };
    }
    let now = std::time::SystemTime::now();
    let second = now
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_secs());
    CACHED.with_borrow_mut(|(cached_second, text)| {
        if *cached_second != second || text.is_empty() {
            *cached_second = second;
            *text = httpdate::fmt_http_date(now);
        }
        buffer.extend_from_slice(text.as_bytes());
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn parsed(text: &str) -> Result<Parsed, Malformed> {
        let mut buffer = BytesMut::from(text.as_bytes());
        parse_head(&mut buffer)
    }

    fn request(text: &str) -> (RequestHead, BytesMut) {
        let mut buffer = BytesMut::from(text.as_bytes());
        match parse_head(&mut buffer) {
            Ok(Parsed::Request(head)) => (head, buffer),
            other => panic!("{text:?} gave {:?}", other.map(|_| "not a request")),
        }
    }

    #[test]
    fn a_generation_head_is_taken_and_the_body_left() {
        let (head, rest) = request(
            "POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\nX-Two: a\r\nX-Two: b\r\n\r\n{}",
        );
        assert_eq!(&rest[..], b"{}");
        assert_eq!(head.client.path, "/v1/chat/completions");
        assert_eq!(head.client.query.as_deref(), Some("x=1"));
        assert_eq!(
            head.client.headers.as_wire(),
            b"X-Two: a\r\nX-Two: b\r\n",
            "both values, as written; host and length are the next hop's own"
        );
        assert_eq!(head.framing, Framing::Length { remaining: 2 });
        assert!(head.keep_alive);
        assert!(!head.expects_continue);
    }

    #[test]
    fn framing_and_connection_are_read_from_the_head() {
        let (head, _) = request(
            "POST /generate HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\nConnection: keep-alive, close\r\nExpect: 100-Continue\r\n\r\n",
        );
        assert_eq!(head.framing, Framing::Chunked(Chunked::Size));
        assert!(!head.keep_alive);
        assert!(head.expects_continue);
        let (head, _) = request("POST /v1/completions HTTP/1.1\r\nContent-Length: 3, 3\r\n\r\n");
        assert_eq!(head.framing, Framing::Length { remaining: 3 });
        let (head, _) = request("POST /v1/completions HTTP/1.1\r\n\r\n");
        assert_eq!(head.framing, Framing::Done);
    }

    #[test]
    fn other_requests_are_left_whole_for_hyper() {
        for text in [
            "GET /health HTTP/1.1\r\n\r\n",
            "GET /v1/chat/completions HTTP/1.1\r\n\r\n",
            "POST /admin/workers HTTP/1.1\r\n\r\n",
            "POST /v1/chat/completions HTTP/1.0\r\n\r\n",
            "POST http://router/v1/chat/completions HTTP/1.1\r\n\r\n",
        ] {
            let mut buffer = BytesMut::from(text.as_bytes());
            assert!(
                matches!(parse_head(&mut buffer), Ok(Parsed::NotHere)),
                "{text}"
            );
            assert_eq!(&buffer[..], text.as_bytes(), "left in the buffer");
        }
    }

    #[test]
    fn incomplete_heads_wait_and_bad_ones_are_refused() {
        assert!(matches!(
            parsed("POST /generate HTTP/1.1\r\nHost: r"),
            Ok(Parsed::Partial)
        ));
        let refused = |text: &str| match parsed(text) {
            Err((status, _)) => status.as_u16(),
            Ok(_) => 0,
        };
        assert_eq!(
            refused("POST /generate HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n"),
            400
        );
        assert_eq!(
            refused(
                "POST /generate HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n"
            ),
            400
        );
        assert_eq!(
            refused("POST /generate HTTP/1.1\r\nContent-Length: x\r\n\r\n"),
            400
        );
        assert_eq!(
            refused("POST /generate HTTP/1.1\r\nContent-Length: 1,\r\n\r\n"),
            400
        );
        assert_eq!(
            refused("POST /generate HTTP/1.1\r\nTransfer-Encoding: chunked, gzip\r\n\r\n"),
            501
        );
        assert_eq!(
            refused("POST /generate HTTP/1.1\r\nBad Header\r\n\r\n"),
            400
        );
        assert_eq!(refused("\u{0}\u{1}\r\n\r\n"), 400);
        let long = format!(
            "POST /generate HTTP/1.1\r\nX: {}",
            "a".repeat(MAX_HEAD_BYTES)
        );
        assert_eq!(refused(&long), 431);
        let many = format!(
            "POST /generate HTTP/1.1\r\n{}\r\n",
            "A: b\r\n".repeat(MAX_HEADERS + 1)
        );
        assert_eq!(refused(&many), 431);
    }

    #[test]
    fn the_timer_looks_in_time_for_every_deadline() {
        let ms = std::time::Duration::from_millis;
        let deadlines = Deadlines {
            header: ms(60_000),
            keepalive: ms(300),
        };
        let start = Instant::now();
        let first = HeadWait {
            since: start,
            first: true,
            started: None,
        };
        assert_eq!(first.deadline(deadlines), start + ms(60_000));
        assert_eq!(
            first.next_check(deadlines, start),
            start + ms(300),
            "no later than the shorter timeout: a keep-alive deadline may follow"
        );
        let idle = HeadWait {
            since: start + ms(1000),
            first: false,
            started: None,
        };
        assert_eq!(idle.deadline(deadlines), start + ms(1300));
        assert_eq!(
            idle.next_check(deadlines, start + ms(1100)),
            start + ms(1300)
        );
        assert_eq!(
            idle.next_check(deadlines, start + ms(1400)),
            start + ms(1400),
            "a deadline already past is looked at now"
        );
        let begun = HeadWait {
            started: Some(start + ms(1200)),
            ..idle
        };
        assert_eq!(begun.deadline(deadlines), start + ms(61_200));
        assert_eq!(
            begun.next_check(deadlines, start + ms(1250)),
            start + ms(1550)
        );
    }

    #[test]
    fn only_the_http2_preface_is_taken_for_it() {
        assert!(preface_pending(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"));
        assert!(preface_pending(b"PR"));
        assert!(!preface_pending(b"POST /generate"));
        assert!(!preface_pending(b""));
    }

    #[test]
    fn heads_carry_the_framing_and_leave_hop_headers_out() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from_static("99"));
        headers.insert(header::CONNECTION, HeaderValue::from_static("keep-alive"));
        headers.insert(
            header::DATE,
            HeaderValue::from_static("Tue, 01 Dec 2026 00:00:00 GMT"),
        );
        let mut buffer = Vec::new();
        write_head(
            &mut buffer,
            StatusCode::OK,
            &AnswerHeaders::Own(headers),
            Out::Length(12345),
            true,
        );
        let text = String::from_utf8(buffer).unwrap();
        assert_eq!(
            text,
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ndate: Tue, 01 Dec 2026 00:00:00 GMT\r\ncontent-length: 12345\r\n\r\n"
        );
        let mut buffer = Vec::new();
        write_head(
            &mut buffer,
            StatusCode::BAD_GATEWAY,
            &AnswerHeaders::Own(HeaderMap::new()),
            Out::Chunked,
            false,
        );
        let text = String::from_utf8(buffer).unwrap();
        assert!(
            text.starts_with("HTTP/1.1 502 Bad Gateway\r\ntransfer-encoding: chunked\r\ndate: "),
            "{text}"
        );
        assert!(
            text.ends_with(" GMT\r\nconnection: close\r\n\r\n"),
            "{text}"
        );

        // A worker's lines go out as they are; its date is not doubled.
        let mut lines = h1::HeaderLines::default();
        lines.append(
            &header::CONTENT_TYPE,
            &HeaderValue::from_static("application/json"),
        );
        lines.append(
            &header::DATE,
            &HeaderValue::from_static("Tue, 01 Dec 2026 00:00:00 GMT"),
        );
        let mut buffer = Vec::new();
        write_head(
            &mut buffer,
            StatusCode::OK,
            &AnswerHeaders::Worker(lines),
            Out::Length(2),
            true,
        );
        assert_eq!(
            String::from_utf8(buffer).unwrap(),
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ndate: Tue, 01 Dec 2026 00:00:00 GMT\r\ncontent-length: 2\r\n\r\n"
        );
    }

    #[test]
    fn data_is_chunked_with_hex_sizes_and_chunks_pass_as_they_are() {
        let data = |bytes: &'static [u8]| Piece::Data(Bytes::from_static(bytes));
        let mut writer = Writer::default();
        writer.piece(data(b"hello"), Out::Chunked);
        writer.piece(data(b""), Out::Chunked);
        writer.piece(Piece::Data(Bytes::from(vec![b'x'; 0x1a2b])), Out::Chunked);
        writer.piece(data(b"!"), Out::Chunked);
        writer.piece(
            Piece::Chunks(Bytes::from_static(b"2\r\nab\r\n")),
            Out::Chunked,
        );
        assert_eq!(writer.frames.len(), 1, "a large frame is not copied");
        let (before, frame) = &writer.frames[0];
        assert_eq!(&writer.bytes[..*before], b"5\r\nhello\r\n1a2b\r\n");
        assert_eq!(frame.len(), 0x1a2b);
        assert_eq!(&writer.bytes[*before..], b"\r\n1\r\n!\r\n2\r\nab\r\n");
        let mut whole = Writer::default();
        whole.piece(data(b"{}"), Out::Length(2));
        assert_eq!(&whole.bytes[..], b"{}");
        assert!(whole.frames.is_empty());
        for value in [0usize, 9, 10, 255, 4096, usize::MAX] {
            let mut buffer = Vec::new();
            write_hex(&mut buffer, value);
            assert_eq!(String::from_utf8(buffer).unwrap(), format!("{value:x}"));
        }
    }
}
