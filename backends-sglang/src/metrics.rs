//! SGLang's Prometheus `/metrics` gauges as a [`WorkerLoad`], for servers
//! without `/v1/loads`.

use std::collections::BTreeMap;

use load_protocols::{
    LoadValidationError, Sample, SchedulerLoadSnapshot, WorkerLoad, parse_prometheus_text,
};

use crate::MetricsError;

/// The metric prefixes SGLang has used: `sglang:` up to 0.5.3, `sglang_` from
/// 0.5.4 on. When a text carries load gauges under both, the newer one wins, so
/// nothing is counted twice.
pub const METRIC_PREFIXES: [&str; 2] = ["sglang_", "sglang:"];

const RUNNING: &str = "num_running_reqs";
const WAITING: &str = "num_queue_reqs";
const TOKEN_USAGE: &str = "token_usage";
const THROUGHPUT: &str = "gen_throughput";
const CACHE_HIT_RATE: &str = "cache_hit_rate";
const UTILIZATION: &str = "utilization";
const GAUGES: [&str; 6] = [
    RUNNING,
    WAITING,
    TOKEN_USAGE,
    THROUGHPUT,
    CACHE_HIT_RATE,
    UTILIZATION,
];

/// Parses a `/metrics` text and converts it with [`worker_load_from_metrics`].
pub fn worker_load_from_metrics_text(text: &str) -> Result<WorkerLoad, MetricsError> {
    worker_load_from_metrics(&parse_prometheus_text(text)?)
}

/// SGLang's load gauges as a [`WorkerLoad`], one rank per `dp_rank` label
/// value (series without the label are rank 0).
///
/// Within a rank, the series of each gauge (one per label set: model, TP rank,
/// …) are combined: request counts and `gen_throughput` are summed,
/// `token_usage`, `cache_hit_rate` and `utilization` averaged. No waiting-token
/// gauge exists, so queued tokens are not reported (`None`); throughput is
/// reported when its gauge is present. Every other family, histogram,
/// counter and `_created` series is ignored.
///
/// A NaN or infinite request count, or a NaN, infinite or negative
/// `token_usage`, rejects the report; see [`WorkerLoad::from_ranks`] for the
/// other rules.
pub fn worker_load_from_metrics(samples: &[Sample]) -> Result<WorkerLoad, MetricsError> {
    let prefix = METRIC_PREFIXES
        .into_iter()
        .find(|prefix| {
            samples
                .iter()
                .any(|sample| gauge_of(sample, prefix).is_some())
        })
        .ok_or(MetricsError::NoLoadGauges)?;

    let mut ranks: BTreeMap<i64, RankGauges> = BTreeMap::new();
    for sample in samples {
        let Some(gauge) = gauge_of(sample, prefix) else {
            continue;
        };
        let dp_rank = sample
            .label("dp_rank")
            .and_then(|rank| rank.trim().parse::<i64>().ok())
            .unwrap_or(0);
        ranks
            .entry(dp_rank)
            .or_default()
            .series
            .entry(gauge)
            .or_default()
            .add(sample.value);
    }
    let snapshots = ranks
        .into_iter()
        .map(|(dp_rank, gauges)| gauges.snapshot(dp_rank))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(WorkerLoad::from_ranks(snapshots)?)
}

fn gauge_of(sample: &Sample, prefix: &str) -> Option<&'static str> {
    let name = sample.name.strip_prefix(prefix)?;
    GAUGES.into_iter().find(|gauge| *gauge == name)
}

#[derive(Debug, Default)]
struct RankGauges {
    series: BTreeMap<&'static str, Series>,
}

#[derive(Debug, Default, Clone, Copy)]
struct Series {
    sum: f64,
    count: u32,
}

impl Series {
    fn add(&mut self, value: f64) {
        self.sum += value;
        self.count += 1;
    }

    fn mean(self) -> f64 {
        self.sum / f64::from(self.count.max(1))
    }
}

impl RankGauges {
    fn sum(&self, gauge: &str) -> Option<f64> {
        self.series.get(gauge).map(|series| series.sum)
    }

    fn mean(&self, gauge: &str) -> Option<f64> {
        self.series.get(gauge).map(|series| series.mean())
    }

    fn count(&self, dp_rank: i64, gauge: &'static str) -> Result<i64, LoadValidationError> {
        let value = self.sum(gauge).unwrap_or(0.0);
        if !value.is_finite() {
            return Err(LoadValidationError::NonFinite {
                dp_rank,
                field: gauge,
                value,
            });
        }
        // Saturating; a negative count stays negative so validation names it.
        Ok(value.round() as i64)
    }

    fn snapshot(&self, dp_rank: i64) -> Result<SchedulerLoadSnapshot, LoadValidationError> {
        let num_running_reqs = self.count(dp_rank, RUNNING)?;
        let num_waiting_reqs = self.count(dp_rank, WAITING)?;
        Ok(SchedulerLoadSnapshot {
            dp_rank,
            num_running_reqs,
            num_waiting_reqs,
            num_waiting_uncached_tokens: None,
            num_total_reqs: num_running_reqs.saturating_add(num_waiting_reqs),
            token_usage: self.mean(TOKEN_USAGE).unwrap_or(0.0),
            gen_throughput: self.sum(THROUGHPUT),
            cache_hit_rate: self.mean(CACHE_HIT_RATE).unwrap_or(0.0),
            utilization: self.mean(UTILIZATION).unwrap_or(0.0),
            ..SchedulerLoadSnapshot::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_prefixes_newer_wins() {
        let old = "sglang:num_queue_reqs 4\nsglang:token_usage 0.5\n";
        let load = worker_load_from_metrics_text(old).unwrap();
        assert_eq!(load.waiting_requests(), 4);
        assert_eq!(load.kv_usage_ratio(), 0.5);
        assert_eq!(load.queued_tokens(), None);
        assert_eq!(load.throughput_tps(), None);

        let both = "sglang:num_queue_reqs 4\nsglang_num_queue_reqs 6\n";
        let load = worker_load_from_metrics_text(both).unwrap();
        assert_eq!(load.waiting_requests(), 6);
    }

    #[test]
    fn no_gauges_is_an_error() {
        assert_eq!(
            worker_load_from_metrics_text("# nothing\nprocess_cpu_seconds_total 1\n"),
            Err(MetricsError::NoLoadGauges)
        );
        // A longer family sharing a gauge's prefix is not that gauge.
        assert_eq!(
            worker_load_from_metrics_text("sglang:num_running_reqs_offline_batch 3\n"),
            Err(MetricsError::NoLoadGauges)
        );
        assert!(matches!(
            worker_load_from_metrics_text("sglang:num_queue_reqs{model=\"m} 3\n"),
            Err(MetricsError::Parse(_))
        ));
    }

    #[test]
    fn bad_values() {
        for text in [
            "sglang_num_queue_reqs NaN\n",
            "sglang_num_running_reqs +Inf\n",
        ] {
            assert!(
                matches!(
                    worker_load_from_metrics_text(text),
                    Err(MetricsError::Invalid(LoadValidationError::NonFinite { .. }))
                ),
                "{text}"
            );
        }
        assert!(matches!(
            worker_load_from_metrics_text("sglang_num_queue_reqs -2\n"),
            Err(MetricsError::Invalid(LoadValidationError::NegativeCount {
                field: "num_waiting_reqs",
                value: -2,
                ..
            }))
        ));
        assert!(matches!(
            worker_load_from_metrics_text("sglang_token_usage NaN\n"),
            Err(MetricsError::Invalid(LoadValidationError::NonFinite {
                field: "token_usage",
                ..
            }))
        ));
        let load =
            worker_load_from_metrics_text("sglang_token_usage 1.5\nsglang_gen_throughput -Inf\n")
                .unwrap();
        assert_eq!(load.kv_usage_ratio(), 1.0, "usage above 1 is clamped");
        assert_eq!(load.throughput_tps(), None, "a bad rate is not reported");
    }
}
