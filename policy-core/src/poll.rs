//! The poll sequence every load monitor runs, shared so the router and tests
//! drive policies the same way.

use std::time::{Duration, Instant};

use load_protocols::WorkerLoad;

use crate::{Clock, LoadError, LoadSource, Policy, WorkerId};

/// What one poll produced; the policy has already been told.
#[derive(Debug)]
pub enum PollOutcome {
    Report(WorkerLoad),
    NoReport,
    Failed(LoadError),
}

/// Polls one worker: `poll_started`, then the fetch under `deadline`, then
/// `poll_completed` or `poll_failed`. A report is stamped with the time it
/// was received.
pub async fn poll_worker(
    policy: &dyn Policy,
    source: &dyn LoadSource,
    id: WorkerId,
    deadline: Duration,
    clock: Clock,
) -> PollOutcome {
    let mark = policy.poll_started(id, clock());
    let result = tokio::time::timeout(deadline, source.fetch()).await;
    let now = clock();
    match result {
        Ok(Ok(Some(load))) => {
            let load = load.observed_at(now);
            policy.poll_completed(mark, Some(&load), now);
            PollOutcome::Report(load)
        }
        Ok(Ok(None)) => {
            policy.poll_completed(mark, None, now);
            PollOutcome::NoReport
        }
        Ok(Err(error)) => {
            policy.poll_failed(mark, now);
            PollOutcome::Failed(error)
        }
        Err(_elapsed) => {
            policy.poll_failed(mark, now);
            PollOutcome::Failed(LoadError::Timeout {
                url: source.load_url().to_owned(),
                deadline,
            })
        }
    }
}

/// Gives a newly built policy a worker's latest report, as if it had polled it
/// when the report was observed, so a swapped-in policy starts informed and
/// still ages the report correctly.
pub fn prime_worker(policy: &dyn Policy, id: WorkerId, load: &WorkerLoad, now: Instant) {
    let observed = load.observed().unwrap_or(now);
    let mark = policy.poll_started(id, observed);
    policy.poll_completed(mark, Some(load), observed);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{MockLoadSource, MockPolicy, PollMark};
    use load_protocols::SchedulerLoadSnapshot;
    use mockall::predicate::always;

    fn mark(id: WorkerId, now: Instant) -> PollMark {
        PollMark::nothing_pending(id, now)
    }

    fn source(result: fn() -> Result<Option<WorkerLoad>, LoadError>) -> MockLoadSource {
        let mut source = MockLoadSource::new();
        source.expect_fetch().times(1).returning(result);
        source
            .expect_load_url()
            .return_const("http://w:1".to_owned());
        source.expect_kind().return_const("mock");
        source
    }

    #[tokio::test(start_paused = true)]
    async fn a_report_completes_the_poll() {
        let id = WorkerId::new(0, 0);
        let mut policy = MockPolicy::new();
        policy.expect_poll_started().times(1).returning(mark);
        policy
            .expect_poll_completed()
            .withf(|_, load, _| load.is_some_and(|load| load.waiting_requests() == 4))
            .times(1)
            .return_const(());
        policy.expect_poll_failed().never();
        let source = source(|| {
            let rank = SchedulerLoadSnapshot {
                num_waiting_reqs: 4,
                ..SchedulerLoadSnapshot::default()
            };
            Ok(Some(WorkerLoad::from_ranks(vec![rank]).unwrap()))
        });
        let outcome = poll_worker(
            &policy,
            &source,
            id,
            Duration::from_millis(500),
            crate::tokio_now,
        )
        .await;
        let PollOutcome::Report(load) = outcome else {
            panic!("expected a report, got {outcome:?}");
        };
        assert!(load.observed().is_some(), "the report is stamped");
    }

    #[tokio::test(start_paused = true)]
    async fn no_report_completes_without_a_load() {
        let mut policy = MockPolicy::new();
        policy.expect_poll_started().returning(mark);
        policy
            .expect_poll_completed()
            .withf(|_, load, _| load.is_none())
            .times(1)
            .return_const(());
        let source = source(|| Ok(None));
        let outcome = poll_worker(
            &policy,
            &source,
            WorkerId::new(1, 0),
            Duration::from_millis(500),
            crate::tokio_now,
        )
        .await;
        assert!(matches!(outcome, PollOutcome::NoReport));
    }

    #[tokio::test(start_paused = true)]
    async fn an_error_fails_the_poll() {
        let mut policy = MockPolicy::new();
        policy.expect_poll_started().returning(mark);
        policy.expect_poll_completed().never();
        policy
            .expect_poll_failed()
            .with(always(), always())
            .times(1)
            .return_const(());
        let source = source(|| {
            Err(LoadError::HttpStatus {
                url: "http://w:1".into(),
                status: 500,
            })
        });
        let outcome = poll_worker(
            &policy,
            &source,
            WorkerId::new(0, 0),
            Duration::from_millis(500),
            crate::tokio_now,
        )
        .await;
        assert!(matches!(
            outcome,
            PollOutcome::Failed(LoadError::HttpStatus { status: 500, .. })
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_hung_source_times_out_at_the_deadline() {
        let mut policy = MockPolicy::new();
        policy.expect_poll_started().returning(mark);
        policy.expect_poll_failed().times(1).return_const(());
        // A worker that accepts and never answers.
        let hung = HungSource;
        let outcome = poll_worker(
            &policy,
            &hung,
            WorkerId::new(0, 0),
            Duration::from_millis(250),
            crate::tokio_now,
        )
        .await;
        match outcome {
            PollOutcome::Failed(LoadError::Timeout { deadline, .. }) => {
                assert_eq!(deadline, Duration::from_millis(250));
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
    }

    struct HungSource;

    #[async_trait::async_trait]
    impl LoadSource for HungSource {
        async fn fetch(&self) -> Result<Option<WorkerLoad>, LoadError> {
            std::future::pending().await
        }
        fn kind(&self) -> &'static str {
            "hung"
        }
        fn load_url(&self) -> &str {
            "http://w:1"
        }
    }
}
