//! Per-cell metrics: percentiles, means, throughput, imbalance.

use engine_model::RequestRecord;

use super::fleet::RateTrace;
use super::sync::SyncStats;

/// Points of the TTFT CDF kept per cell (quantiles 0, 1/N, …, 1).
pub const CDF_POINTS: usize = 201;

/// What one cell measured.
#[derive(Debug, Clone, PartialEq)]
pub struct CellStats {
    pub requests: usize,
    pub ttft_p50_s: f64,
    pub ttft_p90_s: f64,
    pub ttft_p99_s: f64,
    pub ttft_mean_s: f64,
    pub e2e_p50_s: f64,
    pub e2e_p99_s: f64,
    /// Mean of admission − arrival.
    pub queue_delay_mean_s: f64,
    /// Generated tokens over the span from the first arrival to the last finish.
    pub throughput_tps: f64,
    pub preemptions: u64,
    /// Coefficient of variation over workers of the work routed to each,
    /// in seconds of that worker's own time (prompt / prefill_tps + output ×
    /// decode_per_req_ms).
    pub imbalance_cv: f64,
    pub poll_failures: u64,
    /// TTFT at quantiles `i / (CDF_POINTS − 1)`.
    pub ttft_cdf_s: Vec<f64>,
    /// Every TTFT, sorted (kept only in tests).
    pub ttft_sorted_s: Vec<f64>,
    /// The policies' rate for the slowed worker (cells with a slowdown and
    /// a policy with a rate column).
    pub rate_trace: Option<RateTrace>,
    /// What the replicas' sync channel did (cells with sync on).
    pub sync: Option<SyncStats>,
    /// Prompt tokens of the finished requests.
    pub prompt_tokens: u64,
    /// Of those, the tokens the engines' prefix caches served, as the
    /// engines report them (at each request's first admission).
    pub reported_cached_tokens: u64,
    /// The tokens the dispatching policies expected the caches to serve
    /// (`Dispatch::cached_tokens`; 0 for policies without a prefix model
    /// and for the references).
    pub predicted_cached_tokens: u64,
    /// The restarted replica's requests around its restart (cells with a
    /// restart).
    pub restart: Option<crate::fleet::RestartStats>,
    /// What became of every request: served in time, late, or turned away
    /// by an admission room; by class and tenant.
    pub outcomes: Option<crate::outcome::CellOutcomes>,
}

/// Nearest-rank percentile of sorted values: the smallest value with at
/// least `p`% of the values at or below it. `p` in `[0, 100]`; 0 for no values.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (p / 100.0 * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Population coefficient of variation (0 for a zero mean).
pub fn coefficient_of_variation(values: &[f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    if mean <= 0.0 {
        return 0.0;
    }
    let variance = values.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
    variance.sqrt() / mean
}

pub fn summarize(
    records: &[RequestRecord],
    routed_work_s: &[f64],
    preemptions: u64,
    poll_failures: u64,
) -> CellStats {
    let n = records.len();
    let mut ttft: Vec<f64> = records.iter().map(RequestRecord::ttft_s).collect();
    let mut e2e: Vec<f64> = records.iter().map(RequestRecord::e2e_s).collect();
    ttft.sort_by(f64::total_cmp);
    e2e.sort_by(f64::total_cmp);
    let mean = |sum: f64| if n == 0 { 0.0 } else { sum / n as f64 };
    let first_arrival_s = records
        .iter()
        .map(|r| r.arrival_s)
        .fold(f64::INFINITY, f64::min);
    let last_finish_s = records
        .iter()
        .map(|r| r.finish_s)
        .fold(f64::NEG_INFINITY, f64::max);
    let generated: f64 = records.iter().map(|r| f64::from(r.output_tokens)).sum();
    let span_s = last_finish_s - first_arrival_s;
    let ttft_cdf_s = (0..CDF_POINTS)
        .map(|i| percentile(&ttft, 100.0 * i as f64 / (CDF_POINTS - 1) as f64))
        .collect();
    CellStats {
        requests: n,
        ttft_p50_s: percentile(&ttft, 50.0),
        ttft_p90_s: percentile(&ttft, 90.0),
        ttft_p99_s: percentile(&ttft, 99.0),
        ttft_mean_s: mean(ttft.iter().sum()),
        e2e_p50_s: percentile(&e2e, 50.0),
        e2e_p99_s: percentile(&e2e, 99.0),
        queue_delay_mean_s: mean(records.iter().map(|r| r.admitted_s - r.arrival_s).sum()),
        throughput_tps: if span_s > 0.0 {
            generated / span_s
        } else {
            0.0
        },
        preemptions,
        imbalance_cv: coefficient_of_variation(routed_work_s),
        poll_failures,
        ttft_cdf_s,
        ttft_sorted_s: if cfg!(test) { ttft } else { Vec::new() },
        rate_trace: None,
        sync: None,
        prompt_tokens: records.iter().map(|r| u64::from(r.prompt_tokens)).sum(),
        reported_cached_tokens: records.iter().map(|r| u64::from(r.cached_tokens)).sum(),
        restart: None,
        predicted_cached_tokens: 0,
        outcomes: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let values: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&values, 50.0), 50.0);
        assert_eq!(percentile(&values, 99.0), 99.0);
        assert_eq!(percentile(&values, 100.0), 100.0);
        assert_eq!(percentile(&values, 0.0), 1.0);
        assert_eq!(percentile(&values, 99.5), 100.0);
        let few = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&few, 50.0), 2.0);
        assert_eq!(percentile(&few, 51.0), 3.0);
        assert_eq!(percentile(&few, 99.0), 4.0);
        assert_eq!(percentile(&[7.0], 99.0), 7.0);
        assert_eq!(percentile(&[], 99.0), 0.0);
    }

    #[test]
    fn coefficient_of_variation_is_population_sd_over_mean() {
        assert_eq!(coefficient_of_variation(&[2.0, 2.0, 2.0]), 0.0);
        assert!((coefficient_of_variation(&[1.0, 3.0]) - 0.5).abs() < 1e-12);
        assert_eq!(coefficient_of_variation(&[0.0, 0.0]), 0.0);
    }

    #[test]
    fn summary_of_hand_made_records() {
        let record = |id, arrival_s, admitted_s, first_token_s, finish_s| RequestRecord {
            id,
            prompt_tokens: 100,
            output_tokens: 10,
            cached_tokens: 0,
            arrival_s,
            admitted_s,
            first_token_s,
            finish_s,
            preemptions: 0,
        };
        let mut records = [record(0, 0.0, 0.0, 0.5, 1.0), record(1, 1.0, 1.5, 2.0, 4.0)];
        records[1].cached_tokens = 64;
        let stats = summarize(&records, &[1.0, 1.0], 3, 0);
        assert_eq!(
            (stats.prompt_tokens, stats.reported_cached_tokens),
            (200, 64)
        );
        // Only the cell knows what its policies predicted.
        assert_eq!(stats.predicted_cached_tokens, 0);
        assert_eq!(stats.ttft_p50_s, 0.5);
        assert_eq!(stats.ttft_p99_s, 1.0);
        assert_eq!(stats.e2e_p99_s, 3.0);
        assert_eq!(stats.queue_delay_mean_s, 0.25);
        assert_eq!(stats.throughput_tps, 5.0);
        assert_eq!(stats.preemptions, 3);
        assert_eq!(stats.ttft_cdf_s.len(), CDF_POINTS);
        assert_eq!(stats.ttft_cdf_s[0], 0.5);
        assert_eq!(stats.ttft_cdf_s[CDF_POINTS - 1], 1.0);
    }
}
