//! Selection cost: `select` followed by `finish`, at 8, 64 and 512 workers,
//! on one thread and on two contending threads, for `least_load`,
//! `power_of_two`, the baselines, and the original design of the token-work
//! estimator (implemented below as `original`).
//!
//! Every worker carries a distinct load report, as in a busy fleet. Each
//! thread keeps a window of 16 dispatches open (it finishes the one from 16
//! selections ago before each new selection), so the pending work and the
//! choice move as they would under traffic. The policies are called through
//! `&dyn Policy`, as the router calls them.
//!
//! `least_load_prefix` is `least_load` with requests that carry their
//! prompt's block hashes: 64 workers, 8192-token prompts hashed in 16-token
//! blocks (the engines' block size; the index reads every 16th hash, one per
//! `prefix_index_block_tokens` = 256), 8192 distinct prompts that share 256
//! system prefixes of 4096 tokens. Every prompt is dispatched once before
//! measuring, so the index is warm (and, at the default
//! `prefix_index_max_blocks`, full: its sweeps are part of the cost), and each
//! selection includes the lookup and the record of its dispatch. Its 8192
//! prompts' hashes (32 MiB) are cold when a selection reads them;
//! `least_load_prefix_fresh` copies each request's hashes just before its
//! batch of 16 selections (untimed), as the router's hasher writes them
//! just before its selection, so the two rows' difference is the cost of
//! reading the request's own hashes from memory.
//!
//! `least_load` alone is also measured at 16, 256 and 4096 workers, so its
//! rows at 16 to 4096 show how selection cost grows with the fleet.
//! `least_load_idle` is `least_load` over an idle fleet (every worker
//! reports the same empty queue): all but the workers with open dispatches
//! tie, so every selection applies the tie rule across the whole fleet, as
//! in a lightly loaded production fleet.
//! `least_load_room/<workers>` is `least_load` as the admission gate calls
//! it for each request: the fleet's expected wait up to the first worker
//! with room (`expected_wait_within` 0.25 s), then the selection;
//! `least_load_room_deadline/<workers>` adds the chosen worker's wait
//! (`preview`), which a request with a TTFT deadline pays;
//! `least_load_room_exact/<workers>` asks the least wait over every
//! worker instead (`expected_wait`). Compare them with
//! `least_load/<workers>` (64 and 1024) of the same run.
//! `least_load_one_stale/1024` is `least_load/1024` after one worker's
//! poll failed: that worker has no fresh snapshot and is scored against
//! the fleet's mean rate, so the two rows' difference is what one worker
//! whose load cannot be read costs every selection.
//!
//! Names: `select/<policy>/<workers>` and `select/<policy>/<workers>/2-thread`.
//! The 2-thread figure is wall time per selection with both threads working
//! (total time / total selections), so two threads that scale perfectly halve
//! it. The time runs from the first thread's start, once both threads are
//! running (a barrier), to the last one's end; spawning and joining them is
//! not counted.
//!
//! `calibration/spin` and `calibration/spin/2-thread` run a loop that shares
//! nothing: their ratio is the parallelism the machine actually gave this run
//! (other processes on a shared machine take cores), the ceiling for any
//! 2-thread figure next to it.
//!
//! On a shared machine the wall clock of a 2-thread run also measures the
//! other processes. With `SELECT_CPU_SCALING=1` the bench then prints, per
//! policy and fleet size, the process CPU time per selection on one and on
//! two threads (Linux `/proc/self/stat`), with the spin calibration first:
//! time lost to contention (cache lines bouncing, lock spinning) shows up in
//! CPU time, time lost to other processes does not. `2 x cpu(1 thread) /
//! cpu(2 threads)` ("ceiling") is the speed-up two free cores would give, but
//! only when the two threads really ran at once: trust it when the
//! calibration's wall scaling is near 2. `SELECT_CPU_SCALING=least_load/64`
//! prints only the rows whose name contains that text.
//!
//! Run: `cargo bench -p policy-least-load -- --warm-up-time 1 --measurement-time 2`

use std::collections::HashMap;
use std::hint::black_box;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group};
use load_protocols::{SchedulerLoadSnapshot, WorkerLoad};
use parking_lot::RwLock;
use policy_core::{
    Dispatch, Policy, PolicyContext, PolicyRegistry, PrefixBlocks, RequestInfo, TokenCount,
    WorkerId, WorkerInfo,
};

const WORKER_COUNTS: [usize; 4] = [8, 64, 512, 1024];
/// Fleet sizes measured for `least_load` only.
const LEAST_LOAD_ONLY_COUNTS: [usize; 3] = [16, 256, 4096];
/// Fleet sizes of the admission rows (`least_load_room`).
const ROOM_COUNTS: [usize; 2] = [64, 1024];
const WINDOW: usize = 16;
const THREADS: usize = 2;
/// `least_load_reported_rate` is `least_load` with `rate = "reported"`, the
/// divisor before the learned rate: the learned rate's cost, side by side.
const POLICIES: [&str; 5] = [
    "least_load",
    "least_load_reported_rate",
    "power_of_two",
    "round_robin",
    "least_requests",
];

/// Fleet sizes of the `least_load_idle` rows.
const IDLE_COUNTS: [usize; 4] = [16, 64, 1024, 4096];

/// Worker `slot`'s report: a spread of queues, rates and KV usage.
fn report(slot: usize) -> (u64, f64, f64) {
    let queued_tokens = (slot as u64 * 7919) % 20_000;
    let throughput_tps = 1500.0 + ((slot * 31) % 1000) as f64;
    let kv_usage_ratio = 0.1 + ((slot * 17) % 50) as f64 / 100.0;
    (queued_tokens, throughput_tps, kv_usage_ratio)
}

fn url(slot: usize) -> String {
    format!("http://10.0.{}.{}:30000", slot / 256, slot % 256)
}

/// Prompt sizes cycle through a skewed mix.
fn request(i: usize) -> RequestInfo {
    const SIZES: [u64; 8] = [200, 180, 240, 6000, 210, 190, 220, 1500];
    RequestInfo::new(TokenCount::Exact(SIZES[i % SIZES.len()]))
}

type Setup<T> = Result<T, Box<dyn std::error::Error>>;

fn build(name: &str, workers: usize, now: Instant) -> Setup<(Box<dyn Policy>, Vec<WorkerId>)> {
    let mut registry = PolicyRegistry::with_baselines();
    policy_least_load::register(&mut registry);
    let (registered, section) = match name {
        "least_load_reported_rate" => ("least_load", serde_json::json!({"rate": "reported"})),
        "least_load_idle" => ("least_load", serde_json::Value::Null),
        other => (other, serde_json::Value::Null),
    };
    // An idle fleet: every worker reports the same empty queue, so all but
    // the few with open dispatches tie and the tie rule decides.
    let report = |slot| match name {
        "least_load_idle" => (0, 2000.0, 0.1),
        _ => report(slot),
    };
    let policy = registry.build(registered, &section, &PolicyContext::default())?;
    let ids: Vec<WorkerId> = (0..workers)
        .map(|slot| WorkerId::new(slot as u32, 0))
        .collect();
    for id in &ids {
        let slot = id.slot();
        policy.add_worker(*id, WorkerInfo::new(url(slot), "sglang"));
        let (queued, tps, kv) = report(slot);
        let rank = SchedulerLoadSnapshot {
            num_waiting_reqs: (queued / 1000) as i64,
            num_waiting_uncached_tokens: Some(queued as i64),
            gen_throughput: Some(tps),
            token_usage: kv,
            ..SchedulerLoadSnapshot::default()
        };
        let load = WorkerLoad::from_ranks(vec![rank])?;
        let mark = policy.poll_started(*id, now);
        policy.poll_completed(mark, Some(&load), now);
    }
    Ok((policy, ids))
}

/// `iters` selections, each after finishing the one WINDOW selections back.
fn run(policy: &dyn Policy, ids: &[WorkerId], iters: u64, now: Instant) {
    run_from(policy, ids, 0, iters, now, Duration::ZERO);
}

/// [`run`] from selection `from`, the clock moving `tick` per selection.
/// The idle rows move it a nanosecond, as a router's clock moves between
/// requests, so workers are last dispatched to at distinct times and the
/// tie rule has an oldest to find (a nanosecond, so that the reports stay
/// fresh over any number of iterations).
fn run_from(
    policy: &dyn Policy,
    ids: &[WorkerId],
    from: usize,
    iters: u64,
    now: Instant,
    tick: Duration,
) {
    let mut open: [Option<Dispatch>; WINDOW] = [None; WINDOW];
    let mut at = now;
    for i in from..from + iters as usize {
        at = now + tick.saturating_mul(u32::try_from(i).unwrap_or(u32::MAX));
        select_in_window(policy, ids, &mut open, i, &request(i), at);
    }
    finish_window(policy, &open, at);
}

/// How the admission gate asks the fleet's expected wait before a selection.
#[derive(Clone, Copy)]
enum Gate {
    /// The least wait over every candidate (`expected_wait`).
    Exact,
    /// Up to the first candidate with room (`expected_wait_within` the
    /// default 0.25 s threshold), as the gate asks it.
    Within,
    /// As `Within`, then the chosen worker's wait (`preview`), as for a
    /// request with a TTFT deadline.
    WithinAndChosen,
}

/// The room's default lowest threshold, seconds.
const ROOM_THRESHOLD_SECS: f64 = 0.25;

/// [`run`] with the admission gate's calls before each selection.
fn run_admitted(policy: &dyn Policy, ids: &[WorkerId], iters: u64, now: Instant, gate: Gate) {
    let mut open: [Option<Dispatch>; WINDOW] = [None; WINDOW];
    for i in 0..iters as usize {
        let request = request(i);
        match gate {
            Gate::Exact => {
                black_box(policy.expected_wait(ids, &request, now));
            }
            Gate::Within => {
                black_box(policy.expected_wait_within(ids, &request, now, ROOM_THRESHOLD_SECS));
            }
            Gate::WithinAndChosen => {
                black_box(policy.expected_wait_within(ids, &request, now, ROOM_THRESHOLD_SECS));
                black_box(policy.preview(ids, &request, now));
            }
        }
        select_in_window(policy, ids, &mut open, i, &request, now);
    }
    finish_window(policy, &open, now);
}

/// The prefix rows' fleet size and traffic (see the module docs).
const PREFIX_WORKERS: usize = 64;
const PROMPT_TOKENS: usize = 8192;
const ENGINE_BLOCK_TOKENS: usize = 16;
const SHARED_PREFIXES: usize = 256;
const SHARED_PREFIX_TOKENS: usize = 4096;
const PROMPTS: usize = 8192;

/// One step of a chained block hash (the value names the whole prefix).
fn chain(previous: u64, content: u64) -> u64 {
    let mixed = (previous ^ content.wrapping_mul(0x9e37_79b9_7f4a_7c15))
        .wrapping_mul(0xbf58_476d_1ce4_e5b9)
        .rotate_left(29);
    mixed ^ (mixed >> 31)
}

/// `PROMPTS` prompts: prompt `p` is shared prefix `p % SHARED_PREFIXES`
/// followed by its own tokens.
fn prefix_prompts() -> Vec<RequestInfo> {
    let blocks = PROMPT_TOKENS / ENGINE_BLOCK_TOKENS;
    let shared_blocks = SHARED_PREFIX_TOKENS / ENGINE_BLOCK_TOKENS;
    (0..PROMPTS)
        .map(|prompt| {
            let group = (prompt % SHARED_PREFIXES) as u64;
            let mut previous = 0;
            let hashes: Vec<u64> = (0..blocks)
                .map(|block| {
                    let content = if block < shared_blocks {
                        (group << 32) | block as u64
                    } else {
                        (1 << 63) | ((prompt as u64) << 32) | block as u64
                    };
                    previous = chain(previous, content);
                    previous
                })
                .collect();
            RequestInfo::new(TokenCount::Exact(PROMPT_TOKENS as u64))
                .prefix_blocks(PrefixBlocks::new(ENGINE_BLOCK_TOKENS as u32, hashes))
        })
        .collect()
}

/// `iters` selections over `prompts` from `start` on, each after finishing
/// the one WINDOW selections back.
fn run_prompts(
    policy: &dyn Policy,
    ids: &[WorkerId],
    prompts: &[RequestInfo],
    start: usize,
    iters: u64,
    now: Instant,
) {
    let mut open: [Option<Dispatch>; WINDOW] = [None; WINDOW];
    for i in 0..iters as usize {
        select_in_window(
            policy,
            ids,
            &mut open,
            i,
            &prompts[(start + i) % prompts.len()],
            now,
        );
    }
    finish_window(policy, &open, now);
}

/// Selection `i` of a run: finishes the one WINDOW selections back, then
/// selects for `request`.
fn select_in_window(
    policy: &dyn Policy,
    ids: &[WorkerId],
    open: &mut [Option<Dispatch>; WINDOW],
    i: usize,
    request: &RequestInfo,
    now: Instant,
) {
    if let Some(dispatch) = open[i % WINDOW].take() {
        policy.finish(&dispatch, now);
    }
    open[i % WINDOW] = black_box(policy.select(ids, request, now));
}

/// Finishes the dispatches a run left open.
fn finish_window(policy: &dyn Policy, open: &[Option<Dispatch>; WINDOW], now: Instant) {
    for dispatch in open.iter().flatten() {
        policy.finish(dispatch, now);
    }
}

/// Requests handed to the policy between two reads of the clock in
/// [`run_fresh_prompts`]: their hashes (4 KiB each) stay in the core's cache.
const FRESH_BATCH: usize = 16;

/// [`run_prompts`], but each request's hashes are copied into a fresh
/// allocation just before its batch is selected, untimed, as the router's
/// hasher writes them just before its selection; returns the time spent
/// selecting.
fn run_fresh_prompts(
    policy: &dyn Policy,
    ids: &[WorkerId],
    prompts: &[RequestInfo],
    start: usize,
    iters: u64,
    now: Instant,
) -> Duration {
    let mut open: [Option<Dispatch>; WINDOW] = [None; WINDOW];
    let mut selecting = Duration::ZERO;
    let mut batch: Vec<RequestInfo> = Vec::with_capacity(FRESH_BATCH);
    let mut done = 0usize;
    while done < iters as usize {
        let size = FRESH_BATCH.min(iters as usize - done);
        batch.clear();
        batch.extend((done..done + size).map(|i| {
            let prompt = &prompts[(start + i) % prompts.len()];
            RequestInfo::new(prompt.tokens).prefix_blocks(PrefixBlocks::new(
                prompt.prefix.block_tokens(),
                prompt.prefix.hashes().to_vec(),
            ))
        }));
        let began = Instant::now();
        for (offset, request) in batch.iter().enumerate() {
            select_in_window(policy, ids, &mut open, done + offset, request, now);
        }
        selecting += began.elapsed();
        done += size;
    }
    finish_window(policy, &open, now);
    selecting
}

/// A `least_load` fleet whose prefix index has seen every prompt once, and
/// where the next run should start in the prompts (each run, and each
/// thread, goes on where the last left off, so prompts come round in turn).
fn prefix_fleet(
    prompts: &[RequestInfo],
    now: Instant,
) -> Setup<(Box<dyn Policy>, Vec<WorkerId>, AtomicUsize)> {
    let (policy, ids) = build("least_load", PREFIX_WORKERS, now)?;
    run_prompts(policy.as_ref(), &ids, prompts, 0, prompts.len() as u64, now);
    Ok((policy, ids, AtomicUsize::new(0)))
}

/// Wall time per operation with `THREADS` threads each doing `iters`.
fn contended(iters: u64, op: impl Fn(u64) + Sync) -> Duration {
    // Timed from the first thread's start, once every thread is running, to
    // the last one's end: spawning and joining are not the operation's, and
    // a thread timed from its spawn would run alone, uncontended, while the
    // next one starts. The threads read the clock themselves: on a 2-core
    // machine the spawning thread may not run again until they are done.
    let ready = std::sync::Barrier::new(THREADS);
    let spans: Vec<(Instant, Instant)> = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..THREADS)
            .map(|_| {
                scope.spawn(|| {
                    ready.wait();
                    let start = Instant::now();
                    op(iters);
                    (start, Instant::now())
                })
            })
            .collect();
        threads
            .into_iter()
            .filter_map(|thread| thread.join().ok())
            .collect()
    });
    let first_start = spans.iter().map(|(start, _)| *start).min();
    let last_end = spans.iter().map(|(_, end)| *end).max();
    match (first_start, last_end) {
        (Some(start), Some(end)) => end.saturating_duration_since(start) / THREADS as u32,
        _ => Duration::ZERO,
    }
}

/// The original design, as its pull request built it: loads and the
/// since-poll tally in `RwLock<HashMap<String, _>>`s keyed by worker URL, the
/// tally's write lock held while every worker is scored, and the winner's URL
/// cloned to credit it.
struct Original {
    urls: Vec<String>,
    loads: RwLock<HashMap<String, OriginalLoad>>,
    since_poll: RwLock<HashMap<String, u64>>,
    kv_pressure_weight: f64,
    default_throughput: f64,
}

#[derive(Clone, Copy)]
struct OriginalLoad {
    queued_tokens: u64,
    throughput_tps: f64,
    kv_usage_ratio: f64,
}

impl Original {
    fn new(workers: usize) -> Original {
        let urls: Vec<String> = (0..workers).map(url).collect();
        let loads = urls
            .iter()
            .enumerate()
            .map(|(slot, url)| {
                let (queued_tokens, throughput_tps, kv_usage_ratio) = report(slot);
                let load = OriginalLoad {
                    queued_tokens,
                    throughput_tps,
                    kv_usage_ratio,
                };
                (url.clone(), load)
            })
            .collect();
        Original {
            urls,
            loads: RwLock::new(loads),
            since_poll: RwLock::new(HashMap::new()),
            kv_pressure_weight: 0.15,
            default_throughput: 2000.0,
        }
    }

    fn select(&self, healthy: &[usize], tokens: u64) -> Option<usize> {
        let mut tally = self.since_poll.write();
        let loads = self.loads.read();
        // Fleet-nominal throughput over the healthy workers with a load.
        let (sum_tps, count) = healthy
            .iter()
            .filter_map(|&i| loads.get(&self.urls[i]))
            .map(|load| load.throughput_tps)
            .filter(|tps| *tps > 0.0)
            .fold((0.0, 0u32), |(sum, n), tps| (sum + tps, n + 1));
        let nominal = if count > 0 {
            sum_tps / f64::from(count)
        } else {
            self.default_throughput
        };
        let mut best: Option<(usize, f64)> = None;
        for &i in healthy {
            let url = &self.urls[i];
            let inflight = tally.get(url).copied().unwrap_or(0) as f64;
            let score = match loads.get(url) {
                Some(load) => {
                    let tps = if load.throughput_tps > 0.0 {
                        load.throughput_tps
                    } else {
                        self.default_throughput
                    };
                    let k = load.kv_usage_ratio.clamp(0.0, 0.999);
                    (load.queued_tokens as f64 + inflight) / tps
                        + self.kv_pressure_weight * k / (1.0 - k)
                }
                None => inflight / nominal,
            };
            if best.is_none_or(|(_, best_score)| score < best_score) {
                best = Some((i, score));
            }
        }
        let (winner, _) = best?;
        let winner_url = self.urls[winner].clone();
        *tally.entry(winner_url).or_insert(0) += tokens;
        Some(winner)
    }
}

fn run_original(original: &Original, healthy: &[usize], iters: u64) {
    for i in 0..iters as usize {
        let tokens = request(i).tokens.or(1024);
        // Its finish releases nothing: the tally is reset by polls.
        black_box(original.select(healthy, tokens));
    }
}

/// Work that shares nothing between threads: an LCG step per iteration.
/// 64 steps of a linear congruential generator per iteration, each step's
/// value passed through `black_box`: without that barrier the optimizer
/// may fuse steps (the affine maps compose), and the release profile's
/// fat LTO made this loop eight times faster than the same source had run
/// before, which no longer said anything about the machine.
fn spin(iters: u64) {
    let mut state = black_box(0x9e37_79b9_7f4a_7c15u64);
    for _ in 0..iters * 64 {
        state = black_box(
            state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1),
        );
    }
    black_box(state);
}

fn calibration(c: &mut Criterion) {
    let mut group = c.benchmark_group("calibration");
    group.bench_function("spin", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            spin(iters);
            start.elapsed()
        });
    });
    group.bench_function("spin/2-thread", |b| {
        b.iter_custom(|iters| contended(iters, spin))
    });
    group.finish();
}

fn select(c: &mut Criterion) {
    if let Err(err) = select_all(c) {
        eprintln!("select benchmark setup failed: {err}");
        std::process::exit(1);
    }
}

fn select_all(c: &mut Criterion) -> Setup<()> {
    let mut group = c.benchmark_group("select");
    let now = Instant::now();
    for workers in WORKER_COUNTS {
        for name in POLICIES {
            let (policy, ids) = build(name, workers, now)?;
            let policy = policy.as_ref();
            group.bench_function(format!("{name}/{workers}"), |b| {
                b.iter_custom(|iters| {
                    let start = Instant::now();
                    run(policy, &ids, iters, now);
                    start.elapsed()
                });
            });
            group.bench_function(format!("{name}/{workers}/2-thread"), |b| {
                b.iter_custom(|iters| contended(iters, |iters| run(policy, &ids, iters, now)));
            });
        }
        if workers == PREFIX_WORKERS {
            let prompts = prefix_prompts();
            let (policy, ids, next) = prefix_fleet(&prompts, now)?;
            let policy = policy.as_ref();
            let run_prefix = |iters: u64| {
                let start = next.fetch_add(iters as usize, Ordering::Relaxed);
                run_prompts(policy, &ids, &prompts, start, iters, now);
            };
            group.bench_function(format!("least_load_prefix/{workers}"), |b| {
                b.iter_custom(|iters| {
                    let start = Instant::now();
                    run_prefix(iters);
                    start.elapsed()
                });
            });
            group.bench_function(format!("least_load_prefix/{workers}/2-thread"), |b| {
                b.iter_custom(|iters| contended(iters, run_prefix));
            });
            group.bench_function(format!("least_load_prefix_fresh/{workers}"), |b| {
                b.iter_custom(|iters| {
                    let start = next.fetch_add(iters as usize, Ordering::Relaxed);
                    run_fresh_prompts(policy, &ids, &prompts, start, iters, now)
                });
            });
        }
        let original = Original::new(workers);
        let healthy: Vec<usize> = (0..workers).collect();
        group.bench_function(format!("original/{workers}"), |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                run_original(&original, &healthy, iters);
                start.elapsed()
            });
        });
        group.bench_function(format!("original/{workers}/2-thread"), |b| {
            b.iter_custom(|iters| {
                contended(iters, |iters| run_original(&original, &healthy, iters))
            });
        });
    }
    for workers in IDLE_COUNTS {
        let (policy, ids) = build("least_load_idle", workers, now)?;
        let policy = policy.as_ref();
        let clock = AtomicUsize::new(0);
        group.bench_function(format!("least_load_idle/{workers}"), |b| {
            b.iter_custom(|iters| {
                let from = clock.fetch_add(iters as usize, Ordering::Relaxed);
                let start = Instant::now();
                run_from(policy, &ids, from, iters, now, Duration::from_nanos(1));
                start.elapsed()
            });
        });
    }
    {
        let (policy, ids) = build("least_load", 1024, now)?;
        // The last worker's next poll fails: it keeps no fresh snapshot.
        if let Some(stale) = ids.last() {
            let mark = policy.poll_started(*stale, now);
            policy.poll_failed(mark, now);
        }
        let policy = policy.as_ref();
        group.bench_function("least_load_one_stale/1024", |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                run(policy, &ids, iters, now);
                start.elapsed()
            });
        });
    }
    for workers in ROOM_COUNTS {
        let (policy, ids) = build("least_load", workers, now)?;
        let policy = policy.as_ref();
        for (row, gate) in [
            ("least_load_room_exact", Gate::Exact),
            ("least_load_room", Gate::Within),
            ("least_load_room_deadline", Gate::WithinAndChosen),
        ] {
            group.bench_function(format!("{row}/{workers}"), |b| {
                b.iter_custom(|iters| {
                    let start = Instant::now();
                    run_admitted(policy, &ids, iters, now, gate);
                    start.elapsed()
                });
            });
        }
    }
    for workers in LEAST_LOAD_ONLY_COUNTS {
        let (policy, ids) = build("least_load", workers, now)?;
        let policy = policy.as_ref();
        group.bench_function(format!("least_load/{workers}"), |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                run(policy, &ids, iters, now);
                start.elapsed()
            });
        });
        group.bench_function(format!("least_load/{workers}/2-thread"), |b| {
            b.iter_custom(|iters| contended(iters, |iters| run(policy, &ids, iters, now)));
        });
    }
    group.finish();
    Ok(())
}

/// This process's CPU time (user + system), if the platform shows it.
fn process_cpu() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat.get(stat.rfind(')')? + 2..)?.split(' ').collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // USER_HZ is 100 on every mainstream Linux.
    Some(Duration::from_millis(ticks * 10))
}

/// Wall and CPU time of `threads` threads each running `op(iters)`.
fn measure(threads: usize, iters: u64, op: &(impl Fn(u64) + Sync)) -> Option<(Duration, Duration)> {
    let cpu_before = process_cpu()?;
    let start = Instant::now();
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| op(iters));
        }
    });
    let wall = start.elapsed();
    Some((wall, process_cpu()?.saturating_sub(cpu_before)))
}

/// Prints one row of the CPU-time scaling table, unless `SELECT_CPU_SCALING`
/// names rows (`SELECT_CPU_SCALING=least_load/64`) and this is not one.
fn cpu_scaling_row(name: &str, op: impl Fn(u64) + Sync) -> Option<()> {
    let filter = std::env::var("SELECT_CPU_SCALING").unwrap_or_default();
    if !(filter == "1" || name.contains(filter.as_str()) || name.starts_with("calibration")) {
        return Some(());
    }
    // Size the runs to about half a second each (CPU time has 10 ms ticks).
    let (pilot, _) = measure(1, 2000, &op)?;
    let per_op_ns = (pilot.as_nanos() / 2000).max(1);
    let iters = (500_000_000 / per_op_ns).max(1000) as u64;
    let (wall_1, cpu_1) = measure(1, iters, &op)?;
    let (wall_2, cpu_2) = measure(THREADS, iters, &op)?;
    let ns_per_op = |time: Duration, ops: u64| time.as_nanos() as f64 / ops as f64;
    let cpu_1_ns = ns_per_op(cpu_1, iters);
    let cpu_2_ns = ns_per_op(cpu_2, iters * THREADS as u64);
    println!(
        "{name:<32} {:>10.0} {:>10.0} {:>10.0} {:>9.2} {:>9.2}",
        ns_per_op(wall_1, iters),
        cpu_1_ns,
        cpu_2_ns,
        THREADS as f64 * cpu_1_ns / cpu_2_ns,
        THREADS as f64 * wall_1.as_secs_f64() / wall_2.as_secs_f64(),
    );
    Some(())
}

fn cpu_scaling() -> Setup<()> {
    println!(
        "\n{:<32} {:>10} {:>10} {:>10} {:>9} {:>9}",
        "cpu scaling", "wall 1t", "cpu/op 1t", "cpu/op 2t", "ceiling", "wall 2t/1t"
    );
    let missing = || "no /proc/self/stat: CPU time unavailable";
    cpu_scaling_row("calibration/spin", spin).ok_or_else(missing)?;
    let now = Instant::now();
    for workers in WORKER_COUNTS {
        for name in POLICIES {
            let (policy, ids) = build(name, workers, now)?;
            let policy = policy.as_ref();
            cpu_scaling_row(&format!("select/{name}/{workers}"), |iters| {
                run(policy, &ids, iters, now)
            })
            .ok_or_else(missing)?;
        }
        if workers == PREFIX_WORKERS {
            let prompts = prefix_prompts();
            let (policy, ids, next) = prefix_fleet(&prompts, now)?;
            cpu_scaling_row(&format!("select/least_load_prefix/{workers}"), |iters| {
                let start = next.fetch_add(iters as usize, Ordering::Relaxed);
                run_prompts(policy.as_ref(), &ids, &prompts, start, iters, now);
            })
            .ok_or_else(missing)?;
        }
        let original = Original::new(workers);
        let healthy: Vec<usize> = (0..workers).collect();
        cpu_scaling_row(&format!("select/original/{workers}"), |iters| {
            run_original(&original, &healthy, iters)
        })
        .ok_or_else(missing)?;
    }
    Ok(())
}

criterion_group!(benches, calibration, select);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    if std::env::var_os("SELECT_CPU_SCALING").is_some()
        && let Err(err) = cpu_scaling()
    {
        eprintln!("cpu scaling: {err}");
    }
}
