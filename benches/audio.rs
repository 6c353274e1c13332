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

use common::{print_tower_peer, tower_peer, tower_peer_times, tower_runs, vlm_peer};

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
        let ours = tower_runs(
            RUNS,
            || {
                models::gemma4_audio_features::prepare_audio(&bytes, &fx)
                    .unwrap()
                    .0
            },
            |features| tower.encode(features).unwrap(),
        );
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
        println!(
            "gemma4 audio tower, E2B shape, {seconds} s clip -> {} frames, {} soft tokens",
            ours.prepared.frames, ours.tokens
        );
        println!(
            "  ours (MLX CPU, float32):   {:.3} s (decode + log-mel {:.3} s)",
            ours.total, ours.prepare
        );
        print_tower_peer("transformers (torch CPU):", &ours, hf);
        if let Some(m) = mlx_vlm {
            print_tower_peer("mlx-vlm (pip MLX CPU):", &ours, m);
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
