//! The engine's prefix cache: a radix tree of chained block hashes, as
//! SGLang's radix cache keeps token runs.
//!
//! A prompt's blocks are a chain (block `i`'s hash depends on every block
//! before it), so prompts that share a prefix share a path from the root.
//! Each node holds a run of blocks that always go together: a request pins
//! the whole path to the deepest node it uses, and the tree splits a node
//! where a request's match or insertion ends inside it. Work per request is
//! therefore per node on its path (a handful), not per block (a 6k-token
//! prompt is ~400 blocks of 16 tokens): a block-per-entry map spent most of
//! the simulator's time on prefix-heavy scenarios.
//!
//! Eviction is LRU at block granularity from the leaves: the unreferenced
//! leaf released longest ago loses its last block first. A node is
//! released after everything below it on the releasing request's path, so
//! a block is never less recently used than the blocks that extend it.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;

use crate::model::PassThrough;

/// The root's id; it holds no blocks and is never evicted.
pub(crate) const ROOT: u32 = 0;

#[derive(Debug)]
struct Node {
    parent: u32,
    /// Blocks above this node on its path: its first block is block
    /// `start` of every chain through it.
    start: usize,
    /// The first block's hash: the parent's key for this node.
    key: u64,
    /// The chain of the request that inserted the run: the run's chained
    /// block hashes are its `len` keys from `start` on (shared, not copied).
    keys: Arc<[u64]>,
    /// Blocks in the run.
    len: usize,
    /// Children by their first block's hash.
    children: HashMap<u64, u32, PassThrough>,
    /// Requests holding this node (every node on their path).
    refs: u32,
    /// LRU stamp of the last release.
    tick: u64,
    /// The cache's change counter when this node last changed in a way
    /// that can move a match ending in it elsewhere: a split, (re)allocation
    /// or removal. Blocks evicted from its tail are not counted: a match
    /// they cut shows it by ending past the node's blocks.
    changed: u64,
    /// The change counter when a child was last inserted under it: that
    /// lengthens only a match that reaches its end and goes on with the
    /// child's first block.
    grown: u64,
}

impl Node {
    /// The run of `keys[start..start + len]`.
    fn new(parent: u32, start: usize, keys: Arc<[u64]>, len: usize, refs: u32) -> Node {
        Node {
            parent,
            start,
            key: if len > 0 { keys[start] } else { 0 },
            keys,
            len,
            children: HashMap::default(),
            refs,
            tick: 0,
            changed: 0,
            grown: 0,
        }
    }

    /// The run's chained block hashes.
    fn blocks(&self) -> &[u64] {
        &self.keys[self.start..self.start + self.len]
    }
}

/// Where a chain's match ends: in `node`, after `matched` blocks in all,
/// of which `in_node` are the node's (all of them, or a leading part).
#[derive(Debug, Clone, Copy)]
struct Match {
    node: u32,
    matched: usize,
    in_node: usize,
}

/// Where a match ended and when it was taken: see
/// [`PrefixCache::leading_hits_stamped`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MatchStamp {
    node: u32,
    /// Of the match, the blocks in `node`.
    in_node: u32,
    /// The chain's block after the match, if any.
    next: Option<u64>,
    changes: u64,
}

impl MatchStamp {
    /// The node the match ended in.
    pub(crate) fn node(&self) -> u32 {
        self.node
    }

    /// The chain's block after the match, if any.
    pub(crate) fn next(&self) -> Option<u64> {
        self.next
    }
}

/// A change to a node that can change a stamped match ending in it (see
/// [`PrefixCache::take_touched`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Touch {
    /// Blocks evicted from its tail, split, allocated or removed: any match
    /// ending in it may change.
    Node(u32),
    /// A child inserted under it, keyed by its first block: only a match
    /// that goes on with that block may change.
    Grown(u32, u64),
}

impl Default for MatchStamp {
    /// A stamp that always reads as changed.
    fn default() -> MatchStamp {
        MatchStamp {
            node: u32::MAX,
            in_node: 0,
            next: None,
            changes: 0,
        }
    }
}

#[derive(Debug)]
pub(crate) struct PrefixCache {
    nodes: Vec<Node>,
    free_nodes: Vec<u32>,
    /// Unreferenced leaves by release tick, oldest first; entries go stale
    /// when the node is pinned, grows children or is freed (checked on pop).
    lru: BinaryHeap<Reverse<(u64, u32)>>,
    /// Blocks in unreferenced nodes: what eviction could free.
    evictable_blocks: u64,
    tick: u64,
    /// Bumped on every change a node's `changed` or `grown` records.
    changes: u64,
    /// The nodes changed since the last [`take_touched`](PrefixCache::take_touched).
    touched: Vec<Touch>,
    /// The keys of a node with none (shared).
    no_keys: Arc<[u64]>,
}

impl Default for PrefixCache {
    fn default() -> PrefixCache {
        PrefixCache {
            nodes: vec![Node::new(ROOT, 0, Arc::from(Vec::new()), 0, 0)],
            no_keys: Arc::from(Vec::new()),
            free_nodes: Vec::new(),
            lru: BinaryHeap::new(),
            evictable_blocks: 0,
            tick: 0,
            changes: 0,
            touched: Vec::new(),
        }
    }
}

impl PrefixCache {
    pub(crate) fn evictable_blocks(&self) -> u64 {
        self.evictable_blocks
    }

    /// How many leading blocks of `chain` are cached.
    pub(crate) fn leading_hits(&self, chain: &[u64]) -> usize {
        self.walk(chain).matched
    }

    /// [`leading_hits`](PrefixCache::leading_hits), and a [`MatchStamp`]
    /// that tells later whether the count can have changed.
    ///
    /// A match that ends in node `n` (inside it, at its end with no child
    /// for the next block, or at the chain's end) changes only when `n`
    /// itself does: a block evicted from it (only leaves lose blocks, so
    /// nothing above `n` can lose one while `n` exists), a child inserted
    /// under it, a split of it, or its removal. The last three mark `n`;
    /// an eviction shortens the match to the blocks `n` keeps.
    pub(crate) fn leading_hits_stamped(&self, chain: &[u64]) -> (usize, MatchStamp) {
        let at = self.walk(chain);
        (at.matched, self.stamp(chain, at))
    }

    fn stamp(&self, chain: &[u64], at: Match) -> MatchStamp {
        MatchStamp {
            node: at.node,
            in_node: at.in_node as u32,
            next: chain.get(at.matched).copied(),
            changes: self.changes,
        }
    }

    /// The count of a match stamped with `stamp`, now, if it cannot have
    /// changed (see
    /// [`leading_hits_stamped`](PrefixCache::leading_hits_stamped)): its
    /// node has not been split, removed or cut below the match since, nor
    /// grown the child the chain goes on into. `None`: walk again (which
    /// also renews the stamp's next block after a cut).
    pub(crate) fn hits_since(&self, stamp: MatchStamp) -> Option<usize> {
        let node = self.nodes.get(stamp.node as usize)?;
        let in_node = stamp.in_node as usize;
        if node.changed > stamp.changes || node.len < in_node {
            return None;
        }
        if node.grown > stamp.changes
            && node.len == in_node
            && stamp
                .next
                .is_some_and(|next| node.children.contains_key(&next))
        {
            return None;
        }
        Some(node.start + in_node)
    }

    /// [`leading_hits_stamped`](PrefixCache::leading_hits_stamped) for a
    /// chain last matched with `stamp`: the walk starts at the node the
    /// match ended in when the chain still runs through that node's first
    /// block (chained hashes: then it runs through every block above it),
    /// and at the root otherwise. The same count either way.
    pub(crate) fn leading_hits_from(
        &self,
        chain: &[u64],
        stamp: MatchStamp,
    ) -> (usize, MatchStamp) {
        let anchored = self.nodes.get(stamp.node as usize).filter(|node| {
            stamp.node != ROOT && node.len > 0 && chain.get(node.start) == Some(&node.key)
        });
        let at = match anchored {
            Some(_) => self.descend(chain, stamp.node),
            None => self.walk(chain),
        };
        (at.matched, self.stamp(chain, at))
    }

    /// Records a change of `id` (see [`MatchStamp`]).
    fn mark_changed(&mut self, id: u32) {
        self.changes += 1;
        self.nodes[id as usize].changed = self.changes;
        self.touch(Touch::Node(id));
    }

    fn touch(&mut self, touch: Touch) {
        // Evictions take a leaf's blocks one by one: one entry for a run.
        if self.touched.last() != Some(&touch) {
            self.touched.push(touch);
        }
    }

    /// The changes since the last call, in order, into `into` (cleared
    /// first): a stamped match can have changed only if its node is
    /// among them ([`Touch::Node`], or [`Touch::Grown`] with the match's
    /// next block). Its caller takes them after every batch of changes, so
    /// the list stays short.
    pub(crate) fn take_touched(&mut self, into: &mut Vec<Touch>) {
        into.clear();
        std::mem::swap(into, &mut self.touched);
    }

    fn walk(&self, chain: &[u64]) -> Match {
        let root = Match {
            node: ROOT,
            matched: 0,
            in_node: 0,
        };
        match chain.first() {
            Some(first) => match self.nodes[ROOT as usize].children.get(first) {
                Some(&child) => self.descend(chain, child),
                None => root,
            },
            None => root,
        }
    }

    /// The match of `chain` from node `child` down, given that `chain`
    /// runs through `child`'s first block.
    fn descend(&self, chain: &[u64], mut child: u32) -> Match {
        loop {
            let node = &self.nodes[child as usize];
            let run = node.blocks();
            let matched = node.start;
            let rest = &chain[matched..];
            let len = run.len().min(rest.len());
            // Chained hashes: equal at `i` means equal up to `i`, so the
            // common part is found by binary search, and a whole run by
            // its last block.
            let common = if rest[len - 1] == run[len - 1] {
                len
            } else {
                let (mut low, mut high) = (1, len - 1);
                while low < high {
                    let middle = low + (high - low) / 2;
                    if rest[middle] == run[middle] {
                        low = middle + 1;
                    } else {
                        high = middle;
                    }
                }
                low
            };
            let at = Match {
                node: child,
                matched: matched + common,
                in_node: common,
            };
            if common < run.len() {
                return at;
            }
            let Some(next) = chain
                .get(at.matched)
                .and_then(|first| node.children.get(first))
            else {
                return at;
            };
            child = *next;
        }
    }

    /// Makes the match end at a node boundary, splitting its node; returns
    /// the node that ends there.
    fn split_at(&mut self, at: Match) -> u32 {
        let id = at.node;
        if at.in_node == self.nodes[id as usize].len {
            return id;
        }
        // The upper part becomes a new node, so a request holding `id` as
        // its deepest node still ends where it did.
        let node = &mut self.nodes[id as usize];
        let parent = node.parent;
        let (refs, tick) = (node.refs, node.tick);
        let upper_start = node.start;
        let keys = node.keys.clone();
        node.start += at.in_node;
        node.len -= at.in_node;
        node.key = node.keys[node.start];
        let lower_key = node.key;
        let mut upper = Node::new(parent, upper_start, keys, at.in_node, refs);
        upper.tick = tick;
        upper.children.insert(lower_key, id);
        let upper_id = self.alloc(upper);
        self.nodes[id as usize].parent = upper_id;
        self.mark_changed(id);
        let upper_key = self.nodes[upper_id as usize].key;
        self.nodes[parent as usize]
            .children
            .insert(upper_key, upper_id);
        upper_id
    }

    fn alloc(&mut self, node: Node) -> u32 {
        let id = match self.free_nodes.pop() {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        // A reused id must not pass for the node a stamp was taken in.
        self.mark_changed(id);
        id
    }

    /// Pins the first `blocks` blocks of `chain`, which must be cached
    /// (at most [`leading_hits`](PrefixCache::leading_hits)); returns the
    /// deepest node, to [`unpin`](PrefixCache::unpin) or
    /// [`insert`](PrefixCache::insert) with.
    pub(crate) fn pin(&mut self, chain: &[u64], blocks: usize) -> u32 {
        let at = self.walk(&chain[..blocks.min(chain.len())]);
        let deepest = self.split_at(at);
        self.pin_path(deepest, ROOT);
        deepest
    }

    /// Adds a reference to every node from `from` up to, not including, `to`.
    fn pin_path(&mut self, from: u32, to: u32) {
        let mut id = from;
        while id != to && id != ROOT {
            let node = &mut self.nodes[id as usize];
            if node.refs == 0 {
                // Its LRU entry goes stale: `evict_one` skips it.
                self.evictable_blocks -= node.len as u64;
            }
            node.refs += 1;
            id = node.parent;
        }
    }

    /// Drops a reference on every node from `deepest` to the root, deepest
    /// first, so ancestors are released later (more recently) than the
    /// blocks that extend them.
    pub(crate) fn unpin(&mut self, deepest: u32) {
        let mut id = deepest;
        while id != ROOT {
            let node = &mut self.nodes[id as usize];
            if node.refs == 0 {
                break;
            }
            node.refs -= 1;
            if node.refs == 0 {
                self.tick += 1;
                node.tick = self.tick;
                self.evictable_blocks += node.len as u64;
                if node.children.is_empty() {
                    self.lru.push(Reverse((self.tick, id)));
                }
            }
            id = node.parent;
        }
        self.compact_if_stale();
    }

    /// Caches `chain` for a request that pinned its path down to `pinned`
    /// (from [`pin`](PrefixCache::pin), or [`ROOT`]), its first `len` keys
    /// (shared by the nodes, not copied): blocks already cached
    /// are pinned, the rest inserted pinned. Returns the new deepest node
    /// and how many blocks were added.
    pub(crate) fn insert(&mut self, keys: &Arc<[u64]>, len: usize, pinned: u32) -> (u32, usize) {
        let chain = &keys[..len];
        let at = self.walk(chain);
        let end = self.split_at(at);
        self.pin_path(end, pinned);
        if at.matched == chain.len() {
            return (end, 0);
        }
        let added = chain.len() - at.matched;
        let leaf = self.alloc(Node::new(end, at.matched, keys.clone(), added, 1));
        self.nodes[end as usize]
            .children
            .insert(chain[at.matched], leaf);
        self.changes += 1;
        self.nodes[end as usize].grown = self.changes;
        self.touch(Touch::Grown(end, chain[at.matched]));
        (leaf, added)
    }

    /// Evicts the least recently used unreferenced block (the last block of
    /// the oldest unreferenced leaf); false when every block is in use.
    #[cfg(test)]
    pub(crate) fn evict_one(&mut self) -> bool {
        self.evict_blocks(1) == 1
    }

    /// Evicts up to `wanted` blocks, as that many calls evicting the least
    /// recently used unreferenced block one at a time would (the same
    /// blocks, the same changes), but a leaf's blocks in one go; returns
    /// how many were evicted (fewer when every other block is in use).
    pub(crate) fn evict_blocks(&mut self, wanted: u64) -> u64 {
        let mut evicted = 0;
        while evicted < wanted {
            let Some(&Reverse((tick, id))) = self.lru.peek() else {
                break;
            };
            let node = &self.nodes[id as usize];
            let live = id != ROOT
                && node.refs == 0
                && node.tick == tick
                && node.children.is_empty()
                && node.len > 0;
            if !live {
                self.lru.pop();
                continue;
            }
            self.touch(Touch::Node(id));
            let node = &mut self.nodes[id as usize];
            // The leaf stays the oldest until it is gone: its last blocks go.
            let take = (wanted - evicted).min(node.len as u64);
            node.len -= take as usize;
            self.evictable_blocks -= take;
            evicted += take;
            if node.len == 0 {
                // Removed: a match that ended here now ends in the parent.
                self.mark_changed(id);
                let node = &mut self.nodes[id as usize];
                self.lru.pop();
                let (parent, key) = (node.parent, node.key);
                node.children = HashMap::default();
                // Lets go of the inserting request's chain.
                node.keys = self.no_keys.clone();
                self.free_nodes.push(id);
                let parent_node = &mut self.nodes[parent as usize];
                parent_node.children.remove(&key);
                if parent != ROOT && parent_node.refs == 0 && parent_node.children.is_empty() {
                    self.lru.push(Reverse((parent_node.tick, parent)));
                }
            }
        }
        evicted
    }

    /// Rebuilds the LRU heap once stale entries outnumber the nodes.
    fn compact_if_stale(&mut self) {
        let live_nodes = self.nodes.len() - self.free_nodes.len();
        if self.lru.len() > 2 * live_nodes + 1024 {
            let nodes = &self.nodes;
            self.lru.retain(|&Reverse((tick, id))| {
                let node = &nodes[id as usize];
                node.refs == 0 && node.tick == tick && node.children.is_empty() && node.len > 0
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(blocks: &[u64]) -> Arc<[u64]> {
        // Chained like the engine's: each depends on every one before it.
        let mut previous = 0u64;
        blocks
            .iter()
            .map(|&content| {
                previous = crate::model::chain_block_hash(previous, content);
                previous
            })
            .collect()
    }

    #[test]
    fn a_shared_prefix_is_one_path_and_splits_where_prompts_differ() {
        let mut cache = PrefixCache::default();
        let a = chain(&[1, 2, 3, 4]);
        let b = chain(&[1, 2, 9]);
        let (leaf_a, added) = cache.insert(&a, a.len(), ROOT);
        assert_eq!(added, 4);
        assert_eq!(cache.leading_hits(&b), 2);
        let pinned = cache.pin(&b, 2);
        let (leaf_b, added) = cache.insert(&b, b.len(), pinned);
        assert_eq!(added, 1);
        assert_eq!(cache.leading_hits(&a), 4);
        assert_eq!(cache.leading_hits(&b), 3);
        cache.unpin(leaf_a);
        cache.unpin(leaf_b);
        assert_eq!(cache.evictable_blocks(), 5);
    }

    /// Evicting blocks in batches is evicting them one at a time: the same
    /// blocks go, the same changes are recorded.
    #[test]
    fn a_batch_eviction_is_single_evictions_in_a_row() {
        let mut rng = crate::SplitMix64::new(5);
        let chains: Vec<Arc<[u64]>> = (0..60)
            .map(|_| {
                let group = rng.next_u64() % 4;
                let shared = (rng.next_u64() % 12) as usize;
                let own = (rng.next_u64() % 10) as usize;
                let own_base = 100 + rng.next_u64() % 1000;
                let contents: Vec<u64> = (0..shared as u64)
                    .map(|b| group << 32 | b)
                    .chain((0..own as u64).map(|b| own_base << 16 | b))
                    .collect();
                chain(&contents)
            })
            .collect();
        let build = || {
            let mut cache = PrefixCache::default();
            for (i, keys) in chains.iter().enumerate() {
                let hits = cache.leading_hits(keys);
                let pinned = cache.pin(keys, hits);
                let (deepest, _) = cache.insert(keys, keys.len(), pinned);
                // Every third stays pinned: eviction must pass it by.
                if i % 3 != 0 {
                    cache.unpin(deepest);
                }
            }
            cache
        };
        let (mut single, mut batched) = (build(), build());
        let mut touched = (Vec::new(), Vec::new());
        for batch in [1u64, 3, 7, 2, 20, 5, 1000] {
            let evicted = (0..batch).take_while(|_| single.evict_one()).count() as u64;
            assert_eq!(batched.evict_blocks(batch), evicted);
            assert_eq!(single.evictable_blocks(), batched.evictable_blocks());
            single.take_touched(&mut touched.0);
            batched.take_touched(&mut touched.1);
            assert_eq!(touched.0, touched.1);
            for keys in &chains {
                assert_eq!(single.leading_hits(keys), batched.leading_hits(keys));
            }
        }
        assert_eq!(batched.evictable_blocks(), 0);
    }

    #[test]
    fn eviction_takes_the_oldest_leaf_from_its_tail_and_never_a_pinned_block() {
        let mut cache = PrefixCache::default();
        let a = chain(&[1, 2, 3]);
        let b = chain(&[7, 8]);
        let (leaf_a, _) = cache.insert(&a, a.len(), ROOT);
        let (leaf_b, _) = cache.insert(&b, b.len(), ROOT);
        cache.unpin(leaf_a);
        assert!(cache.evict_one());
        assert_eq!(cache.leading_hits(&a), 2, "the tail goes first");
        assert!(cache.evict_one());
        assert!(cache.evict_one());
        assert_eq!(cache.leading_hits(&a), 0);
        assert!(!cache.evict_one(), "b is pinned");
        assert_eq!(cache.leading_hits(&b), 2);
        cache.unpin(leaf_b);
        assert!(cache.evict_one());
        assert_eq!(cache.evictable_blocks(), 1);
    }

    #[test]
    fn a_shared_ancestor_outlives_the_branches_released_before_it() {
        let mut cache = PrefixCache::default();
        let a = chain(&[1, 2, 3]);
        let b = chain(&[1, 2, 4]);
        let (leaf_a, _) = cache.insert(&a, a.len(), ROOT);
        let pinned = cache.pin(&b, 2);
        let (leaf_b, _) = cache.insert(&b, b.len(), pinned);
        cache.unpin(leaf_a);
        cache.unpin(leaf_b);
        // a's leaf, then b's leaf, then the shared [1, 2].
        assert!(cache.evict_one());
        assert_eq!(cache.leading_hits(&a), 2);
        assert_eq!(cache.leading_hits(&b), 3);
        assert!(cache.evict_one());
        assert_eq!(cache.leading_hits(&b), 2);
        assert!(cache.evict_one());
        assert_eq!(cache.leading_hits(&b), 1);
        assert!(cache.evict_one());
        assert!(!cache.evict_one());
        assert_eq!(cache.evictable_blocks(), 0);
    }

    #[test]
    fn a_split_node_keeps_its_holders_and_their_release_order() {
        let mut cache = PrefixCache::default();
        let a = chain(&[1, 2, 3, 4]);
        let (leaf_a, _) = cache.insert(&a, a.len(), ROOT);
        // b matches half of a's node while a still holds it.
        let b = chain(&[1, 2]);
        let pinned_b = cache.pin(&b, 2);
        cache.unpin(leaf_a);
        assert_eq!(
            cache.evictable_blocks(),
            2,
            "[3, 4] is free, [1, 2] held by b"
        );
        assert!(cache.evict_one());
        assert!(cache.evict_one());
        assert!(!cache.evict_one());
        assert_eq!(cache.leading_hits(&a), 2);
        cache.unpin(pinned_b);
        assert_eq!(cache.evictable_blocks(), 2);
    }
}
