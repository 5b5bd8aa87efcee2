//! OpenTelemetry through the router's public port: a client's
//! `traceparent` becomes the parent of the router's spans, which reach an
//! OTLP/gRPC collector running in the test, and the engine gets the
//! dispatch span's context; with tracing off, the client's own
//! `traceparent` reaches the engine untouched.

// Test helpers outside #[test] functions fail loudly on purpose.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use common::upstream::Upstream;
use common::{TestRouter, fast_config, start_router, wait_until, worker};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use router::config::{Layers, RouterConfig};
use serde_json::json;

/// One span as the collector received it.
#[derive(Debug, Clone)]
struct Received {
    service: String,
    name: String,
    trace_id: String,
    span_id: String,
    parent_span_id: String,
    attributes: HashMap<String, String>,
    events: Vec<String>,
    error: bool,
}

/// An OTLP/gRPC trace collector on a loopback port, keeping every span.
#[derive(Clone, Default)]
struct Collector {
    spans: Arc<Mutex<Vec<Received>>>,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.spans.lock().unwrap();
        for resource_spans in request.into_inner().resource_spans {
            let service = resource_spans
                .resource
                .iter()
                .flat_map(|resource| resource.attributes.iter())
                .find(|attribute| attribute.key == "service.name")
                .map(|attribute| text(attribute.value.as_ref()))
                .unwrap_or_default();
            for scope_spans in resource_spans.scope_spans {
                for span in scope_spans.spans {
                    spans.push(Received {
                        service: service.clone(),
                        name: span.name,
                        trace_id: hex(&span.trace_id),
                        span_id: hex(&span.span_id),
                        parent_span_id: hex(&span.parent_span_id),
                        attributes: span
                            .attributes
                            .iter()
                            .map(|kv| (kv.key.clone(), text(kv.value.as_ref())))
                            .collect(),
                        events: span.events.into_iter().map(|event| event.name).collect(),
                        // STATUS_CODE_ERROR
                        error: span.status.is_some_and(|status| status.code == 2),
                    });
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

impl Collector {
    /// Serves on a fresh loopback port; the collector and its endpoint.
    async fn start() -> (Collector, String) {
        let collector = Collector::default();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let service = TraceServiceServer::new(collector.clone());
        tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
                .await
                .unwrap();
        });
        (collector, endpoint)
    }

    fn trace(&self, trace_id: &str) -> Vec<Received> {
        self.spans
            .lock()
            .unwrap()
            .iter()
            .filter(|span| span.trace_id == trace_id)
            .cloned()
            .collect()
    }
}

fn text(value: Option<&opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    match value.and_then(|value| value.value.as_ref()) {
        Some(AnyValue::StringValue(text)) => text.clone(),
        Some(AnyValue::IntValue(number)) => number.to_string(),
        Some(AnyValue::DoubleValue(number)) => number.to_string(),
        Some(AnyValue::BoolValue(flag)) => flag.to_string(),
        other => format!("{other:?}"),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

const CLIENT_TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN_ID: &str = "00f067aa0ba902b7";

fn client_traceparent(trace_id: &str, sampled: bool) -> String {
    let flags = if sampled { "01" } else { "00" };
    format!("00-{trace_id}-{CLIENT_SPAN_ID}-{flags}")
}

async fn traced_router(workers: &[&Upstream], endpoint: &str, policy_toml: &str) -> TestRouter {
    let router = start_router(fast_config(
        workers.iter().map(|w| worker("sglang", &w.url)).collect(),
        &format!(
            "[tracing]\nenabled = true\notlp_endpoint = \"{endpoint}\"\n\
             service_name = \"router-under-test\"\nexport_interval_ms = 50\n{policy_toml}"
        ),
    ))
    .await;
    let expected = workers.len();
    wait_until("the workers are healthy", || async {
        router.healthy_count().await == expected
    })
    .await;
    router
}

async fn chat(router: &TestRouter, traceparent: &str, stream: bool) -> String {
    let response = router
        .client
        .post(format!("{}/v1/chat/completions", router.base))
        .header("traceparent", traceparent)
        .json(&json!({
            "model": "test-model",
            "messages": [{"role": "user", "content": "hello there"}],
            "stream": stream,
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    response.text().await.unwrap()
}

/// Every trace of `traces` once each one's `receive` span has arrived.
async fn receive_spans(collector: &Collector, traces: &[&str]) -> Vec<Vec<Received>> {
    wait_until("every request's receive span arrives", || async {
        traces.iter().all(|trace| {
            collector
                .trace(trace)
                .iter()
                .any(|span| span.name == "receive")
        })
    })
    .await;
    traces.iter().map(|trace| collector.trace(trace)).collect()
}

fn one<'a>(spans: &'a [Received], name: &str) -> &'a Received {
    let named: Vec<&Received> = spans.iter().filter(|span| span.name == name).collect();
    assert_eq!(named.len(), 1, "one {name} span in {spans:#?}");
    named[0]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_traced_request_is_one_trace_from_the_clients_parent_to_the_engine() {
    let (collector, endpoint) = Collector::start().await;
    let upstream = Upstream::start().await;
    let router = traced_router(&[&upstream], &endpoint, "").await;

    let answer = chat(&router, &client_traceparent(CLIENT_TRACE_ID, true), true).await;
    assert!(answer.contains("data: [DONE]"), "{answer}");

    // The receive span ends with the stream's last byte, and goes out in
    // the exporter's next batch.
    wait_until("the request's spans reach the collector", || async {
        let spans = collector.trace(CLIENT_TRACE_ID);
        ["receive", "admission", "selection", "dispatch"]
            .iter()
            .all(|name| spans.iter().any(|span| span.name == *name))
    })
    .await;
    let spans = collector.trace(CLIENT_TRACE_ID);
    let receive = one(&spans, "receive");
    assert_eq!(receive.service, "router-under-test");
    assert_eq!(
        receive.parent_span_id, CLIENT_SPAN_ID,
        "the client's span is the parent"
    );
    assert_eq!(receive.attributes["url.path"], "/v1/chat/completions");
    assert_eq!(receive.attributes["llm_router.streaming"], "true");
    assert_eq!(receive.attributes["http.response.status_code"], "200");
    for name in ["admission", "selection", "dispatch"] {
        assert_eq!(
            one(&spans, name).parent_span_id,
            receive.span_id,
            "{name} is a child of receive"
        );
    }
    let selection = one(&spans, "selection");
    assert_eq!(selection.attributes["llm_router.worker.url"], upstream.url);
    assert_eq!(selection.attributes["llm_router.policy"], "least_load");
    assert!(
        selection.attributes["llm_router.score"]
            .parse::<f64>()
            .unwrap()
            .is_finite()
    );
    let dispatch = one(&spans, "dispatch");
    assert_eq!(dispatch.attributes["server.address"], upstream.url);
    assert_eq!(dispatch.attributes["http.response.status_code"], "200");
    assert!(
        dispatch.events.contains(&"first_token".to_owned()),
        "{dispatch:?}"
    );

    // The engine's parent is the router's dispatch span.
    let sent = upstream.switches.traceparents.lock().unwrap().clone();
    assert_eq!(
        sent,
        vec![Some(format!(
            "00-{CLIENT_TRACE_ID}-{}-01",
            dispatch.span_id
        ))]
    );

    // A non-streaming request: its own trace, complete as well.
    let whole_trace = "0af7651916cd43dd8448eb211c80319c";
    chat(&router, &client_traceparent(whole_trace, true), false).await;
    wait_until("the second request's dispatch span arrives", || async {
        collector
            .trace(whole_trace)
            .iter()
            .any(|span| span.name == "dispatch")
    })
    .await;
    let spans = collector.trace(whole_trace);
    assert_eq!(
        one(&spans, "receive").attributes["llm_router.streaming"],
        "false"
    );
    assert!(
        one(&spans, "dispatch")
            .events
            .contains(&"first_token".to_owned())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_is_a_second_dispatch_and_the_failure_that_ejects_is_marked() {
    let (collector, endpoint) = Collector::start().await;
    let failing = Upstream::start().await;
    failing.switches.fail_status.store(503, Ordering::SeqCst);
    let healthy = Upstream::start().await;
    let router = traced_router(
        &[&failing, &healthy],
        &endpoint,
        "[policy]\nkind = \"round_robin\"\n[outlier_detection]\nconsecutive_failures = 1\n",
    )
    .await;

    // Round robin sends one of the first two requests to the failing
    // worker first; it is ejected at its first failure.
    let traces = [
        "11111111111111111111111111111111",
        "22222222222222222222222222222222",
    ];
    for trace in traces {
        chat(&router, &client_traceparent(trace, true), false).await;
    }
    let traced = receive_spans(&collector, &traces).await;
    let retried: Vec<Vec<Received>> = traced
        .into_iter()
        .filter(|spans| spans.iter().filter(|span| span.name == "dispatch").count() == 2)
        .collect();
    assert_eq!(
        retried.len(),
        1,
        "exactly one request met the failing worker"
    );
    let spans = &retried[0];
    let receive = one(spans, "receive");
    assert!(receive.events.contains(&"retry".to_owned()), "{receive:?}");
    assert_eq!(receive.attributes["http.response.status_code"], "200");
    let mut dispatches: Vec<&Received> = spans
        .iter()
        .filter(|span| span.name == "dispatch")
        .collect();
    dispatches.sort_by_key(|span| span.attributes["llm_router.attempt"].clone());
    assert_eq!(dispatches[0].attributes["server.address"], failing.url);
    assert!(dispatches[0].error);
    assert!(
        dispatches[0].events.contains(&"worker_ejected".to_owned()),
        "{:?}",
        dispatches[0]
    );
    assert_eq!(dispatches[1].attributes["server.address"], healthy.url);
    assert!(!dispatches[1].error);
    assert_eq!(
        spans.iter().filter(|span| span.name == "selection").count(),
        2
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hedge_is_an_event_and_a_second_selection() {
    let (collector, endpoint) = Collector::start().await;
    let held = Upstream::start().await;
    held.switches.hold.store(true, Ordering::SeqCst);
    let healthy = Upstream::start().await;
    let router = traced_router(
        &[&held, &healthy],
        &endpoint,
        "[policy]\nkind = \"round_robin\"\n[hedging]\nafter_ms = 50\n",
    )
    .await;

    // Round robin starts a request on the held worker, which sends no
    // head: that one is hedged.
    let traces = [
        "44444444444444444444444444444444",
        "55555555555555555555555555555555",
    ];
    for trace in traces {
        chat(&router, &client_traceparent(trace, true), true).await;
    }
    let traced = receive_spans(&collector, &traces).await;
    let hedged: Vec<Vec<Received>> = traced
        .into_iter()
        .filter(|spans| one(spans, "receive").events.contains(&"hedge".to_owned()))
        .collect();
    assert!(!hedged.is_empty(), "a request met the held worker");
    for spans in &hedged {
        assert_eq!(
            spans.iter().filter(|span| span.name == "selection").count(),
            2
        );
        let answered = spans
            .iter()
            .find(|span| span.name == "dispatch" && !span.error)
            .expect("the hedge's dispatch span");
        assert_eq!(answered.attributes["server.address"], healthy.url);
    }
    held.switches.hold.store(false, Ordering::SeqCst);
    held.switches.release.notify_waiters();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migrated_answers_continuation_is_spans_of_the_same_request() {
    let (collector, endpoint) = Collector::start().await;
    let engines = mock_engines::start(
        (0..2)
            .map(|_| {
                let mut config = mock_engines::SimEngineConfig::new(mock_engines::Flavour::Sglang);
                config.time_scale = 50.0;
                config
            })
            .collect(),
    )
    .await
    .unwrap();
    let router = start_router(fast_config(
        engines
            .engines()
            .iter()
            .map(|engine| worker("sglang", &engine.http_url()))
            .collect(),
        &format!(
            "[tracing]\nenabled = true\notlp_endpoint = \"{endpoint}\"\nexport_interval_ms = 50\n\
             [policy]\nkind = \"round_robin\"\n"
        ),
    ))
    .await;
    wait_until("the engines are healthy", || async {
        router.healthy_count().await == 2
    })
    .await;
    engines.set_fault(0, mock_engines::FaultMode::CloseMidStream);

    // Round robin starts a request on the engine that cuts streams.
    let traces = [
        "66666666666666666666666666666666",
        "77777777777777777777777777777777",
    ];
    for trace in traces {
        let answer = chat(&router, &client_traceparent(trace, true), true).await;
        assert!(answer.ends_with("data: [DONE]\n\n"), "{answer}");
    }
    let traced = receive_spans(&collector, &traces).await;
    let migrated: Vec<Vec<Received>> = traced
        .into_iter()
        .filter(|spans| {
            one(spans, "receive")
                .events
                .contains(&"migration".to_owned())
        })
        .collect();
    assert!(!migrated.is_empty(), "a request met the cutting engine");
    let cut = engines.engines()[0].http_url();
    for spans in &migrated {
        let receive = one(spans, "receive");
        let dispatches: Vec<&Received> = spans
            .iter()
            .filter(|span| span.name == "dispatch")
            .collect();
        assert_eq!(dispatches.len(), 2, "{spans:?}");
        assert!(
            dispatches
                .iter()
                .all(|span| span.parent_span_id == receive.span_id)
        );
        let broken = dispatches
            .iter()
            .find(|span| span.attributes["server.address"] == cut)
            .expect("the broken attempt");
        assert!(broken.error);
        let continued = dispatches
            .iter()
            .find(|span| span.attributes["server.address"] != cut)
            .expect("the continuation");
        assert!(!continued.error);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsampled_parent_is_not_traced_and_its_traceparent_goes_on() {
    let (collector, endpoint) = Collector::start().await;
    let upstream = Upstream::start().await;
    let router = traced_router(&[&upstream], &endpoint, "").await;
    let unsampled = client_traceparent("33333333333333333333333333333333", false);
    chat(&router, &unsampled, false).await;
    // A sampled request after it: once its spans are in, any of the
    // unsampled one's would be too (same exporter, earlier).
    let sampled_trace = "44444444444444444444444444444444";
    chat(&router, &client_traceparent(sampled_trace, true), false).await;
    wait_until("the sampled request's spans arrive", || async {
        collector
            .trace(sampled_trace)
            .iter()
            .any(|span| span.name == "receive")
    })
    .await;
    assert!(
        collector
            .trace("33333333333333333333333333333333")
            .is_empty()
    );
    let sent = upstream.switches.traceparents.lock().unwrap().clone();
    assert_eq!(sent[0].as_deref(), Some(unsampled.as_str()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_tracing_off_the_clients_traceparent_reaches_the_engine_untouched() {
    let upstream = Upstream::start().await;
    let router = start_router(fast_config(vec![worker("sglang", &upstream.url)], "")).await;
    wait_until("the worker is healthy", || async {
        router.healthy_count().await == 1
    })
    .await;
    let traceparent = client_traceparent(CLIENT_TRACE_ID, true);
    chat(&router, &traceparent, true).await;
    chat(&router, &traceparent, false).await;
    let sent = upstream.switches.traceparents.lock().unwrap().clone();
    assert_eq!(sent, vec![Some(traceparent.clone()), Some(traceparent)]);
}

#[test]
fn an_invalid_tracing_section_is_refused_by_key() {
    for (key, value, names) in [
        (
            "tracing.otlp_endpoint",
            "grpc://collector:4317",
            "tracing.otlp_endpoint",
        ),
        ("tracing.sample_ratio", "1.5", "tracing.sample_ratio"),
        (
            "tracing.export_interval_ms",
            "0",
            "tracing.export_interval_ms",
        ),
        ("tracing.service_name", " ", "tracing.service_name"),
    ] {
        let value: router::config::Value = if let Ok(whole) = value.parse::<i64>() {
            whole.into()
        } else if let Ok(number) = value.parse::<f64>() {
            number.into()
        } else {
            value.into()
        };
        let error = RouterConfig::load(Layers {
            overrides: vec![(key.to_owned(), value)],
            ..Layers::default()
        })
        .unwrap_err();
        assert!(error.to_string().contains(names), "{key}: {error}");
    }
}
