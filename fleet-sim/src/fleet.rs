//! One simulation cell: a fleet of engines, one routing policy (or a
//! reference) in each of R router replicas, one stream of requests, in
//! virtual time.
//!
//! Events, in time order (ties in the order they were scheduled):
//! - **arrival**: a router replica (uniform at random, or the first with
//!   `first_replica_share`; seeded: the same assignment for every policy)
//!   routes the request with `select`, and the
//!   chosen engine receives it. The references instead read every engine's
//!   true state at that instant: `oracle` each engine's
//!   [`first_token_projection_s`](engine_model::Engine::first_token_projection_s)
//!   for this request, `least_true_queue` its
//!   [`queued_prefill_s`](engine_model::Engine::queued_prefill_s).
//! - **step end**: an engine's step is computed when it starts (its
//!   admissions and prefill chunk leave the queue then, as a real scheduler's
//!   do when it plans the batch); its events are delivered at its end, where
//!   the dispatching replica's policy sees `first_token`, and at a finish
//!   the engine's report of the prompt tokens its prefix cache served
//!   (`cache_report`, as a response's usage arrives at its end) before
//!   `finish`; the next step starts. The decode-only steps after a step that emitted
//!   nothing are planned with it ([`Engine::step_ahead`](engine_model::Engine::step_ahead)):
//!   one step end for the whole run, the engine brought up to the instant
//!   before each read of it, the run cut (and its end moved earlier) by a
//!   request submitted to it or a speed change. Bit-identical to stepping.
//! - **poll send / poll done**: every `poll_interval_s` each replica polls
//!   each worker: `poll_started` at send time, the engine's report taken at
//!   send time (or at completion, per the scenario), converted to a
//!   `WorkerLoad` by the worker's backend conversion, and handed to
//!   `poll_completed` `poll_latency_s` later (`poll_failed` if the
//!   conversion rejects it). Replica `r` and worker `w` poll at phase
//!   `replica_offset[r] + worker_offset[w]` within the interval.
//! - **slowdown** (scenarios with one): the worker's engine changes speed.
//! - **rate sample** (scenarios with a slowdown): every poll interval, each
//!   replica's rate for the slowed worker is read from its policy's
//!   `explain` table, next to the engine's true `prefill_tps`.
//! - **sync tick / sync delivery** (several replicas with a periodic sync,
//!   [`SyncConfig::Periodic`](crate::SyncConfig::Periodic)): a replica publishes its
//!   changed pending work; the message reaches the other replicas' policies
//!   `latency_s` later ([`SyncChannel`](crate::SyncChannel)). With the ideal sync, a
//!   replica's change is handed to the others at the dispatch or first
//!   token that made it. The same channel carries each dispatch's prefix
//!   placement (`Policy::placement`), each cache bound a `cache_report`
//!   changed and each first token a `first_token` returned, to the other
//!   replicas' `replica_update`.
//! - **admission** (router points with an admission order): each replica
//!   drives its own `admission::AdmissionRoom` as the router does. An
//!   arrival is dispatched at once, waits in the room, or is turned away
//!   (`arrive` with the policy's `expected_wait`, and its `preview` for a
//!   request with a deadline; `enqueue` when `select`
//!   finds every worker capped). After every first token, finish, poll
//!   completion and arrival, and every [`ADMISSION_TICK_S`] while requests
//!   wait, the replica releases requests in the room's turn to the worker
//!   its policy picks then (late binding) while the room `has_room`, each
//!   waiting for a busy chosen worker as the room's `route` says; each tick first
//!   `shed`s the waiting requests that can no longer meet their deadline,
//!   as the router's ticker does. A released request reaches its engine at
//!   its release; its TTFT counts from its arrival at the router. With
//!   several replicas and a sync, each room is told of the others'
//!   (`set_peers`, `AdmissionRoom::report`) before it decides: at once
//!   with the ideal sync; as each replica published its room at its last
//!   publish tick, `latency_s` later, with a periodic sync (losses are not
//!   drawn for these). A replica also releases when the others' work
//!   reaches it (each delivery; with the ideal sync, each first token).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use admission::{
    AdmissionRoom, Arrival, Decision, Expected, RejectReason, RoomConfig, RoomReport, Route,
};
use load_protocols::WorkerLoad;
use policy_core::{
    Dispatch, Policy, PolicyContext, PolicyRegistry, PollMark, PrefixBlocks, RequestInfo,
    TokenCount, WorkerId, WorkerInfo,
};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::error::SimError;
use super::metrics::{CellStats, percentile, summarize};
use super::outcome::{CellOutcomes, Outcome, cell_outcomes};
use super::scenario::{
    LoadReport, PhaseMode, PolicyName, ReportAt, RouterPoint, SharedPrefixConfig,
};
use super::sync::{SyncChannel, worker_url};
use super::workload::RequestSpec;
use engine_model::{
    Engine, EngineEvent, EngineParams, EngineRequest, EngineSnapshot, RequestRecord, mix, reports,
};

/// Everything one cell needs.
#[derive(Debug, Clone, Copy)]
pub struct Cell<'a> {
    pub workers: &'a [(LoadReport, EngineParams)],
    pub requests: &'a [RequestSpec],
    /// Each request's chained block hashes at [`router_block_tokens`]
    /// ([`RequestSpec::chained_block_hashes`]), shared by the cells of a
    /// load level; empty: each arrival chains its own.
    pub chains: &'a [Arc<[u64]>],
    pub shared_prefix: Option<SharedPrefixConfig>,
    pub router: RouterPoint,
    pub policy: PolicyName,
    /// Seeds engines, phases, replica assignment, policies and the references.
    pub seed: u64,
    /// One worker's speed change, if any; the cell then samples the
    /// policies' rate for that worker.
    pub slowdown: Option<Slowdown>,
    /// One replica's restart, if any (cells with that replica).
    pub restart: Option<Restart>,
    /// Each replica's admission room config, when the scenario sets
    /// admission: a room runs where the router point's order is not `off`
    /// (not for the references), and request deadlines take its classes'.
    pub room: Option<&'a RoomConfig>,
    /// Whether a multi-turn session ends at a turn its room turns away
    /// (its later turns are not sent), or goes on as drawn.
    pub turned_away_ends_session: bool,
}

/// How often a replica's admission room is released and checked for
/// deadlines while requests wait: the router's ticker.
pub const ADMISSION_TICK_S: f64 = 0.01;
/// Virtual seconds a room may wait, with nothing left to arrive and every
/// engine idle, without releasing anything, before the cell counts as stuck.
const STUCK_AFTER_S: f64 = 60.0;

/// One router replica's restart in a cell (the scenario's `restart`,
/// resolved to a time).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Restart {
    pub replica: usize,
    /// Virtual seconds.
    pub at_s: f64,
    /// Whether the fresh policy first loads another replica's prefix
    /// snapshot.
    pub warm: bool,
    /// The span measured before and after it, seconds.
    pub window_s: f64,
}

/// The restarted replica's requests before and after its restart.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize)]
pub struct RestartStats {
    pub replica: usize,
    pub at_s: f64,
    pub warm: bool,
    /// Blocks the fresh policy loaded from the other replica's snapshot.
    pub snapshot_blocks: usize,
    /// p99 TTFT of its requests arriving in the window before, and after.
    pub before_p99_s: f64,
    pub after_p99_s: f64,
    pub before_requests: usize,
    pub after_requests: usize,
}

/// One worker's speed change in a cell (the scenario's `slowdown`, resolved
/// to a time).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Slowdown {
    /// The worker's index in fleet order.
    pub worker: usize,
    /// Virtual seconds.
    pub at_s: f64,
    /// The new speed as a multiple of the nominal one.
    pub factor: f64,
}

/// The block size the router hashes prompts with: the first worker's, as
/// its engine hashes them (engines with that block size get the same
/// hashes).
pub fn router_block_tokens(workers: &[(LoadReport, EngineParams)]) -> u32 {
    workers.first().map_or(16, |w| w.1.block_size_tokens)
}

/// The explain-table column that holds a `least_load` policy's rate.
pub const RATE_COLUMN: &str = "rate_tps";

/// One moment of a [`RateTrace`].
#[derive(Debug, Clone, PartialEq)]
pub struct RateSample {
    pub time_s: f64,
    /// The worker's true `prefill_tps` at that moment.
    pub true_prefill_tps: f64,
    /// Each replica's rate for the worker (`None` where its table has none).
    pub estimates_tps: Vec<Option<f64>>,
}

/// The policies' rate for one worker over a cell, every poll interval.
#[derive(Debug, Clone, PartialEq)]
pub struct RateTrace {
    pub worker: usize,
    /// When the worker changed speed, virtual seconds.
    pub slowdown_at_s: f64,
    pub samples: Vec<RateSample>,
}

impl RateTrace {
    /// How many replicas' estimates the samples carry.
    pub fn replica_count(&self) -> usize {
        self.samples
            .iter()
            .map(|s| s.estimates_tps.len())
            .max()
            .unwrap_or(0)
    }
}

/// The registry of every policy the simulator compares.
pub fn policy_registry() -> PolicyRegistry {
    let mut registry = PolicyRegistry::with_baselines();
    policy_least_load::register(&mut registry);
    registry
}

/// Builds one replica's policy; `None` for the references.
pub fn build_policy(
    registry: &PolicyRegistry,
    name: PolicyName,
    context: &PolicyContext,
) -> Result<Option<Box<dyn Policy>>, SimError> {
    let (registry_name, section) = match name {
        PolicyName::Oracle | PolicyName::LeastTrueQueue => return Ok(None),
        PolicyName::LeastLoadSincePoll => {
            ("least_load", serde_json::json!({"inflight": "since_poll"}))
        }
        PolicyName::LeastLoadReportedRate => (
            "least_load",
            serde_json::json!({"use_reported_throughput": true}),
        ),
        PolicyName::LeastLoadFixedRate => (
            "least_load",
            serde_json::json!({"use_reported_throughput": false}),
        ),
        PolicyName::LeastLoadNoPrefix => {
            ("least_load", serde_json::json!({"prefix_affinity": false}))
        }
        other => (other.as_str(), serde_json::Value::Null),
    };
    registry
        .build(registry_name, &section, context)
        .map(Some)
        .map_err(|source| SimError::Policy {
            policy: name.as_str(),
            source,
        })
}

/// Whether a fresh instance of policy `name` predicts a request's wait
/// (`Policy::expected_wait`): only such policies run with an admission
/// room, since a room dispatches every other policy's requests at once
/// (unless it finds every worker capped, which the simulated policies never
/// do). The references have no policy and no room.
pub fn predicts_wait(registry: &PolicyRegistry, name: PolicyName) -> bool {
    let context = PolicyContext::default();
    let Ok(Some(policy)) = build_policy(registry, name, &context) else {
        return false;
    };
    let id = WorkerId::new(0, 0);
    policy.add_worker(id, WorkerInfo::new(worker_url(0), "sglang"));
    let request = RequestInfo::new(TokenCount::Exact(200));
    policy
        .expected_wait(&[id], &request, Instant::now())
        .is_some()
}

/// `least_true_queue` (`docs/engine-model.md`, "The policies compared"):
/// the worker whose true uncached prefill work (waiting plus unfinished
/// chunked prefill) divided by its `prefill_tps` is least, ties broken
/// uniformly at random (reservoir sampling).
pub fn least_true_queue_pick(engines: &[Engine], rng: &mut SmallRng) -> usize {
    least_pick(engines.iter().map(Engine::queued_prefill_s), rng)
}

/// The `oracle` (`docs/engine-model.md`, "The policies compared"): the
/// worker where this request would get its first token soonest if sent now
/// and nothing else arrived, from each engine's true state, speed, chunking,
/// decode load and the request's own uncached prompt there
/// ([`Engine::first_token_projection_s`]); ties broken uniformly at random
/// (reservoir sampling). `request` builds the request for one engine's
/// parameters and its [`prefix_chain`](EngineRequest::prefix_chain) there
/// (the chain depends on the block size; the request's own
/// `prefix_block_hashes` are not read).
///
/// Engines are projected in the order of their
/// [`Engine::first_token_lower_bound_s`], and the search stops at the first
/// bound above the best projection so far: the same minimum and the same tie
/// set as projecting every engine, for a fraction of the work.
pub fn oracle_pick(
    engines: &[Engine],
    now_s: f64,
    request: impl Fn(&EngineParams) -> (EngineRequest, Arc<[u64]>),
    rng: &mut SmallRng,
) -> usize {
    // One request (and one chain) per block size, not per engine: the
    // fleet usually has one.
    let mut by_block_size: Vec<(u32, EngineRequest, Arc<[u64]>)> = Vec::with_capacity(1);
    let variant: Vec<usize> = engines
        .iter()
        .map(|engine| {
            let block_tokens = engine.params().block_size_tokens;
            match by_block_size.iter().position(|v| v.0 == block_tokens) {
                Some(known) => known,
                None => {
                    let (request, chain) = request(engine.params());
                    by_block_size.push((block_tokens, request, chain));
                    by_block_size.len() - 1
                }
            }
        })
        .collect();
    let request_for = |index: usize| {
        let (_, request, chain) = &by_block_size[variant[index]];
        (request, &chain[..])
    };
    let mut order: Vec<(f64, usize)> = engines
        .iter()
        .enumerate()
        .map(|(index, engine)| {
            let (request, chain) = request_for(index);
            (
                engine.first_token_lower_bound_s(now_s, request, chain),
                index,
            )
        })
        .collect();
    order.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let mut least = Least::default();
    for (bound_s, index) in order {
        if bound_s > least.value {
            break;
        }
        let (request, chain) = request_for(index);
        least.offer(
            index,
            engines[index].first_token_projection_s(now_s, request, chain),
            rng,
        );
    }
    least.index
}

/// The index of the least value, ties broken uniformly at random.
fn least_pick(values: impl Iterator<Item = f64>, rng: &mut SmallRng) -> usize {
    let mut least = Least::default();
    for (index, value) in values.enumerate() {
        least.offer(index, value, rng);
    }
    least.index
}

/// The least value offered so far and its index, ties broken uniformly at
/// random (reservoir sampling).
#[derive(Debug)]
struct Least {
    index: usize,
    value: f64,
    ties: u32,
}

impl Default for Least {
    fn default() -> Least {
        Least {
            index: 0,
            value: f64::INFINITY,
            ties: 0,
        }
    }
}

impl Least {
    fn offer(&mut self, index: usize, value: f64, rng: &mut SmallRng) {
        match value.total_cmp(&self.value) {
            Ordering::Less => {
                self.index = index;
                self.value = value;
                self.ties = 1;
            }
            Ordering::Equal => {
                self.ties += 1;
                if rng.random_range(0..self.ties) == 0 {
                    self.index = index;
                }
            }
            Ordering::Greater => {}
        }
    }
}

/// A worker's report, converted exactly as the router's load monitor does
/// for its backend. `Err` is a rejected report (the poll fails).
pub fn convert_report(
    report: LoadReport,
    snapshot: &EngineSnapshot,
    vllm_metrics: &mut backends_vllm::VllmMetricsConverter,
    observed_at: Instant,
) -> Result<Option<WorkerLoad>, Box<dyn std::error::Error + Send + Sync>> {
    match report {
        LoadReport::Sglang => {
            let body = reports::sglang_loads(snapshot, String::new());
            Ok(backends_sglang::worker_load_from_loads_json(body)?)
        }
        LoadReport::SglangGrpc => {
            let rank = backends_sglang::grpc_from_snapshot(&reports::sglang_rank(snapshot));
            let response = backends_sglang::proto::GetLoadsResponse {
                dp_rank_count: 1,
                loads: vec![rank],
                ..Default::default()
            };
            Ok(backends_sglang::worker_load_from_grpc(response)?)
        }
        LoadReport::Vllm => {
            let text = reports::vllm_metrics_text(snapshot, "sim", 0);
            Ok(Some(vllm_metrics.convert_text(&text, observed_at)?))
        }
        LoadReport::VllmGrpc => {
            let load = reports::vllm_load(snapshot);
            let response = backends_vllm::proto::GetLoadsResponse {
                loads: vec![backends_vllm::proto::SchedulerLoad {
                    num_running_reqs: load.num_running_reqs,
                    num_waiting_reqs: load.num_waiting_reqs,
                    num_total_reqs: load.num_total_reqs,
                    token_usage: load.token_usage,
                    ..Default::default()
                }],
                ..Default::default()
            };
            Ok(backends_vllm::worker_load_from_grpc(response)?)
        }
        LoadReport::Tokenspeed => {
            // A released TokenSpeed server: no queued tokens, no throughput
            // (sent as 0, read back as "not reported" by the proto3 rules).
            let load = reports::tokenspeed_load(snapshot);
            let response = backends_tokenspeed::proto::GetLoadsResponse {
                dp_rank_count: 1,
                loads: vec![backends_tokenspeed::proto::SchedulerLoad {
                    num_running_reqs: load.num_running_reqs,
                    num_waiting_reqs: load.num_waiting_reqs,
                    num_total_reqs: load.num_total_reqs,
                    num_used_tokens: load.num_used_tokens,
                    max_total_num_tokens: load.max_total_num_tokens,
                    max_running_requests: load.max_running_requests,
                    token_usage: load.token_usage,
                    ..Default::default()
                }],
                ..Default::default()
            };
            Ok(backends_tokenspeed::worker_load_from_grpc(response)?)
        }
    }
}

/// What a poll carries back: boxed in its event, so that the event queue
/// moves small events (its heap moves every event it sifts past).
#[derive(Debug)]
struct PollReply {
    mark: PollMark,
    snapshot: Option<EngineSnapshot>,
}

#[derive(Debug)]
enum Kind {
    Arrival,
    /// The end of an engine's steps computed so far; stale (ignored) once
    /// the engine's `generation` moved on (a submit cut its planned steps).
    StepEnd {
        worker: u32,
        generation: u32,
    },
    PollSend {
        replica: u32,
        worker: u32,
    },
    PollDone {
        replica: u32,
        worker: u32,
        reply: Box<PollReply>,
    },
    Slowdown,
    RateSample,
    SyncTick {
        replica: u32,
    },
    /// The oldest sync message in flight arrives.
    SyncDeliver,
    /// A replica restarts (cells with a restart).
    Restart,
    /// A replica's admission room is released and checked (while requests
    /// wait in it).
    AdmissionTick {
        replica: u32,
    },
}

#[derive(Debug)]
struct Event {
    time_s: f64,
    seq: u64,
    kind: Kind,
}

impl PartialEq for Event {
    fn eq(&self, other: &Event) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Event {}

impl PartialOrd for Event {
    fn partial_cmp(&self, other: &Event) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Event {
    /// Reversed, so that `BinaryHeap` pops the earliest (then first scheduled).
    fn cmp(&self, other: &Event) -> Ordering {
        other
            .time_s
            .total_cmp(&self.time_s)
            .then(other.seq.cmp(&self.seq))
    }
}

#[derive(Debug, Default)]
struct Queue {
    heap: BinaryHeap<Event>,
    seq: u64,
}

impl Queue {
    fn push(&mut self, time_s: f64, kind: Kind) {
        self.seq += 1;
        self.heap.push(Event {
            time_s,
            seq: self.seq,
            kind,
        });
    }
}

/// Phase offsets in `[0, interval)`.
fn offsets(mode: PhaseMode, count: usize, interval_s: f64, rng: &mut SmallRng) -> Vec<f64> {
    (0..count)
        .map(|i| match mode {
            PhaseMode::Aligned => 0.0,
            PhaseMode::Spread => interval_s * i as f64 / count as f64,
            PhaseMode::Random => interval_s * rng.random::<f64>(),
        })
        .collect()
}

/// Runs one cell to the last request's completion.
pub fn run_cell(cell: &Cell<'_>, registry: &PolicyRegistry) -> Result<CellStats, SimError> {
    let mut run = CellRun::new(cell, registry)?;
    run.run_events()?;
    run.results()
}

/// Runs one cell to the last request's end; returns the served requests'
/// records, in the order they finished.
pub(crate) fn run_cell_records(
    cell: &Cell<'_>,
    registry: &PolicyRegistry,
) -> Result<Vec<RequestRecord>, SimError> {
    let mut run = CellRun::new(cell, registry)?;
    run.run_events()?;
    Ok(run.records)
}

/// Virtual seconds as the `Instant`s the policies take.
#[derive(Debug, Clone, Copy)]
struct Clock {
    base: Instant,
}

impl Clock {
    fn at(self, time_s: f64) -> Instant {
        self.base + Duration::from_secs_f64(time_s.max(0.0))
    }
}

/// The engines, each with the step it is running.
#[derive(Debug)]
struct Fleet {
    engines: Vec<Engine>,
    /// Each engine's events of its running step, delivered at the step's end.
    in_step: Vec<Vec<EngineEvent>>,
    stepping: Vec<bool>,
    busy_engines: usize,
    /// Each engine's scheduled step end, and the generation of that event.
    step_end_s: Vec<f64>,
    generation: Vec<u32>,
}

impl Fleet {
    fn new(cell: &Cell<'_>) -> Result<Fleet, SimError> {
        let workers = cell.workers.len();
        let mut engines = Vec::with_capacity(workers);
        for (index, (_, params)) in cell.workers.iter().enumerate() {
            let mut engine =
                Engine::new(params.clone(), mix(cell.seed ^ 0xe6_0000 ^ index as u64))?;
            engine.set_token_events(false);
            engines.push(engine);
        }
        Ok(Fleet {
            engines,
            in_step: vec![Vec::new(); workers],
            stepping: vec![false; workers],
            busy_engines: 0,
            step_end_s: vec![0.0; workers],
            generation: vec![0; workers],
        })
    }

    /// Starts the engine's next step if it has work, with the decode-only
    /// steps after it ([`Engine::step_ahead`]); its events are held until
    /// the end of the last.
    fn start_step(&mut self, worker: usize, now_s: f64, queue: &mut Queue) {
        let engine = &mut self.engines[worker];
        if engine
            .step_ahead(now_s, &mut self.in_step[worker])
            .is_some()
        {
            self.stepping[worker] = true;
            self.busy_engines += 1;
            self.schedule_step_end(worker, queue);
        }
    }

    /// Schedules the end of the engine's steps, a new generation.
    fn schedule_step_end(&mut self, worker: usize, queue: &mut Queue) {
        let end_s = self.engines[worker].run_end_s();
        self.step_end_s[worker] = end_s;
        self.generation[worker] = self.generation[worker].wrapping_add(1);
        queue.push(
            end_s,
            Kind::StepEnd {
                worker: worker as u32,
                generation: self.generation[worker],
            },
        );
    }

    /// After the engine's planned steps were cut (a submit, a speed change):
    /// its step end moves to the end of the step under way.
    fn reschedule_step_end(&mut self, worker: usize, queue: &mut Queue) {
        if self.stepping[worker]
            && self.engines[worker].run_end_s().to_bits() != self.step_end_s[worker].to_bits()
        {
            self.schedule_step_end(worker, queue);
        }
    }

    /// Brings every engine's planned steps up to `now_s`, for a reference
    /// that reads them all.
    fn advance_all(&mut self, now_s: f64) {
        for engine in &mut self.engines {
            engine.advance_to(now_s);
        }
    }

    /// Ends the engine's step, moving its events into `events`.
    fn end_step(&mut self, worker: usize, events: &mut Vec<EngineEvent>) {
        self.stepping[worker] = false;
        self.busy_engines -= 1;
        std::mem::swap(events, &mut self.in_step[worker]);
    }
}

/// One of `replicas` for an arrival: the first with `first_share` of them
/// if set, the others alike.
fn draw_replica(rng: &mut SmallRng, replicas: usize, first_share: Option<f64>) -> usize {
    if replicas <= 1 {
        return 0;
    }
    match first_share {
        Some(share) if rng.random::<f64>() < share => 0,
        Some(_) => 1 + rng.random_range(0..replicas - 1),
        None => rng.random_range(0..replicas),
    }
}

/// The router side: one policy per replica (none for the references), what
/// each replica has dispatched, and its view of every worker's reports.
struct Router {
    policy: PolicyName,
    ids: Vec<WorkerId>,
    policies: Vec<Box<dyn Policy>>,
    oracle_rng: SmallRng,
    replica_rng: SmallRng,
    /// The first replica's share of arrivals (`None`: all alike).
    first_replica_share: Option<f64>,
    /// One per (replica, worker): vLLM's throughput is a counter's rate
    /// between one replica's polls.
    converters: Vec<backends_vllm::VllmMetricsConverter>,
    /// The replica and dispatch of each request a policy routed, by id.
    dispatches: Vec<Option<(u32, Dispatch)>>,
    /// The policy a restarting replica takes (cells with a restart).
    spare: Option<Box<dyn Policy>>,
    /// Each replica's admission room (none at points without admission,
    /// and for the references).
    rooms: Vec<Room>,
}

/// One replica's admission room, and the request and arrival time behind
/// each of its tickets.
struct Room {
    room: AdmissionRoom,
    requests: HashMap<u64, (usize, f64)>,
    /// Whether its next tick is scheduled.
    ticking: bool,
}

impl Router {
    fn new(cell: &Cell<'_>, registry: &PolicyRegistry) -> Result<Router, SimError> {
        let workers = cell.workers.len();
        let replicas = cell.router.replicas as usize;
        let ids: Vec<WorkerId> = (0..workers).map(|i| WorkerId::new(i as u32, 0)).collect();
        let build = |seed: u64| -> Result<Option<Box<dyn Policy>>, SimError> {
            let context = PolicyContext {
                poll_interval: Duration::from_secs_f64(cell.router.poll_interval_s),
                stale_after: Duration::from_secs_f64(cell.router.stale_after_s),
                rng_seed: mix(seed),
            };
            let policy = build_policy(registry, cell.policy, &context)?;
            if let Some(policy) = &policy {
                for (index, id) in ids.iter().enumerate() {
                    policy.add_worker(
                        *id,
                        WorkerInfo::new(worker_url(index), cell.workers[index].0.backend_name()),
                    );
                }
            }
            Ok(policy)
        };
        let mut policies: Vec<Box<dyn Policy>> = Vec::with_capacity(replicas);
        for replica in 0..replicas {
            policies.extend(build(cell.seed ^ 0x90_11c7 ^ replica as u64)?);
        }
        let spare = match cell.restart {
            Some(restart) if restart.replica < policies.len() => {
                build(cell.seed ^ 0x5_7a27 ^ restart.replica as u64)?
            }
            _ => None,
        };
        let mut rooms = Vec::new();
        if let Some(config) = cell.room
            && !cell.router.admission.is_off()
        {
            let order_name = cell.router.admission.as_str();
            let orders = admission::registry();
            for _ in 0..policies.len() {
                let order =
                    orders
                        .build(order_name, &serde_json::Value::Null)
                        .map_err(|source| SimError::Admission {
                            order: order_name,
                            source,
                        })?;
                rooms.push(Room {
                    room: AdmissionRoom::new(order, config.clone()),
                    requests: HashMap::new(),
                    ticking: false,
                });
            }
        }
        Ok(Router {
            policy: cell.policy,
            ids,
            policies,
            oracle_rng: SmallRng::seed_from_u64(mix(cell.seed ^ 0x0000_ac1e)),
            replica_rng: SmallRng::seed_from_u64(mix(cell.seed ^ 0x4e_911ca)),
            first_replica_share: cell.router.first_replica_share,
            converters: (0..replicas * workers)
                .map(|_| Default::default())
                .collect(),
            dispatches: vec![None; cell.requests.len()],
            spare,
            rooms,
        })
    }

    fn is_reference(&self) -> bool {
        self.policies.is_empty()
    }

    /// A reference's pick for a request: `request` builds it for one
    /// engine's parameters.
    fn reference_pick(
        &mut self,
        request: impl Fn(&EngineParams) -> (EngineRequest, Arc<[u64]>),
        engines: &[Engine],
        now_s: f64,
    ) -> usize {
        match self.policy {
            PolicyName::LeastTrueQueue => least_true_queue_pick(engines, &mut self.oracle_rng),
            _ => oracle_pick(engines, now_s, request, &mut self.oracle_rng),
        }
    }

    /// The replica an arrival goes to: drawn at random (the same draw for
    /// every policy), the first with its share if set.
    fn pick_replica(&mut self) -> usize {
        draw_replica(
            &mut self.replica_rng,
            self.policies.len(),
            self.first_replica_share,
        )
    }

    /// Notes replica `replica`'s dispatch of request `id`; returns its worker.
    fn dispatched(&mut self, id: usize, replica: usize, dispatch: Dispatch) -> usize {
        let worker = dispatch.worker.slot().min(self.ids.len() - 1);
        self.dispatches[id] = Some((replica as u32, dispatch));
        worker
    }

    /// Whether no request waits in any replica's room.
    fn rooms_empty(&self) -> bool {
        self.rooms.iter().all(|room| room.room.is_empty())
    }

    /// The replica and policy that dispatched request `id`, and its
    /// dispatch (none for the references).
    fn dispatch(&self, id: u64) -> Option<(usize, &dyn Policy, &Dispatch)> {
        let (replica, dispatch) = self.dispatches.get(id as usize)?.as_ref()?;
        let replica = *replica as usize;
        Some((replica, self.policies[replica].as_ref(), dispatch))
    }
}

/// A replica's pending work on a worker may have changed: the sync channel
/// shares it now (ideal), or publishes it if it grew (`publish_dispatches`),
/// scheduling its delivery; such a message carries the replica's room
/// too, into `room_reports`.
fn sync_changed(
    sync: &mut Option<SyncChannel>,
    router: &Router,
    queue: &mut Queue,
    room_reports: &mut [VecDeque<(f64, RoomReport)>],
    (replica, worker): (usize, usize),
    now_s: f64,
    now: Instant,
) {
    if let Some(sync) = sync
        && let Some(arrives_s) =
            sync.changed(replica, worker, &router.policies, &router.ids, now_s, now)
    {
        queue.push(arrives_s, Kind::SyncDeliver);
        if let (Some(room), Some(reports)) =
            (router.rooms.get(replica), room_reports.get_mut(replica))
        {
            reports.push_back((arrives_s, room.room.report(now)));
        }
    }
}

/// Every replica's first poll of every worker, at its phase in the interval.
fn schedule_first_polls(cell: &Cell<'_>, queue: &mut Queue) {
    let interval_s = cell.router.poll_interval_s;
    let mut phase_rng = SmallRng::seed_from_u64(mix(cell.seed ^ 0x9a_5e));
    let replica_offsets = offsets(
        cell.router.replica_phase,
        cell.router.replicas as usize,
        interval_s,
        &mut phase_rng,
    );
    let worker_offsets = offsets(
        cell.router.worker_phase,
        cell.workers.len(),
        interval_s,
        &mut phase_rng,
    );
    for (replica, replica_offset) in replica_offsets.iter().enumerate() {
        for (worker, worker_offset) in worker_offsets.iter().enumerate() {
            let first_s = (replica_offset + worker_offset) % interval_s;
            queue.push(
                first_s,
                Kind::PollSend {
                    replica: replica as u32,
                    worker: worker as u32,
                },
            );
        }
    }
}

/// What an admission room knows of a request: its priority, tenant
/// (`""` when none), deadline and prompt size.
fn arrival_of(spec: &RequestSpec) -> Arrival {
    Arrival {
        priority: spec.priority,
        tenant: spec.tenant.clone().unwrap_or_else(|| Arc::from("")),
        ttft_deadline: spec
            .ttft_deadline_s
            .and_then(|secs| Duration::try_from_secs_f64(secs).ok()),
        work_tokens: u64::from(spec.prompt_tokens),
    }
}

/// Request `id` as an engine of these parameters receives it at `now_s`,
/// and its chain there: the router's for engines of its block size, hashed
/// at their own for the others.
fn engine_request(
    cell: &Cell<'_>,
    id: usize,
    chain: &Arc<[u64]>,
    params: &EngineParams,
    now_s: f64,
) -> (EngineRequest, Arc<[u64]>) {
    let spec = &cell.requests[id];
    let request = EngineRequest {
        id: id as u64,
        prompt_tokens: spec.prompt_tokens,
        output_tokens: spec.output_tokens,
        arrival_s: now_s,
        prefix_block_hashes: Vec::new(),
    };
    if params.block_size_tokens == router_block_tokens(cell.workers) {
        (request, chain.clone())
    } else {
        let own_chain = spec
            .chained_block_hashes(cell.shared_prefix, params.block_size_tokens)
            .into();
        (request, own_chain)
    }
}

/// One cell in progress: the event queue, what its events act on, and what
/// it measures.
struct CellRun<'a> {
    cell: Cell<'a>,
    clock: Clock,
    queue: Queue,
    fleet: Fleet,
    router: Router,
    /// The next request to arrive.
    next_arrival: usize,
    records: Vec<RequestRecord>,
    /// Work routed to each worker, in that worker's own seconds.
    routed_work_s: Vec<f64>,
    poll_failures: u64,
    /// Reused for each step's events.
    scratch: Vec<EngineEvent>,
    /// The policies' rate for the slowed worker (cells with a slowdown).
    rate_trace: Option<RateTrace>,
    /// The request the rate samples are explained for: the cell's mean prompt.
    probe: RequestInfo,
    /// The replicas' sync channel (several replicas with sync on).
    sync: Option<SyncChannel>,
    /// `[replica]`: the room reports it published at its sync ticks, each
    /// with when the others hear of it, oldest first (periodic sync).
    room_reports: Vec<VecDeque<(f64, RoomReport)>>,
    /// The prompt tokens the dispatching policies expected the engines'
    /// prefix caches to serve, over the finished requests.
    predicted_cached_tokens: u64,
    /// Blocks a restarted replica loaded from another's snapshot.
    restart_snapshot_blocks: usize,
    /// Each request turned away by an admission room: why, and how long
    /// after its arrival.
    rejections: Vec<Option<(RejectReason, f64)>>,
    /// How many were.
    rejected: usize,
    /// The router arrival time of each request a room released, until it
    /// finishes (its engine saw it arrive at its release).
    waited_from_s: HashMap<usize, f64>,
    /// Sessions that ended at a turned-away turn ([`Cell::turned_away_ends_session`]).
    ended_sessions: HashSet<u64>,
    /// Requests not sent: their session had ended.
    unsent: Vec<bool>,
    /// How many were.
    unsent_count: usize,
    /// Since when a room has waited with nothing to release (see
    /// [`STUCK_AFTER_S`]).
    stuck_since_s: Option<f64>,
}

impl<'a> CellRun<'a> {
    /// Engines, policies, and the first events: every poll's first round,
    /// then the first arrival.
    fn new(cell: &Cell<'a>, registry: &PolicyRegistry) -> Result<CellRun<'a>, SimError> {
        let clock = Clock {
            base: Instant::now(),
        };
        let fleet = Fleet::new(cell)?;
        let router = Router::new(cell, registry)?;
        let mut queue = Queue::default();
        let mut sync = None;
        if !router.is_reference() {
            schedule_first_polls(cell, &mut queue);
            sync = SyncChannel::new(
                cell.router.sync,
                router.policies.len(),
                cell.workers.len(),
                mix(cell.seed ^ 0x5_c7a7),
            );
            if let Some(channel) = &sync {
                for (replica, &first_s) in channel.first_ticks_s().iter().enumerate() {
                    queue.push(
                        first_s,
                        Kind::SyncTick {
                            replica: replica as u32,
                        },
                    );
                }
            }
        }
        if let Some(restart) = cell.restart
            && router.spare.is_some()
        {
            queue.push(restart.at_s, Kind::Restart);
        }
        if let Some(first) = cell.requests.first() {
            queue.push(first.arrival_s, Kind::Arrival);
        }
        let mut rate_trace = None;
        if let Some(slowdown) = cell.slowdown {
            if slowdown.worker >= cell.workers.len() {
                return Err(SimError::Invalid {
                    scenario: String::new(),
                    field: "slowdown.worker".into(),
                    message: format!("no worker {} in this fleet", slowdown.worker),
                });
            }
            queue.push(slowdown.at_s, Kind::Slowdown);
            if !router.is_reference() {
                queue.push(0.0, Kind::RateSample);
                rate_trace = Some(RateTrace {
                    worker: slowdown.worker,
                    slowdown_at_s: slowdown.at_s,
                    samples: Vec::new(),
                });
            }
        }
        let mean_prompt = if cell.requests.is_empty() {
            1
        } else {
            let total: u64 = cell
                .requests
                .iter()
                .map(|spec| u64::from(spec.prompt_tokens))
                .sum();
            (total / cell.requests.len() as u64).max(1)
        };
        Ok(CellRun {
            cell: *cell,
            clock,
            queue,
            fleet,
            router,
            next_arrival: 0,
            records: Vec::with_capacity(cell.requests.len()),
            routed_work_s: vec![0.0; cell.workers.len()],
            poll_failures: 0,
            scratch: Vec::new(),
            rate_trace,
            probe: RequestInfo::new(TokenCount::Exact(mean_prompt)),
            sync,
            room_reports: vec![VecDeque::new(); cell.router.replicas as usize],
            predicted_cached_tokens: 0,
            restart_snapshot_blocks: 0,
            rejections: vec![None; cell.requests.len()],
            rejected: 0,
            waited_from_s: HashMap::new(),
            ended_sessions: HashSet::new(),
            unsent: vec![false; cell.requests.len()],
            unsent_count: 0,
            stuck_since_s: None,
        })
    }

    /// Handles events in time order until every request has finished, or
    /// none is left.
    fn run_events(&mut self) -> Result<(), SimError> {
        while self.ended() < self.cell.requests.len() {
            let Some(event) = self.queue.heap.pop() else {
                break;
            };
            let now_s = event.time_s;
            match event.kind {
                Kind::Arrival => self.arrive(now_s)?,
                Kind::StepEnd { worker, generation } => {
                    if self.fleet.generation[worker as usize] == generation {
                        self.end_step(worker as usize, now_s)?;
                    }
                }
                Kind::PollSend { replica, worker } => self.send_poll(replica, worker, now_s)?,
                Kind::PollDone {
                    replica,
                    worker,
                    reply,
                } => {
                    self.complete_poll(
                        replica as usize,
                        worker as usize,
                        reply.mark,
                        reply.snapshot,
                        now_s,
                    );
                    self.release(replica as usize, now_s)?;
                }
                Kind::AdmissionTick { replica } => self.admission_tick(replica as usize, now_s)?,
                Kind::Slowdown => self.slow_down(now_s)?,
                Kind::RateSample => self.sample_rates(now_s),
                Kind::Restart => self.restart(now_s),
                Kind::SyncTick { replica } => self.sync_tick(replica, now_s),
                Kind::SyncDeliver => {
                    if let Some(sync) = &mut self.sync {
                        sync.deliver(&self.router.policies, self.clock.at(now_s));
                    }
                    // A replica releases when it hears of the others' work,
                    // as on its own.
                    for replica in 0..self.router.rooms.len() {
                        self.release(replica, now_s)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Each request's chained block hashes at the router's block size.
    fn chain(&self, id: usize) -> Arc<[u64]> {
        match self.cell.chains.get(id) {
            Some(chain) => chain.clone(),
            None => self.cell.requests[id]
                .chained_block_hashes(
                    self.cell.shared_prefix,
                    router_block_tokens(self.cell.workers),
                )
                .into(),
        }
    }

    /// What a policy knows of request `id`: its exact size, and (not for
    /// the references) its prefix blocks. Every simulated request is
    /// measured at its first token, as a stream is.
    fn request_info(&self, id: usize, chain: &Arc<[u64]>) -> RequestInfo {
        let spec = &self.cell.requests[id];
        let info =
            RequestInfo::new(TokenCount::Exact(u64::from(spec.prompt_tokens))).streaming(true);
        if self.router.is_reference() {
            return info;
        }
        let block_tokens = router_block_tokens(self.cell.workers);
        info.prefix_blocks(PrefixBlocks::new(block_tokens, chain.clone()))
    }

    /// Arrival: a reference picks a worker at once; a replica's policy
    /// routes the request, through its admission room when it has one.
    /// Schedules the next arrival.
    fn arrive(&mut self, now_s: f64) -> Result<(), SimError> {
        let id = self.next_arrival;
        self.next_arrival += 1;
        if let Some(next) = self.cell.requests.get(self.next_arrival) {
            self.queue.push(next.arrival_s.max(now_s), Kind::Arrival);
        }
        if let Some(session) = self.cell.requests.get(id).and_then(RequestSpec::session)
            && self.ended_sessions.contains(&session)
        {
            if let Some(unsent) = self.unsent.get_mut(id) {
                *unsent = true;
                self.unsent_count += 1;
            }
            return Ok(());
        }
        // Chained once: for the policy's prefix index and the engines.
        let chain = self.chain(id);
        let now = self.clock.at(now_s);
        let info = self.request_info(id, &chain);
        let worker = match self.router.policy {
            PolicyName::Oracle | PolicyName::LeastTrueQueue => {
                // The references read every engine's state at this instant.
                self.fleet.advance_all(now_s);
                let cell = self.cell;
                let request =
                    |params: &EngineParams| engine_request(&cell, id, &chain, params, now_s);
                self.router
                    .reference_pick(request, &self.fleet.engines, now_s)
            }
            _ => {
                let replica = self.router.pick_replica();
                if !self.router.rooms.is_empty() {
                    self.admit(id, replica, &chain, &info, now_s)?;
                    return self.release(replica, now_s);
                }
                let dispatch = self.router.policies[replica]
                    .select(&self.router.ids, &info, now)
                    .ok_or(SimError::NoWorker {
                        policy: self.router.policy.as_str(),
                        request: id as u64,
                    })?;
                self.router.dispatched(id, replica, dispatch)
            }
        };
        self.submit(id, worker, &chain, &info, now_s)
    }

    /// Request `id` as an engine of these parameters receives it at
    /// `now_s`, and its chain there: the router's for engines of its block
    /// size, hashed at their own for the others.
    fn engine_request(
        &self,
        id: usize,
        chain: &Arc<[u64]>,
        params: &EngineParams,
        now_s: f64,
    ) -> (EngineRequest, Arc<[u64]>) {
        engine_request(&self.cell, id, chain, params, now_s)
    }

    /// Sends request `id` to `worker` now (which starts a step if idle),
    /// sharing the dispatch with the other replicas.
    fn submit(
        &mut self,
        id: usize,
        worker: usize,
        chain: &Arc<[u64]>,
        info: &RequestInfo,
        now_s: f64,
    ) -> Result<(), SimError> {
        let now = self.clock.at(now_s);
        if let Some((replica, _)) = self.router.dispatches[id] {
            // Where the prompt went, for the other replicas' prefix indexes:
            // before the dispatch's own sync message, which carries it.
            if let Some(sync) = &mut self.sync
                && sync.is_active()
                && let Some(prefix) = self.router.policies[replica as usize].placement(info)
            {
                sync.placed(replica as usize, worker, prefix, &self.router.policies, now);
            }
            sync_changed(
                &mut self.sync,
                &self.router,
                &mut self.queue,
                &mut self.room_reports,
                (replica as usize, worker),
                now_s,
                now,
            );
        }
        let spec = &self.cell.requests[id];
        let params = self.fleet.engines[worker].params();
        self.routed_work_s[worker] += f64::from(spec.prompt_tokens) / params.prefill_tps
            + f64::from(spec.output_tokens) * params.decode_per_req_ms / 1000.0;
        let (submitted, chain) = self.engine_request(id, chain, params, now_s);
        self.fleet.engines[worker].submit_shared(submitted, chain)?;
        if self.fleet.stepping[worker] {
            self.fleet.reschedule_step_end(worker, &mut self.queue);
        } else {
            self.fleet.start_step(worker, now_s, &mut self.queue);
        }
        Ok(())
    }

    /// What the admission room knows of request `id`.
    fn arrival(&self, id: usize) -> Arrival {
        arrival_of(&self.cell.requests[id])
    }

    /// An arrival at a replica with an admission room, as the router
    /// admits it: dispatched now (or queued when the policy finds every
    /// worker capped), queued, or turned away at once.
    fn admit(
        &mut self,
        id: usize,
        replica: usize,
        chain: &Arc<[u64]>,
        info: &RequestInfo,
        now_s: f64,
    ) -> Result<(), SimError> {
        let now = self.clock.at(now_s);
        let arrival = self.arrival(id);
        self.tell_peers(replica, now_s);
        let policy = &self.router.policies[replica];
        let room = &mut self.router.rooms[replica];
        let within_secs = room.room.lowest_threshold().as_secs_f64();
        let expected = Expected {
            fleet: policy.expected_wait_within(&self.router.ids, info, now, within_secs),
            chosen: room
                .room
                .has_deadline(&arrival)
                .then(|| policy.preview(&self.router.ids, info, now))
                .flatten()
                .map(|(_, wait)| wait),
        };
        let decision = match room.room.arrive(&arrival, expected, now) {
            Decision::DispatchNow => match policy.select(&self.router.ids, info, now) {
                Some(dispatch) => {
                    room.room.dispatched(&arrival, now);
                    room.room
                        .sent(expected.fleet, &dispatch, self.router.ids.len(), now);
                    let worker = self.router.dispatched(id, replica, dispatch);
                    return self.submit(id, worker, chain, info, now_s);
                }
                None => room.room.enqueue(&arrival, expected, now),
            },
            decision => decision,
        };
        match decision {
            Decision::Queued(ticket) => {
                room.requests.insert(ticket, (id, now_s));
            }
            Decision::Rejected(rejection) => self.reject(id, rejection.reason, 0.0),
            // Not reachable: a room answers a request it queues (`enqueue`)
            // with Queued or Rejected.
            Decision::DispatchNow => {
                return Err(SimError::NoWorker {
                    policy: self.router.policy.as_str(),
                    request: id as u64,
                });
            }
        }
        Ok(())
    }

    /// Requests that reached their end: served, turned away or not sent.
    fn ended(&self) -> usize {
        self.records.len() + self.rejected + self.unsent_count
    }

    /// Request `id` is turned away, `after_s` after its arrival.
    fn reject(&mut self, id: usize, reason: RejectReason, after_s: f64) {
        if self.cell.turned_away_ends_session
            && let Some(session) = self.cell.requests.get(id).and_then(RequestSpec::session)
        {
            self.ended_sessions.insert(session);
        }
        if let Some(slot) = self.rejections.get_mut(id) {
            *slot = Some((reason, after_s));
            self.rejected += 1;
        }
    }

    /// Tells replica `replica`'s room of the other replicas' rooms as the
    /// sync channel carries them: at once with the ideal sync; as each
    /// published them at its last tick heard of, after the channel's
    /// latency, with a periodic sync (the router publishes its room with
    /// every message, so as often or more); not at all without sync.
    fn tell_peers(&mut self, replica: usize, now_s: f64) {
        let Some(sync) = &self.sync else {
            return;
        };
        if self.router.rooms.len() < 2 {
            return;
        }
        let now = self.clock.at(now_s);
        let mut reports = Vec::with_capacity(self.router.rooms.len() - 1);
        for other in (0..self.router.rooms.len()).filter(|&other| other != replica) {
            if sync.is_ideal() {
                reports.push(self.router.rooms[other].room.report(now));
                continue;
            }
            let heard = &mut self.room_reports[other];
            while heard.get(1).is_some_and(|(at_s, _)| *at_s <= now_s) {
                heard.pop_front();
            }
            if let Some((at_s, report)) = heard.front()
                && *at_s <= now_s
            {
                reports.push(report.clone());
            }
        }
        self.router.rooms[replica]
            .room
            .set_peers(Some(RoomReport::combine(reports)));
    }

    /// Work completed at a replica, or a request arrived, or its tick came:
    /// while the fleet has room, its room's head goes to the worker the
    /// policy picks now (late binding). Ticks every [`ADMISSION_TICK_S`]
    /// while any waits.
    fn release(&mut self, replica: usize, now_s: f64) -> Result<(), SimError> {
        if self
            .router
            .rooms
            .get(replica)
            .is_none_or(|room| room.room.is_empty())
        {
            return Ok(());
        }
        let now = self.clock.at(now_s);
        self.tell_peers(replica, now_s);
        'passes: loop {
            let turns = self.router.rooms[replica].room.release_order();
            let mut released = false;
            // Once the fleet has no room (or this replica leaves it to
            // another), only requests that pass, or whose deadline is
            // near, go.
            let mut fleet_full = false;
            for turn in turns {
                if fleet_full && !turn.goes_without_fleet_room() {
                    continue;
                }
                let ticket = turn.ticket;
                let room = &mut self.router.rooms[replica];
                let Some(&(id, arrived_s)) = room.requests.get(&ticket) else {
                    // Not reachable: every queued ticket is recorded. Dropped
                    // rather than left to block the queue.
                    room.room.remove(ticket);
                    continue;
                };
                let chain = self.chain(id);
                let info = self.request_info(id, &chain);
                let policy = &self.router.policies[replica];
                let room = &mut self.router.rooms[replica];
                let ids = &self.router.ids;
                let within_secs = room.room.lowest_threshold().as_secs_f64();
                if !turn.goes_without_fleet_room()
                    && (!room.room.has_room(policy.expected_wait_within(
                        ids,
                        &info,
                        now,
                        within_secs,
                    )) || room.room.yields_to_peers(now))
                {
                    fleet_full = true;
                    continue;
                }
                let preview = policy.preview(ids, &info, now);
                let at_worker = preview.map(|(_, wait)| wait);
                let dispatch = match room.room.route(&turn, preview, now) {
                    Route::Chosen => policy.select(ids, &info, now),
                    Route::Wait => continue,
                    Route::WithRoom => {
                        let open: Vec<WorkerId> = ids
                            .iter()
                            .copied()
                            .filter(|id| {
                                !room.room.peer_waits_for(*id, now)
                                    && room.room.has_room(policy.expected_wait(&[*id], &info, now))
                            })
                            .collect();
                        policy.select(if open.is_empty() { ids } else { &open }, &info, now)
                    }
                };
                let Some(dispatch) = dispatch else {
                    break 'passes;
                };
                room.room.take(ticket, now);
                room.room.sent(at_worker, &dispatch, ids.len(), now);
                room.requests.remove(&ticket);
                self.waited_from_s.insert(id, arrived_s);
                let worker = self.router.dispatched(id, replica, dispatch);
                self.submit(id, worker, &chain, &info, now_s)?;
                released = true;
            }
            if !released {
                break;
            }
        }
        let room = &mut self.router.rooms[replica];
        if !room.room.is_empty() && !room.ticking {
            room.ticking = true;
            self.queue.push(
                now_s + ADMISSION_TICK_S,
                Kind::AdmissionTick {
                    replica: replica as u32,
                },
            );
        }
        Ok(())
    }

    /// Turns away the requests waiting in a replica's room that can no
    /// longer meet their deadline: passed, or missed even if dispatched now
    /// at the least busy worker (the policy's expected wait for a request of
    /// unknown size, as the router asks it).
    fn shed(&mut self, replica: usize, now_s: f64) {
        let now = self.clock.at(now_s);
        let expected = self.router.policies[replica].expected_wait(
            &self.router.ids,
            &RequestInfo::new(TokenCount::Unknown),
            now,
        );
        let Some(room) = self.router.rooms.get_mut(replica) else {
            return;
        };
        let mut turned_away = Vec::new();
        for shed in room.room.shed(expected, now) {
            if let Some((id, _)) = room.requests.remove(&shed.ticket) {
                turned_away.push((id, shed.rejection.reason, shed.waited.as_secs_f64()));
            }
        }
        for (id, reason, after_s) in turned_away {
            self.reject(id, reason, after_s);
        }
    }

    /// A replica's admission tick, as the router's ticker: the waiting
    /// requests' deadlines are checked, then the room released; the next
    /// tick comes while any request waits. A room that waits with nothing
    /// left to arrive, every engine idle and nothing released for
    /// [`STUCK_AFTER_S`] is stuck.
    fn admission_tick(&mut self, replica: usize, now_s: f64) -> Result<(), SimError> {
        let Some(room) = self.router.rooms.get_mut(replica) else {
            return Ok(());
        };
        room.ticking = false;
        self.shed(replica, now_s);
        let waiting = self.router.rooms[replica].room.len();
        self.release(replica, now_s)?;
        let idle = self.next_arrival >= self.cell.requests.len() && self.fleet.busy_engines == 0;
        if idle && self.router.rooms[replica].room.len() == waiting {
            let since_s = *self.stuck_since_s.get_or_insert(now_s);
            if now_s - since_s > STUCK_AFTER_S {
                return Err(SimError::Stalled {
                    finished: self.records.len(),
                    total: self.cell.requests.len(),
                });
            }
        } else {
            self.stuck_since_s = None;
        }
        Ok(())
    }

    /// A step's end: the dispatching policies see first tokens and finishes,
    /// finished requests are recorded, and the engine starts its next step.
    fn end_step(&mut self, worker: usize, now_s: f64) -> Result<(), SimError> {
        self.fleet.end_step(worker, &mut self.scratch);
        let now = self.clock.at(now_s);
        let requests = self.cell.requests;
        // The replicas whose rooms release after these events, in order.
        let mut release = Vec::new();
        for engine_event in self.scratch.drain(..) {
            match engine_event {
                EngineEvent::FirstToken { id, .. } => {
                    if let Some((replica, policy, dispatch)) = self.router.dispatch(id) {
                        if !self.router.rooms.is_empty() && !release.contains(&replica) {
                            release.push(replica);
                        }
                        // With the ideal sync the others hear of it at once,
                        // and release as they would on the message.
                        if self.sync.as_ref().is_some_and(SyncChannel::is_ideal) {
                            for other in 0..self.router.rooms.len() {
                                if !release.contains(&other) {
                                    release.push(other);
                                }
                            }
                        }
                        if let Some(sample) = policy.first_token(dispatch, now)
                            && let Some(sync) = &mut self.sync
                            && sync.is_active()
                        {
                            sync.prefill_sample(
                                replica,
                                worker,
                                sample,
                                &self.router.policies,
                                now,
                            );
                        }
                        sync_changed(
                            &mut self.sync,
                            &self.router,
                            &mut self.queue,
                            &mut self.room_reports,
                            (replica, worker),
                            now_s,
                            now,
                        );
                    }
                }
                EngineEvent::Finished(mut record) => {
                    if !self.waited_from_s.is_empty()
                        && let Some(arrived_s) = self.waited_from_s.remove(&(record.id as usize))
                    {
                        // It arrived at the router before the engine saw it.
                        record.arrival_s = arrived_s;
                    }
                    if let Some((replica, policy, dispatch)) = self.router.dispatch(record.id) {
                        self.predicted_cached_tokens += dispatch.cached_tokens;
                        // The engine's usage (prompt tokens its prefix cache
                        // served) comes with the response's end, before the
                        // router releases the request.
                        if let Some(cache_tokens) =
                            policy.cache_report(dispatch, u64::from(record.cached_tokens), now)
                            && let Some(sync) = &mut self.sync
                            && sync.is_active()
                        {
                            sync.cache_bound(
                                replica,
                                worker,
                                cache_tokens,
                                &self.router.policies,
                                now,
                            );
                        }
                        policy.finish(dispatch, now);
                        sync_changed(
                            &mut self.sync,
                            &self.router,
                            &mut self.queue,
                            &mut self.room_reports,
                            (replica, worker),
                            now_s,
                            now,
                        );
                        if let (Some(room), Some(spec)) = (
                            self.router.rooms.get_mut(replica),
                            requests.get(record.id as usize),
                        ) {
                            let classified = room.room.classify(&arrival_of(spec));
                            room.room.finished(
                                &classified.class,
                                &classified.tenant,
                                u64::from(record.output_tokens),
                            );
                            if !release.contains(&replica) {
                                release.push(replica);
                            }
                        }
                    }
                    self.records.push(record);
                }
                EngineEvent::Token { .. } => {}
            }
        }
        self.fleet.start_step(worker, now_s, &mut self.queue);
        for replica in release {
            self.release(replica, now_s)?;
        }
        Ok(())
    }

    /// A replica polls a worker: its policy notes the poll, the report is
    /// taken now (or at completion) and arrives `poll_latency_s` later, and
    /// the next poll is scheduled. Polls go on forever, so a poll with no
    /// request left to arrive and no engine busy means the cell is stuck.
    fn send_poll(&mut self, replica: u32, worker: u32, now_s: f64) -> Result<(), SimError> {
        let total = self.cell.requests.len();
        if self.next_arrival >= total && self.fleet.busy_engines == 0 && self.router.rooms_empty() {
            return Err(SimError::Stalled {
                finished: self.records.len(),
                total,
            });
        }
        let (r, w) = (replica as usize, worker as usize);
        let mark = self.router.policies[r].poll_started(self.router.ids[w], self.clock.at(now_s));
        let snapshot = match self.cell.router.report_at {
            ReportAt::Send => {
                self.fleet.engines[w].advance_to(now_s);
                Some(self.fleet.engines[w].snapshot(now_s))
            }
            ReportAt::Completion => None,
        };
        self.queue.push(
            now_s + self.cell.router.poll_latency_s,
            Kind::PollDone {
                replica,
                worker,
                reply: Box::new(PollReply { mark, snapshot }),
            },
        );
        self.queue.push(
            now_s + self.cell.router.poll_interval_s,
            Kind::PollSend { replica, worker },
        );
        Ok(())
    }

    /// A poll completes: the report, converted by the worker's backend,
    /// reaches the replica's policy, or the poll fails.
    fn complete_poll(
        &mut self,
        replica: usize,
        worker: usize,
        mark: PollMark,
        snapshot: Option<EngineSnapshot>,
        now_s: f64,
    ) {
        let snapshot = snapshot.unwrap_or_else(|| {
            let engine = &mut self.fleet.engines[worker];
            engine.advance_to(now_s);
            engine.snapshot(now_s)
        });
        let observed = self.clock.at(now_s);
        let policy = &self.router.policies[replica];
        let converter = &mut self.router.converters[replica * self.cell.workers.len() + worker];
        match convert_report(self.cell.workers[worker].0, &snapshot, converter, observed) {
            Ok(Some(load)) => {
                let load = load.observed_at(observed);
                policy.poll_completed(mark, Some(&load), observed);
            }
            Ok(None) => policy.poll_completed(mark, None, observed),
            Err(_) => {
                self.poll_failures += 1;
                policy.poll_failed(mark, observed);
            }
        }
    }

    /// A replica's sync publish tick: its message (if any) is scheduled for
    /// delivery, and its next tick one publish interval later, as long as
    /// the policy counts other replicas.
    fn sync_tick(&mut self, replica: u32, now_s: f64) {
        let Some(sync) = &mut self.sync else {
            return;
        };
        let now = self.clock.at(now_s);
        if let (Some(room), Some(latency_s)) =
            (self.router.rooms.get(replica as usize), sync.latency_s())
        {
            self.room_reports[replica as usize]
                .push_back((now_s + latency_s, room.room.report(now)));
        }
        if let Some(arrives_s) = sync.tick(
            replica as usize,
            &self.router.policies,
            &self.router.ids,
            now_s,
            now,
        ) {
            self.queue.push(arrives_s, Kind::SyncDeliver);
        }
        if sync.is_active()
            && let Some(interval_s) = sync.publish_interval_s()
        {
            self.queue
                .push(now_s + interval_s, Kind::SyncTick { replica });
        }
    }

    /// The slowed worker's engine changes speed.
    fn slow_down(&mut self, now_s: f64) -> Result<(), SimError> {
        if let Some(slowdown) = self.cell.slowdown {
            // The steps started by now keep their durations.
            self.fleet.engines[slowdown.worker].advance_to(now_s);
            self.fleet.engines[slowdown.worker].set_speed(slowdown.factor)?;
            self.fleet
                .reschedule_step_end(slowdown.worker, &mut self.queue);
        }
        Ok(())
    }

    /// Reads every replica's rate for the slowed worker from its explain
    /// table, next to the engine's true prefill rate; the next sample comes
    /// one poll interval later, while requests are still to arrive.
    /// The restarting replica takes its fresh policy; with `warm`, that
    /// policy first loads the next replica's prefix snapshot. Dispatches
    /// the old policy made finish into the new one, which ignores them, as
    /// a restarted router never hears of its previous life's requests.
    fn restart(&mut self, now_s: f64) {
        let (Some(restart), Some(fresh)) = (self.cell.restart, self.router.spare.take()) else {
            return;
        };
        let now = self.clock.at(now_s);
        let replicas = self.router.policies.len();
        if restart.warm && replicas > 1 {
            let peer = (restart.replica + 1) % replicas;
            if let Some(snapshot) = self.router.policies[peer].prefix_snapshot(now) {
                self.restart_snapshot_blocks = fresh.load_prefix_snapshot(&snapshot, now);
            }
        }
        self.router.policies[restart.replica] = fresh;
    }

    /// The restarted replica's requests in the windows before and after
    /// its restart.
    fn restart_stats(&self) -> Option<RestartStats> {
        let restart = self.cell.restart?;
        if restart.replica >= self.router.policies.len() {
            return None;
        }
        let mut before = Vec::new();
        let mut after = Vec::new();
        for record in &self.records {
            let Some((replica, _)) = self.router.dispatches.get(record.id as usize)?.as_ref()
            else {
                continue;
            };
            if *replica as usize != restart.replica {
                continue;
            }
            let ttft_s = record.first_token_s - record.arrival_s;
            if (restart.at_s - restart.window_s..restart.at_s).contains(&record.arrival_s) {
                before.push(ttft_s);
            } else if (restart.at_s..restart.at_s + restart.window_s).contains(&record.arrival_s) {
                after.push(ttft_s);
            }
        }
        before.sort_by(f64::total_cmp);
        after.sort_by(f64::total_cmp);
        Some(RestartStats {
            replica: restart.replica,
            at_s: restart.at_s,
            warm: restart.warm,
            snapshot_blocks: self.restart_snapshot_blocks,
            before_p99_s: percentile(&before, 99.0),
            after_p99_s: percentile(&after, 99.0),
            before_requests: before.len(),
            after_requests: after.len(),
        })
    }

    fn sample_rates(&mut self, now_s: f64) {
        let Some(trace) = self.rate_trace.as_mut() else {
            return;
        };
        let id = self.router.ids[trace.worker];
        let now = self.clock.at(now_s);
        let estimates_tps = self
            .router
            .policies
            .iter()
            .map(|policy| {
                let table = policy.explain(&[id], &self.probe, now);
                table.value(id, RATE_COLUMN)
            })
            .collect();
        trace.samples.push(RateSample {
            time_s: now_s,
            true_prefill_tps: self.fleet.engines[trace.worker].params().prefill_tps,
            estimates_tps,
        });
        if self.next_arrival < self.cell.requests.len() {
            self.queue
                .push(now_s + self.cell.router.poll_interval_s, Kind::RateSample);
        }
    }

    /// The cell's statistics, once every request has finished.
    fn results(self) -> Result<CellStats, SimError> {
        let total = self.cell.requests.len();
        if self.ended() < total {
            return Err(SimError::Stalled {
                finished: self.records.len(),
                total,
            });
        }
        let outcomes = self.outcomes()?;
        let preemptions = self
            .fleet
            .engines
            .iter()
            .map(|engine| engine.snapshot(0.0).preemptions_total)
            .sum();
        let mut stats = summarize(
            &self.records,
            &self.routed_work_s,
            preemptions,
            self.poll_failures,
        );
        stats.sync = self.sync.as_ref().map(SyncChannel::stats);
        stats.predicted_cached_tokens = self.predicted_cached_tokens;
        stats.restart = self.restart_stats();
        stats.rate_trace = self.rate_trace.filter(|trace| {
            trace
                .samples
                .iter()
                .any(|sample| sample.estimates_tps.iter().any(Option::is_some))
        });
        stats.outcomes = Some(outcomes);
        Ok(stats)
    }

    /// What became of every request: served (TTFT from its arrival at the
    /// router) or turned away. A request's deadline is its own, or its
    /// class's in the scenario's admission room.
    fn outcomes(&self) -> Result<CellOutcomes, SimError> {
        let requests = self.cell.requests;
        let mut outcomes: Vec<Option<Outcome>> = self
            .rejections
            .iter()
            .map(|rejection| {
                rejection.map(|(reason, after_s)| Outcome::Rejected { reason, after_s })
            })
            .collect();
        for record in &self.records {
            if let Some(outcome) = outcomes.get_mut(record.id as usize) {
                *outcome = Some(Outcome::Served {
                    ttft_s: record.ttft_s(),
                    finish_s: record.finish_s,
                });
            }
        }
        for (outcome, &unsent) in outcomes.iter_mut().zip(&self.unsent) {
            if unsent {
                *outcome = Some(Outcome::Unsent);
            }
        }
        let classifier = match self.cell.room {
            Some(config) => {
                let order = admission::registry()
                    .build(admission::FIFO, &serde_json::Value::Null)
                    .map_err(|source| SimError::Admission {
                        order: admission::FIFO,
                        source,
                    })?;
                Some(AdmissionRoom::new(order, config.clone()))
            }
            None => None,
        };
        let deadline_s = |id: usize| {
            let spec = requests.get(id)?;
            match &classifier {
                Some(room) => room
                    .classify(&arrival_of(spec))
                    .ttft_deadline
                    .map(|deadline| deadline.as_secs_f64()),
                None => spec.ttft_deadline_s,
            }
        };
        Ok(cell_outcomes(requests, &outcomes, deadline_s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scenario::{AdmissionOrder, RouterPoint, SyncConfig};
    use crate::workload::Segment;

    #[test]
    fn arrivals_split_between_replicas_as_configured() {
        let mut rng = SmallRng::seed_from_u64(7);
        let counts = |rng: &mut SmallRng, replicas, share| {
            let mut counts = vec![0u32; replicas];
            for _ in 0..40_000 {
                counts[draw_replica(rng, replicas, share)] += 1;
            }
            counts
        };
        assert_eq!(counts(&mut rng, 1, Some(0.9)), [40_000]);
        for count in counts(&mut rng, 4, None) {
            assert!((9_500..10_500).contains(&count), "{count}");
        }
        let skewed = counts(&mut rng, 3, Some(0.75));
        assert!((29_500..30_500).contains(&skewed[0]), "{skewed:?}");
        for count in &skewed[1..] {
            assert!((4_700..5_300).contains(count), "{skewed:?}");
        }
    }

    fn router() -> RouterPoint {
        RouterPoint {
            poll_interval_s: 1.0,
            stale_after_s: 3.0,
            poll_latency_s: 0.0,
            replicas: 1,
            replica_phase: PhaseMode::Spread,
            first_replica_share: None,
            worker_phase: PhaseMode::Aligned,
            report_at: ReportAt::Send,
            sweeps_poll_interval: false,
            sweeps_replicas: false,
            sync: SyncConfig::Off {},
            sweeps_sync: false,
            admission: AdmissionOrder::Off,
            sweeps_admission: false,
        }
    }

    fn params() -> EngineParams {
        EngineParams {
            prefill_tps: 1000.0,
            prefill_chunk_tokens: 100_000,
            decode_base_ms: 0.0,
            decode_per_req_ms: 0.0,
            min_step_ms: 1.0,
            prefix_cache: false,
            ..EngineParams::default()
        }
    }

    #[test]
    fn least_true_queue_picks_the_least_true_prefill_seconds_ties_at_random() {
        let slow = EngineParams {
            prefill_tps: 500.0,
            ..params()
        };
        let mut engines = vec![
            Engine::new(params(), 1).unwrap(),
            Engine::new(slow, 2).unwrap(),
            Engine::new(params(), 3).unwrap(),
        ];
        let mut rng = SmallRng::seed_from_u64(1);
        // Idle fleet: a uniform tie.
        let mut counts = [0u32; 3];
        for _ in 0..3000 {
            counts[least_true_queue_pick(&engines, &mut rng)] += 1;
        }
        assert!(
            counts.iter().all(|&c| (850..1150).contains(&c)),
            "{counts:?}"
        );
        // 400 tokens on the fast worker 0 (0.4 s) and 300 on the slow worker
        // 1 (0.6 s): worker 2, idle, wins; then with worker 2 at 500 tokens
        // (0.5 s), worker 0 wins although worker 1 holds fewer tokens.
        let request = |id, prompt_tokens| EngineRequest {
            id,
            prompt_tokens,
            output_tokens: 1,
            arrival_s: 0.0,
            prefix_block_hashes: Vec::new(),
        };
        engines[0].submit(request(1, 400)).unwrap();
        engines[1].submit(request(2, 300)).unwrap();
        assert_eq!(least_true_queue_pick(&engines, &mut rng), 2);
        engines[2].submit(request(3, 500)).unwrap();
        assert_eq!(engines[1].queued_prefill_tokens(), 300);
        assert_eq!(least_true_queue_pick(&engines, &mut rng), 0);
    }

    #[test]
    fn the_oracle_picks_the_earliest_first_token_for_this_request() {
        let slow = EngineParams {
            prefill_tps: 250.0,
            ..params()
        };
        let mut engines = vec![
            Engine::new(params(), 1).unwrap(),
            Engine::new(slow, 2).unwrap(),
        ];
        let request = |id, prompt_tokens| EngineRequest {
            id,
            prompt_tokens,
            output_tokens: 1,
            arrival_s: 0.0,
            prefix_block_hashes: Vec::new(),
        };
        let mut rng = SmallRng::seed_from_u64(1);
        // 400 tokens queued on the fast worker 0 (0.4 s), the slow worker
        // idle. A 50-token request: 0.4 + 0.05 s on worker 0, 0.2 s on worker
        // 1: worker 1. A 500-token request: 0.9 s on worker 0, 2 s on worker 1:
        // worker 0, although least_true_queue sends it to the idle worker.
        engines[0].submit(request(1, 400)).unwrap();
        let pick = |engines: &[Engine], tokens, rng: &mut SmallRng| {
            oracle_pick(engines, 0.0, |_| (request(9, tokens), Arc::from([])), rng)
        };
        assert_eq!(pick(&engines, 50, &mut rng), 1);
        assert_eq!(pick(&engines, 500, &mut rng), 0);
        assert_eq!(least_true_queue_pick(&engines, &mut rng), 1);
        // The step under way counts: once worker 0 has planned its 0.4 s
        // step, least_true_queue sees no queue there, the oracle sees the
        // step end at 0.4 s.
        let mut events = Vec::new();
        engines[0].step(0.0, &mut events).unwrap();
        assert_eq!(engines[0].queued_prefill_tokens(), 0);
        assert_eq!(pick(&engines, 50, &mut rng), 1);
        // Idle twins tie: each is picked about half the time.
        let twins = vec![
            Engine::new(params(), 1).unwrap(),
            Engine::new(params(), 2).unwrap(),
        ];
        let mut counts = [0u32; 2];
        for _ in 0..2000 {
            counts[pick(&twins, 100, &mut rng)] += 1;
        }
        assert!(
            counts.iter().all(|&c| (900..1100).contains(&c)),
            "{counts:?}"
        );
    }

    /// Two identical workers at 1000 prompt tokens/s, one output token, no
    /// decode cost: requests of 1000, 100 and 100 tokens arrive at t = 0,
    /// 0.01 and 0.5 s.
    /// - Request 0 goes to an idle worker, A: one 1 s prefill step, TTFT 1.0.
    /// - Request 1: least_requests sees A with 1 in flight and B with 0;
    ///   least_load sees 1000 pending tokens on A: both pick B, TTFT 0.1.
    /// - Request 2: A is still busy; B has been idle since 0.11 s: B, TTFT 0.1.
    ///
    /// The oracle projects each request's first token: request 1 at 1.1 s on
    /// A (after A's 1 s step), 0.11 s on B: B; request 2 likewise: the same
    /// TTFTs.
    ///
    /// `least_true_queue` reads `queued_prefill_s`, where a step's prefill
    /// has left the queue when the step was planned: at 0.01 s A's running 1 s
    /// step shows 0 queued work, a tie with B broken at random. If it picks
    /// A, request 1 waits for A's step: TTFT 1.0 + 0.1 − 0.01 = 1.09, and
    /// request 2 then goes to B (100 queued tokens on A). Request 2 itself
    /// ties again (A's step is planned, B is idle): A gives TTFT 0.6.
    #[test]
    fn a_tiny_fleet_routes_as_worked_out_by_hand() {
        let workers = vec![
            (LoadReport::Sglang, params()),
            (LoadReport::Sglang, params()),
        ];
        let spec = |arrival_s, prompt_tokens| RequestSpec {
            arrival_s,
            prompt_tokens,
            output_tokens: 1,
            prefix_group: None,
            segments: None,
            priority: None,
            tenant: None,
            ttft_deadline_s: None,
        };
        let requests = vec![spec(0.0, 1000), spec(0.01, 100), spec(0.5, 100)];
        let registry = policy_registry();
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        for policy in [
            PolicyName::LeastRequests,
            PolicyName::LeastLoad,
            PolicyName::LeastTrueQueue,
            PolicyName::Oracle,
        ] {
            for seed in 0..8 {
                let cell = Cell {
                    workers: &workers,
                    requests: &requests,
                    chains: &[],
                    shared_prefix: None,
                    router: router(),
                    policy,
                    seed,
                    slowdown: None,
                    restart: None,
                    room: None,
                    turned_away_ends_session: false,
                };
                let stats = run_cell(&cell, &registry).unwrap();
                let ttft = &stats.ttft_sorted_s;
                assert_eq!(stats.requests, 3);
                if policy == PolicyName::LeastTrueQueue {
                    let possible = [[0.1, 0.1, 1.0], [0.1, 0.6, 1.0], [0.1, 1.0, 1.09]];
                    assert!(
                        possible
                            .iter()
                            .any(|p| p.iter().zip(ttft).all(|(x, y)| close(*x, *y))),
                        "{policy:?} {ttft:?}"
                    );
                } else {
                    let expected = [0.1, 0.1, 1.0];
                    assert!(
                        expected.iter().zip(ttft).all(|(x, y)| close(*x, *y)),
                        "{policy:?} {ttft:?}"
                    );
                }
            }
        }
    }

    /// [`overloaded_cell_stats`]'s cell as 40 sessions of 6 turns, request
    /// `i` a turn of session `i % 40` (so a session's turns are 2 s apart and
    /// share its priority), with the priority order's room.
    fn overloaded_sessions_stats(turned_away_ends_session: bool) -> CellStats {
        let config = RoomConfig::default();
        run_overloaded(
            AdmissionOrder::Priority,
            Some(&config),
            true,
            turned_away_ends_session,
        )
    }

    #[test]
    fn a_session_ends_at_a_turn_turned_away_unless_told_to_go_on() {
        let go_on = overloaded_sessions_stats(false).outcomes.unwrap();
        let ends = overloaded_sessions_stats(true).outcomes.unwrap();
        // Going on, every turn is sent.
        assert_eq!(go_on.all.unsent_requests, 0);
        assert_eq!(go_on.all.offered_requests, 240);
        let (go_on_batch, ends_batch) = (&go_on.by_class[1], &ends.by_class[1]);
        assert!(go_on_batch.rejected_requests > 0, "{go_on_batch:?}");
        // Ending, the turns after one turned away are not sent, and not
        // counted as offered; priority 0's sessions lose none.
        assert!(ends_batch.unsent_requests > 0, "{ends_batch:?}");
        assert_eq!(ends.by_class[0].unsent_requests, 0);
        for group in [&ends.all, &ends.by_class[0], ends_batch] {
            assert_eq!(
                group.served_requests + group.rejected_requests,
                group.offered_requests,
                "{group:?}"
            );
        }
        assert_eq!(ends.all.offered_requests + ends.all.unsent_requests, 240);
        // Each of the 20 priority 1 sessions is turned away at most once.
        assert!(ends_batch.rejected_requests <= 20, "{ends_batch:?}");
    }

    /// Two workers of 1000 prompt tokens/s, 200-token prompts every 50 ms
    /// (twice what they can take) for 12 s, alternately priority 0 (no
    /// deadline) and priority 1 (a 1 s deadline); `order` decides.
    fn overloaded_cell_stats(order: AdmissionOrder, room: Option<&RoomConfig>) -> CellStats {
        run_overloaded(order, room, false, false)
    }

    /// [`overloaded_cell_stats`]'s cell, its requests turns of 40 sessions
    /// when `sessions`.
    fn run_overloaded(
        order: AdmissionOrder,
        room: Option<&RoomConfig>,
        sessions: bool,
        turned_away_ends_session: bool,
    ) -> CellStats {
        let workers = vec![
            (LoadReport::Sglang, params()),
            (LoadReport::Sglang, params()),
        ];
        let requests: Vec<RequestSpec> = (0..240)
            .map(|i| RequestSpec {
                arrival_s: 0.05 * f64::from(i),
                prompt_tokens: 200,
                output_tokens: 1,
                prefix_group: None,
                segments: sessions.then(|| {
                    Arc::from(vec![
                        Segment { id: 7, tokens: 100 },
                        Segment {
                            id: 1000 + (i % 40) as u64,
                            tokens: 50,
                        },
                    ])
                }),
                priority: Some(i % 2),
                tenant: None,
                ttft_deadline_s: (i % 2 == 1).then_some(1.0),
            })
            .collect();
        let cell = Cell {
            workers: &workers,
            requests: &requests,
            chains: &[],
            shared_prefix: None,
            router: RouterPoint {
                poll_interval_s: 0.1,
                stale_after_s: 0.3,
                admission: order,
                sweeps_admission: true,
                ..router()
            },
            policy: PolicyName::LeastLoad,
            seed: 3,
            slowdown: None,
            restart: None,
            room,
            turned_away_ends_session,
        };
        run_cell(&cell, &policy_registry()).unwrap()
    }

    #[test]
    fn an_admission_room_serves_the_urgent_first_and_turns_away_what_would_be_late() {
        let config = RoomConfig::default();
        let without = overloaded_cell_stats(AdmissionOrder::Off, None);
        // A room config with the order off is no room at all.
        assert_eq!(
            overloaded_cell_stats(AdmissionOrder::Off, Some(&config)),
            without
        );
        let with = overloaded_cell_stats(AdmissionOrder::Priority, Some(&config));
        assert_eq!(
            with,
            overloaded_cell_stats(AdmissionOrder::Priority, Some(&config))
        );
        let outcomes = |stats: &CellStats| stats.outcomes.clone().unwrap();
        let (off, on) = (outcomes(&without), outcomes(&with));
        // Without a room every request is served, the late ones too.
        assert_eq!(off.all.served_requests, 240);
        assert!(off.by_class[1].served_late_requests > 50, "{off:?}");
        // With it, priority 0 goes first and is never turned away; priority
        // 1 is served within its deadline or turned away.
        let (urgent, batch) = (&on.by_class[0], &on.by_class[1]);
        assert_eq!(
            (urgent.group.as_str(), batch.group.as_str()),
            ("priority 0", "priority 1")
        );
        assert_eq!(urgent.served_requests, 120);
        assert!(urgent.ttft_p99_s < 1.0, "{urgent:?}");
        assert!(urgent.ttft_p99_s < off.by_class[0].ttft_p99_s, "{urgent:?}");
        assert_eq!(batch.served_requests + batch.rejected_requests, 120);
        assert!(batch.rejected_requests > 20, "{batch:?}");
        assert_eq!(batch.served_late_requests, 0, "{batch:?}");
        // Priority 0 alone fills the fleet: priority 1 keeps the share its
        // weight gives it, served in time.
        assert!(batch.goodput_requests > 0, "{batch:?}");
        assert_eq!(with.requests, 240 - batch.rejected_requests);
        // A request released by the room counts its wait there: TTFT from
        // its arrival at the router, never less than its own prefill.
        assert!(with.ttft_sorted_s.iter().all(|&ttft| ttft >= 0.2 - 1e-9));
    }

    #[test]
    fn only_policies_with_a_model_of_wait_run_with_a_room() {
        let registry = policy_registry();
        assert!(predicts_wait(&registry, PolicyName::LeastLoad));
        assert!(predicts_wait(&registry, PolicyName::PowerOfTwo));
        assert!(!predicts_wait(&registry, PolicyName::RoundRobin));
        assert!(!predicts_wait(&registry, PolicyName::Oracle));
    }

    /// Poisson arrivals of `prompt`-sized prompts with `output_tokens` each.
    fn poisson_traffic(
        prompt: crate::workload::LengthDist,
        output_tokens: u32,
        shared_prefix: Option<SharedPrefixConfig>,
    ) -> crate::scenario::TrafficConfig {
        crate::scenario::TrafficConfig {
            name: "t".into(),
            arrival: crate::scenario::ArrivalConfig::Poisson {},
            prompt: Some(prompt),
            output: Some(crate::workload::LengthDist::Constant {
                tokens: output_tokens,
            }),
            shared_prefix,
            conversation: None,
            classes: Vec::new(),
            tenants: Vec::new(),
            ttft_deadline_s: None,
        }
    }

    /// 90 % 200-token and 10 % 6000-token prompts.
    fn size_skew_prompts() -> crate::workload::LengthDist {
        crate::workload::LengthDist::Bimodal {
            short_tokens: 200,
            long_tokens: 6000,
            long_fraction: 0.1,
            spread: 0.0,
        }
    }

    #[test]
    fn a_cell_is_deterministic() {
        let workers = vec![(LoadReport::Sglang, EngineParams::default()); 4];
        let traffic = poisson_traffic(size_skew_prompts(), 32, None);
        let requests = crate::workload::generate(&traffic, None, 30.0, 2000, 9);
        let registry = policy_registry();
        let outside_the_default_set = [PolicyName::CacheAware, PolicyName::ConsistentHash];
        for policy in PolicyName::ALL.into_iter().chain(outside_the_default_set) {
            let cell = Cell {
                workers: &workers,
                requests: &requests,
                chains: &[],
                shared_prefix: None,
                router: router(),
                policy,
                seed: 5,
                slowdown: None,
                restart: None,
                room: None,
                turned_away_ends_session: false,
            };
            let a = run_cell(&cell, &registry).unwrap();
            let b = run_cell(&cell, &registry).unwrap();
            assert_eq!(a, b, "{policy:?}");
            assert_eq!(a.requests, 2000);
        }
    }

    #[test]
    fn every_load_report_replicas_and_report_timing_run_to_completion() {
        let workers: Vec<(LoadReport, EngineParams)> = LoadReport::ALL
            .iter()
            .map(|&report| (report, EngineParams::default()))
            .collect();
        let traffic = poisson_traffic(
            crate::workload::LengthDist::Constant { tokens: 700 },
            16,
            Some(SharedPrefixConfig {
                fraction: 0.5,
                tokens: 512,
                groups: 2,
            }),
        );
        let requests = crate::workload::generate(&traffic, None, 40.0, 1500, 2);
        let registry = policy_registry();
        for report_at in [ReportAt::Send, ReportAt::Completion] {
            let point = RouterPoint {
                replicas: 3,
                replica_phase: PhaseMode::Random,
                worker_phase: PhaseMode::Spread,
                poll_interval_s: 0.2,
                stale_after_s: 0.6,
                poll_latency_s: 0.05,
                report_at,
                ..router()
            };
            for policy in [
                PolicyName::LeastLoad,
                PolicyName::LeastLoadSincePoll,
                PolicyName::PowerOfTwo,
            ] {
                let cell = Cell {
                    workers: &workers,
                    requests: &requests,
                    chains: &[],
                    shared_prefix: traffic.shared_prefix,
                    router: point,
                    policy,
                    seed: 11,
                    slowdown: None,
                    restart: None,
                    room: None,
                    turned_away_ends_session: false,
                };
                let stats = run_cell(&cell, &registry).unwrap();
                assert_eq!(stats.requests, 1500, "{policy:?} {report_at:?}");
                assert_eq!(stats.poll_failures, 0, "{policy:?} {report_at:?}");
            }
        }
    }

    /// A size-skewed cell of 4 replicas over 8 workers at about 0.85 load.
    fn replica_cell_stats(policy: PolicyName, sync: SyncConfig, seed: u64) -> CellStats {
        let workers = vec![(LoadReport::Sglang, EngineParams::default()); 8];
        let traffic = poisson_traffic(size_skew_prompts(), 32, None);
        let requests = crate::workload::generate(&traffic, None, 60.0, 4000, 3);
        let cell = Cell {
            workers: &workers,
            requests: &requests,
            chains: &[],
            shared_prefix: None,
            router: RouterPoint {
                replicas: 4,
                replica_phase: PhaseMode::Random,
                sync,
                sweeps_sync: true,
                ..router()
            },
            policy,
            seed,
            slowdown: None,
            restart: None,
            room: None,
            turned_away_ends_session: false,
        };
        run_cell(&cell, &policy_registry()).unwrap()
    }

    #[test]
    fn a_cell_with_a_lossy_sync_repeats_exactly_and_sync_helps() {
        let lossy = SyncConfig::Periodic {
            publish_interval_s: 0.02,
            latency_s: 0.002,
            loss_ratio: 0.2,
            entry_ttl_s: 1.0,
            publish_dispatches: false,
        };
        let a = replica_cell_stats(PolicyName::LeastLoad, lossy, 5);
        assert_eq!(a, replica_cell_stats(PolicyName::LeastLoad, lossy, 5));
        let stats = a.sync.unwrap();
        assert!(stats.deliveries_lost > 0, "{stats:?}");
        assert!(stats.entries_applied > 0, "{stats:?}");
        // About one copy in five lost.
        let lost_ratio = stats.deliveries_lost as f64 / stats.deliveries as f64;
        assert!((0.15..0.25).contains(&lost_ratio), "{stats:?}");
        // Nothing to share without sync; the ideal channel counts every
        // dispatch and first token once per other replica.
        let off = replica_cell_stats(PolicyName::LeastLoad, SyncConfig::Off {}, 5);
        assert_eq!(off.sync, None);
        let ideal = replica_cell_stats(PolicyName::LeastLoad, SyncConfig::Ideal {}, 5);
        let ideal_stats = ideal.sync.unwrap();
        assert_eq!(ideal_stats.messages, 2 * 4000);
        assert_eq!(ideal_stats.entries_applied, 3 * 2 * 4000);
        assert!(
            ideal.ttft_p99_s < off.ttft_p99_s && a.ttft_p99_s < off.ttft_p99_s,
            "p99 off {} lossy 20 ms {} ideal {}",
            off.ttft_p99_s,
            a.ttft_p99_s,
            ideal.ttft_p99_s
        );
    }

    #[test]
    fn a_policy_that_ignores_sync_routes_as_without_it() {
        let sync = SyncConfig::Periodic {
            publish_interval_s: 0.02,
            latency_s: 0.001,
            loss_ratio: 0.0,
            entry_ttl_s: 1.0,
            publish_dispatches: false,
        };
        let synced = replica_cell_stats(PolicyName::RoundRobin, sync, 2);
        let stats = synced.sync.unwrap();
        assert!(stats.entries_unsupported > 0 && stats.entries_applied == 0);
        // The channel stopped at the first answer.
        assert!(stats.messages <= 4, "{stats:?}");
        let off = replica_cell_stats(PolicyName::RoundRobin, SyncConfig::Off {}, 2);
        assert_eq!(synced.ttft_cdf_s, off.ttft_cdf_s);
    }

    /// 4 replicas of `least_load` over 8 workers, 2000-token prompts of
    /// which 90 % open with one of 64 shared 1500-token prefixes, at about
    /// 0.7 of the warm-cache capacity; and how many requests open with a
    /// shared prefix (the others have no known prefix).
    fn prefix_cell_stats(sync: SyncConfig) -> (CellStats, u64) {
        let workers = vec![(LoadReport::Sglang, EngineParams::default()); 8];
        let shared_prefix = Some(SharedPrefixConfig {
            fraction: 0.9,
            tokens: 1500,
            groups: 64,
        });
        let traffic = poisson_traffic(
            crate::workload::LengthDist::Constant { tokens: 2000 },
            16,
            shared_prefix,
        );
        let requests = crate::workload::generate(&traffic, None, 40.0, 3000, 6);
        let cell = Cell {
            workers: &workers,
            requests: &requests,
            chains: &[],
            shared_prefix,
            router: RouterPoint {
                replicas: 4,
                replica_phase: PhaseMode::Random,
                sync,
                sweeps_sync: true,
                ..router()
            },
            policy: PolicyName::LeastLoad,
            seed: 3,
            slowdown: None,
            restart: None,
            room: None,
            turned_away_ends_session: false,
        };
        let prefixed = requests
            .iter()
            .filter(|spec| spec.prefix_group.is_some())
            .count() as u64;
        (run_cell(&cell, &policy_registry()).unwrap(), prefixed)
    }

    #[test]
    fn replicas_share_placements_and_the_engines_report_their_hits() {
        let sync = SyncConfig::Periodic {
            publish_interval_s: 0.02,
            latency_s: 0.001,
            loss_ratio: 0.0,
            entry_ttl_s: 1.0,
            publish_dispatches: true,
        };
        let (shared, prefixed) = prefix_cell_stats(sync);
        assert_eq!(shared, prefix_cell_stats(sync).0);
        assert!((2500..3000).contains(&prefixed), "{prefixed}");
        let stats = shared.sync.unwrap();
        // One placement per dispatch of a known prefix, each applied by the
        // 3 other replicas.
        assert_eq!(stats.placements, prefixed);
        assert_eq!(stats.placements_applied, 3 * prefixed);
        assert_eq!(stats.placements_lost, 0);
        // 40 bytes and 5 hashes each: the shared 1500 tokens (the rest of
        // a prompt is its own) fill 5 of the index's 256-token blocks.
        // Each streamed first token (40 bytes and four numbers) is shared
        // too, and applied by the other 3.
        assert!(stats.prefill_samples > 0);
        assert_eq!(stats.prefill_samples_applied, 3 * stats.prefill_samples);
        assert_eq!(
            stats.prefix_bytes,
            prefixed * (40 + 5 * 20) + stats.cache_bounds * 60 + stats.prefill_samples * 120
        );
        assert_eq!(shared.prompt_tokens, 3000 * 2000);
        assert!(shared.reported_cached_tokens > 0);
        assert!(shared.predicted_cached_tokens > 0);
        // Without sync each replica knows only its own quarter of the
        // placements: fewer of its predicted hits, fewer real ones.
        let alone = prefix_cell_stats(SyncConfig::Off {}).0;
        assert_eq!(alone.sync, None);
        assert!(
            alone.reported_cached_tokens < shared.reported_cached_tokens,
            "served from cache: alone {} shared {}",
            alone.reported_cached_tokens,
            shared.reported_cached_tokens
        );
        // The predictions stay honest: at most what the engines served,
        // give or take the index's coarser blocks.
        let predicted = shared.predicted_cached_tokens as f64;
        let served = shared.reported_cached_tokens as f64;
        assert!(
            predicted <= 1.02 * served && predicted >= 0.8 * served,
            "{predicted} {served}"
        );
    }

    #[test]
    fn a_slowdown_changes_the_engine_and_the_rates_are_sampled() {
        let workers = vec![(LoadReport::Sglang, EngineParams::default()); 2];
        let traffic = poisson_traffic(
            crate::workload::LengthDist::Constant { tokens: 1000 },
            8,
            None,
        );
        let requests = crate::workload::generate(&traffic, None, 8.0, 400, 3);
        let last_s = requests.last().unwrap().arrival_s;
        let slowdown = Slowdown {
            worker: 1,
            at_s: last_s / 2.0,
            factor: 0.5,
        };
        let registry = policy_registry();
        let run = |policy, slowdown| {
            let cell = Cell {
                workers: &workers,
                requests: &requests,
                chains: &[],
                shared_prefix: None,
                router: RouterPoint {
                    replicas: 2,
                    ..router()
                },
                policy,
                seed: 4,
                slowdown,
                restart: None,
                room: None,
                turned_away_ends_session: false,
            };
            run_cell(&cell, &registry).unwrap()
        };
        let stats = run(PolicyName::LeastLoadFixedRate, Some(slowdown));
        let trace = stats.rate_trace.unwrap();
        assert_eq!(trace.worker, 1);
        // One sample a second from 0 until the last arrival.
        assert_eq!(trace.samples.len() as f64, last_s.ceil() + 1.0);
        for sample in &trace.samples {
            let expected = if sample.time_s < slowdown.at_s {
                8000.0
            } else {
                4000.0
            };
            assert_eq!(sample.true_prefill_tps, expected, "{sample:?}");
            // The fixed rate is `default_throughput` in both replicas.
            assert_eq!(sample.estimates_tps, vec![Some(2000.0); 2], "{sample:?}");
        }
        // Baselines have no rate column; the references no replicas.
        assert!(
            run(PolicyName::RoundRobin, Some(slowdown))
                .rate_trace
                .is_none()
        );
        assert!(run(PolicyName::Oracle, Some(slowdown)).rate_trace.is_none());
        // The slowed worker makes requests slower for every policy.
        for policy in [PolicyName::RoundRobin, PolicyName::Oracle] {
            let slowed = run(policy, Some(slowdown));
            let nominal = run(policy, None);
            assert!(
                slowed.ttft_mean_s > nominal.ttft_mean_s,
                "{policy:?}: {} vs {}",
                slowed.ttft_mean_s,
                nominal.ttft_mean_s
            );
        }
    }

    #[test]
    fn every_load_report_converts_to_a_worker_load() {
        let snapshot = EngineSnapshot {
            running_requests: 3,
            waiting_requests: 2,
            queued_prefill_tokens: 900,
            used_kv_tokens: 1000,
            kv_capacity_tokens: 10_000,
            max_running: 256,
            decode_tps: 500.0,
            generation_tokens_total: 100,
            ..EngineSnapshot::default()
        };
        let now = Instant::now();
        let mut converter = backends_vllm::VllmMetricsConverter::new();
        for report in LoadReport::ALL {
            let load = convert_report(report, &snapshot, &mut converter, now)
                .unwrap()
                .unwrap();
            assert_eq!(load.waiting_requests(), 2, "{report:?}");
            assert_eq!(load.running_requests(), 3, "{report:?}");
            assert!((load.kv_usage_ratio() - 0.1).abs() < 1e-12, "{report:?}");
            let reports_queue = matches!(report, LoadReport::Sglang | LoadReport::SglangGrpc);
            assert_eq!(
                load.queued_tokens(),
                reports_queue.then_some(900),
                "{report:?}"
            );
            assert_eq!(
                load.throughput_tps(),
                reports_queue.then_some(500.0),
                "{report:?}"
            );
        }
        // vLLM's throughput is the counter's rate between two polls.
        let later = EngineSnapshot {
            generation_tokens_total: 1100,
            ..snapshot
        };
        let load = convert_report(
            LoadReport::Vllm,
            &later,
            &mut converter,
            now + Duration::from_secs(2),
        )
        .unwrap()
        .unwrap();
        assert_eq!(load.throughput_tps(), Some(500.0));
    }
}
