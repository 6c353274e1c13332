//! Importing and loading stored models: `cargo bench --bench store`.
//!
//! `mlx-runner create --quantize q4` against `mlx_lm convert -q --q-bits 4` (the same MLX, the
//! same machine, the same ~120M-parameter float32 gemma4-shaped checkpoint from
//! benches/make_bench_model.py), and a plain float32 import against mlx-lm's float32 convert;
//! each several rounds, medians, ratio ours / peer (lower is faster for us). Then, in process,
//! the cost of loading the stored q4 model (its blobs' sha256 checked first) against loading
//! mlx-lm's q4 directory, and the digest check on its own. Needs benches/peer-venv.sh.

mod common;
use common::{bench_model, median, peer_python};

use std::path::Path;
use std::process::Command;
use std::time::Instant;

const ROUNDS: usize = 3;

fn timed(mut c: Command) -> f64 {
    let t = Instant::now();
    let out = c.output().expect("spawn");
    assert!(
        out.status.success(),
        "{c:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    t.elapsed().as_secs_f64()
}

fn dir_size(p: &Path) -> u64 {
    std::fs::read_dir(p)
        .map(|d| {
            d.flatten()
                .map(|e| {
                    if e.file_type().is_ok_and(|t| t.is_dir()) {
                        dir_size(&e.path())
                    } else {
                        e.metadata().map(|m| m.len()).unwrap_or(0)
                    }
                })
                .sum()
        })
        .unwrap_or(0)
}

fn main() {
    let Some(python) = peer_python() else {
        return;
    };
    let Some(model) = bench_model(&python) else {
        return;
    };
    let work = tempfile::tempdir().expect("a temporary folder");
    let modelfile = work.path().join("Modelfile");
    std::fs::write(&modelfile, format!("FROM {}\n", model.display())).unwrap();
    let store_root = work.path().join("models");
    let peer_q4 = work.path().join("peer-q4");
    let peer_f32 = work.path().join("peer-f32");

    let mut rows: Vec<(&str, Vec<f64>, Vec<f64>)> = vec![
        ("import, q4", vec![], vec![]),
        ("import, float32", vec![], vec![]),
    ];
    for round in 0..ROUNDS {
        for (i, quant) in [Some("q4"), None].into_iter().enumerate() {
            // A fresh store each time: identical blobs would otherwise be skipped.
            let _ = std::fs::remove_dir_all(&store_root);
            let mut ours = Command::new(env!("CARGO_BIN_EXE_mlx-runner"));
            ours.env("MLX_RUNNER_MODELS", &store_root)
                .args(["create", "bench", "-f"])
                .arg(&modelfile);
            if let Some(q) = quant {
                ours.args(["--quantize", q]);
            }
            let t_ours = timed(ours);

            let out = if quant.is_some() { &peer_q4 } else { &peer_f32 };
            let _ = std::fs::remove_dir_all(out);
            let mut peer = Command::new(&python);
            peer.args(["-m", "mlx_lm", "convert", "--hf-path"])
                .arg(&model)
                .arg("--mlx-path")
                .arg(out);
            if quant.is_some() {
                peer.args(["-q", "--q-bits", "4", "--q-group-size", "64"]);
            }
            let t_peer = timed(peer);
            eprintln!(
                "round {round} {}: ours {t_ours:.2}s, mlx-lm {t_peer:.2}s",
                rows[i].0
            );
            rows[i].1.push(t_ours);
            rows[i].2.push(t_peer);
        }
    }
    // Leave the q4 model in the store for the load measurements.
    let _ = std::fs::remove_dir_all(&store_root);
    let mut ours = Command::new(env!("CARGO_BIN_EXE_mlx-runner"));
    ours.env("MLX_RUNNER_MODELS", &store_root)
        .args(["create", "bench", "-f"])
        .arg(&modelfile)
        .args(["--quantize", "q4"]);
    timed(ours);

    let st = store::Store::open(&store_root);
    let resolved = st.resolve(&"bench".parse().unwrap()).unwrap();
    let (mut load_store, mut load_dir, mut verify) = (vec![], vec![], vec![]);
    for _ in 0..ROUNDS {
        let t = Instant::now();
        resolved.target.verify().unwrap();
        verify.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        drop(models::load_files(&resolved.target, models::DtypeChoice::Auto).unwrap());
        load_store.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        drop(models::load(&peer_q4, models::DtypeChoice::Auto).unwrap());
        load_dir.push(t.elapsed().as_secs_f64());
    }

    println!(
        "\n~120M gemma4-shaped float32 checkpoint ({:.0} MB); seconds, medians of {ROUNDS}\n",
        dir_size(&model) as f64 / 1e6
    );
    println!("| | mlx-runner | mlx-lm | ratio ours / mlx-lm |");
    println!("|---|---|---|---|");
    for (label, ours, peer) in rows {
        let (o, p) = (median(ours), median(peer));
        println!(
            "| {label} (create / convert) | {o:.2} | {p:.2} | {:.2} |",
            o / p
        );
    }
    let (ls, ld) = (median(load_store), median(load_dir));
    println!(
        "| load q4: stored model ({} blobs, digests checked) / mlx-lm's q4 directory | {ls:.2} | {ld:.2} | {:.2} |",
        resolved.target.tensors.len(),
        ls / ld
    );
    println!(
        "\nsha256 check of the stored q4 model ({:.0} MB) alone: {:.2} s",
        dir_size(&store_root) as f64 / 1e6,
        median(verify)
    );
}
