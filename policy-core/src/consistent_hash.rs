//! `consistent_hash`: consistent hashing on the prompt's leading blocks.
//!
//! Each worker owns `virtual_nodes` points on a 64-bit ring, placed by a hash
//! of its URL (so every router replica, and a restarted router, builds the
//! same ring). A request's key is the chained hash of its first
//! `prefix_hash_blocks` blocks (all its blocks if it has fewer); it goes to
//! the owner of the first point at or after the key, walking clockwise past
//! points whose worker is not a candidate. Adding or removing a worker moves
//! only the keys of the arcs it gains or loses. A request whose prefix is
//! unknown goes to the candidate with the fewest in-flight requests, ties to
//! the lowest slot. Load is not looked at otherwise (no bounded-load
//! variant).

use std::sync::Arc;
use std::time::Instant;

use arc_swap::ArcSwap;
use load_protocols::WorkerLoad;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::baseline::LedgerBook;
use crate::slots::{Slot, SlotsView, WorkerLedger, WorkerSlots};
use crate::splitmix::mix;
use crate::{
    Dispatch, Policy, PolicyContext, PolicyError, PollMark, PrefillSample, RequestInfo, ScoreRow,
    ScoreTable, WorkerId, WorkerInfo, WorkerStats, describe_request, parse_section, worker_url_key,
};

/// The registry name.
pub const CONSISTENT_HASH: &str = "consistent_hash";

/// At most this many points per worker: the ring is rebuilt on every
/// membership change and searched on every request.
pub const MAX_VIRTUAL_NODES: u32 = 10_000;

/// The `[consistent_hash]` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ConsistentHashParams {
    /// Ring points per worker; more points even out the workers' shares.
    /// 1 to [`MAX_VIRTUAL_NODES`].
    pub virtual_nodes: u32,
    /// How many leading blocks make the key. ≥ 1.
    pub prefix_hash_blocks: u32,
}

impl Default for ConsistentHashParams {
    fn default() -> ConsistentHashParams {
        ConsistentHashParams {
            // Ketama's count: each worker's share within a few per cent.
            virtual_nodes: 160,
            // 256 tokens at 16-token blocks (smg's `prefix_hash` keys on its
            // first 256 tokens): long enough to tell most unrelated prompts
            // apart, short enough that every turn of a conversation and
            // every question on a document share it.
            prefix_hash_blocks: 16,
        }
    }
}

impl ConsistentHashParams {
    pub fn validate(&self) -> Result<(), PolicyError> {
        let invalid = |key, value: u32, allowed| PolicyError::InvalidParameter {
            policy: CONSISTENT_HASH.to_owned(),
            key,
            value: value.to_string(),
            allowed,
        };
        if !(1..=MAX_VIRTUAL_NODES).contains(&self.virtual_nodes) {
            return Err(invalid(
                "virtual_nodes",
                self.virtual_nodes,
                "an integer from 1 to 10000",
            ));
        }
        if self.prefix_hash_blocks == 0 {
            return Err(invalid("prefix_hash_blocks", 0, "an integer ≥ 1"));
        }
        Ok(())
    }

    /// The ring key of a request, `None` if its prefix is unknown.
    pub fn key(&self, request: &RequestInfo) -> Option<u64> {
        let hashes = request.prefix.hashes();
        let blocks = hashes.len().min(self.prefix_hash_blocks as usize);
        // Hash `i` already names blocks `0..=i`: no need to combine them.
        let last = hashes.get(blocks.checked_sub(1)?)?;
        Some(mix(*last))
    }
}

/// One ring point of a worker: FNV-1a of its URL, then the point's index,
/// mixed. Stable across processes (std's hasher is randomly seeded).
fn point_of(url: &str, index: u32) -> u64 {
    let url_hash = worker_url_key(url)
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
            (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
        });
    mix(url_hash ^ mix(u64::from(index)))
}

/// The ring: every registered worker's points, sorted.
#[derive(Debug, Default)]
struct Ring {
    points: Vec<(u64, WorkerId)>,
}

impl Ring {
    fn build<'a>(slots: impl Iterator<Item = &'a Slot<WorkerLedger>>, virtual_nodes: u32) -> Ring {
        let mut points: Vec<(u64, WorkerId)> = slots
            .flat_map(|slot| {
                (0..virtual_nodes).map(move |index| (point_of(&slot.info.url, index), slot.id))
            })
            .collect();
        // Two workers with one URL share points: the lower id owns them.
        points.sort_unstable();
        Ring { points }
    }

    /// The workers in the order a walk from `key` meets them, each once.
    fn walk(&self, key: u64) -> impl Iterator<Item = WorkerId> + '_ {
        let start = self.points.partition_point(|(point, _)| *point < key);
        let (before, after) = self.points.split_at(start);
        let mut seen: Vec<WorkerId> = Vec::new();
        after
            .iter()
            .chain(before)
            .map(|(_, id)| *id)
            .filter(move |id| {
                if seen.contains(id) {
                    return false;
                }
                seen.push(*id);
                true
            })
    }
}

/// See the module documentation.
#[derive(Debug)]
pub struct ConsistentHashPolicy {
    params: ConsistentHashParams,
    workers: WorkerSlots<WorkerLedger>,
    ring: ArcSwap<Ring>,
    /// Serializes membership changes, so the ring published last is built
    /// from the slots as they were last changed.
    membership: Mutex<()>,
    book: LedgerBook,
}

impl ConsistentHashPolicy {
    pub fn new(params: ConsistentHashParams) -> Result<ConsistentHashPolicy, PolicyError> {
        params.validate()?;
        Ok(ConsistentHashPolicy {
            params,
            workers: WorkerSlots::new(),
            ring: ArcSwap::from_pointee(Ring::default()),
            membership: Mutex::new(()),
            book: LedgerBook::default(),
        })
    }

    /// Builds the policy from its config section (`null`: defaults). The
    /// policy is deterministic, so the context's seed is not used.
    pub fn from_section(
        section: &serde_json::Value,
        _context: &PolicyContext,
    ) -> Result<ConsistentHashPolicy, PolicyError> {
        ConsistentHashPolicy::new(parse_section(CONSISTENT_HASH, section)?)
    }

    pub fn parameters(&self) -> &ConsistentHashParams {
        &self.params
    }

    fn rebuild_ring(&self) {
        let ring = Ring::build(self.workers.read().iter(), self.params.virtual_nodes);
        self.ring.store(Arc::new(ring));
    }

    fn choose<'a>(
        &self,
        view: &'a SlotsView<'_, WorkerLedger>,
        candidates: &[WorkerId],
        request: &RequestInfo,
    ) -> Option<&'a Slot<WorkerLedger>> {
        match self.params.key(request) {
            Some(key) => self
                .ring
                .load()
                .walk(key)
                .filter(|id| candidates.contains(id))
                .find_map(|id| view.get(id)),
            None => candidates
                .iter()
                .filter_map(|id| view.get(*id))
                .min_by_key(|slot| (slot.state.stats().in_flight_requests, slot.id.slot())),
        }
    }
}

impl Policy for ConsistentHashPolicy {
    fn name(&self) -> &'static str {
        CONSISTENT_HASH
    }

    fn params(&self) -> serde_json::Value {
        serde_json::json!({
            "virtual_nodes": self.params.virtual_nodes,
            "prefix_hash_blocks": self.params.prefix_hash_blocks,
        })
    }

    fn add_worker(&self, id: WorkerId, info: WorkerInfo) {
        let _membership = self.membership.lock();
        self.workers.insert(id, info, WorkerLedger::new());
        self.rebuild_ring();
    }

    fn remove_worker(&self, id: WorkerId) {
        let _membership = self.membership.lock();
        if self.workers.remove(id).is_some() {
            self.rebuild_ring();
        }
    }

    fn select(
        &self,
        candidates: &[WorkerId],
        request: &RequestInfo,
        _now: Instant,
    ) -> Option<Dispatch> {
        let view = self.workers.read();
        let slot = self.choose(&view, candidates, request)?;
        let in_flight = slot.state.stats().in_flight_requests as f64;
        Some(self.book.dispatch(slot, request, in_flight))
    }

    fn first_token(&self, dispatch: &Dispatch, _now: Instant) -> Option<PrefillSample> {
        LedgerBook::first_token(&self.workers, dispatch);
        None
    }

    fn finish(&self, dispatch: &Dispatch, _now: Instant) {
        LedgerBook::finish(&self.workers, dispatch);
    }

    fn poll_started(&self, id: WorkerId, now: Instant) -> PollMark {
        self.book.poll_mark(&self.workers, id, now)
    }

    fn poll_completed(&self, _mark: PollMark, _load: Option<&WorkerLoad>, _now: Instant) {}

    fn poll_failed(&self, _mark: PollMark, _now: Instant) {}

    /// `ring_order` is the order in which the walk from the request's key
    /// meets each candidate (0: the key's owner; the rest are who would take
    /// it if the ones before were not candidates); NaN when the prefix is
    /// unknown.
    fn explain(&self, candidates: &[WorkerId], request: &RequestInfo, _now: Instant) -> ScoreTable {
        let key = self.params.key(request);
        let title = match key {
            Some(key) => format!("{}, key {key:#018x}", describe_request(request)),
            None => format!("{}, unknown prefix", describe_request(request)),
        };
        let mut table = ScoreTable::new(CONSISTENT_HASH, title, &["in_flight", "ring_order"]);
        let view = self.workers.read();
        let order: Vec<WorkerId> = match key {
            Some(key) => self
                .ring
                .load()
                .walk(key)
                .filter(|id| candidates.contains(id) && view.get(*id).is_some())
                .collect(),
            None => Vec::new(),
        };
        let choice = self.choose(&view, candidates, request);
        for slot in candidates.iter().filter_map(|id| view.get(*id)) {
            let rank = order.iter().position(|id| *id == slot.id);
            let chosen = choice.is_some_and(|c| c.id == slot.id);
            table.rows.push(ScoreRow {
                worker: slot.id,
                url: slot.info.url.clone(),
                values: vec![
                    slot.state.stats().in_flight_requests as f64,
                    rank.map_or(f64::NAN, |rank| rank as f64),
                ],
                note: match (chosen, key) {
                    (true, Some(_)) => "owns the key".to_owned(),
                    (true, None) => "unknown prefix: fewest in flight".to_owned(),
                    (false, _) => String::new(),
                },
            });
        }
        table.chosen = choice.map(|c| vec![c.id]).unwrap_or_default();
        table
    }

    fn worker_stats(&self, id: WorkerId) -> Option<WorkerStats> {
        self.workers.read().get(id).map(|slot| slot.state.stats())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TokenCount;

    use crate::test_support::{prompt, with_workers};

    fn policy(params: ConsistentHashParams, workers: u32) -> (ConsistentHashPolicy, Vec<WorkerId>) {
        with_workers(ConsistentHashPolicy::new(params).unwrap(), workers, ":8000")
    }

    fn owners(policy: &ConsistentHashPolicy, ids: &[WorkerId], keys: u64) -> Vec<WorkerId> {
        let now = Instant::now();
        (0..keys)
            .map(|root| {
                let dispatch = policy.select(ids, &prompt(root, 20), now).unwrap();
                policy.finish(&dispatch, now);
                dispatch.worker
            })
            .collect()
    }

    #[test]
    fn requests_sharing_the_leading_blocks_share_a_worker() {
        let params = ConsistentHashParams {
            prefix_hash_blocks: 4,
            ..ConsistentHashParams::default()
        };
        let (policy, ids) = policy(params, 8);
        let now = Instant::now();
        for root in 0..50 {
            let first = policy.select(&ids, &prompt(root, 4), now).unwrap();
            // Longer prompts on the same first 4 blocks: the same key.
            for blocks in [5, 40, 400] {
                let turn = policy.select(&ids, &prompt(root, blocks), now).unwrap();
                assert_eq!(turn.worker, first.worker, "prompt {root}, {blocks} blocks");
            }
        }
        // Shorter prompts key on what they have, which may differ.
        assert_eq!(policy.parameters().key(&prompt(3, 2)), Some(mix(3_000_001)));
    }

    #[test]
    fn keys_spread_over_the_workers() {
        let (policy, ids) = policy(ConsistentHashParams::default(), 8);
        let picks = owners(&policy, &ids, 8_000);
        for id in &ids {
            let share = picks.iter().filter(|pick| *pick == id).count();
            // 1000 expected; 160 points each keep every share within ±35%.
            assert!((650..=1_350).contains(&share), "{id}: {share}");
        }
    }

    #[test]
    fn removing_a_worker_moves_only_its_keys() {
        let (policy, ids) = policy(ConsistentHashParams::default(), 6);
        let before = owners(&policy, &ids, 3_000);
        policy.remove_worker(ids[2]);
        let after = owners(&policy, &ids, 3_000);
        let mut moved = 0;
        for (old, new) in before.iter().zip(&after) {
            if *old == ids[2] {
                assert_ne!(new, &ids[2]);
                moved += 1;
            } else {
                assert_eq!(old, new, "a key of a remaining worker moved");
            }
        }
        assert!(moved > 300, "worker 2 owned {moved} of 3000 keys");
        // Adding it back restores the original assignment exactly.
        policy.add_worker(ids[2], WorkerInfo::new("http://w2:8000", "sglang"));
        assert_eq!(owners(&policy, &ids, 3_000), before);
    }

    #[test]
    fn an_unhealthy_owner_passes_its_keys_to_the_next_point() {
        let (policy, ids) = policy(ConsistentHashParams::default(), 4);
        let now = Instant::now();
        let request = prompt(42, 20);
        let owner = policy.select(&ids, &request, now).unwrap().worker;
        let healthy: Vec<WorkerId> = ids.iter().copied().filter(|id| *id != owner).collect();
        let table = policy.explain(&ids, &request, now);
        assert_eq!(table.chosen, vec![owner]);
        assert_eq!(table.value(owner, "ring_order"), Some(0.0));
        let successor = *ids
            .iter()
            .find(|id| table.value(**id, "ring_order") == Some(1.0))
            .unwrap();
        let failover = policy.select(&healthy, &request, now).unwrap();
        assert_eq!(failover.worker, successor);
    }

    #[test]
    fn an_unknown_prefix_goes_to_the_fewest_in_flight() {
        let (policy, ids) = policy(ConsistentHashParams::default(), 3);
        let now = Instant::now();
        let unknown = RequestInfo::new(TokenCount::Exact(100));
        let a = policy.select(&ids, &unknown, now).unwrap();
        let b = policy.select(&ids, &unknown, now).unwrap();
        assert_eq!((a.worker, b.worker), (ids[0], ids[1]));
        policy.finish(&a, now);
        let c = policy.select(&ids, &unknown, now).unwrap();
        assert_eq!(c.worker, ids[0], "worker 0 was released");
        let table = policy.explain(&ids, &unknown, now);
        assert_eq!(table.chosen, vec![ids[2]]);
        insta::assert_snapshot!(table.to_string(), @r"
        policy: consistent_hash  request: 100 tokens (exact), unknown prefix
           worker  url             in_flight  ring_order  note
           0.0     http://w0:8000  1          NaN
           1.0     http://w1:8000  1          NaN
        *  2.0     http://w2:8000  0          NaN         unknown prefix: fewest in flight
        ");
    }

    #[test]
    fn no_candidate_no_dispatch() {
        let (policy, ids) = policy(ConsistentHashParams::default(), 2);
        let now = Instant::now();
        assert_eq!(policy.select(&[], &prompt(1, 4), now), None);
        assert_eq!(
            policy.select(&[WorkerId::new(5, 0)], &prompt(1, 4), now),
            None
        );
        policy.remove_worker(ids[0]);
        policy.remove_worker(ids[1]);
        assert_eq!(policy.select(&ids, &prompt(1, 4), now), None);
        assert!(policy.ring.load().points.is_empty());
    }

    #[test]
    fn bad_parameters_are_typed_errors() {
        let context = PolicyContext::default();
        for (section, key) in [
            (serde_json::json!({"virtual_nodes": 0}), "virtual_nodes"),
            (
                serde_json::json!({"virtual_nodes": 10_001}),
                "virtual_nodes",
            ),
            (
                serde_json::json!({"prefix_hash_blocks": 0}),
                "prefix_hash_blocks",
            ),
        ] {
            let err = ConsistentHashPolicy::from_section(&section, &context).unwrap_err();
            assert!(
                matches!(&err, PolicyError::InvalidParameter { key: got, .. } if *got == key),
                "{section}: {err}"
            );
        }
        let err = ConsistentHashPolicy::from_section(&serde_json::json!({"vnodes": 3}), &context)
            .unwrap_err();
        assert!(matches!(err, PolicyError::InvalidSection { .. }));
        let policy =
            ConsistentHashPolicy::from_section(&serde_json::Value::Null, &context).unwrap();
        assert_eq!(
            policy.params(),
            serde_json::json!({"virtual_nodes": 160, "prefix_hash_blocks": 16})
        );
    }
}
