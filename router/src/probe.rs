//! Active probes of ejected workers. A worker ejected for failing requests
//! returns only when a probe passes, and the probe exercises generation
//! where the backend allows: a deadlocked engine's `/health` still says 200.

use std::time::Duration;

use bytes::Bytes;
use http::Method;

use crate::config::ProbeKind;
use crate::upstream::{ControlGetError, UpstreamClient, control_call, control_request};
use crate::workers::Worker;

/// Most bytes a probe's answer may have.
const PROBE_BODY_LIMIT_BYTES: usize = 1024 * 1024;

/// Why a probe did not pass.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ProbeError {
    #[error("probe got no answer")]
    NoAnswer(#[from] ControlGetError),
    #[error("probe answered {status}")]
    Status { status: http::StatusCode },
    #[error("the worker lists no model to probe with (GET /v1/models)")]
    NoModel,
}

/// Runs one probe of `kind` against `worker`, all within `timeout`.
pub(crate) async fn probe(
    client: &UpstreamClient,
    worker: &Worker,
    kind: ProbeKind,
    timeout: Duration,
) -> Result<(), ProbeError> {
    let started = tokio::time::Instant::now();
    let auth = worker.authorization.as_ref();
    let request = match kind {
        ProbeKind::Health => control_request(
            Method::GET,
            &format!("{}/health", worker.url),
            auth,
            Bytes::new(),
        )?,
        ProbeKind::HealthGenerate => control_request(
            Method::GET,
            &format!("{}/health_generate", worker.url),
            auth,
            Bytes::new(),
        )?,
        ProbeKind::Completion => {
            let models = control_request(
                Method::GET,
                &format!("{}/v1/models", worker.url),
                auth,
                Bytes::new(),
            )?;
            let (status, body) =
                control_call(client, models, timeout, PROBE_BODY_LIMIT_BYTES).await?;
            if !status.is_success() {
                return Err(ProbeError::Status { status });
            }
            let model = first_model(&body).ok_or(ProbeError::NoModel)?;
            let completion = serde_json::json!({
                "model": model,
                "prompt": "ping",
                "max_tokens": 1,
                "stream": false,
            });
            control_request(
                Method::POST,
                &format!("{}/v1/completions", worker.url),
                auth,
                Bytes::from(completion.to_string()),
            )?
        }
    };
    let remaining = timeout.saturating_sub(started.elapsed());
    let (status, _) = control_call(client, request, remaining, PROBE_BODY_LIMIT_BYTES).await?;
    if status.is_success() {
        Ok(())
    } else {
        Err(ProbeError::Status { status })
    }
}

/// The first model id of an OpenAI `/v1/models` listing.
fn first_model(body: &[u8]) -> Option<String> {
    let listing: serde_json::Value = serde_json::from_slice(body).ok()?;
    listing
        .get("data")?
        .as_array()?
        .iter()
        .find_map(|model| model.get("id")?.as_str())
        .map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_listed_model_is_probed() {
        assert_eq!(
            first_model(br#"{"object":"list","data":[{"id":"m1"},{"id":"m2"}]}"#).as_deref(),
            Some("m1")
        );
        assert_eq!(first_model(br#"{"data":[]}"#), None);
        assert_eq!(first_model(br#"{"data":[{"name":"x"}]}"#), None);
        assert_eq!(first_model(b"not json"), None);
    }
}
