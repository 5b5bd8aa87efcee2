//! The router in front of many workers: 256 and 1024 canned engines served by
//! one engine-sim process. CPU per request under wrk, and the load monitor's
//! CPU per poll round with the router idle.

use std::path::Path;
use std::time::{Duration, Instant};

use super::proxy::{start_engines, start_router};
use super::report::Row;
use super::wrk::{self, Mode, Target, WrkRun};
use super::{Options, median, proc_stat, spread};

const FLEET_SIZES: [u16; 2] = [256, 1024];
const POLL_INTERVAL_MS: u64 = 1000;

fn cpu_s(pid: u32) -> Result<f64, String> {
    proc_stat::cpu_time(pid)
        .map(|time| time.as_secs_f64())
        .ok_or_else(|| format!("cannot read /proc/{pid}/stat"))
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
    let mut rows = Vec::new();
    for size in FLEET_SIZES {
        let workers = ports.get(..usize::from(size)).ok_or("too few engines")?;
        let (router, port) = start_router("least_load", workers, Some(&config))?;
        let pid = router.child.id();
        // Let every worker pass its first health check and open its poll connection.
        std::thread::sleep(Duration::from_secs(3));

        eprintln!("xtask: == {size} workers: idle router, polling every {POLL_INTERVAL_MS} ms");
        let mut fractions = Vec::new();
        for run in 0..options.runs {
            let before = cpu_s(pid)?;
            let start = Instant::now();
            std::thread::sleep(Duration::from_secs(options.duration_s));
            let wall_s = start.elapsed().as_secs_f64();
            let fraction = (cpu_s(pid)? - before) / wall_s;
            eprintln!(
                "xtask:    run {}/{}: {:.2}% of a core",
                run + 1,
                options.runs,
                fraction * 100.0
            );
            fractions.push(fraction);
        }
        let fraction = median(&fractions);
        rows.push(
            Row::new(format!("poll/{size}"))
                .num("cpu_fraction", fraction)
                .num("cpu_ms_per_round", fraction * POLL_INTERVAL_MS as f64)
                .int("interval_ms", POLL_INTERVAL_MS)
                .int("runs", fractions.len() as u64)
                .num("spread", spread(&fractions)),
        );

        eprintln!("xtask: == {size} workers: wrk through the router (least_load)");
        let target = Target::Port(port);
        let script = wrk::script(out_dir, Mode::NonStream, &target, None)?;
        wrk::run(&script, &target, 1)?;
        let mut runs: Vec<WrkRun> = Vec::new();
        let mut cpu_per_request = Vec::new();
        for _ in 0..options.runs {
            let before = cpu_s(pid)?;
            let run = wrk::run(&script, &target, options.duration_s)?;
            let used = cpu_s(pid)? - before;
            if run.requests > 0 {
                cpu_per_request.push(used * 1e6 / run.requests as f64);
            }
            eprintln!(
                "xtask:    {:>9.0} req/s  p99 {:>7.3} ms  router CPU {:.1} µs/req",
                run.throughput_rps(),
                run.p99_ms,
                cpu_per_request.last().copied().unwrap_or(f64::NAN)
            );
            runs.push(run);
        }
        let throughput: Vec<f64> = runs.iter().map(WrkRun::throughput_rps).collect();
        let p99: Vec<f64> = runs.iter().map(|r| r.p99_ms).collect();
        rows.push(
            Row::new(format!("router-cpu/least_load/{size}"))
                .num("throughput_rps", median(&throughput))
                .num("p99_ms", median(&p99))
                .num("cpu_us_per_request", median(&cpu_per_request))
                .int("errors", runs.iter().map(|r| r.errors).sum())
                .int("runs", runs.len() as u64)
                .num("spread", spread(&throughput)),
        );
        drop(router);
    }
    let notes = vec![format!(
        "Many workers: one engine-sim (`--count {largest} --mode canned`, open-file limit raised with `ulimit -n` in a bash wrapper) on core 0; the router (least_load, open-file limit raised the same way) on core 1 with the first 256 or all 1024 engines as workers. `poll/<workers>`: the idle router's CPU (utime+stime from /proc/<pid>/stat) over {} s windows with loads polled every {POLL_INTERVAL_MS} ms and health checks only at start (health.interval_ms = 1 h), so it is the load monitor's cost; `cpu_ms_per_round` = CPU per window / polling rounds in it. `router-cpu/least_load/<workers>`: wrk non-streaming at saturation, router CPU / requests (includes the polling running beside it).",
        options.duration_s
    )];
    Ok((rows, notes))
}
