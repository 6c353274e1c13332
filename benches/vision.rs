//! gemma4's vision tower at E2B's shape (random weights, benches/vision_peer.py), one 640x480
//! image preprocessed and encoded: ours (`models::gemma4_image` + `Gemma4Vision::encode`)
//! against two peers on this machine, float32 on the CPU: transformers
//! (`Gemma4ImageProcessorPil`, then `get_image_features`) and mlx-vlm (its gemma4 image
//! processor, vision tower and embedder on pip's MLX CPU build: benches/vlm_peer.py). Medians of
//! several runs; mlx-vlm takes minutes an image, so it runs once.
//!
//!     cargo bench --bench vision     (needs .venv-golden: tests/fixtures/requirements.txt;
//!                                     mlx-vlm from benches/peer-venv.sh, skipped without it)

mod common;

use common::{median, rss_peak, rss_reset, tower_peer, tower_peer_times, vlm_peer};
use std::time::Instant;

const RUNS: usize = 3;
const VLM_RUNS: usize = 1;

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
    let mut preprocess = Vec::new();
    let (mut tokens, mut patches_n) = (0, 0);
    let mut grew = 0;
    for i in 0..=RUNS {
        // The first (cold) run's growth of resident memory: what an encode takes.
        let base = rss_reset();
        let t0 = Instant::now();
        let patches = prompt.processor.preprocess(&bytes).unwrap();
        let t1 = Instant::now();
        patches_n = patches.positions.len();
        let soft = tower.encode(&patches).unwrap();
        soft.eval().unwrap();
        tokens = soft.dim(0).unwrap();
        if i == 0 {
            grew = rss_peak().saturating_sub(base);
        }
        if i > 0 {
            ours.push(t0.elapsed().as_secs_f64());
            preprocess.push((t1 - t0).as_secs_f64());
        }
    }
    let d = dir.display().to_string();
    let (hf, hf_grew) = tower_peer_times(
        &python,
        "vision_peer.py",
        &["time".into(), d.clone(), RUNS.to_string()],
    );
    let vlm = vlm_peer().map(|py| {
        tower_peer_times(
            &py,
            "vlm_peer.py",
            &["vision".into(), d, VLM_RUNS.to_string()],
        )
    });
    let (a, p) = (median(ours), median(preprocess));
    println!(
        "gemma4 vision tower, E2B shape, 640x480 image -> {patches_n} patches, {tokens} soft tokens"
    );
    println!("  ours (MLX CPU, float32):   {a:.3} s (preprocessing {p:.3} s)");
    let peer = |name: &str, times: Vec<f64>, peak: u64| {
        let b = median(times);
        println!(
            "  {name:<25} {b:.3} s: ours takes {:.3}x its time; resident memory grown by the first \
             encode {:.0} MB (ours {:.0} MB)",
            a / b,
            peak as f64 / 1e6,
            grew as f64 / 1e6
        );
    };
    peer("transformers (torch CPU):", hf, hf_grew);
    if let Some((times, peak)) = vlm {
        peer("mlx-vlm (pip MLX CPU):", times, peak);
    }
}
