//! This crate's client and hyper's, given the same responses: generated
//! ones (status, headers, a body framed by `Content-Length`, by `chunked`
//! with random chunk splits, extensions and trailers, or by the
//! connection's close), each sent in random pieces over a loopback socket,
//! some broken in one way (a bad hex digit, a bare LF, no CRLF after chunk
//! data, a sign in `Content-Length`, two lengths, whitespace before a
//! colon, obs-fold, a body cut short, …), or bent in a way both read
//! (whitespace at the end of a chunk-size line). Each client reads the whole
//! body; both must give the same status and the same body bytes, or both
//! refuse it at the same point (its head, or its body).
//!
//! hyper's client is `hyper::client::conn::http1` on a fresh connection:
//! the decoder its pooled client uses too.
//!
//! Where this client is stricter than hyper's by design, the case says
//! so ([`Expected::H1Stricter`]), and the test asserts that this client
//! refuses it and hyper's reads it:
//!
//! - a malformed chunk extension (`;a b`, `;=x`): hyper skips anything up
//!   to the CR; this client checks the `chunk-ext` grammar;
//! - `Transfer-Encoding: chunked` beside a `Content-Length`: hyper lets
//!   the transfer coding win (RFC 9112 §6.3 rule 3); this client refuses
//!   the head, as the same rule allows;
//! - a transfer coding besides `chunked` (`gzip, chunked`, `gzip`): hyper
//!   decodes the chunks and hands on the gzip bytes, or reads to the
//!   close; this client decodes no other coding, and refuses the head.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, header};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use proptest::prelude::*;
use proptest::sample::select;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use worker_h1::{HeaderLines, Outgoing, Pool};

/// A place in something of any length: `Pick(p).index(n)` is in `0..n`
/// (0 for an empty one).
#[derive(Debug, Clone, Copy)]
struct Pick(u16);

impl Pick {
    fn index(self, size: usize) -> usize {
        (size * usize::from(self.0)) >> 16
    }

    /// About `fraction` of the way.
    fn at(fraction: f64) -> Pick {
        Pick((fraction * 65536.0) as u16)
    }
}

/// How a client ended with a response.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Outcome {
    /// The status and the whole body.
    Read { status: u16, body: Vec<u8> },
    /// The head was refused (or never came).
    HeadRefused,
    /// The head was read, the body refused (or cut short).
    BodyRefused,
}

/// How the body is framed.
#[derive(Debug, Clone)]
enum Framing {
    Length(LengthForm),
    Chunked(ChunkedForm),
    /// No length: the body runs to the close.
    Close,
}

/// How a correct `Content-Length` is written.
#[derive(Debug, Clone, Copy)]
enum LengthForm {
    Plain,
    LeadingZeros,
    /// The same length in two fields.
    Repeated,
    /// The same length twice in one field (RFC 9110 §8.6).
    List,
}

#[derive(Debug, Clone)]
struct ChunkedForm {
    /// The `Transfer-Encoding` value (a spelling of `chunked`).
    coding: &'static str,
    /// Where the body is cut into chunks.
    cuts: Vec<Pick>,
    upper_hex: bool,
    /// `00` before each size.
    leading_zeros: bool,
    /// An extension for each chunk, by index (cycled), or none.
    extensions: Vec<Option<&'static str>>,
    /// The last chunk's zeros.
    last: &'static str,
    trailers: Vec<(&'static str, &'static str)>,
}

/// One way a response is broken, or none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mutation {
    None,
    // Refused by both.
    /// A `g` before a chunk size.
    BadHex,
    /// A chunk-size line ending in a bare LF.
    BareLfSize,
    /// A space before a chunk size.
    LeadingSpaceSize,
    /// Chunk data not followed by CRLF.
    MissingCrlfAfterData,
    /// Chunk data followed by a bare LF.
    BareLfAfterData,
    /// `Content-Length: +n`.
    SignedLength,
    /// Two different lengths.
    DifferentLengths,
    /// `Content-Length:` with no value.
    EmptyLength,
    /// `Content-Type : …`.
    SpaceBeforeColon,
    /// A field line continued on the next (obs-fold).
    ObsFold,
    /// `HTTP/1.0` with `Transfer-Encoding`.
    Http10Chunked,
    /// The connection closes inside the body (a body framed by the close
    /// is then just shorter).
    Truncated,
    // Read by both.
    /// A space at the end of a chunk-size line.
    TrailingSpaceSize,
    // Refused by this client only (see the module's documentation).
    BadExtension,
    LengthAndChunked,
    GzipThenChunked,
    GzipAlone,
}

impl Mutation {
    const CHUNKED: [Mutation; 14] = [
        Mutation::None,
        Mutation::BadHex,
        Mutation::BareLfSize,
        Mutation::LeadingSpaceSize,
        Mutation::MissingCrlfAfterData,
        Mutation::BareLfAfterData,
        Mutation::Http10Chunked,
        Mutation::Truncated,
        Mutation::TrailingSpaceSize,
        Mutation::BadExtension,
        Mutation::LengthAndChunked,
        Mutation::GzipThenChunked,
        Mutation::GzipAlone,
        Mutation::SpaceBeforeColon,
    ];
    const LENGTH: [Mutation; 7] = [
        Mutation::None,
        Mutation::SignedLength,
        Mutation::DifferentLengths,
        Mutation::EmptyLength,
        Mutation::Truncated,
        Mutation::ObsFold,
        Mutation::SpaceBeforeColon,
    ];
    const CLOSE: [Mutation; 3] = [Mutation::None, Mutation::Truncated, Mutation::ObsFold];
}

#[derive(Debug, Clone)]
struct Case {
    status: u16,
    body: Vec<u8>,
    framing: Framing,
    mutation: Mutation,
    /// Which chunk a chunk mutation breaks, or where a cut falls.
    at: Pick,
    /// Where the response is cut into the pieces written one by one.
    writes: Vec<Pick>,
}

/// What the test expects of the two clients.
#[derive(Debug, PartialEq, Eq)]
enum Expected {
    /// The same outcome from both.
    Same,
    /// This client ends with `h1`; hyper's reads `hyper_body`.
    H1Stricter { h1: Outcome, hyper_body: Vec<u8> },
}

/// A response on the wire, and what is expected of it.
#[derive(Debug)]
struct Rendered {
    wire: Vec<u8>,
    expected: Expected,
    /// The body a correct reading gives, when the response is not broken.
    correct: Option<Outcome>,
}

fn hex(size: usize, form: &ChunkedForm) -> String {
    let digits = if form.upper_hex {
        format!("{size:X}")
    } else {
        format!("{size:x}")
    };
    if form.leading_zeros {
        format!("00{digits}")
    } else {
        digits
    }
}

/// The chunked body: its wire bytes, given the mutation.
fn chunked_wire(body: &[u8], form: &ChunkedForm, mutation: Mutation, at: Pick) -> Vec<u8> {
    let mut cuts: Vec<usize> = form
        .cuts
        .iter()
        .filter(|_| body.len() > 1)
        .map(|cut| 1 + cut.index(body.len() - 1))
        .collect();
    cuts.sort_unstable();
    cuts.dedup();
    let mut chunks = Vec::new();
    let mut start = 0;
    for cut in cuts.into_iter().chain([body.len()]) {
        if cut > start {
            chunks.push(&body[start..cut]);
            start = cut;
        }
    }
    // The chunk a mutation breaks: a data chunk if there is one, else the
    // last chunk (for the size-line mutations).
    let broken = if chunks.is_empty() {
        0
    } else {
        at.index(chunks.len())
    };
    let mut wire = Vec::new();
    let size_line = |wire: &mut Vec<u8>, size: String, extension: Option<&str>, here: bool| {
        let mut line = size;
        if here {
            match mutation {
                Mutation::BadHex => line.insert(0, 'g'),
                Mutation::LeadingSpaceSize => line.insert(0, ' '),
                _ => {}
            }
        }
        if let Some(extension) = extension {
            line.push_str(extension);
        }
        match mutation {
            Mutation::BadExtension if here => line.push_str(";a b"),
            // After the size or the last extension.
            Mutation::TrailingSpaceSize if here => line.push(' '),
            _ => {}
        }
        wire.extend_from_slice(line.as_bytes());
        if here && mutation == Mutation::BareLfSize {
            wire.push(b'\n');
        } else {
            wire.extend_from_slice(b"\r\n");
        }
    };
    let extension = |index: usize| {
        (!form.extensions.is_empty())
            .then(|| form.extensions[index % form.extensions.len()])
            .flatten()
    };
    for (index, chunk) in chunks.iter().enumerate() {
        let here = index == broken;
        size_line(&mut wire, hex(chunk.len(), form), extension(index), here);
        wire.extend_from_slice(chunk);
        match mutation {
            Mutation::MissingCrlfAfterData if here => {}
            Mutation::BareLfAfterData if here => wire.push(b'\n'),
            _ => wire.extend_from_slice(b"\r\n"),
        }
    }
    size_line(
        &mut wire,
        form.last.to_owned(),
        extension(chunks.len()),
        chunks.is_empty(),
    );
    for (name, value) in &form.trailers {
        wire.extend_from_slice(format!("{name}: {value}\r\n").as_bytes());
    }
    wire.extend_from_slice(b"\r\n");
    wire
}

fn render(case: &Case) -> Rendered {
    let Case {
        status,
        ref body,
        ref framing,
        at,
        ..
    } = *case;
    let mut mutation = case.mutation;
    // A mutation with nothing to break is none.
    let has_data = !body.is_empty();
    if matches!(
        mutation,
        Mutation::MissingCrlfAfterData | Mutation::BareLfAfterData
    ) && !has_data
        || (mutation == Mutation::Truncated
            && matches!(framing, Framing::Length(_) | Framing::Close)
            && !has_data)
    {
        mutation = Mutation::None;
    }
    let version = if mutation == Mutation::Http10Chunked {
        "HTTP/1.0"
    } else {
        "HTTP/1.1"
    };
    let mut head = format!("{version} {status} Reason\r\n");
    head.push_str(if mutation == Mutation::SpaceBeforeColon {
        "content-type : application/json\r\n"
    } else {
        "content-type: application/json\r\n"
    });
    if mutation == Mutation::ObsFold {
        head.push_str("x-long: one\r\n two\r\n");
    }
    head.push_str("x-request-id: 7\r\n");
    let n = body.len();
    let body_wire = match framing {
        Framing::Length(form) => {
            head.push_str(&match (mutation, form) {
                (Mutation::SignedLength, _) => format!("content-length: +{n}\r\n"),
                (Mutation::DifferentLengths, _) => {
                    format!("content-length: {n}\r\ncontent-length: {}\r\n", n + 1)
                }
                (Mutation::EmptyLength, _) => "content-length: \r\n".to_owned(),
                (_, LengthForm::Plain) => format!("content-length: {n}\r\n"),
                (_, LengthForm::LeadingZeros) => format!("content-length: 000{n}\r\n"),
                (_, LengthForm::Repeated) => {
                    format!("content-length: {n}\r\nContent-Length: {n}\r\n")
                }
                (_, LengthForm::List) => format!("content-length: {n}, {n}\r\n"),
            });
            body.clone()
        }
        Framing::Chunked(form) => {
            let wire = chunked_wire(body, form, mutation, at);
            let coding = match mutation {
                Mutation::GzipThenChunked => "gzip, chunked",
                Mutation::GzipAlone => "gzip",
                _ => form.coding,
            };
            head.push_str(&format!("transfer-encoding: {coding}\r\n"));
            if mutation == Mutation::LengthAndChunked {
                head.push_str(&format!("content-length: {}\r\n", wire.len()));
            }
            wire
        }
        Framing::Close => body.clone(),
    };
    head.push_str("\r\n");
    let mut wire = head.into_bytes();
    let head_bytes = wire.len();
    wire.extend_from_slice(&body_wire);
    let no_body = status == 204 || status == 304;
    let mut read = Outcome::Read {
        status,
        body: if no_body { Vec::new() } else { body.clone() },
    };
    if mutation == Mutation::Truncated {
        let cut = head_bytes + at.index(body_wire.len());
        wire.truncate(cut);
        if let (Framing::Close, false) = (framing, no_body) {
            read = Outcome::Read {
                status,
                body: wire[head_bytes..].to_vec(),
            };
        }
    }
    let stricter = |h1: Outcome, hyper_body: Vec<u8>| Expected::H1Stricter { h1, hyper_body };
    let expected = match mutation {
        _ if no_body => Expected::Same,
        Mutation::BadExtension => stricter(Outcome::BodyRefused, body.clone()),
        Mutation::LengthAndChunked | Mutation::GzipThenChunked => {
            stricter(Outcome::HeadRefused, body.clone())
        }
        Mutation::GzipAlone => stricter(Outcome::HeadRefused, body_wire.clone()),
        _ => Expected::Same,
    };
    let correct = (matches!(mutation, Mutation::None | Mutation::TrailingSpaceSize)
        || no_body && !matches!(mutation, Mutation::SpaceBeforeColon | Mutation::ObsFold)
        || mutation == Mutation::Truncated && matches!(framing, Framing::Close))
    .then_some(read);
    Rendered {
        wire,
        expected,
        correct,
    }
}

/// Serves `wire` to each of two connections, in pieces cut at `writes`,
/// then closes its side and waits for the client to close its own.
async fn serve(listener: TcpListener, wire: Vec<u8>, writes: Vec<Pick>) {
    let mut cuts: Vec<usize> = writes.iter().map(|cut| cut.index(wire.len() + 1)).collect();
    cuts.push(wire.len());
    cuts.sort_unstable();
    for _ in 0..2 {
        let Ok((mut stream, _)) = listener.accept().await else {
            return;
        };
        let _ = stream.set_nodelay(true);
        let mut request = Vec::new();
        let mut buffer = [0u8; 1024];
        while !request.windows(4).any(|four| four == b"\r\n\r\n") {
            match stream.read(&mut buffer).await {
                Ok(0) | Err(_) => break,
                Ok(n) => request.extend_from_slice(&buffer[..n]),
            }
        }
        let mut start = 0;
        for &cut in &cuts {
            if stream.write_all(&wire[start..cut]).await.is_err() {
                break;
            }
            start = cut;
            // Lets the client read what came so far.
            tokio::task::yield_now().await;
        }
        let _ = stream.shutdown().await;
        while let Ok(n) = stream.read(&mut buffer).await {
            if n == 0 {
                break;
            }
        }
    }
}

async fn with_h1(address: SocketAddr) -> Outcome {
    let pool = Arc::new(Pool::new(&format!("http://{address}")));
    let (headers, body) = (HeaderLines::default(), Bytes::new());
    let request = Outgoing {
        method: &Method::GET,
        path: "/",
        query: None,
        headers: &headers,
        authorization: None,
        body: &body,
    };
    let Ok(mut response) = worker_h1::send(&pool, &request, Duration::from_secs(10)).await else {
        return Outcome::HeadRefused;
    };
    let mut body = Vec::new();
    while let Some(data) = std::future::poll_fn(|cx| response.body.poll_data(cx)).await {
        match data {
            Ok(data) => body.extend_from_slice(&data),
            Err(_) => return Outcome::BodyRefused,
        }
    }
    Outcome::Read {
        status: response.status.as_u16(),
        body,
    }
}

async fn with_hyper(address: SocketAddr) -> Outcome {
    let stream = TcpStream::connect(address).await.unwrap();
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake::<_, Empty<Bytes>>(TokioIo::new(stream))
            .await
            .unwrap();
    let connection = tokio::spawn(connection);
    let request = Request::get("/")
        .header(header::HOST, address.to_string())
        .body(Empty::new())
        .unwrap();
    let outcome = match sender.send_request(request).await {
        Err(_) => Outcome::HeadRefused,
        Ok(response) => {
            let status = response.status().as_u16();
            let mut body = response.into_body();
            let mut read = Vec::new();
            loop {
                match body.frame().await {
                    None => break Outcome::Read { status, body: read },
                    Some(Ok(frame)) => {
                        if let Ok(data) = frame.into_data() {
                            read.extend_from_slice(&data);
                        }
                    }
                    Some(Err(_)) => break Outcome::BodyRefused,
                }
            }
        }
    };
    connection.abort();
    outcome
}

/// Both clients' outcomes for `case`, checked against what is expected.
fn check(case: &Case) -> Result<(), TestCaseError> {
    let rendered = render(case);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (h1, hyper) = runtime.block_on(async {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let server = tokio::spawn(serve(listener, rendered.wire.clone(), case.writes.clone()));
        let h1 = with_h1(address).await;
        let hyper = with_hyper(address).await;
        server.await.unwrap();
        (h1, hyper)
    });
    let wire = String::from_utf8_lossy(&rendered.wire);
    if let Some(correct) = &rendered.correct {
        prop_assert_eq!(&h1, correct, "h1 misread {:?}", wire);
    }
    match rendered.expected {
        Expected::Same => {
            prop_assert_eq!(&h1, &hyper, "the clients differ on {:?}", wire);
        }
        Expected::H1Stricter {
            h1: refused,
            hyper_body,
        } => {
            prop_assert_eq!(&h1, &refused, "h1 should refuse {:?}", wire);
            let read = Outcome::Read {
                status: case.status,
                body: hyper_body,
            };
            prop_assert_eq!(&hyper, &read, "hyper should read {:?}", wire);
        }
    }
    Ok(())
}

fn chunked_form() -> impl Strategy<Value = ChunkedForm> {
    (
        select(vec!["chunked", "Chunked", "CHUNKED"]),
        prop::collection::vec(any::<u16>().prop_map(Pick), 0..6),
        any::<bool>(),
        prop::bool::weighted(0.2),
        prop::collection::vec(
            select(vec![
                None,
                Some(";a"),
                Some(";a=b"),
                Some(" ;a=b"),
                Some("; a = \"x y\""),
                Some(";a=1;b"),
            ]),
            0..3,
        ),
        select(vec!["0", "000"]),
        prop::collection::vec(
            select(vec![("x-trailer", "1"), ("X-Other", "two words")]),
            0..3,
        ),
    )
        .prop_map(
            |(coding, cuts, upper_hex, leading_zeros, extensions, last, trailers)| ChunkedForm {
                coding,
                cuts,
                upper_hex,
                leading_zeros,
                extensions,
                last,
                trailers,
            },
        )
}

/// A third of the cases unbroken, the rest broken by one of `mutations`.
fn mutation(mutations: &[Mutation]) -> impl Strategy<Value = Mutation> + use<> {
    prop_oneof![1 => Just(Mutation::None), 2 => select(mutations.to_vec())]
}

fn framing_and_mutation() -> impl Strategy<Value = (Framing, Mutation)> {
    prop_oneof![
        2 => (
            select(vec![
                LengthForm::Plain,
                LengthForm::LeadingZeros,
                LengthForm::Repeated,
                LengthForm::List,
            ]),
            mutation(&Mutation::LENGTH),
        )
            .prop_map(|(form, mutation)| (Framing::Length(form), mutation)),
        3 => (chunked_form(), mutation(&Mutation::CHUNKED))
            .prop_map(|(form, mutation)| (Framing::Chunked(form), mutation)),
        1 => mutation(&Mutation::CLOSE).prop_map(|mutation| (Framing::Close, mutation)),
    ]
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop_oneof![
            8 => select(vec![200u16, 201, 400, 404, 429, 500, 503]),
            1 => select(vec![204u16, 304]),
        ],
        prop::collection::vec(any::<u8>(), 0..200),
        framing_and_mutation(),
        any::<u16>().prop_map(Pick),
        prop::collection::vec(any::<u16>().prop_map(Pick), 0..4),
    )
        .prop_map(|(status, body, (framing, mutation), at, writes)| Case {
            status,
            body,
            framing,
            mutation,
            at,
            writes,
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn both_clients_read_a_response_alike_or_refuse_it_alike(case in case()) {
        check(&case)?;
    }
}

/// Every mutation at least once, on one response of each framing, so that
/// none rests on the generator's luck.
#[test]
fn every_mutation_is_checked_on_a_fixed_response() {
    let form = ChunkedForm {
        coding: "chunked",
        cuts: vec![Pick::at(0.3), Pick::at(0.6)],
        upper_hex: false,
        leading_zeros: false,
        extensions: vec![None, Some(";a=b")],
        last: "0",
        trailers: vec![("x-trailer", "1")],
    };
    let body = b"data: {\"text\":\"hello\"}\n\n".to_vec();
    let framings = [
        (Framing::Chunked(form), &Mutation::CHUNKED[..]),
        (Framing::Length(LengthForm::Plain), &Mutation::LENGTH[..]),
        (Framing::Close, &Mutation::CLOSE[..]),
    ];
    for (framing, mutations) in framings {
        for &mutation in mutations {
            for status in [200, 204] {
                let case = Case {
                    status,
                    body: body.clone(),
                    framing: framing.clone(),
                    mutation,
                    at: Pick::at(0.5),
                    writes: vec![Pick::at(0.1), Pick::at(0.7)],
                };
                if let Err(error) = check(&case) {
                    panic!("{case:?}: {error}");
                }
            }
        }
    }
}
