//! The data-path HTTP client: hyper's pooled client, keep-alive connections
//! per worker address, and nothing else on the way. Control-plane calls
//! (health checks, backend detection, `/v1/models`) use `App::client`.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};

/// A request body: the client's bytes, kept so a retry can send them again.
pub type UpstreamBody = Full<Bytes>;

/// The client requests are forwarded with.
pub type UpstreamClient = Client<HttpConnector, UpstreamBody>;

/// How long an idle upstream connection stays pooled.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// Builds the forwarding client. `connect_timeout` bounds the TCP connect;
/// the response head's deadline is the proxy's own.
pub fn upstream_client(connect_timeout: Duration) -> UpstreamClient {
    let mut connector = HttpConnector::new();
    // Streams are many small writes; Nagle would hold each one back.
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(connect_timeout));
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(POOL_IDLE_TIMEOUT)
        .pool_timer(TokioTimer::new())
        .build(connector)
}
