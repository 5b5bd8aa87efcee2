//! Rows of the report, and `report.json` / `report.md`.

use std::fmt::Write as _;
use std::path::Path;

use serde_json::{Map, Value, json};

use super::Options;

/// Most a row's runs may disagree (max / min) before its median means
/// nothing: past it the row is FAILED, its median is not reported, and the
/// bench exits non-zero once the report is written.
pub(crate) const MAX_RUN_SPREAD: f64 = 1.5;

/// One measurement: a name and its fields, in the order they were added,
/// and why it failed, if it did.
#[derive(Debug, Clone)]
pub(crate) struct Row {
    pub(crate) name: String,
    fields: Map<String, Value>,
    failures: Vec<String>,
}

impl Row {
    pub(crate) fn new(name: impl Into<String>) -> Row {
        Row {
            name: name.into(),
            fields: Map::new(),
            failures: Vec::new(),
        }
    }

    /// The median of `runs` as `key`, and their spread (max / min) as
    /// `<key>_spread`; when the runs disagree by more than
    /// [`MAX_RUN_SPREAD`], `key` is left empty and the row is FAILED.
    pub(crate) fn settled(self, key: &str, runs: &[f64]) -> Row {
        self.settled_within(key, runs, 0.0)
    }

    /// As [`Row::settled`], but runs within `resolution` of each other
    /// (what the measurement cannot tell apart, such as one clock tick of
    /// CPU time) always agree.
    pub(crate) fn settled_within(self, key: &str, runs: &[f64], resolution: f64) -> Row {
        let spread = super::spread(runs);
        let row = self.num(&format!("{key}_spread"), spread);
        let low = runs.iter().copied().fold(f64::INFINITY, f64::min);
        let high = runs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let apart = spread.is_nan() || spread > MAX_RUN_SPREAD;
        if runs.len() > 1 && apart && high - low > resolution {
            return row.num(key, f64::NAN).fail(format!(
                "`{key}` runs disagree by {spread:.2}× (> {MAX_RUN_SPREAD}×; range {low:.4}–{high:.4}): no median"
            ));
        }
        row.num(key, super::median(runs))
    }

    /// Marks the row FAILED, saying why.
    pub(crate) fn fail(mut self, why: String) -> Row {
        self.failures.push(why);
        self
    }

    pub(crate) fn failures(&self) -> &[String] {
        &self.failures
    }

    /// Adds a number (rounded to 4 significant decimals; NaN becomes null).
    pub(crate) fn num(mut self, key: &str, value: f64) -> Row {
        let value = if value.is_finite() {
            json!((value * 10_000.0).round() / 10_000.0)
        } else {
            Value::Null
        };
        self.fields.insert(key.to_owned(), value);
        self
    }

    pub(crate) fn int(mut self, key: &str, value: u64) -> Row {
        self.fields.insert(key.to_owned(), json!(value));
        self
    }

    pub(crate) fn get(&self, key: &str) -> Option<f64> {
        self.fields.get(key).and_then(Value::as_f64)
    }

    fn to_json(&self) -> Value {
        let mut object = Map::new();
        object.insert("name".to_owned(), json!(self.name));
        object.extend(self.fields.clone());
        object.insert(
            "status".to_owned(),
            json!(if self.failures.is_empty() {
                "ok"
            } else {
                "FAILED"
            }),
        );
        if !self.failures.is_empty() {
            object.insert("failures".to_owned(), json!(self.failures));
        }
        Value::Object(object)
    }
}

/// Every failure of `rows`, as (row name, why).
pub(crate) fn failures(rows: &[Row]) -> impl Iterator<Item = (&str, &str)> {
    rows.iter().flat_map(|row| {
        row.failures
            .iter()
            .map(move |why| (row.name.as_str(), why.as_str()))
    })
}

/// The row named `name`, if measured.
pub(crate) fn find<'a>(rows: &'a [Row], name: &str) -> Option<&'a Row> {
    rows.iter().find(|row| row.name == name)
}

/// Writes both files and prints the markdown.
pub(crate) fn write(
    dir: &Path,
    rows: &[Row],
    notes: &[String],
    options: &Options,
) -> Result<(), String> {
    let array = Value::Array(rows.iter().map(Row::to_json).collect());
    let text = serde_json::to_string_pretty(&array)
        .map_err(|error| format!("cannot encode report.json: {error}"))?;
    let json_path = dir.join("report.json");
    std::fs::write(&json_path, text + "\n")
        .map_err(|error| format!("cannot write {}: {error}", json_path.display()))?;
    let markdown = markdown(rows, notes, options);
    let md_path = dir.join("report.md");
    std::fs::write(&md_path, &markdown)
        .map_err(|error| format!("cannot write {}: {error}", md_path.display()))?;
    println!("{markdown}");
    eprintln!(
        "xtask: wrote {} and {}",
        json_path.display(),
        md_path.display()
    );
    Ok(())
}

fn cell(row: &Row, key: &str, decimals: usize) -> String {
    figure(row.get(key), decimals)
}

/// A table of the rows whose name starts with `prefix`.
fn table(out: &mut String, rows: &[Row], prefix: &str, columns: &[(&str, &str, usize)]) {
    let chosen: Vec<&Row> = rows
        .iter()
        .filter(|row| row.name.starts_with(prefix))
        .collect();
    if chosen.is_empty() {
        out.push_str("(not measured in this run)\n\n");
        return;
    }
    out.push_str("| name |");
    for (_, title, _) in columns {
        let _ = write!(out, " {title} |");
    }
    out.push_str(" status |\n|---|");
    for _ in columns {
        out.push_str("---:|");
    }
    out.push_str("---|\n");
    for row in &chosen {
        let _ = write!(out, "| `{}` |", row.name);
        for (key, _, decimals) in columns {
            let _ = write!(out, " {} |", cell(row, key, *decimals));
        }
        let status = if row.failures.is_empty() {
            "ok"
        } else {
            "**FAILED**"
        };
        let _ = writeln!(out, " {status} |");
    }
    out.push('\n');
    for row in chosen {
        for why in &row.failures {
            let _ = writeln!(out, "- **FAILED** `{}`: {why}", row.name);
        }
    }
    if !out.ends_with("\n\n") {
        out.push('\n');
    }
}

fn verdict(met: Option<bool>) -> &'static str {
    match met {
        Some(true) => "**met**",
        Some(false) => "**missed**",
        None => "not measured",
    }
}

/// `value` with `decimals` decimals, or `–` when it was not measured.
fn figure(value: Option<f64>, decimals: usize) -> String {
    value.map_or("–".to_owned(), |value| format!("{value:.decimals$}"))
}

fn ratio_text(ratio: Option<f64>) -> String {
    ratio.map_or("–".to_owned(), |r| format!("{r:.3}×"))
}

/// `; run by run: median …× (…–…×)`, the paired ratios' summary a
/// saturation row carries under `key`, or nothing.
fn paired_text(row: Option<&Row>, key: &str) -> String {
    let field = |suffix: &str| row.and_then(|row| row.get(&format!("{key}{suffix}")));
    match (field(""), field("_min"), field("_max")) {
        (Some(median), Some(low), Some(high)) => format!(
            "; run by run, each beside nginx's run next to it: median {median:.3}×, range {low:.3}–{high:.3}×"
        ),
        _ => String::new(),
    }
}

/// The share of its core a proxy must use in a saturation run for the
/// throughput target to be judged: below it, the load side (wrk and the
/// engines, which share the other core) limited the run, and the two
/// proxies' throughputs measure that core, not the proxies.
const PROXY_SATURATED_CORE_BUSY: f64 = 0.9;

/// The performance targets, checked against the rows. A target whose row
/// FAILED (or was not measured) is "not measured", never met; the p99 at
/// half load is judged on the router's run-by-run ratios to nginx, which
/// must agree in their turn, so it stands even when one proxy's own p99s
/// disagree.
pub(crate) fn targets(rows: &[Row]) -> Vec<String> {
    let mut lines = Vec::new();
    let value = |name: &str, key: &str| find(rows, name).and_then(|row| row.get(key));
    for mode in ["non-stream", "stream"] {
        let router = value(&format!("proxy/least_load/{mode}"), "cpu_us_per_request");
        let nginx = value(&format!("proxy/nginx/{mode}"), "cpu_us_per_request");
        let ratio = router.zip(nginx).map(|(router, nginx)| router / nginx);
        lines.push(format!(
            "- router (least_load, {mode}) CPU per request ≤ 1.0× nginx's: {} ({}: router {} µs, nginx {} µs{})",
            verdict(ratio.map(|r| r <= 1.0)),
            ratio_text(ratio),
            figure(router, 1),
            figure(nginx, 1),
            paired_text(find(rows, &format!("proxy/least_load/{mode}")), "cpu_vs_nginx_paired"),
        ));
    }
    for mode in ["non-stream", "stream"] {
        let row = find(rows, &format!("proxy/least_load/{mode}"));
        let ratio = row.and_then(|row| row.get("vs_nginx"));
        let busy = |proxy: &str| value(&format!("proxy/{proxy}/{mode}"), "proxy_core_busy");
        let (router_busy, nginx_busy) = (busy("least_load"), busy("nginx"));
        let saturated = router_busy
            .zip(nginx_busy)
            .is_some_and(|(router, nginx)| router.min(nginx) >= PROXY_SATURATED_CORE_BUSY);
        let judged = match ratio {
            Some(ratio) if saturated => verdict(Some(ratio >= 1.1)).to_owned(),
            Some(_) => format!(
                "**not judged**: the proxies were not what limited it (their core busy: router {}, nginx {}; judged at ≥ {PROXY_SATURATED_CORE_BUSY}); wrk and the engines' core was, and moves both alike",
                figure(router_busy, 2),
                figure(nginx_busy, 2),
            ),
            None => verdict(None).to_owned(),
        };
        lines.push(format!(
            "- router (least_load, {mode}) throughput ≥ 1.1× nginx: {judged} ({}; direct path {}{})",
            ratio_text(ratio),
            ratio_text(value(&format!("proxy/direct/{mode}"), "vs_nginx")),
            paired_text(row, "vs_nginx_paired"),
        ));
    }
    // A p99 is a tail, and one stall on a shared machine moves a run's:
    // each router run is judged against the nginx run beside it, and those
    // ratios must agree as any row's runs must.
    for mode in ["stream", "non-stream"] {
        let router_row = find(rows, &format!("half-load/least_load/{mode}"));
        let nginx_row = find(rows, &format!("half-load/nginx/{mode}"));
        let paired = |suffix: &str| {
            router_row.and_then(|row| row.get(&format!("p99_vs_nginx_paired{suffix}")))
        };
        let (ratio, paired_spread) = (paired(""), paired("_spread"));
        let judged = match paired_spread {
            Some(spread) if spread <= MAX_RUN_SPREAD => verdict(ratio.map(|r| r <= 1.0)).to_owned(),
            Some(spread) => format!(
                "not measured: the run-by-run ratios disagree by {spread:.2}× (> {MAX_RUN_SPREAD}×)"
            ),
            None => verdict(None).to_owned(),
        };
        let range = |row: Option<&Row>| {
            row.and_then(|r| r.get("p99_min_ms").zip(r.get("p99_max_ms")))
                .map_or("–".to_owned(), |(low, high)| {
                    format!("{low:.3}–{high:.3}")
                })
        };
        lines.push(format!(
            "- router (least_load, {mode}) p99 ≤ nginx p99 at 50% of the router's saturation, each router run against the nginx run beside it: {judged} (median {}, range {}–{}; medians: router {} ms, nginx {} ms; runs' range: router {}, nginx {})",
            ratio_text(ratio),
            figure(paired("_min"), 3),
            ratio_text(paired("_max")),
            figure(router_row.and_then(|r| r.get("p99_ms")), 3),
            figure(nginx_row.and_then(|r| r.get("p99_ms")), 3),
            range(router_row),
            range(nginx_row),
        ));
    }
    // The router-cpu fleets are canned engines that all report an empty
    // queue, so the selection the router makes there is the idle fleet's
    // (every worker tied): that row is what each size's CPU is taken less.
    let select_us = |row: &str| value(row, "ns_per_op").map(|ns| ns / 1000.0);
    let idle_16_us = select_us("select/least_load_idle/16");
    let idle_1024_us = select_us("select/least_load_idle/1024");
    for (key, what) in [
        ("cpu_us_per_request", "router CPU per request"),
        (
            "cpu_us_per_request_less_polling",
            "router CPU per request less the idle polling's",
        ),
    ] {
        let at_16 = value("router-cpu/least_load/16", key);
        let at_1024 = value("router-cpu/least_load/1024", key);
        let ratio = at_1024.zip(idle_1024_us).zip(at_16.zip(idle_16_us)).map(
            |((at_1024, select_1024), (at_16, select_16))| {
                (at_1024 - select_1024) / (at_16 - select_16)
            },
        );
        lines.push(format!(
            "- {what} at 1024 workers less its selection (criterion, `select/least_load_idle`: the canned fleet is idle), ≤ 1.1× that at 16: {} ({}: ({} − {}) / ({} − {}) µs)",
            verdict(ratio.map(|r| r <= 1.1)),
            ratio_text(ratio),
            figure(at_1024, 1),
            figure(idle_1024_us, 2),
            figure(at_16, 1),
            figure(idle_16_us, 2),
        ));
    }
    let nginx_16 = value("nginx-cpu/least_conn/16", "cpu_us_per_request");
    let nginx_1024 = value("nginx-cpu/least_conn/1024", "cpu_us_per_request");
    let nginx_growth = nginx_1024
        .zip(nginx_16)
        .map(|(at_1024, at_16)| at_1024 / at_16);
    lines.push(format!(
        "- for reference, not a target: nginx (`least_conn`, which scans its upstreams too) CPU per request at 1024 workers / at 16: {} ({} / {} µs)",
        ratio_text(nginx_growth),
        figure(nginx_1024, 1),
        figure(nginx_16, 1),
    ));
    let sick = value("router-cpu/least_load_one_sick/1024", "cpu_us_per_request");
    let healthy = value("router-cpu/least_load/1024", "cpu_us_per_request");
    lines.push(format!(
        "- for reference, not a target: the router's CPU per request at 1024 workers, one of them without load reports, over the healthy fleet's: {} ({} / {} µs)",
        ratio_text(sick.zip(healthy).map(|(sick, healthy)| sick / healthy)),
        figure(sick, 1),
        figure(healthy, 1),
    ));
    for (row, what) in [
        ("select/least_load/1024", "a busy fleet"),
        (
            "select/least_load_idle/1024",
            "an idle fleet, every worker tied",
        ),
    ] {
        let select = select_us(row);
        lines.push(format!(
            "- selection at 1024 workers ≤ 3 µs, {what} (`{row}`): {} ({})",
            verdict(select.map(|us| us <= 3.0)),
            select.map_or("–".to_owned(), |us| format!("{us:.2} µs"))
        ));
    }
    for suffix in ["64", "64/2-thread"] {
        let ratio = value(&format!("select/least_load/{suffix}"), "vs_baseline");
        lines.push(format!(
            "- select/least_load/{suffix} ≥ 10× the original design: {} ({})",
            verdict(ratio.map(|r| r >= 10.0)),
            ratio_text(ratio)
        ));
    }
    let poll = find(rows, "poll/1024").and_then(|r| r.get("cpu_fraction"));
    lines.push(format!(
        "- load polling, 1024 workers at 1 s, ≤ 5% of one core: {} ({})",
        verdict(poll.map(|f| f <= 0.05)),
        poll.map_or("–".to_owned(), |f| format!("{:.2}%", f * 100.0))
    ));
    let versus = find(rows, "replicas/sync-vs");
    let vs_one = versus.and_then(|r| r.get("vs_one_router"));
    lines.push(format!(
        "- 3 replicas with sync: p99 TTFT within 1.2× of one router: {} ({})",
        verdict(vs_one.map(|r| r <= 1.2)),
        vs_one.map_or("–".to_owned(), |r| format!("{r:.3}×"))
    ));
    let vs_no_sync = versus.and_then(|r| r.get("vs_no_sync"));
    lines.push(format!(
        "- 3 replicas with sync: p99 TTFT ≥ 25% below 3 without: {} ({})",
        verdict(vs_no_sync.map(|r| r <= 0.75)),
        vs_no_sync.map_or("–".to_owned(), |r| format!("{r:.3}×"))
    ));
    let multi_turn =
        |key: &str| find(rows, "replicas-multi-turn/sync-vs").and_then(|row| row.get(key));
    let points = multi_turn("hit_rate_points_vs_one");
    let hit_rate = |setup: &str| {
        figure(
            value(&format!("replicas-multi-turn/{setup}"), "hit_rate_pct"),
            1,
        )
    };
    lines.push(format!(
        "- multi-turn, 3 replicas with sync keep the fleet's prefix-cache hit rate within {} points of one router's: {} ({} points: {}% against {}%)",
        super::replicas::MULTI_TURN_HIT_RATE_POINTS,
        verdict(points.map(super::replicas::hit_rate_kept)),
        points.map_or("–".to_owned(), |p| format!("{p:+.1}")),
        hit_rate("3-replicas-sync"),
        hit_rate("one-router"),
    ));
    let vs_one = multi_turn("vs_one_router");
    lines.push(format!(
        "- multi-turn, 3 replicas with sync: p99 TTFT within {}× one router's: {} ({})",
        super::replicas::MULTI_TURN_P99_RATIO,
        verdict(vs_one.map(super::replicas::multi_turn_p99_kept)),
        ratio_text(vs_one)
    ));
    let sync_cpu = find(rows, "replicas/sync-cpu/1024").and_then(|r| r.get("sync_cpu_fraction"));
    lines.push(format!(
        "- sync at 1024 workers < 5% of one core per replica: {} ({})",
        verdict(sync_cpu.map(|f| f < 0.05)),
        sync_cpu.map_or("–".to_owned(), |f| format!("{:.2}%", f * 100.0))
    ));
    lines
}

fn markdown(rows: &[Row], notes: &[String], options: &Options) -> String {
    let mut out = String::from("# cargo xtask bench\n\n");
    let failed: Vec<&Row> = rows.iter().filter(|row| !row.failures.is_empty()).collect();
    if !failed.is_empty() {
        let _ = writeln!(
            out,
            "**FAILED: {} row(s) whose runs disagree by more than {MAX_RUN_SPREAD}×; their medians are not reported and no target is judged on them.** Run again on a quieter machine.\n",
            failed.len()
        );
        for row in failed {
            for why in &row.failures {
                let _ = writeln!(out, "- `{}`: {why}", row.name);
            }
        }
        out.push('\n');
    }
    out.push_str("## Targets\n\n");
    for line in targets(rows) {
        out.push_str(&line);
        out.push('\n');
    }
    out.push_str("\n## Proxy overhead (saturation, 64 connections)\n\n");
    table(
        &mut out,
        rows,
        "proxy/",
        &[
            ("throughput_rps", "req/s", 0),
            ("p50_ms", "p50 ms", 3),
            ("p99_ms", "p99 ms", 3),
            ("vs_direct", "vs direct", 3),
            ("vs_nginx", "vs nginx", 3),
            ("cpu_us_per_request", "proxy CPU µs/req", 1),
            ("cpu_user_us_per_request", "of which user", 1),
            ("proxy_core_busy", "proxy core busy", 2),
            ("errors", "errors", 0),
            ("runs", "runs", 0),
            ("spread", "spread", 3),
        ],
    );
    out.push_str("## Latency at 50% of the router's saturation throughput\n\n");
    table(
        &mut out,
        rows,
        "half-load/",
        &[
            ("offered_rps", "paced at req/s", 0),
            ("throughput_rps", "achieved req/s", 0),
            ("p50_ms", "p50 ms", 3),
            ("p99_ms", "p99 ms", 3),
            ("p99_min_ms", "p99 min", 3),
            ("p99_max_ms", "p99 max", 3),
            ("p99_vs_nginx", "p99 vs nginx", 3),
            ("p99_vs_nginx_paired", "run by run", 3),
            ("p99_vs_nginx_paired_spread", "its spread", 3),
            ("errors", "errors", 0),
            ("runs", "runs", 0),
            ("spread", "spread", 3),
            ("attempts", "attempts", 0),
        ],
    );
    let _ = writeln!(
        out,
        "When either row's runs disagree, the pair is measured again, both proxies, up to {} more time(s); `attempts` counts the pair's measurements, only the last one's figures are shown, and the notes say why an attempt was repeated. `run by run`: the median of each router run's p99 over the nginx run's beside it, and `its spread` those ratios' max / min; the p99 target is judged on them, when they agree within 1.5×.\n",
        super::proxy::HALF_LOAD_RETRIES
    );
    out.push_str("## Selection cost (criterion, select + finish)\n\n");
    table(
        &mut out,
        rows,
        "select/",
        &[
            ("ns_per_op", "ns/op (median)", 1),
            ("mean_ns", "ns/op (mean)", 1),
            ("vs_baseline", "vs original design", 2),
            ("runs", "samples", 0),
            ("spread", "spread (max/min)", 2),
            ("spread_p10_p90", "spread (p90/p10)", 2),
            ("attempts", "attempts", 0),
        ],
    );
    let _ = writeln!(
        out,
        "A benchmark whose samples disagree is measured again, alone, up to {} more times; `attempts` counts its measurements, and only the last one's figures are shown.\n",
        super::select::RETRIES
    );
    out.push_str("Calibration (a fixed spin loop, the machine's own speed during the selection benchmarks: compare it between reports before comparing their selection costs):\n\n");
    table(
        &mut out,
        rows,
        "calibration/",
        &[
            ("ns_per_op", "ns/op (median)", 1),
            ("runs", "samples", 0),
            ("spread", "spread (max/min)", 2),
            ("spread_p10_p90", "spread (p90/p10)", 2),
            ("attempts", "attempts", 0),
        ],
    );
    out.push_str("## Router under many workers\n\n");
    table(
        &mut out,
        rows,
        "router-cpu/",
        &[
            ("throughput_rps", "req/s", 0),
            ("p99_ms", "p99 ms", 3),
            ("cpu_us_per_request", "router CPU µs/req", 1),
            ("cpu_user_us_per_request", "of which user", 1),
            ("cpu_us_per_request_spread", "CPU spread", 3),
            (
                "cpu_us_per_request_less_polling",
                "less idle polling µs/req",
                1,
            ),
            ("cpu_vs_nginx", "CPU vs nginx", 2),
            ("cpu_vs_healthy", "CPU vs healthy", 2),
            ("errors", "errors", 0),
            ("runs", "runs", 0),
            ("throughput_rps_spread", "req/s spread", 3),
        ],
    );
    table(
        &mut out,
        rows,
        "nginx-cpu/",
        &[
            ("throughput_rps", "req/s", 0),
            ("p99_ms", "p99 ms", 3),
            ("cpu_us_per_request", "nginx CPU µs/req", 1),
            ("cpu_user_us_per_request", "of which user", 1),
            ("cpu_us_per_request_spread", "CPU spread", 3),
            ("errors", "errors", 0),
            ("runs", "runs", 0),
            ("throughput_rps_spread", "req/s spread", 3),
        ],
    );
    table(
        &mut out,
        rows,
        "poll/",
        &[
            ("cpu_fraction", "CPU (fraction of a core)", 4),
            ("cpu_ms_per_round", "CPU ms per poll round", 2),
            ("interval_ms", "interval ms", 0),
            ("runs", "runs", 0),
            ("spread", "spread", 3),
        ],
    );
    out.push_str("## Router replicas (p99 TTFT at the client)\n\n");
    table(
        &mut out,
        rows,
        "replicas/",
        &[
            ("routers", "routers", 0),
            ("p50_ttft_s", "p50 TTFT s", 3),
            ("p99_ttft_s", "p99 TTFT s", 3),
            ("p99_min_s", "p99 min s", 3),
            ("p99_max_s", "p99 max s", 3),
            ("completed", "completed", 0),
            ("sent", "sent", 0),
            ("vs_one_router", "sync vs one router", 3),
            ("vs_no_sync", "sync vs no sync", 3),
            ("cpu_fraction_no_sync", "CPU no sync", 4),
            ("cpu_fraction_sync", "CPU sync", 4),
            ("sync_cpu_fraction", "sync CPU", 4),
        ],
    );
    out.push_str("## Router replicas under multi-turn chat sessions\n\n");
    table(
        &mut out,
        rows,
        "replicas-multi-turn/",
        &[
            ("routers", "routers", 0),
            ("hit_rate_pct", "fleet hit rate %", 1),
            ("hit_rate_min_pct", "min %", 1),
            ("hit_rate_max_pct", "max %", 1),
            ("p50_ttft_s", "p50 TTFT s", 3),
            ("p99_ttft_s", "p99 TTFT s", 3),
            ("p99_min_s", "p99 min s", 3),
            ("p99_max_s", "p99 max s", 3),
            ("p99_whole_run_s", "p99 whole run s", 3),
            ("load", "load", 2),
            ("completed", "completed", 0),
            ("runs", "runs", 0),
            ("hit_rate_points_vs_one", "sync − one router, points", 1),
            ("hit_rate_points_vs_no_sync", "sync − no sync, points", 1),
            ("vs_one_router", "p99 sync vs one router, run by run", 3),
            ("vs_one_router_min", "lowest", 3),
            ("vs_one_router_max", "highest", 3),
            ("vs_no_sync", "p99 sync vs no sync, run by run", 3),
        ],
    );
    out.push_str("## How it was measured\n\n");
    let _ = writeln!(
        out,
        "- wrk: {} connections, {} threads, {} s per run ({} s per paced run at half load), {} runs per row (median; `spread` = max/min of the runs' throughput, or of CPU for poll rows).",
        super::wrk::CONNECTIONS,
        super::wrk::THREADS,
        options.duration_s,
        options.half_load_duration_s,
        options.runs
    );
    for note in notes {
        let _ = writeln!(out, "- {note}");
    }
    out
}
