use thiserror::Error;

/// Why a load report was rejected by [`WorkerLoad::from_ranks`](crate::WorkerLoad::from_ranks).
///
/// A rejected report is treated by the router like a failed poll: the worker
/// keeps serving, scored without a fresh snapshot (`least-load.md`, rule 3).
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
