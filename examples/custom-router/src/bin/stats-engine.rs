//! `stats-engine`: one stand-in `jsonstats` engine on a port, for trying the
//! custom router by hand (see this crate's README). Runs until Ctrl-C.

use std::process::ExitCode;

use clap::Parser;
use custom_router::{JsonStats, KvCacheStats, QueueStats, serve_stats_engine};

/// A stand-in `jsonstats` engine: reports these numbers at GET /stats and
/// answers OpenAI chat and text completions.
#[derive(Debug, Parser)]
struct Args {
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long)]
    port: u16,
    #[arg(long, default_value_t = 0)]
    queue_requests: i64,
    #[arg(long, default_value_t = 0)]
    queue_prompt_tokens: i64,
    #[arg(long, default_value_t = 0)]
    running: i64,
    #[arg(long, default_value_t = 0)]
    kv_used_blocks: i64,
    #[arg(long, default_value_t = 1000)]
    kv_total_blocks: i64,
    #[arg(long, default_value_t = 1000.0)]
    decode_tps: f64,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let stats = JsonStats {
        queue: QueueStats {
            requests: args.queue_requests,
            prompt_tokens: Some(args.queue_prompt_tokens),
        },
        running: args.running,
        kv_cache: KvCacheStats {
            used_blocks: args.kv_used_blocks,
            total_blocks: args.kv_total_blocks,
        },
        decode_tps: Some(args.decode_tps),
    };
    let engine = match serve_stats_engine((args.host.as_str(), args.port), stats).await {
        Ok(engine) => engine,
        Err(error) => {
            eprintln!(
                "stats-engine: cannot listen on {}:{}: {error}",
                args.host, args.port
            );
            return ExitCode::FAILURE;
        }
    };
    eprintln!("stats-engine: serving {} (GET /stats)", engine.url());
    if let Err(error) = tokio::signal::ctrl_c().await {
        eprintln!("stats-engine: cannot wait for Ctrl-C: {error}");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
