//! Hedging a stream whose response head or first event is overdue
//! (`[hedging]`): the request also goes to a second worker, the first of
//! the two to send an event answers the client, and the other is closed.
//!
//! The first attempt, when it loses, is not closed at once: it runs on,
//! detached, until its own first event or first-byte deadline, so that the
//! worker is charged the failure (or credited the success) it earned.
//! Without that, a worker that accepts work and never starts it would lose
//! every race without a failure on record, and never be ejected.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use policy_core::WorkerId;
use tokio::time::Instant;

use super::{Answer, Attempt, Chosen, ClientRequest, RequestTracker, attempt_on, choose, selected};
use crate::app::App;
use crate::metrics::OutcomeLabel;

/// Budget in thousandths of a hedge: a hedge costs one whole.
const HEDGE_MILLIS: u64 = 1_000;
/// The budget's burst: at most this many hedges in a row.
const BURST_MILLIS: u64 = 10 * HEDGE_MILLIS;

/// Caps hedges at `[hedging] max_percent` of requests: each request that
/// could be hedged adds that fraction of a hedge, up to a burst of 10; each
/// hedge spends one. A fleet that is slow everywhere thus cannot double
/// its own load.
#[derive(Debug)]
pub(crate) struct HedgeBudget {
    millis: AtomicU64,
    deposit_millis: u64,
}

impl HedgeBudget {
    /// A full budget for `max_percent` hedges per 100 requests.
    pub(crate) fn new(max_percent: f64) -> HedgeBudget {
        // max_percent is validated to 0..=100: the deposit is 0..=1000.
        let deposit_millis = (max_percent.clamp(0.0, 100.0) * 10.0).round() as u64;
        HedgeBudget {
            millis: AtomicU64::new(if deposit_millis > 0 { BURST_MILLIS } else { 0 }),
            deposit_millis,
        }
    }

    /// A request that may be hedged arrived.
    fn deposit(&self) {
        // Not exact at the cap (two deposits may both pass the check): the
        // burst may exceed 10 by a fraction of a hedge.
        if self.deposit_millis > 0 && self.millis.load(Ordering::Relaxed) < BURST_MILLIS {
            self.millis
                .fetch_add(self.deposit_millis, Ordering::Relaxed);
        }
    }

    /// Spends one hedge, if the budget holds one.
    fn spend(&self) -> bool {
        self.millis
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |millis| {
                millis.checked_sub(HEDGE_MILLIS)
            })
            .is_ok()
    }
}

/// When an attempt is hedged if it is still without an answer.
#[derive(Debug, Clone, Copy)]
pub(super) struct HedgeAt {
    /// Without a response head by then. A streaming engine sends its head
    /// when it admits the request, whatever the prompt's length, so a
    /// missing head is a sign of trouble as soon as `[hedging] after_ms`
    /// has passed.
    no_head: Instant,
    /// With a head but no first event by then: the prefill may be long,
    /// so not before `predicted_wait_multiple` × the policy's predicted
    /// wait either. `None`: at or past the first-byte deadline, where the
    /// attempt is retried anyway.
    no_event: Option<Instant>,
}

/// When the attempt that `tracker` starts at `now` is hedged. `None`: it is
/// not (hedging off, a non-streaming answer, or the hedge delay at or past
/// the first-byte deadline).
pub(super) fn hedge_at(
    app: &App,
    request: &ClientRequest,
    tracker: &RequestTracker,
    now: Instant,
) -> Option<HedgeAt> {
    let hedging = &app.config.hedging;
    let after = hedging.after()?;
    if !request.upstream_streaming {
        return None;
    }
    app.hedge_budget.deposit();
    let first_byte_by = now
        .checked_add(request.head_timeout)
        .map_or(request.deadline, |by| by.min(request.deadline));
    let no_head = now.checked_add(after).filter(|at| *at < first_byte_by)?;
    let predicted_secs = if tracker.route.policy.score_is_wait_secs() {
        tracker.dispatch.score * hedging.predicted_wait_multiple
    } else {
        0.0
    };
    let predicted = Duration::try_from_secs_f64(predicted_secs).unwrap_or(Duration::MAX);
    let no_event = now
        .checked_add(after.max(predicted))
        .filter(|at| *at < first_byte_by);
    Some(HedgeAt { no_head, no_event })
}

fn count(app: &App, outcome: &str) {
    app.metrics
        .hedges
        .get_or_create(&OutcomeLabel {
            outcome: outcome.to_owned(),
        })
        .inc();
}

/// The hedge an attempt may get.
pub(super) struct Hedge<'a> {
    pub(super) at: HedgeAt,
    /// The attempt's number, for its trace.
    pub(super) attempt: u32,
    /// Set when the hedge is sent.
    pub(super) sent: &'a mut bool,
}

/// [`attempt_on`] with `hedge`. A hedge's worker that fails before its
/// first event is added to `tried`, as the caller does with the first
/// worker when the whole attempt is retried.
pub(super) async fn hedged_attempt(
    app: &Arc<App>,
    tracker: RequestTracker,
    request: &Arc<ClientRequest>,
    now: Instant,
    hedge: Hedge<'_>,
    tried: &mut Vec<WorkerId>,
) -> Attempt {
    let Hedge {
        at: hedge_at,
        attempt,
        sent,
    } = hedge;
    let first_worker = tracker.worker().id;
    let head_seen = Arc::new(AtomicBool::new(false));
    // Owned, so that it can run on detached when the hedge wins.
    let mut first = Box::pin({
        let (app, request, head_seen) = (app.clone(), request.clone(), head_seen.clone());
        async move { attempt_on(&app, tracker, &request, now, Some(head_seen)).await }
    });
    if let Ok(outcome) = tokio::time::timeout_at(hedge_at.no_head, &mut first).await {
        return outcome;
    }
    if head_seen.load(Ordering::Relaxed) {
        let Some(no_event) = hedge_at.no_event else {
            return first.await;
        };
        if let Ok(outcome) = tokio::time::timeout_at(no_event, &mut first).await {
            return outcome;
        }
    }
    // A hedge would jump the admission queue, where requests wait for
    // exactly the capacity it takes.
    if app.admission.is_waiting() || !app.hedge_budget.spend() {
        count(app, "skipped");
        return first.await;
    }
    let hedge_now = Instant::now();
    let mut excluded = tried.clone();
    excluded.push(first_worker);
    let mut tracker = match choose(
        app,
        &request.info,
        request.received_at,
        &excluded,
        hedge_now,
    ) {
        Chosen::Worker(tracker) if tracker.worker().pool.is_usable() => tracker,
        _ => {
            count(app, "skipped");
            return first.await;
        }
    };
    *sent = true;
    if let Some(trace) = &request.trace {
        trace.hedge(attempt, hedge_now.saturating_duration_since(now));
    }
    selected(request, &mut tracker, attempt);
    let second_worker = tracker.worker().id;
    let second = attempt_on(app, tracker, request, hedge_now, None);
    let mut second = std::pin::pin!(second);
    // Each attempt's failure, once it failed before an event: its answer
    // (a 503 or 429 to pass on if no worker takes the request) and reason.
    let mut first_failed: Option<(Option<Answer>, String)> = None;
    let mut second_failed: Option<(Option<Answer>, String)> = None;
    while first_failed.is_none() || second_failed.is_none() {
        tokio::select! {
            outcome = &mut first, if first_failed.is_none() => match outcome {
                Attempt::Done(answer) => {
                    // The hedge is dropped with this function: closed.
                    count(app, "lost");
                    return Attempt::Done(answer);
                }
                Attempt::Retry { answer, reason } => first_failed = Some((answer, reason)),
            },
            outcome = &mut second, if second_failed.is_none() => match outcome {
                Attempt::Done(answer) => {
                    count(app, "won");
                    if first_failed.is_none() {
                        // Its answer, if one comes, is dropped: closed.
                        tokio::spawn(first);
                    }
                    return Attempt::Done(answer);
                }
                Attempt::Retry { answer, reason } => {
                    tried.push(second_worker);
                    second_failed = Some((answer, reason));
                }
            },
        }
    }
    count(app, "failed");
    let (first_answer, _) = first_failed.unwrap_or_default();
    let (second_answer, reason) = second_failed.unwrap_or_default();
    // The caller adds the first worker to `tried`.
    Attempt::Retry {
        answer: second_answer.or(first_answer),
        reason,
    }
}

#[cfg(test)]
mod tests {
    use super::HedgeBudget;

    #[test]
    fn the_budget_holds_a_burst_of_ten_then_refills_by_the_percentage() {
        let budget = HedgeBudget::new(10.0);
        assert!((0..10).all(|_| budget.spend()), "a burst of 10");
        assert!(!budget.spend(), "then none");
        for _ in 0..9 {
            budget.deposit();
        }
        assert!(!budget.spend(), "9 requests at 10 % are not a hedge yet");
        budget.deposit();
        assert!(budget.spend(), "10 requests are");
        assert!(!budget.spend());
    }

    #[test]
    fn the_budget_stops_at_its_burst() {
        let budget = HedgeBudget::new(100.0);
        for _ in 0..1000 {
            budget.deposit();
        }
        assert_eq!((0..1000).filter(|_| budget.spend()).count(), 10);
    }

    #[test]
    fn a_zero_percent_budget_never_hedges() {
        let budget = HedgeBudget::new(0.0);
        for _ in 0..1000 {
            budget.deposit();
        }
        assert!(!budget.spend());
    }
}
