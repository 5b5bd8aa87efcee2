//! Round trips and properties across the migration pieces: a stream is
//! recorded, broken, continued and spliced, and the client's stream must
//! read as the unbroken one.

use bytes::Bytes;
use proptest::prelude::*;
use serde_json::{Value, json};

use super::*;

/// The tokens of the fixtures' answers, one per chunk.
const WORDS: [&str; 6] = ["Hello", " there", ",", " dear", " friend", "!"];
/// `/generate`'s answer: eight tokens and their ids.
const STORY: [&str; 8] = [
    " there", " was", " a", " small", " red", " fox", " in", " Kent",
];
const STORY_IDS: [u64; 8] = [101, 102, 103, 104, 105, 106, 107, 108];

fn event(value: &Value) -> Bytes {
    Bytes::from(format!("data: {value}\n\n"))
}

fn done() -> Bytes {
    Bytes::from_static(b"data: [DONE]\n\n")
}

fn concat(events: &[Bytes]) -> Vec<u8> {
    events
        .iter()
        .flat_map(|event| event.iter().copied())
        .collect()
}

/// What differs between one engine's stream and another's.
#[derive(Debug, Clone, Copy)]
struct Head {
    id: &'static str,
    created: u64,
    fingerprint: Option<&'static str>,
    prompt_tokens: u64,
    cached_tokens: u64,
}

const FIRST: Head = Head {
    id: "chatcmpl-a1",
    created: 1_700_000_000,
    fingerprint: None,
    prompt_tokens: 20,
    cached_tokens: 16,
};

impl Head {
    /// The continuing worker's head: another id and time, a longer prompt.
    fn continuing(self, tokens_sent: u64) -> Head {
        Head {
            id: "chatcmpl-b2",
            created: 1_700_000_042,
            fingerprint: self.fingerprint.map(|_| "fp_other"),
            prompt_tokens: self.prompt_tokens + tokens_sent,
            cached_tokens: self.cached_tokens,
        }
    }

    fn chunk(&self, object: &str, choices: Value, usage: Option<Value>) -> Bytes {
        let mut chunk = json!({
            "id": self.id, "object": object, "created": self.created, "model": "qwen",
        });
        if let Some(fingerprint) = self.fingerprint {
            chunk["system_fingerprint"] = json!(fingerprint);
        }
        chunk["choices"] = choices;
        if let Some(usage) = usage {
            chunk["usage"] = usage;
        }
        event(&chunk)
    }

    fn usage(&self, completion_tokens: usize) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens as u64,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }
}

/// A vLLM chat stream: the role-only chunk, a chunk per token, the finish
/// chunk, the usage chunk, `[DONE]`.
fn chat_stream(head: &Head, tokens: &[&str], finish: &str) -> Vec<Bytes> {
    let object = "chat.completion.chunk";
    let mut events = vec![head.chunk(
        object,
        json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]),
        None,
    )];
    for token in tokens {
        events.push(head.chunk(
            object,
            json!([{"index": 0, "delta": {"content": token}, "logprobs": null, "finish_reason": null}]),
            None,
        ));
    }
    events.push(head.chunk(
        object,
        json!([{"index": 0, "delta": {"content": ""}, "logprobs": null, "finish_reason": finish, "stop_reason": null}]),
        None,
    ));
    events.push(head.chunk(object, json!([]), Some(head.usage(tokens.len()))));
    events.push(done());
    events
}

/// A vLLM completions stream: a chunk per token, the last one carrying
/// the finish reason, the usage chunk, `[DONE]`.
fn completions_stream(head: &Head, tokens: &[&str]) -> Vec<Bytes> {
    let object = "text_completion";
    let mut events: Vec<Bytes> = tokens
        .iter()
        .enumerate()
        .map(|(at, token)| {
            let finish = if at + 1 == tokens.len() {
                json!("length")
            } else {
                Value::Null
            };
            head.chunk(
                object,
                json!([{"index": 0, "text": token, "logprobs": null, "finish_reason": finish, "stop_reason": null}]),
                None,
            )
        })
        .collect();
    events.push(head.chunk(object, json!([]), Some(head.usage(tokens.len()))));
    events.push(done());
    events
}

/// An SGLang `/generate` stream: an event per token with the cumulative
/// text and ids, the last one finished by length, `[DONE]`.
fn generate_stream(id: &str, prompt_tokens: u64, tokens: &[&str], ids: &[u64]) -> Vec<Bytes> {
    let mut events = Vec::new();
    for count in 1..=tokens.len() {
        let finish = if count == tokens.len() {
            json!({"type": "length", "length": tokens.len()})
        } else {
            Value::Null
        };
        events.push(event(&json!({
            "text": tokens[..count].concat(),
            "output_ids": ids[..count],
            "meta_info": {
                "id": id,
                "finish_reason": finish,
                "prompt_tokens": prompt_tokens,
                "weight_version": "default",
                "completion_tokens": count,
                "cached_tokens": 3,
            },
            "index": 0,
        })));
    }
    events.push(done());
    events
}

/// The events of a client's stream, parsed (`[DONE]` as a string).
fn parse_stream(bytes: &[u8]) -> Vec<Value> {
    let text = std::str::from_utf8(bytes).unwrap();
    assert!(text.is_empty() || text.ends_with("\n\n"), "{text:?}");
    text.split_terminator("\n\n")
        .map(|event| {
            let data = event.strip_prefix("data: ").unwrap();
            assert!(!data.contains('\n'), "{event:?}");
            if data == "[DONE]" {
                Value::String(data.to_owned())
            } else {
                serde_json::from_str(data).unwrap()
            }
        })
        .collect()
}

fn splice_whole(api: Api, sent: &Sent, continuing: &[u8]) -> Vec<u8> {
    let mut splicer = Splicer::new(api, sent);
    let mut out = splicer.feed(continuing).to_vec();
    out.extend_from_slice(&splicer.finish());
    assert!(splicer.engine_error().is_none());
    assert!(!splicer.torn_tail());
    out
}

fn splice_in_pieces(api: Api, sent: &Sent, pieces: &[&[u8]]) -> Vec<u8> {
    let mut splicer = Splicer::new(api, sent);
    let mut out = Vec::new();
    for piece in pieces {
        out.extend_from_slice(&splicer.feed(piece));
    }
    out.extend_from_slice(&splicer.finish());
    out
}

fn json_of(bytes: &[u8]) -> Value {
    serde_json::from_slice(bytes).unwrap()
}

/// The first `k` events and, with `torn`, the first half of the next.
fn recorded(stream: &[Bytes], k: usize, torn: bool) -> Vec<Bytes> {
    let mut recorded = stream[..k].to_vec();
    if torn && let Some(next) = stream.get(k) {
        recorded.push(next.slice(..next.len() / 2));
    }
    recorded
}

/// Checks that reading `k` events (and a torn half of the next) gives the
/// same as reading the `k` whole events, and returns it.
fn read_checked(api: Api, stream: &[Bytes], k: usize) -> Sent {
    let whole = Sent::read(api, &stream[..k]);
    assert!(!whole.torn_tail);
    if k < stream.len() {
        let mut torn = Sent::read(api, &recorded(stream, k, true));
        assert!(torn.torn_tail, "cut in event {k}");
        torn.torn_tail = false;
        assert_eq!(torn, whole, "cut in event {k}");
    }
    whole
}

// (1) Round trips.

fn chat_round_trip(head: Head) {
    let original = br#"{"model":"qwen","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Greet me."}],"max_tokens":10,"temperature":0.7,"stream":true}"#;
    let unbroken = chat_stream(&head, &WORDS, "stop");
    let unbroken_events = parse_stream(&concat(&unbroken));
    let finish_at = 1 + WORDS.len();
    for k in 1..unbroken.len() {
        let sent = read_checked(Api::Chat, &unbroken, k);
        let tokens = (k - 1).min(WORDS.len());
        assert_eq!(sent.tokens_sent, tokens as u64, "k = {k}");
        assert_eq!(sent.text, WORDS[..tokens].concat());
        assert!(sent.role_sent);
        assert_eq!(sent.id, Some(json!(head.id)));
        assert_eq!(sent.created, Some(json!(head.created)));
        assert_eq!(sent.model, Some(json!("qwen")));
        assert_eq!(
            sent.system_fingerprint,
            head.fingerprint.map(|fp| json!(fp))
        );
        assert_eq!(sent.finished, k > finish_at, "k = {k}");
        assert_eq!(sent.usage_seen, k > finish_at + 1);

        let body = continuation(Api::Chat, original, &sent);
        if sent.finished {
            assert_eq!(body, Err(NotResumable::Finished));
            continue;
        }
        let body = body.unwrap();
        assert!(body.starts_with(br#"{"model":"qwen","messages":[{"role":"system""#));
        let mut expected = json!({
            "model": "qwen",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Greet me."},
            ],
            "max_tokens": 10 - tokens,
            "temperature": 0.7,
            "stream": true,
        });
        if tokens > 0 {
            expected["messages"]
                .as_array_mut()
                .unwrap()
                .push(json!({"role": "assistant", "content": WORDS[..tokens].concat()}));
            expected["continue_final_message"] = json!(true);
            expected["add_generation_prompt"] = json!(false);
        }
        assert_eq!(json_of(&body), expected, "k = {k}");

        let continuing = chat_stream(&head.continuing(tokens as u64), &WORDS[tokens..], "stop");
        let spliced = splice_whole(Api::Chat, &sent, &concat(&continuing));
        let mut client = concat(&unbroken[..k]);
        client.extend_from_slice(&spliced);
        assert_eq!(parse_stream(&client), unbroken_events, "k = {k}");
    }
}

#[test]
fn a_chat_stream_broken_anywhere_reads_as_the_unbroken_one() {
    chat_round_trip(FIRST);
}

#[test]
fn a_chat_stream_with_a_fingerprint_keeps_the_first_one() {
    chat_round_trip(Head {
        fingerprint: Some("fp_first"),
        ..FIRST
    });
}

#[test]
fn a_completions_stream_broken_anywhere_reads_as_the_unbroken_one() {
    let original = br#"{"model":"qwen","prompt":"The greeting was","max_tokens":6,"stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":false}}"#;
    let head = Head {
        id: "cmpl-a1",
        ..FIRST
    };
    let unbroken = completions_stream(&head, &WORDS);
    let unbroken_events = parse_stream(&concat(&unbroken));
    for k in 1..unbroken.len() {
        let sent = read_checked(Api::Completions, &unbroken, k);
        let tokens = k.min(WORDS.len());
        assert_eq!(sent.tokens_sent, tokens as u64);
        assert_eq!(sent.text, WORDS[..tokens].concat());
        assert!(!sent.role_sent);
        assert_eq!(sent.finished, k >= WORDS.len());
        let body = continuation(Api::Completions, original, &sent);
        if sent.finished {
            assert_eq!(body, Err(NotResumable::Finished));
            continue;
        }
        let body = body.unwrap();
        assert_eq!(
            json_of(&body),
            json!({
                "model": "qwen",
                "prompt": format!("The greeting was{}", WORDS[..tokens].concat()),
                "max_tokens": 6 - tokens,
                "stream": true,
                "stream_options": {"include_usage": true, "continuous_usage_stats": false},
            }),
            "k = {k}"
        );
        let continuing = completions_stream(&head.continuing(tokens as u64), &WORDS[tokens..]);
        let spliced = splice_whole(Api::Completions, &sent, &concat(&continuing));
        let mut client = concat(&unbroken[..k]);
        client.extend_from_slice(&spliced);
        assert_eq!(parse_stream(&client), unbroken_events, "k = {k}");
    }
}

fn generate_round_trip(original: &[u8], expected_prompt: impl Fn(usize) -> (&'static str, Value)) {
    let unbroken = generate_stream("gen-a1", 4, &STORY, &STORY_IDS);
    let unbroken_events = parse_stream(&concat(&unbroken));
    for k in 1..unbroken.len() {
        let sent = read_checked(Api::Generate, &unbroken, k);
        let tokens = k.min(STORY.len());
        assert_eq!(sent.tokens_sent, tokens as u64);
        assert_eq!(sent.text, STORY[..tokens].concat());
        assert_eq!(sent.output_ids, STORY_IDS[..tokens]);
        assert_eq!(sent.prompt_tokens, Some(4));
        assert_eq!(sent.id, Some(json!("gen-a1")));
        assert_eq!(sent.finished, k >= STORY.len());
        let body = continuation(Api::Generate, original, &sent);
        if sent.finished {
            assert_eq!(body, Err(NotResumable::Finished));
            continue;
        }
        let body = json_of(&body.unwrap());
        let (key, prompt) = expected_prompt(tokens);
        let mut expected = json!({
            "sampling_params": {"max_new_tokens": 8 - tokens, "temperature": 0},
            "stream": true,
            "rid": "r-1",
        });
        expected[key] = prompt;
        assert_eq!(body, expected, "k = {k}");
        let continuing = generate_stream(
            "gen-b2",
            4 + tokens as u64,
            &STORY[tokens..],
            &STORY_IDS[tokens..],
        );
        let spliced = splice_whole(Api::Generate, &sent, &concat(&continuing));
        let mut client = concat(&unbroken[..k]);
        client.extend_from_slice(&spliced);
        assert_eq!(parse_stream(&client), unbroken_events, "k = {k}");
    }
}

#[test]
fn a_generate_stream_on_text_broken_anywhere_reads_as_the_unbroken_one() {
    generate_round_trip(
        br#"{"text":"Once upon a time","sampling_params":{"max_new_tokens":8,"temperature":0},"stream":true,"rid":"r-1"}"#,
        |tokens| ("text", json!(format!("Once upon a time{}", STORY[..tokens].concat()))),
    );
}

#[test]
fn a_generate_stream_on_token_ids_broken_anywhere_reads_as_the_unbroken_one() {
    generate_round_trip(
        br#"{"input_ids":[1,2,3,4],"sampling_params":{"max_new_tokens":8,"temperature":0},"stream":true,"rid":"r-1"}"#,
        |tokens| {
            let mut ids = vec![1, 2, 3, 4];
            ids.extend_from_slice(&STORY_IDS[..tokens]);
            ("input_ids", json!(ids))
        },
    );
}

#[test]
fn a_second_break_continues_from_everything_the_client_got() {
    let original = br#"{"model":"qwen","messages":[{"role":"user","content":"Greet me."}],"max_tokens":10,"stream":true}"#;
    let unbroken = chat_stream(&FIRST, &WORDS, "stop");
    let unbroken_events = parse_stream(&concat(&unbroken));
    // The first worker sends the role and two tokens.
    let mut client: Vec<Bytes> = unbroken[..3].to_vec();
    let sent = Sent::read(Api::Chat, &client);
    let second = FIRST.continuing(2);
    let continuing = chat_stream(&second, &WORDS[2..], "stop");
    // The second sends its role chunk and two more tokens, then breaks.
    let spliced = splice_whole(Api::Chat, &sent, &concat(&continuing[..3]));
    client.push(Bytes::from(spliced));
    let sent = Sent::read(Api::Chat, &client);
    assert_eq!(sent.tokens_sent, 4);
    assert_eq!(sent.text, "Hello there, dear");
    assert_eq!(sent.id, Some(json!(FIRST.id)));
    let body = json_of(&continuation(Api::Chat, original, &sent).unwrap());
    assert_eq!(body["max_tokens"], 6);
    assert_eq!(
        body["messages"][1],
        json!({"role": "assistant", "content": "Hello there, dear"})
    );
    let third = chat_stream(&FIRST.continuing(4), &WORDS[4..], "stop");
    client.push(Bytes::from(splice_whole(Api::Chat, &sent, &concat(&third))));
    assert_eq!(parse_stream(&concat(&client)), unbroken_events);
}

// (2) Splits.

#[test]
fn events_split_at_every_byte_splice_as_whole_ones() {
    let cases: [(Api, Vec<Bytes>, Vec<Bytes>); 3] = [
        (
            Api::Chat,
            chat_stream(&FIRST, &WORDS, "stop"),
            chat_stream(&FIRST.continuing(2), &WORDS[2..], "stop"),
        ),
        (
            Api::Completions,
            completions_stream(&FIRST, &WORDS),
            completions_stream(&FIRST.continuing(2), &WORDS[2..]),
        ),
        (
            Api::Generate,
            generate_stream("gen-a1", 4, &STORY, &STORY_IDS),
            generate_stream("gen-b2", 6, &STORY[2..], &STORY_IDS[2..]),
        ),
    ];
    for (api, unbroken, continuing) in cases {
        let recorded = concat(&unbroken[..3]);
        let whole_sent = Sent::read(api, &unbroken[..3]);
        let bytes: Vec<Bytes> = recorded
            .iter()
            .map(|b| Bytes::copy_from_slice(&[*b]))
            .collect();
        assert_eq!(Sent::read(api, &bytes), whole_sent, "{api:?}");

        let continuing = concat(&continuing);
        let whole = splice_whole(api, &whole_sent, &continuing);
        let every_byte: Vec<&[u8]> = continuing.chunks(1).collect();
        assert_eq!(
            splice_in_pieces(api, &whole_sent, &every_byte),
            whole,
            "{api:?}"
        );
        for cut in 0..=continuing.len() {
            let (head, tail) = continuing.split_at(cut);
            assert_eq!(
                splice_in_pieces(api, &whole_sent, &[head, tail]),
                whole,
                "{api:?} cut at {cut}"
            );
        }

        let stream = concat(&unbroken);
        let assembled = assemble(api, &[&stream]);
        let every_byte: Vec<&[u8]> = stream.chunks(1).collect();
        assert_eq!(assemble(api, &every_byte), assembled, "{api:?}");
    }
}

#[test]
fn crlf_events_and_multi_line_data_are_spliced() {
    let sent = Sent::read(Api::Chat, &chat_stream(&FIRST, &WORDS, "stop")[..2]);
    let continuing = concat(&[
        Bytes::from_static(b": ping\r\n\r\n"),
        Bytes::from_static(
            b"data: {\"id\":\"x\",\"created\":1,\"model\":\"qwen\",\r\ndata: \"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}]}\r\n\r\n",
        ),
        Bytes::from_static(
            b"event: token\ndata: {\"id\":\"x\",\"created\":1,\"model\":\"qwen\",\ndata: \"choices\":[{\"index\":0,\"delta\":{\"content\":\" there\"},\"finish_reason\":null}]}\n\n",
        ),
        Bytes::from_static(b"data: [DONE]\r\n\r\n"),
    ]);
    let spliced = splice_whole(Api::Chat, &sent, &continuing);
    let text = std::str::from_utf8(&spliced).unwrap();
    let (ping, rest) = text.split_at(": ping\r\n\r\n".len());
    assert_eq!(ping, ": ping\r\n\r\n");
    let (token, done) = rest.split_once("\n\n").unwrap();
    let token = token.strip_prefix("event: token\ndata: ").unwrap();
    assert_eq!(
        json_of(token.as_bytes()),
        json!({"id": FIRST.id, "created": FIRST.created, "model": "qwen",
               "choices": [{"index": 0, "delta": {"content": " there"}, "finish_reason": null}]})
    );
    assert_eq!(done, "data: [DONE]\r\n\r\n");
}

// (3) What cannot be continued.

fn sent_chat(tokens: usize) -> Sent {
    Sent::read(
        Api::Chat,
        &chat_stream(&FIRST, &WORDS, "stop")[..1 + tokens],
    )
}

#[test]
fn each_refusal_of_a_continuation() {
    let chat = sent_chat(2);
    let mut tool_calls = chat.clone();
    tool_calls.tool_calls_seen = true;
    let mut reasoning = chat.clone();
    reasoning.reasoning_seen = true;
    let mut finished = chat.clone();
    finished.finished = true;
    let completion = Sent::read(Api::Completions, &completions_stream(&FIRST, &WORDS)[..2]);
    let generate = Sent::read(
        Api::Generate,
        &generate_stream("g", 4, &STORY, &STORY_IDS)[..2],
    );
    let mut generate_without_ids = generate.clone();
    generate_without_ids.output_ids.clear();
    use NotResumable::*;
    let cases: Vec<(Api, &str, &Sent, NotResumable)> = vec![
        (Api::Chat, "not json", &chat, BodyNotJson),
        (Api::Chat, "[1]", &chat, BodyNotJson),
        (Api::Chat, "{\"messages\":[]}\u{ff}", &chat, BodyNotJson),
        (Api::Chat, r#"{"messages":[],"n":2}"#, &chat, SeveralChoices),
        (
            Api::Chat,
            r#"{"messages":[],"best_of":3}"#,
            &chat,
            SeveralChoices,
        ),
        (
            Api::Completions,
            r#"{"prompt":["a","b"]}"#,
            &completion,
            SeveralChoices,
        ),
        (
            Api::Completions,
            r#"{"prompt":[[1,2],[3]]}"#,
            &completion,
            SeveralChoices,
        ),
        (
            Api::Generate,
            r#"{"text":["a","b"]}"#,
            &generate,
            SeveralChoices,
        ),
        (
            Api::Generate,
            r#"{"input_ids":[[1],[2]]}"#,
            &generate,
            SeveralChoices,
        ),
        (
            Api::Generate,
            r#"{"text":"a","sampling_params":[{},{}]}"#,
            &generate,
            SeveralChoices,
        ),
        (
            Api::Generate,
            r#"{"text":"a","sampling_params":{"n":2}}"#,
            &generate,
            SeveralChoices,
        ),
        (
            Api::Chat,
            r#"{"messages":[],"logprobs":true}"#,
            &chat,
            Logprobs,
        ),
        (
            Api::Chat,
            r#"{"messages":[],"prompt_logprobs":1}"#,
            &chat,
            Logprobs,
        ),
        (
            Api::Completions,
            r#"{"prompt":"a","logprobs":0}"#,
            &completion,
            Logprobs,
        ),
        (
            Api::Generate,
            r#"{"text":"a","return_logprob":true}"#,
            &generate,
            Logprobs,
        ),
        (
            Api::Chat,
            r#"{"messages":[],"response_format":{"type":"json_object"}}"#,
            &chat,
            GuidedDecoding,
        ),
        (
            Api::Chat,
            r#"{"messages":[],"response_format":{"type":"json_schema","json_schema":{}}}"#,
            &chat,
            GuidedDecoding,
        ),
        (
            Api::Chat,
            r#"{"messages":[],"guided_json":{"type":"object"}}"#,
            &chat,
            GuidedDecoding,
        ),
        (
            Api::Chat,
            r#"{"messages":[],"guided_regex":"a+"}"#,
            &chat,
            GuidedDecoding,
        ),
        (
            Api::Chat,
            r#"{"messages":[],"guided_choice":["a","b"]}"#,
            &chat,
            GuidedDecoding,
        ),
        (
            Api::Completions,
            r#"{"prompt":"a","guided_grammar":"root ::= x"}"#,
            &completion,
            GuidedDecoding,
        ),
        (
            Api::Chat,
            r#"{"messages":[],"structured_outputs":{"regex":"a"}}"#,
            &chat,
            GuidedDecoding,
        ),
        (
            Api::Chat,
            r#"{"messages":[],"tool_choice":"required","tools":[]}"#,
            &chat,
            GuidedDecoding,
        ),
        (
            Api::Chat,
            r#"{"messages":[],"tool_choice":{"type":"function","function":{"name":"f"}}}"#,
            &chat,
            GuidedDecoding,
        ),
        (
            Api::Generate,
            r#"{"text":"a","sampling_params":{"regex":"a+"}}"#,
            &generate,
            GuidedDecoding,
        ),
        (
            Api::Generate,
            r#"{"text":"a","sampling_params":{"json_schema":"{}"}}"#,
            &generate,
            GuidedDecoding,
        ),
        (
            Api::Generate,
            r#"{"text":"a","sampling_params":{"ebnf":"x"}}"#,
            &generate,
            GuidedDecoding,
        ),
        (
            Api::Completions,
            r#"{"prompt":"a","echo":true}"#,
            &completion,
            Echo,
        ),
        (Api::Chat, r#"{"messages":[],"echo":true}"#, &chat, Echo),
        (
            Api::Completions,
            r#"{"prompt":[1,2,3]}"#,
            &completion,
            PromptNotText,
        ),
        (
            Api::Completions,
            r#"{"prompt":[[1,2,3]]}"#,
            &completion,
            PromptNotText,
        ),
        (
            Api::Completions,
            r#"{"model":"m"}"#,
            &completion,
            PromptNotText,
        ),
        (
            Api::Generate,
            r#"{"input_embeds":[[0.1]]}"#,
            &generate,
            PromptNotText,
        ),
        (
            Api::Generate,
            r#"{"text":"a","input_ids":[1]}"#,
            &generate,
            PromptNotText,
        ),
        (Api::Chat, r#"{"model":"m"}"#, &chat, PromptNotText),
        (
            Api::Chat,
            r#"{"messages":{"role":"user"}}"#,
            &chat,
            PromptNotText,
        ),
        (
            Api::Chat,
            r#"{"messages":[],"continue_final_message":true}"#,
            &chat,
            PromptNotText,
        ),
        (
            Api::Chat,
            r#"{"messages":[{"role":"assistant","content":[{"type":"text","text":"a"}]}],"continue_final_message":true,"add_generation_prompt":false}"#,
            &chat,
            PromptNotText,
        ),
        (
            Api::Chat,
            r#"{"messages":[{"role":"user","content":"a"}],"add_generation_prompt":false}"#,
            &chat,
            PromptNotText,
        ),
        (
            Api::Generate,
            r#"{"input_ids":[1,2]}"#,
            &generate_without_ids,
            OutputIdsMissing,
        ),
        (
            Api::Chat,
            r#"{"messages":[],"max_tokens":-1}"#,
            &chat,
            InvalidTokenLimit,
        ),
        (
            Api::Chat,
            r#"{"messages":[],"max_completion_tokens":"10"}"#,
            &chat,
            InvalidTokenLimit,
        ),
        (
            Api::Chat,
            r#"{"messages":[],"max_tokens":1e400}"#,
            &chat,
            InvalidTokenLimit,
        ),
        (
            Api::Generate,
            r#"{"text":"a","sampling_params":{"max_new_tokens":2.5}}"#,
            &generate,
            InvalidTokenLimit,
        ),
        (
            Api::Chat,
            r#"{"messages":[],"tools":[{"type":"function"}]}"#,
            &tool_calls,
            ToolCallsStreamed,
        ),
        (
            Api::Chat,
            r#"{"messages":[]}"#,
            &reasoning,
            ReasoningStreamed,
        ),
        (Api::Chat, r#"{"messages":[]}"#, &finished, Finished),
        (
            Api::Chat,
            r#"{"messages":[],"max_tokens":2}"#,
            &chat,
            BudgetSpent,
        ),
        (
            Api::Chat,
            r#"{"messages":[],"max_completion_tokens":1}"#,
            &chat,
            BudgetSpent,
        ),
        (
            Api::Completions,
            r#"{"prompt":"a","max_tokens":1}"#,
            &completion,
            BudgetSpent,
        ),
        (
            Api::Generate,
            r#"{"text":"a","sampling_params":{"max_new_tokens":2}}"#,
            &generate,
            BudgetSpent,
        ),
    ];
    for (api, body, sent, expected) in cases {
        assert_eq!(
            continuation(api, body.as_bytes(), sent),
            Err(expected),
            "{api:?} {body}"
        );
    }
    // Labels are distinct snake_case.
    let all = [
        BodyNotJson,
        SeveralChoices,
        Logprobs,
        GuidedDecoding,
        Echo,
        PromptNotText,
        OutputIdsMissing,
        InvalidTokenLimit,
        ToolCallsStreamed,
        ReasoningStreamed,
        Finished,
        BudgetSpent,
    ];
    let labels: std::collections::HashSet<&str> = all.iter().map(|why| why.as_str()).collect();
    assert_eq!(labels.len(), all.len());
    assert!(
        labels
            .iter()
            .all(|label| label.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
    );
    assert!(!Finished.to_string().is_empty());
}

#[test]
fn what_does_not_stop_a_continuation() {
    let chat = sent_chat(2);
    for body in [
        r#"{"messages":[{"role":"user","content":"a"}],"n":1,"best_of":1,"logprobs":false,"echo":false,"response_format":{"type":"text"},"tool_choice":"auto","guided_json":null,"max_tokens":null}"#,
        r#"{"messages":[{"role":"user","content":"a"}],"response_format":null,"tool_choice":"none","top_logprobs":null}"#,
    ] {
        let body = json_of(&continuation(Api::Chat, body.as_bytes(), &chat).unwrap());
        assert_eq!(body["messages"][1]["content"], "Hello there");
    }
}

#[test]
fn limits_are_reduced_where_the_client_set_them_and_defaults_where_the_engine_has_one() {
    let chat = sent_chat(2);
    let body = json_of(
        &continuation(
            Api::Chat,
            br#"{"messages":[{"role":"user","content":"a"}],"max_tokens":9,"max_completion_tokens":7,"min_tokens":5}"#,
            &chat,
        )
        .unwrap(),
    );
    assert_eq!(
        (
            &body["max_tokens"],
            &body["max_completion_tokens"],
            &body["min_tokens"]
        ),
        (&json!(7), &json!(5), &json!(3))
    );
    let body =
        json_of(&continuation(Api::Chat, br#"{"messages":[],"min_tokens":1}"#, &chat).unwrap());
    assert_eq!(body.get("max_tokens"), None);
    assert_eq!(body.get("max_completion_tokens"), None);
    assert_eq!(body["min_tokens"], 0);

    let completion = Sent::read(Api::Completions, &completions_stream(&FIRST, &WORDS)[..3]);
    let body =
        json_of(&continuation(Api::Completions, br#"{"prompt":["a"]}"#, &completion).unwrap());
    assert_eq!(body["max_tokens"], 13);
    assert_eq!(body["prompt"], "aHello there,");
    let body = json_of(
        &continuation(
            Api::Completions,
            br#"{"prompt":"a","max_tokens":null}"#,
            &completion,
        )
        .unwrap(),
    );
    assert_eq!(body["max_tokens"], Value::Null);

    let generate = Sent::read(
        Api::Generate,
        &generate_stream("g", 4, &STORY, &STORY_IDS)[..3],
    );
    let body = json_of(&continuation(Api::Generate, br#"{"text":"a"}"#, &generate).unwrap());
    assert_eq!(body["sampling_params"], json!({"max_new_tokens": 125}));
    let body = json_of(
        &continuation(
            Api::Generate,
            br#"{"text":"a","sampling_params":{"max_new_tokens":10,"min_new_tokens":4}}"#,
            &generate,
        )
        .unwrap(),
    );
    assert_eq!(
        body["sampling_params"],
        json!({"max_new_tokens": 7, "min_new_tokens": 1})
    );
}

#[test]
fn a_client_continuing_its_own_final_message_has_the_text_appended_to_it() {
    let chat = sent_chat(2);
    let body = continuation(
        Api::Chat,
        br#"{"messages":[{"role":"user","content":"Greet me."},{"role":"assistant","content":"Well: "}],"continue_final_message":true,"add_generation_prompt":false,"stream":true}"#,
        &chat,
    )
    .unwrap();
    assert_eq!(
        json_of(&body),
        json!({
            "messages": [
                {"role": "user", "content": "Greet me."},
                {"role": "assistant", "content": "Well: Hello there"},
            ],
            "continue_final_message": true,
            "add_generation_prompt": false,
            "stream": true,
        })
    );
}

#[test]
fn nothing_generated_yet_makes_the_continuation_a_retry() {
    let sent = sent_chat(0);
    assert!(sent.role_sent);
    assert_eq!(sent.tokens_sent, 0);
    let body = json_of(
        &continuation(
            Api::Chat,
            br#"{"messages":[{"role":"user","content":"a"}],"add_generation_prompt":false}"#,
            &sent,
        )
        .unwrap(),
    );
    assert_eq!(
        body,
        json!({"messages": [{"role": "user", "content": "a"}], "add_generation_prompt": false,
               "stream": true})
    );
    let sent = Sent::read(Api::Completions, &[]);
    let body = json_of(&continuation(Api::Completions, br#"{"prompt":[1,2]}"#, &sent).unwrap());
    assert_eq!(body["prompt"], json!([1, 2]));
    assert_eq!(body["max_tokens"], 16);
}

#[test]
fn as_stream_asks_for_a_stream_with_usage() {
    let body = as_stream(
        Api::Chat,
        br#"{"model":"m","messages":[{"role":"user","content":"a"}],"stream":false,"response_format":{"type":"json_object"},"tools":[]}"#,
    )
    .unwrap();
    assert!(body.starts_with(br#"{"model":"m","messages":"#));
    assert_eq!(
        json_of(&body),
        json!({"model": "m", "messages": [{"role": "user", "content": "a"}], "stream": true,
               "response_format": {"type": "json_object"}, "tools": [],
               "stream_options": {"include_usage": true}})
    );
    let body = json_of(&as_stream(Api::Completions, br#"{"prompt":[1,2]}"#).unwrap());
    assert_eq!(
        body,
        json!({"prompt": [1, 2], "stream": true, "stream_options": {"include_usage": true}})
    );
    let body = json_of(&as_stream(Api::Generate, br#"{"input_ids":[1],"stream":false}"#).unwrap());
    assert_eq!(body, json!({"input_ids": [1], "stream": true}));

    use NotResumable::*;
    for (api, body, expected) in [
        (Api::Chat, "", BodyNotJson),
        (Api::Chat, r#"{"n":2}"#, SeveralChoices),
        (Api::Completions, r#"{"best_of":2}"#, SeveralChoices),
        (Api::Completions, r#"{"prompt":["a","b"]}"#, SeveralChoices),
        (Api::Generate, r#"{"text":["a","b"]}"#, SeveralChoices),
        (Api::Chat, r#"{"logprobs":true,"top_logprobs":2}"#, Logprobs),
        (Api::Completions, r#"{"logprobs":1}"#, Logprobs),
        (
            Api::Generate,
            r#"{"text":"a","return_logprob":true}"#,
            Logprobs,
        ),
        (Api::Completions, r#"{"prompt":"a","echo":true}"#, Echo),
    ] {
        assert_eq!(as_stream(api, body.as_bytes()), Err(expected), "{body}");
    }
}

// Splicing details.

#[test]
fn usage_counts_the_whole_answer_and_keeps_the_details() {
    let mut sent = sent_chat(3);
    let usage_chunk = |prompt: u64, completion: u64| {
        event(
            &json!({"id": "x", "object": "chat.completion.chunk", "created": 5, "model": "qwen",
                      "choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "total_tokens": prompt.saturating_add(completion), "prompt_tokens_details": {"cached_tokens": 22}}}),
        )
    };
    let spliced = parse_stream(&splice_whole(Api::Chat, &sent, &usage_chunk(23, 4)));
    assert_eq!(
        spliced[0]["usage"],
        json!({"prompt_tokens": 20, "completion_tokens": 7, "total_tokens": 27,
               "prompt_tokens_details": {"cached_tokens": 22}})
    );
    // The original stream's own prompt count wins; never below zero.
    sent.prompt_tokens = Some(19);
    let spliced = parse_stream(&splice_whole(Api::Chat, &sent, &usage_chunk(23, 4)));
    assert_eq!(spliced[0]["usage"]["prompt_tokens"], 19);
    assert_eq!(spliced[0]["usage"]["total_tokens"], 26);
    sent.prompt_tokens = None;
    let spliced = parse_stream(&splice_whole(Api::Chat, &sent, &usage_chunk(1, u64::MAX)));
    assert_eq!(spliced[0]["usage"]["prompt_tokens"], 0);
    assert_eq!(spliced[0]["usage"]["completion_tokens"], u64::MAX);
    assert_eq!(spliced[0]["usage"]["total_tokens"], u64::MAX);
}

#[test]
fn usage_on_every_chunk_keeps_the_role_chunk_and_is_counted() {
    let recorded = [event(
        &json!({"id": "a", "created": 1, "model": "m", "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": "Hi"}, "finish_reason": null}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}),
    )];
    let sent = Sent::read(Api::Chat, &recorded);
    assert_eq!(sent.tokens_sent, 3, "the reported count wins over chunks");
    assert_eq!(sent.prompt_tokens, Some(7));
    let continuing = event(&json!({"id": "b", "created": 2, "model": "m", "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 0, "total_tokens": 9}}));
    let spliced = parse_stream(&splice_whole(Api::Chat, &sent, &continuing));
    assert_eq!(
        spliced,
        vec![json!({"id": "a", "created": 1, "model": "m", "choices": [
            {"index": 0, "delta": {"content": ""}, "finish_reason": null}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}})]
    );
}

#[test]
fn the_role_passes_when_the_client_has_not_had_it() {
    let sent = Sent::read(Api::Chat, &[Bytes::from_static(b": ping\n\n")]);
    assert!(!sent.role_sent);
    let continuing = concat(&chat_stream(&FIRST, &WORDS[..1], "stop"));
    let spliced = parse_stream(&splice_whole(Api::Chat, &sent, &continuing));
    assert_eq!(spliced, parse_stream(&continuing));
    // An empty chunk the engine sent itself is not the splicer's to drop.
    let sent = sent_chat(1);
    let empty =
        event(&json!({"id": "b", "choices": [{"index": 0, "delta": {}, "finish_reason": null}]}));
    assert_eq!(
        parse_stream(&splice_whole(Api::Chat, &sent, &empty)).len(),
        1
    );
}

#[test]
fn what_is_not_json_passes_untouched() {
    let sent = sent_chat(2);
    for event in [
        &b": ping\n\n"[..],
        b"data: [DONE]\n\n",
        b"data: not json\n\n",
        b"data: [1,2]\n\n",
        b"data: {\"bad\": \xff}\n\n",
        b"event: x\nid: 3\n\n",
        b"\n",
    ] {
        let mut splicer = Splicer::new(Api::Chat, &sent);
        assert_eq!(&splicer.feed(event)[..], event);
        assert!(splicer.finish().is_empty());
    }
}

#[test]
fn an_engine_error_is_kept_from_the_client_and_ends_the_splice() {
    let sent = sent_chat(2);
    let continuing = chat_stream(&FIRST.continuing(2), &WORDS[2..], "stop");
    let error = b"data: {\"error\":{\"message\":\"KV cache exhausted\",\"type\":\"InternalServerError\",\"code\":500}}\n\n";
    let mut splicer = Splicer::new(Api::Chat, &sent);
    let mut stream = concat(&continuing[..2]);
    stream.extend_from_slice(error);
    stream.extend_from_slice(&concat(&continuing[2..]));
    let out = splicer.feed(&stream);
    assert_eq!(
        parse_stream(&out).len(),
        1,
        "the role chunk dropped, one token"
    );
    assert_eq!(
        json_of(splicer.engine_error().unwrap()),
        json!({"error": {"message": "KV cache exhausted", "type": "InternalServerError", "code": 500}})
    );
    assert!(splicer.feed(&concat(&continuing)).is_empty());
    assert!(splicer.finish().is_empty());
}

#[test]
fn the_end_of_a_continuing_stream() {
    let sent = sent_chat(2);
    let token = chat_stream(&FIRST.continuing(2), &WORDS[2..], "stop").swap_remove(1);
    // A last event without its blank line is whole: passed on, ended.
    let mut splicer = Splicer::new(Api::Chat, &sent);
    assert!(splicer.feed(token.trim_ascii_end()).is_empty());
    let out = splicer.finish();
    assert_eq!(parse_stream(&out).len(), 1);
    assert!(!splicer.torn_tail());
    // A torn one is dropped and reported.
    let mut splicer = Splicer::new(Api::Chat, &sent);
    assert!(splicer.feed(&token[..token.len() / 2]).is_empty());
    assert!(splicer.finish().is_empty());
    assert!(splicer.torn_tail());
}

#[test]
fn sent_ignores_errors_comments_and_counts_what_the_client_got() {
    let stream = concat(&[
        Bytes::from_static(b": ping\n\n"),
        chat_stream(&FIRST, &WORDS, "stop")[0].clone(),
        Bytes::from_static(b"data: {\"error\":{\"message\":\"x\"}}\n\n"),
        Bytes::from_static(b"data: {\"object\":\"error\",\"message\":\"x\",\"choices\":[{\"delta\":{\"content\":\"no\"}}]}\n\n"),
        chat_stream(&FIRST, &WORDS, "stop")[1].clone(),
    ]);
    let sent = Sent::read(Api::Chat, &[Bytes::from(stream)]);
    assert_eq!(sent.text, "Hello");
    assert_eq!(sent.tokens_sent, 1);
    assert!(!sent.finished);

    let tool_call = event(
        &json!({"id": "a", "choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}]}}]}),
    );
    assert!(Sent::read(Api::Chat, &[tool_call]).tool_calls_seen);
    let reasoning =
        event(&json!({"id": "a", "choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]}));
    let sent = Sent::read(Api::Chat, &[reasoning]);
    assert!(sent.reasoning_seen);
    assert_eq!(sent.tokens_sent, 0);
    assert!(Sent::read(Api::Chat, &[done()]).finished);
}

#[test]
fn generate_without_reported_counts_falls_back_to_ids_then_events() {
    let with_ids = event(&json!({"text": "a b", "output_ids": [5, 6], "meta_info": {"id": "g"}}));
    assert_eq!(Sent::read(Api::Generate, &[with_ids]).tokens_sent, 2);
    let text_only = [
        event(&json!({"text": "a", "meta_info": {}})),
        event(&json!({"text": "a", "meta_info": {}})),
        event(&json!({"text": "a b", "meta_info": {}})),
    ];
    let sent = Sent::read(Api::Generate, &text_only);
    assert_eq!(sent.tokens_sent, 2);
    assert!(sent.output_ids.is_empty());
    let bad_ids =
        event(&json!({"text": "a", "output_ids": [1, -2], "meta_info": {"completion_tokens": 2}}));
    let sent = Sent::read(Api::Generate, &[bad_ids]);
    assert!(sent.output_ids.is_empty());
    assert_eq!(
        continuation(Api::Generate, br#"{"input_ids":[1]}"#, &sent),
        Err(NotResumable::OutputIdsMissing)
    );
}

// (4) The assembler.

fn assemble(api: Api, pieces: &[&[u8]]) -> Result<Bytes, AssembleError> {
    let mut assembler = Assembler::new(api);
    for piece in pieces {
        assembler.feed(piece);
    }
    assembler.finish()
}

#[test]
fn a_chat_answer_is_assembled() {
    let head = Head {
        fingerprint: Some("fp_1"),
        ..FIRST
    };
    let mut stream = chat_stream(&head, &WORDS, "stop");
    stream.insert(
        1,
        head.chunk(
            "chat.completion.chunk",
            json!([{"index": 0, "delta": {"reasoning_content": "They want"}, "finish_reason": null}]),
            None,
        ),
    );
    stream.insert(
        2,
        head.chunk(
            "chat.completion.chunk",
            json!([{"index": 0, "delta": {"reasoning_content": " a greeting."}, "finish_reason": null}]),
            None,
        ),
    );
    let answer = assemble(Api::Chat, &[&concat(&stream)]).unwrap();
    assert_eq!(
        json_of(&answer),
        json!({
            "id": "chatcmpl-a1", "object": "chat.completion", "created": 1_700_000_000,
            "model": "qwen", "system_fingerprint": "fp_1",
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": "Hello there, dear friend!",
                            "reasoning_content": "They want a greeting."},
                "logprobs": null, "finish_reason": "stop", "stop_reason": null,
            }],
            "usage": {"prompt_tokens": 20, "completion_tokens": 6, "total_tokens": 26,
                      "prompt_tokens_details": {"cached_tokens": 16}},
        })
    );
}

#[test]
fn streamed_tool_calls_are_assembled() {
    let chunk = |delta: Value, finish: Value| {
        FIRST.chunk(
            "chat.completion.chunk",
            json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]),
            None,
        )
    };
    let call = |index: u64, function: Value| json!({"tool_calls": [{"index": index, "function": function}]});
    let stream = [
        chunk(json!({"role": "assistant", "content": ""}), Value::Null),
        chunk(
            json!({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                   "function": {"name": "get_weather", "arguments": ""}}]}),
            Value::Null,
        ),
        chunk(call(0, json!({"arguments": "{\"city\": "})), Value::Null),
        chunk(call(0, json!({"arguments": "\"Paris\"}"})), Value::Null),
        chunk(
            json!({"tool_calls": [{"index": 1, "id": "call_2", "type": "function",
                                   "function": {"name": "get_time", "arguments": "{\"tz\""}}]}),
            Value::Null,
        ),
        chunk(call(1, json!({"arguments": ": \"CET\""})), Value::Null),
        chunk(call(1, json!({"arguments": "}"})), Value::Null),
        chunk(json!({}), json!("tool_calls")),
        FIRST.chunk("chat.completion.chunk", json!([]), Some(FIRST.usage(30))),
        done(),
    ];
    let stream = concat(&stream);
    let answer = json_of(&assemble(Api::Chat, &[&stream]).unwrap());
    assert_eq!(
        answer["choices"],
        json!([{
            "index": 0,
            "message": {
                "role": "assistant",
                "content": null,
                "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
                    {"id": "call_2", "type": "function",
                     "function": {"name": "get_time", "arguments": "{\"tz\": \"CET\"}"}},
                ],
            },
            "logprobs": null,
            "finish_reason": "tool_calls",
        }])
    );
    assert_eq!(answer["usage"]["completion_tokens"], 30);
    assert_eq!(answer["object"], "chat.completion");
    // And a stream with tool calls cannot be continued.
    let sent = Sent::read(
        Api::Chat,
        &[Bytes::copy_from_slice(&stream[..stream.len() / 2])],
    );
    assert_eq!(
        continuation(Api::Chat, br#"{"messages":[]}"#, &sent),
        Err(NotResumable::ToolCallsStreamed)
    );
}

#[test]
fn a_completion_is_assembled() {
    let stream = concat(&completions_stream(
        &Head {
            id: "cmpl-1",
            ..FIRST
        },
        &WORDS,
    ));
    let answer = json_of(&assemble(Api::Completions, &[&stream]).unwrap());
    assert_eq!(
        answer,
        json!({
            "id": "cmpl-1", "object": "text_completion", "created": 1_700_000_000, "model": "qwen",
            "choices": [{"index": 0, "text": "Hello there, dear friend!", "logprobs": null,
                         "finish_reason": "length", "stop_reason": null}],
            "usage": {"prompt_tokens": 20, "completion_tokens": 6, "total_tokens": 26,
                      "prompt_tokens_details": {"cached_tokens": 16}},
        })
    );
}

#[test]
fn a_generate_answer_is_its_last_event() {
    let stream = generate_stream("g-1", 4, &STORY, &STORY_IDS);
    let answer = assemble(Api::Generate, &[&concat(&stream)]).unwrap();
    let last = &stream[stream.len() - 2];
    assert_eq!(
        &answer[..],
        last.strip_prefix(b"data: ").unwrap().trim_ascii_end()
    );
    assert_eq!(json_of(&answer)["text"], STORY.concat());
}

#[test]
fn an_error_event_or_a_missing_finish_is_no_answer() {
    let mut stream = concat(&chat_stream(&FIRST, &WORDS, "stop")[..3]);
    let error = br#"{"error":{"message":"This model's maximum context length is 4096 tokens","type":"BadRequestError","param":null,"code":400}}"#;
    stream.extend_from_slice(b"data: ");
    stream.extend_from_slice(error);
    stream.extend_from_slice(b"\n\n");
    stream.extend_from_slice(&concat(&chat_stream(&FIRST, &WORDS, "stop")[3..]));
    let mut assembler = Assembler::new(Api::Chat);
    assembler.feed(&stream);
    let failure = assembler.finish().unwrap_err();
    assert_eq!(
        failure,
        AssembleError::Engine(Bytes::copy_from_slice(error))
    );
    assert_eq!(failure.status(), http::StatusCode::BAD_REQUEST);
    assert_eq!(failure.as_str(), "engine_error");
    assert_eq!(
        failure.engine_json().map(|json| &json[..]),
        Some(&error[..])
    );
    let old_vllm = AssembleError::Engine(Bytes::from_static(br#"{"object":"error","code":503}"#));
    assert_eq!(old_vllm.status(), http::StatusCode::SERVICE_UNAVAILABLE);
    let odd = AssembleError::Engine(Bytes::from_static(br#"{"error":{"code":200}}"#));
    assert_eq!(odd.status(), http::StatusCode::BAD_GATEWAY);

    let unfinished = chat_stream(&FIRST, &WORDS, "stop");
    for api in [Api::Chat, Api::Completions, Api::Generate] {
        let stream = match api {
            Api::Chat => concat(&unfinished[..4]),
            Api::Completions => concat(&completions_stream(&FIRST, &WORDS)[..5]),
            Api::Generate => concat(&generate_stream("g", 4, &STORY, &STORY_IDS)[..7]),
        };
        let failure = assemble(api, &[&stream]).unwrap_err();
        assert_eq!(failure, AssembleError::Incomplete, "{api:?}");
        assert_eq!(failure.status(), http::StatusCode::BAD_GATEWAY);
    }
    // Cut in the finish chunk: still incomplete.
    let stream = concat(&unfinished);
    let finish_at = concat(&unfinished[..1 + WORDS.len()]).len();
    assert_eq!(
        assemble(Api::Chat, &[&stream[..finish_at + 30]]),
        Err(AssembleError::Incomplete)
    );
}

#[test]
fn apis_are_known_by_path() {
    assert_eq!(Api::from_path("/v1/chat/completions"), Some(Api::Chat));
    assert_eq!(Api::from_path("/v1/completions"), Some(Api::Completions));
    assert_eq!(Api::from_path("/generate"), Some(Api::Generate));
    assert_eq!(Api::from_path("/v1/models"), None);
    assert_eq!(Api::from_path("/generate/"), None);
}

// (5) Properties.

/// `bytes` cut at `cuts` (indices, any order, possibly repeated).
fn cut(bytes: &[u8], cuts: &[prop::sample::Index]) -> Vec<Bytes> {
    let mut at: Vec<usize> = cuts
        .iter()
        .map(|index| index.index(bytes.len() + 1))
        .collect();
    at.push(0);
    at.push(bytes.len());
    at.sort_unstable();
    at.windows(2)
        .map(|pair| Bytes::copy_from_slice(&bytes[pair[0]..pair[1]]))
        .collect()
}

fn api_strategy() -> impl Strategy<Value = Api> {
    prop_oneof![Just(Api::Chat), Just(Api::Completions), Just(Api::Generate)]
}

fn streams(api: Api, tokens_sent: usize) -> (Vec<Bytes>, Vec<Bytes>) {
    match api {
        Api::Chat => (
            chat_stream(&FIRST, &WORDS, "stop"),
            chat_stream(
                &FIRST.continuing(tokens_sent as u64),
                &WORDS[tokens_sent..],
                "stop",
            ),
        ),
        Api::Completions => (
            completions_stream(&FIRST, &WORDS),
            completions_stream(&FIRST.continuing(tokens_sent as u64), &WORDS[tokens_sent..]),
        ),
        Api::Generate => (
            generate_stream("gen-a1", 4, &STORY, &STORY_IDS),
            generate_stream(
                "gen-b2",
                4 + tokens_sent as u64,
                &STORY[tokens_sent..],
                &STORY_IDS[tokens_sent..],
            ),
        ),
    }
}

proptest! {
    #[test]
    fn any_split_gives_the_same_sent_and_the_same_splice(
        api in api_strategy(),
        k in 1usize..5,
        recorded_cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..12),
        continuing_cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..12),
    ) {
        let (unbroken, _) = streams(api, 0);
        let whole_sent = Sent::read(api, &unbroken[..k]);
        let tokens = usize::try_from(whole_sent.tokens_sent).unwrap();
        let (_, continuing) = streams(api, tokens);
        let recorded = concat(&unbroken[..k]);
        prop_assert_eq!(&Sent::read(api, &cut(&recorded, &recorded_cuts)), &whole_sent);
        let continuing = concat(&continuing);
        let whole = splice_whole(api, &whole_sent, &continuing);
        let pieces = cut(&continuing, &continuing_cuts);
        let pieces: Vec<&[u8]> = pieces.iter().map(|piece| &piece[..]).collect();
        prop_assert_eq!(splice_in_pieces(api, &whole_sent, &pieces), whole.clone());
        let mut client = recorded.clone();
        client.extend_from_slice(&whole);
        prop_assert_eq!(parse_stream(&client), parse_stream(&concat(&unbroken)));
        prop_assert_eq!(
            assemble(api, &pieces),
            assemble(api, &[&continuing])
        );
    }

    #[test]
    fn arbitrary_bytes_never_panic(
        api in api_strategy(),
        bytes in prop::collection::vec(any::<u8>(), 0..300),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..6),
    ) {
        let pieces = cut(&bytes, &cuts);
        let sent = Sent::read(api, &pieces);
        let _ = continuation(api, &bytes, &sent);
        let _ = as_stream(api, &bytes);
        let mut splicer = Splicer::new(api, &sent);
        for piece in &pieces {
            splicer.feed(piece);
        }
        splicer.finish();
        let mut assembler = Assembler::new(api);
        for piece in &pieces {
            assembler.feed(piece);
        }
        let _ = assembler.finish();
        let _ = is_error_event(&bytes);
    }

    #[test]
    fn hostile_json_never_panics(
        api in api_strategy(),
        value in hostile_json(),
        tokens in any::<u64>(),
    ) {
        let text = value;
        let body = format!(
            r#"{{"messages":{text},"prompt":{text},"text":{text},"input_ids":{text},"max_tokens":{text},"sampling_params":{text},"n":{text},"stream_options":{text}}}"#
        );
        let event = format!(
            "data: {{\"id\":{text},\"created\":{text},\"choices\":{text},\"usage\":{text},\"text\":{text},\"output_ids\":{text},\"meta_info\":{text}}}\n\n"
        );
        let events = [Bytes::from(event.clone())];
        let mut sent = Sent::read(api, &events);
        sent.tokens_sent = tokens;
        let _ = continuation(api, body.as_bytes(), &sent);
        let _ = as_stream(api, body.as_bytes());
        let mut splicer = Splicer::new(api, &sent);
        let out = splicer.feed(event.as_bytes());
        splicer.finish();
        prop_assert!(out.is_empty() || out.ends_with(b"\n\n"));
        let mut assembler = Assembler::new(api);
        assembler.feed(event.as_bytes());
        let _ = assembler.finish();
    }
}

/// JSON values made to hurt: huge and negative numbers, NaN-like strings,
/// deep nesting, the fields' names with the wrong types.
fn hostile_json() -> impl Strategy<Value = String> {
    let leaf = prop_oneof![
        Just("null".to_owned()),
        Just("1e400".to_owned()),
        Just("-1".to_owned()),
        Just("18446744073709551616".to_owned()),
        Just("18446744073709551615".to_owned()),
        Just("2.5".to_owned()),
        Just("\"NaN\"".to_owned()),
        Just("\"Infinity\"".to_owned()),
        Just("true".to_owned()),
        Just("\"\\ud800\"".to_owned()),
        Just("{\"type\":\"length\",\"length\":18446744073709551615}".to_owned()),
        any::<u64>().prop_map(|n| n.to_string()),
        "[a-z]{0,6}".prop_map(|s| format!("\"{s}\"")),
    ];
    leaf.prop_recursive(4, 32, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4)
                .prop_map(|items| format!("[{}]", items.join(","))),
            prop::collection::vec(
                (
                    prop_oneof![
                        Just("role"),
                        Just("content"),
                        Just("delta"),
                        Just("usage"),
                        Just("prompt_tokens"),
                        Just("completion_tokens"),
                        Just("finish_reason"),
                        Just("tool_calls"),
                        Just("index"),
                        Just("id"),
                        Just("length"),
                    ],
                    inner
                ),
                0..4
            )
            .prop_map(|members| {
                let members: Vec<String> = members
                    .iter()
                    .map(|(key, value)| format!("\"{key}\":{value}"))
                    .collect();
                format!("{{{}}}", members.join(","))
            }),
        ]
    })
}
