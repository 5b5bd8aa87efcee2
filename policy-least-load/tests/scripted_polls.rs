//! `least_load` driven by the shared poll sequence (`policy_core::poll_worker`)
//! over a scripted `MockLoadSource`: a report, a failure, no report, a report,
//! a timeout, then silence until the last report goes stale. The score table
//! follows each step.

// Helpers outside #[test] functions may unwrap too: a panic is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use async_trait::async_trait;
use load_protocols::{SchedulerLoadSnapshot, WorkerLoad};
use policy_core::{
    LoadError, LoadSource, MockLoadSource, Policy, PollOutcome, RequestInfo, TokenCount, WorkerId,
    WorkerInfo, poll_worker, tokio_now,
};
use policy_least_load::{LeastLoad, LeastLoadParams, RateMode, Strategy};

const DEADLINE: Duration = Duration::from_millis(500);

fn load(queued: i64) -> WorkerLoad {
    WorkerLoad::from_ranks(vec![SchedulerLoadSnapshot {
        num_waiting_reqs: 1,
        num_waiting_uncached_tokens: Some(queued),
        gen_throughput: Some(2000.0),
        ..SchedulerLoadSnapshot::default()
    }])
    .unwrap()
}

/// A worker that accepts the poll and never answers.
struct Hung;

#[async_trait]
impl LoadSource for Hung {
    async fn fetch(&self) -> Result<Option<WorkerLoad>, LoadError> {
        std::future::pending().await
    }
    fn kind(&self) -> &'static str {
        "hung"
    }
    fn load_url(&self) -> &str {
        "http://10.0.0.0:30000"
    }
}

#[tokio::test(start_paused = true)]
async fn least_load_follows_a_scripted_sequence_of_polls() {
    // The reported rate: this script is about the poll rules, worked out by
    // hand against the workers' reported rates.
    let policy = LeastLoad::new(
        Strategy::LeastLoad,
        LeastLoadParams {
            rate: RateMode::Reported,
            ..LeastLoadParams::default()
        },
        &policy_core::PolicyContext::default(),
    )
    .unwrap();
    let (flaky, steady) = (WorkerId::new(0, 0), WorkerId::new(1, 0));
    policy.add_worker(flaky, WorkerInfo::new("http://10.0.0.0:30000", "sglang"));
    policy.add_worker(steady, WorkerInfo::new("http://10.0.0.1:30000", "sglang"));
    let both = [flaky, steady];
    let request = RequestInfo::new(TokenCount::Exact(100));

    // The flaky worker's script, one answer per poll (the timeout of step 5
    // comes from a hung source instead: a mock answers at once).
    let mut script = vec![
        Ok(Some(load(8000))),
        Err(LoadError::HttpStatus {
            url: "http://10.0.0.0:30000".into(),
            status: 503,
        }),
        Ok(None),
        Ok(Some(load(0))),
        Ok(Some(load(0))),
    ]
    .into_iter();
    let mut flaky_source = MockLoadSource::new();
    flaky_source
        .expect_fetch()
        .times(5)
        .returning(move || script.next().unwrap_or(Ok(None)));
    flaky_source
        .expect_load_url()
        .return_const("http://10.0.0.0:30000".to_owned());
    flaky_source.expect_kind().return_const("mock");
    // The steady worker always holds 2000 queued tokens: 1 s.
    let mut steady_source = MockLoadSource::new();
    steady_source
        .expect_fetch()
        .returning(|| Ok(Some(load(2000))));
    steady_source
        .expect_load_url()
        .return_const("http://10.0.0.1:30000".to_owned());
    steady_source.expect_kind().return_const("mock");

    // Polls one round and returns the flaky worker's (score, note) and the choice.
    async fn round(
        policy: &LeastLoad,
        flaky: (&dyn LoadSource, WorkerId),
        steady: (&dyn LoadSource, WorkerId),
        request: &RequestInfo,
    ) -> (PollOutcome, f64, String, WorkerId) {
        let outcome = poll_worker(policy, flaky.0, flaky.1, DEADLINE, tokio_now).await;
        poll_worker(policy, steady.0, steady.1, DEADLINE, tokio_now).await;
        let now = tokio_now();
        let both = [flaky.1, steady.1];
        let table = policy.explain(&both, request, now);
        let row = table.row(flaky.1).unwrap();
        let score = table.value(flaky.1, "score_s").unwrap();
        let dispatch = policy.select(&both, request, now).unwrap();
        policy.finish(&dispatch, now);
        (outcome, score, row.note.clone(), dispatch.worker)
    }

    let flaky_pair = (&flaky_source as &dyn LoadSource, flaky);
    let steady_pair = (&steady_source as &dyn LoadSource, steady);

    // 1. A report of 8000 queued tokens: 4 s against the steady 1 s.
    let (outcome, score, note, chosen) = round(&policy, flaky_pair, steady_pair, &request).await;
    assert!(matches!(outcome, PollOutcome::Report(_)));
    assert_eq!((score, note.as_str(), chosen), (4.0, "fresh", steady));

    // 2. The poll fails: no fresh snapshot, its queue counts as 0 (rule 3).
    tokio::time::advance(Duration::from_secs(1)).await;
    let (outcome, score, note, chosen) = round(&policy, flaky_pair, steady_pair, &request).await;
    assert!(matches!(
        outcome,
        PollOutcome::Failed(LoadError::HttpStatus { status: 503, .. })
    ));
    assert_eq!(score, 0.0);
    assert_eq!(note, "rule 3: no fresh snapshot, queue unknown");
    assert_eq!(chosen, flaky);

    // 3. No report this time: still no fresh snapshot.
    tokio::time::advance(Duration::from_secs(1)).await;
    let (outcome, _, note, chosen) = round(&policy, flaky_pair, steady_pair, &request).await;
    assert!(matches!(outcome, PollOutcome::NoReport));
    assert!(note.starts_with("rule 3"), "{note}");
    assert_eq!(chosen, flaky);

    // 4. An empty queue reported: fresh again, 0 s.
    tokio::time::advance(Duration::from_secs(1)).await;
    let (outcome, score, note, chosen) = round(&policy, flaky_pair, steady_pair, &request).await;
    assert!(matches!(outcome, PollOutcome::Report(_)));
    assert_eq!((score, note.as_str(), chosen), (0.0, "fresh", flaky));

    // 5. The worker hangs: the poll times out at the deadline and the worker
    // loses its snapshot.
    tokio::time::advance(Duration::from_secs(1)).await;
    let hung = Hung;
    let (outcome, _, note, _) = round(&policy, (&hung, flaky), steady_pair, &request).await;
    assert!(matches!(
        outcome,
        PollOutcome::Failed(LoadError::Timeout {
            deadline: DEADLINE,
            ..
        })
    ));
    assert!(note.starts_with("rule 3"), "{note}");

    // 6. A last report, then silence: fresh for stale_after (3 s), then not.
    let (_, score, note, _) = round(&policy, flaky_pair, steady_pair, &request).await;
    assert_eq!((score, note.as_str()), (0.0, "fresh"));
    // A request held there: 1000 pending tokens, no first token yet.
    let held = policy
        .select(
            &[flaky],
            &RequestInfo::new(TokenCount::Exact(1000)),
            tokio_now(),
        )
        .unwrap();
    tokio::time::advance(Duration::from_secs(3)).await;
    let table = policy.explain(&both, &request, tokio_now());
    // Still fresh at exactly 3 s: 1000 pending / 2000 = 0.5 s.
    assert_eq!(table.value(flaky, "score_s"), Some(0.5));
    assert_eq!(table.row(flaky).unwrap().note, "fresh");
    tokio::time::advance(Duration::from_millis(1)).await;
    // The steady worker keeps answering; the flaky one has gone quiet.
    poll_worker(&policy, &steady_source, steady, DEADLINE, tokio_now).await;
    let table = policy.explain(&both, &request, tokio_now());
    assert!(
        table.row(flaky).unwrap().note.starts_with("rule 3"),
        "{table}"
    );
    // Its pending work still counts, at the steady worker's 2000 tok/s.
    assert_eq!(table.value(flaky, "score_s"), Some(0.5));
    policy.finish(&held, tokio_now());
}
