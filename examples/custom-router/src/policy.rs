//! The `least_kv` policy: send each request to the worker whose KV cache
//! will be emptiest once this router's pending prompts land there, and keep
//! traffic off workers whose cache is nearly full.
//!
//! For each candidate:
//!
//! ```text
//! score = kv_usage + pending_weight · pending_tokens / capacity_tokens
//! ```
//!
//! - `kv_usage`: the KV-cache usage (0 to 1) of the worker's latest report,
//!   if it is fresh (younger than `load_monitor.stale_after_ms`); 0 without
//!   one, so a worker that cannot be seen is scored on pending work alone;
//! - `pending_tokens`: prompt tokens this router sent there whose first
//!   token it has not yet seen (exact, never stale);
//! - `capacity_tokens`: the worker's reported KV capacity in tokens (summed
//!   over ranks, where the backend reports it, as SGLang does), else the
//!   `kv_capacity_tokens` knob.
//!
//! A worker whose fresh report is above `max_kv_usage_ratio` is skipped,
//! unless every candidate is; the lowest score wins, exact ties at random.
//!
//! ```toml
//! [policy]
//! kind = "least_kv"
//!
//! [policy.least_kv]
//! max_kv_usage_ratio = 0.9    # (0, 1]
//! pending_weight = 1.0        # finite, >= 0; 0 ignores pending work
//! kv_capacity_tokens = 65536  # >= 1
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use load_protocols::WorkerLoad;
use parking_lot::Mutex;
use policy_core::{
    ArgMin, Dispatch, Policy, PolicyContext, PolicyError, PolicyRegistry, PollMark, PrefillSample,
    RequestInfo, ScoreRow, ScoreTable, Slot, SlotsView, TieBreaker, WorkerId, WorkerInfo,
    WorkerLedger, WorkerSlots, WorkerStats, describe_request, parse_section,
};
use serde::Deserialize;

/// The policy's registry name: `[policy] kind = "least_kv"`.
pub const POLICY_NAME: &str = "least_kv";

/// The knobs of `least_kv`, validated. The field names are the config keys
/// of `[policy.least_kv]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LeastKvParams {
    /// Workers whose reported KV usage is above this are skipped, unless
    /// every candidate is. In `(0, 1]`; 1 turns skipping off.
    pub max_kv_usage_ratio: f64,
    /// How much this router's pending prompt tokens count: 1 counts each as
    /// one token of KV cache (it will be one once the engine admits it), 0
    /// ignores them. Finite, ≥ 0.
    pub pending_weight: f64,
    /// KV capacity, in tokens, of a worker that does not report its own.
    /// ≥ 1.
    pub kv_capacity_tokens: u64,
}

impl Default for LeastKvParams {
    fn default() -> LeastKvParams {
        LeastKvParams {
            max_kv_usage_ratio: 0.9,
            pending_weight: 1.0,
            kv_capacity_tokens: 65_536,
        }
    }
}

/// The section as written: the capacity signed, so that a negative one is
/// reported as an invalid value of its key, not as a parse error. Unknown
/// keys are refused, and serde's message lists the valid ones.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawParams {
    max_kv_usage_ratio: f64,
    pending_weight: f64,
    kv_capacity_tokens: i64,
}

impl Default for RawParams {
    fn default() -> RawParams {
        let defaults = LeastKvParams::default();
        RawParams {
            max_kv_usage_ratio: defaults.max_kv_usage_ratio,
            pending_weight: defaults.pending_weight,
            kv_capacity_tokens: i64::try_from(defaults.kv_capacity_tokens).unwrap_or(i64::MAX),
        }
    }
}

impl LeastKvParams {
    /// Reads and validates a `[policy.least_kv]` section (`null` or `{}`:
    /// all defaults).
    pub fn from_section(section: &serde_json::Value) -> Result<LeastKvParams, PolicyError> {
        let raw: RawParams = parse_section(POLICY_NAME, section)?;
        let invalid = |key: &'static str, value: String, allowed: &'static str| {
            PolicyError::InvalidParameter {
                policy: POLICY_NAME.to_owned(),
                key,
                value,
                allowed,
            }
        };
        let ratio = raw.max_kv_usage_ratio;
        if !(ratio > 0.0 && ratio <= 1.0) {
            return Err(invalid(
                "max_kv_usage_ratio",
                ratio.to_string(),
                "a ratio in (0, 1]",
            ));
        }
        let weight = raw.pending_weight;
        if !(weight.is_finite() && weight >= 0.0) {
            return Err(invalid(
                "pending_weight",
                weight.to_string(),
                "a finite number >= 0",
            ));
        }
        let kv_capacity_tokens = u64::try_from(raw.kv_capacity_tokens)
            .ok()
            .filter(|tokens| *tokens >= 1)
            .ok_or_else(|| {
                invalid(
                    "kv_capacity_tokens",
                    raw.kv_capacity_tokens.to_string(),
                    "an integer number of tokens >= 1",
                )
            })?;
        Ok(LeastKvParams {
            max_kv_usage_ratio: ratio,
            pending_weight: weight,
            kv_capacity_tokens,
        })
    }

    /// The section these knobs are read from, as `/admin/policy` and
    /// `--print-config` show it.
    pub fn to_section(&self) -> serde_json::Value {
        serde_json::json!({
            "max_kv_usage_ratio": self.max_kv_usage_ratio,
            "pending_weight": self.pending_weight,
            "kv_capacity_tokens": self.kv_capacity_tokens,
        })
    }
}

/// What the policy keeps of one worker's latest report.
#[derive(Debug, Clone, Copy, PartialEq)]
struct KvReport {
    kv_usage_ratio: f64,
    /// Summed over ranks; `None` when the backend does not report it.
    capacity_tokens: Option<u64>,
    received_at: Instant,
}

#[derive(Debug, Default)]
struct ReportCell {
    report: Option<KvReport>,
    /// The newest poll applied, so an older overlapping poll cannot
    /// overwrite a newer report.
    newest_poll: Option<u64>,
    /// Polls failed since the last one that answered, for `explain`.
    failed_polls: u32,
}

/// Per-worker state: this router's live work there, and its latest report.
#[derive(Debug, Default)]
struct WorkerState {
    ledger: WorkerLedger,
    report: Mutex<ReportCell>,
}

/// One candidate, scored.
#[derive(Debug, Clone, Copy)]
struct Assessment {
    /// From a fresh report; `None` without one.
    kv_usage_ratio: Option<f64>,
    pending_tokens: u64,
    capacity_tokens: u64,
    score: f64,
    over_limit: bool,
    failed_polls: u32,
}

/// The `least_kv` policy (see the module documentation).
#[derive(Debug)]
pub struct LeastKvPolicy {
    params: LeastKvParams,
    stale_after: Duration,
    workers: WorkerSlots<WorkerState>,
    rng: TieBreaker,
    next_dispatch: AtomicU64,
    next_poll: AtomicU64,
}

impl LeastKvPolicy {
    pub fn new(params: LeastKvParams, context: &PolicyContext) -> LeastKvPolicy {
        LeastKvPolicy {
            params,
            stale_after: context.stale_after,
            workers: WorkerSlots::new(),
            rng: TieBreaker::new(context.rng_seed),
            next_dispatch: AtomicU64::new(0),
            next_poll: AtomicU64::new(0),
        }
    }

    /// Builds the policy from its config section; what the registry calls.
    pub fn from_section(
        section: &serde_json::Value,
        context: &PolicyContext,
    ) -> Result<LeastKvPolicy, PolicyError> {
        Ok(LeastKvPolicy::new(
            LeastKvParams::from_section(section)?,
            context,
        ))
    }

    pub fn params(&self) -> LeastKvParams {
        self.params
    }

    fn assess(&self, state: &WorkerState, now: Instant) -> Assessment {
        let (report, failed_polls) = {
            let cell = state.report.lock();
            (cell.report, cell.failed_polls)
        };
        let fresh = report
            .filter(|report| now.saturating_duration_since(report.received_at) <= self.stale_after);
        let kv_usage_ratio = fresh.map(|report| report.kv_usage_ratio);
        let capacity_tokens = fresh
            .and_then(|report| report.capacity_tokens)
            .unwrap_or(self.params.kv_capacity_tokens);
        let pending_tokens = state.ledger.stats().pending_tokens;
        let kv = kv_usage_ratio.unwrap_or(0.0);
        Assessment {
            kv_usage_ratio,
            pending_tokens,
            capacity_tokens,
            score: kv + self.params.pending_weight * pending_tokens as f64 / capacity_tokens as f64,
            over_limit: kv > self.params.max_kv_usage_ratio,
            failed_polls,
        }
    }

    /// The winner among `candidates` (exact ties at random) and whether it
    /// had to come from over the limit because every candidate was.
    fn choose<'a>(
        &self,
        view: &'a SlotsView<'_, WorkerState>,
        candidates: &[WorkerId],
        now: Instant,
    ) -> Option<(&'a Slot<WorkerState>, f64)> {
        let mut under_limit = ArgMin::new();
        let mut any = ArgMin::new();
        for slot in candidates.iter().filter_map(|id| view.get(*id)) {
            let assessment = self.assess(&slot.state, now);
            if !assessment.over_limit {
                under_limit.offer(slot, assessment.score, &self.rng);
            }
            any.offer(slot, assessment.score, &self.rng);
        }
        under_limit.best().or_else(|| any.best())
    }
}

impl Policy for LeastKvPolicy {
    fn name(&self) -> &'static str {
        POLICY_NAME
    }

    fn params(&self) -> serde_json::Value {
        self.params.to_section()
    }

    fn add_worker(&self, id: WorkerId, info: WorkerInfo) {
        self.workers.insert(id, info, WorkerState::default());
    }

    fn remove_worker(&self, id: WorkerId) {
        self.workers.remove(id);
    }

    fn select(
        &self,
        candidates: &[WorkerId],
        request: &RequestInfo,
        now: Instant,
    ) -> Option<Dispatch> {
        let view = self.workers.read();
        let (slot, score) = self.choose(&view, candidates, now)?;
        let dispatch = Dispatch {
            worker: slot.id,
            // A request of unknown size adds no pending work.
            tokens: request.tokens.or(0),
            seq: self.next_dispatch.fetch_add(1, Ordering::Relaxed),
            score,
            cached_tokens: 0,
        };
        slot.state.ledger.credit(dispatch.seq, dispatch.tokens);
        Some(dispatch)
    }

    /// Releases the pending work; this policy learns no rates, so it has no
    /// first token to share.
    fn first_token(&self, dispatch: &Dispatch, _now: Instant) -> Option<PrefillSample> {
        if let Some(slot) = self.workers.read().get(dispatch.worker) {
            slot.state.ledger.first_token(dispatch.seq);
        }
        None
    }

    fn finish(&self, dispatch: &Dispatch, _now: Instant) {
        if let Some(slot) = self.workers.read().get(dispatch.worker) {
            slot.state.ledger.finish(dispatch.seq);
        }
    }

    fn poll_started(&self, id: WorkerId, now: Instant) -> PollMark {
        let seq = self.next_poll.fetch_add(1, Ordering::Relaxed);
        match self.workers.read().get(id) {
            Some(slot) => slot.state.ledger.poll_mark(id, seq, now),
            None => WorkerLedger::new().poll_mark(id, seq, now),
        }
    }

    fn poll_completed(&self, mark: PollMark, load: Option<&WorkerLoad>, now: Instant) {
        let view = self.workers.read();
        let Some(slot) = view.get(mark.worker) else {
            return;
        };
        let mut cell = slot.state.report.lock();
        if cell.newest_poll.is_some_and(|newest| newest > mark.seq) {
            return;
        }
        cell.newest_poll = Some(mark.seq);
        cell.failed_polls = 0;
        // `None` is "no report this time": nothing to score the worker by.
        cell.report = load.map(|load| {
            let capacity_tokens: u64 = load
                .ranks()
                .iter()
                .map(|rank| u64::try_from(rank.max_total_num_tokens).unwrap_or(0))
                .sum();
            KvReport {
                kv_usage_ratio: load.kv_usage_ratio(),
                capacity_tokens: (capacity_tokens > 0).then_some(capacity_tokens),
                received_at: load.observed().unwrap_or(now),
            }
        });
    }

    /// The last report is kept until it is older than `stale_after`; the
    /// failures are counted for `explain`.
    fn poll_failed(&self, mark: PollMark, _now: Instant) {
        if let Some(slot) = self.workers.read().get(mark.worker) {
            let mut cell = slot.state.report.lock();
            cell.failed_polls = cell.failed_polls.saturating_add(1);
        }
    }

    fn explain(&self, candidates: &[WorkerId], request: &RequestInfo, now: Instant) -> ScoreTable {
        let mut table = ScoreTable::new(
            POLICY_NAME,
            describe_request(request),
            &["kv_usage", "pending_tokens", "capacity_tokens", "score"],
        );
        let view = self.workers.read();
        let assessed: Vec<(&Slot<WorkerState>, Assessment)> = candidates
            .iter()
            .filter_map(|id| view.get(*id))
            .map(|slot| (slot, self.assess(&slot.state, now)))
            .collect();
        let all_over = assessed.iter().all(|(_, assessment)| assessment.over_limit);
        for (slot, assessment) in &assessed {
            let note = match (assessment.kv_usage_ratio, assessment.over_limit) {
                (None, _) if assessment.failed_polls > 0 => format!(
                    "no fresh report ({} polls failed): kv usage taken as 0",
                    assessment.failed_polls
                ),
                (None, _) => "no fresh report: kv usage taken as 0".to_owned(),
                (Some(_), true) if all_over => {
                    "over max_kv_usage_ratio, as is every worker".to_owned()
                }
                (Some(_), true) => "over max_kv_usage_ratio: skipped".to_owned(),
                (Some(_), false) => "fresh report".to_owned(),
            };
            table.rows.push(ScoreRow {
                worker: slot.id,
                url: slot.info.url.clone(),
                values: vec![
                    assessment.kv_usage_ratio.unwrap_or(0.0),
                    assessment.pending_tokens as f64,
                    assessment.capacity_tokens as f64,
                    assessment.score,
                ],
                note,
            });
        }
        let considered = |assessment: &Assessment| all_over || !assessment.over_limit;
        let best = assessed
            .iter()
            .filter(|(_, assessment)| considered(assessment))
            .map(|(_, assessment)| assessment.score)
            .fold(f64::INFINITY, f64::min);
        table.chosen = assessed
            .iter()
            .filter(|(_, assessment)| considered(assessment) && assessment.score == best)
            .map(|(slot, _)| slot.id)
            .collect();
        table
    }

    fn worker_stats(&self, id: WorkerId) -> Option<WorkerStats> {
        self.workers
            .read()
            .get(id)
            .map(|slot| slot.state.ledger.stats())
    }
}

/// Registers `least_kv`, built from its `[policy.least_kv]` section.
pub fn register_policy(registry: &mut PolicyRegistry) {
    registry.register(POLICY_NAME, |section, context| {
        LeastKvPolicy::from_section(section, context)
            .map(|policy| Box::new(policy) as Box<dyn Policy>)
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use load_protocols::SchedulerLoadSnapshot;
    use policy_core::TokenCount;
    use std::error::Error as _;

    fn policy(section: serde_json::Value) -> (LeastKvPolicy, Vec<WorkerId>) {
        let policy = LeastKvPolicy::from_section(&section, &PolicyContext::default()).unwrap();
        let ids: Vec<WorkerId> = (0..3).map(|slot| WorkerId::new(slot, 0)).collect();
        for id in &ids {
            policy.add_worker(
                *id,
                WorkerInfo::new(format!("http://w{}", id.slot()), "jsonstats"),
            );
        }
        (policy, ids)
    }

    fn report(policy: &LeastKvPolicy, id: WorkerId, kv_usage_ratio: f64, now: Instant) {
        let load = WorkerLoad::from_ranks(vec![SchedulerLoadSnapshot {
            token_usage: kv_usage_ratio,
            ..SchedulerLoadSnapshot::default()
        }])
        .unwrap()
        .observed_at(now);
        let mark = policy.poll_started(id, now);
        policy.poll_completed(mark, Some(&load), now);
    }

    fn tokens(count: u64) -> RequestInfo {
        RequestInfo::new(TokenCount::Exact(count))
    }

    #[test]
    fn knobs_default_and_validate() {
        let defaults = LeastKvParams::from_section(&serde_json::Value::Null).unwrap();
        assert_eq!(defaults, LeastKvParams::default());
        assert_eq!(
            LeastKvParams::from_section(&serde_json::json!({})).unwrap(),
            defaults
        );
        let set = serde_json::json!({"max_kv_usage_ratio": 0.5, "pending_weight": 0.0, "kv_capacity_tokens": 10});
        let params = LeastKvParams::from_section(&set).unwrap();
        assert_eq!(params.to_section(), set, "the section round-trips");
        for (section, message) in [
            (
                serde_json::json!({"max_kv_usage_ratio": 1.5}),
                "least_kv.max_kv_usage_ratio = 1.5 is invalid: must be a ratio in (0, 1]",
            ),
            (
                serde_json::json!({"max_kv_usage_ratio": 0.0}),
                "least_kv.max_kv_usage_ratio = 0 is invalid: must be a ratio in (0, 1]",
            ),
            (
                serde_json::json!({"pending_weight": -1.0}),
                "least_kv.pending_weight = -1 is invalid: must be a finite number >= 0",
            ),
            (
                serde_json::json!({"kv_capacity_tokens": 0}),
                "least_kv.kv_capacity_tokens = 0 is invalid: must be an integer number of tokens >= 1",
            ),
        ] {
            let error = LeastKvParams::from_section(&section).unwrap_err();
            assert_eq!(error.to_string(), message);
        }
        let error = LeastKvParams::from_section(&serde_json::json!({"max_kv": 0.9})).unwrap_err();
        assert_eq!(error.to_string(), "invalid [least_kv] section");
        let cause = error.source().unwrap().to_string();
        assert!(
            cause.contains(
                "unknown field `max_kv`, expected one of `max_kv_usage_ratio`, `pending_weight`, `kv_capacity_tokens`"
            ),
            "{cause}"
        );
    }

    #[test]
    fn the_least_used_cache_wins_and_full_ones_are_skipped() {
        let (policy, ids) = policy(serde_json::json!({"max_kv_usage_ratio": 0.9}));
        let now = Instant::now();
        report(&policy, ids[0], 0.5, now);
        report(&policy, ids[1], 0.3, now);
        report(&policy, ids[2], 0.95, now);
        let chosen = policy.select(&ids, &tokens(0), now).unwrap();
        assert_eq!(chosen.worker, ids[1]);
        assert!((chosen.score - 0.3).abs() < 1e-12);
        policy.finish(&chosen, now);

        // Every worker over the limit: the least used of them still serves.
        report(&policy, ids[0], 0.99, now);
        report(&policy, ids[1], 0.97, now);
        assert_eq!(policy.select(&ids, &tokens(0), now).unwrap().worker, ids[2]);
        let table = policy.explain(&ids, &tokens(0), now);
        assert_eq!(table.chosen, vec![ids[2]]);
        assert_eq!(
            table.row(ids[0]).unwrap().note,
            "over max_kv_usage_ratio, as is every worker"
        );
    }

    #[test]
    fn pending_work_spreads_requests_until_the_limit() {
        // Pending tokens count against a 1000-token cache: 400 tokens is 0.4.
        let (policy, ids) = policy(serde_json::json!({
            "max_kv_usage_ratio": 0.6, "pending_weight": 1.0, "kv_capacity_tokens": 1000
        }));
        let now = Instant::now();
        report(&policy, ids[0], 0.1, now);
        report(&policy, ids[1], 0.1, now);
        report(&policy, ids[2], 0.7, now);
        let held: Vec<Dispatch> = (0..6)
            .map(|_| policy.select(&ids, &tokens(400), now).unwrap())
            .collect();
        assert!(
            held.iter().all(|dispatch| dispatch.worker != ids[2]),
            "over the limit: skipped however busy the others get"
        );
        assert_eq!(policy.worker_stats(ids[0]).unwrap().pending_tokens, 1200);
        let table = policy.explain(&ids, &tokens(400), now);
        assert_eq!(
            table.row(ids[2]).unwrap().note,
            "over max_kv_usage_ratio: skipped"
        );
        assert_eq!(table.value(ids[0], "score"), Some(1.3));
        for dispatch in &held {
            policy.first_token(dispatch, now);
        }
        assert_eq!(policy.worker_stats(ids[0]).unwrap().pending_tokens, 0);
        assert_eq!(policy.worker_stats(ids[0]).unwrap().in_flight_requests, 3);
        for dispatch in &held {
            policy.finish(dispatch, now);
            policy.finish(dispatch, now);
        }
        assert_eq!(policy.worker_stats(ids[0]), Some(WorkerStats::default()));

        // With skipping off, the same load sends the fifth request to ids[2].
        let (policy, ids) = policy_with_limit_off();
        report(&policy, ids[0], 0.1, now);
        report(&policy, ids[1], 0.1, now);
        report(&policy, ids[2], 0.7, now);
        let picks: Vec<WorkerId> = (0..5)
            .map(|_| policy.select(&ids, &tokens(400), now).unwrap().worker)
            .collect();
        assert_eq!(picks[4], ids[2], "{picks:?}");
    }

    fn policy_with_limit_off() -> (LeastKvPolicy, Vec<WorkerId>) {
        policy(serde_json::json!({
            "max_kv_usage_ratio": 1.0, "pending_weight": 1.0, "kv_capacity_tokens": 1000
        }))
    }

    #[test]
    fn stale_reports_and_older_polls_do_not_count() {
        let (policy, ids) = policy(serde_json::Value::Null);
        let now = Instant::now();
        // An older poll that completes after a newer one is ignored.
        let older = policy.poll_started(ids[0], now);
        report(&policy, ids[0], 0.2, now);
        let full = WorkerLoad::from_ranks(vec![SchedulerLoadSnapshot {
            token_usage: 1.0,
            ..SchedulerLoadSnapshot::default()
        }])
        .unwrap();
        policy.poll_completed(older, Some(&full), now);
        let table = policy.explain(&ids[..1], &tokens(0), now);
        assert_eq!(table.value(ids[0], "kv_usage"), Some(0.2));

        // Past stale_after (3 s by default) the report no longer counts.
        policy.poll_failed(policy.poll_started(ids[0], now), now);
        let later = now + Duration::from_secs(4);
        let table = policy.explain(&ids[..1], &tokens(0), later);
        assert_eq!(table.value(ids[0], "kv_usage"), Some(0.0));
        assert_eq!(
            table.row(ids[0]).unwrap().note,
            "no fresh report (1 polls failed): kv usage taken as 0"
        );
        // Removed and unknown workers are never chosen.
        policy.remove_worker(ids[0]);
        assert_eq!(policy.select(&ids[..1], &tokens(0), now), None);
        assert_eq!(policy.select(&[], &tokens(0), now), None);
        assert_eq!(policy.worker_stats(ids[0]), None);
    }

    #[test]
    fn a_reported_capacity_replaces_the_knob() {
        let (policy, ids) = policy(serde_json::json!({"kv_capacity_tokens": 1000}));
        let now = Instant::now();
        let load = WorkerLoad::from_ranks(vec![SchedulerLoadSnapshot {
            max_total_num_tokens: 4000,
            ..SchedulerLoadSnapshot::default()
        }])
        .unwrap();
        policy.poll_completed(policy.poll_started(ids[0], now), Some(&load), now);
        let table = policy.explain(&ids[..2], &tokens(0), now);
        assert_eq!(table.value(ids[0], "capacity_tokens"), Some(4000.0));
        assert_eq!(table.value(ids[1], "capacity_tokens"), Some(1000.0));
    }

    #[test]
    fn the_registry_builds_it_by_name() {
        let mut registry = PolicyRegistry::with_baselines();
        register_policy(&mut registry);
        assert_eq!(
            registry.names(),
            [
                "cache_aware",
                "consistent_hash",
                "least_kv",
                "least_requests",
                "random",
                "round_robin"
            ]
        );
        let built = registry
            .build(
                POLICY_NAME,
                &serde_json::json!({"pending_weight": 2.0}),
                &PolicyContext::default(),
            )
            .unwrap();
        assert_eq!(built.name(), "least_kv");
        assert_eq!(built.params()["pending_weight"], 2.0);
    }
}
