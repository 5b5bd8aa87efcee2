//! Runs scenarios: derives the arrival rates from fleet capacity, generates
//! the workloads, runs every (traffic, router setting, load, policy) cell on
//! a few threads and assembles the reports.
//!
//! A policy that does not count other replicas' pending work (the
//! baselines, the references) runs only at the router settings without
//! sync: with sync on it would make the same choices. Likewise a policy
//! with no model of wait (`Policy::expected_wait`) runs only without an
//! admission room, which would dispatch its every request at once.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use super::error::SimError;
use super::fleet::{
    Cell, RateTrace, Restart, RestartStats, Slowdown, policy_registry, predicts_wait,
    router_block_tokens, run_cell, run_cell_records,
};
use super::metrics::CellStats;
use super::outcome::GroupStats;
use super::scenario::{
    AdmissionOrder, CapacityBasis, LoadReport, PolicyName, RouterPoint, Scenario, SyncConfig,
    TrafficConfig, TurnedAway,
};
use super::sync::{SyncStats, counts_replica_pending};
use super::workload::{RequestSpec, Trace, chained_block_hashes_of, generate, mean_lengths};
use admission::RoomConfig;
use engine_model::{EngineParams, mix};

/// How to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunOptions {
    /// Worker threads (cells run independently).
    pub threads: usize,
    /// Draw a progress bar on stderr.
    pub progress: bool,
}

impl Default for RunOptions {
    fn default() -> RunOptions {
        RunOptions {
            threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
            progress: false,
        }
    }
}

/// `report.json` (`docs/engine-model.md`, "Running it and reading the
/// output"), plus the capacity
/// derivation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    pub scenario: String,
    pub seed: u64,
    pub workers: u32,
    /// The base poll interval (a sweep reports its own per row).
    pub poll_interval_s: f64,
    /// The base replica count (a sweep reports its own per row).
    pub router_replicas: u32,
    pub requests_per_cell: u64,
    pub capacity: Vec<TrafficCapacity>,
    pub results: Vec<ResultRow>,
    /// Scenarios with a slowdown: how each policy replica's rate for the
    /// slowed worker followed its true prefill rate.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub rate_tracking: Vec<RateTracking>,
}

/// Within this share of the true rate, an estimate counts as caught up.
pub const RATE_TOLERANCE: f64 = 0.2;

/// How one policy replica's rate for the slowed worker followed the
/// worker's true prefill rate (sampled every poll interval).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RateTracking {
    pub traffic: String,
    pub utilization: f64,
    pub policy: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub poll_interval_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub router_replicas: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sync: Option<SyncConfig>,
    pub replica: u32,
    pub worker: usize,
    pub slowdown_at_s: f64,
    pub true_prefill_tps_before: f64,
    pub true_prefill_tps_after: f64,
    /// The replica's rate at the last sample before the slowdown.
    pub estimate_before_tps: Option<f64>,
    /// Its rate at the last sample (at the last arrival).
    pub estimate_end_tps: Option<f64>,
    /// Seconds from the slowdown to the first sample within
    /// [`RATE_TOLERANCE`] of the new true rate; `None` if none is.
    pub first_within_tolerance_s: Option<f64>,
    /// Seconds from the slowdown to the sample from which every later one
    /// stays within [`RATE_TOLERANCE`]; `None` if the last one is not within.
    pub settled_within_tolerance_s: Option<f64>,
}

impl RateTracking {
    /// One entry per replica of the trace of this row's cell.
    pub fn from_trace(row: &ResultRow, trace: &RateTrace) -> Vec<RateTracking> {
        let at_s = trace.slowdown_at_s;
        let before = trace.samples.iter().rev().find(|s| s.time_s < at_s);
        let after: Vec<_> = trace.samples.iter().filter(|s| s.time_s >= at_s).collect();
        let true_before = before
            .or(trace.samples.first())
            .map_or(0.0, |s| s.true_prefill_tps);
        let true_after = after.last().map_or(true_before, |s| s.true_prefill_tps);
        let replicas = trace.replica_count();
        (0..replicas)
            .map(|replica| {
                let estimate = |sample: &crate::fleet::RateSample| {
                    sample.estimates_tps.get(replica).copied().flatten()
                };
                let within = |sample: &crate::fleet::RateSample| {
                    estimate(sample).is_some_and(|tps| {
                        (tps - sample.true_prefill_tps).abs()
                            <= RATE_TOLERANCE * sample.true_prefill_tps
                    })
                };
                let first_within_tolerance_s =
                    after.iter().find(|s| within(s)).map(|s| s.time_s - at_s);
                let settled_from = after
                    .iter()
                    .rposition(|s| !within(s))
                    .map_or(Some(0), |last_out| {
                        (last_out + 1 < after.len()).then_some(last_out + 1)
                    });
                let settled_within_tolerance_s = settled_from
                    .and_then(|index| after.get(index))
                    .map(|s| s.time_s - at_s);
                RateTracking {
                    traffic: row.traffic.clone(),
                    utilization: row.utilization,
                    policy: row.policy,
                    poll_interval_s: row.poll_interval_s,
                    router_replicas: row.router_replicas,
                    sync: row.sync,
                    replica: replica as u32,
                    worker: trace.worker,
                    slowdown_at_s: at_s,
                    true_prefill_tps_before: true_before,
                    true_prefill_tps_after: true_after,
                    estimate_before_tps: before.and_then(estimate),
                    estimate_end_tps: trace.samples.last().and_then(estimate),
                    first_within_tolerance_s,
                    settled_within_tolerance_s,
                }
            })
            .collect()
    }
}

/// How the arrival rates were derived for one traffic mix.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TrafficCapacity {
    pub traffic: String,
    pub mean_prompt_tokens: f64,
    pub mean_output_tokens: f64,
    /// Mean prompt tokens a warm prefix cache serves (shared prefixes).
    pub mean_cached_prompt_tokens: f64,
    /// `Σ_workers 1 / ((prompt − cached) / prefill_tps + output × decode_per_req_ms / 1000)`,
    /// or with `capacity = "measured"` the highest rate `least_load` keeps
    /// up with.
    pub capacity_rps: f64,
    /// With `capacity = "measured"`: the formula's capacity.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub formula_capacity_rps: Option<f64>,
    pub rates: Vec<LoadRate>,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LoadRate {
    pub utilization: f64,
    pub arrival_rate_rps: f64,
}

/// One (traffic, router setting, load, policy) cell.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ResultRow {
    pub traffic: String,
    pub utilization: f64,
    pub policy: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub poll_interval_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub router_replicas: Option<u32>,
    /// How the replicas shared their pending work (scenarios with sync).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sync: Option<SyncConfig>,
    pub requests: usize,
    pub ttft_p50_s: f64,
    pub ttft_p90_s: f64,
    pub ttft_p99_s: f64,
    pub e2e_p50_s: f64,
    pub e2e_p99_s: f64,
    pub queue_delay_mean_s: f64,
    pub throughput_tps: f64,
    pub preemptions: u64,
    pub imbalance_cv: f64,
    pub ttft_mean_s: f64,
    pub arrival_rate_rps: f64,
    pub poll_failures: u64,
    /// This row's p99 TTFT over the best (lowest) reference's p99 in the
    /// same traffic, setting and load (`least_true_queue`, `oracle`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttft_p99_vs_best_reference: Option<f64>,
    /// The same for the mean TTFT.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttft_mean_vs_best_reference: Option<f64>,
    /// What the sync channel did (cells with sync on).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sync_stats: Option<SyncStats>,
    /// Prompt tokens the engines' prefix caches served, as they report
    /// them, over all prompt tokens: the fleet's hit rate.
    pub prefix_hit_rate: f64,
    /// The served (reported) prompt tokens, and those the policy expected
    /// (`Dispatch::cached_tokens`; 0 without a prefix model).
    pub cached_tokens_reported: u64,
    pub cached_tokens_predicted: u64,
    /// Estimated bytes per second of prefix updates (placements and cache
    /// bounds) each replica publishes while requests arrive (cells with
    /// sync on).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefix_bytes_per_replica_s: Option<f64>,
    /// The restarted replica's p99 TTFT around its restart (cells with a
    /// restart).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub restart: Option<RestartStats>,
    /// The replicas' admission order, `off` for none (scenarios that set
    /// admission).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub admission: Option<&'static str>,
    /// What became of every request: served within its deadline, late, or
    /// turned away (scenarios with admission, classes, tenants or
    /// deadlines).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub outcomes: Option<GroupStats>,
    /// The same per priority class (traffic with classes).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub by_class: Vec<GroupStats>,
    /// The same per tenant (traffic with tenants).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub by_tenant: Vec<GroupStats>,
}

impl ResultRow {
    /// The row's sync setting as reports name it (`off`, `20ms`, `ideal`),
    /// if the scenario has one.
    pub fn sync_label(&self) -> Option<String> {
        self.sync.as_ref().map(SyncConfig::label)
    }
}

/// A scenario's report, and the TTFT CDF and rate trace of each row (same
/// order), for plots.
#[derive(Debug, Clone, PartialEq)]
pub struct ScenarioOutcome {
    pub report: Report,
    pub ttft_cdfs_s: Vec<Vec<f64>>,
    pub rate_traces: Vec<Option<RateTrace>>,
}

impl Report {
    /// The row of this traffic, load, policy and router setting (`None`
    /// matches rows without a sweep value).
    pub fn row(
        &self,
        traffic: &str,
        utilization: f64,
        policy: &str,
        poll_interval_s: Option<f64>,
        router_replicas: Option<u32>,
    ) -> Option<&ResultRow> {
        self.results.iter().find(|row| {
            row.traffic == traffic
                && (row.utilization - utilization).abs() < 1e-9
                && row.policy == policy
                && (poll_interval_s.is_none() || row.poll_interval_s == poll_interval_s)
                && (router_replicas.is_none() || row.router_replicas == router_replicas)
        })
    }

    /// The row of this traffic, load, policy and admission order (`off`
    /// for none), at the first router setting that has it.
    pub fn admission_row(
        &self,
        traffic: &str,
        utilization: f64,
        policy: &str,
        admission: AdmissionOrder,
    ) -> Option<&ResultRow> {
        self.results.iter().find(|row| {
            row.traffic == traffic
                && (row.utilization - utilization).abs() < 1e-9
                && row.policy == policy
                && row.admission.unwrap_or("off") == admission.as_str()
        })
    }

    /// The row of this traffic, load, policy, replica count and sync
    /// setting (one replica's row is `SyncConfig::Off {}`).
    pub fn sync_row(
        &self,
        traffic: &str,
        utilization: f64,
        policy: &str,
        router_replicas: u32,
        sync: SyncConfig,
    ) -> Option<&ResultRow> {
        self.results.iter().find(|row| {
            row.traffic == traffic
                && (row.utilization - utilization).abs() < 1e-9
                && row.policy == policy
                && row.router_replicas.unwrap_or(1) == router_replicas
                && row.sync.unwrap_or_default() == sync
        })
    }
}

/// What a scenario needs at run time.
#[derive(Debug)]
struct Plan<'a> {
    scenario: &'a Scenario,
    workers: Vec<(LoadReport, EngineParams)>,
    points: Vec<RouterPoint>,
    /// Per traffic mix.
    capacity: Vec<TrafficCapacity>,
    /// Each traffic mix, each followed by its tenants run alone.
    runs: Vec<TrafficRun>,
    /// `[run][utilization]`.
    workloads: Vec<Vec<Vec<RequestSpec>>>,
    /// `[run][utilization]`: each request's chained block hashes at the
    /// router's block size, made by the first cell of the load level that
    /// runs and shared by the others.
    chains: Vec<Vec<OnceLock<Chains>>>,
    /// Each replica's admission room config (scenarios that set admission).
    room: Option<RoomConfig>,
}

/// The requests of one traffic mix, or of one of its tenants alone.
#[derive(Debug, Clone, PartialEq)]
struct TrafficRun {
    /// The traffic mix's index: its seeds, capacity and settings.
    traffic: usize,
    /// The `traffic` value of its rows.
    name: String,
    /// The one tenant kept, for a tenant run alone.
    tenant: Option<String>,
}

/// Each request's chained block hashes, in request order.
type Chains = Vec<Arc<[u64]>>;

#[derive(Debug, Clone, Copy)]
struct Job {
    plan: usize,
    traffic: usize,
    point: usize,
    utilization: usize,
    policy: usize,
}

/// `Σ_workers 1 / ((prompt − cached) / prefill_tps + output × decode_per_req_ms / 1000)`:
/// the request rate at which every worker's prefill and per-request decode
/// work fills its time (`decode_base_ms`, a per-step cost shared by the batch,
/// and the overlap of prefill and decode within a step are left out).
pub fn capacity_rps(
    workers: &[(LoadReport, EngineParams)],
    prompt: f64,
    output: f64,
    cached: f64,
) -> f64 {
    workers
        .iter()
        .map(|(_, params)| {
            let work_s = (prompt - cached).max(1.0) / params.prefill_tps
                + output * params.decode_per_req_ms / 1000.0;
            1.0 / work_s
        })
        .sum()
}

fn plan(scenario: &Scenario) -> Result<Plan<'_>, SimError> {
    let traces: Vec<Option<Trace>> = scenario.load_traces()?;
    let workers = scenario.worker_specs();
    let min_kv_tokens = workers
        .iter()
        .map(|(_, params)| params.kv_capacity_tokens)
        .min()
        .unwrap_or(0);
    let count = usize::try_from(scenario.requests).unwrap_or(usize::MAX);
    let mut capacity = Vec::new();
    let mut runs = Vec::new();
    let mut workloads = Vec::new();
    for (t, traffic) in scenario.traffic.iter().enumerate() {
        let trace = traces.get(t).and_then(Option::as_ref);
        if let Some(trace) = trace
            && trace.max_tokens() > min_kv_tokens
        {
            return Err(SimError::Invalid {
                scenario: scenario.name.clone(),
                field: format!("traffic[{t}].arrival.path"),
                message: format!(
                    "a trace request needs {} tokens, above the smallest kv_capacity_tokens ({min_kv_tokens})",
                    trace.max_tokens()
                ),
            });
        }
        let (prompt, output, cached) = mean_lengths(traffic, trace);
        let formula_rps = capacity_rps(&workers, prompt, output, cached);
        let fleet_rps = traffic_capacity_rps(scenario, t, trace, &workers, formula_rps)?;
        let mut rates = Vec::new();
        let mut per_load = Vec::new();
        for (u, &utilization) in scenario.utilizations.iter().enumerate() {
            let rate = utilization * fleet_rps;
            rates.push(LoadRate {
                utilization,
                arrival_rate_rps: rate,
            });
            let seed = workload_seed(scenario.seed, t, u);
            per_load.push(generate(traffic, trace, rate, count, seed));
        }
        capacity.push(TrafficCapacity {
            traffic: traffic.name.clone(),
            mean_prompt_tokens: prompt,
            mean_output_tokens: output,
            mean_cached_prompt_tokens: cached,
            capacity_rps: fleet_rps,
            formula_capacity_rps: (scenario.capacity == CapacityBasis::Measured)
                .then_some(formula_rps),
            rates,
        });
        // A tenant alone: the same requests (same seed), the others' left out.
        let alone: Vec<(TrafficRun, Vec<Vec<RequestSpec>>)> = traffic
            .tenants
            .iter()
            .filter(|tenant| tenant.alone)
            .map(|tenant| {
                let of_tenant = per_load
                    .iter()
                    .map(|requests| {
                        requests
                            .iter()
                            .filter(|spec| spec.tenant.as_deref() == Some(tenant.name.as_str()))
                            .cloned()
                            .collect()
                    })
                    .collect();
                let run = TrafficRun {
                    traffic: t,
                    name: traffic.alone_name(&tenant.name),
                    tenant: Some(tenant.name.clone()),
                };
                (run, of_tenant)
            })
            .collect();
        runs.push(TrafficRun {
            traffic: t,
            name: traffic.name.clone(),
            tenant: None,
        });
        workloads.push(per_load);
        for (run, of_tenant) in alone {
            runs.push(run);
            workloads.push(of_tenant);
        }
    }
    let chains = workloads
        .iter()
        .map(|per_load| per_load.iter().map(|_| OnceLock::new()).collect())
        .collect();
    Ok(Plan {
        scenario,
        workers,
        points: scenario.router_points(),
        capacity,
        runs,
        workloads,
        chains,
        room: scenario.room_config()?,
    })
}

fn workload_seed(seed: u64, traffic: usize, utilization: usize) -> u64 {
    mix(seed ^ mix(((traffic as u64) << 16) | utilization as u64))
}

/// The capacity derivation of each scenario, without running it.
pub fn capacities(scenario: &Scenario) -> Result<Vec<TrafficCapacity>, SimError> {
    let traces = scenario.load_traces()?;
    let workers = scenario.worker_specs();
    scenario
        .traffic
        .iter()
        .zip(&traces)
        .enumerate()
        .map(|(t, (traffic, trace))| {
            let (prompt, output, cached) = mean_lengths(traffic, trace.as_ref());
            let formula_rps = capacity_rps(&workers, prompt, output, cached);
            let fleet_rps =
                traffic_capacity_rps(scenario, t, trace.as_ref(), &workers, formula_rps)?;
            Ok(TrafficCapacity {
                traffic: traffic.name.clone(),
                mean_prompt_tokens: prompt,
                mean_output_tokens: output,
                mean_cached_prompt_tokens: cached,
                capacity_rps: fleet_rps,
                formula_capacity_rps: (scenario.capacity == CapacityBasis::Measured)
                    .then_some(formula_rps),
                rates: scenario
                    .utilizations
                    .iter()
                    .map(|&utilization| LoadRate {
                        utilization,
                        arrival_rate_rps: utilization * fleet_rps,
                    })
                    .collect(),
            })
        })
        .collect()
}

/// The bounds of the measured capacity's bisection, as multiples of the
/// formula's: the fleet keeps up at the lower, not at the upper (a step's
/// prefill and decode overlap at most, so it serves at most about twice
/// the formula's rate).
const MEASURED_CAPACITY_BOUNDS: (f64, f64) = (0.25, 4.0);
/// Bisection steps: the capacity to within 3.75 / 2^8 ≈ 1.5 % of the
/// formula's.
const MEASURED_CAPACITY_STEPS: u32 = 8;
/// A run keeps up when at least this share of the requests that arrive in
/// its window finish in it: the requests in the fleet (queued, or in a
/// running batch) do not pile up. Not TTFT: a fleet whose decode is
/// saturated (long answers) grows its running batches, and so every step,
/// long before its queues and TTFT show it. Poisson noise on 40 % of
/// 20 000 requests is about 1 %.
const KEEPS_UP_RATIO: f64 = 0.98;
/// The window: from the arrival of this share of the requests to that of
/// this one (after a multi-turn mix's sessions have mostly ramped up).
const KEEPS_UP_WINDOW: (f64, f64) = (0.5, 0.9);

/// Traffic `t`'s capacity, requests per second: the formula's, or (with
/// `capacity = "measured"`) the highest arrival rate at which `least_load`,
/// one replica at the scenario's first poll setting, without admission,
/// finishes as many requests as arrive over the run's window
/// ([`KEEPS_UP_RATIO`]), bisected between [`MEASURED_CAPACITY_BOUNDS`] × the
/// formula's. The traffic's
/// classes, tenants and deadlines play no part. Measured once per process
/// for each traffic, fleet, router and seed.
fn traffic_capacity_rps(
    scenario: &Scenario,
    t: usize,
    trace: Option<&Trace>,
    workers: &[(LoadReport, EngineParams)],
    formula_rps: f64,
) -> Result<f64, SimError> {
    if scenario.capacity != CapacityBasis::Measured {
        return Ok(formula_rps);
    }
    let Some(traffic) = scenario.traffic.get(t) else {
        return Ok(formula_rps);
    };
    let unlabelled = TrafficConfig {
        classes: Vec::new(),
        tenants: Vec::new(),
        ttft_deadline_s: None,
        ..traffic.clone()
    };
    let Some(base) = scenario.router_points().first().copied() else {
        return Ok(formula_rps);
    };
    let point = RouterPoint {
        replicas: 1,
        sync: SyncConfig::Off {},
        admission: AdmissionOrder::Off,
        ..base
    };
    let key = format!(
        "{:?}",
        (
            scenario.seed,
            scenario.requests,
            t,
            &unlabelled,
            workers,
            point.poll_interval_s,
            point.stale_after_s,
            point.poll_latency_s,
            point.worker_phase,
            point.report_at,
        )
    );
    static MEASURED: Mutex<Vec<(String, f64)>> = Mutex::new(Vec::new());
    if let Some(known) = MEASURED
        .lock()
        .ok()
        .and_then(|known| known.iter().find(|(k, _)| *k == key).map(|(_, rps)| *rps))
    {
        return Ok(known);
    }
    let count = usize::try_from(scenario.requests).unwrap_or(usize::MAX);
    let seed = mix(workload_seed(scenario.seed, t, 0) ^ 0xca9a_c17e);
    let registry = policy_registry();
    let keeps_up = |utilization: f64| -> Result<bool, SimError> {
        let requests = generate(&unlabelled, trace, utilization * formula_rps, count, seed);
        let chains = chained_block_hashes_of(
            &requests,
            unlabelled.shared_prefix,
            router_block_tokens(workers),
        );
        let cell = Cell {
            workers,
            requests: &requests,
            chains: &chains,
            shared_prefix: unlabelled.shared_prefix,
            router: point,
            policy: PolicyName::LeastLoad,
            seed,
            slowdown: None,
            restart: None,
            room: None,
            turned_away_ends_session: false,
        };
        let finished_s: Vec<f64> = run_cell_records(&cell, &registry)?
            .iter()
            .map(|record| record.finish_s)
            .collect();
        let at = |share: f64| {
            let index = ((requests.len() as f64 * share) as usize).min(requests.len() - 1);
            requests[index].arrival_s
        };
        let window_s = at(KEEPS_UP_WINDOW.0)..at(KEEPS_UP_WINDOW.1);
        let arrived = requests
            .iter()
            .filter(|spec| window_s.contains(&spec.arrival_s))
            .count();
        let finished = finished_s
            .iter()
            .filter(|time_s| window_s.contains(time_s))
            .count();
        Ok(finished as f64 >= KEEPS_UP_RATIO * arrived as f64)
    };
    let (mut low, mut high) = MEASURED_CAPACITY_BOUNDS;
    if count >= 2 {
        for _ in 0..MEASURED_CAPACITY_STEPS {
            let middle = (low + high) / 2.0;
            if keeps_up(middle)? {
                low = middle;
            } else {
                high = middle;
            }
        }
    }
    let measured = low * formula_rps;
    if let Ok(mut known) = MEASURED.lock() {
        known.push((key, measured));
    }
    Ok(measured)
}

/// Runs every cell of every scenario, `options.threads` at a time, and
/// returns one outcome per scenario, in order. Deterministic: the result
/// does not depend on the thread count.
pub fn run_scenarios(
    scenarios: &[Scenario],
    options: &RunOptions,
) -> Result<Vec<ScenarioOutcome>, SimError> {
    let plans: Vec<Plan<'_>> = scenarios.iter().map(plan).collect::<Result<_, _>>()?;
    let registry = policy_registry();
    let mut jobs = Vec::new();
    for (p, plan) in plans.iter().enumerate() {
        let counts_sync: Vec<bool> = plan
            .scenario
            .policies
            .iter()
            .map(|&name| counts_replica_pending(&registry, name))
            .collect();
        let with_room: Vec<bool> = plan
            .scenario
            .policies
            .iter()
            .map(|&name| predicts_wait(&registry, name))
            .collect();
        for traffic in 0..plan.runs.len() {
            for point in 0..plan.points.len() {
                for utilization in 0..plan.scenario.utilizations.len() {
                    for (policy, &counts_sync) in counts_sync.iter().enumerate() {
                        if !plan.points[point].sync.is_off() && !counts_sync {
                            continue;
                        }
                        if !plan.points[point].admission.is_off() && !with_room[policy] {
                            continue;
                        }
                        jobs.push(Job {
                            plan: p,
                            traffic,
                            point,
                            utilization,
                            policy,
                        });
                    }
                }
            }
        }
    }
    let progress = if options.progress {
        let bar = ProgressBar::new(jobs.len() as u64);
        if let Ok(style) = ProgressStyle::with_template(
            "{elapsed_precise} [{bar:40}] {pos}/{len} cells, eta {eta}",
        ) {
            bar.set_style(style);
        }
        bar
    } else {
        ProgressBar::hidden()
    };
    let next = AtomicUsize::new(0);
    let threads = options.threads.clamp(1, jobs.len().max(1));
    let run_job = |job: &Job,
                   registry: &policy_core::PolicyRegistry|
     -> Result<CellStats, SimError> {
        let plan = &plans[job.plan];
        let scenario = plan.scenario;
        let requests = &plan.workloads[job.traffic][job.utilization];
        let run = &plan.runs[job.traffic];
        let last_arrival_s = requests.last().map_or(0.0, |spec| spec.arrival_s);
        let point = plan.points[job.point];
        // The points of one poll interval and replica count share their
        // seed whatever the sync: the same engines, phases and replica
        // draws, so sync settings differ by the sync alone.
        let seed_point = plan
            .points
            .iter()
            .position(|other| {
                other.poll_interval_s == point.poll_interval_s && other.replicas == point.replicas
            })
            .unwrap_or(job.point);
        let shared_prefix = scenario.traffic[run.traffic].shared_prefix;
        let chains = plan.chains[job.traffic][job.utilization].get_or_init(|| {
            chained_block_hashes_of(requests, shared_prefix, router_block_tokens(&plan.workers))
        });
        let cell = Cell {
            workers: &plan.workers,
            requests,
            chains,
            shared_prefix,
            router: point,
            policy: scenario.policies[job.policy],
            seed: mix(
                workload_seed(scenario.seed, run.traffic, job.utilization) ^ seed_point as u64
            ),
            slowdown: scenario.slowdown.map(|slowdown| Slowdown {
                worker: slowdown.worker as usize,
                at_s: slowdown.at_s(last_arrival_s),
                factor: slowdown.factor,
            }),
            restart: scenario.restart.map(|restart| Restart {
                replica: restart.replica as usize,
                at_s: restart.at_fraction * last_arrival_s,
                warm: restart.warm,
                window_s: restart.window_s,
            }),
            room: plan.room.as_ref(),
            turned_away_ends_session: scenario.traffic[run.traffic]
                .conversation
                .is_some_and(|conversation| conversation.turned_away == TurnedAway::Ends),
        };
        run_cell(&cell, registry)
    };
    let finished: Vec<Vec<(usize, CellStats)>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| -> Result<Vec<(usize, CellStats)>, SimError> {
                    let registry = policy_registry();
                    let mut done = Vec::new();
                    loop {
                        let index = next.fetch_add(1, Ordering::Relaxed);
                        let Some(job) = jobs.get(index) else {
                            break;
                        };
                        match run_job(job, &registry) {
                            Ok(stats) => done.push((index, stats)),
                            Err(error) => {
                                next.store(jobs.len(), Ordering::Relaxed);
                                return Err(error);
                            }
                        }
                        progress.inc(1);
                    }
                    Ok(done)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|handle| handle.join().map_err(|_| SimError::ThreadPanicked)?)
            .collect::<Result<Vec<_>, SimError>>()
    })?;
    progress.finish_and_clear();
    let mut stats: Vec<Option<CellStats>> = vec![None; jobs.len()];
    for (index, cell) in finished.into_iter().flatten() {
        stats[index] = Some(cell);
    }
    let mut outcomes: Vec<ScenarioOutcome> = plans
        .iter()
        .map(|plan| ScenarioOutcome {
            report: Report {
                scenario: plan.scenario.name.clone(),
                seed: plan.scenario.seed,
                workers: plan.scenario.workers(),
                poll_interval_s: plan.scenario.router.poll_interval_s,
                router_replicas: plan.scenario.router.replicas,
                requests_per_cell: plan.scenario.requests,
                capacity: plan.capacity.clone(),
                results: Vec::new(),
                rate_tracking: Vec::new(),
            },
            ttft_cdfs_s: Vec::new(),
            rate_traces: Vec::new(),
        })
        .collect();
    for (job, cell) in jobs.iter().zip(stats) {
        let Some(cell) = cell else {
            return Err(SimError::ThreadPanicked);
        };
        let plan = &plans[job.plan];
        let scenario = plan.scenario;
        let point = plan.points[job.point];
        let run = &plan.runs[job.traffic];
        let capacity = &plan.capacity[run.traffic];
        let offered_rps = {
            let rate_rps = capacity.rates[job.utilization].arrival_rate_rps;
            // A tenant alone arrives at its share of the mix's rate.
            match run.tenant {
                Some(_) => {
                    let mix = plans_workload_len(plan, run.traffic, job.utilization);
                    let alone = plan.workloads[job.traffic][job.utilization].len();
                    if mix > 0 {
                        rate_rps * alone as f64 / mix as f64
                    } else {
                        0.0
                    }
                }
                None => rate_rps,
            }
        };
        let (outcomes_all, by_class, by_tenant) =
            match (&cell.outcomes, scenario.reports_outcomes()) {
                (Some(outcomes), true) => {
                    let mut all = outcomes.all.clone();
                    all.against_capacity(capacity.capacity_rps);
                    let against = |groups: &[GroupStats]| -> Vec<GroupStats> {
                        groups
                            .iter()
                            .map(|group| {
                                let mut group = group.clone();
                                group.against_capacity(capacity.capacity_rps);
                                group
                            })
                            .collect()
                    };
                    (
                        Some(all),
                        against(&outcomes.by_class),
                        against(&outcomes.by_tenant),
                    )
                }
                _ => (None, Vec::new(), Vec::new()),
            };
        let row = ResultRow {
            traffic: run.name.clone(),
            utilization: scenario.utilizations[job.utilization],
            policy: scenario.policies[job.policy].as_str(),
            poll_interval_s: point.sweeps_poll_interval.then_some(point.poll_interval_s),
            router_replicas: point.sweeps_replicas.then_some(point.replicas),
            sync: point.sweeps_sync.then_some(point.sync),
            requests: cell.requests,
            ttft_p50_s: cell.ttft_p50_s,
            ttft_p90_s: cell.ttft_p90_s,
            ttft_p99_s: cell.ttft_p99_s,
            e2e_p50_s: cell.e2e_p50_s,
            e2e_p99_s: cell.e2e_p99_s,
            queue_delay_mean_s: cell.queue_delay_mean_s,
            throughput_tps: cell.throughput_tps,
            preemptions: cell.preemptions,
            imbalance_cv: cell.imbalance_cv,
            ttft_mean_s: cell.ttft_mean_s,
            arrival_rate_rps: offered_rps,
            poll_failures: cell.poll_failures,
            ttft_p99_vs_best_reference: None,
            ttft_mean_vs_best_reference: None,
            sync_stats: cell.sync,
            prefix_hit_rate: if cell.prompt_tokens > 0 {
                cell.reported_cached_tokens as f64 / cell.prompt_tokens as f64
            } else {
                0.0
            },
            cached_tokens_reported: cell.reported_cached_tokens,
            cached_tokens_predicted: cell.predicted_cached_tokens,
            prefix_bytes_per_replica_s: cell.sync.map(|stats| {
                let requests = &plan.workloads[job.traffic][job.utilization];
                let span_s = match (requests.first(), requests.last()) {
                    (Some(first), Some(last)) => last.arrival_s - first.arrival_s,
                    _ => 0.0,
                };
                if span_s > 0.0 {
                    stats.prefix_bytes as f64 / f64::from(point.replicas.max(1)) / span_s
                } else {
                    0.0
                }
            }),
            restart: cell.restart,
            admission: point.sweeps_admission.then_some(point.admission.as_str()),
            outcomes: outcomes_all,
            by_class,
            by_tenant,
        };
        let outcome = &mut outcomes[job.plan];
        if let Some(trace) = &cell.rate_trace {
            outcome
                .report
                .rate_tracking
                .extend(RateTracking::from_trace(&row, trace));
        }
        outcome.report.results.push(row);
        outcome.ttft_cdfs_s.push(cell.ttft_cdf_s);
        outcome.rate_traces.push(cell.rate_trace);
    }
    for outcome in &mut outcomes {
        compare_with_references(&mut outcome.report.results);
    }
    Ok(outcomes)
}

/// The requests of traffic mix `traffic` at load level `utilization` (its
/// own run, the first of its runs).
fn plans_workload_len(plan: &Plan<'_>, traffic: usize, utilization: usize) -> usize {
    plan.runs
        .iter()
        .position(|run| run.traffic == traffic)
        .and_then(|index| plan.workloads.get(index))
        .and_then(|per_load| per_load.get(utilization))
        .map_or(0, Vec::len)
}

/// Fills every row's ratios to the best reference of its traffic, setting
/// and load (when a reference ran there). The references ignore sync (they
/// run only without it), so a row with sync compares with the references
/// of its poll interval and replica count.
fn compare_with_references(rows: &mut [ResultRow]) {
    let references: Vec<&str> = PolicyName::REFERENCES.iter().map(|p| p.as_str()).collect();
    let same_cell = |a: &ResultRow, b: &ResultRow| {
        a.traffic == b.traffic
            && a.utilization == b.utilization
            && a.poll_interval_s == b.poll_interval_s
            && a.router_replicas == b.router_replicas
    };
    let best: Vec<Option<(f64, f64)>> = rows
        .iter()
        .map(|row| {
            rows.iter()
                .filter(|other| references.contains(&other.policy) && same_cell(row, other))
                .map(|other| (other.ttft_p99_s, other.ttft_mean_s))
                .reduce(|(p99, mean), (q99, qmean)| (p99.min(q99), mean.min(qmean)))
        })
        .collect();
    for (row, best) in rows.iter_mut().zip(best) {
        if let Some((p99, mean)) = best {
            row.ttft_p99_vs_best_reference = (p99 > 0.0).then(|| row.ttft_p99_s / p99);
            row.ttft_mean_vs_best_reference = (mean > 0.0).then(|| row.ttft_mean_s / mean);
        }
    }
}
