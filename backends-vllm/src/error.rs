use load_protocols::{LoadValidationError, PrometheusParseError};
use thiserror::Error;

/// Why a vLLM `/metrics` text could not be turned into a
/// [`WorkerLoad`](load_protocols::WorkerLoad).
///
/// [`VllmMetricsLoadSource`](crate::VllmMetricsLoadSource) reports the first
/// two as [`LoadError::Decode`](policy_core::LoadError::Decode) and the last as
/// [`LoadError::Invalid`](policy_core::LoadError::Invalid).
#[derive(Debug, Clone, PartialEq, Error)]
pub enum VllmMetricsError {
    /// The text is not valid Prometheus exposition format.
    #[error("malformed prometheus text")]
    Parse(#[from] PrometheusParseError),
    /// An engine reported some load gauges but not this one, so its load
    /// cannot be known without inventing a value.
    #[error("engine {engine:?} has no {family} series")]
    MissingSeries {
        family: &'static str,
        engine: String,
    },
    /// The values decoded but are impossible (no engine at all, NaN, infinite
    /// or negative).
    #[error("invalid vllm load values")]
    Invalid(#[from] LoadValidationError),
}
