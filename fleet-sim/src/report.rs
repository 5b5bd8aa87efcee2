//! Writes a scenario's outputs: `report.json`, `report.md` and SVG plots.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use plotters::prelude::*;

use super::error::SimError;
use super::metrics::CDF_POINTS;
use super::run::{RATE_TOLERANCE, Report, ResultRow, ScenarioOutcome};
use super::scenario::{PolicyName, SyncConfig};

const COLOURS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(0, 0, 0),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
];

/// A ratio to the best reference, or `-`.
fn ratio(value: Option<f64>) -> String {
    value.map_or_else(|| "-".to_owned(), |ratio| format!("{ratio:.2}"))
}

/// An optional number of seconds or tokens per second, or `-`.
fn optional(value: Option<f64>, decimals: usize) -> String {
    value.map_or_else(|| "-".to_owned(), |v| format!("{v:.decimals$}"))
}

/// The rows' distinct values of a key, in first-seen order.
fn distinct<T: PartialEq + Copy>(rows: &[ResultRow], key: impl Fn(&ResultRow) -> T) -> Vec<T> {
    let mut values = Vec::new();
    for row in rows {
        let value = key(row);
        if !values.contains(&value) {
            values.push(value);
        }
    }
    values
}

fn distinct_traffic(rows: &[ResultRow]) -> Vec<String> {
    let mut values: Vec<String> = Vec::new();
    for row in rows {
        if !values.contains(&row.traffic) {
            values.push(row.traffic.clone());
        }
    }
    values
}

/// A row's router-side sweep values, for headings and file names.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Sweep {
    interval: Option<f64>,
    replicas: Option<u32>,
    sync: Option<SyncConfig>,
    admission: Option<&'static str>,
}

fn sweep_of(row: &ResultRow) -> Sweep {
    Sweep {
        interval: row.poll_interval_s,
        replicas: row.router_replicas,
        sync: row.sync,
        admission: row.admission,
    }
}

impl Sweep {
    /// `, 4 router replicas, sync 20ms`.
    fn heading(self) -> String {
        let mut out = String::new();
        if let Some(interval) = self.interval {
            out.push_str(&format!(", poll interval {interval} s"));
        }
        if let Some(replicas) = self.replicas {
            out.push_str(&format!(", {replicas} router replicas"));
        }
        if let Some(sync) = self.sync {
            out.push_str(&format!(", sync={}", sync.label()));
        }
        if let Some(admission) = self.admission {
            out.push_str(&format!(", admission={admission}"));
        }
        out
    }

    /// `-r4-sync20ms`.
    fn suffix(self) -> String {
        let mut out = String::new();
        if let Some(interval) = self.interval {
            out.push_str(&format!("-poll{interval}s"));
        }
        if let Some(replicas) = self.replicas {
            out.push_str(&format!("-r{replicas}"));
        }
        if let Some(sync) = self.sync {
            out.push_str(&format!("-sync{}", sync.label().replace([' ', '%'], "")));
        }
        if let Some(admission) = self.admission {
            out.push_str(&format!("-adm-{admission}"));
        }
        out
    }

    /// The summary tables' setting column: `poll 1 s`, `4 replicas`,
    /// `4 replicas, sync=20ms`, `-`.
    fn setting(self) -> String {
        let mut parts = Vec::new();
        if let Some(interval) = self.interval {
            parts.push(format!("poll {interval} s"));
        }
        if let Some(replicas) = self.replicas {
            parts.push(format!("{replicas} replicas"));
        }
        if let Some(sync) = self.sync {
            parts.push(format!("sync={}", sync.label()));
        }
        if let Some(admission) = self.admission {
            parts.push(format!("admission={admission}"));
        }
        if parts.is_empty() {
            "-".to_owned()
        } else {
            parts.join(", ")
        }
    }

    /// The swept knob's value on a plot's x axis.
    fn value(self) -> f64 {
        match (self.interval, self.replicas) {
            (Some(interval), _) => interval,
            (None, Some(replicas)) => f64::from(replicas),
            (None, None) => 0.0,
        }
    }
}

/// `report.md`: one table per traffic, router setting and load level.
pub fn markdown(report: &Report) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "# {}\n", report.scenario);
    let _ = writeln!(
        out,
        "seed {}, {} workers, {} requests per policy and load level, base poll interval {} s, \
         {} router replica(s).\n",
        report.seed,
        report.workers,
        report.requests_per_cell,
        report.poll_interval_s,
        report.router_replicas
    );
    for capacity in &report.capacity {
        let rates: Vec<String> = capacity
            .rates
            .iter()
            .map(|rate| format!("{} → {:.2} req/s", rate.utilization, rate.arrival_rate_rps))
            .collect();
        let measured = capacity
            .formula_capacity_rps
            .map(|formula| format!(" measured (the formula's {formula:.2})"))
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "- traffic `{}`: mean prompt {:.1} tokens ({:.1} cached), output {:.1} tokens; capacity {:.2} req/s{measured}; {}",
            capacity.traffic,
            capacity.mean_prompt_tokens,
            capacity.mean_cached_prompt_tokens,
            capacity.mean_output_tokens,
            capacity.capacity_rps,
            rates.join(", ")
        );
    }
    let rows = &report.results;
    for traffic in distinct_traffic(rows) {
        let of_traffic: Vec<ResultRow> = rows
            .iter()
            .filter(|r| r.traffic == traffic)
            .cloned()
            .collect();
        for sweep in distinct(&of_traffic, sweep_of) {
            for utilization in distinct(&of_traffic, |r| r.utilization) {
                let _ = writeln!(
                    out,
                    "\n## {traffic}, utilization {utilization}{}\n",
                    sweep.heading()
                );
                let _ = writeln!(
                    out,
                    "| policy | TTFT p50 (s) | TTFT p90 (s) | TTFT p99 (s) | TTFT mean (s) | \
                     p99 ÷ best ref | mean ÷ best ref | E2E p50 (s) | E2E p99 (s) | \
                     queue delay mean (s) | throughput (tok/s) | preemptions | imbalance CV | \
                     prefix hit rate |"
                );
                let _ = writeln!(
                    out,
                    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
                );
                for row in of_traffic
                    .iter()
                    .filter(|r| sweep_of(r) == sweep && r.utilization == utilization)
                {
                    let _ = writeln!(
                        out,
                        "| {} | {:.3} | {:.3} | {:.3} | {:.3} | {} | {} | {:.3} | {:.3} | {:.3} | {:.0} | {} | {:.3} | {:.1}% |",
                        row.policy,
                        row.ttft_p50_s,
                        row.ttft_p90_s,
                        row.ttft_p99_s,
                        row.ttft_mean_s,
                        ratio(row.ttft_p99_vs_best_reference),
                        ratio(row.ttft_mean_vs_best_reference),
                        row.e2e_p50_s,
                        row.e2e_p99_s,
                        row.queue_delay_mean_s,
                        row.throughput_tps,
                        row.preemptions,
                        row.imbalance_cv,
                        row.prefix_hit_rate * 100.0
                    );
                }
            }
        }
    }
    if let Some(table) = sync_table(report) {
        let _ = writeln!(
            out,
            "\n## Router replicas and sync\n\n\
             p99 TTFT (s) of each policy with one router and at each replica count (rows) and \
             sync setting (columns), and its ratio to one router's (`off`: no sync; `ideal`: \
             every change seen by every replica at once; `20ms`: published every 20 ms; \
             `+dispatches`: and each dispatch at once). Policies that ignore other replicas \
             run only without sync.\n"
        );
        out.push_str(&table);
    }
    if let Some(table) = prefix_table(report) {
        let _ = writeln!(
            out,
            "\n## Prefix caches\n\n\
             The fleet's hit rate (prompt tokens the engines' prefix caches served, as they \
             report them, over all prompt tokens), the hits the policy expected over those \
             served, and with sync what the replicas shared of their prefix indexes: \
             placements applied and lost (copies to other replicas), cache bounds shared, and \
             the estimated kilobytes per second each replica published (40 bytes per update \
             and 20 per block hash, while requests arrive).\n"
        );
        out.push_str(&table);
    }
    if let Some(table) = outcome_table(report) {
        let _ = writeln!(
            out,
            "\n## Requests served and turned away\n\n\
             Per cell, for all requests, each priority class and each tenant: requests \
             offered, multi-turn requests not sent (their session ended at a turn turned \
             away: a client has no answer to build its next message on), requests served, TTFT of the served ones from their arrival at the router, \
             goodput (served within their TTFT deadline; every served request without one) \
             and its share of those offered, requests served past their deadline, requests \
             the admission room turned away (queue full / deadline unmeetable / deadline \
             passed) and how many of those only at or after their deadline, how long after \
             arrival they were turned away, and the served requests per second over the \
             traffic's capacity (the offered load is the utilization).\n"
        );
        out.push_str(&table);
    }
    if !report.rate_tracking.is_empty() {
        let _ = writeln!(
            out,
            "\n## Rate estimates for the slowed worker\n\n\
             Each policy replica's rate for the slowed worker (its explain table's rate \
             column, read every poll interval) against the worker's true prefill rate. \
             \"first within\" and \"settled within\" count seconds from the slowdown to the \
             first sample within {:.0}% of the new true rate, and to the sample from which \
             every later one stays within it (`-`: never).\n",
            RATE_TOLERANCE * 100.0
        );
        let _ = writeln!(
            out,
            "| traffic | setting | load | policy | replica | slowdown at (s) | true before (tok/s) | \
             true after (tok/s) | estimate before (tok/s) | estimate at end (tok/s) | \
             first within (s) | settled within (s) |"
        );
        let _ = writeln!(
            out,
            "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"
        );
        for tracking in &report.rate_tracking {
            let setting = Sweep {
                interval: tracking.poll_interval_s,
                replicas: tracking.router_replicas,
                sync: tracking.sync,
                admission: None,
            }
            .setting();
            let _ = writeln!(
                out,
                "| {} | {setting} | {} | {} | {} | {:.1} | {:.0} | {:.0} | {} | {} | {} | {} |",
                tracking.traffic,
                tracking.utilization,
                tracking.policy,
                tracking.replica,
                tracking.slowdown_at_s,
                tracking.true_prefill_tps_before,
                tracking.true_prefill_tps_after,
                optional(tracking.estimate_before_tps, 0),
                optional(tracking.estimate_end_tps, 0),
                optional(tracking.first_within_tolerance_s, 1),
                optional(tracking.settled_within_tolerance_s, 1),
            );
        }
    }
    out
}

/// p99 and mean TTFT (s) per policy (columns) for each traffic, router
/// setting and load (rows), as two Markdown tables, each ending in
/// `least_load`'s ratio to the best reference of the row; then, for a
/// replica sweep with sync, the [`sync_table`].
pub fn summary_table(report: &Report) -> String {
    let mut out = String::from("p99 TTFT (s):\n\n");
    out.push_str(&metric_table(
        report,
        |row| row.ttft_p99_s,
        |row| row.ttft_p99_vs_best_reference,
    ));
    out.push_str("\nmean TTFT (s):\n\n");
    out.push_str(&metric_table(
        report,
        |row| row.ttft_mean_s,
        |row| row.ttft_mean_vs_best_reference,
    ));
    if let Some(table) = outcome_table(report) {
        out.push_str("\nrequests served and turned away:\n\n");
        out.push_str(&table);
    }
    if let Some(table) = sync_table(report) {
        out.push_str("\np99 TTFT (s) by replicas and sync, and its ratio to one router's:\n\n");
        out.push_str(&table);
        if let Some(table) = prefix_table(report) {
            out.push_str("\nprefix caches and what the replicas shared of them:\n\n");
            out.push_str(&table);
        }
    }
    out
}

/// For scenarios that count each request's outcome: per cell and group
/// (all requests, each class, each tenant), what was served, in time or
/// late, what was turned away, why and when, and the multi-turn requests
/// not sent because their session ended at a turn turned away. `None`
/// without such rows.
pub fn outcome_table(report: &Report) -> Option<String> {
    if report.results.iter().all(|row| row.outcomes.is_none()) {
        return None;
    }
    let mut out = String::from(
        "| traffic | setting | load | policy | group | offered | not sent | served | TTFT p50 (s) | \
         TTFT p99 (s) | goodput | goodput ÷ offered | served late | turned away (full / \
         unmeetable / passed) | on arrival | turned away late | turned away after p50 / p99 / max (s) | \
         throughput ÷ capacity |\n\
         |---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for row in &report.results {
        let groups = row
            .outcomes
            .iter()
            .chain(&row.by_class)
            .chain(&row.by_tenant);
        for group in groups {
            let reason = |name: &str| group.rejected_by_reason.get(name).copied().unwrap_or(0);
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {:.3} | {:.3} | {} | {:.1}% | {} | {} ({} / {} / {}) | {} | {} | {:.3} / {:.3} / {:.3} | {:.3} |",
                row.traffic,
                sweep_of(row).setting(),
                row.utilization,
                row.policy,
                group.group,
                group.offered_requests,
                group.unsent_requests,
                group.served_requests,
                group.ttft_p50_s,
                group.ttft_p99_s,
                group.goodput_requests,
                group.goodput_fraction * 100.0,
                group.served_late_requests,
                group.rejected_requests,
                reason("queue_full"),
                reason("deadline_unmeetable"),
                reason("deadline_passed"),
                group.rejected_on_arrival_requests,
                group.rejected_late_requests,
                group.rejection_p50_s,
                group.rejection_p99_s,
                group.rejection_max_s,
                group.throughput_vs_capacity,
            );
        }
    }
    Some(out)
}

/// For a replica sweep with sync: per traffic, load, policy and replica
/// count (rows), p99 TTFT with one router and at every sync setting
/// (columns), each with its ratio to one router's (`1.478 (1.93×)`). Every
/// policy but the references has rows, so a policy that ignores other
/// replicas (it runs only without sync) is compared at the same replica
/// counts. `None` without rows under sync.
pub fn sync_table(report: &Report) -> Option<String> {
    let rows = &report.results;
    let synced = |row: &ResultRow| row.sync.is_some_and(|sync| !sync.is_off());
    if !rows
        .iter()
        .any(|row| synced(row) && row.router_replicas.is_some())
    {
        return None;
    }
    let references: Vec<&str> = PolicyName::REFERENCES.iter().map(|p| p.as_str()).collect();
    let policies: Vec<&str> = distinct(rows, |r| r.policy)
        .into_iter()
        .filter(|policy| !references.contains(policy))
        .collect();
    let mut replica_counts: Vec<u32> = Vec::new();
    let mut syncs: Vec<SyncConfig> = Vec::new();
    for row in rows {
        let (Some(replicas), Some(sync)) = (row.router_replicas, row.sync) else {
            continue;
        };
        if replicas > 1 {
            if !replica_counts.contains(&replicas) {
                replica_counts.push(replicas);
            }
            if !syncs.contains(&sync) {
                syncs.push(sync);
            }
        }
    }
    let mut out = String::from("| traffic | load | policy | 1 router | replicas |");
    for sync in &syncs {
        let _ = write!(out, " sync={} |", sync.label());
    }
    out.push_str("\n|---|---:|---|---:|---:|");
    for _ in &syncs {
        out.push_str("---:|");
    }
    out.push('\n');
    for traffic in distinct_traffic(rows) {
        for utilization in distinct(rows, |r| r.utilization) {
            for policy in &policies {
                let find = |replicas: u32, sync: SyncConfig| {
                    report.sync_row(&traffic, utilization, policy, replicas, sync)
                };
                let one = find(1, SyncConfig::default()).map(|row| row.ttft_p99_s);
                for &replicas in &replica_counts {
                    if syncs.iter().all(|&sync| find(replicas, sync).is_none()) {
                        continue;
                    }
                    let _ = write!(
                        out,
                        "| {traffic} | {utilization} | {policy} | {} | {replicas} |",
                        optional(one, 3)
                    );
                    for &sync in &syncs {
                        match find(replicas, sync) {
                            Some(row) => {
                                let _ = write!(out, " {:.3}", row.ttft_p99_s);
                                match one {
                                    Some(one) if one > 0.0 => {
                                        let _ = write!(out, " ({:.2}×) |", row.ttft_p99_s / one);
                                    }
                                    _ => out.push_str(" |"),
                                }
                            }
                            None => out.push_str(" - |"),
                        }
                    }
                    out.push('\n');
                }
            }
        }
    }
    Some(out)
}

/// For scenarios whose engines served prompt tokens from their prefix
/// caches: per row, the fleet's hit rate (served prompt tokens, as the
/// engines report them, over all prompt tokens), what the policy expected
/// over what was served, and with sync what the replicas shared of their
/// prefix indexes: placements applied and lost (copies to other replicas),
/// cache bounds shared, and the estimated bytes per second each replica
/// published. `None` when no engine served a cached token.
pub fn prefix_table(report: &Report) -> Option<String> {
    let rows = &report.results;
    if !rows.iter().any(|row| row.cached_tokens_reported > 0) {
        return None;
    }
    let with_sync = rows.iter().any(|row| row.sync_stats.is_some());
    let mut out =
        String::from("| traffic | setting | load | policy | hit rate | predicted ÷ served |");
    if with_sync {
        out.push_str(" placements applied | placements lost | bounds shared | KB/s per replica |");
    }
    out.push_str("\n|---|---|---:|---|---:|---:|");
    if with_sync {
        out.push_str("---:|---:|---:|---:|");
    }
    out.push('\n');
    for row in rows {
        let predicted = if row.cached_tokens_predicted > 0 && row.cached_tokens_reported > 0 {
            format!(
                "{:.2}",
                row.cached_tokens_predicted as f64 / row.cached_tokens_reported as f64
            )
        } else {
            "-".to_owned()
        };
        let _ = write!(
            out,
            "| {} | {} | {} | {} | {:.1}% | {predicted} |",
            row.traffic,
            sweep_of(row).setting(),
            row.utilization,
            row.policy,
            row.prefix_hit_rate * 100.0
        );
        if with_sync {
            match (row.sync_stats, row.prefix_bytes_per_replica_s) {
                (Some(stats), Some(bytes_s)) if stats.placements + stats.cache_bounds > 0 => {
                    let _ = write!(
                        out,
                        " {} | {} | {} | {:.1} |",
                        stats.placements_applied,
                        stats.placements_lost,
                        stats.cache_bounds,
                        bytes_s / 1000.0
                    );
                }
                _ => out.push_str(" - | - | - | - |"),
            }
        }
        out.push('\n');
    }
    Some(out)
}

/// One metric per policy (columns) for each traffic, setting and load
/// (rows), then `least_load`'s ratio to the best reference.
fn metric_table(
    report: &Report,
    value: impl Fn(&ResultRow) -> f64,
    vs_reference: impl Fn(&ResultRow) -> Option<f64>,
) -> String {
    let rows = &report.results;
    let policies = distinct(rows, |r| r.policy);
    let ratio_column = rows
        .iter()
        .any(|r| r.policy == "least_load" && vs_reference(r).is_some());
    let mut out = String::new();
    let _ = write!(out, "| traffic | setting | load |");
    for policy in &policies {
        let _ = write!(out, " {policy} |");
    }
    if ratio_column {
        let _ = write!(out, " least_load ÷ best ref |");
    }
    let _ = writeln!(out);
    let _ = write!(out, "|---|---|---:|");
    for _ in &policies {
        let _ = write!(out, "---:|");
    }
    if ratio_column {
        let _ = write!(out, "---:|");
    }
    let _ = writeln!(out);
    for traffic in distinct_traffic(rows) {
        let of_traffic: Vec<&ResultRow> = rows.iter().filter(|r| r.traffic == traffic).collect();
        let mut keys: Vec<(Sweep, f64)> = Vec::new();
        for row in &of_traffic {
            let key = (sweep_of(row), row.utilization);
            if !keys.contains(&key) {
                keys.push(key);
            }
        }
        for (sweep, utilization) in keys {
            let _ = write!(out, "| {traffic} | {} | {utilization} |", sweep.setting());
            let of_cell = |policy: &str| {
                of_traffic.iter().find(|r| {
                    r.policy == policy && sweep_of(r) == sweep && r.utilization == utilization
                })
            };
            for policy in &policies {
                match of_cell(policy) {
                    Some(row) => {
                        let _ = write!(out, " {:.3} |", value(row));
                    }
                    None => {
                        let _ = write!(out, " - |");
                    }
                }
            }
            if ratio_column {
                let _ = write!(
                    out,
                    " {} |",
                    ratio(of_cell("least_load").and_then(|row| vs_reference(row)))
                );
            }
            let _ = writeln!(out);
        }
    }
    out
}

/// Writes `<out_dir>/<scenario>/report.json`, `report.md` and (with
/// `plots`) the SVGs; returns the scenario's directory.
pub fn write_outputs(
    outcome: &ScenarioOutcome,
    out_dir: &Path,
    plots: bool,
) -> Result<PathBuf, SimError> {
    let report = &outcome.report;
    let dir = out_dir.join(&report.scenario);
    std::fs::create_dir_all(&dir).map_err(|source| SimError::Write {
        path: dir.clone(),
        source,
    })?;
    let mut json = serde_json::to_string_pretty(report)?;
    json.push('\n');
    write_file(&dir.join("report.json"), json.as_bytes())?;
    write_file(&dir.join("report.md"), markdown(report).as_bytes())?;
    if plots {
        write_plots(outcome, &dir)?;
    }
    Ok(dir)
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<(), SimError> {
    std::fs::write(path, bytes).map_err(|source| SimError::Write {
        path: path.to_owned(),
        source,
    })
}

fn plot_error<E: std::error::Error + Send + Sync + 'static>(
    path: &Path,
) -> impl FnOnce(E) -> SimError + '_ {
    move |error| SimError::Plot {
        path: path.to_owned(),
        source: Box::new(error),
    }
}

fn write_plots(outcome: &ScenarioOutcome, dir: &Path) -> Result<(), SimError> {
    write_rate_plots(outcome, dir)?;
    let rows = &outcome.report.results;
    for traffic in distinct_traffic(rows) {
        let indices: Vec<usize> = (0..rows.len())
            .filter(|&i| rows[i].traffic == traffic)
            .collect();
        let of_traffic: Vec<ResultRow> = indices.iter().map(|&i| rows[i].clone()).collect();
        let sweeps = distinct(&of_traffic, sweep_of);
        let utilizations = distinct(&of_traffic, |r| r.utilization);
        let policies = distinct(&of_traffic, |r| r.policy);
        for &sweep in &sweeps {
            // TTFT CDF per policy, one plot per load.
            for &utilization in &utilizations {
                let series: Vec<(&str, Vec<(f64, f64)>)> = indices
                    .iter()
                    .filter(|&&i| sweep_of(&rows[i]) == sweep && rows[i].utilization == utilization)
                    .map(|&i| {
                        let cdf = &outcome.ttft_cdfs_s[i];
                        let points = cdf
                            .iter()
                            .enumerate()
                            .map(|(k, &ttft)| (ttft.max(1e-4), k as f64 / (CDF_POINTS - 1) as f64))
                            .collect();
                        (rows[i].policy, points)
                    })
                    .collect();
                let path = dir.join(format!(
                    "ttft-cdf-{traffic}{}-u{utilization}.svg",
                    sweep.suffix()
                ));
                let title = format!(
                    "{traffic}: TTFT CDF at utilization {utilization}{}",
                    sweep.heading()
                );
                line_plot(
                    &path,
                    &title,
                    "TTFT (s)",
                    "fraction of requests",
                    true,
                    false,
                    &series,
                )?;
            }
            // p99 TTFT against load.
            let series: Vec<(&str, Vec<(f64, f64)>)> = policies
                .iter()
                .map(|&policy| {
                    let points = of_traffic
                        .iter()
                        .filter(|r| r.policy == policy && sweep_of(r) == sweep)
                        .map(|r| (r.utilization, r.ttft_p99_s.max(1e-4)))
                        .collect();
                    (policy, points)
                })
                .collect();
            let path = dir.join(format!(
                "p99-vs-utilization-{traffic}{}.svg",
                sweep.suffix()
            ));
            let title = format!("{traffic}: p99 TTFT against utilization{}", sweep.heading());
            line_plot(
                &path,
                &title,
                "utilization",
                "p99 TTFT (s)",
                false,
                true,
                &series,
            )?;
        }
        // p99 TTFT against the swept knob.
        if sweeps
            .iter()
            .any(|s| s.interval.is_some() || s.replicas.is_some())
        {
            let (name, axis, log_x) = match sweeps.first().map(|s| s.interval) {
                Some(None) => ("replicas", "router replicas", false),
                _ => ("poll-interval", "poll interval (s)", true),
            };
            // One line per policy and sync setting; the one-replica row
            // (no sync) starts every sync setting's line.
            let mut lines: Vec<(&str, Option<SyncConfig>)> = Vec::new();
            for row in &of_traffic {
                let line = (row.policy, row.sync);
                if !lines.contains(&line) {
                    lines.push(line);
                }
            }
            for &utilization in &utilizations {
                let series: Vec<(String, Vec<(f64, f64)>)> = lines
                    .iter()
                    .map(|&(policy, sync)| {
                        let points = of_traffic
                            .iter()
                            .filter(|r| {
                                r.policy == policy
                                    && r.utilization == utilization
                                    && (r.sync == sync || r.router_replicas == Some(1))
                            })
                            .map(|r| (sweep_of(r).value(), r.ttft_p99_s.max(1e-4)))
                            .collect();
                        let name = match sync {
                            Some(sync) => format!("{policy} sync={}", sync.label()),
                            None => policy.to_owned(),
                        };
                        (name, points)
                    })
                    .collect();
                let series: Vec<(&str, Vec<(f64, f64)>)> = series
                    .iter()
                    .map(|(name, points)| (name.as_str(), points.clone()))
                    .collect();
                let path = dir.join(format!("p99-vs-{name}-{traffic}-u{utilization}.svg"));
                let title =
                    format!("{traffic}: p99 TTFT against {axis} at utilization {utilization}");
                line_plot(&path, &title, axis, "p99 TTFT (s)", log_x, true, &series)?;
            }
        }
    }
    Ok(())
}

/// For cells with a slowdown: each policy replica's rate for the slowed
/// worker against its true prefill rate, over time, one plot per traffic,
/// setting and load (`rate-<traffic>[-sweep]-u<load>.svg`).
fn write_rate_plots(outcome: &ScenarioOutcome, dir: &Path) -> Result<(), SimError> {
    let rows = &outcome.report.results;
    let traced: Vec<usize> = (0..rows.len())
        .filter(|&i| matches!(outcome.rate_traces.get(i), Some(Some(_))))
        .collect();
    let mut cells: Vec<(String, Sweep, f64)> = Vec::new();
    for &i in &traced {
        let key = (
            rows[i].traffic.clone(),
            sweep_of(&rows[i]),
            rows[i].utilization,
        );
        if !cells.contains(&key) {
            cells.push(key);
        }
    }
    for (traffic, sweep, utilization) in cells {
        let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
        for &i in &traced {
            let row = &rows[i];
            if row.traffic != traffic || sweep_of(row) != sweep || row.utilization != utilization {
                continue;
            }
            let Some(Some(trace)) = outcome.rate_traces.get(i) else {
                continue;
            };
            if series.is_empty() {
                let truth = trace
                    .samples
                    .iter()
                    .map(|s| (s.time_s, s.true_prefill_tps))
                    .collect();
                series.push(("true prefill rate".to_owned(), truth));
            }
            let replicas = trace.replica_count();
            for replica in 0..replicas {
                let points: Vec<(f64, f64)> = trace
                    .samples
                    .iter()
                    .filter_map(|s| {
                        let tps = s.estimates_tps.get(replica).copied().flatten()?;
                        (tps.is_finite() && tps > 0.0).then_some((s.time_s, tps))
                    })
                    .collect();
                let name = if replicas > 1 {
                    format!("{} r{replica}", row.policy)
                } else {
                    row.policy.to_owned()
                };
                series.push((name, points));
            }
        }
        let path = dir.join(format!(
            "rate-{traffic}{}-u{utilization}.svg",
            sweep.suffix()
        ));
        let title = format!(
            "{traffic}: rate for the slowed worker at utilization {utilization}{}",
            sweep.heading()
        );
        let series: Vec<(&str, Vec<(f64, f64)>)> = series
            .iter()
            .map(|(name, points)| (name.as_str(), points.clone()))
            .collect();
        line_plot(
            &path,
            &title,
            "time (s)",
            "rate (tokens/s)",
            false,
            true,
            &series,
        )?;
    }
    Ok(())
}

fn bounds(values: impl Iterator<Item = f64>, log: bool) -> (f64, f64) {
    let (mut low, mut high) = (f64::INFINITY, f64::NEG_INFINITY);
    for value in values {
        low = low.min(value);
        high = high.max(value);
    }
    if !low.is_finite() || !high.is_finite() {
        return (0.1, 1.0);
    }
    if log {
        (low / 1.2, high * 1.2)
    } else if high > low {
        let pad = (high - low) * 0.05;
        (low - pad, high + pad)
    } else {
        (low - 0.5, high + 0.5)
    }
}

fn line_plot(
    path: &Path,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    log_x: bool,
    log_y: bool,
    series: &[(&str, Vec<(f64, f64)>)],
) -> Result<(), SimError> {
    let (x_low, x_high) = bounds(
        series.iter().flat_map(|(_, p)| p.iter().map(|q| q.0)),
        log_x,
    );
    let (y_low, y_high) = if log_y {
        bounds(series.iter().flat_map(|(_, p)| p.iter().map(|q| q.1)), true)
    } else {
        (0.0, 1.0)
    };
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_error(path))?;
    let mut builder = ChartBuilder::on(&root);
    builder
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(65);
    // One code path per axis kind (plotters types the coordinates).
    macro_rules! draw {
        ($x:expr, $y:expr) => {{
            let mut chart = builder
                .build_cartesian_2d($x, $y)
                .map_err(plot_error(path))?;
            chart
                .configure_mesh()
                .x_desc(x_desc)
                .y_desc(y_desc)
                .draw()
                .map_err(plot_error(path))?;
            for (index, (name, points)) in series.iter().enumerate() {
                let colour = COLOURS[index % COLOURS.len()];
                chart
                    .draw_series(LineSeries::new(
                        points.iter().copied(),
                        colour.stroke_width(2),
                    ))
                    .map_err(plot_error(path))?
                    .label(*name)
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2))
                    });
            }
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperLeft)
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .draw()
                .map_err(plot_error(path))?;
        }};
    }
    match (log_x, log_y) {
        (true, true) => draw!((x_low..x_high).log_scale(), (y_low..y_high).log_scale()),
        (true, false) => draw!((x_low..x_high).log_scale(), y_low..y_high),
        (false, true) => draw!(x_low..x_high, (y_low..y_high).log_scale()),
        (false, false) => draw!(x_low..x_high, y_low..y_high),
    }
    root.present().map_err(plot_error(path))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{AdmissionOrder, RunOptions, Scenario, run_scenarios};

    const SCENARIO: &str = r#"
name = "tiny"
seed = 3
requests = 300
utilizations = [0.5, 0.8]
policies = ["round_robin", "least_load", "oracle"]
[[fleet]]
count = 2
flavour = "sglang"
[router]
sweep_poll_interval_s = [0.5, 2.0]
[[traffic]]
name = "size-skew"
arrival = { process = "poisson" }
prompt = { dist = "bimodal", short_tokens = 200, long_tokens = 2000, long_fraction = 0.1 }
output = { dist = "constant", tokens = 8 }
"#;

    #[test]
    fn outputs_are_written_with_a_table_per_load_and_sweep_point() {
        let scenario =
            Scenario::from_toml_str(SCENARIO, Path::new("tiny.toml"), PathBuf::new()).unwrap();
        let options = RunOptions {
            threads: 2,
            progress: false,
        };
        let outcomes = run_scenarios(&[scenario], &options).unwrap();
        let report = &outcomes[0].report;
        assert_eq!(report.results.len(), 2 * 2 * 3);
        assert!(
            report
                .results
                .iter()
                .all(|r| r.poll_interval_s.is_some() && r.router_replicas.is_none())
        );
        let md = markdown(report);
        assert_eq!(md.matches("| policy | TTFT p50 (s)").count(), 4, "{md}");
        assert!(
            md.contains("## size-skew, utilization 0.8, poll interval 2 s"),
            "{md}"
        );
        let summary = summary_table(report);
        assert!(
            summary.contains("| size-skew | poll 0.5 s | 0.5 |"),
            "{summary}"
        );
        let dir =
            std::env::temp_dir().join(format!("fleet-sim-report-test-{}", std::process::id()));
        let written = write_outputs(&outcomes[0], &dir, true).unwrap();
        for file in [
            "report.json",
            "report.md",
            "ttft-cdf-size-skew-poll2s-u0.8.svg",
            "p99-vs-utilization-size-skew-poll0.5s.svg",
            "p99-vs-poll-interval-size-skew-u0.5.svg",
        ] {
            let path = written.join(file);
            assert!(path.exists(), "{} missing", path.display());
        }
        let json = std::fs::read_to_string(written.join("report.json")).unwrap();
        assert!(json.contains("\"poll_interval_s\": 2.0"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_sync_sweep_reports_each_setting_and_a_ratio_to_one_router() {
        let text = SCENARIO
            .replace("name = \"tiny\"", "name = \"tiny-sync\"")
            .replace("count = 2", "count = 4")
            .replace("utilizations = [0.5, 0.8]", "utilizations = [0.8]")
            .replace(
                "sweep_poll_interval_s = [0.5, 2.0]",
                "sweep_replicas = [1, 2]\nsweep_sync = [{ mode = \"off\" }, { mode = \"ideal\" }]",
            );
        let scenario =
            Scenario::from_toml_str(&text, Path::new("tiny-sync.toml"), PathBuf::new()).unwrap();
        let options = RunOptions {
            threads: 2,
            progress: false,
        };
        let outcomes = run_scenarios(&[scenario], &options).unwrap();
        let report = &outcomes[0].report;
        // One router: 3 policies; 2 replicas without sync: 3; with ideal
        // sync, only least_load (round_robin ignores it, the oracle too).
        let labels: Vec<(&str, u32, String)> = report
            .results
            .iter()
            .map(|r| {
                (
                    r.policy,
                    r.router_replicas.unwrap(),
                    r.sync_label().unwrap(),
                )
            })
            .collect();
        assert_eq!(labels.len(), 7, "{labels:?}");
        assert!(labels.contains(&("least_load", 2, "ideal".to_owned())));
        assert!(!labels.contains(&("round_robin", 2, "ideal".to_owned())));
        let ideal = report
            .sync_row("size-skew", 0.8, "least_load", 2, SyncConfig::Ideal {})
            .unwrap();
        assert!(ideal.ttft_p99_vs_best_reference.is_some());
        assert!(
            ideal
                .sync_stats
                .is_some_and(|stats| stats.entries_applied > 0)
        );
        let summary = summary_table(report);
        assert!(
            summary.contains("| size-skew | 2 replicas, sync=ideal | 0.8 |"),
            "{summary}"
        );
        let table = sync_table(report).unwrap();
        assert!(
            table.contains("| 1 router | replicas | sync=off | sync=ideal |"),
            "{table}"
        );
        let one = report
            .sync_row("size-skew", 0.8, "least_load", 1, SyncConfig::Off {})
            .unwrap()
            .ttft_p99_s;
        let off = report
            .sync_row("size-skew", 0.8, "least_load", 2, SyncConfig::Off {})
            .unwrap()
            .ttft_p99_s;
        // One row per policy and replica count, a column per sync setting.
        assert!(
            table.contains(&format!(
                "| size-skew | 0.8 | least_load | {one:.3} | 2 | {off:.3} ({:.2}×) | {:.3} ({:.2}×) |",
                off / one,
                ideal.ttft_p99_s,
                ideal.ttft_p99_s / one
            )),
            "{table}"
        );
        // A policy that ignores sync has its replica row without sync only.
        assert!(
            table.contains("| size-skew | 0.8 | round_robin |") && table.contains(" - |\n"),
            "{table}"
        );
        assert!(!table.contains("| oracle |"), "{table}");
        // Without prefixes nothing is cached: no prefix table.
        assert!(prefix_table(report).is_none());
        assert!(
            markdown(report)
                .contains("## size-skew, utilization 0.8, 2 router replicas, sync=ideal")
        );
        let dir =
            std::env::temp_dir().join(format!("fleet-sim-sync-report-test-{}", std::process::id()));
        let written = write_outputs(&outcomes[0], &dir, true).unwrap();
        for file in [
            "ttft-cdf-size-skew-r2-syncideal-u0.8.svg",
            "p99-vs-replicas-size-skew-u0.8.svg",
        ] {
            let path = written.join(file);
            assert!(path.exists(), "{} missing", path.display());
        }
        let json = std::fs::read_to_string(written.join("report.json")).unwrap();
        assert!(json.contains("\"mode\": \"ideal\""), "{json}");
        let _ = std::fs::remove_dir_all(&dir);
        // Without sync, no sync table.
        let plain =
            Scenario::from_toml_str(SCENARIO, Path::new("tiny.toml"), PathBuf::new()).unwrap();
        let outcomes = run_scenarios(&[plain], &options).unwrap();
        assert!(sync_table(&outcomes[0].report).is_none());
    }

    #[test]
    fn an_admission_sweep_reports_what_became_of_each_class_and_tenant() {
        let text = SCENARIO
            .replace("name = \"tiny\"", "name = \"tiny-admission\"\ncapacity = \"measured\"")
            .replace("requests = 300", "requests = 600")
            .replace("utilizations = [0.5, 0.8]", "utilizations = [1.2]")
            .replace(
                "sweep_poll_interval_s = [0.5, 2.0]",
                "poll_interval_s = 0.2\n[router.admission]\nsweep_order = [\"off\", \"fair_share\"]",
            )
            .replace(
                "output = { dist = \"constant\", tokens = 8 }",
                "output = { dist = \"constant\", tokens = 8 }\n\
                 classes = [{ priority = 0, share = 1 }, { priority = 1, share = 1, ttft_deadline_s = 1.0 }]\n\
                 tenants = [{ name = \"A\", share = 3 }, { name = \"B\", share = 1, alone = true }]",
            );
        let scenario =
            Scenario::from_toml_str(&text, Path::new("tiny-admission.toml"), PathBuf::new())
                .unwrap();
        let options = RunOptions {
            threads: 2,
            progress: false,
        };
        let outcomes = run_scenarios(&[scenario], &options).unwrap();
        let report = &outcomes[0].report;
        // Without a room: 3 policies; with it, only least_load (round_robin
        // has no model of wait, the oracle no policy); for the mix and B alone.
        let rows: Vec<(&str, &str, Option<&str>)> = report
            .results
            .iter()
            .map(|r| (r.traffic.as_str(), r.policy, r.admission))
            .collect();
        assert_eq!(rows.len(), 8, "{rows:?}");
        assert!(rows.contains(&("size-skew-B-alone", "least_load", Some("fair_share"))));
        assert!(!rows.contains(&("size-skew", "round_robin", Some("fair_share"))));
        let capacity = &report.capacity[0];
        assert!(capacity.formula_capacity_rps.is_some() && capacity.capacity_rps > 0.0);
        let mix = report
            .admission_row("size-skew", 1.2, "least_load", AdmissionOrder::FairShare)
            .unwrap();
        let all = mix.outcomes.as_ref().unwrap();
        assert_eq!(all.offered_requests, 600);
        assert_eq!(
            all.served_requests + all.rejected_requests,
            600,
            "every request is served or turned away"
        );
        assert_eq!(mix.requests, all.served_requests);
        let groups: Vec<&str> = mix
            .by_class
            .iter()
            .chain(&mix.by_tenant)
            .map(|g| g.group.as_str())
            .collect();
        assert_eq!(groups, ["priority 0", "priority 1", "tenant A", "tenant B"]);
        assert!(all.throughput_vs_capacity > 0.0);
        // B alone: the same B requests, at B's share of the rate.
        let alone = report
            .admission_row("size-skew-B-alone", 1.2, "least_load", AdmissionOrder::Off)
            .unwrap();
        let b = &mix.by_tenant[1];
        assert_eq!(
            alone.outcomes.as_ref().unwrap().offered_requests,
            b.offered_requests
        );
        assert_eq!(alone.by_tenant.len(), 1);
        let share = b.offered_requests as f64 / 600.0;
        assert!((alone.arrival_rate_rps / mix.arrival_rate_rps - share).abs() < 1e-9);
        let md = markdown(report);
        assert!(md.contains("## Requests served and turned away"), "{md}");
        assert!(
            md.contains("| size-skew | admission=fair_share | 1.2 | least_load | tenant B |"),
            "{md}"
        );
        assert!(md.contains("measured (the formula's"), "{md}");
        assert!(summary_table(report).contains("| size-skew | admission=off | 1.2 |"));
        let json = serde_json::to_string(report).unwrap();
        assert!(json.contains("\"by_tenant\"") && json.contains("\"admission\":\"fair_share\""));
    }

    #[test]
    fn a_prefix_sweep_reports_hit_rates_and_what_the_replicas_shared() {
        let text = SCENARIO
            .replace("name = \"tiny\"", "name = \"tiny-prefix\"")
            .replace("count = 2", "count = 4")
            .replace("utilizations = [0.5, 0.8]", "utilizations = [0.8]")
            .replace(
                "sweep_poll_interval_s = [0.5, 2.0]",
                "sweep_replicas = [1, 2]\nsweep_sync = [{ mode = \"off\" }, \
                 { mode = \"periodic\", publish_interval_s = 0.02, publish_dispatches = true }]",
            )
            .replace(
                "output = { dist = \"constant\", tokens = 8 }",
                "output = { dist = \"constant\", tokens = 8 }\n\
                 shared_prefix = { fraction = 0.9, tokens = 1024, groups = 4 }",
            );
        let scenario =
            Scenario::from_toml_str(&text, Path::new("tiny-prefix.toml"), PathBuf::new()).unwrap();
        let options = RunOptions {
            threads: 2,
            progress: false,
        };
        let outcomes = run_scenarios(&[scenario], &options).unwrap();
        let report = &outcomes[0].report;
        let sync = SyncConfig::Periodic {
            publish_interval_s: 0.02,
            latency_s: crate::DEFAULT_SYNC_LATENCY_S,
            loss_ratio: 0.0,
            entry_ttl_s: crate::DEFAULT_SYNC_ENTRY_TTL_S,
            publish_dispatches: true,
        };
        let shared = report
            .sync_row("size-skew", 0.8, "least_load", 2, sync)
            .unwrap();
        let stats = shared.sync_stats.unwrap();
        assert!(stats.placements > 0 && stats.placements_applied == stats.placements);
        assert!(shared.prefix_hit_rate > 0.0 && shared.cached_tokens_predicted > 0);
        assert!(shared.prefix_bytes_per_replica_s.is_some_and(|b| b > 0.0));
        let table = prefix_table(report).unwrap();
        assert!(table.contains("| KB/s per replica |"), "{table}");
        assert!(
            table.contains(&format!(
                "| size-skew | 2 replicas, sync=20ms+dispatches | 0.8 | least_load | {:.1}% |",
                shared.prefix_hit_rate * 100.0
            )),
            "{table}"
        );
        let md = markdown(report);
        assert!(md.contains("## Prefix caches"), "{md}");
        assert!(summary_table(report).contains("| KB/s per replica |"));
        let json = serde_json::to_string(report).unwrap();
        for key in [
            "\"prefix_hit_rate\"",
            "\"cached_tokens_reported\"",
            "\"cached_tokens_predicted\"",
            "\"prefix_bytes_per_replica_s\"",
            "\"placements_applied\"",
        ] {
            assert!(json.contains(key), "{key} missing");
        }
    }
}
