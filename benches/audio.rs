//! gemma4's audio tower at E2B's shape (random weights, benches/audio_peer.py), one 30 s clip
//! (750 soft tokens, the most one item may hold) decoded, turned into log-mel frames and
//! encoded: ours (`models::gemma4_audio_features` + `Gemma4Audio::encode`) against
//! transformers' float32 CPU pipeline (`Gemma4AudioFeatureExtractor`, then
//! `get_audio_features`), side by side on this machine, medians of several runs.
//!
//!     cargo bench --bench audio            (needs .venv-golden: tests/fixtures/requirements.txt)

mod common;

use common::{median, rss_peak, rss_reset, tower_peer, tower_peer_times};
use std::time::Instant;

const RUNS: usize = 3;

fn main() {
    let Some((python, dir)) = tower_peer("audio_peer.py", "target/bench-audio") else {
        return;
    };
    let bytes = std::fs::read(dir.join("clip.wav")).unwrap();
    let (tower, prompt) = models::load_audio_files(
        &models::ModelFiles::dir(&dir).unwrap(),
        models::DtypeChoice::Fixed(mlx::Dtype::F32),
    )
    .unwrap()
    .expect("an audio tower");
    let fx = prompt.features.extractor();
    let mut ours = Vec::new();
    let mut features_s = Vec::new();
    let (mut tokens, mut frames) = (0, 0);
    let mut grew = 0;
    for i in 0..=RUNS {
        // The first (cold) run's growth of resident memory: what an encode takes.
        let base = rss_reset();
        let t0 = Instant::now();
        let (features, _) = models::gemma4_audio_features::prepare_audio(&bytes, &fx).unwrap();
        let t1 = Instant::now();
        frames = features.frames;
        let soft = tower.encode(&features).unwrap();
        soft.eval().unwrap();
        tokens = soft.dim(0).unwrap();
        if i == 0 {
            grew = rss_peak().saturating_sub(base);
        }
        if i > 0 {
            ours.push(t0.elapsed().as_secs_f64());
            features_s.push((t1 - t0).as_secs_f64());
        }
    }
    let (theirs, their_grew) = tower_peer_times(&python, "audio_peer.py", &dir, RUNS);
    let (a, f, b) = (median(ours), median(features_s), median(theirs));
    println!("gemma4 audio tower, E2B shape, 30 s clip -> {frames} frames, {tokens} soft tokens");
    println!("  ours (MLX CPU, float32):           {a:.3} s (decode + log-mel {f:.3} s)");
    println!("  transformers (torch CPU, float32): {b:.3} s");
    println!("  ratio (transformers / ours):       {:.2}x", b / a);
    println!(
        "  resident memory grown by the first encode: ours {:.0} MB, transformers {:.0} MB",
        grew as f64 / 1e6,
        their_grew as f64 / 1e6
    );
}
