//! A small, strict parser of the Prometheus text exposition format (0.0.4).
//!
//! Backends whose engines only expose `/metrics` (vLLM, older SGLang) read
//! their gauges and counters from it. The crates.io parsers we looked at split
//! label lists on `,` and `=` without honouring escapes and skip unparsable
//! values silently, so this one follows the format's grammar instead:
//!
//! - blank lines and `#` comments are skipped; `# HELP` and `# TYPE` lines are
//!   checked (a valid metric name, a known type, valid escapes) and not
//!   returned;
//! - `name{label="value",…} value [timestamp]`, with spaces or tabs between
//!   tokens, an optional trailing comma in the label list, and `\\`, `\"`,
//!   `\n` escapes in label values (any other escape is an error);
//! - values are floats, including `NaN`, `+Inf` and `-Inf`; the optional
//!   timestamp must be an integer (milliseconds) and is dropped;
//! - histograms, summaries, `_total`, `_created` and every other series come
//!   back as plain samples under their own names: the caller picks what it
//!   reads.
//!
//! One malformed line rejects the whole text with its 1-based line number, as
//! Prometheus rejects the whole scrape. Semantic consistency (a `# TYPE` line
//! per family, samples grouped by family) is not enforced.

use crate::{PrometheusParseError, PrometheusParseReason};

/// One sample line: the series name, its labels in the order written, and
/// the value.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    /// Label names and unescaped values, in the order written.
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl Sample {
    /// The value of the label `name`, if the sample carries it.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(label, _)| label == name)
            .map(|(_, value)| value.as_str())
    }
}

/// Parses a whole Prometheus text exposition into its samples, in order.
///
/// ```
/// use load_protocols::parse_prometheus_text;
///
/// let text = concat!(
///     "# HELP vllm:num_requests_waiting Waiting requests.\n",
///     "# TYPE vllm:num_requests_waiting gauge\n",
///     "vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 3.0 1700000000000\n",
/// );
/// let samples = parse_prometheus_text(text)?;
/// assert_eq!(samples.len(), 1);
/// assert_eq!(samples[0].name, "vllm:num_requests_waiting");
/// assert_eq!(samples[0].label("engine"), Some("0"));
/// assert_eq!(samples[0].value, 3.0);
/// # Ok::<(), load_protocols::PrometheusParseError>(())
/// ```
pub fn parse_prometheus_text(text: &str) -> Result<Vec<Sample>, PrometheusParseError> {
    let mut samples = Vec::new();
    for (index, raw) in text.split('\n').enumerate() {
        let line = raw.strip_suffix('\r').unwrap_or(raw);
        let mut cursor = Cursor::new(line);
        cursor.skip_blanks();
        let parsed = match cursor.peek() {
            None => Ok(None),
            Some('#') => parse_comment(&mut cursor).map(|()| None),
            Some(_) => parse_sample(&mut cursor).map(Some),
        };
        match parsed {
            Ok(Some(sample)) => samples.push(sample),
            Ok(None) => {}
            Err(reason) => {
                return Err(PrometheusParseError {
                    line: index + 1,
                    reason,
                });
            }
        }
    }
    Ok(samples)
}

const METRIC_TYPES: [&str; 5] = ["counter", "gauge", "histogram", "summary", "untyped"];

/// `# HELP name doc`, `# TYPE name type`, or any other comment.
fn parse_comment(cursor: &mut Cursor<'_>) -> Result<(), PrometheusParseReason> {
    cursor.bump(); // '#'
    cursor.skip_blanks();
    match cursor.token() {
        "HELP" => {
            cursor.skip_blanks();
            metric_name(cursor)?;
            cursor.skip_blanks();
            check_help_escapes(cursor.rest())
        }
        "TYPE" => {
            cursor.skip_blanks();
            metric_name(cursor)?;
            cursor.skip_blanks();
            let kind = cursor.token();
            if !METRIC_TYPES.contains(&kind) {
                return Err(PrometheusParseReason::InvalidType(kind.to_owned()));
            }
            cursor.skip_blanks();
            match cursor.rest() {
                "" => Ok(()),
                rest => Err(PrometheusParseReason::TrailingText(rest.to_owned())),
            }
        }
        _ => Ok(()),
    }
}

/// Docstrings allow `\\` and `\n` only.
fn check_help_escapes(doc: &str) -> Result<(), PrometheusParseReason> {
    let mut chars = doc.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            match chars.next() {
                Some('\\' | 'n') => {}
                Some(other) => return Err(PrometheusParseReason::InvalidEscape(other.into())),
                None => return Err(PrometheusParseReason::InvalidEscape(String::new())),
            }
        }
    }
    Ok(())
}

fn parse_sample(cursor: &mut Cursor<'_>) -> Result<Sample, PrometheusParseReason> {
    let name = metric_name(cursor)?;
    cursor.skip_blanks();
    let labels = if cursor.peek() == Some('{') {
        cursor.bump();
        let labels = label_list(cursor)?;
        cursor.skip_blanks();
        labels
    } else {
        Vec::new()
    };
    let value = match cursor.token() {
        "" => return Err(PrometheusParseReason::MissingValue),
        token => parse_value(token)?,
    };
    cursor.skip_blanks();
    let timestamp = cursor.token();
    if !timestamp.is_empty() && timestamp.parse::<i64>().is_err() {
        return Err(PrometheusParseReason::InvalidTimestamp(
            timestamp.to_owned(),
        ));
    }
    cursor.skip_blanks();
    match cursor.rest() {
        "" => Ok(Sample {
            name: name.to_owned(),
            labels,
            value,
        }),
        rest => Err(PrometheusParseReason::TrailingText(rest.to_owned())),
    }
}

/// The float grammar of the format: decimal or exponent notation, `NaN`,
/// `+Inf`, `-Inf` (any case, as Go's `ParseFloat` accepts).
fn parse_value(token: &str) -> Result<f64, PrometheusParseReason> {
    let invalid = || PrometheusParseReason::InvalidValue(token.to_owned());
    let unsigned = token.trim_start_matches(['+', '-']);
    // Rust accepts a few spellings the format does not ("infinity" is fine in
    // Go too, but a doubled sign is not); keep to one optional sign.
    if token.len() - unsigned.len() > 1 {
        return Err(invalid());
    }
    token.parse::<f64>().map_err(|_| invalid())
}

/// Reads a metric name; after it must come a blank, `{` or the end.
fn metric_name<'a>(cursor: &mut Cursor<'a>) -> Result<&'a str, PrometheusParseReason> {
    let name = cursor.take_while(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':');
    let starts_well = name
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':');
    let ends_well = matches!(cursor.peek(), None | Some(' ' | '\t' | '{'));
    if starts_well && ends_well {
        Ok(name)
    } else {
        let rest = cursor.token_until(|c| c == ' ' || c == '\t' || c == '{');
        Err(PrometheusParseReason::InvalidMetricName(format!(
            "{name}{rest}"
        )))
    }
}

/// Reads `name="value",…}` after the opening brace.
fn label_list(cursor: &mut Cursor<'_>) -> Result<Vec<(String, String)>, PrometheusParseReason> {
    let mut labels: Vec<(String, String)> = Vec::new();
    loop {
        cursor.skip_blanks();
        if cursor.peek() == Some('}') {
            cursor.bump();
            return Ok(labels);
        }
        let name = label_name(cursor)?;
        cursor.skip_blanks();
        cursor.expect('=')?;
        cursor.skip_blanks();
        cursor.expect('"')?;
        let value = label_value(cursor)?;
        if labels.iter().any(|(existing, _)| existing == name) {
            return Err(PrometheusParseReason::DuplicateLabel(name.to_owned()));
        }
        labels.push((name.to_owned(), value));
        cursor.skip_blanks();
        match cursor.bump() {
            Some(',') => {}
            Some('}') => return Ok(labels),
            found => {
                return Err(PrometheusParseReason::Expected {
                    expected: '}',
                    found: describe(found),
                });
            }
        }
    }
}

fn label_name<'a>(cursor: &mut Cursor<'a>) -> Result<&'a str, PrometheusParseReason> {
    let name = cursor.take_while(|c| c.is_ascii_alphanumeric() || c == '_');
    let starts_well = name
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    if starts_well {
        Ok(name)
    } else {
        let rest = cursor.token_until(|c| c == '=' || c == ',' || c == '}');
        Err(PrometheusParseReason::InvalidLabelName(format!(
            "{name}{rest}"
        )))
    }
}

/// Reads a label value after its opening quote, through the closing quote.
fn label_value(cursor: &mut Cursor<'_>) -> Result<String, PrometheusParseReason> {
    let mut value = String::new();
    loop {
        match cursor.bump() {
            None => return Err(PrometheusParseReason::UnterminatedLabelValue),
            Some('"') => return Ok(value),
            Some('\\') => match cursor.bump() {
                Some('\\') => value.push('\\'),
                Some('"') => value.push('"'),
                Some('n') => value.push('\n'),
                Some(other) => return Err(PrometheusParseReason::InvalidEscape(other.into())),
                None => return Err(PrometheusParseReason::UnterminatedLabelValue),
            },
            Some(c) => value.push(c),
        }
    }
}

fn describe(found: Option<char>) -> String {
    match found {
        Some(c) => format!("{c:?}"),
        None => "end of line".to_owned(),
    }
}

/// A position in one line.
struct Cursor<'a> {
    line: &'a str,
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn new(line: &'a str) -> Cursor<'a> {
        Cursor { line, pos: 0 }
    }

    fn rest(&self) -> &'a str {
        &self.line[self.pos..]
    }

    fn peek(&self) -> Option<char> {
        self.rest().chars().next()
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.peek()?;
        self.pos += c.len_utf8();
        Some(c)
    }

    fn expect(&mut self, expected: char) -> Result<(), PrometheusParseReason> {
        match self.peek() {
            Some(c) if c == expected => {
                self.bump();
                Ok(())
            }
            found => Err(PrometheusParseReason::Expected {
                expected,
                found: describe(found),
            }),
        }
    }

    fn take_while(&mut self, keep: impl Fn(char) -> bool) -> &'a str {
        let rest = self.rest();
        let len = rest.find(|c: char| !keep(c)).unwrap_or(rest.len());
        self.pos += len;
        &rest[..len]
    }

    fn token_until(&mut self, stop: impl Fn(char) -> bool) -> &'a str {
        self.take_while(|c| !stop(c))
    }

    /// Everything up to the next blank.
    fn token(&mut self) -> &'a str {
        self.token_until(|c| c == ' ' || c == '\t')
    }

    fn skip_blanks(&mut self) {
        self.take_while(|c| c == ' ' || c == '\t');
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(name, value)| ((*name).to_owned(), (*value).to_owned()))
            .collect()
    }

    fn one(text: &str) -> Sample {
        let mut samples = parse_prometheus_text(text).unwrap();
        assert_eq!(samples.len(), 1, "{samples:?}");
        samples.remove(0)
    }

    fn error(text: &str) -> PrometheusParseError {
        parse_prometheus_text(text).unwrap_err()
    }

    #[test]
    fn empty_text_and_blank_lines_give_no_samples() {
        assert_eq!(parse_prometheus_text("").unwrap(), Vec::new());
        assert_eq!(parse_prometheus_text("\n\n  \n\t\n").unwrap(), Vec::new());
        let samples = parse_prometheus_text("\na 1\n\n\nb 2\n\n").unwrap();
        let names: Vec<&str> = samples.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
    }

    #[test]
    fn comments_help_and_type_lines_are_skipped() {
        let text = "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
                    # TYPE vllm:num_requests_running gauge\n\
                    # just a comment, with {braces} and \"quotes\"\n\
                    #no space after the hash\n\
                    # HELP empty_doc\n\
                    # HELP escaped Line one\\nline two \\\\ done\n\
                    # EOF\n\
                    vllm:num_requests_running{engine=\"0\"} 4.0\n";
        assert_eq!(
            parse_prometheus_text(text).unwrap(),
            vec![Sample {
                name: "vllm:num_requests_running".into(),
                labels: labels(&[("engine", "0")]),
                value: 4.0,
            }]
        );
    }

    #[test]
    fn every_metric_type_is_accepted() {
        for kind in METRIC_TYPES {
            let text = format!("# TYPE m {kind}\nm 1\n");
            assert_eq!(parse_prometheus_text(&text).unwrap().len(), 1, "{kind}");
        }
    }

    #[test]
    fn label_escapes_are_unescaped() {
        let sample = one(
            r#"msdos_file_access_time_seconds{path="C:\\DIR\\FILE.TXT",error="Cannot find file:\n\"FILE.TXT\""} 1.458255915e9"#,
        );
        assert_eq!(sample.name, "msdos_file_access_time_seconds");
        assert_eq!(
            sample.labels,
            labels(&[
                ("path", r"C:\DIR\FILE.TXT"),
                ("error", "Cannot find file:\n\"FILE.TXT\""),
            ])
        );
        assert_eq!(sample.value, 1.458255915e9);
    }

    #[test]
    fn label_values_may_hold_separators_and_unicode() {
        let sample = one(r#"m{a="x,y=z}",b="{}",c="ünï 🚀"} 2"#);
        assert_eq!(
            sample.labels,
            labels(&[("a", "x,y=z}"), ("b", "{}"), ("c", "ünï 🚀")])
        );
        assert_eq!(sample.label("c"), Some("ünï 🚀"));
        assert_eq!(sample.label("missing"), None);
    }

    #[test]
    fn special_float_values() {
        assert!(one("m NaN").value.is_nan());
        assert_eq!(one("m +Inf").value, f64::INFINITY);
        assert_eq!(one("m -Inf").value, f64::NEG_INFINITY);
        assert_eq!(one("m Inf").value, f64::INFINITY);
        assert_eq!(one("m -0.5").value, -0.5);
        assert_eq!(one("m 1e-3").value, 0.001);
        assert_eq!(one("m +3").value, 3.0);
        assert_eq!(one(r#"h_bucket{le="+Inf"} 17"#).label("le"), Some("+Inf"));
    }

    #[test]
    fn timestamps_after_the_value_are_accepted_and_dropped() {
        let sample = one(r#"http_requests_total{method="post",code="200"} 1027 1395066363000"#);
        assert_eq!(sample.value, 1027.0);
        assert_eq!(
            sample.labels,
            labels(&[("method", "post"), ("code", "200")])
        );
        assert_eq!(one("m +Inf -3982045").value, f64::INFINITY);
        assert_eq!(one("m 1 0").value, 1.0);
    }

    #[test]
    fn created_and_total_series_are_plain_samples() {
        let text = "# TYPE vllm:generation_tokens counter\n\
                    vllm:generation_tokens_total{engine=\"0\"} 1234.0\n\
                    vllm:generation_tokens_created{engine=\"0\"} 1.7e9\n";
        let samples = parse_prometheus_text(text).unwrap();
        assert_eq!(samples.len(), 2);
        assert_eq!(samples[0].name, "vllm:generation_tokens_total");
        assert_eq!(samples[0].value, 1234.0);
        assert_eq!(samples[1].name, "vllm:generation_tokens_created");
        assert_eq!(samples[1].value, 1.7e9);
    }

    #[test]
    fn histograms_and_summaries_come_back_as_their_series() {
        let text = "# TYPE d histogram\n\
                    d_bucket{le=\"0.1\"} 1\n\
                    d_bucket{le=\"+Inf\"} 3\n\
                    d_sum 0.7\n\
                    d_count 3\n\
                    # TYPE s summary\n\
                    s{quantile=\"0.5\"} 0.2\n\
                    s_sum 1\n\
                    s_count 5\n";
        let names: Vec<String> = parse_prometheus_text(text)
            .unwrap()
            .into_iter()
            .map(|s| s.name)
            .collect();
        assert_eq!(
            names,
            [
                "d_bucket", "d_bucket", "d_sum", "d_count", "s", "s_sum", "s_count"
            ]
        );
    }

    #[test]
    fn blanks_between_tokens_trailing_comma_and_crlf() {
        let sample = one("  m { a = \"1\" ,\tb=\"2\", }\t 5   123  \r\n");
        assert_eq!(sample.labels, labels(&[("a", "1"), ("b", "2")]));
        assert_eq!(sample.value, 5.0);
        assert_eq!(one("m{} 7").labels, Vec::new());
        assert_eq!(one("m{}7").value, 7.0);
    }

    #[test]
    fn error_carries_the_line_number() {
        let err = error("a 1\n# TYPE a gauge\n\nb{x=\"1\" 2\n");
        assert_eq!(err.line, 4);
        assert_eq!(
            err.reason,
            PrometheusParseReason::Expected {
                expected: '}',
                found: "'2'".into()
            }
        );
        assert_eq!(
            err.to_string(),
            "prometheus text line 4: expected '}', found '2'"
        );
    }

    #[test]
    fn malformed_lines_give_exact_reasons() {
        use PrometheusParseReason as R;
        let cases: Vec<(&str, R)> = vec![
            ("m", R::MissingValue),
            ("m{a=\"1\"}", R::MissingValue),
            ("m abc", R::InvalidValue("abc".into())),
            ("m 1,5", R::InvalidValue("1,5".into())),
            ("m --1", R::InvalidValue("--1".into())),
            ("m 1 12.5", R::InvalidTimestamp("12.5".into())),
            ("m 1 soon", R::InvalidTimestamp("soon".into())),
            ("m 1 2 3", R::TrailingText("3".into())),
            ("1m 1", R::InvalidMetricName("1m".into())),
            ("m-x 1", R::InvalidMetricName("m-x".into())),
            ("\"m\" 1", R::InvalidMetricName("\"m\"".into())),
            ("m{1a=\"x\"} 1", R::InvalidLabelName("1a".into())),
            ("m{=\"x\"} 1", R::InvalidLabelName(String::new())),
            ("m{,} 1", R::InvalidLabelName(String::new())),
            (
                "m{a-b=\"x\"} 1",
                R::Expected {
                    expected: '=',
                    found: "'-'".into(),
                },
            ),
            (
                "m{a} 1",
                R::Expected {
                    expected: '=',
                    found: "'}'".into(),
                },
            ),
            (
                "m{a=x} 1",
                R::Expected {
                    expected: '"',
                    found: "'x'".into(),
                },
            ),
            (
                "m{a=\"x\" b=\"y\"} 1",
                R::Expected {
                    expected: '}',
                    found: "'b'".into(),
                },
            ),
            (
                "m{a=\"x\"",
                R::Expected {
                    expected: '}',
                    found: "end of line".into(),
                },
            ),
            ("m{a=\"x} 1", R::UnterminatedLabelValue),
            ("m{a=\"x\\", R::UnterminatedLabelValue),
            ("m{a=\"x\\t\"} 1", R::InvalidEscape("t".into())),
            ("m{a=\"1\",a=\"2\"} 1", R::DuplicateLabel("a".into())),
            ("# TYPE m", R::InvalidType(String::new())),
            ("# TYPE m gauges", R::InvalidType("gauges".into())),
            ("# TYPE m gauge extra", R::TrailingText("extra".into())),
            ("# TYPE 9m gauge", R::InvalidMetricName("9m".into())),
            ("# HELP", R::InvalidMetricName(String::new())),
            ("# HELP m bad \\t escape", R::InvalidEscape("t".into())),
            ("# HELP m dangling \\", R::InvalidEscape(String::new())),
        ];
        for (line, reason) in cases {
            let text = format!("ok 1\n{line}\nok 2\n");
            assert_eq!(
                parse_prometheus_text(&text),
                Err(PrometheusParseError { line: 2, reason }),
                "{line:?}"
            );
        }
    }

    #[test]
    fn truncated_text_fails_on_its_last_line() {
        let full = "a{engine=\"0\"} 1\nb{engine=\"0\",model_name=\"m\"} 2\n";
        let cut = &full[..full.len() - 5];
        let err = error(cut);
        assert_eq!(err.line, 2);
        assert_eq!(err.reason, PrometheusParseReason::UnterminatedLabelValue);
    }
}
