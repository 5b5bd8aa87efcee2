//! Other router replicas' pending work, as the policy contract carries it.
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
