//! Warming a starting replica's prefix index from a running one's.
//!
//! A replica that starts knows no placement, so until its own traffic fills
//! its index it sends every long prompt wherever the load says, away from
//! the engines that hold its prefix. Once connected, it asks on
//! `<prefix>.snapshot` (with a reply subject); every running replica whose
//! policy keeps a non-empty prefix index answers with it, cut into parts
//! each loadable on its own. The asking replica loads the parts of the
//! first replica to answer as they arrive, ignores the others', and stops
//! at the last part or after `sync.snapshot_timeout_ms`, keeping what it
//! loaded. It routes meanwhile: nothing waits for the warm-up. It asks
//! again when the broker comes back after an absence longer than
//! `sync.entry_ttl_ms`, as the placements of that time never reached it.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::{Stream, StreamExt};
use policy_core::{Policy, tokio_now};
use tokio::time::Instant;

use super::wire;
use crate::app::App;
use crate::config::SyncConfig;

/// How a warm-up ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum WarmUpOutcome {
    /// Every part of one replica's snapshot was loaded.
    Complete,
    /// Some parts came, but not the last before the timeout (or some
    /// were lost on the way).
    Partial,
    /// No replica answered in time.
    NoAnswer,
}

impl WarmUpOutcome {
    pub(super) fn label(self) -> &'static str {
        match self {
            WarmUpOutcome::Complete => "complete",
            WarmUpOutcome::Partial => "partial",
            WarmUpOutcome::NoAnswer => "no_answer",
        }
    }
}

/// What one warm-up loaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct WarmUp {
    pub(super) outcome: WarmUpOutcome,
    /// The replica whose snapshot was loaded.
    pub(super) from: Option<String>,
    pub(super) parts: u32,
    /// Blocks the policy stored.
    pub(super) blocks: usize,
    pub(super) bytes: usize,
    /// Parts ignored: malformed, or from a replica that answered later.
    pub(super) ignored: u32,
}

/// Loads the parts arriving on `parts` into the current policy (`policy`
/// is asked for at each part, so a swap meanwhile gets the rest), from the
/// first replica to answer only, until its last part or `deadline`.
pub(super) async fn collect_parts<S, P>(mut parts: S, policy: P, deadline: Instant) -> WarmUp
where
    S: Stream<Item = Bytes> + Unpin,
    P: Fn() -> Arc<dyn Policy>,
{
    let mut warm = WarmUp {
        outcome: WarmUpOutcome::NoAnswer,
        from: None,
        parts: 0,
        blocks: 0,
        bytes: 0,
        ignored: 0,
    };
    let mut next_part = 0;
    let mut gap = false;
    loop {
        let payload = match tokio::time::timeout_at(deadline, parts.next()).await {
            Ok(Some(payload)) => payload,
            Ok(None) | Err(_) => break,
        };
        let part = match wire::decode_snapshot_part(&payload) {
            Ok(part) => part,
            Err(error) => {
                warm.ignored += 1;
                tracing::debug!(error = %policy_core::error_chain(&error), "sync: snapshot part ignored");
                continue;
            }
        };
        match &warm.from {
            None => warm.from = Some(part.replica.to_owned()),
            Some(from) if from != part.replica => {
                warm.ignored += 1;
                continue;
            }
            Some(_) => {}
        }
        gap |= part.part != next_part;
        next_part = part.part.saturating_add(1);
        warm.parts += 1;
        warm.bytes += payload.len();
        warm.blocks += policy().load_prefix_snapshot(&part.snapshot, tokio_now());
        if part.last {
            warm.outcome = if gap {
                WarmUpOutcome::Partial
            } else {
                WarmUpOutcome::Complete
            };
            return warm;
        }
    }
    if warm.from.is_some() {
        warm.outcome = WarmUpOutcome::Partial;
    }
    warm
}

/// Asks for a snapshot and loads the answer, within the timeout.
async fn warm_up_once(
    app: &Arc<App>,
    client: &async_nats::Client,
    config: &SyncConfig,
    replica: &str,
) {
    let started = Instant::now();
    let deadline = started + config.snapshot_timeout();
    let inbox = client.new_inbox();
    let subscriber = match client.subscribe(inbox.clone()).await {
        Ok(subscriber) => subscriber,
        Err(error) => {
            tracing::warn!(error = %policy_core::error_chain(&error), "sync: cannot ask for a prefix snapshot; routing on this replica's own placements");
            return;
        }
    };
    let request = wire::encode_snapshot_request(replica);
    let asked = client
        .publish_with_reply(config.snapshot_subject(), inbox, request.into())
        .await;
    if let Err(error) = asked {
        tracing::warn!(error = %policy_core::error_chain(&error), "sync: cannot ask for a prefix snapshot; routing on this replica's own placements");
        return;
    }
    let payloads = subscriber.map(|message| message.payload);
    let warm = collect_parts(payloads, || app.policy(), deadline).await;
    let elapsed = started.elapsed();
    let metrics = &app.metrics;
    crate::metrics::Metrics::outcome(&metrics.sync_warmups, warm.outcome.label()).inc();
    metrics.sync_warmup_blocks.inc_by(warm.blocks as u64);
    metrics.sync_warmup_bytes.inc_by(warm.bytes as u64);
    metrics.sync_warmup_seconds.set(elapsed.as_secs_f64());
    match warm.outcome {
        WarmUpOutcome::NoAnswer => tracing::info!(
            snapshot_timeout_ms = config.snapshot_timeout_ms,
            "sync: no replica sent a prefix snapshot; the prefix index fills from this replica's traffic and the others' placements"
        ),
        outcome => tracing::info!(
            from = warm.from.as_deref().unwrap_or(""),
            outcome = outcome.label(),
            parts = warm.parts,
            blocks = warm.blocks,
            bytes = warm.bytes,
            ms = elapsed.as_millis() as u64,
            "sync: prefix index warmed from another replica's snapshot"
        ),
    }
}

/// How often the warm-up task looks at the connection.
const LINK_CHECK: Duration = Duration::from_millis(100);

/// Warms the prefix index once connected, and again whenever the broker
/// comes back after an absence longer than `sync.entry_ttl_ms`.
pub(super) async fn run_warm_up(
    app: Arc<App>,
    client: async_nats::Client,
    config: SyncConfig,
    replica: String,
) {
    let rewarm_after = config.entry_ttl();
    // Not connected yet counts as away: the first connection warms.
    let mut away_since: Option<Instant> = Some(Instant::now());
    let mut warmed = false;
    let mut ticker = tokio::time::interval(LINK_CHECK);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let connected = client.connection_state() == async_nats::connection::State::Connected;
        if !connected {
            away_since.get_or_insert_with(Instant::now);
            continue;
        }
        if let Some(since) = away_since.take()
            && (!warmed || since.elapsed() >= rewarm_after)
        {
            warmed = true;
            warm_up_once(&app, &client, &config, &replica).await;
        }
    }
}

/// A snapshot's encoded parts are kept this long for the next request:
/// replicas that start (or come back) together ask at once.
const PARTS_REUSED_FOR: Duration = Duration::from_secs(1);

/// Answers other replicas' snapshot requests, one at a time.
pub(super) async fn run_snapshot_server(
    app: Arc<App>,
    client: async_nats::Client,
    config: SyncConfig,
    replica: String,
) {
    let bytes_sent = app.metrics.bytes_sent("snapshot");
    let mut cached: Option<(Instant, Arc<Vec<Bytes>>)> = None;
    let mut warned_wide = false;
    loop {
        let mut subscriber = match client.subscribe(config.snapshot_subject()).await {
            Ok(subscriber) => subscriber,
            Err(error) => {
                tracing::warn!(error = %policy_core::error_chain(&error), "sync: cannot subscribe to snapshot requests; retrying");
                tokio::time::sleep(super::MAX_RECONNECT_DELAY).await;
                continue;
            }
        };
        while let Some(message) = subscriber.next().await {
            let Some(reply) = message.reply else {
                continue;
            };
            let asker = match wire::decode_snapshot_request(&message.payload) {
                Ok(asker) if asker != replica => asker.to_owned(),
                Ok(_) => continue,
                Err(error) => {
                    tracing::debug!(error = %policy_core::error_chain(&error), "sync: snapshot request ignored");
                    continue;
                }
            };
            let parts = match &cached {
                Some((at, parts)) if at.elapsed() < PARTS_REUSED_FOR => parts.clone(),
                _ => {
                    let policy = app.policy();
                    let replica = replica.clone();
                    // Reading the index and writing the parts take a few
                    // milliseconds per hundred thousand blocks: off the
                    // runtime's threads.
                    let built = tokio::task::spawn_blocking(move || {
                        let snapshot = policy.prefix_snapshot(tokio_now())?;
                        Some(wire::encode_snapshot(
                            &replica,
                            &snapshot,
                            wire::MAX_MESSAGE_BYTES,
                        ))
                    })
                    .await;
                    let parts = match built {
                        Ok(Some(Ok(parts))) => {
                            Arc::new(parts.into_iter().map(Bytes::from).collect::<Vec<_>>())
                        }
                        Ok(Some(Err(too_wide))) => {
                            if !warned_wide {
                                warned_wide = true;
                                tracing::warn!(error = %too_wide, "sync: the prefix snapshot cannot be sent in parts; starting replicas warm from traffic");
                            }
                            continue;
                        }
                        Ok(None) | Err(_) => continue,
                    };
                    cached = Some((Instant::now(), parts.clone()));
                    parts
                }
            };
            if parts.is_empty() {
                continue;
            }
            let mut sent = 0;
            for part in parts.iter() {
                let len = part.len();
                if client.publish(reply.clone(), part.clone()).await.is_err() {
                    break;
                }
                bytes_sent.inc_by(len as u64);
                sent += 1;
            }
            app.metrics.sync_snapshots_served.inc();
            tracing::info!(replica = %asker, parts = sent, "sync: prefix snapshot sent to a starting replica");
        }
        tracing::warn!("sync: snapshot subscription ended; subscribing again");
        tokio::time::sleep(super::MAX_RECONNECT_DELAY).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use policy_core::{
        PolicyContext, PolicyRegistry, PrefixBlocks, PrefixSnapshot, RequestInfo, TokenCount,
        WorkerId, WorkerInfo,
    };

    fn policy() -> Arc<dyn Policy> {
        let mut registry = PolicyRegistry::with_baselines();
        policy_least_load::register(&mut registry);
        let policy: Arc<dyn Policy> = Arc::from(
            registry
                .build(
                    "least_load",
                    &serde_json::Value::Null,
                    &PolicyContext::default(),
                )
                .unwrap(),
        );
        policy.add_worker(WorkerId::new(0, 0), WorkerInfo::new("http://w:1", "sglang"));
        policy.add_worker(WorkerId::new(1, 0), WorkerInfo::new("http://w:2", "sglang"));
        policy
    }

    /// A request of `blocks` 256-token blocks of prompt `seed`.
    fn request(seed: u64, blocks: u64) -> RequestInfo {
        let hashes: Vec<u64> = (1..=blocks)
            .map(|i| seed.wrapping_mul(31).wrapping_add(i * 0x9e37_79b9))
            .collect();
        RequestInfo::new(TokenCount::Exact(blocks * 256 + 100))
            .prefix_blocks(PrefixBlocks::new(256, hashes))
    }

    /// A running replica's index with `prompts` prompts placed, as parts.
    fn parts_of(replica: &str, prompts: u64, max_bytes: usize) -> (Vec<Vec<u8>>, PrefixSnapshot) {
        let running = policy();
        let now = tokio_now();
        for seed in 0..prompts {
            let dispatch = running
                .select(
                    &[WorkerId::new(0, 0), WorkerId::new(1, 0)],
                    &request(seed, 8),
                    now,
                )
                .unwrap();
            running.finish(&dispatch, now);
        }
        let snapshot = running.prefix_snapshot(now).unwrap();
        (
            wire::encode_snapshot(replica, &snapshot, max_bytes).unwrap(),
            snapshot,
        )
    }

    fn cached_anywhere(policy: &dyn Policy, seed: u64) -> f64 {
        let table = policy.explain(
            &[WorkerId::new(0, 0), WorkerId::new(1, 0)],
            &request(seed, 8),
            tokio_now(),
        );
        [WorkerId::new(0, 0), WorkerId::new(1, 0)]
            .iter()
            .map(|id| table.value(*id, "cached_tok").unwrap_or(0.0))
            .sum()
    }

    #[tokio::test(start_paused = true)]
    async fn parts_of_the_first_replica_to_answer_are_loaded_as_they_come() {
        let (parts, snapshot) = parts_of("a", 40, 4 * 1024);
        assert!(parts.len() > 2, "{} parts", parts.len());
        let (others, _) = parts_of("b", 5, 4 * 1024);
        let starting = policy();
        assert_eq!(cached_anywhere(starting.as_ref(), 3), 0.0);
        // a's first part, then b's (ignored), junk, and a's others.
        let mut arriving: Vec<Bytes> = vec![Bytes::from(parts[0].clone())];
        arriving.extend(others.iter().cloned().map(Bytes::from));
        arriving.push(Bytes::from_static(b"junk"));
        arriving.extend(parts[1..].iter().cloned().map(Bytes::from));
        let deadline = Instant::now() + Duration::from_secs(2);
        let loaded = starting.clone();
        let warm = collect_parts(
            futures::stream::iter(arriving),
            move || loaded.clone(),
            deadline,
        )
        .await;
        assert_eq!(warm.outcome, WarmUpOutcome::Complete);
        assert_eq!(warm.from.as_deref(), Some("a"));
        assert_eq!(warm.parts as usize, parts.len());
        assert_eq!(warm.ignored as usize, others.len() + 1);
        assert_eq!(warm.blocks, snapshot.blocks.len());
        assert_eq!(warm.bytes, parts.iter().map(Vec::len).sum::<usize>());
        for seed in 0..40 {
            assert_eq!(
                cached_anywhere(starting.as_ref(), seed),
                2048.0,
                "prompt {seed}"
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_warm_up_gives_up_at_its_deadline_keeping_what_came() {
        let (parts, _) = parts_of("a", 40, 4 * 1024);
        let starting = policy();
        // The first part comes, the rest never does.
        let first = futures::stream::iter([Bytes::from(parts[0].clone())]);
        let stream = first.chain(futures::stream::pending());
        let started = Instant::now();
        let deadline = started + Duration::from_millis(2000);
        let loaded = starting.clone();
        let warm = collect_parts(stream, move || loaded.clone(), deadline).await;
        assert_eq!(warm.outcome, WarmUpOutcome::Partial);
        assert_eq!(warm.parts, 1);
        assert!(warm.blocks > 0);
        assert!(Instant::now() >= deadline, "it waited for the deadline");
        // Nobody answers at all.
        let loaded = starting.clone();
        let warm = collect_parts(
            futures::stream::pending(),
            move || loaded.clone(),
            Instant::now() + Duration::from_millis(500),
        )
        .await;
        assert_eq!(warm.outcome, WarmUpOutcome::NoAnswer);
        assert_eq!((warm.parts, warm.blocks), (0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn a_lost_part_makes_the_warm_up_partial() {
        let (parts, _) = parts_of("a", 40, 4 * 1024);
        let starting = policy();
        let arriving: Vec<Bytes> = parts
            .iter()
            .enumerate()
            .filter(|(index, _)| *index != 1)
            .map(|(_, part)| Bytes::from(part.clone()))
            .collect();
        let loaded = starting.clone();
        let warm = collect_parts(
            futures::stream::iter(arriving),
            move || loaded.clone(),
            Instant::now() + Duration::from_secs(2),
        )
        .await;
        assert_eq!(warm.outcome, WarmUpOutcome::Partial);
        assert_eq!(warm.parts as usize, parts.len() - 1);
    }
}
