//! Loopback servers for the source tests, bound on 127.0.0.1:0; those a
//! gRPC source's tests use too are `load_transport::test_support`'s.

// Helpers may unwrap: a panic is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(dead_code, unused_imports)]

use std::net::SocketAddr;

use load_transport::test_support::serve_tcp;
pub use load_transport::test_support::{options, refused_addr, serve_silent, short_deadline};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Serves an axum router; the server lives as long as the test's runtime.
pub async fn serve_http(router: axum::Router) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await });
    addr
}

/// A server that answers every connection with `response` verbatim, then
/// closes it (for bodies shorter than their `Content-Length`).
pub async fn serve_raw(response: &'static str) -> SocketAddr {
    serve_tcp(move |mut stream| async move {
        let mut buffer = [0_u8; 4096];
        let _ = stream.read(&mut buffer).await;
        let _ = stream.write_all(response.as_bytes()).await;
        let _ = stream.shutdown().await;
    })
    .await
}
