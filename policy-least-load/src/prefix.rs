//! The router-side prefix index: which workers are expected to still hold
//! which prompt prefixes in their prefix cache.
//!
//! One table, keyed by a chained block hash (so a key names a whole prefix),
//! holds the few workers that block was last dispatched to, each with the
//! worker's *token clock* at that dispatch. A worker's token clock counts the
//! prompt tokens dispatched to it that it did not already hold; a block is
//! still expected in its cache while fewer newer tokens than its cache bound
//! were dispatched there (least recently used eviction, in tokens). The bound
//! is `prefix_cache_tokens`, or the worker's reported KV capacity when that
//! is smaller (see [`PrefixIndex::set_capacity`]).
//!
//! A dispatch stamps every block of its prompt with the same clock, and any
//! prompt holding block `i` holds every block before it, so along one prompt
//! the stamps never grow: the workers expected to hold block `i` are a subset
//! of those holding block `i − 1`. The lookup uses that: it binary-searches
//! where the set of holders shrinks instead of walking every block, so a
//! selection reads `O(levels × log blocks)` entries, whatever the fleet's
//! size.
//!
//! The table is set-associative and takes no lock to read: a block's key
//! picks a group of [`WAYS`] entries (three cache lines: a version word and
//! the keys, then the holders), which readers read under the group's version
//! (a seqlock) and writers change holding it odd. A lookup therefore never
//! waits on a lock and writes no shared memory; records take the index's
//! writer lock, once per prompt (a lock per group would cost a locked
//! read-modify-write per block, most of a record's time).
//! Memory is fixed when the policy is built: `prefix_index_max_blocks`
//! entries (rounded down to a power of two, at least 16 and at most
//! [`MAX_ENTRIES`]), 48 bytes each. A
//! new block replaces, within its group, an empty entry, else one held by no
//! worker any more or not dispatched for `prefix_max_age_secs`, else the
//! least recently dispatched; a lookup ignores entries older than the age
//! bound.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};

use parking_lot::Mutex;
use policy_core::PrefixBlocks;

/// Workers a block is tracked on at most (the most recent ones).
pub const HOLDERS: usize = 4;

/// Entries per group of the table.
pub const WAYS: usize = 4;

/// A holder word: `(slot + 1) << STAMP_BITS | stamp`, 0 for none. The slot
/// has 16 bits, so slots up to [`MAX_SLOT`] are tracked; the stamp has 48,
/// which a worker's clock reaches after 2.8 × 10¹⁴ dispatched tokens.
const STAMP_BITS: u32 = 48;
const STAMP_MASK: u64 = (1 << STAMP_BITS) - 1;

/// The highest worker slot the index tracks (others are never expected to
/// hold anything).
pub const MAX_SLOT: usize = (1 << (64 - STAMP_BITS)) - 2;

/// Entries the table holds at most whatever the configuration (192 MiB):
/// the table is allocated whole when the policy is built.
pub const MAX_ENTRIES: usize = 1 << 22;

/// Worker clocks are allocated in chunks of this many slots, on first use.
const CLOCK_CHUNK: usize = 256;

/// An empty entry's key; a block hashing to it is stored as 1.
const NO_KEY: u64 = 0;

/// One group of the table: `WAYS` entries under one version.
#[derive(Debug, Default)]
#[repr(C, align(64))]
struct Group {
    /// Odd while a writer holds the group.
    version: AtomicU64,
    keys: [AtomicU64; WAYS],
    /// When each entry was last dispatched, ms on the policy's timeline.
    touched_ms: [AtomicU32; WAYS],
    holders: [[AtomicU64; HOLDERS]; WAYS],
}

/// One entry as read.
#[derive(Debug, Clone, Copy)]
struct EntryRead {
    holders: [u64; HOLDERS],
    touched_ms: u32,
}

/// Per worker: its token clock and its reported KV capacity.
#[derive(Debug, Default)]
struct WorkerClock {
    inserted_tokens: AtomicU64,
    /// KV capacity in tokens from the worker's last load report; 0 when it
    /// reported none.
    capacity_tokens: AtomicU64,
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
            entries: [(u32::MAX, 0); HOLDERS],
            len: 0,
        }
    }
}

impl Matches {
    /// The most any worker is expected to hold (0 when none holds any).
    pub fn max_cached_tokens(&self) -> u64 {
        self.entries[..self.len]
            .iter()
            .map(|&(_, tokens)| tokens)
            .max()
            .unwrap_or(0)
    }

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

    /// Whether the worker in `slot` is expected to hold any of the prompt.
    #[inline]
    pub fn holds(&self, slot: usize) -> bool {
        self.entries[..self.len]
            .iter()
            .any(|(s, _)| *s as usize == slot)
    }
}

/// How one request's prompt is read by the index: its index blocks.
#[derive(Debug, Clone, Copy)]
struct Blocks<'p> {
    hashes: &'p [u64],
    /// Request blocks per index block.
    stride: usize,
    count: usize,
    tokens_per_block: u64,
}

impl Blocks<'_> {
    /// Index block `i` of the request: the chained hash ending it.
    #[inline]
    fn key(&self, i: usize) -> u64 {
        let key = self.hashes[(i + 1) * self.stride - 1];
        if key == NO_KEY { 1 } else { key }
    }
}

/// The index (see the module docs).
#[derive(Debug)]
pub struct PrefixIndex {
    groups: Box<[Group]>,
    group_mask: usize,
    clocks: Box<[OnceLock<Box<[WorkerClock]>>]>,
    index_block_tokens: u64,
    cache_tokens: u64,
    max_age_ms: u32,
    /// Serializes records; readers take no lock.
    writer: Mutex<()>,
}

/// A writer is mid-update (a handful of stores): wait it out, yielding if it
/// was preempted there.
fn backoff(spins: u32) -> u32 {
    if spins < 64 {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
    spins.saturating_add(1)
}

impl PrefixIndex {
    pub fn new(
        index_block_tokens: u64,
        cache_tokens: u64,
        max_blocks: u64,
        max_age_secs: f64,
    ) -> PrefixIndex {
        let max_blocks = usize::try_from(max_blocks)
            .unwrap_or(usize::MAX)
            .clamp(16, MAX_ENTRIES);
        // The largest power of two of groups that stays within the bound.
        let groups = 1usize << (usize::BITS - 1 - (max_blocks / WAYS).leading_zeros());
        PrefixIndex {
            groups: (0..groups).map(|_| Group::default()).collect(),
            group_mask: groups - 1,
            clocks: (0..MAX_SLOT.div_ceil(CLOCK_CHUNK) + 1)
                .map(|_| OnceLock::new())
                .collect(),
            index_block_tokens: index_block_tokens.max(1),
            cache_tokens: cache_tokens.max(1),
            max_age_ms: (max_age_secs * 1000.0).clamp(1.0, f64::from(u32::MAX / 2)) as u32,
            writer: Mutex::new(()),
        }
    }

    /// Entries the table holds at most.
    pub fn capacity(&self) -> usize {
        self.groups.len() * WAYS
    }

    /// The index blocks of `prefix`: every `stride`-th hash, so one index
    /// block covers `stride × block_tokens` tokens.
    fn blocks<'p>(&self, prefix: &'p PrefixBlocks) -> Blocks<'p> {
        let block = u64::from(prefix.block_tokens().max(1));
        let stride = usize::try_from(self.index_block_tokens.div_ceil(block))
            .unwrap_or(usize::MAX)
            .max(1);
        Blocks {
            hashes: prefix.hashes(),
            stride,
            count: prefix.hashes().len() / stride,
            tokens_per_block: block.saturating_mul(stride as u64),
        }
    }

    #[inline]
    fn group(&self, key: u64) -> &Group {
        // Keys are chained hashes, already well mixed.
        &self.groups[(key as usize) & self.group_mask]
    }

    fn clock(&self, slot: usize) -> Option<&WorkerClock> {
        self.clocks
            .get(slot / CLOCK_CHUNK)?
            .get()?
            .get(slot % CLOCK_CHUNK)
    }

    fn clock_or_new(&self, slot: usize) -> Option<&WorkerClock> {
        if slot > MAX_SLOT {
            return None;
        }
        self.clocks
            .get(slot / CLOCK_CHUNK)?
            .get_or_init(|| (0..CLOCK_CHUNK).map(|_| WorkerClock::default()).collect())
            .get(slot % CLOCK_CHUNK)
    }

    /// Tokens the worker's cache is assumed to hold: the configured bound,
    /// or the worker's reported KV capacity when smaller.
    #[inline]
    fn bound_tokens(&self, clock: &WorkerClock) -> u64 {
        match clock.capacity_tokens.load(Ordering::Relaxed) {
            0 => self.cache_tokens,
            reported => reported.min(self.cache_tokens),
        }
    }

    /// The worker in `slot` reported a KV capacity of `capacity_tokens`
    /// (`None`: its report carries none): its cache bound becomes the
    /// smaller of that and `prefix_cache_tokens`.
    pub fn set_capacity(&self, slot: usize, capacity_tokens: Option<u64>) {
        let tokens = capacity_tokens.unwrap_or(0);
        match self.clock(slot) {
            Some(clock) => clock.capacity_tokens.store(tokens, Ordering::Relaxed),
            // Nothing dispatched there yet: allocate only for a real bound.
            None if tokens > 0 => {
                if let Some(clock) = self.clock_or_new(slot) {
                    clock.capacity_tokens.store(tokens, Ordering::Relaxed);
                }
            }
            None => {}
        }
    }

    /// The cache bound in force for the worker in `slot`, tokens.
    pub fn cache_bound_tokens(&self, slot: usize) -> u64 {
        self.clock(slot)
            .map_or(self.cache_tokens, |clock| self.bound_tokens(clock))
    }

    /// The worker slot of a holder word, if the worker is still expected to
    /// hold the block.
    #[inline]
    fn valid_slot(&self, holder: u64) -> Option<u32> {
        self.age_tokens(holder)
            .map(|_| ((holder >> STAMP_BITS) - 1) as u32)
    }

    /// Tokens dispatched to the holder's worker since it was stamped, if
    /// fewer than its cache bound (else it is expected to be evicted).
    #[inline]
    fn age_tokens(&self, holder: u64) -> Option<u64> {
        if holder == 0 {
            return None;
        }
        let clock = self.clock(((holder >> STAMP_BITS) - 1) as usize)?;
        let age = clock
            .inserted_tokens
            .load(Ordering::Relaxed)
            .saturating_sub(holder & STAMP_MASK);
        (age < self.bound_tokens(clock)).then_some(age)
    }

    fn fresh(&self, touched_ms: u32, now_ms: u32) -> bool {
        now_ms.saturating_sub(touched_ms) <= self.max_age_ms
    }

    /// Reads a word of each cache line of every group `blocks` maps to, all
    /// at once: the lookup's binary search and the record's stamps then find
    /// them in cache. Issued back to back, the loads' misses overlap, where
    /// the search (each probe depends on the last) and the stamps (each a
    /// locked read-modify-write, which waits for everything before it) would
    /// take them one at a time.
    fn warm(&self, blocks: &Blocks<'_>) {
        let mut sum = 0u64;
        for i in 0..blocks.count {
            let group = self.group(blocks.key(i));
            sum ^= group.version.load(Ordering::Relaxed)
                ^ group.holders[1][0].load(Ordering::Relaxed)
                ^ group.holders[WAYS - 1][0].load(Ordering::Relaxed);
        }
        std::hint::black_box(sum);
    }

    /// The entry for `key`, read under its group's version.
    fn read(&self, key: u64) -> Option<EntryRead> {
        let group = self.group(key);
        let mut spins = 0u32;
        loop {
            let before = group.version.load(Ordering::Acquire);
            if before & 1 == 0 {
                let entry = (0..WAYS)
                    .find(|&way| group.keys[way].load(Ordering::Relaxed) == key)
                    .map(|way| EntryRead {
                        holders: std::array::from_fn(|h| {
                            group.holders[way][h].load(Ordering::Relaxed)
                        }),
                        touched_ms: group.touched_ms[way].load(Ordering::Relaxed),
                    });
                // Orders the loads above before the version re-check.
                fence(Ordering::Acquire);
                if group.version.load(Ordering::Relaxed) == before {
                    return entry;
                }
            }
            spins = backoff(spins);
        }
    }

    /// The workers still expected to hold the block `key` at `now_ms`.
    fn holders_at(&self, key: u64, now_ms: u32) -> ([u32; HOLDERS], usize) {
        let mut slots = [u32::MAX; HOLDERS];
        let mut count = 0;
        if let Some(entry) = self.read(key)
            && self.fresh(entry.touched_ms, now_ms)
        {
            for holder in entry.holders {
                if let Some(slot) = self.valid_slot(holder) {
                    slots[count] = slot;
                    count += 1;
                }
            }
        }
        (slots, count)
    }

    /// The expected cached prefix of `prefix` at `now_ms` on every worker
    /// that holds one.
    pub fn lookup(&self, prefix: &PrefixBlocks, now_ms: u32) -> Matches {
        let mut matches = Matches::default();
        if prefix.is_empty() {
            return matches;
        }
        let blocks = self.blocks(prefix);
        self.warm(&blocks);
        let mut lo = 0usize;
        while lo < blocks.count {
            let (_, count) = self.holders_at(blocks.key(lo), now_ms);
            if count == 0 {
                break;
            }
            // The last block at or after `lo` still held by as many workers
            // (holders only shrink along a prompt).
            let (mut good, mut bad) = (lo, blocks.count);
            while bad - good > 1 {
                let mid = good + (bad - good) / 2;
                if self.holders_at(blocks.key(mid), now_ms).1 >= count {
                    good = mid;
                } else {
                    bad = mid;
                }
            }
            let (slots, held) = self.holders_at(blocks.key(good), now_ms);
            for slot in &slots[..held] {
                matches.set(*slot, (good as u64 + 1) * blocks.tokens_per_block);
            }
            lo = good + 1;
        }
        matches
    }

    /// Records that `prefix` was dispatched to the worker in `slot`, which
    /// was expected to hold `cached_tokens` of it, at `now_ms`.
    pub fn record(&self, slot: usize, prefix: &PrefixBlocks, cached_tokens: u64, now_ms: u32) {
        if prefix.is_empty() {
            return;
        }
        let blocks = self.blocks(prefix);
        if blocks.count == 0 {
            return;
        }
        let Some(clock) = self.clock_or_new(slot) else {
            return;
        };
        self.warm(&blocks);
        let total = blocks.count as u64 * blocks.tokens_per_block;
        let added = total.saturating_sub(cached_tokens).max(1);
        let stamp = clock
            .inserted_tokens
            .fetch_add(added, Ordering::Relaxed)
            .saturating_add(added)
            .min(STAMP_MASK);
        let word = ((slot as u64 + 1) << STAMP_BITS) | stamp;
        // One lock for the whole prompt, where a lock per block would take
        // a locked read-modify-write per block.
        let _writer = self.writer.lock();
        for i in 0..blocks.count {
            self.stamp(blocks.key(i), slot as u64 + 1, word, now_ms);
        }
    }

    /// Stamps block `key` with the holder `word` (whose worker's slot + 1 is
    /// `tag`), holding the block's group.
    /// The caller holds the index's writer lock, so the group's version is
    /// even here and no other writer changes it.
    fn stamp(&self, key: u64, tag: u64, word: u64, now_ms: u32) {
        let group = self.group(key);
        let version = group.version.load(Ordering::Relaxed);
        group
            .version
            .store(version.wrapping_add(1), Ordering::Relaxed);
        // Readers that see any store below also see the odd version.
        fence(Ordering::Release);
        let way = match (0..WAYS).find(|&way| group.keys[way].load(Ordering::Relaxed) == key) {
            Some(way) => way,
            None => {
                let way = self.victim(group, now_ms);
                group.keys[way].store(key, Ordering::Relaxed);
                for holder in &group.holders[way] {
                    holder.store(0, Ordering::Relaxed);
                }
                way
            }
        };
        group.touched_ms[way].store(now_ms, Ordering::Relaxed);
        let holders = &group.holders[way];
        // The worker's own holder, else an empty or expired one, else the
        // one dispatched to longest ago (in its worker's tokens).
        let position = holders
            .iter()
            .position(|h| h.load(Ordering::Relaxed) >> STAMP_BITS == tag)
            .or_else(|| {
                holders
                    .iter()
                    .enumerate()
                    .max_by_key(|(_, h)| {
                        self.age_tokens(h.load(Ordering::Relaxed))
                            .unwrap_or(u64::MAX)
                    })
                    .map(|(index, _)| index)
            })
            .unwrap_or(0);
        holders[position].store(word, Ordering::Relaxed);
        group
            .version
            .store(version.wrapping_add(2), Ordering::Release);
    }

    /// The way of `group` a new block takes: an empty one, else one held by
    /// no worker or older than the age bound, else the least recently
    /// dispatched. The caller holds the group.
    fn victim(&self, group: &Group, now_ms: u32) -> usize {
        let mut lru: Option<(usize, u32)> = None;
        for way in 0..WAYS {
            if group.keys[way].load(Ordering::Relaxed) == NO_KEY {
                return way;
            }
            let touched_ms = group.touched_ms[way].load(Ordering::Relaxed);
            let held = group.holders[way]
                .iter()
                .any(|holder| self.age_tokens(holder.load(Ordering::Relaxed)).is_some());
            if !held || !self.fresh(touched_ms, now_ms) {
                return way;
            }
            let since_ms = now_ms.saturating_sub(touched_ms);
            if lru.is_none_or(|(_, lru_since_ms)| since_ms > lru_since_ms) {
                lru = Some((way, since_ms));
            }
        }
        lru.map_or(0, |(way, _)| way)
    }

    /// Entries held now (a scan of the whole table).
    pub fn len(&self) -> usize {
        self.groups
            .iter()
            .map(|group| {
                group
                    .keys
                    .iter()
                    .filter(|key| key.load(Ordering::Relaxed) != NO_KEY)
                    .count()
            })
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
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
        let index = PrefixIndex::new(64, 1_000_000, 1000, 60.0);
        let a = blocks(chain(1, 64)); // 1024 tokens, 16 index blocks
        assert!(index.lookup(&a, 0).is_empty());
        index.record(3, &a, 0, 0);
        let found = index.lookup(&a, 0);
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
        assert_eq!(
            index.lookup(&blocks(longer.clone()), 1).cached_tokens(3),
            640
        );
        index.record(5, &blocks(longer.clone()), 0, 1);
        let found = index.lookup(&blocks(longer), 1);
        assert_eq!(found.cached_tokens(5), 1600);
        assert_eq!(found.cached_tokens(3), 640);
        // Unknown and empty prefixes find nothing.
        assert!(index.lookup(&PrefixBlocks::default(), 1).is_empty());
        assert!(index.lookup(&blocks(chain(9, 64)), 1).is_empty());
    }

    #[test]
    fn a_worker_forgets_a_prefix_after_its_cache_of_newer_tokens() {
        let index = PrefixIndex::new(16, 2000, 10_000, 60.0);
        let a = blocks(chain(1, 50)); // 800 tokens
        index.record(0, &a, 0, 0);
        index.record(0, &blocks(chain(2, 50)), 0, 0); // 800 newer
        assert_eq!(index.lookup(&a, 0).cached_tokens(0), 800);
        index.record(0, &blocks(chain(3, 50)), 0, 0); // 1600 newer: still < 2000
        assert_eq!(index.lookup(&a, 0).cached_tokens(0), 800);
        index.record(0, &blocks(chain(4, 50)), 0, 0); // 2400 newer: evicted
        assert_eq!(index.lookup(&a, 0).cached_tokens(0), 0);
        // A hit refreshes without advancing the clock by the cached part.
        index.record(0, &blocks(chain(4, 50)), 800, 0);
        assert_eq!(index.lookup(&blocks(chain(4, 50)), 0).cached_tokens(0), 800);
    }

    #[test]
    fn a_reported_kv_capacity_below_the_configured_bound_evicts_sooner() {
        let index = PrefixIndex::new(16, 2000, 10_000, 60.0);
        let a = blocks(chain(1, 50)); // 800 tokens
        for slot in [0, 1] {
            index.record(slot, &a, 0, 0);
            index.record(slot, &blocks(chain(2 + slot as u64, 50)), 0, 0); // 800 newer
        }
        assert_eq!(index.cache_bound_tokens(0), 2000);
        // Worker 0 reports a KV cache of 700 tokens: 800 newer ones evicted
        // the prefix. Worker 1 reports more than the configured bound, which
        // stands.
        index.set_capacity(0, Some(700));
        index.set_capacity(1, Some(1_000_000));
        assert_eq!(index.cache_bound_tokens(0), 700);
        assert_eq!(index.cache_bound_tokens(1), 2000);
        let found = index.lookup(&a, 0);
        assert_eq!(found.cached_tokens(0), 0);
        assert_eq!(found.cached_tokens(1), 800);
        // A report without a capacity brings the configured bound back.
        index.set_capacity(0, None);
        assert_eq!(index.cache_bound_tokens(0), 2000);
        assert_eq!(index.lookup(&a, 0).cached_tokens(0), 800);
        // A worker never dispatched to takes its bound from its first report.
        index.set_capacity(7, Some(100));
        assert_eq!(index.cache_bound_tokens(7), 100);
        assert_eq!(index.cache_bound_tokens(8), 2000);
    }

    #[test]
    fn memory_stays_bounded_and_old_entries_go_first() {
        let index = PrefixIndex::new(16, u64::MAX / 4, 256, 1.0);
        assert_eq!(index.capacity(), 256);
        for group in 0..100 {
            index.record(
                (group % 3) as usize,
                &blocks(chain(group, 20)),
                0,
                group as u32 * 10,
            );
            assert!(index.len() <= 256, "{}", index.len());
        }
        assert_eq!(index.len(), 256);
        // The newest prefix is still there.
        assert_eq!(
            index.lookup(&blocks(chain(99, 20)), 990).cached_tokens(0),
            320
        );
        // Past the age bound it is forgotten.
        assert!(index.lookup(&blocks(chain(99, 20)), 1_000_000).is_empty());
        // A non-power-of-two bound rounds down; a tiny one up to 16.
        assert_eq!(PrefixIndex::new(16, 1, 1000, 1.0).capacity(), 512);
        assert_eq!(PrefixIndex::new(16, 1, 0, 1.0).capacity(), 16);
    }

    #[test]
    fn at_most_holders_workers_track_one_block_and_bad_slots_are_ignored() {
        let index = PrefixIndex::new(16, 1_000_000, 1000, 60.0);
        let a = blocks(chain(1, 8));
        for slot in 0..(HOLDERS + 2) {
            index.record(slot, &a, 0, 0);
        }
        let found = index.lookup(&a, 0);
        let holding = (0..HOLDERS + 2)
            .filter(|s| found.cached_tokens(*s) > 0)
            .count();
        assert_eq!(holding, HOLDERS);
        // The two dispatched to first are the ones forgotten.
        assert_eq!(found.cached_tokens(0), 0);
        assert_eq!(found.cached_tokens(HOLDERS + 1), 128);
        index.record(MAX_SLOT + 1, &a, 0, 0);
        index.record(u32::MAX as usize, &a, 0, 0);
        index.record(usize::MAX, &a, 0, 0);
        assert_eq!(index.lookup(&a, 0).cached_tokens(MAX_SLOT + 1), 0);
        // A prompt shorter than one index block records nothing.
        let coarse = PrefixIndex::new(1024, 1_000_000, 1000, 60.0);
        coarse.record(0, &a, 0, 0);
        assert!(coarse.is_empty());
        assert!(coarse.lookup(&a, 0).is_empty());
    }

    #[test]
    fn concurrent_records_and_lookups_agree() {
        // Room for every block, so no block of one prompt evicts another.
        let index = PrefixIndex::new(16, 1_000_000, 1 << 16, 60.0);
        let prompts: Vec<PrefixBlocks> = (0..64).map(|g| blocks(chain(g, 32))).collect();
        std::thread::scope(|scope| {
            for thread in 0..2usize {
                let (index, prompts) = (&index, &prompts);
                scope.spawn(move || {
                    for round in 0..200 {
                        for (i, prompt) in prompts.iter().enumerate() {
                            if i % 2 == thread {
                                index.record(thread, prompt, 0, round);
                            }
                            let found = index.lookup(prompt, round);
                            // This thread's own record is whole; the other's
                            // may be part-way through the first time.
                            if i % 2 == thread {
                                assert_eq!(found.cached_tokens(thread), 512);
                            }
                            let other = found.cached_tokens(1 - thread);
                            assert!(other <= 512 && other % 16 == 0, "{other}");
                            assert_eq!(found.cached_tokens(2), 0);
                        }
                    }
                });
            }
        });
        for (i, prompt) in prompts.iter().enumerate() {
            assert_eq!(index.lookup(prompt, 200).cached_tokens(i % 2), 512, "{i}");
        }
    }
}
