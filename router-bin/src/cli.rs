//! The `router` command line. A flag the user did not pass overrides nothing.

use std::path::PathBuf;

use clap::Parser;

use router::ConfigError;
use router::config::{Layers, Value, WorkerConfig, parse_worker_flag};

#[derive(Debug, Parser)]
#[command(
    name = "router",
    version,
    about = "Load-aware router for LLM inference fleets",
    allow_negative_numbers = true
)]
pub(crate) struct Cli {
    /// TOML config file (layers: defaults < file < ROUTER__SECTION__KEY env < flags).
    #[arg(long, value_name = "PATH")]
    pub(crate) config: Option<PathBuf>,
    /// Print the effective configuration as TOML and exit.
    #[arg(long)]
    pub(crate) print_config: bool,
    #[arg(long)]
    host: Option<String>,
    #[arg(long)]
    port: Option<u16>,
    /// Active policy: least_load, power_of_two, least_requests, round_robin, random,
    /// cache_aware, consistent_hash.
    #[arg(long, value_name = "KIND")]
    policy: Option<String>,
    /// A worker, `[BACKEND=]URL[,loads=LOAD_URL]`; repeatable; replaces the file's list.
    #[arg(long = "worker", value_name = "SPEC")]
    workers: Vec<String>,
    #[arg(long)]
    max_retries: Option<u32>,
    #[arg(long)]
    chars_per_token: Option<f64>,
    #[arg(long)]
    load_interval_ms: Option<u64>,
    #[arg(long)]
    load_timeout_ms: Option<u64>,
    #[arg(long)]
    stale_after_ms: Option<u64>,
    #[arg(long)]
    admin_api_key: Option<String>,

    /// Share pending work with other router replicas over NATS (the `[sync]` section).
    #[arg(long)]
    sync: bool,
    /// The NATS broker, `nats://host[:port]`.
    #[arg(long, value_name = "URL")]
    sync_nats_url: Option<String>,
    #[arg(long, value_name = "PREFIX")]
    sync_subject_prefix: Option<String>,
    /// This replica's id in its messages (default: hostname-pid).
    #[arg(long, value_name = "ID")]
    sync_replica_id: Option<String>,
    #[arg(long)]
    sync_publish_interval_ms: Option<u64>,
    #[arg(long)]
    sync_entry_ttl_ms: Option<u64>,
    /// Share prefix placements and cache bounds, and warm from a peer's
    /// prefix snapshot at start (`true` or `false`).
    #[arg(long, value_name = "BOOL")]
    sync_share_prefixes: Option<bool>,
    #[arg(long)]
    sync_snapshot_timeout_ms: Option<u64>,

    #[arg(long)]
    least_load_kv_pressure_weight: Option<f64>,
    #[arg(long)]
    least_load_default_throughput: Option<f64>,
    #[arg(long)]
    least_load_mean_prefill_tokens: Option<u64>,
    #[arg(long)]
    least_load_max_waiting_requests: Option<u64>,
    /// `pending` (default) or `since_poll` (the original estimator).
    #[arg(long)]
    least_load_inflight: Option<String>,
    /// Scores this close to the best are ties, won by the least recently used.
    #[arg(long)]
    least_load_tie_tolerance_secs: Option<f64>,
    /// The divisor: `learned` (default), `reported` or `fixed`.
    #[arg(long)]
    least_load_rate: Option<String>,
    /// How fast a learned rate forgets old samples, in seconds.
    #[arg(long)]
    least_load_rate_half_life_secs: Option<f64>,

    #[arg(long)]
    power_of_two_kv_pressure_weight: Option<f64>,
    #[arg(long)]
    power_of_two_default_throughput: Option<f64>,
    #[arg(long)]
    power_of_two_mean_prefill_tokens: Option<u64>,
    #[arg(long)]
    power_of_two_max_waiting_requests: Option<u64>,
    #[arg(long)]
    power_of_two_inflight: Option<String>,
    #[arg(long)]
    power_of_two_tie_tolerance_secs: Option<f64>,
    #[arg(long)]
    power_of_two_rate: Option<String>,
    #[arg(long)]
    power_of_two_rate_half_life_secs: Option<f64>,
}

impl Cli {
    /// The flags the user passed, as config overrides, and the `--worker` list.
    pub(crate) fn layers(&self) -> Result<Layers<'_>, ConfigError> {
        let mut overrides: Vec<(String, Value)> = Vec::new();
        let mut set = |key: &str, value: Option<Value>| {
            if let Some(value) = value {
                overrides.push((key.to_owned(), value));
            }
        };
        set("server.host", self.host.clone().map(Into::into));
        set("server.port", self.port.map(|port| i64::from(port).into()));
        set(
            "server.max_retries",
            self.max_retries.map(|n| i64::from(n).into()),
        );
        set("policy.kind", self.policy.clone().map(Into::into));
        set(
            "request.chars_per_token",
            self.chars_per_token.map(Into::into),
        );
        set(
            "load_monitor.interval_ms",
            self.load_interval_ms.map(u64_value),
        );
        set(
            "load_monitor.timeout_ms",
            self.load_timeout_ms.map(u64_value),
        );
        set(
            "load_monitor.stale_after_ms",
            self.stale_after_ms.map(u64_value),
        );
        set("admin.api_key", self.admin_api_key.clone().map(Into::into));
        // Only `--sync` turns sync on; without it the file and environment decide.
        set("sync.enabled", self.sync.then_some(true.into()));
        set("sync.nats_url", self.sync_nats_url.clone().map(Into::into));
        set(
            "sync.subject_prefix",
            self.sync_subject_prefix.clone().map(Into::into),
        );
        set(
            "sync.replica_id",
            self.sync_replica_id.clone().map(Into::into),
        );
        set(
            "sync.publish_interval_ms",
            self.sync_publish_interval_ms.map(u64_value),
        );
        set("sync.entry_ttl_ms", self.sync_entry_ttl_ms.map(u64_value));
        set(
            "sync.share_prefixes",
            self.sync_share_prefixes.map(Into::into),
        );
        set(
            "sync.snapshot_timeout_ms",
            self.sync_snapshot_timeout_ms.map(u64_value),
        );
        for (policy, knobs) in [
            (
                "least_load",
                (
                    self.least_load_kv_pressure_weight,
                    self.least_load_default_throughput,
                    self.least_load_mean_prefill_tokens,
                    self.least_load_max_waiting_requests,
                    &self.least_load_inflight,
                    self.least_load_tie_tolerance_secs,
                    &self.least_load_rate,
                    self.least_load_rate_half_life_secs,
                ),
            ),
            (
                "power_of_two",
                (
                    self.power_of_two_kv_pressure_weight,
                    self.power_of_two_default_throughput,
                    self.power_of_two_mean_prefill_tokens,
                    self.power_of_two_max_waiting_requests,
                    &self.power_of_two_inflight,
                    self.power_of_two_tie_tolerance_secs,
                    &self.power_of_two_rate,
                    self.power_of_two_rate_half_life_secs,
                ),
            ),
        ] {
            let (
                weight,
                throughput,
                mean_prefill,
                max_waiting,
                inflight,
                tie_tolerance,
                rate,
                rate_half_life,
            ) = knobs;
            set(
                &format!("policy.{policy}.kv_pressure_weight"),
                weight.map(Into::into),
            );
            set(
                &format!("policy.{policy}.default_throughput"),
                throughput.map(Into::into),
            );
            set(
                &format!("policy.{policy}.mean_prefill_tokens"),
                mean_prefill.map(u64_value),
            );
            set(
                &format!("policy.{policy}.max_waiting_requests"),
                max_waiting.map(u64_value),
            );
            set(
                &format!("policy.{policy}.inflight"),
                inflight.clone().map(Into::into),
            );
            set(
                &format!("policy.{policy}.tie_tolerance_secs"),
                tie_tolerance.map(Into::into),
            );
            set(
                &format!("policy.{policy}.rate"),
                rate.clone().map(Into::into),
            );
            set(
                &format!("policy.{policy}.rate_half_life_secs"),
                rate_half_life.map(Into::into),
            );
        }
        let workers = self
            .workers
            .iter()
            .map(|flag| parse_worker_flag(flag))
            .collect::<Result<Vec<WorkerConfig>, _>>()?;
        Ok(Layers {
            file: self.config.as_deref(),
            environment: None,
            overrides,
            workers,
        })
    }
}

fn u64_value(value: u64) -> Value {
    i64::try_from(value).unwrap_or(i64::MAX).into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use router::RouterConfig;

    #[test]
    fn only_passed_flags_override() {
        let cli = Cli::parse_from([
            "router",
            "--port",
            "9999",
            "--least-load-inflight",
            "since_poll",
        ]);
        let config = RouterConfig::load(cli.layers().unwrap()).unwrap();
        assert_eq!(config.server.port, 9999);
        assert_eq!(config.server.host, "127.0.0.1", "untouched");
        assert_eq!(
            config.policy.sections["least_load"]["inflight"],
            "since_poll"
        );
        assert!(
            !config.policy.sections["least_load"]
                .as_object()
                .unwrap()
                .contains_key("kv_pressure_weight")
        );
    }

    #[test]
    fn sync_flags_override() {
        let config = RouterConfig::load(Cli::parse_from(["router"]).layers().unwrap()).unwrap();
        assert!(!config.sync.enabled, "no --sync, no sync");
        let cli = Cli::parse_from([
            "router",
            "--sync",
            "--sync-nats-url",
            "nats://127.0.0.1:5222",
            "--sync-replica-id",
            "r1",
            "--sync-publish-interval-ms",
            "10",
            "--sync-entry-ttl-ms",
            "500",
            "--sync-share-prefixes",
            "false",
            "--sync-snapshot-timeout-ms",
            "750",
        ]);
        let config = RouterConfig::load(cli.layers().unwrap()).unwrap();
        assert!(config.sync.enabled);
        assert_eq!(config.sync.nats_url, "nats://127.0.0.1:5222");
        assert_eq!(config.sync.replica_id, "r1");
        assert_eq!(config.sync.publish_interval_ms, 10);
        assert_eq!(config.sync.entry_ttl_ms, 500);
        assert!(!config.sync.share_prefixes);
        assert_eq!(config.sync.snapshot_timeout_ms, 750);
        assert_eq!(config.sync.subject_prefix, "llm-router", "untouched");
    }

    #[test]
    fn worker_flags_are_parsed() {
        let cli = Cli::parse_from([
            "router",
            "--worker",
            "sglang=http://h:30000",
            "--worker",
            "tokenspeed=http://h:8000,loads=grpc://h:19000",
        ]);
        let layers = cli.layers().unwrap();
        assert_eq!(layers.workers.len(), 2);
        assert_eq!(
            layers.workers[1].load_url.as_deref(),
            Some("grpc://h:19000")
        );
        // The address is checked here; the backend, against the registry,
        // when the config is loaded.
        let bad = Cli::parse_from(["router", "--worker", "tokenspeed=h:8000"]);
        assert!(bad.layers().is_err());
    }
}
