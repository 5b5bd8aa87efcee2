use thiserror::Error;

/// Why a load report was rejected by [`WorkerLoad::from_ranks`](crate::WorkerLoad::from_ranks).
///
/// A rejected report is treated by the router like a failed poll: the worker
/// keeps serving, scored without a fresh snapshot (`docs/least-load.md`, rule 3).
#[derive(Debug, Clone, PartialEq, Error)]
pub enum LoadValidationError {
    /// The report held no DP rank at all (an encode-only worker, say).
    #[error("load report has no dp ranks")]
    NoRanks,
    /// A request or token count was below zero.
    #[error("dp rank {dp_rank}: {field} is negative ({value})")]
    NegativeCount {
        dp_rank: i64,
        field: &'static str,
        value: i64,
    },
    /// KV-cache usage was NaN or infinite.
    #[error("dp rank {dp_rank}: {field} is not a finite number ({value})")]
    NonFinite {
        dp_rank: i64,
        field: &'static str,
        value: f64,
    },
    /// KV-cache usage was below zero.
    #[error("dp rank {dp_rank}: {field} is negative ({value})")]
    NegativeRatio {
        dp_rank: i64,
        field: &'static str,
        value: f64,
    },
}

/// Why a Prometheus text exposition could not be parsed by
/// [`parse_prometheus_text`](crate::parse_prometheus_text).
///
/// The parser is strict: one malformed line rejects the whole text, as
/// Prometheus itself rejects the scrape.
#[derive(Debug, Clone, PartialEq, Error)]
#[error("prometheus text line {line}: {reason}")]
pub struct PrometheusParseError {
    /// 1-based line number of the offending line.
    pub line: usize,
    /// What was wrong with it.
    pub reason: PrometheusParseReason,
}

/// What was wrong with one line of Prometheus text.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PrometheusParseReason {
    /// A metric name was empty or held a character outside `[a-zA-Z0-9_:]`
    /// (or began with a digit).
    #[error("invalid metric name {0:?}")]
    InvalidMetricName(String),
    /// A label name was empty or held a character outside `[a-zA-Z0-9_]`
    /// (or began with a digit).
    #[error("invalid label name {0:?}")]
    InvalidLabelName(String),
    /// A specific character was required here.
    #[error("expected {expected:?}, found {found}")]
    Expected {
        expected: char,
        /// What stood there instead, or `end of line`.
        found: String,
    },
    /// A label value's closing quote never came.
    #[error("unterminated label value")]
    UnterminatedLabelValue,
    /// A backslash followed by something other than `\`, `"` or `n`.
    #[error("invalid escape sequence \\{0}")]
    InvalidEscape(String),
    /// The same label name appeared twice in one sample.
    #[error("duplicate label {0:?}")]
    DuplicateLabel(String),
    /// A sample line ended before its value.
    #[error("missing sample value")]
    MissingValue,
    /// The value was not a float (`NaN`, `+Inf` and `-Inf` are floats).
    #[error("invalid sample value {0:?}")]
    InvalidValue(String),
    /// The token after the value was not an integer millisecond timestamp.
    #[error("invalid timestamp {0:?}")]
    InvalidTimestamp(String),
    /// Something followed the timestamp (or a `# TYPE` line's type).
    #[error("unexpected trailing text {0:?}")]
    TrailingText(String),
    /// A `# TYPE` line named no type or one outside counter, gauge, histogram,
    /// summary and untyped.
    #[error("invalid metric type {0:?}")]
    InvalidType(String),
}
