//! Layered configuration: built-in defaults < TOML file < environment
//! (`ROUTER__SECTION__KEY`) < command-line flags, validated after merging.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;

use policy_core::{BackendRegistry, LoadAddress};
use request_features::PrefixHashing;
use serde::{Deserialize, Serialize};

use crate::error::ConfigError;

/// A value of [`Layers::overrides`]: a string, number, bool, or a list or
/// table of them; `.into()` makes one from any of these.
pub use config::Value;

/// The whole router configuration.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RouterConfig {
    pub server: ServerConfig,
    pub request: RequestConfig,
    pub policy: PolicyConfig,
    pub load_monitor: LoadMonitorConfig,
    pub health: HealthConfig,
    pub outlier_detection: OutlierConfig,
    pub workers: Vec<WorkerConfig>,
    pub admin: AdminConfig,
    pub sync: SyncConfig,
    pub admission: AdmissionConfig,
    pub worker_tls: WorkerTlsConfig,
    pub tracing: TracingConfig,
    pub migration: MigrationConfig,
    pub hedging: HedgingConfig,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerConfig {
    pub host: String,
    pub port: u16,
    /// Largest request body accepted; larger bodies get 413.
    pub body_limit_bytes: usize,
    /// Per attempt: how long a worker may take to send its response head
    /// and, for a stream, its first `data:` event. A worker that misses it
    /// counts one failure toward ejection.
    pub first_byte_timeout_ms: u64,
    /// A non-streaming answer's head comes with the whole answer, so its
    /// first-byte deadline is `first_byte_timeout_ms` plus the request's
    /// `max_tokens` at this slowest decode rate (tokens per second); with
    /// no `max_tokens`, only the request deadline bounds it.
    pub min_decode_tokens_per_s: f64,
    /// A stream that sends no event for this long is ended with an SSE error
    /// event, and counts as a failure of its worker.
    pub stream_idle_timeout_ms: u64,
    /// The whole request, every attempt and the whole response included.
    pub request_deadline_ms: u64,
    /// How long a new connection to a worker may take before the request
    /// goes to another worker.
    pub connect_timeout_ms: u64,
    /// How long in-flight requests may run on after SIGTERM/SIGINT.
    pub shutdown_grace_ms: u64,
    /// Other workers tried when no generation can have started: a failed
    /// connection, a 503 or 429 from the worker, or a stream whose worker
    /// sent no response head within the first-byte deadline.
    pub max_retries: u32,
    /// A client must send its whole request head within this long (also
    /// the wait for the next request on a kept-alive connection's start).
    pub client_header_timeout_ms: u64,
    /// A client must send its whole request body within this long.
    pub client_body_timeout_ms: u64,
    /// An idle kept-alive client connection is closed after this long.
    pub keepalive_timeout_ms: u64,
    /// Most client connections open at once; more wait in the listen backlog.
    pub max_connections: usize,
    /// Serve `/metrics` on a listener of its own, on this port (at
    /// `metrics_host`), instead of on `port`. Unset: on `port`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics_port: Option<u16>,
    /// The metrics listener's address; unset: `host`. Only with
    /// `metrics_port`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics_host: Option<String>,
    /// TLS on the client listener (`[server.tls]`); absent: plain HTTP.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls: Option<ListenerTlsConfig>,
    /// Replaced by `first_byte_timeout_ms`, `stream_idle_timeout_ms` and
    /// `request_deadline_ms`; kept only to explain that when it is set.
    #[serde(default, skip_serializing)]
    pub request_timeout_ms: Option<u64>,
}

impl Default for ServerConfig {
    fn default() -> ServerConfig {
        ServerConfig {
            host: "127.0.0.1".into(),
            port: 8080,
            body_limit_bytes: 32 * 1024 * 1024,
            first_byte_timeout_ms: 30_000,
            min_decode_tokens_per_s: 5.0,
            stream_idle_timeout_ms: 60_000,
            request_deadline_ms: 600_000,
            connect_timeout_ms: 3_000,
            shutdown_grace_ms: 30_000,
            max_retries: 2,
            client_header_timeout_ms: 10_000,
            client_body_timeout_ms: 30_000,
            keepalive_timeout_ms: 60_000,
            max_connections: 8192,
            metrics_port: None,
            metrics_host: None,
            tls: None,
            request_timeout_ms: None,
        }
    }
}

impl ServerConfig {
    pub(crate) fn first_byte_timeout(&self) -> Duration {
        Duration::from_millis(self.first_byte_timeout_ms)
    }

    /// How long one attempt may wait for the response head.
    pub(crate) fn head_timeout(&self, streaming: bool, max_output_tokens: Option<u64>) -> Duration {
        if streaming {
            return self.first_byte_timeout();
        }
        match max_output_tokens {
            Some(tokens) => {
                let decode_s = tokens as f64 / self.min_decode_tokens_per_s;
                self.first_byte_timeout()
                    .saturating_add(Duration::try_from_secs_f64(decode_s).unwrap_or(Duration::MAX))
            }
            None => self.request_deadline(),
        }
    }

    pub(crate) fn stream_idle_timeout(&self) -> Duration {
        Duration::from_millis(self.stream_idle_timeout_ms)
    }

    pub(crate) fn request_deadline(&self) -> Duration {
        Duration::from_millis(self.request_deadline_ms)
    }

    pub(crate) fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }

    pub(crate) fn shutdown_grace(&self) -> Duration {
        Duration::from_millis(self.shutdown_grace_ms)
    }

    pub(crate) fn client_header_timeout(&self) -> Duration {
        Duration::from_millis(self.client_header_timeout_ms)
    }

    pub(crate) fn client_body_timeout(&self) -> Duration {
        Duration::from_millis(self.client_body_timeout_ms)
    }

    pub(crate) fn keepalive_timeout(&self) -> Duration {
        Duration::from_millis(self.keepalive_timeout_ms)
    }

    /// The metrics listener's `host:port`, when `/metrics` has one of its own.
    pub(crate) fn metrics_address(&self) -> Option<String> {
        let port = self.metrics_port?;
        let host = self.metrics_host.as_deref().unwrap_or(&self.host);
        Some(format!("{host}:{port}"))
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RequestConfig {
    /// Prompt characters per token, to estimate HTTP prompts' token counts.
    pub chars_per_token: f64,
    /// Tokens per hashed prompt block (a text block is this many tokens ×
    /// `chars_per_token` bytes). A divisor of least_load's
    /// `prefix_index_block_tokens` (default 256) keeps its index blocks
    /// exactly that long.
    pub prefix_hash_block_tokens: u32,
    /// The longest prompt prefix hashed, tokens; 0 turns prefix hashing
    /// off. Bounds the hashing work per request whatever the prompt's size.
    pub prefix_hash_max_tokens: u64,
    /// On an OpenAI stream with a hashed prompt whose client set no
    /// `stream_options`, ask the engine for the closing usage chunk
    /// (`include_usage`), read its `cached_tokens`, and keep the chunk from
    /// the client. Without it such streams report no cache hits.
    pub ask_stream_usage: bool,
}

impl RequestConfig {
    /// How prompts are read and hashed (request-features).
    pub(crate) fn prefix_hashing(&self) -> PrefixHashing {
        PrefixHashing {
            block_tokens: self.prefix_hash_block_tokens,
            max_tokens: self.prefix_hash_max_tokens,
            chars_per_token: self.chars_per_token,
        }
    }
}

impl Default for RequestConfig {
    fn default() -> RequestConfig {
        RequestConfig {
            chars_per_token: 4.0,
            prefix_hash_block_tokens: 64,
            prefix_hash_max_tokens: 32_768,
            ask_stream_usage: true,
        }
    }
}

/// The largest `request.prefix_hash_block_tokens`: larger blocks would only
/// make a prefix match coarser than any engine's cache.
pub(crate) const MAX_PREFIX_HASH_BLOCK_TOKENS: u32 = 65_536;

/// `kind` names the active policy; every other key is one policy's section
/// (`[policy.least_load]`, `[policy.power_of_two]`, …), handed to the policy
/// registry, which validates it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PolicyConfig {
    pub kind: String,
    #[serde(flatten)]
    pub sections: BTreeMap<String, serde_json::Value>,
}

impl Default for PolicyConfig {
    fn default() -> PolicyConfig {
        PolicyConfig {
            kind: "least_load".into(),
            sections: BTreeMap::new(),
        }
    }
}

impl PolicyConfig {
    /// The active policy's section (`null` when absent: all defaults).
    pub(crate) fn active_section(&self) -> serde_json::Value {
        self.sections
            .get(&self.kind)
            .cloned()
            .unwrap_or(serde_json::Value::Null)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoadMonitorConfig {
    pub interval_ms: u64,
    pub timeout_ms: u64,
    pub stale_after_ms: u64,
}

impl Default for LoadMonitorConfig {
    fn default() -> LoadMonitorConfig {
        LoadMonitorConfig {
            interval_ms: 1000,
            timeout_ms: 500,
            stale_after_ms: 3000,
        }
    }
}

impl LoadMonitorConfig {
    pub(crate) fn interval(&self) -> Duration {
        Duration::from_millis(self.interval_ms)
    }

    pub(crate) fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }

    pub(crate) fn stale_after(&self) -> Duration {
        Duration::from_millis(self.stale_after_ms)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HealthConfig {
    /// How often each worker's `/health` is checked.
    pub interval_ms: u64,
    pub timeout_ms: u64,
    /// Consecutive failures (checks or requests) that take a worker out.
    pub failure_threshold: u32,
    /// Consecutive passed checks that bring it back.
    pub success_threshold: u32,
}

impl Default for HealthConfig {
    fn default() -> HealthConfig {
        HealthConfig {
            interval_ms: 2000,
            timeout_ms: 1000,
            failure_threshold: 3,
            success_threshold: 2,
        }
    }
}

/// Outlier ejection: a worker whose requests fail in a row (across distinct
/// requests) leaves rotation for a while, and comes back only when a probe
/// that exercises generation succeeds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OutlierConfig {
    /// Consecutive gateway failures (connect errors, first-byte timeouts,
    /// 5xx, streams cut short or stalled) that eject a worker.
    pub consecutive_failures: u32,
    /// The first ejection's length; each further one doubles it.
    pub base_ejection_ms: u64,
    /// The longest one ejection lasts.
    pub max_ejection_ms: u64,
    /// Most of the fleet, in percent, ejected at once; a failure that would
    /// eject more is logged and the worker kept, so a fleet-wide fault does
    /// not empty the pool. At least one worker can always be ejected.
    pub max_ejected_percent: u32,
    /// How long a probe may take to answer.
    pub probe_timeout_ms: u64,
    /// A stream that has sent nothing for this long holds its worker back
    /// from new requests until it sends again (or the stream ends). A hung
    /// engine's streams have passed their first token, so its pending work
    /// is gone and it looks idle: without this it draws new requests for the
    /// whole `server.stream_idle_timeout_ms`. Held-back workers still serve
    /// when every worker is held back. 0 turns this off.
    pub silent_stream_ms: u64,
    /// How an ejected worker is probed, by backend name: `health_generate`
    /// (GET /health_generate), `completion` (a one-token POST
    /// /v1/completions) or `health` (GET /health only). Backends not named
    /// use `default_probe`.
    pub probe: BTreeMap<String, ProbeKind>,
    pub default_probe: ProbeKind,
}

/// How an ejected worker is probed before it returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", try_from = "String")]
pub enum ProbeKind {
    /// `GET /health_generate`: SGLang runs a real one-token generation.
    HealthGenerate,
    /// `POST /v1/completions` with `max_tokens = 1`, for the worker's first
    /// model in `/v1/models`.
    Completion,
    /// `GET /health` only: proves the process answers, not that it generates.
    Health,
}

impl TryFrom<String> for ProbeKind {
    type Error = String;

    fn try_from(name: String) -> Result<ProbeKind, String> {
        match name.as_str() {
            "health_generate" => Ok(ProbeKind::HealthGenerate),
            "completion" => Ok(ProbeKind::Completion),
            "health" => Ok(ProbeKind::Health),
            _ => Err(format!(
                "unknown probe {name:?}; valid probes: health_generate, completion, health"
            )),
        }
    }
}

impl Default for OutlierConfig {
    fn default() -> OutlierConfig {
        OutlierConfig {
            consecutive_failures: 3,
            base_ejection_ms: 10_000,
            max_ejection_ms: 300_000,
            max_ejected_percent: 50,
            probe_timeout_ms: 10_000,
            silent_stream_ms: 5_000,
            probe: [
                ("sglang".to_owned(), ProbeKind::HealthGenerate),
                ("sglang-grpc".to_owned(), ProbeKind::HealthGenerate),
            ]
            .into_iter()
            .collect(),
            default_probe: ProbeKind::Completion,
        }
    }
}

impl OutlierConfig {
    pub(crate) fn base_ejection(&self) -> Duration {
        Duration::from_millis(self.base_ejection_ms)
    }

    pub(crate) fn probe_timeout(&self) -> Duration {
        Duration::from_millis(self.probe_timeout_ms)
    }

    /// `silent_stream_ms`, or `None` when it is off.
    pub(crate) fn silent_stream(&self) -> Option<Duration> {
        (self.silent_stream_ms > 0).then(|| Duration::from_millis(self.silent_stream_ms))
    }

    /// The probe for a worker of `backend`.
    pub(crate) fn probe_for(&self, backend: &str) -> ProbeKind {
        self.probe
            .get(backend)
            .copied()
            .unwrap_or(self.default_probe)
    }
}

/// One worker. `backend` absent means "detect it": `/v1/loads` means SGLang,
/// a `/metrics` with `vllm:` families means vLLM.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    pub url: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_url: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key: Option<String>,
}

/// The client listener's certificate (`[server.tls]`): HTTP/1.1 and HTTP/2
/// (ALPN) over TLS 1.2 and 1.3. Both files are read again on SIGHUP.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerTlsConfig {
    /// PEM: the certificate chain, leaf first.
    pub cert_file: PathBuf,
    /// PEM: the leaf's private key (PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
}

/// How the router trusts `https://` workers, for generation requests and
/// load polls alike.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorkerTlsConfig {
    /// PEM: the certificates that sign workers' certificates; unset: the
    /// system's roots.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
}

/// Answers that survive their worker (`docs/reliability.md`, "Migration"):
/// a stream that breaks after generation began is continued on another
/// worker with what was already sent, and spliced into one stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MigrationConfig {
    /// Continuations per request; 0 turns migration off (a broken stream
    /// ends with an SSE error event).
    pub max_migrations: u32,
    /// Send non-streaming chat and completion requests upstream as streams
    /// and assemble the answer, so that they are retried before their
    /// first token and continued after it like streams. Off by default:
    /// assembling costs CPU per token (`docs/performance.md`).
    pub non_streaming_as_stream: bool,
}

impl Default for MigrationConfig {
    fn default() -> MigrationConfig {
        MigrationConfig {
            max_migrations: 2,
            non_streaming_as_stream: false,
        }
    }
}

/// Most continuations a request may have: each resends the whole context.
const MAX_MIGRATIONS: u32 = 16;

impl MigrationConfig {
    pub(crate) fn enabled(&self) -> bool {
        self.max_migrations > 0
    }
}

/// A second attempt for a stream whose response head or first event is
/// overdue (`docs/reliability.md`, "Hedging"): the request also goes to
/// another worker, the first of the two to send an event answers, and the
/// other is closed. It bounds what an engine that accepts work and never starts it
/// costs a request, before outlier detection has seen enough failures to
/// eject it. Only streams upstream are hedged: a non-streaming answer gives
/// no sign that generation started.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HedgingConfig {
    /// An attempt with no response head after this long is hedged (a
    /// streaming engine sends its head when it admits the request); 0
    /// turns hedging off.
    pub after_ms: u64,
    /// An attempt with a head but no first event is hedged after
    /// `after_ms` or this many times the policy's predicted wait for the
    /// chosen worker (policies that predict one: `least_load`,
    /// `power_of_two`), whichever is longer: a long prefill or a busy
    /// worker is not hedged.
    pub predicted_wait_multiple: f64,
    /// Hedges are at most this percentage of requests, with a burst of 10.
    pub max_percent: f64,
}

impl Default for HedgingConfig {
    fn default() -> HedgingConfig {
        HedgingConfig {
            after_ms: 1_000,
            predicted_wait_multiple: 4.0,
            max_percent: 10.0,
        }
    }
}

impl HedgingConfig {
    pub(crate) fn after(&self) -> Option<Duration> {
        (self.after_ms > 0).then(|| Duration::from_millis(self.after_ms))
    }
}

/// OpenTelemetry traces (`docs/observability.md`): spans for each request's
/// receive, admission, selection, dispatch, first token and finish,
/// exported over OTLP/gRPC. Off by default; an incoming `traceparent` is
/// passed on to the worker either way.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TracingConfig {
    pub enabled: bool,
    /// The OTLP/gRPC collector.
    pub otlp_endpoint: String,
    /// The `service.name` resource attribute.
    pub service_name: String,
    /// Share of requests traced that arrive without a sampled parent; a
    /// request whose `traceparent` is sampled is always traced.
    pub sample_ratio: f64,
    /// How often finished spans are sent to the collector.
    pub export_interval_ms: u64,
}

impl Default for TracingConfig {
    fn default() -> TracingConfig {
        TracingConfig {
            enabled: false,
            otlp_endpoint: "http://127.0.0.1:4317".into(),
            service_name: "llm-router".into(),
            sample_ratio: 1.0,
            export_interval_ms: 1000,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdminConfig {
    /// When set, every admin call needs `Authorization: Bearer <api_key>`;
    /// when not, mutating calls are accepted only from loopback.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api_key: Option<String>,
}

/// Admission at saturation (`docs/admission.md`): while every candidate's
/// expected wait is above `queue_above_wait_s`, or every worker is at its
/// cap, requests wait in the router, and the policy chooses a worker for
/// each as it leaves. On by default, in `priority` order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdmissionConfig {
    /// Off: every request is dispatched on arrival, and answered 503 when
    /// every worker is at its cap.
    pub enabled: bool,
    /// The order waiting requests leave in: `fifo`, `priority` (classes by
    /// priority value) or `fair_share` (classes, then tenants), or an order
    /// a custom router registered.
    pub order: String,
    /// Requests wait in the router while the least busy candidate's
    /// expected wait, before the request's own prefill, is above this.
    /// Only policies with a model of wait (`least_load`, `power_of_two`)
    /// give one; with the others, requests wait only when every worker is
    /// capped.
    pub queue_above_wait_s: f64,
    /// The same threshold while there is something to reorder: for 10 s
    /// after an arrival of another class (or, under `fair_share`, another
    /// tenant) than the one before it, or with a TTFT deadline. Lower keeps
    /// the backlog in the router, where the order applies.
    pub reorder_above_wait_s: f64,
    /// Requests beyond this many waiting are answered 429 (`queue_full`).
    /// With `[sync]`, the other router replicas' queued requests count too,
    /// as their last messages report them.
    pub max_queue_requests: usize,
    /// The header that names a request's tenant. A request without it
    /// belongs to the tenant of its API key (`Authorization: Bearer`, kept
    /// as a hash), or to the unnamed tenant.
    pub tenant_header: String,
    /// Named classes of priority values. A request goes to the first class
    /// (by `priority`) whose `priority` is at least its own, or the last.
    /// With none, each priority value is a class of its own, and each step
    /// down (a higher value) takes an eighth of the share.
    pub classes: Vec<AdmissionClass>,
    /// Tenants' shares within a class under `fair_share` (others weigh 1).
    pub tenant_weights: BTreeMap<String, f64>,
}

impl Default for AdmissionConfig {
    fn default() -> AdmissionConfig {
        AdmissionConfig {
            enabled: true,
            order: admission::DEFAULT_ORDER.into(),
            queue_above_wait_s: admission::DEFAULT_QUEUE_ABOVE_WAIT_MS as f64 / 1000.0,
            reorder_above_wait_s: admission::DEFAULT_REORDER_ABOVE_WAIT_MS as f64 / 1000.0,
            max_queue_requests: admission::DEFAULT_MAX_QUEUE_REQUESTS,
            tenant_header: "x-tenant-id".into(),
            classes: Vec::new(),
            tenant_weights: BTreeMap::new(),
        }
    }
}

/// One `[[admission.classes]]` entry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdmissionClass {
    pub name: String,
    /// The highest priority value the class takes (lower values are served
    /// first).
    pub priority: i32,
    /// The class's share when classes compete.
    #[serde(default = "one")]
    pub weight: f64,
    /// The TTFT deadline of the class's requests that name none
    /// (`x-ttft-deadline-ms`).
    #[serde(default)]
    pub ttft_deadline_ms: Option<u64>,
}

fn one() -> f64 {
    1.0
}

impl AdmissionConfig {
    /// The room's config, checked.
    pub(crate) fn room(&self) -> Result<admission::RoomConfig, ConfigError> {
        let seconds = |key: &str, wait: f64| {
            Duration::try_from_secs_f64(wait)
                .ok()
                .filter(|_| wait.is_finite() && wait <= 3600.0)
                .ok_or_else(|| ConfigError::Invalid {
                    key: format!("admission.{key}"),
                    value: wait.to_string(),
                    allowed: "a number of seconds from 0 to 3600".into(),
                })
        };
        let queue_above_wait = seconds("queue_above_wait_s", self.queue_above_wait_s)?;
        let reorder_above_wait = seconds("reorder_above_wait_s", self.reorder_above_wait_s)?;
        if self.tenant_header.is_empty()
            || http::HeaderName::from_bytes(self.tenant_header.as_bytes()).is_err()
        {
            return Err(ConfigError::Invalid {
                key: "admission.tenant_header".into(),
                value: format!("{:?}", self.tenant_header),
                allowed: "an HTTP header name".into(),
            });
        }
        let room = admission::RoomConfig {
            queue_above_wait,
            reorder_above_wait,
            max_queue_requests: self.max_queue_requests,
            classes: self
                .classes
                .iter()
                .map(|class| admission::ClassConfig {
                    name: class.name.clone(),
                    priority: class.priority,
                    weight: class.weight,
                    ttft_deadline: class.ttft_deadline_ms.map(Duration::from_millis),
                })
                .collect(),
            tenant_weights: self.tenant_weights.clone(),
            peer_lag: admission::DEFAULT_PEER_LAG,
        };
        room.validated().map_err(|error| ConfigError::Invalid {
            key: "admission".into(),
            value: "this section".into(),
            allowed: error.to_string(),
        })
    }
}

/// Replica sync: router replicas share their pending token-work per worker
/// through a NATS subject, so each counts what the others sent
/// (`docs/replicas.md`). Off by default.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SyncConfig {
    pub enabled: bool,
    /// The broker, `nats://host[:port]` (port 4222 when left out).
    pub nats_url: String,
    /// Messages go to `<subject_prefix>.pending`, `.prefix` and `.snapshot`;
    /// replicas that should share use the same prefix, and separate fleets
    /// on one broker different ones.
    pub subject_prefix: String,
    /// This replica's id in its messages; empty: `<hostname>-<pid>`. Letters,
    /// digits, `.`, `_` and `-`, at most 128.
    pub replica_id: String,
    /// How often this replica publishes what changed in its pending work.
    pub publish_interval_ms: u64,
    /// Another replica's entry not confirmed for this long is dropped (the
    /// replica stopped, or no longer has the worker). Every replica
    /// republishes its whole state every `entry_ttl_ms / 4`. At least four
    /// publish intervals.
    pub entry_ttl_ms: u64,
    /// Also share where prompt prefixes were placed and the prefix-cache
    /// bounds learned from engines' reports (`<subject_prefix>.prefix`), and
    /// warm a starting replica's prefix index from a running one's
    /// (`<subject_prefix>.snapshot`). Only policies with a prefix index
    /// (`least_load`, `power_of_two`) use them.
    pub share_prefixes: bool,
    /// How long a starting replica waits for another's prefix snapshot
    /// (from its request to the last part) before it gives up; it routes
    /// meanwhile.
    pub snapshot_timeout_ms: u64,
}

impl Default for SyncConfig {
    fn default() -> SyncConfig {
        SyncConfig {
            enabled: false,
            nats_url: "nats://127.0.0.1:4222".into(),
            subject_prefix: "llm-router".into(),
            replica_id: String::new(),
            publish_interval_ms: 25,
            entry_ttl_ms: 1000,
            share_prefixes: true,
            snapshot_timeout_ms: 2000,
        }
    }
}

/// Most characters in a replica id.
pub(crate) const MAX_REPLICA_ID_CHARS: usize = 128;

impl SyncConfig {
    pub(crate) fn publish_interval(&self) -> Duration {
        Duration::from_millis(self.publish_interval_ms)
    }

    pub(crate) fn entry_ttl(&self) -> Duration {
        Duration::from_millis(self.entry_ttl_ms)
    }

    /// How often the whole state is republished, so an entry lost on the
    /// way (or never sent while the broker was away) is corrected well
    /// within the TTL.
    pub(crate) fn full_state_interval(&self) -> Duration {
        self.entry_ttl() / 4
    }

    /// The subject every replica publishes to and subscribes to.
    pub(crate) fn subject(&self) -> String {
        format!("{}.pending", self.subject_prefix)
    }

    /// The subject of prefix placements and learned cache bounds.
    pub(crate) fn prefix_subject(&self) -> String {
        format!("{}.prefix", self.subject_prefix)
    }

    /// The subject a starting replica asks for a prefix snapshot on.
    pub(crate) fn snapshot_subject(&self) -> String {
        format!("{}.snapshot", self.subject_prefix)
    }

    pub(crate) fn snapshot_timeout(&self) -> Duration {
        Duration::from_millis(self.snapshot_timeout_ms)
    }

    /// `replica_id`, or `<hostname>-<pid>` when it is empty.
    pub(crate) fn effective_replica_id(&self) -> String {
        if !self.replica_id.is_empty() {
            return self.replica_id.clone();
        }
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .or_else(|| std::env::var("HOSTNAME").ok())
            .unwrap_or_default();
        let host: String = host
            .trim()
            .chars()
            .filter(|c| is_replica_id_char(*c))
            .take(64)
            .collect();
        let host = if host.is_empty() {
            "router".into()
        } else {
            host
        };
        format!("{host}-{}", std::process::id())
    }
}

/// Whether `c` may appear in a replica id.
pub(crate) fn is_replica_id_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')
}

/// Whether `id` is a usable replica id: 1 to 128 of letters, digits, `.`,
/// `_` and `-`.
pub(crate) fn is_valid_replica_id(id: &str) -> bool {
    !id.is_empty()
        && id.chars().count() <= MAX_REPLICA_ID_CHARS
        && id.chars().all(is_replica_id_char)
}

/// `nats://host[:port]` with a non-empty host, an optional port from 1 to
/// 65535, and nothing after it.
fn is_valid_nats_url(url: &str) -> bool {
    let Some(authority) = url.strip_prefix("nats://") else {
        return false;
    };
    let authority = authority.strip_suffix('/').unwrap_or(authority);
    if authority.is_empty() || authority.contains(['/', '?', '#', '@', ' ']) {
        return false;
    }
    let (host, port) = match authority.rsplit_once(':') {
        // A bracketed IPv6 address without a port.
        Some((_, rest)) if rest.ends_with(']') => (authority, None),
        Some((host, port)) => (host, Some(port)),
        None => (authority, None),
    };
    !host.is_empty() && port.is_none_or(|port| port.parse::<u16>().is_ok_and(|port| port > 0))
}

/// Dot-separated tokens, each non-empty, with no whitespace and no NATS
/// wildcard (`*`, `>`).
fn is_valid_subject_prefix(prefix: &str) -> bool {
    !prefix.is_empty()
        && prefix.len() <= 200
        && prefix.split('.').all(|token| {
            !token.is_empty()
                && !token
                    .chars()
                    .any(|c| c.is_whitespace() || c.is_control() || c == '*' || c == '>')
        })
}

/// The layers above the defaults.
#[derive(Debug, Default)]
pub struct Layers<'a> {
    pub file: Option<&'a Path>,
    /// The environment, as `(name, value)` pairs; only `ROUTER__*` is read.
    /// Tests pass a map; the binary passes the process environment.
    pub environment: Option<HashMap<String, String>>,
    /// `(dotted.key, value)` overrides from flags the user passed.
    pub overrides: Vec<(String, Value)>,
    /// `--worker` flags: when any is given they replace the file's list.
    pub workers: Vec<WorkerConfig>,
}

impl Layers<'_> {
    /// Adds the process environment (the binary; tests pass a map instead).
    pub fn with_process_environment(mut self) -> Self {
        self.environment = Some(std::env::vars().collect());
        self
    }
}

impl RouterConfig {
    /// Merges the layers over the defaults and validates the result.
    pub fn load(layers: Layers<'_>) -> Result<RouterConfig, ConfigError> {
        let defaults =
            config::Config::try_from(&RouterConfig::default()).map_err(ConfigError::Merge)?;
        let mut builder = config::Config::builder().add_source(defaults);
        if let Some(path) = layers.file {
            if !path.exists() {
                return Err(ConfigError::MissingFile(path.to_path_buf()));
            }
            builder = builder.add_source(
                config::File::from(path)
                    .format(config::FileFormat::Toml)
                    .required(true),
            );
        }
        let environment: HashMap<String, String> = layers
            .environment
            .unwrap_or_default()
            .into_iter()
            .filter(|(name, _)| name.starts_with("ROUTER__"))
            .collect();
        builder = builder.add_source(
            config::Environment::with_prefix("ROUTER")
                .prefix_separator("__")
                .separator("__")
                .try_parsing(true)
                .source(Some(environment)),
        );
        for (key, value) in layers.overrides {
            builder = builder
                .set_override(key, value)
                .map_err(ConfigError::Merge)?;
        }
        let mut merged: RouterConfig = builder
            .build()
            .and_then(config::Config::try_deserialize)
            .map_err(ConfigError::Merge)?;
        if !layers.workers.is_empty() {
            merged.workers = layers.workers;
        }
        merged.validate()?;
        Ok(merged)
    }

    /// Checks what types alone cannot: ranges, relations, names.
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |key: &str, value: String, allowed: &str| {
            Err(ConfigError::Invalid {
                key: key.to_owned(),
                value,
                allowed: allowed.to_owned(),
            })
        };
        if self.server.host.trim().is_empty() {
            return invalid(
                "server.host",
                format!("{:?}", self.server.host),
                "a host name or IP address",
            );
        }
        if self.server.body_limit_bytes == 0 {
            return invalid("server.body_limit_bytes", "0".into(), "at least 1");
        }
        if let Some(old) = self.server.request_timeout_ms {
            return invalid(
                "server.request_timeout_ms",
                old.to_string(),
                "removed: set server.first_byte_timeout_ms (per attempt), \
                 server.stream_idle_timeout_ms and server.request_deadline_ms (overall) instead",
            );
        }
        let server = &self.server;
        for (key, value) in [
            ("server.first_byte_timeout_ms", server.first_byte_timeout_ms),
            (
                "server.stream_idle_timeout_ms",
                server.stream_idle_timeout_ms,
            ),
            ("server.request_deadline_ms", server.request_deadline_ms),
            ("server.connect_timeout_ms", server.connect_timeout_ms),
            (
                "server.client_header_timeout_ms",
                server.client_header_timeout_ms,
            ),
            (
                "server.client_body_timeout_ms",
                server.client_body_timeout_ms,
            ),
            ("server.keepalive_timeout_ms", server.keepalive_timeout_ms),
        ] {
            if value == 0 {
                return invalid(key, "0".into(), "at least 1");
            }
        }
        let floor = server.min_decode_tokens_per_s;
        if !(floor.is_finite() && floor > 0.0) {
            return invalid(
                "server.min_decode_tokens_per_s",
                floor.to_string(),
                "a finite number > 0",
            );
        }
        if server.max_connections == 0 {
            return invalid("server.max_connections", "0".into(), "at least 1");
        }
        if let Some(host) = &server.metrics_host {
            if server.metrics_port.is_none() {
                return invalid(
                    "server.metrics_host",
                    format!("{host:?}"),
                    "set only with server.metrics_port",
                );
            }
            if host.trim().is_empty() {
                return invalid(
                    "server.metrics_host",
                    format!("{host:?}"),
                    "a host name or IP address",
                );
            }
        }
        if let Some(metrics_port) = server.metrics_port {
            let same_host = server
                .metrics_host
                .as_ref()
                .is_none_or(|host| *host == server.host);
            if metrics_port != 0 && metrics_port == server.port && same_host {
                return invalid(
                    "server.metrics_port",
                    metrics_port.to_string(),
                    &format!(
                        "a port other than server.port ({}) on the same host",
                        server.port
                    ),
                );
            }
        }
        if server.first_byte_timeout_ms > server.request_deadline_ms {
            return invalid(
                "server.first_byte_timeout_ms",
                server.first_byte_timeout_ms.to_string(),
                &format!(
                    "at most server.request_deadline_ms ({})",
                    server.request_deadline_ms
                ),
            );
        }
        let chars = self.request.chars_per_token;
        if !(chars.is_finite() && chars > 0.0) {
            return invalid(
                "request.chars_per_token",
                chars.to_string(),
                "a finite number > 0",
            );
        }
        let block_tokens = self.request.prefix_hash_block_tokens;
        if !(1..=MAX_PREFIX_HASH_BLOCK_TOKENS).contains(&block_tokens) {
            return invalid(
                "request.prefix_hash_block_tokens",
                block_tokens.to_string(),
                &format!("an integer from 1 to {MAX_PREFIX_HASH_BLOCK_TOKENS}"),
            );
        }
        let block_bytes = f64::from(block_tokens) * chars;
        if block_bytes > request_features::MAX_TEXT_BLOCK_BYTES as f64 {
            return invalid(
                "request.prefix_hash_block_tokens",
                block_tokens.to_string(),
                &format!(
                    "at most {} bytes of text per block with request.chars_per_token = {chars}",
                    request_features::MAX_TEXT_BLOCK_BYTES
                ),
            );
        }
        let max_tokens = self.request.prefix_hash_max_tokens;
        if max_tokens != 0 && max_tokens < u64::from(block_tokens) {
            return invalid(
                "request.prefix_hash_max_tokens",
                max_tokens.to_string(),
                &format!("0 (off) or at least request.prefix_hash_block_tokens ({block_tokens})"),
            );
        }
        let monitor = &self.load_monitor;
        if monitor.interval_ms == 0 {
            return invalid("load_monitor.interval_ms", "0".into(), "at least 1");
        }
        if monitor.timeout_ms == 0 {
            return invalid("load_monitor.timeout_ms", "0".into(), "at least 1");
        }
        if monitor.stale_after_ms <= monitor.interval_ms {
            return invalid(
                "load_monitor.stale_after_ms",
                monitor.stale_after_ms.to_string(),
                &format!(
                    "greater than load_monitor.interval_ms ({})",
                    monitor.interval_ms
                ),
            );
        }
        if self.health.interval_ms == 0 {
            return invalid("health.interval_ms", "0".into(), "at least 1");
        }
        if self.health.timeout_ms == 0 {
            return invalid("health.timeout_ms", "0".into(), "at least 1");
        }
        if self.health.failure_threshold == 0 {
            return invalid("health.failure_threshold", "0".into(), "at least 1");
        }
        if self.health.success_threshold == 0 {
            return invalid("health.success_threshold", "0".into(), "at least 1");
        }
        let outlier = &self.outlier_detection;
        for (key, value) in [
            (
                "outlier_detection.consecutive_failures",
                u64::from(outlier.consecutive_failures),
            ),
            (
                "outlier_detection.base_ejection_ms",
                outlier.base_ejection_ms,
            ),
            (
                "outlier_detection.probe_timeout_ms",
                outlier.probe_timeout_ms,
            ),
        ] {
            if value == 0 {
                return invalid(key, "0".into(), "at least 1");
            }
        }
        if outlier.max_ejection_ms < outlier.base_ejection_ms {
            return invalid(
                "outlier_detection.max_ejection_ms",
                outlier.max_ejection_ms.to_string(),
                &format!(
                    "at least outlier_detection.base_ejection_ms ({})",
                    outlier.base_ejection_ms
                ),
            );
        }
        if outlier.max_ejected_percent > 100 {
            return invalid(
                "outlier_detection.max_ejected_percent",
                outlier.max_ejected_percent.to_string(),
                "a percentage from 0 to 100",
            );
        }
        for (index, worker) in self.workers.iter().enumerate() {
            validate_worker_address(worker).map_err(|(field, value, allowed)| {
                ConfigError::Invalid {
                    key: format!("workers[{index}].{field}"),
                    value,
                    allowed,
                }
            })?;
        }
        self.admission.room()?;
        if self.migration.max_migrations > MAX_MIGRATIONS {
            return invalid(
                "migration.max_migrations",
                self.migration.max_migrations.to_string(),
                &format!("0 (off) to {MAX_MIGRATIONS}"),
            );
        }
        let hedging = &self.hedging;
        if !(hedging.predicted_wait_multiple.is_finite() && hedging.predicted_wait_multiple >= 0.0)
        {
            return invalid(
                "hedging.predicted_wait_multiple",
                hedging.predicted_wait_multiple.to_string(),
                "a finite number ≥ 0",
            );
        }
        if !(hedging.max_percent.is_finite() && (0.0..=100.0).contains(&hedging.max_percent)) {
            return invalid(
                "hedging.max_percent",
                hedging.max_percent.to_string(),
                "0 to 100",
            );
        }
        self.validate_tracing()?;
        self.validate_sync()
    }

    /// The `[tracing]` section, checked whether or not it is enabled.
    fn validate_tracing(&self) -> Result<(), ConfigError> {
        let tracing = &self.tracing;
        let invalid = |key: &str, value: String, allowed: &str| {
            Err(ConfigError::Invalid {
                key: format!("tracing.{key}"),
                value,
                allowed: allowed.to_owned(),
            })
        };
        let endpoint_ok = tracing
            .otlp_endpoint
            .parse::<http::Uri>()
            .is_ok_and(|uri| uri.scheme_str() == Some("http") && uri.authority().is_some());
        if !endpoint_ok {
            return invalid(
                "otlp_endpoint",
                format!("{:?}", tracing.otlp_endpoint),
                "an http://host:port URL of an OTLP/gRPC collector",
            );
        }
        if tracing.service_name.trim().is_empty() {
            return invalid("service_name", "\"\"".into(), "a non-empty name");
        }
        if !(0.0..=1.0).contains(&tracing.sample_ratio) {
            return invalid(
                "sample_ratio",
                tracing.sample_ratio.to_string(),
                "a number from 0 to 1",
            );
        }
        if tracing.export_interval_ms == 0 {
            return invalid("export_interval_ms", "0".into(), "at least 1");
        }
        Ok(())
    }

    /// The `[sync]` section, checked whether or not it is enabled, so a typo
    /// surfaces before the day it is turned on.
    fn validate_sync(&self) -> Result<(), ConfigError> {
        let sync = &self.sync;
        let invalid = |key: &str, value: String, allowed: String| {
            Err(ConfigError::Invalid {
                key: format!("sync.{key}"),
                value,
                allowed,
            })
        };
        if !is_valid_nats_url(&sync.nats_url) {
            return invalid(
                "nats_url",
                format!("{:?}", sync.nats_url),
                "a nats://host[:port] URL (this build has no TLS)".into(),
            );
        }
        if !is_valid_subject_prefix(&sync.subject_prefix) {
            return invalid(
                "subject_prefix",
                format!("{:?}", sync.subject_prefix),
                "dot-separated NATS subject tokens without spaces or wildcards (* >), at most 200 bytes"
                    .into(),
            );
        }
        if !sync.replica_id.is_empty() && !is_valid_replica_id(&sync.replica_id) {
            return invalid(
                "replica_id",
                format!("{:?}", sync.replica_id),
                format!(
                    "empty (hostname-pid) or 1 to {MAX_REPLICA_ID_CHARS} letters, digits, '.', '_' or '-'"
                ),
            );
        }
        if !(1..=10_000).contains(&sync.publish_interval_ms) {
            return invalid(
                "publish_interval_ms",
                sync.publish_interval_ms.to_string(),
                "from 1 to 10000".into(),
            );
        }
        let min_ttl_ms = sync.publish_interval_ms.saturating_mul(4);
        if !(min_ttl_ms..=600_000).contains(&sync.entry_ttl_ms) {
            return invalid(
                "entry_ttl_ms",
                sync.entry_ttl_ms.to_string(),
                format!("from 4 x sync.publish_interval_ms ({min_ttl_ms}) to 600000"),
            );
        }
        if !(100..=60_000).contains(&sync.snapshot_timeout_ms) {
            return invalid(
                "snapshot_timeout_ms",
                sync.snapshot_timeout_ms.to_string(),
                "from 100 to 60000".into(),
            );
        }
        Ok(())
    }

    /// Checks each worker's backend and load address against the backends
    /// the router was built with: the registry knows the names, and each
    /// backend declared the load address it needs.
    pub(crate) fn validate_workers(&self, backends: &BackendRegistry) -> Result<(), ConfigError> {
        for (index, worker) in self.workers.iter().enumerate() {
            validate_worker(worker, backends).map_err(|(field, value, allowed)| {
                ConfigError::Invalid {
                    key: format!("workers[{index}].{field}"),
                    value,
                    allowed,
                }
            })?;
        }
        Ok(())
    }

    /// The effective configuration as TOML.
    pub fn to_toml(&self) -> Result<String, ConfigError> {
        toml::to_string_pretty(self).map_err(ConfigError::Render)
    }
}

/// Why a worker entry is invalid: `(field, value, allowed)`.
pub(crate) type WorkerProblem = (&'static str, String, String);

/// Checks what needs no backend knowledge: the worker's URL and API key.
pub(crate) fn validate_worker_address(worker: &WorkerConfig) -> Result<(), WorkerProblem> {
    if load_transport::http::http_base(&worker.url).is_err() {
        return Err((
            "url",
            format!("{:?}", worker.url),
            "an http:// or https://host:port URL without a query".into(),
        ));
    }
    if let Some(key) = &worker.api_key
        && load_transport::http::bearer_header(key).is_err()
    {
        return Err((
            "api_key",
            "(redacted)".into(),
            "characters an HTTP header can hold (no control characters)".into(),
        ));
    }
    Ok(())
}

/// Checks one worker entry against the registered backends: its address,
/// its backend's name, and the load address that backend declared.
pub(crate) fn validate_worker(
    worker: &WorkerConfig,
    backends: &BackendRegistry,
) -> Result<(), WorkerProblem> {
    validate_worker_address(worker)?;
    let Some(backend) = &worker.backend else {
        // Detected when the worker is added; only an HTTP load address can
        // be checked before then.
        return match &worker.load_url {
            Some(load_url) if load_transport::http::http_base(load_url).is_err() => Err((
                "load_url",
                format!("{load_url:?}"),
                "an http:// or https://host:port URL without a query (name the backend for a grpc:// one)"
                    .into(),
            )),
            _ => Ok(()),
        };
    };
    let Some(address) = backends.load_address(backend) else {
        return Err((
            "backend",
            format!("{backend:?}"),
            format!("one of {}", backends.names().join(", ")),
        ));
    };
    let fits = match (address, &worker.load_url) {
        (LoadAddress::Http, None) => true,
        (LoadAddress::Http, Some(load_url)) => load_transport::http::http_base(load_url).is_ok(),
        (LoadAddress::Grpc, None) => false,
        (LoadAddress::Grpc, Some(load_url)) => {
            load_transport::grpc::grpc_authority(load_url).is_ok()
        }
    };
    if fits {
        return Ok(());
    }
    let shown = worker
        .load_url
        .as_ref()
        .map_or_else(|| "none".to_owned(), |url| format!("{url:?}"));
    Err(("load_url", shown, address.describe().to_owned()))
}

/// Parses a `--worker [BACKEND=]URL[,loads=LOAD_URL]` flag.
pub fn parse_worker_flag(flag: &str) -> Result<WorkerConfig, ConfigError> {
    let invalid = |allowed: &str| ConfigError::Invalid {
        key: "--worker".into(),
        value: format!("{flag:?}"),
        allowed: allowed.to_owned(),
    };
    let mut parts = flag.split(',');
    let head = parts.next().unwrap_or_default().trim();
    let (backend, url) = match head.split_once('=') {
        Some((backend, url)) => (Some(backend.to_owned()), url.to_owned()),
        None => (None, head.to_owned()),
    };
    let mut load_url = None;
    for part in parts {
        match part.trim().split_once('=') {
            Some(("loads", value)) if !value.is_empty() => load_url = Some(value.to_owned()),
            _ => return Err(invalid("[BACKEND=]URL[,loads=LOAD_URL]")),
        }
    }
    let worker = WorkerConfig {
        url,
        backend,
        load_url,
        api_key: None,
    };
    validate_worker_address(&worker).map_err(|(field, value, allowed)| ConfigError::Invalid {
        key: format!("--worker {field}"),
        value,
        allowed,
    })?;
    Ok(worker)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Option<HashMap<String, String>> {
        Some(
            pairs
                .iter()
                .map(|(key, value)| ((*key).to_owned(), (*value).to_owned()))
                .collect(),
        )
    }

    fn file(text: &str) -> tempfile_path::TempToml {
        tempfile_path::TempToml::new(text)
    }

    /// A TOML file in the target dir, removed on drop (no extra crate needed).
    mod tempfile_path {
        use std::path::PathBuf;
        use std::sync::atomic::{AtomicU32, Ordering};

        static NEXT: AtomicU32 = AtomicU32::new(0);

        pub struct TempToml(pub PathBuf);

        impl TempToml {
            pub fn new(text: &str) -> TempToml {
                let n = NEXT.fetch_add(1, Ordering::Relaxed);
                let path = std::env::temp_dir()
                    .join(format!("router-config-{}-{n}.toml", std::process::id()));
                std::fs::write(&path, text).unwrap();
                TempToml(path)
            }
        }

        impl Drop for TempToml {
            fn drop(&mut self) {
                let _ = std::fs::remove_file(&self.0);
            }
        }
    }

    #[test]
    fn defaults_are_the_documented_ones() {
        let config = RouterConfig::load(Layers::default()).unwrap();
        assert_eq!(config.server.body_limit_bytes, 32 * 1024 * 1024);
        assert_eq!(config.server.max_retries, 2);
        assert_eq!(config.request.chars_per_token, 4.0);
        assert_eq!(config.request.prefix_hash_block_tokens, 64);
        assert_eq!(config.request.prefix_hash_max_tokens, 32_768);
        assert_eq!(config.load_monitor, LoadMonitorConfig::default());
        assert_eq!(config.load_monitor.interval_ms, 1000);
        assert_eq!(config.load_monitor.timeout_ms, 500);
        assert_eq!(config.load_monitor.stale_after_ms, 3000);
        assert_eq!(config.policy.kind, "least_load");
        assert_eq!(config.server.first_byte_timeout_ms, 30_000);
        assert_eq!(config.server.stream_idle_timeout_ms, 60_000);
        assert_eq!(config.server.request_deadline_ms, 600_000);
        assert_eq!(config.server.metrics_address(), None, "/metrics on port");
        assert_eq!(config.outlier_detection.consecutive_failures, 3);
        assert_eq!(
            config.outlier_detection.probe_for("sglang"),
            ProbeKind::HealthGenerate
        );
        assert_eq!(
            config.outlier_detection.probe_for("vllm"),
            ProbeKind::Completion
        );
        assert!(!config.sync.enabled, "replica sync is off by default");
        assert_eq!(config.sync.nats_url, "nats://127.0.0.1:4222");
        assert_eq!(config.sync.subject(), "llm-router.pending");
        assert_eq!(config.sync.publish_interval_ms, 25);
        assert_eq!(config.sync.entry_ttl_ms, 1000);
        assert_eq!(
            config.sync.full_state_interval(),
            Duration::from_millis(250)
        );
        assert!(config.sync.share_prefixes);
        assert_eq!(config.sync.prefix_subject(), "llm-router.prefix");
        assert_eq!(config.sync.snapshot_subject(), "llm-router.snapshot");
        assert_eq!(config.sync.snapshot_timeout_ms, 2000);
    }

    #[test]
    fn sync_is_set_by_file_environment_and_flags() {
        let toml = file(
            "[sync]\nenabled = true\nnats_url = \"nats://10.0.0.9:4333\"\nreplica_id = \"from-file\"\n",
        );
        let config = RouterConfig::load(Layers {
            file: Some(&toml.0),
            environment: env(&[
                ("ROUTER__SYNC__SUBJECT_PREFIX", "fleet.a"),
                ("ROUTER__SYNC__REPLICA_ID", "from-env"),
            ]),
            overrides: vec![("sync.publish_interval_ms".into(), config::Value::from(40))],
            workers: Vec::new(),
        })
        .unwrap();
        assert!(config.sync.enabled);
        assert_eq!(config.sync.nats_url, "nats://10.0.0.9:4333");
        assert_eq!(config.sync.subject(), "fleet.a.pending");
        assert_eq!(config.sync.effective_replica_id(), "from-env");
        assert_eq!(config.sync.publish_interval_ms, 40);
        let generated = SyncConfig::default().effective_replica_id();
        assert!(is_valid_replica_id(&generated), "{generated}");
        assert!(
            generated.ends_with(&format!("-{}", std::process::id())),
            "{generated}"
        );
    }

    #[test]
    fn a_metrics_listener_is_set_by_port_and_host() {
        let config = RouterConfig::load(Layers {
            environment: env(&[("ROUTER__SERVER__METRICS_PORT", "29000")]),
            ..Layers::default()
        })
        .unwrap();
        assert_eq!(config.server.metrics_port, Some(29000));
        assert_eq!(
            config.server.metrics_address().as_deref(),
            Some("127.0.0.1:29000"),
            "the main listener's host"
        );
        let config = RouterConfig::load(Layers {
            environment: env(&[
                ("ROUTER__SERVER__METRICS_PORT", "29000"),
                ("ROUTER__SERVER__METRICS_HOST", "0.0.0.0"),
            ]),
            ..Layers::default()
        })
        .unwrap();
        assert_eq!(
            config.server.metrics_address().as_deref(),
            Some("0.0.0.0:29000")
        );
        let text = config.to_toml().unwrap();
        assert!(text.contains("metrics_port = 29000"), "{text}");
    }

    #[test]
    fn nats_urls_are_checked() {
        for good in [
            "nats://127.0.0.1:4222",
            "nats://broker",
            "nats://broker:1/",
            "nats://[::1]:4222",
            "nats://[::1]",
        ] {
            assert!(is_valid_nats_url(good), "{good}");
        }
        for bad in [
            "",
            "127.0.0.1:4222",
            "tls://h:4222",
            "nats://",
            "nats://:4222",
            "nats://h:0",
            "nats://h:99999",
            "nats://h:4222/path",
            "nats://user:pw@h:4222",
        ] {
            assert!(!is_valid_nats_url(bad), "{bad}");
        }
    }

    #[test]
    fn a_non_streaming_head_may_take_its_generation_time() {
        let server = ServerConfig::default();
        assert_eq!(
            server.head_timeout(true, Some(4096)),
            Duration::from_secs(30)
        );
        assert_eq!(
            server.head_timeout(false, Some(100)),
            Duration::from_secs(50),
            "30 s + 100 tokens at 5 tok/s"
        );
        assert_eq!(server.head_timeout(false, None), server.request_deadline());
        assert!(
            server.head_timeout(false, Some(u64::MAX)) > Duration::from_secs(86_400 * 365),
            "absurd limits saturate, never panic"
        );
    }

    #[test]
    fn probe_kinds_are_set_per_backend() {
        let toml = file("[outlier_detection.probe]\nvllm = \"health\"\n");
        let config = RouterConfig::load(Layers {
            file: Some(&toml.0),
            ..Layers::default()
        })
        .unwrap();
        let outlier = &config.outlier_detection;
        assert_eq!(outlier.probe_for("vllm"), ProbeKind::Health);
        assert_eq!(
            outlier.probe_for("sglang"),
            ProbeKind::HealthGenerate,
            "defaults kept"
        );
        let toml = file("[outlier_detection.probe]\nvllm = \"ping\"\n");
        let error = RouterConfig::load(Layers {
            file: Some(&toml.0),
            ..Layers::default()
        })
        .unwrap_err();
        assert!(
            error.to_string().contains(
                "unknown probe \"ping\"; valid probes: health_generate, completion, health"
            ),
            "{error}"
        );
    }

    #[test]
    fn layers_override_in_order() {
        let toml = file(
            r#"
            [server]
            port = 9000
            max_retries = 5
            [load_monitor]
            interval_ms = 200
            [policy]
            kind = "power_of_two"
            [policy.least_load]
            kv_pressure_weight = 0.3
            "#,
        );
        let config = RouterConfig::load(Layers {
            file: Some(&toml.0),
            environment: env(&[
                ("ROUTER__SERVER__PORT", "9100"),
                ("ROUTER__LOAD_MONITOR__TIMEOUT_MS", "150"),
                ("OTHER__SERVER__PORT", "1"),
            ]),
            overrides: vec![("server.port".into(), config::Value::from(9200))],
            workers: Vec::new(),
        })
        .unwrap();
        assert_eq!(config.server.port, 9200, "the flag wins");
        assert_eq!(config.server.max_retries, 5, "the file beats the default");
        assert_eq!(
            config.load_monitor.timeout_ms, 150,
            "the environment beats the default"
        );
        assert_eq!(config.load_monitor.interval_ms, 200);
        assert_eq!(config.policy.kind, "power_of_two");
        assert_eq!(
            config.policy.sections["least_load"]["kv_pressure_weight"],
            0.3
        );
    }

    #[test]
    fn worker_flags_replace_the_files_list() {
        let toml = file(
            r#"
            [[workers]]
            url = "http://127.0.0.1:1"
            backend = "sglang"
            [[workers]]
            url = "http://127.0.0.1:2"
            backend = "vllm"
            "#,
        );
        let from_file = RouterConfig::load(Layers {
            file: Some(&toml.0),
            ..Layers::default()
        })
        .unwrap();
        assert_eq!(from_file.workers.len(), 2);
        let flagged = RouterConfig::load(Layers {
            file: Some(&toml.0),
            workers: vec![
                parse_worker_flag("tokenspeed=http://h:8000,loads=grpc://h:19000").unwrap(),
            ],
            ..Layers::default()
        })
        .unwrap();
        assert_eq!(
            flagged.workers,
            vec![WorkerConfig {
                url: "http://h:8000".into(),
                backend: Some("tokenspeed".into()),
                load_url: Some("grpc://h:19000".into()),
                api_key: None,
            }]
        );
    }

    #[test]
    fn worker_flags_parse_or_explain() {
        let bare = parse_worker_flag("http://h:30000").unwrap();
        assert_eq!(bare.backend, None);
        assert_eq!(
            parse_worker_flag("vllm=http://h:8000")
                .unwrap()
                .backend
                .as_deref(),
            Some("vllm")
        );
        let cases = [
            (
                "h:1",
                r#"invalid --worker url = "h:1": must be an http:// or https://host:port URL without a query"#,
            ),
            (
                "sglang=ftp://h:1",
                r#"invalid --worker url = "ftp://h:1": must be an http:// or https://host:port URL without a query"#,
            ),
            (
                "sglang=http://h:1,weight=2",
                r#"invalid --worker = "sglang=http://h:1,weight=2": must be [BACKEND=]URL[,loads=LOAD_URL]"#,
            ),
        ];
        for (flag, message) in cases {
            assert_eq!(
                parse_worker_flag(flag).unwrap_err().to_string(),
                message,
                "{flag}"
            );
        }
        // Backend names and load addresses are the registry's to judge.
        let backends = crate::RouterBuilder::with_builtins().backends().clone();
        let against_registry = [
            (
                "tokenspeed=http://h:8000",
                "invalid workers[0].load_url = none: must be a grpc://host:port address (required by this backend)",
            ),
            (
                "nginx=http://h:1",
                r#"invalid workers[0].backend = "nginx": must be one of sglang, sglang-grpc, tokenspeed, vllm, vllm-grpc"#,
            ),
            (
                "vllm-grpc=http://h:1,loads=http://h:2",
                r#"invalid workers[0].load_url = "http://h:2": must be a grpc://host:port address (required by this backend)"#,
            ),
            (
                "vllm=http://h:1,loads=grpc://h:2",
                r#"invalid workers[0].load_url = "grpc://h:2": must be an http:// or https://host:port URL without a query, or none"#,
            ),
        ];
        for (flag, message) in against_registry {
            let config = RouterConfig {
                workers: vec![parse_worker_flag(flag).unwrap()],
                ..RouterConfig::default()
            };
            assert_eq!(
                config.validate_workers(&backends).unwrap_err().to_string(),
                message,
                "{flag}"
            );
        }
        let fine = RouterConfig {
            workers: vec![
                parse_worker_flag("tokenspeed=http://h:8000,loads=grpc://h:19000").unwrap(),
                parse_worker_flag("http://h:30000").unwrap(),
            ],
            ..RouterConfig::default()
        };
        fine.validate_workers(&backends).unwrap();
        let mut keyed = parse_worker_flag("sglang=http://h:1").unwrap();
        keyed.api_key = Some("sk-1\nInjected: yes".into());
        let (field, value, _) = validate_worker(&keyed, &backends).unwrap_err();
        assert_eq!((field, value.as_str()), ("api_key", "(redacted)"));
    }

    #[test]
    fn invalid_values_name_the_key_the_value_and_what_is_allowed() {
        let cases = [
            (
                "[load_monitor]\ninterval_ms = 5000",
                "invalid load_monitor.stale_after_ms = 3000: must be greater than load_monitor.interval_ms (5000)",
            ),
            (
                "[request]\nchars_per_token = 0.0",
                "invalid request.chars_per_token = 0: must be a finite number > 0",
            ),
            (
                "[request]\nprefix_hash_block_tokens = 0",
                "invalid request.prefix_hash_block_tokens = 0: must be an integer from 1 to 65536",
            ),
            (
                "[request]\nprefix_hash_block_tokens = 65536\nchars_per_token = 100.0",
                "invalid request.prefix_hash_block_tokens = 65536: must be at most 1048576 bytes of text per block with request.chars_per_token = 100",
            ),
            (
                "[request]\nprefix_hash_max_tokens = 63",
                "invalid request.prefix_hash_max_tokens = 63: must be 0 (off) or at least request.prefix_hash_block_tokens (64)",
            ),
            (
                "[server]\nbody_limit_bytes = 0",
                "invalid server.body_limit_bytes = 0: must be at least 1",
            ),
            (
                "[health]\nfailure_threshold = 0",
                "invalid health.failure_threshold = 0: must be at least 1",
            ),
            (
                "[server]\nrequest_timeout_ms = 600000",
                "invalid server.request_timeout_ms = 600000: must be removed: set server.first_byte_timeout_ms (per attempt), server.stream_idle_timeout_ms and server.request_deadline_ms (overall) instead",
            ),
            (
                "[server]\nfirst_byte_timeout_ms = 5000\nrequest_deadline_ms = 1000",
                "invalid server.first_byte_timeout_ms = 5000: must be at most server.request_deadline_ms (1000)",
            ),
            (
                "[server]\nclient_header_timeout_ms = 0",
                "invalid server.client_header_timeout_ms = 0: must be at least 1",
            ),
            (
                "[server]\nmax_connections = 0",
                "invalid server.max_connections = 0: must be at least 1",
            ),
            (
                "[hedging]\npredicted_wait_multiple = -1.0",
                "invalid hedging.predicted_wait_multiple = -1: must be a finite number ≥ 0",
            ),
            (
                "[hedging]\npredicted_wait_multiple = nan",
                "invalid hedging.predicted_wait_multiple = NaN: must be a finite number ≥ 0",
            ),
            (
                "[hedging]\nmax_percent = 101.0",
                "invalid hedging.max_percent = 101: must be 0 to 100",
            ),
            (
                "[server]\nport = 9000\nmetrics_port = 9000",
                "invalid server.metrics_port = 9000: must be a port other than server.port (9000) on the same host",
            ),
            (
                "[server]\nport = 9000\nmetrics_port = 9000\nmetrics_host = \"127.0.0.1\"",
                "invalid server.metrics_port = 9000: must be a port other than server.port (9000) on the same host",
            ),
            (
                "[server]\nmetrics_host = \"0.0.0.0\"",
                "invalid server.metrics_host = \"0.0.0.0\": must be set only with server.metrics_port",
            ),
            (
                "[server]\nmetrics_port = 29000\nmetrics_host = \" \"",
                "invalid server.metrics_host = \" \": must be a host name or IP address",
            ),
            (
                "[outlier_detection]\nmax_ejection_ms = 5000\nbase_ejection_ms = 10000",
                "invalid outlier_detection.max_ejection_ms = 5000: must be at least outlier_detection.base_ejection_ms (10000)",
            ),
            (
                "[outlier_detection]\nmax_ejected_percent = 101",
                "invalid outlier_detection.max_ejected_percent = 101: must be a percentage from 0 to 100",
            ),
            (
                "[outlier_detection]\nconsecutive_failures = 0",
                "invalid outlier_detection.consecutive_failures = 0: must be at least 1",
            ),
            (
                "[sync]\nnats_url = \"localhost:4222\"",
                "invalid sync.nats_url = \"localhost:4222\": must be a nats://host[:port] URL (this build has no TLS)",
            ),
            (
                "[sync]\nsubject_prefix = \"fleet.*\"",
                "invalid sync.subject_prefix = \"fleet.*\": must be dot-separated NATS subject tokens without spaces or wildcards (* >), at most 200 bytes",
            ),
            (
                "[sync]\nreplica_id = \"a b\"",
                "invalid sync.replica_id = \"a b\": must be empty (hostname-pid) or 1 to 128 letters, digits, '.', '_' or '-'",
            ),
            (
                "[sync]\npublish_interval_ms = 0",
                "invalid sync.publish_interval_ms = 0: must be from 1 to 10000",
            ),
            (
                "[sync]\npublish_interval_ms = 100\nentry_ttl_ms = 300",
                "invalid sync.entry_ttl_ms = 300: must be from 4 x sync.publish_interval_ms (400) to 600000",
            ),
            (
                "[sync]\nsnapshot_timeout_ms = 50",
                "invalid sync.snapshot_timeout_ms = 50: must be from 100 to 60000",
            ),
            (
                "[sync]\nsnapshot_timeout_ms = 60001",
                "invalid sync.snapshot_timeout_ms = 60001: must be from 100 to 60000",
            ),
        ];
        for (text, message) in cases {
            let toml = file(text);
            let err = RouterConfig::load(Layers {
                file: Some(&toml.0),
                ..Layers::default()
            })
            .unwrap_err();
            assert_eq!(err.to_string(), message, "{text}");
        }
    }

    #[test]
    fn unknown_keys_and_bad_types_are_errors() {
        let toml = file("[server]\nprot = 1");
        let err = RouterConfig::load(Layers {
            file: Some(&toml.0),
            ..Layers::default()
        })
        .unwrap_err();
        assert!(err.to_string().contains("unknown field `prot`"), "{err}");

        let err = RouterConfig::load(Layers {
            environment: env(&[("ROUTER__SERVER__PORT", "eighty")]),
            ..Layers::default()
        })
        .unwrap_err();
        assert!(err.to_string().contains("server.port"), "{err}");

        let missing = Path::new("/nonexistent/router.toml");
        let err = RouterConfig::load(Layers {
            file: Some(missing),
            ..Layers::default()
        })
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "config file /nonexistent/router.toml does not exist"
        );
    }

    #[test]
    fn print_config_round_trips() {
        let config = RouterConfig::load(Layers {
            workers: vec![parse_worker_flag("sglang=http://127.0.0.1:30000").unwrap()],
            ..Layers::default()
        })
        .unwrap();
        let text = config.to_toml().unwrap();
        let again = file(&text);
        let reloaded = RouterConfig::load(Layers {
            file: Some(&again.0),
            ..Layers::default()
        })
        .unwrap();
        assert_eq!(config, reloaded);
    }
}
