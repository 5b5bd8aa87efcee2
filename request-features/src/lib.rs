//! What the router reads from a request body before choosing a worker:
//! the model, the streaming flag, the output limit, the prompt's size in
//! tokens ([`TokenCount`](policy_core::TokenCount): exact for token ids,
//! estimated from text) and its prefix block hashes
//! ([`PrefixBlocks`](policy_core::PrefixBlocks), what the policies' prefix
//! index keys on). Pure: bytes in, [`RequestInfo`](policy_core::RequestInfo)
//! out, no I/O.
//!
//! ```
//! use policy_core::TokenCount;
//! use request_features::{PrefixHashing, extend_token_id_chain, read_request};
//!
//! // 4-token blocks, at most 1024 tokens hashed, 4 characters a token.
//! let hashing = PrefixHashing { block_tokens: 4, max_tokens: 1024, chars_per_token: 4.0 };
//! let body = br#"{"model": "m", "stream": true, "input_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9]}"#;
//! let read = read_request(body, &hashing)?;
//! assert_eq!(read.info.model.as_deref(), Some("m"));
//! assert_eq!(read.info.tokens, TokenCount::Exact(9));
//! // Two full blocks of 4 ids; the ninth id fills no block.
//! assert_eq!(read.info.prefix.hashes().len(), 2);
//!
//! // A prompt known only as token ids hashes to the same blocks.
//! let mut chain = Vec::new();
//! extend_token_id_chain(&mut chain, 1..=9, hashing.block_tokens);
//! assert_eq!(read.info.prefix.hashes(), &chain[..]);
//! # Ok::<(), request_features::RequestBodyError>(())
//! ```
//!
//! How a prompt is cut into blocks: it is laid out as a byte stream and
//! cut into fixed-size blocks; hash `i` is xxh3 of block `i` seeded with
//! hash `i − 1`, so it names the whole prefix up to the end of block `i`.
//! Token ids (`input_ids`, or `prompt` as integers) are 4-byte
//! little-endian words, `block_tokens` to a block; text (`messages`, then
//! `prompt` or `text`) is cut every `block_tokens × chars_per_token`
//! bytes, with marker bytes between a chat's messages, roles and parts.
//! Only full blocks are hashed, and only the first `max_tokens` tokens'
//! worth. A prompt whose prefix cannot be hashed gets an empty
//! `PrefixBlocks` and an [`Unhashed`] reason.

mod estimate;
mod prefix_hash;

pub use estimate::{
    ReadRequest, RequestBodyError, StreamUsage, max_output_tokens, priority, read_request,
    request_info, stream_usage,
};
pub use prefix_hash::{MAX_TEXT_BLOCK_BYTES, PrefixHashing, Unhashed, extend_token_id_chain};
