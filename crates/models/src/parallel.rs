//! A model split by layers over the ranks of a distributed group (pipeline parallel).
//!
//! Rank `r` holds layers `ranges[r]` and their caches only; the first rank holds the token
//! embedding, the last the head (and a model with per-layer embeddings the embedding on every
//! rank, whose layers read it). A forward pass enters the first stage as embeddings, leaves
//! each stage as the residual stream sent to the next rank, and ends on the last stage, whose
//! logits every rank receives: each rank samples the same token from the same bits
//! (docs/DISTRIBUTED.md).

use crate::{ModelError, Result};
use mlx::distributed::Group;
use mlx::{Array, Dtype};
use std::ops::Range;
use std::rc::Rc;

/// This rank's part of a model split by layers.
#[derive(Clone)]
pub struct Stage {
    group: Rc<Group>,
    layers: Range<usize>,
    /// What the hidden states cross between ranks in: the model's compute dtype.
    dtype: Dtype,
}

impl Stage {
    /// The part of rank `group.rank()` among `ranges` (one contiguous range per rank, in
    /// order, covering every layer), passing hidden states in `dtype`.
    pub fn new(group: Rc<Group>, ranges: &[Range<usize>], dtype: Dtype) -> Result<Stage> {
        let layers = ranges.get(group.rank()).cloned().ok_or_else(|| {
            ModelError::Invalid(format!(
                "rank {} of {} has no layers among {ranges:?}",
                group.rank(),
                group.size()
            ))
        })?;
        Ok(Stage {
            group,
            layers,
            dtype,
        })
    }

    pub fn layers(&self) -> Range<usize> {
        self.layers.clone()
    }

    fn rank(&self) -> usize {
        self.group.rank()
    }

    /// Whether this stage embeds the tokens.
    pub fn is_first(&self) -> bool {
        self.rank() == 0
    }

    /// Whether this stage ends with the final norm and holds the head.
    pub fn is_last(&self) -> bool {
        self.rank() + 1 == self.group.size()
    }

    /// The residual stream `[1, T, H]` (`shape`) this stage starts from: `embed()` on the
    /// first stage, else what the previous rank sends.
    pub fn enter(&self, shape: &[i32], embed: impl FnOnce() -> Result<Array>) -> Result<Array> {
        if self.is_first() {
            return Ok(embed()?.astype(self.dtype)?);
        }
        Ok(self.group.recv(shape, self.dtype, self.rank() - 1)?)
    }

    /// Ends this stage's part of a forward pass: the last stage's `out` (the final hidden
    /// states), computed here; another stage sends its residual stream `h` on to the next rank
    /// and returns zeros of its shape (only the last stage's hidden states are real; the
    /// logits come from it, [`Stage::logits`]).
    ///
    /// Every collective is evaluated where the code meets it, in the same order on every
    /// rank: a rank that left one pending would run it when a later evaluation happened to
    /// need it, after collectives its peers ran first, and the ranks would wait on each other.
    pub fn leave(&self, h: &Array, out: Option<Array>) -> Result<Array> {
        match out {
            Some(out) if self.is_last() => {
                out.eval()?;
                Ok(out)
            }
            _ if self.is_last() => Err(ModelError::Invalid(
                "the last stage ended without final hidden states".into(),
            )),
            _ => {
                self.group
                    .send(&h.astype(self.dtype)?, self.rank() + 1)?
                    .eval()?;
                Ok(Array::zeros(&h.shape(), self.dtype)?)
            }
        }
    }

    /// The logits of `hidden` (`[.., H]`) over `vocab` tokens, as float32, on every rank: the
    /// last stage computes them with `head`, which only it holds, and sends them to the others
    /// (evaluated here, see [`Stage::leave`]).
    pub fn logits(
        &self,
        hidden: &Array,
        vocab: usize,
        head: impl FnOnce() -> Result<Array>,
    ) -> Result<Array> {
        let logits = if self.is_last() {
            head()?.astype(Dtype::F32)?
        } else {
            let mut shape = hidden.shape();
            if let Some(last) = shape.last_mut() {
                *last = vocab as i32;
            }
            Array::zeros(&shape, Dtype::F32)?
        };
        let logits = self.group.broadcast(&logits, self.group.size() - 1)?;
        logits.eval()?;
        Ok(logits)
    }
}

/// Contiguous layer ranges, one per rank, whose weights are as even as the split allows:
/// the split minimises the largest stage's bytes. A boundary `b` (the first layer of a stage)
/// must satisfy `allowed(b)` (KV-shared layers stay with the layers whose caches they read).
pub fn split_layers(
    bytes: &[u64],
    ranks: usize,
    allowed: impl Fn(usize) -> bool,
) -> Result<Vec<Range<usize>>> {
    let n = bytes.len();
    let cuts: Vec<usize> = (1..n).filter(|&b| allowed(b)).collect();
    if ranks == 0 || cuts.len() + 1 < ranks {
        return Err(ModelError::Invalid(format!(
            "cannot split {n} layers over {ranks} ranks: {} of the places between layers may \
             begin a stage",
            cuts.len()
        )));
    }
    let mut prefix = vec![0u64; n + 1];
    for (i, b) in bytes.iter().enumerate() {
        prefix[i + 1] = prefix[i] + b;
    }
    // Stage ends: the cuts, then n.
    let ends: Vec<usize> = cuts.iter().copied().chain([n]).collect();
    // best[k][e]: the smallest largest stage putting layers 0..ends[e] on k + 1 stages, with
    // the index of the previous end.
    let inf = u64::MAX;
    let mut best = vec![vec![(inf, usize::MAX); ends.len()]; ranks];
    for (e, &end) in ends.iter().enumerate() {
        best[0][e] = (prefix[end], usize::MAX);
    }
    for k in 1..ranks {
        for e in 0..ends.len() {
            for p in 0..e {
                let (prev, _) = best[k - 1][p];
                if prev == inf {
                    continue;
                }
                let cost = prev.max(prefix[ends[e]] - prefix[ends[p]]);
                if cost < best[k][e].0 {
                    best[k][e] = (cost, p);
                }
            }
        }
    }
    let mut e = ends.len() - 1;
    let mut stage_ends = Vec::with_capacity(ranks);
    for k in (0..ranks).rev() {
        stage_ends.push(ends[e]);
        e = best[k][e].1;
    }
    stage_ends.reverse();
    let mut start = 0;
    Ok(stage_ends
        .into_iter()
        .map(|end| {
            let r = start..end;
            start = end;
            r
        })
        .collect())
}

/// Bytes of each layer's tensors among `tensors` (name, bytes), the layers being named
/// `{prefix}.{i}.…` for `i < layers`.
pub fn layer_bytes<'a>(
    tensors: impl IntoIterator<Item = (&'a str, u64)>,
    prefix: &str,
    layers: usize,
) -> Vec<u64> {
    let mut out = vec![0u64; layers];
    let lead = format!("{prefix}.");
    for (name, bytes) in tensors {
        let Some(rest) = name.strip_prefix(&lead) else {
            continue;
        };
        let index = rest.split('.').next().and_then(|i| i.parse::<usize>().ok());
        if let Some(slot) = index.and_then(|i| out.get_mut(i)) {
            *slot += bytes;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_balance_bytes_and_respect_allowed_cuts() {
        let even = split_layers(&[1, 1, 1, 1, 1, 1], 3, |_| true).unwrap();
        assert_eq!(even, vec![0..2, 2..4, 4..6]);
        // One heavy layer gets a stage of its own.
        let heavy = split_layers(&[1, 1, 10, 1, 1], 3, |_| true).unwrap();
        assert_eq!(heavy[1], 2..3, "{heavy:?}");
        // Layers 3.. share caches with layer 2: no cut after 2.
        let shared = split_layers(&[1; 6], 2, |b| b <= 2).unwrap();
        assert_eq!(shared, vec![0..2, 2..6]);
        let e = split_layers(&[1; 3], 4, |_| true).unwrap_err().to_string();
        assert!(e.contains("cannot split 3 layers over 4 ranks"), "{e}");
        let e = split_layers(&[1; 6], 3, |b| b <= 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("1 of the places"), "{e}");
    }

    #[test]
    fn layer_bytes_reads_the_index_after_the_prefix() {
        let t = [
            ("model.layers.0.mlp.w", 10),
            ("model.layers.1.attn.w", 5),
            ("model.layers.1.attn.s", 1),
            ("model.layers.12.x", 7), // past the layers: an MTP layer
            ("model.embed_tokens.weight", 100),
        ];
        assert_eq!(layer_bytes(t, "model.layers", 2), vec![10, 6]);
    }
}
