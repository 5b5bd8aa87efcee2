//! `engine-sim drive`: size-skewed streaming traffic through one running
//! router or several replicas of one (`--router` repeated: requests take
//! turns), then a per-worker summary read from the routers' own `/metrics`
//! (summed over the replicas) and a live score table taken mid-run. The
//! demo's traffic source.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use load_protocols::{Sample, parse_prometheus_text};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Exp};

/// A drive argument, or the router it names, is unusable.
#[derive(Debug, thiserror::Error)]
#[error("{name}: {reason}")]
pub struct DriveError {
    name: &'static str,
    reason: String,
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
    #[arg(long, default_value_t = 64)]
    pub output_tokens: u32,
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
}

#[derive(Debug, Default)]
struct Tally {
    ok: AtomicU64,
    failed: AtomicU64,
}

/// Sends the traffic, then prints the summary.
pub async fn drive(args: DriveArgs) -> Result<(), DriveError> {
    let positive = |value: f64| value.is_finite() && value > 0.0;
    if !positive(args.rate) || !positive(args.duration_s) {
        return Err(DriveError {
            name: "--rate/--duration-s",
            reason: "must be finite and > 0".into(),
        });
    }
    let routers: Vec<String> = args
        .routers
        .iter()
        .map(|router| router.trim_end_matches('/').to_owned())
        .collect();
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

    let mut rng = SmallRng::seed_from_u64(args.seed);
    let gaps = Exp::new(args.rate).map_err(|error| DriveError {
        name: "--rate",
        reason: error.to_string(),
    })?;
    let tally = Arc::new(Tally::default());
    let progress = indicatif::ProgressBar::new((args.duration_s * 1000.0) as u64);
    progress.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {elapsed}/{duration} sent {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
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
            let ok = stream_one(&client, &url, &body).await;
            let counter = if ok { &tally.ok } else { &tally.failed };
            counter.fetch_add(1, Ordering::Relaxed);
        }));
        sent += 1;
        progress.set_position((next_s * 1000.0) as u64);
        progress.set_message(format!("{sent} requests"));
    }
    for task in tasks {
        let _ = task.await;
    }
    progress.finish_and_clear();
    let elapsed_s = started.elapsed().as_secs_f64();
    println!(
        "sent {sent} streaming requests in {elapsed_s:.1} s through {} router(s): {} completed, {} failed",
        routers.len(),
        tally.ok.load(Ordering::Relaxed),
        tally.failed.load(Ordering::Relaxed)
    );
    print_summary(&client, &routers).await?;
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
            return Err(DriveError {
                name: "--router",
                reason: format!("{router} was not ready within 60 s"),
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Streams one completion to its end; true when it finished with `[DONE]`.
async fn stream_one(client: &reqwest::Client, url: &str, body: &serde_json::Value) -> bool {
    let Ok(response) = client.post(url).json(body).send().await else {
        return false;
    };
    if !response.status().is_success() {
        return false;
    }
    let mut stream = response.bytes_stream();
    let mut tail = Vec::new();
    while let Some(chunk) = stream.next().await {
        let Ok(chunk) = chunk else { return false };
        tail.extend_from_slice(&chunk);
        if tail.len() > 64 {
            tail.drain(..tail.len() - 64);
        }
    }
    tail.windows(6).any(|window| window == b"[DONE]")
}

/// Per-worker requests, token-work and TTFT p50/p99 from the routers'
/// `/metrics`, summed over the replicas.
async fn print_summary(client: &reqwest::Client, routers: &[String]) -> Result<(), DriveError> {
    let mut samples = Vec::new();
    for router in routers {
        let text = fetch_text(client, &format!("{router}/metrics")).await?;
        samples.extend(parse_prometheus_text(&text).map_err(|error| DriveError {
            name: "/metrics",
            reason: error.to_string(),
        })?);
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

async fn fetch_text(client: &reqwest::Client, url: &str) -> Result<String, DriveError> {
    let response = client.get(url).send().await.map_err(|error| DriveError {
        name: "--router",
        reason: format!("GET {url}: {error}"),
    })?;
    response.text().await.map_err(|error| DriveError {
        name: "--router",
        reason: format!("GET {url}: {error}"),
    })
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
