//! The continuous-batching engine model (`docs/engine-model.md`).
//!
//! An [`Engine`] is a deterministic state machine advanced one scheduler step
//! at a time by its caller, with explicit virtual time in seconds: the fleet
//! simulator drives it from its event queue, the mock servers from the wall
//! clock multiplied by a time-scale factor. Nothing in here sleeps, reads a
//! clock or allocates per step (events go into a caller-owned buffer).

use std::cell::{Cell, RefCell};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

use policy_core::splitmix::{SplitMix64, finalize};
use serde::{Deserialize, Serialize};

use crate::error::EngineError;
use crate::prefix_cache::{MatchStamp, PrefixCache, ROOT, Touch};

/// Per-worker engine parameters. Every field has a default; serde
/// accepts the short names (`prefill_chunk`, `block_size`,
/// `kv_capacity`) as aliases and rejects unknown keys.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineParams {
    /// Prefill speed, tokens per second.
    pub prefill_tps: f64,
    /// Shared prefill budget of one step, tokens.
    #[serde(alias = "prefill_chunk")]
    pub prefill_chunk_tokens: u32,
    /// Fixed cost of a decode step, milliseconds.
    pub decode_base_ms: f64,
    /// Added cost per decoding request in a step, milliseconds.
    pub decode_per_req_ms: f64,
    /// Most requests running at once.
    pub max_running: u32,
    /// KV-cache capacity, tokens.
    #[serde(alias = "kv_capacity")]
    pub kv_capacity_tokens: u64,
    /// Prefix-cache block size, tokens.
    #[serde(alias = "block_size")]
    pub block_size_tokens: u32,
    /// Whether the prefix cache is on.
    pub prefix_cache: bool,
    /// KV usage ratio above which unreferenced cached blocks are evicted (LRU).
    pub cache_high_watermark: f64,
    /// Shortest step while busy, milliseconds.
    pub min_step_ms: f64,
    /// Time constant of the smoothed decode throughput, seconds.
    pub throughput_window_s: f64,
    /// Relative step-time noise: each step lasts `1 ± U(0, step_jitter)` times
    /// its cost, drawn from the engine's seeded generator. 0 = exact.
    pub step_jitter: f64,
}

impl Default for EngineParams {
    fn default() -> EngineParams {
        EngineParams {
            prefill_tps: 8000.0,
            prefill_chunk_tokens: 2048,
            decode_base_ms: 6.0,
            decode_per_req_ms: 0.35,
            max_running: 256,
            kv_capacity_tokens: 524_288,
            block_size_tokens: 16,
            prefix_cache: true,
            cache_high_watermark: 0.95,
            min_step_ms: 1.0,
            throughput_window_s: 1.0,
            step_jitter: 0.0,
        }
    }
}

impl EngineParams {
    /// Checks every parameter's range.
    pub fn validate(&self) -> Result<(), EngineError> {
        fn positive(name: &'static str, value: f64) -> Result<(), EngineError> {
            if value.is_finite() && value > 0.0 {
                Ok(())
            } else {
                Err(EngineError::InvalidParam {
                    name,
                    value,
                    rule: "must be finite and positive",
                })
            }
        }
        fn non_negative(name: &'static str, value: f64) -> Result<(), EngineError> {
            if value.is_finite() && value >= 0.0 {
                Ok(())
            } else {
                Err(EngineError::InvalidParam {
                    name,
                    value,
                    rule: "must be finite and not negative",
                })
            }
        }
        positive("prefill_tps", self.prefill_tps)?;
        positive("prefill_chunk_tokens", f64::from(self.prefill_chunk_tokens))?;
        non_negative("decode_base_ms", self.decode_base_ms)?;
        non_negative("decode_per_req_ms", self.decode_per_req_ms)?;
        positive("max_running", f64::from(self.max_running))?;
        positive("kv_capacity_tokens", self.kv_capacity_tokens as f64)?;
        positive("block_size_tokens", f64::from(self.block_size_tokens))?;
        positive("cache_high_watermark", self.cache_high_watermark)?;
        if self.cache_high_watermark > 1.0 {
            return Err(EngineError::InvalidParam {
                name: "cache_high_watermark",
                value: self.cache_high_watermark,
                rule: "must be at most 1",
            });
        }
        non_negative("min_step_ms", self.min_step_ms)?;
        positive("throughput_window_s", self.throughput_window_s)?;
        non_negative("step_jitter", self.step_jitter)?;
        if self.step_jitter >= 1.0 {
            return Err(EngineError::InvalidParam {
                name: "step_jitter",
                value: self.step_jitter,
                rule: "must be below 1",
            });
        }
        Ok(())
    }

    /// Cost of a step, seconds, before the minimum and jitter:
    /// `max(prefill_tokens / prefill_tps, decode_base + per_req × decoding)`.
    pub fn step_cost_s(&self, prefill_tokens: u32, decoding_requests: u32) -> f64 {
        let prefill_s = f64::from(prefill_tokens) / self.prefill_tps;
        let decode_s = if decoding_requests > 0 {
            (self.decode_base_ms + self.decode_per_req_ms * f64::from(decoding_requests)) / 1000.0
        } else {
            0.0
        };
        prefill_s.max(decode_s)
    }
}

/// One request handed to [`Engine::submit`].
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EngineRequest {
    /// Caller-chosen id, unique among the requests in the engine.
    pub id: u64,
    /// Prompt length, tokens (at least 1 is computed).
    pub prompt_tokens: u32,
    /// Tokens to generate (at least 1).
    pub output_tokens: u32,
    /// Virtual arrival time, seconds.
    pub arrival_s: f64,
    /// Content hashes of the prompt's leading full blocks of
    /// `block_size_tokens` tokens (block `i` covers tokens `16i..16i+16` at the
    /// default size). The engine chains them, so a block hits the prefix cache
    /// only when every block before it does too. Empty = nothing cacheable.
    pub prefix_block_hashes: Vec<u64>,
}

impl EngineRequest {
    /// The chained keys of its blocks, as the prefix cache keys them
    /// ([`chain_block_hashes`] of `prefix_block_hashes`).
    pub fn prefix_chain(&self) -> Vec<u64> {
        chain_block_hashes(&self.prefix_block_hashes)
    }
}

/// What happened to one request, reported when it finishes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RequestRecord {
    pub id: u64,
    pub prompt_tokens: u32,
    pub output_tokens: u32,
    /// Prompt tokens served by the prefix cache at the first admission.
    pub cached_tokens: u32,
    pub arrival_s: f64,
    /// When the request was first admitted (queueing delay = this − arrival).
    pub admitted_s: f64,
    pub first_token_s: f64,
    pub finish_s: f64,
    /// How many times the request was preempted and recomputed.
    pub preemptions: u32,
}

impl RequestRecord {
    /// Time to first token, seconds.
    pub fn ttft_s(&self) -> f64 {
        self.first_token_s - self.arrival_s
    }

    /// End-to-end latency, seconds.
    pub fn e2e_s(&self) -> f64 {
        self.finish_s - self.arrival_s
    }

    /// Mean inter-token latency after the first token, seconds (0 for one token).
    pub fn mean_itl_s(&self) -> f64 {
        if self.output_tokens > 1 {
            (self.finish_s - self.first_token_s) / f64::from(self.output_tokens - 1)
        } else {
            0.0
        }
    }
}

/// Something that happened at the end of a step, at `time_s`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum EngineEvent {
    /// The request's first token (emitted once, even across preemptions).
    FirstToken { id: u64, time_s: f64 },
    /// One generated token; only with [`Engine::set_token_events`] on.
    /// `generated_tokens` counts the tokens generated so far, this one included.
    Token {
        id: u64,
        generated_tokens: u32,
        time_s: f64,
    },
    /// The request generated its last token and left the engine.
    Finished(RequestRecord),
}

/// What one step did.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StepSummary {
    pub start_s: f64,
    pub duration_s: f64,
    pub end_s: f64,
    /// Prompt tokens computed in the step (≤ `prefill_chunk_tokens`).
    pub prefill_tokens: u32,
    /// Requests that decoded one token in the step.
    pub decoding_requests: u32,
    /// Requests admitted from the waiting queue in the step.
    pub admitted_requests: u32,
    /// Requests preempted (and requeued) in the step.
    pub preempted_requests: u32,
    /// Requests that finished at the end of the step.
    pub finished_requests: u32,
}

/// The engine's true state at one moment: what every flavour's report is
/// built from, and what the simulator's oracle reads.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EngineSnapshot {
    pub running_requests: u32,
    pub waiting_requests: u32,
    /// Uncached prompt tokens of the waiting requests plus the unfinished part
    /// of every running request's (chunked) prefill.
    pub queued_prefill_tokens: u64,
    /// KV tokens in use: running requests' own tokens and the cached blocks
    /// they hold. Cached blocks no request holds count as free, as SGLang's
    /// `num_used_tokens` and vLLM's KV usage count them: the engine evicts
    /// them on demand, so a full but idle cache is not memory pressure.
    pub used_kv_tokens: u64,
    pub kv_capacity_tokens: u64,
    pub max_running: u32,
    /// Smoothed decode throughput, tokens per second.
    pub decode_tps: f64,
    /// Cumulative prefix-cache hit ratio over admitted prompt tokens.
    pub cache_hit_rate: f64,
    /// Prompt tokens of the requests whose prefill completed (counter).
    pub prompt_tokens_total: u64,
    /// Generated tokens (counter).
    pub generation_tokens_total: u64,
    /// Prompt tokens looked up in the prefix cache (counter).
    pub prefix_cache_queries_tokens_total: u64,
    /// Prompt tokens served by the prefix cache (counter).
    pub prefix_cache_hits_tokens_total: u64,
    pub finished_requests_total: u64,
    pub preemptions_total: u64,
}

impl EngineSnapshot {
    /// KV usage ratio in `[0, 1]`.
    pub fn kv_usage_ratio(&self) -> f64 {
        if self.kv_capacity_tokens == 0 {
            0.0
        } else {
            (self.used_kv_tokens as f64 / self.kv_capacity_tokens as f64).min(1.0)
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Free,
    Waiting,
    Running,
}

#[derive(Debug)]
struct Slot {
    id: u64,
    phase: Phase,
    prompt_tokens: u32,
    output_tokens: u32,
    arrival_s: f64,
    admitted_s: Option<f64>,
    first_token_s: Option<f64>,
    /// Chained block hashes of the prompt's full blocks: the first
    /// `chain_len` of these (shared with the caller where it shared them).
    chain: Arc<[u64]>,
    chain_len: u32,
    /// Tokens generated, as of decode tick `decode_from` while decoding
    /// (see [`Slot::generated_at`]).
    generated: u32,
    /// Tokens that must be in KV before decoding resumes (prompt + generated
    /// at the latest admission).
    prefill_target: u32,
    /// Of `prefill_target`, tokens computed or served from the cache.
    prefilled: u32,
    cached_tokens_first: Option<u32>,
    /// Leading blocks of `chain` this request holds a reference on.
    pinned_blocks: u32,
    /// The prefix cache's node where those blocks end ([`ROOT`] for none).
    pinned_node: u32,
    /// KV tokens held outside the prefix cache, as of decode tick
    /// `decode_from` while decoding (see [`Slot::private_kv_at`]).
    private_kv: u64,
    /// While decoding: the engine's decode tick when `generated` and
    /// `private_kv` were last brought up to date. Every decode tick since
    /// added a token to each, so a step costs a visit only to the requests
    /// with an event, not to the whole batch.
    decode_from: u64,
    /// While running: its admission's place in the engine's admission
    /// order (the running batch is in this order).
    admission_seq: u64,
    /// While waiting: the leading blocks of `chain` found cached when its
    /// estimate was last brought up to date (the waiting sum counts the
    /// rest of `prefill_target`). A `Cell`, so reads bring it up to date.
    queued_hit_blocks: Cell<u32>,
    /// Where that estimate's match ended in the prefix cache and when: the
    /// estimate is only recomputed once that node changed.
    queued_stamp: Cell<MatchStamp>,
    /// While waiting with a chain: its place in its [`Anchors`] list.
    anchor_pos: Cell<u32>,
    /// While waiting: its node changed since its estimate was made (it is
    /// in [`Engine::stale`]).
    stale: Cell<bool>,
    decoding: bool,
    preemptions: u32,
}

impl Slot {
    /// The chained block hashes of the prompt's full blocks.
    fn chain(&self) -> &[u64] {
        &self.chain[..self.chain_len as usize]
    }

    /// Tokens generated by decode tick `ticks` (the engine's current one).
    fn generated_at(&self, ticks: u64) -> u32 {
        if self.decoding {
            self.generated + (ticks - self.decode_from) as u32
        } else {
            self.generated
        }
    }

    /// KV tokens held outside the prefix cache at decode tick `ticks`.
    fn private_kv_at(&self, ticks: u64) -> u64 {
        if self.decoding {
            self.private_kv + (ticks - self.decode_from)
        } else {
            self.private_kv
        }
    }

    /// Brings `generated` and `private_kv` up to decode tick `ticks`.
    fn settle(&mut self, ticks: u64) {
        self.generated = self.generated_at(ticks);
        self.private_kv = self.private_kv_at(ticks);
        self.decode_from = ticks;
    }

    fn empty(chain: Arc<[u64]>, chain_len: u32) -> Slot {
        Slot {
            id: 0,
            phase: Phase::Free,
            prompt_tokens: 0,
            output_tokens: 0,
            arrival_s: 0.0,
            admitted_s: None,
            first_token_s: None,
            chain,
            chain_len,
            generated: 0,
            prefill_target: 0,
            prefilled: 0,
            cached_tokens_first: None,
            pinned_blocks: 0,
            pinned_node: ROOT,
            private_kv: 0,
            decode_from: 0,
            admission_seq: 0,
            queued_hit_blocks: Cell::new(0),
            queued_stamp: Cell::new(MatchStamp::default()),
            anchor_pos: Cell::new(0),
            stale: Cell::new(false),
            decoding: false,
            preemptions: 0,
        }
    }
}

/// Keys are already well-mixed hashes: pass them through.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct PassThroughHasher(u64);

impl Hasher for PassThroughHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = (self.0 << 8 | u64::from(byte)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_u64(&mut self, value: u64) {
        self.0 = value;
    }
}

pub(crate) type PassThrough = BuildHasherDefault<PassThroughHasher>;

/// The waiting requests with a chain, by the prefix-cache node their
/// estimate's match ended in and the chain's block after it: a change to a
/// node reaches only the requests anchored there (a child inserted, only
/// those whose next block it starts with).
type Anchors = HashMap<u32, HashMap<Option<u64>, Vec<u32>, PassThrough>, PassThrough>;

/// Chains content hashes: block `i`'s key depends on every block before it.
pub fn chain_block_hash(previous: u64, content: u64) -> u64 {
    finalize(previous ^ content.rotate_left(29) ^ 0x243f_6a88_85a3_08d3)
}

/// The chained keys of a prompt's blocks from their content hashes
/// ([`chain_block_hash`] applied in order).
pub fn chain_block_hashes(content_hashes: &[u64]) -> Vec<u64> {
    let mut previous = 0u64;
    content_hashes
        .iter()
        .map(|&content| {
            previous = chain_block_hash(previous, content);
            previous
        })
        .collect()
}

/// One continuous-batching engine (see the module docs and `docs/engine-model.md`).
///
/// Protocol: [`submit`](Engine::submit) requests (each with its arrival time);
/// while [`next_step_start_s`](Engine::next_step_start_s) is `Some(t)`, call
/// [`step`](Engine::step) with a time `≥ t`: the step starts at
/// `max(now_s, t)`, its effects are stamped at its end, and the next step
/// starts there. A request submitted to an idle engine starts the next step at
/// its arrival.
#[derive(Debug)]
pub struct Engine {
    /// The parameters in force: [`nominal`](Engine::nominal_params) at the
    /// current [`speed`](Engine::speed).
    params: EngineParams,
    /// The parameters the engine was created with.
    nominal: EngineParams,
    /// Multiplies the nominal speed (1 = as created).
    speed: f64,
    slots: Vec<Slot>,
    free_slots: Vec<u32>,
    by_id: HashMap<u64, u32, PassThrough>,
    waiting: VecDeque<u32>,
    /// In admission order: the newest is last.
    running: Vec<u32>,
    /// The running requests not decoding yet, in admission order.
    prefilling: Vec<u32>,
    /// Decode ticks so far: one per step, in which every request decoding
    /// at its start generated a token (see `Slot::decode_from`).
    decode_ticks: u64,
    /// Admissions so far (the next one's `Slot::admission_seq`).
    admissions: u64,
    /// The decoding requests by the decode tick at which they generate
    /// their last token: `(tick, admission_seq, slot)`. An entry whose slot
    /// no longer decodes under that admission (preempted, aborted) is
    /// stale and skipped.
    finishing: BinaryHeap<Reverse<(u64, u64, u32)>>,
    /// Reused by `step`: the requests its end visits.
    due: Vec<u32>,
    cache: PrefixCache,
    rng: SplitMix64,
    token_events: bool,
    /// Earliest start of the next step.
    clock_s: f64,
    last_step_end_s: f64,
    private_kv_tokens: u64,
    cached_kv_tokens: u64,
    /// Uncached prompt tokens of the waiting requests, as of their
    /// estimates (see [`Engine::waiting_uncached_tokens`]).
    waiting_uncached_tokens: Cell<u64>,
    running_prefill_remaining_tokens: u64,
    decoding_requests: u32,
    decode_tps: f64,
    /// The waiting requests by where their match ended.
    anchors: RefCell<Anchors>,
    /// Waiting requests whose estimate may be out of date (each once,
    /// flagged by `Slot::stale`).
    stale: RefCell<Vec<u32>>,
    /// Reused for the prefix cache's changes of one step.
    touched: Vec<Touch>,
    prompt_tokens_total: u64,
    generation_tokens_total: u64,
    prefix_queries_tokens_total: u64,
    prefix_hits_tokens_total: u64,
    finished_total: u64,
    preemptions_total: u64,
    steps_total: u64,
    /// Decode steps planned by [`step_ahead`](Engine::step_ahead) and not
    /// yet applied (from `planned_applied` on), in order.
    planned: Vec<PlannedStep>,
    /// How many of `planned` are applied.
    planned_applied: usize,
    /// The chain of a request with none (shared by them all).
    empty_chain: Arc<[u64]>,
}

/// Where a submitted request's chain comes from.
enum ChainSource<'a> {
    /// Chained here from `EngineRequest::prefix_block_hashes`.
    Content,
    /// The caller's chained keys, copied.
    Keys(&'a [u64]),
    /// The caller's chained keys, shared.
    Shared(Arc<[u64]>),
}

/// One decode-only step planned ahead: its times, and the clock-dependent
/// state after it, computed by the very operations [`Engine::step`] does.
#[derive(Debug, Clone)]
struct PlannedStep {
    start_s: f64,
    end_s: f64,
    /// The smoothed decode throughput after the step.
    decode_tps: f64,
    /// The generator after the step's jitter draw.
    rng: SplitMix64,
}

impl Engine {
    /// A new idle engine at virtual time 0.
    pub fn new(params: EngineParams, seed: u64) -> Result<Engine, EngineError> {
        params.validate()?;
        Ok(Engine {
            nominal: params.clone(),
            speed: 1.0,
            params,
            slots: Vec::new(),
            free_slots: Vec::new(),
            by_id: HashMap::default(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            prefilling: Vec::new(),
            decode_ticks: 0,
            admissions: 0,
            finishing: BinaryHeap::new(),
            due: Vec::new(),
            cache: PrefixCache::default(),
            rng: SplitMix64::new(seed),
            token_events: false,
            clock_s: 0.0,
            last_step_end_s: 0.0,
            private_kv_tokens: 0,
            cached_kv_tokens: 0,
            waiting_uncached_tokens: Cell::new(0),
            running_prefill_remaining_tokens: 0,
            decoding_requests: 0,
            decode_tps: 0.0,
            anchors: RefCell::new(HashMap::default()),
            stale: RefCell::new(Vec::new()),
            touched: Vec::new(),
            prompt_tokens_total: 0,
            generation_tokens_total: 0,
            prefix_queries_tokens_total: 0,
            prefix_hits_tokens_total: 0,
            finished_total: 0,
            preemptions_total: 0,
            steps_total: 0,
            planned: Vec::new(),
            planned_applied: 0,
            empty_chain: Arc::from(Vec::new()),
        })
    }

    /// The parameters in force (the nominal ones scaled by the speed).
    pub fn params(&self) -> &EngineParams {
        &self.params
    }

    /// The parameters the engine was created with.
    pub fn nominal_params(&self) -> &EngineParams {
        &self.nominal
    }

    /// The current speed as a multiple of the nominal one.
    pub fn speed(&self) -> f64 {
        self.speed
    }

    /// Runs the engine at `factor` × its nominal speed from its next step on
    /// (a step already planned keeps its duration): `prefill_tps` is the
    /// nominal one × `factor`, and `decode_base_ms`, `decode_per_req_ms` and
    /// `min_step_ms` the nominal ones ÷ `factor`, so every step lasts
    /// 1 / `factor` times as long (jitter aside). 1 restores the nominal
    /// speed. Fails, changing nothing, unless `factor` is finite and positive.
    pub fn set_speed(&mut self, factor: f64) -> Result<(), EngineError> {
        if !(factor.is_finite() && factor > 0.0) {
            return Err(EngineError::InvalidParam {
                name: "speed",
                value: factor,
                rule: "must be finite and positive",
            });
        }
        let params = EngineParams {
            prefill_tps: self.nominal.prefill_tps * factor,
            decode_base_ms: self.nominal.decode_base_ms / factor,
            decode_per_req_ms: self.nominal.decode_per_req_ms / factor,
            min_step_ms: self.nominal.min_step_ms / factor,
            ..self.nominal.clone()
        };
        params.validate()?;
        self.drop_planned();
        self.params = params;
        self.speed = factor;
        Ok(())
    }

    /// Emit an [`EngineEvent::Token`] for every generated token (the mock
    /// servers stream them; the simulator leaves this off).
    pub fn set_token_events(&mut self, on: bool) {
        // Planned steps emit no token events.
        self.drop_planned();
        self.token_events = on;
    }

    /// Whether any request is waiting or running.
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// When the next step can start, or `None` when idle: after
    /// [`step_ahead`](Engine::step_ahead), the end of its last planned step.
    pub fn next_step_start_s(&self) -> Option<f64> {
        self.has_work().then_some(self.run_end_s())
    }

    /// When the steps computed so far end: the last planned decode step's
    /// end after [`step_ahead`](Engine::step_ahead), else the last step's
    /// (the engine's clock). The caller's next [`step`](Engine::step) or
    /// `step_ahead` is due then.
    pub fn run_end_s(&self) -> f64 {
        self.planned.last().map_or(self.clock_s, |step| step.end_s)
    }

    /// Steps executed so far.
    pub fn steps_total(&self) -> u64 {
        self.steps_total
    }

    pub fn running_requests(&self) -> u32 {
        self.running.len() as u32
    }

    pub fn waiting_requests(&self) -> u32 {
        self.waiting.len() as u32
    }

    /// KV tokens held now (running requests' private tokens and cached blocks).
    pub fn used_kv_tokens(&self) -> u64 {
        self.private_kv_tokens + self.cached_kv_tokens
    }

    /// The oracle's signal: uncached prefill work waiting plus the unfinished
    /// part of running (chunked) prefills, tokens.
    pub fn queued_prefill_tokens(&self) -> u64 {
        self.waiting_uncached_tokens() + self.running_prefill_remaining_tokens
    }

    /// [`queued_prefill_tokens`](Engine::queued_prefill_tokens) / `prefill_tps`, seconds.
    pub fn queued_prefill_s(&self) -> f64 {
        self.queued_prefill_tokens() as f64 / self.params.prefill_tps
    }

    /// The smoothed decode throughput at `now_s`, tokens per second (decays
    /// while the engine is idle).
    pub fn decode_tps(&self, now_s: f64) -> f64 {
        let idle_s = now_s - self.last_step_end_s;
        if !self.has_work() && idle_s > 0.0 {
            self.decode_tps * (-idle_s / self.params.throughput_window_s).exp()
        } else {
            self.decode_tps
        }
    }

    /// The true state at `now_s` (only the throughput depends on `now_s`).
    pub fn snapshot(&self, now_s: f64) -> EngineSnapshot {
        EngineSnapshot {
            running_requests: self.running_requests(),
            waiting_requests: self.waiting_requests(),
            queued_prefill_tokens: self.queued_prefill_tokens(),
            used_kv_tokens: self.used_kv_tokens()
                - self.cache.evictable_blocks() * u64::from(self.params.block_size_tokens),
            kv_capacity_tokens: self.params.kv_capacity_tokens,
            max_running: self.params.max_running,
            decode_tps: self.decode_tps(now_s),
            cache_hit_rate: if self.prefix_queries_tokens_total == 0 {
                0.0
            } else {
                self.prefix_hits_tokens_total as f64 / self.prefix_queries_tokens_total as f64
            },
            prompt_tokens_total: self.prompt_tokens_total,
            generation_tokens_total: self.generation_tokens_total,
            prefix_cache_queries_tokens_total: self.prefix_queries_tokens_total,
            prefix_cache_hits_tokens_total: self.prefix_hits_tokens_total,
            finished_requests_total: self.finished_total,
            preemptions_total: self.preemptions_total,
        }
    }

    /// Prompt tokens of a request with these leading block hashes that the
    /// prefix cache would serve now (what [`submit`](Engine::submit) and
    /// admission would find; at least one token is always computed).
    pub fn cached_prompt_tokens(&self, prompt_tokens: u32, prefix_block_hashes: &[u64]) -> u32 {
        if !self.params.prefix_cache {
            return 0;
        }
        let prompt_tokens = prompt_tokens.max(1);
        let block = self.params.block_size_tokens;
        let max_blocks = ((prompt_tokens - 1) / block) as usize;
        let content = &prefix_block_hashes[..prefix_block_hashes.len().min(max_blocks)];
        self.cached_chain_tokens(prompt_tokens, &chain_block_hashes(content))
    }

    /// [`cached_prompt_tokens`](Engine::cached_prompt_tokens) from the
    /// chained keys ([`EngineRequest::prefix_chain`]), for a caller that
    /// asks several engines about one request and chains it once.
    pub fn cached_chain_tokens(&self, prompt_tokens: u32, prefix_chain: &[u64]) -> u32 {
        if !self.params.prefix_cache {
            return 0;
        }
        let block = self.params.block_size_tokens;
        let max_blocks = ((prompt_tokens.max(1) - 1) / block) as usize;
        let chain = &prefix_chain[..prefix_chain.len().min(max_blocks)];
        self.cache.leading_hits(chain) as u32 * block
    }

    /// A cheap lower bound of
    /// [`first_token_projection_s`](Engine::first_token_projection_s): the
    /// step under way ends, then every queued prefill token and the
    /// request's own uncached ones are computed at `prefill_tps` (less the
    /// most the jitter can take off), with nothing else in the way; a
    /// nanosecond less, for rounding. A caller looking for the earliest first
    /// token across engines projects only those whose bound is not already
    /// beaten. `prefix_chain` is the request's
    /// [`prefix_chain`](EngineRequest::prefix_chain).
    pub fn first_token_lower_bound_s(
        &self,
        now_s: f64,
        request: &EngineRequest,
        prefix_chain: &[u64],
    ) -> f64 {
        let prompt_tokens = request.prompt_tokens.max(1);
        let own_uncached = prompt_tokens - self.cached_chain_tokens(prompt_tokens, prefix_chain);
        let tokens = self.queued_prefill_tokens() + u64::from(own_uncached);
        now_s.max(self.clock_s)
            + tokens as f64 / self.params.prefill_tps * (1.0 - self.params.step_jitter)
            - 1e-9
    }

    /// When `request` would get its first token if it were submitted now, at
    /// `now_s`, and nothing else arrived: the engine's next steps projected
    /// from its true state, by the rules of [`step`](Engine::step). The step
    /// under way ends first (the engine's state is already the one at its
    /// end); then each step continues the running prefills oldest first out
    /// of the chunk budget, admits waiting requests in order (this one last)
    /// while the budget, `max_running` and the KV room allow, and lasts
    /// `max(prefill cost, decode cost of the requests decoding)` (at least
    /// `min_step_ms`, with the engine's own jitter draws); decoding requests
    /// finish when their output is done, and requests whose prefill completes
    /// decode from the next step on. The request's own uncached prompt is its
    /// prompt less the prefix-cache hits now.
    ///
    /// Exact (to rounding) while no request is preempted during the
    /// projection and the prefix cache does not change what the waiting
    /// requests hit; the projection never preempts (KV room counts the KV in
    /// use less the evictable cached blocks, a finished request frees its
    /// private KV and its pinned blocks) and keeps each waiting request's
    /// current uncached count. Infinite when the request could never be
    /// admitted. Read-only: the engine is not changed. `prefix_chain` is the
    /// request's [`prefix_chain`](EngineRequest::prefix_chain).
    pub fn first_token_projection_s(
        &self,
        now_s: f64,
        request: &EngineRequest,
        prefix_chain: &[u64],
    ) -> f64 {
        /// A request in the projected running batch that is still prefilling.
        struct Prefilling {
            remaining: u32,
            /// Tokens left to generate, the first one included.
            output: u32,
            /// KV it frees when it finishes, not counting its decode tokens.
            kv: u64,
            target: bool,
        }
        let params = &self.params;
        let block = u64::from(params.block_size_tokens);
        let prompt_tokens = request.prompt_tokens.max(1);
        let own_uncached = prompt_tokens - self.cached_chain_tokens(prompt_tokens, prefix_chain);
        // (finish step, KV freed then): requests decoding.
        let mut decoding: BinaryHeap<Reverse<(u64, u64)>> = BinaryHeap::new();
        let mut prefilling: VecDeque<Prefilling> = VecDeque::new();
        let ticks = self.decode_ticks;
        for &index in &self.running {
            let slot = &self.slots[index as usize];
            let output = slot
                .output_tokens
                .saturating_sub(slot.generated_at(ticks))
                .max(1);
            let kv = slot.private_kv_at(ticks) + u64::from(slot.pinned_blocks) * block;
            if slot.decoding {
                let output = u64::from(output);
                decoding.push(Reverse((output - 1, kv + output)));
            } else {
                prefilling.push_back(Prefilling {
                    remaining: slot.prefill_target.saturating_sub(slot.prefilled),
                    output,
                    kv,
                    target: false,
                });
            }
        }
        self.refresh_waiting_estimates();
        let waiting = self
            .waiting
            .iter()
            .map(|&index| {
                let slot = &self.slots[index as usize];
                let uncached = self.queued_uncached(slot) as u32;
                Prefilling {
                    remaining: uncached,
                    output: slot.output_tokens.saturating_sub(slot.generated).max(1),
                    kv: u64::from(slot.prefill_target) + 1,
                    target: false,
                }
            })
            .chain(std::iter::once(Prefilling {
                remaining: own_uncached,
                output: request.output_tokens.max(1),
                kv: u64::from(prompt_tokens) + 1,
                target: true,
            }));
        let mut waiting = waiting.peekable();
        // KV room: capacity less what is held, evictable cached blocks counted free.
        let evictable = self.cache.evictable_blocks() * block;
        let mut free_kv = i128::from(params.kv_capacity_tokens) - i128::from(self.used_kv_tokens())
            + i128::from(evictable);
        let min_step_s = params.min_step_ms / 1000.0;
        let mut rng = self.rng.clone();
        let mut time_s = now_s.max(self.clock_s);
        // A bound on the steps: every step computes a prompt token or
        // decodes one, or nothing will ever change.
        for step in 0u64.. {
            let decoding_requests = decoding.len() as u32;
            let mut budget = params.prefill_chunk_tokens;
            let mut prefill_tokens = 0u32;
            for entry in prefilling.iter_mut() {
                if budget == 0 {
                    break;
                }
                let take = budget.min(entry.remaining);
                entry.remaining -= take;
                budget -= take;
                prefill_tokens += take;
            }
            while budget > 0 && ((decoding.len() + prefilling.len()) as u32) < params.max_running {
                let Some(head) = waiting.peek() else {
                    break;
                };
                let needed = i128::from(head.remaining) + 1;
                if needed + i128::from(decoding_requests) > free_kv {
                    break;
                }
                let Some(mut entry) = waiting.next() else {
                    break;
                };
                free_kv -= needed;
                let take = budget.min(entry.remaining);
                entry.remaining -= take;
                budget -= take;
                prefill_tokens += take;
                prefilling.push_back(entry);
            }
            if prefill_tokens == 0 && decoding_requests == 0 {
                // Nothing can run: the request would wait forever.
                return f64::INFINITY;
            }
            let mut duration_s = params
                .step_cost_s(prefill_tokens, decoding_requests)
                .max(min_step_s);
            if params.step_jitter > 0.0 {
                let noise = 2.0 * rng.next_unit() - 1.0;
                duration_s *= 1.0 + params.step_jitter * noise;
            }
            let end_s = time_s + duration_s;
            free_kv -= i128::from(decoding_requests);
            while let Some(&Reverse((finish, kv))) = decoding.peek() {
                if finish > step {
                    break;
                }
                decoding.pop();
                free_kv += i128::from(kv);
            }
            while prefilling.front().is_some_and(|entry| entry.remaining == 0) {
                let Some(entry) = prefilling.pop_front() else {
                    break;
                };
                if entry.target {
                    return end_s;
                }
                let output = u64::from(entry.output);
                if output <= 1 {
                    free_kv += i128::from(entry.kv);
                } else {
                    decoding.push(Reverse((step + output - 1, entry.kv + output - 1)));
                }
            }
            time_s = end_s;
        }
        f64::INFINITY
    }

    /// Queues a request at the tail of the waiting queue.
    ///
    /// Fails when its id is already in the engine, or when prompt + output
    /// could never fit in the KV cache.
    pub fn submit(&mut self, request: EngineRequest) -> Result<(), EngineError> {
        self.submit_with_chain(request, ChainSource::Content)
    }

    /// [`submit`](Engine::submit) for a caller that already chained the
    /// request's block hashes (to route it, say): `prefix_chain` stands for
    /// [`chain_block_hashes`] of the prompt's content hashes, and
    /// `request.prefix_block_hashes` is not read (it may be left empty).
    pub fn submit_chained(
        &mut self,
        request: EngineRequest,
        prefix_chain: &[u64],
    ) -> Result<(), EngineError> {
        self.submit_with_chain(request, ChainSource::Keys(prefix_chain))
    }

    /// [`submit_chained`](Engine::submit_chained) sharing the caller's chain
    /// rather than copying it (a long prompt's chain is thousands of keys).
    pub fn submit_shared(
        &mut self,
        request: EngineRequest,
        prefix_chain: Arc<[u64]>,
    ) -> Result<(), EngineError> {
        self.submit_with_chain(request, ChainSource::Shared(prefix_chain))
    }

    fn submit_with_chain(
        &mut self,
        request: EngineRequest,
        prefix_chain: ChainSource<'_>,
    ) -> Result<(), EngineError> {
        let prompt_tokens = request.prompt_tokens.max(1);
        let output_tokens = request.output_tokens.max(1);
        let needed_tokens = u64::from(prompt_tokens) + u64::from(output_tokens);
        if needed_tokens > self.params.kv_capacity_tokens {
            return Err(EngineError::RequestTooLarge {
                id: request.id,
                needed_tokens,
                capacity_tokens: self.params.kv_capacity_tokens,
            });
        }
        if self.by_id.contains_key(&request.id) {
            return Err(EngineError::DuplicateRequest { id: request.id });
        }
        // The steps already under way at its arrival happen; the planned
        // ones after it are planned again with the request waiting.
        self.advance_to(request.arrival_s);
        self.drop_planned();
        if !self.has_work() {
            self.clock_s = self.clock_s.max(request.arrival_s);
        }
        let full_blocks = (prompt_tokens / self.params.block_size_tokens) as usize;
        let chain = if !self.params.prefix_cache {
            self.empty_chain.clone()
        } else {
            match prefix_chain {
                ChainSource::Shared(keys) => keys,
                ChainSource::Keys(keys) => Arc::from(&keys[..keys.len().min(full_blocks)]),
                ChainSource::Content => {
                    let mut previous = 0u64;
                    request
                        .prefix_block_hashes
                        .iter()
                        .take(full_blocks)
                        .map(|&content| {
                            previous = chain_block_hash(previous, content);
                            previous
                        })
                        .collect()
                }
            }
        };
        let chain_len = chain.len().min(full_blocks) as u32;
        let index = match self.free_slots.pop() {
            Some(index) => index,
            None => {
                self.slots.push(Slot::empty(self.empty_chain.clone(), 0));
                (self.slots.len() - 1) as u32
            }
        };
        self.slots[index as usize] = Slot {
            id: request.id,
            phase: Phase::Waiting,
            prompt_tokens,
            output_tokens,
            arrival_s: request.arrival_s,
            prefill_target: prompt_tokens,
            ..Slot::empty(chain, chain_len)
        };
        self.by_id.insert(request.id, index);
        self.enqueue(index, false);
        Ok(())
    }

    /// Removes a request wherever it is (a client went away); its KV is
    /// freed and no event is emitted. False when the id is unknown. Decode
    /// steps planned by [`step_ahead`](Engine::step_ahead) and not applied
    /// are dropped first: call [`advance_to`](Engine::advance_to) before, to
    /// keep those that started by then.
    pub fn abort(&mut self, id: u64) -> bool {
        let Some(&index) = self.by_id.get(&id) else {
            return false;
        };
        self.drop_planned();
        match self.slots[index as usize].phase {
            Phase::Waiting => {
                if let Some(position) = self.waiting.iter().position(|&i| i == index) {
                    self.waiting.remove(position);
                }
                self.dequeue_estimate(index);
            }
            Phase::Running => {
                if let Some(position) = self.running.iter().position(|&i| i == index) {
                    self.running.remove(position);
                }
                self.release(index);
            }
            Phase::Free => return false,
        }
        self.free_slot(index);
        true
    }

    /// Runs one scheduler step starting at `max(now_s, next_step_start_s)`,
    /// appends its events to `events` (stamped at the step's end) and returns
    /// what it did; `None` when the engine is idle.
    ///
    /// Decode steps planned by [`step_ahead`](Engine::step_ahead) are applied
    /// first: this step is the one after them.
    pub fn step(&mut self, now_s: f64, events: &mut Vec<EngineEvent>) -> Option<StepSummary> {
        self.apply_planned(self.planned.len() - self.planned_applied);
        if !self.has_work() {
            return None;
        }
        let start_s = now_s.max(self.clock_s);
        let idle_s = start_s - self.last_step_end_s;
        if idle_s > 0.0 {
            self.decode_tps *= (-idle_s / self.params.throughput_window_s).exp();
        }
        let mut summary = StepSummary {
            start_s,
            ..StepSummary::default()
        };
        let capacity = self.params.kv_capacity_tokens;

        // Keep the prefix cache below its high watermark.
        if self.params.prefix_cache {
            let watermark = (self.params.cache_high_watermark * capacity as f64) as u64;
            self.evict_down_to(watermark);
        }

        // 1. Room for one more token per decoding request, preempting the
        // newest running request while it does not fit.
        while self.used_kv_tokens() + u64::from(self.decoding_requests) > capacity {
            let excess = self.used_kv_tokens() + u64::from(self.decoding_requests) - capacity;
            if self.evict_blocks(excess.div_ceil(u64::from(self.params.block_size_tokens))) > 0 {
                continue;
            }
            if self.running.len() <= 1 {
                break;
            }
            if let Some(victim) = self.running.pop() {
                self.preempt(victim);
                summary.preempted_requests += 1;
            }
        }
        let decoding = self.decoding_requests;
        let reserved_decode_tokens = u64::from(decoding);

        // 2. Continue unfinished (chunked) prefills, oldest first.
        let mut budget = self.params.prefill_chunk_tokens;
        for &index in &self.prefilling {
            if budget == 0 {
                break;
            }
            let slot = &mut self.slots[index as usize];
            if slot.decoding || slot.prefilled >= slot.prefill_target {
                continue;
            }
            let take = budget.min(slot.prefill_target - slot.prefilled);
            slot.prefilled += take;
            budget -= take;
            summary.prefill_tokens += take;
            self.running_prefill_remaining_tokens -= u64::from(take);
        }

        // 3. Admit waiting requests FIFO while the prefill budget, the running
        // limit and the KV cache allow (not in a step that had to preempt).
        if summary.preempted_requests == 0 {
            while budget > 0 && (self.running.len() as u32) < self.params.max_running {
                let Some(&index) = self.waiting.front() else {
                    break;
                };
                if !self.try_admit(index, reserved_decode_tokens, start_s) {
                    break;
                }
                self.waiting.pop_front();
                self.running.push(index);
                self.prefilling.push(index);
                summary.admitted_requests += 1;
                let slot = &mut self.slots[index as usize];
                slot.admission_seq = self.admissions;
                self.admissions += 1;
                let take = budget.min(slot.prefill_target - slot.prefilled);
                slot.prefilled += take;
                budget -= take;
                summary.prefill_tokens += take;
                self.running_prefill_remaining_tokens -= u64::from(take);
            }
        }

        // 4. The step's duration.
        let mut duration_s = self
            .params
            .step_cost_s(summary.prefill_tokens, decoding)
            .max(self.params.min_step_ms / 1000.0);
        if self.params.step_jitter > 0.0 {
            let noise = 2.0 * self.rng.next_unit() - 1.0;
            duration_s *= 1.0 + self.params.step_jitter * noise;
        }
        let end_s = start_s + duration_s;
        summary.duration_s = duration_s;
        summary.end_s = end_s;
        summary.decoding_requests = decoding;

        // 5. Apply the step's effects at its end. Every request decoding
        // since the step's start generates a token (one decode tick for
        // all); only the requests with an event are visited: those whose
        // prefill completes, and those generating their last token (every
        // running request with token events on), in admission order.
        self.decode_ticks += 1;
        let ticks = self.decode_ticks;
        self.private_kv_tokens += u64::from(decoding);
        let mut generated_tokens = u64::from(decoding);
        let mut due = std::mem::take(&mut self.due);
        due.clear();
        while let Some(&Reverse((tick, seq, index))) = self.finishing.peek() {
            if tick > ticks {
                break;
            }
            self.finishing.pop();
            let slot = &self.slots[index as usize];
            let live = slot.phase == Phase::Running && slot.decoding && slot.admission_seq == seq;
            if live && !self.token_events {
                due.push(index);
            }
        }
        if self.token_events {
            due.extend_from_slice(&self.running);
        } else {
            due.extend(self.prefilling.iter().copied().filter(|&index| {
                let slot = &self.slots[index as usize];
                slot.prefilled >= slot.prefill_target
            }));
            let slots = &self.slots;
            due.sort_unstable_by_key(|&index| slots[index as usize].admission_seq);
        }
        for &index in &due {
            let slot = &mut self.slots[index as usize];
            let mut prefill_done = false;
            let produced = if slot.decoding {
                true
            } else if slot.prefilled >= slot.prefill_target {
                // Prefill done: this forward pass yields the next token (its
                // KV slot was reserved at admission).
                slot.decoding = true;
                slot.decode_from = ticks;
                self.decoding_requests += 1;
                if slot.generated == 0 {
                    self.prompt_tokens_total += u64::from(slot.prompt_tokens);
                }
                slot.generated += 1;
                generated_tokens += 1;
                prefill_done = true;
                true
            } else {
                false
            };
            let mut finished = false;
            if produced {
                let generated = slot.generated_at(ticks);
                let id = slot.id;
                if slot.first_token_s.is_none() {
                    slot.first_token_s = Some(end_s);
                    events.push(EngineEvent::FirstToken { id, time_s: end_s });
                }
                if self.token_events {
                    events.push(EngineEvent::Token {
                        id,
                        generated_tokens: generated,
                        time_s: end_s,
                    });
                }
                finished = generated >= slot.output_tokens;
                if prefill_done && !finished {
                    let last_tick = ticks + u64::from(slot.output_tokens - generated);
                    self.finishing
                        .push(Reverse((last_tick, slot.admission_seq, index)));
                }
            }
            if prefill_done {
                self.cache_prompt_blocks(index);
            }
            if finished {
                let slot = &self.slots[index as usize];
                let record = RequestRecord {
                    id: slot.id,
                    prompt_tokens: slot.prompt_tokens,
                    output_tokens: slot.output_tokens,
                    cached_tokens: slot.cached_tokens_first.unwrap_or(0),
                    arrival_s: slot.arrival_s,
                    admitted_s: slot.admitted_s.unwrap_or(start_s),
                    first_token_s: slot.first_token_s.unwrap_or(end_s),
                    finish_s: end_s,
                    preemptions: slot.preemptions,
                };
                events.push(EngineEvent::Finished(record));
                self.release(index);
                self.free_slot(index);
                self.finished_total += 1;
                summary.finished_requests += 1;
            }
        }
        if summary.finished_requests > 0 {
            // Both in admission order: one pass takes the finished out.
            let slots = &self.slots;
            due.retain(|&index| slots[index as usize].phase == Phase::Free);
            let mut next = 0;
            self.running.retain(|&index| {
                let gone = due.get(next) == Some(&index);
                next += usize::from(gone);
                !gone
            });
            debug_assert_eq!(next, due.len());
        }
        let slots = &self.slots;
        self.prefilling.retain(|&index| {
            let slot = &slots[index as usize];
            slot.phase == Phase::Running && !slot.decoding
        });
        self.due = due;

        self.generation_tokens_total += generated_tokens;
        let alpha = 1.0 - (-duration_s / self.params.throughput_window_s).exp();
        let instant_tps = generated_tokens as f64 / duration_s;
        self.decode_tps += alpha * (instant_tps - self.decode_tps);
        self.clock_s = end_s;
        self.last_step_end_s = end_s;
        self.steps_total += 1;
        self.mark_stale_estimates();
        Some(summary)
    }

    /// [`step`](Engine::step), then, when the steps after it would only
    /// decode and emit nothing, plans them too, up to the step before the
    /// first request finishes: no request to admit or prefill, every running
    /// request decoding, no token events, and KV room without preempting
    /// (the prefix cache's watermark evictions are planned in). The caller's
    /// next `step_ahead` is due at [`next_step_start_s`](Engine::next_step_start_s),
    /// the last planned step's end, so a long decode costs one call per
    /// batch change rather than one per token.
    ///
    /// The planned steps are applied lazily, by the very operations `step`
    /// would run (the clock and the smoothed throughput are bit-identical to
    /// stepping one step at a time): the state read between calls is the
    /// one after the steps applied so far, so a caller reading it at `now_s`
    /// calls [`advance_to`](Engine::advance_to) first. A
    /// [`submit`](Engine::submit) applies the steps started by its arrival
    /// and drops the rest (they are planned again with the request waiting),
    /// as do [`set_speed`](Engine::set_speed) and [`abort`](Engine::abort)
    /// (after `advance_to`): the next step is due earlier then.
    pub fn step_ahead(&mut self, now_s: f64, events: &mut Vec<EngineEvent>) -> Option<StepSummary> {
        let emitted = events.len();
        let summary = self.step(now_s, events)?;
        if events.len() == emitted {
            self.plan_decode_run();
        }
        Some(summary)
    }

    /// Applies the steps planned by [`step_ahead`](Engine::step_ahead) that
    /// started by `now_s` (each one's effects are in force from its start,
    /// as `step` applies them), so that the reads see the state at `now_s`.
    /// The rest stay planned.
    pub fn advance_to(&mut self, now_s: f64) {
        let started = self.planned[self.planned_applied..].partition_point(|s| s.start_s <= now_s);
        self.apply_planned(started);
    }

    /// Forgets the planned steps not applied: the next step is due at the
    /// end of the last applied one.
    fn drop_planned(&mut self) {
        self.planned.clear();
        self.planned_applied = 0;
    }

    /// Applies the next `steps` planned decode steps: the watermark
    /// evictions step by step (as `step` runs them), then each running
    /// request's tokens and KV once for all of them, and the clock, the
    /// throughput and the generator as they were after the last one.
    fn apply_planned(&mut self, steps: usize) {
        if steps == 0 {
            return;
        }
        let decoding = u64::from(self.decoding_requests);
        let watermark =
            (self.params.cache_high_watermark * self.params.kv_capacity_tokens as f64) as u64;
        for _ in 0..steps {
            if self.params.prefix_cache {
                self.evict_down_to(watermark);
            }
            // Planned only with room for every decoding request's token.
            debug_assert!(self.used_kv_tokens() + decoding <= self.params.kv_capacity_tokens);
            // Each step's tokens count before the next step's check.
            self.private_kv_tokens += decoding;
        }
        let count = steps as u32;
        // Every running request decodes: its tokens and KV follow the ticks.
        self.decode_ticks += u64::from(count);
        self.generation_tokens_total += decoding * u64::from(count);
        self.steps_total += u64::from(count);
        let last = &self.planned[self.planned_applied + steps - 1];
        self.decode_tps = last.decode_tps;
        self.clock_s = last.end_s;
        self.last_step_end_s = last.end_s;
        self.rng = last.rng.clone();
        self.planned_applied += steps;
        if self.planned_applied == self.planned.len() {
            self.drop_planned();
        }
        self.mark_stale_estimates();
    }

    /// Plans the decode-only steps after the one just run (see
    /// [`step_ahead`](Engine::step_ahead)): each step's duration, end and
    /// throughput update are computed exactly as `step` computes them.
    fn plan_decode_run(&mut self) {
        self.drop_planned();
        let decoding = self.decoding_requests;
        if self.token_events || decoding == 0 || decoding as usize != self.running.len() {
            return;
        }
        // A waiting request would be admitted (or tried) by the next step.
        if !self.waiting.is_empty() && (self.running.len() as u32) < self.params.max_running {
            return;
        }
        let steps_left = self.ticks_to_first_finish();
        // The step that finishes a request emits an event: `step` runs it.
        let steps = steps_left.saturating_sub(1);
        if steps == 0 {
            return;
        }
        let params = &self.params;
        let capacity = params.kv_capacity_tokens;
        let watermark = (params.cache_high_watermark * capacity as f64) as u64;
        let block = u64::from(params.block_size_tokens);
        let tokens = u64::from(decoding);
        let cost_s = params
            .step_cost_s(0, decoding)
            .max(params.min_step_ms / 1000.0);
        let alpha_fixed = 1.0 - (-cost_s / params.throughput_window_s).exp();
        let instant_fixed = tokens as f64 / cost_s;
        let mut used = self.used_kv_tokens();
        let mut evictable = self.cache.evictable_blocks();
        let mut rng = self.rng.clone();
        let mut start_s = self.clock_s;
        let mut decode_tps = self.decode_tps;
        self.planned.reserve(steps as usize);
        for _ in 0..steps {
            if params.prefix_cache {
                // `evict_one` succeeds while any block is unreferenced.
                while used > watermark && evictable > 0 {
                    used -= block;
                    evictable -= 1;
                }
            }
            if used + tokens > capacity {
                // That step evicts or preempts for room: `step` runs it.
                break;
            }
            let (duration_s, alpha, instant_tps) = if params.step_jitter > 0.0 {
                let noise = 2.0 * rng.next_unit() - 1.0;
                let duration_s = cost_s * (1.0 + params.step_jitter * noise);
                (
                    duration_s,
                    1.0 - (-duration_s / params.throughput_window_s).exp(),
                    tokens as f64 / duration_s,
                )
            } else {
                (cost_s, alpha_fixed, instant_fixed)
            };
            let end_s = start_s + duration_s;
            decode_tps += alpha * (instant_tps - decode_tps);
            used += tokens;
            self.planned.push(PlannedStep {
                start_s,
                end_s,
                decode_tps,
                rng: rng.clone(),
            });
            start_s = end_s;
        }
    }

    /// Decode ticks until the first decoding request generates its last
    /// token (0 when none decodes); drops the stale entries on the way.
    fn ticks_to_first_finish(&mut self) -> u32 {
        while let Some(&Reverse((tick, seq, index))) = self.finishing.peek() {
            let slot = &self.slots[index as usize];
            if slot.phase == Phase::Running && slot.decoding && slot.admission_seq == seq {
                return (tick - self.decode_ticks) as u32;
            }
            self.finishing.pop();
        }
        0
    }

    /// Puts a waiting request in the queue (tail, or head when preempted) and
    /// counts its uncached prompt in the waiting sum.
    ///
    /// The waiting sum is always the sum of the stored estimates, current or
    /// not; a read brings them all up to date (see
    /// [`refresh_waiting_estimates`](Engine::refresh_waiting_estimates)).
    fn enqueue(&mut self, index: u32, at_head: bool) {
        let (hit_blocks, stamp) = self.cached_prefix_blocks_stamped(index);
        let slot = &mut self.slots[index as usize];
        slot.phase = Phase::Waiting;
        slot.queued_hit_blocks.set(hit_blocks);
        slot.queued_stamp.set(stamp);
        slot.stale.set(false);
        self.anchor(index);
        let uncached = self.queued_uncached(&self.slots[index as usize]);
        self.waiting_uncached_tokens
            .set(self.waiting_uncached_tokens.get() + uncached);
        if at_head {
            self.waiting.push_front(index);
        } else {
            self.waiting.push_back(index);
        }
    }

    /// Takes a request that leaves the waiting queue out of the waiting sum.
    fn dequeue_estimate(&self, index: u32) {
        self.unanchor(index);
        let slot = &self.slots[index as usize];
        slot.stale.set(false);
        let uncached = self.queued_uncached(slot);
        self.waiting_uncached_tokens
            .set(self.waiting_uncached_tokens.get() - uncached);
        slot.queued_hit_blocks.set(0);
    }

    /// A waiting request's uncached prompt tokens as last estimated.
    fn queued_uncached(&self, slot: &Slot) -> u64 {
        u64::from(
            slot.prefill_target - slot.queued_hit_blocks.get() * self.params.block_size_tokens,
        )
    }

    /// Uncached prompt tokens of the waiting requests, following the prefix
    /// cache as it is now.
    fn waiting_uncached_tokens(&self) -> u64 {
        self.refresh_waiting_estimates();
        self.waiting_uncached_tokens.get()
    }

    /// Files a waiting request under the node its match ended in.
    fn anchor(&self, index: u32) {
        let slot = &self.slots[index as usize];
        if !self.params.prefix_cache || slot.chain().is_empty() {
            return;
        }
        let stamp = slot.queued_stamp.get();
        let mut anchors = self.anchors.borrow_mut();
        let list = anchors
            .entry(stamp.node())
            .or_default()
            .entry(stamp.next())
            .or_default();
        slot.anchor_pos.set(list.len() as u32);
        list.push(index);
    }

    /// Takes a waiting request out of [`anchor`](Engine::anchor)'s lists.
    fn unanchor(&self, index: u32) {
        let slot = &self.slots[index as usize];
        if !self.params.prefix_cache || slot.chain().is_empty() {
            return;
        }
        let stamp = slot.queued_stamp.get();
        let mut anchors = self.anchors.borrow_mut();
        let Some(by_next) = anchors.get_mut(&stamp.node()) else {
            return;
        };
        let Some(list) = by_next.get_mut(&stamp.next()) else {
            return;
        };
        let position = slot.anchor_pos.get() as usize;
        if list.get(position) != Some(&index) {
            return;
        }
        list.swap_remove(position);
        if let Some(&moved) = list.get(position) {
            self.slots[moved as usize].anchor_pos.set(position as u32);
        }
        if list.is_empty() {
            by_next.remove(&stamp.next());
            if by_next.is_empty() {
                anchors.remove(&stamp.node());
            }
        }
    }

    /// After a step: flags the waiting requests whose match ended in a
    /// prefix-cache node the step changed (see `MatchStamp`); the others'
    /// estimates still hold.
    fn mark_stale_estimates(&mut self) {
        self.cache.take_touched(&mut self.touched);
        let anchors = self.anchors.get_mut();
        let stale = self.stale.get_mut();
        let slots = &self.slots;
        let mut flag = |list: &Vec<u32>| {
            for &index in list {
                let slot = &slots[index as usize];
                if !slot.stale.get() {
                    slot.stale.set(true);
                    stale.push(index);
                }
            }
        };
        for &touch in &self.touched {
            match touch {
                Touch::Node(node) => {
                    for list in anchors.get(&node).into_iter().flat_map(|m| m.values()) {
                        flag(list);
                    }
                }
                Touch::Grown(node, first) => {
                    if let Some(list) = anchors.get(&node).and_then(|m| m.get(&Some(first))) {
                        flag(list);
                    }
                }
            }
        }
    }

    /// Brings the waiting requests' uncached estimates up to date where the
    /// prefix cache changed (blocks inserted or evicted) under them, so the
    /// reported queued tokens follow the cache.
    ///
    /// Done when read (a poll, the oracle) rather than after every step,
    /// and only for the requests flagged by
    /// [`mark_stale_estimates`](Engine::mark_stale_estimates): a deep queue
    /// under overload costs only where the cache changed under it, not a
    /// check per waiting request per read. A request whose node only changed
    /// elsewhere (a child it does not go on into, blocks cut past its
    /// match) keeps its count; the others walk again from that node.
    fn refresh_waiting_estimates(&self) {
        let mut stale = self.stale.borrow_mut();
        if stale.is_empty() {
            return;
        }
        let block = self.params.block_size_tokens;
        let mut sum = self.waiting_uncached_tokens.get();
        for index in stale.drain(..) {
            let slot = &self.slots[index as usize];
            if !slot.stale.get() {
                continue;
            }
            slot.stale.set(false);
            let before = slot.queued_hit_blocks.get();
            let after = match self.cache.hits_since(slot.queued_stamp.get()) {
                Some(hits) => hits as u32,
                None => {
                    let max_blocks = ((slot.prefill_target - 1) / block) as usize;
                    let (hits, stamp) = self.cache.leading_hits_from(
                        &slot.chain()[..slot.chain().len().min(max_blocks)],
                        slot.queued_stamp.get(),
                    );
                    if (stamp.node(), stamp.next())
                        != (
                            slot.queued_stamp.get().node(),
                            slot.queued_stamp.get().next(),
                        )
                    {
                        self.unanchor(index);
                        slot.queued_stamp.set(stamp);
                        self.anchor(index);
                    } else {
                        slot.queued_stamp.set(stamp);
                    }
                    hits as u32
                }
            };
            if after != before {
                sum = sum + u64::from(before * block) - u64::from(after * block);
                slot.queued_hit_blocks.set(after);
            }
        }
        self.waiting_uncached_tokens.set(sum);
    }

    /// Prompt tokens of this request the cache would serve now (at least one
    /// token is always computed).
    fn cached_prefix_tokens(&self, index: u32) -> u32 {
        let slot = &self.slots[index as usize];
        if !self.params.prefix_cache || slot.chain().is_empty() {
            return 0;
        }
        let block = self.params.block_size_tokens;
        let max_blocks = ((slot.prefill_target - 1) / block) as usize;
        let hits = self
            .cache
            .leading_hits(&slot.chain()[..slot.chain().len().min(max_blocks)]);
        hits as u32 * block
    }

    /// [`cached_prefix_tokens`](Engine::cached_prefix_tokens) in blocks,
    /// with the stamp that tells when they may change.
    fn cached_prefix_blocks_stamped(&self, index: u32) -> (u32, MatchStamp) {
        let slot = &self.slots[index as usize];
        if !self.params.prefix_cache || slot.chain().is_empty() {
            return (0, MatchStamp::default());
        }
        let block = self.params.block_size_tokens;
        let max_blocks = ((slot.prefill_target - 1) / block) as usize;
        let (hits, stamp) = self
            .cache
            .leading_hits_stamped(&slot.chain()[..slot.chain().len().min(max_blocks)]);
        (hits as u32, stamp)
    }

    /// Admits the head of the queue if the KV cache has room for its uncached
    /// prompt and its first token (evicting unreferenced cached blocks if needed).
    fn try_admit(&mut self, index: u32, reserved_tokens: u64, now_s: f64) -> bool {
        let capacity = self.params.kv_capacity_tokens;
        let cached = self.cached_prefix_tokens(index);
        let hit_blocks = cached / self.params.block_size_tokens;
        let pinned_node = self
            .cache
            .pin(self.slots[index as usize].chain(), hit_blocks as usize);
        let needed = u64::from(self.slots[index as usize].prefill_target - cached) + 1;
        let wanted_tokens = self.used_kv_tokens() + reserved_tokens + needed;
        if wanted_tokens > capacity {
            let blocks =
                (wanted_tokens - capacity).div_ceil(u64::from(self.params.block_size_tokens));
            if self.evict_blocks(blocks) < blocks {
                self.cache.unpin(pinned_node);
                return false;
            }
        }
        let slot = &mut self.slots[index as usize];
        slot.phase = Phase::Running;
        slot.pinned_blocks = hit_blocks;
        slot.pinned_node = pinned_node;
        slot.prefilled = cached;
        slot.private_kv = needed;
        slot.decoding = false;
        if slot.admitted_s.is_none() {
            slot.admitted_s = Some(now_s);
        }
        if slot.cached_tokens_first.is_none() {
            slot.cached_tokens_first = Some(cached);
        }
        self.private_kv_tokens += needed;
        let prefill_target = slot.prefill_target;
        self.dequeue_estimate(index);
        self.running_prefill_remaining_tokens += u64::from(prefill_target - cached);
        self.prefix_queries_tokens_total += u64::from(prefill_target);
        self.prefix_hits_tokens_total += u64::from(cached);
        true
    }

    /// After a prefill completes, moves the prompt's full blocks from the
    /// request's private KV into the prefix cache.
    fn cache_prompt_blocks(&mut self, index: u32) {
        if !self.params.prefix_cache {
            return;
        }
        let block = u64::from(self.params.block_size_tokens);
        let slot = &mut self.slots[index as usize];
        let (deepest, added_blocks) =
            self.cache
                .insert(&slot.chain, slot.chain_len as usize, slot.pinned_node);
        let moved = (slot.chain().len() - slot.pinned_blocks as usize) as u64 * block;
        self.cached_kv_tokens += added_blocks as u64 * block;
        slot.private_kv -= moved;
        self.private_kv_tokens -= moved;
        slot.pinned_blocks = slot.chain_len;
        slot.pinned_node = deepest;
    }

    /// Frees a running request's KV and drops its cache references.
    fn release(&mut self, index: u32) {
        let slot = &mut self.slots[index as usize];
        slot.settle(self.decode_ticks);
        if !slot.decoding
            && let Some(position) = self.prefilling.iter().rposition(|&i| i == index)
        {
            self.prefilling.remove(position);
        }
        self.private_kv_tokens -= slot.private_kv;
        slot.private_kv = 0;
        if !slot.decoding {
            self.running_prefill_remaining_tokens -=
                u64::from(slot.prefill_target - slot.prefilled);
        } else {
            self.decoding_requests -= 1;
        }
        slot.decoding = false;
        self.cache.unpin(slot.pinned_node);
        slot.pinned_node = ROOT;
        slot.pinned_blocks = 0;
    }

    /// Preempts a running request: KV freed, requeued at the head, recomputed.
    fn preempt(&mut self, index: u32) {
        self.release(index);
        let slot = &mut self.slots[index as usize];
        slot.preemptions += 1;
        slot.prefill_target = slot.prompt_tokens + slot.generated;
        slot.prefilled = 0;
        self.preemptions_total += 1;
        self.enqueue(index, true);
    }

    fn free_slot(&mut self, index: u32) {
        let slot = &mut self.slots[index as usize];
        self.by_id.remove(&slot.id);
        slot.phase = Phase::Free;
        // Lets go of the caller's chain.
        slot.chain = self.empty_chain.clone();
        slot.chain_len = 0;
        self.free_slots.push(index);
    }

    /// Evicts up to `blocks` unreferenced cached blocks, least recently used
    /// first; returns how many it evicted.
    fn evict_blocks(&mut self, blocks: u64) -> u64 {
        let evicted = self.cache.evict_blocks(blocks);
        self.cached_kv_tokens -= evicted * u64::from(self.params.block_size_tokens);
        evicted
    }

    /// Evicts unreferenced cached blocks until the KV in use is at most
    /// `tokens` (or none is left to evict).
    fn evict_down_to(&mut self, tokens: u64) {
        let used = self.used_kv_tokens();
        if used > tokens {
            self.evict_blocks((used - tokens).div_ceil(u64::from(self.params.block_size_tokens)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(engine: &mut Engine) -> Vec<EngineEvent> {
        let mut events = Vec::new();
        while let Some(start_s) = engine.next_step_start_s() {
            engine.step(start_s, &mut events);
        }
        events
    }

    /// Submitting with the chain computed by the caller is submitting
    /// the content hashes: the same cache hits, the same events.
    #[test]
    fn a_submitted_chain_is_the_chained_content_hashes() {
        let content: Vec<u64> = (0..40).map(|i| crate::mix(i % 25)).collect();
        let request = |id: u64, blocks: usize, arrival_s: f64| EngineRequest {
            id,
            prompt_tokens: 16 * blocks as u32 + 5,
            output_tokens: 3,
            arrival_s,
            prefix_block_hashes: content[..blocks].to_vec(),
        };
        let mut by_content = Engine::new(EngineParams::default(), 3).unwrap();
        let mut by_chain = Engine::new(EngineParams::default(), 3).unwrap();
        let mut by_shared = Engine::new(EngineParams::default(), 3).unwrap();
        for (id, blocks) in [(1u64, 30usize), (2, 40), (3, 12)] {
            let arrival_s = id as f64;
            by_content.submit(request(id, blocks, arrival_s)).unwrap();
            // More keys than the prompt's full blocks: the extra are ignored.
            let chain = chain_block_hashes(&content);
            let without_hashes = EngineRequest {
                prefix_block_hashes: Vec::new(),
                ..request(id, blocks, arrival_s)
            };
            by_chain
                .submit_chained(without_hashes.clone(), &chain)
                .unwrap();
            by_shared
                .submit_shared(without_hashes, Arc::from(chain))
                .unwrap();
            let events = drain(&mut by_content);
            assert_eq!(events, drain(&mut by_chain));
            assert_eq!(events, drain(&mut by_shared));
            assert_eq!(by_content.snapshot(arrival_s), by_chain.snapshot(arrival_s));
            assert_eq!(
                by_content.snapshot(arrival_s),
                by_shared.snapshot(arrival_s)
            );
        }
        assert!(by_chain.snapshot(3.0).prefix_cache_hits_tokens_total > 0);
    }

    /// The waiting requests' uncached estimates, kept by stamps, match a
    /// fresh walk for every waiting request after inserts and evictions.
    #[test]
    fn stamped_waiting_estimates_follow_the_cache() {
        let params = EngineParams {
            kv_capacity_tokens: 4096,
            max_running: 2,
            prefill_chunk_tokens: 512,
            ..EngineParams::default()
        };
        let mut engine = Engine::new(params, 1).unwrap();
        let mut rng = SplitMix64::new(9);
        let mut events = Vec::new();
        for id in 0..300u64 {
            let group = rng.next_u64() % 6;
            let blocks = 4 + (rng.next_u64() % 60) as usize;
            let prefix_block_hashes = (0..blocks)
                .map(|i| crate::mix(group << 32 ^ (i as u64 / (1 + group))))
                .collect();
            let arrival_s = id as f64 * 0.05;
            engine
                .submit(EngineRequest {
                    id,
                    prompt_tokens: 16 * blocks as u32 + 3,
                    output_tokens: 1 + (rng.next_u64() % 20) as u32,
                    arrival_s,
                    prefix_block_hashes,
                })
                .unwrap();
            if let Some(start_s) = engine.next_step_start_s() {
                engine.step(start_s.max(arrival_s), &mut events);
            }
            let fresh: u64 = engine
                .waiting
                .iter()
                .map(|&index| {
                    let slot = &engine.slots[index as usize];
                    u64::from(slot.prefill_target - engine.cached_prefix_tokens(index))
                })
                .sum();
            assert_eq!(
                engine.queued_prefill_tokens(),
                fresh + engine.running_prefill_remaining_tokens,
                "request {id}"
            );
        }
    }
}
