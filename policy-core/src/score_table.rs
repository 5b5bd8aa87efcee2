use std::fmt;

use serde::Serialize;

use crate::WorkerId;

/// Why each worker scored as it did, for a hypothetical request: one row per
/// worker, one column per term. Served by the router's explain endpoint and
/// snapshotted by tests; it renders as an aligned text table.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ScoreTable {
    pub policy: String,
    /// The request that was scored, in words (`200 tokens (estimated)`).
    pub request: String,
    /// Names of the numeric columns, in row order.
    pub columns: Vec<String>,
    pub rows: Vec<ScoreRow>,
    /// The workers `select` would choose among (every row tied at the best
    /// score), marked `*` when rendered.
    pub chosen: Vec<WorkerId>,
}

/// One worker's terms.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ScoreRow {
    pub worker: WorkerId,
    pub url: String,
    pub values: Vec<f64>,
    /// Which rule applied, or why the worker was left out.
    pub note: String,
}

impl ScoreTable {
    pub fn new(policy: &str, request: String, columns: &[&str]) -> ScoreTable {
        ScoreTable {
            policy: policy.to_owned(),
            request,
            columns: columns.iter().map(|column| (*column).to_owned()).collect(),
            rows: Vec::new(),
            chosen: Vec::new(),
        }
    }

    /// The row of one worker.
    pub fn row(&self, worker: WorkerId) -> Option<&ScoreRow> {
        self.rows.iter().find(|row| row.worker == worker)
    }

    /// One worker's value in the named column.
    pub fn value(&self, worker: WorkerId, column: &str) -> Option<f64> {
        let index = self.columns.iter().position(|name| name == column)?;
        self.row(worker)?.values.get(index).copied()
    }
}

/// Formats a table cell: whole numbers without decimals, others with up to four.
pub fn format_value(value: f64) -> String {
    if !value.is_finite() {
        return value.to_string();
    }
    if value.fract() == 0.0 && value.abs() < 1e15 {
        return format!("{value:.0}");
    }
    let text = format!("{value:.4}");
    let trimmed = text.trim_end_matches('0').trim_end_matches('.');
    if trimmed == "-0" || trimmed.is_empty() {
        "0".to_owned()
    } else {
        trimmed.to_owned()
    }
}

impl fmt::Display for ScoreTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "policy: {}  request: {}", self.policy, self.request)?;
        let mut header: Vec<String> = vec![" ".into(), "worker".into(), "url".into()];
        header.extend(self.columns.iter().cloned());
        header.push("note".into());
        let mut lines = vec![header];
        for row in &self.rows {
            let mark = if self.chosen.contains(&row.worker) {
                "*"
            } else {
                " "
            };
            let mut line = vec![mark.to_owned(), row.worker.to_string(), row.url.clone()];
            line.extend(row.values.iter().map(|value| format_value(*value)));
            line.push(row.note.clone());
            lines.push(line);
        }
        let columns = lines.iter().map(Vec::len).max().unwrap_or(0);
        let widths: Vec<usize> = (0..columns)
            .map(|column| {
                lines
                    .iter()
                    .filter_map(|line| line.get(column))
                    .map(|cell| cell.chars().count())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        for line in &lines {
            let cells: Vec<String> = line
                .iter()
                .zip(&widths)
                .map(|(cell, width)| format!("{cell:<width$}"))
                .collect();
            writeln!(f, "{}", cells.join("  ").trim_end())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_formatted_compactly() {
        assert_eq!(format_value(2000.0), "2000");
        assert_eq!(format_value(0.15), "0.15");
        assert_eq!(format_value(0.123456), "0.1235");
        assert_eq!(format_value(-0.00001), "0");
        assert_eq!(format_value(f64::NAN), "NaN");
    }

    #[test]
    fn renders_aligned_with_the_chosen_marked() {
        let mut table = ScoreTable::new("demo", "200 tokens (exact)".into(), &["score"]);
        let (a, b) = (WorkerId::new(0, 0), WorkerId::new(1, 0));
        table.rows.push(ScoreRow {
            worker: a,
            url: "http://a:1".into(),
            values: vec![1.5],
            note: "fresh".into(),
        });
        table.rows.push(ScoreRow {
            worker: b,
            url: "http://bb:2".into(),
            values: vec![0.25],
            note: "fresh".into(),
        });
        table.chosen.push(b);
        assert_eq!(table.value(b, "score"), Some(0.25));
        assert_eq!(table.value(b, "nope"), None);
        insta::assert_snapshot!(table.to_string(), @r"
        policy: demo  request: 200 tokens (exact)
           worker  url          score  note
           0.0     http://a:1   1.5    fresh
        *  1.0     http://bb:2  0.25   fresh
        ");
    }
}
