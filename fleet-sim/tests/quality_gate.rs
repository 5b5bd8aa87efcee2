//! The routing-quality gate (issue 7, `docs/engine-model.md`): the shipped
//! `size-skew.toml`, `uniform.toml` and `poll-jitter.toml`, unchanged except
//! for the request count (5,000 per policy and load level), at 0.8 and 0.9
//! utilization with 1 s polls:
//! - size-skew: `least_load`'s p99 TTFT is at least 20% lower than
//!   `least_requests`', `round_robin`'s and `random`'s;
//! - uniform: no deployable policy (the oracle excluded) beats `least_load`'s
//!   p99 by more than 10%;
//! - poll-jitter, uniform traffic: `least_load`'s p99 is within 10% of
//!   `round_robin`'s.

// Helpers outside #[test] functions unwrap too: a panic here is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::sync::OnceLock;

use fleet_sim::{Report, RunOptions, Scenario, ScenarioOutcome, run_scenarios, summary_table};

const REQUESTS_PER_CELL: f64 = 5000.0;
const LOADS: [f64; 2] = [0.8, 0.9];
const DEPLOYABLE: [&str; 6] = [
    "random",
    "round_robin",
    "least_requests",
    "power_of_two",
    "least_load",
    "least_load_since_poll",
];

fn shipped(name: &str) -> Scenario {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("scenarios")
        .join(format!("{name}.toml"));
    let mut scenario = Scenario::from_path(&path).unwrap();
    assert_eq!(
        scenario.router.poll_interval_s, 1.0,
        "{name}: the gate is at 1 s polls"
    );
    assert!(scenario.router.sweep_poll_interval_s.is_none());
    let factor = REQUESTS_PER_CELL / scenario.requests as f64;
    scenario.scale_requests(factor).unwrap();
    assert!(scenario.requests >= 5000);
    scenario
}

fn p99(report: &Report, traffic: &str, load: f64, policy: &str) -> f64 {
    report
        .row(traffic, load, policy, None, None)
        .unwrap_or_else(|| panic!("{}: no row for {traffic} {load} {policy}", report.scenario))
        .ttft_p99_s
}

/// Runs the three shipped scenarios once per test binary (the three gates
/// share the run).
fn outcomes() -> &'static [ScenarioOutcome] {
    static OUTCOMES: OnceLock<Vec<ScenarioOutcome>> = OnceLock::new();
    OUTCOMES.get_or_init(|| {
        let scenarios = [
            shipped("size-skew"),
            shipped("uniform"),
            shipped("poll-jitter"),
        ];
        let options = RunOptions {
            threads: 2,
            progress: false,
        };
        run_scenarios(&scenarios, &options).unwrap()
    })
}

fn report(name: &str) -> &'static Report {
    &outcomes()
        .iter()
        .find(|o| o.report.scenario == name)
        .unwrap()
        .report
}

fn verdict(gate: &str, failures: &[String], report: &Report) {
    assert!(
        failures.is_empty(),
        "quality gate {gate} failed:\n{}\n\np99 TTFT (s), {} requests per cell:\n{}",
        failures.join("\n"),
        report.requests_per_cell,
        summary_table(report)
    );
}

#[test]
fn gate_size_skew_least_load_is_20_percent_below_the_baselines() {
    let report = report("size-skew");
    let mut failures = Vec::new();
    for load in LOADS {
        let least_load = p99(report, "size-skew", load, "least_load");
        for other in ["least_requests", "round_robin", "random"] {
            let theirs = p99(report, "size-skew", load, other);
            if least_load > 0.8 * theirs {
                failures.push(format!(
                    "size-skew at {load}: least_load p99 {least_load:.4} s is not 20% below {other}'s {theirs:.4} s"
                ));
            }
        }
    }
    verdict("size-skew", &failures, report);
}

#[test]
fn gate_uniform_no_deployable_policy_beats_least_load_by_10_percent() {
    let report = report("uniform");
    let mut failures = Vec::new();
    for load in LOADS {
        let least_load = p99(report, "uniform", load, "least_load");
        for other in DEPLOYABLE {
            let theirs = p99(report, "uniform", load, other);
            if theirs < 0.9 * least_load {
                failures.push(format!(
                    "uniform at {load}: {other} p99 {theirs:.4} s beats least_load's {least_load:.4} s by more than 10%"
                ));
            }
        }
    }
    verdict("uniform", &failures, report);
}

#[test]
fn gate_poll_jitter_least_load_is_within_10_percent_of_round_robin() {
    let report = report("poll-jitter");
    let mut failures = Vec::new();
    for load in LOADS {
        let least_load = p99(report, "uniform", load, "least_load");
        let round_robin = p99(report, "uniform", load, "round_robin");
        if (least_load - round_robin).abs() > 0.1 * round_robin {
            failures.push(format!(
                "poll-jitter uniform at {load}: least_load p99 {least_load:.4} s is not within 10% of \
                 round_robin's {round_robin:.4} s"
            ));
        }
    }
    verdict("poll-jitter", &failures, report);
}

#[test]
fn the_same_seed_gives_a_byte_identical_report() {
    let mut scenario = shipped("size-skew");
    scenario.scale_requests(0.1).unwrap();
    let run = |threads| {
        let options = RunOptions {
            threads,
            progress: false,
        };
        let outcome = run_scenarios(std::slice::from_ref(&scenario), &options).unwrap();
        serde_json::to_string_pretty(&outcome[0].report).unwrap()
    };
    let one = run(1);
    assert_eq!(one, run(2));
    let json: serde_json::Value = serde_json::from_str(&one).unwrap();
    let row = &json["results"][0];
    for key in [
        "traffic",
        "utilization",
        "policy",
        "requests",
        "ttft_p50_s",
        "ttft_p90_s",
        "ttft_p99_s",
        "e2e_p50_s",
        "e2e_p99_s",
        "queue_delay_mean_s",
        "throughput_tps",
        "preemptions",
        "imbalance_cv",
    ] {
        assert!(row.get(key).is_some(), "missing {key} in {row}");
    }
    for key in ["scenario", "seed", "workers", "poll_interval_s", "results"] {
        assert!(json.get(key).is_some(), "missing {key}");
    }
}

#[test]
fn every_shipped_scenario_loads_and_states_its_capacity() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios");
    for path in fleet_sim::standard_scenario_paths(&dir) {
        let scenario = Scenario::from_path(&path).unwrap();
        assert_eq!(
            scenario.utilizations,
            vec![0.5, 0.8, 0.9],
            "{}",
            path.display()
        );
        assert!(scenario.requests >= 20_000, "{}", path.display());
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            text.contains("capacity_rps = Σ_w"),
            "{}: no capacity formula",
            path.display()
        );
        let stem = path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or_default();
        assert_eq!(scenario.name, stem);
    }
}
