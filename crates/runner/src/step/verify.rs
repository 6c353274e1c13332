//! The verification phase of a step: the target's head runs once over every verify block, and
//! each round's acceptance graph is built on its slice ([`crate::round::verdict`]); nothing is
//! read here, so one evaluation serves every row.

use super::forward::{Forwarded, Piece};
use crate::generation::{internal, Ctx, Generation, Result};
use crate::round::{verdict, Verdict};

/// Each verifying row's verdict, or its own error, by row (`None`: the row does not verify).
pub(crate) fn run(
    ctx: &mut Ctx<'_>,
    gens: &[&mut Generation],
    pieces: &[Piece],
    fwd: &Forwarded,
) -> Result<Vec<Option<Result<Verdict>>>> {
    let mut out: Vec<Option<Result<Verdict>>> = (0..gens.len()).map(|_| None).collect();
    let verifying: Vec<(usize, &crate::round::Proposal)> = pieces
        .iter()
        .enumerate()
        .filter_map(|(i, p)| match p {
            Piece::Verify(p) => Some((i, &**p)),
            _ => None,
        })
        .collect();
    if verifying.is_empty() {
        return Ok(out);
    }
    let blocks = verifying
        .iter()
        .map(|&(i, _)| {
            fwd.hidden[i]
                .as_ref()
                .ok_or_else(|| internal("a verify block without hidden states"))
        })
        .collect::<Result<Vec<_>>>()?;
    let logits = ctx.model.logits(&mlx::concatenate(&blocks, 1)?)?;
    let mut at = 0;
    for (i, proposal) in verifying {
        let len = proposal.k + 1;
        let l = logits.slice_axis(1, at as i32, Some((at + len) as i32))?;
        at += len;
        out[i] = Some(verdict(ctx.sampler, gens[i].slot(), proposal, &l));
    }
    Ok(out)
}
