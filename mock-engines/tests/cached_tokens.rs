//! Every generation API reports the prompt tokens the prefix cache served, as
//! real engines do: OpenAI's `usage.prompt_tokens_details.cached_tokens`
//! (whole answers, and a stream's closing usage chunk when
//! `stream_options.include_usage` asks for one) and SGLang's
//! `meta_info.cached_tokens`.

// Test helpers (not only #[test] fns) may unwrap: a panic is a failed assertion.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use futures::StreamExt;
use mock_engines::{Flavour, ServeMode, SimEngineConfig};
use serde_json::{Value, json};

mod common;

use common::DEADLINE;

/// 64 full 16-token blocks at four characters a token.
const PREFIX_CHARS: usize = 64 * 16 * 4;
/// What a prompt that starts with another's whole prefix finds cached.
const SHARED_PREFIX_TOKENS: u64 = 64 * 16;
const MAX_TOKENS: u64 = 3;

/// A `PREFIX_CHARS`-long text made of `seed`, so different seeds share no
/// prefix-cache block.
fn prefix(seed: &str) -> String {
    // Each repeat is longer than 32 characters.
    let text = format!("{seed}: a system prompt every turn repeats; ").repeat(PREFIX_CHARS / 32);
    text[..PREFIX_CHARS].to_owned()
}

#[derive(Debug, Clone, Copy)]
enum Api {
    Chat,
    Completions,
    Generate,
}

const APIS: [Api; 3] = [Api::Chat, Api::Completions, Api::Generate];

impl Api {
    fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Completions => "/v1/completions",
            Api::Generate => "/generate",
        }
    }

    /// A request whose prompt is `prefix` then `question`.
    fn body(self, prefix: &str, question: &str, stream: bool) -> Value {
        let mut body = match self {
            Api::Chat => json!({
                "max_tokens": MAX_TOKENS,
                "messages": [
                    {"role": "system", "content": prefix},
                    {"role": "user", "content": question},
                ],
            }),
            Api::Completions => json!({
                "max_tokens": MAX_TOKENS,
                "prompt": format!("{prefix}{question}"),
            }),
            Api::Generate => json!({
                "sampling_params": {"max_new_tokens": MAX_TOKENS},
                "text": format!("{prefix}{question}"),
            }),
        };
        if stream {
            body["stream"] = json!(true);
            body["stream_options"] = json!({"include_usage": true});
        }
        body
    }
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(DEADLINE)
        .build()
        .unwrap()
}

async fn start(mode: ServeMode) -> (mock_engines::SimFleet, String) {
    let config = SimEngineConfig {
        mode,
        time_scale: 200.0,
        ..SimEngineConfig::new(Flavour::Sglang)
    };
    let fleet = mock_engines::start(vec![config]).await.unwrap();
    let url = fleet.engines()[0].http_url();
    (fleet, url)
}

/// Reads a whole SSE body into its JSON payloads, checking it ends with
/// `[DONE]`.
async fn sse_payloads(response: reqwest::Response) -> Vec<Value> {
    assert_eq!(response.status(), 200);
    let mut body = String::new();
    let mut stream = response.bytes_stream();
    while let Some(chunk) = stream.next().await {
        body.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
    }
    assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
    body.split("\n\n")
        .filter(|event| !event.is_empty() && *event != "data: [DONE]")
        .map(|event| serde_json::from_str(event.strip_prefix("data: ").unwrap()).unwrap())
        .collect()
}

/// Sends one request and returns the cached tokens its answer reports.
async fn cached_tokens(
    client: &reqwest::Client,
    url: &str,
    api: Api,
    body: Value,
    stream: bool,
) -> u64 {
    let response = client
        .post(format!("{url}{}", api.path()))
        .json(&body)
        .send()
        .await
        .unwrap();
    if !stream {
        assert_eq!(response.status(), 200);
        let whole: Value = response.json().await.unwrap();
        return match api {
            Api::Generate => whole["meta_info"]["cached_tokens"].as_u64(),
            Api::Chat | Api::Completions => {
                whole["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64()
            }
        }
        .unwrap_or_else(|| panic!("{api:?}: no cached tokens in {whole}"));
    }
    let payloads = sse_payloads(response).await;
    let last = payloads.last().unwrap();
    match api {
        Api::Generate => {
            assert!(!last["meta_info"]["finish_reason"].is_null(), "{last}");
            last["meta_info"]["cached_tokens"].as_u64().unwrap()
        }
        Api::Chat | Api::Completions => {
            // The usage chunk closes the stream, after the finish chunk.
            assert_eq!(last["choices"], json!([]), "{last}");
            // Every chunk but the finish and usage ones carries a token.
            let tokens = payloads.len() as u64 - 2;
            assert_eq!(last["usage"]["completion_tokens"], tokens, "{last}");
            let finish = &payloads[payloads.len() - 2];
            assert!(!finish["choices"][0]["finish_reason"].is_null(), "{finish}");
            last["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap()
        }
    }
}

/// For every API, plain and streamed: a first prompt finds nothing cached,
/// a second that starts with the first's prefix finds the whole prefix, and
/// an unrelated one finds nothing.
#[tokio::test]
async fn answers_report_the_prefix_cache_hits_of_their_request() {
    let client = client();
    let (fleet, url) = start(ServeMode::Model).await;
    for api in APIS {
        for stream in [false, true] {
            let shared = prefix(&format!("{api:?} {stream}"));
            let first = api.body(&shared, " what is the first question?", stream);
            assert_eq!(
                cached_tokens(&client, &url, api, first, stream).await,
                0,
                "{api:?} stream={stream}: first"
            );
            let second = api.body(&shared, " and now a different one.", stream);
            assert_eq!(
                cached_tokens(&client, &url, api, second, stream).await,
                SHARED_PREFIX_TOKENS,
                "{api:?} stream={stream}: shared prefix"
            );
            let other = prefix(&format!("unrelated {api:?} {stream}"));
            let unrelated = api.body(&other, " and now a different one.", stream);
            assert_eq!(
                cached_tokens(&client, &url, api, unrelated, stream).await,
                0,
                "{api:?} stream={stream}: unrelated"
            );
        }
    }
    fleet.shutdown().await;
}

/// Without `stream_options.include_usage`, a stream has no usage chunk.
#[tokio::test]
async fn streams_carry_usage_only_when_asked() {
    let client = client();
    let (fleet, url) = start(ServeMode::Model).await;
    for api in [Api::Chat, Api::Completions] {
        let mut body = api.body(&prefix("no usage"), " question", true);
        body["stream_options"] = json!({"include_usage": false});
        let response = client
            .post(format!("{url}{}", api.path()))
            .json(&body)
            .send()
            .await
            .unwrap();
        let payloads = sse_payloads(response).await;
        // One chunk per token, then the finish chunk.
        assert_eq!(payloads.len() as u64, MAX_TOKENS + 1, "{payloads:?}");
        assert!(
            payloads
                .iter()
                .all(|payload| payload.get("usage").is_none()),
            "{payloads:?}"
        );
    }
    fleet.shutdown().await;
}

/// Canned answers never come from a prefix cache.
#[tokio::test]
async fn canned_answers_report_no_cached_tokens() {
    let client = client();
    let (fleet, url) = start(ServeMode::Canned).await;
    for api in APIS {
        for stream in [false, true] {
            let shared = prefix("canned");
            for question in [" one", " two"] {
                let body = api.body(&shared, question, stream);
                assert_eq!(
                    cached_tokens(&client, &url, api, body, stream).await,
                    0,
                    "{api:?} stream={stream}"
                );
            }
        }
    }
    fleet.shutdown().await;
}
