//! `https://` workers: a hyper HTTP/1.1 server behind tokio-rustls, with a
//! certificate for `localhost` and `127.0.0.1` signed by a CA made here.
//! Requests through a pool that trusts the CA file read fixed-length and
//! chunked (streamed) bodies and reuse their connection; a pool trusting
//! another CA, or reaching the server by a name its certificate does not
//! hold, fails the handshake with its own typed error.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use worker_h1::{HeaderLines, Outgoing, Pool, SendError, TlsConfigError, WorkerTls};

/// A certificate authority made for one test.
struct TestCa {
    issuer: Issuer<'static, KeyPair>,
    pem: String,
}

impl TestCa {
    fn new(name: &str) -> TestCa {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let certificate = params.self_signed(&key).unwrap();
        TestCa {
            pem: certificate.pem(),
            issuer: Issuer::new(params, key),
        }
    }

    /// A leaf certificate for `names` (DNS names or IP addresses) and its key.
    fn leaf(&self, names: &[&str]) -> (CertificateDer<'static>, PrivateKeyDer<'static>) {
        let key = KeyPair::generate().unwrap();
        let names: Vec<String> = names.iter().map(|name| (*name).to_owned()).collect();
        let certificate = CertificateParams::new(names)
            .unwrap()
            .signed_by(&key, &self.issuer)
            .unwrap();
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        (certificate.der().clone(), key)
    }

    /// The CA's certificate in a PEM file of its own.
    fn write_pem(&self, name: &str) -> PathBuf {
        let path = std::env::temp_dir().join(format!(
            "worker-h1-tls-test-{}-{name}.pem",
            std::process::id()
        ));
        std::fs::write(&path, &self.pem).unwrap();
        path
    }
}

/// A response body sent as one chunk per piece (no length: chunked).
struct Pieces(VecDeque<Bytes>);

impl Body for Pieces {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Ready(
            self.get_mut()
                .0
                .pop_front()
                .map(|piece| Ok(Frame::data(piece))),
        )
    }
}

/// `/stream` answers three chunks; anything else `hello` with a length.
async fn answer(
    request: Request<Incoming>,
) -> Result<Response<http_body_util::Either<http_body_util::Full<Bytes>, Pieces>>, Infallible> {
    let body = if request.uri().path() == "/stream" {
        http_body_util::Either::Right(Pieces(VecDeque::from([
            Bytes::from_static(b"data: 1\n\n"),
            Bytes::from_static(b"data: 2\n\n"),
            Bytes::from_static(b"data: [DONE]\n\n"),
        ])))
    } else {
        http_body_util::Either::Left(http_body_util::Full::new(Bytes::from_static(b"hello")))
    };
    Ok(Response::new(body))
}

/// An HTTP/1.1 server over TLS on loopback with `certificate`; its address
/// and the count of TCP connections it accepted.
async fn https_server(
    certificate: CertificateDer<'static>,
    key: PrivateKeyDer<'static>,
) -> (SocketAddr, Arc<AtomicUsize>) {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![certificate], key)
        .unwrap();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let acceptor = TlsAcceptor::from(Arc::new(config));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let counted = accepted.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            counted.fetch_add(1, Ordering::SeqCst);
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                // A client that refused the certificate ends here.
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tls), hyper::service::service_fn(answer))
                    .await;
            });
        }
    });
    (address, accepted)
}

fn get<'a>(path: &'a str, headers: &'a HeaderLines, body: &'a Bytes) -> Outgoing<'a> {
    Outgoing {
        method: &Method::GET,
        path,
        query: None,
        headers,
        authorization: None,
        body,
    }
}

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

#[tokio::test]
async fn requests_through_a_trusted_ca_read_both_framings_on_one_connection() {
    let ca = TestCa::new("worker-h1 test CA");
    let (certificate, key) = ca.leaf(&["localhost", "127.0.0.1"]);
    let (address, accepted) = https_server(certificate, key).await;
    let ca_file = ca.write_pem("trusted");
    let tls = WorkerTls::from_ca_file(&ca_file).unwrap();
    // By IP address and by name: the certificate holds both.
    for url in [
        format!("https://127.0.0.1:{}", address.port()),
        format!("https://localhost:{}/", address.port()),
    ] {
        let before = accepted.load(Ordering::SeqCst);
        let pool = Arc::new(Pool::with_tls(&url, tls.clone()));
        assert!(pool.is_usable() && pool.is_tls(), "{url}");
        let (headers, body) = (HeaderLines::default(), Bytes::new());
        for _ in 0..3 {
            let response = worker_h1::send(&pool, &get("/fixed", &headers, &body), CONNECT_TIMEOUT)
                .await
                .unwrap();
            assert_eq!(response.status, 200);
            let read = response.body.collect().await.unwrap().to_bytes();
            assert_eq!(&read[..], b"hello");

            let mut response =
                worker_h1::send(&pool, &get("/stream", &headers, &body), CONNECT_TIMEOUT)
                    .await
                    .unwrap();
            let mut streamed = Vec::new();
            while let Some(data) = std::future::poll_fn(|cx| response.body.poll_data(cx)).await {
                streamed.extend_from_slice(&data.unwrap());
            }
            assert_eq!(&streamed[..], b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n");
        }
        assert_eq!(
            accepted.load(Ordering::SeqCst) - before,
            1,
            "six requests on one kept-alive TLS connection ({url})"
        );
    }
    std::fs::remove_file(&ca_file).unwrap();
}

/// The rustls error inside a handshake failure.
fn rustls_error(error: &SendError) -> &rustls::Error {
    let SendError::Handshake { source, .. } = error else {
        panic!("not a handshake failure: {error:?}");
    };
    source
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        .unwrap_or_else(|| panic!("no rustls error in {source:?}"))
}

#[tokio::test]
async fn an_untrusted_or_misnamed_certificate_fails_the_handshake_with_its_own_error() {
    let ca = TestCa::new("the worker's CA");
    let (certificate, key) = ca.leaf(&["localhost", "127.0.0.1"]);
    let (address, _) = https_server(certificate, key).await;
    let url = format!("https://127.0.0.1:{}", address.port());
    let (headers, body) = (HeaderLines::default(), Bytes::new());

    let other_ca = TestCa::new("another CA").write_pem("other");
    let pool = Arc::new(Pool::with_tls(
        &url,
        WorkerTls::from_ca_file(&other_ca).unwrap(),
    ));
    let error = worker_h1::send(&pool, &get("/", &headers, &body), CONNECT_TIMEOUT)
        .await
        .unwrap_err();
    assert!(
        matches!(
            rustls_error(&error),
            rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer)
        ),
        "{error:?}"
    );
    assert!(
        error
            .to_string()
            .contains(&format!("127.0.0.1:{}", address.port())),
        "{error}"
    );
    std::fs::remove_file(&other_ca).unwrap();

    // Trusted, but for other names than the one asked for.
    let (certificate, key) = ca.leaf(&["engine.internal"]);
    let (address, _) = https_server(certificate, key).await;
    let ca_file = ca.write_pem("misnamed");
    let pool = Arc::new(Pool::with_tls(
        &format!("https://127.0.0.1:{}", address.port()),
        WorkerTls::from_ca_file(&ca_file).unwrap(),
    ));
    let error = worker_h1::send(&pool, &get("/", &headers, &body), CONNECT_TIMEOUT)
        .await
        .unwrap_err();
    assert!(
        matches!(
            rustls_error(&error),
            rustls::Error::InvalidCertificate(
                rustls::CertificateError::NotValidForNameContext { .. }
            ) | rustls::Error::InvalidCertificate(rustls::CertificateError::NotValidForName)
        ),
        "{error:?}"
    );
    std::fs::remove_file(&ca_file).unwrap();
}

#[tokio::test]
async fn a_plain_server_on_an_https_url_fails_the_handshake() {
    // An HTTP/1.1 server answers the ClientHello with text, not TLS.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut tcp, _)) = listener.accept().await {
            use tokio::io::AsyncWriteExt;
            let _ = tcp
                .write_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
                .await;
        }
    });
    let ca_file = TestCa::new("any CA").write_pem("plain-server");
    let pool = Arc::new(Pool::with_tls(
        &format!("https://127.0.0.1:{}", address.port()),
        WorkerTls::from_ca_file(&ca_file).unwrap(),
    ));
    let (headers, body) = (HeaderLines::default(), Bytes::new());
    let error = worker_h1::send(&pool, &get("/", &headers, &body), CONNECT_TIMEOUT)
        .await
        .unwrap_err();
    assert!(matches!(error, SendError::Handshake { .. }), "{error:?}");
    std::fs::remove_file(&ca_file).unwrap();
}

#[test]
fn a_missing_ca_file_is_a_typed_error_naming_it() {
    let missing = std::env::temp_dir().join("worker-h1-no-such-ca.pem");
    let error = WorkerTls::from_ca_file(&missing).unwrap_err();
    assert!(
        matches!(&error, TlsConfigError::CaFileUnreadable { path, .. } if path == &missing),
        "{error:?}"
    );
    assert!(
        error.to_string().contains("worker-h1-no-such-ca.pem"),
        "{error}"
    );
}
