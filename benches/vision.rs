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

use common::{print_tower_peer, tower_peer, tower_peer_times, tower_runs, vlm_peer};

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
    let ours = tower_runs(
        RUNS,
        || prompt.processor.preprocess(&bytes).unwrap(),
        |patches| tower.encode(patches).unwrap(),
    );
    let d = dir.display().to_string();
    let hf = tower_peer_times(
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
    println!(
        "gemma4 vision tower, E2B shape, 640x480 image -> {} patches, {} soft tokens",
        ours.prepared.positions.len(),
        ours.tokens
    );
    println!(
        "  ours (MLX CPU, float32):   {:.3} s (preprocessing {:.3} s)",
        ours.total, ours.prepare
    );
    print_tower_peer("transformers (torch CPU):", &ours, hf);
    if let Some(v) = vlm {
        print_tower_peer("mlx-vlm (pip MLX CPU):", &ours, v);
    }
}
