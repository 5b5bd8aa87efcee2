//! What recording one request's per-worker metrics costs when two threads
//! serve the same worker: the two selection counters, the status count, the
//! in-flight gauge up and down, and the three latency observations, as the
//! proxy records them (`WorkerMetrics`, per-thread shards), beside the same
//! records made with one shared atomic per value (prometheus-client's
//! `Counter` and `Gauge`, and a histogram with one shared set of cells, as
//! the router kept them before 2026-12-05).
//!
//! Names: `record/<per_thread|shared_atomics>/<1|2>-thread`; the 2-thread
//! figure is wall time per request with both threads recording (total time
//! / total requests), so two threads that never slow each other halve it.
//!
//! Run: `cargo bench -p router --features bench-internals --bench worker_metrics -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::Instant;

use criterion::{Criterion, criterion_group, criterion_main};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use router::bench_internals::{Metrics, WorkerMetrics};

/// A request's latencies, spread over the buckets as traffic would.
fn latency_secs(i: u64) -> f64 {
    0.0005 * (1 + i % 97) as f64
}

fn record_per_thread(worker: &WorkerMetrics, i: u64) {
    worker.in_flight.inc();
    worker.selections.inc();
    worker.dispatched_tokens.inc_by(200);
    worker.selected_score.observe(latency_secs(i));
    worker.time_to_first_byte.observe(latency_secs(i));
    worker.requests_ok.inc();
    worker.time_to_first_token.observe(latency_secs(i + 1));
    worker.request_duration.observe(latency_secs(i + 2));
    worker.in_flight.dec();
}

/// A histogram whose cells every thread shares: one atomic add to a bucket
/// and a compare-and-swap on the sum per observation.
struct SharedHistogram {
    bounds: Vec<f64>,
    counts: Vec<AtomicU64>,
    sum_bits: AtomicU64,
}

impl SharedHistogram {
    /// `count` bounds doubling from `first`, as the router's.
    fn new(first: f64, count: i32) -> SharedHistogram {
        let bounds: Vec<f64> = (0..count).map(|i| first * f64::powi(2.0, i)).collect();
        SharedHistogram {
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            bounds,
            sum_bits: AtomicU64::new(0),
        }
    }

    fn observe(&self, value: f64) {
        let bucket = self.bounds.partition_point(|bound| *bound < value);
        if let Some(count) = self.counts.get(bucket) {
            count.fetch_add(1, Ordering::Relaxed);
        }
        let mut current = self.sum_bits.load(Ordering::Relaxed);
        while let Err(actual) = self.sum_bits.compare_exchange_weak(
            current,
            (f64::from_bits(current) + value).to_bits(),
            Ordering::Relaxed,
            Ordering::Relaxed,
        ) {
            current = actual;
        }
    }
}

/// Each value its own allocation, as prometheus-client's handles are.
struct SharedAtomics {
    in_flight: Gauge,
    selections: Counter,
    dispatched_tokens: Counter,
    requests_ok: Counter,
    histograms: [Box<SharedHistogram>; 4],
}

fn record_shared(shared: &SharedAtomics, i: u64) {
    shared.in_flight.inc();
    shared.selections.inc();
    shared.dispatched_tokens.inc_by(200);
    shared.histograms[0].observe(latency_secs(i));
    shared.histograms[1].observe(latency_secs(i));
    shared.requests_ok.inc();
    shared.histograms[2].observe(latency_secs(i + 1));
    shared.histograms[3].observe(latency_secs(i + 2));
    shared.in_flight.dec();
}

/// What a run asks of each thread.
#[derive(Clone, Copy)]
enum Job {
    PerThread(u64),
    Shared(u64),
}

fn record(c: &mut Criterion) {
    let metrics = Metrics::new();
    let worker = WorkerMetrics::new(&metrics, "http://10.0.0.1:30000");
    let shared = SharedAtomics {
        in_flight: Gauge::default(),
        selections: Counter::default(),
        dispatched_tokens: Counter::default(),
        requests_ok: Counter::default(),
        // The score's bounds, then the latencies'.
        histograms: std::array::from_fn(|i| {
            Box::new(match i {
                0 => SharedHistogram::new(0.0001, 24),
                _ => SharedHistogram::new(0.001, 17),
            })
        }),
    };
    let run = |job: Job| match job {
        Job::PerThread(iters) => {
            for i in 0..iters {
                record_per_thread(black_box(&worker), i);
            }
        }
        Job::Shared(iters) => {
            for i in 0..iters {
                record_shared(black_box(&shared), i);
            }
        }
    };
    // The second thread lives for the whole benchmark, as a runtime's
    // worker threads do: each thread takes its metric shard once.
    std::thread::scope(|scope| {
        let (to_helper, jobs) = mpsc::channel::<Job>();
        let (helper_done, done) = mpsc::channel::<()>();
        scope.spawn(move || {
            for job in jobs {
                run(job);
                if helper_done.send(()).is_err() {
                    return;
                }
            }
        });
        // Wall time per request with `threads` threads each recording
        // `iters` requests.
        let timed = |threads: u32, job: Job| {
            let started = Instant::now();
            let helped = threads > 1 && to_helper.send(job).is_ok();
            run(job);
            if helped {
                let _ = done.recv();
            }
            started.elapsed() / threads
        };
        let mut group = c.benchmark_group("record");
        for threads in [1, 2] {
            group.bench_function(format!("per_thread/{threads}-thread"), |b| {
                b.iter_custom(|iters| timed(threads, Job::PerThread(iters)));
            });
            group.bench_function(format!("shared_atomics/{threads}-thread"), |b| {
                b.iter_custom(|iters| timed(threads, Job::Shared(iters)));
            });
        }
        group.finish();
        drop(to_helper);
    });
}

criterion_group!(benches, record);
criterion_main!(benches);
