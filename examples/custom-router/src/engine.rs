//! A stand-in `jsonstats` engine for tests and demos: it reports whatever
//! [`JsonStats`] it is given at `GET /stats` and answers OpenAI chat and
//! text completions (streaming or not) with a canned reply. It generates
//! nothing and its numbers never move by themselves: a test sets them.
//!
//! Routes: `GET /stats`, `GET /health`, `GET /v1/models`,
//! `POST /v1/chat/completions`, `POST /v1/completions`.
//!
//! ```
//! use custom_router::{JsonStats, KvCacheStats, QueueStats, serve_stats_engine};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> std::io::Result<()> {
//! let stats = JsonStats {
//!     queue: QueueStats { requests: 0, prompt_tokens: Some(0) },
//!     running: 0,
//!     kv_cache: KvCacheStats { used_blocks: 100, total_blocks: 1000 },
//!     decode_tps: Some(850.0),
//! };
//! let engine = serve_stats_engine("127.0.0.1:0", stats).await?;
//! assert!(engine.url().starts_with("http://127.0.0.1:"));
//! engine.set_raw_stats("{ not json"); // the next poll fails to decode
//! # Ok(())
//! # }
//! ```

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use parking_lot::Mutex;
use tokio::net::{TcpListener, ToSocketAddrs};
use tokio::sync::{oneshot, watch};

use crate::backend::{JsonStats, STATS_PATH};

/// The one model a stats engine serves.
pub const STATS_ENGINE_MODEL: &str = "jsonstats-demo";

/// A running stats engine; it stops when dropped.
#[derive(Debug)]
pub struct StatsEngine {
    address: SocketAddr,
    shared: Arc<Shared>,
    stop: Option<oneshot::Sender<()>>,
}

#[derive(Debug)]
struct Shared {
    address: SocketAddr,
    /// The `/stats` body served, as JSON text.
    stats_body: Mutex<String>,
    stats_requests: AtomicU64,
    generations_received: AtomicU64,
    generations_answered: AtomicU64,
    /// While `true`, generation requests wait before sending any byte.
    held: watch::Sender<bool>,
}

/// Binds `address` (port 0 for any free port) and serves a stats engine
/// reporting `stats` on a background task.
pub async fn serve_stats_engine(
    address: impl ToSocketAddrs,
    stats: JsonStats,
) -> io::Result<StatsEngine> {
    let listener = TcpListener::bind(address).await?;
    let address = listener.local_addr()?;
    let shared = Arc::new(Shared {
        address,
        stats_body: Mutex::new(stats_json(&stats)),
        stats_requests: AtomicU64::new(0),
        generations_received: AtomicU64::new(0),
        generations_answered: AtomicU64::new(0),
        held: watch::Sender::new(false),
    });
    let routes = Router::new()
        .route(STATS_PATH, get(stats_handler))
        .route("/health", get(|| async { "ok" }))
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .with_state(shared.clone());
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(async move {
        let shutdown = async {
            let _ = stopped.await;
        };
        if let Err(error) = axum::serve(listener, routes)
            .with_graceful_shutdown(shutdown)
            .await
        {
            eprintln!("stats engine on {address}: {error}");
        }
    });
    Ok(StatsEngine {
        address,
        shared,
        stop: Some(stop),
    })
}

fn stats_json(stats: &JsonStats) -> String {
    // Every field is a number or a map of numbers; a NaN rate (which JSON
    // cannot carry) is written as `null`, as serde_json writes it.
    serde_json::to_string(stats).unwrap_or_else(|error| format!("{{\"error\": \"{error}\"}}"))
}

impl StatsEngine {
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// `http://host:port`, for a worker entry.
    pub fn url(&self) -> String {
        format!("http://{}", self.address)
    }

    /// Reports `stats` from the next `/stats` request on.
    pub fn set_stats(&self, stats: &JsonStats) {
        *self.shared.stats_body.lock() = stats_json(stats);
    }

    /// Serves `body` verbatim (as `application/json`) at `/stats`: for
    /// malformed or hostile reports.
    pub fn set_raw_stats(&self, body: impl Into<String>) {
        *self.shared.stats_body.lock() = body.into();
    }

    /// `GET /stats` requests answered so far.
    pub fn stats_requests(&self) -> u64 {
        self.shared.stats_requests.load(Ordering::SeqCst)
    }

    /// Generation requests (chat or text completions) that arrived,
    /// answered or still held.
    pub fn generations_received(&self) -> u64 {
        self.shared.generations_received.load(Ordering::SeqCst)
    }

    /// Generation requests answered.
    pub fn generations_answered(&self) -> u64 {
        self.shared.generations_answered.load(Ordering::SeqCst)
    }

    /// Holds generation requests, arrived and arriving, before any byte of
    /// their answer, until [`StatsEngine::release`]: the router keeps their
    /// prompt tokens pending meanwhile.
    pub fn hold(&self) {
        self.shared.held.send_replace(true);
    }

    /// Lets held generation requests, and new ones, be answered.
    pub fn release(&self) {
        self.shared.held.send_replace(false);
    }
}

impl Drop for StatsEngine {
    fn drop(&mut self) {
        self.release();
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

async fn stats_handler(State(shared): State<Arc<Shared>>) -> Response {
    shared.stats_requests.fetch_add(1, Ordering::SeqCst);
    let body = shared.stats_body.lock().clone();
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

async fn models() -> Response {
    axum::Json(serde_json::json!({
        "object": "list",
        "data": [{"id": STATS_ENGINE_MODEL, "object": "model", "owned_by": "custom-router"}],
    }))
    .into_response()
}

/// Which OpenAI endpoint is answered.
#[derive(Debug, Clone, Copy)]
enum Endpoint {
    Chat,
    Text,
}

async fn chat_completions(State(shared): State<Arc<Shared>>, body: axum::body::Bytes) -> Response {
    generate(&shared, &body, Endpoint::Chat).await
}

async fn completions(State(shared): State<Arc<Shared>>, body: axum::body::Bytes) -> Response {
    generate(&shared, &body, Endpoint::Text).await
}

async fn generate(shared: &Shared, body: &[u8], endpoint: Endpoint) -> Response {
    let request: serde_json::Value = match serde_json::from_slice(body) {
        Ok(request @ serde_json::Value::Object(_)) => request,
        _ => {
            return (
                StatusCode::BAD_REQUEST,
                axum::Json(serde_json::json!({"error": {
                    "message": "the body must be a JSON object",
                    "type": "invalid_request_error",
                }})),
            )
                .into_response();
        }
    };
    shared.generations_received.fetch_add(1, Ordering::SeqCst);
    let mut held = shared.held.subscribe();
    // An error means the engine is gone; answer anyway.
    let _ = held.wait_for(|held| !*held).await;
    let streaming = request
        .get("stream")
        .and_then(serde_json::Value::as_bool)
        .unwrap_or(false);
    let model = request
        .get("model")
        .and_then(serde_json::Value::as_str)
        .unwrap_or(STATS_ENGINE_MODEL)
        .to_owned();
    let words = ["served ", "by ", &shared.address.to_string()];
    let response = if streaming {
        stream_answer(endpoint, &model, &words)
    } else {
        whole_answer(endpoint, &model, &words.concat())
    };
    shared.generations_answered.fetch_add(1, Ordering::SeqCst);
    response
}

fn whole_answer(endpoint: Endpoint, model: &str, text: &str) -> Response {
    let (object, choice) = match endpoint {
        Endpoint::Chat => (
            "chat.completion",
            serde_json::json!({"index": 0, "finish_reason": "stop",
                "message": {"role": "assistant", "content": text}}),
        ),
        Endpoint::Text => (
            "text_completion",
            serde_json::json!({"index": 0, "finish_reason": "stop", "text": text}),
        ),
    };
    axum::Json(serde_json::json!({
        "id": "cmpl-stats-engine",
        "object": object,
        "created": 0,
        "model": model,
        "choices": [choice],
        "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4},
    }))
    .into_response()
}

/// Server-sent events: one chunk per word, a finishing chunk, `[DONE]`.
fn stream_answer(endpoint: Endpoint, model: &str, words: &[&str]) -> Response {
    let chunk = |piece: Option<&str>| {
        let finish_reason = if piece.is_none() { Some("stop") } else { None };
        let (object, choice) = match endpoint {
            Endpoint::Chat => (
                "chat.completion.chunk",
                serde_json::json!({"index": 0, "finish_reason": finish_reason,
                    "delta": piece.map_or_else(|| serde_json::json!({}), |piece| serde_json::json!({"content": piece}))}),
            ),
            Endpoint::Text => (
                "text_completion",
                serde_json::json!({"index": 0, "finish_reason": finish_reason,
                    "text": piece.unwrap_or_default()}),
            ),
        };
        let event = serde_json::json!({
            "id": "cmpl-stats-engine",
            "object": object,
            "created": 0,
            "model": model,
            "choices": [choice],
        });
        format!("data: {event}\n\n")
    };
    let mut body: String = words.iter().map(|word| chunk(Some(word))).collect();
    body.push_str(&chunk(None));
    body.push_str("data: [DONE]\n\n");
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}
