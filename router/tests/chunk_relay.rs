//! A worker's chunked stream reaches the client whole through the router's
//! HTTP/1.1 server, however the worker framed its chunks and however its
//! writes split them: every form RFC 9112 allows (an extension, upper-case
//! hex, a chunk split across writes, trailers) is decoded and framed again.
//! The client is reqwest (hyper), which refuses a malformed chunked answer.

// Test helpers outside #[test] functions fail loudly on purpose.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{fast_config, start_router, wait_until, worker};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

fn event(seq: usize) -> String {
    format!("data: {{\"seq\":{seq}}}\n\n")
}

/// The stream's writes, each one or more chunks or part of one, framed in
/// every way the router has to read; and the SSE text they carry.
fn odd_stream() -> (Vec<Vec<u8>>, String) {
    let events: Vec<String> = (0..8).map(event).collect();
    let plain = |text: &str| format!("{:x}\r\n{text}\r\n", text.len());
    let split = plain(&events[3]);
    let writes = vec![
        plain(&events[0]),
        format!("{:x};name=value\r\n{}\r\n", events[1].len(), events[1]),
        format!("{:X}\r\n{}\r\n", events[2].len(), events[2]),
        split[..1].to_owned(),
        split[1..8].to_owned(),
        split[8..].to_owned(),
        [plain(&events[4]), plain(&events[5]), plain(&events[6])].concat(),
        format!(
            "{:x} \r\n{}\r\n0\r\nx-trailer: 1\r\n\r\n",
            events[7].len(),
            events[7]
        ),
    ];
    (
        writes.into_iter().map(String::into_bytes).collect(),
        events.concat(),
    )
}

/// The same events in plain chunks, all in one write (as an engine that
/// has them all at once sends them).
fn plain_stream() -> (Vec<Vec<u8>>, String) {
    let events: Vec<String> = (0..64).map(event).collect();
    let mut wire: String = events
        .iter()
        .map(|text| format!("{:x}\r\n{text}\r\n", text.len()))
        .collect();
    wire.push_str("0\r\n\r\n");
    (vec![wire.into_bytes()], events.concat())
}

/// An engine that answers every generation request with `writes`, a
/// moment apart so that they tend to arrive as separate reads.
async fn engine(writes: Vec<Vec<u8>>) -> String {
    let writes = Arc::new(writes);
    common::hand::hand_engine(move |mut stream: TcpStream| {
        let writes = writes.clone();
        async move {
            stream
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
                .await
                .unwrap();
            for write in writes.iter() {
                stream.write_all(write).await.unwrap();
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            Some(stream)
        }
    })
    .await
}

async fn streams_through_the_router(writes: Vec<Vec<u8>>, expected: &str) {
    let url = engine(writes).await;
    let router = start_router(fast_config(vec![worker("sglang", &url)], "")).await;
    wait_until("the worker is in rotation", || async {
        router.in_rotation_count().await == 1
    })
    .await;
    // Twice: the worker's connection goes back to the pool after a
    // stream, and carries the next one.
    let client = reqwest::Client::new();
    for attempt in 0..2 {
        let response = client
            .post(format!("{}/v1/chat/completions", router.base))
            .json(&serde_json::json!({
                "model": "test-model",
                "stream": true,
                "messages": [{"role": "user", "content": "hi"}],
            }))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "attempt {attempt}");
        assert_eq!(
            response.text().await.unwrap(),
            expected,
            "attempt {attempt}"
        );
    }
    // And on a connection that has served admin requests before.
    let response = router.chat("hi", true).await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.text().await.unwrap(), expected);
    wait_until("every request is done", || async {
        router.workers_json().await["workers"][0]["in_flight"] == 0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunks_framed_any_way_and_split_anywhere_reach_the_client_whole() {
    let (writes, expected) = odd_stream();
    streams_through_the_router(writes, &expected).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_plain_chunks_reaches_the_client_whole() {
    let (writes, expected) = plain_stream();
    streams_through_the_router(writes, &expected).await;
}
