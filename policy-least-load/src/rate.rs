//! A worker's prefill rate, learned from this router's own dispatches.
//!
//! Every dispatch is a measurement. When the router sends a request, it knows
//! the token-work ahead of it on the worker (the queued and pending terms the
//! score used) and the request's own tokens; when the first token comes back,
//! it knows how long clearing all of that took. Each such sample implies a
//! rate, `(work_ahead + own_tokens) / time_to_first_token`, and the estimate
//! is their weighted geometric mean:
//!
//! ```text
//! log rate = Σ w·tokens·log(implied rate) / Σ w·tokens
//! ```
//!
//! where each sample's weight `w` halves every `rate_half_life_secs`. A
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

use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

/// Implied rates below this are not prefill measurements (tokens/s).
pub const MIN_RATE_TPS: f64 = 1.0;
/// Implied rates above this are not prefill measurements (tokens/s).
pub const MAX_RATE_TPS: f64 = 1.0e8;
/// A sample's implied rate counts as at most this factor off the estimate.
pub const CLIP_FACTOR: f64 = 4.0;
/// Decay never takes the estimate's weight below this many times its
/// prior's: after an idle spell the estimate still outweighs the next few
/// samples, so one of them cannot replace it.
const RETAINED_PRIOR_MULTIPLE: f64 = 8.0;

/// What a dispatch remembers to become a rate sample at its first token.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RateProbe {
    /// When it was dispatched, on the policy's timeline.
    pub dispatched_nanos: i64,
    /// Token-work ahead of it on the worker at dispatch: queued + pending.
    pub work_ahead_tokens: u64,
    /// Whether its first token measures prefill. A non-streaming answer's
    /// head comes with the whole answer, so it does not.
    pub learn: bool,
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
    /// No sample yet: the prior.
    Prior,
    /// At least one sample.
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

    pub fn source(&self) -> LearnedSource {
        if self.samples == 0 {
            LearnedSource::Prior
        } else {
            LearnedSource::Learned
        }
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
        self.weight_tokens = (self.weight_tokens * factor).max(floor);
        self.weighted_log_rate = self.weight_tokens * log_rate;
        self.last_nanos = Some(now_nanos);
    }
}

/// A worker's [`RateEstimator`], shared: selections read the rate with one
/// atomic load; first tokens update it under a per-worker lock.
#[derive(Debug)]
pub struct LearnedRate {
    estimator: Mutex<RateEstimator>,
    rate_bits: AtomicU64,
    samples: AtomicU64,
    dropped: AtomicU64,
}

impl LearnedRate {
    pub fn new(estimator: RateEstimator) -> LearnedRate {
        LearnedRate {
            rate_bits: AtomicU64::new(estimator.rate_tps().to_bits()),
            samples: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            estimator: Mutex::new(estimator),
        }
    }

    pub fn rate_tps(&self) -> f64 {
        f64::from_bits(self.rate_bits.load(Ordering::Relaxed))
    }

    pub fn samples(&self) -> u64 {
        self.samples.load(Ordering::Relaxed)
    }

    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    pub fn source(&self) -> LearnedSource {
        if self.samples() == 0 {
            LearnedSource::Prior
        } else {
            LearnedSource::Learned
        }
    }

    /// See [`RateEstimator::observe`].
    pub fn observe(
        &self,
        work_tokens: u64,
        elapsed_nanos: i64,
        now_nanos: i64,
    ) -> Result<(), DroppedSample> {
        let mut estimator = self.estimator.lock();
        let outcome = estimator.observe(work_tokens, elapsed_nanos, now_nanos);
        self.rate_bits
            .store(estimator.rate_tps().to_bits(), Ordering::Relaxed);
        self.samples.store(estimator.samples(), Ordering::Relaxed);
        self.dropped.store(estimator.dropped(), Ordering::Relaxed);
        outcome
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: i64 = 1_000_000_000;

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
        assert_eq!(shared.source(), LearnedSource::Prior);
        shared.observe(4000, SEC / 2, SEC).unwrap();
        assert!(shared.rate_tps() > 2000.0);
        assert_eq!(shared.samples(), 1);
        assert_eq!(
            shared.observe(1, 600 * SEC, 2 * SEC),
            Err(DroppedSample::Absurd)
        );
        assert_eq!(shared.dropped(), 1);
        assert_eq!(shared.source(), LearnedSource::Learned);
    }
}
