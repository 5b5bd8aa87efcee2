//! Background tasks: the load monitor, the health checker and the prober of
//! ejected workers.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;
use policy_core::{PollOutcome, error_chain, poll_worker, tokio_now};
use tokio::time::MissedTickBehavior;

use crate::app::App;
use crate::workers::Worker;

/// Polls every worker's load source once each interval, concurrently, under
/// the configured deadline, and feeds the results to the active policy.
///
/// Each worker's poll is sent at its own phase of the interval (see
/// `poll_phase`) rather than all at the tick: at 4096 workers one burst
/// of polls cost 14.6 % of a core in a single spike and held requests up.
pub(crate) async fn run_load_monitor(app: Arc<App>) {
    let interval = app.config.load_monitor.interval();
    let timeout = app.config.load_monitor.timeout();
    run_spread_rounds(
        interval,
        timeout,
        || {
            let mut workers = app.workers();
            workers.retain(|worker| !worker.is_draining());
            workers
        },
        |worker: &Arc<Worker>| worker.id.slot(),
        |worker| {
            let app = app.clone();
            async move { poll_one(&app, &worker).await }
        },
    )
    .await;
}

/// How many instants of an interval the polls go out at. Polls sent
/// together share the runtime's wake-ups and `epoll` returns, so a poll
/// in a burst costs about half one sent alone (1024 workers polled each
/// at its own instant cost 7 % of a core); a burst of a sixteenth of the
/// fleet is still small enough not to hold requests up.
const POLL_BURSTS: u32 = 16;

/// Where in the interval the worker in `slot` is polled: `slot × φ` modulo
/// 1 (φ the golden ratio), rounded down to one of [`POLL_BURSTS`] instants,
/// so any number of workers is spread evenly over the interval, and a
/// worker keeps its phase when others join or leave. The phases cover the
/// interval less the poll timeout, so every poll of a round ends before
/// the next round starts: each worker is still polled once per interval,
/// and polls of one worker do not overlap. With a timeout of a whole
/// interval or more, every poll goes at the tick.
pub(crate) fn poll_phase(slot: usize, interval: Duration, timeout: Duration) -> Duration {
    const GOLDEN_FRACTION: f64 = 0.618_033_988_749_894_9;
    let spread = interval.saturating_sub(timeout);
    let fraction = (slot as f64 * GOLDEN_FRACTION).fract();
    let burst = (fraction * f64::from(POLL_BURSTS)).floor();
    spread.mul_f64(burst / f64::from(POLL_BURSTS))
}

/// Runs a round every `interval`: each item of `items()` is polled once, at
/// the tick plus its [`poll_phase`], and the round ends when every poll has.
async fn run_spread_rounds<T, F>(
    interval: Duration,
    timeout: Duration,
    items: impl Fn() -> Vec<T>,
    slot_of: impl Fn(&T) -> usize,
    poll: impl Fn(T) -> F,
) where
    F: Future<Output = ()>,
{
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        let round_start = ticker.tick().await;
        join_all(items().into_iter().map(|item| {
            let at = round_start + poll_phase(slot_of(&item), interval, timeout);
            let poll = poll(item);
            async move {
                tokio::time::sleep_until(at).await;
                poll.await;
            }
        }))
        .await;
    }
}

async fn poll_one(app: &Arc<App>, worker: &Arc<Worker>) {
    // The policy is taken once, so the poll starts and completes on the same one.
    let policy = app.policy();
    let started = Instant::now();
    let outcome = poll_worker(
        policy.as_ref(),
        worker.source.as_ref(),
        worker.id,
        app.config.load_monitor.timeout(),
        tokio_now,
    )
    .await;
    worker
        .metrics
        .poll_duration
        .observe(started.elapsed().as_secs_f64());
    match outcome {
        PollOutcome::Report(load) => recovered(worker, Some(load)),
        PollOutcome::NoReport => recovered(worker, None),
        PollOutcome::Failed(error) => {
            // Logged once per state change, not on every poll.
            if worker.poll_failed() == 1 {
                tracing::warn!(worker = %worker.url, error = %error_chain(&error), "load poll failing");
            }
        }
    }
    // A fresh report may show room for requests waiting in the router.
    app.admission.release(app);
}

fn recovered(worker: &Worker, load: Option<load_protocols::WorkerLoad>) {
    if worker.poll_succeeded(load) {
        tracing::info!(worker = %worker.url, "load poll recovered");
    }
}

/// Checks every worker's `/health` each interval.
pub(crate) async fn run_health_checker(app: Arc<App>) {
    let mut ticker = tokio::time::interval(std::time::Duration::from_millis(
        app.config.health.interval_ms,
    ));
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let workers = app.workers();
        join_all(
            workers
                .iter()
                .filter(|worker| !worker.is_draining())
                .map(|worker| app.check_health(worker)),
        )
        .await;
    }
}

/// Starts a probe of every ejected worker whose ejection time is over. Each
/// probe runs on its own task, so a hung worker's probe holds up no other.
pub(crate) async fn run_outlier_prober(app: Arc<App>) {
    // A quarter of the base ejection, so a worker is probed soon after its
    // time is up; within [50 ms, 1 s].
    let tick = (app.config.outlier_detection.base_ejection() / 4).clamp(
        std::time::Duration::from_millis(50),
        std::time::Duration::from_secs(1),
    );
    let mut ticker = tokio::time::interval(tick);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let now = tokio::time::Instant::now();
        for worker in app.topology.load().workers() {
            if worker.is_ejected()
                && !worker.is_draining()
                && worker.with_outlier(|state| state.start_probe(now))
            {
                let app = app.clone();
                let worker = worker.clone();
                tokio::spawn(async move { app.probe_ejected(&worker).await });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    #[test]
    fn phases_stay_inside_the_interval_less_the_timeout_and_spread() {
        let interval = Duration::from_millis(1000);
        let timeout = Duration::from_millis(500);
        let phases: Vec<Duration> = (0..4096)
            .map(|slot| poll_phase(slot, interval, timeout))
            .collect();
        assert!(
            phases
                .iter()
                .all(|phase| *phase < Duration::from_millis(500))
        );
        // POLL_BURSTS instants, each holding about as many workers.
        let mut bursts = phases.clone();
        bursts.sort();
        bursts.dedup();
        assert_eq!(bursts.len(), POLL_BURSTS as usize, "{bursts:?}");
        for burst in &bursts {
            let inside = phases.iter().filter(|phase| *phase == burst).count();
            assert!((230..=282).contains(&inside), "{burst:?}: {inside}");
        }
        // A timeout of the whole interval or more polls at the tick.
        assert_eq!(poll_phase(7, interval, interval), Duration::ZERO);
        assert_eq!(poll_phase(7, interval, interval * 2), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn each_worker_is_polled_once_per_interval_at_its_own_phase() {
        let interval = Duration::from_millis(1000);
        let timeout = Duration::from_millis(500);
        let start = tokio::time::Instant::now();
        let polls: Arc<Mutex<Vec<(usize, Duration)>>> = Arc::default();
        let slots: Vec<usize> = (0..16).collect();
        let rounds = run_spread_rounds(
            interval,
            timeout,
            || slots.clone(),
            |slot| *slot,
            |slot| {
                let polls = polls.clone();
                async move {
                    let at = tokio::time::Instant::now() - start;
                    polls.lock().unwrap().push((slot, at));
                    // A poll that takes as long as its deadline allows.
                    tokio::time::sleep(timeout).await;
                }
            },
        );
        // Three whole intervals (the rounds never end by themselves).
        let _ = tokio::time::timeout(interval * 3 - Duration::from_millis(1), rounds).await;
        let polls = polls.lock().unwrap().clone();
        for round in 0..3u32 {
            let (from, to) = (interval * round, interval * (round + 1));
            let mut polled: Vec<(usize, Duration)> = polls
                .iter()
                .copied()
                .filter(|(_, at)| (from..to).contains(at))
                .collect();
            polled.sort();
            let polled_slots: Vec<usize> = polled.iter().map(|(slot, _)| *slot).collect();
            assert_eq!(polled_slots, slots, "round {round}: {polled:?}");
            // Each at its own phase, on time; not all at the same instant.
            // (tokio's timer fires on the millisecond at or after the phase.)
            for (slot, at) in &polled {
                let phase = poll_phase(*slot, interval, timeout);
                let late = (*at - from).checked_sub(phase);
                assert!(
                    late.is_some_and(|late| late < Duration::from_millis(1)),
                    "{slot}: {at:?} for {phase:?}"
                );
            }
            let mut instants: Vec<Duration> = polled.iter().map(|(_, at)| *at).collect();
            instants.sort();
            instants.dedup();
            let mut phases: Vec<Duration> = slots
                .iter()
                .map(|slot| poll_phase(*slot, interval, timeout))
                .collect();
            phases.sort();
            phases.dedup();
            assert!(phases.len() > 1, "{phases:?}");
            assert_eq!(instants.len(), phases.len(), "{polled:?}");
        }
        assert_eq!(polls.len(), 3 * slots.len());
    }
}
