//! The HTTP side of a mock engine: the accept loop and connections (and
//! `refuse-connections`), the routes, `/health`, `/v1/models`, and the
//! response helpers. The endpoints live in [`super::loads`],
//! [`super::control`] and [`super::generation`].

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderValue, Request, Response, StatusCode, header};
use axum::routing::{get, post};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tower::ServiceExt;

use super::control::{admitted, get_fault, set_fault, stats};
use super::generation::{chat_completions, completions, generate, health_generate};
use super::loads::{sglang_loads, sglang_metrics, tokenspeed_metrics, vllm_metrics};
use super::{EngineShared, FaultMode, Flavour};

pub(super) type Shared = Arc<EngineShared>;

/// Accepts connections until the engine stops, serving each with the router;
/// under [`FaultMode::RefuseConnections`] every request but `/control/*`
/// closes its connection unanswered. A kill drops every open connection at
/// once; a graceful stop lets them finish for a while first.
pub(super) async fn serve(listener: TcpListener, shared: Shared) {
    let router = router(shared.clone());
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let _ = stream.set_nodelay(true);
                let router = router.clone();
                let shared = shared.clone();
                connections.spawn(serve_connection(stream, router, shared));
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            () = shared.stopped() => break,
        }
    }
    drop(listener);
    if shared.killed() {
        // Joining, not just aborting: every socket is closed on return.
        connections.abort_all();
        while connections.join_next().await.is_some() {}
        return;
    }
    let drained = tokio::time::timeout(Duration::from_secs(2), async {
        while connections.join_next().await.is_some() {}
    });
    if drained.await.is_err() {
        connections.abort_all();
    }
}

async fn serve_connection(stream: tokio::net::TcpStream, router: Router, shared: Shared) {
    let service_shared = shared.clone();
    let service = hyper::service::service_fn(move |request: Request<Incoming>| {
        let router = router.clone();
        let refuse = service_shared.fault() == FaultMode::RefuseConnections
            && !request.uri().path().starts_with("/control/");
        async move {
            if refuse {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::ConnectionRefused,
                    "refusing connections (fault mode)",
                ));
            }
            match router.oneshot(request).await {
                Ok(response) => Ok(response),
                Err(never) => match never {},
            }
        }
    });
    let builder = auto::Builder::new(TokioExecutor::new());
    let connection = builder.serve_connection(TokioIo::new(stream), service);
    let mut connection = std::pin::pin!(connection);
    tokio::select! {
        _ = connection.as_mut() => {}
        () = shared.stopped() => {
            // Killed: return, dropping the socket mid-whatever.
            if !shared.killed() {
                connection.as_mut().graceful_shutdown();
                let _ = connection.await;
            }
        }
    }
}

fn router(shared: Shared) -> Router {
    let mut router = Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/generate", post(generate))
        .route("/control/fault", post(set_fault).get(get_fault))
        .route("/control/stats", get(stats))
        .route("/control/admitted", get(admitted));
    match shared.config.flavour {
        Flavour::Sglang => {
            router = router
                .route("/v1/loads", get(sglang_loads))
                .route("/metrics", get(sglang_metrics))
                .route("/health_generate", get(health_generate));
        }
        Flavour::SglangMetrics => {
            router = router
                .route("/metrics", get(sglang_metrics))
                .route("/health_generate", get(health_generate));
        }
        Flavour::Vllm => router = router.route("/metrics", get(vllm_metrics)),
        Flavour::Tokenspeed => router = router.route("/metrics", get(tokenspeed_metrics)),
    }
    router.with_state(shared)
}

async fn health() -> StatusCode {
    StatusCode::OK
}

async fn models(State(shared): State<Shared>) -> Response<Body> {
    json_response(
        StatusCode::OK,
        &json!({
            "object": "list",
            "data": [{
                "id": shared.config.model_name,
                "object": "model",
                "created": 0,
                "owned_by": "engine-sim",
                "max_model_len": shared.config.params.kv_capacity_tokens,
            }],
        }),
    )
}

// ---------------------------------------------------------------- helpers

pub(super) fn json_response(status: StatusCode, value: &Value) -> Response<Body> {
    let mut response = Response::new(Body::from(value.to_string()));
    *response.status_mut() = status;
    with_content_type(response, "application/json")
}

pub(super) fn text_response(content_type: &'static str, text: String) -> Response<Body> {
    with_content_type(Response::new(Body::from(text)), content_type)
}

pub(super) fn error_response(status: StatusCode, message: &str) -> Response<Body> {
    json_response(
        status,
        &json!({"error": {"message": message, "type": "engine_sim_error", "code": status.as_u16()}}),
    )
}

pub(super) fn with_content_type(
    mut response: Response<Body>,
    content_type: &'static str,
) -> Response<Body> {
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}
