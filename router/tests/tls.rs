//! TLS through the router's real paths, with certificates made in each test
//! (rcgen: a CA, and leaves for `localhost` and `127.0.0.1` it signed):
//! clients over TLS to the listener (HTTP/1.1 and h2, streamed and whole
//! answers), plain HTTP on the TLS port, the certificate swapped by a
//! reload while an open connection keeps the old one, a bad file on reload
//! or at start; and the router to `https://` workers (mock engines behind a
//! TLS terminator) for generation, load polls, health checks and backend
//! detection, with a worker whose certificate another CA signed never
//! taking a request.

// Test helpers outside #[test] functions fail loudly on purpose.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use common::upstream::Upstream;
use common::{fast_config, wait_until, worker};
use http::{Method, StatusCode, Version};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use router::config::{RouterConfig, WorkerConfig};
use router::{App, RouterBuilder, RouterError};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinSet;

// Certificates.

/// A certificate authority made for one test.
struct TestCa {
    issuer: Issuer<'static, KeyPair>,
    certificate: CertificateDer<'static>,
    pem: String,
}

/// A leaf certificate and its key, as DER and as PEM.
struct Leaf {
    certificate: CertificateDer<'static>,
    key_der: Vec<u8>,
    certificate_pem: String,
    key_pem: String,
}

impl Leaf {
    fn key(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(self.key_der.clone().into())
    }
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
            certificate: certificate.der().clone(),
            issuer: Issuer::new(params, key),
        }
    }

    /// A leaf for `localhost` and `127.0.0.1`.
    fn leaf(&self) -> Leaf {
        let key = KeyPair::generate().unwrap();
        let certificate =
            CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
                .unwrap()
                .signed_by(&key, &self.issuer)
                .unwrap();
        Leaf {
            certificate: certificate.der().clone(),
            key_der: key.serialize_der(),
            certificate_pem: certificate.pem(),
            key_pem: key.serialize_pem(),
        }
    }

    /// A rustls client config that trusts this CA alone, offering `alpn`.
    fn client_config(&self, alpn: &[&[u8]]) -> rustls::ClientConfig {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.certificate.clone()).unwrap();
        let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
        config.alpn_protocols = alpn.iter().map(|id| id.to_vec()).collect();
        config
    }
}

/// A scratch directory of one test's own, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("router-tls-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `[server.tls]` naming `cert_file` and `key_file`.
fn listener_toml(cert_file: &Path, key_file: &Path) -> String {
    format!(
        "[server.tls]\ncert_file = {:?}\nkey_file = {:?}\n",
        cert_file.display().to_string(),
        key_file.display().to_string()
    )
}

// A router in-process, keeping its `App` (for reloads).

struct TlsRouter {
    app: Arc<App>,
    address: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
}

impl Drop for TlsRouter {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

async fn start(config: RouterConfig) -> TlsRouter {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let app = RouterBuilder::with_builtins()
        .start(config, None)
        .await
        .unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let served = app.clone();
    tokio::spawn(async move {
        let _ = router::serve(served, listener, async {
            let _ = stopped.await;
        })
        .await;
    });
    TlsRouter {
        app,
        address,
        stop: Some(stop),
    }
}

/// What came back over TLS: the HTTP version spoken, the status and the
/// whole body.
struct Answer {
    version: Version,
    status: StatusCode,
    body: String,
}

/// One request on a new TLS connection to the router's `port`, trusting
/// `ca` and offering `alpn` (`h2` or `http/1.1`); `json` is the body of a
/// POST.
async fn https_request(
    port: u16,
    ca: &TestCa,
    alpn: &[u8],
    path: &str,
    json: Option<&serde_json::Value>,
) -> Answer {
    let connector = tokio_rustls::TlsConnector::from(Arc::new(ca.client_config(&[alpn])));
    let tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let tls = connector
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .unwrap();
    let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2".as_slice());
    let (method, body) = match json {
        Some(json) => (Method::POST, Bytes::from(json.to_string())),
        None => (Method::GET, Bytes::new()),
    };
    let request = http::Request::builder()
        .method(method)
        .header("content-type", "application/json");
    let io = TokioIo::new(tls);
    let response = if h2 {
        let (mut sender, connection) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
                .await
                .unwrap();
        tokio::spawn(connection);
        let request = request
            .uri(format!("https://localhost:{port}{path}"))
            .body(Full::new(body))
            .unwrap();
        sender.send_request(request).await.unwrap()
    } else {
        let (mut sender, connection) = hyper::client::conn::http1::handshake(io).await.unwrap();
        tokio::spawn(connection);
        let request = request
            .uri(path)
            .header("host", format!("localhost:{port}"))
            .body(Full::new(body))
            .unwrap();
        sender.send_request(request).await.unwrap()
    };
    let (version, status) = (response.version(), response.status());
    let body = response.into_body().collect().await.unwrap().to_bytes();
    Answer {
        version,
        status,
        body: String::from_utf8(body.to_vec()).unwrap(),
    }
}

fn chat(stream: bool) -> serde_json::Value {
    serde_json::json!({
        "model": "test-model",
        "stream": stream,
        "messages": [{"role": "user", "content": "hello over TLS"}],
    })
}

/// A whole (non-streamed) chat completion with some text.
fn assert_whole_answer(answer: &serde_json::Value) {
    assert_eq!(answer["object"], "chat.completion", "{answer}");
    let content = answer["choices"][0]["message"]["content"].as_str();
    assert!(content.is_some_and(|text| !text.is_empty()), "{answer}");
}

/// A TLS connection to the router's port, made with `ca`'s trust; and the
/// leaf certificate the router presented.
async fn connect_tls(
    port: u16,
    ca: &TestCa,
) -> (
    tokio_rustls::client::TlsStream<TcpStream>,
    CertificateDer<'static>,
) {
    let connector =
        tokio_rustls::TlsConnector::from(Arc::new(ca.client_config(&[b"http/1.1".as_slice()])));
    let tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let stream = connector
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .unwrap();
    let presented = stream.get_ref().1.peer_certificates().unwrap()[0].clone();
    (stream, presented)
}

/// `GET /health` on a kept-alive HTTP/1.1 connection: the status line and
/// the body.
async fn health_on<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    stream: &mut S,
) -> (String, String) {
    stream
        .write_all(b"GET /health HTTP/1.1\r\nhost: localhost\r\n\r\n")
        .await
        .unwrap();
    let mut read = Vec::new();
    let head_end = loop {
        if let Some(at) = read.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        let mut chunk = [0u8; 1024];
        let n = stream.read(&mut chunk).await.unwrap();
        assert!(
            n > 0,
            "closed mid-head: {:?}",
            String::from_utf8_lossy(&read)
        );
        read.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8(read[..head_end].to_vec()).unwrap();
    let length: usize = head
        .lines()
        .find_map(|line| {
            let (name, value) = line.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse().unwrap())
        })
        .unwrap();
    while read.len() < head_end + length {
        let mut chunk = [0u8; 1024];
        let n = stream.read(&mut chunk).await.unwrap();
        assert!(n > 0, "closed mid-body");
        read.extend_from_slice(&chunk[..n]);
    }
    let status = head.lines().next().unwrap().to_owned();
    let body = String::from_utf8(read[head_end..head_end + length].to_vec()).unwrap();
    (status, body)
}

// The client listener.

/// One plain-HTTP worker, a router with `[server.tls]` in front of it.
async fn tls_router(scratch: &Scratch, leaf: &Leaf) -> (Upstream, TlsRouter) {
    let upstream = Upstream::start().await;
    let cert_file = scratch.write("cert.pem", &leaf.certificate_pem);
    let key_file = scratch.write("key.pem", &leaf.key_pem);
    let router = start(fast_config(
        vec![worker("sglang", &upstream.url)],
        &listener_toml(&cert_file, &key_file),
    ))
    .await;
    (upstream, router)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_reach_the_router_over_tls_with_http1_and_h2() {
    let scratch = Scratch::new("listener");
    let ca = TestCa::new("listener CA");
    let leaf = ca.leaf();
    let (upstream, router) = tls_router(&scratch, &leaf).await;
    let port = router.address.port();

    for (alpn, version) in [
        (b"http/1.1".as_slice(), Version::HTTP_11),
        (b"h2".as_slice(), Version::HTTP_2),
    ] {
        wait_until("the worker is healthy, seen over TLS", || async {
            https_request(port, &ca, alpn, "/readiness", None)
                .await
                .status
                == 200
        })
        .await;

        let whole =
            https_request(port, &ca, alpn, "/v1/chat/completions", Some(&chat(false))).await;
        assert_eq!(
            (whole.status, whole.version),
            (StatusCode::OK, version),
            "{}",
            whole.body
        );
        let answer: serde_json::Value = serde_json::from_str(&whole.body).unwrap();
        assert_whole_answer(&answer);

        let streamed =
            https_request(port, &ca, alpn, "/v1/chat/completions", Some(&chat(true))).await;
        assert_eq!(
            (streamed.status, streamed.version),
            (StatusCode::OK, version)
        );
        for token in ["t0", "t1", "t2", "t3"] {
            assert!(streamed.body.contains(token), "{}", streamed.body);
        }
        assert!(
            streamed.body.trim_end().ends_with("data: [DONE]"),
            "{}",
            streamed.body
        );
    }
    assert_eq!(upstream.requests(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_http_on_the_tls_port_is_closed_and_tls_clients_go_on() {
    let scratch = Scratch::new("plain-on-tls");
    let ca = TestCa::new("listener CA");
    let leaf = ca.leaf();
    let (_upstream, router) = tls_router(&scratch, &leaf).await;
    let port = router.address.port();

    // A TLS connection opened before, and kept open across the plain one.
    let (mut before, _) = connect_tls(port, &ca).await;
    assert_eq!(health_on(&mut before).await.1, "ok");

    let mut plain = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    plain
        .write_all(b"GET /health HTTP/1.1\r\nhost: localhost\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(20), plain.read_to_end(&mut answer))
        .await
        .expect("the router closes a plain connection on its TLS port");
    // Closed (maybe with a TLS alert, maybe reset), never answered in HTTP.
    assert!(
        read.is_err() || !answer.starts_with(b"HTTP/"),
        "{:?}",
        String::from_utf8_lossy(&answer)
    );

    assert_eq!(health_on(&mut before).await.1, "ok", "the open one goes on");
    let (mut after, _) = connect_tls(port, &ca).await;
    assert_eq!(health_on(&mut after).await.0, "HTTP/1.1 200 OK");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_gives_new_connections_the_new_certificate_and_keeps_open_ones() {
    let scratch = Scratch::new("reload");
    let ca = TestCa::new("listener CA");
    let first = ca.leaf();
    let (_upstream, router) = tls_router(&scratch, &first).await;
    let port = router.address.port();

    let (mut open, presented) = connect_tls(port, &ca).await;
    assert_eq!(presented, first.certificate);
    assert_eq!(health_on(&mut open).await.1, "ok");

    // The files are replaced with a new leaf, then SIGHUP's reload.
    let second = ca.leaf();
    scratch.write("cert.pem", &second.certificate_pem);
    scratch.write("key.pem", &second.key_pem);
    router.app.reload().await;
    let (mut fresh, presented) = connect_tls(port, &ca).await;
    assert_eq!(
        presented, second.certificate,
        "a new connection: the new one"
    );
    assert_eq!(health_on(&mut fresh).await.1, "ok");
    assert_eq!(
        health_on(&mut open).await.1,
        "ok",
        "the connection made before the reload keeps working"
    );

    // A certificate file that is not one: the reload is refused, and the
    // certificate in force stays.
    scratch.write("cert.pem", "-----BEGIN CERTIFICATE-----\ngarbage\n");
    router.app.reload().await;
    let (mut after_bad, presented) = connect_tls(port, &ca).await;
    assert_eq!(presented, second.certificate, "kept after a bad reload");
    assert_eq!(health_on(&mut after_bad).await.1, "ok");
    // A key that does not match: refused too.
    scratch.write("cert.pem", &second.certificate_pem);
    scratch.write("key.pem", &ca.leaf().key_pem);
    router.app.reload().await;
    let (_, presented) = connect_tls(port, &ca).await;
    assert_eq!(presented, second.certificate);
}

#[tokio::test]
async fn a_missing_certificate_or_ca_file_stops_the_start_naming_the_file() {
    let scratch = Scratch::new("missing");
    let ca = TestCa::new("listener CA");
    let key_file = scratch.write("key.pem", &ca.leaf().key_pem);
    let cert_file = scratch.0.join("no-such-cert.pem");
    let config = fast_config(Vec::new(), &listener_toml(&cert_file, &key_file));
    let error = RouterBuilder::with_builtins()
        .start(config, None)
        .await
        .unwrap_err();
    assert!(matches!(error, RouterError::ListenerTls(_)), "{error:?}");
    let chain = policy_core::error_chain(&error);
    assert!(
        chain.contains(&format!("{} does not exist", cert_file.display())),
        "{chain}"
    );

    let ca_file = scratch.0.join("no-such-ca.pem");
    let config = fast_config(
        Vec::new(),
        &format!(
            "[worker_tls]\nca_file = {:?}\n",
            ca_file.display().to_string()
        ),
    );
    let error = RouterBuilder::with_builtins()
        .start(config, None)
        .await
        .unwrap_err();
    assert!(
        matches!(&error, RouterError::WorkerTls(worker_h1::TlsConfigError::CaFileUnreadable { path, .. }) if path == &ca_file),
        "{error:?}"
    );
}

#[test]
fn the_tls_keys_come_from_the_environment_as_the_python_launcher_sets_them() {
    let environment = [
        ("ROUTER__SERVER__TLS__CERT_FILE", "/etc/router/cert.pem"),
        ("ROUTER__SERVER__TLS__KEY_FILE", "/etc/router/key.pem"),
        ("ROUTER__WORKER_TLS__CA_FILE", "/etc/router/workers-ca.pem"),
    ];
    let config = RouterConfig::load(router::Layers {
        environment: Some(
            environment
                .iter()
                .map(|(name, value)| ((*name).to_owned(), (*value).to_owned()))
                .collect(),
        ),
        ..router::Layers::default()
    })
    .unwrap();
    assert_eq!(
        config.server.tls,
        Some(router::config::ListenerTlsConfig {
            cert_file: "/etc/router/cert.pem".into(),
            key_file: "/etc/router/key.pem".into(),
        })
    );
    assert_eq!(
        config.worker_tls.ca_file.as_deref(),
        Some(Path::new("/etc/router/workers-ca.pem"))
    );
}

// The router to https:// workers.

/// A TLS terminator on loopback in front of a plain worker: each connection
/// completes a handshake with the certificate in force, then its bytes are
/// copied both ways. `present` changes that certificate and closes every
/// open connection.
struct Terminator {
    port: u16,
    acceptor: Arc<std::sync::Mutex<tokio_rustls::TlsAcceptor>>,
    connections: Arc<std::sync::Mutex<JoinSet<()>>>,
}

fn acceptor(leaf: &Leaf) -> tokio_rustls::TlsAcceptor {
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(vec![leaf.certificate.clone()], leaf.key())
    .unwrap();
    tokio_rustls::TlsAcceptor::from(Arc::new(config))
}

impl Terminator {
    async fn start(upstream: SocketAddr, leaf: &Leaf) -> Terminator {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let acceptor = Arc::new(std::sync::Mutex::new(acceptor(leaf)));
        let connections = Arc::new(std::sync::Mutex::new(JoinSet::new()));
        let (accepting, open) = (acceptor.clone(), connections.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let acceptor = accepting.lock().unwrap().clone();
                open.lock().unwrap().spawn(async move {
                    // A client that refuses the certificate ends here.
                    let Ok(mut client) = acceptor.accept(client).await else {
                        return;
                    };
                    let mut engine = TcpStream::connect(upstream).await.unwrap();
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut engine).await;
                });
            }
        });
        Terminator {
            port,
            acceptor,
            connections,
        }
    }

    /// Presents `leaf` from now on, and closes every open connection.
    fn present(&self, leaf: &Leaf) {
        *self.acceptor.lock().unwrap() = acceptor(leaf);
        self.connections.lock().unwrap().abort_all();
    }
}

/// Every worker entry of `/admin/workers`, by URL.
async fn workers(router: &TlsRouter) -> serde_json::Value {
    reqwest::get(format!("http://{}/admin/workers", router.address))
        .await
        .unwrap()
        .json::<serde_json::Value>()
        .await
        .unwrap()["workers"]
        .clone()
}

async fn worker_entry(router: &TlsRouter, url: &str) -> serde_json::Value {
    workers(router)
        .await
        .as_array()
        .unwrap()
        .iter()
        .find(|entry| entry["url"] == url)
        .unwrap_or_else(|| panic!("no worker {url}"))
        .clone()
}

/// The value of the router's metric line that starts with `series` (0 if
/// absent), read over plain HTTP.
async fn metric(router: &TlsRouter, series: &str) -> f64 {
    let text = reqwest::get(format!("http://{}/metrics", router.address))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .map_or(0.0, |value| value.parse().unwrap())
}

/// Sends a chat request to the router over plain HTTP: its status and body.
async fn chat_through(router: &TlsRouter, stream: bool) -> (u16, String) {
    let response = reqwest::Client::new()
        .post(format!("http://{}/v1/chat/completions", router.address))
        .json(&chat(stream))
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.text().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_workers_are_polled_checked_and_sent_requests_and_an_untrusted_one_never_is() {
    let scratch = Scratch::new("workers");
    let workers_ca = TestCa::new("workers CA");
    let stranger_ca = TestCa::new("a stranger's CA");
    let ca_file = scratch.write("workers-ca.pem", &workers_ca.pem);

    let (engine_a, engine_b, engine_c) = (
        Upstream::start().await,
        Upstream::start().await,
        Upstream::start().await,
    );
    let front_a = Terminator::start(engine_a.address, &workers_ca.leaf()).await;
    let front_b = Terminator::start(engine_b.address, &workers_ca.leaf()).await;
    let front_c = Terminator::start(engine_c.address, &stranger_ca.leaf()).await;
    // By name, its backend detected over https; and by IP address.
    let url_a = format!("https://localhost:{}", front_a.port);
    let url_b = format!("https://127.0.0.1:{}", front_b.port);
    let url_c = format!("https://127.0.0.1:{}", front_c.port);
    let detected = WorkerConfig {
        backend: None,
        ..worker("sglang", &url_a)
    };
    // Health is checked once when a worker is added, and then not for a
    // minute: what changes below is seen by requests alone.
    let config = fast_config(
        vec![detected, worker("sglang", &url_b), worker("sglang", &url_c)],
        &format!(
            "[worker_tls]\nca_file = {:?}\n[policy]\nkind = \"round_robin\"\n",
            ca_file.display().to_string()
        ),
    );
    let config = RouterConfig {
        health: router::config::HealthConfig {
            interval_ms: 60_000,
            ..config.health.clone()
        },
        ..config
    };
    let router = start(config).await;

    // Health checks and backend detection over https: A and B are in; C's
    // certificate is not trusted, so it never is.
    let a = worker_entry(&router, &url_a).await;
    assert_eq!(
        (a["backend"].as_str(), a["healthy"].as_bool()),
        (Some("sglang"), Some(true))
    );
    assert_eq!(worker_entry(&router, &url_b).await["healthy"], true);
    assert_eq!(worker_entry(&router, &url_c).await["healthy"], false);

    // Load polls over https: A's report shows what its engine says; C's
    // polls fail its handshake.
    engine_a.switches.waiting_reqs.store(7, Ordering::SeqCst);
    wait_until("A's load report arrives over https", || async {
        worker_entry(&router, &url_a).await["load"]["loads"][0]["num_waiting_reqs"] == 7
    })
    .await;
    wait_until("C's load polls fail", || async {
        worker_entry(&router, &url_c).await["poll_failures"]
            .as_u64()
            .is_some_and(|failures| failures > 0)
    })
    .await;

    // Generation over https, whole and streamed, on A and B in turn.
    for stream in [false, true, false, true] {
        let (status, body) = chat_through(&router, stream).await;
        assert_eq!(status, 200, "{body}");
        if stream {
            assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
        } else {
            assert_whole_answer(&serde_json::from_str(&body).unwrap());
        }
    }
    assert_eq!(engine_a.requests() + engine_b.requests(), 4);
    assert!(engine_a.requests() > 0 && engine_b.requests() > 0);
    assert_eq!(
        engine_c.requests(),
        0,
        "an untrusted worker never takes a request"
    );

    // B now presents a stranger's certificate, and drops its connections:
    // B is still in rotation, and each request sent to it fails the
    // handshake and goes to A instead, the client none the wiser.
    let (a_before, b_before) = (engine_a.requests(), engine_b.requests());
    front_b.present(&stranger_ca.leaf());
    for stream in [false, true, false, true] {
        let (status, body) = chat_through(&router, stream).await;
        assert_eq!(status, 200, "{body}");
    }
    assert_eq!(engine_b.requests(), b_before, "nothing reached B");
    assert_eq!(engine_a.requests(), a_before + 4);
    let failed_on_b = metric(
        &router,
        &format!("router_requests_total{{worker=\"{url_b}\",status=\"error\"}}"),
    )
    .await;
    assert!(
        failed_on_b >= 1.0,
        "B's handshake failures are counted: {failed_on_b}"
    );
    assert_eq!(engine_c.requests(), 0);
}
