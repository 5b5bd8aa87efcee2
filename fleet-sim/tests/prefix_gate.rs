//! The prefix-affinity gate (`docs/least-load.md`, "Prefix affinity"): the
//! shipped `multi-turn.toml` and `rag-many-prefixes.toml`, each its full
//! 20,000 requests (sessions take minutes to fill the caches; shorter RAG
//! runs are mostly the cold start), unchanged except for the load (0.8 of warm-cache capacity),
//! with `least_load`, `least_load_no_prefix` and the two prefix-aware
//! baselines:
//! - on both, `least_load`'s p99 TTFT is at least 3× lower than
//!   `least_load_no_prefix`'s, and lower than `cache_aware`'s and
//!   `consistent_hash`'s. (On the RAG mix, consistent hashing keeps every
//!   document on one worker; `least_load` beats it only with the miss
//!   charge raised by congestion, `prefix_congestion_weight`.)

// Helpers outside #[test] functions unwrap too: a panic here is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;

use fleet_sim::{PolicyName, Report, RunOptions, Scenario, run_scenarios};

const LOAD: f64 = 0.8;
const NO_TERM_FACTOR: f64 = 3.0;

fn run(name: &str, requests: f64) -> Report {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("scenarios")
        .join(format!("{name}.toml"));
    let mut scenario = Scenario::from_path(&path).unwrap();
    scenario
        .scale_requests(requests / scenario.requests as f64)
        .unwrap();
    scenario.utilizations = vec![LOAD];
    scenario.policies = vec![
        PolicyName::LeastLoad,
        PolicyName::LeastLoadNoPrefix,
        PolicyName::CacheAware,
        PolicyName::ConsistentHash,
    ];
    let outcomes = run_scenarios(&[scenario], &RunOptions::default()).unwrap();
    outcomes.into_iter().next().unwrap().report
}

fn p99(report: &Report, policy: &str) -> f64 {
    let traffic = report.scenario.clone();
    report
        .row(&traffic, LOAD, policy, None, None)
        .unwrap_or_else(|| panic!("{}: no row for {policy}", report.scenario))
        .ttft_p99_s
}

fn check(name: &str, requests: f64) {
    let report = run(name, requests);
    let least_load = p99(&report, "least_load");
    let no_term = p99(&report, "least_load_no_prefix");
    let cache_aware = p99(&report, "cache_aware");
    let consistent_hash = p99(&report, "consistent_hash");
    println!(
        "{name} at {LOAD}: p99 least_load {least_load:.3} s, no term {no_term:.3} s, \
         cache_aware {cache_aware:.3} s, consistent_hash {consistent_hash:.3} s"
    );
    assert!(
        least_load * NO_TERM_FACTOR <= no_term,
        "{name}: least_load {least_load:.3} s is not 3x below the no-term {no_term:.3} s"
    );
    assert!(
        least_load < cache_aware,
        "{name}: least_load {least_load:.3} s against cache_aware {cache_aware:.3} s"
    );
    assert!(
        least_load < consistent_hash,
        "{name}: least_load {least_load:.3} s against consistent_hash {consistent_hash:.3} s"
    );
}

#[test]
fn multi_turn_sessions_stay_where_their_history_is_cached() {
    check("multi-turn", 20_000.0);
}

#[test]
fn rag_documents_stay_where_they_are_cached() {
    check("rag-many-prefixes", 20_000.0);
}
