//! Measures engine steps per second for a 16-worker fleet at full load.
//!
//! ```text
//! cargo run --release -p engine-model --example fleet_steps [-- STEPS]
//! ```
//!
//! Every worker (default parameters, prefix cache on) is kept saturated: its
//! waiting queue never drops below 64 requests (prompts 64..4096 tokens with a
//! shared 512-token prefix on a third of them, outputs 16..512 tokens), so
//! every step runs a full batch of up to 256 requests with chunked prefill.
//! The fleet is advanced in virtual time, always stepping the worker whose
//! next step starts first, as the simulator does.

use std::time::Instant;

use engine_model::{Engine, EngineError, EngineEvent, EngineParams, EngineRequest, SplitMix64};

const WORKERS: usize = 16;
const MIN_WAITING: u32 = 64;

fn main() -> Result<(), EngineError> {
    let total_steps: u64 = std::env::args()
        .nth(1)
        .and_then(|arg| arg.parse().ok())
        .unwrap_or(2_000_000);
    let mut engines = (0..WORKERS)
        .map(|index| Engine::new(EngineParams::default(), index as u64))
        .collect::<Result<Vec<_>, _>>()?;
    let mut rng = SplitMix64::new(0x1234_5678);
    let mut next_u64 = move || rng.next_u64();
    let shared_prefix: Vec<u64> = (0..32).collect();
    let mut next_id = 0u64;
    let mut events = Vec::with_capacity(1024);
    let mut finished = 0u64;
    let mut generated_tokens = 0u64;
    let mut virtual_s = 0.0f64;

    let started = Instant::now();
    for _ in 0..total_steps {
        // The worker whose next step starts first.
        let mut chosen = 0;
        let mut earliest = f64::INFINITY;
        for (index, engine) in engines.iter().enumerate() {
            let start = engine.next_step_start_s().unwrap_or(virtual_s);
            if start < earliest {
                earliest = start;
                chosen = index;
            }
        }
        virtual_s = earliest;
        let engine = &mut engines[chosen];
        while engine.waiting_requests() < MIN_WAITING {
            next_id += 1;
            let prefix_block_hashes = if next_id.is_multiple_of(3) {
                shared_prefix.clone()
            } else {
                Vec::new()
            };
            engine.submit(EngineRequest {
                id: next_id,
                prompt_tokens: 64 + (next_u64() % 4032) as u32,
                output_tokens: 16 + (next_u64() % 496) as u32,
                arrival_s: virtual_s,
                prefix_block_hashes,
            })?;
        }
        events.clear();
        if let Some(summary) = engine.step(virtual_s, &mut events) {
            generated_tokens += u64::from(summary.decoding_requests);
        }
        finished += events
            .iter()
            .filter(|event| matches!(event, EngineEvent::Finished(_)))
            .count() as u64;
    }
    let elapsed_s = started.elapsed().as_secs_f64();
    let running: u32 = engines.iter().map(Engine::running_requests).sum();
    println!(
        "{WORKERS} workers, {total_steps} steps in {elapsed_s:.3} s wall: {:.0} steps/s; \
         {:.1} s virtual simulated ({:.0}× real time), {finished} requests finished, \
         {generated_tokens} decode tokens, {running} running at the end",
        total_steps as f64 / elapsed_s,
        virtual_s,
        virtual_s / elapsed_s,
    );
    Ok(())
}
