//! `engine-sim`: simulated inference engines behind real sockets.
//!
//! ```text
//! engine-sim sim [--scenario FILE] [--out-dir DIR] …   # the fleet simulator
//! engine-sim drive --router URL [--router URL]… [--duration-s S] [--rate R] …  # demo traffic
//!                  [--traffic size-skew|multi-turn] [--session-rate R] [--apps N] …
//!                  [--engine URL]…   # per-engine prefix-cache hits from their /metrics
//! engine-sim serve --flavour sglang|sglang-metrics|vllm|tokenspeed --count N
//!                  --base-port P [--grpc-base-port G] [--mode model|canned]
//!                  [--time-scale X] [--fault MODE] [--slow-loads-ms MS]
//!                  [--slow-first-byte-ms MS] [--prefill-tps …] [--decode-base-ms …]
//!                  [--decode-per-req-ms …] [--max-running …] [--kv-tokens …] [--seed S]
//! ```
//!
//! Fault modes (`--fault`, or at run time `POST /control/fault {"mode": …}`):
//! `none`; load-endpoint faults `slow-loads`, `malformed-loads`, `nan-loads`,
//! `loads-500`; generation faults `hang-generation` (no answer),
//! `hang-mid-stream` (head and first event, then silence on an open
//! connection), `close-mid-stream` (cut after the first chunk),
//! `generation-500` (500 while `/health` says 200), `slow-first-byte` (the
//! head only after `--slow-first-byte-ms`); and `refuse-connections`.
//! `GET /control/stats` counts the generation requests and `/health_generate`
//! probes each engine received; `GET /control/admitted` lists the
//! `x-request-id`s of the generation requests that got past every pre-model
//! fault into the engine (the newest 100 000), so a duplicate generation
//! shows as an id admitted twice.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::ExitCode;
use std::time::Duration;

mod drive;
mod sessions;

use clap::{Parser, Subcommand};
use mock_engines::{EngineSimError, FaultMode, Flavour, ServeMode, SimEngineConfig};
use policy_core::error_chain;

#[derive(Debug, Parser)]
#[command(
    name = "engine-sim",
    version,
    about = "Simulated LLM inference engines"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve N simulated engines of one flavour on consecutive ports.
    Serve(ServeArgs),
    /// Run the virtual-time fleet simulator over scenario files.
    Sim(fleet_sim::SimArgs),
    /// Send streaming traffic (size-skewed prompts, or multi-turn chat
    /// sessions) through a running router and print the per-worker outcome.
    Drive(drive::DriveArgs),
}

#[derive(Debug, clap::Args)]
struct ServeArgs {
    /// Which engine to impersonate: sglang, sglang-metrics, vllm, tokenspeed.
    #[arg(long)]
    flavour: Flavour,
    /// How many engines.
    #[arg(long, default_value_t = 1)]
    count: usize,
    /// Engine i serves HTTP on base-port + i; 0 picks free ports.
    #[arg(long)]
    base_port: u16,
    /// Engine i serves gRPC on grpc-base-port + i (required for tokenspeed);
    /// 0 picks free ports.
    #[arg(long)]
    grpc_base_port: Option<u16>,
    /// model: latency from the engine model; canned: answer at once.
    #[arg(long, default_value = "model")]
    mode: ServeMode,
    /// Virtual seconds per wall second.
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Fault mode at start (switchable with POST /control/fault): none,
    /// slow-loads, malformed-loads, nan-loads, loads-500, hang-generation,
    /// hang-mid-stream, close-mid-stream, generation-500, slow-first-byte,
    /// refuse-connections.
    #[arg(long, default_value = "none")]
    fault: FaultMode,
    #[arg(long)]
    prefill_tps: Option<f64>,
    #[arg(long)]
    prefill_chunk_tokens: Option<u32>,
    #[arg(long)]
    decode_base_ms: Option<f64>,
    #[arg(long)]
    decode_per_req_ms: Option<f64>,
    #[arg(long)]
    max_running: Option<u32>,
    /// KV-cache capacity, tokens.
    #[arg(long)]
    kv_tokens: Option<u64>,
    /// Turn the prefix cache off.
    #[arg(long)]
    no_prefix_cache: bool,
    /// Engine i is seeded with seed + i.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Address to listen on.
    #[arg(long, default_value_t = IpAddr::V4(Ipv4Addr::LOCALHOST))]
    host: IpAddr,
    /// Model name served by /v1/models.
    #[arg(long, default_value = "sim-model")]
    model_name: String,
    /// Output tokens when a request names none.
    #[arg(long, default_value_t = 16)]
    default_output_tokens: u32,
    /// Tokens (SSE chunks) of every canned answer.
    #[arg(long, default_value_t = 8)]
    canned_tokens: u32,
    /// How long load endpoints stall under the slow-loads fault, milliseconds.
    #[arg(long, default_value_t = 5000)]
    slow_loads_ms: u64,
    /// How long generation requests wait before their response head under
    /// the slow-first-byte fault, milliseconds (wall time).
    #[arg(long, default_value_t = 5000)]
    slow_first_byte_ms: u64,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("engine-sim: cannot start the runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let result: Result<(), Box<dyn std::error::Error>> = match cli.command {
        // The simulator is CPU-bound virtual time: no runtime needed.
        Command::Sim(args) => fleet_sim::run_cli(args).map_err(Into::into),
        Command::Serve(args) => runtime.block_on(serve(args)).map_err(Into::into),
        Command::Drive(args) => runtime.block_on(drive::drive(args)).map_err(Into::into),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("engine-sim: {}", error_chain(error.as_ref()));
            ExitCode::FAILURE
        }
    }
}

/// Port `base + index`; base 0 lets the OS pick a free port for every engine
/// (the printed lines say which).
fn port(base: u16, index: usize) -> Result<u16, EngineSimError> {
    if base == 0 {
        return Ok(0);
    }
    u16::try_from(usize::from(base) + index)
        .map_err(|_| EngineSimError::PortOutOfRange { base, index })
}

async fn serve(args: ServeArgs) -> Result<(), EngineSimError> {
    if args.flavour.requires_grpc() && args.grpc_base_port.is_none() {
        return Err(EngineSimError::MissingGrpcPort {
            flavour: args.flavour.as_str(),
        });
    }
    let mut configs = Vec::with_capacity(args.count);
    for index in 0..args.count {
        let mut config = SimEngineConfig::new(args.flavour);
        config.mode = args.mode;
        config.time_scale = args.time_scale;
        config.fault = args.fault;
        config.seed = args.seed.wrapping_add(index as u64);
        config.model_name = args.model_name.clone();
        config.default_output_tokens = args.default_output_tokens;
        config.canned_tokens = args.canned_tokens;
        config.slow_loads_delay = Duration::from_millis(args.slow_loads_ms);
        config.slow_first_byte_delay = Duration::from_millis(args.slow_first_byte_ms);
        config.http_addr = SocketAddr::new(args.host, port(args.base_port, index)?);
        config.grpc_addr = match args.grpc_base_port {
            Some(base) if args.flavour.has_grpc() => {
                Some(SocketAddr::new(args.host, port(base, index)?))
            }
            _ => None,
        };
        let params = &mut config.params;
        if let Some(value) = args.prefill_tps {
            params.prefill_tps = value;
        }
        if let Some(value) = args.prefill_chunk_tokens {
            params.prefill_chunk_tokens = value;
        }
        if let Some(value) = args.decode_base_ms {
            params.decode_base_ms = value;
        }
        if let Some(value) = args.decode_per_req_ms {
            params.decode_per_req_ms = value;
        }
        if let Some(value) = args.max_running {
            params.max_running = value;
        }
        if let Some(value) = args.kv_tokens {
            params.kv_capacity_tokens = value;
        }
        if args.no_prefix_cache {
            params.prefix_cache = false;
        }
        configs.push(config);
    }
    let fleet = mock_engines::start(configs).await?;
    for engine in fleet.engines() {
        let line = EngineLine {
            index: engine.index,
            flavour: engine.flavour.as_str(),
            http: engine.http_url(),
            grpc: engine.grpc_url(),
        };
        println!("{}", serde_json::to_string(&line)?);
    }
    tracing::info!(count = fleet.engines().len(), "engines serving");
    wait_for_signal().await?;
    tracing::info!("stopping");
    fleet.shutdown().await;
    Ok(())
}

/// The line printed per engine on start, fields in this order.
#[derive(Debug, serde::Serialize)]
struct EngineLine {
    index: usize,
    flavour: &'static str,
    http: String,
    grpc: Option<String>,
}

async fn wait_for_signal() -> Result<(), EngineSimError> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut terminate = signal(SignalKind::terminate())?;
        tokio::select! {
            result = tokio::signal::ctrl_c() => result?,
            _ = terminate.recv() => {}
        }
        Ok(())
    }
    #[cfg(not(unix))]
    {
        tokio::signal::ctrl_c().await?;
        Ok(())
    }
}
