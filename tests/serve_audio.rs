//! Audio through `serve`, as the client APIs send it: ollama's `images` (ollama sends clips
//! there too), OpenAI's `input_audio` parts and its `/v1/audio/transcriptions` form. A raw
//! prompt with a clip and an image gives the greedy tokens transformers gives
//! (tests/fixtures/models/gemma4_audio_like); a model without audio refuses clips.

mod common;

use base64::Engine;
use common::serve::Serve;
use common::{fixture, golden};
use serde_json::{json, Value};

const FIXTURE: &str = "gemma4_audio_like";

fn bytes(name: &str) -> Vec<u8> {
    std::fs::read(fixture(FIXTURE).join("audio").join(name)).unwrap()
}

fn b64(name: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes(name))
}

fn greedy(n: i64) -> Value {
    json!({"temperature": 0, "num_predict": n, "repeat_penalty": 1.0})
}

fn with_audio() -> Serve {
    let s = Serve::start(&[]);
    s.create("aud", &format!("FROM {}\n", fixture(FIXTURE).display()));
    s.create(
        "vis",
        &format!("FROM {}\n", fixture("gemma4_vision_like").display()),
    );
    s
}

/// A multipart form of text fields and one file, as HTTP clients send it.
fn form(fields: &[(&str, &str)], file: Option<&[u8]>) -> (String, Vec<u8>) {
    let boundary = "----mlx-runner-test-boundary";
    let mut body = Vec::new();
    for (name, value) in fields {
        body.extend(
            format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n"
        )
            .bytes(),
        );
    }
    if let Some(data) = file {
        body.extend(format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"clip.wav\"\r\nContent-Type: audio/wav\r\n\r\n"
        ).bytes());
        body.extend_from_slice(data);
        body.extend(b"\r\n");
    }
    body.extend(format!("--{boundary}--\r\n").bytes());
    (format!("multipart/form-data; boundary={boundary}"), body)
}

fn transcribe(s: &Serve, fields: &[(&str, &str)], file: Option<&[u8]>) -> (u16, String, String) {
    let (content_type, body) = form(fields, file);
    let r = ureq::post(&s.url("/v1/audio/transcriptions"))
        .set("Content-Type", &content_type)
        .send_bytes(&body);
    let r = match r {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("{e}"),
    };
    let (code, kind) = (r.status(), r.content_type().to_string());
    (code, kind, r.into_string().unwrap())
}

#[test]
fn audio_reaches_the_model_through_every_api() {
    let s = with_audio();
    let show = s.post("/api/show", &json!({"model": "aud"})).1;
    let caps = show["capabilities"].as_array().unwrap();
    assert!(
        caps.contains(&json!("audio")) && caps.contains(&json!("vision")),
        "{show}"
    );
    // A raw prompt with its own tags: transformers' greedy tokens.
    let g = golden(FIXTURE);
    let want = g["runner.greedy"].to_vec::<i32>().unwrap();
    let tok = models::Tokenizer::load(&fixture(FIXTURE)).unwrap();
    let (code, v) = s.post(
        "/api/generate",
        &json!({"model": "aud", "raw": true, "stream": false, "logprobs": true,
            "prompt": "Hear [img-0] and see [img-1] now.",
            "images": [b64("speechlike.wav"), b64("wide.png")],
            "options": greedy(want.len() as i64)}),
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
    // Each API's way of sending a clip: its 25 soft tokens (and boa/eoa) are in the prompt.
    let wav = b64("speechlike.wav");
    let cases = [
        (
            "/api/chat",
            json!({"model": "aud", "stream": false, "options": greedy(2),
                "messages": [{"role": "user", "content": "What is said?", "images": [wav]}]}),
        ),
        (
            "/api/generate",
            json!({"model": "aud", "stream": false, "options": greedy(2),
                "prompt": "What is said?", "images": [b64("speech.mp3")]}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "aud", "max_tokens": 2, "temperature": 0,
                "messages": [{"role": "user", "content": [
                    {"type": "text", "text": "What is said?"},
                    {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}]}]}),
        ),
    ];
    for (path, body) in cases {
        let (code, v) = s.post(path, &body);
        assert_eq!(code, 200, "{path}: {v}");
        let prompt_tokens = v["prompt_eval_count"]
            .as_u64()
            .or(v["usage"]["prompt_tokens"].as_u64())
            .unwrap_or_else(|| panic!("{path}: no prompt token count in {v}"));
        assert!(prompt_tokens > 27, "{path}: {prompt_tokens} prompt tokens");
    }
    // OpenAI's transcription form: the answer's text, as JSON or plain text.
    let wav = bytes("speechlike.wav");
    let (code, kind, body) = transcribe(&s, &[("model", "aud")], Some(&wav));
    assert_eq!((code, kind.as_str()), (200, "application/json"), "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert!(v["text"].is_string(), "{v}");
    let (code, kind, text) = transcribe(
        &s,
        &[
            ("model", "aud"),
            ("response_format", "text"),
            ("language", "en"),
        ],
        Some(&wav),
    );
    assert_eq!((code, kind.as_str()), (200, "text/plain"), "{text}");
    assert_eq!(text, text.trim());
}

#[test]
fn audio_that_cannot_be_served_is_refused() {
    let s = with_audio();
    let wav = b64("speechlike.wav");
    let cases = [
        // Models without an audio tower: text only, and vision only.
        (
            "/api/chat",
            json!({"model": "gem", "stream": false,
                "messages": [{"role": "user", "content": "x", "images": [wav]}]}),
            "does not support audio",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "vis", "messages": [{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}]}]}),
            "does not support audio",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "aud", "messages": [{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"format": "wav"}}]}]}),
            "missing data",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "aud", "messages": [{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}}]}]}),
            "invalid input_audio base64 data",
        ),
        // A clip the runner cannot decode: its 400, through serve.
        (
            "/api/chat",
            json!({"model": "aud", "stream": false,
                "messages": [{"role": "user", "content": "x",
                    "images": [base64::engine::general_purpose::STANDARD.encode(b"RIFF\x24\0\0\0WAVEjunkjunkjunk")]}]}),
            "could not be read",
        ),
    ];
    for (path, body, needle) in cases {
        let (code, v) = s.post(path, &body);
        assert_eq!(code, 400, "{path} {needle}: {v}");
        assert!(v.to_string().contains(needle), "{path} {needle}: {v}");
    }
    let wav = bytes("speechlike.wav");
    for (fields, file, needle) in [
        (vec![], Some(&wav[..]), "model is required"),
        (vec![("model", "aud")], None, "file is required"),
        (
            vec![("model", "aud")],
            Some(&b""[..]),
            "audio file is empty",
        ),
        (
            vec![("model", "gem")],
            Some(&wav[..]),
            "does not support audio",
        ),
    ] {
        let (code, _, body) = transcribe(&s, &fields, file);
        assert_eq!(code, 400, "{needle}: {body}");
        assert!(body.contains(needle), "{needle}: {body}");
    }
    // Not a form at all.
    let (code, v) = s.post("/v1/audio/transcriptions", &json!({"model": "aud"}));
    assert_eq!(code, 400, "{v}");
    assert!(
        v.to_string().contains("failed to parse multipart form"),
        "{v}"
    );
}
