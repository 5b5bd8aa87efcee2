//! SplitMix64 (Steele, Lea and Flood, 2014), written once: the policies'
//! tie-breaking (`TieBreaker`) and consistent-hash ring,
//! the engine model's step jitter and prefix-cache block hashes, and the
//! simulators' seeds and workloads all derive from it, so one seed replays
//! one run. `engine-model` re-exports it; `xtask`, which depends on no
//! workspace crate, compiles this file as its own module.
//!
//! The module uses nothing outside `core` and links to nothing in its
//! crate, so that it compiles (and documents) on its own.

/// SplitMix64's state increment (the golden ratio in 64 bits).
pub const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// SplitMix64's finalizer: every input bit reaches every output bit.
pub fn finalize(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The first output of a SplitMix64 seeded with `value`: derives an
/// independent seed or hash from a seed combined with an index, and spreads
/// nearby inputs over the whole `u64` range.
///
/// ```
/// use policy_core::splitmix::{SplitMix64, mix};
///
/// assert_eq!(mix(7), SplitMix64::new(7).next_u64());
/// assert_ne!(mix(7), mix(8));
/// ```
pub fn mix(value: u64) -> u64 {
    finalize(value.wrapping_add(GAMMA))
}

/// Output number `index` (from 0) of a SplitMix64 seeded with `seed`,
/// without stepping through the ones before: independent generators per
/// index.
///
/// ```
/// use policy_core::splitmix::{SplitMix64, mix_at};
///
/// let mut rng = SplitMix64::new(7);
/// let first_three = [rng.next_u64(), rng.next_u64(), rng.next_u64()];
/// assert_eq!(first_three, [mix_at(7, 0), mix_at(7, 1), mix_at(7, 2)]);
/// ```
pub fn mix_at(seed: u64, index: u64) -> u64 {
    mix(seed.wrapping_add(index.wrapping_mul(GAMMA)))
}

/// A tiny seeded generator: a seed replays the same sequence.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    pub fn new(seed: u64) -> SplitMix64 {
        SplitMix64 { state: seed }
    }

    pub fn next_u64(&mut self) -> u64 {
        let value = mix(self.state);
        self.state = self.state.wrapping_add(GAMMA);
        value
    }

    /// Uniform in `[0, 1)`.
    pub fn next_unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reference_sequence() {
        // The first outputs of SplitMix64 seeded with 0, as published with
        // the algorithm: seeds and placements depend on these exact values.
        let mut rng = SplitMix64::new(0);
        assert_eq!(rng.next_u64(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(rng.next_u64(), 0x6e78_9e6a_a1b9_65f4);
        assert_eq!(rng.next_u64(), 0x06c4_5d18_8009_454f);
    }
}
