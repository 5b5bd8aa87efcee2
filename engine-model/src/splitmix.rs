//! SplitMix64 (Steele, Lea and Flood, 2014), written once: the engines' step
//! jitter, the simulator's seeds and workloads, and the prefix-cache block
//! hashes all derive from it, so one seed replays one run.

/// SplitMix64's state increment (the golden ratio in 64 bits).
const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// SplitMix64's finalizer: every input bit reaches every output bit.
pub(crate) fn finalize(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The first output of a SplitMix64 seeded with `value`: derives an
/// independent seed or hash from a seed combined with an index.
///
/// ```
/// use engine_model::{SplitMix64, mix};
///
/// assert_eq!(mix(7), SplitMix64::new(7).next_u64());
/// assert_ne!(mix(7), mix(8));
/// ```
pub fn mix(value: u64) -> u64 {
    finalize(value.wrapping_add(GAMMA))
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
