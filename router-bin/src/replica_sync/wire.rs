//! The pending-work message replicas exchange: compact, versioned JSON.
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
//!
//! Unknown top-level keys are ignored, so a later version 1 sender may add
//! some. Every value is checked: a message that is not this shape is
//! rejected whole; an entry with a bad URL or a count that is negative,
//! fractional or beyond [`MAX_PENDING_TOKENS`] / [`MAX_PENDING_REQUESTS`] is
//! dropped alone.

use serde::{Deserialize, Serialize};

use crate::config::is_valid_replica_id;

/// The version this router speaks.
pub const WIRE_VERSION: u64 = 1;
/// More pending tokens than this on one worker is not a real count.
pub const MAX_PENDING_TOKENS: u64 = 1 << 40;
/// More pending requests than this on one worker is not a real count.
pub const MAX_PENDING_REQUESTS: u64 = 1 << 24;
/// Longest worker URL accepted.
pub const MAX_URL_BYTES: usize = 2048;

/// Why a whole message was ignored.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("not a pending-work message")]
    Malformed(#[source] serde_json::Error),
    #[error("unsupported message version {0} (this router speaks {WIRE_VERSION})")]
    Version(u64),
    #[error("invalid replica id {0:?}")]
    Replica(String),
}

impl WireError {
    /// The `outcome` label of `router_sync_messages_received_total`.
    pub fn outcome(&self) -> &'static str {
        match self {
            WireError::Malformed(_) => "malformed",
            WireError::Version(_) => "foreign_version",
            WireError::Replica(_) => "invalid_replica",
        }
    }
}

/// Why one entry of a message was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum EntryError {
    #[error("an entry is not [worker_url, pending_tokens, pending_requests]")]
    Shape,
    #[error("an entry's worker URL is empty or longer than {MAX_URL_BYTES} bytes")]
    Url,
    #[error(
        "an entry's count is not an integer from 0 to {MAX_PENDING_TOKENS} tokens and {MAX_PENDING_REQUESTS} requests"
    )]
    Count,
}

/// One worker's pending work in a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry<'a> {
    pub worker_url: &'a str,
    pub pending_tokens: u64,
    pub pending_requests: u64,
}

/// A message that passed the message-level checks; its entries are checked
/// one by one as they are read ([`Message::entries`]).
#[derive(Debug)]
pub struct Message<'a> {
    pub replica: &'a str,
    pub seq: u64,
    pub full: bool,
    pending: Vec<&'a serde_json::value::RawValue>,
}

#[derive(Deserialize)]
struct Wire<'a> {
    v: u64,
    #[serde(borrow)]
    replica: &'a str,
    seq: u64,
    full: bool,
    #[serde(borrow)]
    pending: Vec<&'a serde_json::value::RawValue>,
}

/// Reads a message. The strings borrow from `payload`, so JSON escapes in a
/// replica id or URL (which no valid sender writes) make it malformed.
pub fn decode(payload: &[u8]) -> Result<Message<'_>, WireError> {
    let wire: Wire<'_> = serde_json::from_slice(payload).map_err(WireError::Malformed)?;
    if wire.v != WIRE_VERSION {
        return Err(WireError::Version(wire.v));
    }
    if !is_valid_replica_id(wire.replica) {
        return Err(WireError::Replica(wire.replica.chars().take(200).collect()));
    }
    Ok(Message {
        replica: wire.replica,
        seq: wire.seq,
        full: wire.full,
        pending: wire.pending,
    })
}

impl<'a> Message<'a> {
    pub fn len(&self) -> usize {
        self.pending.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// Every entry, each checked on its own.
    pub fn entries(&self) -> impl Iterator<Item = Result<Entry<'a>, EntryError>> + '_ {
        self.pending.iter().map(|raw| parse_entry(raw.get()))
    }
}

fn parse_entry(text: &str) -> Result<Entry<'_>, EntryError> {
    let (worker_url, tokens, requests): (&str, serde_json::Number, serde_json::Number) =
        serde_json::from_str(text).map_err(|_| EntryError::Shape)?;
    if worker_url.is_empty() || worker_url.len() > MAX_URL_BYTES {
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
}

/// Writes a message: `pending` is `(worker_url, tokens, requests)`.
pub fn encode(replica: &str, seq: u64, full: bool, pending: &[(&str, u64, u64)]) -> Vec<u8> {
    let message = WireOut {
        v: WIRE_VERSION,
        replica,
        seq,
        full,
        pending,
    };
    // Serializing strings and integers into memory cannot fail.
    serde_json::to_vec(&message).unwrap_or_default()
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
        );
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
