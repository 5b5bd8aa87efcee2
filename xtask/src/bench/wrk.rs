//! wrk runs: a generated Lua script per kind of request, one JSON summary line
//! per run (printed by the script's `done`), parsed here.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::LOAD_CORE;

/// Connections of every wrk run.
pub(crate) const CONNECTIONS: u32 = 64;
/// wrk threads: one per upstream in the direct runs.
pub(crate) const THREADS: u32 = 4;
/// Tokens (SSE chunks) of every canned answer.
pub(crate) const STREAM_CHUNKS: u32 = 64;

/// Non-streaming or SSE streaming requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    NonStream,
    Stream,
}

impl Mode {
    pub(crate) const ALL: [Mode; 2] = [Mode::NonStream, Mode::Stream];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Mode::NonStream => "non-stream",
            Mode::Stream => "stream",
        }
    }

    fn body(self) -> String {
        let stream = self == Mode::Stream;
        format!(
            r#"{{"model":"sim-model","messages":[{{"role":"user","content":"Say hello in one short sentence."}}],"max_tokens":{STREAM_CHUNKS},"stream":{stream}}}"#
        )
    }
}

/// Where a run sends its requests.
#[derive(Debug, Clone)]
pub(crate) enum Target {
    /// One port (a proxy).
    Port(u16),
    /// One port speaking TLS (a proxy with a TLS listener): wrk connects
    /// with `https://` (OpenSSL, the certificate not verified), each of its
    /// connections one handshake and then kept alive for the run.
    TlsPort(u16),
    /// Several ports, one per wrk thread (threads are spread evenly).
    Spread(Vec<u16>),
}

/// The result of one wrk run.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WrkRun {
    pub(crate) requests: u64,
    pub(crate) duration_s: f64,
    pub(crate) p50_ms: f64,
    pub(crate) p99_ms: f64,
    /// Connect, read, write and timeout errors, and non-2xx/3xx answers.
    pub(crate) errors: u64,
}

impl WrkRun {
    pub(crate) fn throughput_rps(&self) -> f64 {
        if self.duration_s > 0.0 {
            self.requests as f64 / self.duration_s
        } else {
            0.0
        }
    }
}

/// Writes the Lua script for `mode` and `target`, optionally paced to
/// `rate_rps` in total: each connection waits an exponentially distributed
/// time between requests (mean 64/rate s, dithered to whole milliseconds:
/// wrk's `delay()` takes milliseconds), so its requests arrive as a
/// Poisson stream. A fixed wait would let the connections fall into step
/// and fire together, and how far they did would change from run to run,
/// and with it the p99. Each wrk thread seeds its own random numbers.
pub(crate) fn script(
    dir: &Path,
    mode: Mode,
    target: &Target,
    rate_rps: Option<f64>,
) -> Result<PathBuf, String> {
    let mut lua = String::new();
    lua.push_str("wrk.method = \"POST\"\n");
    lua.push_str(&format!("wrk.body = '{}'\n", mode.body()));
    lua.push_str("wrk.headers[\"Content-Type\"] = \"application/json\"\n");
    let mut name = format!("wrk-{}", mode.name());
    // `setup` runs once per wrk thread, in the main Lua state.
    let mut setup =
        String::from("local threads = 0\nfunction setup(thread)\n  threads = threads + 1\n");
    if let Target::Spread(ports) = target {
        let list: Vec<String> = ports.iter().map(|port| format!("\"{port}\"")).collect();
        lua.push_str(&format!("local ports = {{{}}}\n", list.join(", ")));
        setup.push_str(
            "  thread.addr = wrk.lookup(\"127.0.0.1\", ports[(threads - 1) % #ports + 1])[1]\n",
        );
        name.push_str("-spread");
    }
    if let Some(rate) = rate_rps {
        let mean_delay_ms = f64::from(CONNECTIONS) * 1000.0 / rate.max(1.0);
        setup.push_str("  thread:set(\"seed\", threads)\n");
        lua.push_str(&format!(
            "local mean_delay_ms = {mean_delay_ms:.4}\n\
             function init(args)\n  math.randomseed(seed)\nend\n\
             function delay()\n  local wait = -math.log(1 - math.random()) * mean_delay_ms\n  \
             local whole = math.floor(wait)\n  \
             if math.random() < wait - whole then return whole + 1 end\n  return whole\nend\n"
        ));
        name.push_str(&format!("-paced-{rate:.0}"));
    }
    setup.push_str("end\n");
    lua.push_str(&setup);
    lua.push_str(
        "function done(summary, latency, requests)\n  \
         local e = summary.errors\n  \
         io.write(string.format('WRKJSON %d %d %.1f %.1f %d\\n', summary.requests, summary.duration, \
         latency:percentile(50), latency:percentile(99), e.connect + e.read + e.write + e.status + e.timeout))\nend\n",
    );
    let path = dir.join(format!("{name}.lua"));
    std::fs::write(&path, lua)
        .map_err(|error| format!("cannot write {}: {error}", path.display()))?;
    Ok(path)
}

/// One wrk run of `duration_s` against `target`, pinned to the load core.
pub(crate) fn run(script: &Path, target: &Target, duration_s: u64) -> Result<WrkRun, String> {
    let (scheme, port) = match target {
        Target::Port(port) => ("http", *port),
        Target::TlsPort(port) => ("https", *port),
        Target::Spread(ports) => ("http", ports.first().copied().ok_or("no port to send to")?),
    };
    let mut command = Command::new("taskset");
    command
        .args(["-c", LOAD_CORE, "wrk"])
        .args(["-t", &THREADS.to_string(), "-c", &CONNECTIONS.to_string()])
        .args([
            "-d",
            &format!("{duration_s}s"),
            "--latency",
            "--timeout",
            "5s",
            "-s",
        ])
        .arg(script)
        .arg(format!("{scheme}://127.0.0.1:{port}/v1/chat/completions"));
    let output = command
        .output()
        .map_err(|error| format!("could not start wrk: {error}"))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        return Err(format!(
            "wrk failed ({}): {}{}",
            output.status,
            stdout,
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    parse(&stdout).ok_or_else(|| format!("wrk printed no summary line:\n{stdout}"))
}

fn parse(stdout: &str) -> Option<WrkRun> {
    let line = stdout
        .lines()
        .find_map(|line| line.strip_prefix("WRKJSON "))?;
    let fields: Vec<&str> = line.split_whitespace().collect();
    let duration_us: f64 = fields.get(1)?.parse().ok()?;
    let p50_us: f64 = fields.get(2)?.parse().ok()?;
    let p99_us: f64 = fields.get(3)?.parse().ok()?;
    Some(WrkRun {
        requests: fields.first()?.parse().ok()?,
        duration_s: duration_us / 1e6,
        p50_ms: p50_us / 1e3,
        p99_ms: p99_us / 1e3,
        errors: fields.get(4)?.parse().ok()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_paced_script_waits_exponentially_with_a_seed_per_thread() {
        let dir = std::env::temp_dir().join(format!("xtask-wrk-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let paced = script(
            &dir,
            Mode::Stream,
            &Target::Spread(vec![10, 11]),
            Some(2000.0),
        )
        .unwrap();
        let lua = std::fs::read_to_string(&paced).unwrap();
        // 64 connections at 2000 req/s: 32 ms between one connection's requests.
        assert!(lua.contains("local mean_delay_ms = 32.0000"), "{lua}");
        assert!(
            lua.contains("-math.log(1 - math.random()) * mean_delay_ms"),
            "{lua}"
        );
        assert!(lua.contains("thread:set(\"seed\", threads)"), "{lua}");
        assert!(lua.contains("math.randomseed(seed)"), "{lua}");
        assert!(lua.contains("ports[(threads - 1) % #ports + 1]"), "{lua}");
        assert_eq!(lua.matches("function setup(thread)").count(), 1, "{lua}");
        let unpaced = script(&dir, Mode::NonStream, &Target::Port(10), None).unwrap();
        let lua = std::fs::read_to_string(&unpaced).unwrap();
        assert!(
            !lua.contains("function delay()") && !lua.contains("ports"),
            "{lua}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn summary_line_is_parsed() {
        let out = "Running 1s test\nWRKJSON 2000 1000000 250.0 1500.5 3\n";
        let run = parse(out);
        assert!(run.is_some_and(|run| run.requests == 2000
            && (run.throughput_rps() - 2000.0).abs() < 1e-9
            && (run.p99_ms - 1.5005).abs() < 1e-9
            && run.errors == 3));
        assert!(parse("nothing").is_none());
    }
}
