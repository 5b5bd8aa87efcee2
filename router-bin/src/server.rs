//! Serving: the HTTP routes, the background tasks, signals and graceful
//! shutdown.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use tokio::net::TcpListener;

use crate::app::App;
use crate::config::RouterConfig;
use crate::error::RouterError;
use crate::monitor::{error_chain, run_health_checker, run_load_monitor};
use crate::{admin, proxy};

/// Every route the router serves.
pub fn routes(app: Arc<App>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(proxy::generate))
        .route("/v1/completions", post(proxy::generate))
        .route("/generate", post(proxy::generate))
        .route("/v1/models", get(proxy::models))
        .route("/health", get(health))
        .route("/readiness", get(readiness))
        .route("/metrics", get(metrics))
        .merge(admin::routes(app.clone()))
        .with_state(app)
}

async fn health() -> &'static str {
    "ok"
}

/// Ready when at least one worker is healthy.
async fn readiness(State(app): State<Arc<App>>) -> Response {
    if app.workers.any_healthy() {
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

/// A running router.
#[derive(Debug)]
pub struct Running {
    pub app: Arc<App>,
    pub address: SocketAddr,
}

/// Builds the state, adds the configured workers (a worker that cannot be
/// added is an error: the operator named it), and starts the background tasks.
pub async fn start(
    config: RouterConfig,
    config_file: Option<std::path::PathBuf>,
) -> Result<Arc<App>, RouterError> {
    let app = App::new(config, config_file)?;
    for worker in app.config.workers.clone() {
        app.add_worker(worker).await?;
    }
    tokio::spawn(run_load_monitor(app.clone()));
    tokio::spawn(run_health_checker(app.clone()));
    Ok(app)
}

/// Serves `app` on `listener` until `shutdown` resolves, then stops accepting
/// and lets in-flight requests finish for up to the grace period.
pub async fn serve(
    app: Arc<App>,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RouterError> {
    let grace = app.config.server.shutdown_grace();
    let (stopping_tx, stopping_rx) = tokio::sync::watch::channel(false);
    let signal = async move {
        shutdown.await;
        let _ = stopping_tx.send(true);
    };
    // Streams are many small writes: without TCP_NODELAY, Nagle holds each
    // one back until the client's (delayed) ACK of the previous, up to 40 ms.
    let listener = listener.tap_io(|tcp| {
        if let Err(error) = tcp.set_nodelay(true) {
            tracing::debug!(%error, "cannot set TCP_NODELAY on an accepted connection");
        }
    });
    let server = axum::serve(
        listener,
        routes(app).into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(signal);
    let mut stopping = stopping_rx;
    let deadline = async move {
        let _ = stopping.wait_for(|stopping| *stopping).await;
        tokio::time::sleep(grace).await;
    };
    tokio::select! {
        result = server => result.map_err(RouterError::Serve),
        () = deadline => {
            tracing::warn!(?grace, "shutdown grace period over; closing remaining requests");
            Ok(())
        }
    }
}

/// Re-reads the config file's `[policy]` section on SIGHUP and swaps the
/// policy; an invalid section is logged and the old policy kept.
#[cfg(unix)]
pub async fn reload_on_sighup(app: Arc<App>) {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut hangups) = signal(SignalKind::hangup()) else {
        tracing::warn!("cannot listen for SIGHUP; policy reload by signal is off");
        return;
    };
    while hangups.recv().await.is_some() {
        reload_policy_from_file(&app).await;
    }
}

/// Reads the policy section from the config file (over the defaults) and
/// swaps it in.
pub async fn reload_policy_from_file(app: &Arc<App>) {
    let Some(path) = app.config_file.clone() else {
        tracing::warn!("SIGHUP: no --config file to reload the policy from");
        return;
    };
    let reloaded = RouterConfig::load(crate::config::Layers {
        file: Some(&path),
        ..crate::config::Layers::default()
    });
    let result = match reloaded {
        Ok(config) => app.swap_policy(config.policy).await,
        Err(error) => Err(error.into()),
    };
    if let Err(error) = result {
        tracing::error!(error = %error_chain(&error), "policy reload rejected; keeping the current policy");
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
