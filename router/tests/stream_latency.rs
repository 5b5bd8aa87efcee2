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
use tokio::net::TcpStream;
use tokio::sync::{Mutex, mpsc};

/// Events written one at a time.
const EVENTS: usize = 200;
/// How long any one event may take before the test fails: far beyond any
/// latency, only so that a lost event fails instead of hanging.
const DEADLINE: Duration = Duration::from_secs(20);

/// An engine on a raw socket, so that the moment each event goes to the
/// socket is known: a generation request gets a chunked SSE stream whose
/// events are written when `write` says, each write's time sent back.
struct HandEngine {
    url: String,
    /// Tells the streaming connection to write the next event.
    write: mpsc::UnboundedSender<usize>,
    /// The time each event was written, in order.
    written: mpsc::UnboundedReceiver<Instant>,
}

async fn hand_engine() -> HandEngine {
    let (write, writes) = mpsc::unbounded_channel::<usize>();
    let (written_tx, written) = mpsc::unbounded_channel::<Instant>();
    let writes = Arc::new(Mutex::new(Some(writes)));
    let url = common::hand::hand_engine(move |stream| {
        stream_events(stream, writes.clone(), written_tx.clone())
    })
    .await;
    HandEngine {
        url,
        write,
        written,
    }
}

/// Answers the one generation request: an event per `writes` message.
async fn stream_events(
    mut stream: TcpStream,
    writes: Arc<Mutex<Option<mpsc::UnboundedReceiver<usize>>>>,
    written: mpsc::UnboundedSender<Instant>,
) -> Option<TcpStream> {
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
    Some(stream)
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
