//! One step of several sequences: a plan, then phases.
//!
//! 1. [`plan`]: decide, as plain data ([`StepPlan`]), what each sequence does: a prefill chunk
//!    within the step's prompt budget, some layers of a media encoder ahead of the chunk that
//!    holds the item, a plain decode step, or a speculative round of a depth its depth
//!    controller chose.
//! 2. [`draft`]: every round row drafts, all in one call of the drafter.
//! 3. [`forward`]: every row's tokens in one packed forward pass of the target.
//! 4. [`sample`]: rows that continue draw their next token in one sampler call (dispatched,
//!    read next step).
//! 5. [`verify`]: rounds' verdicts as one graph, read together with the fed pending tokens in
//!    one evaluation; then each row settles on its own: what it emits, what its caches and its
//!    drafter keep.
//!
//! An error of the shared work (drafting, the forward pass, sampling) fails the whole step; an
//! error of one row's own work (its grammar, its verdict) fails that row only.

pub mod plan;

mod draft;
mod forward;
mod sample;
mod verify;

pub use plan::{Price, RowPlan, StepPlan, Work};

use crate::generation::{internal, Ctx, Event, GenerateError, Generation, Result};
use forward::Piece;
use std::time::Instant;

/// What one step did.
pub struct StepOutcome {
    /// Each sequence's event (`None` for a prefill chunk, or a sequence that sat out) or its own
    /// error, in order.
    pub events: Vec<Result<Option<Event>>>,
    /// Rows and tokens the target's forward pass had.
    pub rows: usize,
    pub tokens: usize,
    /// The plan the step carried out.
    pub plan: StepPlan,
}

/// Steps `gens` (each [`Generation::batchable`]) together, prefill chunks taking at most
/// `prefill_budget` prompt tokens in all, a media encoder about `encode_budget` of time. Depth
/// controllers are told the whole step's time, so a slower, larger batch makes drafting look
/// dearer.
pub fn run(
    ctx: &mut Ctx<'_>,
    gens: &mut [&mut Generation],
    prefill_budget: usize,
    encode_budget: std::time::Duration,
) -> Result<StepOutcome> {
    let started = Instant::now();
    let plan = StepPlan::make(ctx, gens, prefill_budget);
    let mut encode_errors: Vec<Option<GenerateError>> = gens.iter().map(|_| None).collect();
    for (i, (g, r)) in gens.iter_mut().zip(&plan.rows).enumerate() {
        if let Work::Encode { item } = r.work {
            // An item that does not encode fails its own sequence only.
            let towers = ctx
                .towers
                .ok_or_else(|| internal("media without a tower"))?;
            if let Err(e) = g.encode_some(towers, item, encode_budget) {
                encode_errors[i] = Some(e);
            }
        }
    }

    let rounds: Vec<(usize, usize)> = plan
        .rows
        .iter()
        .enumerate()
        .filter_map(|(i, r)| match r.work {
            Work::Round { depth } => Some((i, depth)),
            _ => None,
        })
        .collect();
    let mut proposals = if rounds.is_empty() {
        Vec::new()
    } else {
        draft::run(ctx, gens, &rounds)?
    }
    .into_iter();
    let mut pieces = Vec::with_capacity(gens.len());
    for (g, r) in gens.iter_mut().zip(&plan.rows) {
        pieces.push(match &r.work {
            Work::Prefill { start, end, .. } => Piece::Prefill {
                start: *start,
                end: *end,
            },
            Work::Decode { continues } => Piece::Decode {
                current: g.take_pending()?,
                continues: *continues,
                planned: 0,
            },
            Work::Round { depth } => match proposals.next().flatten() {
                Some(p) => Piece::Verify(Box::new(p)),
                // Nothing drafted: a plain decode step.
                None => Piece::Decode {
                    current: g.take_pending()?,
                    continues: g.may_continue(),
                    planned: *depth,
                },
            },
            Work::Encode { .. } | Work::Skip => Piece::Skip,
        });
    }

    let fwd = forward::run(ctx, gens, &pieces)?;
    let mut row_errors = sample::run(ctx, gens, &pieces, &fwd)?;
    let verdicts = verify::run(ctx, gens, &pieces, &fwd)?;

    // The fed pending tokens and the verdicts, read together in one evaluation.
    let mut reads: Vec<&mlx::Array> = pieces
        .iter()
        .filter_map(|p| match p {
            Piece::Decode { current, .. } => Some(&current.tokens),
            _ => None,
        })
        .collect();
    for v in verdicts.iter().flatten().flatten() {
        reads.extend(v.arrays());
    }
    mlx::eval(&reads)?;

    // What the step's time prices: the deepest round actually drafted among the controller's
    // rows (a row that drafted nothing stepped plainly).
    let priced = plan.price.depth.map(|_| {
        gens.iter()
            .zip(&pieces)
            .filter(|(g, _)| g.drafting() && !g.has_own_depth())
            .map(|(_, p)| match p {
                Piece::Verify(p) => p.k,
                _ => 0,
            })
            .max()
            .unwrap_or(0)
    });

    // From here on each sequence's work is its own: an error fails that sequence only.
    let mut events = Vec::with_capacity(gens.len());
    for (i, ((g, p), verdict)) in gens.iter_mut().zip(pieces).zip(verdicts).enumerate() {
        if let Some(e) = encode_errors[i].take().or_else(|| row_errors[i].take()) {
            events.push(Err(e));
            continue;
        }
        events.push(settle(ctx, g, p, fwd.hidden[i].as_ref(), verdict));
    }
    if let (Some(k), Some((_, c))) = (priced, &mut ctx.draft) {
        if !plan.price.unpriced && plan.price.own_deepest <= k {
            c.record_cost(k, started.elapsed().as_secs_f64());
        }
    }
    Ok(StepOutcome {
        events,
        rows: fwd.rows,
        tokens: fwd.tokens,
        plan,
    })
}

/// A row's end of the step: what it emits.
fn settle(
    ctx: &mut Ctx<'_>,
    g: &mut Generation,
    piece: Piece,
    hidden: Option<&mlx::Array>,
    verdict: Option<Result<crate::round::Verdict>>,
) -> Result<Option<Event>> {
    Ok(match piece {
        Piece::Decode {
            current,
            continues,
            planned,
        } => Some(g.settle_decode(ctx, &current, continues, planned)?),
        Piece::Verify(proposal) => {
            let k = proposal.k;
            let hidden = hidden.ok_or_else(|| internal("a verify block without hidden states"))?;
            let verdict = verdict.ok_or_else(|| internal("a verify block without a verdict"))??;
            let accepted = g.settle_round(ctx, *proposal, &verdict, hidden)?;
            g.record_depth(ctx, k, accepted);
            g.pop_ready()
        }
        Piece::Prefill { .. } | Piece::Skip => None,
    })
}

impl From<GenerateError> for Event {
    fn from(e: GenerateError) -> Event {
        match e {
            GenerateError::BadRequest(m) => Event::Rejected(m),
            e => Event::Error(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request's fault is a 400 (`Rejected`); an engine invariant that did not hold is an
    /// error of the server's, never a 400.
    #[test]
    fn invariants_are_internal_errors_not_bad_requests() {
        let e: Event = crate::generation::internal("a verify block without a verdict").into();
        assert!(
            matches!(&e, Event::Error(m) if m == "internal error: a verify block without a verdict"),
            "{e:?}"
        );
        let e: Event = GenerateError::BadRequest("prompt is empty".into()).into();
        assert!(
            matches!(&e, Event::Rejected(m) if m == "prompt is empty"),
            "{e:?}"
        );
    }
}
