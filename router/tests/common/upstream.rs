//! A scriptable upstream engine for router tests: SGLang-shaped `/v1/loads`,
//! `/health`, and the generation endpoints, with switches a test flips.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use tokio::sync::{Notify, oneshot};

#[derive(Default)]
pub struct Switches {
    pub healthy: AtomicBool,
    /// Answer generation with this status when non-zero.
    pub fail_status: AtomicU16,
    /// Hold every generation until `release` is notified.
    pub hold: AtomicBool,
    pub release: Notify,
    /// After the first SSE chunk, wait for `continue_stream`.
    pub gate_after_first_chunk: AtomicBool,
    pub continue_stream: Notify,
    /// Send the first SSE chunk one byte per write, so `data:` is split
    /// across frames.
    pub first_chunk_bytewise: AtomicBool,
    /// Never answer `/v1/models` (the connection stays open).
    pub hang_models: AtomicBool,
    pub requests: AtomicU64,
    /// `GET /health_generate` probes received.
    pub probes: AtomicU64,
    pub prompt_chars: AtomicU64,
    /// Every generation request's body, in arrival order.
    pub bodies: std::sync::Mutex<Vec<Bytes>>,
    /// Each generation request's `traceparent` header, in arrival order.
    pub traceparents: std::sync::Mutex<Vec<Option<String>>>,
    pub waiting_reqs: AtomicU64,
    /// Report `cached_tokens` as the prompt tokens the prefix cache
    /// served: in `usage.prompt_tokens_details` (a whole answer, and the
    /// closing usage chunk of a stream that asks for it with
    /// `stream_options.include_usage`), as OpenAI-compatible engines do.
    pub report_cached: AtomicBool,
    pub cached_tokens: AtomicU64,
    pub model: &'static str,
}

pub struct Upstream {
    pub url: String,
    pub address: SocketAddr,
    pub switches: Arc<Switches>,
    stop: Option<oneshot::Sender<()>>,
}

impl Drop for Upstream {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

impl Upstream {
    pub async fn start() -> Upstream {
        Upstream::start_on("127.0.0.1:0").await
    }

    pub async fn start_on(address: &str) -> Upstream {
        let switches = Arc::new(Switches {
            healthy: AtomicBool::new(true),
            model: "test-model",
            ..Switches::default()
        });
        let listener = tokio::net::TcpListener::bind(address).await.unwrap();
        let address = listener.local_addr().unwrap();
        let app = Router::new()
            .route("/health", get(health))
            .route("/health_generate", get(health_generate))
            .route("/v1/loads", get(loads))
            .route("/v1/models", get(models))
            .route("/v1/chat/completions", post(generate))
            .route("/v1/completions", post(generate))
            .route("/generate", post(generate_native))
            .with_state(switches.clone());
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async {
                    let _ = stopped.await;
                })
                .await;
        });
        Upstream {
            url: format!("http://{address}"),
            address,
            switches,
            stop: Some(stop),
        }
    }

    pub fn requests(&self) -> u64 {
        self.switches.requests.load(Ordering::SeqCst)
    }

    /// The first message's content of each chat request received, in order.
    pub fn prompts(&self) -> Vec<String> {
        self.switches
            .bodies
            .lock()
            .unwrap()
            .iter()
            .map(|body| {
                let body: serde_json::Value = serde_json::from_slice(body).unwrap();
                body["messages"][0]["content"].as_str().unwrap().to_owned()
            })
            .collect()
    }
}

async fn health(State(switches): State<Arc<Switches>>) -> StatusCode {
    if switches.healthy.load(Ordering::SeqCst) {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

/// SGLang's generation probe: fails as generation does.
async fn health_generate(State(switches): State<Arc<Switches>>) -> StatusCode {
    switches.probes.fetch_add(1, Ordering::SeqCst);
    match switches.fail_status.load(Ordering::SeqCst) {
        0 => StatusCode::OK,
        status => StatusCode::from_u16(status).unwrap(),
    }
}

async fn loads(State(switches): State<Arc<Switches>>) -> Response {
    let waiting = switches.waiting_reqs.load(Ordering::SeqCst);
    axum::Json(serde_json::json!({
        "timestamp": "", "version": "test", "dp_rank_count": 1,
        "loads": [{"dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": waiting,
                   "num_waiting_uncached_tokens": waiting * 100,
                   "token_usage": 0.1, "gen_throughput": 2000.0}]
    }))
    .into_response()
}

async fn models(State(switches): State<Arc<Switches>>) -> Response {
    if switches.hang_models.load(Ordering::SeqCst) {
        std::future::pending::<()>().await;
    }
    axum::Json(
        serde_json::json!({"object": "list", "data": [{"id": switches.model, "object": "model"}]}),
    )
    .into_response()
}

/// OpenAI chat and completions: `t0t1t2t3`, whole or as four chunks.
async fn generate(
    State(switches): State<Arc<Switches>>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Response {
    answer(switches, headers, body, false).await
}

/// SGLang's `/generate`: the same text, in its own shape (cumulative
/// `text` and `meta_info`).
async fn generate_native(
    State(switches): State<Arc<Switches>>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Response {
    answer(switches, headers, body, true).await
}

async fn answer(
    switches: Arc<Switches>,
    headers: axum::http::HeaderMap,
    body: Bytes,
    native: bool,
) -> Response {
    switches.traceparents.lock().unwrap().push(
        headers
            .get("traceparent")
            .map(|value| value.to_str().unwrap().to_owned()),
    );
    switches.requests.fetch_add(1, Ordering::SeqCst);
    switches
        .prompt_chars
        .fetch_add(body.len() as u64, Ordering::SeqCst);
    switches.bodies.lock().unwrap().push(body.clone());
    let status = switches.fail_status.load(Ordering::SeqCst);
    if status != 0 {
        return (StatusCode::from_u16(status).unwrap(), "upstream failure").into_response();
    }
    if switches.hold.load(Ordering::SeqCst) {
        switches.release.notified().await;
    }
    let request: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let usage = switches.report_cached.load(Ordering::SeqCst).then(|| {
        serde_json::json!({
            "prompt_tokens": body.len() / 4, "completion_tokens": 4,
            "prompt_tokens_details": {"cached_tokens": switches.cached_tokens.load(Ordering::SeqCst)},
        })
    });
    if request["stream"] != true && native {
        return axum::Json(serde_json::json!({
            "text": "t0t1t2t3",
            "meta_info": {"id": "c", "completion_tokens": 4, "finish_reason": {"type": "stop"}},
        }))
        .into_response();
    }
    if request["stream"] != true {
        let mut answer = serde_json::json!({
            "id": "cmpl-1", "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "t0t1t2t3"}, "finish_reason": "stop"}]
        });
        if let Some(usage) = usage {
            answer["usage"] = usage;
        }
        return axum::Json(answer).into_response();
    }
    let gate = switches.gate_after_first_chunk.load(Ordering::SeqCst);
    let bytewise = switches.first_chunk_bytewise.load(Ordering::SeqCst);
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(4);
    let switches = switches.clone();
    tokio::spawn(async move {
        // The last content chunk carries the finish reason, as engines'
        // last chunk does.
        let chunk = |index: usize| {
            let finish = if index == 3 { "\"stop\"" } else { "null" };
            if native {
                let text: String = (0..=index).map(|i| format!("t{i}")).collect();
                let finish = if index == 3 {
                    r#"{"type":"stop"}"#
                } else {
                    "null"
                };
                return Bytes::from(format!(
                    "data: {{\"text\":\"{text}\",\"meta_info\":{{\"id\":\"c\",\"completion_tokens\":{},\"finish_reason\":{finish}}}}}\n\n",
                    index + 1
                ));
            }
            Bytes::from(format!(
                "data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"t{index}\"}},\"finish_reason\":{finish}}}]}}\n\n"
            ))
        };
        if bytewise {
            for byte in chunk(0) {
                if tx.send(Ok(Bytes::from(vec![byte]))).await.is_err() {
                    return;
                }
                // Pace the bytes so each goes out in its own write.
                tokio::time::sleep(std::time::Duration::from_millis(2)).await;
            }
        } else if tx.send(Ok(chunk(0))).await.is_err() {
            return;
        }
        if gate {
            switches.continue_stream.notified().await;
        }
        for index in 1..4 {
            if tx.send(Ok(chunk(index))).await.is_err() {
                return;
            }
        }
        let usage_asked = request["stream_options"]["include_usage"] == true;
        if let Some(usage) = usage.filter(|_| usage_asked) {
            let last = serde_json::json!({
                "id": "c", "object": "chat.completion.chunk", "choices": [], "usage": usage,
            });
            if tx
                .send(Ok(Bytes::from(format!("data: {last}\n\n"))))
                .await
                .is_err()
            {
                return;
            }
        }
        let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
    });
    let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(stream))
        .unwrap()
}
