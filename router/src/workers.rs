//! One worker: its address, whether it is in rotation (health checks,
//! outlier ejection, draining), its in-flight count and latest load report.
//! The list of workers lives in the [`Topology`](crate::topology::Topology).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use http::HeaderValue;
use load_protocols::WorkerLoad;
use load_transport::http::bearer_header;
use parking_lot::Mutex;
use policy_core::{LoadSource, WorkerId, WorkerInfo};

use crate::metrics::WorkerMetrics;
use crate::outlier::OutlierState;
use worker_h1::Pool;

/// One upstream engine.
pub(crate) struct Worker {
    pub(crate) id: WorkerId,
    /// HTTP address requests travel to, without a trailing slash.
    pub(crate) url: String,
    /// Kept-alive connections for forwarded requests, and the address they
    /// go to, parsed once.
    pub(crate) pool: Arc<Pool>,
    pub(crate) backend: String,
    /// `Authorization: Bearer <api_key>`, built once and marked sensitive.
    pub(crate) authorization: Option<HeaderValue>,
    pub(crate) source: Arc<dyn LoadSource>,
    pub(crate) metrics: WorkerMetrics,
    healthy: AtomicBool,
    checked: AtomicBool,
    draining: AtomicBool,
    /// A drain's grace period is over: its streams continue elsewhere.
    drained: AtomicBool,
    check_failures: AtomicU32,
    check_successes: AtomicU32,
    /// Mirrors `outlier.is_ejected()`, so rotation is read without a lock.
    ejected: AtomicBool,
    outlier: Mutex<OutlierState>,
    poll_failures: AtomicU32,
    in_flight: AtomicU64,
    /// Open streams that have sent nothing for
    /// `outlier_detection.silent_stream_ms`; while any, the worker is held
    /// back from new requests.
    silent_streams: AtomicU32,
    /// Woken when `in_flight` drops to 0, for a drain to finish.
    idle: tokio::sync::Notify,
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
pub(crate) enum HealthChange {
    None,
    CameBack,
    WentOut,
}

impl Worker {
    /// A worker at `url`, its requests forwarded through `pool` (made for
    /// that URL, with the router's trust if it is `https://`).
    pub(crate) fn new(
        id: WorkerId,
        url: String,
        pool: Pool,
        backend: String,
        api_key: Option<String>,
        source: Arc<dyn LoadSource>,
        metrics: WorkerMetrics,
    ) -> Worker {
        let url = url.trim_end_matches('/').to_owned();
        // Config validation rejects a key that cannot be a header value.
        let authorization = api_key.as_deref().and_then(|key| bearer_header(key).ok());
        Worker {
            id,
            pool: Arc::new(pool),
            url,
            backend,
            authorization,
            source,
            metrics,
            healthy: AtomicBool::new(false),
            checked: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            drained: AtomicBool::new(false),
            check_failures: AtomicU32::new(0),
            check_successes: AtomicU32::new(0),
            ejected: AtomicBool::new(false),
            outlier: Mutex::new(OutlierState::default()),
            poll_failures: AtomicU32::new(0),
            in_flight: AtomicU64::new(0),
            silent_streams: AtomicU32::new(0),
            idle: tokio::sync::Notify::new(),
            latest_load: Mutex::new(None),
        }
    }

    pub(crate) fn info(&self) -> WorkerInfo {
        WorkerInfo::new(self.url.clone(), self.backend.clone())
    }

    pub(crate) fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Acquire)
    }

    pub(crate) fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    pub(crate) fn set_draining(&self) {
        self.draining.store(true, Ordering::Release);
    }

    /// Whether a drain's grace period is over: a stream still running on
    /// the worker moves to another at its next event.
    pub(crate) fn is_drained(&self) -> bool {
        self.drained.load(Ordering::Acquire)
    }

    pub(crate) fn set_drained(&self) {
        self.drained.store(true, Ordering::Release);
    }

    pub(crate) fn is_ejected(&self) -> bool {
        self.ejected.load(Ordering::Acquire)
    }

    /// Healthy, not ejected, not draining: a candidate for new requests.
    pub(crate) fn in_rotation(&self) -> bool {
        self.is_healthy() && !self.is_ejected() && !self.is_draining()
    }

    /// A stream on this worker is silent: new requests go elsewhere while
    /// another worker can take them.
    pub(crate) fn is_held_back(&self) -> bool {
        self.silent_streams() > 0
    }

    pub(crate) fn silent_streams(&self) -> u32 {
        self.silent_streams.load(Ordering::Acquire)
    }

    /// One more silent stream; true when it is the first (a flip).
    pub(crate) fn stream_went_silent(&self) -> bool {
        self.metrics.silent_streams.inc();
        self.silent_streams.fetch_add(1, Ordering::AcqRel) == 0
    }

    /// One silent stream fewer; true when it was the last (a flip).
    pub(crate) fn silent_stream_ended(&self) -> bool {
        self.metrics.silent_streams.dec();
        self.silent_streams.fetch_sub(1, Ordering::AcqRel) == 1
    }

    /// Runs `change` on the outlier state and mirrors its ejection flag.
    /// The topology's writer calls this for flips that change rotation.
    pub(crate) fn with_outlier<T>(&self, change: impl FnOnce(&mut OutlierState) -> T) -> T {
        let mut outlier = self.outlier.lock();
        let result = change(&mut outlier);
        let ejected = outlier.is_ejected();
        self.ejected.store(ejected, Ordering::Release);
        self.metrics.ejected.set(i64::from(ejected));
        result
    }

    /// A passed `/health` check. The first check decides at once; after
    /// that, `success_threshold` passes in a row bring an out-of-rotation
    /// worker back.
    pub(crate) fn health_check_passed(&self, success_threshold: u32) -> HealthChange {
        self.check_failures.store(0, Ordering::Release);
        let successes = self.check_successes.fetch_add(1, Ordering::AcqRel) + 1;
        let first_check = !self.checked.swap(true, Ordering::AcqRel);
        if !self.is_healthy() && (first_check || successes >= success_threshold) {
            return self.set_healthy(true);
        }
        HealthChange::None
    }

    /// A failed `/health` check; `failure_threshold` in a row take it out.
    pub(crate) fn health_check_failed(&self, failure_threshold: u32) -> HealthChange {
        self.checked.store(true, Ordering::Release);
        self.check_successes.store(0, Ordering::Release);
        let failures = self.check_failures.fetch_add(1, Ordering::AcqRel) + 1;
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

    pub(crate) fn poll_succeeded(&self, load: Option<WorkerLoad>) -> bool {
        if let Some(load) = load {
            *self.latest_load.lock() = Some(load);
        }
        self.poll_failures.swap(0, Ordering::AcqRel) > 0
    }

    /// Returns the consecutive failure count, so the caller logs only on the
    /// first one (a state change).
    pub(crate) fn poll_failed(&self) -> u32 {
        self.metrics.poll_failures.inc();
        self.poll_failures.fetch_add(1, Ordering::AcqRel) + 1
    }

    pub(crate) fn consecutive_poll_failures(&self) -> u32 {
        self.poll_failures.load(Ordering::Acquire)
    }

    pub(crate) fn latest_load(&self) -> Option<WorkerLoad> {
        self.latest_load.lock().clone()
    }

    pub(crate) fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Acquire)
    }

    pub(crate) fn request_started(&self) {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        self.metrics.in_flight.inc();
    }

    pub(crate) fn request_ended(&self) {
        if self.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.idle.notify_waiters();
        }
        self.metrics.in_flight.dec();
    }

    /// Returns once no request is in flight.
    pub(crate) async fn until_idle(&self) {
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
    fn the_api_key_becomes_a_sensitive_bearer_header() {
        let metrics = Metrics::new();
        let keyed = Worker::new(
            WorkerId::new(0, 0),
            "http://w:1".into(),
            Pool::new("http://w:1"),
            "sglang".into(),
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
            Pool::new("http://w:1/"),
            "sglang".into(),
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
}
