//! The engine model against values derived by hand (`docs/engine-model.md`).

// Test helpers (not only #[test] fns) may unwrap: a panic is a failed assertion.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use engine_model::reports::sglang_loads;
use engine_model::{Engine, EngineEvent, EngineParams, EngineRequest, RequestRecord, SplitMix64};

const EPS: f64 = 1e-9;

fn close(actual: f64, expected: f64) -> bool {
    (actual - expected).abs() < EPS
}

fn request(id: u64, prompt_tokens: u32, output_tokens: u32, arrival_s: f64) -> EngineRequest {
    EngineRequest {
        id,
        prompt_tokens,
        output_tokens,
        arrival_s,
        prefix_block_hashes: Vec::new(),
    }
}

/// Runs the engine until idle, returning the finished records sorted by id.
/// Checks the KV invariant after every step.
fn drain(engine: &mut Engine) -> Vec<RequestRecord> {
    let mut events = Vec::new();
    let mut records = Vec::new();
    while let Some(start_s) = engine.next_step_start_s() {
        events.clear();
        engine.step(start_s, &mut events).unwrap();
        assert!(engine.used_kv_tokens() <= engine.params().kv_capacity_tokens);
        records.extend(events.iter().filter_map(|event| match event {
            EngineEvent::Finished(record) => Some(*record),
            _ => None,
        }));
    }
    records.sort_by_key(|record| record.id);
    records
}

fn no_cache() -> EngineParams {
    EngineParams {
        prefix_cache: false,
        ..EngineParams::default()
    }
}

#[test]
fn ttft_grows_with_the_uncached_prompt() {
    // 1000 tokens fit in one chunk: 1000 / 8000 tps = 0.125 s.
    let mut engine = Engine::new(no_cache(), 1).unwrap();
    engine.submit(request(1, 1000, 1, 0.0)).unwrap();
    let short = drain(&mut engine)[0];
    assert!(close(short.ttft_s(), 0.125), "{short:?}");

    // 4000 tokens take two chunks: 2048 / 8000 + 1952 / 8000 = 0.5 s.
    let mut engine = Engine::new(no_cache(), 1).unwrap();
    engine.submit(request(2, 4000, 1, 0.0)).unwrap();
    let long = drain(&mut engine)[0];
    assert!(close(long.ttft_s(), 0.5), "{long:?}");
    assert!(long.ttft_s() > short.ttft_s());
}

#[test]
fn ttft_grows_with_the_queue_ahead() {
    // Three 2048-token prompts at t=0: each fills a whole chunk, so they
    // prefill one per step of 2048 / 8000 = 0.256 s (the decode of the
    // earlier ones, 6.35 or 6.7 ms, is hidden under the prefill cost).
    let mut engine = Engine::new(no_cache(), 1).unwrap();
    for id in 0..3 {
        engine.submit(request(id, 2048, 2, 0.0)).unwrap();
    }
    let records = drain(&mut engine);
    let ttfts: Vec<f64> = records.iter().map(RequestRecord::ttft_s).collect();
    assert!(close(ttfts[0], 0.256), "{ttfts:?}");
    assert!(close(ttfts[1], 0.512), "{ttfts:?}");
    assert!(close(ttfts[2], 0.768), "{ttfts:?}");
    // A finished with its second token in step 2.
    assert!(close(records[0].finish_s, 0.512));
    // B and C were admitted when the chunk budget had room.
    assert!(close(records[1].admitted_s, 0.256));
    assert!(close(records[2].admitted_s, 0.512));
}

#[test]
fn inter_token_latency_grows_with_the_batch() {
    // n requests of 16 prompt tokens and 11 output tokens, all at t=0: one
    // prefill step, then 10 decode steps of (6 + 0.35 n) ms each.
    let itl = |batch: u64| {
        let mut engine = Engine::new(no_cache(), 1).unwrap();
        for id in 0..batch {
            engine.submit(request(id, 16, 11, 0.0)).unwrap();
        }
        let records = drain(&mut engine);
        assert_eq!(records.len() as u64, batch);
        records[0].mean_itl_s()
    };
    let single = itl(1);
    let large = itl(64);
    assert!(close(single, 0.006_35), "{single}");
    assert!(close(large, 0.0284), "{large}");
    assert!(large > single);

    // The first token of the batch of 64 came after 64 × 16 / 8000 = 0.128 s.
    let mut engine = Engine::new(no_cache(), 1).unwrap();
    for id in 0..64 {
        engine.submit(request(id, 16, 11, 0.0)).unwrap();
    }
    assert!(close(drain(&mut engine)[0].ttft_s(), 0.128));
}

#[test]
fn admission_stops_when_kv_is_full() {
    // 1000 KV tokens; each request needs 300 prompt + 1 first-token slot at
    // admission, so three fit (903) and the fourth waits. Each grows to
    // 300 + 30 = 330 tokens: 990 ≤ 1000, so nobody is preempted.
    let params = EngineParams {
        kv_capacity_tokens: 1000,
        ..no_cache()
    };
    let mut engine = Engine::new(params, 1).unwrap();
    for id in 0..4 {
        engine.submit(request(id, 300, 30, 0.0)).unwrap();
    }
    let mut events = Vec::new();
    let first = engine.step(0.0, &mut events).unwrap();
    assert_eq!(first.admitted_requests, 3);
    assert_eq!(first.prefill_tokens, 900);
    assert_eq!(engine.running_requests(), 3);
    assert_eq!(engine.waiting_requests(), 1);
    assert_eq!(engine.used_kv_tokens(), 903);
    assert_eq!(engine.queued_prefill_tokens(), 300);

    let records = drain(&mut engine);
    assert!(records.iter().all(|record| record.preemptions == 0));
    // The fourth was admitted only when the first three left.
    assert!(close(records[3].admitted_s, records[0].finish_s));
    assert_eq!(engine.snapshot(10.0).preemptions_total, 0);
}

#[test]
fn preemption_happens_and_the_request_still_completes() {
    // 1000 KV tokens, two requests of 400 + 200. Admission holds 802; each
    // decode step adds 2. After 99 decode steps 1000 are held, and the next
    // step needs 2 more: the newest (B, 100 tokens generated) is preempted,
    // requeued, and recomputed (500 tokens + 1) once A is done.
    let params = EngineParams {
        kv_capacity_tokens: 1000,
        ..no_cache()
    };
    let mut engine = Engine::new(params, 1).unwrap();
    engine.submit(request(0, 400, 200, 0.0)).unwrap();
    engine.submit(request(1, 400, 200, 0.0)).unwrap();

    let mut events = Vec::new();
    let mut preempted_at_step = None;
    let mut step_index = 0;
    while let Some(start_s) = engine.next_step_start_s() {
        let summary = engine.step(start_s, &mut events).unwrap();
        step_index += 1;
        if summary.preempted_requests > 0 {
            preempted_at_step = Some(step_index);
            assert_eq!(engine.waiting_requests(), 1);
            assert_eq!(engine.used_kv_tokens(), 500 + 1);
            assert_eq!(engine.queued_prefill_tokens(), 500);
            break;
        }
    }
    // Step 1 prefilled both, steps 2..=100 decoded, step 101 preempted.
    assert_eq!(preempted_at_step, Some(101));

    let records = drain(&mut engine);
    assert_eq!(records.len(), 2);
    assert_eq!(records[0].preemptions, 0);
    assert_eq!(records[1].preemptions, 1);
    assert!(records[1].finish_s > records[0].finish_s);
    // B was readmitted after A left and recomputed 500 tokens in one chunk.
    assert_eq!(engine.snapshot(100.0).preemptions_total, 1);
    assert_eq!(engine.used_kv_tokens(), 0);
}

#[test]
fn prefix_hits_cut_prefill() {
    let blocks: Vec<u64> = (0..64).collect();
    let with_prefix = |id: u64, hashes: Vec<u64>, arrival_s: f64| EngineRequest {
        prefix_block_hashes: hashes,
        ..request(id, 1024, 1, arrival_s)
    };
    let mut engine = Engine::new(EngineParams::default(), 1).unwrap();
    engine.submit(with_prefix(1, blocks.clone(), 0.0)).unwrap();
    let cold = drain(&mut engine)[0];
    // 1024 / 8000 = 0.128 s.
    assert!(close(cold.ttft_s(), 0.128));
    assert_eq!(cold.cached_tokens, 0);

    // Same prompt: 63 of 64 blocks hit (the last token is always computed),
    // so 16 tokens are prefilled: 16 / 8000 = 2 ms.
    engine.submit(with_prefix(2, blocks.clone(), 1.0)).unwrap();
    let warm = drain(&mut engine)[0];
    assert_eq!(warm.cached_tokens, 1008);
    assert!(close(warm.ttft_s(), 0.002), "{warm:?}");

    // Half the prefix shared: 32 blocks hit, 512 tokens prefilled: 0.064 s.
    let half: Vec<u64> = (0..32).chain(1000..1032).collect();
    engine.submit(with_prefix(3, half, 2.0)).unwrap();
    let partial = drain(&mut engine)[0];
    assert_eq!(partial.cached_tokens, 512);
    assert!(close(partial.ttft_s(), 0.064), "{partial:?}");

    // A different first block breaks the chain: nothing hits.
    let shifted: Vec<u64> = (1..65).collect();
    engine.submit(with_prefix(4, shifted, 3.0)).unwrap();
    let miss = drain(&mut engine)[0];
    assert_eq!(miss.cached_tokens, 0);
    assert!(close(miss.ttft_s(), 0.128));

    let snapshot = engine.snapshot(4.0);
    assert_eq!(snapshot.prefix_cache_hits_tokens_total, 1008 + 512);
    assert_eq!(snapshot.prefix_cache_queries_tokens_total, 4 * 1024);
}

#[test]
fn prefix_cache_evicts_lru_past_the_watermark() {
    // 2048 KV tokens, watermark 0.5: at most 1024 cached tokens survive a step.
    let params = EngineParams {
        kv_capacity_tokens: 2048,
        cache_high_watermark: 0.5,
        ..EngineParams::default()
    };
    let mut engine = Engine::new(params, 1).unwrap();
    let old: Vec<u64> = (0..48).collect();
    let new: Vec<u64> = (100..148).collect();
    for (id, hashes) in [(1, old.clone()), (2, new.clone())] {
        engine
            .submit(EngineRequest {
                prefix_block_hashes: hashes,
                ..request(id, 768, 1, id as f64)
            })
            .unwrap();
        drain(&mut engine);
    }
    // 1536 cached tokens are above the watermark; the next step evicts the
    // 32 least recently used blocks (512 tokens) down to 1024: the older
    // prompt's tail (its blocks are released tail first), so it keeps its
    // first 16 blocks (256 tokens) and the newer one still hits in full
    // (47 blocks: the last token is always computed).
    engine.submit(request(3, 1, 1, 5.0)).unwrap();
    drain(&mut engine);
    assert!(engine.used_kv_tokens() <= 1024);
    for (id, hashes, expected_cached) in [(4, new, 752), (5, old, 256)] {
        engine
            .submit(EngineRequest {
                prefix_block_hashes: hashes,
                ..request(id, 768, 1, 6.0 + id as f64)
            })
            .unwrap();
        let record = drain(&mut engine)[0];
        assert_eq!(record.cached_tokens, expected_cached, "request {id}");
    }
}

#[test]
fn cached_blocks_no_request_holds_are_reported_free() {
    let mut engine = Engine::new(EngineParams::default(), 1).unwrap();
    let hashes: Vec<u64> = (0..48).collect();
    engine
        .submit(EngineRequest {
            prefix_block_hashes: hashes.clone(),
            ..request(1, 768, 4, 0.0)
        })
        .unwrap();
    // While it runs, its cached blocks are in use.
    engine.step(0.0, &mut Vec::new()).unwrap();
    assert!(engine.snapshot(0.1).used_kv_tokens >= 768);
    drain(&mut engine);
    // Finished: the engine keeps its 48 blocks cached, but they are free
    // to evict, and the report says so (as SGLang's and vLLM's do).
    assert_eq!(engine.used_kv_tokens(), 768);
    let snapshot = engine.snapshot(10.0);
    assert_eq!(snapshot.used_kv_tokens, 0);
    assert_eq!(snapshot.kv_usage_ratio(), 0.0);
    // A new request holding the prefix puts them back in use.
    engine
        .submit(EngineRequest {
            prefix_block_hashes: hashes,
            ..request(2, 800, 4, 10.0)
        })
        .unwrap();
    engine.step(10.0, &mut Vec::new()).unwrap();
    assert!(engine.snapshot(10.1).used_kv_tokens >= 800);
}

#[test]
fn reported_queued_tokens_follow_a_hand_computed_trace() {
    // Prompts 3000, 1000, 500 at t=0; chunk 2048.
    // before:  all waiting                         → 3000 + 1000 + 500 = 4500
    // step 1:  A 2048 (952 left)                   → 952 + 1000 + 500 = 2452
    // step 2:  A 952, B 1000, C 96 (404 left)      → 404
    // step 3:  C 404                               → 0
    let mut engine = Engine::new(no_cache(), 1).unwrap();
    engine.submit(request(1, 3000, 5, 0.0)).unwrap();
    engine.submit(request(2, 1000, 5, 0.0)).unwrap();
    engine.submit(request(3, 500, 5, 0.0)).unwrap();

    let reported = |engine: &Engine, now_s: f64| {
        let body = sglang_loads(&engine.snapshot(now_s), String::new());
        let rank = &body.loads[0];
        (
            rank.num_waiting_uncached_tokens,
            rank.num_waiting_reqs,
            rank.num_running_reqs,
        )
    };
    assert_eq!(reported(&engine, 0.0), (Some(4500), 3, 0));
    let mut events = Vec::new();
    let trace = [
        (2452, 2, 1, 0.256),
        (404, 0, 3, 0.256),
        // 404 / 8000 = 50.5 ms beats 6 + 0.35 × 2 = 6.7 ms of decode.
        (0, 0, 3, 0.0505),
    ];
    for (queued, waiting, running, duration_s) in trace {
        let start_s = engine.next_step_start_s().unwrap();
        let summary = engine.step(start_s, &mut events).unwrap();
        assert!(close(summary.duration_s, duration_s), "{summary:?}");
        assert_eq!(
            reported(&engine, summary.end_s),
            (Some(queued), waiting, running)
        );
        assert_eq!(engine.queued_prefill_tokens() as i64, queued);
    }
}

#[test]
fn same_seed_gives_an_identical_trace() {
    let run = |seed: u64| {
        let params = EngineParams {
            step_jitter: 0.2,
            kv_capacity_tokens: 40_000,
            ..EngineParams::default()
        };
        let mut engine = Engine::new(params, seed).unwrap();
        // A workload drawn from the same seed: prompts 1..4096, outputs 1..256,
        // arrivals every 10 ms, a shared prefix on every third request.
        let mut rng = SplitMix64::new(seed);
        let mut next = || rng.next_u64();
        let mut arrivals: Vec<EngineRequest> = (0..300)
            .map(|id| EngineRequest {
                id,
                prompt_tokens: (next() % 4096) as u32 + 1,
                output_tokens: (next() % 256) as u32 + 1,
                arrival_s: id as f64 * 0.01,
                prefix_block_hashes: if id % 3 == 0 {
                    (0..32).collect()
                } else {
                    Vec::new()
                },
            })
            .collect();
        arrivals.reverse();
        let mut events = Vec::new();
        let mut records = Vec::new();
        loop {
            let next_arrival = arrivals.last().map(|r| r.arrival_s);
            match (next_arrival, engine.next_step_start_s()) {
                (Some(arrival_s), step) if step.is_none_or(|s| arrival_s <= s) => {
                    let request = arrivals.pop().unwrap();
                    engine.submit(request).unwrap();
                }
                (_, Some(start_s)) => {
                    engine.step(start_s, &mut events).unwrap();
                }
                (None, None) => break,
                (Some(_), None) => unreachable!(),
            }
        }
        for event in events {
            if let EngineEvent::Finished(record) = event {
                records.push(record);
            }
        }
        (records, engine.snapshot(1e6))
    };
    let (first, first_state) = run(7);
    let (second, second_state) = run(7);
    assert_eq!(first.len(), 300);
    assert_eq!(first, second);
    assert_eq!(first_state, second_state);
    let (other, _) = run(8);
    assert_ne!(first, other);
}

#[test]
fn token_events_abort_and_throughput() {
    let mut engine = Engine::new(no_cache(), 1).unwrap();
    engine.set_token_events(true);
    engine.submit(request(1, 100, 3, 0.0)).unwrap();
    engine.submit(request(2, 100, 50, 0.0)).unwrap();
    let mut events = Vec::new();
    while engine.snapshot(0.0).finished_requests_total == 0 {
        let start_s = engine.next_step_start_s().unwrap();
        engine.step(start_s, &mut events).unwrap();
    }
    let tokens_of_1 = events
        .iter()
        .filter(|e| matches!(e, EngineEvent::Token { id: 1, .. }))
        .count();
    assert_eq!(tokens_of_1, 3);
    assert!(matches!(events[0], EngineEvent::FirstToken { id: 1, .. }));
    let busy_tps = engine.decode_tps(engine.next_step_start_s().unwrap());
    assert!(busy_tps > 0.0);

    assert!(engine.abort(2));
    assert!(!engine.abort(2));
    assert!(!engine.has_work());
    assert_eq!(engine.used_kv_tokens(), 0);
    assert_eq!(engine.queued_prefill_tokens(), 0);
    // Idle: the smoothed throughput decays.
    assert!(engine.decode_tps(100.0) < busy_tps * 1e-6);
}

#[test]
fn impossible_requests_and_params_are_rejected() {
    let params = EngineParams {
        kv_capacity_tokens: 100,
        ..EngineParams::default()
    };
    let mut engine = Engine::new(params, 1).unwrap();
    assert!(engine.submit(request(1, 90, 20, 0.0)).is_err());
    engine.submit(request(2, 10, 10, 0.0)).unwrap();
    assert!(engine.submit(request(2, 10, 10, 0.0)).is_err());
    let bad = EngineParams {
        prefill_tps: 0.0,
        ..EngineParams::default()
    };
    assert!(Engine::new(bad, 1).is_err());
}

#[test]
fn queued_tokens_follow_the_prefix_cache_every_step() {
    // A and B share a 4096-token prompt (256 blocks) and arrive together.
    // step 1: A prefills 2048; B waits, fully uncached → 2048 + 4096 = 6144.
    // step 2: A prefills its last 2048 and caches its blocks; B, still
    //         waiting, now hits 255 blocks (4080 tokens) → 16 queued.
    // step 3: B is admitted and prefills 16 tokens: 2 ms of prefill, under
    //         A's decode step of 6.35 ms.
    let blocks: Vec<u64> = (0..256).collect();
    let mut engine = Engine::new(EngineParams::default(), 1).unwrap();
    for id in 0..2 {
        engine
            .submit(EngineRequest {
                prefix_block_hashes: blocks.clone(),
                ..request(id, 4096, 2, 0.0)
            })
            .unwrap();
    }
    assert_eq!(engine.queued_prefill_tokens(), 8192);
    let mut events = Vec::new();
    for (expected, duration_s) in [(6144, 0.256), (16, 0.256), (0, 0.006_35)] {
        let start_s = engine.next_step_start_s().unwrap();
        let summary = engine.step(start_s, &mut events).unwrap();
        assert_eq!(engine.queued_prefill_tokens(), expected);
        assert!(close(summary.duration_s, duration_s), "{summary:?}");
    }
    // A finished in step 3; B finishes now.
    let records = drain(&mut engine);
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].id, 1);
    assert_eq!(records[0].cached_tokens, 4080);
}

#[test]
fn half_speed_doubles_every_step_from_the_next_one() {
    // 4000 tokens at 8000 tps: two chunks, 0.256 s and 0.244 s.
    let mut engine = Engine::new(no_cache(), 1).unwrap();
    engine.submit(request(1, 4000, 1, 0.0)).unwrap();
    let mut events = Vec::new();
    let first = engine.step(0.0, &mut events).unwrap();
    assert!(close(first.duration_s, 0.256));
    // Slowed during the first step: the planned step keeps its duration,
    // the second chunk takes twice as long.
    engine.set_speed(0.5).unwrap();
    assert_eq!(engine.speed(), 0.5);
    assert!(close(engine.params().prefill_tps, 4000.0));
    assert!(close(engine.params().decode_base_ms, 12.0));
    assert!(close(engine.params().decode_per_req_ms, 0.7));
    assert!(close(engine.params().min_step_ms, 2.0));
    assert!(close(engine.nominal_params().prefill_tps, 8000.0));
    let second = engine.step(first.end_s, &mut events).unwrap();
    assert!(
        close(second.duration_s, 2.0 * 1952.0 / 8000.0),
        "{second:?}"
    );
    // A decode-only batch: (6 + 0.35 × n) ms doubles too.
    let mut slow = Engine::new(no_cache(), 1).unwrap();
    slow.set_speed(0.5).unwrap();
    let mut fast = Engine::new(no_cache(), 1).unwrap();
    for engine in [&mut slow, &mut fast] {
        for id in 0..4 {
            engine.submit(request(id, 100, 8, 0.0)).unwrap();
        }
    }
    let slow_records = drain(&mut slow);
    let fast_records = drain(&mut fast);
    for (s, f) in slow_records.iter().zip(&fast_records) {
        assert!(close(s.e2e_s(), 2.0 * f.e2e_s()), "{s:?} {f:?}");
    }
    // Back to nominal; nonsense factors change nothing.
    slow.set_speed(1.0).unwrap();
    assert_eq!(slow.params(), slow.nominal_params());
    for factor in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        assert!(slow.set_speed(factor).is_err(), "{factor}");
    }
    assert_eq!(slow.speed(), 1.0);
}

/// Steps the engine through every step that starts at or before `now_s`,
/// as the simulator does (a step's state is its end state once planned).
fn advance_to(engine: &mut Engine, now_s: f64) {
    let mut events = Vec::new();
    while let Some(start_s) = engine.next_step_start_s() {
        if start_s > now_s {
            break;
        }
        engine.step(start_s, &mut events).unwrap();
    }
}

#[test]
fn the_first_token_projection_is_the_first_token_time() {
    // Two identical engines get the same random history; at a random moment
    // one projects a new request's first token, the other takes the request
    // and runs to it. Chunking, admission order, decode interference,
    // finishing decoders, max_running and jitter all play.
    let mut rng = SplitMix64::new(42);
    let mut checked = 0;
    for case in 0..300u64 {
        let params = EngineParams {
            prefix_cache: false,
            max_running: 2 + (rng.next_u64() % 12) as u32,
            prefill_chunk_tokens: 256 + (rng.next_u64() % 2048) as u32,
            decode_base_ms: 2.0 + 10.0 * rng.next_unit(),
            decode_per_req_ms: rng.next_unit(),
            prefill_tps: 2000.0 + 14_000.0 * rng.next_unit(),
            step_jitter: if case % 3 == 0 { 0.3 } else { 0.0 },
            ..EngineParams::default()
        };
        let mut projected = Engine::new(params.clone(), case).unwrap();
        let mut actual = Engine::new(params, case).unwrap();
        let requests = 1 + rng.next_u64() % 40;
        let mut arrival_s = 0.0;
        for id in 0..requests {
            arrival_s += 0.05 * rng.next_unit();
            let prompt = 1 + (rng.next_u64() % 4000) as u32;
            let output = 1 + (rng.next_u64() % 200) as u32;
            for engine in [&mut projected, &mut actual] {
                advance_to(engine, arrival_s);
                engine
                    .submit(request(id, prompt, output, arrival_s))
                    .unwrap();
            }
        }
        let now_s = arrival_s + 0.3 * rng.next_unit();
        advance_to(&mut projected, now_s);
        advance_to(&mut actual, now_s);
        let target = request(1_000_000, 1 + (rng.next_u64() % 5000) as u32, 3, now_s);
        let expected_s = projected.first_token_projection_s(now_s, &target, &target.prefix_chain());
        let bound_s = projected.first_token_lower_bound_s(now_s, &target, &target.prefix_chain());
        assert!(
            bound_s <= expected_s,
            "case {case}: bound {bound_s} > {expected_s}"
        );
        actual.submit(target).unwrap();
        let mut events = Vec::new();
        let mut first_token_s = None;
        while let Some(start_s) = actual.next_step_start_s() {
            events.clear();
            actual.step(start_s, &mut events).unwrap();
            if let Some(time_s) = events.iter().find_map(|event| match event {
                EngineEvent::FirstToken {
                    id: 1_000_000,
                    time_s,
                } => Some(*time_s),
                _ => None,
            }) {
                first_token_s = Some(time_s);
                break;
            }
        }
        let first_token_s = first_token_s.unwrap();
        assert!(
            (expected_s - first_token_s).abs() < 1e-9,
            "case {case}: projected {expected_s}, actual {first_token_s}"
        );
        checked += 1;
    }
    assert_eq!(checked, 300);
}

#[test]
fn the_projection_counts_the_request_s_own_uncached_tokens() {
    // An idle engine: one chunk of 1000 tokens at 8000 tps = 0.125 s; half
    // speed, 0.25 s; with 512 of its tokens cached, 488 tokens: 0.061 s.
    let mut engine = Engine::new(EngineParams::default(), 1).unwrap();
    let hashes: Vec<u64> = (0..62).collect();
    let target = EngineRequest {
        id: 9,
        prompt_tokens: 1000,
        output_tokens: 4,
        arrival_s: 1.0,
        prefix_block_hashes: hashes.clone(),
    };
    assert!(close(
        engine.first_token_projection_s(1.0, &target, &target.prefix_chain()),
        1.125
    ));
    engine.set_speed(0.5).unwrap();
    assert!(close(
        engine.first_token_projection_s(1.0, &target, &target.prefix_chain()),
        1.25
    ));
    engine.set_speed(1.0).unwrap();
    engine
        .submit(EngineRequest {
            id: 1,
            prompt_tokens: 520,
            output_tokens: 1,
            arrival_s: 0.0,
            prefix_block_hashes: hashes[..32].to_vec(),
        })
        .unwrap();
    drain(&mut engine);
    assert_eq!(engine.cached_prompt_tokens(1000, &hashes), 512);
    let expected = 1.0 + 488.0 / 8000.0;
    assert!(close(
        engine.first_token_projection_s(1.0, &target, &target.prefix_chain()),
        expected
    ));
    // The projection changed nothing.
    assert!(!engine.has_work());
}
