use std::time::{Duration, Instant};

use load_protocols::WorkerLoad;

use crate::{
    Dispatch, PollMark, PrefillSample, PrefixBlocks, PrefixSnapshot, ReplicaPending,
    ReplicaPendingOutcome, ReplicaUpdate, ReplicaUpdateOutcome, RequestInfo, ScoreTable, WorkerId,
    WorkerInfo,
};

/// What the router hands every policy at construction.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PolicyContext {
    /// How often the load monitor polls each worker.
    pub poll_interval: Duration,
    /// A snapshot older than this is not used.
    pub stale_after: Duration,
    /// Seeds the policy's tie-breaking, so a simulation is repeatable.
    pub rng_seed: u64,
}

impl Default for PolicyContext {
    fn default() -> PolicyContext {
        PolicyContext {
            poll_interval: Duration::from_secs(1),
            stale_after: Duration::from_secs(3),
            rng_seed: 0x5eed,
        }
    }
}

/// This policy's live view of one worker, for the admin API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WorkerStats {
    /// Requests dispatched and not yet finished.
    pub in_flight_requests: u64,
    /// Requests dispatched whose first token has not been seen.
    pub pending_requests: u64,
    /// Prompt tokens of those pending requests.
    pub pending_tokens: u64,
}

/// How long a request would wait before its first token on the least busy
/// candidate, as a policy with a model of wait predicts it.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ExpectedWait {
    /// Work already queued or pending on that worker, in seconds: how
    /// long before the request's prefill could start.
    pub queue_secs: f64,
    /// The request's own prefill, in seconds at a typical worker's rate.
    pub prefill_secs: f64,
    /// `queue_secs` less what the worker has likely computed of the
    /// prompts under way (since its engine took up the oldest one sent
    /// there, at its rate): the wait if they finish on schedule. `None`
    /// when the policy does not tell.
    pub queue_less_progress_secs: Option<f64>,
    /// How much of `prefill_secs` that worker's prefix cache is expected to
    /// save: what the request would compute again elsewhere. 0 when
    /// nothing is cached there, or the policy does not tell.
    pub cached_prefill_secs: f64,
}

/// How a worker is chosen for each request.
///
/// Synchronous and free of I/O: this is the request hot path. The policy has no
/// clock of its own; the caller passes `now`, so the router (wall clock) and
/// the simulator (virtual clock) drive the same code. Every method takes
/// `&self`: one instance serves all the router's tasks at once.
///
/// ```
/// use std::time::Instant;
/// use policy_core::{PolicyContext, PolicyRegistry, RequestInfo, TokenCount, WorkerId, WorkerInfo};
///
/// let registry = PolicyRegistry::with_baselines();
/// let policy = registry.build("least_requests", &serde_json::Value::Null, &PolicyContext::default())?;
/// let (a, b) = (WorkerId::new(0, 0), WorkerId::new(1, 0));
/// policy.add_worker(a, WorkerInfo::new("http://127.0.0.1:30000", "sglang"));
/// policy.add_worker(b, WorkerInfo::new("http://127.0.0.1:30001", "sglang"));
///
/// let now = Instant::now();
/// let request = RequestInfo::new(TokenCount::Estimated(200));
/// let first = policy.select(&[a, b], &request, now).expect("two idle workers");
/// let second = policy.select(&[a, b], &request, now).expect("one idle worker left");
/// assert_ne!(first.worker, second.worker, "the busy worker is avoided");
/// policy.finish(&first, now);
/// policy.finish(&second, now);
/// # Ok::<(), policy_core::PolicyError>(())
/// ```
#[cfg_attr(any(test, feature = "mocks"), mockall::automock)]
pub trait Policy: Send + Sync {
    /// The registry name (`least_load`, `round_robin`, …).
    fn name(&self) -> &'static str;

    /// The policy's parameters, as its config section would hold them.
    fn params(&self) -> serde_json::Value;

    fn add_worker(&self, id: WorkerId, info: WorkerInfo);

    /// Later calls naming this id (dispatches, poll marks) are ignored.
    fn remove_worker(&self, id: WorkerId);

    /// Chooses among `candidates` (the healthy workers) and credits the choice.
    /// `None` when no candidate can take the request: none given, none
    /// registered, or all capped.
    fn select(
        &self,
        candidates: &[WorkerId],
        request: &RequestInfo,
        now: Instant,
    ) -> Option<Dispatch>;

    /// The first SSE data chunk, or the start of a non-streaming response,
    /// passed through. Idempotent. A policy that learns workers' prefill
    /// rates returns what this first token measures, for the other
    /// replicas ([`ReplicaUpdate::Prefill`]); the others return `None`.
    fn first_token(&self, dispatch: &Dispatch, now: Instant) -> Option<PrefillSample>;

    /// The request ended (done, failed or cancelled): releases whatever is
    /// still held. Idempotent.
    fn finish(&self, dispatch: &Dispatch, now: Instant);

    /// Called just before the worker's load poll is sent.
    fn poll_started(&self, id: WorkerId, now: Instant) -> PollMark;

    /// The poll answered: `Some` fresh report, or `None` "no report this time".
    // The named lifetime is for mockall, which cannot mock an elided one.
    #[allow(clippy::needless_lifetimes)]
    fn poll_completed<'a>(&self, mark: PollMark, load: Option<&'a WorkerLoad>, now: Instant);

    /// The poll failed (error, timeout, invalid report).
    fn poll_failed(&self, mark: PollMark, now: Instant);

    /// How long `request` would wait on the least busy of `candidates`,
    /// without changing any state. `None`: the policy has no model of wait
    /// (the router then queues requests only when `select` finds every
    /// candidate capped).
    fn expected_wait(
        &self,
        candidates: &[WorkerId],
        request: &RequestInfo,
        now: Instant,
    ) -> Option<ExpectedWait> {
        let _ = (candidates, request, now);
        None
    }

    /// [`expected_wait`](Policy::expected_wait), for a caller that asks
    /// only whether some candidate's wait is at most `within_secs` (the
    /// admission room, for every request): the policy may stop at the
    /// first such candidate and return its wait, not the least. When no
    /// candidate's is that short, it is the least, as `expected_wait`.
    /// By default, `expected_wait`.
    fn expected_wait_within(
        &self,
        candidates: &[WorkerId],
        request: &RequestInfo,
        now: Instant,
        within_secs: f64,
    ) -> Option<ExpectedWait> {
        let _ = within_secs;
        self.expected_wait(candidates, request, now)
    }

    /// The worker [`select`](Policy::select) would choose for `request`
    /// now, and the wait expected there (as [`expected_wait`] over that
    /// worker alone), without crediting anything. The admission room uses
    /// it to hold a request whose chosen worker is busy while later ones
    /// go to workers with room. `None`: the policy cannot tell, and the
    /// room releases in its order wherever `select` sends.
    ///
    /// [`expected_wait`]: Policy::expected_wait
    fn preview(
        &self,
        candidates: &[WorkerId],
        request: &RequestInfo,
        now: Instant,
    ) -> Option<(WorkerId, ExpectedWait)> {
        let _ = (candidates, request, now);
        None
    }

    /// Whether [`Dispatch::score`] is the chosen worker's predicted wait for
    /// the request's first token, in seconds. The router then hedges a
    /// stream only once it is overdue by a multiple of that prediction.
    fn score_is_wait_secs(&self) -> bool {
        false
    }

    /// Scores a hypothetical request without changing any state.
    fn explain(&self, candidates: &[WorkerId], request: &RequestInfo, now: Instant) -> ScoreTable;

    /// Live counts of one worker, `None` if it is not registered. These are
    /// this replica's own: what it publishes to the others.
    fn worker_stats(&self, id: WorkerId) -> Option<WorkerStats>;

    /// Another router replica's pending work on a worker (named by URL), as
    /// that replica last published it: replaces the entry held for that
    /// replica and worker unless its sequence number is not newer. Policies
    /// that do not count other replicas' work keep this default, which
    /// ignores it. See [`ReplicaPending`].
    // The named lifetime is for mockall, which cannot mock an elided one.
    #[allow(clippy::needless_lifetimes)]
    fn replica_pending<'a>(
        &self,
        entry: &ReplicaPending<'a>,
        now: Instant,
    ) -> ReplicaPendingOutcome {
        let _ = (entry, now);
        ReplicaPendingOutcome::Unsupported
    }

    /// Drops every other replica's entry last refreshed more than `ttl`
    /// before `now` (its replica stopped publishing, or stopped naming the
    /// worker); returns how many were dropped. The caller runs it often (the
    /// router, at every publish tick): a policy has no clock of its own.
    fn expire_replica_pending(&self, now: Instant, ttl: Duration) -> usize {
        let _ = (now, ttl);
        0
    }

    /// What other replicas should learn of `dispatch` (made for `request`):
    /// the prompt's leading blocks at the granularity this policy indexes
    /// them, to be handed to their [`replica_update`](Policy::replica_update)
    /// as [`ReplicaUpdate::Placed`]. `None` when the policy keeps no prefix
    /// index or the request has no known prefix.
    fn placement(&self, request: &RequestInfo) -> Option<PrefixBlocks> {
        let _ = request;
        None
    }

    /// Applies what another replica learned of a worker. See
    /// [`ReplicaUpdate`]. Policies that keep nothing of the kind keep this
    /// default.
    #[allow(clippy::needless_lifetimes)]
    fn replica_update<'a>(&self, update: &ReplicaUpdate<'a>, now: Instant) -> ReplicaUpdateOutcome {
        let _ = (update, now);
        ReplicaUpdateOutcome::Unsupported
    }

    /// The engine reported that its prefix cache served
    /// `reported_cached_tokens` of `dispatch`'s prompt (the response's
    /// `usage.prompt_tokens_details.cached_tokens`); `dispatch.cached_tokens`
    /// is what the policy expected. Returns the worker's new cache bound in
    /// tokens when the report changed it, for the other replicas
    /// ([`ReplicaUpdate::CacheBound`]); `None` otherwise.
    fn cache_report(
        &self,
        dispatch: &Dispatch,
        reported_cached_tokens: u64,
        now: Instant,
    ) -> Option<u64> {
        let _ = (dispatch, reported_cached_tokens, now);
        None
    }

    /// The prefix index, for a replica that starts now to warm its own
    /// from (`None`: the policy keeps none).
    fn prefix_snapshot(&self, now: Instant) -> Option<PrefixSnapshot> {
        let _ = now;
        None
    }

    /// Loads a snapshot of another replica's prefix index (workers matched
    /// by URL; unknown ones skipped); returns the blocks stored.
    fn load_prefix_snapshot(&self, snapshot: &PrefixSnapshot, now: Instant) -> usize {
        let _ = (snapshot, now);
        0
    }
}
