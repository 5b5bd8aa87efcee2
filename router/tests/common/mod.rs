//! Shared pieces of the router's end-to-end tests: a real router in-process
//! on loopback, a scriptable upstream engine, and waiting with deadlines.

#![allow(dead_code)]

pub mod hand;
pub mod nats;
pub mod upstream;

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use router::config::{Layers, RouterConfig, WorkerConfig};
use tokio::sync::oneshot;

/// A router serving on `127.0.0.1:<ephemeral>`, stopped on drop.
pub struct TestRouter {
    /// The config it was started with.
    pub config: RouterConfig,
    pub base: String,
    pub address: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    pub client: reqwest::Client,
}

impl Drop for TestRouter {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Fast polling and health checks so tests converge quickly.
pub fn fast_config(workers: Vec<WorkerConfig>, policy_toml: &str) -> RouterConfig {
    let text = format!(
        "[load_monitor]\ninterval_ms = 100\ntimeout_ms = 500\nstale_after_ms = 1000\n\
         [health]\ninterval_ms = 100\ntimeout_ms = 500\nfailure_threshold = 2\nsuccess_threshold = 1\n\
         {policy_toml}"
    );
    let path = std::env::temp_dir().join(format!(
        "router-test-{}-{}.toml",
        std::process::id(),
        NEXT_FILE.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    std::fs::write(&path, text).unwrap();
    let config = RouterConfig::load(Layers {
        file: Some(&path),
        workers,
        ..Layers::default()
    })
    .unwrap();
    let _ = std::fs::remove_file(&path);
    config
}

/// A round-robin router (so a broken engine gets its share) over every
/// engine of `engines`, with `extra` config, once it sees them all healthy.
pub async fn round_robin_over(engines: &mock_engines::SimFleet, extra: &str) -> TestRouter {
    router_over(
        engines,
        &format!("[policy]\nkind = \"round_robin\"\n{extra}"),
    )
    .await
}

/// A router with `config_toml` over every engine of `engines` (SGLang
/// workers), once it sees them all healthy.
pub async fn router_over(engines: &mock_engines::SimFleet, config_toml: &str) -> TestRouter {
    let workers = engines
        .engines()
        .iter()
        .map(|engine| worker("sglang", &engine.http_url()))
        .collect();
    let router = start_router(fast_config(workers, config_toml)).await;
    let expected = engines.engines().len();
    wait_until("every engine is healthy", || async {
        router.healthy_count().await == expected
    })
    .await;
    router
}

static NEXT_FILE: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

pub fn worker(backend: &str, url: &str) -> WorkerConfig {
    WorkerConfig {
        url: url.to_owned(),
        backend: Some(backend.to_owned()),
        load_url: None,
        api_key: None,
    }
}

pub async fn start_router(config: RouterConfig) -> TestRouter {
    start_built(router::RouterBuilder::with_builtins(), config).await
}

/// A router of `builder`'s parts (a test's own policy, say).
pub async fn start_built(builder: router::RouterBuilder, config: RouterConfig) -> TestRouter {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let app = builder.start(config.clone(), None).await.unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(async move {
        let _ = router::serve(app, listener, async {
            let _ = stopped.await;
        })
        .await;
    });
    TestRouter {
        config,
        base: format!("http://{address}"),
        address,
        stop: Some(stop),
        client: reqwest::Client::new(),
    }
}

/// Waits until `condition` holds, checking every 20 ms, for at most 20 s
/// (generous: a loaded 2-core machine). Panics with `what` on timeout.
pub async fn wait_until<F, Fut>(what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        if condition().await {
            return;
        }
        if tokio::time::Instant::now() > deadline {
            panic!("timed out waiting until {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

impl TestRouter {
    /// `GET <path>`'s JSON body.
    pub async fn get_json(&self, path: &str) -> serde_json::Value {
        self.client
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    pub async fn workers_json(&self) -> serde_json::Value {
        self.get_json("/admin/workers").await
    }

    pub async fn admission_json(&self) -> serde_json::Value {
        self.get_json("/admin/admission").await
    }

    /// Workers healthy, not ejected and not draining.
    pub async fn in_rotation_count(&self) -> usize {
        self.workers_json().await["workers"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|worker| worker["in_rotation"] == true)
            .count()
    }

    /// The active policy's name, from `/admin/policy`.
    pub async fn policy_kind(&self) -> String {
        let policy: serde_json::Value = self
            .client
            .get(format!("{}/admin/policy", self.base))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        policy["kind"].as_str().unwrap().to_owned()
    }

    /// Adds a worker through `POST /admin/workers`.
    pub async fn add_worker(&self, worker: &WorkerConfig) {
        let added = self
            .client
            .post(format!("{}/admin/workers", self.base))
            .json(&serde_json::json!({"url": worker.url, "backend": worker.backend}))
            .send()
            .await
            .unwrap();
        assert_eq!(added.status(), 201, "{}", added.text().await.unwrap());
    }

    pub async fn healthy_count(&self) -> usize {
        self.workers_json().await["workers"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|worker| worker["healthy"] == true)
            .count()
    }

    pub async fn chat(&self, text: &str, stream: bool) -> reqwest::Response {
        self.client
            .post(format!("{}/v1/chat/completions", self.base))
            .json(&serde_json::json!({
                "model": "test-model",
                "stream": stream,
                "messages": [{"role": "user", "content": text}],
            }))
            .send()
            .await
            .unwrap()
    }
}

/// One column of the worker at `url` in an explain table (its JSON form).
pub fn explain_column(table: &serde_json::Value, url: &str, column: &str) -> f64 {
    let index = table["columns"]
        .as_array()
        .unwrap()
        .iter()
        .position(|name| name == column)
        .unwrap();
    let row = table["rows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|row| row["url"] == url)
        .unwrap_or_else(|| panic!("no row for {url} in {table}"));
    row["values"][index].as_f64().unwrap()
}

/// The value of the router's metric line that starts with `series` (0 if
/// absent).
pub async fn metric(router: &TestRouter, series: &str) -> f64 {
    let text = router
        .client
        .get(format!("{}/metrics", router.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .map_or(0.0, |value| value.parse().unwrap())
}

/// The sum of every series of the router's metric `family` (0 if absent):
/// `router_selections_total` is the selections of every worker.
pub async fn metric_sum(router: &TestRouter, family: &str) -> f64 {
    let text = router
        .client
        .get(format!("{}/metrics", router.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter_map(|line| {
            let rest = line.strip_prefix(family)?;
            let value = match rest.strip_prefix('{') {
                Some(labelled) => labelled.split_once("} ")?.1,
                None => rest.strip_prefix(' ')?,
            };
            Some(value.parse::<f64>().unwrap())
        })
        .sum()
}

/// Whether the router's replica sync is connected to its broker.
pub async fn sync_connected(router: &TestRouter) -> bool {
    metric(router, "router_sync_connected").await == 1.0
}
