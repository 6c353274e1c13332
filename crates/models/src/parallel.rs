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

/// Where a split model's output goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ends {
    /// Every rank runs the same generation loop: the last rank holds the head, and its logits
    /// go to every rank, which samples for itself (`generate`).
    Everywhere,
    /// Rank 0 leads (the HTTP runner): it holds the embedding and the head, the last rank sends
    /// it the final hidden states, and only rank 0 computes logits and samples.
    First,
}

/// This rank's part of a model split by layers.
#[derive(Clone)]
pub struct Stage {
    group: Rc<Group>,
    layers: Range<usize>,
    /// What the hidden states cross between ranks in: the model's compute dtype.
    dtype: Dtype,
    ends: Ends,
}

impl Stage {
    /// The part of rank `group.rank()` among `ranges` (one contiguous range per rank, in
    /// order, covering every layer), passing hidden states in `dtype`.
    pub fn new(
        group: Rc<Group>,
        ranges: &[Range<usize>],
        dtype: Dtype,
        ends: Ends,
    ) -> Result<Stage> {
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
            ends,
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

    /// Whether this stage ends with the final norm.
    pub fn is_last(&self) -> bool {
        self.rank() + 1 == self.group.size()
    }

    /// Whether this rank holds the head (computes logits).
    pub fn holds_head(&self) -> bool {
        match self.ends {
            Ends::Everywhere => self.is_last(),
            Ends::First => self.is_first(),
        }
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
    ///
    /// Where rank 0 leads ([`Ends::First`]), the last stage sends `out` to rank 0 instead, and
    /// rank 0 returns what it receives.
    pub fn leave(&self, h: &Array, out: Option<Array>) -> Result<Array> {
        let last = self.group.size() - 1;
        match out {
            Some(out) if self.is_last() => {
                if self.ends == Ends::First {
                    self.group.send(&out.astype(self.dtype)?, 0)?.eval()?;
                    return Ok(Array::zeros(&h.shape(), self.dtype)?);
                }
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
                if self.ends == Ends::First && self.is_first() {
                    let out = self.group.recv(&h.shape(), self.dtype, last)?;
                    out.eval()?;
                    return Ok(out);
                }
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
        if self.ends == Ends::First {
            return if self.holds_head() {
                head()
            } else {
                Err(ModelError::Invalid(
                    "logits asked of a rank that follows rank 0".into(),
                ))
            };
        }
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
/// the split minimises the largest stage's bytes, counting `ends` (what the first and the
/// last stage hold besides layers: the embedding, the head). A boundary `b` (the first layer
/// of a stage) must satisfy `allowed(b)` (KV-shared layers stay with the layers whose caches
/// they read).
pub fn split_layers(
    bytes: &[u64],
    ranks: usize,
    ends_bytes: [u64; 2],
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
    let extra = |k: usize| {
        let first = if k == 0 { ends_bytes[0] } else { 0 };
        let last = if k + 1 == ranks { ends_bytes[1] } else { 0 };
        first + last
    };
    for (e, &end) in ends.iter().enumerate() {
        best[0][e] = (prefix[end] + extra(0), usize::MAX);
    }
    for k in 1..ranks {
        for e in 0..ends.len() {
            for p in 0..e {
                let (prev, _) = best[k - 1][p];
                if prev == inf {
                    continue;
                }
                let cost = prev.max(prefix[ends[e]] - prefix[ends[p]] + extra(k));
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

/// What the first and the last stage hold besides layers, in bytes (see [`split_layers`]):
/// `embed` and `head` bytes placed as `ends` places them (`tied`: the head is the embedding;
/// `everywhere`: every rank holds the embedding anyway, per-layer embeddings).
pub fn end_bytes(ends: Ends, embed: u64, head: u64, tied: bool, everywhere: bool) -> [u64; 2] {
    let embed_first = if everywhere { 0 } else { embed };
    let head = match (tied, everywhere) {
        (true, true) => 0,
        (true, false) => embed,
        (false, _) => head,
    };
    match ends {
        Ends::Everywhere => [embed_first, head],
        // A tied head on rank 0 is the embedding it holds already.
        Ends::First => [embed_first + if tied { 0 } else { head }, 0],
    }
}

/// Bytes of the tensors among `tensors` whose names start with `prefix`.
pub fn bytes_under<'a>(tensors: impl IntoIterator<Item = (&'a str, u64)>, prefix: &str) -> u64 {
    tensors
        .into_iter()
        .filter(|(n, _)| n.starts_with(prefix))
        .map(|(_, b)| b)
        .sum()
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
        let even = split_layers(&[1, 1, 1, 1, 1, 1], 3, [0, 0], |_| true).unwrap();
        assert_eq!(even, vec![0..2, 2..4, 4..6]);
        // One heavy layer gets a stage of its own.
        let heavy = split_layers(&[1, 1, 10, 1, 1], 3, [0, 0], |_| true).unwrap();
        assert_eq!(heavy[1], 2..3, "{heavy:?}");
        // Layers 3.. share caches with layer 2: no cut after 2.
        let shared = split_layers(&[1; 6], 2, [0, 0], |b| b <= 2).unwrap();
        assert_eq!(shared, vec![0..2, 2..6]);
        // What the first stage holds besides layers (the embedding) moves a layer on.
        let ends = split_layers(&[2; 4], 2, [4, 0], |_| true).unwrap();
        assert_eq!(ends, vec![0..1, 1..4]);
        let e = split_layers(&[1; 3], 4, [0, 0], |_| true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot split 3 layers over 4 ranks"), "{e}");
        let e = split_layers(&[1; 6], 3, [0, 0], |b| b <= 1)
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
