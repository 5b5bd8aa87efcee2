//! Dense, generation-checked per-worker state, shared by every policy.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use std::marker::PhantomData;
use std::sync::Arc;

use arc_swap::{ArcSwap, Guard};
use parking_lot::{Mutex, MutexGuard};

use crate::{PollMark, WorkerId, WorkerInfo, WorkerStats, worker_url_key};

/// One registered worker: its id, what the router told about it, and the
/// policy's state for it.
#[derive(Debug)]
pub struct Slot<S> {
    pub id: WorkerId,
    pub info: WorkerInfo,
    pub state: S,
}

/// Per-worker state in a vector indexed by [`WorkerId::slot`], with an index
/// by worker URL (other router replicas name workers by URL: a `WorkerId` is
/// this replica's own).
///
/// Selections read a published snapshot of the vector (`arc-swap`): taking
/// one writes no memory that other threads read, so concurrent selections do
/// not bounce a lock word between cores. Adding and removing workers (rare)
/// copy the vector of `Arc`s and the URL index, edit them and publish them;
/// the per-worker state is shared between versions, and state that
/// selections change lives behind atomics or per-worker locks inside `S`.
#[derive(Debug)]
pub struct WorkerSlots<S> {
    slots: ArcSwap<Published<S>>,
    /// Serializes writers, so no edit is lost between copy and publish.
    writer: Mutex<()>,
}

/// One published version of the slots: index = [`WorkerId::slot`].
type SlotVec<S> = Vec<Option<Arc<Slot<S>>>>;

#[derive(Debug)]
struct Published<S> {
    slots: SlotVec<S>,
    /// [`worker_url_key`] of each registered worker's URL → its id.
    by_url: HashMap<Box<str>, WorkerId>,
}

impl<S> Clone for Published<S> {
    fn clone(&self) -> Published<S> {
        Published {
            slots: self.slots.clone(),
            by_url: self.by_url.clone(),
        }
    }
}

impl<S> Default for WorkerSlots<S> {
    fn default() -> WorkerSlots<S> {
        WorkerSlots {
            slots: ArcSwap::from_pointee(Published {
                slots: Vec::new(),
                by_url: HashMap::new(),
            }),
            writer: Mutex::new(()),
        }
    }
}

impl<S> WorkerSlots<S> {
    pub fn new() -> WorkerSlots<S> {
        WorkerSlots::default()
    }

    /// Registers a worker, replacing whatever occupied its slot.
    pub fn insert(&self, id: WorkerId, info: WorkerInfo, state: S) {
        let _writer = self.writer.lock();
        let mut next = Published::clone(&self.slots.load());
        if next.slots.len() <= id.slot() {
            next.slots.resize_with(id.slot() + 1, || None);
        }
        if let Some(previous) = next.slots[id.slot()].take() {
            next.forget_url(&previous);
        }
        next.by_url.insert(worker_url_key(&info.url).into(), id);
        next.slots[id.slot()] = Some(Arc::new(Slot { id, info, state }));
        self.slots.store(Arc::new(next));
    }

    /// Unregisters a worker; an id of an earlier generation removes nothing.
    pub fn remove(&self, id: WorkerId) -> Option<Arc<Slot<S>>> {
        let _writer = self.writer.lock();
        let current = self.slots.load_full();
        let registered = current.slots.get(id.slot())?.as_ref()?;
        if registered.id != id {
            return None;
        }
        let mut next = Published::clone(&current);
        let removed = next.slots[id.slot()].take();
        if let Some(removed) = &removed {
            next.forget_url(removed);
        }
        self.slots.store(Arc::new(next));
        removed
    }

    /// A read view for one selection (or one explain).
    pub fn read(&self) -> SlotsView<'_, S> {
        SlotsView {
            slots: self.slots.load(),
            owner: PhantomData,
        }
    }
}

impl<S> Published<S> {
    /// Drops `slot`'s URL from the index, if the index still points at it
    /// (two workers may share a URL; the later one owns the entry).
    fn forget_url(&mut self, slot: &Slot<S>) {
        let key = worker_url_key(&slot.info.url);
        if self.by_url.get(key) == Some(&slot.id) {
            self.by_url.remove(key);
        }
    }
}

/// A snapshot of the slots, valid while it is held.
#[derive(Debug)]
pub struct SlotsView<'a, S> {
    slots: Guard<Arc<Published<S>>>,
    owner: PhantomData<&'a WorkerSlots<S>>,
}

impl<S> SlotsView<'_, S> {
    /// The worker's slot, if `id` is registered and of the current generation.
    pub fn get(&self, id: WorkerId) -> Option<&Slot<S>> {
        self.slots
            .slots
            .get(id.slot())
            .and_then(Option::as_deref)
            .filter(|slot| slot.id == id)
    }

    /// The worker registered with this URL (a trailing `/` is ignored).
    pub fn find_url(&self, url: &str) -> Option<&Slot<S>> {
        let id = *self.slots.by_url.get(worker_url_key(url))?;
        self.get(id)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Slot<S>> {
        self.slots.slots.iter().flatten().map(Arc::as_ref)
    }
}

/// Hashes dispatch sequence numbers (sequential `u64`s) with one multiply, so
/// that the outstanding-dispatch table costs no string or SipHash work.
#[derive(Debug, Default, Clone, Copy)]
pub struct SeqHasher(u64);

impl Hasher for SeqHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for byte in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(*byte)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_u64(&mut self, value: u64) {
        self.0 = value.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

#[derive(Debug, Clone, Copy)]
enum Held<N> {
    /// Before the first token: these prompt tokens are pending work, and the
    /// policy's note about the dispatch.
    Pending(u64, N),
    /// Past the first token: only the in-flight request is held.
    Started,
}

/// The outstanding dispatches of one [`WorkerLedger`], by sequence number.
type Outstanding<N> = HashMap<u64, Held<N>, BuildHasherDefault<SeqHasher>>;

/// A count that only the holder of its ledger's lock changes, and anyone
/// reads without it. The lock already orders the writers, so a change is a
/// plain load and store rather than a locked read-modify-write: a selection
/// and its finish change three counts each, and a locked instruction costs
/// as much as the rest of the change.
#[derive(Debug, Default)]
struct LockedCount(AtomicU64);

impl LockedCount {
    #[inline]
    fn get(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }

    /// Adds `delta`; `_held` shows the ledger's lock is held.
    #[inline]
    fn add<N>(&self, _held: &MutexGuard<'_, Outstanding<N>>, delta: u64) {
        let count = self.0.load(Ordering::Relaxed);
        self.0.store(count.saturating_add(delta), Ordering::Release);
    }

    /// Subtracts `delta`, stopping at zero (the ledger never releases more
    /// than it credited, so it never needs to); `_held` shows the ledger's
    /// lock is held.
    #[inline]
    fn sub<N>(&self, _held: &MutexGuard<'_, Outstanding<N>>, delta: u64) {
        let count = self.0.load(Ordering::Relaxed);
        self.0.store(count.saturating_sub(delta), Ordering::Release);
    }
}

/// This router's live work on one worker: what is pending (dispatched, first
/// token not yet seen) and what is in flight (not yet finished).
///
/// Readers get the counts lock-free; changes go through a per-worker lock that
/// also keeps the outstanding dispatches, which makes `first_token` and
/// `finish` idempotent and lets a cap check and its credit be one critical
/// section.
///
/// A policy may keep a small note `N` with each pending dispatch (`least_load`
/// keeps when it was sent and the work ahead of it, to learn the worker's
/// rate when its first token comes); the note is handed back by
/// [`WorkerLedger::first_token_noted`]. Most policies keep none (`()`).
#[derive(Debug)]
pub struct WorkerLedger<N = ()> {
    pending_tokens: LockedCount,
    pending_requests: LockedCount,
    in_flight_requests: LockedCount,
    outstanding: Mutex<Outstanding<N>>,
}

impl<N> Default for WorkerLedger<N> {
    fn default() -> WorkerLedger<N> {
        WorkerLedger {
            pending_tokens: LockedCount::default(),
            pending_requests: LockedCount::default(),
            in_flight_requests: LockedCount::default(),
            outstanding: Mutex::new(HashMap::default()),
        }
    }
}

impl WorkerLedger {
    pub fn new() -> WorkerLedger {
        WorkerLedger::default()
    }

    /// Credits dispatch `seq` with `tokens` of pending work if `admit`, given
    /// the counts under the lock, agrees. The check and the credit are one
    /// critical section, so concurrent selections cannot overshoot a cap.
    pub fn try_credit(
        &self,
        seq: u64,
        tokens: u64,
        admit: impl FnOnce(WorkerStats) -> bool,
    ) -> bool {
        self.try_credit_noted(seq, tokens, |stats| admit(stats).then_some(()))
    }

    /// Credits dispatch `seq` unconditionally.
    pub fn credit(&self, seq: u64, tokens: u64) {
        self.try_credit(seq, tokens, |_| true);
    }

    /// Releases the pending work of dispatch `seq`; returns the tokens
    /// released, or `None` if it was not pending (unknown, or already released).
    pub fn first_token(&self, seq: u64) -> Option<u64> {
        self.first_token_noted(seq).map(|(tokens, ())| tokens)
    }
}

impl<N: Copy> WorkerLedger<N> {
    /// The live counts, read without locking.
    pub fn stats(&self) -> WorkerStats {
        WorkerStats {
            in_flight_requests: self.in_flight_requests.get(),
            pending_requests: self.pending_requests.get(),
            pending_tokens: self.pending_tokens.get(),
        }
    }

    /// Credits dispatch `seq` with `tokens` of pending work and the note
    /// `admit` returns, given the counts under the lock; `None` refuses. The
    /// check, the note and the credit are one critical section.
    pub fn try_credit_noted(
        &self,
        seq: u64,
        tokens: u64,
        admit: impl FnOnce(WorkerStats) -> Option<N>,
    ) -> bool {
        let mut outstanding = self.outstanding.lock();
        let Some(note) = admit(self.stats()) else {
            return false;
        };
        if outstanding
            .insert(seq, Held::Pending(tokens, note))
            .is_none()
        {
            self.pending_tokens.add(&outstanding, tokens);
            self.pending_requests.add(&outstanding, 1);
            self.in_flight_requests.add(&outstanding, 1);
        }
        true
    }

    /// Releases the pending work of dispatch `seq`; returns the tokens
    /// released and the dispatch's note, or `None` if it was not pending.
    pub fn first_token_noted(&self, seq: u64) -> Option<(u64, N)> {
        let mut outstanding = self.outstanding.lock();
        let held = outstanding.get_mut(&seq)?;
        let Held::Pending(tokens, note) = *held else {
            return None;
        };
        *held = Held::Started;
        self.release_pending(&outstanding, tokens);
        Some((tokens, note))
    }

    /// Releases everything dispatch `seq` still holds; returns whether it was
    /// outstanding.
    pub fn finish(&self, seq: u64) -> bool {
        let mut outstanding = self.outstanding.lock();
        match outstanding.remove(&seq) {
            Some(Held::Pending(tokens, _)) => {
                self.release_pending(&outstanding, tokens);
                self.in_flight_requests.sub(&outstanding, 1);
                true
            }
            Some(Held::Started) => {
                self.in_flight_requests.sub(&outstanding, 1);
                true
            }
            None => false,
        }
    }

    /// A poll mark recording this worker's pending work now.
    pub fn poll_mark(&self, worker: WorkerId, seq: u64, now: Instant) -> PollMark {
        let stats = self.stats();
        PollMark {
            worker,
            seq,
            sent_at: now,
            pending_tokens: stats.pending_tokens,
            pending_requests: stats.pending_requests,
            remote_pending_tokens: 0,
            remote_pending_requests: 0,
        }
    }

    fn release_pending(&self, held: &MutexGuard<'_, Outstanding<N>>, tokens: u64) {
        self.pending_tokens.sub(held, tokens);
        self.pending_requests.sub(held, 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_token_and_finish_are_idempotent() {
        let ledger = WorkerLedger::new();
        ledger.credit(1, 300);
        ledger.credit(2, 50);
        assert_eq!(
            ledger.stats(),
            WorkerStats {
                in_flight_requests: 2,
                pending_requests: 2,
                pending_tokens: 350
            }
        );
        assert_eq!(ledger.first_token(1), Some(300));
        assert_eq!(ledger.first_token(1), None);
        assert_eq!(ledger.stats().pending_tokens, 50);
        assert_eq!(ledger.stats().in_flight_requests, 2);
        assert!(ledger.finish(1));
        assert!(!ledger.finish(1));
        // Finishing a dispatch that never saw its first token releases its tokens.
        assert!(ledger.finish(2));
        assert_eq!(ledger.stats(), WorkerStats::default());
        // Unknown dispatches touch nothing.
        assert_eq!(ledger.first_token(99), None);
        assert!(!ledger.finish(99));
        assert_eq!(ledger.stats(), WorkerStats::default());
    }

    #[test]
    fn counts_changed_under_the_lock_stop_at_zero() {
        let ledger: WorkerLedger = WorkerLedger::new();
        let held = ledger.outstanding.lock();
        ledger.pending_tokens.add(&held, 40);
        ledger.pending_tokens.sub(&held, 100);
        assert_eq!(ledger.pending_tokens.get(), 0);
        ledger.pending_tokens.add(&held, u64::MAX);
        ledger.pending_tokens.add(&held, 1);
        assert_eq!(ledger.pending_tokens.get(), u64::MAX);
    }

    #[test]
    fn counts_stay_exact_under_concurrent_credits_and_finishes() {
        let ledger = Arc::new(WorkerLedger::new());
        let threads: Vec<_> = (0..4u64)
            .map(|thread| {
                let ledger = Arc::clone(&ledger);
                std::thread::spawn(move || {
                    for i in 0..2000u64 {
                        let seq = thread * 1_000_000 + i;
                        ledger.credit(seq, 7);
                        if i % 2 == 0 {
                            ledger.first_token(seq);
                        }
                        ledger.finish(seq);
                    }
                    // One left outstanding per thread.
                    ledger.credit(thread * 1_000_000 + 5000, 3);
                })
            })
            .collect();
        for thread in threads {
            thread.join().expect("a crediting thread panicked");
        }
        assert_eq!(
            ledger.stats(),
            WorkerStats {
                in_flight_requests: 4,
                pending_requests: 4,
                pending_tokens: 12
            }
        );
    }

    #[test]
    fn a_refused_credit_changes_nothing() {
        let ledger = WorkerLedger::new();
        assert!(ledger.try_credit(1, 10, |stats| stats.pending_requests < 1));
        assert!(!ledger.try_credit(2, 10, |stats| stats.pending_requests < 1));
        assert_eq!(ledger.stats().pending_requests, 1);
        assert_eq!(ledger.stats().pending_tokens, 10);
    }

    #[test]
    fn removed_generation_is_not_found() {
        let slots = WorkerSlots::new();
        let old = WorkerId::new(0, 0);
        let new = WorkerId::new(0, 1);
        slots.insert(old, WorkerInfo::new("http://a", "sglang"), 1u8);
        assert!(slots.remove(old).is_some());
        slots.insert(new, WorkerInfo::new("http://b", "sglang"), 2u8);
        assert!(
            slots.remove(old).is_none(),
            "the old id must not remove the new worker"
        );
        let view = slots.read();
        assert!(view.get(old).is_none());
        assert_eq!(view.get(new).map(|slot| slot.state), Some(2));
        assert_eq!(view.iter().count(), 1);
    }

    #[test]
    fn workers_are_found_by_url() {
        let slots = WorkerSlots::new();
        let (a, b) = (WorkerId::new(0, 0), WorkerId::new(1, 0));
        slots.insert(a, WorkerInfo::new("http://a:1/", "sglang"), 1u8);
        slots.insert(b, WorkerInfo::new("http://b:1", "sglang"), 2u8);
        let view = slots.read();
        assert_eq!(view.find_url("http://a:1").map(|slot| slot.id), Some(a));
        assert_eq!(view.find_url("http://b:1/").map(|slot| slot.id), Some(b));
        assert!(view.find_url("http://c:1").is_none());
        drop(view);
        slots.remove(a);
        assert!(slots.read().find_url("http://a:1").is_none());
        // A slot reused by another worker answers to its new URL only.
        let reused = WorkerId::new(1, 1);
        slots.insert(reused, WorkerInfo::new("http://d:1", "sglang"), 3u8);
        let view = slots.read();
        assert!(view.find_url("http://b:1").is_none());
        assert_eq!(
            view.find_url("http://d:1").map(|slot| slot.id),
            Some(reused)
        );
    }
}
