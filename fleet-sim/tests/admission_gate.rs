//! The admission gate (`docs/engine-model.md`, "The fleet simulator"): the
//! shipped `admission-*.toml` scenarios, unchanged, each with size-skewed
//! and multi-turn traffic over 16 SGLang workers, `least_load` with and
//! without the admission room, loads as multiples of each traffic's
//! measured capacity (`capacity = "measured"`: the highest rate
//! `least_load` without a room keeps up with). The goals:
//!
//! 1. `admission-priority`, 1.3 × capacity, one request in five priority 0,
//!    the rest priority 1 with a 2 s TTFT deadline, order `priority`:
//!    priority 0's p99 TTFT within 1.5 × its p99 at 0.5; every priority-1
//!    request served within its deadline or turned away before it passed.
//! 2. `admission-tenants`, tenant A at 10 × tenant B's rate, together 1.2 ×
//!    capacity, order `fair_share`: B's p99 TTFT within 1.2 × its p99 with
//!    B's requests alone; the fleet's throughput at least 0.95 of capacity.
//! 3. `admission-deadline`, a 2 s TTFT deadline on every request at 1.3 ×
//!    capacity: at least 99 % of the requests the room admits meet it; a
//!    request turned away is turned away within 5 ms of its arrival; the
//!    goodput at least 1.5 × that without the room.
//! 4. `admission-default`, no class, tenant or deadline, the room's defaults
//!    (order `priority`): from 0.5 to 0.9 of capacity, p99 TTFT within 2 %
//!    of that without the room.
//!
//! Every goal is measured on both traffics and printed as a table; the test
//! fails on the goals not met, except those in [`OPEN`]: goals the room
//! does not meet yet, measured and printed, not asserted. Build it in
//! release: `cargo test --release -p fleet-sim --test admission_gate --
//! --nocapture`.

// Helpers outside #[test] functions unwrap too: a panic here is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;

use fleet_sim::{
    AdmissionOrder, GroupStats, Report, ResultRow, RunOptions, Scenario, run_scenarios,
};

const TRAFFICS: [&str; 2] = ["size-skew", "multi-turn"];

/// The goals not met yet (the start of the goal's row, traffic), and why
/// (`docs/admission.md`, "Measured"):
/// - multi-turn: the wait in the engine's queue and prefill steps shared
///   with more work at 1.2-1.3 × the load (goal 1's priority 0, 1.53
///   against 1.5), and for tenant B (goal 2) the queue of the worker
///   holding its conversation, behind tenant A's work;
/// - size-skew with tenants: the room keeps engines' queues near
///   `reorder_above_wait`, which a light tenant's request waits out; the
///   policy sees those queues as longer than they are, which costs
///   throughput. No threshold meets both halves of goal 2, and B's half
///   was not met even with the engines' true queues in the room's view.
const OPEN: [(&str, &str); 4] = [
    ("1. priority 0", "multi-turn"),
    ("2. tenant B", "size-skew"),
    ("2. throughput", "size-skew"),
    ("2. tenant B", "multi-turn"),
];

fn is_open(goal: &Goal) -> bool {
    OPEN.iter()
        .any(|(row, traffic)| goal.goal.starts_with(row) && goal.traffic == *traffic)
}

/// The shipped scenario `name`.
fn shipped(name: &str) -> Scenario {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("scenarios")
        .join(format!("{name}.toml"));
    Scenario::from_path(&path).unwrap()
}

/// The four scenarios' reports, in goal order.
fn reports() -> Vec<Report> {
    let scenarios: Vec<Scenario> = [
        "admission-priority",
        "admission-tenants",
        "admission-deadline",
        "admission-default",
    ]
    .into_iter()
    .map(shipped)
    .collect();
    let options = RunOptions {
        threads: 2,
        progress: false,
    };
    run_scenarios(&scenarios, &options)
        .unwrap()
        .into_iter()
        .map(|outcome| outcome.report)
        .collect()
}

fn row<'a>(
    report: &'a Report,
    traffic: &str,
    load: f64,
    admission: AdmissionOrder,
) -> &'a ResultRow {
    report
        .admission_row(traffic, load, "least_load", admission)
        .unwrap_or_else(|| {
            panic!(
                "{}: no row for {traffic} at {load} with admission {}",
                report.scenario,
                admission.as_str()
            )
        })
}

fn all(row: &ResultRow) -> &GroupStats {
    row.outcomes.as_ref().unwrap()
}

fn group<'a>(groups: &'a [GroupStats], name: &str) -> &'a GroupStats {
    groups
        .iter()
        .find(|group| group.group == name)
        .unwrap_or_else(|| panic!("no group {name}"))
}

/// One measured goal.
struct Goal {
    goal: &'static str,
    traffic: &'static str,
    measured: String,
    target: String,
    met: bool,
}

fn priority(report: &Report, traffic: &'static str, goals: &mut Vec<Goal>) {
    let at = |load| &row(report, traffic, load, AdmissionOrder::Priority).by_class;
    let high = group(at(1.3), "priority 0").ttft_p99_s;
    let calm = group(at(0.5), "priority 0").ttft_p99_s;
    goals.push(Goal {
        goal: "1. priority 0 p99 at 1.3 ÷ at 0.5",
        traffic,
        measured: format!("{high:.3} s ÷ {calm:.3} s = {:.2}", high / calm),
        target: "≤ 1.5".into(),
        met: high <= 1.5 * calm,
    });
    let low = group(at(1.3), "priority 1");
    goals.push(Goal {
        goal: "1. priority 1 served late / turned away late",
        traffic,
        measured: format!(
            "{} / {} of {} ({} served, {} turned away)",
            low.served_late_requests,
            low.rejected_late_requests,
            low.offered_requests,
            low.served_requests,
            low.rejected_requests
        ),
        target: "0 / 0".into(),
        met: low.served_late_requests == 0 && low.rejected_late_requests == 0,
    });
}

fn tenants(report: &Report, traffic: &'static str, goals: &mut Vec<Goal>) {
    let shared = row(report, traffic, 1.2, AdmissionOrder::FairShare);
    let b = group(&shared.by_tenant, "tenant B");
    let alone = all(row(
        report,
        &format!("{traffic}-B-alone"),
        1.2,
        AdmissionOrder::FairShare,
    ));
    goals.push(Goal {
        goal: "2. tenant B p99 with A ÷ alone",
        traffic,
        measured: format!(
            "{:.3} s ÷ {:.3} s = {:.2} ({} of B turned away)",
            b.ttft_p99_s,
            alone.ttft_p99_s,
            b.ttft_p99_s / alone.ttft_p99_s,
            b.rejected_requests
        ),
        target: "≤ 1.2".into(),
        met: b.ttft_p99_s <= 1.2 * alone.ttft_p99_s,
    });
    let throughput = all(shared).throughput_vs_capacity;
    let without = all(row(report, traffic, 1.2, AdmissionOrder::Off)).throughput_vs_capacity;
    goals.push(Goal {
        goal: "2. throughput ÷ capacity",
        traffic,
        measured: format!("{throughput:.3} (without the room {without:.3})"),
        target: "≥ 0.95".into(),
        met: throughput >= 0.95,
    });
}

fn deadline(report: &Report, traffic: &'static str, goals: &mut Vec<Goal>) {
    let with = all(row(report, traffic, 1.3, AdmissionOrder::Priority));
    let without = all(row(report, traffic, 1.3, AdmissionOrder::Off));
    let met = with.goodput_requests as f64 / with.served_requests.max(1) as f64;
    goals.push(Goal {
        goal: "3. admitted requests within 2 s",
        traffic,
        measured: format!(
            "{:.2} % ({} of {})",
            met * 100.0,
            with.goodput_requests,
            with.served_requests
        ),
        target: "≥ 99 %".into(),
        met: met >= 0.99,
    });
    goals.push(Goal {
        goal: "3. turned away after arrival p50 / p99 / max",
        traffic,
        measured: format!(
            "{:.1} / {:.1} / {:.1} ms ({} turned away, {} on arrival)",
            with.rejection_p50_s * 1e3,
            with.rejection_p99_s * 1e3,
            with.rejection_max_s * 1e3,
            with.rejected_requests,
            with.rejected_on_arrival_requests
        ),
        target: "max ≤ 5 ms".into(),
        met: with.rejection_max_s <= 0.005,
    });
    let ratio = with.goodput_requests as f64 / without.goodput_requests.max(1) as f64;
    goals.push(Goal {
        goal: "3. goodput with ÷ without the room",
        traffic,
        measured: format!(
            "{} ÷ {} = {ratio:.2}",
            with.goodput_requests, without.goodput_requests
        ),
        target: "≥ 1.5".into(),
        met: ratio >= 1.5,
    });
}

fn default_room(report: &Report, traffic: &'static str, goals: &mut Vec<Goal>) {
    let mut worst: (f64, f64) = (0.5, 1.0);
    let mut ratios = Vec::new();
    for load in [0.5, 0.6, 0.7, 0.8, 0.9] {
        let with = row(report, traffic, load, AdmissionOrder::Priority).ttft_p99_s;
        let without = row(report, traffic, load, AdmissionOrder::Off).ttft_p99_s;
        let ratio = with / without;
        ratios.push(format!("{ratio:.3}"));
        if (ratio - 1.0).abs() > (worst.1 - 1.0).abs() {
            worst = (load, ratio);
        }
    }
    goals.push(Goal {
        goal: "4. p99 with ÷ without the room, 0.5 … 0.9",
        traffic,
        measured: ratios.join(" "),
        target: "within 1 ± 0.02".into(),
        met: (worst.1 - 1.0).abs() <= 0.02,
    });
}

#[test]
fn the_admission_room_meets_its_goals() {
    let reports = reports();
    let mut goals = Vec::new();
    for traffic in TRAFFICS {
        priority(&reports[0], traffic, &mut goals);
        tenants(&reports[1], traffic, &mut goals);
        deadline(&reports[2], traffic, &mut goals);
        default_room(&reports[3], traffic, &mut goals);
    }
    goals.sort_by_key(|goal| goal.goal.chars().next());
    let mut table =
        String::from("| goal | traffic | measured | target | met |\n|---|---|---|---|---|\n");
    for goal in &goals {
        table.push_str(&format!(
            "| {} | {} | {} | {} | {} |\n",
            goal.goal,
            goal.traffic,
            goal.measured,
            goal.target,
            match (goal.met, is_open(goal)) {
                (true, _) => "yes",
                (false, true) => "no (open)",
                (false, false) => "NO",
            }
        ));
    }
    println!("{table}");
    let capacities: Vec<String> = reports[0]
        .capacity
        .iter()
        .map(|capacity| {
            format!(
                "{}: {:.2} req/s (the formula's {:.2})",
                capacity.traffic,
                capacity.capacity_rps,
                capacity
                    .formula_capacity_rps
                    .unwrap_or(capacity.capacity_rps)
            )
        })
        .collect();
    println!("measured capacities: {}", capacities.join(", "));
    let failed: Vec<String> = goals
        .iter()
        .filter(|goal| !goal.met && !is_open(goal))
        .map(|goal| format!("{} ({}): {}", goal.goal, goal.traffic, goal.measured))
        .collect();
    assert!(
        failed.is_empty(),
        "admission goals not met:\n{}\n\n{table}",
        failed.join("\n")
    );
}
