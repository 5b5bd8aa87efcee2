//! The replica sync channel in virtual time (`docs/replicas.md`): what the
//! router's publisher and receiver do over NATS, reduced to events.
//!
//! - **Periodic** ([`SyncConfig::Periodic`]): every `publish_interval_s`, at
//!   a seeded phase of its own, each replica reads its pending work on every
//!   worker exactly as the router's publisher does
//!   ([`Policy::worker_stats`]: `pending_tokens`, `pending_requests`) and
//!   publishes the workers whose work changed since its last message (every
//!   worker every `entry_ttl_s / 4`, and in its first message), under its
//!   next sequence number. The message reaches each other replica
//!   `latency_s` later, unless it is lost for that replica (probability
//!   `loss_ratio`, seeded); delivery hands every entry to
//!   [`Policy::replica_pending`] with the receiving replica's virtual time.
//!   At its publish tick, every `max(entry_ttl_s / 8, publish_interval_s)`,
//!   a replica first drops the others' entries older than the TTL
//!   ([`Policy::expire_replica_pending`]), as the router's publisher task
//!   does. With `publish_dispatches`, a replica whose pending work on a
//!   worker grows (a dispatch) publishes that worker's state at once, on
//!   the same channel.
//! - **Ideal** ([`SyncConfig::Ideal`]): whenever a replica's pending work on
//!   a worker changes (a dispatch, a first token), its new state reaches
//!   every other replica at that instant: exact, and one
//!   `worker_stats` read per change.
//!
//! The same channel carries what replicas learn of the workers
//! ([`ReplicaUpdate`]): where a replica placed a prompt
//! ([`Policy::placement`] after its dispatch), a worker's cache bound
//! learned from the engine's reported hits ([`Policy::cache_report`]), and
//! the first tokens it learns prefill rates from ([`Policy::first_token`]).
//! Periodic: they wait in the replica's outbox for its next message (the
//! dispatch's own with `publish_dispatches`, else the next tick), share its
//! latency and its losses, and are applied with
//! [`Policy::replica_update`] when it arrives. Ideal: applied by every
//! other replica at once.
//!
//! Every message from one replica has the same latency, so messages arrive
//! in the order they were sent: the channel keeps them in one queue and
//! the cell schedules one delivery event per message.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use policy_core::{
    Policy, PrefillSample, PrefixBlocks, ReplicaPending, ReplicaPendingOutcome, ReplicaUpdate,
    ReplicaUpdateOutcome, WorkerId,
};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use super::scenario::SyncConfig;

/// Slack for comparing sums of float intervals (a cadence of 0.125 s is due
/// at the tick 0.125 s later even if the sum of ticks came out a hair short).
const CADENCE_SLACK_S: f64 = 1e-9;

/// A worker's URL in the simulated fleet, as every replica registers it:
/// the key sync entries name workers by.
pub fn worker_url(index: usize) -> String {
    format!("http://sim-worker-{index}:30000")
}

/// A replica's id in its sync messages.
pub fn replica_id(index: usize) -> String {
    format!("sim-replica-{index}")
}

/// Estimated wire size of one prefix update beside its hashes: the worker's
/// URL, the keys and the punctuation of a compact JSON entry.
pub const PREFIX_UPDATE_BYTES: u64 = 40;
/// Estimated wire size of one block hash: a 64-bit integer in JSON decimal
/// (up to 20 digits) and its comma.
pub const PREFIX_HASH_BYTES: u64 = 20;

/// What the channel did over one cell.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct SyncStats {
    /// Messages published (periodic) or changes shared (ideal).
    pub messages: u64,
    /// Message copies to other replicas: sent, and lost on the way.
    pub deliveries: u64,
    pub deliveries_lost: u64,
    /// Entries the receiving policies applied, or ignored as not newer.
    pub entries_applied: u64,
    pub entries_stale: u64,
    /// Entries ignored because the policy does not count other replicas.
    pub entries_unsupported: u64,
    /// Entries dropped by the TTL.
    pub entries_expired: u64,
    /// Placements published (one per dispatch whose policy had one).
    pub placements: u64,
    /// Their copies to other replicas: lost on the way, and applied by the
    /// receiving policies.
    pub placements_lost: u64,
    pub placements_applied: u64,
    /// Cache bounds published (a worker's bound changed by an engine's
    /// reported hits), and their copies applied.
    pub cache_bounds: u64,
    pub cache_bounds_applied: u64,
    /// Updates the receiving policies ignored (no prefix index, no
    /// learned rates).
    pub prefix_unsupported: u64,
    /// First tokens published (those a policy learns rates from), and
    /// their copies applied.
    pub prefill_samples: u64,
    pub prefill_samples_applied: u64,
    /// Estimated bytes of the updates published (each once, as a replica
    /// publishes it to the broker): 40 per update and 20 per hash or
    /// number.
    pub prefix_bytes: u64,
}

/// What a replica learned of one worker, on its way to the others
/// ([`ReplicaUpdate`], by worker index).
#[derive(Debug, Clone, PartialEq)]
enum SharedUpdate {
    Placed {
        worker: usize,
        prefix: PrefixBlocks,
    },
    CacheBound {
        worker: usize,
        cache_tokens: u64,
    },
    Prefill {
        worker: usize,
        sample: PrefillSample,
        first_token_at: Instant,
    },
}

impl SharedUpdate {
    /// Its estimated wire size.
    fn bytes(&self) -> u64 {
        match self {
            SharedUpdate::Placed { prefix, .. } => {
                PREFIX_UPDATE_BYTES + PREFIX_HASH_BYTES * prefix.hashes().len() as u64
            }
            SharedUpdate::CacheBound { .. } => PREFIX_UPDATE_BYTES + PREFIX_HASH_BYTES,
            // Two token counts and two times.
            SharedUpdate::Prefill { .. } => PREFIX_UPDATE_BYTES + 4 * PREFIX_HASH_BYTES,
        }
    }
}

/// One published message on its way.
#[derive(Debug, Clone)]
struct Message {
    sender: usize,
    seq: u64,
    /// `(worker, pending_tokens, pending_requests)`.
    entries: Vec<(usize, u64, u64)>,
    /// The prefix updates it carries.
    prefix: Vec<SharedUpdate>,
    /// Bit `r`: replica `r` receives it (replicas ≤ 64).
    receivers: u64,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    Ideal,
    Periodic {
        publish_interval_s: f64,
        latency_s: f64,
        loss_ratio: f64,
        entry_ttl_s: f64,
        publish_dispatches: bool,
    },
}

/// The sync channel of one cell's replicas.
#[derive(Debug)]
pub struct SyncChannel {
    mode: Mode,
    replicas: usize,
    replica_ids: Vec<String>,
    urls: Vec<String>,
    /// Each replica's next sequence number.
    next_seq: Vec<u64>,
    /// `[replica][worker]`: the pending work last published.
    published: Vec<Vec<Option<(u64, u64)>>>,
    last_full_s: Vec<Option<f64>>,
    last_expiry_s: Vec<Option<f64>>,
    in_flight: VecDeque<Message>,
    /// `[replica]`: prefix updates waiting for the replica's next message.
    outbox: Vec<Vec<SharedUpdate>>,
    loss_rng: SmallRng,
    phases_s: Vec<f64>,
    /// Cleared when a policy answers `Unsupported`: it ignores other
    /// replicas, so the channel stops (nothing it sends changes anything).
    supported: bool,
    stats: SyncStats,
}

impl SyncChannel {
    /// The channel for `replicas` replicas over `workers` workers, or `None`
    /// when there is nothing to share (sync off, or a single replica).
    /// `seed` draws the publish phases and the losses.
    pub fn new(
        config: SyncConfig,
        replicas: usize,
        workers: usize,
        seed: u64,
    ) -> Option<SyncChannel> {
        let mode = match config {
            SyncConfig::Off {} => return None,
            SyncConfig::Ideal {} => Mode::Ideal,
            SyncConfig::Periodic {
                publish_interval_s,
                latency_s,
                loss_ratio,
                entry_ttl_s,
                publish_dispatches,
            } => Mode::Periodic {
                publish_interval_s,
                latency_s,
                loss_ratio,
                entry_ttl_s,
                publish_dispatches,
            },
        };
        if replicas < 2 {
            return None;
        }
        let mut loss_rng = SmallRng::seed_from_u64(seed);
        let phases_s = match mode {
            Mode::Ideal => Vec::new(),
            Mode::Periodic {
                publish_interval_s, ..
            } => (0..replicas)
                .map(|_| publish_interval_s * loss_rng.random::<f64>())
                .collect(),
        };
        Some(SyncChannel {
            mode,
            replicas,
            replica_ids: (0..replicas).map(replica_id).collect(),
            urls: (0..workers).map(worker_url).collect(),
            next_seq: vec![1; replicas],
            published: vec![vec![None; workers]; replicas],
            last_full_s: vec![None; replicas],
            last_expiry_s: vec![None; replicas],
            in_flight: VecDeque::new(),
            outbox: vec![Vec::new(); replicas],
            loss_rng,
            phases_s,
            supported: true,
            stats: SyncStats::default(),
        })
    }

    pub fn is_ideal(&self) -> bool {
        self.mode == Mode::Ideal
    }

    /// Whether the channel still runs (the policy counts other replicas).
    pub fn is_active(&self) -> bool {
        self.supported
    }

    /// Each replica's first publish tick, in `[0, publish_interval_s)`
    /// (none in ideal mode).
    pub fn first_ticks_s(&self) -> &[f64] {
        &self.phases_s
    }

    /// The interval between a replica's publish ticks (ideal: none).
    pub fn publish_interval_s(&self) -> Option<f64> {
        match self.mode {
            Mode::Ideal => None,
            Mode::Periodic {
                publish_interval_s, ..
            } => Some(publish_interval_s),
        }
    }

    /// How long a message takes to reach the other replicas (ideal: none).
    pub fn latency_s(&self) -> Option<f64> {
        match self.mode {
            Mode::Ideal => None,
            Mode::Periodic { latency_s, .. } => Some(latency_s),
        }
    }

    pub fn stats(&self) -> SyncStats {
        self.stats
    }

    /// Messages sent and not yet delivered.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Replica `replica`'s publish tick at `now_s` (`now` on the policies'
    /// clock): expiry when due, then the message of what changed. Returns
    /// when the message arrives, if some replica is to receive it; the
    /// caller then calls [`deliver`](SyncChannel::deliver) at that time.
    pub fn tick(
        &mut self,
        replica: usize,
        policies: &[Box<dyn Policy>],
        ids: &[WorkerId],
        now_s: f64,
        now: Instant,
    ) -> Option<f64> {
        let Mode::Periodic {
            publish_interval_s,
            entry_ttl_s,
            ..
        } = self.mode
        else {
            return None;
        };
        if !self.supported {
            return None;
        }
        let policy = policies.get(replica)?;
        // The router's cadences: expiry every eighth of the TTL (at least a
        // publish interval), a full state every quarter.
        let expiry_interval_s = (entry_ttl_s / 8.0).max(publish_interval_s);
        if due(self.last_expiry_s[replica], now_s, expiry_interval_s) {
            self.last_expiry_s[replica] = Some(now_s);
            let expired = policy.expire_replica_pending(now, Duration::from_secs_f64(entry_ttl_s));
            self.stats.entries_expired += expired as u64;
        }
        let full = due(self.last_full_s[replica], now_s, entry_ttl_s / 4.0);
        let mut entries = Vec::new();
        for (worker, id) in ids.iter().enumerate() {
            let stats = policy.worker_stats(*id).unwrap_or_default();
            let pending = (stats.pending_tokens, stats.pending_requests);
            let last = &mut self.published[replica][worker];
            if full || *last != Some(pending) {
                entries.push((worker, pending.0, pending.1));
            }
            *last = Some(pending);
        }
        if entries.is_empty() && self.outbox[replica].is_empty() {
            return None;
        }
        if full {
            self.last_full_s[replica] = Some(now_s);
        }
        self.send(replica, entries, now_s)
    }

    /// Sends one message from `replica` under its next sequence number,
    /// with the prefix updates in its outbox: each other replica receives
    /// it `latency_s` later unless it is lost on the way. Returns when it
    /// arrives, if anyone is to receive it.
    fn send(&mut self, replica: usize, entries: Vec<(usize, u64, u64)>, now_s: f64) -> Option<f64> {
        let Mode::Periodic {
            latency_s,
            loss_ratio,
            ..
        } = self.mode
        else {
            return None;
        };
        let seq = self.take_seq(replica);
        let prefix = std::mem::take(&mut self.outbox[replica]);
        let placements = prefix
            .iter()
            .filter(|update| matches!(update, SharedUpdate::Placed { .. }))
            .count() as u64;
        self.stats.messages += 1;
        let mut receivers = 0u64;
        for other in (0..self.replicas).filter(|&other| other != replica) {
            self.stats.deliveries += 1;
            if loss_ratio > 0.0 && self.loss_rng.random::<f64>() < loss_ratio {
                self.stats.deliveries_lost += 1;
                self.stats.placements_lost += placements;
            } else {
                receivers |= 1 << other;
            }
        }
        if receivers == 0 {
            return None;
        }
        self.in_flight.push_back(Message {
            sender: replica,
            seq,
            entries,
            prefix,
            receivers,
        });
        Some(now_s + latency_s)
    }

    /// Replica `replica` dispatched a prompt to `worker` and its policy says
    /// the others should learn `prefix` ([`Policy::placement`]), at `now`
    /// on the policies' clock. Ideal: every other replica applies it now.
    /// Periodic: it goes with the replica's next message; call it before
    /// [`changed`](SyncChannel::changed) for the dispatch, so that with
    /// `publish_dispatches` the dispatch's own message carries it.
    pub fn placed(
        &mut self,
        replica: usize,
        worker: usize,
        prefix: PrefixBlocks,
        policies: &[Box<dyn Policy>],
        now: Instant,
    ) {
        let update = SharedUpdate::Placed { worker, prefix };
        self.share_update(replica, update, policies, now);
    }

    /// Replica `replica`'s policy learned a new cache bound for `worker`
    /// from an engine's reported hits ([`Policy::cache_report`]): shared as
    /// a placement is.
    pub fn cache_bound(
        &mut self,
        replica: usize,
        worker: usize,
        cache_tokens: u64,
        policies: &[Box<dyn Policy>],
        now: Instant,
    ) {
        let update = SharedUpdate::CacheBound {
            worker,
            cache_tokens,
        };
        self.share_update(replica, update, policies, now);
    }

    /// Replica `replica`'s policy had a first token from `worker` now
    /// ([`Policy::first_token`]): shared as a placement is.
    pub fn prefill_sample(
        &mut self,
        replica: usize,
        worker: usize,
        sample: PrefillSample,
        policies: &[Box<dyn Policy>],
        now: Instant,
    ) {
        let update = SharedUpdate::Prefill {
            worker,
            sample,
            first_token_at: now,
        };
        self.share_update(replica, update, policies, now);
    }

    /// Counts `update` as published by `replica` and shares it.
    fn share_update(
        &mut self,
        replica: usize,
        update: SharedUpdate,
        policies: &[Box<dyn Policy>],
        now: Instant,
    ) {
        match update {
            SharedUpdate::Placed { .. } => self.stats.placements += 1,
            SharedUpdate::CacheBound { .. } => self.stats.cache_bounds += 1,
            SharedUpdate::Prefill { .. } => self.stats.prefill_samples += 1,
        }
        if !self.supported || replica >= self.replicas {
            return;
        }
        self.stats.prefix_bytes += update.bytes();
        match self.mode {
            Mode::Ideal => {
                for (other, receiver) in policies.iter().enumerate() {
                    if other != replica {
                        self.apply_update(receiver.as_ref(), &update, now);
                    }
                }
            }
            Mode::Periodic { .. } => self.outbox[replica].push(update),
        }
    }

    /// One receiving policy applies one prefix update.
    fn apply_update(&mut self, receiver: &dyn Policy, update: &SharedUpdate, now: Instant) {
        let outcome = match update {
            SharedUpdate::Placed { worker, prefix } => receiver.replica_update(
                &ReplicaUpdate::Placed {
                    worker_url: &self.urls[*worker],
                    prefix,
                },
                now,
            ),
            SharedUpdate::CacheBound {
                worker,
                cache_tokens,
            } => receiver.replica_update(
                &ReplicaUpdate::CacheBound {
                    worker_url: &self.urls[*worker],
                    cache_tokens: *cache_tokens,
                },
                now,
            ),
            SharedUpdate::Prefill {
                worker,
                sample,
                first_token_at,
            } => receiver.replica_update(
                &ReplicaUpdate::Prefill {
                    worker_url: &self.urls[*worker],
                    sample: *sample,
                    first_token_at: *first_token_at,
                },
                now,
            ),
        };
        match (outcome, update) {
            (ReplicaUpdateOutcome::Applied, SharedUpdate::Placed { .. }) => {
                self.stats.placements_applied += 1;
            }
            (ReplicaUpdateOutcome::Applied, SharedUpdate::CacheBound { .. }) => {
                self.stats.cache_bounds_applied += 1;
            }
            (ReplicaUpdateOutcome::Applied, SharedUpdate::Prefill { .. }) => {
                self.stats.prefill_samples_applied += 1;
            }
            (ReplicaUpdateOutcome::Unsupported, _) => self.stats.prefix_unsupported += 1,
            // Every replica registers every worker under the same URL.
            (ReplicaUpdateOutcome::UnknownWorker, _) => {}
        }
    }

    /// The oldest message in flight arrives (`now` on the policies' clock):
    /// each receiving replica's policy gets its entries.
    pub fn deliver(&mut self, policies: &[Box<dyn Policy>], now: Instant) {
        let Some(message) = self.in_flight.pop_front() else {
            return;
        };
        for (receiver, policy) in policies.iter().enumerate() {
            if message.receivers & (1 << receiver) == 0 {
                continue;
            }
            for update in &message.prefix {
                self.apply_update(policy.as_ref(), update, now);
            }
            for &(worker, pending_tokens, pending_requests) in &message.entries {
                let outcome = policy.replica_pending(
                    &ReplicaPending {
                        replica: &self.replica_ids[message.sender],
                        worker_url: &self.urls[worker],
                        pending_tokens,
                        pending_requests,
                        seq: message.seq,
                    },
                    now,
                );
                self.count(outcome);
            }
        }
    }

    /// Replica `replica`'s pending work on `worker` may have changed (a
    /// dispatch, a first token, a finish), at `now_s` (`now` on the
    /// policies' clock). Ideal: if it did, every other replica learns it
    /// now. Periodic with `publish_dispatches`: if it grew, the worker's
    /// state is published now, and the time it arrives is returned (the
    /// caller then calls [`deliver`](SyncChannel::deliver) at that time).
    pub fn changed(
        &mut self,
        replica: usize,
        worker: usize,
        policies: &[Box<dyn Policy>],
        ids: &[WorkerId],
        now_s: f64,
        now: Instant,
    ) -> Option<f64> {
        let push = match self.mode {
            Mode::Ideal => false,
            Mode::Periodic {
                publish_dispatches, ..
            } => publish_dispatches,
        };
        if (self.mode != Mode::Ideal && !push) || !self.supported {
            return None;
        }
        let (Some(policy), Some(id)) = (policies.get(replica), ids.get(worker)) else {
            return None;
        };
        let stats = policy.worker_stats(*id).unwrap_or_default();
        let pending = (stats.pending_tokens, stats.pending_requests);
        let last = self.published[replica][worker];
        if last == Some(pending) {
            return None;
        }
        if push {
            let grew =
                last.is_none_or(|(tokens, requests)| pending.0 > tokens || pending.1 > requests);
            if !grew {
                // Decreases wait for the tick.
                return None;
            }
            self.published[replica][worker] = Some(pending);
            return self.send(replica, vec![(worker, pending.0, pending.1)], now_s);
        }
        self.published[replica][worker] = Some(pending);
        let seq = self.take_seq(replica);
        self.stats.messages += 1;
        for (other, receiver) in policies.iter().enumerate() {
            if other == replica {
                continue;
            }
            self.stats.deliveries += 1;
            let outcome = receiver.replica_pending(
                &ReplicaPending {
                    replica: &self.replica_ids[replica],
                    worker_url: &self.urls[worker],
                    pending_tokens: pending.0,
                    pending_requests: pending.1,
                    seq,
                },
                now,
            );
            self.count(outcome);
        }
        None
    }

    fn take_seq(&mut self, replica: usize) -> u64 {
        let seq = self.next_seq[replica];
        self.next_seq[replica] += 1;
        seq
    }

    fn count(&mut self, outcome: ReplicaPendingOutcome) {
        match outcome {
            ReplicaPendingOutcome::Applied => self.stats.entries_applied += 1,
            ReplicaPendingOutcome::Stale => self.stats.entries_stale += 1,
            // Every replica registers every worker under the same URL.
            ReplicaPendingOutcome::UnknownWorker => {}
            ReplicaPendingOutcome::Unsupported => {
                self.stats.entries_unsupported += 1;
                self.supported = false;
            }
        }
    }
}

/// Whether a cadence of `interval_s` last run at `last_s` is due at `now_s`.
fn due(last_s: Option<f64>, now_s: f64, interval_s: f64) -> bool {
    last_s.is_none_or(|last_s| now_s - last_s >= interval_s - CADENCE_SLACK_S)
}

/// The explain-table column that holds a `least_load` policy's score.
const SCORE_COLUMN: &str = "score_s";

/// Whether policies built as `name` count other replicas' pending work:
/// probed on a fresh instance with one idle worker, by handing it another
/// replica's entry. The baselines answer `Unsupported`; a policy that
/// stores the entry but scores the worker no higher for it does not count
/// it either (`least_load` with `inflight = "since_poll"`); the references
/// have no policy.
pub fn counts_replica_pending(
    registry: &policy_core::PolicyRegistry,
    name: super::scenario::PolicyName,
) -> bool {
    let context = policy_core::PolicyContext::default();
    let Ok(Some(policy)) = super::fleet::build_policy(registry, name, &context) else {
        return false;
    };
    let id = WorkerId::new(0, 0);
    let url = worker_url(0);
    policy.add_worker(id, policy_core::WorkerInfo::new(url.clone(), "sglang"));
    let now = Instant::now();
    let request = policy_core::RequestInfo::new(policy_core::TokenCount::Exact(200));
    let score = || policy.explain(&[id], &request, now).value(id, SCORE_COLUMN);
    let before = score();
    let outcome = policy.replica_pending(
        &ReplicaPending {
            replica: "probe",
            worker_url: &url,
            pending_tokens: 100_000,
            pending_requests: 1,
            seq: 1,
        },
        now,
    );
    if outcome == ReplicaPendingOutcome::Unsupported {
        return false;
    }
    match (before, score()) {
        (Some(before), Some(after)) => after > before,
        // No score to read: it took the entry, so count it as used.
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::policy_registry;
    use crate::scenario::PolicyName;
    use policy_core::{Dispatch, PolicyContext, PrefixBlocks, RequestInfo, TokenCount, WorkerInfo};

    /// `replicas` `least_load` policies over two workers, as a cell builds them.
    fn policies(replicas: usize) -> (Vec<Box<dyn Policy>>, Vec<WorkerId>) {
        let registry = policy_registry();
        let ids: Vec<WorkerId> = (0..2).map(|i| WorkerId::new(i, 0)).collect();
        let policies = (0..replicas)
            .map(|_| {
                let policy = registry
                    .build(
                        "least_load",
                        &serde_json::Value::Null,
                        &PolicyContext::default(),
                    )
                    .unwrap();
                for (index, id) in ids.iter().enumerate() {
                    policy.add_worker(*id, WorkerInfo::new(worker_url(index), "sglang"));
                }
                policy
            })
            .collect();
        (policies, ids)
    }

    fn periodic(interval_s: f64, latency_s: f64, loss_ratio: f64, ttl_s: f64) -> SyncConfig {
        SyncConfig::Periodic {
            publish_interval_s: interval_s,
            latency_s,
            loss_ratio,
            entry_ttl_s: ttl_s,
            publish_dispatches: false,
        }
    }

    /// Replica `replica` dispatches `tokens` to worker 0 (both idle: the
    /// tie goes to a draw, so the worker is forced by offering only it).
    fn dispatch(
        policies: &[Box<dyn Policy>],
        ids: &[WorkerId],
        replica: usize,
        tokens: u64,
        now: Instant,
    ) -> Dispatch {
        let request = RequestInfo::new(TokenCount::Exact(tokens)).streaming(true);
        policies[replica].select(&ids[..1], &request, now).unwrap()
    }

    /// The other replicas' pending tokens on worker 0 as `replica` counts them.
    fn remote_tokens(policies: &[Box<dyn Policy>], ids: &[WorkerId], replica: usize) -> f64 {
        let request = RequestInfo::new(TokenCount::Exact(100));
        policies[replica]
            .explain(ids, &request, Instant::now())
            .value(ids[0], "remote_tok")
            .unwrap()
    }

    #[test]
    fn a_message_arrives_after_the_latency_and_is_applied_then() {
        let (policies, ids) = policies(3);
        let mut channel = SyncChannel::new(periodic(0.02, 0.05, 0.0, 1.0), 3, 2, 1).unwrap();
        let base = Instant::now();
        let at = |s: f64| base + Duration::from_secs_f64(s);
        assert_eq!(channel.first_ticks_s().len(), 3);
        assert!(
            channel
                .first_ticks_s()
                .iter()
                .all(|&t| (0.0..0.02).contains(&t))
        );
        dispatch(&policies, &ids, 0, 1000, at(0.0));
        let arrives_s = channel.tick(0, &policies, &ids, 0.01, at(0.01)).unwrap();
        assert_eq!(arrives_s, 0.01 + 0.05);
        assert_eq!(channel.in_flight(), 1);
        // On the way: nobody counts it yet.
        assert_eq!(remote_tokens(&policies, &ids, 1), 0.0);
        assert_eq!(remote_tokens(&policies, &ids, 2), 0.0);
        channel.deliver(&policies, at(arrives_s));
        assert_eq!(channel.in_flight(), 0);
        assert_eq!(remote_tokens(&policies, &ids, 1), 1000.0);
        assert_eq!(remote_tokens(&policies, &ids, 2), 1000.0);
        // Not to the sender itself.
        assert_eq!(remote_tokens(&policies, &ids, 0), 0.0);
        let stats = channel.stats();
        assert_eq!(stats.messages, 1);
        assert_eq!(stats.deliveries, 2);
        // A first message is a full state: both workers, to both receivers.
        assert_eq!(stats.entries_applied, 4);
    }

    #[test]
    fn only_changes_are_published_between_full_states() {
        let (policies, ids) = policies(2);
        let mut channel = SyncChannel::new(periodic(0.02, 0.0, 0.0, 1.0), 2, 2, 1).unwrap();
        let base = Instant::now();
        let at = |s: f64| base + Duration::from_secs_f64(s);
        assert!(channel.tick(0, &policies, &ids, 0.0, at(0.0)).is_some());
        channel.deliver(&policies, at(0.0));
        // Nothing changed: no message.
        assert_eq!(channel.tick(0, &policies, &ids, 0.02, at(0.02)), None);
        let sent = dispatch(&policies, &ids, 0, 700, at(0.03));
        assert!(channel.tick(0, &policies, &ids, 0.04, at(0.04)).is_some());
        channel.deliver(&policies, at(0.04));
        assert_eq!(remote_tokens(&policies, &ids, 1), 700.0);
        assert_eq!(
            channel.stats().entries_applied,
            3,
            "the full state, then one change"
        );
        // The first token releases it; the next tick says so.
        policies[0].first_token(&sent, at(0.05));
        assert!(channel.tick(0, &policies, &ids, 0.06, at(0.06)).is_some());
        channel.deliver(&policies, at(0.06));
        assert_eq!(remote_tokens(&policies, &ids, 1), 0.0);
        // A quarter of the TTL after the first full state, another one.
        assert_eq!(channel.tick(0, &policies, &ids, 0.24, at(0.24)), None);
        assert!(channel.tick(0, &policies, &ids, 0.26, at(0.26)).is_some());
        channel.deliver(&policies, at(0.26));
        assert_eq!(channel.stats().entries_applied, 6);
        assert_eq!(channel.stats().messages, 4);
    }

    #[test]
    fn a_lost_message_is_not_applied() {
        let (policies, ids) = policies(2);
        let mut channel = SyncChannel::new(periodic(0.02, 0.0, 1.0, 1.0), 2, 2, 1).unwrap();
        let now = Instant::now();
        dispatch(&policies, &ids, 0, 1000, now);
        assert_eq!(channel.tick(0, &policies, &ids, 0.0, now), None);
        assert_eq!(channel.in_flight(), 0);
        assert_eq!(remote_tokens(&policies, &ids, 1), 0.0);
        let stats = channel.stats();
        assert_eq!((stats.deliveries, stats.deliveries_lost), (1, 1));
        assert_eq!(stats.entries_applied, 0);
    }

    #[test]
    fn losses_are_drawn_from_the_seed() {
        let losses = |seed: u64| {
            let (policies, ids) = policies(4);
            let mut channel = SyncChannel::new(periodic(0.02, 0.0, 0.3, 1.0), 4, 2, seed).unwrap();
            let base = Instant::now();
            let mut lost = Vec::new();
            for tick in 0..200 {
                let now_s = f64::from(tick) * 0.02;
                let now = base + Duration::from_secs_f64(now_s);
                // A change every tick, so every tick sends.
                dispatch(&policies, &ids, 0, 10, now);
                if channel.tick(0, &policies, &ids, now_s, now).is_some() {
                    channel.deliver(&policies, now);
                }
                lost.push(channel.stats().deliveries_lost);
            }
            lost
        };
        let a = losses(7);
        assert_eq!(a, losses(7), "the same seed loses the same copies");
        assert_ne!(a, losses(8));
        let lost = *a.last().unwrap();
        // 600 copies at 30 %: about 180.
        assert!((140..220).contains(&lost), "{lost}");
    }

    #[test]
    fn a_replica_that_stops_publishing_is_expired_after_the_ttl() {
        let (policies, ids) = policies(2);
        // TTL 0.4 s: expiry every 0.05 s (an eighth), full states every 0.1 s.
        let mut channel = SyncChannel::new(periodic(0.05, 0.001, 0.0, 0.4), 2, 2, 1).unwrap();
        let base = Instant::now();
        let at = |s: f64| base + Duration::from_secs_f64(s);
        dispatch(&policies, &ids, 0, 1000, at(0.0));
        let arrives_s = channel.tick(0, &policies, &ids, 0.0, at(0.0)).unwrap();
        channel.deliver(&policies, at(arrives_s));
        assert_eq!(remote_tokens(&policies, &ids, 1), 1000.0);
        // Replica 0 falls silent; replica 1 goes on ticking (and expiring).
        let mut gone_at_s = None;
        for tick in 1..=20 {
            let now_s = f64::from(tick) * 0.05;
            channel.tick(1, &policies, &ids, now_s, at(now_s));
            if remote_tokens(&policies, &ids, 1) == 0.0 && gone_at_s.is_none() {
                gone_at_s = Some(now_s);
            }
        }
        // Confirmed at 0.001 s: kept through 0.4 s, gone at the first
        // expiry after 0.401 s.
        let gone_at_s = gone_at_s.unwrap();
        assert!((gone_at_s - 0.45).abs() < 1e-9, "{gone_at_s}");
        // Both of replica 0's entries (worker 0 and worker 1) went.
        assert_eq!(channel.stats().entries_expired, 2);
    }

    #[test]
    fn a_live_replica_is_never_expired() {
        let (policies, ids) = policies(2);
        let mut channel = SyncChannel::new(periodic(0.05, 0.001, 0.0, 0.4), 2, 2, 1).unwrap();
        let base = Instant::now();
        dispatch(&policies, &ids, 0, 1000, base);
        for tick in 0..200 {
            for replica in 0..2 {
                let now_s = f64::from(tick) * 0.05 + 0.01 * replica as f64;
                let now = base + Duration::from_secs_f64(now_s);
                if let Some(arrives_s) = channel.tick(replica, &policies, &ids, now_s, now) {
                    channel.deliver(&policies, base + Duration::from_secs_f64(arrives_s));
                }
            }
        }
        assert_eq!(channel.stats().entries_expired, 0);
        assert_eq!(remote_tokens(&policies, &ids, 1), 1000.0);
    }

    #[test]
    fn ideal_sync_shares_every_change_at_once() {
        let (policies, ids) = policies(3);
        let mut channel = SyncChannel::new(SyncConfig::Ideal {}, 3, 2, 1).unwrap();
        assert!(channel.is_ideal());
        assert!(channel.first_ticks_s().is_empty());
        assert_eq!(channel.publish_interval_s(), None);
        let now = Instant::now();
        let sent = dispatch(&policies, &ids, 1, 500, now);
        assert_eq!(channel.changed(1, 0, &policies, &ids, 0.0, now), None);
        assert_eq!(remote_tokens(&policies, &ids, 0), 500.0);
        assert_eq!(remote_tokens(&policies, &ids, 2), 500.0);
        // Unchanged: nothing sent.
        channel.changed(1, 0, &policies, &ids, 0.0, now);
        assert_eq!(channel.stats().messages, 1);
        policies[1].first_token(&sent, now);
        channel.changed(1, 0, &policies, &ids, 0.0, now);
        assert_eq!(remote_tokens(&policies, &ids, 0), 0.0);
        let stats = channel.stats();
        assert_eq!((stats.messages, stats.entries_applied), (2, 4));
    }

    #[test]
    fn publish_dispatches_sends_growth_at_once_and_leaves_releases_to_the_tick() {
        let (policies, ids) = policies(2);
        let config = SyncConfig::Periodic {
            publish_interval_s: 0.1,
            latency_s: 0.001,
            loss_ratio: 0.0,
            entry_ttl_s: 1.0,
            publish_dispatches: true,
        };
        let mut channel = SyncChannel::new(config, 2, 2, 1).unwrap();
        let base = Instant::now();
        let at = |s: f64| base + Duration::from_secs_f64(s);
        let sent = dispatch(&policies, &ids, 0, 800, at(0.01));
        let arrives_s = channel
            .changed(0, 0, &policies, &ids, 0.01, at(0.01))
            .unwrap();
        assert_eq!(arrives_s, 0.01 + 0.001);
        channel.deliver(&policies, at(arrives_s));
        assert_eq!(remote_tokens(&policies, &ids, 1), 800.0);
        policies[0].first_token(&sent, at(0.02));
        assert_eq!(channel.changed(0, 0, &policies, &ids, 0.02, at(0.02)), None);
        assert_eq!(remote_tokens(&policies, &ids, 1), 800.0, "until the tick");
        let arrives_s = channel.tick(0, &policies, &ids, 0.05, at(0.05)).unwrap();
        channel.deliver(&policies, at(arrives_s));
        assert_eq!(remote_tokens(&policies, &ids, 1), 0.0);
    }

    /// A streamed request of `blocks` full 16-token blocks and 8 more
    /// tokens (an engine always computes a prompt's last token), opening
    /// with prompt `group`'s chained hashes (so two groups share no block).
    fn prefixed(group: u64, blocks: usize) -> RequestInfo {
        let hashes: Vec<u64> = (0..blocks as u64)
            .map(|i| engine_model::mix(group.wrapping_mul(1_000_003) ^ (i + 1)))
            .collect();
        RequestInfo::new(TokenCount::Exact(16 * blocks as u64 + 8))
            .streaming(true)
            .prefix_blocks(PrefixBlocks::new(16, hashes))
    }

    /// Replica `replica` dispatches `request` to worker 0 and hands its
    /// placement to the channel, then the dispatch's change: returns when
    /// the dispatch's message arrives, if it went at once.
    fn dispatch_placed(
        channel: &mut SyncChannel,
        policies: &[Box<dyn Policy>],
        ids: &[WorkerId],
        replica: usize,
        request: &RequestInfo,
        now_s: f64,
        now: Instant,
    ) -> Option<f64> {
        policies[replica].select(&ids[..1], request, now).unwrap();
        let prefix = policies[replica].placement(request).unwrap();
        channel.placed(replica, 0, prefix, policies, now);
        channel.changed(replica, 0, policies, ids, now_s, now)
    }

    /// The prompt tokens of `request` that `replica` expects worker 0 to hold.
    fn expected_cached(
        policies: &[Box<dyn Policy>],
        ids: &[WorkerId],
        replica: usize,
        request: &RequestInfo,
    ) -> f64 {
        policies[replica]
            .explain(ids, request, Instant::now())
            .value(ids[0], "cached_tok")
            .unwrap()
    }

    fn with_dispatches(interval_s: f64, latency_s: f64, loss_ratio: f64) -> SyncConfig {
        SyncConfig::Periodic {
            publish_interval_s: interval_s,
            latency_s,
            loss_ratio,
            entry_ttl_s: 1.0,
            publish_dispatches: true,
        }
    }

    #[test]
    fn a_placement_rides_the_dispatch_message_and_is_applied_when_it_arrives() {
        let (policies, ids) = policies(3);
        let mut channel = SyncChannel::new(with_dispatches(0.1, 0.005, 0.0), 3, 2, 1).unwrap();
        let base = Instant::now();
        let at = |s: f64| base + Duration::from_secs_f64(s);
        // 64 blocks of 16 tokens: 4 of the index's 256-token blocks.
        let request = prefixed(1, 64);
        let arrives_s =
            dispatch_placed(&mut channel, &policies, &ids, 0, &request, 0.01, at(0.01)).unwrap();
        assert_eq!(arrives_s, 0.01 + 0.005);
        // On the way: the others do not expect it yet; the sender does.
        assert_eq!(expected_cached(&policies, &ids, 1, &request), 0.0);
        assert_eq!(expected_cached(&policies, &ids, 0, &request), 1024.0);
        channel.deliver(&policies, at(arrives_s));
        assert_eq!(expected_cached(&policies, &ids, 1, &request), 1024.0);
        assert_eq!(expected_cached(&policies, &ids, 2, &request), 1024.0);
        let stats = channel.stats();
        assert_eq!(
            stats.messages, 1,
            "one message: the dispatch and its placement"
        );
        assert_eq!((stats.placements, stats.placements_applied), (1, 2));
        assert_eq!(
            stats.prefix_bytes,
            PREFIX_UPDATE_BYTES + 4 * PREFIX_HASH_BYTES,
            "four hashes at the index's granularity"
        );
        // The next turn, from replica 1, is expected where the first went.
        let longer = prefixed(1, 80);
        assert_eq!(expected_cached(&policies, &ids, 1, &longer), 1024.0);
    }

    #[test]
    fn on_ticks_alone_a_placement_waits_for_the_next_tick() {
        let (policies, ids) = policies(2);
        let mut channel = SyncChannel::new(periodic(0.02, 0.001, 0.0, 1.0), 2, 2, 1).unwrap();
        let base = Instant::now();
        let at = |s: f64| base + Duration::from_secs_f64(s);
        let request = prefixed(2, 32);
        assert_eq!(
            dispatch_placed(&mut channel, &policies, &ids, 0, &request, 0.0, at(0.0)),
            None
        );
        assert_eq!(channel.in_flight(), 0);
        let arrives_s = channel.tick(0, &policies, &ids, 0.01, at(0.01)).unwrap();
        channel.deliver(&policies, at(arrives_s));
        assert_eq!(expected_cached(&policies, &ids, 1, &request), 512.0);
        // A placement alone (no pending work changed) still makes a tick send.
        let other = prefixed(3, 32);
        let prefix = policies[0].placement(&other).unwrap();
        channel.placed(0, 1, prefix, &policies, at(0.02));
        let arrives_s = channel.tick(0, &policies, &ids, 0.03, at(0.03)).unwrap();
        channel.deliver(&policies, at(arrives_s));
        let request_tokens = policies[1]
            .explain(&ids, &other, Instant::now())
            .value(ids[1], "cached_tok")
            .unwrap();
        assert_eq!(request_tokens, 512.0);
        assert_eq!(channel.stats().placements_applied, 2);
    }

    #[test]
    fn a_lost_message_loses_its_placements() {
        let (policies, ids) = policies(3);
        let mut channel = SyncChannel::new(with_dispatches(0.1, 0.0, 1.0), 3, 2, 1).unwrap();
        let now = Instant::now();
        let request = prefixed(4, 32);
        assert_eq!(
            dispatch_placed(&mut channel, &policies, &ids, 0, &request, 0.0, now),
            None
        );
        let stats = channel.stats();
        assert_eq!(stats.placements, 1);
        assert_eq!((stats.placements_lost, stats.placements_applied), (2, 0));
        assert_eq!(expected_cached(&policies, &ids, 1, &request), 0.0);
        // Sent once, lost on both copies: its bytes were still published.
        assert!(stats.prefix_bytes > 0);
    }

    #[test]
    fn ideal_sync_applies_placements_and_cache_bounds_at_once() {
        let (policies, ids) = policies(3);
        let mut channel = SyncChannel::new(SyncConfig::Ideal {}, 3, 2, 1).unwrap();
        let now = Instant::now();
        let first = prefixed(5, 64);
        let second = prefixed(6, 64);
        assert_eq!(
            dispatch_placed(&mut channel, &policies, &ids, 0, &first, 0.0, now),
            None
        );
        assert_eq!(expected_cached(&policies, &ids, 2, &first), 1024.0);
        // 1024 newer tokens on worker 0: the first prompt is 1024 tokens old.
        dispatch_placed(&mut channel, &policies, &ids, 1, &second, 0.0, now);
        assert_eq!(expected_cached(&policies, &ids, 2, &first), 1024.0);
        // Replica 0 learned that worker 0's cache keeps 512 tokens: every
        // other replica then expects the older prompt gone, the newer kept.
        channel.cache_bound(0, 0, 512, &policies, now);
        for replica in [1, 2] {
            assert_eq!(expected_cached(&policies, &ids, replica, &first), 0.0);
        }
        let stats = channel.stats();
        assert_eq!((stats.placements, stats.placements_applied), (2, 4));
        assert_eq!((stats.cache_bounds, stats.cache_bounds_applied), (1, 2));
        assert_eq!(channel.in_flight(), 0);
    }

    #[test]
    fn a_policy_without_a_prefix_index_answers_unsupported() {
        let registry = policy_registry();
        let ids: Vec<WorkerId> = (0..2).map(|i| WorkerId::new(i, 0)).collect();
        let policies: Vec<Box<dyn Policy>> = (0..2)
            .map(|_| {
                let policy = registry
                    .build(
                        "least_load",
                        &serde_json::json!({"prefix_affinity": false}),
                        &PolicyContext::default(),
                    )
                    .unwrap();
                for (index, id) in ids.iter().enumerate() {
                    policy.add_worker(*id, WorkerInfo::new(worker_url(index), "sglang"));
                }
                policy
            })
            .collect();
        let request = prefixed(7, 32);
        assert_eq!(policies[0].placement(&request), None);
        let mut channel = SyncChannel::new(SyncConfig::Ideal {}, 2, 2, 1).unwrap();
        let prefix = PrefixBlocks::new(16, vec![1, 2, 3]);
        channel.placed(0, 0, prefix, &policies, Instant::now());
        let stats = channel.stats();
        assert_eq!((stats.placements_applied, stats.prefix_unsupported), (0, 1));
    }

    #[test]
    fn nothing_to_share_without_sync_or_with_one_replica() {
        assert!(SyncChannel::new(SyncConfig::Off {}, 4, 2, 1).is_none());
        assert!(SyncChannel::new(SyncConfig::Ideal {}, 1, 2, 1).is_none());
        assert!(SyncChannel::new(periodic(0.02, 0.0, 0.0, 1.0), 1, 2, 1).is_none());
    }

    #[test]
    fn a_policy_that_ignores_other_replicas_stops_the_channel() {
        let registry = policy_registry();
        let ids = [WorkerId::new(0, 0)];
        let policies: Vec<Box<dyn Policy>> = (0..2)
            .map(|_| {
                let policy = registry
                    .build(
                        "round_robin",
                        &serde_json::Value::Null,
                        &PolicyContext::default(),
                    )
                    .unwrap();
                policy.add_worker(ids[0], WorkerInfo::new(worker_url(0), "sglang"));
                policy
            })
            .collect();
        let mut channel = SyncChannel::new(periodic(0.02, 0.0, 0.0, 1.0), 2, 1, 1).unwrap();
        let now = Instant::now();
        assert!(channel.tick(0, &policies, &ids, 0.0, now).is_some());
        assert!(channel.is_active());
        channel.deliver(&policies, now);
        assert!(!channel.is_active());
        assert_eq!(channel.stats().entries_unsupported, 1);
        assert_eq!(channel.tick(1, &policies, &ids, 0.02, now), None);
    }

    #[test]
    fn the_probe_tells_which_policies_count_other_replicas() {
        let registry = policy_registry();
        for (name, counts) in [
            (PolicyName::LeastLoad, true),
            (PolicyName::LeastLoadReportedRate, true),
            (PolicyName::LeastLoadFixedRate, true),
            (PolicyName::PowerOfTwo, true),
            (PolicyName::LeastLoadSincePoll, false),
            (PolicyName::RoundRobin, false),
            (PolicyName::Random, false),
            (PolicyName::LeastRequests, false),
            (PolicyName::CacheAware, false),
            (PolicyName::ConsistentHash, false),
            (PolicyName::Oracle, false),
            (PolicyName::LeastTrueQueue, false),
        ] {
            assert_eq!(counts_replica_pending(&registry, name), counts, "{name:?}");
        }
    }
}
