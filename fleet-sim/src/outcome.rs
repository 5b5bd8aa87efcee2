//! What became of each request of a cell: served (within its TTFT deadline
//! or past it) or turned away by an admission room (why, and how long after
//! its arrival); for all requests, per priority class and per tenant.

use std::collections::BTreeMap;

use admission::RejectReason;
use serde::Serialize;

use super::metrics::percentile;
use super::workload::RequestSpec;

/// One request's end.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Outcome {
    Served {
        ttft_s: f64,
        finish_s: f64,
    },
    Rejected {
        reason: RejectReason,
        after_s: f64,
    },
    /// Never sent: its multi-turn session had ended at a turned-away turn.
    Unsent,
}

/// The requests of one group (all, a class, a tenant) and what became of
/// them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GroupStats {
    /// `all`, `priority 0`, `tenant A`.
    pub group: String,
    /// Requests that arrived.
    pub offered_requests: usize,
    /// Multi-turn requests not sent, their session having ended at a turn
    /// turned away (not among the offered).
    pub unsent_requests: usize,
    /// Requests that got their answer.
    pub served_requests: usize,
    /// TTFT of the served requests, from their arrival at the router.
    pub ttft_p50_s: f64,
    pub ttft_p99_s: f64,
    /// Served within their TTFT deadline (every served request without one).
    pub goodput_requests: usize,
    /// Of the offered requests.
    pub goodput_fraction: f64,
    /// Served past their deadline.
    pub served_late_requests: usize,
    pub rejected_requests: usize,
    /// Turned away, by `admission::RejectReason` (`queue_full`,
    /// `deadline_unmeetable`, `deadline_passed`).
    pub rejected_by_reason: BTreeMap<&'static str, usize>,
    /// Turned away on arrival, rather than after a wait in the room.
    pub rejected_on_arrival_requests: usize,
    /// Turned away at or after their deadline: too late to go elsewhere.
    pub rejected_late_requests: usize,
    /// From arrival to rejection, seconds (0 without rejections).
    pub rejection_p50_s: f64,
    pub rejection_p99_s: f64,
    pub rejection_max_s: f64,
    /// Requests finished per second over the second half of the arrivals
    /// (from the arrival of the middle request to the last: a multi-turn
    /// mix's sessions have ramped up by then).
    pub served_rps: f64,
    /// That rate over the traffic's capacity (`capacity_rps`): the load the
    /// fleet carried, in the unit of the offered `utilization`.
    pub throughput_vs_capacity: f64,
}

impl GroupStats {
    /// Sets [`throughput_vs_capacity`](GroupStats::throughput_vs_capacity).
    pub(crate) fn against_capacity(&mut self, capacity_rps: f64) {
        self.throughput_vs_capacity = if capacity_rps > 0.0 {
            self.served_rps / capacity_rps
        } else {
            0.0
        };
    }
}

/// A cell's outcomes: all requests, then per class (priority value, when
/// the traffic has classes) and per tenant (when it has tenants).
#[derive(Debug, Clone, PartialEq)]
pub struct CellOutcomes {
    pub all: GroupStats,
    pub by_class: Vec<GroupStats>,
    pub by_tenant: Vec<GroupStats>,
}

/// Sums up the outcomes of `requests` (`None`: never ended, counted as
/// neither served nor turned away). `deadline_s` gives a request's TTFT
/// deadline. Rates are taken over the second half of the arrivals.
pub(crate) fn cell_outcomes(
    requests: &[RequestSpec],
    outcomes: &[Option<Outcome>],
    deadline_s: impl Fn(usize) -> Option<f64>,
) -> CellOutcomes {
    let window_s = match (requests.get(requests.len() / 2), requests.last()) {
        (Some(middle), Some(last)) => middle.arrival_s..last.arrival_s,
        _ => 0.0..0.0,
    };
    let deadlines: Vec<Option<f64>> = (0..requests.len()).map(deadline_s).collect();
    let group = |name: String, member: &dyn Fn(&RequestSpec) -> bool| {
        let ids = requests
            .iter()
            .enumerate()
            .filter(|(_, spec)| member(spec))
            .map(|(id, _)| id);
        group_stats(name, ids, outcomes, &deadlines, window_s.clone())
    };
    let mut priorities: Vec<i32> = requests.iter().filter_map(|spec| spec.priority).collect();
    priorities.sort_unstable();
    priorities.dedup();
    let mut tenants: Vec<&str> = requests
        .iter()
        .filter_map(|spec| spec.tenant.as_deref())
        .collect();
    tenants.sort_unstable();
    tenants.dedup();
    CellOutcomes {
        all: group("all".to_owned(), &|_| true),
        by_class: priorities
            .iter()
            .map(|&priority| {
                group(format!("priority {priority}"), &|spec| {
                    spec.priority == Some(priority)
                })
            })
            .collect(),
        by_tenant: tenants
            .iter()
            .map(|&tenant| {
                group(format!("tenant {tenant}"), &|spec| {
                    spec.tenant.as_deref() == Some(tenant)
                })
            })
            .collect(),
    }
}

fn group_stats(
    name: String,
    ids: impl Iterator<Item = usize>,
    outcomes: &[Option<Outcome>],
    deadlines: &[Option<f64>],
    window_s: std::ops::Range<f64>,
) -> GroupStats {
    let mut offered = 0;
    let mut unsent = 0;
    let mut ttft_s = Vec::new();
    let mut goodput = 0;
    let mut served_late = 0;
    let mut rejected_by_reason: BTreeMap<&'static str, usize> = RejectReason::ALL
        .iter()
        .map(|reason| (reason.as_str(), 0))
        .collect();
    let mut rejected_late = 0;
    let mut rejected_on_arrival = 0;
    let mut rejection_s = Vec::new();
    let mut finished_in_window = 0;
    for id in ids {
        let outcome = outcomes.get(id).copied().flatten();
        if outcome == Some(Outcome::Unsent) {
            unsent += 1;
            continue;
        }
        offered += 1;
        let deadline = deadlines.get(id).copied().flatten();
        match outcome {
            Some(Outcome::Served {
                ttft_s: ttft,
                finish_s,
            }) => {
                ttft_s.push(ttft);
                if window_s.contains(&finish_s) {
                    finished_in_window += 1;
                }
                if deadline.is_some_and(|deadline| ttft > deadline) {
                    served_late += 1;
                } else {
                    goodput += 1;
                }
            }
            Some(Outcome::Rejected { reason, after_s }) => {
                *rejected_by_reason.entry(reason.as_str()).or_insert(0) += 1;
                rejection_s.push(after_s);
                if after_s <= 0.0 {
                    rejected_on_arrival += 1;
                }
                if deadline.is_some_and(|deadline| after_s >= deadline) {
                    rejected_late += 1;
                }
            }
            Some(Outcome::Unsent) | None => {}
        }
    }
    ttft_s.sort_by(f64::total_cmp);
    rejection_s.sort_by(f64::total_cmp);
    GroupStats {
        group: name,
        offered_requests: offered,
        unsent_requests: unsent,
        served_requests: ttft_s.len(),
        ttft_p50_s: percentile(&ttft_s, 50.0),
        ttft_p99_s: percentile(&ttft_s, 99.0),
        goodput_requests: goodput,
        goodput_fraction: if offered > 0 {
            goodput as f64 / offered as f64
        } else {
            0.0
        },
        served_late_requests: served_late,
        rejected_requests: rejection_s.len(),
        rejected_by_reason,
        rejected_on_arrival_requests: rejected_on_arrival,
        rejected_late_requests: rejected_late,
        rejection_p50_s: percentile(&rejection_s, 50.0),
        rejection_p99_s: percentile(&rejection_s, 99.0),
        rejection_max_s: rejection_s.last().copied().unwrap_or(0.0),
        served_rps: if window_s.end > window_s.start {
            finished_in_window as f64 / (window_s.end - window_s.start)
        } else {
            0.0
        },
        throughput_vs_capacity: 0.0,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn spec(arrival_s: f64, priority: Option<i32>, tenant: Option<&str>) -> RequestSpec {
        RequestSpec {
            arrival_s,
            prompt_tokens: 100,
            output_tokens: 1,
            prefix_group: None,
            segments: None,
            priority,
            tenant: tenant.map(Arc::from),
            ttft_deadline_s: None,
        }
    }

    #[test]
    fn outcomes_count_goodput_lateness_and_rejections_per_group() {
        let requests = vec![
            spec(0.0, Some(0), Some("a")),
            spec(1.0, Some(1), Some("a")),
            spec(2.0, Some(1), Some("b")),
            spec(3.0, Some(1), Some("b")),
            spec(4.0, Some(0), Some("b")),
        ];
        // Rates over the second half of the arrivals: from 2 s to 4 s.
        let outcomes = vec![
            Some(Outcome::Served {
                ttft_s: 0.5,
                finish_s: 2.5,
            }),
            Some(Outcome::Served {
                ttft_s: 3.0,
                finish_s: 5.0,
            }),
            Some(Outcome::Rejected {
                reason: RejectReason::DeadlineUnmeetable,
                after_s: 0.0,
            }),
            Some(Outcome::Rejected {
                reason: RejectReason::DeadlinePassed,
                after_s: 2.5,
            }),
            Some(Outcome::Served {
                ttft_s: 1.5,
                finish_s: 3.5,
            }),
        ];
        // Priority 1 has a 2 s deadline; priority 0 none.
        let deadline = |id: usize| (requests[id].priority == Some(1)).then_some(2.0);
        let stats = cell_outcomes(&requests, &outcomes, deadline);
        let all = &stats.all;
        assert_eq!((all.offered_requests, all.served_requests), (5, 3));
        assert_eq!((all.goodput_requests, all.served_late_requests), (2, 1));
        assert_eq!(all.goodput_fraction, 0.4);
        assert_eq!(all.rejected_requests, 2);
        assert_eq!(all.rejected_by_reason["deadline_unmeetable"], 1);
        assert_eq!(all.rejected_by_reason["deadline_passed"], 1);
        assert_eq!(all.rejected_by_reason["queue_full"], 0);
        assert_eq!(all.rejected_late_requests, 1);
        assert_eq!(all.rejected_on_arrival_requests, 1);
        assert_eq!((all.rejection_p50_s, all.rejection_max_s), (0.0, 2.5));
        assert_eq!(all.served_rps, 1.0);
        let groups: Vec<&str> = stats.by_class.iter().map(|g| g.group.as_str()).collect();
        assert_eq!(groups, ["priority 0", "priority 1"]);
        assert_eq!(stats.by_class[0].goodput_requests, 2);
        assert_eq!(stats.by_class[0].ttft_p99_s, 1.5);
        assert_eq!(stats.by_class[1].goodput_requests, 0);
        let tenants: Vec<(&str, usize)> = stats
            .by_tenant
            .iter()
            .map(|g| (g.group.as_str(), g.offered_requests))
            .collect();
        assert_eq!(tenants, [("tenant a", 2), ("tenant b", 3)]);
        let mut all = stats.all.clone();
        all.against_capacity(4.0);
        assert_eq!(all.throughput_vs_capacity, 0.25);
        // A traffic without classes or tenants has no groups but all.
        let plain = cell_outcomes(&[spec(0.0, None, None)], &[None], |_| None);
        assert!(plain.by_class.is_empty() && plain.by_tenant.is_empty());
        assert_eq!(plain.all.served_requests, 0);
    }
}
