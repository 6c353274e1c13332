//! End-to-end generation against the peer: `cargo bench --bench generate`.
//!
//! `mlx-runner generate` against `mlx_lm generate` (Python, the same MLX 0.32.4, the same
//! machine, the same weights and prompt), one after the other, several rounds, medians and the
//! ratio ours / peer for prefill and decode tokens per second. The model is a randomly
//! initialised ~120M-parameter gemma4-shaped text model in float32 that mlx-lm itself writes
//! (benches/make_bench_model.py) into target/bench-model. The peer gets OpenBLAS preloaded
//! when the system has it, so both sides run the same BLAS (docs/ARCHITECTURE.md, D6). Needs the peer
//! environment from benches/peer-venv.sh.

mod common;
use common::{bench_model, corpus_prompt, median, ours_generate, peer_generate, peer_python};

const ROUNDS: usize = 3;
const TOKENS: &str = "64";

fn main() {
    let Some(python) = peer_python() else {
        return;
    };
    let Some(model) = bench_model(&python) else {
        return;
    };
    let prompt = corpus_prompt(2600);
    let (mut ours_p, mut ours_d, mut peer_p, mut peer_d) = (vec![], vec![], vec![], vec![]);
    for round in 0..ROUNDS {
        let (p, d) = ours_generate(&model, &prompt, TOKENS);
        ours_p.push(p);
        ours_d.push(d);
        let (p, d) = peer_generate(&python, &model, &prompt, TOKENS);
        peer_p.push(p);
        peer_d.push(d);
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
