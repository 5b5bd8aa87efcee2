//! Selection cost: runs the criterion benchmarks of `policy-least-load` and
//! turns criterion's `estimates.json` / `sample.json` into rows.
//!
//! Criterion writes under `target/bench/criterion` (`CRITERION_HOME`), not
//! the shared `target/criterion`, so results of other engineers' runs in the
//! same target directory can never be mistaken for this run's.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::Options;
use super::report::{MAX_RUN_SPREAD, Row};

/// The original design's name in the benchmark ids.
const BASELINE: &str = "original";

/// How many more times a benchmark whose samples disagree is measured,
/// alone, before its row is FAILED. Interference on a shared machine comes
/// in stretches: the same benchmark measured again a minute later, with
/// nothing else of the bench beside it, usually meets a quiet one. Each
/// attempt's samples must agree on their own, and the row says how many
/// attempts it took and how far apart the earlier ones' samples were.
pub(crate) const RETRIES: usize = 2;

pub(crate) fn run(options: &Options, out_dir: &Path) -> Result<Vec<Row>, String> {
    let home = out_dir.join("criterion");
    if home.exists() {
        std::fs::remove_dir_all(&home)
            .map_err(|error| format!("cannot clear {}: {error}", home.display()))?;
    }
    measure(options, &home, None)?;
    let mut results = read_all(&home)?;
    // Full id → the spreads of its attempts that disagreed.
    let mut earlier: HashMap<String, Vec<f64>> = HashMap::new();
    for _ in 0..RETRIES {
        let noisy: Vec<&Estimate> = results.iter().filter(|e| !e.agrees()).collect();
        if noisy.is_empty() {
            break;
        }
        for estimate in &noisy {
            earlier
                .entry(estimate.full_id.clone())
                .or_default()
                .push(estimate.spread_p10_p90);
        }
        let ids: Vec<&str> = noisy.iter().map(|e| e.full_id.as_str()).collect();
        measure(options, &home, Some(&exact_filter(&ids)))?;
        results = read_all(&home)?;
    }
    for estimate in &mut results {
        estimate.earlier_spreads = earlier.remove(&estimate.full_id).unwrap_or_default();
    }
    Ok(rows(&results))
}

/// Runs the `select` benchmarks, those `filter` matches if given, with
/// their results under `home`. A benchmark measured again replaces its
/// earlier result there.
fn measure(options: &Options, home: &Path, filter: Option<&str>) -> Result<(), String> {
    let mut bench = super::super::cargo();
    bench
        .args([
            "bench",
            "-p",
            "policy-least-load",
            "--bench",
            "select",
            "--",
        ])
        .args(["--warm-up-time", "1", "--measurement-time"])
        .arg(options.measurement_time_s.to_string())
        .args(filter)
        .env("CRITERION_HOME", home);
    super::super::run(
        &format!(
            "cargo bench -p policy-least-load --bench select -- --warm-up-time 1 --measurement-time {}{}",
            options.measurement_time_s,
            filter.map(|f| format!(" '{f}'")).unwrap_or_default()
        ),
        bench,
    )
}

/// Every result under `home`.
fn read_all(home: &Path) -> Result<Vec<Estimate>, String> {
    let mut results = Vec::new();
    for group in ["select", "calibration"] {
        results.extend(read_group(&home.join(group))?);
    }
    if results.is_empty() {
        return Err(format!(
            "criterion wrote no results under {}",
            home.display()
        ));
    }
    Ok(results)
}

/// A criterion filter (a regular expression over benchmark ids) that
/// matches exactly `ids`.
fn exact_filter(ids: &[&str]) -> String {
    let escaped: Vec<String> = ids
        .iter()
        .map(|id| {
            id.chars()
                .flat_map(|c| {
                    let meta = "\\.+*?()|[]{}^$#&-~".contains(c);
                    meta.then_some('\\').into_iter().chain([c])
                })
                .collect()
        })
        .collect();
    format!("^({})$", escaped.join("|"))
}

/// One benchmark's summary.
#[derive(Debug, Clone)]
struct Estimate {
    /// `select/least_load/64/2-thread`.
    full_id: String,
    median_ns: f64,
    mean_ns: f64,
    samples: usize,
    /// max / min of the samples' time per iteration.
    spread: f64,
    /// 90th / 10th percentile of the same: how much the samples disagree,
    /// one stray sample aside.
    spread_p10_p90: f64,
    /// The p90/p10 spreads of the earlier attempts at this benchmark, whose
    /// samples disagreed ([`RETRIES`]).
    earlier_spreads: Vec<f64>,
}

impl Estimate {
    /// Whether the samples agree well enough for the median to mean
    /// something (between the 10th and 90th percentile, so one stray
    /// sample does not fail a row).
    fn agrees(&self) -> bool {
        self.spread_p10_p90 <= MAX_RUN_SPREAD
    }
}

fn read_json(path: &Path) -> Result<Value, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|error| format!("cannot read {}: {error}", path.display()))?;
    serde_json::from_str(&text).map_err(|error| format!("{}: {error}", path.display()))
}

fn read_group(dir: &Path) -> Result<Vec<Estimate>, String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(Vec::new());
    };
    let mut dirs: Vec<PathBuf> = entries
        .flatten()
        .map(|entry| entry.path().join("new"))
        .filter(|path| path.join("benchmark.json").is_file())
        .collect();
    dirs.sort();
    dirs.iter().map(|dir| read_one(dir)).collect()
}

fn read_one(dir: &Path) -> Result<Estimate, String> {
    let benchmark = read_json(&dir.join("benchmark.json"))?;
    let estimates = read_json(&dir.join("estimates.json"))?;
    let sample = read_json(&dir.join("sample.json"))?;
    let number = |value: &Value, pointer: &str| {
        value
            .pointer(pointer)
            .and_then(Value::as_f64)
            .ok_or_else(|| format!("{}: no {pointer}", dir.display()))
    };
    let full_id = benchmark
        .get("full_id")
        .and_then(Value::as_str)
        .ok_or_else(|| format!("{}: no full_id", dir.display()))?
        .to_owned();
    let iters = sample.get("iters").and_then(Value::as_array);
    let times = sample.get("times").and_then(Value::as_array);
    let per_iter: Vec<f64> = match (iters, times) {
        (Some(iters), Some(times)) => iters
            .iter()
            .zip(times)
            .filter_map(|(n, t)| Some(t.as_f64()? / n.as_f64()?))
            .collect(),
        _ => Vec::new(),
    };
    let mut sorted: Vec<f64> = per_iter.iter().copied().filter(|t| t.is_finite()).collect();
    sorted.sort_by(f64::total_cmp);
    let at = |fraction: f64| {
        let index = ((sorted.len().saturating_sub(1)) as f64 * fraction).round() as usize;
        sorted.get(index).copied().unwrap_or(f64::NAN)
    };
    Ok(Estimate {
        full_id,
        median_ns: number(&estimates, "/median/point_estimate")?,
        mean_ns: number(&estimates, "/mean/point_estimate")?,
        samples: per_iter.len(),
        spread: super::spread(&per_iter),
        spread_p10_p90: at(0.9) / at(0.1),
        earlier_spreads: Vec::new(),
    })
}

/// `select/<policy>/<workers>[/2-thread]` → (policy, rest after the policy).
fn split(full_id: &str) -> Option<(&str, &str)> {
    let rest = full_id.strip_prefix("select/")?;
    rest.split_once('/')
}

fn rows(results: &[Estimate]) -> Vec<Row> {
    // A baseline whose own samples disagree has no median to divide by.
    let baseline = |suffix: &str| {
        results
            .iter()
            .find(|e| split(&e.full_id) == Some((BASELINE, suffix)))
            .filter(|e| e.agrees())
            .map(|e| e.median_ns)
    };
    let mut ordered: Vec<&Estimate> = results.iter().collect();
    // By fleet size, then thread count, then policy: comparable rows together.
    ordered.sort_by_key(|e| {
        let (policy, suffix) = split(&e.full_id).unwrap_or(("", &e.full_id));
        let workers: u64 = suffix
            .split('/')
            .next()
            .and_then(|w| w.parse().ok())
            .unwrap_or(0);
        (
            !e.full_id.starts_with("select/"),
            workers,
            suffix.ends_with("2-thread"),
            policy == BASELINE,
            e.full_id.clone(),
        )
    });
    ordered
        .into_iter()
        .map(|e| {
            // Criterion's samples are this row's runs: past the agreement
            // limit its median means nothing.
            let agrees = e.agrees();
            let shown = |value: f64| if agrees { value } else { f64::NAN };
            let mut row = Row::new(e.full_id.clone())
                .num("ns_per_op", shown(e.median_ns))
                .num("mean_ns", shown(e.mean_ns));
            if let Some((_, suffix)) = split(&e.full_id) {
                let vs = baseline(suffix).map_or(f64::NAN, |base| base / e.median_ns);
                row = row.num("vs_baseline", shown(vs));
            }
            row = row
                .int("runs", e.samples as u64)
                .num("spread", e.spread)
                .num("spread_p10_p90", e.spread_p10_p90)
                .int("attempts", 1 + e.earlier_spreads.len() as u64);
            let earlier = if e.earlier_spreads.is_empty() {
                String::new()
            } else {
                let spreads: Vec<String> = e
                    .earlier_spreads
                    .iter()
                    .map(|spread| format!("{spread:.2}×"))
                    .collect();
                format!(
                    " in attempt {} (the earlier: {})",
                    1 + e.earlier_spreads.len(),
                    spreads.join(", ")
                )
            };
            if !agrees {
                row = row.fail(format!(
                    "criterion's samples disagree by {:.2}× between the 10th and 90th percentile (> {MAX_RUN_SPREAD}×){earlier}: no median",
                    e.spread_p10_p90
                ));
            }
            row
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn estimate(full_id: &str, median_ns: f64) -> Estimate {
        Estimate {
            full_id: full_id.to_owned(),
            median_ns,
            mean_ns: median_ns,
            samples: 100,
            spread: 1.1,
            spread_p10_p90: 1.05,
            earlier_spreads: Vec::new(),
        }
    }

    #[test]
    fn speedup_is_against_the_original_of_the_same_size_and_threads() {
        let rows = rows(&[
            estimate("select/least_load/64", 100.0),
            estimate("select/original/64", 400.0),
            estimate("select/least_load/64/2-thread", 50.0),
            estimate("select/original/64/2-thread", 500.0),
        ]);
        let vs =
            |name: &str| super::super::report::find(&rows, name).and_then(|r| r.get("vs_baseline"));
        assert_eq!(vs("select/least_load/64"), Some(4.0));
        assert_eq!(vs("select/least_load/64/2-thread"), Some(10.0));
        assert_eq!(vs("select/original/64"), Some(1.0));
    }

    #[test]
    fn no_speedup_against_an_original_whose_samples_disagree() {
        let mut noisy = estimate("select/original/64/2-thread", 500.0);
        noisy.spread_p10_p90 = 2.0;
        let rows = rows(&[estimate("select/least_load/64/2-thread", 50.0), noisy]);
        let row = super::super::report::find(&rows, "select/least_load/64/2-thread");
        assert_eq!(row.and_then(|r| r.get("vs_baseline")), None);
        assert!(
            row.is_some_and(|r| r.failures().is_empty()),
            "its own median stands"
        );
    }

    #[test]
    fn the_filter_matches_exactly_the_ids_it_names() {
        let filter = exact_filter(&["select/least_load/64", "select/least_load/64/2-thread"]);
        assert_eq!(
            filter,
            r"^(select/least_load/64|select/least_load/64/2\-thread)$"
        );
        assert_eq!(exact_filter(&["a.b(c)"]), r"^(a\.b\(c\))$");
    }

    #[test]
    fn a_row_measured_again_says_how_many_attempts_it_took() {
        let mut retried = estimate("select/least_load/64", 100.0);
        retried.earlier_spreads = vec![1.8];
        let mut still_noisy = estimate("select/least_load/1024", 2000.0);
        still_noisy.earlier_spreads = vec![1.7, 2.1];
        still_noisy.spread_p10_p90 = 1.6;
        let rows = rows(&[retried, still_noisy, estimate("select/original/64", 400.0)]);
        let find = |name: &str| super::super::report::find(&rows, name);
        let agreed = find("select/least_load/64");
        assert_eq!(agreed.and_then(|r| r.get("attempts")), Some(2.0));
        assert_eq!(agreed.and_then(|r| r.get("ns_per_op")), Some(100.0));
        assert!(agreed.is_some_and(|r| r.failures().is_empty()));
        let failed = find("select/least_load/1024");
        assert_eq!(failed.and_then(|r| r.get("attempts")), Some(3.0));
        assert_eq!(failed.and_then(|r| r.get("ns_per_op")), None);
        assert_eq!(
            failed.map(|r| r.failures().to_vec()),
            Some(vec![
                "criterion's samples disagree by 1.60× between the 10th and 90th percentile (> 1.5×) in attempt 3 (the earlier: 1.70×, 2.10×): no median".to_owned()
            ])
        );
    }
}
