//! Router replicas: one router alone, three replicas without sync and three
//! with sync (sharing pending work through `nats-server`), in front of the
//! same engine-sim fleet under the same open-loop, size-skewed, streaming
//! load; p99 TTFT as the client sees it. Then the same three setups under
//! multi-turn chat sessions (`engine-sim drive --traffic multi-turn`), each
//! over a fleet of its own with cold prefix caches: the fleet's prefix-cache
//! hit rate, from the engines' `/metrics`, and p99 TTFT at the client. Then
//! what sync costs a replica in CPU when every replica has 1024 (canned)
//! workers.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::report::Row;
use super::{Options, median, proc_stat, spread};
use crate::chaos::{Outcome, Planned, percentile, send_all};
use crate::splitmix::SplitMix64;
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

/// The multi-turn fleet: `ENGINES` SGLang engines at half the default speed
/// (4000 prefill tok/s, 12 ms + 0.7 ms per decoding request a step), so the
/// load they need stays within what this 2-core machine can send.
const MULTI_TURN_ENGINE_ARGS: [&str; 6] = [
    "--prefill-tps",
    "4000",
    "--decode-base-ms",
    "12",
    "--decode-per-req-ms",
    "0.7",
];
const MULTI_TURN_PREFILL_TPS: f64 = 4000.0;
const MULTI_TURN_DECODE_PER_REQ_MS: f64 = 0.7;
/// Output tokens of every turn.
const MULTI_TURN_OUTPUT_TOKENS: u32 = 32;
/// New chat sessions per second (the drive's defaults otherwise: 8 apps,
/// 2000-token system prompts, 80-token user messages, 6 turns on average,
/// 1 s to think). A turn whose history is cached computes ≈ 130 new tokens
/// (the last answer, the new message, the previous prompt's partial block)
/// and decodes 32: 130 / 4000 + 32 × 0.7 / 1000 ≈ 0.055 s of an engine.
/// Sessions cut at the end of the window play 4 turns on average, so 13 new
/// sessions a second send ≈ 50 turns/s: one router kept the engines ≈ 0.66
/// busy at a 95% hit rate (`load` in the rows is this estimate from the
/// engines' own counters, over the run's wall time, its tail included).
const MULTI_TURN_SESSION_RATE: f64 = 13.0;
/// Seconds during which turns start, per setup and run.
const MULTI_TURN_LOAD_S: f64 = 30.0;
/// Seconds at the start of a run whose turns the steady-state TTFT leaves
/// out. Every engine's prefix cache starts cold: the first sessions of the 8
/// apps prefill 2000-token system prompts (≈ 1 s each at 4000 tok/s), about
/// 15 turns in the first 1.5 s, which is 1 % of a run. Whatever the router
/// does, they are the run's slowest, so a whole-run p99 reads whichever of
/// them ranks 15th. Both are reported; the target reads the steady state.
const MULTI_TURN_WARMUP_S: f64 = 5.0;
/// Most the hit rate of 3 synced replicas may fall below one router's, in
/// percentage points.
pub(super) const MULTI_TURN_HIT_RATE_POINTS: f64 = 2.0;
/// Most the p99 TTFT of 3 synced replicas may be over one router's.
pub(super) const MULTI_TURN_P99_RATIO: f64 = 1.2;

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

/// One engine-sim process serving `ENGINES` model-mode SGLang engines, with
/// `extra` engine-sim arguments.
fn start_fleet(extra: &[&str]) -> Result<(Process, Vec<String>), String> {
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
        .args(extra)
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
    let mut random = SplitMix64::new(seed);
    let mut planned = Vec::new();
    let mut at_s = 0.0;
    loop {
        at_s += -(1.0 - random.next_unit()).ln() / RATE_RPS;
        if at_s >= LOAD_S {
            break;
        }
        let long = random.next_unit() < LONG_FRACTION;
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
    let (fleet, engines) = start_fleet(&[])?;

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

    let (multi_turn_rows, multi_turn_note) = multi_turn(options, &nats_url)?;
    rows.extend(multi_turn_rows);
    rows.push(cpu_row(options, out_dir, &nats_url)?);
    let mut notes = vec![format!(
        "Replicas: one engine-sim with {ENGINES} model-mode SGLang engines (engine-model defaults); open-loop Poisson arrivals at {RATE_RPS} req/s for {LOAD_S} s, all streamed, {:.0}% 3000-token and the rest 200-token prompts, 32 output tokens, the same arrivals (seed per run) for every setup; requests take turns among the routers. Routers: least_load, defaults (polls every {POLL_INTERVAL_MS} ms), all on core 1; sync through one nats-server (publish every 25 ms, TTL 1 s). TTFT: request sent to first SSE `data:` event, at the client. Setups take turns within each run; medians over {} runs. `replicas/sync-cpu/{CPU_WORKERS}`: {REPLICAS} idle replicas each with all {CPU_WORKERS} canned engines as workers, CPU (utime+stime) per replica with sync minus without, over {} s windows; no traffic, so between full states (every 250 ms) nothing changes and nothing else is sent.",
        LONG_FRACTION * 100.0,
        options.runs,
        options.duration_s
    )];
    notes.push(multi_turn_note);
    Ok((rows, notes))
}

/// An engine's cumulative SGLang counters, from its `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
struct CacheCounters {
    /// Prompt tokens looked up in the prefix cache.
    prompt_tokens: f64,
    /// Of those, tokens the cache served.
    cached_tokens: f64,
    generated_tokens: f64,
}

impl CacheCounters {
    fn plus(self, other: CacheCounters) -> CacheCounters {
        CacheCounters {
            prompt_tokens: self.prompt_tokens + other.prompt_tokens,
            cached_tokens: self.cached_tokens + other.cached_tokens,
            generated_tokens: self.generated_tokens + other.generated_tokens,
        }
    }

    fn minus(self, earlier: CacheCounters) -> CacheCounters {
        CacheCounters {
            prompt_tokens: self.prompt_tokens - earlier.prompt_tokens,
            cached_tokens: self.cached_tokens - earlier.cached_tokens,
            generated_tokens: self.generated_tokens - earlier.generated_tokens,
        }
    }

    /// Cached tokens over prompt tokens, in percent; `None` without prompt
    /// tokens.
    fn hit_rate_pct(self) -> Option<f64> {
        (self.prompt_tokens > 0.0).then(|| 100.0 * self.cached_tokens / self.prompt_tokens)
    }

    /// The share of `engines` busy over `wall_s` under the same cost model as
    /// [`MULTI_TURN_SESSION_RATE`]'s estimate: every uncached prompt token at
    /// the prefill rate, every generated token at the per-request decode cost.
    fn load(self, engines: usize, wall_s: f64) -> f64 {
        let busy_s = (self.prompt_tokens - self.cached_tokens) / MULTI_TURN_PREFILL_TPS
            + self.generated_tokens * MULTI_TURN_DECODE_PER_REQ_MS / 1000.0;
        busy_s / (engines as f64 * wall_s)
    }
}

/// The SGLang prompt, cached and generated token counters of a `/metrics`
/// text, each summed over its series; `None` when one is missing.
fn parse_cache_counters(text: &str) -> Option<CacheCounters> {
    let sum = |name: &str| {
        let mut found = false;
        let mut total = 0.0;
        for line in text.lines().filter(|line| !line.starts_with('#')) {
            let Some(rest) = line.strip_prefix(name) else {
                continue;
            };
            // The name ends at its labels or at the value.
            if !(rest.starts_with('{') || rest.starts_with(' ')) {
                continue;
            }
            let value = rest.rsplit(' ').next()?.parse::<f64>().ok()?;
            found = true;
            total += value;
        }
        found.then_some(total)
    };
    Some(CacheCounters {
        prompt_tokens: sum("sglang:prompt_tokens_total")?,
        cached_tokens: sum("sglang:cached_tokens_total")?,
        generated_tokens: sum("sglang:generation_tokens_total")?,
    })
}

/// The counters of every engine, summed.
fn fleet_counters(engines: &[String]) -> Result<CacheCounters, String> {
    let mut total = CacheCounters::default();
    for url in engines {
        let text = super::http_get_body(port_of(url)?, "/metrics")
            .ok_or_else(|| format!("{url}/metrics did not answer 200"))?;
        let counters = parse_cache_counters(&text)
            .ok_or_else(|| format!("{url}/metrics has no SGLang token counters"))?;
        total = total.plus(counters);
    }
    Ok(total)
}

/// The client-side TTFT line `engine-sim drive` prints: (p50, p99) seconds
/// and the completed requests.
/// The drive's whole-run TTFT line starts so.
const WHOLE_RUN_TTFT: &str = "client TTFT (";
/// Its line for the turns after `--warmup-s` starts so.
const STEADY_TTFT: &str = "client TTFT after ";

fn parse_client_ttft(stdout: &str, prefix: &str) -> Option<(f64, f64, u64)> {
    let line = stdout.lines().find(|line| line.starts_with(prefix))?;
    let after = |word: &str| {
        let mut words = line.split_whitespace();
        words.find(|candidate| *candidate == word)?;
        words.next()
    };
    let p50 = after("p50")?.parse().ok()?;
    let p99 = after("p99")?.parse().ok()?;
    let completed = after("over")?.parse().ok()?;
    Some((p50, p99, completed))
}

/// Whether 3 synced replicas kept the fleet's hit rate, `points_vs_one`
/// (theirs minus one router's, percentage points), close enough to one
/// router's: a higher one always is.
pub(super) fn hit_rate_kept(points_vs_one: f64) -> bool {
    points_vs_one >= -MULTI_TURN_HIT_RATE_POINTS
}

/// Whether 3 synced replicas' p99 TTFT, `vs_one` times one router's, is
/// close enough to it.
pub(super) fn multi_turn_p99_kept(vs_one: f64) -> bool {
    vs_one <= MULTI_TURN_P99_RATIO
}

/// One multi-turn run of a setup: what the client and the engines saw.
#[derive(Debug, Clone, Copy)]
struct MultiTurnRun {
    hit_rate_pct: f64,
    /// After the warm-up.
    p50_ttft_s: f64,
    p99_ttft_s: f64,
    /// Over the whole run.
    p99_whole_run_s: f64,
    completed: u64,
    load: f64,
}

/// One setup's multi-turn run over a fresh fleet (cold prefix caches, so
/// every setup starts alike): `engine-sim drive` sends the sessions and
/// prints the client's TTFT; the engines' counters give the hit rate.
fn multi_turn_run(setup: &Setup, nats: &str, seed: u64) -> Result<MultiTurnRun, String> {
    let (fleet, engines) = start_fleet(&MULTI_TURN_ENGINE_ARGS)?;
    let nats = setup.sync.then_some(nats);
    let (routers, urls) = start_routers(setup.routers, &engines, nats, None, 4096)?;
    wait_for_fresh_loads(&urls, engines.len())?;
    let before = fleet_counters(&engines)?;
    let mut drive = Command::new(release_binary("engine-sim"));
    drive.args(["drive", "--traffic", "multi-turn"]);
    for url in &urls {
        drive.args(["--router", url]);
    }
    drive
        .args(["--duration-s", &MULTI_TURN_LOAD_S.to_string()])
        .args(["--session-rate", &MULTI_TURN_SESSION_RATE.to_string()])
        .args(["--output-tokens", &MULTI_TURN_OUTPUT_TOKENS.to_string()])
        .args(["--think-time-s", "1", "--seed", &seed.to_string()])
        .args(["--warmup-s", &MULTI_TURN_WARMUP_S.to_string()])
        .env("RUST_LOG", "warn")
        .stderr(Stdio::inherit());
    let started = Instant::now();
    let output = drive
        .output()
        .map_err(|error| format!("could not run engine-sim drive: {error}"))?;
    let wall_s = started.elapsed().as_secs_f64();
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        return Err(format!(
            "engine-sim drive ({}) failed with {}:\n{stdout}",
            setup.name, output.status
        ));
    }
    let ttft_line = |prefix: &str| {
        parse_client_ttft(&stdout, prefix).ok_or_else(|| {
            format!(
                "engine-sim drive ({}) printed no {prefix:?} line:\n{stdout}",
                setup.name
            )
        })
    };
    let (_, p99_whole_run_s, completed) = ttft_line(WHOLE_RUN_TTFT)?;
    let (p50_ttft_s, p99_ttft_s, _) = ttft_line(STEADY_TTFT)?;
    // The drive waited for every answer; the engines have finished them.
    wait_for_idle_engines(&engines)?;
    let used = fleet_counters(&engines)?.minus(before);
    drop(routers);
    drop(fleet);
    Ok(MultiTurnRun {
        hit_rate_pct: used.hit_rate_pct().unwrap_or(f64::NAN),
        p50_ttft_s,
        p99_ttft_s,
        p99_whole_run_s,
        completed,
        load: used.load(engines.len(), wall_s),
    })
}

/// The median, lowest and highest of `setup`'s p99 over `reference`'s, run
/// by run (each pair served the same sessions).
fn paired_p99_ratios(setup: &[MultiTurnRun], reference: &[MultiTurnRun]) -> (f64, f64, f64) {
    let ratios: Vec<f64> = setup
        .iter()
        .zip(reference)
        .map(|(run, reference)| run.p99_ttft_s / reference.p99_ttft_s)
        .collect();
    (
        median(&ratios),
        ratios.iter().copied().fold(f64::INFINITY, f64::min),
        ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max),
    )
}

/// The multi-turn rows: per setup, the fleet's prefix-cache hit rate and the
/// client's TTFT over `options.runs` runs, then sync against one router.
fn multi_turn(options: &Options, nats_url: &str) -> Result<(Vec<Row>, String), String> {
    eprintln!(
        "xtask: == multi-turn: {MULTI_TURN_SESSION_RATE} sessions/s for {MULTI_TURN_LOAD_S} s over {ENGINES} engines, per setup"
    );
    let mut results: Vec<Vec<MultiTurnRun>> = vec![Vec::new(); SETUPS.len()];
    for run in 0..options.runs {
        let seed = 0x6d75_0000 + run as u64;
        for (index, setup) in SETUPS.iter().enumerate() {
            let result = multi_turn_run(setup, nats_url, seed)?;
            eprintln!(
                "xtask:    run {}/{} multi-turn {:<20} hit rate {:.1}%  p50 {:.3} s  p99 {:.3} s (whole run {:.3} s)  load {:.2}  ({} completed)",
                run + 1,
                options.runs,
                setup.name,
                result.hit_rate_pct,
                result.p50_ttft_s,
                result.p99_ttft_s,
                result.p99_whole_run_s,
                result.load,
                result.completed
            );
            results[index].push(result);
        }
    }
    let mut rows = Vec::new();
    let mut summary = Vec::new();
    for (setup, runs) in SETUPS.iter().zip(&results) {
        let field = |pick: fn(&MultiTurnRun) -> f64| runs.iter().map(pick).collect::<Vec<f64>>();
        let hit_rates = field(|run| run.hit_rate_pct);
        let p99 = field(|run| run.p99_ttft_s);
        let row = Row::new(format!("replicas-multi-turn/{}", setup.name))
            .int("routers", setup.routers as u64)
            .num("hit_rate_pct", median(&hit_rates))
            .num(
                "hit_rate_min_pct",
                hit_rates.iter().copied().fold(f64::INFINITY, f64::min),
            )
            .num(
                "hit_rate_max_pct",
                hit_rates.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            )
            .num("p50_ttft_s", median(&field(|run| run.p50_ttft_s)))
            // Each run is other sessions (its own seed), so the runs' p99s
            // differ by the traffic, not only by noise: the target reads
            // them run by run against one router on the same sessions.
            .num("p99_ttft_s", median(&p99))
            .num(
                "p99_min_s",
                p99.iter().copied().fold(f64::INFINITY, f64::min),
            )
            .num("p99_max_s", p99.iter().copied().fold(0.0, f64::max))
            .num("p99_whole_run_s", median(&field(|run| run.p99_whole_run_s)))
            .num("load", median(&field(|run| run.load)))
            .int("completed", runs.iter().map(|run| run.completed).sum())
            .int("runs", runs.len() as u64)
            .num("spread", spread(&p99));
        summary.push((
            row.get("hit_rate_pct").unwrap_or(f64::NAN),
            row.get("p99_ttft_s").unwrap_or(f64::NAN),
        ));
        rows.push(row);
    }
    if let ([one, no_sync, sync], [one_runs, no_sync_runs, sync_runs]) =
        (&summary[..], &results[..])
    {
        let (vs_one, vs_one_low, vs_one_high) = paired_p99_ratios(sync_runs, one_runs);
        let (vs_no_sync, _, _) = paired_p99_ratios(sync_runs, no_sync_runs);
        rows.push(
            Row::new("replicas-multi-turn/sync-vs")
                .num("hit_rate_points_vs_one", sync.0 - one.0)
                .num("hit_rate_points_vs_no_sync", sync.0 - no_sync.0)
                .num("vs_one_router", vs_one)
                .num("vs_one_router_min", vs_one_low)
                .num("vs_one_router_max", vs_one_high)
                .num("vs_no_sync", vs_no_sync),
        );
    }
    let note = format!(
        "Replicas, multi-turn: per setup and run a fresh engine-sim with {ENGINES} model-mode SGLang engines at half the default speed (cold prefix caches), and `engine-sim drive --traffic multi-turn`: Poisson arrivals of {MULTI_TURN_SESSION_RATE} chat sessions/s for {MULTI_TURN_LOAD_S} s (8 apps with 2000-token system prompts, 80-token user messages, 6 turns on average, 1 s to think, {MULTI_TURN_OUTPUT_TOKENS} output tokens; every turn resends the history), the same sessions (seed per run) for every setup; turn i goes to router i mod n, so a session's turns cross the replicas. Hit rate: the fleet's cached prompt tokens over its prompt tokens across the run, from the engines' `sglang:cached_tokens_total` and `sglang:prompt_tokens_total`. TTFT: request sent to first SSE event, at the drive, of the turns sent after the first {MULTI_TURN_WARMUP_S} s (cold caches: the apps' first sessions prefill their whole system prompt under any router); `p99 whole run` includes them. `load`: the engines' busy share estimated from their counters (uncached prompt tokens at 4000 tok/s, generated tokens at 0.7 ms each) over the run's wall time. Medians over {} runs; each run is other sessions, so p99 against one router is judged run by run (the median of the runs' ratios).",
        options.runs
    );
    Ok((rows, note))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sglang_token_counters_are_summed_over_their_series() {
        let text = "\
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens counter
sglang:prompt_tokens_total{model_name=\"sim-model\"} 1000.0
sglang:prompt_tokens_total{model_name=\"other\"} 500.0
sglang:generation_tokens_total{model_name=\"sim-model\"} 64.0
sglang:cached_tokens_total{model_name=\"sim-model\"} 992.0
sglang:cached_tokens_total_extra{model_name=\"sim-model\"} 7.0
sglang:num_running_reqs{model_name=\"sim-model\"} 3.0
";
        assert_eq!(
            parse_cache_counters(text),
            Some(CacheCounters {
                prompt_tokens: 1500.0,
                cached_tokens: 992.0,
                generated_tokens: 64.0,
            })
        );
        // Without labels too.
        let bare = "sglang:prompt_tokens_total 10\nsglang:cached_tokens_total 4\nsglang:generation_tokens_total 1\n";
        assert_eq!(
            parse_cache_counters(bare).map(|counters| counters.cached_tokens),
            Some(4.0)
        );
        // A missing counter, or a value that is no number: nothing.
        assert_eq!(
            parse_cache_counters("sglang:prompt_tokens_total 10\n"),
            None
        );
        let broken = bare.replace(" 4", " four");
        assert_eq!(parse_cache_counters(&broken), None);
    }

    #[test]
    fn the_hit_rate_and_load_come_from_the_counters_moves() {
        let before = CacheCounters {
            prompt_tokens: 1000.0,
            cached_tokens: 500.0,
            generated_tokens: 10.0,
        };
        let after = CacheCounters {
            prompt_tokens: 11_000.0,
            cached_tokens: 9_500.0,
            generated_tokens: 1_010.0,
        };
        let used = after.minus(before);
        assert_eq!(used.hit_rate_pct(), Some(90.0));
        // 1000 uncached tokens at 4000 tok/s and 1000 generated at 0.7 ms:
        // 0.95 s of 2 engines over 1 s.
        assert!((used.load(2, 1.0) - 0.475).abs() < 1e-12);
        assert_eq!(CacheCounters::default().hit_rate_pct(), None);
    }

    #[test]
    fn the_drives_client_ttft_line_is_read() {
        let stdout = "\
sent 812 streaming requests in 212 chat sessions in 31.2 s through 3 router(s): 812 completed, 0 failed
client TTFT (request sent to first SSE event): p50 0.0834 s, p99 0.4123 s over 812 completed requests

worker                        requests   token-work   TTFT p50   TTFT p99
";
        assert_eq!(
            parse_client_ttft(stdout, WHOLE_RUN_TTFT),
            Some((0.0834, 0.4123, 812))
        );
        assert_eq!(parse_client_ttft(stdout, STEADY_TTFT), None);
        let steady = format!(
            "{stdout}client TTFT after 5 s of warm-up: p50 0.0512 s, p99 0.1301 s over 700 completed requests\n"
        );
        assert_eq!(
            parse_client_ttft(&steady, STEADY_TTFT),
            Some((0.0512, 0.1301, 700))
        );
        assert_eq!(
            parse_client_ttft(&steady, WHOLE_RUN_TTFT),
            Some((0.0834, 0.4123, 812))
        );
        assert_eq!(
            parse_client_ttft("sent 0 streaming requests\n", WHOLE_RUN_TTFT),
            None
        );
        assert_eq!(
            parse_client_ttft(
                "client TTFT (…): p50 x s, p99 0.4 s over 1 completed requests",
                WHOLE_RUN_TTFT
            ),
            None
        );
    }

    #[test]
    fn multi_turn_p99_is_compared_run_by_run() {
        let run = |p99_ttft_s: f64| MultiTurnRun {
            hit_rate_pct: 94.0,
            p50_ttft_s: 0.05,
            p99_ttft_s,
            p99_whole_run_s: 1.0,
            completed: 1500,
            load: 0.6,
        };
        // The runs' own p99s differ by 2× (other sessions); the pairs agree.
        let one = [run(0.10), run(0.20), run(0.15)];
        let sync = [run(0.11), run(0.19), run(0.15)];
        let (median, low, high) = paired_p99_ratios(&sync, &one);
        assert!((median - 1.0).abs() < 1e-9, "{median}");
        assert!(
            (low - 0.95).abs() < 1e-9 && (high - 1.1).abs() < 1e-9,
            "{low} {high}"
        );
    }

    #[test]
    fn multi_turn_targets_are_judged_against_one_router() {
        assert!(hit_rate_kept(-1.9));
        assert!(hit_rate_kept(-2.0));
        assert!(!hit_rate_kept(-2.1));
        // Above one router's is kept however far.
        assert!(hit_rate_kept(5.0));
        assert!(multi_turn_p99_kept(1.2));
        assert!(multi_turn_p99_kept(0.8));
        assert!(!multi_turn_p99_kept(1.21));
    }
}
