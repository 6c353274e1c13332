//! Audio through the runner, sent as ollama's parent sends it (an `[img-N]` tag in the prompt
//! and a `Media` item holding the file's bytes, WAV or MP3 or FLAC or Ogg): the greedy
//! continuation of a prompt with a clip and an image equals transformers' on the same prompt
//! (tests/fixtures/models/gemma4_audio_like), the prefix cache keeps the encoded clip (the tower
//! does not run again), drafting and batching leave the output alone, and bad clips get a 400
//! naming what is wrong while the runner keeps serving.

mod common;

use base64::Engine;
use common::{answers_alone_and_together, done_of, fixture, golden, outcome, Runner};
use serde_json::{json, Value};

const MODEL: &str = "gemma4_audio_like";
const PROMPT: &str = "Hear [img-0] and see [img-1] now.";

fn greedy(n: i64) -> Value {
    json!({"num_predict": n, "temperature": 0, "repeat_penalty": 1.0})
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn file(name: &str) -> Vec<u8> {
    std::fs::read(fixture(MODEL).join("audio").join(name)).unwrap()
}

fn media(items: &[(&str, i64)]) -> Value {
    items
        .iter()
        .map(|&(name, id)| json!({"data": b64(&file(name)), "id": id}))
        .collect()
}

fn counter(r: &Runner, name: &str) -> u64 {
    let text = ureq::get(&r.url("/metrics"))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name}"))
}

fn tokens(lines: &[Value]) -> Vec<String> {
    lines
        .iter()
        .filter_map(|l| l["Logprobs"].as_array())
        .flatten()
        .map(|e| e["token"].as_str().unwrap_or_default().to_string())
        .collect()
}

fn expected() -> (Vec<String>, u64) {
    let g = golden(MODEL);
    let tok = models::Tokenizer::load(&fixture(MODEL)).unwrap();
    let want = g["runner.greedy"]
        .to_vec::<i32>()
        .unwrap()
        .into_iter()
        .map(|t| tok.token_text(t as u32))
        .collect();
    (want, g["runner.input_ids"].shape()[0] as u64)
}

#[test]
fn a_prompt_with_a_clip_continues_as_transformers_does() {
    let (want, prompt_len) = expected();
    let r = Runner::start(MODEL, &[]);
    let body = json!({
        "Prompt": PROMPT,
        "Media": media(&[("speechlike.wav", 0), ("wide.png", 1)]),
        "Options": greedy(want.len() as i64),
        "Logprobs": true,
    });
    // Twice: the second time from the prefix cache (the clip and the image keyed by their
    // contents), so neither tower runs again.
    for round in 0..2 {
        let lines = r.complete(&body);
        assert_eq!(tokens(&lines), want, "round {round}");
        let done = done_of(&lines);
        assert_eq!(done["PromptEvalCount"], prompt_len, "round {round}");
        if round == 1 {
            assert!(done["CachedTokens"].as_u64().unwrap() >= prompt_len - 4);
        }
        assert_eq!(counter(&r, "mlx_runner_audio_encoded_total"), 1);
        assert_eq!(counter(&r, "mlx_runner_images_encoded_total"), 1);
    }
    // The same speech through a lossy codec is other bytes: a new clip, encoded.
    let lines = r.complete(&json!({
        "Prompt": "[img-0]",
        "Media": media(&[("speech.ogg", 0)]),
        "Options": greedy(2),
    }));
    assert_eq!(done_of(&lines)["EvalCount"], 2);
    assert_eq!(counter(&r, "mlx_runner_audio_encoded_total"), 2);
}

/// Drafting over a prompt with a clip and an image, by prompt lookup and by the gemma4
/// assistant (it drafts from the target's hidden state and its KV over the media positions):
/// the same greedy tokens, and drafts were made.
#[test]
fn drafting_over_audio_keeps_the_greedy_output() {
    let (want, _) = expected();
    let assistant = fixture("gemma4_assistant");
    for draft in ["ngram", assistant.to_str().unwrap()] {
        let r = Runner::start(MODEL, &["--draft", draft]);
        let lines = r.complete(&json!({
            "Prompt": PROMPT,
            "Media": media(&[("speechlike.wav", 0), ("wide.png", 1)]),
            "Options": greedy(want.len() as i64),
            "Logprobs": true,
        }));
        assert_eq!(tokens(&lines), want, "{draft}");
        if draft != "ngram" {
            assert!(counter(&r, "mlx_runner_draft_tokens_total") > 0, "{draft}");
        }
    }
}

/// A clip that arrives while another sequence decodes is encoded a few layers per step beside
/// it (`mlx_runner_encode_steps_total`), not in one stall; both answers are what they are alone.
#[test]
fn a_clip_encodes_beside_a_decoding_sequence() {
    use std::io::BufRead;
    let (want, _) = expected();
    let text = json!({"Prompt": "The quick brown fox", "Options": greedy(200), "Logprobs": true});
    let solo = Runner::start(MODEL, &["--parallel", "1"]);
    let text_alone = outcome(&solo.complete(&text));
    drop(solo);
    let r = std::sync::Arc::new(Runner::start(MODEL, &["--parallel", "2"]));
    let resp = ureq::post(&r.url("/v1/completions"))
        .send_string(&text.to_string())
        .unwrap();
    let mut lines = std::io::BufReader::new(resp.into_reader()).lines();
    // The text sequence is decoding once its first token is out.
    let first: Value = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
    let clip = {
        let r = std::sync::Arc::clone(&r);
        std::thread::spawn(move || {
            r.complete(&json!({
                "Prompt": PROMPT,
                "Media": media(&[("speechlike.wav", 0), ("wide.png", 1)]),
                "Options": greedy(want.len() as i64),
                "Logprobs": true,
            }))
        })
    };
    let mut text_lines = vec![first];
    text_lines.extend(lines.map(|l| serde_json::from_str(&l.unwrap()).unwrap()));
    assert_eq!(tokens(&clip.join().unwrap()), expected().0);
    let (got, lps) = outcome(&text_lines);
    assert_eq!(got, text_alone.0);
    for (a, b) in lps.iter().zip(&text_alone.1) {
        assert!((a - b).abs() < 1e-4, "{a} vs {b}");
    }
    assert!(counter(&r, "mlx_runner_encode_steps_total") >= 1);
}

/// Requests with clips batch with each other and with text, in small prefill chunks, and a
/// grammar applies after a clip: each gets what it gets alone.
#[test]
fn audio_requests_batch_and_take_grammars() {
    let schema = json!({"type": "object", "properties": {"said": {"type": "string", "maxLength": 6}},
        "required": ["said"]});
    let requests = [
        json!({"Prompt": PROMPT, "Media": media(&[("speechlike.wav", 0), ("wide.png", 1)]),
            "Options": greedy(6), "Logprobs": true}),
        json!({"Prompt": "The quick brown fox", "Options": greedy(6), "Logprobs": true}),
        json!({"Prompt": "What is said in [img-0]?", "Media": media(&[("odd.wav", 0)]),
            "Options": greedy(24), "Format": schema, "Logprobs": true}),
        json!({"Prompt": "[img-0][img-1]", "Media": media(&[("short.wav", 0), ("stereo.flac", 1)]),
            "Options": greedy(6), "Logprobs": true}),
    ];
    let alone = answers_alone_and_together(MODEL, &requests);
    let v: Value =
        serde_json::from_str(&alone[2].0).unwrap_or_else(|e| panic!("{e}: {:?}", alone[2].0));
    assert!(v["said"].is_string(), "{v}");
}

fn wav_header(samples: u32) -> Vec<u8> {
    let mut h = b"RIFF".to_vec();
    h.extend((36 + 2 * samples).to_le_bytes());
    h.extend(b"WAVEfmt ");
    h.extend(16u32.to_le_bytes());
    h.extend(1u16.to_le_bytes());
    h.extend(1u16.to_le_bytes());
    h.extend(16_000u32.to_le_bytes());
    h.extend(32_000u32.to_le_bytes());
    h.extend(2u16.to_le_bytes());
    h.extend(16u16.to_le_bytes());
    h.extend(b"data");
    h.extend((2 * samples).to_le_bytes());
    h
}

#[test]
fn bad_clips_are_refused_by_name() {
    let r = Runner::start(MODEL, &[]);
    let wav = file("speechlike.wav");
    let mut long = wav_header(31 * 16_000);
    long.resize(long.len() + 2 * 31 * 16_000, 0);
    let mut tiny = wav_header(100);
    tiny.resize(tiny.len() + 200, 0);
    let cases = [
        (b64(&wav[..30]), "could not be read"),
        (b64(b"RIFF\x24\0\0\0WAVEjunkjunkjunk"), "could not be read"),
        (b64(&long), "longer than 30 s"),
        (b64(&tiny), "shorter than one"),
    ];
    for (data, needle) in cases {
        let body = json!({"Prompt": "[img-0]", "Media": [{"data": data, "id": 0}]});
        let (code, e) = r.post_raw("/v1/completions", &body.to_string());
        let msg = e.as_str().unwrap_or_default().to_string();
        assert_eq!(code, 400, "{needle}: {e}");
        assert!(
            msg.contains("media item 0") && msg.contains(needle),
            "{needle}: {msg}"
        );
    }
    // A text-only model refuses media.
    let text = Runner::start("gemma4_e2b_like", &[]);
    let (code, e) = text.post_raw(
        "/v1/completions",
        &json!({"Prompt": "[img-0]", "Media": [{"data": b64(&wav), "id": 0}]}).to_string(),
    );
    assert_eq!(code, 400, "{e}");
    assert!(
        e.as_str().unwrap_or_default().contains("does not support"),
        "{e}"
    );
    // Still serving.
    let lines = r.complete(
        &json!({"Prompt": "[img-0]", "Media": media(&[("odd.wav", 0)]), "Options": greedy(2)}),
    );
    assert_eq!(done_of(&lines)["EvalCount"], 2);
}
