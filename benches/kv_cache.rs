//! KV cache types: `cargo bench --bench kv_cache`.
//!
//! Decode tokens/s of the benchmark model (target/bench-model, ~120M float32, gemma4-shaped:
//! 8 sliding layers of a 512-token window, 2 full ones) and of its 4-bit form, at ~1k and ~4k
//! tokens of context (`KV_BENCH_CONTEXTS=1024,4096,16384` for others; `KV_BENCH_MODELS=4-bit`
//! for one model; `KV_BENCH_PEER=0` skips the comparison with mlx-lm), with
//! `--kv-cache-type f32`, `f16`, `bf16`, `q8` and `q4`; the bytes a cached token costs (the
//! runner's memory plan). Each (model, context) runs its types in turn, five rounds; the
//! context is prefilled once per runner and then restored from the prefix cache, so the rounds
//! time decode only. Medians, and each type's ratio to float32.
//!
//! Then quality: each type's greedy run at every context against the float32 cache's (tokens
//! identical from the start, and the logprob drift over them), and greedy agreement with
//! mlx-lm's own quantized cache at the same bits and group. mlx-lm quantizes only its plain
//! growing cache (benches/kv_peer.py says why), so that comparison runs on the benchmark model
//! with every layer global (`make_bench_model.py --global`), at ~1k tokens.

mod common;
use common::{bench_model, global_bench_model, median, peer_python, quantized_model, root};

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

/// A greedy run's tokens, each with its logprob.
type Run = Vec<(String, f64)>;

/// One greedy completion's tokens, each with its logprob, and the prompt's token count.
fn greedy(r: &Runner, prompt: &str) -> (usize, Run) {
    let body = json!({"Prompt": prompt, "Logprobs": true,
                      "Options": {"num_predict": TOKENS, "temperature": 0}});
    let resp = ureq::post(&format!("http://127.0.0.1:{}/v1/completions", r.port))
        .send_string(&body.to_string())
        .unwrap();
    let mut tokens = Vec::new();
    let mut prompt_tokens = 0;
    for line in BufReader::new(resp.into_reader()).lines() {
        let v: Value = serde_json::from_str(&line.unwrap()).unwrap();
        for e in v["Logprobs"].as_array().into_iter().flatten() {
            let token = e["token"].as_str().unwrap_or_default().to_string();
            tokens.push((token, e["logprob"].as_f64().unwrap()));
        }
        if v["Done"] == true {
            prompt_tokens = v["PromptEvalCount"].as_u64().unwrap_or(0) as usize;
        }
    }
    (prompt_tokens, tokens)
}

/// How far `got` follows `want` token for token from the start, and the largest and mean
/// logprob difference over those tokens.
struct Agreement {
    same: usize,
    of: usize,
    max: f64,
    mean: f64,
}

fn agreement(got: &Run, want: &Run) -> Agreement {
    let same = got.iter().zip(want).take_while(|(g, w)| g.0 == w.0).count();
    let d: Vec<f64> = got[..same]
        .iter()
        .zip(want)
        .map(|(g, w)| (g.1 - w.1).abs())
        .collect();
    Agreement {
        same,
        of: got.len().max(want.len()),
        max: d.iter().copied().fold(0.0, f64::max),
        mean: d.iter().sum::<f64>() / d.len().max(1) as f64,
    }
}

impl std::fmt::Display for Agreement {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        if self.same == 0 {
            return write!(f, "0 of {}, —", self.of);
        }
        write!(
            f,
            "{} of {}, {:.1e}, {:.1e}",
            self.same, self.of, self.mean, self.max
        )
    }
}

/// mlx-lm's greedy tokens and logprobs with its float cache (`bits` 0) or its quantized one.
fn peer_greedy(
    python: &std::path::Path,
    model: &std::path::Path,
    bits: u32,
    ids: &[u32],
) -> Vec<(String, f64)> {
    let mut child = Command::new(python)
        .arg(root().join("benches/kv_peer.py"))
        .arg(model)
        .args([bits.to_string(), TOKENS.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let ids = serde_json::to_vec(ids).unwrap();
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), &ids).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "kv_peer.py failed");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["token"].as_str().unwrap().to_string(),
                e["logprob"].as_f64().unwrap(),
            )
        })
        .collect()
}

/// Greedy agreement with mlx-lm's quantized cache on the all-global benchmark model: ours
/// against mlx-lm at the same bits, and beside it how far each side's quantized cache takes
/// it from its own float32 cache (a random model's greedy path is chaotic: a small change in
/// one logit can change a token, and everything after it, so the last two columns are the
/// yardstick for the first).
fn against_peer(python: &std::path::Path) {
    let Some(model) = global_bench_model(python) else {
        return;
    };
    const CTX: usize = 1024;
    println!("\n## Greedy agreement with mlx-lm's KV cache (all-global bench model, ~{CTX} tokens, {TOKENS} generated)\n");
    println!("Each cell: tokens identical from the start, then the mean and largest \\|Δ logprob\\| over them.\n");
    println!("| cache | ours vs mlx-lm, same cache | ours vs our f32 | mlx-lm vs its f32 |");
    println!("|---|---|---|---|");
    let mut prompt = None;
    let mut float: Option<(Run, Run)> = None;
    for (kind, bits) in [("f32", 0), ("q8", 8), ("q4", 4)] {
        let (r, _) = start(&model, kind, CTX + 512);
        let prompt = prompt.get_or_insert_with(|| prompt_of(r.port, CTX)).clone();
        let (n, ours) = greedy(&r, &prompt);
        // The peer gets the prompt as our runner's tokens (its BOS included).
        let ids = tokenize(r.port, &prompt);
        assert_eq!(n, ids.len(), "the runner evaluates what it tokenizes");
        drop(r);
        let peer = peer_greedy(python, &model, bits, &ids);
        let (of_ours, of_peer) = match &float {
            Some((o, p)) => (
                agreement(&ours, o).to_string(),
                agreement(&peer, p).to_string(),
            ),
            None => ("—".into(), "—".into()),
        };
        println!(
            "| {kind} | {} | {of_ours} | {of_peer} |",
            agreement(&ours, &peer)
        );
        float.get_or_insert((ours, peer));
    }
}

/// `text` as the runner tokenizes it.
fn tokenize(port: u16, text: &str) -> Vec<u32> {
    serde_json::from_str(
        &ureq::post(&format!("http://127.0.0.1:{port}/v1/tokenize"))
            .send_string(text)
            .unwrap()
            .into_string()
            .unwrap(),
    )
    .unwrap()
}

/// Text of about `tokens` tokens for the runner's tokenizer (the corpus, repeated as needed).
fn prompt_of(port: u16, tokens: usize) -> String {
    let corpus = common::corpus_prompt(usize::MAX);
    let count = |p: &str| tokenize(port, p).len();
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
    // `KV_BENCH_MODELS=4-bit` (or float32) runs one of the two.
    if let Ok(only) = std::env::var("KV_BENCH_MODELS") {
        models.retain(|(name, _)| only.split(',').any(|o| o.trim() == *name));
    }
    let mut quality = Vec::new();
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
            // Each type's greedy run against the float32 cache's, on the same context.
            let runs: Vec<_> = runners.iter().map(|(r, _)| greedy(r, &prompt).1).collect();
            for (i, kind) in TYPES.iter().enumerate().skip(1) {
                quality.push(format!(
                    "| {name} | {ctx} | {kind} | {} |",
                    agreement(&runs[i], &runs[0])
                ));
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
    println!("\n## Greedy runs against the float32 cache's ({TOKENS} tokens)\n");
    println!(
        "A random model's greedy path is chaotic: float32 rounding alone (ours against mlx-lm, \
         both float32, below) moves this model's logprobs by ~1e-2, and one changed token \
         changes the rest. The first tokens' drift is the measure of each type.\n"
    );
    println!("| model | context | cache | tokens identical from the start, mean and max \\|Δ logprob\\| over them |");
    println!("|---|---|---|---|");
    for row in quality {
        println!("{row}");
    }
    if std::env::var("KV_BENCH_PEER").as_deref() != Ok("0") {
        against_peer(&python);
    }
}
