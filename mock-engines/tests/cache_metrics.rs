//! Every flavour's `/metrics` carries the request, prompt-token and
//! prefix-cache counters under the real engine's names, and they move when a
//! prompt is repeated.

// Test helpers (not only #[test] fns) may unwrap: a panic is a failed assertion.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use load_protocols::{Sample, parse_prometheus_text};
use mock_engines::{Flavour, SimEngineConfig};
use serde_json::json;

mod common;

use common::{DEADLINE, poll_until};

/// 4000 ASCII characters: 1000 tokens at four characters a token, 62 full
/// 16-token blocks (the last block is never served from the cache: at least
/// one token is computed).
fn long_prompt() -> String {
    let text = "a system prompt every turn repeats; ".repeat(120);
    text[..4000].to_owned()
}

const PROMPT_TOKENS: f64 = 1000.0;
const CACHED_TOKENS: f64 = 62.0 * 16.0;

fn total(samples: &[Sample], name: &str) -> Option<f64> {
    let matching: Vec<f64> = samples
        .iter()
        .filter(|sample| sample.name == name)
        .map(|sample| sample.value)
        .collect();
    (!matching.is_empty()).then(|| matching.iter().sum())
}

/// (requests, prompt tokens looked up, cached tokens) under each flavour's
/// names.
fn cache_counters(flavour: Flavour, samples: &[Sample]) -> Option<(f64, f64, f64)> {
    let (requests, looked_up, cached) = match flavour {
        Flavour::Sglang | Flavour::SglangMetrics => (
            "sglang:num_requests_total",
            "sglang:prompt_tokens_total",
            "sglang:cached_tokens_total",
        ),
        Flavour::Vllm => (
            "vllm:request_success_total",
            "vllm:prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total",
        ),
        Flavour::Tokenspeed => (
            "tokenspeed:num_requests_total",
            "tokenspeed:prompt_tokens_total",
            "tokenspeed:cached_tokens_total",
        ),
    };
    Some((
        total(samples, requests)?,
        total(samples, looked_up)?,
        total(samples, cached)?,
    ))
}

#[tokio::test]
async fn every_flavour_exports_cache_counters_that_move_on_a_repeated_prompt() {
    let client = reqwest::Client::builder()
        .timeout(DEADLINE)
        .build()
        .unwrap();
    for flavour in Flavour::ALL {
        let config = SimEngineConfig {
            time_scale: 200.0,
            ..SimEngineConfig::new(flavour)
        };
        let fleet = mock_engines::start(vec![config]).await.unwrap();
        let url = fleet.engines()[0].http_url();
        let metrics = || async {
            let text = client
                .get(format!("{url}/metrics"))
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            parse_prometheus_text(&text).unwrap()
        };
        let before = cache_counters(flavour, &metrics().await);
        assert_eq!(before, Some((0.0, 0.0, 0.0)), "{flavour}");

        // The same prompt twice, one after the other: the second finds the
        // first's full blocks in the prefix cache.
        for _ in 0..2 {
            let response = client
                .post(format!("{url}/v1/chat/completions"))
                .json(&json!({
                    "max_tokens": 2,
                    "messages": [{"role": "system", "content": long_prompt()}],
                }))
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 200, "{flavour}");
            response.bytes().await.unwrap();
        }
        let samples = poll_until(metrics, |samples| {
            cache_counters(flavour, samples).is_some_and(|(requests, _, _)| requests >= 2.0)
        })
        .await;
        assert_eq!(
            cache_counters(flavour, &samples),
            Some((2.0, 2.0 * PROMPT_TOKENS, CACHED_TOKENS)),
            "{flavour}"
        );
        match flavour {
            Flavour::Sglang | Flavour::SglangMetrics => {
                let rate = total(&samples, "sglang:cache_hit_rate").unwrap();
                assert!(
                    (rate - CACHED_TOKENS / (2.0 * PROMPT_TOKENS)).abs() < 1e-9,
                    "{rate}"
                );
            }
            Flavour::Vllm => {
                // Bounded by max_tokens: both finished by length.
                let by_length = samples.iter().find(|sample| {
                    sample.name == "vllm:request_success_total"
                        && sample.label("finished_reason") == Some("length")
                });
                assert_eq!(by_length.map(|sample| sample.value), Some(2.0));
                assert_eq!(
                    total(&samples, "vllm:prompt_tokens_total"),
                    Some(2.0 * PROMPT_TOKENS)
                );
            }
            Flavour::Tokenspeed => {
                // Counters only: TokenSpeed reports its load over gRPC.
                assert!(
                    samples
                        .iter()
                        .all(|sample| sample.name.starts_with("tokenspeed:")),
                    "{samples:?}"
                );
            }
        }
        fleet.shutdown().await;
    }
}
