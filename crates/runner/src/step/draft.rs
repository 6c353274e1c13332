//! The drafting phase of a step: every row whose plan is a round drafts, all rows in one call
//! of the drafter ([`Drafter::propose`], lockstep passes for network drafters), each draft
//! drawn here under the row's sampler options, penalties and grammar ([`RowDraws`]).
//!
//! Structured output: a constrained row's drafts are drawn from distributions masked by its
//! grammar. The grammar takes in the pending token, then each draft as it is read (one read per
//! pass for all constrained rows), giving the mask of the next position: masks `M1..M(k+1)`,
//! which verification applies to the target's rows too. The drafts are undone at the end; the
//! round takes in those it accepts.

use crate::generation::{internal, Ctx, Generation, Result};
use crate::round::Proposal;
use grammar::{Allowed, Constraint};
use mlx::{Array, Dtype};
use models::draft::{DraftRow, DraftState, Draws};
use models::ModelError;
use sample::{Distribution, Sampled, Sampler};

/// One drafting row's draws so far.
struct RowRecord {
    slot: usize,
    grammar: Option<Box<Constraint>>,
    eos: Vec<u32>,
    drafts: Vec<Array>,
    qs: Vec<Distribution>,
    /// The grammar's allowed tokens after the pending token and each draft.
    masks: Option<Vec<Allowed>>,
    /// Drafts the grammar took in (undone at the end).
    taken: usize,
    /// A draft (or the pending token) was EOS: nothing more is taken in, since the sequence
    /// would end there, and later masks only need to be valid.
    eos_drafted: bool,
    /// The grammar failed: the row drafts on unmasked and fails alone when its round settles.
    failed: Option<String>,
}

impl RowRecord {
    /// The grammar takes in `id` and gives the next position's mask.
    fn advance(&mut self, id: u32) {
        let Some(g) = self.grammar.as_mut() else {
            return;
        };
        let next = (|| -> std::result::Result<Option<Allowed>, grammar::GrammarError> {
            if !self.eos_drafted {
                if self.eos.contains(&id) {
                    self.eos_drafted = true;
                } else {
                    g.consume(id)?;
                    self.taken += 1;
                }
            }
            if self.eos_drafted {
                Ok(self.masks.as_ref().and_then(|m| m.last().cloned()))
            } else {
                g.allowed().map(Some)
            }
        })();
        match next {
            Ok(m) => {
                if let (Some(ms), Some(m)) = (self.masks.as_mut(), m) {
                    ms.push(m);
                }
            }
            Err(e) => {
                self.failed = Some(e.to_string());
                self.masks = None;
            }
        }
    }
}

/// The runner's side of drafting: draws with the sampler and the grammars.
struct RowDraws<'s> {
    sampler: &'s mut Sampler,
    /// The target's vocabulary: the width of the distributions drafts are verified against.
    vocab: i32,
    rows: Vec<RowRecord>,
}

fn draft_error(e: impl std::fmt::Display) -> ModelError {
    ModelError::Invalid(format!("drawing a draft: {e}"))
}

impl Draws for RowDraws<'_> {
    fn sample(&mut self, rows: &[usize], logits: &Array) -> models::Result<Vec<Array>> {
        let width = *logits.shape().last().unwrap_or(&0);
        let mut out = Vec::with_capacity(rows.len());
        for (a, &i) in rows.iter().enumerate() {
            let r = &mut self.rows[i];
            let mut row = logits.slice_axis(0, a as i32, Some(a as i32 + 1))?;
            if let Some(m) = r.masks.as_ref().and_then(|m| m.last()) {
                let bias = Array::from_slice(&m.bias(width as usize), &[1, width])?;
                let masked = row.add(&bias)?;
                // A drafter whose own candidates are all forbidden (the assistant's sparse head)
                // drafts uniformly among the allowed tokens instead: a draft the grammar would
                // refuse must never be proposed.
                let dead = masked.max_all(false)?.isinf()?;
                row = mlx::where_(&dead, &bias, &masked)?;
            }
            let prefix = match r.drafts.is_empty() {
                true => None,
                false => Some(mlx::concatenate(&r.drafts.iter().collect::<Vec<_>>(), 0)?),
            };
            let q = self
                .sampler
                .distribution(r.slot, &row, prefix.as_ref())
                .map_err(draft_error)?;
            let d = self
                .sampler
                .sample_distribution(r.slot, &q)
                .map_err(draft_error)?;
            r.drafts.push(d.clone());
            r.qs.push(q);
            out.push(d);
        }
        // Constrained rows' drafts are read, all at once, for their grammars.
        let constrained: Vec<usize> = rows
            .iter()
            .copied()
            .filter(|&i| self.rows[i].masks.is_some())
            .collect();
        if !constrained.is_empty() {
            let ds: Vec<&Array> = constrained
                .iter()
                .filter_map(|&i| self.rows[i].drafts.last())
                .collect();
            mlx::eval(&ds)?;
            for &i in &constrained {
                let r = &mut self.rows[i];
                let id = match r.drafts.last() {
                    Some(d) => d.to_vec::<i32>()?[0] as u32,
                    None => continue,
                };
                r.advance(id);
            }
        }
        Ok(out)
    }

    fn propose(&mut self, row: usize, token: u32) -> models::Result<bool> {
        let r = &mut self.rows[row];
        if let Some(m) = r.masks.as_ref().and_then(|m| m.last()) {
            if !m.contains(token) {
                return Ok(false);
            }
        }
        let d = Array::from_slice(&[token as i32], &[1])?;
        r.qs.push(Distribution::point(&d, self.vocab).map_err(draft_error)?);
        r.drafts.push(d);
        if r.masks.is_some() {
            r.advance(token);
        }
        Ok(true)
    }
}

/// A round row's inputs, taken from its sequence for the drafting phase.
struct Taken {
    current: Sampled,
    hidden: Option<Array>,
    state: DraftState,
    depth: usize,
}

/// Drafts for the rows at `rounds` (index into `gens`, depth): returns each one's proposal, or
/// `None` for a row that drafted nothing (it decodes plainly instead, its pending token given
/// back).
pub(crate) fn run(
    ctx: &mut Ctx<'_>,
    gens: &mut [&mut Generation],
    rounds: &[(usize, usize)],
) -> Result<Vec<Option<Proposal>>> {
    let drafter = ctx
        .drafter()
        .ok_or_else(|| internal("a round without a drafter"))?;
    let mut taken = Vec::with_capacity(rounds.len());
    let mut records = Vec::with_capacity(rounds.len());
    for &(i, depth) in rounds {
        let g = &mut gens[i];
        let (current, hidden, state) = g.take_for_round()?;
        let mut rec = RowRecord {
            slot: g.slot(),
            grammar: g.take_grammar(),
            eos: g.eos().to_vec(),
            drafts: Vec::new(),
            qs: Vec::new(),
            masks: None,
            taken: 0,
            eos_drafted: false,
            failed: None,
        };
        if let Some(gr) = rec.grammar.as_mut() {
            // The grammar takes in the pending token; its mask is the first draft's.
            let id = current.tokens.to_vec::<i32>()?[0] as u32;
            let start = if rec.eos.contains(&id) {
                rec.eos_drafted = true;
                gr.allowed()
            } else {
                gr.consume(id).and_then(|_| gr.allowed())
            };
            match start {
                Ok(m) => rec.masks = Some(vec![m]),
                Err(e) => rec.failed = Some(e.to_string()),
            }
        }
        records.push(rec);
        taken.push(Taken {
            current,
            hidden,
            state,
            depth,
        });
    }
    let mut draws = RowDraws {
        sampler: &mut *ctx.sampler,
        vocab: ctx.model.vocab_size() as i32,
        rows: records,
    };
    let drafted = {
        let mut pendings = Vec::with_capacity(taken.len());
        for t in &taken {
            pendings.push(t.current.tokens.reshape(&[1, 1])?.astype(Dtype::I32)?);
        }
        let mut rows: Vec<DraftRow<'_>> = Vec::with_capacity(taken.len());
        for ((t, &(i, _)), pending) in taken.iter_mut().zip(rounds).zip(&pendings) {
            let g = &*gens[i];
            rows.push(DraftRow {
                seq: g.seq(),
                state: &mut t.state,
                target: g.caches(),
                committed: g.committed(),
                pending,
                hidden: t.hidden.as_ref(),
                depth: t.depth,
            });
        }
        drafter.propose(&mut rows, &mut draws)
    };
    let records = draws.rows;
    // Whatever happened, the grammars go back, with the drafts they took in undone.
    let mut out = Vec::with_capacity(rounds.len());
    let mut settled = Vec::with_capacity(rounds.len());
    for (mut rec, &(i, _)) in records.into_iter().zip(rounds) {
        if rec.failed.is_none() && rec.taken > 0 {
            if let Some(gr) = rec.grammar.as_mut() {
                if let Err(e) = gr.rollback(rec.taken) {
                    rec.failed = Some(e.to_string());
                }
            }
        }
        gens[i].restore_grammar(rec.grammar.take());
        settled.push(rec);
    }
    drafted?;
    for ((rec, t), &(i, _)) in settled.into_iter().zip(taken).zip(rounds) {
        let k = rec.drafts.len();
        if k == 0 {
            gens[i].untake_round(t.current, t.hidden, t.state);
            out.push(None);
            continue;
        }
        let drafts =
            mlx::concatenate(&rec.drafts.iter().collect::<Vec<_>>(), 0)?.astype(Dtype::I32)?;
        let cur = t.current.tokens.reshape(&[1])?.astype(Dtype::I32)?;
        let tokens = mlx::concatenate(&[&cur, &drafts], 0)?.reshape(&[1, k as i32 + 1])?;
        out.push(Some(Proposal {
            start: gens[i].position(),
            current: t.current,
            qs: rec.qs,
            drafts,
            tokens,
            k,
            state: t.state,
            masks: rec.masks,
            failed: rec.failed,
        }));
    }
    Ok(out)
}
