//! What this replica publishes at each tick: the workers whose pending work
//! changed since the last message, or everything when a full state is due.

use std::collections::HashMap;
use std::time::Duration;

use policy_core::worker_url_key;
use tokio::time::Instant;

use super::wire;

/// One worker's pending work as last published, and the tick that last saw
/// the worker (a worker no tick sees any more was removed).
#[derive(Debug, Clone, Copy)]
struct Published {
    tokens: u64,
    requests: u64,
    seen_tick: u64,
}

/// This replica's side of the exchange: its id, its sequence numbers, and
/// what it last told the others. Pure: the caller reads the pending work and
/// sends the bytes.
#[derive(Debug)]
pub struct Publisher {
    replica: String,
    next_seq: u64,
    full_state_interval: Duration,
    last_full: Option<Instant>,
    published: HashMap<Box<str>, Published>,
    tick: u64,
    /// Reused between ticks: (worker URL, tokens, requests) of the next message.
    pending: Vec<(String, u64, u64)>,
}

impl Publisher {
    /// A publisher whose sequence starts at `first_seq` (the router passes
    /// its start time in microseconds since the Unix epoch).
    pub fn new(replica: String, first_seq: u64, full_state_interval: Duration) -> Publisher {
        Publisher {
            replica,
            next_seq: first_seq,
            full_state_interval,
            last_full: None,
            published: HashMap::new(),
            tick: 0,
            pending: Vec::new(),
        }
    }

    pub fn replica(&self) -> &str {
        &self.replica
    }

    /// The next message is a full state: the last ones may not have arrived
    /// (the broker was away, or a publish failed).
    pub fn force_full_state(&mut self) {
        self.last_full = None;
    }

    /// One tick over every worker's `(url, pending tokens, pending
    /// requests)`: the message to publish, or `None` when nothing changed
    /// and no full state is due.
    pub fn tick<'u>(
        &mut self,
        now: Instant,
        workers: impl IntoIterator<Item = (&'u str, u64, u64)>,
    ) -> Option<Vec<u8>> {
        self.tick = self.tick.wrapping_add(1);
        let tick = self.tick;
        let full = self
            .last_full
            .is_none_or(|last| now.saturating_duration_since(last) >= self.full_state_interval);
        self.pending.clear();
        for (url, tokens, requests) in workers {
            let url = worker_url_key(url);
            let changed = match self.published.get_mut(url) {
                Some(entry) => {
                    let changed = (entry.tokens, entry.requests) != (tokens, requests);
                    *entry = Published {
                        tokens,
                        requests,
                        seen_tick: tick,
                    };
                    changed
                }
                None => {
                    self.published.insert(
                        url.into(),
                        Published {
                            tokens,
                            requests,
                            seen_tick: tick,
                        },
                    );
                    true
                }
            };
            if full || changed {
                self.pending.push((url.to_owned(), tokens, requests));
            }
        }
        // A worker this replica no longer has: a last word of zero, so the
        // others need not wait for the TTL.
        let pending = &mut self.pending;
        self.published.retain(|url, entry| {
            let present = entry.seen_tick == tick;
            if !present && (entry.tokens, entry.requests) != (0, 0) {
                pending.push((url.to_string(), 0, 0));
            }
            present
        });
        if !full && self.pending.is_empty() {
            return None;
        }
        if full {
            self.last_full = Some(now);
        }
        let seq = self.next_seq;
        self.next_seq = self.next_seq.wrapping_add(1);
        let entries: Vec<(&str, u64, u64)> = self
            .pending
            .iter()
            .map(|(url, tokens, requests)| (url.as_str(), *tokens, *requests))
            .collect();
        Some(wire::encode(&self.replica, seq, full, &entries))
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
                [("http://w:1/", 0, 0), ("http://w:2", 500, 1)],
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
                    [("http://w:1", 0, 0), ("http://w:2", 500, 1)]
                )
                .is_none(),
            "nothing changed"
        );
        tokio::time::advance(Duration::from_millis(25)).await;
        let change = publisher
            .tick(
                Instant::now(),
                [("http://w:1", 200, 1), ("http://w:2", 500, 1)],
            )
            .unwrap();
        assert_eq!(
            decoded(&change),
            (101, false, owned(&[("http://w:1", 200, 1)]))
        );
        // Worker 2 is removed: its zero goes out once.
        tokio::time::advance(Duration::from_millis(25)).await;
        let removed = publisher
            .tick(Instant::now(), [("http://w:1", 200, 1)])
            .unwrap();
        assert_eq!(
            decoded(&removed),
            (102, false, owned(&[("http://w:2", 0, 0)]))
        );
        tokio::time::advance(Duration::from_millis(25)).await;
        assert!(
            publisher
                .tick(Instant::now(), [("http://w:1", 200, 1)])
                .is_none()
        );
        // 250 ms after the last full state, the next one is due.
        tokio::time::advance(Duration::from_millis(150)).await;
        let full = publisher
            .tick(Instant::now(), [("http://w:1", 200, 1)])
            .unwrap();
        assert_eq!(
            decoded(&full),
            (103, true, owned(&[("http://w:1", 200, 1)]))
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_forced_full_state_goes_out_at_the_next_tick() {
        let mut publisher = Publisher::new("a".into(), 7, Duration::from_secs(60));
        publisher.tick(Instant::now(), [("http://w:1", 1, 1)]);
        assert!(
            publisher
                .tick(Instant::now(), [("http://w:1", 1, 1)])
                .is_none()
        );
        publisher.force_full_state();
        let full = publisher
            .tick(Instant::now(), [("http://w:1", 1, 1)])
            .unwrap();
        assert_eq!(decoded(&full), (8, true, owned(&[("http://w:1", 1, 1)])));
    }
}
