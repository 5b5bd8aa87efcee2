//! The messages replicas exchange: compact, versioned JSON, on three
//! subjects under `sync.subject_prefix`.
//!
//! # Pending work (`<prefix>.pending`)
//!
//! ```json
//! {"v":1,"replica":"router-a","seq":1718000000000042,"full":false,
//!  "pending":[["http://10.0.0.1:30000",1200,3],["http://10.0.0.2:30000",0,0]]}
//! ```
//!
//! - `v`: the format version; a router ignores (and counts) any other.
//! - `replica`: the sender's id; a router ignores its own.
//! - `seq`: grows by one per message of one replica. It starts at the
//!   replica's start time in microseconds since the Unix epoch, so a
//!   restarted replica's messages are newer than its previous life's.
//! - `full`: `true` when `pending` lists every worker the sender has (sent
//!   every `entry_ttl_ms / 4` and after the broker comes back); `false` when
//!   it lists only the workers whose pending work changed.
//! - `pending`: `[worker_url, pending_tokens, pending_requests]` per worker:
//!   the sender's state, not a delta, so a lost or repeated message is
//!   corrected by the next one.
//! - `first_tokens` (optional): `[worker_url, tokens, foreign_ahead_tokens,
//!   waited_us, ago_us]` per first token the sender had from a worker
//!   since its last message, for the receivers to learn the worker's
//!   prefill rate from ([`policy_core::PrefillSample`]): the request's
//!   `tokens` of prompt work, the `foreign_ahead_tokens` no router replica
//!   sent that were ahead of it at dispatch, `waited_us` microseconds from
//!   its dispatch to its first token, which came `ago_us` microseconds
//!   before the message was written. Events, not state: each is learned
//!   once, and a lost one is a first token fewer. At most
//!   [`MAX_PREFILL_SAMPLES`] per message. (Version 1 senders before this
//!   key sent `prefill` samples instead, which a receiver ignores as an
//!   unknown key: during a rolling upgrade each replica learns from its
//!   own first tokens.)
//!
//! - `room` (optional): the sender's admission room, as it stands when the
//!   message is sent, so that router replicas take turns at the fleet's
//!   room ([`admission::RoomReport`]): `{"oldest_wait_ms":1520,
//!   "prefill_busy_workers":3.2,"waiting_for":[["http://10.0.0.1:30000",240]],
//!   "queued_requests":17}`.
//!   `oldest_wait_ms`: how long its oldest waiting request has waited
//!   (absent while none waits); `prefill_busy_workers`: how many workers
//!   the prompts it sent lately keep computing; `waiting_for`:
//!   `[worker_url, waited_ms]`, the busy worker the head of its order
//!   waits for, and for how long; `queued_requests` (0 when absent): how
//!   many requests wait in it, which `admission.max_queue_requests` counts
//!   with the receiver's own. A sender with admission on carries it in
//!   every message, and sends one every tick while a request waits in its
//!   room (and one more after the room empties). At most
//!   [`MAX_ROOM_WAITING_FOR`] workers; waits up to [`MAX_ROOM_WAIT_MS`];
//!   up to [`MAX_ROOM_QUEUED_REQUESTS`] queued.
//!
//! Unknown top-level keys are ignored, so a later version 1 sender may add
//! some. Every value is checked: a message that is not this shape is
//! rejected whole; an entry with a bad URL or a count that is negative,
//! fractional or beyond [`MAX_PENDING_TOKENS`] / [`MAX_PENDING_REQUESTS`] is
//! dropped alone, and so is a first token with more tokens than
//! [`MAX_PENDING_TOKENS`] or a time over [`MAX_PREFILL_MICROS`], and a
//! `room` that is not this shape or out of these bounds.
//!
//! # Prefix placements and cache bounds (`<prefix>.prefix`)
//!
//! ```json
//! {"v":1,"replica":"router-a","seq":1718000000000007,
//!  "workers":["http://10.0.0.1:30000","http://10.0.0.2:30000"],
//!  "placed":[[0,256,[1311768467294899695,81985529216486895]],[1,256,[42]]],
//!  "bounds":[[1,120000]]}
//! ```
//!
//! - `v`, `replica`: as above. `seq` grows by one per message of one
//!   replica (its own count, not the pending subject's); it orders nothing,
//!   as placements are events, not state, and serves to trace a message.
//! - `workers`: the worker URLs the entries name by index, each once.
//! - `placed`: `[worker_index, block_tokens, [hash, ...]]`: the sender
//!   dispatched a prompt with these leading blocks (chained hashes of
//!   `block_tokens` tokens each, first block first, JSON integers up to
//!   2^64 − 1) to the worker. At most [`MAX_PLACED_HASHES`] hashes; a longer
//!   prompt's placement is cut to its leading blocks, which is still a
//!   placement of them.
//! - `bounds`: `[worker_index, cache_tokens]`: the prefix-cache bound the
//!   sender learned from the worker's reported hits; state, so the latest
//!   heard replaces the one before.
//!
//! Each message is at most [`MAX_MESSAGE_BYTES`]; more placements than fit
//! go out in several. A payload over it, not this shape, of another
//! version or with a bad replica id is rejected whole; an entry whose
//! index names no valid worker URL, whose `block_tokens` is 0 or above
//! [`MAX_BLOCK_TOKENS`], whose hash list is empty, longer than
//! [`MAX_PLACED_HASHES`] or holds anything but integers, or whose bound is
//! above [`MAX_PENDING_TOKENS`], is dropped alone.
//!
//! # Prefix snapshots (`<prefix>.snapshot`)
//!
//! A starting replica publishes `{"v":1,"replica":"router-c"}` with a reply
//! subject; a running replica answers there with its prefix index in parts
//! of at most [`MAX_MESSAGE_BYTES`], each loadable on its own:
//!
//! ```json
//! {"v":1,"replica":"router-a","part":0,"last":false,"block_tokens":256,
//!  "workers":[["http://10.0.0.1:30000",5120000,0],["http://10.0.0.2:30000",4800000,120000]],
//!  "blocks":[[1311768467294899695,1500,[[0,20480],[1,256]]],[42,90000,[[1,0]]]]}
//! ```
//!
//! - `part`: 0, 1, …; `last`: `true` on the final part.
//! - `workers`: every worker, in every part: `[url, clock_tokens,
//!   cache_tokens]` (the worker's token clock and learned bound, 0 when
//!   none; see [`policy_core::SnapshotWorker`]).
//! - `blocks`: `[hash, age_ms, [[worker_index, age_tokens], ...]]` (see
//!   [`policy_core::SnapshotBlock`]), at most [`MAX_SNAPSHOT_HOLDERS`]
//!   holders each.
//!
//! A part that is not this shape (a worker entry included) is rejected
//! whole; a block whose holder names no worker, or with no holder or too
//! many, is dropped alone.
//!
//! The few items marked `pub` here (the rest are `pub(super)` or narrower)
//! are what the benchmarks reach through `crate::bench_internals`.

use std::time::Duration;

use policy_core::{PrefillSample, PrefixBlocks, PrefixSnapshot, SnapshotBlock, SnapshotWorker};
use serde::de::{IgnoredAny, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::value::RawValue;

use crate::config::is_valid_replica_id;

/// The version this router speaks.
pub(super) const WIRE_VERSION: u64 = 1;
/// More pending tokens than this on one worker is not a real count.
pub(super) const MAX_PENDING_TOKENS: u64 = 1 << 40;
/// More pending requests than this on one worker is not a real count.
pub(super) const MAX_PENDING_REQUESTS: u64 = 1 << 24;
/// Longest worker URL accepted.
pub(super) const MAX_URL_BYTES: usize = 2048;
/// The largest prefix or snapshot message, written or read: a quarter of
/// NATS's default payload limit (1 MiB), so one message never holds the
/// connection long.
pub const MAX_MESSAGE_BYTES: usize = 256 * 1024;
/// Most hashes in one placement: 1 Mi tokens at 256-token blocks, about
/// 84 KB, so one placement always fits a message.
pub(super) const MAX_PLACED_HASHES: usize = 4096;
/// Largest block size accepted, tokens.
pub(super) const MAX_BLOCK_TOKENS: u64 = 1 << 20;
/// Most holders of one snapshot block.
pub(super) const MAX_SNAPSHOT_HOLDERS: usize = 16;
/// Most first tokens in one pending message; more are read through and
/// dropped, as they are when a sender queues more between two ticks.
pub(super) const MAX_PREFILL_SAMPLES: usize = 1024;
/// A first token an hour after its dispatch, or heard an hour after it
/// came, measures no prefill.
pub(super) const MAX_PREFILL_MICROS: u64 = 3_600_000_000;
/// Longest wait a room reports: a day.
pub(super) const MAX_ROOM_WAIT_MS: u64 = 86_400_000;
/// Most workers one room reports waiting for.
pub(super) const MAX_ROOM_WAITING_FOR: usize = 64;
/// More requests queued in one room than this is not a real count.
pub(super) const MAX_ROOM_QUEUED_REQUESTS: u64 = 100_000_000;
/// More workers kept busy than this is not a real count.
const MAX_ROOM_BUSY_WORKERS: f64 = 1e6;

/// Why a whole message was ignored.
#[derive(Debug, thiserror::Error)]
pub(super) enum WireError {
    #[error("not a message of this subject's shape")]
    Malformed(#[source] serde_json::Error),
    #[error("invalid message: {0}")]
    Invalid(&'static str),
    #[error("unsupported message version {0} (this router speaks {WIRE_VERSION})")]
    Version(u64),
    #[error("invalid replica id {0:?}")]
    Replica(String),
    #[error("a {0}-byte message (at most {MAX_MESSAGE_BYTES} are read)")]
    Oversize(usize),
}

impl WireError {
    /// The `outcome` label of `router_sync_messages_received_total` and
    /// its kin.
    pub(super) fn outcome(&self) -> &'static str {
        match self {
            WireError::Malformed(_) | WireError::Invalid(_) => "malformed",
            WireError::Version(_) => "foreign_version",
            WireError::Replica(_) => "invalid_replica",
            WireError::Oversize(_) => "oversize",
        }
    }
}

/// Checks the version and the replica id every message carries.
fn check_sender(v: u64, replica: &str) -> Result<(), WireError> {
    if v != WIRE_VERSION {
        return Err(WireError::Version(v));
    }
    if !is_valid_replica_id(replica) {
        return Err(WireError::Replica(replica.chars().take(200).collect()));
    }
    Ok(())
}

/// Refuses a payload over [`MAX_MESSAGE_BYTES`] before parsing it.
fn check_size(payload: &[u8]) -> Result<(), WireError> {
    if payload.len() > MAX_MESSAGE_BYTES {
        return Err(WireError::Oversize(payload.len()));
    }
    Ok(())
}

fn is_valid_url(url: &str) -> bool {
    !url.is_empty() && url.len() <= MAX_URL_BYTES
}

/// Why one entry of a message was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(super) enum EntryError {
    #[error("an entry is not [worker_url, pending_tokens, pending_requests]")]
    Shape,
    #[error("an entry's worker URL is empty or longer than {MAX_URL_BYTES} bytes")]
    Url,
    #[error("an entry's count is out of range (see the limits of its message)")]
    Count,
    #[error("an entry names a worker index the message does not list")]
    Worker,
}

/// One worker's pending work in a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Entry<'a> {
    pub(super) worker_url: &'a str,
    pub(super) pending_tokens: u64,
    pub(super) pending_requests: u64,
}

/// A message that passed the message-level checks; its entries are checked
/// one by one as they are read ([`Message::entries`]).
#[derive(Debug)]
pub(super) struct Message<'a> {
    pub(super) replica: &'a str,
    pub(super) seq: u64,
    /// Read by the tests only: a receiver applies a full state and a
    /// change alike.
    #[cfg(test)]
    pub(super) full: bool,
    pending: Vec<&'a RawValue>,
    prefill: Vec<&'a RawValue>,
    room: Option<&'a RawValue>,
}

/// A sender's admission room, as a message carries it (see the module's
/// docs): waits relative to when it was sent.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub(super) struct Room {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) oldest_wait_ms: Option<u64>,
    pub(super) prefill_busy_workers: f64,
    #[serde(default)]
    pub(super) waiting_for: Vec<(String, u64)>,
    #[serde(default)]
    pub(super) queued_requests: u64,
}

impl Room {
    fn check(&self) -> Result<(), EntryError> {
        let busy = self.prefill_busy_workers;
        if !(busy.is_finite() && (0.0..=MAX_ROOM_BUSY_WORKERS).contains(&busy))
            || self.oldest_wait_ms.is_some_and(|ms| ms > MAX_ROOM_WAIT_MS)
            || self.waiting_for.len() > MAX_ROOM_WAITING_FOR
            || self.queued_requests > MAX_ROOM_QUEUED_REQUESTS
            || self
                .waiting_for
                .iter()
                .any(|(_, ms)| *ms > MAX_ROOM_WAIT_MS)
        {
            return Err(EntryError::Count);
        }
        if self.waiting_for.iter().any(|(url, _)| !is_valid_url(url)) {
            return Err(EntryError::Url);
        }
        Ok(())
    }
}

#[derive(Deserialize)]
struct Wire<'a> {
    v: u64,
    #[serde(borrow)]
    replica: &'a str,
    seq: u64,
    /// Required and type-checked; a receiver applies a full state and a
    /// change alike.
    #[serde(rename = "full")]
    _full: bool,
    #[serde(borrow)]
    pending: Vec<&'a RawValue>,
    #[serde(borrow, default)]
    first_tokens: Vec<&'a RawValue>,
    #[serde(borrow, default)]
    room: Option<&'a RawValue>,
}

/// One first token in a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct PrefillEntry<'a> {
    pub(super) worker_url: &'a str,
    pub(super) sample: PrefillSample,
    /// How long before the message was written the first token came.
    pub(super) ago: Duration,
}

/// Reads a message. The strings borrow from `payload`, so JSON escapes in a
/// replica id or URL (which no valid sender writes) make it malformed.
pub(super) fn decode(payload: &[u8]) -> Result<Message<'_>, WireError> {
    let wire: Wire<'_> = serde_json::from_slice(payload).map_err(WireError::Malformed)?;
    check_sender(wire.v, wire.replica)?;
    Ok(Message {
        replica: wire.replica,
        seq: wire.seq,
        #[cfg(test)]
        full: wire._full,
        pending: wire.pending,
        prefill: wire.first_tokens,
        room: wire.room,
    })
}

impl<'a> Message<'a> {
    /// Every entry, each checked on its own.
    pub(super) fn entries(&self) -> impl Iterator<Item = Result<Entry<'a>, EntryError>> + '_ {
        self.pending.iter().map(|raw| parse_entry(raw.get()))
    }

    /// The sender's admission room: `None` when the message has none,
    /// an error when it is not the documented shape or out of bounds.
    pub(super) fn room(&self) -> Option<Result<Room, EntryError>> {
        let raw = self.room?;
        Some(
            serde_json::from_str::<Room>(raw.get())
                .map_err(|_| EntryError::Shape)
                .and_then(|room| room.check().map(|()| room)),
        )
    }

    /// Every first token, each checked on its own; past
    /// [`MAX_PREFILL_SAMPLES`], each is [`EntryError::Count`].
    pub(super) fn prefill_samples(
        &self,
    ) -> impl Iterator<Item = Result<PrefillEntry<'a>, EntryError>> + '_ {
        self.prefill.iter().enumerate().map(|(position, raw)| {
            if position >= MAX_PREFILL_SAMPLES {
                return Err(EntryError::Count);
            }
            parse_prefill(raw.get())
        })
    }
}

fn parse_prefill(text: &str) -> Result<PrefillEntry<'_>, EntryError> {
    type Raw<'t> = (
        &'t str,
        serde_json::Number,
        serde_json::Number,
        serde_json::Number,
        serde_json::Number,
    );
    let (worker_url, tokens, foreign_ahead_tokens, waited_us, ago_us): Raw<'_> =
        serde_json::from_str(text).map_err(|_| EntryError::Shape)?;
    if !is_valid_url(worker_url) {
        return Err(EntryError::Url);
    }
    let tokens_at_most = |number: &serde_json::Number| {
        number
            .as_u64()
            .filter(|tokens| *tokens <= MAX_PENDING_TOKENS)
            .ok_or(EntryError::Count)
    };
    let micros = |number: &serde_json::Number| {
        number
            .as_u64()
            .filter(|micros| *micros <= MAX_PREFILL_MICROS)
            .map(Duration::from_micros)
            .ok_or(EntryError::Count)
    };
    Ok(PrefillEntry {
        worker_url,
        sample: PrefillSample {
            tokens: tokens_at_most(&tokens)?,
            foreign_ahead_tokens: tokens_at_most(&foreign_ahead_tokens)?,
            waited: micros(&waited_us)?,
        },
        ago: micros(&ago_us)?,
    })
}

fn parse_entry(text: &str) -> Result<Entry<'_>, EntryError> {
    let (worker_url, tokens, requests): (&str, serde_json::Number, serde_json::Number) =
        serde_json::from_str(text).map_err(|_| EntryError::Shape)?;
    if !is_valid_url(worker_url) {
        return Err(EntryError::Url);
    }
    let count = |number: &serde_json::Number, max: u64| {
        number
            .as_u64()
            .filter(|count| *count <= max)
            .ok_or(EntryError::Count)
    };
    Ok(Entry {
        worker_url,
        pending_tokens: count(&tokens, MAX_PENDING_TOKENS)?,
        pending_requests: count(&requests, MAX_PENDING_REQUESTS)?,
    })
}

#[derive(Serialize)]
struct WireOut<'a> {
    v: u64,
    replica: &'a str,
    seq: u64,
    full: bool,
    pending: &'a [(&'a str, u64, u64)],
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    first_tokens: &'a [FirstTokenOut<'a>],
    #[serde(skip_serializing_if = "Option::is_none")]
    room: Option<&'a Room>,
}

/// One first token as written: `(worker_url, tokens, foreign_ahead_tokens,
/// waited_us, ago_us)`.
pub(super) type FirstTokenOut<'a> = (&'a str, u64, u64, u64, u64);

/// Writes a message: `pending` is `(worker_url, tokens, requests)`,
/// `prefill` the first tokens (at most [`MAX_PREFILL_SAMPLES`] are
/// written), `room` the sender's admission room, if it has one.
pub(super) fn encode(
    replica: &str,
    seq: u64,
    full: bool,
    pending: &[(&str, u64, u64)],
    prefill: &[FirstTokenOut<'_>],
    room: Option<&Room>,
) -> Vec<u8> {
    let message = WireOut {
        v: WIRE_VERSION,
        replica,
        seq,
        full,
        pending,
        first_tokens: &prefill[..prefill.len().min(MAX_PREFILL_SAMPLES)],
        room,
    };
    // Serializing strings and integers into memory cannot fail.
    serde_json::to_vec(&message).unwrap_or_default()
}

/// Appends `value` as decimal digits.
fn push_u64(out: &mut Vec<u8>, value: u64) {
    out.extend_from_slice(itoa::Buffer::new().format(value).as_bytes());
}

/// Appends `text` as a JSON string.
fn push_str(out: &mut Vec<u8>, text: &str) {
    // Writing a string into memory cannot fail.
    let _ = serde_json::to_writer(&mut *out, text);
}

/// Bytes of a JSON string's encoding.
fn str_len(text: &str) -> usize {
    let mut out = Vec::with_capacity(text.len() + 2);
    push_str(&mut out, text);
    out.len()
}

/// One placement to publish: the worker's URL (its
/// [`policy_core::worker_url_key`]) and the prompt's leading blocks.
#[derive(Debug, Clone, Copy)]
pub struct Placement<'a> {
    pub worker_url: &'a str,
    pub prefix: &'a PrefixBlocks,
}

/// One learned cache bound to publish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bound<'a> {
    pub worker_url: &'a str,
    pub cache_tokens: u64,
}

/// The messages [`encode_prefix`] wrote, and what went into them.
#[derive(Debug, Default)]
pub struct PrefixEncoded {
    pub messages: Vec<Vec<u8>>,
    pub(super) placements: usize,
    pub(super) bounds: usize,
    /// Entries left out: empty, or too large for a message alone (neither
    /// happens with placements from a policy and URLs from config).
    pub(super) skipped: usize,
}

/// The worst case of a prefix message's envelope, beyond the replica id:
/// `{"v":1,"replica":,"seq":<20 digits>,"workers":[],"placed":[],"bounds":[]}`.
const PREFIX_ENVELOPE_BYTES: usize = 96;

/// One prefix message being filled.
#[derive(Debug, Default)]
struct PrefixBuilder<'a> {
    workers: Vec<&'a str>,
    index: std::collections::HashMap<&'a str, usize>,
    workers_bytes: usize,
    placed: Vec<u8>,
    bounds: Vec<u8>,
}

impl<'a> PrefixBuilder<'a> {
    fn is_empty(&self) -> bool {
        self.placed.is_empty() && self.bounds.is_empty()
    }

    fn size(&self, envelope: usize) -> usize {
        envelope + self.workers_bytes + self.placed.len() + self.bounds.len()
    }

    /// The index `url` has (or would get) here, and the bytes listing it
    /// would add.
    fn index_of(&self, url: &str) -> (usize, usize) {
        match self.index.get(url) {
            Some(index) => (*index, 0),
            None => (self.workers.len(), str_len(url) + 1),
        }
    }

    /// Adds an encoded entry (`bounds` or `placed`) naming `url`.
    fn add(&mut self, url: &'a str, url_bytes: usize, entry: &[u8], bound: bool) {
        if url_bytes > 0 {
            self.index.insert(url, self.workers.len());
            self.workers.push(url);
            self.workers_bytes += url_bytes;
        }
        let list = if bound {
            &mut self.bounds
        } else {
            &mut self.placed
        };
        if !list.is_empty() {
            list.push(b',');
        }
        list.extend_from_slice(entry);
    }

    fn finish(&mut self, replica: &str, seq: u64) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.size(PREFIX_ENVELOPE_BYTES + replica.len()));
        out.extend_from_slice(b"{\"v\":");
        push_u64(&mut out, WIRE_VERSION);
        out.extend_from_slice(b",\"replica\":");
        push_str(&mut out, replica);
        out.extend_from_slice(b",\"seq\":");
        push_u64(&mut out, seq);
        out.extend_from_slice(b",\"workers\":[");
        for (position, url) in self.workers.iter().enumerate() {
            if position > 0 {
                out.push(b',');
            }
            push_str(&mut out, url);
        }
        out.extend_from_slice(b"],\"placed\":[");
        out.extend_from_slice(&self.placed);
        out.extend_from_slice(b"],\"bounds\":[");
        out.extend_from_slice(&self.bounds);
        out.extend_from_slice(b"]}");
        *self = PrefixBuilder::default();
        out
    }
}

/// Writes `placed` and `bounds` as prefix messages of at most `max_bytes`
/// each (in order, as many as they need), numbered from `*seq` on.
pub fn encode_prefix(
    replica: &str,
    seq: &mut u64,
    placed: &[Placement<'_>],
    bounds: &[Bound<'_>],
    max_bytes: usize,
) -> PrefixEncoded {
    let envelope = PREFIX_ENVELOPE_BYTES + str_len(replica);
    let mut encoded = PrefixEncoded::default();
    let mut builder = PrefixBuilder::default();
    let mut entry = Vec::new();
    let placements = placed
        .iter()
        .map(|placement| (placement.worker_url, Some(placement.prefix), 0));
    let bounds = bounds
        .iter()
        .map(|bound| (bound.worker_url, None, bound.cache_tokens));
    for (url, prefix, cache_tokens) in placements.chain(bounds) {
        if prefix.is_some_and(|prefix| prefix.is_empty()) {
            encoded.skipped += 1;
            continue;
        }
        loop {
            let (index, url_bytes) = builder.index_of(url);
            entry.clear();
            entry.push(b'[');
            push_u64(&mut entry, index as u64);
            entry.push(b',');
            match prefix {
                Some(prefix) => {
                    push_u64(&mut entry, u64::from(prefix.block_tokens()));
                    entry.extend_from_slice(b",[");
                    let hashes = prefix.hashes();
                    for (position, hash) in hashes[..hashes.len().min(MAX_PLACED_HASHES)]
                        .iter()
                        .enumerate()
                    {
                        if position > 0 {
                            entry.push(b',');
                        }
                        push_u64(&mut entry, *hash);
                    }
                    entry.push(b']');
                }
                None => push_u64(&mut entry, cache_tokens),
            }
            entry.push(b']');
            if builder.size(envelope) + url_bytes + entry.len() + 1 > max_bytes {
                if builder.is_empty() {
                    encoded.skipped += 1;
                    break;
                }
                encoded.messages.push(builder.finish(replica, *seq));
                *seq = seq.wrapping_add(1);
                continue;
            }
            builder.add(url, url_bytes, &entry, prefix.is_none());
            if prefix.is_some() {
                encoded.placements += 1;
            } else {
                encoded.bounds += 1;
            }
            break;
        }
    }
    if !builder.is_empty() {
        encoded.messages.push(builder.finish(replica, *seq));
        *seq = seq.wrapping_add(1);
    }
    encoded
}

/// A prefix message that passed the message-level checks; its entries are
/// checked one by one as they are read.
#[derive(Debug)]
pub(super) struct PrefixMessage<'a> {
    pub(super) replica: &'a str,
    /// Read by the tests only: placements need no order.
    #[cfg(test)]
    pub(super) seq: u64,
    workers: Vec<&'a str>,
    placed: Vec<&'a RawValue>,
    bounds: Vec<&'a RawValue>,
}

#[derive(Deserialize)]
struct PrefixWire<'a> {
    v: u64,
    #[serde(borrow)]
    replica: &'a str,
    /// Required and type-checked; placements need no order.
    #[serde(rename = "seq")]
    _seq: u64,
    #[serde(borrow)]
    workers: Vec<&'a str>,
    #[serde(borrow, default)]
    placed: Vec<&'a RawValue>,
    #[serde(borrow, default)]
    bounds: Vec<&'a RawValue>,
}

/// One placement read from a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct PlacedEntry<'a> {
    pub(super) worker_url: &'a str,
    pub(super) prefix: PrefixBlocks,
}

/// One cache bound read from a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct BoundEntry<'a> {
    pub(super) worker_url: &'a str,
    pub(super) cache_tokens: u64,
}

/// Reads a prefix message (strings borrow from `payload`, as in [`decode`]).
pub(super) fn decode_prefix(payload: &[u8]) -> Result<PrefixMessage<'_>, WireError> {
    check_size(payload)?;
    let wire: PrefixWire<'_> = serde_json::from_slice(payload).map_err(WireError::Malformed)?;
    check_sender(wire.v, wire.replica)?;
    Ok(PrefixMessage {
        replica: wire.replica,
        #[cfg(test)]
        seq: wire._seq,
        workers: wire.workers,
        placed: wire.placed,
        bounds: wire.bounds,
    })
}

/// At most [`MAX_PLACED_HASHES`] integers; a longer list is read through
/// (so the entry's shape is still checked) and marked.
struct BoundedHashes {
    hashes: Vec<u64>,
    too_many: bool,
}

impl<'de> Deserialize<'de> for BoundedHashes {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<BoundedHashes, D::Error> {
        struct HashesVisitor;
        impl<'de> Visitor<'de> for HashesVisitor {
            type Value = BoundedHashes;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a list of integer hashes")
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<BoundedHashes, A::Error> {
                let mut hashes = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
                while hashes.len() < MAX_PLACED_HASHES {
                    match seq.next_element::<u64>()? {
                        Some(hash) => hashes.push(hash),
                        None => {
                            return Ok(BoundedHashes {
                                hashes,
                                too_many: false,
                            });
                        }
                    }
                }
                let too_many = seq.next_element::<IgnoredAny>()?.is_some();
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(BoundedHashes { hashes, too_many })
            }
        }
        deserializer.deserialize_seq(HashesVisitor)
    }
}

impl<'a> PrefixMessage<'a> {
    /// The URL at `index`, if it is a listed, valid one.
    fn worker(&self, index: &serde_json::Number) -> Result<&'a str, EntryError> {
        let url = index
            .as_u64()
            .and_then(|index| usize::try_from(index).ok())
            .and_then(|index| self.workers.get(index))
            .ok_or(EntryError::Worker)?;
        if !is_valid_url(url) {
            return Err(EntryError::Url);
        }
        Ok(url)
    }

    /// Every placement, each checked on its own.
    pub(super) fn placements(
        &self,
    ) -> impl Iterator<Item = Result<PlacedEntry<'a>, EntryError>> + '_ {
        self.placed.iter().map(|raw| {
            let (index, block_tokens, hashes): (
                serde_json::Number,
                serde_json::Number,
                BoundedHashes,
            ) = serde_json::from_str(raw.get()).map_err(|_| EntryError::Shape)?;
            let worker_url = self.worker(&index)?;
            let block_tokens = block_tokens
                .as_u64()
                .filter(|tokens| (1..=MAX_BLOCK_TOKENS).contains(tokens))
                .ok_or(EntryError::Count)?;
            if hashes.too_many || hashes.hashes.is_empty() {
                return Err(EntryError::Count);
            }
            Ok(PlacedEntry {
                worker_url,
                // At most MAX_BLOCK_TOKENS, which fits.
                prefix: PrefixBlocks::new(block_tokens as u32, hashes.hashes),
            })
        })
    }

    /// Every cache bound, each checked on its own.
    pub(super) fn bounds(&self) -> impl Iterator<Item = Result<BoundEntry<'a>, EntryError>> + '_ {
        self.bounds.iter().map(|raw| {
            let (index, cache_tokens): (serde_json::Number, serde_json::Number) =
                serde_json::from_str(raw.get()).map_err(|_| EntryError::Shape)?;
            let worker_url = self.worker(&index)?;
            let cache_tokens = cache_tokens
                .as_u64()
                .filter(|tokens| *tokens <= MAX_PENDING_TOKENS)
                .ok_or(EntryError::Count)?;
            Ok(BoundEntry {
                worker_url,
                cache_tokens,
            })
        })
    }
}

#[derive(Serialize, Deserialize)]
struct SnapshotRequestWire<'a> {
    v: u64,
    #[serde(borrow)]
    replica: &'a str,
}

/// A starting replica's request for a prefix snapshot.
pub(super) fn encode_snapshot_request(replica: &str) -> Vec<u8> {
    let message = SnapshotRequestWire {
        v: WIRE_VERSION,
        replica,
    };
    serde_json::to_vec(&message).unwrap_or_default()
}

/// Reads a snapshot request: the asking replica's id.
pub(super) fn decode_snapshot_request(payload: &[u8]) -> Result<&str, WireError> {
    check_size(payload)?;
    let wire: SnapshotRequestWire<'_> =
        serde_json::from_slice(payload).map_err(WireError::Malformed)?;
    check_sender(wire.v, wire.replica)?;
    Ok(wire.replica)
}

/// A snapshot whose worker list alone fills most of a message: it cannot be
/// cut into parts that each carry it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "a snapshot's {workers} workers take {bytes} bytes, over half a {MAX_MESSAGE_BYTES}-byte part"
)]
pub(super) struct SnapshotTooWide {
    pub(super) workers: usize,
    pub(super) bytes: usize,
}

/// The worst case of a part's envelope, beyond the replica id and the
/// workers: `{"v":1,"replica":,"part":<10>,"last":false,"block_tokens":<10>,"workers":,"blocks":[]}`.
const PART_ENVELOPE_BYTES: usize = 112;

/// Writes `snapshot` as parts of at most `max_bytes` each, every one with
/// the whole worker list and some of the blocks; none when it has no
/// blocks. A block too large for a part alone (more holders than any
/// policy keeps) is left out.
pub(super) fn encode_snapshot(
    replica: &str,
    snapshot: &PrefixSnapshot,
    max_bytes: usize,
) -> Result<Vec<Vec<u8>>, SnapshotTooWide> {
    let mut workers = Vec::new();
    workers.push(b'[');
    for (position, worker) in snapshot.workers.iter().enumerate() {
        if position > 0 {
            workers.push(b',');
        }
        workers.push(b'[');
        push_str(&mut workers, &worker.url);
        workers.push(b',');
        push_u64(&mut workers, worker.clock_tokens);
        workers.push(b',');
        push_u64(&mut workers, worker.cache_tokens);
        workers.push(b']');
    }
    workers.push(b']');
    let envelope = PART_ENVELOPE_BYTES + str_len(replica) + workers.len();
    if envelope > max_bytes / 2 {
        return Err(SnapshotTooWide {
            workers: snapshot.workers.len(),
            bytes: workers.len(),
        });
    }
    let mut bodies: Vec<Vec<u8>> = Vec::new();
    let mut body: Vec<u8> = Vec::new();
    let mut block = Vec::new();
    for entry in &snapshot.blocks {
        block.clear();
        block.push(b'[');
        push_u64(&mut block, entry.hash);
        block.push(b',');
        push_u64(&mut block, u64::from(entry.age_ms));
        block.extend_from_slice(b",[");
        for (position, (worker, age)) in entry.holders.iter().enumerate() {
            if position > 0 {
                block.push(b',');
            }
            block.push(b'[');
            push_u64(&mut block, u64::from(*worker));
            block.push(b',');
            push_u64(&mut block, *age);
            block.push(b']');
        }
        block.extend_from_slice(b"]]");
        if envelope + block.len() > max_bytes {
            continue;
        }
        if envelope + body.len() + 1 + block.len() > max_bytes {
            bodies.push(std::mem::take(&mut body));
        }
        if !body.is_empty() {
            body.push(b',');
        }
        body.extend_from_slice(&block);
    }
    if !body.is_empty() {
        bodies.push(body);
    }
    let parts = bodies.len();
    Ok(bodies
        .into_iter()
        .enumerate()
        .map(|(part, body)| {
            let mut out = Vec::with_capacity(envelope + body.len());
            out.extend_from_slice(b"{\"v\":");
            push_u64(&mut out, WIRE_VERSION);
            out.extend_from_slice(b",\"replica\":");
            push_str(&mut out, replica);
            out.extend_from_slice(b",\"part\":");
            push_u64(&mut out, part as u64);
            out.extend_from_slice(if part + 1 == parts {
                b",\"last\":true"
            } else {
                b",\"last\":false"
            });
            out.extend_from_slice(b",\"block_tokens\":");
            push_u64(&mut out, u64::from(snapshot.block_tokens));
            out.extend_from_slice(b",\"workers\":");
            out.extend_from_slice(&workers);
            out.extend_from_slice(b",\"blocks\":[");
            out.extend_from_slice(&body);
            out.extend_from_slice(b"]}");
            out
        })
        .collect())
}

/// One part of a snapshot, read and checked.
#[derive(Debug)]
pub(super) struct SnapshotPart<'a> {
    pub(super) replica: &'a str,
    pub(super) part: u32,
    pub(super) last: bool,
    /// The workers and the part's valid blocks.
    pub(super) snapshot: PrefixSnapshot,
    /// Blocks dropped as invalid (read by the tests only).
    #[cfg(test)]
    pub(super) invalid_blocks: usize,
}

#[derive(Deserialize)]
struct PartWire<'a> {
    v: u64,
    #[serde(borrow)]
    replica: &'a str,
    part: u32,
    last: bool,
    block_tokens: u32,
    workers: Vec<(String, u64, u64)>,
    #[serde(borrow)]
    blocks: Vec<&'a RawValue>,
}

/// Reads one snapshot part.
pub(super) fn decode_snapshot_part(payload: &[u8]) -> Result<SnapshotPart<'_>, WireError> {
    check_size(payload)?;
    let wire: PartWire<'_> = serde_json::from_slice(payload).map_err(WireError::Malformed)?;
    check_sender(wire.v, wire.replica)?;
    if wire.block_tokens == 0 || u64::from(wire.block_tokens) > MAX_BLOCK_TOKENS {
        return Err(WireError::Invalid("block_tokens out of range"));
    }
    if wire.workers.iter().any(|(url, _, _)| !is_valid_url(url)) {
        return Err(WireError::Invalid("a worker URL is empty or too long"));
    }
    let workers = wire.workers.len();
    let blocks: Vec<SnapshotBlock> = wire
        .blocks
        .iter()
        .filter_map(|raw| {
            let block = serde_json::from_str::<(u64, u32, Vec<(u32, u64)>)>(raw.get())
                .ok()
                .filter(|(_, _, holders)| {
                    (1..=MAX_SNAPSHOT_HOLDERS).contains(&holders.len())
                        && holders
                            .iter()
                            .all(|(worker, _)| (*worker as usize) < workers)
                });
            let (hash, age_ms, holders) = block?;
            Some(SnapshotBlock {
                hash,
                age_ms,
                holders,
            })
        })
        .collect();
    #[cfg(test)]
    let invalid_blocks = wire.blocks.len() - blocks.len();
    Ok(SnapshotPart {
        replica: wire.replica,
        part: wire.part,
        last: wire.last,
        snapshot: PrefixSnapshot {
            block_tokens: wire.block_tokens,
            workers: wire
                .workers
                .into_iter()
                .map(|(url, clock_tokens, cache_tokens)| SnapshotWorker {
                    url,
                    clock_tokens,
                    cache_tokens,
                })
                .collect(),
            blocks,
        },
        #[cfg(test)]
        invalid_blocks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_round_trips() {
        let payload = encode(
            "router-a",
            42,
            true,
            &[("http://w:1", 1200, 3), ("http://w:2", 0, 0)],
            &[],
            None,
        );
        // Without samples, no `prefill` key: what every version 1 reader
        // expects.
        assert_eq!(
            std::str::from_utf8(&payload).unwrap(),
            r#"{"v":1,"replica":"router-a","seq":42,"full":true,"pending":[["http://w:1",1200,3],["http://w:2",0,0]]}"#
        );
        let message = decode(&payload).unwrap();
        assert_eq!(
            (message.replica, message.seq, message.full),
            ("router-a", 42, true)
        );
        let entries: Vec<_> = message.entries().collect();
        assert_eq!(
            entries,
            vec![
                Ok(Entry {
                    worker_url: "http://w:1",
                    pending_tokens: 1200,
                    pending_requests: 3
                }),
                Ok(Entry {
                    worker_url: "http://w:2",
                    pending_tokens: 0,
                    pending_requests: 0
                }),
            ]
        );
    }

    #[test]
    fn first_tokens_round_trip_and_bad_ones_are_dropped_alone() {
        let payload = encode(
            "router-a",
            7,
            false,
            &[("http://w:1", 0, 0)],
            &[("http://w:1", 4096, 512, 250_000, 40_000)],
            None,
        );
        assert_eq!(
            std::str::from_utf8(&payload).unwrap(),
            r#"{"v":1,"replica":"router-a","seq":7,"full":false,"pending":[["http://w:1",0,0]],"first_tokens":[["http://w:1",4096,512,250000,40000]]}"#
        );
        let message = decode(&payload).unwrap();
        let samples: Vec<_> = message.prefill_samples().collect();
        assert_eq!(
            samples,
            vec![Ok(PrefillEntry {
                worker_url: "http://w:1",
                sample: PrefillSample {
                    tokens: 4096,
                    foreign_ahead_tokens: 512,
                    waited: Duration::from_millis(250),
                },
                ago: Duration::from_millis(40),
            })]
        );

        let payload = br#"{"v":1,"replica":"b","seq":1,"full":false,"pending":[],
            "first_tokens":[["http://w:1",100,0,3600000001,0],["http://w:1",100,0,10,3600000001],
            ["http://w:1",-5,0,10,0],["http://w:1",5,1099511627777,10,0],["http://w:1",1.5,0,10,0],
            ["",100,0,10,0],["http://w:1",100,0,10],"junk",["http://w:1",100,0,0,0]]}"#;
        let message = decode(payload).unwrap();
        let samples: Vec<_> = message.prefill_samples().collect();
        assert_eq!(
            samples,
            vec![
                Err(EntryError::Count),
                Err(EntryError::Count),
                Err(EntryError::Count),
                Err(EntryError::Count),
                Err(EntryError::Count),
                Err(EntryError::Url),
                Err(EntryError::Shape),
                Err(EntryError::Shape),
                Ok(PrefillEntry {
                    worker_url: "http://w:1",
                    sample: PrefillSample {
                        tokens: 100,
                        foreign_ahead_tokens: 0,
                        waited: Duration::ZERO,
                    },
                    ago: Duration::ZERO,
                }),
            ]
        );
        // An earlier sender's `prefill` samples are an unknown key: ignored.
        let payload = br#"{"v":1,"replica":"b","seq":1,"full":false,"pending":[],
            "prefill":[["http://w:1",4096,250000]]}"#;
        assert_eq!(decode(payload).unwrap().prefill_samples().count(), 0);

        // A sender past the cap writes the first MAX_PREFILL_SAMPLES; a
        // reader drops any beyond them.
        let many = vec![("http://w:1", 1u64, 0u64, 1u64, 1u64); MAX_PREFILL_SAMPLES + 5];
        let message_bytes = encode("a", 1, false, &[], &many, None);
        assert_eq!(
            decode(&message_bytes).unwrap().prefill_samples().count(),
            MAX_PREFILL_SAMPLES
        );
        let mut text = String::from(
            r#"{"v":1,"replica":"b","seq":1,"full":false,"pending":[],"first_tokens":["#,
        );
        text.push_str(&vec![r#"["http://w:1",1,0,1,1]"#; MAX_PREFILL_SAMPLES + 2].join(","));
        text.push_str("]}");
        let message = decode(text.as_bytes()).unwrap();
        let samples: Vec<_> = message.prefill_samples().collect();
        assert_eq!(
            samples.iter().filter(|sample| sample.is_ok()).count(),
            MAX_PREFILL_SAMPLES
        );
        assert_eq!(samples[MAX_PREFILL_SAMPLES], Err(EntryError::Count));
    }

    #[test]
    fn a_room_round_trips_and_a_bad_one_is_dropped_alone() {
        let room = Room {
            oldest_wait_ms: Some(1520),
            prefill_busy_workers: 3.5,
            waiting_for: vec![("http://w:1".to_owned(), 240)],
            queued_requests: 17,
        };
        let payload = encode("router-a", 3, false, &[], &[], Some(&room));
        assert_eq!(
            std::str::from_utf8(&payload).unwrap(),
            r#"{"v":1,"replica":"router-a","seq":3,"full":false,"pending":[],"room":{"oldest_wait_ms":1520,"prefill_busy_workers":3.5,"waiting_for":[["http://w:1",240]],"queued_requests":17}}"#
        );
        assert_eq!(decode(&payload).unwrap().room(), Some(Ok(room)));
        // None waiting: no `oldest_wait_ms`; no room at all: no `room`.
        let empty = encode("a", 1, false, &[], &[], Some(&Room::default()));
        assert_eq!(decode(&empty).unwrap().room(), Some(Ok(Room::default())));
        assert_eq!(
            decode(&encode("a", 1, false, &[], &[], None))
                .unwrap()
                .room(),
            None
        );

        let message = |room: &str| {
            format!(
                r#"{{"v":1,"replica":"b","seq":1,"full":false,"pending":[["http://w:1",1,1]],"room":{room}}}"#
            )
        };
        for (room, error) in [
            ("[]", EntryError::Shape),
            (
                r#"{"oldest_wait_ms":-1,"prefill_busy_workers":0}"#,
                EntryError::Shape,
            ),
            (r#"{"oldest_wait_ms":1}"#, EntryError::Shape),
            (r#"{"prefill_busy_workers":-0.5}"#, EntryError::Count),
            (r#"{"prefill_busy_workers":1e300}"#, EntryError::Count),
            (
                r#"{"oldest_wait_ms":86400001,"prefill_busy_workers":0}"#,
                EntryError::Count,
            ),
            (
                r#"{"prefill_busy_workers":0,"waiting_for":[["",5]]}"#,
                EntryError::Url,
            ),
            (
                r#"{"prefill_busy_workers":0,"waiting_for":[["http://w:1",86400001]]}"#,
                EntryError::Count,
            ),
            (
                r#"{"prefill_busy_workers":0,"waiting_for":[["http://w:1"]]}"#,
                EntryError::Shape,
            ),
            (
                r#"{"prefill_busy_workers":0,"queued_requests":-3}"#,
                EntryError::Shape,
            ),
            (
                r#"{"prefill_busy_workers":0,"queued_requests":100000001}"#,
                EntryError::Count,
            ),
        ] {
            let text = message(room);
            let decoded = decode(text.as_bytes()).unwrap();
            assert_eq!(decoded.room(), Some(Err(error)), "{room}");
            // The rest of the message stands.
            assert_eq!(decoded.entries().filter(Result::is_ok).count(), 1, "{room}");
        }
        let many = vec![r#"["http://w:1",1]"#; MAX_ROOM_WAITING_FOR + 1].join(",");
        let text = message(&format!(
            r#"{{"prefill_busy_workers":0,"waiting_for":[{many}]}}"#
        ));
        assert_eq!(
            decode(text.as_bytes()).unwrap().room(),
            Some(Err(EntryError::Count))
        );
        // Keys a later sender may add are ignored.
        let text = message(r#"{"prefill_busy_workers":1,"later":true}"#);
        assert_eq!(
            decode(text.as_bytes()).unwrap().room(),
            Some(Ok(Room {
                prefill_busy_workers: 1.0,
                ..Room::default()
            }))
        );
    }

    #[test]
    fn malformed_and_foreign_messages_are_rejected_whole() {
        let cases: [(&[u8], &str); 9] = [
            (b"", "malformed"),
            (b"hello", "malformed"),
            (b"\xff\xfe", "malformed"),
            (b"[1,2,3]", "malformed"),
            (br#"{"v":1,"replica":"a","seq":1,"full":true}"#, "malformed"),
            (
                br#"{"v":1,"replica":"a","seq":-1,"full":true,"pending":[]}"#,
                "malformed",
            ),
            (
                br#"{"v":1,"replica":"a","seq":1,"full":"yes","pending":[]}"#,
                "malformed",
            ),
            (
                br#"{"v":2,"replica":"a","seq":1,"full":true,"pending":[]}"#,
                "foreign_version",
            ),
            (
                br#"{"v":1,"replica":"a b","seq":1,"full":true,"pending":[]}"#,
                "invalid_replica",
            ),
        ];
        for (payload, outcome) in cases {
            let error = decode(payload).unwrap_err();
            assert_eq!(
                error.outcome(),
                outcome,
                "{:?}",
                String::from_utf8_lossy(payload)
            );
        }
        // Another application's JSON on the subject.
        let foreign = br#"{"event":"deploy","service":"web"}"#;
        assert_eq!(decode(foreign).unwrap_err().outcome(), "malformed");
        // NaN is not JSON.
        let nan = br#"{"v":1,"replica":"a","seq":1,"full":true,"pending":[["http://w:1",NaN,1]]}"#;
        assert_eq!(decode(nan).unwrap_err().outcome(), "malformed");
    }

    #[test]
    fn bad_entries_are_dropped_alone() {
        let payload = format!(
            r#"{{"v":1,"replica":"a","seq":1,"full":false,"extra":{{"later":"fields"}},"pending":[
                ["http://ok:1",10,1],
                ["http://w:1",-5,1],
                ["http://w:1",1.5,1],
                ["http://w:1",1e300,1],
                ["http://w:1",{},1],
                ["http://w:1",1,{}],
                ["",1,1],
                ["{}",1,1],
                ["http://w:1",1],
                {{"url":"http://w:1"}},
                ["http://ok:2",0,0]
            ]}}"#,
            MAX_PENDING_TOKENS + 1,
            MAX_PENDING_REQUESTS + 1,
            "x".repeat(MAX_URL_BYTES + 1)
        );
        let message = decode(payload.as_bytes()).unwrap();
        let entries: Vec<_> = message.entries().collect();
        assert_eq!(entries.len(), 11);
        assert_eq!(entries[0].as_ref().map(|e| e.worker_url), Ok("http://ok:1"));
        assert_eq!(
            entries[1..10].to_vec(),
            vec![
                Err(EntryError::Count),
                Err(EntryError::Count),
                Err(EntryError::Count),
                Err(EntryError::Count),
                Err(EntryError::Count),
                Err(EntryError::Url),
                Err(EntryError::Url),
                Err(EntryError::Shape),
                Err(EntryError::Shape),
            ]
        );
        assert_eq!(entries[10].as_ref().map(|e| e.pending_tokens), Ok(0));
    }
}

#[cfg(test)]
mod prefix_tests {
    use super::*;

    fn blocks(count: u64, seed: u64) -> PrefixBlocks {
        // Chained-looking hashes spread over the u64 range, as xxh3 gives.
        let hashes: Vec<u64> = (1..=count)
            .map(|i| (seed ^ i).wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .collect();
        PrefixBlocks::new(256, hashes)
    }

    fn decoded(payload: &[u8]) -> (Vec<PlacedEntry<'_>>, Vec<BoundEntry<'_>>) {
        let message = decode_prefix(payload).unwrap();
        let placed = message.placements().map(Result::unwrap).collect();
        let bounds = message.bounds().map(Result::unwrap).collect();
        (placed, bounds)
    }

    #[test]
    fn placements_and_bounds_round_trip() {
        let a = PrefixBlocks::new(256, vec![1311768467294899695, 81985529216486895]);
        let b = PrefixBlocks::new(256, vec![u64::MAX]);
        let mut seq = 1718000000000007;
        let encoded = encode_prefix(
            "router-a",
            &mut seq,
            &[
                Placement {
                    worker_url: "http://10.0.0.1:30000",
                    prefix: &a,
                },
                Placement {
                    worker_url: "http://10.0.0.2:30000",
                    prefix: &b,
                },
            ],
            &[Bound {
                worker_url: "http://10.0.0.2:30000",
                cache_tokens: 120_000,
            }],
            MAX_MESSAGE_BYTES,
        );
        assert_eq!(
            (encoded.placements, encoded.bounds, encoded.skipped),
            (2, 1, 0)
        );
        assert_eq!(seq, 1718000000000008);
        assert_eq!(
            std::str::from_utf8(&encoded.messages[0]).unwrap(),
            r#"{"v":1,"replica":"router-a","seq":1718000000000007,"workers":["http://10.0.0.1:30000","http://10.0.0.2:30000"],"placed":[[0,256,[1311768467294899695,81985529216486895]],[1,256,[18446744073709551615]]],"bounds":[[1,120000]]}"#
        );
        let message = decode_prefix(&encoded.messages[0]).unwrap();
        assert_eq!(
            (message.replica, message.seq),
            ("router-a", 1718000000000007)
        );
        let (placed, bounds) = decoded(&encoded.messages[0]);
        assert_eq!(
            placed,
            vec![
                PlacedEntry {
                    worker_url: "http://10.0.0.1:30000",
                    prefix: a
                },
                PlacedEntry {
                    worker_url: "http://10.0.0.2:30000",
                    prefix: b
                },
            ]
        );
        assert_eq!(
            bounds,
            vec![BoundEntry {
                worker_url: "http://10.0.0.2:30000",
                cache_tokens: 120_000
            }]
        );
    }

    #[test]
    fn more_than_a_message_holds_goes_out_in_several_each_within_the_cap() {
        let prompts: Vec<PrefixBlocks> = (0..200).map(|seed| blocks(32, seed)).collect();
        let urls: Vec<String> = (0..16)
            .map(|i| format!("http://10.0.0.{i}:30000"))
            .collect();
        let placed: Vec<Placement<'_>> = prompts
            .iter()
            .enumerate()
            .map(|(i, prefix)| Placement {
                worker_url: &urls[i % urls.len()],
                prefix,
            })
            .collect();
        let bounds: Vec<Bound<'_>> = urls
            .iter()
            .map(|url| Bound {
                worker_url: url,
                cache_tokens: 4096,
            })
            .collect();
        let max = 16 * 1024;
        let mut seq = 10;
        let encoded = encode_prefix("a", &mut seq, &placed, &bounds, max);
        assert!(encoded.messages.len() > 3, "{}", encoded.messages.len());
        assert_eq!(seq, 10 + encoded.messages.len() as u64);
        assert_eq!((encoded.placements, encoded.bounds), (200, 16));
        let mut read_placed = Vec::new();
        let mut read_bounds = 0;
        for message in &encoded.messages {
            assert!(message.len() <= max, "{} bytes", message.len());
            let (placed, bounds) = decoded(message);
            read_placed.extend(
                placed
                    .into_iter()
                    .map(|entry| (entry.worker_url.to_owned(), entry.prefix)),
            );
            read_bounds += bounds.len();
        }
        let sent: Vec<(String, PrefixBlocks)> = placed
            .iter()
            .map(|p| (p.worker_url.to_owned(), p.prefix.clone()))
            .collect();
        assert_eq!(read_placed, sent, "every placement, in order");
        assert_eq!(read_bounds, 16);
    }

    #[test]
    fn a_placement_longer_than_the_limit_is_cut_to_its_leading_blocks() {
        let long = blocks(MAX_PLACED_HASHES as u64 + 100, 7);
        let mut seq = 1;
        let encoded = encode_prefix(
            "a",
            &mut seq,
            &[Placement {
                worker_url: "http://w:1",
                prefix: &long,
            }],
            &[],
            MAX_MESSAGE_BYTES,
        );
        assert_eq!(encoded.messages.len(), 1);
        assert!(encoded.messages[0].len() <= MAX_MESSAGE_BYTES);
        let (placed, _) = decoded(&encoded.messages[0]);
        assert_eq!(
            placed[0].prefix.hashes(),
            &long.hashes()[..MAX_PLACED_HASHES]
        );
        // An entry that fits no message alone, and an empty one, are skipped.
        let encoded = encode_prefix(
            "a",
            &mut seq,
            &[
                Placement {
                    worker_url: "http://w:1",
                    prefix: &long,
                },
                Placement {
                    worker_url: "http://w:1",
                    prefix: &PrefixBlocks::default(),
                },
            ],
            &[Bound {
                worker_url: "http://w:1",
                cache_tokens: 1,
            }],
            1024,
        );
        assert_eq!(
            (encoded.placements, encoded.bounds, encoded.skipped),
            (0, 1, 2)
        );
    }

    #[test]
    fn malformed_prefix_messages_are_rejected_whole() {
        let oversize = vec![b' '; MAX_MESSAGE_BYTES + 1];
        let cases: [(&[u8], &str); 9] = [
            (b"", "malformed"),
            (b"\xff", "malformed"),
            (br#"{"v":1,"replica":"a","seq":1}"#, "malformed"),
            (
                br#"{"v":1,"replica":"a","seq":1,"workers":{}}"#,
                "malformed",
            ),
            (
                br#"{"v":1,"replica":"a","seq":-2,"workers":[]}"#,
                "malformed",
            ),
            (
                br#"{"v":1,"replica":"a","seq":1,"workers":[],"placed":{}}"#,
                "malformed",
            ),
            (
                br#"{"v":2,"replica":"a","seq":1,"workers":[]}"#,
                "foreign_version",
            ),
            (
                br#"{"v":1,"replica":"","seq":1,"workers":[]}"#,
                "invalid_replica",
            ),
            (&oversize, "oversize"),
        ];
        for (payload, outcome) in cases {
            let error = decode_prefix(payload).unwrap_err();
            assert_eq!(
                error.outcome(),
                outcome,
                "{:?}",
                String::from_utf8_lossy(&payload[..payload.len().min(80)])
            );
        }
        // A message with nothing in it is fine.
        let empty = decode_prefix(br#"{"v":1,"replica":"a","seq":1,"workers":[]}"#).unwrap();
        assert_eq!(empty.placements().count() + empty.bounds().count(), 0);
    }

    #[test]
    fn bad_entries_are_dropped_alone() {
        let too_many = format!(
            "[{}]",
            (0..=MAX_PLACED_HASHES)
                .map(|i| i.to_string())
                .collect::<Vec<_>>()
                .join(",")
        );
        let payload = format!(
            r#"{{"v":1,"replica":"a","seq":1,"later":"fields","workers":["http://ok:1","","{long}"],
               "placed":[[0,256,[1,2]],[3,256,[1]],[-1,256,[1]],[1,256,[1]],[2,256,[1]],
                         [0,0,[1]],[0,{big},[1]],[0,256,[]],[0,256,[1.5]],[0,256,[-1]],
                         [0,256,[18446744073709551616]],[0,256,NaN],[0,256,{too_many}],
                         [0,256],{{"worker":0}},[0,16,[7]]],
               "bounds":[[0,100],[0,-1],[0,1.5],[0,{over}],[9,1],[0],"x",[0,0]]}}"#,
            long = "x".repeat(MAX_URL_BYTES + 1),
            big = MAX_BLOCK_TOKENS + 1,
            over = MAX_PENDING_TOKENS + 1,
        )
        .replace("NaN", "\"NaN\"");
        let message = decode_prefix(payload.as_bytes()).unwrap();
        let placed: Vec<_> = message.placements().collect();
        assert_eq!(placed.len(), 16);
        assert_eq!(placed[0].as_ref().map(|e| e.prefix.hashes().len()), Ok(2));
        let errors: Vec<_> = placed[1..15]
            .iter()
            .map(|entry| entry.clone().unwrap_err())
            .collect();
        assert_eq!(
            errors,
            vec![
                EntryError::Worker,
                EntryError::Worker,
                EntryError::Url,
                EntryError::Url,
                EntryError::Count,
                EntryError::Count,
                EntryError::Count,
                EntryError::Shape,
                EntryError::Shape,
                EntryError::Shape,
                EntryError::Shape,
                EntryError::Count,
                EntryError::Shape,
                EntryError::Shape,
            ]
        );
        assert_eq!(placed[15].as_ref().map(|e| e.prefix.block_tokens()), Ok(16));
        let bounds: Vec<_> = message.bounds().collect();
        assert_eq!(
            bounds,
            vec![
                Ok(BoundEntry {
                    worker_url: "http://ok:1",
                    cache_tokens: 100
                }),
                Err(EntryError::Count),
                Err(EntryError::Count),
                Err(EntryError::Count),
                Err(EntryError::Worker),
                Err(EntryError::Shape),
                Err(EntryError::Shape),
                Ok(BoundEntry {
                    worker_url: "http://ok:1",
                    cache_tokens: 0
                }),
            ]
        );
    }

    /// What a placement costs on the wire: an 8k-token prompt at 256-token
    /// index blocks is 32 hashes. docs/replicas.md quotes these figures.
    #[test]
    fn a_placement_of_an_8k_token_prompt_costs_under_800_bytes() {
        let prompts: Vec<PrefixBlocks> = (0..64).map(|seed| blocks(32, seed + 1)).collect();
        let urls: Vec<String> = (0..16)
            .map(|i| format!("http://10.0.1.{i}:30000"))
            .collect();
        let placement = |i: usize| Placement {
            worker_url: &urls[i % urls.len()],
            prefix: &prompts[i],
        };
        let replica = "router-a.prod-1";
        let one = |i: usize| {
            let mut seq = 1_718_000_000_000_000;
            let encoded = encode_prefix(replica, &mut seq, &[placement(i)], &[], MAX_MESSAGE_BYTES);
            encoded.messages[0].len()
        };
        // One dispatch per wake (low load): a message per placement.
        let alone = (0..64).map(one).sum::<usize>() / 64;
        // Under load, a wake's batch shares one message (16 workers).
        let batch: Vec<Placement<'_>> = (0..64).map(placement).collect();
        let mut seq = 1_718_000_000_000_000;
        let encoded = encode_prefix(replica, &mut seq, &batch, &[], MAX_MESSAGE_BYTES);
        assert_eq!(encoded.messages.len(), 1);
        let batched = encoded.messages[0].len() / 64;
        eprintln!(
            "bytes per placement of 32 hashes: {alone} alone, {batched} in a batch of 64 over 16 workers"
        );
        // Each hash is up to 20 digits and a comma.
        assert!((650..800).contains(&alone), "{alone}");
        assert!((620..alone).contains(&batched), "{batched}");
    }
}

#[cfg(test)]
mod snapshot_tests {
    use super::*;

    fn snapshot(blocks: u64) -> PrefixSnapshot {
        PrefixSnapshot {
            block_tokens: 256,
            workers: vec![
                SnapshotWorker {
                    url: "http://10.0.0.1:30000".into(),
                    clock_tokens: 5_120_000,
                    cache_tokens: 0,
                },
                SnapshotWorker {
                    url: "http://10.0.0.2:30000".into(),
                    clock_tokens: 4_800_000,
                    cache_tokens: 120_000,
                },
            ],
            blocks: (0..blocks)
                .map(|i| SnapshotBlock {
                    hash: i.wrapping_mul(0x9e37_79b9_7f4a_7c15),
                    age_ms: (i * 37) as u32,
                    holders: if i % 3 == 0 {
                        vec![(0, i * 256), (1, 256)]
                    } else {
                        vec![(1, i)]
                    },
                })
                .collect(),
        }
    }

    #[test]
    fn a_snapshot_is_cut_into_parts_each_loadable_alone() {
        let whole = snapshot(5000);
        let parts = encode_snapshot("router-a", &whole, 32 * 1024).unwrap();
        assert!(parts.len() > 3, "{} parts", parts.len());
        let mut blocks = Vec::new();
        for (index, payload) in parts.iter().enumerate() {
            assert!(payload.len() <= 32 * 1024, "{} bytes", payload.len());
            let part = decode_snapshot_part(payload).unwrap();
            assert_eq!(part.replica, "router-a");
            assert_eq!(part.part as usize, index);
            assert_eq!(part.last, index + 1 == parts.len());
            assert_eq!(part.invalid_blocks, 0);
            assert_eq!(part.snapshot.block_tokens, 256);
            assert_eq!(
                part.snapshot.workers, whole.workers,
                "every part has every worker"
            );
            blocks.extend(part.snapshot.blocks);
        }
        assert_eq!(blocks, whole.blocks);
        // Nothing to send: no part.
        assert!(
            encode_snapshot("a", &snapshot(0), MAX_MESSAGE_BYTES)
                .unwrap()
                .is_empty()
        );
        // A worker list that fills the part leaves no room for blocks.
        let mut wide = snapshot(1);
        wide.workers = (0..2000)
            .map(|i| SnapshotWorker {
                url: format!("http://10.0.{}.{}:30000", i / 256, i % 256),
                clock_tokens: 1,
                cache_tokens: 0,
            })
            .collect();
        assert!(encode_snapshot("a", &wide, 64 * 1024).is_err());
    }

    #[test]
    fn snapshot_requests_round_trip_and_junk_is_refused() {
        let request = encode_snapshot_request("router-c");
        assert_eq!(
            std::str::from_utf8(&request).unwrap(),
            r#"{"v":1,"replica":"router-c"}"#
        );
        assert_eq!(decode_snapshot_request(&request).unwrap(), "router-c");
        for (payload, outcome) in [
            (&b"{}"[..], "malformed"),
            (br#"{"v":7,"replica":"c"}"#, "foreign_version"),
            (br#"{"v":1,"replica":"c d"}"#, "invalid_replica"),
        ] {
            assert_eq!(
                decode_snapshot_request(payload).unwrap_err().outcome(),
                outcome
            );
        }
    }

    #[test]
    fn bad_parts_are_refused_and_bad_blocks_dropped_alone() {
        let oversize = vec![b' '; MAX_MESSAGE_BYTES + 1];
        let cases: [(&[u8], &str); 7] = [
            (b"nope", "malformed"),
            (br#"{"v":1,"replica":"a","part":0,"last":true,"block_tokens":0,"workers":[],"blocks":[]}"#, "malformed"),
            (br#"{"v":1,"replica":"a","part":0,"last":true,"block_tokens":256,"workers":[["",1,0]],"blocks":[]}"#, "malformed"),
            (br#"{"v":1,"replica":"a","part":0,"last":true,"block_tokens":256,"workers":[["http://w:1",-1,0]],"blocks":[]}"#, "malformed"),
            (br#"{"v":1,"replica":"a","part":-1,"last":true,"block_tokens":256,"workers":[],"blocks":[]}"#, "malformed"),
            (br#"{"v":0,"replica":"a","part":0,"last":true,"block_tokens":256,"workers":[],"blocks":[]}"#, "foreign_version"),
            (&oversize, "oversize"),
        ];
        for (payload, outcome) in cases {
            assert_eq!(
                decode_snapshot_part(payload).unwrap_err().outcome(),
                outcome,
                "{:?}",
                String::from_utf8_lossy(&payload[..payload.len().min(80)])
            );
        }
        let payload = br#"{"v":1,"replica":"a","part":3,"last":false,"block_tokens":256,
            "workers":[["http://w:1",100,0],["http://w:2",50,9000]],
            "blocks":[[7,10,[[0,5],[1,6]]],[8,10,[[2,5]]],[9,10,[]],[10,-1,[[0,1]]],[11,10,[[0,1],[0,1],[0,1],[0,1],[0,1],[0,1],[0,1],[0,1],[0,1],[0,1],[0,1],[0,1],[0,1],[0,1],[0,1],[0,1],[0,1]]],"x",[12,4294967296,[[0,1]]],[13,0,[[1,18446744073709551615]]]]}"#;
        let part = decode_snapshot_part(payload).unwrap();
        assert_eq!((part.part, part.last), (3, false));
        assert_eq!(part.invalid_blocks, 6);
        let hashes: Vec<u64> = part
            .snapshot
            .blocks
            .iter()
            .map(|block| block.hash)
            .collect();
        assert_eq!(hashes, vec![7, 13]);
        assert_eq!(part.snapshot.workers[1].cache_tokens, 9000);
    }

    /// What a snapshot costs: bytes per block of a realistic index (most
    /// blocks on one worker, some on two).
    #[test]
    fn a_snapshot_costs_under_60_bytes_a_block() {
        let whole = snapshot(30_000);
        let parts = encode_snapshot("router-a", &whole, MAX_MESSAGE_BYTES).unwrap();
        let bytes: usize = parts.iter().map(Vec::len).sum();
        let per_block = bytes / whole.blocks.len();
        eprintln!("snapshot: {} parts, {per_block} bytes a block", parts.len());
        assert!(per_block < 60, "{per_block}");
    }
}
