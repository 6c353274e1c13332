//! The first phase of a step: deciding, as plain data, what each sequence does in it.
//!
//! A [`StepPlan`] says for every sequence of the step its position and its work: a prefill
//! chunk (its token ids), a decode step (its pending token, sampled by the step before), a
//! speculative round of some depth, or nothing this time (no prefill budget left). It is made
//! before anything runs and holds everything a replica of the target needs to run the same
//! forward pass except what earlier steps sampled, which the leader knows when it sends the
//! plan; so it serializes, for followers that replay steps.

use crate::generation::{Ctx, Generation};
use serde::{Deserialize, Serialize};

/// What one step does, sequence by sequence, in the order of the step's sequences.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepPlan {
    pub rows: Vec<RowPlan>,
    /// Prompt tokens the step's prefill chunks may take together.
    pub prefill_budget: usize,
    /// What the step's time is the price of, for the engine's depth controller.
    pub price: Price,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RowPlan {
    /// The sequence's sampler slot: its identity in the engine.
    pub slot: usize,
    /// Positions its target caches hold before the step: where its first fed token goes.
    pub position: usize,
    pub work: Work,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Work {
    /// Feeds prompt tokens `start..end`.
    Prefill {
        start: usize,
        end: usize,
        tokens: Vec<u32>,
    },
    /// Feeds the pending token, and samples its successor when `continues` (a limit may end
    /// the sequence at the pending token).
    Decode { continues: bool },
    /// Drafts up to `depth` tokens, then feeds the pending token and the drafts to verify them
    /// (a drafter may find fewer; one that finds none decodes plainly).
    Round { depth: usize },
    /// Runs the towers over media item `item` (by index in the prompt's media) for about a
    /// prefill chunk's time instead of feeding tokens: the next chunk holds it, and other
    /// sequences share the step, so a long encoding is spread over steps rather than stalling
    /// theirs.
    Encode { item: usize },
    /// Sits this step out: the prefill budget is spent.
    Skip,
}

/// Whether a step's time can price the depth the engine's controller chose: only a step that
/// does nothing but rounds (or plain steps) of that depth can. A prefill chunk, a drafter
/// catching up with many tokens, or a seeded row's deeper round makes the time another's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Price {
    /// The depth the controller chose for its rows (`None`: no row on it drafts).
    pub depth: Option<usize>,
    /// Something else is in the step.
    pub unpriced: bool,
    /// The deepest round of a row on its own controller.
    pub own_deepest: usize,
}

impl StepPlan {
    /// The plan for `gens` (each [`Generation::batchable`]) with `prefill_budget` prompt tokens:
    /// prefill chunks in order until the budget is spent; for decoding sequences, the depth of
    /// their round. The rows on the engine's controller share one depth per step, chosen for
    /// the deepest of their limits and clamped by each one's own, so that the step's time is
    /// the price of that depth; a seeded row keeps its own reproducible choice.
    pub(crate) fn make(
        ctx: &mut Ctx<'_>,
        gens: &mut [&mut Generation],
        prefill_budget: usize,
    ) -> StepPlan {
        let drafter = ctx.drafter();
        let limits: Vec<usize> = gens
            .iter_mut()
            .map(|g| {
                if g.prefilling() {
                    0
                } else {
                    g.depth_limit(drafter)
                }
            })
            .collect();
        let shared_limit = gens
            .iter()
            .zip(&limits)
            .filter(|(g, _)| !g.has_own_depth())
            .map(|(_, &l)| l)
            .max()
            .unwrap_or(0);
        let shared = match &mut ctx.draft {
            Some((_, c)) if shared_limit > 0 => c.choose(shared_limit),
            _ => 0,
        };
        let ordinary = match &ctx.draft {
            Some((d, c)) => d.ordinary_lag(c.max()),
            None => 0,
        };
        let mut budget = prefill_budget.max(1);
        let mut price = Price::default();
        let mut rows = Vec::with_capacity(gens.len());
        let shared_step = gens.len() > 1;
        for (g, &limit) in gens.iter_mut().zip(&limits) {
            let work = if g.prefilling() {
                price.unpriced = true;
                if budget == 0 {
                    Work::Skip
                } else {
                    let (start, end) = g.chunk(budget);
                    match g.unencoded(start, end).filter(|_| shared_step) {
                        // An encoding step costs about a chunk: it takes the budget.
                        Some(item) => {
                            budget = 0;
                            Work::Encode { item }
                        }
                        None => {
                            // A chunk may pass the budget by the rest of an item it holds whole.
                            budget = budget.saturating_sub(end - start);
                            Work::Prefill {
                                start,
                                end,
                                tokens: g.prompt(start, end).to_vec(),
                            }
                        }
                    }
                }
            } else {
                let depth = match g.own_choice(limit) {
                    Some(d) => {
                        price.own_deepest = price.own_deepest.max(d);
                        d
                    }
                    None => {
                        let d = shared.min(limit);
                        if g.drafting() {
                            price.depth = price.depth.max(Some(d));
                        }
                        d
                    }
                };
                if depth > 0 {
                    // A round that also catches its drafter up is dearer than its depth.
                    if let Some(d) = drafter {
                        price.unpriced |= g.drafter_lag(d) > ordinary;
                    }
                    Work::Round { depth }
                } else {
                    Work::Decode {
                        continues: g.may_continue(),
                    }
                }
            };
            rows.push(RowPlan {
                slot: g.slot(),
                position: g.position(),
                work,
            });
        }
        StepPlan {
            rows,
            prefill_budget,
            price,
        }
    }
}
