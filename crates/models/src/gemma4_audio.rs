//! gemma4's audio tower and its embedder: a clip's log-mel frames in, the soft tokens that take
//! the place of its audio tokens out (docs/MODELS.md §1.6). transformers' `Gemma4AudioModel`: a
//! convolutional subsampler (two 3×3 stride-2 convolutions, 40 ms a token) then conformer
//! layers (half-step feed-forward, local self-attention with relative positions, a light
//! depthwise convolution, half-step feed-forward).
//!
//! A clip runs alone, with only its valid frames: transformers pads a batch and masks the
//! padding out of every convolution and attention window, the same arithmetic.

use crate::config::JsonFile;
use crate::gemma4_audio_features::{AudioFeatureConfig, AudioFeatures};
use crate::nn::{norm, ClippedLinear, Linear};
use crate::weights::{Vb, Weights};
use crate::{ModelError, Result};
use mlx::{Array, Dtype, Ix};
use serde::Deserialize;
use serde_json::Value;

/// `audio_config` of a gemma4 checkpoint (transformers' `Gemma4AudioConfig`).
#[derive(Debug, Clone, Deserialize)]
pub struct AudioConfig {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub num_attention_heads: i32,
    #[serde(default = "default_act")]
    pub hidden_act: String,
    pub subsampling_conv_channels: Vec<i32>,
    #[serde(default = "default_kernel")]
    pub conv_kernel_size: i32,
    #[serde(default = "default_residual")]
    pub residual_weight: f64,
    #[serde(default = "default_chunk")]
    pub attention_chunk_size: i32,
    #[serde(default = "default_left")]
    pub attention_context_left: i32,
    #[serde(default)]
    pub attention_context_right: i32,
    #[serde(default = "default_cap")]
    pub attention_logit_cap: f64,
    #[serde(default = "yes")]
    pub use_clipped_linears: bool,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f32,
    #[serde(default = "default_clip")]
    pub gradient_clipping: f64,
    pub output_proj_dims: i32,
}

fn default_act() -> String {
    "silu".into()
}
fn default_kernel() -> i32 {
    5
}
fn default_residual() -> f64 {
    0.5
}
fn default_chunk() -> i32 {
    12
}
fn default_left() -> i32 {
    13
}
fn default_cap() -> f64 {
    50.0
}
fn yes() -> bool {
    true
}
fn default_eps() -> f32 {
    1e-6
}
fn default_clip() -> f64 {
    1e10
}

/// The norms transformers builds without passing the config's epsilon.
const DEFAULT_EPS: f32 = 1e-6;

impl AudioConfig {
    /// The `audio_config` of a gemma4 `config.json`, if it has one.
    pub fn from_file(file: &JsonFile) -> Result<Option<AudioConfig>> {
        let Some(v) = file.value.get("audio_config").filter(|v| !v.is_null()) else {
            return Ok(None);
        };
        let cfg: AudioConfig = file.parse(v)?;
        cfg.validate()
            .map_err(|m| file.error(format!("audio_config: {m}")))?;
        Ok(Some(cfg))
    }

    fn validate(&self) -> std::result::Result<(), String> {
        for (name, v) in [
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("conv_kernel_size", self.conv_kernel_size),
            ("attention_chunk_size", self.attention_chunk_size),
            ("output_proj_dims", self.output_proj_dims),
        ] {
            if v <= 0 {
                return Err(format!("`{name}` must be positive, got {v}"));
            }
        }
        if self.hidden_size % self.num_attention_heads != 0 {
            return Err(format!(
                "`hidden_size` ({}) is not a multiple of `num_attention_heads` ({})",
                self.hidden_size, self.num_attention_heads
            ));
        }
        if self.subsampling_conv_channels.len() != 2
            || self.subsampling_conv_channels.iter().any(|&c| c <= 0)
        {
            return Err(format!(
                "`subsampling_conv_channels` must be two positive counts, got {:?}",
                self.subsampling_conv_channels
            ));
        }
        if self.attention_context_left < 2 {
            return Err(format!(
                "`attention_context_left` must be at least 2, got {}",
                self.attention_context_left
            ));
        }
        // Frames see only the past here; a right context would need the blocked form's
        // look-ahead.
        if self.attention_context_right != 0 {
            return Err(format!(
                "`attention_context_right` {} is not supported (only 0)",
                self.attention_context_right
            ));
        }
        if self.hidden_act != "silu" {
            return Err(format!(
                "hidden_act {:?} is not supported (only \"silu\")",
                self.hidden_act
            ));
        }
        if self.attention_logit_cap.is_nan() || self.attention_logit_cap <= 0.0 {
            return Err(format!(
                "`attention_logit_cap` must be positive, got {}",
                self.attention_logit_cap
            ));
        }
        Ok(())
    }

    fn head_dim(&self) -> i32 {
        self.hidden_size / self.num_attention_heads
    }

    /// Keys a frame attends to: itself and the `attention_context_left - 2` before it.
    fn window(&self) -> i32 {
        self.attention_context_left - 1
    }

    /// Soft tokens `frames` log-mel frames become: two stride-2 convolutions with padding 1.
    pub fn soft_tokens(frames: usize) -> usize {
        let half = |t: usize| if t == 0 { 0 } else { (t - 1) / 2 + 1 };
        half(half(frames))
    }
}

/// A 3×3 stride-2 convolution with padding 1 (no bias), LayerNorm over channels (no bias) and
/// ReLU, on channels-last `[T, F, C]`.
///
/// The LayerNorm's mean is taken out of the weights: the mean over output channels of a
/// convolution is the convolution by the mean of its filters, so convolving by the centred
/// filters gives centred outputs, and what is left of the LayerNorm is an RMS norm (one fused
/// op where MLX's LayerNorm was the layer's slowest part).
struct SubsampleLayer {
    /// `[9 · C_in, C_out]`, rows in (kernel row, kernel column, input channel) order, each row
    /// less its mean.
    weight: Array,
    norm: Array,
}

impl SubsampleLayer {
    fn load(vb: &Vb, cin: i32, cout: i32) -> Result<SubsampleLayer> {
        let stored = vb.pp("conv").get("weight", &[cout, cin, 3, 3])?;
        let w = stored.transpose(&[2, 3, 1, 0])?.reshape(&[9 * cin, cout])?;
        let centred = w.subtract(&w.mean(&[1], true)?)?.contiguous()?;
        Ok(SubsampleLayer {
            weight: vb.weights().keep_instead(&stored, centred),
            norm: vb.pp("norm").get("weight", &[cout])?,
        })
    }

    fn forward(&self, x: &Array, eps: f32) -> Result<Array> {
        let s = x.shape();
        let (t, f, c) = (s[0], s[1], s[2]);
        let (t2, f2) = ((t - 1) / 2 + 1, (f - 1) / 2 + 1);
        let xp = x.pad(&[0, 1], &[1, 1], &[1, 1], 0.0)?;
        // The nine taps as strided views, gathered beside each output position (im2col).
        let mut taps = Vec::with_capacity(9);
        for a in 0..3 {
            for b in 0..3 {
                taps.push(xp.index(&[
                    Ix::slice(Some(a), Some(a + 2 * (t2 - 1) + 1), 2),
                    Ix::slice(Some(b), Some(b + 2 * (f2 - 1) + 1), 2),
                ])?);
            }
        }
        let refs: Vec<&Array> = taps.iter().collect();
        let cols = mlx::stack(&refs, 2)?.reshape(&[t2 * f2, 9 * c])?;
        let y = cols.matmul(&self.weight)?.reshape(&[t2, f2, -1])?;
        let y = norm(&y, Some(&self.norm), eps)?;
        Ok(y.maximum_scalar(0.0)?)
    }
}

/// Half-step feed-forward: `x + ½ · norm(W₂ silu(W₁ norm(x)))`.
struct FeedForward {
    pre_norm: Array,
    post_norm: Array,
    up: ClippedLinear,
    down: ClippedLinear,
}

impl FeedForward {
    fn load(vb: &Vb, cfg: &AudioConfig) -> Result<FeedForward> {
        let h = cfg.hidden_size;
        let c = cfg.use_clipped_linears;
        Ok(FeedForward {
            pre_norm: vb.pp("pre_layer_norm").get("weight", &[h])?,
            post_norm: vb.pp("post_layer_norm").get("weight", &[h])?,
            up: ClippedLinear::load(&vb.pp("ffw_layer_1"), c, 4 * h, h)?,
            down: ClippedLinear::load(&vb.pp("ffw_layer_2"), c, h, 4 * h)?,
        })
    }

    fn forward(&self, x: &Array, cfg: &AudioConfig) -> Result<Array> {
        let h = norm(&clamp(x, cfg)?, Some(&self.pre_norm), DEFAULT_EPS)?;
        let h = self.down.forward(&silu(&self.up.forward(&h)?)?)?;
        let h = norm(&clamp(&h, cfg)?, Some(&self.post_norm), DEFAULT_EPS)?;
        Ok(x.add(&h.multiply_scalar(cfg.residual_weight)?)?)
    }
}

/// Local self-attention: each frame attends to itself and the `window - 1` frames before it,
/// logits `q·k + q·r(distance)` (a learned projection of sinusoids of the distance), soft-capped.
struct Attention {
    q: ClippedLinear,
    k: ClippedLinear,
    v: ClippedLinear,
    post: ClippedLinear,
    /// `[heads, head_dim, window]`, float32: the relative keys, already projected (they do not
    /// depend on the input), by band index `j` (distance `window − 1 − j`).
    relative: Array,
    /// `[head_dim]`: the query scale `head_dim^-½ / ln 2 · softplus(per_dim_scale)`.
    q_scale: Array,
}

impl Attention {
    fn load(vb: &Vb, cfg: &AudioConfig) -> Result<Attention> {
        let h = cfg.hidden_size;
        let (heads, d) = (cfg.num_attention_heads, cfg.head_dim());
        let c = cfg.use_clipped_linears;
        let rel_proj = vb.pp("relative_k_proj").linear(h, h)?;
        let per_dim = vb.get_f32("per_dim_scale", &[d])?;
        // softplus(s) = ln(1 + eˢ), as a stable logaddexp with 0.
        let softplus = per_dim.logaddexp_scalar(0.0)?;
        let q_scale = softplus.multiply_scalar((d as f64).powf(-0.5) / std::f64::consts::LN_2)?;
        let relative = relative_keys(cfg, &rel_proj, vb.weights().dtype())?
            .astype(Dtype::F32)?
            .reshape(&[cfg.window(), heads, d])?
            .flip(0)?
            .transpose(&[1, 2, 0])?
            .contiguous()?;
        rel_proj.withdraw(vb.weights());
        Ok(Attention {
            q: ClippedLinear::load(&vb.pp("q_proj"), c, h, h)?,
            k: ClippedLinear::load(&vb.pp("k_proj"), c, h, h)?,
            v: ClippedLinear::load(&vb.pp("v_proj"), c, h, h)?,
            post: ClippedLinear::load(&vb.pp("post"), c, h, h)?,
            relative: vb.weights().keep(relative),
            q_scale: vb.weights().keep(q_scale),
        })
    }

    /// `x`: `[T, hidden]`. Queries go in blocks of `C = attention_chunk_size`, each against
    /// the `C + W − 1` keys its frames can see, as batched matmuls; the band of distances
    /// 0..W is cut out of each block's scores with a skew (a row of `C + W` scores read with a
    /// stride one longer than it), and put back the same way for the values.
    fn forward(&self, x: &Array, cfg: &AudioConfig) -> Result<Array> {
        let t = x.dim(0)?;
        let (heads, d, w) = (cfg.num_attention_heads, cfg.head_dim(), cfg.window());
        let c = cfg.attention_chunk_size;
        let blocks = (t + c - 1) / c;
        let span = c + w - 1;
        let dtype = x.dtype();
        // [T, H, D] → [H, T, D], float32.
        let split = |a: Array| -> Result<Array> {
            Ok(a.astype(Dtype::F32)?
                .reshape(&[t, heads, d])?
                .transpose(&[1, 0, 2])?)
        };
        let q = split(self.q.forward(x)?)?.multiply(&self.q_scale)?;
        let k_scale = (1.0 + std::f64::consts::E).ln() / std::f64::consts::LN_2;
        let k = split(self.k.forward(x)?)?.multiply_scalar(k_scale)?;
        let v = split(self.v.forward(x)?)?;
        // Block u's queries [H, C, D] and the keys (values) frames u·C − (W − 1) .. u·C + C − 1
        // [H, C + W − 1, D], zeros outside the clip.
        let q_blocks = q
            .pad(&[1], &[0], &[blocks * c - t], 0.0)?
            .reshape(&[heads, blocks, c, d])?
            .transpose(&[1, 0, 2, 3])?;
        let windows = |a: &Array| -> Result<Array> {
            let padded = a.pad(&[1], &[w - 1], &[blocks * c - t], 0.0)?;
            let views = (0..blocks)
                .map(|u| padded.slice_axis(1, u * c, Some(u * c + span)))
                .collect::<std::result::Result<Vec<_>, _>>()?;
            let refs: Vec<&Array> = views.iter().collect();
            Ok(mlx::stack(&refs, 0)?)
        };
        let (k_win, v_win) = (windows(&k)?, windows(&v)?);
        // [U, H, C, C + W − 1] → the band: entry (i, j) is frame u·C + i against frame
        // u·C + i − (W − 1) + j, distance W − 1 − j.
        let scores = q_blocks.matmul(&k_win.transpose(&[0, 1, 3, 2])?)?;
        let band = scores
            .reshape(&[blocks, heads, c * span])?
            .pad(&[2], &[0], &[c], 0.0)?
            .reshape(&[blocks, heads, c, span + 1])?
            .slice_axis(3, 0, Some(w))?;
        // [H, T, W] with the relative term, whose keys are stored by band index.
        let band = band
            .transpose(&[1, 0, 2, 3])?
            .reshape(&[heads, blocks * c, w])?
            .slice_axis(1, 0, Some(t))?;
        let relative = q.matmul(&self.relative)?;
        let logits = mlx::fast::softcap(&band.add(&relative)?, cfg.attention_logit_cap as f32)?;
        // Band entries before the clip's start see nothing.
        let ts: Vec<i32> = (0..t).collect();
        let js: Vec<i32> = (0..w).collect();
        let valid = Array::from_slice(&ts, &[1, t, 1])?
            .add(&Array::from_slice(&js, &[1, 1, w])?)?
            .greater_equal_scalar((w - 1) as f64)?;
        let logits = mlx::where_(&valid, &logits, &Array::scalar_as(-1e9, Dtype::F32)?)?;
        let probs = mlx::fast::softmax(&logits)?;
        // Back into each block's rows of C + W − 1 keys, then onto the values.
        let probs = probs
            .pad(&[1], &[0], &[blocks * c - t], 0.0)?
            .reshape(&[heads, blocks, c, w])?
            .transpose(&[1, 0, 2, 3])?
            .pad(&[3], &[0], &[span + 1 - w], 0.0)?
            .reshape(&[blocks, heads, c * (span + 1)])?
            .slice_axis(2, 0, Some(c * span))?
            .reshape(&[blocks, heads, c, span])?;
        let out = probs
            .matmul(&v_win)?
            .transpose(&[0, 2, 1, 3])?
            .reshape(&[blocks * c, heads * d])?
            .slice_axis(0, 0, Some(t))?
            .astype(dtype)?;
        self.post.forward(&out)
    }
}

/// `relative_k_proj` of the sinusoid of each distance 0..window: `[window, hidden]`.
///
/// transformers computes the relative term over blocks of `chunk` queries against
/// `chunk + left` keys with a shift (Transformer-XL's); unrolled, the key at distance `j`
/// gets the sinusoid of position `K − left + j` (`K = (chunk + left) / 2`), or nothing where
/// `left − j > K`.
fn relative_keys(cfg: &AudioConfig, proj: &Linear, dtype: Dtype) -> Result<Array> {
    let h = cfg.hidden_size;
    let left = cfg.window();
    let k = (cfg.attention_chunk_size + left + cfg.attention_context_right) / 2;
    let half = (h / 2) as usize;
    let step = (10_000f64).ln() / (half.max(2) - 1) as f64;
    let mut table = Vec::with_capacity(left as usize * h as usize);
    let mut present = Vec::with_capacity(left as usize);
    for j in 0..left {
        let shown = left - j <= k;
        present.push(if shown { 1f32 } else { 0f32 });
        let pos = (k - left + j) as f32;
        let angles: Vec<f32> = (0..half)
            .map(|i| pos * (-(i as f64) * step).exp() as f32)
            .collect();
        table.extend(angles.iter().map(|a| a.sin()));
        table.extend(angles.iter().map(|a| a.cos()));
    }
    let sinusoids = Array::from_slice(&table, &[left, h])?.astype(dtype)?;
    let keys = proj.forward(&sinusoids)?;
    Ok(keys.multiply(&Array::from_slice(&present, &[left, 1])?.astype(dtype)?)?)
}

/// The light convolution block: gated linear, causal depthwise convolution, norm, silu, linear.
struct LightConv {
    pre_norm: Array,
    conv_norm: Array,
    start: ClippedLinear,
    end: ClippedLinear,
    /// `[kernel, hidden]`: tap `i` multiplies the frame `kernel - 1 - i` steps back.
    taps: Array,
}

impl LightConv {
    fn load(vb: &Vb, cfg: &AudioConfig) -> Result<LightConv> {
        let h = cfg.hidden_size;
        let c = cfg.use_clipped_linears;
        let w = vb
            .pp("depthwise_conv1d")
            .get("weight", &[h, 1, cfg.conv_kernel_size])?;
        let taps = w.squeeze_axes(&[1])?.transpose(&[1, 0])?.contiguous()?;
        Ok(LightConv {
            pre_norm: vb.pp("pre_layer_norm").get("weight", &[h])?,
            conv_norm: vb.pp("conv_norm").get("weight", &[h])?,
            start: ClippedLinear::load(&vb.pp("linear_start"), c, 2 * h, h)?,
            end: ClippedLinear::load(&vb.pp("linear_end"), c, h, h)?,
            taps: vb.weights().keep_instead(&w, taps),
        })
    }

    fn forward(&self, x: &Array, cfg: &AudioConfig) -> Result<Array> {
        let t = x.dim(0)?;
        let kernel = cfg.conv_kernel_size;
        let h = self
            .start
            .forward(&norm(x, Some(&self.pre_norm), cfg.rms_norm_eps)?)?;
        let halves = h.split(2, 1)?;
        let h = mlx::fast::sigmoid_mul(&halves[1], &halves[0])?;
        let padded = h.pad(&[0], &[kernel - 1], &[0], 0.0)?;
        let mut acc: Option<Array> = None;
        for i in 0..kernel {
            let tap = self.taps.slice_axis(0, i, Some(i + 1))?;
            let term = padded.slice_axis(0, i, Some(i + t))?.multiply(&tap)?;
            acc = Some(match acc {
                Some(a) => a.add(&term)?,
                None => term,
            });
        }
        let h = acc.expect("a kernel of at least one tap");
        let h = norm(&clamp(&h, cfg)?, Some(&self.conv_norm), cfg.rms_norm_eps)?;
        Ok(x.add(&self.end.forward(&silu(&h)?)?)?)
    }
}

struct ConformerLayer {
    ff1: FeedForward,
    ff2: FeedForward,
    attn: Attention,
    conv: LightConv,
    norm_pre_attn: Array,
    norm_post_attn: Array,
    norm_out: Array,
}

impl ConformerLayer {
    fn load(vb: &Vb, cfg: &AudioConfig) -> Result<ConformerLayer> {
        let h = cfg.hidden_size;
        Ok(ConformerLayer {
            ff1: FeedForward::load(&vb.pp("feed_forward1"), cfg)?,
            ff2: FeedForward::load(&vb.pp("feed_forward2"), cfg)?,
            attn: Attention::load(&vb.pp("self_attn"), cfg)?,
            conv: LightConv::load(&vb.pp("lconv1d"), cfg)?,
            norm_pre_attn: vb.pp("norm_pre_attn").get("weight", &[h])?,
            norm_post_attn: vb.pp("norm_post_attn").get("weight", &[h])?,
            norm_out: vb.pp("norm_out").get("weight", &[h])?,
        })
    }

    fn forward(&self, x: &Array, cfg: &AudioConfig) -> Result<Array> {
        let x = self.ff1.forward(x, cfg)?;
        let a = norm(&clamp(&x, cfg)?, Some(&self.norm_pre_attn), DEFAULT_EPS)?;
        let a = self.attn.forward(&a, cfg)?;
        let a = norm(&clamp(&a, cfg)?, Some(&self.norm_post_attn), DEFAULT_EPS)?;
        let x = self.conv.forward(&x.add(&a)?, cfg)?;
        let x = self.ff2.forward(&x, cfg)?;
        norm(&clamp(&x, cfg)?, Some(&self.norm_out), DEFAULT_EPS)
    }
}

fn clamp(x: &Array, cfg: &AudioConfig) -> Result<Array> {
    let c = cfg.gradient_clipping.min(f32::MAX as f64);
    let lo = Array::scalar_as(-c, x.dtype())?;
    let hi = Array::scalar_as(c, x.dtype())?;
    Ok(x.clip(Some(&lo), Some(&hi))?)
}

/// `x · σ(x)`, one vectorized op on the CPU.
fn silu(x: &Array) -> Result<Array> {
    Ok(mlx::fast::sigmoid_mul(x, x)?)
}

/// gemma4's audio tower and the embedder that projects its output into the text model.
pub struct Gemma4Audio {
    pub cfg: AudioConfig,
    layer0: SubsampleLayer,
    layer1: SubsampleLayer,
    input_proj: Linear,
    layers: Vec<ConformerLayer>,
    output_proj: Linear,
    output_bias: Array,
    embed_proj: Linear,
    /// Mel bins the subsampler was built for.
    mel_bins: i32,
}

impl Gemma4Audio {
    /// The tower under `model.audio_tower` and its embedder under `model.embed_audio`, for
    /// features of `mel_bins` bins.
    pub fn new(
        cfg: AudioConfig,
        text_hidden: i32,
        mel_bins: i32,
        w: &Weights,
    ) -> Result<Gemma4Audio> {
        let root = w.root().pp("model");
        let tower = root.pp("audio_tower");
        let sub = tower.pp("subsample_conv_projection");
        let (c0, c1) = (
            cfg.subsampling_conv_channels[0],
            cfg.subsampling_conv_channels[1],
        );
        let bins = (((mel_bins - 1) / 2 + 1) - 1) / 2 + 1;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| ConformerLayer::load(&tower.pp("layers").pp(i), &cfg))
            .collect::<Result<Vec<_>>>()?;
        let h = cfg.hidden_size;
        let out = cfg.output_proj_dims;
        Ok(Gemma4Audio {
            layer0: SubsampleLayer::load(&sub.pp("layer0"), 1, c0)?,
            layer1: SubsampleLayer::load(&sub.pp("layer1"), c0, c1)?,
            // Its input is the subsampled mel axis times the channels: the feature extractor's
            // mel count must be the one the checkpoint was trained on.
            input_proj: sub.pp("input_proj_linear").linear(h, bins * c1).map_err(|e| {
                ModelError::Invalid(format!(
                    "the audio tower does not take {mel_bins} mel bins from the feature extractor: {e}"
                ))
            })?,
            layers,
            output_proj: tower.pp("output_proj").linear(out, h)?,
            output_bias: tower.pp("output_proj").get("bias", &[out])?,
            embed_proj: root
                .pp("embed_audio.embedding_projection")
                .linear(text_hidden, out)?,
            mel_bins,
            cfg,
        })
    }

    /// The soft tokens of one clip, `[soft_tokens, text hidden]` in the compute dtype.
    pub fn encode(&self, clip: &AudioFeatures) -> Result<Array> {
        self.finish(self.begin(clip)?)
    }

    /// The tower's output for one clip, `[soft_tokens, output_proj_dims]`.
    pub fn tower(&self, clip: &AudioFeatures) -> Result<Array> {
        self.projected(self.begin(clip)?)
    }

    /// Conformer layers: [`Gemma4Audio::advance`] runs one at a time.
    pub fn layers(&self) -> usize {
        self.layers.len()
    }

    /// An encoding of one clip begun: its frames checked and subsampled (nothing evaluated).
    pub fn begin(&self, clip: &AudioFeatures) -> Result<AudioEncoding> {
        let cfg = &self.cfg;
        if clip.frames == 0 || clip.mel as i32 != self.mel_bins {
            return Err(ModelError::Invalid(format!(
                "audio features of {} frames x {} bins, the tower takes {} bins",
                clip.frames, clip.mel, self.mel_bins
            )));
        }
        if clip.values.len() != clip.frames * clip.mel {
            return Err(ModelError::Invalid(format!(
                "audio features of {} values, expected {} x {}",
                clip.values.len(),
                clip.frames,
                clip.mel
            )));
        }
        let dtype = self.output_bias.dtype();
        let x = Array::from_slice(&clip.values, &[clip.frames as i32, clip.mel as i32, 1])?
            .astype(dtype)?;
        let x = self.layer0.forward(&x, cfg.rms_norm_eps)?;
        let x = self.layer1.forward(&x, cfg.rms_norm_eps)?;
        let t = x.dim(0)?;
        Ok(AudioEncoding {
            x: self.input_proj.forward(&x.reshape(&[t, -1])?)?,
            next: 0,
        })
    }

    /// Runs the next conformer layer (lazily); `false` once every layer has run.
    pub fn advance(&self, e: &mut AudioEncoding) -> Result<bool> {
        let Some(layer) = self.layers.get(e.next) else {
            return Ok(false);
        };
        e.x = layer.forward(&e.x, &self.cfg)?;
        e.next += 1;
        Ok(true)
    }

    /// The soft tokens of a finished encoding (its remaining layers run first).
    pub fn finish(&self, e: AudioEncoding) -> Result<Array> {
        let x = self.projected(e)?;
        let normed = norm(&x, None, self.cfg.rms_norm_eps)?;
        self.embed_proj.forward(&normed)
    }

    /// The tower's output of an encoding, its remaining layers run first.
    fn projected(&self, mut e: AudioEncoding) -> Result<Array> {
        while self.advance(&mut e)? {}
        Ok(self.output_proj.forward(&e.x)?.add(&self.output_bias)?)
    }

    /// The activations an encoding holds, to evaluate between layers.
    pub fn state(e: &AudioEncoding) -> &Array {
        &e.x
    }
}

/// One clip's encoding part-way through the tower: what [`Gemma4Audio::advance`] resumes.
pub struct AudioEncoding {
    x: Array,
    next: usize,
}

/// What the HTTP side needs to put a clip into a prompt: the feature extractor, the tokens a
/// clip becomes (`boa`, one `audio_token` per soft token, `eoa`) and the most soft tokens one
/// clip may take. Plain data.
#[derive(Debug, Clone)]
pub struct AudioPrompt {
    pub features: AudioFeatureConfig,
    pub boa: u32,
    pub eoa: u32,
    pub audio_token: u32,
    pub max_tokens: usize,
}

impl AudioPrompt {
    /// From a gemma4 `config.json`, the feature extractor and the processor's token cap.
    pub fn new(
        file: &JsonFile,
        features: AudioFeatureConfig,
        max_tokens: usize,
    ) -> Result<AudioPrompt> {
        let id = |keys: &[&str]| -> Result<u32> {
            keys.iter()
                .find_map(|k| file.value.get(*k).and_then(Value::as_u64))
                .map(|v| v as u32)
                .ok_or_else(|| file.error(format!("missing field `{}` (a clip needs it)", keys[0])))
        };
        Ok(AudioPrompt {
            features,
            boa: id(&["boa_token_id"])?,
            eoa: id(&["eoa_token_id", "eoa_token_index"])?,
            audio_token: id(&["audio_token_id"])?,
            max_tokens,
        })
    }

    /// Soft tokens a clip of `frames` log-mel frames becomes.
    pub fn soft_tokens(&self, frames: usize) -> usize {
        AudioConfig::soft_tokens(frames).min(self.max_tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn soft_tokens_follow_the_two_stride_two_convolutions() {
        assert_eq!(AudioConfig::soft_tokens(99), 25);
        assert_eq!(AudioConfig::soft_tokens(37), 10);
        assert_eq!(AudioConfig::soft_tokens(4), 1);
        assert_eq!(AudioConfig::soft_tokens(1), 1);
        assert_eq!(AudioConfig::soft_tokens(0), 0);
        // 30 s at 16 kHz: 2,999 frames, 750 tokens (the processor's cap).
        assert_eq!(AudioConfig::soft_tokens(2999), 750);
    }

    #[test]
    fn audio_configs_it_cannot_run_are_refused_by_name() {
        let base = serde_json::json!({
            "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
            "subsampling_conv_channels": [128, 4], "output_proj_dims": 48,
        });
        let check = |patch: serde_json::Value| {
            let mut v = base.clone();
            for (k, x) in patch.as_object().unwrap() {
                v[k] = x.clone();
            }
            serde_json::from_value::<AudioConfig>(v)
                .unwrap()
                .validate()
                .err()
                .unwrap_or_default()
        };
        assert_eq!(check(serde_json::json!({})), "");
        assert!(check(serde_json::json!({"attention_context_right": 2})).contains("only 0"));
        assert!(check(serde_json::json!({"num_attention_heads": 3})).contains("not a multiple"));
        assert!(check(serde_json::json!({"hidden_act": "gelu"})).contains("only \"silu\""));
        assert!(
            check(serde_json::json!({"subsampling_conv_channels": [8]})).contains("two positive")
        );
        assert!(check(serde_json::json!({"attention_logit_cap": 0.0})).contains("positive"));
    }
}
