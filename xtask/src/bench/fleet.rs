//! The router in front of many workers: 16, 256, 1024 and 4096 canned
//! engines served by one engine-sim process. For each fleet size, the load
//! monitor's CPU with the router idle, then the router's CPU per request
//! under wrk, then nginx's (`least_conn`) over the same workers: what any
//! proxy pays for a larger set of upstream connections, beside what the
//! router pays.
//!
//! The sizes take turns within every run (16, 256, 1024, 4096, then again),
//! each with a router of its own started for the turn and stopped after it,
//! so drift on the shared machine hits every size alike and no idle router
//! polls beside the one measured.

use std::path::Path;
use std::time::{Duration, Instant};

use super::proc_stat::{self, CpuTimes};
use super::proxy::{start_engines, start_nginx, start_router};
use super::report::Row;
use super::wrk::{self, Mode, Target, WrkRun};
use super::{Options, median, spread};
use crate::Process;

const FLEET_SIZES: [u16; 4] = [16, 256, 1024, 4096];
/// The fleet of the turn with one sick worker.
const SICK_FLEET_SIZE: u16 = 1024;
const POLL_INTERVAL_MS: u64 = 1000;
/// How long a router may take to see every worker healthy with a fresh
/// load report (4096 workers are added one health check at a time).
const READY_WITHIN: Duration = Duration::from_secs(180);

/// CPU time of a proxy process and its direct children (the router has
/// none; nginx's master has its worker).
fn cpu(pid: u32) -> Result<CpuTimes, String> {
    proc_stat::cpu_times_with_children(pid).ok_or_else(|| format!("cannot read /proc/{pid}/stat"))
}

/// One fleet size's measurements over the runs.
#[derive(Default)]
struct Size {
    /// Idle CPU, as a fraction of one core.
    idle_fractions: Vec<f64>,
    runs: Vec<WrkRun>,
    cpu_us_per_request: Vec<f64>,
    /// The user-space part of `cpu_us_per_request`.
    cpu_user_us_per_request: Vec<f64>,
    /// The same, less what the idle polling costs over the run.
    cpu_us_per_request_less_polling: Vec<f64>,
    nginx_runs: Vec<WrkRun>,
    nginx_cpu_us_per_request: Vec<f64>,
    nginx_cpu_user_us_per_request: Vec<f64>,
}

pub(crate) fn run(options: &Options, out_dir: &Path) -> Result<(Vec<Row>, Vec<String>), String> {
    let largest = FLEET_SIZES.iter().copied().max().unwrap_or(0);
    eprintln!("xtask: == router under many workers: one engine-sim with {largest} canned engines");
    let (_engines, ports) = start_engines(largest, 8)?;
    // Health checks once at the start only, so the idle CPU is the load monitor's.
    let config = out_dir.join("router-fleet.toml");
    std::fs::write(
        &config,
        "[health]\ninterval_ms = 3600000\n\n[load_monitor]\ninterval_ms = 1000\nstale_after_ms = 3000\n",
    )
    .map_err(|error| format!("cannot write {}: {error}", config.display()))?;
    let mut sizes: Vec<Size> = FLEET_SIZES.iter().map(|_| Size::default()).collect();
    let mut one_sick = Size::default();
    for run in 0..options.runs {
        for (size, into) in FLEET_SIZES.iter().zip(sizes.iter_mut()) {
            eprintln!("xtask:  run {}/{}: {size} workers", run + 1, options.runs);
            measure_size(options, out_dir, &ports, *size, &config, into)?;
        }
        eprintln!(
            "xtask:  run {}/{}: {SICK_FLEET_SIZE} workers, one without load reports",
            run + 1,
            options.runs
        );
        measure_one_sick(options, out_dir, &ports, &config, &mut one_sick)?;
    }

    let mut rows = Vec::new();
    for (size, measured) in FLEET_SIZES.iter().zip(&sizes) {
        let fraction = median(&measured.idle_fractions);
        rows.push(
            Row::new(format!("poll/{size}"))
                // Two clock ticks (10 ms each) over a window cannot be told apart.
                .settled_within(
                    "cpu_fraction",
                    &measured.idle_fractions,
                    0.02 / options.duration_s as f64,
                )
                .num("cpu_ms_per_round", fraction * POLL_INTERVAL_MS as f64)
                .int("interval_ms", POLL_INTERVAL_MS)
                .int("runs", measured.idle_fractions.len() as u64)
                .num("spread", spread(&measured.idle_fractions)),
        );
    }
    for (size, measured) in FLEET_SIZES.iter().zip(&sizes) {
        let cpu_vs_nginx =
            median(&measured.cpu_us_per_request) / median(&measured.nginx_cpu_us_per_request);
        rows.push(
            loaded_row(
                format!("router-cpu/least_load/{size}"),
                &measured.runs,
                &measured.cpu_us_per_request,
                &measured.cpu_user_us_per_request,
            )
            .settled(
                "cpu_us_per_request_less_polling",
                &measured.cpu_us_per_request_less_polling,
            )
            .num("cpu_vs_nginx", cpu_vs_nginx),
        );
    }
    let healthy_cpu = FLEET_SIZES
        .iter()
        .zip(&sizes)
        .find(|(size, _)| **size == SICK_FLEET_SIZE)
        .map_or(f64::NAN, |(_, measured)| {
            median(&measured.cpu_us_per_request)
        });
    rows.push(
        loaded_row(
            format!("router-cpu/least_load_one_sick/{SICK_FLEET_SIZE}"),
            &one_sick.runs,
            &one_sick.cpu_us_per_request,
            &one_sick.cpu_user_us_per_request,
        )
        .num(
            "cpu_vs_healthy",
            median(&one_sick.cpu_us_per_request) / healthy_cpu,
        ),
    );
    for (size, measured) in FLEET_SIZES.iter().zip(&sizes) {
        rows.push(loaded_row(
            format!("nginx-cpu/least_conn/{size}"),
            &measured.nginx_runs,
            &measured.nginx_cpu_us_per_request,
            &measured.nginx_cpu_user_us_per_request,
        ));
    }
    let notes = vec![format!(
        "Many workers: one engine-sim (`--count {largest} --mode canned`, open-file limit raised with `ulimit -n` in a bash wrapper) on core 0; the router (least_load, open-file limit raised the same way) on core 1 with the first 16, 256, 1024 or all {largest} engines as workers. The sizes take turns within each run, each turn with a router started for it and stopped after, so only the measured router runs. Each turn waits until the router sees every worker healthy with a load report under 2 s old, then: `poll/<workers>`: the idle router's CPU (utime+stime from /proc/<pid>/stat) over a {} s window with loads polled every {POLL_INTERVAL_MS} ms and health checks only at start (health.interval_ms = 1 h), so it is the load monitor's cost; `cpu_ms_per_round` = CPU per window / polling rounds in it. Then `router-cpu/least_load/<workers>`: wrk non-streaming at saturation for {} s after a 1 s warm-up, router CPU / requests, which includes the polling running beside it; `less idle polling` subtracts that turn's idle polling rate × the run's length first. Then `nginx-cpu/least_conn/<workers>`: nginx (one worker process on core 1, `least_conn`, an idle-connection cache of one connection per worker, at least 128) over the same workers, the same wrk run, nginx's CPU (master + worker) / requests; `cpu_vs_nginx` in the router's row is the ratio of the two medians. `of which user` (both proxies' rows): the user-space part (utime) of the CPU per request; the rest is the kernel's. `router-cpu/least_load_one_sick/{SICK_FLEET_SIZE}`: a turn of its own in every run, a router over the first {SICK_FLEET_SIZE} engines measured as above once the last one's load reports turn malformed (engine-sim's `malformed-loads` fault, set when every worker has a fresh load, lifted after the turn): it stays healthy and in rotation, scored without a load of its own, as a worker whose metrics endpoint broke would be; `vs healthy` is its median over the {SICK_FLEET_SIZE}-worker row's.",
        options.duration_s, options.duration_s
    )];
    Ok((rows, notes))
}

/// A proxy's row over its saturating `runs`: throughput and CPU per
/// request (`cpu_us`, its user-space part `cpu_user_us`, one per run),
/// whose runs must agree, and the median p99.
fn loaded_row(name: String, runs: &[WrkRun], cpu_us: &[f64], cpu_user_us: &[f64]) -> Row {
    let throughput: Vec<f64> = runs.iter().map(WrkRun::throughput_rps).collect();
    let p99: Vec<f64> = runs.iter().map(|run| run.p99_ms).collect();
    Row::new(name)
        .settled("throughput_rps", &throughput)
        .num("p99_ms", median(&p99))
        .settled("cpu_us_per_request", cpu_us)
        .num("cpu_user_us_per_request", median(cpu_user_us))
        .int("errors", runs.iter().map(|run| run.errors).sum())
        .int("runs", runs.len() as u64)
        .num("spread", spread(&throughput))
}

/// A least_load router over `workers`, once it sees every one healthy with
/// a load report under 2 s old: it routes on fresh loads from then on.
fn ready_router(workers: &[u16], config: &Path) -> Result<(Process, u16), String> {
    let (router, port) = start_router("least_load", workers, Some(config))?;
    super::wait_for(
        &format!(
            "the router to see all {} workers healthy with fresh loads",
            workers.len()
        ),
        READY_WITHIN,
        || super::router_has_fresh_loads(port, workers.len(), 2.0),
    )?;
    Ok((router, port))
}

/// One turn of one fleet size: a router over the first `size` engines, its
/// idle CPU, then one wrk run through it.
fn measure_size(
    options: &Options,
    out_dir: &Path,
    ports: &[u16],
    size: u16,
    config: &Path,
    into: &mut Size,
) -> Result<(), String> {
    let workers = ports.get(..usize::from(size)).ok_or("too few engines")?;
    let (router, port) = ready_router(workers, config)?;
    let pid = router.child.id();

    let before = cpu(pid)?;
    let start = Instant::now();
    std::thread::sleep(Duration::from_secs(options.duration_s));
    let fraction = cpu(pid)?.since(before).total_s() / start.elapsed().as_secs_f64();
    into.idle_fractions.push(fraction);

    let loaded = loaded_run(options, out_dir, port, pid)?;
    drop(router);
    if let Some((cpu_us, user_us)) = loaded.per_request_us() {
        into.cpu_us_per_request.push(cpu_us);
        into.cpu_user_us_per_request.push(user_us);
        let polling_s = fraction * loaded.wall_s;
        into.cpu_us_per_request_less_polling
            .push((loaded.cpu.total_s() - polling_s).max(0.0) * 1e6 / loaded.run.requests as f64);
    }

    let (nginx, nginx_port) = start_nginx(&out_dir.join("fleet"), workers)?;
    let nginx_loaded = loaded_run(options, out_dir, nginx_port, nginx.child.id())?;
    drop(nginx);
    if let Some((cpu_us, user_us)) = nginx_loaded.per_request_us() {
        into.nginx_cpu_us_per_request.push(cpu_us);
        into.nginx_cpu_user_us_per_request.push(user_us);
    }
    eprintln!(
        "xtask:    {size:>5} workers: idle {:.2}% of a core; {:>9.0} req/s  p99 {:>7.3} ms  router CPU {:.1} µs/req; nginx {:>9.0} req/s  CPU {:.1} µs/req",
        fraction * 100.0,
        loaded.run.throughput_rps(),
        loaded.run.p99_ms,
        into.cpu_us_per_request.last().copied().unwrap_or(f64::NAN),
        nginx_loaded.run.throughput_rps(),
        into.nginx_cpu_us_per_request
            .last()
            .copied()
            .unwrap_or(f64::NAN),
    );
    into.runs.push(loaded.run);
    into.nginx_runs.push(nginx_loaded.run);
    Ok(())
}

/// One turn of [`SICK_FLEET_SIZE`] workers, the last of which answers its
/// load polls with malformed reports from when the router has seen every
/// worker's load until the turn ends: the router's CPU per request under
/// wrk, with that worker in rotation.
fn measure_one_sick(
    options: &Options,
    out_dir: &Path,
    ports: &[u16],
    config: &Path,
    into: &mut Size,
) -> Result<(), String> {
    let size = usize::from(SICK_FLEET_SIZE);
    let workers = ports.get(..size).ok_or("too few engines")?;
    let sick_port = *workers.last().ok_or("no engines")?;
    let (router, port) = ready_router(workers, config)?;
    set_fault(sick_port, "malformed-loads")?;
    let loaded = super::wait_for(
        "the router to keep the worker with malformed load reports in rotation, its load no longer fresh",
        READY_WITHIN,
        || sick_in_rotation(port, sick_port),
    )
    .and_then(|()| loaded_run(options, out_dir, port, router.child.id()));
    // Lifted whatever happened: the engines serve every later turn.
    let lifted = set_fault(sick_port, "none");
    drop(router);
    let loaded = loaded?;
    lifted?;
    if let Some((cpu_us, user_us)) = loaded.per_request_us() {
        into.cpu_us_per_request.push(cpu_us);
        into.cpu_user_us_per_request.push(user_us);
    }
    eprintln!(
        "xtask:    {size:>5} workers, one sick: {:>9.0} req/s  p99 {:>7.3} ms  router CPU {:.1} µs/req",
        loaded.run.throughput_rps(),
        loaded.run.p99_ms,
        into.cpu_us_per_request.last().copied().unwrap_or(f64::NAN),
    );
    into.runs.push(loaded.run);
    Ok(())
}

/// engine-sim's fault `mode` on the engine at `engine_port`.
fn set_fault(engine_port: u16, mode: &str) -> Result<(), String> {
    match super::http_post_json(
        engine_port,
        "/control/fault",
        &serde_json::json!({ "mode": mode }),
    ) {
        Some(200..=299) => Ok(()),
        answer => Err(format!(
            "POST /control/fault {mode:?} on port {engine_port}: {}",
            answer.map_or("no answer".to_owned(), |status| status.to_string())
        )),
    }
}

/// Whether the router on `port` has the worker at `sick_port` in rotation
/// after at least three failed load polls (its last load older than the
/// fleet's 3 s staleness bound).
fn sick_in_rotation(port: u16, sick_port: u16) -> Result<bool, String> {
    let suffix = format!(":{sick_port}");
    let workers = super::router_workers(port)?.unwrap_or_default();
    let Some(sick) = workers.iter().find(|worker| {
        worker
            .get("url")
            .and_then(serde_json::Value::as_str)
            .is_some_and(|url| url.trim_end_matches('/').ends_with(&suffix))
    }) else {
        return Ok(false);
    };
    let field = |name: &str| sick.get(name).cloned().unwrap_or_default();
    Ok(field("in_rotation") == serde_json::Value::Bool(true)
        && field("poll_failures")
            .as_u64()
            .is_some_and(|failures| failures >= 3))
}

/// One saturating wrk run through a proxy, and the proxy's CPU over it.
struct LoadedRun {
    run: WrkRun,
    cpu: CpuTimes,
    wall_s: f64,
}

impl LoadedRun {
    /// The proxy's CPU per request and its user-space part, µs; `None`
    /// when no request completed.
    fn per_request_us(&self) -> Option<(f64, f64)> {
        let requests = self.run.requests as f64;
        (self.run.requests > 0).then(|| {
            (
                self.cpu.total_s() * 1e6 / requests,
                self.cpu.user_s * 1e6 / requests,
            )
        })
    }
}

/// A 1 s warm-up, then one non-streaming wrk run of the configured length
/// through the proxy on `port`, whose process is `pid`.
fn loaded_run(options: &Options, out_dir: &Path, port: u16, pid: u32) -> Result<LoadedRun, String> {
    let target = Target::Port(port);
    let script = wrk::script(out_dir, Mode::NonStream, &target, None)?;
    wrk::run(&script, &target, 1)?;
    let before = cpu(pid)?;
    let start = Instant::now();
    let run = wrk::run(&script, &target, options.duration_s)?;
    Ok(LoadedRun {
        wall_s: start.elapsed().as_secs_f64(),
        cpu: cpu(pid)?.since(before),
        run,
    })
}
