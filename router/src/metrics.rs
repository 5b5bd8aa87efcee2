//! The router's Prometheus metrics, served at `/metrics`.
//!
//! The few items marked `pub` here (the rest are `pub(crate)` or narrower)
//! are what the benchmarks reach through `crate::bench_internals`.

use std::sync::{Arc, LazyLock};

use parking_lot::RwLock;
use prometheus_client::encoding::{EncodeLabelSet, EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::exponential_buckets;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::Registry;

use crate::metric_shards::ShardedWords;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct WorkerLabel {
    pub(crate) worker: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct RequestLabels {
    pub(crate) worker: String,
    /// The HTTP status, or `error` when the worker could not be reached, or
    /// `cut` when the response stream broke off.
    pub(crate) status: String,
}

/// What became of a replica-sync message or entry, or of a hedge.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct OutcomeLabel {
    pub(crate) outcome: String,
}

/// Why replica sync dropped placements it would have sent.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ReasonLabel {
    pub(crate) reason: String,
}

/// An admission class.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ClassLabel {
    pub(crate) class: String,
}

/// How a request's wait in the admission queue ended: `dispatched`,
/// `rejected` or `left` (its client went away).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ClassOutcomeLabels {
    pub(crate) class: String,
    pub(crate) outcome: &'static str,
}

/// Why the admission room turned a request away.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ClassReasonLabels {
    pub(crate) class: String,
    pub(crate) reason: &'static str,
}

/// Why a stream was continued on another worker, and how that went.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct MigrationLabels {
    pub(crate) reason: &'static str,
    pub(crate) outcome: &'static str,
}

/// A replica-sync subject: `pending`, `prefix` or `snapshot`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct SubjectLabel {
    pub(crate) subject: String,
}

/// An engine's prefix-cache report against the router's prediction.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ReportLabels {
    pub(crate) worker: String,
    /// `as_predicted`, `fewer` or `more` (see [`CacheReportOutcome`]).
    pub(crate) outcome: String,
}

/// How an engine's reported cached tokens compare with the prediction
/// (`Dispatch::cached_tokens`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CacheReportOutcome {
    /// Within [`PREDICTION_SLACK_TOKENS`] of it.
    AsPredicted,
    /// At least that much fewer: the engine had evicted (or not yet
    /// computed) part of what was expected there.
    Fewer,
    /// At least that much more: the engine held a prefix the router did not
    /// expect there.
    More,
}

/// How far a report may be from the prediction and still count as it:
/// `least_load` predicts whole index blocks (256 tokens by default), and an
/// engine counts its own pages of its own tokens.
pub(crate) const PREDICTION_SLACK_TOKENS: u64 = 256;

impl CacheReportOutcome {
    pub(crate) fn of(predicted: u64, reported: u64) -> CacheReportOutcome {
        if reported.saturating_add(PREDICTION_SLACK_TOKENS) <= predicted {
            CacheReportOutcome::Fewer
        } else if reported >= predicted.saturating_add(PREDICTION_SLACK_TOKENS) {
            CacheReportOutcome::More
        } else {
            CacheReportOutcome::AsPredicted
        }
    }

    pub(crate) fn label(self) -> &'static str {
        match self {
            CacheReportOutcome::AsPredicted => "as_predicted",
            CacheReportOutcome::Fewer => "fewer",
            CacheReportOutcome::More => "more",
        }
    }

    const ALL: [CacheReportOutcome; 3] = [
        CacheReportOutcome::AsPredicted,
        CacheReportOutcome::Fewer,
        CacheReportOutcome::More,
    ];
}

type HistogramFamily = Family<WorkerLabel, Histogram, fn() -> Histogram>;

/// Latency buckets from 1 ms to about 65 s, doubling.
static LATENCY_BUCKETS: LazyLock<Arc<Buckets>> =
    LazyLock::new(|| Buckets::new(exponential_buckets(0.001, 2.0, 17).collect()));

/// Score buckets from 0.1 ms to about 840 s, doubling.
static SCORE_BUCKETS: LazyLock<Arc<Buckets>> =
    LazyLock::new(|| Buckets::new(exponential_buckets(0.0001, 2.0, 24).collect()));

fn latency_histogram() -> Histogram {
    Histogram::of_kind(Arc::clone(&LATENCY_BUCKETS))
}

fn score_histogram() -> Histogram {
    Histogram::of_kind(Arc::clone(&SCORE_BUCKETS))
}

/// A Prometheus histogram recorded without locks. prometheus-client's own
/// `Histogram` takes a write lock for every observation; this one adds to a
/// bucket and to the sum in the recording thread's own shard
/// ([`ShardedWords`]), so requests on different threads never wait for each
/// other nor write the same cache line, and requests on different workers
/// never touch the same histogram.
#[derive(Debug, Clone)]
pub struct Histogram {
    /// The bounds, shared by every histogram of a kind: with a copy per
    /// worker, each observation's bucket search read that worker's cold
    /// copy.
    kind: Arc<Buckets>,
    /// Word 0 holds the sum, as `f64` bits; word `1 + i` counts bucket `i`
    /// (the last counts what is above every bound). The sum beside the low
    /// buckets: most observations write one line.
    words: ShardedWords,
}

/// A histogram kind's bucket bounds.
#[derive(Debug)]
struct Buckets {
    /// Upper bounds, ascending; the last bucket (`+Inf`) has none.
    bounds: Arc<[f64]>,
    /// `Some(first)` when the bounds are `first · 2^i`, as every one of the
    /// router's are: a value's bucket is then read off its exponent.
    doubling_from: Option<f64>,
}

impl Buckets {
    fn new(bounds: Arc<[f64]>) -> Arc<Buckets> {
        Arc::new(Buckets {
            doubling_from: doubling_from(&bounds),
            bounds,
        })
    }
}

/// The word of a histogram's sum.
const SUM_WORD: usize = 0;

/// The word of bucket `bucket`.
fn bucket_word(bucket: usize) -> usize {
    bucket + 1
}

/// `Some(first)` when `bounds` are `first · 2^i` exactly (doubling a
/// finite float is exact, so bounds built by doubling pass).
fn doubling_from(bounds: &[f64]) -> Option<f64> {
    let first = *bounds.first()?;
    let mut expected = first;
    for bound in bounds {
        if *bound != expected {
            return None;
        }
        expected *= 2.0;
    }
    (first.is_normal() && first > 0.0 && expected.is_finite()).then_some(first)
}

impl Histogram {
    /// A histogram over `bounds` (ascending), which it may share with
    /// others.
    #[cfg(test)]
    pub(crate) fn new(bounds: Arc<[f64]>) -> Histogram {
        Histogram::of_kind(Buckets::new(bounds))
    }

    /// A histogram sharing `kind`'s bounds.
    fn of_kind(kind: Arc<Buckets>) -> Histogram {
        Histogram {
            words: ShardedWords::new(bucket_word(kind.bounds.len()) + 1),
            kind,
        }
    }

    pub fn observe(&self, value: f64) {
        let shard = self.words.writer();
        shard.add(bucket_word(self.bucket(value)), 1);
        shard.add_f64(SUM_WORD, value);
    }

    /// The first bucket whose bound is at least `value`: `bounds.len()`
    /// (`+Inf`) when none is, or when `value` is NaN.
    fn bucket(&self, value: f64) -> usize {
        let bounds = &*self.kind.bounds;
        if value.is_nan() {
            return bounds.len();
        }
        let Some(first) = self.kind.doubling_from.filter(|_| value > 0.0) else {
            return bounds.partition_point(|bound| *bound < value);
        };
        // value / first in (2^(i-1), 2^i] means bucket i, so the exponent
        // of the quotient (its floor log2) is i or i - 1, unless the
        // division rounded across a power of two: a step or two against the
        // bounds themselves makes it exact.
        let exponent = ((value / first).to_bits() >> 52) as i64 - 1023;
        let mut bucket = usize::try_from(exponent.saturating_add(1))
            .unwrap_or(0)
            .min(bounds.len());
        while bucket > 0 && bounds.get(bucket - 1).is_some_and(|bound| *bound >= value) {
            bucket -= 1;
        }
        while bounds.get(bucket).is_some_and(|bound| *bound < value) {
            bucket += 1;
        }
        bucket
    }

    /// Adds this histogram's sum, count and per-bucket counts to the totals.
    fn add_to(&self, sum: &mut f64, buckets: &mut [(f64, u64)]) {
        *sum += self.words.sum_f64(SUM_WORD);
        for (bucket, (_, total)) in buckets.iter_mut().enumerate() {
            *total += self.words.sum(bucket_word(bucket));
        }
    }

    /// Empty per-bucket totals with this histogram's bounds (`+Inf` last, as
    /// `f64::MAX`, which the encoder writes as `+Inf`).
    fn empty_buckets(&self) -> Vec<(f64, u64)> {
        self.kind
            .bounds
            .iter()
            .copied()
            .chain(std::iter::once(f64::MAX))
            .map(|bound| (bound, 0))
            .collect()
    }

    /// The number of observations.
    #[cfg(test)]
    pub(crate) fn count(&self) -> u64 {
        (0..=self.kind.bounds.len())
            .map(|bucket| self.words.sum(bucket_word(bucket)))
            .sum()
    }
}

fn encode_histograms<'a>(
    mut encoder: MetricEncoder,
    shards: impl IntoIterator<Item = &'a Histogram>,
    like: &Histogram,
) -> Result<(), std::fmt::Error> {
    let mut sum = 0.0;
    let mut buckets = like.empty_buckets();
    for shard in shards {
        shard.add_to(&mut sum, &mut buckets);
    }
    let count = buckets.iter().map(|(_, count)| count).sum();
    encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
}

impl TypedMetric for Histogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for Histogram {
    fn encode(&self, encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        encode_histograms(encoder, [self], self)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// One histogram kept as a shard per worker and exported as their sum, so a
/// metric every request records (the chosen worker's score) is written only
/// where that worker's own metrics are. Shards live as long as the router:
/// a forgotten worker's observations stay in the sum, as a counter must.
#[derive(Debug, Clone)]
pub(crate) struct ShardedHistogram {
    like: Histogram,
    shards: Arc<RwLock<Vec<Histogram>>>,
}

impl ShardedHistogram {
    fn new(make: fn() -> Histogram) -> ShardedHistogram {
        ShardedHistogram {
            like: make(),
            shards: Arc::new(RwLock::new(Vec::new())),
        }
    }

    /// A new shard (for one worker), counted in the sum from now on.
    pub(crate) fn shard(&self) -> Histogram {
        let shard = Histogram::of_kind(Arc::clone(&self.like.kind));
        self.shards.write().push(shard.clone());
        shard
    }

    /// The number of observations in every shard.
    #[cfg(test)]
    pub(crate) fn count(&self) -> u64 {
        self.shards.read().iter().map(Histogram::count).sum()
    }
}

impl TypedMetric for ShardedHistogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for ShardedHistogram {
    fn encode(&self, encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        encode_histograms(encoder, self.shards.read().iter(), &self.like)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// A Prometheus counter kept as a shard per recording thread
/// ([`ShardedWords`]): what every request to a worker counts.
#[derive(Debug, Clone, Default)]
pub struct PerThreadCounter {
    words: ShardedWords,
}

impl PerThreadCounter {
    pub fn inc(&self) {
        self.words.add(0, 1);
    }

    pub fn inc_by(&self, value: u64) {
        self.words.add(0, value);
    }

    pub(crate) fn get(&self) -> u64 {
        self.words.sum(0)
    }
}

impl TypedMetric for PerThreadCounter {
    const TYPE: MetricType = MetricType::Counter;
}

impl EncodeMetric for PerThreadCounter {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        encoder.encode_counter::<NoLabelSet, _, u64>(&self.get(), None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

/// A Prometheus gauge moved by increments and decrements, kept as a shard
/// per recording thread ([`ShardedWords`]). A request may end on another
/// thread than it started on: one shard can go below zero, their sum cannot.
#[derive(Debug, Clone, Default)]
pub struct PerThreadGauge {
    words: ShardedWords,
}

impl PerThreadGauge {
    pub fn inc(&self) {
        self.words.add(0, 1);
    }

    pub fn dec(&self) {
        self.words.add(0, u64::MAX);
    }

    pub(crate) fn get(&self) -> i64 {
        // Two's complement: the wrapped sum of the shards is the signed one.
        self.words.sum(0) as i64
    }
}

impl TypedMetric for PerThreadGauge {
    const TYPE: MetricType = MetricType::Gauge;
}

impl EncodeMetric for PerThreadGauge {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        encoder.encode_gauge(&self.get())
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

/// Every metric the router exports.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub(crate) requests: Family<RequestLabels, PerThreadCounter>,
    pub(crate) request_duration: HistogramFamily,
    pub(crate) time_to_first_byte: HistogramFamily,
    pub(crate) time_to_first_token: HistogramFamily,
    pub(crate) in_flight: Family<WorkerLabel, PerThreadGauge>,
    pub(crate) selections: Family<WorkerLabel, PerThreadCounter>,
    pub(crate) dispatched_tokens: Family<WorkerLabel, PerThreadCounter>,
    pub(crate) retries: Counter,
    pub(crate) rejected: Counter,
    pub(crate) admission_queue_depth: Family<ClassLabel, Gauge>,
    pub(crate) admission_wait: Family<ClassOutcomeLabels, Histogram, fn() -> Histogram>,
    pub(crate) admission_rejections: Family<ClassReasonLabels, Counter>,
    pub(crate) migrations: Family<MigrationLabels, Counter>,
    pub(crate) migration_resume: Histogram,
    pub(crate) hedges: Family<OutcomeLabel, Counter>,
    pub(crate) poll_duration: HistogramFamily,
    pub(crate) poll_failures: Family<WorkerLabel, Counter>,
    pub(crate) selected_score: ShardedHistogram,
    pub(crate) healthy: Family<WorkerLabel, Gauge>,
    pub(crate) ejected: Family<WorkerLabel, Gauge>,
    pub(crate) ejections: Family<WorkerLabel, Counter>,
    pub(crate) silent_streams: Family<WorkerLabel, Gauge>,
    pub(crate) ejections_refused: Counter,
    pub(crate) probes: Family<RequestLabels, Counter>,
    pub(crate) open_connections: Gauge,
    pub(crate) sync_connected: Gauge,
    pub(crate) sync_disconnects: Counter,
    pub(crate) sync_published: Counter,
    pub(crate) sync_publish_failures: Counter,
    pub(crate) sync_messages_received: Family<OutcomeLabel, Counter>,
    pub(crate) sync_entries: Family<OutcomeLabel, Counter>,
    pub(crate) sync_entries_expired: Counter,
    pub(crate) sync_peers: Gauge,
    pub(crate) sync_bytes_sent: Family<SubjectLabel, Counter>,
    pub(crate) sync_placements_sent: Counter,
    pub(crate) sync_placements_received: Family<OutcomeLabel, Counter>,
    pub(crate) sync_placements_dropped: Family<ReasonLabel, Counter>,
    pub(crate) sync_bounds_sent: Counter,
    pub(crate) sync_bounds_received: Family<OutcomeLabel, Counter>,
    pub(crate) sync_prefill_samples_sent: Counter,
    pub(crate) sync_prefill_samples_dropped: Counter,
    pub(crate) sync_prefill_samples_received: Family<OutcomeLabel, Counter>,
    pub(crate) sync_prefix_messages_received: Family<OutcomeLabel, Counter>,
    pub(crate) sync_snapshots_served: Counter,
    pub(crate) sync_warmups: Family<OutcomeLabel, Counter>,
    pub(crate) sync_warmup_blocks: Counter,
    pub(crate) sync_warmup_bytes: Counter,
    pub(crate) sync_warmup_seconds: Gauge<f64, std::sync::atomic::AtomicU64>,
    pub(crate) prefix_predicted_cached_tokens: Family<WorkerLabel, PerThreadCounter>,
    pub(crate) prefix_reported_cached_tokens: Family<WorkerLabel, PerThreadCounter>,
    pub(crate) prefix_cache_reports: Family<ReportLabels, PerThreadCounter>,
    pub(crate) prefix_cache_bound_tokens: Family<WorkerLabel, Gauge>,
    pub(crate) first_token_wait_predicted: Family<WorkerLabel, SecondsCounter>,
    pub(crate) first_token_wait_measured: Family<WorkerLabel, SecondsCounter>,
}

/// A running sum of seconds.
pub(crate) type SecondsCounter = Counter<f64, std::sync::atomic::AtomicU64>;

/// Predicted waits from this long on are not counted: a policy scores a
/// worker it cannot judge (a NaN or infinite signal) as the largest finite
/// value, which is no prediction.
const MAX_PREDICTED_WAIT_SECS: f64 = 86_400.0;

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("router");
        let requests = Family::<RequestLabels, PerThreadCounter>::default();
        registry.register(
            "requests",
            "Requests proxied, by worker and status",
            requests.clone(),
        );
        let request_duration =
            HistogramFamily::new_with_constructor(latency_histogram as fn() -> Histogram);
        registry.register(
            "request_duration_seconds",
            "Time from receiving a request to the end of its response",
            request_duration.clone(),
        );
        let time_to_first_byte =
            HistogramFamily::new_with_constructor(latency_histogram as fn() -> Histogram);
        registry.register(
            "time_to_first_byte_seconds",
            "Time from receiving a request to the worker's response headers",
            time_to_first_byte.clone(),
        );
        let time_to_first_token =
            HistogramFamily::new_with_constructor(latency_histogram as fn() -> Histogram);
        registry.register(
            "time_to_first_token_seconds",
            "Time from receiving a request to its first token passing through (first SSE data chunk, or the start of a non-streaming response)",
            time_to_first_token.clone(),
        );
        let in_flight = Family::<WorkerLabel, PerThreadGauge>::default();
        registry.register(
            "in_flight_requests",
            "Requests in flight per worker",
            in_flight.clone(),
        );
        let selections = Family::<WorkerLabel, PerThreadCounter>::default();
        registry.register(
            "selections",
            "Times the policy chose each worker",
            selections.clone(),
        );
        let dispatched_tokens = Family::<WorkerLabel, PerThreadCounter>::default();
        registry.register(
            "dispatched_tokens",
            "Prompt token-work dispatched to each worker (estimated on the HTTP path)",
            dispatched_tokens.clone(),
        );
        let retries = Counter::default();
        registry.register(
            "retries",
            "Requests retried on another worker",
            retries.clone(),
        );
        let rejected = Counter::default();
        registry.register(
            "rejected",
            "Requests answered 503 because no worker could take them (admission off, or a retry found every worker capped)",
            rejected.clone(),
        );
        let admission_queue_depth = Family::<ClassLabel, Gauge>::default();
        registry.register(
            "admission_queue_depth",
            "Requests waiting in the admission queue, by class",
            admission_queue_depth.clone(),
        );
        let admission_wait =
            Family::<ClassOutcomeLabels, Histogram, fn() -> Histogram>::new_with_constructor(
                latency_histogram,
            );
        registry.register(
            "admission_wait_seconds",
            "Time requests spent in the admission queue, by class and how the wait ended (dispatched, rejected, left)",
            admission_wait.clone(),
        );
        let admission_rejections = Family::<ClassReasonLabels, Counter>::default();
        registry.register(
            "admission_rejections",
            "Requests the admission room answered 429, by class and reason (queue_full, deadline_unmeetable, deadline_passed)",
            admission_rejections.clone(),
        );
        let migrations = Family::<MigrationLabels, Counter>::default();
        registry.register(
            "migrations",
            "Broken answers continued on another worker, by reason (cut, stalled, error_event, server_error, first_byte_timeout, drained) and outcome (resumed, failed, refused)",
            migrations.clone(),
        );
        let migration_resume = latency_histogram();
        registry.register(
            "migration_resume_seconds",
            "From an answer's break to the continuing worker's first event",
            migration_resume.clone(),
        );
        let hedges = Family::<OutcomeLabel, Counter>::default();
        registry.register(
            "hedges",
            "Streams overdue for their first event, by outcome: won (the second worker answered), lost (the first did), failed (both failed before an event), skipped (no hedge budget, requests queued for admission, or no other worker)",
            hedges.clone(),
        );
        let poll_duration =
            HistogramFamily::new_with_constructor(latency_histogram as fn() -> Histogram);
        registry.register(
            "load_poll_duration_seconds",
            "Load poll latency per worker",
            poll_duration.clone(),
        );
        let poll_failures = Family::<WorkerLabel, Counter>::default();
        registry.register(
            "load_poll_failures",
            "Failed load polls per worker",
            poll_failures.clone(),
        );
        let selected_score = ShardedHistogram::new(score_histogram);
        registry.register(
            "selected_score",
            "The policy's score of the chosen worker (seconds of expected wait for least_load)",
            selected_score.clone(),
        );
        let healthy = Family::<WorkerLabel, Gauge>::default();
        registry.register(
            "worker_healthy",
            "1 when the worker passes its health checks (see worker_ejected for outlier ejection)",
            healthy.clone(),
        );
        let ejected = Family::<WorkerLabel, Gauge>::default();
        registry.register(
            "worker_ejected",
            "1 while outlier detection holds the worker out of rotation",
            ejected.clone(),
        );
        let ejections = Family::<WorkerLabel, Counter>::default();
        registry.register(
            "ejections",
            "Times outlier detection ejected each worker (consecutive failures or a failed probe)",
            ejections.clone(),
        );
        let silent_streams = Family::<WorkerLabel, Gauge>::default();
        registry.register(
            "worker_silent_streams",
            "Open streams silent for outlier_detection.silent_stream_ms; above 0 the worker gets no new requests while others can take them",
            silent_streams.clone(),
        );
        let ejections_refused = Counter::default();
        registry.register(
            "ejections_refused",
            "Ejections not made because outlier_detection.max_ejected_percent of the fleet was already out",
            ejections_refused.clone(),
        );
        let probes = Family::<RequestLabels, Counter>::default();
        registry.register(
            "probes",
            "Generation probes of ejected workers, by worker and outcome (pass, fail)",
            probes.clone(),
        );
        let open_connections = Gauge::default();
        registry.register(
            "open_connections",
            "Client connections open now",
            open_connections.clone(),
        );
        let sync_connected = Gauge::default();
        registry.register(
            "sync_connected",
            "1 while replica sync is connected to its NATS broker (0 when off or disconnected: routing on local knowledge)",
            sync_connected.clone(),
        );
        let sync_disconnects = Counter::default();
        registry.register(
            "sync_disconnects",
            "Times replica sync lost its broker connection",
            sync_disconnects.clone(),
        );
        let sync_published = Counter::default();
        registry.register(
            "sync_messages_published",
            "Pending-work messages this replica published",
            sync_published.clone(),
        );
        let sync_publish_failures = Counter::default();
        registry.register(
            "sync_publish_failures",
            "Messages that could not be published (error or timeout): after a pending-work one the next carries the whole state; a prefix one's placements are lost (sync_placements_dropped_total{reason=\"unsent\"})",
            sync_publish_failures.clone(),
        );
        let sync_messages_received = Family::<OutcomeLabel, Counter>::default();
        registry.register(
            "sync_messages_received",
            "Messages received on the sync subject, by outcome: applied, own, malformed, foreign_version, invalid_replica",
            sync_messages_received.clone(),
        );
        let sync_entries = Family::<OutcomeLabel, Counter>::default();
        registry.register(
            "sync_entries",
            "Per-worker entries of other replicas' messages (and their admission rooms), by outcome: applied, stale, unknown_worker, unsupported, invalid",
            sync_entries.clone(),
        );
        let sync_entries_expired = Counter::default();
        registry.register(
            "sync_entries_expired",
            "Other replicas' entries dropped because they were not confirmed within sync.entry_ttl_ms",
            sync_entries_expired.clone(),
        );
        let sync_peers = Gauge::default();
        registry.register(
            "sync_peers",
            "Other replicas heard within sync.entry_ttl_ms",
            sync_peers.clone(),
        );
        let sync_bytes_sent = Family::<SubjectLabel, Counter>::default();
        registry.register(
            "sync_bytes_sent",
            "Payload bytes this replica published, by subject: pending, prefix, snapshot",
            sync_bytes_sent.clone(),
        );
        let sync_placements_sent = Counter::default();
        registry.register(
            "sync_placements_sent",
            "Prefix placements this replica published",
            sync_placements_sent.clone(),
        );
        let sync_placements_received = Family::<OutcomeLabel, Counter>::default();
        registry.register(
            "sync_placements_received",
            "Other replicas' prefix placements, by outcome: applied, unknown_worker, unsupported, invalid",
            sync_placements_received.clone(),
        );
        let sync_placements_dropped = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "sync_placements_dropped",
            "Placements not published, by reason: queue_full (the publisher fell behind), coalesced (a longer one to the same worker went in the same message), unsent (broker away or publish failed); each costs affinity on the other replicas, never correctness",
            sync_placements_dropped.clone(),
        );
        let sync_bounds_sent = Counter::default();
        registry.register(
            "sync_bounds_sent",
            "Learned prefix-cache bounds this replica published",
            sync_bounds_sent.clone(),
        );
        let sync_bounds_received = Family::<OutcomeLabel, Counter>::default();
        registry.register(
            "sync_bounds_received",
            "Other replicas' learned prefix-cache bounds, by outcome: applied, unknown_worker, unsupported, invalid",
            sync_bounds_received.clone(),
        );
        let sync_prefill_samples_sent = Counter::default();
        registry.register(
            "sync_prefill_samples_sent",
            "First tokens this replica had, published with the pending work for the other replicas to learn prefill rates from",
            sync_prefill_samples_sent.clone(),
        );
        let sync_prefill_samples_dropped = Counter::default();
        registry.register(
            "sync_prefill_samples_dropped",
            "First tokens not published: the queue was full between two ticks, the broker was away or the publish failed; each is one first token fewer on the other replicas",
            sync_prefill_samples_dropped.clone(),
        );
        let sync_prefill_samples_received = Family::<OutcomeLabel, Counter>::default();
        registry.register(
            "sync_prefill_samples_received",
            "Other replicas' first tokens, by outcome: applied, unknown_worker, unsupported, invalid",
            sync_prefill_samples_received.clone(),
        );
        let sync_prefix_messages_received = Family::<OutcomeLabel, Counter>::default();
        registry.register(
            "sync_prefix_messages_received",
            "Messages received on the prefix subject, by outcome: applied, own, malformed, foreign_version, invalid_replica, oversize",
            sync_prefix_messages_received.clone(),
        );
        let sync_snapshots_served = Counter::default();
        registry.register(
            "sync_snapshots_served",
            "Prefix snapshots this replica sent to a starting one",
            sync_snapshots_served.clone(),
        );
        let sync_warmups = Family::<OutcomeLabel, Counter>::default();
        registry.register(
            "sync_warmups",
            "Prefix-index warm-ups from another replica's snapshot, by outcome: complete, partial (gave up after sync.snapshot_timeout_ms with parts missing), no_answer",
            sync_warmups.clone(),
        );
        let sync_warmup_blocks = Counter::default();
        registry.register(
            "sync_warmup_blocks",
            "Prefix blocks loaded from other replicas' snapshots",
            sync_warmup_blocks.clone(),
        );
        let sync_warmup_bytes = Counter::default();
        registry.register(
            "sync_warmup_bytes",
            "Snapshot bytes received and loaded",
            sync_warmup_bytes.clone(),
        );
        let sync_warmup_seconds = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register(
            "sync_warmup_seconds",
            "How long the last warm-up took, from its request to its last part (or to giving up)",
            sync_warmup_seconds.clone(),
        );
        let prefix_predicted_cached_tokens = Family::<WorkerLabel, PerThreadCounter>::default();
        registry.register(
            "prefix_predicted_cached_tokens",
            "Prompt tokens the policy expected each worker to hold in its prefix cache, over every dispatch",
            prefix_predicted_cached_tokens.clone(),
        );
        let prefix_reported_cached_tokens = Family::<WorkerLabel, PerThreadCounter>::default();
        registry.register(
            "prefix_reported_cached_tokens",
            "Prompt tokens each worker reported served from its prefix cache (usage.prompt_tokens_details.cached_tokens, meta_info.cached_tokens), over the responses that carried a report",
            prefix_reported_cached_tokens.clone(),
        );
        let prefix_cache_reports = Family::<ReportLabels, PerThreadCounter>::default();
        registry.register(
            "prefix_cache_reports",
            "Responses that carried a cached_tokens report, by worker and outcome against the prediction: as_predicted (within 256 tokens), fewer, more",
            prefix_cache_reports.clone(),
        );
        let prefix_cache_bound_tokens = Family::<WorkerLabel, Gauge>::default();
        registry.register(
            "prefix_cache_bound_tokens",
            "The prefix-cache bound last learned for each worker, from its reports here or another replica's (0: none learned)",
            prefix_cache_bound_tokens.clone(),
        );
        let first_token_wait_predicted = Family::<WorkerLabel, SecondsCounter>::default();
        registry.register(
            "first_token_wait_predicted_seconds",
            "The policy's predicted wait from dispatch to first token, summed over the streamed requests sent to each worker (policies that predict one: least_load, power_of_two)",
            first_token_wait_predicted.clone(),
        );
        let first_token_wait_measured = Family::<WorkerLabel, SecondsCounter>::default();
        registry.register(
            "first_token_wait_measured_seconds",
            "The measured time from dispatch to first token of the same requests: over the predicted sum, how far the policy's model of each worker's wait errs",
            first_token_wait_measured.clone(),
        );
        Metrics {
            registry,
            requests,
            request_duration,
            time_to_first_byte,
            time_to_first_token,
            in_flight,
            selections,
            dispatched_tokens,
            retries,
            rejected,
            admission_queue_depth,
            admission_wait,
            admission_rejections,
            migrations,
            migration_resume,
            hedges,
            poll_duration,
            poll_failures,
            selected_score,
            healthy,
            ejected,
            ejections,
            silent_streams,
            ejections_refused,
            probes,
            open_connections,
            sync_connected,
            sync_disconnects,
            sync_published,
            sync_publish_failures,
            sync_messages_received,
            sync_entries,
            sync_entries_expired,
            sync_peers,
            sync_bytes_sent,
            sync_placements_sent,
            sync_placements_received,
            sync_placements_dropped,
            sync_bounds_sent,
            sync_bounds_received,
            sync_prefill_samples_sent,
            sync_prefill_samples_dropped,
            sync_prefill_samples_received,
            sync_prefix_messages_received,
            sync_snapshots_served,
            sync_warmups,
            sync_warmup_blocks,
            sync_warmup_bytes,
            sync_warmup_seconds,
            prefix_predicted_cached_tokens,
            prefix_reported_cached_tokens,
            prefix_cache_reports,
            prefix_cache_bound_tokens,
            first_token_wait_predicted,
            first_token_wait_measured,
        }
    }

    /// The counter of received sync messages with this outcome.
    pub(crate) fn sync_message(&self, outcome: &str) -> Counter {
        self.sync_messages_received
            .get_or_create(&OutcomeLabel {
                outcome: outcome.to_owned(),
            })
            .clone()
    }

    /// The counter of other replicas' entries with this outcome.
    pub(crate) fn sync_entry(&self, outcome: &str) -> Counter {
        self.sync_entries
            .get_or_create(&OutcomeLabel {
                outcome: outcome.to_owned(),
            })
            .clone()
    }

    /// The counter of `family`'s series with this outcome.
    pub(crate) fn outcome(family: &Family<OutcomeLabel, Counter>, outcome: &str) -> Counter {
        family
            .get_or_create(&OutcomeLabel {
                outcome: outcome.to_owned(),
            })
            .clone()
    }

    /// The counter of placements dropped for this reason.
    pub(crate) fn placements_dropped(&self, reason: &str) -> Counter {
        self.sync_placements_dropped
            .get_or_create(&ReasonLabel {
                reason: reason.to_owned(),
            })
            .clone()
    }

    /// The counter of bytes published on this subject.
    pub(crate) fn bytes_sent(&self, subject: &str) -> Counter {
        self.sync_bytes_sent
            .get_or_create(&SubjectLabel {
                subject: subject.to_owned(),
            })
            .clone()
    }

    /// The Prometheus text exposition of every metric.
    pub(crate) fn render(&self) -> String {
        let mut text = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry);
        text
    }
}

/// Per-worker handles, looked up once when the worker is added so the request
/// path does not hash label strings.
#[derive(Debug, Clone)]
pub struct WorkerMetrics {
    pub(crate) label: String,
    pub request_duration: Histogram,
    pub time_to_first_byte: Histogram,
    pub time_to_first_token: Histogram,
    pub in_flight: PerThreadGauge,
    pub selections: PerThreadCounter,
    pub dispatched_tokens: PerThreadCounter,
    /// This worker's shard of `selected_score`.
    pub selected_score: Histogram,
    pub(crate) poll_duration: Histogram,
    pub(crate) poll_failures: Counter,
    pub(crate) healthy: Gauge,
    pub(crate) ejected: Gauge,
    pub(crate) ejections: Counter,
    pub(crate) silent_streams: Gauge,
    /// `requests_total{status="200"}`, the common case, resolved up front.
    pub requests_ok: PerThreadCounter,
    pub(crate) predicted_cached_tokens: PerThreadCounter,
    pub(crate) reported_cached_tokens: PerThreadCounter,
    /// By [`CacheReportOutcome`], in its declaration order.
    cache_reports: [PerThreadCounter; 3],
    pub(crate) cache_bound_tokens: Gauge,
    pub(crate) first_token_wait_predicted: SecondsCounter,
    pub(crate) first_token_wait_measured: SecondsCounter,
}

impl WorkerMetrics {
    pub fn new(metrics: &Metrics, url: &str) -> WorkerMetrics {
        let label = WorkerLabel {
            worker: url.to_owned(),
        };
        WorkerMetrics {
            label: url.to_owned(),
            request_duration: metrics.request_duration.get_or_create(&label).clone(),
            time_to_first_byte: metrics.time_to_first_byte.get_or_create(&label).clone(),
            time_to_first_token: metrics.time_to_first_token.get_or_create(&label).clone(),
            in_flight: metrics.in_flight.get_or_create(&label).clone(),
            selections: metrics.selections.get_or_create(&label).clone(),
            dispatched_tokens: metrics.dispatched_tokens.get_or_create(&label).clone(),
            selected_score: metrics.selected_score.shard(),
            poll_duration: metrics.poll_duration.get_or_create(&label).clone(),
            poll_failures: metrics.poll_failures.get_or_create(&label).clone(),
            healthy: metrics.healthy.get_or_create(&label).clone(),
            ejected: metrics.ejected.get_or_create(&label).clone(),
            ejections: metrics.ejections.get_or_create(&label).clone(),
            silent_streams: metrics.silent_streams.get_or_create(&label).clone(),
            requests_ok: metrics
                .requests
                .get_or_create(&RequestLabels {
                    worker: url.to_owned(),
                    status: "200".to_owned(),
                })
                .clone(),
            predicted_cached_tokens: metrics
                .prefix_predicted_cached_tokens
                .get_or_create(&label)
                .clone(),
            reported_cached_tokens: metrics
                .prefix_reported_cached_tokens
                .get_or_create(&label)
                .clone(),
            cache_reports: CacheReportOutcome::ALL.map(|outcome| {
                metrics
                    .prefix_cache_reports
                    .get_or_create(&ReportLabels {
                        worker: url.to_owned(),
                        outcome: outcome.label().to_owned(),
                    })
                    .clone()
            }),
            cache_bound_tokens: metrics
                .prefix_cache_bound_tokens
                .get_or_create(&label)
                .clone(),
            first_token_wait_predicted: metrics
                .first_token_wait_predicted
                .get_or_create(&label)
                .clone(),
            first_token_wait_measured: metrics
                .first_token_wait_measured
                .get_or_create(&label)
                .clone(),
        }
    }

    /// Counts one streamed request's first token, `measured_secs` after its
    /// dispatch, where the policy predicted `predicted_secs`. A prediction
    /// that is not a wait (negative, not finite, or the policy's stand-in
    /// for an unusable worker, [`MAX_PREDICTED_WAIT_SECS`] and more) is
    /// left out, with its measurement, so the two sums stay comparable.
    pub(crate) fn first_token_wait(&self, predicted_secs: f64, measured_secs: f64) {
        if (0.0..MAX_PREDICTED_WAIT_SECS).contains(&predicted_secs) {
            self.first_token_wait_predicted.inc_by(predicted_secs);
            self.first_token_wait_measured.inc_by(measured_secs);
        }
    }

    /// Counts one engine report of `reported` cached tokens where
    /// `predicted` were expected.
    pub(crate) fn cache_reported(&self, predicted: u64, reported: u64) {
        self.reported_cached_tokens.inc_by(reported);
        let outcome = CacheReportOutcome::of(predicted, reported);
        self.cache_reports[outcome as usize].inc();
    }

    pub(crate) fn request_status(&self, metrics: &Metrics, status: &str) {
        if status == "200" {
            self.requests_ok.inc();
            return;
        }
        metrics
            .requests
            .get_or_create(&RequestLabels {
                worker: self.label.clone(),
                status: status.to_owned(),
            })
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_observation_lands_in_the_first_bucket_at_or_above_it() {
        let histogram = Histogram::new(Arc::from([0.1, 1.0, 10.0]));
        for value in [0.05, 0.1, 0.5, 10.0, 11.0] {
            histogram.observe(value);
        }
        let mut sum = 0.0;
        let mut buckets = histogram.empty_buckets();
        histogram.add_to(&mut sum, &mut buckets);
        let counts: Vec<u64> = buckets.iter().map(|(_, count)| *count).collect();
        assert_eq!(counts, [2, 1, 1, 1]);
        assert!((sum - 21.65).abs() < 1e-9);
        assert_eq!(histogram.count(), 5);
    }

    #[test]
    fn a_bucket_read_off_the_exponent_is_the_one_a_search_finds() {
        for histogram in [latency_histogram(), score_histogram()] {
            let bounds = Arc::clone(&histogram.kind.bounds);
            assert!(histogram.kind.doubling_from.is_some());
            let mut values = vec![0.0, -1.0, f64::MIN_POSITIVE, 5e-324, 1e-300, 1e300];
            values.extend([f64::INFINITY, f64::NEG_INFINITY, f64::MAX]);
            for bound in bounds.iter() {
                // Each bound, and the floats either side of it.
                values.extend([*bound, bound.next_down(), bound.next_up()]);
            }
            values.extend((0..20_000).map(|i| 1e-5 * 1.0013_f64.powi(i)));
            for value in values {
                let searched = bounds.partition_point(|bound| *bound < value);
                assert_eq!(histogram.bucket(value), searched, "{value:e}");
            }
            assert_eq!(histogram.bucket(f64::NAN), bounds.len());
        }
        // Bounds that do not double are searched.
        let uneven = Histogram::new(Arc::from([0.1, 1.0, 10.0]));
        assert_eq!(uneven.kind.doubling_from, None);
        assert_eq!(uneven.bucket(0.5), 1);
        assert_eq!(uneven.bucket(f64::NAN), 3);
    }

    #[test]
    fn every_shard_shares_one_copy_of_the_bounds_and_counts_in_the_sum() {
        let sharded = ShardedHistogram::new(score_histogram);
        let (first, second) = (sharded.shard(), sharded.shard());
        assert!(Arc::ptr_eq(&first.kind, &second.kind));
        assert!(Arc::ptr_eq(
            &latency_histogram().kind,
            &latency_histogram().kind
        ));
        first.observe(0.002);
        second.observe(f64::NAN);
        assert_eq!(sharded.count(), 2);
    }

    #[test]
    fn per_thread_metrics_scrape_as_the_sum_of_every_thread() {
        let metrics = Metrics::new();
        let worker = WorkerMetrics::new(&metrics, "http://10.0.0.1:30000");
        // A request that starts on one thread and ends on another, and
        // counts and observations from several threads.
        worker.in_flight.inc();
        std::thread::scope(|scope| {
            scope.spawn(|| worker.in_flight.dec());
            for _ in 0..3 {
                scope.spawn(|| {
                    worker.selections.inc();
                    worker.dispatched_tokens.inc_by(100);
                    worker.request_status(&metrics, "200");
                    worker.request_status(&metrics, "503");
                    worker.time_to_first_token.observe(0.5);
                });
            }
        });
        worker.in_flight.inc();
        let text = metrics.render();
        let worker_label = r#"{worker="http://10.0.0.1:30000"}"#;
        for line in [
            format!("router_in_flight_requests{worker_label} 1"),
            format!("router_selections_total{worker_label} 3"),
            format!("router_dispatched_tokens_total{worker_label} 300"),
            r#"router_requests_total{worker="http://10.0.0.1:30000",status="200"} 3"#.to_owned(),
            r#"router_requests_total{worker="http://10.0.0.1:30000",status="503"} 3"#.to_owned(),
            format!("router_time_to_first_token_seconds_sum{worker_label} 1.5"),
            format!("router_time_to_first_token_seconds_count{worker_label} 3"),
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "no line {line:?} in\n{text}"
            );
        }
        assert!(text.contains("# TYPE router_in_flight_requests gauge"));
        assert!(text.contains("# TYPE router_selections counter"));
    }
}
