//! Selection cost: runs the criterion benchmarks of `policy-least-load` and
//! turns criterion's `estimates.json` / `sample.json` into rows.
//!
//! Criterion writes under `target/bench/criterion` (`CRITERION_HOME`), not
//! the shared `target/criterion`, so results of other engineers' runs in the
//! same target directory can never be mistaken for this run's.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::Options;
use super::report::{MAX_RUN_SPREAD, Row};

/// The original design's name in the benchmark ids.
const BASELINE: &str = "original";

pub(crate) fn run(options: &Options, out_dir: &Path) -> Result<Vec<Row>, String> {
    let home = out_dir.join("criterion");
    if home.exists() {
        std::fs::remove_dir_all(&home)
            .map_err(|error| format!("cannot clear {}: {error}", home.display()))?;
    }
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
        .env("CRITERION_HOME", &home);
    super::super::run(
        &format!(
            "cargo bench -p policy-least-load --bench select -- --warm-up-time 1 --measurement-time {}",
            options.measurement_time_s
        ),
        bench,
    )?;
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
    Ok(rows(&results))
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
            .filter(|e| e.spread_p10_p90 <= MAX_RUN_SPREAD)
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
            // limit (between the 10th and 90th percentile, so one stray
            // sample does not fail a row) its median means nothing.
            let agrees = e.spread_p10_p90 <= MAX_RUN_SPREAD;
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
                .num("spread_p10_p90", e.spread_p10_p90);
            if !agrees {
                row = row.fail(format!(
                    "criterion's samples disagree by {:.2}× between the 10th and 90th percentile (> {MAX_RUN_SPREAD}×): no median",
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
}
