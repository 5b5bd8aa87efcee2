//! `engine-sim drive`: streaming traffic through one running router or
//! several replicas of one (`--router` repeated: requests take turns), then
//! the TTFT the client saw, a per-worker summary read from the routers' own
//! `/metrics` (summed over the replicas), a per-engine prefix-cache table
//! read from each `--engine`'s `/metrics`, and a live score table taken
//! mid-run. The demo's traffic source, and the bench's multi-turn one.
//!
//! Two kinds of traffic (`--traffic`): `size-skew`, single-turn prompts of
//! two sizes with unique heads (nothing to cache), and `multi-turn`, chat
//! sessions that resend their whole history every turn
//! ([`crate::sessions`]), whose prompts a prefix cache can serve.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use load_protocols::{Sample, parse_prometheus_text};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Exp};

use crate::sessions::{SessionConfig, SessionConfigError};

/// A drive argument, or the router it names, is unusable.
#[derive(Debug, thiserror::Error)]
pub enum DriveError {
    #[error("{name}: {reason}")]
    Argument { name: &'static str, reason: String },
    #[error(transparent)]
    Sessions(#[from] SessionConfigError),
    #[error("GET {url}: {reason}")]
    Fetch { url: String, reason: String },
}

fn argument_error(name: &'static str, reason: impl Into<String>) -> DriveError {
    DriveError::Argument {
        name,
        reason: reason.into(),
    }
}

/// What kind of traffic to send.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Traffic {
    /// Single-turn prompts, a share of them long, each with a unique head.
    SizeSkew,
    /// Chat sessions of a few apps that resend their history every turn.
    MultiTurn,
}

/// What to send.
#[derive(Debug, Clone, clap::Args)]
pub struct DriveArgs {
    /// A router's base URL; repeat it for replicas of one router fleet, and
    /// requests take turns among them.
    #[arg(long = "router", required = true)]
    pub routers: Vec<String>,
    /// How long to send for.
    #[arg(long, default_value_t = 20.0)]
    pub duration_s: f64,
    /// Mean arrivals per second (Poisson).
    #[arg(long, default_value_t = 12.0)]
    pub rate: f64,
    /// Share of long prompts; the rest are short.
    #[arg(long, default_value_t = 0.1)]
    pub long_fraction: f64,
    #[arg(long, default_value_t = 200)]
    pub short_prompt_tokens: u32,
    #[arg(long, default_value_t = 6000)]
    pub long_prompt_tokens: u32,
    /// Output tokens of every request (`max_tokens`).
    #[arg(long, default_value_t = 64)]
    pub output_tokens: u32,
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// size-skew: single-turn prompts of two sizes (--rate, --long-fraction);
    /// multi-turn: chat sessions resending their history (--session-rate,
    /// --apps, …).
    #[arg(long, value_enum, default_value = "size-skew")]
    pub traffic: Traffic,
    /// Multi-turn: mean new sessions per second (Poisson). No turn starts
    /// after --duration-s; a session cut there plays no more turns.
    #[arg(long, default_value_t = 2.0)]
    pub session_rate: f64,
    /// Multi-turn: apps, each with its own system prompt.
    #[arg(long, default_value_t = 8)]
    pub apps: u32,
    /// Multi-turn: length of every app's system prompt.
    #[arg(long, default_value_t = 2000)]
    pub system_prompt_tokens: u32,
    /// Multi-turn: mean user-message length (each from half to 1.5 times it).
    #[arg(long, default_value_t = 80)]
    pub user_message_tokens: u32,
    /// Multi-turn: mean turns per session (geometric).
    #[arg(long, default_value_t = 6.0)]
    pub mean_turns: f64,
    /// Multi-turn: most turns of one session.
    #[arg(long, default_value_t = 24)]
    pub max_turns: u32,
    /// Multi-turn: mean pause between an answer and the next turn, seconds
    /// (exponential; 0 for none).
    #[arg(long, default_value_t = 1.0)]
    pub think_time_s: f64,
    /// Seconds at the start whose requests are left out of the steady-state
    /// TTFT line: every prefix cache starts cold, so the first sessions of
    /// each app prefill their whole system prompt whatever the router does.
    /// They still count in the whole-run line and as completed.
    #[arg(long, default_value_t = 0.0)]
    pub warmup_s: f64,
    /// An engine's base URL: at the end, its `/metrics` gives its requests,
    /// prompt tokens and prefix-cache hits. Repeat it per engine.
    #[arg(long = "engine")]
    pub engines: Vec<String>,
}

impl DriveArgs {
    fn session_config(&self) -> SessionConfig {
        SessionConfig {
            apps: self.apps,
            system_prompt_tokens: self.system_prompt_tokens,
            user_message_tokens: self.user_message_tokens,
            mean_turns: self.mean_turns,
            max_turns: self.max_turns,
            seed: self.seed,
        }
    }

    fn validate(&self) -> Result<(), DriveError> {
        let positive = |value: f64| value.is_finite() && value > 0.0;
        if !(self.warmup_s.is_finite() && self.warmup_s >= 0.0 && self.warmup_s < self.duration_s) {
            return Err(argument_error(
                "--warmup-s",
                "must be finite, >= 0 and below --duration-s",
            ));
        }
        if !positive(self.rate) || !positive(self.duration_s) {
            return Err(argument_error(
                "--rate/--duration-s",
                "must be finite and > 0",
            ));
        }
        if self.traffic == Traffic::MultiTurn {
            if !positive(self.session_rate) {
                return Err(argument_error("--session-rate", "must be finite and > 0"));
            }
            if !(self.think_time_s.is_finite() && self.think_time_s >= 0.0) {
                return Err(argument_error("--think-time-s", "must be finite and >= 0"));
            }
            self.session_config().validate()?;
        }
        Ok(())
    }
}

#[derive(Debug, Default)]
struct Tally {
    ok: AtomicU64,
    failed: AtomicU64,
    /// Every completed request: when it was sent (seconds from the start)
    /// and its TTFT (seconds).
    ttfts: Mutex<Vec<(f64, f64)>>,
}

impl Tally {
    fn count(&self, sent_at_s: f64, answer: Option<&Streamed>) {
        let counter = if answer.is_some() {
            &self.ok
        } else {
            &self.failed
        };
        counter.fetch_add(1, Ordering::Relaxed);
        if let Some(answer) = answer
            && let Ok(mut ttfts) = self.ttfts.lock()
        {
            ttfts.push((sent_at_s, answer.ttft_s));
        }
    }

    /// TTFT of the completed requests sent at or after `from_s`.
    fn ttfts_from(&self, from_s: f64) -> Vec<f64> {
        self.ttfts.lock().map_or_else(
            |_| Vec::new(),
            |ttfts| {
                ttfts
                    .iter()
                    .filter(|(sent_at_s, _)| *sent_at_s >= from_s)
                    .map(|(_, ttft_s)| *ttft_s)
                    .collect()
            },
        )
    }
}

/// Median and p99 TTFT of some completed requests, as the client saw it
/// (request sent to first SSE event), seconds.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TtftQuantiles {
    pub completed: u64,
    pub p50_s: f64,
    pub p99_s: f64,
}

impl TtftQuantiles {
    /// `None` when `ttfts` is empty.
    fn of(ttfts: &[f64]) -> Option<TtftQuantiles> {
        Some(TtftQuantiles {
            completed: ttfts.len() as u64,
            p50_s: percentile(ttfts, 0.5)?,
            p99_s: percentile(ttfts, 0.99)?,
        })
    }
}

/// What one run sent.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Sent {
    /// Multi-turn sessions opened (0 for size-skew traffic).
    pub sessions: u64,
    /// Requests sent.
    pub requests: u64,
    /// Requests that streamed to `[DONE]`.
    pub completed: u64,
    pub failed: u64,
    /// TTFT of every completed request; `None` when none completed.
    pub ttft: Option<TtftQuantiles>,
    /// TTFT of the completed requests sent after `--warmup-s`; `None` when
    /// there is no warm-up or none completed after it.
    pub steady_ttft: Option<TtftQuantiles>,
}

/// The nearest-rank `quantile` of `values` (the smallest value with at least
/// that share of them at or below it); `None` when there is none.
pub fn percentile(values: &[f64], quantile: f64) -> Option<f64> {
    let mut sorted: Vec<f64> = values.iter().copied().filter(|v| v.is_finite()).collect();
    if sorted.is_empty() {
        return None;
    }
    sorted.sort_by(f64::total_cmp);
    let rank = (quantile * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// Sends the traffic, then prints the summary.
pub async fn drive(args: DriveArgs) -> Result<(), DriveError> {
    args.validate()?;
    let routers = trimmed(&args.routers);
    let engines = trimmed(&args.engines);
    let client = reqwest::Client::new();
    for router in &routers {
        wait_ready(&client, router).await?;
    }
    // Halfway through, while requests are pending, the last router's score
    // table: with replicas, it shows the others' pending work (remote_tok).
    let mid_run = {
        let client = client.clone();
        let router = routers.last().cloned().unwrap_or_default();
        let half = Duration::from_secs_f64(args.duration_s / 2.0);
        tokio::spawn(async move {
            tokio::time::sleep(half).await;
            fetch_text(
                &client,
                &format!("{router}/admin/policy/explain?tokens=200"),
            )
            .await
            .map(|table| (router, table))
        })
    };
    let started = Instant::now();
    let sent = send(&client, &routers, &args).await?;
    let elapsed_s = started.elapsed().as_secs_f64();
    let what = match args.traffic {
        Traffic::SizeSkew => String::new(),
        Traffic::MultiTurn => format!(" in {} chat sessions", sent.sessions),
    };
    println!(
        "sent {} streaming requests{what} in {elapsed_s:.1} s through {} router(s): {} completed, {} failed",
        sent.requests,
        routers.len(),
        sent.completed,
        sent.failed
    );
    // Two lines, kept stable: `cargo xtask bench` reads them.
    if let Some(ttft) = sent.ttft {
        println!(
            "client TTFT (request sent to first SSE event): p50 {:.4} s, p99 {:.4} s over {} completed requests",
            ttft.p50_s, ttft.p99_s, ttft.completed
        );
    }
    if let Some(ttft) = sent.steady_ttft {
        println!(
            "client TTFT after {} s of warm-up: p50 {:.4} s, p99 {:.4} s over {} completed requests",
            args.warmup_s, ttft.p50_s, ttft.p99_s, ttft.completed
        );
    }
    print_summary(&client, &routers).await?;
    if !engines.is_empty() {
        print_cache_table(&client, &engines).await;
    }
    match mid_run.await {
        Ok(Ok((router, table))) => {
            println!(
                "live score table of {router} halfway through, for a 200-token request:\n{table}"
            );
        }
        Ok(Err(error)) => println!("no mid-run score table: {error}"),
        Err(error) => println!("no mid-run score table: {error}"),
    }
    Ok(())
}

fn trimmed(urls: &[String]) -> Vec<String> {
    urls.iter()
        .map(|url| url.trim_end_matches('/').to_owned())
        .collect()
}

/// Sends `args`' traffic to `routers` (any OpenAI-compatible base URLs,
/// taking turns) and waits for every request to end.
pub async fn send(
    client: &reqwest::Client,
    routers: &[String],
    args: &DriveArgs,
) -> Result<Sent, DriveError> {
    args.validate()?;
    if routers.is_empty() {
        return Err(argument_error("--router", "at least one is needed"));
    }
    let progress = indicatif::ProgressBar::new((args.duration_s * 1000.0) as u64);
    progress.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {elapsed}/{duration} sent {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let tally = Arc::new(Tally::default());
    let (sessions, requests) = match args.traffic {
        Traffic::SizeSkew => (
            0,
            send_size_skew(client, routers, args, &tally, &progress).await?,
        ),
        Traffic::MultiTurn => send_multi_turn(client, routers, args, &tally, &progress).await?,
    };
    progress.finish_and_clear();
    Ok(Sent {
        sessions,
        requests,
        completed: tally.ok.load(Ordering::Relaxed),
        failed: tally.failed.load(Ordering::Relaxed),
        ttft: TtftQuantiles::of(&tally.ttfts_from(0.0)),
        steady_ttft: if args.warmup_s > 0.0 {
            TtftQuantiles::of(&tally.ttfts_from(args.warmup_s))
        } else {
            None
        },
    })
}

/// Poisson arrivals of single-turn prompts; returns how many were sent.
async fn send_size_skew(
    client: &reqwest::Client,
    routers: &[String],
    args: &DriveArgs,
    tally: &Arc<Tally>,
    progress: &indicatif::ProgressBar,
) -> Result<u64, DriveError> {
    let mut rng = SmallRng::seed_from_u64(args.seed);
    let gaps = Exp::new(args.rate).map_err(|error| argument_error("--rate", error.to_string()))?;
    let started = Instant::now();
    let mut next_s = 0.0;
    let mut sent = 0u64;
    let mut tasks = Vec::new();
    loop {
        next_s += gaps.sample(&mut rng);
        if next_s >= args.duration_s {
            break;
        }
        let due = started + Duration::from_secs_f64(next_s);
        tokio::time::sleep_until(due.into()).await;
        let long = rng.random_bool(args.long_fraction.clamp(0.0, 1.0));
        let tokens = if long {
            args.long_prompt_tokens
        } else {
            args.short_prompt_tokens
        };
        // A unique head keeps the engines' prefix caches from turning every
        // prompt after the first into a hit; four characters per token is the
        // router's default estimate.
        let mut prompt = format!("request {sent:08} ");
        prompt.push_str(&"lorem ip".repeat((tokens as usize / 2).saturating_sub(2)));
        let body = serde_json::json!({
            "model": "engine-sim", "stream": true, "max_tokens": args.output_tokens,
            "messages": [{"role": "user", "content": prompt}],
        });
        let client = client.clone();
        // Request i goes to router i mod n: an even spread over replicas.
        let router = &routers[(sent % routers.len() as u64) as usize];
        let url = format!("{router}/v1/chat/completions");
        let tally = tally.clone();
        tasks.push(tokio::spawn(async move {
            tally.count(next_s, stream_one(&client, &url, &body).await.as_ref());
        }));
        sent += 1;
        progress.set_position((next_s * 1000.0) as u64);
        progress.set_message(format!("{sent} requests"));
    }
    for task in tasks {
        let _ = task.await;
    }
    Ok(sent)
}

/// Poisson arrivals of chat sessions, each playing its turns in its own
/// task; returns (sessions, requests sent).
async fn send_multi_turn(
    client: &reqwest::Client,
    routers: &[String],
    args: &DriveArgs,
    tally: &Arc<Tally>,
    progress: &indicatif::ProgressBar,
) -> Result<(u64, u64), DriveError> {
    let config = Arc::new(args.session_config());
    let routers: Arc<[String]> = routers.into();
    let mut rng = SmallRng::seed_from_u64(args.seed);
    let gaps = Exp::new(args.session_rate)
        .map_err(|error| argument_error("--session-rate", error.to_string()))?;
    // Think times per session from a generator of its own: a session's
    // pauses do not depend on the others' timing.
    let think = (args.think_time_s > 0.0)
        .then(|| Exp::new(1.0 / args.think_time_s))
        .transpose()
        .map_err(|error| argument_error("--think-time-s", error.to_string()))?;
    let started = Instant::now();
    let window = Duration::from_secs_f64(args.duration_s);
    let requests = Arc::new(AtomicU64::new(0));
    let mut next_s = 0.0;
    let mut sessions = 0u64;
    let mut tasks = Vec::new();
    loop {
        next_s += gaps.sample(&mut rng);
        if next_s >= args.duration_s {
            break;
        }
        tokio::time::sleep_until((started + Duration::from_secs_f64(next_s)).into()).await;
        let id = sessions;
        let mut session = config.session(id);
        let mut pauses = SmallRng::seed_from_u64(args.seed ^ id.rotate_left(32) ^ 0x7468_696e_6b00);
        let client = client.clone();
        let routers = routers.clone();
        let turns = requests.clone();
        let tally = tally.clone();
        let max_tokens = args.output_tokens;
        tasks.push(tokio::spawn(async move {
            loop {
                // Turn i of all sessions goes to router i mod n.
                let turn = turns.fetch_add(1, Ordering::Relaxed);
                let router = &routers[(turn % routers.len() as u64) as usize];
                let url = format!("{router}/v1/chat/completions");
                let sent_at_s = started.elapsed().as_secs_f64();
                let answer = stream_one(&client, &url, &session.request_body(max_tokens)).await;
                tally.count(sent_at_s, answer.as_ref());
                // A failed turn ends its session: there is no answer to resend.
                let Some(answer) = answer else { break };
                if !session.finish_turn(answer.tokens) {
                    break;
                }
                if let Some(think) = &think {
                    tokio::time::sleep(Duration::from_secs_f64(think.sample(&mut pauses))).await;
                }
                // The first turn always goes (the session arrived inside
                // the window); later ones only while it is open.
                if started.elapsed() >= window {
                    break;
                }
            }
        }));
        sessions += 1;
        progress.set_position((next_s * 1000.0) as u64);
        progress.set_message(format!(
            "{sessions} sessions, {} requests",
            requests.load(Ordering::Relaxed)
        ));
    }
    for task in tasks {
        let _ = task.await;
    }
    Ok((sessions, requests.load(Ordering::Relaxed)))
}

async fn wait_ready(client: &reqwest::Client, router: &str) -> Result<(), DriveError> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ready = client
            .get(format!("{router}/readiness"))
            .send()
            .await
            .is_ok_and(|response| response.status().is_success());
        if ready {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(argument_error(
                "--router",
                format!("{router} was not ready within 60 s"),
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One answer streamed to its end.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Streamed {
    /// Content chunks (tokens).
    tokens: u32,
    /// From sending the request to its first SSE event, seconds.
    ttft_s: f64,
}

/// Streams one chat completion to its end; `None` when it failed or did not
/// finish with `[DONE]`.
async fn stream_one(
    client: &reqwest::Client,
    url: &str,
    body: &serde_json::Value,
) -> Option<Streamed> {
    let sent = Instant::now();
    let response = client.post(url).json(body).send().await.ok()?;
    if !response.status().is_success() {
        return None;
    }
    let mut stream = response.bytes_stream();
    let mut events = SseTokens::default();
    let mut ttft_s = None;
    while let Some(chunk) = stream.next().await {
        events.push(&chunk.ok()?);
        if events.events > 0 && ttft_s.is_none() {
            ttft_s = Some(sent.elapsed().as_secs_f64());
        }
    }
    Some(Streamed {
        tokens: events.tokens,
        ttft_s: ttft_s.filter(|_| events.done)?,
    })
}

/// Counts the events and content chunks of an OpenAI chat SSE stream fed in
/// pieces.
#[derive(Debug, Default)]
struct SseTokens {
    /// The unfinished event at the end of what was fed.
    pending: Vec<u8>,
    /// Complete `data:` events so far, `[DONE]` included.
    events: u32,
    tokens: u32,
    done: bool,
}

impl SseTokens {
    fn push(&mut self, bytes: &[u8]) {
        self.pending.extend_from_slice(bytes);
        while let Some(end) = self.pending.windows(2).position(|pair| pair == b"\n\n") {
            let event: Vec<u8> = self.pending.drain(..end + 2).collect();
            self.event(&event[..end]);
        }
    }

    fn event(&mut self, event: &[u8]) {
        let Some(data) = event.strip_prefix(b"data: ") else {
            return;
        };
        self.events += 1;
        if data == b"[DONE]" {
            self.done = true;
            return;
        }
        let has_content = serde_json::from_slice::<serde_json::Value>(data)
            .ok()
            .and_then(|chunk| {
                chunk
                    .pointer("/choices/0/delta/content")
                    .and_then(serde_json::Value::as_str)
                    .map(|content| !content.is_empty())
            })
            .unwrap_or(false);
        if has_content {
            self.tokens += 1;
        }
    }
}

/// Per-worker requests, token-work and TTFT p50/p99 from the routers'
/// `/metrics`, summed over the replicas.
async fn print_summary(client: &reqwest::Client, routers: &[String]) -> Result<(), DriveError> {
    let mut samples = Vec::new();
    for router in routers {
        let text = fetch_text(client, &format!("{router}/metrics")).await?;
        samples.extend(
            parse_prometheus_text(&text)
                .map_err(|error| argument_error("/metrics", error.to_string()))?,
        );
    }
    let per_worker = |name: &str| -> BTreeMap<String, f64> {
        let mut out = BTreeMap::new();
        for sample in samples.iter().filter(|sample| sample.name == name) {
            if let Some(worker) = sample.label("worker") {
                *out.entry(worker.to_owned()).or_insert(0.0) += sample.value;
            }
        }
        out
    };
    let selections = per_worker("router_selections_total");
    let tokens = per_worker("router_dispatched_tokens_total");
    println!();
    println!(
        "{:<28} {:>9} {:>12} {:>10} {:>10}",
        "worker", "requests", "token-work", "TTFT p50", "TTFT p99"
    );
    for (worker, count) in &selections {
        let p50 = histogram_quantile(&samples, "router_time_to_first_token_seconds", worker, 0.5);
        let p99 = histogram_quantile(&samples, "router_time_to_first_token_seconds", worker, 0.99);
        println!(
            "{:<28} {:>9} {:>12} {:>9.3}s {:>9.3}s",
            worker,
            count,
            tokens.get(worker).copied().unwrap_or(0.0),
            p50.unwrap_or(f64::NAN),
            p99.unwrap_or(f64::NAN)
        );
    }
    println!();
    Ok(())
}

/// One engine's cumulative counters, from its own `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CacheCounters {
    pub flavour: &'static str,
    /// Finished requests (`None` when the engine exports no such counter).
    pub requests: Option<f64>,
    /// Prompt tokens looked up in the prefix cache.
    pub prompt_tokens: f64,
    /// Of those, tokens the cache served.
    pub cached_tokens: f64,
}

/// (flavour, requests, prompt tokens looked up, cached tokens) under each
/// engine's own names: SGLang (both prefixes), vLLM V1, TokenSpeed.
const CACHE_FAMILIES: [(&str, &str, &str, &str); 4] = [
    (
        "vllm",
        "vllm:request_success_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
    ),
    (
        "sglang",
        "sglang_num_requests_total",
        "sglang_prompt_tokens_total",
        "sglang_cached_tokens_total",
    ),
    (
        "sglang",
        "sglang:num_requests_total",
        "sglang:prompt_tokens_total",
        "sglang:cached_tokens_total",
    ),
    (
        "tokenspeed",
        "tokenspeed:num_requests_total",
        "tokenspeed:prompt_tokens_total",
        "tokenspeed:cached_tokens_total",
    ),
];

/// An engine's request, prompt-token and prefix-cache counters, each summed
/// over its series (finish reasons, cache sources); `None` when the text
/// has no known prompt and cached-token counters.
pub fn cache_counters(samples: &[Sample]) -> Option<CacheCounters> {
    let sum = |name: &str| {
        let mut values = samples
            .iter()
            .filter(|sample| sample.name == name)
            .map(|sample| sample.value)
            .peekable();
        values.peek().is_some().then(|| values.sum::<f64>())
    };
    CACHE_FAMILIES
        .into_iter()
        .find_map(|(flavour, requests, prompt, cached)| {
            Some(CacheCounters {
                flavour,
                requests: sum(requests),
                prompt_tokens: sum(prompt)?,
                cached_tokens: sum(cached)?,
            })
        })
}

/// Per-engine requests, prompt tokens, cached tokens and hit rate, read from
/// each engine's `/metrics`, and the fleet's totals. An engine that cannot
/// be read gets a line saying why; the others are still shown.
async fn print_cache_table(client: &reqwest::Client, engines: &[String]) {
    println!("prefix cache per engine, from each engine's /metrics:");
    println!(
        "{:<28} {:<11} {:>9} {:>14} {:>14} {:>9}",
        "engine", "flavour", "requests", "prompt tokens", "cached tokens", "hit rate"
    );
    let rate = |cached: f64, prompt: f64| {
        if prompt > 0.0 {
            format!("{:.1}%", 100.0 * cached / prompt)
        } else {
            "-".to_owned()
        }
    };
    let mut fleet = (0.0, 0.0, 0.0);
    for engine in engines {
        let read = fetch_text(client, &format!("{engine}/metrics"))
            .await
            .and_then(|text| {
                parse_prometheus_text(&text)
                    .map_err(|error| argument_error("--engine", format!("{engine}: {error}")))
            })
            .and_then(|samples| {
                cache_counters(&samples).ok_or_else(|| {
                    argument_error("--engine", format!("{engine}: no prefix-cache counters"))
                })
            });
        match read {
            Ok(counters) => {
                let requests = counters.requests.unwrap_or(0.0);
                fleet.0 += requests;
                fleet.1 += counters.prompt_tokens;
                fleet.2 += counters.cached_tokens;
                println!(
                    "{:<28} {:<11} {:>9} {:>14} {:>14} {:>9}",
                    engine,
                    counters.flavour,
                    counters
                        .requests
                        .map_or_else(|| "-".to_owned(), |count| count.to_string()),
                    counters.prompt_tokens,
                    counters.cached_tokens,
                    rate(counters.cached_tokens, counters.prompt_tokens)
                );
            }
            Err(error) => println!("{engine:<28} unreadable: {error}"),
        }
    }
    println!(
        "{:<28} {:<11} {:>9} {:>14} {:>14} {:>9}",
        "fleet",
        "",
        fleet.0,
        fleet.1,
        fleet.2,
        rate(fleet.2, fleet.1)
    );
    println!();
}

async fn fetch_text(client: &reqwest::Client, url: &str) -> Result<String, DriveError> {
    let fetch_error = |error: reqwest::Error| DriveError::Fetch {
        url: url.to_owned(),
        reason: error.to_string(),
    };
    let response = client.get(url).send().await.map_err(fetch_error)?;
    response.text().await.map_err(fetch_error)
}

/// A quantile from cumulative histogram buckets, interpolated linearly inside
/// the bucket it falls in (as Prometheus' `histogram_quantile` does).
/// Buckets of one bound from several routers are summed.
pub fn histogram_quantile(
    samples: &[Sample],
    family: &str,
    worker: &str,
    quantile: f64,
) -> Option<f64> {
    let bucket_name = format!("{family}_bucket");
    let mut buckets: Vec<(f64, f64)> = samples
        .iter()
        .filter(|sample| sample.name == bucket_name && sample.label("worker") == Some(worker))
        .filter_map(|sample| {
            let le = sample.label("le")?;
            let bound = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((bound, sample.value))
        })
        .collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    buckets.dedup_by(|later, kept| {
        let same = later.0 == kept.0;
        if same {
            kept.1 += later.1;
        }
        same
    });
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = quantile * total;
    let mut previous = (0.0, 0.0);
    for &(bound, count) in &buckets {
        if count >= rank {
            if bound.is_infinite() {
                return Some(previous.0);
            }
            let in_bucket = count - previous.1;
            let fraction = if in_bucket > 0.0 {
                (rank - previous.1) / in_bucket
            } else {
                1.0
            };
            return Some(previous.0 + (bound - previous.0) * fraction);
        }
        previous = (bound, count);
    }
    Some(previous.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_token_counting_survives_any_split() {
        let stream = concat!(
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\" the\"}}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\" sim\"}}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"length\"}]}\n\n",
            "data: [DONE]\n\n",
        )
        .as_bytes();
        for split in 0..stream.len() {
            let mut events = SseTokens::default();
            events.push(&stream[..split]);
            events.push(&stream[split..]);
            assert_eq!(
                (events.events, events.tokens, events.done),
                (4, 2, true),
                "{split}"
            );
        }
        // Cut before [DONE]: not finished.
        let mut cut = SseTokens::default();
        cut.push(&stream[..stream.len() - 8]);
        assert!(!cut.done);
    }

    #[test]
    fn cache_counters_are_read_under_each_engines_names() {
        let read = |text: &str| cache_counters(&parse_prometheus_text(text).unwrap());
        let vllm = "\
vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"m\"} 3000.0
vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 992.0
vllm:request_success_total{engine=\"0\",finished_reason=\"length\",model_name=\"m\"} 2.0
vllm:request_success_total{engine=\"0\",finished_reason=\"stop\",model_name=\"m\"} 1.0
";
        assert_eq!(
            read(vllm),
            Some(CacheCounters {
                flavour: "vllm",
                requests: Some(3.0),
                prompt_tokens: 3000.0,
                cached_tokens: 992.0,
            })
        );
        // SGLang's newer prefix, with cache sources summed.
        let sglang = "\
sglang_prompt_tokens_total{model_name=\"m\"} 100.0
sglang_cached_tokens_total{cache_source=\"device\",model_name=\"m\"} 40.0
sglang_cached_tokens_total{cache_source=\"host\",model_name=\"m\"} 10.0
";
        assert_eq!(
            read(sglang),
            Some(CacheCounters {
                flavour: "sglang",
                requests: None,
                prompt_tokens: 100.0,
                cached_tokens: 50.0,
            })
        );
        let tokenspeed = "\
tokenspeed:num_requests_total{model_name=\"m\"} 1.0
tokenspeed:prompt_tokens_total{model_name=\"m\"} 10.0
tokenspeed:cached_tokens_total{model_name=\"m\"} 0.0
";
        assert_eq!(
            read(tokenspeed).map(|counters| counters.flavour),
            Some("tokenspeed")
        );
        assert_eq!(read("sglang:num_running_reqs 1\n"), None);
    }

    fn multi_turn_args(router: &str) -> DriveArgs {
        DriveArgs {
            routers: vec![router.to_owned()],
            duration_s: 2.0,
            rate: 12.0,
            long_fraction: 0.1,
            short_prompt_tokens: 200,
            long_prompt_tokens: 6000,
            output_tokens: 8,
            seed: 11,
            traffic: Traffic::MultiTurn,
            session_rate: 6.0,
            apps: 2,
            system_prompt_tokens: 500,
            user_message_tokens: 40,
            mean_turns: 3.0,
            max_turns: 6,
            think_time_s: 0.05,
            warmup_s: 0.5,
            engines: vec![router.to_owned()],
        }
    }

    #[test]
    fn bad_drive_arguments_are_refused() {
        let args = multi_turn_args("http://127.0.0.1:1");
        assert!(args.validate().is_ok());
        let refused = |args: DriveArgs| args.validate().unwrap_err().to_string();
        let message = refused(DriveArgs {
            session_rate: 0.0,
            ..args.clone()
        });
        assert!(message.contains("--session-rate"), "{message}");
        let message = refused(DriveArgs {
            think_time_s: -1.0,
            ..args.clone()
        });
        assert!(message.contains("--think-time-s"), "{message}");
        for warmup_s in [-0.5, f64::NAN, 2.0] {
            let message = refused(DriveArgs {
                warmup_s,
                ..args.clone()
            });
            assert!(message.contains("--warmup-s"), "{message}");
        }
        let message = refused(DriveArgs {
            apps: 0,
            ..args.clone()
        });
        assert!(message.contains("--apps"), "{message}");
        // Session settings matter only to multi-turn traffic.
        assert!(
            DriveArgs {
                apps: 0,
                traffic: Traffic::SizeSkew,
                ..args
            }
            .validate()
            .is_ok()
        );
    }

    /// Multi-turn sessions straight into one mock engine over loopback: the
    /// engine's own `/metrics` shows prefix-cache hits (shared system
    /// prompts, resent histories).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn multi_turn_traffic_hits_an_engines_prefix_cache() {
        let config = mock_engines::SimEngineConfig {
            time_scale: 20.0,
            ..mock_engines::SimEngineConfig::new(mock_engines::Flavour::Vllm)
        };
        let fleet = mock_engines::start(vec![config]).await.unwrap();
        let engine = fleet.engines()[0].http_url();
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()
            .unwrap();
        let sent = send(
            &client,
            std::slice::from_ref(&engine),
            &multi_turn_args(&engine),
        )
        .await
        .unwrap();
        assert!(sent.sessions > 0, "{sent:?}");
        assert_eq!(sent.failed, 0, "{sent:?}");
        assert_eq!(sent.completed, sent.requests, "{sent:?}");
        // Every session plays its first turn.
        assert!(sent.requests >= sent.sessions, "{sent:?}");
        let ttft = sent.ttft.unwrap();
        assert!(0.0 < ttft.p50_s && ttft.p50_s <= ttft.p99_s, "{sent:?}");
        assert_eq!(ttft.completed, sent.completed, "{sent:?}");
        // The steady-state quantiles leave out what was sent in the warm-up.
        let steady = sent.steady_ttft.unwrap();
        assert!(
            0 < steady.completed && steady.completed < ttft.completed,
            "{sent:?}"
        );
        assert!(
            0.0 < steady.p50_s && steady.p50_s <= steady.p99_s,
            "{sent:?}"
        );

        let deadline = Instant::now() + Duration::from_secs(30);
        let counters = loop {
            let text = fetch_text(&client, &format!("{engine}/metrics"))
                .await
                .unwrap();
            let counters = cache_counters(&parse_prometheus_text(&text).unwrap()).unwrap();
            if counters.requests == Some(sent.requests as f64) && counters.cached_tokens > 0.0 {
                break counters;
            }
            assert!(
                Instant::now() < deadline,
                "no cache hits in time: {counters:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(counters.flavour, "vllm");
        assert!(
            counters.cached_tokens <= counters.prompt_tokens,
            "{counters:?}"
        );
        fleet.shutdown().await;
    }

    #[test]
    fn percentiles_take_the_nearest_rank() {
        let values: Vec<f64> = (1..=200).map(f64::from).collect();
        assert_eq!(percentile(&values, 0.5), Some(100.0));
        assert_eq!(percentile(&values, 0.99), Some(198.0));
        assert_eq!(percentile(&[3.0, f64::NAN, 1.0], 0.99), Some(3.0));
        assert_eq!(percentile(&[2.0], 0.0), Some(2.0));
        assert_eq!(percentile(&[], 0.5), None);
    }

    #[test]
    fn quantiles_interpolate_inside_buckets() {
        let text = "\
h_bucket{worker=\"a\",le=\"0.1\"} 50
h_bucket{worker=\"a\",le=\"0.2\"} 90
h_bucket{worker=\"a\",le=\"0.4\"} 100
h_bucket{worker=\"a\",le=\"+Inf\"} 100
";
        let samples = parse_prometheus_text(text).unwrap();
        // Rank 50 is the top of the first bucket.
        assert!((histogram_quantile(&samples, "h", "a", 0.5).unwrap() - 0.1).abs() < 1e-12);
        // Rank 99 is 9/10 of the way through the (0.2, 0.4] bucket: 0.38.
        assert!((histogram_quantile(&samples, "h", "a", 0.99).unwrap() - 0.38).abs() < 1e-12);
        assert_eq!(histogram_quantile(&samples, "h", "b", 0.5), None);
        // Two replicas' histograms of one worker add up.
        let doubled: Vec<Sample> = samples.iter().chain(&samples).cloned().collect();
        assert!((histogram_quantile(&doubled, "h", "a", 0.99).unwrap() - 0.38).abs() < 1e-12);
    }
}
