//! Structured output's cost: `cargo bench --bench structured`.
//!
//! 1. The grammar's work per token (compute the allowed set, build the logit bias, take in the
//!    token), in-process, on a synthetic byte-fallback vocabulary of the bench model's size
//!    (32768) and of gemma4's (262144), walking a JSON Schema with pseudo-random allowed tokens.
//! 2. Through the runner on the ~120M bench model: decode tok/s of a schema-constrained request
//!    against an unconstrained one (the same prompt, 64 tokens, greedy), medians of 3: the
//!    overhead as a share of a decode step (goal ≤ 10%).
//! 3. Drafting with and without a schema on the constructed pair of benches/speculative.rs
//!    (acceptance 1): decode tok/s without a drafter and with one, for free text and for the
//!    schema.

mod common;
use common::{complete_last, median, root, runner, spec_pair};

use serde_json::{json, Value};
use std::time::Instant;

fn schema() -> Value {
    json!({
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 12},
                "age": {"type": "integer", "minimum": 0, "maximum": 200},
                "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}}
            },
            "required": ["name", "age", "tags"],
            "additionalProperties": false
        },
        // Long enough that every measured request runs to num_predict.
        "minItems": 8
    })
}

/// A byte-fallback tokenizer.json of `size` tokens: 256 byte tokens, `<eos>`, and word pieces
/// (letters, digits, punctuation, some with a leading `▁`), as a real vocabulary has.
fn synthetic_tokenizer(size: usize) -> Value {
    let mut vocab = serde_json::Map::new();
    for b in 0..256u32 {
        vocab.insert(format!("<0x{b:02X}>"), json!(b));
    }
    vocab.insert("<eos>".into(), json!(256));
    let alphabet: Vec<char> =
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789{}[]\":,. -_"
            .chars()
            .collect();
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    while vocab.len() < size {
        let len = 1 + (next() % 8) as usize;
        let mut w: String = if next() % 3 == 0 {
            "▁".into()
        } else {
            String::new()
        };
        for _ in 0..len {
            w.push(alphabet[(next() % alphabet.len() as u64) as usize]);
        }
        let id = vocab.len();
        vocab.entry(w).or_insert(json!(id));
    }
    json!({
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}]},
        "added_tokens": [{"id": 256, "content": "<eos>", "special": true}],
        "model": {"type": "BPE", "vocab": vocab},
    })
}

/// Median microseconds per token of the grammar's work at a vocabulary of `size`.
fn grammar_cost(size: usize) -> f64 {
    let vocab = grammar::Vocabulary::new(&synthetic_tokenizer(size), size, &[256]).unwrap();
    let format = grammar::Format::Schema(schema());
    let mut c = vocab.constrain(&format).unwrap();
    let mut x = 12345u64;
    let mut times = Vec::new();
    for _ in 0..400 {
        let t = Instant::now();
        let allowed = c.allowed().unwrap();
        let bias = allowed.bias(size);
        std::hint::black_box(&bias);
        let mask = t.elapsed();
        // A pseudo-random allowed token other than EOS (a fresh value when only EOS is left).
        let choices: Vec<u32> = (0..size as u32)
            .filter(|&t| t != 256 && allowed.contains(t))
            .collect();
        let pick = if choices.is_empty() {
            None
        } else {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            Some(choices[(x >> 33) as usize % choices.len()])
        };
        let work = mask;
        // The scan for a random choice above is the benchmark's, not the runner's: only the
        // mask and the take-in are timed.
        let taken = Instant::now();
        match pick {
            Some(t) => c.consume(t).unwrap(),
            None => c = vocab.constrain(&format).unwrap(),
        }
        times.push((work + taken.elapsed()).as_secs_f64() * 1e6);
    }
    median(times)
}

/// Decode tok/s of one request (the runner's own EvalCount / EvalDuration) and its drafts'
/// acceptance.
fn decode(port: u16, format: Option<&Value>, seed: i64) -> (f64, f64) {
    let mut body = json!({
        "Prompt": format!("Request {seed}: list some people as JSON."),
        "Options": {"num_predict": 64, "temperature": 1.0, "top_k": 40, "seed": seed, "repeat_penalty": 1.0},
    });
    if let Some(f) = format {
        body["Format"] = f.clone();
    }
    let last = complete_last(port, &body);
    let n = last["EvalCount"].as_f64().unwrap_or(0.0);
    assert_eq!(n, 64.0, "a measured request ended early");
    let ns = last["EvalDuration"].as_f64().unwrap_or(f64::NAN);
    let d = last["DraftTokens"].as_f64().unwrap_or(0.0);
    let a = last["DraftAccepted"].as_f64().unwrap_or(0.0);
    (
        (n - 1.0) / (ns / 1e9),
        if d > 0.0 { a / d } else { f64::NAN },
    )
}

fn measure(port: u16, format: Option<&Value>) -> (f64, f64) {
    decode(port, format, 999);
    let runs: Vec<(f64, f64)> = (0..3).map(|i| decode(port, format, i)).collect();
    (
        median(runs.iter().map(|r| r.0).collect()),
        median(runs.iter().map(|r| r.1).collect()),
    )
}

fn main() {
    println!("Grammar work per token (allowed set + logit bias + take in), JSON Schema, median of 400 steps\n");
    println!("| vocabulary | µs per token |");
    println!("|---|---|");
    let mut per_token = Vec::new();
    for size in [32768, 262144] {
        let us = grammar_cost(size);
        per_token.push(us);
        println!("| {size} | {us:.0} |");
    }

    let model = root().join("target/bench-model");
    if !model.join("model.safetensors").exists() {
        eprintln!(
            "(no runner sections: run `cargo bench --bench generate` first; it writes the model)"
        );
        return;
    }
    let s = schema();
    let (_server, port) = runner(&model, &["--cache-budget", "0"]);
    let (free, _) = measure(port, None);
    let (constrained, _) = measure(port, Some(&s));
    println!("\n~120M bench model, 64 sampled tokens, decode tok/s (medians of 3)\n");
    println!("| free text | schema | overhead |");
    println!("|---|---|---|");
    println!(
        "| {free:.1} | {constrained:.1} | {:.1}% of a decode step |",
        100.0 * (1.0 - constrained / free)
    );
    println!(
        "(the grammar's own work at this vocabulary is {:.3}% of a {:.1} ms step)",
        100.0 * per_token[0] / (1e6 / free),
        1e3 / free
    );
    drop(_server);

    let Some((target, draft)) = spec_pair() else {
        return;
    };
    let mut rows = Vec::new();
    for with in [false, true] {
        let mut args = vec!["--cache-budget", "0", "--max-draft-depth", "6"];
        if with {
            args.extend(["--draft", draft.to_str().unwrap()]);
        }
        let (_server, port) = runner(&target, &args);
        rows.push((measure(port, None), measure(port, Some(&s))));
    }
    println!("\nDrafting (separate drafter, acceptance 1 unconstrained, adaptive depth), decode tok/s (medians of 3)\n");
    println!("| | no drafter | drafter | speed-up | acceptance |");
    println!("|---|---|---|---|---|");
    println!(
        "| free text | {:.1} | {:.1} | {:.2} | {:.2} |",
        rows[0].0 .0,
        rows[1].0 .0,
        rows[1].0 .0 / rows[0].0 .0,
        rows[1].0 .1
    );
    println!(
        "| schema | {:.1} | {:.1} | {:.2} | {:.2} |",
        rows[0].1 .0,
        rows[1].1 .0,
        rows[1].1 .0 / rows[0].1 .0,
        rows[1].1 .1
    );
}
