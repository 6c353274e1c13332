//! GLM's multi-token-prediction layer (docs/MODELS.md §3.5) and the drafter it makes: for each
//! position `i` it fuses the embedding of token `i + 1` with the target's final hidden state at
//! `i`, runs one MLA + MoE block over its own latent cache, and predicts the token after next.
//! Embedding and head are the target's own (the checkpoint's copies are identical and never
//! read).

use crate::attention::Rows;
use crate::draft::{lockstep, DraftRow, DraftState, Drafter, Draws, Feed, Observed, RoundEnd};
use crate::glm4_moe_lite::{DecoderLayer, GlmConfig};
use crate::nn::{norm, Embedding, Linear, Rope};
use crate::weights::Vb;
use crate::{ModelError, Result};
use cache::{LatentCache, LayerCache};
use mlx::{Array, Dtype};
use std::rc::Rc;

/// MTP pairs are buffered while no round drafts, and fed in one batch past this many.
const FLUSH: usize = 256;

pub struct GlmMtp {
    embed: Embedding,
    enorm: Array,
    hnorm: Array,
    eh_proj: Linear,
    block: DecoderLayer,
    head_norm: Array,
    head: Linear,
    rope: Rope,
    hidden: i32,
    eps: f32,
}

impl GlmMtp {
    pub(crate) fn new(
        vb: &Vb,
        cfg: &GlmConfig,
        embed: Embedding,
        head: Linear,
        rope: Rope,
        index: usize,
    ) -> Result<GlmMtp> {
        let h = cfg.hidden_size;
        Ok(GlmMtp {
            embed,
            enorm: vb.pp("enorm").get("weight", &[h])?,
            hnorm: vb.pp("hnorm").get("weight", &[h])?,
            eh_proj: vb.pp("eh_proj").linear(h, 2 * h)?,
            block: DecoderLayer::new(vb, cfg, index)?,
            head_norm: vb.pp("shared_head.norm").get("weight", &[h])?,
            head,
            rope,
            hidden: h,
            eps: cfg.rms_norm_eps,
        })
    }

    /// Pairs `tokens[i]` (`[1, L]`, the token after position i) with `hidden[i]` (`[1, L, H]`,
    /// the target's final hidden at i, or the previous MTP output when chaining), at the cache's
    /// next positions. Returns the block outputs (for chaining) and the logits over the token
    /// after next.
    pub fn forward(
        &self,
        tokens: &Array,
        hidden: &Array,
        cache: &mut LatentCache,
    ) -> Result<(Array, Array)> {
        let u = self.feed(tokens, hidden, cache)?;
        let logits = self
            .head
            .forward(&norm(&u, Some(&self.head_norm), self.eps)?)?;
        Ok((u, logits))
    }

    /// Only the block, when the logits are not needed (keeping the cache in step).
    pub fn feed(&self, tokens: &Array, hidden: &Array, cache: &mut LatentCache) -> Result<Array> {
        let l = tokens.shape()[1] as usize;
        self.feed_rows(tokens, hidden, &mut [cache], &[l])
    }

    /// [`GlmMtp::forward`] for several sequences packed along time (`lens[i]` pairs of row i,
    /// each row with its own cache); returns the block outputs `[1, T, H]` and the logits of
    /// each row's last pair `[R, V]`.
    pub fn forward_rows(
        &self,
        tokens: &Array,
        hidden: &Array,
        caches: &mut [&mut LatentCache],
        lens: &[usize],
    ) -> Result<(Array, Array)> {
        let u = self.feed_rows(tokens, hidden, caches, lens)?;
        let ends = crate::draft::last_positions(lens);
        let idx = Array::from_slice(&ends, &[ends.len() as i32])?;
        let last = u.take(&idx, 1)?;
        let logits = self
            .head
            .forward(&norm(&last, Some(&self.head_norm), self.eps)?)?;
        let v = *logits.shape().last().unwrap_or(&0);
        Ok((u, logits.reshape(&[lens.len() as i32, v])?))
    }

    fn feed_rows(
        &self,
        tokens: &Array,
        hidden: &Array,
        caches: &mut [&mut LatentCache],
        lens: &[usize],
    ) -> Result<Array> {
        let e = norm(&self.embed.lookup(tokens)?, Some(&self.enorm), self.eps)?;
        let h = norm(
            &hidden.reshape(&[1, -1, self.hidden])?,
            Some(&self.hnorm),
            self.eps,
        )?;
        let x = self.eh_proj.forward(&mlx::concatenate(&[&e, &h], -1)?)?;
        let offsets = caches.iter().map(|c| c.offset()).collect();
        let batch = Rows::with_offsets(lens.iter().copied(), offsets, 1)?;
        self.block.forward(&x, caches, &batch, &self.rope, self.eps)
    }

    pub fn vocab_size(&self) -> usize {
        self.head.outputs()
    }
}

/// The MTP layer as a drafter: it trails the target by the pairs it buffers while plain steps
/// run, takes them in with a round's first pass, and chains its own block output into the
/// next draft position.
pub struct MtpDrafter {
    mtp: Rc<GlmMtp>,
}

impl MtpDrafter {
    pub(crate) fn new(mtp: Rc<GlmMtp>) -> MtpDrafter {
        MtpDrafter { mtp }
    }

    /// Feeds pairs for every committed position but the last: token `committed[i + 1]` with
    /// the target's hidden state at `i`.
    fn catch_up(&self, state: &mut DraftState, committed: &[u32]) -> Result<()> {
        let s = committed.len();
        if state.covered + 1 >= s || state.backlog.is_empty() {
            return Ok(());
        }
        let (tokens, hidden) = take_pairs(state, committed)?;
        self.mtp
            .feed(&tokens, &hidden, latent(&mut state.caches)?)?;
        Ok(())
    }
}

/// The pairs a state has yet to take in, as tokens `[1, p]` and hidden states `[1, p, H]`,
/// leaving in its backlog only the hidden state of the last committed position.
fn take_pairs(state: &mut DraftState, committed: &[u32]) -> Result<(Array, Array)> {
    let s = committed.len();
    let refs: Vec<&Array> = state.backlog.iter().collect();
    let mut hidden = mlx::concatenate(&refs, 1)?;
    if hidden.shape()[1] as usize > s - state.covered {
        // A round that ended at EOS committed fewer tokens than it verified.
        hidden = hidden.slice_axis(1, 0, Some((s - state.covered) as i32))?;
    }
    let pairs = s - 1 - state.covered;
    let ids: Vec<i32> = committed[state.covered + 1..s]
        .iter()
        .map(|&t| t as i32)
        .collect();
    let tokens = Array::from_slice(&ids, &[1, pairs as i32])?;
    let h = hidden.slice_axis(1, 0, Some(pairs as i32))?;
    state.backlog = vec![hidden.slice_axis(1, pairs as i32, None)?];
    state.covered = s - 1;
    Ok((tokens, h))
}

fn latent(caches: &mut [LayerCache]) -> Result<&mut LatentCache> {
    match caches.first_mut() {
        Some(LayerCache::Latent(c)) => Ok(c),
        _ => Err(ModelError::Invalid(
            "the MTP drafter's state has no latent cache".into(),
        )),
    }
}

impl Drafter for MtpDrafter {
    fn name(&self) -> &'static str {
        "GLM MTP layer"
    }

    /// One more latent layer of the target's, stored alike.
    fn make_caches(&self, target: &[LayerCache]) -> Vec<LayerCache> {
        vec![LayerCache::Latent(match target.first() {
            Some(LayerCache::Latent(c)) => c.fresh_like(),
            _ => LatentCache::new(),
        })]
    }

    fn probe_caches(&self, target: &[LayerCache]) -> Result<Vec<LayerCache>> {
        let mut caches = self.make_caches(target);
        let token = Array::from_slice(&[0i32], &[1, 1])?;
        let hidden = Array::zeros(&[1, 1, self.mtp.hidden], Dtype::F32)?;
        self.mtp.feed(&token, &hidden, latent(&mut caches)?)?;
        Ok(caches)
    }

    fn needs_hidden(&self) -> bool {
        true
    }

    fn restore_margin(&self) -> usize {
        1
    }

    fn observe(&self, state: &mut DraftState, seen: Observed<'_>) -> Result<()> {
        let hidden = match seen {
            Observed::Prefill { hidden, .. } | Observed::Decode { hidden } => hidden,
        };
        state.backlog.push(hidden.clone());
        Ok(())
    }

    fn lag(&self, state: &DraftState, committed: usize) -> usize {
        committed.saturating_sub(state.covered + 1)
    }

    /// The layer takes the last round's accepted drafts in at the next one.
    fn ordinary_lag(&self, max_depth: usize) -> usize {
        2 + max_depth
    }

    fn maintain(&self, state: &mut DraftState, committed: &[u32]) -> Result<()> {
        let held: usize = state.backlog.iter().map(|b| b.shape()[1] as usize).sum();
        if held > FLUSH {
            self.catch_up(state, committed)?;
        }
        Ok(())
    }

    fn settle(&self, state: &mut DraftState, committed: &[u32]) -> Result<()> {
        self.catch_up(state, committed)
    }

    fn propose(&self, rows: &mut [DraftRow<'_>], draws: &mut dyn Draws) -> Result<()> {
        // Each row's first pass: the pairs the layer has not taken in yet, then the pending
        // token with the target's hidden state that produced it.
        let mut first = Vec::with_capacity(rows.len());
        for r in rows.iter_mut() {
            let h_prev = r.hidden.ok_or_else(|| {
                ModelError::Invalid("the MTP layer drafts from the target's hidden state".into())
            })?;
            let pending = r.pending.reshape(&[1, 1])?.astype(Dtype::I32)?;
            let h_prev = h_prev.reshape(&[1, 1, -1])?;
            let s = r.committed.len();
            let (tokens, hidden) = if r.state.covered + 1 < s && !r.state.backlog.is_empty() {
                let (t, h) = take_pairs(r.state, r.committed)?;
                (
                    mlx::concatenate(&[&t, &pending], 1)?,
                    mlx::concatenate(&[&h, &h_prev], 1)?,
                )
            } else {
                (pending, h_prev)
            };
            first.push(Feed {
                tokens,
                hidden: Some(hidden),
            });
        }
        let mtp = &self.mtp;
        let mut pass = |rows: &mut [DraftRow<'_>],
                        active: &[usize],
                        toks: &Array,
                        hid: Option<&Array>,
                        lens: &[usize]| {
            let hid = hid.ok_or_else(|| {
                ModelError::Invalid("the MTP layer pairs every token with a hidden state".into())
            })?;
            let mut by_row: Vec<Option<&mut DraftRow<'_>>> = rows.iter_mut().map(Some).collect();
            let mut caches = Vec::with_capacity(active.len());
            for &i in active {
                let r = by_row[i].take().ok_or_else(|| {
                    ModelError::Invalid("a row twice in one drafting pass".into())
                })?;
                caches.push(latent(&mut r.state.caches)?);
            }
            let (u, logits) = mtp.forward_rows(toks, hid, &mut caches, lens)?;
            Ok((logits, Some(u)))
        };
        lockstep(rows, first, draws, &mut pass)
    }

    fn accept(&self, state: &mut DraftState, round: &RoundEnd<'_>) -> Result<()> {
        // The first pair of the round (the pending token, the target's hidden) was exact; the
        // later ones chained the layer's own output, so they give way to the verified target
        // hidden states.
        latent(&mut state.caches)?.rewind(round.depth.saturating_sub(1))?;
        state.covered = round.start;
        state.backlog = vec![round.hidden.clone()];
        Ok(())
    }
}
