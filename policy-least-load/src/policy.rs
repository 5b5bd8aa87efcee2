//! The `least_load` and `power_of_two` policies over the shared scorer.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use load_protocols::WorkerLoad;
use policy_core::{
    ArgMin, Dispatch, ExpectedWait, Policy, PolicyContext, PolicyError, PollMark, PrefillSample,
    PrefixBlocks, PrefixSnapshot, ReplicaPending, ReplicaPendingOutcome, ReplicaUpdate,
    ReplicaUpdateOutcome, RequestInfo, ScoreRow, ScoreTable, Slot, SlotsView, TieBreaker, WorkerId,
    WorkerInfo, WorkerLedger, WorkerSlots, WorkerStats, describe_request,
};

use crate::fleet_memo::FleetMemo;
use crate::prefix::{Matches, PrefixIndex};
use crate::rate::{
    FirstToken, FleetRate, LearnedSource, MIN_SAMPLES_TO_SCORE, PeerLateness, RateProbe,
};
use crate::score::{
    Fleet, LoadSummary, MeanThroughput, PendingWork, ScoreBreakdown, SnapshotTerms,
    ThroughputSource, score, wait_secs, wait_secs_converted,
};
use crate::state::{
    HotRead, HotSnapshot, HotTable, HotValues, KeyCursor, StoredSnapshot, Timeline, WorkerState,
    key_tag,
};
use crate::{InflightMode, LeastLoadParams, RateMode};

/// How much of the router fleet's pending prompt work on a worker (this
/// replica's, `stats`, and the others', `remote`) its engine has likely
/// computed, in seconds: the time since it took up the oldest pending
/// prompt ([`HeadStart`](crate::state::HeadStart)), at most that pending
/// work at `rate_tps`.
fn progress_secs(
    state: &WorkerState,
    stats: WorkerStats,
    remote: PendingWork,
    rate_tps: f64,
    now_nanos: i64,
) -> f64 {
    if stats.pending_requests == 0 && remote.requests == 0 {
        return 0.0;
    }
    let since_secs = now_nanos.saturating_sub(state.head_start.nanos()) as f64 / 1e9;
    let pending_tokens = stats.pending_tokens.saturating_add(remote.tokens);
    since_secs.max(0.0).min(pending_tokens as f64 / rate_tps)
}

/// Requests finished per second on the worker, by every router replica:
/// this router's finishes times the replicas that share the worker (this
/// one and the others heard of). Each replica sees only its own requests
/// finish, about `1 / replicas` of them when the replicas take equal
/// shares of the traffic; counted as the worker's, they made the wait for
/// a batch slot `replicas` times too long. `None` before a second of
/// history.
fn worker_finishes_per_second(state: &WorkerState, now_nanos: i64) -> Option<f64> {
    let replicas = 1 + state.remote.replicas();
    state
        .finishes
        .per_second(now_nanos)
        .map(|own| own * replicas as f64)
}

/// A dispatch sequence number, unique in the process and so in every policy.
/// Threads take them in blocks, so that concurrent selections do not bounce
/// one counter's cache line between cores on every request.
fn next_dispatch_seq() -> u64 {
    const BLOCK: u64 = 1024;
    static NEXT_BLOCK: AtomicU64 = AtomicU64::new(0);
    thread_local! {
        static RANGE: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
    }
    RANGE.with(|range| {
        let (mut next, mut end) = range.get();
        if next == end {
            next = NEXT_BLOCK.fetch_add(BLOCK, Ordering::Relaxed);
            end = next.saturating_add(BLOCK);
        }
        range.set((next + 1, end));
        next
    })
}

/// `now` on the prefix index's timeline, ms.
fn index_ms(now_nanos: i64) -> u32 {
    u32::try_from(now_nanos.max(0) / 1_000_000).unwrap_or(u32::MAX)
}

/// The worker's KV capacity in tokens, summed over its DP ranks (each holds
/// its own cache), if every rank reports one (`max_total_num_tokens` > 0).
fn reported_kv_capacity_tokens(load: &WorkerLoad) -> Option<u64> {
    load.ranks()
        .iter()
        .map(|rank| {
            u64::try_from(rank.max_total_num_tokens)
                .ok()
                .filter(|t| *t > 0)
        })
        .try_fold(0u64, |total, tokens| Some(total.saturating_add(tokens?)))
}

/// How the scored candidates are chosen from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// The argmin over every candidate (`least_load`).
    LeastLoad,
    /// The better of two distinct uniform samples (`power_of_two`), scored
    /// with the same knobs. The pair is its own fleet: a sample without a
    /// fresh snapshot drains at the other sample's rate (rule 3), which keeps
    /// a selection O(1). When both samples are capped or unknown it falls
    /// back to the argmin over every candidate, so it refuses a request only
    /// when no candidate can take it. Its explain table scores every
    /// candidate and marks the argmin, the best a sampled pair can reach.
    PowerOfTwo,
}

impl Strategy {
    pub fn name(self) -> &'static str {
        match self {
            Strategy::LeastLoad => "least_load",
            Strategy::PowerOfTwo => "power_of_two",
        }
    }
}

/// The columns of the explain table, in row order. `inflight_tok` counts
/// every replica's pending work; `remote_tok` and `remote_req` are the part
/// other replicas published, and `remote_age_s` how long ago the stalest of
/// their entries was confirmed (0 with none).
pub const COLUMNS: [&str; 14] = [
    "queued_tok",
    "inflight_tok",
    "request_tok",
    "cached_tok",
    "rate_tps",
    "rate_samples",
    "kv_ratio",
    "drain_s",
    "barrier_s",
    "score_s",
    "waiting_req",
    "remote_tok",
    "remote_req",
    "remote_age_s",
];

/// Token-work expected-wait routing (`least_load`), or its two-sample variant
/// (`power_of_two`): see the crate docs.
///
/// Per-worker state sits in dense [`WorkerSlots`]: the ledger of pending and
/// in-flight work (lock-free reads, one per-worker lock for changes), and the
/// latest snapshot's terms behind a seqlock, precomputed when the report is
/// received. What a selection reads of each worker is also packed in a hot
/// record per worker slot, side by side (`HotTable`), rewritten whenever
/// one of its inputs changes. A selection takes the slots' read view, reads
/// the candidates' hot records without writing shared memory, and locks only
/// the winner's ledger, where the cap is checked again and the credit made
/// in one critical section.
#[derive(Debug)]
pub struct LeastLoad {
    strategy: Strategy,
    params: LeastLoadParams,
    stale_after_nanos: i64,
    workers: WorkerSlots<WorkerState>,
    rng: TieBreaker,
    timeline: Timeline,
    next_poll: AtomicU64,
    /// What a worker without a learned rate is scored at.
    fleet_rate: FleetRate,
    /// How late other replicas' first tokens come: how long first tokens
    /// wait to be learned in order with theirs.
    peer_lateness: PeerLateness,
    /// The mean reported rate a worker without a fresh snapshot is scored
    /// at, as last computed ([`LeastLoad::lazy_fleet`]).
    fleet_memo: FleetMemo,
    /// Where prompt prefixes were sent (`prefix_affinity`), else `None`.
    /// Lock-free to read; records take its writer lock.
    prefix: Option<PrefixIndex>,
    /// What selections read of each worker, packed (`inflight = "pending"`;
    /// `since_poll` reads the workers' state directly).
    hot: Option<HotTable>,
}

/// The request's own work as a selection counts it on each worker: its
/// tokens under the learned rate (0 otherwise), less what the worker is
/// expected to hold of its prefix, plus the miss charge.
#[derive(Debug, Clone, Copy, Default)]
struct OwnWork {
    tokens: u64,
    matches: Matches,
    /// Most tokens any worker is expected to hold (capped as `cached_tokens`).
    best_cached_tokens: u64,
    /// Tokens charged per token missed: `prefix_miss_weight`, raised with
    /// the fleet's congestion by [`LeastLoad::priced`].
    miss_weight: f64,
}

impl OwnWork {
    /// Expected cached tokens on the worker: at least one token is always computed.
    #[inline]
    fn cached_tokens(&self, worker: WorkerId, prompt_tokens: u64) -> u64 {
        if self.matches.is_empty() {
            return 0;
        }
        self.matches
            .cached_tokens(worker.slot())
            .min(prompt_tokens.saturating_sub(1))
    }

    /// Whether `worker` is charged nothing for a miss, whatever the miss
    /// weight: it is expected to hold as much as the best placed worker.
    #[inline]
    fn charged_nothing(&self, worker: WorkerId) -> bool {
        self.cached_tokens(worker, self.tokens) >= self.best_cached_tokens
    }

    /// The tokens scored on `worker`.
    #[inline]
    fn on(&self, worker: WorkerId) -> u64 {
        self.charged(self.cached_tokens(worker, self.tokens))
    }

    /// The tokens scored on a worker expected to hold `cached` of the
    /// prompt: the uncached part of the request, and the miss weight × the
    /// tokens it would recompute there that the best-placed worker would
    /// not (the fleet's capacity a miss burns).
    #[inline]
    fn charged(&self, cached: u64) -> u64 {
        let missed = self.best_cached_tokens.saturating_sub(cached);
        let miss_charge = (self.miss_weight * missed as f64) as u64;
        self.tokens
            .saturating_sub(cached)
            .saturating_add(miss_charge)
    }
}

/// Candidates from which a selection filters on the hot keys first
/// ([`LeastLoad::argmin_filtered`]); a single one is scored exactly. The
/// filter wins from two on: at 8 workers it took 0.79× the time of scoring
/// each exactly (`select/least_load/8`, 206 → 163 ns), and a request
/// through the router over 4 workers 0.987× the instructions (callgrind).
const FILTER_MIN_CANDIDATES: usize = 2;

/// How far from the fleet's a worker's learned rate must be before
/// `Policy::preview` predicts a prompt's prefill at it rather than at the
/// fleet's: a worker of another kind, not a measure that wanders.
const OTHER_KIND_FACTOR: f64 = 1.2;

/// The filter's margin, relative to the bar: far above the estimate's error
/// (a few times 2⁻⁵³), far below anything that matters.
const FILTER_MARGIN: f64 = 1e-9;

/// Token counts below this convert to `f64` exactly and cannot saturate when
/// summed, which the filter's error bound relies on.
const EXACT_TOKENS: u64 = 1 << 52;

/// Kept candidates are compacted against the bar when their vector is full
/// and at least this long.
const KEPT_COMPACT_LEN: usize = 64;

thread_local! {
    /// The filter's kept candidates (index, estimate), kept by each thread,
    /// so a selection allocates nothing once the thread has seen its largest.
    static KEPT: Cell<Vec<(usize, f64)>> = const { Cell::new(Vec::new()) };
    /// [`scan_estimates`]'s kept candidates, kept by each thread likewise.
    static WITHIN: Cell<Vec<Within>> = const { Cell::new(Vec::new()) };
}

#[cfg(test)]
thread_local! {
    /// Selections on this thread decided by the filter's estimates alone
    /// ([`LeastLoad::estimates_decide`]), so
    /// that tests can tell that path was taken.
    pub(crate) static SURE_RULES: Cell<u64> = const { Cell::new(0) };
}

/// The first pass of [`LeastLoad::argmin_two_pass`]: pushes onto `kept`
/// every candidate that may be within the final tie tolerance (those it
/// cannot estimate, or that `exact` names by slot, with a negative infinite
/// estimate, so they are always scored); returns the final bar.
#[inline]
fn filter_pass(
    hot: &HotTable,
    candidates: &[WorkerId],
    fresh_from_nanos: i64,
    own_tokens: u64,
    tolerance_secs: f64,
    kept: &mut Vec<(usize, f64)>,
    exact: impl Fn(usize) -> bool,
) -> f64 {
    let own_tokens = own_tokens as f64;
    let mut keys = hot.keys();
    let mut lowest_estimate = f64::INFINITY;
    let mut bar = f64::INFINITY;
    for (index, id) in candidates.iter().enumerate() {
        let (key, _) = keys.key(*id);
        let estimate = if key.tag == key_tag(*id)
            && key.received_nanos >= fresh_from_nanos
            && !exact(id.slot())
        {
            let estimate = key.base_secs + own_tokens * key.inv_rate;
            if estimate > bar {
                continue;
            }
            if estimate < lowest_estimate {
                lowest_estimate = estimate;
                bar = filter_bar(lowest_estimate, tolerance_secs);
            }
            estimate
        } else {
            f64::NEG_INFINITY
        };
        if kept.len() == kept.capacity() && kept.len() >= KEPT_COMPACT_LEN {
            kept.retain(|(_, estimate)| *estimate <= bar);
        }
        kept.push((index, estimate));
    }
    bar
}

/// A candidate [`scan_estimates`] kept: within the bar when it was seen.
#[derive(Debug, Clone, Copy)]
struct Within {
    index: usize,
    /// Its estimate, or its exact score when it has no usable key.
    value_secs: f64,
    last_dispatch_nanos: i64,
}

/// Where [`scan_estimates`] stands in the candidate list, and what it has
/// seen so far.
#[derive(Debug, Clone, Copy)]
struct Scan {
    /// The next candidate to look at.
    next: usize,
    /// The lowest value kept (infinite before the first).
    lowest_secs: f64,
    /// [`filter_bar`] of `lowest_secs`; values above it are not kept.
    /// Starts at the largest finite value, so a vetoed (infinite) or NaN
    /// value is never kept.
    bar_secs: f64,
    /// The oldest last dispatch among the kept values equal to the lowest.
    lowest_oldest_nanos: i64,
}

impl Scan {
    fn new() -> Scan {
        Scan {
            next: 0,
            lowest_secs: f64::INFINITY,
            bar_secs: f64::MAX,
            lowest_oldest_nanos: i64::MIN,
        }
    }

    /// Keeps the candidate at `index`, whose value is within the bar,
    /// unless it is no lower than the lowest and was dispatched to after an
    /// earlier candidate of the lowest value: such a one can neither win
    /// nor take part in a draw, since the earlier one is strictly older and
    /// within the final tolerance whenever it is. (Its value is lower; and
    /// when the values decide, [`LeastLoad::estimates_decide`], the earlier
    /// one, kept, is surely within whenever this one may be.) In an idle
    /// fleet every candidate ties, and most are such.
    #[inline]
    fn keep(
        &mut self,
        kept: &mut Vec<Within>,
        index: usize,
        value_secs: f64,
        last_dispatch_nanos: i64,
        tolerance_secs: f64,
    ) {
        if value_secs < self.lowest_secs {
            self.lowest_secs = value_secs;
            self.bar_secs = filter_bar(value_secs, tolerance_secs);
            self.lowest_oldest_nanos = last_dispatch_nanos;
        } else if last_dispatch_nanos > self.lowest_oldest_nanos {
            return;
        } else if value_secs <= self.lowest_secs {
            // Equal, in one comparison (an equality test of floats takes
            // two branches, for NaN, which never gets here).
            self.lowest_oldest_nanos = last_dispatch_nanos;
        }
        // Values above the bar now stay above it: the bar only falls.
        if kept.len() == kept.capacity() && kept.len() >= KEPT_COMPACT_LEN {
            let bar_secs = self.bar_secs;
            kept.retain(|within| within.value_secs <= bar_secs);
        }
        kept.push(Within {
            index,
            value_secs,
            last_dispatch_nanos,
        });
    }
}

/// The filter's pass over the candidates from `scan.next` on: keeps
/// ([`Scan::keep`]) every candidate whose estimate is within the bar of
/// the lowest so far, and stops at one it cannot estimate (no usable key,
/// or `exact` names its slot), returning its index for the caller to score
/// exactly and keep; `None` at the end of the list.
///
/// A busy fleet's candidates are mostly ruled out here by one comparison,
/// and the few kept are recorded without leaving the loop, so the tie rule
/// sees only what is within the final bar, once the pass is over.
///
/// Kept out of line, with its cursor and state in locals written back once:
/// inlined into the selection, the loop's values were spilled to the stack
/// and reloaded for every candidate; on its own it holds them in registers.
#[inline(never)]
#[allow(clippy::too_many_arguments)]
fn scan_estimates(
    keys: &mut KeyCursor<'_>,
    candidates: &[WorkerId],
    scan: &mut Scan,
    kept: &mut Vec<Within>,
    fresh_from_nanos: i64,
    own_tokens: f64,
    tolerance_secs: f64,
    exact: &impl Fn(usize) -> bool,
) -> Option<usize> {
    let mut cursor = *keys;
    let mut state = *scan;
    // The candidates left, as an iterator (two pointers, no index kept
    // beside them); a candidate's place in the list is worked out only for
    // the few kept.
    let mut rest = candidates.get(state.next..).unwrap_or_default().iter();
    let place = |rest: &std::slice::Iter<'_, WorkerId>| candidates.len() - rest.len() - 1;
    let unestimated = loop {
        let Some(id) = rest.next() else {
            break None;
        };
        let (key, last_dispatch) = cursor.key(*id);
        if key.tag != key_tag(*id) || key.received_nanos < fresh_from_nanos || exact(id.slot()) {
            break Some(place(&rest));
        }
        let estimate = key.base_secs + own_tokens * key.inv_rate;
        if estimate <= state.bar_secs {
            let last_dispatch_nanos = last_dispatch.load(Ordering::Relaxed);
            state.keep(
                kept,
                place(&rest),
                estimate,
                last_dispatch_nanos,
                tolerance_secs,
            );
        }
    };
    state.next = candidates.len() - rest.len();
    *keys = cursor;
    *scan = state;
    unestimated
}

/// The highest estimate the filter keeps, given the lowest so far.
#[inline]
fn filter_bar(lowest_estimate: f64, tolerance_secs: f64) -> f64 {
    let within = lowest_estimate + tolerance_secs;
    within + within * FILTER_MARGIN
}

/// The highest estimate sure to be within the tie tolerance of the lowest
/// exact score, given the lowest estimate: [`filter_bar`]'s mirror.
#[inline]
fn sure_bar(lowest_estimate: f64, tolerance_secs: f64) -> f64 {
    let within = lowest_estimate + tolerance_secs;
    within - within * FILTER_MARGIN
}

/// One candidate as a selection sees it.
#[derive(Debug, Clone, Copy)]
struct Scored<'v> {
    slot: &'v Slot<WorkerState>,
    score_secs: f64,
}

/// One candidate that may be within the tie tolerance of the lowest score:
/// its place in the candidate list, its score and when it was last
/// dispatched to.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Tie {
    pub index: usize,
    pub score_secs: f64,
    pub last_dispatch_nanos: i64,
}

/// The tie rule, applied in one pass over the candidates in order: the
/// candidate with the lowest finite score sets the bar (that score plus the
/// tolerance); among those within it, the least recently dispatched wins;
/// equally old ones are drawn from uniformly, by reservoir sampling in
/// candidate order ([`ArgMin`]).
///
/// The pass keeps every candidate that may end within the final bar, with
/// its last dispatch read then, so nothing is scored twice. The bar only
/// falls, so what is outside now stays outside, and a candidate behind an
/// earlier one no later in score and strictly older can never win nor take
/// part in a draw (that one is within the bar whenever it is, and comes
/// first): neither is kept. The rest stay on the stack up to
/// [`TieRule::STACK`], beyond in a vector reused by the thread, so a
/// selection allocates nothing once the thread has seen its largest tie.
/// The final draw runs over the kept candidates in order, exactly as over
/// every candidate: the choice and the draws taken are those of the rule
/// applied to the whole list.
#[derive(Debug)]
pub(crate) struct TieRule {
    tolerance_secs: f64,
    /// `Some(bar)` when the scores offered are the filter's estimates, not
    /// exact scores ([`LeastLoad::estimates_decide`]): the tie set they give is the
    /// exact one, but the winner's score must be computed, and an exact
    /// score above `bar` means the estimates raced a change.
    estimated_bar_secs: Option<f64>,
    lowest: Option<Tie>,
    /// The oldest candidate kept, and the lowest score among those that old.
    oldest: Option<(i64, f64)>,
    stack: [Tie; TieRule::STACK],
    len: usize,
    spill: Option<Vec<Tie>>,
}

thread_local! {
    /// [`TieRule`]'s room beyond the stack, kept by each thread.
    static SPILL: std::cell::Cell<Vec<Tie>> = const { std::cell::Cell::new(Vec::new()) };
}

impl TieRule {
    /// Small, because the rule is built and moved on every selection (a
    /// copy of the whole array each time): a busy fleet ties a few
    /// candidates, and an idle one keeps about ln(n) of them (each kept one
    /// is older than every one before it).
    const STACK: usize = 8;

    pub fn new(tolerance_secs: f64) -> TieRule {
        TieRule {
            tolerance_secs,
            estimated_bar_secs: None,
            lowest: None,
            oldest: None,
            stack: [Tie::default(); TieRule::STACK],
            len: 0,
            spill: None,
        }
    }

    /// Offers the candidate at `index` with its score; `last_dispatch_nanos`
    /// is read only if it may be needed.
    #[inline]
    pub fn offer(
        &mut self,
        index: usize,
        score_secs: f64,
        last_dispatch_nanos: impl FnOnce() -> i64,
    ) {
        // A NaN or infinite score never wins (the scorer clamps, so this is
        // a second line of defence).
        if !score_secs.is_finite() {
            return;
        }
        let lowest_secs = match self.lowest {
            Some(lowest) if lowest.score_secs <= score_secs => lowest.score_secs,
            _ => score_secs,
        };
        let within_secs = lowest_secs + self.tolerance_secs;
        if score_secs > within_secs {
            return;
        }
        let tie = Tie {
            index,
            score_secs,
            last_dispatch_nanos: last_dispatch_nanos(),
        };
        if self
            .lowest
            .is_none_or(|lowest| score_secs < lowest.score_secs)
        {
            self.lowest = Some(tie);
        }
        if self.behind_after_nanos(score_secs) < tie.last_dispatch_nanos {
            return;
        }
        if let Some((oldest_nanos, oldest_secs)) = self.oldest {
            if tie.last_dispatch_nanos < oldest_nanos
                || (tie.last_dispatch_nanos == oldest_nanos && score_secs < oldest_secs)
            {
                self.oldest = Some((tie.last_dispatch_nanos, score_secs));
            }
        } else {
            self.oldest = Some((tie.last_dispatch_nanos, score_secs));
        }
        self.keep(tie, within_secs);
    }

    /// The last dispatch after which a candidate scored `score_secs` is
    /// behind the oldest kept one (strictly newer, no lower in score), or
    /// `i64::MAX` when nothing is. [`TieRule::offer`] drops such a
    /// candidate, which changes neither the lowest score nor what is kept,
    /// so a caller that sees one may skip the offer: scanning a large tie,
    /// most candidates are such.
    #[inline]
    pub fn behind_after_nanos(&self, score_secs: f64) -> i64 {
        match self.oldest {
            Some((oldest_nanos, oldest_secs)) if oldest_secs <= score_secs => oldest_nanos,
            _ => i64::MAX,
        }
    }

    fn keep(&mut self, tie: Tie, within_secs: f64) {
        if let Some(spill) = &mut self.spill {
            if spill.len() == spill.capacity() {
                spill.retain(|kept| kept.score_secs <= within_secs);
            }
            spill.push(tie);
            return;
        }
        if self.len == TieRule::STACK {
            let mut kept = 0;
            for index in 0..self.len {
                let entry = self.stack[index];
                if entry.score_secs <= within_secs {
                    self.stack[kept] = entry;
                    kept += 1;
                }
            }
            self.len = kept;
        }
        if self.len == TieRule::STACK {
            let mut spill = SPILL.with(std::cell::Cell::take);
            spill.clear();
            spill.extend_from_slice(&self.stack);
            spill.push(tie);
            self.spill = Some(spill);
            return;
        }
        self.stack[self.len] = tie;
        self.len += 1;
    }

    /// Whether `pred` holds for the lowest-scored candidate and every kept
    /// one within the tie tolerance of it (by place in the candidate list).
    /// A candidate within the tolerance that was not kept comes after a
    /// kept one within it, no higher in score and strictly older, so it
    /// neither wins nor takes part in a draw.
    pub fn all_ties(&self, pred: impl Fn(usize) -> bool) -> bool {
        let Some(lowest) = self.lowest else {
            return true;
        };
        let within_secs = lowest.score_secs + self.tolerance_secs;
        let kept = match &self.spill {
            Some(spill) => spill.as_slice(),
            None => &self.stack[..self.len],
        };
        pred(lowest.index)
            && kept
                .iter()
                .all(|tie| tie.score_secs > within_secs || pred(tie.index))
    }

    /// The chosen candidate, if any was offered with a finite score.
    pub fn choose(&self, rng: &TieBreaker) -> Option<Tie> {
        let lowest = self.lowest?;
        let within_secs = lowest.score_secs + self.tolerance_secs;
        let kept = match &self.spill {
            Some(spill) => spill.as_slice(),
            None => &self.stack[..self.len],
        };
        let mut oldest = ArgMin::new();
        for tie in kept {
            if tie.score_secs <= within_secs {
                oldest.offer(*tie, tie.last_dispatch_nanos, rng);
            }
        }
        Some(oldest.best().map_or(lowest, |(tie, _)| tie))
    }
}

impl TieRule {
    /// Gives the room beyond the stack back to the thread, for its next
    /// rule; the rule keeps only its stack.
    fn give_back_room(&mut self) {
        if let Some(mut spill) = self.spill.take() {
            spill.clear();
            SPILL.with(|cell| cell.set(spill));
        }
    }
}

impl Drop for TieRule {
    fn drop(&mut self) {
        self.give_back_room();
    }
}

impl LeastLoad {
    /// A policy with validated knobs.
    pub fn new(
        strategy: Strategy,
        params: LeastLoadParams,
        context: &PolicyContext,
    ) -> Result<LeastLoad, PolicyError> {
        let params = params.validate(strategy.name())?;
        Ok(LeastLoad {
            strategy,
            fleet_rate: FleetRate::new(params.default_throughput, params.rate_deadband_ratio),
            peer_lateness: PeerLateness::default(),
            fleet_memo: FleetMemo::default(),
            params,
            stale_after_nanos: i64::try_from(context.stale_after.as_nanos()).unwrap_or(i64::MAX),
            workers: WorkerSlots::new(),
            rng: TieBreaker::new(context.rng_seed),
            timeline: Timeline::default(),
            next_poll: AtomicU64::new(0),
            prefix: params.prefix_affinity.then(|| {
                PrefixIndex::new(
                    params.prefix_index_block_tokens,
                    params.prefix_cache_tokens,
                    params.prefix_index_max_blocks,
                    params.prefix_max_age_secs,
                )
            }),
            hot: (params.inflight == InflightMode::Pending)
                .then(|| HotTable::new(params.rate == RateMode::Learned)),
        })
    }

    /// A policy from its config section (`null` for all defaults).
    pub fn from_section(
        strategy: Strategy,
        section: &serde_json::Value,
        context: &PolicyContext,
    ) -> Result<LeastLoad, PolicyError> {
        let params = LeastLoadParams::from_section(strategy.name(), section)?;
        LeastLoad::new(strategy, params, context)
    }

    pub fn strategy(&self) -> Strategy {
        self.strategy
    }

    pub fn knobs(&self) -> &LeastLoadParams {
        &self.params
    }

    fn fresh_snapshot(&self, state: &WorkerState, now_nanos: i64) -> Option<StoredSnapshot> {
        state
            .snapshot
            .read()
            .filter(|snapshot| snapshot.is_fresh(now_nanos, self.stale_after_nanos))
    }

    /// The cap's estimate of the worker's waiting requests: the waiting
    /// requests no replica sent, from its fresh snapshot (0 without one),
    /// plus our pending requests and the other replicas' now.
    fn waiting_estimate(others_waiting: u64, stats: WorkerStats, remote: PendingWork) -> u64 {
        others_waiting
            .saturating_add(stats.pending_requests)
            .saturating_add(remote.requests)
    }

    fn admits(&self, others_waiting: u64, stats: WorkerStats, remote: PendingWork) -> bool {
        let cap = self.params.max_waiting_requests;
        cap == 0 || LeastLoad::waiting_estimate(others_waiting, stats, remote) < cap
    }

    /// The other replicas' pending work on the worker, as counted: none
    /// under `inflight = "since_poll"`, whose tally stands in for all
    /// pending work and subtracts nothing from the queue.
    fn remote(&self, state: &WorkerState) -> PendingWork {
        match self.params.inflight {
            InflightMode::Pending => state.remote.totals(),
            InflightMode::SincePoll => PendingWork::default(),
        }
    }

    /// The hot part of the worker's snapshot, if fresh.
    fn fresh_hot(&self, state: &WorkerState, now_nanos: i64) -> Option<HotSnapshot> {
        state
            .snapshot
            .read_hot()
            .filter(|hot| hot.is_fresh(now_nanos, self.stale_after_nanos))
    }

    /// The request's own tokens as the score counts them: under the learned
    /// rate its own prefill is part of its wait, and takes longer on a slower
    /// worker. The reported and fixed rates keep the original score.
    fn own_tokens(&self, tokens: u64) -> u64 {
        match self.params.rate {
            RateMode::Learned => tokens,
            RateMode::Reported | RateMode::Fixed => 0,
        }
    }

    /// The request's prompt tokens (or the configured mean when it has no
    /// count), its own work, and the time on the policy's timeline, as a
    /// selection takes them.
    fn own_work_at(&self, request: &RequestInfo, now: Instant) -> (u64, OwnWork, i64) {
        let tokens = request.tokens.or(self.params.mean_prefill_tokens);
        let now_nanos = self.timeline.nanos(now);
        (tokens, self.own_work(tokens, request, now_nanos), now_nanos)
    }

    /// The request's own work: its tokens under the learned rate, and where
    /// the prefix index expects its prefix to be cached (with
    /// `prefix_affinity` under the learned rate; nowhere otherwise).
    fn own_work(&self, tokens: u64, request: &RequestInfo, now_nanos: i64) -> OwnWork {
        let own_tokens = self.own_tokens(tokens);
        let matches = match &self.prefix {
            Some(index) if own_tokens > 0 && !request.prefix.is_empty() => {
                index.lookup(&request.prefix, index_ms(now_nanos))
            }
            _ => Matches::default(),
        };
        OwnWork {
            tokens: own_tokens,
            best_cached_tokens: matches
                .max_cached_tokens()
                .min(own_tokens.saturating_sub(1)),
            matches,
            miss_weight: self.params.prefix_miss_weight,
        }
    }

    /// What the worker's hot record holds, from its state now.
    fn hot_values(&self, state: &WorkerState) -> HotValues {
        let stats = state.ledger.stats();
        let remote = self.remote(state);
        let snapshot = state.snapshot.read_hot();
        let ahead_tokens = stats.pending_tokens.saturating_add(remote.tokens);
        let learned_tps = state.rate.learned_tps();
        let key = snapshot.and_then(|hot| {
            let throughput_tps = match self.params.rate {
                RateMode::Learned => self.fleet_rate.scoring_tps(learned_tps),
                RateMode::Reported | RateMode::Fixed => hot.throughput_tps,
            };
            // The filter's error bound needs exact integers and
            // non-negative finite terms; otherwise the worker is scored
            // exactly every time.
            let bounded = hot.queued_tokens < EXACT_TOKENS
                && ahead_tokens < EXACT_TOKENS
                && throughput_tps.is_finite()
                && throughput_tps > 0.0
                && hot.kv_barrier_secs.is_finite()
                && hot.kv_barrier_secs >= 0.0;
            if !bounded {
                return None;
            }
            let inv_rate = 1.0 / throughput_tps;
            let base_secs = (hot.queued_tokens as f64 + ahead_tokens as f64) / throughput_tps
                + hot.kv_barrier_secs;
            if !(inv_rate.is_finite() && base_secs.is_finite()) {
                return None;
            }
            let admitted = self.admits(hot.others_waiting_requests, stats, remote);
            Some((if admitted { base_secs } else { f64::INFINITY }, inv_rate))
        });
        HotValues {
            snapshot,
            ahead_tokens,
            pending_requests: stats.pending_requests.saturating_add(remote.requests),
            learned_tps,
            key,
            last_dispatch_nanos: state.last_dispatch.nanos(),
        }
    }

    /// After a poll's outcome was applied to the worker's snapshot: the
    /// fleet's remembered mean and the worker's hot record are out of date.
    fn snapshot_applied(&self, slot: &Slot<WorkerState>) {
        self.fleet_memo.changed();
        self.refresh_hot(slot);
    }

    /// Learns the worker's rate from a first token, this replica's or
    /// another's, held with the others' until the peers' lateness has
    /// passed. A bad sample is dropped and counted by the estimator.
    fn learn_first_token(
        &self,
        view: &SlotsView<'_, WorkerState>,
        slot: &Slot<WorkerState>,
        first_token: FirstToken,
        now_nanos: i64,
    ) {
        let was_scored = slot.state.rate.learned_tps().is_some();
        slot.state.rate.observe_first_token(
            first_token,
            self.peer_lateness.hold_nanos(),
            now_nanos,
            Some(self.fleet_rate.tps()),
        );
        self.after_rate_sample(view, slot, was_scored, now_nanos);
    }

    /// A rate sample may have been learned for `slot` (scored at its own
    /// rate before it if `was_scored`): the worker's hot record takes the
    /// rate, and the fleet's rate follows.
    fn after_rate_sample(
        &self,
        view: &SlotsView<'_, WorkerState>,
        slot: &Slot<WorkerState>,
        was_scored: bool,
        now_nanos: i64,
    ) {
        // A worker that starts being scored at its own rate joins the
        // fleet's at once (once in its life); otherwise the fleet's
        // follows its workers at most every refresh period.
        let now_scored = !was_scored && slot.state.rate.learned_tps().is_some();
        // The released work and the learned rate, in one rewrite.
        self.refresh_hot(slot);
        if self.fleet_rate.claim_refresh(now_nanos) || now_scored {
            self.refresh_fleet_rate(view);
        }
    }

    fn refresh_hot(&self, slot: &Slot<WorkerState>) {
        if let Some(hot) = &self.hot {
            hot.update(slot.id, || self.hot_values(&slot.state));
        }
    }

    /// Recomputes the fleet's rate from every worker's learned rate.
    fn refresh_fleet_rate(&self, view: &SlotsView<'_, WorkerState>) {
        let other_replicas = view
            .iter()
            .map(|slot| slot.state.remote.replicas())
            .max()
            .unwrap_or(0);
        self.fleet_rate.set_replicas(1 + other_replicas);
        self.fleet_rate.set_from(
            view.iter().filter_map(|slot| slot.state.rate.learned_tps()),
            self.params.default_throughput,
        );
        // The hot keys hold each worker's rate as scored, which may be the
        // fleet's.
        if self.hot.is_some() && self.params.rate == RateMode::Learned {
            for slot in view.iter() {
                self.refresh_hot(slot);
            }
        }
    }

    /// The rate a worker's work is divided by under `rate = "learned"`: its
    /// own once learned and outside the deadband, the fleet's otherwise.
    #[inline]
    fn worker_rate_tps(&self, state: &WorkerState) -> f64 {
        self.fleet_rate.scoring_tps(state.rate.learned_tps())
    }

    /// The worker's rate when the learned rate is the divisor, for the
    /// scorer: what the hot path divides by too.
    fn learned_tps(&self, state: &WorkerState) -> Option<f64> {
        (self.params.rate == RateMode::Learned).then(|| self.worker_rate_tps(state))
    }

    /// The rate and freshness of the given candidates as a whole.
    fn fleet<'v>(
        &self,
        candidates: impl Iterator<Item = &'v Slot<WorkerState>>,
        now_nanos: i64,
    ) -> Fleet {
        self.fleet_fresh_until(candidates, now_nanos).0
    }

    /// [`LeastLoad::fleet`], and the last instant every snapshot it found
    /// fresh stays fresh (`i64::MAX` when none is).
    fn fleet_fresh_until<'v>(
        &self,
        candidates: impl Iterator<Item = &'v Slot<WorkerState>>,
        now_nanos: i64,
    ) -> (Fleet, i64) {
        let mut any_fresh = false;
        let mut mean = MeanThroughput::default();
        let mut fresh_until_nanos = i64::MAX;
        for slot in candidates {
            if let Some(snapshot) = self.fresh_snapshot(&slot.state, now_nanos) {
                any_fresh = true;
                fresh_until_nanos = fresh_until_nanos.min(
                    snapshot
                        .received_nanos
                        .saturating_add(self.stale_after_nanos),
                );
                if snapshot.terms.throughput == ThroughputSource::Reported {
                    mean.add(snapshot.terms.throughput_tps);
                }
            }
        }
        (mean.fleet(any_fresh, &self.params), fresh_until_nanos)
    }

    /// The fleet a selection needs, computed only when a candidate lacks a
    /// fresh snapshot (the fleet's rate then matters), so the common case
    /// stays one pass with no allocation; and then reused from the last
    /// selection's when nothing it reads has changed ([`FleetMemo`]), so a
    /// worker whose load cannot be read does not make every selection read
    /// every candidate's snapshot.
    fn lazy_fleet(
        &self,
        cache: &mut Option<Fleet>,
        view: &SlotsView<'_, WorkerState>,
        candidates: &[WorkerId],
        now_nanos: i64,
    ) -> Fleet {
        *cache.get_or_insert_with(|| {
            self.fleet_memo.fleet(candidates, now_nanos, || {
                self.fleet_fresh_until(candidates.iter().filter_map(|id| view.get(*id)), now_nanos)
            })
        })
    }

    /// The in-flight term: every replica's pending work (ours and, with
    /// sync, the others' as published). `any_fresh`: whether the worker or
    /// any other candidate has a fresh snapshot.
    fn inflight_tokens(
        &self,
        state: &WorkerState,
        stats: WorkerStats,
        remote: PendingWork,
        any_fresh: bool,
    ) -> u64 {
        match self.params.inflight {
            InflightMode::Pending => stats.pending_tokens.saturating_add(remote.tokens),
            // Rule 4 reads the live pending work in both modes: with no
            // report arriving, the tally would never be reset.
            InflightMode::SincePoll if !any_fresh => stats.pending_tokens,
            InflightMode::SincePoll => state.since_poll.tokens(),
        }
    }

    fn breakdown(
        &self,
        state: &WorkerState,
        snapshot: Option<&StoredSnapshot>,
        stats: WorkerStats,
        remote: PendingWork,
        own_tokens: u64,
        fleet: Fleet,
    ) -> ScoreBreakdown {
        let any_fresh = snapshot.is_some() || fleet.any_fresh;
        score(
            snapshot.map(|snapshot| &snapshot.terms),
            self.inflight_tokens(state, stats, remote, any_fresh),
            own_tokens,
            self.learned_tps(state),
            fleet,
            &self.params,
        )
    }

    /// The candidate's score, or `None` when the cap vetoes it.
    fn admitted_score(
        &self,
        view: &SlotsView<'_, WorkerState>,
        slot: &Slot<WorkerState>,
        candidates: &[WorkerId],
        fleet: &mut Option<Fleet>,
        now_nanos: i64,
        own: &OwnWork,
    ) -> Option<f64> {
        let own_tokens = own.on(slot.id);
        let state = &slot.state;
        let stats = state.ledger.stats();
        let remote = self.remote(state);
        let hot = self.fresh_hot(state, now_nanos);
        let others_waiting = hot.map_or(0, |hot| hot.others_waiting_requests);
        if !self.admits(others_waiting, stats, remote) {
            return None;
        }
        Some(match hot {
            // The common case, kept to a few loads and one division.
            Some(hot) => wait_secs(
                hot.queued_tokens,
                self.inflight_tokens(state, stats, remote, true)
                    .saturating_add(own_tokens),
                match self.params.rate {
                    RateMode::Learned => self.worker_rate_tps(state),
                    RateMode::Reported | RateMode::Fixed => hot.throughput_tps,
                },
                hot.kv_barrier_secs,
            ),
            None => {
                let fleet = self.lazy_fleet(fleet, view, candidates, now_nanos);
                self.breakdown(state, None, stats, remote, own_tokens, fleet)
                    .score_secs
            }
        })
    }

    /// The admissible candidate with the lowest score. Scores within
    /// `tie_tolerance_secs` of the lowest are ties, and a tie goes to the
    /// worker dispatched to least recently, then to a uniform draw. Among
    /// equal-wait workers that spaces each one's arrivals as evenly as round
    /// robin does, where chasing sub-tolerance differences in poll-borne terms
    /// would herd requests onto one worker until the next poll.
    ///
    /// From the hot records' keys ([`HotTable`]) when the candidates are
    /// many ([`LeastLoad::argmin_filtered`]), else scoring each exactly
    /// ([`LeastLoad::argmin_exact`]); the same choice either way.
    fn argmin<'v>(
        &self,
        view: &'v SlotsView<'_, WorkerState>,
        candidates: &[WorkerId],
        now_nanos: i64,
        own: &OwnWork,
    ) -> Option<Scored<'v>> {
        let Some(hot) = &self.hot else {
            let own = &self.priced(own, view, candidates, now_nanos);
            return self.argmin_direct(view, candidates, now_nanos, own);
        };
        let tie = if self.prices(own) {
            // The congestion price only raises the miss charge, which only
            // raises the scores of the workers that miss part of what the
            // best placed one holds. When every candidate within the tie
            // tolerance at the unraised charge is charged nothing, the tie
            // set, and so the choice and its draws, are the same at the
            // raised one: the pass over every candidate that prices the
            // congestion is skipped.
            let rule = self.argmin_rule(hot, view, candidates, now_nanos, own);
            if rule.all_ties(|index| own.charged_nothing(candidates[index])) {
                self.chosen(rule, hot, view, candidates, now_nanos, own)
            } else {
                drop(rule);
                let own = &self.priced(own, view, candidates, now_nanos);
                let rule = self.argmin_rule(hot, view, candidates, now_nanos, own);
                self.chosen(rule, hot, view, candidates, now_nanos, own)
            }
        } else {
            let rule = self.argmin_rule(hot, view, candidates, now_nanos, own);
            self.chosen(rule, hot, view, candidates, now_nanos, own)
        }?;
        match view.get(candidates[tie.index]) {
            Some(slot) => Some(Scored {
                slot,
                score_secs: tie.score_secs,
            }),
            // A worker added or removed while this view was taken: its
            // record and the view disagree, so score from the view alone.
            None => self.argmin_direct(view, candidates, now_nanos, own),
        }
    }

    /// The tie rule after offering every candidate from the hot records:
    /// from the keys' estimates when the candidates are many
    /// ([`LeastLoad::argmin_filtered`]), else scoring each exactly
    /// ([`LeastLoad::argmin_exact`]); the same choice either way.
    fn argmin_rule(
        &self,
        hot: &HotTable,
        view: &SlotsView<'_, WorkerState>,
        candidates: &[WorkerId],
        now_nanos: i64,
        own: &OwnWork,
    ) -> TieRule {
        let own_elsewhere = own.charged(0);
        if candidates.len() >= FILTER_MIN_CANDIDATES && own_elsewhere < EXACT_TOKENS {
            self.argmin_filtered(hot, view, candidates, now_nanos, own, own_elsewhere)
        } else {
            self.argmin_exact(hot, view, candidates, now_nanos, own)
        }
    }

    /// The candidate's score, or `None` when the cap vetoes it or it is not
    /// registered: from its hot record when that holds a fresh snapshot
    /// (the common case: one cache line and one division), from its own
    /// state otherwise, with the same arithmetic.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    fn candidate_score(
        &self,
        hot: &HotTable,
        view: &SlotsView<'_, WorkerState>,
        id: WorkerId,
        candidates: &[WorkerId],
        fleet: &mut Option<Fleet>,
        now_nanos: i64,
        own: &OwnWork,
        own_elsewhere: u64,
    ) -> Option<f64> {
        match hot.read(id) {
            Some(read)
                if now_nanos.saturating_sub(read.received_nanos) <= self.stale_after_nanos =>
            {
                let cap = self.params.max_waiting_requests;
                if cap != 0 && read.waiting_requests >= cap {
                    return None;
                }
                let own_tokens = if own.matches.is_empty() {
                    own_elsewhere
                } else {
                    own.on(id)
                };
                Some(wait_secs_converted(
                    read.queued_tokens_f64,
                    read.ahead_tokens.saturating_add(own_tokens),
                    self.hot_rate_tps(&read),
                    read.kv_barrier_secs,
                ))
            }
            _ => {
                let slot = view.get(id)?;
                self.admitted_score(view, slot, candidates, fleet, now_nanos, own)
            }
        }
    }

    /// Scores the candidate at `index` ([`LeastLoad::candidate_score`]) and
    /// offers it to the tie rule, unless the cap vetoes it: the step both
    /// argmins take per candidate they score exactly.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    fn offer_candidate(
        &self,
        rule: &mut TieRule,
        hot: &HotTable,
        view: &SlotsView<'_, WorkerState>,
        index: usize,
        id: WorkerId,
        candidates: &[WorkerId],
        fleet: &mut Option<Fleet>,
        now_nanos: i64,
        own: &OwnWork,
        own_elsewhere: u64,
    ) {
        if let Some(score_secs) = self.candidate_score(
            hot,
            view,
            id,
            candidates,
            fleet,
            now_nanos,
            own,
            own_elsewhere,
        ) {
            rule.offer(index, score_secs, || {
                LeastLoad::hot_last_dispatch_nanos(hot, view, id)
            });
        }
    }

    /// The rate a hot record's work is divided by.
    #[inline]
    fn hot_rate_tps(&self, read: &HotRead) -> f64 {
        match self.params.rate {
            RateMode::Learned => self
                .fleet_rate
                .scoring_tps((read.rate_bits != 0).then(|| f64::from_bits(read.rate_bits))),
            RateMode::Reported | RateMode::Fixed => f64::from_bits(read.rate_bits),
        }
    }

    /// How busy the least busy candidate is: the least `(queued + pending
    /// work) / rate` among the candidates with a fresh report (no barrier,
    /// no request), or 0 when none has one. Stops at the first idle worker.
    fn floor_wait_secs(
        &self,
        view: &SlotsView<'_, WorkerState>,
        candidates: &[WorkerId],
        now_nanos: i64,
    ) -> f64 {
        let mut floor_secs = f64::INFINITY;
        for id in candidates {
            let Some((wait_secs, _)) = self.token_wait(view, *id, now_nanos) else {
                continue;
            };
            floor_secs = floor_secs.min(wait_secs);
            if floor_secs <= 0.0 {
                break;
            }
        }
        if floor_secs.is_finite() {
            floor_secs
        } else {
            0.0
        }
    }

    /// A worker's `(queued + pending work) / rate`, and the rate, tokens
    /// per second; `None` without a fresh report.
    fn token_wait(
        &self,
        view: &SlotsView<'_, WorkerState>,
        id: WorkerId,
        now_nanos: i64,
    ) -> Option<(f64, f64)> {
        let hot_read = self
            .hot
            .as_ref()
            .and_then(|hot| hot.read(id))
            .filter(|read| now_nanos.saturating_sub(read.received_nanos) <= self.stale_after_nanos);
        if let Some(read) = hot_read {
            let rate_tps = self.hot_rate_tps(&read);
            return Some((
                wait_secs_converted(read.queued_tokens_f64, read.ahead_tokens, rate_tps, 0.0),
                rate_tps,
            ));
        }
        let state = &view.get(id)?.state;
        let snapshot = self.fresh_hot(state, now_nanos)?;
        let stats = state.ledger.stats();
        let remote = self.remote(state);
        let rate_tps = match self.params.rate {
            RateMode::Learned => self.worker_rate_tps(state),
            RateMode::Reported | RateMode::Fixed => snapshot.throughput_tps,
        };
        Some((
            wait_secs(
                snapshot.queued_tokens,
                self.inflight_tokens(state, stats, remote, true),
                rate_tps,
                0.0,
            ),
            rate_tps,
        ))
    }

    /// As [`floor_wait_secs`](Self::floor_wait_secs), with each worker's
    /// wait at least its waiting requests (others' and the router fleet's
    /// pending ones) over the rate its requests finish: a worker whose batch
    /// slots are full starts a waiting request only as a running one ends,
    /// however few prompt tokens wait. For the admission room, not the
    /// score: what the fleet can take now, not which worker is best. Stops
    /// at the first worker whose wait is at most `within_secs`.
    ///
    /// Returns that floor and the floor of the same waits less each
    /// worker's [progress](progress_secs) on its prompt under way.
    fn slot_aware_floor_secs(
        &self,
        view: &SlotsView<'_, WorkerState>,
        candidates: &[WorkerId],
        now_nanos: i64,
        within_secs: f64,
    ) -> (f64, f64) {
        // Nothing waits less than nothing: an idle worker ends the search.
        let enough_secs = within_secs.max(0.0);
        let mut floor_secs = f64::INFINITY;
        let mut less_progress_floor_secs = f64::INFINITY;
        for id in candidates {
            let Some(slot) = view.get(*id) else {
                continue;
            };
            let state = &slot.state;
            let stats = state.ledger.stats();
            // A worker without a fresh report waits for nothing known.
            let (token_secs, rate_tps) = self
                .token_wait(view, *id, now_nanos)
                .unwrap_or((0.0, f64::INFINITY));
            let remote = self.remote(state);
            let progress_secs =
                progress_secs(state, stats, remote, rate_tps, now_nanos).min(token_secs);
            if token_secs >= floor_secs && token_secs - progress_secs >= less_progress_floor_secs {
                // Its waits are at least these: it cannot lower either
                // floor, so its slot wait (a lock and a rate) is not worth
                // reading.
                continue;
            }
            let waiting = self
                .fresh_hot(state, now_nanos)
                .map_or(0, |hot| hot.others_waiting_requests)
                .saturating_add(stats.pending_requests)
                .saturating_add(remote.requests);
            let slot_secs = match worker_finishes_per_second(state, now_nanos) {
                Some(rate) if waiting > 0 => waiting as f64 / rate,
                _ => 0.0,
            };
            floor_secs = floor_secs.min(token_secs.max(slot_secs));
            // The slots stay as they are: the prompt under way holds one
            // until it ends.
            less_progress_floor_secs =
                less_progress_floor_secs.min((token_secs - progress_secs).max(slot_secs));
            if floor_secs <= enough_secs {
                break;
            }
        }
        if floor_secs.is_finite() {
            (floor_secs, less_progress_floor_secs.min(floor_secs))
        } else {
            (0.0, 0.0)
        }
    }

    /// Whether [`LeastLoad::priced`] may raise `own`'s miss weight.
    #[inline]
    fn prices(&self, own: &OwnWork) -> bool {
        own.best_cached_tokens != 0
            && self.params.prefix_congestion_weight != 0.0
            && own.tokens != 0
    }

    /// `own` with its miss weight raised by the congestion of `candidates`:
    /// `prefix_miss_weight + prefix_congestion_weight × floor_wait /
    /// own_prefill`, where `own_prefill` is the whole prompt at the fleet's
    /// rate. While a candidate is idle a miss costs only its recompute; when
    /// every one has work queued, the recompute takes capacity from requests
    /// already waiting, and a fixed charge would be outgrown by the
    /// deepening queues it causes (`docs/least-load.md`, "Prefix affinity").
    fn priced(
        &self,
        own: &OwnWork,
        view: &SlotsView<'_, WorkerState>,
        candidates: &[WorkerId],
        now_nanos: i64,
    ) -> OwnWork {
        if !self.prices(own) {
            return *own;
        }
        let congestion_weight = self.params.prefix_congestion_weight;
        let own_prefill_secs = own.tokens as f64 / self.fleet_rate.tps();
        let floor_secs = self.floor_wait_secs(view, candidates, now_nanos);
        let raised = congestion_weight * floor_secs / own_prefill_secs;
        OwnWork {
            miss_weight: own.miss_weight + if raised.is_finite() { raised } else { 0.0 },
            ..*own
        }
    }

    /// The choice of the filtered two-pass argmin (`filtered`) or of the
    /// one-pass one, and the tie-breaker's next draw after it, for the
    /// tests that hold them equal.
    #[cfg(test)]
    pub(crate) fn choice_for_test(
        &self,
        candidates: &[WorkerId],
        request: &RequestInfo,
        now: Instant,
        filtered: bool,
    ) -> (Option<(usize, u64)>, u64) {
        let (_, own, now_nanos) = self.own_work_at(request, now);
        let view = self.workers.read();
        let tie = self.hot.as_ref().and_then(|hot| {
            let rule = if filtered {
                self.argmin_filtered(hot, &view, candidates, now_nanos, &own, own.charged(0))
            } else {
                self.argmin_exact(hot, &view, candidates, now_nanos, &own)
            };
            self.chosen(rule, hot, &view, candidates, now_nanos, &own)
        });
        (
            tie.map(|tie| (tie.index, tie.score_secs.to_bits())),
            self.rng.next_u64(),
        )
    }

    /// The choice of [`LeastLoad::argmin`] (`lazy`: as selections make it,
    /// pricing the congestion only when the tie set may depend on it) or
    /// of the argmin at the congestion-priced miss weight, and the
    /// tie-breaker's next draw after it, for the tests that hold them equal.
    #[cfg(test)]
    pub(crate) fn priced_choice_for_test(
        &self,
        candidates: &[WorkerId],
        request: &RequestInfo,
        now: Instant,
        lazy: bool,
    ) -> (Option<(usize, u64)>, u64) {
        let (_, own, now_nanos) = self.own_work_at(request, now);
        let view = self.workers.read();
        let choice = if lazy {
            self.argmin(&view, candidates, now_nanos, &own)
                .and_then(|scored| {
                    let index = candidates.iter().position(|id| *id == scored.slot.id)?;
                    Some((index, scored.score_secs.to_bits()))
                })
        } else {
            let own = self.priced(&own, &view, candidates, now_nanos);
            self.hot.as_ref().and_then(|hot| {
                let rule = self.argmin_rule(hot, &view, candidates, now_nanos, &own);
                self.chosen(rule, hot, &view, candidates, now_nanos, &own)
                    .map(|tie| (tie.index, tie.score_secs.to_bits()))
            })
        };
        (choice, self.rng.next_u64())
    }

    /// When the candidate at hand was last dispatched to (the tie-break).
    fn last_dispatch_nanos(view: &SlotsView<'_, WorkerState>, id: WorkerId) -> i64 {
        view.get(id)
            .map_or(i64::MIN, |slot| slot.state.last_dispatch.nanos())
    }

    /// [`LeastLoad::last_dispatch_nanos`] from the hot table's packed copy
    /// where it has one: with many tied candidates (an idle fleet) every
    /// one of them is asked, and a read of each worker's own state would
    /// be a cache miss each.
    #[inline]
    fn hot_last_dispatch_nanos(
        hot: &HotTable,
        view: &SlotsView<'_, WorkerState>,
        id: WorkerId,
    ) -> i64 {
        hot.last_dispatch_nanos(id)
            .unwrap_or_else(|| LeastLoad::last_dispatch_nanos(view, id))
    }

    /// One pass scoring every candidate exactly ([`TieRule`]).
    fn argmin_exact(
        &self,
        hot: &HotTable,
        view: &SlotsView<'_, WorkerState>,
        candidates: &[WorkerId],
        now_nanos: i64,
        own: &OwnWork,
    ) -> TieRule {
        let own_elsewhere = own.charged(0);
        let mut fleet = None;
        let mut rule = TieRule::new(self.params.tie_tolerance_secs);
        for (index, id) in candidates.iter().enumerate() {
            self.offer_candidate(
                &mut rule,
                hot,
                view,
                index,
                *id,
                candidates,
                &mut fleet,
                now_nanos,
                own,
                own_elsewhere,
            );
        }
        rule
    }

    /// The same choice as [`LeastLoad::argmin_exact`], from the filter's
    /// estimates where they decide it.
    ///
    /// One pass ([`scan_estimates`]) reads each candidate's
    /// [`HotKey`](crate::state) only (32 bytes, side by side with its
    /// neighbours') and estimates its score as `base_secs + own_tokens ×
    /// inv_rate`: a multiply-add instead of a division, off the exact score
    /// by a few ulps (every term is non-negative and every integer below
    /// 2⁵² converts exactly). A candidate it cannot estimate (no fresh
    /// snapshot, a prefix held there, a key being rewritten) is scored
    /// exactly. It keeps every value within the filter's bar of the lowest
    /// so far, with the candidate's last dispatch from the packed copy
    /// beside the keys; once it is over, those within the final bar are
    /// offered to the tie rule, in candidate order.
    ///
    /// The values decide when none lies within a relative [`FILTER_MARGIN`]
    /// (far above the estimates' error) of the edge of the final tolerance,
    /// the lowest value plus `tie_tolerance_secs`
    /// ([`LeastLoad::estimates_decide`]). Then the values within the
    /// tolerance are those of exactly the candidates whose exact scores
    /// are; within that set the rule decides by last dispatch alone, so it
    /// makes the exact choice and draws, and only the winner is scored
    /// exactly ([`LeastLoad::chosen`]). This is the common case: a busy
    /// fleet's scores rarely fall within a few ulps of that edge, and an
    /// idle fleet's workers, which all report the same empty queue and tie,
    /// are decided from the packed keys and last dispatch times. Otherwise
    /// the two-pass argmin decides ([`LeastLoad::argmin_two_pass`]).
    fn argmin_filtered(
        &self,
        hot: &HotTable,
        view: &SlotsView<'_, WorkerState>,
        candidates: &[WorkerId],
        now_nanos: i64,
        own: &OwnWork,
        own_elsewhere: u64,
    ) -> TieRule {
        let tolerance_secs = self.params.tie_tolerance_secs;
        let mut kept = WITHIN.with(Cell::take);
        kept.clear();
        let scan = if own.matches.is_empty() {
            self.estimate_pass(
                hot,
                view,
                candidates,
                now_nanos,
                own,
                own_elsewhere,
                &mut kept,
                |_| false,
            )
        } else {
            self.estimate_pass(
                hot,
                view,
                candidates,
                now_nanos,
                own,
                own_elsewhere,
                &mut kept,
                |slot| own.matches.holds(slot),
            )
        };
        let mut rule = TieRule::new(tolerance_secs);
        for within in &kept {
            if within.value_secs <= scan.bar_secs {
                rule.offer(within.index, within.value_secs, || {
                    within.last_dispatch_nanos
                });
            }
        }
        let decided = LeastLoad::estimates_decide(&kept, scan.lowest_secs, tolerance_secs);
        kept.clear();
        WITHIN.with(|cell| cell.set(kept));
        if !scan.lowest_secs.is_finite() {
            // Nothing was kept: no candidate can take the request.
            return rule;
        }
        if decided {
            #[cfg(test)]
            SURE_RULES.with(|count| count.set(count.get() + 1));
            rule.estimated_bar_secs = Some(scan.bar_secs);
            return rule;
        }
        drop(rule);
        self.argmin_two_pass(hot, view, candidates, now_nanos, own, own_elsewhere)
    }

    /// The pass of [`LeastLoad::argmin_filtered`]: keeps in `kept` every
    /// candidate whose value (its estimate, or its exact score where
    /// `exact` names its slot or it has no usable key) is within the
    /// filter's bar of the lowest so far ([`scan_estimates`],
    /// [`Scan::keep`]); returns where the scan ended.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    fn estimate_pass(
        &self,
        hot: &HotTable,
        view: &SlotsView<'_, WorkerState>,
        candidates: &[WorkerId],
        now_nanos: i64,
        own: &OwnWork,
        own_elsewhere: u64,
        kept: &mut Vec<Within>,
        exact: impl Fn(usize) -> bool,
    ) -> Scan {
        let tolerance_secs = self.params.tie_tolerance_secs;
        let fresh_from_nanos = self.fresh_from_nanos(now_nanos);
        let own_tokens = own_elsewhere as f64;
        let mut fleet = None;
        let mut keys = hot.keys();
        let mut scan = Scan::new();
        while let Some(index) = scan_estimates(
            &mut keys,
            candidates,
            &mut scan,
            kept,
            fresh_from_nanos,
            own_tokens,
            tolerance_secs,
            &exact,
        ) {
            let id = candidates[index];
            let score_secs = self.candidate_score(
                hot,
                view,
                id,
                candidates,
                &mut fleet,
                now_nanos,
                own,
                own_elsewhere,
            );
            if let Some(score_secs) = score_secs
                && score_secs <= scan.bar_secs
            {
                let last_dispatch_nanos = LeastLoad::hot_last_dispatch_nanos(hot, view, id);
                scan.keep(kept, index, score_secs, last_dispatch_nanos, tolerance_secs);
            }
        }
        scan
    }

    /// A key received at or after this is fresh (and so is its record).
    /// Never `i64::MIN`, the received time of a key no worker owns, so
    /// that an unusable key is never taken for fresh, even by an id whose
    /// tag is the unusable tag (`slot` and `generation` both `u32::MAX`).
    #[inline]
    fn fresh_from_nanos(&self, now_nanos: i64) -> i64 {
        now_nanos
            .saturating_sub(self.stale_after_nanos)
            .max(i64::MIN + 1)
    }

    /// Whether the values of [`LeastLoad::argmin_filtered`]'s pass decide
    /// the tie set: none of `kept` lies between the highest value sure to
    /// be within the tie tolerance of the lowest exact score
    /// ([`sure_bar`]) and the lowest that is sure not to be
    /// ([`filter_bar`]).
    fn estimates_decide(kept: &[Within], lowest_secs: f64, tolerance_secs: f64) -> bool {
        let bar = filter_bar(lowest_secs, tolerance_secs);
        let sure = sure_bar(lowest_secs, tolerance_secs);
        let decided = |value: f64| value > bar || value <= sure;
        kept.iter().all(|within| decided(within.value_secs))
    }

    /// The same choice as [`LeastLoad::argmin_exact`], in two passes, for
    /// when the estimates do not decide it ([`LeastLoad::argmin_filtered`]).
    ///
    /// The first ([`filter_pass`]) keeps the candidates whose estimate is
    /// within the tie tolerance, plus a relative margin of
    /// [`FILTER_MARGIN`], of the lowest estimate so far, and every candidate
    /// it cannot estimate. The lowest estimate only falls, so every
    /// candidate within the final tie tolerance of the exact lowest score
    /// is kept.
    ///
    /// The second scores the kept ones exactly, in candidate order, through
    /// the one-pass rule: a candidate left out could not have been within
    /// the final tolerance, so could neither win nor take part in a draw,
    /// and the choice and the draws taken are those of the one-pass rule.
    fn argmin_two_pass(
        &self,
        hot: &HotTable,
        view: &SlotsView<'_, WorkerState>,
        candidates: &[WorkerId],
        now_nanos: i64,
        own: &OwnWork,
        own_elsewhere: u64,
    ) -> TieRule {
        let tolerance_secs = self.params.tie_tolerance_secs;
        let fresh_from_nanos = self.fresh_from_nanos(now_nanos);
        let mut kept = KEPT.with(Cell::take);
        kept.clear();
        let bar = if own.matches.is_empty() {
            filter_pass(
                hot,
                candidates,
                fresh_from_nanos,
                own_elsewhere,
                tolerance_secs,
                &mut kept,
                |_| false,
            )
        } else {
            filter_pass(
                hot,
                candidates,
                fresh_from_nanos,
                own_elsewhere,
                tolerance_secs,
                &mut kept,
                |slot| own.matches.holds(slot),
            )
        };
        let mut fleet = None;
        let mut rule = TieRule::new(tolerance_secs);
        for &(index, estimate) in &kept {
            if estimate > bar {
                continue;
            }
            self.offer_candidate(
                &mut rule,
                hot,
                view,
                index,
                candidates[index],
                candidates,
                &mut fleet,
                now_nanos,
                own,
                own_elsewhere,
            );
        }
        kept.clear();
        KEPT.with(|cell| cell.set(kept));
        rule
    }

    /// The rule's choice with its exact score. A rule offered estimates
    /// ([`LeastLoad::estimates_decide`]) has its winner scored now; should that score
    /// exceed the estimates' bar (the winner's key raced a change to it),
    /// the one-pass rule decides instead.
    #[allow(clippy::too_many_arguments)]
    fn chosen(
        &self,
        mut rule: TieRule,
        hot: &HotTable,
        view: &SlotsView<'_, WorkerState>,
        candidates: &[WorkerId],
        now_nanos: i64,
        own: &OwnWork,
    ) -> Option<Tie> {
        let tie = rule.choose(&self.rng);
        let estimated_bar_secs = rule.estimated_bar_secs;
        // Before a second rule may need the room; not `drop(rule)`, which
        // would copy the rule (its whole stack) to drop it.
        rule.give_back_room();
        let tie = tie?;
        let Some(bar_secs) = estimated_bar_secs else {
            return Some(tie);
        };
        let id = candidates[tie.index];
        let score_secs = self.candidate_score(
            hot,
            view,
            id,
            candidates,
            &mut None,
            now_nanos,
            own,
            own.charged(0),
        );
        match score_secs {
            Some(score_secs) if score_secs <= bar_secs => Some(Tie { score_secs, ..tie }),
            _ => self
                .argmin_exact(hot, view, candidates, now_nanos, own)
                .choose(&self.rng),
        }
    }

    /// [`argmin`](Self::argmin) reading every candidate's own state.
    fn argmin_direct<'v>(
        &self,
        view: &'v SlotsView<'_, WorkerState>,
        candidates: &[WorkerId],
        now_nanos: i64,
        own: &OwnWork,
    ) -> Option<Scored<'v>> {
        let mut fleet = None;
        let mut rule = TieRule::new(self.params.tie_tolerance_secs);
        for (index, id) in candidates.iter().enumerate() {
            let Some(slot) = view.get(*id) else {
                continue;
            };
            let Some(score_secs) =
                self.admitted_score(view, slot, candidates, &mut fleet, now_nanos, own)
            else {
                continue;
            };
            rule.offer(index, score_secs, || slot.state.last_dispatch.nanos());
        }
        let tie = rule.choose(&self.rng)?;
        let slot = view.get(candidates[tie.index])?;
        Some(Scored {
            slot,
            score_secs: tie.score_secs,
        })
    }

    /// Two distinct uniform samples, decided by the same scorer; the whole
    /// fleet when both samples are unusable (capped or unknown), so a request
    /// is refused only when no candidate can take it.
    fn power_of_two<'v>(
        &self,
        view: &'v SlotsView<'_, WorkerState>,
        candidates: &[WorkerId],
        now_nanos: i64,
        own: &OwnWork,
    ) -> Option<Scored<'v>> {
        let count = candidates.len() as u64;
        if count <= 2 {
            return self.argmin(view, candidates, now_nanos, own);
        }
        let first = self.rng.below(count);
        let mut second = self.rng.below(count - 1);
        if second >= first {
            second += 1;
        }
        // Indices are below `candidates.len()`, so the casts are lossless.
        let pair = [candidates[first as usize], candidates[second as usize]];
        self.argmin(view, &pair, now_nanos, own)
            .or_else(|| self.argmin(view, candidates, now_nanos, own))
    }

    fn choose<'v>(
        &self,
        view: &'v SlotsView<'_, WorkerState>,
        candidates: &[WorkerId],
        now_nanos: i64,
        own: &OwnWork,
    ) -> Option<Scored<'v>> {
        // One candidate goes through the argmin too: the cap must still
        // apply (and is checked again under the ledger's lock when crediting).
        match self.strategy {
            Strategy::LeastLoad => self.argmin(view, candidates, now_nanos, own),
            Strategy::PowerOfTwo => self.power_of_two(view, candidates, now_nanos, own),
        }
    }
}

impl Policy for LeastLoad {
    fn name(&self) -> &'static str {
        self.strategy.name()
    }

    fn params(&self) -> serde_json::Value {
        self.params.to_section()
    }

    fn add_worker(&self, id: WorkerId, info: WorkerInfo) {
        // A worker joining a fleet that has learned its rates starts from
        // theirs (most fleets run one engine build on one kind of GPU), so
        // it is neither flooded nor starved while it learns its own.
        let prior_tps = self.fleet_rate.tps();
        self.workers
            .insert(id, info, WorkerState::new(&self.params, prior_tps));
        self.fleet_memo.changed();
        if let Some(hot) = &self.hot
            && let Some(slot) = self.workers.read().get(id)
        {
            hot.insert(id, || self.hot_values(&slot.state));
        }
    }

    fn remove_worker(&self, id: WorkerId) {
        let removed = self.workers.remove(id).is_some();
        self.fleet_memo.changed();
        if removed && let Some(hot) = &self.hot {
            hot.remove(id);
        }
        self.refresh_fleet_rate(&self.workers.read());
    }

    fn select(
        &self,
        candidates: &[WorkerId],
        request: &RequestInfo,
        now: Instant,
    ) -> Option<Dispatch> {
        if candidates.is_empty() {
            return None;
        }
        let (tokens, own, now_nanos) = self.own_work_at(request, now);
        let view = self.workers.read();
        let seq = next_dispatch_seq();
        // A failed credit means a concurrent selection filled the chosen
        // worker's cap after it was scored; scoring again sees that. Bounded,
        // because each retry follows another selection's success.
        for _ in 0..=candidates.len() {
            let chosen = self.choose(&view, candidates, now_nanos, &own)?;
            let state = &chosen.slot.state;
            // The engine computes only what its cache does not hold.
            let cached_tokens = own.cached_tokens(chosen.slot.id, tokens);
            let tokens = tokens - cached_tokens;
            // The veto and the credit are one critical section; the note is
            // what the first token will teach the worker's rate. The last
            // dispatch is recorded in it too, so its writers are serialized.
            let credited = state.ledger.try_credit_noted(seq, tokens, |stats| {
                let hot = self.fresh_hot(state, now_nanos);
                let others_waiting = hot.map_or(0, |hot| hot.others_waiting_requests);
                let remote = self.remote(state);
                self.admits(others_waiting, stats, remote).then(|| {
                    state.last_dispatch.record_under_ledger_lock(now_nanos);
                    if stats.pending_requests == 0 && remote.requests == 0 {
                        // The engine takes it up now: nothing of the router
                        // fleet's is ahead of it.
                        state.head_start.record(now_nanos);
                    }
                    // The other replicas' pending work is learned from at
                    // their first tokens, so it is not foreign: only the
                    // rest of the engine's queue is.
                    let foreign_ahead_tokens = hot
                        .map_or(0, |hot| hot.queued_tokens)
                        .saturating_sub(remote.tokens);
                    RateProbe {
                        dispatched_nanos: now_nanos,
                        foreign_ahead_tokens,
                        learn: request.streaming,
                    }
                })
            });
            if credited {
                if let Some(index) = &self.prefix {
                    let slot = chosen.slot.id.slot();
                    if cached_tokens > 0 {
                        index.note_prediction(slot, seq, own.matches.age_tokens(slot));
                    }
                    index.record(slot, &request.prefix, cached_tokens, index_ms(now_nanos));
                }
                if self.params.inflight == InflightMode::SincePoll {
                    state.since_poll.add(tokens);
                }
                self.refresh_hot(chosen.slot);
                return Some(Dispatch {
                    worker: chosen.slot.id,
                    tokens,
                    seq,
                    score: chosen.score_secs,
                    cached_tokens,
                });
            }
        }
        None
    }

    fn first_token(&self, dispatch: &Dispatch, now: Instant) -> Option<PrefillSample> {
        // Releases pending work (the since-poll tally is untouched by
        // design), and learns the worker's rate from how long it took.
        let view = self.workers.read();
        let slot = view.get(dispatch.worker)?;
        let (tokens, probe) = slot.state.ledger.first_token_noted(dispatch.seq)?;
        let pending = slot.state.ledger.stats().pending_requests;
        if pending.saturating_add(self.remote(&slot.state).requests) > 0 {
            // The engine is on to the next of the router fleet's, at the
            // latest now.
            slot.state.head_start.record(self.timeline.nanos(now));
        }
        if !probe.learn {
            self.refresh_hot(slot);
            return None;
        }
        let now_nanos = self.timeline.nanos(now);
        let first_token = FirstToken {
            probe,
            tokens,
            at_nanos: now_nanos,
        };
        self.learn_first_token(&view, slot, first_token, now_nanos);
        Some(PrefillSample {
            tokens,
            foreign_ahead_tokens: probe.foreign_ahead_tokens,
            waited: Duration::from_nanos(
                u64::try_from(now_nanos.saturating_sub(probe.dispatched_nanos)).unwrap_or(0),
            ),
        })
    }

    fn finish(&self, dispatch: &Dispatch, now: Instant) {
        if let Some(slot) = self.workers.read().get(dispatch.worker)
            && slot.state.ledger.finish(dispatch.seq)
        {
            slot.state.finishes.record(self.timeline.nanos(now));
            self.refresh_hot(slot);
        }
    }

    fn poll_started(&self, id: WorkerId, now: Instant) -> PollMark {
        let seq = self.next_poll.fetch_add(1, Ordering::Relaxed);
        match self.workers.read().get(id) {
            Some(slot) => {
                let remote = slot.state.remote.totals();
                PollMark {
                    remote_pending_tokens: remote.tokens,
                    remote_pending_requests: remote.requests,
                    ..slot.state.ledger.poll_mark(id, seq, now)
                }
            }
            None => WorkerLedger::<RateProbe>::default().poll_mark(id, seq, now),
        }
    }

    fn poll_completed(&self, mark: PollMark, load: Option<&WorkerLoad>, now: Instant) {
        let received_nanos = self.timeline.nanos(now);
        let view = self.workers.read();
        let Some(slot) = view.get(mark.worker) else {
            return;
        };
        if let (Some(index), Some(load)) = (&self.prefix, load) {
            index.set_capacity(mark.worker.slot(), reported_kv_capacity_tokens(load));
        }
        let snapshot = load.map(|load| {
            let summary = LoadSummary::from(load);
            let ours_at_poll_start = PendingWork {
                tokens: mark.pending_tokens,
                requests: mark.pending_requests,
            };
            // Every replica's pending work known when the poll was sent is
            // part of the reported queue: the spec's rule (subtract our
            // own), generalized to the whole router fleet.
            let fleet_at_poll_start = PendingWork {
                tokens: mark
                    .pending_tokens
                    .saturating_add(mark.remote_pending_tokens),
                requests: mark
                    .pending_requests
                    .saturating_add(mark.remote_pending_requests),
            };
            // since_poll subtracts nothing from the queue: its tally is reset
            // instead. The cap reads the live ledger in both modes, so it
            // subtracts the ledger's pending requests even in since_poll.
            let (subtracted, waiting_subtracted) = match self.params.inflight {
                InflightMode::Pending => (fleet_at_poll_start, fleet_at_poll_start.requests),
                InflightMode::SincePoll => (PendingWork::default(), ours_at_poll_start.requests),
            };
            StoredSnapshot {
                received_nanos,
                terms: SnapshotTerms::new(&summary, subtracted, &self.params),
                others_waiting_requests: summary
                    .waiting_requests
                    .saturating_sub(waiting_subtracted),
            }
        });
        let reported = snapshot.is_some();
        let applied = slot.state.snapshot.apply(mark.seq, snapshot, || {
            if reported && self.params.inflight == InflightMode::SincePoll {
                slot.state.since_poll.reset();
            }
        });
        if applied {
            self.snapshot_applied(slot);
        }
    }

    fn poll_failed(&self, mark: PollMark, _now: Instant) {
        if let Some(slot) = self.workers.read().get(mark.worker)
            && slot.state.snapshot.apply(mark.seq, None, || {})
        {
            self.snapshot_applied(slot);
        }
    }

    fn expected_wait(
        &self,
        candidates: &[WorkerId],
        request: &RequestInfo,
        now: Instant,
    ) -> Option<ExpectedWait> {
        self.expected_wait_within(candidates, request, now, 0.0)
    }

    fn expected_wait_within(
        &self,
        candidates: &[WorkerId],
        request: &RequestInfo,
        now: Instant,
        within_secs: f64,
    ) -> Option<ExpectedWait> {
        let now_nanos = self.timeline.nanos(now);
        let tokens = request.tokens.or(self.params.mean_prefill_tokens);
        let view = self.workers.read();
        // The prompt as if nothing were cached: a prediction that errs
        // long, so that a deadline it admits is kept.
        let (queue_secs, queue_less_progress_secs) =
            self.slot_aware_floor_secs(&view, candidates, now_nanos, within_secs);
        Some(ExpectedWait {
            queue_secs,
            prefill_secs: tokens as f64 / self.fleet_rate.tps(),
            queue_less_progress_secs: Some(queue_less_progress_secs),
            cached_prefill_secs: 0.0,
        })
    }

    fn preview(
        &self,
        candidates: &[WorkerId],
        request: &RequestInfo,
        now: Instant,
    ) -> Option<(WorkerId, ExpectedWait)> {
        let (tokens, own, now_nanos) = self.own_work_at(request, now);
        let view = self.workers.read();
        let chosen = self.choose(&view, candidates, now_nanos, &own)?.slot;
        // The whole prompt, as if nothing were cached (an eviction makes it
        // so), at the fleet's rate, or at the chosen worker's when that is
        // of another kind: in a fleet of mixed speeds the fleet's rate is
        // long of a fast worker's prefill, and turned away long prompts it
        // serves in time, and short of a slow one's.
        let fleet_tps = self.fleet_rate.tps();
        let rate_tps = match (self.params.rate, chosen.state.rate.learned_tps()) {
            (RateMode::Learned, Some(learned_tps))
                if learned_tps > OTHER_KIND_FACTOR * fleet_tps
                    || learned_tps * OTHER_KIND_FACTOR < fleet_tps =>
            {
                learned_tps
            }
            _ => fleet_tps,
        };
        let (queue_secs, queue_less_progress_secs) =
            self.slot_aware_floor_secs(&view, &[chosen.id], now_nanos, 0.0);
        Some((
            chosen.id,
            ExpectedWait {
                queue_secs,
                prefill_secs: tokens as f64 / rate_tps,
                queue_less_progress_secs: Some(queue_less_progress_secs),
                cached_prefill_secs: own.cached_tokens(chosen.id, tokens) as f64 / rate_tps,
            },
        ))
    }

    fn score_is_wait_secs(&self) -> bool {
        true
    }

    fn explain(&self, candidates: &[WorkerId], request: &RequestInfo, now: Instant) -> ScoreTable {
        let mut table = ScoreTable::new(self.name(), describe_request(request), &COLUMNS);
        let now_nanos = self.timeline.nanos(now);
        let view = self.workers.read();
        let slots: Vec<&Slot<WorkerState>> =
            candidates.iter().filter_map(|id| view.get(*id)).collect();
        let fleet = self.fleet(slots.iter().copied(), now_nanos);
        let prompt_tokens = request.tokens.or(self.params.mean_prefill_tokens);
        let own = self.priced(
            &self.own_work(prompt_tokens, request, now_nanos),
            &view,
            candidates,
            now_nanos,
        );
        let mut admitted_scores = Vec::new();
        for slot in slots {
            let own_tokens = own.on(slot.id);
            let cached_tokens = own.cached_tokens(slot.id, own.tokens);
            let snapshot = self.fresh_snapshot(&slot.state, now_nanos);
            let stats = slot.state.ledger.stats();
            let remote = self.remote(&slot.state);
            let b = self.breakdown(
                &slot.state,
                snapshot.as_ref(),
                stats,
                remote,
                own_tokens,
                fleet,
            );
            let others_waiting = snapshot.map_or(0, |snapshot| snapshot.others_waiting_requests);
            let waiting = LeastLoad::waiting_estimate(others_waiting, stats, remote);
            let mut note = b.rule.to_string();
            let rate = &slot.state.rate;
            match (self.params.rate, rate.source()) {
                (RateMode::Learned, LearnedSource::Prior) => {
                    note.push_str(&format!(
                        "; rate: the fleet's while learning ({} of {MIN_SAMPLES_TO_SCORE} samples)",
                        rate.samples()
                    ));
                }
                (RateMode::Learned, LearnedSource::Learned) => {
                    note.push_str(&format!("; rate: learned from {} samples", rate.samples()));
                    if rate.learned_tps() != Some(b.throughput_tps) {
                        note.push_str(&format!(
                            " ({:.0} tok/s, within the deadband of the fleet's)",
                            rate.rate_tps()
                        ));
                    }
                }
                (RateMode::Reported | RateMode::Fixed, LearnedSource::Prior) => {}
                (RateMode::Reported | RateMode::Fixed, LearnedSource::Learned) => {
                    note.push_str(&format!(
                        "; rate: {} (learned would be {:.0} tok/s)",
                        self.params.rate,
                        rate.rate_tps()
                    ));
                }
            }
            if rate.dropped() > 0 {
                note.push_str(&format!(", {} dropped", rate.dropped()));
            }
            let summary = slot.state.remote.summary();
            let remote_age_secs = summary.stalest_refresh_nanos.map_or(0.0, |refreshed| {
                now_nanos.saturating_sub(refreshed).max(0) as f64 / 1e9
            });
            match (summary.replicas, self.params.inflight) {
                (0, _) => {}
                (replicas, InflightMode::Pending) => {
                    note.push_str(&format!("; remote: {replicas} replicas"));
                }
                (replicas, InflightMode::SincePoll) => {
                    note.push_str(&format!(
                        "; remote: {replicas} replicas, not counted under since_poll"
                    ));
                }
            }
            if self.admits(others_waiting, stats, remote) {
                admitted_scores.push((slot.id, b.score_secs, slot.state.last_dispatch.nanos()));
            } else {
                note.push_str(&format!(
                    "; capped: {waiting} waiting >= {}",
                    self.params.max_waiting_requests
                ));
            }
            table.rows.push(ScoreRow {
                worker: slot.id,
                url: slot.info.url.clone(),
                values: vec![
                    b.queued_tokens as f64,
                    b.inflight_tokens as f64,
                    b.request_tokens as f64,
                    cached_tokens as f64,
                    b.throughput_tps,
                    rate.samples() as f64,
                    b.kv_usage_ratio,
                    b.drain_secs,
                    b.kv_barrier_secs,
                    b.score_secs,
                    waiting as f64,
                    summary.work.tokens as f64,
                    summary.work.requests as f64,
                    remote_age_secs,
                ],
                note,
            });
        }
        // The workers `select` would draw from: within the tie tolerance of
        // the best score, and among those the least recently dispatched.
        let best_secs = admitted_scores
            .iter()
            .map(|(_, score, _)| *score)
            .fold(f64::INFINITY, f64::min);
        let within_secs = best_secs + self.params.tie_tolerance_secs;
        admitted_scores.retain(|(_, score, _)| *score <= within_secs);
        let oldest = admitted_scores.iter().map(|(_, _, last)| *last).min();
        table.chosen = admitted_scores
            .into_iter()
            .filter(|(_, _, last)| Some(*last) == oldest)
            .map(|(id, _, _)| id)
            .collect();
        table
    }

    fn worker_stats(&self, id: WorkerId) -> Option<WorkerStats> {
        self.workers
            .read()
            .get(id)
            .map(|slot| slot.state.ledger.stats())
    }

    fn replica_pending(&self, entry: &ReplicaPending<'_>, now: Instant) -> ReplicaPendingOutcome {
        let view = self.workers.read();
        let Some(slot) = view.find_url(entry.worker_url) else {
            return ReplicaPendingOutcome::UnknownWorker;
        };
        let now_nanos = self.timeline.nanos(now);
        let before = self.remote(&slot.state);
        let outcome = slot.state.remote.apply(
            entry.replica,
            entry.seq,
            PendingWork {
                tokens: entry.pending_tokens,
                requests: entry.pending_requests,
            },
            now_nanos,
        );
        if outcome == ReplicaPendingOutcome::Applied {
            let after = self.remote(&slot.state);
            let own = slot.state.ledger.stats().pending_requests;
            let started_on_nothing = own.saturating_add(before.requests) == 0 && after.requests > 0;
            let finished_one =
                after.requests < before.requests && own.saturating_add(after.requests) > 0;
            if started_on_nothing || finished_one {
                // The engine took up the router fleet's next prompt (as
                // late as the other replica's message, at the latest now).
                slot.state.head_start.record(now_nanos);
            }
            self.refresh_hot(slot);
        }
        outcome
    }

    fn placement(&self, request: &RequestInfo) -> Option<PrefixBlocks> {
        let index = self.prefix.as_ref()?;
        let blocks = index.coarsen(&request.prefix);
        (!blocks.is_empty()).then_some(blocks)
    }

    fn replica_update(&self, update: &ReplicaUpdate<'_>, now: Instant) -> ReplicaUpdateOutcome {
        let view = self.workers.read();
        let Some(slot) = view.find_url(update.worker_url()) else {
            return ReplicaUpdateOutcome::UnknownWorker;
        };
        let now_nanos = self.timeline.nanos(now);
        match (update, &self.prefix) {
            (
                ReplicaUpdate::Prefill {
                    sample,
                    first_token_at,
                    ..
                },
                _,
            ) => {
                let at_nanos = self.timeline.nanos(*first_token_at);
                self.peer_lateness.heard(now_nanos.saturating_sub(at_nanos));
                let waited_nanos = i64::try_from(sample.waited.as_nanos()).unwrap_or(i64::MAX);
                let first_token = FirstToken {
                    probe: RateProbe {
                        dispatched_nanos: at_nanos.saturating_sub(waited_nanos),
                        foreign_ahead_tokens: sample.foreign_ahead_tokens,
                        learn: true,
                    },
                    tokens: sample.tokens,
                    at_nanos,
                };
                self.learn_first_token(&view, slot, first_token, now_nanos);
            }
            (ReplicaUpdate::Placed { .. } | ReplicaUpdate::CacheBound { .. }, None) => {
                return ReplicaUpdateOutcome::Unsupported;
            }
            (ReplicaUpdate::Placed { prefix, .. }, Some(index)) => {
                index.record_placed(slot.id.slot(), prefix, index_ms(now_nanos));
            }
            (ReplicaUpdate::CacheBound { cache_tokens, .. }, Some(index)) => {
                index.set_learned_bound(slot.id.slot(), *cache_tokens);
            }
        }
        ReplicaUpdateOutcome::Applied
    }

    fn cache_report(
        &self,
        dispatch: &Dispatch,
        reported_cached_tokens: u64,
        _now: Instant,
    ) -> Option<u64> {
        let index = self.prefix.as_ref()?;
        // A removed worker's slot may hold another worker by now.
        self.workers.read().get(dispatch.worker)?;
        index.report(
            dispatch.worker.slot(),
            dispatch.seq,
            dispatch.cached_tokens,
            reported_cached_tokens,
        )
    }

    fn prefix_snapshot(&self, now: Instant) -> Option<PrefixSnapshot> {
        let index = self.prefix.as_ref()?;
        let workers: Vec<(usize, String)> = self
            .workers
            .read()
            .iter()
            .map(|slot| (slot.id.slot(), slot.info.url.clone()))
            .collect();
        Some(index.export(index_ms(self.timeline.nanos(now)), &workers))
    }

    fn load_prefix_snapshot(&self, snapshot: &PrefixSnapshot, now: Instant) -> usize {
        let Some(index) = &self.prefix else {
            return 0;
        };
        let view = self.workers.read();
        let slot_of: Vec<Option<usize>> = snapshot
            .workers
            .iter()
            .map(|worker| view.find_url(&worker.url).map(|slot| slot.id.slot()))
            .collect();
        index.import(snapshot, &slot_of, index_ms(self.timeline.nanos(now)))
    }

    fn expire_replica_pending(&self, now: Instant, ttl: Duration) -> usize {
        let ttl_nanos = i64::try_from(ttl.as_nanos()).unwrap_or(i64::MAX);
        let cutoff_nanos = self.timeline.nanos(now).saturating_sub(ttl_nanos);
        self.workers
            .read()
            .iter()
            .map(|slot| {
                let dropped = slot.state.remote.expire(cutoff_nanos);
                if dropped > 0 {
                    self.refresh_hot(slot);
                }
                dropped
            })
            .sum()
    }
}

#[cfg(test)]
mod scan_tests {
    use super::*;

    /// The places `Scan::keep` keeps, offering `(value_secs, last_dispatch_nanos)`
    /// in order with a tolerance of 1 s.
    fn kept_places(offers: &[(f64, i64)]) -> Vec<usize> {
        let mut scan = Scan::new();
        let mut kept = Vec::new();
        for (index, (value_secs, last_dispatch_nanos)) in offers.iter().enumerate() {
            if *value_secs <= scan.bar_secs {
                scan.keep(&mut kept, index, *value_secs, *last_dispatch_nanos, 1.0);
            }
        }
        kept.iter().map(|within| within.index).collect()
    }

    #[test]
    fn a_candidate_behind_an_older_one_of_the_lowest_value_is_not_kept() {
        // 1: equal to the lowest and newer; 2: higher (within the bar) and
        // newer; both behind 0. 3: higher but older than 0: kept. 4: above
        // the bar: not kept. 5: equal and as old: kept (a draw).
        let offers = [
            (2.0, 10),
            (2.0, 11),
            (2.5, 20),
            (2.5, 5),
            (3.5, 1),
            (2.0, 10),
        ];
        assert_eq!(kept_places(&offers), [0, 3, 5]);
        // A lower value starts over: later candidates are judged against
        // the new lowest's age (30), not the old one's (10).
        let offers = [
            (2.0, 10),
            (1.0, 30),
            (1.5, 35),
            (1.5, 20),
            (1.0, 40),
            (1.0, 30),
        ];
        assert_eq!(kept_places(&offers), [0, 1, 3, 5]);
    }
}
