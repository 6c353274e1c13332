//! gemma4's audio input: a clip's bytes decoded (WAV, MP3, FLAC, Ogg Vorbis), mixed down to
//! one channel, resampled to the model's rate and turned into the log-mel frames the audio
//! tower reads, as transformers' `Gemma4AudioFeatureExtractor` computes them (docs/MODELS.md
//! §1.6). Plain data on the CPU: this runs off the engine thread.

use crate::config::JsonFile;
use crate::{ModelError, Result};
use realfft::RealFftPlanner;
use serde::Deserialize;
use serde_json::Value;
use std::sync::Arc;

/// The feature extractor's settings (transformers' `Gemma4AudioFeatureExtractor` arguments).
#[derive(Debug, Clone, Deserialize)]
pub struct AudioFeatureConfig {
    #[serde(default = "default_feature_size")]
    pub feature_size: usize,
    #[serde(default = "default_rate")]
    pub sampling_rate: u32,
    #[serde(default = "default_frame_ms")]
    pub frame_length_ms: f64,
    #[serde(default = "default_hop_ms")]
    pub hop_length_ms: f64,
    #[serde(default)]
    pub min_frequency: f64,
    #[serde(default = "default_max_frequency")]
    pub max_frequency: f64,
    #[serde(default)]
    pub preemphasis: f64,
    #[serde(default = "yes")]
    pub preemphasis_htk_flavor: bool,
    #[serde(default)]
    pub fft_overdrive: bool,
    #[serde(default)]
    pub dither: f64,
    #[serde(default = "one")]
    pub input_scale_factor: f64,
    #[serde(default = "default_mel_floor")]
    pub mel_floor: f64,
    #[serde(default)]
    pub per_bin_mean: Option<Vec<f64>>,
    #[serde(default)]
    pub per_bin_stddev: Option<Vec<f64>>,
    /// Samples the extractor takes from one clip (transformers' `max_length`: 30 s at 16 kHz).
    #[serde(default = "default_max_samples")]
    pub max_samples: usize,
}

fn default_feature_size() -> usize {
    128
}
fn default_rate() -> u32 {
    16_000
}
fn default_frame_ms() -> f64 {
    20.0
}
fn default_hop_ms() -> f64 {
    10.0
}
fn default_max_frequency() -> f64 {
    8000.0
}
fn yes() -> bool {
    true
}
fn one() -> f64 {
    1.0
}
fn default_mel_floor() -> f64 {
    1e-3
}
fn default_max_samples() -> usize {
    480_000
}

impl AudioFeatureConfig {
    /// The feature extractor among a model's files: the `feature_extractor` part of
    /// `processor_config.json`, or a `preprocessor_config.json` that is one; `None` where
    /// neither exists.
    pub fn load_files(files: &crate::ModelFiles) -> Result<Option<AudioFeatureConfig>> {
        if let Some(path) = files.file("processor_config.json") {
            let file = JsonFile::read(path)?;
            if let Some(v) = file.value.get("feature_extractor").filter(|v| !v.is_null()) {
                return Self::parse(&file, v).map(Some);
            }
        }
        if let Some(path) = files.file("preprocessor_config.json") {
            let file = JsonFile::read(path)?;
            let kind = file
                .value
                .get("feature_extractor_type")
                .and_then(Value::as_str);
            if kind.is_some_and(|k| k.contains("AudioFeatureExtractor")) {
                return Self::parse(&file, &file.value).map(Some);
            }
        }
        Ok(None)
    }

    fn parse(file: &JsonFile, v: &Value) -> Result<AudioFeatureConfig> {
        let cfg: AudioFeatureConfig = file.parse(v)?;
        cfg.validate()
            .map_err(|m| file.error(format!("feature_extractor: {m}")))?;
        Ok(cfg)
    }

    fn validate(&self) -> std::result::Result<(), String> {
        if self.feature_size == 0 || self.sampling_rate == 0 {
            return Err("`feature_size` and `sampling_rate` must be positive".into());
        }
        if self.frame_length() < 2 || self.hop_length() == 0 {
            return Err(format!(
                "frames of {} samples every {} are too short",
                self.frame_length(),
                self.hop_length()
            ));
        }
        if !(0.0..=self.max_frequency).contains(&self.min_frequency)
            || self.max_frequency > self.sampling_rate as f64 / 2.0
        {
            return Err(format!(
                "mel range {}-{} Hz is not within 0-{} Hz",
                self.min_frequency,
                self.max_frequency,
                self.sampling_rate / 2
            ));
        }
        // Dithering adds random noise to every frame: the features would differ run to run.
        if self.dither != 0.0 {
            return Err(format!("dither {} is not supported (only 0)", self.dither));
        }
        for (name, v) in [
            ("per_bin_mean", &self.per_bin_mean),
            ("per_bin_stddev", &self.per_bin_stddev),
        ] {
            if let Some(v) = v {
                if v.len() != self.feature_size {
                    return Err(format!(
                        "`{name}` has {} values for {} mel bins",
                        v.len(),
                        self.feature_size
                    ));
                }
            }
        }
        if self
            .per_bin_stddev
            .as_ref()
            .is_some_and(|s| s.contains(&0.0))
        {
            return Err("`per_bin_stddev` holds a zero".into());
        }
        if self.mel_floor.is_nan() || self.mel_floor <= 0.0 {
            return Err(format!(
                "`mel_floor` must be positive, got {}",
                self.mel_floor
            ));
        }
        Ok(())
    }

    /// Samples in one analysis window (320 at 16 kHz).
    pub fn frame_length(&self) -> usize {
        (self.sampling_rate as f64 * self.frame_length_ms / 1000.0).round() as usize
    }

    /// Samples between windows (160 at 16 kHz).
    pub fn hop_length(&self) -> usize {
        (self.sampling_rate as f64 * self.hop_length_ms / 1000.0).round() as usize
    }

    fn fft_length(&self) -> usize {
        let n = self.frame_length().next_power_of_two();
        if self.fft_overdrive {
            2 * n
        } else {
            n
        }
    }

    /// Log-mel frames a clip of `samples` (at the model's rate) gives: every window that lies
    /// wholly inside the clip, the first centred on its first sample.
    pub fn frames_for(&self, samples: usize) -> usize {
        let span = self.frame_length() + 1;
        let padded = samples + self.frame_length() / 2;
        if padded < span {
            0
        } else {
            (padded - span) / self.hop_length() + 1
        }
    }

    /// The longest clip the extractor takes, in seconds.
    pub fn max_seconds(&self) -> f64 {
        self.max_samples as f64 / self.sampling_rate as f64
    }

    /// The extractor, its window and mel filters computed once.
    pub fn extractor(&self) -> FeatureExtractor {
        FeatureExtractor::new(self.clone())
    }
}

/// A clip's log-mel frames: `frames` rows of `mel` values, row by row. Plain data.
#[derive(Debug, Clone)]
pub struct AudioFeatures {
    pub values: Vec<f32>,
    pub frames: usize,
    pub mel: usize,
}

/// transformers' `Gemma4AudioFeatureExtractor` over one clip with nothing padded: the frames
/// its mask marks valid (the padded ones it zeroes and the tower drops).
pub struct FeatureExtractor {
    cfg: AudioFeatureConfig,
    /// Periodic Hann window of `frame_length`, in float32 as transformers keeps it.
    window: Vec<f32>,
    /// `[fft_length / 2 + 1, feature_size]`, row by row.
    mel_filters: Vec<f64>,
    fft: Arc<dyn realfft::RealToComplex<f64>>,
}

impl FeatureExtractor {
    fn new(cfg: AudioFeatureConfig) -> FeatureExtractor {
        let n = cfg.frame_length();
        let window = (0..n)
            .map(|i| (0.5 - 0.5 * (2.0 * std::f64::consts::PI * i as f64 / n as f64).cos()) as f32)
            .collect();
        let fft_length = cfg.fft_length();
        let mel_filters = mel_filter_bank(
            fft_length / 2 + 1,
            cfg.feature_size,
            cfg.min_frequency,
            cfg.max_frequency,
            cfg.sampling_rate,
        );
        let fft = RealFftPlanner::<f64>::new().plan_fft_forward(fft_length);
        FeatureExtractor {
            cfg,
            window,
            mel_filters,
            fft,
        }
    }

    pub fn config(&self) -> &AudioFeatureConfig {
        &self.cfg
    }

    /// The log-mel frames of `wave` (mono, at the model's rate, samples in [-1, 1]).
    pub fn features(&self, wave: &[f32]) -> AudioFeatures {
        let cfg = &self.cfg;
        let (len, hop) = (cfg.frame_length(), cfg.hop_length());
        let pad_left = len / 2;
        let frames = cfg.frames_for(wave.len());
        let mel = cfg.feature_size;
        let bins = self.fft.len() / 2 + 1;
        let scale = cfg.input_scale_factor as f32;
        // The signal with `pad_left` zeros in front, as transformers pads it ("semicausal").
        let sample = |i: usize| -> f32 {
            if i < pad_left {
                0.0
            } else {
                wave[i - pad_left] * scale
            }
        };
        let mut input = self.fft.make_input_vec();
        let mut spectrum = self.fft.make_output_vec();
        let mut magnitude = vec![0f64; bins];
        let mut values = Vec::with_capacity(frames * mel);
        let pre = cfg.preemphasis as f32;
        for f in 0..frames {
            let start = f * hop;
            input.iter_mut().for_each(|v| *v = 0.0);
            for (j, slot) in input.iter_mut().take(len).enumerate() {
                // Each window reads `len + 1` samples so that pre-emphasis has a predecessor.
                let x = if pre > 0.0 {
                    if cfg.preemphasis_htk_flavor && j == 0 {
                        sample(start) * (1.0 - pre)
                    } else if cfg.preemphasis_htk_flavor {
                        sample(start + j) - pre * sample(start + j - 1)
                    } else {
                        sample(start + j + 1) - pre * sample(start + j)
                    }
                } else {
                    sample(start + j)
                };
                *slot = (x * self.window[j]) as f64;
            }
            self.fft
                .process(&mut input, &mut spectrum)
                .expect("buffers sized by the plan");
            for (m, c) in magnitude.iter_mut().zip(&spectrum) {
                *m = c.norm();
            }
            for k in 0..mel {
                let mut acc = 0f64;
                for (b, m) in magnitude.iter().enumerate() {
                    acc += m * self.mel_filters[b * mel + k];
                }
                let mut v = (acc + cfg.mel_floor).ln();
                if let Some(mean) = &cfg.per_bin_mean {
                    v -= mean[k];
                }
                if let Some(std) = &cfg.per_bin_stddev {
                    v /= std[k];
                }
                values.push(v as f32);
            }
        }
        AudioFeatures {
            values,
            frames,
            mel,
        }
    }
}

/// Triangular mel filters on the HTK scale, unnormalized, `[bins, filters]` row by row
/// (transformers' `mel_filter_bank(norm=None, mel_scale="htk")`).
fn mel_filter_bank(bins: usize, filters: usize, fmin: f64, fmax: f64, rate: u32) -> Vec<f64> {
    let to_mel = |f: f64| 2595.0 * (1.0 + f / 700.0).log10();
    let to_hz = |m: f64| 700.0 * (10f64.powf(m / 2595.0) - 1.0);
    let (lo, hi) = (to_mel(fmin), to_mel(fmax));
    let points = filters + 2;
    let edges: Vec<f64> = (0..points)
        .map(|i| to_hz(linspace(lo, hi, points, i)))
        .collect();
    let nyquist = (rate / 2) as f64;
    let mut out = vec![0f64; bins * filters];
    for b in 0..bins {
        let f = linspace(0.0, nyquist, bins, b);
        for k in 0..filters {
            let down = -(edges[k] - f) / (edges[k + 1] - edges[k]);
            let up = (edges[k + 2] - f) / (edges[k + 2] - edges[k + 1]);
            out[b * filters + k] = down.min(up).max(0.0);
        }
    }
    out
}

/// `np.linspace(a, b, n)[i]`.
fn linspace(a: f64, b: f64, n: usize, i: usize) -> f64 {
    if n == 1 {
        return a;
    }
    if i == n - 1 {
        return b;
    }
    let step = (b - a) / (n - 1) as f64;
    a + i as f64 * step
}

/// A decoded clip: one channel (the mean of the file's channels) at `rate`.
#[derive(Debug, Clone)]
pub struct DecodedAudio {
    pub samples: Vec<f32>,
    pub rate: u32,
    pub channels: usize,
}

impl DecodedAudio {
    pub fn seconds(&self) -> f64 {
        self.samples.len() as f64 / self.rate as f64
    }
}

/// What is wrong with a clip, in words for the person who sent it.
fn bad(msg: impl Into<String>) -> ModelError {
    ModelError::Invalid(msg.into())
}

/// Decodes `bytes` (WAV, MP3, FLAC or Ogg Vorbis) to one channel at the file's own rate,
/// refusing a clip longer than `max_seconds` as soon as decoding passes that length.
pub fn decode_audio(bytes: &[u8], max_seconds: f64) -> Result<DecodedAudio> {
    use symphonia::core::codecs::audio::AudioDecoderOptions;
    use symphonia::core::errors::Error;
    use symphonia::core::formats::probe::Hint;
    use symphonia::core::formats::{FormatOptions, TrackType};
    use symphonia::core::io::MediaSourceStream;
    use symphonia::core::meta::MetadataOptions;

    let source = std::io::Cursor::new(bytes.to_vec());
    let stream = MediaSourceStream::new(Box::new(source), Default::default());
    let mut format = symphonia::default::get_probe()
        .probe(
            &Hint::new(),
            stream,
            FormatOptions::default(),
            MetadataOptions::default(),
        )
        .map_err(|e| bad(format!("the audio could not be read: {e}")))?;
    let track = format
        .default_track(TrackType::Audio)
        .ok_or_else(|| bad("the file holds no audio track"))?;
    let params = track
        .codec_params
        .as_ref()
        .and_then(|p| p.audio())
        .ok_or_else(|| bad("the audio track has no codec parameters"))?
        .clone();
    let track_id = track.id;
    let mut decoder = symphonia::default::get_codecs()
        .make_audio_decoder(&params, &AudioDecoderOptions::default())
        .map_err(|e| bad(format!("the audio's codec is not supported: {e}")))?;
    let mut interleaved: Vec<f32> = Vec::new();
    let mut mono: Vec<f32> = Vec::new();
    let mut spec: Option<(u32, usize)> = None;
    loop {
        let packet = match format.next_packet() {
            Ok(Some(p)) => p,
            Ok(None) => break,
            // A stream that ends mid-packet is a truncated file: what decoded so far is kept
            // only if anything did.
            Err(Error::IoError(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(e) => return Err(bad(format!("the audio could not be read: {e}"))),
        };
        if packet.track_id != track_id {
            continue;
        }
        let buf = match decoder.decode(&packet) {
            Ok(buf) => buf,
            Err(Error::DecodeError(e)) => {
                return Err(bad(format!("the audio could not be decoded: {e}")))
            }
            Err(e) => return Err(bad(format!("the audio could not be decoded: {e}"))),
        };
        let rate = buf.spec().rate();
        let channels = buf.spec().channels().count().max(1);
        match spec {
            None => spec = Some((rate, channels)),
            Some(s) if s != (rate, channels) => {
                return Err(bad("the audio changes its rate or channels midway"))
            }
            Some(_) => {}
        }
        buf.copy_to_vec_interleaved(&mut interleaved);
        mono.extend(
            interleaved
                .chunks_exact(channels)
                .map(|f| f.iter().sum::<f32>() / channels as f32),
        );
        if mono.len() as f64 > max_seconds * rate as f64 {
            return Err(bad(format!(
                "the audio is longer than {max_seconds} s, the most one clip may hold"
            )));
        }
    }
    let Some((rate, channels)) = spec else {
        return Err(bad("the audio holds no samples"));
    };
    if mono.is_empty() {
        return Err(bad("the audio holds no samples"));
    }
    Ok(DecodedAudio {
        samples: mono,
        rate,
        channels,
    })
}

/// `samples` at `from` Hz resampled to `to` Hz (band-limited, FFT based); unchanged where the
/// rates agree.
pub fn resample(samples: &[f32], from: u32, to: u32) -> Result<Vec<f32>> {
    use audioadapter_buffers::direct::InterleavedSlice;
    use rubato::{Fft, FixedSync, Resampler};
    if from == to {
        return Ok(samples.to_vec());
    }
    let input: Vec<f64> = samples.iter().map(|&s| s as f64).collect();
    let adapter = InterleavedSlice::new(&input[..], 1, input.len())
        .map_err(|e| bad(format!("resampling: {e}")))?;
    let mut rs = Fft::<f64>::new(from as usize, to as usize, 1024, 1, FixedSync::Both)
        .map_err(|e| bad(format!("cannot resample {from} Hz to {to} Hz: {e}")))?;
    let out = rs
        .process_all(&adapter, input.len(), None)
        .map_err(|e| bad(format!("resampling: {e}")))?;
    let expected = (samples.len() as u64 * to as u64).div_ceil(from as u64) as usize;
    let data = out.take_data();
    Ok(data.iter().take(expected).map(|&s| s as f32).collect())
}

/// One clip as the tower takes it: decoded, mixed to mono, at the extractor's rate, within
/// its length bound, then log-mel frames. `Err` names what is wrong with the clip.
pub fn prepare_audio(bytes: &[u8], fx: &FeatureExtractor) -> Result<(AudioFeatures, f64)> {
    let cfg = fx.config();
    let decoded = decode_audio(bytes, cfg.max_seconds())?;
    let seconds = decoded.seconds();
    let wave = resample(&decoded.samples, decoded.rate, cfg.sampling_rate)?;
    let wave = &wave[..wave.len().min(cfg.max_samples)];
    let features = fx.features(wave);
    if features.frames == 0 {
        return Err(bad(format!(
            "the audio is {:.0} ms long, shorter than one {} ms analysis window",
            seconds * 1000.0,
            cfg.frame_length_ms
        )));
    }
    Ok((features, seconds))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_follow_the_extractors_arithmetic() {
        let cfg: AudioFeatureConfig = serde_json::from_value(serde_json::json!({})).unwrap();
        // (samples + 160 - 321) / 160 + 1, as the processor counts them.
        assert_eq!(cfg.frames_for(16000), 99);
        assert_eq!(cfg.frames_for(5923), 37);
        assert_eq!(cfg.frames_for(800), 4);
        assert_eq!(cfg.frames_for(161), 1);
        assert_eq!(cfg.frames_for(160), 0);
        assert_eq!(cfg.max_seconds(), 30.0);
    }

    #[test]
    fn feature_configs_it_cannot_follow_are_refused_by_name() {
        let check = |v: serde_json::Value| {
            serde_json::from_value::<AudioFeatureConfig>(v)
                .unwrap()
                .validate()
                .err()
                .unwrap_or_default()
        };
        assert_eq!(check(serde_json::json!({})), "");
        assert!(check(serde_json::json!({"dither": 0.1})).contains("dither"));
        assert!(check(serde_json::json!({"max_frequency": 9000.0})).contains("mel range"));
        assert!(check(serde_json::json!({"per_bin_mean": [0.0, 1.0]})).contains("per_bin_mean"));
        assert!(check(serde_json::json!({"mel_floor": 0.0})).contains("mel_floor"));
        assert!(check(serde_json::json!({"frame_length_ms": 0.01})).contains("too short"));
    }

    #[test]
    fn a_sine_resampled_keeps_its_pitch() {
        let tone = |rate: u32, n: usize| -> Vec<f32> {
            (0..n)
                .map(|i| (2.0 * std::f64::consts::PI * 440.0 * i as f64 / rate as f64).sin() as f32)
                .collect()
        };
        let out = resample(&tone(44_100, 44_100), 44_100, 16_000).unwrap();
        assert_eq!(out.len(), 16_000);
        // Away from the edges (the filter's ramp): a 440 Hz sine of amplitude 1 (the resampler
        // may shift it by a fraction of a sample) and nothing else, within 1e-3.
        let w = 2.0 * std::f64::consts::PI * 440.0 / 16_000.0;
        let mid = &out[500..15_500];
        let (mut s, mut c) = (0f64, 0f64);
        for (i, &x) in mid.iter().enumerate() {
            let t = (i + 500) as f64 * w;
            s += x as f64 * t.sin();
            c += x as f64 * t.cos();
        }
        let (s, c) = (2.0 * s / mid.len() as f64, 2.0 * c / mid.len() as f64);
        assert!(
            ((s * s + c * c).sqrt() - 1.0).abs() < 1e-3,
            "amplitude {s} {c}"
        );
        let residual = mid
            .iter()
            .enumerate()
            .map(|(i, &x)| {
                let t = (i + 500) as f64 * w;
                (x as f64 - s * t.sin() - c * t.cos()).abs()
            })
            .fold(0f64, f64::max);
        assert!(residual < 1e-3, "residual {residual}");
        let want = tone(16_000, 16_000);
        assert_eq!(resample(&want, 16_000, 16_000).unwrap(), want);
    }
}
