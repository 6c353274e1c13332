//! Images through `serve`, as the client APIs send them: ollama's `images` (chat messages and
//! generate), OpenAI's `image_url` data URLs, Anthropic's base64 image blocks and the Responses
//! API's `input_image`, turned into `[img-N]` tags and media for the runner (as ollama's
//! server does). A raw prompt with images gives the greedy tokens transformers gives
//! (tests/fixtures/models/gemma4_vision_like); a model without vision refuses images.

mod common;

use base64::Engine;
use common::serve::Serve;
use common::{fixture, golden};
use serde_json::{json, Value};

fn b64(name: &str) -> String {
    let bytes = std::fs::read(fixture("gemma4_vision_like").join("images").join(name)).unwrap();
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn greedy(n: i64) -> Value {
    json!({"temperature": 0, "num_predict": n, "repeat_penalty": 1.0})
}

fn with_vision() -> Serve {
    let s = Serve::start(&[]);
    s.create(
        "vis",
        &format!("FROM {}\n", fixture("gemma4_vision_like").display()),
    );
    s
}

#[test]
fn images_reach_the_model_through_every_api() {
    let s = with_vision();
    let show = s.post("/api/show", &json!({"model": "vis"})).1;
    assert!(
        show["capabilities"]
            .as_array()
            .unwrap()
            .contains(&json!("vision")),
        "{show}"
    );
    // A raw prompt with its own tags: transformers' greedy tokens (as the runner gives them).
    let g = golden("gemma4_vision_like");
    let want = g["runner.greedy"].to_vec::<i32>().unwrap();
    let tok = models::Tokenizer::load(&fixture("gemma4_vision_like")).unwrap();
    let (code, v) = s.post(
        "/api/generate",
        &json!({"model": "vis", "raw": true, "stream": false, "logprobs": true,
            "prompt": "Describe [img-0] and [img-1] now.",
            "images": [b64("wide.png"), b64("small.png")], "options": greedy(want.len() as i64)}),
    );
    assert_eq!(code, 200, "{v}");
    let got: Vec<String> = v["logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["token"].as_str().unwrap().to_string())
        .collect();
    let expected: Vec<String> = want.iter().map(|&t| tok.token_text(t as u32)).collect();
    assert_eq!(got, expected);
    assert_eq!(
        v["prompt_eval_count"].as_u64().unwrap(),
        g["runner.input_ids"].shape()[0] as u64
    );
    // Each API's way of sending an image: the image's 60 soft tokens (and its boi/eoi) are in
    // the prompt.
    let png = b64("wide.png");
    let url = format!("data:image/png;base64,{png}");
    let cases = [
        (
            "/api/chat",
            json!({"model": "vis", "stream": false, "options": greedy(2),
                "messages": [{"role": "user", "content": "What is this?", "images": [png]}]}),
        ),
        (
            "/api/generate",
            json!({"model": "vis", "stream": false, "options": greedy(2),
                "prompt": "What is this?", "images": [png]}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "vis", "max_tokens": 2, "temperature": 0,
                "messages": [{"role": "user", "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": url}}]}]}),
        ),
        (
            "/v1/messages",
            json!({"model": "vis", "max_tokens": 2, "temperature": 0,
                "messages": [{"role": "user", "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}},
                    {"type": "text", "text": "What is this?"}]}]}),
        ),
        (
            "/v1/responses",
            json!({"model": "vis", "max_output_tokens": 2, "temperature": 0,
                "input": [{"role": "user", "content": [
                    {"type": "input_text", "text": "What is this?"},
                    {"type": "input_image", "image_url": url}]}]}),
        ),
    ];
    for (path, body) in cases {
        let (code, v) = s.post(path, &body);
        assert_eq!(code, 200, "{path}: {v}");
        let prompt_tokens = v["prompt_eval_count"]
            .as_u64()
            .or(v["usage"]["prompt_tokens"].as_u64())
            .or(v["usage"]["input_tokens"].as_u64())
            .unwrap_or_else(|| panic!("{path}: no prompt token count in {v}"));
        assert!(prompt_tokens > 62, "{path}: {prompt_tokens} prompt tokens");
    }
}

#[test]
fn images_that_cannot_be_served_are_refused() {
    let s = with_vision();
    let png = b64("wide.png");
    let cases = [
        // A model without vision.
        (
            "/api/chat",
            json!({"model": "gem", "stream": false,
                "messages": [{"role": "user", "content": "x", "images": [png]}]}),
            "does not support images",
        ),
        (
            "/api/chat",
            json!({"model": "vis", "stream": false,
                "messages": [{"role": "user", "content": "x", "images": ["%%%"]}]}),
            "not valid base64",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "vis", "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]}),
            "image URLs are not currently supported",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "vis", "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/tiff;base64,aGk="}}]}]}),
            "invalid image input",
        ),
        // Bytes that are no image: the runner's 400, through serve.
        (
            "/api/chat",
            json!({"model": "vis", "stream": false,
                "messages": [{"role": "user", "content": "x", "images": ["aGVsbG8="]}]}),
            "no format we decode",
        ),
    ];
    for (path, body, needle) in cases {
        let (code, v) = s.post(path, &body);
        assert_eq!(code, 400, "{path} {needle}: {v}");
        assert!(v.to_string().contains(needle), "{path} {needle}: {v}");
    }
}
