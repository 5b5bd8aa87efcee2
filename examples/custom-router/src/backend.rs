//! The `jsonstats` backend: an engine that reports its load as a small JSON
//! document of its own design at `GET /stats`:
//!
//! ```json
//! {"queue": {"requests": 3, "prompt_tokens": 1200},
//!  "running": 5,
//!  "kv_cache": {"used_blocks": 100, "total_blocks": 1000},
//!  "decode_tps": 850.0}
//! ```
//!
//! A backend is three things: the report's type ([`JsonStats`]), a pure
//! conversion into the router's validated [`WorkerLoad`]
//! ([`worker_load_from_stats`], [`worker_load_from_stats_json`]), and a
//! [`LoadSource`] that fetches the report ([`JsonStatsLoadSource`]).
//! [`register_backend`] adds it to a [`BackendRegistry`] by name.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use load_protocols::{LoadValidationError, SchedulerLoadSnapshot, WorkerLoad};
// The HTTP helpers every built-in HTTP source uses: the address check, the
// pooled GET with bearer header, status, content type and body cap.
use load_transport::http::{ReportClient, ReportFormat, ReportUrl, http_base};
use policy_core::{
    BackendError, BackendRegistry, LoadAddress, LoadError, LoadSource, SourceOptions,
};
use serde::{Deserialize, Serialize};

/// The backend's registry name: `backend = "jsonstats"` in a worker entry.
pub const BACKEND_NAME: &str = "jsonstats";

/// Where a `jsonstats` engine serves its report, under the load address.
pub const STATS_PATH: &str = "/stats";

/// One `GET /stats` report. Unknown keys are ignored, so an engine may add
/// fields; the four sections must be present (`prompt_tokens` and
/// `decode_tps` may be left out by engines that do not measure them).
///
/// Counts are `i64` so that a negative count parses and is rejected by name
/// in [`worker_load_from_stats`], rather than failing as a parse error.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JsonStats {
    pub queue: QueueStats,
    /// Requests being decoded.
    pub running: i64,
    pub kv_cache: KvCacheStats,
    /// The engine's decode rate, tokens per second; `None` when not measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_tps: Option<f64>,
}

/// The engine's waiting queue.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QueueStats {
    /// Requests waiting to be scheduled.
    pub requests: i64,
    /// Prompt tokens of those requests; `None` when not counted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens: Option<i64>,
}

/// KV-cache occupancy, in the engine's blocks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KvCacheStats {
    pub used_blocks: i64,
    pub total_blocks: i64,
}

/// Why a `/stats` body is not a usable load report.
#[derive(Debug, thiserror::Error)]
pub enum JsonStatsError {
    /// Not JSON, or JSON of another shape (a section missing, a count that
    /// is not an integer). Python's `json.dumps` writes a NaN rate as the
    /// bare word `NaN`, which is not JSON: such a body is malformed too.
    #[error("not a jsonstats report")]
    Malformed(#[source] serde_json::Error),
    /// The report parsed but holds an impossible value: a negative count
    /// ([`LoadValidationError::NegativeCount`]), a NaN or infinite rate or
    /// KV usage ([`LoadValidationError::NonFinite`]), a negative rate
    /// ([`LoadValidationError::NegativeRatio`]). `field` is the report's own
    /// key (`queue.requests`, `decode_tps`, …).
    #[error("invalid jsonstats report")]
    Invalid(#[source] LoadValidationError),
}

impl JsonStatsError {
    /// The poll error this is, for the load source at `url`.
    pub fn into_load_error(self, url: &str) -> LoadError {
        match self {
            JsonStatsError::Malformed(source) => LoadError::Decode {
                url: url.to_owned(),
                source: Box::new(source),
            },
            JsonStatsError::Invalid(source) => LoadError::Invalid {
                url: url.to_owned(),
                source,
            },
        }
    }
}

/// Parses and converts one `/stats` body.
pub fn worker_load_from_stats_json(body: &[u8]) -> Result<WorkerLoad, JsonStatsError> {
    let stats: JsonStats = serde_json::from_slice(body).map_err(JsonStatsError::Malformed)?;
    worker_load_from_stats(&stats)
}

/// Converts a report into the router's [`WorkerLoad`]: one DP rank, shaped
/// like SGLang's `/v1/loads` rank, which every policy reads.
///
/// - `queue.requests` → `num_waiting_reqs`; `queue.prompt_tokens` →
///   `num_waiting_uncached_tokens` (the engine has no prefix cache to
///   discount, so every queued prompt token is work still to do);
/// - `running` → `num_running_reqs`; the two summed → `num_total_reqs`;
/// - `kv_cache.used_blocks / kv_cache.total_blocks` → `token_usage` (an
///   engine with no blocks yet, `0 / 0`, reports 0; above 1 is clamped to 1);
/// - `decode_tps` → `gen_throughput`.
///
/// Stricter than [`WorkerLoad::from_ranks`] alone: a NaN, infinite or
/// negative `decode_tps` is an error here, where `from_ranks` would quietly
/// drop it to "not reported"; errors name the report's own keys.
pub fn worker_load_from_stats(stats: &JsonStats) -> Result<WorkerLoad, JsonStatsError> {
    let invalid = JsonStatsError::Invalid;
    let counts = [
        ("queue.requests", stats.queue.requests),
        (
            "queue.prompt_tokens",
            stats.queue.prompt_tokens.unwrap_or(0),
        ),
        ("running", stats.running),
        ("kv_cache.used_blocks", stats.kv_cache.used_blocks),
        ("kv_cache.total_blocks", stats.kv_cache.total_blocks),
    ];
    if let Some(&(field, value)) = counts.iter().find(|(_, value)| *value < 0) {
        return Err(invalid(LoadValidationError::NegativeCount {
            dp_rank: 0,
            field,
            value,
        }));
    }
    if let Some(rate) = stats.decode_tps {
        if !rate.is_finite() {
            return Err(invalid(LoadValidationError::NonFinite {
                dp_rank: 0,
                field: "decode_tps",
                value: rate,
            }));
        }
        if rate < 0.0 {
            return Err(invalid(LoadValidationError::NegativeRatio {
                dp_rank: 0,
                field: "decode_tps",
                value: rate,
            }));
        }
    }
    let KvCacheStats {
        used_blocks,
        total_blocks,
    } = stats.kv_cache;
    let kv_usage_ratio = match (used_blocks, total_blocks) {
        (0, 0) => 0.0,
        (used, total) => used as f64 / total as f64,
    };
    if !kv_usage_ratio.is_finite() {
        // Blocks in use out of none.
        return Err(invalid(LoadValidationError::NonFinite {
            dp_rank: 0,
            field: "kv_cache.used_blocks / kv_cache.total_blocks",
            value: kv_usage_ratio,
        }));
    }
    let rank = SchedulerLoadSnapshot {
        dp_rank: 0,
        num_running_reqs: stats.running,
        num_waiting_reqs: stats.queue.requests,
        num_waiting_uncached_tokens: stats.queue.prompt_tokens,
        num_total_reqs: stats.running.saturating_add(stats.queue.requests),
        token_usage: kv_usage_ratio,
        gen_throughput: stats.decode_tps,
        ..SchedulerLoadSnapshot::default()
    };
    // The router's own checks run too: nothing unvalidated reaches a policy.
    WorkerLoad::from_ranks(vec![rank]).map_err(invalid)
}

/// Polls one `jsonstats` engine: `GET {base}/stats`, JSON only.
///
/// Built on `load_transport::http`, so addresses, the API key, statuses,
/// content types and the body cap are checked exactly as for the built-in
/// HTTP backends; the whole poll runs under the deadline of
/// [`SourceOptions`].
#[derive(Debug)]
pub struct JsonStatsLoadSource {
    client: ReportClient,
    base_url: String,
    stats_url: ReportUrl,
    deadline: Duration,
}

impl JsonStatsLoadSource {
    /// A source polling `base_url` (`http://host:port` or
    /// `https://host:port`, optionally with a path prefix; a trailing `/` is
    /// ignored).
    ///
    /// Fails with [`BackendError::InvalidAddress`] for anything but an
    /// `http://` or `https://` URL with a host, and with
    /// [`BackendError::Client`] for an API key that cannot be a header value
    /// or an `https://` trust that cannot be loaded.
    pub fn new(
        base_url: &str,
        options: &SourceOptions,
    ) -> Result<JsonStatsLoadSource, BackendError> {
        let base_url = http_base(base_url)?;
        Ok(JsonStatsLoadSource {
            client: ReportClient::new(&base_url, options)?,
            stats_url: ReportUrl::new(
                &base_url,
                STATS_PATH,
                ReportFormat::Json,
                STATS_PATH,
                options,
            )?,
            base_url,
            deadline: options.deadline,
        })
    }

    async fn poll(&self) -> Result<Option<WorkerLoad>, LoadError> {
        let body = self.client.get(&self.stats_url).await?;
        worker_load_from_stats_json(&body)
            .map(Some)
            .map_err(|error| error.into_load_error(self.stats_url.as_str()))
    }
}

#[async_trait]
impl LoadSource for JsonStatsLoadSource {
    async fn fetch(&self) -> Result<Option<WorkerLoad>, LoadError> {
        tokio::time::timeout(self.deadline, self.poll())
            .await
            .unwrap_or_else(|_elapsed| {
                Err(LoadError::Timeout {
                    url: self.base_url.clone(),
                    deadline: self.deadline,
                })
            })
    }

    fn kind(&self) -> &'static str {
        BACKEND_NAME
    }

    fn load_url(&self) -> &str {
        &self.base_url
    }
}

/// Registers `jsonstats`: load over HTTP, at the worker's own address or at
/// an optional separate `http://` load address (`load_url`).
pub fn register_backend(registry: &mut BackendRegistry) {
    registry.register(BACKEND_NAME, LoadAddress::Http, |spec| {
        let base = spec.load_url.as_deref().unwrap_or(&spec.worker_url);
        let source = JsonStatsLoadSource::new(base, &spec.options)?;
        Ok(Arc::new(source) as Arc<dyn LoadSource>)
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use policy_core::BackendSpec;

    fn stats() -> JsonStats {
        JsonStats {
            queue: QueueStats {
                requests: 3,
                prompt_tokens: Some(1200),
            },
            running: 5,
            kv_cache: KvCacheStats {
                used_blocks: 100,
                total_blocks: 1000,
            },
            decode_tps: Some(850.0),
        }
    }

    #[test]
    fn a_report_converts_field_by_field() {
        let body = br#"{"queue": {"requests": 3, "prompt_tokens": 1200}, "running": 5,
            "kv_cache": {"used_blocks": 100, "total_blocks": 1000}, "decode_tps": 850.0,
            "engine_version": "ignored"}"#;
        let load = worker_load_from_stats_json(body).unwrap();
        assert_eq!(load.waiting_requests(), 3);
        assert_eq!(load.queued_tokens(), Some(1200));
        assert_eq!(load.running_requests(), 5);
        assert_eq!(load.throughput_tps(), Some(850.0));
        assert!((load.kv_usage_ratio() - 0.1).abs() < 1e-12);
        assert_eq!(load.ranks()[0].num_total_reqs, 8);
        assert_eq!(
            worker_load_from_stats(&stats()).unwrap(),
            load,
            "the body and the struct convert alike"
        );
    }

    #[test]
    fn signals_not_measured_stay_not_reported() {
        let mut partial = stats();
        partial.queue.prompt_tokens = None;
        partial.decode_tps = None;
        partial.kv_cache = KvCacheStats {
            used_blocks: 0,
            total_blocks: 0,
        };
        let load = worker_load_from_stats(&partial).unwrap();
        assert_eq!(load.queued_tokens(), None);
        assert_eq!(load.throughput_tps(), None);
        assert_eq!(load.kv_usage_ratio(), 0.0);
        let body = br#"{"queue": {"requests": 0}, "running": 0,
            "kv_cache": {"used_blocks": 0, "total_blocks": 0}}"#;
        assert_eq!(
            worker_load_from_stats_json(body).unwrap().queued_tokens(),
            None
        );
        // More blocks in use than exist: clamped, as every backend's usage is.
        partial.kv_cache.used_blocks = 2;
        partial.kv_cache.total_blocks = 1;
        assert_eq!(
            worker_load_from_stats(&partial).unwrap().kv_usage_ratio(),
            1.0
        );
    }

    #[test]
    fn malformed_bodies_are_decode_errors() {
        for body in [
            &b"{"[..],
            b"not json",
            b"[]",
            br#"{"queue": {"requests": 1}, "running": 0}"#,
            br#"{"queue": {"requests": 1.5}, "running": 0, "kv_cache": {"used_blocks": 0, "total_blocks": 1}}"#,
            br#"{"queue": {"requests": 1}, "running": 0, "kv_cache": {"used_blocks": 0, "total_blocks": 1}, "decode_tps": NaN}"#,
        ] {
            let error = worker_load_from_stats_json(body).unwrap_err();
            assert!(
                matches!(error, JsonStatsError::Malformed(_)),
                "{}: {error:?}",
                String::from_utf8_lossy(body)
            );
            assert!(matches!(
                error.into_load_error("http://e:1/stats"),
                LoadError::Decode { url, .. } if url == "http://e:1/stats"
            ));
        }
    }

    #[test]
    fn negative_counts_are_rejected_by_their_own_name() {
        type Spoil = fn(&mut JsonStats);
        let cases: [(&str, Spoil); 5] = [
            ("queue.requests", |s| s.queue.requests = -1),
            ("queue.prompt_tokens", |s| s.queue.prompt_tokens = Some(-1)),
            ("running", |s| s.running = -1),
            ("kv_cache.used_blocks", |s| s.kv_cache.used_blocks = -1),
            ("kv_cache.total_blocks", |s| s.kv_cache.total_blocks = -1),
        ];
        for (name, spoil) in cases {
            let mut bad = stats();
            spoil(&mut bad);
            match worker_load_from_stats(&bad) {
                Err(JsonStatsError::Invalid(LoadValidationError::NegativeCount {
                    field,
                    value: -1,
                    ..
                })) => assert_eq!(field, name),
                other => panic!("{name}: {other:?}"),
            }
        }
    }

    #[test]
    fn nan_and_impossible_rates_are_rejected() {
        for rate in [f64::NAN, f64::INFINITY] {
            let mut bad = stats();
            bad.decode_tps = Some(rate);
            assert!(matches!(
                worker_load_from_stats(&bad),
                Err(JsonStatsError::Invalid(LoadValidationError::NonFinite {
                    field: "decode_tps",
                    ..
                }))
            ));
        }
        let mut bad = stats();
        bad.decode_tps = Some(-1.0);
        assert!(matches!(
            worker_load_from_stats(&bad),
            Err(JsonStatsError::Invalid(
                LoadValidationError::NegativeRatio {
                    field: "decode_tps",
                    ..
                }
            ))
        ));
        let mut bad = stats();
        bad.kv_cache.total_blocks = 0;
        let error = worker_load_from_stats(&bad).unwrap_err();
        assert!(matches!(
            error,
            JsonStatsError::Invalid(LoadValidationError::NonFinite { .. })
        ));
        assert!(matches!(
            error.into_load_error("http://e:1/stats"),
            LoadError::Invalid { .. }
        ));
    }

    #[tokio::test]
    async fn the_backend_is_registered_with_checked_addresses() {
        let mut registry = BackendRegistry::new();
        register_backend(&mut registry);
        assert_eq!(registry.load_address(BACKEND_NAME), Some(LoadAddress::Http));
        let source = registry
            .build(BACKEND_NAME, &BackendSpec::new("http://127.0.0.1:9/"))
            .unwrap();
        assert_eq!(source.kind(), "jsonstats");
        assert_eq!(source.load_url(), "http://127.0.0.1:9");
        let separate = BackendSpec::new("http://w:1").with_load_url("http://m:2/engine");
        assert_eq!(
            registry.build(BACKEND_NAME, &separate).unwrap().load_url(),
            "http://m:2/engine"
        );
        for bad in ["127.0.0.1:9", "ftp://w:1", "http://w:1/?x=1"] {
            assert!(
                matches!(
                    registry.build(BACKEND_NAME, &BackendSpec::new(bad)),
                    Err(BackendError::InvalidAddress { .. })
                ),
                "{bad}"
            );
        }
    }
}
