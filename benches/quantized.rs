//! Quantized models on the CPU: `cargo bench --bench quantized`.
//!
//! The benchmark model (target/bench-model, ~120M float32, tied embeddings) quantized by
//! `mlx_lm convert -q` (MLX affine, 4, 8, 3 and 6 bits, group 64; mxfp4, nvfp4 and mxfp8), run by `mlx-runner generate` and `mlx_lm generate` one after the other (same MLX, same
//! machine, OpenBLAS preloaded into the peer): prefill and decode tokens/s, medians, ratio. Ours
//! goes through mlx-runner's CPU kernel for quantized matmuls (crates/mlx-sys/src/qmm_cpu.cc);
//! `MLX_RUNNER_KERNELS=mlx` runs ours with MLX's own kernels instead, for comparison;
//! `BENCH_QUANT_ALL=1` adds 2 and 5 bits and 4-bit with groups 32 and 128; `BENCH_QUANT=3:64,mxfp4`
//! runs only the rows named (bits:group for affine, or a mode).
//!
//! The memory roofline: the bytes a decode step must read over the read bandwidth, measured here
//! by summing a 1 GiB buffer with all cores. The bytes are every weight file byte (each quantized
//! matrix is read once per token, the tied embedding as the output head) and, in the last
//! column, the KV cache too: every layer's keys and values at the mean context of the decode
//! (prompt plus half the new tokens; a sliding layer's at most its window), float32 as the model
//! runs. This machine's bandwidth drifts from minute to minute, so it is measured again just
//! before each of our runs, and a share of the roofline is the median of the runs' own shares.
//! Ours runs three times a round to mlx-lm's once (a run of ours is seconds, mlx-lm's a minute).
//!
//! Where a decode step goes, part by part: `cargo bench --bench step`.

mod common;
use common::{bench_model, corpus_prompt, median, ours_generate, peer_generate, peer_python};

use std::path::Path;

const ROUNDS: usize = 3;
/// Our runs per round (the peer runs once a round): a run of ours is seconds, and this VM's
/// speed drifts by ±20% from one to the next, so ours takes the median of more of them.
const OURS_PER_ROUND: usize = 3;
const TOKENS: &str = "64";

/// Read bandwidth in bytes/s: the best of a few passes summing a 1 GiB buffer, split across
/// the cores.
fn read_bandwidth() -> f64 {
    let n = (1usize << 30) / 8;
    let buf: Vec<u64> = (0..n as u64).collect();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut best = 0f64;
    for _ in 0..5 {
        let start = std::time::Instant::now();
        let total: u64 = std::thread::scope(|s| {
            let chunk = n.div_ceil(threads);
            let handles: Vec<_> = buf
                .chunks(chunk)
                .map(|c| s.spawn(move || c.iter().fold(0u64, |a, &x| a.wrapping_add(x))))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .fold(0, u64::wrapping_add)
        });
        std::hint::black_box(total);
        best = best.max((n * 8) as f64 / start.elapsed().as_secs_f64());
    }
    best
}

/// Bytes of KV cache a decode step reads at `context` tokens: every layer's keys and values
/// (keys only where they are the values), a sliding layer's at most its window, 4 bytes each.
fn kv_bytes(model: &Path, context: u64) -> u64 {
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(model.join("config.json")).unwrap()).unwrap();
    let c = cfg.get("text_config").unwrap_or(&cfg);
    let int = |k: &str| c[k].as_u64();
    let head = int("head_dim").unwrap();
    let heads = int("num_key_value_heads").unwrap();
    let window = int("sliding_window").unwrap_or(u64::MAX);
    let k_eq_v = c["attention_k_eq_v"].as_bool().unwrap_or(false);
    c["layer_types"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            let sliding = t.as_str() == Some("sliding_attention");
            let (keys, dim, kv_heads, arrays) = if sliding {
                (context.min(window), head, heads, 2)
            } else {
                (
                    context,
                    int("global_head_dim").unwrap_or(head),
                    int("num_global_key_value_heads").unwrap_or(heads),
                    if k_eq_v { 1 } else { 2 },
                )
            };
            keys * dim * kv_heads * arrays * 4
        })
        .sum()
}

/// The prompt's length in tokens, as `mlx-runner generate` reports it.
fn prompt_tokens(model: &Path, prompt: &str) -> u64 {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mlx-runner"))
        .args(["generate", "--model"])
        .arg(model)
        .args(["--prompt", prompt, "-n", "1"])
        .output()
        .unwrap();
    common::rate(&String::from_utf8_lossy(&out.stderr), "prompt:", "tokens").unwrap() as u64
}

fn weight_bytes(model: &Path) -> u64 {
    std::fs::read_dir(model)
        .unwrap()
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
        .map(|e| e.metadata().unwrap().len())
        .sum()
}

fn main() {
    let Some(python) = peer_python() else {
        return;
    };
    let Some(base) = bench_model(&python) else {
        return;
    };
    let prompt = corpus_prompt(1300);
    let mut bandwidths = vec![];
    println!("~120M gemma4-shaped model quantized by mlx_lm convert, ~600-token prompt, {TOKENS} new tokens; medians of {} runs of ours, {ROUNDS} of mlx-lm's\n", ROUNDS * OURS_PER_ROUND);
    println!("| quantization | weights MB | ours prefill | mlx-lm prefill | ratio | ours decode | mlx-lm decode | ratio | roofline tok/s (weights) | decode / roofline (weights) | decode / roofline (weights + KV cache) |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    // Every row runs the bench model's layers on the same prompt: one context and cache size,
    // taken from the first quantized model (its tokenizer is the one the rows run).
    let mut cache: Option<(u64, u64)> = None;
    // (mode, bits, group); a microscaling mode's bits and group are its own.
    let mut configs: Vec<(String, u32, u32)> = [(4, 64), (8, 64), (3, 64), (6, 64)]
        .into_iter()
        .map(|(b, g)| ("affine".to_string(), b, g))
        .chain(
            [("mxfp4", 4, 32), ("nvfp4", 4, 16), ("mxfp8", 8, 32)]
                .map(|(m, b, g)| (m.to_string(), b, g)),
        )
        .collect();
    if std::env::var_os("BENCH_QUANT_ALL").is_some() {
        configs.extend(
            [(2, 64), (5, 64), (4, 32), (4, 128)].map(|(b, g)| ("affine".to_string(), b, g)),
        );
    }
    // BENCH_QUANT=3:64,6:64,mxfp4 runs those rows alone.
    if let Ok(only) = std::env::var("BENCH_QUANT") {
        configs = only
            .split(',')
            .filter_map(|c| {
                let c = c.trim();
                if let Some((b, g)) = c.split_once(':') {
                    return Some(("affine".to_string(), b.parse().ok()?, g.parse().ok()?));
                }
                configs.iter().find(|(m, _, _)| m == c).cloned()
            })
            .collect();
    }
    // mlx-lm's 4-bit group-64 medians, the peer of the store's q4 row below.
    let mut peer_q4 = None;
    for (mode, bits, group) in configs {
        let Some(model) = common::quantized_model_as(&python, &base, &mode, bits, group) else {
            continue;
        };
        let bytes = weight_bytes(&model);
        let (_, kv) = *cache.get_or_insert_with(|| {
            let context = prompt_tokens(&model, &prompt) + TOKENS.parse::<u64>().unwrap() / 2;
            (context, kv_bytes(&model, context))
        });
        let mut share_kv = vec![];
        let (mut op, mut od, mut pp, mut pd, mut share) = (vec![], vec![], vec![], vec![], vec![]);
        let mut row_bw = vec![];
        for _ in 0..ROUNDS {
            for _ in 0..OURS_PER_ROUND {
                let bandwidth = read_bandwidth();
                row_bw.push(bandwidth);
                let (p, d) = ours_generate(&model, &prompt, TOKENS);
                op.push(p);
                od.push(d);
                share.push(d / (bandwidth / bytes as f64));
                share_kv.push(d / (bandwidth / (bytes + kv) as f64));
            }
            let (p, d) = peer_generate(&python, &model, &prompt, TOKENS);
            pp.push(p);
            pd.push(d);
        }
        let (op, od, pp, pd) = (median(op), median(od), median(pp), median(pd));
        if (mode.as_str(), bits, group) == ("affine", 4, 64) {
            peer_q4 = Some((pp, pd));
        }
        let label = match mode.as_str() {
            "affine" => format!("{bits}-bit, group {group}"),
            m => format!("{m} ({bits}-bit, group {group})"),
        };
        let roof = median(row_bw.clone()) / bytes as f64;
        bandwidths.extend(row_bw);
        println!(
            "| {label} | {:.0} | {op:.1} | {pp:.1} | {:.1}x | {od:.1} | {pd:.1} | {:.1}x | {roof:.0} | {:.0}% | {:.0}% |",
            bytes as f64 / 1e6,
            op / pp,
            od / pd,
            100.0 * median(share),
            100.0 * median(share_kv)
        );
    }
    // Our own format: the float32 bench model imported by `create --quantize q4` into a store
    // (ollama's layout and mixed precision: some tensors stay at 8 bits), against mlx-lm on its
    // own 4-bit conversion of the same model.
    if let Some((pp, pd)) = peer_q4 {
        let work = tempfile::tempdir().unwrap();
        let modelfile = work.path().join("Modelfile");
        std::fs::write(&modelfile, format!("FROM {}\n", base.display())).unwrap();
        let store = work.path().join("models");
        let created = std::process::Command::new(env!("CARGO_BIN_EXE_mlx-runner"))
            .env("MLX_RUNNER_MODELS", &store)
            .args(["create", "bench-q4", "-f"])
            .arg(&modelfile)
            .args(["--quantize", "q4"])
            .output()
            .is_ok_and(|o| o.status.success());
        if !created {
            eprintln!("mlx-runner create --quantize q4 failed");
            return;
        }
        // The blobs that hold tensors (the store keeps config and tokenizer as small blobs).
        let bytes: u64 = std::fs::read_dir(store.join("blobs"))
            .unwrap()
            .flatten()
            .map(|e| e.metadata().unwrap().len())
            .filter(|&n| n > 1 << 20)
            .sum();
        let (mut op, mut od, mut share, mut share_kv) = (vec![], vec![], vec![], vec![]);
        let kv = cache.map_or(0, |(_, kv)| kv);
        let mut row_bw = vec![];
        for _ in 0..ROUNDS * OURS_PER_ROUND {
            let bandwidth = read_bandwidth();
            row_bw.push(bandwidth);
            let g = common::ours_run(
                Path::new("bench-q4"),
                &prompt,
                TOKENS,
                &[("MLX_RUNNER_MODELS", store.as_os_str())],
            );
            op.push(g.prefill);
            od.push(g.decode);
            share.push(g.decode / (bandwidth / bytes as f64));
            share_kv.push(g.decode / (bandwidth / (bytes + kv) as f64));
        }
        let (op, od) = (median(op), median(od));
        let roof = median(row_bw.clone()) / bytes as f64;
        bandwidths.extend(row_bw);
        println!(
            "| `create --quantize q4` (ours; mlx-lm on its 4-bit g64) | {:.0} | {op:.1} | {pp:.1} | {:.1}x | {od:.1} | {pd:.1} | {:.1}x | {roof:.0} | {:.0}% | {:.0}% |",
            bytes as f64 / 1e6,
            op / pp,
            od / pd,
            100.0 * median(share),
            100.0 * median(share_kv)
        );
    }
    println!(
        "\nread bandwidth: median {:.1} GB/s, {:.1}-{:.1} (1 GiB summed on all cores, best of 5, just before each of our runs); a row's roofline tok/s at its runs' median bandwidth, its decode / roofline the median of each run's own",
        median(bandwidths.clone()) / 1e9,
        bandwidths.iter().cloned().fold(f64::MAX, f64::min) / 1e9,
        bandwidths.iter().cloned().fold(0.0, f64::max) / 1e9,
    );
    if let Some((context, kv)) = cache {
        println!(
            "KV cache read per token at the decode's mean context of {context} tokens: {:.1} MB",
            kv as f64 / 1e6
        );
    }
}
