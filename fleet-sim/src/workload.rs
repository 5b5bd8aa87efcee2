//! The workload generator: arrival times and prompt/output lengths, seeded.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use engine_model::mix;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Exp, LogNormal};
use request_features::extend_token_id_chain;
use serde::Deserialize;

use super::error::SimError;
use super::scenario::{ArrivalConfig, ConversationConfig, SharedPrefixConfig, TrafficConfig};

/// The standard normal quantile at 0.99.
const Z_99: f64 = 2.326_347_874_040_841;

/// A length distribution, tokens.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(tag = "dist", rename_all = "kebab-case", deny_unknown_fields)]
pub enum LengthDist {
    /// Always `tokens`.
    Constant { tokens: u32 },
    /// `long_tokens` with probability `long_fraction`, else `short_tokens`;
    /// each multiplied by `1 + spread × U(−1, 1)` (default spread 0).
    Bimodal {
        short_tokens: u32,
        long_tokens: u32,
        long_fraction: f64,
        #[serde(default)]
        spread: f64,
    },
    /// Log-normal with this median and 99th percentile, clamped to
    /// `[min_tokens, max_tokens]`.
    LogNormal {
        median_tokens: f64,
        p99_tokens: f64,
        #[serde(default = "one_token")]
        min_tokens: u32,
        max_tokens: u32,
    },
}

fn one_token() -> u32 {
    1
}

impl LengthDist {
    /// Checks the parameters; the message names the offending key.
    pub fn validate(&self) -> Result<(), String> {
        match *self {
            LengthDist::Constant { tokens } => {
                if tokens == 0 {
                    return Err("tokens must be at least 1".into());
                }
            }
            LengthDist::Bimodal {
                short_tokens,
                long_tokens,
                long_fraction,
                spread,
            } => {
                if short_tokens == 0 || long_tokens == 0 {
                    return Err("short_tokens and long_tokens must be at least 1".into());
                }
                if !(long_fraction.is_finite() && (0.0..=1.0).contains(&long_fraction)) {
                    return Err(format!(
                        "long_fraction must be in [0, 1], got {long_fraction}"
                    ));
                }
                if !(spread.is_finite() && (0.0..1.0).contains(&spread)) {
                    return Err(format!("spread must be in [0, 1), got {spread}"));
                }
            }
            LengthDist::LogNormal {
                median_tokens,
                p99_tokens,
                min_tokens,
                max_tokens,
            } => {
                if !(median_tokens.is_finite() && median_tokens >= 1.0) {
                    return Err(format!(
                        "median_tokens must be finite and at least 1, got {median_tokens}"
                    ));
                }
                if !(p99_tokens.is_finite() && p99_tokens > median_tokens) {
                    return Err(format!(
                        "p99_tokens must be finite and above median_tokens, got {p99_tokens}"
                    ));
                }
                if min_tokens == 0 || max_tokens < min_tokens {
                    return Err(format!(
                        "min_tokens must be at least 1 and max_tokens at least min_tokens, got \
                         {min_tokens} and {max_tokens}"
                    ));
                }
            }
        }
        Ok(())
    }

    /// The largest value it can draw.
    pub fn max_tokens(&self) -> u32 {
        match *self {
            LengthDist::Constant { tokens } => tokens,
            LengthDist::Bimodal {
                short_tokens,
                long_tokens,
                spread,
                ..
            } => (f64::from(short_tokens.max(long_tokens)) * (1.0 + spread)).round() as u32,
            LengthDist::LogNormal { max_tokens, .. } => max_tokens,
        }
    }

    /// The mean, tokens (exact for the clamped log-normal, up to rounding).
    pub fn mean_tokens(&self) -> f64 {
        match *self {
            LengthDist::Constant { tokens } => f64::from(tokens),
            LengthDist::Bimodal {
                short_tokens,
                long_tokens,
                long_fraction,
                ..
            } => {
                (1.0 - long_fraction) * f64::from(short_tokens)
                    + long_fraction * f64::from(long_tokens)
            }
            LengthDist::LogNormal {
                median_tokens,
                p99_tokens,
                min_tokens,
                max_tokens,
            } => {
                let (mu, sigma) = lognormal_params(median_tokens, p99_tokens);
                clamped_lognormal_mean(mu, sigma, f64::from(min_tokens), f64::from(max_tokens))
            }
        }
    }

    /// Draws one length (at least 1).
    pub fn sample(&self, rng: &mut SmallRng) -> u32 {
        match *self {
            LengthDist::Constant { tokens } => tokens,
            LengthDist::Bimodal {
                short_tokens,
                long_tokens,
                long_fraction,
                spread,
            } => {
                let base = if rng.random::<f64>() < long_fraction {
                    long_tokens
                } else {
                    short_tokens
                };
                if spread > 0.0 {
                    let factor = 1.0 + spread * (2.0 * rng.random::<f64>() - 1.0);
                    ((f64::from(base) * factor).round() as u32).max(1)
                } else {
                    base
                }
            }
            LengthDist::LogNormal {
                median_tokens,
                p99_tokens,
                min_tokens,
                max_tokens,
            } => {
                let (mu, sigma) = lognormal_params(median_tokens, p99_tokens);
                let value = LogNormal::new(mu, sigma)
                    .map(|dist| dist.sample(rng))
                    .unwrap_or(median_tokens);
                (value
                    .round()
                    .clamp(f64::from(min_tokens), f64::from(max_tokens))) as u32
            }
        }
    }
}

/// `(mu, sigma)` of the log-normal with this median and 99th percentile.
fn lognormal_params(median: f64, p99: f64) -> (f64, f64) {
    let mu = median.ln();
    (mu, (p99.ln() - mu) / Z_99)
}

/// `E[clamp(X, a, b)]` for `X ~ LogNormal(mu, sigma)`.
fn clamped_lognormal_mean(mu: f64, sigma: f64, a: f64, b: f64) -> f64 {
    let cdf = |x: f64| normal_cdf((x.ln() - mu) / sigma);
    let partial = |x: f64| normal_cdf((x.ln() - mu - sigma * sigma) / sigma);
    let body = (mu + sigma * sigma / 2.0).exp() * (partial(b) - partial(a));
    a * cdf(a) + body + b * (1.0 - cdf(b))
}

/// The standard normal CDF (erfc by Numerical Recipes' Chebyshev fit, |ε| < 1.2e-7).
fn normal_cdf(x: f64) -> f64 {
    0.5 * erfc(-x / std::f64::consts::SQRT_2)
}

fn erfc(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98
                                + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let value = t * poly.exp();
    if x >= 0.0 { value } else { 2.0 - value }
}

/// A recorded trace: `(arrival_s, prompt_tokens, output_tokens)` rows sorted by time.
#[derive(Debug, Clone, PartialEq)]
pub struct Trace {
    pub rows: Vec<(f64, u32, u32)>,
}

impl Trace {
    pub fn from_path(path: &Path) -> Result<Trace, SimError> {
        let text = std::fs::read_to_string(path).map_err(|source| SimError::Read {
            path: path.to_owned(),
            source,
        })?;
        Trace::parse(&text, path)
    }

    /// Parses `arrival_s,prompt_tokens,output_tokens` lines; a first line
    /// that does not start with a number is a header; `#` starts a comment.
    pub fn parse(text: &str, path: &Path) -> Result<Trace, SimError> {
        let error = |line: usize, message: String| SimError::Trace {
            path: PathBuf::from(path),
            line,
            message,
        };
        let mut rows = Vec::new();
        for (index, raw) in text.lines().enumerate() {
            let line = raw.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            if rows.is_empty() && index == 0 && line.starts_with(|c: char| c.is_ascii_alphabetic())
            {
                continue;
            }
            let fields: Vec<&str> = line.split(',').map(str::trim).collect();
            let [arrival, prompt, output] = fields.as_slice() else {
                return Err(error(
                    index + 1,
                    format!("expected 3 fields, got {}", fields.len()),
                ));
            };
            let arrival_s: f64 = arrival
                .parse()
                .map_err(|_| error(index + 1, format!("arrival_s {arrival:?} is not a number")))?;
            if !(arrival_s.is_finite() && arrival_s >= 0.0) {
                return Err(error(
                    index + 1,
                    format!("arrival_s must be finite and not negative, got {arrival_s}"),
                ));
            }
            let tokens = |name: &str, value: &str| -> Result<u32, SimError> {
                match value.parse::<u32>() {
                    Ok(n) if n >= 1 => Ok(n),
                    _ => Err(error(
                        index + 1,
                        format!("{name} {value:?} is not a count of at least 1"),
                    )),
                }
            };
            rows.push((
                arrival_s,
                tokens("prompt_tokens", prompt)?,
                tokens("output_tokens", output)?,
            ));
        }
        if rows.len() < 2 {
            return Err(error(0, "a trace needs at least 2 requests".into()));
        }
        rows.sort_by(|a, b| a.0.total_cmp(&b.0));
        let span = rows[rows.len() - 1].0 - rows[0].0;
        if span <= 0.0 {
            return Err(error(0, "the trace's arrivals span no time".into()));
        }
        Ok(Trace { rows })
    }

    /// Mean arrival rate, requests per second.
    pub fn rate_rps(&self) -> f64 {
        let span = self.rows[self.rows.len() - 1].0 - self.rows[0].0;
        (self.rows.len() - 1) as f64 / span
    }

    pub fn mean_prompt_tokens(&self) -> f64 {
        self.rows.iter().map(|r| f64::from(r.1)).sum::<f64>() / self.rows.len() as f64
    }

    pub fn mean_output_tokens(&self) -> f64 {
        self.rows.iter().map(|r| f64::from(r.2)).sum::<f64>() / self.rows.len() as f64
    }

    pub fn max_tokens(&self) -> u64 {
        self.rows
            .iter()
            .map(|r| u64::from(r.1) + u64::from(r.2))
            .max()
            .unwrap_or(0)
    }
}

/// A run of prompt tokens with one identity: a system prompt, a user
/// message, an answer. Two prompts that open with the same segments open
/// with the same tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub id: u64,
    pub tokens: u32,
}

/// One generated request.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestSpec {
    pub arrival_s: f64,
    pub prompt_tokens: u32,
    pub output_tokens: u32,
    /// The shared prefix it opens with, if any.
    pub prefix_group: Option<u32>,
    /// The whole prompt as segments (multi-turn traffic: system prompt,
    /// then each turn's user message and answer); `None` for the other mixes.
    pub segments: Option<Arc<[Segment]>>,
    /// Its priority value (lower first), if its traffic has classes.
    pub priority: Option<i32>,
    /// Who sent it, if its traffic has tenants.
    pub tenant: Option<Arc<str>>,
    /// Its TTFT deadline, seconds, if its traffic or class sets one.
    pub ttft_deadline_s: Option<f64>,
}

impl RequestSpec {
    /// The multi-turn session it belongs to, named by the session's first
    /// user message (the system prompt is its app's, shared with other
    /// sessions); `None` outside multi-turn traffic.
    pub fn session(&self) -> Option<u64> {
        self.segments
            .as_ref()
            .and_then(|segments| segments.get(1))
            .map(|message| message.id)
    }

    /// The runs of its prompt that have content: the shared prefix (as
    /// much of it as the prompt holds), or every segment of a multi-turn
    /// prompt. The rest of a prompt is its own, so no block of it could
    /// match another prompt's: it is left unhashed, and uncached.
    fn content_runs(&self, shared_prefix: Option<SharedPrefixConfig>) -> Cow<'_, [Segment]> {
        if let Some(segments) = &self.segments {
            return Cow::Borrowed(segments);
        }
        match (self.prefix_group, shared_prefix) {
            (Some(group), Some(prefix)) => Cow::Owned(vec![Segment {
                id: 0x5eed_0000_0000_0000 ^ (u64::from(group) << 32),
                tokens: prefix.tokens.min(self.prompt_tokens),
            }]),
            _ => Cow::Borrowed(&[]),
        }
    }

    /// The chained hashes of its blocks of `block_tokens` (what a router's
    /// prefix index keys on, and the engines' prefix caches): the synthetic
    /// token ids of its runs with content (a hash of the run's id and the
    /// token's place in it) hashed as the router hashes a body's
    /// `input_ids` ([`request_features::extend_token_id_chain`]).
    pub fn chained_block_hashes(
        &self,
        shared_prefix: Option<SharedPrefixConfig>,
        block_tokens: u32,
    ) -> Vec<u64> {
        let mut chain = Vec::new();
        let runs = self.content_runs(shared_prefix);
        extend_token_id_chain(&mut chain, segment_token_ids(&runs, 0), block_tokens);
        chain
    }
}

/// Each request's [`RequestSpec::chained_block_hashes`] at `block_tokens`:
/// what every cell of one load level routes and caches by, so it is worked
/// out once per load level rather than once per arrival in every cell.
/// Requests that open with the same shared prefix and cover as many of its
/// blocks share one copy. A multi-turn prompt that resends an earlier
/// prompt of the list (its segments less the last answer and message)
/// extends that prompt's chain: only its blocks past the earlier prompt's
/// full blocks are hashed.
pub fn chained_block_hashes_of(
    requests: &[RequestSpec],
    shared_prefix: Option<SharedPrefixConfig>,
    block_tokens: u32,
) -> Vec<Arc<[u64]>> {
    let mut by_prefix: HashMap<(u32, u32), Arc<[u64]>> = HashMap::new();
    // By the id of its last segment: each multi-turn prompt not yet
    // resent, with its chain.
    type Prompt = (Arc<[Segment]>, Arc<[u64]>);
    let mut unresent: HashMap<u64, Prompt> = HashMap::new();
    requests
        .iter()
        .map(
            |spec| match (&spec.segments, spec.prefix_group, shared_prefix) {
                (Some(segments), _, _) => {
                    let earlier = segments
                        .len()
                        .checked_sub(3)
                        .and_then(|last| unresent.remove(&segments[last].id))
                        .filter(|(earlier, _)| segments.starts_with(earlier));
                    let chain: Arc<[u64]> = match earlier {
                        Some((_, earlier_chain)) => {
                            let mut chain = earlier_chain.to_vec();
                            let hashed_tokens = chain.len() as u64 * u64::from(block_tokens);
                            let rest = segment_token_ids(segments, hashed_tokens);
                            extend_token_id_chain(&mut chain, rest, block_tokens);
                            chain.into()
                        }
                        None => spec
                            .chained_block_hashes(shared_prefix, block_tokens)
                            .into(),
                    };
                    if let Some(last) = segments.last() {
                        unresent.insert(last.id, (segments.clone(), chain.clone()));
                    }
                    chain
                }
                (None, Some(group), Some(prefix)) => {
                    // What the chain depends on besides the group.
                    let blocks = prefix.tokens.min(spec.prompt_tokens) / block_tokens.max(1);
                    by_prefix
                        .entry((group, blocks))
                        .or_insert_with(|| {
                            spec.chained_block_hashes(shared_prefix, block_tokens)
                                .into()
                        })
                        .clone()
                }
                _ => spec
                    .chained_block_hashes(shared_prefix, block_tokens)
                    .into(),
            },
        )
        .collect()
}

/// The synthetic token ids of a prompt made of `segments`, from its token
/// `from_token` on: token `k` of a segment is a hash of the segment's id
/// and `k`, so prompts that open with the same segments open with the same
/// ids, and a segment's ids depend on where in it they lie.
fn segment_token_ids(segments: &[Segment], from_token: u64) -> impl Iterator<Item = u32> + '_ {
    let mut skip = from_token;
    segments.iter().flat_map(move |segment| {
        let skipped = skip.min(u64::from(segment.tokens));
        skip -= skipped;
        // `skipped` is at most `segment.tokens`, a u32.
        let first = u32::try_from(skipped).unwrap_or(segment.tokens);
        (first..segment.tokens).map(move |offset| {
            // The high half: the low bits of a mix of nearby inputs are no
            // better spread, and an id is 32 bits.
            (mix(segment.id ^ (u64::from(offset) << 40)) >> 32) as u32
        })
    })
}

/// Mean prompt and output lengths of a traffic mix, tokens, and the mean
/// prompt tokens a warm prefix cache serves.
pub fn mean_lengths(traffic: &TrafficConfig, trace: Option<&Trace>) -> (f64, f64, f64) {
    let (prompt, output) = match trace {
        Some(trace) => (trace.mean_prompt_tokens(), trace.mean_output_tokens()),
        None => (
            traffic.prompt.map_or(0.0, |d| d.mean_tokens()),
            traffic.output.map_or(0.0, |d| d.mean_tokens()),
        ),
    };
    if let (Some(conversation), Some(user), Some(answer)) =
        (traffic.conversation, traffic.prompt, traffic.output)
    {
        return conversation_means(&conversation, &user, &answer);
    }
    let cached = traffic.shared_prefix.map_or(0.0, |prefix| {
        // Only full blocks are cached, at least one prompt token is computed;
        // a prompt shorter than the prefix shares only its own length.
        prefix.fraction * f64::from(prefix.tokens).min((prompt - 1.0).max(0.0))
    });
    (prompt, output, cached)
}

/// Generates `count` requests at a mean rate of `rate_rps`, each with its
/// class, tenant and deadline drawn from the traffic's shares.
pub fn generate(
    traffic: &TrafficConfig,
    trace: Option<&Trace>,
    rate_rps: f64,
    count: usize,
    seed: u64,
) -> Vec<RequestSpec> {
    let mut requests = generate_unlabelled(traffic, trace, rate_rps, count, seed);
    if traffic.is_labelled() {
        label(&mut requests, traffic, seed);
    }
    requests
}

/// Draws each request's class and tenant by the traffic's shares, and sets
/// its deadline. The draws come from a generator of their own, so the
/// requests themselves are those of the same traffic without labels. A
/// multi-turn session's turns share their draws: one session, one sender.
fn label(requests: &mut [RequestSpec], traffic: &TrafficConfig, seed: u64) {
    let seed = mix(seed ^ 0x1abe_1ed0_0000_0000);
    let mut per_request = SmallRng::seed_from_u64(seed);
    let class_total: f64 = traffic.classes.iter().map(|class| class.share).sum();
    let tenant_total: f64 = traffic.tenants.iter().map(|tenant| tenant.share).sum();
    let tenants: Vec<Arc<str>> = traffic
        .tenants
        .iter()
        .map(|tenant| Arc::from(tenant.name.as_str()))
        .collect();
    for request in requests {
        let mut per_session;
        let rng = match request.session() {
            Some(id) => {
                per_session = SmallRng::seed_from_u64(mix(seed ^ id));
                &mut per_session
            }
            None => &mut per_request,
        };
        let class = pick(traffic.classes.iter().map(|c| c.share), class_total, rng)
            .and_then(|index| traffic.classes.get(index));
        let tenant = pick(traffic.tenants.iter().map(|t| t.share), tenant_total, rng)
            .and_then(|index| tenants.get(index));
        request.priority = class.map(|class| class.priority);
        request.tenant = tenant.cloned();
        request.ttft_deadline_s = class
            .and_then(|class| class.ttft_deadline_s)
            .or(traffic.ttft_deadline_s);
    }
}

/// An index drawn with probability share / total; `None` without shares.
fn pick(shares: impl Iterator<Item = f64>, total: f64, rng: &mut SmallRng) -> Option<usize> {
    if total <= 0.0 {
        return None;
    }
    let point = rng.random::<f64>() * total;
    let mut below = 0.0;
    let mut last = None;
    for (index, share) in shares.enumerate() {
        below += share;
        last = Some(index);
        if point < below {
            return last;
        }
    }
    // Rounding left the point at the very top.
    last
}

fn generate_unlabelled(
    traffic: &TrafficConfig,
    trace: Option<&Trace>,
    rate_rps: f64,
    count: usize,
    seed: u64,
) -> Vec<RequestSpec> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut requests = Vec::with_capacity(count);
    if let Some(trace) = trace {
        // Scale time so that the trace's mean rate becomes the target;
        // repeat it (one mean gap after its end) when more requests are asked for.
        let scale = trace.rate_rps() / rate_rps;
        let first = trace.rows[0].0;
        let period = (trace.rows[trace.rows.len() - 1].0 - first) + 1.0 / trace.rate_rps();
        for i in 0..count {
            let (arrival, prompt, output) = trace.rows[i % trace.rows.len()];
            let lap = (i / trace.rows.len()) as f64;
            requests.push(RequestSpec {
                arrival_s: ((arrival - first) + lap * period) * scale,
                prompt_tokens: prompt,
                output_tokens: output,
                prefix_group: prefix_group(traffic.shared_prefix.as_ref(), &mut rng),
                segments: None,
                priority: None,
                tenant: None,
                ttft_deadline_s: None,
            });
        }
        return requests;
    }
    if let Some(conversation) = &traffic.conversation {
        return generate_conversations(traffic, conversation, rate_rps, count, &mut rng);
    }
    let mut arrivals = Arrivals::new(&traffic.arrival, rate_rps);
    let (Some(prompt), Some(output)) = (traffic.prompt, traffic.output) else {
        return requests;
    };
    for _ in 0..count {
        let arrival_s = arrivals.next(&mut rng);
        requests.push(RequestSpec {
            arrival_s,
            prompt_tokens: prompt.sample(&mut rng),
            output_tokens: output.sample(&mut rng),
            prefix_group: prefix_group(traffic.shared_prefix.as_ref(), &mut rng),
            segments: None,
            priority: None,
            tenant: None,
            ttft_deadline_s: None,
        });
    }
    requests
}

/// Sessions drawn to estimate a conversation mix's means.
const MEAN_SESSIONS: usize = 20_000;

/// Mean prompt, output and warm-cache cached prompt tokens of a
/// conversation mix, from `MEAN_SESSIONS` sessions drawn with a fixed seed:
/// turn 1 finds its app's system prompt cached, turn `k + 1` turn `k`'s
/// prompt (answers are not cached; whole blocks are not rounded).
fn conversation_means(
    conversation: &ConversationConfig,
    user: &LengthDist,
    answer: &LengthDist,
) -> (f64, f64, f64) {
    // The printed capacities and the run's plan ask for the same mix:
    // the 20 000 sessions are drawn once per process.
    type Means = (f64, f64, f64);
    type Key = (ConversationConfig, LengthDist, LengthDist);
    static KNOWN: Mutex<Vec<(Key, Means)>> = Mutex::new(Vec::new());
    let key = (*conversation, *user, *answer);
    let known = |known: &[(Key, Means)]| {
        known
            .iter()
            .find(|(k, _)| *k == key)
            .map(|&(_, means)| means)
    };
    if let Some(means) = KNOWN.lock().ok().and_then(|k| known(&k)) {
        return means;
    }
    let means = drawn_conversation_means(conversation, user, answer);
    if let Ok(mut k) = KNOWN.lock() {
        k.push((key, means));
    }
    means
}

/// [`conversation_means`] drawn.
fn drawn_conversation_means(
    conversation: &ConversationConfig,
    user: &LengthDist,
    answer: &LengthDist,
) -> (f64, f64, f64) {
    let mut rng = SmallRng::seed_from_u64(0xc0_4e45);
    let (mut requests, mut prompt_sum, mut output_sum, mut cached_sum) = (0u64, 0.0, 0.0, 0.0);
    for session in 0..MEAN_SESSIONS {
        for turn in session_turns(conversation, user, answer, session as u64, 0, &mut rng) {
            requests += 1;
            prompt_sum += f64::from(turn.prompt_tokens);
            output_sum += f64::from(turn.output_tokens);
            cached_sum += f64::from(turn.cached_tokens);
        }
    }
    let n = requests.max(1) as f64;
    (prompt_sum / n, output_sum / n, cached_sum / n)
}

/// One turn of a session, before its arrival time is drawn.
struct Turn {
    prompt_tokens: u32,
    output_tokens: u32,
    /// What a warm cache holds of it: the system prompt, or the previous prompt.
    cached_tokens: u32,
    segments: Arc<[Segment]>,
}

/// The turns of one session (`session` numbers it; `salt` keeps sessions of
/// different workloads apart).
fn session_turns(
    conversation: &ConversationConfig,
    user: &LengthDist,
    answer: &LengthDist,
    session: u64,
    salt: u64,
    rng: &mut SmallRng,
) -> Vec<Turn> {
    let app = rng.random_range(0..conversation.apps);
    let continue_p = 1.0 - 1.0 / conversation.mean_turns;
    let mut turns_left = 1u32;
    while turns_left < conversation.max_turns && rng.random::<f64>() < continue_p {
        turns_left += 1;
    }
    let session_id = mix(salt ^ mix(0x5e55_1000_0000_0000 ^ session));
    let mut history = vec![Segment {
        id: mix(0xa99_0000_0000 ^ u64::from(app)),
        tokens: conversation.system_tokens,
    }];
    let mut cached = conversation.system_tokens;
    let mut turns = Vec::with_capacity(turns_left as usize);
    for turn in 0..turns_left {
        let message = Segment {
            id: mix(session_id ^ (u64::from(turn) << 1)),
            tokens: user.sample(rng),
        };
        let answer_tokens = answer.sample(rng);
        let prompt: u64 =
            history.iter().map(|s| u64::from(s.tokens)).sum::<u64>() + u64::from(message.tokens);
        if prompt > u64::from(conversation.max_context_tokens) {
            break;
        }
        history.push(message);
        let segments: Arc<[Segment]> = history.clone().into();
        turns.push(Turn {
            prompt_tokens: prompt as u32,
            output_tokens: answer_tokens,
            cached_tokens: cached.min(prompt as u32 - 1),
            segments,
        });
        cached = prompt as u32;
        history.push(Segment {
            id: mix(session_id ^ (u64::from(turn) << 1) ^ 1),
            tokens: answer_tokens,
        });
    }
    turns
}

/// Multi-turn requests: sessions start at `rate_rps / mean turns` and their
/// turns follow `think_time_s` apart; sessions are drawn until `count`
/// requests arrive before the last session start, then the earliest `count`
/// are kept, in arrival order.
fn generate_conversations(
    traffic: &TrafficConfig,
    conversation: &ConversationConfig,
    rate_rps: f64,
    count: usize,
    rng: &mut SmallRng,
) -> Vec<RequestSpec> {
    let (Some(user), Some(answer)) = (traffic.prompt, traffic.output) else {
        return Vec::new();
    };
    // Mean turns really taken (max_turns and max_context_tokens cut sessions).
    let mean_turns = {
        let mut probe = SmallRng::seed_from_u64(0x7e_a175);
        let sessions = 2000u64;
        let turns: usize = (0..sessions)
            .map(|s| session_turns(conversation, &user, &answer, s, 1, &mut probe).len())
            .sum();
        (turns as f64 / sessions as f64).max(1.0)
    };
    let mut starts = Arrivals::new(&traffic.arrival, rate_rps / mean_turns);
    let think = Exp::new(1.0 / conversation.think_time_s.max(1e-9)).ok();
    let salt = rng.random::<u64>();
    let mut requests: Vec<RequestSpec> = Vec::with_capacity(count + count / 4);
    let mut session = 0u64;
    let mut arrived_before_last_start = 0usize;
    let mut pending_times: Vec<f64> = Vec::new();
    while arrived_before_last_start < count {
        let start_s = starts.next(rng);
        if !start_s.is_finite() {
            break;
        }
        let mut at_s = start_s;
        for (index, turn) in session_turns(conversation, &user, &answer, session, salt, rng)
            .into_iter()
            .enumerate()
        {
            if index > 0 {
                at_s += think.map_or(0.0, |d| d.sample(rng));
            }
            pending_times.push(at_s);
            requests.push(RequestSpec {
                arrival_s: at_s,
                prompt_tokens: turn.prompt_tokens,
                output_tokens: turn.output_tokens,
                prefix_group: None,
                segments: Some(turn.segments),
                priority: None,
                tenant: None,
                ttft_deadline_s: None,
            });
        }
        session += 1;
        // Count the turns that arrive before this start (each is counted
        // once: later starts are later).
        pending_times.retain(|&t| {
            if t <= start_s {
                arrived_before_last_start += 1;
                false
            } else {
                true
            }
        });
    }
    requests.sort_by(|a, b| a.arrival_s.total_cmp(&b.arrival_s));
    requests.truncate(count);
    requests
}

fn prefix_group(prefix: Option<&SharedPrefixConfig>, rng: &mut SmallRng) -> Option<u32> {
    let prefix = prefix?;
    (rng.random::<f64>() < prefix.fraction).then(|| rng.random_range(0..prefix.groups))
}

/// Arrival-time generator.
#[derive(Debug)]
enum Arrivals {
    Poisson {
        gap: Exp<f64>,
        now_s: f64,
    },
    OnOff {
        burst_gap: Exp<f64>,
        on: Exp<f64>,
        off: Exp<f64>,
        now_s: f64,
        burst_end_s: f64,
    },
    Never,
}

impl Arrivals {
    fn new(config: &ArrivalConfig, rate_rps: f64) -> Arrivals {
        match *config {
            ArrivalConfig::Poisson {} => match Exp::new(rate_rps) {
                Ok(gap) => Arrivals::Poisson { gap, now_s: 0.0 },
                Err(_) => Arrivals::Never,
            },
            ArrivalConfig::OnOff {
                burst_factor,
                mean_burst_s,
            } => {
                let parts = (
                    Exp::new(rate_rps * burst_factor),
                    Exp::new(1.0 / mean_burst_s),
                    Exp::new(1.0 / (mean_burst_s * (burst_factor - 1.0))),
                );
                match parts {
                    (Ok(burst_gap), Ok(on), Ok(off)) => Arrivals::OnOff {
                        burst_gap,
                        on,
                        off,
                        now_s: 0.0,
                        burst_end_s: -1.0,
                    },
                    _ => Arrivals::Never,
                }
            }
            ArrivalConfig::Trace { .. } => Arrivals::Never,
        }
    }

    fn next(&mut self, rng: &mut SmallRng) -> f64 {
        match self {
            Arrivals::Poisson { gap, now_s } => {
                *now_s += gap.sample(rng);
                *now_s
            }
            Arrivals::OnOff {
                burst_gap,
                on,
                off,
                now_s,
                burst_end_s,
            } => {
                if *burst_end_s < 0.0 {
                    *burst_end_s = on.sample(rng);
                }
                let mut candidate = *now_s + burst_gap.sample(rng);
                // Memorylessness: a gap that crosses the end of the burst
                // continues after the off period.
                while candidate > *burst_end_s {
                    let leftover = candidate - *burst_end_s;
                    let burst_start = *burst_end_s + off.sample(rng);
                    *burst_end_s = burst_start + on.sample(rng);
                    candidate = burst_start + leftover;
                }
                *now_s = candidate;
                candidate
            }
            Arrivals::Never => f64::INFINITY,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scenario::TurnedAway;

    fn traffic(arrival: ArrivalConfig, prompt: LengthDist) -> TrafficConfig {
        TrafficConfig {
            name: "t".into(),
            arrival,
            prompt: Some(prompt),
            output: Some(LengthDist::Constant { tokens: 10 }),
            shared_prefix: None,
            conversation: None,
            classes: Vec::new(),
            tenants: Vec::new(),
            ttft_deadline_s: None,
        }
    }

    fn mean(values: impl Iterator<Item = f64>) -> f64 {
        let (sum, n) = values.fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
        sum / n as f64
    }

    #[test]
    fn poisson_arrivals_have_the_target_rate_and_exponential_gaps() {
        let t = traffic(
            ArrivalConfig::Poisson {},
            LengthDist::Constant { tokens: 5 },
        );
        let requests = generate(&t, 50.0, 50_000);
        let span = requests[requests.len() - 1].arrival_s;
        let rate = requests.len() as f64 / span;
        assert!((rate - 50.0).abs() < 1.0, "rate {rate}");
        // Exponential gaps: the coefficient of variation is 1.
        let gaps: Vec<f64> = requests
            .windows(2)
            .map(|w| w[1].arrival_s - w[0].arrival_s)
            .collect();
        let m = mean(gaps.iter().copied());
        let sd = mean(gaps.iter().map(|g| (g - m) * (g - m))).sqrt();
        assert!((sd / m - 1.0).abs() < 0.03, "cv {}", sd / m);
        assert!(
            requests
                .iter()
                .all(|r| r.prompt_tokens == 5 && r.output_tokens == 10)
        );
    }

    fn generate(t: &TrafficConfig, rate: f64, count: usize) -> Vec<RequestSpec> {
        super::generate(t, None, rate, count, 7)
    }

    #[test]
    fn on_off_arrivals_keep_the_mean_rate_and_burst() {
        let t = traffic(
            ArrivalConfig::OnOff {
                burst_factor: 4.0,
                mean_burst_s: 2.0,
            },
            LengthDist::Constant { tokens: 5 },
        );
        let requests = generate(&t, 20.0, 100_000);
        let span = requests[requests.len() - 1].arrival_s;
        let rate = requests.len() as f64 / span;
        assert!((rate - 20.0).abs() < 1.0, "rate {rate}");
        // Counts per 0.5 s window are far more variable than Poisson's.
        let windows = (span / 0.5) as usize;
        let mut counts = vec![0.0f64; windows + 1];
        for r in &requests {
            counts[(r.arrival_s / 0.5) as usize] += 1.0;
        }
        let m = mean(counts.iter().copied());
        let var = mean(counts.iter().map(|c| (c - m) * (c - m)));
        assert!(var / m > 5.0, "index of dispersion {}", var / m);
        assert!(
            requests
                .windows(2)
                .all(|w| w[1].arrival_s >= w[0].arrival_s)
        );
    }

    #[test]
    fn bimodal_lengths_have_the_configured_mix() {
        let dist = LengthDist::Bimodal {
            short_tokens: 200,
            long_tokens: 6000,
            long_fraction: 0.1,
            spread: 0.0,
        };
        let requests = generate(&traffic(ArrivalConfig::Poisson {}, dist), 10.0, 50_000);
        let long = requests.iter().filter(|r| r.prompt_tokens == 6000).count() as f64;
        assert!((long / 50_000.0 - 0.1).abs() < 0.005, "{long}");
        assert!(
            requests
                .iter()
                .all(|r| r.prompt_tokens == 200 || r.prompt_tokens == 6000)
        );
        assert_eq!(dist.mean_tokens(), 780.0);
        let spread = LengthDist::Bimodal {
            short_tokens: 200,
            long_tokens: 6000,
            long_fraction: 0.1,
            spread: 0.1,
        };
        let requests = generate(&traffic(ArrivalConfig::Poisson {}, spread), 10.0, 10_000);
        assert!(
            requests
                .iter()
                .all(|r| (180..=220).contains(&r.prompt_tokens)
                    || (5400..=6600).contains(&r.prompt_tokens))
        );
        assert_eq!(spread.max_tokens(), 6600);
    }

    #[test]
    fn lognormal_lengths_hit_the_median_and_p99() {
        let dist = LengthDist::LogNormal {
            median_tokens: 500.0,
            p99_tokens: 16_000.0,
            min_tokens: 1,
            max_tokens: 1_000_000,
        };
        let requests = generate(&traffic(ArrivalConfig::Poisson {}, dist), 10.0, 100_000);
        let mut lengths: Vec<u32> = requests.iter().map(|r| r.prompt_tokens).collect();
        lengths.sort_unstable();
        let median = f64::from(lengths[50_000]);
        let p99 = f64::from(lengths[99_000]);
        assert!((median / 500.0 - 1.0).abs() < 0.03, "median {median}");
        assert!((p99 / 16_000.0 - 1.0).abs() < 0.08, "p99 {p99}");
        let sample_mean = mean(lengths.iter().map(|&l| f64::from(l)));
        assert!(
            (sample_mean / dist.mean_tokens() - 1.0).abs() < 0.03,
            "{sample_mean} vs {}",
            dist.mean_tokens()
        );
        // Clamping moves the analytic mean the same way as the samples.
        let clamped = LengthDist::LogNormal {
            median_tokens: 500.0,
            p99_tokens: 16_000.0,
            min_tokens: 100,
            max_tokens: 4000,
        };
        let requests = generate(&traffic(ArrivalConfig::Poisson {}, clamped), 10.0, 100_000);
        assert!(
            requests
                .iter()
                .all(|r| (100..=4000).contains(&r.prompt_tokens))
        );
        let sample_mean = mean(requests.iter().map(|r| f64::from(r.prompt_tokens)));
        assert!(
            (sample_mean / clamped.mean_tokens() - 1.0).abs() < 0.02,
            "{sample_mean} vs {}",
            clamped.mean_tokens()
        );
    }

    /// One class in five priority 0 (no deadline), the rest priority 1
    /// with a 2 s deadline; tenant A at ten times tenant B's rate; 5 s for
    /// every other request.
    fn labelled(mut traffic: TrafficConfig) -> TrafficConfig {
        traffic.classes = vec![
            crate::scenario::TrafficClass {
                priority: 0,
                share: 0.2,
                ttft_deadline_s: None,
            },
            crate::scenario::TrafficClass {
                priority: 1,
                share: 0.8,
                ttft_deadline_s: Some(2.0),
            },
        ];
        traffic.tenants = vec![
            crate::scenario::TrafficTenant {
                name: "A".into(),
                share: 10.0,
                alone: false,
            },
            crate::scenario::TrafficTenant {
                name: "B".into(),
                share: 1.0,
                alone: true,
            },
        ];
        traffic.ttft_deadline_s = Some(5.0);
        traffic
    }

    #[test]
    fn labels_follow_the_shares_and_leave_the_requests_as_they_were() {
        let plain = traffic(
            ArrivalConfig::Poisson {},
            LengthDist::Constant { tokens: 100 },
        );
        let t = labelled(plain.clone());
        let requests = super::generate(&t, None, 10.0, 20_000, 3);
        assert_eq!(requests, super::generate(&t, None, 10.0, 20_000, 3));
        let unlabelled = super::generate(&plain, None, 10.0, 20_000, 3);
        for (a, b) in requests.iter().zip(&unlabelled) {
            assert_eq!(
                (a.arrival_s, a.prompt_tokens, a.output_tokens),
                (b.arrival_s, b.prompt_tokens, b.output_tokens)
            );
            assert!(b.priority.is_none() && b.tenant.is_none() && b.ttft_deadline_s.is_none());
        }
        let share = |keep: &dyn Fn(&RequestSpec) -> bool| {
            requests.iter().filter(|r| keep(r)).count() as f64 / requests.len() as f64
        };
        let high = share(&|r| r.priority == Some(0));
        assert!((0.19..0.21).contains(&high), "{high}");
        let b = share(&|r| r.tenant.as_deref() == Some("B"));
        assert!((0.085..0.097).contains(&b), "{b}");
        // The class's deadline, else the traffic's.
        assert!(requests.iter().all(|r| r.ttft_deadline_s
            == if r.priority == Some(1) {
                Some(2.0)
            } else {
                Some(5.0)
            }));
        // Class and tenant are drawn independently.
        let high_b = share(&|r| r.priority == Some(0) && r.tenant.as_deref() == Some("B"));
        assert!((high_b / (high * b) - 1.0).abs() < 0.15, "{high_b}");
    }

    #[test]
    fn a_session_keeps_its_class_and_tenant_for_every_turn() {
        let (plain, _) = conversation_traffic();
        let t = labelled(plain);
        let requests = super::generate(&t, None, 20.0, 5000, 5);
        let mut sessions: HashMap<u64, (Option<i32>, Option<Arc<str>>)> = HashMap::new();
        for request in &requests {
            let session = request.segments.as_ref().unwrap()[1].id;
            let labels = (request.priority, request.tenant.clone());
            assert!(labels.0.is_some() && labels.1.is_some());
            let first = sessions.entry(session).or_insert_with(|| labels.clone());
            assert_eq!(*first, labels);
        }
        let high = sessions.values().filter(|l| l.0 == Some(0)).count() as f64;
        let share = high / sessions.len() as f64;
        assert!(
            (0.15..0.25).contains(&share),
            "{share} of {}",
            sessions.len()
        );
    }

    #[test]
    fn the_same_seed_gives_the_same_requests() {
        let dist = LengthDist::LogNormal {
            median_tokens: 500.0,
            p99_tokens: 16_000.0,
            min_tokens: 1,
            max_tokens: 32_000,
        };
        let mut t = traffic(ArrivalConfig::Poisson {}, dist);
        t.shared_prefix = Some(SharedPrefixConfig {
            fraction: 0.5,
            tokens: 256,
            groups: 4,
        });
        let a = super::generate(&t, None, 10.0, 1000, 3);
        let b = super::generate(&t, None, 10.0, 1000, 3);
        let c = super::generate(&t, None, 10.0, 1000, 4);
        assert_eq!(a, b);
        assert_ne!(a, c);
        let shared = a.iter().filter(|r| r.prefix_group.is_some()).count();
        assert!((400..600).contains(&shared), "{shared}");
        assert!(a.iter().filter_map(|r| r.prefix_group).all(|g| g < 4));
    }

    fn spec(prompt_tokens: u32, prefix_group: Option<u32>, segments: &[Segment]) -> RequestSpec {
        RequestSpec {
            arrival_s: 0.0,
            prompt_tokens,
            output_tokens: 1,
            prefix_group,
            segments: (!segments.is_empty()).then(|| Arc::from(segments)),
            priority: None,
            tenant: None,
            ttft_deadline_s: None,
        }
    }

    #[test]
    fn shared_prefix_chains_are_shared_within_a_group_only() {
        let prefix = Some(SharedPrefixConfig {
            fraction: 1.0,
            tokens: 256,
            groups: 2,
        });
        let a = spec(1000, Some(1), &[]).chained_block_hashes(prefix, 16);
        assert_eq!(a.len(), 16);
        assert_eq!(a, spec(2000, Some(1), &[]).chained_block_hashes(prefix, 16));
        let other = spec(1000, Some(2), &[]).chained_block_hashes(prefix, 16);
        assert_eq!(other.iter().zip(&a).filter(|(x, y)| x == y).count(), 0);
        // A prompt shorter than the prefix shares only its own full blocks.
        assert_eq!(
            spec(40, Some(1), &[]).chained_block_hashes(prefix, 16),
            a[..2].to_vec()
        );
        // No group, or no shared prefix: nothing to hash.
        assert!(
            spec(1000, None, &[])
                .chained_block_hashes(prefix, 16)
                .is_empty()
        );
        assert!(
            spec(1000, Some(1), &[])
                .chained_block_hashes(None, 16)
                .is_empty()
        );
    }

    /// The simulator's prompts hash as the router hashes the same prompt:
    /// a body whose `input_ids` are a simulated prompt's synthetic token ids
    /// (a shared prefix followed by the prompt's own ids, or a multi-turn
    /// prompt's segments), read by `request_features::read_request`, has
    /// the simulator's chain as its prefix blocks, or as their first blocks
    /// where the simulator leaves the prompt's own tail unhashed.
    #[test]
    fn simulated_prompts_hash_as_the_router_hashes_their_token_ids() {
        let prefix = Some(SharedPrefixConfig {
            fraction: 1.0,
            tokens: 200,
            groups: 4,
        });
        let segment = |id: u64, tokens: u32| Segment { id, tokens };
        let turns = [segment(11, 100), segment(12, 37), segment(13, 64)];
        let cases = [
            (spec(300, Some(3), &[]), true),
            (spec(120, Some(3), &[]), true),
            (spec(100 + 37 + 64, None, &turns), false),
        ];
        for block_tokens in [16, 7, 64] {
            let hashing = request_features::PrefixHashing {
                block_tokens,
                max_tokens: 1 << 20,
                chars_per_token: 4.0,
            };
            for (spec, own_tail) in &cases {
                let runs = spec.content_runs(prefix);
                let mut ids: Vec<u32> = segment_token_ids(&runs, 0).collect();
                let hashed = ids.len();
                // The prompt's own ids, after its shared prefix.
                ids.extend((hashed as u32..spec.prompt_tokens).map(|i| i.wrapping_mul(7_919)));
                assert_eq!(ids.len(), spec.prompt_tokens as usize);
                let body = serde_json::to_vec(&serde_json::json!({"input_ids": ids})).unwrap();
                let read = request_features::read_request(&body, &hashing).unwrap();
                let router = read.info.prefix;
                let simulated = spec.chained_block_hashes(prefix, block_tokens);
                assert!(!simulated.is_empty());
                assert_eq!(router.block_tokens(), block_tokens);
                if *own_tail {
                    assert_eq!(simulated, router.hashes()[..simulated.len()]);
                } else {
                    assert_eq!(
                        policy_core::PrefixBlocks::new(block_tokens, simulated),
                        router
                    );
                }
            }
        }
    }

    #[test]
    fn traces_parse_scale_and_repeat() {
        let text = "arrival_s,prompt_tokens,output_tokens\n0.0,100,10\n0.5,200,20 # comment\n\n1.0,300,30\n";
        let trace = Trace::parse(text, Path::new("t.csv")).unwrap();
        assert_eq!(trace.rows.len(), 3);
        assert_eq!(trace.rate_rps(), 2.0);
        assert_eq!(trace.mean_prompt_tokens(), 200.0);
        let t = TrafficConfig {
            name: "trace".into(),
            arrival: ArrivalConfig::Trace {
                path: "t.csv".into(),
            },
            prompt: None,
            output: None,
            shared_prefix: None,
            conversation: None,
            classes: Vec::new(),
            tenants: Vec::new(),
            ttft_deadline_s: None,
        };
        // Twice the trace's rate: half the gaps; the fourth request starts a second lap.
        let requests = super::generate(&t, Some(&trace), 4.0, 5, 1);
        let arrivals: Vec<f64> = requests.iter().map(|r| r.arrival_s).collect();
        assert_eq!(arrivals, vec![0.0, 0.25, 0.5, 0.75, 1.0]);
        assert_eq!(requests[4].prompt_tokens, 200);
        for (bad, message) in [
            ("0.0,100\n1.0,1,1\n", "line 1: expected 3 fields, got 2"),
            (
                "0.0,100,x\n1.0,1,1\n",
                "line 1: output_tokens \"x\" is not a count of at least 1",
            ),
            ("0.0,0,1\n1.0,1,1\n", "prompt_tokens \"0\" is not a count"),
            (
                "-1.0,1,1\n1.0,1,1\n",
                "arrival_s must be finite and not negative",
            ),
            ("0.0,1,1\n", "at least 2 requests"),
        ] {
            let error = Trace::parse(bad, Path::new("t.csv"))
                .unwrap_err()
                .to_string();
            assert!(error.contains(message), "{error}");
        }
    }

    fn conversation_traffic() -> (TrafficConfig, ConversationConfig) {
        let conversation = ConversationConfig {
            apps: 3,
            system_tokens: 1000,
            mean_turns: 4.0,
            max_turns: 12,
            think_time_s: 5.0,
            max_context_tokens: 8000,
            turned_away: TurnedAway::Ends,
        };
        let mut t = traffic(
            ArrivalConfig::Poisson {},
            LengthDist::Constant { tokens: 100 },
        );
        t.conversation = Some(conversation);
        (t, conversation)
    }

    #[test]
    fn conversation_turns_resend_the_history_and_share_its_blocks() {
        let (t, _) = conversation_traffic();
        let requests = super::generate(&t, None, 20.0, 5000, 5);
        assert_eq!(requests.len(), 5000);
        assert!(
            requests
                .windows(2)
                .all(|w| w[1].arrival_s >= w[0].arrival_s)
        );
        let span = requests[requests.len() - 1].arrival_s - requests[0].arrival_s;
        let rate = requests.len() as f64 / span;
        assert!((rate / 20.0 - 1.0).abs() < 0.15, "rate {rate}");
        let mut follow_ups = 0;
        let mut system_prompts = std::collections::HashSet::new();
        for request in &requests {
            let segments = request.segments.as_ref().unwrap();
            system_prompts.insert(segments[0].id);
            assert_eq!(segments[0].tokens, 1000);
            let total: u32 = segments.iter().map(|s| s.tokens).sum();
            assert_eq!(total, request.prompt_tokens);
            assert!(request.prompt_tokens <= 8000);
            // Turn k + 1 = turn k's prompt + its answer (10 tokens) + a new message.
            let turn_k = segments.len() / 2;
            if turn_k > 0 {
                let previous = requests.iter().find(|r| {
                    r.segments.as_ref().unwrap().len() + 2 == segments.len()
                        && r.segments.as_ref().unwrap()[..] == segments[..segments.len() - 2]
                });
                if let Some(previous) = previous {
                    follow_ups += 1;
                    assert_eq!(request.prompt_tokens, previous.prompt_tokens + 10 + 100);
                    assert!(request.arrival_s > previous.arrival_s);
                    let a = previous.chained_block_hashes(None, 16);
                    let b = request.chained_block_hashes(None, 16);
                    assert_eq!(a.len(), previous.prompt_tokens as usize / 16);
                    assert_eq!(a[..], b[..a.len()]);
                }
            }
        }
        assert!(follow_ups > 1000, "{follow_ups}");
        assert_eq!(system_prompts.len(), 3);
        // Different sessions of one app share only the system prompt's blocks.
        let firsts: Vec<&RequestSpec> = requests
            .iter()
            .filter(|r| r.segments.as_ref().unwrap().len() == 2)
            .collect();
        let (a, b) = (&firsts[0], &firsts[1]);
        let (ha, hb) = (
            a.chained_block_hashes(None, 16),
            b.chained_block_hashes(None, 16),
        );
        let same_app = a.segments.as_ref().unwrap()[0] == b.segments.as_ref().unwrap()[0];
        let shared = ha.iter().zip(&hb).take_while(|(x, y)| x == y).count();
        assert_eq!(shared, if same_app { 1000 / 16 } else { 0 });
        assert_eq!(requests, super::generate(&t, None, 20.0, 5000, 5));
        assert_ne!(requests, super::generate(&t, None, 20.0, 5000, 6));
    }

    #[test]
    fn conversation_means_count_the_previous_prompt_as_cached() {
        let (t, conversation) = conversation_traffic();
        let (prompt, output, cached) = mean_lengths(&t, None);
        assert_eq!(output, 10.0);
        // Uncached: the first turn's message (and its system prompt's
        // remainder nothing), later turns' answer + message: ≈ 100 + 10 × (1 − 1/turns).
        let uncached = prompt - cached;
        assert!((100.0..=110.0).contains(&uncached), "{uncached}");
        assert!(
            prompt > f64::from(conversation.system_tokens) + 100.0,
            "{prompt}"
        );
    }

    /// The chains worked out once per load level, extending each resent
    /// prompt's chain, are every request's own chain, at block sizes that
    /// do and do not divide the segments (and with empty segments and a
    /// resent prompt that ends on a block boundary).
    #[test]
    fn chains_extended_turn_by_turn_are_each_requests_own_chain() {
        let (t, _) = conversation_traffic();
        let mut requests = super::generate(&t, None, 20.0, 3000, 5);
        let segment = |id: u64, tokens: u32| Segment { id, tokens };
        let by_hand: [&[Segment]; 4] = [
            &[segment(1, 32), segment(2, 16)],
            &[segment(1, 32), segment(2, 16), segment(3, 0), segment(4, 5)],
            &[
                segment(1, 32),
                segment(2, 16),
                segment(3, 0),
                segment(4, 5),
                segment(5, 11),
                segment(6, 0),
            ],
            // Not a resend of the one before: chained from scratch.
            &[
                segment(9, 40),
                segment(2, 16),
                segment(5, 11),
                segment(6, 3),
            ],
        ];
        requests.extend(by_hand.iter().map(|segments| RequestSpec {
            arrival_s: 0.0,
            prompt_tokens: segments.iter().map(|s| s.tokens).sum(),
            output_tokens: 1,
            prefix_group: None,
            segments: Some(Arc::from(*segments)),
            priority: None,
            tenant: None,
            ttft_deadline_s: None,
        }));
        for block_tokens in [16, 7, 48, 1] {
            let chains = chained_block_hashes_of(&requests, None, block_tokens);
            assert_eq!(chains.len(), requests.len());
            for (spec, chain) in requests.iter().zip(&chains) {
                assert_eq!(chain[..], spec.chained_block_hashes(None, block_tokens)[..]);
            }
        }
    }

    #[test]
    fn segment_chains_depend_on_content_and_offset() {
        let a = [Segment { id: 1, tokens: 40 }, Segment { id: 2, tokens: 40 }];
        let b = [Segment { id: 1, tokens: 40 }, Segment { id: 3, tokens: 40 }];
        let chain = |segments: &[Segment], block_tokens| {
            spec(segments.iter().map(|s| s.tokens).sum(), None, segments)
                .chained_block_hashes(None, block_tokens)
        };
        let (ha, hb) = (chain(&a, 16), chain(&b, 16));
        assert_eq!(ha.len(), 5);
        assert_eq!(ha[..2], hb[..2]);
        assert_ne!(ha[2], hb[2]);
        // Block 0 and block 1 of one segment differ.
        assert_ne!(ha[0], ha[1]);
        assert!(chain(&[], 16).is_empty());
        // A zero block size hashes nothing, as the router's hashing off.
        assert!(chain(&a, 0).is_empty());
        // A segment's ids depend on where in it they lie.
        let ids: Vec<u32> = segment_token_ids(&a, 0).collect();
        assert_eq!(ids.len(), 80);
        assert_ne!(ids[0], ids[1]);
        let from: Vec<u32> = segment_token_ids(&a, 30).collect();
        assert_eq!(from, ids[30..]);
    }

    #[test]
    fn normal_cdf_is_accurate() {
        assert!((normal_cdf(0.0) - 0.5).abs() < 1e-7);
        assert!((normal_cdf(Z_99) - 0.99).abs() < 1e-6);
        assert!((normal_cdf(-1.0) - 0.158_655_25).abs() < 1e-6);
    }
}
