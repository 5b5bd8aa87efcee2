//! [`RouterBuilder`]: the router as a library.

use std::path::PathBuf;
use std::sync::Arc;

use policy_core::{AdmissionRegistry, BackendRegistry, PolicyRegistry};

use crate::app::{App, complete_policy_sections};
use crate::config::{Layers, RouterConfig};
use crate::error::{ConfigError, RouterError};
use crate::server;

/// The policies and backends a router is built from. A crate of your own
/// adds its policies and backends to the registries and then runs exactly
/// what the `router` binary runs: the same config layers, admin API and
/// metrics (and, through `router-bin`'s `router_bin::main`, the same
/// command line). The `router` binary is this with the built-in parts.
///
/// ```no_run
/// use router::RouterBuilder;
/// use router::config::Layers;
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let mut router = RouterBuilder::with_builtins();
/// // my_backend::register(router.backends());
/// // my_policy::register(router.policies());
/// router.backends(); // (the registries, to add to)
/// let config = router.load_config(Layers::default().with_process_environment())?;
/// router.run(config, None).await?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct RouterBuilder {
    policies: PolicyRegistry,
    backends: BackendRegistry,
    admissions: AdmissionRegistry,
}

impl Default for RouterBuilder {
    fn default() -> RouterBuilder {
        RouterBuilder::new()
    }
}

impl RouterBuilder {
    /// The baseline policies (`round_robin`, `random`, `least_requests`,
    /// `cache_aware`, `consistent_hash`), the admission orders (`fifo`,
    /// `priority`, `fair_share`) and no backend: a router of your own parts.
    pub fn new() -> RouterBuilder {
        RouterBuilder {
            policies: PolicyRegistry::with_baselines(),
            backends: BackendRegistry::new(),
            admissions: admission::registry(),
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

    /// The admission-order registry, to register an order of your own
    /// (`[admission] order`).
    pub fn admissions(&mut self) -> &mut AdmissionRegistry {
        &mut self.admissions
    }

    /// Merges the config layers and validates the result against the
    /// registries: policy names and sections, backend names and the load
    /// address each backend declared. Every policy's effective knobs are
    /// written into the config, so `--print-config` shows them all.
    pub fn load_config(&self, layers: Layers<'_>) -> Result<RouterConfig, ConfigError> {
        let mut config = RouterConfig::load(layers)?;
        config.validate_workers(&self.backends)?;
        complete_policy_sections(&self.policies, &mut config)?;
        let order = &config.admission.order;
        if !self.admissions.names().contains(&order.as_str()) {
            return Err(ConfigError::Invalid {
                key: "admission.order".into(),
                value: format!("{order:?}"),
                allowed: format!("one of {}", self.admissions.names().join(", ")),
            });
        }
        Ok(config)
    }

    /// Builds the router's state from a loaded config, adds its workers and
    /// starts the load monitor, health checks and prober. Serve it with
    /// [`serve`](crate::serve).
    pub async fn start(
        self,
        config: RouterConfig,
        config_file: Option<PathBuf>,
    ) -> Result<Arc<App>, RouterError> {
        let app = App::new(
            config,
            config_file,
            self.policies,
            self.backends,
            self.admissions,
        )?;
        server::start(app).await
    }

    /// Runs the router from a loaded config, as the `router` binary does:
    /// binds `server.host:server.port` (and, with `server.metrics_port`
    /// set, the metrics listener), starts the router, re-reads the
    /// `[policy]` section of `config_file` on SIGHUP, and serves until
    /// SIGTERM or SIGINT ([`termination`](crate::termination)).
    pub async fn run(
        self,
        config: RouterConfig,
        config_file: Option<PathBuf>,
    ) -> Result<(), RouterError> {
        let listener = bind(format!("{}:{}", config.server.host, config.server.port)).await?;
        let metrics_listener = match config.server.metrics_address() {
            Some(address) => Some(bind(address).await?),
            None => None,
        };
        let app = self.start(config, config_file).await?;
        #[cfg(unix)]
        tokio::spawn(server::reload_on_sighup(app.clone()));
        let address = local_address(&listener);
        let metrics = metrics_listener.as_ref().map(local_address);
        tracing::info!(%address, metrics = metrics.as_deref().unwrap_or("on the same address"), policy = app.policy().name(), workers = app.workers().len(), "router listening");
        // The metrics listener serves on through the main one's grace period,
        // and stops with it.
        let metrics_server = metrics_listener.map(|listener| {
            tokio::spawn(server::serve_metrics(
                app.clone(),
                listener,
                std::future::pending(),
            ))
        });
        let served = server::serve(app.clone(), listener, server::termination()).await;
        if let Some(task) = metrics_server {
            task.abort();
        }
        app.telemetry.shutdown(TRACE_FLUSH_TIMEOUT).await;
        served?;
        tracing::info!("router stopped");
        Ok(())
    }
}

/// How long the spans still buffered at shutdown may take to reach the
/// collector.
const TRACE_FLUSH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

async fn bind(address: String) -> Result<tokio::net::TcpListener, RouterError> {
    tokio::net::TcpListener::bind(&address)
        .await
        .map_err(|source| RouterError::Bind { address, source })
}

/// The address a listener is bound to (its real port when asked for 0).
fn local_address(listener: &tokio::net::TcpListener) -> String {
    listener.local_addr().map_or_else(
        |error| format!("(unknown: {error})"),
        |address| address.to_string(),
    )
}
