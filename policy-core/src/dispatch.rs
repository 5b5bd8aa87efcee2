use std::sync::Arc;
use std::time::Instant;

use crate::{Policy, PrefillSample, WorkerId};

/// One routing decision: which worker, how many tokens were credited to it,
/// a sequence number that tells this dispatch apart from every other one of
/// the same policy, and the winner's score (exported as a metric). Small and
/// `Copy`; the router wraps it in a [`DispatchGuard`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dispatch {
    pub worker: WorkerId,
    pub tokens: u64,
    pub seq: u64,
    /// The chosen worker's score in the policy's own units (seconds of
    /// expected wait for `least_load`; in-flight requests for
    /// `least_requests`; 0 for policies that do not score).
    pub score: f64,
    /// Prompt tokens the policy expected the worker to hold in its prefix
    /// cache already (0 for policies without a prefix model): what the
    /// engine's reported `cached_tokens` is compared with.
    pub cached_tokens: u64,
}

/// Handed out by `poll_started` and given back on completion: which worker,
/// when the poll was sent, and the pending work on the worker known at that
/// moment: this router's own and, with replica sync, the other replicas'
/// (together, the part of the engine's queue the router fleet sent itself).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PollMark {
    pub worker: WorkerId,
    /// Orders the polls of one worker, so an older completion can be ignored.
    pub seq: u64,
    pub sent_at: Instant,
    /// This router's pending work.
    pub pending_tokens: u64,
    pub pending_requests: u64,
    /// Other replicas' pending work as last published (0 without sync).
    pub remote_pending_tokens: u64,
    pub remote_pending_requests: u64,
}

impl PollMark {
    /// A poll of `worker` sent at `sent_at` with nothing pending on it: a
    /// policy that keeps no pending work marks its polls so.
    pub fn nothing_pending(worker: WorkerId, sent_at: Instant) -> PollMark {
        PollMark {
            worker,
            seq: 0,
            sent_at,
            pending_tokens: 0,
            pending_requests: 0,
            remote_pending_tokens: 0,
            remote_pending_requests: 0,
        }
    }
}

/// A clock for guards; the router passes [`tokio_now`] so that tests with
/// paused tokio time control it.
pub type Clock = fn() -> Instant;

/// The current time as tokio sees it (paused and advanced in tests).
pub fn tokio_now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// Finishes a [`Dispatch`] when dropped, so no path (error, client gone,
/// panic unwinding) can leak credited work.
pub struct DispatchGuard {
    policy: Arc<dyn Policy>,
    dispatch: Dispatch,
    clock: Clock,
    first_token_seen: bool,
}

impl DispatchGuard {
    pub fn new(policy: Arc<dyn Policy>, dispatch: Dispatch) -> DispatchGuard {
        DispatchGuard::with_clock(policy, dispatch, tokio_now)
    }

    pub fn with_clock(policy: Arc<dyn Policy>, dispatch: Dispatch, clock: Clock) -> DispatchGuard {
        DispatchGuard {
            policy,
            dispatch,
            clock,
            first_token_seen: false,
        }
    }

    pub fn dispatch(&self) -> Dispatch {
        self.dispatch
    }

    /// Tells the policy the first token passed; later calls do nothing.
    /// Returns what it measures of the worker's prefill rate, if anything (see
    /// [`Policy::first_token`]).
    pub fn first_token(&mut self) -> Option<PrefillSample> {
        if self.first_token_seen {
            return None;
        }
        self.first_token_seen = true;
        self.policy.first_token(&self.dispatch, (self.clock)())
    }

    pub fn first_token_seen(&self) -> bool {
        self.first_token_seen
    }
}

impl std::fmt::Debug for DispatchGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DispatchGuard")
            .field("policy", &self.policy.name())
            .field("dispatch", &self.dispatch)
            .field("first_token_seen", &self.first_token_seen)
            .finish()
    }
}

impl Drop for DispatchGuard {
    fn drop(&mut self) {
        self.policy.finish(&self.dispatch, (self.clock)());
    }
}
