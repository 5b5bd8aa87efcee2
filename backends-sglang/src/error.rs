use load_protocols::{LoadValidationError, PrometheusParseError};
use thiserror::Error;

/// Why a `/metrics` text gave no SGLang load report.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum MetricsError {
    /// The text is not valid Prometheus exposition format.
    #[error("could not parse the prometheus text")]
    Parse(#[from] PrometheusParseError),
    /// The text holds none of SGLang's load gauges (`sglang:` or `sglang_`
    /// prefixed `num_running_reqs`, `num_queue_reqs`, `token_usage`, …), as
    /// when the server runs without `--enable-metrics`.
    #[error("no sglang load gauges in the metrics")]
    NoLoadGauges,
    /// The gauges held impossible values.
    #[error("invalid sglang load gauges")]
    Invalid(#[from] LoadValidationError),
}
