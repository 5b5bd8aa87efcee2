//! The admission order: which waiting request the router dispatches next
//! when the fleet is saturated.
//!
//! An [`Admission`] only orders. The room around it (bounds, deadlines,
//! predictions, when to release) is the `admission` crate's
//! `AdmissionRoom`; the router and the simulator both drive that room, so
//! an order is synchronous, free of I/O and of HTTP.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use crate::PolicyError;

/// One request waiting for a worker, as an order sees it. The room fills
/// in the class and tenant (with their weights) from its config.
#[derive(Debug, Clone, PartialEq)]
pub struct Waiting {
    /// Unique among the queued requests.
    pub ticket: u64,
    /// The request's class: a configured class's name, or its priority
    /// value's own.
    pub class: Arc<str>,
    /// The class's precedence: lower is served first when shares are equal.
    pub priority: i32,
    /// The class's share of the fleet when classes compete (> 0).
    pub class_weight: f64,
    /// Who sent it (`""` when unknown).
    pub tenant: Arc<str>,
    /// The tenant's share within its class when tenants compete (> 0).
    pub tenant_weight: f64,
    /// The prompt's tokens (estimated): the work it costs to start.
    pub work_tokens: u64,
    pub arrived: Instant,
}

/// One flow of queued requests (a class, or a tenant within a class), for
/// the admin API.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct FlowView {
    pub class: String,
    /// Empty when the order does not separate tenants.
    pub tenant: String,
    pub queued_requests: usize,
    pub queued_work_tokens: u64,
    /// Work served so far over the flow's weight (fair-share orders); the
    /// least is served next.
    pub served_work_per_weight: f64,
}

/// The order in which waiting requests leave the router's queue.
///
/// `peek` and `pop` agree: `pop` removes what `peek` showed. Orders that
/// share the fleet by token work learn each dispatch at `pop` (its prompt)
/// and each answer's output at [`served`](Admission::served).
pub trait Admission: Send + Sync {
    /// The registry name (`fifo`, `priority`, `fair_share`, …).
    fn name(&self) -> &'static str;

    /// The order's parameters, as its config section would hold them.
    fn params(&self) -> serde_json::Value;

    fn push(&mut self, request: Waiting);

    /// The request to dispatch next.
    fn peek(&self) -> Option<&Waiting>;

    /// Removes the request `peek` shows, counting its prompt as served.
    fn pop(&mut self) -> Option<Waiting>;

    /// The tickets of the first `limit` requests, in the order they would
    /// be popped; nothing changes. The default shows the head only, so the
    /// room releases such an order strictly in turn.
    fn in_order(&self, limit: usize) -> Vec<u64> {
        self.peek()
            .filter(|_| limit > 0)
            .map(|head| head.ticket)
            .into_iter()
            .collect()
    }

    /// Removes a request shown by [`in_order`](Admission::in_order),
    /// counting its prompt as served, as `pop` does for the head: the room
    /// releases a later request while one ahead of it waits for its worker.
    fn take(&mut self, ticket: u64) -> Option<Waiting> {
        let request = self.remove(ticket)?;
        self.served(&request.class, &request.tenant, request.work_tokens);
        Some(request)
    }

    /// Removes a request wherever it is (its client left, or its deadline
    /// passed). Nothing is counted as served.
    fn remove(&mut self, ticket: u64) -> Option<Waiting>;

    fn len(&self) -> usize;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The queued work (prompt tokens) expected to be dispatched before
    /// `request`, were it pushed now.
    fn work_ahead(&self, request: &Waiting) -> u64;

    /// For every queued request, in no set order: its ticket and the work
    /// expected to be dispatched before it.
    fn queued_work_ahead(&self) -> Vec<(u64, u64)>;

    /// A request of this class and tenant generated `tokens` more (its
    /// output): orders that share by token work count it.
    fn served(&mut self, class: &str, tenant: &str, tokens: u64) {
        let _ = (class, tenant, tokens);
    }

    /// The queue is full and `request` arrives: the queued request this
    /// order would rather drop (one it would serve after `request`), or
    /// `None` to turn `request` away. The default turns it away.
    fn eviction_for(&self, request: &Waiting) -> Option<u64> {
        let _ = request;
        None
    }

    /// Whether the order keeps `a` and `b` in one flow (so the order
    /// between them is their arrival). The room keeps engines' queues
    /// shorter while arrivals differ. The default: same class and tenant.
    fn same_flow(&self, a: &Waiting, b: &Waiting) -> bool {
        a.class == b.class && a.tenant == b.tenant
    }

    /// Whether `request`, queued, may pass the backlog: go to a worker
    /// now though the fleet is busy, because its flow sends less than its
    /// share (it is the one request of its flow waiting, others' wait, and
    /// it is next to start under its flow's share). The default: never.
    fn passes(&self, request: &Waiting) -> bool {
        let _ = request;
        false
    }

    /// Removes every queued request, oldest first (to move them to another
    /// order on a live swap).
    fn drain(&mut self) -> Vec<Waiting>;

    /// The queued flows, for the admin API.
    fn flows(&self) -> Vec<FlowView>;
}

/// Builds an order from its config section (JSON; `null` for defaults).
pub type AdmissionFactory =
    Arc<dyn Fn(&serde_json::Value) -> Result<Box<dyn Admission>, PolicyError> + Send + Sync>;

/// Admission orders by name. The `admission` crate registers `fifo`,
/// `priority` and `fair_share`; a custom router adds its own.
#[derive(Clone, Default)]
pub struct AdmissionRegistry {
    factories: BTreeMap<String, AdmissionFactory>,
}

impl AdmissionRegistry {
    pub fn new() -> AdmissionRegistry {
        AdmissionRegistry::default()
    }

    pub fn register(
        &mut self,
        name: &str,
        factory: impl Fn(&serde_json::Value) -> Result<Box<dyn Admission>, PolicyError>
        + Send
        + Sync
        + 'static,
    ) {
        self.factories.insert(name.to_owned(), Arc::new(factory));
    }

    pub fn names(&self) -> Vec<&str> {
        self.factories.keys().map(String::as_str).collect()
    }

    pub fn build(
        &self,
        name: &str,
        section: &serde_json::Value,
    ) -> Result<Box<dyn Admission>, PolicyError> {
        let factory = self
            .factories
            .get(name)
            .ok_or_else(|| PolicyError::UnknownAdmission {
                name: name.to_owned(),
                valid: self.names().join(", "),
            })?;
        factory(section)
    }
}

impl fmt::Debug for AdmissionRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdmissionRegistry")
            .field("names", &self.names())
            .finish()
    }
}
