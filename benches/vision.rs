//! gemma4's vision tower at E2B's shape (random weights, benches/vision_peer.py), one 640x480
//! image preprocessed and encoded: ours (`models::gemma4_image` + `Gemma4Vision::encode`)
//! against transformers' float32 CPU pipeline (`Gemma4ImageProcessorPil`, then
//! `get_image_features`), side by side on this machine, medians of several runs.
//!
//!     cargo bench --bench vision            (needs .venv-golden: tests/fixtures/requirements.txt)

mod common;

use common::{median, root};
use std::process::Command;
use std::time::Instant;

const RUNS: usize = 3;

fn main() {
    let python = root().join(".venv-golden/bin/python");
    if !python.exists() {
        eprintln!("no .venv-golden (tests/fixtures/requirements.txt): skipping");
        return;
    }
    let dir = root().join("target/bench-vision");
    let script = root().join("benches/vision_peer.py");
    if !dir.join("model.safetensors").exists() {
        let ok = Command::new(&python)
            .arg(&script)
            .args(["make"])
            .arg(&dir)
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "could not write the vision benchmark model");
    }
    let bytes = std::fs::read(dir.join("image.png")).unwrap();
    let (tower, prompt) = models::load_vision_files(
        &models::ModelFiles::dir(&dir).unwrap(),
        models::DtypeChoice::Fixed(mlx::Dtype::F32),
    )
    .unwrap()
    .expect("a vision tower");
    let mut ours = Vec::new();
    let (mut tokens, mut patches_n) = (0, 0);
    for i in 0..=RUNS {
        let t0 = Instant::now();
        let patches = prompt.processor.preprocess(&bytes).unwrap();
        patches_n = patches.positions.len();
        let soft = tower.encode(&patches).unwrap();
        soft.eval().unwrap();
        tokens = soft.dim(0).unwrap();
        if i > 0 {
            ours.push(t0.elapsed().as_secs_f64());
        }
    }
    let out = Command::new(&python)
        .arg(&script)
        .arg("time")
        .arg(&dir)
        .arg(RUNS.to_string())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let theirs: Vec<f64> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .skip(1)
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    let (a, b) = (median(ours), median(theirs));
    println!(
        "gemma4 vision tower, E2B shape, 640x480 image -> {patches_n} patches, {tokens} soft tokens"
    );
    println!("  ours (MLX CPU, float32):         {a:.3} s");
    println!("  transformers (torch CPU, float32): {b:.3} s");
    println!("  ratio (transformers / ours):     {:.2}x", b / a);
}
