//! One sequence's generation: its caches, the tokens they hold, its pending token, its drafting
//! state and grammar, and what it has emitted. Everything here is per sequence; the model, the
//! drafter and the sampler are passed in ([`Ctx`]: the engine owns them), and the batched work
//! of a step (one forward pass for many sequences) is [`crate::step`]'s, which calls into a
//! generation for each row's part. It deals in token ids only: text is [`crate::text`]'s job,
//! off the engine thread.
//!
//! Decoding is pipelined: a step dispatches the next token's computation before the current
//! token is read, so the device never waits on the host.

use crate::depth::DepthController;
use crate::round::{Proposal, Verdict};
use base::protocol::{DoneReason, Stats};
use cache::prefix::CacheCheckpoint;
use cache::LayerCache;
use mlx::Array;
use models::draft::{DraftState, Drafter, Observed, RoundEnd};
use models::CausalLm;
use sample::{Options, Sampled, Sampler};
use std::collections::VecDeque;
use std::time::Instant;

#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    /// The request cannot be served as asked (answer 400).
    #[error("{0}")]
    BadRequest(String),
    /// An invariant of the engine did not hold: a bug, not the request's fault (answer 500).
    #[error("internal error: {0}")]
    Internal(String),
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

/// An internal error (see [`GenerateError::Internal`]).
pub(crate) fn internal(what: &str) -> GenerateError {
    GenerateError::Internal(what.into())
}

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
    /// The media in the prompt (images, clips), in order: each one's soft tokens replace its
    /// run of placeholder tokens.
    pub media: Vec<PromptMedia>,
}

impl GenerationParams {
    /// `tokens` (a prefix of this sequence) as the prefix cache keys them: each image's run of
    /// image tokens replaced by its fold value, so that a sequence matches another only where
    /// their images are the same.
    pub fn cache_key(&self, tokens: &[u32]) -> Vec<u32> {
        let mut key = tokens.to_vec();
        for m in &self.media {
            let end = (m.at + m.len).min(key.len());
            if m.at < end {
                key[m.at..end].fill(m.fold);
            }
        }
        key
    }

    /// Where a restored prefix of `cached` tokens must stop so as not to end inside a media
    /// item (an item is encoded whole, in one chunk).
    pub fn restorable(&self, cached: usize) -> usize {
        self.media
            .iter()
            .find(|m| m.at < cached && cached < m.at + m.len)
            .map_or(cached, |m| m.at)
    }
}

/// A media item in a prompt: what its tower takes, where its soft tokens go
/// (`at..at + len`), and what the prefix cache keys its positions by: a hash of its bytes and
/// prepared shape with bit 31 set, so that it is never a token id.
#[derive(Debug, Clone)]
pub struct PromptMedia {
    pub at: usize,
    pub len: usize,
    pub input: std::sync::Arc<models::media::MediaInput>,
    pub fold: u32,
}

/// The borrowed pieces a generation runs on.
pub struct Ctx<'a> {
    pub model: &'a dyn CausalLm,
    pub sampler: &'a mut Sampler,
    /// The drafter and its depth controller, when speculation is on.
    pub draft: Option<(&'a dyn Drafter, &'a mut DepthController)>,
    /// The media towers, for a model that takes images or audio.
    pub towers: Option<&'a models::media::Towers>,
}

impl<'a> Ctx<'a> {
    pub fn new(model: &'a dyn CausalLm, sampler: &'a mut Sampler) -> Ctx<'a> {
        Ctx {
            model,
            sampler,
            draft: None,
            towers: None,
        }
    }

    pub(crate) fn drafter(&self) -> Option<&'a dyn Drafter> {
        self.draft.as_ref().map(|(d, _)| *d)
    }
}

/// A token's logprob and the most likely alternatives, as ids (text is added off-engine).
#[derive(Debug, Clone, PartialEq)]
pub struct RawLogprob {
    pub logprob: f32,
    /// Sorted by logprob, descending.
    pub top: Vec<(u32, f32)>,
}

/// What a request's stream is told.
#[derive(Debug, Clone)]
pub enum Event {
    Token {
        id: u32,
        logprob: Option<RawLogprob>,
    },
    /// Generation ended: EOS (`Stop`), a limit (`Length`) or cancellation.
    Done { reason: DoneReason, stats: Stats },
    /// The request could not be served as asked (an HTTP 400 when nothing was streamed yet).
    Rejected(String),
    /// An error ended the request; the engine goes on serving others.
    Error(String),
}

/// A finished speculative round, for metrics.
#[derive(Debug, Clone, Copy)]
pub struct RoundReport {
    pub depth: usize,
    pub accepted: usize,
}

/// What a finished sequence leaves for the prefix cache.
pub struct Remains {
    /// Every cache: the target's, then the drafter's.
    pub caches: Vec<LayerCache>,
    /// The tokens they hold.
    pub tokens: Vec<u32>,
    /// Snapshots of the rotating caches taken on the way, by position.
    pub snapshots: Vec<(usize, CacheCheckpoint)>,
}

/// The token a sequence sampled last, not yet emitted nor fed.
struct Pending {
    sampled: Sampled,
    /// The target's final hidden state at the position that produced it (drafters that
    /// condition on it read it), `[1, 1, H]`.
    hidden: Option<Array>,
}

pub struct Generation {
    slot: usize,
    params: GenerationParams,
    /// The target model's caches.
    caches: Vec<LayerCache>,
    /// Tokens fed through the target so far (its caches hold exactly these).
    fed: Vec<u32>,
    /// Next prompt position to prefill.
    prefilled: usize,
    generated: usize,
    pending: Option<Pending>,
    /// Drafting state; `None` when this sequence does not draft.
    draft: Option<DraftState>,
    /// Tokens a speculative round produced, handed out one per step.
    ready: VecDeque<Event>,
    started: Instant,
    first_token_at: Option<Instant>,
    stats: Stats,
    finished: bool,
    /// Snapshots taken on the way, by position.
    taken: Vec<(usize, CacheCheckpoint)>,
    /// How many of `taken` a split model's other ranks have been told of.
    reported: usize,
    /// Rounds finished since the engine last asked.
    rounds: Vec<RoundReport>,
    /// A seeded sampling request's own depth controller (reproducible depths); `None`: the
    /// engine's shared one.
    own_depth: Option<DepthController>,
    /// Media items encoded ahead of their chunk, a layer per step (by index in `params.media`),
    /// and the one being encoded.
    encoded: Vec<Option<Array>>,
    encoding: Option<(usize, models::media::Encoding)>,
}

/// The identity in packed forward passes of the sequence in `slot` ([`Generation::seq`]): the
/// slot counted from 1 (0 is a row of one pass only).
pub(crate) fn seq_of(slot: usize) -> u64 {
    slot as u64 + 1
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
        if let Some(d) = ctx.drafter() {
            let own = d.make_caches(&caches);
            caches.extend(own);
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
            return Err(internal("a cached prefix must leave a token to evaluate"));
        }
        let targets = ctx.model.make_caches().len();
        if caches.len() < targets {
            return Err(internal("fewer caches than the target has layers"));
        }
        let own = caches.split_off(targets);
        for m in &params.media {
            let kind = m.input.kind();
            if !ctx.towers.is_some_and(|t| t.takes(kind)) {
                return Err(GenerateError::BadRequest(format!(
                    "this model does not support {}",
                    match kind {
                        models::MediaKind::Image => "images",
                        models::MediaKind::Audio => "audio",
                    }
                )));
            }
        }
        let draft = ctx.drafter().map(|_| DraftState::new(own, cached));
        let own_depth = match &ctx.draft {
            Some((_, c)) if params.options.seeded_sampling() => Some(c.for_seeded_request()),
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
            reported: 0,
            rounds: Vec::new(),
            encoded: vec![None; params.media.len()],
            encoding: None,
            params,
        })
    }

    /// Every cache (the target's, then the drafter's), the tokens they all hold, and the
    /// snapshots taken on the way (for the prefix cache once the sequence ends). The drafter
    /// first takes in every position it can, so that how much of a sequence later requests can
    /// reuse does not depend on whether its last steps drafted.
    pub fn into_parts(mut self, drafter: Option<&dyn Drafter>) -> Result<Remains> {
        if let (Some(d), Some(state)) = (drafter, &mut self.draft) {
            d.settle(state, &self.fed)?;
        }
        let mut caches = self.caches;
        if let Some(d) = self.draft {
            caches.extend(d.caches);
        }
        Ok(Remains {
            caches,
            tokens: self.params.cache_key(&self.fed),
            snapshots: self.taken,
        })
    }

    /// The sequence's identity in a packed forward pass ([`models::PackedRow::seq`]): its
    /// slot, counted from 1 (0 is a row of one pass only).
    pub fn seq(&self) -> u64 {
        seq_of(self.slot)
    }

    /// Positions of the snapshots taken since the last call: a split model's other ranks take
    /// theirs at the same positions before they replay this sequence's next pass.
    pub(crate) fn unreported_snapshots(&mut self) -> Vec<usize> {
        let new = self.taken[self.reported..]
            .iter()
            .map(|(p, _)| *p)
            .collect();
        self.reported = self.taken.len();
        new
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

    /// Whether its next step (a prefill chunk, a decode step or a speculative round) can share
    /// a forward pass with other sequences' ([`crate::step`]): nothing queued, something to
    /// feed.
    pub fn batchable(&self) -> bool {
        !self.finished && self.ready.is_empty() && (self.prefilling() || self.pending.is_some())
    }

    /// Whether it holds tokens a round produced that are not handed out yet.
    pub fn has_ready(&self) -> bool {
        !self.ready.is_empty()
    }

    /// The next token a round produced, or its end.
    pub(crate) fn pop_ready(&mut self) -> Option<Event> {
        self.ready.pop_front()
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
        // Alone, a sequence encodes its media inside its chunk's step (no one waits).
        let step = crate::step::run(ctx, &mut [self], budget, std::time::Duration::ZERO)?;
        step.events.into_iter().next().unwrap_or(Ok(None))
    }

    /// Ends early (the client went away, or a stop string was seen off-engine).
    pub fn cancel(&mut self, ctx: &mut Ctx<'_>) -> Event {
        // A dispatched but unread token may still be computing; wait for it so no graph
        // outlives the caches it writes.
        if let Some(p) = &self.pending {
            let _ = p.sampled.tokens.eval();
        }
        self.ready.clear();
        self.finish(ctx, DoneReason::ConnectionClosed)
    }

    fn finish(&mut self, ctx: &mut Ctx<'_>, reason: DoneReason) -> Event {
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

    // --------------------------------------------------------------------------------------
    // What a step's plan asks of a sequence
    // --------------------------------------------------------------------------------------

    /// Positions its target caches hold.
    pub(crate) fn position(&self) -> usize {
        self.fed.len()
    }

    /// Where the next prefill chunk starts and ends, taking at most `budget` tokens: a chunk
    /// ends where a snapshot is due.
    /// An image is never cut: a chunk that would end inside one ends before it, or, where it
    /// starts there, after it (so a chunk may pass the budget by the rest of one image).
    pub(crate) fn chunk(&self, budget: usize) -> (usize, usize) {
        let at = self.prefilled;
        let n = self.params.prompt.len();
        let end = (at + budget.max(1)).min(n);
        let end = match self.params.checkpoints.iter().find(|&&p| p > at && p < end) {
            Some(&cp) => cp,
            None => end,
        };
        let end = match self
            .params
            .media
            .iter()
            .find(|m| m.at < end && end < m.at + m.len)
        {
            Some(m) if m.at > at => m.at,
            Some(m) => m.at + m.len,
            None => end,
        };
        (at, end)
    }

    /// Whether the prompt holds media.
    pub(crate) fn has_media(&self) -> bool {
        !self.params.media.is_empty()
    }

    /// The first media item in the prompt chunk `start..end` whose soft tokens are not
    /// encoded yet.
    pub(crate) fn unencoded(&self, start: usize, end: usize) -> Option<usize> {
        self.params
            .media
            .iter()
            .enumerate()
            .find(|(i, m)| m.at < end && m.at + m.len > start && self.encoded[*i].is_none())
            .map(|(i, _)| i)
    }

    /// Encodes item `item` a layer at a time, evaluating each, within `budget` or until the
    /// item is done. At least one layer runs; after it, a layer starts only if it would end
    /// within the budget, taking as long as the longest before it (a tower's layers are alike),
    /// so that a step beside other rows' decoding lasts about the budget, not the budget and a
    /// layer more.
    pub(crate) fn encode_some(
        &mut self,
        towers: &models::media::Towers,
        item: usize,
        budget: std::time::Duration,
    ) -> Result<()> {
        let started = Instant::now();
        let mut e = match self.encoding.take() {
            Some((i, e)) if i == item => e,
            _ => towers.begin(&self.params.media[item].input)?,
        };
        let mut longest = std::time::Duration::ZERO;
        loop {
            let layer = Instant::now();
            if !towers.advance(&mut e)? {
                let embeds = towers.finish(e)?;
                embeds.eval()?;
                self.encoded[item] = Some(embeds);
                return Ok(());
            }
            longest = longest.max(layer.elapsed());
            if started.elapsed() + longest > budget {
                self.encoding = Some((item, e));
                return Ok(());
            }
        }
    }

    /// The media whose soft tokens lie in the prompt chunk `start..end`, encoded (here, unless
    /// earlier steps did), placed relative to the chunk (items are never cut by a chunk).
    pub(crate) fn media_spans(
        &mut self,
        towers: Option<&models::media::Towers>,
        start: usize,
        end: usize,
    ) -> Result<Vec<models::MediaSpan>> {
        let mut spans = Vec::new();
        for (i, m) in self.params.media.iter().enumerate() {
            if m.at + m.len <= start || m.at >= end {
                continue;
            }
            if m.at < start || m.at + m.len > end {
                return Err(internal("a prefill chunk cuts a media item"));
            }
            let embeds = match self.encoded[i].take() {
                Some(e) => e,
                None => {
                    let towers = towers.ok_or_else(|| internal("media without a tower"))?;
                    // An encoding begun in earlier steps (the row shared them then) is
                    // finished rather than started again.
                    match self.encoding.take() {
                        Some((j, e)) if j == i => towers.finish(e)?,
                        other => {
                            self.encoding = other;
                            towers.encode(&m.input)?
                        }
                    }
                }
            };
            if embeds.dim(0)? as usize != m.len {
                return Err(internal(
                    "a tower's soft tokens do not fill their placeholders",
                ));
            }
            spans.push(models::MediaSpan {
                at: m.at - start,
                embeds,
                kind: m.input.kind(),
            });
        }
        Ok(spans)
    }

    pub(crate) fn prompt(&self, start: usize, end: usize) -> &[u32] {
        &self.params.prompt[start..end]
    }

    /// Tokens that may still be emitted, counting the pending one.
    fn remaining(&self) -> usize {
        self.params
            .num_predict
            .map_or(usize::MAX, |n| n.saturating_sub(self.generated))
    }

    /// Whether one more token may be fed after the one now pending.
    pub(crate) fn may_continue(&self) -> bool {
        self.remaining() > 1 && self.fed.len() + 1 < self.params.num_ctx
    }

    /// Whether this sequence drafts.
    pub(crate) fn drafting(&self) -> bool {
        self.draft.is_some()
    }

    /// The deepest round this sequence may draft now (0: none, or no drafter), after keeping
    /// its drafter's state up.
    pub(crate) fn depth_limit(&mut self, drafter: Option<&dyn Drafter>) -> usize {
        let (Some(d), Some(state)) = (drafter, &mut self.draft) else {
            return 0;
        };
        if let Err(e) = d.maintain(state, &self.fed) {
            tracing::warn!("drafter maintenance failed, drafting off for this request: {e}");
            self.draft = None;
            return 0;
        }
        // The pending token sits at position fed.len() and each draft one further; a round of
        // depth k feeds up to k + 1 tokens and leaves a new pending token after them, which is
        // emitted too: s + k + 2 tokens in all, never more than the context. Every emitted
        // token counts against num_predict, and a round emits up to depth + 1.
        let s = self.fed.len();
        let by_ctx = (self.params.num_ctx.saturating_sub(2)).saturating_sub(s);
        let by_len = self.remaining().saturating_sub(1);
        by_ctx.min(by_len)
    }

    /// Committed tokens this sequence's drafter has yet to take in.
    pub(crate) fn drafter_lag(&self, drafter: &dyn Drafter) -> usize {
        self.draft
            .as_ref()
            .map_or(0, |st| drafter.lag(st, self.fed.len()))
    }

    /// A seeded request's own choice of depth within `limit`; `None` for a request on the
    /// engine's controller.
    pub(crate) fn own_choice(&mut self, limit: usize) -> Option<usize> {
        self.own_depth.as_mut().map(|c| c.choose(limit))
    }

    /// Whether the depth of this sequence's rounds comes from a controller of its own (a
    /// seeded sampling request), not the engine's.
    pub(crate) fn has_own_depth(&self) -> bool {
        self.own_depth.is_some()
    }

    /// Tells the controller that chose the depth what the round accepted. A controller of its
    /// own is untimed; the engine's is told the step's time once, by the step.
    pub(crate) fn record_depth(&mut self, ctx: &mut Ctx<'_>, depth: usize, accepted: usize) {
        if let Some(c) = &mut self.own_depth {
            c.record(depth, accepted, 0.0);
        } else if let Some((_, c)) = &mut ctx.draft {
            c.record_acceptance(depth, accepted);
        }
    }

    // --------------------------------------------------------------------------------------
    // The forward pass's parts
    // --------------------------------------------------------------------------------------

    pub(crate) fn caches(&self) -> &[LayerCache] {
        &self.caches
    }

    pub(crate) fn caches_mut(&mut self) -> &mut Vec<LayerCache> {
        &mut self.caches
    }

    pub(crate) fn committed(&self) -> &[u32] {
        &self.fed
    }

    /// Takes the pending token to feed it.
    pub(crate) fn take_pending(&mut self) -> Result<Sampled> {
        self.pending
            .take()
            .map(|p| p.sampled)
            .ok_or_else(|| internal("a decoding sequence without a pending token"))
    }

    /// Takes what a drafting round starts from: the pending token, the target's hidden state
    /// that produced it, and the drafting state.
    pub(crate) fn take_for_round(&mut self) -> Result<(Sampled, Option<Array>, DraftState)> {
        let (Some(p), Some(state)) = (self.pending.take(), self.draft.take()) else {
            return Err(internal(
                "a speculative round needs a pending token and a drafting state",
            ));
        };
        Ok((p.sampled, p.hidden, state))
    }

    /// Gives back what [`Generation::take_for_round`] took, for a round that drafted nothing:
    /// the sequence decodes its pending token plainly instead.
    pub(crate) fn untake_round(
        &mut self,
        sampled: Sampled,
        hidden: Option<Array>,
        state: DraftState,
    ) {
        self.pending = Some(Pending { sampled, hidden });
        self.draft = Some(state);
    }

    /// The grammar, taken for drafting (the drafts are drawn under it), and the EOS ids.
    pub(crate) fn take_grammar(&mut self) -> Option<Box<grammar::Constraint>> {
        self.params.constraint.take()
    }

    pub(crate) fn restore_grammar(&mut self, g: Option<Box<grammar::Constraint>>) {
        self.params.constraint = g;
    }

    pub(crate) fn eos(&self) -> &[u32] {
        &self.params.eos
    }

    pub(crate) fn has_grammar(&self) -> bool {
        self.params.constraint.is_some()
    }

    /// The prefill chunk `start..end` went through the target, its final hidden states
    /// `hidden` (`[1, l, H]`): the drafter follows, the snapshot due there is taken. Returns
    /// whether the chunk ended the prompt (its last position then samples the first token).
    pub(crate) fn prefilled(
        &mut self,
        drafter: Option<&dyn Drafter>,
        end: usize,
        hidden: &Array,
    ) -> Result<bool> {
        let chunk = &self.params.prompt[self.prefilled..end];
        self.fed.extend_from_slice(chunk);
        self.prefilled = end;
        if let (Some(d), Some(state)) = (drafter, &mut self.draft) {
            d.observe(
                state,
                Observed::Prefill {
                    committed: &self.fed,
                    hidden,
                },
            )?;
        }
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
        Ok(last)
    }

    /// A plain decode step fed the pending token; `hidden` is its final hidden state.
    pub(crate) fn decoded(&mut self, drafter: Option<&dyn Drafter>, hidden: &Array) -> Result<()> {
        if let (Some(d), Some(state)) = (drafter, &mut self.draft) {
            d.observe(state, Observed::Decode { hidden })?;
        }
        Ok(())
    }

    /// Structured output: the additive logit bias (0 allowed, −∞ not) for the token this step
    /// samples, having taken in the token this step feeds (`fed`: none after the prompt);
    /// `None` without a constraint.
    pub(crate) fn grammar_bias(
        &mut self,
        fed: Option<&Sampled>,
        width: usize,
    ) -> Result<Option<Vec<f32>>> {
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
    fn grammar_take(&mut self, id: u32) -> Result<bool> {
        if self.params.eos.contains(&id) {
            return Ok(false);
        }
        if let Some(c) = self.params.constraint.as_mut() {
            c.consume(id)?;
        }
        Ok(true)
    }

    /// The tokens the grammar allows next; `None` without a constraint.
    fn grammar_allowed(&mut self) -> Result<Option<grammar::Allowed>> {
        match self.params.constraint.as_mut() {
            Some(c) => Ok(Some(c.allowed()?)),
            None => Ok(None),
        }
    }

    /// The token sampled at this sequence's last position, and that position's hidden state.
    pub(crate) fn set_pending(&mut self, sampled: Sampled, hidden: Array) {
        self.pending = Some(Pending {
            sampled,
            hidden: Some(hidden),
        });
    }

    // --------------------------------------------------------------------------------------
    // Settling a step: what each row emits
    // --------------------------------------------------------------------------------------

    /// A plain decode step's end, its fed token `current` now evaluated: commit and emit it.
    /// `planned` is the depth of the round the step was planned as when its drafter found
    /// nothing to propose: the controller hears a round that got no draft accepted, so that a
    /// drafter that seldom finds anything (a lookup over text with no repeats) is asked less.
    pub(crate) fn settle_decode(
        &mut self,
        ctx: &mut Ctx<'_>,
        current: &Sampled,
        continues: bool,
        planned: usize,
    ) -> Result<Event> {
        let id = current.tokens.to_vec::<i32>()?[0] as u32;
        if continues {
            self.fed.push(id);
            self.snapshot_generated();
        }
        if self.draft.is_some() {
            self.record_depth(ctx, planned, 0);
        }
        let logprob = self.logprob(current)?;
        Ok(self.emit(ctx, id, logprob))
    }

    /// A round's second half, given its [`Verdict`] (evaluated) and the target's hidden
    /// states `[1, k+1, H]` over the block (its caches advanced by it): rewind, commit, emit.
    /// Returns how many drafts were accepted; the tokens go to [`Generation::pop_ready`].
    pub(crate) fn settle_round(
        &mut self,
        ctx: &mut Ctx<'_>,
        proposal: Proposal,
        verdict: &Verdict,
        hidden: &Array,
    ) -> Result<usize> {
        let drafter = ctx
            .drafter()
            .ok_or_else(|| internal("a round without a drafter"))?;
        let Proposal {
            current,
            drafts,
            k,
            mut state,
            start: s,
            ..
        } = proposal;
        let o = verdict.read(&drafts)?;
        let (cur_id, d, n) = (o.current, o.drafts, o.accepted);
        // The grammar took in the pending token when the drafts were made; now the accepted
        // drafts (`next` is taken in when it is fed). Nothing after an EOS pending token: the
        // sequence ends at it.
        if self.params.constraint.is_some() && !self.params.eos.contains(&cur_id) {
            for &t in &d[..n] {
                if !self.grammar_take(t)? {
                    break;
                }
            }
        }

        // Keep exactly [current, d1..dn] in the target; the drafter follows.
        for c in &mut self.caches {
            c.rewind(k - n)?;
        }
        self.fed.push(cur_id);
        self.fed.extend_from_slice(&d[..n]);
        let kept = hidden.slice_axis(1, 0, Some(n as i32 + 1))?;
        drafter.accept(
            &mut state,
            &RoundEnd {
                start: s,
                depth: k,
                accepted: n,
                hidden: &kept,
            },
        )?;
        self.draft = Some(state);
        self.snapshot_generated();
        let mut commit: Vec<u32> = d[..n].to_vec();
        commit.push(o.next);
        ctx.sampler.commit(self.slot, &commit)?;
        self.stats.draft_tokens += k;
        self.stats.draft_accepted += n;
        self.rounds.push(RoundReport {
            depth: k,
            accepted: n,
        });

        // Emit current and the accepted drafts; `next` becomes the pending token.
        let mut logprobs = vec![self.logprob(&current)?];
        for (j, &t) in d[..n].iter().enumerate() {
            logprobs.push(match verdict.row(t, j, true)? {
                Some(row) => self.logprob(&row)?,
                None => None,
            });
        }
        for (i, (&id, logprob)) in std::iter::once(&cur_id)
            .chain(&d[..n])
            .zip(logprobs)
            .enumerate()
        {
            let e = self.emit(ctx, id, logprob);
            let done = matches!(e, Event::Done { .. });
            self.ready.push_back(e);
            if done {
                // Nothing after an EOS is kept.
                let extra = n - i;
                for c in &mut self.caches {
                    c.rewind(extra.min(c.offset()))?;
                }
                self.fed.truncate(s + i + 1);
                return Ok(n);
            }
        }
        if self.remaining() > 0 {
            let sampled = match verdict.row(o.next, n, n == k)? {
                Some(row) => row,
                None => Sampled {
                    tokens: Array::from_slice(&[o.next as i32], &[1])?,
                    logprobs: None,
                    top: None,
                },
            };
            self.pending = Some(Pending {
                sampled,
                hidden: Some(hidden.slice_axis(1, n as i32, Some(n as i32 + 1))?),
            });
        }
        Ok(n)
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
    fn emit(&mut self, ctx: &mut Ctx<'_>, id: u32, logprob: Option<RawLogprob>) -> Event {
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

    /// Snapshots the rotating caches once the tokens fed pass the next multiple of
    /// `snapshot_every`, at the multiple: copies of caches past it (a speculative round that
    /// crossed it; the target, where a separate drafter trails it) are rewound to it, which a
    /// round's batched write keeps the tokens for. So snapshots sit where the disk tier's
    /// blocks end. A cache not there yet (a drafter still trailing) puts it off to a later
    /// step; one that cannot be rewound that far takes it where every cache is, if they agree.
    fn snapshot_generated(&mut self) {
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
}
