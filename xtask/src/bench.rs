//! `cargo xtask bench`: selection cost and proxy overhead, measured side by
//! side, written to `target/bench/report.json` and `target/bench/report.md`.
//!
//! Four parts, each its own submodule:
//! - [`select`]: the criterion benchmarks of `policy-least-load` (and of the
//!   baselines it runs), summarized as `select/<policy>/<workers>[/2-thread]`;
//! - [`proxy`]: wrk against engine-sim in canned mode, directly, through the
//!   router (round_robin, least_load) and through nginx (`least_conn`), then
//!   the p99 of the router and of nginx at half the router's saturation
//!   throughput;
//! - [`fleet`]: the router in front of 16, 256, 1024 and 4096 canned engines:
//!   its CPU per request and its load monitor's CPU per poll round, beside
//!   nginx's CPU per request over the same engines;
//! - [`replicas`]: one router, three replicas without sync and three with
//!   sync in front of one engine-sim fleet under the same open-loop load (p99
//!   TTFT), the same three under multi-turn chat sessions (the fleet's
//!   prefix-cache hit rate and p99 TTFT), and sync's CPU per replica at 1024
//!   workers.
//!
//! Pinning (2 cores): wrk and engine-sim share core 0, the proxy under test
//! (router or nginx, one worker each) has core 1 to itself. The direct runs
//! use core 0 only; they show what core 0 can do, so a proxy whose throughput
//! equals direct is not the bottleneck. Each saturation row also reports
//! the share of its core the proxy used (`proxy core busy`): the throughput
//! target compares the router with nginx only when both used 0.9 of it or
//! more, as otherwise core 0 limited both runs and the ratio measures that.

mod fleet;
mod proc_stat;
mod proxy;
mod replicas;
mod report;
mod select;
mod wrk;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use report::Row;

const BENCH_USAGE: &str =
    "usage: cargo xtask bench [--only select|proxy|fleet|replicas]... [--runs N]
                         [--duration-s S] [--half-load-duration-s S]
                         [--measurement-time-s S]

  --only PART              run only this part (repeatable); default: all four.
                           A partial run writes target/bench/partial/report.{md,json}.
                           replicas: one router, 3 replicas without and with sync
                           under size-skewed traffic (p99 TTFT) and under
                           multi-turn chat sessions (fleet prefix-cache hit rate,
                           p99 TTFT), and sync's CPU at 1024 workers
  --runs N                 repetitions of every wrk measurement (default 5; with 3 a
                           noisy neighbour in one run can still move the median).
                           A row whose runs disagree by more than 1.5x (max/min;
                           criterion rows: p90/p10 of the samples) is measured
                           again (a criterion benchmark alone, up to twice; the
                           half-load pair, both proxies, once); if it still
                           disagrees it is FAILED: no median is reported for it
                           and the bench exits non-zero after writing the report
  --duration-s S           length of one wrk run, seconds (default 10)
  --half-load-duration-s S length of one paced run at half load, seconds (default
                           30): a p99 is the tail of 1 % of the requests, and a
                           stall of a tenth of a second on a shared machine moves
                           a 10 s run's p99 by 2x; a longer run dilutes it
  --measurement-time-s S   criterion measurement time per benchmark (default 3)";

/// The core that load generator and upstream share.
const LOAD_CORE: &str = "0";
/// The core the proxy under test has to itself.
const PROXY_CORE: &str = "1";

/// Settings of one `cargo xtask bench` run.
#[derive(Debug, Clone)]
struct Options {
    parts: Vec<String>,
    runs: usize,
    duration_s: u64,
    /// Length of one paced run at half load, longer than `duration_s`: see
    /// `--half-load-duration-s` in [`BENCH_USAGE`].
    half_load_duration_s: u64,
    measurement_time_s: u64,
}

impl Options {
    fn parse(args: &[String]) -> Result<Options, String> {
        let mut options = Options {
            parts: Vec::new(),
            // Five, not three: on a shared machine the runs' throughput
            // spreads up to 1.6×, and one bad run of three moves the median.
            runs: 5,
            duration_s: 10,
            half_load_duration_s: 30,
            measurement_time_s: 3,
        };
        let mut iter = args.iter();
        while let Some(arg) = iter.next() {
            let mut value = |name: &str| {
                iter.next()
                    .cloned()
                    .ok_or_else(|| format!("{name} needs a value\n\n{BENCH_USAGE}"))
            };
            let number = |name: &str, text: String| {
                text.parse::<u64>()
                    .map_err(|_| format!("{name}: not a number: {text:?}"))
            };
            match arg.as_str() {
                "--only" => {
                    let part = value("--only")?;
                    if !["select", "proxy", "fleet", "replicas"].contains(&part.as_str()) {
                        return Err(format!("--only: unknown part {part:?}\n\n{BENCH_USAGE}"));
                    }
                    options.parts.push(part);
                }
                "--runs" => options.runs = number("--runs", value("--runs")?)?.max(1) as usize,
                "--duration-s" => {
                    options.duration_s = number("--duration-s", value("--duration-s")?)?.max(1);
                }
                "--half-load-duration-s" => {
                    options.half_load_duration_s =
                        number("--half-load-duration-s", value("--half-load-duration-s")?)?.max(1);
                }
                "--measurement-time-s" => {
                    options.measurement_time_s =
                        number("--measurement-time-s", value("--measurement-time-s")?)?.max(1);
                }
                "-h" | "--help" => return Err(BENCH_USAGE.to_owned()),
                other => return Err(format!("unknown option {other:?}\n\n{BENCH_USAGE}")),
            }
        }
        Ok(options)
    }

    fn wants(&self, part: &str) -> bool {
        self.parts.is_empty() || self.parts.iter().any(|wanted| wanted == part)
    }
}

/// `cargo xtask bench [options]`.
pub(crate) fn run(args: &[String]) -> Result<(), String> {
    let options = Options::parse(args)?;
    let out_dir = bench_dir();
    std::fs::create_dir_all(&out_dir)
        .map_err(|error| format!("cannot create {}: {error}", out_dir.display()))?;
    let started = Instant::now();
    let mut rows: Vec<Row> = Vec::new();
    let mut notes: Vec<String> = Vec::new();
    notes.push(machine_note());

    if options.wants("proxy") || options.wants("fleet") || options.wants("replicas") {
        ensure_tools()?;
        super::build_release(&["router-bin", "engine-sim"])?;
    }
    if options.wants("select") {
        rows.extend(select::run(&options, &out_dir)?);
    }
    if options.wants("proxy") {
        let (proxy_rows, proxy_notes) = proxy::run(&options, &out_dir)?;
        rows.extend(proxy_rows);
        notes.extend(proxy_notes);
    }
    if options.wants("fleet") {
        let (fleet_rows, fleet_notes) = fleet::run(&options, &out_dir)?;
        rows.extend(fleet_rows);
        notes.extend(fleet_notes);
    }
    if options.wants("replicas") {
        let (replica_rows, replica_notes) = replicas::run(&options, &out_dir)?;
        rows.extend(replica_rows);
        notes.extend(replica_notes);
    }
    notes.push(format!(
        "Whole run: {:.0} s.",
        started.elapsed().as_secs_f64()
    ));
    // A partial run (`--only`) never overwrites the full report.
    let report_dir = if options.parts.is_empty() {
        out_dir
    } else {
        out_dir.join("partial")
    };
    std::fs::create_dir_all(&report_dir)
        .map_err(|error| format!("cannot create {}: {error}", report_dir.display()))?;
    report::write(&report_dir, &rows, &notes, &options)?;
    let failed: Vec<String> = report::failures(&rows)
        .map(|(name, why)| format!("  {name}: {why}"))
        .collect();
    if !failed.is_empty() {
        return Err(format!(
            "FAILED: {} row(s) whose runs disagree by more than {}× (the machine was too noisy to trust their medians; the report marks them):\n{}",
            failed.len(),
            report::MAX_RUN_SPREAD,
            failed.join("\n")
        ));
    }
    Ok(())
}

/// `target/bench` under the workspace (or `CARGO_TARGET_DIR`).
fn bench_dir() -> PathBuf {
    super::target_dir().join("bench")
}

/// nginx, wrk and taskset, installed from Debian's packages when missing.
fn ensure_tools() -> Result<(), String> {
    let missing: Vec<&str> = [
        ("nginx", "nginx"),
        ("wrk", "wrk"),
        ("taskset", "util-linux"),
    ]
    .into_iter()
    .filter(|(binary, _)| !on_path(binary))
    .map(|(_, package)| package)
    .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let mut update = Command::new("apt-get");
    update.arg("update");
    super::run("apt-get update", update)?;
    let mut install = Command::new("apt-get");
    install
        .args(["install", "-y", "--no-install-recommends"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive");
    super::run(
        &format!("apt-get install -y {}", missing.join(" ")),
        install,
    )?;
    match ["nginx", "wrk", "taskset"]
        .into_iter()
        .find(|binary| !on_path(binary))
    {
        Some(binary) => Err(format!("{binary} is still missing after apt-get install")),
        None => Ok(()),
    }
}

pub(crate) fn on_path(binary: &str) -> bool {
    find_on_path(binary).is_some()
}

/// Where `binary` is: on the PATH, or in the sbin directories a non-root
/// PATH may leave out.
pub(crate) fn find_on_path(binary: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|dir| dir.join(binary))
        .find(|candidate| candidate.is_file())
}

/// Cores, load average and kernel at the start, for the report.
fn machine_note() -> String {
    let cores = std::thread::available_parallelism().map_or(0, usize::from);
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let load: Vec<&str> = load.split_whitespace().take(3).collect();
    format!(
        "Machine: {cores} cores, load average {} at the start (shared: other builds run beside this).",
        load.join(" ")
    )
}

/// `GET path` on a loopback port; the status code, if anything answered.
pub(crate) fn http_status(port: u16, path: &str) -> Option<u16> {
    http_send(port, "GET", path, None)
}

/// `POST path` with a JSON `body` on a loopback port; the status code, if
/// anything answered.
fn http_post_json(port: u16, path: &str, body: &serde_json::Value) -> Option<u16> {
    http_send(port, "POST", path, Some(&body.to_string()))
}

/// One request on a new connection; the answer's status code.
fn http_send(port: u16, method: &str, path: &str, json_body: Option<&str>) -> Option<u16> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    let body = match json_body {
        Some(body) => format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        ),
        None => "\r\n".to_owned(),
    };
    let request =
        format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n{body}");
    stream.write_all(request.as_bytes()).ok()?;
    let mut head = [0u8; 64];
    let read = stream.read(&mut head).ok()?;
    let text = std::str::from_utf8(&head[..read]).ok()?;
    text.split_whitespace().nth(1)?.parse().ok()
}

/// Waits until `GET path` answers 200, or fails after `limit`.
fn wait_until_ok(port: u16, path: &str, what: &str, limit: Duration) -> Result<(), String> {
    wait_for(&format!("{what} to answer 200 on {path}"), limit, || {
        Ok(http_status(port, path) == Some(200))
    })
}

/// Checks `condition` every 100 ms until it holds; an error after `limit`
/// (or the condition's own error) says what was waited for. Used instead of
/// fixed sleeps: a warm-up takes as long as it takes, and no longer.
pub(crate) fn wait_for(
    what: &str,
    limit: Duration,
    mut condition: impl FnMut() -> Result<bool, String>,
) -> Result<(), String> {
    let started = Instant::now();
    loop {
        if condition()? {
            return Ok(());
        }
        if started.elapsed() >= limit {
            return Err(format!(
                "gave up waiting for {what} after {} s",
                limit.as_secs()
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `GET path` on a loopback port: the body of a 200 answer, if any.
fn http_get_body(port: u16, path: &str) -> Option<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .ok()?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).ok()?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).ok()?;
    let text = String::from_utf8(answer).ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    if head.split_whitespace().nth(1) != Some("200") {
        return None;
    }
    let chunked = head.lines().any(|line| {
        line.to_ascii_lowercase()
            .starts_with("transfer-encoding: chunked")
    });
    if !chunked {
        return Some(body.to_owned());
    }
    let mut rest = body;
    let mut whole = String::new();
    loop {
        let (size, after) = rest.split_once("\r\n")?;
        let size = usize::from_str_radix(size.split(';').next()?.trim(), 16).ok()?;
        if size == 0 {
            return Some(whole);
        }
        whole.push_str(after.get(..size)?);
        rest = after.get(size + 2..)?;
    }
}

/// Whether the router on `port` has all `workers` healthy, each with a load
/// report at most `max_age_s` old: it routes on fresh loads from now on.
fn router_has_fresh_loads(port: u16, workers: usize, max_age_s: f64) -> Result<bool, String> {
    let fresh = router_workers(port)?
        .unwrap_or_default()
        .iter()
        .filter(|worker| {
            worker.get("healthy").and_then(serde_json::Value::as_bool) == Some(true)
                && worker
                    .get("load_age_s")
                    .and_then(serde_json::Value::as_f64)
                    .is_some_and(|age| age <= max_age_s)
        })
        .count();
    Ok(fresh >= workers)
}

/// The router's `/admin/workers` listing, one object per worker; `None`
/// while it does not answer.
pub(crate) fn router_workers(port: u16) -> Result<Option<Vec<serde_json::Value>>, String> {
    let Some(body) = http_get_body(port, "/admin/workers") else {
        return Ok(None);
    };
    let mut listing: serde_json::Value = serde_json::from_str(&body)
        .map_err(|error| format!("/admin/workers on port {port}: {error}"))?;
    Ok(
        match listing.get_mut("workers").map(serde_json::Value::take) {
            Some(serde_json::Value::Array(workers)) => Some(workers),
            _ => None,
        },
    )
}

/// `program` pinned to `core` (`taskset`), with the open-file limit raised
/// to at least `open_files` first (up to the hard limit; never lowered).
/// bash and taskset exec the program, so the pid is still the program's.
fn pinned_many_files(core: &str, program: &Path, open_files: u64) -> Command {
    let mut command = Command::new("bash");
    command
        .arg("-c")
        .arg(format!(
            "if [ \"$(ulimit -n)\" != unlimited ] && [ \"$(ulimit -n)\" -lt {open_files} ]; then \
             ulimit -n {open_files} 2>/dev/null || ulimit -n \"$(ulimit -Hn)\"; fi; \
             exec taskset -c {core} \"$@\""
        ))
        .arg("bash")
        .arg(program);
    command
}

/// A block of `count` consecutive free loopback ports below the kernel's
/// ephemeral range, so the client side of thousands of connections (and their
/// TIME-WAIT leftovers) cannot collide with it.
fn free_port_block(count: u16) -> Result<u16, String> {
    let range =
        std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap_or_default();
    let ephemeral_low: u32 = range
        .split_whitespace()
        .next()
        .and_then(|low| low.parse().ok())
        .unwrap_or(32_768);
    let count32 = u32::from(count);
    let mut base: u32 = 10_000 + (std::process::id() % 97) * 16;
    while base + count32 <= ephemeral_low.min(65_535) {
        let all_free = (0..count32).all(|offset| {
            u16::try_from(base + offset)
                .is_ok_and(|port| std::net::TcpListener::bind(("127.0.0.1", port)).is_ok())
        });
        if all_free {
            return u16::try_from(base).map_err(|_| "port out of range".to_owned());
        }
        base += count32;
    }
    crate::free_ports(count)
}

/// The median of `values` (the mean of the middle two for an even count).
fn median(values: &[f64]) -> f64 {
    let mut sorted: Vec<f64> = values.iter().copied().filter(|v| v.is_finite()).collect();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// max / min of `values` (1.0 for a single value).
fn spread(values: &[f64]) -> f64 {
    let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    if min > 0.0 { max / min } else { f64::NAN }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn spread_is_max_over_min() {
        assert_eq!(spread(&[2.0, 4.0, 3.0]), 2.0);
        assert_eq!(spread(&[5.0]), 1.0);
    }

    #[test]
    fn runs_that_disagree_fail_the_row_and_report_no_median() {
        let agreeing = report::Row::new("a").settled("x", &[10.0, 12.0, 14.0]);
        assert!(agreeing.failures().is_empty());
        assert_eq!(agreeing.get("x"), Some(12.0));
        assert_eq!(agreeing.get("x_spread"), Some(1.4));
        let apart = report::Row::new("b").settled("x", &[10.0, 12.0, 16.0]);
        assert_eq!(apart.failures().len(), 1, "1.6× apart");
        assert_eq!(apart.get("x"), None, "no median");
        assert_eq!(apart.get("x_spread"), Some(1.6));
        // Within what the measurement can tell apart (a clock tick), runs
        // agree however large their ratio.
        let ticks = report::Row::new("c").settled_within("x", &[0.0, 0.001], 0.002);
        assert!(ticks.failures().is_empty());
        let single = report::Row::new("d").settled("x", &[3.0]);
        assert_eq!(single.get("x"), Some(3.0));
    }

    #[test]
    fn options_parse() -> Result<(), String> {
        let args: Vec<String> = [
            "--only",
            "proxy",
            "--runs",
            "5",
            "--duration-s",
            "4",
            "--half-load-duration-s",
            "12",
        ]
        .map(String::from)
        .to_vec();
        let options = Options::parse(&args)?;
        assert!(options.wants("proxy"));
        assert!(!options.wants("select"));
        assert_eq!(options.runs, 5);
        assert_eq!(options.duration_s, 4);
        assert_eq!(options.half_load_duration_s, 12);
        assert_eq!(Options::parse(&[])?.half_load_duration_s, 30);
        assert!(Options::parse(&["--half-load-duration-s".to_owned(), "x".to_owned()]).is_err());
        assert!(Options::parse(&["--only".to_owned(), "x".to_owned()]).is_err());
        Ok(())
    }
}
