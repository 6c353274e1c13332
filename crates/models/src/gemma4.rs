//! gemma4 text models (docs/MODELS.md §1): E2B/E4B with per-layer embeddings and KV-shared layers,
//! 31B with k_eq_v full layers, and the 26B MoE form with experts beside the dense MLP.
//!
//! Reads top to bottom in the order data flows: config, attention, MLP and MoE, decoder layer,
//! the model. The model holds weights only; caches are passed in (one per non-shared layer).

use crate::attention::{Keys, Recipe, Rows};
use crate::config::JsonFile;
use crate::nn::{
    add_norm, add_norm_then_norm, forward_all, gelu_tanh, norm, quantized_alike, Activation,
    Embedding, Experts, GatedMlp, Linear, Rope,
};
use crate::packed::{check_rows, single_row};
use crate::parallel::{self, Shard, Split, Stage};
use crate::parts::{self, Part};
use crate::pipeline;
use crate::weights::{Vb, Weights};
use crate::{CausalLm, ModelError, PackedRow, Result};
use cache::{AttnMask, KvCache, LayerCache, RotatingKvCache};
use mlx::fast::{sdpa_slots, Attention as Sdpa, KvSlots, QkvNorms, SdpaLayout::Tokens};
use mlx::{Array, Ix, Quantized};
use serde::Deserialize;
use serde_json::Value;
use std::collections::HashMap;
use std::ops::Range;

// ------------------------------------------------------------------------------------------
// Config
// ------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Deserialize)]
struct RopeParams {
    rope_type: Option<String>,
    rope_theta: Option<f32>,
    partial_rotary_factor: Option<f32>,
    factor: Option<f32>,
}

#[derive(Debug, Clone, Deserialize)]
struct PerLayer {
    head_dim: Option<i32>,
    num_key_value_heads: Option<i32>,
}

/// `text_config` of a `gemma4` checkpoint, or the whole config of `gemma4_text`. Both spellings
/// the ecosystem writes are accepted (docs/MODELS.md §1.1: `global_head_dim` /
/// `num_global_key_value_heads` or transformers' `per_layer_config`; `layer_types` or a window
/// pattern; `rope_parameters` or `rope_theta`).
#[derive(Debug, Clone, Deserialize)]
pub struct Gemma4Config {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    #[serde(default = "one")]
    pub num_key_value_heads: i32,
    #[serde(default = "d256")]
    pub head_dim: i32,
    pub global_head_dim: Option<i32>,
    pub num_global_key_value_heads: Option<i32>,
    per_layer_config: Option<HashMap<String, PerLayer>>,
    pub vocab_size: i32,
    #[serde(default = "eps6")]
    pub rms_norm_eps: f32,
    pub sliding_window: i32,
    layer_types: Option<Vec<String>>,
    sliding_window_pattern: Option<i32>,
    #[serde(default)]
    pub num_kv_shared_layers: i32,
    pub hidden_size_per_layer_input: Option<i32>,
    pub vocab_size_per_layer_input: Option<i32>,
    #[serde(default)]
    pub use_double_wide_mlp: bool,
    #[serde(default)]
    pub attention_k_eq_v: bool,
    #[serde(default)]
    pub enable_moe_block: bool,
    pub num_experts: Option<i32>,
    pub top_k_experts: Option<i32>,
    pub moe_intermediate_size: Option<i32>,
    pub final_logit_softcapping: Option<f32>,
    #[serde(default = "ctx")]
    pub max_position_embeddings: usize,
    #[serde(default = "yes")]
    pub tie_word_embeddings: bool,
    rope_parameters: Option<HashMap<String, RopeParams>>,
    rope_theta: Option<f32>,
    /// The token whose per-layer embedding media positions read (transformers feeds the pad
    /// token there).
    #[serde(default)]
    pub pad_token_id: Option<i32>,
    /// `"vision"`: an image's soft tokens see each other both ways in the sliding layers (the
    /// larger models); unset: causal everywhere.
    #[serde(default)]
    pub use_bidirectional_attention: Option<String>,
}

fn one() -> i32 {
    1
}
fn d256() -> i32 {
    256
}
fn eps6() -> f32 {
    1e-6
}
fn ctx() -> usize {
    131072
}
fn yes() -> bool {
    true
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayerKind {
    Sliding,
    Full,
}

/// Everything a layer's shape depends on, resolved from the config.
#[derive(Debug, Clone)]
pub struct LayerSpec {
    pub kind: LayerKind,
    pub head_dim: i32,
    pub kv_heads: i32,
    /// The earlier layer whose K/V this KV-shared layer reads.
    pub shared_from: Option<usize>,
    /// k_eq_v full layers reuse the raw key projection as values.
    pub k_eq_v: bool,
    pub intermediate: i32,
}

impl Gemma4Config {
    /// Reads the text config from `config.json` (`gemma4` wrapper or `gemma4_text`).
    pub fn from_file(file: &JsonFile) -> Result<Gemma4Config> {
        let text = file.value.get("text_config").unwrap_or(&file.value);
        let mut cfg: Gemma4Config = file.parse(text)?;
        if cfg.vocab_size <= 0 {
            if let Some(v) = file.value.get("vocab_size").and_then(Value::as_i64) {
                cfg.vocab_size = v as i32;
            }
        }
        cfg.validate().map_err(|m| file.error(m))?;
        Ok(cfg)
    }

    /// The text config without the checks that assume a full model (the assistant's layers are
    /// all KV-shared).
    pub(crate) fn parse_text(file: &JsonFile) -> Result<Gemma4Config> {
        let text = file.value.get("text_config").unwrap_or(&file.value);
        file.parse(text)
    }

    fn validate(&self) -> std::result::Result<(), String> {
        if let Some(v) = &self.use_bidirectional_attention {
            if v != "vision" {
                return Err(format!(
                    "use_bidirectional_attention {v:?} is not supported (only \"vision\")"
                ));
            }
        }
        let positive = [
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("intermediate_size", self.intermediate_size),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab_size),
            ("sliding_window", self.sliding_window),
        ];
        for (name, v) in positive {
            if v <= 0 {
                return Err(format!("{name} must be positive, got {v}"));
            }
        }
        if let Some(t) = &self.layer_types {
            if t.len() != self.num_hidden_layers as usize {
                return Err(format!(
                    "layer_types has {} entries for {} layers",
                    t.len(),
                    self.num_hidden_layers
                ));
            }
            if let Some(bad) = t
                .iter()
                .find(|s| *s != "sliding_attention" && *s != "full_attention")
            {
                return Err(format!("layer_types: unknown layer type {bad:?}"));
            }
        }
        if self.num_kv_shared_layers < 0 || self.num_kv_shared_layers >= self.num_hidden_layers {
            return Err(format!(
                "num_kv_shared_layers must be in [0, num_hidden_layers), got {}",
                self.num_kv_shared_layers
            ));
        }
        if self.enable_moe_block {
            for (name, v) in [
                ("num_experts", self.num_experts),
                ("top_k_experts", self.top_k_experts),
                ("moe_intermediate_size", self.moe_intermediate_size),
            ] {
                if v.unwrap_or(0) <= 0 {
                    return Err(format!("enable_moe_block needs a positive {name}"));
                }
            }
            if self.top_k_experts > self.num_experts {
                return Err("top_k_experts exceeds num_experts".into());
            }
        }
        let specs = self.layer_specs()?;
        for (i, s) in specs.iter().enumerate() {
            if self.num_attention_heads % s.kv_heads != 0 {
                return Err(format!(
                    "layer {i}: num_attention_heads {} is not a multiple of its {} KV heads",
                    self.num_attention_heads, s.kv_heads
                ));
            }
        }
        Ok(())
    }

    pub fn layer_kinds(&self) -> Vec<LayerKind> {
        let n = self.num_hidden_layers as usize;
        match &self.layer_types {
            Some(t) => t
                .iter()
                .map(|s| {
                    if s == "full_attention" {
                        LayerKind::Full
                    } else {
                        LayerKind::Sliding
                    }
                })
                .collect(),
            None => {
                // mlx-lm's fallback: (pattern - 1) sliding layers, then one full layer.
                let p = self.sliding_window_pattern.unwrap_or(5).max(1) as usize;
                (0..n)
                    .map(|i| {
                        if (i + 1) % p == 0 {
                            LayerKind::Full
                        } else {
                            LayerKind::Sliding
                        }
                    })
                    .collect()
            }
        }
    }

    pub fn ple_dim(&self) -> i32 {
        self.hidden_size_per_layer_input.unwrap_or(0)
    }

    pub fn first_shared(&self) -> usize {
        (self.num_hidden_layers - self.num_kv_shared_layers) as usize
    }

    pub fn layer_specs(&self) -> std::result::Result<Vec<LayerSpec>, String> {
        let kinds = self.layer_kinds();
        let first_shared = self.first_shared();
        let mut last_of_kind: HashMap<LayerKind, usize> = HashMap::new();
        let mut out = Vec::with_capacity(kinds.len());
        for (i, &kind) in kinds.iter().enumerate() {
            let full = kind == LayerKind::Full;
            let k_eq_v = self.attention_k_eq_v && full;
            let mut head_dim = if full {
                self.global_head_dim.unwrap_or(self.head_dim)
            } else {
                self.head_dim
            };
            let mut kv_heads = if k_eq_v {
                self.num_global_key_value_heads
                    .unwrap_or(self.num_key_value_heads)
            } else {
                self.num_key_value_heads
            };
            if let Some(pl) = self
                .per_layer_config
                .as_ref()
                .and_then(|m| m.get(&i.to_string()))
            {
                head_dim = pl.head_dim.unwrap_or(head_dim);
                kv_heads = pl.num_key_value_heads.unwrap_or(kv_heads);
            }
            let shared_from = if i >= first_shared {
                Some(*last_of_kind.get(&kind).ok_or_else(|| {
                    format!("KV-shared layer {i} has no earlier {kind:?} layer to share with")
                })?)
            } else {
                last_of_kind.insert(kind, i);
                None
            };
            let wide = self.use_double_wide_mlp && shared_from.is_some();
            out.push(LayerSpec {
                kind,
                head_dim,
                kv_heads,
                shared_from,
                k_eq_v,
                intermediate: self.intermediate_size * if wide { 2 } else { 1 },
            });
        }
        Ok(out)
    }

    fn rope_params(&self, kind: LayerKind) -> Option<&RopeParams> {
        let key = match kind {
            LayerKind::Sliding => "sliding_attention",
            LayerKind::Full => "full_attention",
        };
        self.rope_parameters.as_ref().and_then(|m| m.get(key))
    }

    pub(crate) fn rope(&self, kind: LayerKind, head_dim: i32) -> Result<Rope> {
        let p = self.rope_params(kind);
        let (default_theta, default_type, default_partial) = match kind {
            LayerKind::Sliding => (10_000.0, "default", 1.0),
            LayerKind::Full => (1_000_000.0, "proportional", 0.25),
        };
        let theta = p
            .and_then(|p| p.rope_theta)
            .or(self.rope_theta.filter(|_| kind == LayerKind::Sliding))
            .unwrap_or(default_theta);
        let ty = p
            .and_then(|p| p.rope_type.clone())
            .unwrap_or(default_type.into());
        let partial = p
            .and_then(|p| p.partial_rotary_factor)
            .unwrap_or(default_partial);
        let factor = p.and_then(|p| p.factor).unwrap_or(1.0);
        match ty.as_str() {
            "proportional" => {
                let rotated = (partial * head_dim as f32 / 2.0).floor() as i32;
                Rope::proportional(head_dim, rotated, theta, factor)
            }
            "default" => {
                let dims = (head_dim as f32 * partial) as i32;
                Ok(Rope::standard(dims, theta, false))
            }
            other => Err(ModelError::Invalid(format!(
                "rope_type {other:?} is not supported"
            ))),
        }
    }
}

// ------------------------------------------------------------------------------------------
// Blocks
// ------------------------------------------------------------------------------------------

/// The projection `y: [B, L, n·d]` as `[B, n, L, d]` RMS-normalised heads (one sequence per
/// batch row). The norm runs over `d` wherever the heads sit, so for one position per sequence
/// this is a reshape straight from the projection and the norm (two ops); for longer ones the
/// norm reads contiguous rows before the transpose.
fn heads(y: &Array, n: i32, d: i32, w: Option<&Array>, eps: f32) -> Result<Array> {
    let s = y.shape();
    if s[1] == 1 {
        return norm(&y.reshape(&[s[0], n, 1, d])?, w, eps);
    }
    Ok(norm(&y.reshape(&[s[0], s[1], n, d])?, w, eps)?.transpose(&[0, 2, 1, 3])?)
}

pub(crate) struct Attention {
    q_proj: Linear,
    k_proj: Option<Linear>,
    v_proj: Option<Linear>,
    o_proj: Linear,
    q_norm: Array,
    k_norm: Option<Array>,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
}

impl Attention {
    fn new(vb: &Vb, cfg: &Gemma4Config, spec: &LayerSpec) -> Result<Attention> {
        let (h, d, nh, nkv) = (
            cfg.hidden_size,
            spec.head_dim,
            cfg.num_attention_heads,
            spec.kv_heads,
        );
        let own_kv = spec.shared_from.is_none();
        Ok(Attention {
            q_proj: vb.pp("q_proj").linear(nh * d, h)?,
            k_proj: own_kv
                .then(|| vb.pp("k_proj").linear(nkv * d, h))
                .transpose()?,
            v_proj: (own_kv && !spec.k_eq_v)
                .then(|| vb.pp("v_proj").linear(nkv * d, h))
                .transpose()?,
            o_proj: vb.pp("o_proj").linear(h, nh * d)?,
            q_norm: vb.pp("q_norm").get("weight", &[d])?,
            k_norm: own_kv
                .then(|| vb.pp("k_norm").get("weight", &[d]))
                .transpose()?,
            heads: nh,
            kv_heads: nkv,
            head_dim: d,
        })
    }

    /// This rank's heads (tensor parallel, [`Shard::heads`]): their query, key and value rows
    /// and the output projection's columns, summed over the ranks.
    fn split(self, w: &Weights, shard: &Shard) -> Result<Attention> {
        let heads = shard.heads(self.heads, self.kv_heads)?;
        let d = self.head_dim;
        let rows = |r: &Range<i32>| Part::Rows(r.start * d..r.end * d);
        let kv = |l: Option<Linear>| l.map(|l| parts::linear(w, l, &rows(&heads.kv))).transpose();
        Ok(Attention {
            q_proj: parts::linear(w, self.q_proj, &rows(&heads.q))?,
            k_proj: kv(self.k_proj)?,
            v_proj: kv(self.v_proj)?,
            o_proj: parts::summed(w, self.o_proj, heads.q.start * d..heads.q.end * d, shard)?,
            heads: heads.q.end - heads.q.start,
            kv_heads: heads.kv.end - heads.kv.start,
            ..self
        })
    }

    /// The raw query projection, and the raw key and value projections of this layer's own
    /// (none in a KV-shared layer), read from `x` in one op where their formats allow. Under
    /// k_eq_v the raw keys, taken before k_norm, double as the values.
    fn project_qkv(&self, x: &Array) -> Result<(Array, Option<(Array, Array)>)> {
        let mut layers = vec![&self.q_proj];
        layers.extend(&self.k_proj);
        layers.extend(&self.v_proj);
        let mut raw = forward_all(x, &layers)?.into_iter();
        let q_raw = raw
            .next()
            .ok_or_else(|| ModelError::Invalid("no query projection".into()))?;
        let kv = raw.next().map(|k_raw| {
            let v_raw = raw.next().unwrap_or_else(|| k_raw.clone());
            (k_raw, v_raw)
        });
        Ok((q_raw, kv))
    }

    /// The q, k and (unless the keys are the values) v projections, where this layer has keys
    /// and all are quantized alike: what one q/k/v op takes.
    fn quantized_qkv(&self) -> Option<Vec<&Quantized>> {
        let mut layers = vec![&self.q_proj, self.k_proj.as_ref()?];
        layers.extend(&self.v_proj);
        quantized_alike(&layers)
    }

    fn k_norm(&self) -> Result<&Array> {
        self.k_norm
            .as_ref()
            .ok_or_else(|| ModelError::Invalid("keys projected without a k_norm".into()))
    }

    /// Normalised `[B, n, L, d]` queries, and the keys and values of this layer's own
    /// projections (none in a KV-shared layer), not yet rotated (each row of a packed batch
    /// rotates at its own offset).
    fn qkv_heads(&self, x: &Array, eps: f32) -> Result<(Array, Option<(Array, Array)>)> {
        let (q_raw, kv) = self.project_qkv(x)?;
        let q = self.q_from(&q_raw, eps)?;
        let (n, d) = (self.kv_heads, self.head_dim);
        let kv = match kv {
            Some((k_raw, v_raw)) => Some((
                heads(&k_raw, n, d, Some(self.k_norm()?), eps)?,
                heads(&v_raw, n, d, None, eps)?,
            )),
            None => None,
        };
        Ok((q, kv))
    }

    /// A decode step's queries, and keys and values of this layer's own projections, each
    /// `[T, n, 1, d]` for `x: [1, T, hidden]` (token `t` its own sequence, at position
    /// `offsets[t]`): normalised, queries and keys rotated, all three in one op.
    fn qkv_rows(
        &self,
        x: &Array,
        eps: f32,
        rope: &Rope,
        offsets: &Array,
    ) -> Result<(Array, Option<(Array, Array)>)> {
        if let Some(mats) = self.quantized_qkv() {
            let (q, k, v) = rope.quantized_qkv_rows(x, &mats, self.norms(eps)?, offsets)?;
            return Ok((q, Some((k, v))));
        }
        let (q_raw, kv) = self.project_qkv(x)?;
        match kv {
            Some((k_raw, v_raw)) => {
                let (q, k, v) =
                    rope.qkv_rows((&q_raw, &k_raw, &v_raw), self.norms(eps)?, offsets)?;
                Ok((q, Some((k, v))))
            }
            None => Ok((
                rope.heads_rows(&q_raw, self.heads, Some(&self.q_norm), eps, offsets)?,
                None,
            )),
        }
    }

    /// What the fused q/k/v ops normalise this layer's heads with.
    fn norms(&self, eps: f32) -> Result<QkvNorms<'_>> {
        Ok(QkvNorms {
            q_heads: self.heads,
            kv_heads: self.kv_heads,
            q_norm: &self.q_norm,
            k_norm: self.k_norm()?,
            eps,
        })
    }

    /// Normalised `[B, H, L, d]` queries from the raw query projection.
    fn q_from(&self, q_raw: &Array, eps: f32) -> Result<Array> {
        heads(q_raw, self.heads, self.head_dim, Some(&self.q_norm), eps)
    }

    /// Normalised `[B, H, L, d]` queries, not yet rotated.
    fn project_q(&self, x: &Array, eps: f32) -> Result<Array> {
        self.q_from(&self.q_proj.forward(x)?, eps)
    }

    pub(crate) fn queries(&self, x: &Array, rope: &Rope, offset: usize, eps: f32) -> Result<Array> {
        rope.apply(&self.project_q(x, eps)?, offset)
    }

    /// Attention of `[B, H, L, d]` queries over keys and values, before the output projection:
    /// `[B, L, H·d]`.
    pub(crate) fn attend(&self, q: &Array, kv: &KvSlots, mask: &AttnMask) -> Result<Array> {
        let attn = Sdpa::new(ATTENTION_SCALE, mask.as_sdpa()).with_layout(Tokens);
        Ok(sdpa_slots(q, kv, attn)?)
    }

    /// The output projection of [`Attention::attend`]'s result (summed over the ranks where
    /// the heads are split).
    pub(crate) fn project_out(&self, x: &Array) -> Result<Array> {
        self.o_proj.forward(x)
    }
}

/// q and k are RMS-normalised, so the attention scale is 1 (docs/MODELS.md §1.3).
const ATTENTION_SCALE: f32 = 1.0;

/// The 26B form's expert block, which runs beside the dense MLP.
struct Moe {
    proj: Linear,
    /// `router.scale · H^-½`, folded into the router's RMS norm weight.
    router_norm: Array,
    per_expert_scale: Array,
    gate: Experts,
    up: Experts,
    down: Experts,
    top_k: i32,
    experts: i32,
    /// Split by tensors: the experts' partial products are summed over the ranks.
    shard: Option<Shard>,
}

impl Moe {
    fn new(vb: &Vb, cfg: &Gemma4Config) -> Result<Moe> {
        let h = cfg.hidden_size;
        let e = cfg.num_experts.unwrap_or(0);
        let i = cfg.moe_intermediate_size.unwrap_or(0);
        let router = vb.pp("router");
        let scale = router.get("scale", &[h])?;
        let router_norm = vb
            .weights()
            .keep(scale.multiply_scalar(f64::from(h).powf(-0.5))?);
        let ex = vb.pp("experts");
        let (gate, up) = if ex.pp("gate_up_proj").is_quantized() {
            // ollama's import of that layout: the fused stack, quantized.
            let q = ex.pp("gate_up_proj").quantized(&[e], 2 * i, h)?;
            Experts::quantized_halves(vb.weights(), q)?
        } else if ex.has("gate_up_proj") {
            // transformers' fused layout: rows 0..I are the gate, I..2I the up projection.
            let gu = ex.get("gate_up_proj", &[e, 2 * i, h])?;
            let parts = gu.split(2, 1)?;
            let halves = (
                Experts::dense(vb.weights(), parts[0].clone())?,
                Experts::dense(vb.weights(), parts[1].clone())?,
            );
            vb.weights().withdraw(&gu);
            halves
        } else {
            let sg = ex.pp("switch_glu");
            (
                sg.pp("gate_proj").experts(e, i, h)?,
                sg.pp("up_proj").experts(e, i, h)?,
            )
        };
        let down = if ex.pp("down_proj").is_quantized() {
            ex.pp("down_proj").experts(e, h, i)?
        } else if ex.has("down_proj") {
            Experts::dense(vb.weights(), ex.get("down_proj", &[e, h, i])?)?
        } else {
            ex.pp("switch_glu").pp("down_proj").experts(e, h, i)?
        };
        Ok(Moe {
            proj: router.pp("proj").linear(e, h)?,
            router_norm,
            per_expert_scale: router.get("per_expert_scale", &[e])?,
            gate,
            up,
            down,
            top_k: cfg.top_k_experts.unwrap_or(1),
            experts: e,
            shard: None,
        })
    }

    /// This rank's hidden units of every expert; the router stays whole.
    fn split(self, w: &Weights, shard: &Shard, hidden: i32) -> Result<Moe> {
        let [gate, up, down] =
            parts::expert_mlp(w, shard, [self.gate, self.up, self.down], hidden)?;
        Ok(Moe {
            gate,
            up,
            down,
            shard: Some(shard.clone()),
            ..self
        })
    }

    /// `router_in` is the residual stream, `x` the pre-normed expert input; both `[B, L, H]`.
    fn forward(&self, router_in: &Array, x: &Array, eps: f32) -> Result<Array> {
        let scores = self
            .proj
            .forward(&norm(router_in, Some(&self.router_norm), eps)?)?;
        let k = self.top_k;
        let idx =
            scores
                .argpartition(self.experts - k, -1)?
                .slice_axis(-1, self.experts - k, None)?;
        // A softmax over the selected logits equals renormalising the full softmax over them.
        let w = scores.take_along_axis(&idx, -1)?.softmax(&[-1], true)?;
        let w = w.multiply(&self.per_expert_scale.take(&idx, 0)?)?;
        let xe = x.expand_dims_axes(&[-2, -3])?; // [B, L, 1, 1, H]
        let g = self.gate.forward(&xe, &idx, false)?;
        let u = self.up.forward(&xe, &idx, false)?;
        let y = self
            .down
            .forward(&Activation::GeluTanh.gated(&g, &u)?, &idx, false)?; // [B, L, k, 1, H]
        let out = y
            .squeeze(-2)?
            .multiply(&w.expand_dims(-1)?)?
            .sum(&[-2], false)?;
        match &self.shard {
            Some(shard) => shard.sum(&out),
            None => Ok(out),
        }
    }
}

struct PerLayerInput {
    gate: Linear,
    proj: Linear,
    post_norm: Array,
}

pub(crate) struct DecoderLayer {
    pub(crate) spec: LayerSpec,
    pub(crate) attn: Attention,
    mlp: GatedMlp,
    moe: Option<(Moe, [Array; 3])>, // pre_ffn_2, post_ffn_1, post_ffn_2
    pub(crate) input_norm: Array,
    pub(crate) post_attn_norm: Array,
    pre_ffn_norm: Array,
    post_ffn_norm: Array,
    ple: Option<PerLayerInput>,
    pub(crate) layer_scalar: Array,
}

impl DecoderLayer {
    pub(crate) fn new(vb: &Vb, cfg: &Gemma4Config, spec: LayerSpec) -> Result<DecoderLayer> {
        let h = cfg.hidden_size;
        let n = |name: &str| vb.pp(name).get("weight", &[h]);
        let moe = if cfg.enable_moe_block {
            Some((
                Moe::new(vb, cfg)?,
                [
                    n("pre_feedforward_layernorm_2")?,
                    n("post_feedforward_layernorm_1")?,
                    n("post_feedforward_layernorm_2")?,
                ],
            ))
        } else {
            None
        };
        let p = cfg.ple_dim();
        let ple = if p > 0 {
            Some(PerLayerInput {
                gate: vb.pp("per_layer_input_gate").linear(p, h)?,
                proj: vb.pp("per_layer_projection").linear(h, p)?,
                post_norm: n("post_per_layer_input_norm")?,
            })
        } else {
            None
        };
        Ok(DecoderLayer {
            attn: Attention::new(&vb.pp("self_attn"), cfg, &spec)?,
            mlp: GatedMlp::load(&vb.pp("mlp"), h, spec.intermediate, Activation::GeluTanh)?,
            moe,
            input_norm: n("input_layernorm")?,
            post_attn_norm: n("post_attention_layernorm")?,
            pre_ffn_norm: n("pre_feedforward_layernorm")?,
            post_ffn_norm: n("post_feedforward_layernorm")?,
            ple,
            layer_scalar: vb.get("layer_scalar", &[1])?,
            spec,
        })
    }

    /// This rank's part of the layer, split by tensors ([`Shard`]): its heads, its hidden units
    /// of the MLP and of every expert; norms, router and per-layer inputs whole.
    pub(crate) fn split(
        self,
        w: &Weights,
        shard: &Shard,
        cfg: &Gemma4Config,
    ) -> Result<DecoderLayer> {
        let moe = match self.moe {
            Some((m, norms)) => Some((
                m.split(w, shard, cfg.moe_intermediate_size.unwrap_or(0))?,
                norms,
            )),
            None => None,
        };
        Ok(DecoderLayer {
            attn: self.attn.split(w, shard)?,
            mlp: parts::mlp(w, shard, self.mlp, true)?,
            moe,
            ..self
        })
    }

    /// `h` plus the feed-forward block of `h`, times `scale` if given.
    pub(crate) fn feed_forward_residual(
        &self,
        h: &Array,
        eps: f32,
        scale: Option<&Array>,
    ) -> Result<Array> {
        self.feed_forward_add_norm(h, &norm(h, Some(&self.pre_ffn_norm), eps)?, eps, scale)
    }

    /// `h + post_ffn_norm(feed_forward(h, x))`, times `scale` if given: without experts, the
    /// down projection and the residual update are one op.
    fn feed_forward_add_norm(
        &self,
        h: &Array,
        x: &Array,
        eps: f32,
        scale: Option<&Array>,
    ) -> Result<Array> {
        let w = Some(&self.post_ffn_norm);
        match &self.moe {
            None => self
                .mlp
                .down
                .forward_add_norm(&self.mlp.hidden(x)?, h, w, eps, scale),
            Some(_) => add_norm(h, &self.feed_forward(h, x, eps)?, w, eps, scale),
        }
    }

    /// [`DecoderLayer::feed_forward_add_norm`], and its result normalised by `next` (the next
    /// block's input norm).
    fn feed_forward_add_norm_then_norm(
        &self,
        h: &Array,
        x: &Array,
        eps: f32,
        scale: Option<&Array>,
        next: &Array,
    ) -> Result<(Array, Array)> {
        let w = Some(&self.post_ffn_norm);
        match &self.moe {
            None => {
                let a = self.mlp.hidden(x)?;
                self.mlp
                    .down
                    .forward_add_norm_then_norm(&a, h, w, eps, scale, next)
            }
            Some(_) => add_norm_then_norm(h, &self.feed_forward(h, x, eps)?, w, eps, scale, next),
        }
    }

    /// The feed-forward block's output for the residual stream `h` and its pre-normed input
    /// `x = pre_ffn_norm(h)`, before post_ffn_norm and the residual add.
    fn feed_forward(&self, h: &Array, x: &Array, eps: f32) -> Result<Array> {
        let dense = self.mlp.forward(x)?;
        Ok(match &self.moe {
            None => dense,
            Some((moe, [pre2, post1, post2])) => {
                let experts = moe.forward(h, &norm(h, Some(pre2), eps)?, eps)?;
                norm(&dense, Some(post1), eps)?.add(&norm(&experts, Some(post2), eps)?)?
            }
        })
    }
}

/// Per-layer embeddings of the E2B/E4B models.
struct Ple {
    /// The table, or split by tensors this rank's rows of it.
    embed: Embedding,
    vocab: i32,
    model_proj: Linear,
    proj_norm: Array,
    dim: i32,
}

// ------------------------------------------------------------------------------------------
// Model
// ------------------------------------------------------------------------------------------

pub struct Gemma4 {
    cfg: Gemma4Config,
    /// The token embedding, where this process embeds tokens, its head is tied to it or its
    /// layers read per-layer inputs (a model split over ranks needs it on the first stage, on
    /// the last for a tied head, and everywhere with per-layer embeddings).
    embed: Option<Embedding>,
    /// Split by tensors: this rank's rows of the table (a view of `embed` where it holds that).
    embed_rows: Option<Embedding>,
    ple: Option<Ple>,
    /// Every layer's shape, whether or not this process holds the layer.
    specs: Vec<LayerSpec>,
    /// The layers this process holds: all of them, or its stage's (`first..first + len`).
    layers: Vec<DecoderLayer>,
    first: usize,
    /// Split by layers over ranks: this rank's part, and the input norm of the layer after
    /// its last, whose input its last layer's update normalises (it is not discarded work: the
    /// fused update computes the norm with the sum).
    stage: Option<(Stage, Option<Array>)>,
    /// Split by tensors: this rank's share of every layer.
    shard: Option<Shard>,
    norm: Array,
    /// The untied head, or (split by tensors, every rank computing logits) this rank's rows
    /// of the head, tied or not.
    lm_head: Option<Linear>,
    rope_sliding: Rope,
    rope_full: Rope,
    /// Index into the caller's cache list for each non-shared layer.
    cache_slot: Vec<Option<usize>>,
    /// Extra history the rotating caches keep (see [`CausalLm::set_cache_slack`]).
    slack: usize,
    /// How the caches store keys and values (see [`CausalLm::set_cache_format`]).
    cache_format: mlx::RowFormat,
}

/// The K/V of the target's last non-shared sliding and full layers, which the gemma4 assistant
/// attends to (docs/MODELS.md §2.1).
pub struct SharedKv {
    /// Keys and values (`[1, nKV, S, d]`, slot order, as the cache stores them) and each
    /// slot's position (`-1` = empty).
    pub sliding: Option<(KvSlots, Vec<i32>)>,
    pub full: Option<KvSlots>,
    /// Positions the target caches hold.
    pub offset: usize,
}

/// The cache slots of the target's store layers ([`Gemma4::store_slots`]).
#[derive(Debug, Clone, Copy)]
pub struct StoreSlots {
    pub sliding: Option<usize>,
    pub full: Option<usize>,
}

impl StoreSlots {
    /// The store layers' K/V in `caches`.
    pub fn shared_kv(&self, caches: &[LayerCache]) -> Result<SharedKv> {
        let mut out = SharedKv {
            sliding: None,
            full: None,
            offset: caches.first().map_or(0, LayerCache::offset),
        };
        let kind =
            |slot: usize| ModelError::Invalid(format!("cache slot {slot} has an unexpected kind"));
        if let Some(slot) = self.sliding {
            match caches.get(slot) {
                Some(LayerCache::Rotating(c)) => out.sliding = c.held_slots()?,
                _ => return Err(kind(slot)),
            }
        }
        if let Some(slot) = self.full {
            match caches.get(slot) {
                Some(LayerCache::Kv(c)) => out.full = c.slots()?,
                _ => return Err(kind(slot)),
            }
        }
        Ok(out)
    }
}

/// The checkpoint prefix of the text model: transformers' multimodal wrapper, mlx-lm's
/// multimodal wrapper, or a text-only checkpoint.
fn text_prefix(w: &Weights) -> Result<&'static str> {
    for p in ["model.language_model", "language_model.model", "model"] {
        if w.contains(&format!("{p}.embed_tokens.weight")) {
            return Ok(p);
        }
    }
    Err(ModelError::MissingTensor {
        name: "model.embed_tokens.weight (or model.language_model.embed_tokens.weight)".into(),
        dir: "the checkpoint".into(),
    })
}

impl Gemma4 {
    pub fn new(cfg: Gemma4Config, w: &Weights) -> Result<Gemma4> {
        Self::with_split(cfg, w, None)
    }

    /// Layer ranges for `ranks` stages, balanced by the layers' bytes in `w`. KV-shared layers
    /// read caches their source layers write in the same pass, so no stage may begin between
    /// a source and the last layer.
    pub fn split(
        cfg: &Gemma4Config,
        w: &Weights,
        ranks: usize,
        ends: parallel::Ends,
    ) -> Result<Vec<Range<usize>>> {
        let specs = cfg.layer_specs().map_err(ModelError::Invalid)?;
        let root = text_prefix(w)?;
        let sizes = w.tensor_bytes();
        let tensors = || sizes.iter().map(|(n, b)| (n.as_str(), *b));
        let bytes = parallel::layer_bytes(tensors(), &format!("{root}.layers"), specs.len());
        let end_bytes = parallel::end_bytes(
            ends,
            parallel::bytes_under(tensors(), &format!("{root}.embed_tokens.")),
            parallel::bytes_under(tensors(), "lm_head."),
            cfg.tie_word_embeddings,
            cfg.ple_dim() > 0,
        );
        let first_source = specs.iter().filter_map(|s| s.shared_from).min();
        parallel::split_layers(&bytes, ranks, end_bytes, |b| {
            first_source.is_none_or(|src| b <= src)
        })
        .map_err(|e| match first_source {
            Some(src) => ModelError::Invalid(format!(
                "{e} (layers {src}.. stay together: the KV-shared layers read layer {src}'s cache)"
            )),
            None => e,
        })
    }

    /// The model, or this rank's part of it: with a [`Stage`] only that stage's layers (and
    /// their caches), with a [`Shard`] its share of every layer.
    pub fn with_split(cfg: Gemma4Config, w: &Weights, split: Option<Split>) -> Result<Gemma4> {
        let stage = split.as_ref().and_then(Split::stage).cloned();
        let shard = split.as_ref().and_then(Split::shard).cloned();
        let specs = cfg.layer_specs().map_err(ModelError::Invalid)?;
        let held = stage.as_ref().map_or(0..specs.len(), Stage::layers);
        if held.end > specs.len() || held.is_empty() {
            return Err(ModelError::Invalid(format!(
                "a stage of layers {held:?} in a model of {} layers",
                specs.len()
            )));
        }
        if let Some(src) = specs[held.clone()]
            .iter()
            .filter_map(|s| s.shared_from)
            .find(|s| !held.contains(s))
        {
            return Err(ModelError::Invalid(format!(
                "layers {held:?} share the K/V of layer {src}, which another stage holds"
            )));
        }
        let root = w.root().pp(text_prefix(w)?);
        let h = cfg.hidden_size;
        let l = cfg.num_hidden_layers;
        let p = cfg.ple_dim();
        let ple = if p > 0 {
            let v = cfg.vocab_size_per_layer_input.unwrap_or(cfg.vocab_size);
            let embed = root.pp("embed_tokens_per_layer").embedding(v, l * p)?;
            // Split by tensors, this table (E2B's is larger than its layers) splits by
            // vocabulary as the token embedding does.
            let embed = match &shard {
                Some(sh) => parts::embedding_rows(w, embed, &sh.vocab_part(v))?,
                None => embed,
            };
            Some(Ple {
                embed,
                vocab: v,
                model_proj: root.pp("per_layer_model_projection").linear(l * p, h)?,
                proj_norm: root.pp("per_layer_projection_norm").get("weight", &[p])?,
                dim: p,
            })
        } else {
            None
        };
        let mut cache_slot = Vec::with_capacity(specs.len());
        let mut next = 0;
        let mut layers = Vec::with_capacity(held.len());
        for (i, spec) in specs.iter().enumerate() {
            let holds = held.contains(&i);
            cache_slot.push((holds && spec.shared_from.is_none()).then(|| {
                next += 1;
                next - 1
            }));
            if holds {
                let layer = DecoderLayer::new(&root.pp("layers").pp(i), &cfg, spec.clone())?;
                layers.push(match &shard {
                    Some(shard) => {
                        let layer = layer.split(w, shard, &cfg)?;
                        w.forget_under(&format!("{}.", root.pp("layers").pp(i).path()));
                        layer
                    }
                    None => layer,
                });
            }
        }
        let stage = match stage {
            Some(st) => {
                let boundary = (held.end < specs.len())
                    .then(|| {
                        root.pp("layers")
                            .pp(held.end)
                            .pp("input_layernorm")
                            .get("weight", &[h])
                    })
                    .transpose()?;
                Some((st, boundary))
            }
            None => None,
        };
        let sliding_dim = cfg.head_dim;
        let full_dim = cfg.global_head_dim.unwrap_or(cfg.head_dim);
        let full_dim = specs
            .iter()
            .find(|s| s.kind == LayerKind::Full)
            .map_or(full_dim, |s| s.head_dim);
        let tied = cfg.tie_word_embeddings;
        // Split by tensors, each rank holds its rows of the vocabulary for lookups (the ranks
        // sum them, Shard::embed) and, where every rank computes logits, its rows of the head
        // (a tied head: those same rows); rank 0 leading holds the whole head.
        let (embeds, heads) = match (&stage, &shard) {
            (Some((st, _)), _) => (
                st.is_first() || ple.is_some() || (tied && st.holds_head()),
                st.holds_head(),
            ),
            (None, Some(sh)) => (sh.leads(), sh.holds_head()),
            (None, None) => (true, true),
        };
        let table = || root.pp("embed_tokens").embedding(cfg.vocab_size, h);
        let embed = embeds.then(table).transpose()?;
        let embed = match embed {
            Some(e) if tied && heads => Some(e.for_tied_head(w)?),
            e => e,
        };
        let embed_rows = shard
            .as_ref()
            .map(|sh| parts::vocab_rows(w, sh, cfg.vocab_size, embed.as_ref(), table))
            .transpose()?;
        let lm_head = (heads && !tied)
            .then(|| w.root().pp("lm_head").linear(cfg.vocab_size, h))
            .transpose()?;
        let lm_head = parts::head_part(w, shard.as_ref(), cfg.vocab_size, lm_head)?;
        Ok(Gemma4 {
            embed,
            embed_rows,
            ple,
            specs,
            layers,
            first: held.start,
            stage,
            shard,
            norm: root.pp("norm").get("weight", &[h])?,
            lm_head,
            rope_sliding: cfg.rope(LayerKind::Sliding, sliding_dim)?,
            rope_full: cfg.rope(LayerKind::Full, full_dim)?,
            cache_slot,
            slack: 0,
            cache_format: mlx::RowFormat::AsComputed,
            cfg,
        })
    }

    pub fn config(&self) -> &Gemma4Config {
        &self.cfg
    }

    fn embedding(&self) -> Result<&Embedding> {
        self.embed
            .as_ref()
            .ok_or_else(|| ModelError::Invalid("this rank's stage holds no token embedding".into()))
    }

    /// `E[ids] · √H`, the scale cast to the compute dtype first (as transformers does).
    pub fn embed_scaled(&self, tokens: &Array) -> Result<Array> {
        let scale = self.embed_scale();
        match (&self.shard, &self.embed_rows) {
            (Some(sh), Some(rows)) => sh.embed(tokens, self.cfg.vocab_size, |ids| {
                rows.lookup_scaled(ids, scale)
            }),
            _ => self.embedding()?.lookup_scaled(tokens, scale),
        }
    }

    /// √H rounded to float32, as a float32 array times a weak scalar multiplies by it.
    fn embed_scale(&self) -> f32 {
        f64::from(self.cfg.hidden_size).sqrt() as f32
    }

    /// The token embedding and the scale [`Gemma4::embed_scaled`] applies (the assistant embeds
    /// its input tokens with the target's table).
    pub fn scaled_embedding(&self) -> Result<(Embedding, f32)> {
        Ok((self.embedding()?.clone(), self.embed_scale()))
    }

    /// Whether an image's soft tokens attend to each other both ways in the sliding layers.
    pub fn bidirectional_vision(&self) -> bool {
        self.cfg.use_bidirectional_attention.as_deref() == Some("vision")
    }

    /// The packed tokens' input embeddings with each media item's soft tokens in place of its
    /// placeholder tokens, and the token ids the per-layer embeddings read: the pad token where
    /// media sits (transformers' `Gemma4Model` does both).
    fn embed_rows(&self, tokens: &Array, rows: &[PackedRow<'_>]) -> Result<(Array, Array)> {
        let h = self.embed_scaled(tokens)?;
        if rows.iter().all(|r| r.media.is_empty()) {
            return Ok((h, tokens.clone()));
        }
        let total = tokens.dim(1)? as usize;
        let mut ids = tokens.astype(mlx::Dtype::I32)?.to_vec::<i32>()?;
        let pad = self.cfg.pad_token_id.unwrap_or(0);
        let mut parts = Vec::new();
        let (mut row_start, mut cursor) = (0, 0);
        for r in rows {
            for m in r.media {
                let s = row_start + m.at;
                if s > cursor {
                    parts.push(h.slice_axis(1, cursor as i32, Some(s as i32))?);
                }
                parts.push(m.embeds.astype(h.dtype())?.expand_dims(0)?);
                ids[s..s + m.len()].fill(pad);
                cursor = s + m.len();
            }
            row_start += r.len;
        }
        if cursor < total {
            parts.push(h.slice_axis(1, cursor as i32, Some(total as i32))?);
        }
        let refs: Vec<&Array> = parts.iter().collect();
        Ok((
            mlx::concatenate(&refs, 1)?,
            Array::from_slice(&ids, &[1, total as i32])?,
        ))
    }

    /// `[B, L, num_layers, P]` per-layer inputs (docs/MODELS.md §1.3).
    fn per_layer_inputs(&self, ple: &Ple, tokens: &Array, h0: &Array) -> Result<Array> {
        let s = tokens.shape();
        let (l, p) = (self.cfg.num_hidden_layers, ple.dim);
        let shape = [s[0], s[1], l, p];
        let scale = f64::from(p).sqrt() as f32;
        let token_part = match &self.shard {
            Some(sh) => sh.embed(tokens, ple.vocab, |ids| ple.embed.lookup_scaled(ids, scale))?,
            None => ple.embed.lookup_scaled(tokens, scale)?,
        }
        .reshape(&shape)?;
        let ctx = ple
            .model_proj
            .forward(h0)?
            .multiply_scalar(f64::from(self.cfg.hidden_size).powf(-0.5))?
            .reshape(&shape)?;
        let ctx = norm(&ctx, Some(&ple.proj_norm), self.cfg.rms_norm_eps)?;
        Ok(ctx
            .add(&token_part)?
            .multiply_scalar(std::f64::consts::FRAC_1_SQRT_2)?)
    }

    /// This rank's share of the model, split by tensors.
    pub fn tensor_shard(&self) -> Option<&Shard> {
        self.shard.as_ref()
    }

    /// This rank's layers, split by layers.
    pub fn layer_stage(&self) -> Option<&Stage> {
        self.stage.as_ref().map(|(s, _)| s)
    }

    /// Where the K/V of the target's last non-shared sliding and full layers sit in a cache
    /// list from [`CausalLm::make_caches`]: what the gemma4 assistant reads.
    pub fn store_slots(&self) -> StoreSlots {
        let first_shared = self.cfg.first_shared();
        let last = |kind: LayerKind| {
            (0..first_shared)
                .rev()
                .find(|&i| self.specs[i].kind == kind)
                .and_then(|i| self.cache_slot[i])
        };
        StoreSlots {
            sliding: last(LayerKind::Sliding),
            full: last(LayerKind::Full),
        }
    }

    /// The store layers' K/V in `caches` (a cache list from [`CausalLm::make_caches`]).
    pub fn shared_kv(&self, caches: &[LayerCache]) -> Result<SharedKv> {
        self.store_slots().shared_kv(caches)
    }

    fn rope(&self, kind: LayerKind) -> &Rope {
        match kind {
            LayerKind::Sliding => &self.rope_sliding,
            LayerKind::Full => &self.rope_full,
        }
    }
}

impl CausalLm for Gemma4 {
    fn make_caches(&self) -> Vec<LayerCache> {
        self.layers
            .iter()
            .filter(|l| l.spec.shared_from.is_none())
            .map(|l| match l.spec.kind {
                LayerKind::Sliding => LayerCache::Rotating(RotatingKvCache::with_slack(
                    self.cfg.sliding_window as usize,
                    self.slack,
                )),
                LayerKind::Full => LayerCache::Kv(KvCache::new()),
            })
            .map(|c| c.with_format(self.cache_format))
            .collect()
    }

    fn forward(&self, tokens: &Array, caches: &mut [LayerCache]) -> Result<Array> {
        let len = single_row(tokens)?;
        self.forward_packed(tokens, &mut [PackedRow::text(len, caches)])
    }

    fn forward_packed(&self, tokens: &Array, rows: &mut [PackedRow<'_>]) -> Result<Array> {
        let eps = self.cfg.rms_norm_eps;
        let expected = self.cache_slot.iter().flatten().count();
        check_rows(tokens, rows, expected, "gemma4")?;
        if let Some((stage, _)) = &self.stage {
            let pass = |t: &Array, r: &mut [PackedRow<'_>]| self.forward_packed(t, r);
            if let Some(h) = pipeline::micro_batched(stage, tokens, rows, pass)? {
                return Ok(h);
            }
        }
        // A later stage without per-layer inputs needs no embeddings: the residual stream
        // arrives from the previous rank.
        let embeds = match &self.stage {
            Some((stage, _)) => stage.is_first() || self.ple.is_some(),
            None => true,
        };
        let (h0, ple_tokens) = if embeds {
            let (h, ids) = self.embed_rows(tokens, rows)?;
            (Some(h), ids)
        } else {
            (None, tokens.clone())
        };
        let ple = match (&self.ple, &h0) {
            (Some(p), Some(h0)) => Some(self.per_layer_inputs(p, &ple_tokens, h0)?),
            _ => None,
        };
        let embedded = || {
            h0.clone()
                .ok_or_else(|| ModelError::Invalid("no embeddings".into()))
        };
        let mut h = match &self.stage {
            Some((stage, _)) => {
                let shape = [1, tokens.dim(1)?, self.cfg.hidden_size];
                stage.enter(&shape, embedded)?
            }
            None => embedded()?,
        };
        let mut batch = Rows::new(rows, self.specs.len(), self.bidirectional_vision())?;
        let n = batch.len() as i32;
        // One new token per row (a decode step, of one sequence or several): each layer's
        // queries, keys and values come out of one op each, every row at its own position.
        let decode = batch.decode();
        // A layer's input norm, from the previous layer's last op (its residual update).
        let mut normed: Option<Array> = None;
        for (j, layer) in self.layers.iter().enumerate() {
            let i = self.first + j;
            let rope = self.rope(layer.spec.kind);
            let x = match normed.take() {
                Some(x) => x,
                None => norm(&h, Some(&layer.input_norm), eps)?,
            };
            // The projections run once over every row's tokens; attention per row.
            let (q, new_kv): (Vec<Array>, Option<Vec<(Array, Array)>>) = if decode {
                let (q, kv) = layer.attn.qkv_rows(&x, eps, rope, batch.offsets_array())?;
                let kv = match kv {
                    Some((k, v)) => Some(k.split(n, 0)?.into_iter().zip(v.split(n, 0)?).collect()),
                    None => None,
                };
                (q.split(n, 0)?, kv)
            } else {
                let (q, kv) = layer.attn.qkv_heads(&x, eps)?;
                let kv = match kv {
                    Some((k, v)) => Some(
                        batch
                            .rotated(&k, rope)?
                            .into_iter()
                            .zip(batch.sliced(&v)?)
                            .collect(),
                    ),
                    None => None,
                };
                (batch.rotated(&q, rope)?, kv)
            };
            let keys = match (layer.spec.shared_from, self.cache_slot[i], new_kv) {
                (Some(src), _, _) => Keys::Shared { layer: src },
                (None, Some(slot), Some(new)) => Keys::Write {
                    new,
                    caches: rows.iter_mut().map(|r| &mut r.caches[slot]).collect(),
                },
                _ => return Err(ModelError::Invalid(format!("layer {i} has no cache slot"))),
            };
            let recipe = Recipe {
                scale: ATTENTION_SCALE,
                layout: Tokens,
                group: layer.spec.kind as usize,
            };
            let joined = batch.attend(i, &recipe, &q, keys)?;
            // Each residual update also normalises its result for the block that reads it next,
            // in the op of the projection before it.
            let (h_attn, x_ff) = layer.attn.o_proj.forward_add_norm_then_norm(
                &joined,
                &h,
                Some(&layer.post_attn_norm),
                eps,
                None,
                &layer.pre_ffn_norm,
            )?;
            let next = match (self.layers.get(j + 1), &self.stage) {
                (Some(l), _) => &l.input_norm,
                (None, Some((_, Some(boundary)))) => boundary,
                (None, _) => &self.norm,
            };
            // The layer scalar rides on the layer's last residual update.
            let scalar = &layer.layer_scalar;
            let (h_out, x_next) = match (&layer.ple, &ple) {
                (Some(pl), Some(all)) => {
                    let h = layer.feed_forward_add_norm(&h_attn, &x_ff, eps, None)?;
                    let this = all.index(&[Ix::full(), Ix::full(), Ix::At(i as i32)])?;
                    let g = gelu_tanh(&pl.gate.forward(&h)?)?.multiply(&this)?;
                    pl.proj.forward_add_norm_then_norm(
                        &g,
                        &h,
                        Some(&pl.post_norm),
                        eps,
                        Some(scalar),
                        next,
                    )?
                }
                _ => layer.feed_forward_add_norm_then_norm(
                    &h_attn,
                    &x_ff,
                    eps,
                    Some(scalar),
                    next,
                )?,
            };
            h = h_out;
            normed = Some(x_next);
        }
        // The last layer's last op normalised its result with the final norm (on a stage
        // that ends before the last layer, with the next stage's input norm).
        let last = self.first + self.layers.len() == self.specs.len();
        let out = match normed {
            Some(x) if last => Some(x),
            _ if last => Some(norm(&h, Some(&self.norm), eps)?),
            _ => None,
        };
        if let Some((stage, _)) = &self.stage {
            return stage.leave(&h, out);
        }
        let out =
            out.ok_or_else(|| ModelError::Invalid("a model without its last layer".into()))?;
        match &self.shard {
            Some(shard) => shard.finish(out),
            None => Ok(out),
        }
    }

    fn logits(&self, hidden: &Array) -> Result<Array> {
        let head = || {
            let logits = match (&self.lm_head, &self.shard, &self.embed_rows) {
                (Some(head), _, _) => head.forward(hidden)?,
                (None, Some(sh), Some(rows)) if sh.splits_head() => rows.as_linear(hidden)?,
                _ => self.embedding()?.as_linear(hidden)?,
            };
            Ok(match self.cfg.final_logit_softcapping {
                Some(c) if c > 0.0 => mlx::fast::softcap(&logits, c)?,
                _ => logits,
            })
        };
        match (&self.stage, &self.shard) {
            (Some((stage, _)), _) => stage.logits(hidden, self.vocab_size(), head),
            (None, Some(shard)) => shard.logits(self.cfg.vocab_size, head),
            (None, None) => head(),
        }
    }

    fn vocab_size(&self) -> usize {
        self.cfg.vocab_size as usize
    }

    fn max_context(&self) -> usize {
        self.cfg.max_position_embeddings
    }

    fn architecture(&self) -> &'static str {
        "gemma4"
    }

    fn set_cache_slack(&mut self, slack: usize) {
        self.slack = slack;
    }

    fn set_cache_format(&mut self, format: mlx::RowFormat) {
        self.cache_format = format;
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
