//! A worker's prefill rate, learned from the router's dispatches: this
//! replica's, and with sync every other replica's first tokens too, merged
//! on one timeline ([`LearnedRate::observe_first_token`]).
//!
//! Every dispatch is a measurement. When the router sends a request, it knows
//! the token-work ahead of it on the worker (the queued and pending terms the
//! score used) and the request's own tokens; when the first token comes back,
//! it knows how long clearing all of that took. Each such sample implies a
//! rate, work over time, and the estimate is their weighted geometric mean:
//!
//! ```text
//! log rate = Σ w·tokens·log(implied rate) / Σ w·tokens
//! ```
//!
//! where each sample's weight `w` halves every `rate_half_life_secs`.
//!
//! A sample is one engine step's worth of first tokens, measured as work
//! conserved (see [`StepBatcher`]): the prompt tokens of the router
//! fleet's requests whose first tokens came back together, plus the share
//! of other traffic's queue that was ahead of them, over the time since
//! the worker last gave the router fleet first tokens (or since their
//! dispatch, if it was idle for it). Each of our
//! tokens is counted once, at its own first token, so prompts that
//! overtake others in chunked prefill, several prompts finishing in one
//! step, and prompts part-way through prefill at dispatch neither inflate
//! nor deflate the rate: busy time is divided among the tokens it really
//! cleared.
//!
//! A
//! sample counts by its tokens, so a deep queue or a long prompt outweighs a
//! short request whose wait is mostly the engine's fixed per-step cost. Idle
//! time leaves the estimate where it is: every sample decays alike, and the
//! decay stops at a floor (twice `mean_prefill_tokens` of weight), so the
//! first samples after a quiet spell move it by a bounded step instead of
//! replacing it. The mean starts from a light pseudo-sample at the prior
//! (worth a quarter of `mean_prefill_tokens`), so the first real samples
//! take over.
//!
//! Samples are guarded on the way in:
//! - dropped and counted: a first token at or before its dispatch, no work,
//!   or an implied rate outside [`MIN_RATE_TPS`, `MAX_RATE_TPS`] (a
//!   one-token request answered after ten minutes says nothing about prefill);
//! - clipped: an implied rate more than [`CLIP_FACTOR`] times off the current
//!   estimate counts as that bound. A preempted request, or a queue that
//!   other routers grew unseen, moves the rate by a bounded step (in log
//!   space, so a slow outlier weighs no more than a fast one), and a worker
//!   that really changed speed is still followed, a bounded step per sample.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use parking_lot::Mutex;

/// Implied rates below this are not prefill measurements (tokens/s).
pub const MIN_RATE_TPS: f64 = 1.0;
/// Implied rates above this are not prefill measurements (tokens/s).
pub const MAX_RATE_TPS: f64 = 1.0e8;
/// A sample's implied rate counts as at most this factor off the estimate.
pub const CLIP_FACTOR: f64 = 4.0;
/// A worker is scored at its own rate from this many learned samples on;
/// before that, at the fleet's. One or two samples say little (a request
/// that waited for a step boundary, a prefix-cache hit), and a worker scored
/// on them alone can look several times faster than the rest and draw
/// every long prompt until the next samples correct it.
pub const MIN_SAMPLES_TO_SCORE: u64 = 4;
/// Decay never takes the estimate's weight below this many times its
/// prior's: after an idle spell the estimate still outweighs the next few
/// samples, so one of them cannot replace it.
const RETAINED_PRIOR_MULTIPLE: f64 = 8.0;

/// What a dispatch remembers to become a rate sample at its first token.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RateProbe {
    /// When it was dispatched, on the policy's timeline.
    pub dispatched_nanos: i64,
    /// Token-work ahead of it on the worker at dispatch that this router did
    /// not send: the engine's queue of other traffic and other replicas'
    /// pending work.
    pub foreign_ahead_tokens: u64,
    /// Whether its first token measures prefill. A non-streaming answer's
    /// head comes with the whole answer, so it does not.
    pub learn: bool,
}

/// First tokens this close to the batch's latest are one engine step's.
pub const SAME_STEP_NANOS: i64 = 2_000_000;

/// One rate sample: `work_tokens` cleared in `elapsed_nanos`, ending at
/// `end_nanos`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepSample {
    pub work_tokens: u64,
    pub elapsed_nanos: i64,
    pub end_nanos: i64,
}

/// Gathers first tokens that come back together into one sample.
///
/// A first token within [`SAME_STEP_NANOS`] of the open batch's latest joins
/// it; any later one closes it (the closed batch is the sample) and opens
/// the next. A request's part of a batch:
/// - its busy time starts at the previous batch's end (the worker was
///   clearing our work until then) or at its dispatch if later (the worker
///   was idle for us in between); the batch spans from its earliest member's
///   start to its latest first token;
/// - its work is its own tokens plus the share of the foreign work ahead of
///   it that falls in that span (assumed cleared evenly over its wait).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepBatcher {
    open: Option<StepSample>,
    /// Where the open batch started.
    open_start_nanos: i64,
    previous_end_nanos: Option<i64>,
}

impl StepBatcher {
    /// Adds the first token, at `first_token_nanos`, of a request of
    /// `own_tokens` sent as `probe` says; returns the batch it closed.
    pub fn add(
        &mut self,
        probe: &RateProbe,
        own_tokens: u64,
        first_token_nanos: i64,
    ) -> Option<StepSample> {
        let closed = match self.open {
            Some(open) if first_token_nanos <= open.end_nanos.saturating_add(SAME_STEP_NANOS) => {
                None
            }
            Some(open) => {
                self.previous_end_nanos = Some(open.end_nanos);
                self.open = None;
                Some(StepSample {
                    elapsed_nanos: open.end_nanos.saturating_sub(self.open_start_nanos),
                    ..open
                })
            }
            None => None,
        };
        let start_nanos = self
            .previous_end_nanos
            .map_or(probe.dispatched_nanos, |end| {
                end.max(probe.dispatched_nanos)
            })
            .min(first_token_nanos);
        let waited_nanos = first_token_nanos.saturating_sub(probe.dispatched_nanos);
        let foreign_tokens = if waited_nanos > 0 {
            let share = (first_token_nanos - start_nanos) as f64 / waited_nanos as f64;
            (probe.foreign_ahead_tokens as f64 * share.clamp(0.0, 1.0)).round() as u64
        } else {
            probe.foreign_ahead_tokens
        };
        let work_tokens = own_tokens.saturating_add(foreign_tokens);
        match self.open.as_mut() {
            Some(open) => {
                open.work_tokens = open.work_tokens.saturating_add(work_tokens);
                open.end_nanos = open.end_nanos.max(first_token_nanos);
                self.open_start_nanos = self.open_start_nanos.min(start_nanos);
            }
            None => {
                self.open = Some(StepSample {
                    work_tokens,
                    elapsed_nanos: 0,
                    end_nanos: first_token_nanos,
                });
                self.open_start_nanos = start_nanos;
            }
        }
        closed
    }
}

/// Why a sample was not learned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DroppedSample {
    /// The first token came at or before the dispatch.
    NoElapsedTime,
    /// Nothing was ahead and the request had no tokens.
    NoWork,
    /// The implied rate is outside [`MIN_RATE_TPS`, `MAX_RATE_TPS`].
    Absurd,
}

/// Where a worker's rate comes from now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LearnedSource {
    /// Fewer than [`MIN_SAMPLES_TO_SCORE`] samples: the prior (the fleet's
    /// rate, in a policy).
    Prior,
    /// At least [`MIN_SAMPLES_TO_SCORE`] samples.
    Learned,
}

/// The estimator itself: pure, fed with times on the policy's timeline.
#[derive(Debug, Clone)]
pub struct RateEstimator {
    half_life_secs: f64,
    /// Decayed Σw·tokens and Σw·tokens·ln(implied rate).
    weight_tokens: f64,
    weighted_log_rate: f64,
    /// The least weight decay leaves.
    retained_weight_tokens: f64,
    /// The prior's part of the weight (decayed with the rest) and its rate:
    /// what [`rebase_prior`](Self::rebase_prior) moves.
    prior_weight_tokens: f64,
    prior_log_tps: f64,
    /// `exp(weighted_log_rate / weight_tokens)`, kept so the prior reads back
    /// exactly.
    rate_tps: f64,
    last_nanos: Option<i64>,
    samples: u64,
    dropped: u64,
}

impl RateEstimator {
    /// An estimator at `prior_tps`, worth a sample of `prior_tokens`.
    pub fn new(prior_tps: f64, prior_tokens: u64, half_life_secs: f64) -> RateEstimator {
        let prior_tps = if prior_tps.is_finite() {
            prior_tps.clamp(MIN_RATE_TPS, MAX_RATE_TPS)
        } else {
            MIN_RATE_TPS
        };
        let prior_tokens = prior_tokens.max(1) as f64;
        RateEstimator {
            half_life_secs,
            weight_tokens: prior_tokens,
            weighted_log_rate: prior_tokens * prior_tps.ln(),
            retained_weight_tokens: prior_tokens * RETAINED_PRIOR_MULTIPLE,
            prior_weight_tokens: prior_tokens,
            prior_log_tps: prior_tps.ln(),
            rate_tps: prior_tps,
            last_nanos: None,
            samples: 0,
            dropped: 0,
        }
    }

    /// The current estimate, tokens/s; always finite and within
    /// [`MIN_RATE_TPS`, `MAX_RATE_TPS`].
    pub fn rate_tps(&self) -> f64 {
        self.rate_tps
    }

    fn log_rate(&self) -> f64 {
        let log_rate = self.weighted_log_rate / self.weight_tokens;
        if log_rate.is_finite() {
            log_rate.clamp(MIN_RATE_TPS.ln(), MAX_RATE_TPS.ln())
        } else {
            MIN_RATE_TPS.ln()
        }
    }

    pub fn samples(&self) -> u64 {
        self.samples
    }

    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Counts a sample dropped before it reached the estimator.
    pub fn count_dropped(&mut self) {
        self.dropped += 1;
    }

    pub fn source(&self) -> LearnedSource {
        if self.samples == 0 {
            LearnedSource::Prior
        } else {
            LearnedSource::Learned
        }
    }

    /// Moves the prior to `prior_tps` while the worker has fewer than
    /// [`MIN_SAMPLES_TO_SCORE`] samples (a no-op after that): its first
    /// samples then refine the rate it was scored at, the fleet's, instead
    /// of the configured default.
    pub fn rebase_prior(&mut self, prior_tps: f64) {
        if self.samples >= MIN_SAMPLES_TO_SCORE || !prior_tps.is_finite() {
            return;
        }
        let prior_log_tps = prior_tps.clamp(MIN_RATE_TPS, MAX_RATE_TPS).ln();
        self.weighted_log_rate += self.prior_weight_tokens * (prior_log_tps - self.prior_log_tps);
        self.prior_log_tps = prior_log_tps;
        self.rate_tps = self.log_rate().exp().clamp(MIN_RATE_TPS, MAX_RATE_TPS);
    }

    /// One dispatch's outcome: `work_tokens` (ahead plus its own) cleared
    /// in `elapsed_nanos` from dispatch to first token, observed at
    /// `now_nanos`.
    pub fn observe(
        &mut self,
        work_tokens: u64,
        elapsed_nanos: i64,
        now_nanos: i64,
    ) -> Result<(), DroppedSample> {
        let implied_tps = match Self::implied_tps(work_tokens, elapsed_nanos) {
            Ok(implied_tps) => implied_tps,
            Err(dropped) => {
                self.dropped += 1;
                return Err(dropped);
            }
        };
        self.decay_to(now_nanos);
        let current = self.log_rate();
        let bound = CLIP_FACTOR.ln();
        let log_sample = implied_tps.ln().clamp(current - bound, current + bound);
        let tokens = work_tokens as f64;
        self.weight_tokens += tokens;
        self.weighted_log_rate += tokens * log_sample;
        self.rate_tps = self.log_rate().exp().clamp(MIN_RATE_TPS, MAX_RATE_TPS);
        self.samples += 1;
        Ok(())
    }

    /// The rate a sample implies, if it is one to learn from.
    fn implied_tps(work_tokens: u64, elapsed_nanos: i64) -> Result<f64, DroppedSample> {
        if elapsed_nanos <= 0 {
            return Err(DroppedSample::NoElapsedTime);
        }
        if work_tokens == 0 {
            return Err(DroppedSample::NoWork);
        }
        let implied_tps = work_tokens as f64 / (elapsed_nanos as f64 / 1e9);
        if (MIN_RATE_TPS..=MAX_RATE_TPS).contains(&implied_tps) {
            Ok(implied_tps)
        } else {
            Err(DroppedSample::Absurd)
        }
    }

    /// Ages every sample to `now_nanos`. First tokens reported out of order
    /// (concurrent threads) age nothing.
    fn decay_to(&mut self, now_nanos: i64) {
        let Some(last) = self.last_nanos else {
            self.last_nanos = Some(now_nanos);
            return;
        };
        if now_nanos <= last {
            return;
        }
        let elapsed_secs = (now_nanos - last) as f64 / 1e9;
        let factor = 0.5f64.powf(elapsed_secs / self.half_life_secs);
        let log_rate = self.log_rate();
        // The mean is kept; only its weight shrinks, never below the floor
        // (nor below where it already is, while it is still young).
        let floor = self.retained_weight_tokens.min(self.weight_tokens);
        let weight_tokens = (self.weight_tokens * factor).max(floor);
        self.prior_weight_tokens *= weight_tokens / self.weight_tokens;
        self.weight_tokens = weight_tokens;
        self.weighted_log_rate = self.weight_tokens * log_rate;
        self.last_nanos = Some(now_nanos);
    }
}

/// First tokens held back at most this many per worker: past it, the
/// oldest is learned whatever the hold.
const MAX_HELD_FIRST_TOKENS: usize = 4096;

/// A first token to learn a worker's rate from: this replica's, or one
/// another replica saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FirstToken {
    /// How its request was sent.
    pub probe: RateProbe,
    /// Prompt tokens the worker computed for it.
    pub tokens: u64,
    /// When it came, on the policy's timeline.
    pub at_nanos: i64,
}

/// A worker's estimator, batcher and the first tokens not learned yet.
///
/// Behind several router replicas an engine computes the prompts of all of
/// them in the same steps, so every replica's first tokens go through one
/// batcher, in the order they came. Another replica's are heard a sync
/// interval late: first tokens are held until `hold` has passed since
/// they came, and learned in order then; one heard after later ones were
/// learned is dropped and counted.
#[derive(Debug)]
struct Learner {
    estimator: RateEstimator,
    batcher: StepBatcher,
    /// Sorted by `at_nanos`.
    held: VecDeque<FirstToken>,
    /// The latest first token learned.
    learned_through_nanos: Option<i64>,
}

/// A worker's [`RateEstimator`] and [`StepBatcher`], shared: selections read
/// the rate with one atomic load; first tokens update it under a per-worker
/// lock.
#[derive(Debug)]
pub struct LearnedRate {
    learner: Mutex<Learner>,
    /// The estimate's bits from [`MIN_SAMPLES_TO_SCORE`] samples on; 0 (no
    /// rate) before, when selections use the fleet's rate instead.
    learned_bits: AtomicU64,
    /// The estimate, prior included: what the explain table shows.
    rate_bits: AtomicU64,
    samples: AtomicU64,
    dropped: AtomicU64,
}

impl LearnedRate {
    pub fn new(estimator: RateEstimator) -> LearnedRate {
        LearnedRate {
            learned_bits: AtomicU64::new(0),
            rate_bits: AtomicU64::new(estimator.rate_tps().to_bits()),
            samples: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            learner: Mutex::new(Learner {
                estimator,
                batcher: StepBatcher::default(),
                held: VecDeque::new(),
                learned_through_nanos: None,
            }),
        }
    }

    /// The estimate, or its prior before the first sample.
    pub fn rate_tps(&self) -> f64 {
        f64::from_bits(self.rate_bits.load(Ordering::Relaxed))
    }

    /// The estimate once [`MIN_SAMPLES_TO_SCORE`] samples have been learned:
    /// one atomic load, for the selection's hot loop.
    #[inline]
    pub fn learned_tps(&self) -> Option<f64> {
        let bits = self.learned_bits.load(Ordering::Relaxed);
        (bits != 0).then(|| f64::from_bits(bits))
    }

    pub fn samples(&self) -> u64 {
        self.samples.load(Ordering::Relaxed)
    }

    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    pub fn source(&self) -> LearnedSource {
        if self.samples() < MIN_SAMPLES_TO_SCORE {
            LearnedSource::Prior
        } else {
            LearnedSource::Learned
        }
    }

    /// Adds a first token, this replica's or another's, and learns, in the
    /// order they came, those that came `hold_nanos` or more before
    /// `now_nanos` (see [`observe`](Self::observe) for `fleet_prior_tps`).
    /// Returns whether a sample was learned. A first token that came before
    /// the last one learned, by more than a step, is dropped and counted.
    pub fn observe_first_token(
        &self,
        first_token: FirstToken,
        hold_nanos: i64,
        now_nanos: i64,
        fleet_prior_tps: Option<f64>,
    ) -> bool {
        let mut learner = self.learner.lock();
        let learner = &mut *learner;
        if learner
            .learned_through_nanos
            .is_some_and(|through| first_token.at_nanos.saturating_add(SAME_STEP_NANOS) < through)
        {
            learner.estimator.count_dropped();
            self.dropped
                .store(learner.estimator.dropped(), Ordering::Relaxed);
            return false;
        }
        let position = learner
            .held
            .partition_point(|held| held.at_nanos <= first_token.at_nanos);
        learner.held.insert(position, first_token);
        let until_nanos = now_nanos.saturating_sub(hold_nanos.max(0));
        let mut learned = false;
        while let Some(next) = learner.held.front().copied() {
            if next.at_nanos > until_nanos && learner.held.len() <= MAX_HELD_FIRST_TOKENS {
                break;
            }
            learner.held.pop_front();
            learner.learned_through_nanos = Some(
                learner
                    .learned_through_nanos
                    .map_or(next.at_nanos, |through| through.max(next.at_nanos)),
            );
            if let Some(sample) = learner.batcher.add(&next.probe, next.tokens, next.at_nanos) {
                learned |= self
                    .learn(
                        &mut learner.estimator,
                        sample.work_tokens,
                        sample.elapsed_nanos,
                        sample.end_nanos,
                        fleet_prior_tps,
                    )
                    .is_ok();
            }
        }
        learned
    }

    /// See [`RateEstimator::observe`]. Until the worker is scored at its
    /// own rate, the prior moves to `fleet_prior_tps` (where given): what
    /// this worker was scored at until now.
    pub fn observe(
        &self,
        work_tokens: u64,
        elapsed_nanos: i64,
        now_nanos: i64,
        fleet_prior_tps: Option<f64>,
    ) -> Result<(), DroppedSample> {
        let mut learner = self.learner.lock();
        self.learn(
            &mut learner.estimator,
            work_tokens,
            elapsed_nanos,
            now_nanos,
            fleet_prior_tps,
        )
    }

    fn learn(
        &self,
        estimator: &mut RateEstimator,
        work_tokens: u64,
        elapsed_nanos: i64,
        now_nanos: i64,
        fleet_prior_tps: Option<f64>,
    ) -> Result<(), DroppedSample> {
        if let Some(prior_tps) = fleet_prior_tps {
            estimator.rebase_prior(prior_tps);
        }
        let outcome = estimator.observe(work_tokens, elapsed_nanos, now_nanos);
        let rate_bits = estimator.rate_tps().to_bits();
        self.rate_bits.store(rate_bits, Ordering::Relaxed);
        if estimator.samples() >= MIN_SAMPLES_TO_SCORE {
            self.learned_bits.store(rate_bits, Ordering::Relaxed);
        }
        self.samples.store(estimator.samples(), Ordering::Relaxed);
        self.dropped.store(estimator.dropped(), Ordering::Relaxed);
        outcome
    }
}

/// The longest first tokens are held for other replicas' (nanoseconds): a
/// replica heard later than this is learned from out of order, or dropped.
pub const MAX_HOLD_NANOS: i64 = 2_000_000_000;

/// How late other replicas' first tokens are heard: how long every
/// worker's first tokens are held before they are learned from
/// ([`LearnedRate::observe_first_token`]). The latest lateness heard, or,
/// when later ones come sooner, a slow decay from it (1/512 per first
/// token heard). 0, so nothing is held, until another replica's is heard.
#[derive(Debug, Default)]
pub struct PeerLateness {
    hold_nanos: AtomicI64,
}

impl PeerLateness {
    /// The hold now, nanoseconds.
    pub fn hold_nanos(&self) -> i64 {
        self.hold_nanos.load(Ordering::Relaxed)
    }

    /// Another replica's first token was heard `late_nanos` after it came.
    pub fn heard(&self, late_nanos: i64) {
        let late_nanos = late_nanos.clamp(0, MAX_HOLD_NANOS);
        let held = self.hold_nanos.load(Ordering::Relaxed);
        let decayed = held - held / 512;
        self.hold_nanos
            .store(late_nanos.max(decayed), Ordering::Relaxed);
    }
}

/// How often, at most, [`FleetRate`] is recomputed from the workers.
pub const FLEET_RATE_REFRESH_NANOS: i64 = 100_000_000;

/// The fleet's rate: the geometric mean of its workers' learned rates.
///
/// - A worker without a sample of its own is scored at it. A fixed default
///   would make every unlearned worker look faster or slower than the
///   learned ones, so a fleet would flood them, or never send them the
///   request that teaches them.
/// - A learned rate within the deadband of it is scored at it too (see
///   `rate_deadband_ratio`): alike workers are scored alike. Behind R
///   router replicas heard through sync the deadband widens by √R: each
///   replica learns from every replica's samples, but a sample counts the
///   others' work ahead as they last published it, and arrives a sync
///   interval late, so rates stay noisier than one router's.
///
/// Read with one atomic load; recomputed by whoever claims a refresh, at most
/// every [`FLEET_RATE_REFRESH_NANOS`], so no request pays a scan.
#[derive(Debug)]
pub struct FleetRate {
    tps_bits: AtomicU64,
    refreshed_nanos: AtomicI64,
    deadband_ratio: f64,
    /// `1 + rate_deadband_ratio × √replicas`, as bits.
    deadband_factor_bits: AtomicU64,
}

impl FleetRate {
    pub fn new(default_tps: f64, deadband_ratio: f64) -> FleetRate {
        let deadband_ratio = deadband_ratio.max(0.0);
        FleetRate {
            tps_bits: AtomicU64::new(default_tps.to_bits()),
            refreshed_nanos: AtomicI64::new(i64::MIN),
            deadband_ratio,
            deadband_factor_bits: AtomicU64::new((1.0 + deadband_ratio).to_bits()),
        }
    }

    /// The router fleet has `replicas` replicas (this one included) that
    /// split the first tokens: the deadband widens by √replicas.
    pub fn set_replicas(&self, replicas: u64) {
        let factor = 1.0 + self.deadband_ratio * (replicas.max(1) as f64).sqrt();
        self.deadband_factor_bits
            .store(factor.to_bits(), Ordering::Relaxed);
    }

    #[inline]
    pub fn tps(&self) -> f64 {
        f64::from_bits(self.tps_bits.load(Ordering::Relaxed))
    }

    /// The rate a worker is scored at: its learned rate when that differs
    /// from the fleet's by more than the deadband, else the fleet's.
    #[inline]
    pub fn scoring_tps(&self, learned_tps: Option<f64>) -> f64 {
        let fleet_tps = self.tps();
        let deadband_factor = f64::from_bits(self.deadband_factor_bits.load(Ordering::Relaxed));
        match learned_tps {
            Some(tps) if tps > fleet_tps * deadband_factor || tps * deadband_factor < fleet_tps => {
                tps
            }
            _ => fleet_tps,
        }
    }

    /// Whether the caller should recompute it now: true for one caller per
    /// refresh period.
    pub fn claim_refresh(&self, now_nanos: i64) -> bool {
        let last = self.refreshed_nanos.load(Ordering::Relaxed);
        now_nanos.saturating_sub(last) >= FLEET_RATE_REFRESH_NANOS
            && self
                .refreshed_nanos
                .compare_exchange(last, now_nanos, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }

    /// Sets it to the geometric mean of `learned_tps`, or `default_tps`
    /// when there is none.
    pub fn set_from(&self, learned_tps: impl Iterator<Item = f64>, default_tps: f64) {
        let (sum_ln, count) = learned_tps
            .filter(|tps| tps.is_finite() && *tps > 0.0)
            .fold((0.0f64, 0u32), |(sum_ln, count), tps| {
                (sum_ln + tps.ln(), count + 1)
            });
        let tps = if count > 0 {
            (sum_ln / f64::from(count)).exp()
        } else {
            default_tps
        };
        self.tps_bits.store(tps.to_bits(), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: i64 = 1_000_000_000;
    const MS: i64 = 1_000_000;

    fn estimator() -> RateEstimator {
        RateEstimator::new(2000.0, 256, 20.0)
    }

    /// Feeds `count` samples of `tokens` at `true_tps`, one every
    /// `gap_secs`, from `start` seconds; returns the time after the last.
    fn feed(
        estimator: &mut RateEstimator,
        start_secs: f64,
        count: usize,
        tokens: u64,
        true_tps: f64,
        gap_secs: f64,
    ) -> f64 {
        let mut at_secs = start_secs;
        for _ in 0..count {
            let elapsed = tokens as f64 / true_tps;
            let elapsed_nanos = (elapsed * 1e9) as i64;
            at_secs += gap_secs;
            estimator
                .observe(tokens, elapsed_nanos, (at_secs * 1e9) as i64)
                .unwrap();
        }
        at_secs
    }

    #[test]
    fn it_starts_at_the_prior() {
        let estimator = estimator();
        assert_eq!(estimator.rate_tps(), 2000.0);
        assert_eq!(estimator.source(), LearnedSource::Prior);
        assert_eq!(estimator.samples(), 0);
    }

    #[test]
    fn it_converges_to_the_true_rate_from_far_below_and_far_above() {
        for true_tps in [16_000.0, 300.0, 60_000.0] {
            let mut estimator = estimator();
            feed(&mut estimator, 0.0, 60, 2000, true_tps, 0.5);
            let ratio = estimator.rate_tps() / true_tps;
            assert!(
                (0.95..=1.05).contains(&ratio),
                "true {true_tps}: learned {}",
                estimator.rate_tps()
            );
            assert_eq!(estimator.source(), LearnedSource::Learned);
        }
    }

    #[test]
    fn it_follows_a_worker_that_slows_to_half_within_a_few_half_lives() {
        let mut estimator = estimator();
        let at = feed(&mut estimator, 0.0, 200, 1000, 8000.0, 0.25);
        assert!((estimator.rate_tps() / 8000.0 - 1.0).abs() < 0.02);
        // Three half-lives of traffic at half speed.
        feed(&mut estimator, at, 240, 1000, 4000.0, 0.25);
        let ratio = estimator.rate_tps() / 4000.0;
        assert!(
            (1.0..=1.2).contains(&ratio),
            "learned {}",
            estimator.rate_tps()
        );
    }

    #[test]
    fn an_idle_spell_changes_nothing() {
        let mut estimator = estimator();
        let at = feed(&mut estimator, 0.0, 50, 1000, 8000.0, 0.5);
        let before = estimator.rate_tps();
        // An hour later, one sample at the same speed (the estimate still
        // carries a trace of its prior, 0.4 %).
        feed(&mut estimator, at + 3600.0, 1, 1000, 8000.0, 0.0);
        assert!((estimator.rate_tps() / before - 1.0).abs() < 5e-3);
        // Weeks later, one sample at twice the speed: the estimate kept its
        // weight floor, so it moves part of the way, not all of it.
        feed(&mut estimator, at + 3.0e6, 1, 1000, 16_000.0, 0.0);
        let moved = estimator.rate_tps() / before;
        assert!(moved > 1.05 && moved < 1.5, "{moved}");
    }

    #[test]
    fn one_outlier_moves_the_rate_a_bounded_step() {
        let mut estimator = estimator();
        let at = feed(&mut estimator, 0.0, 100, 1000, 8000.0, 0.1);
        // A preempted request: 1000 tokens took a minute.
        estimator
            .observe(1000, 60 * SEC, ((at + 0.1) * 1e9) as i64)
            .unwrap();
        assert!(
            estimator.rate_tps() > 0.9 * 8000.0,
            "learned {}",
            estimator.rate_tps()
        );
    }

    #[test]
    fn bad_samples_are_dropped_and_counted() {
        let mut estimator = estimator();
        assert_eq!(
            estimator.observe(1000, 0, SEC),
            Err(DroppedSample::NoElapsedTime)
        );
        assert_eq!(
            estimator.observe(1000, -5 * SEC, SEC),
            Err(DroppedSample::NoElapsedTime)
        );
        assert_eq!(estimator.observe(0, SEC, SEC), Err(DroppedSample::NoWork));
        // One token after ten minutes.
        assert_eq!(
            estimator.observe(1, 600 * SEC, SEC),
            Err(DroppedSample::Absurd)
        );
        // A billion tokens in a nanosecond.
        assert_eq!(
            estimator.observe(1_000_000_000, 1, SEC),
            Err(DroppedSample::Absurd)
        );
        assert_eq!(estimator.dropped(), 5);
        assert_eq!(estimator.samples(), 0);
        assert_eq!(estimator.rate_tps(), 2000.0);
    }

    #[test]
    fn the_rate_stays_finite_and_in_range_whatever_it_is_fed() {
        let mut estimator = estimator();
        for (tokens, elapsed_nanos) in [
            (u64::MAX, i64::MAX),
            (1, 1),
            (u64::MAX, 1),
            (1, i64::MAX),
            (5, 3),
        ] {
            let _ = estimator.observe(tokens, elapsed_nanos, 0);
            let rate = estimator.rate_tps();
            assert!(rate.is_finite() && (MIN_RATE_TPS..=MAX_RATE_TPS).contains(&rate));
        }
    }

    #[test]
    fn the_shared_rate_mirrors_its_estimator() {
        let shared = LearnedRate::new(estimator());
        assert_eq!(shared.rate_tps(), 2000.0);
        assert_eq!(shared.learned_tps(), None);
        assert_eq!(shared.source(), LearnedSource::Prior);
        shared.observe(4000, SEC / 2, SEC, None).unwrap();
        assert!(shared.rate_tps() > 2000.0);
        assert_eq!(shared.samples(), 1);
        // Not scored on one sample...
        assert_eq!(shared.learned_tps(), None);
        assert_eq!(shared.source(), LearnedSource::Prior);
        for at in 2..=MIN_SAMPLES_TO_SCORE as i64 {
            shared.observe(4000, SEC / 2, at * SEC, None).unwrap();
        }
        // ...but from the fourth on.
        assert_eq!(shared.learned_tps(), Some(shared.rate_tps()));
        assert_eq!(
            shared.observe(1, 600 * SEC, 10 * SEC, None),
            Err(DroppedSample::Absurd)
        );
        assert_eq!(shared.dropped(), 1);
        assert_eq!(shared.source(), LearnedSource::Learned);
    }

    #[test]
    fn a_first_sample_refines_the_fleet_rate_not_the_configured_default() {
        // The worker was scored at the fleet's 8000 tok/s while unlearned;
        // its first samples, at 8000 too, must leave it there, however the
        // fleet's rate moved in between.
        let shared = LearnedRate::new(estimator());
        for (at, fleet_tps) in [(1, 2000.0), (2, 6000.0), (3, 8000.0), (4, 8000.0)] {
            shared
                .observe(800, SEC / 10, at * SEC, Some(fleet_tps))
                .unwrap();
        }
        let learned = shared.learned_tps().unwrap();
        assert!((learned - 8000.0).abs() < 1.0, "{learned}");
        // Once scored, the fleet's rate no longer moves it.
        shared.observe(800, SEC / 10, 5 * SEC, Some(100.0)).unwrap();
        assert!((shared.rate_tps() - 8000.0).abs() < 1.0);
    }

    #[test]
    fn the_fleet_rate_is_the_geometric_mean_refreshed_once_per_period() {
        let fleet = FleetRate::new(2000.0, 0.1);
        assert_eq!(fleet.tps(), 2000.0);
        fleet.set_from([4000.0, 16000.0, f64::NAN].into_iter(), 2000.0);
        assert!((fleet.tps() - 8000.0).abs() < 1e-6);
        fleet.set_from(std::iter::empty(), 2000.0);
        assert_eq!(fleet.tps(), 2000.0);
        assert!(fleet.claim_refresh(0));
        assert!(!fleet.claim_refresh(FLEET_RATE_REFRESH_NANOS - 1));
        assert!(fleet.claim_refresh(FLEET_RATE_REFRESH_NANOS));
    }

    #[test]
    fn rates_within_the_deadband_score_as_the_fleets_and_others_as_learned() {
        let fleet = FleetRate::new(8000.0, 0.1);
        assert_eq!(fleet.scoring_tps(None), 8000.0);
        assert_eq!(fleet.scoring_tps(Some(8700.0)), 8000.0);
        assert_eq!(fleet.scoring_tps(Some(7300.0)), 8000.0);
        assert_eq!(fleet.scoring_tps(Some(8900.0)), 8900.0);
        assert_eq!(fleet.scoring_tps(Some(7200.0)), 7200.0);
        assert_eq!(fleet.scoring_tps(Some(16000.0)), 16000.0);
        // Behind 4 replicas the deadband is twice as wide: 20 %.
        fleet.set_replicas(4);
        assert_eq!(fleet.scoring_tps(Some(9500.0)), 8000.0);
        assert_eq!(fleet.scoring_tps(Some(6700.0)), 8000.0);
        assert_eq!(fleet.scoring_tps(Some(9700.0)), 9700.0);
        fleet.set_replicas(1);
        assert_eq!(fleet.scoring_tps(Some(8900.0)), 8900.0);
        // No deadband: every learned rate counts.
        let exact = FleetRate::new(8000.0, 0.0);
        assert_eq!(exact.scoring_tps(Some(8001.0)), 8001.0);
        assert_eq!(exact.scoring_tps(Some(8000.0)), 8000.0);
    }

    fn probe(dispatched_secs: f64, foreign_ahead_tokens: u64) -> RateProbe {
        RateProbe {
            dispatched_nanos: (dispatched_secs * 1e9) as i64,
            foreign_ahead_tokens,
            learn: true,
        }
    }

    #[test]
    fn first_tokens_of_one_step_are_one_sample_over_the_busy_time() {
        let mut batcher = StepBatcher::default();
        // Idle worker: a request sent at 1 s comes back at 1.1 s.
        assert_eq!(batcher.add(&probe(1.0, 0), 800, 1_100 * MS), None);
        // Four queued behind it come back together at 1.3 s: the first of
        // them closes the first batch.
        let first = batcher.add(&probe(1.01, 0), 400, 1_300 * MS);
        assert_eq!(
            first,
            Some(StepSample {
                work_tokens: 800,
                elapsed_nanos: 100 * MS,
                end_nanos: 1_100 * MS
            })
        );
        for _ in 0..3 {
            assert_eq!(batcher.add(&probe(1.02, 0), 400, 1_300 * MS), None);
        }
        // The next step's closes the batch of four: 1600 tokens in the
        // 200 ms since the previous batch.
        let second = batcher.add(&probe(1.05, 0), 100, 1_400 * MS);
        assert_eq!(
            second,
            Some(StepSample {
                work_tokens: 1600,
                elapsed_nanos: 200 * MS,
                end_nanos: 1_300 * MS
            })
        );
    }

    #[test]
    fn a_request_sent_after_an_idle_spell_counts_from_its_dispatch_with_its_foreign_share() {
        let mut batcher = StepBatcher::default();
        assert_eq!(batcher.add(&probe(0.0, 0), 100, 50 * MS), None);
        // Sent at 5 s with 1000 foreign tokens ahead, back at 5.5 s.
        let closed = batcher.add(&probe(5.0, 1000), 500, 5_500 * MS);
        assert!(closed.is_some());
        // Sent at 5.2 s with 1000 foreign tokens ahead, back at 6.2 s: it
        // is measured from 5.5 s (the previous batch), so 70% of its wait
        // and of its foreign work.
        assert!(batcher.add(&probe(5.2, 1000), 300, 6_200 * MS).is_some());
        let last = batcher.add(&probe(7.0, 0), 1, 7_100 * MS).unwrap();
        assert_eq!(
            last,
            StepSample {
                work_tokens: 300 + 700,
                elapsed_nanos: 700 * MS,
                end_nanos: 6_200 * MS
            }
        );
    }

    #[test]
    fn a_busy_worker_is_learned_at_its_true_rate() {
        // An 8000 tok/s engine clearing prompts of 1000 tokens in steps of
        // 2000: two first tokens every 250 ms, the queue never empty, prompts
        // part-way through prefill at every dispatch.
        let shared = LearnedRate::new(RateEstimator::new(8000.0, 256, 30.0));
        for step in 1..=40i64 {
            for second in [false, true] {
                let learned = shared.observe_first_token(
                    first_token(0.0, 1000, step * SEC / 4),
                    0,
                    step * SEC / 4,
                    None,
                );
                // The first of each step closes the step before.
                assert_eq!(learned, step > 1 && !second);
            }
        }
        assert_eq!(shared.samples(), 39);
        assert!(
            (shared.rate_tps() - 8000.0).abs() < 1.0,
            "{}",
            shared.rate_tps()
        );
    }

    fn first_token(dispatched_secs: f64, tokens: u64, at_nanos: i64) -> FirstToken {
        FirstToken {
            probe: probe(dispatched_secs, 0),
            tokens,
            at_nanos,
        }
    }

    #[test]
    fn several_replicas_first_tokens_are_learned_on_one_timeline() {
        // An 8000 tok/s engine computing two replicas' 1000-token prompts,
        // one of each per 250 ms step. Each replica alone sees 1000 tokens
        // per step: learned apart, the worker would look half as fast.
        let shared = LearnedRate::new(RateEstimator::new(4000.0, 256, 30.0));
        let hold_nanos = 100 * MS;
        for step in 1..=40i64 {
            let at = step * SEC / 4;
            // This replica's first token, at once...
            shared.observe_first_token(first_token(0.0, 1000, at), hold_nanos, at, None);
            // ...and the other's, heard 80 ms late: both held for 100 ms.
            let heard = at + 80 * MS;
            shared.observe_first_token(first_token(0.0, 1000, at), hold_nanos, heard, None);
        }
        assert!(
            (shared.rate_tps() / 8000.0 - 1.0).abs() < 0.01,
            "{}",
            shared.rate_tps()
        );
        // What is still held is learned later, in order.
        assert_eq!(shared.samples(), 38);
        assert_eq!(shared.dropped(), 0);
    }

    #[test]
    fn a_first_token_heard_after_later_ones_were_learned_is_dropped_and_counted() {
        let shared = LearnedRate::new(estimator());
        for step in 1..=4i64 {
            shared.observe_first_token(first_token(0.0, 1000, step * SEC), 0, step * SEC, None);
        }
        let before = shared.rate_tps();
        assert!(!shared.observe_first_token(first_token(0.0, 50_000, SEC / 2), 0, 5 * SEC, None));
        assert_eq!(shared.dropped(), 1);
        assert_eq!(shared.rate_tps(), before);
        // Within a step of the last one learned, it joins that step.
        shared.observe_first_token(first_token(0.0, 1000, 4 * SEC - MS), 0, 5 * SEC, None);
        assert_eq!(shared.dropped(), 1);
    }

    #[test]
    fn the_hold_follows_the_latest_lateness_and_decays_slowly() {
        let lateness = PeerLateness::default();
        assert_eq!(lateness.hold_nanos(), 0);
        lateness.heard(100 * MS);
        assert_eq!(lateness.hold_nanos(), 100 * MS);
        lateness.heard(10 * MS);
        assert!(lateness.hold_nanos() < 100 * MS && lateness.hold_nanos() > 99 * MS);
        for _ in 0..10_000 {
            lateness.heard(10 * MS);
        }
        assert_eq!(lateness.hold_nanos(), 10 * MS);
        // Clamped: a clock gone backwards holds nothing more, an hour no
        // more than the cap.
        lateness.heard(-SEC);
        assert!(lateness.hold_nanos() >= 0);
        lateness.heard(3600 * SEC);
        assert_eq!(lateness.hold_nanos(), MAX_HOLD_NANOS);
    }

    #[test]
    fn a_dropped_first_sample_still_leaves_the_worker_unlearned() {
        let shared = LearnedRate::new(estimator());
        let dropped = shared.observe(1000, 0, SEC, Some(8000.0));
        assert_eq!(dropped, Err(DroppedSample::NoElapsedTime));
        assert_eq!(shared.learned_tps(), None);
    }
}
