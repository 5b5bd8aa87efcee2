//! `cache_aware`: the approximate-prefix-tree policy of SGLang's model
//! gateway (smg), over the request's chained block hashes.
//!
//! The router remembers, per worker, which prompt prefixes it sent there (an
//! approximate tree: what was routed, not what the engine still holds).
//! For each request:
//!
//! 1. Unknown prefix: the worker with the fewest in-flight requests.
//! 2. Imbalanced fleet (`max − min > balance_abs_threshold` and
//!    `max > min × balance_rel_threshold`, over the candidates' in-flight
//!    requests from this router): the worker with the fewest in flight.
//! 3. Otherwise the worker with the longest recorded prefix match, if the
//!    matched share of the prompt is above `cache_threshold`;
//! 4. else the worker whose tree is smallest (most cache room).
//!
//! Ties go to the lowest slot. The request's blocks are then recorded in the
//! chosen worker's tree, whichever rule chose it. Every
//! `eviction_interval_secs` each tree larger than `max_tree_tokens` loses its
//! least recently routed leaves until it fits.
//!
//! smg matches text characters or token ids; this one matches block hashes,
//! since those are what [`RequestInfo::prefix`] carries. Because hash `i`
//! names the whole prompt up to block `i`, a worker's match is the number
//! of leading blocks its tree holds.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::BuildHasherDefault;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use load_protocols::WorkerLoad;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::baseline::{HasLedger, LedgerBook};
use crate::slots::{Slot, SlotsView, WorkerLedger, WorkerSlots};
use crate::{
    Dispatch, Policy, PolicyContext, PolicyError, PollMark, PrefillSample, RequestInfo, ScoreRow,
    ScoreTable, SeqHasher, WorkerId, WorkerInfo, WorkerStats, describe_request, parse_section,
};

/// The registry name.
pub const CACHE_AWARE: &str = "cache_aware";

/// The `[cache_aware]` section. Defaults are smg's `CacheAwareConfig`
/// defaults, its tree size read as tokens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CacheAwareParams {
    /// A longest match above this share of the prompt wins; at or below it,
    /// the smallest tree does. In `[0, 1]`.
    pub cache_threshold: f64,
    /// The fleet is imbalanced only if the most and least loaded workers'
    /// in-flight requests differ by more than this…
    pub balance_abs_threshold: u64,
    /// …and the most loaded has more than this many times the least's. ≥ 1.
    pub balance_rel_threshold: f64,
    /// How often the trees are cut back to `max_tree_tokens`; 0 cuts them
    /// back at every selection.
    pub eviction_interval_secs: u64,
    /// Prompt tokens each worker's tree keeps after an eviction. ≥ 1.
    pub max_tree_tokens: u64,
}

impl Default for CacheAwareParams {
    fn default() -> CacheAwareParams {
        CacheAwareParams {
            cache_threshold: 0.5,
            balance_abs_threshold: 32,
            balance_rel_threshold: 1.1,
            eviction_interval_secs: 30,
            max_tree_tokens: 10_000,
        }
    }
}

impl CacheAwareParams {
    pub fn validate(&self) -> Result<(), PolicyError> {
        let invalid = |key, value: String, allowed| PolicyError::InvalidParameter {
            policy: CACHE_AWARE.to_owned(),
            key,
            value,
            allowed,
        };
        if !(0.0..=1.0).contains(&self.cache_threshold) {
            return Err(invalid(
                "cache_threshold",
                self.cache_threshold.to_string(),
                "a number in [0, 1]",
            ));
        }
        if !(self.balance_rel_threshold.is_finite() && self.balance_rel_threshold >= 1.0) {
            return Err(invalid(
                "balance_rel_threshold",
                self.balance_rel_threshold.to_string(),
                "a finite number ≥ 1",
            ));
        }
        if self.max_tree_tokens == 0 {
            return Err(invalid("max_tree_tokens", "0".to_owned(), "an integer ≥ 1"));
        }
        Ok(())
    }

    /// smg's imbalance test over in-flight request counts.
    fn imbalanced(&self, min_in_flight: u64, max_in_flight: u64) -> bool {
        max_in_flight.saturating_sub(min_in_flight) > self.balance_abs_threshold
            && max_in_flight as f64 > min_in_flight as f64 * self.balance_rel_threshold
    }
}

/// The root's index in a [`BlockTree`]'s arena; it holds no blocks.
const ROOT: u32 = 0;

/// One run of recorded blocks that were always routed together: every
/// prompt that carried one of them carried the run up to it, and the last
/// prompt that carried any carried them all, so they share one stamp.
#[derive(Debug, Default)]
struct TreeRun {
    /// The run this one extends (`ROOT` for a prompt's first blocks).
    parent: u32,
    /// The blocks' hashes, in prompt order.
    blocks: Vec<u64>,
    /// Tokens per block, as the prompt that recorded the run counted them.
    block_tokens: u32,
    /// Runs that extend this one, by their first block's hash: none makes
    /// it a leaf.
    children: HashMap<u64, u32, BuildHasherDefault<SeqHasher>>,
    /// The routing stamp of the last request that carried it (LRU order).
    last_routed: u64,
}

/// The prefixes routed to one worker, as a radix tree of block-hash runs
/// in an arena. It is closed under prefixes (a block's parent is present
/// whenever it is), since insertion records a whole prompt and eviction
/// removes leaves only.
///
/// Kept as runs rather than one map entry per block so that recording a
/// prompt, matching it and re-stamping it cost a step per run on its path
/// (a handful) instead of a hash-map operation per block (hundreds for a
/// long prompt). A run is split where a prompt leaves it or ends inside it,
/// so its blocks always share their stamp and evict tail first, as
/// per-block leaves in stamp order would.
#[derive(Debug)]
pub(crate) struct BlockTree {
    runs: Vec<TreeRun>,
    /// Arena slots of removed runs, reused first.
    free_runs: Vec<u32>,
    blocks: usize,
    tokens: u64,
}

impl Default for BlockTree {
    fn default() -> BlockTree {
        BlockTree {
            runs: vec![TreeRun::default()],
            free_runs: Vec::new(),
            blocks: 0,
            tokens: 0,
        }
    }
}

/// Where a prompt's match ends: in run `run`, after its first `in_run`
/// blocks, `matched` blocks into the prompt.
#[derive(Debug, Clone, Copy)]
struct TreeMatch {
    run: u32,
    in_run: usize,
    matched: usize,
}

impl BlockTree {
    /// How many leading blocks of `hashes` the tree holds.
    pub(crate) fn matched_blocks(&self, hashes: &[u64]) -> usize {
        self.walk(hashes).matched
    }

    /// Follows `hashes` down from the root as far as the tree holds them.
    fn walk(&self, hashes: &[u64]) -> TreeMatch {
        let mut at = TreeMatch {
            run: ROOT,
            in_run: 0,
            matched: 0,
        };
        while let Some(&child) = hashes
            .get(at.matched)
            .and_then(|first| self.runs[at.run as usize].children.get(first))
        {
            let run = &self.runs[child as usize].blocks;
            let rest = &hashes[at.matched..];
            let len = run.len().min(rest.len());
            let common = if run[..len] == rest[..len] {
                len
            } else {
                run.iter().zip(rest).take_while(|(a, b)| a == b).count()
            };
            at = TreeMatch {
                run: child,
                in_run: common,
                matched: at.matched + common,
            };
            if common < run.len() {
                break;
            }
        }
        at
    }

    /// Takes a run's slot from the arena.
    fn alloc(&mut self, run: TreeRun) -> u32 {
        match self.free_runs.pop() {
            Some(id) => {
                self.runs[id as usize] = run;
                id
            }
            None => {
                self.runs.push(run);
                (self.runs.len() - 1) as u32
            }
        }
    }

    /// Splits run `id` after its first `keep` blocks (0 < `keep` < its
    /// length): the rest becomes its only child, with its stamp and
    /// children.
    fn split(&mut self, id: u32, keep: usize) {
        let run = &mut self.runs[id as usize];
        let tail_blocks = run.blocks.split_off(keep);
        let tail = TreeRun {
            parent: id,
            blocks: tail_blocks,
            block_tokens: run.block_tokens,
            children: std::mem::take(&mut run.children),
            last_routed: run.last_routed,
        };
        let first = tail.blocks[0];
        let tail_id = self.alloc(tail);
        let children: Vec<u32> = self.runs[tail_id as usize]
            .children
            .values()
            .copied()
            .collect();
        for child in children {
            self.runs[child as usize].parent = tail_id;
        }
        self.runs[id as usize].children.insert(first, tail_id);
    }

    /// Records a prompt's blocks, stamping each with `stamp`.
    pub(crate) fn insert(&mut self, hashes: &[u64], block_tokens: u32, stamp: u64) {
        let at = self.walk(hashes);
        if at.run != ROOT && at.in_run < self.runs[at.run as usize].blocks.len() {
            self.split(at.run, at.in_run);
        }
        // Every run on the path now ends within the prompt: restamp them.
        let mut id = at.run;
        while id != ROOT {
            let run = &mut self.runs[id as usize];
            run.last_routed = stamp;
            id = run.parent;
        }
        if at.matched < hashes.len() {
            let blocks = hashes[at.matched..].to_vec();
            let added = blocks.len();
            let leaf = self.alloc(TreeRun {
                parent: at.run,
                blocks,
                block_tokens,
                children: HashMap::default(),
                last_routed: stamp,
            });
            self.runs[at.run as usize]
                .children
                .insert(hashes[at.matched], leaf);
            self.blocks += added;
            self.tokens += added as u64 * u64::from(block_tokens);
        }
    }

    /// Removes least recently routed leaves until at most `max_tokens`
    /// remain (a parent whose last child goes becomes a leaf in turn);
    /// returns the tokens removed. A leaf run loses its blocks from the
    /// tail, one at a time.
    pub(crate) fn evict_to(&mut self, max_tokens: u64) -> u64 {
        if self.tokens <= max_tokens {
            return 0;
        }
        let before = self.tokens;
        // Oldest first; runs on one path may share a stamp only when one
        // extends the other, and then only the deeper is a leaf, so stamps
        // alone order the leaves (the id just makes the order total).
        let mut leaves: BinaryHeap<Reverse<(u64, u32)>> = self
            .runs
            .iter()
            .enumerate()
            .skip(1)
            .filter(|(_, run)| run.children.is_empty() && !run.blocks.is_empty())
            .map(|(id, run)| Reverse((run.last_routed, id as u32)))
            .collect();
        while self.tokens > max_tokens {
            let Some(Reverse((_, id))) = leaves.pop() else {
                break;
            };
            let run = &mut self.runs[id as usize];
            let block_tokens = u64::from(run.block_tokens);
            let Some(&key) = run.blocks.first() else {
                continue;
            };
            while self.tokens > max_tokens && !run.blocks.is_empty() {
                run.blocks.pop();
                self.blocks -= 1;
                self.tokens = self.tokens.saturating_sub(block_tokens);
            }
            if !run.blocks.is_empty() {
                break;
            }
            let parent = run.parent;
            *run = TreeRun::default();
            self.free_runs.push(id);
            let parent_run = &mut self.runs[parent as usize];
            parent_run.children.remove(&key);
            if parent != ROOT && parent_run.children.is_empty() {
                leaves.push(Reverse((parent_run.last_routed, parent)));
            }
        }
        before - self.tokens
    }

    pub(crate) fn tokens(&self) -> u64 {
        self.tokens
    }

    pub(crate) fn blocks(&self) -> usize {
        self.blocks
    }
}

/// One worker's state: this router's live work there and its tree.
#[derive(Debug, Default)]
struct CacheAwareWorker {
    ledger: WorkerLedger,
    tree: Mutex<BlockTree>,
}

impl HasLedger for CacheAwareWorker {
    fn ledger(&self) -> &WorkerLedger {
        &self.ledger
    }
}

/// Which rule chose the worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rule {
    UnknownPrefix,
    Imbalanced,
    LongestMatch,
    SmallestTree,
}

/// One candidate as a selection sees it.
#[derive(Debug)]
struct Candidate<'a> {
    slot: &'a Slot<CacheAwareWorker>,
    in_flight: u64,
    matched_blocks: usize,
    tree_tokens: u64,
}

/// A selection, before it is credited.
#[derive(Debug)]
struct Decision<'a> {
    candidates: Vec<Candidate<'a>>,
    /// Index into `candidates`.
    chosen: usize,
    rule: Rule,
    /// The prompt's size for the match ratio, tokens.
    prompt_tokens: u64,
}

impl Decision<'_> {
    fn chosen(&self) -> &Candidate<'_> {
        &self.candidates[self.chosen]
    }

    fn match_ratio(&self, request: &RequestInfo, candidate: &Candidate<'_>) -> f64 {
        if self.prompt_tokens == 0 {
            return 0.0;
        }
        request.prefix.tokens_in(candidate.matched_blocks) as f64 / self.prompt_tokens as f64
    }
}

/// The index of the candidate with the least `key`, ties to the lowest slot.
fn argmin_by_slot<T, K: Ord>(
    items: &[T],
    slot: impl Fn(&T) -> usize,
    key: impl Fn(&T) -> K,
) -> Option<usize> {
    (0..items.len()).min_by_key(|&index| (key(&items[index]), slot(&items[index])))
}

/// See the module documentation.
#[derive(Debug)]
pub struct CacheAwarePolicy {
    params: CacheAwareParams,
    workers: WorkerSlots<CacheAwareWorker>,
    book: LedgerBook,
    /// Orders insertions for LRU eviction (no clock needed: only the order
    /// matters).
    next_stamp: AtomicU64,
    /// When the trees were last cut back; `None` until the first selection.
    last_eviction: Mutex<Option<Instant>>,
}

impl CacheAwarePolicy {
    pub fn new(params: CacheAwareParams) -> Result<CacheAwarePolicy, PolicyError> {
        params.validate()?;
        Ok(CacheAwarePolicy {
            params,
            workers: WorkerSlots::new(),
            book: LedgerBook::default(),
            next_stamp: AtomicU64::new(0),
            last_eviction: Mutex::new(None),
        })
    }

    /// Builds the policy from its config section (`null`: defaults). The
    /// policy is deterministic, so the context's seed is not used.
    pub fn from_section(
        section: &serde_json::Value,
        _context: &PolicyContext,
    ) -> Result<CacheAwarePolicy, PolicyError> {
        CacheAwarePolicy::new(parse_section(CACHE_AWARE, section)?)
    }

    pub fn parameters(&self) -> &CacheAwareParams {
        &self.params
    }

    /// Blocks and tokens recorded in one worker's tree, `None` if the worker
    /// is not registered.
    pub fn tree_size(&self, id: WorkerId) -> Option<(usize, u64)> {
        let view = self.workers.read();
        let tree = view.get(id)?.state.tree.lock();
        Some((tree.blocks(), tree.tokens()))
    }

    fn decide<'a>(
        &self,
        view: &'a SlotsView<'_, CacheAwareWorker>,
        candidates: &[WorkerId],
        request: &RequestInfo,
    ) -> Option<Decision<'a>> {
        let hashes = request.prefix.hashes();
        let rows: Vec<Candidate<'a>> = candidates
            .iter()
            .filter_map(|id| view.get(*id))
            .map(|slot| {
                let tree = slot.state.tree.lock();
                Candidate {
                    slot,
                    in_flight: slot.state.ledger.stats().in_flight_requests,
                    matched_blocks: tree.matched_blocks(hashes),
                    tree_tokens: tree.tokens(),
                }
            })
            .collect();
        let slot_of = |row: &Candidate<'_>| row.slot.id.slot();
        let least_loaded = argmin_by_slot(&rows, slot_of, |row| row.in_flight)?;
        let prompt_tokens = request
            .tokens
            .or(0)
            .max(request.prefix.tokens_in(hashes.len()));
        let mut decision = Decision {
            candidates: rows,
            chosen: least_loaded,
            rule: Rule::UnknownPrefix,
            prompt_tokens,
        };
        if hashes.is_empty() {
            return Some(decision);
        }
        let loads = decision.candidates.iter().map(|row| row.in_flight);
        let min_in_flight = loads.clone().min().unwrap_or(0);
        let max_in_flight = loads.max().unwrap_or(0);
        if self.params.imbalanced(min_in_flight, max_in_flight) {
            decision.rule = Rule::Imbalanced;
            return Some(decision);
        }
        let rows = &decision.candidates;
        let best_match = argmin_by_slot(rows, slot_of, |row| Reverse(row.matched_blocks))?;
        if decision.match_ratio(request, &rows[best_match]) > self.params.cache_threshold {
            decision.chosen = best_match;
            decision.rule = Rule::LongestMatch;
        } else {
            decision.chosen = argmin_by_slot(rows, slot_of, |row| row.tree_tokens)?;
            decision.rule = Rule::SmallestTree;
        }
        Some(decision)
    }

    /// Cuts every tree back to `max_tree_tokens` once per
    /// `eviction_interval_secs`, timed from the first selection.
    fn evict_if_due(&self, now: Instant) {
        {
            let mut last = self.last_eviction.lock();
            let interval = Duration::from_secs(self.params.eviction_interval_secs);
            match *last {
                Some(at) if now.saturating_duration_since(at) < interval => return,
                _ => *last = Some(now),
            }
        }
        for slot in self.workers.read().iter() {
            slot.state.tree.lock().evict_to(self.params.max_tree_tokens);
        }
    }
}

impl Policy for CacheAwarePolicy {
    fn name(&self) -> &'static str {
        CACHE_AWARE
    }

    fn params(&self) -> serde_json::Value {
        serde_json::json!({
            "cache_threshold": self.params.cache_threshold,
            "balance_abs_threshold": self.params.balance_abs_threshold,
            "balance_rel_threshold": self.params.balance_rel_threshold,
            "eviction_interval_secs": self.params.eviction_interval_secs,
            "max_tree_tokens": self.params.max_tree_tokens,
        })
    }

    fn add_worker(&self, id: WorkerId, info: WorkerInfo) {
        self.workers.insert(id, info, CacheAwareWorker::default());
    }

    fn remove_worker(&self, id: WorkerId) {
        self.workers.remove(id);
    }

    fn select(
        &self,
        candidates: &[WorkerId],
        request: &RequestInfo,
        now: Instant,
    ) -> Option<Dispatch> {
        let dispatch = {
            let view = self.workers.read();
            let decision = self.decide(&view, candidates, request)?;
            let chosen = decision.chosen();
            let dispatch = self
                .book
                .dispatch(chosen.slot, request, chosen.in_flight as f64);
            if !request.prefix.is_empty() {
                let stamp = self.next_stamp.fetch_add(1, Ordering::Relaxed);
                chosen.slot.state.tree.lock().insert(
                    request.prefix.hashes(),
                    request.prefix.block_tokens(),
                    stamp,
                );
            }
            dispatch
        };
        self.evict_if_due(now);
        Some(dispatch)
    }

    fn first_token(&self, dispatch: &Dispatch, _now: Instant) -> Option<PrefillSample> {
        LedgerBook::first_token(&self.workers, dispatch);
        None
    }

    fn finish(&self, dispatch: &Dispatch, _now: Instant) {
        LedgerBook::finish(&self.workers, dispatch);
    }

    fn poll_started(&self, id: WorkerId, now: Instant) -> PollMark {
        self.book.poll_mark(&self.workers, id, now)
    }

    fn poll_completed(&self, _mark: PollMark, _load: Option<&WorkerLoad>, _now: Instant) {}

    fn poll_failed(&self, _mark: PollMark, _now: Instant) {}

    fn explain(&self, candidates: &[WorkerId], request: &RequestInfo, _now: Instant) -> ScoreTable {
        let mut table = ScoreTable::new(
            CACHE_AWARE,
            describe_request(request),
            &["in_flight", "match_blocks", "match_ratio", "tree_tokens"],
        );
        let view = self.workers.read();
        let Some(decision) = self.decide(&view, candidates, request) else {
            return table;
        };
        let chosen_note = match decision.rule {
            Rule::UnknownPrefix => "unknown prefix: fewest in flight".to_owned(),
            Rule::Imbalanced => "imbalanced: fewest in flight".to_owned(),
            Rule::LongestMatch => format!(
                "longest match, ratio > {}",
                crate::format_value(self.params.cache_threshold)
            ),
            Rule::SmallestTree => format!(
                "no match above {}: smallest tree",
                crate::format_value(self.params.cache_threshold)
            ),
        };
        for (index, candidate) in decision.candidates.iter().enumerate() {
            table.rows.push(ScoreRow {
                worker: candidate.slot.id,
                url: candidate.slot.info.url.clone(),
                values: vec![
                    candidate.in_flight as f64,
                    candidate.matched_blocks as f64,
                    decision.match_ratio(request, candidate),
                    candidate.tree_tokens as f64,
                ],
                note: if index == decision.chosen {
                    chosen_note.clone()
                } else {
                    String::new()
                },
            });
        }
        table.chosen = vec![decision.chosen().slot.id];
        table
    }

    fn worker_stats(&self, id: WorkerId) -> Option<WorkerStats> {
        self.workers
            .read()
            .get(id)
            .map(|slot| slot.state.ledger.stats())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TokenCount;

    use crate::test_support::{prompt, with_workers};

    fn fleet(params: CacheAwareParams, workers: u32) -> (CacheAwarePolicy, Vec<WorkerId>) {
        with_workers(CacheAwarePolicy::new(params).unwrap(), workers, "")
    }

    #[test]
    fn the_tree_matches_leading_blocks_and_evicts_least_recent_leaves_first() {
        let mut tree = BlockTree::default();
        tree.insert(&[1, 2, 3, 4], 16, 0);
        tree.insert(&[1, 2, 7], 16, 1);
        assert_eq!(tree.matched_blocks(&[1, 2, 3, 9]), 3);
        assert_eq!(tree.matched_blocks(&[1, 2, 7, 8]), 3);
        assert_eq!(tree.matched_blocks(&[5, 6, 7]), 0);
        assert_eq!((tree.blocks(), tree.tokens()), (5, 80));

        // The older branch (3, 4) goes first, leaf before parent; the shared
        // blocks stay while the newer branch needs them.
        assert_eq!(tree.evict_to(48), 32);
        assert_eq!(tree.matched_blocks(&[1, 2, 3, 4]), 2);
        assert_eq!(tree.matched_blocks(&[1, 2, 7]), 3);
        // Re-routing the old branch makes the other one the older.
        tree.insert(&[1, 2, 3], 16, 2);
        assert_eq!(tree.evict_to(48), 16);
        assert_eq!(tree.matched_blocks(&[1, 2, 7]), 2);
        assert_eq!(tree.matched_blocks(&[1, 2, 3]), 3);
        assert_eq!(tree.evict_to(0), 48);
        assert_eq!((tree.blocks(), tree.tokens()), (0, 0));
    }

    /// The tree as one map entry per block (the plain model the runs
    /// compress): the same matches, sizes and evictions.
    #[test]
    fn the_run_tree_matches_a_per_block_tree() {
        #[derive(Default)]
        struct PerBlock {
            // hash -> (parent, children, stamp)
            nodes: HashMap<u64, (Option<u64>, u32, u64)>,
        }
        impl PerBlock {
            fn matched(&self, hashes: &[u64]) -> usize {
                hashes
                    .iter()
                    .take_while(|hash| self.nodes.contains_key(hash))
                    .count()
            }
            fn insert(&mut self, hashes: &[u64], stamp: u64) {
                let mut parent = None;
                for &hash in hashes {
                    if let Some(node) = self.nodes.get_mut(&hash) {
                        node.2 = stamp;
                    } else {
                        self.nodes.insert(hash, (parent, 0, stamp));
                        if let Some(node) = parent.and_then(|p| self.nodes.get_mut(&p)) {
                            node.1 += 1;
                        }
                    }
                    parent = Some(hash);
                }
            }
            fn evict_to(&mut self, max_blocks: usize) {
                let mut leaves: BinaryHeap<Reverse<(u64, u64)>> = self
                    .nodes
                    .iter()
                    .filter(|(_, node)| node.1 == 0)
                    .map(|(hash, node)| Reverse((node.2, *hash)))
                    .collect();
                while self.nodes.len() > max_blocks {
                    let Some(Reverse((_, hash))) = leaves.pop() else {
                        break;
                    };
                    let (parent, _, _) = self.nodes.remove(&hash).unwrap();
                    if let Some(p) = parent {
                        let node = self.nodes.get_mut(&p).unwrap();
                        node.1 -= 1;
                        if node.1 == 0 {
                            leaves.push(Reverse((node.2, p)));
                        }
                    }
                }
            }
        }
        // Prompts that share and fork prefixes, chained like real ones.
        let mut seed = 7u64;
        let mut next = move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            seed >> 33
        };
        let mut tree = BlockTree::default();
        let mut reference = PerBlock::default();
        let mut prompts: Vec<Vec<u64>> = Vec::new();
        for stamp in 0..600u64 {
            let prompt: Vec<u64> = match prompts.len() {
                0 => (0..1 + next() % 30).map(|i| 1000 + i).collect(),
                known => {
                    let base = &prompts[(next() as usize) % known];
                    let keep = (next() as usize) % (base.len() + 1);
                    let mut prompt = base[..keep].to_vec();
                    let fork = next();
                    let mut previous = prompt.last().copied().unwrap_or(fork);
                    for _ in 0..next() % 12 {
                        previous = previous.wrapping_mul(31).wrapping_add(fork) | 1;
                        prompt.push(previous);
                    }
                    prompt
                }
            };
            if prompt.is_empty() {
                continue;
            }
            tree.insert(&prompt, 16, stamp);
            reference.insert(&prompt, stamp);
            prompts.push(prompt);
            if next() % 5 == 0 {
                let max_blocks = (next() % 200) as usize;
                tree.evict_to(16 * max_blocks as u64);
                reference.evict_to(max_blocks);
            }
            assert_eq!(tree.blocks(), reference.nodes.len(), "stamp {stamp}");
            assert_eq!(tree.tokens(), 16 * reference.nodes.len() as u64);
            for probe in prompts.iter().rev().take(40) {
                assert_eq!(tree.matched_blocks(probe), reference.matched(probe));
            }
        }
    }

    #[test]
    fn longest_match_wins_when_balanced() {
        let (policy, ids) = fleet(CacheAwareParams::default(), 3);
        let now = Instant::now();
        // Three conversations land on three empty trees in slot order.
        for root in 1..=3 {
            let dispatch = policy.select(&ids, &prompt(root, 10), now).unwrap();
            assert_eq!(dispatch.worker, ids[root as usize - 1]);
        }
        // Each one's next turn (its prompt plus 2 blocks) returns home.
        for root in [2, 3, 1] {
            let dispatch = policy.select(&ids, &prompt(root, 12), now).unwrap();
            assert_eq!(
                dispatch.worker,
                ids[root as usize - 1],
                "conversation {root}"
            );
        }
        let table = policy.explain(&ids, &prompt(3, 20), now);
        assert_eq!(table.chosen, vec![ids[2]]);
        assert_eq!(table.value(ids[2], "match_blocks"), Some(12.0));
        assert_eq!(table.value(ids[2], "match_ratio"), Some(0.6));
        assert_eq!(table.value(ids[0], "match_blocks"), Some(0.0));
    }

    #[test]
    fn a_match_at_or_below_the_threshold_goes_to_the_smallest_tree() {
        let (policy, ids) = fleet(CacheAwareParams::default(), 3);
        let now = Instant::now();
        policy.select(&ids, &prompt(1, 10), now).unwrap();
        policy.select(&ids, &prompt(2, 30), now).unwrap();
        assert_eq!(policy.tree_size(ids[0]), Some((10, 160)));
        assert_eq!(policy.tree_size(ids[1]), Some((30, 480)));
        // Worker 0 holds 10 of 20 blocks: exactly 0.5, not above it.
        let half = policy.select(&ids, &prompt(1, 20), now).unwrap();
        assert_eq!(half.worker, ids[2], "worker 2's tree is empty");
        // A new prompt goes to the smallest tree: worker 0 (160 tokens).
        let fresh = policy.select(&ids, &prompt(9, 4), now).unwrap();
        assert_eq!(fresh.worker, ids[0]);
        let table = policy.explain(&ids, &prompt(8, 4), now);
        assert_eq!(table.chosen, vec![ids[0]]);
        assert_eq!(table.value(ids[0], "tree_tokens"), Some(224.0));
        insta::assert_snapshot!(table.to_string(), @r"
        policy: cache_aware  request: 64 tokens (exact)
           worker  url        in_flight  match_blocks  match_ratio  tree_tokens  note
        *  0.0     http://w0  2          0             0            224          no match above 0.5: smallest tree
           1.0     http://w1  1          0             0            480
           2.0     http://w2  1          0             0            320
        ");
    }

    #[test]
    fn an_imbalanced_fleet_goes_to_the_least_loaded_despite_a_match() {
        let params = CacheAwareParams {
            balance_abs_threshold: 2,
            balance_rel_threshold: 1.5,
            ..CacheAwareParams::default()
        };
        let (policy, ids) = fleet(params, 2);
        let now = Instant::now();
        let home = policy.select(&ids, &prompt(1, 8), now).unwrap();
        assert_eq!(home.worker, ids[0]);
        // Turns of the same conversation follow it while the gap is ≤ 2.
        let turns: Vec<Dispatch> = (0..2)
            .map(|_| policy.select(&ids, &prompt(1, 8), now).unwrap())
            .collect();
        assert!(turns.iter().all(|turn| turn.worker == ids[0]));
        // 3 in flight against 0: more than 2 apart and more than 1.5 times.
        let table = policy.explain(&ids, &prompt(1, 8), now);
        assert_eq!(table.chosen, vec![ids[1]]);
        assert_eq!(
            table.row(ids[1]).map(|row| row.note.as_str()),
            Some("imbalanced: fewest in flight")
        );
        let spill = policy.select(&ids, &prompt(1, 8), now).unwrap();
        assert_eq!(spill.worker, ids[1]);
        // The spilled request was recorded where it went, as smg does.
        assert_eq!(policy.tree_size(ids[1]), Some((8, 128)));
        // Finishing the home dispatches rebalances: affinity again.
        policy.finish(&home, now);
        for turn in &turns {
            policy.finish(turn, now);
        }
        assert_eq!(policy.worker_stats(ids[0]).unwrap().in_flight_requests, 0);
        let back = policy.select(&ids, &prompt(1, 9), now).unwrap();
        assert_eq!(back.worker, ids[0], "tie on match length: lowest slot");
    }

    #[test]
    fn an_unknown_prefix_goes_to_the_least_loaded_and_is_not_recorded() {
        let (policy, ids) = fleet(CacheAwareParams::default(), 3);
        let now = Instant::now();
        let unknown = RequestInfo::new(TokenCount::Exact(500));
        let picks: Vec<WorkerId> = (0..4)
            .map(|_| policy.select(&ids, &unknown, now).unwrap().worker)
            .collect();
        assert_eq!(picks, vec![ids[0], ids[1], ids[2], ids[0]]);
        assert!(ids.iter().all(|id| policy.tree_size(*id) == Some((0, 0))));
        let table = policy.explain(&ids, &unknown, now);
        assert_eq!(table.chosen, vec![ids[1]]);
    }

    #[test]
    fn eviction_bounds_every_tree_once_per_interval() {
        let params = CacheAwareParams {
            eviction_interval_secs: 30,
            max_tree_tokens: 1_600,
            ..CacheAwareParams::default()
        };
        let (policy, ids) = fleet(params, 1);
        let start = Instant::now();
        for root in 0..50 {
            let at = start + Duration::from_secs(root / 2);
            policy.select(&ids, &prompt(root, 20), at).unwrap();
        }
        // 50 prompts of 20 blocks in 25 s: no eviction yet.
        assert_eq!(policy.tree_size(ids[0]), Some((1_000, 16_000)));
        policy
            .select(&ids, &prompt(99, 20), start + Duration::from_secs(30))
            .unwrap();
        assert_eq!(policy.tree_size(ids[0]), Some((100, 1_600)));
        // The newest prompts survive, the oldest are gone.
        let table = policy.explain(&ids, &prompt(99, 20), start);
        assert_eq!(table.value(ids[0], "match_blocks"), Some(20.0));
        let table = policy.explain(&ids, &prompt(0, 20), start);
        assert_eq!(table.value(ids[0], "match_blocks"), Some(0.0));
        // The next cut waits another interval.
        for root in 100..110 {
            policy
                .select(&ids, &prompt(root, 20), start + Duration::from_secs(59))
                .unwrap();
        }
        assert_eq!(policy.tree_size(ids[0]), Some((300, 4_800)));
        policy
            .select(&ids, &prompt(200, 20), start + Duration::from_secs(60))
            .unwrap();
        assert_eq!(policy.tree_size(ids[0]), Some((100, 1_600)));
    }

    #[test]
    fn a_zero_interval_bounds_the_trees_after_every_selection() {
        let params = CacheAwareParams {
            eviction_interval_secs: 0,
            max_tree_tokens: 320,
            ..CacheAwareParams::default()
        };
        let (policy, ids) = fleet(params, 2);
        let now = Instant::now();
        for root in 0..40 {
            policy.select(&ids, &prompt(root, 15), now).unwrap();
            for id in &ids {
                let (_, tokens) = policy.tree_size(*id).unwrap();
                assert!(tokens <= 320, "{tokens} tokens after prompt {root}");
            }
        }
    }

    #[test]
    fn finish_releases_the_in_flight_count() {
        let (policy, ids) = fleet(CacheAwareParams::default(), 2);
        let now = Instant::now();
        let dispatch = policy.select(&ids, &prompt(1, 4), now).unwrap();
        assert_eq!(
            policy.worker_stats(dispatch.worker),
            Some(WorkerStats {
                in_flight_requests: 1,
                pending_requests: 1,
                pending_tokens: 64
            })
        );
        policy.first_token(&dispatch, now);
        policy.finish(&dispatch, now);
        policy.finish(&dispatch, now);
        assert_eq!(
            policy.worker_stats(dispatch.worker),
            Some(WorkerStats::default())
        );
        assert_eq!(policy.select(&[], &prompt(1, 4), now), None);
        assert_eq!(
            policy.select(&[WorkerId::new(7, 0)], &prompt(1, 4), now),
            None
        );
        policy.remove_worker(ids[0]);
        assert_eq!(policy.worker_stats(ids[0]), None);
        let moved = policy.select(&ids, &prompt(1, 4), now).unwrap();
        assert_eq!(
            moved.worker, ids[1],
            "the removed worker's tree went with it"
        );
    }

    #[test]
    fn bad_parameters_are_typed_errors() {
        let context = PolicyContext::default();
        for (section, key) in [
            (
                serde_json::json!({"cache_threshold": 1.5}),
                "cache_threshold",
            ),
            (
                serde_json::json!({"cache_threshold": -0.1}),
                "cache_threshold",
            ),
            (
                serde_json::json!({"balance_rel_threshold": 0.9}),
                "balance_rel_threshold",
            ),
            (serde_json::json!({"max_tree_tokens": 0}), "max_tree_tokens"),
        ] {
            let err = CacheAwarePolicy::from_section(&section, &context).unwrap_err();
            assert!(
                matches!(&err, PolicyError::InvalidParameter { key: got, .. } if *got == key),
                "{section}: {err}"
            );
        }
        let err = CacheAwarePolicy::from_section(&serde_json::json!({"threshold": 0.5}), &context)
            .unwrap_err();
        assert!(matches!(err, PolicyError::InvalidSection { .. }));
        let policy =
            CacheAwarePolicy::from_section(&serde_json::json!({"cache_threshold": 0.8}), &context)
                .unwrap();
        assert_eq!(policy.parameters().cache_threshold, 0.8);
        assert_eq!(policy.parameters().balance_abs_threshold, 32);
        assert_eq!(
            policy.params(),
            serde_json::json!({
                "cache_threshold": 0.8,
                "balance_abs_threshold": 32,
                "balance_rel_threshold": 1.1,
                "eviction_interval_secs": 30,
                "max_tree_tokens": 10_000,
            })
        );
    }
}
