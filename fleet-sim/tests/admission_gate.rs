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
//! 5. `admission-mixed-speeds`, workers of two speeds, one prompt in twenty
//!    long enough to meet its 1.5 s deadline only on a fast one: at half of
//!    capacity, the room's goodput at least 0.99 of that without it.
//!
//! Every goal is measured on both traffics and on three draws of the
//! traffic (the scenarios' seed 7, and 8 and 9): one draw's p99 is a few
//! hundred requests, and the same traffic drawn again moves it by more than
//! the margins the goals leave. A goal is judged on the median of its three
//! measures, except the promises no draw may break: requests served or
//! turned away after their deadline count over all three, and the time to
//! turn a request away is the longest of the three. The goals are printed
//! as a table; the test fails on the goals not met, except those in
//! [`OPEN`]: goals the room does not meet yet, measured and printed, not
//! asserted. Build it in release: `cargo test --release -p fleet-sim --test
//! admission_gate -- --nocapture`.

// Helpers outside #[test] functions unwrap too: a panic here is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;

use fleet_sim::{
    AdmissionOrder, GroupStats, Report, ResultRow, RunOptions, Scenario, run_scenarios,
};

const TRAFFICS: [&str; 2] = ["size-skew", "multi-turn"];

/// The draws each goal is measured on: the shipped scenarios' seed first.
const SEEDS: [u64; 3] = [7, 8, 9];

/// The goals not met (the start of the goal's row, traffic), and why
/// (`docs/admission.md`, "Where the goals are not met"): multi-turn tenant
/// B (goal 2), whose slowest requests wait for the engine's step under way
/// and share their own last step with A's prompts. Modelled, only engines
/// whose steps compute a B prompt alone meet it; none schedules so.
const OPEN: [(&str, &str); 1] = [("2. tenant B", "multi-turn")];

fn is_open(goal: &Judged) -> bool {
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

/// The five scenarios' reports, in goal order, for each of [`SEEDS`].
fn reports() -> Vec<[Report; 5]> {
    let names = [
        "admission-priority",
        "admission-tenants",
        "admission-deadline",
        "admission-default",
        "admission-mixed-speeds",
    ];
    let scenarios: Vec<Scenario> = SEEDS
        .iter()
        .flat_map(|seed| {
            names.iter().map(move |name| {
                let mut scenario = shipped(name);
                scenario.seed = *seed;
                scenario
            })
        })
        .collect();
    let options = RunOptions {
        threads: 2,
        progress: false,
    };
    let mut reports = run_scenarios(&scenarios, &options)
        .unwrap()
        .into_iter()
        .map(|outcome| outcome.report);
    SEEDS
        .iter()
        .map(|_| std::array::from_fn(|_| reports.next().unwrap()))
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

/// How a goal's measures on the draws make the one it is judged on.
#[derive(Clone, Copy)]
enum Across {
    Median,
    Total,
    Longest,
}

/// One goal measured on one draw: `value` is what `meets` judges, once
/// combined over the draws as `across` says.
struct Goal {
    goal: &'static str,
    traffic: &'static str,
    measured: String,
    value: f64,
    across: Across,
    target: &'static str,
    meets: fn(f64) -> bool,
    /// The combined value, as the table shows it.
    show: fn(f64) -> String,
}

/// One goal over every draw.
struct Judged {
    goal: &'static str,
    traffic: &'static str,
    measured: Vec<String>,
    value: f64,
    target: &'static str,
    show: fn(f64) -> String,
    met: bool,
}

fn judge(draws: &[Goal]) -> Judged {
    let first = &draws[0];
    let mut values: Vec<f64> = draws.iter().map(|draw| draw.value).collect();
    values.sort_by(f64::total_cmp);
    let value = match first.across {
        Across::Median => values[values.len() / 2],
        Across::Total => values.iter().sum(),
        Across::Longest => values[values.len() - 1],
    };
    Judged {
        goal: first.goal,
        traffic: first.traffic,
        measured: draws.iter().map(|draw| draw.measured.clone()).collect(),
        value,
        target: first.target,
        show: first.show,
        met: (first.meets)(value),
    }
}

fn priority(report: &Report, traffic: &'static str, goals: &mut Vec<Goal>) {
    let at = |load| &row(report, traffic, load, AdmissionOrder::Priority).by_class;
    let high = group(at(1.3), "priority 0").ttft_p99_s;
    let calm = group(at(0.5), "priority 0").ttft_p99_s;
    goals.push(Goal {
        goal: "1. priority 0 p99 at 1.3 ÷ at 0.5",
        traffic,
        measured: format!("{high:.3} s ÷ {calm:.3} s = {:.2}", high / calm),
        value: high / calm,
        across: Across::Median,
        target: "≤ 1.5",
        meets: |ratio| ratio <= 1.5,
        show: |ratio| format!("{ratio:.2}"),
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
        value: (low.served_late_requests + low.rejected_late_requests) as f64,
        across: Across::Total,
        target: "0 / 0 in all",
        meets: |late| late == 0.0,
        show: |late| format!("{late} in all"),
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
        value: b.ttft_p99_s / alone.ttft_p99_s,
        across: Across::Median,
        target: "≤ 1.2",
        meets: |ratio| ratio <= 1.2,
        show: |ratio| format!("{ratio:.2}"),
    });
    let throughput = all(shared).throughput_vs_capacity;
    let without = all(row(report, traffic, 1.2, AdmissionOrder::Off)).throughput_vs_capacity;
    goals.push(Goal {
        goal: "2. throughput ÷ capacity",
        traffic,
        measured: format!("{throughput:.3} (without the room {without:.3})"),
        value: throughput,
        across: Across::Median,
        target: "≥ 0.95",
        meets: |throughput| throughput >= 0.95,
        show: |throughput| format!("{throughput:.3}"),
    });
}

/// Goodput with the room over goodput without it.
fn goodput_ratio(with: &GroupStats, without: &GroupStats) -> f64 {
    with.goodput_requests as f64 / without.goodput_requests.max(1) as f64
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
        value: met,
        across: Across::Median,
        target: "≥ 99 %",
        meets: |share| share >= 0.99,
        show: |share| format!("{:.2} %", share * 100.0),
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
        value: with.rejection_max_s,
        across: Across::Longest,
        target: "max ≤ 5 ms in all",
        meets: |secs| secs <= 0.005,
        show: |secs| format!("{:.1} ms", secs * 1e3),
    });
    let ratio = goodput_ratio(with, without);
    goals.push(Goal {
        goal: "3. goodput with ÷ without the room",
        traffic,
        measured: format!(
            "{} ÷ {} = {ratio:.2}",
            with.goodput_requests, without.goodput_requests
        ),
        value: ratio,
        across: Across::Median,
        target: "≥ 1.5",
        meets: |ratio| ratio >= 1.5,
        show: |ratio| format!("{ratio:.2}"),
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
        value: (worst.1 - 1.0).abs(),
        across: Across::Median,
        target: "within 1 ± 0.02",
        meets: |off| off <= 0.02,
        show: |off| format!("off by {off:.3} at worst"),
    });
}

fn mixed_speeds(report: &Report, goals: &mut Vec<Goal>) {
    let traffic = "long-prompts";
    let with = all(row(report, traffic, 0.5, AdmissionOrder::Priority));
    let without = all(row(report, traffic, 0.5, AdmissionOrder::Off));
    let ratio = goodput_ratio(with, without);
    goals.push(Goal {
        goal: "5. goodput with ÷ without the room at 0.5",
        traffic,
        measured: format!(
            "{} ÷ {} = {ratio:.4} ({} turned away)",
            with.goodput_requests, without.goodput_requests, with.rejected_requests
        ),
        value: ratio,
        across: Across::Median,
        target: "≥ 0.99",
        meets: |ratio| ratio >= 0.99,
        show: |ratio| format!("{ratio:.4}"),
    });
}

#[test]
fn the_admission_room_meets_its_goals() {
    let reports = reports();
    let mut by_draw: Vec<Vec<Goal>> = Vec::new();
    for draw in &reports {
        let mut goals = Vec::new();
        for traffic in TRAFFICS {
            priority(&draw[0], traffic, &mut goals);
            tenants(&draw[1], traffic, &mut goals);
            deadline(&draw[2], traffic, &mut goals);
            default_room(&draw[3], traffic, &mut goals);
        }
        mixed_speeds(&draw[4], &mut goals);
        goals.sort_by_key(|goal| goal.goal.chars().next());
        by_draw.push(goals);
    }
    let mut per_goal: Vec<Vec<Goal>> = by_draw[0].iter().map(|_| Vec::new()).collect();
    for goals in by_draw {
        for (draws, goal) in per_goal.iter_mut().zip(goals) {
            draws.push(goal);
        }
    }
    let judged: Vec<Judged> = per_goal.iter().map(|draws| judge(draws)).collect();
    let seeds: Vec<String> = SEEDS.iter().map(u64::to_string).collect();
    let mut table = format!(
        "| goal | traffic | measured (seeds {}) | judged | target | met |\n|---|---|---|---|---|---|\n",
        seeds.join(", ")
    );
    for goal in &judged {
        table.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} |\n",
            goal.goal,
            goal.traffic,
            goal.measured.join(" · "),
            (goal.show)(goal.value),
            goal.target,
            match (goal.met, is_open(goal)) {
                (true, _) => "yes",
                (false, true) => "no (open)",
                (false, false) => "NO",
            }
        ));
    }
    println!("{table}");
    for (seed, draw) in SEEDS.iter().zip(&reports) {
        let capacities: Vec<String> = draw[0]
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
        println!(
            "measured capacities, seed {seed}: {}",
            capacities.join(", ")
        );
    }
    let failed: Vec<String> = judged
        .iter()
        .filter(|goal| !goal.met && !is_open(goal))
        .map(|goal| {
            format!(
                "{} ({}): {}",
                goal.goal,
                goal.traffic,
                goal.measured.join(" · ")
            )
        })
        .collect();
    assert!(
        failed.is_empty(),
        "admission goals not met:\n{}\n\n{table}",
        failed.join("\n")
    );
}
