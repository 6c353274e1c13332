//! The sampling phase of a step: the head runs once over every row whose last position samples
//! (a continuing decode step, the end of a prompt), grammar masks are added (worked out on the
//! host while the forward pass runs), and the sampler draws every row's token in one call (the
//! fused path when options allow). The draws are dispatched, not read: each becomes its
//! sequence's pending token, read by the next step, so the device never waits on the host.

use super::forward::{Forwarded, Piece};
use crate::generation::{internal, Ctx, GenerateError, Generation, Result};
use mlx::Array;
use sample::Sampled;

/// Draws the sampling rows' tokens; returns each row's own error (its grammar), by row.
pub(crate) fn run(
    ctx: &mut Ctx<'_>,
    gens: &mut [&mut Generation],
    pieces: &[Piece],
    fwd: &Forwarded,
) -> Result<Vec<Option<GenerateError>>> {
    let mut errors: Vec<Option<GenerateError>> = (0..gens.len()).map(|_| None).collect();
    if fwd.sampling.is_empty() {
        return Ok(errors);
    }
    let hidden = fwd
        .packed
        .as_ref()
        .ok_or_else(|| internal("sampling rows without a forward pass"))?;
    let positions: Vec<i32> = fwd.sampling.iter().map(|s| s.1).collect();
    let idx = Array::from_slice(&positions, &[positions.len() as i32])?;
    let last = hidden.take(&idx, 1)?; // [1, S, H]
    let logits = ctx.model.logits(&last)?;
    let v = logits.shape();
    let width = v[v.len() - 1];
    let mut logits = logits.reshape(&[fwd.sampling.len() as i32, width])?;
    if fwd.sampling.iter().any(|&(i, _)| gens[i].has_grammar()) {
        // The forward runs while the host works out the masks.
        mlx::async_eval(&[&logits])?;
        let mut bias = Vec::with_capacity(fwd.sampling.len());
        for &(i, _) in &fwd.sampling {
            let fed = match &pieces[i] {
                Piece::Decode { current, .. } => Some(current),
                _ => None,
            };
            let row = match gens[i].grammar_bias(fed, width as usize) {
                Ok(Some(b)) => Array::from_slice(&b, &[1, width])?,
                Ok(None) => Array::full(&[1, width], 0.0, mlx::Dtype::F32)?,
                Err(e) => {
                    errors[i] = Some(e);
                    Array::full(&[1, width], 0.0, mlx::Dtype::F32)?
                }
            };
            bias.push(row);
        }
        logits = logits.add(&mlx::concatenate(&bias.iter().collect::<Vec<_>>(), 0)?)?;
    }
    let slots: Vec<usize> = fwd.sampling.iter().map(|&(i, _)| gens[i].slot()).collect();
    let s = ctx.sampler.sample(&slots, &logits)?;
    // Each row's slices go into this evaluation: left lazy, they would join the next step's
    // graph, and reading a token would wait for that whole forward pass.
    let rows = (0..fwd.sampling.len())
        .map(|j| s.row(j))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    mlx::async_eval(&rows.iter().flat_map(Sampled::arrays).collect::<Vec<_>>())?;
    for (j, (row, &(i, _))) in rows.into_iter().zip(&fwd.sampling).enumerate() {
        let h = last.slice_axis(1, j as i32, Some(j as i32 + 1))?;
        gens[i].set_pending(row, h);
    }
    Ok(errors)
}
