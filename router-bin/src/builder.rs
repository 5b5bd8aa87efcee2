//! [`RouterBuilder`]: the router as a library. A crate of your own adds its
//! policies and backends to the registries and then runs exactly what the
//! `router` binary runs: the same config layers, command line, admin API
//! and metrics. The `router` binary is this with the built-in parts.
//!
//! ```no_run
//! use router_bin::RouterBuilder;
//!
//! fn main() -> std::process::ExitCode {
//!     let mut router = RouterBuilder::with_builtins();
//!     // my_backend::register(router.backends());
//!     // my_policy::register(router.policies());
//!     router.backends(); // (the registries, to add to)
//!     router.main()
//! }
//! ```

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use policy_core::{BackendRegistry, PolicyRegistry};

use crate::app::{App, complete_policy_sections};
use crate::cli::Cli;
use crate::config::{Layers, RouterConfig};
use crate::error::{ConfigError, RouterError};
use crate::server;
use policy_core::error_chain;

/// The policies and backends a router is built from. See the module
/// documentation.
#[derive(Debug, Clone)]
pub struct RouterBuilder {
    policies: PolicyRegistry,
    backends: BackendRegistry,
}

impl Default for RouterBuilder {
    fn default() -> RouterBuilder {
        RouterBuilder::new()
    }
}

impl RouterBuilder {
    /// The baseline policies (`round_robin`, `random`, `least_requests`,
    /// `cache_aware`, `consistent_hash`) and no backend: a router of your own parts.
    pub fn new() -> RouterBuilder {
        RouterBuilder {
            policies: PolicyRegistry::with_baselines(),
            backends: BackendRegistry::new(),
        }
    }

    /// Everything the `router` binary has: the baselines, `least_load` and
    /// `power_of_two`, and the SGLang, TokenSpeed and vLLM backends.
    pub fn with_builtins() -> RouterBuilder {
        let mut builder = RouterBuilder::new();
        policy_least_load::register(&mut builder.policies);
        backends_sglang::register(&mut builder.backends);
        backends_tokenspeed::register(&mut builder.backends);
        backends_vllm::register(&mut builder.backends);
        builder
    }

    /// The policy registry, to register a policy of your own.
    pub fn policies(&mut self) -> &mut PolicyRegistry {
        &mut self.policies
    }

    /// The backend registry, to register a backend of your own.
    pub fn backends(&mut self) -> &mut BackendRegistry {
        &mut self.backends
    }

    /// Merges the config layers and validates the result against the
    /// registries: policy names and sections, backend names and the load
    /// address each backend declared. Every policy's effective knobs are
    /// written into the config, so `--print-config` shows them all.
    pub fn load_config(&self, layers: Layers<'_>) -> Result<RouterConfig, ConfigError> {
        let mut config = RouterConfig::load(layers)?;
        config.validate_workers(&self.backends)?;
        complete_policy_sections(&self.policies, &mut config)?;
        Ok(config)
    }

    /// Builds the router's state from a loaded config, adds its workers and
    /// starts the load monitor, health checks and prober. Serve it with
    /// [`server::serve`].
    pub async fn start(
        self,
        config: RouterConfig,
        config_file: Option<PathBuf>,
    ) -> Result<Arc<App>, RouterError> {
        let app = App::new(config, config_file, self.policies, self.backends)?;
        server::start(app).await
    }

    /// Runs the router from the process's command line and environment,
    /// exactly as the `router` binary does, until SIGTERM or SIGINT.
    pub fn main(self) -> ExitCode {
        self.main_from(std::env::args_os())
    }

    /// [`RouterBuilder::main`] with the given command line (its first item
    /// is the program name).
    pub fn main_from(self, args: impl IntoIterator<Item = OsString>) -> ExitCode {
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
            .map(Layers::with_process_environment)
            .and_then(|layers| self.load_config(layers))
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
        match runtime.block_on(self.run(config, cli.config.clone())) {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("router: {}", error_chain(&error));
                ExitCode::FAILURE
            }
        }
    }

    async fn run(
        self,
        config: RouterConfig,
        config_file: Option<PathBuf>,
    ) -> Result<(), RouterError> {
        let address = format!("{}:{}", config.server.host, config.server.port);
        let listener = tokio::net::TcpListener::bind(&address)
            .await
            .map_err(|source| RouterError::Bind {
                address: address.clone(),
                source,
            })?;
        let app = self.start(config, config_file).await?;
        #[cfg(unix)]
        tokio::spawn(server::reload_on_sighup(app.clone()));
        tracing::info!(%address, policy = app.policy().name(), workers = app.workers().len(), "router listening");
        server::serve(app, listener, server::termination()).await?;
        tracing::info!("router stopped");
        Ok(())
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
