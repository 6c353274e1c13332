//! A separate small model with the target's tokenizer as the drafter: its own caches, kept in
//! step with the target's tokens during prefill and caught up lazily, in the round's first
//! pass, with tokens the target decoded plainly.

use super::lockstep::{last_positions, lockstep, Feed};
use super::{probe_model, DraftRow, DraftState, Drafter, Draws, Observed, RoundEnd};
use crate::{CausalLm, PackedRow, Result};
use cache::LayerCache;
use mlx::{Array, Dtype};

pub struct SeparateModel {
    model: Box<dyn CausalLm>,
}

impl SeparateModel {
    pub fn new(model: Box<dyn CausalLm>) -> SeparateModel {
        SeparateModel { model }
    }

    /// Feeds the drafter every committed token it lacks.
    fn catch_up(&self, state: &mut DraftState, committed: &[u32]) -> Result<()> {
        if state.covered >= committed.len() {
            return Ok(());
        }
        let toks = tokens(&committed[state.covered..])?;
        self.model.forward(&toks, &mut state.caches)?;
        state.covered = committed.len();
        Ok(())
    }
}

fn tokens(ids: &[u32]) -> Result<Array> {
    let v: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
    Ok(Array::from_slice(&v, &[1, v.len() as i32])?)
}

impl Drafter for SeparateModel {
    fn name(&self) -> &'static str {
        "separate model"
    }

    fn make_caches(&self, _target: &[LayerCache]) -> Vec<LayerCache> {
        self.model.make_caches()
    }

    fn probe_caches(&self, _target: &[LayerCache]) -> Result<Vec<LayerCache>> {
        probe_model(self.model.as_ref())
    }

    fn observe(&self, state: &mut DraftState, seen: Observed<'_>) -> Result<()> {
        match seen {
            // In lockstep during prefill, so that prefix-cache snapshots see both at one offset.
            Observed::Prefill { committed, .. } => self.catch_up(state, committed),
            Observed::Decode { .. } => Ok(()),
        }
    }

    fn lag(&self, state: &DraftState, committed: usize) -> usize {
        committed.saturating_sub(state.covered)
    }

    fn propose(&self, rows: &mut [DraftRow<'_>], draws: &mut dyn Draws) -> Result<()> {
        // Each row's first pass: the committed tokens it lacks, then the pending token.
        let mut first = Vec::with_capacity(rows.len());
        for r in rows.iter() {
            let pending = r.pending.reshape(&[1, 1])?.astype(Dtype::I32)?;
            let tokens = if r.state.covered < r.committed.len() {
                mlx::concatenate(&[&tokens(&r.committed[r.state.covered..])?, &pending], 1)?
            } else {
                pending
            };
            first.push(Feed {
                tokens,
                hidden: None,
            });
        }
        // The last draft of each row is drawn but not fed: the drafter holds the pending token
        // and d1..d(k-1); the round keeps what was committed.
        let m = self.model.as_ref();
        let mut pass = |rows: &mut [DraftRow<'_>],
                        active: &[usize],
                        toks: &Array,
                        _: Option<&Array>,
                        lens: &[usize]| {
            let mut by_row: Vec<Option<&mut DraftRow<'_>>> = rows.iter_mut().map(Some).collect();
            let mut packed = Vec::with_capacity(active.len());
            for (&i, &len) in active.iter().zip(lens) {
                let r = by_row[i].take().ok_or_else(|| {
                    crate::ModelError::Invalid("a row twice in one drafting pass".into())
                })?;
                r.state.covered += len;
                packed.push(PackedRow::text(len, &mut r.state.caches));
            }
            let hidden = m.forward_packed(toks, &mut packed)?;
            let ends = last_positions(lens);
            let last = hidden.take(&Array::from_slice(&ends, &[ends.len() as i32])?, 1)?;
            let logits = m.logits(&last)?;
            let v = *logits.shape().last().unwrap_or(&0);
            Ok((logits.reshape(&[lens.len() as i32, v])?, None))
        };
        lockstep(rows, first, draws, &mut pass)
    }

    fn accept(&self, state: &mut DraftState, round: &RoundEnd<'_>) -> Result<()> {
        // The drafter holds the pending token and d1..d(k-1): keep what was committed.
        let keep = round.start + round.depth.min(round.accepted + 1);
        let excess = state.covered.saturating_sub(keep);
        if state
            .caches
            .iter_mut()
            .try_for_each(|c| c.rewind(excess))
            .is_ok()
        {
            state.covered -= excess;
        } else {
            // History past the window is gone: start the drafter over; it catches up with the
            // committed tokens in one batch next round.
            state.caches = self.model.make_caches();
            state.covered = 0;
        }
        Ok(())
    }
}
