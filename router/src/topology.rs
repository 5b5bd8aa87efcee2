//! The router's topology: the policy, the workers and the candidates a
//! request may be sent to, published as one immutable [`Snapshot`].
//!
//! One writer: every change (a worker added, drained or forgotten, a health
//! or ejection flip, a policy swap) runs under the writer lock, rebuilds the
//! snapshot from the current state and publishes it with one atomic swap. A
//! flip is made before the rebuild that follows it, under the same lock, so
//! the last rebuild always sees every flip: no update is lost. A request
//! does one lock-free load.
//!
//! The request path writes nothing shared by every request: the load is
//! arc-swap's (a per-thread slot, not the snapshot's reference count), the
//! candidate list is the snapshot's own slice (built once per change, never
//! copied per request), and what a request keeps after choosing is its
//! worker's [`Route`], whose reference count only that worker's requests
//! share.

use std::sync::Arc;

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use policy_core::{Policy, WorkerId, WorkerIdAllocator, prime_worker, tokio_now};

use crate::config::PolicyConfig;
use crate::workers::Worker;

/// What a request reads: all of it consistent with itself.
pub(crate) struct Snapshot {
    pub(crate) policy: Arc<dyn Policy>,
    pub(crate) policy_config: PolicyConfig,
    /// By slot; `None` where no worker is.
    workers: Vec<Option<Arc<Worker>>>,
    /// By slot, beside `workers`: each worker with this snapshot's policy.
    routes: Vec<Option<Arc<Route>>>,
    /// Healthy, not ejected, not draining: who `select` may choose.
    candidates: Vec<WorkerId>,
}

/// A worker and the policy that chooses it, as one request holds them from
/// its selection to its end: the dispatch is finished against the policy
/// that credited it, even if another was swapped in meanwhile. One per
/// worker and policy, shared by that worker's requests only.
pub(crate) struct Route {
    pub(crate) worker: Arc<Worker>,
    pub(crate) policy: Arc<dyn Policy>,
}

impl std::fmt::Debug for Route {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Route")
            .field("worker", &self.worker.url)
            .field("policy", &self.policy.name())
            .finish()
    }
}

impl std::fmt::Debug for Snapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Snapshot")
            .field("policy", &self.policy.name())
            .field("workers", &self.workers.iter().flatten().count())
            .field("candidates", &self.candidates)
            .finish()
    }
}

impl Snapshot {
    pub(crate) fn worker(&self, id: WorkerId) -> Option<&Arc<Worker>> {
        self.workers
            .get(id.slot())
            .and_then(Option::as_ref)
            .filter(|worker| worker.id == id)
    }

    /// The worker with its route (this snapshot's policy), for a request.
    pub(crate) fn route(&self, id: WorkerId) -> Option<&Arc<Route>> {
        self.routes
            .get(id.slot())
            .and_then(Option::as_ref)
            .filter(|route| route.worker.id == id)
    }

    /// Every worker, in slot order.
    pub(crate) fn workers(&self) -> impl Iterator<Item = &Arc<Worker>> {
        self.workers.iter().flatten()
    }

    pub(crate) fn candidates(&self) -> &[WorkerId] {
        &self.candidates
    }

    /// Workers that are neither ejected nor draining, healthy or not: the
    /// fleet the ejection cap is a share of.
    fn ejectable_fleet(&self) -> usize {
        self.workers()
            .filter(|worker| !worker.is_draining())
            .count()
    }
}

/// The single owner of the topology. See the module documentation.
pub(crate) struct Topology {
    writer: Mutex<WorkerIdAllocator>,
    current: ArcSwap<Snapshot>,
}

impl std::fmt::Debug for Topology {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Topology")
            .field("current", &*self.current.load())
            .finish()
    }
}

impl Topology {
    pub(crate) fn new(policy: Arc<dyn Policy>, policy_config: PolicyConfig) -> Topology {
        Topology {
            writer: Mutex::new(WorkerIdAllocator::default()),
            current: ArcSwap::from_pointee(Snapshot {
                policy,
                policy_config,
                workers: Vec::new(),
                routes: Vec::new(),
                candidates: Vec::new(),
            }),
        }
    }

    /// The current snapshot: one lock-free load.
    pub(crate) fn load(&self) -> arc_swap::Guard<Arc<Snapshot>> {
        self.current.load()
    }

    /// The current snapshot, owned (to hold across an await). Raises the
    /// snapshot's shared reference count: not for the request path, which
    /// uses [`Topology::load`].
    pub(crate) fn snapshot(&self) -> Arc<Snapshot> {
        self.current.load_full()
    }

    /// Adds a worker built by `make` from a fresh id, and tells the policy.
    pub(crate) fn add(&self, make: impl FnOnce(WorkerId) -> Arc<Worker>) -> Arc<Worker> {
        let mut ids = self.writer.lock();
        let worker = make(ids.allocate());
        let slot = worker.id.slot();
        self.publish(|snapshot| {
            snapshot.policy.add_worker(worker.id, worker.info());
            if snapshot.workers.len() <= slot {
                snapshot.workers.resize_with(slot + 1, || None);
            }
            snapshot.workers[slot] = Some(worker.clone());
        });
        worker
    }

    /// Takes the worker out of rotation; it stays listed until
    /// [`Topology::forget`].
    pub(crate) fn start_draining(&self, id: WorkerId) -> Option<Arc<Worker>> {
        let _writer = self.writer.lock();
        let worker = self.current.load().worker(id).cloned()?;
        worker.set_draining();
        self.publish(|_| {});
        Some(worker)
    }

    /// Removes a worker from the policy and the list, and frees its id.
    pub(crate) fn forget(&self, id: WorkerId) {
        let mut ids = self.writer.lock();
        self.publish(|snapshot| {
            if let Some(entry) = snapshot.workers.get_mut(id.slot())
                && entry.as_ref().is_some_and(|worker| worker.id == id)
            {
                *entry = None;
                snapshot.policy.remove_worker(id);
            }
        });
        ids.release(id);
    }

    /// Swaps in `policy`, primed with every worker, its latest load, and
    /// the prefix index of the policy it replaces.
    pub(crate) fn swap_policy(&self, policy: Arc<dyn Policy>, policy_config: PolicyConfig) {
        let _writer = self.writer.lock();
        let now = tokio_now();
        self.publish(|snapshot| {
            for worker in snapshot.workers.iter().flatten() {
                if worker.is_draining() {
                    continue;
                }
                policy.add_worker(worker.id, worker.info());
                if let Some(load) = worker.latest_load() {
                    prime_worker(policy.as_ref(), worker.id, &load, now);
                }
            }
            // What the old policy knew of where prefixes are cached still
            // holds; the new one starts from it rather than from nothing.
            if let Some(prefixes) = snapshot.policy.prefix_snapshot(now) {
                policy.load_prefix_snapshot(&prefixes, now);
            }
            snapshot.policy = policy;
            snapshot.policy_config = policy_config;
        });
    }

    /// Re-reads every worker's rotation state after a flip.
    pub(crate) fn refresh(&self) {
        let _writer = self.writer.lock();
        self.publish(|_| {});
    }

    /// Ejects `worker` if the fleet-wide cap allows: at most
    /// `max_ejected_percent` of the (non-draining) fleet out at once, and
    /// always at least one. `eject` runs under the writer lock and does the
    /// flip; returns whether it ran.
    pub(crate) fn eject_within_cap(
        &self,
        worker: &Worker,
        max_ejected_percent: u32,
        eject: impl FnOnce(),
    ) -> bool {
        let _writer = self.writer.lock();
        let snapshot = self.current.load();
        let fleet = snapshot.ejectable_fleet();
        let ejected = snapshot
            .workers()
            .filter(|other| !other.is_draining() && other.is_ejected())
            .count();
        let cap = (fleet * max_ejected_percent as usize / 100).max(1);
        if worker.is_ejected() || ejected + 1 > cap {
            return false;
        }
        eject();
        self.publish(|_| {});
        true
    }

    /// Copies the current snapshot, applies `change`, recomputes the
    /// candidates from the workers' flags, and swaps it in. Callers hold
    /// the writer lock.
    fn publish(&self, change: impl FnOnce(&mut Snapshot)) {
        let current = self.current.load();
        let mut next = Snapshot {
            policy: current.policy.clone(),
            policy_config: current.policy_config.clone(),
            workers: current.workers.clone(),
            routes: Vec::new(),
            candidates: Vec::new(),
        };
        change(&mut next);
        // A route is kept while its worker and policy are; otherwise made anew.
        next.routes = next
            .workers
            .iter()
            .enumerate()
            .map(|(slot, worker)| {
                let worker = worker.as_ref()?;
                let kept = current
                    .routes
                    .get(slot)
                    .and_then(Option::as_ref)
                    .filter(|route| {
                        Arc::ptr_eq(&route.worker, worker)
                            && Arc::ptr_eq(&route.policy, &next.policy)
                    });
                Some(kept.cloned().unwrap_or_else(|| {
                    Arc::new(Route {
                        worker: worker.clone(),
                        policy: next.policy.clone(),
                    })
                }))
            })
            .collect();
        next.candidates = next
            .workers()
            .filter(|worker| worker.in_rotation() && !worker.is_held_back())
            .map(|worker| worker.id)
            .collect();
        // Held back is a preference, not an ejection: with no other worker
        // in rotation, the held-back ones still serve.
        if next.candidates.is_empty() {
            next.candidates = next
                .workers()
                .filter(|worker| worker.in_rotation())
                .map(|worker| worker.id)
                .collect();
        }
        self.current.store(Arc::new(next));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::{Metrics, WorkerMetrics};
    use crate::outlier::OutlierState;
    use policy_core::{MockLoadSource, PolicyContext, PolicyRegistry};

    fn topology() -> Topology {
        let policy = PolicyRegistry::with_baselines()
            .build(
                "round_robin",
                &serde_json::Value::Null,
                &PolicyContext::default(),
            )
            .unwrap();
        Topology::new(Arc::from(policy), PolicyConfig::default())
    }

    fn add(topology: &Topology, metrics: &Metrics, n: usize) -> Vec<Arc<Worker>> {
        (0..n)
            .map(|index| {
                let url = format!("http://w:{index}");
                topology.add(|id| {
                    Arc::new(Worker::new(
                        id,
                        url.clone(),
                        worker_h1::Pool::new(&url),
                        "sglang".into(),
                        None,
                        Arc::new(MockLoadSource::new()),
                        WorkerMetrics::new(metrics, &url),
                    ))
                })
            })
            .collect()
    }

    #[test]
    fn the_candidates_follow_health_ejection_and_draining() {
        let metrics = Metrics::new();
        let topology = topology();
        let workers = add(&topology, &metrics, 2);
        assert!(
            topology.load().candidates().is_empty(),
            "unchecked workers take no traffic"
        );
        for worker in &workers {
            worker.health_check_passed(1);
        }
        topology.refresh();
        assert_eq!(
            topology.load().candidates(),
            &[workers[0].id, workers[1].id]
        );
        let config = crate::config::OutlierConfig::default();
        let ejected = topology.eject_within_cap(&workers[0], 100, || {
            workers[0].with_outlier(|state| state.eject(&config, tokio::time::Instant::now()));
        });
        assert!(ejected);
        assert_eq!(topology.load().candidates(), &[workers[1].id]);
        topology.start_draining(workers[1].id);
        assert!(topology.load().candidates().is_empty());
        assert!(
            topology.load().worker(workers[1].id).is_some(),
            "listed until forgotten"
        );
        topology.forget(workers[1].id);
        assert!(topology.load().worker(workers[1].id).is_none());
        let reused = add(&topology, &metrics, 1);
        assert_eq!(
            reused[0].id,
            WorkerId::new(1, 1),
            "the slot is reused with a new generation"
        );
    }

    #[test]
    fn a_held_back_worker_serves_only_when_no_other_can() {
        let metrics = Metrics::new();
        let topology = topology();
        let workers = add(&topology, &metrics, 2);
        for worker in &workers {
            worker.health_check_passed(1);
        }
        assert!(workers[0].stream_went_silent(), "the first is a flip");
        assert!(!workers[0].stream_went_silent(), "the second is not");
        topology.refresh();
        assert_eq!(topology.load().candidates(), &[workers[1].id]);
        assert!(workers[1].stream_went_silent());
        topology.refresh();
        assert_eq!(
            topology.load().candidates(),
            &[workers[0].id, workers[1].id],
            "all held back: all serve"
        );
        assert!(workers[1].silent_stream_ended());
        assert!(!workers[0].silent_stream_ended(), "one silent stream left");
        topology.refresh();
        assert_eq!(topology.load().candidates(), &[workers[1].id]);
        assert!(workers[0].silent_stream_ended());
        topology.refresh();
        assert_eq!(
            topology.load().candidates(),
            &[workers[0].id, workers[1].id]
        );
    }

    #[test]
    fn the_ejection_cap_keeps_part_of_the_fleet() {
        let metrics = Metrics::new();
        let topology = topology();
        let workers = add(&topology, &metrics, 4);
        let config = crate::config::OutlierConfig::default();
        let eject = |worker: &Worker| {
            topology.eject_within_cap(worker, 50, || {
                worker.with_outlier(|state| state.eject(&config, tokio::time::Instant::now()));
            })
        };
        assert!(eject(&workers[0]));
        assert!(!eject(&workers[0]), "already ejected");
        assert!(eject(&workers[1]));
        assert!(!eject(&workers[2]), "half the fleet is out");
        assert!(!workers[2].is_ejected());
        // At least one worker can always be ejected, even at 0 %.
        let small = self::topology();
        let pair = add(&small, &metrics, 2);
        assert!(small.eject_within_cap(&pair[0], 0, || {
            pair[0].with_outlier(|state| state.eject(&config, tokio::time::Instant::now()));
        }));
    }

    /// Many tasks flip health and ejection at once; whatever order their
    /// writes land in, the final snapshot matches the workers' final state.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_flips_lose_no_update() {
        let metrics = Metrics::new();
        let topology = Arc::new(topology());
        let workers = add(&topology, &metrics, 16);
        let config = crate::config::OutlierConfig::default();
        let mut tasks = tokio::task::JoinSet::new();
        for task in 0..8u64 {
            let topology = topology.clone();
            let workers = workers.clone();
            let config = config.clone();
            tasks.spawn(async move {
                let mut state = task.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
                for _ in 0..2_000 {
                    // xorshift: a different flip sequence per task.
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    let worker = &workers[(state % 16) as usize];
                    match (state >> 8) % 4 {
                        0 => {
                            worker.health_check_passed(1);
                            topology.refresh();
                        }
                        1 => {
                            worker.health_check_failed(1);
                            topology.refresh();
                        }
                        2 => {
                            topology.eject_within_cap(worker, 100, || {
                                worker.with_outlier(|outlier| {
                                    outlier.eject(&config, tokio::time::Instant::now())
                                });
                            });
                        }
                        _ => {
                            worker.with_outlier(|outlier| *outlier = OutlierState::default());
                            topology.refresh();
                        }
                    }
                    tokio::task::yield_now().await;
                }
            });
        }
        while let Some(joined) = tasks.join_next().await {
            joined.unwrap();
        }
        let expected: Vec<WorkerId> = workers
            .iter()
            .filter(|worker| worker.in_rotation())
            .map(|worker| worker.id)
            .collect();
        assert_eq!(topology.load().candidates(), expected.as_slice());
    }
}
