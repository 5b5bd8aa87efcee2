//! The worker registry: who the workers are, whether each is in rotation, and
//! its latest load report.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use http::uri::{Authority, Scheme};
use http::{HeaderValue, Uri};
use load_protocols::WorkerLoad;
use parking_lot::{Mutex, RwLock};
use policy_core::http::bearer_header;
use policy_core::{LoadSource, WorkerId, WorkerIdAllocator, WorkerInfo};

use crate::metrics::WorkerMetrics;

/// One upstream engine.
pub struct Worker {
    pub id: WorkerId,
    /// HTTP address requests travel to, without a trailing slash.
    pub url: String,
    /// `url`, parsed once: a request joins its path to this without parsing
    /// the host again. `None` if it does not parse.
    base: Option<UpstreamBase>,
    pub backend: String,
    pub load_url: Option<String>,
    /// `Authorization: Bearer <api_key>`, built once and marked sensitive.
    pub authorization: Option<HeaderValue>,
    pub source: Arc<dyn LoadSource>,
    pub metrics: WorkerMetrics,
    healthy: AtomicBool,
    checked: AtomicBool,
    draining: AtomicBool,
    check_failures: AtomicU32,
    check_successes: AtomicU32,
    request_failures: AtomicU32,
    poll_failures: AtomicU32,
    in_flight: AtomicU64,
    /// Woken when `in_flight` drops to 0, for a drain to finish.
    idle: tokio::sync::Notify,
    latest_load: Mutex<Option<WorkerLoad>>,
}

/// A worker address split once into the parts every request URI reuses.
#[derive(Debug, Clone)]
struct UpstreamBase {
    scheme: Scheme,
    authority: Authority,
    /// A path the worker sits behind (`/engine-a`), without a trailing slash;
    /// usually empty.
    path_prefix: String,
}

impl UpstreamBase {
    fn parse(url: &str) -> Option<UpstreamBase> {
        let uri: Uri = url.parse().ok()?;
        let parts = uri.into_parts();
        Some(UpstreamBase {
            scheme: parts.scheme?,
            authority: parts.authority?,
            path_prefix: parts
                .path_and_query
                .map(|path| path.path().trim_end_matches('/').to_owned())
                .unwrap_or_default(),
        })
    }

    fn join(&self, path: &str, query: Option<&str>) -> Option<Uri> {
        let path_and_query = match query {
            Some(query) => format!("{}{path}?{query}", self.path_prefix),
            None => format!("{}{path}", self.path_prefix),
        };
        Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(path_and_query)
            .build()
            .ok()
    }
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("id", &self.id)
            .field("url", &self.url)
            .field("backend", &self.backend)
            .field("healthy", &self.is_healthy())
            .finish()
    }
}

/// What changed in a worker's rotation state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HealthChange {
    None,
    CameBack,
    WentOut,
}

impl Worker {
    pub fn new(
        id: WorkerId,
        url: String,
        backend: String,
        load_url: Option<String>,
        api_key: Option<String>,
        source: Arc<dyn LoadSource>,
        metrics: WorkerMetrics,
    ) -> Worker {
        let url = url.trim_end_matches('/').to_owned();
        // Config validation rejects a key that cannot be a header value.
        let authorization = api_key.as_deref().and_then(|key| bearer_header(key).ok());
        Worker {
            id,
            base: UpstreamBase::parse(&url),
            url,
            backend,
            load_url,
            authorization,
            source,
            metrics,
            healthy: AtomicBool::new(false),
            checked: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            check_failures: AtomicU32::new(0),
            check_successes: AtomicU32::new(0),
            request_failures: AtomicU32::new(0),
            poll_failures: AtomicU32::new(0),
            in_flight: AtomicU64::new(0),
            idle: tokio::sync::Notify::new(),
            latest_load: Mutex::new(None),
        }
    }

    /// The worker's URI for a request path (`/v1/chat/completions`) and query.
    pub fn uri_for(&self, path: &str, query: Option<&str>) -> Option<Uri> {
        self.base.as_ref()?.join(path, query)
    }

    pub fn info(&self) -> WorkerInfo {
        WorkerInfo::new(self.url.clone(), self.backend.clone())
    }

    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Acquire)
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// A passed `/health` check. The first check decides at once; after
    /// that, `success_threshold` passes in a row bring an out-of-rotation
    /// worker back.
    pub fn health_check_passed(&self, success_threshold: u32) -> HealthChange {
        self.check_failures.store(0, Ordering::Release);
        let successes = self.check_successes.fetch_add(1, Ordering::AcqRel) + 1;
        let first_check = !self.checked.swap(true, Ordering::AcqRel);
        if !self.is_healthy() && (first_check || successes >= success_threshold) {
            self.request_failures.store(0, Ordering::Release);
            return self.set_healthy(true);
        }
        HealthChange::None
    }

    /// A failed `/health` check; `failure_threshold` in a row take it out.
    pub fn health_check_failed(&self, failure_threshold: u32) -> HealthChange {
        self.checked.store(true, Ordering::Release);
        self.check_successes.store(0, Ordering::Release);
        let failures = self.check_failures.fetch_add(1, Ordering::AcqRel) + 1;
        if failures >= failure_threshold {
            return self.set_healthy(false);
        }
        HealthChange::None
    }

    /// A whole response came back: the run of request failures is over.
    pub fn request_succeeded(&self) {
        self.request_failures.store(0, Ordering::Release);
    }

    /// Passive health: a connect error, a 5xx or a cut stream.
    /// `failure_threshold` in a row take the worker out until health checks
    /// bring it back (a passing `/health` alone does not clear this run).
    pub fn request_failed(&self, failure_threshold: u32) -> HealthChange {
        let failures = self.request_failures.fetch_add(1, Ordering::AcqRel) + 1;
        if failures >= failure_threshold {
            return self.set_healthy(false);
        }
        HealthChange::None
    }

    fn set_healthy(&self, healthy: bool) -> HealthChange {
        if self.healthy.swap(healthy, Ordering::AcqRel) == healthy {
            return HealthChange::None;
        }
        self.metrics.healthy.set(i64::from(healthy));
        if healthy {
            HealthChange::CameBack
        } else {
            // Coming back needs a fresh run of passed checks.
            self.check_successes.store(0, Ordering::Release);
            HealthChange::WentOut
        }
    }

    pub fn poll_succeeded(&self, load: Option<WorkerLoad>) -> bool {
        if let Some(load) = load {
            *self.latest_load.lock() = Some(load);
        }
        self.poll_failures.swap(0, Ordering::AcqRel) > 0
    }

    /// Returns the consecutive failure count, so the caller logs only on the
    /// first one (a state change).
    pub fn poll_failed(&self) -> u32 {
        self.metrics.poll_failures.inc();
        self.poll_failures.fetch_add(1, Ordering::AcqRel) + 1
    }

    pub fn consecutive_poll_failures(&self) -> u32 {
        self.poll_failures.load(Ordering::Acquire)
    }

    pub fn latest_load(&self) -> Option<WorkerLoad> {
        self.latest_load.lock().clone()
    }

    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Acquire)
    }

    pub fn request_started(&self) {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        self.metrics.in_flight.inc();
    }

    pub fn request_ended(&self) {
        if self.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.idle.notify_waiters();
        }
        self.metrics.in_flight.dec();
    }

    /// Returns once no request is in flight.
    pub async fn until_idle(&self) {
        loop {
            // Registered before the check, so a request ending in between
            // still wakes us.
            let idle = self.idle.notified();
            if self.in_flight() == 0 {
                return;
            }
            idle.await;
        }
    }
}

/// Every worker, by slot, plus the cached list of candidates (healthy and not
/// draining) that each selection reads.
#[derive(Debug, Default)]
pub struct WorkerRegistry {
    ids: Mutex<WorkerIdAllocator>,
    slots: RwLock<Vec<Option<Arc<Worker>>>>,
    candidates: RwLock<Arc<[WorkerId]>>,
}

impl WorkerRegistry {
    pub fn new() -> WorkerRegistry {
        WorkerRegistry::default()
    }

    pub fn allocate_id(&self) -> WorkerId {
        self.ids.lock().allocate()
    }

    pub fn insert(&self, worker: Arc<Worker>) {
        let slot = worker.id.slot();
        {
            let mut slots = self.slots.write();
            if slots.len() <= slot {
                slots.resize_with(slot + 1, || None);
            }
            slots[slot] = Some(worker);
        }
        self.refresh_candidates();
    }

    /// Takes the worker out of rotation; it stays listed until `forget`.
    pub fn start_draining(&self, id: WorkerId) -> Option<Arc<Worker>> {
        let worker = self.get(id)?;
        worker.draining.store(true, Ordering::Release);
        self.refresh_candidates();
        Some(worker)
    }

    /// Removes a drained worker and frees its id.
    pub fn forget(&self, id: WorkerId) {
        {
            let mut slots = self.slots.write();
            if let Some(entry) = slots.get_mut(id.slot())
                && entry.as_ref().is_some_and(|worker| worker.id == id)
            {
                *entry = None;
            }
        }
        self.ids.lock().release(id);
        self.refresh_candidates();
    }

    pub fn get(&self, id: WorkerId) -> Option<Arc<Worker>> {
        self.slots
            .read()
            .get(id.slot())
            .and_then(Option::as_ref)
            .filter(|worker| worker.id == id)
            .cloned()
    }

    pub fn all(&self) -> Vec<Arc<Worker>> {
        self.slots.read().iter().flatten().cloned().collect()
    }

    /// Healthy, non-draining workers: who `select` may choose.
    pub fn candidates(&self) -> Arc<[WorkerId]> {
        self.candidates.read().clone()
    }

    pub fn any_healthy(&self) -> bool {
        !self.candidates.read().is_empty()
    }

    pub fn refresh_candidates(&self) {
        let ids: Vec<WorkerId> = self
            .slots
            .read()
            .iter()
            .flatten()
            .filter(|worker| worker.is_healthy() && !worker.is_draining())
            .map(|worker| worker.id)
            .collect();
        *self.candidates.write() = ids.into();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;
    use policy_core::MockLoadSource;

    #[tokio::test(start_paused = true)]
    async fn a_drain_waits_for_the_last_request() {
        let worker = Arc::new(worker());
        worker.request_started();
        worker.request_started();
        let drained = tokio::spawn({
            let worker = worker.clone();
            async move { worker.until_idle().await }
        });
        tokio::task::yield_now().await;
        worker.request_ended();
        tokio::task::yield_now().await;
        assert!(!drained.is_finished(), "one request is still in flight");
        worker.request_ended();
        tokio::time::timeout(std::time::Duration::from_secs(1), drained)
            .await
            .expect("the drain ends with the last request")
            .unwrap();
        // Already idle: returns at once.
        worker.until_idle().await;
    }

    #[test]
    fn request_uris_join_the_worker_address() {
        let at = |base: &str| {
            let mut worker = worker();
            worker.base = UpstreamBase::parse(base);
            worker
        };
        let plain = at("http://10.0.0.1:30000");
        assert_eq!(
            plain
                .uri_for("/v1/chat/completions", None)
                .unwrap()
                .to_string(),
            "http://10.0.0.1:30000/v1/chat/completions"
        );
        let prefixed = at("http://h:8000/engine-a/");
        assert_eq!(
            prefixed
                .uri_for("/generate", Some("x=1"))
                .unwrap()
                .to_string(),
            "http://h:8000/engine-a/generate?x=1"
        );
        assert!(at("not a url").uri_for("/generate", None).is_none());
        assert!(at("/relative").uri_for("/generate", None).is_none());
    }

    #[test]
    fn the_api_key_becomes_a_sensitive_bearer_header() {
        let metrics = Metrics::new();
        let keyed = Worker::new(
            WorkerId::new(0, 0),
            "http://w:1".into(),
            "sglang".into(),
            None,
            Some("sk-1".into()),
            Arc::new(MockLoadSource::new()),
            WorkerMetrics::new(&metrics, "http://w:1"),
        );
        let value = keyed.authorization.expect("a key was given");
        assert_eq!(value, "Bearer sk-1");
        assert!(value.is_sensitive());
        assert!(worker().authorization.is_none(), "no key, no header");
    }

    fn worker() -> Worker {
        let metrics = Metrics::new();
        Worker::new(
            WorkerId::new(0, 0),
            "http://w:1/".into(),
            "sglang".into(),
            None,
            None,
            Arc::new(MockLoadSource::new()),
            WorkerMetrics::new(&metrics, "http://w:1"),
        )
    }

    #[test]
    fn the_first_check_decides_then_thresholds_apply() {
        let worker = worker();
        assert_eq!(worker.url, "http://w:1", "trailing slash trimmed");
        assert!(!worker.is_healthy(), "unchecked workers take no traffic");
        assert_eq!(worker.health_check_passed(3), HealthChange::CameBack);
        assert_eq!(worker.health_check_failed(2), HealthChange::None);
        assert_eq!(worker.health_check_failed(2), HealthChange::WentOut);
        assert_eq!(worker.health_check_passed(3), HealthChange::None);
        assert_eq!(worker.health_check_passed(3), HealthChange::None);
        assert_eq!(worker.health_check_passed(3), HealthChange::CameBack);
    }

    #[test]
    fn request_failures_are_not_cleared_by_passing_checks() {
        let worker = worker();
        worker.health_check_passed(2);
        assert_eq!(worker.request_failed(3), HealthChange::None);
        // /health keeps passing while generation fails.
        worker.health_check_passed(2);
        assert_eq!(worker.request_failed(3), HealthChange::None);
        assert_eq!(worker.request_failed(3), HealthChange::WentOut);
        // Two fresh passes bring it back, with the run of failures cleared.
        assert_eq!(worker.health_check_passed(2), HealthChange::None);
        assert_eq!(worker.health_check_passed(2), HealthChange::CameBack);
        assert_eq!(worker.request_failed(3), HealthChange::None);
    }

    #[test]
    fn a_successful_request_ends_a_run_of_failures() {
        let worker = worker();
        worker.health_check_passed(1);
        worker.request_failed(2);
        worker.request_succeeded();
        assert_eq!(worker.request_failed(2), HealthChange::None);
        assert!(worker.is_healthy());
    }

    #[test]
    fn the_candidate_list_follows_health_and_draining() {
        let registry = WorkerRegistry::new();
        let id = registry.allocate_id();
        let metrics = Metrics::new();
        let entry = Arc::new(Worker::new(
            id,
            "http://w:1".into(),
            "sglang".into(),
            None,
            None,
            Arc::new(MockLoadSource::new()),
            WorkerMetrics::new(&metrics, "http://w:1"),
        ));
        registry.insert(entry.clone());
        assert!(registry.candidates().is_empty());
        entry.health_check_passed(1);
        registry.refresh_candidates();
        assert_eq!(&*registry.candidates(), &[id]);
        registry.start_draining(id);
        assert!(registry.candidates().is_empty());
        assert!(registry.get(id).is_some(), "listed until forgotten");
        registry.forget(id);
        assert!(registry.get(id).is_none());
        assert_eq!(
            registry.allocate_id(),
            WorkerId::new(0, 1),
            "the slot is reused with a new generation"
        );
    }
}
