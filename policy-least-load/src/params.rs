//! The tuning knobs of `least_load` and `power_of_two`, and their validation.

use std::fmt;

use policy_core::{PolicyError, parse_section};
use serde::{Deserialize, Serialize};

/// Which in-flight estimate the score uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InflightMode {
    /// This router's pending work: prompt tokens dispatched whose first token
    /// has not been seen. Needs no reset, so the score does not depend on when
    /// each worker was last polled.
    #[default]
    Pending,
    /// The original estimator, kept so the simulator can compare the two:
    /// tokens dispatched since the worker's last report, reset on receipt.
    SincePoll,
}

impl InflightMode {
    pub fn as_str(self) -> &'static str {
        match self {
            InflightMode::Pending => "pending",
            InflightMode::SincePoll => "since_poll",
        }
    }
}

impl fmt::Display for InflightMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the score divides token-work by: the worker's rate of clearing
/// uncached prompt tokens, tokens/s.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RateMode {
    /// Learned per worker from the router's dispatches (with sync, every
    /// replica's): the work ahead of each request and the time its first
    /// token took (`crate::rate`).
    /// Starts at `default_throughput`.
    #[default]
    Learned,
    /// The worker's reported generation rate (SGLang's `gen_throughput`), the
    /// original design's divisor; `default_throughput` where none is
    /// reported. A decode rate that rises with the batch.
    Reported,
    /// `default_throughput` for every worker.
    Fixed,
}

impl RateMode {
    pub fn as_str(self) -> &'static str {
        match self {
            RateMode::Learned => "learned",
            RateMode::Reported => "reported",
            RateMode::Fixed => "fixed",
        }
    }
}

impl fmt::Display for RateMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The knobs, each settable from the policy's config section.
///
/// The field names are the config keys; their units and ranges are in
/// `docs/least-load.md` ("Settings"). Build one through [`LeastLoadParams::from_section`] or
/// [`LeastLoadParams::validate`]: deserializing runs the same checks.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "RawParams")]
pub struct LeastLoadParams {
    /// Seconds added per unit of `k / (1 - k)` (KV-cache pressure). Finite, ≥ 0.
    pub kv_pressure_weight: f64,
    /// Tokens per second assumed when a worker reports no generation rate.
    /// Finite, > 0.
    pub default_throughput: f64,
    /// Tokens per request (p̄): the size of a waiting request when the queue is
    /// only reported in requests, and of a request of unknown size. ≥ 1.
    pub mean_prefill_tokens: u64,
    /// Skip a worker once its estimated waiting requests reach this; 0 = off.
    pub max_waiting_requests: u64,
    pub inflight: InflightMode,
    /// Scores within this many seconds of the best count as tied, and ties go
    /// to the worker this router dispatched to least recently. The snapshot
    /// terms are up to a poll interval old, so smaller differences are noise,
    /// and chasing them herds requests onto whichever worker looked emptiest
    /// at the last poll. 0 keeps exact ties only. Finite, ≥ 0.
    pub tie_tolerance_secs: f64,
    /// The divisor: `learned` (the default), `reported` or `fixed`. The
    /// original `use_reported_throughput = true | false` key is still read,
    /// as `reported` | `fixed`.
    pub rate: RateMode,
    /// How fast a learned rate forgets: a sample's weight halves every this
    /// many seconds, so a worker that slows down or speeds up is followed
    /// within a few half-lives of traffic. Idle time changes nothing: with no
    /// new samples, old ones keep their relative weights. Finite, > 0.
    pub rate_half_life_secs: f64,
    /// A learned rate within this fraction of the fleet's (the geometric
    /// mean of every learned rate) counts as the fleet's. Workers of one
    /// build on one kind of GPU learn rates a few percent apart from noise
    /// and load alone; scoring those differences would steer long prompts
    /// to whichever looks fastest and load it unevenly. Real differences
    /// (another GPU, a degraded engine) are larger and count in full.
    /// Finite, in `[0, 1)`; 0 trusts every difference.
    pub rate_deadband_ratio: f64,
    /// Prefix affinity: the request's own tokens on a worker are only those
    /// the worker is not expected to hold in its prefix cache, from a
    /// router-side index of the block hashes dispatched to it. Applies under
    /// `rate = "learned"` (the other rates count no own tokens).
    pub prefix_affinity: bool,
    /// The index's granularity, tokens: the request's chained block hashes
    /// are read every this many tokens (rounded up to whole blocks). ≥ 1.
    pub prefix_index_block_tokens: u64,
    /// Tokens of prompt each worker's prefix cache is assumed to hold: a
    /// block is forgotten once this many newer tokens were dispatched to
    /// the worker (least recently used first). ≥ 1.
    pub prefix_cache_tokens: u64,
    /// Blocks the index holds in all at most (about 80 bytes each); the
    /// least recently used go first. ≥ 16.
    pub prefix_index_max_blocks: u64,
    /// A block not dispatched for this long is forgotten. Finite, > 0.
    pub prefix_max_age_secs: f64,
    /// What a prefix miss costs beyond this request's own wait, per token
    /// the best-placed worker would not have recomputed: sending a request
    /// away from the worker holding its prefix makes the fleet compute
    /// those tokens again (and evict something else to hold them), which
    /// every later request waits for. 0 counts only the request's own
    /// wait. Finite, ≥ 0.
    pub prefix_miss_weight: f64,
    /// How much the miss charge grows when the whole fleet is busy: the
    /// weight becomes `prefix_miss_weight + prefix_congestion_weight ×
    /// floor_wait / own_prefill`, where `floor_wait` is the least queued
    /// wait of any candidate and `own_prefill` the request's whole prompt at
    /// the fleet's rate. With a worker idle a miss only costs its own
    /// recompute; with every worker queued it takes capacity from requests
    /// already waiting, and a fixed charge would let deepening queues
    /// trigger ever more misses. 0 keeps the charge fixed. Finite, ≥ 0.
    pub prefix_congestion_weight: f64,
}

impl Default for LeastLoadParams {
    fn default() -> LeastLoadParams {
        LeastLoadParams {
            kv_pressure_weight: 0.15,
            default_throughput: 2000.0,
            mean_prefill_tokens: 1024,
            max_waiting_requests: 0,
            inflight: InflightMode::Pending,
            tie_tolerance_secs: 0.01,
            rate: RateMode::Learned,
            rate_half_life_secs: 30.0,
            rate_deadband_ratio: 0.1,
            prefix_affinity: true,
            prefix_index_block_tokens: 256,
            prefix_cache_tokens: 400_000,
            prefix_index_max_blocks: 131_072,
            prefix_max_age_secs: 3600.0,
            prefix_miss_weight: 1.0,
            prefix_congestion_weight: 4.0,
        }
    }
}

impl LeastLoadParams {
    /// Reads and validates a config section (`null` or `{}` = all defaults).
    /// `policy` names the section in errors (`least_load`, `power_of_two`).
    pub fn from_section(
        policy: &str,
        section: &serde_json::Value,
    ) -> Result<LeastLoadParams, PolicyError> {
        let raw: RawParams = parse_section(policy, section)?;
        raw.validate(policy)
    }

    /// Checks every knob against its valid range.
    pub fn validate(self, policy: &str) -> Result<LeastLoadParams, PolicyError> {
        RawParams::from(self).validate(policy)
    }

    /// The section these knobs would be read from.
    pub fn to_section(&self) -> serde_json::Value {
        serde_json::json!({
            "kv_pressure_weight": self.kv_pressure_weight,
            "default_throughput": self.default_throughput,
            "mean_prefill_tokens": self.mean_prefill_tokens,
            "max_waiting_requests": self.max_waiting_requests,
            "inflight": self.inflight.as_str(),
            "tie_tolerance_secs": self.tie_tolerance_secs,
            "rate": self.rate.as_str(),
            "rate_half_life_secs": self.rate_half_life_secs,
            "rate_deadband_ratio": self.rate_deadband_ratio,
            "prefix_affinity": self.prefix_affinity,
            "prefix_index_block_tokens": self.prefix_index_block_tokens,
            "prefix_cache_tokens": self.prefix_cache_tokens,
            "prefix_index_max_blocks": self.prefix_index_max_blocks,
            "prefix_max_age_secs": self.prefix_max_age_secs,
            "prefix_miss_weight": self.prefix_miss_weight,
            "prefix_congestion_weight": self.prefix_congestion_weight,
        })
    }
}

/// The section as written, before validation: integers signed and the mode a
/// string, so that a negative count or an unknown mode is reported as an
/// invalid value of its key rather than as a parse error.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawParams {
    kv_pressure_weight: f64,
    default_throughput: f64,
    mean_prefill_tokens: i64,
    max_waiting_requests: i64,
    inflight: String,
    tie_tolerance_secs: f64,
    rate: Option<String>,
    rate_half_life_secs: f64,
    rate_deadband_ratio: f64,
    prefix_affinity: bool,
    prefix_index_block_tokens: i64,
    prefix_cache_tokens: i64,
    prefix_index_max_blocks: i64,
    prefix_max_age_secs: f64,
    prefix_miss_weight: f64,
    prefix_congestion_weight: f64,
    /// The original key: `true` is `rate = "reported"`, `false` is
    /// `rate = "fixed"`; giving both keys is an error.
    use_reported_throughput: Option<bool>,
}

impl Default for RawParams {
    fn default() -> RawParams {
        let mut raw = RawParams::from(LeastLoadParams::default());
        // `rate` unset, so the older key may stand in for it.
        raw.rate = None;
        raw
    }
}

impl From<LeastLoadParams> for RawParams {
    fn from(params: LeastLoadParams) -> RawParams {
        RawParams {
            kv_pressure_weight: params.kv_pressure_weight,
            default_throughput: params.default_throughput,
            mean_prefill_tokens: i64::try_from(params.mean_prefill_tokens).unwrap_or(i64::MAX),
            max_waiting_requests: i64::try_from(params.max_waiting_requests).unwrap_or(i64::MAX),
            inflight: params.inflight.as_str().to_owned(),
            tie_tolerance_secs: params.tie_tolerance_secs,
            rate: Some(params.rate.as_str().to_owned()),
            rate_half_life_secs: params.rate_half_life_secs,
            rate_deadband_ratio: params.rate_deadband_ratio,
            prefix_affinity: params.prefix_affinity,
            prefix_index_block_tokens: i64::try_from(params.prefix_index_block_tokens)
                .unwrap_or(i64::MAX),
            prefix_cache_tokens: i64::try_from(params.prefix_cache_tokens).unwrap_or(i64::MAX),
            prefix_index_max_blocks: i64::try_from(params.prefix_index_max_blocks)
                .unwrap_or(i64::MAX),
            prefix_max_age_secs: params.prefix_max_age_secs,
            prefix_miss_weight: params.prefix_miss_weight,
            prefix_congestion_weight: params.prefix_congestion_weight,
            use_reported_throughput: None,
        }
    }
}

impl TryFrom<RawParams> for LeastLoadParams {
    type Error = PolicyError;

    fn try_from(raw: RawParams) -> Result<LeastLoadParams, PolicyError> {
        raw.validate("least_load")
    }
}

impl RawParams {
    fn validate(self, policy: &str) -> Result<LeastLoadParams, PolicyError> {
        let invalid = |key: &'static str, value: String, allowed: &'static str| {
            PolicyError::InvalidParameter {
                policy: policy.to_owned(),
                key,
                value,
                allowed,
            }
        };
        if !(self.kv_pressure_weight.is_finite() && self.kv_pressure_weight >= 0.0) {
            return Err(invalid(
                "kv_pressure_weight",
                self.kv_pressure_weight.to_string(),
                "a finite number of seconds >= 0",
            ));
        }
        if !(self.default_throughput.is_finite() && self.default_throughput > 0.0) {
            return Err(invalid(
                "default_throughput",
                self.default_throughput.to_string(),
                "a finite number of tokens/s > 0",
            ));
        }
        let mean_prefill_tokens = u64::try_from(self.mean_prefill_tokens)
            .ok()
            .filter(|tokens| *tokens >= 1)
            .ok_or_else(|| {
                invalid(
                    "mean_prefill_tokens",
                    self.mean_prefill_tokens.to_string(),
                    "an integer >= 1",
                )
            })?;
        let max_waiting_requests = u64::try_from(self.max_waiting_requests).map_err(|_| {
            invalid(
                "max_waiting_requests",
                self.max_waiting_requests.to_string(),
                "an integer >= 0 (0 turns the cap off)",
            )
        })?;
        let inflight = match self.inflight.as_str() {
            "pending" => InflightMode::Pending,
            "since_poll" => InflightMode::SincePoll,
            _ => {
                return Err(invalid(
                    "inflight",
                    format!("{:?}", self.inflight),
                    r#""pending" or "since_poll""#,
                ));
            }
        };
        if !(self.tie_tolerance_secs.is_finite() && self.tie_tolerance_secs >= 0.0) {
            return Err(invalid(
                "tie_tolerance_secs",
                self.tie_tolerance_secs.to_string(),
                "a finite number of seconds >= 0",
            ));
        }
        let rate = match (self.rate.as_deref(), self.use_reported_throughput) {
            (Some(_), Some(legacy)) => {
                return Err(invalid(
                    "use_reported_throughput",
                    legacy.to_string(),
                    "left out when `rate` is set (it is the older spelling of rate = \"reported\" or \"fixed\")",
                ));
            }
            (None, Some(true)) => RateMode::Reported,
            (None, Some(false)) => RateMode::Fixed,
            (None, None) => RateMode::Learned,
            (Some("learned"), None) => RateMode::Learned,
            (Some("reported"), None) => RateMode::Reported,
            (Some("fixed"), None) => RateMode::Fixed,
            (Some(other), None) => {
                return Err(invalid(
                    "rate",
                    format!("{other:?}"),
                    r#""learned", "reported" or "fixed""#,
                ));
            }
        };
        if !(self.rate_half_life_secs.is_finite() && self.rate_half_life_secs > 0.0) {
            return Err(invalid(
                "rate_half_life_secs",
                self.rate_half_life_secs.to_string(),
                "a finite number of seconds > 0",
            ));
        }
        if !(self.rate_deadband_ratio.is_finite() && (0.0..1.0).contains(&self.rate_deadband_ratio))
        {
            return Err(invalid(
                "rate_deadband_ratio",
                self.rate_deadband_ratio.to_string(),
                "a finite ratio in [0, 1)",
            ));
        }
        let at_least = |key: &'static str, value: i64, min: u64, allowed: &'static str| {
            u64::try_from(value)
                .ok()
                .filter(|v| *v >= min)
                .ok_or_else(|| invalid(key, value.to_string(), allowed))
        };
        let prefix_index_block_tokens = at_least(
            "prefix_index_block_tokens",
            self.prefix_index_block_tokens,
            1,
            "an integer number of tokens >= 1",
        )?;
        let prefix_cache_tokens = at_least(
            "prefix_cache_tokens",
            self.prefix_cache_tokens,
            1,
            "an integer number of tokens >= 1",
        )?;
        let prefix_index_max_blocks = at_least(
            "prefix_index_max_blocks",
            self.prefix_index_max_blocks,
            16,
            "an integer number of blocks >= 16",
        )?;
        if !(self.prefix_max_age_secs.is_finite() && self.prefix_max_age_secs > 0.0) {
            return Err(invalid(
                "prefix_max_age_secs",
                self.prefix_max_age_secs.to_string(),
                "a finite number of seconds > 0",
            ));
        }
        for (key, weight) in [
            ("prefix_miss_weight", self.prefix_miss_weight),
            ("prefix_congestion_weight", self.prefix_congestion_weight),
        ] {
            if !(weight.is_finite() && weight >= 0.0) {
                return Err(invalid(key, weight.to_string(), "a finite number >= 0"));
            }
        }
        Ok(LeastLoadParams {
            prefix_affinity: self.prefix_affinity,
            prefix_miss_weight: self.prefix_miss_weight,
            prefix_congestion_weight: self.prefix_congestion_weight,
            prefix_index_block_tokens,
            prefix_cache_tokens,
            prefix_index_max_blocks,
            prefix_max_age_secs: self.prefix_max_age_secs,
            kv_pressure_weight: self.kv_pressure_weight,
            default_throughput: self.default_throughput,
            mean_prefill_tokens,
            max_waiting_requests,
            inflight,
            tie_tolerance_secs: self.tie_tolerance_secs,
            rate,
            rate_half_life_secs: self.rate_half_life_secs,
            rate_deadband_ratio: self.rate_deadband_ratio,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::error::Error as _;

    #[test]
    fn null_and_empty_sections_give_the_spec_defaults() {
        for section in [serde_json::Value::Null, json!({})] {
            let params = LeastLoadParams::from_section("least_load", &section).unwrap();
            assert_eq!(params, LeastLoadParams::default());
        }
        let defaults = LeastLoadParams::default();
        assert_eq!(defaults.kv_pressure_weight, 0.15);
        assert_eq!(defaults.default_throughput, 2000.0);
        assert_eq!(defaults.mean_prefill_tokens, 1024);
        assert_eq!(defaults.max_waiting_requests, 0);
        assert_eq!(defaults.inflight, InflightMode::Pending);
        assert_eq!(defaults.tie_tolerance_secs, 0.01);
        assert_eq!(defaults.rate, RateMode::Learned);
        assert_eq!(defaults.rate_half_life_secs, 30.0);
        assert_eq!(defaults.rate_deadband_ratio, 0.1);
    }

    #[test]
    fn every_knob_is_read() {
        let section = json!({
            "kv_pressure_weight": 0.5,
            "default_throughput": 1500.0,
            "mean_prefill_tokens": 200,
            "max_waiting_requests": 8,
            "inflight": "since_poll",
            "tie_tolerance_secs": 0.0,
            "rate": "fixed",
            "rate_half_life_secs": 5.0,
            "rate_deadband_ratio": 0.25,
            "prefix_affinity": false,
            "prefix_index_block_tokens": 128,
            "prefix_cache_tokens": 1000,
            "prefix_index_max_blocks": 64,
            "prefix_max_age_secs": 5.0,
            "prefix_miss_weight": 0.5,
            "prefix_congestion_weight": 0.0,
        });
        let params = LeastLoadParams::from_section("least_load", &section).unwrap();
        assert_eq!(
            params,
            LeastLoadParams {
                kv_pressure_weight: 0.5,
                default_throughput: 1500.0,
                mean_prefill_tokens: 200,
                max_waiting_requests: 8,
                inflight: InflightMode::SincePoll,
                tie_tolerance_secs: 0.0,
                rate: RateMode::Fixed,
                rate_half_life_secs: 5.0,
                rate_deadband_ratio: 0.25,
                prefix_affinity: false,
                prefix_index_block_tokens: 128,
                prefix_cache_tokens: 1000,
                prefix_index_max_blocks: 64,
                prefix_max_age_secs: 5.0,
                prefix_miss_weight: 0.5,
                prefix_congestion_weight: 0.0,
            }
        );
        // The section round-trips.
        assert_eq!(
            LeastLoadParams::from_section("least_load", &params.to_section()).unwrap(),
            params
        );
    }

    #[test]
    fn invalid_values_name_the_key_the_value_and_the_range() {
        let cases = [
            (
                json!({"kv_pressure_weight": -0.1}),
                "least_load.kv_pressure_weight = -0.1 is invalid: must be a finite number of seconds >= 0",
            ),
            (
                json!({"default_throughput": 0.0}),
                "least_load.default_throughput = 0 is invalid: must be a finite number of tokens/s > 0",
            ),
            (
                json!({"default_throughput": -5}),
                "least_load.default_throughput = -5 is invalid: must be a finite number of tokens/s > 0",
            ),
            (
                json!({"mean_prefill_tokens": 0}),
                "least_load.mean_prefill_tokens = 0 is invalid: must be an integer >= 1",
            ),
            (
                json!({"max_waiting_requests": -1}),
                "least_load.max_waiting_requests = -1 is invalid: must be an integer >= 0 (0 turns the cap off)",
            ),
            (
                json!({"tie_tolerance_secs": -0.001}),
                "least_load.tie_tolerance_secs = -0.001 is invalid: must be a finite number of seconds >= 0",
            ),
            (
                json!({"rate": "decode"}),
                r#"least_load.rate = "decode" is invalid: must be "learned", "reported" or "fixed""#,
            ),
            (
                json!({"rate": "fixed", "use_reported_throughput": false}),
                r#"least_load.use_reported_throughput = false is invalid: must be left out when `rate` is set (it is the older spelling of rate = "reported" or "fixed")"#,
            ),
            (
                json!({"rate_half_life_secs": 0}),
                "least_load.rate_half_life_secs = 0 is invalid: must be a finite number of seconds > 0",
            ),
            (
                json!({"prefix_index_block_tokens": 0}),
                "least_load.prefix_index_block_tokens = 0 is invalid: must be an integer number of tokens >= 1",
            ),
            (
                json!({"prefix_cache_tokens": -5}),
                "least_load.prefix_cache_tokens = -5 is invalid: must be an integer number of tokens >= 1",
            ),
            (
                json!({"prefix_index_max_blocks": 3}),
                "least_load.prefix_index_max_blocks = 3 is invalid: must be an integer number of blocks >= 16",
            ),
            (
                json!({"prefix_miss_weight": -1.0}),
                "least_load.prefix_miss_weight = -1 is invalid: must be a finite number >= 0",
            ),
            (
                json!({"prefix_congestion_weight": -0.5}),
                "least_load.prefix_congestion_weight = -0.5 is invalid: must be a finite number >= 0",
            ),
            (
                json!({"prefix_max_age_secs": 0.0}),
                "least_load.prefix_max_age_secs = 0 is invalid: must be a finite number of seconds > 0",
            ),
            (
                json!({"rate_deadband_ratio": 1.0}),
                "least_load.rate_deadband_ratio = 1 is invalid: must be a finite ratio in [0, 1)",
            ),
            (
                json!({"rate_deadband_ratio": -0.1}),
                "least_load.rate_deadband_ratio = -0.1 is invalid: must be a finite ratio in [0, 1)",
            ),
            (
                json!({"inflight": "since-poll"}),
                r#"least_load.inflight = "since-poll" is invalid: must be "pending" or "since_poll""#,
            ),
        ];
        for (section, message) in cases {
            let err = LeastLoadParams::from_section("least_load", &section).unwrap_err();
            assert!(
                matches!(err, PolicyError::InvalidParameter { .. }),
                "{err:?}"
            );
            assert_eq!(err.to_string(), message);
        }
    }

    #[test]
    fn non_finite_values_built_in_code_are_rejected() {
        for weight in [f64::NAN, f64::INFINITY] {
            let params = LeastLoadParams {
                kv_pressure_weight: weight,
                ..LeastLoadParams::default()
            };
            assert!(params.validate("power_of_two").is_err());
        }
        let params = LeastLoadParams {
            prefix_congestion_weight: f64::NAN,
            ..LeastLoadParams::default()
        };
        let err = params.validate("least_load").unwrap_err();
        assert_eq!(
            err.to_string(),
            "least_load.prefix_congestion_weight = NaN is invalid: must be a finite number >= 0"
        );
        let params = LeastLoadParams {
            default_throughput: f64::NAN,
            ..LeastLoadParams::default()
        };
        let err = params.validate("power_of_two").unwrap_err();
        assert_eq!(
            err.to_string(),
            "power_of_two.default_throughput = NaN is invalid: must be a finite number of tokens/s > 0"
        );
    }

    #[test]
    fn the_original_rate_key_still_reads() {
        for (legacy, rate) in [(true, RateMode::Reported), (false, RateMode::Fixed)] {
            let section = json!({ "use_reported_throughput": legacy });
            let params = LeastLoadParams::from_section("least_load", &section).unwrap();
            assert_eq!(params.rate, rate);
        }
    }

    #[test]
    fn unknown_keys_are_rejected() {
        let err =
            LeastLoadParams::from_section("least_load", &json!({"kv_weight": 1.0})).unwrap_err();
        assert_eq!(err.to_string(), "invalid [least_load] section");
        let cause = err.source().unwrap().to_string();
        assert!(cause.contains("unknown field `kv_weight`"), "{cause}");
    }

    #[test]
    fn deserializing_validates_too() {
        let bad: Result<LeastLoadParams, _> =
            serde_json::from_value(json!({"mean_prefill_tokens": 0}));
        assert!(bad.is_err());
        let good: LeastLoadParams =
            serde_json::from_value(json!({"inflight": "since_poll"})).unwrap();
        assert_eq!(good.inflight, InflightMode::SincePoll);
    }
}
