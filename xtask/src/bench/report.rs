//! Rows of the report, and `report.json` / `report.md`.

use std::fmt::Write as _;
use std::path::Path;

use serde_json::{Map, Value, json};

use super::Options;

/// One measurement: a name and its fields, in the order they were added.
#[derive(Debug, Clone)]
pub(crate) struct Row {
    pub(crate) name: String,
    fields: Map<String, Value>,
}

impl Row {
    pub(crate) fn new(name: impl Into<String>) -> Row {
        Row {
            name: name.into(),
            fields: Map::new(),
        }
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
        Value::Object(object)
    }
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
    match row.get(key) {
        Some(value) => format!("{value:.decimals$}"),
        None => "–".to_owned(),
    }
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
    out.push_str("\n|---|");
    for _ in columns {
        out.push_str("---:|");
    }
    out.push('\n');
    for row in chosen {
        let _ = write!(out, "| `{}` |", row.name);
        for (key, _, decimals) in columns {
            let _ = write!(out, " {} |", cell(row, key, *decimals));
        }
        out.push('\n');
    }
    out.push('\n');
}

fn verdict(met: Option<bool>) -> &'static str {
    match met {
        Some(true) => "**met**",
        Some(false) => "**missed**",
        None => "not measured",
    }
}

/// The three targets, checked against the rows.
pub(crate) fn targets(rows: &[Row]) -> Vec<String> {
    let mut lines = Vec::new();
    for mode in ["non-stream", "stream"] {
        for policy in ["least_load", "round_robin"] {
            let ratio =
                find(rows, &format!("proxy/{policy}/{mode}")).and_then(|r| r.get("vs_nginx"));
            lines.push(format!(
                "- router ({policy}, {mode}) throughput ≥ 0.9× nginx: {} ({})",
                verdict(ratio.map(|r| r >= 0.9)),
                ratio.map_or("–".to_owned(), |r| format!("{r:.3}×"))
            ));
        }
    }
    for mode in ["non-stream", "stream"] {
        let router_row = find(rows, &format!("half-load/least_load/{mode}"));
        let nginx_row = find(rows, &format!("half-load/nginx/{mode}"));
        let router = router_row.and_then(|r| r.get("p99_ms"));
        let nginx = nginx_row.and_then(|r| r.get("p99_ms"));
        let met = router.zip(nginx).map(|(router, nginx)| router <= nginx);
        let range = |row: Option<&Row>| {
            row.and_then(|r| r.get("p99_min_ms").zip(r.get("p99_max_ms")))
                .map_or("–".to_owned(), |(low, high)| {
                    format!("{low:.3}–{high:.3}")
                })
        };
        lines.push(format!(
            "- router (least_load, {mode}) p99 ≤ nginx p99 at 50% of the router's saturation: {} (medians: router {} ms, nginx {} ms; runs' range: router {}, nginx {})",
            verdict(met),
            router.map_or("–".to_owned(), |v| format!("{v:.3}")),
            nginx.map_or("–".to_owned(), |v| format!("{v:.3}")),
            range(router_row),
            range(nginx_row),
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
            ("errors", "errors", 0),
            ("runs", "runs", 0),
            ("spread", "spread", 3),
        ],
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
            ("spread", "spread", 2),
        ],
    );
    table(
        &mut out,
        rows,
        "calibration/",
        &[("ns_per_op", "ns/op (median)", 1), ("runs", "samples", 0)],
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
            ("errors", "errors", 0),
            ("runs", "runs", 0),
            ("spread", "spread", 3),
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
    out.push_str("## How it was measured\n\n");
    let _ = writeln!(
        out,
        "- wrk: {} connections, {} threads, {} s per run, {} runs per row (median; `spread` = max/min of the runs' throughput, or of CPU for poll rows).",
        super::wrk::CONNECTIONS,
        super::wrk::THREADS,
        options.duration_s,
        options.runs
    );
    for note in notes {
        let _ = writeln!(out, "- {note}");
    }
    out
}
