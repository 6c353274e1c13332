//! A speculative round's data, between the phases of a step (docs/MODELS.md §4).
//!
//! A round of depth `k`: the drafter proposes `d1..dk`, each drawn from its distribution `q`
//! under the request's sampler options with penalties extended by the drafts before it (or
//! looked up, a point mass); one target forward over `[current, d1..dk]` gives the target
//! distributions `p`; draft `i` is accepted with probability `min(1, p(di) / q(di))`, the
//! first rejected position is resampled from `normalise(max(p − q, 0))`, and when every draft
//! is accepted a bonus token comes from the last row. The whole verdict is one lazy graph, read
//! back with every other row's in one evaluation. Greedy decoding is the special case where `p`
//! and `q` are point masses, so acceptance is exact match.

use crate::generation::Result;
use grammar::Allowed;
use mlx::{Array, Dtype};
use models::draft::DraftState;
use sample::{Distribution, Sampled, Sampler, TopLogprobs};

/// A round's drafts, waiting for the target's verify forward.
pub(crate) struct Proposal {
    /// The pending token the drafts follow.
    pub current: Sampled,
    /// The drafter's distribution at each draft.
    pub qs: Vec<Distribution>,
    /// `[k]` int32 drafts.
    pub drafts: Array,
    /// `[1, k+1]`: the pending token and the drafts, for the target.
    pub tokens: Array,
    pub k: usize,
    pub state: DraftState,
    /// Tokens the target held before the round.
    pub start: usize,
    /// Structured output: the grammar's allowed tokens at each position of the block (after
    /// the pending token and each draft), `k + 1` of them.
    pub masks: Option<Vec<Allowed>>,
    /// The grammar failed while the drafts were made: the round fails this sequence alone.
    pub failed: Option<String>,
}

/// A round's accept/reject decisions, replacement tokens and log-probabilities, not yet read.
pub(crate) struct Verdict {
    /// `[k]` bool: draft `j` accepted (given the ones before it were).
    pub accept: Array,
    /// `[k]`: the token that replaces draft `j` if it is the first one rejected.
    pub resampled: Array,
    /// `[1]`: the token after a fully accepted block.
    pub bonus: Array,
    /// The pending token the drafts followed, as int32.
    pub current: Array,
    /// When the request asks for log-probabilities: those of each row's candidates.
    pub logprobs: Option<RoundLogprobs>,
}

/// Log-probabilities under the target's (masked) logits at each row of the verify block: row
/// `j` is the distribution of the token after block position `j`.
pub(crate) struct RoundLogprobs {
    /// `[k+1]`: of `d(j+1)` at rows `j < k`, of the bonus at row `k`.
    pub drafted: Array,
    /// `[k+1]`: of the resampled token at rows `j < k`, of the bonus at row `k`.
    pub resampled: Array,
    /// `[k+1, K]` alternatives per row.
    pub top: Option<TopLogprobs>,
}

impl Verdict {
    /// Every array to read, for one evaluation.
    pub fn arrays(&self) -> Vec<&Array> {
        let mut v = vec![&self.accept, &self.resampled, &self.bonus, &self.current];
        if let Some(lp) = &self.logprobs {
            v.push(&lp.drafted);
            v.push(&lp.resampled);
            if let Some(t) = &lp.top {
                v.push(&t.ids);
                v.push(&t.logprobs);
            }
        }
        v
    }
}

/// A round's verdict as a graph: the target's distributions over the block from its `logits`
/// `[k+1, V]` (grammar masks added), then the acceptance of each draft, the resampled tokens
/// and the bonus, drawn with the slot's key stream.
pub(crate) fn verdict(
    sampler: &mut Sampler,
    slot: usize,
    proposal: &Proposal,
    logits: &Array,
) -> Result<Verdict> {
    if let Some(e) = &proposal.failed {
        return Err(grammar::GrammarError::Matcher(e.clone()).into());
    }
    let (k, drafts) = (proposal.k, &proposal.drafts);
    let v = *logits.shape().last().unwrap_or(&0);
    let mut logits = logits.reshape(&[k as i32 + 1, v])?.astype(Dtype::F32)?;
    if let Some(masks) = &proposal.masks {
        let bias: Vec<f32> = masks.iter().flat_map(|m| m.bias(v as usize)).collect();
        logits = logits.add(&Array::from_slice(&bias, &[k as i32 + 1, v])?)?;
    }
    let p = sampler.distribution(slot, &logits, Some(drafts))?;
    let q = Distribution::concat(&proposal.qs.iter().collect::<Vec<_>>())?;
    let p_rows = p.slice_rows(0, k as i32)?;
    let pd = p_rows.prob_of(drafts)?;
    let qd = q.prob_of(drafts)?;
    let ratio = pd.divide(&qd.maximum_scalar(1e-30)?)?.minimum_scalar(1.0)?;
    let accept = sampler.bernoulli(slot, &ratio)?;
    let resampled = sampler.sample_distribution(slot, &Distribution::residual(&p_rows, &q)?)?;
    let bonus = sampler.sample_distribution(slot, &p.slice_rows(k as i32, k as i32 + 1)?)?;
    let opts = sampler.options(slot)?;
    let logprobs = if opts.logprobs {
        let drafted = mlx::concatenate(&[&drafts.astype(Dtype::I32)?, &bonus], 0)?;
        let resampled = mlx::concatenate(&[&resampled, &bonus], 0)?;
        let (mut chosen, top) =
            sample::logprobs(&logits, &[&drafted, &resampled], opts.top_logprobs)?;
        let resampled = chosen.pop();
        let drafted = chosen.pop();
        match (drafted, resampled) {
            (Some(drafted), Some(resampled)) => Some(RoundLogprobs {
                drafted,
                resampled,
                top,
            }),
            _ => None,
        }
    } else {
        None
    };
    Ok(Verdict {
        accept,
        resampled,
        bonus,
        current: proposal.current.tokens.astype(Dtype::I32)?,
        logprobs,
    })
}

/// A read verdict: how many drafts were accepted and the token that follows them.
pub(crate) struct Outcome {
    pub current: u32,
    pub drafts: Vec<u32>,
    pub accepted: usize,
    pub next: u32,
}

impl Verdict {
    /// Reads the (evaluated) verdict.
    pub fn read(&self, drafts: &Array) -> Result<Outcome> {
        let current = self.current.to_vec::<i32>()?[0] as u32;
        let drafts: Vec<u32> = drafts
            .to_vec::<i32>()?
            .into_iter()
            .map(|t| t as u32)
            .collect();
        let k = drafts.len();
        let accepted = self
            .accept
            .to_vec::<bool>()?
            .iter()
            .take_while(|&&a| a)
            .count();
        let next = if accepted < k {
            self.resampled.to_vec::<i32>()?[accepted] as u32
        } else {
            self.bonus.to_vec::<i32>()?[0] as u32
        };
        Ok(Outcome {
            current,
            drafts,
            accepted,
            next,
        })
    }

    /// The sampled view of block row `j`'s token, as a plain step would have returned it: the
    /// accepted draft `d(j+1)` when `drafted`, else the token that replaced it (the resampled
    /// one, or the bonus at the last row); `None` when no log-probabilities were asked for.
    pub fn row(&self, token: u32, j: usize, drafted: bool) -> Result<Option<Sampled>> {
        let Some(lp) = &self.logprobs else {
            return Ok(None);
        };
        let one = |a: &Array| a.slice_axis(0, j as i32, Some(j as i32 + 1));
        let from = if drafted { &lp.drafted } else { &lp.resampled };
        Ok(Some(Sampled {
            tokens: Array::from_slice(&[token as i32], &[1])?,
            logprobs: Some(one(from)?),
            top: match &lp.top {
                Some(t) => Some(TopLogprobs {
                    ids: one(&t.ids)?,
                    logprobs: one(&t.logprobs)?,
                }),
                None => None,
            },
        }))
    }
}
