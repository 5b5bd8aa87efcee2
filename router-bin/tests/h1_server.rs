//! The router's own HTTP/1.1 server for the generation routes, spoken to
//! byte by byte over loopback: framing, keep-alive and pipelining, the
//! hand-over to hyper for every other route, and bad input.

// Test helpers outside #[test] functions fail loudly on purpose.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::upstream::Upstream;
use common::{TestRouter, fast_config, start_router, wait_until, worker};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long anything may take on a loaded 2-core machine.
const PATIENCE: Duration = Duration::from_secs(20);

const CHAT: &str = r#"{"messages":[{"role":"user","content":"hi"}]}"#;
const CHAT_STREAM: &str = r#"{"messages":[{"role":"user","content":"hi"}],"stream":true}"#;

async fn router_with(extra_toml: &str) -> (Upstream, TestRouter) {
    let upstream = Upstream::start().await;
    let router = start_router(fast_config(
        vec![worker("sglang", &upstream.url)],
        extra_toml,
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_requests_are_answered_in_order_and_other_routes_go_on_the_same_connection() {
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
    // After the hand-over, hyper serves the generation routes too.
    let after = client.answer().await;
    assert_eq!(after.status(), 200, "{after:?}");
    assert_eq!(upstream.requests(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_request_body_is_read_whole() {
    let (upstream, router) = router_with("").await;
    let mut client = connect(&router).await;
    let (first, second) = CHAT.split_at(10);
    client
        .send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nTransfer-Encoding: chunked\r\n\r\n")
        .await;
    client
        .send(format!("{:x}\r\n{first}\r\n", first.len()).as_bytes())
        .await;
    client
        .send(
            format!(
                "{:x};ext=1\r\n{second}\r\n0\r\nX-Trailer: t\r\n\r\n",
                second.len()
            )
            .as_bytes(),
        )
        .await;
    let answer = client.answer().await;
    assert_eq!(answer.status(), 200, "{answer:?}");
    assert_eq!(
        upstream
            .switches
            .prompt_chars
            .load(std::sync::atomic::Ordering::SeqCst),
        CHAT.len() as u64,
        "the worker got the body, de-chunked"
    );
    // The connection is still good.
    client.send(post("/v1/completions", CHAT).as_bytes()).await;
    assert_eq!(client.answer().await.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expect_100_continue_is_answered_before_the_body() {
    let (_upstream, router) = router_with("").await;
    let mut client = connect(&router).await;
    client
        .send(
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nExpect: 100-continue\r\nContent-Length: {}\r\n\r\n",
                CHAT.len()
            )
            .as_bytes(),
        )
        .await;
    let interim = client.answer().await;
    assert_eq!(interim.status(), 100, "{interim:?}");
    client.send(CHAT.as_bytes()).await;
    assert_eq!(client.answer().await.status(), 200);
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

/// Heads the router must refuse with `status` and a closed connection,
/// never a panic or a request sent on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_heads_are_refused_and_closed() {
    let (upstream, router) = router_with("").await;
    let body = CHAT;
    let len = body.len();
    let cases: Vec<(String, u16)> = vec![
        (
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\nContent-Length: {len}\r\nTransfer-Encoding: chunked\r\n\r\n{body}"
            ),
            400,
        ),
        (
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\nContent-Length: {len}\r\nContent-Length: 3\r\n\r\n{body}"
            ),
            400,
        ),
        (
            "POST /v1/chat/completions HTTP/1.1\r\nContent-Length: -4\r\n\r\n".to_owned(),
            400,
        ),
        (
            "POST /v1/chat/completions HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n".to_owned(),
            501,
        ),
        (
            "POST /v1/chat/completions HTTP/1.1\r\nBad Header\r\n\r\n".to_owned(),
            400,
        ),
        ("\u{1}\u{2} nonsense\r\n\r\n".to_owned(), 400),
        (
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\nX-Big: {}\r\n",
                "a".repeat(70 * 1024)
            ),
            431,
        ),
        (
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\n{}\r\n",
                "X-Many: 1\r\n".repeat(101)
            ),
            431,
        ),
    ];
    for (request, status) in cases {
        let mut client = connect(&router).await;
        client.send(request.as_bytes()).await;
        let answer = client.answer().await;
        assert_eq!(answer.status(), status, "{request:.80}: {answer:?}");
        assert!(client.closed().await, "{request:.80}: still open");
    }
    assert_eq!(upstream.requests(), 0, "nothing malformed was sent on");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_chunked_bodies_are_refused() {
    let (upstream, router) = router_with("").await;
    let mut client = connect(&router).await;
    client
        .send(b"POST /v1/chat/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n")
        .await;
    let answer = client.answer().await;
    assert_eq!(answer.status(), 400, "{answer:?}");
    assert!(client.closed().await);
    assert_eq!(upstream.requests(), 0);
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

    let mut late = connect(&router).await;
    late.send(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 40\r\n\r\n{\"mess")
        .await;
    let answer = late.answer().await;
    assert_eq!(answer.status(), 408, "{answer:?}");
    assert!(late.closed().await);
    assert_eq!(upstream.requests(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_generation_head_is_closed_at_the_header_deadline() {
    let (_upstream, router) = router_with("[server]\nclient_header_timeout_ms = 300\n").await;
    let mut client = connect(&router).await;
    client
        .send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: ro")
        .await;
    assert!(client.closed().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_connection_after_a_generation_is_closed_at_the_keepalive_deadline() {
    let (_upstream, router) =
        router_with("[server]\nclient_header_timeout_ms = 60000\nkeepalive_timeout_ms = 300\n")
            .await;
    let mut client = connect(&router).await;
    client
        .send(post("/v1/chat/completions", CHAT).as_bytes())
        .await;
    assert_eq!(client.answer().await.status(), 200);
    assert!(client.closed().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_mid_stream_releases_its_work() {
    let (upstream, router) = router_with("").await;
    upstream
        .switches
        .gate_after_first_chunk
        .store(true, std::sync::atomic::Ordering::SeqCst);
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
