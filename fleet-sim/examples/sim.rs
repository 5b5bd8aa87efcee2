//! Runs the fleet simulator as `engine-sim sim` does, without the mock servers:
//! `cargo run --release -p fleet-sim --example sim -- [--scenario PATH] [--out-dir DIR]`.

use clap::Parser;
use fleet_sim::{SimArgs, run_cli};

#[derive(Debug, Parser)]
#[command(about = "Virtual-time fleet simulator: routing quality against baselines and an oracle")]
struct Cli {
    #[command(flatten)]
    sim: SimArgs,
}

fn main() -> std::process::ExitCode {
    match run_cli(Cli::parse().sim) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            let mut message = format!("error: {error}");
            let mut source = std::error::Error::source(&error);
            while let Some(cause) = source {
                message.push_str(&format!(": {cause}"));
                source = cause.source();
            }
            eprintln!("{message}");
            std::process::ExitCode::FAILURE
        }
    }
}
