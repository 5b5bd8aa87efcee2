use std::sync::Arc;

/// How many prompt tokens the request being routed carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenCount {
    /// Known exactly (gRPC path, or the caller sent token ids).
    Exact(u64),
    /// Estimated from the prompt text (HTTP path: characters / chars-per-token).
    Estimated(u64),
    /// No text to measure.
    Unknown,
}

impl TokenCount {
    /// The count, or `fallback` (a policy's mean prompt size) when unknown.
    pub fn or(self, fallback: u64) -> u64 {
        match self {
            TokenCount::Exact(tokens) | TokenCount::Estimated(tokens) => tokens,
            TokenCount::Unknown => fallback,
        }
    }
}

/// The request's prompt as chained hashes of fixed-size token blocks: hash
/// `i` names the prompt's first `(i + 1) × block_tokens` tokens (each block's
/// content chained onto the hash before it), so two prompts share hash `i`
/// exactly when they share that whole prefix. Only full blocks are hashed.
/// Empty means unknown: a prefix-aware policy then scores as if nothing were
/// cached.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PrefixBlocks {
    block_tokens: u32,
    hashes: Arc<[u64]>,
}

impl PrefixBlocks {
    /// Blocks of `block_tokens` tokens; a zero block size gives the empty set.
    pub fn new(block_tokens: u32, hashes: impl Into<Arc<[u64]>>) -> PrefixBlocks {
        if block_tokens == 0 {
            return PrefixBlocks::default();
        }
        PrefixBlocks {
            block_tokens,
            hashes: hashes.into(),
        }
    }

    /// Tokens per block (0 when empty and built by `default`).
    pub fn block_tokens(&self) -> u32 {
        self.block_tokens
    }

    /// The chained hashes, first block first.
    pub fn hashes(&self) -> &[u64] {
        &self.hashes
    }

    pub fn is_empty(&self) -> bool {
        self.hashes.is_empty()
    }

    /// Prompt tokens covered by the first `blocks` blocks.
    pub fn tokens_in(&self, blocks: usize) -> u64 {
        blocks.min(self.hashes.len()) as u64 * u64::from(self.block_tokens)
    }
}

/// What a policy knows of the request it routes.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestInfo {
    pub tokens: TokenCount,
    pub streaming: bool,
    pub model: Option<Arc<str>>,
    /// The prompt's leading blocks, hashed; empty when unknown.
    pub prefix: PrefixBlocks,
}

impl RequestInfo {
    pub fn new(tokens: TokenCount) -> RequestInfo {
        RequestInfo {
            tokens,
            streaming: false,
            model: None,
            prefix: PrefixBlocks::default(),
        }
    }

    /// The prompt's chained block hashes (see [`PrefixBlocks`]).
    #[must_use]
    pub fn prefix_blocks(mut self, prefix: PrefixBlocks) -> RequestInfo {
        self.prefix = prefix;
        self
    }

    #[must_use]
    pub fn streaming(mut self, streaming: bool) -> RequestInfo {
        self.streaming = streaming;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_blocks_count_tokens_and_reject_a_zero_block_size() {
        let blocks = PrefixBlocks::new(64, vec![1, 2, 3]);
        assert_eq!(blocks.tokens_in(2), 128);
        assert_eq!(blocks.tokens_in(10), 192);
        assert!(PrefixBlocks::new(0, vec![1, 2]).is_empty());
        let request = RequestInfo::new(TokenCount::Exact(300)).prefix_blocks(blocks.clone());
        assert_eq!(request.prefix, blocks);
        assert!(RequestInfo::new(TokenCount::Unknown).prefix.is_empty());
    }
}
