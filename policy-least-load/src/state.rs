//! Per-worker state: the latest snapshot's terms behind a seqlock, and the
//! since-poll tally.
//!
//! Every selection reads every candidate's snapshot, while a snapshot changes
//! a few times a second. A seqlock makes those reads plain loads, with no
//! write to shared memory, so concurrent selections never bounce a lock's
//! cache line between cores. All fields are atomics, so a torn read is
//! impossible to act on: it is detected by the version check and retried.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering, fence};
use std::time::Instant;

use parking_lot::Mutex;
use policy_core::{ReplicaPendingOutcome, WorkerId, WorkerLedger};

use crate::LeastLoadParams;
use crate::rate::{LearnedRate, RateEstimator, RateProbe};
use crate::score::{PendingWork, QueueSource, SnapshotTerms, ThroughputSource};

/// One received report, reduced to what selections read.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct StoredSnapshot {
    /// When the report was received, on the policy's [`Timeline`].
    pub received_nanos: i64,
    pub terms: SnapshotTerms,
    /// Reported waiting requests minus ours when the poll was sent, floored at
    /// 0: the part of the waiting queue the cap adds our live pending to.
    pub others_waiting_requests: u64,
}

impl StoredSnapshot {
    pub fn is_fresh(&self, now_nanos: i64, stale_after_nanos: i64) -> bool {
        now_nanos.saturating_sub(self.received_nanos) <= stale_after_nanos
    }
}

const PRESENT: u64 = 1;
const QUEUE_REPORTED: u64 = 1 << 1;
const THROUGHPUT_REPORTED: u64 = 1 << 2;

/// The latest snapshot of one worker (or none), lock-free to read.
#[derive(Debug, Default)]
pub(crate) struct SnapshotCell {
    /// Odd while a writer is between its stores.
    version: AtomicU64,
    flags: AtomicU64,
    received_nanos: AtomicI64,
    queued_tokens: AtomicU64,
    throughput_bits: AtomicU64,
    kv_usage_bits: AtomicU64,
    kv_barrier_bits: AtomicU64,
    others_waiting_requests: AtomicU64,
    /// Serializes writers and holds the sequence number of the newest poll
    /// outcome applied, so an older overlapping poll cannot overwrite it.
    newest_poll: Mutex<Option<u64>>,
}

/// The part of a snapshot a selection reads for every candidate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct HotSnapshot {
    pub received_nanos: i64,
    pub queued_tokens: u64,
    pub throughput_tps: f64,
    pub kv_barrier_secs: f64,
    pub others_waiting_requests: u64,
}

impl HotSnapshot {
    pub fn is_fresh(&self, now_nanos: i64, stale_after_nanos: i64) -> bool {
        now_nanos.saturating_sub(self.received_nanos) <= stale_after_nanos
    }
}

impl SnapshotCell {
    /// The fields every selection needs, if a snapshot is stored: fewer
    /// loads than [`SnapshotCell::read`] on the per-candidate path.
    pub fn read_hot(&self) -> Option<HotSnapshot> {
        let mut spins = 0u32;
        loop {
            let before = self.version.load(Ordering::Acquire);
            if before & 1 == 0 {
                let flags = self.flags.load(Ordering::Relaxed);
                let hot = HotSnapshot {
                    received_nanos: self.received_nanos.load(Ordering::Relaxed),
                    queued_tokens: self.queued_tokens.load(Ordering::Relaxed),
                    throughput_tps: f64::from_bits(self.throughput_bits.load(Ordering::Relaxed)),
                    kv_barrier_secs: f64::from_bits(self.kv_barrier_bits.load(Ordering::Relaxed)),
                    others_waiting_requests: self.others_waiting_requests.load(Ordering::Relaxed),
                };
                fence(Ordering::Acquire);
                if self.version.load(Ordering::Relaxed) == before {
                    return (flags & PRESENT != 0).then_some(hot);
                }
            }
            spins = backoff(spins);
        }
    }

    /// The stored snapshot, if any.
    pub fn read(&self) -> Option<StoredSnapshot> {
        let mut spins = 0u32;
        loop {
            let before = self.version.load(Ordering::Acquire);
            if before & 1 == 0 {
                let flags = self.flags.load(Ordering::Relaxed);
                let received_nanos = self.received_nanos.load(Ordering::Relaxed);
                let queued_tokens = self.queued_tokens.load(Ordering::Relaxed);
                let throughput_bits = self.throughput_bits.load(Ordering::Relaxed);
                let kv_usage_bits = self.kv_usage_bits.load(Ordering::Relaxed);
                let kv_barrier_bits = self.kv_barrier_bits.load(Ordering::Relaxed);
                let others_waiting_requests = self.others_waiting_requests.load(Ordering::Relaxed);
                // Orders the loads above before the version re-check.
                fence(Ordering::Acquire);
                if self.version.load(Ordering::Relaxed) == before {
                    if flags & PRESENT == 0 {
                        return None;
                    }
                    return Some(StoredSnapshot {
                        received_nanos,
                        terms: SnapshotTerms {
                            queued_tokens,
                            queue: if flags & QUEUE_REPORTED != 0 {
                                QueueSource::Reported
                            } else {
                                QueueSource::Estimated
                            },
                            throughput_tps: f64::from_bits(throughput_bits),
                            throughput: if flags & THROUGHPUT_REPORTED != 0 {
                                ThroughputSource::Reported
                            } else {
                                ThroughputSource::Default
                            },
                            kv_usage_ratio: f64::from_bits(kv_usage_bits),
                            kv_barrier_secs: f64::from_bits(kv_barrier_bits),
                        },
                        others_waiting_requests,
                    });
                }
            }
            spins = backoff(spins);
        }
    }

    /// Applies the outcome of poll `seq` (`None`: no fresh snapshot) unless a
    /// newer poll's outcome was already applied; then runs `applied` while
    /// writers are still excluded. Returns whether it was applied.
    pub fn apply(
        &self,
        seq: u64,
        snapshot: Option<StoredSnapshot>,
        applied: impl FnOnce(),
    ) -> bool {
        let mut newest = self.newest_poll.lock();
        if newest.is_some_and(|newest| seq < newest) {
            return false;
        }
        *newest = Some(seq);
        let version = self.version.load(Ordering::Relaxed);
        self.version
            .store(version.wrapping_add(1), Ordering::Relaxed);
        // Readers that see any store below also see the odd version.
        fence(Ordering::Release);
        match snapshot {
            Some(snapshot) => {
                let terms = snapshot.terms;
                let mut flags = PRESENT;
                if terms.queue == QueueSource::Reported {
                    flags |= QUEUE_REPORTED;
                }
                if terms.throughput == ThroughputSource::Reported {
                    flags |= THROUGHPUT_REPORTED;
                }
                self.flags.store(flags, Ordering::Relaxed);
                self.received_nanos
                    .store(snapshot.received_nanos, Ordering::Relaxed);
                self.queued_tokens
                    .store(terms.queued_tokens, Ordering::Relaxed);
                self.throughput_bits
                    .store(terms.throughput_tps.to_bits(), Ordering::Relaxed);
                self.kv_usage_bits
                    .store(terms.kv_usage_ratio.to_bits(), Ordering::Relaxed);
                self.kv_barrier_bits
                    .store(terms.kv_barrier_secs.to_bits(), Ordering::Relaxed);
                self.others_waiting_requests
                    .store(snapshot.others_waiting_requests, Ordering::Relaxed);
            }
            None => self.flags.store(0, Ordering::Relaxed),
        }
        self.version
            .store(version.wrapping_add(2), Ordering::Release);
        applied();
        true
    }
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

/// What a selection needs of one worker, as stored in its [`HotRecord`].
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub(crate) struct HotValues {
    /// The worker's snapshot, if one is stored (fresh or not).
    pub snapshot: Option<HotSnapshot>,
    /// Every replica's pending work there: ours and the others' as published.
    pub ahead_tokens: u64,
    /// Our pending requests plus the other replicas' (the cap adds the
    /// snapshot's `others_waiting_requests`).
    pub pending_requests: u64,
    /// Under `rate = "learned"`: the worker's learned rate (`None` before
    /// it has one).
    pub learned_tps: Option<f64>,
    /// The worker's [`HotKey`] terms, `(base_secs, inv_rate)`: its score
    /// with a fresh snapshot is about `base_secs + own_tokens × inv_rate`
    /// (`base_secs` infinite when the cap vetoes it). `None`: no snapshot,
    /// or terms too large to bound the estimate's error.
    pub key: Option<(f64, f64)>,
    /// When the worker was last dispatched to ([`LastDispatch`]): the tie
    /// rule's input, kept beside the keys so that a selection among many
    /// tied workers (an idle fleet) reads it from a packed array rather
    /// than from each worker's state.
    pub last_dispatch_nanos: i64,
}

/// The first pass's view of one worker: its score as a multiply-add, and
/// when its snapshot was received, so that a selection can rule out most
/// candidates reading 32 bytes each, and score exactly only the few that
/// may be within the tie tolerance of the best.
#[derive(Debug)]
#[repr(C, align(32))]
struct HotKey {
    /// [`key_tag`] of the slot's worker when the terms below are usable
    /// (it is alive and has a snapshot), else [`UNUSABLE_TAG`].
    tag: AtomicU64,
    received_nanos: AtomicI64,
    base_bits: AtomicU64,
    inv_rate_bits: AtomicU64,
}

impl HotKey {
    /// A key no candidate can use.
    const fn unusable() -> HotKey {
        HotKey {
            tag: AtomicU64::new(UNUSABLE_TAG),
            received_nanos: AtomicI64::new(i64::MIN),
            base_bits: AtomicU64::new(0),
            inv_rate_bits: AtomicU64::new(0),
        }
    }
}

/// A worker's [`HotKey`] as read.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct KeyRead {
    pub tag: u64,
    pub received_nanos: i64,
    pub base_secs: f64,
    pub inv_rate: f64,
}

/// One worker's [`HotRecord`] as read, when it has a snapshot.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct HotRead {
    pub received_nanos: i64,
    /// `queued_tokens as f64`, converted once when stored.
    pub queued_tokens_f64: f64,
    pub ahead_tokens: u64,
    /// The learned rate's bits (0: none) under `rate = "learned"`, else the
    /// snapshot's throughput's.
    pub rate_bits: u64,
    pub kv_barrier_secs: f64,
    /// The cap's estimate of the worker's waiting requests.
    pub waiting_requests: u64,
}

const HOT_ALIVE: u64 = 1;
const HOT_SNAPSHOT: u64 = 1 << 1;
const HOT_GENERATION_SHIFT: u32 = 32;

/// The [`HotKey`] tag of worker `id` when its key is usable: the id's slot
/// and generation in one word, which a scan compares with the candidate's
/// id as loaded, in one instruction.
#[inline]
pub(crate) fn key_tag(id: WorkerId) -> u64 {
    id.to_bits()
}

/// The tag of an unusable [`HotKey`]: that of slot and generation
/// `u32::MAX`, a slot past the table ([`HOT_SLOTS`]), whose candidates read
/// [`NO_KEYS`], received at `i64::MIN`, which no selection takes for fresh.
const UNUSABLE_TAG: u64 = u64::MAX;

/// Everything a selection reads of one worker, in one cache line, derived
/// from the worker's ledger, snapshot, learned rate and remote pending work.
///
/// A selection reads every candidate and writes one, so the terms it needs
/// are kept packed here, side by side with the other workers', instead of
/// behind a pointer per worker and a cache line per source. Whoever changes
/// a source rewrites the record from all the sources while holding it (the
/// version odd), so the last writer to finish has seen every change, and
/// the record is exact whenever no change is under way. Readers use the
/// version as a seqlock and never write.
#[derive(Debug, Default)]
#[repr(C, align(64))]
struct HotRecord {
    /// Odd while a writer holds the record.
    version: AtomicU64,
    /// `generation << 32 | HOT_SNAPSHOT? | HOT_ALIVE?`: whose record this is.
    tag: AtomicU64,
    received_nanos: AtomicI64,
    queued_bits: AtomicU64,
    ahead_tokens: AtomicU64,
    rate_bits: AtomicU64,
    kv_barrier_bits: AtomicU64,
    waiting_requests: AtomicU64,
}

/// Records per chunk of the [`HotTable`] (a 4 KiB page of them).
const HOT_CHUNK: usize = 64;

/// Keys (and last dispatch times) per chunk of the [`HotTable`]: 40 KiB of
/// them, so that a scan of a large fleet reads long runs of consecutive
/// memory, which the hardware prefetches, and checks its chunk with one
/// comparison per candidate.
const KEY_CHUNK: usize = 1024;

/// Worker slots the [`HotTable`] covers; a worker in a higher slot is scored
/// through the slower path that reads its state directly.
pub(crate) const HOT_SLOTS: usize = 1 << 16;

/// The records of [`HOT_CHUNK`] consecutive slots.
#[derive(Debug)]
struct HotChunk {
    records: [HotRecord; HOT_CHUNK],
}

/// The keys and last dispatch times of [`KEY_CHUNK`] consecutive slots,
/// apart from the records: a scan reads a key for every candidate, a record
/// only for the few it scores exactly.
#[derive(Debug)]
struct KeyChunk {
    keys: [HotKey; KEY_CHUNK],
    last_dispatch_nanos: [AtomicI64; KEY_CHUNK],
}

impl KeyChunk {
    /// Every key unusable, no slot ever dispatched to: how a chunk starts,
    /// and what [`NO_KEYS`] stays.
    const fn new() -> KeyChunk {
        KeyChunk {
            keys: [const { HotKey::unusable() }; KEY_CHUNK],
            last_dispatch_nanos: [const { AtomicI64::new(i64::MIN) }; KEY_CHUNK],
        }
    }
}

/// One slot's parts of the [`HotTable`].
struct HotEntry<'t> {
    record: &'t HotRecord,
    key: &'t HotKey,
    last_dispatch_nanos: &'t AtomicI64,
}

/// The [`HotRecord`]s and [`HotKey`]s of every worker, indexed by slot, in
/// chunks allocated on first use (so a small fleet costs a few pages).
#[derive(Debug)]
pub(crate) struct HotTable {
    chunks: Box<[OnceLock<Box<HotChunk>>]>,
    key_chunks: Box<[OnceLock<Box<KeyChunk>>]>,
    /// Whether `rate_bits` holds the learned rate (else the snapshot's).
    learned_rate: bool,
}

impl HotTable {
    pub fn new(learned_rate: bool) -> HotTable {
        HotTable {
            chunks: (0..HOT_SLOTS / HOT_CHUNK)
                .map(|_| OnceLock::new())
                .collect(),
            key_chunks: (0..HOT_SLOTS / KEY_CHUNK)
                .map(|_| OnceLock::new())
                .collect(),
            learned_rate,
        }
    }

    /// The first slot of `slot`'s chunk of keys, and the chunk
    /// ([`NO_KEYS`] if not allocated), for a [`KeyCursor`] to move to.
    /// Out of line, since candidates in slot order change chunk once per
    /// [`KEY_CHUNK`]; and returned rather than written through the cursor,
    /// so that a scan's cursor can live in registers.
    #[cold]
    #[inline(never)]
    fn key_chunk_at(&self, slot: usize) -> (usize, &KeyChunk) {
        (
            slot - slot % KEY_CHUNK,
            self.key_chunk(slot).unwrap_or(&NO_KEYS),
        )
    }

    #[inline]
    fn key_chunk(&self, slot: usize) -> Option<&KeyChunk> {
        self.key_chunks
            .get(slot / KEY_CHUNK)?
            .get()
            .map(|chunk| &**chunk)
    }

    #[inline]
    fn entry(&self, slot: usize) -> Option<HotEntry<'_>> {
        let chunk = self.chunks.get(slot / HOT_CHUNK)?.get()?;
        let key_chunk = self.key_chunk(slot)?;
        Some(HotEntry {
            record: &chunk.records[slot % HOT_CHUNK],
            key: &key_chunk.keys[slot % KEY_CHUNK],
            last_dispatch_nanos: &key_chunk.last_dispatch_nanos[slot % KEY_CHUNK],
        })
    }

    fn entry_or_new(&self, slot: usize) -> Option<HotEntry<'_>> {
        // Keys first: a record is only written once its key can be.
        self.key_chunks
            .get(slot / KEY_CHUNK)?
            .get_or_init(|| Box::new(KeyChunk::new()));
        self.chunks.get(slot / HOT_CHUNK)?.get_or_init(|| {
            Box::new(HotChunk {
                records: std::array::from_fn(|_| HotRecord::default()),
            })
        });
        self.entry(slot)
    }

    /// A reader of keys that remembers the last chunk it looked up
    /// (candidates in slot order share chunks).
    pub fn keys(&self) -> KeyCursor<'_> {
        KeyCursor {
            table: self,
            // No slot is in this chunk: the first key read looks one up.
            chunk_first_slot: usize::MAX - KEY_CHUNK,
            chunk: &NO_KEYS,
        }
    }

    /// The record of worker `id`, if it holds a snapshot and belongs to this
    /// live generation of the worker; `None` sends the caller to the
    /// worker's own state.
    #[inline]
    pub fn read(&self, id: WorkerId) -> Option<HotRead> {
        let record = self.entry(id.slot())?.record;
        let expected =
            (u64::from(id.generation()) << HOT_GENERATION_SHIFT) | HOT_ALIVE | HOT_SNAPSHOT;
        let mut spins = 0u32;
        loop {
            let before = record.version.load(Ordering::Acquire);
            if before & 1 == 0 {
                let tag = record.tag.load(Ordering::Relaxed);
                let read = HotRead {
                    received_nanos: record.received_nanos.load(Ordering::Relaxed),
                    queued_tokens_f64: f64::from_bits(record.queued_bits.load(Ordering::Relaxed)),
                    ahead_tokens: record.ahead_tokens.load(Ordering::Relaxed),
                    rate_bits: record.rate_bits.load(Ordering::Relaxed),
                    kv_barrier_secs: f64::from_bits(record.kv_barrier_bits.load(Ordering::Relaxed)),
                    waiting_requests: record.waiting_requests.load(Ordering::Relaxed),
                };
                // Orders the loads above before the version re-check.
                fence(Ordering::Acquire);
                if record.version.load(Ordering::Relaxed) == before {
                    return (tag == expected).then_some(read);
                }
            }
            spins = backoff(spins);
        }
    }

    /// Makes worker `id` the owner of its slot's record, from `values`.
    pub fn insert(&self, id: WorkerId, values: impl FnOnce() -> HotValues) {
        if let Some(entry) = self.entry_or_new(id.slot()) {
            self.write(entry, id, true, values);
        }
    }

    /// Rewrites worker `id`'s record from `values` (read while the record is
    /// held), unless the slot now belongs to another generation.
    pub fn update(&self, id: WorkerId, values: impl FnOnce() -> HotValues) {
        if let Some(entry) = self.entry(id.slot()) {
            self.write(entry, id, false, values);
        }
    }

    /// When worker `id` was last dispatched to, as of its record's last
    /// rewrite; `None` when the table does not cover its slot or its record
    /// belongs to another generation. Unguarded like a key: a read racing
    /// a rewrite sees the time before or after that dispatch, as a read of
    /// the worker's own [`LastDispatch`] would.
    #[inline]
    pub fn last_dispatch_nanos(&self, id: WorkerId) -> Option<i64> {
        let entry = self.entry(id.slot())?;
        let tag = entry.record.tag.load(Ordering::Relaxed);
        (tag >> HOT_GENERATION_SHIFT == u64::from(id.generation()) && tag & HOT_ALIVE != 0)
            .then(|| entry.last_dispatch_nanos.load(Ordering::Relaxed))
    }

    /// Worker `id` was removed: its record is no longer read. A late update
    /// for it (from a selection that still saw it) leaves it so.
    pub fn remove(&self, id: WorkerId) {
        if let Some(HotEntry { record, key, .. }) = self.entry(id.slot()) {
            let generation = u64::from(id.generation());
            let version = lock(&record.version);
            let tag = record.tag.load(Ordering::Relaxed);
            if tag >> HOT_GENERATION_SHIFT == generation {
                record.tag.store(tag & !HOT_ALIVE, Ordering::Relaxed);
                key.tag.store(UNUSABLE_TAG, Ordering::Relaxed);
            }
            record
                .version
                .store(version.wrapping_add(2), Ordering::Release);
        }
    }

    /// Writes `values` into `record` for worker `id`: as its new owner
    /// (`insert`), else only if `id` owns it, keeping whether it is alive.
    fn write(
        &self,
        entry: HotEntry<'_>,
        id: WorkerId,
        insert: bool,
        values: impl FnOnce() -> HotValues,
    ) {
        let HotEntry {
            record,
            key,
            last_dispatch_nanos,
        } = entry;
        let version = lock(&record.version);
        let tag = record.tag.load(Ordering::Relaxed);
        let generation_bits = u64::from(id.generation()) << HOT_GENERATION_SHIFT;
        let owned = tag & !(HOT_ALIVE | HOT_SNAPSHOT) == generation_bits;
        if insert || owned {
            // Read while the record is held: a source changed before this
            // point is seen here, or by the writer that holds it next.
            let values = values();
            let alive = if insert { HOT_ALIVE } else { tag & HOT_ALIVE };
            let mut flags = generation_bits | alive;
            let snapshot = values.snapshot;
            if snapshot.is_some() {
                flags |= HOT_SNAPSHOT;
            }
            let snapshot = snapshot.unwrap_or(HotSnapshot {
                received_nanos: i64::MIN,
                queued_tokens: 0,
                throughput_tps: 0.0,
                kv_barrier_secs: 0.0,
                others_waiting_requests: 0,
            });
            let rate_bits = if self.learned_rate {
                values.learned_tps.map_or(0, f64::to_bits)
            } else {
                snapshot.throughput_tps.to_bits()
            };
            record.tag.store(flags, Ordering::Relaxed);
            record
                .received_nanos
                .store(snapshot.received_nanos, Ordering::Relaxed);
            record
                .queued_bits
                .store((snapshot.queued_tokens as f64).to_bits(), Ordering::Relaxed);
            record
                .ahead_tokens
                .store(values.ahead_tokens, Ordering::Relaxed);
            record.rate_bits.store(rate_bits, Ordering::Relaxed);
            record
                .kv_barrier_bits
                .store(snapshot.kv_barrier_secs.to_bits(), Ordering::Relaxed);
            record.waiting_requests.store(
                snapshot
                    .others_waiting_requests
                    .saturating_add(values.pending_requests),
                Ordering::Relaxed,
            );
            let (tag, (base_secs, inv_rate)) = match values.key {
                Some(terms) if flags & HOT_SNAPSHOT != 0 && alive != 0 => (key_tag(id), terms),
                _ => (UNUSABLE_TAG, (f64::INFINITY, 0.0)),
            };
            key.tag.store(tag, Ordering::Relaxed);
            key.received_nanos
                .store(snapshot.received_nanos, Ordering::Relaxed);
            key.base_bits.store(base_secs.to_bits(), Ordering::Relaxed);
            key.inv_rate_bits
                .store(inv_rate.to_bits(), Ordering::Relaxed);
            last_dispatch_nanos.store(values.last_dispatch_nanos, Ordering::Relaxed);
        }
        record
            .version
            .store(version.wrapping_add(2), Ordering::Release);
    }
}

/// Reads [`HotKey`]s; see [`HotTable::keys`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct KeyCursor<'t> {
    table: &'t HotTable,
    /// The first slot of the chunk at hand: one comparison per candidate
    /// tells whether its slot is in it.
    chunk_first_slot: usize,
    /// The chunk at hand; [`NO_KEYS`] when the table has not allocated it
    /// (or none was looked up yet).
    chunk: &'t KeyChunk,
}

/// The keys of slots the table has no chunk for: all unusable, so a
/// [`KeyCursor`] needs no second check for a missing chunk.
static NO_KEYS: KeyChunk = KeyChunk::new();

impl<'t> KeyCursor<'t> {
    /// Worker `id`'s key, unguarded: a read racing a writer may mix two
    /// versions, which is harmless because a key only decides which
    /// candidates are scored exactly; unusable without a chunk for
    /// the slot. With it, the slot's last dispatch time, kept beside the
    /// keys and unguarded likewise (`i64::MIN`, "never", without a chunk),
    /// for the caller to read only if the key leaves it in the running.
    #[inline]
    pub fn key(&mut self, id: WorkerId) -> (KeyRead, &'t AtomicI64) {
        let mut index = id.slot().wrapping_sub(self.chunk_first_slot);
        if index >= KEY_CHUNK {
            (self.chunk_first_slot, self.chunk) = self.table.key_chunk_at(id.slot());
            index = id.slot() % KEY_CHUNK;
        }
        let chunk = self.chunk;
        let key = &chunk.keys[index];
        let read = KeyRead {
            tag: key.tag.load(Ordering::Relaxed),
            received_nanos: key.received_nanos.load(Ordering::Relaxed),
            base_secs: f64::from_bits(key.base_bits.load(Ordering::Relaxed)),
            inv_rate: f64::from_bits(key.inv_rate_bits.load(Ordering::Relaxed)),
        };
        (read, &chunk.last_dispatch_nanos[index])
    }
}

/// Takes a seqlock's version odd for a writer; returns the even version it
/// held before.
fn lock(version: &AtomicU64) -> u64 {
    let mut spins = 0u32;
    let held = loop {
        let current = version.load(Ordering::Relaxed);
        if current & 1 == 0
            && version
                .compare_exchange_weak(
                    current,
                    current.wrapping_add(1),
                    Ordering::Acquire,
                    Ordering::Relaxed,
                )
                .is_ok()
        {
            break current;
        }
        spins = backoff(spins);
    };
    // Readers that see any store after this also see the odd version.
    fence(Ordering::Release);
    held
}

/// The original estimator's tally: tokens dispatched to the worker since its
/// last report was received. (It counts no requests: nothing would read
/// them, since the cap uses the ledger in both modes.)
#[derive(Debug, Default)]
pub(crate) struct SincePollTally {
    tokens: AtomicU64,
}

impl SincePollTally {
    pub fn add(&self, tokens: u64) {
        self.tokens.fetch_add(tokens, Ordering::Relaxed);
    }

    pub fn tokens(&self) -> u64 {
        self.tokens.load(Ordering::Relaxed)
    }

    pub fn reset(&self) {
        self.tokens.store(0, Ordering::Relaxed);
    }
}

/// Everything the policy keeps for one worker.
#[derive(Debug)]
pub(crate) struct WorkerState {
    /// Pending work and in-flight requests, from select / first_token /
    /// finish, each pending dispatch with what its first token will teach
    /// the rate.
    pub ledger: WorkerLedger<RateProbe>,
    pub snapshot: SnapshotCell,
    /// Used only in `inflight = "since_poll"` mode.
    pub since_poll: SincePollTally,
    pub last_dispatch: LastDispatch,
    /// Learned in every mode (the explain table shows it); the divisor
    /// under `rate = "learned"`.
    pub rate: LearnedRate,
    /// Other router replicas' pending work here, as they published it.
    pub remote: RemotePending,
    /// How fast this router's requests on the worker finish.
    pub finishes: FinishRate,
    /// When the engine likely took up the oldest of our pending prompts.
    pub head_start: HeadStart,
}

impl WorkerState {
    /// A worker whose learned rate starts at `prior_tps`.
    pub fn new(params: &LeastLoadParams, prior_tps: f64) -> WorkerState {
        WorkerState {
            ledger: WorkerLedger::default(),
            snapshot: SnapshotCell::default(),
            since_poll: SincePollTally::default(),
            last_dispatch: LastDispatch::default(),
            finishes: FinishRate::default(),
            rate: LearnedRate::new(RateEstimator::new(
                prior_tps,
                // The prior is worth a quarter of a typical request, so the
                // first real samples take over.
                params.mean_prefill_tokens / 4,
                params.rate_half_life_secs,
            )),
            remote: RemotePending::default(),
            head_start: HeadStart::default(),
        }
    }
}

/// One other replica's latest published pending work on the worker.
#[derive(Debug)]
struct RemoteEntry {
    replica: Box<str>,
    seq: u64,
    work: PendingWork,
    /// When the replica last confirmed it, on the policy's [`Timeline`].
    refreshed_nanos: i64,
}

/// What the explain table shows of the other replicas' work on a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct RemoteSummary {
    pub work: PendingWork,
    /// Replicas with an entry held (zero work included).
    pub replicas: usize,
    /// When the stalest entry held was last confirmed; `None` with none.
    pub stalest_refresh_nanos: Option<i64>,
}

/// Other router replicas' pending work on one worker: one entry per
/// replica, each replaced whole by that replica's newer state.
///
/// Selections read only the sums, two atomics, so the sync path never makes
/// them wait; a writer recomputes the sums under the entries' lock. (The two
/// sums are stored one after the other, so a selection may read tokens of one
/// update with requests of the previous: both are estimates a publish
/// interval old already.)
#[derive(Debug)]
pub(crate) struct RemotePending {
    tokens: AtomicU64,
    requests: AtomicU64,
    /// The stalest entry's refresh time (`i64::MAX` with none), so an expiry
    /// sweep passes a worker with nothing to expire without locking it.
    stalest_refresh_nanos: AtomicI64,
    /// Replicas with an entry held, lock-free.
    replicas: AtomicU64,
    entries: Mutex<Vec<RemoteEntry>>,
}

impl Default for RemotePending {
    fn default() -> RemotePending {
        RemotePending {
            tokens: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            stalest_refresh_nanos: AtomicI64::new(i64::MAX),
            replicas: AtomicU64::new(0),
            entries: Mutex::new(Vec::new()),
        }
    }
}

impl RemotePending {
    /// The other replicas' pending work now, lock-free.
    pub fn totals(&self) -> PendingWork {
        PendingWork {
            tokens: self.tokens.load(Ordering::Acquire),
            requests: self.requests.load(Ordering::Acquire),
        }
    }

    /// Replaces `replica`'s entry with `work` as of `seq`, unless the entry
    /// held is as new or newer.
    pub fn apply(
        &self,
        replica: &str,
        seq: u64,
        work: PendingWork,
        now_nanos: i64,
    ) -> ReplicaPendingOutcome {
        let mut entries = self.entries.lock();
        match entries.iter_mut().find(|entry| &*entry.replica == replica) {
            Some(entry) if entry.seq >= seq => return ReplicaPendingOutcome::Stale,
            Some(entry) => {
                entry.seq = seq;
                entry.work = work;
                entry.refreshed_nanos = now_nanos;
            }
            // The only allocation on this path: a replica's first word
            // about this worker.
            None => entries.push(RemoteEntry {
                replica: replica.into(),
                seq,
                work,
                refreshed_nanos: now_nanos,
            }),
        }
        self.publish(&entries);
        ReplicaPendingOutcome::Applied
    }

    /// Other replicas with an entry held for the worker.
    pub fn replicas(&self) -> u64 {
        self.replicas.load(Ordering::Relaxed)
    }

    /// Drops the entries last confirmed before `cutoff_nanos`; returns how
    /// many.
    pub fn expire(&self, cutoff_nanos: i64) -> usize {
        if self.stalest_refresh_nanos.load(Ordering::Acquire) >= cutoff_nanos {
            return 0;
        }
        let mut entries = self.entries.lock();
        let before = entries.len();
        entries.retain(|entry| entry.refreshed_nanos >= cutoff_nanos);
        let dropped = before - entries.len();
        if dropped > 0 {
            self.publish(&entries);
        }
        dropped
    }

    pub fn summary(&self) -> RemoteSummary {
        let entries = self.entries.lock();
        RemoteSummary {
            work: sum(&entries),
            replicas: entries.len(),
            stalest_refresh_nanos: entries.iter().map(|entry| entry.refreshed_nanos).min(),
        }
    }

    /// Stores the sums and the stalest refresh time of `entries` (the caller
    /// holds their lock, so writers never interleave).
    fn publish(&self, entries: &[RemoteEntry]) {
        let total = sum(entries);
        self.tokens.store(total.tokens, Ordering::Release);
        self.requests.store(total.requests, Ordering::Release);
        let stalest = entries
            .iter()
            .map(|entry| entry.refreshed_nanos)
            .min()
            .unwrap_or(i64::MAX);
        self.stalest_refresh_nanos.store(stalest, Ordering::Release);
        self.replicas.store(entries.len() as u64, Ordering::Relaxed);
    }
}

/// Saturating: a hostile replica's huge counts cannot wrap into small ones.
fn sum(entries: &[RemoteEntry]) -> PendingWork {
    entries
        .iter()
        .fold(PendingWork::default(), |total, entry| PendingWork {
            tokens: total.tokens.saturating_add(entry.work.tokens),
            requests: total.requests.saturating_add(entry.work.requests),
        })
}

/// When this router last dispatched to the worker, on the policy's
/// Requests finished per second on one worker: a count decaying with a
/// time constant of [`FINISH_TIME_CONSTANT_NANOS`], over the window it has
/// had time to fill. A worker whose batch slots are all taken starts a
/// waiting request only when a running one finishes, so its waiting
/// requests over this rate is how long a new one waits for a slot.
#[derive(Debug, Default)]
pub(crate) struct FinishRate(parking_lot::Mutex<FinishCount>);

#[derive(Debug, Default, Clone, Copy)]
struct FinishCount {
    decayed: f64,
    last_nanos: Option<i64>,
    first_nanos: Option<i64>,
}

const FINISH_TIME_CONSTANT_NANOS: f64 = 5e9;
/// Less history than this gives no rate.
const FINISH_WARMUP_NANOS: i64 = 1_000_000_000;

impl FinishRate {
    pub fn record(&self, now_nanos: i64) {
        let mut count = self.0.lock();
        if let Some(last) = count.last_nanos {
            let elapsed = now_nanos.saturating_sub(last).max(0) as f64;
            count.decayed *= (-elapsed / FINISH_TIME_CONSTANT_NANOS).exp();
        }
        count.decayed += 1.0;
        count.last_nanos = Some(now_nanos.max(count.last_nanos.unwrap_or(now_nanos)));
        count.first_nanos.get_or_insert(now_nanos);
    }

    /// Finishes per second lately; `None` before a second of history.
    pub fn per_second(&self, now_nanos: i64) -> Option<f64> {
        let count = *self.0.lock();
        let history = now_nanos.saturating_sub(count.first_nanos?);
        if history < FINISH_WARMUP_NANOS {
            return None;
        }
        let since_last = now_nanos.saturating_sub(count.last_nanos?).max(0) as f64;
        let decayed = count.decayed * (-since_last / FINISH_TIME_CONSTANT_NANOS).exp();
        let window_secs = FINISH_TIME_CONSTANT_NANOS
            * (1.0 - (-(history as f64) / FINISH_TIME_CONSTANT_NANOS).exp())
            / 1e9;
        let rate = decayed / window_secs;
        (rate.is_finite() && rate > 0.0).then_some(rate)
    }
}

/// [`Timeline`]: the tie-break among near-equal scores. Never dispatched is
/// the oldest of all.
#[derive(Debug)]
pub(crate) struct LastDispatch(AtomicI64);

impl Default for LastDispatch {
    fn default() -> LastDispatch {
        LastDispatch(AtomicI64::new(i64::MIN))
    }
}

impl LastDispatch {
    pub fn nanos(&self) -> i64 {
        self.0.load(Ordering::Relaxed)
    }

    /// Records a dispatch at `nanos`; a selection that read an older clock
    /// never moves it back. Only the holder of the worker's ledger lock
    /// calls this, so the writers are serialized and a plain load and store
    /// do what a locked `fetch_max` would, at a fraction of its cost.
    pub fn record_under_ledger_lock(&self, nanos: i64) {
        if nanos > self.0.load(Ordering::Relaxed) {
            self.0.store(nanos, Ordering::Relaxed);
        }
    }
}

/// When the engine likely took up the oldest of this router's pending
/// prompts on a worker: its dispatch, when nothing of ours was pending
/// before it, else the last first token (the engine finished the one
/// before it then).
#[derive(Debug, Default)]
pub(crate) struct HeadStart(AtomicI64);

impl HeadStart {
    pub fn nanos(&self) -> i64 {
        self.0.load(Ordering::Relaxed)
    }

    pub fn record(&self, nanos: i64) {
        self.0.store(nanos, Ordering::Relaxed);
    }
}

/// Turns `Instant`s into signed nanoseconds from the first `Instant` the
/// policy was given, so a receive time fits in an atomic. The policy reads no
/// clock: the origin is one of the caller's instants, and every decision
/// depends only on differences between them.
#[derive(Debug, Default)]
pub(crate) struct Timeline {
    origin: OnceLock<Instant>,
}

impl Timeline {
    pub fn nanos(&self, at: Instant) -> i64 {
        let origin = *self.origin.get_or_init(|| at);
        match at.checked_duration_since(origin) {
            Some(after) => i64::try_from(after.as_nanos()).unwrap_or(i64::MAX),
            None => i64::try_from(origin.duration_since(at).as_nanos())
                .map_or(i64::MIN, |before| -before),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_last_dispatch_never_moves_back() {
        let last = LastDispatch::default();
        assert_eq!(last.nanos(), i64::MIN, "never dispatched is the oldest");
        last.record_under_ledger_lock(500);
        // A selection that read its clock before the one above recorded.
        last.record_under_ledger_lock(200);
        assert_eq!(last.nanos(), 500);
        last.record_under_ledger_lock(900);
        assert_eq!(last.nanos(), 900);
    }

    fn terms(queued_tokens: u64) -> SnapshotTerms {
        SnapshotTerms {
            queued_tokens,
            queue: QueueSource::Reported,
            throughput_tps: 1000.0,
            throughput: ThroughputSource::Default,
            kv_usage_ratio: 0.25,
            kv_barrier_secs: 0.05,
        }
    }

    fn stored(queued_tokens: u64) -> StoredSnapshot {
        StoredSnapshot {
            received_nanos: -7,
            terms: terms(queued_tokens),
            others_waiting_requests: 3,
        }
    }

    #[test]
    fn a_snapshot_round_trips_and_can_be_cleared() {
        let cell = SnapshotCell::default();
        assert_eq!(cell.read(), None);
        assert!(cell.apply(1, Some(stored(42)), || {}));
        assert_eq!(cell.read(), Some(stored(42)));
        assert!(cell.apply(2, None, || {}));
        assert_eq!(cell.read(), None);
    }

    #[test]
    fn an_older_outcome_is_not_applied() {
        let cell = SnapshotCell::default();
        assert!(cell.apply(5, Some(stored(5)), || {}));
        let mut ran = false;
        assert!(!cell.apply(4, Some(stored(4)), || ran = true));
        assert!(!cell.apply(3, None, || ran = true));
        assert!(!ran);
        assert_eq!(cell.read(), Some(stored(5)));
    }

    #[test]
    fn concurrent_readers_never_see_a_torn_snapshot() {
        let cell = SnapshotCell::default();
        std::thread::scope(|scope| {
            scope.spawn(|| {
                for seq in 0..20_000u64 {
                    // Every field derives from one number; a torn read would mix two.
                    let mut snapshot = stored(seq);
                    snapshot.others_waiting_requests = seq;
                    snapshot.received_nanos = seq as i64;
                    cell.apply(seq, Some(snapshot), || {});
                }
            });
            scope.spawn(|| {
                for _ in 0..20_000 {
                    if let Some(snapshot) = cell.read() {
                        assert_eq!(
                            snapshot.terms.queued_tokens,
                            snapshot.others_waiting_requests
                        );
                        assert_eq!(
                            snapshot.received_nanos,
                            snapshot.others_waiting_requests as i64
                        );
                    }
                }
            });
        });
    }

    fn work(tokens: u64, requests: u64) -> PendingWork {
        PendingWork { tokens, requests }
    }

    #[test]
    fn remote_entries_are_replaced_per_replica_and_summed() {
        let remote = RemotePending::default();
        assert_eq!(remote.totals(), PendingWork::default());
        assert_eq!(
            remote.apply("a", 1, work(300, 2), 10),
            ReplicaPendingOutcome::Applied
        );
        assert_eq!(
            remote.apply("b", 7, work(50, 1), 20),
            ReplicaPendingOutcome::Applied
        );
        assert_eq!(remote.totals(), work(350, 3));
        // State, not a delta: a's newer entry replaces its old one.
        assert_eq!(
            remote.apply("a", 2, work(100, 1), 30),
            ReplicaPendingOutcome::Applied
        );
        assert_eq!(remote.totals(), work(150, 2));
        // An older or repeated entry is ignored.
        assert_eq!(
            remote.apply("a", 2, work(999, 9), 40),
            ReplicaPendingOutcome::Stale
        );
        assert_eq!(
            remote.apply("a", 1, work(999, 9), 40),
            ReplicaPendingOutcome::Stale
        );
        assert_eq!(remote.totals(), work(150, 2));
        let summary = remote.summary();
        assert_eq!(summary.replicas, 2);
        assert_eq!(summary.stalest_refresh_nanos, Some(20));
    }

    #[test]
    fn remote_entries_expire_by_their_last_refresh() {
        let remote = RemotePending::default();
        remote.apply("a", 1, work(300, 2), 10);
        remote.apply("b", 1, work(50, 1), 20);
        assert_eq!(remote.expire(10), 0, "refreshed at the cutoff: kept");
        assert_eq!(remote.expire(11), 1);
        assert_eq!(remote.totals(), work(50, 1));
        assert_eq!(remote.expire(100), 1);
        assert_eq!(remote.totals(), PendingWork::default());
        assert_eq!(remote.summary(), RemoteSummary::default());
        // A replica heard again after expiry starts afresh.
        assert_eq!(
            remote.apply("a", 1, work(5, 1), 200),
            ReplicaPendingOutcome::Applied
        );
    }

    #[test]
    fn huge_remote_counts_saturate() {
        let remote = RemotePending::default();
        remote.apply("a", 1, work(u64::MAX, u64::MAX), 0);
        remote.apply("b", 1, work(u64::MAX, 1), 0);
        assert_eq!(remote.totals(), work(u64::MAX, u64::MAX));
    }

    #[test]
    fn the_timeline_is_signed_around_its_origin() {
        let timeline = Timeline::default();
        let t0 = Instant::now();
        assert_eq!(timeline.nanos(t0 + Duration::from_secs(1)), 0);
        assert_eq!(timeline.nanos(t0 + Duration::from_secs(3)), 2_000_000_000);
        assert_eq!(timeline.nanos(t0), -1_000_000_000);
    }

    #[test]
    fn the_hot_table_keeps_the_last_dispatch_of_the_slots_live_worker_only() {
        let table = HotTable::new(false);
        let first = WorkerId::new(3, 0);
        let values = |last_dispatch_nanos| HotValues {
            last_dispatch_nanos,
            ..HotValues::default()
        };
        // No record yet: the caller reads the worker's own state.
        assert_eq!(table.last_dispatch_nanos(first), None);
        table.insert(first, || values(i64::MIN));
        assert_eq!(table.last_dispatch_nanos(first), Some(i64::MIN));
        table.update(first, || values(42));
        assert_eq!(table.last_dispatch_nanos(first), Some(42));
        // A later generation in the same slot is not read through the old
        // id, and starts from its own value, not the old worker's.
        table.remove(first);
        assert_eq!(table.last_dispatch_nanos(first), None);
        let second = WorkerId::new(3, 1);
        table.insert(second, || values(i64::MIN));
        assert_eq!(table.last_dispatch_nanos(first), None);
        assert_eq!(table.last_dispatch_nanos(second), Some(i64::MIN));
        // A late update for the removed worker leaves the new one's alone.
        table.update(first, || values(99));
        assert_eq!(table.last_dispatch_nanos(second), Some(i64::MIN));
        // Slots beyond the table are not covered.
        assert_eq!(
            table.last_dispatch_nanos(WorkerId::new(HOT_SLOTS as u32, 0)),
            None
        );
    }

    #[test]
    fn a_key_is_usable_only_by_its_live_worker_with_a_snapshot() {
        let table = HotTable::new(false);
        let snapshot = HotSnapshot {
            received_nanos: 7,
            queued_tokens: 10,
            throughput_tps: 100.0,
            kv_barrier_secs: 0.0,
            others_waiting_requests: 0,
        };
        let values = |key, last_dispatch_nanos| HotValues {
            snapshot: Some(snapshot),
            key: Some(key),
            last_dispatch_nanos,
            ..HotValues::default()
        };
        let read = |cursor: &mut KeyCursor<'_>, id: WorkerId| {
            let (key, last_dispatch) = cursor.key(id);
            (key, last_dispatch.load(Ordering::Relaxed))
        };
        let mut cursor = table.keys();
        let near = WorkerId::new(3, 0);
        // Another chunk of keys, so the cursor moves between chunks.
        let far = WorkerId::new(KEY_CHUNK as u32 + 5, 2);
        // Nothing allocated yet: unusable, never dispatched to.
        let (key, last_dispatch_nanos) = read(&mut cursor, near);
        assert_eq!((key.tag, last_dispatch_nanos), (UNUSABLE_TAG, i64::MIN));

        table.insert(near, || values((1.5, 0.25), 40));
        table.insert(far, || values((2.0, 0.5), 41));
        let mut cursor = table.keys();
        for _ in 0..2 {
            let (key, last_dispatch_nanos) = read(&mut cursor, near);
            assert_eq!(
                (key, last_dispatch_nanos),
                (
                    KeyRead {
                        tag: key_tag(near),
                        received_nanos: 7,
                        base_secs: 1.5,
                        inv_rate: 0.25
                    },
                    40
                )
            );
            let (key, last_dispatch_nanos) = read(&mut cursor, far);
            assert_eq!(
                (key.tag, key.base_secs, last_dispatch_nanos),
                (key_tag(far), 2.0, 41)
            );
        }
        // Another generation of the slot, a slot of a chunk never
        // allocated, and slots past the table never match.
        assert_ne!(
            read(&mut cursor, WorkerId::new(3, 1)).0.tag,
            key_tag(WorkerId::new(3, 1))
        );
        for slot in [5 * KEY_CHUNK as u32, HOT_SLOTS as u32, u32::MAX] {
            let id = WorkerId::new(slot, 0);
            let (key, last_dispatch_nanos) = read(&mut cursor, id);
            assert_ne!(key.tag, key_tag(id), "slot {slot}");
            assert_eq!(last_dispatch_nanos, i64::MIN);
        }
        // The one id whose tag is the unusable one reads a key received
        // at `i64::MIN`, which no selection takes for fresh.
        let last = WorkerId::new(u32::MAX, u32::MAX);
        let (key, _) = read(&mut cursor, last);
        assert_eq!((key.tag, key.received_nanos), (key_tag(last), i64::MIN));
        // No terms, no snapshot, or removed: unusable.
        table.update(near, || HotValues {
            key: None,
            ..values((1.5, 0.25), 40)
        });
        assert_eq!(read(&mut cursor, near).0.tag, UNUSABLE_TAG);
        table.update(near, || HotValues {
            snapshot: None,
            ..values((1.5, 0.25), 40)
        });
        assert_eq!(read(&mut cursor, near).0.tag, UNUSABLE_TAG);
        table.update(far, || values((2.0, 0.5), 41));
        assert_eq!(read(&mut cursor, far).0.tag, key_tag(far));
        table.remove(far);
        assert_eq!(read(&mut cursor, far).0.tag, UNUSABLE_TAG);
        // A late update for the removed worker does not revive its key.
        table.update(far, || values((2.0, 0.5), 41));
        assert_eq!(read(&mut cursor, far).0.tag, UNUSABLE_TAG);
    }
}
