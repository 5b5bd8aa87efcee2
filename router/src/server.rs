//! Serving: the HTTP routes, TLS on the client listener ([`tls`]), the
//! background tasks, signals and graceful shutdown.

pub(crate) mod tls;

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::extract::{ConnectInfo, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use bytes::Bytes;
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use hyper::service::Service as _;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;

use policy_core::error_chain;
use prometheus_client::metrics::gauge::Gauge;

use crate::app::App;
use crate::client_body::BodyReadError;
use crate::config::{RouterConfig, ServerConfig};
use crate::error::RouterError;
use crate::monitor::{run_health_checker, run_load_monitor, run_outlier_prober};
use crate::proxy::ProxyBody;
use crate::{admin, proxy};
use tls::ListenerTls;

/// Every route the router serves besides the generation routes
/// ([`proxy::GENERATE_PATHS`]), which [`serve_routes`] sends to
/// [`proxy::handle`] before any route table. `/metrics` is among them
/// unless it has a listener of its own (`server.metrics_port`,
/// [`serve_metrics`]).
pub(crate) fn routes(app: Arc<App>) -> Router {
    let mut routes = Router::new()
        .route("/v1/models", get(proxy::models))
        .route("/health", get(health))
        .route("/readiness", get(readiness));
    if app.config.server.metrics_port.is_none() {
        routes = routes.route("/metrics", get(metrics));
    }
    routes.merge(admin::routes(app.clone())).with_state(app)
}

async fn health() -> &'static str {
    "ok"
}

/// Ready when at least one worker is healthy.
async fn readiness(State(app): State<Arc<App>>) -> Response {
    if !app.topology.load().candidates().is_empty() {
        (StatusCode::OK, "ready").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "no healthy worker").into_response()
    }
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        app.metrics.render(),
    )
        .into_response()
}

/// Adds the configured workers to `app` (a worker that cannot be added is
/// an error: the operator named it), and starts the background tasks.
pub(crate) async fn start(app: Arc<App>) -> Result<Arc<App>, RouterError> {
    for worker in app.config.workers.clone() {
        app.add_worker(worker).await?;
    }
    tokio::spawn(run_load_monitor(app.clone()));
    tokio::spawn(run_health_checker(app.clone()));
    tokio::spawn(run_outlier_prober(app.clone()));
    tokio::spawn(crate::admission::run_ticker(app.clone()));
    crate::replica_sync::start(app.clone()).await;
    Ok(app)
}

/// Serves `app` on `listener` (HTTP/1.1 kept alive, and h2c, under the
/// `[server]` section's client limits; with `[server.tls]`, both over TLS
/// instead) until `shutdown` resolves (for example [`termination`]), then
/// stops accepting and lets in-flight requests finish for up to
/// `server.shutdown_grace_ms`.
pub async fn serve(
    app: Arc<App>,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RouterError> {
    let routes = routes(app.clone());
    serve_routes(app, routes, listener, shutdown).await
}

/// Serves `app` on `listener` with hyper's HTTP/1.1 (kept alive) and h2c
/// until `shutdown` resolves, then stops accepting, closes idle
/// connections, lets in-flight requests finish for up to
/// `shutdown_grace_ms` and returns.
///
/// With `[server.tls]` ([`App::listener_tls`]), each connection first
/// completes a TLS handshake (ALPN `h2` and `http/1.1`), in its own task
/// and within `client_header_timeout_ms` of its accept, with the
/// certificate in force when it was accepted; then it is served exactly as
/// a plain one. A client that fails the handshake (plain HTTP on the TLS
/// port, say) is closed and logged at debug.
///
/// Every request on every connection takes one path: a head refused
/// before its body is read (a transfer coding besides `chunked`: 501;
/// `Expect: 100-continue` with a length over `body_limit_bytes`: 413) is
/// answered at once; anything addressed to one of
/// [`proxy::GENERATE_PATHS`] goes to [`proxy::handle`] with hyper's own
/// request (no route table, extractor, boxed body or boxed future);
/// everything else goes through `routes` ([`routes`], or a table of the
/// caller's own), whose handlers see the peer as `ConnectInfo<SocketAddr>`.
///
/// Under `server`'s client limits:
/// - At most `max_connections` connections are open at once; more wait in
///   the kernel's listen backlog, not accepted.
/// - A connection's first request head must arrive within
///   `client_header_timeout_ms` of its accept; a later one within that long
///   of its first byte.
/// - A kept-alive connection with no request in flight is closed after
///   `keepalive_timeout_ms` without a byte either way.
///
/// Request bodies are the handlers' to bound ([`crate::client_body`]).
pub(crate) async fn serve_routes(
    app: Arc<App>,
    routes: Router,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RouterError> {
    let server = app.config.server.clone();
    let open_connections = app.metrics.open_connections.clone();
    let handler = Handler {
        routes: TowerToHyperService::new(routes),
        app: app.clone(),
        generate: true,
    };
    let listener_tls = app.listener_tls.as_ref();
    serve_handler(
        handler,
        &server,
        listener,
        listener_tls,
        open_connections,
        shutdown,
    )
    .await
}

/// Serves `GET /metrics` alone on `listener`, the listener of
/// `server.metrics_port` (every other path is 404 there), under the same
/// client limits as [`serve`], until `shutdown` resolves. With
/// `server.metrics_port` set, [`serve`] leaves `/metrics` out.
pub async fn serve_metrics(
    app: Arc<App>,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RouterError> {
    let server = app.config.server.clone();
    let routes = Router::new()
        .route("/metrics", get(metrics))
        .with_state(app.clone());
    let handler = Handler {
        routes: TowerToHyperService::new(routes),
        app,
        generate: false,
    };
    // Scrapes are not client connections: a gauge of their own,
    // unregistered; and plain HTTP, whatever `[server.tls]` says.
    serve_handler(handler, &server, listener, None, Gauge::default(), shutdown).await
}

/// Where a connection's requests go.
#[derive(Debug, Clone)]
struct Handler {
    routes: TowerToHyperService<Router>,
    app: Arc<App>,
    /// Whether the generation paths go to the proxy (not on the metrics
    /// listener).
    generate: bool,
}

impl Handler {
    /// Starts serving `request`: picks its route now, and returns the
    /// future of its response.
    fn call(
        &self,
        peer: SocketAddr,
        guard: RequestGuard,
        mut request: http::Request<Incoming>,
    ) -> impl Future<Output = Result<http::Response<GuardedBody>, Infallible>> + Send + use<> {
        let route = if let Some(response) = refused(&request, &self.app.config.server) {
            Routed::Refused(response)
        } else if self.generate && proxy::generate_path(request.uri().path()).is_some() {
            Routed::Generate(self.app.clone(), request)
        } else {
            request.extensions_mut().insert(ConnectInfo(peer));
            Routed::Routes(self.routes.call(request))
        };
        async move {
            let response = match route {
                Routed::Refused(response) => response.map(ProxyBody::Boxed),
                Routed::Generate(app, request) => {
                    let (parts, body) = request.into_parts();
                    proxy::handle(app, parts, body).await
                }
                Routed::Routes(routed) => match routed.await {
                    Ok(response) => response.map(ProxyBody::Boxed),
                    Err(never) => match never {},
                },
            };
            Ok(response.map(|body| GuardedBody {
                body,
                _guard: guard,
            }))
        }
    }
}

/// A request on its way: refused, to the proxy directly, or through the
/// routes.
// Built once per request inside its future, never moved about; boxing the
// request would cost the allocation the direct path exists to save (and
// axum's future, `F`, holds a request too).
#[allow(clippy::large_enum_variant)]
enum Routed<F> {
    Refused(Response),
    Generate(Arc<App>, http::Request<Incoming>),
    Routes(F),
}

/// The answer to a request refused on its head alone, before a byte of its
/// body is read (so no `100 Continue` goes out), with `Connection: close`:
/// what the client sends next cannot be framed as a request. hyper has
/// already refused what RFC 9112 calls malformed (400: a bad or repeated
/// `Content-Length`, `Transfer-Encoding` not ending in `chunked`, obs-fold;
/// 431: a head over [`MAX_HEAD_BYTES`]); here:
/// - 501 for a transfer coding other than `chunked` (`gzip, chunked`):
///   hyper would decode the chunks and hand on the still-compressed body
///   as if it were plain (RFC 9112 section 6.1);
/// - 400 for `chunked` applied twice (RFC 9112 section 6.1);
/// - 413 for `Expect: 100-continue` with a declared length over
///   `server.body_limit_bytes`: the client is waiting to be told, so
///   nothing is discarded (RFC 9110 section 10.1.1).
fn refused(request: &http::Request<Incoming>, server: &ServerConfig) -> Option<Response> {
    let headers = request.headers();
    let mut chunked = 0usize;
    for value in headers.get_all(header::TRANSFER_ENCODING) {
        let Ok(value) = value.to_str() else {
            return Some(refusal(
                StatusCode::BAD_REQUEST,
                "Transfer-Encoding is not ASCII".to_owned(),
            ));
        };
        for coding in value.split(',').map(str::trim).filter(|c| !c.is_empty()) {
            if coding.eq_ignore_ascii_case("chunked") {
                chunked += 1;
            } else {
                return Some(refusal(
                    StatusCode::NOT_IMPLEMENTED,
                    format!(
                        "transfer coding {coding:?} is not supported; send the body with \
                         Content-Length or Transfer-Encoding: chunked alone"
                    ),
                ));
            }
        }
    }
    if chunked > 1 {
        return Some(refusal(
            StatusCode::BAD_REQUEST,
            "Transfer-Encoding applies chunked more than once".to_owned(),
        ));
    }
    let expects_continue = headers
        .get(header::EXPECT)
        .is_some_and(|value| value.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    let limit = u64::try_from(server.body_limit_bytes).unwrap_or(u64::MAX);
    if expects_continue && http_body::Body::size_hint(request.body()).lower() > limit {
        return Some(
            BodyReadError::TooLarge {
                limit_bytes: server.body_limit_bytes,
            }
            .response(),
        );
    }
    None
}

/// An OpenAI-shaped error that closes the connection.
fn refusal(status: StatusCode, message: String) -> Response {
    let mut response = proxy::error_response(status, "invalid_request_error", message);
    response.headers_mut().insert(
        header::CONNECTION,
        header::HeaderValue::from_static("close"),
    );
    response
}

/// Serves `handler` as [`serve_routes`] describes, over TLS with
/// `listener_tls`.
async fn serve_handler(
    handler: Handler,
    server: &ServerConfig,
    listener: TcpListener,
    listener_tls: Option<&ListenerTls>,
    open_connections: Gauge,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RouterError> {
    let deadlines = Deadlines {
        header: server.client_header_timeout(),
        keepalive: server.keepalive_timeout(),
    };
    let grace = server.shutdown_grace();
    let slots = Arc::new(Semaphore::new(
        server.max_connections.clamp(1, Semaphore::MAX_PERMITS),
    ));
    let builder = Arc::new(connection_builder());
    let (stopping_tx, stopping_rx) = watch::channel(false);
    let mut connections = JoinSet::new();
    let mut shutdown = pin!(shutdown);
    loop {
        tokio::select! {
            biased;
            () = &mut shutdown => break,
            Some(ended) = connections.join_next() => log_connection_end(ended),
            (stream, peer, slot) = accept_within_cap(&listener, &slots) => {
                connections.spawn(serve_connection(Connection {
                    builder: builder.clone(),
                    stream,
                    // The certificate in force at the accept.
                    tls: listener_tls.map(ListenerTls::acceptor),
                    peer,
                    handler: handler.clone(),
                    deadlines,
                    stopping: stopping_rx.clone(),
                    _slot: slot,
                    _open: OpenConnection::new(&open_connections),
                }));
            }
        }
    }
    // New connections are refused from here on.
    drop(listener);
    let _ = stopping_tx.send(true);
    let drained = tokio::time::timeout(grace, async {
        while let Some(ended) = connections.join_next().await {
            log_connection_end(ended);
        }
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            ?grace,
            "shutdown grace period over; closing remaining requests"
        );
        connections.shutdown().await;
    }
    Ok(())
}

/// On SIGHUP, re-reads the `[server.tls]` certificate and key files and
/// the config file's `[policy]` and `[admission]` sections, and swaps them
/// in ([`App::reload`]); anything invalid is logged and the old one kept.
#[cfg(unix)]
pub(crate) async fn reload_on_sighup(app: Arc<App>) {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut hangups) = signal(SignalKind::hangup()) else {
        tracing::warn!("cannot listen for SIGHUP; policy reload by signal is off");
        return;
    };
    while hangups.recv().await.is_some() {
        app.reload().await;
    }
}

impl App {
    /// What SIGHUP does: reads the client listener's certificate and key
    /// again (the files `[server.tls]` named at start) for connections
    /// accepted from now on, and the config file's `[policy]` and
    /// `[admission]` sections, and swaps each in. Whatever cannot be
    /// loaded is logged and the one in force kept; open connections keep
    /// the certificate they were accepted with.
    pub async fn reload(&self) {
        reload_listener_tls(self);
        reload_policy_from_file(self).await;
    }
}

/// Reads the client listener's certificate and key again and swaps them in.
fn reload_listener_tls(app: &App) {
    let Some(tls) = &app.listener_tls else {
        return;
    };
    let files = tls.files();
    match tls.reload() {
        Ok(()) => tracing::info!(
            cert_file = %files.cert_file.display(),
            key_file = %files.key_file.display(),
            "listener certificate reloaded: new connections get it"
        ),
        Err(error) => tracing::error!(
            error = %error_chain(&error),
            "listener certificate reload rejected; keeping the current one"
        ),
    }
}

/// Reads the policy section from the config file (over the defaults) and
/// swaps it in.
pub(crate) async fn reload_policy_from_file(app: &App) {
    let Some(path) = app.config_file.clone() else {
        tracing::warn!("SIGHUP: no --config file to reload the policy from");
        return;
    };
    let reloaded = RouterConfig::load(crate::config::Layers {
        file: Some(&path),
        ..crate::config::Layers::default()
    });
    let config = match reloaded {
        Ok(config) => config,
        Err(error) => {
            tracing::error!(error = %error_chain(&error), "config reload rejected; keeping the current policy and admission");
            return;
        }
    };
    if let Err(error) = app.swap_policy(config.policy).await {
        tracing::error!(error = %error_chain(&error), "policy reload rejected; keeping the current policy");
    }
    if let Err(error) = app.swap_admission(config.admission) {
        tracing::error!(error = %error_chain(&error), "admission reload rejected; keeping the current section");
    }
}

/// Resolves on SIGTERM or SIGINT.
pub async fn termination() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut terminate) => {
                tokio::select! {
                    _ = terminate.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

// Client connections: the accept loop's cap, and one watchdog per connection
// for the header and keep-alive deadlines.

/// Most bytes of a request head, and of hyper's read buffer (hyper's
/// default is about 400 KB): a longer head is answered 431.
const MAX_HEAD_BYTES: usize = 64 * 1024;

/// The connection-level deadlines.
#[derive(Debug, Clone, Copy)]
struct Deadlines {
    header: Duration,
    keepalive: Duration,
}

impl Deadlines {
    /// When a connection's one timer looks next, from `now`: at `due` (the
    /// deadline, if any), but no later than the shorter of the two timeouts
    /// from now. Nothing re-arms the timer between its firings, and any
    /// deadline that begins meanwhile (a request ends, a new head's first
    /// byte arrives) lies at least that far past its start, so the timer
    /// fires in time for it and is then re-armed to it exactly.
    fn next_check(&self, due: Option<Instant>, now: Instant) -> Instant {
        let bound = now + self.header.min(self.keepalive);
        due.map_or(bound, |due| due.max(now).min(bound))
    }
}

/// hyper's HTTP/1.1 (kept alive) and h2c.
fn connection_builder() -> Builder<TokioExecutor> {
    let mut builder = Builder::new(TokioExecutor::new());
    // hyper's own header_read_timeout restarts its clock whenever a
    // connection goes idle (hyper 1.x proto/h1/conn.rs, State::idle), so it
    // would also close kept-alive connections after the header deadline,
    // whatever keepalive_timeout says. The watchdog enforces both instead.
    // Set to None explicitly: hyper's 30 s default, with no timer, only logs
    // a warning on every connection.
    builder
        .http1()
        .keep_alive(true)
        .header_read_timeout(None)
        .max_buf_size(MAX_HEAD_BYTES);
    builder
}

/// Takes a connection slot, then accepts: while every slot is taken, new
/// connections wait in the listen backlog, costing the router nothing.
async fn accept_within_cap(
    listener: &TcpListener,
    slots: &Arc<Semaphore>,
) -> (TcpStream, SocketAddr, OwnedSemaphorePermit) {
    loop {
        let Ok(slot) = slots.clone().acquire_owned().await else {
            // The semaphore is never closed; wait for shutdown instead.
            return std::future::pending().await;
        };
        match listener.accept().await {
            Ok((stream, peer)) => return (stream, peer, slot),
            // The client gave up while in the backlog: nothing to do.
            Err(error)
                if matches!(
                    error.kind(),
                    io::ErrorKind::ConnectionAborted
                        | io::ErrorKind::ConnectionReset
                        | io::ErrorKind::ConnectionRefused
                ) => {}
            Err(error) => {
                // Most likely out of file descriptors: retrying at once would
                // spin. Connections closing in the meantime free some.
                tracing::error!(%error, "cannot accept a connection; retrying in 1 s");
                drop(slot);
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

fn log_connection_end(ended: Result<(), tokio::task::JoinError>) {
    if let Err(error) = ended
        && error.is_panic()
    {
        tracing::error!(%error, "a client connection's task panicked");
    }
}

/// One accepted client connection and what serving it needs.
struct Connection {
    builder: Arc<Builder<TokioExecutor>>,
    stream: TcpStream,
    /// With `[server.tls]`: the handshake to make first.
    tls: Option<TlsAcceptor>,
    peer: SocketAddr,
    handler: Handler,
    deadlines: Deadlines,
    stopping: watch::Receiver<bool>,
    /// Held until the connection ends, then frees its place under the cap.
    _slot: OwnedSemaphorePermit,
    _open: OpenConnection,
}

/// Counts one open connection in the `open_connections` gauge while it lives.
struct OpenConnection(Gauge);

impl OpenConnection {
    fn new(gauge: &Gauge) -> OpenConnection {
        gauge.inc();
        OpenConnection(gauge.clone())
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Serves one connection until it ends, misses a deadline, or the server
/// stops. Returning drops the connection, which closes the socket.
async fn serve_connection(connection: Connection) {
    let Connection {
        builder,
        stream,
        tls,
        peer,
        handler,
        deadlines,
        stopping,
        _slot,
        _open,
    } = connection;
    let accepted = Instant::now();
    // Streams are many small writes: without TCP_NODELAY, Nagle holds each
    // one back until the client's (delayed) ACK of the previous, up to 40 ms.
    if let Err(error) = stream.set_nodelay(true) {
        tracing::debug!(%error, "cannot set TCP_NODELAY on an accepted connection");
    }
    let mut serving = Serving {
        builder,
        accepted,
        peer,
        handler,
        deadlines,
        stopping,
    };
    let Some(acceptor) = tls else {
        return serve_stream(stream, serving).await;
    };
    // The handshake counts toward the first request head's deadline, so a
    // client that stalls in it is closed as one that sends no head is.
    let handshake_by = accepted + deadlines.header;
    let handshake = tokio::time::timeout_at(handshake_by, acceptor.accept(stream));
    let stream = tokio::select! {
        biased;
        handshake = handshake => match handshake {
            Ok(Ok(stream)) => stream,
            Ok(Err(error)) => {
                tracing::debug!(%peer, %error, "client TLS handshake failed");
                return;
            }
            Err(_elapsed) => {
                tracing::debug!(%peer, "closing a client connection: TLS handshake not done within client_header_timeout_ms");
                return;
            }
        },
        _ = serving.stopping.wait_for(|stopping| *stopping) => return,
    };
    serve_stream(stream, serving).await;
}

/// What serving an accepted connection's stream needs besides the stream.
struct Serving {
    builder: Arc<Builder<TokioExecutor>>,
    accepted: Instant,
    peer: SocketAddr,
    handler: Handler,
    deadlines: Deadlines,
    stopping: watch::Receiver<bool>,
}

/// Serves one connection's stream (TCP, or TLS over it) from its accept
/// until it ends, misses a deadline, or the server stops.
async fn serve_stream<S>(stream: S, serving: Serving)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let Serving {
        builder,
        accepted,
        peer,
        handler,
        deadlines,
        mut stopping,
    } = serving;
    let activity = Arc::new(Activity::new(accepted));
    let io = TokioIo::new(TrackedIo {
        stream,
        activity: activity.clone(),
    });
    // Each request is counted in flight from its head until hyper drops
    // its response body ([`GuardedBody`]).
    let requests = activity.clone();
    let service = hyper::service::service_fn(move |request| {
        handler.call(peer, requests.request_started(), request)
    });
    let mut conn = pin!(builder.serve_connection(io, service));
    let mut draining = false;
    let mut stop = pin!(async move { stopping.wait_for(|stopping| *stopping).await.is_ok() });
    // One timer for the connection's life, re-armed only when it fires, at
    // the deadline it then finds, or sooner (see `Activity::next_check`):
    // a request's start and end touch no timer and wake nothing, so a
    // kept-alive connection costs no timer or task work per request.
    let mut timer = pin!(tokio::time::sleep_until(
        activity.next_check(deadlines, Instant::now())
    ));
    loop {
        // The connection first, in a fixed order: no random draw on every
        // wake (a wake is almost always the connection's socket).
        tokio::select! {
            biased;
            ended = conn.as_mut() => {
                if let Err(error) = ended {
                    tracing::debug!(%peer, error = %error, "client connection ended with an error");
                }
                return;
            }
            () = timer.as_mut() => {
                let now = Instant::now();
                if activity.deadline(deadlines).is_some_and(|due| due <= now) {
                    tracing::debug!(%peer, "closing a client connection: request head late or idle past keepalive_timeout_ms");
                    return;
                }
                timer.as_mut().reset(activity.next_check(deadlines, now));
            }
            stopped = stop.as_mut(), if !draining => {
                // Also once the server is gone without a word: the future
                // is done either way and must not be polled again.
                draining = true;
                if !stopped {
                    continue;
                }
                if activity.is_idle() {
                    return;
                }
                // Finish the requests in flight, then close.
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

/// What a connection is doing, for its deadlines. Reads and writes update it
/// from the connection's task; requests start and end wherever hyper polls
/// them (their own tasks under HTTP/2).
#[derive(Debug)]
struct Activity {
    state: Mutex<ActivityState>,
}

#[derive(Debug)]
struct ActivityState {
    accepted: Instant,
    in_flight: usize,
    served_any: bool,
    /// The last byte read or written with no request in flight.
    idle_since: Instant,
    /// The first byte read since the connection last went idle: a new
    /// request head has begun.
    head_started: Option<Instant>,
}

impl Activity {
    fn new(now: Instant) -> Activity {
        Activity {
            state: Mutex::new(ActivityState {
                accepted: now,
                in_flight: 0,
                served_any: false,
                idle_since: now,
                head_started: None,
            }),
        }
    }

    /// When the watchdog looks next ([`Deadlines::next_check`]).
    fn next_check(&self, deadlines: Deadlines, now: Instant) -> Instant {
        deadlines.next_check(self.deadline(deadlines), now)
    }

    /// When the connection is due to close, if nothing changes; `None`
    /// while a request is in flight (its body and response have their own
    /// deadlines).
    fn deadline(&self, deadlines: Deadlines) -> Option<Instant> {
        let state = self.state.lock();
        if state.in_flight > 0 {
            None
        } else if !state.served_any {
            // The first head is counted from the accept: a client that never
            // sends a byte is closed after the header deadline too.
            state.accepted.checked_add(deadlines.header)
        } else if let Some(started) = state.head_started {
            started.checked_add(deadlines.header)
        } else {
            state.idle_since.checked_add(deadlines.keepalive)
        }
    }

    fn is_idle(&self) -> bool {
        self.state.lock().in_flight == 0
    }

    fn on_read(&self) {
        let mut state = self.state.lock();
        // Bytes after a response are the next request's head (or the
        // unread rest of the last body, which may take no longer).
        if state.in_flight == 0 && state.served_any && state.head_started.is_none() {
            state.head_started = Some(Instant::now());
        }
    }

    fn on_write(&self) {
        let mut state = self.state.lock();
        // A response still flushing to a slow reader is not idleness.
        if state.in_flight == 0 && state.served_any {
            state.idle_since = Instant::now();
        }
    }

    fn request_started(self: &Arc<Self>) -> RequestGuard {
        let mut state = self.state.lock();
        state.in_flight += 1;
        state.served_any = true;
        state.head_started = None;
        RequestGuard(self.clone())
    }

    fn request_ended(&self) {
        let mut state = self.state.lock();
        state.in_flight = state.in_flight.saturating_sub(1);
        if state.in_flight == 0 {
            // Bytes that arrived during the request (a pipelined head) are
            // not timed as a head: the keep-alive deadline covers them.
            state.idle_since = Instant::now();
            state.head_started = None;
        }
    }
}

/// A request in flight, from its head to its response's last byte handed to
/// hyper (or the request being dropped).
#[derive(Debug)]
struct RequestGuard(Arc<Activity>);

impl Drop for RequestGuard {
    fn drop(&mut self) {
        self.0.request_ended();
    }
}

/// The socket (or the TLS stream over it), telling the connection's
/// [`Activity`] of each read and write.
#[derive(Debug)]
struct TrackedIo<S> {
    stream: S,
    activity: Arc<Activity>,
}

impl<S: AsyncRead + Unpin> AsyncRead for TrackedIo<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.stream).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            this.activity.on_read();
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for TrackedIo<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.stream).poll_write(cx, buf);
        if matches!(polled, Poll::Ready(Ok(written)) if written > 0) {
            this.activity.on_write();
        }
        polled
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.stream).poll_write_vectored(cx, bufs);
        if matches!(polled, Poll::Ready(Ok(written)) if written > 0) {
            this.activity.on_write();
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

/// A response body that keeps its request counted as in flight until hyper
/// has taken its last frame and dropped it.
#[derive(Debug)]
struct GuardedBody {
    body: ProxyBody,
    _guard: RequestGuard,
}

impl http_body::Body for GuardedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod slow_clients;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_timer_looks_in_time_for_every_deadline() {
        let ms = Duration::from_millis;
        let deadlines = Deadlines {
            header: ms(60_000),
            keepalive: ms(300),
        };
        let start = Instant::now();
        let activity = Arc::new(Activity::new(start));
        assert_eq!(activity.deadline(deadlines), Some(start + ms(60_000)));
        assert_eq!(
            activity.next_check(deadlines, start),
            start + ms(300),
            "no later than the shorter timeout: a keep-alive deadline may follow"
        );
        let guard = activity.request_started();
        assert_eq!(activity.deadline(deadlines), None, "a request in flight");
        drop(guard);
        let idle_since = activity.state.lock().idle_since;
        assert_eq!(
            activity.deadline(deadlines),
            Some(idle_since + ms(300)),
            "idle after a request: the keep-alive deadline"
        );
        let later = idle_since + ms(400);
        assert_eq!(
            deadlines.next_check(activity.deadline(deadlines), later),
            later,
            "a deadline already past is looked at now"
        );
        activity.on_read();
        let started = activity.state.lock().head_started;
        assert!(started.is_some(), "a later head has begun");
        assert_eq!(
            activity.deadline(deadlines),
            started.map(|started| started + ms(60_000)),
            "a begun head has the header deadline"
        );
    }
}
