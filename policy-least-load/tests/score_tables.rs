//! Score tables of canonical fleets, snapshotted: every term, the rule that
//! applied, and the chosen workers (`*`). Each test also checks the winner
//! and one score worked out by hand.

// Helpers outside #[test] functions may unwrap too: a panic is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use load_protocols::{SchedulerLoadSnapshot, WorkerLoad, queued_tokens_from_proto3};
use policy_core::{
    Policy, PolicyContext, RequestInfo, ScoreTable, TokenCount, WorkerId, WorkerInfo,
};
use policy_least_load::{LeastLoad, LeastLoadParams, RateMode, Strategy};

fn fleet(n: u32) -> (LeastLoad, Vec<WorkerId>) {
    fleet_with(LeastLoadParams::default(), n)
}

fn fleet_with(params: LeastLoadParams, n: u32) -> (LeastLoad, Vec<WorkerId>) {
    let policy = LeastLoad::new(Strategy::LeastLoad, params, &PolicyContext::default()).unwrap();
    let ids: Vec<WorkerId> = (0..n).map(|slot| WorkerId::new(slot, 0)).collect();
    for id in &ids {
        policy.add_worker(
            *id,
            WorkerInfo::new(format!("http://10.0.0.{}:30000", id.slot()), "sglang"),
        );
    }
    (policy, ids)
}

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

fn report(policy: &LeastLoad, id: WorkerId, load: &WorkerLoad, at: Instant) {
    let mark = policy.poll_started(id, at);
    policy.poll_completed(mark, Some(load), at);
}

/// Dispatches requests of the given sizes to one worker (no first token yet).
fn hold(policy: &LeastLoad, id: WorkerId, sizes: &[u64], at: Instant) {
    for tokens in sizes {
        policy
            .select(&[id], &RequestInfo::new(TokenCount::Exact(*tokens)), at)
            .unwrap();
    }
}

/// Streams `count` requests of 4000 tokens to `id`, one at a time, each
/// answered at `true_tps`: the policy learns the worker's rate. Returns the
/// time after the last.
fn teach(policy: &LeastLoad, id: WorkerId, true_tps: f64, mut at: Instant) -> Instant {
    let request = RequestInfo::new(TokenCount::Exact(4000)).streaming(true);
    for _ in 0..30 {
        let dispatch = policy.select(&[id], &request, at).unwrap();
        at += Duration::from_secs_f64(4000.0 / true_tps);
        policy.first_token(&dispatch, at);
        policy.finish(&dispatch, at);
        at += Duration::from_millis(50);
    }
    at
}

fn request() -> RequestInfo {
    RequestInfo::new(TokenCount::Estimated(512))
}

fn score(table: &ScoreTable, id: WorkerId) -> f64 {
    table.value(id, "score_s").unwrap()
}

#[test]
fn homogeneous_idle() {
    let (policy, ids) = fleet(4);
    let t0 = Instant::now();
    for id in &ids {
        report(&policy, *id, &load(Some(0), 0, Some(2000.0), 0.2), t0);
    }
    let table = policy.explain(&ids, &request(), t0);
    insta::assert_snapshot!(table.to_string());
    // The request's own 512 tokens at the prior, 0.256 s, and the barrier,
    // 0.15 * 0.2 / 0.8 = 0.0375 s: the same everywhere.
    assert!((score(&table, ids[2]) - 0.2935).abs() < 1e-12);
    assert_eq!(table.chosen, ids, "all four tied");
    let winner = policy.select(&ids, &request(), t0).unwrap().worker;
    assert!(ids.contains(&winner));
}

#[test]
fn size_skew() {
    // The seed's case: one worker holds a single 6000-token request, the
    // other four 200-token ones. Counting requests would send the next one to
    // worker 0; counting token-work sends it to worker 1.
    let (policy, ids) = fleet(2);
    let t0 = Instant::now();
    for id in &ids {
        report(&policy, *id, &load(Some(0), 0, Some(2000.0), 0.0), t0);
    }
    let now = t0 + Duration::from_millis(200);
    hold(&policy, ids[0], &[6000], now);
    hold(&policy, ids[1], &[200, 200, 200, 200], now);
    let table = policy.explain(&ids, &request(), now);
    insta::assert_snapshot!(table.to_string());
    // (6000 + 512) / 2000 = 3.256 s against (800 + 512) / 2000 = 0.656 s.
    assert_eq!(score(&table, ids[0]), 3.256);
    assert_eq!(score(&table, ids[1]), 0.656);
    assert_eq!(table.chosen, vec![ids[1]]);
    assert_eq!(policy.select(&ids, &request(), now).unwrap().worker, ids[1]);
}

#[test]
fn heterogeneous_throughput() {
    // Four workers whose rates were learned from traffic (worker 2 has had
    // none: it is scored at the fleet's rate, the geometric mean of the
    // others', 1260 tok/s). What each reports as its generation rate does not
    // matter under the learned rate.
    let (policy, ids) = fleet(4);
    let mut at = Instant::now();
    for (id, true_tps) in [(ids[0], 1000.0), (ids[1], 4000.0), (ids[3], 500.0)] {
        at = teach(&policy, id, true_tps, at);
    }
    report(&policy, ids[0], &load(Some(2000), 2, Some(9.0), 0.0), at);
    report(&policy, ids[1], &load(Some(6000), 6, Some(9.0), 0.0), at);
    report(&policy, ids[2], &load(Some(2500), 3, None, 0.0), at);
    report(&policy, ids[3], &load(Some(1000), 1, Some(9.0), 0.0), at);
    let table = policy.explain(&ids, &request(), at);
    insta::assert_snapshot!(table.to_string());
    // With the request's own 512 tokens: about 2512 / 1000 = 2.5 s,
    // 6512 / 4000 = 1.6 s, 3012 / 1260 = 2.4 s and 1512 / 500 = 3 s. The
    // fast worker wins despite the longest queue.
    let near = |id: WorkerId, secs: f64| (score(&table, id) / secs - 1.0).abs() < 0.05;
    assert!(
        near(ids[0], 2.512) && near(ids[1], 1.628) && near(ids[2], 2.39) && near(ids[3], 3.024),
        "{table}"
    );
    assert_eq!(table.chosen, vec![ids[1]]);
    assert_eq!(policy.select(&ids, &request(), at).unwrap().worker, ids[1]);
}

#[test]
fn heterogeneous_reported_rate() {
    // rate = "reported": each worker's reported generation rate divides.
    let params = LeastLoadParams {
        rate: RateMode::Reported,
        ..LeastLoadParams::default()
    };
    let (policy, ids) = fleet_with(params, 4);
    let t0 = Instant::now();
    report(&policy, ids[0], &load(Some(2000), 2, Some(1000.0), 0.0), t0);
    report(&policy, ids[1], &load(Some(6000), 6, Some(4000.0), 0.0), t0);
    // No rate reported: default 2000 tok/s (rule 2).
    report(&policy, ids[2], &load(Some(2500), 3, None, 0.0), t0);
    report(&policy, ids[3], &load(Some(1000), 1, Some(500.0), 0.0), t0);
    let table = policy.explain(&ids, &request(), t0);
    insta::assert_snapshot!(table.to_string());
    // 2500 / 2000 = 1.25 s beats 2 s, 1.5 s and 2 s.
    assert_eq!(score(&table, ids[2]), 1.25);
    assert_eq!(score(&table, ids[1]), 1.5);
    assert_eq!(table.chosen, vec![ids[2]]);
    assert_eq!(policy.select(&ids, &request(), t0).unwrap().worker, ids[2]);
}

#[test]
fn near_full_kv() {
    let (policy, ids) = fleet(4);
    let t0 = Instant::now();
    // 0.15 * 0.95 / 0.05 = 2.85 s.
    report(&policy, ids[0], &load(Some(0), 0, Some(2000.0), 0.95), t0);
    // 2000 / 2000 + 0.15 * 0.5 / 0.5 = 1.15 s.
    report(&policy, ids[1], &load(Some(2000), 2, Some(2000.0), 0.5), t0);
    // Full: k clamped to 0.999, 0.15 * 0.999 / 0.001 = 149.85 s.
    report(&policy, ids[2], &load(Some(0), 0, Some(2000.0), 1.0), t0);
    // 3000 / 2000 + 0.15 * 0.1 / 0.9 = 1.5167 s.
    report(&policy, ids[3], &load(Some(3000), 3, Some(2000.0), 0.1), t0);
    let table = policy.explain(&ids, &request(), t0);
    insta::assert_snapshot!(table.to_string());
    // Each plus the request's own 512 tokens, 0.256 s.
    assert!((score(&table, ids[1]) - 1.406).abs() < 1e-12);
    assert!((score(&table, ids[2]) - 150.106).abs() < 1e-9);
    assert_eq!(table.chosen, vec![ids[1]]);
    assert_eq!(policy.select(&ids, &request(), t0).unwrap().worker, ids[1]);
}

#[test]
fn mixed_signals() {
    // The degradation rules, under rate = "reported" (where rule 3's nominal
    // rate is the mean of the reported ones).
    let params = LeastLoadParams {
        rate: RateMode::Reported,
        ..LeastLoadParams::default()
    };
    let (policy, ids) = fleet_with(params, 5);
    let t0 = Instant::now();
    let stale_after = PolicyContext::default().stale_after;
    // Worker 4 last reported long ago: stale by now.
    report(&policy, ids[4], &load(Some(0), 0, Some(9000.0), 0.0), t0);
    let now = t0 + stale_after + Duration::from_secs(1);
    // SGLang gRPC with every signal: 1200 / 2400 + 0.15 * 0.25 / 0.75 = 0.55 s.
    report(
        &policy,
        ids[0],
        &load(Some(1200), 1, Some(2400.0), 0.25),
        now,
    );
    // vLLM /metrics: no queued tokens, no rate: 2 * 1024 / 2000 + 0.05 = 1.074 s.
    report(&policy, ids[1], &load(None, 2, None, 0.25), now);
    // gRPC 0 next to a waiting request, so not reported: 1024 / 1600 = 0.64 s.
    let grpc = load(queued_tokens_from_proto3(0, 1), 1, Some(1600.0), 0.0);
    report(&policy, ids[2], &grpc, now);
    // Worker 3 never reported: pending work at the nominal mean(2400, 1600).
    hold(&policy, ids[3], &[1000], now);
    hold(&policy, ids[4], &[1500], now);
    let table = policy.explain(&ids, &request(), now);
    insta::assert_snapshot!(table.to_string());
    // 1000 / 2000 = 0.5 s: it wins, just ahead of worker 0.
    assert_eq!(score(&table, ids[3]), 0.5);
    assert_eq!(score(&table, ids[4]), 0.75);
    assert!((score(&table, ids[0]) - 0.55).abs() < 1e-12);
    assert_eq!(table.chosen, vec![ids[3]]);
    assert_eq!(policy.select(&ids, &request(), now).unwrap().worker, ids[3]);
}
