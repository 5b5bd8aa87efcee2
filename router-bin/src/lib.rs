//! The `router` binary's command line, as a library: [`main`] parses the
//! process's arguments and environment into config layers, loads the config
//! through a [`RouterBuilder`] and runs the router until SIGTERM or SIGINT.
//!
//! The `router` binary is [`main`] with [`RouterBuilder::with_builtins`]; a
//! binary of your own adds policies and backends to the builder first and
//! gets the same command line, config layers, admin API and metrics:
//!
//! ```no_run
//! use router::RouterBuilder;
//!
//! fn main() -> std::process::ExitCode {
//!     let mut router = RouterBuilder::with_builtins();
//!     // my_backend::register(router.backends());
//!     // my_policy::register(router.policies());
//!     router.backends(); // (the registries, to add to)
//!     router_bin::main(router)
//! }
//! ```

mod cli;

use std::ffi::OsString;
use std::process::ExitCode;

use clap::Parser;
use policy_core::error_chain;
use router::RouterBuilder;

use crate::cli::Cli;

/// Runs the router built by `builder` from the process's command line and
/// environment, exactly as the `router` binary does, until SIGTERM or
/// SIGINT.
pub fn main(builder: RouterBuilder) -> ExitCode {
    main_from(builder, std::env::args_os())
}

/// [`main`] with the given command line (its first item is the program
/// name).
pub fn main_from(builder: RouterBuilder, args: impl IntoIterator<Item = OsString>) -> ExitCode {
    init_logging();
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(error) => {
            // clap prints help and version to stdout with exit code 0.
            let _ = error.print();
            return ExitCode::from(u8::try_from(error.exit_code()).unwrap_or(2));
        }
    };
    let config = match cli
        .layers()
        .map(router::Layers::with_process_environment)
        .and_then(|layers| builder.load_config(layers))
    {
        Ok(config) => config,
        Err(error) => {
            eprintln!("router: {}", error_chain(&error));
            return ExitCode::from(2);
        }
    };
    if cli.print_config {
        return match config.to_toml() {
            Ok(text) => {
                print!("{text}");
                ExitCode::SUCCESS
            }
            Err(error) => {
                eprintln!("router: {}", error_chain(&error));
                ExitCode::FAILURE
            }
        };
    }
    let runtime = match runtime_for_this_machine() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("router: cannot start the runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(builder.run(config, cli.config.clone())) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("router: {}", error_chain(&error));
            ExitCode::FAILURE
        }
    }
}

/// Logs to stderr, filtered by `RUST_LOG` (default `info`). A second call
/// (a test, an embedding program that set its own) changes nothing.
fn init_logging() {
    // The NATS client logs every connection event at info; replica sync
    // logs each state change once itself.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,async_nats=warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// The runtime the router runs on: one thread per core it may use, or,
/// given a single core (a container's CPU limit, `taskset`), one thread
/// that runs every task itself. A second thread on one core would only
/// hand work across threads and switch between them; nginx, given one
/// core, runs one worker the same way.
fn runtime_for_this_machine() -> std::io::Result<tokio::runtime::Runtime> {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    if cores == 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Runtime::new()
    }
}
