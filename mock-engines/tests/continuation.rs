//! Deterministic generation and continuation inputs, as a router migrating
//! a broken stream uses them: an answer is a function of its context, so a
//! request carrying the first k tokens of an answer (a chat's final
//! assistant message with `continue_final_message`, a longer completion
//! prompt, `input_ids` followed by the first k `output_ids`) sent to another
//! engine generates exactly the rest of the unbroken answer.

// Test helpers (not only #[test] fns) may unwrap: a panic is a failed assertion.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use futures::StreamExt;
use mock_engines::{Flavour, SimEngineConfig, SimFleet};
use serde_json::{Value, json};

mod common;

use common::DEADLINE;

/// Tokens of every unbroken answer.
const ANSWER_TOKENS: usize = 12;
/// Where the continuations cut the unbroken answer (tokens already sent).
const CUTS: [usize; 4] = [1, 2, 6, 11];

fn config(flavour: Flavour) -> SimEngineConfig {
    SimEngineConfig {
        time_scale: 200.0,
        ..SimEngineConfig::new(flavour)
    }
}

/// A vLLM and an SGLang engine: the unbroken answers come from the first,
/// the continuations from the second, as after a migration.
async fn two_engines() -> (SimFleet, String, String) {
    let fleet = mock_engines::start(vec![config(Flavour::Vllm), config(Flavour::Sglang)])
        .await
        .unwrap();
    let first = fleet.engines()[0].http_url();
    let second = fleet.engines()[1].http_url();
    (fleet, first, second)
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(DEADLINE)
        .build()
        .unwrap()
}

/// What an answer carried, whole or streamed.
#[derive(Debug, Clone, PartialEq)]
struct Answer {
    text: String,
    /// `/generate` only.
    output_ids: Vec<u64>,
    finish_reason: String,
    prompt_tokens: u64,
    completion_tokens: u64,
}

/// Reads a whole SSE body into its `data:` payloads, `[DONE]` left out.
async fn sse_payloads(response: reqwest::Response) -> Vec<Value> {
    assert_eq!(response.status(), 200);
    let mut body = String::new();
    let mut stream = response.bytes_stream();
    while let Some(chunk) = stream.next().await {
        body.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
    }
    assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
    body.split("\n\n")
        .filter(|event| !event.is_empty() && *event != "data: [DONE]")
        .map(|event| serde_json::from_str(event.strip_prefix("data: ").unwrap()).unwrap())
        .collect()
}

/// Posts `body` to `path` and reads the answer, whole or streamed as the
/// body asks (a streamed chat or completion asks for its usage chunk).
async fn generate(url: &str, path: &str, body: &Value) -> Answer {
    let stream = body["stream"].as_bool().unwrap_or(false);
    let mut body = body.clone();
    if stream && path != "/generate" {
        body["stream_options"] = json!({"include_usage": true});
    }
    let response = client()
        .post(format!("{url}{path}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    if !stream {
        assert_eq!(response.status(), 200);
        let whole: Value = response.json().await.unwrap();
        return whole_answer(path, &whole);
    }
    let payloads = sse_payloads(response).await;
    match path {
        "/generate" => streamed_generate_answer(&payloads),
        _ => streamed_openai_answer(path, &payloads),
    }
}

fn whole_answer(path: &str, whole: &Value) -> Answer {
    match path {
        "/generate" => Answer {
            text: whole["text"].as_str().unwrap().to_owned(),
            output_ids: ids(&whole["output_ids"]),
            finish_reason: whole["meta_info"]["finish_reason"]["type"]
                .as_str()
                .unwrap()
                .to_owned(),
            prompt_tokens: whole["meta_info"]["prompt_tokens"].as_u64().unwrap(),
            completion_tokens: whole["meta_info"]["completion_tokens"].as_u64().unwrap(),
        },
        _ => {
            let choice = &whole["choices"][0];
            let text = match path {
                "/v1/chat/completions" => {
                    assert_eq!(choice["message"]["role"], "assistant");
                    &choice["message"]["content"]
                }
                _ => &choice["text"],
            };
            Answer {
                text: text.as_str().unwrap().to_owned(),
                output_ids: Vec::new(),
                finish_reason: choice["finish_reason"].as_str().unwrap().to_owned(),
                prompt_tokens: whole["usage"]["prompt_tokens"].as_u64().unwrap(),
                completion_tokens: whole["usage"]["completion_tokens"].as_u64().unwrap(),
            }
        }
    }
}

/// A streamed chat or completion: the text is the chunks' pieces joined;
/// the first chat chunk carries the assistant role; the usage chunk ends it.
fn streamed_openai_answer(path: &str, payloads: &[Value]) -> Answer {
    let (usage_chunk, chunks) = payloads.split_last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]), "{usage_chunk}");
    let mut text = String::new();
    let mut finish_reason = None;
    for (index, chunk) in chunks.iter().enumerate() {
        let choice = &chunk["choices"][0];
        let piece = match path {
            "/v1/chat/completions" => {
                let role = &choice["delta"]["role"];
                if index == 0 {
                    assert_eq!(*role, "assistant", "{chunk}");
                } else {
                    assert!(role.is_null(), "{chunk}");
                }
                &choice["delta"]["content"]
            }
            _ => &choice["text"],
        };
        text.push_str(piece.as_str().unwrap_or_default());
        if let Some(reason) = choice["finish_reason"].as_str() {
            assert_eq!(index, chunks.len() - 1, "a finish reason before the end");
            finish_reason = Some(reason.to_owned());
        }
    }
    Answer {
        text,
        output_ids: Vec::new(),
        finish_reason: finish_reason.unwrap(),
        prompt_tokens: usage_chunk["usage"]["prompt_tokens"].as_u64().unwrap(),
        completion_tokens: usage_chunk["usage"]["completion_tokens"].as_u64().unwrap(),
    }
}

/// A streamed `/generate`: every chunk carries the text and `output_ids`
/// so far (each extending the one before, one id per completion token);
/// the last one is the answer.
fn streamed_generate_answer(payloads: &[Value]) -> Answer {
    let mut previous_text = "";
    let mut previous_ids = Vec::new();
    for chunk in payloads {
        let text = chunk["text"].as_str().unwrap();
        let output_ids = ids(&chunk["output_ids"]);
        assert!(text.starts_with(previous_text), "{chunk}");
        assert!(output_ids.starts_with(&previous_ids), "{chunk}");
        assert_eq!(
            output_ids.len() as u64,
            chunk["meta_info"]["completion_tokens"].as_u64().unwrap(),
            "{chunk}"
        );
        assert_eq!(words(text).len(), output_ids.len(), "{chunk}");
        previous_text = text;
        previous_ids = output_ids;
    }
    whole_answer("/generate", payloads.last().unwrap())
}

fn ids(value: &Value) -> Vec<u64> {
    value
        .as_array()
        .unwrap_or_else(|| panic!("not an id array: {value}"))
        .iter()
        .map(|id| id.as_u64().unwrap())
        .collect()
}

/// Splits a generated text into its tokens: words with their leading space.
fn words(text: &str) -> Vec<String> {
    assert!(text.is_empty() || text.starts_with(' '), "{text:?}");
    text.split(' ')
        .skip(1)
        .map(|word| format!(" {word}"))
        .collect()
}

/// The prompt-token count of a text prompt: one token per four characters.
fn text_prompt_tokens(text: &str) -> u64 {
    (text.chars().count() as u64).div_ceil(4)
}

/// The unbroken answer, checked for its length and its split into words.
async fn unbroken(url: &str, path: &str, body: &Value) -> (Answer, Vec<String>) {
    let answer = generate(url, path, body).await;
    let words = words(&answer.text);
    assert_eq!(words.len(), ANSWER_TOKENS, "{answer:?}");
    assert_eq!(words.concat(), answer.text);
    assert_eq!(answer.completion_tokens, ANSWER_TOKENS as u64);
    assert_eq!(answer.finish_reason, "length");
    (answer, words)
}

fn chat_request(question: &str, stream: bool) -> Value {
    json!({
        "model": "sim-model",
        "stream": stream,
        "max_tokens": ANSWER_TOKENS,
        "messages": [
            {"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": question},
        ],
    })
}

/// `request` continuing its answer after `sent_text`, `remaining` tokens long.
fn chat_continuation(request: &Value, sent_text: &str, remaining: usize) -> Value {
    let mut continuation = request.clone();
    continuation["messages"]
        .as_array_mut()
        .unwrap()
        .push(json!({"role": "assistant", "content": sent_text}));
    continuation["continue_final_message"] = json!(true);
    continuation["add_generation_prompt"] = json!(false);
    continuation["max_tokens"] = json!(remaining);
    continuation
}

#[tokio::test]
async fn a_continued_chat_message_generates_the_rest_of_the_unbroken_answer() {
    let (fleet, first, second) = two_engines().await;
    let question = "What does the router do when a stream breaks?";
    let prompt_chars = "You answer briefly.".len() + question.len();
    let mut answers_by_mode = Vec::new();
    for stream in [false, true] {
        let request = chat_request(question, stream);
        let (answer, words) = unbroken(&first, "/v1/chat/completions", &request).await;
        assert_eq!(answer.prompt_tokens, (prompt_chars as u64).div_ceil(4));
        for sent in CUTS {
            let sent_text = words[..sent].concat();
            let remaining = ANSWER_TOKENS - sent;
            let continuation = chat_continuation(&request, &sent_text, remaining);
            let rest = generate(&second, "/v1/chat/completions", &continuation).await;
            assert_eq!(
                rest.text,
                words[sent..].concat(),
                "stream {stream}, {sent} sent"
            );
            assert_eq!(rest.finish_reason, "length");
            assert_eq!(rest.completion_tokens, remaining as u64);
            // The continued message is part of the prompt.
            assert_eq!(
                rest.prompt_tokens,
                ((prompt_chars + sent_text.len()) as u64).div_ceil(4)
            );
        }
        answers_by_mode.push(answer);
    }
    // Whole and streamed answers to the same request agree.
    assert_eq!(answers_by_mode[0], answers_by_mode[1]);
    fleet.shutdown().await;
}

#[tokio::test]
async fn a_longer_completion_prompt_generates_the_rest_of_the_unbroken_answer() {
    let (fleet, first, second) = two_engines().await;
    let prompt = "Once upon a time, a router met an engine.";
    let mut answers_by_mode = Vec::new();
    for stream in [false, true] {
        let request = json!({"prompt": prompt, "max_tokens": ANSWER_TOKENS, "stream": stream});
        let (answer, words) = unbroken(&first, "/v1/completions", &request).await;
        assert_eq!(answer.prompt_tokens, text_prompt_tokens(prompt));
        for sent in CUTS {
            let longer_prompt = format!("{prompt}{}", words[..sent].concat());
            let remaining = ANSWER_TOKENS - sent;
            let continuation =
                json!({"prompt": longer_prompt, "max_tokens": remaining, "stream": stream});
            let rest = generate(&second, "/v1/completions", &continuation).await;
            assert_eq!(
                rest.text,
                words[sent..].concat(),
                "stream {stream}, {sent} sent"
            );
            assert_eq!(rest.finish_reason, "length");
            assert_eq!(rest.completion_tokens, remaining as u64);
            assert_eq!(rest.prompt_tokens, text_prompt_tokens(&longer_prompt));
        }
        answers_by_mode.push(answer);
    }
    assert_eq!(answers_by_mode[0], answers_by_mode[1]);
    fleet.shutdown().await;
}

#[tokio::test]
async fn longer_input_ids_generate_the_rest_of_the_unbroken_output_ids() {
    let fleet = mock_engines::start_many(&config(Flavour::Sglang), 2)
        .await
        .unwrap();
    let first = fleet.engines()[0].http_url();
    let second = fleet.engines()[1].http_url();
    let input_ids: Vec<u64> = (1..=40).map(|i| i * 7).collect();
    let mut answers_by_mode = Vec::new();
    for stream in [false, true] {
        let request = json!({
            "input_ids": input_ids,
            "sampling_params": {"max_new_tokens": ANSWER_TOKENS},
            "stream": stream,
        });
        let (answer, words) = unbroken(&first, "/generate", &request).await;
        assert_eq!(answer.output_ids.len(), ANSWER_TOKENS);
        assert_eq!(answer.prompt_tokens, input_ids.len() as u64);
        for sent in CUTS {
            let longer_ids: Vec<u64> = input_ids
                .iter()
                .chain(&answer.output_ids[..sent])
                .copied()
                .collect();
            let remaining = ANSWER_TOKENS - sent;
            let continuation = json!({
                "input_ids": longer_ids,
                "sampling_params": {"max_new_tokens": remaining},
                "stream": stream,
            });
            let rest = generate(&second, "/generate", &continuation).await;
            assert_eq!(rest.output_ids, answer.output_ids[sent..], "{sent} sent");
            assert_eq!(rest.text, words[sent..].concat(), "{sent} sent");
            assert_eq!(rest.finish_reason, "length");
            assert_eq!(rest.completion_tokens, remaining as u64);
            assert_eq!(rest.prompt_tokens, longer_ids.len() as u64);
        }
        answers_by_mode.push(answer);
    }
    assert_eq!(answers_by_mode[0], answers_by_mode[1]);
    fleet.shutdown().await;
}

#[tokio::test]
async fn a_longer_generate_text_generates_the_rest_of_the_unbroken_answer() {
    let fleet = mock_engines::start_many(&config(Flavour::Sglang), 2)
        .await
        .unwrap();
    let first = fleet.engines()[0].http_url();
    let second = fleet.engines()[1].http_url();
    let text = "The quick brown fox";
    let request = json!({"text": text, "sampling_params": {"max_new_tokens": ANSWER_TOKENS}});
    let (answer, words) = unbroken(&first, "/generate", &request).await;
    assert_eq!(answer.output_ids.len(), ANSWER_TOKENS);
    for sent in CUTS {
        let remaining = ANSWER_TOKENS - sent;
        let continuation = json!({
            "text": format!("{text}{}", words[..sent].concat()),
            "sampling_params": {"max_new_tokens": remaining},
        });
        let rest = generate(&second, "/generate", &continuation).await;
        assert_eq!(rest.text, words[sent..].concat(), "{sent} sent");
        assert_eq!(rest.output_ids, answer.output_ids[sent..], "{sent} sent");
    }
    fleet.shutdown().await;
}

#[tokio::test]
async fn different_contexts_generate_different_answers() {
    let (fleet, url, _) = two_engines().await;
    let pairs = [
        (
            "/v1/chat/completions",
            chat_request("Why is the sky blue?", false),
            chat_request("Why is the sea blue?", false),
        ),
        (
            "/v1/completions",
            json!({"prompt": "Once upon a time", "max_tokens": ANSWER_TOKENS}),
            json!({"prompt": "Once upon a rhyme", "max_tokens": ANSWER_TOKENS}),
        ),
    ];
    for (path, one, other) in pairs {
        let (one, _) = unbroken(&url, path, &one).await;
        let (other, _) = unbroken(&url, path, &other).await;
        assert_ne!(one.text, other.text, "{path}");
    }
    fleet.shutdown().await;

    let fleet = mock_engines::start(vec![config(Flavour::Sglang)])
        .await
        .unwrap();
    let url = fleet.engines()[0].http_url();
    let max_new_tokens = json!({"max_new_tokens": ANSWER_TOKENS});
    let pairs = [
        (
            json!({"input_ids": [1, 2, 3, 4], "sampling_params": max_new_tokens}),
            json!({"input_ids": [1, 2, 3, 5], "sampling_params": max_new_tokens}),
        ),
        (
            json!({"text": "Once upon a time", "sampling_params": max_new_tokens}),
            json!({"text": "Once upon a rhyme", "sampling_params": max_new_tokens}),
        ),
    ];
    for (one, other) in pairs {
        let (one, _) = unbroken(&url, "/generate", &one).await;
        let (other, _) = unbroken(&url, "/generate", &other).await;
        assert_ne!(one.text, other.text);
        assert_ne!(one.output_ids, other.output_ids);
    }
    fleet.shutdown().await;
}

#[tokio::test]
async fn a_new_turn_after_an_assistant_message_is_not_a_continuation_of_it() {
    let (fleet, url, _) = two_engines().await;
    let request = chat_request("Name three colours.", false);
    let (_, words) = unbroken(&url, "/v1/chat/completions", &request).await;
    let sent_text = words[..4].concat();
    let continuation = chat_continuation(&request, &sent_text, ANSWER_TOKENS - 4);
    let mut new_turn = continuation.clone();
    let new_turn_fields = new_turn.as_object_mut().unwrap();
    new_turn_fields.remove("continue_final_message");
    new_turn_fields.remove("add_generation_prompt");
    let continued = generate(&url, "/v1/chat/completions", &continuation).await;
    let answered_anew = generate(&url, "/v1/chat/completions", &new_turn).await;
    assert_eq!(continued.text, words[4..].concat());
    assert_ne!(answered_anew.text, continued.text);
    fleet.shutdown().await;
}

#[tokio::test]
async fn continue_final_message_refuses_what_vllm_refuses() {
    let (fleet, url, _) = two_engines().await;
    let client = client();
    let question = json!({"role": "user", "content": "hi"});
    let partial_answer = json!({"role": "assistant", "content": " the"});
    let refused = [
        // With add_generation_prompt true, said or by default.
        json!({"messages": [question, partial_answer], "continue_final_message": true,
               "add_generation_prompt": true}),
        json!({"messages": [question, partial_answer], "continue_final_message": true}),
        // Without a final assistant message to continue.
        json!({"messages": [question], "continue_final_message": true,
               "add_generation_prompt": false}),
        json!({"messages": [], "continue_final_message": true, "add_generation_prompt": false}),
    ];
    for body in refused {
        for stream in [false, true] {
            let mut body = body.clone();
            body["stream"] = json!(stream);
            let response = client
                .post(format!("{url}/v1/chat/completions"))
                .json(&body)
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 400, "{body}");
            let error: Value = response.json().await.unwrap();
            let message = error["error"]["message"].as_str().unwrap();
            assert!(message.contains("continue_final_message"), "{error}");
        }
    }
    // The same continuation, asked for properly, is answered.
    let accepted = json!({"messages": [question, partial_answer], "continue_final_message": true,
                          "add_generation_prompt": false, "max_tokens": 3});
    let answer = generate(&url, "/v1/chat/completions", &accepted).await;
    assert_eq!(words(&answer.text).len(), 3);
    fleet.shutdown().await;
}

#[tokio::test]
async fn an_unbounded_answer_runs_to_the_default_length_and_stops_alike_whole_or_streamed() {
    let (fleet, url, _) = two_engines().await;
    let default_output_tokens = SimEngineConfig::new(Flavour::Vllm).default_output_tokens;
    let requests = [
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Tell me more."}]}),
        ),
        ("/v1/completions", json!({"prompt": "Tell me more."})),
        ("/generate", json!({"text": "Tell me more."})),
        ("/generate", json!({"input_ids": [5, 6, 7]})),
    ];
    for (path, request) in requests {
        let whole = generate(&url, path, &request).await;
        assert_eq!(whole.finish_reason, "stop", "{path}");
        assert_eq!(
            whole.completion_tokens,
            u64::from(default_output_tokens),
            "{path}"
        );
        assert_eq!(
            words(&whole.text).len(),
            default_output_tokens as usize,
            "{path}"
        );
        let mut streaming = request.clone();
        streaming["stream"] = json!(true);
        let streamed = generate(&url, path, &streaming).await;
        assert_eq!(streamed, whole, "{path}");
    }
    fleet.shutdown().await;
}
