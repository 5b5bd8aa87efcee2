//! The router-side prefix index: which workers are expected to still hold
//! which prompt prefixes in their prefix cache.
//!
//! One map, keyed by a chained block hash (so a key names a whole prefix),
//! holds the few workers that block was last dispatched to, each with the
//! worker's *token clock* at that dispatch. A worker's token clock counts the
//! prompt tokens dispatched to it that it did not already hold; a block is
//! still expected in its cache while fewer than `prefix_cache_tokens` newer
//! tokens were dispatched there (least recently used eviction, in tokens).
//!
//! A dispatch stamps every block of its prompt with the same clock, and any
//! prompt holding block `i` holds every block before it, so along one prompt
//! the stamps never grow: the workers expected to hold block `i` are a subset
//! of those holding block `i − 1`. The lookup uses that: it binary-searches
//! where the set of holders shrinks instead of walking every block, so a
//! selection reads `O(levels × log blocks)` entries.
//!
//! Memory is bounded by `prefix_index_max_blocks` entries of fixed size (no
//! allocation per entry); when full, entries not dispatched for
//! `prefix_max_age_secs`, or held by no worker any more, go first, then the
//! least recently dispatched quarter.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use policy_core::PrefixBlocks;

/// Workers a block is tracked on at most (the most recent ones).
pub const HOLDERS: usize = 4;

/// No worker in a holder slot.
const EMPTY: u32 = u32::MAX;

/// The keys are chained hashes, already well mixed: hashing them again is
/// wasted work on the selection's path.
#[derive(Debug, Default, Clone, Copy)]
pub struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = (self.0 << 8) | u64::from(byte);
        }
    }

    fn write_u64(&mut self, value: u64) {
        self.0 = value;
    }
}

#[derive(Debug, Clone, Copy)]
struct Holder {
    slot: u32,
    /// The worker's token clock when the block was last dispatched to it.
    stamp_tokens: u64,
}

const NO_HOLDER: Holder = Holder {
    slot: EMPTY,
    stamp_tokens: 0,
};

#[derive(Debug, Clone, Copy)]
struct Entry {
    holders: [Holder; HOLDERS],
    /// When the block was last dispatched, ms on the index's timeline.
    touched_ms: u32,
}

/// Per worker: its token clock.
#[derive(Debug, Clone, Copy, Default)]
struct WorkerClock {
    inserted_tokens: u64,
}

/// What the index expects the workers to hold of one request: up to
/// [`HOLDERS`] workers with a non-zero cached prefix (every other worker
/// holds none of it).
#[derive(Debug, Clone, Copy)]
pub struct Matches {
    entries: [(u32, u64); HOLDERS],
    len: usize,
}

impl Default for Matches {
    fn default() -> Matches {
        Matches {
            entries: [(EMPTY, 0); HOLDERS],
            len: 0,
        }
    }
}

impl Matches {
    /// Expected cached prompt tokens on the worker in `slot`.
    #[inline]
    pub fn cached_tokens(&self, slot: usize) -> u64 {
        self.entries[..self.len]
            .iter()
            .find(|(s, _)| *s as usize == slot)
            .map_or(0, |(_, tokens)| *tokens)
    }

    fn set(&mut self, slot: u32, tokens: u64) {
        if let Some(entry) = self.entries[..self.len]
            .iter_mut()
            .find(|(s, _)| *s == slot)
        {
            entry.1 = tokens;
        } else if self.len < HOLDERS {
            self.entries[self.len] = (slot, tokens);
            self.len += 1;
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// The index (see the module docs).
#[derive(Debug)]
pub struct PrefixIndex {
    map: HashMap<u64, Entry, BuildHasherDefault<IdentityHasher>>,
    clocks: Vec<WorkerClock>,
    index_block_tokens: u64,
    cache_tokens: u64,
    max_blocks: usize,
    max_age_ms: u32,
}

impl PrefixIndex {
    pub fn new(
        index_block_tokens: u64,
        cache_tokens: u64,
        max_blocks: u64,
        max_age_secs: f64,
    ) -> PrefixIndex {
        let max_blocks = usize::try_from(max_blocks).unwrap_or(usize::MAX).max(16);
        PrefixIndex {
            map: HashMap::with_capacity_and_hasher(max_blocks.min(1 << 20), Default::default()),
            clocks: Vec::new(),
            index_block_tokens: index_block_tokens.max(1),
            cache_tokens: cache_tokens.max(1),
            max_blocks,
            max_age_ms: (max_age_secs * 1000.0).clamp(1.0, f64::from(u32::MAX / 2)) as u32,
        }
    }

    /// Blocks of the index in `prefix`: every `stride`-th hash, so one
    /// index block covers `stride × block_tokens` tokens.
    fn stride(&self, prefix: &PrefixBlocks) -> usize {
        let block = u64::from(prefix.block_tokens().max(1));
        usize::try_from(self.index_block_tokens.div_ceil(block))
            .unwrap_or(usize::MAX)
            .max(1)
    }

    /// Index block `i` of the request: the chained hash ending it.
    #[inline]
    fn key(prefix: &PrefixBlocks, stride: usize, i: usize) -> u64 {
        prefix.hashes()[(i + 1) * stride - 1]
    }

    #[inline]
    fn valid(&self, holder: &Holder) -> bool {
        holder.slot != EMPTY
            && self.clocks.get(holder.slot as usize).is_some_and(|clock| {
                clock.inserted_tokens.saturating_sub(holder.stamp_tokens) < self.cache_tokens
            })
    }

    fn holders_at(&self, key: u64) -> Option<&Entry> {
        self.map.get(&key)
    }

    fn valid_count(&self, key: u64) -> usize {
        self.holders_at(key).map_or(0, |entry| {
            entry.holders.iter().filter(|h| self.valid(h)).count()
        })
    }

    /// The expected cached prefix of `prefix` on every worker that holds one.
    pub fn lookup(&self, prefix: &PrefixBlocks) -> Matches {
        let mut matches = Matches::default();
        if prefix.is_empty() {
            return matches;
        }
        let stride = self.stride(prefix);
        let blocks = prefix.hashes().len() / stride;
        let tokens_per_block = u64::from(prefix.block_tokens()) * stride as u64;
        let mut lo = 0usize;
        while lo < blocks {
            let count = self.valid_count(PrefixIndex::key(prefix, stride, lo));
            if count == 0 {
                break;
            }
            // The last block at or after `lo` still held by as many workers
            // (holders only shrink along a prompt).
            let (mut good, mut bad) = (lo, blocks);
            while bad - good > 1 {
                let mid = good + (bad - good) / 2;
                if self.valid_count(PrefixIndex::key(prefix, stride, mid)) >= count {
                    good = mid;
                } else {
                    bad = mid;
                }
            }
            if let Some(entry) = self.holders_at(PrefixIndex::key(prefix, stride, good)) {
                for holder in entry.holders.iter().filter(|h| self.valid(h)) {
                    matches.set(holder.slot, (good as u64 + 1) * tokens_per_block);
                }
            }
            lo = good + 1;
        }
        matches
    }

    /// Records that `prefix` was dispatched to the worker in `slot`, which
    /// was expected to hold `cached_tokens` of it, at `now_ms`.
    pub fn record(&mut self, slot: usize, prefix: &PrefixBlocks, cached_tokens: u64, now_ms: u32) {
        if prefix.is_empty() {
            return;
        }
        let Ok(slot_u32) = u32::try_from(slot) else {
            return;
        };
        if slot_u32 == EMPTY {
            return;
        }
        if self.clocks.len() <= slot {
            self.clocks.resize(slot + 1, WorkerClock::default());
        }
        let stride = self.stride(prefix);
        let blocks = prefix.hashes().len() / stride;
        let tokens_per_block = u64::from(prefix.block_tokens()) * stride as u64;
        let total = blocks as u64 * tokens_per_block;
        let clock = &mut self.clocks[slot];
        clock.inserted_tokens = clock
            .inserted_tokens
            .saturating_add(total.saturating_sub(cached_tokens).max(1));
        let stamp_tokens = clock.inserted_tokens;
        if self.map.len() + blocks > self.max_blocks {
            self.sweep(now_ms, blocks);
        }
        for i in 0..blocks {
            if self.map.len() >= self.max_blocks {
                break;
            }
            let key = PrefixIndex::key(prefix, stride, i);
            let cache_tokens = self.cache_tokens;
            let clocks = &self.clocks;
            let entry = self.map.entry(key).or_insert(Entry {
                holders: [NO_HOLDER; HOLDERS],
                touched_ms: now_ms,
            });
            entry.touched_ms = now_ms;
            // The worker's own holder, else an empty or expired one, else
            // the one dispatched to longest ago (in its worker's tokens).
            let position = entry
                .holders
                .iter()
                .position(|h| h.slot == slot_u32)
                .or_else(|| {
                    entry
                        .holders
                        .iter()
                        .enumerate()
                        .max_by_key(|(_, h)| match clocks.get(h.slot as usize) {
                            Some(clock) if h.slot != EMPTY => {
                                let age = clock.inserted_tokens.saturating_sub(h.stamp_tokens);
                                if age >= cache_tokens { u64::MAX } else { age }
                            }
                            _ => u64::MAX,
                        })
                        .map(|(index, _)| index)
                });
            if let Some(position) = position {
                entry.holders[position] = Holder {
                    slot: slot_u32,
                    stamp_tokens,
                };
            }
        }
    }

    /// Frees room: drops entries older than the age bound or held by no
    /// worker, then, if still more than three quarters full, the least
    /// recently dispatched quarter (estimated from a sample of entries).
    fn sweep(&mut self, now_ms: u32, room: usize) {
        let max_age_ms = self.max_age_ms;
        let cache_tokens = self.cache_tokens;
        let clocks = &self.clocks;
        self.map.retain(|_, entry| {
            now_ms.saturating_sub(entry.touched_ms) <= max_age_ms
                && entry.holders.iter().any(|h| {
                    h.slot != EMPTY
                        && clocks.get(h.slot as usize).is_some_and(|clock| {
                            clock.inserted_tokens.saturating_sub(h.stamp_tokens) < cache_tokens
                        })
                })
        });
        let target = (self.max_blocks * 3 / 4).min(self.max_blocks.saturating_sub(room));
        while self.map.len() > target {
            let mut sample = [0u32; 256];
            let mut taken = 0;
            for entry in self.map.values().take(sample.len()) {
                sample[taken] = entry.touched_ms;
                taken += 1;
            }
            sample[..taken].sort_unstable();
            let cutoff = sample[taken / 4];
            self.map.retain(|_, entry| entry.touched_ms > cutoff);
        }
    }

    /// Entries held now.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(group: u64, blocks: usize) -> Vec<u64> {
        let mut previous = 0u64;
        (0..blocks)
            .map(|i| {
                previous = previous
                    .wrapping_mul(0x9e37_79b9_7f4a_7c15)
                    .wrapping_add(group * 1_000_003 + i as u64 + 1);
                previous ^ (previous >> 29)
            })
            .collect()
    }

    fn blocks(hashes: Vec<u64>) -> PrefixBlocks {
        PrefixBlocks::new(16, hashes)
    }

    #[test]
    fn a_dispatched_prefix_is_found_on_its_worker_only() {
        let mut index = PrefixIndex::new(64, 1_000_000, 1000, 60.0);
        let a = blocks(chain(1, 64)); // 1024 tokens, 16 index blocks
        assert!(index.lookup(&a).is_empty());
        index.record(3, &a, 0, 0);
        let found = index.lookup(&a);
        assert_eq!(found.cached_tokens(3), 1024);
        assert_eq!(found.cached_tokens(0), 0);
        // A longer prompt sharing the first 40 blocks (640 tokens).
        let mut longer = chain(1, 40);
        longer.extend(chain(2, 60).into_iter().map(|h| h ^ 0xabc));
        let mut previous = longer[39];
        for hash in &mut longer[40..] {
            previous = previous.rotate_left(7) ^ *hash;
            *hash = previous;
        }
        assert_eq!(index.lookup(&blocks(longer.clone())).cached_tokens(3), 640);
        index.record(5, &blocks(longer.clone()), 0, 1);
        let found = index.lookup(&blocks(longer));
        assert_eq!(found.cached_tokens(5), 1600);
        assert_eq!(found.cached_tokens(3), 640);
        // Unknown and empty prefixes find nothing.
        assert!(index.lookup(&PrefixBlocks::default()).is_empty());
        assert!(index.lookup(&blocks(chain(9, 64))).is_empty());
    }

    #[test]
    fn a_worker_forgets_a_prefix_after_its_cache_of_newer_tokens() {
        let mut index = PrefixIndex::new(16, 2000, 10_000, 60.0);
        let a = blocks(chain(1, 50)); // 800 tokens
        index.record(0, &a, 0, 0);
        index.record(0, &blocks(chain(2, 50)), 0, 0); // 800 newer
        assert_eq!(index.lookup(&a).cached_tokens(0), 800);
        index.record(0, &blocks(chain(3, 50)), 0, 0); // 1600 newer: still < 2000
        assert_eq!(index.lookup(&a).cached_tokens(0), 800);
        index.record(0, &blocks(chain(4, 50)), 0, 0); // 2400 newer: evicted
        assert_eq!(index.lookup(&a).cached_tokens(0), 0);
        // A hit refreshes without advancing the clock by the cached part.
        index.record(0, &blocks(chain(4, 50)), 800, 0);
        assert_eq!(index.lookup(&blocks(chain(4, 50))).cached_tokens(0), 800);
    }

    #[test]
    fn memory_stays_bounded_and_old_entries_go_first() {
        let mut index = PrefixIndex::new(16, u64::MAX / 4, 64, 1.0);
        for group in 0..100 {
            index.record(
                (group % 3) as usize,
                &blocks(chain(group, 20)),
                0,
                group as u32 * 10,
            );
            assert!(index.len() <= 64, "{}", index.len());
        }
        // The newest prefix is still there.
        assert_eq!(index.lookup(&blocks(chain(99, 20))).cached_tokens(0), 320);
        // Past the age bound everything goes at the next sweep.
        index.record(1, &blocks(chain(500, 60)), 0, 1_000_000);
        assert!(index.lookup(&blocks(chain(99, 20))).is_empty());
    }

    #[test]
    fn at_most_holders_workers_track_one_block_and_bad_slots_are_ignored() {
        let mut index = PrefixIndex::new(16, 1_000_000, 1000, 60.0);
        let a = blocks(chain(1, 8));
        for slot in 0..(HOLDERS + 2) {
            index.record(slot, &a, 0, 0);
        }
        let found = index.lookup(&a);
        let holding = (0..HOLDERS + 2)
            .filter(|s| found.cached_tokens(*s) > 0)
            .count();
        assert_eq!(holding, HOLDERS);
        index.record(u32::MAX as usize, &a, 0, 0);
        index.record(usize::MAX, &a, 0, 0);
        // A prompt shorter than one index block records nothing.
        let mut coarse = PrefixIndex::new(1024, 1_000_000, 1000, 60.0);
        coarse.record(0, &a, 0, 0);
        assert!(coarse.is_empty());
        assert!(coarse.lookup(&a).is_empty());
    }
}
