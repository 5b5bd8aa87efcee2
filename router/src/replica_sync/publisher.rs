//! What this replica publishes at each tick: the workers whose pending work
//! changed since the last message, or everything when a full state is due.
//!
//! It runs every publish interval over every worker, so what it remembers is
//! indexed by worker slot, not hashed by URL: a tick over 1024 unchanged
//! workers is a walk over two vectors.

use std::time::Duration;

use policy_core::{WorkerId, worker_url_key};
use tokio::time::Instant;

use super::wire;

/// One worker's pending work as this replica sees it now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct WorkerPending<'u> {
    pub(super) id: WorkerId,
    pub(super) url: &'u str,
    pub(super) tokens: u64,
    pub(super) requests: u64,
}

/// One worker's pending work as last published, and the tick that last saw
/// the worker (a worker no tick sees any more was removed).
#[derive(Debug, Clone)]
struct Published {
    id: WorkerId,
    /// [`worker_url_key`] of its URL, copied once when the worker is first seen.
    url: Box<str>,
    tokens: u64,
    requests: u64,
    seen_tick: u64,
}

/// This replica's side of the exchange: its id, its sequence numbers, and
/// what it last told the others. Pure: the caller reads the pending work and
/// sends the bytes.
#[derive(Debug)]
pub(super) struct Publisher {
    replica: String,
    next_seq: u64,
    full_state_interval: Duration,
    last_full: Option<Instant>,
    /// By worker slot.
    published: Vec<Option<Published>>,
    tick: u64,
    /// Reused between ticks: the slots to send, and the zeros of workers
    /// that left (URL, 0, 0).
    changed: Vec<usize>,
    gone: Vec<Box<str>>,
    /// Whether the last message told of a request waiting in this
    /// replica's admission room.
    room_waiting_told: bool,
}

impl Publisher {
    /// A publisher whose sequence starts at `first_seq` (the router passes
    /// its start time in microseconds since the Unix epoch).
    pub(super) fn new(replica: String, first_seq: u64, full_state_interval: Duration) -> Publisher {
        Publisher {
            replica,
            next_seq: first_seq,
            full_state_interval,
            last_full: None,
            published: Vec::new(),
            tick: 0,
            changed: Vec::new(),
            gone: Vec::new(),
            room_waiting_told: false,
        }
    }

    /// The next message is a full state: the last ones may not have arrived
    /// (the broker was away, or a publish failed).
    pub(super) fn force_full_state(&mut self) {
        self.last_full = None;
    }

    /// One tick over every worker, with the first tokens had since the
    /// last ([`wire::FirstTokenOut`]) and this replica's admission room:
    /// the message to publish, or `None` when nothing changed, no full
    /// state is due, there is no first token and no request waits in the
    /// room (nor did at the last message).
    pub(super) fn tick<'u>(
        &mut self,
        now: Instant,
        workers: impl IntoIterator<Item = WorkerPending<'u>>,
        prefill: &[wire::FirstTokenOut<'_>],
        room: Option<&wire::Room>,
    ) -> Option<Vec<u8>> {
        self.tick = self.tick.wrapping_add(1);
        let tick = self.tick;
        let full = self
            .last_full
            .is_none_or(|last| now.saturating_duration_since(last) >= self.full_state_interval);
        self.changed.clear();
        self.gone.clear();
        for worker in workers {
            let slot = worker.id.slot();
            if self.published.len() <= slot {
                self.published.resize_with(slot + 1, || None);
            }
            let entry = &mut self.published[slot];
            let changed = match entry {
                Some(published) if published.id == worker.id => {
                    let changed =
                        (published.tokens, published.requests) != (worker.tokens, worker.requests);
                    published.tokens = worker.tokens;
                    published.requests = worker.requests;
                    published.seen_tick = tick;
                    changed
                }
                _ => {
                    // A new worker, or a new one in a removed worker's slot
                    // (whose last word is a zero, unless it had none).
                    if let Some(previous) = entry.take()
                        && (previous.tokens, previous.requests) != (0, 0)
                        && *previous.url != *worker_url_key(worker.url)
                    {
                        self.gone.push(previous.url);
                    }
                    *entry = Some(Published {
                        id: worker.id,
                        url: worker_url_key(worker.url).into(),
                        tokens: worker.tokens,
                        requests: worker.requests,
                        seen_tick: tick,
                    });
                    true
                }
            };
            if full || changed {
                self.changed.push(slot);
            }
        }
        // A worker this replica no longer has: a last word of zero, so the
        // others need not wait for the TTL.
        for entry in &mut self.published {
            if entry
                .as_ref()
                .is_some_and(|published| published.seen_tick != tick)
                && let Some(previous) = entry.take()
                && (previous.tokens, previous.requests) != (0, 0)
            {
                self.gone.push(previous.url);
            }
        }
        let room_waiting = room.is_some_and(|room| room.oldest_wait_ms.is_some());
        if !full
            && self.changed.is_empty()
            && self.gone.is_empty()
            && prefill.is_empty()
            && !room_waiting
            && !self.room_waiting_told
        {
            return None;
        }
        self.room_waiting_told = room_waiting;
        if full {
            self.last_full = Some(now);
        }
        let seq = self.next_seq;
        self.next_seq = self.next_seq.wrapping_add(1);
        let published = &self.published;
        let entries: Vec<(&str, u64, u64)> = self
            .changed
            .iter()
            .filter_map(|slot| published.get(*slot)?.as_ref())
            .map(|published| (&*published.url, published.tokens, published.requests))
            .chain(self.gone.iter().map(|url| (&**url, 0, 0)))
            .collect();
        Some(wire::encode(
            &self.replica,
            seq,
            full,
            &entries,
            prefill,
            room,
        ))
    }
}

impl Publisher {
    /// A message with just `workers` whose pending work changed since last
    /// published (a dispatch raised it): sent at once rather than at the next
    /// tick, so the other replicas see a dispatch within the broker's
    /// latency. `None` when none changed or a worker is new (the next tick
    /// introduces it). Full states and removals are left to [`tick`](Self::tick).
    pub(super) fn dispatched<'u>(
        &mut self,
        workers: impl IntoIterator<Item = WorkerPending<'u>>,
        room: Option<&wire::Room>,
    ) -> Option<Vec<u8>> {
        let mut entries: Vec<(&str, u64, u64)> = Vec::new();
        self.changed.clear();
        for worker in workers {
            let slot = worker.id.slot();
            let Some(Some(published)) = self.published.get_mut(slot) else {
                continue;
            };
            if published.id != worker.id
                || (published.tokens, published.requests) == (worker.tokens, worker.requests)
            {
                continue;
            }
            published.tokens = worker.tokens;
            published.requests = worker.requests;
            if !self.changed.contains(&slot) {
                self.changed.push(slot);
            }
        }
        if self.changed.is_empty() {
            return None;
        }
        let seq = self.next_seq;
        self.next_seq = self.next_seq.wrapping_add(1);
        for slot in &self.changed {
            if let Some(Some(published)) = self.published.get(*slot) {
                entries.push((&published.url, published.tokens, published.requests));
            }
        }
        self.room_waiting_told = room.is_some_and(|room| room.oldest_wait_ms.is_some());
        Some(wire::encode(&self.replica, seq, false, &entries, &[], room))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decoded(payload: &[u8]) -> (u64, bool, Vec<(String, u64, u64)>) {
        let message = wire::decode(payload).unwrap();
        let entries = message
            .entries()
            .map(|entry| {
                let entry = entry.unwrap();
                (
                    entry.worker_url.to_owned(),
                    entry.pending_tokens,
                    entry.pending_requests,
                )
            })
            .collect();
        (message.seq, message.full, entries)
    }

    fn w(slot: u32, url: &str, tokens: u64, requests: u64) -> WorkerPending<'_> {
        WorkerPending {
            id: WorkerId::new(slot, 0),
            url,
            tokens,
            requests,
        }
    }

    fn owned(entries: &[(&str, u64, u64)]) -> Vec<(String, u64, u64)> {
        entries
            .iter()
            .map(|(url, tokens, requests)| ((*url).to_owned(), *tokens, *requests))
            .collect()
    }

    #[tokio::test(start_paused = true)]
    async fn only_changes_are_sent_between_full_states() {
        let mut publisher = Publisher::new("a".into(), 100, Duration::from_millis(250));
        let first = publisher
            .tick(
                Instant::now(),
                [w(0, "http://w:1/", 0, 0), w(1, "http://w:2", 500, 1)],
                &[],
                None,
            )
            .unwrap();
        assert_eq!(
            decoded(&first),
            (
                100,
                true,
                owned(&[("http://w:1", 0, 0), ("http://w:2", 500, 1)])
            ),
            "the first message is a full state, URLs without trailing slashes"
        );
        tokio::time::advance(Duration::from_millis(25)).await;
        assert!(
            publisher
                .tick(
                    Instant::now(),
                    [w(0, "http://w:1", 0, 0), w(1, "http://w:2", 500, 1)],
                    &[],
                    None
                )
                .is_none(),
            "nothing changed"
        );
        tokio::time::advance(Duration::from_millis(25)).await;
        let change = publisher
            .tick(
                Instant::now(),
                [w(0, "http://w:1", 200, 1), w(1, "http://w:2", 500, 1)],
                &[],
                None,
            )
            .unwrap();
        assert_eq!(
            decoded(&change),
            (101, false, owned(&[("http://w:1", 200, 1)]))
        );
        // Worker 2 is removed: its zero goes out once.
        tokio::time::advance(Duration::from_millis(25)).await;
        let removed = publisher
            .tick(Instant::now(), [w(0, "http://w:1", 200, 1)], &[], None)
            .unwrap();
        assert_eq!(
            decoded(&removed),
            (102, false, owned(&[("http://w:2", 0, 0)]))
        );
        tokio::time::advance(Duration::from_millis(25)).await;
        assert!(
            publisher
                .tick(Instant::now(), [w(0, "http://w:1", 200, 1)], &[], None)
                .is_none()
        );
        // 250 ms after the last full state, the next one is due.
        tokio::time::advance(Duration::from_millis(150)).await;
        let full = publisher
            .tick(Instant::now(), [w(0, "http://w:1", 200, 1)], &[], None)
            .unwrap();
        assert_eq!(
            decoded(&full),
            (103, true, owned(&[("http://w:1", 200, 1)]))
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_tick_goes_out_while_a_request_waits_in_the_room_and_once_after() {
        let mut publisher = Publisher::new("a".into(), 1, Duration::from_secs(60));
        let workers = || [w(0, "http://w:1", 1, 1)];
        publisher.tick(Instant::now(), workers(), &[], None);
        let waiting = wire::Room {
            oldest_wait_ms: Some(30),
            ..wire::Room::default()
        };
        let empty = wire::Room::default();
        // Nothing changed, but a request waits: every tick tells.
        for _ in 0..2 {
            let payload = publisher
                .tick(Instant::now(), workers(), &[], Some(&waiting))
                .unwrap();
            assert_eq!(
                wire::decode(&payload).unwrap().room(),
                Some(Ok(waiting.clone()))
            );
        }
        // The room emptied: one more message says so, then quiet.
        let payload = publisher
            .tick(Instant::now(), workers(), &[], Some(&empty))
            .unwrap();
        assert_eq!(
            wire::decode(&payload).unwrap().room(),
            Some(Ok(empty.clone()))
        );
        assert!(
            publisher
                .tick(Instant::now(), workers(), &[], Some(&empty))
                .is_none()
        );
        // A dispatch's message carries the room too.
        let payload = publisher
            .dispatched([w(0, "http://w:1", 9, 2)], Some(&waiting))
            .unwrap();
        assert_eq!(wire::decode(&payload).unwrap().room(), Some(Ok(waiting)));
    }

    #[tokio::test(start_paused = true)]
    async fn first_tokens_go_out_at_the_next_tick_even_when_nothing_changed() {
        let mut publisher = Publisher::new("a".into(), 7, Duration::from_secs(60));
        publisher.tick(Instant::now(), [w(0, "http://w:1", 1, 1)], &[], None);
        let payload = publisher
            .tick(
                Instant::now(),
                [w(0, "http://w:1", 1, 1)],
                &[("http://w:1", 4000, 120, 500_000, 30_000)],
                None,
            )
            .unwrap();
        assert_eq!(decoded(&payload), (8, false, Vec::new()));
        let message = wire::decode(&payload).unwrap();
        let samples: Vec<_> = message
            .prefill_samples()
            .map(|sample| {
                let sample = sample.unwrap();
                (
                    sample.worker_url,
                    sample.sample.tokens,
                    sample.sample.foreign_ahead_tokens,
                    sample.sample.waited,
                    sample.ago,
                )
            })
            .collect();
        assert_eq!(
            samples,
            vec![(
                "http://w:1",
                4000,
                120,
                Duration::from_millis(500),
                Duration::from_millis(30)
            )]
        );
        // Sent once: the next tick has nothing to say.
        assert!(
            publisher
                .tick(Instant::now(), [w(0, "http://w:1", 1, 1)], &[], None)
                .is_none()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_forced_full_state_goes_out_at_the_next_tick() {
        let mut publisher = Publisher::new("a".into(), 7, Duration::from_secs(60));
        publisher.tick(Instant::now(), [w(0, "http://w:1", 1, 1)], &[], None);
        assert!(
            publisher
                .tick(Instant::now(), [w(0, "http://w:1", 1, 1)], &[], None)
                .is_none()
        );
        publisher.force_full_state();
        let full = publisher
            .tick(Instant::now(), [w(0, "http://w:1", 1, 1)], &[], None)
            .unwrap();
        assert_eq!(decoded(&full), (8, true, owned(&[("http://w:1", 1, 1)])));
    }

    #[tokio::test(start_paused = true)]
    async fn a_slot_taken_by_another_worker_clears_the_old_one() {
        let mut publisher = Publisher::new("a".into(), 1, Duration::from_secs(60));
        publisher.tick(Instant::now(), [w(0, "http://old:1", 300, 1)], &[], None);
        let replaced = publisher
            .tick(
                Instant::now(),
                [WorkerPending {
                    id: WorkerId::new(0, 1),
                    url: "http://new:1",
                    tokens: 0,
                    requests: 0,
                }],
                &[],
                None,
            )
            .unwrap();
        assert_eq!(
            decoded(&replaced),
            (
                2,
                false,
                owned(&[("http://new:1", 0, 0), ("http://old:1", 0, 0)])
            )
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_dispatch_is_published_at_once_with_only_its_worker() {
        let mut publisher = Publisher::new("a".into(), 10, Duration::from_secs(1));
        let now = Instant::now();
        // The first tick introduces the workers.
        let first = publisher
            .tick(
                now,
                [w(0, "http://w:0", 0, 0), w(1, "http://w:1", 0, 0)],
                &[],
                None,
            )
            .unwrap();
        assert_eq!(decoded(&first).0, 10);
        // A dispatch to worker 1: only it, at once, with the next seq.
        let message = publisher
            .dispatched(
                [w(1, "http://w:1", 500, 1), w(1, "http://w:1", 500, 1)],
                None,
            )
            .unwrap();
        assert_eq!(
            decoded(&message),
            (11, false, owned(&[("http://w:1", 500, 1)]))
        );
        // Nothing changed since: nothing to send; the tick sends nothing
        // either (it was published).
        assert_eq!(
            publisher.dispatched([w(1, "http://w:1", 500, 1)], None),
            None
        );
        assert_eq!(
            publisher.tick(
                now,
                [w(0, "http://w:0", 0, 0), w(1, "http://w:1", 500, 1)],
                &[],
                None
            ),
            None
        );
        // A worker no tick has seen yet waits for the tick.
        assert_eq!(publisher.dispatched([w(2, "http://w:2", 9, 1)], None), None);
    }
}
