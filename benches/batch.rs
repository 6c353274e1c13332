//! Concurrent clients: `cargo bench --bench batch`.
//!
//! On the benchmark model (target/bench-model, see benches/generate.rs), 1, 2, 4 and 8 clients
//! each stream one request at the same moment (distinct prompts, greedy, the same length), to
//! `mlx-runner runner --parallel 8` and to `mlx_lm.server` (its batching on: decode and prompt
//! concurrency 8; OpenBLAS preloaded when present) on the same weights, one server after the
//! other. Reported per client count: aggregate decode tokens/s (all tokens after each
//! request's first, over the span from the first request's first token to the last request's
//! end), median time to first token and median per-request decode tokens/s; medians over
//! rounds, and ours / peer as ratios. The aggregate's span includes prompts prefilled after
//! the first request's first token (requests that reach the server after it started on the
//! first are prefilled in a later step, while the first decodes), so it depends on when they
//! arrive; the steady aggregate counts only the text chunks that arrive while every request is
//! decoding (from the last request's first chunk to the first request's last), which is the
//! rate of batched decode steps alone. `BATCH_ROUNDS`, `BATCH_TOKENS` and `BATCH_CLIENTS`
//! (comma-separated) override the defaults.
//!
//! Then, in-process, where a batched decode step goes at 1, 2, 4 and 8 rows (each row 64
//! tokens into its sequence): the whole step (packed forward, head, greedy pick, evaluation),
//! the part of it spent building the graph on the host, and the floor set by the model's
//! matrix products alone (every 2-D weight, the tied head included, held the way the model
//! holds it, times a `[B, in]` input, evaluated together), each step and its floor taken in
//! turn. The rest (step − floor) is attention, norms, elementwise work and per-row overhead.
//!
//! Last, batched decoding with and without a drafter (the constructed pair of
//! benches/speculative.rs). `BATCH_ONLY_BREAKDOWN` / `BATCH_ONLY_DRAFTING` run one part alone.
//! `BATCH_BITS=4` (or 8) runs the client rounds on the bench model as `mlx_lm convert -q` makes
//! it at that width (group 64), both servers loading the same converted weights; the breakdown
//! then steps the converted model, its floor multiplying the quantized matrices as the model
//! holds them (16-output panels on a CPU with AVX-512).
//! `BATCH_BREAKDOWN_STEPS` (default 10) sets how many steps the breakdown times, so that a
//! profiler attached to it sees decode steps more than the prefill before them.

mod common;
use common::{
    affine_matrix, median, peer_server, quantized_model, root, runner, spec_pair,
    stream_ours as ours, stream_peer as peer, Timing,
};

use std::path::Path;
use std::time::Instant;

/// A comma-separated list of counts from the environment, or `default`.
fn env_counts(name: &str, default: &str) -> Vec<usize> {
    std::env::var(name)
        .unwrap_or_else(|_| default.into())
        .split(',')
        .filter_map(|c| c.trim().parse().ok())
        .collect()
}

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// (aggregate decode tok/s, median TTFT s, median per-request decode tok/s, steady aggregate
/// tok/s) of one round.
type Round = (f64, f64, f64, f64);

/// A [`Round`] of `clients` requests sent at once.
fn round(
    clients: usize,
    n: usize,
    tag: &str,
    send: fn(u16, &str, usize) -> Timing,
    port: u16,
) -> Round {
    let handles: Vec<_> = (0..clients)
        .map(|c| {
            // Distinct prompts, so no prefix cache serves one from another.
            let prompt = format!(
                "{tag} client {c}. {}",
                "The quick brown fox jumps over the lazy dog. ".repeat(4)
            );
            std::thread::spawn(move || send(port, &prompt, n))
        })
        .collect();
    let t: Vec<Timing> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let first = t.iter().map(|x| x.first).min().unwrap();
    let end = t.iter().map(|x| x.end).max().unwrap();
    let decoded: usize = t.iter().map(|x| x.tokens.saturating_sub(1)).sum();
    let aggregate = decoded as f64 / (end - first).as_secs_f64().max(1e-9);
    let ttft = median(
        t.iter()
            .map(|x| (x.first - x.start).as_secs_f64())
            .collect(),
    );
    let per = median(
        t.iter()
            .map(|x| x.tokens.saturating_sub(1) as f64 / (x.end - x.first).as_secs_f64().max(1e-9))
            .collect(),
    );
    (aggregate, ttft, per, steady(&t))
}

/// Text chunks a second, all requests together, from the last request's first chunk to the
/// first request's last: while every one of them is decoding (NaN where that span is empty).
fn steady(t: &[Timing]) -> f64 {
    let from = t.iter().map(|x| x.first).max().unwrap();
    let to = t.iter().map(|x| x.last).min().unwrap();
    if to <= from {
        return f64::NAN;
    }
    let chunks = t
        .iter()
        .flat_map(|x| &x.chunks)
        .filter(|&&c| c > from && c <= to)
        .count();
    chunks as f64 / (to - from).as_secs_f64()
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// A matrix of the model as the model holds it on the CPU, with its input width.
enum Product {
    /// Float: column panels where the rows are whole panels, else `Wᵀ`
    /// (`models::nn::Linear::dense`).
    Dense(models::nn::Linear, i32),
    /// Affine-quantized: 16-output panels where the CPU takes them, else MLX's rows.
    Quantized(mlx::Quantized, i32),
}

impl Product {
    /// `rows` rows of random input.
    fn input(&self, rows: i32, dtype: mlx::Dtype) -> mlx::Array {
        let (Product::Dense(_, inputs) | Product::Quantized(_, inputs)) = self;
        mlx::random::normal(&[rows, *inputs], dtype, 0.0, 1.0, None).unwrap()
    }

    fn apply(&self, x: &mlx::Array) -> mlx::Array {
        match self {
            Product::Dense(l, _) => l.forward(x).unwrap(),
            Product::Quantized(q, _) => x.quantized_matmul(q, true).unwrap(),
        }
    }
}

/// (step, graph build, matmul floor) in milliseconds for `b` decode rows.
fn step_costs(m: &models::LoadedModel, weights: &[Product], b: usize) -> (f64, f64, f64) {
    let model = &*m.model;
    let mut caches: Vec<Vec<models::LayerCache>> = (0..b).map(|_| model.make_caches()).collect();
    for (r, c) in caches.iter_mut().enumerate() {
        let ids: Vec<i32> = (0..64)
            .map(|i| ((r * 97 + i * 13) % 30000) as i32 + 10)
            .collect();
        let t = mlx::Array::from_slice(&ids, &[1, 64]).unwrap();
        model.forward(&t, c).unwrap().eval().unwrap();
    }
    // Each product's input, dense and ready before any is timed (a broadcast one is copied
    // inside the product, or takes another kernel).
    let inputs: Vec<mlx::Array> = weights.iter().map(|p| p.input(b as i32, m.dtype)).collect();
    mlx::eval(&inputs.iter().collect::<Vec<_>>()).unwrap();
    let (mut steps, mut builds, mut floors) = (vec![], vec![], vec![]);
    let mut next = mlx::Array::from_slice(&vec![42i32; b], &[1, b as i32]).unwrap();
    for i in 0..4 + env_or("BATCH_BREAKDOWN_STEPS", 10) {
        let start = Instant::now();
        let mut rows: Vec<models::PackedRow<'_>> = caches
            .iter_mut()
            .map(|c| models::PackedRow::text(1, c))
            .collect();
        let h = model.forward_packed(&next, &mut rows).unwrap();
        let picked = model.logits(&h).unwrap().argmax(-1, false).unwrap();
        let built = ms(start);
        picked.eval().unwrap();
        let step = ms(start);
        next = picked
            .astype(mlx::Dtype::I32)
            .unwrap()
            .reshape(&[1, b as i32])
            .unwrap();
        let start = Instant::now();
        let outs: Vec<mlx::Array> = weights
            .iter()
            .zip(&inputs)
            .map(|(p, x)| p.apply(x))
            .collect();
        mlx::eval(&outs.iter().collect::<Vec<_>>()).unwrap();
        let floor = ms(start);
        // The first steps warm up.
        if i >= 4 {
            steps.push(step);
            builds.push(built);
            floors.push(floor);
        }
    }
    (median(steps), median(builds), median(floors))
}

fn breakdown(model_dir: &Path) {
    mlx::init_thread().unwrap();
    let m = models::load(model_dir, models::DtypeChoice::Auto).unwrap();
    let weights = products(model_dir, &m);
    println!(
        "\nWhere a batched decode step goes (in-process, medians of {} steps)\n",
        env_or("BATCH_BREAKDOWN_STEPS", 10)
    );
    println!(
        "| rows | step ms | per row ms | graph build ms | matmul floor ms | rest ms | step / floor |"
    );
    println!("|---|---|---|---|---|---|---|");
    for b in env_counts("BATCH_BREAKDOWN_ROWS", "1,2,4,8") {
        let (step, build, floor) = step_costs(&m, &weights, b);
        println!(
            "| {b} | {step:.1} | {:.1} | {build:.1} | {floor:.1} | {:.1} | {:.2} |",
            step / b as f64,
            step - floor,
            step / floor
        );
    }
}

/// Every matrix the model multiplies a token by (the tied head included), held as the model
/// holds it, so that the floor is the same products through the same kernels: float ones
/// through `models::nn::Linear::dense`, affine-quantized ones (a `.scales` beside the weight,
/// mlx-lm's layout) as the loader panels them.
fn products(model_dir: &Path, m: &models::LoadedModel) -> Vec<Product> {
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(model_dir.join("config.json")).unwrap()).unwrap();
    let quant = &cfg["quantization"];
    let (group, bits) = (
        quant["group_size"].as_i64().unwrap_or(64) as i32,
        quant["bits"].as_i64().unwrap_or(4) as i32,
    );
    let arrays = mlx::io::load_safetensors(model_dir.join("model.safetensors"))
        .unwrap()
        .arrays;
    let held = models::weights::Weights::from_arrays(Default::default(), m.dtype, None);
    let mut out = vec![];
    for (name, a) in &arrays {
        let Some(base) = name.strip_suffix(".weight") else {
            continue;
        };
        if a.ndim() != 2 {
            continue;
        }
        if let Some(q) = affine_matrix(&arrays, base, group, bits) {
            let inputs = a.shape()[1] * 32 / bits;
            let q = q.paneled().unwrap().unwrap_or(q);
            mlx::eval(&[&q.weight, &q.scales]).unwrap();
            out.push(Product::Quantized(q, inputs));
        } else if a.dtype().is_float() {
            let l = models::nn::Linear::dense(&held, a.astype(m.dtype).unwrap()).unwrap();
            out.push(Product::Dense(l, a.shape()[1]));
        }
    }
    held.materialize().unwrap();
    out
}

/// Batched and drafting together, on the constructed pair of benches/speculative.rs (a target
/// whose first two layers, as a separate drafter, always agree with it: acceptance 1): the
/// aggregate decode tok/s of `--parallel 8` with the drafter (adaptive depth) over without.
fn drafting(rounds: usize, n: usize, counts: &[usize]) {
    let Some((target, draft)) = spec_pair() else {
        return;
    };
    let mut rows = Vec::new();
    for with in [false, true] {
        let mut args = vec!["--parallel", "8", "--cache-budget", "0"];
        if with {
            args.extend(["--draft", draft.to_str().unwrap(), "--max-draft-depth", "6"]);
        } else {
            args.extend(["--draft-depth", "0"]);
        }
        let (_server, port) = runner(&target, &args);
        ours(port, "warm up", 4);
        rows.push(
            counts
                .iter()
                .map(|&c| {
                    median(
                        (0..rounds)
                            .map(|i| round(c, n, &format!("draft {with} {i}"), ours, port).0)
                            .collect(),
                    )
                })
                .collect::<Vec<f64>>(),
        );
    }
    println!("\nBatched with drafting (separate drafter, acceptance 1, adaptive depth) vs batched alone; aggregate decode tok/s, medians of {rounds}\n");
    println!("| clients | batched | batched + drafting | ratio |");
    println!("|---|---|---|---|");
    for (i, c) in counts.iter().enumerate() {
        println!(
            "| {c} | {:.1} | {:.1} | {:.2} |",
            rows[0][i],
            rows[1][i],
            rows[1][i] / rows[0][i]
        );
    }
}

fn main() {
    let python = root().join(".venv-peer/bin/python");
    let model = root().join("target/bench-model");
    if !python.exists() || !model.join("model.safetensors").exists() {
        eprintln!("run benches/peer-venv.sh and `cargo bench --bench generate` first (it writes the model)");
        return;
    }
    let bits = env_or("BATCH_BITS", 0);
    let (model, weights) = if bits == 0 {
        (model, "float32".to_string())
    } else {
        let Some(q) = quantized_model(&python, &model, bits as u32, 64) else {
            return;
        };
        (q, format!("{bits}-bit (group 64)"))
    };
    if std::env::var("BATCH_ONLY_BREAKDOWN").is_ok() {
        breakdown(&model);
        return;
    }
    let rounds = env_or("BATCH_ROUNDS", 3);
    let n = env_or("BATCH_TOKENS", 48);
    let counts = env_counts("BATCH_CLIENTS", "1,2,4,8");
    if std::env::var("BATCH_ONLY_DRAFTING").is_ok() {
        drafting(rounds, n, &counts);
        return;
    }

    let mut ours_rows = Vec::new();
    {
        let (_server, port) = runner(&model, &["--parallel", "8"]);
        ours(port, "warm up", 4);
        for &c in &counts {
            let r: Vec<_> = (0..rounds)
                .map(|i| round(c, n, &format!("ours {i}"), ours, port))
                .collect();
            ours_rows.push(r);
        }
    }
    let mut peer_rows = Vec::new();
    if std::env::var("BATCH_ONLY_OURS").is_ok() {
        println!("{weights} weights");
        for (&c, rows) in counts.iter().zip(&ours_rows) {
            let m = |f: fn(&Round) -> f64| median(rows.iter().map(f).collect());
            println!(
                "ours, {c} clients: aggregate {:.1} tok/s, TTFT {:.0} ms, per request {:.1} tok/s, steady aggregate {:.1} tok/s",
                m(|r| r.0),
                m(|r| r.1) * 1e3,
                m(|r| r.2),
                m(|r| r.3)
            );
        }
        return;
    }
    {
        let (_peer, port) = peer_server(
            &python,
            &model,
            &["--decode-concurrency", "8", "--prompt-concurrency", "8"],
        );
        peer(port, "warm up", 4);
        for &c in &counts {
            let r: Vec<_> = (0..rounds)
                .map(|i| round(c, n, &format!("peer {i}"), peer, port))
                .collect();
            peer_rows.push(r);
        }
    }

    let med = |v: &[Round], f: fn(&Round) -> f64| median(v.iter().map(f).collect());
    println!("\n~120M gemma4-shaped model, {weights}, {n} new tokens per request, greedy; medians of {rounds} rounds\n");
    println!("| clients | ours aggregate tok/s | mlx_lm.server aggregate tok/s | ratio | ours TTFT | peer TTFT | ours per-request tok/s | peer per-request tok/s | ours steady tok/s | peer steady tok/s |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let solo = med(&ours_rows[0], |r| r.0);
    for (i, &c) in counts.iter().enumerate() {
        let (oa, pa) = (med(&ours_rows[i], |r| r.0), med(&peer_rows[i], |r| r.0));
        println!(
            "| {c} | {oa:.1} | {pa:.1} | {:.2} | {:.0} ms | {:.0} ms | {:.1} | {:.1} | {:.1} | {:.1} |",
            oa / pa,
            med(&ours_rows[i], |r| r.1) * 1e3,
            med(&peer_rows[i], |r| r.1) * 1e3,
            med(&ours_rows[i], |r| r.2),
            med(&peer_rows[i], |r| r.2),
            med(&ours_rows[i], |r| r.3),
            med(&peer_rows[i], |r| r.3),
        );
    }
    for (i, &c) in counts.iter().enumerate() {
        println!(
            "ours, {c} clients: aggregate {:.2}x one client's (steady {:.2}x); per-request decode {:.2}x slower than one alone",
            med(&ours_rows[i], |r| r.0) / solo,
            med(&ours_rows[i], |r| r.3) / med(&ours_rows[0], |r| r.3),
            med(&ours_rows[0], |r| r.2) / med(&ours_rows[i], |r| r.2),
        );
    }
    breakdown(&model);
    drafting(rounds, n, &counts);
}
