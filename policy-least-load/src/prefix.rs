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
use policy_core::{PrefixBlocks, PrefixSnapshot, SnapshotBlock, SnapshotWorker};

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

/// Per worker: its token clock, its reported KV capacity, the cache bound
/// learned from its reported hits, and its latest predicted hits.
#[derive(Debug, Default)]
struct WorkerClock {
    inserted_tokens: AtomicU64,
    /// KV capacity in tokens from the worker's last load report; 0 when it
    /// reported none.
    capacity_tokens: AtomicU64,
    /// The cache bound learned from the worker's reported hits (or shared
    /// by another replica); 0 when none was learned.
    learned_tokens: AtomicU64,
    /// The latest dispatches that expected a hit there: what a report is
    /// compared with.
    predictions: Mutex<Predictions>,
}

/// Dispatches remembered per worker for their cache reports: the latest
/// [`PREDICTIONS`]; an older one's report teaches nothing.
const PREDICTIONS: usize = 16;

/// `(dispatch seq, age in the worker's tokens of the holding the hit was
/// expected from)`, written round-robin.
#[derive(Debug, Default)]
struct Predictions {
    entries: [(u64, u64); PREDICTIONS],
    next: usize,
}

impl Predictions {
    fn note(&mut self, seq: u64, age_tokens: u64) {
        self.entries[self.next] = (seq, age_tokens);
        self.next = (self.next + 1) % PREDICTIONS;
    }

    fn take(&mut self, seq: u64) -> Option<u64> {
        let entry = self.entries.iter_mut().find(|(s, _)| *s == seq)?;
        let age = entry.1;
        *entry = (u64::MAX, 0);
        Some(age)
    }
}

/// A miss on a holding younger than this share of the worker's bound is no
/// evidence of eviction: the prefix was most likely dispatched there so
/// recently that the engine had not computed it yet.
const MISS_EVIDENCE_SHARE: u64 = 8;

/// A hit on a holding within this share of the bound from it raises the
/// bound by the same share: the cache kept more than was assumed.
const HIT_RAISE_SHARE: u64 = 4;

/// What the index expects the workers to hold of one request: up to
/// [`HOLDERS`] workers with a non-zero cached prefix, the deepest holdings
/// when more hold some (every other worker is expected to hold none of it).
#[derive(Debug, Clone, Copy)]
pub struct Matches {
    /// `(slot, cached tokens, age in the worker's tokens of that holding)`.
    entries: [(u32, u64, u64); HOLDERS],
    len: usize,
}

impl Default for Matches {
    fn default() -> Matches {
        Matches {
            entries: [(u32::MAX, 0, 0); HOLDERS],
            len: 0,
        }
    }
}

impl Matches {
    /// The most any worker is expected to hold (0 when none holds any).
    pub fn max_cached_tokens(&self) -> u64 {
        self.entries[..self.len]
            .iter()
            .map(|&(_, tokens, _)| tokens)
            .max()
            .unwrap_or(0)
    }

    /// Expected cached prompt tokens on the worker in `slot`.
    #[inline]
    pub fn cached_tokens(&self, slot: usize) -> u64 {
        self.entries[..self.len]
            .iter()
            .find(|(s, _, _)| *s as usize == slot)
            .map_or(0, |(_, tokens, _)| *tokens)
    }

    /// Tokens dispatched to the worker in `slot` since it got the prefix it
    /// is expected to hold (0 when it holds none).
    pub fn age_tokens(&self, slot: usize) -> u64 {
        self.entries[..self.len]
            .iter()
            .find(|(s, _, _)| *s as usize == slot)
            .map_or(0, |(_, _, age)| *age)
    }

    fn set(&mut self, slot: u32, tokens: u64, age_tokens: u64) {
        if let Some(entry) = self.entries[..self.len]
            .iter_mut()
            .find(|(s, _, _)| *s == slot)
        {
            entry.1 = tokens;
            entry.2 = age_tokens;
        } else if self.len < HOLDERS {
            self.entries[self.len] = (slot, tokens, age_tokens);
            self.len += 1;
        } else if let Some(shallowest) = self
            .entries
            .iter_mut()
            .min_by_key(|(_, held, _)| *held)
            .filter(|(_, held, _)| *held < tokens)
        {
            // A prefix shared by more workers than are kept (a system
            // prompt) must not hide the one worker holding the rest of
            // the prompt: the deeper holding replaces the shallowest.
            *shallowest = (slot, tokens, age_tokens);
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
            .any(|(s, _, _)| *s as usize == slot)
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

/// The worker slot of a non-empty holder word.
#[inline]
fn holder_slot(holder: u64) -> u32 {
    ((holder >> STAMP_BITS) - 1) as u32
}

/// The index (see the module docs).
#[derive(Debug)]
pub struct PrefixIndex {
    groups: Box<[Group]>,
    group_mask: usize,
    clocks: Box<[OnceLock<Box<[WorkerClock; CLOCK_CHUNK]>>]>,
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
        let chunk = self.clocks.get(slot / CLOCK_CHUNK)?.get()?;
        Some(&chunk[slot % CLOCK_CHUNK])
    }

    fn clock_or_new(&self, slot: usize) -> Option<&WorkerClock> {
        if slot > MAX_SLOT {
            return None;
        }
        let chunk = self
            .clocks
            .get(slot / CLOCK_CHUNK)?
            .get_or_init(|| Box::new(std::array::from_fn(|_| WorkerClock::default())));
        Some(&chunk[slot % CLOCK_CHUNK])
    }

    /// Tokens the worker's cache is assumed to hold: the configured bound,
    /// or the worker's reported KV capacity or its learned bound when
    /// smaller.
    #[inline]
    fn bound_tokens(&self, clock: &WorkerClock) -> u64 {
        let mut bound = self.assumed_tokens(clock);
        let learned = clock.learned_tokens.load(Ordering::Relaxed);
        if learned > 0 {
            bound = bound.min(learned);
        }
        bound
    }

    /// The bound before learning: the configured one, or the reported KV
    /// capacity when smaller.
    #[inline]
    fn assumed_tokens(&self, clock: &WorkerClock) -> u64 {
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

    /// Tokens dispatched to the holder's worker since it was stamped, if
    /// fewer than its cache bound (else it is expected to be evicted).
    #[inline]
    fn age_tokens(&self, holder: u64) -> Option<u64> {
        if holder == 0 {
            return None;
        }
        let clock = self.clock(holder_slot(holder) as usize)?;
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

    /// The workers still expected to hold the block `key` at `now_ms`,
    /// with the tokens dispatched to each since it got the block.
    fn holders_at(&self, key: u64, now_ms: u32) -> ([(u32, u64); HOLDERS], usize) {
        let mut slots = [(u32::MAX, 0); HOLDERS];
        let mut count = 0;
        if let Some(entry) = self.read(key)
            && self.fresh(entry.touched_ms, now_ms)
        {
            for holder in entry.holders {
                if let Some(age) = self.age_tokens(holder) {
                    slots[count] = (holder_slot(holder), age);
                    count += 1;
                }
            }
        }
        (slots, count)
    }

    /// How many workers are still expected to hold the block `key` at
    /// `now_ms`: [`PrefixIndex::holders_at`]'s count, for the search.
    fn held_count(&self, key: u64, now_ms: u32) -> usize {
        self.read(key)
            .filter(|entry| self.fresh(entry.touched_ms, now_ms))
            .map_or(0, |entry| {
                entry
                    .holders
                    .iter()
                    .filter(|holder| self.age_tokens(**holder).is_some())
                    .count()
            })
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
            let count = self.held_count(blocks.key(lo), now_ms);
            if count == 0 {
                break;
            }
            // The last block at or after `lo` still held by as many workers
            // (holders only shrink along a prompt).
            let (mut good, mut bad) = (lo, blocks.count);
            while bad - good > 1 {
                let mid = good + (bad - good) / 2;
                if self.held_count(blocks.key(mid), now_ms) >= count {
                    good = mid;
                } else {
                    bad = mid;
                }
            }
            let (slots, held) = self.holders_at(blocks.key(good), now_ms);
            for &(slot, age) in &slots[..held] {
                matches.set(slot, (good as u64 + 1) * blocks.tokens_per_block, age);
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

    /// Records that another replica dispatched `prefix` to the worker in
    /// `slot` at `now_ms`: as [`PrefixIndex::record`] with the hit this
    /// index expects there, so the worker's token clock advances by what
    /// it did not already hold, as it would for a dispatch of its own.
    pub fn record_placed(&self, slot: usize, prefix: &PrefixBlocks, now_ms: u32) {
        let cached_tokens = self.lookup(prefix, now_ms).cached_tokens(slot);
        self.record(slot, prefix, cached_tokens, now_ms);
    }

    /// `prefix` at the index's own granularity: the hash ending each index
    /// block, so another index of the same block size reads the same keys
    /// from fewer hashes. Empty when the prompt fills no index block.
    pub fn coarsen(&self, prefix: &PrefixBlocks) -> PrefixBlocks {
        let blocks = self.blocks(prefix);
        let hashes: Vec<u64> = (0..blocks.count)
            .map(|i| blocks.hashes[(i + 1) * blocks.stride - 1])
            .collect();
        PrefixBlocks::new(
            u32::try_from(blocks.tokens_per_block).unwrap_or(u32::MAX),
            hashes,
        )
    }

    /// The dispatch `seq` to the worker in `slot` expected a hit from a
    /// holding `age_tokens` old: kept for its cache report.
    pub fn note_prediction(&self, slot: usize, seq: u64, age_tokens: u64) {
        if let Some(clock) = self.clock_or_new(slot) {
            clock.predictions.lock().note(seq, age_tokens);
        }
    }

    /// The engine in `slot` served `reported_tokens` of dispatch `seq`'s
    /// prompt from its cache where `predicted_tokens` were expected. A
    /// whole index block missed on a holding old enough to have been
    /// computed means the cache keeps fewer tokens than the bound: the
    /// bound steps down toward that holding's age, by a quarter at most (a
    /// cache squeezed for a moment by running requests does not make the
    /// index forget most of it). A hit near the bound raises it.
    /// Whatever was missed counts on the worker's clock.
    /// Returns the new bound when it changed.
    pub fn report(
        &self,
        slot: usize,
        seq: u64,
        predicted_tokens: u64,
        reported_tokens: u64,
    ) -> Option<u64> {
        let clock = self.clock(slot)?;
        let age = clock.predictions.lock().take(seq)?;
        // The engine computed what it missed: the worker's clock counts it,
        // as it would have had the miss been predicted.
        let missed = predicted_tokens.saturating_sub(reported_tokens);
        clock.inserted_tokens.fetch_add(missed, Ordering::Relaxed);
        let bound = self.bound_tokens(clock);
        let assumed = self.assumed_tokens(clock);
        let learned = if reported_tokens.saturating_add(self.index_block_tokens) <= predicted_tokens
        {
            if age < bound / MISS_EVIDENCE_SHARE {
                return None;
            }
            age.max(bound - bound / HIT_RAISE_SHARE)
        } else if reported_tokens >= predicted_tokens
            && age >= bound - bound / HIT_RAISE_SHARE
            && bound < assumed
        {
            bound.saturating_add(bound / HIT_RAISE_SHARE)
        } else {
            return None;
        };
        self.set_learned_bound(slot, learned)
    }

    /// Sets the worker's learned cache bound (from its own reports or
    /// another replica's); a bound at or above the assumed one clears it.
    /// Returns the bound in force when it changed.
    pub fn set_learned_bound(&self, slot: usize, cache_tokens: u64) -> Option<u64> {
        let clock = self.clock_or_new(slot)?;
        let before = self.bound_tokens(clock);
        let value = if cache_tokens >= self.assumed_tokens(clock) {
            0
        } else {
            cache_tokens.max(self.index_block_tokens)
        };
        clock.learned_tokens.store(value, Ordering::Relaxed);
        let after = self.bound_tokens(clock);
        (after != before).then_some(after)
    }

    /// The index as another replica loads it: every block still expected
    /// on one of `workers` (`(slot, url)`, the registered ones) at
    /// `now_ms`, with each holder's age, and each worker's clock and
    /// learned bound.
    pub fn export(&self, now_ms: u32, workers: &[(usize, String)]) -> PrefixSnapshot {
        let mut position_of =
            vec![None; workers.iter().map(|(slot, _)| slot + 1).max().unwrap_or(0)];
        for (position, (slot, _)) in workers.iter().enumerate() {
            position_of[*slot] = u32::try_from(position).ok();
        }
        let workers = workers
            .iter()
            .map(|(slot, url)| {
                let clock = self.clock(*slot);
                SnapshotWorker {
                    url: url.clone(),
                    clock_tokens: clock
                        .map_or(0, |clock| clock.inserted_tokens.load(Ordering::Relaxed)),
                    cache_tokens: clock
                        .map_or(0, |clock| clock.learned_tokens.load(Ordering::Relaxed)),
                }
            })
            .collect();
        let _writer = self.writer.lock();
        let mut blocks = Vec::new();
        for group in self.groups.iter() {
            for way in 0..WAYS {
                let hash = group.keys[way].load(Ordering::Relaxed);
                let touched_ms = group.touched_ms[way].load(Ordering::Relaxed);
                if hash == NO_KEY || !self.fresh(touched_ms, now_ms) {
                    continue;
                }
                let holders: Vec<(u32, u64)> = group.holders[way]
                    .iter()
                    .filter_map(|holder| {
                        let holder = holder.load(Ordering::Relaxed);
                        let age = self.age_tokens(holder)?;
                        let position = position_of.get(holder_slot(holder) as usize)?;
                        position.map(|position| (position, age))
                    })
                    .collect();
                if !holders.is_empty() {
                    blocks.push(SnapshotBlock {
                        hash,
                        age_ms: now_ms.saturating_sub(touched_ms),
                        holders,
                    });
                }
            }
        }
        PrefixSnapshot {
            block_tokens: u32::try_from(self.index_block_tokens).unwrap_or(u32::MAX),
            workers,
            blocks,
        }
    }

    /// Loads another replica's snapshot, its workers already mapped to this
    /// index's slots (`None`: a worker this index does not have). Each
    /// worker's clock first moves up to the exporter's, so every imported
    /// age is counted back from it; a holder this index has newer is kept.
    /// Returns the blocks stored; none when the block sizes differ.
    pub fn import(
        &self,
        snapshot: &PrefixSnapshot,
        slot_of: &[Option<usize>],
        now_ms: u32,
    ) -> usize {
        if u64::from(snapshot.block_tokens) != self.index_block_tokens {
            return 0;
        }
        for (worker, local) in snapshot.workers.iter().zip(slot_of) {
            let Some(clock) = local.and_then(|slot| self.clock_or_new(slot)) else {
                continue;
            };
            clock
                .inserted_tokens
                .fetch_max(worker.clock_tokens.min(STAMP_MASK), Ordering::Relaxed);
            if worker.cache_tokens > 0 && clock.learned_tokens.load(Ordering::Relaxed) == 0 {
                clock
                    .learned_tokens
                    .store(worker.cache_tokens, Ordering::Relaxed);
            }
        }
        let _writer = self.writer.lock();
        let mut stored = 0;
        for block in &snapshot.blocks {
            let mut any = false;
            for &(position, age_tokens) in &block.holders {
                let Some(slot) = slot_of.get(position as usize).copied().flatten() else {
                    continue;
                };
                let Some(clock) = self.clock(slot) else {
                    continue;
                };
                let stamp = clock
                    .inserted_tokens
                    .load(Ordering::Relaxed)
                    .saturating_sub(age_tokens)
                    .min(STAMP_MASK);
                let word = ((slot as u64 + 1) << STAMP_BITS) | stamp;
                let touched_ms = now_ms.saturating_sub(block.age_ms);
                self.stamp_if_newer(block.hash, slot as u64 + 1, word, touched_ms);
                any = true;
            }
            stored += usize::from(any);
        }
        stored
    }

    /// [`PrefixIndex::stamp`], unless the block already has this worker as
    /// a holder with a newer stamp. The caller holds the writer lock.
    fn stamp_if_newer(&self, key: u64, tag: u64, word: u64, touched_ms: u32) {
        let key = if key == NO_KEY { 1 } else { key };
        if let Some(entry) = self.read(key) {
            let newer = entry
                .holders
                .iter()
                .any(|&holder| holder >> STAMP_BITS == tag && holder >= word);
            if newer {
                return;
            }
        }
        self.stamp(key, tag, word, touched_ms);
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
        match (0..WAYS).find(|&way| group.keys[way].load(Ordering::Relaxed) == key) {
            Some(way) => {
                group.touched_ms[way].store(now_ms, Ordering::Relaxed);
                let holders = &group.holders[way];
                // The worker's own holder, else the one to replace.
                let position = holders
                    .iter()
                    .position(|h| h.load(Ordering::Relaxed) >> STAMP_BITS == tag)
                    .unwrap_or_else(|| self.replaced_holder(holders));
                holders[position].store(word, Ordering::Relaxed);
            }
            None => {
                let way = self.victim(group, now_ms);
                group.keys[way].store(key, Ordering::Relaxed);
                group.touched_ms[way].store(now_ms, Ordering::Relaxed);
                // A new entry's holders are all empty, and of equally old
                // holders [`PrefixIndex::replaced_holder`] takes the last.
                for (position, holder) in group.holders[way].iter().enumerate() {
                    let value = if position == HOLDERS - 1 { word } else { 0 };
                    holder.store(value, Ordering::Relaxed);
                }
            }
        }
        group
            .version
            .store(version.wrapping_add(2), Ordering::Release);
    }

    /// The holder a worker not yet among `holders` replaces: an empty or
    /// expired one, else the one dispatched to longest ago (in its worker's
    /// tokens); the last of equally old ones.
    fn replaced_holder(&self, holders: &[AtomicU64; HOLDERS]) -> usize {
        holders
            .iter()
            .enumerate()
            .max_by_key(|(_, h)| {
                self.age_tokens(h.load(Ordering::Relaxed))
                    .unwrap_or(u64::MAX)
            })
            .map_or(0, |(index, _)| index)
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
            // The age first: it needs no worker's clock.
            let touched_ms = group.touched_ms[way].load(Ordering::Relaxed);
            if !self.fresh(touched_ms, now_ms) {
                return way;
            }
            let held = group.holders[way]
                .iter()
                .any(|holder| self.age_tokens(holder.load(Ordering::Relaxed)).is_some());
            if !held {
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

    /// Way `way` of group `group`: its key, when it was last dispatched and
    /// its holder words, for the tests that compare the table with a model.
    #[cfg(test)]
    fn entry_for_test(&self, group: usize, way: usize) -> (u64, u32, [u64; HOLDERS]) {
        let group = &self.groups[group];
        (
            group.keys[way].load(Ordering::Relaxed),
            group.touched_ms[way].load(Ordering::Relaxed),
            std::array::from_fn(|h| group.holders[way][h].load(Ordering::Relaxed)),
        )
    }

    #[cfg(test)]
    fn groups_for_test(&self) -> usize {
        self.groups.len()
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

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
    fn a_prefix_shared_by_many_workers_does_not_hide_the_one_holding_the_rest() {
        // A system prompt every worker was sent, then one conversation
        // that went on at worker 9: its later blocks are only there.
        let index = PrefixIndex::new(16, 1_000_000, 1000, 60.0);
        let system = chain(1, 8);
        let conversation: Vec<u64> = system.iter().copied().chain(chain(2, 8)).collect();
        index.record(9, &blocks(conversation.clone()), 0, 0);
        for slot in 0..8 {
            index.record(slot, &blocks(system.clone()), 0, 0);
        }
        let found = index.lookup(&blocks(conversation), 0);
        assert_eq!(found.cached_tokens(9), 256);
        assert_eq!(found.max_cached_tokens(), 256);
        // Of the system prompt's holders, those kept beside it still count.
        let sharing = (0..8)
            .filter(|slot| found.cached_tokens(*slot) == 128)
            .count();
        assert_eq!(sharing, HOLDERS - 1);
    }

    /// The index's rules written plainly, one step at a time: the
    /// reference the table and its lookups are held to.
    mod model {
        use std::collections::HashMap;

        use super::super::{HOLDERS, MAX_SLOT, NO_KEY, STAMP_BITS, STAMP_MASK, WAYS};
        use policy_core::PrefixBlocks;

        #[derive(Debug, Clone, Copy)]
        pub struct Entry {
            pub key: u64,
            pub touched_ms: u32,
            /// `(slot, stamp)` per holder position.
            pub holders: [Option<(usize, u64)>; HOLDERS],
        }

        #[derive(Debug)]
        pub struct Model {
            pub groups: Vec<[Option<Entry>; WAYS]>,
            /// Per slot: (token clock, reported capacity or 0).
            clocks: HashMap<usize, (u64, u64)>,
            index_block_tokens: u64,
            cache_tokens: u64,
            max_age_ms: u32,
        }

        impl Model {
            pub fn new(
                groups: usize,
                index_block_tokens: u64,
                cache_tokens: u64,
                max_age_ms: u32,
            ) -> Model {
                Model {
                    groups: vec![[None; WAYS]; groups],
                    clocks: HashMap::new(),
                    index_block_tokens,
                    cache_tokens,
                    max_age_ms,
                }
            }

            /// (key per index block, tokens per index block).
            fn blocks(&self, prefix: &PrefixBlocks) -> (Vec<u64>, u64) {
                let block = u64::from(prefix.block_tokens().max(1));
                let stride = self.index_block_tokens.div_ceil(block) as usize;
                let keys = prefix
                    .hashes()
                    .chunks_exact(stride)
                    .map(|chunk| match chunk[stride - 1] {
                        NO_KEY => 1,
                        key => key,
                    })
                    .collect();
                (keys, block * stride as u64)
            }

            fn bound(&self, slot: usize) -> u64 {
                match self.clocks.get(&slot) {
                    Some(&(_, capacity)) if capacity > 0 => capacity.min(self.cache_tokens),
                    _ => self.cache_tokens,
                }
            }

            /// Tokens dispatched to the holder's worker since, if it still
            /// holds the block.
            fn age(&self, holder: Option<(usize, u64)>) -> Option<u64> {
                let (slot, stamp) = holder?;
                let (clock, _) = self.clocks.get(&slot)?;
                let age = clock.saturating_sub(stamp);
                (age < self.bound(slot)).then_some(age)
            }

            fn fresh(&self, touched_ms: u32, now_ms: u32) -> bool {
                now_ms.saturating_sub(touched_ms) <= self.max_age_ms
            }

            pub fn set_capacity(&mut self, slot: usize, capacity: Option<u64>) {
                let capacity = capacity.unwrap_or(0);
                if capacity > 0 || self.clocks.contains_key(&slot) {
                    self.clocks.entry(slot).or_insert((0, 0)).1 = capacity;
                }
            }

            pub fn record(&mut self, slot: usize, prefix: &PrefixBlocks, cached: u64, now_ms: u32) {
                let (keys, tokens_per_block) = self.blocks(prefix);
                if keys.is_empty() || slot > MAX_SLOT {
                    return;
                }
                let total = keys.len() as u64 * tokens_per_block;
                let added = total.saturating_sub(cached).max(1);
                let clock = &mut self.clocks.entry(slot).or_insert((0, 0)).0;
                *clock = clock.saturating_add(added);
                let stamp = (*clock).min(STAMP_MASK);
                for key in keys {
                    let group = key as usize % self.groups.len();
                    let way = match (0..WAYS)
                        .find(|&way| self.groups[group][way].is_some_and(|e| e.key == key))
                    {
                        Some(way) => way,
                        None => {
                            let way = self.victim(group, now_ms);
                            self.groups[group][way] = Some(Entry {
                                key,
                                touched_ms: now_ms,
                                holders: [None; HOLDERS],
                            });
                            way
                        }
                    };
                    let Some(mut entry) = self.groups[group][way] else {
                        continue;
                    };
                    entry.touched_ms = now_ms;
                    // Its own holder, else the oldest (expired and empty
                    // ones oldest of all), the last of equally old ones.
                    let position = match entry
                        .holders
                        .iter()
                        .position(|h| h.is_some_and(|(s, _)| s == slot))
                    {
                        Some(position) => position,
                        None => {
                            let mut oldest = 0;
                            let mut oldest_age = 0;
                            for (position, holder) in entry.holders.iter().enumerate() {
                                let age = self.age(*holder).unwrap_or(u64::MAX);
                                if age >= oldest_age {
                                    (oldest, oldest_age) = (position, age);
                                }
                            }
                            oldest
                        }
                    };
                    entry.holders[position] = Some((slot, stamp));
                    self.groups[group][way] = Some(entry);
                }
            }

            fn victim(&self, group: usize, now_ms: u32) -> usize {
                let ways = &self.groups[group];
                if let Some(way) = (0..WAYS).find(|&way| {
                    ways[way].is_none_or(|e| {
                        !self.fresh(e.touched_ms, now_ms)
                            || e.holders.iter().all(|h| self.age(*h).is_none())
                    })
                }) {
                    return way;
                }
                // The least recently dispatched, the first of equals.
                let mut lru = 0;
                for way in 1..WAYS {
                    let since =
                        |w: usize| ways[w].map_or(0, |e| now_ms.saturating_sub(e.touched_ms));
                    if since(way) > since(lru) {
                        lru = way;
                    }
                }
                lru
            }

            /// Workers still holding block `key`, in holder order.
            fn holders(&self, key: u64, now_ms: u32) -> Vec<usize> {
                let group = &self.groups[key as usize % self.groups.len()];
                group
                    .iter()
                    .flatten()
                    .find(|e| e.key == key && self.fresh(e.touched_ms, now_ms))
                    .map_or(Vec::new(), |e| {
                        e.holders
                            .iter()
                            .filter(|h| self.age(**h).is_some())
                            .filter_map(|h| h.map(|(slot, _)| slot))
                            .collect()
                    })
            }

            /// The documented search: from each block on, the last block
            /// still held by as many workers; each of those holds up to
            /// there. Returns (slot, cached tokens), at most `HOLDERS`: a
            /// deeper holder replaces the shallowest when full.
            pub fn lookup(&self, prefix: &PrefixBlocks, now_ms: u32) -> Vec<(usize, u64)> {
                let (keys, tokens_per_block) = self.blocks(prefix);
                let mut found: Vec<(usize, u64)> = Vec::new();
                let mut lo = 0;
                while lo < keys.len() {
                    let count = self.holders(keys[lo], now_ms).len();
                    if count == 0 {
                        break;
                    }
                    let (mut good, mut bad) = (lo, keys.len());
                    while bad - good > 1 {
                        let mid = good + (bad - good) / 2;
                        if self.holders(keys[mid], now_ms).len() >= count {
                            good = mid;
                        } else {
                            bad = mid;
                        }
                    }
                    let tokens = (good as u64 + 1) * tokens_per_block;
                    for slot in self.holders(keys[good], now_ms) {
                        if let Some(entry) = found.iter_mut().find(|(s, _)| *s == slot) {
                            entry.1 = tokens;
                        } else if found.len() < HOLDERS {
                            found.push((slot, tokens));
                        } else if let Some(shallowest) =
                            found.iter_mut().min_by_key(|(_, held)| *held)
                            && shallowest.1 < tokens
                        {
                            *shallowest = (slot, tokens);
                        }
                    }
                    lo = good + 1;
                }
                found
            }

            /// Way `way` of `group` as the table's words.
            pub fn words(&self, group: usize, way: usize) -> (u64, u32, [u64; HOLDERS]) {
                match self.groups[group][way] {
                    None => (NO_KEY, 0, [0; HOLDERS]),
                    Some(e) => (
                        e.key,
                        e.touched_ms,
                        e.holders.map(|h| {
                            h.map_or(0, |(slot, stamp)| ((slot as u64 + 1) << STAMP_BITS) | stamp)
                        }),
                    ),
                }
            }
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// Prompt, worker (an index into `SLOTS`), whether the record
        /// counts what the lookup found cached there, ms to advance first.
        Dispatch(usize, usize, bool, u32),
        Capacity(usize, Option<u64>),
    }

    /// Workers, some past the first 64 slots.
    const SLOTS: [usize; 6] = [0, 1, 2, 64, 65, 130];

    fn any_op() -> impl Strategy<Value = Op> {
        prop_oneof![
            // Often at the same ms, so that entries tie on their age.
            8 => (0usize..24, 0..SLOTS.len(), any::<bool>(), prop_oneof![Just(0u32), 1u32..1500])
                .prop_map(|(prompt, slot, hit, dt)| Op::Dispatch(prompt, slot, hit, dt)),
            1 => (0..SLOTS.len(), proptest::option::of(0u64..600))
                .prop_map(|(slot, capacity)| Op::Capacity(slot, capacity)),
        ]
    }

    /// Prompt `p`: one of 3 shared prefixes (0 to 5 blocks), then its own
    /// 0 to 7 blocks, in 16-token blocks.
    fn prompt(p: usize) -> PrefixBlocks {
        let mut hashes = chain(p as u64 % 3, p % 6);
        let mut previous = hashes.last().copied().unwrap_or(0);
        for i in 0..(p * 5) % 8 {
            previous = previous.rotate_left(13) ^ (p as u64 * 7919 + i as u64 + 1);
            hashes.push(previous);
        }
        blocks(hashes)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        /// After every step the table holds exactly what the model does,
        /// and every lookup (and every question a selection asks of its
        /// matches) answers as the model's: with a table small enough to
        /// evict, caches small enough to expire, and entries aged out.
        #[test]
        fn the_index_follows_its_plain_model(
            index_block_tokens in prop_oneof![Just(16u64), Just(32)],
            cache_tokens in prop_oneof![100u64..2000, 2000u64..50_000],
            ops in proptest::collection::vec(any_op(), 1..120),
        ) {
            let index = PrefixIndex::new(index_block_tokens, cache_tokens, 32, 2.0);
            let mut model = model::Model::new(index.groups_for_test(), index_block_tokens, cache_tokens, 2000);
            let mut now_ms = 0u32;
            for op in ops {
                match op {
                    Op::Dispatch(p, worker, hit, dt) => {
                        now_ms += dt;
                        let slot = SLOTS[worker];
                        let prefix = prompt(p);
                        let found = index.lookup(&prefix, now_ms);
                        let expected = model.lookup(&prefix, now_ms);
                        for probe in SLOTS.iter().chain(&[3, 66, 128]) {
                            let want = expected
                                .iter()
                                .find(|(s, _)| s == probe)
                                .map_or(0, |(_, tokens)| *tokens);
                            prop_assert_eq!(found.cached_tokens(*probe), want, "slot {}", probe);
                            prop_assert_eq!(found.holds(*probe), want > 0, "slot {}", probe);
                        }
                        let best = expected.iter().map(|(_, t)| *t).max().unwrap_or(0);
                        prop_assert_eq!(found.max_cached_tokens(), best);
                        prop_assert_eq!(found.is_empty(), expected.is_empty());
                        let cached = if hit { found.cached_tokens(slot) } else { 0 };
                        index.record(slot, &prefix, cached, now_ms);
                        model.record(slot, &prefix, cached, now_ms);
                    }
                    Op::Capacity(worker, capacity) => {
                        index.set_capacity(SLOTS[worker], capacity);
                        model.set_capacity(SLOTS[worker], capacity);
                    }
                }
                for group in 0..index.groups_for_test() {
                    for way in 0..WAYS {
                        prop_assert_eq!(
                            index.entry_for_test(group, way),
                            model.words(group, way),
                            "group {} way {}", group, way
                        );
                    }
                }
            }
        }
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
