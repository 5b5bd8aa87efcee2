//! Unit tests of the policies, one per rule of `docs/least-load.md`, with the expected
//! values worked out by hand.

use std::time::{Duration, Instant};

use load_protocols::{SchedulerLoadSnapshot, WorkerLoad, queued_tokens_from_proto3};
use policy_core::{
    Dispatch, Policy, PolicyContext, PolicyError, PolicyRegistry, PrefillSample, ReplicaPending,
    ReplicaPendingOutcome, ReplicaUpdate, ReplicaUpdateOutcome, RequestInfo, ScoreTable,
    TokenCount, WorkerId, WorkerInfo, WorkerStats,
};
use proptest::prelude::*;

use crate::Strategy as Pick;
use crate::rate::MIN_SAMPLES_TO_SCORE;
use crate::{InflightMode, LeastLoad, LeastLoadParams, RateMode, register};

fn fleet_with(strategy: Pick, params: LeastLoadParams, n: u32) -> (LeastLoad, Vec<WorkerId>) {
    let policy = LeastLoad::new(strategy, params, &PolicyContext::default()).unwrap();
    let ids: Vec<WorkerId> = (0..n).map(|slot| WorkerId::new(slot, 0)).collect();
    for id in &ids {
        policy.add_worker(
            *id,
            WorkerInfo::new(format!("http://w{}", id.slot()), "sglang"),
        );
    }
    (policy, ids)
}

/// The rules below are worked out by hand against reported rates; the
/// learned rate (the default) has its own tests at the end.
fn reported() -> LeastLoadParams {
    LeastLoadParams {
        rate: RateMode::Reported,
        ..LeastLoadParams::default()
    }
}

fn fleet(n: u32) -> (LeastLoad, Vec<WorkerId>) {
    fleet_with(Pick::LeastLoad, reported(), n)
}

fn learned_fleet(n: u32) -> (LeastLoad, Vec<WorkerId>) {
    fleet_with(Pick::LeastLoad, LeastLoadParams::default(), n)
}

fn since_poll() -> LeastLoadParams {
    LeastLoadParams {
        inflight: InflightMode::SincePoll,
        ..reported()
    }
}

fn capped(cap: u64) -> LeastLoadParams {
    LeastLoadParams {
        max_waiting_requests: cap,
        ..reported()
    }
}

/// One rank with the given queue (`None`: not reported), waiting requests,
/// throughput and KV usage.
fn load(queued: Option<i64>, waiting: i64, tps: Option<f64>, kv: f64) -> WorkerLoad {
    WorkerLoad::from_ranks(vec![SchedulerLoadSnapshot {
        num_waiting_reqs: waiting,
        num_waiting_uncached_tokens: queued,
        gen_throughput: tps,
        token_usage: kv,
        ..SchedulerLoadSnapshot::default()
    }])
    .unwrap()
}

/// A poll sent and answered at `at`.
fn report(policy: &LeastLoad, id: WorkerId, load: &WorkerLoad, at: Instant) {
    let mark = policy.poll_started(id, at);
    policy.poll_completed(mark, Some(load), at);
}

fn exact(tokens: u64) -> RequestInfo {
    RequestInfo::new(TokenCount::Exact(tokens))
}

fn score(table: &ScoreTable, id: WorkerId) -> f64 {
    table.value(id, "score_s").unwrap()
}

fn close(actual: f64, expected: f64) -> bool {
    (actual - expected).abs() < 1e-9
}

#[test]
fn queued_tokens_steer() {
    let (policy, ids) = fleet(2);
    let t0 = Instant::now();
    report(&policy, ids[0], &load(Some(4000), 2, Some(2000.0), 0.0), t0);
    report(&policy, ids[1], &load(Some(1000), 2, Some(2000.0), 0.0), t0);
    let table = policy.explain(&ids, &exact(100), t0);
    // 4000 / 2000 = 2 s against 1000 / 2000 = 0.5 s.
    assert_eq!(score(&table, ids[0]), 2.0);
    assert_eq!(score(&table, ids[1]), 0.5);
    let dispatch = policy.select(&ids, &exact(100), t0).unwrap();
    assert_eq!(dispatch.worker, ids[1]);
    assert_eq!(
        dispatch.score, 0.5,
        "the dispatch carries the winner's score"
    );
}

#[test]
fn preview_names_the_worker_select_then_chooses_and_credits_nothing() {
    let (policy, ids) = fleet(2);
    let t0 = Instant::now();
    report(&policy, ids[0], &load(Some(4000), 2, Some(2000.0), 0.0), t0);
    report(&policy, ids[1], &load(Some(1000), 2, Some(2000.0), 0.0), t0);
    let (worker, wait) = policy.preview(&ids, &exact(100), t0).unwrap();
    assert_eq!(worker, ids[1]);
    // The wait there alone, as `expected_wait` over that worker.
    let alone = policy.expected_wait(&[ids[1]], &exact(100), t0).unwrap();
    assert_eq!(wait, alone);
    assert_eq!(wait.queue_secs, 0.5);
    // Nothing was credited: a second preview and the select agree.
    assert_eq!(policy.preview(&ids, &exact(100), t0).unwrap().0, ids[1]);
    assert_eq!(policy.worker_stats(ids[1]).unwrap().pending_requests, 0);
    assert_eq!(policy.select(&ids, &exact(100), t0).unwrap().worker, ids[1]);
    assert_eq!(policy.preview(&[], &exact(100), t0), None);
}

#[test]
fn throughput_normalizes_the_queue() {
    let (policy, ids) = fleet(2);
    let t0 = Instant::now();
    // More tokens but three times the rate: 3000 / 3000 = 1 s < 2000 / 1000 = 2 s.
    report(&policy, ids[0], &load(Some(3000), 3, Some(3000.0), 0.0), t0);
    report(&policy, ids[1], &load(Some(2000), 2, Some(1000.0), 0.0), t0);
    let table = policy.explain(&ids, &exact(100), t0);
    assert_eq!(score(&table, ids[0]), 1.0);
    assert_eq!(score(&table, ids[1]), 2.0);
    assert_eq!(policy.select(&ids, &exact(100), t0).unwrap().worker, ids[0]);
}

#[test]
fn without_reported_throughput_every_worker_drains_at_the_default() {
    let params = LeastLoadParams {
        rate: RateMode::Fixed,
        default_throughput: 1000.0,
        ..LeastLoadParams::default()
    };
    let (policy, ids) = fleet_with(Pick::LeastLoad, params, 2);
    let t0 = Instant::now();
    // The same reports as `throughput_normalizes_the_queue`, which picks
    // worker 0 for its rate; here both drain at 1000 tok/s: 3 s against 2 s.
    report(&policy, ids[0], &load(Some(3000), 3, Some(3000.0), 0.0), t0);
    report(&policy, ids[1], &load(Some(2000), 2, Some(1000.0), 0.0), t0);
    let table = policy.explain(&ids, &exact(100), t0);
    assert_eq!(score(&table, ids[0]), 3.0, "{table}");
    assert_eq!(score(&table, ids[1]), 2.0, "{table}");
    assert_eq!(table.value(ids[0], "rate_tps"), Some(1000.0));
    assert_eq!(policy.select(&ids, &exact(100), t0).unwrap().worker, ids[1]);
}

#[test]
fn the_kv_barrier_avoids_a_near_full_worker() {
    let (policy, ids) = fleet(2);
    let t0 = Instant::now();
    // Empty queue but k = 0.98: 0.15 * 0.98 / 0.02 = 7.35 s.
    report(&policy, ids[0], &load(Some(0), 0, Some(2000.0), 0.98), t0);
    // 4000 / 2000 = 2 s plus 0.15 * 0.1 / 0.9 = 0.01667 s.
    report(&policy, ids[1], &load(Some(4000), 4, Some(2000.0), 0.1), t0);
    let table = policy.explain(&ids, &exact(100), t0);
    assert!(close(score(&table, ids[0]), 7.35), "{table}");
    assert!(close(score(&table, ids[1]), 2.0 + 0.15 / 9.0), "{table}");
    assert_eq!(policy.select(&ids, &exact(100), t0).unwrap().worker, ids[1]);
}

#[test]
fn pending_work_water_fills_before_any_first_token() {
    let (policy, ids) = fleet(4);
    let t0 = Instant::now();
    for id in &ids {
        report(&policy, *id, &load(Some(0), 0, Some(2000.0), 0.0), t0);
    }
    let mut per_worker = [0u64; 4];
    for _ in 0..8 {
        let dispatch = policy.select(&ids, &exact(1000), t0).unwrap();
        per_worker[dispatch.worker.slot()] += 1;
    }
    assert_eq!(
        per_worker,
        [2, 2, 2, 2],
        "each level filled before the next"
    );

    // Size skew: one 6000-token request, then 200-token ones all avoid it
    // until the others hold as much work.
    let (policy, ids) = fleet(2);
    let big = policy.select(&ids, &exact(6000), t0).unwrap();
    let other = ids.iter().copied().find(|id| *id != big.worker).unwrap();
    for _ in 0..30 {
        assert_eq!(policy.select(&ids, &exact(200), t0).unwrap().worker, other);
    }
    // 30 * 200 = 6000: tied now, then the next one is spread at random.
    assert_eq!(policy.worker_stats(other).unwrap().pending_tokens, 6000);
}

#[test]
fn pending_work_is_released_at_the_first_token_and_by_finish_on_failure() {
    let (policy, ids) = fleet(1);
    let t0 = Instant::now();
    let ok = policy.select(&ids, &exact(700), t0).unwrap();
    let failed = policy.select(&ids, &exact(300), t0).unwrap();
    assert_eq!(
        policy.worker_stats(ids[0]),
        Some(WorkerStats {
            in_flight_requests: 2,
            pending_requests: 2,
            pending_tokens: 1000
        })
    );
    policy.first_token(&ok, t0);
    policy.first_token(&ok, t0); // idempotent
    assert_eq!(policy.worker_stats(ids[0]).unwrap().pending_tokens, 300);
    // The second request fails before its first token: finish releases it.
    policy.finish(&failed, t0);
    assert_eq!(
        policy.worker_stats(ids[0]),
        Some(WorkerStats {
            in_flight_requests: 1,
            pending_requests: 0,
            pending_tokens: 0
        })
    );
    policy.finish(&ok, t0);
    policy.finish(&ok, t0); // idempotent
    assert_eq!(policy.worker_stats(ids[0]), Some(WorkerStats::default()));
}

#[test]
fn unknown_sizes_are_credited_the_mean_prefill() {
    let (policy, ids) = fleet(1);
    let t0 = Instant::now();
    let unknown = policy
        .select(&ids, &RequestInfo::new(TokenCount::Unknown), t0)
        .unwrap();
    assert_eq!(unknown.tokens, 1024);
    let estimated = policy
        .select(&ids, &RequestInfo::new(TokenCount::Estimated(77)), t0)
        .unwrap();
    assert_eq!(estimated.tokens, 77);
    assert_eq!(policy.worker_stats(ids[0]).unwrap().pending_tokens, 1101);
}

/// Two identical workers, each holding one 1000-token request whose prefill
/// has started (the engine no longer queues it) but whose first token has not
/// arrived; worker 0 was polled after the dispatch, worker 1 before it.
fn polled_at_different_moments(params: LeastLoadParams) -> (LeastLoad, Vec<WorkerId>, Instant) {
    let (policy, ids) = fleet_with(Pick::LeastLoad, params, 2);
    let t0 = Instant::now();
    let idle = load(Some(0), 0, Some(2000.0), 0.0);
    report(&policy, ids[1], &idle, t0);
    let candidates = [ids[0]];
    policy.select(&candidates, &exact(1000), t0).unwrap();
    let candidates = [ids[1]];
    policy.select(&candidates, &exact(1000), t0).unwrap();
    report(&policy, ids[0], &idle, t0 + Duration::from_millis(500));
    (policy, ids, t0 + Duration::from_millis(600))
}

#[test]
fn the_score_does_not_depend_on_poll_phase() {
    let (policy, ids, now) = polled_at_different_moments(LeastLoadParams::default());
    let table = policy.explain(&ids, &exact(100), now);
    // Both: queue 0, pending 1000, the request's own 100 → 1100 / 2000.
    assert_eq!(score(&table, ids[0]), 0.55);
    assert_eq!(score(&table, ids[1]), 0.55);
    assert_eq!(table.chosen.len(), 2, "{table}");

    // The original estimator forgets worker 0's request at its poll and
    // floods it: the defect the pending mode removes.
    let (policy, ids, now) = polled_at_different_moments(since_poll());
    let table = policy.explain(&ids, &exact(100), now);
    assert_eq!(score(&table, ids[0]), 0.0);
    assert_eq!(score(&table, ids[1]), 0.5);
}

#[test]
fn the_queued_term_subtracts_pending_work_at_poll_start_in_tokens() {
    let (policy, ids) = fleet(1);
    let t0 = Instant::now();
    let first = policy.select(&ids, &exact(500), t0).unwrap();
    policy.select(&ids, &exact(500), t0).unwrap();
    policy.select(&ids, &exact(500), t0).unwrap();
    let mark = policy.poll_started(ids[0], t0);
    assert_eq!((mark.pending_tokens, mark.pending_requests), (1500, 3));
    // While the poll is out: one first token, one new dispatch.
    policy.first_token(&first, t0);
    policy.select(&ids, &exact(250), t0).unwrap();
    // The engine saw our 1500 plus 1000 of others'.
    policy.poll_completed(mark, Some(&load(Some(2500), 5, Some(2000.0), 0.0)), t0);
    let table = policy.explain(&ids, &exact(100), t0);
    // queued 2500 - 1500 = 1000; pending now 1000 + 250 = 1250; / 2000 = 1.125 s.
    assert_eq!(table.value(ids[0], "queued_tok"), Some(1000.0));
    assert_eq!(table.value(ids[0], "inflight_tok"), Some(1250.0));
    assert_eq!(score(&table, ids[0]), 1.125);
}

#[test]
fn the_queued_term_subtracts_pending_requests_times_mean_prefill() {
    let (policy, ids) = fleet(1);
    let t0 = Instant::now();
    for _ in 0..3 {
        policy.select(&ids, &exact(100), t0).unwrap();
    }
    let mark = policy.poll_started(ids[0], t0);
    // vLLM-style report: 5 waiting, no token count.
    policy.poll_completed(mark, Some(&load(None, 5, None, 0.0)), t0);
    let table = policy.explain(&ids, &exact(100), t0);
    // (5 - 3) * 1024 = 2048 queued; 300 pending; / 2000 default = 1.174 s.
    assert_eq!(table.value(ids[0], "queued_tok"), Some(2048.0));
    assert_eq!(score(&table, ids[0]), 1.174);
    assert_eq!(
        table.row(ids[0]).unwrap().note,
        "fresh; rules 1+2: queue = waiting x mean_prefill, default throughput"
    );
}

#[test]
fn an_older_overlapping_poll_is_ignored() {
    let (policy, ids) = fleet(1);
    let t0 = Instant::now();
    let older = policy.poll_started(ids[0], t0);
    let newer = policy.poll_started(ids[0], t0 + Duration::from_millis(1000));
    let t1 = t0 + Duration::from_millis(1100);
    policy.poll_completed(newer, Some(&load(Some(200), 1, Some(2000.0), 0.0)), t1);
    // The older poll answers last, with a bigger queue: ignored.
    policy.poll_completed(older, Some(&load(Some(9000), 9, Some(2000.0), 0.0)), t1);
    let table = policy.explain(&ids, &exact(1), t1);
    assert_eq!(table.value(ids[0], "queued_tok"), Some(200.0));
    // Nor can its failure clear the newer snapshot.
    policy.poll_failed(older, t1);
    let table = policy.explain(&ids, &exact(1), t1);
    assert_eq!(table.row(ids[0]).unwrap().note, "fresh");
}

#[test]
fn reported_zero_is_trusted_and_not_reported_is_estimated() {
    let (policy, ids) = fleet(3);
    let t0 = Instant::now();
    // JSON with the key present: 0 tokens next to 3 waiting is a report.
    report(&policy, ids[0], &load(Some(0), 3, Some(2000.0), 0.0), t0);
    // JSON without the key: 3 waiting * 1024.
    report(&policy, ids[1], &load(None, 3, Some(2000.0), 0.0), t0);
    // gRPC: 0 next to 3 waiting means "not reported"; 0 with nothing waiting is a report.
    let grpc_busy = load(queued_tokens_from_proto3(0, 3), 3, Some(2000.0), 0.0);
    let grpc_idle = load(queued_tokens_from_proto3(0, 0), 0, Some(2000.0), 0.0);
    assert_eq!(grpc_busy.queued_tokens(), None);
    assert_eq!(grpc_idle.queued_tokens(), Some(0));
    report(&policy, ids[2], &grpc_busy, t0);
    let table = policy.explain(&ids, &exact(1), t0);
    assert_eq!(score(&table, ids[0]), 0.0);
    // 3072 / 2000.
    assert_eq!(score(&table, ids[1]), 1.536);
    assert_eq!(score(&table, ids[2]), 1.536);
    assert_eq!(table.chosen, vec![ids[0]]);
    report(&policy, ids[2], &grpc_idle, t0);
    let table = policy.explain(&ids, &exact(1), t0);
    assert_eq!(table.row(ids[2]).unwrap().note, "fresh");
    assert_eq!(score(&table, ids[2]), 0.0);
}

#[test]
fn a_stale_snapshot_is_ignored() {
    let (policy, ids) = fleet(2);
    let t0 = Instant::now();
    report(&policy, ids[0], &load(Some(8000), 8, Some(2000.0), 0.0), t0);
    let stale_after = PolicyContext::default().stale_after;
    report(
        &policy,
        ids[1],
        &load(Some(2000), 2, Some(2000.0), 0.0),
        t0 + stale_after,
    );
    // Exactly stale_after old: still fresh, 8000 / 2000 = 4 s.
    let table = policy.explain(&ids, &exact(1), t0 + stale_after);
    assert_eq!(score(&table, ids[0]), 4.0);
    // One nanosecond later it is ignored: rule 3, nothing pending → 0 s.
    let later = t0 + stale_after + Duration::from_nanos(1);
    let table = policy.explain(&ids, &exact(1), later);
    assert_eq!(score(&table, ids[0]), 0.0);
    assert_eq!(
        table.row(ids[0]).unwrap().note,
        "rule 3: no fresh snapshot, queue unknown"
    );
    assert_eq!(
        policy.select(&ids, &exact(1), later).unwrap().worker,
        ids[0]
    );
}

#[test]
fn a_failed_poll_or_no_report_leaves_no_fresh_snapshot() {
    let (policy, ids) = fleet(2);
    let t0 = Instant::now();
    report(&policy, ids[1], &load(Some(0), 0, Some(2000.0), 0.0), t0);
    for outcome in ["failed", "none"] {
        report(&policy, ids[0], &load(Some(4000), 4, Some(2000.0), 0.0), t0);
        let mark = policy.poll_started(ids[0], t0);
        if outcome == "failed" {
            policy.poll_failed(mark, t0);
        } else {
            policy.poll_completed(mark, None, t0);
        }
        let table = policy.explain(&ids, &exact(1), t0);
        assert_eq!(
            table.row(ids[0]).unwrap().note,
            "rule 3: no fresh snapshot, queue unknown",
            "{outcome}"
        );
    }
}

#[test]
fn a_worker_without_a_snapshot_among_reporting_ones() {
    let (policy, ids) = fleet(3);
    let t0 = Instant::now();
    report(&policy, ids[0], &load(Some(3000), 3, Some(1000.0), 0.0), t0);
    report(&policy, ids[1], &load(Some(6000), 6, Some(3000.0), 0.0), t0);
    let candidates = [ids[2]];
    policy.select(&candidates, &exact(3000), t0).unwrap();
    let table = policy.explain(&ids, &exact(1), t0);
    // Nominal = (1000 + 3000) / 2 = 2000 tok/s; 3000 pending / 2000 = 1.5 s,
    // comparable with the 3 s and 2 s of the reporting workers; no barrier.
    assert_eq!(table.value(ids[2], "rate_tps"), Some(2000.0));
    assert_eq!(score(&table, ids[2]), 1.5);
    assert_eq!(score(&table, ids[0]), 3.0);
    assert_eq!(score(&table, ids[1]), 2.0);
    assert_eq!(policy.select(&ids, &exact(1), t0).unwrap().worker, ids[2]);
}

/// The fleet's mean rate, which a worker without a snapshot is scored at,
/// is remembered between selections over the same candidates, and a report
/// or a removal changes it at once.
#[test]
fn the_remembered_fleet_rate_follows_reports_and_removals() {
    let (policy, ids) = fleet(3);
    let t0 = Instant::now();
    report(&policy, ids[0], &load(Some(2000), 2, Some(1000.0), 0.0), t0);
    report(&policy, ids[1], &load(Some(2000), 2, Some(1000.0), 0.0), t0);
    policy.select(&[ids[2]], &exact(3000), t0).unwrap();
    // Nominal 1000 tok/s: the dark worker waits 3 s, the others 2 s.
    let first = policy.select(&ids, &exact(1), t0).unwrap();
    assert_ne!(first.worker, ids[2]);
    // ids[1] now reports 1.2 s at 5000 tok/s: nominal (1000 + 5000) / 2 =
    // 3000, and the dark worker's 3000 tokens wait 1 s.
    report(&policy, ids[1], &load(Some(6000), 6, Some(5000.0), 0.0), t0);
    assert_eq!(policy.select(&ids, &exact(1), t0).unwrap().worker, ids[2]);
    // Without ids[1], nominal is 1000 again: 3 s against ids[0]'s 2 s.
    policy.remove_worker(ids[1]);
    assert_eq!(policy.select(&ids, &exact(1), t0).unwrap().worker, ids[0]);
}

#[test]
fn a_dark_fleet_joins_the_shortest_queue_of_pending_tokens() {
    let (policy, ids) = fleet(3);
    let t0 = Instant::now();
    for (id, tokens) in ids.iter().zip([300, 100, 200]) {
        policy.select(&[*id], &exact(tokens), t0).unwrap();
    }
    let table = policy.explain(&ids, &exact(1), t0);
    // 100 / 2000 default.
    assert_eq!(score(&table, ids[1]), 0.05);
    assert_eq!(
        table.row(ids[1]).unwrap().note,
        "rule 4: no fresh snapshot in fleet, pending work only"
    );
    let next = policy.select(&ids, &exact(50), t0).unwrap();
    assert_eq!(next.worker, ids[1]);
    // 150 now: still the shortest.
    assert_eq!(policy.select(&ids, &exact(1), t0).unwrap().worker, ids[1]);
}

#[test]
fn the_cap_vetoes_workers_and_none_when_all_are_capped() {
    let (policy, ids) = fleet_with(Pick::LeastLoad, capped(2), 2);
    let t0 = Instant::now();
    // One of ours pending on worker 0 when polled; it reports 3 waiting:
    // 3 - 1 = 2 of others' + 1 of ours = 3 >= 2: capped, though its score is best.
    let ours = policy.select(&ids[..1], &exact(10), t0).unwrap();
    let mark = policy.poll_started(ids[0], t0);
    policy.poll_completed(mark, Some(&load(Some(0), 3, Some(2000.0), 0.0)), t0);
    report(&policy, ids[1], &load(Some(9000), 1, Some(2000.0), 0.0), t0);
    let table = policy.explain(&ids, &exact(10), t0);
    assert_eq!(table.value(ids[0], "waiting_req"), Some(3.0));
    assert!(
        table
            .row(ids[0])
            .unwrap()
            .note
            .ends_with("capped: 3 waiting >= 2")
    );
    assert_eq!(table.chosen, vec![ids[1]]);
    // Worker 1: 1 waiting + 0 pending < 2: admitted once, then capped.
    assert_eq!(policy.select(&ids, &exact(10), t0).unwrap().worker, ids[1]);
    assert_eq!(policy.select(&ids, &exact(10), t0), None, "all capped");
    assert!(policy.explain(&ids, &exact(10), t0).chosen.is_empty());
    // The single-worker shortcut does not bypass the cap.
    assert_eq!(policy.select(&ids[1..], &exact(10), t0), None);
    // Our request on worker 0 starts: 2 + 0 = 2, still capped; the engine's
    // queue drains in the next report: admitted again.
    policy.first_token(&ours, t0);
    assert_eq!(policy.select(&ids[..1], &exact(10), t0), None);
    report(&policy, ids[0], &load(Some(0), 1, Some(2000.0), 0.0), t0);
    assert_eq!(
        policy.select(&ids[..1], &exact(10), t0).unwrap().worker,
        ids[0]
    );
}

#[test]
fn the_cap_counts_pending_requests_of_a_worker_without_a_snapshot() {
    let (policy, ids) = fleet_with(Pick::LeastLoad, capped(2), 1);
    let t0 = Instant::now();
    let a = policy.select(&ids, &exact(1), t0).unwrap();
    policy.select(&ids, &exact(1), t0).unwrap();
    assert_eq!(policy.select(&ids, &exact(1), t0), None);
    policy.first_token(&a, t0);
    assert!(policy.select(&ids, &exact(1), t0).is_some());
}

#[test]
fn hostile_reports_never_produce_a_non_finite_score() {
    let (policy, ids) = fleet(3);
    let t0 = Instant::now();
    // NaN / infinite / negative rates are dropped by validation; usage > 1 is
    // clamped; huge counts stay finite.
    for (id, tps) in ids.iter().zip([f64::NAN, f64::INFINITY, -1.0]) {
        report(
            &policy,
            *id,
            &load(Some(i64::MAX), i64::MAX, Some(tps), 1.7),
            t0,
        );
    }
    let table = policy.explain(&ids, &exact(1), t0);
    for row in &table.rows {
        assert!(row.values.iter().all(|value| value.is_finite()), "{table}");
    }
    assert_eq!(table.chosen.len(), 3, "all equal: every one may win");
    // A sane worker beats them all.
    policy.add_worker(WorkerId::new(3, 0), WorkerInfo::new("http://w3", "sglang"));
    let all = [ids[0], ids[1], ids[2], WorkerId::new(3, 0)];
    report(&policy, all[3], &load(Some(10), 1, Some(2000.0), 0.2), t0);
    let dispatch = policy.select(&all, &exact(1), t0).unwrap();
    assert_eq!(dispatch.worker, all[3]);
    assert!(dispatch.score.is_finite());
}

#[test]
fn ties_spread_over_all_tied_workers() {
    let (policy, ids) = fleet(4);
    let t0 = Instant::now();
    for id in &ids[..3] {
        report(&policy, *id, &load(Some(0), 0, Some(2000.0), 0.0), t0);
    }
    // Worker 3 is busier: never tied.
    report(&policy, ids[3], &load(Some(100), 1, Some(2000.0), 0.0), t0);
    let mut wins = [0u32; 4];
    for _ in 0..3000 {
        let dispatch = policy.select(&ids, &exact(10), t0).unwrap();
        wins[dispatch.worker.slot()] += 1;
        policy.finish(&dispatch, t0);
    }
    assert_eq!(wins[3], 0);
    // 1000 expected each; 800 is far outside binomial noise (sd ≈ 26).
    assert!(wins[..3].iter().all(|count| *count > 800), "{wins:?}");
}

/// Three idle workers whose KV barriers differ by less than the default
/// 10 ms tie tolerance: 0.15·k/(1−k) is 1.515 ms at k = 0.01, 3.061 ms at
/// 0.02 and 4.639 ms at 0.03.
fn near_tied_fleet(params: LeastLoadParams) -> (LeastLoad, Vec<WorkerId>, Instant) {
    let (policy, ids) = fleet_with(Pick::LeastLoad, params, 3);
    let t0 = Instant::now();
    for (id, kv) in ids.iter().zip([0.01, 0.02, 0.03]) {
        report(&policy, *id, &load(Some(0), 0, Some(2000.0), kv), t0);
    }
    (policy, ids, t0)
}

/// Selects `count` times, 1 ms apart, releasing each dispatch at once.
fn dispatch_order(policy: &LeastLoad, ids: &[WorkerId], t0: Instant, count: u64) -> Vec<WorkerId> {
    (0..count)
        .map(|step| {
            let now = t0 + Duration::from_millis(step);
            let dispatch = policy.select(ids, &exact(10), now).unwrap();
            policy.first_token(&dispatch, now);
            policy.finish(&dispatch, now);
            dispatch.worker
        })
        .collect()
}

#[test]
fn near_ties_go_to_the_least_recently_dispatched_worker() {
    let (policy, ids, t0) = near_tied_fleet(LeastLoadParams::default());
    let table = policy.explain(&ids, &exact(10), t0);
    // The barrier, and the request's own 10 tokens at the prior.
    assert!(
        close(score(&table, ids[0]), 0.15 * 0.01 / 0.99 + 10.0 / 2000.0),
        "{table}"
    );
    assert_eq!(
        table.chosen.len(),
        3,
        "never dispatched: all three tied\n{table}"
    );
    let order = dispatch_order(&policy, &ids, t0, 9);
    let mut first_round = order[..3].to_vec();
    first_round.sort();
    assert_eq!(
        first_round, ids,
        "each worker once before any twice: {order:?}"
    );
    assert_eq!(order[3..6], order[..3], "then the same cycle: {order:?}");
    assert_eq!(order[6..], order[..3], "then the same cycle: {order:?}");
    // The explain table marks the one `select` would take next.
    let now = t0 + Duration::from_millis(9);
    assert_eq!(policy.explain(&ids, &exact(10), now).chosen, vec![order[0]]);
}

#[test]
fn a_zero_tolerance_keeps_the_strict_argmin() {
    let params = LeastLoadParams {
        tie_tolerance_secs: 0.0,
        ..LeastLoadParams::default()
    };
    let (policy, ids, t0) = near_tied_fleet(params);
    assert_eq!(dispatch_order(&policy, &ids, t0, 6), vec![ids[0]; 6]);
}

#[test]
fn near_ties_are_exact_past_the_stack_buffer() {
    // Scores fall along the candidate list (worker i: (39 − i) × 10 tokens at
    // 2000 tok/s = (39 − i) × 5 ms), so every candidate is briefly a near-tie
    // and the buffer must drop the ones the falling minimum leaves behind.
    // Only workers 37, 38 and 39 end within 10 ms of the lowest (0 s).
    let (policy, ids) = fleet(40);
    let t0 = Instant::now();
    for (index, id) in ids.iter().enumerate() {
        let queued = (39 - index as i64) * 10;
        report(&policy, *id, &load(Some(queued), 1, Some(2000.0), 0.0), t0);
    }
    let order = dispatch_order(&policy, &ids, t0, 6);
    let mut first_round = order[..3].to_vec();
    first_round.sort();
    assert_eq!(first_round, ids[37..].to_vec(), "{order:?}");
    assert_eq!(order[3..], order[..3], "{order:?}");
}

#[test]
fn a_large_idle_fleet_is_cycled_through_whole() {
    // 48 tied workers: more near-ties than the stack buffer holds.
    let (policy, ids) = fleet(48);
    let t0 = Instant::now();
    for id in &ids {
        report(&policy, *id, &load(Some(0), 0, Some(2000.0), 0.0), t0);
    }
    let order = dispatch_order(&policy, &ids, t0, 96);
    let mut first_round = order[..48].to_vec();
    first_round.sort();
    assert_eq!(first_round, ids, "each worker once before any twice");
    assert_eq!(order[48..], order[..48], "then the same cycle");
}

#[test]
fn a_difference_beyond_the_tolerance_is_never_a_tie() {
    let (policy, ids) = fleet(2);
    let t0 = Instant::now();
    report(&policy, ids[0], &load(Some(0), 0, Some(2000.0), 0.0), t0);
    // 30 / 2000 = 15 ms of queue: more than the 10 ms tolerance.
    report(&policy, ids[1], &load(Some(30), 1, Some(2000.0), 0.0), t0);
    assert_eq!(dispatch_order(&policy, &ids, t0, 4), vec![ids[0]; 4]);
}

#[test]
fn since_poll_resets_on_receipt_and_ignores_first_tokens() {
    let (policy, ids) = fleet_with(Pick::LeastLoad, since_poll(), 2);
    let t0 = Instant::now();
    let idle = load(Some(0), 0, Some(2000.0), 0.0);
    report(&policy, ids[0], &idle, t0);
    report(&policy, ids[1], &idle, t0);
    let dispatch = policy.select(&ids[..1], &exact(1000), t0).unwrap();
    let inflight = |policy: &LeastLoad| {
        policy
            .explain(&ids, &exact(1), t0)
            .value(ids[0], "inflight_tok")
            .unwrap()
    };
    assert_eq!(inflight(&policy), 1000.0);
    policy.first_token(&dispatch, t0);
    assert_eq!(inflight(&policy), 1000.0, "a first token releases nothing");
    policy.finish(&dispatch, t0);
    assert_eq!(inflight(&policy), 1000.0, "finish releases nothing");
    // The live counts still follow select / finish (they feed the cap).
    assert_eq!(policy.worker_stats(ids[0]), Some(WorkerStats::default()));
    let mark = policy.poll_started(ids[0], t0);
    assert_eq!(inflight(&policy), 1000.0, "sending a poll resets nothing");
    policy.select(&ids[..1], &exact(500), t0).unwrap();
    // The queue reported is used as is: 700, nothing subtracted.
    policy.poll_completed(mark, Some(&load(Some(700), 1, Some(2000.0), 0.0)), t0);
    let table = policy.explain(&ids, &exact(1), t0);
    assert_eq!(
        table.value(ids[0], "inflight_tok"),
        Some(0.0),
        "reset on receipt"
    );
    assert_eq!(table.value(ids[0], "queued_tok"), Some(700.0));
    assert_eq!(score(&table, ids[0]), 0.35);
    // No report this time, or a failure: the tally is kept.
    policy.select(&ids[..1], &exact(300), t0).unwrap();
    let mark = policy.poll_started(ids[0], t0);
    policy.poll_completed(mark, None, t0);
    let mark = policy.poll_started(ids[0], t0);
    policy.poll_failed(mark, t0);
    assert_eq!(inflight(&policy), 300.0);
}

#[test]
fn a_removed_worker_is_never_chosen_and_its_marks_are_ignored() {
    let (policy, ids) = fleet(2);
    let t0 = Instant::now();
    let dispatch = policy.select(&ids[..1], &exact(10), t0).unwrap();
    let mark = policy.poll_started(ids[0], t0);
    policy.remove_worker(ids[0]);
    let successor = WorkerId::new(0, 1);
    policy.add_worker(successor, WorkerInfo::new("http://new", "sglang"));
    // Old marks and dispatches touch nothing of the slot's next occupant.
    policy.poll_completed(mark, Some(&load(Some(9999), 9, Some(1.0), 0.0)), t0);
    policy.finish(&dispatch, t0);
    let table = policy.explain(&[successor], &exact(1), t0);
    assert!(table.row(successor).unwrap().note.starts_with("rule 4"));
    for _ in 0..20 {
        let dispatch = policy.select(&[ids[0], ids[1]], &exact(1), t0).unwrap();
        assert_eq!(dispatch.worker, ids[1]);
    }
    assert_eq!(policy.select(&[ids[0]], &exact(1), t0), None);
    assert_eq!(policy.select(&[], &exact(1), t0), None);
}

#[test]
fn power_of_two_picks_the_better_of_two_with_the_same_knobs() {
    // With two workers the pair is the whole fleet: the barrier decides, and
    // its weight is the operator's.
    let t0 = Instant::now();
    for (weight, winner) in [(0.15, 1), (0.0, 0)] {
        let params = LeastLoadParams {
            kv_pressure_weight: weight,
            ..LeastLoadParams::default()
        };
        let (policy, ids) = fleet_with(Pick::PowerOfTwo, params, 2);
        assert_eq!(policy.name(), "power_of_two");
        // 0 s + 0.15 * 0.9 / 0.1 = 1.35 s against 2000 / 2000 = 1 s.
        report(&policy, ids[0], &load(Some(0), 0, Some(2000.0), 0.9), t0);
        report(&policy, ids[1], &load(Some(2000), 2, Some(2000.0), 0.0), t0);
        assert_eq!(
            policy.select(&ids, &exact(1), t0).unwrap().worker,
            ids[winner]
        );
    }
}

#[test]
fn power_of_two_never_picks_the_worst_and_spreads_over_the_rest() {
    let (policy, ids) = fleet_with(Pick::PowerOfTwo, LeastLoadParams::default(), 4);
    let t0 = Instant::now();
    for (id, queued) in ids.iter().zip([0, 1000, 2000, 3000]) {
        report(&policy, *id, &load(Some(queued), 1, Some(2000.0), 0.0), t0);
    }
    let mut wins = [0u32; 4];
    for _ in 0..6000 {
        let dispatch = policy.select(&ids, &exact(1), t0).unwrap();
        wins[dispatch.worker.slot()] += 1;
        policy.finish(&dispatch, t0);
    }
    // Of the 6 equally likely pairs, worker i wins those with a worse one:
    // 3, 2, 1 and 0 of 6, so 3000, 2000, 1000 and 0 expected.
    assert_eq!(wins[3], 0);
    assert!(
        wins[0] > 2700 && wins[1] > 1700 && wins[2] > 800,
        "{wins:?}"
    );
}

#[test]
fn power_of_two_falls_back_to_the_fleet_when_its_samples_are_capped() {
    let (policy, ids) = fleet_with(Pick::PowerOfTwo, capped(1), 5);
    let t0 = Instant::now();
    for id in &ids[..4] {
        report(&policy, *id, &load(Some(0), 5, Some(2000.0), 0.0), t0);
    }
    report(&policy, ids[4], &load(Some(0), 0, Some(2000.0), 0.0), t0);
    for _ in 0..20 {
        let dispatch = policy.select(&ids, &exact(1), t0).unwrap();
        assert_eq!(dispatch.worker, ids[4], "the only uncapped worker");
        policy.finish(&dispatch, t0);
    }
    let held = policy.select(&ids, &exact(1), t0).unwrap();
    assert_eq!(held.worker, ids[4]);
    assert_eq!(policy.select(&ids, &exact(1), t0), None, "all capped");
}

#[test]
fn both_policies_register_and_validate_their_sections() {
    let mut registry = PolicyRegistry::with_baselines();
    register(&mut registry);
    let context = PolicyContext::default();
    for name in ["least_load", "power_of_two"] {
        let policy = registry
            .build(name, &serde_json::Value::Null, &context)
            .unwrap();
        assert_eq!(policy.name(), name);
        assert_eq!(policy.params()["inflight"], "pending");
        let err = registry
            .build(
                name,
                &serde_json::json!({"default_throughput": 0}),
                &context,
            )
            .err()
            .unwrap();
        assert!(
            matches!(&err, PolicyError::InvalidParameter { policy, key: "default_throughput", .. } if policy == name),
            "{err:?}"
        );
    }
    // The simulator's original estimator.
    let original = registry
        .build(
            "least_load",
            &serde_json::json!({"inflight": "since_poll"}),
            &context,
        )
        .unwrap();
    assert_eq!(original.params()["inflight"], "since_poll");
    assert_eq!(original.params()["kv_pressure_weight"], 0.15);
}

fn finish_all(policy: &LeastLoad, dispatches: &[Dispatch], now: Instant) {
    for dispatch in dispatches {
        policy.finish(dispatch, now);
    }
}

#[derive(Debug, Clone)]
enum Op {
    Select {
        tokens: u64,
        first: usize,
        count: usize,
    },
    FirstToken(usize),
    Finish(usize),
    Poll {
        worker: usize,
        queued: Option<u32>,
        waiting: u8,
    },
    PollFailed(usize),
    Remove(usize),
}

fn any_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u64..5000, 0usize..6, 1usize..6)
            .prop_map(|(tokens, first, count)| Op::Select { tokens, first, count }),
        2 => any::<usize>().prop_map(Op::FirstToken),
        2 => any::<usize>().prop_map(Op::Finish),
        2 => (0usize..6, proptest::option::of(0u32..20_000), 0u8..8)
            .prop_map(|(worker, queued, waiting)| Op::Poll { worker, queued, waiting }),
        1 => (0usize..6).prop_map(Op::PollFailed),
        1 => (0usize..6).prop_map(Op::Remove),
    ]
}

fn any_params() -> impl Strategy<Value = LeastLoadParams> {
    (0u64..4, any::<bool>(), any::<bool>()).prop_map(|(cap, since, _)| LeastLoadParams {
        max_waiting_requests: cap,
        inflight: if since {
            InflightMode::SincePoll
        } else {
            InflightMode::Pending
        },
        ..LeastLoadParams::default()
    })
}

proptest! {
    #[test]
    fn select_never_returns_a_vetoed_or_removed_worker(
        params in any_params(),
        p2c in any::<bool>(),
        ops in proptest::collection::vec(any_op(), 1..60),
    ) {
        let strategy = if p2c { Pick::PowerOfTwo } else { Pick::LeastLoad };
        let (policy, ids) = fleet_with(strategy, params, 6);
        let t0 = Instant::now();
        let mut removed = [false; 6];
        let mut dispatches = Vec::new();
        for op in ops {
            match op {
                Op::Select { tokens, first, count } => {
                    let candidates: Vec<WorkerId> = ids.iter().copied().cycle().skip(first).take(count).collect();
                    let table = policy.explain(&candidates, &exact(tokens), t0);
                    let admissible: Vec<WorkerId> = table
                        .rows
                        .iter()
                        .filter(|row| !row.note.contains("capped"))
                        .map(|row| row.worker)
                        .collect();
                    match policy.select(&candidates, &exact(tokens), t0) {
                        Some(dispatch) => {
                            prop_assert!(!removed[dispatch.worker.slot()]);
                            prop_assert!(admissible.contains(&dispatch.worker), "{table}");
                            if strategy == Pick::LeastLoad {
                                prop_assert!(table.chosen.contains(&dispatch.worker), "{table}");
                            }
                            dispatches.push(dispatch);
                        }
                        None => prop_assert!(admissible.is_empty(), "{table}"),
                    }
                }
                Op::FirstToken(index) => {
                    if !dispatches.is_empty() {
                        policy.first_token(&dispatches[index % dispatches.len()], t0);
                    }
                }
                Op::Finish(index) => {
                    if !dispatches.is_empty() {
                        policy.finish(&dispatches[index % dispatches.len()], t0);
                    }
                }
                Op::Poll { worker, queued, waiting } => {
                    let report_load = load(queued.map(i64::from), i64::from(waiting), Some(2000.0), 0.3);
                    report(&policy, ids[worker], &report_load, t0);
                }
                Op::PollFailed(worker) => {
                    let mark = policy.poll_started(ids[worker], t0);
                    policy.poll_failed(mark, t0);
                }
                Op::Remove(worker) => {
                    policy.remove_worker(ids[worker]);
                    removed[worker] = true;
                }
            }
        }
    }

    #[test]
    fn finishing_every_dispatch_returns_all_counts_to_zero(
        params in any_params(),
        p2c in any::<bool>(),
        ops in proptest::collection::vec(any_op(), 1..80),
    ) {
        let strategy = if p2c { Pick::PowerOfTwo } else { Pick::LeastLoad };
        let (policy, ids) = fleet_with(strategy, params, 6);
        let t0 = Instant::now();
        let mut dispatches = Vec::new();
        for op in ops {
            match op {
                Op::Select { tokens, first, count } => {
                    let candidates: Vec<WorkerId> = ids.iter().copied().cycle().skip(first).take(count).collect();
                    dispatches.extend(policy.select(&candidates, &exact(tokens), t0));
                }
                Op::FirstToken(index) if !dispatches.is_empty() => {
                    policy.first_token(&dispatches[index % dispatches.len()], t0);
                }
                Op::Finish(index) if !dispatches.is_empty() => {
                    policy.finish(&dispatches[index % dispatches.len()], t0);
                }
                Op::Poll { worker, queued, waiting } => {
                    let report_load = load(queued.map(i64::from), i64::from(waiting), None, 0.0);
                    report(&policy, ids[worker], &report_load, t0);
                }
                // Workers stay registered here so that their counts can be read.
                _ => {}
            }
        }
        finish_all(&policy, &dispatches, t0);
        for id in &ids {
            prop_assert_eq!(policy.worker_stats(*id), Some(WorkerStats::default()));
        }
    }
}

#[test]
fn concurrent_selections_never_overshoot_the_cap() {
    const THREADS: usize = 4;
    let t0 = Instant::now();
    // Phase 1: everyone selects at once and nobody finishes: exactly the cap
    // per worker, never more.
    let (policy, ids) = fleet_with(Pick::LeastLoad, capped(3), 2);
    let barrier = std::sync::Barrier::new(THREADS);
    let won: Vec<Vec<Dispatch>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..THREADS)
            .map(|_| {
                scope.spawn(|| {
                    barrier.wait();
                    (0..50)
                        .filter_map(|_| policy.select(&ids, &exact(1), t0))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let won: Vec<Dispatch> = won.into_iter().flatten().collect();
    assert_eq!(won.len(), 6);
    for id in &ids {
        assert_eq!(policy.worker_stats(*id).unwrap().pending_requests, 3);
    }
    finish_all(&policy, &won, t0);

    // Phase 2: with a cap of 1, every thread selects, checks and finishes in
    // a tight loop, some through the single-worker shortcut. A veto checked
    // apart from the credit lets two threads in at once here within a few
    // thousand rounds; the count must never pass 1.
    for p2c in [false, true] {
        let pick = if p2c {
            Pick::PowerOfTwo
        } else {
            Pick::LeastLoad
        };
        let (policy, ids) = fleet_with(pick, capped(1), 2);
        std::thread::scope(|scope| {
            for thread in 0..THREADS {
                let (policy, ids, barrier) = (&policy, &ids, &barrier);
                scope.spawn(move || {
                    barrier.wait();
                    for round in 0..20_000usize {
                        let candidates = if (round + thread) % 3 == 0 {
                            &ids[..1]
                        } else {
                            &ids[..]
                        };
                        if let Some(dispatch) = policy.select(candidates, &exact(1), t0) {
                            let pending = policy
                                .worker_stats(dispatch.worker)
                                .unwrap()
                                .pending_requests;
                            assert!(pending <= 1, "{pending} pending with a cap of 1");
                            policy.finish(&dispatch, t0);
                        }
                    }
                });
            }
        });
        for id in &ids {
            assert_eq!(policy.worker_stats(*id), Some(WorkerStats::default()));
        }
    }
}

// ------------------------------------------------------------ learned rate

fn streamed(tokens: u64) -> RequestInfo {
    exact(tokens).streaming(true)
}

fn rate(policy: &LeastLoad, id: WorkerId, at: Instant) -> f64 {
    policy
        .explain(&[id], &exact(1), at)
        .value(id, "rate_tps")
        .unwrap()
}

/// Sends `count` streamed requests of `tokens` to `id` (alone) one after
/// another, each answered after `tokens / true_tps` seconds; returns the time
/// after the last.
fn serve(
    policy: &LeastLoad,
    id: WorkerId,
    count: usize,
    tokens: u64,
    true_tps: f64,
    mut at: Instant,
) -> Instant {
    for _ in 0..count {
        let dispatch = policy.select(&[id], &streamed(tokens), at).unwrap();
        at += Duration::from_secs_f64(tokens as f64 / true_tps);
        policy.first_token(&dispatch, at);
        policy.finish(&dispatch, at);
        at += Duration::from_millis(100);
    }
    at
}

#[test]
fn each_worker_learns_its_own_rate_and_the_score_divides_by_it() {
    let (policy, ids) = learned_fleet(2);
    let t0 = Instant::now();
    assert_eq!(rate(&policy, ids[0], t0), 2000.0, "the prior");
    let at = serve(&policy, ids[0], 40, 4000, 16_000.0, t0);
    let at = serve(&policy, ids[1], 40, 4000, 4000.0, at);
    let fast = rate(&policy, ids[0], at);
    let slow = rate(&policy, ids[1], at);
    // The fast worker's first sample is clipped (8x the prior), so a trace of
    // it stays.
    assert!((fast / 16_000.0 - 1.0).abs() < 0.03, "fast worker: {fast}");
    // Each first token closes the previous one's sample: 39 of 40.
    assert!((slow / 4000.0 - 1.0).abs() < 0.02, "slow worker: {slow}");
    // The same queue is four times the wait on the slow worker.
    report(&policy, ids[0], &load(Some(8000), 2, Some(50.0), 0.0), at);
    report(&policy, ids[1], &load(Some(8000), 2, Some(50.0), 0.0), at);
    let table = policy.explain(&ids, &exact(100), at);
    // The request's own 100 tokens are part of its wait.
    assert!(close(score(&table, ids[0]), 8100.0 / fast), "{table}");
    assert!(close(score(&table, ids[1]), 8100.0 / slow), "{table}");
    assert!(
        table.rows[0].note.contains("learned from 39 samples"),
        "{table}"
    );
    assert_eq!(table.value(ids[0], "rate_samples"), Some(39.0));
    assert_eq!(policy.select(&ids, &exact(100), at).unwrap().worker, ids[0]);
}

#[test]
fn preview_judges_a_prompt_at_the_rate_of_a_worker_of_another_speed() {
    let (policy, ids) = learned_fleet(2);
    let t0 = Instant::now();
    let at = serve(&policy, ids[0], 40, 4000, 16_000.0, t0);
    let at = serve(&policy, ids[1], 40, 4000, 4000.0, at);
    let fast = rate(&policy, ids[0], at);
    let slow = rate(&policy, ids[1], at);
    let (worker, wait) = policy.preview(&[ids[0]], &exact(8000), at).unwrap();
    assert_eq!(worker, ids[0]);
    // Its own rate, not the fleet's (between the two workers'), which would
    // predict a prefill longer than the fast worker takes.
    assert!(close(wait.prefill_secs, 8000.0 / fast), "{wait:?}");
    let fleet = policy.expected_wait(&ids, &exact(8000), at).unwrap();
    assert!(fleet.prefill_secs > 1.2 * wait.prefill_secs, "{fleet:?}");
    // And shorter than the slow one takes.
    let (_, wait) = policy.preview(&[ids[1]], &exact(8000), at).unwrap();
    assert!(close(wait.prefill_secs, 8000.0 / slow), "{wait:?}");
    assert!(1.2 * fleet.prefill_secs < wait.prefill_secs, "{fleet:?}");
}

#[test]
fn a_peer_learns_a_worker_s_rate_from_another_replica_s_first_tokens() {
    let (policy, ids) = learned_fleet(1);
    let (peer, _) = learned_fleet(1);
    let mut at = Instant::now();
    // 4000-token prompts on an 8000 tok/s worker, through `policy` only;
    // each first token is handed to the peer as sync would, at once.
    for _ in 0..=MIN_SAMPLES_TO_SCORE {
        let dispatch = policy.select(&ids, &streamed(4000), at).unwrap();
        at += Duration::from_millis(500);
        let sample = policy.first_token(&dispatch, at).unwrap();
        assert_eq!(sample.tokens, 4000);
        assert_eq!(sample.foreign_ahead_tokens, 0);
        assert_eq!(sample.waited, Duration::from_millis(500));
        let outcome = peer.replica_update(
            &ReplicaUpdate::Prefill {
                worker_url: "http://w0/",
                sample,
                first_token_at: at,
            },
            at,
        );
        assert_eq!(outcome, ReplicaUpdateOutcome::Applied);
        policy.finish(&dispatch, at);
        at += Duration::from_millis(100);
    }
    // The peer dispatched nothing, yet scores the worker at the rate the
    // first replica learned: each first token closes the one before.
    let table = peer.explain(&ids, &exact(100), at);
    assert_eq!(
        table.value(ids[0], "rate_samples"),
        Some(MIN_SAMPLES_TO_SCORE as f64)
    );
    assert!(
        close(rate(&peer, ids[0], at), rate(&policy, ids[0], at)),
        "{table}"
    );
    // A first token from a worker the peer lacks teaches nothing; one that
    // came before those already learned is dropped.
    let late = |worker_url| ReplicaUpdate::Prefill {
        worker_url,
        sample: PrefillSample {
            tokens: 100_000,
            foreign_ahead_tokens: 0,
            waited: Duration::from_millis(10),
        },
        first_token_at: at - Duration::from_secs(2),
    };
    let elsewhere = peer.replica_update(&late("http://elsewhere"), at);
    assert_eq!(elsewhere, ReplicaUpdateOutcome::UnknownWorker);
    let dropped = peer.replica_update(&late("http://w0"), at);
    assert_eq!(dropped, ReplicaUpdateOutcome::Applied);
    let table = peer.explain(&ids, &exact(100), at);
    assert_eq!(
        table.value(ids[0], "rate_samples"),
        Some(MIN_SAMPLES_TO_SCORE as f64)
    );
}

#[test]
fn replicas_sharing_a_worker_learn_its_rate_from_all_their_first_tokens() {
    // Two replicas send one 2000-token prompt each every 500 ms to an 8000
    // tok/s worker, which computes both in the same steps: their first
    // tokens come together, 500 ms later. Each hears the other's 50 ms
    // late. Alone, each would see 2000 tokens per 500 ms: half the rate.
    let (a, ids) = learned_fleet(1);
    let (b, _) = learned_fleet(1);
    let t0 = Instant::now();
    let step = Duration::from_millis(500);
    let late = Duration::from_millis(50);
    let mut heard: Vec<(Instant, usize, PrefillSample, Instant)> = Vec::new();
    for n in 0..80u32 {
        let sent = t0 + step * n;
        let came = sent + step;
        let dispatches = [
            a.select(&ids, &streamed(2000), sent).unwrap(),
            b.select(&ids, &streamed(2000), sent).unwrap(),
        ];
        // What was heard by now is applied first.
        heard.retain(|(at, to, sample, first_token_at)| {
            if *at > came {
                return true;
            }
            let receiver = if *to == 0 { &a } else { &b };
            receiver.replica_update(
                &ReplicaUpdate::Prefill {
                    worker_url: "http://w0/",
                    sample: *sample,
                    first_token_at: *first_token_at,
                },
                *at,
            );
            false
        });
        for (index, (policy, dispatch)) in [&a, &b].into_iter().zip(&dispatches).enumerate() {
            let sample = policy.first_token(dispatch, came).unwrap();
            heard.push((came + late, 1 - index, sample, came));
            policy.finish(dispatch, came);
        }
    }
    let end = t0 + step * 81;
    for policy in [&a, &b] {
        let learned = rate(policy, ids[0], end);
        assert!((learned / 8000.0 - 1.0).abs() < 0.05, "{learned}");
    }
}

#[test]
fn the_foreign_work_ahead_at_dispatch_counts_in_the_sample() {
    let (policy, ids) = learned_fleet(1);
    let mut at = Instant::now();
    // Each time, 6000 tokens queued by others, then our 2000: 8000 tokens
    // cleared in 1 s. Each first token closes the previous one's sample.
    for _ in 0..=MIN_SAMPLES_TO_SCORE {
        report(&policy, ids[0], &load(Some(6000), 3, None, 0.0), at);
        let dispatch = policy.select(&ids, &streamed(2000), at).unwrap();
        at += Duration::from_secs(1);
        policy.first_token(&dispatch, at);
        policy.finish(&dispatch, at);
        at += Duration::from_secs(5);
    }
    let learned = rate(&policy, ids[0], at);
    // Four samples against a light prior: nearly all the way to 8000.
    assert!(learned > 7500.0 && learned <= 8000.0, "{learned}");
}

#[test]
fn non_streaming_and_unanswered_requests_teach_nothing() {
    let (policy, ids) = learned_fleet(1);
    let t0 = Instant::now();
    // A non-streaming answer's head comes after the whole generation.
    let dispatch = policy.select(&ids, &exact(1000), t0).unwrap();
    policy.first_token(&dispatch, t0 + Duration::from_secs(30));
    policy.finish(&dispatch, t0 + Duration::from_secs(30));
    // A stream cancelled before its first token.
    let dispatch = policy.select(&ids, &streamed(1000), t0).unwrap();
    policy.finish(&dispatch, t0 + Duration::from_secs(5));
    let table = policy.explain(&ids, &exact(1), t0 + Duration::from_secs(30));
    assert_eq!(table.value(ids[0], "rate_tps"), Some(2000.0));
    assert_eq!(table.value(ids[0], "rate_samples"), Some(0.0));
    assert!(
        table.rows[0]
            .note
            .contains("rate: the fleet's while learning (0 of 4 samples)"),
        "{table}"
    );
}

#[test]
fn absurd_samples_are_dropped_and_counted() {
    let (policy, ids) = learned_fleet(1);
    let t0 = Instant::now() + Duration::from_secs(3600);
    // A first token that arrives before its dispatch.
    let dispatch = policy.select(&ids, &streamed(1000), t0).unwrap();
    policy.first_token(&dispatch, t0 - Duration::from_secs(1));
    // A one-token request answered after ten minutes (it closes the first
    // one's sample: nothing elapsed).
    let dispatch = policy.select(&ids, &streamed(1), t0).unwrap();
    policy.first_token(&dispatch, t0 + Duration::from_secs(600));
    // The next first token closes the one-token request's sample.
    let later = t0 + Duration::from_secs(700);
    let dispatch = policy.select(&ids, &streamed(1000), later).unwrap();
    policy.first_token(&dispatch, later + Duration::from_secs(1));
    let table = policy.explain(&ids, &exact(1), later + Duration::from_secs(1));
    assert_eq!(table.value(ids[0], "rate_tps"), Some(2000.0));
    assert!(table.rows[0].note.contains("2 dropped"), "{table}");
}

#[test]
fn a_worker_that_joins_starts_from_the_fleets_learned_rate() {
    let (policy, ids) = learned_fleet(2);
    let t0 = Instant::now();
    let at = serve(&policy, ids[0], 40, 4000, 10_000.0, t0);
    let at = serve(&policy, ids[1], 40, 4000, 40_000.0, at);
    let joined = WorkerId::new(2, 0);
    policy.add_worker(joined, WorkerInfo::new("http://w2", "sglang"));
    // The geometric mean of 10 000 and 40 000.
    let prior = rate(&policy, joined, at);
    assert!((prior / 20_000.0 - 1.0).abs() < 0.05, "{prior}");
}

#[test]
fn the_reported_and_fixed_rates_remain_and_show_what_was_learned() {
    for (mode, expected) in [(RateMode::Reported, 3000.0), (RateMode::Fixed, 2000.0)] {
        let params = LeastLoadParams {
            rate: mode,
            ..LeastLoadParams::default()
        };
        let (policy, ids) = fleet_with(Pick::LeastLoad, params, 1);
        let t0 = Instant::now();
        let at = serve(&policy, ids[0], 20, 4000, 16_000.0, t0);
        report(&policy, ids[0], &load(Some(3000), 3, Some(3000.0), 0.0), at);
        let table = policy.explain(&ids, &exact(100), at);
        assert_eq!(table.value(ids[0], "rate_tps"), Some(expected), "{table}");
        assert!(table.rows[0].note.contains("learned would be"), "{table}");
    }
}

// ---- Other replicas' pending work (replica sync) ----

/// Replica `replica`'s state for worker `w{slot}` as of `seq`.
fn remote(
    policy: &LeastLoad,
    replica: &str,
    slot: u32,
    tokens: u64,
    requests: u64,
    seq: u64,
    at: Instant,
) -> ReplicaPendingOutcome {
    policy.replica_pending(
        &ReplicaPending {
            replica,
            worker_url: &format!("http://w{slot}"),
            pending_tokens: tokens,
            pending_requests: requests,
            seq,
        },
        at,
    )
}

#[test]
fn other_replicas_pending_work_counts_in_flight() {
    let (policy, ids) = fleet(2);
    let t0 = Instant::now();
    report(&policy, ids[0], &load(Some(0), 0, Some(2000.0), 0.0), t0);
    report(&policy, ids[1], &load(Some(0), 0, Some(2000.0), 0.0), t0);
    assert_eq!(
        remote(&policy, "b", 0, 4000, 2, 1, t0),
        ReplicaPendingOutcome::Applied
    );
    let table = policy.explain(&ids, &exact(100), t0);
    // 4000 tokens another replica sent, at 2000 tok/s: 2 s.
    assert_eq!(score(&table, ids[0]), 2.0, "{table}");
    assert_eq!(table.value(ids[0], "inflight_tok"), Some(4000.0));
    assert_eq!(table.value(ids[0], "remote_tok"), Some(4000.0));
    assert_eq!(table.value(ids[0], "remote_req"), Some(2.0));
    assert_eq!(table.value(ids[1], "remote_tok"), Some(0.0));
    assert!(table.rows[0].note.contains("remote: 1 replicas"), "{table}");
    for _ in 0..3 {
        let dispatch = policy.select(&ids, &exact(100), t0).unwrap();
        assert_eq!(
            dispatch.worker, ids[1],
            "the other replica's worker is avoided"
        );
    }
    // What this replica publishes is its own work only.
    assert_eq!(policy.worker_stats(ids[0]).unwrap().pending_tokens, 0);
    assert_eq!(policy.worker_stats(ids[1]).unwrap().pending_tokens, 300);
}

#[test]
fn every_replicas_pending_work_at_poll_send_is_subtracted_from_the_queue() {
    let (policy, ids) = fleet(1);
    let t0 = Instant::now();
    remote(&policy, "b", 0, 3000, 1, 1, t0);
    let ours = policy.select(&ids, &exact(1000), t0).unwrap();
    let mark = policy.poll_started(ids[0], t0);
    assert_eq!(
        (mark.pending_tokens, mark.remote_pending_tokens),
        (1000, 3000)
    );
    // The other replica's request got its first token while the poll was out.
    remote(&policy, "b", 0, 0, 0, 2, t0);
    // The engine queues 5000 tokens: ours, the other replica's, and 1000 nobody sent.
    let at = t0 + Duration::from_millis(10);
    policy.poll_completed(mark, Some(&load(Some(5000), 3, Some(2000.0), 0.0)), at);
    let table = policy.explain(&ids, &exact(100), at);
    assert_eq!(table.value(ids[0], "queued_tok"), Some(1000.0), "{table}");
    assert_eq!(table.value(ids[0], "inflight_tok"), Some(1000.0), "{table}");
    assert_eq!(score(&table, ids[0]), 1.0, "{table}");
    policy.finish(&ours, at);
}

#[test]
fn the_cap_counts_other_replicas_pending_requests() {
    let (policy, ids) = fleet_with(Pick::LeastLoad, capped(3), 2);
    let t0 = Instant::now();
    remote(&policy, "b", 0, 300, 2, 1, t0);
    remote(&policy, "c", 0, 100, 1, 1, t0);
    let table = policy.explain(&ids, &exact(100), t0);
    assert_eq!(table.value(ids[0], "waiting_req"), Some(3.0), "{table}");
    assert!(table.rows[0].note.contains("capped"), "{table}");
    for _ in 0..3 {
        assert_eq!(policy.select(&ids, &exact(100), t0).unwrap().worker, ids[1]);
    }
    assert!(
        policy.select(&ids, &exact(100), t0).is_none(),
        "both workers at the cap"
    );
}

#[test]
fn out_of_order_and_repeated_entries_are_ignored() {
    let (policy, ids) = fleet(1);
    let t0 = Instant::now();
    assert_eq!(
        remote(&policy, "b", 0, 500, 1, 10, t0),
        ReplicaPendingOutcome::Applied
    );
    assert_eq!(
        remote(&policy, "b", 0, 900, 2, 9, t0),
        ReplicaPendingOutcome::Stale
    );
    assert_eq!(
        remote(&policy, "b", 0, 900, 2, 10, t0),
        ReplicaPendingOutcome::Stale,
        "delivered twice"
    );
    // Each replica has its own sequence.
    assert_eq!(
        remote(&policy, "c", 0, 200, 1, 3, t0),
        ReplicaPendingOutcome::Applied
    );
    let table = policy.explain(&ids, &exact(1), t0);
    assert_eq!(table.value(ids[0], "remote_tok"), Some(700.0), "{table}");
    // A newer state replaces the old one whole: it is not added to it.
    remote(&policy, "b", 0, 100, 1, 11, t0);
    let table = policy.explain(&ids, &exact(1), t0);
    assert_eq!(table.value(ids[0], "remote_tok"), Some(300.0), "{table}");
}

#[test]
fn workers_are_matched_by_url_and_unknown_ones_ignored() {
    let (policy, ids) = fleet(1);
    let t0 = Instant::now();
    let entry = |url| ReplicaPending {
        replica: "b",
        worker_url: url,
        pending_tokens: 100,
        pending_requests: 1,
        seq: 1,
    };
    assert_eq!(
        policy.replica_pending(&entry("http://w0/"), t0),
        ReplicaPendingOutcome::Applied,
        "a trailing slash names the same worker"
    );
    assert_eq!(
        policy.replica_pending(&entry("http://elsewhere:1"), t0),
        ReplicaPendingOutcome::UnknownWorker
    );
    // A removed worker's URL is no longer known.
    policy.remove_worker(ids[0]);
    assert_eq!(
        policy.replica_pending(&entry("http://w0"), t0),
        ReplicaPendingOutcome::UnknownWorker
    );
    // The baselines do not count other replicas' work.
    let baseline = PolicyRegistry::with_baselines()
        .build(
            "round_robin",
            &serde_json::Value::Null,
            &PolicyContext::default(),
        )
        .unwrap();
    baseline.add_worker(ids[0], WorkerInfo::new("http://w0", "sglang"));
    assert_eq!(
        baseline.replica_pending(&entry("http://w0"), t0),
        ReplicaPendingOutcome::Unsupported
    );
}

#[tokio::test(start_paused = true)]
async fn a_replica_that_stops_publishing_is_dropped_after_the_ttl() {
    let (policy, ids) = fleet(1);
    let ttl = Duration::from_millis(1000);
    let now = policy_core::tokio_now;
    remote(&policy, "b", 0, 400, 1, 1, now());
    remote(&policy, "c", 0, 600, 2, 1, now());
    tokio::time::advance(Duration::from_millis(600)).await;
    // c keeps publishing; b has gone quiet.
    remote(&policy, "c", 0, 600, 2, 2, now());
    assert_eq!(policy.expire_replica_pending(now(), ttl), 0);
    let table = policy.explain(&ids, &exact(1), now());
    assert_eq!(table.value(ids[0], "remote_tok"), Some(1000.0), "{table}");
    assert_eq!(table.value(ids[0], "remote_age_s"), Some(0.6), "{table}");
    tokio::time::advance(Duration::from_millis(401)).await;
    assert_eq!(policy.expire_replica_pending(now(), ttl), 1, "b expires");
    let table = policy.explain(&ids, &exact(1), now());
    assert_eq!(table.value(ids[0], "remote_tok"), Some(600.0), "{table}");
    assert!(
        close(table.value(ids[0], "remote_age_s").unwrap(), 0.401),
        "{table}"
    );
    tokio::time::advance(Duration::from_millis(1000)).await;
    assert_eq!(policy.expire_replica_pending(now(), ttl), 1, "c expires");
    let table = policy.explain(&ids, &exact(1), now());
    assert_eq!(table.value(ids[0], "remote_tok"), Some(0.0), "{table}");
    assert_eq!(table.value(ids[0], "remote_age_s"), Some(0.0), "{table}");
    assert!(!table.rows[0].note.contains("remote"), "{table}");
}

#[test]
fn since_poll_does_not_count_other_replicas() {
    let (policy, ids) = fleet_with(Pick::LeastLoad, since_poll(), 1);
    let t0 = Instant::now();
    report(&policy, ids[0], &load(Some(0), 0, Some(2000.0), 0.0), t0);
    remote(&policy, "b", 0, 4000, 2, 1, t0);
    let table = policy.explain(&ids, &exact(1), t0);
    assert_eq!(table.value(ids[0], "inflight_tok"), Some(0.0), "{table}");
    assert_eq!(table.value(ids[0], "remote_tok"), Some(4000.0), "{table}");
    assert!(table.rows[0].note.contains("not counted"), "{table}");
}

#[test]
fn power_of_two_counts_other_replicas_too() {
    let (policy, ids) = fleet_with(Pick::PowerOfTwo, reported(), 2);
    let t0 = Instant::now();
    remote(&policy, "b", 1, 8000, 4, 1, t0);
    for _ in 0..4 {
        assert_eq!(policy.select(&ids, &exact(100), t0).unwrap().worker, ids[0]);
    }
}

/// The filtered two-pass argmin against the one-pass one, on fleets built
/// so that exact ties and ties at the edge of the tolerance are common.
mod filtered_argmin {
    use std::time::{Duration, Instant};

    use policy_core::{Policy, PolicyContext, PrefixBlocks, RequestInfo, TokenCount, WorkerId};
    use proptest::prelude::*;

    use super::{load, report};
    use crate::{LeastLoad, LeastLoadParams, RateMode, Strategy as Pick};

    /// One worker: its report (queue on a 5-token grid, 2.5 ms at 2000
    /// tok/s; `None`: never reported), KV usage, whether the report is
    /// stale, and how many 100-token dispatches it holds.
    type Worker = (Option<i64>, f64, bool, u8);

    pub(super) fn worker() -> impl Strategy<Value = Worker> {
        (
            proptest::option::weighted(0.9, (0i64..16).prop_map(|step| step * 5)),
            prop_oneof![4 => Just(0.0), 1 => Just(0.5)],
            proptest::bool::weighted(0.1),
            0u8..3,
        )
    }

    pub(super) fn build(
        params: &LeastLoadParams,
        workers: &[Worker],
        t0: Instant,
    ) -> (LeastLoad, Vec<WorkerId>) {
        let policy = LeastLoad::new(Pick::LeastLoad, *params, &PolicyContext::default()).unwrap();
        let ids: Vec<WorkerId> = (0..workers.len() as u32)
            .map(|slot| WorkerId::new(slot, 0))
            .collect();
        let stale_at = t0 - Duration::from_secs(3600);
        for (id, (queued, kv, stale, _)) in ids.iter().zip(workers) {
            policy.add_worker(
                *id,
                policy_core::WorkerInfo::new(format!("http://w{}", id.slot()), "sglang"),
            );
            if let Some(queued) = queued {
                let at = if *stale { stale_at } else { t0 };
                report(&policy, *id, &load(Some(*queued), 1, Some(2000.0), *kv), at);
            }
        }
        // Dispatches pinned to one worker each (a one-candidate selection).
        for (id, (_, _, _, held)) in ids.iter().zip(workers) {
            for _ in 0..*held {
                policy.select(&[*id], &RequestInfo::new(TokenCount::Exact(100)), t0);
            }
        }
        (policy, ids)
    }

    pub(super) fn prompt(group: u64) -> RequestInfo {
        let hashes: Vec<u64> = (1..=32u64).map(|block| group * 1000 + block).collect();
        RequestInfo::new(TokenCount::Exact(512)).prefix_blocks(PrefixBlocks::new(16, hashes))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]

        #[test]
        fn the_filtered_choice_and_draws_are_the_one_pass_ones(
            workers in prop::collection::vec(worker(), 2..90),
            tolerance_secs in prop_oneof![Just(0.0), Just(0.0025), Just(0.01), 0.0f64..0.03],
            reported_rate in any::<bool>(),
            cap in prop_oneof![3 => Just(0u64), 1 => 2u64..4],
            tokens in prop_oneof![Just(0u64), Just(10), 1u64..5000],
            prompts in prop::collection::vec((0u64..3, 0usize..90), 0..4),
        ) {
            let params = LeastLoadParams {
                tie_tolerance_secs: tolerance_secs,
                rate: if reported_rate { RateMode::Reported } else { RateMode::Learned },
                max_waiting_requests: cap,
                prefix_index_block_tokens: 16,
                ..LeastLoadParams::default()
            };
            let t0 = Instant::now();
            let (filtered, ids) = build(&params, &workers, t0);
            let (one_pass, _) = build(&params, &workers, t0);
            // Prompts recorded on some workers, so some candidates hold a prefix.
            for (group, worker) in &prompts {
                let id = ids[worker % ids.len()];
                filtered.select(&[id], &prompt(*group), t0);
                one_pass.select(&[id], &prompt(*group), t0);
            }
            let now = t0 + Duration::from_millis(1);
            for request in [RequestInfo::new(TokenCount::Exact(tokens)), prompt(0), prompt(1)] {
                prop_assert_eq!(
                    filtered.choice_for_test(&ids, &request, now, true),
                    one_pass.choice_for_test(&ids, &request, now, false)
                );
            }
        }
    }
}

/// Idle fleets, where most candidates tie and the filter's estimates alone
/// decide the tie set (`LeastLoad::estimates_decide`), against
/// the one-pass rule, selection after selection as the clock moves.
mod sure_ties {
    use std::time::{Duration, Instant};

    use policy_core::{Policy, RequestInfo, TokenCount};
    use proptest::prelude::*;

    use super::filtered_argmin::build;
    use crate::LeastLoadParams;
    use crate::policy::SURE_RULES;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(100))]

        #[test]
        fn an_idle_fleet_is_decided_as_the_one_pass_rule_decides(
            workers in 2usize..200,
            busy in prop::collection::vec((0usize..200, 0i64..4), 0..8),
            tolerance_secs in prop_oneof![Just(0.0025), Just(0.01), 0.0001f64..0.03],
            sizes in prop::collection::vec(prop_oneof![Just(0u64), 1u64..3000], 1..40),
            ticks_ns in prop_oneof![Just(0u64), Just(1), 1u64..2_000_000],
        ) {
            let params = LeastLoadParams {
                tie_tolerance_secs: tolerance_secs,
                ..LeastLoadParams::default()
            };
            // Every worker idle but a few with a short queue.
            let mut fleet = vec![(Some(0i64), 0.0, false, 0u8); workers];
            for (worker, steps) in &busy {
                fleet[worker % workers].0 = Some(steps * 5);
            }
            let t0 = Instant::now();
            let (filtered, ids) = build(&params, &fleet, t0);
            let (one_pass, _) = build(&params, &fleet, t0);
            let mut now = t0;
            for tokens in &sizes {
                now += Duration::from_nanos(ticks_ns);
                let request = RequestInfo::new(TokenCount::Exact(*tokens));
                let choice = filtered.choice_for_test(&ids, &request, now, true);
                prop_assert_eq!(choice, one_pass.choice_for_test(&ids, &request, now, false));
                // Both dispatch to the chosen worker, so last dispatch times
                // and pending work move as under traffic.
                if let (Some((index, _)), _) = choice {
                    filtered.select(&[ids[index]], &request, now);
                    one_pass.select(&[ids[index]], &request, now);
                }
            }
        }
    }

    /// Workers a picosecond beyond the tie tolerance of the best one are
    /// within the filter's margin, yet left out of the tie set: the best
    /// one wins every time (were they in it, each would win a draw 15
    /// times in 16).
    #[test]
    fn a_worker_just_beyond_the_tolerance_never_ties() {
        let params = LeastLoadParams {
            // 20 tokens at 2000 tok/s is 0.01 s.
            tie_tolerance_secs: 0.01 - 1e-12,
            rate: crate::RateMode::Reported,
            ..LeastLoadParams::default()
        };
        let t0 = Instant::now();
        let mut fleet = vec![(Some(20), 0.0, false, 0); 16];
        fleet[0].0 = Some(0);
        let (policy, ids) = build(&params, &fleet, t0);
        for tokens in [0, 1, 7, 300] {
            let request = RequestInfo::new(TokenCount::Exact(tokens));
            let (choice, _) = policy.choice_for_test(&ids, &request, t0, true);
            assert_eq!(choice.map(|(index, _)| index), Some(0), "{tokens} tokens");
        }
    }

    /// On an idle fleet the estimates decide every selection, and each
    /// goes to a worker not yet dispatched to (the one dispatched to has a
    /// request's work ahead, beyond the tie tolerance).
    #[test]
    fn an_idle_fleet_is_decided_by_the_estimates() {
        let params = LeastLoadParams::default();
        let t0 = Instant::now();
        let (policy, ids) = build(&params, &[(Some(0), 0.0, false, 0); 64], t0);
        let sure_before = SURE_RULES.with(|count| count.get());
        let mut chosen = std::collections::HashSet::new();
        for tick in 1..=40u64 {
            let now = t0 + Duration::from_micros(tick);
            let dispatch = policy
                .select(&ids, &RequestInfo::new(TokenCount::Exact(200)), now)
                .unwrap();
            assert!(
                chosen.insert(dispatch.worker),
                "{:?} chosen twice",
                dispatch.worker
            );
        }
        assert_eq!(SURE_RULES.with(|count| count.get()) - sure_before, 40);
    }
}

/// The argmin that prices the congestion only when the tie set may depend
/// on it, against the one that always prices it.
mod lazy_pricing {
    use std::time::{Duration, Instant};

    use policy_core::{Policy, RequestInfo, TokenCount, WorkerId};
    use proptest::prelude::*;

    use super::filtered_argmin::{build, worker};
    use crate::{LeastLoadParams, RateMode};

    /// A 512-token prompt whose first `shared` of 32 blocks are those of
    /// `group`'s.
    fn prompt(group: u64, shared: u64) -> RequestInfo {
        let hashes: Vec<u64> = (1..=32u64)
            .map(|block| {
                if block <= shared {
                    group * 1000 + block
                } else {
                    1_000_000 + group * 100_000 + shared * 100 + block
                }
            })
            .collect();
        RequestInfo::new(TokenCount::Exact(512))
            .prefix_blocks(policy_core::PrefixBlocks::new(16, hashes))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        #[test]
        fn the_lazily_priced_choice_and_draws_are_the_priced_ones(
            workers in prop::collection::vec(worker(), 2..40),
            tolerance_secs in prop_oneof![Just(0.0), Just(0.0025), Just(0.01), 0.0f64..0.03],
            reported_rate in any::<bool>(),
            congestion_weight in prop_oneof![Just(0.0), Just(4.0), 0.0f64..20.0],
            miss_weight in prop_oneof![Just(1.0), 0.0f64..3.0],
            prompts in prop::collection::vec((0u64..3, 1u64..=32, 0usize..40), 0..8),
            rounds in prop::collection::vec((0u64..3, 1u64..=32, 1usize..40), 1..6),
        ) {
            let params = LeastLoadParams {
                tie_tolerance_secs: tolerance_secs,
                rate: if reported_rate { RateMode::Reported } else { RateMode::Learned },
                prefix_index_block_tokens: 16,
                prefix_congestion_weight: congestion_weight,
                prefix_miss_weight: miss_weight,
                ..LeastLoadParams::default()
            };
            let t0 = Instant::now();
            let (lazy, ids) = build(&params, &workers, t0);
            let (eager, _) = build(&params, &workers, t0);
            // Prompts recorded on some workers, so some candidates hold a
            // prefix, some of them only part of what others hold.
            for (group, shared, worker) in &prompts {
                let id = ids[worker % ids.len()];
                for policy in [&lazy, &eager] {
                    policy.select(&[id], &prompt(*group, *shared), t0);
                }
            }
            // Selections over the first `count` workers, each then made on
            // both, so the fleets move on alike.
            for (round, (group, shared, count)) in rounds.iter().enumerate() {
                let now = t0 + Duration::from_millis(1 + round as u64);
                let candidates: Vec<WorkerId> = ids.iter().copied().take(*count).collect();
                let requests = [
                    RequestInfo::new(TokenCount::Exact(300)),
                    prompt(*group, 32),
                    prompt(*group, *shared),
                ];
                for request in &requests {
                    prop_assert_eq!(
                        lazy.priced_choice_for_test(&candidates, request, now, true),
                        eager.priced_choice_for_test(&candidates, request, now, false)
                    );
                }
                let chosen: Vec<_> = [&lazy, &eager]
                    .iter()
                    .map(|policy| {
                        policy.select(&candidates, &requests[2], now).map(|d| d.worker)
                    })
                    .collect();
                prop_assert_eq!(chosen[0], chosen[1]);
            }
        }
    }
}

/// The one-pass tie rule against the rule written out plainly.
mod tie_rule {
    use policy_core::{ArgMin, TieBreaker};
    use proptest::prelude::*;

    use crate::policy::TieRule;

    /// Every finite score within the tolerance of the lowest is a tie; the
    /// least recently dispatched tie wins; equally old ones are drawn from
    /// in candidate order.
    fn reference(
        candidates: &[(f64, i64)],
        tolerance_secs: f64,
        rng: &TieBreaker,
    ) -> Option<usize> {
        let lowest_secs = candidates
            .iter()
            .map(|(score, _)| *score)
            .filter(|score| score.is_finite())
            .fold(f64::INFINITY, f64::min);
        let within_secs = lowest_secs + tolerance_secs;
        let mut oldest = ArgMin::new();
        for (index, (score, last_dispatch)) in candidates.iter().enumerate() {
            if score.is_finite() && *score <= within_secs {
                oldest.offer(index, *last_dispatch, rng);
            }
        }
        oldest.best().map(|(index, _)| index)
    }

    fn one_pass(candidates: &[(f64, i64)], tolerance_secs: f64, rng: &TieBreaker) -> Option<usize> {
        let mut rule = TieRule::new(tolerance_secs);
        for (index, (score, last_dispatch)) in candidates.iter().enumerate() {
            rule.offer(index, *score, || *last_dispatch);
        }
        rule.choose(rng).map(|tie| tie.index)
    }

    /// [`one_pass`], skipping the offer of every candidate behind the
    /// oldest kept one, as the selection's scan does.
    fn one_pass_skipping_behind(
        candidates: &[(f64, i64)],
        tolerance_secs: f64,
        rng: &TieBreaker,
    ) -> Option<usize> {
        let mut rule = TieRule::new(tolerance_secs);
        for (index, (score, last_dispatch)) in candidates.iter().enumerate() {
            if rule.behind_after_nanos(*score) < *last_dispatch {
                continue;
            }
            rule.offer(index, *score, || *last_dispatch);
        }
        rule.choose(rng).map(|tie| tie.index)
    }

    /// Scores on a grid of a quarter of the default tolerance, so exact ties
    /// and ties at the edge of the tolerance are common, with some off the
    /// grid and some unusable.
    fn score() -> impl Strategy<Value = f64> {
        prop_oneof![
            8 => (0u32..24).prop_map(|step| f64::from(step) * 0.0025),
            2 => 0.0f64..0.06,
            1 => Just(f64::NAN),
            1 => Just(f64::INFINITY),
            1 => Just(f64::MAX),
        ]
    }

    /// Few distinct ages, never-dispatched included, so draws are common.
    fn last_dispatch() -> impl Strategy<Value = i64> {
        prop_oneof![1 => Just(i64::MIN), 4 => 0i64..4]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3000))]

        #[test]
        fn the_one_pass_choice_and_draws_are_the_rules(
            candidates in prop::collection::vec((score(), last_dispatch()), 0..160),
            tolerance_secs in prop_oneof![Just(0.0), Just(0.0025), Just(0.01), 0.0f64..0.03],
            seed in any::<u64>(),
        ) {
            let (rng, reference_rng) = (TieBreaker::new(seed), TieBreaker::new(seed));
            prop_assert_eq!(
                one_pass(&candidates, tolerance_secs, &rng),
                reference(&candidates, tolerance_secs, &reference_rng)
            );
            // The same draws were taken: the generators are still in step.
            prop_assert_eq!(rng.next_u64(), reference_rng.next_u64());
            let skipping_rng = TieBreaker::new(seed);
            let reference_rng = TieBreaker::new(seed);
            prop_assert_eq!(
                one_pass_skipping_behind(&candidates, tolerance_secs, &skipping_rng),
                reference(&candidates, tolerance_secs, &reference_rng)
            );
            prop_assert_eq!(skipping_rng.next_u64(), reference_rng.next_u64());
        }
    }

    #[test]
    fn a_tie_wider_than_the_stack_is_drawn_uniformly() {
        // 96 candidates all tied and equally old: kept past the stack.
        let candidates = vec![(0.5, 7); 96];
        let rng = TieBreaker::new(3);
        let mut wins = vec![0u32; candidates.len()];
        for _ in 0..96 * 200 {
            let chosen = one_pass(&candidates, 0.01, &rng).unwrap();
            wins[chosen] += 1;
        }
        assert!(wins.iter().all(|w| (120..=290).contains(w)), "{wins:?}");
        // The oldest wins outright wherever it stands, and nothing is chosen
        // from nothing.
        let mut candidates = candidates;
        candidates[77].1 = 3;
        assert_eq!(one_pass(&candidates, 0.01, &rng), Some(77));
        assert_eq!(one_pass(&[], 0.01, &rng), None);
        assert_eq!(one_pass(&[(f64::NAN, 0)], 0.01, &rng), None);
    }
}

/// A 6400-token prompt in 400 blocks of 16 tokens, all of them `salt`'s.
fn prefixed(salt: u64) -> RequestInfo {
    let hashes: Vec<u64> = (1..=400).map(|i| salt * 1000 + i).collect();
    exact(6400).prefix_blocks(policy_core::PrefixBlocks::new(16, hashes))
}

/// Two idle workers at the fleet's prior rate (2000 tok/s); the first
/// request of a prefix goes to one of them, and is done. Returns the worker
/// holding the prefix, then the other.
fn one_prefix_served(params: LeastLoadParams, at: Instant) -> (LeastLoad, WorkerId, WorkerId) {
    let (policy, ids) = fleet_with(Pick::LeastLoad, params, 2);
    report(&policy, ids[0], &load(Some(0), 0, None, 0.0), at);
    report(&policy, ids[1], &load(Some(0), 0, None, 0.0), at);
    let first = policy.select(&ids, &prefixed(7), at).unwrap();
    policy.finish(&first, at);
    let other = if first.worker == ids[0] {
        ids[1]
    } else {
        ids[0]
    };
    (policy, first.worker, other)
}

#[test]
fn a_prefix_miss_is_charged_the_tokens_it_recomputes() {
    let t0 = Instant::now();
    let (policy, holder, other) = one_prefix_served(LeastLoadParams::default(), t0);
    let ids = [holder, other];
    let table = policy.explain(&ids, &prefixed(7), t0);
    // The holder keeps all but the last token; elsewhere the request is
    // 6400 tokens of its own plus 1 × the 6399 the holder would not
    // recompute (both workers are idle: no congestion).
    assert_eq!(table.value(holder, "cached_tok"), Some(6399.0));
    assert_eq!(table.value(holder, "request_tok"), Some(1.0));
    assert_eq!(table.value(other, "cached_tok"), Some(0.0));
    assert_eq!(table.value(other, "request_tok"), Some(6400.0 + 6399.0));
    // Another prefix is charged nothing anywhere.
    let table = policy.explain(&ids, &prefixed(8), t0);
    assert_eq!(table.value(holder, "request_tok"), Some(6400.0));
    assert_eq!(table.value(other, "request_tok"), Some(6400.0));
}

#[test]
fn a_preview_tells_what_the_chosen_worker_s_cache_saves() {
    let t0 = Instant::now();
    let (policy, holder, other) = one_prefix_served(LeastLoadParams::default(), t0);
    let (chosen, wait) = policy.preview(&[holder, other], &prefixed(7), t0).unwrap();
    assert_eq!(chosen, holder);
    // All but the last of its 6400 tokens, at the 2000 tok/s prior.
    assert!(close(wait.prefill_secs, 3.2), "{wait:?}");
    assert!(close(wait.cached_prefill_secs, 6399.0 / 2000.0), "{wait:?}");
    // Where it is not cached, and for the fleet as a whole, nothing.
    let (_, elsewhere) = policy.preview(&[other], &prefixed(7), t0).unwrap();
    assert_eq!(elsewhere.cached_prefill_secs, 0.0);
    let fleet = policy
        .expected_wait(&[holder, other], &prefixed(7), t0)
        .unwrap();
    assert_eq!(fleet.cached_prefill_secs, 0.0);
}

#[test]
fn the_miss_charge_keeps_a_prefix_where_it_is_cached_until_the_queue_outweighs_it() {
    for (miss_weight, stays) in [(2.0, true), (0.0, false)] {
        let t0 = Instant::now();
        let params = LeastLoadParams {
            prefix_miss_weight: miss_weight,
            ..LeastLoadParams::default()
        };
        let (policy, holder, other) = one_prefix_served(params, t0);
        // The holder has 10 000 tokens queued: 5 s at 2000 tok/s, against
        // 3.2 s for the whole prompt elsewhere, and 9.6 s with the charge.
        let t1 = t0 + Duration::from_millis(10);
        report(&policy, holder, &load(Some(10_000), 2, None, 0.0), t1);
        report(&policy, other, &load(Some(0), 0, None, 0.0), t1);
        let chosen = policy.select(&[holder, other], &prefixed(7), t1).unwrap();
        let expected = if stays { holder } else { other };
        assert_eq!(
            chosen.worker, expected,
            "prefix_miss_weight = {miss_weight}"
        );
    }
}

#[test]
fn the_miss_charge_grows_with_the_least_busy_workers_queue() {
    let t0 = Instant::now();
    let (policy, holder, other) = one_prefix_served(LeastLoadParams::default(), t0);
    let ids = [holder, other];
    // Both busy: the floor is the other's 4000 tokens, 2 s at the 2000 tok/s
    // prior; the whole prompt takes 3.2 s there, so the weight is
    // 1 + 4 × 2 / 3.2 = 3.5.
    let t1 = t0 + Duration::from_millis(10);
    report(&policy, holder, &load(Some(12_000), 3, None, 0.0), t1);
    report(&policy, other, &load(Some(4000), 1, None, 0.0), t1);
    let table = policy.explain(&ids, &prefixed(7), t1);
    assert_eq!(table.value(holder, "request_tok"), Some(1.0));
    assert_eq!(
        table.value(other, "request_tok"),
        Some(6400.0 + (3.5f64 * 6399.0).floor())
    );
    // Zero congestion weight: the fixed charge.
    let params = LeastLoadParams {
        prefix_congestion_weight: 0.0,
        ..LeastLoadParams::default()
    };
    let (policy, holder, other) = one_prefix_served(params, t0);
    report(&policy, holder, &load(Some(12_000), 3, None, 0.0), t1);
    report(&policy, other, &load(Some(4000), 1, None, 0.0), t1);
    let table = policy.explain(&[holder, other], &prefixed(7), t1);
    assert_eq!(table.value(other, "request_tok"), Some(6400.0 + 6399.0));
}

#[test]
fn a_busy_holder_keeps_its_prefix_only_while_every_worker_is_busy() {
    // The holder has 40 000 tokens queued (20 s at 2000 tok/s). Against an
    // idle worker the miss costs its recompute only (6400 + 6399 tokens,
    // 6.4 s): the request moves. Against a worker with 20 000 queued (10 s)
    // the fleet has no idle capacity: the weight is 1 + 4 × 10 / 3.2 = 13.5,
    // and the request stays where its prefix is cached. A fixed charge
    // would have moved it there too (10 + 6.4 s < 20 s).
    for (other_queued, congestion_weight, stays) in
        [(0, 4.0, false), (20_000, 4.0, true), (20_000, 0.0, false)]
    {
        let t0 = Instant::now();
        let params = LeastLoadParams {
            prefix_congestion_weight: congestion_weight,
            ..LeastLoadParams::default()
        };
        let (policy, holder, other) = one_prefix_served(params, t0);
        let t1 = t0 + Duration::from_millis(10);
        report(&policy, holder, &load(Some(40_000), 6, None, 0.0), t1);
        report(&policy, other, &load(Some(other_queued), 3, None, 0.0), t1);
        let chosen = policy.select(&[holder, other], &prefixed(7), t1).unwrap();
        let expected = if stays { holder } else { other };
        assert_eq!(
            chosen.worker, expected,
            "other queued {other_queued}, congestion weight {congestion_weight}"
        );
    }
}

/// A second replica's policy over the same two workers (the same URLs),
/// with their loads reported at `at`.
fn peer_of(ids: &[WorkerId], at: Instant) -> LeastLoad {
    let (peer, peer_ids) = fleet_with(Pick::LeastLoad, LeastLoadParams::default(), 2);
    assert_eq!(peer_ids, ids);
    for id in ids {
        report(&peer, *id, &load(Some(0), 0, None, 0.0), at);
    }
    peer
}

#[test]
fn a_placement_from_another_replica_is_found_as_if_dispatched_here() {
    let t0 = Instant::now();
    let (policy, holder, other) = one_prefix_served(LeastLoadParams::default(), t0);
    let ids = [holder, other];
    let peer = peer_of(&policy_ids(holder, other), t0);
    // Before: the peer expects the prefix nowhere.
    let before = peer.explain(&ids, &prefixed(7), t0);
    assert_eq!(before.value(holder, "cached_tok"), Some(0.0));
    // The placement is the prompt at the index's 256-token blocks: 25 of them.
    let placed = policy.placement(&prefixed(7)).unwrap();
    assert_eq!(placed.block_tokens(), 256);
    assert_eq!(placed.hashes().len(), 25);
    let outcome = peer.replica_update(
        &ReplicaUpdate::Placed {
            worker_url: &format!("http://w{}/", holder.slot()),
            prefix: &placed,
        },
        t0,
    );
    assert_eq!(outcome, ReplicaUpdateOutcome::Applied);
    let after = peer.explain(&ids, &prefixed(7), t0);
    assert_eq!(after.value(holder, "cached_tok"), Some(6399.0));
    assert_eq!(after.value(other, "cached_tok"), Some(0.0));
    let chosen = peer.select(&ids, &prefixed(7), t0).unwrap();
    assert_eq!(chosen.worker, holder);
    assert_eq!(chosen.cached_tokens, 6399);
    // Unknown workers and unprefixed requests.
    let outcome = peer.replica_update(
        &ReplicaUpdate::Placed {
            worker_url: "http://elsewhere",
            prefix: &placed,
        },
        t0,
    );
    assert_eq!(outcome, ReplicaUpdateOutcome::UnknownWorker);
    assert!(policy.placement(&exact(6400)).is_none());
}

/// `[holder, other]` in slot order, as `fleet_with` registers them.
fn policy_ids(a: WorkerId, b: WorkerId) -> Vec<WorkerId> {
    let mut ids = vec![a, b];
    ids.sort_by_key(|id| id.slot());
    ids
}

#[test]
fn policies_without_a_prefix_index_share_nothing() {
    let params = LeastLoadParams {
        prefix_affinity: false,
        ..LeastLoadParams::default()
    };
    let (policy, ids) = fleet_with(Pick::LeastLoad, params, 2);
    assert!(policy.placement(&prefixed(7)).is_none());
    let placed = policy_core::PrefixBlocks::new(256, vec![1, 2, 3]);
    let outcome = policy.replica_update(
        &ReplicaUpdate::Placed {
            worker_url: "http://w0",
            prefix: &placed,
        },
        Instant::now(),
    );
    assert_eq!(outcome, ReplicaUpdateOutcome::Unsupported);
    assert!(policy.prefix_snapshot(Instant::now()).is_none());
    let _ = ids;
    let registry = {
        let mut registry = PolicyRegistry::with_baselines();
        register(&mut registry);
        registry
    };
    let baseline = registry
        .build(
            "round_robin",
            &serde_json::Value::Null,
            &PolicyContext::default(),
        )
        .unwrap();
    assert!(baseline.placement(&prefixed(7)).is_none());
}

/// Serves one distinct 6400-token prompt per salt on `worker`.
fn serve_distinct(policy: &LeastLoad, worker: WorkerId, salts: std::ops::Range<u64>, at: Instant) {
    for salt in salts {
        let dispatch = policy.select(&[worker], &prefixed(salt), at).unwrap();
        policy.finish(&dispatch, at);
    }
}

#[test]
fn a_reported_miss_on_an_old_holding_lowers_the_workers_cache_bound() {
    let t0 = Instant::now();
    let params = LeastLoadParams {
        prefix_cache_tokens: 100_000,
        ..LeastLoadParams::default()
    };
    let (policy, ids) = fleet_with(Pick::LeastLoad, params, 1);
    let worker = ids[0];
    report(&policy, worker, &load(Some(0), 0, None, 0.0), t0);
    serve_distinct(&policy, worker, 1..2, t0);
    // 8 more prompts: the first is 8 × 6400 = 51 200 tokens old, within the
    // 100 000-token bound, so a hit is expected.
    serve_distinct(&policy, worker, 2..10, t0);
    let again = policy.select(&[worker], &prefixed(1), t0).unwrap();
    assert_eq!(again.cached_tokens, 6399);
    // The engine served none of it from cache: it keeps at most 51 200;
    // the bound steps down by a quarter, to 75 000.
    assert_eq!(policy.cache_report(&again, 0, t0), Some(75_000));
    policy.finish(&again, t0);
    // A report is taken once.
    assert_eq!(policy.cache_report(&again, 0, t0), None);
    // The miss counted its 6399 recomputed tokens: prompt 2 is 51 200
    // tokens old. 4 more prompts make it 76 800: past the learned bound,
    // within the configured one.
    serve_distinct(&policy, worker, 10..14, t0);
    let table = policy.explain(&[worker], &prefixed(2), t0);
    assert_eq!(table.value(worker, "cached_tok"), Some(0.0));
    // Prompt 12 (2 prompts old) still is; its hit as predicted, far from
    // the bound, changes nothing.
    let hit = policy.select(&[worker], &prefixed(12), t0).unwrap();
    assert_eq!(hit.cached_tokens, 6399);
    assert_eq!(policy.cache_report(&hit, 6399, t0), None);
    policy.finish(&hit, t0);
}

#[test]
fn a_miss_on_a_prefix_dispatched_moments_ago_is_not_evidence_of_eviction() {
    let t0 = Instant::now();
    let (policy, ids) = fleet_with(Pick::LeastLoad, LeastLoadParams::default(), 1);
    let worker = ids[0];
    report(&policy, worker, &load(Some(0), 0, None, 0.0), t0);
    let first = policy.select(&[worker], &prefixed(1), t0).unwrap();
    // The same prompt right behind it: the engine had not computed it yet.
    let second = policy.select(&[worker], &prefixed(1), t0).unwrap();
    assert_eq!(second.cached_tokens, 6399);
    assert_eq!(policy.cache_report(&second, 0, t0), None);
    policy.finish(&first, t0);
    policy.finish(&second, t0);
    let table = policy.explain(&[worker], &prefixed(1), t0);
    assert_eq!(table.value(worker, "cached_tok"), Some(6399.0));
}

#[test]
fn a_shared_cache_bound_applies_to_the_worker_it_names() {
    let t0 = Instant::now();
    let (policy, holder, other) = one_prefix_served(LeastLoadParams::default(), t0);
    serve_distinct(&policy, holder, 100..104, t0); // 25 600 newer tokens
    let ids = [holder, other];
    let table = policy.explain(&ids, &prefixed(7), t0);
    assert_eq!(table.value(holder, "cached_tok"), Some(6399.0));
    let outcome = policy.replica_update(
        &ReplicaUpdate::CacheBound {
            worker_url: &format!("http://w{}", holder.slot()),
            cache_tokens: 20_000,
        },
        t0,
    );
    assert_eq!(outcome, ReplicaUpdateOutcome::Applied);
    let table = policy.explain(&ids, &prefixed(7), t0);
    assert_eq!(table.value(holder, "cached_tok"), Some(0.0));
    // A bound at or above the configured one clears what was learned.
    policy.replica_update(
        &ReplicaUpdate::CacheBound {
            worker_url: &format!("http://w{}", holder.slot()),
            cache_tokens: u64::MAX,
        },
        t0,
    );
    let table = policy.explain(&ids, &prefixed(7), t0);
    assert_eq!(table.value(holder, "cached_tok"), Some(6399.0));
}

#[test]
fn a_starting_replica_loads_a_running_ones_prefix_index() {
    let t0 = Instant::now();
    let (policy, holder, other) = one_prefix_served(LeastLoadParams::default(), t0);
    serve_distinct(&policy, other, 20..23, t0);
    let snapshot = policy.prefix_snapshot(t0).unwrap();
    assert_eq!(snapshot.block_tokens, 256);
    assert_eq!(snapshot.workers.len(), 2);
    // 25 index blocks of prefix 7, 3 × 25 of the others.
    assert_eq!(snapshot.blocks.len(), 100);
    // The snapshot survives its wire form.
    let json = serde_json::to_string(&snapshot).unwrap();
    let snapshot: policy_core::PrefixSnapshot = serde_json::from_str(&json).unwrap();

    let later = t0 + Duration::from_secs(1);
    let peer = peer_of(&policy_ids(holder, other), later);
    // Cut in two parts, each loaded on its own.
    let (first, second) = snapshot.blocks.split_at(40);
    let part = |blocks: &[policy_core::SnapshotBlock]| policy_core::PrefixSnapshot {
        blocks: blocks.to_vec(),
        ..snapshot.clone()
    };
    assert_eq!(peer.load_prefix_snapshot(&part(first), later), 40);
    assert_eq!(peer.load_prefix_snapshot(&part(second), later), 60);
    let ids = [holder, other];
    for salt in [7, 20, 22] {
        let mine = policy.explain(&ids, &prefixed(salt), t0);
        let theirs = peer.explain(&ids, &prefixed(salt), later);
        for id in ids {
            assert_eq!(
                theirs.value(id, "cached_tok"),
                mine.value(id, "cached_tok"),
                "prefix {salt} on {id:?}"
            );
        }
    }
    // An index of another block size reads other keys: nothing is loaded.
    let block_size_differs = policy_core::PrefixSnapshot {
        block_tokens: 64,
        ..snapshot.clone()
    };
    assert_eq!(peer.load_prefix_snapshot(&block_size_differs, later), 0);
}

#[test]
fn the_fleet_s_expected_wait_is_the_least_of_each_worker_s_token_and_slot_waits() {
    let (policy, ids) = fleet(3);
    let t0 = Instant::now();
    // Worker 0 finishes about ten requests a second: 20 over 2 s.
    for step in 0..20u64 {
        let at = t0 + Duration::from_millis(100 * step);
        let dispatch = policy.select(&ids[..1], &exact(10), at).unwrap();
        policy.finish(&dispatch, at);
    }
    let now = t0 + Duration::from_secs(2);
    // Worker 0: 200 tokens queued (0.1 s) but 40 requests waiting for a
    // batch slot, seconds at its finish rate. Worker 1: 1000 tokens
    // (0.5 s), nothing waiting. Worker 2: 3000 tokens (1.5 s).
    report(
        &policy,
        ids[0],
        &load(Some(200), 40, Some(2000.0), 0.0),
        now,
    );
    report(
        &policy,
        ids[1],
        &load(Some(1000), 0, Some(2000.0), 0.0),
        now,
    );
    report(
        &policy,
        ids[2],
        &load(Some(3000), 0, Some(2000.0), 0.0),
        now,
    );
    let alone = policy.expected_wait(&ids[..1], &exact(100), now).unwrap();
    assert!(
        alone.queue_secs > 2.0,
        "worker 0 waits for a slot: {}",
        alone.queue_secs
    );
    // Whichever worker comes first, the floor is worker 1's 0.5 s: worker
    // 0's slot wait counts even when its token wait is the lowest.
    for order in [
        [0, 1, 2],
        [0, 2, 1],
        [1, 0, 2],
        [1, 2, 0],
        [2, 0, 1],
        [2, 1, 0],
    ] {
        let candidates: Vec<WorkerId> = order.iter().map(|&i| ids[i]).collect();
        let wait = policy.expected_wait(&candidates, &exact(100), now).unwrap();
        assert!(
            close(wait.queue_secs, 0.5),
            "{order:?}: {}",
            wait.queue_secs
        );
    }
}

#[test]
fn behind_replicas_a_worker_s_slot_wait_counts_every_replica_s_finishes() {
    let (policy, ids) = fleet(1);
    let t0 = Instant::now();
    // This router sees worker 0 finish ten requests a second.
    for step in 0..20u64 {
        let at = t0 + Duration::from_millis(100 * step);
        let dispatch = policy.select(&ids, &exact(10), at).unwrap();
        policy.finish(&dispatch, at);
    }
    let now = t0 + Duration::from_secs(2);
    // 40 requests wait for a batch slot: about 4 s at ten a second.
    report(&policy, ids[0], &load(Some(0), 40, Some(2000.0), 0.0), now);
    let alone = policy.expected_wait(&ids, &exact(100), now).unwrap();
    assert!((alone.queue_secs - 4.0).abs() < 0.2, "{}", alone.queue_secs);
    // Three other replicas share the worker: each sees about a quarter of
    // its finishes, so it finishes about four times as many as this one
    // sees, and the slot wait is a quarter.
    for replica in ["b", "c", "d"] {
        remote(&policy, replica, 0, 0, 0, 1, now);
    }
    let shared = policy.expected_wait(&ids, &exact(100), now).unwrap();
    assert!(
        close(shared.queue_secs, alone.queue_secs / 4.0),
        "{} against {}",
        shared.queue_secs,
        alone.queue_secs
    );
}

#[test]
fn a_wait_within_a_bound_stops_at_the_first_worker_that_has_it() {
    let (policy, ids) = fleet(3);
    let t0 = Instant::now();
    // 1 s, 0.2 s and 0.1 s of queued tokens at 2000 tokens a second.
    for (id, queued) in ids.iter().zip([2000, 400, 200]) {
        report(&policy, *id, &load(Some(queued), 0, Some(2000.0), 0.0), t0);
    }
    let least = policy.expected_wait(&ids, &exact(100), t0).unwrap();
    assert!(close(least.queue_secs, 0.1));
    // Worker 1 is the first with at most 0.25 s: the search stops there.
    let within = policy
        .expected_wait_within(&ids, &exact(100), t0, 0.25)
        .unwrap();
    assert!(close(within.queue_secs, 0.2));
    assert_eq!(within.prefill_secs, least.prefill_secs);
    // None has at most 0.05 s: the least, as without a bound.
    let none_within = policy
        .expected_wait_within(&ids, &exact(100), t0, 0.05)
        .unwrap();
    assert_eq!(none_within, least);
}

/// The expected wait for a small request, and the same less the workers'
/// progress on their prompts under way.
fn waits_with_progress(policy: &LeastLoad, ids: &[WorkerId], at: Instant) -> (f64, f64) {
    let wait = policy.expected_wait(ids, &exact(100), at).unwrap();
    (wait.queue_secs, wait.queue_less_progress_secs.unwrap())
}

#[test]
fn the_progress_on_the_prompt_under_way_is_told_apart_from_the_wait() {
    let (policy, ids) = fleet(1);
    let t0 = Instant::now();
    report(&policy, ids[0], &load(Some(0), 0, Some(2000.0), 0.0), t0);
    let waits = |at: Instant| waits_with_progress(&policy, &ids, at);
    assert_eq!(waits(t0), (0.0, 0.0));
    // A prompt of 2000 tokens: 1 s at 2000 tokens a second.
    let first = policy.select(&ids, &exact(2000), t0).unwrap();
    let (queue, less_progress) = waits(t0);
    assert!(close(queue, 1.0) && close(less_progress, 1.0));
    // 0.6 s on, it still counts whole until its first token; 0.4 s of it
    // is left.
    let later = t0 + Duration::from_millis(600);
    let (queue, less_progress) = waits(later);
    assert!(
        close(queue, 1.0) && close(less_progress, 0.4),
        "{less_progress}"
    );
    // A second prompt sent behind it waits for the rest of it.
    let _second = policy.select(&ids, &exact(2000), later).unwrap();
    let (queue, less_progress) = waits(later);
    assert!(
        close(queue, 2.0) && close(less_progress, 1.4),
        "{less_progress}"
    );
    // The first one's first token: the engine is on to the second since.
    let t1 = t0 + Duration::from_secs(1);
    policy.first_token(&first, t1);
    let (queue, less_progress) = waits(t1);
    assert!(
        close(queue, 1.0) && close(less_progress, 1.0),
        "{less_progress}"
    );
    let (_, less_progress) = waits(t1 + Duration::from_millis(250));
    assert!(close(less_progress, 0.75), "{less_progress}");
    // Never more progress than the work pending.
    let (queue, less_progress) = waits(t1 + Duration::from_millis(1500));
    assert!(close(queue, 1.0) && less_progress == 0.0, "{less_progress}");
}

#[test]
fn the_progress_counts_the_prompts_other_replicas_sent() {
    let (policy, ids) = fleet(1);
    let t0 = Instant::now();
    report(&policy, ids[0], &load(Some(0), 0, Some(2000.0), 0.0), t0);
    let waits = |at: Instant| waits_with_progress(&policy, &ids, at);
    // Another replica sent a 2000-token prompt onto nothing pending: the
    // engine takes it up when the message says so.
    assert_eq!(
        remote(&policy, "b", 0, 2000, 1, 1, t0),
        ReplicaPendingOutcome::Applied
    );
    let (queue, less_progress) = waits(t0 + Duration::from_millis(600));
    assert!(
        close(queue, 1.0) && close(less_progress, 0.4),
        "{less_progress}"
    );
    // This replica's prompt goes behind it: the engine is not on it yet.
    let ours = policy
        .select(&ids, &exact(2000), t0 + Duration::from_millis(600))
        .unwrap();
    let (queue, less_progress) = waits(t0 + Duration::from_millis(600));
    assert!(
        close(queue, 2.0) && close(less_progress, 1.4),
        "{less_progress}"
    );
    // The other replica's prompt has its first token (its pending falls):
    // the engine is on to ours since that message.
    let t1 = t0 + Duration::from_secs(1);
    remote(&policy, "b", 0, 0, 0, 2, t1);
    let (queue, less_progress) = waits(t1 + Duration::from_millis(250));
    assert!(
        close(queue, 1.0) && close(less_progress, 0.75),
        "{less_progress}"
    );
    policy.first_token(&ours, t1 + Duration::from_secs(1));
    assert_eq!(waits(t1 + Duration::from_secs(1)), (0.0, 0.0));
}
