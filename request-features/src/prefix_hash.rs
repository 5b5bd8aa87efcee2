//! The prompt's prefix block hashes ([`PrefixBlocks`]) computed from an HTTP
//! body, for the policies' prefix index (least_load's `prefix_affinity`).
//!
//! The prompt is laid out as a byte stream and cut into fixed-size blocks;
//! hash `i` is xxh3 of block `i` seeded with hash `i − 1`, so it names the
//! whole prefix up to the end of block `i`. Only full blocks are hashed, and
//! only the first `prefix_hash_max_tokens` tokens' worth, so a 10 MB prompt
//! costs no more hashing than a prompt of that bound.
//!
//! Which part of the body is the prompt, the first present (not `null`) of:
//!
//! 1. `input_ids` (SGLang native), or `prompt` given as integers (a list
//!    whose first item is a number or a list): token ids, hashed as 4-byte
//!    little-endian words in blocks of `block_tokens` ids. A batch (a list
//!    of lists) hashes its first sequence. Every id read must be an integer
//!    from 0 to `u32::MAX` (ids past the bound are not read).
//! 2. `messages` (chat): for each message object, a message marker, its
//!    `role`, a content marker, and each text part of its `content` (a
//!    string, or the string items and `text` fields of a content array;
//!    image and audio parts add nothing) after a part marker. The markers
//!    are bytes that never occur in UTF-8 text (0xFF, 0xFE, 0xFD), so
//!    conversations that share their first messages share their leading
//!    blocks, and a different role or a different message split changes
//!    every block from there on.
//! 3. `prompt`, then `text`: a string, or the first string of a list.
//!
//! Text blocks are `block_tokens × chars_per_token` bytes of the text as
//! the engine sees it: JSON string escapes are decoded (without copying the
//! string), so a body hashes the same however its client escaped it, and the
//! raw reader ([`crate::read_request`]) and the parsed one
//! ([`crate::request_info`]) agree. Token ids and text are hashed
//! from different seeds, so neither can match the other.
//!
//! A body whose prefix cannot be hashed gets an empty [`PrefixBlocks`]
//! ("prefix unknown": the policy scores it plainly) and an [`Unhashed`]
//! reason, never a panic.

use std::fmt;

use policy_core::PrefixBlocks;
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::Value;
use serde_json::value::RawValue;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::estimate::{ObjectFields, fields_of, for_each_item_while};

/// The largest text block, bytes (`request.prefix_hash_block_tokens` ×
/// `request.chars_per_token` is validated against it; a larger product is
/// clamped to it).
pub const MAX_TEXT_BLOCK_BYTES: usize = 1 << 20;

/// Seeds of the first block: text and token ids never share a chain.
const TEXT_SEED: u64 = 0x7465_7874_5f70_7265;
const IDS_SEED: u64 = 0x6964_735f_7072_6566;

/// Chat layout markers: bytes no UTF-8 text contains.
const MESSAGE: u8 = 0xFF;
const CONTENT: u8 = 0xFE;
const PART: u8 = 0xFD;

/// How prompts are hashed (from `[request]`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefixHashing {
    /// Tokens per block; 0 turns hashing off.
    pub block_tokens: u32,
    /// The longest prefix hashed, tokens; 0 turns hashing off.
    pub max_tokens: u64,
    /// Text bytes per token: a text block is `block_tokens × chars_per_token`
    /// bytes, rounded up (at least 1, at most [`MAX_TEXT_BLOCK_BYTES`]).
    pub chars_per_token: f64,
}

impl PrefixHashing {
    /// Whether hashing is off (`max_tokens` or `block_tokens` is 0).
    fn is_off(&self) -> bool {
        self.max_blocks() == 0 || self.block_tokens == 0
    }

    /// Blocks hashed at most.
    fn max_blocks(&self) -> usize {
        let blocks = self.max_tokens / u64::from(self.block_tokens.max(1));
        usize::try_from(blocks).unwrap_or(usize::MAX)
    }

    fn text_block_bytes(&self) -> usize {
        let bytes = (f64::from(self.block_tokens) * self.chars_per_token).ceil();
        // A NaN or negative product (an unvalidated ratio) clamps to 1.
        if bytes >= MAX_TEXT_BLOCK_BYTES as f64 {
            MAX_TEXT_BLOCK_BYTES
        } else if bytes >= 1.0 {
            bytes as usize
        } else {
            1
        }
    }
}

/// Why a request's prefix was left unknown (the policy then scores it
/// without prefix affinity).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Unhashed {
    /// `request.prefix_hash_max_tokens = 0` (or a zero block size).
    #[error("prefix hashing is off")]
    Disabled,
    /// No token ids and no text: no prompt field, an empty one, or one of
    /// another type, or chat messages with no text part (images only).
    #[error("the request has no prompt text or token ids")]
    NoPrompt,
    /// A token id read is negative, not an integer, above `u32::MAX`, or
    /// not a number at all.
    #[error("a token id is not an integer from 0 to 4294967295")]
    InvalidTokenIds,
    /// The prompt fills no whole block.
    #[error("the prompt is shorter than one block")]
    ShorterThanOneBlock,
}

impl Unhashed {
    /// A short name, for logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Unhashed::Disabled => "disabled",
            Unhashed::NoPrompt => "no_prompt",
            Unhashed::InvalidTokenIds => "invalid_token_ids",
            Unhashed::ShorterThanOneBlock => "shorter_than_one_block",
        }
    }
}

/// The prompt fields of a raw body, as [`crate::read_request`]
/// captured them (`messages` is read where it lies: [`ReadChat`]).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RawPrompt<'a> {
    pub input_ids: Option<&'a RawValue>,
    pub prompt: Option<&'a RawValue>,
    pub text: Option<&'a RawValue>,
}

/// The chained block hashes of a byte stream, cut into blocks as it comes.
#[derive(Debug)]
struct Chain {
    block_bytes: usize,
    max_blocks: usize,
    /// The current block, while it is split across pushes.
    partial: Vec<u8>,
    previous: u64,
    hashes: Vec<u64>,
}

impl Chain {
    fn new(seed: u64, block_bytes: usize, max_blocks: usize) -> Chain {
        Chain {
            block_bytes: block_bytes.max(1),
            max_blocks,
            partial: Vec::new(),
            previous: seed,
            hashes: Vec::new(),
        }
    }

    fn is_full(&self) -> bool {
        self.hashes.len() >= self.max_blocks
    }

    /// Bytes it still takes.
    fn room(&self) -> usize {
        (self.max_blocks - self.hashes.len().min(self.max_blocks))
            .saturating_mul(self.block_bytes)
            .saturating_sub(self.partial.len())
    }

    fn push(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() && !self.is_full() {
            // A whole block in the input is hashed where it lies.
            if self.partial.is_empty() && bytes.len() >= self.block_bytes {
                let (block, rest) = bytes.split_at(self.block_bytes);
                self.finish(block);
                bytes = rest;
                continue;
            }
            if self.partial.capacity() == 0 {
                self.partial.reserve_exact(self.block_bytes);
            }
            let take = (self.block_bytes - self.partial.len()).min(bytes.len());
            let (head, rest) = bytes.split_at(take);
            self.partial.extend_from_slice(head);
            bytes = rest;
            if self.partial.len() == self.block_bytes {
                let block = std::mem::take(&mut self.partial);
                self.finish(&block);
                self.partial = block;
                self.partial.clear();
            }
        }
    }

    fn finish(&mut self, block: &[u8]) {
        self.previous = xxh3_64_with_seed(block, self.previous);
        self.hashes.push(self.previous);
    }

    fn into_blocks(self, block_tokens: u32) -> Result<PrefixBlocks, Unhashed> {
        if self.hashes.is_empty() {
            return Err(Unhashed::ShorterThanOneBlock);
        }
        Ok(PrefixBlocks::new(block_tokens, self.hashes))
    }

    /// Pushes the text of a raw JSON string (quotes included), its escapes
    /// decoded, reading no further than the chain takes. False when `raw`
    /// is not a string.
    fn push_json_str(&mut self, raw: &str) -> bool {
        let Some(inner) = raw.strip_prefix('"').and_then(|s| s.strip_suffix('"')) else {
            return false;
        };
        let bytes = inner.as_bytes();
        let mut at = 0;
        while at < bytes.len() && !self.is_full() {
            // Escaped text is never shorter than its decoding, so looking
            // `room` bytes ahead reads no more than the chain takes.
            let end = bytes.len().min(at.saturating_add(self.room()));
            match memchr::memchr(b'\\', &bytes[at..end]) {
                None => {
                    self.push(&bytes[at..end]);
                    at = end;
                }
                Some(offset) => {
                    self.push(&bytes[at..at + offset]);
                    at += offset;
                    match decode_escape(bytes, at) {
                        Some((decoded, next)) => {
                            let mut utf8 = [0u8; 4];
                            self.push(decoded.encode_utf8(&mut utf8).as_bytes());
                            at = next;
                        }
                        // Not valid JSON (the body was validated): stop here.
                        None => break,
                    }
                }
            }
        }
        true
    }
}

/// The character escaped at `bytes[at]` (a backslash) and the index after
/// the escape. A lone surrogate (which only a raw reader sees: a parsed
/// body refuses it) decodes to U+FFFD.
fn decode_escape(bytes: &[u8], at: usize) -> Option<(char, usize)> {
    let decoded = match *bytes.get(at + 1)? {
        b'"' => '"',
        b'\\' => '\\',
        b'/' => '/',
        b'b' => '\u{8}',
        b'f' => '\u{c}',
        b'n' => '\n',
        b'r' => '\r',
        b't' => '\t',
        b'u' => {
            let high = hex4(bytes, at + 2)?;
            if (0xD800..0xDC00).contains(&high)
                && bytes.get(at + 6) == Some(&b'\\')
                && bytes.get(at + 7) == Some(&b'u')
                && let Some(low) = hex4(bytes, at + 8)
                && (0xDC00..0xE000).contains(&low)
            {
                let code = 0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00);
                return Some((char::from_u32(code)?, at + 12));
            }
            return Some((char::from_u32(high).unwrap_or('\u{fffd}'), at + 6));
        }
        _ => return None,
    };
    Some((decoded, at + 2))
}

fn hex4(bytes: &[u8], at: usize) -> Option<u32> {
    let digits = std::str::from_utf8(bytes.get(at..at + 4)?).ok()?;
    u32::from_str_radix(digits, 16).ok()
}

/// The characters of a raw JSON string (quotes included) once its escapes
/// are decoded, counted where it lies: what
/// `serde_json::from_str::<Cow<str>>(raw)` then `chars().count()` gives,
/// and `None` where that fails (not a string, or a lone surrogate escape).
pub(crate) fn json_str_chars(raw: &str) -> Option<usize> {
    let inner = raw.strip_prefix('"')?.strip_suffix('"')?;
    let bytes = inner.as_bytes();
    // A byte that does not continue a UTF-8 sequence starts a character.
    let count = |run: &[u8]| run.iter().filter(|&&b| (b as i8) >= -0x40).count();
    let mut chars = 0;
    let mut at = 0;
    while let Some(offset) = memchr::memchr(b'\\', &bytes[at..]) {
        chars += count(&bytes[at..at + offset]);
        at = escape_end(bytes, at + offset)?;
        chars += 1;
    }
    Some(chars + count(&bytes[at..]))
}

/// The index after the escape at `bytes[at]` (a backslash), `None` for one
/// that does not decode to a character (a lone surrogate, or not an escape).
fn escape_end(bytes: &[u8], at: usize) -> Option<usize> {
    match *bytes.get(at + 1)? {
        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => Some(at + 2),
        b'u' => match hex4(bytes, at + 2)? {
            0xD800..0xDC00 => {
                let low = (bytes.get(at + 6..at + 8)? == b"\\u")
                    .then(|| hex4(bytes, at + 8))
                    .flatten()?;
                (0xDC00..0xE000).contains(&low).then_some(at + 12)
            }
            0xDC00..0xE000 => None,
            _ => Some(at + 6),
        },
        _ => None,
    }
}

/// The text of a chat's messages as the token estimate counts it: the
/// characters of every text part, and whether there was any.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct MessageText {
    pub chars: usize,
    pub any: bool,
}

impl MessageText {
    /// Counts a raw JSON value if it is a string.
    fn count(&mut self, raw: &str) {
        if let Some(chars) = json_str_chars(raw) {
            self.chars += chars;
            self.any = true;
        }
    }
}

/// Which field holds the prompt (see the module docs).
enum Source<T> {
    Ids(T),
    Chat(T),
    Text(T),
}

#[cfg(test)]
/// Hashes the prompt of a raw body: `prompt`'s token ids or text fields,
/// and `messages` as the body's reader read them ([`ReadChat`]).
pub(crate) fn hash_raw(
    prompt: RawPrompt<'_>,
    messages: Option<ReadChat>,
    hashing: &PrefixHashing,
) -> Result<PrefixBlocks, Unhashed> {
    hash_raw_counting(prompt, messages, hashing).blocks
}

/// What [`hash_raw_counting`] found.
#[derive(Debug)]
pub(crate) struct RawHashed {
    pub blocks: Result<PrefixBlocks, Unhashed>,
    /// The number of token ids in the list hashed, when the hash read it
    /// whole as the token estimate reads it (one list, not a batch, every
    /// item an unsigned integer, at least one): the estimate's exact count,
    /// so that a long id list is read once, not twice.
    pub ids_counted: Option<u64>,
}

/// [`hash_raw`], and the count of the token ids it read, if it read them
/// all ([`RawHashed::ids_counted`]).
pub(crate) fn hash_raw_counting(
    prompt: RawPrompt<'_>,
    messages: Option<ReadChat>,
    hashing: &PrefixHashing,
) -> RawHashed {
    let max_blocks = hashing.max_blocks();
    if hashing.is_off() {
        return without_ids_counted(Err(Unhashed::Disabled));
    }
    fn present(raw: Option<&RawValue>) -> Option<&RawValue> {
        raw.filter(|raw| raw.get() != "null")
    }
    let ids = present(prompt.input_ids)
        .or_else(|| present(prompt.prompt).filter(|raw| raw_holds_ids(raw)));
    if let Some(ids) = ids {
        let mut blocks = IdBlocks::new(IDS_SEED, hashing.block_tokens, max_blocks);
        let (hashed, ids_counted) = raw_ids(&mut blocks, ids.get());
        return RawHashed {
            blocks: hashed.and_then(|()| blocks.chain.into_blocks(hashing.block_tokens)),
            ids_counted,
        };
    }
    if let Some(chat) = messages {
        return without_ids_counted(chat.into_blocks(hashing.block_tokens));
    }
    match present(prompt.prompt).or(present(prompt.text)) {
        Some(text) => without_ids_counted(hash_raw_text(text, hashing, max_blocks)),
        None => without_ids_counted(Err(Unhashed::NoPrompt)),
    }
}

/// Blocks hashed (or not) from anything but an id list, which count no
/// ids.
fn without_ids_counted(blocks: Result<PrefixBlocks, Unhashed>) -> RawHashed {
    RawHashed {
        blocks,
        ids_counted: None,
    }
}

/// Hashes a raw `prompt` or `text`: a string, or the first of a list.
fn hash_raw_text(
    raw: &RawValue,
    hashing: &PrefixHashing,
    max_blocks: usize,
) -> Result<PrefixBlocks, Unhashed> {
    let mut chain = Chain::new(TEXT_SEED, hashing.text_block_bytes(), max_blocks);
    let text = match raw.get().as_bytes().first() {
        Some(b'"') => raw,
        Some(b'[') => {
            let mut first = None;
            let _ = for_each_item_while(raw, |item| {
                first = Some(item);
                false
            });
            first.ok_or(Unhashed::NoPrompt)?
        }
        _ => return Err(Unhashed::NoPrompt),
    };
    if !chain.push_json_str(text.get()) {
        return Err(Unhashed::NoPrompt);
    }
    chain.into_blocks(hashing.block_tokens)
}

/// Whether a raw `prompt` is token ids: a list whose first item is a
/// number or a list.
fn raw_holds_ids(raw: &RawValue) -> bool {
    let Some(items) = raw.get().strip_prefix('[') else {
        return false;
    };
    matches!(
        items.trim_start().as_bytes().first(),
        Some(b'0'..=b'9' | b'-' | b'[')
    )
}

/// Token ids laid out as the chain hashes them: 4-byte little-endian
/// words, `block_tokens` ids to a block. The one layout of every id prompt:
/// a body's `input_ids` (raw or parsed) and a prompt of ids given directly
/// ([`extend_token_id_chain`]). Ids are gathered a block at a time, so a
/// block costs one push, not one per id.
#[derive(Debug)]
struct IdBlocks {
    chain: Chain,
    /// The ids of the current block, while it is not full.
    block: Vec<u8>,
}

impl IdBlocks {
    /// Blocks chained on from `previous` (the seed, or the hash of the
    /// blocks before), at most `max_blocks` of them.
    fn new(previous: u64, block_tokens: u32, max_blocks: usize) -> IdBlocks {
        let block_bytes = usize::try_from(block_tokens)
            .unwrap_or(usize::MAX)
            .saturating_mul(4);
        let chain = Chain::new(previous, block_bytes, max_blocks);
        let block = Vec::with_capacity(chain.block_bytes.min(MAX_TEXT_BLOCK_BYTES));
        IdBlocks { chain, block }
    }

    fn is_full(&self) -> bool {
        self.chain.is_full()
    }

    fn push(&mut self, id: u32) {
        self.block.extend_from_slice(&id.to_le_bytes());
        if self.block.len() >= self.chain.block_bytes {
            self.chain.push(&self.block);
            self.block.clear();
        }
    }
}

/// Extends `chain`, the chained hashes of an id prompt's first
/// `chain.len()` blocks of `block_tokens` ids, with the full blocks of
/// `ids`, the prompt's ids from the end of those blocks on. The result is
/// what [`read_request`](crate::read_request) hashes from a body whose
/// `input_ids` are the whole prompt, blocks of `block_tokens` ids, without
/// a bound on the prompt's length: the same code lays the ids out and
/// chains them (4-byte little-endian words, xxh3 seeded with the block
/// before). Ids after the last full block are not hashed; a zero block
/// size hashes nothing, as hashing off does.
///
/// For prompts known only as token ids (the fleet simulator's synthetic
/// prompts), so that they are hashed as the router hashes a real one.
pub fn extend_token_id_chain(
    chain: &mut Vec<u64>,
    ids: impl IntoIterator<Item = u32>,
    block_tokens: u32,
) {
    if block_tokens == 0 {
        return;
    }
    let previous = chain.last().copied().unwrap_or(IDS_SEED);
    let mut blocks = IdBlocks::new(previous, block_tokens, usize::MAX);
    for id in ids {
        blocks.push(id);
    }
    chain.append(&mut blocks.chain.hashes);
}

/// Pushes the ids of a raw id list (the first sequence of a batch) until
/// the chain is full, and counts them as the token estimate does
/// ([`RawHashed::ids_counted`]). The list was validated as JSON, so only
/// what an item is needs checking.
///
/// Past a full chain the list is still read, for the count, but what it
/// holds no longer decides the hash: it is hashed as far as it was pushed.
fn raw_ids(blocks: &mut IdBlocks, raw: &str) -> (Result<(), Unhashed>, Option<u64>) {
    let bytes = raw.as_bytes();
    if bytes.first() != Some(&b'[') {
        return (Err(Unhashed::InvalidTokenIds), None);
    }
    let first = skip_whitespace(bytes, 1);
    let batch = bytes.get(first) == Some(&b'[');
    let list = if batch { first } else { 0 };
    let mut pushed = 0u64;
    // An id above `u32::MAX` before the chain is full.
    let mut out_of_range = false;
    let read = scan_uint_list(bytes, list, u64::MAX, |id| {
        if blocks.is_full() {
            return true;
        }
        let Ok(id) = u32::try_from(id) else {
            out_of_range = true;
            return false;
        };
        blocks.push(id);
        pushed += 1;
        true
    });
    // What lies past a full chain does not decide the hash.
    let hashed = if out_of_range || (read.is_none() && !blocks.is_full()) {
        Err(Unhashed::InvalidTokenIds)
    } else if pushed == 0 {
        Err(Unhashed::NoPrompt)
    } else {
        Ok(())
    };
    let ids_counted = match read {
        Some((ids, _)) if !batch && !out_of_range && ids > 0 => Some(ids),
        _ => None,
    };
    (hashed, ids_counted)
}

/// Reads the list of unsigned JSON integers that opens at `bytes[at]`,
/// passing each to `each` until it returns false: the number of integers
/// read and the index after the list (or of where the reading stopped).
/// `None` unless it is such a list, every integer at most `max`: an item
/// with a sign, fraction or exponent, or that is not a number, makes it
/// none (as `Value::as_u64` finds). The list was validated as JSON, so
/// only what an item is needs checking.
///
/// Token id lists are most of the bodies that hold them, so this is one
/// tight loop over the bytes, the digits accumulated unchecked: nineteen
/// digits cannot overflow a `u64`, and only a longer run (never a token
/// id) is read again with checks.
pub(crate) fn scan_uint_list(
    bytes: &[u8],
    at: usize,
    max: u64,
    mut each: impl FnMut(u64) -> bool,
) -> Option<(u64, usize)> {
    const UNCHECKED_DIGITS: usize = 19;
    if bytes.get(at) != Some(&b'[') {
        return None;
    }
    let items = bytes.get(at + 1..)?;
    let mut count = 0u64;
    let mut value = 0u64;
    let mut digits = 0usize;
    for (offset, &byte) in items.iter().enumerate() {
        let digit = byte.wrapping_sub(b'0');
        if digit <= 9 {
            value = value.wrapping_mul(10).wrapping_add(u64::from(digit));
            digits += 1;
            continue;
        }
        if digits > 0 {
            if digits > UNCHECKED_DIGITS {
                value = items
                    .get(offset - digits..offset)?
                    .iter()
                    .try_fold(0u64, |value, digit| {
                        value.checked_mul(10)?.checked_add(u64::from(digit - b'0'))
                    })?;
            }
            if value > max {
                return None;
            }
            count += 1;
            if !each(value) {
                return Some((count, at + 1 + offset));
            }
            value = 0;
            digits = 0;
        }
        match byte {
            b',' | b' ' | b'\t' | b'\n' | b'\r' => {}
            b']' => return Some((count, at + 2 + offset)),
            // A sign, fraction, exponent or any other value.
            _ => return None,
        }
    }
    None
}

/// The index of the first byte at or after `at` that is not JSON
/// whitespace.
pub(crate) fn skip_whitespace(bytes: &[u8], mut at: usize) -> usize {
    while bytes.get(at).is_some_and(|b| b.is_ascii_whitespace()) {
        at += 1;
    }
    at
}

/// A chat's `messages`, read in one pass where they lie in the body
/// ([`ChatSeed`]): their layout pushed onto a chain until it is full, and
/// the text of every message counted (the token estimate reads the whole
/// chat, the hash only its leading blocks). Each message's `role` and
/// `content` are captured where they lie, and a string content is pushed
/// and counted from there. A value that is not a list reads as a chat
/// with no text.
#[derive(Debug)]
pub(crate) struct ReadChat {
    chain: Chain,
    text: MessageText,
    /// Whether any text part was pushed.
    found: bool,
}

impl ReadChat {
    /// A chat with nothing read yet, chained as `hashing` says (counted
    /// only, with hashing off).
    fn new(hashing: &PrefixHashing) -> ReadChat {
        let chain = if hashing.is_off() {
            Chain::new(TEXT_SEED, 1, 0)
        } else {
            Chain::new(TEXT_SEED, hashing.text_block_bytes(), hashing.max_blocks())
        };
        ReadChat {
            chain,
            text: MessageText::default(),
            found: false,
        }
    }

    /// The text of its messages, as the token estimate counts it.
    pub(crate) fn text(&self) -> MessageText {
        self.text
    }

    /// Reads one item of the list: its `role` and `content`, or `None`
    /// when it is not an object (it adds nothing).
    fn message(&mut self, fields: Option<[Option<&RawValue>; 2]>) {
        let Some([role, content]) = fields else {
            return;
        };
        let chain = &mut self.chain;
        if !chain.is_full() {
            chain.push(&[MESSAGE]);
            if let Some(role) = role {
                chain.push_json_str(role.get());
            }
            chain.push(&[CONTENT]);
        }
        let Some(content) = content else {
            return;
        };
        let text = &mut self.text;
        let found = &mut self.found;
        let mut part = |raw: &RawValue| {
            text.count(raw.get());
            if raw.get().starts_with('"') && !chain.is_full() {
                chain.push(&[PART]);
                *found |= chain.push_json_str(raw.get());
            }
        };
        match content.get().as_bytes().first() {
            Some(b'"') => part(content),
            Some(b'[') => {
                // Parts are few and small beside the text they hold.
                let _ = for_each_item_while(content, |item| {
                    let raw = if item.get().starts_with('"') {
                        Some(item)
                    } else {
                        fields_of(item, &["text"]).and_then(|[text]| text)
                    };
                    if let Some(raw) = raw {
                        part(raw);
                    }
                    true
                });
            }
            _ => {}
        }
    }

    /// Its blocks; no prompt if no message held text.
    fn into_blocks(self, block_tokens: u32) -> Result<PrefixBlocks, Unhashed> {
        if !self.found {
            return Err(Unhashed::NoPrompt);
        }
        self.chain.into_blocks(block_tokens)
    }
}

#[cfg(test)]
/// Reads a raw `messages` value as the body's reader does ([`ChatSeed`]);
/// `None` for `null`.
pub(crate) fn read_chat(messages: &RawValue, hashing: &PrefixHashing) -> Option<ReadChat> {
    let mut de = serde_json::Deserializer::from_str(messages.get());
    // A raw value is valid JSON, so the walk cannot fail.
    ChatSeed { hashing }.deserialize(&mut de).ok().flatten()
}

/// Reads a body's `messages` where it lies, within the walk over the body
/// ([`crate::read_request`]), so that the chat is not skipped
/// once and read again: `None` for `null` (as if absent), a [`ReadChat`]
/// for anything else.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ChatSeed<'h> {
    pub hashing: &'h PrefixHashing,
}

impl<'de> DeserializeSeed<'de> for ChatSeed<'_> {
    type Value = Option<ReadChat>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ChatSeed<'_> {
    type Value = Option<ReadChat>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut chat = ReadChat::new(self.hashing);
        let names = &["role", "content"];
        while let Some(fields) = seq.next_element_seed(ObjectFields { names })? {
            chat.message(fields);
        }
        Ok(Some(chat))
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Some(ReadChat::new(self.hashing)))
    }

    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(Some(ReadChat::new(self.hashing)))
    }

    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(Some(ReadChat::new(self.hashing)))
    }

    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(Some(ReadChat::new(self.hashing)))
    }

    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(Some(ReadChat::new(self.hashing)))
    }

    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(Some(ReadChat::new(self.hashing)))
    }
}

/// Hashes the prompt of a parsed body, as [`hash_raw`] hashes a raw one.
pub(crate) fn hash_value(body: &Value, hashing: &PrefixHashing) -> Result<PrefixBlocks, Unhashed> {
    let max_blocks = hashing.max_blocks();
    if hashing.is_off() {
        return Err(Unhashed::Disabled);
    }
    let present = |key: &str| body.get(key).filter(|value| !value.is_null());
    let holds_ids = |value: &&Value| {
        value
            .as_array()
            .and_then(|items| items.first())
            .is_some_and(|first| first.is_number() || first.is_array())
    };
    let source = if let Some(ids) = present("input_ids") {
        Source::Ids(ids)
    } else if let Some(ids) = present("prompt").filter(holds_ids) {
        Source::Ids(ids)
    } else if let Some(messages) = present("messages") {
        Source::Chat(messages)
    } else if let Some(text) = present("prompt").or_else(|| present("text")) {
        Source::Text(text)
    } else {
        return Err(Unhashed::NoPrompt);
    };
    match source {
        Source::Ids(value) => {
            let mut blocks = IdBlocks::new(IDS_SEED, hashing.block_tokens, max_blocks);
            let items = value.as_array().ok_or(Unhashed::InvalidTokenIds)?;
            let sequence = match items.first() {
                Some(Value::Array(first)) => first,
                _ => items,
            };
            let mut any = false;
            for item in sequence {
                if blocks.is_full() {
                    break;
                }
                let id = item
                    .as_u64()
                    .and_then(|id| u32::try_from(id).ok())
                    .ok_or(Unhashed::InvalidTokenIds)?;
                blocks.push(id);
                any = true;
            }
            if !any {
                return Err(Unhashed::NoPrompt);
            }
            blocks.chain.into_blocks(hashing.block_tokens)
        }
        Source::Chat(value) => {
            let mut chain = Chain::new(TEXT_SEED, hashing.text_block_bytes(), max_blocks);
            let messages = value.as_array().ok_or(Unhashed::NoPrompt)?;
            let mut found = false;
            for message in messages.iter().filter(|message| message.is_object()) {
                if chain.is_full() {
                    break;
                }
                chain.push(&[MESSAGE]);
                if let Some(role) = message.get("role").and_then(Value::as_str) {
                    chain.push(role.as_bytes());
                }
                chain.push(&[CONTENT]);
                match message.get("content") {
                    Some(Value::String(text)) => {
                        chain.push(&[PART]);
                        chain.push(text.as_bytes());
                        found = true;
                    }
                    Some(Value::Array(parts)) => {
                        for part in parts {
                            if chain.is_full() {
                                break;
                            }
                            let text = part
                                .as_str()
                                .or_else(|| part.get("text").and_then(Value::as_str));
                            if let Some(text) = text {
                                chain.push(&[PART]);
                                chain.push(text.as_bytes());
                                found = true;
                            }
                        }
                    }
                    _ => {}
                }
            }
            if !found {
                return Err(Unhashed::NoPrompt);
            }
            chain.into_blocks(hashing.block_tokens)
        }
        Source::Text(value) => {
            let mut chain = Chain::new(TEXT_SEED, hashing.text_block_bytes(), max_blocks);
            let text = match value {
                Value::String(text) => text,
                Value::Array(items) => items
                    .first()
                    .and_then(Value::as_str)
                    .ok_or(Unhashed::NoPrompt)?,
                _ => return Err(Unhashed::NoPrompt),
            };
            chain.push(text.as_bytes());
            chain.into_blocks(hashing.block_tokens)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use serde_json::json;

    /// 4-token blocks of 16 bytes of text, at most 256 blocks.
    const SMALL: PrefixHashing = PrefixHashing {
        block_tokens: 4,
        max_tokens: 1024,
        chars_per_token: 4.0,
    };

    /// Hashes a raw body's prompt as the proxy's reader captures it.
    fn from_raw(raw: &str, hashing: &PrefixHashing) -> Result<PrefixBlocks, Unhashed> {
        let fields: HashMap<String, Box<RawValue>> = serde_json::from_str(raw).unwrap();
        let get = |key: &str| fields.get(key).map(|raw| &**raw);
        hash_raw(
            RawPrompt {
                input_ids: get("input_ids"),
                prompt: get("prompt"),
                text: get("text"),
            },
            get("messages").and_then(|raw| read_chat(raw, hashing)),
            hashing,
        )
    }

    /// Both readers' answer, held to be the same.
    fn hashed(body: &Value, hashing: &PrefixHashing) -> Result<PrefixBlocks, Unhashed> {
        let parsed = hash_value(body, hashing);
        let raw = from_raw(&serde_json::to_string(body).unwrap(), hashing);
        assert_eq!(raw, parsed, "{body}");
        parsed
    }

    fn chat(messages: &[(&str, &str)]) -> Value {
        let messages: Vec<Value> = messages
            .iter()
            .map(|(role, content)| json!({"role": role, "content": content}))
            .collect();
        json!({"model": "m", "messages": messages})
    }

    fn hashes(body: &Value) -> Vec<u64> {
        hashed(body, &SMALL).unwrap().hashes().to_vec()
    }

    /// Blocks two hash chains share from the start.
    fn shared(a: &[u64], b: &[u64]) -> usize {
        a.iter().zip(b).take_while(|(a, b)| a == b).count()
    }

    fn long(seed: &str, bytes: usize) -> String {
        seed.repeat(bytes / seed.len() + 1)[..bytes].to_owned()
    }

    #[test]
    fn conversations_sharing_a_system_prompt_share_its_blocks() {
        let system = long("You are a careful assistant. ", 800); // 50 blocks
        let a = hashes(&chat(&[
            ("system", &system),
            ("user", "What is a KV cache?"),
        ]));
        let b = hashes(&chat(&[
            ("system", &system),
            ("user", "Explain paged attention."),
        ]));
        // The system message's blocks (markers and role included) are shared,
        // the user turns' differ.
        let common = shared(&a, &b);
        assert!(
            (49..=51).contains(&common),
            "{common} of {} {}",
            a.len(),
            b.len()
        );
        assert_ne!(a.last(), b.last());
        // A third conversation with its own system prompt shares nothing.
        let other = long("Answer in French, please. ", 800);
        let c = hashes(&chat(&[
            ("system", &other),
            ("user", "What is a KV cache?"),
        ]));
        assert_eq!(shared(&a, &c), 0);
    }

    #[test]
    fn a_different_later_message_keeps_the_leading_blocks() {
        let first = long("The first turn sets the scene at length. ", 640);
        let turn = |later: &str| {
            hashes(&chat(&[
                ("user", &first),
                ("assistant", "Understood."),
                ("user", later),
            ]))
        };
        let a = turn(&long("Now summarise it. ", 320));
        let b = turn(&long("Now translate it. ", 320));
        assert_eq!(a.len(), b.len());
        let common = shared(&a, &b);
        assert!(common >= 40, "{common}");
        assert!(common < a.len(), "the tails differ");
        // A longer conversation extends the shorter one's chain exactly.
        let short = hashes(&chat(&[("user", &first)]));
        assert_eq!(shared(&short, &a), short.len());
    }

    #[test]
    fn a_role_change_or_another_message_split_does_not_collide() {
        let text = long("abcdefghijklmnop", 256);
        let user = hashes(&chat(&[("user", &text)]));
        let system = hashes(&chat(&[("system", &text)]));
        assert_eq!(shared(&user, &system), 0);
        // The same text split into two messages, or into two parts of one.
        let (head, tail) = text.split_at(100);
        let split = hashes(&chat(&[("user", head), ("user", tail)]));
        let parts = hashes(&json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": head}, {"type": "text", "text": tail}]}]}));
        assert!(shared(&user, &split) < user.len());
        assert!(shared(&split, &parts) < split.len());
        // A plain prompt of the same text is yet another chain.
        let prompt = hashes(&json!({"prompt": text}));
        assert_eq!(shared(&prompt, &user), 0);
        // A string content and one text part are the same message.
        let one_part = hashes(&json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": text}]}]}));
        assert_eq!(one_part, user);
    }

    #[test]
    fn images_and_audio_add_nothing_and_alone_are_no_prompt() {
        let text = long("describe this picture in detail ", 200);
        let plain = hashes(&json!({"messages": [{"role": "user", "content": text}]}));
        let with_image = hashes(&json!({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            {"type": "text", "text": text},
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]}));
        assert_eq!(plain, with_image);
        let images_only = json!({"messages": [
            {"role": "system", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "y"}}]}]});
        assert_eq!(hashed(&images_only, &SMALL), Err(Unhashed::NoPrompt));
    }

    #[test]
    fn bodies_without_a_prompt_are_unknown_with_their_reason() {
        let cases = [
            (json!({}), Unhashed::NoPrompt),
            (json!({"model": "m", "messages": []}), Unhashed::NoPrompt),
            (json!({"messages": "hello"}), Unhashed::NoPrompt),
            (
                json!({"messages": [{"role": "user", "content": null}]}),
                Unhashed::NoPrompt,
            ),
            (
                json!({"messages": [{"role": "user"}, 5, "x"]}),
                Unhashed::NoPrompt,
            ),
            (json!({"prompt": 7}), Unhashed::NoPrompt),
            (
                json!({"prompt": [], "text": "ignored: prompt came first"}),
                Unhashed::NoPrompt,
            ),
            (
                json!({"prompt": [{"text": "not a prompt list"}]}),
                Unhashed::NoPrompt,
            ),
            (json!({"input_ids": []}), Unhashed::NoPrompt),
            (json!({"input_ids": [[]]}), Unhashed::NoPrompt),
            (json!({"prompt": ""}), Unhashed::ShorterThanOneBlock),
            (
                json!({"prompt": "fifteen bytes.."}),
                Unhashed::ShorterThanOneBlock,
            ),
            (
                json!({"input_ids": [1, 2, 3]}),
                Unhashed::ShorterThanOneBlock,
            ),
            (
                json!({"messages": [{"role": "user", "content": "hi"}]}),
                Unhashed::ShorterThanOneBlock,
            ),
        ];
        for (body, reason) in cases {
            assert_eq!(hashed(&body, &SMALL), Err(reason), "{body}");
        }
        let off = PrefixHashing {
            max_tokens: 0,
            ..SMALL
        };
        assert_eq!(
            hashed(&json!({"prompt": long("x", 100)}), &off),
            Err(Unhashed::Disabled)
        );
        let no_blocks = PrefixHashing {
            block_tokens: 0,
            ..SMALL
        };
        assert_eq!(
            hashed(&json!({"prompt": long("x", 100)}), &no_blocks),
            Err(Unhashed::Disabled)
        );
    }

    #[test]
    fn token_ids_out_of_range_are_unknown() {
        for ids in [
            json!([1, 2, -3, 4]),
            json!([1, 2, 3, 4.5]),
            json!([1, 2, 3, 4_294_967_296u64]),
            json!([1, 2, 3, 18_446_744_073_709_551_615u64]),
            json!([1, 2, "3", 4]),
            json!([1, 2, null, 4]),
            json!([1, [2], 3, 4]),
            json!([[1, 2, -3, 4], [5]]),
            json!("1 2 3 4"),
            json!({"ids": [1, 2, 3, 4]}),
        ] {
            let body = json!({"input_ids": ids});
            assert_eq!(
                hashed(&body, &SMALL),
                Err(Unhashed::InvalidTokenIds),
                "{body}"
            );
        }
        // Forms a parsed body reads as floats, which the raw reader sees as
        // written.
        for raw in [
            r#"{"input_ids": [1, 2, 3, -0]}"#,
            r#"{"input_ids": [1, 2, 3, 1e2]}"#,
            r#"{"input_ids": [1, 2, 3, 4.0]}"#,
            r#"{"input_ids": [1, 2, 3, 123456789012345678901234567890]}"#,
        ] {
            assert_eq!(
                from_raw(raw, &SMALL),
                Err(Unhashed::InvalidTokenIds),
                "{raw}"
            );
            let parsed: Value = serde_json::from_str(raw).unwrap();
            assert_eq!(
                hash_value(&parsed, &SMALL),
                Err(Unhashed::InvalidTokenIds),
                "{raw}"
            );
        }
        // The largest id is fine.
        let max = json!({"input_ids": [0, 1, 2, u32::MAX]});
        assert_eq!(hashed(&max, &SMALL).unwrap().hashes().len(), 1);
    }

    #[test]
    fn token_ids_hash_in_blocks_of_ids_and_a_batch_hashes_its_first() {
        let ids: Vec<u32> = (0..42).collect();
        let flat = hashed(&json!({"input_ids": ids}), &SMALL).unwrap();
        assert_eq!(flat.block_tokens(), 4);
        assert_eq!(flat.hashes().len(), 10, "only full blocks");
        let batch = hashed(&json!({"input_ids": [ids, [7, 7, 7, 7, 7]]}), &SMALL).unwrap();
        assert_eq!(batch, flat);
        // `prompt` as ids is the same prompt.
        assert_eq!(hashed(&json!({"prompt": ids}), &SMALL).unwrap(), flat);
        // Chained: a change in block 3 changes block 3 and every later one.
        let mut changed = ids.clone();
        changed[13] = 1000;
        let changed = hashed(&json!({"input_ids": changed}), &SMALL).unwrap();
        assert_eq!(shared(flat.hashes(), changed.hashes()), 3);
        assert!(
            flat.hashes()[3..]
                .iter()
                .zip(&changed.hashes()[3..])
                .all(|(a, b)| a != b)
        );
        // Ids past the bound are not read, so not checked either.
        let bounded = PrefixHashing {
            max_tokens: 8,
            ..SMALL
        };
        let tail_bad = json!({"input_ids": [1, 2, 3, 4, 5, 6, 7, 8, -9]});
        assert_eq!(hashed(&tail_bad, &bounded).unwrap().hashes().len(), 2);
    }

    #[test]
    fn unsigned_integer_lists_are_scanned_as_serde_reads_them() {
        // What `Value::as_u64` makes of each item, for the lists a
        // validated body can hold.
        let reference = |raw: &str, max: u64| -> Option<u64> {
            let items: Vec<Value> = serde_json::from_str(raw).ok()?;
            let mut count = 0;
            for item in items {
                // A number written with a fraction or exponent is not an id,
                // though `as_u64` may read it as one.
                let written = item.to_string();
                if !written.bytes().all(|b| b.is_ascii_digit()) {
                    return None;
                }
                item.as_u64().filter(|id| *id <= max)?;
                count += 1;
            }
            Some(count)
        };
        for raw in [
            "[]",
            "[ ]",
            "[0]",
            "[1,2,3]",
            "[ 1 ,\n\t2\r\n, 3 ]",
            "[4294967295, 0]",
            "[4294967296]",
            "[9999999999999999999]",
            "[18446744073709551615]",
            "[18446744073709551616]",
            "[123456789012345678901234567890]",
            "[1, -2]",
            "[-0]",
            "[1.5]",
            "[1e3]",
            "[1E3, 2]",
            "[1, [2]]",
            "[\"1\"]",
            "[1, null]",
            "[true]",
            "[{}]",
        ] {
            for max in [u64::from(u32::MAX), u64::MAX] {
                let mut seen = Vec::new();
                let scanned = scan_uint_list(raw.as_bytes(), 0, max, |id| {
                    seen.push(id);
                    true
                });
                assert_eq!(
                    scanned.map(|(count, _)| count),
                    reference(raw, max),
                    "{raw} up to {max}"
                );
                if let Some((count, end)) = scanned {
                    assert_eq!(end, raw.len(), "{raw}: the index after the list");
                    assert_eq!(seen.len() as u64, count);
                    let parsed: Vec<u64> = serde_json::from_str(raw).unwrap();
                    assert_eq!(seen, parsed, "{raw}");
                }
            }
        }
        // A list inside a body: the index after it; and a stop on request.
        let body = b"[[1, 22], [333]]";
        assert_eq!(scan_uint_list(body, 1, u64::MAX, |_| true), Some((2, 8)));
        assert_eq!(scan_uint_list(body, 10, u64::MAX, |_| true), Some((1, 15)));
        assert_eq!(scan_uint_list(body, 0, u64::MAX, |_| true), None);
        assert_eq!(
            scan_uint_list(b"[5, 6, 7]", 0, u64::MAX, |id| id < 6),
            Some((2, 5))
        );
    }

    #[test]
    fn an_id_list_read_whole_for_its_hash_is_counted_once() {
        let counted = |raw: &str, hashing: &PrefixHashing| {
            let fields: HashMap<String, Box<RawValue>> = serde_json::from_str(raw).unwrap();
            let get = |key: &str| fields.get(key).map(|raw| &**raw);
            let prompt = RawPrompt {
                input_ids: get("input_ids"),
                prompt: get("prompt"),
                text: get("text"),
            };
            hash_raw_counting(prompt, None, hashing).ids_counted
        };
        let bounded = PrefixHashing {
            max_tokens: 8,
            ..SMALL
        };
        for hashing in [&SMALL, &bounded] {
            assert_eq!(counted(r#"{"input_ids": [1, 2, 3]}"#, hashing), Some(3));
            assert_eq!(counted(r#"{"prompt": [1, 2, 3, 4, 5]}"#, hashing), Some(5));
            // A batch is counted whole by the estimate, not here.
            assert_eq!(counted(r#"{"input_ids": [[1, 2], [3]]}"#, hashing), None);
            for not_counted in [
                r#"{"input_ids": []}"#,
                r#"{"input_ids": [1, -2]}"#,
                r#"{"input_ids": [4294967296, 1]}"#,
                r#"{"input_ids": "1 2"}"#,
                r#"{"prompt": "text"}"#,
            ] {
                assert_eq!(counted(not_counted, hashing), None, "{not_counted}");
            }
        }
        // Past a full chain the ids are still counted, though not hashed.
        let long = r#"{"input_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 4294967296]}"#;
        assert_eq!(counted(long, &bounded), Some(12));
        assert_eq!(from_raw(long, &bounded).unwrap().hashes().len(), 2);
        assert_eq!(counted(long, &SMALL), None);
        // An item past a full chain that is no id leaves the hash as it was
        // and the count to the estimate.
        let tail_bad = r#"{"input_ids": [1, 2, 3, 4, 5, 6, 7, 8, -9]}"#;
        assert_eq!(counted(tail_bad, &bounded), None);
        assert_eq!(from_raw(tail_bad, &bounded).unwrap().hashes().len(), 2);
    }

    #[test]
    fn escapes_are_decoded_so_any_spelling_hashes_alike() {
        let text = "caf\u{e9} \u{1f600} \"quoted\" back\\slash / tab\tnew\nline \u{0} end of it";
        let canonical = hashes(&json!({"prompt": text}));
        assert!(canonical.len() >= 3);
        let spelled = concat!(
            r#"{"prompt": "caf\u00e9 \ud83d\ude00 \"quoted\" back\\slash \/ "#,
            r#"tab\u0009new\u000aline \u0000 end \u006ff it"}"#
        );
        assert_eq!(from_raw(spelled, &SMALL).unwrap().hashes(), canonical);
        // In chat messages and roles too.
        let chat_body = json!({"messages": [{"role": "us\u{e9}r", "content": [{"type": "text", "text": text}]}]});
        let spelled = concat!(
            r#"{"messages": [{"role": "us\u00e9r", "content": [{"type": "text", "text": "#,
            r#""caf\u00e9 \ud83d\ude00 \"quoted\" back\\slash \/ tab\tnew\nline \u0000 end of it"}]}]}"#
        );
        assert_eq!(from_raw(spelled, &SMALL), hashed(&chat_body, &SMALL));
        // A lone surrogate (a parsed body refuses it) is U+FFFD.
        assert_eq!(
            from_raw(r#"{"prompt": "\ud800 and some more text here"}"#, &SMALL),
            hashed(
                &json!({"prompt": "\u{fffd} and some more text here"}),
                &SMALL
            )
        );
    }

    #[test]
    fn a_huge_prompt_hashes_no_more_than_the_bound() {
        let hashing = PrefixHashing {
            block_tokens: 64,
            max_tokens: 32_768,
            chars_per_token: 4.0,
        };
        let ten_mb = 10 * 1024 * 1024;
        // Plain text, text with an escape every few bytes, and a chat.
        let plain = long("lorem ipsum dolor sit amet ", ten_mb);
        let escaped = long("line\n\"q\"\t", ten_mb);
        for body in [
            json!({"prompt": plain}),
            json!({"text": [escaped]}),
            json!({"messages": [{"role": "system", "content": plain}, {"role": "user", "content": escaped}]}),
        ] {
            let blocks = hashed(&body, &hashing).unwrap();
            assert_eq!(blocks.hashes().len(), 32_768 / 64);
            assert_eq!(blocks.tokens_in(usize::MAX), 32_768);
        }
        // Ten million token ids.
        let ids: Vec<u32> = (0..10_000_000).collect();
        let blocks = hashed(&json!({"input_ids": ids}), &hashing).unwrap();
        assert_eq!(blocks.hashes().len(), 512);
        // Many small messages are hashed up to the bound too.
        let many: Vec<Value> = (0..100_000)
            .map(|i| json!({"role": "user", "content": format!("message {i}")}))
            .collect();
        let blocks = hashed(&json!({"messages": many}), &hashing).unwrap();
        assert_eq!(blocks.hashes().len(), 512);
    }

    #[test]
    fn text_blocks_are_block_tokens_times_chars_per_token_bytes() {
        let text = long("0123456789", 100);
        let at = |block_tokens: u32, chars_per_token: f64| {
            let hashing = PrefixHashing {
                block_tokens,
                max_tokens: 1 << 20,
                chars_per_token,
            };
            hashed(&json!({"prompt": text}), &hashing)
                .map(|blocks| blocks.hashes().len())
                .unwrap_or(0)
        };
        assert_eq!(at(4, 4.0), 6); // 16-byte blocks
        assert_eq!(at(4, 2.5), 10); // 10-byte blocks
        assert_eq!(at(3, 0.1), 100); // rounds up to 1 byte
        assert_eq!(at(1, f64::NAN), 100); // an unvalidated ratio degrades to 1 byte
        assert_eq!(at(64, 1e12), 0); // clamped to 1 MiB: no full block
    }

    #[test]
    fn a_strings_characters_are_counted_as_serde_json_decodes_them() {
        let decoded = |raw: &str| {
            serde_json::from_str::<std::borrow::Cow<'_, str>>(raw)
                .ok()
                .map(|text| text.chars().count())
        };
        let mut raws: Vec<String> = [
            r#""""#,
            r#""plain ascii""#,
            r#""caf\u00e9 and café""#,
            r#""\ud83d\ude00 and 😀""#,
            r#""quotes \" and \\ and \/ \b\f\n\r\t""#,
            r#""\u0000\u001f""#,
            // Lone surrogates: serde_json refuses them, and so does the count.
            r#""\ud83d""#,
            r#""a\ud83d b""#,
            r#""\ud83d\u0041""#,
            r#""\ude00""#,
            r#""\ud83d\n""#,
            // Not strings.
            "7",
            "[\"a\"]",
            "null",
        ]
        .iter()
        .map(|raw| (*raw).to_owned())
        .collect();
        // Every character below 0x800 and a sample above, escaped by serde_json
        // where it must be, and each also as a \u escape.
        for code in (0..0x800).chain((0x800..0x11_0000).step_by(997)) {
            let Some(c) = char::from_u32(code) else {
                continue;
            };
            let literal = serde_json::to_string(&format!("x{c}y")).unwrap();
            let mut units = [0u16; 2];
            let escaped: String = c
                .encode_utf16(&mut units)
                .iter()
                .map(|unit| format!("\\u{unit:04x}"))
                .collect();
            raws.push(literal);
            raws.push(format!("\"x{escaped}y\""));
        }
        for raw in &raws {
            assert_eq!(json_str_chars(raw), decoded(raw), "{raw}");
        }
    }

    #[test]
    fn a_hashed_chat_is_counted_in_the_same_pass() {
        // Escaped in the body: quotes, backslashes, a newline.
        let text = long("a \"quoted\" \\ line\n", 300);
        let body = json!({"messages": [
            {"role": "system", "content": text},
            {"role": "user", "content": [{"type": "text", "text": "abc"}, {"type": "image_url"}, "de", {"text": 5}]},
            "not a message",
            {"role": "assistant"},
        ]});
        let raw: HashMap<String, Box<RawValue>> =
            serde_json::from_str(&serde_json::to_string(&body).unwrap()).unwrap();
        let messages = &*raw["messages"];
        let prompt = RawPrompt::default();
        let want = MessageText {
            chars: 300 + 3 + 2,
            any: true,
        };
        // Hashed and counted in one read; off, the count reads the same.
        let chat = read_chat(messages, &SMALL).unwrap();
        assert_eq!(chat.text(), want);
        assert!(hash_raw(prompt, Some(chat), &SMALL).is_ok());
        // Only the first blocks are hashed, but every message is counted.
        let short = PrefixHashing {
            max_tokens: 8,
            ..SMALL
        };
        let chat = read_chat(messages, &short).unwrap();
        assert_eq!(chat.text(), want);
        let hashed = hash_raw(prompt, Some(chat), &short);
        assert_eq!(hashed.map(|blocks| blocks.hashes().len()), Ok(2));
        let off = PrefixHashing {
            max_tokens: 0,
            ..SMALL
        };
        let chat = read_chat(messages, &off).unwrap();
        assert_eq!(chat.text(), want);
        assert_eq!(hash_raw(prompt, Some(chat), &off), Err(Unhashed::Disabled));
        // A chat with no text part at all.
        let images: Box<RawValue> =
            serde_json::from_str(r#"[{"role": "user", "content": [{"type": "image_url"}]}]"#)
                .unwrap();
        let chat = read_chat(&images, &SMALL).unwrap();
        assert_eq!(chat.text(), MessageText::default());
        assert_eq!(
            hash_raw(prompt, Some(chat), &SMALL),
            Err(Unhashed::NoPrompt)
        );
        // `null` reads as no messages; any other value as a chat with no text.
        let null: Box<RawValue> = serde_json::from_str("null").unwrap();
        assert!(read_chat(&null, &SMALL).is_none());
        for other in [r#""hi""#, "7", "-1.5", "true", r#"{"role": "user"}"#] {
            let other: Box<RawValue> = serde_json::from_str(other).unwrap();
            let chat = read_chat(&other, &SMALL).unwrap();
            assert_eq!(chat.text(), MessageText::default(), "{other}");
            assert_eq!(
                hash_raw(prompt, Some(chat), &SMALL),
                Err(Unhashed::NoPrompt)
            );
        }
    }

    #[test]
    fn an_id_prompt_given_directly_chains_as_its_body_does() {
        let ids: Vec<u32> = (0..42).map(|i| i * 7_919).collect();
        let body = hashed(&json!({"input_ids": ids}), &SMALL).unwrap();
        let mut chain = Vec::new();
        extend_token_id_chain(&mut chain, ids.iter().copied(), SMALL.block_tokens);
        assert_eq!(body.hashes(), &chain[..]);
        // Extended a turn at a time from a block boundary: the same chain.
        let mut extended = Vec::new();
        extend_token_id_chain(&mut extended, ids[..12].iter().copied(), 4);
        assert_eq!(extended.len(), 3);
        extend_token_id_chain(&mut extended, ids[12..].iter().copied(), 4);
        assert_eq!(extended, chain);
        // A zero block size hashes nothing, as hashing off does.
        let mut off = Vec::new();
        extend_token_id_chain(&mut off, ids.iter().copied(), 0);
        assert!(off.is_empty());
    }
}
