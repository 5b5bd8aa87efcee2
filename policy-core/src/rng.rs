//! Seeded, lock-free randomness for tie-breaking and sampling.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::splitmix::{GAMMA, mix};

/// A SplitMix64 generator whose state is one atomic counter: every call is a
/// single `fetch_add`, so concurrent selections never wait on each other, and a
/// given seed replays the same sequence in a single-threaded simulation.
#[derive(Debug)]
pub struct TieBreaker {
    state: AtomicU64,
}

impl TieBreaker {
    pub fn new(seed: u64) -> TieBreaker {
        TieBreaker {
            state: AtomicU64::new(seed),
        }
    }

    /// The same sequence as a [`SplitMix64`](crate::splitmix::SplitMix64)
    /// of the same seed.
    pub fn next_u64(&self) -> u64 {
        mix(self.state.fetch_add(GAMMA, Ordering::Relaxed))
    }

    /// A uniform integer in `0..bound` (`bound` > 0), by multiply-shift.
    pub fn below(&self, bound: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(bound)) >> 64) as u64
    }
}

/// A key [`ArgMin`] can rank. Keys that are not rankable (a NaN or infinite
/// score) never win.
pub trait RankKey: Copy + PartialOrd {
    fn is_rankable(&self) -> bool;
}

impl RankKey for f64 {
    fn is_rankable(&self) -> bool {
        self.is_finite()
    }
}

impl RankKey for i64 {
    fn is_rankable(&self) -> bool {
        true
    }
}

/// Argmin over keyed items with ties broken uniformly at random (reservoir
/// sampling), never first-index-wins. Non-finite scores never win.
#[derive(Debug)]
pub struct ArgMin<T, K = f64> {
    best: Option<(T, K)>,
    ties: u64,
}

impl<T, K> Default for ArgMin<T, K> {
    fn default() -> ArgMin<T, K> {
        ArgMin {
            best: None,
            ties: 0,
        }
    }
}

impl<T, K: RankKey> ArgMin<T, K> {
    pub fn new() -> ArgMin<T, K> {
        ArgMin::default()
    }

    pub fn offer(&mut self, item: T, key: K, rng: &TieBreaker) {
        if !key.is_rankable() {
            return;
        }
        match &self.best {
            Some((_, best)) if key > *best => {}
            Some((_, best)) if key == *best => {
                self.ties += 1;
                if rng.below(self.ties) == 0 {
                    self.best = Some((item, key));
                }
            }
            _ => {
                self.best = Some((item, key));
                self.ties = 1;
            }
        }
    }

    pub fn best(self) -> Option<(T, K)> {
        self.best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_sequence() {
        let a = TieBreaker::new(7);
        let b = TieBreaker::new(7);
        let xs: Vec<u64> = (0..8).map(|_| a.next_u64()).collect();
        let ys: Vec<u64> = (0..8).map(|_| b.next_u64()).collect();
        assert_eq!(xs, ys);
        assert_ne!(xs[0], xs[1]);
        let mut plain = crate::splitmix::SplitMix64::new(7);
        let zs: Vec<u64> = (0..8).map(|_| plain.next_u64()).collect();
        assert_eq!(xs, zs);
    }

    #[test]
    fn below_stays_in_range() {
        let rng = TieBreaker::new(1);
        assert!((0..10_000).all(|_| rng.below(3) < 3));
    }

    #[test]
    fn ties_are_spread_over_every_tied_item() {
        let rng = TieBreaker::new(42);
        let mut wins = [0u32; 4];
        for _ in 0..4000 {
            let mut argmin = ArgMin::new();
            for (index, score) in [1.0, 1.0, 2.0, 1.0].into_iter().enumerate() {
                argmin.offer(index, score, &rng);
            }
            let (winner, _) = argmin.best().unwrap();
            wins[winner] += 1;
        }
        assert_eq!(wins[2], 0, "the higher score never wins");
        for index in [0, 1, 3] {
            // Each of three tied items expects 1333 wins; 1000 is far outside noise.
            assert!(wins[index] > 1000, "item {index} won {} times", wins[index]);
        }
    }

    #[test]
    fn nan_never_wins() {
        let rng = TieBreaker::new(3);
        let mut argmin = ArgMin::new();
        argmin.offer("nan", f64::NAN, &rng);
        argmin.offer("inf", f64::INFINITY, &rng);
        argmin.offer("ten", 10.0, &rng);
        argmin.offer("nan2", f64::NAN, &rng);
        assert_eq!(argmin.best().map(|(item, _)| item), Some("ten"));
        let mut only_nan = ArgMin::new();
        only_nan.offer(1, f64::NAN, &rng);
        assert!(only_nan.best().is_none());
    }
}
