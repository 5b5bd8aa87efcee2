//! `cargo xtask chaos`: the router in front of a fleet with one engine per
//! generation fault, against the same good engines alone, under the same
//! open-loop load. Measured, not asserted: written to
//! `target/chaos/report.{md,json}`.
//!
//! Fleet A is 3 good engine-sim SGLang engines; fleet B is the same 3 plus 6
//! bad ones, one per fault mode (started healthy and switched to their fault
//! once the router sees all 9 healthy). Each fleet gets its own router
//! (`least_load`, tight deadlines, outlier ejection). The load is Poisson
//! arrivals of mostly streaming, size-skewed chat requests, each with a
//! unique `x-request-id`; the engines' `/control/admitted` logs then show
//! which requests were generated on more than one engine (a faulty
//! engine's, retried or continued elsewhere; or two good ones, when a
//! hedge's loser had already started). For fleet B, `/admin/workers` is polled every 100 ms to time each
//! bad engine's ejection.
//!
//! The task fails only when the harness does (a process dies, no ports, the
//! router never becomes ready); missed goals are reported, not enforced.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::splitmix::SplitMix64;
use crate::{Process, build_release, free_ports, release_binary, start_engines, workspace_root};

const CHAOS_USAGE: &str = "usage: cargo xtask chaos [--rate R] [--duration-s S] [--seed N]

  --rate R          mean arrivals per second, Poisson (default 40)
  --duration-s S    how long arrivals last, seconds (default 30)
  --seed N          arrivals and request mix; both fleets get the same (default 7)";

// The router's deadlines and ejection settings (written to router.toml).
const FIRST_BYTE_TIMEOUT_MS: u64 = 2_000;
const STREAM_IDLE_TIMEOUT_MS: u64 = 2_000;
const REQUEST_DEADLINE_MS: u64 = 30_000;
const CONSECUTIVE_FAILURES: u64 = 3;
const BASE_EJECTION_MS: u64 = 5_000;
/// The production default (5 s against a 60 s idle deadline), scaled to
/// this run's idle deadline.
const SILENT_STREAM_MS: u64 = 500;
/// 6 bad engines of 9 are 67 %: all of them may be ejected at once.
const MAX_EJECTED_PERCENT: u64 = 75;
/// The production default (1 s against a 30 s first-byte deadline),
/// scaled like `silent_stream_ms`.
const HEDGE_AFTER_MS: u64 = 100;
/// Past the first-byte deadline, so a probe of a slow engine fails too.
const PROBE_TIMEOUT_MS: u64 = 2_000;
const HEALTH_INTERVAL_MS: u64 = 500;
const LOAD_INTERVAL_MS: u64 = 250;
/// The client waits this much past the router's deadline, so a request the
/// router lets overrun shows as a client timeout instead of being cut by us.
const CLIENT_MARGIN_MS: u64 = 5_000;

// The engines.
/// Virtual seconds per wall second: TTFT of tens of ms for short prompts,
/// about 200 ms for long ones, at moderate utilization.
const TIME_SCALE: &str = "2";
/// Far above what the load keeps running at once: no engine-side cap.
const MAX_RUNNING: &str = "1024";
/// Well past the first-byte deadline.
const SLOW_FIRST_BYTE_MS: u64 = 10_000;
const GOOD_ENGINES: usize = 3;
const BAD_MODES: [&str; 6] = [
    "hang-generation",
    "hang-mid-stream",
    "generation-500",
    "close-mid-stream",
    "slow-first-byte",
    "refuse-connections",
];

// The load.
const STREAM_FRACTION: f64 = 0.85;
const LONG_FRACTION: f64 = 0.1;
const SHORT_PROMPT_TOKENS: usize = 200;
const LONG_PROMPT_TOKENS: usize = 3_000;
const OUTPUT_TOKENS: u32 = 32;
/// The router's (and engine-sim's) prompt-size estimate.
const CHARS_PER_TOKEN: usize = 4;
const ADMIN_POLL_MS: u64 = 100;
/// How long the router gets to see every worker healthy.
const READY_LIMIT: Duration = Duration::from_secs(60);

// Goals (reported, not enforced).
const GOAL_SUCCESS_RATE: f64 = 0.999;
const GOAL_P99_TTFT_RATIO: f64 = 1.2;

/// Settings of one `cargo xtask chaos` run.
#[derive(Debug, Clone)]
struct Options {
    rate: f64,
    duration_s: f64,
    seed: u64,
}

impl Options {
    fn parse(args: &[String]) -> Result<Options, String> {
        let mut options = Options {
            rate: 40.0,
            duration_s: 30.0,
            seed: 7,
        };
        let mut iter = args.iter();
        while let Some(arg) = iter.next() {
            let mut value = |name: &str| {
                iter.next()
                    .cloned()
                    .ok_or_else(|| format!("{name} needs a value\n\n{CHAOS_USAGE}"))
            };
            let positive = |name: &str, text: String| {
                text.parse::<f64>()
                    .ok()
                    .filter(|number| number.is_finite() && *number > 0.0)
                    .ok_or_else(|| format!("{name}: not a positive number: {text:?}"))
            };
            match arg.as_str() {
                "--rate" => options.rate = positive("--rate", value("--rate")?)?,
                "--duration-s" => {
                    options.duration_s = positive("--duration-s", value("--duration-s")?)?;
                }
                "--seed" => {
                    let text = value("--seed")?;
                    options.seed = text
                        .parse()
                        .map_err(|_| format!("--seed: not a number: {text:?}"))?;
                }
                "-h" | "--help" => return Err(CHAOS_USAGE.to_owned()),
                other => return Err(format!("unknown option {other:?}\n\n{CHAOS_USAGE}")),
            }
        }
        Ok(options)
    }
}

/// `cargo xtask chaos [options]`.
pub(crate) fn run(args: &[String]) -> Result<(), String> {
    let options = Options::parse(args)?;
    let out_dir = chaos_dir();
    std::fs::create_dir_all(&out_dir)
        .map_err(|error| format!("cannot create {}: {error}", out_dir.display()))?;
    build_release(&["engine-sim", "router-bin"])?;
    let config = write_router_config(&out_dir)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|error| format!("cannot start the runtime: {error}"))?;
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_millis(
            REQUEST_DEADLINE_MS + CLIENT_MARGIN_MS,
        ))
        .build()
        .map_err(|error| format!("cannot build the HTTP client: {error}"))?;

    eprintln!("xtask: == starting {GOOD_ENGINES} good engines");
    let mut engines = Vec::new();
    for index in 0..GOOD_ENGINES {
        engines.push(start_engine(format!("good-{}", index + 1), None, index)?);
    }

    eprintln!(
        "xtask: == fleet A (good only): {} req/s for {} s",
        options.rate, options.duration_s
    );
    let fleet_a = {
        let mut router = start_router(&out_dir, &config, "a", &engines)?;
        let result = runtime.block_on(run_fleet(&client, &options, "a", &mut router, &engines));
        check_alive(&mut router.process, &mut engines)?;
        result?
    };

    eprintln!("xtask: == starting {} bad engines", BAD_MODES.len());
    for (index, mode) in BAD_MODES.iter().enumerate() {
        engines.push(start_engine(
            (*mode).to_owned(),
            Some(mode),
            GOOD_ENGINES + index,
        )?);
    }
    eprintln!(
        "xtask: == fleet B (chaos: {} good + {} bad): {} req/s for {} s",
        GOOD_ENGINES,
        BAD_MODES.len(),
        options.rate,
        options.duration_s
    );
    let fleet_b = {
        let mut router = start_router(&out_dir, &config, "b", &engines)?;
        let result = runtime.block_on(run_fleet(&client, &options, "b", &mut router, &engines));
        check_alive(&mut router.process, &mut engines)?;
        result?
    };

    let report = Report {
        options,
        build: build_note(),
        a: fleet_a,
        b: fleet_b,
    };
    let markdown = report.markdown();
    println!("{markdown}");
    write(&out_dir.join("report.md"), &markdown)?;
    let json_text = serde_json::to_string_pretty(&report.json())
        .map_err(|error| format!("cannot encode the report: {error}"))?;
    write(&out_dir.join("report.json"), &json_text)?;
    eprintln!(
        "xtask: chaos report: {}",
        out_dir.join("report.md").display()
    );
    Ok(())
}

/// The commit the binaries were built from, and whether the working tree
/// differed from it (the binaries are built from the working tree).
fn build_note() -> String {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .current_dir(workspace_root())
            .output()
            .ok()
            .filter(|output| output.status.success())
            .map(|output| String::from_utf8_lossy(&output.stdout).trim().to_owned())
    };
    let Some(commit) = git(&["rev-parse", "--short", "HEAD"]) else {
        return "unknown commit".to_owned();
    };
    match git(&[
        "status",
        "--porcelain",
        "--",
        "router",
        "router-bin",
        "engine-sim",
    ]) {
        Some(changes) if !changes.is_empty() => format!(
            "commit {commit} plus uncommitted changes under router/, router-bin/ or engine-sim/"
        ),
        _ => format!("commit {commit}"),
    }
}

/// `target/chaos` under the workspace (or `CARGO_TARGET_DIR`).
fn chaos_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|dir| {
            if dir.is_absolute() {
                dir
            } else {
                workspace_root().join(dir)
            }
        })
        .unwrap_or_else(|| workspace_root().join("target"));
    target.join("chaos")
}

fn write(path: &Path, text: &str) -> Result<(), String> {
    std::fs::write(path, text).map_err(|error| format!("cannot write {}: {error}", path.display()))
}

fn write_router_config(out_dir: &Path) -> Result<PathBuf, String> {
    let path = out_dir.join("router.toml");
    let text = format!(
        "# Written by cargo xtask chaos.
[server]
first_byte_timeout_ms = {FIRST_BYTE_TIMEOUT_MS}
stream_idle_timeout_ms = {STREAM_IDLE_TIMEOUT_MS}
request_deadline_ms = {REQUEST_DEADLINE_MS}

[health]
interval_ms = {HEALTH_INTERVAL_MS}
timeout_ms = 400

[load_monitor]
interval_ms = {LOAD_INTERVAL_MS}
timeout_ms = 200
stale_after_ms = 1000

[outlier_detection]
consecutive_failures = {CONSECUTIVE_FAILURES}
base_ejection_ms = {BASE_EJECTION_MS}
max_ejected_percent = {MAX_EJECTED_PERCENT}
probe_timeout_ms = {PROBE_TIMEOUT_MS}
silent_stream_ms = {SILENT_STREAM_MS}

[migration]
# Non-streaming requests go upstream as streams: retried when no first
# event comes, continued when they break.
non_streaming_as_stream = true

[hedging]
after_ms = {HEDGE_AFTER_MS}
"
    );
    write(&path, &text)?;
    Ok(path)
}

/// One engine-sim SGLang engine (its own process).
struct Engine {
    name: String,
    /// The fault it is switched to once the router sees it healthy.
    fault: Option<&'static str>,
    url: String,
    process: Process,
}

fn start_engine(name: String, fault: Option<&'static str>, index: usize) -> Result<Engine, String> {
    let seed = (index + 1).to_string();
    let slow_ms = SLOW_FIRST_BYTE_MS.to_string();
    let (process, urls) = start_engines(
        "sglang",
        &[
            "--seed",
            &seed,
            "--time-scale",
            TIME_SCALE,
            "--max-running",
            MAX_RUNNING,
            "--slow-first-byte-ms",
            &slow_ms,
        ],
    )?;
    let url = urls
        .into_iter()
        .next()
        .map(|(http, _)| http)
        .filter(|http| !http.is_empty())
        .ok_or_else(|| format!("engine {name} printed no HTTP address"))?;
    Ok(Engine {
        name,
        fault,
        url,
        process,
    })
}

/// A running router; its log goes to `target/chaos/router-<fleet>.log`.
struct Router {
    process: Process,
    url: String,
}

fn start_router(
    out_dir: &Path,
    config: &Path,
    fleet: &str,
    engines: &[Engine],
) -> Result<Router, String> {
    let port = free_ports(1)?;
    let log_path = out_dir.join(format!("router-{fleet}.log"));
    let log = File::create(&log_path)
        .map_err(|error| format!("cannot create {}: {error}", log_path.display()))?;
    let mut command = Command::new(release_binary("router"));
    command
        .arg("--config")
        .arg(config)
        .args(["--port", &port.to_string(), "--policy", "least_load"])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::from(log));
    for engine in engines {
        command.args(["--worker", &format!("sglang={}", engine.url)]);
    }
    let process = Process::spawn(&format!("router (fleet {fleet})"), &mut command)?;
    Ok(Router {
        process,
        url: format!("http://127.0.0.1:{port}"),
    })
}

/// Fails when the router or any engine has exited.
fn check_alive(router: &mut Process, engines: &mut [Engine]) -> Result<(), String> {
    let processes =
        std::iter::once(router).chain(engines.iter_mut().map(|engine| &mut engine.process));
    for process in processes {
        if let Ok(Some(status)) = process.child.try_wait() {
            return Err(format!("{} exited during the run ({status})", process.name));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------- one fleet

/// Everything measured on one fleet.
#[derive(Debug)]
struct FleetResult {
    name: &'static str,
    records: Vec<Record>,
    /// Per engine, in fleet order.
    engines: Vec<EngineResult>,
    /// Ids admitted more than once in all (on one engine twice, or on two).
    duplicate_ids: Vec<(String, Vec<String>)>,
    /// Succeeded requests whose id no engine admitted (the router did not
    /// forward `x-request-id`, or the log is wrong).
    succeeded_not_admitted: usize,
    load_wall_s: f64,
    /// The router's migration metrics after the load.
    migrations: Migrations,
}

/// `router_migrations_total` by its labels, the resume-time histogram, and
/// `router_hedges_total`.
#[derive(Debug, Default)]
struct Migrations {
    /// `(reason, outcome, count)`.
    counts: Vec<(String, String, f64)>,
    /// `router_hedges_total`: `(outcome, count)`.
    hedges: Vec<(String, f64)>,
    /// `(upper bound in seconds, cumulative count)`.
    resume_buckets: Vec<(f64, f64)>,
    resume_sum_s: f64,
    resume_count: f64,
}

impl Migrations {
    /// Reads them from the router's Prometheus text.
    fn parse(text: &str) -> Migrations {
        let mut migrations = Migrations::default();
        let label = |labels: &str, name: &str| {
            labels
                .split(',')
                .find_map(|pair| pair.strip_prefix(&format!("{name}=\"")))
                .map(|value| value.trim_end_matches('"').to_owned())
                .unwrap_or_default()
        };
        for line in text.lines() {
            let Some((series, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(value) = value.parse::<f64>() else {
                continue;
            };
            if let Some(labels) = series.strip_prefix("router_migrations_total{") {
                let labels = labels.trim_end_matches('}');
                migrations
                    .counts
                    .push((label(labels, "reason"), label(labels, "outcome"), value));
            } else if let Some(labels) = series.strip_prefix("router_hedges_total{") {
                let outcome = label(labels.trim_end_matches('}'), "outcome");
                migrations.hedges.push((outcome, value));
            } else if let Some(labels) =
                series.strip_prefix("router_migration_resume_seconds_bucket{")
            {
                let bound = label(labels.trim_end_matches('}'), "le");
                let bound = if bound == "+Inf" {
                    f64::INFINITY
                } else {
                    bound.parse().unwrap_or(f64::NAN)
                };
                migrations.resume_buckets.push((bound, value));
            } else if series == "router_migration_resume_seconds_sum" {
                migrations.resume_sum_s = value;
            } else if series == "router_migration_resume_seconds_count" {
                migrations.resume_count = value;
            }
        }
        migrations
    }

    /// The smallest bucket bound holding `quantile` of the resumes.
    fn quantile_bound_s(&self, quantile: f64) -> f64 {
        let wanted = quantile * self.resume_count;
        self.resume_buckets
            .iter()
            .find(|(_, count)| *count >= wanted)
            .map_or(f64::NAN, |(bound, _)| *bound)
    }
}

#[derive(Debug)]
struct EngineResult {
    name: String,
    fault: Option<&'static str>,
    /// Generation requests that reached it during this fleet's load.
    received: u64,
    /// `/health_generate` probes it answered during the load.
    probes: u64,
    /// This fleet's ids it admitted.
    admitted: usize,
    trace: Option<WorkerTrace>,
}

async fn run_fleet(
    client: &reqwest::Client,
    options: &Options,
    fleet: &'static str,
    router: &mut Router,
    engines: &[Engine],
) -> Result<FleetResult, String> {
    wait_all_healthy(client, router, engines.len()).await?;
    for engine in engines {
        if let Some(mode) = engine.fault {
            set_fault(client, &engine.url, mode).await?;
        }
    }
    let counts_before = engine_counts(client, engines).await?;

    // Load and ejection polling start together: times count from here.
    let started = tokio::time::Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let poller = tokio::spawn(poll_workers(
        client.clone(),
        router.url.clone(),
        started,
        stop.clone(),
    ));
    let plan = plan(options, fleet);
    let records = send_all(client, std::slice::from_ref(&router.url), plan, started).await;
    let load_wall_s = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let traces = poller
        .await
        .map_err(|error| format!("the /admin/workers poller failed: {error}"))?;

    let counts_after = engine_counts(client, engines).await?;
    let prefix = format!("{fleet}-");
    let mut admitted_on: HashMap<String, Vec<String>> = HashMap::new();
    let mut engine_results = Vec::new();
    for (index, engine) in engines.iter().enumerate() {
        let ids = admitted_ids(client, &engine.url).await?;
        let mine: Vec<String> = ids
            .into_iter()
            .filter(|id| id.starts_with(&prefix))
            .collect();
        for id in &mine {
            admitted_on
                .entry(id.clone())
                .or_default()
                .push(engine.name.clone());
        }
        let before = counts_before.get(index).copied().unwrap_or_default();
        let after = counts_after.get(index).copied().unwrap_or_default();
        engine_results.push(EngineResult {
            name: engine.name.clone(),
            fault: engine.fault,
            received: after.0.saturating_sub(before.0),
            probes: after.1.saturating_sub(before.1),
            admitted: mine.len(),
            trace: traces.get(engine.url.trim_end_matches('/')).cloned(),
        });
    }
    let mut duplicate_ids: Vec<(String, Vec<String>)> = admitted_on
        .iter()
        .filter(|(_, on)| on.len() > 1)
        .map(|(id, on)| (id.clone(), on.clone()))
        .collect();
    duplicate_ids.sort();
    let metrics = client
        .get(format!("{}/metrics", router.url))
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .map_err(|error| format!("GET /metrics: {error}"))?
        .text()
        .await
        .map_err(|error| format!("GET /metrics: {error}"))?;
    let migrations = Migrations::parse(&metrics);
    let succeeded_not_admitted = records
        .iter()
        .filter(|record| record.outcome == Outcome::Ok && !admitted_on.contains_key(&record.id))
        .count();
    Ok(FleetResult {
        name: fleet,
        records,
        engines: engine_results,
        duplicate_ids,
        succeeded_not_admitted,
        load_wall_s,
        migrations,
    })
}

async fn get_json(client: &reqwest::Client, url: &str) -> Result<Value, String> {
    let response = client
        .get(url)
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .map_err(|error| format!("GET {url}: {error}"))?;
    if !response.status().is_success() {
        return Err(format!("GET {url}: {}", response.status()));
    }
    response
        .json()
        .await
        .map_err(|error| format!("GET {url}: {error}"))
}

/// Waits until `/admin/workers` lists `count` workers, all healthy and in
/// rotation.
async fn wait_all_healthy(
    client: &reqwest::Client,
    router: &mut Router,
    count: usize,
) -> Result<(), String> {
    let deadline = Instant::now() + READY_LIMIT;
    let url = format!("{}/admin/workers", router.url);
    loop {
        if let Ok(Some(status)) = router.process.child.try_wait() {
            return Err(format!(
                "{} exited before it was ready ({status}); see its log under target/chaos/",
                router.process.name
            ));
        }
        if let Ok(body) = get_json(client, &url).await {
            let workers = body
                .get("workers")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            let ready = workers.len() == count
                && workers.iter().all(|worker| {
                    worker.get("healthy") == Some(&Value::Bool(true))
                        && worker.get("in_rotation") == Some(&Value::Bool(true))
                });
            if ready {
                return Ok(());
            }
        }
        if Instant::now() > deadline {
            return Err(format!(
                "the router did not see all {count} workers healthy within {} s",
                READY_LIMIT.as_secs()
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn set_fault(client: &reqwest::Client, engine_url: &str, mode: &str) -> Result<(), String> {
    let url = format!("{engine_url}/control/fault");
    let response = client
        .post(&url)
        .timeout(Duration::from_secs(5))
        .json(&json!({"mode": mode}))
        .send()
        .await
        .map_err(|error| format!("POST {url}: {error}"))?;
    if response.status().is_success() {
        Ok(())
    } else {
        Err(format!("POST {url} {mode}: {}", response.status()))
    }
}

/// Each engine's `generation_requests` (counted on arrival) and
/// `health_generate_requests`.
async fn engine_counts(
    client: &reqwest::Client,
    engines: &[Engine],
) -> Result<Vec<(u64, u64)>, String> {
    let mut counts = Vec::with_capacity(engines.len());
    for engine in engines {
        let stats = get_json(client, &format!("{}/control/stats", engine.url)).await?;
        let count = |name: &str| stats.get(name).and_then(Value::as_u64).unwrap_or(0);
        counts.push((
            count("generation_requests"),
            count("health_generate_requests"),
        ));
    }
    Ok(counts)
}

async fn admitted_ids(client: &reqwest::Client, engine_url: &str) -> Result<Vec<String>, String> {
    let url = format!("{engine_url}/control/admitted");
    let body = get_json(client, &url).await?;
    let ids = body
        .get("admitted_request_ids")
        .and_then(Value::as_array)
        .ok_or_else(|| format!("GET {url}: no admitted_request_ids"))?;
    Ok(ids
        .iter()
        .filter_map(Value::as_str)
        .map(str::to_owned)
        .collect())
}

// ---------------------------------------------------------------- ejections

/// What `/admin/workers` showed of one worker during the load.
#[derive(Debug, Clone, Default)]
struct WorkerTrace {
    /// Seconds from the start of the load to the first poll that showed
    /// `"ejected": true`.
    first_ejected_s: Option<f64>,
    /// ... and to the first that showed `"in_rotation": false`.
    first_out_of_rotation_s: Option<f64>,
    /// `"ejections"` at the last poll.
    ejections: u64,
    /// Polls that showed it back in rotation right after one that showed
    /// it ejected.
    returns: u64,
    /// Whether the last poll showed it ejected.
    ejected_now: bool,
}

/// Polls `/admin/workers` every [`ADMIN_POLL_MS`] until `stop`; the traces by
/// worker URL.
async fn poll_workers(
    client: reqwest::Client,
    router_url: String,
    started: tokio::time::Instant,
    stop: Arc<AtomicBool>,
) -> HashMap<String, WorkerTrace> {
    let url = format!("{router_url}/admin/workers");
    let mut traces: HashMap<String, WorkerTrace> = HashMap::new();
    let mut next = started;
    while !stop.load(Ordering::Relaxed) {
        let polled_s = started.elapsed().as_secs_f64();
        if let Ok(body) = get_json(&client, &url).await {
            let workers = body
                .get("workers")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            for worker in workers {
                let Some(worker_url) = worker.get("url").and_then(Value::as_str) else {
                    continue;
                };
                let trace = traces
                    .entry(worker_url.trim_end_matches('/').to_owned())
                    .or_default();
                let ejected = worker.get("ejected") == Some(&Value::Bool(true));
                let in_rotation = worker.get("in_rotation") == Some(&Value::Bool(true));
                if ejected {
                    trace.first_ejected_s.get_or_insert(polled_s);
                }
                if !in_rotation {
                    trace.first_out_of_rotation_s.get_or_insert(polled_s);
                }
                if trace.ejected_now && !ejected && in_rotation {
                    trace.returns += 1;
                }
                trace.ejected_now = ejected;
                if let Some(ejections) = worker.get("ejections").and_then(Value::as_u64) {
                    trace.ejections = ejections;
                }
            }
        }
        next += Duration::from_millis(ADMIN_POLL_MS);
        tokio::time::sleep_until(next.max(tokio::time::Instant::now())).await;
    }
    traces
}

// ---------------------------------------------------------------- load

/// One planned request.
#[derive(Debug, Clone)]
pub(crate) struct Planned {
    pub(crate) id: String,
    pub(crate) at_s: f64,
    pub(crate) stream: bool,
    pub(crate) long: bool,
}

/// The same arrivals and mix for every fleet with the same seed; ids are
/// `<fleet>-<n>`, unique across both fleets.
fn plan(options: &Options, fleet: &str) -> Vec<Planned> {
    let mut random = SplitMix64::new(options.seed);
    let mut planned = Vec::new();
    let mut at_s = 0.0;
    loop {
        // Exponential gaps: Poisson arrivals.
        at_s += -(1.0 - random.next_unit()).ln() / options.rate;
        if at_s >= options.duration_s {
            break;
        }
        let stream = random.next_unit() < STREAM_FRACTION;
        let long = random.next_unit() < LONG_FRACTION;
        planned.push(Planned {
            id: format!("{fleet}-{:06}", planned.len()),
            at_s,
            stream,
            long,
        });
    }
    planned
}

/// How a request ended, from the client's side.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Outcome {
    /// 200 and, for a stream, `[DONE]` with no SSE error event.
    Ok,
    /// Any other status.
    Status(u16),
    /// A `data: {"error": ...}` event in a stream.
    SseError,
    /// Ended cleanly but without `[DONE]`, or a body that is not an answer.
    Incomplete,
    /// No end within the client's timeout (the deadline plus a margin).
    ClientTimeout,
    /// Connection refused, reset or cut.
    Connection,
}

impl Outcome {
    fn label(&self) -> String {
        match self {
            Outcome::Ok => "ok".to_owned(),
            Outcome::Status(code) => format!("HTTP {code}"),
            Outcome::SseError => "SSE error event".to_owned(),
            Outcome::Incomplete => "incomplete answer".to_owned(),
            Outcome::ClientTimeout => "client timeout".to_owned(),
            Outcome::Connection => "connection error".to_owned(),
        }
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Record {
    id: String,
    /// When it was due, seconds from the start of the load.
    at_s: f64,
    stream: bool,
    long: bool,
    pub(crate) outcome: Outcome,
    /// To the first `data:` event, or to the response head of a whole
    /// answer (which engines send once the answer is complete).
    pub(crate) ttft_s: Option<f64>,
    duration_s: f64,
}

/// Sends every planned request at its time (open loop: never waits for an
/// answer before the next) and returns their records in plan order. With
/// several routers (replicas of one fleet), requests take turns among them.
pub(crate) async fn send_all(
    client: &reqwest::Client,
    router_urls: &[String],
    plan: Vec<Planned>,
    started: tokio::time::Instant,
) -> Vec<Record> {
    let urls: Vec<String> = router_urls
        .iter()
        .map(|router_url| format!("{router_url}/v1/chat/completions"))
        .collect();
    let mut tasks = Vec::with_capacity(plan.len());
    for (index, planned) in plan.into_iter().enumerate() {
        tokio::time::sleep_until(started + Duration::from_secs_f64(planned.at_s)).await;
        let client = client.clone();
        let Some(url) = urls.get(index % urls.len().max(1)).cloned() else {
            break;
        };
        tasks.push(tokio::spawn(async move {
            send_one(&client, &url, planned).await
        }));
    }
    let mut records = Vec::with_capacity(tasks.len());
    for task in tasks {
        // A task only fails by panicking; the record is lost then, which
        // the sent count shows.
        if let Ok(record) = task.await {
            records.push(record);
        }
    }
    records
}

fn prompt(id: &str, tokens: usize) -> String {
    // A unique head keeps the engines' prefix caches from turning later
    // prompts into hits.
    let mut text = format!("request {id} ");
    let filler = "lorem ip";
    while text.len() + filler.len() <= tokens * CHARS_PER_TOKEN {
        text.push_str(filler);
    }
    text
}

async fn send_one(client: &reqwest::Client, url: &str, planned: Planned) -> Record {
    let tokens = if planned.long {
        LONG_PROMPT_TOKENS
    } else {
        SHORT_PROMPT_TOKENS
    };
    let body = json!({
        "model": "sim-model",
        "stream": planned.stream,
        "max_tokens": OUTPUT_TOKENS,
        "messages": [{"role": "user", "content": prompt(&planned.id, tokens)}],
    });
    let sent = Instant::now();
    let (outcome, ttft_s) = exchange(client, url, &planned, &body, sent).await;
    Record {
        id: planned.id,
        at_s: planned.at_s,
        stream: planned.stream,
        long: planned.long,
        outcome,
        ttft_s,
        duration_s: sent.elapsed().as_secs_f64(),
    }
}

fn failed(error: &reqwest::Error) -> Outcome {
    if error.is_timeout() {
        Outcome::ClientTimeout
    } else {
        Outcome::Connection
    }
}

async fn exchange(
    client: &reqwest::Client,
    url: &str,
    planned: &Planned,
    body: &Value,
    sent: Instant,
) -> (Outcome, Option<f64>) {
    let response = match client
        .post(url)
        .header("x-request-id", &planned.id)
        .json(body)
        .send()
        .await
    {
        Ok(response) => response,
        Err(error) => return (failed(&error), None),
    };
    let status = response.status().as_u16();
    if status != 200 {
        // Read the error body so the connection can be reused.
        let _ = response.bytes().await;
        return (Outcome::Status(status), None);
    }
    if !planned.stream {
        let head_s = sent.elapsed().as_secs_f64();
        return match response.bytes().await {
            Ok(bytes) => {
                let answer: Option<Value> = serde_json::from_slice(&bytes).ok();
                let complete = answer
                    .as_ref()
                    .is_some_and(|answer| answer.get("choices").is_some());
                if complete {
                    (Outcome::Ok, Some(head_s))
                } else {
                    (Outcome::Incomplete, Some(head_s))
                }
            }
            Err(error) => (failed(&error), Some(head_s)),
        };
    }
    let mut response = response;
    let mut buffered = String::new();
    let mut first_event_s = None;
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) => buffered.push_str(&String::from_utf8_lossy(&chunk)),
            Ok(None) => return (Outcome::Incomplete, first_event_s),
            Err(error) => return (failed(&error), first_event_s),
        }
        while let Some(end) = buffered.find("\n\n") {
            let event: String = buffered.drain(..end + 2).collect();
            for line in event.lines() {
                let Some(data) = line.strip_prefix("data:") else {
                    continue;
                };
                let data = data.trim();
                first_event_s.get_or_insert_with(|| sent.elapsed().as_secs_f64());
                if data == "[DONE]" {
                    return (Outcome::Ok, first_event_s);
                }
                let is_error = serde_json::from_str::<Value>(data)
                    .ok()
                    .is_some_and(|value| value.get("error").is_some());
                if is_error {
                    return (Outcome::SseError, first_event_s);
                }
            }
        }
    }
}

// ---------------------------------------------------------------- report

/// What one fleet's records add up to.
#[derive(Debug)]
struct Summary {
    sent: usize,
    succeeded: usize,
    failures: BTreeMap<String, usize>,
    success_rate: f64,
    p50_ttft_s: f64,
    p99_ttft_s: f64,
    max_duration_s: f64,
    over_deadline: usize,
    /// Requests a faulty engine broke that ran again on another (retried
    /// or continued: migration does this on purpose).
    rerun_after_fault: usize,
    /// Requests generated on two good engines: a hedge whose loser had
    /// started before it was closed.
    on_two_good_engines: usize,
}

impl FleetResult {
    fn summary(&self) -> Summary {
        let sent = self.records.len();
        let mut failures = BTreeMap::new();
        let mut ttfts = Vec::new();
        for record in &self.records {
            if record.outcome == Outcome::Ok {
                if let Some(ttft) = record.ttft_s {
                    ttfts.push(ttft);
                }
            } else {
                *failures.entry(record.outcome.label()).or_insert(0) += 1;
            }
        }
        let succeeded = self
            .records
            .iter()
            .filter(|record| record.outcome == Outcome::Ok)
            .count();
        let deadline_s = REQUEST_DEADLINE_MS as f64 / 1000.0;
        Summary {
            sent,
            succeeded,
            failures,
            success_rate: if sent == 0 {
                f64::NAN
            } else {
                succeeded as f64 / sent as f64
            },
            p50_ttft_s: percentile(&ttfts, 0.50),
            p99_ttft_s: percentile(&ttfts, 0.99),
            max_duration_s: self
                .records
                .iter()
                .map(|record| record.duration_s)
                .fold(0.0, f64::max),
            over_deadline: self
                .records
                .iter()
                .filter(|record| record.duration_s > deadline_s)
                .count(),
            rerun_after_fault: self
                .duplicate_ids
                .iter()
                .filter(|(_, on)| on.iter().any(|engine| !is_good(engine)))
                .count(),
            on_two_good_engines: self
                .duplicate_ids
                .iter()
                .filter(|(_, on)| on.iter().filter(|engine| is_good(engine)).count() > 1)
                .count(),
        }
    }
}

impl FleetResult {
    /// p99 TTFT of the succeeded requests due after `from_s`.
    fn p99_ttft_from(&self, from_s: f64) -> f64 {
        let ttfts: Vec<f64> = self
            .records
            .iter()
            .filter(|record| record.outcome == Outcome::Ok && record.at_s >= from_s)
            .filter_map(|record| record.ttft_s)
            .collect();
        percentile(&ttfts, 0.99)
    }

    /// When the last faulty engine left rotation (ejected or unhealthy),
    /// seconds from the start of the load; None if one never did.
    fn all_faulty_out_s(&self) -> Option<f64> {
        self.engines
            .iter()
            .filter(|engine| engine.fault.is_some())
            .map(|engine| {
                engine
                    .trace
                    .as_ref()
                    .and_then(|trace| trace.first_out_of_rotation_s)
            })
            .try_fold(0.0, |latest: f64, out_s| {
                out_s.map(|out_s| latest.max(out_s))
            })
    }
}

/// Whether an engine of the report is one of the good ones.
fn is_good(engine: &str) -> bool {
    engine.starts_with("good-")
}

/// Nearest-rank percentile; NaN for no values.
pub(crate) fn percentile(values: &[f64], quantile: f64) -> f64 {
    let mut sorted: Vec<f64> = values.iter().copied().filter(|v| v.is_finite()).collect();
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted.sort_by(f64::total_cmp);
    let rank = (quantile * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

struct Report {
    options: Options,
    /// Which router was measured.
    build: String,
    a: FleetResult,
    b: FleetResult,
}

fn ms(seconds: f64) -> String {
    if seconds.is_finite() {
        format!("{:.0}", seconds * 1000.0)
    } else {
        "–".to_owned()
    }
}

fn percent(fraction: f64) -> String {
    if fraction.is_finite() {
        format!("{:.2} %", fraction * 100.0)
    } else {
        "–".to_owned()
    }
}

fn seconds_or_never(value: Option<f64>) -> String {
    value.map_or_else(|| "never".to_owned(), |s| format!("{s:.1} s"))
}

fn met(ok: bool) -> &'static str {
    if ok { "met" } else { "MISSED" }
}

impl Report {
    fn ratios(&self, a: &Summary, b: &Summary) -> (f64, f64) {
        (b.success_rate / a.success_rate, b.p99_ttft_s / a.p99_ttft_s)
    }

    fn markdown(&self) -> String {
        let (a, b) = (self.a.summary(), self.b.summary());
        let (success_ratio, p99_ratio) = self.ratios(&a, &b);
        let options = &self.options;
        let mut out = String::new();
        let mut line = |text: String| {
            out.push_str(&text);
            out.push('\n');
        };
        line("# Chaos: one engine per fault mode vs good engines only".into());
        line(String::new());
        line(format!(
            "Load: Poisson arrivals, {} req/s for {} s (seed {}), the same for both fleets; \
             {:.0} % streaming; prompts {:.0} % {SHORT_PROMPT_TOKENS} and {:.0} % \
             {LONG_PROMPT_TOKENS} tokens; {OUTPUT_TOKENS} output tokens; a unique \
             `x-request-id` each; client timeout {} s.",
            options.rate,
            options.duration_s,
            options.seed,
            STREAM_FRACTION * 100.0,
            (1.0 - LONG_FRACTION) * 100.0,
            LONG_FRACTION * 100.0,
            (REQUEST_DEADLINE_MS + CLIENT_MARGIN_MS) / 1000,
        ));
        line(String::new());
        line(format!(
            "Router: `least_load`; first_byte_timeout_ms {FIRST_BYTE_TIMEOUT_MS}, \
             stream_idle_timeout_ms {STREAM_IDLE_TIMEOUT_MS}, request_deadline_ms \
             {REQUEST_DEADLINE_MS}, max_retries default; outlier ejection after \
             {CONSECUTIVE_FAILURES} consecutive failures, base_ejection_ms {BASE_EJECTION_MS}, \
             max_ejected_percent {MAX_EJECTED_PERCENT}, silent_stream_ms {SILENT_STREAM_MS}, \
             hedging after_ms {HEDGE_AFTER_MS}, probe GET /health_generate \
             ({PROBE_TIMEOUT_MS} ms); health every {HEALTH_INTERVAL_MS} ms. Engines: engine-sim \
             SGLang, model mode, time scale {TIME_SCALE}, max-running {MAX_RUNNING}; \
             slow-first-byte waits {SLOW_FIRST_BYTE_MS} ms. Built from {}.",
            self.build
        ));
        line(String::new());
        line(format!(
            "| | A: {GOOD_ENGINES} good | B: {GOOD_ENGINES} good + {} faulty |",
            BAD_MODES.len()
        ));
        line("|---|---:|---:|".into());
        line(format!("| requests sent | {} | {} |", a.sent, b.sent));
        line(format!("| succeeded | {} | {} |", a.succeeded, b.succeeded));
        line(format!(
            "| success rate | {} | {} |",
            percent(a.success_rate),
            percent(b.success_rate)
        ));
        let mut kinds: Vec<&String> = a.failures.keys().chain(b.failures.keys()).collect();
        kinds.sort();
        kinds.dedup();
        for kind in kinds {
            line(format!(
                "| failed: {kind} | {} | {} |",
                a.failures.get(kind).copied().unwrap_or(0),
                b.failures.get(kind).copied().unwrap_or(0)
            ));
        }
        line(format!(
            "| p50 TTFT, ms (succeeded) | {} | {} |",
            ms(a.p50_ttft_s),
            ms(b.p50_ttft_s)
        ));
        line(format!(
            "| p99 TTFT, ms (succeeded) | {} | {} |",
            ms(a.p99_ttft_s),
            ms(b.p99_ttft_s)
        ));
        match self.b.all_faulty_out_s() {
            Some(out_s) => line(format!(
                "| p99 TTFT, ms, requests due after every faulty engine left rotation in B \
                 ({out_s:.1} s) | {} | {} |",
                ms(self.a.p99_ttft_from(out_s)),
                ms(self.b.p99_ttft_from(out_s))
            )),
            None => line("| p99 TTFT after every faulty engine left rotation | – | never |".into()),
        }
        line(format!(
            "| max request duration, s (deadline {} s) | {:.2} | {:.2} |",
            REQUEST_DEADLINE_MS / 1000,
            a.max_duration_s,
            b.max_duration_s
        ));
        line(format!(
            "| requests past the deadline | {} | {} |",
            a.over_deadline, b.over_deadline
        ));
        line(format!(
            "| requests a faulty engine broke, run again elsewhere | {} | {} |",
            a.rerun_after_fault, b.rerun_after_fault
        ));
        line(format!(
            "| requests generated on two good engines (a hedge's loser is closed at its first event) | {} | {} |",
            a.on_two_good_engines, b.on_two_good_engines
        ));
        let hedges = |result: &FleetResult| {
            let count = |outcome: &str| {
                result
                    .migrations
                    .hedges
                    .iter()
                    .filter(|(name, _)| name == outcome)
                    .fold(0.0, |sum, (_, count)| sum + count)
            };
            format!(
                "{} / {} / {} / {}",
                count("won"),
                count("lost"),
                count("failed"),
                count("skipped")
            )
        };
        line(format!(
            "| hedges: won / lost / failed / skipped | {} | {} |",
            hedges(&self.a),
            hedges(&self.b)
        ));
        line(format!(
            "| succeeded but admitted nowhere | {} | {} |",
            self.a.succeeded_not_admitted, self.b.succeeded_not_admitted
        ));
        line(format!(
            "| load wall time, s | {:.1} | {:.1} |",
            self.a.load_wall_s, self.b.load_wall_s
        ));
        line(String::new());
        line(format!(
            "B vs A: success rate {:.4}× ({} served in B; goal ≥ {:.1} %: {}), \
             p99 TTFT {:.2}× (goal ≤ {GOAL_P99_TTFT_RATIO:.1}×: {}).",
            success_ratio,
            percent(b.success_rate),
            GOAL_SUCCESS_RATE * 100.0,
            met(b.success_rate >= GOAL_SUCCESS_RATE),
            p99_ratio,
            met(p99_ratio <= GOAL_P99_TTFT_RATIO),
        ));
        line(String::new());
        line(
            "Fleet B per engine (times from the start of the load; `/admin/workers` polled \
             every 100 ms; received = generation requests that reached the engine, admitted = \
             those that got past its faults into the model, probes = `/health_generate` calls \
             it answered, back = times it was seen back in rotation after an ejection):"
                .into(),
        );
        line(String::new());
        line(
            "| engine | received | admitted | first `ejected: true` | first out of rotation | ejections | probes | back |"
                .into(),
        );
        line("|---|---:|---:|---:|---:|---:|---:|---:|".into());
        for engine in &self.b.engines {
            let trace = engine.trace.clone().unwrap_or_default();
            line(format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                engine.name,
                engine.received,
                engine.admitted,
                seconds_or_never(trace.first_ejected_s),
                seconds_or_never(trace.first_out_of_rotation_s),
                trace.ejections,
                engine.probes,
                trace.returns
            ));
        }
        for (fleet, result) in [("A", &self.a), ("B", &self.b)] {
            if !result.duplicate_ids.is_empty() {
                line(String::new());
                line(format!(
                    "Requests generated on more than one engine in fleet {fleet} (id: engines):"
                ));
                line(String::new());
                for (id, on) in result.duplicate_ids.iter().take(20) {
                    line(format!("- {id}: {}", on.join(", ")));
                }
            }
        }
        let migrations = &self.b.migrations;
        line(String::new());
        line(
            "Migrations in fleet B (`router_migrations_total`; resume = from a break to the \
             continuing worker's first event, `router_migration_resume_seconds`):"
                .into(),
        );
        line(String::new());
        line("| reason | outcome | count |".into());
        line("|---|---|---:|".into());
        for (reason, outcome, count) in &migrations.counts {
            line(format!("| {reason} | {outcome} | {count} |"));
        }
        if migrations.resume_count > 0.0 {
            line(String::new());
            line(format!(
                "Resume time over {} resumes: mean {:.0} ms; p50 ≤ {} ms, p90 ≤ {} ms, p99 ≤ {} ms \
                 (histogram bucket bounds).",
                migrations.resume_count,
                1000.0 * migrations.resume_sum_s / migrations.resume_count,
                1000.0 * migrations.quantile_bound_s(0.5),
                1000.0 * migrations.quantile_bound_s(0.9),
                1000.0 * migrations.quantile_bound_s(0.99),
            ));
        }
        out
    }

    fn fleet_json(result: &FleetResult, summary: &Summary) -> Value {
        let engines: Vec<Value> = result
            .engines
            .iter()
            .map(|engine| {
                let trace = engine.trace.clone().unwrap_or_default();
                json!({
                    "name": engine.name,
                    "fault": engine.fault,
                    "received": engine.received,
                    "admitted": engine.admitted,
                    "first_ejected_s": trace.first_ejected_s,
                    "first_out_of_rotation_s": trace.first_out_of_rotation_s,
                    "ejections": trace.ejections,
                    "probes": engine.probes,
                    "returns_to_rotation": trace.returns,
                })
            })
            .collect();
        let request = |record: &Record| {
            json!({
                "id": record.id,
                "at_s": record.at_s,
                "stream": record.stream,
                "long": record.long,
                "outcome": record.outcome.label(),
                "ttft_s": record.ttft_s,
                "duration_s": record.duration_s,
            })
        };
        let failed: Vec<Value> = result
            .records
            .iter()
            .filter(|record| record.outcome != Outcome::Ok)
            .map(request)
            .collect();
        let requests: Vec<Value> = result.records.iter().map(request).collect();
        let finite = |value: f64| value.is_finite().then_some(value);
        json!({
            "fleet": result.name,
            "sent": summary.sent,
            "succeeded": summary.succeeded,
            "success_rate": finite(summary.success_rate),
            "failures": summary.failures,
            "p50_ttft_s": finite(summary.p50_ttft_s),
            "p99_ttft_s": finite(summary.p99_ttft_s),
            "max_duration_s": summary.max_duration_s,
            "over_deadline": summary.over_deadline,
            "rerun_after_fault": summary.rerun_after_fault,
            "on_two_good_engines": summary.on_two_good_engines,
            "duplicate_ids": result.duplicate_ids,
            "hedges": result.migrations.hedges,
            "succeeded_not_admitted": result.succeeded_not_admitted,
            "load_wall_s": result.load_wall_s,
            "engines": engines,
            "failed_requests": failed,
            "requests": requests,
        })
    }

    fn json(&self) -> Value {
        let (a, b) = (self.a.summary(), self.b.summary());
        let (success_ratio, p99_ratio) = self.ratios(&a, &b);
        let finite = |value: f64| value.is_finite().then_some(value);
        json!({
            "build": self.build,
            "options": {
                "rate": self.options.rate,
                "duration_s": self.options.duration_s,
                "seed": self.options.seed,
            },
            "router": {
                "policy": "least_load",
                "first_byte_timeout_ms": FIRST_BYTE_TIMEOUT_MS,
                "stream_idle_timeout_ms": STREAM_IDLE_TIMEOUT_MS,
                "request_deadline_ms": REQUEST_DEADLINE_MS,
                "consecutive_failures": CONSECUTIVE_FAILURES,
                "base_ejection_ms": BASE_EJECTION_MS,
                "max_ejected_percent": MAX_EJECTED_PERCENT,
                "probe_timeout_ms": PROBE_TIMEOUT_MS,
                "silent_stream_ms": SILENT_STREAM_MS,
                "health_interval_ms": HEALTH_INTERVAL_MS,
            },
            "a": Self::fleet_json(&self.a, &a),
            "b": Self::fleet_json(&self.b, &b),
            "all_faulty_out_of_rotation_s": self.b.all_faulty_out_s(),
            "p99_ttft_s_after_all_faulty_out": self.b.all_faulty_out_s().map(|out_s| json!({
                "a": finite(self.a.p99_ttft_from(out_s)),
                "b": finite(self.b.p99_ttft_from(out_s)),
            })),
            "b_vs_a": {
                "success_rate_ratio": finite(success_ratio),
                "p99_ttft_ratio": finite(p99_ratio),
                "goal_success_rate": GOAL_SUCCESS_RATE,
                "goal_success_rate_met": b.success_rate >= GOAL_SUCCESS_RATE,
                "goal_p99_ttft_ratio": GOAL_P99_TTFT_RATIO,
                "goal_p99_ttft_ratio_met": p99_ratio <= GOAL_P99_TTFT_RATIO,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_parse() -> Result<(), String> {
        let args: Vec<String> = ["--rate", "10", "--duration-s", "5", "--seed", "3"]
            .map(String::from)
            .to_vec();
        let options = Options::parse(&args)?;
        assert_eq!(options.rate, 10.0);
        assert_eq!(options.duration_s, 5.0);
        assert_eq!(options.seed, 3);
        assert!(Options::parse(&["--rate".to_owned(), "0".to_owned()]).is_err());
        assert!(Options::parse(&["--bogus".to_owned()]).is_err());
        Ok(())
    }

    #[test]
    fn the_plan_is_the_same_for_both_fleets_and_poisson_like() {
        let options = Options {
            rate: 40.0,
            duration_s: 30.0,
            seed: 7,
        };
        let a = plan(&options, "a");
        let b = plan(&options, "b");
        assert_eq!(a.len(), b.len());
        assert!(a.iter().zip(&b).all(|(a, b)| a.at_s == b.at_s
            && a.stream == b.stream
            && a.long == b.long
            && a.id != b.id));
        // 1200 expected; a Poisson count's standard deviation is about 35.
        assert!((1_050..1_350).contains(&a.len()), "{}", a.len());
        let streams = a.iter().filter(|p| p.stream).count() as f64 / a.len() as f64;
        let longs = a.iter().filter(|p| p.long).count() as f64 / a.len() as f64;
        assert!((0.8..0.9).contains(&streams), "{streams}");
        assert!((0.07..0.13).contains(&longs), "{longs}");
    }

    #[test]
    fn prompts_are_about_four_characters_per_token() {
        let text = prompt("a-000001", 200);
        assert!(text.starts_with("request a-000001 "));
        assert!((790..=800).contains(&text.len()), "{}", text.len());
    }

    #[test]
    fn faulty_engines_are_all_out_when_the_last_one_leaves() {
        let engine = |fault: Option<&'static str>, out_s: Option<f64>| EngineResult {
            name: "e".into(),
            fault,
            received: 0,
            probes: 0,
            admitted: 0,
            trace: Some(WorkerTrace {
                first_out_of_rotation_s: out_s,
                ..WorkerTrace::default()
            }),
        };
        let mut fleet = FleetResult {
            name: "b",
            records: Vec::new(),
            engines: vec![
                engine(None, None),
                engine(Some("generation-500"), Some(0.3)),
                engine(Some("hang-generation"), Some(2.5)),
            ],
            duplicate_ids: Vec::new(),
            succeeded_not_admitted: 0,
            load_wall_s: 0.0,
            migrations: Migrations::default(),
        };
        assert_eq!(fleet.all_faulty_out_s(), Some(2.5));
        fleet.engines.push(engine(Some("slow-first-byte"), None));
        assert_eq!(fleet.all_faulty_out_s(), None);
    }

    #[test]
    fn migration_metrics_are_read_from_the_routers_text() {
        let text = "# HELP router_migrations Broken answers\n\
            router_migrations_total{reason=\"cut\",outcome=\"resumed\"} 3\n\
            router_migrations_total{reason=\"stalled\",outcome=\"failed\"} 1\n\
            router_migration_resume_seconds_sum 0.3\n\
            router_migration_resume_seconds_count 4\n\
            router_migration_resume_seconds_bucket{le=\"0.05\"} 1\n\
            router_migration_resume_seconds_bucket{le=\"0.1\"} 3\n\
            router_migration_resume_seconds_bucket{le=\"+Inf\"} 4\n";
        let migrations = Migrations::parse(text);
        assert_eq!(
            migrations.counts,
            vec![
                ("cut".to_owned(), "resumed".to_owned(), 3.0),
                ("stalled".to_owned(), "failed".to_owned(), 1.0)
            ]
        );
        assert_eq!(migrations.resume_count, 4.0);
        assert_eq!(migrations.quantile_bound_s(0.5), 0.1);
        assert_eq!(migrations.quantile_bound_s(0.25), 0.05);
        assert!(migrations.quantile_bound_s(0.99).is_infinite());
    }

    #[test]
    fn percentile_is_nearest_rank() {
        let values: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&values, 0.5), 50.0);
        assert_eq!(percentile(&values, 0.99), 99.0);
        assert_eq!(percentile(&[3.0], 0.99), 3.0);
        assert!(percentile(&[], 0.5).is_nan());
    }
}
