//! What router replicas share through the policy contract: their pending
//! work, where they placed prompt prefixes, what engines' reports taught
//! them of a worker's prefix cache, and how fast they saw it clear prefill.
//!
//! Replicas of one router fleet share, per worker, the prompt tokens and
//! requests each has dispatched whose first token it has not seen. A policy
//! that counts them (`least_load`, `power_of_two`) is told through
//! [`Policy::replica_pending`](crate::Policy::replica_pending), one entry at
//! a time, and forgets entries that were not refreshed in time through
//! [`Policy::expire_replica_pending`](crate::Policy::expire_replica_pending).
//! Both are synchronous and free of I/O: the router feeds them from its sync
//! channel, and a simulator can call them directly with virtual time.
//!
//! A worker is named by its URL here, never by [`WorkerId`](crate::WorkerId):
//! ids are handed out by each replica on its own, while every replica is
//! configured with the same worker URLs.

use std::time::{Duration, Instant};

use crate::PrefixBlocks;

/// One other replica's pending work on one worker, as that replica last
/// published it. State, not a delta: the entry replaces whatever the policy
/// held for this replica and worker, so a lost or repeated message corrects
/// itself with the next one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplicaPending<'a> {
    /// The publishing replica's id (unique per running replica).
    pub replica: &'a str,
    /// The worker's URL as configured (a trailing `/` is ignored).
    pub worker_url: &'a str,
    /// Prompt tokens that replica dispatched to the worker whose first token
    /// it has not seen yet.
    pub pending_tokens: u64,
    /// Requests behind those tokens.
    pub pending_requests: u64,
    /// The replica's sequence number for the state this entry is part of;
    /// it only grows for one replica, so an entry at or below the sequence
    /// already held for this replica and worker is old news.
    pub seq: u64,
}

/// What a policy did with a [`ReplicaPending`] entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaPendingOutcome {
    /// Stored: it replaced the replica's previous entry for the worker.
    Applied,
    /// Its sequence number is not newer than the entry held (out of order,
    /// or delivered twice): ignored.
    Stale,
    /// No registered worker has this URL: ignored.
    UnknownWorker,
    /// This policy does not count other replicas' work (the baselines).
    Unsupported,
}

/// One first token a replica saw from a worker: what a policy that learns
/// prefill rates measures them from. A policy returns it from
/// [`Policy::first_token`](crate::Policy::first_token) for the other
/// replicas, so that every replica learns from all the replicas' first
/// tokens on one timeline: an engine computes the prompts of several
/// replicas in the same steps, and one replica's first tokens alone
/// cannot tell what else the engine computed meanwhile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillSample {
    /// Prompt tokens the worker computed for the request (its uncached
    /// tokens, as the policy predicted them).
    pub tokens: u64,
    /// Token-work ahead of it on the worker at its dispatch that no router
    /// replica sent (the engine's queue of other traffic).
    pub foreign_ahead_tokens: u64,
    /// From its dispatch to its first token.
    pub waited: Duration,
}

/// What another replica learned of a worker, as the policy contract
/// carries it ([`Policy::replica_update`](crate::Policy::replica_update)).
/// Like [`ReplicaPending`], it names the worker by URL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaUpdate<'a> {
    /// The replica dispatched a prompt with these leading blocks to the
    /// worker: the worker is expected to hold them from now on, as if this
    /// replica had dispatched it.
    Placed {
        worker_url: &'a str,
        prefix: &'a PrefixBlocks,
    },
    /// The replica learned from the worker's reported cache hits that its
    /// prefix cache keeps about `cache_tokens` tokens before it evicts
    /// (least recently used): prefixes dispatched longer ago than that are
    /// no longer expected there.
    CacheBound {
        worker_url: &'a str,
        cache_tokens: u64,
    },
    /// The replica had a first token from the worker at `first_token_at`
    /// (on the receiver's clock).
    Prefill {
        worker_url: &'a str,
        sample: PrefillSample,
        first_token_at: Instant,
    },
}

impl ReplicaUpdate<'_> {
    /// The worker the update is about.
    pub fn worker_url(&self) -> &str {
        match self {
            ReplicaUpdate::Placed { worker_url, .. }
            | ReplicaUpdate::CacheBound { worker_url, .. }
            | ReplicaUpdate::Prefill { worker_url, .. } => worker_url,
        }
    }
}

/// What a policy did with a [`ReplicaUpdate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaUpdateOutcome {
    Applied,
    /// No registered worker has this URL: ignored.
    UnknownWorker,
    /// This policy keeps no state of this kind (no prefix index, or prefix
    /// affinity off; no learned rates): ignored.
    Unsupported,
}

/// A policy's prefix index as a starting replica takes it over from a
/// running one ([`Policy::prefix_snapshot`](crate::Policy::prefix_snapshot),
/// [`Policy::load_prefix_snapshot`](crate::Policy::load_prefix_snapshot)).
/// Self-contained: a snapshot may be cut into several, each with the whole
/// worker list and some of the blocks, and each is loaded on its own.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct PrefixSnapshot {
    /// Tokens per block of the hashes below (the index's block size).
    pub block_tokens: u32,
    pub workers: Vec<SnapshotWorker>,
    pub blocks: Vec<SnapshotBlock>,
}

/// One worker of a [`PrefixSnapshot`].
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct SnapshotWorker {
    /// As configured ([`worker_url_key`] applies).
    pub url: String,
    /// Uncached prompt tokens dispatched to the worker so far: the clock a
    /// block's age is counted on.
    pub clock_tokens: u64,
    /// The worker's learned cache bound, tokens (0: none learned).
    pub cache_tokens: u64,
}

/// One block of a [`PrefixSnapshot`]: a chained hash and the workers
/// expected to hold it.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct SnapshotBlock {
    pub hash: u64,
    /// Milliseconds since the block was last dispatched.
    pub age_ms: u32,
    /// `(index into workers, tokens dispatched to that worker since it got
    /// the block)`.
    pub holders: Vec<(u32, u64)>,
}

/// The canonical form of a worker URL for matching across replicas: without
/// trailing slashes, so `http://h:1/` and `http://h:1` are one worker.
pub fn worker_url_key(url: &str) -> &str {
    url.trim_end_matches('/')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trailing_slashes_do_not_split_a_worker() {
        assert_eq!(worker_url_key("http://h:1/"), "http://h:1");
        assert_eq!(worker_url_key("http://h:1//"), "http://h:1");
        assert_eq!(worker_url_key("http://h:1"), "http://h:1");
    }
}
