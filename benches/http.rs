//! The runner over HTTP: `cargo bench --bench http`.
//!
//! On the benchmark model (target/bench-model, see benches/generate.rs): decode tokens/s and
//! time to first token of `mlx-runner runner` through HTTP, against `mlx-runner generate`
//! in-process (the protocol's overhead), and the same streamed request against
//! `mlx_lm.server` on the same weights (the peer; OpenBLAS preloaded when present). Both servers
//! are timed from the client: time to the first streamed text, and tokens after the first over
//! the time after it. Medians of several runs.

mod common;
use common::{median, peer_server, root, runner, stream_ours, stream_peer};

use std::path::Path;
use std::process::Command;

const ROUNDS: usize = 5;
const TOKENS: usize = 48;

/// (time to first text in seconds, decode tokens/s) for one streamed request.
fn ours(port: u16, prompt: &str) -> (f64, f64) {
    let t = stream_ours(port, prompt, TOKENS);
    (t.ttft(), t.decode_rate())
}

fn peer(port: u16, prompt: &str) -> (f64, f64) {
    let t = stream_peer(port, prompt, TOKENS);
    (t.ttft(), t.decode_rate())
}

fn in_process(model: &Path, prompt: &str) -> f64 {
    let out = Command::new(env!("CARGO_BIN_EXE_mlx-runner"))
        .args(["generate", "--model"])
        .arg(model)
        .args(["--prompt", prompt, "-n", &TOKENS.to_string()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    let line = err.lines().find(|l| l.contains("generated:")).unwrap_or("");
    line.rsplit("generated:")
        .next()
        .and_then(|s| s.split(',').nth(1))
        .and_then(|s| s.trim().trim_end_matches(" tok/s").parse().ok())
        .unwrap_or(f64::NAN)
}

fn main() {
    let python = root().join(".venv-peer/bin/python");
    let model = root().join("target/bench-model");
    if !python.exists() || !model.join("model.safetensors").exists() {
        eprintln!("run benches/peer-venv.sh and `cargo bench --bench generate` first (it writes the model)");
        return;
    }
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(12);
    let (_ours, port) = runner(&model, &[]);
    let (_peer, peer_port) = peer_server(&python, &model, &[]);
    let (mut ot, mut od, mut pt, mut pd, mut ip) = (vec![], vec![], vec![], vec![], vec![]);
    for round in 0..ROUNDS {
        // A different prompt per round keeps any prefix cache out of the measurement.
        let p = format!("Round {round}. {prompt}");
        let (t, d) = ours(port, &p);
        ot.push(t);
        od.push(d);
        let (t, d) = peer(peer_port, &p);
        pt.push(t);
        pd.push(d);
        ip.push(in_process(&model, &p));
        eprintln!("round {round}: ours ttft {:.3}s {:.1} tok/s | mlx_lm.server ttft {:.3}s {:.1} tok/s | in-process {:.1} tok/s", ot[round], od[round], pt[round], pd[round], ip[round]);
    }
    let (ot, od, pt, pd, ip) = (median(ot), median(od), median(pt), median(pd), median(ip));
    println!("\n~120M gemma4-shaped model, float32, ~330-token prompt, {TOKENS} new tokens; medians of {ROUNDS}\n");
    println!("| | time to first token | decode tok/s |");
    println!("|---|---|---|");
    println!(
        "| mlx-runner runner (HTTP) | {:.0} ms | {od:.1} |",
        ot * 1e3
    );
    println!("| mlx-runner generate (in-process) | | {ip:.1} |");
    println!("| mlx_lm.server (HTTP) | {:.0} ms | {pd:.1} |", pt * 1e3);
    println!("\nHTTP / in-process decode: {:.2}; ours / mlx_lm.server: decode {:.2}, TTFT {:.2} (lower is better)", od / ip, od / pd, ot / pt);
}
