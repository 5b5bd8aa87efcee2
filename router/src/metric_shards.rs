//! Per-thread shards for the metrics every request records.
//!
//! A per-worker counter that every request to that worker writes is one
//! cache line that every core serving the worker would pass back and forth,
//! and an atomic read-modify-write (a locked instruction) per record. Here a
//! metric keeps one shard per recording thread instead: a thread owns its
//! shard alone, so it records with a plain load and store (no locked
//! instruction, no line written by another core), and a scrape sums the
//! shards. There are as many owned shards as the machine has cores (the
//! threads a tokio runtime runs by default), at most
//! [`OWNED_SHARDS_MAX`]; threads past that share one more shard and record
//! there with atomic read-modify-writes, so no count is ever lost.
//!
//! An example in use: the unit test `tests::example`.

use std::cell::Cell;
use std::num::NonZero;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock};

/// The most shards a metric gives threads to own. Each costs its lines in
/// every sharded metric of every worker: 16 keeps a large fleet's metrics
/// in tens of megabytes on a many-core machine.
pub(crate) const OWNED_SHARDS_MAX: usize = 16;

const LINE_WORDS: usize = 8;

/// One cache line of counters, so two shards never share a line.
#[repr(align(64))]
#[derive(Default)]
struct Line([AtomicU64; LINE_WORDS]);

/// Owned shards per metric: one per core, as a runtime runs one thread per
/// core.
static OWNED_SHARDS: LazyLock<usize> = LazyLock::new(|| {
    std::thread::available_parallelism()
        .map_or(1, NonZero::get)
        .clamp(1, OWNED_SHARDS_MAX)
});

/// Handed out once per thread that records, never reused: no two live
/// threads can own the same shard.
static NEXT_THREAD: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static THREAD: Cell<Option<usize>> = const { Cell::new(None) };
}

/// This thread's index among the threads that have recorded.
fn thread_index() -> usize {
    THREAD.with(|thread| match thread.get() {
        Some(index) => index,
        None => {
            let index = NEXT_THREAD.fetch_add(1, Ordering::Relaxed);
            thread.set(Some(index));
            index
        }
    })
}

/// `words` 64-bit counters, kept as a shard per recording thread and read
/// as their sum. A handle: clones share the counters. The lines sit in the
/// reference-counted allocation itself, so a record reads the handle (kept
/// inline where the metric is used) and writes one line, with no pointer in
/// between to miss in the cache; in a large fleet each worker's metrics
/// are cold when its turn comes.
#[derive(Debug, Clone)]
pub(crate) struct ShardedWords {
    lines: Arc<[Line]>,
    /// Small: a handle is 24 bytes, and a worker keeps several side by side.
    lines_per_shard: u32,
    owned_shards: u32,
}

impl std::fmt::Debug for Line {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Line")
    }
}

/// One counter at zero: what a counter or a gauge keeps.
impl Default for ShardedWords {
    fn default() -> ShardedWords {
        ShardedWords::new(1)
    }
}

impl ShardedWords {
    /// `words` counters at zero. More words than fit a `u32` of lines are
    /// cut to what does: no metric comes near.
    pub(crate) fn new(words: usize) -> ShardedWords {
        let owned_shards = *OWNED_SHARDS;
        let lines_per_shard = words.div_ceil(LINE_WORDS).clamp(1, u32::MAX as usize);
        ShardedWords {
            lines: (0..lines_per_shard * (owned_shards + 1))
                .map(|_| Line::default())
                .collect(),
            lines_per_shard: lines_per_shard as u32,
            // At most OWNED_SHARDS_MAX.
            owned_shards: owned_shards as u32,
        }
    }

    fn lines_per_shard(&self) -> usize {
        self.lines_per_shard as usize
    }

    fn owned_shards(&self) -> usize {
        self.owned_shards as usize
    }

    fn word(&self, shard: usize, word: usize) -> Option<&AtomicU64> {
        if word >= self.lines_per_shard() * LINE_WORDS {
            return None;
        }
        self.lines
            .get(shard * self.lines_per_shard() + word / LINE_WORDS)
            .map(|line| &line.0[word % LINE_WORDS])
    }

    /// Where this thread records: the shard it owns, or the shared last
    /// one. Looked up once for several adds.
    pub(crate) fn writer(&self) -> ShardWriter<'_> {
        let thread = thread_index();
        let owned = thread < self.owned_shards();
        let shard = if owned { thread } else { self.owned_shards() };
        let first_line = shard * self.lines_per_shard();
        ShardWriter {
            lines: self
                .lines
                .get(first_line..first_line + self.lines_per_shard())
                .unwrap_or_default(),
            owned,
        }
    }

    /// Adds `value` to `word` ([`ShardWriter::add`]).
    pub(crate) fn add(&self, word: usize, value: u64) {
        self.writer().add(word, value);
    }

    /// Adds `value` to `word` read as `f64` bits ([`ShardWriter::add_f64`]).
    #[cfg(test)]
    pub(crate) fn add_f64(&self, word: usize, value: f64) {
        self.writer().add_f64(word, value);
    }

    fn shards(&self, word: usize) -> impl Iterator<Item = u64> + '_ {
        (0..=self.owned_shards()).filter_map(move |shard| {
            self.word(shard, word)
                .map(|cell| cell.load(Ordering::Relaxed))
        })
    }

    /// `word` summed over the shards, wrapping.
    pub(crate) fn sum(&self, word: usize) -> u64 {
        self.shards(word).fold(0, u64::wrapping_add)
    }

    /// `word`, read as `f64` bits, summed over the shards.
    pub(crate) fn sum_f64(&self, word: usize) -> f64 {
        self.shards(word).map(f64::from_bits).sum()
    }
}

/// One thread's shard of a [`ShardedWords`].
#[derive(Debug)]
pub(crate) struct ShardWriter<'a> {
    lines: &'a [Line],
    /// This thread is the shard's only writer.
    owned: bool,
}

impl ShardWriter<'_> {
    fn cell(&self, word: usize) -> Option<&AtomicU64> {
        self.lines
            .get(word / LINE_WORDS)
            .map(|line| &line.0[word % LINE_WORDS])
    }

    /// Adds `value` to `word`, wrapping (a gauge adds a negative value as
    /// its two's complement). A word past the metric's is ignored.
    pub(crate) fn add(&self, word: usize, value: u64) {
        let Some(cell) = self.cell(word) else {
            return;
        };
        if self.owned {
            // The only writer of this cell: nothing comes between the load
            // and the store.
            cell.store(
                cell.load(Ordering::Relaxed).wrapping_add(value),
                Ordering::Relaxed,
            );
        } else {
            cell.fetch_add(value, Ordering::Relaxed);
        }
    }

    /// Adds `value` to `word` read as the bits of an `f64`.
    pub(crate) fn add_f64(&self, word: usize, value: f64) {
        let Some(cell) = self.cell(word) else {
            return;
        };
        let plus = |bits: u64| (f64::from_bits(bits) + value).to_bits();
        if self.owned {
            cell.store(plus(cell.load(Ordering::Relaxed)), Ordering::Relaxed);
            return;
        }
        let mut current = cell.load(Ordering::Relaxed);
        while let Err(actual) =
            cell.compare_exchange_weak(current, plus(current), Ordering::Relaxed, Ordering::Relaxed)
        {
            current = actual;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn example() {
        let counts = ShardedWords::new(2);
        counts.add(0, 3);
        counts.add_f64(1, 0.25);
        std::thread::scope(|scope| {
            scope.spawn(|| counts.add(0, 4));
        });
        assert_eq!(counts.sum(0), 7);
        assert_eq!(counts.sum_f64(1), 0.25);
    }

    #[test]
    fn every_thread_counts_once_whether_it_owns_a_shard_or_shares_the_last() {
        let words = ShardedWords::new(3);
        // More threads than any machine gives shards to own: the later ones
        // share the last shard.
        let threads = OWNED_SHARDS_MAX * 2 + 3;
        std::thread::scope(|scope| {
            for _ in 0..threads {
                scope.spawn(|| {
                    for _ in 0..1000 {
                        words.add(0, 1);
                        words.add(2, u64::MAX); // -1
                        words.add_f64(1, 0.5);
                    }
                });
            }
        });
        assert_eq!(words.sum(0), threads as u64 * 1000);
        assert_eq!(words.sum(2) as i64, -(threads as i64) * 1000);
        assert_eq!(words.sum_f64(1), threads as f64 * 500.0);
    }

    #[test]
    fn a_thread_keeps_its_index_and_shards_do_not_share_lines() {
        assert_eq!(thread_index(), thread_index());
        let words = ShardedWords::new(LINE_WORDS + 1);
        assert_eq!(words.lines_per_shard, 2);
        let (Some(first), Some(second)) = (words.word(0, 0), words.word(1, 0)) else {
            panic!("shards missing");
        };
        let distance = (second as *const AtomicU64 as usize) - (first as *const AtomicU64 as usize);
        assert!(distance >= 64 && distance.is_multiple_of(64));
        // A word past the last is ignored, not a panic.
        words.add(LINE_WORDS * 2, 1);
        assert_eq!(words.sum(LINE_WORDS * 2), 0);
    }
}
