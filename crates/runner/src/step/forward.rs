//! The forward phase of a step: every row's tokens (a prefill chunk, a pending token, a verify
//! block) packed into one `[1, T]` row and run through the target in one pass
//! ([`models::CausalLm::forward_packed`]: each row at its own offset, with its own caches), so
//! the weights are read once for the whole step. Each row's hidden states then go to its
//! sequence: a prefill chunk advances the prompt (and its drafter, and the snapshot due there),
//! a decode step tells its drafter.

use crate::generation::{tokens_array, Ctx, Generation, Result};
use crate::round::Proposal;
use mlx::Array;
use sample::Sampled;

/// A row's work as the step executes it (the plan, with what drafting produced).
pub(crate) enum Piece {
    /// Feeds prompt tokens `start..end`.
    Prefill {
        start: usize,
        end: usize,
    },
    /// Feeds the pending token (taken) and samples its successor when it continues; `planned`
    /// is the depth of the round the plan had (0: a plain step), whose drafter found nothing.
    Decode {
        current: Sampled,
        continues: bool,
        planned: usize,
    },
    /// Feeds the pending token and its drafts.
    Verify(Box<Proposal>),
    Skip,
}

/// What the forward pass produced.
pub(crate) struct Forwarded {
    /// The packed final hidden states `[1, T, H]`, when anything was fed.
    pub packed: Option<Array>,
    /// Each fed row's hidden states `[1, len, H]`.
    pub hidden: Vec<Option<Array>>,
    /// The rows whose last position samples a token (a decode step that continues, the end of
    /// a prompt), with that position in the packed row.
    pub sampling: Vec<(usize, i32)>,
    /// Rows and tokens fed.
    pub rows: usize,
    pub tokens: usize,
}

pub(crate) fn run(
    ctx: &mut Ctx<'_>,
    gens: &mut [&mut Generation],
    pieces: &[Piece],
) -> Result<Forwarded> {
    let mut tokens: Vec<Array> = Vec::new();
    let mut lens: Vec<Option<usize>> = Vec::with_capacity(gens.len());
    // The media in each row's prefill chunk, encoded (the towers run here, in the step).
    let mut media: Vec<Vec<models::MediaSpan>> = Vec::with_capacity(gens.len());
    for (g, p) in gens.iter_mut().zip(pieces) {
        media.push(match p {
            Piece::Prefill { start, end } if g.has_media() => {
                g.media_spans(ctx.towers, *start, *end)?
            }
            _ => Vec::new(),
        });
        match p {
            Piece::Decode {
                current,
                continues: true,
                ..
            } => {
                tokens.push(current.tokens.reshape(&[1, 1])?);
                lens.push(Some(1));
            }
            Piece::Verify(p) => {
                tokens.push(p.tokens.clone());
                lens.push(Some(p.k + 1));
            }
            Piece::Prefill { start, end } => {
                tokens.push(tokens_array(g.prompt(*start, *end))?);
                lens.push(Some(end - start));
            }
            _ => lens.push(None),
        }
    }
    let rows = lens.iter().flatten().count();
    let total: usize = lens.iter().flatten().sum();
    let mut out = Forwarded {
        packed: None,
        hidden: vec![None; gens.len()],
        sampling: Vec::new(),
        rows,
        tokens: total,
    };
    if rows == 0 {
        return Ok(out);
    }
    let refs: Vec<&Array> = tokens.iter().collect();
    let packed_tokens = mlx::concatenate(&refs, 1)?;
    let mut packed_rows: Vec<models::PackedRow<'_>> = gens
        .iter_mut()
        .zip(&lens)
        .zip(&media)
        .filter_map(|((g, l), m)| {
            l.map(|len| models::PackedRow {
                seq: g.seq(),
                len,
                caches: g.caches_mut(),
                media: m,
            })
        })
        .collect();
    let hidden = ctx.model.forward_packed(&packed_tokens, &mut packed_rows)?;
    drop(packed_rows);
    let drafter = ctx.drafter();
    let mut at = 0;
    for (i, (g, p)) in gens.iter_mut().zip(pieces).enumerate() {
        let Some(len) = lens[i] else {
            continue;
        };
        let h = if rows == 1 {
            hidden.clone()
        } else {
            hidden.slice_axis(1, at as i32, Some((at + len) as i32))?
        };
        at += len;
        let samples = match p {
            Piece::Decode { .. } => {
                g.decoded(drafter, &h)?;
                true
            }
            Piece::Prefill { end, .. } => g.prefilled(drafter, *end, &h)?,
            Piece::Verify(_) | Piece::Skip => false,
        };
        out.hidden[i] = Some(h);
        if samples {
            out.sampling.push((i, at as i32 - 1));
        }
    }
    let verifying = pieces.iter().any(|p| matches!(p, Piece::Verify(_)));
    if out.sampling.is_empty() && !verifying {
        // Only prefill chunks: materialise their cache writes.
        hidden.eval()?;
    }
    out.packed = Some(hidden);
    Ok(out)
}
