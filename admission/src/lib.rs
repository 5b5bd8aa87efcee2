//! What the router does with a request when the fleet is saturated: the
//! admission room.
//!
//! When every candidate's expected wait is above the room's threshold (or
//! every worker is at its cap), a request waits in the router instead of
//! being dispatched, and the policy chooses its worker only when it leaves
//! (late binding). Which waiting request leaves next is an
//! [`Admission`](policy_core::Admission) order, built by name: `fifo`,
//! `priority` (classes by priority value, weighted) and `fair_share`
//! (classes, then tenants within a class, each sharing by token work). The
//! room bounds the queue and turns away, at once, a request whose predicted
//! wait is past its TTFT deadline.
//!
//! ```
//! use std::sync::Arc;
//! use std::time::{Duration, Instant};
//! use admission::{AdmissionRoom, Arrival, Decision, RoomConfig, registry};
//! use policy_core::ExpectedWait;
//!
//! let order = registry().build("priority", &serde_json::Value::Null)?;
//! let mut room = AdmissionRoom::new(order, RoomConfig::default());
//! let now = Instant::now();
//! let wait = |queue_secs| Some(ExpectedWait { queue_secs, prefill_secs: 0.1, ..Default::default() });
//! let busy = wait(3.0);
//! let request = |priority| Arrival {
//!     priority: Some(priority),
//!     tenant: Arc::from("team-a"),
//!     ttft_deadline: None,
//!     work_tokens: 500,
//! };
//! // Every worker is busy: both wait, and the lower priority value goes first.
//! let Decision::Queued(batch) = room.arrive(&request(5), busy, now) else { panic!() };
//! let Decision::Queued(chat) = room.arrive(&request(0), busy, now) else { panic!() };
//! let idle = wait(0.0);
//! assert!(room.has_room(idle));
//! assert_eq!(room.pop(now).map(|r| r.ticket), Some(chat));
//! assert_eq!(room.pop(now).map(|r| r.ticket), Some(batch));
//!
//! // A deadline the queue cannot meet is refused at once.
//! let hurried = Arrival { ttft_deadline: Some(Duration::from_millis(500)), ..request(0) };
//! assert!(matches!(room.arrive(&hurried, busy, now), Decision::Rejected(_)));
//! # Ok::<(), policy_core::PolicyError>(())
//! ```

mod order;
mod room;

use policy_core::{AdmissionRegistry, PolicyError};

pub use order::{FAIR_SHARE, FIFO, PRIORITY};
pub use room::{
    AdmissionRoom, Arrival, ClassConfig, Classified, DEFAULT_MAX_QUEUE_REQUESTS, DEFAULT_PEER_LAG,
    DEFAULT_QUEUE_ABOVE_WAIT_MS, DEFAULT_REORDER_ABOVE_WAIT_MS, Decision, Expected, Explanation,
    PASS_WITHIN_THRESHOLDS, PREFILL_BOUND_SHARE, PREFILL_BOUND_THRESHOLD_FACTOR, RELEASE_LOOKAHEAD,
    REORDER_WINDOW, RejectReason, Rejection, ReleaseTurn, Released, RoomConfig, RoomConfigError,
    RoomReport, RoomView, Route, Shed, WORKER_WAIT_BEHIND_REPLICAS, default_class_weight,
};

use order::{BuiltinOrder, Grouping};

/// The order a router uses with no `[admission] order` set.
pub const DEFAULT_ORDER: &str = PRIORITY;

/// Adds `fifo`, `priority` and `fair_share` to `registry`. None takes
/// parameters: an order's section must be empty (or absent).
pub fn register(registry: &mut AdmissionRegistry) {
    for (name, grouping) in [
        (FIFO, Grouping::Fifo),
        (PRIORITY, Grouping::Classes),
        (FAIR_SHARE, Grouping::ClassesAndTenants),
    ] {
        registry.register(name, move |section| {
            let empty = section.is_null() || section.as_object().is_some_and(|o| o.is_empty());
            if !empty {
                return Err(PolicyError::InvalidParameter {
                    policy: name.to_owned(),
                    key: "section",
                    value: section.to_string(),
                    allowed: "empty: the order takes no parameters",
                });
            }
            Ok(Box::new(BuiltinOrder::new(name, grouping)))
        });
    }
}

/// A registry holding the built-in orders.
pub fn registry() -> AdmissionRegistry {
    let mut registry = AdmissionRegistry::new();
    register(&mut registry);
    registry
}

#[cfg(test)]
mod tests;
