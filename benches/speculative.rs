//! Speculative decoding's machinery: `cargo bench --bench speculative`.
//!
//! Real drafters need real weights, which cannot be downloaded here, so the pair is constructed
//! (benches/make_spec_models.py, from the benchmark model of benches/generate.rs):
//! (i) a target whose layers past the second are identities, drafted by its own first two
//! layers (acceptance 1): decode tokens/s against no drafting for depths 1..6 and adaptive;
//! (ii) a random drafter of the same shape (acceptance ~0): the adaptive depth must keep at
//! least 0.95x of no drafting. Through the runner, as in service: per configuration one runner,
//! a warm-up request, then the median of three requests of 96 sampled tokens (temperature 1,
//! top-k 40, seeded), decode tokens/s from the runner's own EvalCount and EvalDuration.

mod common;
use common::{complete_last, median, root, runner, Server};

use serde_json::json;
use std::path::Path;
use std::process::Command;

const TOKENS: usize = 96;

fn serve(dir: &Path, draft: &str, depth: &str) -> (Server, u16) {
    let draft = dir.join(draft);
    runner(
        &dir.join("target"),
        &[
            "--draft",
            draft.to_str().unwrap(),
            "--draft-depth",
            depth,
            "--max-draft-depth",
            "6",
            // Every request starts cold: the measurement is decoding, not the prefix cache.
            "--cache-budget",
            "0",
        ],
    )
}

/// (decode tok/s, acceptance) of one request.
fn request(port: u16, seed: u64) -> (f64, f64) {
    // Sampling, not greedy: a random model's greedy output collapses into repeating one token,
    // which any drafter predicts. With identical distributions every draft is accepted.
    let body = json!({
        "Prompt": "The quick brown fox jumps over the lazy dog. Tell me more about the fox and the dog.",
        "Options": {"num_predict": TOKENS, "temperature": 1.0, "top_k": 40, "seed": seed, "repeat_penalty": 1.0}
    });
    let last = complete_last(port, &body);
    let n = last["EvalCount"].as_f64().unwrap_or(0.0);
    let ns = last["EvalDuration"].as_f64().unwrap_or(f64::NAN);
    let (d, a) = (
        last["DraftTokens"].as_f64().unwrap_or(0.0),
        last["DraftAccepted"].as_f64().unwrap_or(0.0),
    );
    ((n - 1.0) / (ns / 1e9), if d > 0.0 { a / d } else { 0.0 })
}

/// Steady state of one loaded model: a warm-up request (the adaptive depth learns, as it would
/// over a runner's life), then the median of three.
fn measure(dir: &Path, draft: &str, depth: &str) -> (f64, f64) {
    let (_server, port) = serve(dir, draft, depth);
    request(port, 1000);
    let runs: Vec<(f64, f64)> = (0..3).map(|i| request(port, i)).collect();
    (
        median(runs.iter().map(|r| r.0).collect()),
        median(runs.iter().map(|r| r.1).collect()),
    )
}

fn main() {
    let python = root().join(".venv-peer/bin/python");
    let model = root().join("target/bench-model");
    let dir = root().join("target/bench-spec");
    if !model.join("model.safetensors").exists() || !python.exists() {
        eprintln!("run benches/peer-venv.sh and `cargo bench --bench generate` first");
        return;
    }
    if !dir.join("draft-bad/model.safetensors").exists() {
        let ok = Command::new(&python)
            .arg(root().join("benches/make_spec_models.py"))
            .arg(&model)
            .arg(&dir)
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "could not write the speculative benchmark models");
    }
    let (base, _) = measure(&dir, "draft-good", "0");
    println!("## (i) drafted by its own first two layers (no drafting: {base:.1} tok/s)\n");
    println!("| depth | decode tok/s | speed-up | acceptance |");
    println!("|---|---|---|---|");
    for depth in ["1", "2", "3", "4", "5", "6", "auto"] {
        let (t, a) = measure(&dir, "draft-good", depth);
        println!("| {depth} | {t:.1} | {:.2}x | {a:.2} |", t / base);
    }
    let (bad_base, _) = measure(&dir, "draft-bad", "0");
    let (t, a) = measure(&dir, "draft-bad", "auto");
    println!("\n## (ii) a random drafter\n");
    println!("| | decode tok/s | ratio | acceptance |");
    println!("|---|---|---|---|");
    println!("| no drafting | {bad_base:.1} | 1.00x | |");
    println!("| adaptive | {t:.1} | {:.2}x | {a:.2} |", t / bad_base);
}
