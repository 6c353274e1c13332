//! Prompt lookup (`--draft ngram`): drafts from the sequence's own context, no model needed.
//!
//! The last `n` tokens (the pending one included) are looked for earlier in the context, for
//! `n` from [`Ngram::max`] down to [`Ngram::min`]; the most recent earlier occurrence of the
//! longest one that occurs proposes the tokens that followed it. Where the match runs into the
//! end of the context (a span that repeats with a period shorter than the depth), the copy goes
//! on over what it has just proposed, so a loop drafts to full depth. Strong wherever an answer
//! copies its input (code edits, quotes, JSON echoed back) or repeats itself; elsewhere it finds
//! nothing (the row decodes plainly) or proposes what verification rejects, and the depth
//! controller learns to stop asking.
//!
//! A looked-up draft is certain: the drafter's distribution is a point mass on it, so under
//! sampling it is accepted with the target's probability of it and a rejection resamples from
//! the target's distribution without it, which keeps the target's distribution exactly.

use super::{DraftRow, Drafter, Draws};
use crate::Result;
use cache::LayerCache;

pub struct Ngram {
    /// The shortest suffix that may propose.
    pub min: usize,
    /// The longest suffix looked for.
    pub max: usize,
}

impl Default for Ngram {
    fn default() -> Ngram {
        Ngram { min: 2, max: 5 }
    }
}

impl Ngram {
    /// Up to `depth` tokens that followed the latest earlier occurrence of the longest suffix of
    /// `context` (at least `min` tokens long) that occurs earlier.
    pub fn lookup(&self, context: &[u32], depth: usize) -> Vec<u32> {
        let len = context.len();
        if depth == 0 {
            return Vec::new();
        }
        for n in (self.min.max(1)..=self.max).rev() {
            if n >= len {
                continue;
            }
            let suffix = &context[len - n..];
            // Latest start `i` of an earlier occurrence (it must end before the suffix's end).
            let Some(i) = (0..len - n).rev().find(|&i| &context[i..i + n] == suffix) else {
                continue;
            };
            let mut out = Vec::with_capacity(depth);
            for j in 0..depth {
                let at = i + n + j;
                // Positions past the context continue over what was just proposed.
                let t = if at < len { context[at] } else { out[at - len] };
                out.push(t);
            }
            return out;
        }
        Vec::new()
    }
}

impl Drafter for Ngram {
    fn name(&self) -> &'static str {
        "prompt lookup"
    }

    fn make_caches(&self, _target: &[LayerCache]) -> Vec<LayerCache> {
        Vec::new()
    }

    fn probe_caches(&self, _target: &[LayerCache]) -> Result<Vec<LayerCache>> {
        Ok(Vec::new())
    }

    fn propose(&self, rows: &mut [DraftRow<'_>], draws: &mut dyn Draws) -> Result<()> {
        let pending: Vec<&mlx::Array> = rows.iter().map(|r| r.pending).collect();
        mlx::eval(&pending)?;
        for (i, r) in rows.iter().enumerate() {
            let mut context = Vec::with_capacity(r.committed.len() + 1);
            context.extend_from_slice(r.committed);
            context.push(r.pending.to_vec::<i32>()?[0] as u32);
            for t in self.lookup(&context, r.depth) {
                if !draws.propose(i, t)? {
                    break;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_latest_match_proposes_what_followed() {
        let g = Ngram::default();
        // "1 2 3" occurs twice earlier; the later one (followed by 9) wins.
        assert_eq!(
            g.lookup(&[1, 2, 3, 4, 1, 2, 3, 9, 5, 1, 2, 3], 2),
            vec![9, 5]
        );
        // A longer match beats a later shorter one: "7 1 2 3" is followed by 4.
        assert_eq!(
            g.lookup(&[7, 1, 2, 3, 4, 1, 2, 3, 8, 7, 1, 2, 3], 1),
            vec![4]
        );
        // Nothing repeats: nothing is proposed; a single token never proposes at min 2.
        assert!(g.lookup(&[1, 2, 3, 4, 5], 3).is_empty());
        assert!(g.lookup(&[5, 1, 2, 5], 3).is_empty());
        assert!(g.lookup(&[1, 1], 0).is_empty());
    }

    #[test]
    fn a_loop_drafts_to_full_depth() {
        let g = Ngram::default();
        assert_eq!(g.lookup(&[8, 1, 2, 1, 2], 5), vec![1, 2, 1, 2, 1]);
        assert_eq!(g.lookup(&[3, 3, 3], 4), vec![3, 3, 3, 3]);
    }
}
