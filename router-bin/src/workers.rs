//! The worker registry: who the workers are, whether each is in rotation, and
//! its latest load report.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use load_protocols::WorkerLoad;
use parking_lot::{Mutex, RwLock};
use policy_core::{LoadSource, WorkerId, WorkerIdAllocator, WorkerInfo};

use crate::metrics::WorkerMetrics;

/// One upstream engine.
pub struct Worker {
    pub id: WorkerId,
    /// HTTP address requests travel to, without a trailing slash.
    pub url: String,
    pub backend: String,
    pub load_url: Option<String>,
    pub api_key: Option<String>,
    pub source: Arc<dyn LoadSource>,
    pub metrics: WorkerMetrics,
    healthy: AtomicBool,
    checked: AtomicBool,
    draining: AtomicBool,
    consecutive_failures: AtomicU32,
    consecutive_successes: AtomicU32,
    poll_failures: AtomicU32,
    in_flight: AtomicU64,
    latest_load: Mutex<Option<WorkerLoad>>,
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
        Worker {
            id,
            url: url.trim_end_matches('/').to_owned(),
            backend,
            load_url,
            api_key,
            source,
            metrics,
            healthy: AtomicBool::new(false),
            checked: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            consecutive_failures: AtomicU32::new(0),
            consecutive_successes: AtomicU32::new(0),
            poll_failures: AtomicU32::new(0),
            in_flight: AtomicU64::new(0),
            latest_load: Mutex::new(None),
        }
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

    /// A passed health check (or a successful request). The first check
    /// decides at once; after that, `success_threshold` in a row bring an
    /// unhealthy worker back.
    pub fn record_success(&self, success_threshold: u32, from_health_check: bool) -> HealthChange {
        self.consecutive_failures.store(0, Ordering::Release);
        if !from_health_check {
            return HealthChange::None;
        }
        let successes = self.consecutive_successes.fetch_add(1, Ordering::AcqRel) + 1;
        let first_check = !self.checked.swap(true, Ordering::AcqRel);
        if !self.is_healthy() && (first_check || successes >= success_threshold) {
            self.healthy.store(true, Ordering::Release);
            self.metrics.healthy.set(1);
            return HealthChange::CameBack;
        }
        HealthChange::None
    }

    /// A failed health check or request (connect error, 5xx, cut stream).
    pub fn record_failure(&self, failure_threshold: u32, from_health_check: bool) -> HealthChange {
        self.consecutive_successes.store(0, Ordering::Release);
        if from_health_check {
            self.checked.store(true, Ordering::Release);
        }
        let failures = self.consecutive_failures.fetch_add(1, Ordering::AcqRel) + 1;
        if self.is_healthy() && failures >= failure_threshold {
            self.healthy.store(false, Ordering::Release);
            self.metrics.healthy.set(0);
            return HealthChange::WentOut;
        }
        HealthChange::None
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
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.metrics.in_flight.dec();
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
