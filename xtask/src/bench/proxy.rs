//! Proxy overhead: wrk directly against 4 canned engines, through the router
//! (round_robin, least_load, and least_load with clients over TLS) and
//! through nginx (`least_conn`), then latency at half the router's
//! saturation throughput.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::Process;

use super::report::{Row, find};
use super::wrk::{self, Mode, STREAM_CHUNKS, Target, WrkRun};
use super::{LOAD_CORE, Options, PROXY_CORE, median, proc_stat, spread};

/// Upstream engines of the proxy comparison.
const UPSTREAMS: u16 = 4;

/// The proxies and the direct path, in the order they are measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ProxyPath {
    Direct,
    RoundRobin,
    LeastLoad,
    /// least_load with `[server.tls]`: clients over TLS, engines plain.
    LeastLoadTls,
    /// least_load with `[admission] enabled = false`.
    LeastLoadNoRoom,
    /// least_load with `[hedging] after_ms = 0`.
    LeastLoadNoHedge,
    Nginx,
}

impl ProxyPath {
    const ALL: [ProxyPath; 7] = [
        ProxyPath::Direct,
        ProxyPath::RoundRobin,
        ProxyPath::LeastLoad,
        ProxyPath::LeastLoadTls,
        ProxyPath::LeastLoadNoRoom,
        ProxyPath::LeastLoadNoHedge,
        ProxyPath::Nginx,
    ];

    fn name(self) -> &'static str {
        match self {
            ProxyPath::Direct => "direct",
            ProxyPath::RoundRobin => "round_robin",
            ProxyPath::LeastLoad => "least_load",
            ProxyPath::LeastLoadTls => "least_load_tls",
            ProxyPath::LeastLoadNoRoom => "least_load_no_room",
            ProxyPath::LeastLoadNoHedge => "least_load_no_hedge",
            ProxyPath::Nginx => "nginx",
        }
    }
}

/// A running proxy: its process (stopped on drop), port and how to read its CPU.
struct Proxy {
    process: Process,
    port: u16,
    with_children: bool,
}

impl Proxy {
    fn cpu(&self) -> Option<proc_stat::CpuTimes> {
        let pid = self.process.child.id();
        if self.with_children {
            proc_stat::cpu_times_with_children(pid)
        } else {
            proc_stat::cpu_times(pid)
        }
    }
}

/// One canned engine-sim process with `count` engines, pinned to the load core.
pub(crate) fn start_engines(count: u16, stream_chunks: u32) -> Result<(Process, Vec<u16>), String> {
    let base = super::free_port_block(count)?;
    let mut command = super::pinned_many_files(
        LOAD_CORE,
        &crate::release_binary("engine-sim"),
        u64::from(count) * 8 + 4096,
    );
    command
        .args(["serve", "--flavour", "sglang", "--mode", "canned"])
        .args([
            "--count",
            &count.to_string(),
            "--base-port",
            &base.to_string(),
        ])
        .args(["--canned-tokens", &stream_chunks.to_string()])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut process = Process::spawn("engine-sim (canned)", &mut command)?;
    let lines = process.read_lines(usize::from(count))?;
    let mut ports = Vec::with_capacity(lines.len());
    for line in &lines {
        let value: serde_json::Value = serde_json::from_str(line)
            .map_err(|error| format!("engine-sim printed {line:?}: {error}"))?;
        let port = value
            .get("http")
            .and_then(serde_json::Value::as_str)
            .and_then(|url| url.rsplit(':').next())
            .and_then(|port| port.trim_end_matches('/').parse::<u16>().ok())
            .ok_or_else(|| format!("engine-sim printed no HTTP port: {line}"))?;
        ports.push(port);
    }
    Ok((process, ports))
}

/// The router on the proxy core, `policy` over `ports`, ready.
pub(crate) fn start_router(
    policy: &str,
    ports: &[u16],
    config: Option<&Path>,
) -> Result<(Process, u16), String> {
    let port = crate::free_ports(1)?;
    let mut command = router_command(policy, ports, port, config);
    let process = Process::spawn(&format!("router ({policy})"), &mut command)?;
    super::wait_until_ok(port, "/readiness", "the router", Duration::from_secs(60))?;
    Ok((process, port))
}

/// The router's command line: `policy` over `ports`, listening on `port`.
fn router_command(policy: &str, ports: &[u16], port: u16, config: Option<&Path>) -> Command {
    let mut command = super::pinned_many_files(
        PROXY_CORE,
        &crate::release_binary("router"),
        ports.len() as u64 * 8 + 4096,
    );
    command
        .args(["--port", &port.to_string(), "--policy", policy])
        .args(["--load-interval-ms", "1000", "--stale-after-ms", "3000"])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    if let Some(config) = config {
        command.arg("--config").arg(config);
    }
    for upstream in ports {
        command.args(["--worker", &format!("sglang=http://127.0.0.1:{upstream}")]);
    }
    command
}

/// A self-signed ECDSA P-256 certificate for `localhost` and `127.0.0.1`,
/// made by `openssl` under `dir/tls`: its certificate and key files.
fn self_signed_certificate(dir: &Path) -> Result<(PathBuf, PathBuf), String> {
    let tls_dir = dir.join("tls");
    std::fs::create_dir_all(&tls_dir)
        .map_err(|error| format!("cannot create {}: {error}", tls_dir.display()))?;
    let (cert_file, key_file) = (tls_dir.join("cert.pem"), tls_dir.join("key.pem"));
    let output = Command::new("openssl")
        .args(["req", "-x509", "-newkey", "ec", "-pkeyopt"])
        .args(["ec_paramgen_curve:prime256v1", "-nodes", "-days", "2"])
        .args(["-subj", "/CN=localhost"])
        .args(["-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"])
        .arg("-keyout")
        .arg(&key_file)
        .arg("-out")
        .arg(&cert_file)
        .output()
        .map_err(|error| format!("could not run openssl: {error}"))?;
    if !output.status.success() {
        return Err(format!(
            "openssl could not make a certificate ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    Ok((cert_file, key_file))
}

/// The least_load router with `[server.tls]` (a certificate made here),
/// ready: every worker healthy. Its `/metrics` is on a plain listener of its
/// own, which the readiness check reads (the main port speaks only TLS).
/// The least_load router with one more section of config, `toml`, written
/// to `dir/<name>.toml`.
fn start_router_configured(
    dir: &Path,
    name: &str,
    toml: &str,
    ports: &[u16],
) -> Result<(Process, u16), String> {
    let config = dir.join(format!("{name}.toml"));
    std::fs::write(&config, toml)
        .map_err(|error| format!("cannot write {}: {error}", config.display()))?;
    start_router("least_load", ports, Some(&config))
}

fn start_tls_router(dir: &Path, ports: &[u16]) -> Result<(Process, u16), String> {
    let (cert_file, key_file) = self_signed_certificate(dir)?;
    let port = crate::free_ports(2)?;
    let metrics_port = port + 1;
    let config = dir.join("tls").join("router.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nmetrics_port = {metrics_port}\n[server.tls]\ncert_file = {:?}\nkey_file = {:?}\n",
            cert_file.display().to_string(),
            key_file.display().to_string()
        ),
    )
    .map_err(|error| format!("cannot write {}: {error}", config.display()))?;
    let mut command = router_command("least_load", ports, port, Some(&config));
    // wrk (OpenSSL) sends the address 127.0.0.1 as SNI, which RFC 6066
    // forbids and rustls warns of on every connection.
    command.env("RUST_LOG", "warn,rustls=error");
    let process = Process::spawn("router (least_load, TLS)", &mut command)?;
    super::wait_for(
        "the TLS router's workers to be healthy",
        Duration::from_secs(60),
        || {
            let healthy = super::http_get_body(metrics_port, "/metrics").map_or(0, |text| {
                text.lines()
                    .filter(|line| {
                        line.starts_with("router_worker_healthy{") && line.ends_with(" 1")
                    })
                    .count()
            });
            Ok(healthy == ports.len())
        },
    )?;
    Ok((process, port))
}

/// nginx in the foreground on the proxy core, `least_conn` over `ports`,
/// its config and logs under `dir/nginx`.
///
/// Its idle-connection cache holds one connection per upstream at least
/// (128 for a small fleet), as the router keeps one per worker, so a large
/// fleet's requests find a warm connection through both proxies alike.
pub(crate) fn start_nginx(dir: &Path, ports: &[u16]) -> Result<(Process, u16), String> {
    let port = crate::free_ports(1)?;
    let nginx_dir = dir.join("nginx");
    std::fs::create_dir_all(nginx_dir.join("tmp"))
        .map_err(|error| format!("cannot create {}: {error}", nginx_dir.display()))?;
    let d = nginx_dir.display();
    let servers: String = ports
        .iter()
        .map(|upstream| format!("        server 127.0.0.1:{upstream};\n"))
        .collect();
    let keepalive = ports.len().max(128);
    // A client and an upstream connection per request in flight, plus the
    // idle upstream connections kept.
    let worker_connections = keepalive + 4096;
    let open_files = worker_connections as u64 * 2;
    // Matches the router: one worker on one core, keep-alive to the upstreams,
    // no buffering so SSE chunks pass as they come.
    let conf = format!(
        "daemon off;
master_process on;
worker_processes 1;
worker_rlimit_nofile {open_files};
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{
    worker_connections {worker_connections};
}}
http {{
    access_log off;
    client_body_temp_path {d}/tmp/body;
    proxy_temp_path {d}/tmp/proxy;
    fastcgi_temp_path {d}/tmp/fastcgi;
    uwsgi_temp_path {d}/tmp/uwsgi;
    scgi_temp_path {d}/tmp/scgi;
    keepalive_requests 1000000;
    upstream engines {{
        least_conn;
{servers}        keepalive {keepalive};
        keepalive_requests 1000000;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://engines;
            proxy_http_version 1.1;
            proxy_set_header Connection \"\";
            proxy_buffering off;
            proxy_request_buffering off;
        }}
    }}
}}
"
    );
    let conf_path = nginx_dir.join("nginx.conf");
    std::fs::write(&conf_path, conf)
        .map_err(|error| format!("cannot write {}: {error}", conf_path.display()))?;
    let nginx = if Path::new("/usr/sbin/nginx").is_file() {
        Path::new("/usr/sbin/nginx").to_path_buf()
    } else {
        "nginx".into()
    };
    let mut command = super::pinned_many_files(PROXY_CORE, &nginx, open_files);
    command
        .arg("-c")
        .arg(&conf_path)
        .arg("-p")
        .arg(&nginx_dir)
        .arg("-e")
        .arg(nginx_dir.join("error.log"))
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    let process = Process::spawn("nginx", &mut command)?;
    super::wait_until_ok(port, "/health", "nginx", Duration::from_secs(20))?;
    Ok((process, port))
}

/// Sends one streaming request and counts the `data:` events of the answer.
fn count_sse_events(port: u16) -> Result<usize, String> {
    let body = format!(
        r#"{{"model":"sim-model","messages":[{{"role":"user","content":"hi"}}],"max_tokens":{STREAM_CHUNKS},"stream":true}}"#
    );
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut stream =
        TcpStream::connect(("127.0.0.1", port)).map_err(|error| format!("port {port}: {error}"))?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|error| error.to_string())?;
    stream
        .write_all(request.as_bytes())
        .map_err(|error| format!("port {port}: {error}"))?;
    let mut answer = Vec::new();
    stream
        .read_to_end(&mut answer)
        .map_err(|error| format!("port {port}: {error}"))?;
    let text = String::from_utf8_lossy(&answer);
    Ok(text.matches("data: ").count())
}

#[derive(Default)]
struct Measured {
    runs: Vec<WrkRun>,
    cpu_us_per_request: Vec<f64>,
    /// The user-space part of `cpu_us_per_request`.
    cpu_user_us_per_request: Vec<f64>,
}

/// The row of one path's runs. Throughput and CPU per request must agree
/// across runs (see [`Row::settled`]); at half load, where the rate is held,
/// so must the p99.
fn summarize(name: String, measured: &Measured, half_load: bool) -> Row {
    let throughput = throughputs(measured);
    let p50: Vec<f64> = measured.runs.iter().map(|r| r.p50_ms).collect();
    let p99 = p99s(measured);
    let errors: u64 = measured.runs.iter().map(|r| r.errors).sum();
    let (p99_min, p99_max) = p99
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(low, high), &p| {
            (low.min(p), high.max(p))
        });
    let mut row = Row::new(name)
        .settled("throughput_rps", &throughput)
        .num("p50_ms", median(&p50));
    row = if half_load {
        row.settled("p99_ms", &p99)
    } else {
        row.num("p99_ms", median(&p99))
    };
    // A p99 is noisier than a throughput; the runs' range shows how much.
    row = row.num("p99_min_ms", p99_min).num("p99_max_ms", p99_max);
    if !measured.cpu_us_per_request.is_empty() {
        // The share of its core the proxy used: below saturation it was
        // not what limited the run's throughput.
        let core_busy: Vec<f64> = measured
            .cpu_us_per_request
            .iter()
            .zip(&throughput)
            .map(|(cpu_us, rps)| cpu_us * rps / 1e6)
            .collect();
        row = row
            .settled("cpu_us_per_request", &measured.cpu_us_per_request)
            .num(
                "cpu_user_us_per_request",
                median(&measured.cpu_user_us_per_request),
            )
            .num("proxy_core_busy", median(&core_busy));
    }
    row.int("errors", errors)
        .int("runs", measured.runs.len() as u64)
        .num("spread", spread(&throughput))
}

/// A quantity of each run of a [`Measured`].
type PerRun = fn(&Measured) -> Vec<f64>;

fn throughputs(measured: &Measured) -> Vec<f64> {
    measured.runs.iter().map(WrkRun::throughput_rps).collect()
}

fn cpu_per_request(measured: &Measured) -> Vec<f64> {
    measured.cpu_us_per_request.clone()
}

fn p99s(measured: &Measured) -> Vec<f64> {
    measured.runs.iter().map(|run| run.p99_ms).collect()
}

/// The saturation rows' run-by-run comparisons with nginx.
const SATURATION_PAIRED: [(&str, PerRun); 2] = [
    ("vs_nginx_paired", throughputs),
    ("cpu_vs_nginx_paired", cpu_per_request),
];

/// The least_load variants' (TLS, no admission room, no hedging)
/// run-by-run comparison with the plain least_load router's.
const VARIANT_PAIRED: [(&str, PerRun); 1] = [("cpu_vs_plain_paired", cpu_per_request)];

/// The half-load router row's run-by-run comparison with nginx: the p99
/// target is judged on it.
const HALF_LOAD_PAIRED: [(&str, PerRun); 1] = [("p99_vs_nginx_paired", p99s)];

/// Run `i` of a path over run `i` of nginx, for each of `quantities`: the
/// runs are interleaved, so the two runs of a pair are minutes apart at
/// most and drift on a shared machine hits both. Their median, range and
/// spread (max / min) are reported as `<key>`, `<key>_min`, `<key>_max`
/// and `<key>_spread`, so a reader sees how much the comparison itself
/// moved from run to run.
fn with_paired_ratios(
    row: Row,
    own: &Measured,
    nginx: &Measured,
    quantities: &[(&str, PerRun)],
) -> Row {
    let mut row = row;
    for (key, per_run) in quantities {
        let ratios: Vec<f64> = per_run(own)
            .iter()
            .zip(per_run(nginx))
            .map(|(own, nginx)| own / nginx)
            .filter(|ratio| ratio.is_finite())
            .collect();
        if ratios.is_empty() {
            continue;
        }
        let low = ratios.iter().copied().fold(f64::INFINITY, f64::min);
        let high = ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        row = row
            .num(key, median(&ratios))
            .num(&format!("{key}_min"), low)
            .num(&format!("{key}_max"), high)
            .num(&format!("{key}_spread"), spread(&ratios));
    }
    row
}

/// One wrk run against `path`, with the proxy's CPU per request.
fn measure_once(
    proxies: &[(ProxyPath, Proxy)],
    path: ProxyPath,
    target: &Target,
    script: &Path,
    duration_s: u64,
    into: &mut Measured,
) -> Result<(), String> {
    let proxy = proxies
        .iter()
        .find(|(p, _)| *p == path)
        .map(|(_, proxy)| proxy);
    let before = proxy.and_then(Proxy::cpu);
    let run = wrk::run(script, target, duration_s)?;
    let after = proxy.and_then(Proxy::cpu);
    if let (Some(before), Some(after)) = (before, after)
        && run.requests > 0
    {
        let spent = after.since(before);
        let requests = run.requests as f64;
        into.cpu_us_per_request
            .push(spent.total_s() * 1e6 / requests);
        into.cpu_user_us_per_request
            .push(spent.user_s * 1e6 / requests);
    }
    eprintln!(
        "xtask:    {:<12} {:>9.0} req/s  p50 {:>7.3} ms  p99 {:>7.3} ms  errors {}",
        path.name(),
        run.throughput_rps(),
        run.p50_ms,
        run.p99_ms,
        run.errors
    );
    into.runs.push(run);
    Ok(())
}

pub(crate) fn run(options: &Options, out_dir: &Path) -> Result<(Vec<Row>, Vec<String>), String> {
    eprintln!("xtask: == proxy overhead: engine-sim canned ×{UPSTREAMS}, direct / router / nginx");
    let mut notes = Vec::new();
    let (_engines, ports) = start_engines(UPSTREAMS, STREAM_CHUNKS)?;
    let (round_robin, rr_port) = start_router("round_robin", &ports, None)?;
    let (least_load, ll_port) = start_router("least_load", &ports, None)?;
    let (least_load_tls, tls_port) = start_tls_router(out_dir, &ports)?;
    let (no_room, no_room_port) = start_router_configured(
        out_dir,
        "least_load_no_room",
        "[admission]\nenabled = false\n",
        &ports,
    )?;
    let (no_hedge, no_hedge_port) = start_router_configured(
        out_dir,
        "least_load_no_hedge",
        "[hedging]\nafter_ms = 0\n",
        &ports,
    )?;
    let (nginx, nginx_port) = start_nginx(out_dir, &ports)?;
    let proxies = [
        (
            ProxyPath::RoundRobin,
            Proxy {
                process: round_robin,
                port: rr_port,
                with_children: false,
            },
        ),
        (
            ProxyPath::LeastLoad,
            Proxy {
                process: least_load,
                port: ll_port,
                with_children: false,
            },
        ),
        (
            ProxyPath::LeastLoadTls,
            Proxy {
                process: least_load_tls,
                port: tls_port,
                with_children: false,
            },
        ),
        (
            ProxyPath::LeastLoadNoRoom,
            Proxy {
                process: no_room,
                port: no_room_port,
                with_children: false,
            },
        ),
        (
            ProxyPath::LeastLoadNoHedge,
            Proxy {
                process: no_hedge,
                port: no_hedge_port,
                with_children: false,
            },
        ),
        (
            ProxyPath::Nginx,
            Proxy {
                process: nginx,
                port: nginx_port,
                with_children: true,
            },
        ),
    ];
    let target = |path: ProxyPath| match proxies.iter().find(|(p, _)| *p == path) {
        Some((ProxyPath::LeastLoadTls, proxy)) => Target::TlsPort(proxy.port),
        Some((_, proxy)) => Target::Port(proxy.port),
        None => Target::Spread(ports.clone()),
    };

    // Every plain path streams the whole answer (the TLS path is the same
    // router; wrk counts its non-2xx answers as errors).
    let mut checks = Vec::new();
    for path in ProxyPath::ALL {
        let port = match target(path) {
            Target::Port(port) => port,
            Target::Spread(_) => ports.first().copied().ok_or("no upstream")?,
            Target::TlsPort(_) => continue,
        };
        checks.push(format!("{} {}", path.name(), count_sse_events(port)?));
    }
    notes.push(format!(
        "Upstream: one engine-sim process, `serve --flavour sglang --mode canned --count 4 --canned-tokens {STREAM_CHUNKS}`: every answer at once; a streaming answer is {STREAM_CHUNKS} token events plus the final event and `[DONE]` (`data:` events counted through each path: {}).",
        checks.join(", ")
    ));
    notes.push(format!(
        "Pinning (`taskset`): wrk and engine-sim share core {LOAD_CORE}; the proxy under test has core {PROXY_CORE} to itself (the router's tokio runtime sees one core and runs one worker thread; nginx runs one worker process). All three proxies stay up for the whole section and the runs are interleaved (direct, round_robin, least_load, nginx, then again), so drift on the shared machine hits them alike; the idle proxies only poll loads. `direct`: one wrk with one thread per upstream (4 threads × 16 connections, an even spread), so it measures what core {LOAD_CORE} alone can drive: a proxy at `vs_direct` ≈ 1 is not the bottleneck."
    ));
    notes.push(
        "least_load_tls: the least_load router with `[server.tls]` (a self-signed ECDSA P-256 certificate made by `openssl`), the engines behind it plain HTTP as for the others; wrk connects with `https://` (OpenSSL, TLS 1.3), each of its 64 connections one handshake and then kept alive for the run, so the row is the cost of TLS records, not of handshakes. Its `/metrics` has a plain listener of its own (`metrics_port`), for the readiness check. `cpu_vs_plain_paired`: its CPU per request over least_load's, run by run.".to_owned(),
    );
    notes.push(
        "least_load_no_room and least_load_no_hedge: the least_load router with `[admission] enabled = false` and with `[hedging] after_ms = 0`, so 1 − their `cpu_vs_plain_paired` is the share of least_load's CPU per request that the admission gate, or the hedge's arming, costs a request that is neither queued nor hedged.".to_owned(),
    );
    notes.push(
        "nginx: `least_conn` over the same 4 upstreams, `keepalive 128` upstream connections, HTTP/1.1 upstream, `proxy_buffering off` and `proxy_request_buffering off`, access log off; config under target/bench/nginx/.".to_owned(),
    );

    let mut rows = Vec::new();
    for mode in Mode::ALL {
        eprintln!("xtask: == saturation, {}", mode.name());
        let mut measured: Vec<(ProxyPath, Measured)> = Vec::new();
        let mut scripts = Vec::new();
        for path in ProxyPath::ALL {
            let target = target(path);
            let script = wrk::script(out_dir, mode, &target, None)?;
            // Warm-up: connections, pools, caches.
            wrk::run(&script, &target, 1)?;
            scripts.push((path, target, script));
            measured.push((path, Measured::default()));
        }
        for run in 0..options.runs {
            eprintln!("xtask:  run {}/{}", run + 1, options.runs);
            for ((path, target, script), (_, into)) in scripts.iter().zip(measured.iter_mut()) {
                measure_once(&proxies, *path, target, script, options.duration_s, into)?;
            }
        }
        let mode_rows: Vec<Row> = measured
            .iter()
            .map(|(path, m)| summarize(format!("proxy/{}/{}", path.name(), mode.name()), m, false))
            .collect();
        let throughput = |path: ProxyPath| {
            find(
                &mode_rows,
                &format!("proxy/{}/{}", path.name(), mode.name()),
            )
            .and_then(|row| row.get("throughput_rps"))
            .unwrap_or(f64::NAN)
        };
        let direct = throughput(ProxyPath::Direct);
        let nginx_rps = throughput(ProxyPath::Nginx);
        let nginx_runs = measured
            .iter()
            .find(|(path, _)| *path == ProxyPath::Nginx)
            .map(|(_, m)| m);
        let plain_runs = measured
            .iter()
            .find(|(path, _)| *path == ProxyPath::LeastLoad)
            .map(|(_, m)| m);
        for (row, (path, own_runs)) in mode_rows.into_iter().zip(&measured) {
            let own = row.get("throughput_rps").unwrap_or(f64::NAN);
            let mut row = row
                .num("vs_direct", own / direct)
                .num("vs_nginx", own / nginx_rps);
            if let Some(nginx_runs) = nginx_runs {
                row = with_paired_ratios(row, own_runs, nginx_runs, &SATURATION_PAIRED);
            }
            if let (
                ProxyPath::LeastLoadTls | ProxyPath::LeastLoadNoRoom | ProxyPath::LeastLoadNoHedge,
                Some(plain_runs),
            ) = (path, plain_runs)
            {
                row = with_paired_ratios(row, own_runs, plain_runs, &VARIANT_PAIRED);
            }
            rows.push(row);
        }
    }

    // Latency at half the router's saturation throughput.
    for mode in Mode::ALL {
        let saturation = find(&rows, &format!("proxy/least_load/{}", mode.name()))
            .and_then(|row| row.get("throughput_rps"))
            .unwrap_or(f64::NAN);
        if !saturation.is_finite() || saturation <= 0.0 {
            continue;
        }
        let rate = saturation / 2.0;
        eprintln!(
            "xtask: == {} at {rate:.0} req/s (50% of least_load's saturation)",
            mode.name()
        );
        // The pair is measured again, whole, when either row's runs
        // disagree: the router's p99 is judged against nginx's from the
        // same attempt.
        let mut attempt = 1;
        let half_rows = loop {
            let half_rows = measure_half_load(options, out_dir, &proxies, target, mode, rate)?;
            let agree = half_rows.iter().all(|row| row.failures().is_empty());
            if agree || attempt > HALF_LOAD_RETRIES {
                break half_rows;
            }
            let why: Vec<String> = super::report::failures(&half_rows)
                .map(|(name, why)| format!("`{name}`: {why}"))
                .collect();
            eprintln!("xtask:  runs disagree; measuring the pair again");
            notes.push(format!(
                "Half load, {}: attempt {attempt} was measured again, both proxies, because {}.",
                mode.name(),
                why.join("; ")
            ));
            attempt += 1;
        };
        let nginx_p99 = half_rows
            .iter()
            .find(|row| row.name.starts_with("half-load/nginx/"))
            .and_then(|row| row.get("p99_ms"))
            .unwrap_or(f64::NAN);
        for row in half_rows {
            let own = row.get("p99_ms").unwrap_or(f64::NAN);
            rows.push(
                row.num("p99_vs_nginx", own / nginx_p99)
                    .int("attempts", attempt as u64),
            );
        }
    }
    notes.push(
        format!("Half load: wrk2 is not packaged in Debian (bookworm has only `wrk`), so the rate is held with wrk's Lua `delay()`: each of the 64 connections waits an exponentially distributed time with a mean of 64/rate s before each request (rounded to whole ms at random, in proportion, so the mean holds; each wrk thread seeds its own random numbers), so requests arrive as a Poisson stream at the paced rate. A closed loop with think time: wrk's latency clock starts when the request is sent, after the delay, so it is the response time at that offered load; achieved req/s is reported next to the paced rate. Coordinated omission is not corrected (it matters little at 50% load). Each paced run lasts {} s, longer than a saturation run: a p99 is the tail of 1 % of the requests, and on a shared machine a stall of a tenth of a second moves a 10 s run's p99 by up to 2×.", options.half_load_duration_s),
    );
    notes.push(
        "`cpu_us_per_request`: the proxy's user+system CPU (`/proc/<pid>/stat`; nginx: master + worker) over the run divided by the requests; 10 ms tick resolution, so ±1% at these run lengths. `of which user`: its user-space part (utime); the rest is the kernel's, mostly loopback TCP.".to_owned(),
    );
    Ok((rows, notes))
}

/// How many more times the half-load pair (the router and nginx) is
/// measured when either one's runs disagree. A p99 is a tail, and one
/// stall on a shared machine moves it; one more attempt, both proxies
/// again, is what the half hour of paced runs can afford.
pub(crate) const HALF_LOAD_RETRIES: usize = 1;

/// The router's and nginx's rows at `rate_rps` (half the router's
/// saturation), their runs interleaved.
fn measure_half_load(
    options: &Options,
    out_dir: &Path,
    proxies: &[(ProxyPath, Proxy)],
    target_of: impl Fn(ProxyPath) -> Target,
    mode: Mode,
    rate_rps: f64,
) -> Result<Vec<Row>, String> {
    let paths = [ProxyPath::LeastLoad, ProxyPath::Nginx];
    let mut measured: Vec<(ProxyPath, Target, std::path::PathBuf, Measured)> = Vec::new();
    for path in paths {
        let target = target_of(path);
        let script = wrk::script(out_dir, mode, &target, Some(rate_rps))?;
        measured.push((path, target, script, Measured::default()));
    }
    for run in 0..options.runs {
        eprintln!("xtask:  run {}/{}", run + 1, options.runs);
        for (path, target, script, into) in &mut measured {
            measure_once(
                proxies,
                *path,
                target,
                script,
                options.half_load_duration_s,
                into,
            )?;
        }
    }
    match &measured[..] {
        [(_, _, _, router), (_, _, _, nginx)] => Ok(half_load_rows(mode, rate_rps, router, nginx)),
        _ => Err("half load: the router's and nginx's runs were not both measured".to_owned()),
    }
}

/// The router's and nginx's half-load rows; the router's carries its runs'
/// p99s against nginx's run by run, which the p99 target judges.
fn half_load_rows(mode: Mode, rate_rps: f64, router: &Measured, nginx: &Measured) -> Vec<Row> {
    let row = |path: ProxyPath, measured: &Measured| {
        summarize(
            format!("half-load/{}/{}", path.name(), mode.name()),
            measured,
            true,
        )
        .num("offered_rps", rate_rps)
    };
    vec![
        with_paired_ratios(
            row(ProxyPath::LeastLoad, router),
            router,
            nginx,
            &HALF_LOAD_PAIRED,
        ),
        row(ProxyPath::Nginx, nginx),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn measured(rps: &[f64], cpu_us: &[f64]) -> Measured {
        Measured {
            runs: rps
                .iter()
                .map(|rps| WrkRun {
                    requests: *rps as u64 * 10,
                    duration_s: 10.0,
                    p50_ms: 1.0,
                    p99_ms: 2.0,
                    errors: 0,
                })
                .collect(),
            cpu_us_per_request: cpu_us.to_vec(),
            cpu_user_us_per_request: Vec::new(),
        }
    }

    #[test]
    fn each_run_is_compared_with_the_nginx_run_beside_it() {
        // Run 2 is slow for both: run by run the router is 0.9× nginx's
        // CPU every time, though the medians' ratio says 1.0×.
        let router = measured(&[100.0, 50.0, 110.0], &[18.0, 36.0, 9.0]);
        let nginx = measured(&[100.0, 50.0, 100.0], &[20.0, 40.0, 10.0]);
        let row = with_paired_ratios(
            Row::new("proxy/least_load/non-stream"),
            &router,
            &nginx,
            &SATURATION_PAIRED,
        );
        assert_eq!(row.get("cpu_vs_nginx_paired"), Some(0.9));
        assert_eq!(row.get("cpu_vs_nginx_paired_min"), Some(0.9));
        assert_eq!(row.get("vs_nginx_paired"), Some(1.0));
        assert_eq!(row.get("vs_nginx_paired_max"), Some(1.1));
        let lines = super::super::report::targets(&[row]);
        assert!(
            lines.iter().any(|line| line.contains("throughput ≥ 1.1× nginx")
                && line.contains("run by run, each beside nginx's run next to it: median 1.000×, range 1.000–1.100×")),
            "{lines:#?}"
        );
    }

    #[test]
    fn p99_at_half_load_is_judged_run_by_run_when_those_ratios_agree() {
        let measured_p99s = |p99s: &[f64]| Measured {
            runs: p99s
                .iter()
                .map(|p99_ms| WrkRun {
                    requests: 15_000,
                    duration_s: 10.0,
                    p50_ms: 0.5,
                    p99_ms: *p99_ms,
                    errors: 0,
                })
                .collect(),
            ..Measured::default()
        };
        let p99_line = |router: &[f64], nginx: &[f64]| {
            let rows = half_load_rows(
                Mode::Stream,
                1500.0,
                &measured_p99s(router),
                &measured_p99s(nginx),
            );
            super::super::report::targets(&rows)
                .into_iter()
                .find(|line| line.contains("(least_load, stream) p99"))
                .unwrap()
        };

        // nginx's own runs disagree (1.77×), so its median is not
        // reported, but each router run beside it is 0.74–0.98× of it.
        let line = p99_line(
            &[4.163, 4.041, 5.120, 3.821, 4.478],
            &[5.106, 4.493, 6.878, 3.888, 5.749],
        );
        assert!(
            line.contains("**met** (median 0.815×, range 0.744–0.983×"),
            "{line}"
        );
        assert!(line.contains("nginx – ms"), "{line}");

        // Run by run the router is ahead in one pair and far behind in
        // another: no verdict.
        let line = p99_line(&[2.0, 2.0, 2.0], &[1.0, 2.0, 4.0]);
        assert!(
            line.contains("not measured: the run-by-run ratios disagree by 4.00×"),
            "{line}"
        );

        // Steady and behind: missed.
        let line = p99_line(&[2.2, 2.4, 2.2], &[2.0, 2.0, 2.0]);
        assert!(line.contains("**missed** (median 1.100×"), "{line}");
    }

    #[test]
    fn throughput_is_judged_only_when_both_proxies_filled_their_core() {
        // 40 µs a request at 20,000 req/s is 0.8 of a core.
        let rows = |router_cpu_us: f64, nginx_cpu_us: f64| {
            let row = |path: ProxyPath, rps: f64, cpu_us: f64| {
                let measured = measured(&[rps, rps, rps], &[cpu_us, cpu_us, cpu_us]);
                summarize(
                    format!("proxy/{}/non-stream", path.name()),
                    &measured,
                    false,
                )
                .num("vs_nginx", rps / 20_000.0)
            };
            vec![
                row(ProxyPath::Direct, 25_000.0, 0.0),
                row(ProxyPath::LeastLoad, 24_000.0, router_cpu_us),
                row(ProxyPath::Nginx, 20_000.0, nginx_cpu_us),
            ]
        };
        let throughput_line = |rows: &[Row]| {
            super::super::report::targets(rows)
                .into_iter()
                .find(|line| line.contains("(least_load, non-stream) throughput"))
                .unwrap()
        };

        let unsaturated = rows(40.0, 40.0);
        assert_eq!(
            find(&unsaturated, "proxy/nginx/non-stream").and_then(|row| row.get("proxy_core_busy")),
            Some(0.8)
        );
        let line = throughput_line(&unsaturated);
        assert!(
            line.contains("**not judged**") && line.contains("nginx 0.80"),
            "{line}"
        );
        assert!(line.contains("1.200×; direct path 1.250×"), "{line}");

        let saturated = rows(40.0, 48.0);
        let line = throughput_line(&saturated);
        assert!(line.contains("**met**"), "{line}");
    }
}
