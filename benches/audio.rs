//! gemma4's audio tower at E2B's shape (random weights, benches/audio_peer.py): a 10 s clip and
//! a 30 s one (750 soft tokens, the most one item may hold) decoded, turned into log-mel frames
//! and encoded: ours (`models::gemma4_audio_features` + `Gemma4Audio::encode`) against two peers
//! on this machine, float32 on the CPU: transformers (`Gemma4AudioFeatureExtractor`, then
//! `get_audio_features`) and, for the 10 s clip, mlx-vlm (its feature extractor, audio tower
//! and embedder on pip's MLX CPU build: benches/vlm_peer.py). Medians of several runs.
//!
//!     cargo bench --bench audio      (needs .venv-golden: tests/fixtures/requirements.txt;
//!                                     mlx-vlm from benches/peer-venv.sh, skipped without it)

mod common;

use common::{median, rss_peak, rss_reset, tower_peer, tower_peer_times, vlm_peer};
use std::time::Instant;

const RUNS: usize = 3;
const VLM_RUNS: usize = 2;

fn main() {
    let Some((python, dir)) = tower_peer("audio_peer.py", "target/bench-audio") else {
        return;
    };
    let wav = std::fs::read(dir.join("clip.wav")).unwrap();
    let (tower, prompt) = models::load_audio_files(
        &models::ModelFiles::dir(&dir).unwrap(),
        models::DtypeChoice::Fixed(mlx::Dtype::F32),
    )
    .unwrap()
    .expect("an audio tower");
    let fx = prompt.features.extractor();
    let vlm = vlm_peer();
    let d = dir.display().to_string();
    for seconds in [10, 30] {
        let bytes = wav_prefix(&wav, seconds);
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
        let args = |runs: usize| vec![d.clone(), runs.to_string(), seconds.to_string()];
        let hf = tower_peer_times(
            &python,
            "audio_peer.py",
            &[&["time".into()], &args(RUNS)[..]].concat(),
        );
        let mlx_vlm = vlm.as_ref().filter(|_| seconds == 10).map(|py| {
            tower_peer_times(
                py,
                "vlm_peer.py",
                &[&["audio".into()], &args(VLM_RUNS)[..]].concat(),
            )
        });
        let (a, f) = (median(ours), median(features_s));
        println!(
            "gemma4 audio tower, E2B shape, {seconds} s clip -> {frames} frames, {tokens} soft tokens"
        );
        println!("  ours (MLX CPU, float32):   {a:.3} s (decode + log-mel {f:.3} s)");
        let peer = |name: &str, (times, peak): (Vec<f64>, u64)| {
            let b = median(times);
            println!(
                "  {name:<25} {b:.3} s: ours takes {:.3}x its time; resident memory grown by the \
                 first encode {:.0} MB (ours {:.0} MB)",
                a / b,
                peak as f64 / 1e6,
                grew as f64 / 1e6
            );
        };
        peer("transformers (torch CPU):", hf);
        if let Some(m) = mlx_vlm {
            peer("mlx-vlm (pip MLX CPU):", m);
        }
    }
}

/// The first `seconds` of a 16-bit mono WAV file, as a WAV file of its own (the peers cut the
/// same samples from the same file).
fn wav_prefix(wav: &[u8], seconds: usize) -> Vec<u8> {
    let data = wav
        .windows(4)
        .position(|w| w == b"data")
        .expect("a data chunk");
    let rate = u32::from_le_bytes(wav[24..28].try_into().unwrap()) as usize;
    let body = &wav[data + 8..];
    let body = &body[..body.len().min(seconds * rate * 2)];
    let mut out = wav[..data + 8].to_vec();
    out[data + 4..data + 8].copy_from_slice(&(body.len() as u32).to_le_bytes());
    let riff = (out.len() + body.len() - 8) as u32;
    out[4..8].copy_from_slice(&riff.to_le_bytes());
    out.extend_from_slice(body);
    out
}
