//! The admin API end to end.

// Test helpers outside #[test] functions fail loudly on purpose.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::upstream::Upstream;
use common::{fast_config, start_router, wait_until, worker};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_are_listed_added_and_drained() {
    let first = Upstream::start().await;
    let second = Upstream::start().await;
    let router = start_router(fast_config(vec![worker("sglang", &first.url)], "")).await;
    wait_until("the first worker has a load report", || async {
        !router.workers_json().await["workers"][0]["load"].is_null()
    })
    .await;
    let listed = router.workers_json().await;
    let entry = &listed["workers"][0];
    assert_eq!(entry["id"], "0.0");
    assert_eq!(entry["url"], first.url);
    assert_eq!(entry["backend"], "sglang");
    assert_eq!(entry["healthy"], true);
    assert_eq!(entry["in_flight"], 0);
    assert_eq!(entry["pending_tokens"], 0);
    assert_eq!(entry["poll_failures"], 0);
    assert_eq!(
        entry["load"]["loads"][0]["gen_throughput"], 2000.0,
        "SGLang field names"
    );
    assert!(entry["load_age_s"].as_f64().unwrap() >= 0.0);

    let added = router
        .client
        .post(format!("{}/admin/workers", router.base))
        .json(&serde_json::json!({"url": second.url, "backend": "sglang"}))
        .send()
        .await
        .unwrap();
    assert_eq!(added.status(), 201);
    let added: serde_json::Value = added.json().await.unwrap();
    assert_eq!(added["id"], "1.0");
    wait_until("two workers are healthy", || async {
        router.healthy_count().await == 2
    })
    .await;

    let invalid = router
        .client
        .post(format!("{}/admin/workers", router.base))
        .json(&serde_json::json!({"url": "ftp://nope", "backend": "sglang"}))
        .send()
        .await
        .unwrap();
    assert_eq!(invalid.status(), 400);
    let error: serde_json::Value = invalid.json().await.unwrap();
    assert_eq!(
        error["error"]["message"],
        "invalid worker.url = \"ftp://nope\": must be an http:// or https://host:port URL without a query"
    );

    let removed = router
        .client
        .delete(format!("{}/admin/workers/0.0", router.base))
        .send()
        .await
        .unwrap();
    assert_eq!(removed.status(), 202);
    wait_until("the drained worker is gone", || async {
        let workers = router.workers_json().await;
        workers["workers"].as_array().unwrap().len() == 1 && workers["workers"][0]["id"] == "1.0"
    })
    .await;
    for index in 0..4 {
        assert_eq!(
            router.chat(&format!("after {index}"), false).await.status(),
            200
        );
    }
    assert_eq!(second.requests(), 4, "nothing goes to a removed worker");
    let missing = router
        .client
        .delete(format!("{}/admin/workers/0.0", router.base))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_policy_swaps_through_the_admin_api() {
    let upstream = Upstream::start().await;
    let router = start_router(fast_config(vec![worker("sglang", &upstream.url)], "")).await;
    let policy: serde_json::Value = router
        .client
        .get(format!("{}/admin/policy", router.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(policy["kind"], "least_load");
    assert_eq!(policy["params"]["kv_pressure_weight"], 0.15);

    let swapped = router
        .client
        .put(format!("{}/admin/policy", router.base))
        .json(&serde_json::json!({"kind": "power_of_two", "power_of_two": {"kv_pressure_weight": 0.5}}))
        .send()
        .await
        .unwrap();
    assert_eq!(swapped.status(), 200);
    let swapped: serde_json::Value = swapped.json().await.unwrap();
    assert_eq!(swapped["kind"], "power_of_two");
    assert_eq!(swapped["params"]["kv_pressure_weight"], 0.5);

    let rejected = router
        .client
        .put(format!("{}/admin/policy", router.base))
        .json(
            &serde_json::json!({"kind": "least_load", "least_load": {"kv_pressure_weight": -1.0}}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(rejected.status(), 400);
    let error: serde_json::Value = rejected.json().await.unwrap();
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("kv_pressure_weight"),
        "{error}"
    );
    assert_eq!(
        router.policy_kind().await,
        "power_of_two",
        "the old policy is kept"
    );

    // The swapped-in policy was primed with the worker and routes at once.
    assert_eq!(
        router
            .chat("routed by the new policy", false)
            .await
            .status(),
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_is_served_as_text_and_json() {
    let upstream = Upstream::start().await;
    let router = start_router(fast_config(vec![worker("sglang", &upstream.url)], "")).await;
    wait_until("the worker is healthy", || async {
        router.healthy_count().await == 1
    })
    .await;
    let text = router
        .client
        .get(format!("{}/admin/policy/explain?tokens=500", router.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        text.starts_with("policy: least_load  request: 500 tokens (exact)"),
        "{text}"
    );
    assert!(text.contains(&upstream.url), "{text}");
    let json: serde_json::Value = router
        .client
        .get(format!("{}/admin/policy/explain?tokens=500", router.base))
        .header("accept", "application/json")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(json["policy"], "least_load");
    assert_eq!(json["rows"][0]["worker"], "0.0");
    assert_eq!(json["chosen"][0], "0.0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_auth_is_enforced() {
    let upstream = Upstream::start().await;
    let mut config = fast_config(vec![worker("sglang", &upstream.url)], "");
    config.admin.api_key = Some("s3cret".into());
    let router = start_router(config).await;
    let url = format!("{}/admin/workers", router.base);
    let anonymous = router.client.get(&url).send().await.unwrap();
    assert_eq!(anonymous.status(), 401);
    let error: serde_json::Value = anonymous.json().await.unwrap();
    assert_eq!(error["error"]["type"], "authentication_error");
    let wrong = router
        .client
        .get(&url)
        .bearer_auth("guess")
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 401);
    let right = router
        .client
        .get(&url)
        .bearer_auth("s3cret")
        .send()
        .await
        .unwrap();
    assert_eq!(right.status(), 200);
    let delete = router
        .client
        .delete(format!("{url}/0.0"))
        .send()
        .await
        .unwrap();
    assert_eq!(delete.status(), 401, "mutations need the key too");
    // The proxy itself is not behind the admin key.
    assert_eq!(router.chat("hello", false).await.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_body_is_explained_with_its_prompt_and_prefix() {
    let upstream = Upstream::start().await;
    let router = start_router(fast_config(vec![worker("sglang", &upstream.url)], "")).await;
    wait_until("the worker is healthy", || async {
        router.healthy_count().await == 1
    })
    .await;
    let url = format!("{}/admin/policy/explain", router.base);
    let explain = |body: serde_json::Value| {
        let (client, url) = (router.client.clone(), url.clone());
        async move {
            client
                .post(&url)
                .header("accept", "application/json")
                .json(&body)
                .send()
                .await
                .unwrap()
        }
    };
    // About 2000 tokens of prompt, 4 characters each.
    let prompt = "the same long system prompt, every turn. ".repeat(200);
    let body = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": prompt}]});
    let value = |table: &serde_json::Value, column: &str| {
        let index = table["columns"]
            .as_array()
            .unwrap()
            .iter()
            .position(|name| name == column)
            .unwrap();
        table["rows"][0]["values"][index].as_f64().unwrap()
    };
    let before: serde_json::Value = explain(body.clone()).await.json().await.unwrap();
    assert!(value(&before, "request_tok") >= 2000.0, "{before}");
    assert_eq!(value(&before, "cached_tok"), 0.0, "nothing was dispatched");
    // Explaining dispatches nothing; sending does.
    assert_eq!(upstream.requests(), 0);
    let sent = router
        .client
        .post(format!("{}/v1/chat/completions", router.base))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(sent.status(), 200);
    let after: serde_json::Value = explain(body.clone()).await.json().await.unwrap();
    assert!(value(&after, "cached_tok") > 0.0, "{after}");
    // A body the proxy would refuse is refused here too.
    let refused = router
        .client
        .post(&url)
        .body("not json")
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 400);
}
