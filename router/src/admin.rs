//! The admin API under `/admin`: workers, the policy, explain, and the
//! admission queue.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::rejection::QueryRejection;
use axum::extract::{ConnectInfo, Path, Query, Request, State};
use axum::http::{Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::{Json, Router, routing::get};
use policy_core::{RequestInfo, TokenCount, WorkerId, error_chain, tokio_now};
use serde::Deserialize;

use crate::app::App;
use crate::config::{AdmissionConfig, PolicyConfig, WorkerConfig};
use crate::outlier::Standing;
use crate::proxy::error_response;
use crate::workers::Worker;

pub(crate) fn routes(app: Arc<App>) -> Router<Arc<App>> {
    Router::new()
        .route("/admin/workers", get(list_workers).post(add_worker))
        .route("/admin/workers/{id}", axum::routing::delete(remove_worker))
        .route("/admin/policy", get(get_policy).put(put_policy))
        .route("/admin/policy/explain", get(explain).post(explain_request))
        .route("/admin/admission", get(get_admission).put(put_admission))
        .route(
            "/admin/admission/explain",
            axum::routing::post(explain_admission),
        )
        .layer(axum::middleware::from_fn_with_state(app, authorize))
}

/// With `admin.api_key`, every call needs it as a bearer token; without,
/// calls that change anything are accepted only from loopback.
async fn authorize(State(app): State<Arc<App>>, request: Request, next: Next) -> Response {
    if let Some(key) = &app.config.admin.api_key {
        let presented = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.strip_prefix("Bearer "));
        if presented != Some(key.as_str()) {
            return error_response(
                StatusCode::UNAUTHORIZED,
                "authentication_error",
                "admin calls need Authorization: Bearer <admin.api_key>",
            );
        }
        return next.run(request).await;
    }
    // Explaining a request's body changes nothing, whatever its method.
    let path = request.uri().path();
    let mutating = request.method() != Method::GET
        && request.method() != Method::HEAD
        && path != "/admin/policy/explain"
        && path != "/admin/admission/explain";
    let loopback = request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .is_some_and(|ConnectInfo(peer)| peer.ip().is_loopback());
    if mutating && !loopback {
        return error_response(
            StatusCode::FORBIDDEN,
            "permission_error",
            "without admin.api_key, admin changes are accepted only from loopback",
        );
    }
    next.run(request).await
}

fn worker_json(app: &App, worker: &Worker) -> serde_json::Value {
    let stats = app.policy().worker_stats(worker.id).unwrap_or_default();
    let (ejected_for_s, consecutive_failures, ejections) = worker.with_outlier(|state| {
        let ejected_for_s = match state.standing() {
            Standing::InRotation => None,
            Standing::Probing => Some(0.0),
            Standing::Ejected { until } => Some(
                until
                    .saturating_duration_since(tokio::time::Instant::now())
                    .as_secs_f64(),
            ),
        };
        (
            ejected_for_s,
            state.consecutive_failures(),
            state.ejections_total(),
        )
    });
    let load = worker.latest_load();
    let load_age_s = load
        .as_ref()
        .and_then(|load| load.observed())
        .map(|observed| {
            tokio_now()
                .saturating_duration_since(observed)
                .as_secs_f64()
        });
    serde_json::json!({
        "id": worker.id.to_string(),
        "url": worker.url,
        "backend": worker.backend,
        "healthy": worker.is_healthy(),
        "ejected": worker.is_ejected(),
        "ejected_for_s": ejected_for_s,
        "consecutive_failures": consecutive_failures,
        "ejections": ejections,
        "in_rotation": worker.in_rotation(),
        "held_back": worker.is_held_back(),
        "silent_streams": worker.silent_streams(),
        "draining": worker.is_draining(),
        "in_flight": worker.in_flight(),
        "pending_tokens": stats.pending_tokens,
        "load": load,
        "load_age_s": load_age_s,
        "poll_failures": worker.consecutive_poll_failures(),
    })
}

async fn list_workers(State(app): State<Arc<App>>) -> Response {
    let workers: Vec<serde_json::Value> = app
        .workers()
        .iter()
        .map(|worker| worker_json(&app, worker))
        .collect();
    Json(serde_json::json!({"workers": workers})).into_response()
}

async fn add_worker(State(app): State<Arc<App>>, body: axum::body::Bytes) -> Response {
    let worker: WorkerConfig = match serde_json::from_slice(&body) {
        Ok(worker) => worker,
        Err(error) => {
            return error_response(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                format!("invalid worker: {error}"),
            );
        }
    };
    match app.add_worker(worker).await {
        Ok(worker) => (StatusCode::CREATED, Json(worker_json(&app, &worker))).into_response(),
        Err(error) => error_response(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            error_chain(&error),
        ),
    }
}

/// `DELETE /admin/workers/{id}[?grace_ms=N]`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct DrainQuery {
    /// How long in-flight requests may finish where they are; then its
    /// streams continue on other workers. Unset: as long as they take.
    grace_ms: Option<u64>,
}

async fn remove_worker(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    query: Result<Query<DrainQuery>, QueryRejection>,
) -> Response {
    let grace = match query {
        Ok(Query(query)) => query.grace_ms.map(std::time::Duration::from_millis),
        Err(rejection) => {
            return error_response(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                format!("{rejection}: the only parameter is grace_ms, in milliseconds"),
            );
        }
    };
    let id: WorkerId = match id.parse() {
        Ok(id) => id,
        Err(error) => {
            return error_response(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                error.to_string(),
            );
        }
    };
    if app.remove_worker(id, grace).await {
        (
            StatusCode::ACCEPTED,
            Json(serde_json::json!({"id": id.to_string(), "status": "draining"})),
        )
            .into_response()
    } else {
        error_response(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no worker {id}"),
        )
    }
}

async fn get_policy(State(app): State<Arc<App>>) -> Response {
    let policy = app.policy();
    Json(serde_json::json!({"kind": policy.name(), "params": policy.params()})).into_response()
}

async fn put_policy(State(app): State<Arc<App>>, body: axum::body::Bytes) -> Response {
    let section: PolicyConfig = match serde_json::from_slice(&body) {
        Ok(section) => section,
        Err(error) => {
            return error_response(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                format!("invalid policy section: {error}"),
            );
        }
    };
    match app.swap_policy(section).await {
        Ok(()) => get_policy(State(app)).await,
        Err(error) => error_response(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            error_chain(&error),
        ),
    }
}

/// `GET /admin/admission`: the section in force, and the queue: how many
/// wait, for how long, the drain rate its predictions use, and each
/// waiting flow (class, and tenant under `fair_share`).
async fn get_admission(State(app): State<Arc<App>>) -> Response {
    let (room, enabled) = app.admission.view(app.peer_rooms.combined());
    Json(serde_json::json!({
        "enabled": enabled,
        "config": app.admission.config(),
        "queue": room,
    }))
    .into_response()
}

/// `PUT /admin/admission` with a whole `[admission]` section as JSON: a
/// live swap. Waiting requests move to the new order.
async fn put_admission(State(app): State<Arc<App>>, body: axum::body::Bytes) -> Response {
    let section: AdmissionConfig = match serde_json::from_slice(&body) {
        Ok(section) => section,
        Err(error) => {
            return error_response(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                format!("invalid admission section: {error}"),
            );
        }
    };
    match app.swap_admission(section) {
        Ok(()) => get_admission(State(app)).await,
        Err(error) => error_response(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            error_chain(&error),
        ),
    }
}

/// `POST /admin/admission/explain` with a generation request's body and
/// headers: what the admission room would do with it now (dispatch, queue
/// or turn away) and why: its class, tenant and deadline, the policy's
/// expected wait, the work ahead of it and the predicted TTFT. Nothing is
/// queued or dispatched.
async fn explain_admission(
    State(app): State<Arc<App>>,
    headers: axum::http::HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let read = match request_features::read_request(&body, &app.config.request.prefix_hashing()) {
        Ok(read) => read,
        Err(error) => {
            return error_response(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                error.to_string(),
            );
        }
    };
    match app.admission.explain(&app, &headers, &read) {
        Ok(explained) => Json(explained).into_response(),
        Err(message) => error_response(StatusCode::BAD_REQUEST, "invalid_request_error", message),
    }
}

#[derive(Debug, Deserialize)]
struct ExplainQuery {
    tokens: Option<u64>,
}

async fn explain(
    State(app): State<Arc<App>>,
    Query(query): Query<ExplainQuery>,
    headers: axum::http::HeaderMap,
) -> Response {
    let tokens = query.tokens.map_or(TokenCount::Unknown, TokenCount::Exact);
    explained(&app, &RequestInfo::new(tokens), &headers)
}

/// `POST /admin/policy/explain` with a generation request's body (as sent
/// to `/v1/chat/completions`, `/v1/completions` or `/generate`): the score
/// table for that request, its prompt's size and prefix blocks read as the
/// proxy reads them, so `cached_tok` shows where the prefix is expected.
/// Nothing is dispatched.
async fn explain_request(
    State(app): State<Arc<App>>,
    headers: axum::http::HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    match request_features::read_request(&body, &app.config.request.prefix_hashing()) {
        Ok(read) => explained(&app, &read.info, &headers),
        Err(error) => error_response(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            error.to_string(),
        ),
    }
}

fn explained(app: &App, request: &RequestInfo, headers: &axum::http::HeaderMap) -> Response {
    let snapshot = app.topology.snapshot();
    let table = snapshot
        .policy
        .explain(snapshot.candidates(), request, tokio_now());
    let wants_json = headers
        .get(header::ACCEPT)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|accept| accept.contains("application/json"));
    if wants_json {
        Json(table).into_response()
    } else {
        (
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            table.to_string(),
        )
            .into_response()
    }
}
