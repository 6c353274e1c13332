//! Drafters for speculative decoding, behind one trait ([`Drafter`]).
//!
//! A drafter proposes tokens that the target then verifies in one forward pass
//! (docs/MODELS.md §4). Four kinds live in this crate, each beside its model: the gemma4
//! assistant (reads the target's caches, keeps none), GLM's MTP layer (one latent cache, fed a
//! target hidden state with each token), a separate small model with the target's tokenizer
//! (its own caches), and prompt lookup ([`ngram::Ngram`]: no model at all). The runner drives
//! them through this trait only; it never names a concrete drafter or model type.
//!
//! What the runner and a drafter each own: the drafter runs its network (or its lookup) and
//! keeps its per-sequence [`DraftState`] in step with the target; the runner owns sampling and
//! grammars, so every draft is drawn through [`Draws`], which applies the request's sampler
//! options, penalties and grammar to the drafter's logits (or vets a looked-up token).

mod lockstep;
pub mod ngram;
mod separate;

pub(crate) use lockstep::{last_positions, lockstep, Feed};
pub use separate::SeparateModel;

use crate::{CausalLm, Result};
use cache::LayerCache;
use mlx::Array;

/// One sequence's drafting state: the drafter's own caches and how far they follow the target.
pub struct DraftState {
    /// The drafter's own caches (none for the assistant and prompt lookup); they go to the
    /// prefix cache beside the target's.
    pub caches: Vec<LayerCache>,
    /// Target positions the drafter has taken in (tokens for a separate model; for GLM's MTP
    /// layer, pairs: position `i` pairs token `i + 1` with the target's hidden state at `i`).
    pub(crate) covered: usize,
    /// Target hidden states of positions `covered..` not yet taken in (GLM's MTP layer).
    pub(crate) backlog: Vec<Array>,
}

impl DraftState {
    /// A state whose caches hold the first `covered` target positions.
    pub fn new(caches: Vec<LayerCache>, covered: usize) -> DraftState {
        DraftState {
            caches,
            covered,
            backlog: Vec::new(),
        }
    }
}

/// What the target just took in, for [`Drafter::observe`].
pub enum Observed<'a> {
    /// A prefill chunk: `committed` is every token the target now holds, `hidden` the final
    /// hidden states of the chunk's positions `[1, l, H]`.
    Prefill {
        committed: &'a [u32],
        hidden: &'a Array,
    },
    /// A plain decode step fed one token; `hidden` is its final hidden state `[1, 1, H]`.
    Decode { hidden: &'a Array },
}

/// One sequence's part in a drafting round.
pub struct DraftRow<'a> {
    /// The sequence's identity in packed forward passes ([`crate::PackedRow::seq`]): the other
    /// ranks of a split model know its caches by it.
    pub seq: u64,
    pub state: &'a mut DraftState,
    /// The target's caches, holding exactly `committed`.
    pub target: &'a [LayerCache],
    /// The tokens the target holds.
    pub committed: &'a [u32],
    /// The token sampled after them and not yet fed, `[1, 1]` int32 (possibly not yet read).
    pub pending: &'a Array,
    /// The target's final hidden state at the last committed position (the one that produced
    /// `pending`), `[1, 1, H]`; present when [`Drafter::needs_hidden`].
    pub hidden: Option<&'a Array>,
    /// Drafts to make at most.
    pub depth: usize,
}

/// How drafts are drawn: the runner's sampler and grammar, which this crate knows nothing of.
pub trait Draws {
    /// Draws the next draft of each of `rows` (indices into the round's rows) from the
    /// drafter's logits at their last positions, `[rows.len(), V]`; returns each draft as `[1]`
    /// int32 (possibly not yet read), in order.
    fn sample(&mut self, rows: &[usize], logits: &Array) -> Result<Vec<Array>>;
    /// Proposes `token` as row `row`'s next draft, a certain one (a point mass); `false` when it
    /// may not be proposed (a grammar forbids it), which ends the row's drafts.
    fn propose(&mut self, row: usize, token: u32) -> Result<bool>;
}

/// How a round ended, for [`Drafter::accept`].
pub struct RoundEnd<'a> {
    /// Tokens the target held before the round.
    pub start: usize,
    /// Drafts the round verified.
    pub depth: usize,
    /// Of which the target accepted this many; the target now holds `start + accepted + 1`
    /// (the pending token and the accepted drafts).
    pub accepted: usize,
    /// The target's final hidden states over the kept positions, `[1, accepted + 1, H]`.
    pub hidden: &'a Array,
}

/// A drafter: proposes tokens for the target to verify.
pub trait Drafter {
    fn name(&self) -> &'static str;

    /// The drafter's own caches for one sequence whose target caches are `target` (they are
    /// stored and restored with the target's).
    fn make_caches(&self, target: &[LayerCache]) -> Vec<LayerCache>;

    /// One sequence's caches after one position, for the memory plan: what a position costs
    /// the drafter. Built as a graph, not evaluated.
    fn probe_caches(&self, target: &[LayerCache]) -> Result<Vec<LayerCache>>;

    /// Whether a round needs the target's hidden state at the last committed position.
    fn needs_hidden(&self) -> bool {
        false
    }

    /// Positions fewer than the prefix cache matched that a restored sequence should start
    /// from (GLM's MTP row at the last stored position pairs it with the stored sequence's next
    /// token, which a new prompt need not share).
    fn restore_margin(&self) -> usize {
        0
    }

    /// The target took in a prefill chunk or a decode step.
    fn observe(&self, _state: &mut DraftState, _seen: Observed<'_>) -> Result<()> {
        Ok(())
    }

    /// Committed positions the drafter has yet to take in: a round's usual one or two, or many
    /// after plain steps, when the round pays for catching up as well.
    fn lag(&self, _state: &DraftState, _committed: usize) -> usize {
        0
    }

    /// The lag a round takes in in its ordinary course, with rounds at most `max_depth` deep;
    /// past it a round's time is not the price of its depth.
    fn ordinary_lag(&self, _max_depth: usize) -> usize {
        2
    }

    /// Keeps the state bounded while no round drafts (called before each step).
    fn maintain(&self, _state: &mut DraftState, _committed: &[u32]) -> Result<()> {
        Ok(())
    }

    /// Takes in every committed position it can, before the caches go to the prefix cache.
    fn settle(&self, _state: &mut DraftState, _committed: &[u32]) -> Result<()> {
        Ok(())
    }

    /// Drafts for every row at once, up to its depth; each draft is drawn or proposed through
    /// `draws`, in order. A row may end with fewer drafts than its depth (a lookup that found
    /// fewer, a grammar that forbade one).
    fn propose(&self, rows: &mut [DraftRow<'_>], draws: &mut dyn Draws) -> Result<()>;

    /// The target verified a round: keep what it committed.
    fn accept(&self, _state: &mut DraftState, _round: &RoundEnd<'_>) -> Result<()> {
        Ok(())
    }
}

/// Rank 0's line to the other ranks of a split model, for a drafter split with it (the gemma4
/// assistant, whose layers read the target's caches: each rank its own heads of them, or its
/// own stage's).
pub trait DraftPeers {
    /// One pass of the drafter's split layers: tells the other ranks to run their part over
    /// `rows` (each row's sequence and the positions its target caches hold on rank 0) with
    /// `input` (`[1, R, H]`), then runs `own` (this rank's share, summing with theirs). An
    /// error is a lost rank.
    fn pass(
        &self,
        rows: &[(u64, usize)],
        input: &Array,
        own: &mut dyn FnMut() -> Result<Array>,
    ) -> Result<Array>;
}

/// A split drafter's share on a rank that follows rank 0: runs each pass rank 0's drafter
/// makes ([`DraftPeers::pass`]) over this rank's caches of the same sequences.
pub trait DraftFollower {
    /// `input` (`[1, R, H]`) through this rank's share of the layers, row `i` reading
    /// `targets[i]` (this rank's target caches of the row's sequence).
    fn pass(&self, input: &Array, targets: &[&[LayerCache]]) -> Result<()>;
}

/// How to load a drafter from a checkpoint for a target.
#[derive(Debug, Clone, Copy)]
pub struct DraftOptions {
    pub dtype: crate::DtypeChoice,
    /// How the drafter's caches store keys and values.
    pub cache_format: mlx::RowFormat,
    /// Drafts a separate model writes into its rotating caches before they are rewound: the
    /// deepest round.
    pub slack: usize,
    pub position: crate::gemma4_assistant::QueryPosition,
}

/// A model's fresh caches after one token: what a position costs a drafter that is a model
/// with caches of its own.
pub(crate) fn probe_model(m: &dyn CausalLm) -> Result<Vec<LayerCache>> {
    let mut caches = m.make_caches();
    let token = Array::from_slice(&[0i32], &[1, 1])?;
    m.forward(&token, &mut caches)?;
    Ok(caches)
}
