//! The expected-wait score as a pure function.
//!
//! ```text
//! score = (queued_tokens + inflight_tokens) / throughput
//!         + kv_pressure_weight * k / (1 - k)
//! ```
//!
//! Both terms are seconds; lower is better. The work is split in two so that
//! the request hot path does as little as possible: [`SnapshotTerms::new`]
//! runs once per received report (the queue estimate, the subtraction of our
//! own pending work at poll start, the throughput fallback, the KV barrier),
//! and [`score`] combines those terms with the live in-flight tokens at each
//! selection. [`score_worker`] is the two together.

use std::fmt;

use load_protocols::WorkerLoad;

use crate::{LeastLoadParams, RateMode};

/// `k` is clamped below 1 so that the barrier `k / (1 - k)` stays finite.
pub const MAX_KV_USAGE_RATIO: f64 = 0.999;

/// The signals of one load report that the score reads.
///
/// Built from a validated [`WorkerLoad`]; the fields are public so tests can
/// feed values no adapter would let through (NaN, infinities), which the
/// score must still survive.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadSummary {
    /// Uncached queued token-work; `None` when the backend does not report it.
    pub queued_tokens: Option<u64>,
    pub waiting_requests: u64,
    /// Generation rate summed over DP ranks; `None` when not reported.
    pub throughput_tps: Option<f64>,
    /// KV-cache usage, mean over DP ranks.
    pub kv_usage_ratio: f64,
}

impl From<&WorkerLoad> for LoadSummary {
    fn from(load: &WorkerLoad) -> LoadSummary {
        LoadSummary {
            queued_tokens: load.queued_tokens(),
            waiting_requests: load.waiting_requests(),
            throughput_tps: load.throughput_tps(),
            kv_usage_ratio: load.kv_usage_ratio(),
        }
    }
}

/// This router's pending work on one worker at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PendingWork {
    pub tokens: u64,
    pub requests: u64,
}

/// Where a snapshot's queued term came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueSource {
    /// `num_waiting_uncached_tokens` was reported; trusted, 0 included.
    Reported,
    /// Not reported: waiting requests × `mean_prefill_tokens` (rule 1).
    Estimated,
}

/// Where a worker's rate (the divisor) came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThroughputSource {
    /// Reported by the worker (`rate = "reported"`).
    Reported,
    /// `default_throughput`: `rate = "fixed"`, a reported rate missing or
    /// zero (rule 2), or a learned rate with no estimate to read.
    Default,
    /// Learned from this router's dispatches (`rate = "learned"`).
    Learned,
}

/// Which degradation rule the score followed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// A fresh snapshot; rules 1 and 2 may still have filled in a signal.
    Fresh {
        queue: QueueSource,
        throughput: ThroughputSource,
    },
    /// Rule 3: no fresh snapshot while other candidates have one. Queue 0,
    /// barrier 0, pending work at the candidates' nominal throughput.
    NoFreshSnapshot,
    /// Rule 4: no candidate has a fresh snapshot: join-shortest-queue on
    /// pending token-work.
    DarkFleet,
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = match self {
            Rule::Fresh { queue, throughput } => {
                let estimated = *queue == QueueSource::Estimated;
                let default = *throughput == ThroughputSource::Default;
                match (estimated, default) {
                    (false, false) => "fresh",
                    (true, false) => "fresh; rule 1: queue = waiting x mean_prefill",
                    (false, true) => "fresh; rule 2: default throughput",
                    (true, true) => {
                        "fresh; rules 1+2: queue = waiting x mean_prefill, default throughput"
                    }
                }
            }
            Rule::NoFreshSnapshot => "rule 3: no fresh snapshot, queue unknown",
            Rule::DarkFleet => "rule 4: no fresh snapshot in fleet, pending work only",
        };
        f.write_str(text)
    }
}

/// The terms one fresh snapshot fixes until the next one arrives.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SnapshotTerms {
    /// Queue not sent by this router: reported (or estimated) minus our
    /// pending work when the poll was sent, floored at 0.
    pub queued_tokens: u64,
    pub queue: QueueSource,
    /// Finite and > 0.
    pub throughput_tps: f64,
    pub throughput: ThroughputSource,
    /// `k`, in `[0, MAX_KV_USAGE_RATIO]`.
    pub kv_usage_ratio: f64,
    /// `kv_pressure_weight * k / (1 - k)`, seconds.
    pub kv_barrier_secs: f64,
}

impl SnapshotTerms {
    /// The terms of `load`, given our pending work when its poll was sent
    /// (`PendingWork::default()` to subtract nothing, as `since_poll` does).
    pub fn new(
        load: &LoadSummary,
        at_poll_start: PendingWork,
        params: &LeastLoadParams,
    ) -> SnapshotTerms {
        // Our own pending work is part of the engine's queue; only the rest is
        // other routers' and clients' traffic. The floor keeps a prefix-cache
        // overshoot (we count whole prompts, the engine uncached ones) safe.
        let (queued_tokens, queue) = match load.queued_tokens {
            Some(tokens) => (
                tokens.saturating_sub(at_poll_start.tokens),
                QueueSource::Reported,
            ),
            None => (
                load.waiting_requests
                    .saturating_sub(at_poll_start.requests)
                    .saturating_mul(params.mean_prefill_tokens.max(1)),
                QueueSource::Estimated,
            ),
        };
        let default_tps = valid_throughput(params.default_throughput).unwrap_or(1.0);
        let reported_tps = load
            .throughput_tps
            .filter(|_| params.rate == RateMode::Reported)
            .and_then(valid_throughput);
        let (throughput_tps, throughput) = match reported_tps {
            Some(tps) => (tps, ThroughputSource::Reported),
            None => (default_tps, ThroughputSource::Default),
        };
        let kv_usage_ratio = if load.kv_usage_ratio.is_finite() {
            load.kv_usage_ratio.clamp(0.0, MAX_KV_USAGE_RATIO)
        } else {
            0.0
        };
        let weight = if params.kv_pressure_weight.is_finite() {
            params.kv_pressure_weight.max(0.0)
        } else {
            0.0
        };
        let kv_barrier_secs = weight * kv_usage_ratio / (1.0 - kv_usage_ratio);
        SnapshotTerms {
            queued_tokens,
            queue,
            throughput_tps,
            throughput,
            kv_usage_ratio,
            kv_barrier_secs,
        }
    }
}

/// What the candidates as a whole contribute to one worker's score.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fleet {
    /// Mean of the positive reported throughputs among candidates with a
    /// fresh snapshot, else `default_throughput`: the rate a worker without a
    /// snapshot is assumed to drain at (rule 3).
    pub nominal_throughput_tps: f64,
    /// Whether any candidate has a fresh snapshot (rule 4 when none does).
    pub any_fresh: bool,
}

impl Fleet {
    /// The fleet from the reported throughputs of its fresh candidates.
    pub fn new(
        any_fresh: bool,
        reported_throughputs_tps: impl IntoIterator<Item = f64>,
        params: &LeastLoadParams,
    ) -> Fleet {
        let mut mean = MeanThroughput::default();
        for tps in reported_throughputs_tps {
            mean.add(tps);
        }
        mean.fleet(any_fresh, params)
    }
}

/// Accumulates the candidates' reported rates without allocating.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MeanThroughput {
    sum_tps: f64,
    count: u32,
}

impl MeanThroughput {
    /// Counts `tps` if it is a usable rate (finite, > 0).
    pub fn add(&mut self, tps: f64) {
        if let Some(tps) = valid_throughput(tps) {
            self.sum_tps += tps;
            self.count = self.count.saturating_add(1);
        }
    }

    pub fn fleet(self, any_fresh: bool, params: &LeastLoadParams) -> Fleet {
        let mean_tps = (self.count > 0).then(|| self.sum_tps / f64::from(self.count));
        Fleet {
            nominal_throughput_tps: mean_tps
                .and_then(valid_throughput)
                .or_else(|| valid_throughput(params.default_throughput))
                .unwrap_or(1.0),
            any_fresh,
        }
    }
}

/// One worker's score and every term of it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScoreBreakdown {
    pub queued_tokens: u64,
    pub inflight_tokens: u64,
    /// The request's own tokens, counted under `rate = "learned"`: its own
    /// prefill takes longer on a slower worker.
    pub request_tokens: u64,
    pub throughput_tps: f64,
    pub kv_usage_ratio: f64,
    /// `(queued + inflight + request) / throughput`.
    pub drain_secs: f64,
    pub kv_barrier_secs: f64,
    /// Always finite.
    pub score_secs: f64,
    pub rule: Rule,
}

/// Scores one worker: `terms` of its fresh snapshot (`None` without one),
/// this router's in-flight tokens on it, the request's own tokens (0 to
/// leave them out), and, under `rate = "learned"`, its learned rate (`None`:
/// no estimate, so `default_throughput`).
pub fn score(
    terms: Option<&SnapshotTerms>,
    inflight_tokens: u64,
    request_tokens: u64,
    learned_tps: Option<f64>,
    fleet: Fleet,
    params: &LeastLoadParams,
) -> ScoreBreakdown {
    let (queued_tokens, mut throughput_tps, kv_usage_ratio, kv_barrier_secs, mut rule) = match terms
    {
        Some(terms) => (
            terms.queued_tokens,
            terms.throughput_tps,
            terms.kv_usage_ratio,
            terms.kv_barrier_secs,
            Rule::Fresh {
                queue: terms.queue,
                throughput: terms.throughput,
            },
        ),
        None => (
            0,
            fleet.nominal_throughput_tps,
            0.0,
            0.0,
            if fleet.any_fresh {
                Rule::NoFreshSnapshot
            } else {
                Rule::DarkFleet
            },
        ),
    };
    if params.rate == RateMode::Learned {
        // The worker's own rate, with or without a snapshot: its pending
        // work stays comparable, in seconds, with everyone else's.
        let learned = learned_tps.and_then(valid_throughput);
        throughput_tps = learned.unwrap_or(params.default_throughput);
        if let Rule::Fresh { queue, .. } = rule {
            rule = Rule::Fresh {
                queue,
                throughput: if learned.is_some() {
                    ThroughputSource::Learned
                } else {
                    ThroughputSource::Default
                },
            };
        }
    }
    let throughput_tps = valid_throughput(throughput_tps)
        .or_else(|| valid_throughput(params.default_throughput))
        .unwrap_or(1.0);
    let kv_barrier_secs = finite_or_max(kv_barrier_secs.max(0.0));
    let ahead_tokens = inflight_tokens.saturating_add(request_tokens);
    ScoreBreakdown {
        queued_tokens,
        inflight_tokens,
        request_tokens,
        throughput_tps,
        kv_usage_ratio,
        drain_secs: drain_secs(queued_tokens, ahead_tokens, throughput_tps),
        kv_barrier_secs,
        score_secs: wait_secs(queued_tokens, ahead_tokens, throughput_tps, kv_barrier_secs),
        rule,
    }
}

fn drain_secs(queued_tokens: u64, inflight_tokens: u64, throughput_tps: f64) -> f64 {
    // Summed in f64: two u64 near the top would overflow as integers.
    (queued_tokens as f64 + inflight_tokens as f64) / throughput_tps
}

/// The score from terms already checked (throughput finite and > 0, barrier
/// finite and >= 0): the arithmetic of [`score`], which the per-candidate
/// path calls directly so that it and the explain table agree to the bit.
#[inline]
pub(crate) fn wait_secs(
    queued_tokens: u64,
    inflight_tokens: u64,
    throughput_tps: f64,
    kv_barrier_secs: f64,
) -> f64 {
    finite_or_max(drain_secs(queued_tokens, inflight_tokens, throughput_tps) + kv_barrier_secs)
}

/// [`wait_secs`] with the queue already converted (`queued_tokens as f64`,
/// done once per report by the hot records): the same arithmetic, so the
/// same bits.
#[inline]
pub(crate) fn wait_secs_converted(
    queued_tokens_f64: f64,
    inflight_tokens: u64,
    throughput_tps: f64,
    kv_barrier_secs: f64,
) -> f64 {
    finite_or_max((queued_tokens_f64 + inflight_tokens as f64) / throughput_tps + kv_barrier_secs)
}

/// The whole score from its inputs: one worker's fresh snapshot (or none),
/// our pending work now, our pending work when its poll was sent, the knobs
/// and the fleet. A learned rate is the policy's state, so under
/// `rate = "learned"` this scores at the prior, `default_throughput`.
pub fn score_worker(
    load: Option<&LoadSummary>,
    pending_now: PendingWork,
    pending_at_poll_start: PendingWork,
    params: &LeastLoadParams,
    fleet: Fleet,
) -> ScoreBreakdown {
    let terms = load.map(|load| SnapshotTerms::new(load, pending_at_poll_start, params));
    score(terms.as_ref(), pending_now.tokens, 0, None, fleet, params)
}

fn valid_throughput(tps: f64) -> Option<f64> {
    (tps.is_finite() && tps > 0.0).then_some(tps)
}

/// NaN (impossible after the guards above, kept as a last line) and +inf
/// become the largest finite score: such a worker loses to any sane one but
/// still compares, so a NaN can never win a selection.
fn finite_or_max(value: f64) -> f64 {
    if value.is_finite() { value } else { f64::MAX }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The pure scorer is worked out by hand against reported rates.
    fn params() -> LeastLoadParams {
        LeastLoadParams {
            rate: RateMode::Reported,
            ..LeastLoadParams::default()
        }
    }

    fn fresh_fleet() -> Fleet {
        Fleet::new(true, [], &params())
    }

    fn summary(queued: Option<u64>, waiting: u64, tps: Option<f64>, kv: f64) -> LoadSummary {
        LoadSummary {
            queued_tokens: queued,
            waiting_requests: waiting,
            throughput_tps: tps,
            kv_usage_ratio: kv,
        }
    }

    fn pending(tokens: u64, requests: u64) -> PendingWork {
        PendingWork { tokens, requests }
    }

    #[test]
    fn every_term_by_hand() {
        // (4000 queued - 1000 ours at poll start + 600 pending) / 2400 tok/s = 1.5 s;
        // barrier 0.15 * 0.5 / 0.5 = 0.15 s.
        let load = summary(Some(4000), 3, Some(2400.0), 0.5);
        let b = score_worker(
            Some(&load),
            pending(600, 2),
            pending(1000, 1),
            &params(),
            fresh_fleet(),
        );
        assert_eq!(b.queued_tokens, 3000);
        assert_eq!(b.inflight_tokens, 600);
        assert_eq!(b.throughput_tps, 2400.0);
        assert_eq!(b.drain_secs, 1.5);
        assert!((b.kv_barrier_secs - 0.15).abs() < 1e-12);
        assert!((b.score_secs - 1.65).abs() < 1e-12);
        assert_eq!(b.rule.to_string(), "fresh");
    }

    #[test]
    fn rule_1_estimates_the_queue_from_waiting_requests() {
        // (5 waiting - 2 ours) * 1024 = 3072 tokens; / 2000 default = 1.536 s.
        let load = summary(None, 5, None, 0.0);
        let b = score_worker(
            Some(&load),
            pending(0, 0),
            pending(999, 2),
            &params(),
            fresh_fleet(),
        );
        assert_eq!(b.queued_tokens, 3072);
        assert_eq!(b.score_secs, 1.536);
        assert_eq!(
            b.rule,
            Rule::Fresh {
                queue: QueueSource::Estimated,
                throughput: ThroughputSource::Default
            }
        );
    }

    #[test]
    fn reported_zero_is_trusted() {
        let load = summary(Some(0), 7, Some(1000.0), 0.0);
        let b = score_worker(
            Some(&load),
            pending(0, 0),
            pending(0, 0),
            &params(),
            fresh_fleet(),
        );
        assert_eq!(b.queued_tokens, 0);
        assert_eq!(b.score_secs, 0.0);
    }

    #[test]
    fn the_subtraction_floors_at_zero() {
        let load = summary(Some(100), 1, Some(1000.0), 0.0);
        let b = score_worker(
            Some(&load),
            pending(0, 0),
            pending(5000, 3),
            &params(),
            fresh_fleet(),
        );
        assert_eq!(b.queued_tokens, 0);
        let load = summary(None, 1, Some(1000.0), 0.0);
        let b = score_worker(
            Some(&load),
            pending(0, 0),
            pending(5000, 3),
            &params(),
            fresh_fleet(),
        );
        assert_eq!(b.queued_tokens, 0);
    }

    #[test]
    fn rule_2_zero_or_missing_throughput_uses_the_default() {
        for tps in [None, Some(0.0)] {
            let load = summary(Some(1000), 1, tps, 0.0);
            let b = score_worker(
                Some(&load),
                pending(0, 0),
                pending(0, 0),
                &params(),
                fresh_fleet(),
            );
            assert_eq!(b.throughput_tps, 2000.0);
            assert_eq!(b.score_secs, 0.5);
            assert_eq!(b.rule.to_string(), "fresh; rule 2: default throughput");
        }
    }

    #[test]
    fn rules_3_and_4_use_the_fleet() {
        // Nominal = mean(1000, 3000) = 2000; 1000 pending tokens / 2000 = 0.5 s.
        let fleet = Fleet::new(true, [1000.0, 3000.0], &params());
        assert_eq!(fleet.nominal_throughput_tps, 2000.0);
        let b = score_worker(None, pending(1000, 1), pending(0, 0), &params(), fleet);
        assert_eq!((b.score_secs, b.rule), (0.5, Rule::NoFreshSnapshot));
        assert_eq!(b.kv_barrier_secs, 0.0);
        assert_eq!(b.queued_tokens, 0);
        // No reported rate at all: the default.
        let dark = Fleet::new(false, [], &params());
        assert_eq!(dark.nominal_throughput_tps, 2000.0);
        let b = score_worker(None, pending(500, 1), pending(0, 0), &params(), dark);
        assert_eq!((b.score_secs, b.rule), (0.25, Rule::DarkFleet));
    }

    #[test]
    fn hostile_values_still_give_a_finite_score() {
        for tps in [f64::NAN, f64::INFINITY, -1.0, 0.0] {
            for kv in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, -3.0, 1.0, 7.0] {
                let load = summary(Some(u64::MAX), u64::MAX, Some(tps), kv);
                let b = score_worker(
                    Some(&load),
                    pending(u64::MAX, u64::MAX),
                    pending(0, 0),
                    &params(),
                    fresh_fleet(),
                );
                assert!(b.score_secs.is_finite(), "tps {tps} kv {kv}: {b:?}");
                assert!(b.throughput_tps > 0.0);
            }
        }
        let fleet = Fleet::new(true, [f64::NAN, f64::INFINITY, -2.0], &params());
        assert_eq!(fleet.nominal_throughput_tps, 2000.0);
        // Unvalidated knobs are survived too.
        let wild = LeastLoadParams {
            kv_pressure_weight: f64::INFINITY,
            default_throughput: f64::NAN,
            mean_prefill_tokens: 0,
            ..params()
        };
        let load = summary(None, 3, None, 0.999);
        let b = score_worker(
            Some(&load),
            pending(1, 1),
            pending(0, 0),
            &wild,
            fresh_fleet(),
        );
        assert!(b.score_secs.is_finite(), "{b:?}");
    }

    fn any_params() -> impl Strategy<Value = LeastLoadParams> {
        (0.0..10.0f64, 1.0..100_000.0f64, 1u64..100_000, 0u64..64).prop_map(
            |(weight, default_tps, prefill, cap)| LeastLoadParams {
                kv_pressure_weight: weight,
                default_throughput: default_tps,
                mean_prefill_tokens: prefill,
                max_waiting_requests: cap,
                ..LeastLoadParams::default()
            },
        )
    }

    fn any_f64() -> impl Strategy<Value = f64> {
        prop_oneof![
            any::<f64>(),
            Just(f64::NAN),
            Just(f64::INFINITY),
            Just(0.0),
            0.0..1.0f64
        ]
    }

    fn any_summary() -> impl Strategy<Value = LoadSummary> {
        (
            proptest::option::of(any::<u64>()),
            any::<u64>(),
            proptest::option::of(any_f64()),
            any_f64(),
        )
            .prop_map(|(queued, waiting, tps, kv)| summary(queued, waiting, tps, kv))
    }

    fn any_pending() -> impl Strategy<Value = PendingWork> {
        (any::<u64>(), any::<u64>()).prop_map(|(tokens, requests)| pending(tokens, requests))
    }

    fn score_of(
        load: &LoadSummary,
        now: PendingWork,
        at_poll: PendingWork,
        params: &LeastLoadParams,
    ) -> f64 {
        score_worker(Some(load), now, at_poll, params, fresh_fleet()).score_secs
    }

    proptest! {
        #[test]
        fn the_score_is_always_finite(
            load in proptest::option::of(any_summary()),
            now in any_pending(),
            at_poll in any_pending(),
            params in any_params(),
            any_fresh in any::<bool>(),
            rates in proptest::collection::vec(any_f64(), 0..4),
        ) {
            let fleet = Fleet::new(any_fresh, rates, &params);
            let b = score_worker(load.as_ref(), now, at_poll, &params, fleet);
            prop_assert!(b.score_secs.is_finite());
            prop_assert!(b.score_secs >= 0.0);
        }

        #[test]
        fn monotone_in_queued_tokens(
            load in any_summary(), now in any_pending(), at_poll in any_pending(),
            params in any_params(), a in any::<u64>(), b in any::<u64>(),
        ) {
            let (low, high) = (a.min(b), a.max(b));
            let s_low = score_of(&LoadSummary { queued_tokens: Some(low), ..load }, now, at_poll, &params);
            let s_high = score_of(&LoadSummary { queued_tokens: Some(high), ..load }, now, at_poll, &params);
            prop_assert!(s_low <= s_high, "{s_low} > {s_high}");
            // And in waiting requests when the queue is estimated.
            let s_low = score_of(&LoadSummary { queued_tokens: None, waiting_requests: low, ..load }, now, at_poll, &params);
            let s_high = score_of(&LoadSummary { queued_tokens: None, waiting_requests: high, ..load }, now, at_poll, &params);
            prop_assert!(s_low <= s_high, "{s_low} > {s_high}");
        }

        #[test]
        fn monotone_in_pending_tokens(
            load in proptest::option::of(any_summary()), at_poll in any_pending(),
            params in any_params(), a in any::<u64>(), b in any::<u64>(), any_fresh in any::<bool>(),
        ) {
            let (low, high) = (a.min(b), a.max(b));
            let fleet = Fleet::new(any_fresh, [1500.0], &params);
            let s_low = score_worker(load.as_ref(), pending(low, 1), at_poll, &params, fleet).score_secs;
            let s_high = score_worker(load.as_ref(), pending(high, 1), at_poll, &params, fleet).score_secs;
            prop_assert!(s_low <= s_high, "{s_low} > {s_high}");
        }

        #[test]
        fn monotone_in_kv_usage(
            load in any_summary(), now in any_pending(), at_poll in any_pending(),
            params in any_params(), a in any_f64(), b in any_f64(),
        ) {
            prop_assume!(a.is_finite() && b.is_finite());
            let (low, high) = (a.min(b), a.max(b));
            let s_low = score_of(&LoadSummary { kv_usage_ratio: low, ..load }, now, at_poll, &params);
            let s_high = score_of(&LoadSummary { kv_usage_ratio: high, ..load }, now, at_poll, &params);
            prop_assert!(s_low <= s_high, "{s_low} > {s_high}");
        }

        #[test]
        fn non_increasing_in_throughput(
            load in any_summary(), now in any_pending(), at_poll in any_pending(),
            params in any_params(), a in 1e-3..1e9f64, b in 1e-3..1e9f64,
        ) {
            let (low, high) = (a.min(b), a.max(b));
            let s_slow = score_of(&LoadSummary { throughput_tps: Some(low), ..load }, now, at_poll, &params);
            let s_fast = score_of(&LoadSummary { throughput_tps: Some(high), ..load }, now, at_poll, &params);
            prop_assert!(s_fast <= s_slow, "{s_fast} > {s_slow}");
        }
    }
}
