//! The other replicas' admission rooms, as their pending-work messages
//! carry them ([`wire::Room`]): what this replica's room needs to take
//! turns with theirs ([`admission::RoomReport`]).
//!
//! A message's waits are relative to when it was sent; they become
//! instants on this router's clock when it is received (the broker's
//! latency makes a peer's request look a little younger than it is, so
//! this replica leaves the fleet's room to it a little later, never
//! sooner). Workers are named by URL on the wire and by this router's ids
//! here; one this router does not have is left out.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use admission::RoomReport;
use arc_swap::ArcSwapOption;
use parking_lot::Mutex;
use policy_core::{WorkerId, worker_url_key};

use super::wire;
use crate::config::SyncConfig;
use crate::topology::Snapshot;

/// The id this router has for a worker URL (as [`worker_url_key`] keys it).
pub(super) fn id_of(snapshot: &Snapshot, url: &str) -> Option<WorkerId> {
    let key = worker_url_key(url);
    snapshot
        .workers()
        .find(|worker| worker_url_key(&worker.url) == key)
        .map(|worker| worker.id)
}

/// The URL of one of this router's workers, as the wire names it.
pub(super) fn url_of(snapshot: &Snapshot, id: WorkerId) -> Option<&str> {
    snapshot
        .worker(id)
        .map(|worker| worker_url_key(&worker.url))
}

/// The other replicas heard within the TTL, each with its room (empty for
/// a replica without admission), and all of them as one, read without a
/// lock by the admission gate.
#[derive(Debug, Default)]
pub(crate) struct PeerRooms {
    ttl: Duration,
    heard: Mutex<HashMap<String, Heard>>,
    combined: ArcSwapOption<RoomReport>,
}

#[derive(Debug)]
struct Heard {
    at: Instant,
    room: RoomReport,
}

impl PeerRooms {
    /// Empty; replicas are forgotten `sync.entry_ttl_ms` after their last
    /// message.
    pub(crate) fn new(config: &SyncConfig) -> PeerRooms {
        PeerRooms {
            ttl: config.entry_ttl(),
            ..PeerRooms::default()
        }
    }

    /// The other replicas' rooms as one ([`RoomReport::combine`]); `None`
    /// while no other replica is heard (sync off, or a single router).
    pub(crate) fn combined(&self) -> Option<RoomReport> {
        self.combined.load().as_deref().cloned()
    }

    /// A message from `replica` arrived at `now` with `room` (`None`: it
    /// runs without admission).
    /// `id_of` names this router's worker for a URL.
    pub(super) fn heard(
        &self,
        replica: &str,
        room: Option<&wire::Room>,
        id_of: impl Fn(&str) -> Option<WorkerId>,
        now: Instant,
    ) {
        let room = room.map_or_else(RoomReport::default, |room| report(room, id_of, now));
        let mut heard = self.heard.lock();
        heard.insert(replica.to_owned(), Heard { at: now, room });
        self.recombine(&heard);
    }

    /// Forgets the replicas silent for longer than the TTL.
    pub(super) fn sweep(&self, now: Instant) {
        let mut heard = self.heard.lock();
        let before = heard.len();
        heard.retain(|_, peer| now.saturating_duration_since(peer.at) <= self.ttl);
        if heard.len() != before {
            self.recombine(&heard);
        }
    }

    fn recombine(&self, heard: &HashMap<String, Heard>) {
        let combined = (!heard.is_empty())
            .then(|| RoomReport::combine(heard.values().map(|peer| peer.room.clone())));
        self.combined.store(combined.map(std::sync::Arc::new));
    }
}

/// A received room on this router's clock and ids.
fn report(room: &wire::Room, id_of: impl Fn(&str) -> Option<WorkerId>, now: Instant) -> RoomReport {
    let since = |ms: u64| now.checked_sub(Duration::from_millis(ms)).unwrap_or(now);
    RoomReport {
        oldest_arrived: room.oldest_wait_ms.map(since),
        prefill_busy_workers: room.prefill_busy_workers,
        waiting_for: room
            .waiting_for
            .iter()
            .filter_map(|(url, ms)| Some((id_of(url)?, since(*ms))))
            .collect(),
        // Within `MAX_ROOM_QUEUED_REQUESTS`, which `check` enforces.
        queued_requests: usize::try_from(room.queued_requests).unwrap_or(usize::MAX),
    }
}

/// This replica's room as its messages carry it, at `now`: waits in
/// milliseconds, workers by the URL `url_of` gives (one removed since is
/// left out).
pub(super) fn outgoing<'u>(
    report: &RoomReport,
    url_of: impl Fn(WorkerId) -> Option<&'u str>,
    now: Instant,
) -> wire::Room {
    let waited_ms = |since: Instant| {
        u64::try_from(now.saturating_duration_since(since).as_millis())
            .unwrap_or(u64::MAX)
            .min(wire::MAX_ROOM_WAIT_MS)
    };
    wire::Room {
        oldest_wait_ms: report.oldest_arrived.map(waited_ms),
        prefill_busy_workers: report.prefill_busy_workers,
        waiting_for: report
            .waiting_for
            .iter()
            .take(wire::MAX_ROOM_WAITING_FOR)
            .filter_map(|(id, since)| Some((url_of(*id)?.to_owned(), waited_ms(*since))))
            .collect(),
        queued_requests: u64::try_from(report.queued_requests)
            .unwrap_or(u64::MAX)
            .min(wire::MAX_ROOM_QUEUED_REQUESTS),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    const W1: WorkerId = WorkerId::new(1, 0);

    fn id_of(url: &str) -> Option<WorkerId> {
        (worker_url_key(url) == "http://w:1").then_some(W1)
    }

    fn url_of(id: WorkerId) -> Option<&'static str> {
        (id == W1).then_some("http://w:1")
    }

    fn rooms(ttl_ms: u64) -> PeerRooms {
        let config = SyncConfig {
            entry_ttl_ms: ttl_ms,
            ..SyncConfig::default()
        };
        PeerRooms::new(&config)
    }

    #[test]
    fn a_peer_s_room_is_read_on_this_router_s_clock_and_ids() {
        let now = Instant::now() + Duration::from_secs(10);
        let peer_rooms = rooms(1000);
        assert_eq!(peer_rooms.combined(), None, "no peer heard yet");
        let room = wire::Room {
            oldest_wait_ms: Some(1500),
            prefill_busy_workers: 2.5,
            waiting_for: vec![
                ("http://w:1/".to_owned(), 200),
                ("http://elsewhere:1".to_owned(), 100),
            ],
            queued_requests: 40,
        };
        peer_rooms.heard("b", Some(&room), id_of, now);
        // A replica without admission is heard, with an empty room.
        peer_rooms.heard("c", None, id_of, now);
        let combined = peer_rooms.combined().unwrap();
        assert_eq!(
            combined.oldest_arrived,
            Some(now - Duration::from_millis(1500))
        );
        assert_eq!(combined.prefill_busy_workers, 2.5);
        assert_eq!(combined.queued_requests, 40);
        // The worker this router does not have is left out.
        assert_eq!(
            combined.waiting_for,
            BTreeMap::from([(W1, now - Duration::from_millis(200))])
        );
        // Its next message replaces its room.
        peer_rooms.heard("b", Some(&wire::Room::default()), id_of, now);
        assert_eq!(peer_rooms.combined().unwrap(), RoomReport::default());
        // Silent past the TTL, both are forgotten.
        peer_rooms.sweep(now + Duration::from_millis(999));
        assert!(peer_rooms.combined().is_some());
        peer_rooms.sweep(now + Duration::from_millis(1001));
        assert_eq!(peer_rooms.combined(), None);
    }

    #[test]
    fn this_replica_s_room_goes_out_as_waits_and_urls() {
        let now = Instant::now() + Duration::from_secs(10);
        let report = RoomReport {
            oldest_arrived: Some(now - Duration::from_millis(1520)),
            prefill_busy_workers: 3.0,
            waiting_for: BTreeMap::from([
                (W1, now - Duration::from_millis(240)),
                // A worker removed since: left out.
                (WorkerId::new(2, 0), now),
            ]),
            queued_requests: 9,
        };
        assert_eq!(
            outgoing(&report, url_of, now),
            wire::Room {
                oldest_wait_ms: Some(1520),
                prefill_busy_workers: 3.0,
                waiting_for: vec![("http://w:1".to_owned(), 240)],
                queued_requests: 9,
            }
        );
        assert_eq!(
            outgoing(&RoomReport::default(), url_of, now),
            wire::Room::default()
        );
    }
}
