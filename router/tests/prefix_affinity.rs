//! Prefix affinity end to end: the router hashes each chat body's prompt
//! prefix, and least_load (default config) keeps sending a long shared
//! prefix to the worker that already served it, over mock engines on
//! loopback.

// Test helpers outside #[test] functions fail loudly on purpose.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{fast_config, start_router, wait_until, worker};
use mock_engines::{Flavour, SimEngineConfig};

/// About `tokens` tokens of text (4 characters each) that starts with `tag`.
fn text(tag: &str, tokens: usize) -> String {
    let mut text = format!("{tag}: ");
    while text.len() < tokens * 4 {
        text.push_str("you answer questions about the fleet's engines, briefly. ");
    }
    text.truncate(tokens * 4);
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_sharing_a_long_prefix_stay_on_the_worker_that_served_it() {
    let configs = (0..2)
        .map(|index| {
            let mut config = SimEngineConfig::new(Flavour::Sglang);
            config.seed = 70 + index;
            config.time_scale = 4.0;
            // The engines' own prefix caches stay out of their load reports,
            // so the two look the same between requests: only the router's
            // prefix index tells them apart.
            config.params.prefix_cache = false;
            config
        })
        .collect();
    let engines = mock_engines::start(configs).await.unwrap();
    let workers = engines
        .engines()
        .iter()
        .map(|engine| worker("sglang", &engine.http_url()))
        .collect();
    let router = start_router(fast_config(workers, "")).await;
    assert_eq!(router.policy_kind().await, "least_load");
    wait_until("both workers are healthy", || async {
        router.healthy_count().await == 2
    })
    .await;
    let url = format!("{}/v1/chat/completions", router.base);
    // Two system prompts of about 4000 tokens each, and a distinct question
    // per request. One request at a time, each finished before the next, so
    // both workers are idle at every choice.
    let systems = [text("fleet X", 4000), text("fleet Y", 4000)];
    let send = |system: usize, question: usize| {
        let body = serde_json::json!({"model": "m", "max_tokens": 2, "messages": [
            {"role": "system", "content": systems[system]},
            {"role": "user", "content": format!("question {question}: which engine is idle?")},
        ]});
        let (client, url, engines) = (router.client.clone(), url.clone(), &engines);
        async move {
            let before: Vec<u64> = (0..2)
                .map(|index| engines.generation_requests(index).unwrap())
                .collect();
            let response = client.post(&url).json(&body).send().await.unwrap();
            assert!(response.status().is_success(), "{}", response.status());
            response.bytes().await.unwrap();
            let served: Vec<usize> = (0..2)
                .filter(|index| engines.generation_requests(*index).unwrap() > before[*index])
                .collect();
            assert_eq!(served.len(), 1, "one engine served the request");
            served[0]
        }
    };
    let home = [send(0, 0).await, send(1, 0).await];
    // Without prefix hashes the tie-break between idle workers alternates
    // them (with `request.prefix_hash_max_tokens = 0` consecutive requests
    // of one prefix change workers and this test fails); affinity keeps
    // each prefix home.
    let mut landed = Vec::new();
    for (question, system) in [0, 0, 0, 1, 1, 0, 1, 0, 0, 1].into_iter().enumerate() {
        landed.push((system, send(system, question + 1).await));
    }
    assert!(
        landed
            .iter()
            .all(|(system, worker)| *worker == home[*system]),
        "homes {home:?}; (prefix, worker) per request: {landed:?}"
    );

    // A policy swapped in at run time starts from the prefix index of the
    // one it replaces: it expects each system prompt cached at its home.
    let swapped = router
        .client
        .put(format!("{}/admin/policy", router.base))
        .json(&serde_json::json!({"kind": "least_load"}))
        .send()
        .await
        .unwrap();
    assert!(swapped.status().is_success(), "{}", swapped.status());
    for (system, home) in home.into_iter().enumerate() {
        let body = serde_json::json!({"model": "m", "messages": [
            {"role": "system", "content": systems[system]},
            {"role": "user", "content": "after the swap"},
        ]});
        let table: serde_json::Value = router
            .client
            .post(format!("{}/admin/policy/explain", router.base))
            .header("accept", "application/json")
            .json(&body)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let cached = |index: usize| {
            common::explain_column(&table, &engines.engines()[index].http_url(), "cached_tok")
        };
        assert!(cached(home) > 0.0, "{table}");
        assert_eq!(cached(1 - home), 0.0, "{table}");
        assert_eq!(send(system, 100).await, home);
    }
    drop(router);
    engines.shutdown().await;
}
