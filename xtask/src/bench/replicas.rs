//! Router replicas: one router alone, three replicas without sync and three
//! with sync (sharing pending work through `nats-server`), in front of the
//! same engine-sim fleet under the same open-loop, size-skewed, streaming
//! load; p99 TTFT as the client sees it. Then what sync costs a replica in
//! CPU when every replica has 1024 (canned) workers.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::report::Row;
use super::{Options, median, proc_stat, spread};
use crate::chaos::{Outcome, Planned, SplitMix, percentile, send_all};
use crate::{Process, free_ports, release_binary};

/// Model-mode SGLang engines in the fleet (engine-model defaults: 8000
/// prefill tok/s, 0.35 ms per decoding request per step).
const ENGINES: u16 = 4;
/// One request in ten is long (3000 tokens), the rest 200; 32 output
/// tokens. Capacity per engine ≈ 1 / (480 / 8000 + 32 × 0.35 / 1000) ≈ 14
/// req/s, so 4 engines take ≈ 56 req/s; this is about 0.8 of it.
const RATE_RPS: f64 = 45.0;
const LONG_FRACTION: f64 = 0.1;
/// Seconds of load per configuration and run.
const LOAD_S: f64 = 30.0;
/// The routers' poll interval: the default.
const POLL_INTERVAL_MS: u64 = 1000;
const REPLICAS: usize = 3;
/// The workers each replica has in the CPU measurement.
const CPU_WORKERS: u16 = 1024;

/// One router configuration of the TTFT comparison.
#[derive(Debug, Clone, Copy)]
struct Setup {
    name: &'static str,
    routers: usize,
    sync: bool,
}

const SETUPS: [Setup; 3] = [
    Setup {
        name: "one-router",
        routers: 1,
        sync: false,
    },
    Setup {
        name: "3-replicas-no-sync",
        routers: REPLICAS,
        sync: false,
    },
    Setup {
        name: "3-replicas-sync",
        routers: REPLICAS,
        sync: true,
    },
];

fn cpu_s(pid: u32) -> Result<f64, String> {
    proc_stat::cpu_times(pid)
        .map(proc_stat::CpuTimes::total_s)
        .ok_or_else(|| format!("cannot read /proc/{pid}/stat"))
}

/// One engine-sim process serving `ENGINES` model-mode SGLang engines.
fn start_fleet() -> Result<(Process, Vec<String>), String> {
    let mut command = Command::new(release_binary("engine-sim"));
    command
        .args([
            "serve",
            "--flavour",
            "sglang",
            "--count",
            &ENGINES.to_string(),
        ])
        .args(["--base-port", "0", "--seed", "11"])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut process = Process::spawn("engine-sim (model)", &mut command)?;
    let lines = process.read_lines(usize::from(ENGINES))?;
    let mut urls = Vec::new();
    for line in &lines {
        let value: serde_json::Value = serde_json::from_str(line)
            .map_err(|error| format!("engine-sim printed {line:?}: {error}"))?;
        let url = value
            .get("http")
            .and_then(serde_json::Value::as_str)
            .ok_or_else(|| format!("engine-sim printed no HTTP address: {line}"))?;
        urls.push(url.trim_end_matches('/').to_owned());
    }
    Ok((process, urls))
}

/// `count` routers over `workers`, sharing through `nats` when given; ready.
fn start_routers(
    count: usize,
    workers: &[String],
    nats: Option<&str>,
    extra_config: Option<&Path>,
    open_files: u64,
) -> Result<(Vec<Process>, Vec<String>), String> {
    let base = free_ports(u16::try_from(count).unwrap_or(1))?;
    let mut processes = Vec::new();
    let mut urls = Vec::new();
    for index in 0..count {
        let port = base + u16::try_from(index).unwrap_or(0);
        let mut command =
            super::pinned_many_files(super::PROXY_CORE, &release_binary("router"), open_files);
        command
            .args(["--port", &port.to_string(), "--policy", "least_load"])
            .args([
                "--load-interval-ms",
                &POLL_INTERVAL_MS.to_string(),
                "--stale-after-ms",
                "3000",
            ])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        if let Some(config) = extra_config {
            command.arg("--config").arg(config);
        }
        if let Some(url) = nats {
            command
                .args(["--sync", "--sync-nats-url", url])
                .args(["--sync-replica-id", &format!("bench-{}", index + 1)]);
        }
        for worker in workers {
            command.args(["--worker", &format!("sglang={worker}")]);
        }
        processes.push(Process::spawn(
            &format!("router {}", index + 1),
            &mut command,
        )?);
        urls.push(format!("http://127.0.0.1:{port}"));
    }
    for (index, _) in urls.iter().enumerate() {
        let port = base + u16::try_from(index).unwrap_or(0);
        super::wait_until_ok(port, "/readiness", "a router", Duration::from_secs(60))?;
    }
    Ok((processes, urls))
}

/// The port of a `http://127.0.0.1:<port>` URL.
fn port_of(url: &str) -> Result<u16, String> {
    url.rsplit(':')
        .next()
        .and_then(|port| port.trim_end_matches('/').parse().ok())
        .ok_or_else(|| format!("no port in {url}"))
}

/// Waits until every router sees all `workers` healthy with a load report
/// from its latest poll round.
fn wait_for_fresh_loads(routers: &[String], workers: usize) -> Result<(), String> {
    let max_age_s = 2.0 * POLL_INTERVAL_MS as f64 / 1000.0;
    for url in routers {
        let port = port_of(url)?;
        super::wait_for(
            &format!("router {url} to see all {workers} workers healthy with fresh loads"),
            Duration::from_secs(120),
            || super::router_has_fresh_loads(port, workers, max_age_s),
        )?;
    }
    Ok(())
}

/// Waits until no engine has a request running or waiting.
fn wait_for_idle_engines(engines: &[String]) -> Result<(), String> {
    for url in engines {
        let port = port_of(url)?;
        super::wait_for(
            &format!("engine {url} to finish its requests"),
            Duration::from_secs(120),
            || {
                let Some(body) = super::http_get_body(port, "/v1/loads") else {
                    return Ok(false);
                };
                let loads: serde_json::Value = serde_json::from_str(&body)
                    .map_err(|error| format!("{url}/v1/loads: {error}"))?;
                let busy: u64 = loads
                    .get("loads")
                    .and_then(serde_json::Value::as_array)
                    .into_iter()
                    .flatten()
                    .map(|rank| {
                        ["num_running_reqs", "num_waiting_reqs"]
                            .iter()
                            .filter_map(|key| rank.get(*key).and_then(serde_json::Value::as_u64))
                            .sum::<u64>()
                    })
                    .sum();
                Ok(busy == 0)
            },
        )?;
    }
    Ok(())
}

/// The same Poisson arrivals and mix for every setup: all streamed.
fn plan(seed: u64, tag: &str) -> Vec<Planned> {
    let mut random = SplitMix(seed);
    let mut planned = Vec::new();
    let mut at_s = 0.0;
    loop {
        at_s += -(1.0 - random.unit()).ln() / RATE_RPS;
        if at_s >= LOAD_S {
            break;
        }
        let long = random.unit() < LONG_FRACTION;
        planned.push(Planned {
            id: format!("{tag}-{:06}", planned.len()),
            at_s,
            stream: true,
            long,
        });
    }
    planned
}

/// p50 and p99 TTFT (s) of the completed requests, and how many completed of
/// how many sent.
fn measure(
    runtime: &tokio::runtime::Runtime,
    client: &reqwest::Client,
    routers: &[String],
    seed: u64,
    tag: &str,
) -> (f64, f64, usize, usize) {
    let plan = plan(seed, tag);
    let records = runtime.block_on(async {
        let started = tokio::time::Instant::now();
        send_all(client, routers, plan, started).await
    });
    let ttfts: Vec<f64> = records
        .iter()
        .filter(|record| record.outcome == Outcome::Ok)
        .filter_map(|record| record.ttft_s)
        .collect();
    (
        percentile(&ttfts, 0.5),
        percentile(&ttfts, 0.99),
        ttfts.len(),
        records.len(),
    )
}

pub(crate) fn run(options: &Options, out_dir: &Path) -> Result<(Vec<Row>, Vec<String>), String> {
    let (_nats, nats_url) = crate::demo::start_nats_server()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|error| format!("cannot start the runtime: {error}"))?;
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(120))
        .build()
        .map_err(|error| format!("cannot build the HTTP client: {error}"))?;
    let (fleet, engines) = start_fleet()?;

    // Per setup, every run's (p50, p99, completed, sent); the setups take
    // turns within a run, so a noisy minute hurts all of them alike.
    let mut results: Vec<Vec<(f64, f64, usize, usize)>> = vec![Vec::new(); SETUPS.len()];
    for run in 0..options.runs {
        let seed = 0x5eed_0000 + run as u64;
        for (index, setup) in SETUPS.iter().enumerate() {
            let nats = setup.sync.then_some(nats_url.as_str());
            let (routers, urls) = start_routers(setup.routers, &engines, nats, None, 4096)?;
            // Every router starts with a fresh report of every engine.
            wait_for_fresh_loads(&urls, engines.len())?;
            let result = measure(&runtime, &client, &urls, seed, setup.name);
            eprintln!(
                "xtask:    run {}/{} {:<20} p50 {:.3} s  p99 {:.3} s  ({}/{} completed)",
                run + 1,
                options.runs,
                setup.name,
                result.0,
                result.1,
                result.2,
                result.3
            );
            results[index].push(result);
            drop(routers);
            // The next setup starts on idle engines.
            wait_for_idle_engines(&engines)?;
        }
    }
    drop(fleet);

    let mut rows = Vec::new();
    let mut p99_of = Vec::new();
    for (setup, runs) in SETUPS.iter().zip(&results) {
        let p50: Vec<f64> = runs.iter().map(|run| run.0).collect();
        let p99: Vec<f64> = runs.iter().map(|run| run.1).collect();
        let completed: usize = runs.iter().map(|run| run.2).sum();
        let sent: usize = runs.iter().map(|run| run.3).sum();
        rows.push(
            Row::new(format!("replicas/{}", setup.name))
                .int("routers", setup.routers as u64)
                .num("p50_ttft_s", median(&p50))
                .settled("p99_ttft_s", &p99)
                .num(
                    "p99_min_s",
                    p99.iter().copied().fold(f64::INFINITY, f64::min),
                )
                .num("p99_max_s", p99.iter().copied().fold(0.0, f64::max))
                .int("completed", completed as u64)
                .int("sent", sent as u64)
                .int("runs", runs.len() as u64)
                .num("spread", spread(&p99)),
        );
        p99_of.push(
            rows.last()
                .and_then(|row| row.get("p99_ttft_s"))
                .unwrap_or(f64::NAN),
        );
    }
    if let [one, no_sync, sync] = p99_of[..] {
        rows.push(
            Row::new("replicas/sync-vs")
                .num("vs_one_router", sync / one)
                .num("vs_no_sync", sync / no_sync),
        );
    }

    rows.push(cpu_row(options, out_dir, &nats_url)?);
    let notes = vec![format!(
        "Replicas: one engine-sim with {ENGINES} model-mode SGLang engines (engine-model defaults); open-loop Poisson arrivals at {RATE_RPS} req/s for {LOAD_S} s, all streamed, {:.0}% 3000-token and the rest 200-token prompts, 32 output tokens, the same arrivals (seed per run) for every setup; requests take turns among the routers. Routers: least_load, defaults (polls every {POLL_INTERVAL_MS} ms), all on core 1; sync through one nats-server (publish every 25 ms, TTL 1 s). TTFT: request sent to first SSE `data:` event, at the client. Setups take turns within each run; medians over {} runs. `replicas/sync-cpu/{CPU_WORKERS}`: {REPLICAS} idle replicas each with all {CPU_WORKERS} canned engines as workers, CPU (utime+stime) per replica with sync minus without, over {} s windows; no traffic, so between full states (every 250 ms) nothing changes and nothing else is sent.",
        LONG_FRACTION * 100.0,
        options.runs,
        options.duration_s
    )];
    Ok((rows, notes))
}

/// What sync costs each of three idle replicas with 1024 workers.
fn cpu_row(options: &Options, out_dir: &Path, nats_url: &str) -> Result<Row, String> {
    eprintln!(
        "xtask: == sync CPU: {REPLICAS} replicas with {CPU_WORKERS} canned workers each, with and without sync"
    );
    let (_engines, ports) = super::proxy::start_engines(CPU_WORKERS, 8)?;
    let workers: Vec<String> = ports
        .iter()
        .map(|port| format!("http://127.0.0.1:{port}"))
        .collect();
    // Health checks once at the start only, as in the polling measurement.
    let config = out_dir.join("router-replicas-cpu.toml");
    std::fs::write(&config, "[health]\ninterval_ms = 3600000\n")
        .map_err(|error| format!("cannot write {}: {error}", config.display()))?;
    let open_files = u64::from(CPU_WORKERS) * 8 + 4096;
    let mut fractions = [Vec::new(), Vec::new()];
    for (slot, nats) in [None, Some(nats_url)].into_iter().enumerate() {
        let (routers, urls) = start_routers(REPLICAS, &workers, nats, Some(&config), open_files)?;
        wait_for_fresh_loads(&urls, workers.len())?;
        for _ in 0..options.runs {
            let pids: Vec<u32> = routers.iter().map(|router| router.child.id()).collect();
            let before: Vec<f64> = pids
                .iter()
                .map(|pid| cpu_s(*pid))
                .collect::<Result<_, _>>()?;
            let start = Instant::now();
            std::thread::sleep(Duration::from_secs(options.duration_s));
            let wall_s = start.elapsed().as_secs_f64();
            for (pid, before) in pids.iter().zip(before) {
                fractions[slot].push((cpu_s(*pid)? - before) / wall_s);
            }
        }
        eprintln!(
            "xtask:    {}: {:.2}% of a core per replica (median)",
            if nats.is_some() { "sync" } else { "no sync" },
            median(&fractions[slot]) * 100.0
        );
        drop(routers);
    }
    let without = median(&fractions[0]);
    let with = median(&fractions[1]);
    Ok(Row::new(format!("replicas/sync-cpu/{CPU_WORKERS}"))
        .num("cpu_fraction_no_sync", without)
        .num("cpu_fraction_sync", with)
        .num("sync_cpu_fraction", with - without)
        .int("replicas", REPLICAS as u64)
        .int("runs", options.runs as u64))
}
