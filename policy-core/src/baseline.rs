//! The baseline policies: `round_robin`, `random` and `least_requests`.
//!
//! They ignore load reports; each keeps its own live in-flight counts from
//! `select`/`finish`, so `least_requests` needs nothing from the router.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use load_protocols::WorkerLoad;
use serde::{Deserialize, Serialize};

use crate::rng::{ArgMin, TieBreaker};
use crate::slots::{Slot, SlotsView, WorkerLedger, WorkerSlots};
use crate::{
    Dispatch, Policy, PolicyContext, PolicyError, PollMark, PrefillSample, RequestInfo, ScoreRow,
    ScoreTable, TokenCount, WorkerId, WorkerInfo, WorkerStats, parse_section,
};

/// A worker state that keeps a [`WorkerLedger`] (the baselines' states).
pub(crate) trait HasLedger {
    fn ledger(&self) -> &WorkerLedger;
}

impl HasLedger for WorkerLedger {
    fn ledger(&self) -> &WorkerLedger {
        self
    }
}

/// What the baselines share: the dispatch and poll sequence numbers, and
/// the in-flight ledger kept through `select`, `first_token` and `finish`.
#[derive(Debug, Default)]
pub(crate) struct LedgerBook {
    next_dispatch: AtomicU64,
    next_poll: AtomicU64,
}

impl LedgerBook {
    /// Dispatches `request` to `slot` and credits it there. Baselines do
    /// not estimate prompts: an unknown size credits nothing.
    pub(crate) fn dispatch<S: HasLedger>(
        &self,
        slot: &Slot<S>,
        request: &RequestInfo,
        score: f64,
    ) -> Dispatch {
        let dispatch = Dispatch {
            worker: slot.id,
            tokens: request.tokens.or(0),
            seq: self.next_dispatch.fetch_add(1, Ordering::Relaxed),
            score,
            cached_tokens: 0,
        };
        slot.state.ledger().credit(dispatch.seq, dispatch.tokens);
        dispatch
    }

    pub(crate) fn first_token<S: HasLedger>(workers: &WorkerSlots<S>, dispatch: &Dispatch) {
        if let Some(slot) = workers.read().get(dispatch.worker) {
            slot.state.ledger().first_token(dispatch.seq);
        }
    }

    pub(crate) fn finish<S: HasLedger>(workers: &WorkerSlots<S>, dispatch: &Dispatch) {
        if let Some(slot) = workers.read().get(dispatch.worker) {
            slot.state.ledger().finish(dispatch.seq);
        }
    }

    pub(crate) fn poll_mark<S: HasLedger>(
        &self,
        workers: &WorkerSlots<S>,
        id: WorkerId,
        now: Instant,
    ) -> PollMark {
        let seq = self.next_poll.fetch_add(1, Ordering::Relaxed);
        match workers.read().get(id) {
            Some(slot) => slot.state.ledger().poll_mark(id, seq, now),
            None => WorkerLedger::new().poll_mark(id, seq, now),
        }
    }
}

/// Which baseline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BaselineKind {
    /// Each candidate in turn.
    RoundRobin,
    /// A uniform random candidate.
    Random,
    /// Join-shortest-queue on live in-flight requests, random ties.
    LeastRequests,
}

impl BaselineKind {
    pub const ALL: [BaselineKind; 3] = [
        BaselineKind::RoundRobin,
        BaselineKind::Random,
        BaselineKind::LeastRequests,
    ];

    pub fn name(self) -> &'static str {
        match self {
            BaselineKind::RoundRobin => "round_robin",
            BaselineKind::Random => "random",
            BaselineKind::LeastRequests => "least_requests",
        }
    }
}

/// The baselines have no knobs; their section must be empty.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BaselineParams {}

/// One of the baseline policies (see [`BaselineKind`]).
#[derive(Debug)]
pub struct BaselinePolicy {
    kind: BaselineKind,
    workers: WorkerSlots<WorkerLedger>,
    rng: TieBreaker,
    book: LedgerBook,
    rotation: AtomicU64,
}

impl BaselinePolicy {
    pub fn new(kind: BaselineKind, context: &PolicyContext) -> BaselinePolicy {
        BaselinePolicy {
            kind,
            workers: WorkerSlots::new(),
            rng: TieBreaker::new(context.rng_seed),
            book: LedgerBook::default(),
            rotation: AtomicU64::new(0),
        }
    }

    pub fn from_section(
        kind: BaselineKind,
        section: &serde_json::Value,
        context: &PolicyContext,
    ) -> Result<BaselinePolicy, PolicyError> {
        let BaselineParams {} = parse_section(kind.name(), section)?;
        Ok(BaselinePolicy::new(kind, context))
    }

    /// The candidate the policy would pick now, without crediting it.
    fn choose<'a>(
        &self,
        view: &'a SlotsView<'_, WorkerLedger>,
        candidates: &[WorkerId],
        rotation: u64,
    ) -> Option<&'a Slot<WorkerLedger>> {
        match self.kind {
            BaselineKind::RoundRobin => {
                let count = candidates.len() as u64;
                (0..count)
                    .map(|step| (rotation + step) % count)
                    .find_map(|index| view.get(candidates[index as usize]))
            }
            BaselineKind::Random | BaselineKind::LeastRequests => {
                let mut argmin = ArgMin::new();
                for slot in candidates.iter().filter_map(|id| view.get(*id)) {
                    argmin.offer(slot, self.score(slot), &self.rng);
                }
                argmin.best().map(|(slot, _)| slot)
            }
        }
    }

    fn score(&self, slot: &Slot<WorkerLedger>) -> f64 {
        match self.kind {
            BaselineKind::LeastRequests => slot.state.stats().in_flight_requests as f64,
            BaselineKind::RoundRobin | BaselineKind::Random => 0.0,
        }
    }
}

impl Policy for BaselinePolicy {
    fn name(&self) -> &'static str {
        self.kind.name()
    }

    fn params(&self) -> serde_json::Value {
        serde_json::json!({})
    }

    fn add_worker(&self, id: WorkerId, info: WorkerInfo) {
        self.workers.insert(id, info, WorkerLedger::new());
    }

    fn remove_worker(&self, id: WorkerId) {
        self.workers.remove(id);
    }

    fn select(
        &self,
        candidates: &[WorkerId],
        request: &RequestInfo,
        _now: Instant,
    ) -> Option<Dispatch> {
        if candidates.is_empty() {
            return None;
        }
        let view = self.workers.read();
        let rotation = match self.kind {
            BaselineKind::RoundRobin => self.rotation.fetch_add(1, Ordering::Relaxed),
            _ => 0,
        };
        let slot = self.choose(&view, candidates, rotation)?;
        Some(self.book.dispatch(slot, request, self.score(slot)))
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

    fn explain(&self, candidates: &[WorkerId], request: &RequestInfo, _now: Instant) -> ScoreTable {
        let mut table = ScoreTable::new(
            self.kind.name(),
            describe_request(request),
            &["in_flight", "pending_tokens"],
        );
        let view = self.workers.read();
        let registered: Vec<&Slot<WorkerLedger>> =
            candidates.iter().filter_map(|id| view.get(*id)).collect();
        for slot in &registered {
            let stats = slot.state.stats();
            table.rows.push(ScoreRow {
                worker: slot.id,
                url: slot.info.url.clone(),
                values: vec![stats.in_flight_requests as f64, stats.pending_tokens as f64],
                note: String::new(),
            });
        }
        table.chosen = match self.kind {
            BaselineKind::RoundRobin => self
                .choose(&view, candidates, self.rotation.load(Ordering::Relaxed))
                .map(|slot| vec![slot.id])
                .unwrap_or_default(),
            BaselineKind::Random | BaselineKind::LeastRequests => {
                let best = registered
                    .iter()
                    .map(|slot| self.score(slot))
                    .fold(f64::INFINITY, f64::min);
                registered
                    .iter()
                    .filter(|slot| self.score(slot) == best)
                    .map(|slot| slot.id)
                    .collect()
            }
        };
        table
    }

    fn worker_stats(&self, id: WorkerId) -> Option<WorkerStats> {
        self.workers.read().get(id).map(|slot| slot.state.stats())
    }
}

/// How a request reads in a score table's title.
pub fn describe_request(request: &RequestInfo) -> String {
    match request.tokens {
        TokenCount::Exact(tokens) => format!("{tokens} tokens (exact)"),
        TokenCount::Estimated(tokens) => format!("{tokens} tokens (estimated)"),
        TokenCount::Unknown => "unknown size".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fleet(kind: BaselineKind, workers: u32) -> (BaselinePolicy, Vec<WorkerId>) {
        let policy = BaselinePolicy::new(kind, &PolicyContext::default());
        let ids: Vec<WorkerId> = (0..workers).map(|slot| WorkerId::new(slot, 0)).collect();
        for id in &ids {
            policy.add_worker(
                *id,
                WorkerInfo::new(format!("http://w{}", id.slot()), "sglang"),
            );
        }
        (policy, ids)
    }

    fn request() -> RequestInfo {
        RequestInfo::new(TokenCount::Exact(100))
    }

    #[test]
    fn round_robin_takes_each_in_turn() {
        let (policy, ids) = fleet(BaselineKind::RoundRobin, 3);
        let now = Instant::now();
        let picks: Vec<u32> = (0..6)
            .map(|_| policy.select(&ids, &request(), now).unwrap().worker.slot() as u32)
            .collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
    }

    #[test]
    fn round_robin_skips_removed_workers() {
        let (policy, ids) = fleet(BaselineKind::RoundRobin, 3);
        policy.remove_worker(ids[1]);
        let now = Instant::now();
        for _ in 0..6 {
            let pick = policy.select(&ids, &request(), now).unwrap();
            assert_ne!(pick.worker, ids[1]);
        }
    }

    #[test]
    fn least_requests_joins_the_shortest_queue() {
        let (policy, ids) = fleet(BaselineKind::LeastRequests, 3);
        let now = Instant::now();
        let a = policy.select(&ids, &request(), now).unwrap();
        let b = policy.select(&ids, &request(), now).unwrap();
        let c = policy.select(&ids, &request(), now).unwrap();
        let mut slots = vec![a.worker.slot(), b.worker.slot(), c.worker.slot()];
        slots.sort_unstable();
        assert_eq!(slots, vec![0, 1, 2], "three idle workers get one each");
        policy.finish(&b, now);
        let d = policy.select(&ids, &request(), now).unwrap();
        assert_eq!(d.worker, b.worker, "the only worker with nothing in flight");
        let table = policy.explain(&ids, &request(), now);
        assert_eq!(table.value(a.worker, "in_flight"), Some(1.0));
        assert_eq!(table.chosen.len(), 3, "all three tied at one request");
    }

    #[test]
    fn random_spreads_over_all_workers() {
        let (policy, ids) = fleet(BaselineKind::Random, 4);
        let now = Instant::now();
        let mut counts = [0u32; 4];
        for _ in 0..4000 {
            let dispatch = policy.select(&ids, &request(), now).unwrap();
            counts[dispatch.worker.slot()] += 1;
            policy.finish(&dispatch, now);
        }
        // Expect 1000 each; 800 is far outside binomial noise (sd ≈ 27).
        assert!(counts.iter().all(|count| *count > 800), "{counts:?}");
    }

    #[test]
    fn no_candidates_or_only_unknown_ones_select_none() {
        for kind in BaselineKind::ALL {
            let (policy, _) = fleet(kind, 2);
            let now = Instant::now();
            assert_eq!(policy.select(&[], &request(), now), None);
            assert_eq!(policy.select(&[WorkerId::new(9, 0)], &request(), now), None);
            assert_eq!(policy.select(&[WorkerId::new(0, 1)], &request(), now), None);
        }
    }

    #[test]
    fn a_dispatch_of_a_removed_worker_does_not_touch_the_slots_next_occupant() {
        let policy = BaselinePolicy::new(BaselineKind::LeastRequests, &PolicyContext::default());
        let old = WorkerId::new(0, 0);
        policy.add_worker(old, WorkerInfo::new("http://old", "sglang"));
        let now = Instant::now();
        let stale = policy.select(&[old], &request(), now).unwrap();
        policy.remove_worker(old);

        let new = WorkerId::new(0, 1);
        policy.add_worker(new, WorkerInfo::new("http://new", "sglang"));
        let live = policy.select(&[new], &request(), now).unwrap();
        // Same sequence number space, same slot: only the generation differs.
        assert_eq!(stale.worker.slot(), live.worker.slot());

        policy.first_token(&stale, now);
        policy.finish(&stale, now);
        let stats = policy.worker_stats(new).unwrap();
        assert_eq!(
            stats.in_flight_requests, 1,
            "the old dispatch released nothing"
        );
        assert_eq!(stats.pending_tokens, 100);
        assert_eq!(policy.worker_stats(old), None);
        policy.finish(&live, now);
        assert_eq!(policy.worker_stats(new), Some(WorkerStats::default()));
    }

    #[test]
    fn explain_changes_nothing_and_renders() {
        let (policy, ids) = fleet(BaselineKind::RoundRobin, 2);
        let now = Instant::now();
        let first = policy.select(&ids, &request(), now).unwrap();
        let table = policy.explain(&ids, &request(), now);
        assert_eq!(table.chosen, vec![ids[1]], "next in turn");
        let again = policy.explain(&ids, &request(), now);
        assert_eq!(table, again, "explain does not advance the rotation");
        assert_eq!(table.value(first.worker, "pending_tokens"), Some(100.0));
        insta::assert_snapshot!(table.to_string(), @r"
        policy: round_robin  request: 100 tokens (exact)
           worker  url        in_flight  pending_tokens  note
           0.0     http://w0  1          100
        *  1.0     http://w1  0          0
        ");
    }
}
