//! The router's shared state and the operations that change its topology:
//! adding and draining workers, swapping the policy, health checks and
//! outlier ejection. Every topology change goes through [`Topology`].

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use policy_core::{
    AdmissionRegistry, BackendRegistry, BackendSpec, Policy, PolicyContext, PolicyRegistry,
    SourceOptions, error_chain,
};

use crate::admission::{Gate, peer_lag};
use crate::config::{AdmissionConfig, PolicyConfig, RouterConfig, WorkerConfig, validate_worker};
use crate::error::{ConfigError, RouterError};
use crate::metrics::{Metrics, WorkerMetrics};
use crate::outlier::Failure;
use crate::server::tls::{ListenerTls, WorkerTrust};
use crate::topology::Topology;
use crate::upstream::{UpstreamClient, control_get, upstream_client};
use crate::workers::{HealthChange, Worker};

/// The state every request handler and background task shares.
///
/// Outside this crate, an opaque handle to a started router:
/// [`RouterBuilder::start`](crate::RouterBuilder::start) makes one and
/// [`serve`](crate::serve) serves it.
pub struct App {
    pub(crate) config: RouterConfig,
    pub(crate) config_file: Option<PathBuf>,
    pub(crate) policies: PolicyRegistry,
    pub(crate) backends: BackendRegistry,
    /// The policy, the workers and the candidates, behind one writer.
    pub(crate) topology: Topology,
    /// Forwards requests to workers, and carries the control-plane calls.
    pub(crate) upstream: UpstreamClient,
    pub(crate) metrics: Metrics,
    /// Tells the replica-sync publisher about dispatches (a no-op without
    /// `[sync]`).
    pub(crate) sync_signal: crate::replica_sync::DispatchSignal,
    /// The other router replicas' admission rooms, as sync last heard
    /// them (none without `[sync]`).
    pub(crate) peer_rooms: crate::replica_sync::PeerRooms,
    /// Where requests wait while the fleet is saturated.
    pub(crate) admission: Gate,
    /// Request traces (`[tracing]`); empty when off.
    pub(crate) telemetry: crate::telemetry::Telemetry,
    /// The client listener's certificate (`[server.tls]`), swapped on SIGHUP.
    pub(crate) listener_tls: Option<ListenerTls>,
    /// How `https://` workers are trusted (`[worker_tls]`).
    pub(crate) worker_trust: WorkerTrust,
    /// Hedges left to spend (`[hedging] max_percent`).
    pub(crate) hedge_budget: crate::proxy::HedgeBudget,
}

impl std::fmt::Debug for App {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("App")
            .field("policy", &self.policy().name())
            .field("topology", &self.topology)
            .finish()
    }
}

impl App {
    /// Builds the state and the policy; workers are added by [`App::add_worker`].
    pub(crate) fn new(
        config: RouterConfig,
        config_file: Option<PathBuf>,
        policies: PolicyRegistry,
        backends: BackendRegistry,
        admissions: AdmissionRegistry,
    ) -> Result<Arc<App>, RouterError> {
        let policy = build_policy(&policies, &config, &config.policy)?;
        let admission = Gate::new(admissions, &config.admission, peer_lag(&config.sync))?;
        // A bad certificate, key or CA file stops the router here, at start.
        let listener_tls = match &config.server.tls {
            Some(files) => Some(ListenerTls::load(files).map_err(RouterError::ListenerTls)?),
            None => None,
        };
        let worker_trust = WorkerTrust::load(&config.worker_tls).map_err(RouterError::WorkerTls)?;
        let upstream = upstream_client(config.server.connect_timeout(), worker_trust.clone());
        let telemetry = crate::telemetry::Telemetry::new(&config.tracing)?;
        Ok(Arc::new(App {
            hedge_budget: crate::proxy::HedgeBudget::new(config.hedging.max_percent),
            topology: Topology::new(policy, config.policy.clone()),
            sync_signal: crate::replica_sync::DispatchSignal::new(&config.sync),
            peer_rooms: crate::replica_sync::PeerRooms::new(&config.sync),
            config,
            config_file,
            policies,
            backends,
            upstream,
            metrics: Metrics::new(),
            admission,
            telemetry,
            listener_tls,
            worker_trust,
        }))
    }

    /// The active policy. Requests keep the `Arc` they dispatched with, so a
    /// swap lets them finish against the policy that credited them.
    pub(crate) fn policy(&self) -> Arc<dyn Policy> {
        self.topology.load().policy.clone()
    }

    /// Every worker, in slot order.
    pub(crate) fn workers(&self) -> Vec<Arc<Worker>> {
        self.topology.load().workers().cloned().collect()
    }

    /// Adds a worker: detects its backend if none was named, builds its load
    /// source, checks its health once, and registers it with the policy.
    pub(crate) async fn add_worker(
        &self,
        worker: WorkerConfig,
    ) -> Result<Arc<Worker>, RouterError> {
        validate_worker(&worker, &self.backends).map_err(|(field, value, allowed)| {
            RouterError::Config(ConfigError::Invalid {
                key: format!("worker.{field}"),
                value,
                allowed,
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
                ca_file: self.config.worker_tls.ca_file.clone(),
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
        let pool = self.worker_trust.pool(&worker.url);
        let pool = pool.map_err(|source| RouterError::WorkerTrust {
            url: worker.url.clone(),
            source,
        })?;
        let metrics = WorkerMetrics::new(&self.metrics, worker.url.trim_end_matches('/'));
        let entry = self.topology.add(|id| {
            Arc::new(Worker::new(
                id,
                worker.url.clone(),
                pool,
                backend,
                worker.api_key.clone(),
                source,
                metrics,
            ))
        });
        // One check now, so a healthy worker takes traffic at once.
        self.check_health(&entry).await;
        tracing::info!(worker = %entry.url, backend = %entry.backend, id = %entry.id, healthy = entry.is_healthy(), "worker added");
        Ok(entry)
    }

    /// Drains a worker: no new requests go to it; in-flight ones finish, then
    /// it is forgotten. With a `grace` period, the streams still running at
    /// its end continue on other workers (with migration on). Returns false
    /// when no such worker exists.
    pub(crate) async fn remove_worker(
        self: &Arc<Self>,
        id: policy_core::WorkerId,
        grace: Option<Duration>,
    ) -> bool {
        let Some(worker) = self.topology.start_draining(id) else {
            return false;
        };
        tracing::info!(worker = %worker.url, in_flight = worker.in_flight(), ?grace, "worker draining");
        let app = self.clone();
        tokio::spawn(async move {
            if let Some(grace) = grace
                && tokio::time::timeout(grace, worker.until_idle())
                    .await
                    .is_err()
            {
                tracing::info!(worker = %worker.url, in_flight = worker.in_flight(), "drain grace over; its streams continue on other workers");
                worker.set_drained();
            }
            worker.until_idle().await;
            app.topology.forget(id);
            tracing::info!(worker = %worker.url, "worker removed");
        });
        true
    }

    /// Builds a policy from `section`, primes it with every worker and its
    /// latest load, and swaps it in. On error the old policy stays.
    pub(crate) async fn swap_policy(&self, section: PolicyConfig) -> Result<(), RouterError> {
        let policy = build_policy(&self.policies, &self.config, &section)?;
        let name = policy.name();
        self.topology.swap_policy(policy, section);
        tracing::info!(policy = name, "policy swapped");
        Ok(())
    }

    /// Replaces the `[admission]` section; the waiting requests move to the
    /// new order. On error the old section stays.
    pub(crate) fn swap_admission(&self, section: AdmissionConfig) -> Result<(), RouterError> {
        let order = section.order.clone();
        self.admission.swap(section)?;
        tracing::info!(order, "admission section swapped");
        Ok(())
    }

    /// One `/health` check; updates rotation.
    pub(crate) async fn check_health(&self, worker: &Worker) {
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

    pub(crate) fn apply_health_change(&self, worker: &Worker, change: HealthChange) {
        match change {
            HealthChange::None => {}
            HealthChange::CameBack => {
                tracing::info!(worker = %worker.url, "worker healthy: in rotation");
                self.topology.refresh();
            }
            HealthChange::WentOut => {
                tracing::warn!(worker = %worker.url, "worker unhealthy: out of rotation");
                self.topology.refresh();
            }
        }
    }

    /// A request on `worker` completed: its run of failures is over.
    pub(crate) fn request_succeeded(&self, worker: &Worker) {
        worker.with_outlier(|state| state.succeeded());
    }

    /// One of `worker`'s streams went silent: held back from new requests
    /// while any such mark lives.
    fn stream_went_silent(&self, worker: &Worker) {
        if worker.stream_went_silent() {
            tracing::warn!(
                worker = %worker.url,
                silent_stream_ms = self.config.outlier_detection.silent_stream_ms,
                "a stream on the worker went silent: held back from new requests until it sends again"
            );
            self.topology.refresh();
        }
    }

    /// A gateway failure of one request on `worker`: counted toward its
    /// ejection, which happens within the fleet-wide cap. How long the
    /// worker is out for, when this failure ejected it.
    pub(crate) fn request_failed(&self, worker: &Worker, failure: Failure) -> Option<Duration> {
        let outlier = &self.config.outlier_detection;
        let (due, failures) = worker.with_outlier(|state| {
            let due = state.failed(outlier);
            (due, state.consecutive_failures())
        });
        if !due {
            return None;
        }
        let now = tokio::time::Instant::now();
        let mut ejected_for = None;
        let ejected = self
            .topology
            .eject_within_cap(worker, outlier.max_ejected_percent, || {
                ejected_for = Some(worker.with_outlier(|state| state.eject(outlier, now)));
            });
        if ejected {
            worker.metrics.ejections.inc();
            tracing::warn!(
                worker = %worker.url,
                ?failure,
                failures,
                ejected_for = ?ejected_for.unwrap_or_default(),
                "worker ejected after consecutive failures; it returns when a generation probe passes"
            );
        } else if !worker.is_ejected() {
            self.metrics.ejections_refused.inc();
            // Logged when the run first reaches the threshold, not on every
            // failure after it.
            if failures == outlier.consecutive_failures {
                tracing::warn!(
                    worker = %worker.url,
                    max_ejected_percent = outlier.max_ejected_percent,
                    "worker keeps failing but is not ejected: the ejection cap is reached"
                );
            }
        }
        ejected.then(|| ejected_for.unwrap_or_default())
    }

    /// Probes one ejected worker whose ejection time is over: back in
    /// rotation when the probe passes, ejected again for longer when not.
    pub(crate) async fn probe_ejected(&self, worker: &Worker) {
        let outlier = &self.config.outlier_detection;
        let kind = outlier.probe_for(&worker.backend);
        let result =
            crate::probe::probe(&self.upstream, worker, kind, outlier.probe_timeout()).await;
        let now = tokio::time::Instant::now();
        let outcome = if result.is_ok() { "pass" } else { "fail" };
        self.metrics
            .probes
            .get_or_create(&crate::metrics::RequestLabels {
                worker: worker.metrics.label.clone(),
                status: outcome.to_owned(),
            })
            .inc();
        match result {
            Ok(()) => {
                worker.with_outlier(|state| state.probe_passed(now));
                self.topology.refresh();
                tracing::info!(worker = %worker.url, ?kind, "probe passed: worker back in rotation");
            }
            Err(error) => {
                let again = worker.with_outlier(|state| state.probe_failed(outlier, now));
                worker.metrics.ejections.inc();
                tracing::info!(worker = %worker.url, ?kind, error = %error_chain(&error), ejected_for = ?again, "probe failed: worker stays out");
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
pub(crate) fn policy_context(config: &RouterConfig) -> PolicyContext {
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
pub(crate) fn build_policy(
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
pub(crate) fn complete_policy_sections(
    registry: &PolicyRegistry,
    config: &mut RouterConfig,
) -> Result<(), ConfigError> {
    build_policy(registry, config, &config.policy)?;
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

/// A stream whose worker has sent nothing on it for
/// `outlier_detection.silent_stream_ms`. While any lives, the worker is
/// held back from new requests (unless every worker is); dropping the last
/// one (the stream sent again, or ended) lets it back.
#[derive(Debug)]
pub(crate) struct SilentStream {
    app: Arc<App>,
    worker: Arc<Worker>,
}

impl SilentStream {
    pub(crate) fn new(app: &Arc<App>, worker: &Arc<Worker>) -> SilentStream {
        app.stream_went_silent(worker);
        SilentStream {
            app: app.clone(),
            worker: worker.clone(),
        }
    }
}

impl Drop for SilentStream {
    fn drop(&mut self) {
        if self.worker.silent_stream_ended() {
            tracing::info!(worker = %self.worker.url, "no stream on the worker is silent now: back in selection");
            self.app.topology.refresh();
        }
    }
}
