//! Drafting several sequences in lockstep: each pass of a drafter network runs once for every
//! row still drafting, packed along time as the target's forward is, and each row's draft is
//! drawn from its own logits ([`Draws::sample`]) and fed, with the pass's hidden output where
//! the drafter chains one, to the next pass. One sequence drafting alone is the one-row case.

use super::{DraftRow, Draws};
use crate::{ModelError, Result};
use mlx::{Array, Dtype};

/// What a drafter takes in for one row of a pass: tokens `[1, l]` and, for drafters that pair
/// tokens with hidden states, those `[1, l, H]`.
pub(crate) struct Feed {
    pub tokens: Array,
    pub hidden: Option<Array>,
}

/// One pass over the active rows (indices into `rows`): packed tokens `[1, T]`, packed hidden
/// states if the feeds carry them, and each active row's length; returns each active row's
/// logits at its last position `[A, V]` and, for chaining drafters, the hidden outputs
/// `[1, T, H]` the next position pairs with.
pub(crate) type Pass<'p, 'r> = dyn FnMut(
        &mut [DraftRow<'r>],
        &[usize],
        &Array,
        Option<&Array>,
        &[usize],
    ) -> Result<(Array, Option<Array>)>
    + 'p;

/// Runs passes until every row has its depth of drafts: `first[i]` is what row `i` takes in
/// first (rows of depth 0 take part in nothing).
pub(crate) fn lockstep<'r>(
    rows: &mut [DraftRow<'r>],
    first: Vec<Feed>,
    draws: &mut dyn Draws,
    pass: &mut Pass<'_, 'r>,
) -> Result<()> {
    if first.len() != rows.len() {
        return Err(ModelError::Invalid(format!(
            "{} first feeds for {} drafting rows",
            first.len(),
            rows.len()
        )));
    }
    let (mut active, mut feeds): (Vec<usize>, Vec<Feed>) = first
        .into_iter()
        .enumerate()
        .filter(|(i, _)| rows[*i].depth > 0)
        .unzip();
    let mut j = 0;
    while !active.is_empty() {
        let lens: Vec<usize> = feeds.iter().map(|f| f.tokens.shape()[1] as usize).collect();
        let toks = mlx::concatenate(&feeds.iter().map(|f| &f.tokens).collect::<Vec<_>>(), 1)?;
        let hid = match feeds
            .iter()
            .map(|f| f.hidden.as_ref())
            .collect::<Option<Vec<_>>>()
        {
            Some(h) => Some(mlx::concatenate(&h, 1)?),
            None => None,
        };
        let (logits, out) = pass(rows, &active, &toks, hid.as_ref(), &lens)?;
        let drafts = draws.sample(&active, &logits.astype(Dtype::F32)?)?;
        let mut next = (Vec::new(), Vec::new());
        let mut at = 0;
        for ((&i, &l), d) in active.iter().zip(&lens).zip(drafts) {
            at += l;
            if j + 1 < rows[i].depth {
                next.0.push(i);
                next.1.push(Feed {
                    tokens: d.reshape(&[1, 1])?.astype(Dtype::I32)?,
                    hidden: match &out {
                        Some(u) => Some(u.slice_axis(1, at as i32 - 1, Some(at as i32))?),
                        None => None,
                    },
                });
            }
        }
        (active, feeds) = next;
        j += 1;
    }
    Ok(())
}

/// Each row's last position in a packed pass of rows of these lengths.
pub(crate) fn last_positions(lens: &[usize]) -> Vec<i32> {
    let mut at = 0;
    lens.iter()
        .map(|&l| {
            at += l;
            at as i32 - 1
        })
        .collect()
}
