//! How late an SSE event reaches the client through the router: an engine
//! on loopback writes events one at a time, each only after the client has
//! seen the one before, and the delay from the engine's write to the
//! client's read is measured and printed. The time is reported, never
//! asserted (the machine is shared); the test asserts that every event
//! arrives, whole and in order, within a generous deadline.

// Test helpers outside #[test] functions fail loudly on purpose.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{fast_config, start_router, wait_until, worker};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Mutex, mpsc};

/// Events written one at a time.
const EVENTS: usize = 200;
/// How long any one event may take before the test fails: far beyond any
/// latency, only so that a lost event fails instead of hanging.
const DEADLINE: Duration = Duration::from_secs(20);

/// An engine speaking just enough HTTP/1.1 by hand that the moment each
/// event goes to the socket is known: `/health` answers 200, `/v1/loads`
/// an SGLang report, and a generation request a chunked SSE stream whose
/// events are written when `write` says, each write's time sent back.
struct HandEngine {
    url: String,
    /// Tells the streaming connection to write the next event.
    write: mpsc::UnboundedSender<usize>,
    /// The time each event was written, in order.
    written: mpsc::UnboundedReceiver<Instant>,
}

async fn hand_engine() -> HandEngine {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (write, writes) = mpsc::unbounded_channel::<usize>();
    let (written_tx, written) = mpsc::unbounded_channel::<Instant>();
    let writes = Arc::new(Mutex::new(Some(writes)));
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let writes = writes.clone();
            let written_tx = written_tx.clone();
            tokio::spawn(serve(stream, writes, written_tx));
        }
    });
    HandEngine {
        url,
        write,
        written,
    }
}

/// Serves one connection's requests until it closes.
async fn serve(
    mut stream: TcpStream,
    writes: Arc<Mutex<Option<mpsc::UnboundedReceiver<usize>>>>,
    written: mpsc::UnboundedSender<Instant>,
) {
    stream.set_nodelay(true).unwrap();
    let mut buffer = Vec::new();
    loop {
        let Some((head, body_len)) = read_head(&mut stream, &mut buffer).await else {
            return;
        };
        // The body follows the head; it is not needed, only read past.
        while buffer.len() < body_len {
            let mut more = [0u8; 4096];
            match stream.read(&mut more).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buffer.extend_from_slice(&more[..n]),
            }
        }
        buffer.drain(..body_len);
        let answer = |body: &str| {
            format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            )
        };
        if head.starts_with("GET /health") {
            stream.write_all(answer("{}").as_bytes()).await.unwrap();
        } else if head.starts_with("GET /v1/loads") {
            let loads = r#"{"timestamp": "", "version": "test", "dp_rank_count": 1, "loads": [{"dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 0, "num_waiting_uncached_tokens": 0, "token_usage": 0.1, "gen_throughput": 2000.0}]}"#;
            stream.write_all(answer(loads).as_bytes()).await.unwrap();
        } else if head.starts_with("POST ") {
            let Some(mut writes) = writes.lock().await.take() else {
                panic!("one stream only");
            };
            stream
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
                .await
                .unwrap();
            while let Some(index) = writes.recv().await {
                let event = if index == EVENTS {
                    "data: [DONE]\n\n".to_owned()
                } else {
                    format!("data: {{\"seq\":{index}}}\n\n")
                };
                let chunk = format!("{:x}\r\n{event}\r\n", event.len());
                written.send(Instant::now()).unwrap();
                stream.write_all(chunk.as_bytes()).await.unwrap();
                if index == EVENTS {
                    stream.write_all(b"0\r\n\r\n").await.unwrap();
                    break;
                }
            }
        } else {
            stream
                .write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                .await
                .unwrap();
        }
    }
}

/// Reads one request head from the connection; its text and body length.
async fn read_head(stream: &mut TcpStream, buffer: &mut Vec<u8>) -> Option<(String, usize)> {
    loop {
        if let Some(end) = buffer.windows(4).position(|window| window == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buffer[..end]).into_owned();
            buffer.drain(..end + 4);
            let body_len = head
                .lines()
                .filter_map(|line| line.split_once(':'))
                .find(|(name, _)| name.trim().eq_ignore_ascii_case("content-length"))
                .and_then(|(_, value)| value.trim().parse().ok())
                .unwrap_or(0);
            return Some((head, body_len));
        }
        let mut more = [0u8; 4096];
        match stream.read(&mut more).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buffer.extend_from_slice(&more[..n]),
        }
    }
}

fn percentile(sorted: &[Duration], fraction: f64) -> Duration {
    let index = ((sorted.len() as f64 - 1.0) * fraction).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_event_reaches_the_client_as_soon_as_it_is_written() {
    let mut engine = hand_engine().await;
    let router = start_router(fast_config(vec![worker("sglang", &engine.url)], "")).await;
    wait_until("the worker is in rotation", || async {
        router.in_rotation_count().await == 1
    })
    .await;

    // The client: a raw connection, so that nothing between the socket and
    // the clock buffers.
    let mut client = TcpStream::connect(router.address).await.unwrap();
    client.set_nodelay(true).unwrap();
    let body =
        r#"{"model":"test-model","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    client.write_all(request.as_bytes()).await.unwrap();

    let mut received = Vec::new();
    let mut latencies = Vec::with_capacity(EVENTS);
    for index in 0..=EVENTS {
        engine.write.send(index).unwrap();
        let marker = if index == EVENTS {
            "data: [DONE]".to_owned()
        } else {
            format!("data: {{\"seq\":{index}}}")
        };
        // Read until this event is in; the clock stops at the read that
        // brought its last byte.
        let arrived = tokio::time::timeout(DEADLINE, async {
            loop {
                if String::from_utf8_lossy(&received).contains(&marker) {
                    return Instant::now();
                }
                let mut more = [0u8; 16 * 1024];
                let n = client.read(&mut more).await.unwrap();
                assert!(n > 0, "the router closed the stream before event {index}");
                received.extend_from_slice(&more[..n]);
            }
        })
        .await
        .unwrap_or_else(|_| panic!("event {index} did not arrive within {DEADLINE:?}"));
        let written = engine.written.recv().await.unwrap();
        latencies.push(arrived.saturating_duration_since(written));
    }

    // Whole and in order: every event once, in sequence.
    let text = String::from_utf8_lossy(&received);
    let mut from = 0;
    for index in 0..EVENTS {
        let marker = format!("data: {{\"seq\":{index}}}\n\n");
        let at = text[from..]
            .find(&marker)
            .unwrap_or_else(|| panic!("event {index} missing or out of order"));
        from += at + marker.len();
    }
    assert_eq!(text.matches("data: ").count(), EVENTS + 1);

    latencies.sort();
    let report = format!(
        "engine write -> client read through the router, {} events one at a time on loopback: \
         p50 {:?}, p90 {:?}, p99 {:?}, max {:?}",
        latencies.len(),
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.9),
        percentile(&latencies, 0.99),
        percentile(&latencies, 1.0),
    );
    println!("{report}");
    eprintln!("{report}");
}
