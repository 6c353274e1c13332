//! One greedy completion as the prefix-cache tests see it, compared with a cold runner's.
#![allow(dead_code)]

use super::{done_of, text_of, Runner};
use serde_json::json;

pub struct Turn {
    pub text: String,
    pub cached: u64,
    pub prompt_tokens: u64,
    pub draft_tokens: u64,
    pub logprobs: Vec<f64>,
}

/// `n` greedy tokens for `prompt`, with their logprobs when `logprobs` (which also turns
/// drafting off for the request).
pub fn ask_with(r: &Runner, prompt: &str, n: i64, logprobs: bool) -> Turn {
    let lines = r.complete(&json!({
        "Prompt": prompt,
        "Options": {"num_predict": n, "temperature": 0, "repeat_penalty": 1.0},
        "Logprobs": logprobs
    }));
    let d = done_of(&lines);
    Turn {
        text: text_of(&lines),
        cached: d["CachedTokens"].as_u64().unwrap(),
        prompt_tokens: d["PromptEvalCount"].as_u64().unwrap(),
        draft_tokens: d["DraftTokens"].as_u64().unwrap_or(0),
        logprobs: lines
            .iter()
            .filter_map(|l| l["Logprobs"].as_array())
            .flatten()
            .map(|e| e["logprob"].as_f64().unwrap())
            .collect(),
    }
}

/// A warm turn gives what a cold runner gives: the same text, logprobs within 1e-4.
pub fn same(warm: &Turn, cold: &Turn, what: &str) {
    assert_eq!(
        warm.text, cold.text,
        "{what}: text differs from a cold runner"
    );
    assert_eq!(warm.logprobs.len(), cold.logprobs.len(), "{what}");
    for (a, b) in warm.logprobs.iter().zip(&cold.logprobs) {
        assert!((a - b).abs() < 1e-4, "{what}: logprob {a} vs cold {b}");
    }
}

/// One sample of the runner's `/metrics`.
pub fn metric(r: &Runner, name: &str) -> f64 {
    let m = ureq::get(&r.url("/metrics"))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    m.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no metric {name}"))
}
