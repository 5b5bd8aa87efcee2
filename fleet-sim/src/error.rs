use std::path::PathBuf;

use thiserror::Error;

use engine_model::EngineError;

/// Everything that can go wrong loading a scenario, simulating it or writing
/// its report.
#[derive(Debug, Error)]
pub enum SimError {
    /// A scenario or trace file could not be read.
    #[error("could not read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A scenario file is not valid TOML for the scenario schema (unknown
    /// keys, wrong types, unknown policy or flavour names).
    #[error("invalid scenario file {path}")]
    Parse {
        path: PathBuf,
        #[source]
        source: Box<toml::de::Error>,
    },
    /// A scenario value is out of its range.
    #[error("invalid scenario {scenario:?}: {field} {message}")]
    Invalid {
        scenario: String,
        field: String,
        message: String,
    },
    /// A line of a CSV trace is malformed.
    #[error("invalid trace {path} line {line}: {message}")]
    Trace {
        path: PathBuf,
        line: usize,
        message: String,
    },
    /// An engine rejected its parameters or a request.
    #[error("engine error")]
    Engine(#[from] EngineError),
    /// A policy could not be built.
    #[error("could not build policy {policy}")]
    Policy {
        policy: &'static str,
        #[source]
        source: policy_core::PolicyError,
    },
    /// An admission order could not be built.
    #[error("could not build admission order {order}")]
    Admission {
        order: &'static str,
        #[source]
        source: policy_core::PolicyError,
    },
    /// A policy returned no worker although every worker was a candidate.
    #[error("policy {policy} selected no worker for request {request}")]
    NoWorker { policy: &'static str, request: u64 },
    /// An output file or directory could not be written.
    #[error("could not write {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A plot could not be drawn.
    #[error("could not draw {path}")]
    Plot {
        path: PathBuf,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// JSON encoding of the report failed.
    #[error("json encoding failed")]
    Json(#[from] serde_json::Error),
    /// The simulation ran out of events before every request finished.
    #[error("the simulation stalled with {finished} of {total} requests finished")]
    Stalled { finished: usize, total: usize },
    /// A simulation thread panicked.
    #[error("a simulation thread panicked")]
    ThreadPanicked,
    /// No scenario to run.
    #[error("no scenario files found in {dir}")]
    NoScenarios { dir: PathBuf },
}
