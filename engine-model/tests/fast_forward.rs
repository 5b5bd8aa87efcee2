//! `Engine::step_ahead` against `Engine::step`: an engine that plans its
//! decode-only steps ahead and applies them lazily must be the engine stepped
//! one step at a time, bit for bit: every event at the same time, every
//! report read between steps the same, over random arrival streams, reads,
//! speed changes, KV pressure (evictions, preemptions) and full batches.

// Test helpers (not only #[test] fns) may unwrap: a panic is a failed assertion.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use engine_model::{Engine, EngineEvent, EngineParams, EngineRequest, SplitMix64};

/// One random stream: the engine's parameters, its requests (by arrival),
/// when it is read, and an optional speed change `(at_s, factor)`.
struct Stream {
    params: EngineParams,
    requests: Vec<EngineRequest>,
    reads_s: Vec<f64>,
    speed_change: Option<(f64, f64)>,
}

fn below(rng: &mut SplitMix64, bound: u64) -> u64 {
    rng.next_u64() % bound
}

fn stream(seed: u64) -> Stream {
    let mut rng = SplitMix64::new(seed);
    let params = EngineParams {
        prefill_tps: 2000.0 + below(&mut rng, 20_000) as f64,
        prefill_chunk_tokens: 64 + below(&mut rng, 1024) as u32,
        decode_base_ms: 1.0 + below(&mut rng, 8) as f64,
        decode_per_req_ms: 0.05 + below(&mut rng, 40) as f64 / 100.0,
        max_running: 1 + below(&mut rng, 24) as u32,
        // From a few requests' worth (preemptions, evictions) to plenty.
        kv_capacity_tokens: [3_000, 8_000, 30_000, 500_000][below(&mut rng, 4) as usize],
        block_size_tokens: 16,
        prefix_cache: below(&mut rng, 4) != 0,
        cache_high_watermark: [0.5, 0.8, 0.95, 1.0][below(&mut rng, 4) as usize],
        min_step_ms: below(&mut rng, 3) as f64,
        throughput_window_s: 0.5 + below(&mut rng, 3) as f64,
        step_jitter: if below(&mut rng, 2) == 0 { 0.0 } else { 0.3 },
    };
    let count = 20 + below(&mut rng, 100);
    let mean_gap_s = 0.001 + below(&mut rng, 200) as f64 / 1000.0;
    let mut arrival_s = 0.0;
    let requests = (0..count)
        .map(|id| {
            arrival_s += mean_gap_s * 2.0 * rng.next_unit();
            // A few shared prefixes, so the cache hits, fills and evicts.
            let group = below(&mut rng, 5);
            let blocks = below(&mut rng, 40) as usize;
            let prompt_tokens = 16 * blocks as u32 + 1 + below(&mut rng, 40) as u32;
            EngineRequest {
                id,
                prompt_tokens,
                output_tokens: 1 + below(&mut rng, 400) as u32,
                arrival_s,
                prefix_block_hashes: (0..blocks as u64).map(|b| group << 32 | b).collect(),
            }
        })
        .filter(|request| {
            u64::from(request.prompt_tokens) + u64::from(request.output_tokens)
                <= params.kv_capacity_tokens
        })
        .collect();
    let read_gap_s = 0.005 + below(&mut rng, 500) as f64 / 1000.0;
    let reads_s = (1..2000).map(|i| i as f64 * read_gap_s).collect();
    let speed_change = (below(&mut rng, 3) == 0).then(|| {
        (
            arrival_s * rng.next_unit(),
            [0.25, 0.5, 2.0][below(&mut rng, 3) as usize],
        )
    });
    Stream {
        params,
        requests,
        reads_s,
        speed_change,
    }
}

/// What a driver saw: each line an event with its delivery time, or a read.
struct Run {
    log: Vec<String>,
    /// `step` or `step_ahead` calls.
    calls: u64,
    steps: u64,
    preemptions: u64,
}

/// How [`drive`] steps the engine.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    /// `step`, one step at a time.
    Step,
    /// `step_ahead` (and `advance_to` before each read).
    Ahead,
    /// `step` with token events on, which visits every running request at
    /// every step's end instead of only those with an event; the token
    /// events are left out of the log, their counts checked against the
    /// steps each request decoded in.
    EveryRequest,
}

/// Drives one engine through the stream in virtual time, as the fleet
/// simulator does: a step's events are delivered at its end, where the next
/// step starts; at equal times a step end comes first, then an arrival, a
/// speed change, a read.
fn drive(stream: &Stream, mode: Mode) -> Run {
    let ahead = mode == Mode::Ahead;
    let mut engine = Engine::new(stream.params.clone(), 11).unwrap();
    engine.set_token_events(mode == Mode::EveryRequest);
    // Per request: tokens counted by its token events.
    let mut tokens_seen: std::collections::HashMap<u64, u32> = Default::default();
    let mut log = Vec::new();
    let mut in_step: Vec<EngineEvent> = Vec::new();
    let mut step_end_s: Option<f64> = None;
    let (mut next_request, mut next_read) = (0, 0);
    let mut speed_change = stream.speed_change;
    let mut calls = 0;
    let probe = EngineRequest {
        id: u64::MAX,
        prompt_tokens: 300,
        output_tokens: 10,
        arrival_s: 0.0,
        prefix_block_hashes: (0..10).map(|b| 2 << 32 | b).collect(),
    };
    let probe_chain = probe.prefix_chain();
    let start =
        |engine: &mut Engine, now_s: f64, in_step: &mut Vec<EngineEvent>, calls: &mut u64| {
            let summary = if ahead {
                engine.step_ahead(now_s, in_step)
            } else {
                engine.step(now_s, in_step)
            };
            *calls += u64::from(summary.is_some());
            summary.map(|_| engine.run_end_s())
        };
    loop {
        let arrival_s = stream.requests.get(next_request).map(|r| r.arrival_s);
        // Reads stop with the arrivals, or the loop would never end.
        let read_s = stream
            .reads_s
            .get(next_read)
            .copied()
            .filter(|&t| arrival_s.is_some() || step_end_s.is_some_and(|end| t < end));
        let candidates = [
            step_end_s,
            arrival_s,
            speed_change.map(|(at_s, _)| at_s),
            read_s,
        ];
        let Some((kind, now_s)) = candidates
            .iter()
            .enumerate()
            .filter_map(|(kind, time)| time.map(|t| (kind, t)))
            .min_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)))
        else {
            break;
        };
        match kind {
            0 => {
                for event in in_step.drain(..) {
                    match event {
                        EngineEvent::Token {
                            id,
                            generated_tokens,
                            ..
                        } => {
                            let seen = tokens_seen.entry(id).or_default();
                            // One more each time, across preemptions too.
                            assert_eq!(generated_tokens, *seen + 1, "request {id}");
                            *seen = generated_tokens;
                        }
                        EngineEvent::Finished(record) if mode == Mode::EveryRequest => {
                            assert_eq!(tokens_seen.get(&record.id), Some(&record.output_tokens));
                            log.push(format!("{now_s:?} {event:?}"));
                        }
                        _ => log.push(format!("{now_s:?} {event:?}")),
                    }
                }
                step_end_s = start(&mut engine, now_s, &mut in_step, &mut calls);
            }
            1 => {
                engine
                    .submit(stream.requests[next_request].clone())
                    .unwrap();
                next_request += 1;
                if step_end_s.is_some() {
                    // A submit cuts the planned steps after its arrival.
                    step_end_s = Some(engine.run_end_s());
                } else {
                    step_end_s = start(&mut engine, now_s, &mut in_step, &mut calls);
                }
            }
            2 => {
                let (_, factor) = speed_change.take().unwrap();
                if ahead {
                    engine.advance_to(now_s);
                }
                engine.set_speed(factor).unwrap();
                if step_end_s.is_some() {
                    step_end_s = Some(engine.run_end_s());
                }
            }
            _ => {
                next_read += 1;
                if ahead {
                    engine.advance_to(now_s);
                }
                log.push(format!(
                    "{now_s:?} {:?} {:?} {:?} {:?} {:?}",
                    engine.snapshot(now_s),
                    engine.first_token_projection_s(now_s, &probe, &probe_chain),
                    engine.first_token_lower_bound_s(now_s, &probe, &probe_chain),
                    engine.steps_total(),
                    engine.has_work(),
                ));
            }
        }
    }
    assert!(!engine.has_work());
    Run {
        log,
        calls,
        steps: engine.steps_total(),
        preemptions: engine.snapshot(0.0).preemptions_total,
    }
}

/// Every event and every read of the engine stepped ahead is the one of the
/// engine stepped one step at a time, over many random streams; and the
/// fast-forward does skip calls (the comparison is not of two `step` runs).
#[test]
fn stepping_ahead_is_stepping_one_step_at_a_time() {
    let (mut calls, mut steps) = (0, 0);
    for seed in 0..300 {
        let stream = stream(seed);
        let reference = drive(&stream, Mode::Step);
        let ahead = drive(&stream, Mode::Ahead);
        assert_eq!(reference.steps, ahead.steps, "seed {seed}");
        assert_eq!(reference.calls, reference.steps, "seed {seed}");
        for (line, (want, got)) in reference.log.iter().zip(&ahead.log).enumerate() {
            assert_eq!(want, got, "seed {seed}, line {line}");
        }
        assert_eq!(reference.log.len(), ahead.log.len(), "seed {seed}");
        calls += ahead.calls;
        steps += ahead.steps;
    }
    assert!(
        calls * 3 < steps,
        "{calls} step_ahead calls for {steps} steps"
    );
}

/// A step's end visits only the requests with an event (a first token, a
/// finish), the other decoding requests' tokens and KV following the
/// engine's decode ticks: the same events, reports and projections as
/// visiting every running request (as with token events on), whose token
/// counts match each finished request's output, over the random streams.
#[test]
fn visiting_only_the_requests_with_events_is_visiting_every_request() {
    let mut preemptions = 0;
    for seed in 0..300 {
        let stream = stream(seed);
        let reference = drive(&stream, Mode::EveryRequest);
        let only_events = drive(&stream, Mode::Step);
        assert_eq!(reference.steps, only_events.steps, "seed {seed}");
        for (line, (want, got)) in reference.log.iter().zip(&only_events.log).enumerate() {
            assert_eq!(want, got, "seed {seed}, line {line}");
        }
        assert_eq!(reference.log.len(), only_events.log.len(), "seed {seed}");
        preemptions += reference.preemptions;
    }
    assert!(preemptions > 100, "{preemptions} preemptions");
}

/// A lone long decode is a handful of calls: the one that admits it, the
/// one that plans the rest, the one that finishes it.
#[test]
fn a_lone_decode_is_planned_to_its_last_step() {
    let mut engine = Engine::new(EngineParams::default(), 1).unwrap();
    engine
        .submit(EngineRequest {
            id: 1,
            prompt_tokens: 100,
            output_tokens: 500,
            arrival_s: 0.0,
            prefix_block_hashes: Vec::new(),
        })
        .unwrap();
    let mut events = Vec::new();
    let mut calls = 0;
    while let Some(start_s) = engine.next_step_start_s() {
        engine.step_ahead(start_s, &mut events);
        calls += 1;
    }
    assert_eq!(engine.steps_total(), 500);
    assert!(calls <= 3, "{calls} calls");
    let finish_s = match events.last() {
        Some(EngineEvent::Finished(record)) => record.finish_s,
        other => panic!("last event {other:?}"),
    };
    // The prefill step, then 499 decode steps of 6.35 ms, summed one by one.
    let mut expected_s = 0.0 + (100.0 / 8000.0_f64).max(0.001);
    for _ in 0..499 {
        expected_s += (6.0 + 0.35) / 1000.0;
    }
    assert_eq!(finish_s.to_bits(), expected_s.to_bits());
}
