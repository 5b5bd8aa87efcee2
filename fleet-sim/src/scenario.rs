//! Scenario files: the fleet, the traffic, the router side, the policies to
//! compare and the size of the run (`docs/engine-model.md`, "Scenario files").
//!
//! Every table denies unknown keys; [`Scenario::validate`] rejects impossible
//! values with a message naming the field.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use admission::{ClassConfig, RoomConfig};
use serde::{Deserialize, Deserializer, Serialize};

use super::error::SimError;
use super::workload::{LengthDist, Trace};
use engine_model::EngineParams;

/// The standard scenario names, in the order they are run and reported.
pub const STANDARD_SCENARIOS: [&str; 16] = [
    "uniform",
    "size-skew",
    "heavy-tail",
    "hetero-fleet",
    "bursty",
    "mixed-backends",
    "stale-polls",
    "poll-jitter",
    "replicas",
    "rate-spread",
    "rate-spread-vllm",
    "bursty-long",
    "slowdown",
    "replicas-hetero",
    "replicas-multi-turn",
    "replicas-rag",
];

/// The most workers a scenario may have.
pub const MAX_WORKERS: u32 = 4096;
/// The most router replicas a scenario may have.
pub const MAX_REPLICAS: u32 = 64;
/// The highest load level a scenario may ask for, as a multiple of the
/// fleet's capacity: above 1 the fleet is overloaded (what admission is for).
pub const MAX_UTILIZATION: f64 = 4.0;

/// One scenario file.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// The scenario's name (`size-skew`, …): the output directory.
    pub name: String,
    /// Seeds the workload, the engines, the policies' tie-breaking and the
    /// oracle's: the same seed gives the same report, byte for byte.
    pub seed: u64,
    /// Requests per traffic, policy and load level.
    pub requests: u64,
    /// Target utilizations of fleet capacity.
    pub utilizations: Vec<f64>,
    /// What a traffic's capacity is: the formula's (default) or measured.
    #[serde(default)]
    pub capacity: CapacityBasis,
    /// Policies compared.
    #[serde(default = "PolicyName::all")]
    pub policies: Vec<PolicyName>,
    /// Worker groups.
    pub fleet: Vec<WorkerGroup>,
    /// The router side.
    #[serde(default)]
    pub router: RouterConfig,
    /// One or more traffic mixes, each run separately.
    pub traffic: Vec<TrafficConfig>,
    /// One worker changes speed during the run.
    #[serde(default)]
    pub slowdown: Option<SlowdownConfig>,
    /// One router replica restarts during the run.
    #[serde(default)]
    pub restart: Option<RestartConfig>,
    /// The directory relative paths (traces) are resolved against: the
    /// scenario file's directory.
    #[serde(skip)]
    pub base_dir: PathBuf,
}

/// How a traffic's capacity (what `utilizations` multiply) is worked out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CapacityBasis {
    /// `Σ_workers 1 / ((prompt − cached) / prefill_tps + output ×
    /// decode_per_req_ms / 1000)`: every worker's prefill and decode work
    /// summed, though a step overlaps them, so the fleet serves more than
    /// this (size-skew about 1.2 ×).
    #[default]
    Formula,
    /// The highest arrival rate `least_load` (one replica, no admission)
    /// keeps up with: found by bisection over simulated runs of the traffic
    /// (`capacity_rps` is then that rate, `formula_capacity_rps` the
    /// formula's). For loads above the fleet's real capacity.
    Measured,
}

/// The policies the simulator knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyName {
    Random,
    RoundRobin,
    LeastRequests,
    PowerOfTwo,
    /// `least_load` with the registry's defaults.
    LeastLoad,
    /// `least_load` with `inflight = "since_poll"`.
    LeastLoadSincePoll,
    /// `least_load` with `use_reported_throughput = true`: every worker's
    /// work divided by the generation rate it reports.
    LeastLoadReportedRate,
    /// `least_load` with `use_reported_throughput = false`: every worker's
    /// work divided by `default_throughput`.
    LeastLoadFixedRate,
    /// `least_load` with `prefix_affinity = false`: the request's whole
    /// prompt counts on every worker, cached or not. Not in the default set;
    /// name it in `policies`.
    LeastLoadNoPrefix,
    /// smg's `cache_aware` over block hashes (`policy_core::CacheAwarePolicy`).
    /// Not in the default set; name it in `policies`.
    CacheAware,
    /// Consistent hashing on the prompt's leading blocks
    /// (`policy_core::ConsistentHashPolicy`). Not in the default set; name
    /// it in `policies`.
    ConsistentHash,
    /// A reference: least true queued uncached prefill seconds, ties at random.
    LeastTrueQueue,
    /// The reference: the earliest projected first token for this request
    /// (`Engine::first_token_projection_s`), ties at random.
    Oracle,
}

impl PolicyName {
    pub const ALL: [PolicyName; 10] = [
        PolicyName::Random,
        PolicyName::RoundRobin,
        PolicyName::LeastRequests,
        PolicyName::PowerOfTwo,
        PolicyName::LeastLoad,
        PolicyName::LeastLoadSincePoll,
        PolicyName::LeastLoadReportedRate,
        PolicyName::LeastLoadFixedRate,
        PolicyName::LeastTrueQueue,
        PolicyName::Oracle,
    ];

    /// The references: they read the engines' true state, not deployable.
    pub const REFERENCES: [PolicyName; 2] = [PolicyName::LeastTrueQueue, PolicyName::Oracle];

    /// Whether this is one of the [`REFERENCES`](PolicyName::REFERENCES).
    pub fn is_reference(self) -> bool {
        PolicyName::REFERENCES.contains(&self)
    }

    fn all() -> Vec<PolicyName> {
        PolicyName::ALL.to_vec()
    }

    /// The name in reports.
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyName::Random => "random",
            PolicyName::RoundRobin => "round_robin",
            PolicyName::LeastRequests => "least_requests",
            PolicyName::PowerOfTwo => "power_of_two",
            PolicyName::LeastLoad => "least_load",
            PolicyName::LeastLoadSincePoll => "least_load_since_poll",
            PolicyName::LeastLoadReportedRate => "least_load_reported_rate",
            PolicyName::LeastLoadFixedRate => "least_load_fixed_rate",
            PolicyName::LeastLoadNoPrefix => "least_load_no_prefix",
            PolicyName::CacheAware => "cache_aware",
            PolicyName::ConsistentHash => "consistent_hash",
            PolicyName::LeastTrueQueue => "least_true_queue",
            PolicyName::Oracle => "oracle",
        }
    }
}

/// How a worker reports its load: which of the router's backends reads it.
/// Not the engine: one SGLang engine (`mock_engines::Flavour::Sglang`)
/// reports over `/v1/loads` and over gRPC alike. Scenario files name it by
/// the backend's registry name (`flavour = "sglang-grpc"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadReport {
    /// SGLang `GET /v1/loads` JSON: queued uncached tokens and throughput.
    Sglang,
    /// SGLang gRPC `GetLoads` (proto3 presence rules).
    SglangGrpc,
    /// vLLM Prometheus `/metrics`: no queued tokens, throughput as a counter
    /// rate between polls (not reported on the first poll).
    Vllm,
    /// vLLM gRPC `GetLoads`: no queued tokens, no throughput.
    VllmGrpc,
    /// TokenSpeed gRPC `GetLoads`: no queued tokens, no throughput.
    Tokenspeed,
}

impl LoadReport {
    pub const ALL: [LoadReport; 5] = [
        LoadReport::Sglang,
        LoadReport::SglangGrpc,
        LoadReport::Vllm,
        LoadReport::VllmGrpc,
        LoadReport::Tokenspeed,
    ];

    /// [`backend_name`](LoadReport::backend_name) of each of [`ALL`](LoadReport::ALL).
    const NAMES: [&'static str; 5] = {
        let mut names = [""; 5];
        let mut index = 0;
        while index < names.len() {
            names[index] = LoadReport::ALL[index].backend_name();
            index += 1;
        }
        names
    };

    /// The name the backend that reads this report registers under, taken
    /// from the backend crates so it cannot drift from the router's.
    pub const fn backend_name(self) -> &'static str {
        match self {
            LoadReport::Sglang => backends_sglang::HTTP_BACKEND,
            LoadReport::SglangGrpc => backends_sglang::GRPC_BACKEND,
            LoadReport::Vllm => backends_vllm::METRICS_KIND,
            LoadReport::VllmGrpc => backends_vllm::GRPC_KIND,
            LoadReport::Tokenspeed => backends_tokenspeed::BACKEND,
        }
    }
}

impl<'de> Deserialize<'de> for LoadReport {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<LoadReport, D::Error> {
        let name = String::deserialize(deserializer)?;
        LoadReport::ALL
            .into_iter()
            .find(|report| report.backend_name() == name)
            .ok_or_else(|| serde::de::Error::unknown_variant(&name, &LoadReport::NAMES))
    }
}

/// `count` identical workers.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerGroup {
    pub count: u32,
    /// How these workers report load; the scenario key is `flavour`.
    #[serde(rename = "flavour")]
    pub load_report: LoadReport,
    /// Engine parameters; omitted keys take their defaults.
    #[serde(default)]
    pub engine: EngineParams,
}

/// When a worker's or a replica's polls happen within the interval.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PhaseMode {
    /// All at offset 0.
    Aligned,
    /// Evenly spread: item `i` of `n` at `i / n` of the interval.
    #[default]
    Spread,
    /// Seeded uniform offsets in the interval.
    Random,
}

/// Which moment's engine state a poll reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ReportAt {
    /// The state when the poll is sent (the report is `poll_latency_s` old
    /// when it arrives): the conservative choice.
    #[default]
    Send,
    /// The state when the poll completes.
    Completion,
}

/// The one-way latency of a sync message when a scenario does not set it:
/// one hop through a broker on the same network.
pub const DEFAULT_SYNC_LATENCY_S: f64 = 0.001;
/// The sync entry TTL when a scenario does not set it (the router's
/// `sync.entry_ttl_ms` default).
pub const DEFAULT_SYNC_ENTRY_TTL_S: f64 = 1.0;

fn default_sync_latency_s() -> f64 {
    DEFAULT_SYNC_LATENCY_S
}

fn default_sync_entry_ttl_s() -> f64 {
    DEFAULT_SYNC_ENTRY_TTL_S
}

/// How router replicas share their pending work (`docs/replicas.md`), as
/// the simulator models the channel. Scenario files name the mode by its
/// `mode` key: `{ mode = "off" }`, `{ mode = "ideal" }`,
/// `{ mode = "periodic", publish_interval_s = 0.02 }`.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize)]
#[serde(tag = "mode", rename_all = "kebab-case", deny_unknown_fields)]
pub enum SyncConfig {
    /// No sync: each replica counts only its own pending work.
    Off {},
    /// The limit: every change of a replica's pending work on a worker
    /// (a dispatch, a first token), every prefix placement and every
    /// learned cache bound reaches every other replica at that instant,
    /// and nothing is lost or expires.
    Ideal {},
    /// The router's channel: every `publish_interval_s` (at a seeded phase
    /// per replica) each replica reads its own pending work per worker
    /// (`Policy::worker_stats`) and publishes the workers whose work changed
    /// (every worker every `entry_ttl_s / 4`) with its next sequence number;
    /// each message reaches every other replica `latency_s` later, or is
    /// lost for that replica with probability `loss_ratio` (seeded). Each
    /// replica drops the others' entries not confirmed within `entry_ttl_s`,
    /// checked every `entry_ttl_s / 8` (at least one publish interval), as
    /// the router does.
    ///
    /// With `publish_dispatches = true`, a replica also publishes a
    /// worker's state the moment its pending work there grows (a
    /// dispatch), through the same channel (latency, loss, sequence); the
    /// ticks then carry the decreases (first tokens) and the full states.
    /// The router's publisher does this (it wakes on every dispatch).
    ///
    /// Each message also carries the prefix placements and learned cache
    /// bounds the replica made since its last one (`Policy::placement`,
    /// `Policy::cache_report`): with `publish_dispatches` a dispatch's
    /// placement goes in the dispatch's own message. A lost copy loses
    /// them for that replica.
    Periodic {
        publish_interval_s: f64,
        #[serde(default = "default_sync_latency_s")]
        latency_s: f64,
        #[serde(default)]
        loss_ratio: f64,
        #[serde(default = "default_sync_entry_ttl_s")]
        entry_ttl_s: f64,
        #[serde(default)]
        publish_dispatches: bool,
    },
}

impl Default for SyncConfig {
    fn default() -> SyncConfig {
        SyncConfig::Off {}
    }
}

impl SyncConfig {
    /// Whether replicas share anything.
    pub fn is_off(&self) -> bool {
        matches!(self, SyncConfig::Off {})
    }

    /// The name in reports: `off`, `ideal`, `20ms` (a periodic channel by
    /// its publish interval, then whatever differs from the defaults:
    /// `20ms+dispatches lat 5ms loss 10% ttl 2s`).
    pub fn label(&self) -> String {
        match *self {
            SyncConfig::Off {} => "off".to_owned(),
            SyncConfig::Ideal {} => "ideal".to_owned(),
            SyncConfig::Periodic {
                publish_interval_s,
                latency_s,
                loss_ratio,
                entry_ttl_s,
                publish_dispatches,
            } => {
                let mut label = format!("{}ms", trimmed(publish_interval_s * 1000.0));
                if publish_dispatches {
                    label.push_str("+dispatches");
                }
                if latency_s != DEFAULT_SYNC_LATENCY_S {
                    label.push_str(&format!(" lat {}ms", trimmed(latency_s * 1000.0)));
                }
                if loss_ratio > 0.0 {
                    label.push_str(&format!(" loss {}%", trimmed(loss_ratio * 100.0)));
                }
                if entry_ttl_s != DEFAULT_SYNC_ENTRY_TTL_S {
                    label.push_str(&format!(" ttl {}s", trimmed(entry_ttl_s)));
                }
                label
            }
        }
    }

    /// Checks the ranges the router's `[sync]` section enforces (the TTL at
    /// least four publish intervals), and the channel's own.
    fn validate(&self) -> Result<(), String> {
        let SyncConfig::Periodic {
            publish_interval_s,
            latency_s,
            loss_ratio,
            entry_ttl_s,
            ..
        } = *self
        else {
            return Ok(());
        };
        if !(publish_interval_s.is_finite() && publish_interval_s > 0.0) {
            return Err(format!(
                "publish_interval_s must be finite and positive, got {publish_interval_s}"
            ));
        }
        if !(latency_s.is_finite() && latency_s >= 0.0) {
            return Err(format!(
                "latency_s must be finite and not negative, got {latency_s}"
            ));
        }
        if !(loss_ratio.is_finite() && (0.0..=1.0).contains(&loss_ratio)) {
            return Err(format!("loss_ratio must be in [0, 1], got {loss_ratio}"));
        }
        if !(entry_ttl_s.is_finite() && entry_ttl_s >= 4.0 * publish_interval_s) {
            return Err(format!(
                "entry_ttl_s must be at least 4 × publish_interval_s ({} s), got {entry_ttl_s}",
                4.0 * publish_interval_s
            ));
        }
        Ok(())
    }
}

/// A number with at most three decimals and no trailing zeros.
fn trimmed(value: f64) -> String {
    let text = format!("{value:.3}");
    let text = text.trim_end_matches('0').trim_end_matches('.');
    text.to_owned()
}

/// The router side.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RouterConfig {
    /// Every replica polls every worker this often, seconds.
    pub poll_interval_s: f64,
    /// From sending a poll to its completion, seconds.
    pub poll_latency_s: f64,
    /// The policies' `stale_after`; default 3 × the poll interval.
    pub stale_after_s: Option<f64>,
    /// Router replicas, each with its own policy instance and poll phase.
    pub replicas: u32,
    /// Replica `r`'s polls are offset by this phase (default: spread).
    pub replica_phase: PhaseMode,
    /// The share of arrivals the first replica takes, the others splitting
    /// the rest evenly (default: all alike): clients that do not spread
    /// over the replicas evenly. In (0, 1).
    pub first_replica_share: Option<f64>,
    /// Worker `w`'s polls are offset by this phase (default: aligned).
    pub worker_phase: PhaseMode,
    pub report_at: ReportAt,
    /// Sweep: run every poll interval listed instead of `poll_interval_s`.
    pub sweep_poll_interval_s: Option<Vec<f64>>,
    /// Sweep: run every replica count listed instead of `replicas`.
    pub sweep_replicas: Option<Vec<u32>>,
    /// How replicas share their pending work (default: off).
    pub sync: SyncConfig,
    /// Sweep: run every sync setting listed instead of `sync`, at each point
    /// of the other sweep (one replica runs once, without sync: it has no
    /// one to share with).
    pub sweep_sync: Option<Vec<SyncConfig>>,
    /// The admission room in each replica (default: none, dispatch at once).
    pub admission: Option<AdmissionConfig>,
}

impl Default for RouterConfig {
    fn default() -> RouterConfig {
        RouterConfig {
            poll_interval_s: 1.0,
            poll_latency_s: 0.002,
            stale_after_s: None,
            replicas: 1,
            replica_phase: PhaseMode::Spread,
            first_replica_share: None,
            worker_phase: PhaseMode::Aligned,
            report_at: ReportAt::Send,
            sweep_poll_interval_s: None,
            sweep_replicas: None,
            sync: SyncConfig::default(),
            sweep_sync: None,
            admission: None,
        }
    }
}

/// The order of a router replica's admission room (`admission`'s registry
/// names), or `off`: no room, every request dispatched at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AdmissionOrder {
    #[default]
    Off,
    Fifo,
    Priority,
    FairShare,
}

impl AdmissionOrder {
    /// The name in reports, and the order's registry name.
    pub fn as_str(self) -> &'static str {
        match self {
            AdmissionOrder::Off => "off",
            AdmissionOrder::Fifo => admission::FIFO,
            AdmissionOrder::Priority => admission::PRIORITY,
            AdmissionOrder::FairShare => admission::FAIR_SHARE,
        }
    }

    pub fn is_off(self) -> bool {
        self == AdmissionOrder::Off
    }
}

/// `[router.admission]`: each replica's admission room, as the router's
/// `[admission]` section sets it (`admission::RoomConfig`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdmissionConfig {
    /// The room's order, or `off`.
    #[serde(default)]
    pub order: AdmissionOrder,
    /// Sweep: run every order listed instead of `order`, at each point of
    /// the other sweeps.
    pub sweep_order: Option<Vec<AdmissionOrder>>,
    /// A request waits in the router while every worker's expected wait is
    /// above this, seconds (default `admission::DEFAULT_QUEUE_ABOVE_WAIT_MS`).
    pub queue_above_wait_s: Option<f64>,
    /// The same threshold while there is something to reorder (default
    /// `admission::DEFAULT_REORDER_ABOVE_WAIT_MS`).
    pub reorder_above_wait_s: Option<f64>,
    /// Requests beyond this many waiting are turned away (default
    /// `admission::DEFAULT_MAX_QUEUE_REQUESTS`).
    pub max_queue_requests: Option<usize>,
    /// Named classes of priority values (default: each value its own class).
    #[serde(default)]
    pub classes: Vec<AdmissionClassConfig>,
    /// Tenants' weights within a class (`fair_share`); others weigh 1.
    #[serde(default)]
    pub tenant_weights: BTreeMap<String, f64>,
}

/// One class of the room: the priority values up to `priority`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdmissionClassConfig {
    pub name: String,
    pub priority: i32,
    /// Its share when classes compete (default
    /// `admission::default_class_weight(priority)`).
    pub weight: Option<f64>,
    /// The TTFT deadline of its requests that carry none, seconds.
    pub ttft_deadline_s: Option<f64>,
}

impl AdmissionConfig {
    /// The orders run: the sweep's, or the one order.
    pub fn orders(&self) -> Vec<AdmissionOrder> {
        self.sweep_order.clone().unwrap_or_else(|| vec![self.order])
    }

    /// The room's config, validated by the room's own rules; the message
    /// names the offending key.
    pub fn room_config(&self) -> Result<RoomConfig, String> {
        let defaults = RoomConfig::default();
        let queue_above_wait = match self.queue_above_wait_s {
            Some(secs) => Duration::try_from_secs_f64(secs).map_err(|_| {
                format!("queue_above_wait_s must be finite and not negative, got {secs}")
            })?,
            None => defaults.queue_above_wait,
        };
        let mut classes = Vec::with_capacity(self.classes.len());
        for class in &self.classes {
            let ttft_deadline = match class.ttft_deadline_s {
                Some(secs) => Some(positive_duration(secs).ok_or_else(|| {
                    format!(
                        "class {:?}: ttft_deadline_s must be finite and positive, got {secs}",
                        class.name
                    )
                })?),
                None => None,
            };
            classes.push(ClassConfig {
                name: class.name.clone(),
                priority: class.priority,
                weight: class
                    .weight
                    .unwrap_or_else(|| admission::default_class_weight(class.priority)),
                ttft_deadline,
            });
        }
        let reorder_above_wait = match self.reorder_above_wait_s {
            Some(secs) => Duration::try_from_secs_f64(secs).map_err(|_| {
                format!("reorder_above_wait_s must be finite and not negative, got {secs}")
            })?,
            None => defaults.reorder_above_wait,
        };
        RoomConfig {
            queue_above_wait,
            reorder_above_wait,
            max_queue_requests: self
                .max_queue_requests
                .unwrap_or(defaults.max_queue_requests),
            classes,
            tenant_weights: self.tenant_weights.clone(),
            peer_lag: defaults.peer_lag,
        }
        .validated()
        .map_err(|error| error.to_string())
    }
}

/// A positive, finite number of seconds as a duration.
fn positive_duration(secs: f64) -> Option<Duration> {
    (secs.is_finite() && secs > 0.0)
        .then(|| Duration::try_from_secs_f64(secs).ok())
        .flatten()
}

/// One router-side setting of a run (one point of a sweep).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouterPoint {
    pub poll_interval_s: f64,
    pub stale_after_s: f64,
    pub poll_latency_s: f64,
    pub replicas: u32,
    pub replica_phase: PhaseMode,
    /// The first replica's share of arrivals (`None`: all alike).
    pub first_replica_share: Option<f64>,
    pub worker_phase: PhaseMode,
    pub report_at: ReportAt,
    /// Whether this point is part of a poll-interval sweep (report the interval per row).
    pub sweeps_poll_interval: bool,
    /// Whether this point is part of a replica sweep (report replicas per row).
    pub sweeps_replicas: bool,
    /// How the replicas share their pending work (always off with one).
    pub sync: SyncConfig,
    /// Whether this point is part of a sync sweep, or sync is on (report
    /// the sync setting per row).
    pub sweeps_sync: bool,
    /// Each replica's admission room's order (`off`: none).
    pub admission: AdmissionOrder,
    /// Whether the scenario sets admission (report the order per row).
    pub sweeps_admission: bool,
}

/// The arrival process.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "process", rename_all = "kebab-case", deny_unknown_fields)]
pub enum ArrivalConfig {
    /// Exponential gaps at the target rate.
    Poisson {},
    /// On/off: Poisson at `burst_factor` × the mean rate during bursts of mean
    /// `mean_burst_s` (exponential), silent in between (mean
    /// `mean_burst_s × (burst_factor − 1)`), so the mean rate is the target.
    OnOff {
        burst_factor: f64,
        mean_burst_s: f64,
    },
    /// A CSV trace (`arrival_s,prompt_tokens,output_tokens`, one request per
    /// line, optional header), time-scaled to the target rate and repeated if
    /// more requests are asked for than it holds. `prompt` and `output` must
    /// then be absent.
    Trace { path: PathBuf },
}

/// A fraction of requests that open with one of a few shared prefixes.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SharedPrefixConfig {
    /// Share of requests with a shared prefix, in `[0, 1]`.
    pub fraction: f64,
    /// Length of each shared prefix, tokens (cut to the prompt's length).
    pub tokens: u32,
    /// How many distinct prefixes (chosen uniformly).
    #[serde(default = "one")]
    pub groups: u32,
}

fn one() -> u32 {
    1
}

/// Multi-turn conversations: each session belongs to one of `apps` apps and
/// opens with that app's system prompt; turn `k + 1` resends turn `k`'s
/// prompt, its answer and a new user message (the traffic's `prompt`
/// distribution); turns are `think_time_s` apart on average (exponential,
/// open loop: a turn does not wait for the previous answer); the number of
/// turns is geometric with mean `mean_turns`, at most `max_turns`, and a
/// session ends early when its next prompt would exceed `max_context_tokens`.
/// Sessions start at the traffic's arrival process, at the request rate
/// divided by the mean turns a session really has. A turn an admission room
/// turns away ends its session by default (`turned_away`).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConversationConfig {
    /// Distinct apps, each with its own system prompt, ≥ 1.
    #[serde(default = "four")]
    pub apps: u32,
    /// Length of every app's system prompt, tokens, ≥ 1.
    pub system_tokens: u32,
    /// Mean turns per session (geometric), ≥ 1.
    pub mean_turns: f64,
    /// Turns per session at most, ≥ 1.
    #[serde(default = "thirty_two")]
    pub max_turns: u32,
    /// Mean think time between a session's turns, seconds, ≥ 0.
    pub think_time_s: f64,
    /// A session ends before a prompt longer than this, tokens.
    #[serde(default = "context_default")]
    pub max_context_tokens: u32,
    /// What a session does when an admission room turns one of its turns
    /// away.
    #[serde(default)]
    pub turned_away: TurnedAway,
}

/// What a session does after a turn of it is turned away.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TurnedAway {
    /// The session ends: its later turns, each of which would resend that
    /// turn's answer, are not sent. A client whose request is refused has
    /// no answer to build its next message on.
    #[default]
    Ends,
    /// Its later turns are sent as drawn, as if the answer had come.
    Continues,
}

fn four() -> u32 {
    4
}

fn thirty_two() -> u32 {
    32
}

fn context_default() -> u32 {
    32_768
}

/// One router replica restarts at `at_fraction` of the last arrival's time:
/// its policy is replaced by a fresh one (no load, no learned rate, an
/// empty prefix index), which with `warm` first loads another replica's
/// prefix snapshot, as a starting router does. Its requests arriving in
/// the `window_s` after the restart are measured against those in the
/// `window_s` before. Cells with fewer replicas than `replica + 1` run
/// without it.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RestartConfig {
    pub replica: u32,
    pub at_fraction: f64,
    #[serde(default)]
    pub warm: bool,
    #[serde(default = "restart_window_default")]
    pub window_s: f64,
}

fn restart_window_default() -> f64 {
    30.0
}

/// One worker's speed change: from `at_s` (or `at_fraction` of the last
/// arrival's time) on, worker `worker` (0-based, in fleet order) runs at
/// `factor` × its nominal speed (`Engine::set_speed`).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlowdownConfig {
    pub worker: u32,
    /// When, as a share of the last arrival's time, in (0, 1).
    pub at_fraction: Option<f64>,
    /// When, in virtual seconds (instead of `at_fraction`).
    pub at_s: Option<f64>,
    /// The new speed as a multiple of the nominal one, > 0.
    pub factor: f64,
}

impl SlowdownConfig {
    /// The moment of the change in a run whose last request arrives at
    /// `last_arrival_s`.
    pub fn at_s(&self, last_arrival_s: f64) -> f64 {
        match (self.at_s, self.at_fraction) {
            (Some(at_s), _) => at_s,
            (None, Some(fraction)) => fraction * last_arrival_s,
            (None, None) => 0.0,
        }
    }
}

/// One traffic mix.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrafficConfig {
    /// The `traffic` value of the report rows (`uniform`, `size-skew`, …).
    pub name: String,
    pub arrival: ArrivalConfig,
    pub prompt: Option<LengthDist>,
    pub output: Option<LengthDist>,
    pub shared_prefix: Option<SharedPrefixConfig>,
    /// Multi-turn sessions; `prompt` is then each turn's new user message.
    pub conversation: Option<ConversationConfig>,
    /// Priority classes, each drawn with its share (default: none, every
    /// request without a priority).
    #[serde(default)]
    pub classes: Vec<TrafficClass>,
    /// Tenants, each drawn with its share of the arrivals (default: none).
    #[serde(default)]
    pub tenants: Vec<TrafficTenant>,
    /// Every request's TTFT deadline, seconds, unless its class sets one.
    pub ttft_deadline_s: Option<f64>,
}

/// A priority class of a traffic mix: its requests' priority value (lower
/// first) and their share of the arrivals (relative to the other classes').
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrafficClass {
    pub priority: i32,
    pub share: f64,
    /// The TTFT deadline of this class's requests, seconds (over the
    /// traffic's `ttft_deadline_s`).
    pub ttft_deadline_s: Option<f64>,
}

/// A tenant of a traffic mix and its share of the arrivals (relative to
/// the other tenants'). With `alone`, the simulator also runs this tenant's
/// requests by themselves: the same requests, the others left out, as the
/// traffic `<name>-<tenant>-alone`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrafficTenant {
    pub name: String,
    pub share: f64,
    #[serde(default)]
    pub alone: bool,
}

impl TrafficConfig {
    /// Whether its requests carry a class, a tenant or a deadline.
    pub fn is_labelled(&self) -> bool {
        !self.classes.is_empty() || !self.tenants.is_empty() || self.ttft_deadline_s.is_some()
    }

    /// The name of the traffic of `tenant`'s requests alone.
    pub fn alone_name(&self, tenant: &str) -> String {
        format!("{}-{tenant}-alone", self.name)
    }
}

impl ConversationConfig {
    /// Checks the parameters: `(key, message)` on the first bad one.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        if self.apps == 0 {
            return Err(("apps", "must be at least 1".into()));
        }
        if self.system_tokens == 0 {
            return Err(("system_tokens", "must be at least 1".into()));
        }
        if !(self.mean_turns.is_finite() && self.mean_turns >= 1.0) {
            return Err((
                "mean_turns",
                format!("must be finite and at least 1, got {}", self.mean_turns),
            ));
        }
        if self.max_turns == 0 {
            return Err(("max_turns", "must be at least 1".into()));
        }
        if !(self.think_time_s.is_finite() && self.think_time_s >= 0.0) {
            return Err((
                "think_time_s",
                format!("must be finite and not negative, got {}", self.think_time_s),
            ));
        }
        if self.max_context_tokens <= self.system_tokens {
            return Err((
                "max_context_tokens",
                format!(
                    "must exceed system_tokens ({}), got {}",
                    self.system_tokens, self.max_context_tokens
                ),
            ));
        }
        Ok(())
    }
}

impl Scenario {
    /// Reads, parses and validates a scenario file. Relative trace paths are
    /// resolved against the file's directory.
    pub fn from_path(path: &Path) -> Result<Scenario, SimError> {
        let text = std::fs::read_to_string(path).map_err(|source| SimError::Read {
            path: path.to_owned(),
            source,
        })?;
        let base_dir = path.parent().map(Path::to_owned).unwrap_or_default();
        Scenario::from_toml_str(&text, path, base_dir)
    }

    /// Parses and validates a scenario from TOML text; `origin` names it in errors.
    pub fn from_toml_str(
        text: &str,
        origin: &Path,
        base_dir: PathBuf,
    ) -> Result<Scenario, SimError> {
        let mut scenario: Scenario = toml::from_str(text).map_err(|source| SimError::Parse {
            path: origin.to_owned(),
            source: Box::new(source),
        })?;
        scenario.base_dir = base_dir;
        scenario.validate()?;
        Ok(scenario)
    }

    /// Multiplies the request count (at least 1 request).
    pub fn scale_requests(&mut self, factor: f64) -> Result<(), SimError> {
        if !(factor.is_finite() && factor > 0.0) {
            return Err(self.invalid(
                "requests_scale",
                format!("must be finite and positive, got {factor}"),
            ));
        }
        self.requests = ((self.requests as f64 * factor).round() as u64).max(1);
        Ok(())
    }

    /// Total number of workers.
    pub fn workers(&self) -> u32 {
        self.fleet.iter().map(|group| group.count).sum()
    }

    /// One entry per worker: how it reports load and its engine parameters.
    pub fn worker_specs(&self) -> Vec<(LoadReport, EngineParams)> {
        self.fleet
            .iter()
            .flat_map(|group| (0..group.count).map(|_| (group.load_report, group.engine.clone())))
            .collect()
    }

    /// The router settings to run: one per sweep value, or just one; with
    /// a sync sweep, one per sync setting at each of those (one replica
    /// once, without sync).
    pub fn router_points(&self) -> Vec<RouterPoint> {
        let router = &self.router;
        let syncs: Vec<SyncConfig> = router
            .sweep_sync
            .clone()
            .unwrap_or_else(|| vec![router.sync]);
        let sweeps_sync = router.sweep_sync.is_some() || !router.sync.is_off();
        let admissions = router
            .admission
            .as_ref()
            .map_or_else(|| vec![AdmissionOrder::Off], AdmissionConfig::orders);
        let sweeps_admission = router.admission.is_some();
        let point = |poll_interval_s: f64,
                     replicas: u32,
                     sync: SyncConfig,
                     admission: AdmissionOrder| RouterPoint {
            poll_interval_s,
            stale_after_s: router.stale_after_s.unwrap_or(3.0 * poll_interval_s),
            poll_latency_s: router.poll_latency_s,
            replicas,
            replica_phase: router.replica_phase,
            first_replica_share: router.first_replica_share,
            worker_phase: router.worker_phase,
            report_at: router.report_at,
            sweeps_poll_interval: router.sweep_poll_interval_s.is_some(),
            sweeps_replicas: router.sweep_replicas.is_some(),
            sync,
            sweeps_sync,
            admission,
            sweeps_admission,
        };
        let bases: Vec<(f64, u32)> = if let Some(intervals) = &router.sweep_poll_interval_s {
            intervals.iter().map(|&i| (i, router.replicas)).collect()
        } else if let Some(replicas) = &router.sweep_replicas {
            replicas
                .iter()
                .map(|&r| (router.poll_interval_s, r))
                .collect()
        } else {
            vec![(router.poll_interval_s, router.replicas)]
        };
        let mut points = Vec::new();
        for (poll_interval_s, replicas) in bases {
            let syncs = if replicas == 1 {
                &[SyncConfig::Off {}][..]
            } else {
                &syncs[..]
            };
            for &sync in syncs {
                for &admission in &admissions {
                    points.push(point(poll_interval_s, replicas, sync, admission));
                }
            }
        }
        points
    }

    /// Each replica's admission room config, when the scenario sets
    /// admission (validated).
    pub fn room_config(&self) -> Result<Option<RoomConfig>, SimError> {
        self.router
            .admission
            .as_ref()
            .map(|admission| {
                admission
                    .room_config()
                    .map_err(|message| self.invalid("router.admission", message))
            })
            .transpose()
    }

    /// Whether the report counts each request's outcome (served in time,
    /// late, turned away), by class and tenant: with admission, or traffic
    /// with classes, tenants or deadlines.
    pub fn reports_outcomes(&self) -> bool {
        self.router.admission.is_some() || self.traffic.iter().any(TrafficConfig::is_labelled)
    }

    fn invalid(&self, field: &str, message: impl Into<String>) -> SimError {
        SimError::Invalid {
            scenario: self.name.clone(),
            field: field.to_owned(),
            message: message.into(),
        }
    }

    /// Checks every value's range.
    pub fn validate(&self) -> Result<(), SimError> {
        if self.name.trim().is_empty() {
            return Err(self.invalid("name", "must not be empty"));
        }
        if self.requests == 0 {
            return Err(self.invalid("requests", "must be at least 1"));
        }
        if self.utilizations.is_empty() {
            return Err(self.invalid("utilizations", "must list at least one load level"));
        }
        for &u in &self.utilizations {
            if !(u.is_finite() && u > 0.0 && u <= MAX_UTILIZATION) {
                return Err(self.invalid(
                    "utilizations",
                    format!("must each be in (0, {MAX_UTILIZATION}], got {u}"),
                ));
            }
        }
        if self.policies.is_empty() {
            return Err(self.invalid("policies", "must list at least one policy"));
        }
        for (i, policy) in self.policies.iter().enumerate() {
            if self.policies[..i].contains(policy) {
                return Err(self.invalid("policies", format!("lists {} twice", policy.as_str())));
            }
        }
        self.validate_fleet()?;
        self.validate_router()?;
        self.validate_traffic()?;
        self.validate_slowdown()?;
        self.validate_restart()
    }

    fn validate_restart(&self) -> Result<(), SimError> {
        let Some(restart) = &self.restart else {
            return Ok(());
        };
        if !(restart.at_fraction > 0.0 && restart.at_fraction < 1.0) {
            return Err(self.invalid(
                "restart.at_fraction",
                format!("must be in (0, 1), got {}", restart.at_fraction),
            ));
        }
        if !(restart.window_s.is_finite() && restart.window_s > 0.0) {
            return Err(self.invalid(
                "restart.window_s",
                format!("must be finite and positive, got {}", restart.window_s),
            ));
        }
        Ok(())
    }

    fn validate_slowdown(&self) -> Result<(), SimError> {
        let Some(slowdown) = &self.slowdown else {
            return Ok(());
        };
        if slowdown.worker >= self.workers() {
            return Err(self.invalid(
                "slowdown.worker",
                format!(
                    "must name one of the {} workers (0-based), got {}",
                    self.workers(),
                    slowdown.worker
                ),
            ));
        }
        match (slowdown.at_fraction, slowdown.at_s) {
            (Some(fraction), None) => {
                if !(fraction.is_finite() && fraction > 0.0 && fraction < 1.0) {
                    return Err(self.invalid(
                        "slowdown.at_fraction",
                        format!("must be in (0, 1), got {fraction}"),
                    ));
                }
            }
            (None, Some(at_s)) => {
                if !(at_s.is_finite() && at_s >= 0.0) {
                    return Err(self.invalid(
                        "slowdown.at_s",
                        format!("must be finite and not negative, got {at_s}"),
                    ));
                }
            }
            _ => {
                return Err(self.invalid("slowdown", "needs exactly one of at_fraction and at_s"));
            }
        }
        if !(slowdown.factor.is_finite() && slowdown.factor > 0.0) {
            return Err(self.invalid(
                "slowdown.factor",
                format!("must be finite and positive, got {}", slowdown.factor),
            ));
        }
        Ok(())
    }

    fn validate_fleet(&self) -> Result<(), SimError> {
        if self.fleet.is_empty() {
            return Err(self.invalid("fleet", "must have at least one worker group"));
        }
        let mut total: u64 = 0;
        for (i, group) in self.fleet.iter().enumerate() {
            if group.count == 0 {
                return Err(self.invalid(&format!("fleet[{i}].count"), "must be at least 1"));
            }
            total += u64::from(group.count);
            group
                .engine
                .validate()
                .map_err(|error| self.invalid(&format!("fleet[{i}].engine"), error.to_string()))?;
        }
        if total > u64::from(MAX_WORKERS) {
            return Err(self.invalid(
                "fleet",
                format!("has {total} workers, at most {MAX_WORKERS}"),
            ));
        }
        Ok(())
    }

    fn validate_router(&self) -> Result<(), SimError> {
        let router = &self.router;
        let interval = |field: &str, value: f64| {
            if value.is_finite() && value > 0.0 {
                Ok(())
            } else {
                Err(self.invalid(field, format!("must be finite and positive, got {value}")))
            }
        };
        interval("router.poll_interval_s", router.poll_interval_s)?;
        if !(router.poll_latency_s.is_finite() && router.poll_latency_s >= 0.0) {
            return Err(self.invalid(
                "router.poll_latency_s",
                format!(
                    "must be finite and not negative, got {}",
                    router.poll_latency_s
                ),
            ));
        }
        let replicas = |field: &str, value: u32| {
            if (1..=MAX_REPLICAS).contains(&value) {
                Ok(())
            } else {
                Err(self.invalid(field, format!("must be in 1..={MAX_REPLICAS}, got {value}")))
            }
        };
        replicas("router.replicas", router.replicas)?;
        if let Some(share) = router.first_replica_share
            && !(share > 0.0 && share < 1.0)
        {
            return Err(self.invalid(
                "router.first_replica_share",
                format!("must be in (0, 1), got {share}"),
            ));
        }
        if router.sweep_poll_interval_s.is_some() && router.sweep_replicas.is_some() {
            return Err(self.invalid(
                "router",
                "sweeps sweep_poll_interval_s or sweep_replicas, not both (sweep_sync goes with either)",
            ));
        }
        router
            .sync
            .validate()
            .map_err(|message| self.invalid("router.sync", message))?;
        if let Some(syncs) = &router.sweep_sync {
            if syncs.is_empty() {
                return Err(self.invalid("router.sweep_sync", "must not be empty"));
            }
            for (i, sync) in syncs.iter().enumerate() {
                sync.validate()
                    .map_err(|message| self.invalid(&format!("router.sweep_sync[{i}]"), message))?;
                if syncs[..i].contains(sync) {
                    return Err(self.invalid(
                        &format!("router.sweep_sync[{i}]"),
                        format!("lists sync {} twice", sync.label()),
                    ));
                }
            }
        }
        if let Some(intervals) = &router.sweep_poll_interval_s {
            if intervals.is_empty() {
                return Err(self.invalid("router.sweep_poll_interval_s", "must not be empty"));
            }
            for &value in intervals {
                interval("router.sweep_poll_interval_s", value)?;
            }
        }
        if let Some(counts) = &router.sweep_replicas {
            if counts.is_empty() {
                return Err(self.invalid("router.sweep_replicas", "must not be empty"));
            }
            for &value in counts {
                replicas("router.sweep_replicas", value)?;
            }
        }
        if let Some(admission) = &router.admission {
            if let Some(orders) = &admission.sweep_order {
                if orders.is_empty() {
                    return Err(self.invalid("router.admission.sweep_order", "must not be empty"));
                }
                for (i, order) in orders.iter().enumerate() {
                    if orders[..i].contains(order) {
                        return Err(self.invalid(
                            "router.admission.sweep_order",
                            format!("lists {} twice", order.as_str()),
                        ));
                    }
                }
            }
            if admission.max_queue_requests == Some(0) {
                return Err(
                    self.invalid("router.admission.max_queue_requests", "must be at least 1")
                );
            }
            self.room_config()?;
        }
        if let Some(stale) = router.stale_after_s {
            for point in self.router_points() {
                if !(stale.is_finite() && stale > point.poll_interval_s) {
                    return Err(self.invalid(
                        "router.stale_after_s",
                        format!(
                            "must exceed the poll interval ({} s), got {stale}",
                            point.poll_interval_s
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    fn validate_traffic(&self) -> Result<(), SimError> {
        if self.traffic.is_empty() {
            return Err(self.invalid("traffic", "must list at least one traffic mix"));
        }
        let min_kv_tokens = self
            .fleet
            .iter()
            .map(|group| group.engine.kv_capacity_tokens)
            .min()
            .unwrap_or(0);
        for (i, traffic) in self.traffic.iter().enumerate() {
            let field = |name: &str| format!("traffic[{i}].{name}");
            if traffic.name.trim().is_empty() {
                return Err(self.invalid(&field("name"), "must not be empty"));
            }
            if self.traffic[..i].iter().any(|t| t.name == traffic.name) {
                return Err(
                    self.invalid(&field("name"), format!("{:?} is used twice", traffic.name))
                );
            }
            match &traffic.arrival {
                ArrivalConfig::Poisson {} => {}
                ArrivalConfig::OnOff {
                    burst_factor,
                    mean_burst_s,
                } => {
                    if !(burst_factor.is_finite() && *burst_factor > 1.0) {
                        return Err(self.invalid(
                            &field("arrival.burst_factor"),
                            format!("must be finite and above 1, got {burst_factor}"),
                        ));
                    }
                    if !(mean_burst_s.is_finite() && *mean_burst_s > 0.0) {
                        return Err(self.invalid(
                            &field("arrival.mean_burst_s"),
                            format!("must be finite and positive, got {mean_burst_s}"),
                        ));
                    }
                }
                ArrivalConfig::Trace { .. } => {
                    if traffic.prompt.is_some() || traffic.output.is_some() {
                        return Err(self.invalid(
                            &field("prompt"),
                            "and output must be absent with a trace: the trace gives the lengths",
                        ));
                    }
                }
            }
            let is_trace = matches!(traffic.arrival, ArrivalConfig::Trace { .. });
            let mut max_tokens = 0u64;
            for (name, dist) in [("prompt", &traffic.prompt), ("output", &traffic.output)] {
                match dist {
                    Some(dist) => {
                        dist.validate()
                            .map_err(|message| self.invalid(&field(name), message))?;
                        max_tokens += u64::from(dist.max_tokens());
                    }
                    None if !is_trace => {
                        return Err(
                            self.invalid(&field(name), "is required (a length distribution)")
                        );
                    }
                    None => {}
                }
            }
            if let Some(conversation) = &traffic.conversation {
                if is_trace {
                    return Err(self.invalid(&field("conversation"), "cannot be used with a trace"));
                }
                if traffic.shared_prefix.is_some() {
                    return Err(self.invalid(
                        &field("conversation"),
                        "and shared_prefix cannot be combined (the system prompt is the shared prefix)",
                    ));
                }
                conversation.validate().map_err(|(key, message)| {
                    self.invalid(&field(&format!("conversation.{key}")), message)
                })?;
                let output_max = traffic.output.map_or(0, |d| u64::from(d.max_tokens()));
                max_tokens = u64::from(conversation.max_context_tokens) + output_max;
            }
            if max_tokens > min_kv_tokens {
                return Err(self.invalid(
                    &field("prompt"),
                    format!(
                        "the longest prompt plus output ({max_tokens} tokens) exceeds the smallest \
                         kv_capacity_tokens ({min_kv_tokens})"
                    ),
                ));
            }
            self.validate_labels(i, traffic)?;
            if let Some(prefix) = &traffic.shared_prefix {
                if !(prefix.fraction.is_finite() && (0.0..=1.0).contains(&prefix.fraction)) {
                    return Err(self.invalid(
                        &field("shared_prefix.fraction"),
                        format!("must be in [0, 1], got {}", prefix.fraction),
                    ));
                }
                if prefix.tokens == 0 {
                    return Err(self.invalid(&field("shared_prefix.tokens"), "must be at least 1"));
                }
                if prefix.groups == 0 {
                    return Err(self.invalid(&field("shared_prefix.groups"), "must be at least 1"));
                }
            }
        }
        Ok(())
    }

    /// Checks a traffic mix's classes, tenants and deadlines.
    fn validate_labels(&self, i: usize, traffic: &TrafficConfig) -> Result<(), SimError> {
        let field = |name: &str| format!("traffic[{i}].{name}");
        let deadline = |name: &str, value: Option<f64>| match value {
            Some(secs) if positive_duration(secs).is_none() => Err(self.invalid(
                &field(name),
                format!("must be finite and positive, got {secs}"),
            )),
            _ => Ok(()),
        };
        let share = |name: &str, value: f64| {
            if value.is_finite() && value > 0.0 {
                Ok(())
            } else {
                Err(self.invalid(
                    &field(name),
                    format!("must be finite and positive, got {value}"),
                ))
            }
        };
        deadline("ttft_deadline_s", traffic.ttft_deadline_s)?;
        for (c, class) in traffic.classes.iter().enumerate() {
            share(&format!("classes[{c}].share"), class.share)?;
            deadline(
                &format!("classes[{c}].ttft_deadline_s"),
                class.ttft_deadline_s,
            )?;
            if traffic.classes[..c]
                .iter()
                .any(|other| other.priority == class.priority)
            {
                return Err(self.invalid(
                    &field(&format!("classes[{c}].priority")),
                    format!("{} is used twice", class.priority),
                ));
            }
        }
        for (t, tenant) in traffic.tenants.iter().enumerate() {
            share(&format!("tenants[{t}].share"), tenant.share)?;
            if tenant.name.trim().is_empty() {
                return Err(
                    self.invalid(&field(&format!("tenants[{t}].name")), "must not be empty")
                );
            }
            if traffic.tenants[..t]
                .iter()
                .any(|other| other.name == tenant.name)
            {
                return Err(self.invalid(
                    &field(&format!("tenants[{t}].name")),
                    format!("{:?} is used twice", tenant.name),
                ));
            }
            if tenant.alone {
                let alone = traffic.alone_name(&tenant.name);
                if self.traffic_names().filter(|name| *name == alone).count() > 1 {
                    return Err(self.invalid(
                        &field(&format!("tenants[{t}].alone")),
                        format!("names the traffic {alone:?}, which is used already"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Every traffic's name, and the names of the tenants' `alone` runs.
    fn traffic_names(&self) -> impl Iterator<Item = String> + '_ {
        self.traffic.iter().flat_map(|traffic| {
            std::iter::once(traffic.name.clone()).chain(
                traffic
                    .tenants
                    .iter()
                    .filter(|tenant| tenant.alone)
                    .map(|tenant| traffic.alone_name(&tenant.name)),
            )
        })
    }

    /// Loads the traces of the traffic mixes that use one (`None` for the others).
    pub fn load_traces(&self) -> Result<Vec<Option<Trace>>, SimError> {
        self.traffic
            .iter()
            .map(|traffic| match &traffic.arrival {
                ArrivalConfig::Trace { path } => {
                    let path = if path.is_absolute() {
                        path.clone()
                    } else {
                        self.base_dir.join(path)
                    };
                    Trace::from_path(&path).map(Some)
                }
                _ => Ok(None),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
name = "t"
seed = 1
requests = 10
utilizations = [0.5]
[[fleet]]
count = 2
flavour = "sglang"
[[traffic]]
name = "uniform"
arrival = { process = "poisson" }
prompt = { dist = "constant", tokens = 200 }
output = { dist = "constant", tokens = 10 }
"#;

    fn parse(text: &str) -> Result<Scenario, SimError> {
        Scenario::from_toml_str(text, Path::new("test.toml"), PathBuf::new())
    }

    #[test]
    fn a_session_ends_at_a_turn_turned_away_unless_the_traffic_says_it_goes_on() {
        let with = |extra: &str| {
            let conversation = format!(
                "tokens = 10 }}\nconversation = {{ system_tokens = 100, mean_turns = 2.0, think_time_s = 1.0{extra} }}"
            );
            let text = MINIMAL.replacen("tokens = 10 }", &conversation, 1);
            parse(&text).unwrap().traffic[0]
                .conversation
                .unwrap()
                .turned_away
        };
        assert_eq!(with(""), TurnedAway::Ends);
        assert_eq!(with(", turned_away = \"continues\""), TurnedAway::Continues);
        assert_eq!(with(", turned_away = \"ends\""), TurnedAway::Ends);
    }

    fn error_text(error: &SimError) -> String {
        let mut text = error.to_string();
        let mut source = std::error::Error::source(error);
        while let Some(cause) = source {
            text.push_str(": ");
            text.push_str(&cause.to_string());
            source = cause.source();
        }
        text
    }

    #[test]
    fn a_minimal_scenario_takes_the_defaults() {
        let scenario = parse(MINIMAL).unwrap();
        assert_eq!(scenario.workers(), 2);
        assert_eq!(scenario.policies, PolicyName::ALL.to_vec());
        assert_eq!(scenario.router, RouterConfig::default());
        let points = scenario.router_points();
        assert_eq!(points.len(), 1);
        assert_eq!(points[0].stale_after_s, 3.0);
        assert_eq!(scenario.fleet[0].engine, EngineParams::default());
    }

    #[test]
    fn unknown_keys_are_errors_everywhere() {
        for (extra, key) in [
            ("colour = 1\n", "colour"),
            ("[router]\npoll_intervall_s = 1.0\n", "poll_intervall_s"),
        ] {
            let text = format!("{MINIMAL}{extra}");
            let text = if extra.starts_with('[') {
                text
            } else {
                format!("{extra}{MINIMAL}")
            };
            let error = parse(&text).unwrap_err();
            let message = error_text(&error);
            assert!(
                message.contains(&format!("unknown field `{key}`")),
                "{message}"
            );
        }
        let text = MINIMAL.replace("count = 2", "count = 2\nspeed = 3");
        assert!(error_text(&parse(&text).unwrap_err()).contains("unknown field `speed`"));
        let text = MINIMAL.replace(
            "flavour = \"sglang\"",
            "flavour = \"sglang\"\n[fleet.engine]\nprefill_tpz = 1.0",
        );
        assert!(error_text(&parse(&text).unwrap_err()).contains("unknown field `prefill_tpz`"));
        let text = MINIMAL.replace("tokens = 200 }", "tokens = 200, mean = 3 }");
        assert!(error_text(&parse(&text).unwrap_err()).contains("unknown field `mean`"));
        let text = MINIMAL.replace("process = \"poisson\"", "process = \"poisson\", rate = 3");
        assert!(error_text(&parse(&text).unwrap_err()).contains("unknown field `rate`"));
    }

    #[test]
    fn every_load_report_is_a_registered_backend_and_parses_by_its_name() {
        let mut registry = policy_core::BackendRegistry::new();
        backends_sglang::register(&mut registry);
        backends_vllm::register(&mut registry);
        backends_tokenspeed::register(&mut registry);
        for report in LoadReport::ALL {
            let name = report.backend_name();
            assert!(registry.contains(name), "{name}");
            let text = MINIMAL.replace("flavour = \"sglang\"", &format!("flavour = \"{name}\""));
            assert_eq!(parse(&text).unwrap().fleet[0].load_report, report);
        }
    }

    #[test]
    fn unknown_names_are_errors() {
        let text = MINIMAL.replace("flavour = \"sglang\"", "flavour = \"trt\"");
        assert!(error_text(&parse(&text).unwrap_err()).contains("unknown variant `trt`"));
        let text = format!("policies = [\"fastest\"]\n{MINIMAL}");
        assert!(error_text(&parse(&text).unwrap_err()).contains("unknown variant `fastest`"));
        let text = MINIMAL.replace(
            "dist = \"constant\", tokens = 200",
            "dist = \"zipf\", tokens = 200",
        );
        assert!(error_text(&parse(&text).unwrap_err()).contains("unknown variant `zipf`"));
    }

    #[test]
    fn impossible_values_are_clear_errors() {
        let cases: [(&str, &str, &str); 18] = [
            (
                "utilizations = [0.5]",
                "utilizations = [4.5]",
                "utilizations must each be in (0, 4], got 4.5",
            ),
            (
                "utilizations = [0.5]",
                "utilizations = []",
                "utilizations must list at least one",
            ),
            (
                "requests = 10",
                "requests = 0",
                "requests must be at least 1",
            ),
            (
                "count = 2",
                "count = 0",
                "fleet[0].count must be at least 1",
            ),
            (
                "tokens = 200 }",
                "tokens = 0 }",
                "traffic[0].prompt tokens must be at least 1",
            ),
            (
                "flavour = \"sglang\"",
                "flavour = \"sglang\"\nengine = { prefill_tps = -1.0 }",
                "fleet[0].engine invalid engine parameter prefill_tps",
            ),
            (
                "flavour = \"sglang\"",
                "flavour = \"sglang\"\nengine = { kv_capacity_tokens = 100 }",
                "exceeds the smallest kv_capacity_tokens (100)",
            ),
            (
                "process = \"poisson\"",
                "process = \"on-off\", burst_factor = 1.0, mean_burst_s = 1.0",
                "burst_factor must be finite and above 1, got 1",
            ),
            (
                "output = { dist = \"constant\", tokens = 10 }",
                "",
                "traffic[0].output is required",
            ),
            (
                "seed = 1",
                "seed = 1\npolicies = [\"random\", \"random\"]",
                "policies lists random twice",
            ),
            (
                "tokens = 200 }",
                "tokens = 200 }\nshared_prefix = { fraction = 1.5, tokens = 64 }",
                "shared_prefix.fraction must be in [0, 1], got 1.5",
            ),
            (
                "tokens = 200 }",
                "tokens = 200 }\nconversation = { system_tokens = 100, mean_turns = 0.5, think_time_s = 1.0 }",
                "conversation.mean_turns must be finite and at least 1, got 0.5",
            ),
            (
                "tokens = 200 }",
                "tokens = 200 }\nconversation = { apps = 0, system_tokens = 100, mean_turns = 2.0, think_time_s = 1.0 }",
                "conversation.apps must be at least 1",
            ),
            (
                "tokens = 200 }",
                "tokens = 200 }\nconversation = { system_tokens = 100, mean_turns = 2.0, think_time_s = -1.0 }",
                "conversation.think_time_s must be finite and not negative",
            ),
            (
                "tokens = 200 }",
                "tokens = 200 }\nconversation = { system_tokens = 100, mean_turns = 2.0, think_time_s = 1.0, max_context_tokens = 100 }",
                "conversation.max_context_tokens must exceed system_tokens",
            ),
            (
                "tokens = 200 }",
                "tokens = 200 }\nconversation = { system_tokens = 100, mean_turns = 2.0, think_time_s = 1.0, max_context_tokens = 100000000 }",
                "exceeds the smallest kv_capacity_tokens",
            ),
            (
                "tokens = 200 }",
                "tokens = 200 }\nconversation = { system_tokens = 100, mean_turns = 2.0, think_time_s = 1.0 }\nshared_prefix = { fraction = 0.5, tokens = 64 }",
                "cannot be combined",
            ),
            (
                "tokens = 200 }",
                "tokens = 200 }\nconversation = { system_tokens = 100, mean_turns = 2.0, think_time_s = 1.0, turned_away = \"retries\" }",
                "unknown variant `retries`, expected `ends` or `continues`",
            ),
        ];
        for (from, to, expected) in cases {
            let text = MINIMAL.replacen(from, to, 1);
            let error = parse(&text).unwrap_err();
            let message = error_text(&error);
            assert!(
                message.contains(expected),
                "expected {expected:?} in {message:?}"
            );
        }
        let mut text = MINIMAL.to_owned();
        text.push_str("[router]\npoll_interval_s = 2.0\nstale_after_s = 1.0\n");
        assert!(
            error_text(&parse(&text).unwrap_err())
                .contains("router.stale_after_s must exceed the poll interval (2 s), got 1")
        );
        let mut text = MINIMAL.to_owned();
        text.push_str("[router]\nreplicas = 0\n");
        assert!(
            error_text(&parse(&text).unwrap_err())
                .contains("router.replicas must be in 1..=64, got 0")
        );
        let mut text = MINIMAL.to_owned();
        text.push_str("[router]\nsweep_replicas = [1]\nsweep_poll_interval_s = [1.0]\n");
        assert!(error_text(&parse(&text).unwrap_err()).contains("not both"));
        for share in ["0.0", "1.0", "nan"] {
            let mut text = MINIMAL.to_owned();
            text.push_str(&format!("[router]\nfirst_replica_share = {share}\n"));
            assert!(
                error_text(&parse(&text).unwrap_err())
                    .contains("router.first_replica_share must be in (0, 1)"),
                "{share}"
            );
        }
    }

    #[test]
    fn a_restart_parses_and_its_values_are_checked() {
        let text =
            format!("restart = {{ replica = 1, at_fraction = 0.6, warm = true }}\n{MINIMAL}");
        let restart = parse(&text).unwrap().restart.unwrap();
        assert_eq!(restart.replica, 1);
        assert!(restart.warm);
        assert_eq!(restart.window_s, 30.0);
        for (restart, expected) in [
            (
                "{ replica = 0, at_fraction = 1.0 }",
                "restart.at_fraction must be in (0, 1), got 1",
            ),
            (
                "{ replica = 0, at_fraction = 0.5, window_s = nan }",
                "restart.window_s must be finite and positive, got NaN",
            ),
        ] {
            let text = format!("restart = {restart}\n{MINIMAL}");
            let error = parse(&text).unwrap_err().to_string();
            assert!(error.contains(expected), "{error}");
        }
    }

    #[test]
    fn a_slowdown_parses_and_its_values_are_checked() {
        let text =
            format!("slowdown = {{ worker = 1, at_fraction = 0.5, factor = 0.5 }}\n{MINIMAL}");
        let scenario = parse(&text).unwrap();
        let slowdown = scenario.slowdown.unwrap();
        assert_eq!(slowdown.worker, 1);
        assert_eq!(slowdown.at_s(30.0), 15.0);
        let text = format!("slowdown = {{ worker = 0, at_s = 4.0, factor = 2.0 }}\n{MINIMAL}");
        assert_eq!(parse(&text).unwrap().slowdown.unwrap().at_s(30.0), 4.0);
        for (slowdown, expected) in [
            (
                "{ worker = 2, at_fraction = 0.5, factor = 0.5 }",
                "slowdown.worker must name one of the 2 workers (0-based), got 2",
            ),
            (
                "{ worker = 0, at_fraction = 1.0, factor = 0.5 }",
                "slowdown.at_fraction must be in (0, 1), got 1",
            ),
            (
                "{ worker = 0, at_fraction = 0.5, at_s = 1.0, factor = 0.5 }",
                "needs exactly one of at_fraction and at_s",
            ),
            (
                "{ worker = 0, factor = 0.5 }",
                "needs exactly one of at_fraction and at_s",
            ),
            (
                "{ worker = 0, at_s = 1.0, factor = 0.0 }",
                "slowdown.factor must be finite and positive, got 0",
            ),
            (
                "{ worker = 0, at_s = 1.0, factor = 0.5, when = 1 }",
                "unknown field `when`",
            ),
        ] {
            let text = format!("slowdown = {slowdown}\n{MINIMAL}");
            let message = error_text(&parse(&text).unwrap_err());
            assert!(
                message.contains(expected),
                "expected {expected:?} in {message:?}"
            );
        }
    }

    #[test]
    fn a_sync_sweep_runs_at_every_replica_count_but_one() {
        let mut text = MINIMAL.to_owned();
        text.push_str(
            "[router]\nsweep_replicas = [1, 4]\nsweep_sync = [\n  { mode = \"off\" },\n  \
             { mode = \"periodic\", publish_interval_s = 0.02 },\n  \
             { mode = \"periodic\", publish_interval_s = 0.1, latency_s = 0.005, loss_ratio = 0.01, entry_ttl_s = 2.0, publish_dispatches = true },\n  \
             { mode = \"ideal\" },\n]\n",
        );
        let points = parse(&text).unwrap().router_points();
        let summary: Vec<(u32, String)> = points
            .iter()
            .map(|point| (point.replicas, point.sync.label()))
            .collect();
        assert_eq!(
            summary,
            [
                (1, "off".to_owned()),
                (4, "off".to_owned()),
                (4, "20ms".to_owned()),
                (4, "100ms+dispatches lat 5ms loss 1% ttl 2s".to_owned()),
                (4, "ideal".to_owned()),
            ]
        );
        assert!(points.iter().all(|p| p.sweeps_sync && p.sweeps_replicas));
        assert_eq!(
            points[2].sync,
            SyncConfig::Periodic {
                publish_interval_s: 0.02,
                latency_s: DEFAULT_SYNC_LATENCY_S,
                loss_ratio: 0.0,
                entry_ttl_s: DEFAULT_SYNC_ENTRY_TTL_S,
                publish_dispatches: false,
            }
        );
        // One sync setting, not swept: on every point with replicas to share.
        let mut text = MINIMAL.to_owned();
        text.push_str("[router]\nreplicas = 3\nsync = { mode = \"ideal\" }\n");
        let points = parse(&text).unwrap().router_points();
        assert_eq!(points.len(), 1);
        assert_eq!(points[0].sync, SyncConfig::Ideal {});
        assert!(points[0].sweeps_sync);
        // Without sync, rows carry no sync setting.
        assert!(!parse(MINIMAL).unwrap().router_points()[0].sweeps_sync);
    }

    #[test]
    fn impossible_sync_settings_are_clear_errors() {
        for (sync, expected) in [
            (
                "{ mode = \"periodic\", publish_interval_s = 0.0 }",
                "router.sync publish_interval_s must be finite and positive, got 0",
            ),
            (
                "{ mode = \"periodic\", publish_interval_s = 0.02, latency_s = -1.0 }",
                "router.sync latency_s must be finite and not negative, got -1",
            ),
            (
                "{ mode = \"periodic\", publish_interval_s = 0.02, loss_ratio = 1.5 }",
                "router.sync loss_ratio must be in [0, 1], got 1.5",
            ),
            (
                "{ mode = \"periodic\", publish_interval_s = 0.5, entry_ttl_s = 1.0 }",
                "router.sync entry_ttl_s must be at least 4 × publish_interval_s (2 s), got 1",
            ),
            (
                "{ mode = \"periodic\", publish_interval_ms = 20 }",
                "unknown field `publish_interval_ms`",
            ),
            ("{ mode = \"gossip\" }", "unknown variant `gossip`"),
            (
                "{ mode = \"ideal\", latency_s = 0.1 }",
                "unknown field `latency_s`",
            ),
        ] {
            let text = format!("{MINIMAL}[router]\nsync = {sync}\n");
            let message = error_text(&parse(&text).unwrap_err());
            assert!(
                message.contains(expected),
                "expected {expected:?} in {message:?}"
            );
        }
        let text = format!(
            "{MINIMAL}[router]\nsweep_sync = [{{ mode = \"ideal\" }}, {{ mode = \"ideal\" }}]\n"
        );
        assert!(
            error_text(&parse(&text).unwrap_err())
                .contains("router.sweep_sync[1] lists sync ideal twice")
        );
        let text = format!("{MINIMAL}[router]\nsweep_sync = []\n");
        assert!(error_text(&parse(&text).unwrap_err()).contains("must not be empty"));
    }

    #[test]
    fn classes_tenants_and_deadlines_parse() {
        let text = MINIMAL.replace(
            "output = { dist = \"constant\", tokens = 10 }",
            "output = { dist = \"constant\", tokens = 10 }\n\
             classes = [{ priority = 0, share = 0.2 }, { priority = 1, share = 0.8, ttft_deadline_s = 2.0 }]\n\
             tenants = [{ name = \"A\", share = 10 }, { name = \"B\", share = 1, alone = true }]\n\
             ttft_deadline_s = 5.0",
        );
        let text = text.replace("utilizations = [0.5]", "utilizations = [0.5, 1.3]");
        let scenario = parse(&text).unwrap();
        let traffic = &scenario.traffic[0];
        assert_eq!(
            traffic.classes,
            [
                TrafficClass {
                    priority: 0,
                    share: 0.2,
                    ttft_deadline_s: None
                },
                TrafficClass {
                    priority: 1,
                    share: 0.8,
                    ttft_deadline_s: Some(2.0)
                },
            ]
        );
        assert_eq!(traffic.tenants[1].name, "B");
        assert!(traffic.tenants[1].alone && !traffic.tenants[0].alone);
        assert_eq!(traffic.ttft_deadline_s, Some(5.0));
        assert!(traffic.is_labelled());
        assert_eq!(traffic.alone_name("B"), "uniform-B-alone");
        // Loads above capacity are allowed; the outcomes are reported.
        assert_eq!(scenario.utilizations, [0.5, 1.3]);
        assert!(scenario.reports_outcomes());
        assert!(!parse(MINIMAL).unwrap().reports_outcomes());
        assert_eq!(parse(MINIMAL).unwrap().capacity, CapacityBasis::Formula);
        let measured = format!("capacity = \"measured\"\n{MINIMAL}");
        assert_eq!(parse(&measured).unwrap().capacity, CapacityBasis::Measured);
    }

    #[test]
    fn impossible_classes_tenants_and_deadlines_are_clear_errors() {
        let with = |extra: &str| {
            MINIMAL.replace(
                "output = { dist = \"constant\", tokens = 10 }",
                &format!("output = {{ dist = \"constant\", tokens = 10 }}\n{extra}"),
            )
        };
        for (extra, expected) in [
            (
                "classes = [{ priority = 0, share = 0.0 }]",
                "traffic[0].classes[0].share must be finite and positive, got 0",
            ),
            (
                "classes = [{ priority = 0, share = 1.0 }, { priority = 0, share = 1.0 }]",
                "traffic[0].classes[1].priority 0 is used twice",
            ),
            (
                "classes = [{ priority = 0, share = 1.0, ttft_deadline_s = -2.0 }]",
                "traffic[0].classes[0].ttft_deadline_s must be finite and positive, got -2",
            ),
            (
                "classes = [{ priority = 0, share = 1.0, weight = 2.0 }]",
                "unknown field `weight`",
            ),
            (
                "tenants = [{ name = \"A\", share = -1.0 }]",
                "traffic[0].tenants[0].share must be finite and positive, got -1",
            ),
            (
                "tenants = [{ name = \"A\", share = 1.0 }, { name = \"A\", share = 2.0 }]",
                "traffic[0].tenants[1].name \"A\" is used twice",
            ),
            (
                "tenants = [{ name = \" \", share = 1.0 }]",
                "traffic[0].tenants[0].name must not be empty",
            ),
            (
                "ttft_deadline_s = 0.0",
                "traffic[0].ttft_deadline_s must be finite and positive, got 0",
            ),
            (
                "ttft_deadline_s = nan",
                "must be finite and positive, got NaN",
            ),
        ] {
            let message = error_text(&parse(&with(extra)).unwrap_err());
            assert!(
                message.contains(expected),
                "expected {expected:?} in {message:?}"
            );
        }
        // A tenant alone must not take another traffic's name.
        let mut text = with("tenants = [{ name = \"B\", share = 1.0, alone = true }]");
        text.push_str(
            "[[traffic]]\nname = \"uniform-B-alone\"\narrival = { process = \"poisson\" }\n\
             prompt = { dist = \"constant\", tokens = 200 }\noutput = { dist = \"constant\", tokens = 10 }\n",
        );
        assert!(
            error_text(&parse(&text).unwrap_err())
                .contains("names the traffic \"uniform-B-alone\", which is used already")
        );
    }

    #[test]
    fn admission_settings_parse_and_sweep() {
        let mut text = MINIMAL.replace("utilizations = [0.5]", "utilizations = [0.5, 1.2]");
        text.push_str(
            "[router]\nreplicas = 2\n[router.admission]\nsweep_order = [\"off\", \"fifo\", \"fair_share\"]\n\
             queue_above_wait_s = 0.1\nmax_queue_requests = 64\n\
             classes = [{ name = \"chat\", priority = 0, ttft_deadline_s = 2.0 }, { name = \"batch\", priority = 5, weight = 0.5 }]\n\
             tenant_weights = { A = 2.0 }\n",
        );
        let scenario = parse(&text).unwrap();
        let orders: Vec<AdmissionOrder> = scenario
            .router_points()
            .iter()
            .map(|point| point.admission)
            .collect();
        assert_eq!(
            orders,
            [
                AdmissionOrder::Off,
                AdmissionOrder::Fifo,
                AdmissionOrder::FairShare
            ]
        );
        assert!(scenario.router_points().iter().all(|p| p.sweeps_admission));
        let room = scenario.room_config().unwrap().unwrap();
        assert_eq!(room.queue_above_wait, Duration::from_millis(100));
        assert_eq!(room.max_queue_requests, 64);
        assert_eq!(room.classes[0].name, "chat");
        assert_eq!(room.classes[0].weight, admission::default_class_weight(0));
        assert_eq!(room.classes[0].ttft_deadline, Some(Duration::from_secs(2)));
        assert_eq!(room.classes[1].weight, 0.5);
        assert_eq!(room.tenant_weights["A"], 2.0);
        assert!(scenario.reports_outcomes());
        // The defaults: the router's, one order.
        let mut text = MINIMAL.to_owned();
        text.push_str("[router.admission]\norder = \"priority\"\n");
        let scenario = parse(&text).unwrap();
        assert_eq!(
            scenario.room_config().unwrap().unwrap(),
            RoomConfig::default()
        );
        let points = scenario.router_points();
        assert_eq!(points.len(), 1);
        assert_eq!(points[0].admission, AdmissionOrder::Priority);
        // Without the section: no room, no admission column.
        let points = parse(MINIMAL).unwrap().router_points();
        assert!(points[0].admission.is_off() && !points[0].sweeps_admission);
        assert_eq!(parse(MINIMAL).unwrap().room_config().unwrap(), None);
    }

    #[test]
    fn impossible_admission_settings_are_clear_errors() {
        for (admission, expected) in [
            ("order = \"lifo\"", "unknown variant `lifo`"),
            (
                "sweep_order = []",
                "router.admission.sweep_order must not be empty",
            ),
            (
                "sweep_order = [\"fifo\", \"fifo\"]",
                "router.admission.sweep_order lists fifo twice",
            ),
            (
                "max_queue_requests = 0",
                "router.admission.max_queue_requests must be at least 1",
            ),
            (
                "queue_above_wait_s = -0.1",
                "queue_above_wait_s must be finite and not negative, got -0.1",
            ),
            (
                "classes = [{ name = \"a\", priority = 0 }, { name = \"b\", priority = 0 }]",
                "have the same priority 0",
            ),
            (
                "classes = [{ name = \"a\", priority = 0, weight = 0.0 }]",
                "weight 0 must be a finite number above 0",
            ),
            (
                "classes = [{ name = \"a\", priority = 0, ttft_deadline_s = 0.0 }]",
                "class \"a\": ttft_deadline_s must be finite and positive, got 0",
            ),
            (
                "tenant_weights = { A = -1.0 }",
                "tenant \"A\": weight -1 must be a finite number above 0",
            ),
            (
                "queue_above_wait_ms = 250",
                "unknown field `queue_above_wait_ms`",
            ),
        ] {
            let text = format!("{MINIMAL}[router.admission]\n{admission}\n");
            let message = error_text(&parse(&text).unwrap_err());
            assert!(
                message.contains(expected),
                "expected {expected:?} in {message:?}"
            );
        }
    }

    #[test]
    fn sweeps_make_one_router_point_each() {
        let mut text = MINIMAL.to_owned();
        text.push_str("[router]\nsweep_poll_interval_s = [0.05, 2.0]\n");
        let points = parse(&text).unwrap().router_points();
        assert_eq!(points.len(), 2);
        assert_eq!(points[1].poll_interval_s, 2.0);
        assert_eq!(points[1].stale_after_s, 6.0);
        assert!(points[0].sweeps_poll_interval && !points[0].sweeps_replicas);
        let mut scenario = parse(MINIMAL).unwrap();
        scenario.scale_requests(2.5).unwrap();
        assert_eq!(scenario.requests, 25);
        assert!(scenario.scale_requests(0.0).is_err());
    }
}
