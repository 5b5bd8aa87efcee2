//! The control plane's HTTP client to the workers: hyper's pooled client,
//! keep-alive connections per worker address ([`control_get`]: health
//! checks, backend detection, `/v1/models`). Generation requests are
//! forwarded, and loads polled, on `worker_h1` instead.

use std::sync::OnceLock;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::{Client, ResponseFuture};
use load_transport::http::{
    CappedBodyError, PooledHttpsClient, pooled_client, pooled_https_client, read_capped,
};

use crate::server::tls::WorkerTrust;

/// A request body: the client's bytes, kept so a retry can send them again.
pub(crate) type UpstreamBody = Full<Bytes>;

/// The control plane's client: plain HTTP for `http://` workers, and for
/// `https://` ones a client over TLS with the router's worker trust, made
/// on the first such call (so a router of plain workers never reads the
/// system's certificate store).
#[derive(Debug)]
pub(crate) struct UpstreamClient {
    plain: Client<HttpConnector, UpstreamBody>,
    https: OnceLock<PooledHttpsClient<UpstreamBody>>,
    trust: WorkerTrust,
    connect_timeout: Duration,
}

impl UpstreamClient {
    /// Sends `request` on the client its URL's scheme needs.
    fn request(
        &self,
        request: http::Request<UpstreamBody>,
    ) -> Result<ResponseFuture, worker_h1::TlsConfigError> {
        if request.uri().scheme_str() != Some("https") {
            return Ok(self.plain.request(request));
        }
        let https = match self.https.get() {
            Some(https) => https,
            None => {
                // Fails (and is tried again next call) only when the
                // system's roots cannot be loaded; both loads are once per
                // process.
                let tls = self.trust.for_https()?;
                self.https
                    .get_or_init(|| pooled_https_client(self.connect_timeout, &tls))
            }
        };
        Ok(https.request(request))
    }
}

/// Builds the control plane's client, trusting `https://` workers by
/// `trust`. `connect_timeout` bounds the TCP connect; each call's deadline
/// is its caller's.
pub(crate) fn upstream_client(connect_timeout: Duration, trust: WorkerTrust) -> UpstreamClient {
    UpstreamClient {
        plain: pooled_client(connect_timeout),
        https: OnceLock::new(),
        trust,
        connect_timeout,
    }
}

/// Most bytes a control-plane answer (`/health`, `/metrics`, `/v1/models`)
/// may have; a worker that sends more is treated as not answering.
pub(crate) const CONTROL_BODY_LIMIT_BYTES: usize = 8 * 1024 * 1024;

/// Why a control-plane GET got no answer.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ControlGetError {
    #[error("{url} is not a valid URI")]
    InvalidUri { url: String },
    #[error("{url} did not answer within {timeout:?}")]
    Timeout { url: String, timeout: Duration },
    #[error("request to {url} failed")]
    Request {
        url: String,
        #[source]
        source: hyper_util::client::legacy::Error,
    },
    #[error("no trust for https:// worker {url}")]
    NoTrust {
        url: String,
        #[source]
        source: worker_h1::TlsConfigError,
    },
    #[error("the answer from {url} broke off")]
    Body {
        url: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("the answer from {url} exceeds {limit_bytes} bytes")]
    TooLarge { url: String, limit_bytes: usize },
}

/// One control-plane GET: the status and the whole body (at most
/// [`CONTROL_BODY_LIMIT_BYTES`]), all within `timeout`.
pub(crate) async fn control_get(
    client: &UpstreamClient,
    url: &str,
    timeout: Duration,
) -> Result<(http::StatusCode, Bytes), ControlGetError> {
    let request = control_request(http::Method::GET, url, None, Bytes::new())?;
    control_call(client, request, timeout, CONTROL_BODY_LIMIT_BYTES).await
}

/// A control-plane request to `url`, with the worker's `authorization`
/// when it has one.
pub(crate) fn control_request(
    method: http::Method,
    url: &str,
    authorization: Option<&http::HeaderValue>,
    body: Bytes,
) -> Result<http::Request<UpstreamBody>, ControlGetError> {
    let uri: http::Uri = url.parse().map_err(|_| ControlGetError::InvalidUri {
        url: url.to_owned(),
    })?;
    let has_body = !body.is_empty();
    let mut request = http::Request::new(UpstreamBody::new(body));
    *request.method_mut() = method;
    *request.uri_mut() = uri;
    if let Some(authorization) = authorization {
        request
            .headers_mut()
            .insert(http::header::AUTHORIZATION, authorization.clone());
    }
    if has_body {
        request.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
    }
    Ok(request)
}

/// Sends a control-plane `request`: the status and the whole body (at most
/// `limit_bytes`), all within `timeout`.
pub(crate) async fn control_call(
    client: &UpstreamClient,
    request: http::Request<UpstreamBody>,
    timeout: Duration,
    limit_bytes: usize,
) -> Result<(http::StatusCode, Bytes), ControlGetError> {
    let url = request.uri().to_string();
    let url = url.as_str();
    let exchange = async {
        let sent = client
            .request(request)
            .map_err(|source| ControlGetError::NoTrust {
                url: url.to_owned(),
                source,
            })?;
        let response = sent.await.map_err(|source| ControlGetError::Request {
            url: url.to_owned(),
            source,
        })?;
        let status = response.status();
        let body = read_capped(response.into_body(), limit_bytes)
            .await
            .map_err(|error| match error {
                CappedBodyError::TooLarge { limit_bytes } => ControlGetError::TooLarge {
                    url: url.to_owned(),
                    limit_bytes,
                },
                CappedBodyError::Broken(source) => ControlGetError::Body {
                    url: url.to_owned(),
                    source,
                },
            })?;
        Ok((status, body))
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .unwrap_or_else(|_elapsed| {
            Err(ControlGetError::Timeout {
                url: url.to_owned(),
                timeout,
            })
        })
}

#[cfg(test)]
mod tests {
    use axum::Router;
    use axum::routing::get;

    use super::*;

    /// Serves `router` on a free loopback port; returns its base URL.
    async fn serve(router: Router) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, router).await });
        format!("http://{address}")
    }

    fn client() -> UpstreamClient {
        upstream_client(Duration::from_secs(5), WorkerTrust::default())
    }

    #[tokio::test]
    async fn an_answer_comes_back_with_its_status_and_body() {
        let base = serve(Router::new().route("/health", get(|| async { "ok" }))).await;
        let (status, body) =
            control_get(&client(), &format!("{base}/health"), Duration::from_secs(5))
                .await
                .unwrap();
        assert_eq!((status.as_u16(), &body[..]), (200, &b"ok"[..]));
        let (status, _) = control_get(&client(), &format!("{base}/nope"), Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(status.as_u16(), 404, "a status is an answer, not an error");
    }

    #[tokio::test]
    async fn a_body_over_the_cap_is_refused() {
        let base = serve(Router::new().route("/metrics", get(|| async { "x".repeat(100) }))).await;
        let request = control_request(
            http::Method::GET,
            &format!("{base}/metrics"),
            None,
            Bytes::new(),
        )
        .unwrap();
        let error = control_call(&client(), request, Duration::from_secs(5), 10)
            .await
            .unwrap_err();
        assert!(
            matches!(
                error,
                ControlGetError::TooLarge {
                    limit_bytes: 10,
                    ..
                }
            ),
            "{error:?}"
        );
    }

    #[tokio::test]
    async fn silence_is_a_timeout_and_a_closed_port_a_request_error() {
        // Accepts connections and never answers.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let silent = format!("http://{}/health", listener.local_addr().unwrap());
        let _held = tokio::spawn(async move {
            let mut open = Vec::new();
            while let Ok((stream, _)) = listener.accept().await {
                open.push(stream);
            }
        });
        let error = control_get(&client(), &silent, Duration::from_millis(200))
            .await
            .unwrap_err();
        assert!(
            matches!(error, ControlGetError::Timeout { .. }),
            "{error:?}"
        );

        let closed = {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            format!("http://{}/health", listener.local_addr().unwrap())
        };
        let error = control_get(&client(), &closed, Duration::from_secs(5))
            .await
            .unwrap_err();
        assert!(
            matches!(error, ControlGetError::Request { .. }),
            "{error:?}"
        );
        let error = control_get(&client(), "not a uri", Duration::from_secs(5))
            .await
            .unwrap_err();
        assert!(
            matches!(error, ControlGetError::InvalidUri { .. }),
            "{error:?}"
        );
    }
}
