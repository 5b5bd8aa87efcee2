//! Replica sync: router replicas share their pending token-work per worker
//! through NATS, so that each one counts what the others dispatched
//! (`docs/replicas.md`).
//!
//! Two tasks, both off the request path:
//! - the **publisher** wakes every `sync.publish_interval_ms`, reads this
//!   replica's pending work per worker from the policy
//!   ([`policy_core::Policy::worker_stats`]) and publishes what changed
//!   ([`Publisher`]); every eighth of `sync.entry_ttl_ms` it also drops the
//!   other replicas' entries older than the TTL from the policy. It also
//!   wakes at once when a request is dispatched ([`DispatchSignal`]) and
//!   publishes the workers dispatched to since it last woke: until the
//!   others know of a dispatch, every replica sends to the same momentarily
//!   least-loaded worker (in the simulator, 4 replicas at 100 ms ticks reach
//!   1.34× one router's p99 TTFT without this, 1.02× with it). First tokens
//!   wait for the tick: they only make a worker look busier than it is;
//! - the **receiver** hands every other replica's entries to the policy
//!   ([`policy_core::Policy::replica_pending`]), where selections read them
//!   through atomics.
//!
//! The same messages carry this replica's first tokens
//! ([`policy_core::Policy::first_token`]), at the next tick, each with how
//! long before the message it came: the others apply them as
//! [`policy_core::ReplicaUpdate::Prefill`], and each replica learns a
//! worker's prefill rate from every replica's first tokens on one
//! timeline. An engine computes several replicas' prompts in the same
//! steps; one replica's own first tokens alone make the worker look slower
//! than it is.
//!
//! They also carry this replica's admission room, when admission is on
//! (its oldest wait, the worker its head waits for, the prompt work it
//! sends; [`admission::RoomReport`]), so that the replicas' rooms take
//! turns at the fleet's room: the receiver keeps each replica's latest in
//! [`PeerRooms`], which the admission gate reads, and releases its own
//! room at each message it applies.
//!
//! With `sync.share_prefixes` (the default) replicas also share where they
//! placed prompt prefixes, so that each replica's prefix index knows every
//! replica's dispatches, not only its own ([`prefix`]): the request path
//! queues the policy's [`placement`](policy_core::Policy::placement) of
//! each dispatch beside the dispatch itself, and the prefix-cache bounds
//! learned from engines' reports; the publisher sends them at the same
//! wake, coalesced, on `<prefix>.prefix`; a third task applies the
//! others' ([`policy_core::Policy::replica_update`]). A starting replica
//! warms its index from a running one's snapshot ([`warm`]).
//!
//! The broker is never on the request path: while it is down, slow or
//! unreachable, the replica routes on its own knowledge (the others' entries
//! expire after the TTL), logs the change once, exports it as
//! `router_sync_connected`, and the client reconnects in the background;
//! once back, the replica republishes its whole state.
//!
//! # The interface
//!
//! The rest of the router reaches replica sync through three things only:
//! - [`start`], once, when the router starts: with `[sync]` on, starts the
//!   NATS client and spawns the tasks above (and the prefix index's
//!   warm-up from a peer's snapshot);
//! - [`DispatchSignal`], the one narrow interface of the request path (the
//!   router's state holds one; the proxy calls it):
//!   [`dispatched`](DispatchSignal::dispatched) when a request is sent to
//!   a worker, [`bound_learned`](DispatchSignal::bound_learned) when an
//!   engine's report changes a worker's cache bound, and
//!   [`first_token_had`](DispatchSignal::first_token_had) when a first token
//!   comes. Each queues under a short lock and returns
//!   (nothing at all without `[sync]`); no call waits on the broker;
//! - [`PeerRooms`], which the admission gate reads (lock-free) for the
//!   other replicas' rooms.
//!
//! Everything else here is private to this module: the wire format
//! ([`wire`]), the publisher, the receivers, prefix sharing ([`prefix`])
//! and warm-up. `prefix` and `wire` are visible to the crate only so that
//! the benchmarks' `bench_internals` can name the few items marked `pub`
//! in them.

pub(crate) mod prefix;
mod publisher;
mod rooms;
mod warm;
pub(crate) mod wire;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use parking_lot::Mutex;
use policy_core::{
    Policy, PrefillSample, ReplicaPending, ReplicaPendingOutcome, ReplicaUpdate, RequestInfo,
    WorkerId, tokio_now, worker_url_key,
};
use prometheus_client::metrics::counter::Counter;
use tokio::time::{Instant, MissedTickBehavior};

use crate::app::App;
use crate::config::SyncConfig;
use crate::metrics::Metrics;
use crate::topology;

use publisher::{Publisher, WorkerPending};
pub(crate) use rooms::PeerRooms;

/// How the request path tells the publisher what it did: the workers it
/// dispatched to, the prefixes it placed there and the cache bounds engines'
/// reports taught it, in short lists behind one lock taken only with
/// `[sync]` on, and a wake-up. What comes while the publisher is busy piles
/// up (placements and bounds up to a cap, past which they are counted and
/// dropped) and goes out at its next wake. First tokens wait, under a
/// lock of their own, for the next tick.
#[derive(Debug, Default)]
pub(crate) struct DispatchSignal {
    enabled: bool,
    share_prefixes: bool,
    queued: Mutex<prefix::Queued>,
    first_tokens: Mutex<FirstTokenQueue>,
    wake: tokio::sync::Notify,
}

/// First tokens had since the last tick, with when each came, at most
/// [`wire::MAX_PREFILL_SAMPLES`]; the rest are counted.
#[derive(Debug, Default)]
struct FirstTokenQueue {
    samples: Vec<FirstTokenHad>,
    dropped: u64,
}

/// A first token from `worker` at `at`.
type FirstTokenHad = (WorkerId, PrefillSample, std::time::Instant);

impl DispatchSignal {
    /// A signal that records dispatches only with `[sync]` enabled, and
    /// placements and bounds only with `sync.share_prefixes` too.
    pub(crate) fn new(config: &SyncConfig) -> DispatchSignal {
        DispatchSignal {
            enabled: config.enabled,
            share_prefixes: config.enabled && config.share_prefixes,
            ..DispatchSignal::default()
        }
    }

    /// A request was dispatched to `worker` by `policy`: queues the worker
    /// and, when prefixes are shared and the prompt has hashed blocks, the
    /// policy's placement of them (its one allocation).
    #[inline]
    pub(crate) fn dispatched(&self, worker: WorkerId, policy: &dyn Policy, request: &RequestInfo) {
        if !self.enabled {
            return;
        }
        let placement = if self.share_prefixes && !request.prefix.is_empty() {
            policy.placement(request)
        } else {
            None
        };
        {
            let mut queued = self.queued.lock();
            queued.dispatched.push(worker);
            if let Some(blocks) = placement {
                queued.place(worker, blocks);
            }
        }
        self.wake.notify_one();
    }

    /// An engine's report changed `worker`'s learned cache bound: queued
    /// for the other replicas when prefixes are shared.
    pub(crate) fn bound_learned(&self, worker: WorkerId, cache_tokens: u64) {
        if self.share_prefixes {
            self.queued.lock().bound(worker, cache_tokens);
            self.wake.notify_one();
        }
    }

    /// A first token came from `worker` at `at`: queued for the next tick
    /// with `[sync]` on.
    pub(crate) fn first_token_had(
        &self,
        worker: WorkerId,
        sample: PrefillSample,
        at: std::time::Instant,
    ) {
        if !self.enabled {
            return;
        }
        let mut queue = self.first_tokens.lock();
        if queue.samples.len() < wire::MAX_PREFILL_SAMPLES {
            queue.samples.push((worker, sample, at));
        } else {
            queue.dropped += 1;
        }
    }

    /// The first tokens queued since the last call, into `into` (reused);
    /// returns how many were dropped meanwhile.
    fn take_first_tokens(&self, into: &mut Vec<FirstTokenHad>) -> u64 {
        into.clear();
        let mut queue = self.first_tokens.lock();
        std::mem::swap(&mut queue.samples, into);
        std::mem::take(&mut queue.dropped)
    }

    /// Waits for a dispatch or a bound (at once if one came since the last
    /// call).
    async fn wait(&self) {
        self.wake.notified().await;
    }

    /// What was queued since the last call, into `into` (whose lists are
    /// reused); dispatched workers sorted and deduplicated.
    fn take(&self, into: &mut prefix::Queued) {
        into.clear();
        std::mem::swap(&mut *self.queued.lock(), into);
        into.dispatched.sort_unstable_by_key(|id| id.slot());
        into.dispatched.dedup();
    }
}

/// How long a connection may take before the broker counts as unreachable
/// (and the state change is logged).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// The longest wait between reconnection attempts.
const MAX_RECONNECT_DELAY: Duration = Duration::from_secs(1);
/// How often the client pings the broker: a broker that stops answering
/// (hung, or the network dropped it silently) is dropped once three pings go
/// unanswered (the client's rule), about 6 s. Nothing arrives meanwhile, so
/// the other replicas' entries expire after the TTL and routing goes on with
/// local knowledge.
const PING_INTERVAL: Duration = Duration::from_secs(2);

/// The counters of received messages and entries, resolved once so the
/// receive path hashes no label strings.
#[derive(Debug, Clone)]
struct ReceiveCounters {
    applied: Counter,
    own: Counter,
    malformed: Counter,
    foreign_version: Counter,
    invalid_replica: Counter,
    entries_applied: Counter,
    entries_stale: Counter,
    entries_unknown_worker: Counter,
    entries_unsupported: Counter,
    entries_invalid: Counter,
    /// First tokens by outcome: applied, unknown_worker, unsupported,
    /// invalid.
    prefill_samples: [Counter; 4],
}

impl ReceiveCounters {
    fn new(metrics: &Metrics) -> ReceiveCounters {
        let message = |outcome: &str| metrics.sync_message(outcome);
        let entry = |outcome: &str| metrics.sync_entry(outcome);
        ReceiveCounters {
            applied: message("applied"),
            own: message("own"),
            malformed: message("malformed"),
            foreign_version: message("foreign_version"),
            invalid_replica: message("invalid_replica"),
            entries_applied: entry("applied"),
            entries_stale: entry("stale"),
            entries_unknown_worker: entry("unknown_worker"),
            entries_unsupported: entry("unsupported"),
            entries_invalid: entry("invalid"),
            prefill_samples: prefix::ENTRY_OUTCOMES
                .map(|outcome| Metrics::outcome(&metrics.sync_prefill_samples_received, outcome)),
        }
    }
}

/// What one received message came to.
#[derive(Debug, Clone, PartialEq)]
enum Received {
    /// Not a message of ours: ignored and counted by reason
    /// (`malformed`, `foreign_version`, `invalid_replica`).
    Rejected(&'static str),
    /// Sent under this replica's own id: ignored.
    Own,
    /// Another replica's entries, handed to the policy, the prefill
    /// samples it applied, and its admission room (`None`: it has none, or
    /// sent one that is not the documented shape, counted as an invalid
    /// entry).
    Applied {
        replica: String,
        applied: usize,
        ignored: usize,
        prefill_samples: usize,
        room: Option<wire::Room>,
    },
}

/// Hands one payload from the subject to `policy`: checks it, ignores this
/// replica's own, and applies each valid entry. Everything is counted.
fn receive(
    policy: &dyn Policy,
    own_replica: &str,
    payload: &[u8],
    now: std::time::Instant,
    counters: &ReceiveCounters,
) -> Received {
    let message = match wire::decode(payload) {
        Ok(message) => message,
        Err(error) => {
            let counter = match error {
                wire::WireError::Malformed(_)
                | wire::WireError::Invalid(_)
                | wire::WireError::Oversize(_) => &counters.malformed,
                wire::WireError::Version(_) => &counters.foreign_version,
                wire::WireError::Replica(_) => &counters.invalid_replica,
            };
            counter.inc();
            tracing::debug!(error = %policy_core::error_chain(&error), "sync: message ignored");
            return Received::Rejected(error.outcome());
        }
    };
    if message.replica == own_replica {
        counters.own.inc();
        return Received::Own;
    }
    counters.applied.inc();
    let (mut applied, mut ignored) = (0, 0);
    for entry in message.entries() {
        let Ok(entry) = entry else {
            counters.entries_invalid.inc();
            ignored += 1;
            continue;
        };
        let outcome = policy.replica_pending(
            &ReplicaPending {
                replica: message.replica,
                worker_url: entry.worker_url,
                pending_tokens: entry.pending_tokens,
                pending_requests: entry.pending_requests,
                seq: message.seq,
            },
            now,
        );
        let counter = match outcome {
            ReplicaPendingOutcome::Applied => {
                applied += 1;
                &counters.entries_applied
            }
            ReplicaPendingOutcome::Stale => {
                ignored += 1;
                &counters.entries_stale
            }
            ReplicaPendingOutcome::UnknownWorker => {
                ignored += 1;
                &counters.entries_unknown_worker
            }
            ReplicaPendingOutcome::Unsupported => {
                ignored += 1;
                &counters.entries_unsupported
            }
        };
        counter.inc();
    }
    let mut prefill_samples = 0;
    for entry in message.prefill_samples() {
        let outcome = match entry {
            Ok(entry) => prefix::entry_outcome(policy.replica_update(
                &ReplicaUpdate::Prefill {
                    worker_url: entry.worker_url,
                    sample: entry.sample,
                    // The message's time in flight is not known: it counts
                    // as none.
                    first_token_at: now.checked_sub(entry.ago).unwrap_or(now),
                },
                now,
            )),
            Err(_) => prefix::INVALID,
        };
        counters.prefill_samples[outcome].inc();
        if outcome == 0 {
            prefill_samples += 1;
        }
    }
    let room = match message.room() {
        Some(Ok(room)) => Some(room),
        Some(Err(_)) => {
            counters.entries_invalid.inc();
            ignored += 1;
            None
        }
        None => None,
    };
    Received::Applied {
        replica: message.replica.to_owned(),
        applied,
        ignored,
        prefill_samples,
        room,
    }
}

/// The other replicas heard within the TTL, for the log and the
/// `router_sync_peers` gauge.
#[derive(Debug, Default)]
struct Peers {
    last_heard: HashMap<String, Instant>,
}

impl Peers {
    fn heard(&mut self, replica: &str, now: Instant) {
        match self.last_heard.get_mut(replica) {
            Some(last) => *last = now,
            None => {
                tracing::info!(replica, "sync: replica heard");
                self.last_heard.insert(replica.to_owned(), now);
            }
        }
    }

    fn sweep(&mut self, now: Instant, ttl: Duration) -> usize {
        self.last_heard.retain(|replica, last| {
            let alive = now.saturating_duration_since(*last) <= ttl;
            if !alive {
                tracing::info!(
                    replica = replica.as_str(),
                    entry_ttl_ms = ttl.as_millis() as u64,
                    "sync: replica silent past the TTL; its pending work is no longer counted"
                );
            }
            alive
        });
        self.last_heard.len()
    }
}

/// The broker connection as last logged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Link {
    /// Just started: not logged yet.
    Starting,
    Up,
    Down,
}

/// Starts the sync tasks when `[sync]` is enabled. Never fails and never
/// waits for the broker: the client connects in the background.
pub(crate) async fn start(app: Arc<App>) {
    let config = app.config.sync.clone();
    if !config.enabled {
        return;
    }
    let replica = config.effective_replica_id();
    let options = async_nats::ConnectOptions::new()
        .name(format!("llm-router {replica}"))
        // This replica's own messages are not echoed back to it.
        .no_echo()
        .retry_on_initial_connect()
        .max_reconnects(None)
        .connection_timeout(CONNECT_TIMEOUT)
        .ping_interval(PING_INTERVAL)
        .reconnect_delay_callback(|attempts| {
            let exponent = u32::try_from(attempts.min(10)).unwrap_or(10);
            (Duration::from_millis(50) * 2u32.saturating_pow(exponent)).min(MAX_RECONNECT_DELAY)
        });
    // With retry_on_initial_connect this returns at once: the connection is
    // made (and remade) by the client's own task.
    let client = match options.connect(config.nats_url.as_str()).await {
        Ok(client) => client,
        Err(error) => {
            tracing::error!(nats_url = %config.nats_url, error = %policy_core::error_chain(&error), "sync: cannot start the NATS client; routing on local knowledge only");
            return;
        }
    };
    tracing::info!(nats_url = %config.nats_url, subject = %config.subject(), replica = %replica, "sync: starting");
    let peers = Arc::new(Mutex::new(Peers::default()));
    tokio::spawn(run_receiver(
        app.clone(),
        client.clone(),
        config.clone(),
        replica.clone(),
        peers.clone(),
    ));
    if config.share_prefixes {
        tokio::spawn(run_prefix_receiver(
            app.clone(),
            client.clone(),
            config.clone(),
            replica.clone(),
        ));
        tokio::spawn(warm::run_snapshot_server(
            app.clone(),
            client.clone(),
            config.clone(),
            replica.clone(),
        ));
        tokio::spawn(warm::run_warm_up(
            app.clone(),
            client.clone(),
            config.clone(),
            replica.clone(),
        ));
    }
    tokio::spawn(run_publisher(app, client, config, replica, peers));
}

/// The first sequence number: the start time in microseconds since the Unix
/// epoch, so a restarted replica's messages are newer than its previous
/// life's.
fn first_seq() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(1, |elapsed| {
            u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX / 2)
        })
}

async fn run_publisher(
    app: Arc<App>,
    client: async_nats::Client,
    config: SyncConfig,
    replica: String,
    peers: Arc<Mutex<Peers>>,
) {
    let subject = async_nats::Subject::from(config.subject());
    let prefix_subject = async_nats::Subject::from(config.prefix_subject());
    let ttl = config.entry_ttl();
    let first = first_seq();
    let mut publisher = Publisher::new(replica.clone(), first, config.full_state_interval());
    let mut prefix_seq = first;
    let mut ticker = tokio::time::interval(config.publish_interval());
    ticker.set_missed_tick_behavior(MissedTickBehavior::Skip);
    // A slow broker holds a publish at most this long; the next tick retries
    // with the whole state.
    let publish_deadline = config.publish_interval().max(Duration::from_millis(100));
    let started = Instant::now();
    let mut link = Link::Starting;
    let metrics = &app.metrics;
    let counters = SendCounters::new(metrics);
    // Expiry touches every worker's state, so it runs every eighth of the
    // TTL rather than every tick: an entry goes at most that much late.
    let expiry_interval = (ttl / 8).max(config.publish_interval());
    let mut last_expiry: Option<Instant> = None;
    let mut queued = prefix::Queued::default();
    let mut samples = Vec::new();
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            () = app.sync_signal.wait() => {
                app.sync_signal.take(&mut queued);
                counters.dropped_queue_full.inc_by(queued.dropped_placements);
                let connected =
                    client.connection_state() == async_nats::connection::State::Connected;
                if !connected {
                    // Nothing sent now is certain to arrive; the pending
                    // work goes out whole once the broker is back, but
                    // placements are events and are lost.
                    counters.dropped_unsent.inc_by(queued.placed.len() as u64);
                    continue;
                }
                let policy = app.policy();
                let snapshot = app.topology.snapshot();
                // Placements first, so they reach the broker no later than
                // the pending work of the dispatches that made them.
                publish_prefixes(
                    &client,
                    &prefix_subject,
                    &replica,
                    &mut prefix_seq,
                    &mut queued,
                    &snapshot,
                    publish_deadline,
                    metrics,
                    &counters,
                )
                .await;
                let workers = queued.dispatched.iter().filter_map(|id| {
                    let worker = snapshot.worker(*id)?;
                    let stats = policy.worker_stats(*id).unwrap_or_default();
                    Some(WorkerPending {
                        id: *id,
                        url: &worker.url,
                        tokens: stats.pending_tokens,
                        requests: stats.pending_requests,
                    })
                });
                let room = own_room(&app, &snapshot);
                if let Some(payload) = publisher.dispatched(workers, room.as_ref()) {
                    // A failure is counted, and the next tick sends the
                    // whole state.
                    let _ = send(&client, &subject, payload, publish_deadline, metrics, &counters, &mut publisher).await;
                }
                continue;
            }
        }
        let policy = app.policy();
        if last_expiry.is_none_or(|last| last.elapsed() >= expiry_interval) {
            last_expiry = Some(Instant::now());
            let expired = policy.expire_replica_pending(tokio_now(), ttl);
            if expired > 0 {
                metrics.sync_entries_expired.inc_by(expired as u64);
            }
            let peer_count = peers.lock().sweep(Instant::now(), ttl);
            app.peer_rooms.sweep(tokio_now());
            metrics
                .sync_peers
                .set(i64::try_from(peer_count).unwrap_or(i64::MAX));
        }

        let dropped = app.sync_signal.take_first_tokens(&mut samples);
        counters.prefill_dropped.inc_by(dropped);
        let connected = client.connection_state() == async_nats::connection::State::Connected;
        link = log_link_change(link, connected, started.elapsed(), &config, metrics);
        if !connected {
            // Nothing sent now is certain to arrive: start over with the
            // whole state once the broker is back.
            publisher.force_full_state();
            counters.prefill_dropped.inc_by(samples.len() as u64);
            continue;
        }
        let snapshot = app.topology.snapshot();
        let workers = snapshot.workers().map(|worker| {
            let stats = policy.worker_stats(worker.id).unwrap_or_default();
            WorkerPending {
                id: worker.id,
                url: &worker.url,
                tokens: stats.pending_tokens,
                requests: stats.pending_requests,
            }
        });
        // A removed worker's first tokens go nowhere.
        let written_at = tokio_now();
        let micros = |duration: Duration| u64::try_from(duration.as_micros()).unwrap_or(u64::MAX);
        let prefill: Vec<wire::FirstTokenOut<'_>> = samples
            .iter()
            .filter_map(|(id, sample, at)| {
                let worker = snapshot.worker(*id)?;
                Some((
                    worker_url_key(&worker.url),
                    sample.tokens,
                    sample.foreign_ahead_tokens,
                    micros(sample.waited),
                    micros(written_at.saturating_duration_since(*at)),
                ))
            })
            .collect();
        let room = own_room(&app, &snapshot);
        let Some(payload) = publisher.tick(Instant::now(), workers, &prefill, room.as_ref()) else {
            continue;
        };
        let prefill_sent = prefill.len() as u64;
        if send(
            &client,
            &subject,
            payload,
            publish_deadline,
            metrics,
            &counters,
            &mut publisher,
        )
        .await
        {
            counters.prefill_sent.inc_by(prefill_sent);
        } else {
            counters.prefill_dropped.inc_by(prefill_sent);
        }
    }
}

/// This replica's admission room as its messages carry it; `None` with
/// admission off.
fn own_room(app: &App, snapshot: &topology::Snapshot) -> Option<wire::Room> {
    let now = tokio_now();
    let report = app.admission.report(now)?;
    Some(rooms::outgoing(
        &report,
        |id| rooms::url_of(snapshot, id),
        now,
    ))
}

/// The publisher's counters, resolved once.
#[derive(Debug)]
struct SendCounters {
    pending_bytes: Counter,
    prefix_bytes: Counter,
    placements_sent: Counter,
    bounds_sent: Counter,
    dropped_queue_full: Counter,
    dropped_coalesced: Counter,
    dropped_unsent: Counter,
    prefill_sent: Counter,
    prefill_dropped: Counter,
}

impl SendCounters {
    fn new(metrics: &Metrics) -> SendCounters {
        SendCounters {
            pending_bytes: metrics.bytes_sent("pending"),
            prefix_bytes: metrics.bytes_sent("prefix"),
            placements_sent: metrics.sync_placements_sent.clone(),
            bounds_sent: metrics.sync_bounds_sent.clone(),
            dropped_queue_full: metrics.placements_dropped("queue_full"),
            dropped_coalesced: metrics.placements_dropped("coalesced"),
            dropped_unsent: metrics.placements_dropped("unsent"),
            prefill_sent: metrics.sync_prefill_samples_sent.clone(),
            prefill_dropped: metrics.sync_prefill_samples_dropped.clone(),
        }
    }
}

/// Coalesces the queued placements and bounds and publishes them, in as
/// many messages as they need; a worker removed meanwhile is skipped.
#[allow(clippy::too_many_arguments)]
async fn publish_prefixes(
    client: &async_nats::Client,
    subject: &async_nats::Subject,
    replica: &str,
    seq: &mut u64,
    queued: &mut prefix::Queued,
    snapshot: &crate::topology::Snapshot,
    deadline: Duration,
    metrics: &Metrics,
    counters: &SendCounters,
) {
    if queued.placed.is_empty() && queued.bounds.is_empty() {
        return;
    }
    let coalesced = prefix::coalesce(&mut queued.placed, &mut queued.bounds);
    counters.dropped_coalesced.inc_by(coalesced as u64);
    let url = |id: &WorkerId| Some(worker_url_key(&snapshot.worker(*id)?.url));
    let placements: Vec<wire::Placement<'_>> = queued
        .placed
        .iter()
        .filter_map(|(id, prefix)| {
            Some(wire::Placement {
                worker_url: url(id)?,
                prefix,
            })
        })
        .collect();
    let bounds: Vec<wire::Bound<'_>> = queued
        .bounds
        .iter()
        .filter_map(|(id, cache_tokens)| {
            Some(wire::Bound {
                worker_url: url(id)?,
                cache_tokens: *cache_tokens,
            })
        })
        .collect();
    let encoded = wire::encode_prefix(replica, seq, &placements, &bounds, wire::MAX_MESSAGE_BYTES);
    let mut delivered = true;
    for message in encoded.messages {
        let len = message.len() as u64;
        if publish(client, subject, message, deadline).await {
            counters.prefix_bytes.inc_by(len);
        } else {
            delivered = false;
        }
    }
    if delivered {
        counters.placements_sent.inc_by(encoded.placements as u64);
        counters.bounds_sent.inc_by(encoded.bounds as u64);
    } else {
        metrics.sync_publish_failures.inc();
        counters.dropped_unsent.inc_by(encoded.placements as u64);
    }
}

/// Publishes one payload within `deadline`; false when it failed or timed
/// out.
async fn publish(
    client: &async_nats::Client,
    subject: &async_nats::Subject,
    payload: Vec<u8>,
    deadline: Duration,
) -> bool {
    let sent =
        tokio::time::timeout(deadline, client.publish(subject.clone(), payload.into())).await;
    match sent {
        Ok(Ok(())) => true,
        Ok(Err(error)) => {
            tracing::debug!(error = %policy_core::error_chain(&error), "sync: publish failed");
            false
        }
        Err(_elapsed) => {
            tracing::debug!("sync: publish timed out");
            false
        }
    }
}

/// Publishes one pending-work message; a failure or a timeout makes the
/// next tick's a full state.
async fn send(
    client: &async_nats::Client,
    subject: &async_nats::Subject,
    payload: Vec<u8>,
    deadline: Duration,
    metrics: &Metrics,
    counters: &SendCounters,
    publisher: &mut Publisher,
) -> bool {
    let len = payload.len() as u64;
    if publish(client, subject, payload, deadline).await {
        metrics.sync_published.inc();
        counters.pending_bytes.inc_by(len);
        true
    } else {
        metrics.sync_publish_failures.inc();
        publisher.force_full_state();
        false
    }
}

/// Logs (once per change) and exports the broker connection's state.
fn log_link_change(
    link: Link,
    connected: bool,
    since_start: Duration,
    config: &SyncConfig,
    metrics: &Metrics,
) -> Link {
    metrics.sync_connected.set(i64::from(connected));
    match (link, connected) {
        (Link::Starting | Link::Down, true) => {
            tracing::info!(nats_url = %config.nats_url, "sync: connected to the broker; sharing pending work");
            Link::Up
        }
        (Link::Up, false) => {
            metrics.sync_disconnects.inc();
            tracing::warn!(nats_url = %config.nats_url, "sync: broker connection lost; routing on local knowledge while reconnecting");
            Link::Down
        }
        (Link::Starting, false) if since_start >= CONNECT_TIMEOUT => {
            tracing::warn!(nats_url = %config.nats_url, "sync: broker unreachable; routing on local knowledge while reconnecting");
            Link::Down
        }
        (link, _) => link,
    }
}

async fn run_receiver(
    app: Arc<App>,
    client: async_nats::Client,
    config: SyncConfig,
    replica: String,
    peers: Arc<Mutex<Peers>>,
) {
    let counters = ReceiveCounters::new(&app.metrics);
    let mut warned_duplicate_id = false;
    loop {
        let mut subscriber = match client.subscribe(config.subject()).await {
            Ok(subscriber) => subscriber,
            Err(error) => {
                tracing::warn!(error = %policy_core::error_chain(&error), "sync: cannot subscribe; retrying");
                tokio::time::sleep(MAX_RECONNECT_DELAY).await;
                continue;
            }
        };
        // The client resubscribes by itself after a reconnection; the stream
        // ends only if the client is closed.
        while let Some(message) = subscriber.next().await {
            let policy = app.policy();
            match receive(
                policy.as_ref(),
                &replica,
                &message.payload,
                tokio_now(),
                &counters,
            ) {
                Received::Applied { replica, room, .. } => {
                    peers.lock().heard(&replica, Instant::now());
                    let snapshot = app.topology.load();
                    let id_of = |url: &str| rooms::id_of(&snapshot, url);
                    app.peer_rooms
                        .heard(&replica, room.as_ref(), id_of, tokio_now());
                    // The other replica's work may have freed room, or its
                    // room emptied: this one's waiting requests may go now
                    // (cheap when none waits).
                    app.admission.release(&app);
                }
                // The broker does not echo our own messages: this is another
                // process using the same id, and the two blind each other.
                Received::Own if !warned_duplicate_id => {
                    warned_duplicate_id = true;
                    tracing::warn!(replica = %replica, "sync: another process publishes under this replica's id; set sync.replica_id uniquely");
                }
                Received::Own | Received::Rejected(_) => {}
            }
        }
        tracing::warn!("sync: subscription ended; subscribing again");
        tokio::time::sleep(MAX_RECONNECT_DELAY).await;
    }
}

/// Applies other replicas' placements and learned bounds.
async fn run_prefix_receiver(
    app: Arc<App>,
    client: async_nats::Client,
    config: SyncConfig,
    replica: String,
) {
    let counters = prefix::PrefixCounters::new(&app.metrics);
    loop {
        let mut subscriber = match client.subscribe(config.prefix_subject()).await {
            Ok(subscriber) => subscriber,
            Err(error) => {
                tracing::warn!(error = %policy_core::error_chain(&error), "sync: cannot subscribe to placements; retrying");
                tokio::time::sleep(MAX_RECONNECT_DELAY).await;
                continue;
            }
        };
        while let Some(message) = subscriber.next().await {
            let policy = app.policy();
            let received = prefix::receive_prefix(
                policy.as_ref(),
                &replica,
                &message.payload,
                tokio_now(),
                &counters,
            );
            if let prefix::ReceivedPrefix::Applied { bounds, .. } = received
                && !bounds.is_empty()
            {
                let snapshot = app.topology.snapshot();
                for (url, cache_tokens) in bounds {
                    if let Some(worker) = snapshot
                        .workers()
                        .find(|worker| worker_url_key(&worker.url) == url)
                    {
                        worker
                            .metrics
                            .cache_bound_tokens
                            .set(i64::try_from(cache_tokens).unwrap_or(i64::MAX));
                    }
                }
            }
        }
        tracing::warn!("sync: placement subscription ended; subscribing again");
        tokio::time::sleep(MAX_RECONNECT_DELAY).await;
    }
}

/// What the sync modules' unit tests share.
#[cfg(test)]
mod test_support {
    use policy_core::{Policy, PolicyContext, PolicyRegistry, WorkerId, WorkerInfo};

    use crate::metrics::Metrics;

    /// `least_load` with its defaults over `urls`, in slots 0, 1, …
    pub(super) fn least_load(urls: &[&str]) -> Box<dyn Policy> {
        let mut registry = PolicyRegistry::with_baselines();
        policy_least_load::register(&mut registry);
        let policy = registry
            .build(
                "least_load",
                &serde_json::Value::Null,
                &PolicyContext::default(),
            )
            .unwrap();
        for (slot, url) in urls.iter().enumerate() {
            policy.add_worker(
                WorkerId::new(slot as u32, 0),
                WorkerInfo::new(*url, "sglang"),
            );
        }
        policy
    }

    /// The value of `router_sync_<family>_total{outcome="<outcome>"}`.
    pub(super) fn counted(metrics: &Metrics, family: &str, outcome: &str) -> u64 {
        let series = format!("router_sync_{family}_total{{outcome=\"{outcome}\"}} ");
        metrics
            .render()
            .lines()
            .find_map(|line| line.strip_prefix(series.as_str())?.parse().ok())
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use policy_core::WorkerId;

    fn policy() -> Box<dyn Policy> {
        test_support::least_load(&["http://w:1"])
    }

    use test_support::counted;

    /// Another replica's pending work, received and handed to the policy.
    #[test]
    fn example() {
        let policy = test_support::least_load(&["http://10.0.0.1:30000"]);
        // Replica "b" has 1200 tokens in 3 requests pending on the worker.
        let message = wire::encode(
            "b",
            1,
            true,
            &[("http://10.0.0.1:30000", 1200, 3)],
            &[],
            None,
        );
        let counters = ReceiveCounters::new(&Metrics::new());
        let received = receive(
            policy.as_ref(),
            "a",
            &message,
            std::time::Instant::now(),
            &counters,
        );
        assert_eq!(
            received,
            Received::Applied {
                replica: "b".into(),
                applied: 1,
                ignored: 0,
                prefill_samples: 0,
                room: None,
            }
        );
    }

    #[test]
    fn a_message_s_room_is_received_and_a_bad_one_counted() {
        let metrics = Metrics::new();
        let counters = ReceiveCounters::new(&metrics);
        let policy = policy();
        let now = std::time::Instant::now();
        let room = wire::Room {
            oldest_wait_ms: Some(900),
            prefill_busy_workers: 1.5,
            waiting_for: vec![("http://w:1".to_owned(), 40)],
            queued_requests: 3,
        };
        let message = wire::encode("b", 1, false, &[("http://w:1", 10, 1)], &[], Some(&room));
        let Received::Applied { room: received, .. } =
            receive(policy.as_ref(), "a", &message, now, &counters)
        else {
            panic!("applied");
        };
        assert_eq!(received, Some(room));
        let bad = br#"{"v":1,"replica":"b","seq":2,"full":false,"pending":[["http://w:1",10,1]],
            "room":{"prefill_busy_workers":"many"}}"#;
        assert_eq!(
            receive(policy.as_ref(), "a", bad, now, &counters),
            Received::Applied {
                replica: "b".into(),
                applied: 1,
                ignored: 1,
                prefill_samples: 0,
                room: None,
            }
        );
        assert_eq!(counted(&metrics, "entries", "invalid"), 1);
    }

    #[test]
    fn messages_are_applied_own_ignored_and_junk_counted() {
        let metrics = Metrics::new();
        let counters = ReceiveCounters::new(&metrics);
        let policy = policy();
        let now = std::time::Instant::now();
        // Replica b had a first token from w:1 (12,000 tokens, 1.5 s after
        // their dispatch, just now) and one from a worker this replica
        // lacks.
        let message = wire::encode(
            "b",
            5,
            false,
            &[("http://w:1", 300, 1), ("http://unknown:1", 5, 1)],
            &[
                ("http://w:1", 12_000, 0, 1_500_000, 0),
                ("http://unknown:1", 1, 0, 1, 0),
            ],
            None,
        );
        assert_eq!(
            receive(policy.as_ref(), "a", &message, now, &counters),
            Received::Applied {
                replica: "b".into(),
                applied: 1,
                ignored: 1,
                prefill_samples: 1,
                room: None,
            }
        );
        let table = policy.explain(
            &[WorkerId::new(0, 0)],
            &policy_core::RequestInfo::new(policy_core::TokenCount::Exact(1)),
            now,
        );
        assert_eq!(table.value(WorkerId::new(0, 0), "remote_tok"), Some(300.0));
        // Learned as one of this replica's own first tokens would be: the
        // step's sample closes at the next one, heard a second later.
        assert_eq!(table.value(WorkerId::new(0, 0), "rate_samples"), Some(0.0));
        let later = now + Duration::from_secs(1);
        let next = wire::encode(
            "b",
            6,
            false,
            &[],
            &[("http://w:1", 100, 0, 10_000, 0)],
            None,
        );
        receive(policy.as_ref(), "a", &next, later, &counters);
        let table = policy.explain(
            &[WorkerId::new(0, 0)],
            &policy_core::RequestInfo::new(policy_core::TokenCount::Exact(1)),
            later,
        );
        assert_eq!(table.value(WorkerId::new(0, 0), "rate_samples"), Some(1.0));
        assert_eq!(counted(&metrics, "prefill_samples_received", "applied"), 2);
        assert_eq!(
            counted(&metrics, "prefill_samples_received", "unknown_worker"),
            1
        );
        // The same message again is old news.
        receive(policy.as_ref(), "a", &message, now, &counters);
        assert_eq!(counted(&metrics, "entries", "stale"), 1);
        assert_eq!(
            receive(policy.as_ref(), "b", &message, now, &counters),
            Received::Own
        );
        assert_eq!(
            receive(policy.as_ref(), "a", b"{\"hello\":1}", now, &counters),
            Received::Rejected("malformed")
        );
        let future = br#"{"v":9,"replica":"b","seq":9,"full":true,"pending":[]}"#;
        assert_eq!(
            receive(policy.as_ref(), "a", future, now, &counters),
            Received::Rejected("foreign_version")
        );
        let negative =
            br#"{"v":1,"replica":"b","seq":9,"full":false,"pending":[["http://w:1",-1,1]],
            "first_tokens":[["http://w:1",100,0,-1,0]]}"#;
        receive(policy.as_ref(), "a", negative, now, &counters);
        assert_eq!(counted(&metrics, "prefill_samples_received", "invalid"), 1);
        for (family, outcome, count) in [
            ("messages_received", "applied", 4),
            ("messages_received", "own", 1),
            ("messages_received", "malformed", 1),
            ("messages_received", "foreign_version", 1),
            ("entries", "applied", 1),
            ("entries", "unknown_worker", 2),
            ("entries", "invalid", 1),
        ] {
            assert_eq!(
                counted(&metrics, family, outcome),
                count,
                "{family} {outcome}\n{}",
                metrics.render()
            );
        }
        // Nothing the junk said reached the policy.
        let table = policy.explain(
            &[WorkerId::new(0, 0)],
            &policy_core::RequestInfo::new(policy_core::TokenCount::Exact(1)),
            now,
        );
        assert_eq!(table.value(WorkerId::new(0, 0), "remote_tok"), Some(300.0));
    }

    #[test]
    fn the_signal_queues_only_what_the_config_shares() {
        let policy = policy();
        let worker = WorkerId::new(0, 0);
        let hashes: Vec<u64> = (1..=40u64)
            .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .collect();
        // 40 blocks of 64 tokens: ten 256-token index blocks.
        let request = RequestInfo::new(policy_core::TokenCount::Exact(2600))
            .prefix_blocks(policy_core::PrefixBlocks::new(64, hashes));
        let short = RequestInfo::new(policy_core::TokenCount::Exact(20));
        let mut queued = prefix::Queued::default();
        for (enabled, share_prefixes, dispatched, placed) in
            [(false, true, 0, 0), (true, false, 1, 0), (true, true, 1, 1)]
        {
            let signal = DispatchSignal::new(&SyncConfig {
                enabled,
                share_prefixes,
                ..SyncConfig::default()
            });
            signal.dispatched(worker, policy.as_ref(), &request);
            signal.dispatched(worker, policy.as_ref(), &short);
            signal.bound_learned(worker, 5000);
            signal.take(&mut queued);
            // Two dispatches to one worker are one entry once taken.
            assert_eq!(
                queued.dispatched.len(),
                dispatched,
                "{enabled} {share_prefixes}"
            );
            assert_eq!(queued.placed.len(), placed, "{enabled} {share_prefixes}");
            assert_eq!(queued.bounds.len(), placed, "{enabled} {share_prefixes}");
            if placed > 0 {
                let blocks = &queued.placed[0].1;
                assert_eq!(
                    (blocks.block_tokens(), blocks.hashes().len()),
                    (256, 10),
                    "coarsened to the index's blocks"
                );
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn peers_are_forgotten_after_the_ttl() {
        let mut peers = Peers::default();
        let ttl = Duration::from_millis(1000);
        peers.heard("b", Instant::now());
        tokio::time::advance(Duration::from_millis(600)).await;
        peers.heard("c", Instant::now());
        assert_eq!(peers.sweep(Instant::now(), ttl), 2);
        tokio::time::advance(Duration::from_millis(401)).await;
        assert_eq!(peers.sweep(Instant::now(), ttl), 1);
    }

    #[test]
    fn the_link_state_is_logged_once_per_change() {
        let metrics = Metrics::new();
        let config = SyncConfig::default();
        let grace = CONNECT_TIMEOUT;
        let link = log_link_change(Link::Starting, false, Duration::ZERO, &config, &metrics);
        assert_eq!(
            link,
            Link::Starting,
            "not reported unreachable before the connect timeout"
        );
        let link = log_link_change(link, false, grace, &config, &metrics);
        assert_eq!(link, Link::Down);
        let link = log_link_change(link, true, grace, &config, &metrics);
        assert_eq!(link, Link::Up);
        assert!(metrics.render().contains("router_sync_connected 1"));
        let link = log_link_change(link, false, grace, &config, &metrics);
        assert_eq!(link, Link::Down);
        assert!(metrics.render().contains("router_sync_connected 0"));
        assert!(metrics.render().contains("router_sync_disconnects_total 1"));
        assert_eq!(
            log_link_change(link, false, grace, &config, &metrics),
            Link::Down
        );
        assert!(metrics.render().contains("router_sync_disconnects_total 1"));
    }

    #[test]
    fn sequence_numbers_start_at_the_start_time() {
        // 2020-01-01 in microseconds: any clock this runs on is past it.
        assert!(first_seq() > 1_577_836_800_000_000);
    }
}
