//! Helpers the policies' unit tests share.

use crate::{Policy, PrefixBlocks, RequestInfo, TokenCount, WorkerId, WorkerInfo};

/// Adds `workers` SGLang workers to `policy`, at slots 0.., with URLs
/// `http://w{slot}{url_suffix}`.
pub(crate) fn with_workers<P: Policy>(
    policy: P,
    workers: u32,
    url_suffix: &str,
) -> (P, Vec<WorkerId>) {
    let ids: Vec<WorkerId> = (0..workers).map(|slot| WorkerId::new(slot, 0)).collect();
    for id in &ids {
        policy.add_worker(
            *id,
            WorkerInfo::new(format!("http://w{}{url_suffix}", id.slot()), "sglang"),
        );
    }
    (policy, ids)
}

/// A prompt of `blocks` 16-token blocks whose chain starts at `root`:
/// prompts with the same root share their leading blocks.
pub(crate) fn prompt(root: u64, blocks: u64) -> RequestInfo {
    let hashes: Vec<u64> = (0..blocks).map(|index| root * 1_000_000 + index).collect();
    RequestInfo::new(TokenCount::Exact(blocks * 16)).prefix_blocks(PrefixBlocks::new(16, hashes))
}
