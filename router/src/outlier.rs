//! Outlier ejection, one worker's state: consecutive gateway failures across
//! distinct requests eject the worker for a time that doubles with each
//! ejection (capped), and an ejected worker returns only when a probe that
//! exercises generation passes.
//!
//! The state machine here is pure: callers pass `now`, so the timing rules
//! are unit-tested with paused tokio time. Whether an ejection may happen at
//! all (the fleet-wide cap) is the topology's decision.

use std::time::Duration;

use tokio::time::Instant;

use crate::config::OutlierConfig;

/// What went wrong with one request on one worker: a gateway failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Failure {
    /// No connection could be made, or it was refused or reset before the
    /// response head.
    Connect,
    /// No response head (or, for a stream, no first event) within the
    /// first-byte deadline.
    FirstByteTimeout,
    /// The worker answered a 5xx status.
    ServerError(u16),
    /// The response broke off before it ended.
    Cut,
    /// A stream sent no event within the idle deadline.
    Stalled,
}

impl Failure {
    /// The `status` label of the per-worker request counter.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Failure::Connect => "error",
            Failure::FirstByteTimeout => "timeout",
            Failure::ServerError(_) => "5xx",
            Failure::Cut => "cut",
            Failure::Stalled => "stalled",
        }
    }
}

/// Where a worker stands with outlier detection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Standing {
    InRotation,
    /// Out until `until`; then probed.
    Ejected {
        until: Instant,
    },
    /// The ejection time is over and a probe is running.
    Probing,
}

/// One worker's outlier-detection state.
#[derive(Debug, Clone)]
pub(crate) struct OutlierState {
    consecutive_failures: u32,
    standing: Standing,
    /// How many ejections back to back the next one counts as: its length
    /// is `base · 2^level`, capped. Decays by one per base ejection time
    /// spent in rotation, as Envoy's multiplier does.
    level: u32,
    /// When the worker last returned to rotation (for the decay).
    returned_at: Option<Instant>,
    ejections_total: u64,
}

impl Default for OutlierState {
    fn default() -> OutlierState {
        OutlierState {
            consecutive_failures: 0,
            standing: Standing::InRotation,
            level: 0,
            returned_at: None,
            ejections_total: 0,
        }
    }
}

impl OutlierState {
    pub(crate) fn standing(&self) -> Standing {
        self.standing
    }

    pub(crate) fn is_ejected(&self) -> bool {
        self.standing != Standing::InRotation
    }

    pub(crate) fn consecutive_failures(&self) -> u32 {
        self.consecutive_failures
    }

    pub(crate) fn ejections_total(&self) -> u64 {
        self.ejections_total
    }

    /// A request completed: the run of failures is over.
    pub(crate) fn succeeded(&mut self) {
        self.consecutive_failures = 0;
    }

    /// A gateway failure. Returns true when the worker, in rotation, has
    /// now failed `consecutive_failures` requests in a row and should be
    /// ejected (the caller checks the fleet-wide cap, then calls
    /// [`OutlierState::eject`]). Failures of requests that were sent before
    /// an ejection and end after it do not count twice.
    pub(crate) fn failed(&mut self, config: &OutlierConfig) -> bool {
        if self.is_ejected() {
            return false;
        }
        self.consecutive_failures = self.consecutive_failures.saturating_add(1);
        self.consecutive_failures >= config.consecutive_failures
    }

    /// Ejects the worker; returns how long for.
    pub(crate) fn eject(&mut self, config: &OutlierConfig, now: Instant) -> Duration {
        if let Some(returned_at) = self.returned_at.take() {
            let in_rotation = now.saturating_duration_since(returned_at);
            let decay = in_rotation.as_millis() / u128::from(config.base_ejection_ms.max(1));
            self.level = self
                .level
                .saturating_sub(u32::try_from(decay).unwrap_or(u32::MAX));
        }
        let length = ejection_length(config, self.level);
        self.level = self.level.saturating_add(1);
        self.standing = Standing::Ejected {
            until: now + length,
        };
        self.consecutive_failures = 0;
        self.ejections_total += 1;
        length
    }

    /// Whether the ejection time is over and no probe runs yet; if so, the
    /// worker is marked as probing and the caller starts one probe.
    pub(crate) fn start_probe(&mut self, now: Instant) -> bool {
        match self.standing {
            Standing::Ejected { until } if now >= until => {
                self.standing = Standing::Probing;
                true
            }
            _ => false,
        }
    }

    /// The probe answered as a generating engine: back in rotation.
    pub(crate) fn probe_passed(&mut self, now: Instant) {
        self.standing = Standing::InRotation;
        self.consecutive_failures = 0;
        self.returned_at = Some(now);
    }

    /// The probe failed: ejected again, for longer. Returns how long for.
    pub(crate) fn probe_failed(&mut self, config: &OutlierConfig, now: Instant) -> Duration {
        let length = ejection_length(config, self.level);
        self.level = self.level.saturating_add(1);
        self.standing = Standing::Ejected {
            until: now + length,
        };
        length
    }
}

/// `base · 2^level`, at most `max`.
fn ejection_length(config: &OutlierConfig, level: u32) -> Duration {
    let factor = 1u64.checked_shl(level.min(62)).unwrap_or(u64::MAX);
    let millis = config
        .base_ejection_ms
        .saturating_mul(factor)
        .min(config.max_ejection_ms);
    Duration::from_millis(millis)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> OutlierConfig {
        OutlierConfig {
            consecutive_failures: 3,
            base_ejection_ms: 1_000,
            max_ejection_ms: 5_000,
            ..OutlierConfig::default()
        }
    }

    #[test]
    fn consecutive_failures_eject_and_a_success_resets_the_run() {
        let config = config();
        let mut state = OutlierState::default();
        assert!(!state.failed(&config));
        assert!(!state.failed(&config));
        state.succeeded();
        assert!(!state.failed(&config));
        assert!(!state.failed(&config));
        assert!(state.failed(&config), "the third in a row");
    }

    #[tokio::test(start_paused = true)]
    async fn ejections_double_up_to_the_cap_and_return_only_through_a_probe() {
        let config = config();
        let mut state = OutlierState::default();
        let start = Instant::now();
        assert_eq!(state.eject(&config, start), Duration::from_secs(1));
        assert!(state.is_ejected());
        assert!(
            !state.failed(&config),
            "an ejected worker's late failures do not count"
        );
        assert!(!state.start_probe(start + Duration::from_millis(999)));
        let due = start + Duration::from_secs(1);
        assert!(state.start_probe(due));
        assert!(!state.start_probe(due), "one probe at a time");
        assert!(state.is_ejected(), "probing is still out of rotation");
        assert_eq!(state.probe_failed(&config, due), Duration::from_secs(2));
        assert!(state.start_probe(due + Duration::from_secs(2)));
        assert_eq!(state.probe_failed(&config, due), Duration::from_secs(4));
        assert!(state.start_probe(due + Duration::from_secs(4)));
        assert_eq!(
            state.probe_failed(&config, due),
            Duration::from_secs(5),
            "capped at max_ejection_ms"
        );
        assert!(state.start_probe(due + Duration::from_secs(5)));
        state.probe_passed(due);
        assert!(!state.is_ejected());
        assert_eq!(state.ejections_total(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn time_in_rotation_decays_the_next_ejection() {
        let config = config();
        let mut state = OutlierState::default();
        let start = Instant::now();
        state.eject(&config, start);
        state.start_probe(start + Duration::from_secs(1));
        state.probe_failed(&config, start);
        state.start_probe(start + Duration::from_secs(3));
        state.probe_passed(start + Duration::from_secs(3));
        // Back soon: the next ejection is longer than the first (level 2).
        let soon = start + Duration::from_millis(3_500);
        assert_eq!(state.eject(&config, soon), Duration::from_secs(4));
        state.start_probe(soon + Duration::from_secs(4));
        state.probe_passed(soon + Duration::from_secs(4));
        // After a long healthy spell the multiplier is back to 1.
        let later = soon + Duration::from_secs(60);
        assert_eq!(state.eject(&config, later), Duration::from_secs(1));
    }

    #[test]
    fn absurd_levels_saturate_at_the_cap() {
        let config = config();
        assert_eq!(ejection_length(&config, 200), Duration::from_secs(5));
        assert_eq!(ejection_length(&config, 0), Duration::from_secs(1));
    }
}
