//! Real shapes, 4-bit, on the CPU: `cargo bench --bench real_shapes`.
//!
//! Random weights with the real dimensions of gemma4 E2B (35 layers, per-layer embeddings, 20
//! KV-shared layers, 262144-token vocabulary, double-wide MLPs) and of GLM4-MoE-Lite
//! (GLM-4.7-Flash's widths, MLA, 64 experts with 4 active and a shared one, 154880-token
//! vocabulary; 4 layers instead of 47 so it fits here), quantized by mlx-lm to 4 bits, group 64
//! (benches/make_real_shape_models.py writes them into target/real-*-q4 once). Each round runs
//! `mlx-runner generate` and `mlx_lm generate` (same MLX, OpenBLAS preloaded into the peer) on
//! the same prompt: prefill and decode tokens/s and the process's peak resident memory
//! (`wait4`), medians of the rounds, and the ratios. mlx-lm on the CPU goes through MLX's own
//! quantized kernels; mlx-runner through its own (crates/mlx-sys/src/qmm_cpu.cc).
//! `BENCH_REAL=e2b` or `glm` runs one model; `BENCH_REAL_ROUNDS=n` sets the rounds (3).

mod common;
use common::{median, ours_run, peer_python, peer_run, real_shape_model, root, Generation};

use std::path::{Path, PathBuf};

const TOKENS: &str = "8";
const PROMPT: &str =
    "The history of the printing press begins in the fifteenth century, when movable \
                      type made books cheap enough for ordinary readers, and within fifty years \
                      presses were running in more than two hundred cities.";

fn model(python: &Path, which: &str) -> Option<PathBuf> {
    let dir = root().join(format!("target/real-{which}-q4"));
    real_shape_model(python, which, dir, None)
}

fn medians(runs: &[Generation]) -> Generation {
    Generation {
        prefill: median(runs.iter().map(|r| r.prefill).collect()),
        decode: median(runs.iter().map(|r| r.decode).collect()),
        peak_rss: median(runs.iter().map(|r| r.peak_rss as f64).collect()) as u64,
    }
}

fn gb(bytes: u64) -> f64 {
    bytes as f64 / 1e9
}

fn main() {
    let Some(python) = peer_python() else {
        return;
    };
    let rounds: usize = std::env::var("BENCH_REAL_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let only = std::env::var("BENCH_REAL").ok();
    let mut rows = vec![];
    for (which, name) in [
        ("e2b", "gemma4 E2B shape"),
        ("glm", "GLM4-MoE-Lite shape, 4 layers"),
    ] {
        if only.as_deref().is_some_and(|o| o != which) {
            continue;
        }
        let Some(dir) = model(&python, which) else {
            continue;
        };
        let (mut o, mut p) = (vec![], vec![]);
        for round in 0..rounds {
            o.push(ours_run(&dir, PROMPT, TOKENS, &[]));
            p.push(peer_run(&python, &dir, PROMPT, TOKENS));
            let (a, b) = (o.last().unwrap(), p.last().unwrap());
            eprintln!(
                "{which} round {round}: ours prefill {:.2} decode {:.2} rss {:.2} GB | mlx-lm prefill {:.2} decode {:.2} rss {:.2} GB",
                a.prefill, a.decode, gb(a.peak_rss), b.prefill, b.decode, gb(b.peak_rss)
            );
        }
        rows.push((name, medians(&o), medians(&p)));
    }
    println!("\n4-bit (group 64) random weights, ~40-token prompt, {TOKENS} new tokens; medians of {rounds}\n");
    println!("| model | | prefill tok/s | decode tok/s | peak RSS GB |");
    println!("|---|---|---|---|---|");
    for (name, o, p) in rows {
        println!(
            "| {name} | mlx-runner | {:.2} | {:.2} | {:.2} |",
            o.prefill,
            o.decode,
            gb(o.peak_rss)
        );
        println!(
            "| | mlx-lm | {:.2} | {:.2} | {:.2} |",
            p.prefill,
            p.decode,
            gb(p.peak_rss)
        );
        println!(
            "| | ratio | {:.1}x | {:.1}x | {:.2} |",
            o.prefill / p.prefill,
            o.decode / p.decode,
            gb(o.peak_rss) / gb(p.peak_rss)
        );
    }
}
