//! One sequence's generation on the engine thread: chunked prefill, then decoding, either one
//! token per step (pipelined: the next step is dispatched before the current token is read, so
//! the device never waits on the host) or in speculative rounds ([`crate::speculate`]).
//!
//! A [`Generation`] holds only per-sequence state; the model, drafter and sampler are passed
//! into each call (the engine owns them). [`step_together`] steps many sequences in one forward
//! pass; [`Generation::step`] is the same step for one. It deals in token ids only: text is
//! [`crate::text`]'s job, off the engine thread.

use crate::depth::DepthController;
use crate::protocol::{DoneReason, Stats};
use crate::speculate::{DraftModel, DraftState, Proposal, Verdict};
use cache::prefix::CacheCheckpoint;
use cache::LayerCache;
use mlx::Array;
use models::CausalLm;
use sample::{Options, Sampled, Sampler};
use std::collections::VecDeque;
use std::time::Instant;

#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    /// The request cannot be served as asked (answer 400).
    #[error("{0}")]
    BadRequest(String),
    #[error(transparent)]
    Model(#[from] models::ModelError),
    #[error(transparent)]
    Sample(#[from] sample::SampleError),
    #[error(transparent)]
    Cache(#[from] cache::CacheError),
    #[error(transparent)]
    Mlx(#[from] mlx::Error),
    #[error(transparent)]
    Grammar(#[from] grammar::GrammarError),
}

pub type Result<T> = std::result::Result<T, GenerateError>;

/// Committed tokens a drafter may lag behind at a round's start in the ordinary course (the
/// pending token, the last draft); more, and the round's time is not its depth's price.
const ROUND_LAG: usize = 2;

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerationParams {
    pub prompt: Vec<u32>,
    pub options: Options,
    /// `None`: until EOS, a stop string or the context limit.
    pub num_predict: Option<usize>,
    /// Positions this sequence may use (prompt plus generated tokens).
    pub num_ctx: usize,
    /// Tokens per prefill forward pass.
    pub prefill_chunk: usize,
    /// Token ids that end generation (not emitted).
    pub eos: Vec<u32>,
    /// Prompt positions at which to snapshot the rotating caches during prefill (for the prefix
    /// cache; empty when the model has none).
    pub checkpoints: Vec<usize>,
    /// Snapshot the rotating caches every this many positions while generating too, so that a
    /// later prompt that leaves this answer part-way (a re-rendered or edited answer) resumes
    /// near where it leaves; `None` when the model has no rotating caches.
    pub snapshot_every: Option<usize>,
    /// Structured output: the grammar every generated token must keep to.
    pub constraint: Option<Box<grammar::Constraint>>,
}

/// The borrowed pieces a generation runs on.
pub struct Ctx<'a> {
    pub model: &'a dyn CausalLm,
    pub sampler: &'a mut Sampler,
    /// The drafter and its depth controller, when speculation is on.
    pub draft: Option<(&'a DraftModel, &'a mut DepthController)>,
}

impl<'a> Ctx<'a> {
    pub fn new(model: &'a dyn CausalLm, sampler: &'a mut Sampler) -> Ctx<'a> {
        Ctx {
            model,
            sampler,
            draft: None,
        }
    }
}

/// A token's logprob and the most likely alternatives, as ids (text is added off-engine).
#[derive(Debug, Clone, PartialEq)]
pub struct RawLogprob {
    pub logprob: f32,
    /// Sorted by logprob, descending.
    pub top: Vec<(u32, f32)>,
}

/// One step's outcome.
#[derive(Debug, Clone)]
pub enum Event {
    Token {
        id: u32,
        logprob: Option<RawLogprob>,
    },
    /// Generation ended: EOS (`Stop`), a limit (`Length`) or cancellation.
    Done { reason: DoneReason, stats: Stats },
}

/// A finished speculative round, for metrics.
#[derive(Debug, Clone, Copy)]
pub struct RoundReport {
    pub depth: usize,
    pub accepted: usize,
}

pub struct Generation {
    pub(crate) slot: usize,
    /// The target model's caches.
    pub(crate) caches: Vec<LayerCache>,
    /// Tokens fed through the target so far (its caches hold exactly these).
    pub(crate) fed: Vec<u32>,
    /// Next prompt position to prefill.
    prefilled: usize,
    pub(crate) generated: usize,
    pub(crate) params: GenerationParams,
    /// The last sampled token, not yet emitted nor fed.
    pub(crate) pending: Option<Sampled>,
    /// The target's final hidden state at the last fed position (the one that produced
    /// `pending`): drafters condition on it.
    pub(crate) last_hidden: Option<Array>,
    pub(crate) draft: Option<DraftState>,
    /// Tokens a speculative round produced, handed out one per step.
    pub(crate) ready: VecDeque<Event>,
    started: Instant,
    first_token_at: Option<Instant>,
    pub(crate) stats: Stats,
    pub(crate) finished: bool,
    /// Snapshots taken during prefill, by position.
    taken: Vec<(usize, CacheCheckpoint)>,
    /// Rounds finished since the engine last asked.
    pub(crate) rounds: Vec<RoundReport>,
    /// A seeded sampling request's own depth controller (reproducible depths); `None`: the
    /// engine's shared one.
    pub(crate) own_depth: Option<DepthController>,
}

pub(crate) fn tokens_array(ids: &[u32]) -> Result<Array> {
    let v: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
    Ok(Array::from_slice(&v, &[1, v.len() as i32])?)
}

impl Generation {
    /// Registers the sequence with fresh caches. Prefill happens in [`Generation::step`], a
    /// chunk per call, so an engine can interleave it with other sequences' decoding.
    pub fn new(ctx: &mut Ctx<'_>, slot: usize, params: GenerationParams) -> Result<Generation> {
        let mut caches = ctx.model.make_caches();
        if let Some((d, _)) = &ctx.draft {
            caches.extend(d.make_caches(&caches));
        }
        Self::with_caches(ctx, slot, params, caches, 0)
    }

    /// As [`Generation::new`], with caches (the target's, then the drafter's own) that already
    /// hold the first `cached` prompt tokens (a prefix-cache hit); at least the last prompt token
    /// is always evaluated.
    pub fn with_caches(
        ctx: &mut Ctx<'_>,
        slot: usize,
        params: GenerationParams,
        mut caches: Vec<LayerCache>,
        cached: usize,
    ) -> Result<Generation> {
        let n = params.prompt.len();
        if n == 0 {
            return Err(GenerateError::BadRequest("prompt is empty".into()));
        }
        if n >= params.num_ctx {
            return Err(GenerateError::BadRequest(format!(
                "prompt of {n} tokens does not fit the context of {} tokens",
                params.num_ctx
            )));
        }
        if cached >= n {
            return Err(GenerateError::BadRequest(
                "a cached prefix must leave a token to evaluate".into(),
            ));
        }
        // Logprobs are reported for plain decoding only: drafting is off for such requests.
        let draft = match &ctx.draft {
            Some((d, _)) if !params.options.logprobs => {
                let own = caches.split_off(ctx.model_caches_len());
                Some(DraftState::new(d, own, cached))
            }
            _ => {
                caches.truncate(ctx.model_caches_len());
                None
            }
        };
        let own_depth = match (&draft, &ctx.draft) {
            (Some(_), Some((_, c))) if params.options.seeded_sampling() => {
                Some(c.for_seeded_request())
            }
            _ => None,
        };
        ctx.sampler.add(slot, &params.options, &params.prompt)?;
        Ok(Generation {
            own_depth,
            slot,
            caches,
            fed: params.prompt[..cached].to_vec(),
            prefilled: cached,
            generated: 0,
            pending: None,
            last_hidden: None,
            draft,
            ready: VecDeque::new(),
            started: Instant::now(),
            first_token_at: None,
            stats: Stats {
                prompt_eval_count: n,
                cached_tokens: cached,
                ..Stats::default()
            },
            finished: false,
            taken: Vec::new(),
            rounds: Vec::new(),
            params,
        })
    }

    /// Where the next prefill chunk ends, taking at most `budget` tokens: a chunk ends where a
    /// snapshot is due.
    fn chunk_end(&self, budget: usize) -> usize {
        let at = self.prefilled;
        let n = self.params.prompt.len();
        let end = (at + budget.max(1)).min(n);
        match self.params.checkpoints.iter().find(|&&p| p > at && p < end) {
            Some(&cp) => cp,
            None => end,
        }
    }

    /// Records that the prefill chunk `prefilled..end` went through the target.
    fn advance(&mut self, end: usize) {
        let chunk = &self.params.prompt[self.prefilled..end];
        self.fed.extend_from_slice(chunk);
        self.prefilled = end;
    }

    /// Takes the snapshot due at the end of a prefill chunk (every cache caught up); returns
    /// whether the chunk ended the prompt.
    fn chunk_checkpoint(&mut self) -> bool {
        let end = self.prefilled;
        if self.params.checkpoints.contains(&end) {
            let mut all = self.caches.clone();
            if let Some(d) = &self.draft {
                all.extend(d.caches.iter().cloned());
            }
            self.taken.push((end, CacheCheckpoint::of(&all)));
        }
        let last = end == self.params.prompt.len();
        if last {
            // The end of the prompt is where generation's snapshots start counting from.
            self.snapshot_generated();
        }
        last
    }

    /// Every cache (the target's, then the drafter's), the tokens they all hold, and the
    /// snapshots taken on the way (for the prefix cache once the sequence ends).
    pub fn into_parts(self) -> (Vec<LayerCache>, Vec<u32>, Vec<(usize, CacheCheckpoint)>) {
        let mut caches = self.caches;
        if let Some(d) = self.draft {
            caches.extend(d.caches);
        }
        (caches, self.fed, self.taken)
    }

    pub fn slot(&self) -> usize {
        self.slot
    }

    pub fn is_finished(&self) -> bool {
        self.finished
    }

    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// Speculative rounds finished since the last call.
    pub fn take_rounds(&mut self) -> Vec<RoundReport> {
        std::mem::take(&mut self.rounds)
    }

    /// Whether the prompt is still being prefilled.
    pub fn prefilling(&self) -> bool {
        self.prefilled < self.params.prompt.len()
    }

    /// Tokens that may still be emitted, counting the pending one.
    pub(crate) fn remaining(&self) -> usize {
        self.params
            .num_predict
            .map_or(usize::MAX, |n| n.saturating_sub(self.generated))
    }

    /// Whether one more token may be fed after the one now pending.
    fn may_continue(&self) -> bool {
        self.remaining() > 1 && self.fed.len() + 1 < self.params.num_ctx
    }

    fn logprob(&self, s: &Sampled) -> Result<Option<RawLogprob>> {
        let Some(lp) = &s.logprobs else {
            return Ok(None);
        };
        let logprob = lp.to_vec::<f32>()?[0];
        let want = self.params.options.top_logprobs.max(0) as usize;
        let mut top = Vec::new();
        if let (Some(t), true) = (&s.top, want > 0) {
            let ids = t.ids.to_vec::<i32>()?;
            let vals = t.logprobs.to_vec::<f32>()?;
            top = ids.into_iter().map(|i| i as u32).zip(vals).collect();
            top.sort_by(|a, b| b.1.total_cmp(&a.1));
            top.truncate(want);
        }
        Ok(Some(RawLogprob { logprob, top }))
    }

    /// Counts an emitted token; returns the end event when it is EOS.
    pub(crate) fn emit(
        &mut self,
        ctx: &mut Ctx<'_>,
        id: u32,
        logprob: Option<RawLogprob>,
    ) -> Event {
        if self.first_token_at.is_none() {
            let now = Instant::now();
            self.stats.prompt_eval_ns = (now - self.started).as_nanos() as u64;
            self.first_token_at = Some(now);
        }
        // EOS ends the sequence without being counted (it is neither streamed nor part of
        // `EvalCount`, and does not use up `num_predict`), as in ollama's runner.
        if self.params.eos.contains(&id) {
            return self.finish(ctx, DoneReason::Stop);
        }
        self.generated += 1;
        self.stats.eval_count = self.generated;
        Event::Token { id, logprob }
    }

    /// Does the next piece of work: a prefill chunk (returns `None`), a decode step or a
    /// speculative round (returns the next token, or the end). After `Done` the sampler slot is
    /// released and further calls return `None`.
    pub fn step(&mut self, ctx: &mut Ctx<'_>) -> Result<Option<Event>> {
        if let Some(e) = self.ready.pop_front() {
            return Ok(Some(e));
        }
        if self.finished {
            return Ok(None);
        }
        if !self.prefilling() && self.pending.is_none() {
            // The previous token was the last one a limit allowed.
            return Ok(Some(self.finish(ctx, DoneReason::Length)));
        }
        // One sequence is a batch of one: the same step the engine runs for many.
        let budget = self.params.prefill_chunk;
        let step = step_together(ctx, &mut [self], budget)?;
        step.events.into_iter().next().unwrap_or(Ok(None))
    }

    /// Structured output: the additive logit bias (0 allowed, −∞ not) for the token this step
    /// samples, having taken in the token this step feeds (`fed`: none after the prompt);
    /// `None` without a constraint.
    fn grammar_bias(&mut self, fed: Option<&Sampled>, width: usize) -> Result<Option<Vec<f32>>> {
        if self.params.constraint.is_none() {
            return Ok(None);
        }
        if let Some(current) = fed {
            let id = current.tokens.to_vec::<i32>()?[0] as u32;
            if !self.grammar_take(id)? {
                // An EOS, fed before it was read (decoding is pipelined): the sequence ends at
                // it, and what this step samples is never used.
                return Ok(None);
            }
        }
        Ok(self.grammar_allowed()?.map(|a| a.bias(width)))
    }

    /// The grammar takes in a generated token; `false` (and nothing taken) for an EOS, which
    /// ends the sequence. `true` without a constraint.
    pub(crate) fn grammar_take(&mut self, id: u32) -> Result<bool> {
        if self.params.eos.contains(&id) {
            return Ok(false);
        }
        if let Some(c) = self.params.constraint.as_mut() {
            c.consume(id)?;
        }
        Ok(true)
    }

    /// The tokens the grammar allows next; `None` without a constraint.
    pub(crate) fn grammar_allowed(&mut self) -> Result<Option<grammar::Allowed>> {
        match self.params.constraint.as_mut() {
            Some(c) => Ok(Some(c.allowed()?)),
            None => Ok(None),
        }
    }

    /// Undoes the last `n` tokens the grammar took in.
    pub(crate) fn grammar_rollback(&mut self, n: usize) -> Result<()> {
        if let (Some(c), true) = (self.params.constraint.as_mut(), n > 0) {
            c.rollback(n)?;
        }
        Ok(())
    }

    /// Tells the controller that chose the depth what the round accepted. A controller of its
    /// own is untimed; the engine's is told the step's time once, by [`step_together`].
    pub(crate) fn record_depth(&mut self, ctx: &mut Ctx<'_>, depth: usize, accepted: usize) {
        if let Some(c) = &mut self.own_depth {
            c.record(depth, accepted, 0.0);
        } else if let Some((_, c)) = &mut ctx.draft {
            c.record_acceptance(depth, accepted);
        }
    }

    /// Whether its next step (a prefill chunk, a decode step or a speculative round) can share
    /// a forward pass with other sequences' ([`step_together`]): nothing queued, something to
    /// feed.
    pub fn batchable(&self) -> bool {
        !self.finished && self.ready.is_empty() && (self.prefilling() || self.pending.is_some())
    }

    /// Snapshots the rotating caches once the tokens fed pass the next multiple of
    /// `snapshot_every`, at the multiple: copies of caches past it (a speculative round that
    /// crossed it; the target, where a separate drafter trails it) are rewound to it, which a
    /// round's batched write keeps the tokens for. So snapshots sit where the disk tier's
    /// blocks end. A cache not there yet (a drafter still trailing) puts it off to a later
    /// step; one that cannot be rewound that far takes it where every cache is, if they agree.
    pub(crate) fn snapshot_generated(&mut self) {
        let Some(every) = self.params.snapshot_every else {
            return;
        };
        let pos = self.fed.len();
        let last = self.taken.last().map_or(0, |(p, _)| *p);
        if pos / every <= last / every {
            return;
        }
        let multiple = pos / every * every;
        let draft = self.draft.as_ref().map_or(&[][..], |d| &d.caches[..]);
        let all: Vec<LayerCache> = self.caches.iter().chain(draft).cloned().collect();
        let rotating = || all.iter().filter(|c| matches!(c, LayerCache::Rotating(_)));
        if rotating().any(|c| c.offset() < multiple) {
            return;
        }
        let mut back = all.clone();
        let rewound = back.iter_mut().all(|c| match c {
            LayerCache::Rotating(r) => r.rewind(r.offset() - multiple).is_ok(),
            _ => true,
        });
        if rewound {
            self.taken.push((multiple, CacheCheckpoint::of(&back)));
        } else if rotating().all(|c| c.offset() == pos) {
            self.taken.push((pos, CacheCheckpoint::of(&all)));
        }
    }

    pub(crate) fn finish(&mut self, ctx: &mut Ctx<'_>, reason: DoneReason) -> Event {
        self.finished = true;
        self.pending = None;
        let _ = ctx.sampler.remove(self.slot);
        if let Some(t) = self.first_token_at {
            self.stats.eval_ns = t.elapsed().as_nanos() as u64;
        }
        Event::Done {
            reason,
            stats: self.stats.clone(),
        }
    }

    /// Ends early (the client went away, or a stop string was seen off-engine).
    pub fn cancel(&mut self, ctx: &mut Ctx<'_>) -> Event {
        // A dispatched but unread token may still be computing; wait for it so no graph
        // outlives the caches it writes.
        if let Some(p) = &self.pending {
            let _ = p.tokens.eval();
        }
        self.ready.clear();
        self.finish(ctx, DoneReason::ConnectionClosed)
    }
}

impl Ctx<'_> {
    /// How many of a sequence's caches belong to the target.
    fn model_caches_len(&self) -> usize {
        self.model.make_caches().len()
    }
}

/// What one [`step_together`] did.
pub struct BatchStep {
    /// Each sequence's event, or its own error, in order.
    pub events: Vec<Result<Option<Event>>>,
    /// Rows and tokens the target's forward pass had.
    pub rows: usize,
    pub tokens: usize,
}

/// One step of several sequences (each [`Generation::batchable`]) in one forward pass of the
/// target, packed into one `[1, T]` row ([`CausalLm::forward_packed`], each sequence at its
/// own offset with its own caches): a decoding sequence feeds its pending token; a drafting
/// one that chooses a depth `k` drafts first and feeds its verify block `[pending, d1..dk]`
/// (each row at its own depth); a prefilling one feeds its next chunk (all chunks together at
/// most `prefill_budget` tokens, in order; a sequence left without budget sits this step out).
/// The sampler then draws, in one call (the fused path when options allow), the successor of
/// every decoding sequence and the first token of every sequence whose prompt just ended, and
/// the draws are dispatched before the pending tokens are read, as [`Generation::step`] does
/// for one; each drafting sequence accepts, rewinds and emits on its own. Depth controllers
/// are told the whole step's time, so a slower, larger batch makes drafting look dearer.
/// Returns each sequence's event (`None` for a prefill chunk, or a sequence that sat out) or
/// its own error, in order, and how many rows and tokens the forward pass had; an error of
/// the shared work (drafting, the forward pass, sampling) fails them all.
pub fn step_together(
    ctx: &mut Ctx<'_>,
    gens: &mut [&mut Generation],
    prefill_budget: usize,
) -> Result<BatchStep> {
    enum Piece {
        /// Feeds the pending token (taken) and samples its successor when it continues.
        Decode {
            current: Sampled,
            continues: bool,
        },
        /// Will draft this many tokens (becomes `Verify`).
        Draft(usize),
        /// Feeds the pending token and `k` drafts.
        Verify(Box<Proposal>),
        /// Feeds prompt tokens up to `end`.
        Prefill {
            end: usize,
        },
        Skip,
    }
    let started = Instant::now();
    let mut budget = prefill_budget.max(1);
    // Each decoding row's deepest possible round (keeping its drafter up). The rows on the
    // engine's controller share one depth per step, chosen for the deepest of their limits and
    // clamped by each one's own, so that the step's time is the price of that depth; a seeded
    // row keeps its own reproducible choice.
    let limits: Vec<usize> = gens
        .iter_mut()
        .map(|g| {
            if g.prefilling() {
                0
            } else {
                g.depth_limit(ctx)
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
    let mut pieces = Vec::with_capacity(gens.len());
    // What the step's time is the price of: the deepest round on the engine's controller, when
    // nothing else (a prefill chunk, a seeded row's deeper round) is in the step.
    let mut priced: Option<usize> = None;
    let mut unpriced = false;
    let mut own_deepest = 0;
    for (r, g) in gens.iter_mut().enumerate() {
        if g.prefilling() {
            unpriced = true;
            if budget == 0 {
                pieces.push(Piece::Skip);
                continue;
            }
            let end = g.chunk_end(budget);
            budget -= end - g.prefilled;
            pieces.push(Piece::Prefill { end });
            continue;
        }
        let depth = match g.own_choice(limits[r]) {
            Some(d) => {
                own_deepest = own_deepest.max(d);
                d
            }
            None => {
                let d = shared.min(limits[r]);
                if g.draft.is_some() {
                    priced = priced.max(Some(d));
                }
                d
            }
        };
        if depth > 0 {
            // A round that also catches the drafter up is dearer than its depth: not a price.
            if let Some((m, c)) = &ctx.draft {
                // GLM's MTP layer takes the last round's accepted drafts in at the next one.
                let ordinary = match m {
                    DraftModel::Mtp => ROUND_LAG + c.max(),
                    _ => ROUND_LAG,
                };
                unpriced |= g.drafter_lag(m) > ordinary;
            }
            pieces.push(Piece::Draft(depth));
            continue;
        }
        let Some(current) = g.pending.take() else {
            return Err(GenerateError::BadRequest(
                "a sequence without a pending token in a decode batch".into(),
            ));
        };
        let continues = g.may_continue();
        pieces.push(Piece::Decode { current, continues });
    }

    // Drafting: the drafter runs for all drafting rows at once, in lockstep, one pass per draft
    // position.
    let drafting: Vec<usize> = (0..pieces.len())
        .filter(|&i| matches!(pieces[i], Piece::Draft(_)))
        .collect();
    if !drafting.is_empty() {
        let depths: Vec<usize> = drafting
            .iter()
            .map(|&i| match pieces[i] {
                Piece::Draft(k) => k,
                _ => 0,
            })
            .collect();
        let mut rows: Vec<&mut Generation> = gens
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| drafting.contains(i))
            .map(|(_, g)| &mut **g)
            .collect();
        use crate::speculate::{
            propose_assistant_together, propose_mtp_together, propose_together,
        };
        let proposals = match &ctx.draft {
            Some((DraftModel::Model(_), _)) => propose_together(ctx, &mut rows, &depths)?,
            Some((DraftModel::Mtp, _)) => propose_mtp_together(ctx, &mut rows, &depths)?,
            Some((DraftModel::Assistant(_), _)) => {
                propose_assistant_together(ctx, &mut rows, &depths)?
            }
            None => {
                return Err(GenerateError::BadRequest(
                    "a draft round without a drafter".into(),
                ))
            }
        };
        drop(rows);
        for (&i, p) in drafting.iter().zip(proposals) {
            pieces[i] = Piece::Verify(Box::new(p));
        }
    }

    // The packed tokens, and each fed row's length.
    let mut tokens: Vec<Array> = Vec::new();
    let mut lens: Vec<Option<usize>> = Vec::with_capacity(gens.len());
    for (g, p) in gens.iter().zip(&pieces) {
        match p {
            Piece::Decode {
                current,
                continues: true,
            } => {
                tokens.push(current.tokens.reshape(&[1, 1])?);
                lens.push(Some(1));
            }
            Piece::Verify(p) => {
                tokens.push(p.tokens.clone());
                lens.push(Some(p.k + 1));
            }
            Piece::Prefill { end } => {
                tokens.push(tokens_array(&g.params.prompt[g.prefilled..*end])?);
                lens.push(Some(end - g.prefilled));
            }
            _ => lens.push(None),
        }
    }
    let rows_fed = lens.iter().flatten().count();
    let tokens_fed: usize = lens.iter().flatten().sum();
    // A row whose own work failed before the end of the step (its grammar).
    let mut row_errors: Vec<Option<GenerateError>> = (0..gens.len()).map(|_| None).collect();
    // Each fed row's hidden states `[1, len, H]`, for verification and the drafters.
    let mut row_hidden: Vec<Option<Array>> = vec![None; gens.len()];
    if rows_fed > 0 {
        let refs: Vec<&Array> = tokens.iter().collect();
        let tokens = mlx::concatenate(&refs, 1)?;
        let mut rows: Vec<models::PackedRow<'_>> = gens
            .iter_mut()
            .zip(&lens)
            .filter_map(|(g, l)| {
                l.map(|len| models::PackedRow {
                    len,
                    caches: &mut g.caches,
                })
            })
            .collect();
        let hidden = ctx.model.forward_packed(&tokens, &mut rows)?;
        drop(rows);
        // Which rows sample, and the packed position of each one's last token.
        let mut sampling: Vec<(usize, i32)> = Vec::new();
        let mut at = 0;
        for (i, (g, p)) in gens.iter_mut().zip(&pieces).enumerate() {
            let Some(len) = lens[i] else {
                continue;
            };
            let h = if rows_fed == 1 {
                hidden.clone()
            } else {
                hidden.slice_axis(1, at as i32, Some((at + len) as i32))?
            };
            at += len;
            let samples = match p {
                Piece::Decode { .. } => {
                    if let (Some(d), Some((model, _))) = (&mut g.draft, &ctx.draft) {
                        d.decoded(model, &h)?;
                    }
                    true
                }
                Piece::Prefill { end } => {
                    let chunk_at = g.prefilled;
                    g.advance(*end);
                    if let (Some(d), Some((model, _))) = (&mut g.draft, &ctx.draft) {
                        let chunk = g.params.prompt[chunk_at..*end].to_vec();
                        d.prefilled(model, &chunk, &h, &g.fed)?;
                    }
                    g.chunk_checkpoint()
                }
                Piece::Verify(_) | Piece::Draft(_) | Piece::Skip => false,
            };
            row_hidden[i] = Some(h);
            if samples {
                sampling.push((i, at as i32 - 1));
            }
        }
        let verifying = pieces.iter().any(|p| matches!(p, Piece::Verify(_)));
        if sampling.is_empty() {
            if !verifying {
                // Only prefill chunks: materialise their cache writes.
                hidden.eval()?;
            }
        } else {
            let positions: Vec<i32> = sampling.iter().map(|s| s.1).collect();
            let idx = Array::from_slice(&positions, &[positions.len() as i32])?;
            let last = hidden.take(&idx, 1)?; // [1, S, H]
            let logits = ctx.model.logits(&last)?;
            let v = logits.shape();
            let width = v[v.len() - 1];
            let mut logits = logits.reshape(&[sampling.len() as i32, width])?;
            if sampling
                .iter()
                .any(|&(i, _)| gens[i].params.constraint.is_some())
            {
                // The forward runs while the host works out the masks.
                mlx::async_eval(&[&logits])?;
                let mut bias = Vec::with_capacity(sampling.len());
                for &(i, _) in &sampling {
                    let fed = match &pieces[i] {
                        Piece::Decode { current, .. } => Some(current),
                        _ => None,
                    };
                    let row = match gens[i].grammar_bias(fed, width as usize) {
                        Ok(Some(b)) => Array::from_slice(&b, &[1, width])?,
                        Ok(None) => Array::full(&[1, width], 0.0, mlx::Dtype::F32)?,
                        Err(e) => {
                            row_errors[i] = Some(e);
                            Array::full(&[1, width], 0.0, mlx::Dtype::F32)?
                        }
                    };
                    bias.push(row);
                }
                logits = logits.add(&mlx::concatenate(&bias.iter().collect::<Vec<_>>(), 0)?)?;
            }
            let slots: Vec<usize> = sampling.iter().map(|&(i, _)| gens[i].slot).collect();
            let s = ctx.sampler.sample(&slots, &logits)?;
            // Each row's slices go into this evaluation: left lazy, they would join the next
            // step's graph, and reading a token would wait for that whole forward pass.
            let rows = (0..sampling.len())
                .map(|j| s.row(j))
                .collect::<std::result::Result<Vec<_>, _>>()?;
            mlx::async_eval(&rows.iter().flat_map(Sampled::arrays).collect::<Vec<_>>())?;
            for (j, (row, &(i, _))) in rows.into_iter().zip(&sampling).enumerate() {
                gens[i].pending = Some(row);
                gens[i].last_hidden = Some(last.slice_axis(1, j as i32, Some(j as i32 + 1))?);
            }
        }
    }

    // The verifying rows' verdicts: the target's head once over every block, each row's
    // acceptance graph on its slice.
    let mut verdicts: Vec<Option<Result<Verdict>>> = (0..gens.len()).map(|_| None).collect();
    let verifying: Vec<(usize, usize)> = pieces
        .iter()
        .enumerate()
        .filter_map(|(i, p)| match p {
            Piece::Verify(p) => Some((i, p.k + 1)),
            _ => None,
        })
        .collect();
    if !verifying.is_empty() {
        let blocks = verifying
            .iter()
            .map(|&(i, _)| {
                row_hidden[i].as_ref().ok_or_else(|| {
                    GenerateError::BadRequest("a verify block without hidden states".into())
                })
            })
            .collect::<Result<Vec<&Array>>>()?;
        let logits = ctx.model.logits(&mlx::concatenate(&blocks, 1)?)?;
        let mut at = 0;
        for &(i, len) in &verifying {
            let Piece::Verify(proposal) = &pieces[i] else {
                continue;
            };
            let l = logits.slice_axis(1, at as i32, Some((at + len) as i32))?;
            at += len;
            verdicts[i] = Some(gens[i].verdict(ctx, proposal, &l));
        }
    }
    // The pending tokens and the verdicts, read together in one evaluation.
    let mut reads: Vec<&Array> = pieces
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
    // From here on each sequence's work is its own: an error fails that sequence only.
    let mut events = Vec::with_capacity(gens.len());
    for ((((g, p), h), verdict), failed) in gens
        .iter_mut()
        .zip(pieces)
        .zip(row_hidden)
        .zip(verdicts)
        .zip(row_errors)
    {
        let finish_row = || -> Result<Option<Event>> {
            if let Some(e) = failed {
                return Err(e);
            }
            Ok(match p {
                Piece::Decode { current, continues } => {
                    let id = current.tokens.to_vec::<i32>()?[0] as u32;
                    if continues {
                        g.fed.push(id);
                        g.snapshot_generated();
                    }
                    if g.draft.is_some() {
                        g.record_depth(ctx, 0, 0);
                    }
                    let logprob = g.logprob(&current)?;
                    Some(g.emit(ctx, id, logprob))
                }
                Piece::Verify(proposal) => {
                    let k = proposal.k;
                    let h = h.ok_or_else(|| {
                        GenerateError::BadRequest("a verify block without hidden states".into())
                    })?;
                    let verdict = verdict.ok_or_else(|| {
                        GenerateError::BadRequest("a verify block without a verdict".into())
                    })??;
                    let accepted = g.settle_round(ctx, *proposal, verdict, &h)?;
                    g.record_depth(ctx, k, accepted);
                    g.ready.pop_front()
                }
                Piece::Prefill { .. } | Piece::Draft(_) | Piece::Skip => None,
            })
        };
        events.push(finish_row());
    }
    if let (Some(k), Some((_, c))) = (priced, &mut ctx.draft) {
        if !unpriced && own_deepest <= k {
            c.record_cost(k, started.elapsed().as_secs_f64());
        }
    }
    Ok(BatchStep {
        events,
        rows: rows_fed,
        tokens: tokens_fed,
    })
}
