//! Prefix placements and learned cache bounds: what the request path
//! queues, how the publisher coalesces it into messages, and how another
//! replica's messages reach the policy.
//!
//! Placements are events: each tells the other replicas that a worker was
//! sent a prompt with these leading blocks, so their prefix indexes expect
//! it there as if they had sent it. A lost, late or repeated one costs
//! affinity (a replica sends a prompt where its prefix is not, or expects it
//! where it no longer is, until the index's age bounds catch up), never
//! correctness: routing reads the index only as a preference.
//!
//! The few items marked `pub` here (the rest are `pub(super)` or narrower)
//! are what the benchmarks reach through `crate::bench_internals`.

use std::collections::HashSet;
use std::time::Instant;

use policy_core::{Policy, PrefixBlocks, ReplicaUpdate, ReplicaUpdateOutcome, WorkerId};
use prometheus_client::metrics::counter::Counter;

use super::wire;
use crate::metrics::Metrics;

/// Most placements queued between two publisher wakes; past it they are
/// dropped and counted (`router_sync_placements_dropped_total{reason="queue_full"}`).
/// The publisher drains the queue at every wake, so only a publisher that
/// falls far behind the request path fills it.
pub(super) const MAX_QUEUED_PLACEMENTS: usize = 4096;
/// Most learned bounds queued between two wakes (one per worker is all a
/// wake sends).
pub(super) const MAX_QUEUED_BOUNDS: usize = 1024;

/// What the request path handed the publisher since its last wake.
#[derive(Debug, Default)]
pub(super) struct Queued {
    /// Workers dispatched to (for the pending-work message).
    pub(super) dispatched: Vec<WorkerId>,
    /// Prefix placements, as the policy coarsened them.
    pub(super) placed: Vec<(WorkerId, PrefixBlocks)>,
    /// Cache bounds learned from engines' reports.
    pub(super) bounds: Vec<(WorkerId, u64)>,
    /// Placements refused because the queue was full.
    pub(super) dropped_placements: u64,
}

impl Queued {
    pub(super) fn clear(&mut self) {
        self.dispatched.clear();
        self.placed.clear();
        self.bounds.clear();
        self.dropped_placements = 0;
    }

    pub(super) fn place(&mut self, worker: WorkerId, prefix: PrefixBlocks) {
        if self.placed.len() < MAX_QUEUED_PLACEMENTS {
            self.placed.push((worker, prefix));
        } else {
            self.dropped_placements += 1;
        }
    }

    /// A bound is state: a newer one for the same worker replaces it.
    pub(super) fn bound(&mut self, worker: WorkerId, cache_tokens: u64) {
        if let Some(queued) = self.bounds.iter_mut().find(|(id, _)| *id == worker) {
            queued.1 = cache_tokens;
        } else if self.bounds.len() < MAX_QUEUED_BOUNDS {
            self.bounds.push((worker, cache_tokens));
        }
    }
}

/// Drops every placement whose blocks lead another's to the same worker in
/// `placed` (the longer one places them too), duplicates included, and
/// every bound but the last per worker. Returns the placements dropped.
///
/// Hashes are chained, so a block's hash names its whole prefix: a
/// placement leads a kept one when its last hash is one of that one's.
pub fn coalesce(
    placed: &mut Vec<(WorkerId, PrefixBlocks)>,
    bounds: &mut Vec<(WorkerId, u64)>,
) -> usize {
    let before = placed.len();
    if before > 1 {
        // Longest first, so each is checked against every longer one.
        placed.sort_by(|(a, pa), (b, pb)| {
            (a.slot(), a.generation(), pa.block_tokens())
                .cmp(&(b.slot(), b.generation(), pb.block_tokens()))
                .then_with(|| pb.hashes().len().cmp(&pa.hashes().len()))
        });
        let mut held: HashSet<(WorkerId, u32, u64)> = HashSet::new();
        placed.retain(|(worker, prefix)| {
            let Some(last) = prefix.hashes().last() else {
                return false;
            };
            if held.contains(&(*worker, prefix.block_tokens(), *last)) {
                return false;
            }
            held.extend(
                prefix
                    .hashes()
                    .iter()
                    .map(|hash| (*worker, prefix.block_tokens(), *hash)),
            );
            true
        });
    }
    if bounds.len() > 1 {
        // The last learned per worker: a stable sort keeps their order.
        bounds.sort_by_key(|(worker, _)| (worker.slot(), worker.generation()));
        let mut kept: Vec<(WorkerId, u64)> = Vec::with_capacity(bounds.len());
        for (worker, tokens) in bounds.drain(..) {
            match kept.last_mut() {
                Some(last) if last.0 == worker => last.1 = tokens,
                _ => kept.push((worker, tokens)),
            }
        }
        *bounds = kept;
    }
    before - placed.len()
}

/// The counters of received prefix messages and their entries, resolved
/// once so the receive path hashes no label strings.
#[derive(Debug, Clone)]
pub struct PrefixCounters {
    pub(super) applied: Counter,
    pub(super) own: Counter,
    pub(super) malformed: Counter,
    pub(super) foreign_version: Counter,
    pub(super) invalid_replica: Counter,
    pub(super) oversize: Counter,
    /// Placements by outcome: applied, unknown_worker, unsupported, invalid.
    pub(super) placements: [Counter; 4],
    /// Bounds by the same outcomes.
    pub(super) bounds: [Counter; 4],
}

impl PrefixCounters {
    pub fn new(metrics: &Metrics) -> PrefixCounters {
        let message =
            |outcome: &str| Metrics::outcome(&metrics.sync_prefix_messages_received, outcome);
        let entries = |family| ENTRY_OUTCOMES.map(|outcome| Metrics::outcome(family, outcome));
        PrefixCounters {
            applied: message("applied"),
            own: message("own"),
            malformed: message("malformed"),
            foreign_version: message("foreign_version"),
            invalid_replica: message("invalid_replica"),
            oversize: message("oversize"),
            placements: entries(&metrics.sync_placements_received),
            bounds: entries(&metrics.sync_bounds_received),
        }
    }
}

/// The outcomes of one placement or bound, in [`PrefixCounters`]' order.
pub(super) const ENTRY_OUTCOMES: [&str; 4] =
    ["applied", "unknown_worker", "unsupported", "invalid"];

pub(super) fn entry_outcome(outcome: ReplicaUpdateOutcome) -> usize {
    match outcome {
        ReplicaUpdateOutcome::Applied => 0,
        ReplicaUpdateOutcome::UnknownWorker => 1,
        ReplicaUpdateOutcome::Unsupported => 2,
    }
}

pub(super) const INVALID: usize = 3;

/// What one received prefix message came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReceivedPrefix {
    /// Not a message of ours: ignored and counted by reason.
    Rejected(&'static str),
    /// Sent under this replica's own id: ignored.
    Own,
    /// Another replica's entries, handed to the policy; `bounds` lists the
    /// bounds applied (worker URL, tokens).
    Applied {
        replica: String,
        placements: usize,
        ignored: usize,
        bounds: Vec<(String, u64)>,
    },
}

/// Hands one payload from the prefix subject to `policy`: checks it,
/// ignores this replica's own, and applies each valid placement and bound.
/// Everything is counted.
pub fn receive_prefix(
    policy: &dyn Policy,
    own_replica: &str,
    payload: &[u8],
    now: Instant,
    counters: &PrefixCounters,
) -> ReceivedPrefix {
    let message = match wire::decode_prefix(payload) {
        Ok(message) => message,
        Err(error) => {
            let counter = match error {
                wire::WireError::Malformed(_) | wire::WireError::Invalid(_) => &counters.malformed,
                wire::WireError::Version(_) => &counters.foreign_version,
                wire::WireError::Replica(_) => &counters.invalid_replica,
                wire::WireError::Oversize(_) => &counters.oversize,
            };
            counter.inc();
            tracing::debug!(error = %policy_core::error_chain(&error), "sync: prefix message ignored");
            return ReceivedPrefix::Rejected(error.outcome());
        }
    };
    if message.replica == own_replica {
        counters.own.inc();
        return ReceivedPrefix::Own;
    }
    counters.applied.inc();
    let (mut placements, mut ignored) = (0, 0);
    for entry in message.placements() {
        let outcome = match entry {
            Ok(entry) => entry_outcome(policy.replica_update(
                &ReplicaUpdate::Placed {
                    worker_url: entry.worker_url,
                    prefix: &entry.prefix,
                },
                now,
            )),
            Err(_) => INVALID,
        };
        counters.placements[outcome].inc();
        if outcome == 0 {
            placements += 1;
        } else {
            ignored += 1;
        }
    }
    let mut bounds = Vec::new();
    for entry in message.bounds() {
        let outcome = match entry {
            Ok(entry) => {
                let outcome = entry_outcome(policy.replica_update(
                    &ReplicaUpdate::CacheBound {
                        worker_url: entry.worker_url,
                        cache_tokens: entry.cache_tokens,
                    },
                    now,
                ));
                if outcome == 0 {
                    bounds.push((entry.worker_url.to_owned(), entry.cache_tokens));
                }
                outcome
            }
            Err(_) => INVALID,
        };
        counters.bounds[outcome].inc();
        if outcome != 0 {
            ignored += 1;
        }
    }
    ReceivedPrefix::Applied {
        replica: message.replica.to_owned(),
        placements,
        ignored,
        bounds,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use policy_core::{PolicyContext, PolicyRegistry, RequestInfo, TokenCount, WorkerInfo};

    fn id(slot: u32) -> WorkerId {
        WorkerId::new(slot, 0)
    }

    fn blocks(hashes: &[u64]) -> PrefixBlocks {
        PrefixBlocks::new(256, hashes.to_vec())
    }

    #[test]
    fn a_placement_leading_a_longer_one_to_the_same_worker_is_dropped() {
        let mut placed = vec![
            (id(0), blocks(&[1, 2])),
            (id(0), blocks(&[1, 2, 3])),
            (id(1), blocks(&[1, 2])),
            (id(0), blocks(&[1, 2, 3])),
            (id(0), blocks(&[1, 9])),
            (id(0), blocks(&[1])),
            (id(0), PrefixBlocks::new(64, vec![1, 2])),
        ];
        let mut bounds = vec![(id(1), 500), (id(0), 300), (id(1), 400)];
        assert_eq!(coalesce(&mut placed, &mut bounds), 3);
        let kept: Vec<(u32, u32, Vec<u64>)> = placed
            .iter()
            .map(|(worker, prefix)| {
                (
                    worker.slot() as u32,
                    prefix.block_tokens(),
                    prefix.hashes().to_vec(),
                )
            })
            .collect();
        assert_eq!(
            kept,
            vec![
                (0, 64, vec![1, 2]),
                (0, 256, vec![1, 2, 3]),
                (0, 256, vec![1, 9]),
                (1, 256, vec![1, 2]),
            ],
            "another worker's, another block size's and a diverging prompt's stay"
        );
        assert_eq!(
            bounds,
            vec![(id(0), 300), (id(1), 400)],
            "the last per worker"
        );
    }

    #[test]
    fn the_queue_is_bounded_and_counts_what_it_refuses() {
        let mut queued = Queued::default();
        for i in 0..MAX_QUEUED_PLACEMENTS + 3 {
            queued.place(id(0), blocks(&[i as u64]));
        }
        assert_eq!(queued.placed.len(), MAX_QUEUED_PLACEMENTS);
        assert_eq!(queued.dropped_placements, 3);
        queued.bound(id(0), 10);
        queued.bound(id(1), 20);
        queued.bound(id(0), 30);
        assert_eq!(queued.bounds, vec![(id(0), 30), (id(1), 20)]);
        queued.clear();
        assert!(queued.placed.is_empty() && queued.bounds.is_empty());
        assert_eq!(queued.dropped_placements, 0);
    }

    fn policy() -> Box<dyn Policy> {
        super::super::test_support::least_load(&["http://w:1", "http://w:2"])
    }

    use super::super::test_support::counted;

    #[test]
    fn placements_reach_the_policy_and_junk_is_counted() {
        let metrics = Metrics::new();
        let counters = PrefixCounters::new(&metrics);
        let policy = policy();
        let now = Instant::now();
        // Eight 256-token blocks: 2048 tokens.
        let hashes: Vec<u64> = (1..=8u64)
            .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .collect();
        let prefix = PrefixBlocks::new(256, hashes.clone());
        let mut seq = 1;
        let encoded = wire::encode_prefix(
            "b",
            &mut seq,
            &[
                wire::Placement {
                    worker_url: "http://w:2",
                    prefix: &prefix,
                },
                wire::Placement {
                    worker_url: "http://unknown:1",
                    prefix: &prefix,
                },
            ],
            &[wire::Bound {
                worker_url: "http://w:1",
                cache_tokens: 100_000,
            }],
            wire::MAX_MESSAGE_BYTES,
        );
        assert_eq!(encoded.messages.len(), 1);
        let received = receive_prefix(policy.as_ref(), "a", &encoded.messages[0], now, &counters);
        assert_eq!(
            received,
            ReceivedPrefix::Applied {
                replica: "b".into(),
                placements: 1,
                ignored: 1,
                bounds: vec![("http://w:1".into(), 100_000)],
            }
        );
        // The policy now expects the prompt on worker 2.
        let request = RequestInfo::new(TokenCount::Exact(3000)).prefix_blocks(prefix);
        let table = policy.explain(&[id(0), id(1)], &request, now);
        assert_eq!(table.value(id(1), "cached_tok"), Some(2048.0));
        assert_eq!(table.value(id(0), "cached_tok"), Some(0.0));

        assert_eq!(
            receive_prefix(policy.as_ref(), "b", &encoded.messages[0], now, &counters),
            ReceivedPrefix::Own
        );
        let junk: [(&[u8], &str); 4] = [
            (b"{}", "malformed"),
            (
                br#"{"v":3,"replica":"b","seq":1,"workers":[]}"#,
                "foreign_version",
            ),
            (
                br#"{"v":1,"replica":"b c","seq":1,"workers":[]}"#,
                "invalid_replica",
            ),
            (&[b' '; wire::MAX_MESSAGE_BYTES + 1], "oversize"),
        ];
        for (payload, outcome) in junk {
            assert_eq!(
                receive_prefix(policy.as_ref(), "a", payload, now, &counters),
                ReceivedPrefix::Rejected(outcome)
            );
        }
        let bad = br#"{"v":1,"replica":"b","seq":2,"workers":["http://w:1"],"placed":[[5,256,[1]],[0,0,[1]],[0,256,[]],[0,256,[1.5]]],"bounds":[[0,-1]]}"#;
        assert_eq!(
            receive_prefix(policy.as_ref(), "a", bad, now, &counters),
            ReceivedPrefix::Applied {
                replica: "b".into(),
                placements: 0,
                ignored: 5,
                bounds: vec![],
            }
        );
        for (family, outcome, count) in [
            ("prefix_messages_received", "applied", 2),
            ("prefix_messages_received", "own", 1),
            ("prefix_messages_received", "malformed", 1),
            ("prefix_messages_received", "foreign_version", 1),
            ("prefix_messages_received", "invalid_replica", 1),
            ("prefix_messages_received", "oversize", 1),
            ("placements_received", "applied", 1),
            ("placements_received", "unknown_worker", 1),
            ("placements_received", "invalid", 4),
            ("bounds_received", "applied", 1),
            ("bounds_received", "invalid", 1),
        ] {
            assert_eq!(
                counted(&metrics, family, outcome),
                count,
                "{family} {outcome}\n{}",
                metrics.render()
            );
        }
    }

    #[test]
    fn a_policy_without_a_prefix_index_counts_placements_unsupported() {
        let metrics = Metrics::new();
        let counters = PrefixCounters::new(&metrics);
        let policy = PolicyRegistry::with_baselines()
            .build(
                "round_robin",
                &serde_json::Value::Null,
                &PolicyContext::default(),
            )
            .unwrap();
        policy.add_worker(id(0), WorkerInfo::new("http://w:1", "sglang"));
        let payload = br#"{"v":1,"replica":"b","seq":2,"workers":["http://w:1"],"placed":[[0,256,[1,2]]],"bounds":[[0,5000]]}"#;
        receive_prefix(policy.as_ref(), "a", payload, Instant::now(), &counters);
        assert_eq!(counted(&metrics, "placements_received", "unsupported"), 1);
        assert_eq!(counted(&metrics, "bounds_received", "unsupported"), 1);
    }
}
