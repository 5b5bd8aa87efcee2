//! The room around an order: who waits, who is turned away, who leaves.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use policy_core::{Admission, Dispatch, ExpectedWait, FlowView, Waiting, WorkerId};

/// How the room decides, shared by the router and the simulator.
#[derive(Debug, Clone, PartialEq)]
pub struct RoomConfig {
    /// A request waits in the router while every candidate's expected
    /// wait (the policy's, before the request's own prefill) is above this.
    pub queue_above_wait: Duration,
    /// The same threshold while there is something to reorder: arrivals of
    /// different classes or tenants, or with a TTFT deadline, within the
    /// last [`REORDER_WINDOW`]. Lower: the backlog waits in the router,
    /// where the order applies, rather than at the engines.
    pub reorder_above_wait: Duration,
    /// Requests beyond this many are turned away (`QueueFull`); behind
    /// several router replicas, this many in all their rooms together.
    pub max_queue_requests: usize,
    /// Named classes of priority values. Empty: each priority value is a
    /// class of its own, weighted [`default_class_weight`].
    pub classes: Vec<ClassConfig>,
    /// Tenants' weights within a class (`fair_share`); others weigh 1.
    pub tenant_weights: BTreeMap<String, f64>,
    /// Behind several router replicas: how much longer another replica's
    /// oldest request must have waited than this one's before this
    /// replica leaves the fleet's room to it (see
    /// [`AdmissionRoom::yields_to_peers`]). The router sets it from how
    /// often replicas hear of each other.
    pub peer_lag: Duration,
}

impl Default for RoomConfig {
    fn default() -> RoomConfig {
        RoomConfig {
            queue_above_wait: Duration::from_millis(DEFAULT_QUEUE_ABOVE_WAIT_MS),
            reorder_above_wait: Duration::from_millis(DEFAULT_REORDER_ABOVE_WAIT_MS),
            max_queue_requests: DEFAULT_MAX_QUEUE_REQUESTS,
            classes: Vec::new(),
            tenant_weights: BTreeMap::new(),
            peer_lag: DEFAULT_PEER_LAG,
        }
    }
}

/// [`RoomConfig::peer_lag`] unless the router sets it.
pub const DEFAULT_PEER_LAG: Duration = Duration::from_millis(50);

pub const DEFAULT_QUEUE_ABOVE_WAIT_MS: u64 = 1500;
pub const DEFAULT_REORDER_ABOVE_WAIT_MS: u64 = 100;
/// How long after an arrival that differs from the one before it (or has
/// a deadline) the room keeps to `reorder_above_wait`.
pub const REORDER_WINDOW: Duration = Duration::from_secs(10);
/// At arrival, a request is turned away when its predicted TTFT is above
/// this share of its deadline: the prediction is a point estimate, and a
/// request admitted close to its deadline would more often be turned away
/// later, after a wait, or served late.
const ARRIVAL_DEADLINE_SHARE: f64 = 0.75;
pub const DEFAULT_MAX_QUEUE_REQUESTS: usize = 1024;
/// A request that passes the backlog goes to its worker while the wait
/// expected there is at most this many thresholds. Deeper, it waits in the
/// room like the rest: bound early to one busy worker, it would miss
/// another that frees sooner, and a flow that passes because of its weight
/// but sends more than the fleet serves would fill the engines' queues.
/// (Twice the threshold served multi-turn priority 1 requests late in the
/// admission gate; six let an overloading priority 0 queue at the engines.)
pub const PASS_WITHIN_THRESHOLDS: f64 = 4.0;
/// A fleet is prefill-bound while the uncached prompt work sent to it
/// lately keeps at least this share of its workers computing prompts.
pub const PREFILL_BOUND_SHARE: f64 = 0.65;
/// How many times `reorder_above_wait` the threshold while reordering is
/// on a prefill-bound fleet.
pub const PREFILL_BOUND_THRESHOLD_FACTOR: f64 = 1.5;
/// How long prompts must have been sent before a fleet is judged
/// prefill-bound: the policy's first predictions are at its prior rate.
const PREFILL_BOUND_HISTORY: Duration = Duration::from_secs(10);
/// Behind several router replicas, a request waits at its turn for its
/// busy worker at most this long, then joins that worker's queue. One
/// router keeps a worker's room for the first request in its order that
/// waits for it; replicas share only their heads' waits
/// ([`RoomReport::waiting_for`]), and the one whose own requests free the
/// worker hears of it first. Much shorter, the backlog moves to the
/// engines' queues, where the room's order no longer applies.
pub const WORKER_WAIT_BEHIND_REPLICAS: Duration = Duration::from_secs(2);
/// How far past a request waiting for its busy worker a release looks for
/// requests whose workers have room.
pub const RELEASE_LOOKAHEAD: usize = 32;

/// A class of requests: those whose priority value is at most `priority`
/// (and above the previous class's).
#[derive(Debug, Clone, PartialEq)]
pub struct ClassConfig {
    pub name: String,
    pub priority: i32,
    /// The class's share when classes compete (> 0).
    pub weight: f64,
    /// The TTFT deadline of a request of this class that names none.
    pub ttft_deadline: Option<Duration>,
}

/// An unconfigured priority value's weight: each step down the order
/// (a higher value) takes an eighth of the share, so a lower value is
/// served first whenever both wait, and a higher one still progresses.
pub fn default_class_weight(priority: i32) -> f64 {
    8f64.powi(-priority.clamp(-6, 6))
}

/// Why a room's config cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RoomConfigError {
    #[error("admission.max_queue_requests must be at least 1")]
    EmptyQueue,
    #[error("admission class {name:?}: weight {weight} must be a finite number above 0")]
    ClassWeight { name: String, weight: f64 },
    #[error("admission classes {first:?} and {second:?} have the same priority {priority}")]
    SamePriority {
        first: String,
        second: String,
        priority: i32,
    },
    #[error("admission class name {name:?} is used twice")]
    SameName { name: String },
    #[error("admission tenant {tenant:?}: weight {weight} must be a finite number above 0")]
    TenantWeight { tenant: String, weight: f64 },
}

impl RoomConfig {
    /// Checks the weights and classes; sorts the classes by priority.
    pub fn validated(mut self) -> Result<RoomConfig, RoomConfigError> {
        if self.max_queue_requests == 0 {
            return Err(RoomConfigError::EmptyQueue);
        }
        for class in &self.classes {
            if !(class.weight.is_finite() && class.weight > 0.0) {
                return Err(RoomConfigError::ClassWeight {
                    name: class.name.clone(),
                    weight: class.weight,
                });
            }
        }
        self.classes.sort_by_key(|class| class.priority);
        for pair in self.classes.windows(2) {
            if pair[0].priority == pair[1].priority {
                return Err(RoomConfigError::SamePriority {
                    first: pair[0].name.clone(),
                    second: pair[1].name.clone(),
                    priority: pair[0].priority,
                });
            }
        }
        let mut names: Vec<&str> = self.classes.iter().map(|c| c.name.as_str()).collect();
        names.sort_unstable();
        if let Some(pair) = names.windows(2).find(|pair| pair[0] == pair[1]) {
            return Err(RoomConfigError::SameName {
                name: pair[0].to_owned(),
            });
        }
        for (tenant, weight) in &self.tenant_weights {
            if !(weight.is_finite() && *weight > 0.0) {
                return Err(RoomConfigError::TenantWeight {
                    tenant: tenant.clone(),
                    weight: *weight,
                });
            }
        }
        Ok(self)
    }
}

/// What the policy expects for a request, from
/// [`Policy::expected_wait`](policy_core::Policy::expected_wait) and
/// [`Policy::preview`](policy_core::Policy::preview).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Expected {
    /// At the least busy candidate: whether the fleet has room.
    pub fleet: Option<ExpectedWait>,
    /// At the worker the policy would choose: the request's own wait,
    /// which its deadline is judged on. `None`: the policy cannot tell,
    /// and `fleet` stands for it.
    pub chosen: Option<ExpectedWait>,
}

impl Expected {
    /// The wait the request itself is predicted.
    fn own(&self) -> Option<ExpectedWait> {
        self.chosen.or(self.fleet)
    }
}

impl From<Option<ExpectedWait>> for Expected {
    /// A policy's one wait, at the fleet and the chosen worker alike.
    fn from(fleet: Option<ExpectedWait>) -> Expected {
        Expected {
            fleet,
            chosen: None,
        }
    }
}

/// What the router knows of an arriving request that the room decides on.
#[derive(Debug, Clone, PartialEq)]
pub struct Arrival {
    /// The request's priority value (lower first); `None` counts as 0.
    pub priority: Option<i32>,
    /// Who sent it (`""` when unknown).
    pub tenant: Arc<str>,
    /// The request's own TTFT deadline; `None` takes its class's.
    pub ttft_deadline: Option<Duration>,
    /// The prompt's tokens (estimated).
    pub work_tokens: u64,
}

/// Why a request was turned away.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RejectReason {
    /// The queue holds `max_queue_requests` already.
    QueueFull,
    /// Its predicted wait is longer than its TTFT deadline allows.
    DeadlineUnmeetable,
    /// Its TTFT deadline passed while it waited.
    DeadlinePassed,
}

impl RejectReason {
    pub const ALL: [RejectReason; 3] = [
        RejectReason::QueueFull,
        RejectReason::DeadlineUnmeetable,
        RejectReason::DeadlinePassed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RejectReason::QueueFull => "queue_full",
            RejectReason::DeadlineUnmeetable => "deadline_unmeetable",
            RejectReason::DeadlinePassed => "deadline_passed",
        }
    }
}

/// A request turned away, and when to come back.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rejection {
    pub reason: RejectReason,
    /// Whole seconds, at least 1: when the queue ahead should have drained
    /// enough (the `Retry-After` header).
    pub retry_after_s: u64,
    /// The wait the room predicted, when it predicted one.
    pub predicted_wait: Option<Duration>,
}

/// What to do with an arriving request.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Dispatch it now. If the policy then finds every worker capped, pass
    /// the request to [`AdmissionRoom::enqueue`].
    DispatchNow,
    /// It waits under this ticket until [`AdmissionRoom::pop`] releases it
    /// or [`AdmissionRoom::shed`] turns it away.
    Queued(u64),
    Rejected(Rejection),
}

/// A queued request's turn to be released (see
/// [`AdmissionRoom::release_order`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReleaseTurn {
    pub ticket: u64,
    /// When its TTFT deadline passes.
    pub due: Option<Instant>,
    /// It passes the backlog ([`Admission::passes`]): the one request of
    /// its flow waiting, while other flows' wait, and its flow next to
    /// start under its share. It goes to the worker its policy chooses
    /// whether the fleet has room or not, unless the wait there is more
    /// than [`PASS_WITHIN_THRESHOLDS`] thresholds
    /// ([`route`](AdmissionRoom::route)):
    /// a flow sending less than its share does not wait for the heavier
    /// flows' backlog to drain. Its share bounds it: a flow sending more
    /// runs ahead on its count, and waits.
    pub passes: bool,
    /// Its deadline is near ([`shed`](AdmissionRoom::shed) found it): it
    /// would meet it at the least busy worker now, and not after waiting
    /// twice the threshold more. Unless a request of a lower priority
    /// value waits, it goes now, whether the fleet has room or not: to the
    /// worker its policy chooses if it meets the deadline there, else to
    /// the best of the others ([`Route::WithRoom`]), rather than wait to be
    /// turned away.
    pub last_moment: bool,
}

impl ReleaseTurn {
    /// Whether it may go though the fleet has no room: it passes, or is
    /// at its last moment.
    pub fn goes_without_fleet_room(&self) -> bool {
        self.passes || self.last_moment
    }
}

/// Where a request whose turn it is goes ([`AdmissionRoom::route`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// To the worker the policy chooses: it has room.
    Chosen,
    /// Nowhere yet: it waits for its chosen worker, which is busy.
    Wait,
    /// To the best of the workers with room (of all, when none has room):
    /// waiting for its chosen one would miss its deadline, or leave a
    /// worker the room counts as finishing its prompt with none to
    /// compute next ([`AdmissionRoom::counts_progress`]).
    WithRoom,
}

/// A request leaving the queue for a worker.
#[derive(Debug, Clone, PartialEq)]
pub struct Released {
    pub ticket: u64,
    pub class: Arc<str>,
    pub waited: Duration,
}

/// A queued request turned away by [`AdmissionRoom::shed`].
#[derive(Debug, Clone, PartialEq)]
pub struct Shed {
    pub ticket: u64,
    pub class: Arc<str>,
    pub waited: Duration,
    pub rejection: Rejection,
}

/// What the room would decide for a request, and why
/// ([`AdmissionRoom::explain`]).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Explanation {
    /// `dispatch_now`, `queue`, or the reason it would be turned away
    /// ([`RejectReason::as_str`]).
    pub decision: &'static str,
    pub class: String,
    pub priority: i32,
    pub class_weight: f64,
    pub tenant: String,
    pub tenant_weight: f64,
    pub ttft_deadline_s: Option<f64>,
    /// The policy's expected wait at the least busy worker, and the
    /// request's own prefill (`None`: the policy has no model of wait).
    pub expected_queue_s: Option<f64>,
    pub expected_prefill_s: Option<f64>,
    /// The expected wait at the worker the policy would choose (`None`:
    /// the policy cannot tell).
    pub chosen_queue_s: Option<f64>,
    /// Queued work dispatched before it, were it queued now.
    pub work_ahead_tokens: u64,
    pub drain_tokens_per_s: Option<f64>,
    pub predicted_ttft_s: Option<f64>,
}

enum Verdict {
    DispatchNow,
    Queue,
    Reject(Rejection),
}

struct Judged {
    verdict: Verdict,
    ahead: u64,
    predicted: Option<Duration>,
    /// The queued request to drop to make room (a full queue).
    evicts: Option<u64>,
}

/// `classified`'s request as the order sees it.
fn waiting(ticket: u64, classified: &Classified, work_tokens: u64, now: Instant) -> Waiting {
    Waiting {
        ticket,
        class: classified.class.clone(),
        priority: classified.priority,
        class_weight: classified.class_weight,
        tenant: classified.tenant.clone(),
        tenant_weight: classified.tenant_weight,
        work_tokens,
        arrived: now,
    }
}

/// A request's class, tenant and deadline, as the room resolved them.
#[derive(Debug, Clone, PartialEq)]
pub struct Classified {
    pub class: Arc<str>,
    pub priority: i32,
    pub class_weight: f64,
    pub tenant: Arc<str>,
    pub tenant_weight: f64,
    pub ttft_deadline: Option<Duration>,
}

#[derive(Debug, Clone)]
struct Entry {
    /// The request as the order holds it.
    request: Waiting,
    /// When its TTFT deadline passes.
    due: Option<Instant>,
    /// Its own prefill at a typical worker's rate, as predicted.
    prefill: Duration,
    /// Its deadline is near: see [`ReleaseTurn::last_moment`].
    last_moment: bool,
    /// The busy worker it waits for at its turn, and since when.
    waits_for: Option<(WorkerId, Instant)>,
}

/// How much of something (prompt tokens, seconds of prefill) the room
/// has sent lately, per second: a sum decaying with a time constant,
/// divided by the window it has had time to fill.
#[derive(Debug, Clone, Default)]
struct RecentRate {
    decayed: f64,
    last: Option<Instant>,
    first: Option<Instant>,
}

const RECENT_RATE_TIME_CONSTANT_S: f64 = 2.0;
/// Before this much history the rate is not trusted.
const RECENT_RATE_WARMUP_S: f64 = 0.5;

impl RecentRate {
    fn add(&mut self, amount: f64, now: Instant) {
        self.decay_to(now);
        self.decayed += amount;
        self.first.get_or_insert(now);
    }

    fn decay_to(&mut self, now: Instant) {
        if let Some(last) = self.last {
            let elapsed = now.saturating_duration_since(last).as_secs_f64();
            self.decayed *= (-elapsed / RECENT_RATE_TIME_CONSTANT_S).exp();
        }
        self.last = Some(now.max(self.last.unwrap_or(now)));
    }

    /// Whether the first amount was added at least `at_least` before `now`.
    fn has_history(&self, now: Instant, at_least: Duration) -> bool {
        self.first
            .is_some_and(|first| now.saturating_duration_since(first) >= at_least)
    }

    fn per_s(&self, now: Instant) -> Option<f64> {
        let first = self.first?;
        let last = self.last?;
        let history_s = now.saturating_duration_since(first).as_secs_f64();
        if history_s < RECENT_RATE_WARMUP_S {
            return None;
        }
        let since_last = now.saturating_duration_since(last).as_secs_f64();
        let decayed = self.decayed * (-since_last / RECENT_RATE_TIME_CONSTANT_S).exp();
        let window_s =
            RECENT_RATE_TIME_CONSTANT_S * (1.0 - (-history_s / RECENT_RATE_TIME_CONSTANT_S).exp());
        let rate = decayed / window_s;
        (rate.is_finite() && rate > 0.0).then_some(rate)
    }
}

/// Whether the fleet is prefill-bound: its workers spend most of their
/// time computing prompts, so one whose queue empties idles. The uncached
/// prompt tokens sent lately, at the fastest prompt speed the policy's
/// predictions have shown (the speed it learns from first tokens falls
/// while an engine's steps are long with decoding, when prompts are not
/// what holds it back), over the workers' time.
#[derive(Debug, Clone, Default)]
struct PrefillLoad {
    /// Seconds of prompt work sent, at `fastest_tps`.
    sent: RecentRate,
    /// Prompt tokens per second: the fastest seen, the policy's prior
    /// included. A fleet slower than that (one that became slower, or
    /// whose prior is fast) is so judged prefill-bound later than it is,
    /// or never, and keeps the shallower queues meanwhile.
    fastest_tps: f64,
    workers: usize,
}

impl PrefillLoad {
    fn sent(&mut self, expected: ExpectedWait, dispatch: &Dispatch, workers: usize, now: Instant) {
        let prompt_tokens = dispatch.tokens.saturating_add(dispatch.cached_tokens) as f64;
        let tps = prompt_tokens / expected.prefill_secs;
        if tps.is_finite() && tps > self.fastest_tps {
            self.fastest_tps = tps;
        }
        if self.fastest_tps > 0.0 {
            self.sent
                .add(dispatch.tokens as f64 / self.fastest_tps, now);
        }
        self.workers = workers;
    }

    /// How many workers the prompts sent lately keep computing.
    fn busy_workers(&self, now: Instant) -> Option<f64> {
        self.sent.per_s(now)
    }

    /// Whether the fleet is prefill-bound, given the workers the other
    /// router replicas' prompts keep computing.
    fn is_bound(&self, peers_busy_workers: f64, now: Instant) -> bool {
        self.workers > 0
            && self.sent.has_history(now, PREFILL_BOUND_HISTORY)
            && self.busy_workers(now).is_some_and(|busy_workers| {
                busy_workers + peers_busy_workers >= PREFILL_BOUND_SHARE * self.workers as f64
            })
    }
}

/// The router's waiting room: an [`Admission`] order with a length bound,
/// TTFT deadlines, and the predictions that turn a request away at once
/// rather than after a wait it cannot afford.
///
/// Synchronous and free of I/O; the caller passes `now` and the policy's
/// [`ExpectedWait`], so the router and the simulator run the same room.
pub struct AdmissionRoom {
    order: Box<dyn Admission>,
    config: RoomConfig,
    /// By ticket, so in order of arrival.
    entries: BTreeMap<u64, Entry>,
    drain: RecentRate,
    next_ticket: u64,
    /// The last arrival, to tell whether the next one differs from it.
    last_arrival: Option<Waiting>,
    /// Until when `reorder_above_wait` applies.
    reorder_until: Option<Instant>,
    /// The most urgent priority value among recent arrivals, and when it
    /// last arrived.
    most_urgent_arrival: Option<(i32, Instant)>,
    /// Whether it applied at the last call that had the time.
    reordering: bool,
    /// Requests evicted for a newcomer, reported by the next `shed`.
    evicted: Vec<Shed>,
    prefill: PrefillLoad,
    /// Whether the fleet was prefill-bound at the last call that had the
    /// time.
    prefill_bound: bool,
    /// When the last request with a TTFT deadline arrived.
    last_deadline_arrival: Option<Instant>,
    /// Whether the room counted the workers' progress on their prompts
    /// under way at the last call that had the time (see
    /// [`AdmissionRoom::counts_progress`]).
    counts_progress: bool,
    peers: Peers,
}

/// What a router replica's room tells the other replicas, and, summed,
/// what a room is told of them ([`AdmissionRoom::report`],
/// [`AdmissionRoom::set_peers`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RoomReport {
    /// When the request waiting longest arrived; `None` while none waits.
    pub oldest_arrived: Option<Instant>,
    /// How many workers the prompts sent lately keep computing (seconds
    /// of prompt work sent per second).
    pub prefill_busy_workers: f64,
    /// The busy worker the head of its order waits for at its turn (where
    /// its prefix is cached, usually), with since when; combined, each
    /// such worker of every replica, with the longest wait for it.
    pub waiting_for: BTreeMap<WorkerId, Instant>,
    /// How many requests wait in it; combined, in all of them. The
    /// [`RoomConfig::max_queue_requests`] bound counts the whole fleet's.
    pub queued_requests: usize,
}

impl RoomReport {
    /// Several replicas' reports as one: the oldest arrival among them,
    /// the sum of the workers their prompts keep busy and of their queues.
    pub fn combine(reports: impl IntoIterator<Item = RoomReport>) -> RoomReport {
        let mut sum = RoomReport::default();
        for report in reports {
            sum.oldest_arrived = match (sum.oldest_arrived, report.oldest_arrived) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            sum.prefill_busy_workers += finite_or_zero(report.prefill_busy_workers);
            sum.queued_requests = sum.queued_requests.saturating_add(report.queued_requests);
            for (worker, since) in report.waiting_for {
                sum.waiting_for
                    .entry(worker)
                    .and_modify(|first| *first = (*first).min(since))
                    .or_insert(since);
            }
        }
        sum
    }
}

/// Whether a room that began deferring to a peer's request (`began`: what
/// it deferred to, and since when) still defers to `to` at `now`: for at
/// most `lag`. `None` when it has not begun deferring to `to`.
fn still_deferring(
    began: Option<(Instant, Instant)>,
    to: Instant,
    now: Instant,
    lag: Duration,
) -> Option<bool> {
    began
        .filter(|(deferred_to, _)| *deferred_to == to)
        .map(|(_, since)| now < since + lag)
}

fn finite_or_zero(value: f64) -> f64 {
    if value.is_finite() && value > 0.0 {
        value
    } else {
        0.0
    }
}

/// What a room knows of the other router replicas' rooms.
#[derive(Debug, Clone, Default)]
struct Peers {
    /// Whether the router has other replicas (it has told the room of them).
    any: bool,
    report: RoomReport,
    /// The peers' oldest arrival this room last yielded to, and since when.
    yielding_to: Option<(Instant, Instant)>,
    /// For each worker a peer's request waits for: that request's wait
    /// (since when) this room last left the worker to, and since when.
    left_workers: BTreeMap<WorkerId, (Instant, Instant)>,
}

/// The room as the admin API shows it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RoomView {
    pub order: &'static str,
    pub queued_requests: usize,
    pub max_queue_requests: usize,
    pub queue_above_wait_s: f64,
    pub reorder_above_wait_s: f64,
    /// The threshold in force now.
    pub threshold_s: f64,
    /// Whether the fleet is prefill-bound (its workers spend at least
    /// [`PREFILL_BOUND_SHARE`] of their time on the prompts sent lately),
    /// which raises the threshold while reordering.
    pub prefill_bound: bool,
    /// Whether the room counts the workers' progress on the prompts under
    /// way: reordering on a prefill-bound fleet, no request with a TTFT
    /// deadline lately.
    pub counts_progress: bool,
    /// Prompt tokens per second leaving the room lately; `None` before
    /// there is history enough.
    pub drain_tokens_per_s: Option<f64>,
    pub oldest_wait_s: f64,
    /// The longest wait in the other router replicas' rooms, as they last
    /// reported; `None` behind one router or while none waits.
    pub peers_oldest_wait_s: Option<f64>,
    /// The requests waiting in the other replicas' rooms, as they last
    /// reported; `None` behind one router. `max_queue_requests` bounds
    /// this and `queued_requests` together.
    pub peers_queued_requests: Option<usize>,
    pub flows: Vec<FlowView>,
}

/// Whether a request of `priority` is of the most urgent class that
/// arrived within [`REORDER_WINDOW`] of `now`, given the most urgent
/// arrival and when it came.
fn is_most_urgent(
    most_urgent_arrival: Option<(i32, Instant)>,
    priority: i32,
    now: Instant,
) -> bool {
    most_urgent_arrival
        .is_none_or(|(urgent, seen)| priority <= urgent || now >= seen + REORDER_WINDOW)
}

fn secs(duration: Duration) -> f64 {
    duration.as_secs_f64()
}

fn duration_from_secs(secs: f64) -> Duration {
    Duration::try_from_secs_f64(secs.max(0.0)).unwrap_or(Duration::MAX)
}

/// Whole seconds, at least one, for `Retry-After`.
fn retry_after_s(wait: Duration) -> u64 {
    wait.as_secs_f64().ceil().clamp(1.0, 3600.0) as u64
}

impl AdmissionRoom {
    pub fn new(order: Box<dyn Admission>, config: RoomConfig) -> AdmissionRoom {
        AdmissionRoom {
            order,
            config,
            entries: BTreeMap::new(),
            drain: RecentRate::default(),
            next_ticket: 1,
            last_arrival: None,
            reorder_until: None,
            most_urgent_arrival: None,
            reordering: false,
            evicted: Vec::new(),
            prefill: PrefillLoad::default(),
            prefill_bound: false,
            last_deadline_arrival: None,
            counts_progress: false,
            peers: Peers::default(),
        }
    }

    pub fn config(&self) -> &RoomConfig {
        &self.config
    }

    /// Takes a new config (a live change). Waiting requests keep their
    /// class and deadline; the bound applies to arrivals from now on.
    pub fn set_config(&mut self, config: RoomConfig) {
        self.config = config;
    }

    pub fn order_name(&self) -> &'static str {
        self.order.name()
    }

    pub fn len(&self) -> usize {
        self.order.len()
    }

    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// Whether the request has a TTFT deadline (its own or its class's):
    /// only then does [`Expected::chosen`] change the room's decision, so
    /// a caller may skip asking the policy for it.
    pub fn has_deadline(&self, arrival: &Arrival) -> bool {
        self.classify(arrival).ttft_deadline.is_some()
    }

    /// The request's class, tenant weight and deadline.
    pub fn classify(&self, arrival: &Arrival) -> Classified {
        let priority = arrival.priority.unwrap_or(0);
        let tenant_weight = self
            .config
            .tenant_weights
            .get(arrival.tenant.as_ref())
            .copied()
            .unwrap_or(1.0);
        let configured = self
            .config
            .classes
            .iter()
            .find(|class| priority <= class.priority)
            .or(self.config.classes.last());
        match configured {
            Some(class) => Classified {
                class: Arc::from(class.name.as_str()),
                priority: class.priority,
                class_weight: class.weight,
                tenant: arrival.tenant.clone(),
                tenant_weight,
                ttft_deadline: arrival.ttft_deadline.or(class.ttft_deadline),
            },
            None => Classified {
                class: Arc::from(priority.to_string()),
                priority,
                class_weight: default_class_weight(priority),
                tenant: arrival.tenant.clone(),
                tenant_weight,
                ttft_deadline: arrival.ttft_deadline,
            },
        }
    }

    /// Whether the fleet takes more work now: the policy predicts a wait
    /// at most the threshold in force, `reorder_above_wait` while there is
    /// something to reorder, else `queue_above_wait` (a policy with no model
    /// of wait always does; its caps decide).
    pub fn has_room(&self, expected: Option<ExpectedWait>) -> bool {
        expected.is_none_or(|wait| self.judged_queue_secs(&wait) <= secs(self.threshold()))
    }

    /// The wait the room judges room by: the policy's, less the workers'
    /// progress on their prompts under way while the room
    /// [counts it](Self::counts_progress).
    fn judged_queue_secs(&self, wait: &ExpectedWait) -> f64 {
        match wait.queue_less_progress_secs {
            Some(less_progress_secs) if self.counts_progress => less_progress_secs,
            _ => wait.queue_secs,
        }
    }

    /// Whether the room counts the workers' progress on the prompts under
    /// way (as of the last call that had the time): while reordering on a
    /// prefill-bound fleet, with no request with a TTFT deadline in the
    /// last [`REORDER_WINDOW`]. A policy counts a prompt whole until its
    /// first token, so a worker finishing a long one looks busy until it
    /// has nothing left, and a prefill-bound engine with nothing queued
    /// behind its prompt runs its next steps with no prompt to compute.
    /// A request with a deadline keeps the margins sized for the policy's
    /// own prediction: the progress is a bet that the prompt finishes on
    /// schedule.
    pub fn counts_progress(&self) -> bool {
        self.counts_progress
    }

    /// When this room's oldest waiting request arrived.
    pub fn oldest_arrived(&self) -> Option<Instant> {
        self.entries
            .values()
            .next()
            .map(|entry| entry.request.arrived)
    }

    /// What this room tells the other router replicas.
    pub fn report(&self, now: Instant) -> RoomReport {
        let waiting_for = self
            .order
            .peek()
            .and_then(|head| self.entries.get(&head.ticket))
            .and_then(|entry| entry.waits_for)
            .into_iter()
            .collect();
        RoomReport {
            oldest_arrived: self.oldest_arrived(),
            prefill_busy_workers: self.prefill.busy_workers(now).unwrap_or(0.0),
            waiting_for,
            queued_requests: self.order.len(),
        }
    }

    /// Tells the room of the other router replicas' rooms, as their latest
    /// reports say ([`RoomReport::combine`]); `None` while no other
    /// replica is heard (a single router, or sync off).
    pub fn set_peers(&mut self, peers: Option<RoomReport>) {
        self.peers.any = peers.is_some();
        let peers = peers.unwrap_or_default();
        self.peers
            .left_workers
            .retain(|worker, _| peers.waiting_for.contains_key(worker));
        self.peers.report = peers;
    }

    /// Whether this replica leaves the room it sees in the fleet to
    /// another replica now (asked when the fleet has room): one whose
    /// oldest waiting request arrived more than [`RoomConfig::peer_lag`]
    /// before this room's oldest (or before `now`, when none waits here). Each replica hears first of the room
    /// its own requests free, so without turns the replica with the most
    /// requests in flight keeps taking it and one with few waits for
    /// minutes. The replica that has waited longest takes the next turn
    /// and sends its own order's head. A room yields for at most the lag
    /// at a time: a peer that has not taken the room by then cannot use it
    /// now (its request waits for a busy worker, or its report is stale),
    /// and this room sends one request, then yields again. A request at
    /// its last moment goes anyway.
    pub fn yields_to_peers(&mut self, now: Instant) -> bool {
        let Some(peer_oldest) = self.peers.report.oldest_arrived else {
            self.peers.yielding_to = None;
            return false;
        };
        let own_oldest = self.oldest_arrived().unwrap_or(now);
        let lag = self.config.peer_lag;
        if own_oldest <= peer_oldest + lag {
            self.peers.yielding_to = None;
            return false;
        }
        still_deferring(self.peers.yielding_to, peer_oldest, now, lag).unwrap_or_else(|| {
            self.peers.yielding_to = Some((peer_oldest, now));
            true
        })
    }

    /// The lower of the two thresholds: a worker whose wait is at most
    /// this has room whichever is in force, so a search for one may stop
    /// there ([`Policy::expected_wait_within`](policy_core::Policy::expected_wait_within)).
    pub fn lowest_threshold(&self) -> Duration {
        self.config
            .queue_above_wait
            .min(self.config.reorder_above_wait)
    }

    /// The threshold in force (as of the last call that had the time).
    /// While reordering on a prefill-bound fleet it is
    /// [`PREFILL_BOUND_THRESHOLD_FACTOR`] times `reorder_above_wait`, up to
    /// `queue_above_wait`: an engine that computes prompts all the time
    /// idles whenever its queue empties (the room hears of a first token
    /// after the engine has planned its next step), while one whose steps
    /// are long with decoding does not, and its queue only delays the
    /// requests the room would serve first.
    pub fn threshold(&self) -> Duration {
        let margin = self.margin();
        if self.reordering && self.prefill_bound {
            duration_from_secs(secs(margin) * PREFILL_BOUND_THRESHOLD_FACTOR)
                .min(self.config.queue_above_wait)
                .max(margin)
        } else {
            margin
        }
    }

    /// The threshold in force without the raise on a prefill-bound fleet:
    /// the margin a request with a deadline keeps for the prediction's
    /// error, which the depth of the engines' queues does not change.
    fn margin(&self) -> Duration {
        if self.reordering {
            self.config.reorder_above_wait
        } else {
            self.config.queue_above_wait
        }
    }

    /// A request went to a worker as `dispatch` says, among `workers`
    /// candidates, with `expected` the policy's expected wait for it (its
    /// prefill at the rate the policy predicts): what tells a
    /// prefill-bound fleet. Nothing is learned without a model of wait.
    pub fn sent(
        &mut self,
        expected: Option<ExpectedWait>,
        dispatch: &Dispatch,
        workers: usize,
        now: Instant,
    ) {
        if let Some(expected) = expected {
            self.prefill.sent(expected, dispatch, workers, now);
        }
        self.tick(now);
    }

    /// Notes an arrival: one that differs from the one before it in its
    /// order's flow, or has a deadline, starts a window of reordering.
    fn note_arrival(&mut self, arrival: &Waiting, has_deadline: bool, now: Instant) {
        let differs = self
            .last_arrival
            .as_ref()
            .is_some_and(|last| !self.order.same_flow(last, arrival));
        if differs || has_deadline {
            self.reorder_until = Some(now + REORDER_WINDOW);
        }
        if has_deadline {
            self.last_deadline_arrival = Some(now);
        }
        self.last_arrival = Some(arrival.clone());
        // A more urgent class that arrived within the window stays.
        if is_most_urgent(self.most_urgent_arrival, arrival.priority, now) {
            self.most_urgent_arrival = Some((arrival.priority, now));
        }
        self.tick(now);
    }

    /// Brings the threshold in force up to `now`.
    fn tick(&mut self, now: Instant) {
        self.reordering = self.reorder_until.is_some_and(|until| now < until);
        self.prefill_bound = self
            .prefill
            .is_bound(self.peers.report.prefill_busy_workers, now);
        self.counts_progress = self.reordering
            && self.prefill_bound
            && self
                .last_deadline_arrival
                .is_none_or(|seen| now >= seen + REORDER_WINDOW);
    }

    /// Decides on an arriving request, given the policy's expected waits
    /// for it (see [`Expected`]).
    pub fn arrive(
        &mut self,
        arrival: &Arrival,
        expected: impl Into<Expected>,
        now: Instant,
    ) -> Decision {
        self.admit(arrival, expected.into(), now, true)
    }

    /// Queues a request whatever the fleet's wait (the policy found every
    /// worker capped), within the bound and its deadline.
    pub fn enqueue(
        &mut self,
        arrival: &Arrival,
        expected: impl Into<Expected>,
        now: Instant,
    ) -> Decision {
        self.admit(arrival, expected.into(), now, false)
    }

    /// What [`arrive`](Self::arrive) would decide for `arrival` now, and
    /// why; nothing changes.
    pub fn explain(
        &self,
        arrival: &Arrival,
        expected: impl Into<Expected>,
        now: Instant,
    ) -> Explanation {
        let expected = expected.into();
        let classified = self.classify(arrival);
        let judged = self.judge(&classified, arrival.work_tokens, expected, now, true);
        Explanation {
            decision: match judged.verdict {
                Verdict::DispatchNow => "dispatch_now",
                Verdict::Queue => "queue",
                Verdict::Reject(rejection) => rejection.reason.as_str(),
            },
            class: classified.class.to_string(),
            priority: classified.priority,
            class_weight: classified.class_weight,
            tenant: classified.tenant.to_string(),
            tenant_weight: classified.tenant_weight,
            ttft_deadline_s: classified.ttft_deadline.map(secs),
            expected_queue_s: expected.fleet.map(|wait| wait.queue_secs),
            expected_prefill_s: expected.fleet.map(|wait| wait.prefill_secs),
            chosen_queue_s: expected.chosen.map(|wait| wait.queue_secs),
            work_ahead_tokens: judged.ahead,
            drain_tokens_per_s: self.drain.per_s(now),
            predicted_ttft_s: judged.predicted.map(secs),
        }
    }

    fn admit(
        &mut self,
        arrival: &Arrival,
        expected: Expected,
        now: Instant,
        may_dispatch_now: bool,
    ) -> Decision {
        let classified = self.classify(arrival);
        let incoming = waiting(self.next_ticket, &classified, arrival.work_tokens, now);
        self.note_arrival(&incoming, classified.ttft_deadline.is_some(), now);
        // Asked only when it would go now: a room yields to a peer for a
        // bounded time, counted from when the fleet has room.
        let may_dispatch_now = may_dispatch_now
            && (!self.order.is_empty()
                || !self.has_room(expected.fleet)
                || !self.yields_to_peers(now));
        let judged = self.judge(
            &classified,
            arrival.work_tokens,
            expected,
            now,
            may_dispatch_now,
        );
        if let Some(ticket) = judged.evicts {
            self.evict(ticket, now);
        }
        match judged.verdict {
            Verdict::DispatchNow => Decision::DispatchNow,
            Verdict::Reject(rejection) => Decision::Rejected(rejection),
            Verdict::Queue => {
                let ticket = self.next_ticket;
                self.next_ticket += 1;
                let request = waiting(ticket, &classified, arrival.work_tokens, now);
                self.order.push(request.clone());
                self.entries.insert(
                    ticket,
                    Entry {
                        request,
                        due: classified.ttft_deadline.map(|deadline| now + deadline),
                        prefill: duration_from_secs(
                            expected.own().map_or(0.0, |wait| wait.prefill_secs),
                        ),
                        last_moment: false,
                        waits_for: None,
                    },
                );
                Decision::Queued(ticket)
            }
        }
    }

    /// The room's verdict on a request: dispatched now (when allowed, the
    /// queue is empty and the fleet has room), turned away (the bound, or a
    /// deadline the prediction cannot meet), or queued.
    fn judge(
        &self,
        classified: &Classified,
        work_tokens: u64,
        expected: Expected,
        now: Instant,
        may_dispatch_now: bool,
    ) -> Judged {
        if may_dispatch_now && self.order.is_empty() && self.has_room(expected.fleet) {
            let predicted = self.predicted_ttft(0, expected.own(), now);
            return Judged {
                verdict: self
                    .too_late(classified, predicted)
                    .map_or(Verdict::DispatchNow, Verdict::Reject),
                ahead: 0,
                predicted: Some(predicted),
                evicts: None,
            };
        }
        let incoming = waiting(self.next_ticket, classified, work_tokens, now);
        let mut evicts = None;
        if self.fleet_queued_requests() >= self.config.max_queue_requests {
            // The order may rather drop a request it would serve after
            // this one (the tail of a heavier flow) than turn this away.
            evicts = self.order.eviction_for(&incoming);
            if evicts.is_none() {
                let drain_wait = self.drain_secs(self.queued_work(), now);
                return Judged {
                    verdict: Verdict::Reject(Rejection {
                        reason: RejectReason::QueueFull,
                        retry_after_s: retry_after_s(duration_from_secs(drain_wait.unwrap_or(1.0))),
                        predicted_wait: drain_wait.map(duration_from_secs),
                    }),
                    ahead: 0,
                    predicted: None,
                    evicts: None,
                };
            }
        }
        let ahead = self.order.work_ahead(&incoming);
        let predicted = self.predicted_ttft(ahead, expected.own(), now);
        let rejection = self.too_late(classified, predicted);
        Judged {
            // A newcomer turned away evicts nobody.
            evicts: evicts.filter(|_| rejection.is_none()),
            verdict: rejection.map_or(Verdict::Queue, Verdict::Reject),
            ahead,
            predicted: Some(predicted),
        }
    }

    /// The requests waiting in this room and, as they last reported, in
    /// the other router replicas' rooms: what the bound counts, so that a
    /// fleet of replicas holds as many as one router, and waits as long.
    fn fleet_queued_requests(&self) -> usize {
        self.order
            .len()
            .saturating_add(self.peers.report.queued_requests)
    }

    fn queued_work(&self) -> u64 {
        self.order
            .flows()
            .iter()
            .map(|flow| flow.queued_work_tokens)
            .sum()
    }

    /// Seconds to dispatch `tokens` at the recent drain rate.
    fn drain_secs(&self, tokens: u64, now: Instant) -> Option<f64> {
        if tokens == 0 {
            return Some(0.0);
        }
        self.drain.per_s(now).map(|rate| tokens as f64 / rate)
    }

    /// A request's predicted TTFT with `ahead` work queued before it: the
    /// policy's expected wait and prefill, and the queue ahead at the
    /// recent drain rate (none before there is history enough).
    fn predicted_ttft(&self, ahead: u64, expected: Option<ExpectedWait>, now: Instant) -> Duration {
        let policy_secs = expected.map_or(0.0, |wait| wait.queue_secs + wait.prefill_secs);
        duration_from_secs(policy_secs + self.drain_secs(ahead, now).unwrap_or(0.0))
    }

    /// The rejection due to a request predicted to take `predicted` to its
    /// first token, if that is past its share of its deadline
    /// ([`ARRIVAL_DEADLINE_SHARE`]).
    fn too_late(&self, classified: &Classified, predicted: Duration) -> Option<Rejection> {
        let deadline = classified.ttft_deadline?;
        let admissible = deadline.mul_f64(ARRIVAL_DEADLINE_SHARE);
        (predicted > admissible).then(|| Rejection {
            reason: RejectReason::DeadlineUnmeetable,
            retry_after_s: retry_after_s(predicted.saturating_sub(admissible)),
            predicted_wait: Some(predicted),
        })
    }

    /// Drops a queued request to make room for a newcomer; the next
    /// [`shed`](Self::shed) reports it (`QueueFull`).
    fn evict(&mut self, ticket: u64, now: Instant) {
        let Some(entry) = self.entries.remove(&ticket) else {
            return;
        };
        self.order.remove(ticket);
        let drain_wait = self.drain_secs(self.queued_work(), now);
        self.evicted.push(Shed {
            ticket,
            class: entry.request.class,
            waited: now.saturating_duration_since(entry.request.arrived),
            rejection: Rejection {
                reason: RejectReason::QueueFull,
                retry_after_s: retry_after_s(duration_from_secs(drain_wait.unwrap_or(1.0))),
                predicted_wait: drain_wait.map(duration_from_secs),
            },
        });
    }

    /// The request to release next, if the fleet has room for it (see
    /// [`has_room`](Self::has_room)). The caller asks the policy for a worker;
    /// if it finds one, it calls [`pop`](Self::pop).
    pub fn head(&self) -> Option<&Waiting> {
        self.order.peek()
    }

    /// The next [`RELEASE_LOOKAHEAD`] requests to release, in the order's
    /// turn. For each, the caller asks the policy which worker it would
    /// choose and the wait expected there, and [`route`](Self::route)
    /// says where the request goes.
    pub fn release_order(&self) -> Vec<ReleaseTurn> {
        // A request at its last moment goes ahead of none of a lower
        // priority value: the classes' order stands.
        let first_priority = self
            .entries
            .values()
            .any(|entry| entry.last_moment)
            .then(|| {
                self.entries
                    .values()
                    .map(|entry| entry.request.priority)
                    .min()
            })
            .flatten();
        self.order
            .in_order(RELEASE_LOOKAHEAD)
            .into_iter()
            .map(|ticket| {
                let entry = self.entries.get(&ticket);
                ReleaseTurn {
                    ticket,
                    due: entry.and_then(|entry| entry.due),
                    passes: entry.is_some_and(|entry| self.order.passes(&entry.request)),
                    last_moment: entry.is_some_and(|entry| {
                        entry.last_moment && Some(entry.request.priority) <= first_priority
                    }),
                }
            })
            .collect()
    }

    /// Where a request whose turn it is goes, given the wait expected at
    /// the worker its policy chooses. One that [passes](ReleaseTurn::passes)
    /// goes there unless the wait there is more than
    /// [`PASS_WITHIN_THRESHOLDS`] thresholds. A busy worker (where its
    /// prefix is cached, usually) is waited for, in the room's order, while those
    /// behind it go to others: sent there now it would wait in the
    /// engine's queue, behind whatever was sent earlier. A request with a
    /// deadline waits while that worker would still meet it, or while a
    /// worker with room would still meet it later (with the threshold
    /// again as margin for the prediction's error); at that last moment it
    /// goes to the best worker with room. Sent elsewhere sooner, its
    /// prefix is computed again and pushes others' out of that cache.
    /// While the room [counts progress](Self::counts_progress), one
    /// without a deadline goes to the best worker with room at once, unless
    /// the busy worker's prefix cache holds part of its prompt
    /// ([`ExpectedWait::cached_prefill_secs`]).
    pub fn route(
        &mut self,
        turn: &ReleaseTurn,
        at_worker: Option<(WorkerId, ExpectedWait)>,
        now: Instant,
    ) -> Route {
        if turn.passes
            && at_worker.is_none_or(|(_, wait)| {
                wait.queue_secs <= PASS_WITHIN_THRESHOLDS * secs(self.threshold())
            })
        {
            return Route::Chosen;
        }
        let Some((worker, wait)) = at_worker else {
            return Route::Chosen;
        };
        let route = if self.has_room(Some(wait)) {
            // Only a head's wait is shared: the rest of the order leaves a
            // worker a peer's head waits for.
            let is_head = self
                .order
                .peek()
                .is_some_and(|head| head.ticket == turn.ticket);
            let own_since = is_head.then(|| self.waits_since(turn.ticket, worker, now));
            if self.leaves_to_peer(worker, own_since, now) {
                Route::Wait
            } else {
                Route::Chosen
            }
        } else {
            self.route_busy(turn, wait, now)
        };
        if route == Route::Wait {
            self.wait_for(turn.ticket, worker, now);
        }
        route
    }

    /// [`route`](Self::route) for a request whose chosen worker is busy.
    fn route_busy(&mut self, turn: &ReleaseTurn, wait: ExpectedWait, now: Instant) -> Route {
        let Some(due) = turn.due else {
            // The fleet's room is then the workers finishing their prompts,
            // which the policy's choice does not count: the request goes
            // to one of them, or that engine runs out of prompts to compute.
            // Not one whose prefix is cached where it waits: elsewhere it
            // would compute it again and push others' out of that cache,
            // and a fleet serving from its caches serves a fraction as
            // much without them.
            return if self.counts_progress && wait.cached_prefill_secs <= 0.0 {
                Route::WithRoom
            } else if self.waited_for_worker_long(turn.ticket, now) {
                Route::Chosen
            } else {
                Route::Wait
            };
        };
        let there = now + duration_from_secs(wait.queue_secs + wait.prefill_secs);
        if turn.last_moment {
            return if there <= due {
                Route::Chosen
            } else {
                Route::WithRoom
            };
        }
        let margin = secs(self.margin());
        let elsewhere_later = now + duration_from_secs(2.0 * margin + wait.prefill_secs);
        if there <= due || elsewhere_later < due {
            Route::Wait
        } else {
            Route::WithRoom
        }
    }

    /// Whether the request has waited at its turn for its busy worker for
    /// [`WORKER_WAIT_BEHIND_REPLICAS`] behind several router replicas: it
    /// then goes to that worker's queue.
    fn waited_for_worker_long(&self, ticket: u64, now: Instant) -> bool {
        if !self.peers.any {
            return false;
        }
        self.entries
            .get(&ticket)
            .and_then(|entry| entry.waits_for)
            .is_some_and(|(_, since)| now >= since + WORKER_WAIT_BEHIND_REPLICAS)
    }

    /// Since when request `ticket` has waited for `worker` at its turn:
    /// `now` if it has not.
    fn waits_since(&self, ticket: u64, worker: WorkerId, now: Instant) -> Instant {
        match self.entries.get(&ticket).and_then(|entry| entry.waits_for) {
            Some((waited_for, since)) if waited_for == worker => since,
            _ => now,
        }
    }

    /// Notes that request `ticket` waits for `worker` at its turn.
    fn wait_for(&mut self, ticket: u64, worker: WorkerId, now: Instant) {
        if let Some(entry) = self.entries.get_mut(&ticket) {
            match entry.waits_for {
                Some((waited_for, _)) if waited_for == worker => {}
                _ => entry.waits_for = Some((worker, now)),
            }
        }
    }

    /// Whether a request leaves the room at `worker` to another replica's
    /// head that waits for it: a request that is not its own room's head
    /// (`own_since` `None`) does, and a head that has waited for it since
    /// `own_since` does when the peer's has waited more than
    /// [`RoomConfig::peer_lag`] longer. One router keeps a worker's room
    /// for the first request in its order that waits for it; replicas do
    /// not share their orders, and the one whose own requests free the
    /// worker hears of it first. It leaves the worker to the same peer
    /// request for at most the lag: a peer that has not taken it by then
    /// cannot (its report is stale).
    fn leaves_to_peer(
        &mut self,
        worker: WorkerId,
        own_since: Option<Instant>,
        now: Instant,
    ) -> bool {
        let Some(&peer_since) = self.peers.report.waiting_for.get(&worker) else {
            return false;
        };
        let lag = self.config.peer_lag;
        if own_since.is_some_and(|own_since| own_since <= peer_since + lag) {
            self.peers.left_workers.remove(&worker);
            return false;
        }
        let began = self.peers.left_workers.get(&worker).copied();
        still_deferring(began, peer_since, now, lag).unwrap_or_else(|| {
            self.peers.left_workers.insert(worker, (peer_since, now));
            true
        })
    }

    /// Whether another replica's request has waited for `worker` more than
    /// [`RoomConfig::peer_lag`] (and this room has not left it to that
    /// request for longer than the lag): a request that may go to
    /// any worker with room leaves that one.
    pub fn peer_waits_for(&self, worker: WorkerId, now: Instant) -> bool {
        let Some(&peer_since) = self.peers.report.waiting_for.get(&worker) else {
            return false;
        };
        let lag = self.config.peer_lag;
        if now <= peer_since + lag {
            return false;
        }
        let began = self.peers.left_workers.get(&worker).copied();
        still_deferring(began, peer_since, now, lag).unwrap_or(true)
    }

    /// Releases the head: the policy found it a worker.
    pub fn pop(&mut self, now: Instant) -> Option<Released> {
        let ticket = self.order.peek()?.ticket;
        self.take(ticket, now)
    }

    /// Releases `ticket` (one of [`release_order`](Self::release_order)):
    /// the policy found it a worker.
    pub fn take(&mut self, ticket: u64, now: Instant) -> Option<Released> {
        self.tick(now);
        let waiting = self.order.take(ticket)?;
        // Having taken a turn, it yields afresh at the next.
        self.peers.yielding_to = None;
        self.drain.add(waiting.work_tokens as f64, now);
        let entry = self.entries.remove(&waiting.ticket);
        Some(Released {
            ticket: waiting.ticket,
            class: waiting.class,
            waited: now.saturating_duration_since(entry.map_or(now, |entry| entry.request.arrived)),
        })
    }

    /// A request that never waited went to a worker: its work counts
    /// toward the drain rate, and toward its flow's share as if it had
    /// waited (a tenant whose requests pass straight through is served
    /// too).
    pub fn dispatched(&mut self, arrival: &Arrival, now: Instant) {
        self.peers.yielding_to = None;
        self.drain.add(arrival.work_tokens as f64, now);
        let classified = self.classify(arrival);
        self.order
            .served(&classified.class, &classified.tenant, arrival.work_tokens);
    }

    /// A request of this class and tenant finished with `output_tokens`
    /// generated: orders that share by token work count them.
    pub fn finished(&mut self, class: &str, tenant: &str, output_tokens: u64) {
        self.order.served(class, tenant, output_tokens);
    }

    /// Removes a queued request whose client left. `false` if it was not
    /// queued (already released or turned away).
    pub fn remove(&mut self, ticket: u64) -> bool {
        self.entries.remove(&ticket);
        self.order.remove(ticket).is_some()
    }

    /// Turns away the queued requests that can no longer meet their
    /// deadline: passed, or so close that even dispatched now, at the
    /// least busy worker's queue (`queue_secs`) plus their own prefill,
    /// they would miss it. Requests admitted are not re-judged on the
    /// queue ahead of them, so a rejection comes at arrival where it can.
    /// Those that would still meet it now, but not after twice the
    /// threshold more (and the largest waiting prefill more, when no more
    /// urgent class arrived within [`REORDER_WINDOW`]), are marked to go at once
    /// ([`ReleaseTurn::last_moment`]).
    pub fn shed(&mut self, expected: Option<ExpectedWait>, now: Instant) -> Vec<Shed> {
        self.tick(now);
        let queue = duration_from_secs(expected.map_or(0.0, |wait| wait.queue_secs));
        let threshold = self.margin();
        let most_urgent_arrival = self.most_urgent_arrival;
        let largest_prefill = self
            .entries
            .values()
            .map(|entry| entry.prefill)
            .max()
            .unwrap_or_default();
        for entry in self.entries.values_mut() {
            if let Some(due) = entry.due {
                // The least busy worker's wait jumps by a whole prefill
                // when a request is sent there between two checks. One of
                // the most urgent class keeps the largest waiting one as a
                // further margin; one of another would take engine time
                // from that class.
                let jump = if is_most_urgent(most_urgent_arrival, entry.request.priority, now) {
                    largest_prefill
                } else {
                    Duration::ZERO
                };
                let margin = 2 * threshold + jump;
                let dispatched_now = now + queue + entry.prefill;
                entry.last_moment |= dispatched_now <= due && dispatched_now + margin > due;
            }
        }
        let late: Vec<(u64, Option<Duration>)> = self
            .entries
            .iter()
            .filter_map(|(ticket, entry)| {
                let due = entry.due?;
                if now >= due {
                    return Some((*ticket, None));
                }
                let predicted = queue + entry.prefill;
                (now + predicted > due).then_some((*ticket, Some(predicted)))
            })
            .collect();
        let mut shed = std::mem::take(&mut self.evicted);
        for (ticket, predicted) in late {
            let Some(entry) = self.entries.remove(&ticket) else {
                continue;
            };
            self.order.remove(ticket);
            let waited = now.saturating_duration_since(entry.request.arrived);
            let rejection = match predicted {
                None => Rejection {
                    reason: RejectReason::DeadlinePassed,
                    retry_after_s: 1,
                    predicted_wait: None,
                },
                Some(predicted) => Rejection {
                    reason: RejectReason::DeadlineUnmeetable,
                    retry_after_s: retry_after_s(predicted),
                    predicted_wait: Some(predicted),
                },
            };
            shed.push(Shed {
                ticket,
                class: entry.request.class,
                waited,
                rejection,
            });
        }
        shed.sort_by_key(|shed| shed.ticket);
        shed
    }

    /// The earliest deadline among the queued requests.
    pub fn next_due(&self) -> Option<Instant> {
        self.entries.values().filter_map(|entry| entry.due).min()
    }

    /// Moves every queued request to `order`, oldest first (a live swap).
    pub fn swap_order(&mut self, mut order: Box<dyn Admission>) {
        for waiting in self.order.drain() {
            order.push(waiting);
        }
        self.order = order;
    }

    /// Queued requests per class.
    pub fn queued_by_class(&self) -> BTreeMap<Arc<str>, usize> {
        let mut by_class = BTreeMap::new();
        for entry in self.entries.values() {
            *by_class.entry(entry.request.class.clone()).or_insert(0) += 1;
        }
        by_class
    }

    pub fn view(&self, now: Instant) -> RoomView {
        RoomView {
            order: self.order.name(),
            queued_requests: self.order.len(),
            max_queue_requests: self.config.max_queue_requests,
            queue_above_wait_s: secs(self.config.queue_above_wait),
            reorder_above_wait_s: secs(self.config.reorder_above_wait),
            threshold_s: secs(self.threshold()),
            prefill_bound: self.prefill_bound,
            counts_progress: self.counts_progress,
            drain_tokens_per_s: self.drain.per_s(now),
            oldest_wait_s: self
                .oldest_arrived()
                .map_or(0.0, |arrived| secs(now.saturating_duration_since(arrived))),
            peers_oldest_wait_s: self
                .peers
                .report
                .oldest_arrived
                .map(|arrived| secs(now.saturating_duration_since(arrived))),
            peers_queued_requests: self.peers.any.then_some(self.peers.report.queued_requests),
            flows: self.order.flows(),
        }
    }
}

impl std::fmt::Debug for AdmissionRoom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdmissionRoom")
            .field("order", &self.order.name())
            .field("queued", &self.order.len())
            .field("config", &self.config)
            .finish()
    }
}
