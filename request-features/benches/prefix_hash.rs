//! What prefix hashing adds to reading a request: `read_request` on an
//! 8k-token chat body (a system prompt and a user turn, 32 KiB of text with
//! a few escapes) with hashing on (the defaults: 64-token blocks, up to
//! 32 768 tokens) and off (`max_tokens = 0`), and on an 8k
//! `input_ids` body both ways.
//!
//! Names: `read_request/<body>/<hashing on|off>`.
//!
//! Run: `cargo bench -p request-features --bench prefix_hash -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use request_features::{PrefixHashing, read_request};

const PROMPT_TOKENS: usize = 8192;

/// About `tokens` tokens of English-like text at 4 characters each, with a
/// newline (an escape in JSON) every few sentences.
fn text(tokens: usize, seed: usize) -> String {
    let words = [
        "router", "prefill", "cache", "block", "worker", "token", "queue", "decode", "batch",
        "latency", "the", "of", "and", "a",
    ];
    let mut text = String::with_capacity(tokens * 4 + 16);
    let mut i = seed;
    while text.len() < tokens * 4 {
        text.push_str(words[i % words.len()]);
        i = i.wrapping_mul(31).wrapping_add(7);
        text.push(if i.is_multiple_of(23) { '\n' } else { ' ' });
    }
    text.truncate(tokens * 4);
    text
}

fn chat_body() -> Vec<u8> {
    let body = serde_json::json!({
        "model": "m",
        "stream": true,
        "max_tokens": 256,
        "messages": [
            {"role": "system", "content": text(PROMPT_TOKENS * 3 / 4, 1)},
            {"role": "user", "content": text(PROMPT_TOKENS / 4, 2)},
        ],
    });
    serde_json::to_vec(&body).unwrap_or_default()
}

fn ids_body() -> Vec<u8> {
    let ids: Vec<u32> = (0..PROMPT_TOKENS as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) % 150_000)
        .collect();
    let body = serde_json::json!({
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 256},
        "stream": true,
    });
    serde_json::to_vec(&body).unwrap_or_default()
}

/// The router's defaults (`[request]`).
const ON: PrefixHashing = PrefixHashing {
    block_tokens: 64,
    max_tokens: 32_768,
    chars_per_token: 4.0,
};

/// Hashing off: nothing hashed, all else read.
const OFF: PrefixHashing = PrefixHashing {
    max_tokens: 0,
    ..ON
};

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("read_request");
    for (name, body) in [("chat_8k", chat_body()), ("input_ids_8k", ids_body())] {
        group.throughput(Throughput::Bytes(body.len() as u64));
        for (hashing, config) in [("on", &ON), ("off", &OFF)] {
            // A body the reader refuses would measure nothing: say so.
            let read = read_request(&body, config).map(|read| read.info.prefix.hashes().len());
            assert!(
                read.as_ref()
                    .is_ok_and(|blocks| (*blocks > 0) == (hashing == "on")),
                "{name}/{hashing}: {read:?}"
            );
            group.bench_function(format!("{name}/{hashing}"), |b| {
                b.iter(|| read_request(black_box(&body), config))
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
