//! What keeping a stream's usage chunk from its client costs
//! (`UsageChunkFilter`): a 64-event chat stream with its closing usage
//! chunk and `[DONE]`, fed through the filter one event per piece (as an
//! engine that flushes every token sends it) and in pieces cut mid-event,
//! beside the same pieces passed on untouched.
//!
//! Names: `usage_filter/<per_event|cut>/<filtered|passed>`, time per whole
//! stream.
//!
//! Run: `cargo bench -p router --features bench-internals --bench usage_filter -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;

use bytes::Bytes;
use criterion::{Criterion, criterion_group, criterion_main};
use router::bench_internals::UsageChunkFilter;

/// The stream's events, each whole.
fn events() -> Vec<Bytes> {
    let mut events: Vec<Bytes> = (0..64)
        .map(|index| {
            Bytes::from(format!(
                "data: {{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"token{index}\"}},\"finish_reason\":null}}]}}\n\n"
            ))
        })
        .collect();
    events.push(Bytes::from_static(
        b"data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[],\"usage\":{\"prompt_tokens\":8000,\"completion_tokens\":64,\"total_tokens\":8064,\"prompt_tokens_details\":{\"cached_tokens\":7936}}}\n\n",
    ));
    events.push(Bytes::from_static(b"data: [DONE]\n\n"));
    events
}

/// The same stream in pieces of 700 bytes, cut wherever that falls.
fn cut_pieces(events: &[Bytes]) -> Vec<Bytes> {
    let whole: Vec<u8> = events
        .iter()
        .flat_map(|event| event.iter().copied())
        .collect();
    whole.chunks(700).map(Bytes::copy_from_slice).collect()
}

fn filtered(pieces: &[Bytes]) -> usize {
    let mut filter = UsageChunkFilter::default();
    let mut sent = 0;
    for piece in pieces {
        if let Some(out) = filter.feed(piece.clone()) {
            sent += black_box(out).len();
        }
    }
    sent + filter.finish().map_or(0, |rest| black_box(rest).len())
}

fn passed(pieces: &[Bytes]) -> usize {
    pieces
        .iter()
        .map(|piece| black_box(piece.clone()).len())
        .sum()
}

fn bench(c: &mut Criterion) {
    let per_event = events();
    let cut = cut_pieces(&per_event);
    let mut group = c.benchmark_group("usage_filter");
    for (name, pieces) in [("per_event", &per_event), ("cut", &cut)] {
        group.bench_function(format!("{name}/filtered"), |b| {
            b.iter(|| filtered(black_box(pieces)))
        });
        group.bench_function(format!("{name}/passed"), |b| {
            b.iter(|| passed(black_box(pieces)))
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
