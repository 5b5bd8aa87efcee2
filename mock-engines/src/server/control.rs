//! Fault control and request counters: `/control/fault`,
//! `/control/stats` and `/control/admitted`, which keep answering under
//! every fault.

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{Response, StatusCode};
use serde::Deserialize;
use serde_json::json;

use super::FaultMode;
use super::http::{Shared, error_response, json_response};

#[derive(Debug, Deserialize)]
struct FaultBody {
    mode: String,
}

pub(super) async fn set_fault(State(shared): State<Shared>, body: Bytes) -> Response<Body> {
    let parsed = serde_json::from_slice::<FaultBody>(&body)
        .ok()
        .and_then(|body| body.mode.parse::<FaultMode>().ok());
    match parsed {
        Some(mode) => {
            let previous = shared.fault();
            shared.set_fault(mode);
            tracing::info!(engine = shared.index, %previous, %mode, "fault mode switched");
            json_response(
                StatusCode::OK,
                &json!({"mode": mode.as_str(), "previous": previous.as_str()}),
            )
        }
        None => {
            let names: Vec<&str> = FaultMode::ALL.iter().map(|mode| mode.as_str()).collect();
            error_response(
                StatusCode::BAD_REQUEST,
                &format!("expected {{\"mode\": one of {}}}", names.join(", ")),
            )
        }
    }
}

pub(super) async fn get_fault(State(shared): State<Shared>) -> Response<Body> {
    json_response(StatusCode::OK, &json!({"mode": shared.fault().as_str()}))
}

pub(super) async fn stats(State(shared): State<Shared>) -> Response<Body> {
    let stats = shared.counters.stats();
    json_response(
        StatusCode::OK,
        &json!({
            "generation_requests": stats.generation_requests,
            "health_generate_requests": stats.health_generate_requests,
            "fault": shared.fault().as_str(),
        }),
    )
}

/// The request ids that reached the engine model (`x-request-id`), for
/// spotting a generation run twice.
pub(super) async fn admitted(State(shared): State<Shared>) -> Response<Body> {
    let admitted = shared.counters.admitted();
    json_response(
        StatusCode::OK,
        &json!({
            "admitted_request_ids": admitted.ids,
            "admitted_total": admitted.total,
        }),
    )
}
