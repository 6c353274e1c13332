//! The gemma4 MTP drafter, `gemma4_assistant` (docs/MODELS.md §2).
//!
//! A few gemma4 layers with no K/V of their own: each attends to the K/V of the target's last
//! non-shared layer of its kind. Input is `[target embedding · √H_t, target hidden]` through
//! `pre_projection`; the output hidden goes back through `post_projection` and replaces the
//! target hidden in the next step (an EAGLE-like recurrence). The head is the assistant's own
//! tied embedding, or the centroid-masked sparse head of the E2B/E4B assistants.

use crate::config::JsonFile;
use crate::draft::{lockstep, DraftFollower, DraftPeers, DraftRow, Drafter, Draws, Feed};
use crate::gemma4::{
    DecoderLayer, Gemma4, Gemma4Config, LayerKind, LayerSpec, SharedKv, StoreSlots,
};
use crate::nn::{add_norm, norm, Embedding, Linear, Rope};
use crate::parallel::Stage;
use crate::weights::Weights;
use crate::{ModelError, Result};
use cache::{AttnMask, LayerCache};
use mlx::fast::KvSlots;
use mlx::{Array, Dtype};
use serde_json::Value;
use std::rc::Rc;

/// Where the assistant's query sits (docs/MODELS.md §2.4): transformers uses the position of the
/// bonus token, `S`; mlx-vlm and ollama the last committed position, `S − 1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueryPosition {
    Bonus,
    LastCommitted,
}

impl std::str::FromStr for QueryPosition {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "s" | "S" | "bonus" => Ok(QueryPosition::Bonus),
            "s-1" | "S-1" | "last" => Ok(QueryPosition::LastCommitted),
            other => Err(format!(
                "unknown draft position {other:?} (expected s or s-1)"
            )),
        }
    }
}

struct CentroidHead {
    centroids: Linear,
    /// `[C, V/C]`: the token ids each centroid owns.
    ordering: Array,
    top_k: i32,
}

pub struct Gemma4Assistant {
    pre_projection: Linear,
    post_projection: Linear,
    layers: AssistantLayers,
    norm: Array,
    embed: Embedding,
    centroid: Option<CentroidHead>,
    backbone: i32,
    vocab_size: i32,
    /// The target's token embedding and its scale: the assistant embeds its input tokens as
    /// the target does.
    target_embed: Embedding,
    target_scale: f32,
    /// Split with the target: the other ranks, told of each pass of the layers.
    peers: Option<Rc<dyn DraftPeers>>,
}

/// The assistant's decoder layers over the target's store-layer K/V. One process holds them
/// all. Split by tensors with the target ([`crate::parallel::Shard`]), a rank holds its query
/// heads of each, which read its K/V heads of the store layers, and its MLP hidden units,
/// summed over the ranks in each layer. Split by layers ([`Stage`]), a rank holds the layers
/// that read a store layer of its stage, whole, and hands their output to every rank. Every
/// rank runs them on the same input; only rank 0 has the rest of the assistant.
pub struct AssistantLayers {
    cfg: Gemma4Config,
    /// `None`: a layer another stage runs (split by layers).
    layers: Vec<Option<DecoderLayer>>,
    /// Split by layers: this rank's stage, which the layers' outputs cross the ranks through.
    stage: Option<Stage>,
    rope_sliding: Rope,
    rope_full: Rope,
    pub position: QueryPosition,
    /// Where the target's store layers' K/V sit among its caches.
    store: StoreSlots,
}

/// One draft step's outputs.
pub struct AssistantStep {
    /// `[1, V]` float32; entries outside the centroid head's candidates are -inf.
    pub logits: Array,
    /// `[1, 1, H_target]`: the hidden state fed to the next step.
    pub hidden: Array,
    /// The final-normed assistant hidden (for tests).
    pub normed: Array,
}

impl Gemma4Assistant {
    /// Loads an assistant for `target` from its checkpoint, refusing one whose sizes do not fit.
    /// A split target splits the layers alike; `peers` then tells the other ranks of
    /// each pass (rank 0 leading them).
    pub fn load(
        file: &JsonFile,
        w: &Weights,
        target: &Gemma4,
        peers: Option<Rc<dyn DraftPeers>>,
    ) -> Result<Gemma4Assistant> {
        let refuse = |m: String| {
            Err(ModelError::Config {
                path: file.path.clone(),
                message: m,
            })
        };
        // Every rank of `generate` runs the whole loop: its ranks other than 0 hold no token
        // table to embed the assistant's input with.
        let split = target.tensor_shard().is_some() || target.layer_stage().is_some();
        if split && peers.is_none() {
            return refuse(
                "the gemma4 assistant drafts on a split model where rank 0 leads the other \
                 ranks (`runner --hostfile`), not in `generate`: not supported"
                    .into(),
            );
        }
        let layers = AssistantLayers::load(file, w, target)?;
        let backbone = backbone(file)?;
        let cfg = &layers.cfg;
        let int = |k: &str| file.value.get(k).and_then(Value::as_i64);
        let h = cfg.hidden_size;
        let root = w.root();
        let ordered = file
            .value
            .get("use_ordered_embeddings")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let centroid = if ordered {
            let c = int("num_centroids").unwrap_or(2048) as i32;
            let top_k = int("centroid_intermediate_top_k").unwrap_or(32) as i32;
            if cfg.vocab_size % c != 0 || top_k > c {
                return refuse(format!(
                    "{c} centroids with top-k {top_k} do not fit a vocabulary of {}",
                    cfg.vocab_size
                ));
            }
            let me = root.pp("masked_embedding");
            let ordering = w.keep(
                me.raw_tensor("token_ordering", &[cfg.vocab_size])?
                    .astype(Dtype::I32)?
                    .reshape(&[c, cfg.vocab_size / c])?,
            );
            Some(CentroidHead {
                centroids: me.pp("centroids").linear(c, h)?,
                ordering,
                top_k,
            })
        } else {
            None
        };
        let (target_embed, target_scale) = target.scaled_embedding()?;
        Ok(Gemma4Assistant {
            target_embed,
            target_scale,
            pre_projection: root.pp("pre_projection").linear(h, 2 * backbone)?,
            post_projection: root.pp("post_projection").linear(backbone, h)?,
            norm: root.pp("model.norm").get("weight", &[h])?,
            embed: root
                .pp("model.embed_tokens")
                .embedding(cfg.vocab_size, h)?
                .for_tied_head(w)?,
            centroid,
            backbone,
            vocab_size: cfg.vocab_size,
            layers,
            peers,
        })
    }

    /// Where the assistant's query sits.
    pub fn set_position(&mut self, position: QueryPosition) {
        self.layers.position = position;
    }

    /// One draft step: `token` (`[1, 1]` int32) is the last token, `hidden` (`[1, 1, H_t]`) the
    /// target's (or the previous step's) hidden state; `kv` the target's store-layer K/V.
    pub fn step(&self, token: &Array, hidden: &Array, kv: &SharedKv) -> Result<AssistantStep> {
        self.step_rows(token, hidden, &[kv])
    }

    /// One draft step for several sequences at once: row `i` of `tokens` (`[1, R]` int32) and of
    /// `hidden` (`[1, R, H_t]`) drafts over `kvs[i]`, its own target's K/V. Projections,
    /// feed-forwards and the head run once for all rows; each row's queries and attention are
    /// its own (its position, its keys). Logits `[R, V]`, hidden `[1, R, H_t]`.
    pub fn step_rows(
        &self,
        tokens: &Array,
        hidden: &Array,
        kvs: &[&SharedKv],
    ) -> Result<AssistantStep> {
        if self.peers.is_some() {
            // The other ranks' share of a row needs its sequence and position, which only
            // the drafter's own steps name.
            return Err(ModelError::Invalid(
                "an assistant split over ranks drafts through its drafter, which names each row"
                    .into(),
            ));
        }
        self.step_split(tokens, hidden, kvs, &[])
    }

    /// [`Gemma4Assistant::step_rows`], split: `seqs` names each row's sequence and
    /// its position for the other ranks, which run their share of the layers with this rank's.
    fn step_split(
        &self,
        tokens: &Array,
        hidden: &Array,
        kvs: &[&SharedKv],
        seqs: &[(u64, usize)],
    ) -> Result<AssistantStep> {
        let rows = kvs.len() as i32;
        let e = self
            .target_embed
            .lookup_scaled(&tokens.reshape(&[1, rows])?, self.target_scale)?;
        let x = mlx::concatenate(&[&e, &hidden.reshape(&[1, rows, self.backbone])?], -1)?;
        let z = self.pre_projection.forward(&x)?;
        let z = match &self.peers {
            None => self.layers.run(&z, kvs)?,
            Some(peers) => peers.pass(seqs, &z, &mut || self.layers.run(&z, kvs))?,
        };
        let n = norm(&z, Some(&self.norm), self.layers.cfg.rms_norm_eps)?;
        let logits = match &self.centroid {
            None => self.embed.as_linear(&n)?.reshape(&[rows, -1])?,
            Some(c) => self.centroid_logits(c, &n)?,
        };
        Ok(AssistantStep {
            logits: logits.astype(Dtype::F32)?,
            hidden: self.post_projection.forward(&n)?,
            normed: n,
        })
    }

    /// The sparse head, row by row of `n` (`[1, R, H]`): only the tokens of each row's top-k
    /// centroids get logits; `[R, V]`.
    fn centroid_logits(&self, c: &CentroidHead, n: &Array) -> Result<Array> {
        let v = self.vocab_size;
        let h = *n.shape().last().unwrap_or(&0);
        let n = n.reshape(&[-1, h])?; // [R, H]
        let rows = n.shape()[0];
        let scores = c.centroids.forward(&n)?; // [R, C]
        let k = c.top_k;
        let top = scores
            .negative()?
            .argpartition(k - 1, -1)?
            .slice_axis(-1, 0, Some(k))?; // [R, k]
        let cand = c
            .ordering
            .take(&top.reshape(&[-1])?, 0)?
            .reshape(&[rows, -1])?; // [R, k·V/C]
        let sel = self.embed.lookup(&cand)?; // [R, k·V/C, H]
        let vals = n
            .reshape(&[rows, 1, h])?
            .matmul(&sel.transpose(&[0, 2, 1])?)?
            .reshape(&[rows, -1])?; // [R, k·V/C]
        let floor = Array::full(&[rows, v], f64::NEG_INFINITY, Dtype::F32)?;
        Ok(floor.put_along_axis(&cand, &vals.astype(Dtype::F32)?, -1)?)
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size as usize
    }

    /// The target caches' store-layer K/V.
    fn shared_kv(&self, target: &[LayerCache]) -> Result<SharedKv> {
        self.layers.store.shared_kv(target)
    }
}

/// The `backbone_hidden_size` an assistant's checkpoint names: the target's hidden size.
fn backbone(file: &JsonFile) -> Result<i32> {
    Ok(file
        .value
        .get("backbone_hidden_size")
        .and_then(Value::as_i64)
        .ok_or_else(|| file.error("missing field `backbone_hidden_size`"))? as i32)
}

impl AssistantLayers {
    /// The layers for `target` from the assistant's checkpoint, split as the target is split:
    /// by tensors, this rank's share of each; by layers, those that read a store layer this
    /// rank holds.
    pub fn load(file: &JsonFile, w: &Weights, target: &Gemma4) -> Result<AssistantLayers> {
        let cfg = Gemma4Config::parse_text(file)?;
        let t = target.config();
        let refuse = |m: String| {
            Err(ModelError::Config {
                path: file.path.clone(),
                message: m,
            })
        };
        let stage = target.layer_stage().cloned();
        let held = target.store_slots();
        let backbone = backbone(file)?;
        if backbone != t.hidden_size {
            return refuse(format!(
                "the draft expects a target hidden size of {backbone}, the target has {}",
                t.hidden_size
            ));
        }
        if cfg.vocab_size != t.vocab_size {
            return refuse(format!(
                "the draft's vocabulary has {} tokens, the target's {}",
                cfg.vocab_size, t.vocab_size
            ));
        }
        let target_specs = t.layer_specs().map_err(ModelError::Invalid)?;
        let store = |kind: LayerKind| {
            target_specs[..t.first_shared()]
                .iter()
                .rfind(|s| s.kind == kind)
                .cloned()
        };
        let kinds = cfg.layer_kinds();
        let mut layers = Vec::with_capacity(kinds.len());
        for (i, &kind) in kinds.iter().enumerate() {
            let Some(ts) = store(kind) else {
                return refuse(format!(
                    "draft layer {i} is {kind:?} but the target has no such layer to read"
                ));
            };
            let head_dim = match kind {
                LayerKind::Sliding => cfg.head_dim,
                LayerKind::Full => cfg.global_head_dim.unwrap_or(cfg.head_dim),
            };
            let kv_heads = match kind {
                LayerKind::Full if cfg.attention_k_eq_v => cfg
                    .num_global_key_value_heads
                    .unwrap_or(cfg.num_key_value_heads),
                _ => cfg.num_key_value_heads,
            };
            if head_dim != ts.head_dim
                || kv_heads != ts.kv_heads
                || cfg.num_attention_heads % ts.kv_heads != 0
            {
                return refuse(format!(
                    "draft layer {i} ({kind:?}) expects head_dim {head_dim} and {kv_heads} KV heads; the target's layer has head_dim {} and {} KV heads",
                    ts.head_dim, ts.kv_heads
                ));
            }
            let spec = LayerSpec {
                kind,
                head_dim,
                kv_heads: ts.kv_heads,
                shared_from: Some(usize::MAX),
                k_eq_v: false,
                intermediate: cfg.intermediate_size,
            };
            let vb = w.root().pp("model.layers").pp(i);
            let here = match kind {
                LayerKind::Sliding => held.sliding.is_some(),
                LayerKind::Full => held.full.is_some(),
            };
            if stage.is_some() && !here {
                layers.push(None);
                continue;
            }
            let layer = DecoderLayer::new(&vb, &cfg, spec)?;
            // Split by tensors, this rank's query heads read the K/V heads the target's
            // layers hold here (which heads a rank holds depends on the K/V heads alone).
            layers.push(match target.tensor_shard() {
                Some(shard) => {
                    let layer = layer.split(w, shard, &cfg).map_err(|e| match e {
                        ModelError::Invalid(m) => ModelError::Config {
                            path: file.path.clone(),
                            message: format!("draft layer {i}: {m}"),
                        },
                        e => e,
                    })?;
                    w.forget_under(&format!("{}.", vb.path()));
                    Some(layer)
                }
                None => Some(layer),
            });
        }
        let full_dim = cfg.global_head_dim.unwrap_or(cfg.head_dim);
        Ok(AssistantLayers {
            rope_sliding: cfg.rope(LayerKind::Sliding, cfg.head_dim)?,
            rope_full: cfg.rope(LayerKind::Full, full_dim)?,
            layers,
            stage,
            position: QueryPosition::LastCommitted,
            store: held,
            cfg,
        })
    }

    /// `z` (`[1, R, H]`, the pre-projection's output) through the layers, row `i` attending
    /// to `kvs[i]`. Split, every rank runs this on the same `z`: by tensors each layer sums
    /// its ranks' shares; by layers the rank holding a run of layers of one kind (which read
    /// one store layer) runs them and hands the result to every rank.
    fn run(&self, z: &Array, kvs: &[&SharedKv]) -> Result<Array> {
        let kinds = self.cfg.layer_kinds();
        // What crosses the ranks: the same dtype on the rank that ran a layer and the others.
        let dtype = z.dtype();
        let mut z = z.clone();
        let mut here = false;
        for (i, layer) in self.layers.iter().enumerate() {
            if let Some(layer) = layer {
                z = self.layer(layer, &z, kvs)?;
                here = true;
            }
            let Some(stage) = &self.stage else { continue };
            if kinds.get(i + 1) != kinds.get(i) {
                let mine = if here {
                    z.astype(dtype)?
                } else {
                    Array::zeros(&z.shape(), dtype)?
                };
                z = stage.from_owner(&mine)?;
                here = false;
            }
        }
        Ok(z)
    }

    fn layer(&self, layer: &DecoderLayer, z: &Array, kvs: &[&SharedKv]) -> Result<Array> {
        let eps = self.cfg.rms_norm_eps;
        let rows = kvs.len() as i32;
        let rope = match layer.spec.kind {
            LayerKind::Sliding => &self.rope_sliding,
            LayerKind::Full => &self.rope_full,
        };
        let xn = norm(z, Some(&layer.input_norm), eps)?;
        let mut outs = Vec::with_capacity(kvs.len());
        for (r, kv) in kvs.iter().enumerate() {
            let (slots, mask) = self.row_kv(layer.spec.kind, kv)?;
            let x_r = if rows == 1 {
                xn.clone()
            } else {
                xn.slice_axis(1, r as i32, Some(r as i32 + 1))?
            };
            let q = layer
                .attn
                .queries(&x_r, rope, self.query_position(kv), eps)?;
            outs.push(layer.attn.attend(&q, slots, &mask)?);
        }
        // One output projection for every row: split by tensors, one sum.
        let a = layer.attn.project_out(&if rows == 1 {
            outs.pop().expect("one row")
        } else {
            mlx::concatenate(&outs.iter().collect::<Vec<_>>(), 1)?
        })?;
        let z = add_norm(z, &a, Some(&layer.post_attn_norm), eps, None)?;
        layer.feed_forward_residual(&z, eps, Some(&layer.layer_scalar))
    }

    /// Where a row's query sits, given its target's K/V.
    fn query_position(&self, kv: &SharedKv) -> usize {
        match self.position {
            QueryPosition::Bonus => kv.offset,
            QueryPosition::LastCommitted => kv.offset.saturating_sub(1),
        }
    }

    /// A row's keys, values and mask for a layer of `kind`: transformers' assistant mask, every
    /// full-attention key and the last W + 1 sliding keys (its bidirectional window counts
    /// |q − k| ≤ W).
    fn row_kv<'a>(&self, kind: LayerKind, kv: &'a SharedKv) -> Result<(&'a KvSlots, AttnMask)> {
        match kind {
            LayerKind::Full => {
                let slots = kv.full.as_ref().ok_or_else(|| {
                    ModelError::Invalid("the target has no full-attention K/V yet".into())
                })?;
                Ok((slots, AttnMask::None))
            }
            LayerKind::Sliding => {
                let (slots, p) = kv.sliding.as_ref().ok_or_else(|| {
                    ModelError::Invalid("the target has no sliding-window K/V yet".into())
                })?;
                let lo = kv.offset as i32 - 1 - self.cfg.sliding_window;
                let visible: Vec<bool> = p.iter().map(|&q| q >= 0 && q >= lo).collect();
                let mask = if visible.iter().all(|&b| b) {
                    AttnMask::None
                } else {
                    AttnMask::Array(Array::from_slice(&visible, &[1, visible.len() as i32])?)
                };
                Ok((slots, mask))
            }
        }
    }
}

/// A following rank's share of the assistant's layers: each of rank 0's passes over this
/// rank's target caches of the same sequences.
impl DraftFollower for AssistantLayers {
    fn pass(&self, input: &Array, targets: &[&[LayerCache]]) -> Result<()> {
        let kvs = targets
            .iter()
            .map(|t| self.store.shared_kv(t))
            .collect::<Result<Vec<_>>>()?;
        let refs: Vec<&SharedKv> = kvs.iter().collect();
        self.run(input, &refs)?.eval()?;
        Ok(())
    }
}

/// Drafts with no caches of its own: each pass is one assistant step for every row still
/// drafting, each row attending to its own target's K/V; the first takes the pending token with
/// the target's hidden state that produced it, later ones a draft with the step's hidden
/// output.
impl Drafter for Gemma4Assistant {
    fn name(&self) -> &'static str {
        "gemma4 assistant"
    }

    fn make_caches(&self, _target: &[LayerCache]) -> Vec<LayerCache> {
        Vec::new()
    }

    fn probe_caches(&self, _target: &[LayerCache]) -> Result<Vec<LayerCache>> {
        Ok(Vec::new())
    }

    fn needs_hidden(&self) -> bool {
        true
    }

    fn propose(&self, rows: &mut [DraftRow<'_>], draws: &mut dyn Draws) -> Result<()> {
        let kvs = rows
            .iter()
            .map(|r| self.shared_kv(r.target))
            .collect::<Result<Vec<_>>>()?;
        let seqs: Vec<(u64, usize)> = rows
            .iter()
            .zip(&kvs)
            .map(|(r, kv)| (r.seq, kv.offset))
            .collect();
        let mut first = Vec::with_capacity(rows.len());
        for r in rows.iter() {
            let hidden = r.hidden.ok_or_else(|| {
                ModelError::Invalid("the assistant drafts from the target's hidden state".into())
            })?;
            first.push(Feed {
                tokens: r.pending.reshape(&[1, 1])?.astype(Dtype::I32)?,
                hidden: Some(hidden.reshape(&[1, 1, -1])?),
            });
        }
        let mut pass = |_: &mut [DraftRow<'_>],
                        active: &[usize],
                        toks: &Array,
                        hid: Option<&Array>,
                        _: &[usize]| {
            let hid = hid.ok_or_else(|| {
                ModelError::Invalid("the assistant takes a hidden state with each token".into())
            })?;
            let kv: Vec<&SharedKv> = active.iter().map(|&i| &kvs[i]).collect();
            let seqs: Vec<(u64, usize)> = active.iter().map(|&i| seqs[i]).collect();
            let out = self.step_split(toks, hid, &kv, &seqs)?;
            Ok((out.logits, Some(out.hidden)))
        };
        lockstep(rows, first, draws, &mut pass)
    }
}
