//! Attention for packed rows: the one path every architecture's layers take.
//!
//! A packed forward ([`crate::CausalLm::forward_packed`]) runs several sequences in one pass:
//! everything that acts per token (projections, norms, MLPs) runs once over all of them, and
//! attention runs per row, at the row's own position, against the row's own caches (growing,
//! rotating, latent or shared with an earlier layer). [`Rows`] is that per-row part, built once
//! per pass: where each row's tokens sit, at which position each row starts, and what earlier
//! layers left for later ones (the K/V a KV-shared layer reads, the masks a batched window
//! write worked out). A model file states its layers' recipes and calls [`Rows::attend`]
//! (standard attention over keys and values) or [`Rows::write_latent`] (MLA's latent rows).

use crate::nn::Rope;
use crate::packed::PackedRow;
use crate::{ModelError, Result};
use cache::{Attended, AttnMask, LatentCache, LayerCache};
use mlx::fast::{sdpa_slots, Attention as Sdpa, KvSlots, SdpaLayout};
use mlx::Array;
use std::collections::HashMap;

/// A layer's standard attention: `softmax(q kᵀ · scale + mask) v`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Recipe {
    pub scale: f32,
    /// How the output comes back: `[B, H, L, d]` heads or `[B, L, H·d]` tokens.
    pub layout: SdpaLayout,
    /// Layers of one group see the same history through the same mask (gemma4's sliding or
    /// full layers): a batched write's mask is worked out once per row and group, and a layer
    /// that shares another's K/V reads that layer's group's mask.
    pub group: usize,
}

/// Where a layer's keys and values come from.
pub(crate) enum Keys<'c> {
    /// Each row's new keys and values (`[1, Hkv, l, d]`, rotated), written into its cache.
    Write {
        new: Vec<(Array, Array)>,
        caches: Vec<&'c mut LayerCache>,
    },
    /// The slots layer `layer` wrote in this pass (KV sharing).
    Shared { layer: usize },
}

/// The rows of one packed forward, as attention sees them.
pub(crate) struct Rows {
    /// `(start, len)` of each row along the packed time axis.
    spans: Vec<(usize, usize)>,
    /// Positions each row's caches hold before the pass.
    offsets: Vec<usize>,
    /// `[R]` int32 `offsets`, for rotating a decode step's rows in one op.
    offsets_array: Array,
    /// Per row, per group: the mask its first layer of that group attended with.
    masks: Vec<HashMap<usize, AttnMask>>,
    /// Per layer, per row: the K/V slots the layer attended over (what a KV-shared layer reads).
    written: Vec<Vec<KvSlots>>,
    /// Per row: the absolute `[start, end)` positions of media whose tokens see each other both
    /// ways in windowed layers.
    blocks: Vec<Vec<(i32, i32)>>,
}

impl Rows {
    /// The rows of a pass over `rows` (each row's position is that of its first cache) through
    /// a model of `layers` layers; with `media_both_ways`, each image's tokens see each other
    /// both ways in windowed layers.
    pub fn new(rows: &[PackedRow<'_>], layers: usize, media_both_ways: bool) -> Result<Rows> {
        let offsets: Vec<usize> = rows
            .iter()
            .map(|r| r.caches.first().map_or(0, LayerCache::offset))
            .collect();
        let mut out = Self::with_offsets(rows.iter().map(|r| r.len), offsets, layers)?;
        for (r, row) in rows.iter().enumerate() {
            let at = out.offsets[r];
            if !media_both_ways {
                break;
            }
            out.blocks[r] = row
                .media
                .iter()
                .filter(|m| m.kind == crate::MediaKind::Image)
                .map(|m| ((at + m.at) as i32, (at + m.at + m.len()) as i32))
                .collect();
        }
        Ok(out)
    }

    /// Rows of these lengths starting at these positions.
    pub fn with_offsets(
        lens: impl IntoIterator<Item = usize>,
        offsets: Vec<usize>,
        layers: usize,
    ) -> Result<Rows> {
        let mut at = 0;
        let spans: Vec<(usize, usize)> = lens
            .into_iter()
            .map(|l| {
                let s = (at, l);
                at += l;
                s
            })
            .collect();
        if spans.len() != offsets.len() {
            return Err(ModelError::Invalid(format!(
                "{} rows with {} positions",
                spans.len(),
                offsets.len()
            )));
        }
        let o: Vec<i32> = offsets.iter().map(|&o| o as i32).collect();
        Ok(Rows {
            offsets_array: Array::from_slice(&o, &[o.len() as i32])?,
            masks: vec![HashMap::new(); spans.len()],
            blocks: vec![Vec::new(); spans.len()],
            written: vec![Vec::new(); layers],
            spans,
            offsets,
        })
    }

    pub fn len(&self) -> usize {
        self.spans.len()
    }

    /// Tokens of row `r`.
    pub fn row_len(&self, r: usize) -> usize {
        self.spans[r].1
    }

    /// Where each row starts: what its caches hold.
    pub fn offsets(&self) -> &[usize] {
        &self.offsets
    }

    /// [`Rows::offsets`] as `[R]` int32.
    pub fn offsets_array(&self) -> &Array {
        &self.offsets_array
    }

    /// One token per row: a decode step, whose rows can go along the batch axis instead.
    pub fn decode(&self) -> bool {
        self.spans.iter().all(|&(_, l)| l == 1)
    }

    /// Row `r`'s positions of `x: [B, H, T, d]` along time (all of `x` when that is all).
    pub fn slice(&self, x: &Array, r: usize) -> Result<Array> {
        let (at, len) = self.spans[r];
        if at == 0 && x.shape()[2] as usize == len {
            return Ok(x.clone());
        }
        Ok(x.slice_axis(2, at as i32, Some((at + len) as i32))?)
    }

    /// Each row's part of `x: [B, H, T, d]`, rotated for its positions.
    pub fn rotated(&self, x: &Array, rope: &Rope) -> Result<Vec<Array>> {
        (0..self.len())
            .map(|r| rope.apply(&self.slice(x, r)?, self.offsets[r]))
            .collect()
    }

    /// Each row's part of `x: [B, H, T, d]`.
    pub fn sliced(&self, x: &Array) -> Result<Vec<Array>> {
        (0..self.len()).map(|r| self.slice(x, r)).collect()
    }

    /// Standard attention of layer `layer` for every row: row `r`'s queries `q[r]`
    /// (`[1, H, l, d]`, rotated) over its keys; returns the rows' outputs joined along time
    /// (`[1, T, H·d]` in the tokens layout). A write of one token into a growing or rotating
    /// cache is one op with the attention that reads it.
    pub fn attend(
        &mut self,
        layer: usize,
        recipe: &Recipe,
        q: &[Array],
        keys: Keys<'_>,
    ) -> Result<Array> {
        let attn = Sdpa::new(recipe.scale, mlx::SdpaMask::None).with_layout(recipe.layout);
        let over = |q: &Array, kv: KvSlots, mask: AttnMask| -> Result<Attended> {
            let out = sdpa_slots(
                q,
                &kv,
                Sdpa {
                    mask: mask.as_sdpa(),
                    ..attn
                },
            )?;
            Ok(Attended { out, kv, mask })
        };
        let g = recipe.group;
        let mut outs = Vec::with_capacity(self.len());
        let mut written = Vec::with_capacity(self.len());
        match keys {
            Keys::Shared { layer: src } => {
                for (r, q) in q.iter().enumerate() {
                    let kv = self
                        .written
                        .get(src)
                        .and_then(|w| w.get(r))
                        .cloned()
                        .ok_or_else(|| {
                            ModelError::Invalid(format!(
                                "layer {layer} shares K/V with layer {src}, which has none"
                            ))
                        })?;
                    let mask = self.masks[r].get(&g).cloned().unwrap_or(AttnMask::None);
                    let a = over(q, kv, mask)?;
                    outs.push(a.out);
                    written.push(a.kv);
                }
            }
            Keys::Write { new, caches } => {
                if new.len() != q.len() || caches.len() != q.len() {
                    return Err(ModelError::Invalid(format!(
                        "layer {layer}: {} rows of queries, {} of keys, {} caches",
                        q.len(),
                        new.len(),
                        caches.len()
                    )));
                }
                for (r, ((q, (k, v)), cache)) in q.iter().zip(&new).zip(caches).enumerate() {
                    let l = self.spans[r].1;
                    let (scale, layout) = (recipe.scale, recipe.layout);
                    let a = match cache {
                        LayerCache::Kv(c) => c.update_attend(q, k, v, scale, layout)?,
                        LayerCache::Rotating(c) if l == 1 => {
                            c.update_attend(q, k, v, scale, layout)?
                        }
                        // A batched write's window mask is worked out once per row and group;
                        // the group's other layers have the same history.
                        LayerCache::Rotating(c) => {
                            let kv = c.update_slots(k, v)?;
                            let mask = match self.masks[r].get(&g) {
                                Some(m) => m.clone(),
                                None => c.mask_blocks(l, &self.blocks[r])?,
                            };
                            over(q, kv, mask)?
                        }
                        LayerCache::Latent(_) => {
                            return Err(ModelError::Invalid(format!(
                                "layer {layer}: keys and values given to an MLA latent cache"
                            )))
                        }
                    };
                    // A KV-shared layer reads its source's slots with the mask of its group.
                    self.masks[r].entry(g).or_insert_with(|| a.mask.clone());
                    outs.push(a.out);
                    written.push(a.kv);
                }
            }
        }
        if let Some(w) = self.written.get_mut(layer) {
            *w = written;
        }
        join(&outs)
    }

    /// MLA's write: each row's new latent rows (`[1, 1, l, r + dr]`) into its latent cache;
    /// returns, per row, the rows the cache holds now (as stored: quantized or not) and the
    /// mask its queries attend with.
    pub fn write_latent(
        &self,
        new: &[Array],
        caches: &mut [&mut LatentCache],
    ) -> Result<Vec<(mlx::Rows, AttnMask)>> {
        if new.len() != self.len() || caches.len() != self.len() {
            return Err(ModelError::Invalid(format!(
                "{} rows of latents and {} caches for {} rows",
                new.len(),
                caches.len(),
                self.len()
            )));
        }
        new.iter()
            .zip(caches.iter_mut())
            .zip(&self.spans)
            .map(|((rows, cache), &(_, l))| Ok((cache.update(rows)?, cache.mask(l))))
            .collect()
    }
}

/// Per-row `[1, l, D]` outputs joined along time into `[1, T, D]`.
pub(crate) fn join(outs: &[Array]) -> Result<Array> {
    match outs {
        [one] => Ok(one.clone()),
        many => {
            let refs: Vec<&Array> = many.iter().collect();
            Ok(mlx::concatenate(&refs, 1)?)
        }
    }
}
