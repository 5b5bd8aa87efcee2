//! The fleet's mean rate, remembered between selections.
//!
//! A candidate without a fresh snapshot is scored against the mean reported
//! rate of the candidates that have one ([`Fleet`]), and that mean reads
//! every candidate's snapshot: one worker whose load cannot be read would
//! make every selection read the whole fleet. The mean changes only when a
//! snapshot is stored or cleared, a worker joins or leaves, or a fresh
//! snapshot goes stale; so the last one computed is kept with what it
//! depends on and reused until one of those happens.

use parking_lot::Mutex;
use policy_core::WorkerId;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::score::Fleet;

/// The last [`Fleet`] computed, and when it can be reused.
#[derive(Debug, Default)]
pub(crate) struct FleetMemo {
    /// Bumped after every change the mean reads ([`FleetMemo::changed`]).
    epoch: AtomicU64,
    last: Mutex<Option<Memo>>,
}

#[derive(Debug)]
struct Memo {
    /// [`FleetMemo::epoch`] when the computation began: a change during it
    /// leaves the memo already out of date.
    epoch: u64,
    candidates: Vec<WorkerId>,
    computed_at_nanos: i64,
    /// The last instant every snapshot fresh then is still fresh.
    fresh_until_nanos: i64,
    fleet: Fleet,
}

impl Memo {
    /// Whether the memo is the fleet of `candidates` at `now_nanos`: nothing
    /// changed since, no fresh snapshot went stale, and no stale one can be
    /// fresh again (time only moves on from when it was computed).
    fn holds(&self, epoch: u64, candidates: &[WorkerId], now_nanos: i64) -> bool {
        self.epoch == epoch
            && self.computed_at_nanos <= now_nanos
            && now_nanos <= self.fresh_until_nanos
            && self.candidates == candidates
    }
}

impl FleetMemo {
    /// Something the mean reads changed: a snapshot was stored or cleared,
    /// or a worker was added or removed. Called after the change, so a
    /// selection that reads the new epoch also reads the change.
    pub fn changed(&self) {
        self.epoch.fetch_add(1, Ordering::AcqRel);
    }

    /// The fleet of `candidates` at `now_nanos`: the memo when it holds,
    /// else `compute()`'s, which returns it with the last instant every
    /// snapshot it found fresh stays so (`i64::MAX` when none is).
    ///
    /// Selections only try the lock: one that finds it taken computes the
    /// fleet itself rather than wait.
    pub fn fleet(
        &self,
        candidates: &[WorkerId],
        now_nanos: i64,
        compute: impl FnOnce() -> (Fleet, i64),
    ) -> Fleet {
        let epoch = self.epoch.load(Ordering::Acquire);
        if let Some(last) = self.last.try_lock()
            && let Some(memo) = last.as_ref()
            && memo.holds(epoch, candidates, now_nanos)
        {
            return memo.fleet;
        }
        let (fleet, fresh_until_nanos) = compute();
        if let Some(mut last) = self.last.try_lock() {
            // The candidate list's room passes from one memo to the next.
            let mut kept = last.take().map(|memo| memo.candidates).unwrap_or_default();
            kept.clear();
            kept.extend_from_slice(candidates);
            *last = Some(Memo {
                epoch,
                candidates: kept,
                computed_at_nanos: now_nanos,
                fresh_until_nanos,
                fleet,
            });
        }
        fleet
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    fn fleet(tps: f64) -> Fleet {
        Fleet {
            nominal_throughput_tps: tps,
            any_fresh: true,
        }
    }

    #[test]
    fn the_memo_serves_until_a_change_an_expiry_or_other_candidates() {
        let memo = FleetMemo::default();
        let ids = [WorkerId::new(0, 0), WorkerId::new(1, 0)];
        let computed = Cell::new(0);
        let get = |candidates: &[WorkerId], now_nanos: i64, tps: f64| {
            memo.fleet(candidates, now_nanos, || {
                computed.set(computed.get() + 1);
                (fleet(tps), 100)
            })
        };
        assert_eq!(get(&ids, 10, 1.0), fleet(1.0));
        // Later, before any fresh snapshot expires: remembered.
        assert_eq!(get(&ids, 100, 2.0), fleet(1.0));
        assert_eq!(computed.get(), 1);
        // Past the expiry, earlier than computed (a stale snapshot could
        // be fresh then), another candidate list, or after a change.
        assert_eq!(get(&ids, 101, 2.0), fleet(2.0));
        assert_eq!(get(&ids, 50, 3.0), fleet(3.0));
        assert_eq!(get(&ids[..1], 50, 4.0), fleet(4.0));
        assert_eq!(get(&ids[..1], 60, 0.0), fleet(4.0));
        memo.changed();
        assert_eq!(get(&ids[..1], 60, 5.0), fleet(5.0));
        assert_eq!(computed.get(), 5);
    }

    #[test]
    fn a_change_during_the_computation_leaves_the_memo_out_of_date() {
        let memo = FleetMemo::default();
        let ids = [WorkerId::new(0, 0)];
        // The change lands after the epoch was read, while computing.
        let first = memo.fleet(&ids, 10, || {
            memo.changed();
            (fleet(1.0), i64::MAX)
        });
        assert_eq!(first, fleet(1.0));
        assert_eq!(memo.fleet(&ids, 10, || (fleet(2.0), i64::MAX)), fleet(2.0));
        assert_eq!(memo.fleet(&ids, 10, || (fleet(3.0), i64::MAX)), fleet(2.0));
    }
}
