//! Slow and idle clients cannot hold the router's connections: raw TCP
//! clients that stall, against a real router on loopback with short client
//! deadlines. Every wait has a generous deadline; no duration is asserted.
//!
//! Besides the router's own routes, the router serves two test routes here
//! ([`serve_routes`] with a table of its own) that read their bodies as the
//! router's handlers do ([`read_body`]), so the body deadlines and limits
//! are seen without a worker.

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::response::IntoResponse;
use axum::routing::post;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use super::{routes, serve_routes};
use crate::client_body::read_body;
use crate::config::{RouterConfig, ServerConfig};

/// How long anything may take on a loaded 2-core machine.
const PATIENCE: Duration = Duration::from_secs(20);

/// Short client deadlines, so the router's own closing is what tests see.
fn config(edit: impl FnOnce(&mut ServerConfig)) -> RouterConfig {
    let mut config = RouterConfig::default();
    let server = &mut config.server;
    server.client_header_timeout_ms = 500;
    server.client_body_timeout_ms = 500;
    server.keepalive_timeout_ms = 500;
    server.max_connections = 64;
    server.body_limit_bytes = 1024;
    server.shutdown_grace_ms = 20_000;
    edit(server);
    config
}

/// A router (no workers) on loopback, plus test routes that read their
/// bodies with `client_body::read_body` under the config's limits:
/// `POST /upload` answers `<n> bytes`; `POST /gated` does the same after
/// reporting on `entered` that it was called.
struct Served {
    address: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    serving: JoinHandle<()>,
    entered: mpsc::UnboundedReceiver<()>,
}

async fn serve(config: RouterConfig) -> Served {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let server = config.server.clone();
    let app = crate::RouterBuilder::with_builtins()
        .start(config, None)
        .await
        .unwrap();
    let (entered_tx, entered) = mpsc::unbounded_channel();
    let limit = server.body_limit_bytes;
    let deadline = server.client_body_timeout();
    let upload = move |body: Body| async move {
        match read_body(body, limit, deadline, tokio::time::Instant::now()).await {
            Ok(bytes) => format!("{} bytes", bytes.len()).into_response(),
            Err(error) => error.into_response(),
        }
    };
    let gated = move |body: Body| {
        let _ = entered_tx.send(());
        upload(body)
    };
    let routes = routes(app.clone()).merge(
        Router::new()
            .route("/upload", post(upload))
            .route("/gated", post(gated)),
    );
    let (stop, stopped) = oneshot::channel::<()>();
    let serving = tokio::spawn(async move {
        serve_routes(app, routes, listener, async {
            let _ = stopped.await;
        })
        .await
        .unwrap();
    });
    Served {
        address,
        stop: Some(stop),
        serving,
        entered,
    }
}

async fn connect(served: &Served) -> TcpStream {
    TcpStream::connect(served.address).await.unwrap()
}

/// Reads until the router closes the connection (end of stream or reset)
/// and returns what came before. Panics if it stays open past `PATIENCE`.
async fn read_until_closed(stream: &mut TcpStream) -> Vec<u8> {
    let mut received = Vec::new();
    let reading = async {
        let mut buffer = [0u8; 8192];
        loop {
            match stream.read(&mut buffer).await {
                Ok(0) | Err(_) => return,
                Ok(n) => received.extend_from_slice(&buffer[..n]),
            }
        }
    };
    tokio::time::timeout(PATIENCE, reading)
        .await
        .expect("the router kept the connection open");
    received
}

/// Reads one response with a `Content-Length` body, leaving the connection
/// open; returns it as text.
async fn read_response(stream: &mut TcpStream) -> String {
    let reading = async {
        let mut received = Vec::new();
        let mut buffer = [0u8; 8192];
        loop {
            if whole_response_len(&received).is_some_and(|len| received.len() >= len) {
                return String::from_utf8(received).unwrap();
            }
            let n = stream.read(&mut buffer).await.unwrap();
            assert!(n > 0, "closed mid-response: {received:?}");
            received.extend_from_slice(&buffer[..n]);
        }
    };
    tokio::time::timeout(PATIENCE, reading)
        .await
        .expect("no response")
}

/// The length of the response that `received` opens with (its head and
/// its `Content-Length` body), once its head is whole.
fn whole_response_len(received: &[u8]) -> Option<usize> {
    let end = find(received, b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&received[..end]).to_ascii_lowercase();
    let length: usize = head
        .lines()
        .find_map(|line| line.strip_prefix("content-length:"))
        .map_or(0, |value| value.trim().parse().unwrap());
    Some(end + 4 + length)
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack
        .windows(needle.len())
        .position(|window| window == needle)
}

const HEALTH: &[u8] = b"GET /health HTTP/1.1\r\nHost: router\r\n\r\n";

async fn health_on(stream: &mut TcpStream) {
    stream.write_all(HEALTH).await.unwrap();
    let response = read_response(stream).await;
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(response.ends_with("\r\n\r\nok"), "{response}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_sends_nothing_is_closed_at_the_header_deadline() {
    let served = serve(config(|server| server.keepalive_timeout_ms = 60_000)).await;
    let mut silent = connect(&served).await;
    assert!(read_until_closed(&mut silent).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_a_request_head_is_closed_at_the_header_deadline() {
    let served = serve(config(|server| server.keepalive_timeout_ms = 60_000)).await;
    let mut stalled = connect(&served).await;
    stalled
        .write_all(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-")
        .await
        .unwrap();
    assert!(
        read_until_closed(&mut stalled).await.is_empty(),
        "closed without an answer"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_that_keeps_trickling_is_still_closed() {
    let served = serve(config(|server| server.keepalive_timeout_ms = 60_000)).await;
    let mut dripping = connect(&served).await;
    dripping
        .write_all(b"GET /health HTTP/1.1\r\nX-Drip: ")
        .await
        .unwrap();
    // One byte whenever 50 ms pass without the router closing: the client is
    // never idle, yet the head's deadline still runs out.
    let closed = async {
        let mut buffer = [0u8; 64];
        loop {
            match tokio::time::timeout(Duration::from_millis(50), dripping.read(&mut buffer)).await
            {
                Ok(Ok(0) | Err(_)) => return,
                Ok(Ok(n)) => panic!("unexpected answer: {:?}", &buffer[..n]),
                Err(_still_open) => {
                    if dripping.write_all(b"a").await.is_err() {
                        return;
                    }
                }
            }
        }
    };
    tokio::time::timeout(PATIENCE, closed)
        .await
        .expect("the router kept a dripping head open");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_stops_short_is_answered_408_and_closed() {
    let served = serve(config(|_| {})).await;
    let mut short = connect(&served).await;
    short
        .write_all(b"POST /upload HTTP/1.1\r\nHost: router\r\nContent-Length: 100\r\n\r\n12345")
        .await
        .unwrap();
    let answer = String::from_utf8(read_until_closed(&mut short).await).unwrap();
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(
        answer
            .to_ascii_lowercase()
            .contains("\r\nconnection: close\r\n"),
        "{answer}"
    );
    assert!(
        answer.contains("(server.client_body_timeout_ms)"),
        "{answer}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_kept_alive_connection_is_closed_at_the_keepalive_deadline() {
    let served = serve(config(|server| server.client_header_timeout_ms = 60_000)).await;
    let mut kept = connect(&served).await;
    health_on(&mut kept).await;
    health_on(&mut kept).await;
    assert!(read_until_closed(&mut kept).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_alive_is_not_cut_short_by_the_header_deadline() {
    let served = serve(config(|server| {
        server.client_header_timeout_ms = 200;
        server.keepalive_timeout_ms = 60_000;
    }))
    .await;
    let mut kept = connect(&served).await;
    health_on(&mut kept).await;
    // Connected after `kept` went idle, so closed by its header deadline only
    // once `kept` has been idle longer than that deadline.
    let mut silent = connect(&served).await;
    read_until_closed(&mut silent).await;
    health_on(&mut kept).await;
}

/// The watchdog's timer is not moved when a request ends or a head begins;
/// it must still fire in time for a head that begins on a connection kept
/// alive far longer than the header deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_later_head_that_stalls_is_closed_at_the_header_deadline_not_the_keepalive() {
    let served = serve(config(|server| server.keepalive_timeout_ms = 60_000)).await;
    let mut kept = connect(&served).await;
    health_on(&mut kept).await;
    kept.write_all(b"GET /health HTTP/1.1\r\nHost: router\r\nX-Half: ")
        .await
        .unwrap();
    // PATIENCE (20 s) is far below the 60 s keep-alive deadline.
    assert!(
        read_until_closed(&mut kept).await.is_empty(),
        "closed without an answer"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_over_the_cap_wait_in_the_backlog_until_one_closes() {
    const CAP: usize = 3;
    let served = serve(config(|server| {
        server.max_connections = CAP;
        server.client_header_timeout_ms = 60_000;
        server.keepalive_timeout_ms = 60_000;
    }))
    .await;
    let mut held = Vec::new();
    for _ in 0..CAP {
        let mut stream = connect(&served).await;
        health_on(&mut stream).await;
        held.push(stream);
    }
    // The kernel completes the handshake; the router must not accept it.
    let mut waiting = connect(&served).await;
    waiting.write_all(HEALTH).await.unwrap();
    // Proving an absence needs a window; a slow machine only makes a wrong
    // answer less likely to show here, never a right one fail.
    let mut byte = [0u8; 1];
    let early = tokio::time::timeout(Duration::from_millis(300), waiting.read(&mut byte)).await;
    assert!(early.is_err(), "answered over the cap: {early:?}");
    drop(held.pop());
    let response = read_response(&mut waiting).await;
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    // The rest are still served.
    for stream in &mut held {
        health_on(stream).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_upload_sent_whole_before_reading_gets_a_readable_413() {
    let served = serve(config(|server| server.client_body_timeout_ms = 10_000)).await;
    // Larger than loopback's socket buffers can absorb (32 MiB receive, 4 MiB
    // send at most), smaller than what the router reads and discards.
    let size = 40 << 20;
    let mut client = connect(&served).await;
    // Like Python's urllib: the whole request goes out before any reading.
    let head = format!("POST /upload HTTP/1.1\r\nHost: router\r\nContent-Length: {size}\r\n\r\n");
    client.write_all(head.as_bytes()).await.unwrap();
    let chunk = vec![b'x'; 1 << 20];
    for _ in 0..(size >> 20) {
        client.write_all(&chunk).await.unwrap();
    }
    let answer = String::from_utf8(read_until_closed(&mut client).await).unwrap();
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(
        answer
            .to_ascii_lowercase()
            .contains("\r\nconnection: close\r\n"),
        "{answer}"
    );
    assert!(
        answer.contains("request body exceeds 1024 bytes (server.body_limit_bytes)"),
        "{answer}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_within_the_limit_is_read() {
    let served = serve(config(|_| {})).await;
    let mut client = connect(&served).await;
    client
        .write_all(b"POST /upload HTTP/1.1\r\nHost: router\r\nContent-Length: 5\r\n\r\n12345")
        .await
        .unwrap();
    let response = read_response(&mut client).await;
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(response.ends_with("5 bytes"), "{response}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handlers_see_the_peer_address() {
    let served = serve(config(|_| {})).await;
    // Without `admin.api_key`, admin changes need a loopback peer: a 403
    // here would mean `ConnectInfo` is missing.
    let mut client = connect(&served).await;
    client
        .write_all(
            b"POST /admin/workers HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}",
        )
        .await
        .unwrap();
    let response = read_response(&mut client).await;
    assert!(response.starts_with("HTTP/1.1 4"), "{response}");
    assert!(!response.starts_with("HTTP/1.1 403"), "{response}");
}

/// A router whose client deadlines are far off, so that only the stop
/// closes its connections.
async fn serve_with_long_deadlines() -> Served {
    serve(config(|server| {
        server.client_header_timeout_ms = 60_000;
        server.client_body_timeout_ms = 60_000;
        server.keepalive_timeout_ms = 60_000;
    }))
    .await
}

/// Waits for a stopped router's serving to return.
async fn serving_ends(served: Served) {
    tokio::time::timeout(PATIENCE, served.serving)
        .await
        .expect("serving did not return after its connections ended")
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_closes_idle_connections_and_finishes_requests_in_flight() {
    let mut served = serve_with_long_deadlines().await;
    let mut idle = connect(&served).await;
    health_on(&mut idle).await;
    let mut busy = connect(&served).await;
    busy.write_all(b"POST /gated HTTP/1.1\r\nHost: router\r\nContent-Length: 10\r\n\r\n12345")
        .await
        .unwrap();
    tokio::time::timeout(PATIENCE, served.entered.recv())
        .await
        .expect("the request never reached its handler");

    drop(served.stop.take());
    assert!(read_until_closed(&mut idle).await.is_empty());
    busy.write_all(b"67890").await.unwrap();
    let answer = String::from_utf8(read_until_closed(&mut busy).await).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.ends_with("10 bytes"), "{answer}");
    serving_ends(served).await;
}

/// The same on the generation routes: a connection idle after an answer
/// closes at the stop, and one whose request is being read gets its
/// answer, then is closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_closes_idle_generation_connections_and_answers_requests_being_read() {
    let mut served = serve_with_long_deadlines().await;
    let request =
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nContent-Length: 2\r\n\r\n{}";
    let mut idle = connect(&served).await;
    idle.write_all(request).await.unwrap();
    let answer = read_response(&mut idle).await;
    assert!(answer.starts_with("HTTP/1.1 "), "{answer}");
    assert!(
        !answer.to_ascii_lowercase().contains("connection: close"),
        "kept alive before the stop: {answer}"
    );
    let mut busy = connect(&served).await;
    busy.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n",
    )
    .await
    .unwrap();
    // The router asks for the body once it is reading it.
    let mut continued = Vec::new();
    while find(&continued, b"\r\n\r\n").is_none() {
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(PATIENCE, busy.read(&mut byte))
            .await
            .expect("no 100 Continue")
            .unwrap();
        assert_eq!(read, 1, "closed before 100 Continue: {continued:?}");
        continued.push(byte[0]);
    }
    assert!(continued.starts_with(b"HTTP/1.1 100"), "{continued:?}");

    drop(served.stop.take());
    assert!(read_until_closed(&mut idle).await.is_empty());
    busy.write_all(b"{}").await.unwrap();
    let answer = String::from_utf8(read_until_closed(&mut busy).await).unwrap();
    assert!(answer.starts_with("HTTP/1.1 "), "{answer}");
    assert_eq!(
        whole_response_len(answer.as_bytes()),
        Some(answer.len()),
        "one whole answer: {answer}"
    );
    serving_ends(served).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2c_with_prior_knowledge_is_still_served() {
    let served = serve(config(|_| {})).await;
    let client = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let response = client
        .get(format!("http://{}/health", served.address))
        .send()
        .await
        .unwrap();
    assert_eq!(response.version(), reqwest::Version::HTTP_2);
    assert_eq!(response.status(), 200);
    assert_eq!(response.text().await.unwrap(), "ok");
}
