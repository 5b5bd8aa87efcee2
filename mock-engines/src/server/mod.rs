//! Mock engine servers: simulated engines behind real sockets on loopback.
//!
//! [`start`] runs one server per [`SimEngineConfig`] inside the current tokio
//! runtime and returns a [`SimFleet`]: the engines' addresses, run-time fault
//! switching, their true state, request counters, a hard
//! [`SimFleet::kill`] and [`SimFleet::restart`] of one engine, and a clean
//! [`SimFleet::shutdown`].
//!
//! Each engine has one HTTP port (`/health`, `/v1/models`, the generation
//! endpoints, SGLang's `/health_generate` on the SGLang flavours, its
//! flavour's load endpoints, `/metrics` with the request, prompt-token and
//! prefix-cache counters, `/control/fault`, `/control/stats`,
//! `/control/admitted`) and, when the flavour has gRPC and
//! [`SimEngineConfig::grpc_addr`] is set, one gRPC port (`GetLoads`,
//! `HealthCheck`).
//!
//! In [`ServeMode::Model`] an [`Engine`] runs in virtual time
//! = elapsed wall time × `time_scale`. One driver task per engine advances the
//! model to "now" in as many virtual steps as fit, hands each waiting request
//! its tokens, and sleeps until the next event is due (or a request arrives):
//! never once per step. In [`ServeMode::Canned`] every generation request is
//! answered at once with `canned_tokens` tokens.

mod control;
mod generation;
mod grpc;
mod http;
mod loads;

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::net::{Ipv4Addr, SocketAddr};
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::{Notify, mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::error::EngineSimError;
use engine_model::{Engine, EngineEvent, EngineParams, EngineSnapshot, RequestRecord};

/// Which real engine a mock server impersonates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Flavour {
    /// SGLang: `/v1/loads` JSON, `/metrics` (`sglang:`), gRPC `SglangScheduler`.
    Sglang,
    /// SGLang without `/v1/loads`: `/metrics` only, no gRPC (the backends'
    /// fallback path).
    SglangMetrics,
    /// vLLM: `/metrics` (`vllm:`), gRPC `VllmEngine`.
    Vllm,
    /// TokenSpeed: gRPC `TokenSpeedScheduler` for loads (a gRPC port is
    /// required); `/metrics` carries only its request and token counters.
    Tokenspeed,
}

impl Flavour {
    pub const ALL: [Flavour; 4] = [
        Flavour::Sglang,
        Flavour::SglangMetrics,
        Flavour::Vllm,
        Flavour::Tokenspeed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Flavour::Sglang => "sglang",
            Flavour::SglangMetrics => "sglang-metrics",
            Flavour::Vllm => "vllm",
            Flavour::Tokenspeed => "tokenspeed",
        }
    }

    /// Whether this flavour can serve gRPC `GetLoads`.
    pub fn has_grpc(self) -> bool {
        !matches!(self, Flavour::SglangMetrics)
    }

    /// Whether this flavour cannot run without gRPC (its only load report).
    pub fn requires_grpc(self) -> bool {
        matches!(self, Flavour::Tokenspeed)
    }
}

impl fmt::Display for Flavour {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Flavour {
    type Err = EngineSimError;

    fn from_str(name: &str) -> Result<Flavour, EngineSimError> {
        Flavour::ALL
            .into_iter()
            .find(|flavour| flavour.as_str() == name)
            .ok_or_else(|| EngineSimError::UnknownFlavour {
                name: name.to_owned(),
            })
    }
}

/// How generation requests are answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ServeMode {
    /// Latency from the engine model.
    #[default]
    Model,
    /// At once, with a fixed small body or a fixed number of SSE chunks.
    Canned,
}

impl ServeMode {
    pub fn as_str(self) -> &'static str {
        match self {
            ServeMode::Model => "model",
            ServeMode::Canned => "canned",
        }
    }
}

impl FromStr for ServeMode {
    type Err = EngineSimError;

    fn from_str(name: &str) -> Result<ServeMode, EngineSimError> {
        match name {
            "model" => Ok(ServeMode::Model),
            "canned" => Ok(ServeMode::Canned),
            _ => Err(EngineSimError::UnknownMode {
                name: name.to_owned(),
            }),
        }
    }
}

/// A misbehaviour, set at start and switchable at run time
/// (`POST /control/fault {"mode": "..."}` or [`SimFleet::set_fault`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(u8)]
pub enum FaultMode {
    /// Behave.
    #[default]
    None = 0,
    /// Load endpoints (HTTP and gRPC) answer only after `slow_loads_delay`.
    SlowLoads = 1,
    /// Load endpoints answer 200 with an undecodable body (truncated JSON,
    /// broken Prometheus lines); gRPC answers negative counts.
    MalformedLoads = 2,
    /// Load reports carry NaN for KV usage and throughput.
    NanLoads = 3,
    /// Load endpoints answer HTTP 500 (gRPC `INTERNAL`).
    Loads500 = 4,
    /// Generation requests are accepted and never answered.
    HangGeneration = 5,
    /// Generation responses are cut (connection closed) after the first chunk.
    CloseMidStream = 6,
    /// Every request except `/control/*` gets its connection closed
    /// without an answer; new gRPC connections are dropped and calls fail
    /// with `UNAVAILABLE`.
    RefuseConnections = 7,
    /// Streaming generations send their head and first event, then go silent
    /// with the connection open until the engine stops (even if the fault is
    /// switched off meanwhile); non-streaming ones hang like
    /// [`FaultMode::HangGeneration`].
    HangMidStream = 8,
    /// Generation requests (and `/health_generate`) answer HTTP 500 with a
    /// JSON error body while `/health` still answers 200.
    Generation500 = 9,
    /// Generation requests answer normally, but only after
    /// [`SimEngineConfig::slow_first_byte_delay`] of wall time before the
    /// response head.
    SlowFirstByte = 10,
}

impl FaultMode {
    pub const ALL: [FaultMode; 11] = [
        FaultMode::None,
        FaultMode::SlowLoads,
        FaultMode::MalformedLoads,
        FaultMode::NanLoads,
        FaultMode::Loads500,
        FaultMode::HangGeneration,
        FaultMode::CloseMidStream,
        FaultMode::RefuseConnections,
        FaultMode::HangMidStream,
        FaultMode::Generation500,
        FaultMode::SlowFirstByte,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            FaultMode::None => "none",
            FaultMode::SlowLoads => "slow-loads",
            FaultMode::MalformedLoads => "malformed-loads",
            FaultMode::NanLoads => "nan-loads",
            FaultMode::Loads500 => "loads-500",
            FaultMode::HangGeneration => "hang-generation",
            FaultMode::CloseMidStream => "close-mid-stream",
            FaultMode::RefuseConnections => "refuse-connections",
            FaultMode::HangMidStream => "hang-mid-stream",
            FaultMode::Generation500 => "generation-500",
            FaultMode::SlowFirstByte => "slow-first-byte",
        }
    }

    fn from_u8(value: u8) -> FaultMode {
        FaultMode::ALL
            .into_iter()
            .find(|mode| *mode as u8 == value)
            .unwrap_or_default()
    }
}

impl fmt::Display for FaultMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for FaultMode {
    type Err = EngineSimError;

    fn from_str(name: &str) -> Result<FaultMode, EngineSimError> {
        FaultMode::ALL
            .into_iter()
            .find(|mode| mode.as_str() == name)
            .ok_or_else(|| EngineSimError::UnknownFault {
                name: name.to_owned(),
            })
    }
}

/// One simulated engine to start.
#[derive(Debug, Clone, PartialEq)]
pub struct SimEngineConfig {
    pub flavour: Flavour,
    pub mode: ServeMode,
    pub params: EngineParams,
    pub seed: u64,
    /// Virtual seconds per wall second (100 = a hundred times faster than real).
    pub time_scale: f64,
    pub fault: FaultMode,
    /// HTTP listen address (port 0 = any free port).
    pub http_addr: SocketAddr,
    /// gRPC listen address, `None` for no gRPC (required for `tokenspeed`,
    /// refused for `sglang-metrics`).
    pub grpc_addr: Option<SocketAddr>,
    /// The model name served by `/v1/models` and used in metric labels.
    pub model_name: String,
    /// Output tokens when the request names none (`max_tokens` …).
    pub default_output_tokens: u32,
    /// Tokens (SSE chunks) of every canned answer.
    pub canned_tokens: u32,
    /// How long load endpoints stall under [`FaultMode::SlowLoads`].
    pub slow_loads_delay: Duration,
    /// How long generation requests wait (wall time) before their response
    /// head under [`FaultMode::SlowFirstByte`].
    pub slow_first_byte_delay: Duration,
}

impl SimEngineConfig {
    /// Defaults for `flavour`: model mode, default engine parameters, real
    /// time, no fault, HTTP on `127.0.0.1:0`, and gRPC on `127.0.0.1:0` for
    /// every flavour that has it.
    pub fn new(flavour: Flavour) -> SimEngineConfig {
        let any_port = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
        SimEngineConfig {
            flavour,
            mode: ServeMode::Model,
            params: EngineParams::default(),
            seed: 0,
            time_scale: 1.0,
            fault: FaultMode::None,
            http_addr: any_port,
            grpc_addr: flavour.has_grpc().then_some(any_port),
            model_name: "sim-model".to_owned(),
            default_output_tokens: 16,
            canned_tokens: 8,
            slow_loads_delay: Duration::from_secs(5),
            slow_first_byte_delay: Duration::from_secs(5),
        }
    }

    fn validate(&self) -> Result<(), EngineSimError> {
        self.params.validate()?;
        if !(self.time_scale.is_finite() && self.time_scale > 0.0) {
            return Err(EngineSimError::InvalidTimeScale {
                time_scale: self.time_scale,
            });
        }
        match (self.grpc_addr, self.flavour) {
            (None, flavour) if flavour.requires_grpc() => Err(EngineSimError::MissingGrpcPort {
                flavour: flavour.as_str(),
            }),
            (Some(_), flavour) if !flavour.has_grpc() => Err(EngineSimError::UnexpectedGrpcPort {
                flavour: flavour.as_str(),
            }),
            _ => Ok(()),
        }
    }
}

/// Where one started engine listens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimEngineAddr {
    pub index: usize,
    pub flavour: Flavour,
    pub http_addr: SocketAddr,
    pub grpc_addr: Option<SocketAddr>,
}

impl SimEngineAddr {
    /// `http://127.0.0.1:PORT`
    pub fn http_url(&self) -> String {
        format!("http://{}", self.http_addr)
    }

    /// `grpc://127.0.0.1:PORT` when the engine serves gRPC.
    pub fn grpc_url(&self) -> Option<String> {
        self.grpc_addr.map(|addr| format!("grpc://{addr}"))
    }

    /// `http://127.0.0.1:PORT` of the gRPC port (what tonic clients dial).
    pub fn grpc_http_url(&self) -> Option<String> {
        self.grpc_addr.map(|addr| format!("http://{addr}"))
    }
}

/// What one engine has received, counted over the fleet's lifetime (a
/// restart keeps counting).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SimEngineStats {
    /// Generation requests (chat, completions, `/generate`) accepted, counted
    /// on arrival before any fault applies. Requests whose connection
    /// `refuse-connections` closes never reach the engine and are not counted.
    pub generation_requests: u64,
    /// `/health_generate` probes accepted (not in `generation_requests`).
    pub health_generate_requests: u64,
}

/// How many admitted request ids an engine keeps (the newest); older ones
/// are forgotten so a long run's memory stays bounded.
pub const ADMITTED_IDS_KEPT: usize = 100_000;
/// Longer `x-request-id`s are not recorded: with the count capped, this caps
/// the log's memory too.
pub const ADMITTED_ID_MAX_BYTES: usize = 256;

/// The `x-request-id`s of the generation requests that entered the engine
/// (submitted to the model, or a canned answer started), oldest first.
/// Arrival counts cannot tell a duplicate generation from the retry of a
/// request a hung engine never started; this can.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AdmittedRequestIds {
    /// The newest ids (100 000 are kept), oldest first.
    pub ids: Vec<String>,
    /// Every id ever recorded, including those no longer kept.
    pub total: u64,
}

#[derive(Debug, Default)]
struct AdmittedLog {
    ids: VecDeque<String>,
    total: u64,
}

#[derive(Debug, Default)]
struct Counters {
    generation_requests: AtomicU64,
    health_generate_requests: AtomicU64,
    admitted: Mutex<AdmittedLog>,
}

impl Counters {
    fn stats(&self) -> SimEngineStats {
        SimEngineStats {
            generation_requests: self.generation_requests.load(Ordering::Relaxed),
            health_generate_requests: self.health_generate_requests.load(Ordering::Relaxed),
        }
    }

    /// Records that the request with this id entered the engine.
    fn admit(&self, request_id: &str) {
        if request_id.len() > ADMITTED_ID_MAX_BYTES {
            return;
        }
        let mut log = self.admitted.lock();
        if log.ids.len() >= ADMITTED_IDS_KEPT {
            log.ids.pop_front();
        }
        log.ids.push_back(request_id.to_owned());
        log.total += 1;
    }

    fn admitted(&self) -> AdmittedRequestIds {
        let log = self.admitted.lock();
        AdmittedRequestIds {
            ids: log.ids.iter().cloned().collect(),
            total: log.total,
        }
    }
}

/// How an engine's tasks are told to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    Running,
    /// Close listeners, finish open connections gracefully.
    Graceful,
    /// Close listeners and drop every open connection at once.
    Kill,
}

/// One running life of an engine: its stop switch and its tasks.
#[derive(Debug)]
struct Incarnation {
    stop: watch::Sender<Stop>,
    tasks: JoinSet<()>,
}

impl Incarnation {
    /// Stops with `how` and waits until every task is gone (so the listeners
    /// are closed), aborting whatever outlives `grace`.
    async fn stop(mut self, how: Stop, grace: Duration) {
        let _ = self.stop.send(how);
        let tasks = &mut self.tasks;
        let finished =
            tokio::time::timeout(grace, async { while tasks.join_next().await.is_some() {} });
        if finished.await.is_err() {
            self.tasks.abort_all();
            while self.tasks.join_next().await.is_some() {}
        }
    }
}

/// One engine of a fleet across its restarts.
#[derive(Debug)]
struct EngineSlot {
    /// What it (re)starts from, with the addresses it was first bound to.
    config: SimEngineConfig,
    counters: Arc<Counters>,
    /// The current (or, while killed, the last) incarnation's state.
    shared: Mutex<Arc<EngineShared>>,
    /// `None` while killed. An async lock: kill and restart await under it.
    running: tokio::sync::Mutex<Option<Incarnation>>,
}

/// Running mock engines; dropping it stops them too (without waiting).
#[derive(Debug)]
pub struct SimFleet {
    addrs: Vec<SimEngineAddr>,
    slots: Vec<EngineSlot>,
}

/// How long a killed engine's tasks get to drop their connections before
/// they are aborted (they need no I/O to do so).
const KILL_GRACE: Duration = Duration::from_secs(1);
/// How long a shutdown waits for open connections to finish gracefully.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(3);

impl SimFleet {
    /// The engines' addresses, in the order of their configs.
    pub fn engines(&self) -> &[SimEngineAddr] {
        &self.addrs
    }

    fn shared(&self, index: usize) -> Option<Arc<EngineShared>> {
        self.slots.get(index).map(|slot| slot.shared.lock().clone())
    }

    /// Switches engine `index`'s fault mode; false when there is no such engine.
    /// A restart resets it to the config's fault.
    pub fn set_fault(&self, index: usize, fault: FaultMode) -> bool {
        match self.shared(index) {
            Some(engine) => {
                engine.set_fault(fault);
                true
            }
            None => false,
        }
    }

    /// Engine `index`'s current fault mode.
    pub fn fault(&self, index: usize) -> Option<FaultMode> {
        self.shared(index).map(|engine| engine.fault())
    }

    /// Engine `index`'s true state now (advanced to the current virtual time;
    /// while killed, the state it died with, advanced).
    pub fn snapshot(&self, index: usize) -> Option<EngineSnapshot> {
        self.shared(index).map(|engine| engine.snapshot())
    }

    /// Engine `index`'s request counters (also `GET /control/stats`).
    pub fn stats(&self, index: usize) -> Option<SimEngineStats> {
        self.slots.get(index).map(|slot| slot.counters.stats())
    }

    /// The `x-request-id`s of the generation requests that entered engine
    /// `index`'s model (past every pre-model fault), across restarts (also
    /// `GET /control/admitted`).
    pub fn admitted_request_ids(&self, index: usize) -> Option<AdmittedRequestIds> {
        self.slots.get(index).map(|slot| slot.counters.admitted())
    }

    /// Generation requests engine `index` has accepted, across restarts.
    pub fn generation_requests(&self, index: usize) -> Option<u64> {
        self.stats(index).map(|stats| stats.generation_requests)
    }

    /// `/health_generate` probes engine `index` has accepted, across restarts.
    pub fn health_generate_requests(&self, index: usize) -> Option<u64> {
        self.stats(index)
            .map(|stats| stats.health_generate_requests)
    }

    /// Whether engine `index` is serving (not killed).
    pub async fn is_running(&self, index: usize) -> Option<bool> {
        let slot = self.slots.get(index)?;
        Some(slot.running.lock().await.is_some())
    }

    /// Kills engine `index` hard, like a crashed process: its listeners close
    /// (new connections are refused) and every open connection is dropped at
    /// once, in-flight streams cut mid-way. Returns when all of that is done;
    /// false when there is no such engine. Killing a killed engine does
    /// nothing.
    pub async fn kill(&self, index: usize) -> bool {
        let Some(slot) = self.slots.get(index) else {
            return false;
        };
        let mut running = slot.running.lock().await;
        if let Some(incarnation) = running.take() {
            incarnation.stop(Stop::Kill, KILL_GRACE).await;
            tracing::info!(engine = index, "engine killed");
        }
        true
    }

    /// Starts engine `index` again on the same HTTP (and gRPC) port with a
    /// fresh engine (empty model, virtual time from 0, the config's fault);
    /// its counters keep counting. A running engine is killed first.
    pub async fn restart(&self, index: usize) -> Result<(), EngineSimError> {
        let slot = self
            .slots
            .get(index)
            .ok_or(EngineSimError::NoSuchEngine { index })?;
        let mut running = slot.running.lock().await;
        if let Some(incarnation) = running.take() {
            incarnation.stop(Stop::Kill, KILL_GRACE).await;
        }
        let http_listener = bind(slot.config.http_addr)?;
        let grpc_listener = match slot.config.grpc_addr {
            Some(addr) => Some(bind(addr)?),
            None => None,
        };
        let (shared, incarnation) = launch(
            index,
            slot.config.clone(),
            slot.counters.clone(),
            Instant::now(),
            http_listener,
            grpc_listener,
        )?;
        *slot.shared.lock() = shared;
        *running = Some(incarnation);
        tracing::info!(engine = index, "engine restarted");
        Ok(())
    }

    /// Stops every server and driver: listeners close, open connections are
    /// finished gracefully (hung and streaming requests end at once), and
    /// whatever is still running after a short grace period is aborted.
    pub async fn shutdown(mut self) {
        let incarnations: Vec<Incarnation> = self
            .slots
            .iter_mut()
            .filter_map(|slot| slot.running.get_mut().take())
            .collect();
        for incarnation in &incarnations {
            let _ = incarnation.stop.send(Stop::Graceful);
        }
        // One grace period for all engines, not one each.
        let deadline = Instant::now() + SHUTDOWN_GRACE;
        for incarnation in incarnations {
            let grace = deadline.saturating_duration_since(Instant::now());
            incarnation.stop(Stop::Graceful, grace).await;
        }
    }
}

impl Drop for SimFleet {
    fn drop(&mut self) {
        for slot in &mut self.slots {
            if let Some(incarnation) = slot.running.get_mut() {
                let _ = incarnation.stop.send(Stop::Graceful);
            }
        }
    }
}

/// Starts one mock engine per config, in the current tokio runtime.
pub async fn start(configs: Vec<SimEngineConfig>) -> Result<SimFleet, EngineSimError> {
    for config in &configs {
        config.validate()?;
    }
    let mut fleet = SimFleet {
        addrs: Vec::with_capacity(configs.len()),
        slots: Vec::with_capacity(configs.len()),
    };
    let origin = Instant::now();
    for (index, mut config) in configs.into_iter().enumerate() {
        let http_listener = bind(config.http_addr)?;
        let http_addr = http_listener.local_addr()?;
        let grpc_listener = match config.grpc_addr {
            Some(addr) => Some(bind(addr)?),
            None => None,
        };
        let grpc_addr = match &grpc_listener {
            Some(listener) => Some(listener.local_addr()?),
            None => None,
        };
        // A restart binds the ports the OS picked, not port 0 again.
        config.http_addr = http_addr;
        config.grpc_addr = grpc_addr;
        let counters = Arc::new(Counters::default());
        let (shared, incarnation) = launch(
            index,
            config.clone(),
            counters.clone(),
            origin,
            http_listener,
            grpc_listener,
        )?;
        fleet.addrs.push(SimEngineAddr {
            index,
            flavour: config.flavour,
            http_addr,
            grpc_addr,
        });
        fleet.slots.push(EngineSlot {
            config,
            counters,
            shared: Mutex::new(shared),
            running: tokio::sync::Mutex::new(Some(incarnation)),
        });
    }
    Ok(fleet)
}

/// Builds a fresh engine on bound listeners and spawns its tasks.
fn launch(
    index: usize,
    config: SimEngineConfig,
    counters: Arc<Counters>,
    origin: Instant,
    http_listener: TcpListener,
    grpc_listener: Option<TcpListener>,
) -> Result<(Arc<EngineShared>, Incarnation), EngineSimError> {
    let mut engine = Engine::new(config.params.clone(), config.seed)?;
    engine.set_token_events(true);
    let (stop, stop_receiver) = watch::channel(Stop::Running);
    let shared = Arc::new(EngineShared {
        index,
        clock: VirtualClock {
            origin,
            time_scale: config.time_scale,
        },
        fault: AtomicU8::new(config.fault as u8),
        next_request_id: AtomicU64::new(1),
        core: Mutex::new(Core {
            engine,
            waiters: HashMap::new(),
            pending: Vec::new(),
            scratch: Vec::new(),
        }),
        wake: Notify::new(),
        stop: stop_receiver,
        counters,
        finished: FinishedCounts::default(),
        config,
    });
    let mut tasks = JoinSet::new();
    if shared.config.mode == ServeMode::Model {
        tasks.spawn(drive(shared.clone()));
    }
    tasks.spawn(http::serve(http_listener, shared.clone()));
    if let Some(listener) = grpc_listener {
        tasks.spawn(grpc::serve(listener, shared.clone()));
    }
    Ok((shared, Incarnation { stop, tasks }))
}

/// Starts `count` engines from one template: engine `i` is seeded with
/// `seed + i`, and a non-zero template port becomes `port + i` (port 0 stays
/// "any free port").
pub async fn start_many(
    template: &SimEngineConfig,
    count: usize,
) -> Result<SimFleet, EngineSimError> {
    let offset = |addr: SocketAddr, index: usize| -> Result<SocketAddr, EngineSimError> {
        if addr.port() == 0 {
            return Ok(addr);
        }
        let port = u16::try_from(usize::from(addr.port()) + index).map_err(|_| {
            EngineSimError::PortOutOfRange {
                base: addr.port(),
                index,
            }
        })?;
        Ok(SocketAddr::new(addr.ip(), port))
    };
    let mut configs = Vec::with_capacity(count);
    for index in 0..count {
        let mut config = template.clone();
        config.seed = template.seed.wrapping_add(index as u64);
        config.http_addr = offset(template.http_addr, index)?;
        config.grpc_addr = match template.grpc_addr {
            Some(addr) => Some(offset(addr, index)?),
            None => None,
        };
        configs.push(config);
    }
    start(configs).await
}

fn bind(addr: SocketAddr) -> Result<TcpListener, EngineSimError> {
    let listen = || {
        let socket = if addr.is_ipv4() {
            TcpSocket::new_v4()?
        } else {
            TcpSocket::new_v6()?
        };
        // A restart rebinds a port whose cut connections sit in TIME_WAIT
        // (tokio's own bind sets this too on Unix; say it outright).
        socket.set_reuseaddr(true)?;
        socket.bind(addr)?;
        // The standard library's backlog: hundreds of clients may connect
        // at once.
        socket.listen(1024)
    };
    listen().map_err(|source| EngineSimError::Bind { addr, source })
}

/// Virtual time = elapsed wall time × time scale.
#[derive(Debug, Clone, Copy)]
struct VirtualClock {
    origin: Instant,
    time_scale: f64,
}

impl VirtualClock {
    fn now_s(&self) -> f64 {
        self.origin.elapsed().as_secs_f64() * self.time_scale
    }

    /// The wall-clock instant of a virtual time (far future if unrepresentable).
    fn instant_at(&self, virtual_s: f64) -> Instant {
        let far = Duration::from_secs(86_400 * 365);
        let wall = Duration::try_from_secs_f64((virtual_s / self.time_scale).max(0.0))
            .unwrap_or(far)
            .min(far);
        self.origin + wall
    }
}

/// What a waiting request hears from the driver.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Progress {
    /// One more token; `generated_tokens` counts all so far.
    Token {
        generated_tokens: u32,
    },
    Finished(RequestRecord),
}

#[derive(Debug)]
struct Core {
    engine: Engine,
    waiters: HashMap<u64, mpsc::UnboundedSender<Progress>>,
    /// Events of the step in progress, not due yet.
    pending: Vec<EngineEvent>,
    scratch: Vec<EngineEvent>,
}

impl Core {
    /// Runs every step that starts by `now_s`, delivers the events due, and
    /// returns the virtual time of the next thing to do.
    fn advance(&mut self, now_s: f64) -> Option<f64> {
        let mut pending = std::mem::take(&mut self.pending);
        pending.retain(|event| {
            if event_time_s(event) <= now_s {
                deliver(&mut self.waiters, event);
                false
            } else {
                true
            }
        });
        while let Some(start_s) = self.engine.next_step_start_s() {
            if start_s > now_s {
                break;
            }
            self.scratch.clear();
            if self.engine.step(start_s, &mut self.scratch).is_none() {
                break;
            }
            for event in &self.scratch {
                if event_time_s(event) <= now_s {
                    deliver(&mut self.waiters, event);
                } else {
                    pending.push(*event);
                }
            }
        }
        self.pending = pending;
        let next_event = self.pending.first().map(event_time_s);
        match (next_event, self.engine.next_step_start_s()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

fn event_time_s(event: &EngineEvent) -> f64 {
    match event {
        EngineEvent::FirstToken { time_s, .. } | EngineEvent::Token { time_s, .. } => *time_s,
        EngineEvent::Finished(record) => record.finish_s,
    }
}

fn deliver(waiters: &mut HashMap<u64, mpsc::UnboundedSender<Progress>>, event: &EngineEvent) {
    match *event {
        EngineEvent::FirstToken { .. } => {}
        EngineEvent::Token {
            id,
            generated_tokens,
            ..
        } => {
            if let Some(waiter) = waiters.get(&id) {
                let _ = waiter.send(Progress::Token { generated_tokens });
            }
        }
        EngineEvent::Finished(record) => {
            if let Some(waiter) = waiters.remove(&record.id) {
                let _ = waiter.send(Progress::Finished(record));
            }
        }
    }
}

/// Everything one engine's tasks share.
#[derive(Debug)]
struct EngineShared {
    index: usize,
    config: SimEngineConfig,
    clock: VirtualClock,
    fault: AtomicU8,
    next_request_id: AtomicU64,
    core: Mutex<Core>,
    /// Wakes the driver when a request arrives.
    wake: Notify,
    stop: watch::Receiver<Stop>,
    /// The slot's, shared by every incarnation.
    counters: Arc<Counters>,
    /// This incarnation's finished generations, reset on restart like the
    /// model's own token counters (what a restarted engine's `/metrics` shows).
    finished: FinishedCounts,
}

/// Generations the model finished, by the finish reason they were answered
/// with (`/metrics`: vLLM's `request_success_total`, SGLang's and
/// TokenSpeed's `num_requests_total`).
#[derive(Debug, Default)]
struct FinishedCounts {
    /// Stopped by `max_tokens` (or its equivalent).
    length: AtomicU64,
    /// Ran to the engine's default length: an unbounded request's "stop".
    stop: AtomicU64,
}

impl FinishedCounts {
    fn count(&self, bounded: bool) {
        let counter = if bounded { &self.length } else { &self.stop };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// (finished by length, finished by stop).
    fn get(&self) -> (u64, u64) {
        (
            self.length.load(Ordering::Relaxed),
            self.stop.load(Ordering::Relaxed),
        )
    }
}

impl EngineShared {
    fn fault(&self) -> FaultMode {
        FaultMode::from_u8(self.fault.load(Ordering::Relaxed))
    }

    fn set_fault(&self, fault: FaultMode) {
        self.fault.store(fault as u8, Ordering::Relaxed);
    }

    /// The true state, advanced to now.
    fn snapshot(&self) -> EngineSnapshot {
        let now_s = self.clock.now_s();
        let mut core = self.core.lock();
        if self.config.mode == ServeMode::Model {
            core.advance(now_s);
        }
        core.engine.snapshot(now_s)
    }

    /// Resolves when this engine stops (fleet shutdown, kill or drop).
    async fn stopped(&self) {
        let mut stop = self.stop.clone();
        let _ = stop.wait_for(|stop| *stop != Stop::Running).await;
    }

    /// Whether the engine is being killed (connections dropped, not drained).
    fn killed(&self) -> bool {
        *self.stop.borrow() == Stop::Kill
    }
}

/// The driver: advances the model to the current virtual time, then sleeps
/// until the next step or event is due, or a request arrives.
async fn drive(shared: Arc<EngineShared>) {
    loop {
        let next_s = {
            let now_s = shared.clock.now_s();
            shared.core.lock().advance(now_s)
        };
        let wake_at = match next_s {
            Some(virtual_s) => shared.clock.instant_at(virtual_s),
            None => Instant::now() + Duration::from_secs(3600),
        };
        tokio::select! {
            () = tokio::time::sleep_until(wake_at) => {}
            () = shared.wake.notified() => {}
            () = shared.stopped() => break,
        }
    }
}
