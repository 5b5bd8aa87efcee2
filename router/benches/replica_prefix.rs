//! What sharing prefix placements costs a replica: publishing one
//! dispatch's placement (the policy's coarsened blocks, coalescing, the
//! message's encoding) and receiving one from another replica (decoding,
//! and recording it in a `least_load` prefix index over 16 workers), for
//! 8k-token prompts hashed at the router's default 64-token blocks (32
//! index blocks of 256 tokens each).
//!
//! Names: `replica_prefix/publish/<placements per message>` and
//! `replica_prefix/receive/<placements per message>`; each reports the
//! time per placement (criterion's throughput in elements). A replica at
//! R requests a second behind N replicas spends R × publish + (N − 1) × R
//! × receive of a core on them.
//!
//! Run: `cargo bench -p router --features bench-internals --bench replica_prefix -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;
use std::time::Instant;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use policy_core::{
    Policy, PolicyContext, PolicyRegistry, PrefixBlocks, RequestInfo, TokenCount, WorkerId,
    WorkerInfo,
};
use router::bench_internals::wire::{self, Placement};
use router::bench_internals::{Metrics, PrefixCounters, coalesce, receive_prefix};

const WORKERS: u32 = 16;
const PROMPT_TOKENS: u64 = 8192;
const ROUTER_BLOCK_TOKENS: u32 = 64;

/// `least_load` with its defaults over the 16 workers.
fn policy() -> Result<Box<dyn Policy>, policy_core::PolicyError> {
    let mut registry = PolicyRegistry::with_baselines();
    policy_least_load::register(&mut registry);
    let policy = registry.build(
        "least_load",
        &serde_json::Value::Null,
        &PolicyContext::default(),
    )?;
    for slot in 0..WORKERS {
        policy.add_worker(WorkerId::new(slot, 0), WorkerInfo::new(url(slot), "sglang"));
    }
    Ok(policy)
}

fn url(slot: u32) -> String {
    format!("http://10.0.0.{slot}:30000")
}

/// Request `i`'s prompt: its own 8k tokens of chained block hashes.
fn request(i: u64) -> RequestInfo {
    let blocks = PROMPT_TOKENS / u64::from(ROUTER_BLOCK_TOKENS);
    let mut hash = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let hashes: Vec<u64> = (0..blocks)
        .map(|_| {
            hash ^= hash << 13;
            hash ^= hash >> 7;
            hash ^= hash << 17;
            hash
        })
        .collect();
    RequestInfo::new(TokenCount::Estimated(PROMPT_TOKENS))
        .prefix_blocks(PrefixBlocks::new(ROUTER_BLOCK_TOKENS, hashes))
}

fn publish_and_receive(c: &mut Criterion) {
    let (sender, receiver) = match (policy(), policy()) {
        (Ok(sender), Ok(receiver)) => (sender, receiver),
        (Err(error), _) | (_, Err(error)) => {
            eprintln!("replica_prefix: least_load does not build: {error}");
            return;
        }
    };
    let urls: Vec<String> = (0..WORKERS).map(url).collect();
    let mut group = c.benchmark_group("replica_prefix");
    for per_message in [1usize, 20] {
        let requests: Vec<RequestInfo> = (0..per_message as u64).map(request).collect();
        group.throughput(Throughput::Elements(per_message as u64));
        group.bench_function(format!("publish/{per_message}"), |b| {
            let mut seq = 1u64;
            b.iter(|| {
                let mut placed: Vec<(WorkerId, PrefixBlocks)> = requests
                    .iter()
                    .enumerate()
                    .filter_map(|(i, request)| {
                        let worker = WorkerId::new(i as u32 % WORKERS, 0);
                        sender.placement(request).map(|blocks| (worker, blocks))
                    })
                    .collect();
                let mut bounds = Vec::new();
                coalesce(&mut placed, &mut bounds);
                let placements: Vec<Placement<'_>> = placed
                    .iter()
                    .map(|(worker, prefix)| Placement {
                        worker_url: &urls[worker.slot()],
                        prefix,
                    })
                    .collect();
                black_box(wire::encode_prefix(
                    "replica-a",
                    &mut seq,
                    &placements,
                    &[],
                    wire::MAX_MESSAGE_BYTES,
                ))
            })
        });

        // The message another replica sends, decoded and recorded here.
        let blocks: Vec<PrefixBlocks> = requests
            .iter()
            .filter_map(|request| sender.placement(request))
            .collect();
        let placements: Vec<Placement<'_>> = blocks
            .iter()
            .enumerate()
            .map(|(i, prefix)| Placement {
                worker_url: &urls[i % WORKERS as usize],
                prefix,
            })
            .collect();
        let mut seq = 1u64;
        let encoded = wire::encode_prefix(
            "replica-b",
            &mut seq,
            &placements,
            &[],
            wire::MAX_MESSAGE_BYTES,
        );
        let Some(message) = encoded.messages.first() else {
            eprintln!("replica_prefix: nothing was encoded");
            return;
        };
        let counters = PrefixCounters::new(&Metrics::new());
        let now = Instant::now();
        group.bench_function(format!("receive/{per_message}"), |b| {
            b.iter(|| {
                black_box(receive_prefix(
                    receiver.as_ref(),
                    "replica-a",
                    message,
                    now,
                    &counters,
                ))
            })
        });
        println!(
            "replica_prefix: {per_message} placement(s) of {PROMPT_TOKENS} tokens: {} bytes a message, {:.0} bytes a placement",
            message.len(),
            message.len() as f64 / per_message as f64
        );
    }
    group.finish();
}

criterion_group!(benches, publish_and_receive);
criterion_main!(benches);
