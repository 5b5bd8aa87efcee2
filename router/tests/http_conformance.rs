//! The router's HTTP/1.1 server spoken to byte by byte over loopback:
//! message framing as RFC 9112 has it (what is refused, with which status,
//! and that nothing refused reaches the engine), keep-alive and
//! pipelining, and the body size limit. Every wait has a deadline; no
//! duration is asserted.

// Test helpers outside #[test] functions fail loudly on purpose.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::upstream::Upstream;
use common::{TestRouter, fast_config, start_router, wait_until, worker};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long anything may take on a loaded 2-core machine.
const PATIENCE: Duration = Duration::from_secs(20);

const CHAT: &str = r#"{"messages":[{"role":"user","content":"hi"}]}"#;
const CHAT_STREAM: &str = r#"{"messages":[{"role":"user","content":"hi"}],"stream":true}"#;

/// A router over one upstream; non-streaming requests go upstream as they
/// came (not as streams), so that the bodies the engine gets are the
/// client's, byte for byte.
async fn router_with(extra_toml: &str) -> (Upstream, TestRouter) {
    let upstream = Upstream::start().await;
    let router = start_router(fast_config(
        vec![worker("sglang", &upstream.url)],
        &format!("{extra_toml}\n[migration]\nnon_streaming_as_stream = false\n"),
    ))
    .await;
    wait_until("the worker is healthy", || async {
        router.healthy_count().await == 1
    })
    .await;
    (upstream, router)
}

fn post(path: &str, body: &str) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// One HTTP/1.1 response read off a raw connection.
#[derive(Debug)]
struct Answer {
    head: String,
    body: Vec<u8>,
}

impl Answer {
    fn status(&self) -> u16 {
        self.head
            .split(' ')
            .nth(1)
            .and_then(|code| code.parse().ok())
            .unwrap_or(0)
    }

    fn header(&self, name: &str) -> Option<String> {
        self.head.split("\r\n").skip(1).find_map(|line| {
            let (key, value) = line.split_once(':')?;
            key.trim()
                .eq_ignore_ascii_case(name)
                .then(|| value.trim().to_owned())
        })
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Reads responses from a connection, keeping what follows one for the next.
struct Reader {
    stream: TcpStream,
    buffer: Vec<u8>,
}

impl Reader {
    fn new(stream: TcpStream) -> Reader {
        Reader {
            stream,
            buffer: Vec::new(),
        }
    }

    async fn fill(&mut self) -> usize {
        let mut chunk = [0u8; 8192];
        let read = tokio::time::timeout(PATIENCE, self.stream.read(&mut chunk))
            .await
            .expect("the router sent nothing in time")
            .unwrap_or(0);
        self.buffer.extend_from_slice(&chunk[..read]);
        read
    }

    async fn line(&mut self) -> String {
        loop {
            if let Some(end) = self.buffer.windows(2).position(|w| w == b"\r\n") {
                let line = String::from_utf8_lossy(&self.buffer[..end]).into_owned();
                self.buffer.drain(..end + 2);
                return line;
            }
            assert!(self.fill().await > 0, "closed mid-line: {:?}", self.buffer);
        }
    }

    async fn take(&mut self, count: usize) -> Vec<u8> {
        while self.buffer.len() < count {
            assert!(self.fill().await > 0, "closed mid-body");
        }
        self.buffer.drain(..count).collect()
    }

    /// The next response (1xx heads included), decoding its framing.
    async fn answer(&mut self) -> Answer {
        let mut head = String::new();
        loop {
            let line = self.line().await;
            if line.is_empty() {
                break;
            }
            head.push_str(&line);
            head.push_str("\r\n");
        }
        let mut answer = Answer {
            head,
            body: Vec::new(),
        };
        if answer.status() < 200 || answer.status() == 204 {
            return answer;
        }
        if answer
            .header("transfer-encoding")
            .is_some_and(|coding| coding.eq_ignore_ascii_case("chunked"))
        {
            loop {
                let size = usize::from_str_radix(self.line().await.trim(), 16).unwrap();
                if size == 0 {
                    assert_eq!(self.line().await, "", "no trailers are sent");
                    return answer;
                }
                answer.body.extend(self.take(size).await);
                assert_eq!(self.line().await, "");
            }
        }
        let length: usize = answer
            .header("content-length")
            .expect("a length or chunked")
            .parse()
            .unwrap();
        answer.body = self.take(length).await;
        answer
    }

    /// True once the router closed the connection (end of stream or reset)
    /// with nothing more sent.
    async fn closed(&mut self) -> bool {
        self.buffer.is_empty() && self.fill().await == 0
    }

    async fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.unwrap();
    }
}

async fn connect(router: &TestRouter) -> Reader {
    Reader::new(TcpStream::connect(router.address).await.unwrap())
}

/// The bodies the engine has received so far.
fn bodies(upstream: &Upstream) -> Vec<String> {
    upstream
        .switches
        .bodies
        .lock()
        .unwrap()
        .iter()
        .map(|body| String::from_utf8_lossy(body).into_owned())
        .collect()
}

/// Sends `request` on a connection of its own; the router must answer
/// `status` (its first answer: no `100 Continue` before it), close the
/// connection, and send nothing on to the engine.
async fn refused(
    router: &TestRouter,
    upstream: &Upstream,
    case: &str,
    request: &[u8],
    status: u16,
) {
    let before = upstream.requests();
    let mut client = connect(router).await;
    client.send(request).await;
    let answer = client.answer().await;
    assert_eq!(answer.status(), status, "{case}: {answer:?}");
    assert!(client.closed().await, "{case}: the connection stayed open");
    assert_eq!(upstream.requests(), before, "{case}: reached the engine");
}

const HEAD: &str = "POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\n";

/// The framing cases RFC 9112 refuses, each with the status hyper's parser
/// (or, for transfer codings and `Expect`, the router) answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_framed_against_rfc_9112_are_refused_and_never_sent_on() {
    let (upstream, router) = router_with("[server]\nbody_limit_bytes = 65536\n").await;
    let len = CHAT.len();
    let chunked = format!("{HEAD}Transfer-Encoding: chunked\r\n\r\n");
    let cases: Vec<(&str, String, u16)> = vec![
        (
            "Content-Length with a sign",
            format!("{HEAD}Content-Length: +{len}\r\n\r\n{CHAT}"),
            400,
        ),
        (
            "two different Content-Lengths",
            format!("{HEAD}Content-Length: {len}\r\nContent-Length: 3\r\n\r\n{CHAT}"),
            400,
        ),
        (
            "a space inside Content-Length",
            format!("{HEAD}Content-Length: 4 6\r\n\r\n{CHAT}"),
            400,
        ),
        (
            "a negative Content-Length",
            format!("{HEAD}Content-Length: -4\r\n\r\n"),
            400,
        ),
        (
            "a chunk-size line ending in a bare LF",
            format!("{chunked}{len:x}\n{CHAT}\r\n0\r\n\r\n"),
            400,
        ),
        (
            "a chunk size with leading spaces",
            format!("{chunked}  {len:x}\r\n{CHAT}\r\n0\r\n\r\n"),
            400,
        ),
        (
            "a chunk size that is not hex",
            format!("{chunked}zz\r\n{CHAT}\r\n0\r\n\r\n"),
            400,
        ),
        (
            "a chunk extension over 16 KiB",
            format!(
                "{chunked}{len:x};ext={}\r\n{CHAT}\r\n0\r\n\r\n",
                "e".repeat(20 * 1024)
            ),
            400,
        ),
        (
            "trailers over 16 KiB",
            format!(
                "{chunked}{len:x}\r\n{CHAT}\r\n0\r\nX-Trailer: {}\r\n\r\n",
                "t".repeat(20 * 1024)
            ),
            400,
        ),
        (
            "obs-fold in Transfer-Encoding",
            format!(
                "{HEAD}Transfer-Encoding: gzip,\r\n chunked\r\n\r\n{len:x}\r\n{CHAT}\r\n0\r\n\r\n"
            ),
            400,
        ),
        (
            "a transfer coding not ending in chunked",
            format!("{HEAD}Transfer-Encoding: gzip\r\n\r\n{CHAT}"),
            400,
        ),
        (
            "a transfer coding besides chunked",
            format!("{HEAD}Transfer-Encoding: gzip, chunked\r\n\r\n{len:x}\r\n{CHAT}\r\n0\r\n\r\n"),
            501,
        ),
        (
            "chunked applied twice",
            format!(
                "{HEAD}Transfer-Encoding: chunked, chunked\r\n\r\n{len:x}\r\n{CHAT}\r\n0\r\n\r\n"
            ),
            400,
        ),
        (
            "Transfer-Encoding in HTTP/1.0",
            format!("{chunked}{len:x}\r\n{CHAT}\r\n0\r\n\r\n").replace("HTTP/1.1", "HTTP/1.0"),
            400,
        ),
        (
            "Expect: 100-continue with a length over the limit",
            format!("{HEAD}Expect: 100-continue\r\nContent-Length: 999999999\r\n\r\n"),
            413,
        ),
        (
            "a header line without a colon",
            format!("{HEAD}Bad Header\r\n\r\n"),
            400,
        ),
        ("not HTTP", "\u{1}\u{2} nonsense\r\n\r\n".to_owned(), 400),
        (
            "a head over 64 KiB",
            format!("{HEAD}X-Big: {}\r\n", "a".repeat(70 * 1024)),
            431,
        ),
        (
            "over 100 headers",
            format!("{HEAD}{}\r\n", "X-Many: 1\r\n".repeat(101)),
            431,
        ),
    ];
    for (case, request, status) in &cases {
        refused(&router, &upstream, case, request.as_bytes(), *status).await;
    }
    assert_eq!(upstream.requests(), 0, "nothing refused was sent on");
    // The same router still takes a well-framed request.
    let mut client = connect(&router).await;
    client
        .send(post("/v1/chat/completions", CHAT).as_bytes())
        .await;
    assert_eq!(client.answer().await.status(), 200);
    assert_eq!(bodies(&upstream), [CHAT]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn well_framed_bodies_reach_the_engine_exactly() {
    let (upstream, router) = router_with("").await;
    let mut client = connect(&router).await;
    client
        .send(post("/v1/chat/completions", CHAT).as_bytes())
        .await;
    let answer = client.answer().await;
    assert_eq!(answer.status(), 200, "{answer:?}");
    assert!(answer.text().contains("chat.completion"), "{answer:?}");
    // Chunked, in pieces, with an extension and a trailer, on the same
    // connection.
    let (first, second) = CHAT_STREAM.split_at(10);
    client
        .send(format!("{HEAD}Transfer-Encoding: chunked\r\n\r\n").as_bytes())
        .await;
    client
        .send(format!("{:x}\r\n{first}\r\n", first.len()).as_bytes())
        .await;
    client
        .send(
            format!(
                "{:X};ext=1\r\n{second}\r\n0\r\nX-Trailer: t\r\n\r\n",
                second.len()
            )
            .as_bytes(),
        )
        .await;
    let answer = client.answer().await;
    assert_eq!(answer.status(), 200, "{answer:?}");
    assert!(answer.text().ends_with("data: [DONE]\n\n"), "{answer:?}");
    assert_eq!(bodies(&upstream), [CHAT, CHAT_STREAM], "de-chunked, whole");
}

/// RFC 9112 section 6.3: with both, `Transfer-Encoding` frames the body,
/// and the connection closes after the answer (what follows might be
/// framed by the length).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn content_length_beside_chunked_is_overridden_and_the_connection_closed() {
    let (upstream, router) = router_with("").await;
    let mut client = connect(&router).await;
    let len = CHAT.len();
    client
        .send(
            format!(
                "{HEAD}Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n{len:x}\r\n{CHAT}\r\n0\r\n\r\n"
            )
            .as_bytes(),
        )
        .await;
    let answer = client.answer().await;
    assert_eq!(answer.status(), 200, "{answer:?}");
    assert!(client.closed().await, "kept alive after an ambiguous frame");
    assert_eq!(bodies(&upstream), [CHAT]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_requests_of_every_kind_are_answered_in_order_on_one_connection() {
    let (upstream, router) = router_with("").await;
    let mut client = connect(&router).await;
    let mut requests = post("/v1/chat/completions", CHAT);
    requests.push_str(&post("/v1/chat/completions?trace=0", CHAT_STREAM));
    requests.push_str("GET /health HTTP/1.1\r\nHost: router\r\n\r\n");
    requests.push_str(&post("/generate", CHAT));
    client.send(requests.as_bytes()).await;

    let whole = client.answer().await;
    assert_eq!(whole.status(), 200, "{whole:?}");
    assert!(whole.text().contains("chat.completion"), "{whole:?}");
    assert!(whole.header("date").is_some(), "{whole:?}");
    let stream = client.answer().await;
    assert_eq!(stream.status(), 200, "{stream:?}");
    assert_eq!(
        stream.header("transfer-encoding").as_deref(),
        Some("chunked"),
        "a stream's length is not known: {stream:?}"
    );
    let events = stream.text();
    assert!(events.starts_with("data: "), "{events}");
    assert!(events.ends_with("data: [DONE]\n\n"), "{events}");
    let health = client.answer().await;
    assert_eq!(health.status(), 200, "{health:?}");
    assert_eq!(health.text(), "ok");
    let after = client.answer().await;
    assert_eq!(after.status(), 200, "{after:?}");
    assert_eq!(upstream.requests(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_absolute_form_target_is_served() {
    let (upstream, router) = router_with("").await;
    let mut client = connect(&router).await;
    let request = post("/v1/chat/completions", CHAT).replace(
        "POST /v1/chat/completions",
        "POST http://router/v1/chat/completions",
    );
    client.send(request.as_bytes()).await;
    let answer = client.answer().await;
    assert_eq!(answer.status(), 200, "{answer:?}");
    assert_eq!(bodies(&upstream), [CHAT]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expect_100_continue_is_answered_before_the_body() {
    let (upstream, router) = router_with("").await;
    let mut client = connect(&router).await;
    client
        .send(
            format!(
                "{HEAD}Expect: 100-continue\r\nContent-Length: {}\r\n\r\n",
                CHAT.len()
            )
            .as_bytes(),
        )
        .await;
    let interim = client.answer().await;
    assert_eq!(interim.status(), 100, "{interim:?}");
    client.send(CHAT.as_bytes()).await;
    assert_eq!(client.answer().await.status(), 200);
    assert_eq!(bodies(&upstream), [CHAT]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_close_is_honoured() {
    let (_upstream, router) = router_with("").await;
    let mut client = connect(&router).await;
    let request = post("/v1/chat/completions", CHAT)
        .replace("Host: router\r\n", "Host: router\r\nConnection: close\r\n");
    client.send(request.as_bytes()).await;
    let answer = client.answer().await;
    assert_eq!(answer.status(), 200, "{answer:?}");
    assert_eq!(answer.header("connection").as_deref(), Some("close"));
    assert!(client.closed().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_1_0_request_is_served() {
    let (_upstream, router) = router_with("").await;
    let mut client = connect(&router).await;
    let request = post("/v1/chat/completions", CHAT).replace("HTTP/1.1", "HTTP/1.0");
    client.send(request.as_bytes()).await;
    let answer = client.answer().await;
    assert_eq!(answer.status(), 200, "{answer:?}");
    assert!(answer.text().contains("chat.completion"), "{answer:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generation_body_over_the_limit_or_late_is_refused() {
    let (upstream, router) =
        router_with("[server]\nbody_limit_bytes = 64\nclient_body_timeout_ms = 500\n").await;
    let mut large = connect(&router).await;
    large
        .send(post("/v1/chat/completions", &"x".repeat(65)).as_bytes())
        .await;
    let answer = large.answer().await;
    assert_eq!(answer.status(), 413, "{answer:?}");
    assert!(
        answer.text().contains("server.body_limit_bytes"),
        "{answer:?}"
    );
    assert!(large.closed().await);

    // Chunked, so no length is declared: refused once it passes the limit.
    let mut chunked = connect(&router).await;
    chunked
        .send(
            format!(
                "{HEAD}Transfer-Encoding: chunked\r\n\r\n41\r\n{}\r\n0\r\n\r\n",
                "x".repeat(65)
            )
            .as_bytes(),
        )
        .await;
    assert_eq!(chunked.answer().await.status(), 413);
    assert!(chunked.closed().await);

    let mut late = connect(&router).await;
    late.send(format!("{HEAD}Content-Length: 40\r\n\r\n{{\"mess").as_bytes())
        .await;
    let answer = late.answer().await;
    assert_eq!(answer.status(), 408, "{answer:?}");
    assert!(late.closed().await);
    assert_eq!(upstream.requests(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_mid_stream_releases_its_work() {
    let (upstream, router) = router_with("").await;
    upstream
        .switches
        .gate_after_first_chunk
        .store(true, Ordering::SeqCst);
    let mut client = connect(&router).await;
    client
        .send(post("/v1/chat/completions", CHAT_STREAM).as_bytes())
        .await;
    // The head and the first event arrive; the rest is held by the worker.
    let status = client.line().await;
    assert!(status.starts_with("HTTP/1.1 200"), "{status}");
    wait_until("the request is in flight", || async {
        router.workers_json().await["workers"][0]["in_flight"] == 1
    })
    .await;
    drop(client);
    wait_until("the dispatch is released", || async {
        router.workers_json().await["workers"][0]["in_flight"] == 0
    })
    .await;
    upstream.switches.continue_stream.notify_waiters();
}
