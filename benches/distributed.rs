//! A model split by layers (pipeline) and by tensors over 1, 2 and 3 ranks on this machine's
//! loopback: `cargo bench --bench distributed`.
//!
//! GLM4-MoE-Lite at GLM-4.7-Flash's widths with 12 layers (1 dense + 11 MoE), 4-bit random
//! weights (benches/make_real_shape_models.py writes target/real-glm-q4-12l once). Each rank
//! count and mode runs `mlx-runner generate --hostfile [--parallel-mode tensor]` and mlx-lm's
//! own split (`mlx.launch --backend ring -n N -- python -m mlx_lm.benchmark [--pipeline]`, same
//! MLX, OpenBLAS preloaded) on a prompt of the same length: prefill and decode tok/s, each
//! rank's weights and peak resident memory, and the bytes a token sends between ranks. mlx-lm's
//! gemma4 has no pipeline, so GLM is the model both can split. `BENCH_DIST_MODEL=g31` runs
//! gemma4 31B's widths instead (6 layers, target/real-g31-q4-6l; mlx-lm cannot split gemma4 either
//! way, so ours alone). `BENCH_DIST_RANKS=1,2` picks the rank counts, `BENCH_DIST_MODES=tensor` the
//! modes; `BENCH_DIST_PEER=0` leaves mlx-lm out (it takes minutes a run here).

mod common;
use common::{
    free_port, output_with_peak_rss, peer_python, rate, real_shape_model, root, system_openblas,
};

use std::path::{Path, PathBuf};
use std::process::Command;

const PROMPT_TOKENS: usize = 64;
const NEW_TOKENS: &str = "16";

/// The model (`glm` or `g31`) and its layer count.
fn which() -> (String, &'static str) {
    match std::env::var("BENCH_DIST_MODEL").as_deref() {
        Ok("g31") => ("g31".into(), "6"),
        _ => ("glm".into(), "12"),
    }
}

fn model(python: &Path) -> Option<PathBuf> {
    let (name, layers) = which();
    let dir = root().join(format!("target/real-{name}-q4-{layers}l"));
    real_shape_model(python, &name, dir, Some(layers))
}

/// A hostfile of `n` ranks on loopback.
fn hostfile(n: usize) -> (tempfile::TempDir, PathBuf) {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("hosts.json");
    let hosts: Vec<serde_json::Value> = (0..n)
        .map(|_| serde_json::json!({"ssh": "localhost", "ips": ["127.0.0.1"]}))
        .collect();
    std::fs::write(&p, serde_json::to_vec(&hosts).unwrap()).unwrap();
    (d, p)
}

struct Run {
    prefill: f64,
    decode: f64,
    /// Each rank's weights and peak resident memory, MB.
    weights: Vec<f64>,
    peaks: Vec<f64>,
}

/// A prompt of about `PROMPT_TOKENS` tokens of the padded tokenizer: short words.
fn prompt() -> String {
    ["the"; PROMPT_TOKENS].join(" ")
}

fn ours(model: &Path, ranks: usize, mode: &str) -> Run {
    let mut c = Command::new(env!("CARGO_BIN_EXE_mlx-runner"));
    c.args(["generate", "--model"]).arg(model).args([
        "--prompt",
        &prompt(),
        "-n",
        NEW_TOKENS,
        "--no-draft",
    ]);
    let _hosts = (ranks > 1).then(|| {
        let (d, p) = hostfile(ranks);
        c.arg("--hostfile")
            .arg(&p)
            .args(["--ring-port", &free_port().to_string()])
            .args(["--parallel-mode", mode]);
        d
    });
    let (_, err, rss) = output_with_peak_rss(&mut c);
    assert!(err.contains("generated:"), "{err}");
    let weights = err
        .lines()
        .filter_map(|l| {
            l.split("weights ")
                .nth(1)?
                .strip_suffix(" MB")?
                .parse()
                .ok()
        })
        .collect();
    // One process prints no ranks: its peak is the process's.
    let peaks = err
        .lines()
        .find_map(|l| l.strip_prefix("peak resident MB by rank: "))
        .map(|l| l.split(' ').filter_map(|v| v.parse().ok()).collect())
        .unwrap_or_else(|| vec![rss as f64 / 1e6]);
    Run {
        prefill: rate(&err, "prompt:", "tok/s").unwrap_or(f64::NAN),
        decode: rate(&err, "generated:", "tok/s").unwrap_or(f64::NAN),
        weights,
        peaks,
    }
}

fn peer(python: &Path, model: &Path, ranks: usize, mode: &str) -> Run {
    let bin = python.parent().unwrap();
    let bench = [
        "-m",
        "mlx_lm.benchmark",
        "--model",
        model.to_str().unwrap(),
        "-p",
        &PROMPT_TOKENS.to_string(),
        "-g",
        NEW_TOKENS,
        "-n",
        "1",
    ];
    let mut c = if ranks == 1 {
        let mut c = Command::new(python);
        c.args(bench);
        c
    } else {
        let mut c = Command::new(bin.join("mlx.launch"));
        c.args(["--backend", "ring", "-n", &ranks.to_string()])
            .args(["--starting-port", &free_port().to_string(), "--"])
            .arg(python)
            .args(bench);
        // mlx-lm splits by tensors unless told to pipeline.
        if mode == "pipeline" {
            c.arg("--pipeline");
        }
        c
    };
    if let Some(lib) = system_openblas() {
        c.env("LD_PRELOAD", lib);
    }
    let out = c.output().unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    let avg = text
        .lines()
        .find(|l| l.contains("Averages:"))
        .unwrap_or_default()
        .to_string();
    let field = |k: &str| -> f64 {
        avg.split(&format!("{k}="))
            .nth(1)
            .and_then(|v| v.split(',').next())
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(f64::NAN)
    };
    if avg.is_empty() {
        eprintln!("mlx-lm over {ranks} ranks printed no averages:\n{text}");
    }
    Run {
        prefill: field("prompt_tps"),
        decode: field("generation_tps"),
        weights: vec![],
        // MLX's peak of rank 0, GB.
        peaks: vec![field("peak_memory") * 1e3],
    }
}

fn list(v: &[f64]) -> String {
    let parts: Vec<String> = v.iter().map(|x| format!("{x:.0}")).collect();
    parts.join(" / ")
}

fn main() {
    let Some(python) = peer_python() else {
        return;
    };
    let Some(dir) = model(&python) else {
        return;
    };
    let ranks: Vec<usize> = std::env::var("BENCH_DIST_RANKS")
        .ok()
        .map(|s| s.split(',').filter_map(|v| v.parse().ok()).collect())
        .unwrap_or_else(|| vec![1, 2, 3]);
    let modes: Vec<String> = std::env::var("BENCH_DIST_MODES")
        .ok()
        .map(|s| s.split(',').map(str::to_string).collect())
        .unwrap_or_else(|| vec!["pipeline".into(), "tensor".into()]);
    let (name, layers) = which();
    let with_peer = std::env::var("BENCH_DIST_PEER").as_deref() != Ok("0") && name == "glm";
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    let cfg = cfg.get("text_config").cloned().unwrap_or(cfg);
    let hidden = cfg["hidden_size"].as_u64().unwrap_or(0) as f64;
    let vocab = cfg["vocab_size"].as_u64().unwrap_or(0) as f64;
    let mut rows = Vec::new();
    for &n in &ranks {
        // One process is one row, whatever the mode.
        let modes = if n == 1 { &modes[..1] } else { &modes[..] };
        for mode in modes {
            let mode = if n == 1 { "-" } else { mode.as_str() };
            let o = ours(&dir, n, mode);
            eprintln!(
                "{n} ranks {mode}: ours prefill {:.2} decode {:.2} weights {} peaks {}",
                o.prefill,
                o.decode,
                list(&o.weights),
                list(&o.peaks)
            );
            let p = with_peer.then(|| peer(&python, &dir, n, mode));
            if let Some(p) = &p {
                eprintln!(
                    "{n} ranks {mode}: mlx-lm prefill {:.2} decode {:.2}",
                    p.prefill, p.decode
                );
            }
            rows.push((n, mode.to_string(), o, p));
        }
    }
    let title = if name == "glm" {
        "GLM4-MoE-Lite"
    } else {
        "gemma4 31B"
    };
    println!(
        "\n{title} widths, {layers} layers, 4-bit random weights; {PROMPT_TOKENS}-token prompt, \
         {NEW_TOKENS} new tokens; ranks on one 2-core machine's loopback\n"
    );
    println!("| ranks | split | ours prefill | ours decode | mlx-lm prefill | mlx-lm decode | decode ratio | weights MB by rank | peak RSS MB by rank |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for (n, mode, o, p) in &rows {
        let (pp, pd) = p
            .as_ref()
            .map_or((f64::NAN, f64::NAN), |p| (p.prefill, p.decode));
        println!(
            "| {n} | {mode} | {:.1} | {:.1} | {:.2} | {:.2} | {:.1}x | {} | {} |",
            o.prefill,
            o.decode,
            pp,
            pd,
            o.decode / pd,
            list(&o.weights),
            list(&o.peaks)
        );
    }
    // By layers, a decode step sends the residual stream (hidden × 4 bytes) down the n - 1
    // hops, one after another, and the last rank's float32 logits to every rank: a ring
    // all-sum, whose busiest link carries 2 (n - 1) / n of them. By tensors, each layer sums
    // two residual-stream-wide vectors (a ring all-sum each), the embeddings one more, and the
    // ranks gather the logits (each link carries (n - 1) / n of them); the sums wait on each
    // other, layer by layer.
    let layers: f64 = layers.parse().unwrap_or(0.0);
    println!(
        "\nbytes a decoded token crosses the busiest link with, and the time they add per token:\n"
    );
    println!("| ranks | split | bytes/token | 10 Gb/s | 100 Gb/s |");
    println!("|---|---|---|---|---|");
    for &n in &ranks {
        if n < 2 {
            continue;
        }
        let share = (n - 1) as f64 / n as f64;
        for mode in &modes {
            let bytes = if mode == "tensor" {
                (layers * 2.0 + 1.0) * 2.0 * share * hidden * 4.0 + share * vocab * 4.0
            } else {
                (n - 1) as f64 * hidden * 4.0 + 2.0 * share * vocab * 4.0
            };
            let at = |gbit: f64| bytes * 8.0 / (gbit * 1e9) * 1e3;
            println!(
                "| {n} | {mode} | {:.0} KB | {:.2} ms | {:.3} ms |",
                bytes / 1e3,
                at(10.0),
                at(100.0)
            );
        }
    }
}
