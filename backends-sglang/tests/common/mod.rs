//! Loopback servers for the source tests, bound on 127.0.0.1:0.

// Helpers may unwrap: a panic is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::Duration;

use policy_core::SourceOptions;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Serves an axum router; the server lives as long as the test's runtime.
pub async fn serve_http(router: axum::Router) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await });
    addr
}

/// A server that accepts connections, reads what is sent, and never answers.
pub async fn serve_silent() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut buffer = [0_u8; 4096];
                while let Ok(n) = stream.read(&mut buffer).await {
                    if n == 0 {
                        break;
                    }
                }
            });
        }
    });
    addr
}

/// A server that answers every connection with `response` verbatim, then
/// closes it (for bodies shorter than their `Content-Length`).
pub async fn serve_raw(response: &'static str) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut buffer = [0_u8; 4096];
                let _ = stream.read(&mut buffer).await;
                let _ = stream.write_all(response.as_bytes()).await;
                let _ = stream.shutdown().await;
            });
        }
    });
    addr
}

/// An address nothing listens on.
pub async fn refused_addr() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    addr
}

/// Options for tests that expect an answer: a deadline generous enough for a
/// loaded CI machine.
pub fn options() -> SourceOptions {
    SourceOptions {
        deadline: Duration::from_secs(10),
        ..SourceOptions::default()
    }
}

/// Options for tests that expect the deadline to pass: a short one, so that
/// they end quickly.
pub fn short_deadline() -> SourceOptions {
    SourceOptions {
        deadline: Duration::from_millis(200),
        ..SourceOptions::default()
    }
}
