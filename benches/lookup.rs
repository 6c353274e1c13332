//! Prompt lookup (`--draft ngram`) against plain decoding: `cargo bench --bench lookup`.
//!
//! On the benchmark model (target/bench-model, see benches/generate.rs), through the runner as
//! in service: one runner without drafting and one with `--draft ngram` (adaptive depth, up to
//! 6), their requests interleaved round by round so both see the same machine; decode tokens/s
//! from each runner's own `EvalCount` and `EvalDuration`, medians of `LOOKUP_ROUNDS` (5), after
//! two warm-up requests each (the depth controller learns, as over a runner's life).
//!
//! Two kinds of text. *Repeats*: greedy decoding, where the random model's answer settles into
//! repeating spans of its context, as an answer that copies its input does (code edits, quotes,
//! JSON echoed back): lookups find the continuation. *No repeats*: sampled text (temperature 1,
//! top-k 40, seeded), in which n-grams recur only by chance: lookups seldom find anything, and
//! the depth controller must keep drafting from costing anything.

mod common;
use common::{complete_last, median, root, runner};

use serde_json::json;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// (decode tok/s, drafted, accepted) of one request.
fn request(port: u16, prompt: &str, tokens: usize, sampled: Option<u64>) -> (f64, f64, f64) {
    let options = match sampled {
        Some(seed) => json!({"num_predict": tokens, "temperature": 1.0, "top_k": 40,
                             "seed": seed, "repeat_penalty": 1.0}),
        None => json!({"num_predict": tokens, "temperature": 0}),
    };
    let last = complete_last(port, &json!({"Prompt": prompt, "Options": options}));
    let n = last["EvalCount"].as_f64().unwrap_or(0.0);
    let ns = last["EvalDuration"].as_f64().unwrap_or(f64::NAN);
    (
        (n - 1.0) / (ns / 1e9),
        last["DraftTokens"].as_f64().unwrap_or(0.0),
        last["DraftAccepted"].as_f64().unwrap_or(0.0),
    )
}

fn main() {
    let model = root().join("target/bench-model");
    if !model.join("model.safetensors").exists() {
        eprintln!("run `cargo bench --bench generate` first (it writes the benchmark model)");
        return;
    }
    let rounds = env_or("LOOKUP_ROUNDS", 5);
    let tokens = env_or("LOOKUP_TOKENS", 160);
    // Every request starts cold: the measurement is decoding, not the prefix cache.
    let (_plain, plain) = runner(&model, &["--draft-depth", "0", "--cache-budget", "0"]);
    let (_lookup, lookup) = runner(
        &model,
        &[
            "--draft",
            "ngram",
            "--max-draft-depth",
            "6",
            "--cache-budget",
            "0",
        ],
    );
    println!("\nPrompt lookup vs plain decoding, ~120M float32 gemma4-shaped model, {tokens} new tokens, medians of {rounds} interleaved rounds\n");
    println!("| text | plain tok/s | lookup tok/s | ratio | drafted / request | accepted |");
    println!("|---|---|---|---|---|---|");
    for (what, sampled) in [("repeats (greedy)", false), ("no repeats (sampled)", true)] {
        let prompt =
            "The quick brown fox jumps over the lazy dog. Tell me more about the fox and the dog.";
        let seed = |i: usize| sampled.then_some(i as u64 + 7);
        for i in 0..2 {
            request(plain, prompt, tokens, seed(1000 + i));
            request(lookup, prompt, tokens, seed(1000 + i));
        }
        let (mut a, mut b, mut drafted, mut accepted) = (vec![], vec![], vec![], vec![]);
        for i in 0..rounds {
            a.push(request(plain, prompt, tokens, seed(i)).0);
            let (rate, d, acc) = request(lookup, prompt, tokens, seed(i));
            b.push(rate);
            drafted.push(d);
            accepted.push(if d > 0.0 { acc / d } else { 0.0 });
        }
        let (pa, pb) = (median(a), median(b));
        println!(
            "| {what} | {pa:.1} | {pb:.1} | {:.2} | {:.0} | {:.0}% |",
            pb / pa,
            median(drafted),
            100.0 * median(accepted)
        );
    }
}
