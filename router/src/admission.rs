//! The admission gate: the router's side of the `admission` crate's room.
//!
//! A generation request passes [`admit`] before its first attempt. While
//! the fleet is below the room's threshold it is dispatched at once, as
//! without admission. Otherwise it waits: its task holds the receiving end
//! of a one-shot channel, and whoever sees work complete (a first token, a
//! finished response, a load poll, the gate's ticker) runs
//! [`Gate::release`], which asks the policy for a worker for the queue's
//! head (late binding) and hands that dispatch to the waiting task. A
//! client that leaves drops its wait, which takes it out of the queue at
//! once.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use admission::{
    AdmissionRoom, Arrival, Decision, Expected, Explanation, RejectReason, Rejection, RoomReport,
    RoomView, Route,
};
use arc_swap::ArcSwap;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::IntoResponse;
use opentelemetry::KeyValue;
use parking_lot::Mutex;
use policy_core::{AdmissionRegistry, ExpectedWait, RequestInfo, TokenCount, WorkerId, tokio_now};
use tokio::sync::{Notify, oneshot};

use crate::app::App;
use crate::config::{AdmissionConfig, SyncConfig};
use crate::error::ConfigError;
use crate::metrics::{ClassLabel, ClassOutcomeLabels, ClassReasonLabels, Metrics};
use crate::proxy::{Answer, Chosen, RequestTracker, choose, own};
use crate::telemetry::SpanGuard;

/// The header that sets a request's priority (over its body's `priority`).
pub(crate) const PRIORITY_HEADER: &str = "x-request-priority";
/// The header that sets a request's TTFT deadline, in milliseconds.
pub(crate) const DEADLINE_HEADER: &str = "x-ttft-deadline-ms";
/// How often waiting requests are checked against their deadlines.
const TICK: Duration = Duration::from_millis(10);
/// The work a request with no measurable prompt is counted as.
const UNKNOWN_PROMPT_TOKENS: u64 = 512;

/// What the gate reads from a request's head and body.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Admission {
    pub(crate) priority: Option<i32>,
    pub(crate) tenant: Arc<str>,
    pub(crate) ttft_deadline: Option<Duration>,
}

impl Admission {
    /// The request's priority (header over body), tenant (the tenant
    /// header, else a hash of its API key) and TTFT deadline. A header
    /// that is there but unreadable is the client's error.
    pub(crate) fn read(
        headers: &HeaderMap,
        body_priority: Option<i64>,
        tenant_header: &HeaderName,
    ) -> Result<Admission, String> {
        let priority = match headers.get(PRIORITY_HEADER) {
            Some(value) => Some(
                value
                    .to_str()
                    .ok()
                    .and_then(|text| text.trim().parse::<i32>().ok())
                    .ok_or_else(|| format!("{PRIORITY_HEADER} must be an integer"))?,
            ),
            None => body_priority.map(|p| p.clamp(i64::from(i32::MIN), i64::from(i32::MAX)) as i32),
        };
        let ttft_deadline = match headers.get(DEADLINE_HEADER) {
            Some(value) => Some(
                value
                    .to_str()
                    .ok()
                    .and_then(|text| text.trim().parse::<u64>().ok())
                    .filter(|ms| (1..=86_400_000).contains(ms))
                    .map(Duration::from_millis)
                    .ok_or_else(|| {
                        format!("{DEADLINE_HEADER} must be a whole number of milliseconds from 1 to 86400000")
                    })?,
            ),
            None => None,
        };
        let tenant = match headers.get(tenant_header) {
            Some(value) => Arc::from(
                value
                    .to_str()
                    .ok()
                    .filter(|name| name.len() <= 256)
                    .ok_or_else(|| {
                        format!("{tenant_header} must be visible ASCII, at most 256 bytes")
                    })?
                    .trim(),
            ),
            None => headers
                .get(header::AUTHORIZATION)
                .and_then(|value| value.to_str().ok())
                .and_then(|value| value.strip_prefix("Bearer "))
                .map_or_else(|| Arc::from(""), key_tenant),
        };
        Ok(Admission {
            priority,
            tenant,
            ttft_deadline,
        })
    }
}

/// An API key's tenant: a hash, so the key itself is never shown.
fn key_tenant(key: &str) -> Arc<str> {
    use std::hash::{Hash, Hasher};
    // SipHash with fixed keys: the same key names the same tenant on every
    // replica and after a restart.
    let mut hasher = std::hash::DefaultHasher::new();
    key.trim().hash(&mut hasher);
    Arc::from(format!("key-{:016x}", hasher.finish()))
}

/// What a waiting request gets when its wait ends.
pub(crate) enum Turn {
    Go(Chosen),
    Rejected(Rejection),
}

struct Waiter {
    info: RequestInfo,
    received_at: Instant,
    sender: oneshot::Sender<Turn>,
}

struct State {
    room: AdmissionRoom,
    waiters: HashMap<u64, Waiter>,
    config: AdmissionConfig,
}

/// The admission room behind a lock, the waiting tasks' channels, and what
/// wakes the ticker.
pub(crate) struct Gate {
    state: Mutex<State>,
    /// Requests waiting, read without the lock by every release trigger.
    waiting: AtomicUsize,
    enabled: AtomicBool,
    /// Whether a configured class sets a TTFT deadline, so a request that
    /// names none may still have one (its class's).
    class_deadlines: AtomicBool,
    /// The room's lowest threshold, in seconds (`f64` bits): where the
    /// search for a worker with room may stop, read without the lock.
    lowest_threshold_secs: AtomicU64,
    tenant_header: ArcSwap<HeaderName>,
    registry: AdmissionRegistry,
    /// One release runs at a time; a trigger during it makes it run again.
    releasing: AtomicBool,
    release_again: AtomicBool,
    /// Wakes the ticker when a request starts waiting.
    wake: Notify,
    /// The room's [`peer_lag`](admission::RoomConfig::peer_lag), from the
    /// sync section.
    peer_lag: Duration,
}

/// How much longer another replica's oldest request must have waited
/// before this replica leaves it the fleet's room: two of the replicas'
/// publish intervals (what they may not yet have heard of each other), at
/// least the room's default.
pub(crate) fn peer_lag(sync: &SyncConfig) -> Duration {
    (2 * sync.publish_interval()).max(admission::DEFAULT_PEER_LAG)
}

fn room_for(
    registry: &AdmissionRegistry,
    config: &AdmissionConfig,
    peer_lag: Duration,
) -> Result<AdmissionRoom, ConfigError> {
    let room = admission::RoomConfig {
        peer_lag,
        ..config.room()?
    };
    let order = registry.build(&config.order, &serde_json::Value::Null)?;
    Ok(AdmissionRoom::new(order, room))
}

fn lowest_threshold_bits(room: &AdmissionRoom) -> u64 {
    room.lowest_threshold().as_secs_f64().to_bits()
}

fn has_class_deadlines(room: &AdmissionRoom) -> bool {
    room.config()
        .classes
        .iter()
        .any(|class| class.ttft_deadline.is_some())
}

fn tenant_header(config: &AdmissionConfig) -> Result<HeaderName, ConfigError> {
    HeaderName::from_bytes(config.tenant_header.as_bytes()).map_err(|_| ConfigError::Invalid {
        key: "admission.tenant_header".into(),
        value: format!("{:?}", config.tenant_header),
        allowed: "an HTTP header name".into(),
    })
}

impl Gate {
    pub(crate) fn new(
        registry: AdmissionRegistry,
        config: &AdmissionConfig,
        peer_lag: Duration,
    ) -> Result<Gate, ConfigError> {
        let room = room_for(&registry, config, peer_lag)?;
        let class_deadlines = AtomicBool::new(has_class_deadlines(&room));
        let lowest_threshold_secs = AtomicU64::new(lowest_threshold_bits(&room));
        Ok(Gate {
            state: Mutex::new(State {
                room,
                waiters: HashMap::new(),
                config: config.clone(),
            }),
            waiting: AtomicUsize::new(0),
            enabled: AtomicBool::new(config.enabled),
            class_deadlines,
            lowest_threshold_secs,
            tenant_header: ArcSwap::from_pointee(tenant_header(config)?),
            registry,
            releasing: AtomicBool::new(false),
            release_again: AtomicBool::new(false),
            wake: Notify::new(),
            peer_lag,
        })
    }

    /// Whether any request waits in the room (one atomic load).
    pub(crate) fn is_waiting(&self) -> bool {
        self.waiting.load(Ordering::Relaxed) > 0
    }

    pub(crate) fn tenant_header(&self) -> Arc<HeaderName> {
        self.tenant_header.load_full()
    }

    /// Replaces the section: a new order (the waiting requests move to it,
    /// oldest first), threshold, bounds and classes. On error nothing
    /// changes.
    pub(crate) fn swap(&self, config: AdmissionConfig) -> Result<(), ConfigError> {
        let fresh = room_for(&self.registry, &config, self.peer_lag)?;
        let header = tenant_header(&config)?;
        let mut state = self.state.lock();
        let order = self
            .registry
            .build(&config.order, &serde_json::Value::Null)?;
        state.room.swap_order(order);
        state.room.set_config(fresh.config().clone());
        self.enabled.store(config.enabled, Ordering::Release);
        self.class_deadlines
            .store(has_class_deadlines(&fresh), Ordering::Release);
        self.lowest_threshold_secs
            .store(lowest_threshold_bits(&fresh), Ordering::Release);
        self.tenant_header.store(Arc::new(header));
        state.config = config;
        Ok(())
    }

    pub(crate) fn config(&self) -> AdmissionConfig {
        self.state.lock().config.clone()
    }

    /// What the room would do with this request now, and why.
    pub(crate) fn explain(
        &self,
        app: &App,
        headers: &HeaderMap,
        read: &request_features::ReadRequest,
    ) -> Result<Explanation, String> {
        let admission = Admission::read(headers, read.priority, &self.tenant_header())?;
        let arrival = arrival(&admission, &read.info);
        let now = tokio_now();
        // The least wait, not the first with room: explain shows it.
        let expected = expected(app, &read.info, true, 0.0, now);
        Ok(self.state.lock().room.explain(&arrival, expected, now))
    }

    fn max_queue_requests(&self) -> usize {
        self.state.lock().room.config().max_queue_requests
    }

    /// The room, and each waiting request's class and wait so far.
    /// `peers`: the other replicas' rooms as sync last heard them.
    pub(crate) fn view(&self, peers: Option<RoomReport>) -> (RoomView, bool) {
        let mut state = self.state.lock();
        state.room.set_peers(peers);
        (
            state.room.view(tokio_now()),
            self.enabled.load(Ordering::Acquire),
        )
    }

    /// The room as this replica tells the others; `None` with admission
    /// off.
    pub(crate) fn report(&self, now: Instant) -> Option<RoomReport> {
        if !self.enabled.load(Ordering::Acquire) {
            return None;
        }
        Some(self.state.lock().room.report(now))
    }

    /// Work completed somewhere: dispatches waiting requests while the
    /// fleet has room. Cheap when nothing waits.
    pub(crate) fn release(&self, app: &Arc<App>) {
        if self.waiting.load(Ordering::Acquire) == 0 {
            return;
        }
        self.release_again.store(true, Ordering::SeqCst);
        if self.releasing.swap(true, Ordering::SeqCst) {
            // The running release will go round again.
            return;
        }
        loop {
            self.release_again.store(false, Ordering::SeqCst);
            // Dispatches whose clients left: dropped after the lock, since
            // dropping one finishes it, which triggers a release.
            let mut orphans = Vec::new();
            {
                // Read before the lock: the copy is not made under it.
                let peers = app.peer_rooms.combined();
                let mut state = self.state.lock();
                state.room.set_peers(peers);
                self.release_locked(app, &mut state, &mut orphans);
            }
            drop(orphans);
            self.releasing.store(false, Ordering::SeqCst);
            if !self.release_again.load(Ordering::SeqCst)
                || self.releasing.swap(true, Ordering::SeqCst)
            {
                return;
            }
        }
    }

    fn release_locked(&self, app: &Arc<App>, state: &mut State, orphans: &mut Vec<Turn>) {
        // Bounded: each pass releases a request, or stops.
        for _ in 0..=state.waiters.len() {
            if !self.release_one(app, state, orphans) {
                return;
            }
        }
    }

    /// Releases the first request in the room's order that may go now
    /// ([`AdmissionRoom::route`]); `false` when none may.
    fn release_one(&self, app: &Arc<App>, state: &mut State, orphans: &mut Vec<Turn>) -> bool {
        let now = tokio::time::Instant::now();
        let now_std = now.into_std();
        let snapshot = app.topology.load();
        let policy = &snapshot.policy;
        // Once the fleet has no room (or this replica leaves it to
        // another), only requests that pass, or whose deadline is near, go.
        let mut fleet_full = false;
        for turn in state.room.release_order() {
            if fleet_full && !turn.goes_without_fleet_room() {
                continue;
            }
            let Some(waiter) = state.waiters.get(&turn.ticket) else {
                // Not reachable: a ticket is queued and registered under
                // one lock. Dropped rather than left to block the queue.
                state.room.remove(turn.ticket);
                continue;
            };
            let info = &waiter.info;
            if !turn.goes_without_fleet_room() {
                let within_secs = state.room.lowest_threshold().as_secs_f64();
                let expected =
                    policy.expected_wait_within(snapshot.candidates(), info, now_std, within_secs);
                if !state.room.has_room(expected) || state.room.yields_to_peers(now_std) {
                    fleet_full = true;
                    continue;
                }
            }
            let preview = policy.preview(snapshot.candidates(), info, now_std);
            let at_chosen = preview.map(|(_, wait)| wait);
            let busy: Vec<WorkerId> = match state.room.route(&turn, preview, now_std) {
                Route::Chosen => Vec::new(),
                Route::Wait => continue,
                Route::WithRoom => {
                    let mut busy: Vec<WorkerId> = snapshot
                        .candidates()
                        .iter()
                        .copied()
                        .filter(|id| {
                            state.room.peer_waits_for(*id, now_std)
                                || !state
                                    .room
                                    .has_room(policy.expected_wait(&[*id], info, now_std))
                        })
                        .collect();
                    // None has room (its deadline is near): the best of all.
                    if busy.len() == snapshot.candidates().len() {
                        busy.clear();
                    }
                    busy
                }
            };
            let chosen = choose(app, info, waiter.received_at, &busy, now);
            if !matches!(chosen, Chosen::Worker(_)) {
                // Capped, no candidate, or a worker just forgotten: the
                // next trigger tries again.
                return false;
            }
            let Some(released) = state.room.take(turn.ticket, now_std) else {
                return false;
            };
            if let Chosen::Worker(tracker) = &chosen {
                let workers = snapshot.candidates().len();
                state
                    .room
                    .sent(at_chosen, tracker.dispatch(), workers, now_std);
            }
            let Some(waiter) = state.waiters.remove(&released.ticket) else {
                return true;
            };
            self.waiting.fetch_sub(1, Ordering::AcqRel);
            let metrics = &app.metrics;
            queue_depth(metrics, &released.class, -1);
            observe_wait(metrics, &released.class, "dispatched", released.waited);
            if let Err(turn) = waiter.sender.send(Turn::Go(chosen)) {
                orphans.push(turn);
            }
            return true;
        }
        false
    }

    /// Turns away the waiting requests that can no longer meet their
    /// deadline.
    fn shed(&self, app: &Arc<App>) {
        if self.waiting.load(Ordering::Acquire) == 0 {
            return;
        }
        let now = tokio_now();
        let snapshot = app.topology.load();
        let expected = snapshot.policy.expected_wait(
            snapshot.candidates(),
            &RequestInfo::new(TokenCount::Unknown),
            now,
        );
        let mut state = self.state.lock();
        for shed in state.room.shed(expected, now) {
            let Some(waiter) = state.waiters.remove(&shed.ticket) else {
                continue;
            };
            self.waiting.fetch_sub(1, Ordering::AcqRel);
            queue_depth(&app.metrics, &shed.class, -1);
            observe_wait(&app.metrics, &shed.class, "rejected", shed.waited);
            count_rejection(&app.metrics, &shed.class, shed.rejection.reason);
            // A client that left is taken out by its own drop.
            let _ = waiter.sender.send(Turn::Rejected(shed.rejection));
        }
    }

    /// A request that never waited went to a worker, as `tracker` says,
    /// with `expected` the policy's expected wait for it at arrival, among
    /// `workers` candidates.
    fn dispatched(
        &self,
        arrival: &Arrival,
        expected: Option<ExpectedWait>,
        tracker: &RequestTracker,
        workers: usize,
    ) {
        let now = tokio_now();
        let mut state = self.state.lock();
        state.room.dispatched(arrival, now);
        state.room.sent(expected, tracker.dispatch(), workers, now);
    }

    /// An answer of this class and tenant ended with `output_tokens`
    /// generated, as its engine reported: orders that share by token work
    /// count them.
    pub(crate) fn finished(&self, class: &str, tenant: &str, output_tokens: u64) {
        self.state
            .lock()
            .room
            .finished(class, tenant, output_tokens);
    }
}

/// Moves the class's queue-depth gauge by `delta`.
fn queue_depth(metrics: &Metrics, class: &str, delta: i64) {
    metrics
        .admission_queue_depth
        .get_or_create(&ClassLabel {
            class: class.to_owned(),
        })
        .inc_by(delta);
}

fn observe_wait(metrics: &Metrics, class: &str, outcome: &'static str, waited: Duration) {
    metrics
        .admission_wait
        .get_or_create(&ClassOutcomeLabels {
            class: class.to_owned(),
            outcome,
        })
        .observe(waited.as_secs_f64());
}

fn count_rejection(metrics: &Metrics, class: &str, reason: RejectReason) {
    metrics
        .admission_rejections
        .get_or_create(&ClassReasonLabels {
            class: class.to_owned(),
            reason: reason.as_str(),
        })
        .inc();
}

/// Checks the waiting requests' deadlines every [`TICK`] while any waits,
/// and releases what the fleet has room for (a backstop for triggers that
/// came while the fleet had none).
pub(crate) async fn run_ticker(app: Arc<App>) {
    loop {
        if app.admission.waiting.load(Ordering::Acquire) == 0 {
            app.admission.wake.notified().await;
            continue;
        }
        tokio::time::sleep(TICK).await;
        app.admission.shed(&app);
        app.admission.release(&app);
    }
}

/// The policy's expected waits for a request: at the least busy candidate
/// (or the first found whose wait is at most `within_secs`) and, when
/// `at_chosen`, at the worker it would choose (a second scoring, asked for
/// only when the request has a deadline to judge).
fn expected(
    app: &App,
    info: &RequestInfo,
    at_chosen: bool,
    within_secs: f64,
    now: Instant,
) -> Expected {
    let snapshot = app.topology.load();
    let candidates = snapshot.candidates();
    Expected {
        fleet: snapshot
            .policy
            .expected_wait_within(candidates, info, now, within_secs),
        chosen: at_chosen
            .then(|| snapshot.policy.preview(candidates, info, now))
            .flatten()
            .map(|(_, wait)| wait),
    }
}

/// The room's view of a request.
fn arrival(admission: &Admission, info: &RequestInfo) -> Arrival {
    Arrival {
        priority: admission.priority,
        tenant: admission.tenant.clone(),
        ttft_deadline: admission.ttft_deadline,
        work_tokens: info.tokens.or(UNKNOWN_PROMPT_TOKENS),
    }
}

/// How [`admit`] ended.
pub(crate) enum Admitted {
    /// A worker was chosen (or why none could be): go on as without
    /// admission.
    Chosen(Chosen),
    /// The router's own answer: 429 from the room, or the request deadline
    /// passed while it waited.
    Answer(Answer),
}

/// Admits one request: dispatched now, or after a wait in the queue, or
/// turned away. `deadline` is the whole request's. `span`, the request's
/// `admission` span when it is traced, gets the class and the `queued` or
/// `rejected` event.
pub(crate) async fn admit(
    app: &Arc<App>,
    info: &RequestInfo,
    received_at: Instant,
    admission: &Admission,
    deadline: tokio::time::Instant,
    mut span: Option<&mut SpanGuard>,
) -> Admitted {
    let gate = &app.admission;
    let now = tokio::time::Instant::now();
    if !gate.enabled.load(Ordering::Acquire) {
        return Admitted::Chosen(choose(app, info, received_at, &[], now));
    }
    let arrival = arrival(admission, info);
    let now_std = now.into_std();
    // Without the lock unless a class may set the deadline.
    let has_deadline = arrival.ttft_deadline.is_some()
        || (gate.class_deadlines.load(Ordering::Acquire)
            && gate.state.lock().room.has_deadline(&arrival));
    let within_secs = f64::from_bits(gate.lowest_threshold_secs.load(Ordering::Acquire));
    let expected = expected(app, info, has_deadline, within_secs, now_std);
    let (sender, receiver) = oneshot::channel();
    let mut sender = Some(sender);
    // The decision and the waiter's registration are one critical section,
    // so no release can pop a ticket whose task it cannot reach.
    let (decision, class) = {
        let peers = app.peer_rooms.combined();
        let mut state = gate.state.lock();
        let class = state.room.classify(&arrival).class;
        state.room.set_peers(peers);
        let decision = state.room.arrive(&arrival, expected, now_std);
        if let Decision::Queued(ticket) = decision {
            let waiter = (info, received_at, &class);
            register(gate, app, &mut state, ticket, waiter, &mut sender);
        }
        (decision, class)
    };
    let decision = match decision {
        Decision::DispatchNow => match choose(app, info, received_at, &[], now) {
            Chosen::Capped => {
                let mut state = gate.state.lock();
                let decision = state.room.enqueue(&arrival, expected, tokio_now());
                if let Decision::Queued(ticket) = decision {
                    let waiter = (info, received_at, &class);
                    register(gate, app, &mut state, ticket, waiter, &mut sender);
                }
                decision
            }
            chosen => {
                if let Chosen::Worker(tracker) = &chosen {
                    let workers = app.topology.load().candidates().len();
                    gate.dispatched(&arrival, expected.fleet, tracker, workers);
                }
                return Admitted::Chosen(charged(chosen, &class, &arrival.tenant));
            }
        },
        other => other,
    };
    if let Some(span) = span.as_mut() {
        span.set(KeyValue::new("llm_router.class", class.to_string()));
        match &decision {
            Decision::Queued(_) => span.event("queued", Vec::new()),
            Decision::Rejected(rejection) => span.event(
                "rejected",
                vec![KeyValue::new(
                    "llm_router.reason",
                    rejection.reason.as_str(),
                )],
            ),
            Decision::DispatchNow => {}
        }
    }
    match decision {
        Decision::Queued(ticket) => {
            match wait(app, ticket, class.clone(), receiver, deadline).await {
                Admitted::Chosen(chosen) => {
                    Admitted::Chosen(charged(chosen, &class, &arrival.tenant))
                }
                answer => answer,
            }
        }
        Decision::Rejected(rejection) => {
            count_rejection(&app.metrics, &class, rejection.reason);
            Admitted::Answer(rejected(&rejection, gate.max_queue_requests()))
        }
        Decision::DispatchNow => Admitted::Chosen(Chosen::Capped),
    }
}

/// `chosen` with its answer's output charged to the request's class and
/// tenant.
fn charged(chosen: Chosen, class: &Arc<str>, tenant: &Arc<str>) -> Chosen {
    match chosen {
        Chosen::Worker(mut tracker) => {
            tracker.charge_output_to(class.clone(), tenant.clone());
            Chosen::Worker(tracker)
        }
        other => other,
    }
}

/// Registers a queued request's task (its body's facts, when it arrived,
/// its class) to be sent its turn.
fn register(
    gate: &Gate,
    app: &App,
    state: &mut State,
    ticket: u64,
    (info, received_at, class): (&RequestInfo, Instant, &Arc<str>),
    sender: &mut Option<oneshot::Sender<Turn>>,
) {
    let Some(sender) = sender.take() else {
        return;
    };
    queue_depth(&app.metrics, class, 1);
    state.waiters.insert(
        ticket,
        Waiter {
            info: info.clone(),
            received_at,
            sender,
        },
    );
    gate.waiting.fetch_add(1, Ordering::AcqRel);
    gate.wake.notify_one();
}

/// Takes a request out of the queue when its task stops waiting (its
/// client left, or the request deadline passed) before its turn came.
struct QueuedWait<'a> {
    app: &'a Arc<App>,
    ticket: u64,
    class: Arc<str>,
    started: Instant,
    over: bool,
}

impl Drop for QueuedWait<'_> {
    fn drop(&mut self) {
        if self.over {
            return;
        }
        let gate = &self.app.admission;
        let mut state = gate.state.lock();
        if state.room.remove(self.ticket) {
            state.waiters.remove(&self.ticket);
            gate.waiting.fetch_sub(1, Ordering::AcqRel);
            drop(state);
            let metrics = &self.app.metrics;
            queue_depth(metrics, &self.class, -1);
            let waited = tokio_now().saturating_duration_since(self.started);
            observe_wait(metrics, &self.class, "left", waited);
        }
    }
}

async fn wait(
    app: &Arc<App>,
    ticket: u64,
    class: Arc<str>,
    receiver: oneshot::Receiver<Turn>,
    deadline: tokio::time::Instant,
) -> Admitted {
    let mut waiting = QueuedWait {
        app,
        ticket,
        class,
        started: tokio_now(),
        over: false,
    };
    // The fleet may have room already (the request was queued behind
    // others, or capacity freed since the decision).
    app.admission.release(app);
    match tokio::time::timeout_at(deadline, receiver).await {
        Ok(Ok(Turn::Go(chosen))) => {
            waiting.over = true;
            Admitted::Chosen(chosen)
        }
        Ok(Ok(Turn::Rejected(rejection))) => {
            waiting.over = true;
            Admitted::Answer(rejected(&rejection, app.admission.max_queue_requests()))
        }
        // The gate dropped the waiter without a turn: not reachable, as
        // every removal sends one; answered as a lack of capacity.
        Ok(Err(_)) => {
            waiting.over = true;
            Admitted::Chosen(Chosen::Capped)
        }
        Err(_elapsed) => Admitted::Answer(crate::proxy::deadline_passed(app)),
    }
}

/// The 429 the room's rejection is answered with.
fn rejected(rejection: &Rejection, max_queue_requests: usize) -> Answer {
    let predicted = rejection.predicted_wait.map(|wait| wait.as_secs_f64());
    let message = match rejection.reason {
        RejectReason::QueueFull => format!(
            "the router's admission queue is full (admission.max_queue_requests = {}, counting every router replica's queue); retry after {} s",
            max_queue_requests, rejection.retry_after_s
        ),
        RejectReason::DeadlineUnmeetable => format!(
            "the predicted time to first token ({:.2} s) is past the request's TTFT deadline; retry after {} s",
            predicted.unwrap_or(0.0),
            rejection.retry_after_s
        ),
        RejectReason::DeadlinePassed => {
            "the request's TTFT deadline passed while it waited for a worker".to_owned()
        }
    };
    let body = serde_json::json!({"error": {
        "message": message,
        "type": "rate_limit_exceeded",
        "code": rejection.reason.as_str(),
        "retry_after_s": rejection.retry_after_s,
        "predicted_wait_s": predicted,
    }});
    let mut response = (StatusCode::TOO_MANY_REQUESTS, axum::Json(body)).into_response();
    response.headers_mut().insert(
        header::RETRY_AFTER,
        HeaderValue::from(rejection.retry_after_s),
    );
    own(response)
}
