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
    #[error("cannot set up TLS on the client listener ([server.tls])")]
    ListenerTls(#[source] TlsError),
    #[error("cannot set up the trust for https:// workers ([worker_tls])")]
    WorkerTls(#[source] worker_h1::TlsConfigError),
    #[error("worker {url} is https://, and no trust for it could be loaded")]
    WorkerTrust {
        url: String,
        #[source]
        source: worker_h1::TlsConfigError,
    },
}

/// Why the client listener's certificate and key (`[server.tls]`) could not
/// be loaded, at start or on SIGHUP.
#[derive(Debug, Error)]
pub enum TlsError {
    #[error("{} does not exist", path.display())]
    Missing {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read {}", path.display())]
    Unreadable {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} is not valid PEM", path.display())]
    BadPem {
        path: PathBuf,
        #[source]
        source: rustls_pki_types::pem::Error,
    },
    #[error("{} holds no PEM certificate", path.display())]
    NoCertificate { path: PathBuf },
    #[error("{} holds no PEM private key", path.display())]
    NoPrivateKey { path: PathBuf },
    #[error(
        "the private key in {} does not match the certificate in {}",
        key_file.display(),
        cert_file.display()
    )]
    KeyMismatch {
        cert_file: PathBuf,
        key_file: PathBuf,
    },
    #[error(
        "the certificate in {} with the key in {} cannot be used",
        cert_file.display(),
        key_file.display()
    )]
    Rejected {
        cert_file: PathBuf,
        key_file: PathBuf,
        #[source]
        source: rustls::Error,
    },
}
