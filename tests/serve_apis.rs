//! What client libraries lean on, through `serve` over loopback: JSON mode answers objects,
//! schemas without `additionalProperties` give exactly their keys, fields we do not implement
//! are refused rather than ignored, endpoints we do not serve answer in their API's shape, and
//! Anthropic's Messages API streams its events in order.

mod common;

use common::serve::Serve;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};

fn sampled(seed: u64, n: i64) -> Value {
    json!({"temperature": 0.9, "seed": seed, "num_predict": n})
}

#[test]
fn json_mode_is_an_object_and_schemas_have_exactly_their_keys() {
    let s = Serve::start(&[]);
    // A pydantic model's schema: no additionalProperties.
    let person = json!({"title": "Person", "type": "object", "properties": {
        "name": {"title": "Name", "type": "string", "maxLength": 12},
        "age": {"title": "Age", "type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"]});
    for model in ["gem", "glm"] {
        let (mut objects, mut people) = (0, 0);
        for seed in 0..12 {
            let chat = |format: &Value, n: i64| {
                let (code, v) = s.post(
                    "/api/chat",
                    &json!({"model": model, "messages": [{"role": "user", "content": "Give JSON"}],
                        "format": format, "stream": false, "think": false, "options": sampled(seed, n)}),
                );
                assert_eq!(code, 200, "{v}");
                v
            };
            let v = chat(&json!("json"), 120);
            let text = v["message"]["content"].as_str().unwrap().to_string();
            assert!(text.starts_with('{'), "{model} seed {seed}: {text}");
            if v["done_reason"] == "stop" {
                let parsed: Value = serde_json::from_str(&text).unwrap();
                assert!(parsed.is_object(), "{model} seed {seed}: {text}");
                objects += 1;
            }
            let v = chat(&person, 80);
            let text = v["message"]["content"].as_str().unwrap();
            assert_eq!(
                v["done_reason"], "stop",
                "{model} seed {seed} ran on: {text}"
            );
            let p: Value = serde_json::from_str(text).unwrap();
            let keys: Vec<&String> = p.as_object().unwrap().keys().collect();
            assert_eq!(keys, ["name", "age"], "{model} seed {seed}: {text}");
            people += 1;
        }
        assert!(objects > 0, "{model}: no JSON-mode answer completed");
        assert_eq!(people, 12);
    }
    // OpenAI's json_object and json_schema the same way.
    for seed in 0..4 {
        let (code, v) = s.post(
            "/v1/chat/completions",
            &json!({"model": "gem", "messages": [{"role": "user", "content": "JSON"}], "seed": seed,
                "max_tokens": 80, "response_format": {"type": "json_schema",
                    "json_schema": {"name": "person", "schema": person, "strict": true}}}),
        );
        assert_eq!(code, 200, "{v}");
        let p: Value =
            serde_json::from_str(v["choices"][0]["message"]["content"].as_str().unwrap()).unwrap();
        assert_eq!(p.as_object().unwrap().len(), 2, "{p}");
    }
}

#[test]
fn fields_we_do_not_implement_are_refused() {
    let s = Serve::start(&[]);
    let base =
        json!({"model": "gem", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    for (k, val, needle) in [
        ("n", json!(2), "n must be 1"),
        ("logit_bias", json!({"15": 5}), "logit_bias"),
    ] {
        let mut b = base.clone();
        b[k] = val;
        let (code, v) = s.post("/v1/chat/completions", &b);
        assert_eq!(code, 400, "{v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(needle),
            "{v}"
        );
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }
    let mut one = base.clone();
    one["n"] = json!(1);
    one["logit_bias"] = json!({});
    assert_eq!(s.post("/v1/chat/completions", &one).0, 200);
    let (code, v) = s.post(
        "/v1/completions",
        &json!({"model": "gem", "prompt": "x", "echo": true}),
    );
    assert_eq!(code, 400, "{v}");
}

#[test]
fn endpoints_we_do_not_serve_answer_in_their_apis_shape() {
    let s = Serve::start(&[]);
    for path in ["/api/embed", "/api/embeddings"] {
        let (code, v) = s.post(
            path,
            &json!({"model": "gem", "input": "hello", "prompt": "hello"}),
        );
        assert_eq!(code, 400, "{path}: {v}");
        let e = v["error"].as_str().unwrap();
        assert!(e.contains("does not support embeddings"), "{e}");
        let (code, v) = s.post(path, &json!({"model": "nope", "input": "x"}));
        assert_eq!(code, 404, "{v}");
        assert!(!v["error"].as_str().unwrap().is_empty());
    }
    let (code, v) = s.post("/v1/embeddings", &json!({"model": "glm", "input": "hello"}));
    assert_eq!(code, 400, "{v}");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("does not support embeddings"));
    for path in ["/api/pull", "/api/push"] {
        let (code, v) = s.post(path, &json!({"model": "gemma4"}));
        assert_eq!(code, 400, "{v}");
        assert!(v["error"].as_str().unwrap().contains("no registry"), "{v}");
    }
    // Unknown paths and methods: never an empty body.
    let (code, v) = s.post("/v1/audio/speech", &json!({"model": "gem", "input": "hi"}));
    assert_eq!(code, 404);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("/v1/audio/speech"),
        "{v}"
    );
    let (code, v) = s.send("GET", "/api/nothing", "");
    assert_eq!(code, 404);
    assert!(v["error"].as_str().unwrap().contains("/api/nothing"), "{v}");
    let (code, v) = s.send("GET", "/api/chat", "");
    assert_eq!(code, 405);
    assert!(v["error"].as_str().unwrap().contains("GET"), "{v}");
    let (code, v) = s.post("/v1/messages/batches", &json!({}));
    assert_eq!(code, 404);
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], "not_found_error", "{v}");
}

/// An Anthropic SSE stream's (event, data) pairs.
fn events(s: &Serve, body: &Value) -> Vec<(String, Value)> {
    events_at(s, "/v1/messages", body)
}

#[test]
fn anthropic_messages_stream_their_events_in_order() {
    let s = Serve::start(&[]);
    let body = json!({"model": "gem", "max_tokens": 6, "temperature": 0,
        "messages": [{"role": "user", "content": "Hello"}]});
    let (code, whole) = s.post("/v1/messages", &body);
    assert_eq!(code, 200, "{whole}");
    assert_eq!(whole["type"], "message");
    assert!(whole["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(whole["usage"]["output_tokens"], 6);
    assert_eq!(whole["stop_reason"], "max_tokens");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let ev = events(&s, &streamed);
    let names: Vec<&str> = ev.iter().map(|(e, _)| e.as_str()).collect();
    assert_eq!(names[..3], ["message_start", "ping", "content_block_start"]);
    assert_eq!(
        names[names.len() - 3..],
        ["content_block_stop", "message_delta", "message_stop"]
    );
    for (e, d) in &ev {
        assert_eq!(d["type"], e.as_str(), "each event's data names it");
    }
    let text: String = ev
        .iter()
        .filter_map(|(_, d)| d["delta"]["text"].as_str())
        .collect();
    assert_eq!(text, whole["content"][0]["text"].as_str().unwrap());
    let delta = &ev[ev.len() - 2].1;
    assert_eq!(delta["delta"]["stop_reason"], "max_tokens");
    assert_eq!(delta["usage"]["output_tokens"], 6);

    // A forced tool call streams as a tool_use block with its input as JSON.
    let tools = json!([{"name": "get_weather", "input_schema": {"type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}]);
    let ev = events(
        &s,
        &json!({"model": "gem", "max_tokens": 200, "seed": 3, "stream": true, "tools": tools,
            "tool_choice": {"type": "any"}, "messages": [{"role": "user", "content": "Weather?"}]}),
    );
    let start = ev
        .iter()
        .find(|(e, d)| e == "content_block_start" && d["content_block"]["type"] == "tool_use")
        .expect("no tool_use block");
    assert_eq!(start.1["content_block"]["name"], "get_weather");
    let input: String = ev
        .iter()
        .filter_map(|(_, d)| d["delta"]["partial_json"].as_str())
        .collect();
    let input: Value = serde_json::from_str(&input).unwrap();
    assert!(input["city"].is_string(), "{input}");
    assert_eq!(ev[ev.len() - 2].1["delta"]["stop_reason"], "tool_use");

    // Errors in Anthropic's shape.
    let (code, v) = s.post("/v1/messages", &json!({"model": "gem", "messages": []}));
    assert_eq!(code, 400);
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("max_tokens"));
    let (code, v) = s.post(
        "/v1/messages/count_tokens",
        &json!({"model": "gem", "messages": [{"role": "user", "content": "Hello"}]}),
    );
    assert_eq!(code, 200, "{v}");
    assert!(v["input_tokens"].as_u64().unwrap() > 1, "{v}");
}

/// An SSE stream's (event, data) pairs from `path`.
fn events_at(s: &Serve, path: &str, body: &Value) -> Vec<(String, Value)> {
    let r = ureq::post(&s.url(path))
        .send_string(&body.to_string())
        .unwrap();
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let mut out = Vec::new();
    let mut event = String::new();
    for line in BufReader::new(r.into_reader()).lines() {
        let line = line.unwrap();
        if let Some(e) = line.strip_prefix("event: ") {
            event = e.to_string();
        } else if let Some(d) = line.strip_prefix("data: ") {
            out.push((event.clone(), serde_json::from_str(d).unwrap()));
        }
    }
    out
}

#[test]
fn the_responses_api_streams_numbered_events_and_function_calls() {
    let s = Serve::start(&[]);
    let body = json!({"model": "gem", "input": "Hello", "max_output_tokens": 6, "temperature": 0});
    let (code, whole) = s.post("/v1/responses", &body);
    assert_eq!(code, 200, "{whole}");
    assert_eq!(whole["object"], "response");
    assert_eq!(whole["status"], "incomplete");
    assert_eq!(whole["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(whole["usage"]["output_tokens"], 6);
    let text = whole["output"][0]["content"][0]["text"].as_str().unwrap();
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let ev = events_at(&s, "/v1/responses", &streamed);
    let names: Vec<&str> = ev.iter().map(|(e, _)| e.as_str()).collect();
    assert_eq!(
        names[..4],
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added"
        ]
    );
    assert_eq!(
        names[names.len() - 4..],
        [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.incomplete"
        ]
    );
    for (i, (e, d)) in ev.iter().enumerate() {
        assert_eq!(d["type"], e.as_str());
        assert_eq!(d["sequence_number"], i, "{e}");
    }
    let deltas: String = ev
        .iter()
        .filter(|(e, _)| e == "response.output_text.delta")
        .filter_map(|(_, d)| d["delta"].as_str())
        .collect();
    assert_eq!(deltas, text);
    // A required call: a function_call item with its arguments as JSON.
    let tools = json!([{"type": "function", "name": "get_weather", "parameters": {"type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}]);
    let call = json!({"model": "gem", "input": "Weather?", "tools": tools, "tool_choice": "required",
        "max_output_tokens": 200, "seed": 3});
    let (code, r) = s.post("/v1/responses", &call);
    assert_eq!(code, 200, "{r}");
    assert_eq!(r["status"], "completed");
    let item = &r["output"][0];
    assert_eq!(item["type"], "function_call", "{r}");
    let args: Value = serde_json::from_str(item["arguments"].as_str().unwrap()).unwrap();
    assert!(args["city"].is_string());
    let mut streamed = call.clone();
    streamed["stream"] = json!(true);
    let ev = events_at(&s, "/v1/responses", &streamed);
    let done = ev
        .iter()
        .find(|(e, _)| e == "response.function_call_arguments.done")
        .expect("no function call streamed");
    assert_eq!(done.1["arguments"], item["arguments"]);
    assert_eq!(ev.last().unwrap().0, "response.completed");
    // Its output back in the input.
    let (code, r) = s.post(
        "/v1/responses",
        &json!({"model": "gem", "tools": tools, "max_output_tokens": 4, "input": [
            {"role": "user", "content": "Weather?"}, item,
            {"type": "function_call_output", "call_id": item["call_id"], "output": "sunny"}]}),
    );
    assert_eq!(code, 200, "{r}");
    let (code, v) = s.post(
        "/v1/responses",
        &json!({"model": "gem", "input": "x", "previous_response_id": "resp_1"}),
    );
    assert_eq!(code, 400);
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("not stored"));
}
