//! gemma4's audio input against transformers (tests/fixtures/models/gemma4_audio_like, made by
//! tests/fixtures/generate.py): clips decoded as libsndfile decodes them, log-mel frames as
//! `Gemma4AudioFeatureExtractor` computes them, the tower and embedder as
//! `Gemma4AudioModel` + `embed_audio` run, and a prompt with a clip and an image through the
//! whole model.

use mlx::{Array, Dtype};
use models::gemma4_audio::{AudioConfig, Gemma4Audio};
use models::gemma4_audio_features::{
    decode_audio, prepare_audio, AudioFeatureConfig, AudioFeatures, FeatureExtractor,
};
use models::media::{MediaInput, Towers};
use models::{DtypeChoice, MediaKind, ModelFiles};
use std::collections::HashMap;
use std::path::PathBuf;

mod common;
use common::{argmax_rows, mm_logits};

const CLIPS: [&str; 3] = ["speechlike", "odd", "short"];

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models/gemma4_audio_like")
}

fn golden() -> HashMap<String, Array> {
    mlx::io::load_safetensors(fixture().join("golden.safetensors"))
        .unwrap()
        .arrays
}

fn towers() -> Towers {
    Towers::load(
        &ModelFiles::dir(&fixture()).unwrap(),
        DtypeChoice::Fixed(Dtype::F32),
    )
    .unwrap()
    .0
}

fn extractor() -> FeatureExtractor {
    AudioFeatureConfig::load_files(&ModelFiles::dir(&fixture()).unwrap())
        .unwrap()
        .expect("the fixture has a feature extractor")
        .extractor()
}

fn f32s(a: &Array) -> Vec<f32> {
    a.astype(Dtype::F32).unwrap().to_vec::<f32>().unwrap()
}

fn worst(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The extractor's valid frames of clip `name`, from the golden file.
fn golden_features(g: &HashMap<String, Array>, name: &str) -> AudioFeatures {
    let mask = g[&format!("audio.{name}.mask")].to_vec::<i32>().unwrap();
    let frames = mask.iter().filter(|&&m| m != 0).count();
    let all = f32s(&g[&format!("audio.{name}.features")]);
    AudioFeatures {
        values: all[..frames * 128].to_vec(),
        frames,
        mel: 128,
    }
}

fn clip_bytes(name: &str) -> Vec<u8> {
    std::fs::read(fixture().join("audio").join(name)).unwrap()
}

#[test]
fn wav_clips_decode_to_the_samples_the_extractor_read() {
    let g = golden();
    for name in CLIPS {
        let d = decode_audio(&clip_bytes(&format!("{name}.wav")), 30.0).unwrap();
        assert_eq!((d.rate, d.channels), (16_000, 1), "{name}");
        // 16-bit PCM over 32768: exactly the float32 samples transformers was given.
        assert_eq!(
            d.samples,
            f32s(&g[&format!("audio.{name}.waveform")]),
            "{name}"
        );
    }
}

#[test]
fn other_containers_decode_as_libsndfile_decodes_them() {
    let g = golden();
    // FLAC is lossless: the mean of its two channels, exactly.
    let d = decode_audio(&clip_bytes("stereo.flac"), 30.0).unwrap();
    assert_eq!((d.rate, d.channels), (16_000, 2));
    let both = f32s(&g["audio.stereo.flac.decoded"]);
    let (l, r) = both.split_at(both.len() / 2);
    let mono: Vec<f32> = l.iter().zip(r).map(|(a, b)| (a + b) / 2.0).collect();
    assert!(worst(&d.samples, &mono) <= 1e-7);
    // Lossy codecs: another decoder's output, sample for sample, within what their float
    // arithmetic differs by.
    for (file, tol) in [("speech.ogg", 1e-5), ("speech.mp3", 1e-5)] {
        let d = decode_audio(&clip_bytes(file), 30.0).unwrap();
        let theirs = f32s(&g[&format!("audio.{file}.decoded")]);
        assert_eq!(d.rate, 16_000, "{file}");
        let n = d.samples.len().min(theirs.len());
        assert!(
            d.samples.len().abs_diff(theirs.len()) <= 1152,
            "{file}: {} samples against {}",
            d.samples.len(),
            theirs.len()
        );
        let e = worst(&d.samples[..n], &theirs[..n]);
        assert!(e <= tol, "{file}: differs by {e}");
    }
}

#[test]
fn clips_become_the_extractors_log_mel_frames() {
    let (g, fx) = (golden(), extractor());
    for name in CLIPS {
        let wave = f32s(&g[&format!("audio.{name}.waveform")]);
        let ours = fx.features(&wave);
        let theirs = golden_features(&g, name);
        assert_eq!(ours.frames, theirs.frames, "{name}");
        let e = worst(&ours.values, &theirs.values);
        assert!(e <= 1e-5, "{name}: log-mel differs by {e}");
    }
}

#[test]
fn a_clip_at_another_rate_is_resampled_and_mixed_down() {
    let fx = extractor();
    // Half a second of speech labelled 44.1 kHz, two equal channels.
    let (f, seconds) = prepare_audio(&clip_bytes("stereo44k.wav"), &fx).unwrap();
    assert!((seconds - 8000.0 / 44100.0).abs() < 1e-9);
    assert_eq!(f.frames, fx.config().frames_for(2903));
    assert_eq!(f.mel, 128);
}

#[test]
fn clips_encode_as_transformers_encodes_them() {
    let (t, g) = (towers(), golden());
    let audio: &Gemma4Audio = t.audio.as_ref().expect("the fixture has an audio tower");
    for name in CLIPS {
        let f = golden_features(&g, name);
        let tower = audio.tower(&f).unwrap();
        let want = &g[&format!("audio.{name}.tower")];
        assert_eq!(tower.shape(), want.shape(), "{name}");
        assert_eq!(
            tower.dim(0).unwrap() as usize,
            AudioConfig::soft_tokens(f.frames)
        );
        let e = worst(&f32s(&tower), &f32s(want));
        assert!(e <= 1e-4, "{name}: tower output differs by {e}");
        let soft = t.encode(&MediaInput::Audio(f)).unwrap();
        let e = worst(&f32s(&soft), &f32s(&g[&format!("audio.{name}.embeds")]));
        assert!(e <= 1e-4, "{name}: soft tokens differ by {e}");
    }
}

/// A prompt with a clip, then an image, through the whole model against transformers'
/// `Gemma4ForConditionalGeneration`, in one pass and in passes cut between the items, from our
/// own soft tokens.
#[test]
fn a_prompt_with_a_clip_and_an_image_gives_transformers_logits() {
    let (t, g) = (towers(), golden());
    let fx = extractor();
    let (clip, _) = prepare_audio(&clip_bytes("speechlike.wav"), &fx).unwrap();
    let image = t.vision.as_ref().unwrap().cfg.patch_size;
    assert_eq!(image, 4);
    let processor = models::gemma4_image::ImageProcessorConfig::load_files(
        &ModelFiles::dir(&fixture()).unwrap(),
    )
    .unwrap()
    .unwrap();
    let patches = processor.preprocess(&clip_bytes("wide.png")).unwrap();
    let items = [
        (
            t.encode(&MediaInput::Audio(clip)).unwrap(),
            MediaKind::Audio,
        ),
        (
            t.encode(&MediaInput::Image(patches)).unwrap(),
            MediaKind::Image,
        ),
    ];
    let ids = g["mm.input_ids"].to_vec::<i32>().unwrap();
    let want = f32s(&g["mm.logits"]);
    let n = ids.len();
    let vocab = want.len() / n;
    // Whole; cut after the clip; cut before the image.
    for passes in [vec![n], vec![30, n - 30], vec![4, 28, n - 32]] {
        let got = mm_logits(&fixture(), &ids, &items, &passes, |t| t == 508 || t == 511);
        let e = worst(&got, &want);
        assert!(e <= 1e-4, "passes {passes:?}: logits differ by {e}");
        assert_eq!(
            argmax_rows(&got, vocab),
            argmax_rows(&want, vocab),
            "passes {passes:?}"
        );
    }
}

#[test]
fn bad_clips_are_refused_by_name() {
    let fx = extractor();
    let err = |bytes: &[u8]| prepare_audio(bytes, &fx).unwrap_err().to_string();
    let wav = clip_bytes("speechlike.wav");
    // A header that promises more than the file holds, cut inside the header.
    assert!(
        err(&wav[..30]).contains("could not be read"),
        "{}",
        err(&wav[..30])
    );
    assert!(err(b"RIFF\x24\0\0\0WAVEjunkjunk").contains("could not be read"));
    // Too short for one analysis window (10 ms at 16 kHz: 160 samples + the header).
    let mut short = wav[..44].to_vec();
    short.extend_from_slice(&wav[44..44 + 2 * 100]);
    let e = err(&short);
    assert!(e.contains("shorter than one"), "{e}");
    // Longer than 30 s: refused while decoding.
    let header = |samples: u32| {
        let mut h = b"RIFF".to_vec();
        h.extend((36 + 2 * samples).to_le_bytes());
        h.extend(b"WAVEfmt ");
        h.extend(16u32.to_le_bytes());
        h.extend(1u16.to_le_bytes());
        h.extend(1u16.to_le_bytes());
        h.extend(16_000u32.to_le_bytes());
        h.extend(32_000u32.to_le_bytes());
        h.extend(2u16.to_le_bytes());
        h.extend(16u16.to_le_bytes());
        h.extend(b"data");
        h.extend((2 * samples).to_le_bytes());
        h
    };
    let samples = 31 * 16_000;
    let mut long = header(samples);
    long.resize(long.len() + 2 * samples as usize, 0);
    let e = err(&long);
    assert!(e.contains("longer than 30 s"), "{e}");
    // Exactly 30 s is taken.
    let mut ok = header(30 * 16_000);
    ok.resize(ok.len() + 2 * 30 * 16_000, 0);
    let (f, _) = prepare_audio(&ok, &fx).unwrap();
    assert_eq!(AudioConfig::soft_tokens(f.frames), 750);
}
