//! KV cache types: `cargo bench --bench kv_cache`.
//!
//! Decode tokens/s of the benchmark model (target/bench-model, ~120M float32, gemma4-shaped:
//! 8 sliding layers of a 512-token window, 2 full ones) and of its 4-bit form, at ~1k and ~4k
//! tokens of context (`KV_BENCH_CONTEXTS=1024,4096,16384` for others), with
//! `--kv-cache-type f32`, `f16`, `bf16`, `q8` and `q4`; the bytes a cached token costs (the
//! runner's memory plan). Each (model, context) runs its types in turn, five rounds; the
//! context is prefilled once per runner and then restored from the prefix cache, so the rounds
//! time decode only. Medians, and each type's ratio to float32.

mod common;
use common::{bench_model, median, peer_python, quantized_model, root};

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};

const ROUNDS: usize = 5;
const TOKENS: usize = 64;
const TYPES: [&str; 5] = ["f32", "f16", "bf16", "q8", "q4"];

struct Runner {
    child: std::process::Child,
    port: u16,
}

impl Drop for Runner {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A runner with `--kv-cache-type kind`, and the KV cache its memory plan counts per token.
fn start(model: &std::path::Path, kind: &str, ctx: usize) -> (Runner, f64) {
    let port = common::free_port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_mlx-runner"))
        .args(["runner", "--model"])
        .arg(model)
        .args(["--port", &port.to_string(), "--parallel", "1"])
        .args(["--kv-cache-type", kind, "--ctx-size", &ctx.to_string()])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut per_token = f64::NAN;
    let mut line = String::new();
    while err.read_line(&mut line).unwrap_or(0) > 0 {
        if let Some(at) = line.find("kv_cache=") {
            let mut w = line[at + 9..].split_whitespace();
            let (n, unit) = (w.next().unwrap(), w.next().unwrap());
            let scale = match unit {
                "KiB" => 1024.0,
                "MiB" => 1048576.0,
                "GiB" => 1073741824.0,
                _ => 1.0,
            };
            per_token = n.parse::<f64>().unwrap() * scale / ctx as f64;
        }
        if line.contains("runner ready") {
            break;
        }
        line.clear();
    }
    // Keep reading its log so that it never blocks on a full pipe.
    std::thread::spawn(move || {
        let mut sink = Vec::new();
        let _ = err.read_to_end(&mut sink);
    });
    (Runner { child, port }, per_token)
}

/// Decode tokens/s of one greedy completion.
fn decode(r: &Runner, prompt: &str) -> f64 {
    let body = json!({"Prompt": prompt, "Options": {"num_predict": TOKENS, "temperature": 0}});
    let resp = ureq::post(&format!("http://127.0.0.1:{}/v1/completions", r.port))
        .send_string(&body.to_string())
        .unwrap();
    let mut last = Value::Null;
    for line in BufReader::new(resp.into_reader()).lines() {
        last = serde_json::from_str(&line.unwrap()).unwrap();
    }
    let n = last["EvalCount"].as_f64().unwrap();
    (n - 1.0) / (last["EvalDuration"].as_f64().unwrap() / 1e9)
}

/// Text of about `tokens` tokens for the runner's tokenizer (the corpus, repeated as needed).
fn prompt_of(port: u16, tokens: usize) -> String {
    let corpus = common::corpus_prompt(usize::MAX);
    let count = |p: &str| -> usize {
        let n: Vec<u32> = serde_json::from_str(
            &ureq::post(&format!("http://127.0.0.1:{port}/v1/tokenize"))
                .send_string(p)
                .unwrap()
                .into_string()
                .unwrap(),
        )
        .unwrap();
        n.len()
    };
    let per_char = count(&corpus) as f64 / corpus.chars().count() as f64;
    let chars = (tokens as f64 / per_char) as usize;
    let text: String = corpus.chars().cycle().take(chars).collect();
    assert!(
        count(&text).abs_diff(tokens) < tokens / 10,
        "prompt of {tokens} tokens"
    );
    text
}

fn main() {
    let Some(python) = peer_python() else { return };
    let Some(base) = bench_model(&python) else {
        return;
    };
    let mut models = vec![("float32", base.clone())];
    if let Some(q4) = quantized_model(&python, &base, 4, 64) {
        models.push(("4-bit", q4));
    }
    let _ = root();
    println!("## Decode tokens/s by KV cache type (medians of {ROUNDS})\n");
    println!("| model | context | cache | bytes per token | ÷ f32's | decode tok/s | vs f32 |");
    println!("|---|---|---|---|---|---|---|");
    for (name, model) in &models {
        let contexts = std::env::var("KV_BENCH_CONTEXTS").unwrap_or_else(|_| "1024,4096".into());
        for ctx in contexts
            .split(',')
            .filter_map(|c| c.trim().parse::<usize>().ok())
        {
            let runners: Vec<(Runner, f64)> =
                TYPES.iter().map(|k| start(model, k, ctx + 512)).collect();
            let prompt = prompt_of(runners[0].0.port, ctx);
            // Prefill once (into each runner's prefix cache).
            for (r, _) in &runners {
                decode(r, &prompt);
            }
            let mut rates: Vec<Vec<f64>> = vec![Vec::new(); TYPES.len()];
            for round in 0..ROUNDS {
                let p = format!("{prompt} {round}");
                for (i, (r, _)) in runners.iter().enumerate() {
                    rates[i].push(decode(r, &p));
                }
            }
            let f32_rate = median(rates[0].clone());
            for (i, kind) in TYPES.iter().enumerate() {
                let m = median(rates[i].clone());
                println!(
                    "| {name} | {ctx} | {kind} | {:.0} | {:.2} | {m:.1} | {:.2}x |",
                    runners[i].1,
                    runners[0].1 / runners[i].1,
                    m / f32_rate
                );
            }
        }
    }
}
