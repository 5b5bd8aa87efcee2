//! Background tasks: the load monitor, the health checker and the prober of
//! ejected workers.

use std::sync::Arc;
use std::time::Instant;

use futures::future::join_all;
use policy_core::{PollOutcome, error_chain, poll_worker, tokio_now};
use tokio::time::MissedTickBehavior;

use crate::app::App;
use crate::workers::Worker;

/// Polls every worker's load source each interval, concurrently, under the
/// configured deadline, and feeds the results to the active policy.
pub async fn run_load_monitor(app: Arc<App>) {
    let mut ticker = tokio::time::interval(app.config.load_monitor.interval());
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let workers = app.workers();
        join_all(
            workers
                .iter()
                .filter(|worker| !worker.is_draining())
                .map(|worker| poll_one(&app, worker)),
        )
        .await;
    }
}

async fn poll_one(app: &App, worker: &Arc<Worker>) {
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
}

fn recovered(worker: &Worker, load: Option<load_protocols::WorkerLoad>) {
    if worker.poll_succeeded(load) {
        tracing::info!(worker = %worker.url, "load poll recovered");
    }
}

/// Checks every worker's `/health` each interval.
pub async fn run_health_checker(app: Arc<App>) {
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
pub async fn run_outlier_prober(app: Arc<App>) {
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
