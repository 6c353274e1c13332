//! Images through the runner, sent as ollama's parent sends them (`[img-N]` tags in the prompt,
//! `Media` items with base64 bytes): the greedy continuation equals transformers' on the same
//! prompt (tests/fixtures/models/gemma4_vision_like), a prompt seen before reuses its encoded
//! images from the prefix cache (the tower does not run again) and one with other images does
//! not, and bad media gets a 400 naming what is wrong while the runner keeps serving.

mod common;

use base64::Engine;
use common::{answers_alone_and_together, done_of, fixture, golden, Runner};
use serde_json::{json, Value};

fn greedy(n: i64) -> Value {
    json!({"num_predict": n, "temperature": 0, "repeat_penalty": 1.0})
}

fn image(name: &str) -> String {
    let bytes = std::fs::read(fixture("gemma4_vision_like").join("images").join(name)).unwrap();
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn media(items: &[(&str, i64)]) -> Value {
    items
        .iter()
        .map(|&(name, id)| json!({"data": image(name), "id": id, "Kind": 0}))
        .collect()
}

const PROMPT: &str = "Describe [img-0] and [img-1] now.";

/// Images the runner has run through its vision tower so far (`/metrics`).
fn images_encoded(r: &Runner) -> u64 {
    let text = ureq::get(&r.url("/metrics"))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix("mlx_runner_images_encoded_total "))
        .and_then(|v| v.trim().parse().ok())
        .expect("the images counter")
}

#[test]
fn a_prompt_with_images_continues_as_transformers_does() {
    let g = golden("gemma4_vision_like");
    let want: Vec<u32> = g["runner.greedy"]
        .to_vec::<i32>()
        .unwrap()
        .into_iter()
        .map(|t| t as u32)
        .collect();
    let prompt_len = g["runner.input_ids"].shape()[0] as u64;
    let tok = models::Tokenizer::load(&fixture("gemma4_vision_like")).unwrap();
    let r = Runner::start("gemma4_vision_like", &[]);
    let body = json!({
        "Prompt": PROMPT,
        "Media": media(&[("wide.png", 0), ("small.png", 1)]),
        "Options": greedy(want.len() as i64),
        "Logprobs": true,
    });
    // Twice: the second time from the prefix cache, which holds both images (keyed by their
    // contents), so the tower does not run again; the answer is the same.
    let mut first_logprob = None;
    for round in 0..2u64 {
        let lines = r.complete(&body);
        let got: Vec<String> = lines
            .iter()
            .filter_map(|l| l["Logprobs"].as_array())
            .flatten()
            .map(|e| e["token"].as_str().unwrap_or_default().to_string())
            .collect();
        let expected: Vec<String> = want.iter().map(|&t| tok.token_text(t)).collect();
        assert_eq!(got, expected, "round {round}: greedy tokens");
        let done = done_of(&lines);
        assert_eq!(done["PromptEvalCount"], prompt_len, "round {round}");
        let cached = done["CachedTokens"].as_u64().unwrap();
        if round == 0 {
            assert_eq!(cached, 0);
        } else {
            assert!(cached >= prompt_len - 4, "round {round}: {cached} cached");
        }
        assert_eq!(images_encoded(&r), 2, "round {round}");
        first_logprob = lines
            .iter()
            .find_map(|l| l["Logprobs"][0]["logprob"].as_f64());
    }
    // The images swapped: the same number of tokens, another distribution.
    let swapped = r.complete(&json!({
        "Prompt": PROMPT,
        "Media": media(&[("small.png", 0), ("wide.png", 1)]),
        "Options": greedy(want.len() as i64),
        "Logprobs": true,
    }));
    assert_eq!(done_of(&swapped)["PromptEvalCount"], prompt_len);
    // Only the text before the first image is shared: both images are encoded again.
    assert!(done_of(&swapped)["CachedTokens"].as_u64().unwrap() < 8);
    assert_eq!(images_encoded(&r), 4);
    let other = swapped
        .iter()
        .find_map(|l| l["Logprobs"][0]["logprob"].as_f64());
    assert!(
        first_logprob.is_some() && other != first_logprob,
        "{first_logprob:?} {other:?}"
    );
}

/// Drafting over a prompt with images, by prompt lookup and by the gemma4 assistant (it drafts
/// from the target's hidden state and its KV over the images' bidirectional positions): the
/// same greedy tokens.
#[test]
fn drafting_over_images_keeps_the_greedy_output() {
    let g = golden("gemma4_vision_like");
    let want = g["runner.greedy"].to_vec::<i32>().unwrap();
    let tok = models::Tokenizer::load(&fixture("gemma4_vision_like")).unwrap();
    let assistant = fixture("gemma4_assistant");
    for draft in ["ngram", assistant.to_str().unwrap()] {
        let r = Runner::start("gemma4_vision_like", &["--draft", draft]);
        let lines = r.complete(&json!({
            "Prompt": PROMPT,
            "Media": media(&[("wide.png", 0), ("small.png", 1)]),
            "Options": greedy(want.len() as i64),
            "Logprobs": true,
        }));
        let got: Vec<String> = lines
            .iter()
            .filter_map(|l| l["Logprobs"].as_array())
            .flatten()
            .map(|e| e["token"].as_str().unwrap_or_default().to_string())
            .collect();
        let expected: Vec<String> = want.iter().map(|&t| tok.token_text(t as u32)).collect();
        assert_eq!(got, expected, "{draft}");
    }
}

#[test]
fn bad_media_is_refused_by_name() {
    let r = Runner::start("gemma4_vision_like", &[]);
    let png = image("wide.png");
    let truncated = {
        let b = base64::engine::general_purpose::STANDARD
            .decode(&png)
            .unwrap();
        base64::engine::general_purpose::STANDARD.encode(&b[..b.len() / 2])
    };
    let not_image = base64::engine::general_purpose::STANDARD.encode(b"just some text, not pixels");
    let wav = base64::engine::general_purpose::STANDARD.encode(b"RIFF\x24\0\0\0WAVEfmt \x10\0\0\0");
    let cut_jpeg = {
        let b = base64::engine::general_purpose::STANDARD
            .decode(image("photo.jpg"))
            .unwrap();
        base64::engine::general_purpose::STANDARD.encode(&b[..b.len() * 2 / 3])
    };
    let many: String = (0..17).map(|i| format!("[img-{i}]")).collect();
    let many_media: Vec<Value> = (0..17).map(|i| json!({"data": png, "id": i})).collect();
    let cases = [
        (
            json!({"Prompt": "look: [img-3]", "Media": [{"data": png, "id": 0}]}),
            "media item 0 is not named",
        ),
        (
            json!({"Prompt": "[img-0] and [img-1]", "Media": [{"data": png, "id": 0}]}),
            "no media item has the id 1",
        ),
        (
            json!({"Prompt": "[img-0]", "Media": [{"data": not_image, "id": 0}]}),
            "no format we decode",
        ),
        (
            json!({"Prompt": "[img-0]", "Media": [{"data": truncated, "id": 0}]}),
            "cannot decode",
        ),
        (
            json!({"Prompt": "[img-0]", "Media": [{"data": cut_jpeg, "id": 0}]}),
            "truncated",
        ),
        (
            json!({"Prompt": "[img-0]", "Media": [{"data": wav, "id": 0}]}),
            "is WAV audio",
        ),
        (
            json!({"Prompt": "[img-0]", "Media": [{"data": "%%%", "id": 0}]}),
            "not base64",
        ),
        (
            json!({"Prompt": "[img-0]", "Media": [{"id": 0}]}),
            "has no `data`",
        ),
        (
            json!({"Prompt": "[img-0]", "Media": [{"data": png, "id": 0}, {"data": png, "id": 0}]}),
            "two media items have the id 0",
        ),
        (
            json!({"Prompt": many, "Media": many_media}),
            "more than the 16",
        ),
    ];
    for (body, needle) in cases {
        let (code, e) = r.post_raw("/v1/completions", &body.to_string());
        let msg = e.as_str().unwrap_or_default().to_string();
        assert_eq!(code, 400, "{needle}: {e}");
        assert!(msg.contains(needle), "{needle}: {msg}");
    }
    // More image than the context holds (tall.png is 65 soft tokens).
    let small = Runner::start("gemma4_vision_like", &["--ctx-size", "64"]);
    let (code, e) = small.post_raw(
        "/v1/completions",
        &json!({"Prompt": "[img-0]", "Media": [{"data": image("tall.png"), "id": 0}]}).to_string(),
    );
    assert_eq!(code, 400, "{e}");
    assert!(
        e.as_str()
            .unwrap_or_default()
            .contains("prompt is too long"),
        "{e}"
    );
    // Still serving, images and text alike.
    let lines = r.complete(
        &json!({"Prompt": "[img-0]", "Media": [{"data": png, "id": 0}], "Options": greedy(2)}),
    );
    assert_eq!(done_of(&lines)["EvalCount"], 2);
    let lines = r.complete(&json!({"Prompt": "hello", "Options": greedy(2)}));
    assert_eq!(done_of(&lines)["EvalCount"], 2);
}

/// Requests with images batch with text requests and with each other, a grammar applies after
/// an image: each gets what it gets alone, with small prefill chunks (an image's 60-odd soft
/// tokens go in one chunk past the chunk size; other rows' chunks share its passes).
#[test]
fn image_requests_batch_and_take_grammars() {
    let schema = json!({"type": "object", "properties": {"color": {"type": "string", "maxLength": 6}},
        "required": ["color"]});
    let requests = [
        json!({"Prompt": PROMPT, "Media": media(&[("wide.png", 0), ("small.png", 1)]),
            "Options": greedy(6), "Logprobs": true}),
        json!({"Prompt": "The quick brown fox", "Options": greedy(6), "Logprobs": true}),
        json!({"Prompt": "Colour of [img-0]?", "Media": media(&[("tall.png", 0)]),
            "Options": greedy(24), "Format": schema, "Logprobs": true}),
        json!({"Prompt": "[img-0] [img-0] twice", "Media": media(&[("small.png", 0)]),
            "Options": greedy(6), "Logprobs": true}),
    ];
    let alone = answers_alone_and_together("gemma4_vision_like", &requests);
    // The grammar held after the image.
    let v: Value =
        serde_json::from_str(&alone[2].0).unwrap_or_else(|e| panic!("{e}: {:?}", alone[2].0));
    assert!(v["color"].is_string(), "{v}");
}
