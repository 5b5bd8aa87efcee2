//! The router's shared state and the operations that change its topology:
//! adding and draining workers, and swapping the policy.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::RwLock;
use policy_core::{
    BackendRegistry, BackendSpec, Policy, PolicyContext, PolicyRegistry, SourceOptions,
    prime_worker, tokio_now,
};

use crate::config::{PolicyConfig, RouterConfig, WorkerConfig, validate_worker};
use crate::error::{ConfigError, RouterError};
use crate::metrics::{Metrics, WorkerMetrics};
use crate::monitor::error_chain;
use crate::upstream::{UpstreamClient, control_get, upstream_client};
use crate::workers::{HealthChange, Worker, WorkerRegistry};

/// Every policy the router can run.
pub fn policy_registry() -> PolicyRegistry {
    let mut registry = PolicyRegistry::with_baselines();
    policy_least_load::register(&mut registry);
    registry
}

/// Every backend the router can poll.
pub fn backend_registry() -> BackendRegistry {
    let mut registry = BackendRegistry::new();
    backends_sglang::register(&mut registry);
    backends_tokenspeed::register(&mut registry);
    backends_vllm::register(&mut registry);
    registry
}

/// The state every request handler and background task shares.
pub struct App {
    pub config: RouterConfig,
    pub config_file: Option<PathBuf>,
    pub policies: PolicyRegistry,
    pub backends: BackendRegistry,
    policy: RwLock<Arc<dyn Policy>>,
    policy_config: RwLock<PolicyConfig>,
    pub workers: WorkerRegistry,
    /// Forwards requests to workers, and carries the control-plane calls.
    pub upstream: UpstreamClient,
    pub metrics: Metrics,
    /// Serializes worker additions, removals and policy swaps, so a swap
    /// never misses a worker added while it primed.
    topology: tokio::sync::Mutex<()>,
}

impl std::fmt::Debug for App {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("App")
            .field("policy", &self.policy().name())
            .field("workers", &self.workers)
            .finish()
    }
}

impl App {
    /// Builds the state and the policy; workers are added by [`App::add_worker`].
    pub fn new(
        config: RouterConfig,
        config_file: Option<PathBuf>,
    ) -> Result<Arc<App>, RouterError> {
        let policies = policy_registry();
        let policy = build_policy(&policies, &config, &config.policy)?;
        let upstream = upstream_client(config.server.connect_timeout());
        Ok(Arc::new(App {
            policy_config: RwLock::new(config.policy.clone()),
            config,
            config_file,
            policies,
            backends: backend_registry(),
            policy: RwLock::new(policy),
            workers: WorkerRegistry::new(),
            upstream,
            metrics: Metrics::new(),
            topology: tokio::sync::Mutex::new(()),
        }))
    }

    /// The active policy. Requests keep the `Arc` they dispatched with, so a
    /// swap lets them finish against the policy that credited them.
    pub fn policy(&self) -> Arc<dyn Policy> {
        self.policy.read().clone()
    }

    pub fn policy_config(&self) -> PolicyConfig {
        self.policy_config.read().clone()
    }

    /// Adds a worker: detects its backend if none was named, builds its load
    /// source, checks its health once, and registers it with the policy.
    pub async fn add_worker(&self, worker: WorkerConfig) -> Result<Arc<Worker>, RouterError> {
        validate_worker(&worker).map_err(|(field, value, allowed)| {
            RouterError::Config(ConfigError::Invalid {
                key: format!("worker.{field}"),
                value,
                allowed: allowed.to_owned(),
            })
        })?;
        let backend = match worker.backend.clone() {
            Some(backend) => backend,
            None => self.detect_backend(&worker).await?,
        };
        let spec = BackendSpec {
            worker_url: worker.url.clone(),
            load_url: worker.load_url.clone(),
            options: SourceOptions {
                deadline: self.config.load_monitor.timeout(),
                api_key: worker.api_key.clone(),
                ..SourceOptions::default()
            },
        };
        let source =
            self.backends
                .build(&backend, &spec)
                .map_err(|source| RouterError::Backend {
                    url: worker.url.clone(),
                    source,
                })?;
        let _topology = self.topology.lock().await;
        let id = self.workers.allocate_id();
        let entry = Arc::new(Worker::new(
            id,
            worker.url.clone(),
            backend,
            worker.load_url.clone(),
            worker.api_key.clone(),
            source,
            WorkerMetrics::new(&self.metrics, worker.url.trim_end_matches('/')),
        ));
        self.policy().add_worker(id, entry.info());
        self.workers.insert(entry.clone());
        // One check now, so a healthy worker takes traffic at once.
        self.check_health(&entry).await;
        tracing::info!(worker = %entry.url, backend = %entry.backend, id = %id, healthy = entry.is_healthy(), "worker added");
        Ok(entry)
    }

    /// Drains a worker: no new requests go to it; in-flight ones finish, then
    /// it is forgotten. Returns false when no such worker exists.
    pub async fn remove_worker(self: &Arc<Self>, id: policy_core::WorkerId) -> bool {
        let _topology = self.topology.lock().await;
        let Some(worker) = self.workers.start_draining(id) else {
            return false;
        };
        tracing::info!(worker = %worker.url, in_flight = worker.in_flight(), "worker draining");
        let app = self.clone();
        tokio::spawn(async move {
            worker.until_idle().await;
            let _topology = app.topology.lock().await;
            app.policy().remove_worker(id);
            app.workers.forget(id);
            tracing::info!(worker = %worker.url, "worker removed");
        });
        true
    }

    /// Builds a policy from `section`, primes it with every worker and its
    /// latest load, and swaps it in. On error the old policy stays.
    pub async fn swap_policy(&self, section: PolicyConfig) -> Result<(), RouterError> {
        let _topology = self.topology.lock().await;
        let policy = build_policy(&self.policies, &self.config, &section)?;
        let now = tokio_now();
        for worker in self.workers.all() {
            if worker.is_draining() {
                continue;
            }
            policy.add_worker(worker.id, worker.info());
            if let Some(load) = worker.latest_load() {
                prime_worker(policy.as_ref(), worker.id, &load, now);
            }
        }
        let name = policy.name();
        *self.policy.write() = policy;
        *self.policy_config.write() = section;
        tracing::info!(policy = name, "policy swapped");
        Ok(())
    }

    /// One `/health` check; updates rotation.
    pub async fn check_health(&self, worker: &Worker) {
        let health = &self.config.health;
        let url = format!("{}/health", worker.url);
        let timeout = Duration::from_millis(health.timeout_ms);
        let change = match control_get(&self.upstream, &url, timeout).await {
            Ok((status, _)) if status.is_success() => {
                worker.health_check_passed(health.success_threshold)
            }
            Ok((status, _)) => {
                tracing::debug!(worker = %worker.url, %status, "health check failed");
                worker.health_check_failed(health.failure_threshold)
            }
            Err(error) => {
                tracing::debug!(worker = %worker.url, error = %error_chain(&error), "health check failed");
                worker.health_check_failed(health.failure_threshold)
            }
        };
        self.apply_health_change(worker, change);
    }

    pub fn apply_health_change(&self, worker: &Worker, change: HealthChange) {
        match change {
            HealthChange::None => {}
            HealthChange::CameBack => {
                tracing::info!(worker = %worker.url, "worker healthy: in rotation");
                self.workers.refresh_candidates();
            }
            HealthChange::WentOut => {
                tracing::warn!(worker = %worker.url, "worker unhealthy: out of rotation");
                self.workers.refresh_candidates();
            }
        }
    }

    /// `/v1/loads` means SGLang; a `/metrics` with `vllm:` families means vLLM.
    async fn detect_backend(&self, worker: &WorkerConfig) -> Result<String, RouterError> {
        let base = worker.url.trim_end_matches('/');
        let timeout = self.config.load_monitor.timeout();
        let loads = control_get(
            &self.upstream,
            &format!("{base}/v1/loads?include=core"),
            timeout,
        )
        .await;
        if loads.is_ok_and(|(status, _)| status.is_success()) {
            return Ok("sglang".into());
        }
        let metrics = control_get(&self.upstream, &format!("{base}/metrics"), timeout).await;
        if let Ok((status, body)) = metrics
            && status.is_success()
        {
            let text = String::from_utf8_lossy(&body);
            if text.contains("vllm:") {
                return Ok("vllm".into());
            }
            if text.contains("sglang:") || text.contains("sglang_") {
                return Ok("sglang".into());
            }
        }
        Err(RouterError::DetectFailed {
            url: worker.url.clone(),
        })
    }
}

/// The construction context every policy gets, from the `load_monitor` section.
pub fn policy_context(config: &RouterConfig) -> PolicyContext {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|elapsed| elapsed.as_nanos() as u64)
        .unwrap_or(0x5eed);
    PolicyContext {
        poll_interval: config.load_monitor.interval(),
        stale_after: config.load_monitor.stale_after(),
        rng_seed: seed,
    }
}

/// Builds the policy a `[policy]` section names.
pub fn build_policy(
    registry: &PolicyRegistry,
    config: &RouterConfig,
    section: &PolicyConfig,
) -> Result<Arc<dyn Policy>, ConfigError> {
    for name in section.sections.keys() {
        if !registry.names().contains(&name.as_str()) {
            return Err(ConfigError::Invalid {
                key: format!("policy.{name}"),
                value: "a section".into(),
                allowed: format!(
                    "a section named after a policy: one of {}",
                    registry.names().join(", ")
                ),
            });
        }
    }
    let policy = registry.build(
        &section.kind,
        &section.active_section(),
        &policy_context(config),
    )?;
    Ok(Arc::from(policy))
}

/// Validates every policy section by building its policy, and writes each
/// policy's effective knobs back into the config, so `--print-config` shows
/// every knob with its value. Policies without knobs get no section.
pub fn complete_policy_sections(config: &mut RouterConfig) -> Result<(), ConfigError> {
    let registry = policy_registry();
    build_policy(&registry, config, &config.policy)?;
    let context = policy_context(config);
    for name in registry.names() {
        let section = config
            .policy
            .sections
            .get(name)
            .cloned()
            .unwrap_or(serde_json::Value::Null);
        let params = registry.build(name, &section, &context)?.params();
        if params.as_object().is_some_and(|knobs| !knobs.is_empty()) {
            config.policy.sections.insert(name.to_owned(), params);
        }
    }
    Ok(())
}
