//! `router`: a load-aware router for LLM inference fleets.

use std::process::ExitCode;

use clap::Parser;
use policy_core::error_chain;
use router_bin::cli::Cli;
use router_bin::config::RouterConfig;
use router_bin::server;
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let config = match cli
        .layers()
        .map(Layers::with_process_environment)
        .and_then(RouterConfig::load)
        .and_then(|mut config| {
            router_bin::app::complete_policy_sections(&mut config)?;
            Ok(config)
        }) {
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
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("router: cannot start the runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(config, cli.config.clone())) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("router: {}", error_chain(&error));
            ExitCode::FAILURE
        }
    }
}

use router_bin::config::Layers;

async fn run(
    config: RouterConfig,
    config_file: Option<std::path::PathBuf>,
) -> Result<(), router_bin::RouterError> {
    let address = format!("{}:{}", config.server.host, config.server.port);
    let listener = tokio::net::TcpListener::bind(&address)
        .await
        .map_err(|source| router_bin::RouterError::Bind {
            address: address.clone(),
            source,
        })?;
    let app = server::start(config, config_file).await?;
    #[cfg(unix)]
    tokio::spawn(server::reload_on_sighup(app.clone()));
    tracing::info!(%address, policy = app.policy().name(), workers = app.workers().len(), "router listening");
    server::serve(app, listener, server::termination()).await?;
    tracing::info!("router stopped");
    Ok(())
}
