//! gemma4's vision tower and its embedder: an image's patches in, the soft tokens that take the
//! place of its image tokens out (docs/MODELS.md §1.5).
//!
//! Each image runs through the tower alone at its own patch count: transformers pads every image
//! to the processor's patch budget and masks the padding out of attention and pooling, which is
//! the same arithmetic as leaving it out.

use crate::config::JsonFile;
use crate::nn::{gelu_tanh, norm, ClippedLinear, Linear};
use crate::weights::{Vb, Weights};
use crate::{ModelError, Result};
use mlx::{Array, Dtype};
use serde::Deserialize;
use serde_json::Value;

/// `vision_config` of a gemma4 checkpoint (transformers' `Gemma4VisionConfig`).
#[derive(Debug, Clone, Deserialize)]
pub struct VisionConfig {
    pub hidden_size: i32,
    pub intermediate_size: i32,
    pub num_hidden_layers: i32,
    pub num_attention_heads: i32,
    pub num_key_value_heads: i32,
    pub head_dim: i32,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f32,
    pub patch_size: i32,
    pub pooling_kernel_size: i32,
    pub position_embedding_size: i32,
    #[serde(default)]
    pub use_clipped_linears: bool,
    #[serde(default)]
    pub standardize: bool,
    #[serde(default)]
    pub rope_parameters: Option<RopeParameters>,
    #[serde(default = "default_activation")]
    pub hidden_activation: String,
}

#[derive(Debug, Clone, Deserialize)]
pub struct RopeParameters {
    #[serde(default = "default_theta")]
    pub rope_theta: f32,
    #[serde(default = "default_rope_type")]
    pub rope_type: String,
}

fn default_eps() -> f32 {
    1e-6
}
fn default_theta() -> f32 {
    100.0
}
fn default_rope_type() -> String {
    "axial".into()
}
fn default_activation() -> String {
    "gelu_pytorch_tanh".into()
}

impl VisionConfig {
    /// The `vision_config` of a gemma4 `config.json`, if it has one.
    pub fn from_file(file: &JsonFile) -> Result<Option<VisionConfig>> {
        let Some(v) = file.value.get("vision_config").filter(|v| !v.is_null()) else {
            return Ok(None);
        };
        let cfg: VisionConfig = file.parse(v)?;
        cfg.validate()
            .map_err(|m| file.error(format!("vision_config: {m}")))?;
        Ok(Some(cfg))
    }

    fn validate(&self) -> std::result::Result<(), String> {
        for (name, v) in [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("patch_size", self.patch_size),
            ("pooling_kernel_size", self.pooling_kernel_size),
            ("position_embedding_size", self.position_embedding_size),
        ] {
            if v <= 0 {
                return Err(format!("`{name}` must be positive, got {v}"));
            }
        }
        if self.num_attention_heads % self.num_key_value_heads != 0 {
            return Err(format!(
                "`num_attention_heads` ({}) is not a multiple of `num_key_value_heads` ({})",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        // The axial rotation splits a head in two halves (x, y), each rotated as pairs.
        if self.head_dim % 4 != 0 {
            return Err(format!(
                "`head_dim` must be a multiple of 4, got {}",
                self.head_dim
            ));
        }
        if let Some(r) = &self.rope_parameters {
            if r.rope_type != "axial" {
                return Err(format!(
                    "rope_type {:?} is not supported (only \"axial\")",
                    r.rope_type
                ));
            }
        }
        if self.hidden_activation != "gelu_pytorch_tanh" {
            return Err(format!(
                "hidden_activation {:?} is not supported (only \"gelu_pytorch_tanh\")",
                self.hidden_activation
            ));
        }
        Ok(())
    }

    fn theta(&self) -> f32 {
        self.rope_parameters
            .as_ref()
            .map_or(default_theta(), |r| r.rope_theta)
    }

    /// Values in one patch: 3 channels of `patch_size²` pixels.
    pub fn patch_values(&self) -> i32 {
        3 * self.patch_size * self.patch_size
    }
}

/// Queries per attention block in the tower.
const ATTENTION_BLOCK: i32 = 256;

struct VisionLayer {
    input_norm: Array,
    post_attention_norm: Array,
    pre_feedforward_norm: Array,
    post_feedforward_norm: Array,
    q: ClippedLinear,
    k: ClippedLinear,
    v: ClippedLinear,
    o: ClippedLinear,
    q_norm: Array,
    k_norm: Array,
    gate: ClippedLinear,
    up: ClippedLinear,
    down: ClippedLinear,
}

impl VisionLayer {
    fn load(vb: &Vb, cfg: &VisionConfig) -> Result<VisionLayer> {
        let (h, i, d) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim);
        let (hq, hkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let attn = vb.pp("self_attn");
        let mlp = vb.pp("mlp");
        let lin = |vb: Vb, out, inp| ClippedLinear::load(&vb, cfg.use_clipped_linears, out, inp);
        Ok(VisionLayer {
            input_norm: vb.pp("input_layernorm").get("weight", &[h])?,
            post_attention_norm: vb.pp("post_attention_layernorm").get("weight", &[h])?,
            pre_feedforward_norm: vb.pp("pre_feedforward_layernorm").get("weight", &[h])?,
            post_feedforward_norm: vb.pp("post_feedforward_layernorm").get("weight", &[h])?,
            q: lin(attn.pp("q_proj"), hq * d, h)?,
            k: lin(attn.pp("k_proj"), hkv * d, h)?,
            v: lin(attn.pp("v_proj"), hkv * d, h)?,
            o: lin(attn.pp("o_proj"), h, hq * d)?,
            q_norm: attn.pp("q_norm").get("weight", &[d])?,
            k_norm: attn.pp("k_norm").get("weight", &[d])?,
            gate: lin(mlp.pp("gate_proj"), i, h)?,
            up: lin(mlp.pp("up_proj"), i, h)?,
            down: lin(mlp.pp("down_proj"), h, i)?,
        })
    }

    /// `x`: `[N, hidden]`, every patch of one image; `rot`: the axial rotation of its patches.
    fn forward(&self, x: &Array, rot: &Axial, cfg: &VisionConfig) -> Result<Array> {
        let eps = cfg.rms_norm_eps;
        let n = x.dim(0)?;
        let d = cfg.head_dim;
        let heads = |t: Array, count: i32| t.reshape(&[n, count, d]);
        let h = norm(x, Some(&self.input_norm), eps)?;
        let q = heads(self.q.forward(&h)?, cfg.num_attention_heads)?;
        let k = heads(self.k.forward(&h)?, cfg.num_key_value_heads)?;
        let v = heads(self.v.forward(&h)?, cfg.num_key_value_heads)?;
        let q = rot.apply(&norm(&q, Some(&self.q_norm), eps)?)?;
        let k = rot.apply(&norm(&k, Some(&self.k_norm), eps)?)?;
        let v = norm(&v, None, eps)?;
        // [N, H, D] → [1, H, N, D]; every patch sees every patch, unscaled (the norms did it).
        // Laid out head by head once: every block's products read them, and a strided view
        // would be copied by each.
        let bhnd = |t: &Array| t.transpose(&[1, 0, 2])?.expand_dims(0)?.contiguous();
        let (q, mut k, mut v) = (bhnd(&q)?, bhnd(&k)?, bhnd(&v)?);
        let group = cfg.num_attention_heads / cfg.num_key_value_heads;
        if group > 1 {
            k = k.repeat(group, 1)?;
            v = v.repeat(group, 1)?;
        }
        let kt = k.transpose(&[0, 1, 3, 2])?;
        // Queries a block at a time: a whole image's scores are heads × N² floats (275 MB for
        // E2B's 2,394 patches).
        let mut blocks = Vec::new();
        let mut at = 0;
        while at < n {
            let end = (at + ATTENTION_BLOCK).min(n);
            let qb = if at == 0 && end == n {
                q.clone()
            } else {
                q.slice_axis(2, at, Some(end))?
            };
            // softmax(q kᵀ) v with the fused softmax (MLX's CPU one is a libm call a value).
            let scores = qb.matmul(&kt)?;
            blocks.push(mlx::fast::softmax(&scores)?.matmul(&v)?);
            // Each block run before the next is built: in one graph MLX would run every
            // block's q kᵀ before any softmax and hold all their scores at once (one 640x480
            // image: 846 MB resident growth that way, 363 MB this way, and faster).
            blocks.last().expect("pushed").eval()?;
            at = end;
        }
        let a = if blocks.len() == 1 {
            blocks.pop().expect("one block")
        } else {
            let refs: Vec<&Array> = blocks.iter().collect();
            mlx::concatenate(&refs, 2)?
        };
        let a = a
            .squeeze_axes(&[0])?
            .transpose(&[1, 0, 2])?
            .reshape(&[n, cfg.num_attention_heads * d])?;
        let a = norm(&self.o.forward(&a)?, Some(&self.post_attention_norm), eps)?;
        let x = x.add(&a)?;
        let h = norm(&x, Some(&self.pre_feedforward_norm), eps)?;
        let m = gelu_tanh(&self.gate.forward(&h)?)?.multiply(&self.up.forward(&h)?)?;
        let m = norm(
            &self.down.forward(&m)?,
            Some(&self.post_feedforward_norm),
            eps,
        )?;
        Ok(x.add(&m)?)
    }
}

/// The axial rotation of one image's patches: a head's first half turns with the patch's x,
/// its second half with its y, each half as `rotate_half` pairs over `head_dim / 4` frequencies
/// `θ^(-2j / (head_dim / 2))`. Applied as `x · cos + swap(x) · sin±` (swap: each half's two
/// quarters exchanged; sin± negative on the first quarter), transformers' arithmetic in three
/// passes over the heads.
struct Axial {
    /// `[N, 1 (heads), 2 (axis), 2 (quarter), quarter]`.
    cos: Array,
    sin: Array,
}

impl Axial {
    fn new(positions: &[[i32; 2]], cfg: &VisionConfig) -> Result<Axial> {
        let quarter = (cfg.head_dim / 4) as usize;
        let half = (cfg.head_dim / 2) as f32;
        let inv: Vec<f32> = (0..quarter)
            .map(|j| 1.0 / cfg.theta().powf((2 * j) as f32 / half))
            .collect();
        let n = positions.len();
        let (mut cos, mut sin) = (Vec::with_capacity(n * 4 * quarter), Vec::new());
        sin.reserve(n * 4 * quarter);
        for p in positions {
            for &coord in p {
                // float32 throughout, as transformers computes the angles.
                let angles: Vec<f32> = inv.iter().map(|f| coord as f32 * f).collect();
                for sign in [-1.0f32, 1.0] {
                    cos.extend(angles.iter().map(|a| a.cos()));
                    sin.extend(angles.iter().map(|a| sign * a.sin()));
                }
            }
        }
        let shape = [n as i32, 1, 2, 2, quarter as i32];
        Ok(Axial {
            cos: Array::from_slice(&cos, &shape)?,
            sin: Array::from_slice(&sin, &shape)?,
        })
    }

    /// `x`: `[N, H, D]`.
    fn apply(&self, x: &Array) -> Result<Array> {
        let s = x.shape();
        let quarter = s[2] / 4;
        let parts = x.reshape(&[s[0], s[1], 2, 2, quarter])?;
        let cos = self.cos.astype(x.dtype())?;
        let sin = self.sin.astype(x.dtype())?;
        let turned = parts.multiply(&cos)?.add(&parts.flip(3)?.multiply(&sin)?)?;
        Ok(turned.reshape(&s)?)
    }
}

/// One image's patches as the image processor makes them: `pixels`, N rows of `3·patch²`
/// values (each patch's rows of pixels, channels last, in [0, 1]) and each patch's `(x, y)` in
/// the patch grid, row by row; the grid's sides are multiples of the pooling kernel. Plain data:
/// made off the engine thread.
#[derive(Debug, Clone)]
pub struct ImagePatches {
    pub pixels: Vec<f32>,
    pub positions: Vec<[i32; 2]>,
    /// Patches across and down.
    pub grid: (i32, i32),
}

impl ImagePatches {
    /// Soft tokens the image becomes.
    pub fn soft_tokens(&self, cfg: &VisionConfig) -> i32 {
        let k = cfg.pooling_kernel_size;
        (self.grid.0 / k) * (self.grid.1 / k)
    }
}

/// gemma4's vision tower and the embedder that projects its output into the text model.
pub struct Gemma4Vision {
    pub cfg: VisionConfig,
    patch_proj: Linear,
    /// `[2, position_embedding_size, hidden]`: x and y position embeddings.
    positions: Array,
    layers: Vec<VisionLayer>,
    standardize: Option<(Array, Array)>,
    embed_proj: Linear,
    text_hidden: i32,
}

impl Gemma4Vision {
    /// The tower under `model.vision_tower` and its embedder under `model.embed_vision`
    /// (transformers' `Gemma4ForConditionalGeneration` layout).
    pub fn new(cfg: VisionConfig, text_hidden: i32, w: &Weights) -> Result<Gemma4Vision> {
        let root = w.root().pp("model");
        let tower = root.pp("vision_tower");
        let h = cfg.hidden_size;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| VisionLayer::load(&tower.pp("encoder.layers").pp(i), &cfg))
            .collect::<Result<Vec<_>>>()?;
        let standardize = if cfg.standardize {
            Some((
                tower.get_f32("std_bias", &[h])?,
                tower.get_f32("std_scale", &[h])?,
            ))
        } else {
            None
        };
        Ok(Gemma4Vision {
            patch_proj: tower
                .pp("patch_embedder.input_proj")
                .linear(h, cfg.patch_values())?,
            positions: tower.pp("patch_embedder").get(
                "position_embedding_table",
                &[2, cfg.position_embedding_size, h],
            )?,
            layers,
            standardize,
            embed_proj: root
                .pp("embed_vision.embedding_projection")
                .linear(text_hidden, h)?,
            text_hidden,
            cfg,
        })
    }

    /// The soft tokens of one image, `[soft_tokens, text hidden]` in the compute dtype: the
    /// rows that replace the image's tokens in the text model's input.
    pub fn encode(&self, image: &ImagePatches) -> Result<Array> {
        self.finish(self.begin(image)?)
    }

    /// The tower's output for one image, `[soft_tokens, vision hidden]`: patches encoded,
    /// pooled, scaled and standardized (transformers' `Gemma4VisionModel`).
    pub fn tower(&self, image: &ImagePatches) -> Result<Array> {
        let mut e = self.begin(image)?;
        while self.advance(&mut e)? {}
        self.pooled(e)
    }

    /// Encoder layers: [`Gemma4Vision::advance`] runs one at a time.
    pub fn layers(&self) -> usize {
        self.layers.len()
    }

    /// An encoding of one image begun: its patches checked and embedded (nothing evaluated).
    pub fn begin(&self, image: &ImagePatches) -> Result<VisionEncoding> {
        let cfg = &self.cfg;
        let n = image.positions.len() as i32;
        let (gw, gh) = image.grid;
        let k = cfg.pooling_kernel_size;
        if n == 0 || gw * gh != n || gw % k != 0 || gh % k != 0 {
            return Err(ModelError::Invalid(format!(
                "an image of {n} patches on a {gw}x{gh} grid does not pool by {k}"
            )));
        }
        if image.pixels.len() != n as usize * cfg.patch_values() as usize {
            return Err(ModelError::Invalid(format!(
                "image patches of {} values, expected {n} x {}",
                image.pixels.len(),
                cfg.patch_values()
            )));
        }
        let limit = cfg.position_embedding_size;
        if gw > limit || gh > limit {
            return Err(ModelError::Invalid(format!(
                "a {gw}x{gh} patch grid is past the tower's {limit} positions a side"
            )));
        }
        let dtype = self.positions.dtype();
        // The processor's [0, 1] pixels, scaled to [-1, 1] here (gemma4 has no normalization).
        let pixels = Array::from_slice(&image.pixels, &[n, cfg.patch_values()])?
            .subtract_scalar(0.5)?
            .multiply_scalar(2.0)?
            .astype(dtype)?;
        let ids = |axis: usize| -> Result<Array> {
            let v: Vec<i32> = image.positions.iter().map(|p| p[axis]).collect();
            Ok(Array::from_slice(&v, &[n])?)
        };
        let table = |axis: i32| {
            self.positions
                .slice_axis(0, axis, Some(axis + 1))?
                .squeeze_axes(&[0])
        };
        let pos = table(0)?
            .take(&ids(0)?, 0)?
            .add(&table(1)?.take(&ids(1)?, 0)?)?;
        Ok(VisionEncoding {
            x: self.patch_proj.forward(&pixels)?.add(&pos)?,
            rot: Axial::new(&image.positions, cfg)?,
            grid: image.grid,
            next: 0,
        })
    }

    /// Runs the next encoder layer (lazily); `false` once every layer has run.
    pub fn advance(&self, e: &mut VisionEncoding) -> Result<bool> {
        let Some(layer) = self.layers.get(e.next) else {
            return Ok(false);
        };
        e.x = layer.forward(&e.x, &e.rot, &self.cfg)?;
        e.next += 1;
        Ok(true)
    }

    /// The soft tokens of a finished encoding (its remaining layers run first).
    pub fn finish(&self, mut e: VisionEncoding) -> Result<Array> {
        while self.advance(&mut e)? {}
        let pooled = self.pooled(e)?;
        let normed = norm(&pooled, None, self.cfg.rms_norm_eps)?;
        let out = self.embed_proj.forward(&normed)?;
        debug_assert_eq!(out.dim(1).ok(), Some(self.text_hidden));
        Ok(out)
    }

    /// Average each k×k block of the patch grid (patches are row by row), in float32, then
    /// scale by √hidden and standardize.
    fn pooled(&self, e: VisionEncoding) -> Result<Array> {
        let cfg = &self.cfg;
        let (gw, gh) = e.grid;
        let k = cfg.pooling_kernel_size;
        let dtype = self.positions.dtype();
        let h = cfg.hidden_size;
        let pooled =
            e.x.astype(Dtype::F32)?
                .reshape(&[gh / k, k, gw / k, k, h])?
                .mean(&[1, 3], false)?
                .reshape(&[(gh / k) * (gw / k), h])?
                .multiply_scalar((h as f64).sqrt())?;
        let pooled = match &self.standardize {
            Some((bias, scale)) => pooled.subtract(bias)?.multiply(scale)?,
            None => pooled,
        };
        Ok(pooled.astype(dtype)?)
    }

    /// The activations an encoding holds, to evaluate between layers.
    pub fn state(e: &VisionEncoding) -> &Array {
        &e.x
    }
}

/// One image's encoding part-way through the tower: what [`Gemma4Vision::advance`] resumes.
pub struct VisionEncoding {
    x: Array,
    rot: Axial,
    grid: (i32, i32),
    next: usize,
}

/// What the HTTP side needs to put an image into a prompt: the processor, and the tokens an
/// image becomes (`boi`, one `image_token` per soft token, `eoi`). Plain data.
#[derive(Debug, Clone)]
pub struct ImagePrompt {
    pub processor: crate::gemma4_image::ImageProcessorConfig,
    pub boi: u32,
    pub eoi: u32,
    pub image_token: u32,
    /// Whether an image's soft tokens see each other both ways (an image must then be whole in
    /// one forward pass; see [`crate::MediaSpan`]).
    pub bidirectional: bool,
}

impl ImagePrompt {
    /// From a gemma4 `config.json` and the image processor's config.
    pub fn new(
        file: &JsonFile,
        processor: crate::gemma4_image::ImageProcessorConfig,
        vision: &VisionConfig,
    ) -> Result<ImagePrompt> {
        let id = |key: &str| -> Result<u32> {
            file.value
                .get(key)
                .and_then(Value::as_u64)
                .map(|v| v as u32)
                .ok_or_else(|| file.error(format!("missing field `{key}` (an image needs it)")))
        };
        if processor.patch_size != vision.patch_size
            || processor.pooling_kernel_size != vision.pooling_kernel_size
        {
            return Err(file.error(format!(
                "the image processor cuts {}-pixel patches pooled by {}, the tower takes {} and {}",
                processor.patch_size,
                processor.pooling_kernel_size,
                vision.patch_size,
                vision.pooling_kernel_size
            )));
        }
        let bidirectional = file
            .value
            .get("text_config")
            .and_then(|t| t.get("use_bidirectional_attention"))
            .and_then(Value::as_str)
            == Some("vision");
        Ok(ImagePrompt {
            processor,
            boi: id("boi_token_id")?,
            eoi: id("eoi_token_id")?,
            image_token: id("image_token_id")?,
            bidirectional,
        })
    }
}

/// The text model's hidden size, where the embedder projects to.
pub(crate) fn text_hidden(file: &JsonFile) -> Result<i32> {
    file.value
        .get("text_config")
        .and_then(|t| t.get("hidden_size"))
        .and_then(Value::as_i64)
        .map(|h| h as i32)
        .ok_or_else(|| file.error("missing field `text_config.hidden_size`"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vision_configs_it_cannot_run_are_refused_by_name() {
        let base = serde_json::json!({
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
            "patch_size": 4, "pooling_kernel_size": 2, "position_embedding_size": 16,
        });
        let check = |patch: serde_json::Value| {
            let mut v = base.clone();
            for (k, x) in patch.as_object().unwrap() {
                v[k] = x.clone();
            }
            serde_json::from_value::<VisionConfig>(v)
                .unwrap()
                .validate()
                .err()
        };
        assert_eq!(check(serde_json::json!({})), None);
        let e = |p| check(p).unwrap_or_default();
        assert!(e(serde_json::json!({"head_dim": 18})).contains("multiple of 4"));
        assert!(e(serde_json::json!({"num_key_value_heads": 3})).contains("not a multiple"));
        assert!(
            e(serde_json::json!({"rope_parameters": {"rope_type": "default"}}))
                .contains("only \"axial\"")
        );
        assert!(e(serde_json::json!({"hidden_activation": "relu"})).contains("gelu_pytorch_tanh"));
        assert!(e(serde_json::json!({"patch_size": 0})).contains("`patch_size` must be positive"));
    }
}
