//! vLLM's Prometheus `/metrics` → [`WorkerLoad`], as pure functions.
//!
//! - Every `engine` label value (one per engine / DP rank in vLLM V1; absent
//!   on older servers, which then form one rank) becomes one rank of the
//!   report, numbered by the engine id. [`WorkerLoad`] then sums running and
//!   waiting requests and averages KV usage over them.
//! - Running and waiting come from `vllm:num_requests_running` and
//!   `vllm:num_requests_waiting`, summed over the series of one engine.
//! - KV usage comes from `vllm:kv_cache_usage_perc`, or from the older
//!   `vllm:gpu_cache_usage_perc` when an engine has no V1 series, averaged
//!   over the series of one engine.
//! - Throughput is the rate of `vllm:generation_tokens_total` between two
//!   polls ([`GenerationRate`]); the first poll, a counter reset or a broken
//!   counter give "not reported", never a negative or invented rate.
//! - Queued tokens are not reported (vLLM has no such gauge).
//! - The cache hit rate (informational) is `prefix_cache_hits_total /
//!   prefix_cache_queries_total` since start (V1), or the older
//!   `gpu_prefix_cache_hit_rate` gauge.
//!
//! An engine that reports one load gauge but lacks running, waiting or KV
//! usage is an error ([`VllmMetricsError::MissingSeries`]), never a silent 0.
//! Every other family is ignored.

use std::collections::BTreeMap;
use std::time::Instant;

use load_protocols::{
    LoadValidationError, Sample, SchedulerLoadSnapshot, WorkerLoad, parse_prometheus_text,
};

use crate::VllmMetricsError;

/// Gauge: requests in the running batch, per engine.
pub const NUM_REQUESTS_RUNNING: &str = "vllm:num_requests_running";
/// Gauge: requests waiting to be scheduled, per engine.
pub const NUM_REQUESTS_WAITING: &str = "vllm:num_requests_waiting";
/// Gauge: KV-cache usage in `[0, 1]` (vLLM V1).
pub const KV_CACHE_USAGE_PERC: &str = "vllm:kv_cache_usage_perc";
/// Gauge: KV-cache usage in `[0, 1]` (older servers).
pub const GPU_CACHE_USAGE_PERC: &str = "vllm:gpu_cache_usage_perc";
/// Counter: generated tokens since the engine started.
pub const GENERATION_TOKENS_TOTAL: &str = "vllm:generation_tokens_total";
/// The same counter as some exporters name it, without the `_total` suffix.
pub const GENERATION_TOKENS: &str = "vllm:generation_tokens";
/// Counter: prefix-cache hits, in tokens (V1).
pub const PREFIX_CACHE_HITS_TOTAL: &str = "vllm:prefix_cache_hits_total";
/// Counter: prefix-cache queries, in tokens (V1).
pub const PREFIX_CACHE_QUERIES_TOTAL: &str = "vllm:prefix_cache_queries_total";
/// Gauge: prefix-cache hit rate (older servers).
pub const GPU_PREFIX_CACHE_HIT_RATE: &str = "vllm:gpu_prefix_cache_hit_rate";
/// The label that tells vLLM V1's engines (DP ranks) apart.
pub const ENGINE_LABEL: &str = "engine";

/// The rate of a monotonic counter between two observations.
///
/// Fed `(counter_total, observed_at)` once per poll. The rate is only
/// reported when it can be known:
///
/// - the first observation gives `None` (nothing to compare with);
/// - a counter below the previous reading (the engine restarted) gives `None`
///   and starts over from the new reading;
/// - a NaN, infinite or negative counter gives `None` and forgets the
///   previous reading;
/// - an observation not later than the previous one (overlapping polls
///   completing out of order) gives `None` and is ignored.
///
/// ```
/// use std::time::{Duration, Instant};
/// use backends_vllm::GenerationRate;
///
/// let start = Instant::now();
/// let mut rate = GenerationRate::new();
/// assert_eq!(rate.observe(1_000.0, start), None);
/// let later = start + Duration::from_secs(2);
/// assert_eq!(rate.observe(5_000.0, later), Some(2_000.0));
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GenerationRate {
    last: Option<CounterReading>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct CounterReading {
    total: f64,
    at: Instant,
}

impl GenerationRate {
    pub fn new() -> GenerationRate {
        GenerationRate::default()
    }

    /// Records one reading and returns the rate since the previous one, in
    /// counter units (tokens) per second, when it is known.
    pub fn observe(&mut self, counter_total: f64, observed_at: Instant) -> Option<f64> {
        if !counter_total.is_finite() || counter_total < 0.0 {
            self.last = None;
            return None;
        }
        let reading = CounterReading {
            total: counter_total,
            at: observed_at,
        };
        let Some(previous) = self.last else {
            self.last = Some(reading);
            return None;
        };
        if observed_at <= previous.at {
            return None;
        }
        self.last = Some(reading);
        if counter_total < previous.total {
            return None;
        }
        let elapsed_secs = observed_at.duration_since(previous.at).as_secs_f64();
        let rate_tps = (counter_total - previous.total) / elapsed_secs;
        rate_tps.is_finite().then_some(rate_tps)
    }

    /// Forgets the previous reading: the next observation is a first one.
    pub fn reset(&mut self) {
        self.last = None;
    }
}

/// What the load families say about one engine, before validation.
///
/// Sums and means are over the series that share the engine's label value
/// (normally one per family).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct VllmEngineSeries {
    /// The `engine` label value; empty for servers without the label.
    pub engine: String,
    /// Sum of `vllm:num_requests_running`.
    pub num_requests_running: Option<f64>,
    /// Sum of `vllm:num_requests_waiting`.
    pub num_requests_waiting: Option<f64>,
    /// Mean of `vllm:kv_cache_usage_perc`, else of `vllm:gpu_cache_usage_perc`.
    pub kv_cache_usage_ratio: Option<f64>,
    /// Sum of `vllm:generation_tokens_total` (or its unsuffixed name).
    pub generation_tokens_total: Option<f64>,
    /// Prefix-cache hit ratio since start, when the engine reports one.
    pub prefix_cache_hit_ratio: Option<f64>,
}

/// Groups the vLLM load families of a scrape by engine, in engine order
/// (numeric ids first, ascending). Engines with none of the running, waiting
/// and KV-usage gauges are left out; other families are ignored.
pub fn engine_series(samples: &[Sample]) -> Vec<VllmEngineSeries> {
    let mut engines: BTreeMap<EngineKey, Accumulator> = BTreeMap::new();
    for sample in samples {
        let Some(family) = Family::of(&sample.name) else {
            continue;
        };
        let engine = sample.label(ENGINE_LABEL).unwrap_or_default();
        engines
            .entry(EngineKey::new(engine))
            .or_default()
            .add(family, sample.value);
    }
    engines
        .into_iter()
        .filter(|(_, acc)| acc.has_load_gauge())
        .map(|(key, acc)| acc.finish(key.name))
        .collect()
}

/// Converts one engine's series into a rank snapshot, with the throughput
/// measured by the caller ([`GenerationRate`]).
pub fn snapshot_from_engine(
    series: &VllmEngineSeries,
    dp_rank: i64,
    gen_throughput_tps: Option<f64>,
) -> Result<SchedulerLoadSnapshot, VllmMetricsError> {
    let missing = |family| VllmMetricsError::MissingSeries {
        family,
        engine: series.engine.clone(),
    };
    let running = series
        .num_requests_running
        .ok_or_else(|| missing(NUM_REQUESTS_RUNNING))?;
    let waiting = series
        .num_requests_waiting
        .ok_or_else(|| missing(NUM_REQUESTS_WAITING))?;
    let token_usage = series
        .kv_cache_usage_ratio
        .ok_or_else(|| missing(KV_CACHE_USAGE_PERC))?;
    let num_running_reqs = count(dp_rank, "num_running_reqs", running)?;
    let num_waiting_reqs = count(dp_rank, "num_waiting_reqs", waiting)?;
    Ok(SchedulerLoadSnapshot {
        dp_rank,
        num_running_reqs,
        num_waiting_reqs,
        num_waiting_uncached_tokens: None,
        num_total_reqs: num_running_reqs.saturating_add(num_waiting_reqs),
        token_usage,
        gen_throughput: gen_throughput_tps,
        cache_hit_rate: series.prefix_cache_hit_ratio.unwrap_or(0.0),
        ..SchedulerLoadSnapshot::default()
    })
}

/// Turns successive `/metrics` scrapes of one vLLM server into
/// [`WorkerLoad`]s, keeping one [`GenerationRate`] per engine.
///
/// ```
/// use std::time::{Duration, Instant};
/// use backends_vllm::VllmMetricsConverter;
///
/// let scrape = |generated: u32| format!(
///     "vllm:num_requests_running{{engine=\"0\"}} 4\n\
///      vllm:num_requests_waiting{{engine=\"0\"}} 2\n\
///      vllm:kv_cache_usage_perc{{engine=\"0\"}} 0.25\n\
///      vllm:generation_tokens_total{{engine=\"0\"}} {generated}\n");
/// let start = Instant::now();
/// let mut converter = VllmMetricsConverter::new();
/// let first = converter.convert_text(&scrape(1_000), start)?;
/// assert_eq!(first.waiting_requests(), 2);
/// assert_eq!(first.throughput_tps(), None); // first poll: no rate yet
/// let second = converter.convert_text(&scrape(1_500), start + Duration::from_millis(500))?;
/// assert_eq!(second.throughput_tps(), Some(1_000.0));
/// assert_eq!(second.queued_tokens(), None); // vLLM never reports it
/// # Ok::<(), backends_vllm::VllmMetricsError>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct VllmMetricsConverter {
    rates: BTreeMap<String, GenerationRate>,
}

impl VllmMetricsConverter {
    pub fn new() -> VllmMetricsConverter {
        VllmMetricsConverter::default()
    }

    /// Parses a scrape taken at `observed_at` and converts it.
    pub fn convert_text(
        &mut self,
        text: &str,
        observed_at: Instant,
    ) -> Result<WorkerLoad, VllmMetricsError> {
        let samples = parse_prometheus_text(text)?;
        self.convert(&samples, observed_at)
    }

    /// Converts the samples of a scrape taken at `observed_at`.
    ///
    /// The engines' counters are recorded even when the report is then
    /// rejected, so the next rate still spans a known interval. No engine at
    /// all is [`LoadValidationError::NoRanks`].
    pub fn convert(
        &mut self,
        samples: &[Sample],
        observed_at: Instant,
    ) -> Result<WorkerLoad, VllmMetricsError> {
        let engines = engine_series(samples);
        self.rates
            .retain(|engine, _| engines.iter().any(|series| &series.engine == engine));
        let rates: Vec<Option<f64>> = engines
            .iter()
            .map(|series| match series.generation_tokens_total {
                Some(total) => self
                    .rates
                    .entry(series.engine.clone())
                    .or_default()
                    .observe(total, observed_at),
                None => {
                    self.rates.remove(&series.engine);
                    None
                }
            })
            .collect();
        let ranks = engines
            .iter()
            .zip(rates)
            .enumerate()
            .map(|(position, (series, rate))| {
                let dp_rank = series
                    .engine
                    .parse::<i64>()
                    .unwrap_or_else(|_| i64::try_from(position).unwrap_or(i64::MAX));
                snapshot_from_engine(series, dp_rank, rate)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(WorkerLoad::from_ranks(ranks)?)
    }
}

/// A gauge value as a request count: finite, rounded; negative values are
/// kept so that validation rejects them by name.
fn count(dp_rank: i64, field: &'static str, value: f64) -> Result<i64, VllmMetricsError> {
    if value.is_finite() {
        // `as` saturates at the i64 bounds.
        Ok(value.round() as i64)
    } else {
        Err(LoadValidationError::NonFinite {
            dp_rank,
            field,
            value,
        }
        .into())
    }
}

/// Orders engines by numeric id first (ascending), then by name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct EngineKey {
    /// `false` for numeric ids, so that they sort first.
    named: bool,
    id: u64,
    name: String,
}

impl EngineKey {
    fn new(engine: &str) -> EngineKey {
        let id = engine.parse::<u64>().ok();
        EngineKey {
            named: id.is_none(),
            id: id.unwrap_or(0),
            name: engine.to_owned(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Family {
    Running,
    Waiting,
    KvUsage,
    GpuKvUsage,
    GenerationTotal,
    GenerationUnsuffixed,
    PrefixHits,
    PrefixQueries,
    PrefixHitRate,
}

impl Family {
    fn of(name: &str) -> Option<Family> {
        Some(match name {
            NUM_REQUESTS_RUNNING => Family::Running,
            NUM_REQUESTS_WAITING => Family::Waiting,
            KV_CACHE_USAGE_PERC => Family::KvUsage,
            GPU_CACHE_USAGE_PERC => Family::GpuKvUsage,
            GENERATION_TOKENS_TOTAL => Family::GenerationTotal,
            GENERATION_TOKENS => Family::GenerationUnsuffixed,
            PREFIX_CACHE_HITS_TOTAL => Family::PrefixHits,
            PREFIX_CACHE_QUERIES_TOTAL => Family::PrefixQueries,
            GPU_PREFIX_CACHE_HIT_RATE => Family::PrefixHitRate,
            _ => return None,
        })
    }
}

/// Running sums of one engine's series.
#[derive(Debug, Default)]
struct Accumulator {
    running: Option<f64>,
    waiting: Option<f64>,
    kv_usage: Mean,
    gpu_kv_usage: Mean,
    generation_total: Option<f64>,
    generation_unsuffixed: Option<f64>,
    prefix_hits: Option<f64>,
    prefix_queries: Option<f64>,
    prefix_hit_rate: Mean,
}

impl Accumulator {
    fn add(&mut self, family: Family, value: f64) {
        let sum = |slot: &mut Option<f64>| *slot = Some(slot.unwrap_or(0.0) + value);
        match family {
            Family::Running => sum(&mut self.running),
            Family::Waiting => sum(&mut self.waiting),
            Family::KvUsage => self.kv_usage.add(value),
            Family::GpuKvUsage => self.gpu_kv_usage.add(value),
            Family::GenerationTotal => sum(&mut self.generation_total),
            Family::GenerationUnsuffixed => sum(&mut self.generation_unsuffixed),
            Family::PrefixHits => sum(&mut self.prefix_hits),
            Family::PrefixQueries => sum(&mut self.prefix_queries),
            Family::PrefixHitRate => self.prefix_hit_rate.add(value),
        }
    }

    fn has_load_gauge(&self) -> bool {
        self.running.is_some()
            || self.waiting.is_some()
            || self.kv_usage.count > 0
            || self.gpu_kv_usage.count > 0
    }

    fn finish(self, engine: String) -> VllmEngineSeries {
        let prefix_since_start = match (self.prefix_hits, self.prefix_queries) {
            (Some(hits), Some(queries)) if queries > 0.0 => Some(hits / queries),
            _ => None,
        };
        VllmEngineSeries {
            engine,
            num_requests_running: self.running,
            num_requests_waiting: self.waiting,
            kv_cache_usage_ratio: self.kv_usage.value().or(self.gpu_kv_usage.value()),
            generation_tokens_total: self.generation_total.or(self.generation_unsuffixed),
            prefix_cache_hit_ratio: prefix_since_start.or(self.prefix_hit_rate.value()),
        }
    }
}

#[derive(Debug, Default)]
struct Mean {
    sum: f64,
    count: u32,
}

impl Mean {
    fn add(&mut self, value: f64) {
        self.sum += value;
        self.count += 1;
    }

    fn value(&self) -> Option<f64> {
        (self.count > 0).then(|| self.sum / f64::from(self.count))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn at(start: Instant, millis: u64) -> Instant {
        start + Duration::from_millis(millis)
    }

    #[test]
    fn first_observation_has_no_rate() {
        let mut rate = GenerationRate::new();
        assert_eq!(rate.observe(500.0, Instant::now()), None);
    }

    #[test]
    fn rate_is_tokens_per_second_between_observations() {
        let start = Instant::now();
        let mut rate = GenerationRate::new();
        rate.observe(1_000.0, start);
        assert_eq!(rate.observe(1_250.0, at(start, 250)), Some(1_000.0));
        assert_eq!(rate.observe(1_250.0, at(start, 1_250)), Some(0.0));
        assert_eq!(rate.observe(4_250.0, at(start, 2_750)), Some(2_000.0));
    }

    #[test]
    fn counter_reset_gives_no_rate_then_restarts_from_the_new_reading() {
        let start = Instant::now();
        let mut rate = GenerationRate::new();
        rate.observe(10_000.0, start);
        assert_eq!(rate.observe(300.0, at(start, 1_000)), None);
        assert_eq!(rate.observe(800.0, at(start, 2_000)), Some(500.0));
    }

    #[test]
    fn broken_counters_give_no_rate_and_forget_the_baseline() {
        let start = Instant::now();
        for broken in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, -1.0] {
            let mut rate = GenerationRate::new();
            rate.observe(100.0, start);
            assert_eq!(rate.observe(broken, at(start, 1_000)), None, "{broken}");
            // The next good reading is a first one again.
            assert_eq!(rate.observe(200.0, at(start, 2_000)), None, "{broken}");
            assert_eq!(rate.observe(400.0, at(start, 3_000)), Some(200.0));
        }
    }

    #[test]
    fn stale_or_simultaneous_observations_are_ignored() {
        let start = Instant::now();
        let mut rate = GenerationRate::new();
        rate.observe(100.0, at(start, 1_000));
        assert_eq!(rate.observe(900.0, at(start, 1_000)), None);
        assert_eq!(rate.observe(50.0, start), None);
        // The baseline is still the reading at 1 s.
        assert_eq!(rate.observe(300.0, at(start, 2_000)), Some(200.0));
    }

    #[test]
    fn reset_forgets_the_baseline() {
        let start = Instant::now();
        let mut rate = GenerationRate::new();
        rate.observe(100.0, start);
        rate.reset();
        assert_eq!(rate.observe(200.0, at(start, 1_000)), None);
    }

    #[test]
    fn engines_are_ordered_numerically_then_by_name() {
        let names = ["10", "b", "2", "", "a", "0"];
        let mut keys: Vec<EngineKey> = names.iter().map(|name| EngineKey::new(name)).collect();
        keys.sort();
        let sorted: Vec<&str> = keys.iter().map(|key| key.name.as_str()).collect();
        assert_eq!(sorted, ["0", "2", "10", "", "a", "b"]);
    }

    #[test]
    fn non_finite_counts_are_rejected_by_field() {
        let series = VllmEngineSeries {
            engine: "3".into(),
            num_requests_running: Some(f64::NAN),
            num_requests_waiting: Some(1.0),
            kv_cache_usage_ratio: Some(0.5),
            ..VllmEngineSeries::default()
        };
        let err = snapshot_from_engine(&series, 3, None).unwrap_err();
        assert!(matches!(
            err,
            VllmMetricsError::Invalid(LoadValidationError::NonFinite {
                dp_rank: 3,
                field: "num_running_reqs",
                ..
            })
        ));
    }
}
