//! GLM4-MoE-Lite (GLM-4.7-Flash, docs/MODELS.md §3): multi-head latent attention with a compressed
//! per-token cache, sigmoid-routed experts with a selection-only correction bias, shared
//! experts, dense first layers, untied head.
//!
//! Reads top to bottom in the order data flows: config, attention, MLP and MoE, decoder layer,
//! the model. The model holds weights only; caches are passed in (one latent cache per layer).

use crate::attention::{join, Rows};
use crate::config::JsonFile;
use crate::draft::Drafter;
use crate::glm4_mtp::{GlmMtp, MtpDrafter};
use crate::nn::{forward_all, norm, Activation, Embedding, Experts, GatedMlp, Linear, Rope};
use crate::packed::{check_rows, single_row};
use crate::parallel::{self, Shard, Split, Stage};
use crate::parts::{self, Part};
use crate::pipeline;
use crate::weights::{Vb, Weights};
use crate::{CausalLm, ModelError, PackedRow, Result};
use cache::{LatentCache, LayerCache};
use mlx::fast::{scaled_dot_product_attention, sdpa_slots, Attention, KvSlots};
use mlx::{Array, Dtype, Ix};
use serde::Deserialize;
use serde_json::Value;
use std::ops::Range;
use std::rc::Rc;

// ------------------------------------------------------------------------------------------
// Config
// ------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Deserialize)]
struct RopeParameters {
    rope_type: Option<String>,
    rope_theta: Option<f32>,
}

/// `config.json` of a `glm4_moe_lite` checkpoint, accepting both spellings (docs/MODELS.md §3.1:
/// `first_k_dense_replace` or `mlp_layer_types`, `rope_theta` or `rope_parameters`).
#[derive(Debug, Clone, Deserialize)]
pub struct GlmConfig {
    pub vocab_size: i32,
    pub hidden_size: i32,
    pub intermediate_size: i32,
    pub moe_intermediate_size: i32,
    pub num_hidden_layers: i32,
    pub num_attention_heads: i32,
    #[serde(default = "one")]
    pub n_shared_experts: i32,
    pub n_routed_experts: i32,
    #[serde(default = "one_f")]
    pub routed_scaling_factor: f32,
    pub kv_lora_rank: i32,
    pub q_lora_rank: Option<i32>,
    pub qk_rope_head_dim: i32,
    pub qk_nope_head_dim: i32,
    pub v_head_dim: i32,
    #[serde(default = "one")]
    pub n_group: i32,
    #[serde(default = "one")]
    pub topk_group: i32,
    pub num_experts_per_tok: i32,
    #[serde(default = "yes")]
    pub norm_topk_prob: bool,
    first_k_dense_replace: Option<i32>,
    #[serde(default = "one")]
    moe_layer_freq: i32,
    mlp_layer_types: Option<Vec<String>>,
    #[serde(default = "ctx")]
    pub max_position_embeddings: usize,
    #[serde(default = "eps5")]
    pub rms_norm_eps: f32,
    rope_theta: Option<f32>,
    rope_parameters: Option<RopeParameters>,
    rope_scaling: Option<Value>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub num_nextn_predict_layers: i32,
}

fn one() -> i32 {
    1
}
fn one_f() -> f32 {
    1.0
}
fn yes() -> bool {
    true
}
fn ctx() -> usize {
    202_752
}
fn eps5() -> f32 {
    1e-5
}

impl GlmConfig {
    pub fn from_file(file: &JsonFile) -> Result<GlmConfig> {
        let cfg: GlmConfig = file.parse(&file.value)?;
        cfg.validate().map_err(|m| file.error(m))?;
        Ok(cfg)
    }

    fn validate(&self) -> std::result::Result<(), String> {
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("kv_lora_rank", self.kv_lora_rank),
            ("qk_rope_head_dim", self.qk_rope_head_dim),
            ("qk_nope_head_dim", self.qk_nope_head_dim),
            ("v_head_dim", self.v_head_dim),
            ("n_routed_experts", self.n_routed_experts),
            ("num_experts_per_tok", self.num_experts_per_tok),
            ("n_group", self.n_group),
            ("topk_group", self.topk_group),
        ] {
            if v <= 0 {
                return Err(format!("{name} must be positive, got {v}"));
            }
        }
        if self.num_experts_per_tok > self.n_routed_experts {
            return Err("num_experts_per_tok exceeds n_routed_experts".into());
        }
        if self.n_routed_experts % self.n_group != 0 || self.topk_group > self.n_group {
            return Err(format!(
                "n_group {} / topk_group {} do not fit {} experts",
                self.n_group, self.topk_group, self.n_routed_experts
            ));
        }
        if self.n_group > 1 && self.n_routed_experts / self.n_group < 2 {
            return Err("grouped routing needs at least 2 experts per group".into());
        }
        if let Some(t) = &self.mlp_layer_types {
            if t.len() != self.num_hidden_layers as usize {
                return Err(format!(
                    "mlp_layer_types has {} entries for {} layers",
                    t.len(),
                    self.num_hidden_layers
                ));
            }
            if let Some(bad) = t.iter().find(|s| *s != "dense" && *s != "sparse") {
                return Err(format!("mlp_layer_types: unknown entry {bad:?}"));
            }
        }
        match &self.rope_scaling {
            None | Some(Value::Null) => {}
            Some(v) => {
                let ty = v
                    .get("type")
                    .or_else(|| v.get("rope_type"))
                    .and_then(Value::as_str);
                if ty != Some("default") {
                    return Err(format!("rope_scaling {v} is not supported"));
                }
            }
        }
        if self.qk_rope_head_dim % 2 != 0 {
            return Err("qk_rope_head_dim must be even".into());
        }
        Ok(())
    }

    pub fn is_moe_layer(&self, i: usize) -> bool {
        match &self.mlp_layer_types {
            // Past the main layers sit the MTP layers, whose blocks are MoE.
            Some(t) => t.get(i).is_none_or(|s| s == "sparse"),
            None => {
                let first = self.first_k_dense_replace.unwrap_or(0) as usize;
                i >= first && i.is_multiple_of(self.moe_layer_freq.max(1) as usize)
            }
        }
    }

    fn rope_theta(&self) -> f32 {
        self.rope_theta
            .or(self.rope_parameters.as_ref().and_then(|p| p.rope_theta))
            .unwrap_or(1_000_000.0)
    }

    fn rope(&self) -> Result<Rope> {
        if let Some(ty) = self
            .rope_parameters
            .as_ref()
            .and_then(|p| p.rope_type.as_deref())
        {
            if ty != "default" {
                return Err(ModelError::Invalid(format!(
                    "rope_type {ty:?} is not supported"
                )));
            }
        }
        // GLM rotates adjacent pairs (2i, 2i+1): mlx's "traditional" layout.
        Ok(Rope::standard(
            self.qk_rope_head_dim,
            self.rope_theta(),
            true,
        ))
    }
}

// ------------------------------------------------------------------------------------------
// Multi-head latent attention
// ------------------------------------------------------------------------------------------

enum QueryProj {
    Lora { a: Linear, norm: Array, b: Linear },
    Direct(Linear),
}

struct Mla {
    q: QueryProj,
    kv_a: Linear,
    kv_a_norm: Array,
    /// `W_UK` per head, `[nH, d_nope, r]`: absorbs the key up-projection into the query.
    wk: Array,
    /// `W_UKᵀ`, `[nH, r, d_nope]`: expands latents to per-head keys.
    wk_t: Array,
    /// `W_UVᵀ`, `[nH, r, d_v]`: latents (or attended latents) to per-head values.
    wv_t: Array,
    o_proj: Linear,
    heads: i32,
    nope: i32,
    rope_dim: i32,
    rank: i32,
    v_dim: i32,
    scale: f32,
}

impl Mla {
    fn new(vb: &Vb, cfg: &GlmConfig) -> Result<Mla> {
        let (h, nh, dn, dr, dv, r) = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
            cfg.kv_lora_rank,
        );
        let q = match cfg.q_lora_rank {
            Some(ql) if ql > 0 => QueryProj::Lora {
                a: vb.pp("q_a_proj").linear(ql, h)?,
                norm: vb.pp("q_a_layernorm").get("weight", &[ql])?,
                b: vb.pp("q_b_proj").linear(nh * (dn + dr), ql)?,
            },
            _ => QueryProj::Direct(vb.pp("q_proj").linear(nh * (dn + dr), h)?),
        };
        let w = vb.weights();
        let (wk, wv) = if vb.pp("kv_b_proj").has("weight") {
            let kvb = vb.pp("kv_b_proj");
            let full = kvb.weight_values(&[], nh * (dn + dv), r)?;
            let full = full.reshape(&[nh, dn + dv, r])?;
            let parts = full.split_at(&[dn], 1)?;
            (parts[0].clone(), parts[1].clone())
        } else {
            // mlx-lm's converted layout: embed_q = W_UKᵀ [nH, r, dn], unembed_out = W_UV.
            let dense =
                |name: &str, rows: i32, cols: i32| vb.pp(name).weight_values(&[nh], rows, cols);
            (
                dense("embed_q", r, dn)?.swapaxes(-1, -2)?,
                dense("unembed_out", dv, r)?,
            )
        };
        Ok(Mla {
            q,
            kv_a: vb.pp("kv_a_proj_with_mqa").linear(r + dr, h)?,
            kv_a_norm: vb.pp("kv_a_layernorm").get("weight", &[r])?,
            wk_t: w.keep(wk.swapaxes(-1, -2)?.contiguous()?),
            wk: w.keep(wk.contiguous()?),
            wv_t: w.keep(wv.swapaxes(-1, -2)?.contiguous()?),
            o_proj: vb.pp("o_proj").linear(h, nh * dv)?,
            heads: nh,
            nope: dn,
            rope_dim: dr,
            rank: r,
            v_dim: dv,
            scale: ((dn + dr) as f32).powf(-0.5),
        })
    }

    /// This rank's heads of the attention (tensor parallel): their query rows, key and value
    /// up-projections and output columns. The compressed projection and the latent cache stay
    /// whole: every head reads the same latents, so a rank holds all of them (splitting the
    /// latent dimension instead would need a sum inside every attention score).
    fn split(self, w: &Weights, shard: &Shard) -> Result<Mla> {
        let heads = shard.heads(self.heads, self.heads)?.q;
        let (dq, dv) = (self.nope + self.rope_dim, self.v_dim);
        let rows = |l: Linear| parts::linear(w, l, &Part::Rows(heads.start * dq..heads.end * dq));
        let q = match self.q {
            QueryProj::Lora { a, norm, b } => QueryProj::Lora {
                a,
                norm,
                b: rows(b)?,
            },
            QueryProj::Direct(p) => QueryProj::Direct(rows(p)?),
        };
        Ok(Mla {
            q,
            wk: parts::along(w, &self.wk, 0, &heads)?,
            wk_t: parts::along(w, &self.wk_t, 0, &heads)?,
            wv_t: parts::along(w, &self.wv_t, 0, &heads)?,
            o_proj: parts::summed(w, self.o_proj, heads.start * dv..heads.end * dv, shard)?,
            heads: heads.end - heads.start,
            ..self
        })
    }

    /// Whether `l` new tokens attending over `t` cached positions (theirs included) cost fewer
    /// multiplications in the absorbed form, which attends over the latents (`2r + dr` a
    /// query and key, the query and the output projected per token), than expanded, which
    /// projects every cached latent to keys and values (`r (dn + dv)` a position) and attends
    /// over those (`dn + dr + dv`). A decode step always is; a prefill chunk from the start
    /// of the sequence never is (`2r > dn + dv`); a verify block, or a short prompt after a
    /// long restored prefix, is: at GLM-4.7-Flash's widths over 3,000 cached positions, chunks
    /// up to ~320 tokens.
    fn absorbed_is_cheaper(&self, l: usize, t: usize) -> bool {
        let widths = [self.rank, self.nope, self.rope_dim, self.v_dim].map(|w| w as usize);
        absorbed_is_cheaper(widths, l, t)
    }

    /// [`Mla::forward`] for a decode step of several sequences (one token each): the
    /// sequences go along the batch axis, so that rotation, the absorbed query projection and
    /// the value up-projection run once for all; only the cache update and the attention
    /// itself are per sequence. `q` is `[1, nH, T, dn+dr]`, `parts` the latent and rope-key
    /// halves of `kv_a`'s output (`[1, T, r]`, `[1, T, dr]`).
    fn decode_rows(
        &self,
        q: &Array,
        parts: &[Array],
        caches: &mut [&mut LatentCache],
        batch: &Rows,
        rope: &Rope,
        eps: f32,
    ) -> Result<Array> {
        let (nh, dn, dr, r) = (self.heads, self.nope, self.rope_dim, self.rank);
        let n = batch.len() as i32;
        let offsets = batch.offsets();
        let q = q.transpose(&[2, 1, 0, 3])?; // [T, nH, 1, dn+dr]
        let qs = q.split_at(&[dn], -1)?;
        let q_rope = rope.apply_rows(&qs[1], offsets)?;
        let q_lat = qs[0].matmul(&self.wk)?; // [T, nH, 1, r]
        let qq = mlx::concatenate(&[&q_lat, &q_rope], -1)?.split(n, 0)?;
        let latent = norm(&parts[0], Some(&self.kv_a_norm), eps)?.reshape(&[n, 1, 1, r])?;
        let k_rope = rope.apply_rows(&parts[1].reshape(&[n, 1, 1, dr])?, offsets)?;
        let new = mlx::concatenate(&[&latent, &k_rope], -1)?.split(n, 0)?;
        let mut outs = Vec::with_capacity(qq.len());
        for ((rows, mask), qq) in batch.write_latent(&new, caches)?.into_iter().zip(&qq) {
            // The values are the latent part of the rows, read in place (quantized or not).
            let kv = KvSlots::of(rows.clone(), rows.first_values(r as usize)?);
            outs.push(sdpa_slots(
                qq,
                &kv,
                Attention::new(self.scale, mask.as_sdpa()),
            )?);
        }
        let refs: Vec<&Array> = outs.iter().collect();
        let o = mlx::concatenate(&refs, 0)?.matmul(&self.wv_t)?; // [T, nH, 1, dv]
        self.o_proj.forward(&o.reshape(&[1, n, nh * self.v_dim])?)
    }

    /// Attention for packed rows: `x` holds every row's tokens, `caches[i]` is row i's cache.
    /// Projections run once over all rows.
    fn forward(
        &self,
        x: &Array,
        caches: &mut [&mut LatentCache],
        batch: &Rows,
        rope: &Rope,
        eps: f32,
    ) -> Result<Array> {
        let s = x.shape();
        let (b, t_all) = (s[0], s[1]);
        let (nh, dn, dr, r) = (self.heads, self.nope, self.rope_dim, self.rank);
        // The query's first projection and the compressed KV projection both read x: one op
        // where their formats allow.
        let first = match &self.q {
            QueryProj::Lora { a, .. } => a,
            QueryProj::Direct(p) => p,
        };
        let mut raw = forward_all(x, &[first, &self.kv_a])?.into_iter();
        let (q_first, ckv) = match (raw.next(), raw.next()) {
            (Some(q), Some(c)) => (q, c),
            _ => return Err(ModelError::Invalid("MLA projections missing".into())),
        };
        let q = match &self.q {
            QueryProj::Lora { norm: n, b, .. } => b.forward(&norm(&q_first, Some(n), eps)?)?,
            QueryProj::Direct(_) => q_first,
        };
        let q = q
            .reshape(&[b, t_all, nh, dn + dr])?
            .transpose(&[0, 2, 1, 3])?;
        let qs = q.split_at(&[dn], -1)?;
        let parts = ckv.split_at(&[r], -1)?;
        if batch.len() > 1 && batch.decode() {
            return self.decode_rows(&q, &parts, caches, batch, rope, eps);
        }
        let latent = norm(&parts[0], Some(&self.kv_a_norm), eps)?.expand_dims(1)?; // [B,1,T,r]
        let k_rope = batch.rotated(&parts[1].expand_dims(1)?, rope)?; // one rope key for all heads
        let new = batch
            .sliced(&latent)?
            .iter()
            .zip(&k_rope)
            .map(|(lat, k)| Ok(mlx::concatenate(&[lat, k], -1)?))
            .collect::<Result<Vec<_>>>()?;
        let q_nope = batch.sliced(&qs[0])?;
        let q_rope = batch.rotated(&qs[1], rope)?;
        let written = batch.write_latent(&new, caches)?;
        let mut outs = Vec::with_capacity(written.len());
        for (i, (rows, mask)) in written.into_iter().enumerate() {
            let (q_nope, q_rope, l) = (&q_nope[i], &q_rope[i], batch.row_len(i));
            let t = rows.time_len() as i32;
            let o = if self.absorbed_is_cheaper(l, t as usize) {
                // Absorbed form (docs/MODELS.md §3.3): score = (q_nope W_UK)·c + q_rope·k_rope,
                // and the values are the latents themselves, up-projected after attention.
                let q_lat = q_nope.matmul(&self.wk)?; // [B,nH,l,r]
                let qq = mlx::concatenate(&[&q_lat, q_rope], -1)?;
                let kv = KvSlots::of(rows.clone(), rows.first_values(r as usize)?);
                let o = sdpa_slots(&qq, &kv, Attention::new(self.scale, mask.as_sdpa()))?;
                o.matmul(&self.wv_t)? // [B,nH,l,dv]
            } else {
                // A prefill chunk expands the latents into per-head keys and values: it reads
                // them as values (quantized rows dequantized).
                let rows = rows.dense()?;
                let c = rows.index(&[Ix::Ellipsis, Ix::slice(None, Some(r), 1)])?;
                let kr = rows.index(&[Ix::Ellipsis, Ix::slice(Some(r), None, 1)])?;
                let k_nope = c.matmul(&self.wk_t)?; // [B,nH,T,dn]
                let v = c.matmul(&self.wv_t)?; // [B,nH,T,dv]
                let k = mlx::concatenate(&[&k_nope, &kr.broadcast_to(&[b, nh, t, dr])?], -1)?;
                let qq = mlx::concatenate(&[q_nope, q_rope], -1)?;
                scaled_dot_product_attention(&qq, &k, &v, self.scale, mask.as_sdpa(), None)?
            };
            outs.push(
                o.transpose(&[0, 2, 1, 3])?
                    .reshape(&[b, l as i32, nh * self.v_dim])?,
            );
        }
        self.o_proj.forward(&join(&outs)?)
    }
}

/// [`Mla::absorbed_is_cheaper`] for latent rank `r`, key widths `dn` (no rope) and `dr` (rope)
/// and value width `dv`.
fn absorbed_is_cheaper([r, dn, dr, dv]: [usize; 4], l: usize, t: usize) -> bool {
    let absorbed = l * t * (2 * r + dr) + l * r * (dn + dv);
    let expanded = t * r * (dn + dv) + l * t * (dn + dr + dv);
    absorbed < expanded
}

// ------------------------------------------------------------------------------------------
// Feed-forward: dense MLP and routed experts
// ------------------------------------------------------------------------------------------

struct Moe {
    /// Router weight, transposed, float32.
    gate_t: Array,
    /// Added to the scores for selection only (docs/MODELS.md §3.3), float32.
    correction: Array,
    gate: Experts,
    up: Experts,
    down: Experts,
    shared: GatedMlp,
    experts: i32,
    top_k: i32,
    groups: i32,
    topk_groups: i32,
    norm_topk: bool,
    scaling: f32,
    /// Split by tensors: the routed experts' and the shared expert's partial products are
    /// summed over the ranks together.
    shard: Option<Shard>,
}

/// Expert matrices under `mlp`: mlx-lm's stacked `switch_mlp.*`, a fused `experts.gate_up_proj`,
/// ollama's stacked `experts.<proj>.weight`, or one tensor per expert as in the GLM-4.7-Flash
/// checkpoints (stacked here once).
fn experts(vb: &Vb, which: &str, e: i32, out: i32, inp: i32) -> Result<Experts> {
    let sw = vb.pp("switch_mlp").pp(which);
    if sw.has("weight") {
        return sw.experts(e, out, inp);
    }
    let ex = vb.pp("experts");
    let fused = ex.has("gate_up_proj") && which != "down_proj";
    if fused {
        let gu = ex.get("gate_up_proj", &[e, 2 * out, inp])?;
        let parts = gu.split(2, 1)?;
        let part = if which == "gate_proj" {
            &parts[0]
        } else {
            &parts[1]
        };
        let experts = Experts::dense(vb.weights(), part.clone());
        vb.weights().withdraw(&gu);
        return experts;
    }
    if ex.has(which) {
        return Experts::dense(vb.weights(), ex.get(which, &[e, out, inp])?);
    }
    // ollama's importer stacks the per-expert tensors into `experts.<proj>.weight`.
    if ex.pp(which).has("weight") {
        return ex.pp(which).experts(e, out, inp);
    }
    let per: Vec<Array> = (0..e)
        .map(|i| ex.pp(i).pp(which).get("weight", &[out, inp]))
        .collect::<Result<_>>()?;
    let refs: Vec<&Array> = per.iter().collect();
    let experts = Experts::dense(vb.weights(), mlx::stack(&refs, 0)?);
    for w in &per {
        vb.weights().withdraw(w);
    }
    experts
}

impl Moe {
    fn new(vb: &Vb, cfg: &GlmConfig) -> Result<Moe> {
        let (h, e, i) = (
            cfg.hidden_size,
            cfg.n_routed_experts,
            cfg.moe_intermediate_size,
        );
        let g = vb.pp("gate");
        let gate_t = g.get_f32("weight", &[e, h])?.t()?;
        Ok(Moe {
            gate_t: vb.weights().keep(gate_t),
            correction: g.get_f32("e_score_correction_bias", &[e])?,
            gate: experts(vb, "gate_proj", e, i, h)?,
            up: experts(vb, "up_proj", e, i, h)?,
            down: experts(vb, "down_proj", e, h, i)?,
            shared: GatedMlp::load(
                &vb.pp("shared_experts"),
                h,
                i * cfg.n_shared_experts,
                Activation::Silu,
            )?,
            experts: e,
            top_k: cfg.num_experts_per_tok,
            groups: cfg.n_group,
            topk_groups: cfg.topk_group,
            norm_topk: cfg.norm_topk_prob,
            scaling: cfg.routed_scaling_factor,
            shard: None,
        })
    }

    /// This rank's hidden units of every expert and of the shared expert; the router stays
    /// whole (every rank routes every token alike).
    fn split(self, w: &Weights, shard: &Shard, hidden: i32) -> Result<Moe> {
        let [gate, up, down] =
            parts::expert_mlp(w, shard, [self.gate, self.up, self.down], hidden)?;
        Ok(Moe {
            gate,
            up,
            down,
            shared: parts::mlp(w, shard, self.shared, false)?,
            shard: Some(shard.clone()),
            ..self
        })
    }

    /// Expert ids `[.., k]` and their weights `[.., k]` (float32), as transformers routes.
    fn route(&self, x: &Array) -> Result<(Array, Array)> {
        let scores = x.astype(Dtype::F32)?.matmul(&self.gate_t)?.sigmoid()?;
        let mut choice = scores.add(&self.correction)?;
        if self.groups > 1 {
            // Keep the topk_group groups with the largest sum of their two best corrected
            // scores; the other groups' experts cannot be chosen (-inf, as transformers does).
            let shape = choice.shape();
            let lead = &shape[..shape.len() - 1];
            let per = self.experts / self.groups;
            let mut gshape = lead.to_vec();
            gshape.extend([self.groups, per]);
            let grouped = choice.reshape(&gshape)?;
            let best2 = grouped.topk(2, -1)?.sum(&[-1], false)?; // [.., G]
            let drop = self.groups - self.topk_groups;
            if drop > 0 {
                let dropped = best2
                    .argpartition(drop - 1, -1)?
                    .slice_axis(-1, 0, Some(drop))?;
                let mut ishape = lead.to_vec();
                ishape.extend([drop, 1]);
                let mut full = lead.to_vec();
                full.extend([drop, per]);
                let idx = dropped.reshape(&ishape)?.broadcast_to(&full)?;
                let ninf = Array::full(&full, f64::NEG_INFINITY, Dtype::F32)?;
                choice = grouped.put_along_axis(&idx, &ninf, -2)?.reshape(&shape)?;
            }
        }
        let k = self.top_k;
        let idx = choice
            .negative()?
            .argpartition(k - 1, -1)?
            .slice_axis(-1, 0, Some(k))?;
        let mut w = scores.take_along_axis(&idx, -1)?;
        if self.norm_topk {
            w = w.divide(&w.sum(&[-1], true)?.add_scalar(1e-20)?)?;
        }
        Ok((idx, w.multiply_scalar(f64::from(self.scaling))?))
    }

    fn forward(&self, x: &Array) -> Result<Array> {
        let (idx, w) = self.route(x)?;
        let xe = x.expand_dims_axes(&[-2, -3])?; // [B, L, 1, 1, H]
        let g = self.gate.forward(&xe, &idx, false)?;
        let u = self.up.forward(&xe, &idx, false)?;
        let y = self
            .down
            .forward(&Activation::Silu.gated(&g, &u)?, &idx, false)?; // [B, L, k, 1, H]
        let w = w.astype(x.dtype())?.expand_dims(-1)?;
        let routed = y.squeeze(-2)?.multiply(&w)?.sum(&[-2], false)?;
        let out = routed.add(&self.shared.forward(x)?)?;
        match &self.shard {
            Some(shard) => shard.sum(&out),
            None => Ok(out),
        }
    }
}

enum FeedForward {
    Dense(GatedMlp),
    Moe(Box<Moe>),
}

pub(crate) struct DecoderLayer {
    attn: Mla,
    ffn: FeedForward,
    input_norm: Array,
    post_attn_norm: Array,
}

impl DecoderLayer {
    pub(crate) fn new(vb: &Vb, cfg: &GlmConfig, i: usize) -> Result<DecoderLayer> {
        let h = cfg.hidden_size;
        let ffn = if cfg.is_moe_layer(i) {
            FeedForward::Moe(Box::new(Moe::new(&vb.pp("mlp"), cfg)?))
        } else {
            FeedForward::Dense(GatedMlp::load(
                &vb.pp("mlp"),
                h,
                cfg.intermediate_size,
                Activation::Silu,
            )?)
        };
        Ok(DecoderLayer {
            attn: Mla::new(&vb.pp("self_attn"), cfg)?,
            ffn,
            input_norm: vb.pp("input_layernorm").get("weight", &[h])?,
            post_attn_norm: vb.pp("post_attention_layernorm").get("weight", &[h])?,
        })
    }

    /// This rank's part of the layer, split by tensors ([`Shard`]).
    fn split(self, w: &Weights, shard: &Shard, cfg: &GlmConfig) -> Result<DecoderLayer> {
        Ok(DecoderLayer {
            attn: self.attn.split(w, shard)?,
            ffn: match self.ffn {
                FeedForward::Dense(m) => FeedForward::Dense(parts::mlp(w, shard, m, true)?),
                FeedForward::Moe(m) => {
                    FeedForward::Moe(Box::new(m.split(w, shard, cfg.moe_intermediate_size)?))
                }
            },
            ..self
        })
    }

    pub(crate) fn forward(
        &self,
        h: &Array,
        caches: &mut [&mut LatentCache],
        batch: &Rows,
        rope: &Rope,
        eps: f32,
    ) -> Result<Array> {
        let x = norm(h, Some(&self.input_norm), eps)?;
        let a = self.attn.forward(&x, caches, batch, rope, eps)?;
        let h = h.add(&a)?;
        let x = norm(&h, Some(&self.post_attn_norm), eps)?;
        let f = match &self.ffn {
            FeedForward::Dense(m) => m.forward(&x)?,
            FeedForward::Moe(m) => m.forward(&x)?,
        };
        Ok(h.add(&f)?)
    }
}

// ------------------------------------------------------------------------------------------
// Model
// ------------------------------------------------------------------------------------------

pub struct Glm4MoeLite {
    cfg: GlmConfig,
    /// Present when the checkpoint carries the MTP layer (`model.layers.{L}.*`).
    mtp: Option<Rc<GlmMtp>>,
    /// The token embedding, where this process embeds tokens or its head is tied to it (a
    /// model split over ranks holds it on the first stage and the head on the last).
    embed: Option<Embedding>,
    /// Split by tensors: this rank's rows of the table (a view of `embed` where it holds that).
    embed_rows: Option<Embedding>,
    /// The layers this process holds: all of them, or its stage's (`first..first + len`).
    layers: Vec<DecoderLayer>,
    first: usize,
    stage: Option<Stage>,
    /// Split by tensors: this rank's share of every layer.
    shard: Option<Shard>,
    norm: Array,
    /// The head, or (split by tensors, every rank computing logits) this rank's rows of it.
    lm_head: Option<Linear>,
    rope: Rope,
    /// How the caches store latent rows (see [`CausalLm::set_cache_format`]).
    cache_format: mlx::RowFormat,
}

impl Glm4MoeLite {
    pub fn new(cfg: GlmConfig, w: &Weights) -> Result<Glm4MoeLite> {
        Self::with_split(cfg, w, None)
    }

    /// Layer ranges for `ranks` stages, balanced by the layers' bytes in `w`.
    pub fn split(
        cfg: &GlmConfig,
        w: &Weights,
        ranks: usize,
        ends: parallel::Ends,
    ) -> Result<Vec<Range<usize>>> {
        let n = cfg.num_hidden_layers as usize;
        let sizes = w.tensor_bytes();
        let tensors = || sizes.iter().map(|(k, b)| (k.as_str(), *b));
        let bytes = parallel::layer_bytes(tensors(), "model.layers", n);
        let end_bytes = parallel::end_bytes(
            ends,
            parallel::bytes_under(tensors(), "model.embed_tokens."),
            parallel::bytes_under(tensors(), "lm_head."),
            cfg.tie_word_embeddings,
            false,
        );
        parallel::split_layers(&bytes, ranks, end_bytes, |_| true)
    }

    /// The model, or this rank's part of it: with a [`Stage`] only that stage's layers (and
    /// their caches), with a [`Shard`] its share of every layer. Of a split model, only rank 0
    /// leading it has the MTP drafter.
    pub fn with_split(cfg: GlmConfig, w: &Weights, split: Option<Split>) -> Result<Glm4MoeLite> {
        let stage = split.as_ref().and_then(Split::stage).cloned();
        let shard = split.as_ref().and_then(Split::shard).cloned();
        let root = w.root();
        let model = root.pp("model");
        let h = cfg.hidden_size;
        let n = cfg.num_hidden_layers as usize;
        let held = stage.as_ref().map_or(0..n, Stage::layers);
        if held.end > n || held.is_empty() {
            return Err(ModelError::Invalid(format!(
                "a stage of layers {held:?} in a model of {n} layers"
            )));
        }
        let layers = held
            .clone()
            .map(|i| {
                let layer = DecoderLayer::new(&model.pp("layers").pp(i), &cfg, i)?;
                let Some(shard) = &shard else {
                    return Ok(layer);
                };
                let layer = layer.split(w, shard, &cfg)?;
                w.forget_under(&format!("model.layers.{i}."));
                Ok(layer)
            })
            .collect::<Result<Vec<_>>>()?;
        let tied = cfg.tie_word_embeddings;
        // Split by tensors, each rank holds its rows of the vocabulary for lookups (the ranks
        // sum them, Shard::embed) and, where every rank computes logits, its rows of the head;
        // rank 0 leading holds the whole head, and the whole table its MTP drafter reads.
        let (embeds, heads) = match (&stage, &shard) {
            (Some(st), _) => (st.is_first() || (tied && st.holds_head()), st.holds_head()),
            (None, Some(sh)) => (sh.leads(), sh.holds_head()),
            (None, None) => (true, true),
        };
        let table = || model.pp("embed_tokens").embedding(cfg.vocab_size, h);
        let embed = embeds.then(table).transpose()?;
        let embed_rows = shard
            .as_ref()
            .map(|sh| parts::vocab_rows(w, sh, cfg.vocab_size, embed.as_ref(), table))
            .transpose()?;
        let lm_head = (heads && !tied)
            .then(|| root.pp("lm_head").linear(cfg.vocab_size, h))
            .transpose()?;
        let lm_head = parts::head_part(w, shard.as_ref(), cfg.vocab_size, lm_head)?;
        let rope = cfg.rope()?;
        // The MTP layer drafts from the final hidden states with the embedding and the head:
        // where rank 0 leads a split model, it holds all three.
        let drafts = match (&stage, &shard) {
            (Some(st), _) => st.is_first() && st.holds_head(),
            (None, Some(sh)) => sh.leads(),
            (None, None) => true,
        };
        let mtp = if drafts
            && cfg.num_nextn_predict_layers > 0
            && w.contains(&format!("model.layers.{n}.eh_proj.weight"))
        {
            let head = match &lm_head {
                Some(l) => l.clone(),
                None => {
                    return Err(ModelError::Invalid(
                        "an MTP layer needs an untied lm_head".into(),
                    ))
                }
            };
            let embed = embed
                .clone()
                .ok_or_else(|| ModelError::Invalid("an MTP layer without the embedding".into()))?;
            Some(Rc::new(GlmMtp::new(
                &model.pp("layers").pp(n),
                &cfg,
                embed,
                head,
                rope.clone(),
                n,
            )?))
        } else {
            None
        };
        Ok(Glm4MoeLite {
            embed,
            embed_rows,
            layers,
            first: held.start,
            stage,
            shard,
            norm: model.pp("norm").get("weight", &[h])?,
            lm_head,
            rope,
            mtp,
            cfg,
            cache_format: mlx::RowFormat::AsComputed,
        })
    }

    fn embedding(&self) -> Result<&Embedding> {
        self.embed
            .as_ref()
            .ok_or_else(|| ModelError::Invalid("this rank's stage holds no token embedding".into()))
    }

    /// The checkpoint's own MTP drafter, if it has one.
    pub fn mtp(&self) -> Option<&GlmMtp> {
        self.mtp.as_deref()
    }

    pub fn rope(&self) -> &Rope {
        &self.rope
    }

    pub fn config(&self) -> &GlmConfig {
        &self.cfg
    }
}

impl CausalLm for Glm4MoeLite {
    fn make_caches(&self) -> Vec<LayerCache> {
        (0..self.layers.len())
            .map(|_| {
                LayerCache::Latent(
                    LatentCache::with_format(self.cache_format)
                        .with_values(self.cfg.kv_lora_rank as usize),
                )
            })
            .collect()
    }

    fn set_cache_format(&mut self, format: mlx::RowFormat) {
        self.cache_format = format;
    }

    fn forward(&self, tokens: &Array, caches: &mut [LayerCache]) -> Result<Array> {
        let len = single_row(tokens)?;
        self.forward_packed(tokens, &mut [PackedRow::text(len, caches)])
    }

    fn forward_packed(&self, tokens: &Array, rows: &mut [PackedRow<'_>]) -> Result<Array> {
        check_rows(tokens, rows, self.layers.len(), "glm4_moe_lite")?;
        if rows.iter().any(|r| !r.media.is_empty()) {
            return Err(ModelError::Invalid(
                "glm4_moe_lite takes no images or audio".into(),
            ));
        }
        if let Some(stage) = &self.stage {
            let pass = |t: &Array, r: &mut [PackedRow<'_>]| self.forward_packed(t, r);
            if let Some(h) = pipeline::micro_batched(stage, tokens, rows, pass)? {
                return Ok(h);
            }
        }
        let eps = self.cfg.rms_norm_eps;
        let batch = Rows::new(rows, self.first + self.layers.len(), false)?;
        let embed = || match (&self.shard, &self.embed_rows) {
            (Some(sh), Some(rows)) => sh.embed(tokens, self.cfg.vocab_size, |ids| rows.lookup(ids)),
            _ => self.embedding()?.lookup(tokens),
        };
        let mut h = match &self.stage {
            None => embed()?,
            Some(stage) => stage.enter(&[1, tokens.dim(1)?, self.cfg.hidden_size], embed)?,
        };
        for (i, layer) in self.layers.iter().enumerate() {
            let mut caches = rows
                .iter_mut()
                .map(|r| match &mut r.caches[i] {
                    LayerCache::Latent(c) => Ok(c),
                    _ => Err(ModelError::Invalid(
                        "glm4_moe_lite needs latent caches".into(),
                    )),
                })
                .collect::<Result<Vec<&mut LatentCache>>>()?;
            h = layer.forward(&h, &mut caches, &batch, &self.rope, eps)?;
        }
        match (&self.stage, &self.shard) {
            (Some(stage), _) => {
                let last = self.first + self.layers.len() == self.cfg.num_hidden_layers as usize;
                let out = last.then(|| norm(&h, Some(&self.norm), eps)).transpose()?;
                stage.leave(&h, out)
            }
            (None, Some(shard)) => shard.finish(norm(&h, Some(&self.norm), eps)?),
            (None, None) => norm(&h, Some(&self.norm), eps),
        }
    }

    fn logits(&self, hidden: &Array) -> Result<Array> {
        let head = || match (&self.lm_head, &self.shard, &self.embed_rows) {
            (Some(head), _, _) => head.forward(hidden),
            (None, Some(sh), Some(rows)) if sh.splits_head() => rows.as_linear(hidden),
            _ => self.embedding()?.as_linear(hidden),
        };
        match (&self.stage, &self.shard) {
            (Some(stage), _) => stage.logits(hidden, self.vocab_size(), head),
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
        "glm4_moe_lite"
    }

    fn builtin_drafter(&self) -> Option<Box<dyn Drafter>> {
        let mtp = self.mtp.as_ref()?;
        Some(Box::new(MtpDrafter::new(Rc::clone(mtp))))
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::absorbed_is_cheaper;

    /// GLM-4.7-Flash's widths: decode steps, verify blocks and short prompts after a long
    /// prefix attend over the latents; a prompt's first chunk expands them.
    #[test]
    fn the_cheaper_attention_form_is_chosen() {
        let flash = [512, 192, 64, 256];
        for t in [2, 10, 3000, 100_000] {
            assert!(absorbed_is_cheaper(flash, 1, t), "a decode step over {t}");
        }
        assert!(absorbed_is_cheaper(flash, 5, 3000), "a verify block");
        assert!(
            absorbed_is_cheaper(flash, 300, 3000),
            "a short prompt after a prefix"
        );
        assert!(!absorbed_is_cheaper(flash, 512, 3000));
        for l in [2, 64, 512, 4096] {
            assert!(!absorbed_is_cheaper(flash, l, l), "a first chunk of {l}");
        }
    }
}
