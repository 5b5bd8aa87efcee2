use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::{LoadValidationError, LoadsResponse, SchedulerLoadSnapshot};

/// Every DP rank of one worker, validated, and when the report was observed.
///
/// A `WorkerLoad` can only be built through [`WorkerLoad::from_ranks`] (or
/// deserialized, which runs the same checks), so every value in it is usable:
///
/// - counts are never negative: a negative count rejects the report;
/// - `token_usage` is finite and in `[0, 1]`: NaN, infinity or a negative value
///   rejects the report, and a value above 1 is clamped to 1;
/// - `gen_throughput` is finite and non-negative, or not reported: a NaN,
///   infinite or negative rate is dropped to "not reported";
/// - `cache_hit_rate` and `utilization`, informational only, are clamped into
///   `[0, 1]`, non-finite values becoming 0.
///
/// Which optional signals were reported stays visible per rank
/// (`Option` fields of [`SchedulerLoadSnapshot`]); a worker-level signal is
/// reported when every rank reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "LoadsResponse", into = "LoadsResponse")]
pub struct WorkerLoad {
    loads: Vec<SchedulerLoadSnapshot>,
    observed_at: Option<Instant>,
}

impl WorkerLoad {
    /// Validates the ranks of one report (see the type's docs for the rules).
    pub fn from_ranks(
        loads: Vec<SchedulerLoadSnapshot>,
    ) -> Result<WorkerLoad, LoadValidationError> {
        if loads.is_empty() {
            return Err(LoadValidationError::NoRanks);
        }
        let loads = loads
            .into_iter()
            .map(validate_rank)
            .collect::<Result<Vec<_>, _>>()?;
        Ok(WorkerLoad {
            loads,
            observed_at: None,
        })
    }

    /// Validates one report whose rank list may be empty: an empty list is
    /// `Ok(None)`, "no report this time" (an encode-only worker, a server
    /// between runs), the rest as [`from_ranks`](Self::from_ranks).
    ///
    /// ```
    /// use load_protocols::{SchedulerLoadSnapshot, WorkerLoad};
    ///
    /// assert_eq!(WorkerLoad::from_report(Vec::new()), Ok(None));
    /// let one = WorkerLoad::from_report(vec![SchedulerLoadSnapshot::default()]);
    /// assert_eq!(one.map(|load| load.map(|load| load.ranks().len())), Ok(Some(1)));
    /// ```
    pub fn from_report(
        loads: Vec<SchedulerLoadSnapshot>,
    ) -> Result<Option<WorkerLoad>, LoadValidationError> {
        if loads.is_empty() {
            return Ok(None);
        }
        WorkerLoad::from_ranks(loads).map(Some)
    }

    /// Stamps the moment the report was received.
    #[must_use]
    pub fn observed_at(mut self, now: Instant) -> WorkerLoad {
        self.observed_at = Some(now);
        self
    }

    /// When the report was received, if the poller stamped it.
    pub fn observed(&self) -> Option<Instant> {
        self.observed_at
    }

    /// The validated ranks.
    pub fn ranks(&self) -> &[SchedulerLoadSnapshot] {
        &self.loads
    }

    /// Uncached queued token-work summed over ranks, or `None` when any rank
    /// did not report it.
    pub fn queued_tokens(&self) -> Option<u64> {
        self.loads
            .iter()
            .map(|rank| rank.num_waiting_uncached_tokens.map(non_negative))
            .sum()
    }

    /// Waiting requests summed over ranks.
    pub fn waiting_requests(&self) -> u64 {
        self.loads
            .iter()
            .map(|rank| non_negative(rank.num_waiting_reqs))
            .sum()
    }

    /// Running requests summed over ranks.
    pub fn running_requests(&self) -> u64 {
        self.loads
            .iter()
            .map(|rank| non_negative(rank.num_running_reqs))
            .sum()
    }

    /// Generation rate summed over ranks, tokens per second, or `None` when
    /// any rank did not report it.
    pub fn throughput_tps(&self) -> Option<f64> {
        self.loads.iter().map(|rank| rank.gen_throughput).sum()
    }

    /// KV-cache usage, the mean over ranks, in `[0, 1]`.
    pub fn kv_usage_ratio(&self) -> f64 {
        // `from_ranks` guarantees at least one rank.
        let total: f64 = self.loads.iter().map(|rank| rank.token_usage).sum();
        total / self.loads.len() as f64
    }
}

impl TryFrom<LoadsResponse> for WorkerLoad {
    type Error = LoadValidationError;

    fn try_from(response: LoadsResponse) -> Result<WorkerLoad, LoadValidationError> {
        WorkerLoad::from_ranks(response.loads)
    }
}

impl From<WorkerLoad> for LoadsResponse {
    fn from(load: WorkerLoad) -> LoadsResponse {
        LoadsResponse {
            dp_rank_count: load.loads.len() as i64,
            loads: load.loads,
            ..LoadsResponse::default()
        }
    }
}

fn non_negative(count: i64) -> u64 {
    u64::try_from(count).unwrap_or(0)
}

fn validate_rank(
    mut rank: SchedulerLoadSnapshot,
) -> Result<SchedulerLoadSnapshot, LoadValidationError> {
    let dp_rank = rank.dp_rank;
    let counts = [
        ("num_running_reqs", rank.num_running_reqs),
        ("num_waiting_reqs", rank.num_waiting_reqs),
        (
            "num_waiting_uncached_tokens",
            rank.num_waiting_uncached_tokens.unwrap_or(0),
        ),
        ("num_total_reqs", rank.num_total_reqs),
        ("num_used_tokens", rank.num_used_tokens),
        ("max_total_num_tokens", rank.max_total_num_tokens),
        ("max_running_requests", rank.max_running_requests),
    ];
    if let Some(&(field, value)) = counts.iter().find(|(_, value)| *value < 0) {
        return Err(LoadValidationError::NegativeCount {
            dp_rank,
            field,
            value,
        });
    }
    if !rank.token_usage.is_finite() {
        return Err(LoadValidationError::NonFinite {
            dp_rank,
            field: "token_usage",
            value: rank.token_usage,
        });
    }
    if rank.token_usage < 0.0 {
        return Err(LoadValidationError::NegativeRatio {
            dp_rank,
            field: "token_usage",
            value: rank.token_usage,
        });
    }
    rank.token_usage = rank.token_usage.min(1.0);
    rank.gen_throughput = rank
        .gen_throughput
        .filter(|rate| rate.is_finite() && *rate >= 0.0);
    rank.cache_hit_rate = unit_ratio(rank.cache_hit_rate);
    rank.utilization = unit_ratio(rank.utilization);
    Ok(rank)
}

fn unit_ratio(value: f64) -> f64 {
    if value.is_finite() {
        value.clamp(0.0, 1.0)
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank() -> SchedulerLoadSnapshot {
        SchedulerLoadSnapshot {
            num_running_reqs: 2,
            num_waiting_reqs: 1,
            num_waiting_uncached_tokens: Some(300),
            token_usage: 0.5,
            gen_throughput: Some(1000.0),
            ..SchedulerLoadSnapshot::default()
        }
    }

    #[test]
    fn empty_report_is_rejected() {
        assert_eq!(
            WorkerLoad::from_ranks(Vec::new()),
            Err(LoadValidationError::NoRanks)
        );
    }

    #[test]
    fn negative_counts_are_rejected_by_name() {
        let bad = SchedulerLoadSnapshot {
            dp_rank: 3,
            num_waiting_reqs: -4,
            ..rank()
        };
        let err = WorkerLoad::from_ranks(vec![bad]).unwrap_err();
        assert_eq!(
            err,
            LoadValidationError::NegativeCount {
                dp_rank: 3,
                field: "num_waiting_reqs",
                value: -4
            }
        );
        assert_eq!(
            err.to_string(),
            "dp rank 3: num_waiting_reqs is negative (-4)"
        );

        let bad = SchedulerLoadSnapshot {
            num_waiting_uncached_tokens: Some(-1),
            ..rank()
        };
        assert!(matches!(
            WorkerLoad::from_ranks(vec![bad]),
            Err(LoadValidationError::NegativeCount {
                field: "num_waiting_uncached_tokens",
                ..
            })
        ));
    }

    #[test]
    fn non_finite_or_negative_kv_usage_is_rejected() {
        for usage in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            let bad = SchedulerLoadSnapshot {
                token_usage: usage,
                ..rank()
            };
            assert!(matches!(
                WorkerLoad::from_ranks(vec![bad]),
                Err(LoadValidationError::NonFinite {
                    field: "token_usage",
                    ..
                })
            ));
        }
        let bad = SchedulerLoadSnapshot {
            token_usage: -0.1,
            ..rank()
        };
        assert_eq!(
            WorkerLoad::from_ranks(vec![bad]),
            Err(LoadValidationError::NegativeRatio {
                dp_rank: 0,
                field: "token_usage",
                value: -0.1
            })
        );
    }

    #[test]
    fn kv_usage_above_one_is_clamped() {
        let over = SchedulerLoadSnapshot {
            token_usage: 1.7,
            ..rank()
        };
        let load = WorkerLoad::from_ranks(vec![over]).unwrap();
        assert_eq!(load.kv_usage_ratio(), 1.0);
    }

    #[test]
    fn bad_throughput_becomes_not_reported() {
        for rate in [f64::NAN, f64::INFINITY, -5.0] {
            let bad = SchedulerLoadSnapshot {
                gen_throughput: Some(rate),
                ..rank()
            };
            let load = WorkerLoad::from_ranks(vec![bad]).unwrap();
            assert_eq!(load.throughput_tps(), None);
            assert_eq!(load.ranks()[0].gen_throughput, None);
        }
    }

    #[test]
    fn informational_ratios_are_clamped() {
        let odd = SchedulerLoadSnapshot {
            cache_hit_rate: f64::NAN,
            utilization: 3.0,
            ..rank()
        };
        let load = WorkerLoad::from_ranks(vec![odd]).unwrap();
        assert_eq!(load.ranks()[0].cache_hit_rate, 0.0);
        assert_eq!(load.ranks()[0].utilization, 1.0);
    }

    #[test]
    fn a_signal_is_reported_only_when_every_rank_reports_it() {
        let silent = SchedulerLoadSnapshot {
            dp_rank: 1,
            num_waiting_uncached_tokens: None,
            gen_throughput: None,
            ..rank()
        };
        let load = WorkerLoad::from_ranks(vec![rank(), silent]).unwrap();
        assert_eq!(load.queued_tokens(), None);
        assert_eq!(load.throughput_tps(), None);
        assert_eq!(load.waiting_requests(), 2);
        assert_eq!(load.running_requests(), 4);
    }

    #[test]
    fn reported_zero_is_kept_apart_from_missing() {
        let zero = SchedulerLoadSnapshot {
            num_waiting_uncached_tokens: Some(0),
            ..rank()
        };
        let load = WorkerLoad::from_ranks(vec![zero]).unwrap();
        assert_eq!(load.queued_tokens(), Some(0));
    }

    #[test]
    fn observed_at_is_stamped() {
        let now = Instant::now();
        let load = WorkerLoad::from_ranks(vec![rank()])
            .unwrap()
            .observed_at(now);
        assert_eq!(load.observed(), Some(now));
    }
}
