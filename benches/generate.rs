//! End-to-end generation against the peer: `cargo bench --bench generate`.
//!
//! `mlx-runner generate` against `mlx_lm generate` (Python, the same MLX 0.32.4, the same
//! machine, the same weights and prompt), one after the other, several rounds, medians and the
//! ratio ours / peer for prefill and decode tokens per second. The model is a randomly
//! initialised ~120M-parameter gemma4-shaped text model in float32 that mlx-lm itself writes
//! (benches/make_bench_model.py) into target/bench-model. The peer gets OpenBLAS preloaded
//! when the system has it, so both sides run the same BLAS (decision D6). Needs the peer
//! environment from benches/peer-venv.sh.

mod common;
use common::{bench_model, median, peer_python, root};

use std::path::Path;
use std::process::Command;

const ROUNDS: usize = 3;
const TOKENS: &str = "64";

/// The number just before `unit` on the line that starts with `label`.
fn rate(text: &str, label: &str, unit: &str) -> Option<f64> {
    let line = text.lines().find(|l| l.contains(label))?;
    let at = line.find(label)? + label.len();
    let rest = &line[at..];
    let end = rest.find(unit)?;
    rest[..end]
        .rsplit([',', ' '])
        .find(|s| !s.is_empty())?
        .trim()
        .parse()
        .ok()
}

fn prompt() -> String {
    let text =
        std::fs::read_to_string(root().join("tests/fixtures/generate.py")).unwrap_or_default();
    let start = text.find("CORPUS = \"\"\"").map(|i| i + 12).unwrap_or(0);
    let end = text[start..]
        .find("\"\"\"")
        .map(|i| start + i)
        .unwrap_or(text.len());
    let corpus = text[start..end].replace('\n', " ");
    corpus.repeat(4).chars().take(2600).collect()
}

fn main() {
    let Some(python) = peer_python() else {
        return;
    };
    let Some(model) = bench_model(&python) else {
        return;
    };
    let openblas = [
        "/lib/x86_64-linux-gnu/libopenblas.so.0",
        "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    ]
    .into_iter()
    .find(|p| Path::new(p).exists());
    let prompt = prompt();
    let (mut ours_p, mut ours_d, mut peer_p, mut peer_d) = (vec![], vec![], vec![], vec![]);
    for round in 0..ROUNDS {
        let out = Command::new(env!("CARGO_BIN_EXE_mlx-runner"))
            .args(["generate", "--model"])
            .arg(&model)
            .args(["--prompt", &prompt, "-n", TOKENS])
            .output()
            .expect("run mlx-runner");
        let err = String::from_utf8_lossy(&out.stderr);
        ours_p.push(rate(&err, "prompt:", "tok/s").unwrap_or(f64::NAN));
        ours_d.push(rate(&err, "generated:", "tok/s").unwrap_or(f64::NAN));

        let mut peer = Command::new(&python);
        peer.args(["-m", "mlx_lm", "generate", "--model"])
            .arg(&model)
            .args(["--prompt", &prompt, "-m", TOKENS, "--ignore-chat-template"]);
        if let Some(lib) = openblas {
            peer.env("LD_PRELOAD", lib);
        }
        let out = peer.output().expect("run mlx_lm");
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        peer_p.push(rate(&text, "Prompt:", "tokens-per-sec").unwrap_or(f64::NAN));
        peer_d.push(rate(&text, "Generation:", "tokens-per-sec").unwrap_or(f64::NAN));
        eprintln!(
            "round {round}: ours prefill {:.1} decode {:.1} | mlx-lm prefill {:.1} decode {:.1}",
            ours_p[round], ours_d[round], peer_p[round], peer_d[round]
        );
    }
    let (op, od, pp, pd) = (
        median(ours_p),
        median(ours_d),
        median(peer_p),
        median(peer_d),
    );
    println!("\n~120M gemma4-shaped model, float32, ~1200-token prompt, {TOKENS} new tokens; medians of {ROUNDS}\n");
    println!("| | prefill tok/s | decode tok/s |");
    println!("|---|---|---|");
    println!("| mlx-runner generate | {op:.1} | {od:.1} |");
    println!("| mlx_lm generate | {pp:.1} | {pd:.1} |");
    println!("| ratio ours / mlx-lm | {:.2} | {:.2} |", op / pp, od / pd);
}
