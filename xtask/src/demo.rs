//! `cargo xtask demo [--replicas N] [--multi-turn]`: a mixed engine-sim fleet
//! behind the release router, driven with size-skewed streaming traffic. With
//! `--replicas N` (N > 1), N routers share their pending work through a
//! `nats-server` this task starts (installing it from Debian when missing),
//! and the traffic takes turns among them. With `--multi-turn`, the traffic
//! is chat sessions of a few apps that resend their history every turn, and
//! the run ends with each engine's prefix-cache hit rate, read from its own
//! `/metrics`.

use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::{Process, build_release, free_ports, release_binary, start_engines};

const DEMO_USAGE: &str = "usage: cargo xtask demo [--replicas N] [--multi-turn]

  --replicas N   routers in front of the fleet (default 1, at most 16); with more
                 than one they share pending work through nats-server
  --multi-turn   multi-turn chat sessions (8 apps, 2000-token system prompts,
                 history resent every turn) instead of size-skewed prompts; ends
                 with every engine's prefix-cache hit rate from its /metrics";

/// Most replicas the demo starts.
const MAX_REPLICAS: usize = 16;

/// What `cargo xtask demo` was asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DemoOptions {
    pub(crate) replicas: usize,
    pub(crate) multi_turn: bool,
}

fn parse(args: &[String]) -> Result<DemoOptions, String> {
    let mut options = DemoOptions {
        replicas: 1,
        multi_turn: false,
    };
    let mut iter = args.iter();
    while let Some(arg) = iter.next() {
        match arg.as_str() {
            "--replicas" => {
                let value = iter
                    .next()
                    .ok_or_else(|| format!("--replicas needs a value\n\n{DEMO_USAGE}"))?;
                options.replicas = value
                    .parse::<usize>()
                    .ok()
                    .filter(|count| (1..=MAX_REPLICAS).contains(count))
                    .ok_or_else(|| {
                        format!("--replicas: {value:?} is not a number from 1 to {MAX_REPLICAS}")
                    })?;
            }
            "--multi-turn" => options.multi_turn = true,
            "-h" | "--help" => return Err(DEMO_USAGE.to_owned()),
            other => return Err(format!("unknown option {other:?}\n\n{DEMO_USAGE}")),
        }
    }
    Ok(options)
}

/// `nats-server`, installed from Debian's package when missing.
pub(crate) fn ensure_nats_server() -> Result<PathBuf, String> {
    let candidates = || {
        crate::bench::find_on_path("nats-server").or_else(|| {
            ["/usr/bin/nats-server", "/usr/local/bin/nats-server"]
                .into_iter()
                .map(PathBuf::from)
                .find(|path| path.is_file())
        })
    };
    if let Some(found) = candidates() {
        return Ok(found);
    }
    let mut update = Command::new("apt-get");
    update.arg("update");
    crate::run("apt-get update", update)?;
    let mut install = Command::new("apt-get");
    install
        .args(["install", "-y", "--no-install-recommends", "nats-server"])
        .env("DEBIAN_FRONTEND", "noninteractive");
    crate::run("apt-get install -y nats-server", install)?;
    candidates().ok_or_else(|| "nats-server is still missing after apt-get install".to_owned())
}

/// Starts `nats-server` on a free loopback port and waits until it accepts;
/// returns it (stopped on drop) and its URL.
pub(crate) fn start_nats_server() -> Result<(Process, String), String> {
    let binary = ensure_nats_server()?;
    let port = free_ports(1)?;
    let mut command = Command::new(binary);
    command
        .args(["-a", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let process = Process::spawn("nats-server", &mut command)?;
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            return Err(format!(
                "nats-server did not listen on port {port} within 20 s"
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok((process, format!("nats://127.0.0.1:{port}")))
}

pub(crate) fn run_demo(options: DemoOptions) -> Result<(), String> {
    let replicas = options.replicas;
    build_release(&["engine-sim", "router-bin"])?;
    let nats = if replicas > 1 {
        let (process, url) = start_nats_server()?;
        eprintln!("xtask: == nats-server on {url}");
        Some((process, url))
    } else {
        None
    };
    eprintln!(
        "xtask: == starting a mixed fleet: 2 SGLang (one at half speed), 1 vLLM, 1 TokenSpeed"
    );
    let (sglang_fast, fast) = start_engines("sglang", &["--seed", "1"])?;
    let (sglang_slow, slow) = start_engines(
        "sglang",
        &[
            "--seed",
            "2",
            "--prefill-tps",
            "4000",
            "--decode-base-ms",
            "12",
        ],
    )?;
    let (vllm, vllm_engines) = start_engines("vllm", &["--seed", "3"])?;
    let (tokenspeed, tokenspeed_engines) = start_engines("tokenspeed", &["--seed", "4"])?;
    let _fleet = [sglang_fast, sglang_slow, vllm, tokenspeed];

    let mut workers = Vec::new();
    for (http, _) in fast.iter().chain(&slow) {
        workers.push(format!("sglang={http}"));
    }
    for (http, _) in &vllm_engines {
        workers.push(format!("vllm={http}"));
    }
    for (http, grpc) in &tokenspeed_engines {
        let grpc = grpc
            .clone()
            .ok_or("tokenspeed engine printed no gRPC address")?;
        workers.push(format!("tokenspeed={http},loads={grpc}"));
    }
    let base_port = free_ports(u16::try_from(replicas).unwrap_or(1))?;
    let mut routers = Vec::new();
    let mut router_urls = Vec::new();
    for index in 0..replicas {
        let port = base_port + u16::try_from(index).unwrap_or(0);
        let mut command = Command::new(release_binary("router"));
        command
            .args(["--port", &port.to_string(), "--policy", "least_load"])
            .args(["--load-interval-ms", "250", "--stale-after-ms", "1000"])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        if let Some((_, url)) = &nats {
            command
                .args(["--sync", "--sync-nats-url", url])
                .args(["--sync-replica-id", &format!("router-{}", index + 1)]);
        }
        for worker in &workers {
            command.args(["--worker", worker]);
        }
        routers.push(Process::spawn(
            &format!("router {}", index + 1),
            &mut command,
        )?);
        router_urls.push(format!("http://127.0.0.1:{port}"));
    }
    eprintln!(
        "xtask: == {replicas} router(s) on {} with {}",
        router_urls.join(" "),
        workers.join(" ")
    );

    let mut drive = Command::new(release_binary("engine-sim"));
    drive.arg("drive");
    for url in &router_urls {
        drive.args(["--router", url]);
    }
    let step = if options.multi_turn {
        // 30 s of sessions (mean 6 turns, 1 s to think between them) lets
        // most play out; each engine's /metrics gives its cache hits.
        drive.args(["--traffic", "multi-turn", "--duration-s", "30"]);
        drive.args(["--session-rate", "2", "--think-time-s", "1", "--seed", "7"]);
        let engines = fast
            .iter()
            .chain(&slow)
            .chain(&vllm_engines)
            .chain(&tokenspeed_engines);
        for (http, _) in engines {
            drive.args(["--engine", http]);
        }
        format!("engine-sim drive: 30 s of multi-turn chat sessions over {replicas} router(s)")
    } else {
        drive.args(["--duration-s", "20", "--rate", "12", "--seed", "7"]);
        format!("engine-sim drive: 20 s of size-skewed streaming traffic over {replicas} router(s)")
    };
    crate::run(&step, drive)
}

/// `cargo xtask demo [--replicas N] [--multi-turn]`.
pub(crate) fn run(args: &[String]) -> Result<(), String> {
    run_demo(parse(args)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_parse() {
        let args = |list: &[&str]| list.iter().map(|arg| (*arg).to_owned()).collect::<Vec<_>>();
        let options = |replicas, multi_turn| {
            Ok(DemoOptions {
                replicas,
                multi_turn,
            })
        };
        assert_eq!(parse(&args(&[])), options(1, false));
        assert_eq!(parse(&args(&["--replicas", "3"])), options(3, false));
        assert_eq!(parse(&args(&["--multi-turn"])), options(1, true));
        assert_eq!(
            parse(&args(&["--multi-turn", "--replicas", "2"])),
            options(2, true)
        );
        for bad in [
            &["--replicas"][..],
            &["--replicas", "0"],
            &["--replicas", "x"],
            &["--replica", "3"],
            &["--multi-turns"],
        ] {
            assert!(parse(&args(bad)).is_err(), "{bad:?}");
        }
    }
}
