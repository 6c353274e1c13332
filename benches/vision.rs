//! gemma4's vision tower at E2B's shape (random weights, benches/vision_peer.py), one 640x480
//! image preprocessed and encoded: ours (`models::gemma4_image` + `Gemma4Vision::encode`)
//! against transformers' float32 CPU pipeline (`Gemma4ImageProcessorPil`, then
//! `get_image_features`), side by side on this machine, medians of several runs.
//!
//!     cargo bench --bench vision            (needs .venv-golden: tests/fixtures/requirements.txt)

mod common;

use common::{median, rss_peak, rss_reset, tower_peer, tower_peer_times};
use std::time::Instant;

const RUNS: usize = 3;

fn main() {
    let Some((python, dir)) = tower_peer("vision_peer.py", "target/bench-vision") else {
        return;
    };
    let bytes = std::fs::read(dir.join("image.png")).unwrap();
    let (tower, prompt) = models::load_vision_files(
        &models::ModelFiles::dir(&dir).unwrap(),
        models::DtypeChoice::Fixed(mlx::Dtype::F32),
    )
    .unwrap()
    .expect("a vision tower");
    let mut ours = Vec::new();
    let (mut tokens, mut patches_n) = (0, 0);
    let mut grew = 0;
    for i in 0..=RUNS {
        // The first (cold) run's growth of resident memory: what an encode takes.
        let base = rss_reset();
        let t0 = Instant::now();
        let patches = prompt.processor.preprocess(&bytes).unwrap();
        patches_n = patches.positions.len();
        let soft = tower.encode(&patches).unwrap();
        soft.eval().unwrap();
        tokens = soft.dim(0).unwrap();
        if i == 0 {
            grew = rss_peak().saturating_sub(base);
        }
        if i > 0 {
            ours.push(t0.elapsed().as_secs_f64());
        }
    }
    let (theirs, their_grew) = tower_peer_times(&python, "vision_peer.py", &dir, RUNS);
    let (a, b) = (median(ours), median(theirs));
    println!(
        "gemma4 vision tower, E2B shape, 640x480 image -> {patches_n} patches, {tokens} soft tokens"
    );
    println!("  ours (MLX CPU, float32):         {a:.3} s");
    println!("  transformers (torch CPU, float32): {b:.3} s");
    println!("  ratio (transformers / ours):     {:.2}x", b / a);
    println!(
        "  resident memory grown by the first encode: ours {:.0} MB, transformers {:.0} MB",
        grew as f64 / 1e6,
        their_grew as f64 / 1e6
    );
}
