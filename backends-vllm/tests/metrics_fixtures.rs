//! The `/metrics` conversion on real-shaped captures (`tests/fixtures/`).

use std::time::{Duration, Instant};

use backends_vllm::{VllmEngineSeries, VllmMetricsConverter, VllmMetricsError, engine_series};
use load_protocols::{LoadValidationError, PrometheusParseReason, parse_prometheus_text};

const V1_T0: &str = include_str!("fixtures/v1_two_engines_t0.txt");
const V1_T1: &str = include_str!("fixtures/v1_two_engines_t1.txt");
const OLDER: &str = include_str!("fixtures/older_server.txt");
const QUIRKS: &str = include_str!("fixtures/v1_quirks.txt");

fn close(actual: f64, expected: f64) -> bool {
    (actual - expected).abs() < 1e-9
}

#[test]
fn v1_two_engines_first_poll() {
    let load = VllmMetricsConverter::new()
        .convert_text(V1_T0, Instant::now())
        .unwrap();
    assert_eq!(load.ranks().len(), 2);
    assert_eq!(load.running_requests(), 24 + 19);
    assert_eq!(load.waiting_requests(), 7 + 2);
    assert!(close(load.kv_usage_ratio(), (0.6218 + 0.4406) / 2.0));
    // First poll: no rate yet. vLLM never reports queued tokens.
    assert_eq!(load.throughput_tps(), None);
    assert_eq!(load.queued_tokens(), None);
    let engine0 = &load.ranks()[0];
    assert_eq!(engine0.dp_rank, 0);
    assert_eq!(engine0.num_total_reqs, 31);
    assert!(close(engine0.cache_hit_rate, 512_000.0 / 1_843_922.0));
    insta::assert_json_snapshot!("v1_two_engines_t0", load);
}

#[test]
fn v1_two_engines_second_poll_reports_the_generation_rate() {
    let start = Instant::now();
    let mut converter = VllmMetricsConverter::new();
    converter.convert_text(V1_T0, start).unwrap();
    let load = converter
        .convert_text(V1_T1, start + Duration::from_secs(2))
        .unwrap();
    // engine 0: 405813 - 402113 = 3700 tokens in 2 s; engine 1: 3300.
    assert_eq!(load.ranks()[0].gen_throughput, Some(1_850.0));
    assert_eq!(load.ranks()[1].gen_throughput, Some(1_650.0));
    assert_eq!(load.throughput_tps(), Some(3_500.0));
    assert_eq!(load.running_requests(), 26 + 18);
    assert_eq!(load.waiting_requests(), 5 + 3);
    assert!(close(load.kv_usage_ratio(), (0.6570 + 0.4312) / 2.0));
    assert_eq!(load.queued_tokens(), None);
    insta::assert_json_snapshot!("v1_two_engines_t1", load);
}

#[test]
fn a_counter_reset_gives_no_rate_never_a_negative_one() {
    let start = Instant::now();
    let mut converter = VllmMetricsConverter::new();
    converter.convert_text(V1_T1, start).unwrap();
    // The server restarted: the counters went back to the t0 values.
    let load = converter
        .convert_text(V1_T0, start + Duration::from_secs(1))
        .unwrap();
    assert_eq!(load.throughput_tps(), None);
    assert!(
        load.ranks()
            .iter()
            .all(|rank| rank.gen_throughput.is_none())
    );
    // And the next poll measures from the reset reading.
    let load = converter
        .convert_text(V1_T1, start + Duration::from_secs(3))
        .unwrap();
    assert_eq!(load.throughput_tps(), Some(3_500.0));
}

#[test]
fn an_engine_that_disappears_starts_over() {
    let start = Instant::now();
    let mut converter = VllmMetricsConverter::new();
    converter.convert_text(V1_T0, start).unwrap();
    let only_engine_1: String = V1_T1
        .lines()
        .filter(|line| !line.contains("engine=\"0\""))
        .map(|line| format!("{line}\n"))
        .collect();
    let load = converter
        .convert_text(&only_engine_1, start + Duration::from_secs(2))
        .unwrap();
    assert_eq!(load.ranks().len(), 1);
    assert_eq!(load.ranks()[0].dp_rank, 1);
    assert_eq!(load.throughput_tps(), Some(1_650.0));
    // Engine 0 comes back: its old reading was dropped, so no rate yet.
    let load = converter
        .convert_text(V1_T1, start + Duration::from_secs(4))
        .unwrap();
    assert_eq!(load.ranks()[0].gen_throughput, None);
    assert_eq!(load.ranks()[1].gen_throughput, Some(0.0));
}

#[test]
fn older_server_without_engine_label_uses_gpu_cache_usage() {
    let samples = parse_prometheus_text(OLDER).unwrap();
    assert_eq!(
        engine_series(&samples),
        vec![VllmEngineSeries {
            engine: String::new(),
            num_requests_running: Some(11.0),
            num_requests_waiting: Some(4.0),
            kv_cache_usage_ratio: Some(0.8734),
            generation_tokens_total: Some(190_455.0),
            prefix_cache_hit_ratio: Some(0.3125),
        }]
    );
    let load = VllmMetricsConverter::new()
        .convert(&samples, Instant::now())
        .unwrap();
    assert_eq!(load.ranks().len(), 1);
    assert_eq!(load.ranks()[0].dp_rank, 0);
    assert_eq!(load.running_requests(), 11);
    assert_eq!(load.waiting_requests(), 4);
    assert!(close(load.kv_usage_ratio(), 0.8734));
    assert_eq!(load.throughput_tps(), None);
    assert_eq!(load.queued_tokens(), None);
    insta::assert_json_snapshot!("older_server", load);
}

#[test]
fn kv_cache_usage_perc_wins_over_the_older_gauge() {
    let text = "vllm:num_requests_running{engine=\"0\"} 1\n\
                vllm:num_requests_waiting{engine=\"0\"} 0\n\
                vllm:gpu_cache_usage_perc{engine=\"0\"} 0.9\n\
                vllm:kv_cache_usage_perc{engine=\"0\"} 0.2\n\
                vllm:num_requests_running{engine=\"1\"} 1\n\
                vllm:num_requests_waiting{engine=\"1\"} 0\n\
                vllm:gpu_cache_usage_perc{engine=\"1\"} 0.6\n";
    let load = VllmMetricsConverter::new()
        .convert_text(text, Instant::now())
        .unwrap();
    assert!(close(load.ranks()[0].token_usage, 0.2));
    // Engine 1 has only the older gauge: the fallback is per engine.
    assert!(close(load.ranks()[1].token_usage, 0.6));
    assert!(close(load.kv_usage_ratio(), 0.4));
}

#[test]
fn several_series_of_one_engine_are_summed_and_averaged() {
    let text = "vllm:num_requests_running{engine=\"0\",model_name=\"a\"} 2\n\
                vllm:num_requests_running{engine=\"0\",model_name=\"b\"} 3\n\
                vllm:num_requests_waiting{engine=\"0\",model_name=\"a\"} 1\n\
                vllm:num_requests_waiting{engine=\"0\",model_name=\"b\"} 4\n\
                vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"a\"} 0.2\n\
                vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"b\"} 0.4\n";
    let load = VllmMetricsConverter::new()
        .convert_text(text, Instant::now())
        .unwrap();
    assert_eq!(load.ranks().len(), 1);
    assert_eq!(load.running_requests(), 5);
    assert_eq!(load.waiting_requests(), 5);
    assert!(close(load.kv_usage_ratio(), 0.3));
}

#[test]
fn quirks_comments_unknown_families_created_timestamps_and_escapes() {
    let samples = parse_prometheus_text(QUIRKS).unwrap();
    let running = samples
        .iter()
        .find(|s| s.name == "vllm:num_requests_running")
        .unwrap();
    assert_eq!(
        running.label("model_name"),
        Some(r#"org/model "v2" \ beta"#)
    );
    let start = Instant::now();
    let mut converter = VllmMetricsConverter::new();
    let load = converter.convert(&samples, start).unwrap();
    assert_eq!(load.running_requests(), 4);
    assert_eq!(load.waiting_requests(), 6);
    assert!(close(load.kv_usage_ratio(), 0.5));
    assert_eq!(load.throughput_tps(), None);
    // The counters (written 1.0e3 and 2.5e3, with timestamps) feed the rate;
    // `_created` does not.
    let series = engine_series(&samples);
    assert_eq!(series[0].generation_tokens_total, Some(1_000.0));
    assert_eq!(series[1].generation_tokens_total, Some(2_500.0));
    let load = converter
        .convert(&samples, start + Duration::from_secs(1))
        .unwrap();
    assert_eq!(load.throughput_tps(), Some(0.0));
    insta::assert_json_snapshot!("v1_quirks", load);
}

#[test]
fn unsuffixed_counter_name_is_accepted() {
    let text = "vllm:num_requests_running 1\n\
                vllm:num_requests_waiting 0\n\
                vllm:kv_cache_usage_perc 0.1\n\
                vllm:generation_tokens 500\n";
    let series = engine_series(&parse_prometheus_text(text).unwrap());
    assert_eq!(series[0].generation_tokens_total, Some(500.0));
}

#[test]
fn no_vllm_engine_is_no_ranks() {
    let only_process = "# TYPE process_open_fds gauge\nprocess_open_fds 97\n";
    for text in ["", "\n", "# nothing here\n", only_process] {
        assert_eq!(
            VllmMetricsConverter::new()
                .convert_text(text, Instant::now())
                .unwrap_err(),
            VllmMetricsError::Invalid(LoadValidationError::NoRanks),
            "{text:?}"
        );
    }
}

#[test]
fn a_missing_load_gauge_is_named() {
    let cases = [
        (
            "vllm:num_requests_running{engine=\"0\"} 1\nvllm:kv_cache_usage_perc{engine=\"0\"} 0.1\n",
            "vllm:num_requests_waiting",
        ),
        (
            "vllm:num_requests_waiting{engine=\"0\"} 1\nvllm:kv_cache_usage_perc{engine=\"0\"} 0.1\n",
            "vllm:num_requests_running",
        ),
        (
            "vllm:num_requests_running{engine=\"0\"} 1\nvllm:num_requests_waiting{engine=\"0\"} 1\n",
            "vllm:kv_cache_usage_perc",
        ),
    ];
    for (text, family) in cases {
        assert_eq!(
            VllmMetricsConverter::new()
                .convert_text(text, Instant::now())
                .unwrap_err(),
            VllmMetricsError::MissingSeries {
                family,
                engine: "0".into()
            }
        );
    }
}

#[test]
fn hostile_values_give_the_exact_validation_error() {
    let scrape = |running: &str, waiting: &str, usage: &str| {
        format!(
            "vllm:num_requests_running{{engine=\"1\"}} {running}\n\
             vllm:num_requests_waiting{{engine=\"1\"}} {waiting}\n\
             vllm:kv_cache_usage_perc{{engine=\"1\"}} {usage}\n"
        )
    };
    let convert = |text: String| {
        VllmMetricsConverter::new()
            .convert_text(&text, Instant::now())
            .map_err(|err| match err {
                VllmMetricsError::Invalid(inner) => inner,
                other => panic!("not a validation error: {other:?}"),
            })
    };
    let err = convert(scrape("1", "1", "NaN")).unwrap_err();
    assert!(matches!(
        err,
        LoadValidationError::NonFinite { dp_rank: 1, field: "token_usage", value } if value.is_nan()
    ));
    assert_eq!(
        convert(scrape("1", "1", "+Inf")).unwrap_err(),
        LoadValidationError::NonFinite {
            dp_rank: 1,
            field: "token_usage",
            value: f64::INFINITY
        }
    );
    assert_eq!(
        convert(scrape("1", "1", "-0.25")).unwrap_err(),
        LoadValidationError::NegativeRatio {
            dp_rank: 1,
            field: "token_usage",
            value: -0.25
        }
    );
    assert_eq!(
        convert(scrape("1", "-Inf", "0.5")).unwrap_err(),
        LoadValidationError::NonFinite {
            dp_rank: 1,
            field: "num_waiting_reqs",
            value: f64::NEG_INFINITY
        }
    );
    assert!(matches!(
        convert(scrape("NaN", "1", "0.5")).unwrap_err(),
        LoadValidationError::NonFinite {
            field: "num_running_reqs",
            ..
        }
    ));
    assert_eq!(
        convert(scrape("1", "-3", "0.5")).unwrap_err(),
        LoadValidationError::NegativeCount {
            dp_rank: 1,
            field: "num_waiting_reqs",
            value: -3
        }
    );
    // Usage above 1 is clamped (documented by `WorkerLoad`).
    let load = convert(scrape("1", "1", "1.7")).unwrap();
    assert_eq!(load.kv_usage_ratio(), 1.0);
}

#[test]
fn broken_generation_counters_are_not_reported() {
    let start = Instant::now();
    let scrape = |generated: &str| {
        format!(
            "vllm:num_requests_running{{engine=\"0\"}} 1\n\
             vllm:num_requests_waiting{{engine=\"0\"}} 0\n\
             vllm:kv_cache_usage_perc{{engine=\"0\"}} 0.5\n\
             vllm:generation_tokens_total{{engine=\"0\"}} {generated}\n"
        )
    };
    let mut converter = VllmMetricsConverter::new();
    converter.convert_text(&scrape("100"), start).unwrap();
    for (step, broken) in ["NaN", "+Inf", "-5"].into_iter().enumerate() {
        let at = start + Duration::from_secs(step as u64 + 1);
        let load = converter.convert_text(&scrape(broken), at).unwrap();
        assert_eq!(load.throughput_tps(), None, "{broken}");
    }
}

#[test]
fn malformed_text_names_the_line() {
    let broken = V1_T0.replacen(
        "vllm:num_requests_waiting{model_name=\"meta-llama/Llama-3.1-8B-Instruct\",engine=\"0\"} 7.0",
        "vllm:num_requests_waiting{model_name=\"meta-llama/Llama-3.1-8B-Instruct\",engine=\"0\" 7.0",
        1,
    );
    let err = VllmMetricsConverter::new()
        .convert_text(&broken, Instant::now())
        .unwrap_err();
    let VllmMetricsError::Parse(err) = err else {
        panic!("{err:?}");
    };
    assert_eq!(err.line, 57);
    assert_eq!(
        err.reason,
        PrometheusParseReason::Expected {
            expected: '}',
            found: "'7'".into()
        }
    );
}
