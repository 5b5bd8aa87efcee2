use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A worker's identity inside the router: a slot index plus the generation of
/// that slot.
///
/// Slots are reused after a worker is removed, with the generation bumped, so a
/// `Dispatch` or `PollMark` that names a removed worker can never touch the
/// slot's next occupant. Policies keep per-worker state in dense vectors
/// indexed by [`WorkerId::slot`].
///
/// Both halves live in one word, slot high, so that ids order by slot, then
/// generation, and a policy scanning candidates compares an id in one
/// instruction ([`WorkerId::to_bits`]).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerId {
    /// `slot << 32 | generation`.
    bits: u64,
}

impl WorkerId {
    pub const fn new(slot: u32, generation: u32) -> WorkerId {
        WorkerId {
            bits: (slot as u64) << 32 | generation as u64,
        }
    }

    pub const fn slot(self) -> usize {
        (self.bits >> 32) as usize
    }

    pub const fn generation(self) -> u32 {
        self.bits as u32
    }

    /// The slot and generation as one word, `slot << 32 | generation`: equal
    /// for equal ids, and never `u64::MAX` for a slot a dense table covers.
    pub const fn to_bits(self) -> u64 {
        self.bits
    }
}

impl fmt::Debug for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkerId")
            .field("slot", &self.slot())
            .field("generation", &self.generation())
            .finish()
    }
}

impl Serialize for WorkerId {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

/// Renders as `slot.generation` (for example `3.1`), the stable string id the
/// admin API uses.
impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.slot(), self.generation())
    }
}

/// Why a string is not a `WorkerId`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid worker id {0:?}: expected SLOT.GENERATION, for example 3.1")]
pub struct ParseWorkerIdError(pub String);

impl FromStr for WorkerId {
    type Err = ParseWorkerIdError;

    fn from_str(text: &str) -> Result<WorkerId, ParseWorkerIdError> {
        let invalid = || ParseWorkerIdError(text.to_owned());
        let (slot, generation) = text.split_once('.').ok_or_else(invalid)?;
        Ok(WorkerId::new(
            slot.parse().map_err(|_| invalid())?,
            generation.parse().map_err(|_| invalid())?,
        ))
    }
}

/// What a policy is told about a worker when it is added.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerInfo {
    /// The worker's HTTP address, where requests go.
    pub url: String,
    /// The backend name (`sglang`, `vllm-grpc`, …).
    pub backend: String,
    /// Static weight; 1.0 unless configured.
    pub weight: f64,
}

impl WorkerInfo {
    pub fn new(url: impl Into<String>, backend: impl Into<String>) -> WorkerInfo {
        WorkerInfo {
            url: url.into(),
            backend: backend.into(),
            weight: 1.0,
        }
    }
}

/// Hands out [`WorkerId`]s, reusing freed slots with a new generation.
///
/// The router's registry and the simulator each own one.
#[derive(Debug, Default)]
pub struct WorkerIdAllocator {
    generations: Vec<u32>,
    live: Vec<bool>,
    free: Vec<u32>,
}

impl WorkerIdAllocator {
    pub fn new() -> WorkerIdAllocator {
        WorkerIdAllocator::default()
    }

    /// A fresh id: the lowest free slot (so state vectors stay dense), else a
    /// new one.
    pub fn allocate(&mut self) -> WorkerId {
        self.free.sort_unstable_by(|a, b| b.cmp(a));
        if let Some(slot) = self.free.pop() {
            let index = slot as usize;
            self.generations[index] = self.generations[index].wrapping_add(1);
            self.live[index] = true;
            return WorkerId::new(slot, self.generations[index]);
        }
        let slot = u32::try_from(self.generations.len()).unwrap_or(u32::MAX);
        self.generations.push(0);
        self.live.push(true);
        WorkerId::new(slot, 0)
    }

    /// Frees the id's slot. Releasing an id that is not live does nothing.
    pub fn release(&mut self, id: WorkerId) {
        let index = id.slot();
        if self.live.get(index) == Some(&true) && self.generations[index] == id.generation() {
            self.live[index] = false;
            self.free.push(index as u32);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freed_slots_come_back_with_a_new_generation() {
        let mut ids = WorkerIdAllocator::new();
        let a = ids.allocate();
        let b = ids.allocate();
        assert_eq!((a, b), (WorkerId::new(0, 0), WorkerId::new(1, 0)));
        ids.release(a);
        ids.release(a); // twice is harmless
        let c = ids.allocate();
        assert_eq!(c, WorkerId::new(0, 1));
        assert_ne!(a, c);
        assert_eq!(ids.allocate(), WorkerId::new(2, 0));
    }

    #[test]
    fn ids_render_and_parse() {
        let id = WorkerId::new(3, 7);
        assert_eq!(id.to_string(), "3.7");
        assert_eq!("3.7".parse::<WorkerId>(), Ok(id));
        assert!("3".parse::<WorkerId>().is_err());
        assert!("a.b".parse::<WorkerId>().is_err());
        assert!("-1.0".parse::<WorkerId>().is_err());
    }

    #[test]
    fn ids_order_by_slot_then_generation_and_debug_as_both() {
        let mut ids = [
            WorkerId::new(2, 0),
            WorkerId::new(1, u32::MAX),
            WorkerId::new(1, 3),
            WorkerId::new(u32::MAX, 0),
        ];
        ids.sort();
        let pairs: Vec<(usize, u32)> = ids.iter().map(|id| (id.slot(), id.generation())).collect();
        assert_eq!(
            pairs,
            [(1, 3), (1, u32::MAX), (2, 0), (u32::MAX as usize, 0)]
        );
        assert_eq!(WorkerId::new(1, 3).to_bits(), 1 << 32 | 3);
        assert_eq!(
            format!("{:?}", WorkerId::new(4, 2)),
            "WorkerId { slot: 4, generation: 2 }"
        );
    }
}
