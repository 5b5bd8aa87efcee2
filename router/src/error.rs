use std::path::PathBuf;

use policy_core::{BackendError, PolicyError};
use thiserror::Error;

/// Why the configuration could not be used.
#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("config file {} does not exist", .0.display())]
    MissingFile(PathBuf),
    /// A layer could not be read or merged: bad TOML, a wrong type, an unknown key.
    #[error(transparent)]
    Merge(config::ConfigError),
    #[error("invalid {key} = {value}: must be {allowed}")]
    Invalid {
        key: String,
        value: String,
        allowed: String,
    },
    #[error("invalid policy configuration")]
    Policy(#[from] PolicyError),
    #[error("could not render the configuration as TOML")]
    Render(#[source] toml::ser::Error),
}

/// Why the router could not start or a worker could not be added.
#[derive(Debug, Error)]
pub enum RouterError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("worker {url}")]
    Backend {
        url: String,
        #[source]
        source: BackendError,
    },
    #[error("could not detect the backend of {url}: neither /v1/loads nor vLLM /metrics answered")]
    DetectFailed { url: String },
    #[error("could not bind {address}")]
    Bind {
        address: String,
        #[source]
        source: std::io::Error,
    },
    #[error("server error")]
    Serve(#[source] std::io::Error),
    #[error("cannot start the OTLP trace exporter to {endpoint}")]
    Tracing {
        endpoint: String,
        #[source]
        source: opentelemetry_otlp::ExporterBuildError,
    },
}
