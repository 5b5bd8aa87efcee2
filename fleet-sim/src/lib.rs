//! The virtual-time fleet simulator that measures routing quality
//! (`docs/engine-model.md`, "The fleet simulator").
//!
//! A scenario file names a fleet of [`Engine`](engine_model::Engine)s, one or more
//! traffic mixes, the router side (poll interval and latency, replicas and
//! their phases) and the policies to compare. For every traffic mix, router
//! setting, load level and policy, the simulator runs one independent cell:
//! the real [`Policy`](policy_core::Policy) implementations, built through the
//! registry, route every arrival; the engines' events drive `first_token` and
//! `finish`; polls go through each backend's own conversion to `WorkerLoad`;
//! with admission, each replica runs the router's admission room, and the
//! report counts what became of each request (served in time or late,
//! turned away) per priority class and tenant.
//! Results go to `<out_dir>/<scenario>/report.json`, `report.md` and SVG plots.
//!
//! ```no_run
//! use fleet_sim::{RunOptions, Scenario, run_scenarios};
//!
//! let mut scenario = Scenario::from_path("fleet-sim/scenarios/size-skew.toml".as_ref())?;
//! scenario.scale_requests(0.25)?;
//! let outcomes = run_scenarios(&[scenario], &RunOptions::default())?;
//! let report = &outcomes[0].report;
//! let row = report.row("size-skew", 0.8, "least_load", None, None).expect("a row");
//! println!("least_load p99 TTFT at 0.8: {:.3} s", row.ttft_p99_s);
//! # Ok::<(), fleet_sim::SimError>(())
//! ```

mod error;
mod fleet;
mod metrics;
mod outcome;
mod report;
mod run;
mod scenario;
mod sync;
mod workload;

use std::path::{Path, PathBuf};
use std::time::Instant;

pub use error::SimError;
pub use fleet::{
    ADMISSION_TICK_S, Cell, RATE_COLUMN, RateSample, RateTrace, Restart, RestartStats, Slowdown,
    build_policy, convert_report, least_true_queue_pick, oracle_pick, policy_registry,
    predicts_wait, router_block_tokens, run_cell,
};
pub use metrics::{CellStats, coefficient_of_variation, percentile};
pub use outcome::{CellOutcomes, GroupStats};
pub use report::{markdown, outcome_table, prefix_table, summary_table, sync_table, write_outputs};
pub use run::{
    LoadRate, RATE_TOLERANCE, RateTracking, Report, ResultRow, RunOptions, ScenarioOutcome,
    TrafficCapacity, capacities, capacity_rps, run_scenarios,
};
pub use scenario::{
    AdmissionClassConfig, AdmissionConfig, AdmissionOrder, ArrivalConfig, CapacityBasis,
    DEFAULT_SYNC_ENTRY_TTL_S, DEFAULT_SYNC_LATENCY_S, LoadReport, PhaseMode, PolicyName, ReportAt,
    RestartConfig, RouterConfig, RouterPoint, STANDARD_SCENARIOS, Scenario, SharedPrefixConfig,
    SlowdownConfig, SyncConfig, TrafficClass, TrafficConfig, TrafficTenant, WorkerGroup,
};
pub use sync::{SyncChannel, SyncStats, counts_replica_pending, replica_id, worker_url};
pub use workload::{LengthDist, RequestSpec, Trace, generate};

/// `engine-sim sim`: run one scenario file, or the standard set.
#[derive(Debug, Clone, clap::Args)]
pub struct SimArgs {
    /// A scenario file to run; without it, every standard scenario in
    /// `--scenarios-dir`.
    #[arg(long)]
    pub scenario: Option<PathBuf>,
    /// Where `<scenario>/report.json`, `report.md` and the plots go.
    #[arg(long, default_value = "target/sim")]
    pub out_dir: PathBuf,
    /// Multiplies every scenario's request count (per policy and load level).
    #[arg(long)]
    pub requests_scale: Option<f64>,
    /// Where the standard scenario files are (default: `fleet-sim/scenarios/`).
    #[arg(long)]
    pub scenarios_dir: Option<PathBuf>,
    /// Simulation threads (default: the available parallelism).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Skip the SVG plots.
    #[arg(long)]
    pub no_plots: bool,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

/// The standard scenario files, in [`STANDARD_SCENARIOS`] order.
pub fn standard_scenario_paths(dir: &Path) -> Vec<PathBuf> {
    STANDARD_SCENARIOS
        .iter()
        .map(|name| dir.join(format!("{name}.toml")))
        .collect()
}

/// The crate's own `scenarios/` directory.
pub fn default_scenarios_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios")
}

/// Runs `engine-sim sim`: loads the scenario(s), prints the derived arrival
/// rates, simulates, writes the outputs and prints a summary table, the
/// total time and the simulated requests per second.
pub fn run_cli(args: SimArgs) -> Result<(), SimError> {
    let paths = match &args.scenario {
        Some(path) => vec![path.clone()],
        None => {
            let dir = args
                .scenarios_dir
                .clone()
                .unwrap_or_else(default_scenarios_dir);
            let paths = standard_scenario_paths(&dir);
            if !paths.iter().any(|path| path.exists()) {
                return Err(SimError::NoScenarios { dir });
            }
            paths
        }
    };
    let mut scenarios = Vec::with_capacity(paths.len());
    for path in &paths {
        let mut scenario = Scenario::from_path(path)?;
        if let Some(factor) = args.requests_scale {
            scenario.scale_requests(factor)?;
        }
        scenarios.push(scenario);
    }
    for scenario in &scenarios {
        for capacity in capacities(scenario)? {
            let rates: Vec<String> = capacity
                .rates
                .iter()
                .map(|rate| {
                    format!(
                        "u={} → {:.2} req/s",
                        rate.utilization, rate.arrival_rate_rps
                    )
                })
                .collect();
            let measured = capacity
                .formula_capacity_rps
                .map(|formula| format!(" measured (the formula's {formula:.2})"))
                .unwrap_or_default();
            println!(
                "{} / {}: capacity {:.2} req/s{measured} over {} workers (mean prompt {:.1}, \
                 cached {:.1}, output {:.1} tokens); {}",
                scenario.name,
                capacity.traffic,
                capacity.capacity_rps,
                scenario.workers(),
                capacity.mean_prompt_tokens,
                capacity.mean_cached_prompt_tokens,
                capacity.mean_output_tokens,
                rates.join(", ")
            );
        }
    }
    let mut options = RunOptions {
        progress: !args.quiet,
        ..RunOptions::default()
    };
    if let Some(threads) = args.threads {
        options.threads = threads.max(1);
    }
    let started = Instant::now();
    let outcomes = run_scenarios(&scenarios, &options)?;
    let elapsed_s = started.elapsed().as_secs_f64();
    let mut simulated_requests = 0usize;
    for outcome in &outcomes {
        simulated_requests += outcome
            .report
            .results
            .iter()
            .map(|row| row.requests)
            .sum::<usize>();
        let dir = write_outputs(outcome, &args.out_dir, !args.no_plots)?;
        println!();
        println!("## {} → {}\n", outcome.report.scenario, dir.display());
        print!("{}", summary_table(&outcome.report));
    }
    println!();
    println!(
        "simulated {simulated_requests} requests in {elapsed_s:.1} s on {} threads: {:.0} requests/s",
        options.threads,
        simulated_requests as f64 / elapsed_s.max(1e-9)
    );
    Ok(())
}
